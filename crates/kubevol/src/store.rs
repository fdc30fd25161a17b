//! The object store: pods and the objects they reference, as delivered by pod sources.
//!
//! Sources (the manifest directory, the library API, later the API server) write here; the
//! populator reads. Each object remembers where it came from, so an error can name the manifest
//! file, and so a file's objects can be replaced or removed as a whole. Every change bumps a
//! generation on a watch channel: readers are woken, never poll.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::storage::v1::CSIDriver;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kubevol_core::projection::ObjectKind;
use kubevol_core::PodUid;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// Where an object came from. The order is the precedence when two origins define the same
/// object: the library API first, then manifest files by path (byte order) and document.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Origin {
    /// The library API (an embedding node agent).
    Api,
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
        }
    }
}

/// An object kept in the store. The variants differ in size, but objects are parsed once and
/// moved into `Arc`s right away, so boxing them would only add an allocation.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Object {
    /// A pod (namespace and UID already filled in).
    Pod(Pod),
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
}

/// The namespace name of the kubelet's default namespace.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The namespace under which pod UIDs are derived (a fixed, random UUID).
const UID_NAMESPACE: uuid::Uuid = uuid::Uuid::from_bytes([
    0x5c, 0x1e, 0x7a, 0x43, 0x2b, 0x9d, 0x4f, 0x0e, 0x8a, 0x61, 0x3d, 0x77, 0xc2, 0x15, 0xe9, 0x04,
]);

/// A pod's UID: `metadata.uid` when set, else a UUID derived from its namespace and name, stable
/// across restarts.
pub fn pod_uid(pod: &Pod) -> PodUid {
    if let Some(uid) = pod.metadata.uid.as_deref().filter(|u| !u.is_empty()) {
        return PodUid(uid.to_string());
    }
    let ns = pod
        .metadata
        .namespace
        .as_deref()
        .unwrap_or(DEFAULT_NAMESPACE);
    let name = pod.metadata.name.as_deref().unwrap_or("");
    PodUid(uuid::Uuid::new_v5(&UID_NAMESPACE, format!("{ns}/{name}").as_bytes()).to_string())
}

/// Fills in a pod's defaults: the `default` namespace and its UID.
pub fn normalize_pod(mut pod: Pod) -> Pod {
    if pod.metadata.namespace.as_deref().unwrap_or("").is_empty() {
        pod.metadata.namespace = Some(DEFAULT_NAMESPACE.to_string());
    }
    let uid = pod_uid(&pod);
    pod.metadata.uid = Some(uid.0);
    pod
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
    /// Its origin.
    pub origin: Origin,
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

type NsName = (String, String);

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

/// What the store keys an object by: its kind and name (a pod by its UID).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Key {
    Pod(PodUid),
    ConfigMap(NsName),
    Secret(NsName),
    PersistentVolume(String),
    PersistentVolumeClaim(NsName),
    CSIDriver(String),
}

impl Key {
    fn of(obj: &Object) -> Key {
        let name = |m: &ObjectMeta| m.name.clone().unwrap_or_default();
        match obj {
            Object::Pod(p) => Key::Pod(pod_uid(p)),
            Object::ConfigMap(c) => Key::ConfigMap(ns_name(&c.metadata)),
            Object::Secret(s) => Key::Secret(ns_name(&s.metadata)),
            Object::PersistentVolume(pv) => Key::PersistentVolume(name(&pv.metadata)),
            Object::PersistentVolumeClaim(c) => Key::PersistentVolumeClaim(ns_name(&c.metadata)),
            Object::CSIDriver(d) => Key::CSIDriver(name(&d.metadata)),
        }
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Key::Pod(uid) => write!(f, "pod (uid {uid})"),
            Key::ConfigMap((ns, n)) => write!(f, "ConfigMap {ns}/{n}"),
            Key::Secret((ns, n)) => write!(f, "Secret {ns}/{n}"),
            Key::PersistentVolume(n) => write!(f, "PersistentVolume {n}"),
            Key::PersistentVolumeClaim((ns, n)) => write!(f, "PersistentVolumeClaim {ns}/{n}"),
            Key::CSIDriver(n) => write!(f, "CSIDriver {n}"),
        }
    }
}

