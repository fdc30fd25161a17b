//! The project's control plane's etcd, reached through its JSON gateway.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Compacts the etcd of the control plane in `dir` physically at its current revision.
pub(super) async fn compact(dir: &std::path::Path) {
    let port = std::fs::read_to_string(dir.join("etcd-port"))
        .unwrap_or_else(|e| panic!("{}/etcd-port: {e}", dir.display()));
    let etcd = format!("127.0.0.1:{}", port.trim());
    // Any key's range answer carries the store's current revision in its header.
    let range = gateway(&etcd, "/v3/kv/range", r#"{"key":"AA=="}"#).await;
    let revision = range["header"]["revision"]
        .as_str()
        .unwrap_or_else(|| panic!("etcd's range answer has no revision: {range}"))
        .to_string();
    let body = serde_json::json!({"revision": revision, "physical": true}).to_string();
    let done = gateway(&etcd, "/v3/kv/compaction", &body).await;
    assert!(done.get("header").is_some(), "etcd's compaction: {done}");
}

/// POSTs `body` to etcd's JSON gateway at `addr` (`/v3/kv/...`) over plain HTTP/1.1 and returns
/// the answer's JSON; panics on any failure (the control plane is the test's own).
async fn gateway(addr: &str, path: &str, body: &str) -> serde_json::Value {
    let mut conn = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connecting to etcd at {addr}: {e}"));
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("writing to etcd at {addr}: {e}"));
    let mut answer = String::new();
    conn.read_to_string(&mut answer)
        .await
        .unwrap_or_else(|e| panic!("reading etcd's answer to {path}: {e}"));
    let (head, payload) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("etcd's answer to {path} has no body: {answer}"));
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "etcd answered {path} with {head}"
    );
    // A chunked body: the JSON is between the first chunk's size line and its end.
    let json = match payload.find('{') {
        Some(start) => &payload[start..payload.rfind('}').map_or(payload.len(), |e| e + 1)],
        None => payload,
    };
    serde_json::from_str(json).unwrap_or_else(|e| panic!("etcd's answer to {path}: {e}: {payload}"))
}
