//! An image volume's source: its reference, in the grammar container registries and runtimes
//! read (`[domain[:port]/]path[:tag][@digest]`, the distribution project's), and its pull
//! policy. The API server checks only that a reference is set and has no surrounding
//! whitespace; kubevol hands the reference to the container runtime (its CRI and OCI forms,
//! `kubevol mounts`), so anything else in it (a newline, an option) must never get that far.

use super::{err, invalid, required, FieldError, FieldErrorKind};

/// The longest repository name (domain and path), as registries take it.
pub const MAX_NAME_LENGTH: usize = 255;

/// The pull policies.
pub const PULL_POLICIES: [&str; 3] = ["Always", "Never", "IfNotPresent"];

/// Why `reference` is not an image reference, or `None` when it is one.
pub fn image_reference_error(reference: &str) -> Option<String> {
    if reference.trim() != reference {
        return Some("must not have leading or trailing whitespace".into());
    }
    let (rest, digest) = match reference.split_once('@') {
        Some((r, d)) => (r, Some(d)),
        None => (reference, None),
    };
    if let Some(d) = digest {
        if let Some(why) = digest_error(d) {
            return Some(why);
        }
    }
    // A tag follows the last ':' after the last '/' (a ':' before it is the domain's port).
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => (&rest[..last_slash + i], Some(&rest[last_slash + i + 1..])),
        None => (rest, None),
    };
    if let Some(t) = tag {
        if !is_tag(t) {
            return Some(format!(
                "tag {t:?} is not a tag: a letter, digit or _, then up to 127 letters, digits, _, . or -"
            ));
        }
    }
    if name.is_empty() {
        return Some("has no repository name".into());
    }
    if name.len() > MAX_NAME_LENGTH {
        return Some(format!(
            "its repository name is {} characters, more than {MAX_NAME_LENGTH}",
            name.len()
        ));
    }
    let mut components = name.split('/');
    let first = components.next().unwrap_or_default();
    let has_path = name.contains('/');
    // As registries tell a domain from a path: a '.' or ':' in it, or `localhost`.
    let is_domain =
        has_path && (first.contains('.') || first.contains(':') || first == "localhost");
    if is_domain {
        if let Some(why) = domain_error(first) {
            return Some(why);
        }
    } else if !is_path_component(first) {
        return Some(path_error(first));
    }
    for c in components {
        if !is_path_component(c) {
            return Some(path_error(c));
        }
    }
    None
}

fn path_error(c: &str) -> String {
    format!(
        "path component {c:?} is not one: lowercase letters and digits, separated by one '.', one or two '_', or '-'s"
    )
}

/// `[a-z0-9]+ ((\.|_|__|-+) [a-z0-9]+)*`
fn is_path_component(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    let mut i = 0;
    loop {
        let start = i;
        while i < b.len() && alnum(b[i]) {
            i += 1;
        }
        if i == start {
            return false;
        }
        if i == b.len() {
            return true;
        }
        let sep = i;
        match b[i] {
            b'.' => i += 1,
            b'_' => {
                i += 1;
                if i < b.len() && b[i] == b'_' {
                    i += 1;
                }
            }
            b'-' => {
                while i < b.len() && b[i] == b'-' {
                    i += 1;
                }
            }
            _ => return false,
        }
        if i == sep || i == b.len() {
            return false;
        }
    }
}

/// `host[:port]`, the host a name of dot-separated `[A-Za-z0-9]` components (`-` inside one)
/// or an IPv6 address in brackets.
fn domain_error(d: &str) -> Option<String> {
    let bad = || {
        Some(format!(
            "domain {d:?} is not a host name or address, with an optional :port"
        ))
    };
    let (host, port) = if let Some(inner) = d.strip_prefix('[') {
        let (addr, after) = inner.split_once(']')?;
        if addr.is_empty()
            || !addr
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return bad();
        }
        match after {
            "" => return None,
            p => (addr, p.strip_prefix(':').map(Some).unwrap_or(Some("x"))),
        }
    } else {
        match d.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (d, None),
        }
    };
    if let Some(p) = port {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return bad();
        }
    }
    if d.starts_with('[') {
        return None;
    }
    let component_ok = |c: &str| {
        let b = c.as_bytes();
        !b.is_empty()
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter().all(|x| x.is_ascii_alphanumeric() || *x == b'-')
    };
    if !host.split('.').all(component_ok) {
        return bad();
    }
    None
}

