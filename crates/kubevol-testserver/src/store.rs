//! The objects, their resource versions and the history watches resume from.
//!
//! One counter gives every change its resource version, as etcd's revision does. Changes are
//! kept in a bounded history; a watch asked to resume from a version older than the history
//! gets `410 Gone` ("too old resource version"), as from a compacted etcd.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};
use tokio::sync::broadcast;

/// One kind of object the server keeps.
#[derive(Debug, PartialEq, Eq)]
pub struct Resource {
    /// The URL's plural (`pods`).
    pub plural: &'static str,
    /// `v1` or `storage.k8s.io/v1`.
    pub group_version: &'static str,
    /// The kind (`Pod`).
    pub kind: &'static str,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
}

/// The resources served.
pub const RESOURCES: &[Resource] = &[
    res("pods", "v1", "Pod", true),
    res("configmaps", "v1", "ConfigMap", true),
    res("secrets", "v1", "Secret", true),
    res(
        "persistentvolumeclaims",
        "v1",
        "PersistentVolumeClaim",
        true,
    ),
    res("persistentvolumes", "v1", "PersistentVolume", false),
    res("serviceaccounts", "v1", "ServiceAccount", true),
    res("events", "v1", "Event", true),
    res("nodes", "v1", "Node", false),
    res("csidrivers", "storage.k8s.io/v1", "CSIDriver", false),
    res("csinodes", "storage.k8s.io/v1", "CSINode", false),
    res(
        "volumeattachments",
        "storage.k8s.io/v1",
        "VolumeAttachment",
        false,
    ),
    // As a default 1.37 server serves them: at v1 only (v1beta1 answers 404).
    res(
        "clustertrustbundles",
        "certificates.k8s.io/v1",
        "ClusterTrustBundle",
        false,
    ),
];

const fn res(
    plural: &'static str,
    group_version: &'static str,
    kind: &'static str,
    namespaced: bool,
) -> Resource {
    Resource {
        plural,
        group_version,
        kind,
        namespaced,
    }
}

/// The resource served under `group_version` and `plural`.
pub fn resource(group_version: &str, plural: &str) -> Option<&'static Resource> {
    RESOURCES
        .iter()
        .find(|r| r.group_version == group_version && r.plural == plural)
}

/// An object's place.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    /// Its resource's plural.
    pub plural: &'static str,
    /// Its namespace (empty when cluster-scoped).
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// A change, as watches see it.
#[derive(Clone, Debug)]
pub struct Change {
    /// The resource version the change made.
    pub rv: u64,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub kind: &'static str,
    /// The object's place.
    pub key: Key,
    /// The object after the change (before it, for `DELETED`), shared by every watch.
    pub object: std::sync::Arc<Value>,
}

