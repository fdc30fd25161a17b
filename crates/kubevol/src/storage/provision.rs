//! Provisioning in standalone mode: what external provisioners do for a claim that no existing
//! volume fits.
//!
//! A claim whose class's provisioner is `kubevol.io/local-path` gets a directory of its own
//! under the node's local-path directory, served as a `local` PersistentVolume of this node,
//! named `pvc-<claim UID>` as an external provisioner names it, with the claim's request,
//! access modes and class and the class's reclaim policy. A claim of a class whose provisioner
//! is a CSI driver given with `--csi-controller` gets a volume from its `CreateVolume`. The
//! volume is recorded, and bound to its claim, in one write of `bindings.json` before anything
//! uses it. A provisioned volume grows with its claim where its class allows it.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, LocalVolumeSource, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeSpec, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::classes::{storage_class, LOCAL_PATH_PROVISIONER, PROVISIONED_BY};
use super::StorageError;
use crate::plugins::PluginHost;
use crate::store::{claim_uid, Creating, Object, ObjectStore};

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
    fn of(claim: &PersistentVolumeClaim) -> Result<Ask, StorageError> {
        let (bytes, request) =
            kubevol_core::binding::requested(claim).ok_or(StorageError::NoRequest)?;
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

/// A volume a provisioner made, to be described as a PersistentVolume.
struct Made<'a> {
    /// The volume's name.
    volume: &'a str,
    /// The provisioner that made it.
    by: &'a str,
    /// Its capacity, as a quantity.
    capacity: String,
    /// Where it is: a local directory, or a CSI driver's volume.
    source: MadeSource,
    /// Where it can be used (the nodes its topology names); none means anywhere.
    terms: Vec<NodeSelectorTerm>,
}

/// The volume source of a provisioned volume.
enum MadeSource {
    /// A directory of this node (`spec.local`).
    Local(std::path::PathBuf),
    /// A volume of a CSI driver (`spec.csi`).
    Csi(Box<CSIPersistentVolumeSource>),
}

/// One node selector term of `key In [value]` pairs.
fn term<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> NodeSelectorTerm {
    NodeSelectorTerm {
        match_expressions: Some(
            pairs
                .into_iter()
                .map(|(key, value)| NodeSelectorRequirement {
                    key: key.to_string(),
                    operator: "In".into(),
                    values: Some(vec![value.to_string()]),
                })
                .collect(),
        ),
        match_fields: None,
    }
}

