//! The [`VolumeManager`]: the library API, and the loops that drive it.
//!
//! It owns the desired state (written only by the populator and the library's pod calls through
//! the store), the actual state (written only by operation results), the executor and the plugin
//! registry. Nothing here polls: each pod's waiters sleep on the pod's own signal, the
//! reconciler on a `Notify`, status watchers on a watch channel. Locks are never held across an
//! `.await`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::backoff::BackoffPolicy;
use kubevol_core::state::{ActualState, DesiredState, PodMountState, SubPathMount};
use kubevol_core::{PodRef, PodUid, UniqueVolumeName};
use kubevol_mount::Mounter;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::events::EventRecorder;
use crate::executor::Executor;
use crate::metrics::Metrics;
use crate::plugins::{PluginHost, PluginRegistry};
use crate::status::{PodPhase, PodStatus, RetryInfo, StatusReport, VolumePhase, VolumeStatus};
use crate::store::{pod_uid, ObjectStore, Origin};

/// How the manager is set up.
#[derive(Clone, Debug)]
pub struct Config {
    /// The root directory (`/var/lib/kubevol`).
    pub root_dir: PathBuf,
    /// This node's name: pods assigned to other nodes are ignored.
    pub node_name: String,
    /// Backoff of failing operations.
    pub backoff: BackoffPolicy,
    /// How long `wait_for_attach_and_mount` and `wait_for_unmount` wait (kubelet: 2 min 3 s).
    pub wait_timeout: Duration,
    /// The reconciler's safety-net resync; it is otherwise woken by events.
    pub resync_period: Duration,
    /// How many operations may run at once.
    pub max_concurrent_operations: usize,
    /// Host path prefixes pods may use (empty: any).
    pub host_path_allow: Vec<PathBuf>,
    /// Where the kernel lists huge page sizes.
    pub hugepages_dir: PathBuf,
    /// What a container without limits is limited by (downward API); `None` measures the
    /// node: its CPUs, its memory and the size of the root directory's filesystem.
    pub node_allocatable: Option<kubevol_core::projection::NodeAllocatable>,
    /// CSI drivers started without a registrar: name → socket (`--csi-driver`).
    pub csi_drivers: Vec<(String, PathBuf)>,
    /// CSI controller services, for attach and detach: driver name → socket
    /// (`--csi-controller`).
    pub csi_controllers: Vec<(String, PathBuf)>,
    /// How long one CSI call may take.
    pub csi_timeout: Duration,
    /// How often `kubelet_volume_stats_*` are gathered (kubelet: 1 minute).
    pub volume_stats_period: Duration,
    /// How long one operation may run before its pod shows it as stalled and its slot is given
    /// to other operations (a hung filesystem or driver).
    pub operation_timeout: Duration,
    /// Whether an unmount that fails with EBUSY may detach the mount lazily (MNT_DETACH). Off:
    /// a busy volume is retried with backoff and the pod says why.
    pub allow_lazy_unmount: bool,
}

impl Config {
    /// The kubelet's defaults for a root directory and node name.
    pub fn new(root_dir: impl Into<PathBuf>, node_name: impl Into<String>) -> Self {
        Config {
            root_dir: root_dir.into(),
            node_name: node_name.into(),
            backoff: BackoffPolicy::KUBELET,
            wait_timeout: Duration::from_secs(123),
            resync_period: Duration::from_secs(10),
            max_concurrent_operations: 64,
            host_path_allow: Vec::new(),
            hugepages_dir: PathBuf::from("/sys/kernel/mm/hugepages"),
            node_allocatable: None,
            csi_drivers: Vec::new(),
            csi_controllers: Vec::new(),
            csi_timeout: crate::csi::DEFAULT_TIMEOUT,
            volume_stats_period: Duration::from_secs(60),
            operation_timeout: Duration::from_secs(120),
            allow_lazy_unmount: false,
        }
    }
}

/// A pod the populator refused, with why.
#[derive(Clone, Debug)]
pub(crate) struct Rejected {
    pub(crate) pod_ref: PodRef,
    pub(crate) origin: Origin,
    pub(crate) errors: Vec<String>,
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
}

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

