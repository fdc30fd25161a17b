//! Rules for the volumes that carry content from objects into pods (configMap, secret,
//! downwardAPI, projected) and for the ConfigMaps and Secrets they read.
//!
//! Item paths become file names under a pod's volume directory, so besides the API server's rules
//! (relative, no `..`, not starting with `..`) they get the atomic writer's node-side limits, and
//! kubevol also rejects paths that collide only after cleaning (`a` and `./a`) or as a file and a
//! directory (`a` and `a/b`), which the API lets through.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    ConfigMap, DownwardAPIVolumeFile, KeyToPath, Pod, Secret, Volume,
};

use super::{
    dns1123_label_error, dns1123_subdomain_error, err, exactly_one, invalid, required, FieldError,
};
use super::{has_backsteps, FieldErrorKind};
use crate::quantity::Quantity;

/// The largest ConfigMap or Secret, in bytes of decoded values (the API's `MaxSecretSize`).
pub const MAX_OBJECT_SIZE: usize = 1024 * 1024;
/// The longest object key.
pub const MAX_KEY_LENGTH: usize = 253;
/// The longest element of an item path, in bytes.
pub const MAX_PATH_ELEMENT: usize = 255;
/// The longest item path, in bytes.
pub const MAX_PATH_LENGTH: usize = 4096;
/// The highest file mode an item may ask for.
pub const MAX_MODE: i32 = 0o777;

const CONFIG_KEY_MSG: &str = "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')";
const MODE_MSG: &str = "must be a number between 0 and 0777 (octal), both inclusive";

/// The fieldRef paths a downwardAPI volume may use (besides the subscripted label and annotation
/// forms).
pub const DOWNWARD_FIELD_PATHS: [&str; 5] = [
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "metadata.labels",
    "metadata.annotations",
];

/// The resources a resourceFieldRef may name (besides `limits.hugepages-<size>` and
/// `requests.hugepages-<size>`).
pub const DOWNWARD_RESOURCES: [&str; 6] = [
    "limits.cpu",
    "limits.memory",
    "limits.ephemeral-storage",
    "requests.cpu",
    "requests.memory",
    "requests.ephemeral-storage",
];

/// Why `key` is not a valid ConfigMap or Secret key, or `None`.
pub fn config_key_errors(key: &str) -> Vec<String> {
    let mut out = Vec::new();
    if key.len() > MAX_KEY_LENGTH {
        out.push(format!("must be no more than {MAX_KEY_LENGTH} characters"));
    }
    let ok = !key.is_empty()
        && key
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_'));
    if !ok {
        out.push(CONFIG_KEY_MSG.into());
    }
    if key == "." {
        out.push("must not be '.'".into());
    } else if key == ".." {
        out.push("must not be '..'".into());
    } else if key.starts_with("..") {
        out.push("must not start with '..'".into());
    }
    out
}

fn validate_object_meta(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    errs: &mut Vec<FieldError>,
) {
    match meta.name.as_deref() {
        None | Some("") => errs.push(required("metadata.name")),
        Some(n) => {
            if let Some(d) = dns1123_subdomain_error(n) {
                errs.push(invalid("metadata.name", n, d));
            }
        }
    }
    if let Some(ns) = meta.namespace.as_deref().filter(|n| !n.is_empty()) {
        if let Some(d) = dns1123_label_error(ns) {
            errs.push(invalid("metadata.namespace", ns, d));
        }
    }
}

fn validate_keys<'a>(
    field: &str,
    keys: impl Iterator<Item = &'a String>,
    errs: &mut Vec<FieldError>,
) {
    for k in keys {
        for d in config_key_errors(k) {
            errs.push(invalid(format!("{field}[{k}]"), k, d));
        }
    }
}

fn check_size(field: &str, total: usize, errs: &mut Vec<FieldError>) {
    if total > MAX_OBJECT_SIZE {
        errs.push(err(field, FieldErrorKind::TooLong(MAX_OBJECT_SIZE)));
    }
}

