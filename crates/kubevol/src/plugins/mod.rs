//! Volume plugins: one type per volume source, as trait objects in a registry keyed by name.
//!
//! A plugin knows how to set up and tear down one kind of volume; it never decides *when* (the
//! reconciler does) and never touches another plugin's directories. Adding a plugin means one
//! file here and one line in [`PluginRegistry::standard`].

pub mod budget;
mod content;
pub mod csi;
pub(crate) mod empty_dir;
mod host;
mod host_path;
pub mod image;
pub(crate) mod local;
pub mod ownership;
pub mod usage;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::names::SharedStr;
use kubevol_core::state::{VolumeSpec, VolumeTraits};
use kubevol_core::{PodRef, UniqueVolumeName};
use kubevol_mount::safe::FsGroupPolicy;

pub(crate) use content::StoreObjects;
pub use content::{ContentKind, ContentPlugin};
pub use empty_dir::EmptyDirPlugin;
pub(crate) use host::{Filesystem, VolumeDir};
pub use host::{PluginHost, Refresher};
pub use host_path::HostPathPlugin;
pub use local::LocalPlugin;

use crate::error::{ApiError, VolumeError};

/// Who attaches volumes to the node when kubevol does not call ControllerPublishVolume itself:
/// a cluster's attach/detach controller, which records the result in a VolumeAttachment.
pub trait AttachController: Send + Sync + 'static {
    /// The publish context of `volume` once the controller has attached it to this node
    /// (`attachment` names its VolumeAttachment), or what it still waits for.
    fn attached(
        &self,
        volume: UniqueVolumeName,
        attachment: String,
    ) -> BoxFuture<Result<BTreeMap<String, String>, ApiError>>;
}

/// Where a claim's status is written (the API server in cluster mode): the node's part of an
/// expansion, as the kubelet's.
pub trait ClaimStatusWriter: Send + Sync + 'static {
    /// The claim `namespace/name` as the API server has it now (an expansion decides on the
    /// claim's current status, as the kubelet reads it afresh).
    fn get(
        &self,
        namespace: String,
        name: String,
    ) -> BoxFuture<Result<k8s_openapi::api::core::v1::PersistentVolumeClaim, ApiError>>;
    /// Merge-patches the status of claim `namespace/name` with `patch` (a JSON merge patch of
    /// the whole claim; set `metadata.resourceVersion` to make it conditional); returns the
    /// claim as written.
    fn patch_status(
        &self,
        namespace: String,
        name: String,
        patch: serde_json::Value,
    ) -> BoxFuture<Result<k8s_openapi::api::core::v1::PersistentVolumeClaim, ApiError>>;
}

/// Where `clusterTrustBundle` projected sources are read (the API server in cluster mode).
pub trait TrustBundles: Send + Sync + 'static {
    /// The PEM bundle a source selects (by name, or by signer name and label selector), `None`
    /// when no ClusterTrustBundle matches, or why it cannot be read.
    fn bundle(
        &self,
        source: k8s_openapi::api::core::v1::ClusterTrustBundleProjection,
    ) -> BoxFuture<Result<Option<String>, ApiError>>;
}

pub use crate::BoxFuture;

