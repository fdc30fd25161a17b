//! What the content volumes hold: the files a configMap, secret, downwardAPI or projected volume
//! projects, computed from the pod and the objects it references, and the environment a
//! container's `subPathExpr` is expanded with.
//!
//! Pure functions of values: the plugins hand the result to the atomic writer. The formats are
//! the kubelet's: labels and annotations as sorted `key="value"` lines with Go string quoting,
//! resource values divided by the divisor and rounded up, default file mode 0644.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    ClusterTrustBundleProjection, ConfigMap, Container, DownwardAPIVolumeFile, KeyToPath,
    ObjectFieldSelector, Pod, PodCertificateProjection, ResourceFieldSelector, Secret,
    ServiceAccountTokenProjection, Volume, VolumeProjection,
};

use crate::quantity::Quantity;
use crate::validation::{clean_item_path, item_path_errors, split_subscript};

/// The default mode of projected files (`0644`).
pub const DEFAULT_MODE: u32 = 0o644;

/// One file of a volume's payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileProjection {
    /// The content.
    pub data: Vec<u8>,
    /// The permission bits.
    pub mode: u32,
}

/// A volume's files by cleaned relative path.
pub type Payload = BTreeMap<String, FileProjection>;

/// The result of looking an object up.
#[derive(Clone, Debug)]
pub enum Lookup<T> {
    /// The object, valid.
    Found(Arc<T>),
    /// The object exists but is invalid; the message says where and why.
    Invalid(String),
    /// No such object.
    Missing,
}

/// Where the objects a pod references come from.
pub trait Objects {
    /// A ConfigMap by namespace and name.
    fn config_map(&self, namespace: &str, name: &str) -> Lookup<ConfigMap>;
    /// A Secret by namespace and name.
    fn secret(&self, namespace: &str, name: &str) -> Lookup<Secret>;
    /// The token of the `serviceAccountToken` source `index` of the volume being projected
    /// (fetched beforehand: projection does no I/O), or `None` where no API server issues
    /// tokens.
    fn service_account_token(&self, index: usize) -> Option<Result<String, String>> {
        let _ = index;
        None
    }
    /// The PEM bundle of the `clusterTrustBundle` source `index` (fetched beforehand), `Ok(None)`
    /// when no ClusterTrustBundle matches, or `None` where there is no API server.
    fn cluster_trust_bundle(&self, index: usize) -> Option<Result<Option<String>, String>> {
        let _ = index;
        None
    }
    /// The key and certificate chain of the `podCertificate` source `index` (fetched
    /// beforehand), or why there are none yet; `None` where there is no API server.
    fn pod_certificate(&self, index: usize) -> Option<Result<Credentials, CredentialsError>> {
        let _ = index;
        None
    }
    /// Whether an API server is there (a node of a cluster): a podCertificate source without
    /// a place to make requests is then the node agent's gap, not the lack of a cluster.
    fn in_cluster(&self) -> bool {
        false
    }
}

/// A private key and the certificate chain issued for it, as PEM (a `podCertificate`
/// source's files). Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The PKCS#8 private key, one `PRIVATE KEY` block.
    pub key_pem: Vec<u8>,
    /// The chain, leaf first, `CERTIFICATE` blocks.
    pub chain_pem: Vec<u8>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("chain_bytes", &self.chain_pem.len())
            .finish_non_exhaustive()
    }
}

/// Why a `podCertificate` source has no credentials.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CredentialsError {
    /// What happened, and what to do.
    pub detail: String,
    /// The signer denied or failed the request for good: only a change of the pod helps.
    pub permanent: bool,
}

/// The node's allocatable resources: what a container without a limit is limited by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeAllocatable {
    /// CPU in millicores.
    pub cpu_milli: i64,
    /// Memory in bytes.
    pub memory: i64,
    /// Ephemeral storage in bytes.
    pub ephemeral_storage: i64,
}

/// The kind of a referenced object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKind {
    /// A ConfigMap.
    ConfigMap,
    /// A Secret.
    Secret,
}

impl std::fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ObjectKind::ConfigMap => "configMap",
            ObjectKind::Secret => "secret",
        })
    }
}

/// A referenced object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectRef {
    /// Its kind.
    pub kind: ObjectKind,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// Why a payload could not be computed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProjectionError {
    /// A referenced object does not exist and the volume is not optional.
    #[error("{kind} {namespace}/{name} not found; create it, or set optional: true to mount the volume without it")]
    MissingObject {
        /// Its kind.
        kind: ObjectKind,
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// An item names a key the object does not have and the volume is not optional.
    #[error("{kind} {namespace}/{name} has no key {key:?}; add the key, fix items[].key, or set optional: true to skip it")]
    MissingKey {
        /// The object's kind.
        kind: ObjectKind,
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The key.
        key: String,
    },
    /// A referenced object is invalid.
    #[error("{kind} {namespace}/{name} is invalid: {detail}")]
    InvalidObject {
        /// Its kind.
        kind: ObjectKind,
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// What is wrong, and where it was defined.
        detail: String,
    },
    /// A projected source kubevol cannot serve without a cluster.
    #[error("projected source {kind} (sources[{index}]) needs a Kubernetes API server, which standalone mode does not have; remove the source or run kubevol as a cluster node agent")]
    NeedsCluster {
        /// The source's field name.
        kind: &'static str,
        /// Its index in `sources`.
        index: usize,
    },
    /// A cluster trust bundle could not be read, or none matches a source that is not optional.
    #[error("projected source clusterTrustBundle (sources[{index}]): {detail}")]
    TrustBundle {
        /// Its index in `sources`.
        index: usize,
        /// Why.
        detail: String,
    },
    /// A pod certificate is not issued (yet, or for good).
    #[error("projected source podCertificate (sources[{index}]): {}", .error.detail)]
    Certificate {
        /// Its index in `sources`.
        index: usize,
        /// Why.
        error: CredentialsError,
    },
    /// A service account token could not be had from the API server.
    #[error("projected source serviceAccountToken (sources[{index}]): {detail}")]
    Token {
        /// Its index in `sources`.
        index: usize,
        /// Why (the API server's answer).
        detail: String,
    },
    /// A downward API field or resource cannot be resolved.
    #[error("{field}: {detail}")]
    Field {
        /// The item's field path.
        field: String,
        /// Why.
        detail: String,
    },
    /// An item path is invalid (validation normally catches this first).
    #[error("item path {path:?}: {detail}")]
    Path {
        /// The path.
        path: String,
        /// Why.
        detail: String,
    },
}

