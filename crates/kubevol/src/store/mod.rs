//! The object store: pods and the objects they reference, as delivered by pod sources.
//!
//! Sources (the manifest directory, the library API, later the API server) write here; the
//! populator reads. Each object remembers where it came from, so an error can name the manifest
//! file, and so a file's objects can be replaced or removed as a whole. Every change bumps a
//! generation on a watch channel: readers are woken, never poll.

pub use kubevol_core::state::PodExtensions;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use k8s_openapi::api::core::v1::{
    ConfigMap, Node, PersistentVolume, PersistentVolumeClaim, Pod, Secret,
};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kubevol_core::names::SharedStr;
use kubevol_core::projection::ObjectKind;
use kubevol_core::PodUid;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

mod bindings;
mod definitions;
mod identity;

pub use bindings::{Binding, Bindings, Creating, BINDINGS_FILE};
pub use definitions::Key as ObjectKey;
use definitions::{Key, Objects, Shared};
pub use identity::*;

/// The name the API server's pod source registers under (`ClusterSource::NAME`).
pub const API_SERVER_SOURCE: &str = "api-server";

/// Where an object came from. The order is the precedence when two origins define the same
/// object: the library API first, then the API server, then manifest files by path (byte
/// order) and document.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Origin {
    /// The library API (an embedding node agent).
    Api,
    /// The API server (cluster mode).
    Cluster,
    /// kubevol's own provisioner (standalone mode): a volume made for a claim.
    Provisioned,
    /// A manifest file, and the 1-based index of the document in it.
    File {
        /// The file.
        path: PathBuf,
        /// The document.
        document: usize,
    },
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::File { path, document } => {
                write!(f, "{} (document {document})", path.display())
            }
            Origin::Api => f.write_str("library API"),
            Origin::Cluster => f.write_str("API server"),
            Origin::Provisioned => f.write_str("kubevol's provisioner"),
        }
    }
}

impl Origin {
    /// The manifest file named by an origin as [`Origin`]'s `Display` spells it (as the record
    /// keeps it): `/m/a.yaml (document 2)` names `/m/a.yaml`.
    pub fn file_of(spelled: &str) -> Option<PathBuf> {
        let (path, rest) = spelled.rsplit_once(" (document ")?;
        let n = rest.strip_suffix(')')?;
        (n.parse::<usize>().is_ok() && path.starts_with('/')).then(|| PathBuf::from(path))
    }
}

/// An object kept in the store. The variants differ in size, but objects are parsed once and
/// moved into `Arc`s right away, so boxing them would only add an allocation.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Object {
    /// A pod (namespace and UID already filled in), with what its manifest says of its volumes
    /// beyond the API types (empty for a pod given as a typed value).
    Pod(Pod, PodExtensions),
    /// A ConfigMap.
    ConfigMap(ConfigMap),
    /// A Secret.
    Secret(Secret),
    /// A PersistentVolume.
    PersistentVolume(PersistentVolume),
    /// A PersistentVolumeClaim.
    PersistentVolumeClaim(PersistentVolumeClaim),
    /// A CSIDriver.
    CSIDriver(CSIDriver),
    /// A StorageClass (standalone mode provisions claims of it).
    StorageClass(StorageClass),
    /// A Node (in cluster mode, this node's own: its labels are what PersistentVolumes'
    /// nodeAffinity is checked against).
    Node(Node),
    /// A VolumeSnapshot (standalone mode fills claims' volumes from it).
    VolumeSnapshot(kubevol_core::snapshot::VolumeSnapshot),
    /// A VolumeSnapshotContent: a snapshot on the storage.
    VolumeSnapshotContent(kubevol_core::snapshot::VolumeSnapshotContent),
}

/// Why an object given through the library API is invalid (it is kept, and pods that use it
/// fail with this), or `None`.
pub(crate) fn problem_of(obj: &Object) -> Option<String> {
    let shared = match obj {
        Object::Secret(s) => Shared::from(Object::Secret(normalize_secret(s.clone()))),
        other => Shared::from(other.clone()),
    };
    let list = shared.invalid()?;
    Some(format!(
        "{} is invalid and pods that use it will fail; fix these fields: {list}",
        Key::of(obj)
    ))
}

