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

/// The claim whose volume is being made, as the checks of its data source see it.
pub(super) struct Target<'a> {
    pub(super) host: &'a PluginHost,
    pub(super) namespace: &'a str,
    /// `PersistentVolumeClaim <namespace>/<name>`, for messages.
    pub(super) this: String,
    /// Its StorageClass's name and provisioner.
    pub(super) class: &'a str,
    pub(super) driver: &'a str,
    /// What it asks for, in bytes, and whether it is a Block claim.
    pub(super) bytes: i64,
    pub(super) block: bool,
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
    let t = Target {
        host,
        namespace,
        this: format!("PersistentVolumeClaim {namespace}/{name}"),
        class: class.metadata.name.as_deref().unwrap_or_default(),
        driver: &class.provisioner,
        bytes,
        block,
    };
    let group = source.api_group.as_deref().unwrap_or_default();
    if source.namespace.as_deref().is_some_and(|n| n != namespace) {
        return Err(StorageError::Refused(format!(
            "{}: dataSourceRef names namespace {:?}: a data source in another namespace needs CrossNamespaceVolumeDataSource, which kubevol does not offer; use a source in {namespace}",
            t.this,
            source.namespace.unwrap_or_default()
        )));
    }
    let content = match (group, source.kind.as_str()) {
        ("", "PersistentVolumeClaim") => {
            let volume_id = clone_source(&t, &source.name)?;
            needs(&t, ControllerCap::CloneVolume, "CLONE_VOLUME").await?;
            volume_content_source::Type::Volume(volume_content_source::VolumeSource { volume_id })
        }
        (SNAPSHOT_GROUP, "VolumeSnapshot") => {
            let snapshot_id = super::snapshots::snapshot_handle(&t, &source.name)?;
            needs(&t, ControllerCap::CreateDeleteSnapshot, "CREATE_DELETE_SNAPSHOT").await?;
            volume_content_source::Type::Snapshot(volume_content_source::SnapshotSource {
                snapshot_id,
            })
        }
        (group, kind) => {
            return Err(StorageError::Refused(format!(
                "{}: its data source is a {kind}{}: kubevol fills a volume from a PersistentVolumeClaim (a clone) or a VolumeSnapshot of {SNAPSHOT_GROUP}, not from volume populators; remove the data source or use one of those",
                t.this,
                if group.is_empty() { String::new() } else { format!(" of API group {group}") }
            )))
        }
    };
    Ok(Some(VolumeContentSource {
        r#type: Some(content),
    }))
}

/// Refuses unless the driver's controller offers `cap` (`spelled` as the spec spells it).
async fn needs(t: &Target<'_>, cap: ControllerCap, spelled: &str) -> Result<(), StorageError> {
    if t.host.csi.controller_has(t.driver, cap).await? {
        return Ok(());
    }
    Err(StorageError::Refused(format!(
        "{}: CSI driver {} does not offer {spelled}, which its data source needs: remove the data source, or use a class whose driver offers it",
        t.this, t.driver
    )))
}

/// The handle of the volume a clone of claim `source` (in the target's namespace) starts
/// from, checked as the external-provisioner checks it: bound, of the same class, driver and
/// volume mode, and no larger than the clone.
fn clone_source(t: &Target<'_>, source: &str) -> Result<String, StorageError> {
    let (host, namespace, class, driver) = (t.host, t.namespace, t.class, t.driver);
    let refuse = |why: String| {
        Err(StorageError::Refused(format!(
            "{}: its data source PersistentVolumeClaim {namespace}/{source} {why}",
            t.this
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
    if source_block != t.block {
        return refuse("has another volumeMode: a clone must have its source's".into());
    }
    // Bound both ways, as the PersistentVolume controller binds: the volume kubevol bound the
    // claim to, or one whose claimRef names the claim. A claim's own spec.volumeName alone is
    // a wish that anyone who writes a claim can make, naming any volume of any namespace.
    let uid = crate::store::claim_uid(&claim);
    let bound = host.store.bindings().volume_of(namespace, source, &uid);
    let pv = match bound.and_then(|v| host.store.persistent_volume(&v)) {
        Some(pv) => Some(pv.object),
        None => crate::populator::claims::bound_volume(&host.store, namespace, &claim)
            .filter(|pv| kubevol_core::binding::claim_ref_names(pv, namespace, source, Some(&uid))),
    };
    let Some(pv) = pv else {
        return refuse(match claim.spec.as_ref().and_then(|s| s.volume_name.as_deref()) {
            Some(v) if !v.is_empty() => format!(
                "names PersistentVolume {v} in spec.volumeName, but that volume is not bound to it (its claimRef does not name {namespace}/{source}): a clone starts only from a claim bound to its volume both ways"
            ),
            _ => "is not bound to a volume yet: the clone waits for it".into(),
        });
    };
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
    if t.bytes < have {
        return refuse(format!(
            "has {have} bytes, more than the clone asks for ({}): ask for at least as much",
            t.bytes
        ));
    }
    Ok(csi.volume_handle.clone())
}
