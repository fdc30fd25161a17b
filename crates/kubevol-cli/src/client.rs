//! A minimal HTTP/1.1 GET for `kubevol status`: the daemon listens on loopback and answers
//! small JSON documents, so a plain socket is all that is needed.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{bail, Context};

/// GETs `path` from `server` (`http://host:port`) and returns the body.
pub fn get(server: &str, path: &str) -> anyhow::Result<String> {
    let authority = server
        .strip_prefix("http://")
        .with_context(|| format!("{server}: only http:// servers are supported"))?
        .trim_end_matches('/');
    let mut stream = TcpStream::connect(authority).with_context(|| {
        format!("cannot connect to {server}: is `kubevol run` running with --listen {authority}?")
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nAccept: application/json\r\n\r\n")?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("malformed HTTP answer")?;
    let status = head.lines().next().unwrap_or("");
    if status.split_whitespace().nth(1) != Some("200") {
        bail!("{server}{path}: {status}: {}", body.trim());
    }
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return dechunk(body);
    }
    Ok(body.to_string())
}

fn dechunk(mut body: &str) -> anyhow::Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").context("malformed chunk")?;
        let size = usize::from_str_radix(size.trim(), 16).context("malformed chunk size")?;
        if size == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..size).context("short chunk")?);
        body = rest.get(size + 2..).unwrap_or("");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn dechunks() {
        assert_eq!(
            super::dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n").unwrap(),
            "hello world"
        );
    }
}
