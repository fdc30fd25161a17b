//! The object store: pods and the objects they reference, as delivered by pod sources.
//!
//! Sources (the manifest directory, the library API, later the API server) write here; the
//! populator reads. Each object remembers where it came from, so an error can name the manifest
//! file, and so a file's objects can be replaced or removed as a whole. Every change bumps a
//! generation on a watch channel: readers are woken, never poll.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::storage::v1::CSIDriver;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kubevol_core::projection::ObjectKind;
use kubevol_core::validation::FieldError;
use kubevol_core::PodUid;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// Where an object came from.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Origin {
    /// A manifest file, and the 1-based index of the document in it.
    File {
        /// The file.
        path: PathBuf,
        /// The document.
        document: usize,
    },
    /// The library API (an embedding node agent).
    Api,
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

impl<T> Stored<T> {
    /// An object as stored; `errors` are its validation errors, already formatted.
    fn new(object: T, origin: Origin, errors: Option<&str>) -> Self {
        let invalid = errors.map(|list| Arc::from(format!("{origin}: {list}")));
        Stored {
            object: Arc::new(object),
            origin,
            invalid,
        }
    }
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

#[derive(Default)]
struct Objects {
    pods: BTreeMap<PodUid, StoredPod>,
    config_maps: BTreeMap<NsName, Stored<ConfigMap>>,
    secrets: BTreeMap<NsName, Stored<Secret>>,
    persistent_volumes: BTreeMap<String, Stored<PersistentVolume>>,
    persistent_volume_claims: BTreeMap<NsName, Stored<PersistentVolumeClaim>>,
    csi_drivers: BTreeMap<String, Stored<CSIDriver>>,
    file_errors: BTreeMap<PathBuf, Vec<ManifestError>>,
}

impl Objects {
    /// The origin of every object held.
    fn origins(&self) -> impl Iterator<Item = &Origin> {
        self.pods
            .values()
            .map(|p| &p.origin)
            .chain(self.config_maps.values().map(|s| &s.origin))
            .chain(self.secrets.values().map(|s| &s.origin))
            .chain(self.persistent_volumes.values().map(|s| &s.origin))
            .chain(self.persistent_volume_claims.values().map(|s| &s.origin))
            .chain(self.csi_drivers.values().map(|s| &s.origin))
    }

    /// Adds or replaces one object. Returns an error to report for its origin: an invalid
    /// ConfigMap or Secret (kept, so that pods using it fail with the reason), or a pod whose
    /// UID another origin already defines (not taken).
    fn insert(&mut self, origin: Origin, obj: Object) -> Result<(), String> {
        use kubevol_core::validation::{validate_config_map, validate_secret};
        // The joined field errors (kept with the object) and the report for its origin.
        let check = |kind: &str, meta: &ObjectMeta, errs: Vec<FieldError>| {
            if errs.is_empty() {
                return (None, Ok(()));
            }
            let list = errs
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; ");
            let (ns, name) = ns_name(meta);
            let report = format!(
                "{kind} {ns}/{name} is invalid and pods that use it will fail; fix these fields: {list}"
            );
            (Some(list), Err(report))
        };
        match obj {
            Object::Pod(pod) => {
                let uid = pod_uid(&pod);
                if let Some(other) = self.pods.get(&uid).filter(|o| o.origin != origin) {
                    return Err(format!(
                        "pod {}/{} (uid {uid}) is already defined by {}; this definition is ignored: rename one of them",
                        pod.metadata.namespace.as_deref().unwrap_or_default(),
                        pod.metadata.name.as_deref().unwrap_or_default(),
                        other.origin
                    ));
                }
                self.pods.insert(
                    uid,
                    StoredPod {
                        pod: Arc::new(pod),
                        origin,
                    },
                );
                Ok(())
            }
            Object::ConfigMap(c) => {
                let (list, report) = check("ConfigMap", &c.metadata, validate_config_map(&c));
                let key = ns_name(&c.metadata);
                self.config_maps
                    .insert(key, Stored::new(c, origin, list.as_deref()));
                report
            }
            Object::Secret(x) => {
                let (list, report) = check("Secret", &x.metadata, validate_secret(&x));
                let key = ns_name(&x.metadata);
                self.secrets
                    .insert(key, Stored::new(x, origin, list.as_deref()));
                report
            }
            Object::PersistentVolume(pv) => {
                let k = pv.metadata.name.clone().unwrap_or_default();
                self.persistent_volumes
                    .insert(k, Stored::new(pv, origin, None));
                Ok(())
            }
            Object::PersistentVolumeClaim(c) => {
                let k = ns_name(&c.metadata);
                self.persistent_volume_claims
                    .insert(k, Stored::new(c, origin, None));
                Ok(())
            }
            Object::CSIDriver(d) => {
                let k = d.metadata.name.clone().unwrap_or_default();
                self.csi_drivers.insert(k, Stored::new(d, origin, None));
                Ok(())
            }
        }
    }

