//! The node's connections to the API server.
//!
//! kube's own client speaks HTTP/1.1, so every watch holds a connection of its own: a node of
//! 500 pods with 5 objects each held 2,500, and the usual limit of 1,024 open files ended in
//! EMFILE everywhere. Here, as client-go does, the node speaks HTTP/2 over TLS and multiplexes
//! its requests over as few connections as the server allows: a connection takes requests
//! until [`STREAMS_PER_CONNECTION`] of them are open on it (a watch stays open while it is
//! watched; kube-apiserver allows 100 streams per connection unless told otherwise, and
//! queues — forever, for watches — what goes beyond), then the next is opened, as Go's
//! transport does; the first with room is always taken, and a connection other than the
//! first is closed as soon as its last request ends, so that the pool shrinks again when
//! watches end (112 connections of a deleted pod's 10,000 watches stayed open for 90 s,
//! hyper's idle timeout). Each connection with open streams is
//! pinged every 30 s and dropped when a ping is not answered within 15 s (a connection frozen
//! by the network is noticed in about 45 s, and every watch on it restarts), and every request
//! but a watch has a deadline. Against a server without TLS (the in-process test server) it
//! speaks HTTP/1.1, a connection per request in flight.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::BoxFuture;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::{Body, ConfigExt};

use super::credentials::{Credentials, Expired};

/// How many requests (watches included) one connection carries at once: below
/// kube-apiserver's default of 100 concurrent streams, for the requests that are finishing
/// as new ones start.
pub const STREAMS_PER_CONNECTION: usize = 90;
/// How long a request other than a watch may wait for the server's answer to begin.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a connection may take to be made.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a connection is pinged (client-go's ReadIdleTimeout).
const PING_EVERY: Duration = Duration::from_secs(30);
/// How long a ping may go unanswered (client-go's PingTimeout).
const PING_TIMEOUT: Duration = Duration::from_secs(15);

type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// A client of the API server `config` names, as kubevol's node: HTTP/2 over as few
/// connections as the server's stream limit allows, pinged, with a deadline on every request
/// but a watch.
pub fn client(config: kube::Config) -> Result<kube::Client, kube::Error> {
    let h2 = config.cluster_url.scheme_str() == Some("https");
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?);
    let namespace = config.default_namespace.clone();
    let pool = Pool {
        credentials: Credentials::new(config)?,
        h2,
        connections: Mutex::default(),
    };
    Ok(kube::Client::new(
        service.service(Spread(Arc::new(pool))),
        namespace,
    ))
}

/// The node's connections.
struct Pool {
    /// The client certificate, read again when its files change.
    credentials: Credentials,
    /// HTTP/2 (every connection shared by many requests) rather than HTTP/1.1.
    h2: bool,
    connections: Mutex<Vec<Connection>>,
}

/// One connection (a client whose pool holds the one HTTP/2 connection it multiplexes), and
/// how many requests are open on it.
struct Connection {
    client: HyperClient<Connector, Body>,
    open: Arc<AtomicUsize>,
}

impl Pool {
    /// Closes the connection whose count is `open` if no request is open on it and it is not
    /// the first (which stays for the next request): its client is dropped, and with the last
    /// clone, held by no request now, the connection.
    fn release(&self, open: &Arc<AtomicUsize>) {
        let mut all = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = all.iter().position(|c| Arc::ptr_eq(&c.open, open)) {
            if i > 0 && all[i].open.load(Ordering::SeqCst) == 0 {
                all.remove(i);
            }
        }
    }
}

impl Pool {
    /// The first connection with room for one more request, opened if none has; the request
    /// is counted on it.
    fn take(&self) -> (HyperClient<Connector, Body>, Arc<AtomicUsize>) {
        let room = if self.h2 {
            STREAMS_PER_CONNECTION
        } else {
            usize::MAX
        };
        let renewed = self.credentials.renewed();
        let mut all = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        if renewed {
            // Made with the old certificate, which the server authenticated them by: the
            // requests on them finish there, new ones go over new connections.
            all.clear();
        }
        let i = match all
            .iter()
            .position(|c| c.open.load(Ordering::SeqCst) < room)
        {
            Some(i) => i,
            None => {
                all.push(Connection {
                    client: self.connect(),
                    open: Arc::default(),
                });
                if all.len() > 1 {
                    tracing::debug!(
                        connections = all.len(),
                        "another connection to the API server: the others are full"
                    );
                }
                all.len() - 1
            }
        };
        let c = &all[i];
        c.open.fetch_add(1, Ordering::SeqCst);
        (c.client.clone(), c.open.clone())
    }