pub(crate) struct Inner {
    pub(crate) config: Config,
    pub(crate) store: Arc<ObjectStore>,
    pub(crate) plugins: PluginRegistry,
    pub(crate) host: Arc<PluginHost>,
    pub(crate) dsw: RwLock<DesiredState>,
    pub(crate) asw: RwLock<ActualState>,
    pub(crate) rejected: RwLock<BTreeMap<PodUid, Rejected>>,
    pub(crate) executor: Executor,
    /// The last content generation handed out (see `DesiredPodVolume::content_generation`).
    pub(crate) content_generation: std::sync::atomic::AtomicU64,
    pub(crate) events: EventRecorder,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) changed: watch::Sender<u64>,
    pub(crate) wake: Notify,
    pub(crate) dsw_synced: AtomicBool,
    pub(crate) states_synced: AtomicBool,
    pub(crate) pending_since: Mutex<HashMap<PodUid, Instant>>,
    pub(crate) pod_signals: Mutex<HashMap<PodUid, Arc<Notify>>>,
    pub(crate) shutdown: watch::Sender<bool>,
    pub(crate) operations: crate::slots::Slots<crate::slots::Group>,
    /// What reconstruction found at start.
    pub(crate) reconstruction: Mutex<crate::reconstruct::Reconstruction>,
    /// Orphaned pod directories the last sweep could not remove.
    pub(crate) leftovers: Mutex<BTreeMap<PodUid, crate::reconstruct::Leftover>>,
}

