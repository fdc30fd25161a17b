//! A PersistentVolume's spec, checked as the API server checks it before it stores one: a
//! PersistentVolume from a manifest file never met the API server, and its paths reach the
//! node's mounts.

use std::fmt;

use k8s_openapi::api::core::v1::{
    EphemeralVolumeSource, NodeSelector, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeSpec,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{dns1123_subdomain_error, label_error, FieldError};
use super::{err, exactly_one, has_backsteps, invalid, required, FieldErrorKind, HOST_PATH_TYPES};
use crate::quantity::Quantity;

const ACCESS_MODES: [&str; 4] = [
    "ReadOnlyMany",
    "ReadWriteMany",
    "ReadWriteOnce",
    "ReadWriteOncePod",
];
const RECLAIM_POLICIES: [&str; 3] = ["Delete", "Recycle", "Retain"];
const VOLUME_MODES: [&str; 2] = ["Block", "Filesystem"];
const SELECTOR_OPERATORS: [&str; 6] = ["DoesNotExist", "Exists", "Gt", "In", "Lt", "NotIn"];

/// The volume types a PersistentVolume's spec sets, by API name.
fn sources(s: &PersistentVolumeSpec) -> Vec<&'static str> {
    let set = [
        (s.host_path.is_some(), "hostPath"),
        (s.gce_persistent_disk.is_some(), "gcePersistentDisk"),
        (s.aws_elastic_block_store.is_some(), "awsElasticBlockStore"),
        (s.glusterfs.is_some(), "glusterfs"),
        (s.flocker.is_some(), "flocker"),
        (s.nfs.is_some(), "nfs"),
        (s.rbd.is_some(), "rbd"),
        (s.quobyte.is_some(), "quobyte"),
        (s.cephfs.is_some(), "cephfs"),
        (s.iscsi.is_some(), "iscsi"),
        (s.cinder.is_some(), "cinder"),
        (s.fc.is_some(), "fc"),
        (s.flex_volume.is_some(), "flexVolume"),
        (s.azure_file.is_some(), "azureFile"),
        (s.vsphere_volume.is_some(), "vsphereVolume"),
        (s.azure_disk.is_some(), "azureDisk"),
        (s.photon_persistent_disk.is_some(), "photonPersistentDisk"),
        (s.portworx_volume.is_some(), "portworxVolume"),
        (s.scale_io.is_some(), "scaleIO"),
        (s.local.is_some(), "local"),
        (s.storageos.is_some(), "storageos"),
        (s.csi.is_some(), "csi"),
    ];
    set.into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| n)
        .collect()
}

/// A path the API server takes for a PersistentVolume's hostPath or local path: set, and
/// without a `..` element. kubevol also wants it absolute: it is a path on this node.
fn node_path(field: &str, path: &str, errs: &mut Vec<FieldError>) {
    if path.is_empty() {
        errs.push(required(field));
    } else if has_backsteps(path) {
        errs.push(invalid(field, path, "must not contain '..'"));
    } else if !path.starts_with('/') {
        errs.push(invalid(field, path, "must be an absolute path"));
    }
}

/// A node selector's terms as the API server checks them (keys, operators and values).
fn node_selector(field: &str, s: &NodeSelector, errs: &mut Vec<FieldError>) {
    if s.node_selector_terms.is_empty() {
        errs.push(err(
            format!("{field}.nodeSelectorTerms"),
            FieldErrorKind::Required("must have at least one node selector term".into()),
        ));
    }
    for (i, term) in s.node_selector_terms.iter().enumerate() {
        let expressions = term.match_expressions.iter().flatten().enumerate();
        for (j, e) in expressions {
            let at = format!("{field}.nodeSelectorTerms[{i}].matchExpressions[{j}]");
            if let Some(why) = label_error(&e.key, "") {
                errs.push(invalid(format!("{at}.key"), &e.key, why));
            }
            let values = e.values.as_deref().unwrap_or_default();
            let problem = match e.operator.as_str() {
                "In" | "NotIn" if values.is_empty() => {
                    Some("must be specified when `operator` is 'In' or 'NotIn'")
                }
                "Exists" | "DoesNotExist" if !values.is_empty() => {
                    Some("may not be specified when `operator` is 'Exists' or 'DoesNotExist'")
                }
                "Gt" | "Lt" if values.len() != 1 => {
                    Some("must be specified single value when `operator` is 'Lt' or 'Gt'")
                }
                op if !SELECTOR_OPERATORS.contains(&op) => {
                    errs.push(err(
                        format!("{at}.operator"),
                        FieldErrorKind::NotSupported {
                            value: op.into(),
                            allowed: SELECTOR_OPERATORS.to_vec(),
                        },
                    ));
                    None
                }
                _ => None,
            };
            if let Some(why) = problem {
                errs.push(err(
                    format!("{at}.values"),
                    FieldErrorKind::Required(why.into()),
                ));
            }
        }
    }
}

