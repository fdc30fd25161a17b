//! The key pair of a pod certificate, made on the node, and the stub PKCS#10 request that
//! carries its public key to the signer.
//!
//! The request is empty but for the key, signed with it, as the kubelet makes it: subject and
//! attributes empty, the signature `sha256WithRSAEncryption` (RSA), `ecdsa-with-SHA256`,
//! `-SHA384` or `-SHA512` (P-256, P-384, P-521) or `Ed25519`. The API server checks that
//! signature when the request is created. The private key is written as PKCS#8 (`PRIVATE
//! KEY`), what every TLS library reads.

use base64::Engine as _;
use ring::signature::{self as ring_sig, KeyPair as _};

/// A key type the API allows (`keyType` of a `podCertificate` source).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyType {
    /// RSA, 3072-bit modulus.
    Rsa3072,
    /// RSA, 4096-bit modulus.
    Rsa4096,
    /// ECDSA on P-256.
    EcdsaP256,
    /// ECDSA on P-384.
    EcdsaP384,
    /// ECDSA on P-521.
    EcdsaP521,
    /// Ed25519.
    Ed25519,
}

impl KeyType {
    /// The key type a source names, or `None` for one the API does not allow.
    pub fn parse(name: &str) -> Option<KeyType> {
        Some(match name {
            "RSA3072" => KeyType::Rsa3072,
            "RSA4096" => KeyType::Rsa4096,
            "ECDSAP256" => KeyType::EcdsaP256,
            "ECDSAP384" => KeyType::EcdsaP384,
            "ECDSAP521" => KeyType::EcdsaP521,
            "ED25519" => KeyType::Ed25519,
            _ => return None,
        })
    }
}

/// A new private key and the request for its certificate.
pub struct KeyPair {
    /// The private key, PKCS#8 in one `PRIVATE KEY` PEM block.
    pub key_pem: Vec<u8>,
    /// The stub PKCS#10 request (DER).
    pub request_der: Vec<u8>,
}

/// A DER element: `tag`, the length, `content`.
fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        out.push(0x80 | (bytes.len() - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
    out.extend_from_slice(content);
    out
}

/// A DER SEQUENCE of `parts`.
fn sequence(parts: &[&[u8]]) -> Vec<u8> {
    tlv(0x30, &parts.concat())
}

/// A DER BIT STRING of whole bytes.
fn bit_string(bytes: &[u8]) -> Vec<u8> {
    tlv(0x03, &[&[0u8][..], bytes].concat())
}

/// Encoded object identifiers (tag and length included).
mod oid {
    /// id-ecPublicKey, 1.2.840.10045.2.1.
    pub const EC_PUBLIC_KEY: &[u8] = &[0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
    /// prime256v1, 1.2.840.10045.3.1.7.
    pub const P256: &[u8] = &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
    /// secp384r1, 1.3.132.0.34.
    pub const P384: &[u8] = &[0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22];
    /// id-Ed25519, 1.3.101.112.
    pub const ED25519: &[u8] = &[0x06, 0x03, 0x2b, 0x65, 0x70];
    /// sha256WithRSAEncryption, 1.2.840.113549.1.1.11.
    pub const SHA256_WITH_RSA: &[u8] = &[
        0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0b,
    ];
    /// ecdsa-with-SHA256, 1.2.840.10045.4.3.2.
    pub const ECDSA_SHA256: &[u8] = &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x02];
    /// ecdsa-with-SHA384, 1.2.840.10045.4.3.3.
    pub const ECDSA_SHA384: &[u8] = &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x03];
    /// ecdsa-with-SHA512, 1.2.840.10045.4.3.4.
    pub const ECDSA_SHA512: &[u8] = &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x04];
}

/// A DER NULL (the parameters of an RSA signature algorithm).
const NULL: &[u8] = &[0x05, 0x00];

/// `der` as one PEM block of `label`, in lines of 64 characters.
pub fn pem(label: &str, der: &[u8]) -> Vec<u8> {
    let text = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in text.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out.into_bytes()
}

/// Signs the request's bytes once.
type SignOnce = Box<dyn FnOnce(&[u8]) -> Result<Vec<u8>, String>>;

/// What a key type signs a request with: its public key info, its private key (PKCS#8 DER),
/// the signature algorithm, and the signing itself.
struct Signer {
    spki: Vec<u8>,
    pkcs8: Vec<u8>,
    algorithm: Vec<u8>,
    sign: SignOnce,
}

fn failed(what: &str) -> impl Fn(ring::error::Unspecified) -> String + '_ {
    move |_| format!("cannot {what}")
}