/// One definition of an object, shared with the store's view when it is the one in effect (so
/// that readers comparing by identity see no change when only its origin changes).
#[derive(Clone, Debug)]
enum Shared {
    Pod(Arc<Pod>),
    ConfigMap(Arc<ConfigMap>),
    Secret(Arc<Secret>),
    PersistentVolume(Arc<PersistentVolume>),
    PersistentVolumeClaim(Arc<PersistentVolumeClaim>),
    CSIDriver(Arc<CSIDriver>),
}

impl From<Object> for Shared {
    fn from(obj: Object) -> Self {
        match obj {
            Object::Pod(x) => Shared::Pod(Arc::new(x)),
            Object::ConfigMap(x) => Shared::ConfigMap(Arc::new(x)),
            Object::Secret(x) => Shared::Secret(Arc::new(x)),
            Object::PersistentVolume(x) => Shared::PersistentVolume(Arc::new(x)),
            Object::PersistentVolumeClaim(x) => Shared::PersistentVolumeClaim(Arc::new(x)),
            Object::CSIDriver(x) => Shared::CSIDriver(Arc::new(x)),
        }
    }
}

impl Shared {
    /// Whether two definitions have the same content.
    fn same(&self, other: &Shared) -> bool {
        match (self, other) {
            (Shared::Pod(a), Shared::Pod(b)) => a == b,
            (Shared::ConfigMap(a), Shared::ConfigMap(b)) => a == b,
            (Shared::Secret(a), Shared::Secret(b)) => a == b,
            (Shared::PersistentVolume(a), Shared::PersistentVolume(b)) => a == b,
            (Shared::PersistentVolumeClaim(a), Shared::PersistentVolumeClaim(b)) => a == b,
            (Shared::CSIDriver(a), Shared::CSIDriver(b)) => a == b,
            _ => false,
        }
    }

