//! Where a provisioned CSI volume's content comes from: a claim's `dataSourceRef` (or
//! `dataSource`), checked as the external-provisioner checks it before CreateVolume is sent
//! with a `volume_content_source`. What cannot be honoured is refused with what to change,
//! never provisioned as an empty volume.

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, TypedObjectReference};
use k8s_openapi::api::storage::v1::StorageClass;
use kubevol_csi::v1::controller_service_capability::rpc::Type as ControllerCap;
use kubevol_csi::v1::{volume_content_source, VolumeContentSource};

use super::StorageError;
use crate::plugins::PluginHost;

/// The API group of VolumeSnapshots.
pub const SNAPSHOT_GROUP: &str = "snapshot.storage.k8s.io";

/// The claim's data source: `dataSourceRef`, else `dataSource` (the API server copies one into
/// the other; a manifest may give either).
fn data_source(claim: &PersistentVolumeClaim) -> Option<TypedObjectReference> {
    let spec = claim.spec.as_ref()?;
    spec.data_source_ref.clone().or_else(|| {
        spec.data_source.as_ref().map(|r| TypedObjectReference {
            api_group: r.api_group.clone(),
            kind: r.kind.clone(),
            name: r.name.clone(),
            namespace: None,
        })
    })
}

/// The content source of the volume for claim `namespace/name` of `class` (`bytes` asked,
/// `block` for a Block claim), or `None` for an empty volume.
pub(super) async fn content_source(
    host: &PluginHost,
    namespace: &str,
    name: &str,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    bytes: i64,
    block: bool,
) -> Result<Option<VolumeContentSource>, StorageError> {
    let Some(source) = data_source(claim) else {
        return Ok(None);
    };
    let this = format!("PersistentVolumeClaim {namespace}/{name}");
    let group = source.api_group.as_deref().unwrap_or_default();
    if source.namespace.as_deref().is_some_and(|n| n != namespace) {
        return Err(StorageError::Refused(format!(
            "{this}: dataSourceRef names namespace {:?}: a data source in another namespace needs CrossNamespaceVolumeDataSource, which kubevol does not offer; use a source in {namespace}",
            source.namespace.unwrap_or_default()
        )));
    }
    let driver = &class.provisioner;
    let class_name = class.metadata.name.as_deref().unwrap_or_default();
    match (group, source.kind.as_str()) {
        ("", "PersistentVolumeClaim") => {
            let handle = clone_source(host, namespace, &this, &source.name, class_name, driver, bytes, block)?;
            needs(host, driver, ControllerCap::CloneVolume, "CLONE_VOLUME", &this).await?;
            Ok(Some(VolumeContentSource {
                r#type: Some(volume_content_source::Type::Volume(
                    volume_content_source::VolumeSource { volume_id: handle },
                )),
            }))
        }
        (SNAPSHOT_GROUP, "VolumeSnapshot") => {
            let snapshot =
                super::snapshots::snapshot_handle(host, namespace, &this, &source.name, driver)?;
            needs(host, driver, ControllerCap::CreateDeleteSnapshot, "CREATE_DELETE_SNAPSHOT", &this).await?;
            Ok(Some(VolumeContentSource {
                r#type: Some(volume_content_source::Type::Snapshot(
                    volume_content_source::SnapshotSource {
                        snapshot_id: snapshot,
                    },
                )),
            }))
        }
        (group, kind) => Err(StorageError::Refused(format!(
            "{this}: its data source is a {kind}{}: kubevol fills a volume from a PersistentVolumeClaim (a clone) or a VolumeSnapshot of {SNAPSHOT_GROUP}, not from volume populators; remove the data source or use one of those",
            if group.is_empty() { String::new() } else { format!(" of API group {group}") }
        ))),
    }
}

/// Refuses unless `driver`'s controller offers `cap`.
async fn needs(
    host: &PluginHost,
    driver: &str,
    cap: ControllerCap,
    spelled: &str,
    this: &str,
) -> Result<(), StorageError> {
    if host.csi.controller_has(driver, cap).await? {
        return Ok(());
    }
    Err(StorageError::Refused(format!(
        "{this}: CSI driver {driver} does not offer {spelled}, which its data source needs: remove the data source, or use a class whose driver offers it"
    )))
}

/// The handle of the volume a clone of claim `source` (in `namespace`) starts from, checked as
/// the external-provisioner checks it: bound, of the same class, driver and volume mode, and no
/// larger than the clone.
#[allow(clippy::too_many_arguments)]
fn clone_source(
    host: &PluginHost,
    namespace: &str,
    this: &str,
    source: &str,
    class: &str,
    driver: &str,
    bytes: i64,
    block: bool,
) -> Result<String, StorageError> {
    let refuse = |why: String| {
        Err(StorageError::Refused(format!(
            "{this}: its data source PersistentVolumeClaim {namespace}/{source} {why}"
        )))
    };
    let Some(claim) = host.store.persistent_volume_claim(namespace, source) else {
        return refuse("is not defined: define it, or remove the data source".into());
    };
    let claim = claim.object;
    let source_class = kubevol_core::binding::claim_class(&claim);
    if source_class != class {
        return refuse(format!(
            "is of StorageClass {source_class:?}, not {class:?}: a clone must be of its source's class"
        ));
    }
    let source_block = claim.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block");
    if source_block != block {
        return refuse("has another volumeMode: a clone must have its source's".into());
    }
    let bindings = host.store.bindings();
    let volume = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|v| !v.is_empty())
        .or_else(|| bindings.volume_of(namespace, source, &crate::store::claim_uid(&claim)));
    let Some(pv) = volume.and_then(|v| host.store.persistent_volume(&v)) else {
        return refuse("is not bound to a volume yet: the clone waits for it".into());
    };
    let pv = pv.object;
    let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.as_ref()) else {
        return refuse("is not a CSI volume: only a CSI volume can be cloned".into());
    };
    if csi.driver != driver {
        return refuse(format!(
            "is a volume of CSI driver {}, not {driver}: a clone is made by its source's driver",
            csi.driver
        ));
    }
    let have = kubevol_core::binding::capacity(&pv);
    if bytes < have {
        return refuse(format!(
            "has {have} bytes, more than the clone asks for ({bytes}): ask for at least as much"
        ));
    }
    Ok(csi.volume_handle.clone())
}
