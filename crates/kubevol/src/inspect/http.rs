//! The HTTP server: health, readiness, Prometheus metrics, and the status API that
//! `kubevol status` reads.
//!
//! - `GET /healthz`: 200 while the process runs.
//! - `GET /readyz`: 200 once the reconciler's states are synced and every pod source can be
//!   read; 503 with the reason otherwise (not synced yet, an API server that cannot be
//!   reached, a manifest directory that cannot be read).
//! - `GET /metrics`: Prometheus text.
//! - `GET /api/v1/pods`: the [`StatusReport`](crate::status::StatusReport) as JSON.
//! - `GET /api/v1/events`: every recorded event as JSON.
//! - `GET /api/v1/drivers`: the CSI drivers (name, endpoint, node ID, capabilities, health).
//! - `GET /api/v1/pods/{namespace}/{name}/describe` (or `/api/v1/pods/{uid}/describe`): the
//!   pod's [`PodDescription`](crate::describe::PodDescription), each volume's chain.
//! - `GET /api/v1/node/describe`: the [`NodeDescription`](crate::describe::NodeDescription).
//! - `GET /api/v1/pods/{namespace}/{name}/containers/{container}/mounts`: what the container
//!   gets of the pod's volumes ([`ContainerMounts`](crate::containers::ContainerMounts));
//!   `?format=cri` the CRI form, `?format=oci` the OCI form. 404 for an unknown pod or
//!   container, 409 while the volumes it uses are not mounted, 422 for a mount that cannot be
//!   given as asked.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};

use crate::VolumeManager;

/// The router, for serving on any listener.
pub fn router(manager: VolumeManager) -> Router {
    let report = std::sync::Arc::new(Shared::default());
    let pods = move |State(m): State<VolumeManager>| async move {
        let bytes = report
            .get(move || serde_json::to_vec(&m.status(true)).unwrap_or_default())
            .await;
        ([(header::CONTENT_TYPE, "application/json")], bytes)
    };
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/pods", get(pods))
        .route("/api/v1/events", get(events))
        .route("/api/v1/drivers", get(drivers))
        .route(
            "/api/v1/pods/{namespace}/{name}/describe",
            get(describe_by_name),
        )
        .route("/api/v1/pods/{uid}/describe", get(describe_by_uid))
        .route("/api/v1/node/describe", get(describe_node))
        .route("/stats/summary", get(stats_summary))
        .route(
            "/api/v1/pods/{namespace}/{name}/containers/{container}/mounts",
            get(container_mounts),
        )
        .with_state(manager)
}