impl Inner {
    pub(crate) fn dsw(&self) -> std::sync::RwLockReadGuard<'_, DesiredState> {
        crate::sync::read(&self.dsw)
    }
    pub(crate) fn dsw_mut(&self) -> std::sync::RwLockWriteGuard<'_, DesiredState> {
        crate::sync::write(&self.dsw)
    }
    pub(crate) fn asw(&self) -> std::sync::RwLockReadGuard<'_, ActualState> {
        crate::sync::read(&self.asw)
    }
    pub(crate) fn asw_mut(&self) -> std::sync::RwLockWriteGuard<'_, ActualState> {
        crate::sync::write(&self.asw)
    }
    pub(crate) fn rejected(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<PodUid, Rejected>> {
        crate::sync::read(&self.rejected)
    }
    pub(crate) fn rejected_mut(
        &self,
    ) -> std::sync::RwLockWriteGuard<'_, BTreeMap<PodUid, Rejected>> {
        crate::sync::write(&self.rejected)
    }

    /// Wakes the reconciler and the status watchers (a pod's waiters: [`Inner::notify_pod`]).
    pub(crate) fn notify_changed(&self) {
        self.changed.send_modify(|g| *g += 1);
        self.wake.notify_one();
    }

    /// The signal a pod's waiters sleep on.
    pub(crate) fn pod_signal(&self, uid: &PodUid) -> Arc<Notify> {
        crate::sync::lock(&self.pod_signals)
            .entry(uid.clone())
            .or_default()
            .clone()
    }

    /// Wakes one pod's waiters.
    pub(crate) fn notify_pod(&self, uid: &PodUid) {
        let signal = crate::sync::lock(&self.pod_signals).get(uid).cloned();
        if let Some(s) = signal {
            s.notify_waiters();
        }
    }

    /// Forgets a gone pod's signal unless a waiter still holds it.
    pub(crate) fn forget_pod_signal(&self, uid: &PodUid) {
        let mut map = crate::sync::lock(&self.pod_signals);
        if map.get(uid).is_some_and(|s| Arc::strong_count(s) == 1) {
            map.remove(uid);
        }
    }

    /// Where the pod came from, for messages.
    pub(crate) fn origin_of(&self, uid: &PodUid) -> String {
        self.store
            .pod(uid)
            .map(|p| p.origin.to_string())
            .unwrap_or_else(|| "source removed".into())
    }

    fn volume_type(&self, plugin: &str) -> String {
        self.plugins
            .by_name(plugin)
            .map(|p| p.source_field().to_string())
            .unwrap_or_else(|| plugin.to_string())
    }

    /// Whether every volume the pod's containers use is mounted (the cheap check waiters run on
    /// every wake; [`Inner::pod_status`] builds the full picture).
    pub(crate) fn pod_ready(&self, uid: &PodUid) -> bool {
        let dsw = self.dsw();
        let Some(dp) = dsw.pod(uid) else { return false };
        if !dp.failed_to_process.is_empty() {
            return false;
        }
        let asw = self.asw();
        // Fewer mounted than wanted: not ready, without looking at each volume (a pod with
        // thousands of volumes is asked after each of their set-ups).
        if asw.mounted_count(uid) < dp.volumes.len() {
            return false;
        }
        // A teardown under way (the pod is back while its volume is being unmounted) makes
        // the volume not ready, although the actual state still says mounted.
        dp.volumes.values().all(|u| {
            asw.pod_volume(u, uid)
                .is_some_and(|m| m.state == PodMountState::Mounted)
                && !self
                    .executor
                    .tearing_down(&kubevol_core::reconcile::OperationKey {
                        volume: u.clone(),
                        pod: Some(uid.clone()),
                    })
        })
    }

    /// Builds one pod's status from both states of world and the executor's errors.
    pub(crate) fn pod_status(&self, uid: &PodUid, with_events: bool) -> Option<PodStatus> {
        let events = if with_events {
            self.events.for_pod(uid)
        } else {
            Vec::new()
        };
        if let Some(r) = self.rejected().get(uid) {
            if self.dsw().pod(uid).is_none() {
                return Some(PodStatus {
                    namespace: r.pod_ref.namespace.clone(),
                    name: r.pod_ref.name.clone(),
                    uid: uid.to_string(),
                    source: r.origin.to_string(),
                    phase: PodPhase::Rejected,
                    errors: r.errors.clone(),
                    volumes: Vec::new(),
                    events,
                });
            }
        }
        let now = Instant::now();
        let dsw = self.dsw();
        let asw = self.asw();
        let mut volumes = Vec::new();
        let (pod_ref, phase) = if let Some(dp) = dsw.pod(uid) {
            let mut all_mounted = true;
            let mut any_failed = !dp.failed_to_process.is_empty();
            for (outer, unique) in &dp.volumes {
                let plugin = dsw
                    .volume(unique)
                    .map(|v| v.traits.plugin.clone())
                    .unwrap_or_default();
                let mounted = asw.pod_volume(unique, uid);
                let err = self.executor.last_error_for(unique, uid);
                let state = match (mounted.map(|m| m.state), &err) {
                    (Some(PodMountState::Mounted), _) => VolumePhase::Mounted,
                    (Some(PodMountState::Uncertain), _) => VolumePhase::Uncertain,
                    (None, Some(_)) => VolumePhase::Failed,
                    (None, None) => VolumePhase::Pending,
                };
                all_mounted &= state == VolumePhase::Mounted;
                any_failed |= state != VolumePhase::Mounted && err.is_some();
                volumes.push(VolumeStatus {
                    name: outer.clone(),
                    type_: self.volume_type(&plugin),
                    unique_name: Some(unique.to_string()),
                    state,
                    path: mounted.map(|m| m.path.display().to_string()),
                    read_only: mounted.is_some_and(|m| m.read_only),
                    retry: RetryInfo::from_error(err.as_ref(), now),
                });
            }
            let stored = self.store.pod(uid);
            for (outer, why) in &dp.failed_to_process {
                let type_ = stored
                    .as_ref()
                    .and_then(|p| p.pod.spec.as_ref())
                    .and_then(|s| s.volumes.as_ref())
                    .and_then(|vs| vs.iter().find(|v| &v.name == outer))
                    .and_then(|v| {
                        kubevol_core::validation::volume_source_names(v)
                            .first()
                            .copied()
                    })
                    .unwrap_or("unknown");
                volumes.push(VolumeStatus {
                    name: outer.clone(),
                    type_: type_.to_string(),
                    unique_name: None,
                    state: VolumePhase::Unsupported,
                    path: None,
                    read_only: false,
                    retry: RetryInfo {
                        last_error: Some(why.clone()),
                        ..RetryInfo::default()
                    },
                });
            }
            let phase = if any_failed {
                PodPhase::Failed
            } else if all_mounted {
                PodPhase::Ready
            } else {
                PodPhase::Pending
            };
            (dp.pod_ref.clone(), phase)
        } else {
            let mut pod_ref = None;
            for (unique, m) in asw.pod_volumes(uid) {
                pod_ref = Some(m.pod_ref.clone());
                let err = self.executor.last_error_for(unique, uid);
                volumes.push(VolumeStatus {
                    name: m.outer_volume_name.clone(),
                    type_: self.volume_type(
                        &asw.volume(unique)
                            .map(|v| v.traits.plugin.clone())
                            .unwrap_or_default(),
                    ),
                    unique_name: Some(unique.to_string()),
                    state: VolumePhase::Unmounting,
                    path: Some(m.path.display().to_string()),
                    read_only: m.read_only,
                    retry: RetryInfo::from_error(err.as_ref(), now),
                });
            }
            (pod_ref?, PodPhase::Terminating)
        };
        volumes.sort_by(|a, b| a.name.cmp(&b.name));
        Some(PodStatus {
            namespace: pod_ref.namespace.clone(),
            name: pod_ref.name.clone(),
            uid: uid.to_string(),
            source: self.origin_of(uid),
            phase,
            errors: Vec::new(),
            volumes,
            events,
        })
    }
}

