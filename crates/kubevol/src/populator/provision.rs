//! Storage classes and provisioning in standalone mode: what a cluster's default-class
//! admission and external provisioners do for a claim that no existing volume fits.
//!
//! A claim that names no class gets the default one: the StorageClass of the manifests
//! annotated `storageclass.kubernetes.io/is-default-class: "true"` (the newest, if several),
//! else kubevol's own `local-path` class. A claim whose class's provisioner is
//! `kubevol.io/local-path` gets a directory of its own under the node's local-path directory,
//! served as a `local` PersistentVolume of this node, named `pvc-<claim UID>` as an external
//! provisioner names it, with the claim's request, access modes and class and the class's
//! reclaim policy. The volume is recorded, and bound to its claim, in one write of
//! `bindings.json` before anything uses it.

use std::os::unix::fs::PermissionsExt as _;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use serde_json::json;

use crate::plugins::PluginHost;
use crate::store::{claim_uid, ObjectStore};

/// The built-in provisioner: directories on this node.
pub const LOCAL_PATH_PROVISIONER: &str = "kubevol.io/local-path";

/// The built-in class, the default where the manifests mark none.
pub const LOCAL_PATH_CLASS: &str = "local-path";

/// The annotation that makes a StorageClass the default.
pub const DEFAULT_CLASS_ANNOTATION: &str = "storageclass.kubernetes.io/is-default-class";

/// The annotation a provisioned volume names its provisioner by.
pub const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";

/// The default class: the newest StorageClass marked default (then the first by name), else
/// the built-in `local-path`.
pub fn default_class(store: &ObjectStore) -> String {
    let mut marked: Vec<Arc<StorageClass>> = store
        .storage_classes()
        .into_iter()
        .filter(|c| c.invalid.is_none())
        .map(|c| c.object)
        .filter(|c| {
            c.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(DEFAULT_CLASS_ANNOTATION))
                .is_some_and(|v| v == "true")
        })
        .collect();
    marked.sort_by(|a, b| {
        let created = |c: &StorageClass| c.metadata.creation_timestamp.as_ref().map(|t| t.0);
        created(b)
            .cmp(&created(a))
            .then_with(|| a.metadata.name.cmp(&b.metadata.name))
    });
    marked
        .first()
        .and_then(|c| c.metadata.name.clone())
        .unwrap_or_else(|| LOCAL_PATH_CLASS.to_string())
}

/// The class a claim's volume must have: the one it names, else the default.
pub fn class_of(store: &ObjectStore, claim: &PersistentVolumeClaim) -> String {
    match kubevol_core::binding::named_class(claim) {
        Some(c) => c.to_string(),
        None => default_class(store),
    }
}

/// A StorageClass by name: the manifests', else the built-in one for `local-path`.
pub fn storage_class(store: &ObjectStore, name: &str) -> Option<Arc<StorageClass>> {
    let defined = store
        .storage_classes()
        .into_iter()
        .find(|c| c.object.metadata.name.as_deref() == Some(name))
        .map(|c| c.object);
    defined.or_else(|| {
        (name == LOCAL_PATH_CLASS).then(|| {
            Arc::new(StorageClass {
                metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                    name: Some(LOCAL_PATH_CLASS.into()),
                    ..Default::default()
                },
                provisioner: LOCAL_PATH_PROVISIONER.into(),
                reclaim_policy: Some("Delete".into()),
                volume_binding_mode: Some("WaitForFirstConsumer".into()),
                ..Default::default()
            })
        })
    })
}