/// Why `option` cannot be passed on as a mount option (the kernel and `mount -o` split
/// options at commas outside double quotes): a NUL or a line break, or a double quote left
/// open, which would make the options after it part of this one.
pub fn mount_option_error(option: &str) -> Option<&'static str> {
    if option.is_empty() {
        return Some("must not be empty");
    }
    if option.bytes().any(|c| matches!(c, b'\0' | b'\n' | b'\r')) {
        return Some("must not contain a NUL or a line break");
    }
    if option.bytes().filter(|c| *c == b'"').count() % 2 == 1 {
        return Some("must close every double quote it opens");
    }
    None
}

/// The mount options of a PersistentVolume or StorageClass, each checked as
/// [`mount_option_error`] says.
pub fn mount_options(field: &str, options: Option<&[String]>, errs: &mut Vec<FieldError>) {
    for (i, o) in options.unwrap_or_default().iter().enumerate() {
        if let Some(why) = mount_option_error(o) {
            errs.push(invalid(format!("{field}[{i}]"), o, why));
        }
    }
}

/// Validates a PersistentVolume as the API server does (its name, access modes, capacity,
/// reclaim policy, node affinity, exactly one volume type, the hostPath and local paths, the
/// CSI driver and handle, the volume mode and the class name). An empty result means it may
/// be used.
pub fn validate_persistent_volume(pv: &PersistentVolume) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let name = pv.metadata.name.as_deref().unwrap_or_default();
    if name.is_empty() {
        errs.push(required("metadata.name"));
    } else if let Some(why) = dns1123_subdomain_error(name) {
        errs.push(invalid("metadata.name", name, why));
    }
    let Some(s) = &pv.spec else {
        errs.push(required("spec"));
        return errs;
    };
    access_modes(&"spec", s.access_modes.as_deref(), &mut errs);
    mount_options("spec.mountOptions", s.mount_options.as_deref(), &mut errs);
    let capacity = s.capacity.clone().unwrap_or_default();
    if capacity.is_empty() {
        errs.push(required("spec.capacity"));
    }
    if !capacity.contains_key("storage") || capacity.len() > 1 {
        let names: Vec<&str> = capacity.keys().map(String::as_str).collect();
        errs.push(err(
            "spec.capacity",
            FieldErrorKind::NotSupported {
                value: names.join(", "),
                allowed: vec!["storage"],
            },
        ));
    }
    for (r, q) in &capacity {
        let field = format!("spec.capacity[{r}]");
        match Quantity::parse(&q.0) {
            Err(e) => errs.push(invalid(field, &q.0, e.to_string())),
            Ok(q2) if q2.is_negative() || q2.is_zero() => {
                errs.push(invalid(field, &q.0, "must be greater than zero"))
            }
            Ok(_) => {}
        }
    }
    if let Some(p) = s.persistent_volume_reclaim_policy.as_deref() {
        if !p.is_empty() && !RECLAIM_POLICIES.contains(&p) {
            errs.push(err(
                "spec.persistentVolumeReclaimPolicy",
                FieldErrorKind::NotSupported {
                    value: p.into(),
                    allowed: RECLAIM_POLICIES.to_vec(),
                },
            ));
        }
    }
    let affinity = s.node_affinity.as_ref();
    if let Some(a) = affinity {
        match &a.required {
            Some(r) => node_selector("spec.nodeAffinity.required", r, &mut errs),
            None => errs.push(err(
                "spec.nodeAffinity.required",
                FieldErrorKind::Required("must specify required node constraints".into()),
            )),
        }
    }
    exactly_one(
        &"spec",
        &sources(s),
        "volume type",
        "must specify a volume type",
        &mut errs,
    );
    if let Some(hp) = &s.host_path {
        node_path("spec.hostPath.path", &hp.path, &mut errs);
        let t = hp.type_.as_deref().unwrap_or("");
        if !HOST_PATH_TYPES.contains(&t) {
            errs.push(err(
                "spec.hostPath.type",
                FieldErrorKind::NotSupported {
                    value: t.into(),
                    allowed: HOST_PATH_TYPES.to_vec(),
                },
            ));
        }
    }
    if let Some(local) = &s.local {
        node_path("spec.local.path", &local.path, &mut errs);
        if affinity.is_none() {
            errs.push(err(
                "spec.nodeAffinity",
                FieldErrorKind::Required("Local volume requires node affinity".into()),
            ));
        }
    }
    if let Some(csi) = &s.csi {
        super::csi_driver_name("spec.csi.driver", &csi.driver, &mut errs);
        if csi.volume_handle.is_empty() {
            errs.push(required("spec.csi.volumeHandle"));
        }
    }
    mode_and_class(
        &"spec",
        s.volume_mode.as_deref(),
        s.storage_class_name.as_deref(),
        &mut errs,
    );
    errs
}

