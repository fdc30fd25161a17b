//! Every definition the sources gave of every object, and which one is in effect.
//!
//! When two origins define the same object, the first in [`Origin`]'s order is in effect; the
//! others are kept, reported as errors of their files, and take over when it goes. Readers
//! compare objects by `Arc` identity, so a definition that only moves between origins keeps
//! the object in effect as it is.

use kubevol_core::state::PodExtensions;
use std::collections::{BTreeMap, BTreeSet};

use kubevol_core::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    ConfigMap, Node, PersistentVolume, PersistentVolumeClaim, Pod, Secret,
};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kubevol_core::projection::ObjectKind;
use kubevol_core::snapshot::{VolumeSnapshot, VolumeSnapshotContent};
use kubevol_core::PodUid;

use super::{
    normalize_pod, normalize_secret, ns_name, pod_uid, Change, FileContent, ManifestError, NsName,
    Object, ObjectName, Origin, Stored, StoredPod, DEFAULT_NAMESPACE,
};

/// What the store keys an object by: its kind and name (a pod by its UID).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    /// A pod, by UID.
    Pod(PodUid),
    /// A ConfigMap, by namespace and name.
    ConfigMap(NsName),
    /// A Secret, by namespace and name.
    Secret(NsName),
    /// A PersistentVolume, by name.
    PersistentVolume(String),
    /// A PersistentVolumeClaim, by namespace and name.
    PersistentVolumeClaim(NsName),
    /// A CSIDriver, by name.
    CSIDriver(String),
    /// A StorageClass, by name.
    StorageClass(String),
    /// A Node, by name.
    Node(String),
    /// A VolumeSnapshot, by namespace and name.
    VolumeSnapshot(NsName),
    /// A VolumeSnapshotContent, by name.
    VolumeSnapshotContent(String),
}

impl Key {
    pub(super) fn of(obj: &Object) -> Key {
        let name = |m: &ObjectMeta| m.name.clone().unwrap_or_default();
        match obj {
            Object::Pod(p, _) => Key::Pod(pod_uid(p)),
            Object::ConfigMap(c) => Key::ConfigMap(ns_name(&c.metadata)),
            Object::Secret(s) => Key::Secret(ns_name(&s.metadata)),
            Object::PersistentVolume(pv) => Key::PersistentVolume(name(&pv.metadata)),
            Object::PersistentVolumeClaim(c) => Key::PersistentVolumeClaim(ns_name(&c.metadata)),
            Object::CSIDriver(d) => Key::CSIDriver(name(&d.metadata)),
            Object::StorageClass(c) => Key::StorageClass(name(&c.metadata)),
            Object::Node(n) => Key::Node(name(&n.metadata)),
            Object::VolumeSnapshot(v) => Key::VolumeSnapshot(ns_name(&v.metadata)),
            Object::VolumeSnapshotContent(c) => Key::VolumeSnapshotContent(name(&c.metadata)),
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
            Key::StorageClass(n) => write!(f, "StorageClass {n}"),
            Key::Node(n) => write!(f, "Node {n}"),
            Key::VolumeSnapshot((ns, n)) => write!(f, "VolumeSnapshot {ns}/{n}"),
            Key::VolumeSnapshotContent(n) => write!(f, "VolumeSnapshotContent {n}"),
        }
    }
}

/// The namespace and name of a pod's definition.
fn pod_name(def: &Shared) -> Option<NsName> {
    match def {
        Shared::Pod(p, _) => Some((
            p.metadata
                .namespace
                .clone()
                .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string()),
            p.metadata.name.clone().unwrap_or_default(),
        )),
        _ => None,
    }
}

fn key_uid(key: &Key) -> &str {
    match key {
        Key::Pod(uid) => uid.as_str(),
        _ => "",
    }
}

