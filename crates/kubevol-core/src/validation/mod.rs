//! Pod validation, done before anything touches disk.
//!
//! A standalone node agent has no API server in front of it, so kubevol enforces the API
//! server's volume rules itself, and a few stricter ones where a node-side path depends on them
//! (an absolute hostPath, a canonical pod UID). Every violation is collected, each with its field
//! path (`spec.volumes[2].name`), so the user can fix a manifest in one go.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use k8s_openapi::api::core::v1::{Container, Pod, Volume};

use crate::quantity::Quantity;

mod content;
mod image;
mod snapshot;
mod static_pod;
mod volume;

pub use image::{image_reference_error, PULL_POLICIES};
pub use snapshot::{validate_volume_snapshot, validate_volume_snapshot_content};
pub use static_pod::static_pod_api_reference;

pub use content::*;
pub use volume::{
    mount_option_error, validate_claim, validate_persistent_volume, validate_storage_class,
};

/// One violation, with the field path the API server would name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// The field, e.g. `spec.volumes[2].name`.
    pub field: String,
    /// What is wrong with it.
    pub kind: FieldErrorKind,
}

/// The kinds of violation, with the API server's wording.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FieldErrorKind {
    /// A required value is missing.
    Required(String),
    /// The value is invalid.
    Invalid {
        /// The offending value.
        value: String,
        /// Why.
        detail: String,
    },
    /// The value repeats an earlier one.
    Duplicate(String),
    /// The value is not one of the allowed ones.
    NotSupported {
        /// The offending value.
        value: String,
        /// The allowed values.
        allowed: Vec<&'static str>,
    },
    /// The value names something that does not exist.
    NotFound(String),
    /// The value is not allowed here.
    Forbidden(String),
    /// The value is longer than the given number of bytes.
    TooLong(usize),
    /// The value has more items than allowed.
    TooMany {
        /// How many it has.
        count: usize,
        /// The most allowed.
        max: usize,
    },
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let field = &self.field;
        match &self.kind {
            FieldErrorKind::Required(d) if d.is_empty() => write!(f, "{field}: Required value"),
            FieldErrorKind::Required(d) => write!(f, "{field}: Required value: {d}"),
            FieldErrorKind::Invalid { value, detail } => {
                write!(f, "{field}: Invalid value: {value:?}: {detail}")
            }
            FieldErrorKind::Duplicate(v) => write!(f, "{field}: Duplicate value: {v:?}"),
            FieldErrorKind::NotSupported { value, allowed } => {
                let allowed: Vec<String> = allowed.iter().map(|a| format!("{a:?}")).collect();
                write!(
                    f,
                    "{field}: Unsupported value: {value:?}: supported values: {}",
                    allowed.join(", ")
                )
            }
            FieldErrorKind::NotFound(v) => write!(f, "{field}: Not found: {v:?}"),
            FieldErrorKind::Forbidden(d) => write!(f, "{field}: Forbidden: {d}"),
            FieldErrorKind::TooLong(n) => {
                write!(f, "{field}: Too long: may not be more than {n} bytes")
            }
            FieldErrorKind::TooMany { count, max } => {
                write!(
                    f,
                    "{field}: Too many: {count}: must have at most {max} items"
                )
            }
        }
    }
}

/// A field's path, spelled out only when an error names it: a valid pod's paths are never
/// built (every pod is validated whole, and a thousand pods' volume and mount paths were a
/// tenth of the populator's time).
#[derive(Clone, Copy)]
pub struct FieldPath<'a> {
    parent: Option<&'a dyn fmt::Display>,
    name: &'static str,
    index: Option<usize>,
}

impl<'a> FieldPath<'a> {
    /// `name` (itself a path from the root, e.g. `spec.containers`), at `index` if any.
    pub fn root(name: &'static str, index: Option<usize>) -> FieldPath<'static> {
        FieldPath {
            parent: None,
            name,
            index,
        }
    }

    /// `parent.name`, at `index` if any.
    pub fn child(parent: &'a dyn fmt::Display, name: &'static str, index: Option<usize>) -> Self {
        FieldPath {
            parent: Some(parent),
            name,
            index,
        }
    }
}

impl fmt::Display for FieldPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(p) = self.parent {
            write!(f, "{p}.")?;
        }
        f.write_str(self.name)?;
        if let Some(i) = self.index {
            write!(f, "[{i}]")?;
        }
        Ok(())
    }
}

