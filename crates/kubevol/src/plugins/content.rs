//! configMap, secret, downwardAPI and projected volumes: files computed from objects and the pod,
//! written by the atomic writer at the kubelet's paths (`kubernetes.io~configmap`, `~secret`,
//! `~downward-api`, `~projected`).
//!
//! Secret, downwardAPI and projected volumes live on a tmpfs of their own, as the kubelet wraps
//! them in a Memory emptyDir (a secret never touches the node's disk); configMap volumes live on
//! the node's disk. All four are reported read-only
//! to the runtime, whatever a container asks. Set-up runs again whenever an object a volume
//! reads, or the pod's metadata, changes; the writer leaves unchanged content alone.

use std::collections::BTreeMap;
use std::sync::Arc;

use kubevol_core::projection::{self, Credentials, CredentialsError, Lookup, Objects};
use kubevol_core::state::VolumeSpec;
use kubevol_mount::atomic::{self, Entry, Ownership};
use kubevol_mount::safe::FsGroupPolicy;

use super::{
    blocking, empty_dir, fs_group, BoxFuture, Filesystem, PluginHost, SetUpRequest, SetUpResult,
    TearDownRequest, VolumePlugin,
};
use crate::certificates::SourceRequest;
use crate::error::VolumeError;
use crate::store::{ObjectStore, Stored};
use crate::tokens::TokenSpec;

/// The four content volume types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentKind {
    /// `configMap`.
    ConfigMap,
    /// `secret`.
    Secret,
    /// `downwardAPI`.
    DownwardApi,
    /// `projected`.
    Projected,
}

impl ContentKind {
    /// Every kind.
    pub const ALL: [ContentKind; 4] = [
        ContentKind::ConfigMap,
        ContentKind::Secret,
        ContentKind::DownwardApi,
        ContentKind::Projected,
    ];

    /// The kubelet's plugin name.
    pub fn plugin_name(self) -> &'static str {
        match self {
            ContentKind::ConfigMap => "kubernetes.io/configmap",
            ContentKind::Secret => "kubernetes.io/secret",
            ContentKind::DownwardApi => "kubernetes.io/downward-api",
            ContentKind::Projected => "kubernetes.io/projected",
        }
    }

    fn source_field(self) -> &'static str {
        match self {
            ContentKind::ConfigMap => "configMap",
            ContentKind::Secret => "secret",
            ContentKind::DownwardApi => "downwardAPI",
            ContentKind::Projected => "projected",
        }
    }

    /// Whether the volume lives on a tmpfs of its own.
    fn in_memory(self) -> bool {
        matches!(
            self,
            ContentKind::Secret | ContentKind::DownwardApi | ContentKind::Projected
        )
    }
}

/// One content volume plugin.
pub struct ContentPlugin(pub ContentKind);

/// The store seen as the projection's object source: invalid objects fail with their reason.
pub(crate) struct StoreObjects<'a>(pub(crate) &'a ObjectStore);

/// An object from the store; one a broken manifest file holds back is invalid with that file's
/// error, not missing (and not silently skipped when the volume is optional).
fn lookup<T>(
    store: &ObjectStore,
    kind: &str,
    (namespace, name): (&str, &str),
    found: Option<Stored<T>>,
) -> Lookup<T> {
    match found {
        None => match store.not_loaded(kind, namespace, name) {
            Some(why) => Lookup::Invalid(why),
            None => Lookup::Missing,
        },
        Some(s) => match s.invalid {
            Some(why) => Lookup::Invalid(why.to_string()),
            None => Lookup::Found(s.object),
        },
    }
}

impl Objects for StoreObjects<'_> {
    fn config_map(
        &self,
        namespace: &str,
        name: &str,
    ) -> Lookup<k8s_openapi::api::core::v1::ConfigMap> {
        let found = self.0.config_map(namespace, name);
        lookup(self.0, "ConfigMap", (namespace, name), found)
    }

    fn secret(&self, namespace: &str, name: &str) -> Lookup<k8s_openapi::api::core::v1::Secret> {
        let found = self.0.secret(namespace, name);
        lookup(self.0, "Secret", (namespace, name), found)
    }
}

