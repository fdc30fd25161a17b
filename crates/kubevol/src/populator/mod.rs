//! The desired-state populator: turns the pods in the store into the desired state of world.
//!
//! It is woken by every store change (never polls), processes only pods whose object changed,
//! and holds the only [`DswWriter`]. An invalid pod is rejected whole before anything touches
//! disk; if an earlier valid version of it is already desired, that version stays (a bad edit
//! never takes volumes away). Volumes no container uses are skipped, as the kubelet does.

pub mod claims;

use std::collections::{BTreeMap, BTreeSet};

use kubevol_core::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::projection::{referenced_objects, ObjectKind};
use kubevol_core::state::{
    DesiredPodVolume, PodVolumeRef, PodVolumeWish, ProcessFailure, VolumeSpec,
};
use kubevol_core::validation::{all_containers, validate_pod, volume_source_names};
use kubevol_core::{PodRef, PodUid};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::debug;

use crate::events::{reason, EventRecorder};
use crate::operations::executor::Executor;
use crate::plugins::{PluginHost, PluginRegistry};
pub use crate::store::{is_for_node, is_terminated, pod_ref};
use crate::store::{ObjectKey, ObjectStore, StoredPod};
use crate::world::{DswWriter, Rejected};

/// The volumes a pod's containers mount or map: only these are set up.
pub fn used_volume_names(pod: &Pod) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (_, c) in all_containers(pod) {
        out.extend(c.volume_mounts.iter().flatten().map(|m| m.name.clone()));
        out.extend(c.volume_devices.iter().flatten().map(|d| d.name.clone()));
    }
    out
}

/// The populator: what it reads, the DSW it writes, and what it remembers between passes.
pub struct Populator {
    store: Arc<ObjectStore>,
    dsw: DswWriter,
    plugins: PluginRegistry,
    host: Arc<PluginHost>,
    events: Arc<EventRecorder>,
    /// Backoff of a pod's operations is reset when an object it reads changes.
    executor: Arc<Executor>,
    node_name: String,
    /// The last content generation handed out (see `DesiredPodVolume::content_generation`).
    content_generation: u64,
    /// Pods to process again though nothing of theirs changed (their tokens are due).
    refreshes: tokio::sync::mpsc::UnboundedReceiver<PodUid>,
    seen: HashMap<PodUid, Seen>,
    /// The pods that read each object (by the keys of `seen`): a change of the object touches
    /// only them.
    readers: HashMap<ObjectKey, HashSet<PodUid>>,
    /// Pods to process in the next pass whatever changed (refreshes).
    due: BTreeSet<PodUid>,
    /// The next pass looks at every pod (the first one, and the one after a panic).
    full_pass_due: bool,
    /// Pods recorded at start from a manifest file that have not come back yet: while their
    /// file has errors they are held (their volumes kept as recorded).
    recorded: crate::reconstruct::RecordedFiles,
}

impl Populator {
    /// A populator of `dsw` from `store`.
    pub fn new(
        store: Arc<ObjectStore>,
        dsw: DswWriter,
        plugins: PluginRegistry,
        host: Arc<PluginHost>,
        events: Arc<EventRecorder>,
        executor: Arc<Executor>,
        refreshes: tokio::sync::mpsc::UnboundedReceiver<PodUid>,
    ) -> Self {
        Populator {
            store,
            node_name: host.node_name.clone(),
            dsw,
            plugins,
            host,
            events,
            executor,
            content_generation: 0,
            refreshes,
            seen: HashMap::default(),
            readers: HashMap::default(),
            due: BTreeSet::new(),
            full_pass_due: true,
            recorded: Default::default(),
        }
    }

    /// Holds the volumes of pods recorded from a manifest file while that file has errors and
    /// the pod has not come back (`files`: what reconstruction found in the record).
    pub(crate) fn holding(mut self, files: crate::reconstruct::RecordedFiles) -> Self {
        self.recorded = files;
        self
    }

    /// Brings the held pods up to date: a recorded pod that came back, or whose file reads
    /// without errors (and so no longer defines it), is no longer held, for good.
    fn update_held(&mut self) {
        if self.recorded.is_empty() {
            return;
        }
        let broken: BTreeSet<std::path::PathBuf> = self
            .store
            .file_errors()
            .into_iter()
            .map(|e| e.path)
            .collect();
        let store = &self.store;
        self.recorded
            .retain(|uid, (_, file)| store.pod(uid).is_none() && broken.contains(file));
        let held = self
            .recorded
            .iter()
            .map(|(uid, (pod, file))| {
                let why = format!(
                    "pod {}/{} is kept as last recorded: its manifest {} has errors; its volumes stay until the file is fixed (or removed)",
                    pod.namespace,
                    pod.name,
                    file.display()
                );
                (uid.clone(), why)
            })
            .collect();
        self.dsw.set_held(held);
    }