impl crate::status::RetryInfo {
    fn from_error(err: Option<&crate::executor::LastError>, now: Instant) -> Self {
        crate::status::RetryInfo {
            last_error: err.map(|e| e.message.clone()),
            failures: err.map(|e| e.failures).unwrap_or(0),
            next_retry_ms: err
                .filter(|e| e.retry_at > now)
                .map(|e| (e.retry_at - now).as_millis() as u64),
        }
    }
}

/// Runs one of the manager's loops until it returns, starting it again if it panics: a bug hit
/// by one input must not leave the node without a populator or reconciler.
async fn supervise<F, Fut>(name: &'static str, inner: Arc<Inner>, run: F)
where
    F: Fn(Arc<Inner>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        match tokio::spawn(run(inner.clone())).await {
            Err(e) if e.is_panic() && !*inner.shutdown.borrow() => {
                tracing::error!("the {name} panicked; starting it again: {e}");
            }
            _ => return,
        }
    }
}

/// The volume manager. Cheap to clone; all clones share one manager.
#[derive(Clone)]
pub struct VolumeManager {
    pub(crate) inner: Arc<Inner>,
}

impl VolumeManager {
    /// A manager with the standard plugins over `mounter`. Creates the root directory.
    pub fn new(config: Config, mounter: Arc<dyn Mounter>) -> std::io::Result<Self> {
        Self::with_plugins(config, mounter, PluginRegistry::standard())
    }