impl ProjectionError {
    /// Whether retrying can help without the pod changing (a missing object may appear).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ProjectionError::MissingObject { .. }
                | ProjectionError::MissingKey { .. }
                | ProjectionError::InvalidObject { .. }
                | ProjectionError::Token { .. }
                | ProjectionError::TrustBundle { .. }
        ) || matches!(self, ProjectionError::Certificate { error, .. } if !error.permanent)
    }
}

fn mode_of(m: Option<i32>, default: u32) -> u32 {
    m.map(|m| m as u32 & 0o777).unwrap_or(default)
}

fn insert(payload: &mut Payload, path: &str, file: FileProjection) -> Result<(), ProjectionError> {
    if let Some(detail) = item_path_errors(path).into_iter().next() {
        return Err(ProjectionError::Path {
            path: path.into(),
            detail,
        });
    }
    let clean = clean_item_path(path);
    if clean.is_empty() {
        return Err(ProjectionError::Path {
            path: path.into(),
            detail: "must name a file below the volume".into(),
        });
    }
    if payload.insert(clean, file).is_some() {
        return Err(ProjectionError::Path {
            path: path.into(),
            detail: "conflicting duplicate paths".into(),
        });
    }
    Ok(())
}

struct KeyedSource<'a> {
    kind: ObjectKind,
    namespace: &'a str,
    name: &'a str,
    items: &'a [KeyToPath],
    optional: bool,
    default_mode: u32,
}

/// Projects keyed data (a ConfigMap's `data` and `binaryData`, a Secret's `data`).
fn project_keyed(
    src: &KeyedSource<'_>,
    data: &BTreeMap<&str, &[u8]>,
    payload: &mut Payload,
) -> Result<(), ProjectionError> {
    if src.items.is_empty() {
        for (k, v) in data {
            insert(
                payload,
                k,
                FileProjection {
                    data: v.to_vec(),
                    mode: src.default_mode,
                },
            )?;
        }
        return Ok(());
    }
    for item in src.items {
        let Some(v) = data.get(item.key.as_str()) else {
            if src.optional {
                continue;
            }
            return Err(ProjectionError::MissingKey {
                kind: src.kind,
                namespace: src.namespace.into(),
                name: src.name.into(),
                key: item.key.clone(),
            });
        };
        insert(
            payload,
            &item.path,
            FileProjection {
                data: v.to_vec(),
                mode: mode_of(item.mode, src.default_mode),
            },
        )?;
    }
    Ok(())
}

fn lookup_failed<T>(
    src: &KeyedSource<'_>,
    found: Lookup<T>,
) -> Result<Option<Arc<T>>, ProjectionError> {
    match found {
        Lookup::Found(o) => Ok(Some(o)),
        Lookup::Missing if src.optional => Ok(None),
        Lookup::Missing => Err(ProjectionError::MissingObject {
            kind: src.kind,
            namespace: src.namespace.into(),
            name: src.name.into(),
        }),
        Lookup::Invalid(detail) => Err(ProjectionError::InvalidObject {
            kind: src.kind,
            namespace: src.namespace.into(),
            name: src.name.into(),
            detail,
        }),
    }
}

fn project_source(
    src: &KeyedSource<'_>,
    objects: &dyn Objects,
    payload: &mut Payload,
) -> Result<(), ProjectionError> {
    match src.kind {
        ObjectKind::ConfigMap => {
            let Some(cm) = lookup_failed(src, objects.config_map(src.namespace, src.name))? else {
                return Ok(());
            };
            let mut data: BTreeMap<&str, &[u8]> = BTreeMap::new();
            for (k, v) in cm.data.iter().flatten() {
                data.insert(k, v.as_bytes());
            }
            for (k, v) in cm.binary_data.iter().flatten() {
                data.insert(k, &v.0);
            }
            project_keyed(src, &data, payload)
        }
        ObjectKind::Secret => {
            let Some(s) = lookup_failed(src, objects.secret(src.namespace, src.name))? else {
                return Ok(());
            };
            let mut data: BTreeMap<&str, &[u8]> = BTreeMap::new();
            for (k, v) in s.data.iter().flatten() {
                data.insert(k, &v.0);
            }
            for (k, v) in s.string_data.iter().flatten() {
                data.insert(k, v.as_bytes());
            }
            project_keyed(src, &data, payload)
        }
    }
}

/// The pod's namespace (`default` when unset).
pub fn pod_namespace(pod: &Pod) -> &str {
    pod.metadata
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .unwrap_or("default")
}

/// One source of a content volume's files.
enum Source<'a> {
    /// Keys of a ConfigMap or Secret.
    Keyed(KeyedSource<'a>),
    /// Downward API items (`field` names them in errors).
    Downward {
        field: String,
        items: &'a [DownwardAPIVolumeFile],
        default_mode: u32,
    },
    /// A service account token, written at `path`.
    Token {
        index: usize,
        path: &'a str,
        mode: u32,
    },
    /// A cluster trust bundle, written at `path`.
    TrustBundle {
        index: usize,
        path: &'a str,
        mode: u32,
        optional: bool,
    },
    /// A pod certificate's key (`key`), chain (`chain`) and both (`bundle`), where asked.
    Certificate {
        index: usize,
        bundle: Option<&'a str>,
        key: Option<&'a str>,
        chain: Option<&'a str>,
        mode: u32,
    },
    /// A projected source of no kind (validation refuses it first).
    Empty { index: usize },
}