/// Validates a ConfigMap as the API server would.
pub fn validate_config_map(cm: &ConfigMap) -> Vec<FieldError> {
    let mut errs = Vec::new();
    validate_object_meta(&cm.metadata, &mut errs);
    let data = cm.data.as_ref();
    let binary = cm.binary_data.as_ref();
    validate_keys("data", data.into_iter().flat_map(|d| d.keys()), &mut errs);
    validate_keys(
        "binaryData",
        binary.into_iter().flat_map(|d| d.keys()),
        &mut errs,
    );
    if let (Some(d), Some(b)) = (data, binary) {
        for k in d.keys().filter(|k| b.contains_key(*k)) {
            errs.push(invalid(
                format!("data[{k}]"),
                k,
                "duplicate of key present in binaryData",
            ));
        }
    }
    let total = data
        .into_iter()
        .flatten()
        .map(|(_, v)| v.len())
        .sum::<usize>()
        + binary
            .into_iter()
            .flatten()
            .map(|(_, v)| v.0.len())
            .sum::<usize>();
    check_size("data", total, &mut errs);
    errs
}

/// Merges a Secret's `stringData` into `data` (the string wins), as the API server does on write.
pub fn merge_string_data(secret: &mut Secret) {
    if let Some(strings) = secret.string_data.take() {
        let data = secret.data.get_or_insert_with(BTreeMap::new);
        for (k, v) in strings {
            data.insert(k, k8s_openapi::ByteString(v.into_bytes()));
        }
    }
}

/// Validates a Secret (with `stringData` already merged) as the API server would, including
/// the keys each built-in type requires.
pub fn validate_secret(secret: &Secret) -> Vec<FieldError> {
    let mut errs = Vec::new();
    validate_object_meta(&secret.metadata, &mut errs);
    let empty = BTreeMap::new();
    let data = secret.data.as_ref().unwrap_or(&empty);
    let string_data = secret.string_data.as_ref();
    validate_keys("data", data.keys(), &mut errs);
    validate_keys(
        "stringData",
        string_data.into_iter().flat_map(|d| d.keys()),
        &mut errs,
    );
    let total = data.values().map(|v| v.0.len()).sum::<usize>()
        + string_data
            .into_iter()
            .flatten()
            .map(|(_, v)| v.len())
            .sum::<usize>();
    check_size("data", total, &mut errs);
    let has = |k: &str| data.contains_key(k) || string_data.is_some_and(|s| s.contains_key(k));
    let value = |k: &str| -> Option<Vec<u8>> {
        string_data
            .and_then(|s| s.get(k).map(|v| v.as_bytes().to_vec()))
            .or_else(|| data.get(k).map(|v| v.0.clone()))
    };
    let require = |k: &str, errs: &mut Vec<FieldError>| {
        if !has(k) {
            errs.push(required(format!("data[{k}]")));
        }
    };
    let json = |k: &str, errs: &mut Vec<FieldError>| {
        require(k, errs);
        if let Some(v) = value(k) {
            if let Err(e) = serde_json::from_slice::<serde_json::Value>(&v) {
                errs.push(invalid(
                    format!("data[{k}]"),
                    "<secret contents redacted>",
                    e.to_string(),
                ));
            }
        }
    };
    match secret.type_.as_deref().unwrap_or("Opaque") {
        "kubernetes.io/service-account-token" => {
            let ann = "kubernetes.io/service-account.name";
            let named = secret
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ann))
                .is_some_and(|n| !n.is_empty());
            if !named {
                errs.push(required(format!("metadata.annotations[{ann}]")));
            }
        }
        "kubernetes.io/dockercfg" => json(".dockercfg", &mut errs),
        "kubernetes.io/dockerconfigjson" => json(".dockerconfigjson", &mut errs),
        "kubernetes.io/basic-auth" if !has("username") && !has("password") => {
            errs.push(err(
                "data[username]",
                FieldErrorKind::Required("one of username or password must be provided".into()),
            ));
        }
        "kubernetes.io/ssh-auth" => require("ssh-privatekey", &mut errs),
        "kubernetes.io/tls" => {
            require("tls.crt", &mut errs);
            require("tls.key", &mut errs);
        }
        _ => {}
    }
    errs
}