    /// A manager with a chosen plugin registry.
    pub fn with_plugins(
        config: Config,
        mounter: Arc<dyn Mounter>,
        plugins: PluginRegistry,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(config.root_dir.join("pods"))?;
        let root = std::fs::canonicalize(&config.root_dir)?;
        let config = Config {
            root_dir: root.clone(),
            ..config
        };
        let root_dir = kubevol_mount::safe::Dir::open(&root).map_err(std::io::Error::other)?;
        let store = Arc::new(ObjectStore::new());
        let metrics = Arc::new(Metrics::default());
        let csi = Arc::new(crate::csi::Drivers::new(
            config.csi_timeout,
            metrics.clone(),
        ));
        for (name, endpoint) in &config.csi_controllers {
            csi.set_controller(name, endpoint.clone());
        }
        let record = Arc::new(crate::record::Record::open(&root)?);
        let host = Arc::new(PluginHost {
            csi,
            record,
            allow_lazy_unmount: config.allow_lazy_unmount,
            root,
            root_dir,
            mounter,
            host_path_allow: config.host_path_allow.clone(),
            hugepages_dir: config.hugepages_dir.clone(),
            store: store.clone(),
            node_name: config.node_name.clone(),
            node_allocatable: config
                .node_allocatable
                .unwrap_or_else(|| crate::node::allocatable(&config.root_dir)),
        });
        Ok(VolumeManager {
            inner: Arc::new(Inner {
                executor: Executor::new(config.backoff),
                content_generation: std::sync::atomic::AtomicU64::new(0),
                operations: crate::slots::Slots::new(config.max_concurrent_operations),
                config,
                store,
                plugins,
                host,
                dsw: RwLock::default(),
                asw: RwLock::default(),
                rejected: RwLock::default(),
                events: EventRecorder::default(),
                metrics,
                changed: watch::channel(0).0,
                wake: Notify::new(),
                dsw_synced: AtomicBool::new(false),
                states_synced: AtomicBool::new(false),
                pending_since: Mutex::default(),
                pod_signals: Mutex::default(),
                shutdown: watch::channel(false).0,
                reconstruction: Mutex::default(),
                leftovers: Mutex::default(),
            }),
        })
    }

    /// The manager's configuration (with the root directory made absolute).
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The object store that pod sources write to.
    pub fn store(&self) -> &Arc<ObjectStore> {
        &self.inner.store
    }

    /// Runs the populator and the reconciler until [`VolumeManager::shutdown`].
    ///
    /// First the actual state is reconstructed from the record, the pods directory and the
    /// mount table; nothing is torn down until every pod source has listed its pods.
    pub async fn run(&self) {
        crate::reconstruct::at_start(&self.inner).await;
        let missing = crate::csi::register_at_start(&self.inner).await;
        let populator = tokio::spawn(supervise(
            "populator",
            self.inner.clone(),
            crate::populator::run,
        ));
        let reconciler = tokio::spawn(supervise(
            "reconciler",
            self.inner.clone(),
            crate::reconciler::run,
        ));
        let csi = tokio::spawn(crate::csi::run(self.inner.clone(), missing));
        let sweep = tokio::spawn(crate::reconstruct::sweep_loop(self.inner.clone()));
        let _ = tokio::join!(populator, reconciler);
        csi.abort();
        sweep.abort();
        let _ = csi.await;
        let _ = sweep.await;
    }

    /// What reconstruction found at start.
    pub fn reconstruction(&self) -> crate::reconstruct::Reconstruction {
        crate::sync::lock(&self.inner.reconstruction).clone()
    }

    /// Orphaned pod directories kubevol could not remove (something other than empty
    /// directories is left in them).
    pub fn leftovers(&self) -> Vec<crate::reconstruct::Leftover> {
        crate::sync::lock(&self.inner.leftovers)
            .values()
            .cloned()
            .collect()
    }

    /// The CSI drivers kubevol knows.
    pub fn csi_drivers(&self) -> Vec<crate::csi::DriverStatus> {
        self.inner.host.csi.status()
    }

    /// Stops [`VolumeManager::run`]. Mounts stay in place (pods keep their volumes).
    pub fn shutdown(&self) {
        self.inner.shutdown.send_replace(true);
        self.inner.notify_changed();
    }

    /// Adds or replaces a pod (the library's pod source). Returns its UID.
    pub fn add_pod(&self, pod: Pod) -> PodUid {
        self.inner.store.upsert_pod(pod)
    }

    /// Adds or replaces many pods at once (one wake-up of the populator, as a manifest file with
    /// many pods is delivered). Returns their UIDs.
    pub fn add_pods(&self, pods: impl IntoIterator<Item = Pod>) -> Vec<PodUid> {
        self.inner.store.upsert_pods(pods)
    }

    /// Removes many pods at once: their volumes are torn down.
    pub fn remove_pods(&self, pods: &[Pod]) {
        let uids: Vec<PodUid> = pods.iter().map(pod_uid).collect();
        self.inner.store.remove_pods(&uids);
    }