impl VolumePlugin for ContentPlugin {
    fn name(&self) -> &'static str {
        self.0.plugin_name()
    }

    fn source_field(&self) -> &'static str {
        self.0.source_field()
    }

    fn can_support(&self, spec: &VolumeSpec) -> bool {
        let v = &spec.volume;
        match self.0 {
            ContentKind::ConfigMap => v.config_map.is_some(),
            ContentKind::Secret => v.secret.is_some(),
            ContentKind::DownwardApi => v.downward_api.is_some(),
            ContentKind::Projected => v.projected.is_some(),
        }
    }

    fn requires_remount(&self) -> bool {
        true
    }

    fn reconstruct(
        &self,
        _host: &PluginHost,
        _pod: &kubevol_core::PodRef,
        name: &str,
        dir: &std::path::Path,
        _mounted: bool,
    ) -> Option<(VolumeSpec, std::path::PathBuf)> {
        let mut volume = k8s_openapi::api::core::v1::Volume {
            name: name.to_string(),
            ..Default::default()
        };
        match self.0 {
            ContentKind::ConfigMap => volume.config_map = Some(Default::default()),
            ContentKind::Secret => volume.secret = Some(Default::default()),
            ContentKind::DownwardApi => volume.downward_api = Some(Default::default()),
            ContentKind::Projected => volume.projected = Some(Default::default()),
        }
        super::reconstructed(volume, dir)
    }

    fn set_up(
        &self,
        host: Arc<PluginHost>,
        req: SetUpRequest,
    ) -> BoxFuture<Result<SetUpResult, VolumeError>> {
        let kind = self.0;
        Box::pin(async move {
            // Tokens are fetched first (the projection does no I/O); the volume is written
            // again before the first of them is due.
            let (tokens, due) = fetch_tokens(&host, &req).await;
            let (bundles, bundles_due) = fetch_bundles(&host, &req).await;
            let (certificates, certificates_due) = fetch_certificates(&host, &req).await;
            let due = [due, bundles_due, certificates_due]
                .into_iter()
                .flatten()
                .min();
            let fetched = Fetched {
                tokens,
                bundles,
                certificates,
            };
            let result = blocking({
                let host = host.clone();
                let req = req.clone();
                move || write_content(kind, &host, &req, fetched)
            })
            .await;
            // A certificate is looked at again when due even where the volume failed (a
            // request is out).
            if let Some(at) = due.filter(|_| result.is_ok() || certificates_due.is_some()) {
                host.refresh_at(req.pod_ref.uid.clone(), at);
            }
            result
        })
    }

    fn tear_down(
        &self,
        host: Arc<PluginHost>,
        req: TearDownRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        let kind = self.0;
        blocking(move || {
            host.tear_down_volume_dir(
                &req.pod_ref,
                kind.plugin_name(),
                &req.outer_volume_name,
                &req.path,
                kind.in_memory(),
            )?;
            host.content_usage
                .release(&req.pod_ref.uid, &req.outer_volume_name);
            Ok(())
        })
    }
}