/// An error as the API server answers it: a `Status` with a code and a reason.
#[derive(Clone, Debug)]
pub struct ApiError {
    /// The HTTP status code.
    pub code: u16,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Forbidden`, `Expired`, ...
    pub reason: &'static str,
    /// The message.
    pub message: String,
    /// `details.kind` and `details.name`, where the server names what was not found.
    pub details: Option<(&'static str, String)>,
}

impl ApiError {
    pub(crate) fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    /// The `Status` object.
    pub fn status(&self) -> Value {
        let mut status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": self.message, "reason": self.reason, "code": self.code});
        if let Some((kind, name)) = &self.details {
            status["details"] = json!({"name": name, "kind": kind});
        }
        status
    }
}

/// How many changes watches can resume across.
const HISTORY: usize = 10_000;

/// The objects.
pub struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Change>,
    /// Watches may resume from this version or a later one.
    oldest: u64,
    /// Each resource's changes, for its watches (a watch of Secrets is not woken by pods).
    feeds: HashMap<&'static str, broadcast::Sender<Change>>,
    /// When each pod's node relationship becomes known to the authorizer.
    pod_seen_at: BTreeMap<Key, Instant>,
    /// How long the authorizer takes to learn a pod's references.
    pub(crate) relation_delay: Duration,
    /// The longest lifetime a token is granted (a real server's
    /// `--service-account-max-token-expiration`).
    pub(crate) max_token_lifetime: Option<Duration>,
    /// How many tokens were issued.
    pub(crate) tokens_issued: u64,
    /// Resources not served (as a server without a beta API).
    pub(crate) disabled: std::collections::BTreeSet<&'static str>,
    /// Whether watches may ask for the initial events (the WatchList feature; on, as on the
    /// project's control plane).
    pub(crate) watch_list: bool,
    /// Whether a streaming list's first events leave out every object, as a watch cache that
    /// has not caught up with objects made just before (a fault).
    pub(crate) stale_streams: bool,
    /// The requests nodes made, by verb and resource (`watch configmaps`,
    /// `create serviceaccounts/token`).
    pub(crate) node_requests: BTreeMap<String, u64>,
    /// The pods bound to each node (as the Node authorizer's graph has them).
    pods_by_node: BTreeMap<String, BTreeSet<Key>>,
    /// The pods that reference each object by name: (plural, namespace, name) → pods.
    referencing: HashMap<(&'static str, String, String), BTreeSet<Key>>,
    /// What each pod references, to undo its entries when it changes.
    references: HashMap<Key, Vec<(&'static str, String)>>,
}

impl Default for Store {
    fn default() -> Self {
        Store {
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            oldest: 1,
            feeds: HashMap::new(),
            pod_seen_at: BTreeMap::new(),
            relation_delay: Duration::ZERO,
            max_token_lifetime: None,
            tokens_issued: 0,
            disabled: Default::default(),
            watch_list: true,
            stale_streams: false,
            node_requests: BTreeMap::new(),
            pods_by_node: BTreeMap::new(),
            referencing: HashMap::new(),
            references: HashMap::new(),
        }
    }
}

/// Now in RFC 3339, as `metav1.Time` writes it.
pub fn now_rfc3339() -> String {
    rfc3339(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()) as i64,
    )
}

/// A Unix time in RFC 3339.
pub fn rfc3339(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(t) = target else { return };
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

fn meta(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    obj["metadata"]
        .as_object_mut()
        .expect("metadata is an object")
}

impl Store {
    /// The current resource version.
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// Subscribes to every change of a resource from now on.
    pub fn subscribe(&mut self, plural: &'static str) -> broadcast::Receiver<Change> {
        self.feeds
            .entry(plural)
            .or_insert_with(|| broadcast::channel(HISTORY).0)
            .subscribe()
    }

    /// How many watches of a resource are open.
    pub fn watchers(&self, plural: &str) -> usize {
        self.feeds.get(plural).map_or(0, |f| f.receiver_count())
    }

    /// The changes after `rv`, or `410 Gone` when they are no longer kept.
    pub fn since(&self, rv: u64) -> Result<Vec<Change>, ApiError> {
        if rv < self.oldest {
            return Err(ApiError::new(
                410,
                "Expired",
                format!("too old resource version: {rv} ({})", self.oldest),
            ));
        }
        Ok(self.history.iter().filter(|c| c.rv > rv).cloned().collect())
    }

    /// Forgets the history: watches must list again (as after an etcd compaction).
    pub fn compact(&mut self) {
        self.history.clear();
        self.oldest = self.rv;
    }

    /// One object.
    pub fn get(&self, key: &Key) -> Option<&Value> {
        self.objects.get(key)
    }

    /// The objects of a resource, in a namespace or all.
    pub fn list(&self, plural: &'static str, namespace: Option<&str>) -> Vec<&Value> {
        // Keys sort by resource, then namespace: the objects asked for are one range.
        let from = Key {
            plural,
            namespace: namespace.unwrap_or_default().to_string(),
            name: String::new(),
        };
        self.objects
            .range(from..)
            .take_while(|(k, _)| k.plural == plural && namespace.is_none_or(|n| k.namespace == n))
            .map(|(_, v)| v)
            .collect()
    }

    /// The authorizer learns every pod's references now, whatever its lag.
    pub(crate) fn learn_relations(&mut self) {
        let now = Instant::now();
        for t in self.pod_seen_at.values_mut() {
            *t = (*t).min(now);
        }
    }

    /// The pods that reference an object by name (in its namespace).
    pub(crate) fn pods_referencing(
        &self,
        plural: &'static str,
        namespace: &str,
        name: &str,
    ) -> impl Iterator<Item = &Key> {
        self.referencing
            .get(&(plural, namespace.to_string(), name.to_string()))
            .into_iter()
            .flatten()
    }

    /// Whether `pod` is bound to `node` and the authorizer has learnt its references.
    pub(crate) fn known_pod_of(&self, pod: &Key, node: &str) -> bool {
        self.pods_by_node.get(node).is_some_and(|p| p.contains(pod))
            && self
                .pod_seen_at
                .get(pod)
                .is_some_and(|t| *t <= Instant::now())
    }

    /// Whether the server's admission (NodeRestriction, from its own informer of pods, which
    /// lags as the authorizer's does) knows `pod`.
    pub(crate) fn admission_knows(&self, pod: &Key) -> bool {
        self.pod_seen_at
            .get(pod)
            .is_none_or(|t| *t <= Instant::now())
    }

    /// Pods bound to `node` whose references the authorizer has learnt.
    pub(crate) fn known_pods_of(&self, node: &str) -> Vec<(&Key, &Value)> {
        let now = Instant::now();
        self.pods_by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter(|key| self.pod_seen_at.get(*key).is_some_and(|t| *t <= now))
            .filter_map(|key| self.objects.get(key).map(|p| (key, p)))
            .collect()
    }

    fn record(&mut self, kind: &'static str, key: Key, object: Value) {
        if key.plural == "pods" {
            if let Some(node) = object.pointer("/spec/nodeName").and_then(Value::as_str) {
                let pods = self.pods_by_node.entry(node.to_string()).or_default();
                if kind == "DELETED" {
                    pods.remove(&key);
                } else {
                    pods.insert(key.clone());
                }
            }
            for (plural, name) in self.references.remove(&key).unwrap_or_default() {
                let entry = (plural, key.namespace.clone(), name);
                if let Some(pods) = self.referencing.get_mut(&entry) {
                    pods.remove(&key);
                    if pods.is_empty() {
                        self.referencing.remove(&entry);
                    }
                }
            }
            if kind != "DELETED" {
                let refs = crate::refs::of_pod(&object);
                for (plural, name) in &refs {
                    self.referencing
                        .entry((plural, key.namespace.clone(), name.clone()))
                        .or_default()
                        .insert(key.clone());
                }
                self.references.insert(key.clone(), refs);
            }
        }
        let change = Change {
            rv: self.rv,
            kind,
            key,
            object: std::sync::Arc::new(object),
        };
        self.history.push_back(change.clone());
        if self.history.len() > HISTORY {
            if let Some(old) = self.history.pop_front() {
                self.oldest = old.rv;
            }
        }
        if let Some(feed) = self.feeds.get(change.key.plural) {
            let _ = feed.send(change);
        }
    }

    fn next_rv(&mut self, obj: &mut Value) {
        self.rv += 1;
        meta(obj).insert("resourceVersion".into(), json!(self.rv.to_string()));
    }

    /// Creates an object.
    pub fn create(
        &mut self,
        res: &Resource,
        namespace: &str,
        mut obj: Value,
    ) -> Result<Value, ApiError> {
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                ApiError::new(422, "Invalid", format!("{} \"\" is invalid: metadata.name: Required value: name or generateName is required", res.kind))
            })?
            .to_string();
        let key = Key {
            plural: res.plural,
            namespace: if res.namespaced {
                namespace.to_string()
            } else {
                String::new()
            },
            name: name.clone(),
        };
        if self.objects.contains_key(&key) {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", res.plural),
            ));
        }
        obj["apiVersion"] = json!(res.group_version);
        obj["kind"] = json!(res.kind);
        let m = meta(&mut obj);
        if res.namespaced {
            m.insert("namespace".into(), json!(namespace));
        } else {
            m.remove("namespace");
        }
        m.insert(
            "uid".into(),
            json!(uuid::Uuid::new_v5(
                &uuid::Uuid::NAMESPACE_OID,
                format!("{}/{key:?}/{}", self.rv, now_rfc3339()).as_bytes()
            )
            .to_string()),
        );
        m.insert("creationTimestamp".into(), json!(now_rfc3339()));
        m.remove("deletionTimestamp");
        self.next_rv(&mut obj);
        if res.plural == "pods" {
            self.pod_seen_at
                .insert(key.clone(), Instant::now() + self.relation_delay);
        }
        self.objects.insert(key.clone(), obj.clone());
        self.record("ADDED", key, obj.clone());
        Ok(obj)
    }

    /// Replaces an object; a stale `resourceVersion` is a conflict.
    pub fn update(&mut self, key: &Key, res: &Resource, mut obj: Value) -> Result<Value, ApiError> {
        let Some(old) = self.objects.get(key) else {
            return Err(not_found(key));
        };
        let want = obj
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str);
        let have = old
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str);
        if want.is_some_and(|w| Some(w) != have) {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!("Operation cannot be fulfilled on {} \"{}\": the object has been modified; please apply your changes to the latest version and try again", key.plural, key.name),
            ));
        }
        let kept = old.get("metadata").cloned().unwrap_or_default();
        obj["apiVersion"] = json!(res.group_version);
        obj["kind"] = json!(res.kind);
        let m = meta(&mut obj);
        for f in [
            "uid",
            "creationTimestamp",
            "namespace",
            "name",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ] {
            match kept.get(f) {
                Some(v) => m.insert(f.into(), v.clone()),
                None => m.remove(f),
            };
        }
        self.store_modified(key, obj)
    }

    fn store_modified(&mut self, key: &Key, mut obj: Value) -> Result<Value, ApiError> {
        if self.objects.get(key) == Some(&obj) {
            return Ok(obj);
        }
        self.next_rv(&mut obj);
        self.objects.insert(key.clone(), obj.clone());
        self.record("MODIFIED", key.clone(), obj.clone());
        Ok(obj)
    }

    /// Applies a merge patch, to the whole object or (`status_only`) to its `status`.
    pub fn patch(
        &mut self,
        key: &Key,
        patch: &Value,
        status_only: bool,
    ) -> Result<Value, ApiError> {
        let Some(old) = self.objects.get(key) else {
            return Err(not_found(key));
        };
        let mut obj = old.clone();
        if status_only {
            if let Some(status) = patch.get("status") {
                merge_patch(&mut obj["status"], status);
            }
        } else {
            let mut patch = patch.clone();
            if let Some(m) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
                for f in [
                    "uid",
                    "creationTimestamp",
                    "namespace",
                    "name",
                    "resourceVersion",
                    "deletionTimestamp",
                ] {
                    m.remove(f);
                }
            }
            merge_patch(&mut obj, &patch);
        }
        self.store_modified(key, obj)
    }

    /// Deletes an object. A pod bound to a node is deleted gracefully, as the real server does:
    /// it gets a `deletionTimestamp` and stays until deleted again with a grace period of 0
    /// (by its node, once its containers and volumes are gone).
    pub fn delete(&mut self, key: &Key, grace: Option<i64>) -> Result<Value, ApiError> {
        let Some(obj) = self.objects.get(key).cloned() else {
            return Err(not_found(key));
        };
        let bound = obj
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .is_some_and(|n| !n.is_empty());
        let terminal = matches!(
            obj.pointer("/status/phase").and_then(Value::as_str),
            Some("Succeeded" | "Failed")
        );
        if key.plural == "pods" && bound && !terminal && grace != Some(0) {
            if obj.pointer("/metadata/deletionTimestamp").is_some() {
                return Ok(obj);
            }
            let mut obj = obj;
            let m = meta(&mut obj);
            m.insert("deletionTimestamp".into(), json!(now_rfc3339()));
            m.insert(
                "deletionGracePeriodSeconds".into(),
                json!(grace.unwrap_or(30)),
            );
            return self.store_modified(key, obj);
        }
        self.objects.remove(key);
        self.pod_seen_at.remove(key);
        let mut gone = obj.clone();
        self.next_rv(&mut gone);
        self.record("DELETED", key.clone(), gone.clone());
        Ok(gone)
    }
}

/// The key of an object of `plural` from its metadata.
pub fn key_of(plural: &'static str, obj: &Value) -> Key {
    let text = |p: &str| {
        obj.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    Key {
        plural,
        namespace: text("/metadata/namespace"),
        name: text("/metadata/name"),
    }
}

pub(crate) fn not_found(key: &Key) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("{} \"{}\" not found", key.plural, key.name),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut t = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut t, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(t, json!({"a": "z", "c": {"d": "e"}}));
        merge_patch(&mut t, &json!({"c": ["x"]}));
        assert_eq!(t, json!({"a": "z", "c": ["x"]}));
    }

    #[test]
    fn timestamps_are_rfc_3339() {
        let t = now_rfc3339();
        assert_eq!(t.len(), 20, "{t}");
        assert!(
            t.starts_with("20") && t.ends_with('Z') && &t[10..11] == "T",
            "{t}"
        );
    }

    #[test]
    fn watches_resume_within_the_history_and_get_gone_before_it() {
        let mut s = Store::default();
        let pods = resource("v1", "pods").unwrap();
        s.create(pods, "default", json!({"metadata": {"name": "a"}}))
            .unwrap();
        let rv = s.resource_version();
        s.create(pods, "default", json!({"metadata": {"name": "b"}}))
            .unwrap();
        let after = s.since(rv).unwrap();
        assert_eq!(after.len(), 1);
        assert_eq!(after[0].key.name, "b");
        s.compact();
        assert_eq!(s.since(rv).unwrap_err().code, 410);
        assert!(s.since(s.resource_version()).unwrap().is_empty());
    }

    #[test]
    fn bound_pods_are_deleted_gracefully() {
        let mut s = Store::default();
        let pods = resource("v1", "pods").unwrap();
        s.create(
            pods,
            "ns",
            json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n"}}),
        )
        .unwrap();
        let key = Key {
            plural: "pods",
            namespace: "ns".into(),
            name: "p".into(),
        };
        let o = s.delete(&key, None).unwrap();
        assert!(o.pointer("/metadata/deletionTimestamp").is_some());
        assert!(s.get(&key).is_some(), "kept until its node deletes it");
        s.delete(&key, Some(0)).unwrap();
        assert!(s.get(&key).is_none());
    }
}