/// The mode of a token's or key's file: the volume's, but `0600` where the pod has an fsGroup
/// (the group's read access is then added by the writer), as the kubelet writes them.
fn secret_file_mode(pod: &Pod, mode: u32) -> u32 {
    let fs_group = pod
        .spec
        .as_ref()
        .and_then(|s| s.security_context.as_ref())
        .and_then(|c| c.fs_group);
    if fs_group.is_some() {
        0o600
    } else {
        mode
    }
}

/// The sources of a content volume, in order, or `None` if the volume is not one. The payload,
/// the referenced objects and the reads of pod fields all come from this one walk.
fn sources<'a>(pod: &'a Pod, volume: &'a Volume) -> Option<Vec<Source<'a>>> {
    let namespace = pod_namespace(pod);
    let keyed = |kind,
                 name: &'a str,
                 items: &'a Option<Vec<KeyToPath>>,
                 optional: Option<bool>,
                 default_mode| {
        Source::Keyed(KeyedSource {
            kind,
            namespace,
            name,
            items: items.as_deref().unwrap_or_default(),
            optional: optional.unwrap_or(false),
            default_mode,
        })
    };
    let downward = |field: String, items: &'a Option<Vec<DownwardAPIVolumeFile>>, default_mode| {
        Source::Downward {
            field,
            items: items.as_deref().unwrap_or_default(),
            default_mode,
        }
    };
    if let Some(cm) = &volume.config_map {
        let mode = mode_of(cm.default_mode, DEFAULT_MODE);
        return Some(vec![keyed(
            ObjectKind::ConfigMap,
            &cm.name,
            &cm.items,
            cm.optional,
            mode,
        )]);
    }
    if let Some(s) = &volume.secret {
        let mode = mode_of(s.default_mode, DEFAULT_MODE);
        let name = s.secret_name.as_deref().unwrap_or_default();
        return Some(vec![keyed(
            ObjectKind::Secret,
            name,
            &s.items,
            s.optional,
            mode,
        )]);
    }
    if let Some(d) = &volume.downward_api {
        let mode = mode_of(d.default_mode, DEFAULT_MODE);
        return Some(vec![downward("downwardAPI".into(), &d.items, mode)]);
    }
    let p = volume.projected.as_ref()?;
    let mode = mode_of(p.default_mode, DEFAULT_MODE);
    let mut out = Vec::new();
    for (index, s) in p.sources.iter().flatten().enumerate() {
        out.push(if let Some(cm) = &s.config_map {
            keyed(
                ObjectKind::ConfigMap,
                &cm.name,
                &cm.items,
                cm.optional,
                mode,
            )
        } else if let Some(sec) = &s.secret {
            keyed(
                ObjectKind::Secret,
                &sec.name,
                &sec.items,
                sec.optional,
                mode,
            )
        } else if let Some(d) = &s.downward_api {
            downward(
                format!("projected.sources[{index}].downwardAPI"),
                &d.items,
                mode,
            )
        } else if let Some(t) = &s.service_account_token {
            Source::Token {
                index,
                path: &t.path,
                mode: secret_file_mode(pod, mode),
            }
        } else if let Some(b) = &s.cluster_trust_bundle {
            Source::TrustBundle {
                index,
                path: &b.path,
                mode,
                optional: b.optional.unwrap_or(false),
            }
        } else if let Some(c) = &s.pod_certificate {
            let path = |p: &'a Option<String>| p.as_deref().filter(|p| !p.is_empty());
            Source::Certificate {
                index,
                bundle: path(&c.credential_bundle_path),
                key: path(&c.key_path),
                chain: path(&c.certificate_chain_path),
                mode: secret_file_mode(pod, mode),
            }
        } else {
            Source::Empty { index }
        });
    }
    Some(out)
}

/// Computes the payload of a content volume, or `None` if the volume is not one.
pub fn volume_payload(
    pod: &Pod,
    volume: &Volume,
    objects: &dyn Objects,
    node: &NodeAllocatable,
) -> Option<Result<Payload, ProjectionError>> {
    let sources = sources(pod, volume)?;
    Some(project(pod, sources, objects, node))
}

fn project(
    pod: &Pod,
    sources: Vec<Source<'_>>,
    objects: &dyn Objects,
    node: &NodeAllocatable,
) -> Result<Payload, ProjectionError> {
    let mut payload = Payload::new();
    for source in sources {
        match source {
            Source::Keyed(src) => project_source(&src, objects, &mut payload)?,
            Source::Downward {
                field,
                items,
                default_mode,
            } => project_downward(pod, &field, items, default_mode, node, &mut payload)?,
            Source::Token { index, path, mode } => match objects.service_account_token(index) {
                None => {
                    return Err(ProjectionError::NeedsCluster {
                        kind: "serviceAccountToken",
                        index,
                    })
                }
                Some(Err(detail)) => return Err(ProjectionError::Token { index, detail }),
                Some(Ok(token)) => insert(
                    &mut payload,
                    path,
                    FileProjection {
                        data: token.into_bytes(),
                        mode,
                    },
                )?,
            },
            Source::TrustBundle {
                index,
                path,
                mode,
                optional,
            } => match objects.cluster_trust_bundle(index) {
                None => {
                    return Err(ProjectionError::NeedsCluster {
                        kind: "clusterTrustBundle",
                        index,
                    })
                }
                Some(Err(detail)) => return Err(ProjectionError::TrustBundle { index, detail }),
                Some(Ok(None)) if optional => {}
                Some(Ok(None)) => {
                    return Err(ProjectionError::TrustBundle {
                        index,
                        detail: "no ClusterTrustBundle matches; create one, or set optional: true"
                            .into(),
                    })
                }
                Some(Ok(Some(pem))) => insert(
                    &mut payload,
                    path,
                    FileProjection {
                        data: pem.into_bytes(),
                        mode,
                    },
                )?,
            },
            Source::Certificate {
                index,
                bundle,
                key,
                chain,
                mode,
            } => {
                let credentials = match objects.pod_certificate(index) {
                    None if objects.in_cluster() => {
                        return Err(ProjectionError::Certificate {
                            index,
                            error: CredentialsError {
                                detail: "this node agent makes no PodCertificateRequests (an agent embedding kubevol sets where with VolumeManager::set_certificate_requests)".into(),
                                permanent: true,
                            },
                        })
                    }
                    None => {
                        return Err(ProjectionError::NeedsCluster {
                            kind: "podCertificate",
                            index,
                        })
                    }
                    Some(Err(error)) => return Err(ProjectionError::Certificate { index, error }),
                    Some(Ok(c)) => c,
                };
                let file = |data: Vec<u8>| FileProjection { data, mode };
                if let Some(path) = bundle {
                    let mut data = credentials.key_pem.clone();
                    data.extend_from_slice(&credentials.chain_pem);
                    insert(&mut payload, path, file(data))?;
                }
                if let Some(path) = key {
                    insert(&mut payload, path, file(credentials.key_pem.clone()))?;
                }
                if let Some(path) = chain {
                    insert(&mut payload, path, file(credentials.chain_pem.clone()))?;
                }
            }
            Source::Empty { index } => {
                return Err(ProjectionError::Field {
                    field: format!("projected.sources[{index}]"),
                    detail: "names no source: set one of configMap, secret, downwardAPI, serviceAccountToken, clusterTrustBundle and podCertificate".into(),
                })
            }
        }
    }
    Ok(payload)
}