/// Computes a content volume's files and writes them with the atomic writer.
fn write_content(
    kind: ContentKind,
    host: &PluginHost,
    req: &SetUpRequest,
    fetched: Fetched,
) -> Result<SetUpResult, VolumeError> {
    // Compute the content first: a missing object fails before anything is created.
    let payload = projection::volume_payload(
        &req.pod,
        &req.spec.volume,
        &WithFetched {
            store: StoreObjects(&host.store),
            fetched,
            in_cluster: host.tokens.has_issuer(),
        },
        &host.node_allocatable,
    )
    .ok_or(VolumeError::Unsupported {
        plugin: kind.plugin_name(),
        operation: "set-up of a volume of another type",
    })??;
    // Counted against the pod's budget before anything is made: each file's pages, and each
    // directory its paths make (a block each).
    let need: u64 = payload
        .values()
        .map(|f| super::budget::pages(f.data.len()))
        .sum::<u64>()
        + super::budget::directories(payload.keys().map(String::as_str)) * super::budget::pages(0);
    let (budget, of) = super::budget::budget_of(&req.pod, kind.in_memory(), &host.node_allocatable);
    host.content_usage
        .take(&req.pod_ref.uid, &req.outer_volume_name, need, budget)
        .map_err(|used| VolumeError::ContentBudget {
            need,
            used,
            budget,
            of,
        })?;
    let size = tmpfs_size(&req.pod, need);
    let fs = kind.in_memory().then(|| Filesystem {
        source: "tmpfs",
        fstype: "tmpfs",
        data: vec![format!("size={size}")],
    });
    let (path, dir) = host.set_up_volume_dir(
        &req.pod_ref,
        kind.plugin_name(),
        &req.outer_volume_name,
        0o777,
        fs,
    )?;
    // What fails from here leaves the volume's directory (and tmpfs) made: uncertain, so that
    // it is torn down if the pod goes.
    let made = VolumeError::after_something_made;
    // A tmpfs mounted just now has the size asked for: nothing to grow.
    let grow = kind.in_memory() && !dir.mounted_now();
    let dir = dir.open().map_err(|e| made(e.into()))?;
    if grow {
        grow_tmpfs(host, &path, &dir, size).map_err(made)?;
    }
    let group = fs_group(&req.pod);
    if let Some((gid, _)) = group {
        // The payload gets its group from the writer; the root once, here.
        dir.apply_fs_group(gid, true, FsGroupPolicy::OnRootMismatch)
            .map_err(|e| made(e.into()))?;
    }
    let owners =
        kubevol_core::projection::FileOwners::of_volume(&req.spec.volume, &req.spec.extensions);
    let entries: Vec<Entry<'_>> = payload
        .iter()
        .map(|(path, f)| Entry {
            path,
            data: &f.data,
            mode: f.mode,
            user: owners.of(path),
        })
        .collect();
    let own = Ownership {
        gid: group.map(|(gid, _)| gid),
    };
    let written = atomic::write(&dir, &entries, own, &mut |_| {}).map_err(|e| made(e.into()))?;
    tracing::debug!(pod = %req.pod_ref, volume = %req.outer_volume_name, ?written, files = entries.len(), "content written");
    Ok(SetUpResult {
        path,
        read_only: true,
    })
}

/// The size of a content volume's tmpfs for a payload whose files take `need` bytes (whole
/// pages): twice that (the atomic writer keeps the version it replaces until the new one is in
/// place), and 1 MiB besides for directories and links; no more than the pod's memory limit
/// when it has one (a payload past it then fails to be written, as in the kubelet). Without a
/// size a tmpfs may take half the node's memory, and one pod's hundred volumes of a large
/// Secret took gigabytes.
fn tmpfs_size(pod: &k8s_openapi::api::core::v1::Pod, need: u64) -> u64 {
    let size = 2 * need + (1 << 20);
    match empty_dir::pod_memory_limit(pod)
        .and_then(|l| u64::try_from(l).ok())
        .filter(|l| *l > 0)
    {
        Some(limit) => size.min(limit),
        None => size,
    }
}

/// Makes the tmpfs mounted at `path` (open as `dir`) hold at least `size` bytes, keeping its
/// files: a payload that grew since the volume was mounted.
fn grow_tmpfs(
    host: &PluginHost,
    path: &std::path::Path,
    dir: &kubevol_mount::safe::Dir,
    size: u64,
) -> Result<(), VolumeError> {
    let Some(usage) = PluginHost::tmpfs_usage(dir) else {
        return Ok(());
    };
    if usage.size >= size {
        return Ok(());
    }
    tracing::debug!(path = %path.display(), from = usage.size, to = size, "the content grew: its tmpfs too");
    host.resize_tmpfs(path, size)
}

/// The tokens of a projected volume's `serviceAccountToken` sources, by source index, and when
/// the first of them is due for refreshing (with the pod to process again then). Empty when no
/// issuer is set: the projection then says that a source needs an API server.
async fn fetch_tokens(
    host: &PluginHost,
    req: &SetUpRequest,
) -> (
    BTreeMap<usize, Result<String, String>>,
    Option<tokio::time::Instant>,
) {
    let mut out = BTreeMap::new();
    let mut due: Option<tokio::time::Instant> = None;
    let sources = projection::token_sources(&req.spec.volume);
    if sources.is_empty() || !host.tokens.has_issuer() {
        return (out, None);
    }
    for (index, source) in sources {
        let spec = TokenSpec::for_pod(
            &req.pod_ref,
            &req.pod,
            source.audience.as_deref(),
            source.expiration_seconds,
        );
        match host.tokens.get(spec).await {
            Some(Ok(granted)) => {
                let at = granted.refresh_at;
                due = Some(due.map_or(at, |d| d.min(at)));
                out.insert(index, Ok(granted.token));
            }
            Some(Err(why)) => {
                out.insert(index, Err(why.to_string()));
            }
            None => {}
        }
    }
    (out, due)
}