/// Provisions a volume of `class` for claim `namespace/name` and binds them; returns the
/// volume's name, or why it cannot be made (a message for the claim's pods).
pub fn provision(
    host: &PluginHost,
    namespace: &str,
    name: &str,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
) -> Result<String, String> {
    let class_name = class.metadata.name.clone().unwrap_or_default();
    if class.provisioner != LOCAL_PATH_PROVISIONER {
        return Err(match host.csi.controller_client(&class.provisioner) {
            Some(_) => start_csi(host, namespace, name, claim, class),
            None => format!(
                "StorageClass {class_name} is provisioned by {}, which kubevol does not run: kubevol runs {LOCAL_PATH_PROVISIONER}, and the CSI drivers whose controller service it is given (--csi-controller {}=unix:///…); add a PersistentVolume that fits the claim, or use another class",
                class.provisioner, class.provisioner
            ),
        });
    }
    let spec = claim.spec.clone().unwrap_or_default();
    if spec.volume_mode.as_deref() == Some("Block") {
        return Err(format!(
            "StorageClass {class_name} ({LOCAL_PATH_PROVISIONER}) makes directories, not block devices: use volumeMode Filesystem, or add a Block PersistentVolume that fits the claim"
        ));
    }
    if spec.data_source.is_some() || spec.data_source_ref.is_some() {
        return Err(format!(
            "StorageClass {class_name} ({LOCAL_PATH_PROVISIONER}) cannot fill a volume from a dataSource: remove it, or add a PersistentVolume that fits the claim"
        ));
    }
    let request = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .map(|q| q.0.clone())
        .ok_or_else(|| {
            "the claim asks for no storage (resources.requests.storage): set it".to_string()
        })?;
    let uid = claim_uid(claim);
    let volume = format!("pvc-{uid}");
    let dir = host
        .local_path_dir
        .join(format!("{volume}_{namespace}_{name}"));
    let made = |e: std::io::Error| {
        format!(
            "cannot make the directory {} of a {LOCAL_PATH_PROVISIONER} volume: {e}",
            dir.display()
        )
    };
    std::fs::create_dir_all(&host.local_path_dir).map_err(made)?;
    match std::fs::create_dir(&dir) {
        // Made before a crash, and never recorded: still empty, and this claim's.
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(made(e)),
    }
    // Any container user may write, as the local-path provisioners make them.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).map_err(made)?;
    let access_modes = spec
        .access_modes
        .clone()
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| vec!["ReadWriteOnce".into()]);
    let pv: PersistentVolume = serde_json::from_value(json!({
        "metadata": {
            "name": volume,
            "annotations": {PROVISIONED_BY: LOCAL_PATH_PROVISIONER},
        },
        "spec": {
            "capacity": {"storage": request},
            "accessModes": access_modes,
            "persistentVolumeReclaimPolicy": class.reclaim_policy.clone().unwrap_or_else(|| "Delete".into()),
            "storageClassName": class_name,
            "volumeMode": "Filesystem",
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": namespace, "name": name, "uid": claim.metadata.uid},
            "local": {"path": dir},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [host.node_name]}]}]}},
        },
    }))
    .map_err(|e| format!("cannot describe the provisioned volume: {e}"))?;
    host.store
        .bindings()
        .provision(namespace, name, pv.clone())
        .map_err(|e| {
            format!("PersistentVolumeClaim {namespace}/{name} cannot be bound to the volume provisioned for it ({volume}): {e}")
        })?;
    host.store.add_provisioned([pv]);
    tracing::info!(claim = %format!("{namespace}/{name}"), %volume, class = %class_name, dir = %dir.display(), "volume provisioned");
    Ok(volume)
}

