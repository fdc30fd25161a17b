//! The parsers of `kubevol run`'s flags: sizes, durations, labels and CSI endpoints, each
//! with a message that says what to write.

use std::path::PathBuf;
use std::time::Duration;

/// Parses a size in bytes: `8388608`, `512Ki`, `8Mi`, `1Gi`.
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let (digits, shift) = match s.trim() {
        t if t.ends_with("Ki") => (&t[..t.len() - 2], 10),
        t if t.ends_with("Mi") => (&t[..t.len() - 2], 20),
        t if t.ends_with("Gi") => (&t[..t.len() - 2], 30),
        t => (t, 0),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?}: write a number of bytes, optionally with Ki, Mi or Gi"))?;
    n.checked_mul(1 << shift)
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?}: must be between 1 byte and 2^64 bytes"))
}

/// Parses KEY=VALUE,KEY=VALUE (labels, as the kubelet's --node-labels).
pub(crate) fn parse_labels(s: &str) -> Result<Vec<(String, String)>, String> {
    s.split(',')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                format!("{kv:?}: write KEY=VALUE (e.g. topology.kubernetes.io/zone=a)")
            })?;
            match kubevol_core::validation::label_error(k, v) {
                Some(e) => Err(e),
                None => Ok((k.to_string(), v.to_string())),
            }
        })
        .collect()
}

/// Parses NAME=unix:///path.sock.
pub(crate) fn parse_endpoint(s: &str) -> Result<(String, PathBuf), String> {
    let (name, endpoint) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: write NAME=unix:///path/to/csi.sock"))?;
    if name.is_empty() {
        return Err(format!("{s:?}: the driver name is empty"));
    }
    Ok((name.to_string(), kubevol_csi::socket_path(endpoint)?))
}

/// Parses `500ms`, `10s`, `2m3s`, `1h`.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = s.trim();
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let n_end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if n_end == 0 {
            return Err(format!("{s:?}: expected a number, e.g. 500ms, 10s, 2m3s"));
        }
        let n: u64 = rest[..n_end].parse().map_err(|e| format!("{s:?}: {e}"))?;
        rest = &rest[n_end..];
        let u_end = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..u_end] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n * 60),
            "h" => Duration::from_secs(n * 3600),
            u => return Err(format!("{s:?}: unknown unit {u:?} (use ms, s, m or h)")),
        };
        total += unit;
        rest = &rest[u_end..];
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m3s").unwrap(), Duration::from_secs(123));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("").is_err());
    }
}
