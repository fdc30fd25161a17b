//! The [`VolumeManager`]: the library API. It composes the parts and holds no logic of its
//! own: the sources fill the store, the populator (holding the only DSW writer) turns it into
//! the desired state, the reconciler reads the world and starts operations, operations (holding
//! the ASW writer) run plugins, reconstruction rebuilds the actual state at start, and the
//! status, events and metrics read snapshots of it all.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::backoff::BackoffPolicy;
use kubevol_core::{PodUid, UniqueVolumeName};
use kubevol_mount::Mounter;
use tokio::sync::watch;

use crate::csi::Drivers;
use crate::inspect::status::{PodStatus, Sources, StatusReport};
use crate::operations::executor::Executor;
use crate::operations::Operations;
use crate::plugins::{PluginHost, PluginRegistry};
use crate::populator::Populator;
use crate::reconstruct::Findings;
use crate::report::events::EventRecorder;
use crate::report::metrics::Metrics;
use crate::source::{Library, PodSource};
use crate::store::{ObjectStore, PodIdentity};
use crate::waiters::{Wait, WaitError};
use crate::world::{AswWriter, MountedVolume, World};

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
    /// The least time between two rewrites of the volumes that show one ConfigMap or Secret,
    /// for changes of it ([`crate::populator::CONTENT_EVERY`], 1 s): changes that come sooner
    /// are one rewrite at the object's next turn. The change that brings an object its volumes
    /// wait for (its first listing, its creation) is never held back.
    pub content_pace: Duration,
    /// Whether a disk-backed emptyDir made where the filesystem accounts project quotas gets a
    /// project of its own, so that its usage is one `quotactl` rather than a walk
    /// (on; the daemon's `--no-project-quotas` turns it off).
    pub project_quotas: bool,
    /// How long a volume's fsGroup walk runs before its pod is warned
    /// (`VolumePermissionChangeInProgress`; kubelet: 30 s).
    pub fs_group_warning_after: Duration,
    /// How long one operation may run before its pod shows it as stalled and its slot is given
    /// to other operations (a hung filesystem or driver).
    pub operation_timeout: Duration,
    /// Whether an unmount that fails with EBUSY may detach the mount lazily (MNT_DETACH). Off:
    /// a busy volume is retried with backoff and the pod says why.
    pub allow_lazy_unmount: bool,
    /// This node's labels, which PersistentVolumes' nodeAffinity is checked against
    /// (`--node-labels`). `kubernetes.io/hostname` (the node name), `kubernetes.io/os` and
    /// `kubernetes.io/arch` are added unless given, as the kubelet labels its Node.
    pub node_labels: BTreeMap<String, String>,
    /// Whether pod directories under the root that kubevol never recorded (a kubelet's,
    /// another tool's, or left by a lost record) are taken as kubevol's own: their volumes
    /// reconstructed, torn down when no pod wants them, and their directories swept. Off: they
    /// are reported and left alone.
    pub adopt_foreign_pods: bool,
    /// Whether the node has SELinux, and its containers' default file context: detected (from
    /// `/sys/fs/selinux` and the policy's `lxc_contexts`) unless given.
    pub selinux: Selinux,
    /// The SELinuxMount feature (Kubernetes 1.37: GA, on by default): persistent volumes of
    /// every access mode, not only ReadWriteOncePod ones, are mounted with their SELinux label
    /// where their CSIDriver says `seLinuxMount`. `false` turns it off (ReadWriteOncePod only,
    /// as in 1.36).
    pub selinux_mount: bool,
    /// Where the built-in `kubevol.io/local-path` provisioner makes its volumes' directories
    /// (standalone mode); `None`: `<root_dir>/local-path`.
    pub local_path_dir: Option<PathBuf>,
}

/// Whether the node has SELinux.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Selinux {
    /// As the node says (`/sys/fs/selinux`).
    #[default]
    Detect,
    /// No SELinux: volumes are mounted without a label.
    Disabled,
    /// SELinux, with the containers' default file context
    /// (`system_u:object_r:container_file_t:s0`).
    Enabled {
        /// The default file context.
        file_context: String,
    },
}