fn err(field: impl Into<String>, kind: FieldErrorKind) -> FieldError {
    FieldError {
        field: field.into(),
        kind,
    }
}

fn required(field: impl Into<String>) -> FieldError {
    err(field, FieldErrorKind::Required(String::new()))
}

/// Checks that exactly one of a union's members (`found`, by API name) is set: the API's
/// "must specify a volume type" / "may not specify more than 1 volume type" pair, for volume
/// sources and projections alike (`what` is "volume type" or "projection type"; `none` says
/// what is missing when nothing is set).
fn exactly_one(
    field: &dyn fmt::Display,
    found: &[&str],
    what: &str,
    none: &str,
    errs: &mut Vec<FieldError>,
) {
    match found.len() {
        0 => errs.push(err(
            field.to_string(),
            FieldErrorKind::Required(none.into()),
        )),
        1 => {}
        _ => errs.push(err(
            field.to_string(),
            FieldErrorKind::Forbidden(format!(
                "may not specify more than 1 {what} (found {})",
                found.join(", ")
            )),
        )),
    }
}

fn invalid(field: impl Into<String>, value: &str, detail: impl Into<String>) -> FieldError {
    err(
        field,
        FieldErrorKind::Invalid {
            value: value.to_string(),
            detail: detail.into(),
        },
    )
}

const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

/// Why `s` is not a DNS-1123 label (at most 63 characters of `[a-z0-9-]`, alphanumeric at both
/// ends), or `None` when it is one.
pub fn dns1123_label_error(s: &str) -> Option<String> {
    if s.len() > 63 {
        return Some("must be no more than 63 characters".into());
    }
    let b = s.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let ok = !b.is_empty()
        && alnum(&b[0])
        && alnum(&b[b.len() - 1])
        && b.iter().all(|c| alnum(c) || *c == b'-');
    (!ok).then(|| DNS1123_LABEL_MSG.to_string())
}

/// Why `s` is not a DNS-1123 subdomain (at most 253 characters, dot-separated labels), or `None`.
pub fn dns1123_subdomain_error(s: &str) -> Option<String> {
    if s.len() > 253 {
        return Some("must be no more than 253 characters".into());
    }
    let b = s.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let ok = !b.is_empty()
        && s.split('.').all(|part| {
            let p = part.as_bytes();
            !p.is_empty()
                && alnum(&p[0])
                && alnum(&p[p.len() - 1])
                && p.iter().all(|c| alnum(c) || *c == b'-')
        });
    (!ok).then(|| DNS1123_SUBDOMAIN_MSG.to_string())
}

/// Why `key=value` is not a valid label (the key a qualified name: an optional DNS-1123
/// subdomain prefix and `/`, then at most 63 characters of `[A-Za-z0-9_.-]`, alphanumeric at
/// both ends; the value empty or such a name), or `None`.
pub fn label_error(key: &str, value: &str) -> Option<String> {
    fn name_error(s: &str) -> Option<&'static str> {
        let b = s.as_bytes();
        let alnum = |c: &u8| c.is_ascii_alphanumeric();
        if b.len() > 63 {
            return Some("must be no more than 63 characters");
        }
        let ok = !b.is_empty()
            && alnum(&b[0])
            && alnum(&b[b.len() - 1])
            && b.iter()
                .all(|c| alnum(c) || matches!(c, b'-' | b'_' | b'.'));
        (!ok).then_some("must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")
    }
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(e) = prefix.and_then(dns1123_subdomain_error) {
        return Some(format!("label key {key:?}: the prefix before '/' {e}"));
    }
    if let Some(e) = name_error(name) {
        return Some(format!("label key {key:?}: the name {e}"));
    }
    if !value.is_empty() {
        if let Some(e) = name_error(value) {
            return Some(format!("label value {value:?} of {key:?}: {e}"));
        }
    }
    None
}

/// Whether `s` is a canonical lower-case UUID (`8-4-4-4-12` hex digits). The pod UID becomes a
/// directory name, so nothing else may pass.
pub fn is_canonical_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(c),
        })
}