/// Whether the manager is ready, or why not.
pub fn readiness(m: &VolumeManager) -> Result<(), String> {
    let problems = m.store().source_problems();
    if !m.reconciler_states_synced() {
        // Why a source has not listed yet (an API server that refuses the node's certificate)
        // is the reason to give.
        return Err(match problems.is_empty() {
            true => "reconciler states not synced yet".into(),
            false => format!("reconciler states not synced yet: {}", problems.join("\n")),
        });
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

async fn readyz(State(m): State<VolumeManager>) -> impl IntoResponse {
    match readiness(&m) {
        Ok(()) => (StatusCode::OK, "ok\n".to_string()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

async fn metrics(State(m): State<VolumeManager>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.metrics_text(),
    )
}

/// A document built for every request that arrives while it is being built: the status report
/// of 5,000 pods is megabytes, and 128 clients asking at once get one copy of it, built once,
/// instead of 128. A request that finds no build under way starts one, so what it gets was
/// built after it arrived.
#[derive(Default)]
struct Shared {
    building: std::sync::Mutex<Option<SharedBuild>>,
    /// Requests that joined a build (for the tests).
    #[cfg(test)]
    joined: std::sync::atomic::AtomicUsize,
}

type SharedBuild =
    futures_util::future::Shared<futures_util::future::BoxFuture<'static, bytes::Bytes>>;

impl Shared {
    /// The document: the one being built, else one `build` makes now (on a blocking thread).
    async fn get(&self, build: impl FnOnce() -> Vec<u8> + Send + 'static) -> bytes::Bytes {
        use futures_util::FutureExt;
        let shared = {
            let mut building = crate::sync::lock(&self.building);
            building
                .get_or_insert_with(|| {
                    async move {
                        tokio::task::spawn_blocking(build)
                            .await
                            .map(bytes::Bytes::from)
                            .unwrap_or_default()
                    }
                    .boxed()
                    .shared()
                })
                .clone()
        };
        #[cfg(test)]
        self.joined
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let document = shared.clone().await;
        let mut building = crate::sync::lock(&self.building);
        if building.as_ref().is_some_and(|b| b.ptr_eq(&shared)) {
            *building = None;
        }
        document
    }
}

/// A pod's description as JSON, or 404 naming what was asked for.
fn described(
    m: &VolumeManager,
    uid: Option<kubevol_core::PodUid>,
    what: &str,
) -> axum::response::Response {
    match uid.and_then(|u| m.describe_pod(&u)) {
        Some(d) => Json(d).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            format!("no pod {what} on this node\n"),
        )
            .into_response(),
    }
}

async fn describe_by_name(
    State(m): State<VolumeManager>,
    axum::extract::Path((namespace, name)): axum::extract::Path<(String, String)>,
) -> impl IntoResponse {
    described(
        &m,
        m.find_pod(&namespace, &name),
        &format!("{namespace}/{name}"),
    )
}

async fn describe_by_uid(
    State(m): State<VolumeManager>,
    axum::extract::Path(uid): axum::extract::Path<String>,
) -> impl IntoResponse {
    described(&m, Some(kubevol_core::PodUid::from(uid.as_str())), &uid)
}

async fn describe_node(State(m): State<VolumeManager>) -> impl IntoResponse {
    Json(m.describe_node())
}

async fn stats_summary(State(m): State<VolumeManager>) -> impl IntoResponse {
    Json(m.stats_summary().await)
}

/// The query of a container's mounts: `format=json` (kubevol's, the default), `cri` or `oci`.
#[derive(serde::Deserialize)]
struct MountsQuery {
    format: Option<String>,
}

async fn container_mounts(
    State(m): State<VolumeManager>,
    axum::extract::Path((namespace, name, container)): axum::extract::Path<(
        String,
        String,
        String,
    )>,
    axum::extract::Query(q): axum::extract::Query<MountsQuery>,
) -> axum::response::Response {
    use crate::containers::ContainerMountsError as E;
    let format = q.format.unwrap_or_else(|| "json".into());
    if !["json", "cri", "oci"].contains(&format.as_str()) {
        let why = format!("format {format:?} is not one of json, cri, oci\n");
        return (StatusCode::BAD_REQUEST, why).into_response();
    }
    let Some(stored) = m
        .find_pod(&namespace, &name)
        .and_then(|u| m.store().pod(&u))
    else {
        let why = format!("no pod {namespace}/{name} on this node\n");
        return (StatusCode::NOT_FOUND, why).into_response();
    };
    // It may read the mount table (a volume that propagates mounts): off the runtime's threads.
    let resolved = tokio::task::spawn_blocking(move || {
        let mounts = m.container_mounts(&stored.pod, &container)?;
        Ok::<_, E>(match format.as_str() {
            "cri" => Ok(mounts.to_cri()),
            "oci" => mounts.to_oci(),
            _ => Ok(serde_json::to_value(&mounts).unwrap_or_default()),
        })
    })
    .await;
    match resolved {
        Ok(Ok(Ok(body))) => Json(body).into_response(),
        Ok(Ok(Err(why))) => (StatusCode::UNPROCESSABLE_ENTITY, format!("{why}\n")).into_response(),
        Ok(Err(e)) => {
            let code = match &e {
                E::NoContainer { .. } => StatusCode::NOT_FOUND,
                e if e.is_not_ready() => StatusCode::CONFLICT,
                _ => StatusCode::UNPROCESSABLE_ENTITY,
            };
            (code, format!("{e}\n")).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

async fn events(State(m): State<VolumeManager>) -> impl IntoResponse {
    Json(m.events())
}

async fn drivers(State(m): State<VolumeManager>) -> impl IntoResponse {
    Json(m.csi_drivers())
}

/// Serves the router on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    manager: VolumeManager,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, router(manager), Limits::default(), shutdown).await
}

/// What the HTTP server allows its clients: any local user can connect, so none of them can
/// hold its descriptors, its stop or its probes for long.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once; one more is closed as soon as it is accepted.
    pub max_connections: usize,
    /// How long a client has to send its request's headers.
    pub header_read_timeout: std::time::Duration,
    /// How long one connection (one request: keep-alive is off) may last in all.
    pub connection_deadline: std::time::Duration,
    /// How long a stop waits for requests in flight before it closes them.
    pub stop_grace: std::time::Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 128,
            header_read_timeout: std::time::Duration::from_secs(5),
            connection_deadline: std::time::Duration::from_secs(30),
            stop_grace: std::time::Duration::from_secs(1),
        }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tower::ServiceExt;
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut connections = tokio::task::JoinSet::new();
    let mut refused = 0u64;
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors (or a connection reset before it was taken): the
                    // engine comes first; try again in a moment rather than spin.
                    tracing::debug!("cannot accept an HTTP connection: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    refused,
                    limit = limits.max_connections,
                    "HTTP connections beyond the limit are closed at once"
                );
            }
            continue;
        };
        let router = router.clone();
        connections.spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req| router.clone().oneshot(req));
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(limits.connection_deadline, connection).await;
        });
    }
    drop(listener);
    let drained = async { while connections.join_next().await.is_some() {} };
    let _ = tokio::time::timeout(limits.stop_grace, drained).await;
    connections.abort_all();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Sixty-four requests that arrive while the report is built get that one build; the next
    /// request, after it, gets a new one.
    #[tokio::test]
    async fn requests_during_a_build_share_it_and_a_later_one_gets_a_new_build() {
        let shared = Arc::new(Shared::default());
        let builds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = Arc::new(std::sync::Mutex::new(released));
        let mut requests = Vec::new();
        for _ in 0..64 {
            let (shared, builds, released) = (shared.clone(), builds.clone(), released.clone());
            requests.push(tokio::spawn(async move {
                shared
                    .get(move || {
                        let n = builds.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        released.lock().unwrap().recv().unwrap();
                        format!("build {n}").into_bytes()
                    })
                    .await
            }));
        }
        while shared.joined.load(std::sync::atomic::Ordering::SeqCst) < 64 {
            tokio::task::yield_now().await;
        }
        release.send(()).unwrap();
        for r in requests {
            assert_eq!(&r.await.unwrap()[..], b"build 0");
        }
        assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 1);
        let later = shared.get(|| b"build 1".to_vec()).await;
        assert_eq!(&later[..], b"build 1");
    }

    /// A server of one route within `limits`; its address and a handle that stops it (the
    /// task ends when the server has stopped).
    async fn limited(
        limits: Limits,
    ) -> (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router = Router::new().route("/healthz", get(|| async { "ok\n" }));
        let server = tokio::spawn(serve_with(listener, router, limits, async move {
            let _ = stopped.await;
        }));
        (addr, stop, server)
    }

    /// A connection that sends half a request and waits.
    async fn half_sent(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        s
    }

    /// Whether the server closes `s` within `within`.
    async fn closed_within(s: &mut tokio::net::TcpStream, within: std::time::Duration) -> bool {
        use tokio::io::AsyncReadExt;
        let mut buf = Vec::new();
        tokio::time::timeout(within, s.read_to_end(&mut buf))
            .await
            .is_ok()
    }

    async fn get_healthz(addr: std::net::SocketAddr) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out).await;
        out
    }

    #[tokio::test]
    async fn a_half_sent_request_is_closed_after_the_header_timeout() {
        let limits = Limits {
            header_read_timeout: std::time::Duration::from_millis(200),
            ..Limits::default()
        };
        let (addr, _stop, _server) = limited(limits).await;
        let mut s = half_sent(addr).await;
        assert!(
            closed_within(&mut s, std::time::Duration::from_secs(30)).await,
            "the server closes a connection whose headers do not come"
        );
        assert!(get_healthz(addr).await.ends_with("ok\n"));
    }

    #[tokio::test]
    async fn connections_beyond_the_limit_are_closed_at_once_and_the_rest_served() {
        let limits = Limits {
            max_connections: 2,
            header_read_timeout: std::time::Duration::from_secs(3600),
            ..Limits::default()
        };
        let (addr, _stop, _server) = limited(limits).await;
        let mut held = [half_sent(addr).await, half_sent(addr).await];
        // The two are taken (each answers nothing yet); a third is closed without an answer.
        let mut third = half_sent(addr).await;
        assert!(closed_within(&mut third, std::time::Duration::from_secs(30)).await);
        // One of the two finishes its request: a new connection is served again.
        {
            use tokio::io::AsyncWriteExt;
            held[0].write_all(b"\r\n").await.unwrap();
        }
        assert!(closed_within(&mut held[0], std::time::Duration::from_secs(30)).await);
        let mut answer = String::new();
        for _ in 0..100 {
            answer = get_healthz(addr).await;
            if answer.ends_with("ok\n") {
                break;
            }
            // The finished connection's slot is given back as its task ends.
            tokio::task::yield_now().await;
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(answer.ends_with("ok\n"), "{answer:?}");
    }

    #[tokio::test]
    async fn a_stop_waits_for_a_half_sent_request_only_for_its_grace() {
        let limits = Limits {
            header_read_timeout: std::time::Duration::from_secs(3600),
            connection_deadline: std::time::Duration::from_secs(3600),
            stop_grace: std::time::Duration::from_millis(100),
            ..Limits::default()
        };
        let (addr, stop, server) = limited(limits).await;
        let _held = half_sent(addr).await;
        // The request is being read once the server answers another one.
        assert!(get_healthz(addr).await.ends_with("ok\n"));
        stop.send(()).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(30), server)
            .await
            .expect("the stop does not wait for the client")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn readyz_is_unavailable_until_states_are_synced() {
        let t = tempfile::tempdir().unwrap();
        let m = VolumeManager::new(
            crate::Config::new(t.path(), "n"),
            Arc::new(kubevol_mount::FakeMounter::new()),
        )
        .unwrap();
        m.store().register_source("file");
        let run = tokio::spawn({
            let m = m.clone();
            async move { m.run().await }
        });
        let status =
            |m: VolumeManager| async move { readyz(State(m)).await.into_response().status() };
        assert_eq!(status(m.clone()).await, StatusCode::SERVICE_UNAVAILABLE);
        let mut changes = m.subscribe();
        m.store().mark_source_synced("file");
        while !m.reconciler_states_synced() {
            changes.changed().await.unwrap();
        }
        assert_eq!(status(m.clone()).await, StatusCode::OK);
        m.shutdown();
        run.await.unwrap();
    }
}