    /// The object's validation errors, joined (ConfigMaps and Secrets are checked here; pods
    /// by the populator).
    fn invalid(&self) -> Option<String> {
        use kubevol_core::validation::{validate_config_map, validate_secret};
        let errs = match self {
            Shared::ConfigMap(c) => validate_config_map(c),
            Shared::Secret(s) => validate_secret(s),
            _ => return None,
        };
        (!errs.is_empty()).then(|| {
            errs.iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        })
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
    /// An object given through the library API, added or replaced.
    Upsert(Object),
    /// A pod given through the library API, removed.
    RemovePod(PodUid),
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

/// What the store knows of one manifest file.
#[derive(Default)]
struct FileEntry {
    /// The definitions it delivered (document, key).
    defs: Vec<(usize, Key)>,
    /// Why its last read was not applied.
    errors: Vec<ManifestError>,
}

#[derive(Default)]
struct Objects {
    // The objects in effect: for each key, the definition of the first origin (see `Origin`).
    pods: BTreeMap<PodUid, StoredPod>,
    config_maps: BTreeMap<NsName, Stored<ConfigMap>>,
    secrets: BTreeMap<NsName, Stored<Secret>>,
    persistent_volumes: BTreeMap<String, Stored<PersistentVolume>>,
    persistent_volume_claims: BTreeMap<NsName, Stored<PersistentVolumeClaim>>,
    csi_drivers: BTreeMap<String, Stored<CSIDriver>>,
    /// Every definition of every object, by origin: when the one in effect goes, the next one
    /// takes its place without any file being read again.
    defs: HashMap<Key, BTreeMap<Origin, Shared>>,
    files: BTreeMap<PathBuf, FileEntry>,
}

/// Puts `def` (from `origin`) in effect in `map`, keeping the object in effect when its content
/// is the same. Returns whether anything changed.
fn put<K: Ord, T: PartialEq>(
    map: &mut BTreeMap<K, Stored<T>>,
    key: K,
    def: &Arc<T>,
    origin: &Origin,
    invalid: Option<String>,
) -> bool {
    let invalid = invalid.map(|list| Arc::from(format!("{origin}: {list}")));
    match map.get_mut(&key) {
        Some(s) if Arc::ptr_eq(&s.object, def) || *s.object == **def => {
            if s.origin == *origin && s.invalid == invalid {
                return false;
            }
            s.origin = origin.clone();
            s.invalid = invalid;
            true
        }
        _ => {
            map.insert(
                key,
                Stored {
                    object: def.clone(),
                    origin: origin.clone(),
                    invalid,
                },
            );
            true
        }
    }
}

impl Objects {
    /// Puts the first definition of `key` in effect, or removes the object when none is left.
    /// Returns whether what readers see changed.
    fn promote(&mut self, key: &Key) -> bool {
        let first = self
            .defs
            .get(key)
            .and_then(|m| m.iter().next())
            .map(|(o, d)| (o.clone(), d.clone()));
        let Some((origin, def)) = first else {
            self.defs.remove(key);
            return match key {
                Key::Pod(k) => self.pods.remove(k).is_some(),
                Key::ConfigMap(k) => self.config_maps.remove(k).is_some(),
                Key::Secret(k) => self.secrets.remove(k).is_some(),
                Key::PersistentVolume(k) => self.persistent_volumes.remove(k).is_some(),
                Key::PersistentVolumeClaim(k) => self.persistent_volume_claims.remove(k).is_some(),
                Key::CSIDriver(k) => self.csi_drivers.remove(k).is_some(),
            };
        };
        let invalid = def.invalid();
        match (key, &def) {
            (Key::Pod(k), Shared::Pod(p)) => match self.pods.get_mut(k) {
                Some(s) if Arc::ptr_eq(&s.pod, p) || *s.pod == **p => {
                    let moved = s.origin != origin;
                    s.origin = origin;
                    moved
                }
                _ => {
                    self.pods.insert(
                        k.clone(),
                        StoredPod {
                            pod: p.clone(),
                            origin,
                        },
                    );
                    true
                }
            },
            (Key::ConfigMap(k), Shared::ConfigMap(d)) => {
                put(&mut self.config_maps, k.clone(), d, &origin, invalid)
            }
            (Key::Secret(k), Shared::Secret(d)) => {
                put(&mut self.secrets, k.clone(), d, &origin, invalid)
            }
            (Key::PersistentVolume(k), Shared::PersistentVolume(d)) => {
                put(&mut self.persistent_volumes, k.clone(), d, &origin, None)
            }
            (Key::PersistentVolumeClaim(k), Shared::PersistentVolumeClaim(d)) => put(
                &mut self.persistent_volume_claims,
                k.clone(),
                d,
                &origin,
                None,
            ),
            (Key::CSIDriver(k), Shared::CSIDriver(d)) => {
                put(&mut self.csi_drivers, k.clone(), d, &origin, None)
            }
            _ => unreachable!("a key and its definitions are of one kind"),
        }
    }

    /// Adds one definition; returns its key.
    fn define(&mut self, origin: Origin, obj: Object) -> Key {
        let key = Key::of(&obj);
        self.defs
            .entry(key.clone())
            .or_default()
            .insert(origin, obj.into());
        key
    }

    /// Drops one definition.
    fn undefine(&mut self, key: &Key, origin: &Origin) {
        if let Some(m) = self.defs.get_mut(key) {
            m.remove(origin);
        }
    }

    /// Whether a file's new objects are exactly what it delivered before.
    fn file_unchanged(&self, path: &Path, objects: &[(usize, Object)]) -> bool {
        let Some(entry) = self.files.get(path) else {
            return objects.is_empty();
        };
        entry.errors.is_empty()
            && entry.defs.len() == objects.len()
            && objects.iter().zip(&entry.defs).all(|((doc, obj), (d, k))| {
                let origin = Origin::File {
                    path: path.to_path_buf(),
                    document: *doc,
                };
                let key = Key::of(obj);
                doc == d
                    && key == *k
                    && self
                        .defs
                        .get(&key)
                        .and_then(|m| m.get(&origin))
                        .is_some_and(|have| have.same(&obj.clone().into()))
            })
    }

    /// Applies one change; `touched` collects the keys whose definitions changed.
    fn change(&mut self, change: Change, touched: &mut BTreeSet<Key>) -> bool {
        match change {
            Change::File { path, content } => match content {
                FileContent::Objects(objects) => {
                    if self.file_unchanged(&path, &objects) {
                        return false;
                    }
                    let old = self.files.remove(&path).unwrap_or_default();
                    for (document, key) in old.defs {
                        let origin = Origin::File {
                            path: path.clone(),
                            document,
                        };
                        self.undefine(&key, &origin);
                        touched.insert(key);
                    }
                    let mut entry = FileEntry::default();
                    for (document, obj) in objects {
                        let origin = Origin::File {
                            path: path.clone(),
                            document,
                        };
                        let key = self.define(origin, obj);
                        entry.defs.push((document, key.clone()));
                        touched.insert(key);
                    }
                    self.files.insert(path, entry);
                    true
                }
                FileContent::Broken(errors) => {
                    let entry = self.files.entry(path).or_default();
                    if entry.errors == errors {
                        return false;
                    }
                    entry.errors = errors;
                    true
                }
                FileContent::Gone => {
                    let Some(old) = self.files.remove(&path) else {
                        return false;
                    };
                    for (document, key) in old.defs {
                        let origin = Origin::File {
                            path: path.clone(),
                            document,
                        };
                        self.undefine(&key, &origin);
                        touched.insert(key);
                    }
                    true
                }
            },
            Change::Upsert(obj) => {
                let obj = match obj {
                    Object::Pod(p) => Object::Pod(normalize_pod(p)),
                    Object::Secret(s) => Object::Secret(normalize_secret(s)),
                    other => other,
                };
                let key = Key::of(&obj);
                let unchanged = self
                    .defs
                    .get(&key)
                    .and_then(|m| m.get(&Origin::Api))
                    .is_some_and(|have| have.same(&obj.clone().into()));
                if unchanged {
                    return false;
                }
                self.define(Origin::Api, obj);
                touched.insert(key);
                true
            }
            Change::RemovePod(uid) => {
                let key = Key::Pod(uid);
                self.undefine(&key, &Origin::Api);
                touched.insert(key);
                true
            }
            Change::RemoveObject {
                kind,
                namespace,
                name,
            } => {
                let key = match kind {
                    ObjectKind::ConfigMap => Key::ConfigMap((namespace, name)),
                    ObjectKind::Secret => Key::Secret((namespace, name)),
                };
                self.undefine(&key, &Origin::Api);
                touched.insert(key);
                true
            }
        }
    }

    /// The errors to report for a file: why it is not applied, its invalid objects, and its
    /// definitions that another origin overrides.
    fn errors_of(&self, path: &Path, entry: &FileEntry) -> Vec<ManifestError> {
        let mut out = entry.errors.clone();
        for (document, key) in &entry.defs {
            let here = Origin::File {
                path: path.to_path_buf(),
                document: *document,
            };
            let Some(defs) = self.defs.get(key) else {
                continue;
            };
            let report = |message: String| ManifestError {
                path: path.to_path_buf(),
                document: Some(*document),
                line: None,
                column: None,
                message,
                object: None,
            };
            match defs.iter().next() {
                Some((winner, _)) if *winner != here => {
                    let what = match (key, defs.get(&here)) {
                        (Key::Pod(uid), Some(Shared::Pod(p))) => format!(
                            "pod {}/{} (uid {uid})",
                            p.metadata.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE),
                            p.metadata.name.as_deref().unwrap_or_default()
                        ),
                        _ => key.to_string(),
                    };
                    let rule = match winner {
                        Origin::Api => "the library API's definition wins",
                        Origin::File { path: p, .. } if p == path => {
                            "the first document of a file wins"
                        }
                        Origin::File { .. } => "the file whose path sorts first wins",
                    };
                    out.push(report(format!(
                        "{what} is also defined by {winner} ({rule}); this definition is ignored while that one exists: remove one of them"
                    )));
                }
                _ => {
                    if let Some(list) = defs.get(&here).and_then(Shared::invalid) {
                        out.push(report(format!(
                            "{key} is invalid and pods that use it will fail; fix these fields: {list}"
                        )));
                    }
                }
            }
        }
        out
    }
}

fn ns_name(meta: &ObjectMeta) -> NsName {
    (
        meta.namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| DEFAULT_NAMESPACE.into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// The store.
pub struct ObjectStore {
    objects: RwLock<Objects>,
    changed: watch::Sender<u64>,
    sources: Mutex<BTreeMap<String, bool>>,
}

impl Default for ObjectStore {
    fn default() -> Self {
        ObjectStore {
            objects: RwLock::default(),
            changed: watch::channel(0).0,
            sources: Mutex::default(),
        }
    }
}

impl ObjectStore {
    /// An empty store with no registered sources.
    pub fn new() -> Self {
        Self::default()
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
    pub fn register_source(&self, name: &str) {
        crate::sync::lock(&self.sources)
            .entry(name.to_string())
            .or_insert(false);
        self.bump();
    }

    /// Records that a source has delivered its complete first listing.
    pub fn mark_source_synced(&self, name: &str) {
        crate::sync::lock(&self.sources).insert(name.to_string(), true);
        self.bump();
    }

    /// Whether every registered source has synced.
    pub fn all_sources_synced(&self) -> bool {
        crate::sync::lock(&self.sources).values().all(|s| *s)
    }

    /// Applies a batch of changes as one: every definition is updated first, then the object
    /// in effect for each name is decided, and readers are woken once. So a pod whose
    /// definition moves from one file to another in the batch (a rename) is never seen gone,
    /// and keeps its identity when its content is the same.
    ///
    /// When two origins define the same object, the first in [`Origin`]'s order is in effect
    /// (the library API, then the file whose path sorts first, then the first document); the
    /// others are reported as errors of their files and take over when it goes.
    pub fn apply(&self, changes: impl IntoIterator<Item = Change>) {
        let mut touched = BTreeSet::new();
        let mut changed = false;
        {
            let mut o = self.write();
            for c in changes {
                changed |= o.change(c, &mut touched);
            }
            for key in &touched {
                changed |= o.promote(key);
            }
        }
        if changed {
            self.bump();
        }
    }

    /// The files that have delivered objects or errors.
    pub fn known_files(&self) -> Vec<PathBuf> {
        self.read().files.keys().cloned().collect()
    }

    /// Adds or replaces a pod given through the library API. Returns its UID.
    pub fn upsert_pod(&self, pod: Pod) -> PodUid {
        self.upsert_pods([pod]).remove(0)
    }

    /// Adds or replaces many pods given through the library API in one change (one wake-up of
    /// the populator). Returns their UIDs.
    pub fn upsert_pods(&self, pods: impl IntoIterator<Item = Pod>) -> Vec<PodUid> {
        let pods: Vec<Pod> = pods.into_iter().map(normalize_pod).collect();
        let uids = pods.iter().map(pod_uid).collect();
        self.apply(pods.into_iter().map(|p| Change::Upsert(Object::Pod(p))));
        uids
    }

    /// Adds or replaces objects given through the library API (ConfigMaps, Secrets, ...) in one
    /// change. Returns the problems found (an invalid object is kept and fails the pods that
    /// use it).
    pub fn upsert_objects(&self, objects: impl IntoIterator<Item = Object>) -> Vec<String> {
        let objects: Vec<Object> = objects.into_iter().collect();
        let problems = objects
            .iter()
            .filter_map(|obj| {
                let shared = match obj {
                    Object::Secret(s) => Shared::from(Object::Secret(normalize_secret(s.clone()))),
                    other => Shared::from(other.clone()),
                };
                let list = shared.invalid()?;
                Some(format!(
                    "{} is invalid and pods that use it will fail; fix these fields: {list}",
                    Key::of(obj)
                ))
            })
            .collect();
        self.apply(objects.into_iter().map(Change::Upsert));
        problems
    }

    /// Removes a ConfigMap or Secret given through the library API.
    pub fn remove_object(&self, kind: ObjectKind, namespace: &str, name: &str) {
        self.apply([Change::RemoveObject {
            kind,
            namespace: namespace.to_string(),
            name: name.to_string(),
        }]);
    }

    /// Removes a pod given through the library API.
    pub fn remove_pod(&self, uid: &PodUid) {
        self.remove_pods(std::slice::from_ref(uid));
    }

    /// Removes many pods given through the library API in one change.
    pub fn remove_pods(&self, uids: &[PodUid]) {
        self.apply(uids.iter().cloned().map(Change::RemovePod));
    }

    /// Every pod.
    pub fn pods(&self) -> Vec<(PodUid, StoredPod)> {
        self.read()
            .pods
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// One pod.
    pub fn pod(&self, uid: &PodUid) -> Option<StoredPod> {
        self.read().pods.get(uid).cloned()
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

    /// A CSIDriver by name.
    pub fn csi_driver(&self, name: &str) -> Option<Stored<CSIDriver>> {
        self.read().csi_drivers.get(name).cloned()
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
        match self.not_loaded(kind, namespace, name) {
            Some(why) => format!("is not loaded: {why}"),
            None => "does not exist: add it to the manifests".into(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A file read with these objects.
    fn load(s: &ObjectStore, path: &Path, objects: Vec<(usize, Object)>) {
        s.apply([Change::File {
            path: path.to_path_buf(),
            content: FileContent::Objects(objects),
        }]);
    }

    fn gone(path: &Path) -> Change {
        Change::File {
            path: path.to_path_buf(),
            content: FileContent::Gone,
        }
    }

    fn pod(ns: Option<&str>, name: &str) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.namespace = ns.map(Into::into);
        p
    }

    #[test]
    fn derived_uid_is_stable_and_depends_on_namespace_and_name() {
        let a = pod_uid(&pod(None, "web"));
        assert_eq!(
            a,
            pod_uid(&pod(Some("default"), "web")),
            "namespace defaults to default"
        );
        assert_eq!(a, pod_uid(&pod(None, "web")));
        assert_ne!(a, pod_uid(&pod(Some("prod"), "web")));
        assert!(kubevol_core::validation::is_canonical_uuid(a.as_str()));
        let mut explicit = pod(None, "web");
        explicit.metadata.uid = Some("0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70".into());
        assert_eq!(
            pod_uid(&explicit).as_str(),
            "0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70"
        );
    }

    #[test]
    fn an_invalid_config_map_is_kept_with_its_reason_and_reported_for_its_file() {
        let store = ObjectStore::new();
        let file = std::path::Path::new("/m/config.yaml");
        let cm: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "app", "namespace": "prod"},
            "data": {"ok": "1", "bad/key": "2"},
        }))
        .unwrap();
        load(&store, file, vec![(2, Object::ConfigMap(cm))]);
        let errors = store.file_errors();
        assert_eq!(errors.len(), 1);
        assert_eq!(
            (errors[0].path.as_path(), errors[0].document),
            (file, Some(2))
        );
        assert!(
            errors[0].message.starts_with("ConfigMap prod/app is invalid and pods that use it will fail; fix these fields: data[bad/key]: Invalid value: \"bad/key\": a valid config key"),
            "{}",
            errors[0].message
        );
        let stored = store.config_map("prod", "app").expect("kept");
        assert_eq!(
            stored.invalid.as_deref().unwrap(),
            format!(
                "/m/config.yaml (document 2): {}",
                errors[0]
                    .message
                    .split("fix these fields: ")
                    .nth(1)
                    .unwrap()
            )
        );
    }

    #[test]
    fn a_file_is_replaced_as_a_whole_and_duplicates_are_reported() {
        let s = ObjectStore::new();
        let a = PathBuf::from("/m/a.yaml");
        let b = PathBuf::from("/m/b.yaml");
        load(
            &s,
            &a,
            vec![
                (1, Object::Pod(normalize_pod(pod(None, "x")))),
                (2, Object::Pod(normalize_pod(pod(None, "y")))),
            ],
        );
        assert_eq!(s.pods().len(), 2);
        load(
            &s,
            &b,
            vec![(1, Object::Pod(normalize_pod(pod(None, "x"))))],
        );
        assert_eq!(s.pods().len(), 2);
        let errs = s.file_errors();
        assert_eq!(errs.len(), 1);
        assert!(
            errs[0]
                .to_string()
                .contains("/m/b.yaml: document 1: pod default/x"),
            "{}",
            errs[0]
        );
        load(
            &s,
            &a,
            vec![(1, Object::Pod(normalize_pod(pod(None, "y"))))],
        );
        assert_eq!(
            s.pods().len(),
            2,
            "x went away from a.yaml, and b.yaml's definition took its place"
        );
        assert!(s.file_errors().is_empty(), "{:?}", s.file_errors());
        s.apply([gone(&a)]);
        assert_eq!(s.pods().len(), 1);
        s.apply([gone(&b)]);
        assert!(s.pods().is_empty());
    }

    #[test]
    fn reloading_identical_content_changes_nothing() {
        let s = ObjectStore::new();
        let a = PathBuf::from("/m/a.yaml");
        let objs = || vec![(1, Object::Pod(normalize_pod(pod(None, "x"))))];
        load(&s, &a, objs());
        let before = s.pods()[0].1.pod.clone();
        let mut rx = s.subscribe();
        rx.borrow_and_update();
        load(&s, &a, objs());
        assert!(!rx.has_changed().unwrap(), "no change announced");
        assert!(
            Arc::ptr_eq(&before, &s.pods()[0].1.pod),
            "the same object is kept"
        );
        load(
            &s,
            &a,
            vec![(1, Object::Pod(normalize_pod(pod(None, "y"))))],
        );
        assert!(rx.has_changed().unwrap());
    }

    /// Every pod's (UID, origin), and whether it is the same object as in `before`.
    fn pods_seen(s: &ObjectStore) -> Vec<(PodUid, Origin, Arc<Pod>)> {
        s.pods()
            .into_iter()
            .map(|(u, p)| (u, p.origin, p.pod))
            .collect()
    }

    #[test]
    fn a_renamed_file_keeps_its_pods_in_any_order_of_events() {
        let web = || vec![(1, Object::Pod(normalize_pod(pod(None, "web"))))];
        let (old, new) = (
            PathBuf::from("/m/web.yaml"),
            PathBuf::from("/m/00-web.yaml"),
        );
        let file = |p: &Path| Origin::File {
            path: p.to_path_buf(),
            document: 1,
        };
        // (row, the changes a rename gives, applied one batch at a time)
        let rows: [(&str, Vec<Vec<Change>>); 3] = [
            (
                "one batch",
                vec![vec![
                    gone(&old),
                    Change::File {
                        path: new.clone(),
                        content: FileContent::Objects(web()),
                    },
                ]],
            ),
            (
                "new name read first, old name gone later",
                vec![
                    vec![Change::File {
                        path: new.clone(),
                        content: FileContent::Objects(web()),
                    }],
                    vec![gone(&old)],
                ],
            ),
            (
                "old name gone first, in the same batch as the new name",
                vec![vec![
                    Change::File {
                        path: new.clone(),
                        content: FileContent::Objects(web()),
                    },
                    gone(&old),
                ]],
            ),
        ];
        for (row, batches) in rows {
            let s = ObjectStore::new();
            load(&s, &old, web());
            let before = pods_seen(&s);
            assert_eq!(before[0].1, file(&old), "row {row}");
            let rx = s.subscribe();
            for batch in batches {
                s.apply(batch);
                let now = pods_seen(&s);
                assert_eq!(now.len(), 1, "row {row}: the pod is never gone");
                assert!(
                    Arc::ptr_eq(&now[0].2, &before[0].2),
                    "row {row}: the same object, so nothing is set up again"
                );
            }
            assert_eq!(pods_seen(&s)[0].1, file(&new), "row {row}");
            assert!(
                s.file_errors().is_empty(),
                "row {row}: {:?}",
                s.file_errors()
            );
            assert!(rx.has_changed().unwrap(), "row {row}: the origin changed");
        }
    }

    #[test]
    fn the_first_file_wins_a_duplicate_whatever_order_they_are_read_in() {
        let (a, b) = (PathBuf::from("/m/a.yaml"), PathBuf::from("/m/b.yaml"));
        let with_label = |v: &str| {
            let mut p = pod(None, "x");
            p.metadata.labels = Some([("from".to_string(), v.to_string())].into());
            vec![(1, Object::Pod(normalize_pod(p)))]
        };
        for order in [[&a, &b], [&b, &a]] {
            let s = ObjectStore::new();
            for path in order {
                let from = path.file_name().unwrap().to_str().unwrap();
                load(&s, path, with_label(from));
            }
            let (_, stored) = s.pods().remove(0);
            let label =
                |stored: &StoredPod| stored.pod.metadata.labels.as_ref().unwrap()["from"].clone();
            assert_eq!(label(&stored), "a.yaml", "order {order:?}");
            let errs = s.file_errors();
            assert_eq!(errs.len(), 1, "{errs:?}");
            assert!(
                errs[0].to_string().starts_with("/m/b.yaml: document 1: pod default/x (uid ")
                    && errs[0].message.contains("is also defined by /m/a.yaml (document 1) (the file whose path sorts first wins)"),
                "{}",
                errs[0]
            );
            // The winner goes: the other definition takes over without its file being read.
            s.apply([gone(&a)]);
            let (_, stored) = s.pods().remove(0);
            assert_eq!(label(&stored), "b.yaml");
            assert!(s.file_errors().is_empty());
        }
    }

    #[test]
    fn a_broken_file_keeps_what_it_delivered() {
        let s = ObjectStore::new();
        let a = PathBuf::from("/m/a.yaml");
        load(
            &s,
            &a,
            vec![(1, Object::Pod(normalize_pod(pod(None, "x"))))],
        );
        let err = ManifestError {
            path: a.clone(),
            document: Some(1),
            line: Some(3),
            column: Some(1),
            message: "bad".into(),
            object: None,
        };
        s.apply([Change::File {
            path: a.clone(),
            content: FileContent::Broken(vec![err.clone()]),
        }]);
        assert_eq!(s.pods().len(), 1);
        assert_eq!(s.file_errors(), vec![err]);
        load(
            &s,
            &a,
            vec![(1, Object::Pod(normalize_pod(pod(None, "x"))))],
        );
        assert!(s.file_errors().is_empty());
        assert_eq!(s.pods().len(), 1);
    }

    #[test]
    fn the_library_api_wins_over_files_and_removes_only_its_own() {
        let s = ObjectStore::new();
        let a = PathBuf::from("/m/a.yaml");
        load(
            &s,
            &a,
            vec![(1, Object::Pod(normalize_pod(pod(None, "x"))))],
        );
        let uid = s.upsert_pod(pod(None, "x"));
        assert_eq!(s.pod(&uid).unwrap().origin, Origin::Api);
        assert!(s.file_errors()[0]
            .message
            .contains("the library API's definition wins"));
        s.remove_pod(&uid);
        assert!(
            matches!(s.pod(&uid).unwrap().origin, Origin::File { .. }),
            "the file's definition is back"
        );
    }

    #[test]
    fn sources_gate_until_all_synced() {
        let s = ObjectStore::new();
        assert!(s.all_sources_synced());
        s.register_source("file");
        assert!(!s.all_sources_synced());
        s.mark_source_synced("file");
        assert!(s.all_sources_synced());
    }
}