/// The API field names of every volume source set on `v`, in a fixed order.
pub fn volume_source_names(v: &Volume) -> Vec<&'static str> {
    let mut out = Vec::new();
    macro_rules! check {
        ($($field:ident => $name:literal),* $(,)?) => {
            $( if v.$field.is_some() { out.push($name); } )*
        };
    }
    check!(
        aws_elastic_block_store => "awsElasticBlockStore",
        azure_disk => "azureDisk",
        azure_file => "azureFile",
        cephfs => "cephfs",
        cinder => "cinder",
        config_map => "configMap",
        csi => "csi",
        downward_api => "downwardAPI",
        empty_dir => "emptyDir",
        ephemeral => "ephemeral",
        fc => "fc",
        flex_volume => "flexVolume",
        flocker => "flocker",
        gce_persistent_disk => "gcePersistentDisk",
        git_repo => "gitRepo",
        glusterfs => "glusterfs",
        host_path => "hostPath",
        image => "image",
        iscsi => "iscsi",
        nfs => "nfs",
        persistent_volume_claim => "persistentVolumeClaim",
        photon_persistent_disk => "photonPersistentDisk",
        portworx_volume => "portworxVolume",
        projected => "projected",
        quobyte => "quobyte",
        rbd => "rbd",
        scale_io => "scaleIO",
        secret => "secret",
        storageos => "storageos",
        vsphere_volume => "vsphereVolume",
    );
    out
}

/// The hostPath types the kubelet knows.
pub const HOST_PATH_TYPES: [&str; 8] = [
    "",
    "DirectoryOrCreate",
    "Directory",
    "FileOrCreate",
    "File",
    "Socket",
    "CharDevice",
    "BlockDevice",
];

/// Why a path is not a relative path without `..` elements (the API's
/// `validateLocalDescendingPath`), or `None`.
pub fn local_descending_path_error(p: &str) -> Option<&'static str> {
    if p.starts_with('/') {
        return Some("must be a relative path");
    }
    has_backsteps(p).then_some("must not contain '..'")
}

/// Whether a path has a `..` element, after converting `\` to `/` as the API server does.
pub fn has_backsteps(p: &str) -> bool {
    p.replace('\\', "/").split('/').any(|e| e == "..")
}

/// Validates a pod's identity and volumes. An empty result means the pod may be processed.
pub fn validate_pod(pod: &Pod) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let meta = &pod.metadata;
    match meta.name.as_deref() {
        None | Some("") => errs.push(required("metadata.name")),
        Some(n) => {
            if let Some(d) = dns1123_subdomain_error(n) {
                errs.push(invalid("metadata.name", n, d));
            }
        }
    }
    if let Some(ns) = meta.namespace.as_deref() {
        if let Some(d) = dns1123_label_error(ns) {
            errs.push(invalid("metadata.namespace", ns, d));
        }
    }
    if let Some(uid) = meta.uid.as_deref() {
        if !is_canonical_uuid(uid) {
            errs.push(invalid(
                "metadata.uid",
                uid,
                "must be a lower-case UUID such as 0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70 (it names the pod's directory); remove it to let kubevol derive one",
            ));
        }
    }
    let Some(spec) = &pod.spec else {
        errs.push(required("spec"));
        return errs;
    };
    if spec.containers.is_empty() {
        errs.push(required("spec.containers"));
    }
    let volumes = spec.volumes.as_deref().unwrap_or_default();
    let container_names = content::container_names(pod);
    let mut by_name: BTreeMap<&str, &Volume> = BTreeMap::new();
    for (i, v) in volumes.iter().enumerate() {
        let path = FieldPath::root("spec.volumes", Some(i));
        if v.name.is_empty() {
            errs.push(required(format!("{path}.name")));
        } else if let Some(d) = dns1123_label_error(&v.name) {
            errs.push(invalid(format!("{path}.name"), &v.name, d));
        } else if by_name.insert(&v.name, v).is_some() {
            errs.push(err(
                format!("{path}.name"),
                FieldErrorKind::Duplicate(v.name.clone()),
            ));
        }
        validate_volume_source(v, &path, &mut errs);
        content::validate_content_source(v, &path, &container_names, &mut errs);
        if let Some(e) = &v.ephemeral {
            let pod_name = meta.name.as_deref().unwrap_or_default();
            volume::validate_ephemeral(pod_name, &v.name, e, &path, &mut errs);
        }
    }
    // A claim the pod names may not be one made for its own generic ephemeral volume.
    if let Some(pod_name) = meta.name.as_deref().filter(|n| !n.is_empty()) {
        let made: BTreeSet<String> = volumes
            .iter()
            .filter(|v| v.ephemeral.is_some())
            .map(|v| format!("{pod_name}-{}", v.name))
            .collect();
        for (i, v) in volumes.iter().enumerate() {
            if let Some(c) = v
                .persistent_volume_claim
                .as_ref()
                .filter(|c| made.contains(&c.claim_name))
            {
                errs.push(invalid(
                    format!("spec.volumes[{i}].persistentVolumeClaim.claimName"),
                    &c.claim_name,
                    "must not reference a PVC that gets created for an ephemeral volume",
                ));
            }
        }
    }

    let pod_selinux = spec
        .security_context
        .as_ref()
        .and_then(|c| c.se_linux_options.as_ref());
    selinux_options(
        "spec.securityContext.seLinuxOptions",
        pod_selinux,
        &mut errs,
    );
    let containers = all_containers(pod);
    let mut seen_containers = BTreeSet::new();
    for (path, c) in &containers {
        let opts = c
            .security_context
            .as_ref()
            .and_then(|s| s.se_linux_options.as_ref());
        selinux_options(
            &format!("{path}.securityContext.seLinuxOptions"),
            opts,
            &mut errs,
        );
        if let Some(d) = dns1123_label_error(&c.name) {
            errs.push(invalid(format!("{path}.name"), &c.name, d));
        } else if !seen_containers.insert(c.name.as_str()) {
            errs.push(err(
                format!("{path}.name"),
                FieldErrorKind::Duplicate(c.name.clone()),
            ));
        }
        validate_container_mounts(c, path, &by_name, &mut errs);
    }
    errs
}