/// The subdirectories of `d`, sorted (none if it cannot be read).
pub(crate) fn subdirs(d: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(d)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

/// What [`VolumePlugin::reconstruct`] returns for a volume whose directory is the volume.
pub(crate) fn reconstructed(
    volume: k8s_openapi::api::core::v1::Volume,
    dir: &Path,
) -> Option<(VolumeSpec, PathBuf)> {
    Some((
        VolumeSpec {
            volume: volume.into(),
            persistent_volume: None,
            block: false,
            extensions: Default::default(),
            selinux_label: None,
            selinux_mount: false,
        },
        dir.to_path_buf(),
    ))
}

/// The pod's `securityContext.fsGroup` and `fsGroupChangePolicy`, when it sets a group.
pub fn fs_group(pod: &Pod) -> Option<(u32, FsGroupPolicy)> {
    let sc = pod.spec.as_ref()?.security_context.as_ref()?;
    let gid = u32::try_from(sc.fs_group?).ok()?;
    let policy = match sc.fs_group_change_policy.as_deref() {
        Some("OnRootMismatch") => FsGroupPolicy::OnRootMismatch,
        _ => FsGroupPolicy::Always,
    };
    Some((gid, policy))
}

/// What the node-wide operations (attach, mount device and their inverses) need.
#[derive(Clone)]
pub struct DeviceRequest {
    /// The volume's key.
    pub volume: UniqueVolumeName,
    /// The volume.
    pub spec: Arc<VolumeSpec>,
    /// What attach returned.
    pub publish_context: BTreeMap<String, String>,
}

/// What set-up needs.
#[derive(Clone)]
pub struct SetUpRequest {
    /// The volume's key.
    pub volume: UniqueVolumeName,
    /// What attach returned.
    pub publish_context: BTreeMap<String, String>,
    /// The pod.
    pub pod_ref: PodRef,
    /// The whole pod.
    pub pod: Arc<Pod>,
    /// The volume's name in the pod's spec.
    pub outer_volume_name: SharedStr,
    /// The volume.
    pub spec: Arc<VolumeSpec>,
}

/// What set-up produced: the path the container runtime bind-mounts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetUpResult {
    /// The path.
    pub path: PathBuf,
    /// Whether the runtime must mount it read-only whatever the container asks.
    pub read_only: bool,
}

/// What teardown needs: the facts set-up had, and where it put the volume.
#[derive(Clone)]
pub struct TearDownRequest {
    /// The volume's key.
    pub volume: UniqueVolumeName,
    /// The pod.
    pub pod_ref: PodRef,
    /// The volume's name in the pod's spec.
    pub outer_volume_name: SharedStr,
    /// The volume.
    pub spec: Arc<VolumeSpec>,
    /// Where set-up put it.
    pub path: PathBuf,
}

/// The set-up and teardown of a plugin whose work, for some of its volumes, is a few syscalls
/// on the node's own filesystems that end in microseconds whatever the volume holds: no driver,
/// no network, no walk of the volume's content. Those run one after another on the operations'
/// local lane, on its own thread, instead of each as a task that hops to the blocking pool.
pub trait QuickPlugin: Send + Sync {
    /// Whether this step of this volume is quick.
    fn is_quick(&self, spec: &VolumeSpec, step: QuickStep<'_>) -> bool;

    /// What a new set-up for `pod` can do before its intent is recorded, on another thread
    /// while the lane runs the operations before it: nothing that holds data, like the
    /// kubelet's pod directories, made outside the volume manager (an empty directory left
    /// behind is removed with the pod's directory). Errors are the set-up's to report.
    fn set_up_ahead(&self, _host: &PluginHost, _pod: &PodRef) {}

    /// [`VolumePlugin::set_up`] as a plain call.
    fn set_up_now(
        &self,
        host: &Arc<PluginHost>,
        req: SetUpRequest,
    ) -> Result<SetUpResult, VolumeError>;

    /// [`VolumePlugin::tear_down`] as a plain call.
    fn tear_down_now(
        &self,
        host: &Arc<PluginHost>,
        req: TearDownRequest,
    ) -> Result<(), VolumeError>;
}

/// The step [`QuickPlugin::is_quick`] is asked about.
#[derive(Clone, Copy, Debug)]
pub enum QuickStep<'a> {
    /// The set-up for this pod.
    SetUp(&'a Pod),
    /// The teardown.
    TearDown,
}

/// One kind of volume.
pub trait VolumePlugin: Send + Sync + 'static {
    /// The kubelet's plugin name, e.g. `kubernetes.io/empty-dir`.
    fn name(&self) -> &'static str;

    /// The API field name of the volume source it handles, e.g. `emptyDir`.
    fn source_field(&self) -> &'static str;

