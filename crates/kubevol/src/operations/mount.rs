//! Set-up of a pod's volume: the intent recorded, the plugin's set-up, then the volume's
//! subPath mounts, and the outcome in the actual state and the record.
//!
//! The steps are split so that two drivers share them: an operation task awaits the plugin
//! (CSI, hostPath, content), and the local lane calls a quick plugin's set-up in place, after
//! one commit of the intents of a whole chunk.

use kubevol_core::names::SharedStr;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use kubevol_core::state::{
    ActualState, DesiredPodVolume, DesiredState, PodMountState, SubPathMount, VolumeTraits,
};
use kubevol_core::{PodRef, PodUid, UniqueVolumeName};
use tracing::instrument;

use super::{as_mounted, settle_all, settle_pod_record};
use super::{effected, intend, Operations, Outcome};
use crate::error::{ErrorClass, VolumeError};
use crate::events::reason;
use crate::plugins::{SetUpRequest, SetUpResult, VolumePlugin};
use crate::record;

/// A set-up ready to run: what the plugin is asked (its intent to record before comes beside
/// it, from [`prepare`]).
pub(super) struct SetUp {
    pub(super) volume: UniqueVolumeName,
    pub(super) pod: PodUid,
    pub(super) plugin: Arc<dyn VolumePlugin>,
    traits: VolumeTraits,
    want: DesiredPodVolume,
    pub(super) req: SetUpRequest,
    was_mounted: bool,
    remount: bool,
}

/// What the plugin and the subPath mounts did: the set-up, or the error with the path of a
/// volume set up whose subPath mounts failed.
pub(super) type Effect =
    Result<(SetUpResult, Vec<SubPathMount>), (VolumeError, Option<std::path::PathBuf>)>;

/// What the DSW wants of one pod's volume: the volume's plugin facts and the pod's wish.
pub(super) type Wanted = Option<(VolumeTraits, DesiredPodVolume)>;

/// What the ASW has of it: the attach's publish context, and this pod's set-up.
pub(super) type Had = (BTreeMap<String, String>, Option<(PodMountState, PathBuf)>);

pub(super) fn wanted(dsw: &DesiredState, volume: &UniqueVolumeName, pod: &PodUid) -> Wanted {
    dsw.volume(volume)
        .and_then(|v| v.pods.get(pod).map(|p| (v.traits.clone(), p.clone())))
}

pub(super) fn had(asw: &ActualState, volume: &UniqueVolumeName, pod: &PodUid) -> Had {
    asw.volume(volume)
        .map(|v| {
            let have = v.pods.get(pod).map(|m| (m.state, m.path.clone()));
            (v.publish_context.clone(), have)
        })
        .unwrap_or_default()
}

/// A set-up ready to run, and the intent to record before its side effect (none for a content
/// rewrite of a volume already set up: it adds nothing to the node).
pub(super) type Prepared = (SetUp, Option<record::Change>);

/// Reads what the set-up needs from the world; an operation with nothing to do (the pod gone,
/// no plugin) is finished at once with its outcome.
pub(super) fn prepare(
    ops: &Operations,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    remount: bool,
) -> Result<Prepared, Outcome> {
    let want = wanted(&ops.world().dsw(), volume, pod);
    prepare_from(ops, volume, pod, remount, want, || {
        had(&ops.world().asw(), volume, pod)
    })
}

/// [`prepare`] from what was read of the DSW, and of the ASW when it is needed.
pub(super) fn prepare_from(
    ops: &Operations,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    remount: bool,
    want: Wanted,
    had: impl FnOnce() -> Had,
) -> Result<Prepared, Outcome> {
    let Some((traits, want)) = want else {
        return Err((SharedStr::default(), Ok(()), true));
    };
    if remount && ops.store.pod(pod).is_none() {
        // The pod has left its source and is about to be torn down: its content is not
        // rewritten from objects that may have left with it.
        return Err((traits.plugin, Ok(()), false));
    }
    let Some(plugin) = ops.plugins.by_name(&traits.plugin) else {
        return Err((
            traits.plugin.clone(),
            Err(format!(
                "volume {:?} of pod {}: no plugin {} is registered",
                want.outer_volume_name, want.pod_ref, traits.plugin
            )
            .into()),
            true,
        ));
    };
    let (publish_context, have) = had();
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
    let intent = (!(remount && was_mounted)).then(|| {
        let path = have.map(|(_, path)| path).unwrap_or_else(|| {
            ops.host
                .pod_volume_path(&want.pod_ref, &traits.plugin, &want.outer_volume_name)
        });
        let m = as_mounted(&want, PodMountState::Uncertain, path, false, Vec::new());
        record::Change::PodVolume(record::PodVolumeRecord::of(
            record::PodVolumeState::SettingUp,
            volume,
            &traits,
            &m,
            ops.store.pod_source(pod),
        ))
    });
    Ok((
        SetUp {
            volume: volume.clone(),
            pod: pod.clone(),
            plugin,
            traits,
            want,
            req,
            was_mounted,
            remount,
        },
        intent,
    ))
}

impl SetUp {
    /// The plugin and pod of a first set-up (nothing of it on the node yet), for
    /// [`QuickPlugin::set_up_ahead`](crate::plugins::QuickPlugin::set_up_ahead).
    pub(super) fn first(&self) -> Option<(&Arc<dyn VolumePlugin>, &PodRef)> {
        (!self.was_mounted && !self.remount).then_some((&self.plugin, &self.want.pod_ref))
    }

