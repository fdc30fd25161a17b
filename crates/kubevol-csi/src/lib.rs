//! CSI v1 and the kubelet's plugin registration API over gRPC on unix sockets.
//!
//! The message types, clients and server traits are generated at build time from
//! `proto/csi.proto` and `proto/pluginregistration.proto`. [`connect`] dials a unix socket
//! endpoint; [`serve`] serves services on one.

#![allow(missing_docs)]

/// CSI v1 (`csi.v1`).
pub mod v1 {
    tonic::include_proto!("csi.v1");
}

/// The kubelet plugin registration API, v1 (`pluginregistration`).
pub mod registration {
    tonic::include_proto!("pluginregistration");
}

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// The socket path of an endpoint: `unix:///path.sock`, `unix:/path.sock` or a bare absolute
/// path. Anything else (tcp) is refused: drivers on a node listen on unix sockets.
pub fn socket_path(endpoint: &str) -> Result<PathBuf, String> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if path.starts_with('/') {
        Ok(PathBuf::from(path))
    } else {
        Err(format!(
            "endpoint {endpoint:?} is not a unix socket: write unix:///absolute/path.sock"
        ))
    }
}

/// A channel to a unix socket. It connects lazily and again after each failure, so a driver
/// that restarts (a new socket at the same path) is reached by the next call without a new
/// channel; calls while nothing listens fail with `Unavailable`.
pub fn connect(path: &Path) -> Channel {
    let path = path.to_path_buf();
    // The URI is required by the transport but never resolved: the connector dials the socket.
    Endpoint::from_static("http://[::1]:1").connect_with_connector_lazy(tower::service_fn(
        move |_| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        },
    ))
}

/// Binds a unix socket for a gRPC server, replacing a stale socket file left by a previous run
/// (but never a file that is not a socket).
pub fn bind(path: &Path) -> std::io::Result<tokio_stream::wrappers::UnixListenerStream> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    Ok(tokio_stream::wrappers::UnixListenerStream::new(listener))
}

/// The CSI versions kubevol speaks, as the registration API lists them.
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            socket_path("unix:///run/csi.sock").unwrap(),
            PathBuf::from("/run/csi.sock")
        );
        assert_eq!(
            socket_path("unix:/run/csi.sock").unwrap(),
            PathBuf::from("/run/csi.sock")
        );
        assert_eq!(
            socket_path("/run/csi.sock").unwrap(),
            PathBuf::from("/run/csi.sock")
        );
        assert!(socket_path("tcp://127.0.0.1:10000").is_err());
        assert!(socket_path("csi.sock").is_err());
    }
}
