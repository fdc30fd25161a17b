//! The world: the desired state (DSW) and the actual state (ASW), with the signals that tell
//! of their changes and the per-pod signals waiters sleep on.
//!
//! Who may change what is in the types: [`World::new`] hands out the only [`DswWriter`] (the
//! populator's) and the [`AswWriter`] (operation results' and reconstruction's); everything
//! else gets `&World` and can only read. No lock here is ever held across an `.await`: every
//! read or write is a short critical section on plain values.

use std::collections::{BTreeMap, BTreeSet};

use kubevol_core::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::reconcile::OperationKey;
use kubevol_core::state::{
    ActualState, DesiredState, PodMountState, PodVolumeWish, ProcessFailure, SubPathMount,
};
use kubevol_core::{PodRef, PodUid, UniqueVolumeName};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::store::Origin;

/// A pod the populator refused, with why.
#[derive(Clone, Debug)]
pub struct Rejected {
    /// The pod.
    pub pod_ref: PodRef,
    /// Where it came from.
    pub origin: Origin,
    /// Its validation errors.
    pub errors: Vec<String>,
}

/// A volume as the container runtime needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountedVolume {
    /// The path to bind-mount into containers.
    pub path: PathBuf,
    /// Whether it must be mounted read-only.
    pub read_only: bool,
    /// The subPath mounts: for these container mounts the runtime bind-mounts the subPath's
    /// own mount instead of `path`.
    pub sub_paths: Vec<SubPathMount>,
    /// The plugin that set it up (`kubernetes.io/empty-dir`).
    pub plugin: kubevol_core::names::SharedStr,
    /// Whether it is a raw block device (`volumeDevices`): `path` is the device.
    pub block: bool,
    /// Whether it was mounted with the pod's SELinux context (`-o context=`): the runtime has
    /// nothing to relabel.
    pub selinux_mount: bool,
}

/// The two states of world and their signals.
pub struct World {
    dsw: RwLock<DesiredState>,
    asw: RwLock<ActualState>,
    /// Pods the populator refused (part of its output, beside the DSW).
    rejected: RwLock<BTreeMap<PodUid, Rejected>>,
    /// When each desired pod entered the DSW, until all its volumes were first mounted.
    pending_since: Mutex<HashMap<PodUid, Instant>>,
    pod_signals: Mutex<HashMap<PodUid, Arc<Notify>>>,
    /// Bumped on every change a status watcher may want to see.
    changed: watch::Sender<u64>,
    /// Wakes the reconciler.
    wake: Notify,
    dsw_synced: AtomicBool,
    states_synced: AtomicBool,
    /// Node-wide volumes wait to be reported in use before attach and stage (cluster mode).
    require_reported: AtomicBool,
    /// The volumes the reconciler is to plan again: their desired or actual state changed.
    dirty: Mutex<Dirty>,
    /// The reconciler's passes so far.
    passes: std::sync::atomic::AtomicU64,
    /// The store's version (its change count) that the storage controllers' last finished look
    /// began from (standalone mode).
    storage_seen: std::sync::atomic::AtomicU64,
    /// Content rewrites the populator held back to their turn (an object's or a volume's pace).
    rewrites_held: std::sync::atomic::AtomicU64,
}

/// The volumes whose desired or actual state changed since the reconciler last planned, or
/// that anything may have (`all`).
#[derive(Default)]
pub struct Dirty {
    /// The volumes (a hash set: each finished operation adds one; the reconciler sorts them).
    pub volumes: HashSet<UniqueVolumeName>,
    /// Every volume.
    pub all: bool,
}

/// The only writer of the desired state: the populator's.
pub struct DswWriter {
    world: Arc<World>,
}

/// The writer of the actual state: operation results and reconstruction hold one.
#[derive(Clone)]
pub struct AswWriter {
    world: Arc<World>,
}