/// Why an item path is not a relative path that stays below the volume and avoids the writer's
/// reserved names (the API's `ValidateLocalNonReservedPath` and the atomic writer's limits).
pub fn item_path_errors(p: &str) -> Vec<String> {
    let mut out = Vec::new();
    if p.starts_with('/') {
        out.push("must be a relative path".into());
    }
    if has_backsteps(p) {
        out.push("must not contain '..'".into());
    }
    if p.starts_with("..") {
        out.push("must not start with '..'".into());
    }
    if p.len() > MAX_PATH_LENGTH {
        out.push(format!("must be no more than {MAX_PATH_LENGTH} bytes"));
    }
    if p.split('/').any(|e| e.len() > MAX_PATH_ELEMENT) {
        out.push(format!(
            "each path element must be no more than {MAX_PATH_ELEMENT} bytes"
        ));
    }
    let depth = p.split('/').filter(|e| !e.is_empty() && *e != ".").count();
    if depth > MAX_ITEM_DEPTH {
        out.push(format!(
            "must have at most {MAX_ITEM_DEPTH} path elements (it has {depth}): kubevol makes a directory of the volume for each, and refuses deeper paths"
        ));
    }
    out
}

/// The most path elements an item path may have: each but the last is a directory the writer
/// makes in the volume (and counts in the pod's budget). The API allows a path of 4,096 bytes,
/// 2,048 levels; kubevol refuses more than this, which no real volume comes near (60 items of
/// 300 levels made 181,855 directories, 714 MB of ext4, in ten volumes of one key).
pub const MAX_ITEM_DEPTH: usize = 32;