fn ring_ecdsa(
    signing: &'static ring_sig::EcdsaSigningAlgorithm,
    curve: &[u8],
    algorithm: &[u8],
) -> Result<Signer, String> {
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = ring_sig::EcdsaKeyPair::generate_pkcs8(signing, &rng)
        .map_err(failed("make an ECDSA key"))?;
    let pair = ring_sig::EcdsaKeyPair::from_pkcs8(signing, pkcs8.as_ref(), &rng)
        .map_err(|e| format!("cannot read the new ECDSA key: {e}"))?;
    let spki = sequence(&[
        &sequence(&[oid::EC_PUBLIC_KEY, curve]),
        &bit_string(pair.public_key().as_ref()),
    ]);
    Ok(Signer {
        spki,
        pkcs8: pkcs8.as_ref().to_vec(),
        algorithm: sequence(&[algorithm]),
        sign: Box::new(move |tbs| {
            pair.sign(&rng, tbs)
                .map(|s| s.as_ref().to_vec())
                .map_err(failed("sign with the ECDSA key"))
        }),
    })
}

fn ed25519() -> Result<Signer, String> {
    let rng = ring::rand::SystemRandom::new();
    let doc =
        ring_sig::Ed25519KeyPair::generate_pkcs8(&rng).map_err(failed("make an Ed25519 key"))?;
    let pair = ring_sig::Ed25519KeyPair::from_pkcs8(doc.as_ref())
        .map_err(|e| format!("cannot read the new Ed25519 key: {e}"))?;
    // ring writes PKCS#8 v2 (with the public key); the seed is the 32 bytes after the
    // algorithm's OCTET STRING header. Written as v1, as other tools write it.
    let seed = doc
        .as_ref()
        .get(16..48)
        .ok_or("the new Ed25519 key is too short")?;
    let pkcs8 = sequence(&[
        &[0x02, 0x01, 0x00],
        &sequence(&[oid::ED25519]),
        &tlv(0x04, &tlv(0x04, seed)),
    ]);
    let spki = sequence(&[
        &sequence(&[oid::ED25519]),
        &bit_string(pair.public_key().as_ref()),
    ]);
    Ok(Signer {
        spki,
        pkcs8,
        algorithm: sequence(&[oid::ED25519]),
        sign: Box::new(move |tbs| Ok(pair.sign(tbs).as_ref().to_vec())),
    })
}

fn rsa(bits: usize) -> Result<Signer, String> {
    use rsa::pkcs8::{EncodePrivateKey as _, EncodePublicKey as _};
    use rsa::signature::{SignatureEncoding as _, Signer as _};
    let key = rsa::PrivateKey::new(&mut getrandom::SysRng, bits)
        .map_err(|e| format!("cannot make an RSA key: {e}"))?;
    let pkcs8 = key
        .to_pkcs8_der()
        .map_err(|e| format!("cannot encode the RSA key: {e}"))?;
    let spki = key
        .to_public_key()
        .to_public_key_der()
        .map_err(|e| format!("cannot encode the RSA public key: {e}"))?;
    let signer = rsa::pkcs1v15::SigningKey::<rsa::sha2::Sha256>::new(key);
    Ok(Signer {
        spki: spki.as_bytes().to_vec(),
        pkcs8: pkcs8.as_bytes().to_vec(),
        algorithm: sequence(&[oid::SHA256_WITH_RSA, NULL]),
        sign: Box::new(move |tbs| {
            signer
                .try_sign(tbs)
                .map(|s| s.to_vec())
                .map_err(|e| format!("cannot sign with the RSA key: {e}"))
        }),
    })
}

fn p521() -> Result<Signer, String> {
    use p521::elliptic_curve::Generate as _;
    use p521::pkcs8::{EncodePrivateKey as _, EncodePublicKey as _};
    use rsa::signature::{SignatureEncoding as _, Signer as _};
    let key = p521::ecdsa::SigningKey::try_generate()
        .map_err(|e| format!("cannot make a P-521 key: {e}"))?;
    let secret = p521::SecretKey::from(key.as_nonzero_scalar());
    let pkcs8 = secret
        .to_pkcs8_der()
        .map_err(|e| format!("cannot encode the P-521 key: {e}"))?;
    let spki = secret
        .public_key()
        .to_public_key_der()
        .map_err(|e| format!("cannot encode the P-521 public key: {e}"))?;
    Ok(Signer {
        spki: spki.as_bytes().to_vec(),
        pkcs8: pkcs8.as_bytes().to_vec(),
        algorithm: sequence(&[oid::ECDSA_SHA512]),
        sign: Box::new(move |tbs| {
            let signature: p521::ecdsa::DerSignature = key
                .try_sign(tbs)
                .map_err(|e| format!("cannot sign with the P-521 key: {e}"))?;
            Ok(signature.to_vec())
        }),
    })
}

/// A new key of `kind` and its stub request. RSA keys take a while (a search for primes):
/// call it off the async threads.
pub fn generate(kind: KeyType) -> Result<KeyPair, String> {
    let signer = match kind {
        KeyType::Rsa3072 => rsa(3072)?,
        KeyType::Rsa4096 => rsa(4096)?,
        KeyType::EcdsaP256 => ring_ecdsa(
            &ring_sig::ECDSA_P256_SHA256_ASN1_SIGNING,
            oid::P256,
            oid::ECDSA_SHA256,
        )?,
        KeyType::EcdsaP384 => ring_ecdsa(
            &ring_sig::ECDSA_P384_SHA384_ASN1_SIGNING,
            oid::P384,
            oid::ECDSA_SHA384,
        )?,
        KeyType::EcdsaP521 => p521()?,
        KeyType::Ed25519 => ed25519()?,
    };
    // CertificationRequestInfo: version 0, an empty subject, the key, no attributes.
    let info = sequence(&[
        &[0x02, 0x01, 0x00],
        &[0x30, 0x00],
        &signer.spki,
        &[0xa0, 0x00],
    ]);
    let signature = (signer.sign)(&info)?;
    let request_der = sequence(&[&info, &signer.algorithm, &bit_string(&signature)]);
    Ok(KeyPair {
        key_pem: pem("PRIVATE KEY", &signer.pkcs8),
        request_der,
    })
}

