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

use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use serde_json::json;

use crate::plugins::PluginHost;
use crate::store::{claim_uid, Creating, Object, ObjectStore};

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

/// What a claim asks a provisioner for.
struct Ask {
    /// Its storage request as written, and in bytes.
    request: String,
    bytes: i64,
    /// Its access modes (`ReadWriteOnce` where it names none).
    access_modes: Vec<String>,
    /// `volumeMode: Block`.
    block: bool,
}

impl Ask {
    fn of(claim: &PersistentVolumeClaim) -> Result<Ask, String> {
        let (bytes, request) = kubevol_core::binding::requested(claim).ok_or(
            "the claim asks for no storage (resources.requests.storage): set it".to_string(),
        )?;
        let spec = claim.spec.as_ref();
        Ok(Ask {
            request,
            bytes,
            access_modes: spec
                .and_then(|s| s.access_modes.clone())
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| vec!["ReadWriteOnce".into()]),
            block: spec.and_then(|s| s.volume_mode.as_deref()) == Some("Block"),
        })
    }
}

/// The volume a provisioner makes for `claim` (`pvc-<claim UID>`, as the external-provisioner
/// names it).
fn volume_name(claim: &PersistentVolumeClaim) -> String {
    format!("pvc-{}", claim_uid(claim))
}

/// The PersistentVolume of volume `volume`, provisioned by `by` for claim `namespace/name` of
/// `class`: what every provisioner writes (the claim's access modes and volume mode, the
/// class's name and reclaim policy, a claimRef), with `capacity`, the volume `source` (its
/// field and value: `local` or `csi`) and the node selector terms that say where it is.
#[allow(clippy::too_many_arguments)]
fn provisioned_volume(
    namespace: &str,
    name: &str,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    ask: &Ask,
    (volume, by, capacity): (&str, &str, &str),
    (field, source): (&str, serde_json::Value),
    terms: Vec<serde_json::Value>,
) -> Result<PersistentVolume, String> {
    let mut pv = json!({
        "metadata": {"name": volume, "annotations": {PROVISIONED_BY: by}},
        "spec": {
            "capacity": {"storage": capacity},
            "accessModes": ask.access_modes,
            "persistentVolumeReclaimPolicy": class.reclaim_policy.clone().unwrap_or_else(|| "Delete".into()),
            "storageClassName": class.metadata.name,
            "volumeMode": if ask.block { "Block" } else { "Filesystem" },
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": namespace, "name": name, "uid": claim_uid(claim)},
        },
    });
    pv["spec"][field] = source;
    if !terms.is_empty() {
        pv["spec"]["nodeAffinity"] = json!({"required": {"nodeSelectorTerms": terms}});
    }
    serde_json::from_value(pv).map_err(|e| format!("cannot describe the provisioned volume: {e}"))
}

/// Records `pv`, provisioned for claim `namespace/name`, bound to it (one write), then puts it
/// in the store.
fn record(
    store: &ObjectStore,
    namespace: &str,
    name: &str,
    pv: PersistentVolume,
) -> Result<(), String> {
    let volume = pv.metadata.name.clone().unwrap_or_default();
    let uid = pv
        .spec
        .as_ref()
        .and_then(|s| s.claim_ref.as_ref()?.uid.clone())
        .unwrap_or_default();
    store
        .bindings()
        .provision(namespace, name, &uid, pv.clone())
        .map_err(|e| {
            format!("PersistentVolumeClaim {namespace}/{name} cannot be bound to the volume provisioned for it ({volume}): {e}")
        })?;
    store.add_provisioned([Object::PersistentVolume(pv)]);
    Ok(())
}

/// Provisions a volume of `class` for claim `namespace/name` and binds them; returns the
/// volume's name, or why it cannot be made (a message for the claim's pods).
pub fn provision(
    host: &Arc<PluginHost>,
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
    let ask = Ask::of(claim)?;
    if ask.block {
        return Err(format!(
            "StorageClass {class_name} ({LOCAL_PATH_PROVISIONER}) makes directories, not block devices: use volumeMode Filesystem, or add a Block PersistentVolume that fits the claim"
        ));
    }
    if claim
        .spec
        .as_ref()
        .is_some_and(|s| s.data_source.is_some() || s.data_source_ref.is_some())
    {
        return Err(format!(
            "StorageClass {class_name} ({LOCAL_PATH_PROVISIONER}) cannot fill a volume from a dataSource: remove it, or add a PersistentVolume that fits the claim"
        ));
    }
    let volume = volume_name(claim);
    let dir = local_path_directory(host, &volume, namespace, name)?;
    let here = json!({"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": [host.node_name]}]});
    let pv = provisioned_volume(
        namespace,
        name,
        claim,
        class,
        &ask,
        (&volume, LOCAL_PATH_PROVISIONER, &ask.request),
        ("local", json!({"path": dir})),
        vec![here],
    )?;
    record(&host.store, namespace, name, pv)?;
    tracing::info!(claim = %format!("{namespace}/{name}"), %volume, class = %class_name, dir = %dir.display(), "volume provisioned");
    Ok(volume)
}