    /// The volume first, then its subPath mounts, through the plugin's own (async) set-up.
    async fn effect(&self, ops: &Operations) -> Effect {
        let done = self
            .plugin
            .set_up(ops.host.clone(), self.req.clone())
            .await
            .map_err(|e| (e, None))?;
        let shared = |subs: Vec<_>| {
            super::subpath::share_for_propagation(&ops.host, &self.want, &done.path, &subs)
                .map(|()| subs)
        };
        match super::subpath::bind_all(ops.host.clone(), &self.want, &done.path)
            .await
            .and_then(shared)
        {
            Ok(subs) => Ok((done, subs)),
            Err(e) => Err((e, Some(done.path))),
        }
    }

    /// The same, as plain calls on this thread, for a plugin that is quick for this volume.
    pub(super) fn effect_now(&self, ops: &Operations) -> Effect {
        let quick = self.plugin.quick().ok_or_else(|| {
            (
                VolumeError::Task(format!(
                    "volume {:?} of pod {}: plugin {} has no quick set-up (a kubevol bug; it is retried)",
                    self.want.outer_volume_name, self.want.pod_ref, self.traits.plugin
                )),
                None,
            )
        })?;
        let done = quick
            .set_up_now(&ops.host, self.req.clone())
            .map_err(|e| (e, None))?;
        let subs =
            super::subpath::bind_all_now(&ops.host, &self.want, &done.path).and_then(|subs| {
                super::subpath::share_for_propagation(&ops.host, &self.want, &done.path, &subs)
                    .map(|()| subs)
            });
        match subs {
            Ok(subs) => Ok((done, subs)),
            Err(e) => Err((e, Some(done.path))),
        }
    }
}

#[instrument(skip(ops), fields(volume = %volume, pod = %pod, operation = "volume_mount"))]
pub(super) async fn mount_volume(
    ops: &Arc<Operations>,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    remount: bool,
) -> Outcome {
    let (s, intent) = match prepare(ops, volume, pod, remount) {
        Ok(prepared) => prepared,
        Err(done) => return done,
    };
    let intent = match intent {
        Some(change) => intend(ops, "set_up", change).await,
        None => Ok(()),
    };
    // The volume first, then its subPath mounts: if those fail the volume is set up but the
    // pod cannot use it yet, so it is recorded as uncertain (torn down if the pod goes away).
    let result = match intent {
        Err(e) => Err((e, None)),
        Ok(()) => effected("set_up", s.effect(ops).await),
    };
    let mut records = Vec::new();
    let outcome = finish(ops, s, result, &mut records);
    settle_all(ops, records);
    outcome
}

/// The outcome of a set-up in the actual state and the events; its record line is added to
/// `records`.
pub(super) fn finish(
    ops: &Operations,
    s: SetUp,
    result: Effect,
    records: &mut Vec<record::Change>,
) -> Outcome {
    let SetUp {
        volume,
        pod,
        traits,
        want,
        was_mounted,
        remount,
        ..
    } = &s;
    // The event is for a first set-up, not for a content rewrite or a re-check.
    let announce = !was_mounted && !remount;
    let pref = &want.pod_ref;
    let traits = traits.clone();
    match result {
        Ok((done, subs)) => {
            let mounted = as_mounted(
                want,
                PodMountState::Mounted,
                done.path,
                done.read_only,
                subs,
            );
            // The record says what the actual state is about to hold (the executor keeps
            // every other operation of this key away until the line is queued).
            records.push(record::Change::PodVolume(record::PodVolumeRecord::of(
                record::PodVolumeState::SetUp,
                volume,
                &traits,
                &mounted,
                ops.store.pod_source(pod),
            )));
            ops.asw
                .write()
                .mark_pod_volume(volume, &traits, pod.clone(), mounted);
            if announce {
                if let Some(waited) = ops.asw.waiting_since(pod) {
                    let plugin = super::metric_plugin(ops, volume, &traits.plugin);
                    let seconds = waited.as_secs_f64();
                    ops.metrics
                        .observe_end_to_end(&plugin, "overall_volume_mount", seconds);
                }
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
            observe_pod_ready(ops, pod, pref);
            // Nothing follows a set-up; a wish that changed while it ran was turned away by
            // the executor, which asks for the new plan when this key is released.
            (traits.plugin, Ok(()), false)
        }
        Err((e, set_up_path)) => {
            let message = format!(
                "MountVolume.SetUp failed for volume {:?} of pod {pref} ({}): {e}",
                want.outer_volume_name,
                ops.store.pod_source(pod)
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
            settle_pod_record(ops, volume, pod, &want.outer_volume_name, records);
            ops.events
                .record(pref, true, reason::FAILED_MOUNT, message.clone());
            let failure = super::executor::Failure {
                message,
                permanent: e.is_permanent(),
            };
            (traits.plugin, Err(failure), true)
        }
    }
}

/// Observes the pod's volume-ready latency the first time all its volumes are mounted, and
/// says so in the log (the one line of the pod's set-up at `info`; each volume's is at debug).
fn observe_pod_ready(ops: &Operations, pod: &PodUid, pref: &PodRef) {
    if let Some(waited) = ops.asw.first_ready(pod, |k| ops.executor.tearing_down(k)) {
        ops.metrics.observe_pod_ready(waited.as_secs_f64());
        let volumes = ops.world().mounted_volumes(pod).len();
        tracing::info!(pod = %pref, volumes, waited = ?waited, "every volume of the pod is mounted");
    }
}