/// The access modes of a volume or claim spec at `path`: at least one, each supported, and
/// ReadWriteOncePod alone.
fn access_modes(path: &dyn fmt::Display, modes: Option<&[String]>, errs: &mut Vec<FieldError>) {
    let field = format!("{path}.accessModes");
    let modes = modes.unwrap_or_default();
    if modes.is_empty() {
        errs.push(required(&field));
    }
    for m in modes {
        if !ACCESS_MODES.contains(&m.as_str()) {
            errs.push(err(
                &field,
                FieldErrorKind::NotSupported {
                    value: m.clone(),
                    allowed: ACCESS_MODES.to_vec(),
                },
            ));
        }
    }
    let once_pod = modes.iter().any(|m| m == "ReadWriteOncePod");
    let others = modes
        .iter()
        .any(|m| m != "ReadWriteOncePod" && ACCESS_MODES.contains(&m.as_str()));
    if once_pod && others {
        errs.push(err(
            &field,
            FieldErrorKind::Forbidden(
                "may not use ReadWriteOncePod with other access modes".into(),
            ),
        ));
    }
}

/// The volume mode and the storage class name of a volume or claim spec at `path`.
fn mode_and_class(
    path: &dyn fmt::Display,
    mode: Option<&str>,
    class: Option<&str>,
    errs: &mut Vec<FieldError>,
) {
    if let Some(m) = mode {
        if !VOLUME_MODES.contains(&m) {
            errs.push(err(
                format!("{path}.volumeMode"),
                FieldErrorKind::NotSupported {
                    value: m.into(),
                    allowed: VOLUME_MODES.to_vec(),
                },
            ));
        }
    }
    if let Some(class) = class.filter(|c| !c.is_empty()) {
        if let Some(why) = dns1123_subdomain_error(class) {
            errs.push(invalid(format!("{path}.storageClassName"), class, why));
        }
    }
}

/// A claim spec at `path` (a claim, or the `volumeClaimTemplate` of a generic ephemeral
/// volume), as the API server checks it: access modes, a positive storage request, the volume
/// mode and the class name.
pub fn validate_claim_spec(
    s: &PersistentVolumeClaimSpec,
    path: &dyn fmt::Display,
    errs: &mut Vec<FieldError>,
) {
    access_modes(path, s.access_modes.as_deref(), errs);
    let field = format!("{path}.resources.requests[storage]");
    match s
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref()?.get("storage"))
    {
        None => errs.push(required(field)),
        Some(q) => match Quantity::parse(&q.0) {
            Err(e) => errs.push(invalid(field, &q.0, e.to_string())),
            Ok(v) if v.is_negative() || v.is_zero() => {
                errs.push(invalid(field, &q.0, "must be greater than zero"))
            }
            Ok(_) => {}
        },
    }
    mode_and_class(
        path,
        s.volume_mode.as_deref(),
        s.storage_class_name.as_deref(),
        errs,
    );
}

/// The UID of an object from a manifest: a canonical lower-case UUID when it is set (it names
/// directories, as a claim's names its provisioned volume's).
pub(super) fn uid(meta: &ObjectMeta, errs: &mut Vec<FieldError>) {
    if let Some(uid) = meta.uid.as_deref() {
        if !super::is_canonical_uuid(uid) {
            errs.push(invalid(
                "metadata.uid",
                uid,
                "must be a lower-case UUID such as 0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70 (it names directories); remove it to let kubevol derive one",
            ));
        }
    }
}

