//! Waiting for a pod's volumes: `wait_for_attach_and_mount` before its containers start and
//! `wait_for_unmount` after they are killed. A waiter sleeps on its pod's own signal (never
//! polls) and, when it times out, says which volumes are missing and why.

use std::time::Duration;

use kubevol_core::{PodRef, PodUid};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::inspect::status::{Sources, VolumePhase, VolumeStatus};

/// Why a wait ended without success.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The wait timed out; the message lists every volume still missing with its last error.
    #[error("timed out after {timeout:?} waiting for volumes of pod {pod}: {detail}")]
    Timeout {
        /// The pod.
        pod: String,
        /// How long it waited.
        timeout: Duration,
        /// Unmounted and failed-to-process volumes with their errors.
        detail: String,
    },
    /// The pod is invalid and will never be processed.
    #[error("pod {pod} was rejected ({origin}): {}", errors.join("; "))]
    Rejected {
        /// The pod.
        pod: String,
        /// Where it came from (manifest file and document, or the library API).
        origin: String,
        /// Its validation errors.
        errors: Vec<String>,
    },
    /// The manager stopped.
    #[error("the volume manager stopped")]
    Stopped,
}

/// What a waiter needs: read views of the parts, how long to wait, and the manager's stop.
///
/// A node agent waits for every pod it starts, so a waiter's size is paid a thousand times
/// over: the stop is read from its sender (the manager's stop wakes every pod's signal, see
/// [`crate::world::World::notify_all_pods`]) instead of being a receiver with a future of its
/// own, and only [`Wait::until`] is a state machine (the others build its future, so their
/// arguments are not kept twice).
pub(crate) struct Wait<'a> {
    pub(crate) sources: Sources<'a>,
    pub(crate) timeout: Duration,
    pub(crate) stop: &'a watch::Sender<bool>,
}

/// A pod's signal, held by a waiter: when the waiter ends, however it ends (done, a timeout,
/// dropped), the signal goes from the world's map unless another waiter holds it, so that the
/// map holds the signals of the pods being waited for, not of every pod ever waited for.
struct SignalHeld<'a> {
    world: &'a crate::world::World,
    uid: &'a PodUid,
    signal: Option<std::sync::Arc<tokio::sync::Notify>>,
}

impl Drop for SignalHeld<'_> {
    fn drop(&mut self) {
        drop(self.signal.take());
        self.world.forget_pod_signal(self.uid);
    }
}

impl<'a> Wait<'a> {
    /// The one state machine of a wait. A plain function returning an `async move` block, not
    /// an `async fn`: an `async fn` keeps its arguments twice (as given and as moved into its
    /// body), a block only once.
    #[allow(clippy::manual_async_fn)]
    fn until(
        self,
        pod: PodRef,
        deadline: Instant,
        mut done: impl FnMut(&Sources<'_>, &PodUid) -> Result<bool, WaitError> + 'a,
        describe: impl Fn(&Sources<'_>, &PodUid) -> String + 'a,
    ) -> impl std::future::Future<Output = Result<(), WaitError>> + 'a {
        async move {
            let uid = &pod.uid;
            let held = SignalHeld {
                world: self.sources.world,
                uid,
                signal: Some(self.sources.world.pod_signal(uid)),
            };
            let signal = held.signal.as_ref().expect("held until dropped");
            loop {
                // Register for the next signal before checking, so a change in between is not
                // lost.
                let notified = signal.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if done(&self.sources, uid)? {
                    return Ok(());
                }
                // Read after registering: a stop from here on wakes the signal.
                if *self.stop.borrow() {
                    return Err(WaitError::Stopped);
                }
                tokio::select! {
                    _ = &mut notified => {}
                    _ = tokio::time::sleep_until(deadline) => {
                        return Err(WaitError::Timeout {
                            pod: pod.to_string(),
                            timeout: self.timeout,
                            detail: describe(&self.sources, uid),
                        });
                    }
                }
            }
        }
    }

    /// Waits until every volume the pod's containers use is mounted.
    pub(crate) fn attach_and_mount(
        self,
        pod: PodRef,
    ) -> impl std::future::Future<Output = Result<(), WaitError>> + 'a {
        let deadline = Instant::now() + self.timeout;
        self.until(
            pod,
            deadline,
            |s, uid| {
                // Rejected, and no earlier valid version is desired: it will never be ready.
                s.world
                    .mounts_decided(uid, |k| s.executor.tearing_down(k))
                    .map_err(|r| WaitError::Rejected {
                        pod: r.pod_ref.to_string(),
                        origin: r.origin.to_string(),
                        errors: r.errors,
                    })
            },
            |s, uid| match s.pod(uid, false) {
                None => "the pod is not known to the volume manager: add it to a pod source, and check its spec.nodeName".into(),
                Some(status) => {
                    let describe = |v: &VolumeStatus| match &v.retry.last_error {
                        Some(e) => format!("{} ({e})", v.name),
                        None => v.name.clone(),
                    };
                    let unmounted: Vec<String> = status
                        .volumes
                        .iter()
                        .filter(|v| v.state != VolumePhase::Mounted && !v.not_processed())
                        .map(describe)
                        .collect();
                    let failed: Vec<String> = status
                        .volumes
                        .iter()
                        .filter(|v| v.not_processed())
                        .map(describe)
                        .collect();
                    format!(
                        "unmounted volumes=[{}], failed to process volumes=[{}]",
                        unmounted.join(", "),
                        failed.join(", ")
                    )
                }
            },
        )
    }

    /// Waits until nothing of the pod's is mounted any more (not even uncertainly).
    pub(crate) fn unmount(
        self,
        pod: PodRef,
    ) -> impl std::future::Future<Output = Result<(), WaitError>> + 'a {
        let deadline = Instant::now() + self.timeout;
        self.unmount_by(pod, deadline)
    }

    /// [`Wait::unmount`] until `deadline`, shared by a wait for many pods.
    pub(crate) fn unmount_by(
        self,
        pod: PodRef,
        deadline: Instant,
    ) -> impl std::future::Future<Output = Result<(), WaitError>> + 'a {
        self.until(
            pod,
            deadline,
            |s, uid| Ok(!s.world.has_possibly_mounted_volumes(uid)),
            |s, uid| {
                let names: Vec<String> = s
                    .world
                    .asw()
                    .pod_volumes(uid)
                    .map(|(n, m)| match s.executor.last_error_for(n, uid) {
                        Some(e) => format!("{} ({})", m.outer_volume_name, e.message),
                        None => m.outer_volume_name.to_string(),
                    })
                    .collect();
                format!("still mounted volumes=[{}]", names.join(", "))
            },
        )
    }
}
