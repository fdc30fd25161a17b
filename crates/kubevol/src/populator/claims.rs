//! From a pod's `persistentVolumeClaim` to its PersistentVolume, with the checks the kubelet
//! (and the API server's binder) make, each failing with a message that says what to fix.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    NodeSelector, PersistentVolume, PersistentVolumeClaim, Pod, Volume,
};
use kubevol_core::affinity::{self, NodeFacts};
use kubevol_core::validation::all_containers;

use std::borrow::Cow;

use kubevol_core::PodRef;

use crate::store::{claim_bound, claim_uid, claim_volume, ObjectStore, Origin};

/// How a pod's containers use a volume.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Listed in some container's `volumeMounts`.
    pub mounted: bool,
    /// Mounted writable by some container.
    pub written: bool,
    /// Listed in some container's `volumeDevices`.
    pub device: bool,
}

/// How `pod`'s containers use the volume `name`.
pub fn usage(pod: &Pod, name: &str) -> Usage {
    let mut u = Usage::default();
    for (_, c) in all_containers(pod) {
        for m in c.volume_mounts.iter().flatten().filter(|m| m.name == name) {
            u.mounted = true;
            u.written |= !m.read_only.unwrap_or(false);
        }
        u.device |= c.volume_devices.iter().flatten().any(|d| d.name == name);
    }
    u
}

/// The claim a pod's volume uses (see [`claim_name`](kubevol_core::names::claim_name)), if it is a claim or generic ephemeral
/// volume, and the claim the store holds by that name.
pub fn claim_of<'a>(
    store: &ObjectStore,
    pod: &PodRef,
    volume: &'a Volume,
) -> Option<(Cow<'a, str>, Option<Arc<PersistentVolumeClaim>>)> {
    let name = kubevol_core::names::claim_name(&pod.name, volume)?;
    let claim = store
        .persistent_volume_claim(&pod.namespace, &name)
        .map(|s| s.object);
    Some((name, claim))
}

/// Whether `claim` is the one made for `pod`'s generic ephemeral volume: the pod is its
/// controlling owner (`ownerReferences[]` with `controller: true` and the pod's UID), as the
/// kubelet checks before it uses such a claim, so that a claim that merely has the name is
/// never mounted. A claim of the manifests may leave the reference's `uid` out (a pod of the
/// manifests has a UID only if it sets `metadata.uid`): then kind `Pod` and the pod's name must
/// match.
pub fn made_for_pod(pod: &PodRef, claim: &PersistentVolumeClaim, from_cluster: bool) -> bool {
    claim
        .metadata
        .owner_references
        .iter()
        .flatten()
        .filter(|o| o.controller == Some(true))
        .any(|o| {
            o.uid == pod.uid.as_str()
                || (!from_cluster && o.uid.is_empty() && o.kind == "Pod" && o.name == *pod.name)
        })
}

/// The pod (`namespace/name`) that a claim kubevol made for a generic ephemeral volume was made
/// for, when that pod is gone: the claim goes with it (as the garbage collector deletes it), so
/// no pod may start with it meanwhile, nor with the volume bound to it.
fn orphaned(store: &ObjectStore, ns: &str, name: &str) -> Option<String> {
    let claim = store
        .persistent_volume_claim(ns, name)
        .filter(|c| c.origin == Origin::Provisioned)?;
    let owner = claim
        .object
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == "Pod")?;
    let uid = kubevol_core::PodUid::from(owner.uid.as_str());
    store
        .pod(&uid)
        .is_none()
        .then(|| format!("{ns}/{}", owner.name))
}

/// Whether the claim `ns/name` the store holds came from the API server, where the
/// PersistentVolume controller binds claims (and a node may read only the PersistentVolume a
/// bound claim names, never list them).
pub(crate) fn from_cluster(store: &ObjectStore, ns: &str, name: &str) -> bool {
    store
        .persistent_volume_claim(ns, name)
        .is_some_and(|s| s.origin == Origin::Cluster)
}