    /// Runs until `stop` says so: a pass on every store change. A pass that panics (a bug hit
    /// by one input) is reported and the next change gets a new one.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut store_rx = self.store.subscribe();
        loop {
            store_rx.borrow_and_update();
            if *stop.borrow_and_update() {
                return;
            }
            let pass = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.sync()));
            match pass {
                Ok(true) => self.dsw.world().wake_reconciler(),
                Ok(false) => {}
                Err(_) => {
                    tracing::error!(
                        "the populator panicked in a pass; the next store change starts a new one"
                    );
                    self.seen.clear();
                    self.readers.clear();
                    self.full_pass_due = true;
                }
            }
            // The status report shows manifest errors too: status watchers hear of every
            // store change.
            self.dsw.world().announce();
            tokio::select! {
                r = store_rx.changed() => if r.is_err() { return },
                Some(uid) = self.refreshes.recv() => {
                    self.refresh(uid);
                    while let Ok(uid) = self.refreshes.try_recv() {
                        self.refresh(uid);
                    }
                }
                _ = stop.changed() => return,
            }
        }
    }
}

/// The version of an object a pod's volume reads, compared by identity: the store replaces an
/// object's `Arc` exactly when the object changes.
#[derive(Clone, Debug)]
enum Version {
    Missing,
    /// Missing, and a manifest file with an error defines it: the pod's message says so.
    NotLoaded,
    ConfigMap(Arc<k8s_openapi::api::core::v1::ConfigMap>),
    Secret(Arc<k8s_openapi::api::core::v1::Secret>),
    Claim(Arc<k8s_openapi::api::core::v1::PersistentVolumeClaim>),
    Volume(Arc<k8s_openapi::api::core::v1::PersistentVolume>),
    Driver(Arc<k8s_openapi::api::storage::v1::CSIDriver>),
    Node(Arc<k8s_openapi::api::core::v1::Node>),
    /// Missing, and the API server is still to list it.
    Pending(ObjectKey),
    /// A claim the storage controllers have not bound, and why, once they have said.
    Unbound(Option<String>),
}