/// Why `value` cannot be an SELinux user, role or type (identifiers of the policy: letters,
/// digits, `_`, `.` and `-`), or `None` when it can.
pub fn selinux_identifier_error(value: &str) -> Option<&'static str> {
    let ok = value.len() <= 255
        && value
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'));
    (!ok).then_some("must be an SELinux identifier: at most 255 letters, digits, '_', '.' and '-' (it becomes part of a mount option)")
}

/// Why `value` cannot be an SELinux level (sensitivities and categories such as `s0`,
/// `s0:c1,c2` or `s0-s0:c0.c1023`: letters, digits, `_`, `.`, `-`, `:` and `,`), or `None`
/// when it can.
pub fn selinux_level_error(value: &str) -> Option<&'static str> {
    let ok = value.len() <= 4096
        && value
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-' | b':' | b','));
    (!ok).then_some("must be an SELinux level such as s0:c1,c2: at most 4096 letters, digits, '_', '.', '-', ':' and ',' (it becomes part of a mount option)")
}

/// The errors of `opts`, by field name (`user`, `role`, `type`, `level`) and value.
pub fn selinux_options_errors(
    opts: &k8s_openapi::api::core::v1::SELinuxOptions,
) -> Vec<(&'static str, &str, &'static str)> {
    let fields = [
        (
            "user",
            &opts.user,
            selinux_identifier_error as fn(&str) -> _,
        ),
        ("role", &opts.role, selinux_identifier_error),
        ("type", &opts.type_, selinux_identifier_error),
        ("level", &opts.level, selinux_level_error),
    ];
    fields
        .into_iter()
        .filter_map(|(name, value, check)| {
            let value = value.as_deref()?;
            check(value).map(|why| (name, value, why))
        })
        .collect()
}

/// SELinux options become a mount option (`-o context="…"`): each field may hold only what
/// an SELinux context holds.
fn selinux_options(
    path: &str,
    opts: Option<&k8s_openapi::api::core::v1::SELinuxOptions>,
    errs: &mut Vec<FieldError>,
) {
    for (field, value, why) in opts.map(selinux_options_errors).unwrap_or_default() {
        errs.push(invalid(format!("{path}.{field}"), value, why));
    }
}

/// A CSI driver's name, as the API server checks it: set, at most 63 characters, and in lower
/// case a DNS-1123 subdomain (it names the driver's directories on the node).
pub fn csi_driver_name(field: &str, driver: &str, errs: &mut Vec<FieldError>) {
    if driver.is_empty() {
        errs.push(required(field));
    } else if driver.len() > 63 {
        errs.push(err(field, FieldErrorKind::TooLong(63)));
    } else if let Some(why) = dns1123_subdomain_error(&driver.to_lowercase()) {
        errs.push(invalid(field, driver, why));
    }
}

