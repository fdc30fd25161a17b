//! Teardown of a pod's volume: its subPath mounts first, then the plugin's teardown, and
//! the pod's directory once nothing of it is left.

use std::sync::Arc;

use kubevol_core::state::PodMountState;
use kubevol_core::{PodUid, UniqueVolumeName};
use tracing::{info, instrument, warn};

use super::{effected, intend, Operations};
use super::{pod_record_of, settle_pod_record};
use crate::events::reason;
use crate::plugins::TearDownRequest;
use crate::record;

#[instrument(skip(ops), fields(volume = %volume, pod = %pod, operation = "volume_unmount"))]
pub(super) async fn unmount_volume(
    ops: &Arc<Operations>,
    volume: &UniqueVolumeName,
    pod: &PodUid,
) -> (String, Result<(), String>) {
    let have = {
        let asw = ops.world().asw();
        asw.volume(volume)
            .and_then(|v| v.pods.get(pod).map(|m| (v.traits.clone(), m.clone())))
    };
    let Some((traits, mounted)) = have else {
        return (String::new(), Ok(()));
    };
    let Some(plugin) = ops.plugins.by_name(&traits.plugin) else {
        return (
            traits.plugin.clone(),
            Err(format!(
                "volume {:?} of pod {}: no plugin {} is registered",
                mounted.outer_volume_name, mounted.pod_ref, traits.plugin
            )),
        );
    };
    let req = TearDownRequest {
        volume: volume.clone(),
        pod_ref: mounted.pod_ref.clone(),
        outer_volume_name: mounted.outer_volume_name.clone(),
        spec: mounted.spec.clone(),
        path: mounted.path.clone(),
    };
    let pref = mounted.pod_ref.clone();
    let intent = pod_record_of(ops, volume, pod, Some(record::PodVolumeState::TearingDown));
    let intent = match intent {
        Some(r) => intend(ops, "tear_down", record::Change::PodVolume(r)).await,
        None => Ok(()),
    };
    if intent.is_ok() {
        // From here on the volume may be half torn down: a pod that wants it again (the same
        // UID back, as a static pod's is) is not ready until it is set up again. (Before the
        // intent, the executor's record of the teardown in flight says the same.)
        ops.asw
            .write()
            .set_pod_state(volume, pod, PodMountState::Uncertain);
    }
    // subPath mounts go first: they keep the volume busy.
    let torn = match intent {
        Err(e) => Err(e),
        Ok(()) => {
            // A volume set up without subPath mounts has none to look for; one that may be half
            // set up (uncertain, reconstructed) is checked on disk.
            let sub_paths =
                if mounted.state == PodMountState::Mounted && mounted.sub_paths.is_empty() {
                    Ok(())
                } else {
                    super::subpath::unmount_all(
                        ops.host.clone(),
                        &mounted.pod_ref,
                        &mounted.outer_volume_name,
                    )
                    .await
                };
            let torn = match sub_paths {
                Ok(()) => plugin.tear_down(ops.host.clone(), req).await,
                Err(e) => Err(e),
            };
            effected("tear_down", torn)
        }
    };
    match torn {
        Ok(()) => {
            info!(pod = %pref, volume = %mounted.outer_volume_name, "UnmountVolume.TearDown succeeded");
            ops.asw.write().mark_pod_unmounted(volume, pod);
            settle_pod_record(ops, volume, pod, &mounted.outer_volume_name);
            cleanup_pod_dir(ops, pod).await;
            (traits.plugin, Ok(()))
        }
        Err(e) => {
            let message = format!(
                "UnmountVolume.TearDown failed for volume {:?} of pod {pref}: {e}",
                mounted.outer_volume_name
            );
            // The volume stays uncertain (set at the intent): its subPath mounts may be gone
            // already, so a pod that wants it again gets it set up again, idempotently.
            settle_pod_record(ops, volume, pod, &mounted.outer_volume_name);
            ops.events
                .record(&pref, true, reason::FAILED_UNMOUNT, message.clone());
            (traits.plugin, Err(message))
        }
    }
}

/// Removes a gone pod's directory once nothing of it is mounted: rmdir only, never crossing a
/// mount point, so a failed unmount can never lose a volume's data.
async fn cleanup_pod_dir(ops: &Arc<Operations>, pod: &PodUid) {
    let idle =
        ops.world().dsw().pod(pod).is_none() && ops.world().asw().pod_volumes(pod).next().is_none();
    if !idle {
        return;
    }
    let host = ops.host.clone();
    let uid = pod.clone();
    let result = tokio::task::spawn_blocking(move || -> Result<(), kubevol_mount::MountError> {
        let pods = host.root_dir.open_beneath(std::path::Path::new("pods"))?;
        pods.remove_empty_tree(uid.as_str())
    })
    .await;
    match result {
        // Gone already: the orphan sweep may have removed it first.
        Ok(Err(e)) if e.is_not_found() => {}
        Ok(Ok(())) => {
            ops.events.forget(pod);
            ops.world().forget_pod_signal(pod);
            tracing::debug!(pod = %pod, "pod directory removed");
        }
        Ok(Err(e)) => {
            warn!(pod = %pod, dir = %ops.host.root.join("pods").join(pod.as_str()).display(), "pod directory left in place: {e}")
        }
        Err(e) => warn!(pod = %pod, "pod directory cleanup task failed: {e}"),
    }
}