/// Grows the volume kubevol provisioned for claim `namespace/name` when the claim asks for
/// more than it has, as the external-resizer does: where the volume's class allows expansion
/// (`allowVolumeExpansion: true`), its recorded capacity becomes the claim's request, and the
/// volume is then expanded by its driver (ControllerExpandVolume, then NodeExpandVolume) as any
/// volume whose capacity grew. A smaller request changes nothing (a volume never shrinks).
pub fn grow(
    host: &PluginHost,
    namespace: &str,
    claim: &PersistentVolumeClaim,
) -> Result<(), String> {
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    let bindings = host.store.bindings();
    let Some(volume) = bindings.volume_of(namespace, name) else {
        return Ok(());
    };
    let Some(mut pv) = bindings
        .provisioned()
        .into_iter()
        .find(|pv| pv.metadata.name.as_deref() == Some(volume.as_str()))
    else {
        return Ok(());
    };
    let Some(request) = claim
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .cloned()
    else {
        return Ok(());
    };
    let want = kubevol_core::quantity::Quantity::parse(&request.0).map_or(0, |q| q.value());
    if want <= kubevol_core::binding::capacity(&pv) {
        return Ok(());
    }
    let class_name = kubevol_core::binding::volume_class(&pv).to_string();
    let allowed = storage_class(&host.store, &class_name)
        .is_some_and(|c| c.allow_volume_expansion == Some(true));
    if !allowed {
        return Err(format!(
            "PersistentVolumeClaim {namespace}/{name} asks for {} but its volume {volume} has {}, and StorageClass {class_name} does not allow volume expansion (allowVolumeExpansion: true): set it, or ask for no more than the volume has",
            request.0,
            pv.spec.as_ref().and_then(|s| s.capacity.as_ref()).and_then(|c| c.get("storage")).map(|q| q.0.clone()).unwrap_or_default()
        ));
    }
    if let Some(spec) = pv.spec.as_mut() {
        spec.capacity
            .get_or_insert_with(Default::default)
            .insert("storage".into(), request.clone());
    }
    bindings
        .update_provisioned(pv.clone())
        .map_err(|e| format!("the grown volume {volume} cannot be recorded: {e}"))?;
    host.store.add_provisioned([pv]);
    tracing::info!(claim = %format!("{namespace}/{name}"), %volume, size = %request.0, "provisioned volume grown to the claim's request");
    Ok(())
}

/// The prefix of the StorageClass parameters meant for the provisioner itself, not the driver.
const RESERVED_PARAMETERS: &str = "csi.storage.k8s.io/";

/// The parameter that gives a CSI volume's filesystem.
const FSTYPE_PARAMETER: &str = "csi.storage.k8s.io/fstype";

/// Starts creating the volume of claim `namespace/name` with the CSI driver of `class` (once:
/// a call already out is waited for), and says what the claim waits for. When the call ends,
/// the volume is recorded and bound (and the store's change brings the claim's pods back), or
/// the pods are looked at again after a backoff.
fn start_csi(
    host: &PluginHost,
    namespace: &str,
    name: &str,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
) -> String {
    let volume = format!("pvc-{}", claim_uid(claim));
    let driver = class.provisioner.clone();
    let waiting = format!(
        "waiting for CSI driver {driver} to create volume {volume} (CreateVolume) for StorageClass {}",
        class.metadata.name.as_deref().unwrap_or_default()
    );
    let bindings = host.store.bindings();
    let Some(before) = bindings.start_creating(namespace, name) else {
        return waiting;
    };
    let host = Arc::new(HostRef {
        store: host.store.clone(),
        csi: host.csi.clone(),
        node_name: host.node_name.clone(),
    });
    let (ns, claim_name) = (namespace.to_string(), name.to_string());
    let (claim, class) = (claim.clone(), class.clone());
    tokio::spawn(async move {
        let result = create_csi(&host, &ns, &claim_name, &claim, &class).await;
        let failures = host
            .store
            .bindings()
            .finish_creating(&ns, &claim_name, result.err());
        if failures > 0 {
            // Looked at again after a backoff: 1 s, doubling to a minute.
            let delay = std::time::Duration::from_secs(1 << failures.min(6))
                .min(std::time::Duration::from_secs(60));
            tokio::time::sleep(delay).await;
            host.store.touch_claim(&ns, &claim_name);
        }
    });
    match before.last_error {
        Some(e) => format!("{waiting}; the last attempt failed: {e}"),
        None => waiting,
    }
}

