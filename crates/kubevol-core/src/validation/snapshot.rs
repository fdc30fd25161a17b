//! VolumeSnapshot and VolumeSnapshotContent, as their CustomResourceDefinitions' schemas and
//! rules check them (external-snapshotter's `snapshot.storage.k8s.io/v1`).

use super::volume::{namespaced_meta, uid};
use super::{
    dns1123_subdomain_error, err, exactly_one, invalid, required, FieldError, FieldErrorKind,
};
use crate::snapshot::{VolumeSnapshot, VolumeSnapshotContent};

/// `spec.source` must set exactly one of `fields` (an empty string is not set).
fn one_source(fields: [(&str, &Option<String>); 2], errs: &mut Vec<FieldError>) {
    let found: Vec<&str> = fields
        .iter()
        .filter(|(_, v)| v.as_deref().is_some_and(|v| !v.is_empty()))
        .map(|(k, _)| *k)
        .collect();
    let none = format!(
        "exactly one of {} and {} must be set",
        fields[0].0, fields[1].0
    );
    exactly_one(&"spec.source", &found, "source", &none, errs);
}

/// A VolumeSnapshot's errors: its name and namespace, exactly one source.
pub fn validate_volume_snapshot(s: &VolumeSnapshot) -> Vec<FieldError> {
    let mut errs = Vec::new();
    namespaced_meta(&s.metadata, &mut errs);
    uid(&s.metadata, &mut errs);
    let src = &s.spec.source;
    let found: Vec<&str> = [
        (
            "persistentVolumeClaimName",
            &src.persistent_volume_claim_name,
        ),
        (
            "volumeSnapshotContentName",
            &src.volume_snapshot_content_name,
        ),
    ]
    .into_iter()
    .filter(|(_, v)| v.as_deref().is_some_and(|v| !v.is_empty()))
    .map(|(k, _)| k)
    .collect();
    exactly_one(
        &"spec.source",
        &found,
        "source",
        "exactly one of persistentVolumeClaimName and volumeSnapshotContentName must be set",
        &mut errs,
    );
    errs
}

/// A VolumeSnapshotContent's errors: its name, driver, deletion policy, exactly one source and
/// the snapshot it is bound to.
pub fn validate_volume_snapshot_content(c: &VolumeSnapshotContent) -> Vec<FieldError> {
    let mut errs = Vec::new();
    match c.metadata.name.as_deref() {
        None | Some("") => errs.push(required("metadata.name")),
        Some(n) => {
            if let Some(why) = dns1123_subdomain_error(n) {
                errs.push(invalid("metadata.name", n, why));
            }
        }
    }
    uid(&c.metadata, &mut errs);
    if c.spec.driver.is_empty() {
        errs.push(required("spec.driver"));
    }
    if !["Delete", "Retain"].contains(&c.spec.deletion_policy.as_str()) {
        errs.push(err(
            "spec.deletionPolicy",
            FieldErrorKind::NotSupported {
                value: c.spec.deletion_policy.clone(),
                allowed: vec!["Delete", "Retain"],
            },
        ));
    }
    let src = &c.spec.source;
    one_source(
        [
            ("volumeHandle", &src.volume_handle),
            ("snapshotHandle", &src.snapshot_handle),
        ],
        &mut errs,
    );
    let r = &c.spec.volume_snapshot_ref;
    if r.name.as_deref().unwrap_or_default().is_empty()
        || r.namespace.as_deref().unwrap_or_default().is_empty()
    {
        errs.push(required(
            "spec.volumeSnapshotRef (both spec.volumeSnapshotRef.name and spec.volumeSnapshotRef.namespace must be set)",
        ));
    }
    errs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_names_exactly_one_source() {
        let mut s = VolumeSnapshot::default();
        s.metadata.name = Some("snap".into());
        s.metadata.namespace = Some("default".into());
        assert!(validate_volume_snapshot(&s)[0]
            .to_string()
            .contains("exactly one of"));
        s.spec.source.volume_snapshot_content_name = Some("c".into());
        assert!(validate_volume_snapshot(&s).is_empty());
        s.spec.source.persistent_volume_claim_name = Some("data".into());
        assert!(validate_volume_snapshot(&s)[0]
            .to_string()
            .contains("more than 1"));
    }

    #[test]
    fn a_content_needs_its_driver_policy_source_and_reference() {
        let mut c = VolumeSnapshotContent::default();
        c.metadata.name = Some("c".into());
        let errs: Vec<String> = validate_volume_snapshot_content(&c)
            .iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(errs.len(), 4, "{errs:?}");
        c.spec.driver = "d".into();
        c.spec.deletion_policy = "Retain".into();
        c.spec.source.snapshot_handle = Some("h".into());
        c.spec.volume_snapshot_ref.name = Some("snap".into());
        c.spec.volume_snapshot_ref.namespace = Some("default".into());
        assert!(validate_volume_snapshot_content(&c).is_empty());
    }
}