/// Makes the directory of the `local-path` volume `volume` for claim `namespace/name`,
/// `<local-path dir>/<volume>_<namespace>_<name>`, with mode 0777 (any container user may
/// write, as the local-path provisioners make them): relative to the local-path directory's
/// descriptor, never through a link. One that is there already is taken only when it is empty
/// (made before a crash and never recorded); one with anything in it is not this claim's to
/// take, and is left alone. Returns its path.
fn local_path_directory(
    host: &PluginHost,
    volume: &str,
    namespace: &str,
    name: &str,
) -> Result<std::path::PathBuf, String> {
    let leaf = kubevol_core::names::PathName::new(
        "the directory of a local-path volume",
        &format!("{volume}_{namespace}_{name}"),
    )
    .map_err(|e| e.to_string())?;
    let path = host.local_path_dir.join(&leaf);
    let made = |e: kubevol_mount::MountError| {
        format!(
            "cannot make the directory {} of a {LOCAL_PATH_PROVISIONER} volume: {e}",
            path.display()
        )
    };
    let base = kubevol_mount::safe::Dir::open(&host.local_path_dir).map_err(made)?;
    let (dir, created) = base.make_child(leaf.as_ref(), 0o777).map_err(made)?;
    if !created {
        if !dir.is_empty().map_err(made)? {
            return Err(format!(
                "the directory {} of a {LOCAL_PATH_PROVISIONER} volume is there already and holds files: kubevol takes only an empty one (made before a crash) and never another's data; move it away, or remove it if nobody needs it",
                path.display()
            ));
        }
        dir.chmod(0o777).map_err(made)?;
    }
    Ok(path)
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
    let Some(volume) = bindings.volume_of(namespace, name, &claim_uid(claim)) else {
        return Ok(());
    };
    let Some(mut pv) = bindings.provisioned_volume(&volume) else {
        return Ok(());
    };
    let Some((want, request)) = kubevol_core::binding::requested(claim) else {
        return Ok(());
    };
    if want <= kubevol_core::binding::capacity(&pv) {
        return Ok(());
    }
    let class_name = kubevol_core::binding::volume_class(&pv).to_string();
    let allowed = storage_class(&host.store, &class_name)
        .is_some_and(|c| c.allow_volume_expansion == Some(true));
    if !allowed {
        return Err(format!(
            "PersistentVolumeClaim {namespace}/{name} asks for {request} but its volume {volume} has {}, and StorageClass {class_name} does not allow volume expansion (allowVolumeExpansion: true): set it, or ask for no more than the volume has",
            pv.spec.as_ref().and_then(|s| s.capacity.as_ref()).and_then(|c| c.get("storage")).map(|q| q.0.clone()).unwrap_or_default()
        ));
    }
    if let Some(spec) = pv.spec.as_mut() {
        spec.capacity.get_or_insert_with(Default::default).insert(
            "storage".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity(request.clone()),
        );
    }
    bindings
        .update_provisioned(pv.clone())
        .map_err(|e| format!("the grown volume {volume} cannot be recorded: {e}"))?;
    host.store.add_provisioned([Object::PersistentVolume(pv)]);
    tracing::info!(claim = %format!("{namespace}/{name}"), %volume, size = %request, "provisioned volume grown to the claim's request");
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
    host: &Arc<PluginHost>,
    namespace: &str,
    name: &str,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
) -> String {
    let volume = volume_name(claim);
    let driver = class.provisioner.clone();
    let waiting = format!(
        "waiting for CSI driver {driver} to create volume {volume} (CreateVolume) for StorageClass {}",
        class.metadata.name.as_deref().unwrap_or_default()
    );
    let bindings = host.store.bindings();
    // What the claim waits for, with the last failure while a call is out or backing off.
    let said = |c: Option<Creating>| match c.and_then(|c| c.last_error) {
        Some(e) => format!("{waiting}; the last attempt failed: {e}"),
        None => waiting.clone(),
    };
    let Some(before) = bindings.start_creating(namespace, name) else {
        return said(bindings.creating(namespace, name));
    };
    let host = host.clone();
    let (ns, claim_name) = (namespace.to_string(), name.to_string());
    let (claim, class) = (claim.clone(), class.clone());
    tokio::spawn(async move {
        let result = create_csi(&host, &ns, &claim_name, &claim, &class).await;
        let retry = host
            .store
            .bindings()
            .finish_creating(&ns, &claim_name, result.err());
        // Looked at again once the backoff has passed (nothing starts a call before).
        if let Some(delay) = retry {
            tokio::time::sleep(delay).await;
            host.store.touch_claim(&ns, &claim_name);
        }
    });
    said(Some(before))
}

