//! Set-up of a pod's volume: the intent recorded, the plugin's set-up, then the volume's
//! subPath mounts, and the outcome in the actual state and the record.

use std::sync::Arc;

use kubevol_core::state::PodMountState;
use kubevol_core::{PodUid, UniqueVolumeName};
use tracing::instrument;

use super::{as_mounted, settle_pod_record};
use super::{effected, intend, Operations};
use crate::error::ErrorClass;
use crate::events::reason;
use crate::plugins::SetUpRequest;
use crate::record;

#[instrument(skip(ops), fields(volume = %volume, pod = %pod, operation = "volume_mount"))]
pub(super) async fn mount_volume(
    ops: &Arc<Operations>,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    remount: bool,
) -> (String, Result<(), String>, bool) {
    let want = {
        let dsw = ops.world().dsw();
        dsw.volume(volume)
            .and_then(|v| v.pods.get(pod).map(|p| (v.traits.clone(), p.clone())))
    };
    let Some((traits, want)) = want else {
        return (String::new(), Ok(()), true);
    };
    if remount && ops.store.pod(pod).is_none() {
        // The pod has left its source and is about to be torn down: its content is not
        // rewritten from objects that may have left with it.
        return (traits.plugin, Ok(()), false);
    }
    let Some(plugin) = ops.plugins.by_name(&traits.plugin) else {
        return (
            traits.plugin.clone(),
            Err(format!(
                "volume {:?} of pod {}: no plugin {} is registered",
                want.outer_volume_name, want.pod_ref, traits.plugin
            )),
            true,
        );
    };
    // What the node has of it: the attach's publish context, and this pod's set-up.
    let (publish_context, have) = ops
        .world()
        .asw()
        .volume(volume)
        .map(|v| {
            let have = v.pods.get(pod).map(|m| (m.state, m.path.clone()));
            (v.publish_context.clone(), have)
        })
        .unwrap_or_default();
    let was_mounted = have
        .as_ref()
        .is_some_and(|(state, _)| *state == PodMountState::Mounted);
    let req = SetUpRequest {
        volume: volume.clone(),
        publish_context,
        pod_ref: want.pod_ref.clone(),
        pod: want.pod.clone(),
        outer_volume_name: want.outer_volume_name.clone(),
        spec: want.spec.clone(),
    };
    // A content rewrite of a volume already set up adds nothing to the node: its record stands.
    let intent = if remount && was_mounted {
        Ok(())
    } else {
        let path = have.map(|(_, path)| path).unwrap_or_else(|| {
            ops.host
                .pod_volume_path(&want.pod_ref, &traits.plugin, &want.outer_volume_name)
        });
        let m = as_mounted(&want, PodMountState::Uncertain, path, false, Vec::new());
        let r = record::PodVolumeRecord::of(
            record::PodVolumeState::SettingUp,
            volume,
            &traits,
            &m,
            ops.origin_of(pod),
        );
        intend(ops, "set_up", record::Change::PodVolume(r)).await
    };
    // The volume first, then its subPath mounts: if those fail the volume is set up but the
    // pod cannot use it yet, so it is recorded as uncertain (torn down if the pod goes away).
    let result = match intent {
        Err(e) => Err((e, None)),
        Ok(()) => {
            let result = match plugin.set_up(ops.host.clone(), req).await {
                Ok(done) => {
                    match super::subpath::bind_all(ops.host.clone(), &want, &done.path).await {
                        Ok(subs) => Ok((done, subs)),
                        Err(e) => Err((e, Some(done.path))),
                    }
                }
                Err(e) => Err((e, None)),
            };
            effected("set_up", result)
        }
    };
    // The event is for a first set-up, not for a content rewrite or a re-check.
    let announce = !was_mounted && !remount;
    let outcome = set_up_outcome(ops, volume, pod, announce, &traits, &want, result);
    settle_pod_record(ops, volume, pod, &want.outer_volume_name);
    outcome
}

fn set_up_outcome(
    ops: &Arc<Operations>,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    announce: bool,
    traits: &kubevol_core::state::VolumeTraits,
    want: &kubevol_core::state::DesiredPodVolume,
    result: Result<
        (
            crate::plugins::SetUpResult,
            Vec<kubevol_core::state::SubPathMount>,
        ),
        (crate::error::VolumeError, Option<std::path::PathBuf>),
    >,
) -> (String, Result<(), String>, bool) {
    let pref = &want.pod_ref;
    let traits = traits.clone();
    match result {
        Ok((done, subs)) => {
            ops.asw.write().mark_pod_volume(
                volume,
                &traits,
                pod.clone(),
                as_mounted(
                    want,
                    PodMountState::Mounted,
                    done.path,
                    done.read_only,
                    subs,
                ),
            );
            if announce {
                ops.events.record(
                    pref,
                    false,
                    reason::SUCCESSFUL_MOUNT_VOLUME,
                    format!(
                        "MountVolume.SetUp succeeded for volume {:?}",
                        want.outer_volume_name
                    ),
                );
            }
            observe_pod_ready(ops, pod);
            // Nothing follows a set-up; a wish that changed while it ran was turned away by
            // the executor, which asks for the new plan when this key is released.
            (traits.plugin, Ok(()), false)
        }
        Err((e, set_up_path)) => {
            let message = format!(
                "MountVolume.SetUp failed for volume {:?} of pod {pref} ({}): {e}",
                want.outer_volume_name,
                ops.origin_of(pod)
            );
            if set_up_path.is_some() || e.class() == ErrorClass::Uncertain {
                let path = set_up_path.unwrap_or_else(|| {
                    ops.host
                        .pod_volume_path(pref, &traits.plugin, &want.outer_volume_name)
                });
                ops.asw.write().mark_pod_volume(
                    volume,
                    &traits,
                    pod.clone(),
                    as_mounted(want, PodMountState::Uncertain, path, false, Vec::new()),
                );
            }
            ops.events
                .record(pref, true, reason::FAILED_MOUNT, message.clone());
            (traits.plugin, Err(message), true)
        }
    }
}

/// Observes the pod's volume-ready latency the first time all its volumes are mounted.
fn observe_pod_ready(ops: &Operations, pod: &PodUid) {
    if let Some(waited) = ops.asw.first_ready(pod, |k| ops.executor.tearing_down(k)) {
        ops.metrics.observe_pod_ready(waited.as_secs_f64());
    }
}