impl PartialEq for Version {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Version::Missing, Version::Missing) => true,
            (Version::Pending(a), Version::Pending(b)) => a == b,
            (Version::Unbound(a), Version::Unbound(b)) => a == b,
            (Version::NotLoaded, Version::NotLoaded) => true,
            (Version::ConfigMap(a), Version::ConfigMap(b)) => Arc::ptr_eq(a, b),
            (Version::Secret(a), Version::Secret(b)) => Arc::ptr_eq(a, b),
            (Version::Claim(a), Version::Claim(b)) => Arc::ptr_eq(a, b),
            (Version::Volume(a), Version::Volume(b)) => Arc::ptr_eq(a, b),
            (Version::Driver(a), Version::Driver(b)) => Arc::ptr_eq(a, b),
            (Version::Node(a), Version::Node(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// What an unbound claim's readers read: every PersistentVolume change touches them.
const ANY_PERSISTENT_VOLUME: ObjectKey = ObjectKey::PersistentVolume(String::new());

/// An object the store does not hold: still to be listed by the API server, or missing.
fn absent(store: &ObjectStore, key: ObjectKey) -> Version {
    if store.pending(&key) {
        Version::Pending(key)
    } else {
        Version::Missing
    }
}

/// The claim, volume and CSIDriver objects a volume depends on.
fn storage_versions(
    store: &ObjectStore,
    node: &str,
    pod: &PodRef,
    v: &k8s_openapi::api::core::v1::Volume,
    out: &mut Vec<(ObjectKey, Version)>,
) {
    let driver = |name: &str| {
        let key = ObjectKey::CSIDriver(name.to_string());
        let version = store
            .csi_driver(name)
            .map_or(Version::Missing, |d| Version::Driver(d.object));
        (key, version)
    };
    if let Some(csi) = &v.csi {
        out.push(driver(&csi.driver));
    }
    let Some((name, claim)) = claims::claim_of(store, pod, v) else {
        return;
    };
    let ns = &*pod.namespace;
    let claim_key = ObjectKey::PersistentVolumeClaim((ns.to_string(), name.to_string()));
    let Some(claim) = claim else {
        out.push((claim_key.clone(), absent(store, claim_key)));
        return;
    };
    out.push((claim_key, Version::Claim(claim.clone())));
    match claims::bound_volume(store, ns, &claim) {
        Some(pv) => {
            if let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.as_ref()) {
                out.push(driver(&csi.driver));
            }
            // Its nodeAffinity is checked against the Node's labels.
            if pv.spec.as_ref().is_some_and(|s| s.node_affinity.is_some()) {
                let key = ObjectKey::Node(node.to_string());
                let version = store
                    .node(node)
                    .map_or_else(|| absent(store, key.clone()), |n| Version::Node(n.object));
                out.push((key, version));
            }
            let key = ObjectKey::PersistentVolume(pv.metadata.name.clone().unwrap_or_default());
            out.push((key, Version::Volume(pv)));
        }
        None => {
            // Bound to a volume the store does not hold (yet), or unbound: then any
            // PersistentVolume may turn out to be its (its `claimRef` names the claim).
            match crate::store::claim_volume(&claim) {
                Some(pv) => {
                    let key = ObjectKey::PersistentVolume(pv.to_string());
                    out.push((key.clone(), absent(store, key)));
                }
                None => {
                    out.push((ANY_PERSISTENT_VOLUME, Version::Missing));
                    // What the binder says of it (it touches the claim when that changes).
                    let why = store.bindings().why_unbound(ns, &name);
                    let key = ObjectKey::PersistentVolumeClaim((ns.to_string(), name.to_string()));
                    out.push((key, Version::Unbound(why)));
                }
            }
        }
    }
}

/// What the populator last processed of a pod: the pod object and the objects its volumes read.
pub(crate) struct Seen {
    pod: Arc<Pod>,
    objects: Vec<(ObjectKey, Version)>,
}

/// The current versions of the objects a pod's volumes read, in a fixed order, and for each
/// volume that reads an object the API server is still to list, the first such object.
fn object_versions(
    store: &ObjectStore,
    node: &str,
    pod: &Pod,
    uid: &PodUid,
) -> (Vec<(ObjectKey, Version)>, BTreeMap<String, ObjectKey>) {
    let mut out = Vec::new();
    let mut pending = BTreeMap::new();
    let pref = pod_ref(pod, uid);
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let start = out.len();
        volume_versions(store, node, pod, &pref, v, &mut out);
        let first = out[start..].iter().find_map(|(_, x)| match x {
            Version::Pending(key) => Some(key.clone()),
            _ => None,
        });
        if let Some(key) = first {
            pending.insert(v.name.clone(), key);
        }
    }
    (out, pending)
}

/// The current versions of the objects one volume reads.
fn volume_versions(
    store: &ObjectStore,
    node: &str,
    pod: &Pod,
    pref: &PodRef,
    v: &k8s_openapi::api::core::v1::Volume,
    out: &mut Vec<(ObjectKey, Version)>,
) {
    storage_versions(store, node, pref, v, out);
    for r in referenced_objects(pod, v) {
        let (kind, key) = match r.kind {
            ObjectKind::ConfigMap => (
                "ConfigMap",
                ObjectKey::ConfigMap((r.namespace.clone(), r.name.clone())),
            ),
            ObjectKind::Secret => (
                "Secret",
                ObjectKey::Secret((r.namespace.clone(), r.name.clone())),
            ),
        };
        let missing = || match store.not_loaded(kind, &r.namespace, &r.name) {
            Some(_) => Version::NotLoaded,
            None => absent(store, key.clone()),
        };
        let version = match r.kind {
            ObjectKind::ConfigMap => store
                .config_map(&r.namespace, &r.name)
                .map_or_else(missing, |s| Version::ConfigMap(s.object)),
            ObjectKind::Secret => store
                .secret(&r.namespace, &r.name)
                .map_or_else(missing, |s| Version::Secret(s.object)),
        };
        out.push((key, version));
    }
}

/// How many pods a pass changes before it wakes the reconciler, which then starts their
/// operations while the pass goes on (a manifest of a thousand pods is not processed whole
/// before the first mount).
const WAKE_EVERY: usize = 64;

/// The pods a pass changed since it last woke the reconciler.
#[derive(Default)]
struct Wake(usize);

impl Wake {
    /// Counts one pod's sync; says whether the reconciler is due a wake-up now.
    fn count(&mut self, changed: bool) -> bool {
        self.0 += usize::from(changed);
        if self.0 < WAKE_EVERY {
            return false;
        }
        self.0 = 0;
        true
    }

