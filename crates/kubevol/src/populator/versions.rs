//! The versions of the objects a pod's volumes read (claims, volumes, CSIDrivers, the Node,
//! ConfigMaps, Secrets), compared by identity: a pod is processed again exactly when one of them
//! changed.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::projection::{referenced_objects, ObjectKind};
use kubevol_core::{PodRef, PodUid};

use super::claims;
use crate::store::{pod_ref, ObjectKey, ObjectStore};

/// The version of an object a pod's volume reads, compared by identity: the store replaces an
/// object's `Arc` exactly when the object changes.
#[derive(Clone, Debug)]
pub(super) enum Version {
    Missing,
    /// Missing, and a manifest file with an error defines it: the pod's message says so.
    NotLoaded,
    ConfigMap(Arc<k8s_openapi::api::core::v1::ConfigMap>),
    Secret(Arc<k8s_openapi::api::core::v1::Secret>),
    Claim(Arc<k8s_openapi::api::core::v1::PersistentVolumeClaim>),
    Volume(Arc<k8s_openapi::api::core::v1::PersistentVolume>),
    Driver(Arc<k8s_openapi::api::storage::v1::CSIDriver>),
    Node(Arc<k8s_openapi::api::core::v1::Node>),
    /// Missing, and the API server is still to list it; whether the server refuses the node's
    /// reads meanwhile (the pod's message says so).
    Pending(ObjectKey, bool),
    /// A claim the storage controllers have not bound, and why, once they have said.
    Unbound(Option<String>),
}

impl PartialEq for Version {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Version::Missing, Version::Missing) => true,
            (Version::Pending(a, x), Version::Pending(b, y)) => a == b && x == y,
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
pub(super) const ANY_PERSISTENT_VOLUME: ObjectKey = ObjectKey::PersistentVolume(String::new());

/// An object the store does not hold: still to be listed by the API server, or missing.
fn absent(store: &ObjectStore, key: ObjectKey) -> Version {
    if store.pending(&key) {
        let refused = store.refusal().is_some();
        Version::Pending(key, refused)
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
    pub(super) pod: Arc<Pod>,
    pub(super) objects: Vec<(ObjectKey, Version)>,
    /// Which of `objects` each volume reads, by the volume's name.
    pub(super) spans: Vec<(String, std::ops::Range<usize>)>,
}

impl Seen {
    /// The names of the volumes whose objects differ between `before` and now (`objects`
    /// read as `spans` say): those a change concerns.
    pub(super) fn changed_volumes<'a>(
        before: Option<&Seen>,
        objects: &[(ObjectKey, Version)],
        spans: &'a [(String, std::ops::Range<usize>)],
    ) -> Vec<&'a str> {
        spans
            .iter()
            .filter(|(name, range)| {
                let was = before.and_then(|s| {
                    let (_, r) = s.spans.iter().find(|(n, _)| n == name)?;
                    s.objects.get(r.clone())
                });
                was != objects.get(range.clone())
            })
            .map(|(name, _)| name.as_str())
            .collect()
    }
}

/// The current versions of the objects a pod's volumes read, in a fixed order; which of them
/// each volume reads; and for each volume that reads an object the API server is still to
/// list, the first such object.
pub(super) struct Versions {
    pub(super) objects: Vec<(ObjectKey, Version)>,
    pub(super) spans: Vec<(String, std::ops::Range<usize>)>,
    pub(super) pending: BTreeMap<String, ObjectKey>,
}

/// The [`Versions`] of the objects `pod`'s volumes read now.
pub(super) fn object_versions(
    store: &ObjectStore,
    node: &str,
    pod: &Pod,
    uid: &PodUid,
) -> Versions {
    let mut out = Vec::new();
    let mut spans = Vec::new();
    let mut pending = BTreeMap::new();
    let pref = pod_ref(pod, uid);
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let start = out.len();
        volume_versions(store, node, pod, &pref, v, &mut out);
        spans.push((v.name.clone(), start..out.len()));
        let first = out[start..].iter().find_map(|(_, x)| match x {
            Version::Pending(key, _) => Some(key.clone()),
            _ => None,
        });
        if let Some(key) = first {
            pending.insert(v.name.clone(), key);
        }
    }
    Versions {
        objects: out,
        spans,
        pending,
    }
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