/// What a CSI creation needs of the host, owned (it outlives the pass that started it).
struct HostRef {
    store: Arc<ObjectStore>,
    csi: Arc<crate::csi::Drivers>,
    node_name: String,
}

/// Creates the volume of claim `namespace/name` with the CSI driver of `class`, as the
/// external-provisioner does (name `pvc-<claim UID>`, the claim's request, access mode and
/// volume mode, the class's parameters, this node's topology), then records and binds it.
async fn create_csi(
    host: &HostRef,
    namespace: &str,
    name: &str,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
) -> Result<(), String> {
    use kubevol_csi::v1::{
        volume_capability, CapacityRange, CreateVolumeRequest, TopologyRequirement,
        VolumeCapability,
    };
    let driver = &class.provisioner;
    let class_name = class.metadata.name.clone().unwrap_or_default();
    let spec = claim.spec.clone().unwrap_or_default();
    let volume = format!("pvc-{}", claim_uid(claim));
    let request = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .ok_or("the claim asks for no storage (resources.requests.storage): set it")?;
    let bytes = kubevol_core::quantity::Quantity::parse(&request.0)
        .map_err(|e| format!("its request {}: {e}", request.0))?
        .value();
    let parameters = class.parameters.clone().unwrap_or_default();
    let fs_type = parameters
        .get(FSTYPE_PARAMETER)
        .cloned()
        .unwrap_or_default();
    let block = spec.volume_mode.as_deref() == Some("Block");
    let node = host
        .csi
        .get(driver)
        .ok_or_else(|| format!("CSI driver {driver} is not registered on this node (its node plugin must be, for its topology)"))?;
    let access_modes = spec
        .access_modes
        .clone()
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| vec!["ReadWriteOnce".into()]);
    let capability = VolumeCapability {
        access_type: Some(if block {
            volume_capability::AccessType::Block(volume_capability::BlockVolume {})
        } else {
            volume_capability::AccessType::Mount(volume_capability::MountVolume {
                fs_type: fs_type.clone(),
                ..Default::default()
            })
        }),
        access_mode: Some(volume_capability::AccessMode {
            mode: crate::plugins::csi::csi_access_mode(
                access_modes.first().map(String::as_str),
                node.capabilities.single_node_multi_writer,
            ),
        }),
    };
    let topology = (!node.topology.is_empty()).then(|| {
        let here = kubevol_csi::v1::Topology {
            segments: node.topology.clone().into_iter().collect(),
        };
        TopologyRequirement {
            requisite: vec![here.clone()],
            preferred: vec![here],
        }
    });
    let Some(mut client) = host.csi.controller_client(driver) else {
        return Err(format!(
            "no controller service of CSI driver {driver} is given (--csi-controller)"
        ));
    };
    let created = host
        .csi
        .call(
            driver,
            "Controller",
            "CreateVolume",
            client.create_volume(CreateVolumeRequest {
                name: volume.clone(),
                capacity_range: Some(CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![capability],
                parameters: parameters
                    .iter()
                    .filter(|(k, _)| !k.starts_with(RESERVED_PARAMETERS))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                accessibility_requirements: topology,
                ..Default::default()
            }),
        )
        .await
        .map_err(|e| e.to_string())?
        .volume
        .ok_or_else(|| format!("CSI driver {driver} created no volume"))?;
    let capacity = if created.capacity_bytes > 0 {
        created.capacity_bytes.to_string()
    } else {
        request.0.clone()
    };
    let affinity: Vec<serde_json::Value> = created
        .accessible_topology
        .iter()
        .map(|t| {
            json!({"matchExpressions": t.segments.iter().map(|(k, v)| json!({"key": k, "operator": "In", "values": [v]})).collect::<Vec<_>>()})
        })
        .collect();
    let mut pv = json!({
        "metadata": {"name": volume, "annotations": {PROVISIONED_BY: driver}},
        "spec": {
            "capacity": {"storage": capacity},
            "accessModes": access_modes,
            "persistentVolumeReclaimPolicy": class.reclaim_policy.clone().unwrap_or_else(|| "Delete".into()),
            "storageClassName": class_name,
            "volumeMode": if block { "Block" } else { "Filesystem" },
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": namespace, "name": name, "uid": claim.metadata.uid},
            "csi": {"driver": driver, "volumeHandle": created.volume_id, "volumeAttributes": created.volume_context},
        },
    });
    if !fs_type.is_empty() && !block {
        pv["spec"]["csi"]["fsType"] = json!(fs_type);
    }
    if !affinity.is_empty() {
        pv["spec"]["nodeAffinity"] = json!({"required": {"nodeSelectorTerms": affinity}});
    }
    let pv: PersistentVolume = serde_json::from_value(pv)
        .map_err(|e| format!("cannot describe the created volume: {e}"))?;
    host.store
        .bindings()
        .provision(namespace, name, pv.clone())
        .map_err(|e| format!("the created volume {volume} cannot be recorded: {e}"))?;
    host.store.add_provisioned([pv]);
    tracing::info!(claim = %format!("{namespace}/{name}"), %volume, %driver, node = %host.node_name, "volume provisioned by CSI driver");
    Ok(())
}

