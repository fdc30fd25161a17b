//! Operations: what the reconciler starts. Each runs as its own task once the executor has
//! reserved its key and it holds a concurrency slot; it writes its intent to the durable record
//! before any side effect, calls the plugin, and writes its outcome to the actual state (the
//! only place besides reconstruction that does) and the record. A panic, a timeout or an error
//! each end in a recorded outcome: the key is always released.

mod device;
pub mod executor;
mod lane;
mod mount;
mod slots;
pub(crate) mod subpath;
mod unmount;

use kubevol_core::names::SharedStr;
use std::sync::Arc;
use std::time::Duration;

use kubevol_core::reconcile::Operation;
use kubevol_core::state::{DeviceMountState, MountedPodVolume, PodMountState};
use kubevol_core::{PodUid, UniqueVolumeName};
use tokio::time::Instant;
use tracing::warn;

use crate::error::VolumeError;
use crate::events::{reason, EventRecorder};
use crate::metrics::Metrics;
use crate::plugins::{PluginHost, PluginRegistry};
use crate::record;
use crate::store::ObjectStore;
use crate::world::{AswWriter, World};
use device::device_operation;
use executor::{Executor, NotStarted};
use lane::Lane;
use mount::mount_volume;
use slots::{Group, Slots};
use unmount::unmount_volume;

/// How an operation ended: its plugin's name (for metrics), the result (an error names pod,
/// volume and what to do), and whether the reconciler must plan again now (a follow-up may be
/// due, or a backoff is to be scheduled).
type Outcome = (SharedStr, Result<(), executor::Failure>, bool);

/// What operations need, handed to each: the executor's bookkeeping, the slots, the plugins
/// and the host they work on, the actual state's writer, and where outcomes are reported.
pub struct Operations {
    /// Single-flight, backoff and last errors, per key.
    pub(crate) executor: Arc<Executor>,
    slots: Slots<Group>,
    plugins: PluginRegistry,
    host: Arc<PluginHost>,
    asw: AswWriter,
    events: Arc<EventRecorder>,
    metrics: Arc<Metrics>,
    /// Read only: where a pod came from, for messages.
    store: Arc<ObjectStore>,
    /// How long one operation may run before its pod shows it as stalled.
    timeout: Duration,
    /// Where quick set-ups and teardowns run, one after another.
    lane: Lane,
    /// Teardowns waiting for the processes that hold their busy mount to exit.
    released:
        Arc<std::sync::Mutex<std::collections::HashSet<kubevol_core::reconcile::OperationKey>>>,
}

/// How operations are set up.
pub struct Setup {
    /// The executor's bookkeeping (shared with the populator, which resets backoff).
    pub executor: Arc<Executor>,
    /// How many operations may run at once.
    pub slots: usize,
    /// The plugins.
    pub plugins: PluginRegistry,
    /// What plugins work on.
    pub host: Arc<PluginHost>,
    /// The writer of the actual state.
    pub asw: AswWriter,
    /// Events.
    pub events: Arc<EventRecorder>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The object store, read only.
    pub store: Arc<ObjectStore>,
    /// The operation timeout.
    pub timeout: Duration,
}

impl Operations {
    /// The operations' shared context.
    pub fn new(s: Setup) -> Arc<Self> {
        Arc::new(Operations {
            executor: s.executor,
            slots: Slots::new(s.slots),
            plugins: s.plugins,
            host: s.host,
            asw: s.asw,
            events: s.events,
            metrics: s.metrics,
            store: s.store,
            timeout: s.timeout,
            lane: Lane::default(),
            released: Arc::default(),
        })
    }

    /// The world the operations change.
    pub fn world(&self) -> &World {
        self.asw.world()
    }

    /// Starts `op` as its own task if the executor lets its key run now.
    pub fn start(self: &Arc<Self>, op: Operation, now: Instant) -> Result<(), NotStarted> {
        self.executor.try_start(&op.key(), now)?;
        if op.is_teardown() {
            self.executor.mark_teardown(&op.key());
        }
        if self.is_quick(&op) {
            if let Err(op) = self.lane.push(self, op) {
                self.spawn_task(op);
            }
        } else {
            self.spawn_task(op);
        }
        Ok(())
    }

