//! Teardown of a pod's volume: its subPath mounts first, then the plugin's teardown, and
//! the pod's directory once nothing of it is left.
//!
//! As for set-up, the steps are shared by an operation task (which awaits the plugin) and the
//! local lane (which calls a quick plugin's teardown in place).

use kubevol_core::names::SharedStr;
use std::sync::Arc;

use kubevol_core::state::{ActualState, MountedPodVolume, PodMountState, VolumeTraits};
use kubevol_core::{PodUid, UniqueVolumeName};
use tracing::{debug, info, instrument, warn};

use super::{effected, intend, Operations, Outcome};
use super::{settle_all, settle_pod_record};
use crate::error::VolumeError;
use crate::events::reason;
use crate::plugins::{TearDownRequest, VolumePlugin};
use crate::record;

/// A teardown ready to run.
pub(super) struct TearDown {
    pub(super) volume: UniqueVolumeName,
    pub(super) pod: PodUid,
    pub(super) plugin: Arc<dyn VolumePlugin>,
    plugin_name: SharedStr,
    mounted: MountedPodVolume,
    req: TearDownRequest,
}

/// What the ASW has of one pod's volume: the volume's plugin facts and the pod's set-up.
pub(super) type Had = Option<(VolumeTraits, MountedPodVolume)>;

pub(super) fn had(asw: &ActualState, volume: &UniqueVolumeName, pod: &PodUid) -> Had {
    asw.volume(volume)
        .and_then(|v| v.pods.get(pod).map(|m| (v.traits.clone(), m.clone())))
}

/// A teardown ready to run, and its intent, the record's `TearingDown` line.
pub(super) type Prepared = (TearDown, record::Change);

/// Reads what the teardown needs; one with nothing to do is finished at once.
pub(super) fn prepare(
    ops: &Operations,
    volume: &UniqueVolumeName,
    pod: &PodUid,
) -> Result<Prepared, Outcome> {
    let have = had(&ops.world().asw(), volume, pod);
    prepare_from(ops, volume, pod, have)
}

/// [`prepare`] from what was read of the ASW.
pub(super) fn prepare_from(
    ops: &Operations,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    have: Had,
) -> Result<Prepared, Outcome> {
    // Still on the node after this pod's teardown: a device unmount or a detach may be due.
    // (A pod that wants it again meanwhile was turned away by the executor, which reports it.)
    let replan = || ops.world().asw().volume(volume).is_some();
    let Some((traits, mounted)) = have else {
        return Err((SharedStr::default(), Ok(()), replan()));
    };
    let Some(plugin) = ops.plugins.by_name(&traits.plugin) else {
        return Err((
            traits.plugin.clone(),
            Err(format!(
                "volume {:?} of pod {}: no plugin {} is registered",
                mounted.outer_volume_name, mounted.pod_ref, traits.plugin
            )
            .into()),
            replan(),
        ));
    };
    let req = TearDownRequest {
        volume: volume.clone(),
        pod_ref: mounted.pod_ref.clone(),
        outer_volume_name: mounted.outer_volume_name.clone(),
        spec: mounted.spec.clone(),
        path: mounted.path.clone(),
    };
    let intent = record::Change::PodVolume(record::PodVolumeRecord::of(
        record::PodVolumeState::TearingDown,
        volume,
        &traits,
        &mounted,
        ops.store.pod_source(pod),
    ));
    Ok((
        TearDown {
            volume: volume.clone(),
            pod: pod.clone(),
            plugin,
            plugin_name: traits.plugin,
            mounted,
            req,
        },
        intent,
    ))
}

impl TearDown {
    /// A volume set up without subPath mounts has none to look for; one that may be half set
    /// up (uncertain, reconstructed) is checked on disk.
    fn may_have_sub_paths(&self) -> bool {
        !(self.mounted.state == PodMountState::Mounted && self.mounted.sub_paths.is_empty())
    }

    /// subPath mounts first (they keep the volume busy), then the plugin's own teardown.
    async fn effect(&self, ops: &Operations) -> Result<(), VolumeError> {
        if self.may_have_sub_paths() {
            super::subpath::unmount_all(
                ops.host.clone(),
                &self.mounted.pod_ref,
                &self.mounted.outer_volume_name,
            )
            .await?;
        }
        self.plugin
            .tear_down(ops.host.clone(), self.req.clone())
            .await
    }