/// Every container of a pod (init, regular, ephemeral) with its field path.
pub fn all_containers(pod: &Pod) -> Vec<(FieldPath<'static>, &Container)> {
    let mut out = Vec::new();
    if let Some(spec) = &pod.spec {
        for (i, c) in spec.init_containers.iter().flatten().enumerate() {
            out.push((FieldPath::root("spec.initContainers", Some(i)), c));
        }
        for (i, c) in spec.containers.iter().enumerate() {
            out.push((FieldPath::root("spec.containers", Some(i)), c));
        }
    }
    out
}

fn validate_volume_source(v: &Volume, path: &dyn fmt::Display, errs: &mut Vec<FieldError>) {
    exactly_one(
        path,
        &volume_source_names(v),
        "volume type",
        "must specify a volume type",
        errs,
    );
    if let Some(hp) = &v.host_path {
        let p = FieldPath::child(path, "hostPath", None);
        if hp.path.is_empty() {
            errs.push(required(format!("{p}.path")));
        } else if !hp.path.starts_with('/') {
            errs.push(invalid(
                format!("{p}.path"),
                &hp.path,
                "must be an absolute path",
            ));
        } else if has_backsteps(&hp.path) {
            errs.push(invalid(
                format!("{p}.path"),
                &hp.path,
                "must not contain '..'",
            ));
        }
        let t = hp.type_.as_deref().unwrap_or("");
        if !HOST_PATH_TYPES.contains(&t) {
            errs.push(err(
                format!("{p}.type"),
                FieldErrorKind::NotSupported {
                    value: t.into(),
                    allowed: HOST_PATH_TYPES.to_vec(),
                },
            ));
        }
    }
    if let Some(image) = &v.image {
        let p = FieldPath::child(path, "image", None);
        image::validate_image_source(image, &p.to_string(), errs);
    }
    if let Some(csi) = &v.csi {
        let p = FieldPath::child(path, "csi", None);
        csi_driver_name(&format!("{p}.driver"), &csi.driver, errs);
        let secret = csi.node_publish_secret_ref.as_ref();
        if let Some(name) = secret.map(|r| r.name.as_str()).filter(|n| !n.is_empty()) {
            if let Some(why) = dns1123_subdomain_error(name) {
                errs.push(invalid(format!("{p}.nodePublishSecretRef.name"), name, why));
            }
        }
    }
    if let Some(ed) = &v.empty_dir {
        let p = FieldPath::child(path, "emptyDir", None);
        let medium = ed.medium.as_deref().unwrap_or("");
        let ok = match medium {
            "" | "Memory" | "HugePages" => true,
            m => m
                .strip_prefix("HugePages-")
                .is_some_and(|size| Quantity::parse(size).is_ok_and(|q| q.value() > 0)),
        };
        if !ok {
            errs.push(err(
                format!("{p}.medium"),
                FieldErrorKind::NotSupported {
                    value: medium.into(),
                    allowed: vec!["", "Memory", "HugePages", "HugePages-<size>"],
                },
            ));
        }
        if let Some(limit) = &ed.size_limit {
            match Quantity::parse(&limit.0) {
                Err(e) => errs.push(invalid(format!("{p}.sizeLimit"), &limit.0, e.to_string())),
                Ok(q) if q.is_negative() => errs.push(invalid(
                    format!("{p}.sizeLimit"),
                    &limit.0,
                    "SizeLimit field must be a valid resource quantity",
                )),
                Ok(_) => {}
            }
        }
    }
}

const PROPAGATION: [&str; 3] = ["None", "HostToContainer", "Bidirectional"];
const RECURSIVE_READ_ONLY: [&str; 3] = ["Disabled", "IfPossible", "Enabled"];

