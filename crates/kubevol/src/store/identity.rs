//! Who a pod or claim is (its UID, given or derived), whose node it is for, whether it is done,
//! and the defaults a pod is given.

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kubevol_core::{PodRef, PodUid};

/// The namespace name of the kubelet's default namespace.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The namespace under which pod UIDs are derived (a fixed, random UUID).
const UID_NAMESPACE: uuid::Uuid = uuid::Uuid::from_bytes([
    0x5c, 0x1e, 0x7a, 0x43, 0x2b, 0x9d, 0x4f, 0x0e, 0x8a, 0x61, 0x3d, 0x77, 0xc2, 0x15, 0xe9, 0x04,
]);

/// A pod's UID: `metadata.uid` when set, else a UUID derived from its namespace and name, stable
/// across restarts.
pub fn pod_uid(pod: &Pod) -> PodUid {
    pod_uid_of(&pod.metadata)
}

/// [`pod_uid`] from the pod's metadata alone.
pub fn pod_uid_of(meta: &ObjectMeta) -> PodUid {
    PodUid::from(own_or(meta, |ns, name| derived(&format!("{ns}/{name}"))))
}

/// A claim's UID: its own, or, for a claim of the manifests that has none, one derived from
/// its namespace and name (stable: the same claim written again has the same UID).
pub fn claim_uid(claim: &PersistentVolumeClaim) -> String {
    own_or(&claim.metadata, derived_claim_uid)
}

/// The UID of a claim of the manifests that sets none.
pub fn derived_claim_uid(namespace: &str, name: &str) -> String {
    derived(&format!("PersistentVolumeClaim/{namespace}/{name}"))
}

/// The UID of the claim kubevol makes for the generic ephemeral volume `volume` of the pod of
/// UID `pod`: another for every pod, as the API server gives every claim its own, so that a
/// claim that merely has the same name later is another claim, not this one's heir.
pub fn ephemeral_claim_uid(pod: &str, volume: &str) -> String {
    derived(&format!("PersistentVolumeClaim/ephemeral/{pod}/{volume}"))
}

/// The object's own UID, or `derive(namespace, name)` when it sets none (no namespace is the
/// default one).
fn own_or(meta: &ObjectMeta, derive: impl FnOnce(&str, &str) -> String) -> String {
    if let Some(uid) = meta.uid.as_deref().filter(|u| !u.is_empty()) {
        return uid.to_string();
    }
    let ns = meta.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE);
    derive(ns, meta.name.as_deref().unwrap_or(""))
}

/// The UUID derived from `key` under kubevol's namespace: the same for the same key, on
/// every node and after every restart.
fn derived(key: &str) -> String {
    uuid::Uuid::new_v5(&UID_NAMESPACE, key.as_bytes()).to_string()
}

/// Whether a pod is assigned to this node (no `spec.nodeName` means this node, as for static pods).
pub fn is_for_node(pod: &Pod, node: &str) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_none_or(|n| n.is_empty() || n == node)
}

/// Whether a pod has finished or is being deleted: its volumes are torn down.
pub fn is_terminated(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded") | Some("Failed")) || pod.metadata.deletion_timestamp.is_some()
}

/// A pod's reference, for messages and keys.
pub fn pod_ref(pod: &Pod, uid: &PodUid) -> PodRef {
    PodRef {
        namespace: pod
            .metadata
            .namespace
            .as_deref()
            .unwrap_or(DEFAULT_NAMESPACE)
            .into(),
        name: pod.metadata.name.as_deref().unwrap_or_default().into(),
        uid: uid.clone(),
    }
}

/// What the manager's waits and removals take to name a pod: the pod itself, or who it is (a
/// [`PodRef`], three shared strings, for a caller that keeps thousands of pods waited on and
/// not their specs).
pub trait PodIdentity {
    /// Who the pod is: its namespace, name and UID (the manifest's, or derived as
    /// [`pod_uid`] derives it).
    fn pod_ref(&self) -> PodRef;

    /// The pod's UID alone (what a removal needs).
    fn uid(&self) -> PodUid {
        self.pod_ref().uid
    }
}

impl PodIdentity for Pod {
    fn pod_ref(&self) -> PodRef {
        pod_ref(self, &pod_uid(self))
    }

    fn uid(&self) -> PodUid {
        pod_uid(self)
    }
}

impl PodIdentity for PodRef {
    fn pod_ref(&self) -> PodRef {
        self.clone()
    }

    fn uid(&self) -> PodUid {
        self.uid.clone()
    }
}

/// The PersistentVolume a claim names in `spec.volumeName`, if it names one.
pub fn claim_volume(claim: &PersistentVolumeClaim) -> Option<&str> {
    claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .filter(|n| !n.is_empty())
}

/// Whether a claim's binding is complete, as the kubelet requires of the API server's claims:
/// the PersistentVolume controller has set `spec.volumeName`, then `status.phase` Bound.
pub fn claim_bound(claim: &PersistentVolumeClaim) -> bool {
    claim_volume(claim).is_some()
        && claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
}

/// Fills in a pod's defaults: the `default` namespace and its UID.
pub fn normalize_pod(mut pod: Pod) -> Pod {
    if pod.metadata.namespace.as_deref().unwrap_or("").is_empty() {
        pod.metadata.namespace = Some(DEFAULT_NAMESPACE.to_string());
    }
    let uid = pod_uid(&pod);
    pod.metadata.uid = Some(uid.0.to_string());
    pod
}