    /// `sync` (one pod's sync) and, every [`WAKE_EVERY`] changed pods, a wake-up.
    fn after(&mut self, p: &mut Populator, sync: impl FnOnce(&mut Populator) -> bool) -> bool {
        let changed = sync(p);
        if self.count(changed) {
            p.dsw.world().wake_reconciler();
        }
        changed
    }
}

impl Populator {
    /// One pass: the pods the store's changes touch (their own changes, and changes of the
    /// objects they read), or every pod when anything may have changed. Returns whether the
    /// DSW changed (the reconciler must look).
    fn sync(&mut self) -> bool {
        // Read the sync flag before the pods: if it is true, this listing is complete.
        let sources_synced = self.store.all_sources_synced();
        let (keys, everything) = self.store.take_changes();
        let mut changed = false;
        if everything || std::mem::take(&mut self.full_pass_due) {
            let pods = self.store.pods();
            let listed: HashSet<&PodUid> = pods.iter().map(|(uid, _)| uid).collect();
            let gone: Vec<PodUid> = self
                .seen
                .keys()
                .filter(|u| !listed.contains(u))
                .cloned()
                .collect();
            let mut wake = Wake::default();
            for (uid, stored) in &pods {
                changed |= wake.after(self, |p| p.sync_pod(uid, Some(stored)));
            }
            for uid in gone {
                changed |= wake.after(self, |p| p.sync_pod(&uid, None));
            }
            self.due.clear();
        } else {
            let mut touched: BTreeSet<PodUid> = std::mem::take(&mut self.due);
            for key in keys {
                match key {
                    ObjectKey::Pod(uid) => {
                        touched.insert(uid);
                    }
                    other => {
                        if matches!(other, ObjectKey::PersistentVolume(_)) {
                            touched.extend(self.readers_of(&ANY_PERSISTENT_VOLUME));
                        }
                        touched.extend(self.readers_of(&other));
                    }
                }
            }
            let mut wake = Wake::default();
            for uid in touched {
                let stored = self.store.pod(&uid);
                changed |= wake.after(self, |p| p.sync_pod(&uid, stored.as_ref()));
            }
        }
        if sources_synced {
            self.update_held();
            if self.dsw.mark_synced() {
                changed = true;
            }
        }
        changed
    }

    /// Brings one pod's wishes up to date with the store's pod (`None`: it is gone). Returns
    /// whether the DSW changed.
    fn sync_pod(&mut self, uid: &PodUid, stored: Option<&StoredPod>) -> bool {
        let wanted = stored.filter(|s| {
            let pod = &s.pod;
            if !is_for_node(pod, &self.node_name) {
                debug!(pod = ?pod.metadata.name, node = ?pod.spec.as_ref().and_then(|s| s.node_name.as_ref()), "pod is assigned to another node; ignored");
                return false;
            }
            !is_terminated(pod)
        });
        let Some(stored) = wanted else {
            let Some(old) = self.seen.remove(uid) else {
                return false;
            };
            // Its volumes are torn down now: a set-up that failed for good shares their keys.
            self.executor
                .retry_permanent_now(|k| k.pod.as_ref() == Some(uid), Instant::now());
            self.forget_readers(uid, &old);
            // Its certificates' keys go with it (a set-up that never succeeded has no
            // teardown to drop them).
            self.host.certificates.forget_pod(uid.as_str());
            self.dsw.remove_pod(uid);
            self.dsw.world().notify_pod(uid);
            return true;
        };
        let pod = &stored.pod;
        let (objects, pending) = object_versions(&self.store, &self.node_name, pod, uid);
        let (same_pod, same_objects) = self.seen.get(uid).map_or((false, false), |s| {
            (Arc::ptr_eq(&s.pod, pod), s.objects == objects)
        });
        if same_pod && same_objects {
            return false;
        }
        if !same_objects {
            // An object appeared or changed: retry this pod's volumes now, not after backoff.
            self.executor
                .retry_now(|k| k.pod.as_ref() == Some(uid), Instant::now());
        } else if !same_pod {
            // The pod changed: what failed for good because of its spec may work now.
            self.executor
                .retry_permanent_now(|k| k.pod.as_ref() == Some(uid), Instant::now());
        }
        if let Some(old) = self.seen.remove(uid) {
            self.forget_readers(uid, &old);
        }
        for (key, _) in &objects {
            self.readers
                .entry(key.clone())
                .or_default()
                .insert(uid.clone());
        }
        self.seen.insert(
            uid.clone(),
            Seen {
                pod: pod.clone(),
                objects,
            },
        );
        self.process_pod(uid, stored, &pending);
        self.dsw.world().notify_pod(uid);
        true
    }