/// A relative path with empty and `.` elements removed (`./a//b/` is `a/b`); `""` if nothing is
/// left. Paths with `..` never get here.
pub fn clean_item_path(p: &str) -> String {
    p.split('/')
        .filter(|e| !e.is_empty() && *e != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// Checks the item paths of one volume for collisions: equal strings (the API's check), equal
/// after cleaning, or one a directory of the other. `paths` holds (field, path) pairs.
pub fn path_collision_errors(paths: &[(String, &str)]) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let mut seen: BTreeMap<String, &str> = BTreeMap::new();
    for (field, p) in paths {
        let clean = clean_item_path(p);
        if clean.is_empty() {
            errs.push(invalid(field, p, "must name a file below the volume"));
            continue;
        }
        if let Some(other) = seen.get(&clean) {
            let detail = if *other == *p {
                "conflicting duplicate paths".to_string()
            } else {
                format!("conflicting duplicate paths: {p:?} and {other:?} name the same file")
            };
            errs.push(invalid(field, p, detail));
            continue;
        }
        let mut prefix = String::new();
        for elem in clean.split('/') {
            if !prefix.is_empty() {
                if let Some(other) = seen.get(&prefix) {
                    errs.push(invalid(
                        field,
                        p,
                        format!("conflicts with path {other:?}: it would have to be both a file and a directory"),
                    ));
                }
                prefix.push('/');
            }
            prefix.push_str(elem);
        }
        let dir = format!("{clean}/");
        if let Some((_, other)) = seen
            .range(dir.clone()..)
            .next()
            .filter(|(k, _)| k.starts_with(&dir))
        {
            errs.push(invalid(
                field,
                p,
                format!("conflicts with path {other:?}: it would have to be both a file and a directory"),
            ));
        }
        seen.insert(clean, p);
    }
    errs
}

fn check_mode(field: String, mode: Option<i32>, errs: &mut Vec<FieldError>) {
    if let Some(m) = mode {
        if !(0..=MAX_MODE).contains(&m) {
            errs.push(invalid(field, &m.to_string(), MODE_MSG));
        }
    }
}

fn check_item_path(field: &str, p: &str, errs: &mut Vec<FieldError>) {
    if p.is_empty() {
        errs.push(required(field));
    }
    for d in item_path_errors(p) {
        errs.push(invalid(field, p, d));
    }
}

fn validate_key_to_paths<'a>(
    field: &str,
    items: &'a [KeyToPath],
    errs: &mut Vec<FieldError>,
    paths: &mut Vec<(String, &'a str)>,
) {
    for (i, item) in items.iter().enumerate() {
        let f = format!("{field}.items[{i}]");
        if item.key.is_empty() {
            errs.push(required(format!("{f}.key")));
        }
        check_item_path(&format!("{f}.path"), &item.path, errs);
        check_mode(format!("{f}.mode"), item.mode, errs);
        paths.push((format!("{f}.path"), item.path.as_str()));
    }
}

/// Whether `s` is a qualified name (`[prefix/]name`), as label and annotation keys are.
fn qualified_name_error(s: &str) -> Option<String> {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    if let Some(p) = prefix {
        if p.is_empty() {
            return Some("prefix part must be non-empty".into());
        }
        if let Some(d) = dns1123_subdomain_error(p) {
            return Some(format!("prefix part {d}"));
        }
    }
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
    (!ok).then(|| "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]'), at most 63 characters".into())
}

/// Splits `metadata.labels['key']` into (`metadata.labels`, `key`).
pub fn split_subscript(path: &str) -> Option<(&str, &str)> {
    let inner = path.strip_suffix("']")?;
    let (base, key) = inner.split_once("['")?;
    (!base.is_empty()).then_some((base, key))
}

const CPU_DIVISORS: [&str; 2] = ["1m", "1"];
const BYTE_DIVISORS: [&str; 13] = [
    "1", "1k", "1M", "1G", "1T", "1P", "1E", "1Ki", "1Mi", "1Gi", "1Ti", "1Pi", "1Ei",
];

fn validate_downward_items<'a>(
    field: &str,
    items: &'a [DownwardAPIVolumeFile],
    containers: &BTreeSet<&str>,
    errs: &mut Vec<FieldError>,
    paths: &mut Vec<(String, &'a str)>,
) {
    for (i, item) in items.iter().enumerate() {
        let f = format!("{field}.items[{i}]");
        check_item_path(&format!("{f}.path"), &item.path, errs);
        check_mode(format!("{f}.mode"), item.mode, errs);
        paths.push((format!("{f}.path"), item.path.as_str()));
        match (&item.field_ref, &item.resource_field_ref) {
            (Some(_), Some(_)) => errs.push(invalid(
                &f,
                "resource",
                "fieldRef and resourceFieldRef can not be specified simultaneously",
            )),
            (None, None) => errs.push(err(
                &f,
                FieldErrorKind::Required("one of fieldRef and resourceFieldRef is required".into()),
            )),
            (Some(r), None) => {
                let fp = format!("{f}.fieldRef.fieldPath");
                let version = r.api_version.as_deref().unwrap_or("v1");
                if !version.is_empty() && version != "v1" {
                    errs.push(err(
                        format!("{f}.fieldRef.apiVersion"),
                        FieldErrorKind::NotSupported {
                            value: version.into(),
                            allowed: vec!["v1"],
                        },
                    ));
                }
                match split_subscript(&r.field_path) {
                    Some((base @ ("metadata.labels" | "metadata.annotations"), key)) => {
                        if let Some(d) = qualified_name_error(key) {
                            errs.push(invalid(
                                &fp,
                                &r.field_path,
                                format!("invalid key in {base}: {d}"),
                            ));
                        }
                    }
                    _ if DOWNWARD_FIELD_PATHS.contains(&r.field_path.as_str()) => {}
                    _ if r.field_path.is_empty() => errs.push(required(fp)),
                    _ => errs.push(err(
                        fp,
                        FieldErrorKind::NotSupported {
                            value: r.field_path.clone(),
                            allowed: DOWNWARD_FIELD_PATHS.to_vec(),
                        },
                    )),
                }
            }
            (None, Some(r)) => {
                let rf = format!("{f}.resourceFieldRef");
                match r.container_name.as_deref().unwrap_or("") {
                    "" => errs.push(required(format!("{rf}.containerName"))),
                    c if !containers.contains(c) => errs.push(err(
                        format!("{rf}.containerName"),
                        FieldErrorKind::NotFound(c.into()),
                    )),
                    _ => {}
                }
                let hugepages = r
                    .resource
                    .strip_prefix("limits.hugepages-")
                    .or_else(|| r.resource.strip_prefix("requests.hugepages-"))
                    .is_some_and(|size| Quantity::parse(size).is_ok_and(|q| q.value() > 0));
                if !hugepages && !DOWNWARD_RESOURCES.contains(&r.resource.as_str()) {
                    errs.push(err(
                        format!("{rf}.resource"),
                        FieldErrorKind::NotSupported {
                            value: r.resource.clone(),
                            allowed: DOWNWARD_RESOURCES.to_vec(),
                        },
                    ));
                }
                if let Some(div) = &r.divisor {
                    let cpu = r.resource.ends_with(".cpu");
                    let allowed: &[&str] = if cpu { &CPU_DIVISORS } else { &BYTE_DIVISORS };
                    let ok = Quantity::parse(&div.0).is_ok_and(|q| {
                        allowed
                            .iter()
                            .any(|a| Quantity::parse(a).is_ok_and(|a| same_quantity(a, q)))
                    });
                    if !ok {
                        let what = if cpu { "cpu" } else { "memory" };
                        errs.push(invalid(
                            format!("{rf}.divisor"),
                            &div.0,
                            format!(
                                "only divisor's values {} are supported with the {what} resource",
                                allowed.join(", ")
                            ),
                        ));
                    }
                }
            }
        }
    }
}

fn same_quantity(a: Quantity, b: Quantity) -> bool {
    a.value() == b.value() && a.milli_value() == b.milli_value()
}

/// The projected sources kubevol knows, by API field name.
fn projection_kinds(p: &k8s_openapi::api::core::v1::VolumeProjection) -> Vec<&'static str> {
    let mut out = Vec::new();
    if p.config_map.is_some() {
        out.push("configMap");
    }
    if p.secret.is_some() {
        out.push("secret");
    }
    if p.downward_api.is_some() {
        out.push("downwardAPI");
    }
    if p.service_account_token.is_some() {
        out.push("serviceAccountToken");
    }
    if p.cluster_trust_bundle.is_some() {
        out.push("clusterTrustBundle");
    }
    if p.pod_certificate.is_some() {
        out.push("podCertificate");
    }
    out
}