/// Fills in what the API server would: `stringData` merged into `data`.
pub fn normalize_secret(mut secret: Secret) -> Secret {
    kubevol_core::validation::merge_string_data(&mut secret);
    secret
}

/// A pod and where it came from.
#[derive(Clone, Debug)]
pub struct StoredPod {
    /// The pod.
    pub pod: Arc<Pod>,
    /// What its manifest says of its volumes beyond the API types.
    pub extensions: Arc<PodExtensions>,
    /// Its origin (read with [`StoredPod::origin`]; changed only with its spelling).
    origin: Origin,
    /// Its origin spelled out, once (every record line of its volumes names it).
    source: SharedStr,
}

impl StoredPod {
    pub(crate) fn new(pod: Arc<Pod>, extensions: Arc<PodExtensions>, origin: Origin) -> Self {
        StoredPod {
            pod,
            extensions,
            source: origin.to_string().as_str().into(),
            origin,
        }
    }

    /// Where it came from: a manifest file and document, a cluster, the library API.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Its origin spelled out, as every record line of its volumes names it.
    pub fn source(&self) -> &SharedStr {
        &self.source
    }

    /// Takes `origin` as its origin (its spelling with it); whether it moved.
    pub(crate) fn move_to(&mut self, origin: Origin) -> bool {
        if self.origin == origin {
            return false;
        }
        self.source = origin.to_string().as_str().into();
        self.origin = origin;
        true
    }
}

/// A referenced object and where it came from.
#[derive(Clone, Debug)]
pub struct Stored<T> {
    /// The object.
    pub object: Arc<T>,
    /// Its origin.
    pub origin: Origin,
    /// Why it is invalid (origin and field errors), when it is: pods that use it fail with this.
    pub invalid: Option<Arc<str>>,
}

/// A namespace and a name.
pub type NsName = (String, String);

/// A problem with a manifest file as a whole or one of its documents.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestError {
    /// The file.
    pub path: PathBuf,
    /// The 1-based document index, when the problem is in one document.
    pub document: Option<usize>,
    /// The 1-based line, when known.
    pub line: Option<usize>,
    /// The 1-based column, when known.
    pub column: Option<usize>,
    /// What is wrong.
    pub message: String,
    /// The object the document defines, when its kind and name could be read: pods that use
    /// it are told that it waits for this file to be fixed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<ObjectName>,
}

/// A Kubernetes object's kind, namespace and name, as a manifest document states them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectName {
    /// The kind, e.g. `Secret`.
    pub kind: String,
    /// The namespace (`default` when the document has none; empty for cluster-scoped kinds).
    pub namespace: String,
    /// The name.
    pub name: String,
}

impl std::fmt::Display for ManifestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(d) = self.document {
            write!(f, ": document {d}")?;
        }
        match (self.line, self.column) {
            (Some(l), Some(c)) => write!(f, ", line {l}, column {c}")?,
            (Some(l), None) => write!(f, ", line {l}")?,
            _ => {}
        }
        write!(f, ": {}", self.message)
    }
}

/// What a manifest file delivers when it is read.
#[derive(Clone, Debug)]
pub enum FileContent {
    /// Its objects, each with its 1-based document index: they replace what the file delivered
    /// before.
    Objects(Vec<(usize, Object)>),
    /// It cannot be applied (it does not parse, a document is not a valid object, it is not a
    /// regular file, ...): what it delivered before stays, so a half-saved edit never unmounts
    /// a running pod, and these errors are reported for it.
    Broken(Vec<ManifestError>),
    /// It is gone: what it delivered goes too.
    Gone,
}