/// One definition of an object, shared with the store's view when it is the one in effect (so
/// that readers comparing by identity see no change when only its origin changes).
#[derive(Clone, Debug)]
pub(super) enum Shared {
    Pod(Arc<Pod>, Arc<PodExtensions>),
    ConfigMap(Arc<ConfigMap>),
    Secret(Arc<Secret>),
    PersistentVolume(Arc<PersistentVolume>),
    PersistentVolumeClaim(Arc<PersistentVolumeClaim>),
    CSIDriver(Arc<CSIDriver>),
    StorageClass(Arc<StorageClass>),
    Node(Arc<Node>),
    VolumeSnapshot(Arc<VolumeSnapshot>),
    VolumeSnapshotContent(Arc<VolumeSnapshotContent>),
}

impl From<Object> for Shared {
    fn from(obj: Object) -> Self {
        match obj {
            Object::Pod(x, e) => Shared::Pod(Arc::new(x), Arc::new(e)),
            Object::ConfigMap(x) => Shared::ConfigMap(Arc::new(x)),
            Object::Secret(x) => Shared::Secret(Arc::new(x)),
            Object::PersistentVolume(x) => Shared::PersistentVolume(Arc::new(x)),
            Object::PersistentVolumeClaim(x) => Shared::PersistentVolumeClaim(Arc::new(x)),
            Object::CSIDriver(x) => Shared::CSIDriver(Arc::new(x)),
            Object::StorageClass(x) => Shared::StorageClass(Arc::new(x)),
            Object::Node(x) => Shared::Node(Arc::new(x)),
            Object::VolumeSnapshot(x) => Shared::VolumeSnapshot(Arc::new(x)),
            Object::VolumeSnapshotContent(x) => Shared::VolumeSnapshotContent(Arc::new(x)),
        }
    }
}

impl Shared {
    /// Whether this definition has the content of `obj` (compared in place, without a copy).
    fn holds(&self, obj: &Object) -> bool {
        match (self, obj) {
            (Shared::Pod(a, ae), Object::Pod(b, be)) => **a == *b && **ae == *be,
            (Shared::ConfigMap(a), Object::ConfigMap(b)) => **a == *b,
            (Shared::Secret(a), Object::Secret(b)) => **a == *b,
            (Shared::PersistentVolume(a), Object::PersistentVolume(b)) => **a == *b,
            (Shared::PersistentVolumeClaim(a), Object::PersistentVolumeClaim(b)) => **a == *b,
            (Shared::CSIDriver(a), Object::CSIDriver(b)) => **a == *b,
            (Shared::StorageClass(a), Object::StorageClass(b)) => **a == *b,
            (Shared::Node(a), Object::Node(b)) => **a == *b,
            (Shared::VolumeSnapshot(a), Object::VolumeSnapshot(b)) => **a == *b,
            (Shared::VolumeSnapshotContent(a), Object::VolumeSnapshotContent(b)) => **a == *b,
            _ => false,
        }
    }

    /// The object's validation errors, joined (pods are checked by the populator, which keeps
    /// an earlier valid version of an edited one).
    pub(super) fn invalid(&self) -> Option<String> {
        use kubevol_core::validation as v;
        let errs = match self {
            Shared::ConfigMap(c) => v::validate_config_map(c),
            Shared::Secret(s) => v::validate_secret(s),
            Shared::PersistentVolume(pv) => v::validate_persistent_volume(pv),
            Shared::PersistentVolumeClaim(c) => v::validate_claim(c),
            Shared::StorageClass(c) => v::validate_storage_class(c),
            Shared::CSIDriver(d) => {
                let mut errs = Vec::new();
                let name = d.metadata.name.as_deref().unwrap_or_default();
                v::csi_driver_name("metadata.name", name, &mut errs);
                errs
            }
            Shared::VolumeSnapshot(s) => v::validate_volume_snapshot(s),
            Shared::VolumeSnapshotContent(c) => v::validate_volume_snapshot_content(c),
            Shared::Pod(..) | Shared::Node(_) => return None,
        };
        (!errs.is_empty()).then(|| {
            errs.iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        })
    }
}