/// Validates the content volume sources of one volume. `containers` are the pod's container
/// names (a resourceFieldRef must name one of them).
pub(crate) fn validate_content_source(
    v: &Volume,
    path: &dyn std::fmt::Display,
    containers: &BTreeSet<&str>,
    errs: &mut Vec<FieldError>,
) {
    let mut paths: Vec<(String, &str)> = Vec::new();
    if let Some(cm) = &v.config_map {
        let f = format!("{path}.configMap");
        if cm.name.is_empty() {
            errs.push(required(format!("{f}.name")));
        }
        check_mode(format!("{f}.defaultMode"), cm.default_mode, errs);
        validate_key_to_paths(
            &f,
            cm.items.as_deref().unwrap_or_default(),
            errs,
            &mut paths,
        );
    }
    if let Some(s) = &v.secret {
        let f = format!("{path}.secret");
        if s.secret_name.as_deref().unwrap_or("").is_empty() {
            errs.push(required(format!("{f}.secretName")));
        }
        check_mode(format!("{f}.defaultMode"), s.default_mode, errs);
        validate_key_to_paths(&f, s.items.as_deref().unwrap_or_default(), errs, &mut paths);
    }
    if let Some(d) = &v.downward_api {
        let f = format!("{path}.downwardAPI");
        check_mode(format!("{f}.defaultMode"), d.default_mode, errs);
        validate_downward_items(
            &f,
            d.items.as_deref().unwrap_or_default(),
            containers,
            errs,
            &mut paths,
        );
    }
    if let Some(p) = &v.projected {
        let f = format!("{path}.projected");
        check_mode(format!("{f}.defaultMode"), p.default_mode, errs);
        for (i, src) in p.sources.iter().flatten().enumerate() {
            let sf = format!("{f}.sources[{i}]");
            exactly_one(
                &sf,
                &projection_kinds(src),
                "projection type",
                "must specify exactly one projection type",
                errs,
            );
            if let Some(cm) = &src.config_map {
                let f = format!("{sf}.configMap");
                if cm.name.is_empty() {
                    errs.push(required(format!("{f}.name")));
                }
                validate_key_to_paths(
                    &f,
                    cm.items.as_deref().unwrap_or_default(),
                    errs,
                    &mut paths,
                );
            }
            if let Some(s) = &src.secret {
                let f = format!("{sf}.secret");
                if s.name.is_empty() {
                    errs.push(required(format!("{f}.name")));
                }
                validate_key_to_paths(&f, s.items.as_deref().unwrap_or_default(), errs, &mut paths);
            }
            if let Some(d) = &src.downward_api {
                validate_downward_items(
                    &format!("{sf}.downwardAPI"),
                    d.items.as_deref().unwrap_or_default(),
                    containers,
                    errs,
                    &mut paths,
                );
            }
            if let Some(t) = &src.service_account_token {
                let f = format!("{sf}.serviceAccountToken");
                let secs = t.expiration_seconds.unwrap_or(3600);
                if secs < 600 {
                    errs.push(invalid(
                        format!("{f}.expirationSeconds"),
                        &secs.to_string(),
                        "may not specify a duration less than 10 minutes",
                    ));
                } else if secs > 1 << 32 {
                    errs.push(invalid(
                        format!("{f}.expirationSeconds"),
                        &secs.to_string(),
                        "may not specify a duration larger than 2^32 seconds",
                    ));
                }
                check_item_path(&format!("{f}.path"), &t.path, errs);
                paths.push((format!("{f}.path"), t.path.as_str()));
            }
            if let Some(b) = &src.cluster_trust_bundle {
                let f = format!("{sf}.clusterTrustBundle");
                match (b.name.as_deref(), b.signer_name.as_deref()) {
                    (Some(_), Some(_)) => errs.push(invalid(
                        &f,
                        "",
                        "only one of name and signerName may be used",
                    )),
                    (None, None) => errs.push(err(
                        &f,
                        FieldErrorKind::Required(
                            "either name or signerName must be specified".into(),
                        ),
                    )),
                    (Some(_), None) if b.label_selector.is_some() => errs.push(err(
                        format!("{f}.labelSelector"),
                        FieldErrorKind::Forbidden(
                            "labelSelector can only be used with signerName".into(),
                        ),
                    )),
                    _ => {}
                }
                check_item_path(&format!("{f}.path"), &b.path, errs);
                paths.push((format!("{f}.path"), b.path.as_str()));
            }
            if let Some(c) = &src.pod_certificate {
                validate_pod_certificate(&format!("{sf}.podCertificate"), c, errs, &mut paths);
            }
        }
    }
    if !paths.is_empty() {
        let valid: Vec<(String, &str)> = paths
            .into_iter()
            .filter(|(_, p)| !p.is_empty() && item_path_errors(p).is_empty())
            .collect();
        errs.extend(path_collision_errors(&valid));
    }
}

