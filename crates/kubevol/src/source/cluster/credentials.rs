//! The node's client certificate, read again when its files change.
//!
//! A node's certificate is rotated by writing a fresh one over the same files (the kubelet's
//! certificate manager does so, and so does an operator's tool): kubeconfig read once at start
//! would keep presenting the old one, and once it expired every request would be refused until
//! a restart. Here the files named by the kubeconfig (`client-certificate`, `client-key`) are
//! looked at again (a `stat` each, at most once a second, when a request is made): when they
//! changed, the TLS configuration is made again from them and the connections made with the
//! old one are dropped, as the kubelet closes its connections when its certificate rotates. A
//! certificate past its `notAfter` is named as such when the server refuses a request.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// How often the files are looked at, at most.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// The client's TLS configuration and where it came from.
pub(super) struct Credentials {
    config: kube::Config,
    /// The certificate and key files, when the kubeconfig names files (not inline data).
    files: Vec<PathBuf>,
    state: Mutex<State>,
}

struct State {
    tls: rustls::ClientConfig,
    /// What the files were when `tls` was made (inode, size, modification time).
    seen: Vec<Option<(u64, u64, i64, i64)>>,
    looked: Instant,
    /// The certificate's `notAfter`.
    not_after: Option<SystemTime>,
}

/// A certificate refused because it expired.
#[derive(Debug, thiserror::Error)]
#[error("the API server refused the node's client certificate {}: it expired at {}; write a fresh certificate and key over the same files (kubevol reads them again without a restart)", path.display(), jiff::Timestamp::try_from(*at).map_or_else(|_| "?".to_string(), |t| t.to_string()))]
pub(super) struct Expired {
    path: PathBuf,
    at: SystemTime,
}