/// A change to the store; a batch of them is applied as one ([`ObjectStore::apply`]). An
/// upserted object is moved into an `Arc` right away, so boxing it would only add an allocation.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Change {
    /// A manifest file's new content.
    File {
        /// The file.
        path: PathBuf,
        /// What it holds now.
        content: FileContent,
    },
    /// The objects of kinds kubevol does not run (Deployment, Job, ...) that a manifest file
    /// holds: kept only to be shown (after the file's [`Change::File`] in a batch).
    Skipped {
        /// The file.
        path: PathBuf,
        /// Its objects kubevol skips.
        objects: Vec<ObjectName>,
    },
    /// The fields a manifest file's objects (other than pods) set that kubevol's API types do
    /// not have: ignored, kept to be shown and logged (after the file's [`Change::File`]).
    Warnings {
        /// The file.
        path: PathBuf,
        /// One per field.
        warnings: Vec<ManifestError>,
    },
    /// An object given through the library API, added or replaced (boxed: a pod is kilobytes,
    /// and a batch of removals should not reserve that much for each).
    Upsert(Box<Object>),
    /// A pod given through the library API, removed.
    RemovePod(PodUid),
    /// A volume kubevol provisioned, added.
    Provisioned(Box<Object>),
    /// A volume kubevol provisioned, deleted.
    Unprovisioned(ObjectKey),
    /// An object the API server delivered, added or replaced.
    ClusterUpsert(Box<Object>),
    /// An object the API server no longer has (or no longer lets this node read).
    ClusterRemove(ObjectKey),
    /// An object read by name (GET) that the API server answered does not exist: it is
    /// removed, marked absent for the messages of what needs it, and its readers look again
    /// each time (each read is one per backoff step of the reader).
    ClusterAbsent(ObjectKey),
    /// The API server's complete listing of this node's pods: every other pod it delivered
    /// before is gone.
    ClusterPods(Vec<Object>),
    /// An object the API server is asked for (`pending: true`: its watch has started but not
    /// yet listed it), or that it has answered for (`false`: it exists or it does not). What
    /// reads a pending object waits for it instead of failing.
    ClusterPending {
        /// The object.
        key: ObjectKey,
        /// Whether it is still to be listed.
        pending: bool,
    },
    /// A ConfigMap or Secret given through the library API, removed.
    RemoveObject {
        /// Its kind.
        kind: ObjectKind,
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
}