    /// Runs `op`, whose key is reserved, as a task of its own.
    fn spawn_task(self: &Arc<Self>, op: Operation) {
        let ops = self.clone();
        tokio::spawn(async move { run_operation(ops, op).await });
    }

    /// Stops the local lane once its running operation has ended (a manager that stops).
    pub(crate) async fn stop(&self) {
        self.lane.close().await;
    }

    /// Whether `op` is a set-up or teardown its plugin does with a few local syscalls: the
    /// local lane runs it.
    fn is_quick(&self, op: &Operation) -> bool {
        use crate::plugins::QuickStep;
        // The volume's plugin and spec, and for a set-up the pod.
        let found = match op {
            Operation::MountVolume { volume, pod, .. } => {
                let dsw = self.world().dsw();
                dsw.volume(volume).and_then(|v| {
                    let w = v.pods.get(pod)?;
                    Some((v.traits.plugin.clone(), w.spec.clone(), Some(w.pod.clone())))
                })
            }
            Operation::UnmountVolume { volume, pod } => {
                let asw = self.world().asw();
                asw.volume(volume).and_then(|v| {
                    let m = v.pods.get(pod)?;
                    Some((v.traits.plugin.clone(), m.spec.clone(), None))
                })
            }
            _ => None,
        };
        let Some((plugin, spec, pod)) = found else {
            return false;
        };
        let step = match &pod {
            Some(p) => QuickStep::SetUp(p),
            None => QuickStep::TearDown,
        };
        self.plugins
            .by_name(&plugin)
            .is_some_and(|p| p.quick().is_some_and(|q| q.is_quick(&spec, step)))
    }

    /// Forgets errors of keys whose volume and pod are in neither state of world.
    pub fn prune_errors(&self) {
        let world = self.world();
        let dsw = world.dsw();
        let asw = world.asw();
        self.executor.retain(|k| match &k.pod {
            Some(p) => {
                dsw.pod_volume(&k.volume, p).is_some() || asw.pod_volume(&k.volume, p).is_some()
            }
            None => dsw.volume(&k.volume).is_some() || asw.volume(&k.volume).is_some(),
        });
    }

    /// A node-wide volume as pods want it now: its traits and the spec of one of its pods.
    fn wanted_device(
        &self,
        volume: &UniqueVolumeName,
    ) -> Option<(
        kubevol_core::state::VolumeTraits,
        Arc<kubevol_core::state::VolumeSpec>,
    )> {
        let dsw = self.world().dsw();
        let v = dsw.volume(volume)?;
        let p = v.pods.values().next()?;
        Some((v.traits.clone(), p.spec.clone()))
    }
}

async fn run_operation(ops: Arc<Operations>, op: Operation) {
    let mut permit = Some(ops.slots.acquire(Group::of(&op.key())).await);
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
            } => mount_volume(&ops, volume, pod, *remount).await,
            Operation::UnmountVolume { volume, pod } => unmount_volume(&ops, volume, pod).await,
            Operation::Attach { .. }
            | Operation::MountDevice { .. }
            | Operation::UnmountDevice { .. }
            | Operation::Detach { .. } => {
                let (plugin, outcome) = device_operation(&ops, &op).await;
                (plugin, outcome.map_err(Into::into), true)
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
        _ = tokio::time::sleep(ops.timeout) => {
            report_stalled(&ops, &op);
            permit = None;
            work.await
        }
    };
    drop(permit);
    let outcome = match done {
        Ok(r) => r,
        Err(panic) => {
            let mut records = Vec::new();
            let outcome = panicked(&ops, &op, &panic, &mut records);
            settle_all(&ops, records);
            outcome
        }
    };
    conclude(&ops, vec![(op.clone(), started, outcome)]);
}