    /// The same as plain calls on this thread, for a plugin that is quick for this volume.
    pub(super) fn effect_now(&self, ops: &Operations) -> Result<(), VolumeError> {
        let quick = self.plugin.quick().ok_or_else(|| {
            VolumeError::Task(format!(
                "volume {:?} of pod {}: plugin {} has no quick teardown (a kubevol bug; it is retried)",
                self.mounted.outer_volume_name, self.mounted.pod_ref, self.plugin_name
            ))
        })?;
        if self.may_have_sub_paths() {
            super::subpath::unmount_all_now(
                &ops.host,
                &self.mounted.pod_ref,
                &self.mounted.outer_volume_name,
            )?;
        }
        quick.tear_down_now(&ops.host, self.req.clone())
    }
}

#[instrument(skip(ops), fields(volume = %volume, pod = %pod, operation = "volume_unmount"))]
pub(super) async fn unmount_volume(
    ops: &Arc<Operations>,
    volume: &UniqueVolumeName,
    pod: &PodUid,
) -> Outcome {
    let (t, intent) = match prepare(ops, volume, pod) {
        Ok(prepared) => prepared,
        Err(done) => return done,
    };
    let torn = match intend(ops, "tear_down", intent).await {
        Err(e) => Err(e),
        Ok(()) => effected("tear_down", t.effect(ops).await),
    };
    let mut records = Vec::new();
    let (outcome, cleanup) = finish(ops, t, torn, &mut records);
    settle_all(ops, records);
    if cleanup {
        remove_pod_dirs(ops, vec![(pod.clone(), outcome.0.clone())]).await;
    }
    outcome
}

/// Removes the directories of pods whose last volume is torn down (with the plugin of that
/// volume: see [`PluginHost::remove_pod_dirs`](crate::plugins::PluginHost::remove_pod_dirs)),
/// on the blocking pool, and forgets what kubevol kept of each pod removed.
pub(super) async fn remove_pod_dirs(ops: &Operations, gone: Vec<(PodUid, SharedStr)>) {
    let host = ops.host.clone();
    // Named if the removal fails as a whole.
    let pods: Vec<PodUid> = gone.iter().map(|(pod, _)| pod.clone()).collect();
    let removed = tokio::task::spawn_blocking(move || {
        host.remove_pod_dirs(gone.into_iter().map(|(pod, plugin)| (pod, Some(plugin))))
    })
    .await;
    match removed {
        Ok(removed) => {
            for (pod, r) in removed {
                pod_dir_removed(ops, &pod, r);
            }
        }
        Err(e) => warn!(
            pods = ?pods.iter().map(PodUid::as_str).collect::<Vec<_>>(),
            dir = %ops.host.root.join("pods").display(),
            "the removal of these pods' directories failed ({e}): the orphan sweep removes them"
        ),
    }
}

