//! The reconciler loop and the operations it starts.
//!
//! The loop asks the pure planner in `kubevol-core` what is due, hands each operation to the
//! executor (which drops keys in flight or backing off), and sleeps until something changes: a
//! DSW or ASW change, a finished operation, the earliest backoff expiry, or the slow safety-net
//! resync. It never makes a syscall; operations do, through plugins, off the runtime's core
//! threads. Operation results are the only writers of the actual state.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kubevol_core::reconcile::{plan, Operation};
use kubevol_core::state::{DeviceMountState, MountedPodVolume, PodMountState};
use kubevol_core::{PodRef, PodUid, UniqueVolumeName};
use tokio::time::Instant;
use tracing::{info, instrument, warn};

use crate::error::{ErrorClass, VolumeError};
use crate::events::reason;
use crate::executor::NotStarted;
use crate::manager::Inner;
use crate::plugins::{DeviceRequest, SetUpRequest, TearDownRequest};
use crate::record;

pub(crate) async fn run(inner: Arc<Inner>) {
    let mut stop = inner.shutdown.subscribe();
    loop {
        if *stop.borrow_and_update() {
            return;
        }
        let now = Instant::now();
        let teardown_allowed = inner.dsw_synced.load(Ordering::Acquire);
        let ops = {
            let dsw = inner.dsw();
            let asw = inner.asw();
            plan(&dsw, &asw, teardown_allowed)
        };
        let mut next = now + inner.config.resync_period;
        for op in ops {
            match inner.executor.try_start(&op.key(), now) {
                Ok(()) => {
                    if op.is_teardown() {
                        inner.executor.mark_teardown(&op.key());
                    }
                    let i = inner.clone();
                    tokio::spawn(async move { run_operation(i, op).await });
                }
                Err(NotStarted::BackingOff(at)) => next = next.min(at),
                Err(NotStarted::Busy) => {}
            }
        }
        if teardown_allowed && !inner.states_synced.swap(true, Ordering::AcqRel) {
            info!("reconciler states synced");
            inner.changed.send_modify(|g| *g += 1);
        }
        prune_errors(&inner);
        tokio::select! {
            _ = inner.wake.notified() => {}
            _ = tokio::time::sleep_until(next) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Forgets errors of keys whose volume and pod are in neither state of world.
fn prune_errors(inner: &Inner) {
    let dsw = inner.dsw();
    let asw = inner.asw();
    inner.executor.retain(|k| match &k.pod {
        Some(p) => dsw.pod_volume(&k.volume, p).is_some() || asw.pod_volume(&k.volume, p).is_some(),
        None => dsw.volume(&k.volume).is_some() || asw.volume(&k.volume).is_some(),
    });
}

async fn run_operation(inner: Arc<Inner>, op: Operation) {
    let mut permit = Some(
        inner
            .operations
            .acquire(crate::slots::Group::of(&op.key()))
            .await,
    );
    let started = Instant::now();
    // Boxed, and only once a slot is free: a storm spawns thousands of these tasks that wait
    // for a slot, and the operation's state machine (plugin calls, record writes) is tens of
    // KiB; inline, every waiting task would hold one.
    let work = Box::pin(async {
        match &op {
            Operation::MountVolume {
                volume,
                pod,
                remount,
            } => mount_volume(&inner, volume, pod, *remount).await,
            Operation::UnmountVolume { volume, pod } => {
                let (plugin, outcome) = unmount_volume(&inner, volume, pod).await;
                // Still on the node: a device unmount or a detach may be due now. (A pod that
                // wants it again meanwhile was turned away by the executor, which reports it.)
                let replan = inner.asw().volume(volume).is_some();
                (plugin, outcome, replan)
            }
            Operation::Attach { .. }
            | Operation::MountDevice { .. }
            | Operation::UnmountDevice { .. }
            | Operation::Detach { .. } => {
                let (plugin, outcome) = device_operation(&inner, &op).await;
                (plugin, outcome, true)
            }
        }
    });
    // A call into a dead filesystem (stat, statfs, umount on a hung FUSE or NFS mount) or a
    // driver that never answers cannot be cancelled, but it holds only its own key: after the
    // operation timeout the pod shows why, the slot is given back for other operations, and the
    // key runs again (with backoff) once the call returns.
    let mut work = CatchUnwind(work);
    let done = tokio::select! {
        r = &mut work => r,
        _ = tokio::time::sleep(inner.config.operation_timeout) => {
            let message = format!(
                "{} of {} has not finished after {:?}: its filesystem or CSI driver may be hung (check the mount and the driver); other volumes carry on, and this one is tried again once the call returns",
                op.metric_name(),
                describe(&inner, &op),
                inner.config.operation_timeout
            );
            warn!("{message}");
            inner.executor.report_stalled(&op.key(), message, Instant::now());
            permit = None;
            notify_operation(&inner, &op);
            inner.changed.send_modify(|g| *g += 1);
            work.await
        }
    };
    drop(permit);
    let (plugin, outcome, replan) = match done {
        Ok(r) => r,
        // Boxed: inline, its state would make every task waiting for a slot bigger.
        Err(panic) => Box::pin(panicked(&inner, &op, &panic)).await,
    };
    inner.metrics.observe_operation(
        &plugin,
        op.metric_name(),
        outcome.is_ok(),
        started.elapsed().as_secs_f64(),
    );
    let failed = outcome.is_err();
    let blocked = inner.executor.finish(&op.key(), outcome, Instant::now());
    notify_operation(&inner, &op);
    // Re-planning the whole world after every operation would be quadratic: a pass is needed
    // only when the operation failed (a backoff to schedule), may have enabled a follow-up
    // (`replan`: the volume is still on the node after an unmount, or a volume-wide operation
    // finished), or kept a key the planner asked for from starting (`blocked`: the pod's wish
    // changed while this operation ran, e.g. a ConfigMap edited during a content rewrite).
    inner.changed.send_modify(|g| *g += 1);
    if failed || replan || blocked {
        inner.wake.notify_one();
    }
}

/// A future whose panic is caught and returned as the panic's message, so that an operation
/// that panics still releases its key and records its outcome.
struct CatchUnwind<F>(F);

impl<F: std::future::Future + Unpin> std::future::Future for CatchUnwind<F> {
    type Output = Result<F::Output, String>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let inner = std::pin::Pin::new(&mut self.0);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(std::task::Poll::Ready(v)) => std::task::Poll::Ready(Ok(v)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".into());
                std::task::Poll::Ready(Err(message))
            }
        }
    }
}

/// Records the outcome of an operation that panicked: whatever it may have done is uncertain
/// (a set-up may have mounted, a teardown may have unmounted), so the volume stays in the
/// actual state as uncertain, its record says so, its pod shows the error, and the operation is
/// tried again with backoff.
async fn panicked(
    inner: &Arc<Inner>,
    op: &Operation,
    panic: &str,
) -> (String, Result<(), String>, bool) {
    let key = op.key();
    let message = format!(
        "{} of {} failed: kubevol panicked ({panic}); whatever it did is treated as uncertain and it is tried again with backoff",
        op.metric_name(),
        describe(inner, op),
    );
    tracing::error!("{message}");
    let plugin = {
        let dsw = inner.dsw();
        let asw = inner.asw();
        dsw.volume(&key.volume)
            .map(|v| v.traits.plugin.clone())
            .or_else(|| asw.volume(&key.volume).map(|v| v.traits.plugin.clone()))
            .unwrap_or_default()
    };
    match op {
        Operation::MountVolume { volume, pod, .. } => {
            let want = {
                let dsw = inner.dsw();
                dsw.volume(volume)
                    .and_then(|v| v.pods.get(pod).map(|p| (v.traits.clone(), p.clone())))
            };
            let have = inner.asw().pod_volume(volume, pod).map(|m| m.path.clone());
            if let Some((traits, want)) = want {
                let path = have.unwrap_or_else(|| {
                    inner.host.pod_volume_path(
                        &want.pod_ref,
                        &traits.plugin,
                        &want.outer_volume_name,
                    )
                });
                inner.asw_mut().mark_pod_volume(
                    volume,
                    &traits,
                    pod.clone(),
                    as_mounted(&want, PodMountState::Uncertain, path, false, Vec::new()),
                );
                inner
                    .events
                    .record(&want.pod_ref, true, reason::FAILED_MOUNT, message.clone());
                settle_pod_record(inner, volume, pod, &want.outer_volume_name).await;
            }
        }
        Operation::UnmountVolume { volume, pod } => {
            let mounted = inner.asw().pod_volume(volume, pod).cloned();
            if let Some(m) = mounted {
                inner
                    .asw_mut()
                    .set_pod_state(volume, pod, PodMountState::Uncertain);
                inner
                    .events
                    .record(&m.pod_ref, true, reason::FAILED_UNMOUNT, message.clone());
                settle_pod_record(inner, volume, pod, &m.outer_volume_name).await;
            }
        }
        Operation::Attach { volume } | Operation::MountDevice { volume } => {
            let want = {
                let dsw = inner.dsw();
                dsw.volume(volume).and_then(|v| {
                    v.pods
                        .values()
                        .next()
                        .map(|p| (v.traits.clone(), p.spec.clone()))
                })
            };
            if let Some((traits, spec)) = want {
                if matches!(op, Operation::Attach { .. }) {
                    inner.asw_mut().mark_attach_uncertain(volume, &traits, spec);
                } else {
                    inner.asw_mut().mark_device_state(
                        volume,
                        &traits,
                        DeviceMountState::Uncertain,
                        None,
                        spec,
                    );
                }
            }
            settle_device_record(inner, volume).await;
        }
        // Still in the actual state as they were: the teardown step runs again.
        Operation::UnmountDevice { volume } | Operation::Detach { volume } => {
            settle_device_record(inner, volume).await;
        }
    }
    (plugin, Err(message), true)
}

/// What an operation is about, for messages: the pod's volume with its manifest, or the
/// node-wide volume.
fn describe(inner: &Inner, op: &Operation) -> String {
    let key = op.key();
    let Some(pod) = &key.pod else {
        return format!("volume {}", key.volume);
    };
    let wanted = inner
        .dsw()
        .pod_volume(&key.volume, pod)
        .map(|w| (w.outer_volume_name.clone(), w.pod_ref.clone()));
    let known = wanted.or_else(|| {
        inner
            .asw()
            .pod_volume(&key.volume, pod)
            .map(|m| (m.outer_volume_name.clone(), m.pod_ref.clone()))
    });
    match known {
        Some((outer, pref)) => format!("volume {outer:?} of pod {pref} ({})", inner.origin_of(pod)),
        None => format!("volume {} of pod {pod}", key.volume),
    }
}

/// Passes an operation's `after` fail point: the side effect is done, the record not updated.
fn effected<T>(operation: &str, result: T) -> T {
    record::fail_point(operation, "after");
    result
}

/// Wakes the waiters of every pod an operation concerns.
fn notify_operation(inner: &Inner, op: &Operation) {
    match op {
        Operation::MountVolume { pod, .. } | Operation::UnmountVolume { pod, .. } => {
            inner.notify_pod(pod)
        }
        Operation::Attach { volume }
        | Operation::MountDevice { volume }
        | Operation::UnmountDevice { volume }
        | Operation::Detach { volume } => {
            let pods: Vec<PodUid> = inner
                .dsw()
                .volume(volume)
                .map(|v| v.pods.keys().cloned().collect())
                .unwrap_or_default();
            for p in pods {
                inner.notify_pod(&p);
            }
        }
    }
}

/// Writes an intent durably before a side effect, then passes the operation's `before` fail
/// point. An intent that cannot be written stops the operation before it does anything.
async fn intend(
    inner: &Arc<Inner>,
    operation: &'static str,
    intent: record::Change,
) -> Result<(), VolumeError> {
    inner
        .host
        .record
        .commit(intent, true)
        .await
        .map_err(|source| VolumeError::Record {
            dir: inner.host.record.dir().to_path_buf(),
            source,
        })?;
    record::fail_point(operation, "before");
    Ok(())
}

/// A pod volume's record as the actual state holds it, in `state` (default: as the actual
/// state says).
fn pod_record_of(
    inner: &Inner,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    state: Option<record::PodVolumeState>,
) -> Option<record::PodVolumeRecord> {
    let asw = inner.asw();
    let v = asw.volume(volume)?;
    let m = v.pods.get(pod)?;
    let state = state.unwrap_or(match m.state {
        PodMountState::Mounted => record::PodVolumeState::SetUp,
        PodMountState::Uncertain => record::PodVolumeState::Uncertain,
    });
    Some(record::PodVolumeRecord::of(
        state,
        volume,
        &v.traits,
        m,
        inner.origin_of(pod),
    ))
}

/// After an operation: the record says what the actual state now holds (no fsync: losing
/// this write brings back the intent, which means the same "uncertain").
async fn settle(inner: &Arc<Inner>, change: record::Change) {
    if let Err(e) = inner.host.record.commit(change, false).await {
        warn!(dir = %inner.host.record.dir().display(), "cannot update the volume record: {e}");
    }
}

async fn settle_pod_record(
    inner: &Arc<Inner>,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    outer: &str,
) {
    let now = pod_record_of(inner, volume, pod, None);
    if now
        .as_ref()
        .is_some_and(|r| inner.host.record.holds_pod_volume(r))
    {
        // A content rewrite: the record already says so.
        return;
    }
    let change = match now {
        Some(now) => record::Change::PodVolume(now),
        None => record::Change::RemovePodVolume {
            pod: pod.clone(),
            volume: outer.to_string(),
            unique: volume.clone(),
        },
    };
    settle(inner, change).await;
}

async fn settle_device_record(inner: &Arc<Inner>, volume: &UniqueVolumeName) {
    let now = inner
        .asw()
        .volume(volume)
        .and_then(record::DeviceRecord::of);
    let change = match now {
        Some(now) => record::Change::Device(now),
        None => record::Change::RemoveDevice(volume.clone()),
    };
    settle(inner, change).await;
}

#[instrument(skip(inner), fields(volume = %volume, pod = %pod, operation = "volume_mount"))]
async fn mount_volume(
    inner: &Arc<Inner>,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    remount: bool,
) -> (String, Result<(), String>, bool) {
    let want = {
        let dsw = inner.dsw();
        dsw.volume(volume)
            .and_then(|v| v.pods.get(pod).map(|p| (v.traits.clone(), p.clone())))
    };
    let Some((traits, want)) = want else {
        return (String::new(), Ok(()), true);
    };
    let Some(plugin) = inner.plugins.by_name(&traits.plugin) else {
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
    let (publish_context, have) = inner
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
            inner
                .host
                .pod_volume_path(&want.pod_ref, &traits.plugin, &want.outer_volume_name)
        });
        let m = as_mounted(&want, PodMountState::Uncertain, path, false, Vec::new());
        let r = record::PodVolumeRecord::of(
            record::PodVolumeState::SettingUp,
            volume,
            &traits,
            &m,
            inner.origin_of(pod),
        );
        intend(inner, "set_up", record::Change::PodVolume(r)).await
    };
    // The volume first, then its subPath mounts: if those fail the volume is set up but the
    // pod cannot use it yet, so it is recorded as uncertain (torn down if the pod goes away).
    let result = match intent {
        Err(e) => Err((e, None)),
        Ok(()) => {
            let result = match plugin.set_up(inner.host.clone(), req).await {
                Ok(done) => {
                    match crate::subpath::bind_all(inner.host.clone(), &want, &done.path).await {
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
    let outcome = set_up_outcome(inner, volume, pod, announce, &traits, &want, result);
    settle_pod_record(inner, volume, pod, &want.outer_volume_name).await;
    outcome
}

fn set_up_outcome(
    inner: &Arc<Inner>,
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
            inner.asw_mut().mark_pod_volume(
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
                inner.events.record(
                    pref,
                    false,
                    reason::SUCCESSFUL_MOUNT_VOLUME,
                    format!(
                        "MountVolume.SetUp succeeded for volume {:?}",
                        want.outer_volume_name
                    ),
                );
            }
            observe_pod_ready(inner, pod);
            // Nothing follows a set-up; a wish that changed while it ran was turned away by
            // the executor, which asks for the new plan when this key is released.
            (traits.plugin, Ok(()), false)
        }
        Err((e, set_up_path)) => {
            let message = format!(
                "MountVolume.SetUp failed for volume {:?} of pod {pref} ({}): {e}",
                want.outer_volume_name,
                inner.origin_of(pod)
            );
            if set_up_path.is_some() || e.class() == ErrorClass::Uncertain {
                let path = set_up_path.unwrap_or_else(|| {
                    inner
                        .host
                        .pod_volume_path(pref, &traits.plugin, &want.outer_volume_name)
                });
                inner.asw_mut().mark_pod_volume(
                    volume,
                    &traits,
                    pod.clone(),
                    as_mounted(want, PodMountState::Uncertain, path, false, Vec::new()),
                );
            }
            inner
                .events
                .record(pref, true, reason::FAILED_MOUNT, message.clone());
            (traits.plugin, Err(message), true)
        }
    }
}

/// Attach, mount device, unmount device or detach: one volume, for the whole node.
#[instrument(skip(inner), fields(operation = op.metric_name()))]
async fn device_operation(inner: &Arc<Inner>, op: &Operation) -> (String, Result<(), String>) {
    let volume = &op.key().volume;
    let wanted = {
        let dsw = inner.dsw();
        dsw.volume(volume).and_then(|v| {
            v.pods
                .values()
                .next()
                .map(|p| (v.traits.clone(), p.spec.clone()))
        })
    };
    let (traits, spec, publish_context) = {
        let asw = inner.asw();
        let have = asw.volume(volume);
        let publish_context = have.map(|v| v.publish_context.clone()).unwrap_or_default();
        match (wanted, have) {
            // Set-up steps take the spec pods want now; teardown steps the one it was set up
            // with (the pods are gone).
            (Some((t, s)), _) if !op.is_teardown() => (t, s, publish_context),
            (wanted, Some(v)) => match (v.spec.clone(), wanted) {
                (Some(s), _) => (v.traits.clone(), s, publish_context),
                (None, Some((t, s))) => (t, s, publish_context),
                (None, None) => return (String::new(), Ok(())),
            },
            (Some((t, s)), None) => (t, s, publish_context),
            (None, None) => return (String::new(), Ok(())),
        }
    };
    let Some(plugin) = inner.plugins.by_name(&traits.plugin) else {
        return (
            traits.plugin.clone(),
            Err(format!(
                "volume {volume}: no plugin {} is registered",
                traits.plugin
            )),
        );
    };
    let req = DeviceRequest {
        volume: volume.clone(),
        spec: spec.clone(),
        publish_context: publish_context.clone(),
    };
    // The fail point and record name of the step, and the kubelet's name in messages.
    let (step, what) = match op {
        Operation::Attach { .. } => ("attach", "AttachVolume.Attach"),
        Operation::MountDevice { .. } => ("mount_device", "MountVolume.MountDevice"),
        Operation::UnmountDevice { .. } => ("unmount_device", "UnmountDevice"),
        _ => ("detach", "DetachVolume.Detach"),
    };
    let intent = {
        use record::DeviceStepState as S;
        let mut r = inner
            .asw()
            .volume(volume)
            .and_then(record::DeviceRecord::of)
            .unwrap_or(record::DeviceRecord {
                version: record::VERSION,
                unique_name: volume.clone(),
                traits: record::TraitsRecord::of(&traits),
                attach: None,
                device_mount: None,
                device_mount_path: None,
                publish_context,
                expanded_size: None,
                spec: record::SpecRecord::of(&spec),
            });
        match op {
            Operation::Attach { .. } => r.attach = Some(S::Starting),
            Operation::MountDevice { .. } => r.device_mount = Some(S::Starting),
            Operation::UnmountDevice { .. } => r.device_mount = Some(S::Undoing),
            _ => r.attach = Some(S::Undoing),
        }
        r
    };
    let host = inner.host.clone();
    let outcome = match intend(inner, step, record::Change::Device(intent)).await {
        Err(e) => Err(e),
        Ok(()) => match op {
            Operation::Attach { .. } => match effected(step, plugin.attach(host, req).await) {
                Ok(ctx) => {
                    inner
                        .asw_mut()
                        .mark_attached(volume, &traits, ctx, spec.clone());
                    Ok(())
                }
                Err(e) => {
                    if e.class() == ErrorClass::Uncertain {
                        inner
                            .asw_mut()
                            .mark_attach_uncertain(volume, &traits, spec.clone());
                    }
                    Err(e)
                }
            },
            Operation::MountDevice { .. } => {
                match effected(step, plugin.mount_device(host, req).await) {
                    Ok(path) => {
                        inner.asw_mut().mark_device_state(
                            volume,
                            &traits,
                            DeviceMountState::Mounted,
                            path,
                            spec.clone(),
                        );
                        Ok(())
                    }
                    Err(e) => {
                        if e.class() == ErrorClass::Uncertain {
                            inner.asw_mut().mark_device_state(
                                volume,
                                &traits,
                                DeviceMountState::Uncertain,
                                None,
                                spec.clone(),
                            );
                        }
                        Err(e)
                    }
                }
            }
            Operation::UnmountDevice { .. } => {
                match effected(step, plugin.unmount_device(host, req).await) {
                    Ok(()) => {
                        inner.asw_mut().mark_device_state(
                            volume,
                            &traits,
                            DeviceMountState::NotMounted,
                            None,
                            spec.clone(),
                        );
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Operation::Detach { .. } => match effected(step, plugin.detach(host, req).await) {
                Ok(()) => {
                    inner.asw_mut().mark_detached(volume);
                    Ok(())
                }
                Err(e) => Err(e),
            },
            Operation::MountVolume { .. } | Operation::UnmountVolume { .. } => {
                unreachable!("per-pod operations are not device operations")
            }
        },
    };
    settle_device_record(inner, volume).await;
    match outcome {
        Ok(()) => {
            info!(volume = %volume, "{what} succeeded");
            (traits.plugin, Ok(()))
        }
        Err(e) => {
            // Every pod waiting on the volume shows why, and the message names them with the
            // files they come from: a node-wide step has no single pod.
            let users: Vec<(PodRef, String)> = inner
                .dsw()
                .volume(volume)
                .map(|v| {
                    v.pods
                        .values()
                        .map(|p| (p.pod_ref.clone(), p.outer_volume_name.clone()))
                        .collect()
                })
                .unwrap_or_default();
            let pv = spec
                .persistent_volume
                .as_ref()
                .and_then(|p| p.metadata.name.as_deref())
                .map(|n| format!("PersistentVolume {n}, "))
                .unwrap_or_default();
            let used_by = if users.is_empty() {
                "no pod uses it any more".to_string()
            } else {
                users
                    .iter()
                    .map(|(p, outer)| {
                        format!("volume {outer:?} of pod {p} ({})", inner.origin_of(&p.uid))
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let message = format!("{what} failed for {pv}{volume} ({used_by}): {e}");
            let reason = if op.is_teardown() {
                reason::FAILED_UNMOUNT
            } else {
                reason::FAILED_MOUNT
            };
            for (p, _) in &users {
                inner.events.record(p, true, reason, message.clone());
            }
            if users.is_empty() {
                warn!("{message}");
            }
            (traits.plugin, Err(message))
        }
    }
}

/// The ASW record of a pod's wish after a set-up attempt.
fn as_mounted(
    want: &kubevol_core::state::DesiredPodVolume,
    state: PodMountState,
    path: std::path::PathBuf,
    read_only: bool,
    sub_paths: Vec<kubevol_core::state::SubPathMount>,
) -> MountedPodVolume {
    MountedPodVolume {
        pod_ref: want.pod_ref.clone(),
        outer_volume_name: want.outer_volume_name.clone(),
        spec: want.spec.clone(),
        state,
        path,
        read_only,
        content_generation: want.content_generation,
        sub_paths,
    }
}

fn observe_pod_ready(inner: &Inner, pod: &PodUid) {
    let mut pending = crate::sync::lock(&inner.pending_since);
    if pending.contains_key(pod) && inner.pod_ready(pod) {
        if let Some(since) = pending.remove(pod) {
            inner
                .metrics
                .observe_pod_ready(since.elapsed().as_secs_f64());
        }
    }
}

#[instrument(skip(inner), fields(volume = %volume, pod = %pod, operation = "volume_unmount"))]
async fn unmount_volume(
    inner: &Arc<Inner>,
    volume: &UniqueVolumeName,
    pod: &PodUid,
) -> (String, Result<(), String>) {
    let have = {
        let asw = inner.asw();
        asw.volume(volume)
            .and_then(|v| v.pods.get(pod).map(|m| (v.traits.clone(), m.clone())))
    };
    let Some((traits, mounted)) = have else {
        return (String::new(), Ok(()));
    };
    let Some(plugin) = inner.plugins.by_name(&traits.plugin) else {
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
    let intent = pod_record_of(
        inner,
        volume,
        pod,
        Some(record::PodVolumeState::TearingDown),
    );
    let intent = match intent {
        Some(r) => intend(inner, "tear_down", record::Change::PodVolume(r)).await,
        None => Ok(()),
    };
    if intent.is_ok() {
        // From here on the volume may be half torn down: a pod that wants it again (the same
        // UID back, as a static pod's is) is not ready until it is set up again.
        inner
            .asw_mut()
            .set_pod_state(volume, pod, PodMountState::Uncertain);
    }
    // subPath mounts go first: they keep the volume busy.
    let torn = match intent {
        Err(e) => Err(e),
        Ok(()) => {
            let torn = match crate::subpath::unmount_all(
                inner.host.clone(),
                &mounted.pod_ref,
                &mounted.outer_volume_name,
            )
            .await
            {
                Ok(()) => plugin.tear_down(inner.host.clone(), req).await,
                Err(e) => Err(e),
            };
            effected("tear_down", torn)
        }
    };
    match torn {
        Ok(()) => {
            info!(pod = %pref, volume = %mounted.outer_volume_name, "UnmountVolume.TearDown succeeded");
            inner.asw_mut().mark_pod_unmounted(volume, pod);
            settle_pod_record(inner, volume, pod, &mounted.outer_volume_name).await;
            cleanup_pod_dir(inner, pod).await;
            (traits.plugin, Ok(()))
        }
        Err(e) => {
            let message = format!(
                "UnmountVolume.TearDown failed for volume {:?} of pod {pref}: {e}",
                mounted.outer_volume_name
            );
            // A failure that did nothing lasting (busy, refused) leaves the volume as it was.
            let state = if e.class() == ErrorClass::Uncertain {
                PodMountState::Uncertain
            } else {
                mounted.state
            };
            inner.asw_mut().set_pod_state(volume, pod, state);
            settle_pod_record(inner, volume, pod, &mounted.outer_volume_name).await;
            inner
                .events
                .record(&pref, true, reason::FAILED_UNMOUNT, message.clone());
            (traits.plugin, Err(message))
        }
    }
}

/// Removes a gone pod's directory once nothing of it is mounted: rmdir only, never crossing a
/// mount point, so a failed unmount can never lose a volume's data.
async fn cleanup_pod_dir(inner: &Arc<Inner>, pod: &PodUid) {
    let idle = inner.dsw().pod(pod).is_none() && inner.asw().pod_volumes(pod).next().is_none();
    if !idle {
        return;
    }
    let host = inner.host.clone();
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
            inner.events.forget(pod);
            inner.forget_pod_signal(pod);
            tracing::debug!(pod = %pod, "pod directory removed");
        }
        Ok(Err(e)) => {
            warn!(pod = %pod, dir = %inner.host.root.join("pods").join(pod.as_str()).display(), "pod directory left in place: {e}")
        }
        Err(e) => warn!(pod = %pod, "pod directory cleanup task failed: {e}"),
    }
}