/// The sources of a projected volume that `pick` finds a kind in, with their index in
/// `sources`.
fn sources_of<'v, T>(
    volume: &'v Volume,
    pick: impl Fn(&'v VolumeProjection) -> Option<&'v T>,
) -> Vec<(usize, &'v T)> {
    volume
        .projected
        .iter()
        .flat_map(|p| p.sources.iter().flatten())
        .enumerate()
        .filter_map(|(i, s)| Some((i, pick(s)?)))
        .collect()
}

/// The `clusterTrustBundle` sources of a projected volume, with their index in `sources`.
pub fn trust_bundle_sources(volume: &Volume) -> Vec<(usize, &ClusterTrustBundleProjection)> {
    sources_of(volume, |s| s.cluster_trust_bundle.as_ref())
}

/// The `serviceAccountToken` sources of a projected volume, with their index in `sources`.
pub fn token_sources(volume: &Volume) -> Vec<(usize, &ServiceAccountTokenProjection)> {
    sources_of(volume, |s| s.service_account_token.as_ref())
}

/// The `podCertificate` sources of a projected volume, with their index in `sources`.
pub fn certificate_sources(volume: &Volume) -> Vec<(usize, &PodCertificateProjection)> {
    sources_of(volume, |s| s.pod_certificate.as_ref())
}

/// The objects a volume reads: a change to any of them rewrites the volume.
pub fn referenced_objects(pod: &Pod, volume: &Volume) -> Vec<ObjectRef> {
    sources(pod, volume)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|s| match s {
            Source::Keyed(k) => Some(ObjectRef {
                kind: k.kind,
                namespace: k.namespace.to_string(),
                name: k.name.to_string(),
            }),
            _ => None,
        })
        .collect()
}

fn project_downward(
    pod: &Pod,
    field: &str,
    items: &[DownwardAPIVolumeFile],
    default_mode: u32,
    node: &NodeAllocatable,
    payload: &mut Payload,
) -> Result<(), ProjectionError> {
    for (i, item) in items.iter().enumerate() {
        let f = format!("{field}.items[{i}]");
        let value = match (&item.field_ref, &item.resource_field_ref) {
            (Some(r), None) => field_value(pod, r).map_err(|detail| ProjectionError::Field {
                field: format!("{f}.fieldRef"),
                detail,
            })?,
            (None, Some(r)) => {
                resource_value(pod, r, None, node).map_err(|detail| ProjectionError::Field {
                    field: format!("{f}.resourceFieldRef"),
                    detail,
                })?
            }
            _ => {
                return Err(ProjectionError::Field {
                    field: f,
                    detail: "exactly one of fieldRef and resourceFieldRef is required".into(),
                })
            }
        };
        insert(
            payload,
            &item.path,
            FileProjection {
                data: value.into_bytes(),
                mode: mode_of(item.mode, default_mode),
            },
        )?;
    }
    Ok(())
}