/// How often a volume with cluster trust bundles is written again, so that a bundle's change
/// reaches it (the kubelet's periodic remount).
const BUNDLE_REFRESH: std::time::Duration = std::time::Duration::from_secs(60);

/// The PEM bundles of a projected volume's `clusterTrustBundle` sources, by source index, and
/// when to read them again. Empty when no source of bundles is set.
async fn fetch_bundles(
    host: &PluginHost,
    req: &SetUpRequest,
) -> (
    BTreeMap<usize, Result<Option<String>, String>>,
    Option<tokio::time::Instant>,
) {
    let mut out = BTreeMap::new();
    let sources = projection::trust_bundle_sources(&req.spec.volume);
    let Some(bundles) = host.trust_bundles.get().filter(|_| !sources.is_empty()) else {
        return (out, None);
    };
    for (index, source) in sources {
        out.insert(
            index,
            bundles
                .bundle(source.clone())
                .await
                .map_err(|e| e.to_string()),
        );
    }
    (out, Some(tokio::time::Instant::now() + BUNDLE_REFRESH))
}

/// The credentials of a projected volume's `podCertificate` sources, by source index, and
/// when to look at them again. Empty where no requests can be made.
async fn fetch_certificates(
    host: &PluginHost,
    req: &SetUpRequest,
) -> (
    BTreeMap<usize, Result<Credentials, CredentialsError>>,
    Option<tokio::time::Instant>,
) {
    let mut out = BTreeMap::new();
    let mut due: Option<tokio::time::Instant> = None;
    let sources = projection::certificate_sources(&req.spec.volume);
    if sources.is_empty() || !host.certificates.has_requests() {
        return (out, None);
    }
    let node_uid = host
        .store
        .node(&host.node_name)
        .and_then(|n| n.object.metadata.uid.clone());
    for (index, source) in sources {
        let asked = SourceRequest {
            pod_ref: &req.pod_ref,
            pod: &req.pod,
            volume: &req.outer_volume_name,
            index,
            source,
            node_name: &host.node_name,
            node_uid: node_uid.clone(),
        };
        if let Some(answer) = host.certificates.get(asked, &host.events).await {
            if let Some(at) = answer.recheck_at {
                due = Some(due.map_or(at, |d| d.min(at)));
            }
            out.insert(index, answer.result);
        }
    }
    (out, due)
}

/// What was fetched for the volume being projected: tokens, trust bundles, certificates.
struct Fetched {
    tokens: BTreeMap<usize, Result<String, String>>,
    bundles: BTreeMap<usize, Result<Option<String>, String>>,
    certificates: BTreeMap<usize, Result<Credentials, CredentialsError>>,
}

/// The store, and what was fetched.
struct WithFetched<'a> {
    store: StoreObjects<'a>,
    fetched: Fetched,
    /// A node of a cluster (tokens are issued).
    in_cluster: bool,
}

impl Objects for WithFetched<'_> {
    fn config_map(
        &self,
        namespace: &str,
        name: &str,
    ) -> Lookup<k8s_openapi::api::core::v1::ConfigMap> {
        self.store.config_map(namespace, name)
    }

    fn secret(&self, namespace: &str, name: &str) -> Lookup<k8s_openapi::api::core::v1::Secret> {
        self.store.secret(namespace, name)
    }

    fn service_account_token(&self, index: usize) -> Option<Result<String, String>> {
        self.fetched.tokens.get(&index).cloned()
    }

    fn cluster_trust_bundle(&self, index: usize) -> Option<Result<Option<String>, String>> {
        self.fetched.bundles.get(&index).cloned()
    }

    fn pod_certificate(&self, index: usize) -> Option<Result<Credentials, CredentialsError>> {
        self.fetched.certificates.get(&index).cloned()
    }

    fn in_cluster(&self) -> bool {
        self.in_cluster
    }
}