    /// Drops every object a file delivered.
    fn forget_file(&mut self, path: &std::path::Path) {
        self.pods.retain(|_, p| !from_file(&p.origin, path));
        self.config_maps.retain(|_, s| !from_file(&s.origin, path));
        self.secrets.retain(|_, s| !from_file(&s.origin, path));
        self.persistent_volumes
            .retain(|_, s| !from_file(&s.origin, path));
        self.persistent_volume_claims
            .retain(|_, s| !from_file(&s.origin, path));
        self.csi_drivers.retain(|_, s| !from_file(&s.origin, path));
    }

    /// Whether the store holds exactly `obj`, delivered by document `document` of `path`.
    fn holds(&self, path: &std::path::Path, document: usize, obj: &Object) -> bool {
        let here = |o: &Origin| matches!(o, Origin::File { path: p, document: d } if p == path && *d == document);
        fn same<T: PartialEq>(
            s: Option<&Stored<T>>,
            obj: &T,
            here: impl Fn(&Origin) -> bool,
        ) -> bool {
            s.is_some_and(|s| here(&s.origin) && *s.object == *obj)
        }
        match obj {
            Object::Pod(p) => self
                .pods
                .get(&pod_uid(p))
                .is_some_and(|s| here(&s.origin) && *s.pod == *p),
            Object::ConfigMap(c) => same(self.config_maps.get(&ns_name(&c.metadata)), c, here),
            Object::Secret(x) => same(self.secrets.get(&ns_name(&x.metadata)), x, here),
            Object::PersistentVolume(pv) => same(
                self.persistent_volumes
                    .get(pv.metadata.name.as_deref().unwrap_or_default()),
                pv,
                here,
            ),
            Object::PersistentVolumeClaim(c) => same(
                self.persistent_volume_claims.get(&ns_name(&c.metadata)),
                c,
                here,
            ),
            Object::CSIDriver(d) => same(
                self.csi_drivers
                    .get(d.metadata.name.as_deref().unwrap_or_default()),
                d,
                here,
            ),
        }
    }