/// Whether a claim volume waits for others (the cluster's controllers, or kubevol's own
/// provisioner) rather than for a fix: its claim
/// comes from the API server and is not bound yet, or the API server said it does not exist
/// (yet: a claim is made by a user, a StatefulSet or the ephemeral-volume controller, and bound
/// by the PersistentVolume controller). Such a volume is Pending, not failed, and `--once` waits
/// for it; its FailedMount event is posted all the same. In standalone mode, a claim whose
/// volume a CSI driver is creating, or whose provisioned volume is being deleted to make way
/// for a new one, waits likewise.
pub fn waits_for_others(store: &ObjectStore, pod: &PodRef, volume: &Volume) -> bool {
    let Some((name, claim)) = claim_of(store, pod, volume) else {
        return false;
    };
    let ns = &*pod.namespace;
    match claim {
        Some(c) if from_cluster(store, ns, &name) => {
            !claim_bound(&c) && (volume.ephemeral.is_none() || made_for_pod(pod, &c, true))
        }
        Some(c) => {
            let bindings = store.bindings();
            let bound = bound_volume(store, ns, &c);
            bindings.creating(ns, &name).is_some()
                || orphaned(store, ns, &name).is_some()
                || bound.is_none() && bindings.why_unbound(ns, &name).is_none()
                || bindings
                    .volume_of(ns, &name, &claim_uid(&c))
                    .is_some_and(|v| bindings.is_releasing(&v))
        }
        // In standalone mode kubevol's own ephemeral-volume controller makes the claim of a
        // generic ephemeral volume: until it has, the volume waits (unless a manifest with an
        // error holds a claim of that name back).
        None if volume.ephemeral.is_some() && !store.serves_a_cluster() => store
            .not_loaded("PersistentVolumeClaim", ns, &name)
            .is_none(),
        None => store.absent(&crate::store::ObjectKey::PersistentVolumeClaim((
            ns.to_string(),
            name.to_string(),
        ))),
    }
}

/// The PersistentVolume a claim is bound to: the one `spec.volumeName` names, or else (a claim
/// of the manifests or the library) the one kubevol bound it to, or the one whose
/// `spec.claimRef` names the claim.
pub fn bound_volume(
    store: &ObjectStore,
    ns: &str,
    claim: &PersistentVolumeClaim,
) -> Option<Arc<PersistentVolume>> {
    let cname = claim.metadata.name.as_deref().unwrap_or_default();
    let uid = claim_uid(claim);
    match claim_volume(claim) {
        Some(pv) => store.persistent_volume(pv).map(|s| s.object),
        None if from_cluster(store, ns, cname) => None,
        None => match store.bindings().volume_of(ns, cname, &uid) {
            Some(pv) => store.persistent_volume(&pv).map(|s| s.object),
            // A volume kubevol bound to another claim is that claim's, whatever its claimRef
            // says now.
            None => store
                .persistent_volumes()
                .into_iter()
                .map(|s| s.object)
                .find(|pv| {
                    let name = pv.metadata.name.as_deref().unwrap_or_default();
                    store.bindings().claim_of(name).is_none()
                        && kubevol_core::binding::claim_ref_names(pv, ns, cname, Some(&uid))
                }),
        },
    }
}

/// Why the claim `ns/name` cannot be used (it is invalid: its fields and file), if it cannot.
pub(crate) fn invalid_claim(store: &ObjectStore, ns: &str, name: &str) -> Result<(), String> {
    match store.persistent_volume_claim(ns, name).and_then(|s| s.invalid) {
        Some(why) => Err(format!(
            "PersistentVolumeClaim {ns}/{name} is invalid (the API server refuses it too), so nothing is bound, provisioned or mounted for it: {why}; fix the claim"
        )),
        None => Ok(()),
    }
}

fn mode(m: Option<&String>) -> &str {
    m.map(String::as_str).unwrap_or("Filesystem")
}

/// Why the claim of a generic ephemeral volume is not there, and who makes it.
fn ephemeral_absence(store: &ObjectStore, ns: &str, name: &str) -> String {
    let key = crate::store::ObjectKey::PersistentVolumeClaim((ns.to_string(), name.to_string()));
    if store.absent(&key) {
        return "does not exist in the API server yet: the ephemeral-volume controller makes it from the volume's volumeClaimTemplate (it is read again with backoff, every 8 s at most)".into();
    }
    match store.not_loaded("PersistentVolumeClaim", ns, name) {
        Some(why) => format!("is not loaded: {why}"),
        None if !store.serves_a_cluster() => "is not made yet: kubevol's ephemeral-volume controller makes it from the volume's volumeClaimTemplate, and the volume waits for it".into(),
        None => format!(
            "does not exist: add it to the manifests (the volumeClaimTemplate's spec, named {name}, with an ownerReference to the pod: kind Pod, its name, controller: true)"
        ),
    }
}