/// The key types the API allows a `podCertificate` source.
pub const POD_CERTIFICATE_KEY_TYPES: [&str; 6] = [
    "RSA3072",
    "RSA4096",
    "ECDSAP256",
    "ECDSAP384",
    "ECDSAP521",
    "ED25519",
];

/// The shortest and longest `maxExpirationSeconds` of a pod certificate (1 hour, 91 days; a
/// `kubernetes.io` signer's at most 24 hours).
const MIN_EXPIRATION: i32 = 3600;
const MAX_EXPIRATION: i32 = 91 * 24 * 3600;
const KUBERNETES_MAX_EXPIRATION: i32 = 24 * 3600;

/// Whether `signer` is one of the Kubernetes project's (`kubernetes.io/...`,
/// `*.kubernetes.io/...`).
fn is_kubernetes_signer(signer: &str) -> bool {
    let host = signer.split('/').next().unwrap_or_default();
    host == "kubernetes.io" || host.ends_with(".kubernetes.io")
}

/// Why `signer` is not a signer name (`example.com/name`: a domain of at least two labels, one
/// `/`, then DNS-1123 subdomains), as the API server checks it.
fn signer_name_errors(signer: &str) -> Vec<String> {
    let Some((domain, path)) = signer.split_once('/').filter(|(_, p)| !p.contains('/')) else {
        return vec![
            "must be a fully qualified domain and path of the form 'example.com/signer-name'"
                .into(),
        ];
    };
    let mut out = Vec::new();
    if domain.len() > 253 {
        out.push("must have at most 253 bytes".into());
    }
    if let Some(e) = domain
        .split('.')
        .find_map(|l| super::dns1123_label_error(l).map(|e| format!("validating label {l:?}: {e}")))
    {
        out.push(e);
    }
    if !domain.contains('.') {
        out.push("should be a domain with at least two segments separated by dots".into());
    }
    if let Some(e) = path
        .split('.')
        .find_map(|l| dns1123_subdomain_error(l).map(|e| format!("validating label {l:?}: {e}")))
    {
        out.push(e);
    }
    out
}