    /// Removes a pod added with [`VolumeManager::add_pod`]: its volumes are torn down.
    pub fn remove_pod(&self, pod: &Pod) {
        self.inner.store.remove_pod(&pod_uid(pod));
    }

    async fn wait_until(
        &self,
        pod: &Pod,
        mut done: impl FnMut(&Inner, &PodUid) -> Result<bool, WaitError>,
        describe: impl Fn(&Inner, &PodUid) -> String,
    ) -> Result<(), WaitError> {
        let uid = pod_uid(pod);
        let deadline = Instant::now() + self.inner.config.wait_timeout;
        let signal = self.inner.pod_signal(&uid);
        let mut stop = self.inner.shutdown.subscribe();
        loop {
            // Register for the next signal before checking, so a change in between is not lost.
            let notified = signal.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if done(&self.inner, &uid)? {
                return Ok(());
            }
            if *stop.borrow_and_update() {
                return Err(WaitError::Stopped);
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {
                    let name = format!(
                        "{}/{}",
                        pod.metadata.namespace.as_deref().unwrap_or(crate::store::DEFAULT_NAMESPACE),
                        pod.metadata.name.as_deref().unwrap_or("")
                    );
                    return Err(WaitError::Timeout {
                        pod: name,
                        timeout: self.inner.config.wait_timeout,
                        detail: describe(&self.inner, &uid),
                    });
                }
                _ = stop.changed() => return Err(WaitError::Stopped),
            }
        }
    }

    /// Waits until every volume the pod's containers use is mounted. Woken by state changes;
    /// times out after the configured wait (2 min 3 s) with an error that lists the unmounted
    /// and failed-to-process volumes, each with its last error.
    pub async fn wait_for_attach_and_mount(&self, pod: &Pod) -> Result<(), WaitError> {
        self.wait_until(
            pod,
            |inner, uid| {
                if inner.pod_ready(uid) {
                    return Ok(true);
                }
                // Rejected, and no earlier valid version is desired: it will never be ready.
                match crate::sync::read(&inner.rejected).get(uid) {
                    Some(r) if inner.dsw().pod(uid).is_none() => Err(WaitError::Rejected {
                        pod: r.pod_ref.to_string(),
                        origin: r.origin.to_string(),
                        errors: r.errors.clone(),
                    }),
                    _ => Ok(false),
                }
            },
            |inner, uid| match inner.pod_status(uid, false) {
                None => "the pod is not known to the volume manager: add it to a pod source, and check its spec.nodeName".into(),
                Some(s) => {
                    let describe = |v: &VolumeStatus| match &v.retry.last_error {
                        Some(e) => format!("{} ({e})", v.name),
                        None => v.name.clone(),
                    };
                    let unmounted: Vec<String> = s
                        .volumes
                        .iter()
                        .filter(|v| v.state != VolumePhase::Mounted && v.state != VolumePhase::Unsupported)
                        .map(describe)
                        .collect();
                    let failed: Vec<String> = s.volumes.iter().filter(|v| v.state == VolumePhase::Unsupported).map(describe).collect();
                    format!("unmounted volumes=[{}], failed to process volumes=[{}]", unmounted.join(", "), failed.join(", "))
                }
            },
        )
        .await
    }

    /// Waits until nothing of the pod's is mounted any more (not even uncertainly).
    pub async fn wait_for_unmount(&self, pod: &Pod) -> Result<(), WaitError> {
        self.wait_until(
            pod,
            |inner, uid| Ok(inner.asw().pod_volumes(uid).next().is_none()),
            |inner, uid| {
                let names: Vec<String> = inner
                    .asw()
                    .pod_volumes(uid)
                    .map(|(n, m)| match inner.executor.last_error_for(n, uid) {
                        Some(e) => format!("{} ({})", m.outer_volume_name, e.message),
                        None => m.outer_volume_name.clone(),
                    })
                    .collect();
                format!("still mounted volumes=[{}]", names.join(", "))
            },
        )
        .await
    }