    /// Whether it serves volumes given inline in a pod (`local` does not).
    fn serves_inline(&self) -> bool {
        true
    }

    /// Whether it serves PersistentVolumes of its type, through a claim.
    fn serves_persistent(&self) -> bool {
        false
    }

    /// Whether it handles this volume.
    fn can_support(&self, spec: &VolumeSpec) -> bool;

    /// Facts about one of its volumes (static for most plugins; a CSI volume's depend on its
    /// driver's CSIDriver object).
    fn traits(&self, _host: &PluginHost, _spec: &VolumeSpec) -> VolumeTraits {
        VolumeTraits {
            plugin: kubevol_core::names::SharedStr::interned(self.name()),
            attachable: false,
            device_mountable: false,
        }
    }

    /// Whether the plugin mounts this volume with an SELinux context when asked (`-o
    /// context=`): none but CSI, whose CSIDriver says so (`seLinuxMount`).
    fn supports_selinux_mount(&self, _host: &PluginHost, _spec: &VolumeSpec) -> bool {
        false
    }

    /// Whether set-up must run again when the volume's content changes (an object it reads or
    /// the pod's metadata), as the kubelet's `RequiresRemount`.
    fn requires_remount(&self) -> bool {
        false
    }

    /// Whether a change of the pod or the volume's spec (from `old_pod`'s `old` to `pod`'s
    /// `spec`) needs the volume set up again, for a plugin that does not rewrite content: a
    /// memory-backed emptyDir whose size changed is resized in place.
    fn set_up_again(
        &self,
        _old_pod: &Pod,
        _old: &VolumeSpec,
        _pod: &Pod,
        _spec: &VolumeSpec,
    ) -> bool {
        false
    }

    /// The volume's key in the states of world. Per-pod volumes by default.
    fn volume_name(&self, pod: &PodRef, spec: &VolumeSpec) -> UniqueVolumeName {
        UniqueVolumeName::for_pod_volume(self.name(), &pod.uid, &spec.volume.name)
    }

    /// The spec and path of a volume found only in the pods directory (no record of it): its
    /// directory `dir` (absolute) is `pods/<pod>/volumes/<plugin>/<name>`, and `mounted` says
    /// whether the mount table shows a mount there. Enough to tear it down the right way, or to
    /// set it up again. `None`: the plugin cannot tell, and the directory is left in place.
    fn reconstruct(
        &self,
        _host: &PluginHost,
        _pod: &PodRef,
        _name: &str,
        _dir: &Path,
        _mounted: bool,
    ) -> Option<(VolumeSpec, PathBuf)> {
        None
    }

    /// Its quick set-up and teardown, if it has any.
    fn quick(&self) -> Option<&dyn QuickPlugin> {
        None
    }

    /// Sets the volume up for one pod. Must be idempotent: it may run again on a volume that is
    /// already set up, or was half set up by an interrupted attempt.
    fn set_up(
        &self,
        host: Arc<PluginHost>,
        req: SetUpRequest,
    ) -> BoxFuture<Result<SetUpResult, VolumeError>>;

    /// Tears the volume down for one pod. Must be idempotent and must never remove data that
    /// is not the volume's own.
    fn tear_down(
        &self,
        host: Arc<PluginHost>,
        req: TearDownRequest,
    ) -> BoxFuture<Result<(), VolumeError>>;

    /// Attaches an attachable volume to the node; returns what later steps need (a CSI
    /// driver's publish context).
    fn attach(
        &self,
        _host: Arc<PluginHost>,
        _req: DeviceRequest,
    ) -> BoxFuture<Result<BTreeMap<String, String>, VolumeError>> {
        unsupported(self.name(), "attach")
    }

    /// Detaches a volume no pod on the node uses.
    fn detach(
        &self,
        _host: Arc<PluginHost>,
        _req: DeviceRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        unsupported(self.name(), "detach")
    }

    /// Mounts a device-mountable volume once for the node; returns where, if anywhere.
    fn mount_device(
        &self,
        _host: Arc<PluginHost>,
        _req: DeviceRequest,
    ) -> BoxFuture<Result<Option<PathBuf>, VolumeError>> {
        unsupported(self.name(), "mount device")
    }