/// Creates the volume of claim `namespace/name` with the CSI driver of `class`, as the
/// external-provisioner does (name `pvc-<claim UID>`, the claim's request, access mode and
/// volume mode, the class's parameters, this node's topology), then records and binds it.
async fn create_csi(
    host: &PluginHost,
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
    let volume = volume_name(claim);
    let ask = Ask::of(claim)?;
    let parameters = class.parameters.clone().unwrap_or_default();
    let fs_type = parameters
        .get(FSTYPE_PARAMETER)
        .cloned()
        .unwrap_or_default();
    let node = host
        .csi
        .get(driver)
        .ok_or_else(|| format!("CSI driver {driver} is not registered on this node (its node plugin must be, for its topology)"))?;
    let capability = VolumeCapability {
        access_type: Some(if ask.block {
            volume_capability::AccessType::Block(volume_capability::BlockVolume {})
        } else {
            volume_capability::AccessType::Mount(volume_capability::MountVolume {
                fs_type: fs_type.clone(),
                ..Default::default()
            })
        }),
        access_mode: Some(volume_capability::AccessMode {
            mode: crate::plugins::csi::csi_access_mode(
                ask.access_modes.first().map(String::as_str),
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
                    required_bytes: ask.bytes,
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
        ask.request.clone()
    };
    let terms = created
        .accessible_topology
        .iter()
        .map(|t| {
            json!({"matchExpressions": t.segments.iter().map(|(k, v)| json!({"key": k, "operator": "In", "values": [v]})).collect::<Vec<_>>()})
        })
        .collect();
    let mut source = json!({"driver": driver, "volumeHandle": created.volume_id, "volumeAttributes": created.volume_context});
    if !fs_type.is_empty() && !ask.block {
        source["fsType"] = json!(fs_type);
    }
    let pv = provisioned_volume(
        namespace,
        name,
        claim,
        class,
        &ask,
        (&volume, driver, &capacity),
        ("csi", source),
        terms,
    )?;
    record(&host.store, namespace, name, pv)?;
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
                uid: Some(crate::store::ephemeral_claim_uid(uid, &v.name)),
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
        store.add_provisioned(made.into_iter().map(Object::PersistentVolumeClaim));
    }
}

/// A provisioned volume to delete, and its claim (`namespace/name`), which is gone.
pub struct Reclaim {
    /// The volume, as recorded.
    pub volume: PersistentVolume,
    /// Its claim.
    pub claim: String,
    /// Another claim of the same name (another UID) is there now: the pods that name the
    /// claim name that one.
    replaced: bool,
}

/// The provisioned volumes to delete now: of reclaim policy `Delete`, whose claim is gone for
/// good (every source synced and readable, and no broken manifest file that defined the claim
/// holds it back), that no pod names, wants or has mounted, and that are not being deleted
/// already.
/// Each is marked as being deleted (nothing may mount it meanwhile) before it is returned.
pub fn to_reclaim(store: &ObjectStore, world: &crate::world::World) -> Vec<Reclaim> {
    let bindings = store.bindings();
    // Looked at on every change of either state of world: nothing to copy when nothing was
    // provisioned.
    if !bindings.has_provisioned() {
        return Vec::new();
    }
    let gone: Vec<Reclaim> = bindings
        .provisioned()
        .into_iter()
        .filter_map(|volume| {
            let spec = volume.spec.as_ref()?;
            let claim = spec.claim_ref.as_ref()?;
            let (ns, claim) = (claim.namespace.as_deref()?, claim.name.as_deref()?);
            let name = volume.metadata.name.as_deref()?;
            // Gone, or another claim of the same name now (another UID): the volume's claim is
            // not coming back.
            let bound = bindings.binding_of(name);
            let (gone, replaced) = match store.persistent_volume_claim(ns, claim) {
                Some(c) => {
                    let other = bound.is_some_and(|b| b.uid != claim_uid(&c.object));
                    (other, other)
                }
                None => {
                    let absent = store
                        .not_loaded("PersistentVolumeClaim", ns, claim)
                        .is_none();
                    (absent, false)
                }
            };
            let delete = spec.persistent_volume_reclaim_policy.as_deref() == Some("Delete");
            (delete && gone && !bindings.is_releasing(name)).then(|| Reclaim {
                claim: format!("{ns}/{claim}"),
                volume: volume.clone(),
                replaced,
            })
        })
        .collect();
    if gone.is_empty()
        || !world.states_synced()
        || !store.all_sources_synced()
        || !store.source_problems().is_empty()
    {
        return Vec::new();
    }
    // A claim a pod still names is in use though it is gone from the manifests (what
    // PersistentVolumeClaim protection keeps on a cluster): its volume waits for the pod.
    let named: std::collections::BTreeSet<String> = store
        .pods()
        .iter()
        .flat_map(|(_, p)| {
            let pod = &p.pod;
            let ns = pod
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| crate::store::DEFAULT_NAMESPACE.into());
            let pod_name = pod.metadata.name.clone().unwrap_or_default();
            pod.spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .filter_map(|v| {
                    super::claims::claim_name(&pod_name, v).map(|c| format!("{ns}/{c}"))
                })
                .collect::<Vec<_>>()
        })
        .collect();
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
        .filter(|r| {
            let name = r.volume.metadata.name.as_deref().unwrap_or_default();
            !in_use.contains(name)
                && (r.replaced || !named.contains(&r.claim))
                && bindings.start_release(name)
        })
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
pub fn bind_at_once(host: &Arc<PluginHost>) {
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
        if store
            .bindings()
            .volume_of(ns, name, &claim_uid(c))
            .is_some()
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
        for r in to_reclaim(&host.store, &world) {
            tokio::spawn(reclaim(host.clone(), r));
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

/// Deletes a provisioned volume that [`to_reclaim`] chose (its claim is gone, and it is
/// neither mounted, staged nor attached any more): a CSI driver's with DeleteVolume, a
/// `local-path` one by removing its directory, on its own filesystem only (a mount inside it
/// stops the removal, and a directory outside the local-path directory is left alone); then
/// its record and binding, then the store's object. A failure is logged and tried again at the
/// next change.
pub async fn reclaim(host: Arc<PluginHost>, r: Reclaim) {
    let name = r.volume.metadata.name.clone().unwrap_or_default();
    let spec = r.volume.spec.clone().unwrap_or_default();
    crate::record::fail_point("reclaim", "before");
    let deleted = match (spec.csi, spec.local) {
        (Some(csi), _) => match host.csi.controller_client(&csi.driver) {
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
        },
        (None, Some(local)) => {
            let dir = std::path::PathBuf::from(&local.path);
            let root = host.local_path_dir.clone();
            match (dir.parent() == Some(root.as_path()), dir.file_name()) {
                (true, Some(leaf)) => {
                    let leaf = leaf.to_string_lossy().into_owned();
                    let removed = tokio::task::spawn_blocking(move || {
                        kubevol_mount::safe::Dir::open(&root)
                            .and_then(|d| d.remove_dir_all_one_fs(&leaf))
                    })
                    .await;
                    match removed {
                        Ok(r) => r.map_err(|e| e.to_string()),
                        Err(e) => Err(format!("the removal did not finish: {e}")),
                    }
                }
                _ => Err(format!(
                    "its directory {} is not in the local-path directory {}: left alone",
                    dir.display(),
                    root.display()
                )),
            }
        }
        (None, None) => Ok(()),
    };
    let store = &host.store;
    if let Err(e) = deleted {
        tracing::warn!(volume = %name, claim = %r.claim, "the provisioned volume of a removed claim cannot be deleted: {e}; tried again at the next change");
        let _ = store.bindings().finish_release(&name, false);
        return;
    }
    crate::record::fail_point("reclaim", "after");
    if let Err(e) = store.bindings().finish_release(&name, true) {
        tracing::warn!(volume = %name, "the deleted volume cannot be forgotten: {e}; tried again at the next change");
        return;
    }
    store.remove_provisioned(&name);
    tracing::info!(volume = %name, claim = %r.claim, "provisioned volume deleted: its claim is gone (reclaim policy Delete)");
}
