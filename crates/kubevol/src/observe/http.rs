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

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};

use crate::VolumeManager;

/// The router, for serving on any listener.
pub fn router(manager: VolumeManager) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/pods", get(pods))
        .route("/api/v1/events", get(events))
        .route("/api/v1/drivers", get(drivers))
        .with_state(manager)
}

/// Whether the manager is ready, or why not.
pub fn readiness(m: &VolumeManager) -> Result<(), String> {
    if !m.reconciler_states_synced() {
        return Err("reconciler states not synced yet".into());
    }
    let problems = m.store().source_problems();
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

async fn pods(State(m): State<VolumeManager>) -> impl IntoResponse {
    Json(m.status(true))
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
    axum::serve(listener, router(manager))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

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