    /// Undoes [`VolumePlugin::mount_device`] after the last pod is gone.
    fn unmount_device(
        &self,
        _host: Arc<PluginHost>,
        _req: DeviceRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        unsupported(self.name(), "unmount device")
    }
}

/// The answer of a plugin to an operation it does not have.
fn unsupported<T: Send + 'static>(
    plugin: &'static str,
    operation: &'static str,
) -> BoxFuture<Result<T, VolumeError>> {
    Box::pin(async move { Err(VolumeError::Unsupported { plugin, operation }) })
}

/// Runs blocking plugin work off the runtime's core threads.
pub(crate) fn blocking<T, F>(f: F) -> BoxFuture<Result<T, VolumeError>>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, VolumeError> + Send + 'static,
{
    Box::pin(async move {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| VolumeError::Task(e.to_string()))?
    })
}

/// The plugins, keyed by name.
#[derive(Clone)]
pub struct PluginRegistry {
    plugins: Vec<Arc<dyn VolumePlugin>>,
}

impl PluginRegistry {
    /// The plugins kubevol ships.
    pub fn standard() -> Self {
        let mut r = PluginRegistry {
            plugins: Vec::new(),
        };
        r.register(Arc::new(EmptyDirPlugin));
        r.register(Arc::new(HostPathPlugin));
        r.register(Arc::new(LocalPlugin));
        for kind in ContentKind::ALL {
            r.register(Arc::new(ContentPlugin(kind)));
        }
        r.register(Arc::new(csi::CsiPlugin::default()));
        r.register(Arc::new(image::ImagePlugin));
        r
    }

    /// Adds a plugin (an embedding agent may bring its own).
    pub fn register(&mut self, plugin: Arc<dyn VolumePlugin>) {
        self.plugins.retain(|p| p.name() != plugin.name());
        self.plugins.push(plugin);
    }

    /// The plugin that handles a volume.
    pub fn find(&self, spec: &VolumeSpec) -> Option<Arc<dyn VolumePlugin>> {
        self.plugins.iter().find(|p| p.can_support(spec)).cloned()
    }

    /// A plugin by name.
    pub fn by_name(&self, name: &str) -> Option<Arc<dyn VolumePlugin>> {
        self.plugins.iter().find(|p| p.name() == name).cloned()
    }

    /// The inline volume source fields the registered plugins handle, for error messages;
    /// `persistentVolumeClaim` and `ephemeral` (whose claims are used like any other) when some
    /// plugin serves PersistentVolumes; the in-tree cloud types the CSI plugin serves through
    /// CSI migration, when it is registered.
    pub fn supported_sources(&self) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = self
            .plugins
            .iter()
            .filter(|p| p.serves_inline())
            .map(|p| p.source_field())
            .collect();
        if self.plugins.iter().any(|p| p.serves_persistent()) {
            out.extend(["persistentVolumeClaim", "ephemeral"]);
        }
        out.extend(self.migrated_sources());
        out
    }

    /// The PersistentVolume types the registered plugins mount, for error messages (the
    /// in-tree cloud types among them, where the CSI plugin serves them).
    pub fn persistent_sources(&self) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = self
            .plugins
            .iter()
            .filter(|p| p.serves_persistent())
            .map(|p| p.source_field())
            .collect();
        out.extend(self.migrated_sources());
        out
    }

    /// The in-tree cloud volume types served by their CSI drivers (Kubernetes' CSI migration),
    /// when the CSI plugin is registered.
    fn migrated_sources(&self) -> impl Iterator<Item = &'static str> {
        let csi = self.plugins.iter().any(|p| p.name() == csi::PLUGIN_NAME);
        kubevol_core::migration::IN_TREE
            .iter()
            .filter(move |_| csi)
            .map(|t| t.field)
    }
}

#[cfg(test)]
mod tests;