    /// Processes `uid` again in the next pass whatever changed: forgotten, so nothing
    /// compares equal.
    fn refresh(&mut self, uid: PodUid) {
        if let Some(old) = self.seen.remove(&uid) {
            self.forget_readers(&uid, &old);
        }
        self.due.insert(uid);
    }

    fn readers_of(&self, key: &ObjectKey) -> Vec<PodUid> {
        self.readers
            .get(key)
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Drops `uid` from the readers of what it read.
    fn forget_readers(&mut self, uid: &PodUid, seen: &Seen) {
        for (key, _) in &seen.objects {
            if let Some(readers) = self.readers.get_mut(key) {
                readers.remove(uid);
                if readers.is_empty() {
                    self.readers.remove(key);
                }
            }
        }
    }

    /// Turns the pod into wishes; `pending` names, for each volume that reads one, an object
    /// the API server is still to list (the volume waits for it).
    fn process_pod(
        &mut self,
        uid: &PodUid,
        stored: &StoredPod,
        pending: &BTreeMap<String, ObjectKey>,
    ) {
        let pod = &stored.pod;
        let pref = pod_ref(pod, uid);
        // Before validation: a misspelt field is often why a pod is invalid
        // (`mountpath` leaves `mountPath` unset).
        let ext = &stored.extensions;
        let unknown = ext
            .unknown_fields
            .iter()
            .chain(ext.volumes.values().flat_map(|v| &v.unknown_fields));
        for field in unknown {
            self.events.record(
                &pref,
                true,
                reason::UNKNOWN_FIELD,
                format!(
                    "{}: pod {pref}: {field}: kubevol's API types do not have it, so it is ignored",
                    stored.origin()
                ),
            );
        }
        let errors: Vec<String> = validate_pod(pod).iter().map(|e| e.to_string()).collect();
        if !errors.is_empty() {
            let message = format!(
                "{}: pod {pref} rejected, nothing was created for it; fix these fields: {}",
                stored.origin(),
                errors.join("; ")
            );
            self.events
                .record(&pref, true, reason::FAILED_VALIDATION, message);
            self.dsw.reject(
                uid.clone(),
                Rejected {
                    pod_ref: pref,
                    origin: stored.origin().clone(),
                    errors,
                },
            );
            return;
        }
        let used = used_volume_names(pod);
        let mut wishes = Vec::new();
        let mut failed = BTreeMap::new();
        for (index, v) in pod
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
            .enumerate()
        {
            if !used.contains(&v.name) {
                debug!(pod = %pref, volume = %v.name, "volume is not used by any container; skipped");
                continue;
            }
            let usage = claims::usage(pod, &v.name);
            if let Some(key) = pending.get(&v.name) {
                // Not a failure: no event, and the pod is not failed for good.
                failed.insert(
                    v.name.clone(),
                    ProcessFailure {
                        message: format!(
                            "{}: volume {:?} of pod {pref}: waiting for the API server to deliver {key} (it has not been read yet)",
                            stored.origin(), v.name
                        ),
                        unsupported: false,
                        waiting: true,
                    },
                );
                continue;
            }
            let mut fail = |why: String, unsupported: bool, waiting: bool| {
                let message = format!(
                    "{}: volume {:?} of pod {pref}: {why}",
                    stored.origin(),
                    v.name
                );
                self.events
                    .record(&pref, true, reason::FAILED_MOUNT, message.clone());
                failed.insert(
                    v.name.clone(),
                    ProcessFailure {
                        message,
                        unsupported,
                        waiting,
                    },
                );
            };
            let persistent_volume = match storage_check(&self.store, &self.host, &pref, v, usage) {
                Ok(pv) => pv,
                Err(Refusal { why, unsupported }) => {
                    let waiting = claims::waits_for_others(&self.store, &pref, v);
                    fail(why, unsupported, waiting);
                    continue;
                }
            };
            let extensions = stored
                .extensions
                .volumes
                .get(&v.name)
                .cloned()
                .unwrap_or_default();
            // Read in place in the stored pod: no copy of the volume per wish.
            let volume =
                PodVolumeRef::in_pod(stored.pod.clone(), index).unwrap_or_else(|| v.clone().into());
            let spec = Arc::new(VolumeSpec {
                volume,
                block: usage.device,
                extensions,
                persistent_volume,
                selinux_label: None,
                selinux_mount: false,
            });
            let Some(plugin) = self.plugins.find(&spec) else {
                let why = match spec.persistent_volume.as_deref() {
                    Some(pv) => format!(
                        "PersistentVolume {} is a {} volume, a type kubevol does not mount yet (supported for persistent volumes: {}); use a CSI volume",
                        pv.metadata.name.as_deref().unwrap_or_default(),
                        persistent_volume_type(pv),
                        self.plugins.persistent_sources().join(", ")
                    ),
                    None => format!(
                        "volume type {} is not supported by kubevol yet (supported: {}); change the volume's type or remove it",
                        volume_source_names(v).first().copied().unwrap_or("unknown"),
                        self.plugins.supported_sources().join(", ")
                    ),
                };
                fail(why, true, false);
                continue;
            };
            let name = plugin.volume_name(&pref, &spec);
            let spec = match self.selinux(pod, &pref, &v.name, spec, &*plugin, &name) {
                Ok(spec) => spec,
                Err(why) => {
                    fail(why, false, false);
                    continue;
                }
            };
            let content_generation = if plugin.requires_remount() {
                // The pod or an object it reads changed: content volumes are written again
                // (the writer leaves unchanged content alone).
                self.content_generation += 1;
                self.content_generation
            } else {
                0
            };
            wishes.push(PodVolumeWish {
                name,
                traits: plugin.traits(&self.host, &spec),
                pod_volume: DesiredPodVolume {
                    pod_ref: pref.clone(),
                    pod: pod.clone(),
                    outer_volume_name: v.name.as_str().into(),
                    spec,
                    content_generation,
                },
            });
        }
        self.dsw.set_pod(pref, wishes, failed);
    }

    /// The volume's SELinux label and whether it is mounted with it, decided as the kubelet
    /// decides (see [`kubevol_core::selinux`]), or why the pod cannot use the volume: its
    /// containers disagree on the label, or other pods use the volume with another one — for a
    /// volume mounted with its label; for others these are counted as warnings only.
    fn selinux(
        &self,
        pod: &Pod,
        pref: &PodRef,
        volume: &str,
        spec: Arc<VolumeSpec>,
        plugin: &dyn crate::plugins::VolumePlugin,
        name: &kubevol_core::UniqueVolumeName,
    ) -> Result<Arc<VolumeSpec>, String> {
        use crate::report::metrics::SelinuxCount;
        use kubevol_core::selinux as se;
        let pv_spec = spec
            .persistent_volume
            .as_ref()
            .and_then(|pv| pv.spec.as_ref());
        let modes = pv_spec.and_then(|s| s.access_modes.as_deref());
        let mode_ok = se::mode_allows_mount(modes, self.host.selinux_mount_all);
        let count = |what| {
            // The kubelet's label: the plugin, and for CSI its driver.
            let plugin_name = match pv_spec.and_then(|s| s.csi.as_ref()) {
                Some(csi) => format!("{}:{}", plugin.name(), csi.driver),
                None => plugin.name().to_string(),
            };
            let access = se::metric_access_mode(modes);
            self.host.metrics.count_selinux(what, &plugin_name, access);
        };
        let Some(context) = &self.host.selinux_context else {
            // Without SELinux nothing is labelled: a pod is told only where it would have been.
            let would_mount = mode_ok && plugin.supports_selinux_mount(&self.host, &spec);
            let asked = || {
                se::volume_label(pod, volume, se::DEFAULT_FILE_CONTEXT)
                    .map_or(true, |l| l.is_some())
            };
            if would_mount && asked() {
                self.events.record(
                    pref,
                    true,
                    reason::SELINUX_UNAVAILABLE,
                    format!(
                        "volume {volume:?} of pod {pref}: the pod asks for an SELinux label, but this node has no SELinux (no selinuxfs at /sys/fs/selinux): it is mounted without -o context"
                    ),
                );
            }
            return Ok(spec);
        };
        let label = match se::volume_label(pod, volume, context) {
            Ok(label) => label,
            Err(labels) => {
                // An error for a volume of an access mode mounted with its label, whatever the
                // plugin (as the kubelet decides), a warning for the others.
                if !mode_ok {
                    count(SelinuxCount::PodMismatchWarning);
                    return Ok(spec);
                }
                count(SelinuxCount::PodMismatchError);
                return Err(format!(
                    "the containers that use the volume have different SELinux labels ({}): a volume of this access mode is labelled as a whole; give the containers that use it the same seLinuxOptions",
                    labels.join(", ")
                ));
            }
        };
        // The label the volume is mounted with, when it can be (the kubelet's: none for a
        // plugin that cannot, nor for a pod that asks the runtime to relabel recursively). A pod
        // without a label still conflicts with pods that have one.
        let supports = plugin.supports_selinux_mount(&self.host, &spec);
        let label = label.filter(|_| supports && !se::recursive_change(pod));
        if supports {
            let dsw = self.dsw.world().dsw();
            let existing = dsw.volume(name);
            let other = existing.and_then(|v| v.pods.values().find(|p| p.pod_ref.uid != pref.uid));
            if let Some(other) = other {
                if other.spec.selinux_label != label {
                    let show = |l: &Option<String>| format!("{:?}", l.as_deref().unwrap_or(""));
                    if mode_ok {
                        count(SelinuxCount::VolumeMismatchError);
                        return Err(format!(
                            "conflicting SELinux labels of volume {name}: {} (pod {}) and {} (this pod): a volume mounted with -o context has one label; give the pods the same seLinuxOptions",
                            show(&other.spec.selinux_label),
                            other.pod_ref,
                            show(&label)
                        ));
                    }
                    count(SelinuxCount::VolumeMismatchWarning);
                }
            } else if label.is_some() && existing.is_none() {
                count(SelinuxCount::Admitted);
            }
        }
        let Some(label) = label else {
            return Ok(spec);
        };
        Ok(Arc::new(VolumeSpec {
            selinux_label: Some(label),
            selinux_mount: mode_ok,
            ..(*spec).clone()
        }))
    }
}

/// The volume source a PersistentVolume's spec sets (`hostPath`, `nfs`, `local`, ...), as the
/// API names it.
pub(crate) fn persistent_volume_type(
    pv: &k8s_openapi::api::core::v1::PersistentVolume,
) -> &'static str {
    const SOURCES: [&str; 22] = [
        "awsElasticBlockStore",
        "azureDisk",
        "azureFile",
        "cephfs",
        "cinder",
        "csi",
        "fc",
        "flexVolume",
        "flocker",
        "gcePersistentDisk",
        "glusterfs",
        "hostPath",
        "iscsi",
        "local",
        "nfs",
        "photonPersistentDisk",
        "portworxVolume",
        "quobyte",
        "rbd",
        "scaleIO",
        "storageos",
        "vsphereVolume",
    ];
    let spec = pv
        .spec
        .as_ref()
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or_default();
    SOURCES
        .into_iter()
        .find(|s| spec.get(*s).is_some_and(|v| !v.is_null()))
        .unwrap_or("unknown")
}

