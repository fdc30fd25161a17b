//! A TCP relay between a test's node and the API server, which a test cuts to make an outage
//! (the connections drop and new ones hang) and restores.

use super::*;

/// A TCP relay between the node's clients and the server, which can be cut.
pub(super) struct Relay {
    addr: std::net::SocketAddr,
    pub(super) gate: Arc<Gate>,
    task: tokio::task::JoinHandle<()>,
}

/// Whether the relay is open, and the lock every forwarded chunk is written under: a cut
/// takes it exclusively, so it waits for a write in flight and no write starts after it.
pub(super) struct Gate {
    pub(super) open: watch::Sender<bool>,
    pub(super) writing: tokio::sync::RwLock<()>,
    /// Whether what is sent is dropped, the connections left open (a network that froze).
    pub(super) frozen: std::sync::atomic::AtomicBool,
    /// The node's connections open now.
    pub(super) connections: std::sync::atomic::AtomicUsize,
}

impl Gate {
    /// Copies `from` to `to`, chunk by chunk, while the relay is open.
    async fn pipe(&self, mut from: OwnedReadHalf, mut to: OwnedWriteHalf) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let _writing = self.writing.read().await;
            if !*self.open.borrow() {
                return;
            }
            if self.frozen.load(std::sync::atomic::Ordering::SeqCst) {
                continue;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }
}

impl Relay {
    pub(super) async fn start(upstream: &Uri) -> Relay {
        let host = upstream
            .host()
            .expect("the server's URL has a host")
            .to_string();
        let port = upstream.port_u16().unwrap_or(match upstream.scheme_str() {
            Some("http") => 80,
            _ => 443,
        });
        let target = format!(
            "{}:{port}",
            host.trim_start_matches('[').trim_end_matches(']')
        );
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a relay port");
        let addr = listener.local_addr().expect("the relay's address");
        let gate = Arc::new(Gate {
            open: watch::channel(true).0,
            writing: tokio::sync::RwLock::new(()),
            frozen: Default::default(),
            connections: Default::default(),
        });
        let state = gate.clone();
        let task = tokio::spawn(async move {
            while let Ok((from, _)) = listener.accept().await {
                let mut rx = state.open.subscribe();
                if !*rx.borrow_and_update() {
                    // Cut: the connection is closed at once.
                    continue;
                }
                let target = target.clone();
                let gate = state.clone();
                tokio::spawn(async move {
                    let Ok(to) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let ((from_read, from_write), (to_read, to_write)) =
                        (from.into_split(), to.into_split());
                    gate.connections
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    // Both directions end, and both sockets close, at the cut.
                    tokio::select! {
                        _ = async {
                            tokio::join!(
                                gate.pipe(from_read, to_write),
                                gate.pipe(to_read, from_write)
                            )
                        } => {}
                        _ = rx.wait_for(|open| !*open) => {}
                    }
                    gate.connections
                        .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
        });
        Relay { addr, gate, task }
    }

    /// `config` pointed at the relay, still verifying the server's certificate by its name.
    pub(super) fn config_of(&self, mut config: kube::Config) -> kube::Config {
        let url = &config.cluster_url;
        if config.tls_server_name.is_none() && url.scheme_str() == Some("https") {
            config.tls_server_name = url
                .host()
                .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string());
        }
        let scheme = url.scheme_str().unwrap_or("https");
        config.cluster_url = format!("{scheme}://{}{}", self.addr, url.path())
            .parse()
            .expect("the relay's URL");
        config
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}
