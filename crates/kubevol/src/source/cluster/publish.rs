//! Keeping what the API server holds of the node in step with a local value.

use crate::source::cluster::backoff::WatchBackoff;
use crate::source::BoxFuture;

/// Keeps what the API server holds of this node in step with a local value: on every change,
/// `read` it and, when it differs from what was last published, `publish` it, retrying with
/// backoff until the server takes it (each failure logged, naming `what`). `publish` gets the
/// value and what its last success returned (starting from `state`).
pub(super) async fn publish_on_change<T: PartialEq + Clone, S: Clone>(
    mut changes: tokio::sync::watch::Receiver<u64>,
    node: &str,
    what: &str,
    read: impl Fn() -> T,
    mut state: S,
    publish: impl Fn(T, S) -> BoxFuture<Result<S, String>>,
) {
    let mut published: Option<T> = None;
    let mut backoff = WatchBackoff::default();
    loop {
        changes.borrow_and_update();
        let now = read();
        if published.as_ref() != Some(&now) {
            match publish(now.clone(), state.clone()).await {
                Ok(next) => {
                    state = next;
                    published = Some(now);
                    backoff.reset();
                }
                Err(e) => {
                    tracing::warn!(node = %node, "cannot publish {what}: {e}; retrying");
                    tokio::time::sleep(backoff.step(false)).await;
                    continue;
                }
            }
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}