/// A namespaced object's name and namespace, as the API server checks them.
pub(super) fn namespaced_meta(meta: &ObjectMeta, errs: &mut Vec<FieldError>) {
    match meta.name.as_deref() {
        None | Some("") => errs.push(required("metadata.name")),
        Some(n) => {
            if let Some(why) = dns1123_subdomain_error(n) {
                errs.push(invalid("metadata.name", n, why));
            }
        }
    }
    if let Some(ns) = meta.namespace.as_deref() {
        if let Some(why) = super::dns1123_label_error(ns) {
            errs.push(invalid("metadata.namespace", ns, why));
        }
    }
    uid(meta, errs);
}

/// Validates a PersistentVolumeClaim as the API server does (its name, namespace and spec),
/// and its UID, which kubevol's provisioner names a directory after.
pub fn validate_claim(claim: &PersistentVolumeClaim) -> Vec<FieldError> {
    let mut errs = Vec::new();
    namespaced_meta(&claim.metadata, &mut errs);
    match &claim.spec {
        None => errs.push(required("spec")),
        Some(s) => validate_claim_spec(s, &"spec", &mut errs),
    }
    errs
}

const BINDING_MODES: [&str; 2] = ["Immediate", "WaitForFirstConsumer"];

/// Validates a StorageClass as the API server does: its name, provisioner, reclaim policy,
/// binding mode, mount options and number of parameters.
pub fn validate_storage_class(class: &StorageClass) -> Vec<FieldError> {
    let mut errs = Vec::new();
    match class.metadata.name.as_deref() {
        None | Some("") => errs.push(required("metadata.name")),
        Some(n) => {
            if let Some(why) = dns1123_subdomain_error(n) {
                errs.push(invalid("metadata.name", n, why));
            }
        }
    }
    uid(&class.metadata, &mut errs);
    if class.provisioner.is_empty() {
        errs.push(required("provisioner"));
    } else if let Some(why) = label_error(&class.provisioner.to_lowercase(), "") {
        errs.push(invalid("provisioner", &class.provisioner, why));
    }
    let policy = class.reclaim_policy.as_deref().unwrap_or("Delete");
    if !["Delete", "Retain"].contains(&policy) {
        errs.push(err(
            "reclaimPolicy",
            FieldErrorKind::NotSupported {
                value: policy.into(),
                allowed: vec!["Delete", "Retain"],
            },
        ));
    }
    let mode = class.volume_binding_mode.as_deref().unwrap_or("Immediate");
    if !BINDING_MODES.contains(&mode) {
        errs.push(err(
            "volumeBindingMode",
            FieldErrorKind::NotSupported {
                value: mode.into(),
                allowed: BINDING_MODES.to_vec(),
            },
        ));
    }
    mount_options("mountOptions", class.mount_options.as_deref(), &mut errs);
    let parameters = class.parameters.as_ref().map_or(0, |p| p.len());
    if parameters > 512 {
        errs.push(err(
            "parameters",
            FieldErrorKind::TooMany {
                count: parameters,
                max: 512,
            },
        ));
    }
    errs
}