impl Selinux {
    /// The default container file context, or `None` without SELinux.
    pub fn file_context(&self) -> Option<String> {
        match self {
            Selinux::Disabled => None,
            Selinux::Enabled { file_context } => Some(file_context.clone()),
            Selinux::Detect => crate::node::selinux_file_context(),
        }
    }
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
            content_pace: crate::populator::CONTENT_EVERY,
            project_quotas: true,
            operation_timeout: Duration::from_secs(120),
            fs_group_warning_after: crate::plugins::ownership::WARN_AFTER,
            allow_lazy_unmount: false,
            node_labels: BTreeMap::new(),
            adopt_foreign_pods: false,
            selinux: Selinux::Detect,
            selinux_mount: true,
            local_path_dir: None,
        }
    }
}

#[cfg(feature = "cluster")]
impl crate::source::cluster::NodeVolumes for VolumeManager {
    fn volumes_in_use(&self) -> Vec<UniqueVolumeName> {
        self.parts.world.volumes_in_use()
    }

    fn mark_reported(&self, names: &[UniqueVolumeName]) {
        self.parts.world.mark_reported_in_use(names);
    }

    fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.subscribe()
    }

    fn wait_for_reports(&self) {
        self.parts.world.require_reported_in_use();
    }
}

/// The node's CSI drivers as cluster mode's jobs see them ([`VolumeManager::node_drivers`]),
/// without the manager: what the manager's own parts hold (the attach controller) must not
/// hold the manager.
#[cfg(feature = "cluster")]
struct NodeDriversView {
    csi: Arc<Drivers>,
    store: Arc<ObjectStore>,
}

#[cfg(feature = "cluster")]
impl crate::source::cluster::NodeDrivers for NodeDriversView {
    fn csi_drivers(&self) -> Vec<crate::csi::DriverStatus> {
        self.csi.status()
    }

    fn driver_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.csi.subscribe()
    }

    fn allocatable_period(&self, driver: &str) -> Option<std::time::Duration> {
        let seconds = self
            .store
            .csi_driver(driver)?
            .object
            .spec
            .node_allocatable_update_period_seconds?;
        u64::try_from(seconds)
            .ok()
            .filter(|s| *s > 0)
            .map(std::time::Duration::from_secs)
    }

    fn object_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.store.subscribe()
    }

    fn refresh_allocatable(
        &self,
        driver: &str,
    ) -> crate::BoxFuture<Result<(i64, bool), crate::csi::CsiError>> {
        let (csi, driver) = (self.csi.clone(), driver.to_string());
        Box::pin(async move { csi.refresh_info(&driver).await })
    }
}

/// The parts, as the manager holds them to hand out.
struct Parts {
    config: Config,
    store: Arc<ObjectStore>,
    library: Library,
    world: Arc<World>,
    asw: AswWriter,
    executor: Arc<Executor>,
    operations: Arc<Operations>,
    plugins: PluginRegistry,
    host: Arc<PluginHost>,
    events: Arc<EventRecorder>,
    metrics: Arc<Metrics>,
    findings: Arc<Findings>,
    shutdown: watch::Sender<bool>,
    /// Taken by [`VolumeManager::run`]: the populator owns the DSW writer.
    populator: Mutex<Option<Populator>>,
    /// The locks of the root directory and of the local-path directory, held as long as any
    /// part of the manager lives.
    _locks: (crate::record::RootLock, crate::record::DirLock),
}

/// The volume manager. Cheap to clone; all clones share one manager.
#[derive(Clone)]
pub struct VolumeManager {
    parts: Arc<Parts>,
}