/// What the store knows of one manifest file.
#[derive(Default)]
pub(super) struct FileEntry {
    /// The definitions it delivered (document, key).
    defs: Vec<(usize, Key)>,
    /// Why its last read was not applied.
    pub(super) errors: Vec<ManifestError>,
    /// Its objects of kinds kubevol does not run.
    pub(super) skipped: Vec<ObjectName>,
    /// Fields its objects set that the types do not have.
    pub(super) warnings: Vec<ManifestError>,
}

#[derive(Default)]
pub(super) struct Objects {
    // The objects in effect: for each key, the definition of the first origin (see `Origin`).
    pub(super) pods: BTreeMap<PodUid, StoredPod>,
    pub(super) config_maps: BTreeMap<NsName, Stored<ConfigMap>>,
    pub(super) secrets: BTreeMap<NsName, Stored<Secret>>,
    pub(super) persistent_volumes: BTreeMap<String, Stored<PersistentVolume>>,
    pub(super) persistent_volume_claims: BTreeMap<NsName, Stored<PersistentVolumeClaim>>,
    pub(super) csi_drivers: BTreeMap<String, Stored<CSIDriver>>,
    pub(super) storage_classes: BTreeMap<String, Stored<StorageClass>>,
    pub(super) nodes: BTreeMap<String, Stored<Node>>,
    pub(super) volume_snapshots: BTreeMap<NsName, Stored<VolumeSnapshot>>,
    pub(super) volume_snapshot_contents: BTreeMap<String, Stored<VolumeSnapshotContent>>,
    /// Every definition of every object, by origin: when the one in effect goes, the next one
    /// takes its place without any file being read again.
    defs: HashMap<Key, BTreeMap<Origin, Shared>>,
    /// Which pod (namespace and name) holds each pod UID: the first put in effect with it, or
    /// the one whose volumes the record found mounted at start. A definition of another pod
    /// with that UID is refused while any definition of the UID is left: a pod's UID names its
    /// directory, and with it its volumes' data.
    pub(super) uid_holders: BTreeMap<PodUid, NsName>,
    pub(super) files: BTreeMap<PathBuf, FileEntry>,
    /// Objects the API server is asked for and has not listed yet.
    pub(super) pending: BTreeSet<Key>,
    /// Objects read by name that the API server said do not exist (`Change::ClusterAbsent`).
    pub(super) absent: BTreeSet<Key>,
    /// What changed since the populator last looked (see `ObjectStore::take_changes`).
    pub(super) journal: Journal,
}