fn stamp(path: &PathBuf) -> Option<(u64, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

impl Credentials {
    pub(super) fn new(config: kube::Config) -> Result<Self, kube::Error> {
        use kube::client::ConfigExt;
        let tls = config.rustls_client_config()?;
        let auth = &config.auth_info;
        let files: Vec<PathBuf> = match (&auth.client_certificate, &auth.client_key) {
            (Some(cert), Some(key))
                if auth.client_certificate_data.is_none() && auth.client_key_data.is_none() =>
            {
                vec![cert.into(), key.into()]
            }
            _ => Vec::new(),
        };
        let not_after = certificate_pem(&config).and_then(|pem| not_after(&pem));
        let seen = files.iter().map(stamp).collect();
        Ok(Credentials {
            config,
            files,
            state: Mutex::new(State {
                tls,
                seen,
                looked: Instant::now(),
                not_after,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The TLS configuration to make a connection with.
    pub(super) fn tls(&self) -> rustls::ClientConfig {
        self.lock().tls.clone()
    }

    /// Looks at the files (at most once a second) and, when they changed, makes the TLS
    /// configuration again from them; says whether it did (connections made before are to
    /// be dropped). Files caught half-written are looked at again a second later.
    pub(super) fn renewed(&self) -> bool {
        use kube::client::ConfigExt;
        if self.files.is_empty() {
            return false;
        }
        let mut state = self.lock();
        if state.looked.elapsed() < LOOK_EVERY {
            return false;
        }
        state.looked = Instant::now();
        let seen: Vec<_> = self.files.iter().map(stamp).collect();
        if seen == state.seen {
            return false;
        }
        match self.config.rustls_client_config() {
            Ok(tls) => {
                state.tls = tls;
                state.seen = seen;
                state.not_after = certificate_pem(&self.config).and_then(|pem| not_after(&pem));
                tracing::info!(
                    certificate = %self.files[0].display(),
                    "the node's client certificate changed: new connections present the new one"
                );
                true
            }
            Err(e) => {
                tracing::warn!(certificate = %self.files[0].display(), "the node's client certificate changed but cannot be read yet: {e}");
                false
            }
        }
    }

    /// Why the server refused a request, when the certificate presented has expired.
    pub(super) fn expired(&self) -> Option<Expired> {
        let at = self.lock().not_after?;
        (at < SystemTime::now()).then(|| Expired {
            path: self
                .files
                .first()
                .cloned()
                .unwrap_or_else(|| PathBuf::from("(kubeconfig client-certificate-data)")),
            at,
        })
    }
}

/// The client certificate's PEM, as the kubeconfig gives it now.
fn certificate_pem(config: &kube::Config) -> Option<Vec<u8>> {
    use base64::Engine as _;
    let auth = &config.auth_info;
    match (&auth.client_certificate_data, &auth.client_certificate) {
        (Some(data), _) => base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .ok(),
        (None, Some(path)) => std::fs::read(path).ok(),
        (None, None) => None,
    }
}

/// The `notAfter` of the first certificate in `pem`.
fn not_after(pem: &[u8]) -> Option<SystemTime> {
    use base64::Engine as _;
    let text = std::str::from_utf8(pem).ok()?;
    let start = text.find("-----BEGIN CERTIFICATE-----")? + "-----BEGIN CERTIFICATE-----".len();
    let end = start + text[start..].find("-----END CERTIFICATE-----")?;
    let b64: String = text[start..end].split_whitespace().collect();
    let der = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    validity_end(&der)
}

/// One DER element at the start of `der`: its tag, its contents, and what follows it.
fn element(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The end of a DER certificate's validity: Certificate → TBSCertificate → [version],
/// serialNumber, signature, issuer, validity → notAfter.
fn validity_end(der: &[u8]) -> Option<SystemTime> {
    let (0x30, certificate, _) = element(der)? else {
        return None;
    };
    let (0x30, tbs, _) = element(certificate)? else {
        return None;
    };
    let mut rest = tbs;
    let (tag, _, after) = element(rest)?;
    if tag == 0xa0 {
        rest = after;
    }
    // serialNumber, signature, issuer.
    for _ in 0..3 {
        rest = element(rest)?.2;
    }
    let (0x30, validity, _) = element(rest)? else {
        return None;
    };
    let (_, after_not_before) = element(validity).map(|(_, _, r)| ((), r))?;
    let (tag, time, _) = element(after_not_before)?;
    let text = std::str::from_utf8(time).ok()?;
    let text = match tag {
        // UTCTime: YYMMDDHHMMSSZ, years 1950 to 2049.
        0x17 if text.len() == 13 => {
            let century = if text[..2] < *"50" { "20" } else { "19" };
            format!("{century}{text}")
        }
        // GeneralizedTime: YYYYMMDDHHMMSSZ.
        0x18 if text.len() == 15 => text.to_string(),
        _ => return None,
    };
    let iso = format!(
        "{}-{}-{}T{}:{}:{}Z",
        &text[0..4],
        &text[4..6],
        &text[6..8],
        &text[8..10],
        &text[10..12],
        &text[12..14]
    );
    let t: jiff::Timestamp = iso.parse().ok()?;
    Some(SystemTime::from(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Certificates made by OpenSSL (`openssl ca -startdate 20261128070000Z -enddate …`), valid
    /// to 2026-11-29T07:00:00Z (a UTCTime) and to 2060-01-01T00:00:00Z (a GeneralizedTime:
    /// years from 2050 on).
    const UTC: &str = include_str!("credentials-utc.pem");
    const GENERALIZED: &str = include_str!("credentials-generalized.pem");

    #[test]
    fn the_end_of_a_certificates_validity_is_read() {
        for (pem, want) in [
            (UTC, "2026-11-29T07:00:00Z"),
            (GENERALIZED, "2060-01-01T00:00:00Z"),
        ] {
            let at = not_after(pem.as_bytes()).expect("notAfter");
            assert_eq!(jiff::Timestamp::try_from(at).unwrap().to_string(), want);
        }
    }

    #[test]
    fn what_is_not_a_certificate_has_no_validity() {
        for junk in [
            &b""[..],
            b"\x30",
            b"\x30\x82\xff\xff",
            b"\x30\x03\x30\x01\x00",
            b"\x30\x84\xff\xff\xff\xff",
        ] {
            assert_eq!(validity_end(junk), None);
        }
        assert_eq!(
            not_after(b"-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n"),
            None
        );
    }
}