pub(crate) fn ns_name(meta: &ObjectMeta) -> NsName {
    (
        meta.namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| DEFAULT_NAMESPACE.into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// A registered pod source, as the sync gate and the status see it.
#[derive(Default)]
struct SourceState {
    synced: bool,
    /// Why it cannot deliver now (a directory missing or unreadable), for the status.
    problem: Option<String>,
    /// Why the API server refuses the source's reads (the node's credentials): apart from
    /// `problem`, which the pods' watch sets and clears, since a watch started before the
    /// refusal goes on delivering while every new read is refused.
    refused: Option<String>,
}

/// The store.
pub struct ObjectStore {
    objects: RwLock<Objects>,
    changed: watch::Sender<u64>,
    sources: Mutex<BTreeMap<String, SourceState>>,
    /// The manifest errors last logged: each is logged once when it appears and once when it
    /// clears, however often its file is read again.
    logged_errors: Mutex<BTreeSet<String>>,
    /// The claims kubevol bound (see [`Bindings`]).
    bindings: Bindings,
}

impl Default for ObjectStore {
    fn default() -> Self {
        Self::with_bindings(Bindings::default())
    }
}

impl ObjectStore {
    /// An empty store with no registered sources (its bindings in memory only).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store whose claims' bindings are `bindings` (the root's, kept on disk).
    pub fn with_bindings(bindings: Bindings) -> Self {
        ObjectStore {
            objects: RwLock::default(),
            changed: watch::channel(0).0,
            sources: Mutex::default(),
            logged_errors: Mutex::default(),
            bindings,
        }
    }

    /// The claims kubevol bound to PersistentVolumes.
    pub fn bindings(&self) -> &Bindings {
        &self.bindings
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Objects> {
        crate::sync::write(&self.objects)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Objects> {
        crate::sync::read(&self.objects)
    }

    fn bump(&self) {
        self.changed.send_modify(|g| *g += 1);
    }

    /// A receiver woken on every change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Registers a pod source that must deliver a complete listing before teardown may start.
    pub(crate) fn register_source(&self, name: &str) {
        crate::sync::lock(&self.sources)
            .entry(name.to_string())
            .or_default();
        self.bump();
    }

    /// Records that a source has delivered its complete first listing.
    pub(crate) fn mark_source_synced(&self, name: &str) {
        crate::sync::lock(&self.sources)
            .entry(name.to_string())
            .or_default()
            .synced = true;
        self.bump();
    }

    /// Records why a source cannot deliver now, or that it can again (`None`).
    pub(crate) fn set_source_problem(&self, name: &str, problem: Option<String>) {
        {
            let mut sources = crate::sync::lock(&self.sources);
            let state = sources.entry(name.to_string()).or_default();
            if state.problem == problem {
                return;
            }
            state.problem = problem;
        }
        self.bump();
    }

    /// Records why the API server refuses a source's new reads (its credentials), or that it
    /// takes them again (`None`).
    pub(crate) fn set_source_refused(&self, name: &str, refused: Option<String>) {
        {
            let mut sources = crate::sync::lock(&self.sources);
            let state = sources.entry(name.to_string()).or_default();
            if state.refused == refused {
                return;
            }
            match &refused {
                Some(why) => tracing::warn!(
                    source = name,
                    "the API server refuses the node's reads: {why}"
                ),
                None => {
                    tracing::info!(source = name, "the API server takes the node's reads again")
                }
            }
            state.refused = refused;
        }
        // The volumes that wait for an object say why: every pod is looked at again.
        self.write().journal.everything = true;
        self.bump();
    }

    /// Why the API server refuses the node's reads now, if it does (the first source's).
    pub fn refusal(&self) -> Option<String> {
        crate::sync::lock(&self.sources)
            .values()
            .find_map(|s| s.refused.clone())
    }

    /// Every registered source, and whether it has delivered its first listing.
    pub fn sources(&self) -> Vec<(String, bool)> {
        crate::sync::lock(&self.sources)
            .iter()
            .map(|(name, s)| (name.clone(), s.synced))
            .collect()
    }

    /// Whether the API server is one of the pod sources (a node of a cluster): pods from
    /// manifest files are then static pods.
    pub fn serves_a_cluster(&self) -> bool {
        crate::sync::lock(&self.sources).contains_key(API_SERVER_SOURCE)
    }

    /// Whether every registered source has synced.
    pub fn all_sources_synced(&self) -> bool {
        crate::sync::lock(&self.sources).values().all(|s| s.synced)
    }

    /// The problems of sources that cannot deliver now, each with the source's name.
    pub fn source_problems(&self) -> Vec<String> {
        crate::sync::lock(&self.sources)
            .iter()
            .flat_map(|(name, s)| {
                let waiting = if s.synced {
                    "what it delivered before stays"
                } else {
                    "nothing is torn down until it has been listed"
                };
                let problem = s.problem.as_ref().map(|p| format!("pod source {name}: {p}; {waiting}"));
                let refused = s.refused.as_ref().map(|r| {
                    format!("pod source {name}: the API server refuses the node's new reads: {r}; {waiting}, and what is not read yet waits")
                });
                problem.into_iter().chain(refused)
            })
            .collect()
    }

    /// The objects of kinds kubevol does not run that manifest files hold (file, kind, name).
    pub fn skipped_objects(&self) -> Vec<(PathBuf, ObjectName)> {
        let o = self.read();
        o.files
            .iter()
            .flat_map(|(path, f)| f.skipped.iter().map(|n| (path.clone(), n.clone())))
            .collect()
    }

    /// Applies a batch of changes as one: every definition is updated first, then the object
    /// in effect for each name is decided, and readers are woken once. So a pod whose
    /// definition moves from one file to another in the batch (a rename) is never seen gone,
    /// and keeps its identity when its content is the same.
    ///
    /// When two origins define the same object, the first in [`Origin`]'s order is in effect
    /// (the library API, then the file whose path sorts first, then the first document); the
    /// others are reported as errors of their files and take over when it goes.
    pub(crate) fn apply(&self, changes: impl IntoIterator<Item = Change>) {
        let mut touched = BTreeSet::new();
        let mut changed = false;
        let mut files = false;
        {
            let mut o = self.write();
            for c in changes {
                files |= matches!(c, Change::File { .. } | Change::Warnings { .. });
                changed |= o.change(c, &mut touched);
            }
            for key in &touched {
                changed |= o.promote(key);
            }
            o.journal.keys.extend(touched);
        }
        if changed {
            self.bump();
        }
        if files {
            self.log_file_errors();
        }
    }

    /// Gives each pod UID of `held` to its pod (namespace, name), whose volumes the record found
    /// mounted at start: a definition of another pod with that UID is refused, whichever came
    /// first since this store began (a file that sorts first cannot take the UID of a running
    /// pod across a restart).
    pub fn hold_pod_uids(&self, held: impl IntoIterator<Item = (PodUid, NsName)>) {
        let changed = {
            let mut o = self.write();
            let mut changed = false;
            for (uid, holder) in held {
                if o.hold_uid(uid.clone(), holder) {
                    o.journal.keys.insert(definitions::Key::Pod(uid));
                    changed = true;
                }
            }
            changed
        };
        if changed {
            self.bump();
            self.log_file_errors();
        }
    }

    /// The definitions of another pod than the one holding pod UID `uid`: their origin and the
    /// namespace and name they give.
    pub fn pod_uid_conflicts(&self, uid: &PodUid) -> Vec<(Origin, NsName)> {
        self.read().uid_conflicts(uid)
    }

    /// Logs the manifest errors (duplicate definitions among them) that appeared since the last
    /// look, and those that cleared.
    fn log_file_errors(&self) {
        let now: BTreeSet<String> = self
            .file_errors()
            .iter()
            .chain(&self.file_warnings())
            .map(|e| e.to_string())
            .collect();
        let mut logged = crate::sync::lock(&self.logged_errors);
        for e in now.difference(&logged) {
            tracing::warn!("{e}");
        }
        for e in logged.difference(&now) {
            tracing::info!("manifest error cleared: {e}");
        }
        *logged = now;
    }

    /// A pod source's handle on the store, registered in the sync gate under `name`: the store
    /// keeps teardown back until every registered source has called [`Sink::synced`].
    pub fn sink(self: &Arc<Self>, name: &'static str) -> Sink {
        self.register_source(name);
        Sink {
            store: self.clone(),
            name,
        }
    }

    /// Every pod.
    pub fn pods(&self) -> Vec<(PodUid, StoredPod)> {
        self.pods_where(|_| true)
    }

    /// The pods `keep` chooses, looked at in place: only those are copied (a pass over the
    /// pods of one origin runs on every change of the store, and a copy of every pod on each
    /// was quadratic in a node's pods as they came).
    pub fn pods_where(&self, keep: impl Fn(&StoredPod) -> bool) -> Vec<(PodUid, StoredPod)> {
        self.read()
            .pods
            .iter()
            .filter(|(_, v)| keep(v))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Whether the store has a pod.
    pub fn has_pod(&self, uid: &PodUid) -> bool {
        self.read().pods.contains_key(uid)
    }

    /// One pod.
    pub fn pod(&self, uid: &PodUid) -> Option<StoredPod> {
        self.read().pods.get(uid).cloned()
    }

    /// Where a pod came from, spelled out for messages (`…/app.yaml (document 1)`, `library
    /// API`): `source removed` once its source no longer has it.
    pub fn pod_source(&self, uid: &PodUid) -> SharedStr {
        match self.read().pods.get(uid) {
            Some(p) => p.source.clone(),
            None => SharedStr::interned("source removed"),
        }
    }

    /// A ConfigMap by namespace and name.
    pub fn config_map(&self, ns: &str, name: &str) -> Option<Stored<ConfigMap>> {
        self.read()
            .config_maps
            .get(&(ns.into(), name.into()))
            .cloned()
    }

    /// A Secret by namespace and name.
    pub fn secret(&self, ns: &str, name: &str) -> Option<Stored<Secret>> {
        self.read().secrets.get(&(ns.into(), name.into())).cloned()
    }

    /// A PersistentVolume by name.
    pub fn persistent_volume(&self, name: &str) -> Option<Stored<PersistentVolume>> {
        self.read().persistent_volumes.get(name).cloned()
    }

    /// Every PersistentVolume.
    pub fn persistent_volumes(&self) -> Vec<Stored<PersistentVolume>> {
        self.read().persistent_volumes.values().cloned().collect()
    }

    /// A PersistentVolumeClaim by namespace and name.
    pub fn persistent_volume_claim(
        &self,
        ns: &str,
        name: &str,
    ) -> Option<Stored<PersistentVolumeClaim>> {
        self.read()
            .persistent_volume_claims
            .get(&(ns.into(), name.into()))
            .cloned()
    }

    /// A VolumeSnapshot by namespace and name.
    pub fn volume_snapshot(
        &self,
        ns: &str,
        name: &str,
    ) -> Option<Stored<kubevol_core::snapshot::VolumeSnapshot>> {
        self.read()
            .volume_snapshots
            .get(&(ns.into(), name.into()))
            .cloned()
    }

    /// A VolumeSnapshotContent by name.
    pub fn volume_snapshot_content(
        &self,
        name: &str,
    ) -> Option<Stored<kubevol_core::snapshot::VolumeSnapshotContent>> {
        self.read().volume_snapshot_contents.get(name).cloned()
    }

    /// A CSIDriver by name.
    pub fn csi_driver(&self, name: &str) -> Option<Stored<CSIDriver>> {
        self.read().csi_drivers.get(name).cloned()
    }

    /// Adds what kubevol made: volumes it provisioned (recorded in [`Bindings`] first), claims
    /// of generic ephemeral volumes.
    pub fn add_provisioned(&self, objects: impl IntoIterator<Item = Object>) {
        self.apply(
            objects
                .into_iter()
                .map(|o| Change::Provisioned(Box::new(o)))
                .collect::<Vec<_>>(),
        );
    }

    /// Removes a volume kubevol provisioned (deleted, and forgotten by [`Bindings`] first).
    pub fn remove_provisioned(&self, name: &str) {
        self.apply([Change::Unprovisioned(ObjectKey::PersistentVolume(
            name.to_string(),
        ))]);
    }

    /// Removes the claims kubevol made for pod `uid` (their controlling owner); claims of the
    /// manifests or the library are never touched.
    pub fn remove_claims_made_for(&self, uid: &str) {
        let made: Vec<Change> = self
            .read()
            .persistent_volume_claims
            .iter()
            .filter(|(_, c)| {
                c.origin == Origin::Provisioned
                    && c.object
                        .metadata
                        .owner_references
                        .iter()
                        .flatten()
                        .any(|o| o.controller == Some(true) && o.uid == uid)
            })
            .map(|(k, _)| Change::Unprovisioned(ObjectKey::PersistentVolumeClaim(k.clone())))
            .collect();
        if !made.is_empty() {
            self.apply(made);
        }
    }

    /// Has the readers of claim `namespace/name` look at it again, though nothing of it
    /// changed (its volume could not be made, and may be now).
    pub fn touch_claim(&self, namespace: &str, name: &str) {
        self.write()
            .journal
            .keys
            .insert(ObjectKey::PersistentVolumeClaim((
                namespace.into(),
                name.into(),
            )));
        self.bump();
    }

    /// Every PersistentVolumeClaim.
    pub fn persistent_volume_claims(&self) -> Vec<Stored<PersistentVolumeClaim>> {
        self.persistent_volume_claims_where(|_| true)
    }

    /// The PersistentVolumeClaims `keep` chooses, looked at in place: only those are copied
    /// (the storage pass, which runs on every change, serves only the claims of some origins).
    pub fn persistent_volume_claims_where(
        &self,
        keep: impl Fn(&Stored<PersistentVolumeClaim>) -> bool,
    ) -> Vec<Stored<PersistentVolumeClaim>> {
        self.read()
            .persistent_volume_claims
            .values()
            .filter(|c| keep(c))
            .cloned()
            .collect()
    }

    /// Every StorageClass.
    pub fn storage_classes(&self) -> Vec<Stored<StorageClass>> {
        self.read().storage_classes.values().cloned().collect()
    }

    /// Whether an object is still to be delivered by the API server: its watch has started
    /// but not listed it yet (see [`Change::ClusterPending`]).
    pub fn pending(&self, key: &ObjectKey) -> bool {
        self.read().pending.contains(key)
    }

    /// Whether the store holds the ConfigMap or Secret of `key`, whose volumes then show its
    /// content (`false` for other kinds).
    pub fn holds_content(&self, key: &ObjectKey) -> bool {
        let s = self.read();
        match key {
            ObjectKey::ConfigMap(k) => s.config_maps.contains_key(k),
            ObjectKey::Secret(k) => s.secrets.contains_key(k),
            _ => false,
        }
    }

    /// Whether the API server said an object read by name does not exist (see
    /// [`Change::ClusterAbsent`]).
    pub fn absent(&self, key: &ObjectKey) -> bool {
        self.read().absent.contains(key)
    }

    /// The keys whose objects changed since the last call (pods by UID, the objects they
    /// read, an object's pending state), and whether anything else may have changed what a
    /// pod reads (a manifest file's errors): the populator processes only the pods these touch.
    pub fn take_changes(&self) -> (BTreeSet<ObjectKey>, bool) {
        let journal = std::mem::take(&mut self.write().journal);
        (journal.keys, journal.everything)
    }

    /// A Node by name.
    pub fn node(&self, name: &str) -> Option<Stored<Node>> {
        self.read().nodes.get(name).cloned()
    }

    /// Why an object the store does not hold is not there, when a manifest file with an error
    /// defines it (such a file is not applied): a sentence for the message of whatever needs
    /// the object. `namespace` is ignored for cluster-scoped kinds.
    pub fn not_loaded(&self, kind: &str, namespace: &str, name: &str) -> Option<String> {
        let o = self.read();
        let err = o.files.values().flat_map(|f| &f.errors).find(|e| {
            e.object.as_ref().is_some_and(|x| {
                x.kind == kind
                    && x.name == name
                    && (x.namespace.is_empty() || x.namespace == namespace)
            })
        })?;
        Some(format!(
            "it is defined in {err}; that file is not applied while it has an error: fix it"
        ))
    }

    /// What to say of an object the store does not hold: that a broken manifest file holds it
    /// back (see [`ObjectStore::not_loaded`]), or that it does not exist.
    pub fn absence(&self, kind: &str, namespace: &str, name: &str) -> String {
        // Only what is read with GET (claims and PersistentVolumes) is ever marked absent.
        let (ns, n) = (namespace.to_string(), name.to_string());
        let key = match kind {
            "PersistentVolumeClaim" => Some(ObjectKey::PersistentVolumeClaim((ns, n))),
            "PersistentVolume" => Some(ObjectKey::PersistentVolume(n)),
            _ => None,
        };
        if key.is_some_and(|k| self.absent(&k)) {
            return "does not exist in the API server: create it (it is read again with backoff, every 8 s at most)".into();
        }
        match self.not_loaded(kind, namespace, name) {
            Some(why) => format!("is not loaded: {why}"),
            None => "does not exist: add it to the manifests".into(),
        }
    }

    /// Every manifest warning (a field kubevol's API types do not have), file by file.
    pub fn file_warnings(&self) -> Vec<ManifestError> {
        self.read()
            .files
            .values()
            .flat_map(|f| f.warnings.iter().cloned())
            .collect()
    }

    /// Every manifest error, file by file.
    pub fn file_errors(&self) -> Vec<ManifestError> {
        let o = self.read();
        o.files
            .iter()
            .flat_map(|(path, entry)| o.errors_of(path, entry))
            .collect()
    }
}

/// A pod source's handle on the store: its changes go in, and its first listing is marked
/// complete. Made by [`ObjectStore::sink`], which registers the source in the sync gate; the
/// only way for anything outside the store to write it.
#[derive(Clone)]
pub struct Sink {
    store: Arc<ObjectStore>,
    name: &'static str,
}

impl Sink {
    /// Applies a batch of changes as one (see [`ObjectStore::apply`]).
    pub fn apply(&self, changes: impl IntoIterator<Item = Change>) {
        self.store.apply(changes);
    }

    /// Records that the source has delivered its complete first listing.
    pub fn synced(&self) {
        self.store.mark_source_synced(self.name);
    }

    /// Records why the source cannot deliver now (shown by the status), or that it can again.
    pub fn problem(&self, problem: Option<String>) {
        self.store.set_source_problem(self.name, problem);
    }

    /// Records that the API server refuses the source's new reads (its credentials: an expired
    /// certificate, a revoked token), or that a new read was taken again (`None`).
    pub fn refused(&self, why: Option<String>) {
        self.store.set_source_refused(self.name, why);
    }
}

#[cfg(test)]
mod tests;
