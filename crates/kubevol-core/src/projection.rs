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
    ClusterTrustBundleProjection, ConfigMap, DownwardAPIVolumeFile, KeyToPath, Pod,
    PodCertificateProjection, Secret, ServiceAccountTokenProjection, Volume, VolumeProjection,
};

use crate::validation::{clean_item_path, item_path_errors};

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

/// Whether a content volume's files would be made from the same parts of its pod in `old` and
/// `new` (each with its `spec.volumes[]` entry): the volume's definition, the pod's identity
/// (tokens are bound to it), service account and fsGroup (ownership and modes), and the value
/// of every downward API item it projects. Anything else of the pod (an annotation no item
/// reads, a label of a configMap volume's pod) changes nothing of the volume, which need not be
/// written again for it. The objects, tokens, bundles and certificates it reads are compared
/// apart.
pub fn same_pod_inputs(old: (&Pod, &Volume), new: (&Pod, &Volume), node: &NodeAllocatable) -> bool {
    let ((op, ov), (np, nv)) = (old, new);
    fn spec(p: &Pod) -> Option<&k8s_openapi::api::core::v1::PodSpec> {
        p.spec.as_ref()
    }
    let fs_group = |p: &Pod| {
        spec(p)
            .and_then(|s| s.security_context.as_ref())
            .and_then(|c| c.fs_group)
    };
    let account = |p: &Pod| {
        spec(p)
            .and_then(|s| s.service_account_name.clone().or(s.service_account.clone()))
            .unwrap_or_default()
    };
    let identity = |p: &Pod| {
        (
            p.metadata.name.clone(),
            pod_namespace(p).to_string(),
            p.metadata.uid.clone(),
        )
    };
    if ov != nv
        || fs_group(op) != fs_group(np)
        || account(op) != account(np)
        || identity(op) != identity(np)
    {
        return false;
    }
    // The downward API items' values, in order (the sources are the same: the volume is).
    let values = |p: &Pod, v: &Volume| -> Vec<Result<String, String>> {
        sources(p, v)
            .unwrap_or_default()
            .iter()
            .flat_map(|s| match s {
                Source::Downward { items, .. } => items.iter().collect::<Vec<_>>(),
                _ => Vec::new(),
            })
            .map(|item| match (&item.field_ref, &item.resource_field_ref) {
                (Some(f), _) => field_value(p, f),
                (None, Some(r)) => resource_value(p, r, None, node),
                (None, None) => Err(String::new()),
            })
            .collect()
    };
    values(op, ov) == values(np, nv)
}

/// Whether a content volume reads what is fetched for it rather than stored (service account
/// tokens, cluster trust bundles, pod certificates): it is written again when they are due.
pub fn fetches(volume: &Volume) -> bool {
    !token_sources(volume).is_empty()
        || !trust_bundle_sources(volume).is_empty()
        || !certificate_sources(volume).is_empty()
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

mod downward;
mod env;
mod owners;

use downward::project_downward;
pub use downward::{field_value, format_map, go_quote, resource_value};
pub use env::{container_env, expand, expand_sub_path, redact, ContainerEnv};
pub use owners::FileOwners;

#[cfg(test)]
mod tests;