    /// Whether a file's new content is what the store already has from it (compared in place,
    /// without copying what it holds).
    fn file_unchanged(
        &self,
        path: &std::path::Path,
        objects: &[(usize, Object)],
        errors: &[ManifestError],
    ) -> bool {
        let have_errors = self
            .file_errors
            .get(path)
            .map(Vec::as_slice)
            .unwrap_or_default();
        have_errors == errors
            && self.origins().filter(|o| from_file(o, path)).count() == objects.len()
            && objects.iter().all(|(d, obj)| self.holds(path, *d, obj))
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

fn from_file(origin: &Origin, path: &std::path::Path) -> bool {
    matches!(origin, Origin::File { path: p, .. } if p == path)
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

    /// Replaces every object that came from `path` with `objects`, and clears the file's errors
    /// (setting `errors` instead). A pod whose UID another file already defines is not taken;
    /// that is reported as an error of this file.
    pub fn replace_file(
        &self,
        path: &std::path::Path,
        objects: Vec<(usize, Object)>,
        mut errors: Vec<ManifestError>,
    ) {
        let mut o = self.write();
        if o.file_unchanged(path, &objects, &errors) {
            // A reload of identical content keeps the same objects: nothing to reprocess.
            return;
        }
        o.forget_file(path);
        for (document, obj) in objects {
            let origin = Origin::File {
                path: path.to_path_buf(),
                document,
            };
            if let Err(message) = o.insert(origin, obj) {
                errors.push(ManifestError {
                    path: path.to_path_buf(),
                    document: Some(document),
                    line: None,
                    column: None,
                    message,
                    object: None,
                });
            }
        }
        if errors.is_empty() {
            o.file_errors.remove(path);
        } else {
            o.file_errors.insert(path.to_path_buf(), errors);
        }
        drop(o);
        self.bump();
    }

    /// Records errors for a file while keeping the objects it delivered before, so that a
    /// broken edit never takes a running pod's volumes away.
    pub fn set_file_errors(&self, path: &std::path::Path, errors: Vec<ManifestError>) {
        {
            let mut o = self.write();
            if o.file_errors.get(path) == Some(&errors) {
                return;
            }
            o.file_errors.insert(path.to_path_buf(), errors);
        }
        self.bump();
    }

    /// Forgets everything a file delivered (the file was removed).
    pub fn remove_file(&self, path: &std::path::Path) {
        self.replace_file(path, Vec::new(), Vec::new());
    }

    /// The files that have delivered objects or errors.
    pub fn known_files(&self) -> Vec<PathBuf> {
        let o = self.read();
        let mut files: Vec<PathBuf> = o
            .origins()
            .filter_map(|o| match o {
                Origin::File { path, .. } => Some(path.clone()),
                Origin::Api => None,
            })
            .chain(o.file_errors.keys().cloned())
            .collect();
        files.sort();
        files.dedup();
        files
    }

    /// Adds or replaces a pod given through the library API. Returns its UID.
    pub fn upsert_pod(&self, pod: Pod) -> PodUid {
        self.upsert_pods([pod]).remove(0)
    }

    /// Adds or replaces many pods given through the library API in one change (one wake-up of
    /// the populator). Returns their UIDs.
    pub fn upsert_pods(&self, pods: impl IntoIterator<Item = Pod>) -> Vec<PodUid> {
        let mut uids = Vec::new();
        {
            let mut o = self.write();
            for pod in pods {
                let pod = normalize_pod(pod);
                let uid = pod_uid(&pod);
                o.pods.insert(
                    uid.clone(),
                    StoredPod {
                        pod: Arc::new(pod),
                        origin: Origin::Api,
                    },
                );
                uids.push(uid);
            }
        }
        self.bump();
        uids
    }

    /// Adds or replaces objects given through the library API (ConfigMaps, Secrets, ...) in one
    /// change. Returns the problems found (an invalid object is kept and fails the pods that
    /// use it).
    pub fn upsert_objects(&self, objects: impl IntoIterator<Item = Object>) -> Vec<String> {
        let mut problems = Vec::new();
        {
            let mut o = self.write();
            for obj in objects {
                let obj = match obj {
                    Object::Pod(p) => Object::Pod(normalize_pod(p)),
                    Object::Secret(s) => Object::Secret(normalize_secret(s)),
                    other => other,
                };
                if let Err(e) = o.insert(Origin::Api, obj) {
                    problems.push(e);
                }
            }
        }
        self.bump();
        problems
    }

    /// Removes a ConfigMap or Secret given through the library API.
    pub fn remove_object(&self, kind: ObjectKind, namespace: &str, name: &str) {
        {
            let mut o = self.write();
            let key = (namespace.to_string(), name.to_string());
            match kind {
                ObjectKind::ConfigMap => o.config_maps.remove(&key).is_some(),
                ObjectKind::Secret => o.secrets.remove(&key).is_some(),
            };
        }
        self.bump();
    }

    /// Removes a pod given through the library API.
    pub fn remove_pod(&self, uid: &PodUid) {
        self.remove_pods(std::slice::from_ref(uid));
    }

    /// Removes many pods in one change.
    pub fn remove_pods(&self, uids: &[PodUid]) {
        {
            let mut o = self.write();
            for uid in uids {
                o.pods.remove(uid);
            }
        }
        self.bump();
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

    /// Every file error.
    /// Why an object the store does not hold is not there, when a manifest file with an error
    /// defines it (such a file is not applied): a sentence for the message of whatever needs
    /// the object. `namespace` is ignored for cluster-scoped kinds.
    pub fn not_loaded(&self, kind: &str, namespace: &str, name: &str) -> Option<String> {
        let o = self.read();
        let err = o.file_errors.values().flatten().find(|e| {
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
        self.read()
            .file_errors
            .values()
            .flatten()
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        store.replace_file(file, vec![(2, Object::ConfigMap(cm))], Vec::new());
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
        s.replace_file(
            &a,
            vec![
                (1, Object::Pod(normalize_pod(pod(None, "x")))),
                (2, Object::Pod(normalize_pod(pod(None, "y")))),
            ],
            vec![],
        );
        assert_eq!(s.pods().len(), 2);
        s.replace_file(
            &b,
            vec![(1, Object::Pod(normalize_pod(pod(None, "x"))))],
            vec![],
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
        s.replace_file(
            &a,
            vec![(1, Object::Pod(normalize_pod(pod(None, "y"))))],
            vec![],
        );
        assert_eq!(
            s.pods().len(),
            1,
            "x went away with the new version of a.yaml"
        );
        s.remove_file(&a);
        assert!(s.pods().is_empty());
    }

    #[test]
    fn reloading_identical_content_changes_nothing() {
        let s = ObjectStore::new();
        let a = PathBuf::from("/m/a.yaml");
        let objs = || vec![(1, Object::Pod(normalize_pod(pod(None, "x"))))];
        s.replace_file(&a, objs(), vec![]);
        let before = s.pods()[0].1.pod.clone();
        let mut rx = s.subscribe();
        rx.borrow_and_update();
        s.replace_file(&a, objs(), vec![]);
        assert!(!rx.has_changed().unwrap(), "no change announced");
        assert!(
            Arc::ptr_eq(&before, &s.pods()[0].1.pod),
            "the same object is kept"
        );
        s.replace_file(
            &a,
            vec![(1, Object::Pod(normalize_pod(pod(None, "y"))))],
            vec![],
        );
        assert!(rx.has_changed().unwrap());
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