/// Why a volume cannot be processed.
struct Refusal {
    why: String,
    /// A use kubevol does not support, as opposed to a reference that cannot be resolved yet.
    unsupported: bool,
}

impl From<String> for Refusal {
    fn from(why: String) -> Self {
        Refusal {
            why,
            unsupported: false,
        }
    }
}

/// The storage checks of one volume: a claim resolves to its PersistentVolume, whose
/// nodeAffinity this node matches; an inline CSI volume's driver allows ephemeral volumes.
/// Returns the PersistentVolume of a claim.
fn storage_check(
    store: &ObjectStore,
    host: &Arc<PluginHost>,
    pod: &PodRef,
    v: &k8s_openapi::api::core::v1::Volume,
    usage: claims::Usage,
) -> Result<Option<Arc<k8s_openapi::api::core::v1::PersistentVolume>>, Refusal> {
    let unsupported = |why: String| Refusal {
        why,
        unsupported: true,
    };
    if let Some(csi) = &v.csi {
        if usage.device {
            return Err(unsupported("an inline CSI volume cannot be used in volumeDevices: use a claim with volumeMode Block".into()));
        }
        claims::lifecycle_allows(store, &csi.driver, "Ephemeral")?;
    }
    if let Some(translated) = kubevol_core::migration::translate_inline(v, &pod.namespace) {
        return migrated_inline(v, translated, usage).map(Some);
    }
    if v.persistent_volume_claim.is_none() && v.ephemeral.is_none() {
        return Ok(None);
    }
    // (A claim nothing binds is bound by the storage controllers, which run beside.)
    let pv = claims::resolve(store, pod, v, usage)?;
    let name = pv.metadata.name.as_deref().unwrap_or_default();
    let spec = pv.spec.as_ref();
    if usage.device && spec.is_some_and(|s| s.host_path.is_some()) {
        return Err(unsupported(format!(
            "PersistentVolume {name} is a hostPath volume, which cannot be used as a raw block device: use the claim in volumeMounts"
        )));
    }
    claims::check_persistent_volume(&pv)?;
    if let Some(required) = spec
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
    {
        claims::check_node_affinity(name, required, &host.node_facts())?;
    }
    // An in-tree type is served by its CSI driver, as the PersistentVolume the translation
    // gives (its node affinity was checked as written).
    match kubevol_core::migration::translate_pv(&pv) {
        Some(Ok(translated)) => Ok(Some(Arc::new(translated))),
        Some(Err(e)) => {
            let t = kubevol_core::migration::in_tree_of_pv(&pv).map_or("", |t| t.driver);
            Err(format!(
                "PersistentVolume {name} cannot be served by CSI driver {t}, as Kubernetes serves in-tree volumes: {e}; fix the PersistentVolume"
            )
            .into())
        }
        None => Ok(Some(pv)),
    }
}