/// The PersistentVolume of what was made for claim `namespace/name` of `class`: what every
/// provisioner writes (the claim's access modes and volume mode, the class's name and reclaim
/// policy, a claimRef with the claim's UID, the provisioner's annotation), with the volume's
/// capacity, source and node affinity.
fn provisioned_volume(
    namespace: &str,
    name: &str,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    ask: &Ask,
    made: Made<'_>,
) -> PersistentVolume {
    let (local, csi) = match made.source {
        MadeSource::Local(path) => (
            Some(LocalVolumeSource {
                path: path.to_string_lossy().into_owned(),
                fs_type: None,
            }),
            None,
        ),
        MadeSource::Csi(source) => (None, Some(*source)),
    };
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(made.volume.to_string()),
            annotations: Some([(PROVISIONED_BY.to_string(), made.by.to_string())].into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some([("storage".to_string(), Quantity(made.capacity))].into()),
            access_modes: Some(ask.access_modes.clone()),
            persistent_volume_reclaim_policy: Some(
                class
                    .reclaim_policy
                    .clone()
                    .unwrap_or_else(|| "Delete".into()),
            ),
            storage_class_name: class.metadata.name.clone(),
            volume_mode: Some(if ask.block { "Block" } else { "Filesystem" }.into()),
            claim_ref: Some(ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("PersistentVolumeClaim".into()),
                namespace: Some(namespace.to_string()),
                name: Some(name.to_string()),
                uid: Some(claim_uid(claim)),
                ..Default::default()
            }),
            local,
            csi,
            node_affinity: (!made.terms.is_empty()).then_some(VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: made.terms,
                }),
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// Records `pv`, provisioned for claim `namespace/name`, bound to it (one write), then puts it
/// in the store.
fn record(
    store: &ObjectStore,
    namespace: &str,
    name: &str,
    pv: PersistentVolume,
) -> Result<(), StorageError> {
    let volume = pv.metadata.name.clone().unwrap_or_default();
    let uid = pv
        .spec
        .as_ref()
        .and_then(|s| s.claim_ref.as_ref()?.uid.clone())
        .unwrap_or_default();
    store
        .bindings()
        .provision(namespace, name, &uid, pv.clone())
        .map_err(StorageError::recording(namespace, name, &volume))?;
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
) -> Result<String, StorageError> {
    let class_name = class.metadata.name.clone().unwrap_or_default();
    if class.provisioner != LOCAL_PATH_PROVISIONER {
        return Err(match host.csi.controller_client(&class.provisioner) {
            Some(_) => StorageError::Creating(start_csi(host, namespace, name, claim, class)),
            None => StorageError::Refused(format!(
                "StorageClass {class_name} is provisioned by {}, which kubevol does not run: kubevol runs {LOCAL_PATH_PROVISIONER}, and the CSI drivers whose controller service it is given (--csi-controller {}=unix:///…); add a PersistentVolume that fits the claim, or use another class",
                class.provisioner, class.provisioner
            )),
        });
    }
    let ask = Ask::of(claim)?;
    if ask.block {
        return Err(StorageError::Refused(format!(
            "StorageClass {class_name} ({LOCAL_PATH_PROVISIONER}) makes directories, not block devices: use volumeMode Filesystem, or add a Block PersistentVolume that fits the claim"
        )));
    }
    if claim
        .spec
        .as_ref()
        .is_some_and(|s| s.data_source.is_some() || s.data_source_ref.is_some())
    {
        return Err(StorageError::Refused(format!(
            "StorageClass {class_name} ({LOCAL_PATH_PROVISIONER}) cannot fill a volume from a dataSource: remove it, or add a PersistentVolume that fits the claim"
        )));
    }
    let volume = volume_name(claim);
    let dir = local_path_directory(host, &volume, namespace, name)?;
    let here = term([("kubernetes.io/hostname", host.node_name.as_str())]);
    let pv = provisioned_volume(
        namespace,
        name,
        claim,
        class,
        &ask,
        Made {
            volume: &volume,
            by: LOCAL_PATH_PROVISIONER,
            capacity: ask.request.clone(),
            source: MadeSource::Local(dir.clone()),
            terms: vec![here],
        },
    );
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
) -> Result<std::path::PathBuf, StorageError> {
    let leaf = kubevol_core::names::PathName::new(
        "the directory of a local-path volume",
        &format!("{volume}_{namespace}_{name}"),
    )?;
    let path = host.local_path_dir.join(&leaf);
    let made = |source| StorageError::Directory {
        path: path.clone(),
        source,
    };
    let base = kubevol_mount::safe::Dir::open(&host.local_path_dir).map_err(made)?;
    let (dir, created) = base.make_child(leaf.as_ref(), 0o777).map_err(made)?;
    if !created {
        if !dir.is_empty().map_err(made)? {
            return Err(StorageError::Occupied { path });
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
) -> Result<(), StorageError> {
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
        return Err(StorageError::Refused(format!(
            "PersistentVolumeClaim {namespace}/{name} asks for {request} but its volume {volume} has {}, and StorageClass {class_name} does not allow volume expansion (allowVolumeExpansion: true): set it, or ask for no more than the volume has",
            pv.spec.as_ref().and_then(|s| s.capacity.as_ref()).and_then(|c| c.get("storage")).map(|q| q.0.clone()).unwrap_or_default()
        )));
    }
    if let Some(spec) = pv.spec.as_mut() {
        spec.capacity.get_or_insert_with(Default::default).insert(
            "storage".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity(request.clone()),
        );
    }
    bindings
        .update_provisioned(pv.clone())
        .map_err(StorageError::recording(namespace, name, &volume))?;
    host.store.add_provisioned([Object::PersistentVolume(pv)]);
    tracing::info!(claim = %format!("{namespace}/{name}"), %volume, size = %request, "provisioned volume grown to the claim's request");
    Ok(())
}

/// The prefix of the StorageClass parameters meant for the provisioner itself, not the driver.
const RESERVED_PARAMETERS: &str = "csi.storage.k8s.io/";

/// The parameter that gives a CSI volume's filesystem.
const FSTYPE_PARAMETER: &str = "csi.storage.k8s.io/fstype";

/// The volume attribute the external-provisioner adds to each volume it makes: its identity.
const PROVISIONER_IDENTITY: &str = "storage.kubernetes.io/csiProvisionerIdentity";

/// The provisioner's identity for `driver`, as the external-provisioner forms it: its start
/// time in milliseconds, a number, the driver (here this process's start and its PID).
fn provisioner_identity(driver: &str) -> String {
    static BASE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let base = BASE.get_or_init(|| {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        format!("{ms}-{}", std::process::id() % 10_000)
    });
    format!("{base}-{driver}")
}

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
        let result = create_csi(&host, &ns, &claim_name, &claim, &class)
            .await
            .map_err(|e| e.to_string());
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
) -> Result<(), StorageError> {
    use kubevol_csi::v1::{
        volume_capability, CapacityRange, CreateVolumeRequest, TopologyRequirement,
        VolumeCapability,
    };
    let driver = &class.provisioner;
    let volume = volume_name(claim);
    let ask = Ask::of(claim)?;
    let parameters = class.parameters.clone().unwrap_or_default();
    let secrets = super::secrets::class_secrets(&parameters, &volume, claim)
        .map_err(StorageError::Refused)?;
    let provisioner_secrets = match secrets.get("provisioner") {
        Some(r) => crate::plugins::csi::secret_data(host, r, namespace)
            .map_err(|e| StorageError::Refused(format!("the provisioner's secret: {e}")))?,
        None => Default::default(),
    };
    let fs_type = parameters
        .get(FSTYPE_PARAMETER)
        .cloned()
        .unwrap_or_default();
    let node = host
        .csi
        .get(driver)
        .ok_or_else(|| StorageError::NoDriver(format!("CSI driver {driver} is not registered on this node (its node plugin must be, for its topology)")))?;
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
        return Err(StorageError::NoDriver(format!(
            "no controller service of CSI driver {driver} is given (--csi-controller)"
        )));
    };
    let content_source =
        super::sources::content_source(host, namespace, name, claim, class, ask.bytes, ask.block)
            .await?;
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
                secrets: provisioner_secrets,
                volume_content_source: content_source,
            }),
        )
        .await?
        .volume
        .ok_or_else(|| StorageError::Refused(format!("CSI driver {driver} created no volume")))?;
    let capacity = if created.capacity_bytes > 0 {
        created.capacity_bytes.to_string()
    } else {
        ask.request.clone()
    };
    let terms = created
        .accessible_topology
        .iter()
        .map(|t| term(t.segments.iter().map(|(k, v)| (k.as_str(), v.as_str()))))
        .collect();
    let source = CSIPersistentVolumeSource {
        driver: driver.clone(),
        volume_handle: created.volume_id,
        volume_attributes: Some(
            created
                .volume_context
                .into_iter()
                .chain([(
                    PROVISIONER_IDENTITY.to_string(),
                    provisioner_identity(driver),
                )])
                .collect(),
        ),
        fs_type: (!fs_type.is_empty() && !ask.block).then_some(fs_type),
        controller_publish_secret_ref: secrets.get("controller-publish").cloned(),
        node_stage_secret_ref: secrets.get("node-stage").cloned(),
        node_publish_secret_ref: secrets.get("node-publish").cloned(),
        controller_expand_secret_ref: secrets.get("controller-expand").cloned(),
        node_expand_secret_ref: secrets.get("node-expand").cloned(),
        ..Default::default()
    };
    let mut pv = provisioned_volume(
        namespace,
        name,
        claim,
        class,
        &ask,
        Made {
            volume: &volume,
            by: driver,
            capacity,
            source: MadeSource::Csi(Box::new(source)),
            terms,
        },
    );
    // DeleteVolume gets the provisioner's secret too, whatever becomes of the class.
    if let Some(r) = secrets.get("provisioner") {
        let annotations = pv.metadata.annotations.get_or_insert_with(Default::default);
        let (name, ns) = (
            r.name.clone().unwrap_or_default(),
            r.namespace.clone().unwrap_or_default(),
        );
        annotations.insert(super::secrets::DELETION_SECRET_NAME.into(), name);
        annotations.insert(super::secrets::DELETION_SECRET_NAMESPACE.into(), ns);
    }
    record(&host.store, namespace, name, pv)?;
    tracing::info!(claim = %format!("{namespace}/{name}"), %volume, %driver, node = %host.node_name, "volume provisioned by CSI driver");
    Ok(())
}