/// Makes the claims of `pod`'s generic ephemeral volumes that nothing defines, as the
/// ephemeral-volume controller makes them: `<pod>-<volume>` in the pod's namespace, from the
/// volume's `volumeClaimTemplate` (its labels, annotations and spec), controlled by the pod.
/// They go with the pod ([`ObjectStore::remove_claims_made_for`]), and their provisioned
/// volumes by their reclaim policy.
pub fn make_ephemeral_claims(store: &ObjectStore, pod: &k8s_openapi::api::core::v1::Pod) {
    let ns = pod
        .metadata
        .namespace
        .as_deref()
        .unwrap_or(crate::store::DEFAULT_NAMESPACE);
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let mut made = Vec::new();
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let Some(template) = v
            .ephemeral
            .as_ref()
            .and_then(|e| e.volume_claim_template.as_ref())
        else {
            continue;
        };
        let name = format!("{pod_name}-{}", v.name);
        if store.persistent_volume_claim(ns, &name).is_some()
            || store
                .not_loaded("PersistentVolumeClaim", ns, &name)
                .is_some()
        {
            continue;
        }
        let meta = template.metadata.clone().unwrap_or_default();
        made.push(PersistentVolumeClaim {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name),
                namespace: Some(ns.to_string()),
                labels: meta.labels,
                annotations: meta.annotations,
                owner_references: Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                        api_version: "v1".into(),
                        kind: "Pod".into(),
                        name: pod_name.to_string(),
                        uid: uid.to_string(),
                        controller: Some(true),
                        block_owner_deletion: Some(true),
                    },
                ]),
                ..Default::default()
            },
            spec: Some(template.spec.clone()),
            status: None,
        });
    }
    if !made.is_empty() {
        tracing::info!(pod = %format!("{ns}/{pod_name}"), claims = made.len(), "claims made for generic ephemeral volumes");
        store.add_made_claims(made);
    }
}