impl World {
    /// An empty world, with its two writers.
    pub fn new() -> (Arc<World>, DswWriter, AswWriter) {
        let world = Arc::new(World {
            dsw: RwLock::default(),
            asw: RwLock::default(),
            rejected: RwLock::default(),
            pending_since: Mutex::default(),
            pod_signals: Mutex::default(),
            changed: watch::channel(0).0,
            wake: Notify::new(),
            dsw_synced: AtomicBool::new(false),
            states_synced: AtomicBool::new(false),
            require_reported: AtomicBool::new(false),
            dirty: Mutex::new(Dirty {
                volumes: HashSet::default(),
                all: true,
            }),
            passes: std::sync::atomic::AtomicU64::new(0),
            storage_seen: std::sync::atomic::AtomicU64::new(0),
            rewrites_held: std::sync::atomic::AtomicU64::new(0),
        });
        (
            world.clone(),
            DswWriter {
                world: world.clone(),
            },
            AswWriter { world },
        )
    }

    /// The desired state.
    pub fn dsw(&self) -> RwLockReadGuard<'_, DesiredState> {
        crate::sync::read(&self.dsw)
    }

    /// The actual state.
    pub fn asw(&self) -> RwLockReadGuard<'_, ActualState> {
        crate::sync::read(&self.asw)
    }

    /// The pods the populator refused.
    pub fn rejected(&self) -> RwLockReadGuard<'_, BTreeMap<PodUid, Rejected>> {
        crate::sync::read(&self.rejected)
    }

    /// A receiver woken on every change a status watcher may want to see.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Tells status watchers that something changed.
    pub fn announce(&self) {
        self.changed.send_modify(|g| *g += 1);
    }

    /// Marks volumes for the reconciler to plan again.
    pub fn touch<'a>(&self, volumes: impl IntoIterator<Item = &'a UniqueVolumeName>) {
        let mut dirty = crate::sync::lock(&self.dirty);
        if !dirty.all {
            dirty.volumes.extend(volumes.into_iter().cloned());
        }
    }

    /// Marks every volume for the reconciler to plan again (a change of what every plan
    /// depends on: the sync gate, the in-use reporting, a reconstruction).
    pub fn touch_all(&self) {
        let mut dirty = crate::sync::lock(&self.dirty);
        dirty.all = true;
        dirty.volumes.clear();
    }

    /// The volumes to plan again, taken.
    pub(crate) fn take_dirty(&self) -> Dirty {
        std::mem::take(&mut *crate::sync::lock(&self.dirty))
    }

    /// Wakes the reconciler.
    pub fn wake_reconciler(&self) {
        self.wake.notify_one();
    }

    /// Counts one pass of the reconciler. The first is announced: a pass that changes
    /// nothing announces nothing else, and whoever waits for the reconciler to have looked
    /// (after a restart, with every recorded volume awaited) would otherwise wait for an
    /// unrelated change.
    /// Counts a content rewrite held back to its turn.
    pub(crate) fn count_rewrite_held(&self) {
        self.rewrites_held
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The content rewrites held back to their turn so far.
    pub fn rewrites_held(&self) -> u64 {
        self.rewrites_held
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn count_pass(&self) {
        let before = self
            .passes
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        if before == 0 {
            self.announce();
        }
    }

    /// Records that a look of the storage controllers, begun at store version `version`, is done.
    pub(crate) fn storage_looked(&self, version: u64) {
        self.storage_seen
            .fetch_max(version, std::sync::atomic::Ordering::Release);
    }

    /// The store version the storage controllers' last finished look began from: every change
    /// up to it has been decided on (bound, provisioned, grown or reclaimed, or not).
    pub fn storage_seen(&self) -> u64 {
        self.storage_seen.load(std::sync::atomic::Ordering::Acquire)
    }

    /// How many passes the reconciler has made: a pass that begins after a change has planned
    /// it.
    pub fn reconciler_passes(&self) -> u64 {
        self.passes.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Resolves when the reconciler is woken.
    pub async fn reconciler_woken(&self) {
        self.wake.notified().await
    }

    /// The signal a pod's waiters sleep on.
    pub fn pod_signal(&self, uid: &PodUid) -> Arc<Notify> {
        crate::sync::lock(&self.pod_signals)
            .entry(uid.clone())
            .or_default()
            .clone()
    }

    /// How many pods' signals are held (for the tests: each is a pod being waited for).
    #[cfg(test)]
    pub(crate) fn pod_signals_held(&self) -> usize {
        crate::sync::lock(&self.pod_signals).len()
    }

    /// Wakes one pod's waiters.
    pub fn notify_pod(&self, uid: &PodUid) {
        // Under the lock, without a copy of the signal: a copy held here would keep a waiter
        // that ends meanwhile from forgetting it.
        if let Some(s) = crate::sync::lock(&self.pod_signals).get(uid) {
            s.notify_waiters();
        }
    }

    /// Wakes every pod's waiters (the manager stopped: each reads the stop when woken).
    pub fn notify_all_pods(&self) {
        for s in crate::sync::lock(&self.pod_signals).values() {
            s.notify_waiters();
        }
    }

    /// Forgets a pod's signal unless a waiter still holds it (a signal is wanted only while
    /// someone waits: a new waiter makes a new one).
    pub fn forget_pod_signal(&self, uid: &PodUid) {
        let mut map = crate::sync::lock(&self.pod_signals);
        if map.get(uid).is_some_and(|s| Arc::strong_count(s) == 1) {
            map.remove(uid);
        }
    }

    /// Whether the DSW holds every pod of every source's complete first listing.
    pub fn dsw_synced(&self) -> bool {
        self.dsw_synced.load(Ordering::Acquire)
    }

    /// Whether the reconciler has made a full pass over a synced DSW.
    pub fn states_synced(&self) -> bool {
        self.states_synced.load(Ordering::Acquire)
    }

    /// Records the reconciler's first full pass over a synced DSW; true the first time.
    pub fn mark_states_synced(&self) -> bool {
        let first = !self.states_synced.swap(true, Ordering::AcqRel);
        if first {
            self.announce();
        }
        first
    }

    /// Records which volumes the node has reported as in use: the one change of the DSW made
    /// outside the populator, by whoever reports the node's status.
    pub fn mark_reported_in_use(&self, names: &[UniqueVolumeName]) {
        crate::sync::write(&self.dsw).mark_reported_in_use(names);
        self.touch_all();
        self.wake_reconciler();
    }

    /// Makes node-wide volumes wait to be reported in use before attach and stage.
    pub fn require_reported_in_use(&self) {
        self.require_reported.store(true, Ordering::SeqCst);
        self.touch_all();
        self.wake_reconciler();
    }

    /// Whether node-wide volumes wait to be reported in use.
    pub fn reported_in_use_required(&self) -> bool {
        self.require_reported.load(Ordering::SeqCst)
    }

    /// Whether every volume the pod's containers use is mounted and none is being torn down
    /// (`tearing_down`: a teardown of that key has started). Cheap on every wake: the ASW's
    /// count of the pod's mounted volumes answers "no" without a look at each volume.
    pub fn pod_ready(&self, uid: &PodUid, tearing_down: impl Fn(&OperationKey) -> bool) -> bool {
        let dsw = self.dsw();
        let Some(dp) = dsw.pod(uid) else { return false };
        if !dp.failed_to_process.is_empty() {
            return false;
        }
        let asw = self.asw();
        if asw.mounted_count(uid) < dp.volumes.len() {
            return false;
        }
        // The same UID back while its volume is being unmounted: the ASW still says mounted.
        dp.volumes.values().all(|u| {
            asw.pod_volume(u, uid)
                .is_some_and(|m| m.state == PodMountState::Mounted)
                && !tearing_down(&OperationKey {
                    volume: u.clone(),
                    pod: Some(uid.clone()),
                })
        })
    }

    /// What a wait for the pod's mounts decides now: ready (`Ok(true)`), never (`Err`: it was
    /// rejected and no earlier valid version of it is desired), or not yet (`Ok(false)`). The
    /// waiters ask it on each wake; the populator asks it to wake them only when it says
    /// something.
    pub fn mounts_decided(
        &self,
        uid: &PodUid,
        tearing_down: impl Fn(&OperationKey) -> bool,
    ) -> Result<bool, Rejected> {
        if self.pod_ready(uid, tearing_down) {
            return Ok(true);
        }
        let rejected = self.rejected().get(uid).cloned();
        match rejected {
            Some(r) if self.dsw().pod(uid).is_none() => Err(r),
            _ => Ok(false),
        }
    }
}

/// What the world answers a node agent: read-only questions about one pod or the node.
impl World {
    /// The mounted volumes of a pod, keyed by the pod's volume name.
    pub fn mounted_volumes(&self, uid: &PodUid) -> BTreeMap<String, MountedVolume> {
        let asw = self.asw();
        asw.pod_volumes(uid)
            .filter(|(_, m)| m.state == PodMountState::Mounted)
            .map(|(name, m)| {
                let plugin = asw.volume(name).map(|v| v.traits.plugin.clone());
                (
                    m.outer_volume_name.to_string(),
                    MountedVolume {
                        path: m.path.clone(),
                        read_only: m.read_only,
                        sub_paths: m.sub_paths.clone(),
                        plugin: plugin.unwrap_or_default(),
                        block: m.spec.block,
                        selinux_mount: m.spec.selinux_mount,
                    },
                )
            })
            .collect()
    }

    /// Whether anything of the pod's may still be mounted (mounted or uncertain).
    pub fn has_possibly_mounted_volumes(&self, uid: &PodUid) -> bool {
        self.asw().pod_volumes(uid).next().is_some()
    }

    /// The volumes the node must report as in use: attachable or device-mountable volumes that
    /// are desired or still on the node.
    pub fn volumes_in_use(&self) -> Vec<UniqueVolumeName> {
        let dsw = self.dsw();
        let asw = self.asw();
        let mut out: BTreeSet<&UniqueVolumeName> = dsw.node_wide_volumes().collect();
        out.extend(asw.node_wide_volumes());
        out.into_iter().cloned().collect()
    }

    /// Whether a volume is attached to the node.
    pub fn volume_is_attached(&self, name: &UniqueVolumeName) -> bool {
        self.asw().volume(name).is_some_and(|v| v.attached)
    }

    /// Extra supplemental groups for a pod's containers: the `pv.beta.kubernetes.io/gid`
    /// annotations of the PersistentVolumes it has mounted, minus the groups the pod already has.
    pub fn extra_supplemental_groups(&self, pod: &Pod) -> Vec<i64> {
        let uid = crate::store::pod_uid(pod);
        let existing: BTreeSet<i64> = pod
            .spec
            .as_ref()
            .and_then(|s| s.security_context.as_ref())
            .and_then(|s| s.supplemental_groups.clone())
            .unwrap_or_default()
            .into_iter()
            .collect();
        let asw = self.asw();
        let mut out = BTreeSet::new();
        for (_, m) in asw.pod_volumes(&uid) {
            let gid = m
                .spec
                .persistent_volume
                .as_ref()
                .and_then(|pv| pv.metadata.annotations.as_ref())
                .and_then(|a| a.get("pv.beta.kubernetes.io/gid"))
                .and_then(|g| g.trim().parse::<i64>().ok());
            if let Some(g) = gid.filter(|g| !existing.contains(g)) {
                out.insert(g);
            }
        }
        out.into_iter().collect()
    }
}

impl DswWriter {
    /// Replaces everything the DSW knows about one pod (accepted: no longer rejected), and
    /// starts its volume-ready clock if it is new.
    pub fn set_pod(
        &self,
        pod_ref: PodRef,
        wishes: Vec<PodVolumeWish>,
        failed: BTreeMap<String, ProcessFailure>,
    ) {
        let uid = pod_ref.uid.clone();
        crate::sync::write(&self.world.rejected).remove(&uid);
        {
            let mut dsw = crate::sync::write(&self.world.dsw);
            // The volumes it wanted and the ones it wants now.
            if let Some(old) = dsw.pod(&uid) {
                self.world.touch(old.volumes.values());
            }
            self.world.touch(wishes.iter().map(|w| &w.name));
            dsw.set_pod(pod_ref, wishes, failed);
        }
        crate::sync::lock(&self.world.pending_since)
            .entry(uid)
            .or_insert_with(Instant::now);
    }

    /// Refuses a pod (an earlier valid version of it, if desired, stays).
    pub fn reject(&self, uid: PodUid, rejected: Rejected) {
        crate::sync::write(&self.world.rejected).insert(uid, rejected);
    }

    /// Forgets a pod that is gone: its volumes are no longer wanted by it.
    pub fn remove_pod(&self, uid: &PodUid) {
        {
            let mut dsw = crate::sync::write(&self.world.dsw);
            if let Some(old) = dsw.pod(uid) {
                self.world.touch(old.volumes.values());
            }
            dsw.remove_pod(uid);
        }
        crate::sync::write(&self.world.rejected).remove(uid);
        crate::sync::lock(&self.world.pending_since).remove(uid);
    }

    /// Keeps exactly these pods' volumes from being torn down while no pod wants them (see
    /// [`DesiredState::held`](kubevol_core::state::DesiredState::held)).
    pub fn set_held(&self, held: BTreeMap<PodUid, String>) {
        let changed = crate::sync::write(&self.world.dsw).set_held(held);
        if changed.is_empty() {
            return;
        }
        let volumes: Vec<UniqueVolumeName> = {
            let asw = self.world.asw();
            changed
                .iter()
                .flat_map(|uid| asw.pod_volumes(uid).map(|(name, _)| name.clone()))
                .collect()
        };
        self.world.touch(volumes.iter());
        for uid in &changed {
            self.world.notify_pod(uid);
        }
        self.world.announce();
    }

    /// Records that the DSW holds every source's complete first listing; true the first time.
    pub fn mark_synced(&self) -> bool {
        let first = !self.world.dsw_synced.swap(true, Ordering::AcqRel);
        if first {
            // Teardown is allowed from now on: every volume may have some due.
            self.world.touch_all();
        }
        first
    }

    /// The world written to, for reading.
    pub fn world(&self) -> &World {
        &self.world
    }
}

impl AswWriter {
    /// The actual state, for writing.
    pub fn write(&self) -> RwLockWriteGuard<'_, ActualState> {
        crate::sync::write(&self.world.asw)
    }

    /// If the pod has just become ready for the first time, how long it waited since it
    /// entered the DSW (for `kubevol_pod_volumes_ready_duration_seconds`).
    pub fn first_ready(
        &self,
        uid: &PodUid,
        tearing_down: impl Fn(&OperationKey) -> bool,
    ) -> Option<std::time::Duration> {
        let mut pending = crate::sync::lock(&self.world.pending_since);
        if !pending.contains_key(uid) || !self.world.pod_ready(uid, tearing_down) {
            return None;
        }
        pending.remove(uid).map(|since| since.elapsed())
    }

    /// How long the pod has waited for its volumes since it entered the DSW, while it has not
    /// yet had them all mounted.
    pub fn waiting_since(&self, uid: &PodUid) -> Option<std::time::Duration> {
        crate::sync::lock(&self.world.pending_since)
            .get(uid)
            .map(|since| since.elapsed())
    }

    /// The world written to, for reading.
    pub fn world(&self) -> &World {
        &self.world
    }
}
