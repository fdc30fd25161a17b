//! Waiting for a stop signal, shared by the `kubevol` and `kubevol-csi-loop` binaries.

/// Resolves at the first SIGTERM, SIGINT or SIGHUP (never, if the handlers cannot be
/// installed). SIGHUP, which a closed terminal or session sends, stops as cleanly as SIGTERM:
/// mounts stay in place. (SIGPIPE is ignored by the Rust runtime: a closed pipe is an error of
/// the write, never the end of the process.)
pub async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        _ = hup.recv() => {}
    }
}