    /// Waits until none of `pods` has anything mounted.
    pub async fn wait_for_all_pods_unmount(&self, pods: &[Pod]) -> Result<(), WaitError> {
        let mut waits = tokio::task::JoinSet::new();
        for p in pods {
            let (m, p) = (self.clone(), p.clone());
            waits.spawn(async move { m.wait_for_unmount(&p).await });
        }
        let mut timeouts = Vec::new();
        while let Some(r) = waits.join_next().await {
            match r {
                Ok(Ok(())) => {}
                Ok(Err(WaitError::Timeout { detail, pod, .. })) => {
                    timeouts.push(format!("{pod}: {detail}"))
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(WaitError::Stopped),
            }
        }
        if timeouts.is_empty() {
            Ok(())
        } else {
            Err(WaitError::Timeout {
                pod: format!("{} of {} pods", timeouts.len(), pods.len()),
                timeout: self.inner.config.wait_timeout,
                detail: timeouts.join("; "),
            })
        }
    }

    /// The mounted volumes of a pod, keyed by the pod's volume name.
    pub fn mounted_volumes_for_pod(&self, uid: &PodUid) -> BTreeMap<String, MountedVolume> {
        self.inner
            .asw()
            .pod_volumes(uid)
            .filter(|(_, m)| m.state == PodMountState::Mounted)
            .map(|(_, m)| {
                (
                    m.outer_volume_name.clone(),
                    MountedVolume {
                        path: m.path.clone(),
                        read_only: m.read_only,
                        sub_paths: m.sub_paths.clone(),
                    },
                )
            })
            .collect()
    }

    /// Whether anything of the pod's may still be mounted (mounted or uncertain).
    pub fn has_possibly_mounted_volumes(&self, uid: &PodUid) -> bool {
        self.inner.asw().pod_volumes(uid).next().is_some()
    }

    /// The volumes the node must report as in use: attachable or device-mountable volumes that
    /// are desired or still on the node.
    pub fn volumes_in_use(&self) -> Vec<UniqueVolumeName> {
        let dsw = self.inner.dsw();
        let asw = self.inner.asw();
        let mut out: BTreeSet<UniqueVolumeName> = dsw
            .volumes()
            .filter(|v| v.traits.attachable || v.traits.device_mountable)
            .map(|v| v.name.clone())
            .collect();
        out.extend(
            asw.volumes()
                .filter(|v| v.traits.attachable || v.traits.device_mountable)
                .map(|v| v.name.clone()),
        );
        out.into_iter().collect()
    }

    /// Whether every pod source has synced and the reconciler has made a full pass since.
    pub fn reconciler_states_synced(&self) -> bool {
        self.inner.states_synced.load(Ordering::Acquire)
    }

    /// Whether a volume is attached to the node.
    pub fn volume_is_attached(&self, name: &UniqueVolumeName) -> bool {
        self.inner.asw().volume(name).is_some_and(|v| v.attached)
    }

    /// Records which volumes the node has reported as in use.
    pub fn mark_volumes_reported_in_use(&self, names: &[UniqueVolumeName]) {
        self.inner.dsw_mut().mark_reported_in_use(names);
    }

    /// Extra supplemental groups for a pod's containers: the `pv.beta.kubernetes.io/gid`
    /// annotations of the PersistentVolumes it has mounted, minus the groups the pod already has.
    pub fn extra_supplemental_groups_for_pod(&self, pod: &Pod) -> Vec<i64> {
        let uid = pod_uid(pod);
        let existing: BTreeSet<i64> = pod
            .spec
            .as_ref()
            .and_then(|s| s.security_context.as_ref())
            .and_then(|s| s.supplemental_groups.clone())
            .unwrap_or_default()
            .into_iter()
            .collect();
        let asw = self.inner.asw();
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

    /// One pod's status.
    pub fn pod_status(&self, uid: &PodUid) -> Option<PodStatus> {
        self.inner.pod_status(uid, true)
    }

    /// The whole status report.
    pub fn status(&self, with_events: bool) -> StatusReport {
        // The flag first: once true, the desired state read below is complete. Read after the
        // pods, it could pair a listing from before the first sync with "synced".
        let states_synced = self.reconciler_states_synced();
        let mut uids: BTreeSet<PodUid> = self
            .inner
            .dsw()
            .pods()
            .map(|p| p.pod_ref.uid.clone())
            .collect();
        uids.extend(self.inner.rejected().keys().cloned());
        uids.extend(self.inner.asw().pods().cloned());
        let mut pods: Vec<PodStatus> = uids
            .iter()
            .filter_map(|u| self.inner.pod_status(u, with_events))
            .collect();
        pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        StatusReport {
            node_name: self.inner.config.node_name.clone(),
            root_dir: self.inner.config.root_dir.display().to_string(),
            states_synced,
            pods,
            manifest_errors: self
                .inner
                .store
                .file_errors()
                .iter()
                .map(|e| e.to_string())
                .collect(),
            reconstruction: self.reconstruction(),
            leftovers: self.leftovers(),
        }
    }

    /// Every recorded event.
    pub fn events(&self) -> Vec<crate::events::Event> {
        self.inner.events.all()
    }

    /// The Prometheus text exposition.
    pub fn metrics_text(&self) -> String {
        let mut totals: BTreeMap<(String, &'static str), i64> = BTreeMap::new();
        for v in self.inner.dsw().volumes() {
            *totals
                .entry((v.traits.plugin.clone(), "desired_state_of_world"))
                .or_default() += v.pods.len() as i64;
        }
        for v in self.inner.asw().volumes() {
            *totals
                .entry((v.traits.plugin.clone(), "actual_state_of_world"))
                .or_default() += v.pods.len() as i64;
        }
        self.inner.metrics.render(&totals)
    }

    /// A receiver woken on every change of the status report: either state of world, an
    /// operation's outcome, or the object store (manifest errors). For status watchers; a pod's
    /// waiters sleep on the pod's own signal instead.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.changed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PersistentVolume, Volume};
    use kubevol_core::state::{MountedPodVolume, VolumeSpec, VolumeTraits};

    #[test]
    fn extra_supplemental_groups_come_from_mounted_persistent_volumes() {
        let t = tempfile::tempdir().unwrap();
        let m = VolumeManager::new(
            Config::new(t.path(), "n"),
            Arc::new(kubevol_mount::FakeMounter::new()),
        )
        .unwrap();
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {"containers": [], "securityContext": {"supplementalGroups": [5]}}
        }))
        .unwrap();
        let uid = pod_uid(&pod);
        let pv = |gid: &str| {
            let mut pv = PersistentVolume::default();
            pv.metadata.annotations =
                Some([("pv.beta.kubernetes.io/gid".to_string(), gid.to_string())].into());
            Arc::new(pv)
        };
        let traits = VolumeTraits {
            plugin: "test/pv".into(),
            attachable: false,
            device_mountable: false,
        };
        // (volume, PV gid annotation): 5 is already the pod's, "x" is not a number.
        for (name, gid) in [
            ("a", Some("1234")),
            ("b", Some("5")),
            ("c", Some("x")),
            ("d", None),
            ("e", Some("1234")),
        ] {
            let spec = Arc::new(VolumeSpec {
                volume: Volume {
                    name: name.into(),
                    ..Default::default()
                },
                persistent_volume: gid.map(pv),
                block: false,
            });
            m.inner.asw_mut().mark_pod_volume(
                &UniqueVolumeName(format!("test/pv/{name}")),
                &traits,
                uid.clone(),
                MountedPodVolume {
                    pod_ref: crate::populator::pod_ref(&pod, &uid),
                    outer_volume_name: name.into(),
                    spec,
                    state: PodMountState::Mounted,
                    path: PathBuf::from("/x"),
                    read_only: false,
                    content_generation: 0,
                    sub_paths: Vec::new(),
                },
            );
        }
        assert_eq!(m.extra_supplemental_groups_for_pod(&pod), vec![1234]);
    }
}