impl VolumeManager {
    /// A manager with the standard plugins over `mounter`. Creates the root directory and
    /// takes its lock (`<root>/kubevol.lock`) for as long as the manager lives: while another
    /// process holds it, this fails with `ResourceBusy`, naming the holder, and nothing is read
    /// or changed.
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
        // Before the record is read or anything touched: one owner per root.
        let lock = crate::record::RootLock::take(&root)?;
        let local_path_dir = config
            .local_path_dir
            .clone()
            .unwrap_or_else(|| root.join("local-path"));
        std::fs::create_dir_all(&local_path_dir)?;
        let local_path_lock = crate::record::DirLock::take_local_path(&local_path_dir, &root)?;
        let root_dir = kubevol_mount::safe::Dir::open(&root).map_err(std::io::Error::other)?;
        let store = Arc::new(ObjectStore::with_bindings(crate::store::Bindings::load(
            &root,
        )?));
        // The volumes provisioned before: there before any pod is looked at.
        store.add_provisioned(
            store
                .bindings()
                .provisioned()
                .into_iter()
                .map(crate::store::Object::PersistentVolume),
        );
        let library = Library::default();
        // Synced once run() knows which pods of the library the record holds.
        drop(Box::new(library.clone()).start(store.sink(Library::NAME)));
        let metrics = Arc::new(Metrics::default());
        let events = Arc::new(EventRecorder::default());
        let csi = Arc::new(Drivers::new(config.csi_timeout, metrics.clone()));
        for (name, endpoint) in &config.csi_controllers {
            csi.set_controller(name, endpoint.clone());
        }
        let record = Arc::new(crate::record::Record::open(&root)?);
        let (refresh, refreshes) = tokio::sync::mpsc::unbounded_channel();
        let host = Arc::new(PluginHost {
            tokens: Arc::default(),
            certificates: Arc::default(),
            plugin_dirs: Default::default(),
            attach_controller: std::sync::OnceLock::new(),
            trust_bundles: std::sync::OnceLock::new(),
            claim_status: std::sync::OnceLock::new(),
            refresh: crate::plugins::Refresher::new(refresh),
            content_usage: Default::default(),
            projects: crate::plugins::usage::Projects::new(config.project_quotas),
            usages: Default::default(),
            selinux_context: config.selinux.file_context(),
            selinux_mount_all: config.selinux_mount,
            metrics: metrics.clone(),
            events: events.clone(),
            health: Arc::default(),
            ownership: crate::plugins::ownership::Walks::warning_after(
                config.fs_group_warning_after,
            ),
            csi,
            record,
            allow_lazy_unmount: config.allow_lazy_unmount,
            root,
            root_dir,
            mounter,
            host_path_allow: config.host_path_allow.clone(),
            hugepages_dir: config.hugepages_dir.clone(),
            local_path_dir,
            store: store.clone(),
            node_name: config.node_name.clone(),
            node_labels: config.node_labels.clone(),
            node_allocatable: config
                .node_allocatable
                .unwrap_or_else(|| crate::node::allocatable(&config.root_dir)),
        });
        let (world, dsw, asw) = World::new();
        let executor = Arc::new(Executor::new(config.backoff));
        let operations = Operations::new(crate::operations::Setup {
            executor: executor.clone(),
            slots: config.max_concurrent_operations,
            plugins: plugins.clone(),
            host: host.clone(),
            asw: asw.clone(),
            events: events.clone(),
            metrics: metrics.clone(),
            store: store.clone(),
            timeout: config.operation_timeout,
        });
        let populator = Populator::new(
            store.clone(),
            dsw,
            plugins.clone(),
            host.clone(),
            events.clone(),
            executor.clone(),
            refreshes,
        )
        .pacing(config.content_pace);
        Ok(VolumeManager {
            parts: Arc::new(Parts {
                config,
                store,
                library,
                world,
                asw,
                executor,
                operations,
                plugins,
                host,
                events,
                metrics,
                findings: Arc::default(),
                shutdown: watch::channel(false).0,
                populator: Mutex::new(Some(populator)),
                _locks: (lock, local_path_lock),
            }),
        })
    }

    /// The manager's configuration (with the root directory made absolute).
    pub fn config(&self) -> &Config {
        &self.parts.config
    }

    /// The object store the pod sources fill (read it; sources write through their
    /// [`Sink`](crate::source::Sink)).
    pub fn store(&self) -> &Arc<ObjectStore> {
        &self.parts.store
    }

    /// The library API's pod source: pods, ConfigMaps, Secrets and other objects given by
    /// calls ([`VolumeManager::add_pod`] and friends use it).
    pub fn library(&self) -> &Library {
        &self.parts.library
    }

    /// Lets `controller` (a cluster's attach/detach controller) attach volumes instead of
    /// kubevol calling ControllerPublishVolume: an attachable CSI volume waits until the
    /// controller reports it attached, and is never detached by kubevol. Set once, before any
    /// volume is attached.
    pub fn set_attach_controller(&self, controller: Arc<dyn crate::plugins::AttachController>) {
        let _ = self.parts.host.attach_controller.set(controller);
    }

    /// The node's CSI drivers for cluster mode's jobs, holding only the drivers and the store
    /// (not the manager: a part of the manager may keep it).
    #[cfg(feature = "cluster")]
    pub fn node_drivers(&self) -> Arc<dyn crate::source::cluster::NodeDrivers> {
        Arc::new(NodeDriversView {
            csi: self.parts.host.csi.clone(),
            store: self.parts.store.clone(),
        })
    }

    /// Sets where claims' statuses are written (in cluster mode,
    /// [`ClusterClaims`](crate::source::cluster::ClusterClaims)): the node's part of an
    /// expansion. Set once.
    pub fn set_claim_status_writer(&self, writer: Arc<dyn crate::plugins::ClaimStatusWriter>) {
        let _ = self.parts.host.claim_status.set(writer);
    }

    /// Sets where `clusterTrustBundle` projected sources are read (in cluster mode,
    /// [`ClusterTrustBundles`](crate::source::cluster::ClusterTrustBundles)). Set once.
    pub fn set_trust_bundles(&self, bundles: Arc<dyn crate::plugins::TrustBundles>) {
        let _ = self.parts.host.trust_bundles.set(bundles);
    }

    /// Sets who issues service account tokens for `serviceAccountToken` projected sources (in
    /// cluster mode, [`ClusterTokens`](crate::source::cluster::ClusterTokens)). Without one,
    /// such a source fails its volume with a clear message.
    pub fn set_token_issuer(&self, issuer: Arc<dyn crate::tokens::TokenIssuer>) {
        self.parts.host.tokens.set_issuer(issuer);
    }

    /// Sets where `podCertificate` sources' requests are made (in cluster mode,
    /// [`ClusterCertificates`](crate::source::cluster::ClusterCertificates)). Set once.
    pub fn set_certificate_requests(
        &self,
        requests: Arc<dyn crate::certificates::CertificateRequests>,
    ) {
        self.parts.host.certificates.set_requests(requests);
    }

    /// What asks for a pod to be processed again, as if something it reads had changed (a
    /// request for its certificates was answered).
    #[cfg(feature = "cluster")]
    pub(crate) fn refresher(&self) -> crate::plugins::Refresher {
        self.parts.host.refresh.clone()
    }

    /// Sends every warning about a pod to `sink` too, besides the status API (in cluster mode,
    /// [`EventPoster`](crate::source::cluster::EventPoster) posts them to the API server). A
    /// successful set-up, the one normal event, stays in the status API and the log, as the
    /// kubelet no longer posts it. A sink that falls behind loses events rather than slowing
    /// the volume manager.
    pub fn set_event_sink(&self, sink: tokio::sync::mpsc::Sender<crate::report::events::PodEvent>) {
        self.parts.events.set_sink(sink);
    }

    /// Starts a pod source (a manifest directory, ...): it is registered in the sync gate
    /// now, so nothing is torn down until it has delivered its first listing, and runs as its
    /// own task until the returned handle is aborted.
    pub fn add_source(&self, source: impl PodSource) -> tokio::task::JoinHandle<()> {
        let sink = self.parts.store.sink(source.name());
        tokio::spawn(Box::new(source).start(sink))
    }

    /// Runs the populator and the reconciler until [`VolumeManager::shutdown`].
    ///
    /// First the actual state is reconstructed from the record, the pods directory and the
    /// mount table; nothing is torn down until every pod source has listed its pods. A manager
    /// runs once: a second call returns at once.
    pub async fn run(&self) {
        let p = &self.parts;
        let Some(populator) = crate::sync::lock(&p.populator).take() else {
            tracing::warn!("VolumeManager::run was called again; the manager runs once");
            return;
        };
        let recorded = crate::reconstruct::at_start(
            p.asw.clone(),
            p.host.clone(),
            p.plugins.clone(),
            &p.metrics,
            &p.findings,
            p.config.adopt_foreign_pods,
        )
        .await;
        // The pods whose volumes are mounted keep their UIDs, whatever a source gave first.
        let held: Vec<_> = {
            let asw = p.world.asw();
            asw.volumes()
                .flat_map(|v| v.pods.values())
                .map(|m| {
                    let r = &m.pod_ref;
                    (r.uid.clone(), (r.namespace.to_string(), r.name.to_string()))
                })
                .collect()
        };
        p.store.hold_pod_uids(held);
        let registry = p.host.root.join(crate::csi::registration::REGISTRY_DIR);
        let at_start =
            crate::csi::register_at_start(&p.host.csi, &registry, &p.config.csi_drivers).await;
        let stop = p.shutdown.subscribe();
        p.library.awaiting(recorded.library);
        let populator = tokio::spawn(populator.holding(recorded.files).run(stop.clone()));
        let reconciler = tokio::spawn(crate::reconciler::run(
            p.operations.clone(),
            p.config.resync_period,
            stop.clone(),
        ));
        let mut beside = tokio::task::JoinSet::new();
        beside.spawn(crate::csi::run(p.host.csi.clone(), registry, at_start));
        beside.spawn(retry_csi_on_registration(
            p.host.csi.clone(),
            p.executor.clone(),
            p.world.clone(),
        ));
        beside.spawn(crate::plugins::csi::stats_loop(
            p.world.clone(),
            p.host.clone(),
            p.metrics.clone(),
            p.config.volume_stats_period,
        ));
        beside.spawn(crate::memory::trim_after_storms(
            p.world.clone(),
            stop.clone(),
        ));
        beside.spawn(crate::storage::run(
            p.host.clone(),
            p.world.clone(),
            stop.clone(),
        ));
        beside.spawn(crate::reconstruct::sweep_loop(
            crate::reconstruct::Sweep {
                world: p.world.clone(),
                host: p.host.clone(),
                events: p.events.clone(),
                metrics: p.metrics.clone(),
                findings: p.findings.clone(),
                period: p.config.resync_period,
            },
            stop,
        ));
        let _ = tokio::join!(populator, reconciler);
        p.operations.stop().await;
        beside.abort_all();
        while beside.join_next().await.is_some() {}
        // The outcomes operations queued without waiting.
        p.host.record.flush().await;
    }

    /// What reconstruction found at start.
    pub fn reconstruction(&self) -> crate::reconstruct::Reconstruction {
        self.parts.findings.reconstruction()
    }

    /// Orphaned pod directories kubevol could not remove (something other than empty
    /// directories is left in them).
    pub fn leftovers(&self) -> Vec<crate::reconstruct::Leftover> {
        self.parts.findings.leftovers()
    }

    /// The health CSI drivers report of the node's volumes and of their storage.
    pub fn health(&self) -> Arc<crate::report::health::Health> {
        self.parts.host.health.clone()
    }

    /// `/stats/summary`: each mounted emptyDir's usage, in the kubelet's Summary API's shape;
    /// measured now unless the last measure is younger than `volume_stats_period`, each volume
    /// by one of kubevol's own measuring threads at a time (never the runtime's blocking pool).
    /// Waits at most [`crate::plugins::usage::STATS_WAIT`] for the measurements; a volume
    /// still being measured then has its last measure, whose `time` says how old it is.
    pub async fn stats_summary(&self) -> serde_json::Value {
        let max_age = self.parts.config.volume_stats_period;
        crate::plugins::usage::refresh(&self.parts.host, &self.parts.world, max_age).await;
        crate::inspect::summary::summary(&self.status(false), &self.parts.host.usages.all())
    }

    /// How many emptyDir volumes are being measured for `/stats/summary` (or wait for a
    /// thread), and how many threads measure them.
    pub fn usage_measurements(&self) -> (usize, usize) {
        self.parts.host.usages.measuring()
    }

    /// Whether a pod came from the API server (holding only the store).
    #[cfg(feature = "cluster")]
    pub(crate) fn api_server_pods(&self) -> Arc<dyn Fn(&PodUid) -> bool + Send + Sync> {
        let store = self.parts.store.clone();
        Arc::new(move |uid| {
            store
                .pod(uid)
                .is_some_and(|p| matches!(p.origin(), crate::store::Origin::Cluster))
        })
    }

    /// The CSI drivers kubevol knows.
    pub fn csi_drivers(&self) -> Vec<crate::csi::DriverStatus> {
        let mut drivers = self.parts.host.csi.status();
        let storage = self.parts.host.health.storage();
        for d in &mut drivers {
            d.storage_health = storage.get(&d.name).cloned().unwrap_or_default();
        }
        drivers
    }

    /// Stops [`VolumeManager::run`]. Mounts stay in place (pods keep their volumes).
    pub fn shutdown(&self) {
        self.parts.shutdown.send_replace(true);
        self.parts.world.notify_all_pods();
        self.parts.world.announce();
        self.parts.world.wake_reconciler();
    }

    /// Adds or replaces a pod (through the library source). Returns its UID.
    pub fn add_pod(&self, pod: Pod) -> PodUid {
        self.add_pods([pod]).remove(0)
    }

    /// Adds or replaces many pods at once (one wake-up of the populator, as a manifest file with
    /// many pods is delivered). Returns their UIDs.
    pub fn add_pods(&self, pods: impl IntoIterator<Item = Pod>) -> Vec<PodUid> {
        self.parts.library.add_pods(pods)
    }

    /// Removes many pods at once: their volumes are torn down.
    pub fn remove_pods(&self, pods: &[impl PodIdentity]) {
        let uids: Vec<PodUid> = pods.iter().map(PodIdentity::uid).collect();
        self.parts.library.remove_pods(&uids);
    }

    /// Removes a pod added with [`VolumeManager::add_pod`]: its volumes are torn down.
    pub fn remove_pod(&self, pod: &impl PodIdentity) {
        self.remove_pods(std::slice::from_ref(pod));
    }

    /// Read views of every part, for the status and the waiters.
    fn sources(&self) -> Sources<'_> {
        let p = &self.parts;
        Sources {
            world: &p.world,
            executor: &p.executor,
            store: &p.store,
            plugins: &p.plugins,
            events: &p.events,
            health: &p.host.health,
            findings: &p.findings,
            node_name: &p.config.node_name,
            root_dir: &p.config.root_dir,
        }
    }

    fn wait(&self) -> Wait<'_> {
        Wait {
            sources: self.sources(),
            timeout: self.parts.config.wait_timeout,
            stop: &self.parts.shutdown,
        }
    }

    /// Waits until every volume the pod's containers use is mounted. Woken by state changes;
    /// times out after the configured wait (2 min 3 s) with an error that lists the unmounted
    /// and failed-to-process volumes, each with its last error.
    pub async fn wait_for_attach_and_mount(&self, pod: &impl PodIdentity) -> Result<(), WaitError> {
        self.wait().attach_and_mount(pod.pod_ref()).await
    }

    /// Waits until nothing of the pod's is mounted any more (not even uncertainly).
    pub async fn wait_for_unmount(&self, pod: &impl PodIdentity) -> Result<(), WaitError> {
        self.wait().unmount(pod.pod_ref()).await
    }

    /// Waits until none of `pods` has anything mounted. The pods share one deadline and are
    /// waited for in turn: a pod whose volumes went while an earlier one was waited for costs
    /// one look, not a task and a timer of its own (a node's teardown storm is thousands).
    pub async fn wait_for_all_pods_unmount(
        &self,
        pods: &[impl PodIdentity],
    ) -> Result<(), WaitError> {
        let deadline = tokio::time::Instant::now() + self.parts.config.wait_timeout;
        let mut timeouts = Vec::new();
        for p in pods {
            match self.wait().unmount_by(p.pod_ref(), deadline).await {
                Ok(()) => {}
                Err(WaitError::Timeout { detail, pod, .. }) => {
                    timeouts.push(format!("{pod}: {detail}"))
                }
                Err(e) => return Err(e),
            }
        }
        if timeouts.is_empty() {
            Ok(())
        } else {
            Err(WaitError::Timeout {
                pod: format!("{} of {} pods", timeouts.len(), pods.len()),
                timeout: self.parts.config.wait_timeout,
                detail: timeouts.join("; "),
            })
        }
    }

    /// The mounted volumes of a pod, keyed by the pod's volume name.
    pub fn mounted_volumes_for_pod(&self, uid: &PodUid) -> BTreeMap<String, MountedVolume> {
        self.parts.world.mounted_volumes(uid)
    }

    /// What `container` of `pod` gets of the pod's mounted volumes, as the kubelet's
    /// `makeMounts` and `makeDevices` make it (see [`crate::containers`]): call it once
    /// [`VolumeManager::wait_for_attach_and_mount`] has returned, and hand the result (or its
    /// CRI or OCI form) to the container runtime.
    pub fn container_mounts(
        &self,
        pod: &Pod,
        container: &str,
    ) -> Result<crate::containers::ContainerMounts, crate::containers::ContainerMountsError> {
        let host = &self.parts.host;
        let mounted = self.mounted_volumes_for_pod(&crate::pod_uid(pod));
        crate::containers::Resolver {
            expand: &|c, index, m| {
                let expanded = crate::operations::subpath::sub_path_of(host, pod, c, index, m);
                expanded
                    .map(|p| p.map(|(path, _secrets)| path))
                    .map_err(|e| e.to_string())
            },
            propagate: &|path, propagation| {
                crate::containers::propagating(host.mounter.as_ref(), path, propagation)
            },
            recursive_read_only: kubevol_mount::recursive_read_only_supported(),
        }
        .resolve(pod, container, &mounted)
    }

    /// Whether anything of the pod's may still be mounted (mounted or uncertain).
    pub fn has_possibly_mounted_volumes(&self, uid: &PodUid) -> bool {
        self.parts.world.has_possibly_mounted_volumes(uid)
    }

    /// The volumes the node must report as in use: attachable or device-mountable volumes that
    /// are desired or still on the node.
    pub fn volumes_in_use(&self) -> Vec<UniqueVolumeName> {
        self.parts.world.volumes_in_use()
    }

    /// How many passes the reconciler has made. A pass counted after a change (a pod removed,
    /// a volume's state changed) has planned that change: what it did not start, it decided
    /// not to start.
    pub fn reconciler_passes(&self) -> u64 {
        self.parts.world.reconciler_passes()
    }

    /// The version of the store (the count of its changes, as [`ObjectStore::subscribe`]
    /// gives it) that the storage controllers of standalone mode have decided on: every change
    /// up to it has been looked at by the binder, the provisioners, growth and reclaim.
    ///
    /// [`ObjectStore::subscribe`]: crate::store::ObjectStore::subscribe
    pub fn storage_seen(&self) -> u64 {
        self.parts.world.storage_seen()
    }

    /// Whether every pod source has synced and the reconciler has made a full pass since.
    pub fn reconciler_states_synced(&self) -> bool {
        self.parts.world.states_synced()
    }

    /// Whether a volume is attached to the node.
    pub fn volume_is_attached(&self, name: &UniqueVolumeName) -> bool {
        self.parts.world.volume_is_attached(name)
    }

    /// Records which volumes the node has reported as in use.
    pub fn mark_volumes_reported_in_use(&self, names: &[UniqueVolumeName]) {
        self.parts.world.mark_reported_in_use(names);
    }

    /// Extra supplemental groups for a pod's containers: the `pv.beta.kubernetes.io/gid`
    /// annotations of the PersistentVolumes it has mounted, minus the groups the pod already has.
    pub fn extra_supplemental_groups_for_pod(&self, pod: &Pod) -> Vec<i64> {
        self.parts.world.extra_supplemental_groups(pod)
    }

    /// One pod's status.
    pub fn pod_status(&self, uid: &PodUid) -> Option<PodStatus> {
        self.sources().pod(uid, true)
    }

    /// The whole status report.
    pub fn status(&self, with_events: bool) -> StatusReport {
        self.sources().report(with_events)
    }

    /// A pod, described: for each of its volumes the chain of what it depends on, where each
    /// step stands and what it is stuck on (see [`crate::inspect::describe`]).
    pub fn describe_pod(&self, uid: &PodUid) -> Option<crate::describe::PodDescription> {
        self.sources().describe_pod(uid, &self.parts.host)
    }

    /// The UID of the pod `namespace/name` that either state of world knows.
    pub fn find_pod(&self, namespace: &str, name: &str) -> Option<PodUid> {
        let is =
            |p: &kubevol_core::PodRef| p.namespace.as_str() == namespace && p.name.as_str() == name;
        let world = &self.parts.world;
        let wanted = world
            .dsw()
            .pods()
            .find(|p| is(&p.pod_ref))
            .map(|p| p.pod_ref.uid.clone());
        wanted
            .or_else(|| {
                let rejected = world.rejected();
                rejected
                    .values()
                    .find(|r| is(&r.pod_ref))
                    .map(|r| r.pod_ref.uid.clone())
            })
            .or_else(|| {
                let asw = world.asw();
                let found = asw
                    .volumes()
                    .flat_map(|v| v.pods.values())
                    .find(|m| is(&m.pod_ref))
                    .map(|m| m.pod_ref.uid.clone());
                found
            })
    }

    /// The node, described: sources, drivers, counts per state, what is not ready and why,
    /// the volumes in use and attached, and what was found at start.
    pub fn describe_node(&self) -> crate::describe::NodeDescription {
        self.sources()
            .describe_node(self.status(false), self.csi_drivers())
    }

    /// Every recorded event.
    pub fn events(&self) -> Vec<crate::report::events::Event> {
        self.parts.events.all()
    }

    /// How many content rewrites (of ConfigMap, Secret, projected and downwardAPI volumes) were
    /// held back to their turn so far: an object's or a volume's changes come faster than one a
    /// second, and the writes meanwhile are one write of the latest.
    pub fn content_rewrites_held(&self) -> u64 {
        self.parts.world.rewrites_held()
    }

    /// The Prometheus text exposition.
    pub fn metrics_text(&self) -> String {
        let metrics = &self.parts.metrics;
        metrics.set_pod_certificates(
            self.parts
                .host
                .certificates
                .states()
                .into_iter()
                .map(|((signer, state), n)| ((signer, state.to_string()), n)),
        );
        // `volume_manager_total_volumes`, counted from both states of world.
        let mut totals: std::collections::BTreeMap<(String, &'static str), i64> =
            Default::default();
        let world = &self.parts.world;
        for v in world.dsw().volumes() {
            *totals
                .entry((v.traits.plugin.to_string(), "desired_state_of_world"))
                .or_default() += v.pods.len() as i64;
        }
        for v in world.asw().volumes() {
            *totals
                .entry((v.traits.plugin.to_string(), "actual_state_of_world"))
                .or_default() += v.pods.len() as i64;
        }
        metrics.render(&totals)
    }

    /// A receiver woken on every change of the status report: either state of world, an
    /// operation's outcome, or the object store (manifest errors). For status watchers; a pod's
    /// waiters sleep on the pod's own signal instead.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.parts.world.subscribe()
    }
}

/// A CSI volume waiting for its driver is retried as soon as a driver registers (or goes), not
/// after its backoff; other volumes keep theirs.
async fn retry_csi_on_registration(
    drivers: Arc<Drivers>,
    executor: Arc<Executor>,
    world: Arc<World>,
) {
    let mut changed = drivers.subscribe();
    let prefix = format!("{}/", crate::plugins::csi::PLUGIN_NAME);
    while changed.changed().await.is_ok() {
        executor.retry_now(
            |k| k.volume.0.starts_with(&prefix),
            tokio::time::Instant::now(),
        );
        // Its volumes are tried again now (registrations are rare: every volume is planned).
        world.touch_all();
        world.wake_reconciler();
    }
}

#[cfg(test)]
mod tests;