/// Shows that `op` has not finished after the operation timeout: the pod says why, and the
/// key stays reserved until the call returns.
fn report_stalled(ops: &Operations, op: &Operation) {
    let message = stalled_message(ops, op);
    warn!("{message}");
    ops.executor
        .report_stalled(&op.key(), message, Instant::now());
    let mut pods = Vec::new();
    operation_pods(ops, op, &mut pods);
    for p in &pods {
        ops.world().notify_pod(p);
    }
    ops.world().announce();
}

/// The plugin as the kubelet names it in its metrics: a CSI volume's with its driver
/// (`kubernetes.io/csi:<driver>`), read from the volume's key when it holds it (a persistent
/// volume's, `kubernetes.io/csi/<driver>^<handle>`) and else from its spec.
pub(crate) fn metric_plugin<'a>(
    ops: &Operations,
    volume: &UniqueVolumeName,
    plugin: &'a str,
) -> std::borrow::Cow<'a, str> {
    use std::borrow::Cow;
    let csi = crate::plugins::csi::PLUGIN_NAME;
    if plugin != csi {
        return Cow::Borrowed(plugin);
    }
    let keyed = volume
        .as_str()
        .strip_prefix(csi)
        .and_then(|rest| rest.strip_prefix('/')?.split_once('^'))
        .map(|(driver, _)| driver.to_string());
    let driver = keyed.or_else(|| {
        let world = ops.world();
        let actual = world.asw().volume(volume).and_then(|v| {
            let spec = v.spec.as_ref()?;
            spec.csi_driver().map(str::to_string)
        });
        actual.or_else(|| {
            let dsw = world.dsw();
            let spec = dsw.volume(volume)?.pods.values().next()?.spec.clone();
            spec.csi_driver().map(str::to_string)
        })
    });
    match driver {
        Some(d) => Cow::Owned(format!("{plugin}:{d}")),
        None => Cow::Borrowed(plugin),
    }
}

fn stalled_message(ops: &Operations, op: &Operation) -> String {
    format!(
        "{} of {} has not finished after {:?}: its filesystem or CSI driver may be hung (check the mount and the driver); other volumes carry on, and this one is tried again once the call returns",
        op.metric_name(),
        describe(ops, op),
        ops.timeout
    )
}

/// After operations, whichever way they ran: their metrics, their keys released with their
/// outcomes, their volumes marked for the next pass, their pods' waiters woken (once per pod),
/// and the reconciler woken if something is due now.
fn conclude(ops: &Operations, done: Vec<(Operation, Instant, Outcome)>) {
    let mut wake = false;
    let mut pods: Vec<PodUid> = Vec::with_capacity(done.len());
    let mut volumes: Vec<UniqueVolumeName> = Vec::with_capacity(done.len());
    let mut ended = Vec::with_capacity(done.len());
    let now = Instant::now();
    for (op, started, (plugin, outcome, replan)) in done {
        ops.metrics.observe_operation(
            &metric_plugin(ops, op.volume(), &plugin),
            op.metric_name(),
            outcome.is_ok(),
            started.elapsed().as_secs_f64(),
        );
        operation_pods(ops, &op, &mut pods);
        // Re-planning the whole world after every operation would be quadratic: a pass is
        // needed only when an operation failed (a backoff to schedule), may have enabled a
        // follow-up (`replan`: the volume is still on the node after an unmount, or a
        // volume-wide operation finished), or kept a key the planner asked for from starting
        // (`blocked`, below: the pod's wish changed while it ran, e.g. a ConfigMap edited
        // during a content rewrite).
        wake |= outcome.is_err() || replan;
        volumes.push(op.volume().clone());
        ended.push((op.key(), outcome));
    }
    // The keys, released together (one lock for the batch), and only then their volumes
    // marked: a pass between the two finds them free, or does not look at them yet.
    wake |= ops.executor.finish_all(ended, now);
    // Their volumes' actual states (or backoffs) changed: the next pass plans them again.
    ops.world().touch(&volumes);
    pods.sort_unstable();
    pods.dedup();
    for p in &pods {
        ops.world().notify_pod(p);
    }
    ops.world().announce();
    if wake {
        ops.world().wake_reconciler();
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
            Err(payload) => std::task::Poll::Ready(Err(panic_message(&*payload))),
        }
    }
}

