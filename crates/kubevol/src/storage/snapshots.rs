//! The snapshot a claim's volume starts from: a VolumeSnapshot of the manifests bound to a
//! VolumeSnapshotContent that names a snapshot the driver has (`snapshotHandle`), checked as the
//! snapshot controller and the external-provisioner check them. kubevol runs no snapshot
//! controller: a VolumeSnapshot that asks for a new snapshot of a claim is refused with how to
//! give an existing one instead.

use super::sources::Target;
use super::StorageError;

/// The driver's ID of the snapshot that VolumeSnapshot `name` (in the target's namespace)
/// stands for.
pub(super) fn snapshot_handle(t: &Target<'_>, name: &str) -> Result<String, StorageError> {
    let (host, namespace, driver) = (t.host, t.namespace, t.driver);
    let snapshot = format!("VolumeSnapshot {namespace}/{name}");
    let refuse = |why: String| {
        Err(StorageError::Refused(format!(
            "{}: its data source {why}",
            t.this
        )))
    };
    let Some(s) = host.store.volume_snapshot(namespace, name) else {
        return refuse(format!(
            "{snapshot} is not defined: define it, or remove the data source"
        ));
    };
    let source = &s.object.spec.source;
    let take_one = "kubevol runs no snapshot controller and takes no snapshots: give the VolumeSnapshot spec.source.volumeSnapshotContentName, naming a VolumeSnapshotContent whose spec.source.snapshotHandle is the driver's snapshot";
    let Some(content_name) = source.volume_snapshot_content_name.as_deref() else {
        return refuse(format!(
            "{snapshot} asks for a new snapshot of PersistentVolumeClaim {namespace}/{}: {take_one}",
            source.persistent_volume_claim_name.as_deref().unwrap_or_default()
        ));
    };
    let content = format!("VolumeSnapshotContent {content_name}");
    let Some(c) = host.store.volume_snapshot_content(content_name) else {
        return refuse(format!(
            "{snapshot} names {content}, which is not defined: define it, or name another"
        ));
    };
    let spec = &c.object.spec;
    let bound = &spec.volume_snapshot_ref;
    if bound.name.as_deref() != Some(name) || bound.namespace.as_deref() != Some(namespace) {
        return refuse(format!(
            "{snapshot} names {content}, which is bound to VolumeSnapshot {}/{}: a content and its snapshot name each other (set its spec.volumeSnapshotRef to {namespace}/{name})",
            bound.namespace.as_deref().unwrap_or_default(),
            bound.name.as_deref().unwrap_or_default()
        ));
    }
    if spec.driver != driver {
        return refuse(format!(
            "{snapshot} is a snapshot of CSI driver {}, not {driver}: a volume is made from a snapshot by the driver that holds it (use a class of {})",
            spec.driver, spec.driver
        ));
    }
    match spec.source.snapshot_handle.as_deref() {
        Some(handle) if !handle.is_empty() => Ok(handle.to_string()),
        _ => refuse(format!(
            "{snapshot} names {content}, which asks for a new snapshot of volume {}: {take_one}",
            spec.source.volume_handle.as_deref().unwrap_or_default()
        )),
    }
}