/// `[\w][\w.-]{0,127}`
fn is_tag(t: &str) -> bool {
    let b = t.as_bytes();
    let word = |x: u8| x.is_ascii_alphanumeric() || x == b'_';
    !b.is_empty()
        && b.len() <= 128
        && word(b[0])
        && b[1..].iter().all(|x| word(*x) || *x == b'.' || *x == b'-')
}

/// `algorithm:hex`, the algorithm `[A-Za-z][A-Za-z0-9]*` components joined by `+`, `.`, `_`
/// or `-`, the hex at least 32 digits.
fn digest_error(d: &str) -> Option<String> {
    let bad = || {
        Some(format!(
            "digest {d:?} is not ALGORITHM:HEX (sha256:<64 hex digits>)"
        ))
    };
    let Some((algorithm, hex)) = d.split_once(':') else {
        return bad();
    };
    let algorithm_ok = algorithm.split(['+', '.', '_', '-']).all(|c| {
        let b = c.as_bytes();
        !b.is_empty() && b[0].is_ascii_alphabetic() && b.iter().all(|x| x.is_ascii_alphanumeric())
    });
    let hex_ok = hex.len() >= 32 && hex.bytes().all(|b| b.is_ascii_hexdigit());
    if !algorithm_ok || !hex_ok {
        return bad();
    }
    if algorithm == "sha256" && hex.len() != 64 {
        return Some(format!("digest {d:?}: a sha256 digest has 64 hex digits"));
    }
    None
}

/// An image volume source's errors (`path` is the field path of `image`).
pub(super) fn validate_image_source(
    source: &k8s_openapi::api::core::v1::ImageVolumeSource,
    path: &str,
    errs: &mut Vec<FieldError>,
) {
    match source.reference.as_deref().unwrap_or_default() {
        "" => errs.push(required(format!("{path}.reference"))),
        r => {
            if let Some(why) = image_reference_error(r) {
                errs.push(invalid(format!("{path}.reference"), r, why));
            }
        }
    }
    if let Some(policy) = source.pull_policy.as_deref() {
        if !PULL_POLICIES.contains(&policy) {
            errs.push(err(
                format!("{path}.pullPolicy"),
                FieldErrorKind::NotSupported {
                    value: policy.into(),
                    allowed: PULL_POLICIES.to_vec(),
                },
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_as_registries_read_them() {
        let sha = format!("sha256:{}", "a".repeat(64));
        for good in [
            "busybox",
            "busybox:1.36",
            "library/busybox:latest",
            "quay.io/x/y:1",
            "localhost:5000/a/b",
            "localhost/a",
            "registry.example.com:443/team/app-name__v2.x:v1.2.3-rc_1",
            "[::1]:5000/a",
            &format!("quay.io/x/y@{sha}"),
            &format!("quay.io/x/y:1@{sha}"),
            "a-b--c.d_e__f",
        ] {
            assert_eq!(image_reference_error(good), None, "{good}");
        }
        for (bad, why) in [
            ("quay.io/x/y:1\n--privileged", "tag"),
            (" busybox", "whitespace"),
            ("busybox\n", "whitespace"),
            ("Busybox", "path component"),
            ("quay.io/x/Y", "path component"),
            ("quay.io//y", "path component"),
            ("a_", "path component"),
            ("a___b", "path component"),
            ("-a", "path component"),
            ("quay.io/x:", "tag"),
            ("quay.io/x:-t", "tag"),
            ("x@sha256:abc", "digest"),
            ("x@sha256:", "digest"),
            ("bad_domain.io:x/y", "domain"),
            ("-bad.io/y", "domain"),
            ("a b", "path component"),
            ("", "repository name"),
            (":tag", "repository name"),
        ] {
            let e = image_reference_error(bad).unwrap_or_else(|| panic!("{bad:?} taken"));
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        let long = format!("quay.io/{}", "a".repeat(10_000));
        assert!(image_reference_error(&long)
            .unwrap()
            .contains("more than 255"));
        let tag = format!("a:{}", "t".repeat(129));
        assert!(image_reference_error(&tag).is_some());
    }

    proptest::proptest! {
        /// Whatever the string, the check ends without a panic, and what it takes has no
        /// whitespace or control character, and a name no longer than the limit.
        #[test]
        fn any_string_is_checked_and_what_passes_is_plain(s in "[ -~\\n\\t\\u{0}-\\u{1f}é]{0,300}") {
            if image_reference_error(&s).is_none() {
                proptest::prop_assert!(!s.chars().any(|c| c.is_whitespace() || c.is_control()), "{:?}", s);
                let name = s.split('@').next().unwrap_or_default();
                proptest::prop_assert!(name.len() <= MAX_NAME_LENGTH + 129, "{:?}", s);
            }
        }
    }
}