/// Resolves a claim or generic ephemeral volume of `pod`, used by its containers as `u` says,
/// to its PersistentVolume.
pub fn resolve(
    store: &ObjectStore,
    pod: &PodRef,
    volume: &Volume,
    u: Usage,
) -> Result<Arc<PersistentVolume>, String> {
    let Some((cname, claim)) = claim_of(store, pod, volume) else {
        return Err("not a persistentVolumeClaim or ephemeral volume".into());
    };
    let (ns, cname) = (&*pod.namespace, &*cname);
    let Some(claim) = claim else {
        return Err(match volume.ephemeral {
            Some(_) => format!(
                "PersistentVolumeClaim {ns}/{cname} of the generic ephemeral volume {}",
                ephemeral_absence(store, ns, cname)
            ),
            None => format!(
                "PersistentVolumeClaim {ns}/{cname} {}",
                store.absence("PersistentVolumeClaim", ns, cname)
            ),
        });
    };
    invalid_claim(store, ns, cname)?;
    if volume.ephemeral.is_some() && !made_for_pod(pod, &claim, from_cluster(store, ns, cname)) {
        return Err(format!(
            "PVC {ns}/{cname} was not created for pod {pod} (pod is not owner): the claim of a generic ephemeral volume is used only when the pod is its controlling owner; delete or rename the claim, or rename the pod or the volume"
        ));
    }
    if claim.metadata.deletion_timestamp.is_some() {
        return Err(format!(
            "PersistentVolumeClaim {ns}/{cname} is being deleted (metadata.deletionTimestamp is set): a pod cannot start with it"
        ));
    }
    if let Some(owner) = orphaned(store, ns, cname) {
        return Err(format!(
            "PersistentVolumeClaim {ns}/{cname} is being deleted (it was made for the generic ephemeral volume of pod {owner}, which is gone): a pod cannot start with it; a claim of its name defined elsewhere is used once it is gone"
        ));
    }
    let volume_name = claim_volume(&claim).map(String::from);
    // The API server's claim is used once its binding is complete, as the kubelet does.
    if from_cluster(store, ns, cname) && !claim_bound(&claim) {
        return Err(format!(
            "PersistentVolumeClaim {ns}/{cname} is not bound yet (status.phase {}, spec.volumeName {}): waiting for the PersistentVolume controller to bind it; the claim is read again with backoff, every 8 s at most",
            claim.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("unset"),
            volume_name.as_deref().unwrap_or("unset"),
        ));
    }
    let Some(pv) = bound_volume(store, ns, &claim) else {
        let kept = store.bindings().volume_of(ns, cname, &claim_uid(&claim));
        return Err(match (volume_name, kept) {
            (Some(n), _) => format!(
                "PersistentVolumeClaim {ns}/{cname} is bound to PersistentVolume {n} (spec.volumeName), which {}",
                store.absence("PersistentVolume", "", &n)
            ),
            (None, Some(n)) => format!(
                "PersistentVolumeClaim {ns}/{cname} was bound by kubevol to PersistentVolume {n}, which {} (the binding is kept: a claim never moves to another volume)",
                store.absence("PersistentVolume", "", &n)
            ),
            (None, None) => match store.bindings().why_unbound(ns, cname) {
                Some(why) => why,
                None => format!(
                    "PersistentVolumeClaim {ns}/{cname} is not bound yet: kubevol's binder binds it to a PersistentVolume that fits, or provisions one, as soon as it looks at it; set its spec.volumeName to choose one"
                ),
            },
        });
    };
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    if store.bindings().is_releasing(&pv_name) {
        return Err(format!(
            "PersistentVolume {pv_name}, provisioned for claim {ns}/{cname}, is being deleted (its claim was removed, and its reclaim policy is Delete): the claim gets a new volume once that is done"
        ));
    }
    if let Some(other) = store
        .bindings()
        .claim_of(&pv_name)
        .filter(|c| *c != format!("{ns}/{cname}"))
    {
        return Err(format!(
            "PersistentVolume {pv_name} was bound by kubevol to claim {other}, and a volume is never given to two claims: choose another volume, or, to give it to this claim, remove that binding from {}/{} while kubevol is stopped",
            crate::record::RECORD_DIR,
            crate::store::BINDINGS_FILE
        ));
    }
    if let Some(e) = kubevol_core::validation::dns1123_subdomain_error(&pv_name) {
        return Err(format!("PersistentVolume name {pv_name:?}: {e}"));
    }
    let pv_spec = pv.spec.clone().unwrap_or_default();
    if let Some(r) = &pv_spec.claim_ref {
        let (rns, rname) = (
            r.namespace.as_deref().unwrap_or_default(),
            r.name.as_deref().unwrap_or_default(),
        );
        let uid_mismatch = r
            .uid
            .as_deref()
            .filter(|u| !u.is_empty())
            .is_some_and(|u| u != claim_uid(claim.as_ref()));
        if rns != ns || rname != cname {
            return Err(format!(
                "PersistentVolume {pv_name} is bound to claim {rns}/{rname}, not to {ns}/{cname}: fix the claim's spec.volumeName or the volume's spec.claimRef"
            ));
        }
        if uid_mismatch {
            return Err(format!(
                "PersistentVolume {pv_name} is bound to an earlier claim {rns}/{rname} (claimRef.uid {}), not to this one (uid {}): the volume is Released; fix the claim's spec.volumeName or the volume's spec.claimRef",
                r.uid.as_deref().unwrap_or_default(),
                claim_uid(claim.as_ref())
            ));
        }
    }
    let pv_mode = mode(pv_spec.volume_mode.as_ref());
    let claim_mode = mode(claim.spec.as_ref().and_then(|s| s.volume_mode.as_ref()));
    if pv_mode != claim_mode {
        return Err(format!(
            "PersistentVolumeClaim {ns}/{cname} asks for volumeMode {claim_mode} but PersistentVolume {pv_name} has volumeMode {pv_mode}"
        ));
    }
    if u.device && u.mounted {
        return Err(format!(
            "the claim is used in both volumeMounts and volumeDevices: use one (volumeMode {pv_mode})"
        ));
    }
    if u.device && pv_mode != "Block" {
        return Err(format!(
            "the claim is used in volumeDevices but PersistentVolume {pv_name} has volumeMode {pv_mode}: use volumeMounts, or a volume with volumeMode Block"
        ));
    }
    if u.mounted && pv_mode == "Block" {
        return Err(format!(
            "the claim is used in volumeMounts but PersistentVolume {pv_name} has volumeMode Block: use volumeDevices, or a volume with volumeMode Filesystem"
        ));
    }
    let modes = pv_spec.access_modes.clone().unwrap_or_default();
    if u.written && !modes.is_empty() && modes.iter().all(|m| m == "ReadOnlyMany") {
        return Err(format!(
            "PersistentVolume {pv_name} allows only ReadOnlyMany but a container mounts it writable: set readOnly: true on the volumeMount"
        ));
    }
    if let Some(csi) = &pv_spec.csi {
        lifecycle_allows(store, &csi.driver, "Persistent")?;
    }
    sole_volume_of_its_handle(store, &pv)?;
    Ok(pv)
}