/// The provisioned volumes to delete now: of reclaim policy `Delete`, whose claim is gone for
/// good (every source synced and readable, and no broken manifest file that defined the claim
/// holds it back), that no pod wants or has mounted, and that are not being deleted already.
/// Each is marked as being deleted (nothing may mount it meanwhile) before it is returned.
pub fn to_reclaim(store: &ObjectStore, world: &crate::world::World) -> Vec<(String, String)> {
    let bindings = store.bindings();
    let gone: Vec<(String, String)> = bindings
        .provisioned()
        .into_iter()
        .filter_map(|pv| {
            let spec = pv.spec?;
            let claim = spec.claim_ref?;
            let (ns, claim) = (claim.namespace?, claim.name?);
            let gone = store.persistent_volume_claim(&ns, &claim).is_none()
                && store
                    .not_loaded("PersistentVolumeClaim", &ns, &claim)
                    .is_none();
            let name = pv.metadata.name?;
            (spec.persistent_volume_reclaim_policy.as_deref() == Some("Delete")
                && gone
                && !bindings.is_releasing(&name))
            .then(|| (name, format!("{ns}/{claim}")))
        })
        .collect();
    if gone.is_empty()
        || !world.states_synced()
        || !store.all_sources_synced()
        || !store.source_problems().is_empty()
    {
        return Vec::new();
    }
    let in_use: std::collections::BTreeSet<String> = {
        let name = |spec: &kubevol_core::state::VolumeSpec| {
            spec.persistent_volume
                .as_ref()
                .and_then(|pv| pv.metadata.name.clone())
        };
        let dsw = world.dsw();
        let asw = world.asw();
        let wanted = dsw
            .volumes()
            .flat_map(|v| v.pods.values().filter_map(|p| name(&p.spec)));
        let mounted = asw
            .volumes()
            .filter_map(|v| v.spec.as_deref().and_then(name));
        wanted.chain(mounted).collect()
    };
    gone.into_iter()
        .filter(|(name, _)| !in_use.contains(name) && bindings.start_release(name))
        .collect()
}

/// Whether claims of class `class` are bound (or get a volume) at once rather than when a pod
/// first uses them: `volumeBindingMode: Immediate`, the API's default, and the behaviour of the
/// PersistentVolume controller for a class that no StorageClass defines.
fn binds_at_once(store: &ObjectStore, class: &str) -> bool {
    storage_class(store, class)
        .is_none_or(|c| c.volume_binding_mode.as_deref() != Some("WaitForFirstConsumer"))
}

/// Binds, or provisions for, the unbound claims of the manifests and the library whose class
/// binds at once, as the PersistentVolume controller does without waiting for a pod. A claim
/// that cannot be bound yet is looked at again at the next change (its pods, if any, say why).
pub fn bind_at_once(host: &PluginHost) {
    let store = &host.store;
    for claim in store.persistent_volume_claims() {
        if claim.origin == crate::store::Origin::Cluster
            || claim.invalid.is_some()
            || crate::store::claim_volume(&claim.object).is_some()
        {
            continue;
        }
        let c = &claim.object;
        let ns = c
            .metadata
            .namespace
            .as_deref()
            .unwrap_or(crate::store::DEFAULT_NAMESPACE);
        let name = c.metadata.name.as_deref().unwrap_or_default();
        if store.bindings().volume_of(ns, name).is_some()
            || !binds_at_once(store, &class_of(store, c))
        {
            continue;
        }
        if let Err(e) = super::claims::bind_claim(host, ns, name, c) {
            tracing::debug!(claim = %format!("{ns}/{name}"), "not bound yet: {e}");
        }
    }
}

/// Binds the claims that bind at once, and deletes the provisioned volumes of removed claims
/// as they become unused: looks again at every change of the objects (both) or of either state
/// of world (deletions), until `stop`.
pub async fn storage_loop(
    host: Arc<PluginHost>,
    world: Arc<crate::world::World>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut objects = host.store.subscribe();
    let mut states = world.subscribe();
    let mut objects_changed = true;
    loop {
        if objects_changed && world.states_synced() {
            objects_changed = false;
            bind_at_once(&host);
        }
        for (name, claim) in to_reclaim(&host.store, &world) {
            let host = host.clone();
            let csi = host
                .store
                .bindings()
                .provisioned()
                .into_iter()
                .find(|pv| pv.metadata.name.as_deref() == Some(name.as_str()))
                .and_then(|pv| pv.spec?.csi);
            match csi {
                Some(csi) => {
                    tokio::spawn(async move { reclaim_csi(&host, &name, &claim, csi).await });
                }
                None => {
                    tokio::task::spawn_blocking(move || reclaim(&host, &name, &claim));
                }
            }
        }
        tokio::select! {
            r = objects.changed() => {
                if r.is_err() {
                    return;
                }
                objects_changed = true;
            }
            r = states.changed() => if r.is_err() { return },
            _ = stop.changed() => return,
        }
    }
}