fn validate_container_mounts(
    c: &Container,
    path: &dyn fmt::Display,
    volumes: &BTreeMap<&str, &Volume>,
    errs: &mut Vec<FieldError>,
) {
    let mut mount_paths = BTreeSet::new();
    let mut device_paths = BTreeSet::new();
    let mut device_names = BTreeSet::new();
    for (i, d) in c.volume_devices.iter().flatten().enumerate() {
        let p = FieldPath::child(path, "volumeDevices", Some(i));
        match volumes.get(d.name.as_str()) {
            None if d.name.is_empty() => {
                errs.push(required(format!("{p}.name")))
            }
            None => errs.push(err(format!("{p}.name"), FieldErrorKind::NotFound(d.name.clone()))),
            Some(v) if v.persistent_volume_claim.is_none() && v.ephemeral.is_none() => {
                errs.push(invalid(
                    format!("{p}.name"),
                    &d.name,
                    "can only use volume source type of PersistentVolumeClaim or Ephemeral for block mode",
                ))
            }
            Some(_) => {}
        }
        if !device_names.insert(d.name.as_str()) {
            errs.push(err(
                format!("{p}.name"),
                FieldErrorKind::Duplicate(d.name.clone()),
            ));
        }
        if d.device_path.is_empty() {
            errs.push(required(format!("{p}.devicePath")));
        } else if has_backsteps(&d.device_path) {
            errs.push(invalid(
                format!("{p}.devicePath"),
                &d.device_path,
                "can not contain backsteps ('..')",
            ));
        } else if !device_paths.insert(d.device_path.as_str()) {
            errs.push(err(
                format!("{p}.devicePath"),
                FieldErrorKind::Duplicate(d.device_path.clone()),
            ));
        }
    }
    let privileged = c
        .security_context
        .as_ref()
        .and_then(|s| s.privileged)
        .unwrap_or(false);
    for (i, m) in c.volume_mounts.iter().flatten().enumerate() {
        let p = FieldPath::child(path, "volumeMounts", Some(i));
        if m.name.is_empty() {
            errs.push(required(format!("{p}.name")));
        } else if !volumes.contains_key(m.name.as_str()) {
            errs.push(err(
                format!("{p}.name"),
                FieldErrorKind::NotFound(m.name.clone()),
            ));
        }
        if device_names.contains(m.name.as_str()) {
            errs.push(invalid(
                format!("{p}.name"),
                &m.name,
                "must not already exist in volumeDevices",
            ));
        }
        if m.mount_path.is_empty() {
            errs.push(required(format!("{p}.mountPath")));
        } else if !mount_paths.insert(m.mount_path.as_str()) {
            errs.push(invalid(
                format!("{p}.mountPath"),
                &m.mount_path,
                "must be unique",
            ));
        } else if device_paths.contains(m.mount_path.as_str()) {
            errs.push(invalid(
                format!("{p}.mountPath"),
                &m.mount_path,
                "must not already exist as a path in volumeDevices",
            ));
        }
        let sub_path = m.sub_path.as_deref().unwrap_or("");
        if !sub_path.is_empty() {
            if let Some(d) = local_descending_path_error(sub_path) {
                errs.push(invalid(format!("{p}.subPath"), sub_path, d));
            }
        }
        let sub_path_expr = m.sub_path_expr.as_deref().unwrap_or("");
        if !sub_path_expr.is_empty() {
            if !sub_path.is_empty() {
                errs.push(invalid(
                    format!("{p}.subPathExpr"),
                    sub_path_expr,
                    "subPathExpr and subPath are mutually exclusive",
                ));
            } else if let Some(d) = local_descending_path_error(sub_path_expr) {
                errs.push(invalid(format!("{p}.subPathExpr"), sub_path_expr, d));
            }
        }
        let propagation = m.mount_propagation.as_deref();
        if let Some(mp) = propagation {
            if !PROPAGATION.contains(&mp) {
                errs.push(err(
                    format!("{p}.mountPropagation"),
                    FieldErrorKind::NotSupported {
                        value: mp.into(),
                        allowed: PROPAGATION.to_vec(),
                    },
                ));
            } else if mp == "Bidirectional" && !privileged {
                errs.push(err(
                    format!("{p}.mountPropagation"),
                    FieldErrorKind::Forbidden(
                        "Bidirectional mount propagation is available only to privileged containers"
                            .into(),
                    ),
                ));
            }
        }
        if let Some(rro) = m.recursive_read_only.as_deref() {
            if !RECURSIVE_READ_ONLY.contains(&rro) {
                errs.push(err(
                    format!("{p}.recursiveReadOnly"),
                    FieldErrorKind::NotSupported {
                        value: rro.into(),
                        allowed: RECURSIVE_READ_ONLY.to_vec(),
                    },
                ));
            } else if rro != "Disabled" {
                if !m.read_only.unwrap_or(false) {
                    errs.push(err(
                        format!("{p}.recursiveReadOnly"),
                        FieldErrorKind::Forbidden(
                            "may only be specified when readOnly is true".into(),
                        ),
                    ));
                }
                if propagation.is_some_and(|mp| mp != "None") {
                    errs.push(err(
                        format!("{p}.recursiveReadOnly"),
                        FieldErrorKind::Forbidden(
                            "may only be specified when mountPropagation is None or not specified"
                                .into(),
                        ),
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