/// An inline volume of an in-tree type, as the PersistentVolume its CSI driver serves. Its
/// name (the translation's, unique per disk) names the volume's directories: one that is not a
/// single path component has each `/` written as `~`.
fn migrated_inline(
    v: &k8s_openapi::api::core::v1::Volume,
    translated: Result<k8s_openapi::api::core::v1::PersistentVolume, String>,
    usage: claims::Usage,
) -> Result<Arc<k8s_openapi::api::core::v1::PersistentVolume>, Refusal> {
    let t = kubevol_core::migration::in_tree_of_volume(v).map_or("", |t| t.driver);
    let mut pv = translated.map_err(|e| {
        format!("the volume cannot be served by CSI driver {t}, as Kubernetes serves in-tree volumes: {e}; fix the volume")
    })?;
    if usage.device {
        return Err(Refusal {
            why: "an inline volume cannot be used in volumeDevices: use a claim with volumeMode Block".into(),
            unsupported: true,
        });
    }
    if let Some(n) = pv.metadata.name.as_mut() {
        *n = n.replace('/', "~");
        if n.is_empty() || n == "." || n == ".." {
            return Err(format!(
                "the volume's disk name {n:?} cannot name a directory; fix the volume"
            )
            .into());
        }
    }
    Ok(Arc::new(pv))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(extra: serde_json::Value) -> Pod {
        let mut v = serde_json::json!({"metadata": {"name": "p"}, "spec": {"containers": []}});
        if let (Some(base), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
            for (k, val) in extra {
                if k == "metadata" {
                    base["metadata"]
                        .as_object_mut()
                        .unwrap()
                        .extend(val.as_object().unwrap().clone());
                } else {
                    base.insert(k.clone(), val.clone());
                }
            }
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn terminated_pods_are_finished_or_being_deleted() {
        let rows = [
            ("no status", serde_json::json!({}), false),
            (
                "running",
                serde_json::json!({"status": {"phase": "Running"}}),
                false,
            ),
            (
                "pending",
                serde_json::json!({"status": {"phase": "Pending"}}),
                false,
            ),
            (
                "succeeded",
                serde_json::json!({"status": {"phase": "Succeeded"}}),
                true,
            ),
            (
                "failed",
                serde_json::json!({"status": {"phase": "Failed"}}),
                true,
            ),
            (
                "deleting",
                serde_json::json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}),
                true,
            ),
        ];
        for (name, extra, want) in rows {
            assert_eq!(is_terminated(&pod(extra)), want, "row {name}");
        }
    }

    #[test]
    fn a_long_pass_wakes_the_reconciler_every_so_many_changed_pods() {
        let mut w = Wake::default();
        let woken: Vec<usize> = (1..=3 * WAKE_EVERY)
            .filter(|i| w.count(i % 3 != 0))
            .collect();
        // Two of every three pods change: a wake-up after each WAKE_EVERY of those.
        assert_eq!(
            woken,
            vec![WAKE_EVERY * 3 / 2 - 1, WAKE_EVERY * 3 - 1],
            "unchanged pods do not count"
        );
    }

    #[test]
    fn node_assignment() {
        let on = |node: Option<&str>| {
            let mut p = pod(serde_json::json!({}));
            p.spec.as_mut().unwrap().node_name = node.map(Into::into);
            is_for_node(&p, "node-a")
        };
        assert!(on(None), "no nodeName: this node, as for static pods");
        assert!(on(Some("")));
        assert!(on(Some("node-a")));
        assert!(!on(Some("node-b")));
    }
}