/// The certificates of a PEM chain, each re-encoded as a `CERTIFICATE` block: text between
/// blocks and headers inside them are dropped, as the kubelet writes a chain.
pub fn clean_chain(chain: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let mut body: Option<String> = None;
    for line in chain.lines() {
        let line = line.trim();
        if line.starts_with("-----BEGIN ") && line.ends_with("-----") {
            body = Some(String::new());
        } else if line.starts_with("-----END ") && line.ends_with("-----") {
            let Some(text) = body.take() else { continue };
            if let Ok(der) = base64::engine::general_purpose::STANDARD.decode(text) {
                out.extend(pem("CERTIFICATE", &der));
            }
        } else if let Some(text) = body.as_mut() {
            // A header (`Proc-Type: ...`) is not base64.
            if !line.contains(':') {
                text.push_str(line);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn der_lengths_use_the_short_and_long_forms() {
        assert_eq!(tlv(0x04, &[1, 2]), [0x04, 0x02, 1, 2]);
        let long = tlv(0x04, &[0; 200]);
        assert_eq!(long[..3], [0x04, 0x81, 200]);
        let longer = tlv(0x04, &[0; 300]);
        assert_eq!(longer[..4], [0x04, 0x82, 0x01, 0x2c]);
    }

    #[test]
    fn a_chain_is_cleaned_to_certificate_blocks() {
        let chain = "junk\n-----BEGIN CERTIFICATE-----\nAAEC\n-----END CERTIFICATE-----\nmore\n-----BEGIN TRUSTED CERTIFICATE-----\nProc-Type: 4,ENCRYPTED\n\nAwQF\n-----END TRUSTED CERTIFICATE-----\n";
        assert_eq!(
            String::from_utf8(clean_chain(chain)).unwrap(),
            "-----BEGIN CERTIFICATE-----\nAAEC\n-----END CERTIFICATE-----\n-----BEGIN CERTIFICATE-----\nAwQF\n-----END CERTIFICATE-----\n"
        );
    }

    fn openssl(args: &[&str], input: &[u8]) -> (bool, String) {
        use std::io::Write as _;
        let mut child = std::process::Command::new("openssl")
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("openssl runs (the test command installs it)");
        child.stdin.take().unwrap().write_all(input).unwrap();
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }

    /// Every key type makes a request whose signature an independent implementation (OpenSSL)
    /// verifies, for the key written beside it, of the size the API asks.
    #[test]
    fn every_key_type_makes_a_request_signed_with_the_written_key() {
        let rows = [
            (
                "RSA3072",
                "Public-Key: (3072 bit)",
                "sha256WithRSAEncryption",
            ),
            (
                "RSA4096",
                "Public-Key: (4096 bit)",
                "sha256WithRSAEncryption",
            ),
            ("ECDSAP256", "NIST CURVE: P-256", "ecdsa-with-SHA256"),
            ("ECDSAP384", "NIST CURVE: P-384", "ecdsa-with-SHA384"),
            ("ECDSAP521", "NIST CURVE: P-521", "ecdsa-with-SHA512"),
            ("ED25519", "ED25519 Public-Key", "ED25519"),
        ];
        assert_eq!(KeyType::parse("RSA2048"), None);
        for (name, key_text, algorithm) in rows {
            let kind = KeyType::parse(name).unwrap();
            let pair = generate(kind).unwrap();
            let (ok, text) = openssl(
                &["req", "-inform", "DER", "-verify", "-noout", "-text"],
                &pair.request_der,
            );
            assert!(ok, "{name}: {text}");
            assert!(
                text.contains("verify OK")
                    || text.contains("Certificate request self-signature verify OK"),
                "{name}: {text}"
            );
            assert!(text.contains(key_text), "{name}: {text}");
            assert!(
                text.contains(&format!("Signature Algorithm: {algorithm}")),
                "{name}: {text}"
            );
            assert!(text.contains("Attributes:"), "{name}: {text}");
            // The written key is the request's.
            let (ok, from_key) = openssl(&["pkey", "-pubout"], &pair.key_pem);
            assert!(ok, "{name}: {from_key}");
            let (ok, from_request) = openssl(
                &["req", "-inform", "DER", "-pubkey", "-noout"],
                &pair.request_der,
            );
            assert!(ok, "{name}: {from_request}");
            assert_eq!(from_key, from_request, "{name}");
            let pem = String::from_utf8(pair.key_pem).unwrap();
            assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----\n"), "{name}");
        }
    }
}