/// The CSI volume (driver, handle) a PersistentVolume of the manifests or the library names.
fn held_handle(s: &crate::store::Stored<PersistentVolume>) -> Option<(String, String)> {
    if matches!(s.origin, crate::store::Origin::Cluster) {
        return None;
    }
    let csi = s.object.spec.as_ref()?.csi.as_ref()?;
    Some((csi.driver.clone(), csi.volume_handle.clone()))
}

/// Of PersistentVolumes that name one CSI volume, the one that keeps it: the one a claim is
/// bound to, then kubevol's provisioned one, then by origin (the library API, then the file that
/// sorts first), then by name.
fn first_of_handle<'a>(
    store: &ObjectStore,
    same: impl Iterator<Item = &'a crate::store::Stored<PersistentVolume>>,
) -> Option<&'a crate::store::Stored<PersistentVolume>> {
    same.min_by_key(|s| {
        let n = s.object.metadata.name.as_deref().unwrap_or_default();
        let bound = store.bindings().claim_of(n).is_some();
        let provisioned = matches!(s.origin, crate::store::Origin::Provisioned);
        (!bound, !provisioned, s.origin.clone(), n.to_string())
    })
}

/// Refuses a PersistentVolume of the manifests or the library that names the CSI volume (driver
/// and handle) another one names first ([`first_of_handle`]): whoever writes a PersistentVolume
/// could otherwise name another tenant's volume and mount it, around its claim and its access
/// modes. The API server's PersistentVolumes are not held to it: only a cluster's
/// administrators make them, and two for one share (an NFS export given to two namespaces) are
/// theirs to make.
pub fn sole_volume_of_its_handle(store: &ObjectStore, pv: &PersistentVolume) -> Result<(), String> {
    let name = pv.metadata.name.as_deref().unwrap_or_default();
    let all = store.persistent_volumes();
    let Some(this) = all
        .iter()
        .find(|s| s.object.metadata.name.as_deref() == Some(name))
    else {
        return Ok(());
    };
    let Some(handle) = held_handle(this) else {
        return Ok(());
    };
    let same = all
        .iter()
        .filter(|s| held_handle(s).as_ref() == Some(&handle));
    let first = first_of_handle(store, same).expect("this one at least");
    let first_name = first.object.metadata.name.as_deref().unwrap_or_default();
    if first_name == name {
        return Ok(());
    }
    Err(format!(
        "PersistentVolume {name} names volume {:?} of CSI driver {}, which PersistentVolume {first_name} ({}) names first: one volume of the storage is one PersistentVolume, whose claim and access modes decide who mounts it; remove {name}, or give it the handle of a volume of its own",
        handle.1, handle.0, first.origin
    ))
}

/// The names of the PersistentVolumes of `all` that another one's CSI volume keeps out
/// ([`sole_volume_of_its_handle`]), found in one pass.
pub fn handles_named_first_elsewhere(
    store: &ObjectStore,
    all: &[crate::store::Stored<PersistentVolume>],
) -> std::collections::HashSet<String> {
    type Group<'a> = Vec<&'a crate::store::Stored<PersistentVolume>>;
    let mut by_handle: std::collections::BTreeMap<(String, String), Group<'_>> =
        std::collections::BTreeMap::new();
    for s in all {
        if let Some(h) = held_handle(s) {
            by_handle.entry(h).or_default().push(s);
        }
    }
    let mut out = std::collections::HashSet::new();
    for group in by_handle.values().filter(|g| g.len() > 1) {
        let first = first_of_handle(store, group.iter().copied()).expect("two or more");
        out.extend(
            group
                .iter()
                .filter(|s| !std::ptr::eq(**s, first))
                .filter_map(|s| s.object.metadata.name.clone()),
        );
    }
    out
}