    fn connect(&self) -> HyperClient<Connector, Body> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        http.set_nodelay(true);
        http.set_keepalive(Some(PING_EVERY));
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(self.credentials.tls())
            .https_or_http();
        let https = if self.h2 {
            builder.enable_http2().wrap_connector(http)
        } else {
            builder.enable_http1().wrap_connector(http)
        };
        HyperClient::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .http2_only(self.h2)
            .http2_keep_alive_interval(PING_EVERY)
            .http2_keep_alive_timeout(PING_TIMEOUT)
            .http2_keep_alive_while_idle(false)
            .build(https)
    }
}

/// The pool as the service kube's client sends through.
#[derive(Clone)]
struct Spread(Arc<Pool>);

/// Why a request failed here rather than at the server.
#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    #[error("no answer from the API server within {0:?}")]
    Timeout(Duration),
    /// hyper's own words ("client error (Connect)") and every cause below them, so that a
    /// server certificate of an unknown authority reads as such.
    #[error("{}", chain(.0))]
    Http(#[from] hyper_util::client::legacy::Error),
    #[error(transparent)]
    Expired(#[from] Expired),
}

/// An error and its causes, each once, joined by ": ".
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut words = vec![e.to_string()];
    let mut cause = e.source();
    while let Some(c) = cause {
        let w = c.to_string();
        if !words.iter().any(|seen| seen.contains(&w)) {
            words.push(w);
        }
        cause = c.source();
    }
    words.join(": ")
}

/// Why the API server refused a request for the node's credentials, if it did: the expiry of
/// the client certificate where it has expired, else the server's 401.
pub(crate) fn refusal(e: &kube::Error) -> Option<String> {
    match e {
        kube::Error::Api(s) if s.code == 401 => Some(format!(
            "the API server refused the node's credentials (401 Unauthorized: {}); give the node valid credentials",
            s.message
        )),
        kube::Error::Service(inner) => {
            let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(inner.as_ref());
            while let Some(c) = cause {
                if let Some(ConnectionError::Expired(x)) = c.downcast_ref::<ConnectionError>() {
                    return Some(x.to_string());
                }
                if let Some(x) = c.downcast_ref::<Expired>() {
                    return Some(x.to_string());
                }
                cause = c.source();
            }
            None
        }
        _ => None,
    }
}

/// [`refusal`] of a watch's failure.
pub(crate) fn watch_refusal(e: &kube::runtime::watcher::Error) -> Option<String> {
    use kube::runtime::watcher::Error as W;
    match e {
        W::InitialListFailed(e) | W::WatchStartFailed(e) | W::WatchFailed(e) => refusal(e),
        W::WatchError(s) if s.code == 401 => Some(format!(
            "the API server refused the node's credentials (401 Unauthorized: {}); give the node valid credentials",
            s.message
        )),
        _ => None,
    }
}

/// Whether a request is a watch (its answer is a stream that lasts minutes).
fn is_watch(req: &http::Request<Body>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

/// Uncounts a request on its connection when dropped: with its answer's body, once read or
/// given up, or with the request if it failed. The last request of a connection other than
/// the first closes it.
struct Open(Arc<AtomicUsize>, std::sync::Weak<Pool>);

impl Drop for Open {
    fn drop(&mut self) {
        if self.0.fetch_sub(1, Ordering::SeqCst) == 1 {
            if let Some(pool) = self.1.upgrade() {
                pool.release(&self.0);
            }
        }
    }
}

/// An answer's body, which keeps its request counted while it is read.
struct CountedBody {
    inner: hyper::body::Incoming,
    _open: Open,
}

impl http_body::Body for CountedBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl tower::Service<http::Request<Body>> for Spread {
    type Response = http::Response<CountedBody>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The pool opens a connection when every other is full.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let watch = is_watch(&req);
        let pool = self.0.clone();
        let (client, open) = pool.take();
        let open = Open(open, Arc::downgrade(&pool));
        let answer = client.request(req);
        Box::pin(async move {
            let answer = if watch {
                answer.await
            } else {
                tokio::time::timeout(REQUEST_TIMEOUT, answer)
                    .await
                    .map_err(|_| ConnectionError::Timeout(REQUEST_TIMEOUT))?
            };
            let answer = answer.map_err(ConnectionError::from)?;
            if answer.status() == http::StatusCode::UNAUTHORIZED {
                if let Some(expired) = pool.credentials.expired() {
                    return Err(ConnectionError::from(expired).into());
                }
            }
            Ok(answer.map(|inner| CountedBody { inner, _open: open }))
        })
    }
}