/// The outcome of a teardown in the actual state and the events, its record line added to
/// `records`; and whether the pod's directory is to be removed now (nothing of the pod is
/// left, nor wanted).
pub(super) fn finish(
    ops: &Operations,
    t: TearDown,
    torn: Result<(), VolumeError>,
    records: &mut Vec<record::Change>,
) -> (Outcome, bool) {
    let (volume, pod) = (&t.volume, &t.pod);
    let replan = || ops.world().asw().volume(volume).is_some();
    let outer = &t.mounted.outer_volume_name;
    let pref = &t.mounted.pod_ref;
    match torn {
        Ok(()) => {
            debug!(pod = %pref, volume = %outer, "UnmountVolume.TearDown succeeded");
            ops.asw.write().mark_pod_unmounted(volume, pod);
            if !ops.world().has_possibly_mounted_volumes(pod) {
                info!(pod = %pref, "every volume of the pod is torn down");
            }
            // Nothing of this pod's use of the volume is left (the executor keeps every
            // other operation of this key away until the line is queued).
            records.push(record::Change::RemovePodVolume {
                pod: pod.clone(),
                volume: outer.clone(),
                unique: volume.clone(),
            });
            let idle = ops.world().dsw().pod(pod).is_none()
                && ops.world().asw().pod_volumes(pod).next().is_none();
            ((t.plugin_name, Ok(()), replan()), idle)
        }
        Err(e) => {
            match &e {
                VolumeError::Mount(kubevol_mount::MountError::Busy { holders, .. })
                | VolumeError::DriverLeftMount {
                    holders: Some(holders),
                    ..
                } => retry_when_released(ops, volume, pod, holders),
                _ => {}
            }
            let message =
                format!("UnmountVolume.TearDown failed for volume {outer:?} of pod {pref}: {e}");
            // Once its intent was recorded the volume may be half torn down (its subPath
            // mounts gone already): it is uncertain, so a pod that wants it again (the same
            // UID back, as a static pod's is) gets it set up again, idempotently. (While the
            // teardown ran, the executor's record of it in flight said the same.) An intent
            // that could not be recorded did nothing.
            if !matches!(e, VolumeError::Record { .. }) {
                ops.asw
                    .write()
                    .set_pod_state(volume, pod, PodMountState::Uncertain);
            }
            settle_pod_record(ops, volume, pod, outer, records);
            ops.events
                .record(pref, true, reason::FAILED_UNMOUNT, message.clone());
            ((t.plugin_name, Err(message.into()), replan()), false)
        }
    }
}

/// What follows the removal of a pod's directory.
fn pod_dir_removed(ops: &Operations, pod: &PodUid, removed: Result<(), kubevol_mount::MountError>) {
    match removed {
        // Gone already: the orphan sweep may have removed it first.
        Err(e) if e.is_not_found() => {}
        Ok(()) => {
            ops.events.forget(pod);
            ops.world().forget_pod_signal(pod);
            tracing::debug!(pod = %pod, "pod directory removed");
        }
        Err(e) => {
            warn!(pod = %pod, dir = %ops.host.root.join("pods").join(pod.as_str()).display(), "pod directory left in place: {e}")
        }
    }
}

/// Tries the teardown of `volume` for `pod` again as soon as every process that holds its busy
/// mount has exited (watched with pidfds), rather than at the next backoff step. A mount held
/// otherwise (a mount on top, another namespace) is left to the backoff. One watch per key.
fn retry_when_released(
    ops: &Operations,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    holders: &kubevol_mount::holders::Holders,
) {
    use kubevol_core::reconcile::OperationKey;
    let by_process = !holders.holders.is_empty()
        && holders
            .holders
            .iter()
            .all(kubevol_mount::holders::Holder::ends_with_process);
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let key = OperationKey {
        volume: volume.clone(),
        pod: Some(pod.clone()),
    };
    if !by_process || !crate::sync::lock(&ops.released).insert(key.clone()) {
        return;
    }
    let pids: std::collections::BTreeSet<i32> = holders
        .holders
        .iter()
        .filter_map(|h| i32::try_from(h.pid).ok())
        .collect();
    let (executor, asw, released) = (ops.executor.clone(), ops.asw.clone(), ops.released.clone());
    runtime.spawn(async move {
        for pid in pids {
            if let Err(e) = process_exit(pid).await {
                // Not watchable (gone already, or no pidfds here): the backoff takes over.
                tracing::debug!(pid, "cannot watch a holder of a busy mount: {e}");
            }
        }
        crate::sync::lock(&released).remove(&key);
        executor.retry_now(|k| *k == key, tokio::time::Instant::now());
        asw.world().touch([&key.volume]);
        asw.world().wake_reconciler();
    });
}

/// How often a watched holder's pidfd is looked at.
const HOLDER_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Waits until process `pid` has exited: its pidfd, held from the start (so a reused PID is
/// never taken for it), becomes readable. A process already gone ends the wait at once.
async fn process_exit(pid: i32) -> std::io::Result<()> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    use rustix::process::{pidfd_open, Pid, PidfdFlags};
    let pid = Pid::from_raw(pid).ok_or_else(|| std::io::Error::other("pid 0"))?;
    let fd = match pidfd_open(pid, PidfdFlags::NONBLOCK) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::SRCH) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    loop {
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        if poll(&mut fds, Some(&now))? > 0 {
            return Ok(());
        }
        tokio::time::sleep(HOLDER_POLL).await;
    }
}