/// The API server's checks of a PersistentVolume (a volume from a manifest file never met
/// them, and its paths reach the node's mounts), with kubevol's own: a local or hostPath path is
/// absolute.
pub fn check_persistent_volume(pv: &PersistentVolume) -> Result<(), String> {
    let errors = kubevol_core::validation::validate_persistent_volume(pv);
    if errors.is_empty() {
        return Ok(());
    }
    let errors: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
    Err(format!(
        "PersistentVolume {} is invalid (the API server refuses it too): {}; fix the PersistentVolume",
        pv.metadata.name.as_deref().unwrap_or_default(),
        errors.join("; ")
    ))
}

/// Whether this node matches a PersistentVolume's `spec.nodeAffinity.required`: a volume that
/// lives on other nodes is not mounted here.
pub fn check_node_affinity(
    pv: &str,
    required: &NodeSelector,
    node: &NodeFacts,
) -> Result<(), String> {
    if required.node_selector_terms.is_empty() {
        return Err(format!(
            "PersistentVolume {pv}: spec.nodeAffinity.required.nodeSelectorTerms: Required value: must have at least one node selector term"
        ));
    }
    if affinity::matches(required, node) {
        return Ok(());
    }
    Err(format!(
        "PersistentVolume {pv} is on other nodes: its spec.nodeAffinity requires {}, and node {} (labels: {}) matches none of its terms; run the pod on a node the volume is on, or give this node the label (--node-labels; in cluster mode, on the Node object)",
        affinity::describe(required),
        node.name,
        node.describe_labels()
    ))
}