/// Deletes provisioned volume `name` of a CSI driver (its claim `claim` is gone, and it is
/// neither mounted, staged nor attached any more): DeleteVolume, then its record and binding,
/// then the store's object. A failure is logged and tried again at the next change.
async fn reclaim_csi(
    host: &PluginHost,
    name: &str,
    claim: &str,
    csi: k8s_openapi::api::core::v1::CSIPersistentVolumeSource,
) {
    let store = &host.store;
    crate::record::fail_point("reclaim", "before");
    let deleted = match host.csi.controller_client(&csi.driver) {
        Some(mut client) => host
            .csi
            .call(
                &csi.driver,
                "Controller",
                "DeleteVolume",
                client.delete_volume(kubevol_csi::v1::DeleteVolumeRequest {
                    volume_id: csi.volume_handle.clone(),
                    ..Default::default()
                }),
            )
            .await
            .map(drop)
            .map_err(|e| e.to_string()),
        None => Err(format!(
            "no controller service of CSI driver {} is given (--csi-controller)",
            csi.driver
        )),
    };
    forget_deleted(store, name, claim, deleted);
}

/// After the deletion of provisioned volume `name` of claim `claim`: forgotten (its record,
/// its binding, the store's object) if it went; else given up until the next change.
fn forget_deleted(store: &ObjectStore, name: &str, claim: &str, deleted: Result<(), String>) {
    if let Err(e) = deleted {
        tracing::warn!(volume = %name, %claim, "the provisioned volume of a removed claim cannot be deleted: {e}; tried again at the next change");
        let _ = store.bindings().finish_release(name, false);
        return;
    }
    crate::record::fail_point("reclaim", "after");
    if let Err(e) = store.bindings().finish_release(name, true) {
        tracing::warn!(volume = %name, "the deleted volume cannot be forgotten: {e}; tried again at the next change");
        return;
    }
    store.remove_provisioned(name);
    tracing::info!(volume = %name, %claim, "provisioned volume deleted: its claim is gone (reclaim policy Delete)");
}

/// Deletes provisioned volume `name` (its claim `claim` is gone; [`to_reclaim`] chose it):
/// its directory, on its own filesystem only (a mount inside it stops the removal), then its
/// record and binding, then the store's object. A failure is logged and tried again at the
/// next look.
pub fn reclaim(host: &PluginHost, name: &str, claim: &str) {
    let store = &host.store;
    let Some(pv) = store
        .bindings()
        .provisioned()
        .into_iter()
        .find(|pv| pv.metadata.name.as_deref() == Some(name))
    else {
        let _ = store.bindings().finish_release(name, false);
        return;
    };
    let dir = pv
        .spec
        .as_ref()
        .and_then(|s| s.local.as_ref())
        .map(|l| std::path::PathBuf::from(&l.path));
    crate::record::fail_point("reclaim", "before");
    let removed = match dir {
        Some(dir) if dir.parent() == Some(host.local_path_dir.as_path()) => {
            let leaf = dir.file_name().map(|n| n.to_string_lossy().into_owned());
            kubevol_mount::safe::Dir::open(&host.local_path_dir)
                .and_then(|d| d.remove_dir_all_one_fs(&leaf.unwrap_or_default()))
                .map_err(|e| e.to_string())
        }
        Some(dir) => Err(format!(
            "its directory {} is not in the local-path directory {}: left alone",
            dir.display(),
            host.local_path_dir.display()
        )),
        None => Ok(()),
    };
    forget_deleted(store, name, claim, removed);
}
