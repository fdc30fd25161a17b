//! Waiting for SIGTERM or SIGINT, shared by the `kubevol` and `kubevol-csi-loop` binaries.

/// Resolves at the first SIGTERM or SIGINT (never, if the handlers cannot be installed).
pub async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