/// A generic ephemeral volume of pod `pod_name` at `path`: its `volumeClaimTemplate` (only
/// labels and annotations in its metadata, and a valid claim spec), and the name of the claim
/// made for it, `<pod name>-<volume name>`, which must be a valid object name.
pub fn validate_ephemeral(
    pod_name: &str,
    volume: &str,
    e: &EphemeralVolumeSource,
    path: &dyn fmt::Display,
    errs: &mut Vec<FieldError>,
) {
    let Some(t) = &e.volume_claim_template else {
        errs.push(required(format!("{path}.ephemeral.volumeClaimTemplate")));
        return;
    };
    let tpath = format!("{path}.ephemeral.volumeClaimTemplate");
    let ObjectMeta {
        labels,
        annotations,
        ..
    } = t.metadata.clone().unwrap_or_default();
    let rest = ObjectMeta {
        labels,
        annotations,
        ..Default::default()
    };
    if Some(&rest) != t.metadata.as_ref() && t.metadata.is_some() {
        errs.push(err(
            format!("{tpath}.metadata"),
            FieldErrorKind::Forbidden(
                "cannot be set: only labels and annotations may be set in a volumeClaimTemplate's metadata".into(),
            ),
        ));
    }
    for (k, v) in rest.labels.iter().flatten() {
        if let Some(why) = label_error(k, v) {
            errs.push(invalid(format!("{tpath}.metadata.labels"), k, why));
        }
    }
    validate_claim_spec(&t.spec, &format!("{tpath}.spec"), errs);
    if !pod_name.is_empty() && !volume.is_empty() {
        let claim = format!("{pod_name}-{volume}");
        if let Some(why) = dns1123_subdomain_error(&claim) {
            errs.push(invalid(
                format!("{path}.name"),
                volume,
                format!("PVC name {claim:?}: {why}"),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pv(spec: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(json!({"metadata": {"name": "disk-1"}, "spec": spec})).unwrap()
    }

    fn errors(spec: serde_json::Value) -> String {
        validate_persistent_volume(&pv(spec))
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("; ")
    }

    #[test]
    fn a_valid_volume_passes() {
        let affinity = json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n"]}]}]}});
        for spec in [
            json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                   "hostPath": {"path": "/srv/data", "type": "DirectoryOrCreate"}}),
            json!({"accessModes": ["ReadWriteOncePod"], "capacity": {"storage": "10Gi"},
                   "local": {"path": "/mnt/disk"}, "nodeAffinity": affinity,
                   "persistentVolumeReclaimPolicy": "Retain", "volumeMode": "Block"}),
            json!({"accessModes": ["ReadWriteMany"], "capacity": {"storage": "1"},
                   "csi": {"driver": "loop.csi.kubevol.io", "volumeHandle": "h"},
                   "storageClassName": "fast"}),
        ] {
            assert_eq!(errors(spec.clone()), "", "{spec}");
        }
    }

    #[test]
    fn every_rule_is_reported_in_the_api_servers_words() {
        let rows = [
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                       "hostPath": {"path": "/srv/x/../../../etc"}}),
                "spec.hostPath.path: Invalid value: \"/srv/x/../../../etc\": must not contain '..'",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                       "hostPath": {"path": ""}}),
                "spec.hostPath.path: Required value",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                       "hostPath": {"path": "/x", "type": "Pipe"}}),
                "spec.hostPath.type: Unsupported value: \"Pipe\"",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                       "local": {"path": "/mnt/../etc"}}),
                "spec.local.path: Invalid value: \"/mnt/../etc\": must not contain '..'; spec.nodeAffinity: Required value: Local volume requires node affinity",
            ),
            (
                json!({"capacity": {"storage": "1Gi"}, "hostPath": {"path": "/x"}}),
                "spec.accessModes: Required value",
            ),
            (
                json!({"accessModes": ["ReadWriteOncePod", "ReadWriteOnce"],
                       "capacity": {"storage": "1Gi"}, "hostPath": {"path": "/x"}}),
                "spec.accessModes: Forbidden: may not use ReadWriteOncePod with other access modes",
            ),
            (
                json!({"accessModes": ["WriteSometimes"], "capacity": {"storage": "1Gi"},
                       "hostPath": {"path": "/x"}}),
                "spec.accessModes: Unsupported value: \"WriteSometimes\"",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "hostPath": {"path": "/x"}}),
                "spec.capacity: Required value",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "0"},
                       "hostPath": {"path": "/x"}}),
                "spec.capacity[storage]: Invalid value: \"0\": must be greater than zero",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"}}),
                "spec: Required value: must specify a volume type",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                       "hostPath": {"path": "/x"}, "nfs": {"server": "s", "path": "/"}}),
                "may not specify more than 1 volume type",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                       "csi": {"driver": "", "volumeHandle": ""}}),
                "spec.csi.driver: Required value; spec.csi.volumeHandle: Required value",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                       "hostPath": {"path": "/x"}, "volumeMode": "Raw",
                       "persistentVolumeReclaimPolicy": "Keep"}),
                "spec.persistentVolumeReclaimPolicy: Unsupported value: \"Keep\"",
            ),
            (
                json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                       "hostPath": {"path": "/x"}, "nodeAffinity": {"required": {"nodeSelectorTerms": [
                           {"matchExpressions": [{"key": "zone", "operator": "In"}]}]}}}),
                "spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].values: Required value",
            ),
        ];
        for (spec, want) in rows {
            let got = errors(spec.clone());
            assert!(got.contains(want), "{spec}\n got: {got}\nwant: {want}");
        }
    }
}