/// Validates a `podCertificate` projected source at `f`, collecting its paths.
fn validate_pod_certificate<'a>(
    f: &str,
    c: &'a k8s_openapi::api::core::v1::PodCertificateProjection,
    errs: &mut Vec<FieldError>,
    paths: &mut Vec<(String, &'a str)>,
) {
    if c.signer_name.is_empty() {
        errs.push(required(format!("{f}.signerName")));
    } else {
        for e in signer_name_errors(&c.signer_name) {
            errs.push(invalid(format!("{f}.signerName"), &c.signer_name, e));
        }
    }
    let annotations = c.user_annotations.iter().flatten();
    for (k, _) in annotations.clone() {
        let key = k.to_lowercase();
        let problem = qualified_name_error(&key).or_else(|| {
            (!key.contains('/'))
                .then(|| "must be a domain-prefixed key (such as \"acme.io/foo\")".into())
        });
        if let Some(e) = problem {
            errs.push(invalid(format!("{f}.userAnnotations"), k, e));
        }
    }
    let size: usize = annotations.map(|(k, v)| k.len() + v.len()).sum();
    if size > 256 * 1024 {
        errs.push(err(
            format!("{f}.userAnnotations"),
            FieldErrorKind::TooLong(256 * 1024),
        ));
    }
    if !POD_CERTIFICATE_KEY_TYPES.contains(&c.key_type.as_str()) {
        errs.push(err(
            format!("{f}.keyType"),
            FieldErrorKind::NotSupported {
                value: c.key_type.clone(),
                allowed: POD_CERTIFICATE_KEY_TYPES.to_vec(),
            },
        ));
    }
    if let Some(secs) = c.max_expiration_seconds {
        let max = if is_kubernetes_signer(&c.signer_name) {
            KUBERNETES_MAX_EXPIRATION
        } else {
            MAX_EXPIRATION
        };
        if secs < MIN_EXPIRATION {
            errs.push(invalid(
                format!("{f}.maxExpirationSeconds"),
                &secs.to_string(),
                "if provided, maxExpirationSeconds must be >= 3600",
            ));
        } else if secs > max {
            errs.push(invalid(
                format!("{f}.maxExpirationSeconds"),
                &secs.to_string(),
                format!("if provided, maxExpirationSeconds must be <= {max}"),
            ));
        }
    }
    let named = [
        ("credentialBundlePath", &c.credential_bundle_path),
        ("keyPath", &c.key_path),
        ("certificateChainPath", &c.certificate_chain_path),
    ];
    let mut any = false;
    for (name, p) in named {
        let Some(p) = p.as_deref().filter(|p| !p.is_empty()) else {
            continue;
        };
        any = true;
        check_item_path(&format!("{f}.{name}"), p, errs);
        paths.push((format!("{f}.{name}"), p));
    }
    if !any {
        errs.push(err(
            f,
            FieldErrorKind::Required(
                "specify at least one of credentialBundlePath, keyPath, and certificateChainPath"
                    .into(),
            ),
        ));
    }
}

/// The pod's container names (init and regular), for resourceFieldRef checks.
pub(crate) fn container_names(pod: &Pod) -> BTreeSet<&str> {
    super::all_containers(pod)
        .into_iter()
        .map(|(_, c)| c.name.as_str())
        .collect()
}

#[cfg(test)]
mod tests;