/// The keys whose objects (or pending state) changed since the last reading, or that anything
/// may have: a manifest file's errors decide whether a missing object is "not loaded", so a
/// change of them is a change of every reader.
#[derive(Default)]
pub(super) struct Journal {
    pub(super) keys: BTreeSet<Key>,
    pub(super) everything: bool,
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
    pub(super) fn promote(&mut self, key: &Key) -> bool {
        let holder = match key {
            Key::Pod(uid) => self.holder_of(uid),
            _ => None,
        };
        let first = self
            .defs
            .get(key)
            .and_then(|m| {
                m.iter().find(|(_, d)| {
                    holder
                        .as_ref()
                        .is_none_or(|h| pod_name(d).as_ref() == Some(h))
                })
            })
            .map(|(o, d)| (o.clone(), d.clone()));
        if let (Key::Pod(uid), Some((_, def))) = (key, &first) {
            if holder.is_none() {
                if let Some(name) = pod_name(def) {
                    self.uid_holders.insert(uid.clone(), name);
                }
            }
        }
        let Some((origin, def)) = first else {
            // (A UID held before any definition of it came, from the record, stays held.)
            if self.defs.get(key).is_some_and(|m| m.is_empty()) {
                self.defs.remove(key);
                if let Key::Pod(uid) = key {
                    self.uid_holders.remove(uid);
                }
            }
            return match key {
                Key::Pod(k) => self.pods.remove(k).is_some(),
                Key::ConfigMap(k) => self.config_maps.remove(k).is_some(),
                Key::Secret(k) => self.secrets.remove(k).is_some(),
                Key::PersistentVolume(k) => self.persistent_volumes.remove(k).is_some(),
                Key::PersistentVolumeClaim(k) => self.persistent_volume_claims.remove(k).is_some(),
                Key::CSIDriver(k) => self.csi_drivers.remove(k).is_some(),
                Key::StorageClass(k) => self.storage_classes.remove(k).is_some(),
                Key::Node(k) => self.nodes.remove(k).is_some(),
                Key::VolumeSnapshot(k) => self.volume_snapshots.remove(k).is_some(),
                Key::VolumeSnapshotContent(k) => self.volume_snapshot_contents.remove(k).is_some(),
            };
        };
        let invalid = def.invalid();
        match (key, &def) {
            (Key::Pod(k), Shared::Pod(p, e)) => match self.pods.get_mut(k) {
                Some(s)
                    if (Arc::ptr_eq(&s.pod, p) || *s.pod == **p)
                        && (Arc::ptr_eq(&s.extensions, e) || *s.extensions == **e) =>
                {
                    s.move_to(origin)
                }
                _ => {
                    self.pods
                        .insert(k.clone(), StoredPod::new(p.clone(), e.clone(), origin));
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
                put(&mut self.persistent_volumes, k.clone(), d, &origin, invalid)
            }
            (Key::PersistentVolumeClaim(k), Shared::PersistentVolumeClaim(d)) => put(
                &mut self.persistent_volume_claims,
                k.clone(),
                d,
                &origin,
                invalid,
            ),
            (Key::CSIDriver(k), Shared::CSIDriver(d)) => {
                put(&mut self.csi_drivers, k.clone(), d, &origin, invalid)
            }
            (Key::StorageClass(k), Shared::StorageClass(d)) => {
                put(&mut self.storage_classes, k.clone(), d, &origin, invalid)
            }
            (Key::Node(k), Shared::Node(d)) => put(&mut self.nodes, k.clone(), d, &origin, None),
            (Key::VolumeSnapshot(k), Shared::VolumeSnapshot(d)) => {
                put(&mut self.volume_snapshots, k.clone(), d, &origin, invalid)
            }
            (Key::VolumeSnapshotContent(k), Shared::VolumeSnapshotContent(d)) => put(
                &mut self.volume_snapshot_contents,
                k.clone(),
                d,
                &origin,
                invalid,
            ),
            _ => unreachable!("a key and its definitions are of one kind"),
        }
    }

    /// The pod that holds `uid`, if one does and a definition of it is left.
    fn holder_of(&self, uid: &PodUid) -> Option<NsName> {
        let holder = self.uid_holders.get(uid)?;
        let key = Key::Pod(uid.clone());
        let defs = self.defs.get(&key)?;
        defs.values()
            .any(|d| pod_name(d).as_ref() == Some(holder))
            .then(|| holder.clone())
            // Its own definitions are all gone while another pod's are left: the UID stays
            // with it until every definition of the UID is gone.
            .or_else(|| (!defs.is_empty()).then(|| holder.clone()))
    }

    /// The definitions of pod UID `uid` that are another pod's than the one holding it: their
    /// origin and namespace and name.
    pub(super) fn uid_conflicts(&self, uid: &PodUid) -> Vec<(Origin, NsName)> {
        let Some(holder) = self.uid_holders.get(uid) else {
            return Vec::new();
        };
        self.defs
            .get(&Key::Pod(uid.clone()))
            .into_iter()
            .flatten()
            .filter_map(|(o, d)| {
                let name = pod_name(d)?;
                (name != *holder).then(|| (o.clone(), name))
            })
            .collect()
    }

    /// Gives `uid` to the pod `holder`, whose volumes the record found mounted, whoever was
    /// given it since this store began; returns whether the pod in effect changed.
    pub(super) fn hold_uid(&mut self, uid: PodUid, holder: NsName) -> bool {
        if self.uid_holders.get(&uid) == Some(&holder) {
            return false;
        }
        self.uid_holders.insert(uid.clone(), holder);
        self.promote(&Key::Pod(uid))
    }

    /// Adds one definition; returns its key.
    /// Defines `obj` from `origin` unless that origin's definition is the same. Returns whether
    /// anything changed.
    fn upsert(&mut self, origin: Origin, obj: Object, touched: &mut BTreeSet<Key>) -> bool {
        let obj = match obj {
            Object::Pod(p, e) => Object::Pod(normalize_pod(p), e),
            Object::Secret(s) => Object::Secret(normalize_secret(s)),
            other => other,
        };
        let key = Key::of(&obj);
        let unchanged = self
            .defs
            .get(&key)
            .and_then(|m| m.get(&origin))
            .is_some_and(|have| have.holds(&obj));
        if unchanged {
            return false;
        }
        self.define(origin, obj);
        touched.insert(key);
        true
    }

    fn define(&mut self, origin: Origin, obj: Object) -> Key {
        let key = Key::of(&obj);
        let def = Shared::from(obj);
        let defs = self.defs.entry(key.clone()).or_default();
        // A pod's own origin may rename it (an edit of its file): the UID goes with it, as long
        // as no other definition of the old name is left.
        if let (Key::Pod(uid), Some(old), Some(new)) = (&key, defs.get(&origin), pod_name(&def)) {
            let old = pod_name(old);
            let renamed = old.as_ref().is_some_and(|o| *o != new);
            let held = old.is_some() && self.uid_holders.get(uid) == old.as_ref();
            let others = defs.iter().any(|(o, d)| *o != origin && pod_name(d) == old);
            if renamed && held && !others {
                self.uid_holders.insert(uid.clone(), new);
            }
        }
        defs.insert(origin, def);
        key
    }

    /// Drops one definition.
    fn undefine(&mut self, key: &Key, origin: &Origin) {
        if let Some(m) = self.defs.get_mut(key) {
            m.remove(origin);
        }
    }

    /// Drops everything a file delivered; returns whether it had delivered anything.
    fn forget_file(&mut self, path: &Path, touched: &mut BTreeSet<Key>) -> bool {
        let Some(old) = self.files.remove(path) else {
            return false;
        };
        for (document, key) in old.defs {
            let origin = Origin::File {
                path: path.to_path_buf(),
                document,
            };
            self.undefine(&key, &origin);
            touched.insert(key);
        }
        true
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
                        .is_some_and(|have| have.holds(obj))
            })
    }

    /// Applies one change; `touched` collects the keys whose definitions changed.
    pub(super) fn change(&mut self, change: Change, touched: &mut BTreeSet<Key>) -> bool {
        match change {
            Change::File { path, content } => match content {
                FileContent::Objects(objects) => {
                    if self.file_unchanged(&path, &objects) {
                        return false;
                    }
                    if self.files.get(&path).is_some_and(|f| !f.errors.is_empty()) {
                        // Its errors go with its old content.
                        self.journal.everything = true;
                    }
                    self.forget_file(&path, touched);
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
                    self.journal.everything = true;
                    true
                }
                FileContent::Gone => self.forget_file(&path, touched),
            },
            Change::Warnings { path, warnings } => {
                if warnings.is_empty() && !self.files.contains_key(&path) {
                    return false;
                }
                let entry = self.files.entry(path).or_default();
                if entry.warnings == warnings {
                    return false;
                }
                entry.warnings = warnings;
                true
            }
            Change::Skipped { path, objects } => {
                if objects.is_empty() && !self.files.contains_key(&path) {
                    return false;
                }
                let entry = self.files.entry(path).or_default();
                if entry.skipped == objects {
                    return false;
                }
                entry.skipped = objects;
                true
            }
            Change::Upsert(obj) => self.upsert(Origin::Api, *obj, touched),
            Change::Provisioned(obj) => self.upsert(Origin::Provisioned, *obj, touched),
            Change::Unprovisioned(key) => {
                self.undefine(&key, &Origin::Provisioned);
                touched.insert(key);
                true
            }
            Change::ClusterUpsert(obj) => {
                self.absent.remove(&Key::of(&obj));
                self.upsert(Origin::Cluster, *obj, touched)
            }
            Change::ClusterAbsent(key) => {
                if self
                    .defs
                    .get(&key)
                    .is_some_and(|m| m.contains_key(&Origin::Cluster))
                {
                    self.undefine(&key, &Origin::Cluster);
                }
                self.absent.insert(key.clone());
                touched.insert(key);
                true
            }
            Change::ClusterRemove(key) => {
                self.absent.remove(&key);
                let had = self
                    .defs
                    .get(&key)
                    .is_some_and(|m| m.contains_key(&Origin::Cluster));
                if had {
                    self.undefine(&key, &Origin::Cluster);
                    touched.insert(key);
                }
                had
            }
            Change::ClusterPods(objects) => {
                let listed: BTreeSet<Key> = objects.iter().map(Key::of).collect();
                let gone: Vec<Key> = self
                    .defs
                    .iter()
                    .filter(|(k, m)| {
                        matches!(k, Key::Pod(_))
                            && m.contains_key(&Origin::Cluster)
                            && !listed.contains(*k)
                    })
                    .map(|(k, _)| k.clone())
                    .collect();
                let mut changed = !gone.is_empty();
                for key in gone {
                    self.undefine(&key, &Origin::Cluster);
                    touched.insert(key);
                }
                for obj in objects {
                    changed |= self.upsert(Origin::Cluster, obj, touched);
                }
                changed
            }
            Change::ClusterPending { key, pending } => {
                let changed = if pending {
                    self.pending.insert(key.clone())
                } else {
                    self.pending.remove(&key)
                };
                if changed {
                    self.journal.keys.insert(key);
                }
                changed
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
    pub(super) fn errors_of(&self, path: &Path, entry: &FileEntry) -> Vec<ManifestError> {
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
            let holder = match key {
                Key::Pod(uid) => self.uid_holders.get(uid),
                _ => None,
            };
            let mine = defs.get(&here).and_then(pod_name);
            if let (Some(holder), Some(mine)) = (holder, &mine) {
                if holder != mine {
                    let held_by = defs
                        .iter()
                        .find(|(_, d)| pod_name(d).as_ref() == Some(holder))
                        .map(|(o, _)| format!(" ({o})"))
                        .unwrap_or_default();
                    out.push(report(format!(
                        "pod {}/{} is refused: its metadata.uid {} is already the UID of pod {}/{}{held_by}, which keeps it (a pod's UID names its directory and its volumes on this node); give this pod a UID of its own, or no metadata.uid (kubevol then derives one from its namespace and name)",
                        mine.0, mine.1, key_uid(key), holder.0, holder.1
                    )));
                    continue;
                }
            }
            let in_effect = defs
                .iter()
                .find(|(_, d)| holder.is_none_or(|h| pod_name(d).as_ref() == Some(h)));
            match in_effect {
                Some((winner, _)) if *winner != here => {
                    let what = match (key, defs.get(&here)) {
                        (Key::Pod(uid), Some(Shared::Pod(p, _))) => format!(
                            "pod {}/{} (uid {uid})",
                            p.metadata.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE),
                            p.metadata.name.as_deref().unwrap_or_default()
                        ),
                        _ => key.to_string(),
                    };
                    let rule = match winner {
                        Origin::Api => "the library API's definition wins",
                        Origin::Cluster => "the API server's definition wins over files",
                        Origin::Provisioned => "the provisioned volume wins over files",
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