/// Quotes a string as Go's `%q` does (the kubelet's label and annotation format).
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\u{b}' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c if c.is_control() => {
                let n = c as u32;
                if n <= 0xffff {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Labels or annotations as the kubelet writes them: sorted `key="value"` lines, no trailing
/// newline.
pub fn format_map(m: Option<&BTreeMap<String, String>>) -> String {
    m.into_iter()
        .flatten()
        .map(|(k, v)| format!("{k}={}", go_quote(v)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The value of a downward API fieldRef (the fields a volume may read).
pub fn field_value(pod: &Pod, r: &ObjectFieldSelector) -> Result<String, String> {
    let meta = &pod.metadata;
    if let Some((base, key)) = split_subscript(&r.field_path) {
        let map = match base {
            "metadata.labels" => meta.labels.as_ref(),
            "metadata.annotations" => meta.annotations.as_ref(),
            _ => return Err(format!("unsupported fieldPath {:?}", r.field_path)),
        };
        return Ok(map.and_then(|m| m.get(key)).cloned().unwrap_or_default());
    }
    Ok(match r.field_path.as_str() {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => pod_namespace(pod).to_string(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => format_map(meta.labels.as_ref()),
        "metadata.annotations" => format_map(meta.annotations.as_ref()),
        other => return Err(format!("unsupported fieldPath {other:?}")),
    })
}

fn container_named<'a>(pod: &'a Pod, name: &str) -> Option<&'a Container> {
    let spec = pod.spec.as_ref()?;
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find(|c| c.name == name)
}

fn div_ceil(a: i64, b: i64) -> i64 {
    if b <= 0 {
        return a;
    }
    if a <= 0 {
        return a / b;
    }
    (a + b - 1) / b
}

/// The value of a resourceFieldRef: the container's limit or request divided by the divisor,
/// rounded up. A missing limit is the node's allocatable; a missing request is the limit when
/// one is set (the API server's defaulting), else zero. `container` overrides the selector's
/// container name (an env var refers to its own container).
pub fn resource_value(
    pod: &Pod,
    r: &ResourceFieldSelector,
    container: Option<&str>,
    node: &NodeAllocatable,
) -> Result<String, String> {
    let name = container
        .or(r.container_name.as_deref())
        .filter(|n| !n.is_empty())
        .ok_or("containerName is required")?;
    let c = container_named(pod, name).ok_or_else(|| format!("container {name:?} not found"))?;
    let (kind, res) = r
        .resource
        .split_once('.')
        .ok_or_else(|| format!("unsupported resource {:?}", r.resource))?;
    let get = |m: Option<
        &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| { m.and_then(|m| m.get(res)).map(|q| Quantity::parse(&q.0)) };
    let resources = c.resources.as_ref();
    let limit = get(resources.and_then(|r| r.limits.as_ref()));
    let request = get(resources.and_then(|r| r.requests.as_ref()));
    let parsed = match kind {
        "limits" => limit,
        "requests" => request.or(limit),
        _ => return Err(format!("unsupported resource {:?}", r.resource)),
    };
    let q = match parsed {
        Some(q) => Some(q.map_err(|e| format!("{}: {e}", r.resource))?),
        None => None,
    };
    let divisor = match &r.divisor {
        Some(d) => Quantity::parse(&d.0).map_err(|e| format!("divisor {:?}: {e}", d.0))?,
        None => Quantity::parse("1").map_err(|e| e.to_string())?,
    };
    let v = match res {
        "cpu" => {
            let milli = match (q, kind) {
                (Some(q), _) => q.milli_value(),
                (None, "limits") => node.cpu_milli,
                (None, _) => 0,
            };
            div_ceil(milli, divisor.milli_value())
        }
        "memory" | "ephemeral-storage" => {
            let bytes = match (q, kind) {
                (Some(q), _) => q.value(),
                (None, "limits") if res == "memory" => node.memory,
                (None, "limits") => node.ephemeral_storage,
                (None, _) => 0,
            };
            div_ceil(bytes, divisor.value())
        }
        r if r.starts_with("hugepages-") => {
            div_ceil(q.map(|q| q.value()).unwrap_or(0), divisor.value())
        }
        other => return Err(format!("unsupported resource {other:?}")),
    };
    Ok(v.to_string())
}

/// A container's environment, and which of its variables carry a Secret's value (read with
/// `secretKeyRef`, or expanded from such a variable): those values never appear in a message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerEnv {
    /// The variables' values.
    pub values: BTreeMap<String, String>,
    /// The names of the variables whose value comes from a Secret.
    pub secret: std::collections::BTreeSet<String>,
}

impl ContainerEnv {
    /// The Secret-derived values, to be kept out of messages.
    pub fn secret_values(&self) -> Vec<String> {
        self.secret
            .iter()
            .filter_map(|n| self.values.get(n))
            .filter(|v| !v.is_empty())
            .cloned()
            .collect()
    }
}

/// `text` with every one of `secrets` (longest first) replaced by a placeholder: a message
/// about something a Secret's value went into.
pub fn redact(text: &str, secrets: &[String]) -> String {
    let mut secrets: Vec<&String> = secrets.iter().filter(|s| !s.is_empty()).collect();
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.into_iter().fold(text.to_string(), |t, s| {
        t.replace(s.as_str(), "<redacted: a Secret's value>")
    })
}

/// A container's environment as far as a node can resolve it without a cluster: literal values
/// (with `$(VAR)` references to earlier variables expanded), downward API fields and resources,
/// and ConfigMap and Secret keys. Variables that cannot be resolved are left out, so a
/// `subPathExpr` that uses them fails with a message naming them.
pub fn container_env(
    pod: &Pod,
    container: &Container,
    node_name: &str,
    objects: &dyn Objects,
    node: &NodeAllocatable,
) -> ContainerEnv {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let mut secret = std::collections::BTreeSet::new();
    let ns = pod_namespace(pod);
    for var in container.env.iter().flatten() {
        let mut from_secret = false;
        let value = if let Some(v) = &var.value {
            let used = std::cell::RefCell::new(Vec::new());
            let expanded = expand(v, |k| {
                used.borrow_mut().push(k.to_string());
                env.get(k).cloned()
            })
            .0;
            from_secret = used.borrow().iter().any(|k| secret.contains(k));
            Some(expanded)
        } else if let Some(from) = &var.value_from {
            if let Some(f) = &from.field_ref {
                match f.field_path.as_str() {
                    "spec.nodeName" => Some(
                        pod.spec
                            .as_ref()
                            .and_then(|s| s.node_name.clone())
                            .filter(|n| !n.is_empty())
                            .unwrap_or_else(|| node_name.to_string()),
                    ),
                    "spec.serviceAccountName" => Some(
                        pod.spec
                            .as_ref()
                            .and_then(|s| s.service_account_name.clone())
                            .unwrap_or_else(|| "default".into()),
                    ),
                    _ => field_value(pod, f).ok(),
                }
            } else if let Some(r) = &from.resource_field_ref {
                resource_value(pod, r, Some(&container.name), node).ok()
            } else if let Some(k) = &from.config_map_key_ref {
                match objects.config_map(ns, &k.name) {
                    Lookup::Found(cm) => cm.data.as_ref().and_then(|d| d.get(&k.key)).cloned(),
                    _ => None,
                }
            } else if let Some(k) = &from.secret_key_ref {
                from_secret = true;
                match objects.secret(ns, &k.name) {
                    Lookup::Found(s) => s
                        .data
                        .as_ref()
                        .and_then(|d| d.get(&k.key))
                        .and_then(|v| String::from_utf8(v.0.clone()).ok()),
                    _ => None,
                }
            } else {
                None
            }
        } else {
            Some(String::new())
        };
        match value {
            Some(v) => {
                env.insert(var.name.clone(), v);
            }
            None => {
                env.remove(&var.name);
            }
        }
        if from_secret {
            secret.insert(var.name.clone());
        } else {
            secret.remove(&var.name);
        }
    }
    ContainerEnv {
        values: env,
        secret,
    }
}

/// Expands `$(VAR)` references as the kubelet does: `$$` is a literal `$`, an unterminated
/// `$(` or a `$` before anything else is kept as written, and a reference `lookup` cannot
/// resolve is kept as written. Returns the result and the names that could not be resolved.
pub fn expand(input: &str, lookup: impl Fn(&str) -> Option<String>) -> (String, Vec<String>) {
    let mut out = String::with_capacity(input.len());
    let mut missing = Vec::new();
    let mut rest = input;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(tail) = after.strip_prefix('(') {
            match tail.find(')') {
                Some(end) => {
                    let name = &tail[..end];
                    match lookup(name) {
                        Some(v) => out.push_str(&v),
                        None => {
                            missing.push(name.to_string());
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &tail[end + 1..];
                }
                None => {
                    out.push_str("$(");
                    rest = tail;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    (out, missing)
}

/// Expands a `subPathExpr` with a container's environment and checks the result as the kubelet
/// does: every variable defined and non-empty, the result relative and without `..`.
/// A path made with a Secret's value is not shown: the message names the variables instead.
pub fn expand_sub_path(expr: &str, env: &ContainerEnv) -> Result<String, String> {
    let used = std::cell::RefCell::new(Vec::new());
    let (out, missing) = expand(expr, |k| {
        used.borrow_mut().push(k.to_string());
        env.values.get(k).filter(|v| !v.is_empty()).cloned()
    });
    if !missing.is_empty() {
        return Err(format!(
            "subPathExpr {expr:?}: missing value for {}; define the variable in the container's env",
            missing.join(", ")
        ));
    }
    if let Some(d) = crate::validation::local_descending_path_error(&out) {
        let secret: Vec<String> = used
            .into_inner()
            .into_iter()
            .filter(|k| env.secret.contains(k))
            .collect();
        if !secret.is_empty() {
            return Err(format!(
                "subPathExpr {expr:?} expands to a path that {d} (not shown: it holds the value of {}, from a Secret)",
                secret.join(", ")
            ));
        }
        return Err(format!(
            "subPathExpr {expr:?} expands to {out:?}, which {d}"
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    struct Fixed {
        cms: BTreeMap<String, Lookup<ConfigMap>>,
        secrets: BTreeMap<String, Lookup<Secret>>,
    }

    impl Objects for Fixed {
        fn config_map(&self, ns: &str, name: &str) -> Lookup<ConfigMap> {
            self.cms
                .get(&format!("{ns}/{name}"))
                .cloned()
                .unwrap_or(Lookup::Missing)
        }
        fn secret(&self, ns: &str, name: &str) -> Lookup<Secret> {
            self.secrets
                .get(&format!("{ns}/{name}"))
                .cloned()
                .unwrap_or(Lookup::Missing)
        }
    }

    fn objects() -> Fixed {
        let cm: ConfigMap = serde_json::from_value(json!({
            "metadata": {"name": "cm", "namespace": "ns"},
            "data": {"a": "alpha", "b": "beta"},
            "binaryData": {"bin": "AAEC"},
        }))
        .unwrap();
        let s: Secret = serde_json::from_value(json!({
            "metadata": {"name": "s", "namespace": "ns"},
            "data": {"user": "YWRtaW4=", "pass": "czNjcjN0"},
        }))
        .unwrap();
        Fixed {
            cms: BTreeMap::from([
                ("ns/cm".to_string(), Lookup::Found(Arc::new(cm))),
                (
                    "ns/bad".to_string(),
                    Lookup::Invalid(
                        "x.yaml (document 1): data[..a]: must not start with '..'".into(),
                    ),
                ),
            ]),
            secrets: BTreeMap::from([("ns/s".to_string(), Lookup::Found(Arc::new(s)))]),
        }
    }

    const NODE: NodeAllocatable = NodeAllocatable {
        cpu_milli: 4000,
        memory: 8 << 30,
        ephemeral_storage: 100 << 30,
    };

    fn pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70",
                "labels": {"app": "web", "tier": "front \"end\"\n"}, "annotations": {"b": "2", "a": "1"}},
            "spec": {"containers": [
                {"name": "c", "resources": {"limits": {"cpu": "500m", "memory": "100Mi"}, "requests": {"cpu": "250m"}},
                 "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                         {"name": "DIR", "value": "logs/$(POD)"},
                         {"name": "EMPTY", "value": ""},
                         {"name": "USER", "valueFrom": {"secretKeyRef": {"name": "s", "key": "user"}}},
                         {"name": "GREETING", "value": "hi-$(USER)"},
                         {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]},
                {"name": "d"}]},
        }))
        .unwrap()
    }

    fn payload(volume: serde_json::Value) -> Result<Payload, ProjectionError> {
        let v: Volume = serde_json::from_value(volume).unwrap();
        volume_payload(&pod(), &v, &objects(), &NODE).expect("a content volume")
    }

    fn text(p: &Payload, path: &str) -> (String, u32) {
        let f = &p[path];
        (String::from_utf8(f.data.clone()).unwrap(), f.mode)
    }

    #[test]
    fn config_map_all_keys_and_items() {
        let p = payload(json!({"name": "v", "configMap": {"name": "cm"}})).unwrap();
        assert_eq!(p.keys().collect::<Vec<_>>(), ["a", "b", "bin"]);
        assert_eq!(text(&p, "a"), ("alpha".into(), 0o644));
        assert_eq!(p["bin"].data, [0, 1, 2]);
        let p = payload(
            json!({"name": "v", "configMap": {"name": "cm", "defaultMode": 0o600,
            "items": [{"key": "a", "path": "dir/./x"}, {"key": "b", "path": "y", "mode": 0o400}]}}),
        )
        .unwrap();
        assert_eq!(text(&p, "dir/x"), ("alpha".into(), 0o600));
        assert_eq!(text(&p, "y"), ("beta".into(), 0o400));
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn missing_objects_and_keys() {
        let e = payload(json!({"name": "v", "configMap": {"name": "nope"}})).unwrap_err();
        assert_eq!(e.to_string(), "configMap ns/nope not found; create it, or set optional: true to mount the volume without it");
        assert!(e.is_transient());
        assert!(
            payload(json!({"name": "v", "configMap": {"name": "nope", "optional": true}}))
                .unwrap()
                .is_empty()
        );
        let e = payload(json!({"name": "v", "secret": {"secretName": "s", "items": [{"key": "token", "path": "t"}]}})).unwrap_err();
        assert!(
            e.to_string().contains("secret ns/s has no key \"token\""),
            "{e}"
        );
        let p = payload(json!({"name": "v", "secret": {"secretName": "s", "optional": true, "items": [{"key": "token", "path": "t"}, {"key": "user", "path": "u"}]}})).unwrap();
        assert_eq!(
            p.keys().collect::<Vec<_>>(),
            ["u"],
            "a missing optional key is skipped"
        );
        let e = payload(json!({"name": "v", "configMap": {"name": "bad", "optional": true}}))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("configMap ns/bad is invalid: x.yaml (document 1)"),
            "an invalid object fails even when optional: {e}"
        );
    }

    #[test]
    fn downward_api_formats() {
        let p = payload(json!({"name": "v", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
            {"path": "app", "fieldRef": {"fieldPath": "metadata.labels['app']"}},
            {"path": "none", "fieldRef": {"fieldPath": "metadata.annotations['missing']"}},
            {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
            {"path": "ns", "fieldRef": {"fieldPath": "metadata.namespace"}},
            {"path": "uid", "fieldRef": {"fieldPath": "metadata.uid"}, "mode": 0o400},
            {"path": "cpu", "resourceFieldRef": {"containerName": "c", "resource": "limits.cpu", "divisor": "1m"}},
            {"path": "cpu-cores", "resourceFieldRef": {"containerName": "c", "resource": "limits.cpu"}},
            {"path": "cpu-req", "resourceFieldRef": {"containerName": "c", "resource": "requests.cpu", "divisor": "1m"}},
            {"path": "mem", "resourceFieldRef": {"containerName": "c", "resource": "limits.memory", "divisor": "1Mi"}},
            {"path": "mem-req", "resourceFieldRef": {"containerName": "c", "resource": "requests.memory"}},
            {"path": "mem-d", "resourceFieldRef": {"containerName": "d", "resource": "limits.memory", "divisor": "1Gi"}},
            {"path": "cpu-d-req", "resourceFieldRef": {"containerName": "d", "resource": "requests.cpu"}},
            {"path": "eph-d", "resourceFieldRef": {"containerName": "d", "resource": "limits.ephemeral-storage", "divisor": "1G"}},
        ]}}))
        .unwrap();
        assert_eq!(
            text(&p, "labels").0,
            "app=\"web\"\ntier=\"front \\\"end\\\"\\n\""
        );
        assert_eq!(text(&p, "annotations").0, "a=\"1\"\nb=\"2\"");
        assert_eq!(text(&p, "app").0, "web");
        assert_eq!(text(&p, "none").0, "");
        assert_eq!(text(&p, "name").0, "web");
        assert_eq!(text(&p, "ns").0, "ns");
        assert_eq!(
            text(&p, "uid"),
            ("0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70".into(), 0o400)
        );
        assert_eq!(text(&p, "cpu").0, "500");
        assert_eq!(text(&p, "cpu-cores").0, "1", "500m in cores rounds up");
        assert_eq!(text(&p, "cpu-req").0, "250");
        assert_eq!(text(&p, "mem").0, "100");
        assert_eq!(
            text(&p, "mem-req").0,
            (100 << 20).to_string(),
            "a missing request is the limit"
        );
        assert_eq!(text(&p, "mem-d").0, "8", "no limit: the node's allocatable");
        assert_eq!(text(&p, "cpu-d-req").0, "0");
        assert_eq!(text(&p, "eph-d").0, "108", "100Gi in G, rounded up");
    }

    #[test]
    fn projected_mix_and_cluster_only_sources() {
        let p = payload(json!({"name": "v", "projected": {"defaultMode": 0o440, "sources": [
            {"configMap": {"name": "cm", "items": [{"key": "a", "path": "cfg/a"}]}},
            {"secret": {"name": "s"}},
            {"configMap": {"name": "gone", "optional": true}},
            {"downwardAPI": {"items": [{"path": "cfg/name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
        ]}}))
        .unwrap();
        assert_eq!(
            p.keys().collect::<Vec<_>>(),
            ["cfg/a", "cfg/name", "pass", "user"]
        );
        assert_eq!(text(&p, "user"), ("admin".into(), 0o440));
        let e = payload(json!({"name": "v", "projected": {"sources": [{"configMap": {"name": "cm"}}, {"serviceAccountToken": {"path": "token"}}]}})).unwrap_err();
        assert!(
            e.to_string().starts_with(
                "projected source serviceAccountToken (sources[1]) needs a Kubernetes API server"
            ),
            "{e}"
        );
        assert!(!e.is_transient());
        let e = payload(json!({"name": "v", "projected": {"sources": [{"clusterTrustBundle": {"path": "b", "signerName": "x"}}]}})).unwrap_err();
        assert!(e.to_string().contains("clusterTrustBundle"), "{e}");
    }

    /// What a podCertificate source writes: the key and chain, each where asked, and both in
    /// one bundle (key first); 0600 under an fsGroup; why there are none, transient or not.
    #[test]
    fn pod_certificates_are_written_where_their_source_says() {
        struct Issued(Result<Credentials, CredentialsError>);
        impl Objects for Issued {
            fn config_map(&self, _: &str, _: &str) -> Lookup<ConfigMap> {
                Lookup::Missing
            }
            fn secret(&self, _: &str, _: &str) -> Lookup<Secret> {
                Lookup::Missing
            }
            fn pod_certificate(
                &self,
                index: usize,
            ) -> Option<Result<Credentials, CredentialsError>> {
                assert_eq!(index, 1, "the source's index among all sources");
                Some(self.0.clone())
            }
            fn in_cluster(&self) -> bool {
                true
            }
        }
        let creds = Credentials {
            key_pem: b"KEY\n".to_vec(),
            chain_pem: b"LEAF\nCA\n".to_vec(),
        };
        let v: Volume = serde_json::from_value(json!({"name": "v", "projected": {"defaultMode": 0o644, "sources": [
            {"downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
            {"podCertificate": {"signerName": "example.com/s", "keyType": "ED25519", "credentialBundlePath": "creds/bundle.pem", "keyPath": "tls.key", "certificateChainPath": "tls.crt"}},
        ]}})).unwrap();
        let p = volume_payload(&pod(), &v, &Issued(Ok(creds.clone())), &NODE)
            .unwrap()
            .unwrap();
        assert_eq!(
            text(&p, "creds/bundle.pem"),
            ("KEY\nLEAF\nCA\n".into(), 0o644)
        );
        assert_eq!(text(&p, "tls.key"), ("KEY\n".into(), 0o644));
        assert_eq!(text(&p, "tls.crt"), ("LEAF\nCA\n".into(), 0o644));
        assert!(
            !format!("{creds:?}").contains("KEY"),
            "a key is never printed"
        );

        let mut grouped = pod();
        grouped.spec.as_mut().unwrap().security_context =
            Some(serde_json::from_value(json!({"fsGroup": 2000})).unwrap());
        let p = volume_payload(&grouped, &v, &Issued(Ok(creds)), &NODE)
            .unwrap()
            .unwrap();
        assert_eq!(
            text(&p, "tls.key").1,
            0o600,
            "the key is the owner's alone under an fsGroup (the writer adds the group)"
        );
        assert_eq!(
            text(&p, "name").1,
            0o644,
            "other files keep the volume's mode"
        );

        let waiting = CredentialsError {
            detail: "waiting for the signer".into(),
            permanent: false,
        };
        let e = volume_payload(&pod(), &v, &Issued(Err(waiting)), &NODE)
            .unwrap()
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "projected source podCertificate (sources[1]): waiting for the signer"
        );
        assert!(e.is_transient());
        let denied = CredentialsError {
            detail: "denied".into(),
            permanent: true,
        };
        let e = volume_payload(&pod(), &v, &Issued(Err(denied)), &NODE)
            .unwrap()
            .unwrap_err();
        assert!(!e.is_transient());
        let e = volume_payload(&pod(), &v, &objects(), &NODE)
            .unwrap()
            .unwrap_err();
        assert!(
            e.to_string().starts_with(
                "projected source podCertificate (sources[1]) needs a Kubernetes API server"
            ),
            "{e}"
        );
    }

    #[test]
    fn references() {
        let v: Volume = serde_json::from_value(json!({"name": "v", "projected": {"sources": [{"configMap": {"name": "a"}}, {"secret": {"name": "b"}}, {"downwardAPI": {}}]}})).unwrap();
        let refs = referenced_objects(&pod(), &v);
        assert_eq!(refs.len(), 2);
        assert_eq!(
            (
                refs[1].kind,
                refs[1].namespace.as_str(),
                refs[1].name.as_str()
            ),
            (ObjectKind::Secret, "ns", "b")
        );
    }

    #[test]
    fn go_quoting() {
        assert_eq!(go_quote("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(go_quote("\t\u{1}é"), "\"\\t\\x01é\"");
        assert_eq!(go_quote("\u{7f}\u{85}"), "\"\\x7f\\u0085\"");
    }

    #[test]
    fn expansion_rules() {
        let env = BTreeMap::from([
            ("A".to_string(), "x".to_string()),
            ("E".to_string(), String::new()),
        ]);
        let look = |k: &str| env.get(k).cloned();
        let rows = [
            ("$(A)/y", "x/y", 0),
            ("$$(A)", "$(A)", 0),
            ("$(B)", "$(B)", 1),
            ("$(A", "$(A", 0),
            ("a$b", "a$b", 0),
            ("$(A)$(A)", "xx", 0),
            ("end$", "end$", 0),
        ];
        for (input, want, missing) in rows {
            let (out, m) = expand(input, look);
            assert_eq!((out.as_str(), m.len()), (want, missing), "input {input:?}");
        }
    }

    #[test]
    fn sub_path_expr() {
        let c = pod().spec.unwrap().containers[0].clone();
        let env = container_env(&pod(), &c, "node-a", &objects(), &NODE);
        assert_eq!(
            env.values["DIR"], "logs/web",
            "earlier variables expand in values"
        );
        assert_eq!(env.values["USER"], "admin");
        assert!(
            !env.values.contains_key("IP"),
            "status fields are not known on a standalone node"
        );
        assert_eq!(
            expand_sub_path("$(DIR)/$(USER)", &env).unwrap(),
            "logs/web/admin"
        );
        let e = expand_sub_path("$(IP)/$(EMPTY)", &env).unwrap_err();
        assert!(e.contains("missing value for IP, EMPTY"), "{e}");
        let mut env = env;
        assert_eq!(
            env.secret,
            ["GREETING".to_string(), "USER".to_string()].into(),
            "a Secret's key is known as such, and so is a value made with it"
        );
        env.values.insert("HOME".into(), "/home/admin".into());
        env.secret.insert("HOME".into());
        let e = expand_sub_path("$(HOME)", &env).unwrap_err();
        assert!(
            e.contains(
                "must be a relative path (not shown: it holds the value of HOME, from a Secret)"
            ) && !e.contains("admin"),
            "{e}"
        );
        assert_eq!(
            redact("mkdir /v/admin/x: EACCES", &env.secret_values()),
            "mkdir /v/<redacted: a Secret's value>/x: EACCES"
        );
        env.values.insert("UP".into(), "../etc".into());
        env.values.insert("ABS".into(), "/etc".into());
        assert!(expand_sub_path("$(UP)", &env)
            .unwrap_err()
            .contains("must not contain '..'"));
        assert!(expand_sub_path("$(ABS)", &env)
            .unwrap_err()
            .contains("must be a relative path"));
    }
}