/// A panic's message.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Records the outcome of an operation that panicked: whatever it may have done is uncertain
/// (a set-up may have mounted, a teardown may have unmounted), so the volume stays in the
/// actual state as uncertain, its record says so, its pod shows the error, and the operation is
/// tried again with backoff.
fn panicked(
    ops: &Operations,
    op: &Operation,
    panic: &str,
    records: &mut Vec<record::Change>,
) -> Outcome {
    let key = op.key();
    let message = format!(
        "{} of {} failed: kubevol panicked ({panic}); whatever it did is treated as uncertain and it is tried again with backoff",
        op.metric_name(),
        describe(ops, op),
    );
    tracing::error!("{message}");
    let plugin = {
        let dsw = ops.world().dsw();
        let asw = ops.world().asw();
        dsw.volume(&key.volume)
            .map(|v| v.traits.plugin.clone())
            .or_else(|| asw.volume(&key.volume).map(|v| v.traits.plugin.clone()))
            .unwrap_or_default()
    };
    match op {
        Operation::MountVolume { volume, pod, .. } => {
            let want = {
                let dsw = ops.world().dsw();
                dsw.volume(volume)
                    .and_then(|v| v.pods.get(pod).map(|p| (v.traits.clone(), p.clone())))
            };
            let have = ops
                .world()
                .asw()
                .pod_volume(volume, pod)
                .map(|m| m.path.clone());
            if let Some((traits, want)) = want {
                let path = have.unwrap_or_else(|| {
                    ops.host
                        .pod_volume_path(&want.pod_ref, &traits.plugin, &want.outer_volume_name)
                });
                ops.asw.write().mark_pod_volume(
                    volume,
                    &traits,
                    pod.clone(),
                    as_mounted(&want, PodMountState::Uncertain, path, false, Vec::new()),
                );
                ops.events
                    .record(&want.pod_ref, true, reason::FAILED_MOUNT, message.clone());
                settle_pod_record(ops, volume, pod, &want.outer_volume_name, records);
            }
        }
        Operation::UnmountVolume { volume, pod } => {
            let mounted = ops.world().asw().pod_volume(volume, pod).cloned();
            if let Some(m) = mounted {
                ops.asw
                    .write()
                    .set_pod_state(volume, pod, PodMountState::Uncertain);
                ops.events
                    .record(&m.pod_ref, true, reason::FAILED_UNMOUNT, message.clone());
                settle_pod_record(ops, volume, pod, &m.outer_volume_name, records);
            }
        }
        Operation::Attach { volume } | Operation::MountDevice { volume } => {
            if let Some((traits, spec)) = ops.wanted_device(volume) {
                if matches!(op, Operation::Attach { .. }) {
                    ops.asw.write().mark_attach_uncertain(volume, &traits, spec);
                } else {
                    ops.asw.write().mark_device_state(
                        volume,
                        &traits,
                        DeviceMountState::Uncertain,
                        None,
                        spec,
                    );
                }
            }
            settle_device_record(ops, volume);
        }
        // Still in the actual state as they were: the teardown step runs again.
        Operation::UnmountDevice { volume } | Operation::Detach { volume } => {
            settle_device_record(ops, volume);
        }
    }
    (plugin, Err(message.into()), true)
}

/// What an operation is about, for messages: the pod's volume with its manifest, or the
/// node-wide volume.
fn describe(ops: &Operations, op: &Operation) -> String {
    let key = op.key();
    let Some(pod) = &key.pod else {
        return format!("volume {}", key.volume);
    };
    let wanted = ops
        .world()
        .dsw()
        .pod_volume(&key.volume, pod)
        .map(|w| (w.outer_volume_name.clone(), w.pod_ref.clone()));
    let known = wanted.or_else(|| {
        ops.world()
            .asw()
            .pod_volume(&key.volume, pod)
            .map(|m| (m.outer_volume_name.clone(), m.pod_ref.clone()))
    });
    match known {
        Some((outer, pref)) => format!(
            "volume {outer:?} of pod {pref} ({})",
            ops.store.pod_source(pod)
        ),
        None => format!("volume {} of pod {pod}", key.volume),
    }
}