/// Whether the CSIDriver object of `driver` allows `mode` (`Persistent` or `Ephemeral`). Without
/// a CSIDriver object only Persistent is allowed, as in the kubelet.
pub fn lifecycle_allows(store: &ObjectStore, driver: &str, mode: &str) -> Result<(), String> {
    let modes = store.csi_driver(driver).map(|d| {
        d.object
            .spec
            .volume_lifecycle_modes
            .clone()
            .unwrap_or_default()
    });
    let allowed = match &modes {
        None => mode == "Persistent",
        Some(m) if m.is_empty() => mode == "Persistent",
        Some(m) => m.iter().any(|x| x == mode),
    };
    if allowed {
        return Ok(());
    }
    Err(match modes {
        None => match store.not_loaded("CSIDriver", "", driver) {
            Some(why) => format!(
                "CSI driver {driver}'s CSIDriver object is not loaded, so only persistent volumes are allowed: {why}"
            ),
            None => format!(
                "CSI driver {driver} has no CSIDriver object, so only persistent volumes are allowed: add a CSIDriver {driver} with volumeLifecycleModes [{mode}]"
            ),
        },
        Some(m) => format!(
            "CSIDriver {driver} does not list {mode} in spec.volumeLifecycleModes ({}): add it, or use the volume another way",
            if m.is_empty() { "Persistent".to_string() } else { m.join(", ") }
        ),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn store(items: serde_json::Value) -> ObjectStore {
        let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
        let (objects, errors) =
            crate::source::parse_manifest(std::path::Path::new("t.json"), &list.to_string());
        assert!(errors.is_empty(), "{errors:?}");
        let s = ObjectStore::new();
        s.apply(
            objects
                .into_iter()
                .map(|(_, o)| crate::store::Change::Upsert(Box::new(o))),
        );
        s
    }

    fn pv(name: &str, claim: Option<(&str, &str)>, mode: &str, access: &str) -> serde_json::Value {
        let mut v = json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name}, "spec": {
            "accessModes": [access], "volumeMode": mode,
            "csi": {"driver": "d.example.com", "volumeHandle": name}}});
        if let Some((ns, n)) = claim {
            v["spec"]["claimRef"] = json!({"namespace": ns, "name": n});
        }
        v
    }

    fn pvc(name: &str, volume_name: Option<&str>, mode: &str) -> serde_json::Value {
        let mut v = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"volumeMode": mode, "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}});
        if let Some(n) = volume_name {
            v["spec"]["volumeName"] = json!(n);
        }
        v
    }

    fn volume(claim: &str) -> Volume {
        serde_json::from_value(json!({"name": "v", "persistentVolumeClaim": {"claimName": claim}}))
            .unwrap()
    }

    /// The pod `ns/app` whose volumes are resolved.
    fn app() -> PodRef {
        PodRef {
            namespace: "ns".into(),
            name: "app".into(),
            uid: kubevol_core::PodUid::from("0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70"),
        }
    }

    const MOUNTED: Usage = Usage {
        mounted: true,
        written: true,
        device: false,
    };
    const DEVICE: Usage = Usage {
        mounted: false,
        written: false,
        device: true,
    };

    fn resolved(objects: serde_json::Value, claim: &str, u: Usage) -> Result<String, String> {
        let s = store(objects);
        resolve(&s, &app(), &volume(claim), u).map(|pv| pv.metadata.name.clone().unwrap())
    }

    #[test]
    fn claims_bind_by_volume_name_or_claim_ref() {
        let by_name = json!([
            pv("a", None, "Filesystem", "ReadWriteOnce"),
            pvc("c", Some("a"), "Filesystem")
        ]);
        assert_eq!(resolved(by_name, "c", MOUNTED).unwrap(), "a");
        let by_ref = json!([
            pv("b", Some(("ns", "c")), "Filesystem", "ReadWriteOnce"),
            pvc("c", None, "Filesystem")
        ]);
        assert_eq!(resolved(by_ref, "c", MOUNTED).unwrap(), "b");
        let block = json!([
            pv("k", Some(("ns", "c")), "Block", "ReadWriteOnce"),
            pvc("c", None, "Block")
        ]);
        assert_eq!(resolved(block, "c", DEVICE).unwrap(), "k");
    }

    /// A claim of a gone pod's generic ephemeral volume, still in the store (the storage pass
    /// has not removed it yet) and shadowing a claim of its name from the manifests, gives no
    /// pod its volume; nor does a volume whose claimRef names an earlier claim of the name.
    #[test]
    fn a_gone_pods_ephemeral_claim_and_its_volume_go_to_no_one() {
        let gone = "5d6f1c1e-7c1b-4b8e-9a43-1f0c9d2b7e11";
        let made: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "e0e0e0e0-0000-4000-8000-000000000001",
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "gone", "uid": gone, "controller": true}]},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}))
        .unwrap();
        let mut old = pv("old", Some(("ns", "c")), "Filesystem", "ReadWriteOnce");
        old["spec"]["claimRef"]["uid"] = json!("e0e0e0e0-0000-4000-8000-000000000001");
        let s = store(json!([old]));
        let path = std::path::Path::new("/m/c.yaml");
        let (objects, errors) =
            crate::source::parse_manifest(path, &pvc("c", None, "Filesystem").to_string());
        assert!(errors.is_empty(), "{errors:?}");
        s.apply([crate::store::Change::File {
            path: path.to_path_buf(),
            content: crate::store::FileContent::Objects(objects),
        }]);
        s.add_provisioned([crate::store::Object::PersistentVolumeClaim(made)]);
        let err = resolve(&s, &app(), &volume("c"), MOUNTED).unwrap_err();
        assert!(
            err.contains("is being deleted (it was made for the generic ephemeral volume of pod ns/gone, which is gone)"),
            "{err}"
        );
        assert!(
            waits_for_others(&s, &app(), &volume("c")),
            "it waits, not fails"
        );
        s.remove_claims_made_for(gone);
        let err = resolve(&s, &app(), &volume("c"), MOUNTED).unwrap_err();
        assert!(
            err.contains("is not bound yet"),
            "the old volume is not the new claim's: {err}"
        );
    }

    #[test]
    fn objects_held_back_by_a_broken_file_are_named_with_its_error() {
        let broken = |s: &ObjectStore, text: &str| {
            let path = std::path::Path::new("/m/broken.yaml");
            let (_, errors) = crate::source::parse_manifest(path, text);
            s.apply([crate::store::Change::File {
                path: path.to_path_buf(),
                content: crate::store::FileContent::Broken(errors),
            }]);
        };
        let s = ObjectStore::new();
        broken(&s, "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: c, namespace: ns}\nspec: {volumeName: [a]}\n");
        let err = resolve(&s, &app(), &volume("c"), MOUNTED).unwrap_err();
        assert!(
            err.starts_with("PersistentVolumeClaim ns/c is not loaded: it is defined in /m/broken.yaml: document 1, line 4")
                && err.ends_with("that file is not applied while it has an error: fix it"),
            "{err}"
        );
        let s = store(json!([pvc("c", Some("a"), "Filesystem")]));
        broken(
            &s,
            "apiVersion: v2\nkind: PersistentVolume\nmetadata: {name: a}\n",
        );
        let err = resolve(&s, &app(), &volume("c"), MOUNTED).unwrap_err();
        assert!(err.contains("PersistentVolume a (spec.volumeName), which is not loaded: it is defined in /m/broken.yaml: document 1: apiVersion \"v2\" is not supported"), "{err}");
        broken(&s, "apiVersion: storage.k8s.io/v1\nkind: CSIDriver\nmetadata: {name: d.example.com}\nspec: {volumeLifecycleModes: Ephemeral}\n");
        let err = lifecycle_allows(&s, "d.example.com", "Ephemeral").unwrap_err();
        assert!(err.contains("CSIDriver object is not loaded, so only persistent volumes are allowed: it is defined in /m/broken.yaml"), "{err}");
        assert!(
            lifecycle_allows(&s, "other.example.com", "Ephemeral")
                .unwrap_err()
                .contains("has no CSIDriver object"),
            "another driver's object is simply missing"
        );
    }

    #[test]
    fn every_refusal_says_what_to_fix() {
        let rows: Vec<(&str, serde_json::Value, Usage, &str)> = vec![
            ("missing claim", json!([]), MOUNTED, "PersistentVolumeClaim ns/c does not exist: add it"),
            (
                "claim being deleted",
                json!([{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "c", "namespace": "ns", "deletionTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"volumeName": "a", "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}]),
                MOUNTED,
                "is being deleted",
            ),
            ("missing volume", json!([pvc("c", Some("a"), "Filesystem")]), MOUNTED, "bound to PersistentVolume a (spec.volumeName), which does not exist"),
            ("unbound", json!([pvc("c", None, "Filesystem")]), MOUNTED, "is not bound yet: kubevol's binder binds it to a PersistentVolume that fits, or provisions one"),
            (
                "bound to another claim",
                json!([pv("a", Some(("ns", "other")), "Filesystem", "ReadWriteOnce"), pvc("c", Some("a"), "Filesystem")]),
                MOUNTED,
                "PersistentVolume a is bound to claim ns/other, not to ns/c",
            ),
            (
                "claim and volume modes differ",
                json!([pv("a", None, "Block", "ReadWriteOnce"), pvc("c", Some("a"), "Filesystem")]),
                MOUNTED,
                "asks for volumeMode Filesystem but PersistentVolume a has volumeMode Block",
            ),
            (
                "Block in volumeMounts",
                json!([pv("a", None, "Block", "ReadWriteOnce"), pvc("c", Some("a"), "Block")]),
                MOUNTED,
                "used in volumeMounts but PersistentVolume a has volumeMode Block: use volumeDevices",
            ),
            (
                "Filesystem in volumeDevices",
                json!([pv("a", None, "Filesystem", "ReadWriteOnce"), pvc("c", Some("a"), "Filesystem")]),
                DEVICE,
                "used in volumeDevices but PersistentVolume a has volumeMode Filesystem",
            ),
            (
                "read-only volume written",
                json!([pv("a", None, "Filesystem", "ReadOnlyMany"), pvc("c", Some("a"), "Filesystem")]),
                MOUNTED,
                "allows only ReadOnlyMany but a container mounts it writable: set readOnly: true",
            ),
            (
                "driver without Persistent",
                json!([pv("a", None, "Filesystem", "ReadWriteOnce"), pvc("c", Some("a"), "Filesystem"),
                       {"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": "d.example.com"}, "spec": {"volumeLifecycleModes": ["Ephemeral"]}}]),
                MOUNTED,
                "CSIDriver d.example.com does not list Persistent in spec.volumeLifecycleModes",
            ),
        ];
        for (name, objects, u, want) in rows {
            let err = resolved(objects, "c", u).expect_err(name);
            assert!(err.contains(want), "row {name}: {err}");
        }
        let read_only = Usage {
            written: false,
            ..MOUNTED
        };
        let rox = json!([
            pv("a", None, "Filesystem", "ReadOnlyMany"),
            pvc("c", Some("a"), "Filesystem")
        ]);
        assert!(
            resolved(rox, "c", read_only).is_ok(),
            "read-only mounts of a ReadOnlyMany volume"
        );
    }

    #[test]
    fn local_and_host_path_volumes_are_checked_as_the_api_server_does() {
        let affinity = json!({"required": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["n"]}]}]}});
        let volume = |source: serde_json::Value, affinity: Option<&serde_json::Value>| {
            let mut spec =
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"}});
            spec.as_object_mut()
                .unwrap()
                .extend(source.as_object().unwrap().clone());
            if let Some(a) = affinity {
                spec["nodeAffinity"] = a.clone();
            }
            serde_json::from_value::<PersistentVolume>(
                json!({"metadata": {"name": "pv"}, "spec": spec}),
            )
            .unwrap()
        };
        let rows = [
            (
                json!({"local": {"path": ""}}),
                Some(&affinity),
                "spec.local.path: Required value",
            ),
            (
                json!({"local": {"path": "data"}}),
                Some(&affinity),
                "\"data\": must be an absolute path",
            ),
            (
                json!({"local": {"path": "/mnt/../etc"}}),
                Some(&affinity),
                "must not contain '..'",
            ),
            (
                json!({"local": {"path": "/mnt/disk"}}),
                None,
                "Local volume requires node affinity",
            ),
            (
                json!({"hostPath": {"path": "/srv/x/../../../etc"}}),
                None,
                "spec.hostPath.path: Invalid value: \"/srv/x/../../../etc\": must not contain '..'",
            ),
        ];
        for (source, affinity, want) in rows {
            let err = check_persistent_volume(&volume(source.clone(), affinity)).unwrap_err();
            assert!(
                err.starts_with("PersistentVolume pv is invalid (the API server refuses it too): ")
                    && err.contains(want),
                "row {source}: {err}"
            );
        }
        assert!(check_persistent_volume(&volume(
            json!({"local": {"path": "/mnt/disk"}}),
            Some(&affinity)
        ))
        .is_ok());
        let affinity: k8s_openapi::api::core::v1::VolumeNodeAffinity =
            serde_json::from_value(affinity).unwrap();
        let node = NodeFacts {
            name: "m".into(),
            labels: [("kubernetes.io/hostname".to_string(), "m".to_string())].into(),
        };
        let err =
            check_node_affinity("pv", affinity.required.as_ref().unwrap(), &node).unwrap_err();
        assert_eq!(
            err,
            "PersistentVolume pv is on other nodes: its spec.nodeAffinity requires (kubernetes.io/hostname in (n)), and node m (labels: kubernetes.io/hostname=m) matches none of its terms; run the pod on a node the volume is on, or give this node the label (--node-labels; in cluster mode, on the Node object)"
        );
        let empty = NodeSelector::default();
        assert!(check_node_affinity("pv", &empty, &node)
            .unwrap_err()
            .contains("must have at least one node selector term"));
    }

    #[test]
    fn inline_volumes_need_a_csidriver_that_allows_them() {
        let none = store(json!([]));
        let err = lifecycle_allows(&none, "d.example.com", "Ephemeral").unwrap_err();
        assert!(
            err.contains("has no CSIDriver object")
                && err.contains("volumeLifecycleModes [Ephemeral]"),
            "{err}"
        );
        assert!(lifecycle_allows(&none, "d.example.com", "Persistent").is_ok());
        let both = store(
            json!([{"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": "d.example.com"}, "spec": {"volumeLifecycleModes": ["Persistent", "Ephemeral"]}}]),
        );
        assert!(lifecycle_allows(&both, "d.example.com", "Ephemeral").is_ok());
        let default = store(
            json!([{"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": "d.example.com"}, "spec": {}}]),
        );
        let err = lifecycle_allows(&default, "d.example.com", "Ephemeral").unwrap_err();
        assert!(
            err.contains("does not list Ephemeral") && err.contains("(Persistent)"),
            "{err}"
        );
    }

    #[test]
    fn an_ephemeral_claim_is_the_pods_only_if_the_pod_controls_it() {
        let claim = |owners: serde_json::Value| -> PersistentVolumeClaim {
            serde_json::from_value(json!({"metadata": {"name": "app-v", "namespace": "ns", "ownerReferences": owners}})).unwrap()
        };
        let uid = app().uid.as_str().to_string();
        let by_uid = claim(
            json!([{"apiVersion": "v1", "kind": "Pod", "name": "app", "uid": uid, "controller": true}]),
        );
        let not_controller =
            claim(json!([{"apiVersion": "v1", "kind": "Pod", "name": "app", "uid": uid}]));
        let other_uid = claim(
            json!([{"apiVersion": "v1", "kind": "Pod", "name": "app", "uid": "1b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70", "controller": true}]),
        );
        let by_name =
            claim(json!([{"apiVersion": "v1", "kind": "Pod", "name": "app", "controller": true}]));
        let other_kind = claim(
            json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "app", "controller": true}]),
        );
        for cluster in [true, false] {
            assert!(made_for_pod(&app(), &by_uid, cluster));
            assert!(!made_for_pod(&app(), &not_controller, cluster));
            assert!(!made_for_pod(&app(), &other_uid, cluster));
            assert!(!made_for_pod(&app(), &other_kind, cluster));
            assert!(!made_for_pod(&app(), &claim(json!([])), cluster));
        }
        // A claim of the manifests may name its pod without a UID; the API server's never.
        assert!(made_for_pod(&app(), &by_name, false));
        assert!(!made_for_pod(&app(), &by_name, true));
        let v: Volume = serde_json::from_value(
            json!({"name": "v", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}),
        )
        .unwrap();
        assert_eq!(
            kubevol_core::names::claim_name("app", &v).as_deref(),
            Some("app-v")
        );
        assert_eq!(
            kubevol_core::names::claim_name("app", &volume("c")).as_deref(),
            Some("c")
        );
    }
}