/// Passes an operation's `after` fail point: the side effect is done, the record not updated.
fn effected<T>(operation: &str, result: T) -> T {
    record::fail_point(operation, "after");
    result
}

/// The pods an operation concerns, added to `out`.
fn operation_pods(ops: &Operations, op: &Operation, out: &mut Vec<PodUid>) {
    match op {
        Operation::MountVolume { pod, .. } | Operation::UnmountVolume { pod, .. } => {
            out.push(pod.clone())
        }
        Operation::Attach { volume }
        | Operation::MountDevice { volume }
        | Operation::UnmountDevice { volume }
        | Operation::Detach { volume } => {
            if let Some(v) = ops.world().dsw().volume(volume) {
                out.extend(v.pods.keys().cloned());
            }
        }
    }
}

/// Writes an intent durably before a side effect, then passes the operation's `before` fail
/// point. An intent that cannot be written stops the operation before it does anything.
async fn intend(
    ops: &Arc<Operations>,
    operation: &'static str,
    intent: record::Change,
) -> Result<(), VolumeError> {
    ops.host
        .record
        .commit(intent, true)
        .await
        .map_err(|source| VolumeError::Record {
            dir: ops.host.record.dir().to_path_buf(),
            source,
        })?;
    record::fail_point(operation, "before");
    Ok(())
}

/// A pod volume's record as the actual state holds it (set up, or uncertain).
fn pod_record_of(
    ops: &Operations,
    volume: &UniqueVolumeName,
    pod: &PodUid,
) -> Option<record::PodVolumeRecord> {
    let asw = ops.world().asw();
    let v = asw.volume(volume)?;
    let m = v.pods.get(pod)?;
    let state = match m.state {
        PodMountState::Mounted => record::PodVolumeState::SetUp,
        PodMountState::Uncertain => record::PodVolumeState::Uncertain,
    };
    Some(record::PodVolumeRecord::of(
        state,
        volume,
        &v.traits,
        m,
        ops.store.pod_source(pod),
    ))
}

/// After an operation: the record says what the actual state now holds. Not waited for (no
/// fsync either): losing this line brings back the intent, which means the same "uncertain",
/// and the volume's next intent is queued after it.
fn settle(ops: &Operations, change: record::Change) {
    ops.host.record.submit(change);
}

/// Queues outcomes collected by [`settle_pod_record`], in order, together.
fn settle_all(ops: &Operations, records: Vec<record::Change>) {
    ops.host.record.submit_all(records);
}

/// Collects a pod volume's outcome for the record, as the actual state now holds it: queued
/// with [`settle_all`] before the operation's key is released.
fn settle_pod_record(
    ops: &Operations,
    volume: &UniqueVolumeName,
    pod: &PodUid,
    outer: &str,
    records: &mut Vec<record::Change>,
) {
    // Queued even when unchanged (a content rewrite): the writer drops an outcome that would
    // not change the record, off the runtime's threads.
    let now = pod_record_of(ops, volume, pod);
    records.push(match now {
        Some(now) => record::Change::PodVolume(now),
        None => record::Change::RemovePodVolume {
            pod: pod.clone(),
            volume: outer.into(),
            unique: volume.clone(),
        },
    });
}

fn settle_device_record(ops: &Operations, volume: &UniqueVolumeName) {
    let now = ops
        .world()
        .asw()
        .volume(volume)
        .and_then(record::DeviceRecord::of);
    let change = match now {
        Some(now) => record::Change::Device(now),
        None => record::Change::RemoveDevice(volume.clone()),
    };
    settle(ops, change);
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
