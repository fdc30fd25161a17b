//! Volume plugins: one type per volume source, as trait objects in a registry keyed by name.
//!
//! A plugin knows how to set up and tear down one kind of volume; it never decides *when* (the
//! reconciler does) and never touches another plugin's directories. Adding a plugin means one
//! file here and one line in [`PluginRegistry::standard`].

mod content;
pub mod csi;
pub(crate) mod empty_dir;
mod host_path;
pub(crate) mod local;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::names::escape_plugin_name;
use kubevol_core::names::SharedStr;
use kubevol_core::projection::NodeAllocatable;
use kubevol_core::state::{VolumeSpec, VolumeTraits};
use kubevol_core::{PodRef, PodUid, UniqueVolumeName};
use kubevol_mount::safe::{Dir, FsGroupPolicy};
use kubevol_mount::{MountError, MountOptions, Mounter};

pub(crate) use content::StoreObjects;
pub use content::{ContentKind, ContentPlugin};
pub use empty_dir::EmptyDirPlugin;
pub use host_path::HostPathPlugin;
pub use local::LocalPlugin;

use crate::error::VolumeError;
use crate::store::ObjectStore;

/// Who attaches volumes to the node when kubevol does not call ControllerPublishVolume itself:
/// a cluster's attach/detach controller, which records the result in a VolumeAttachment.
pub trait AttachController: Send + Sync + 'static {
    /// The publish context of `volume` once the controller has attached it to this node
    /// (`attachment` names its VolumeAttachment), or what it still waits for.
    fn attached(
        &self,
        volume: UniqueVolumeName,
        attachment: String,
    ) -> BoxFuture<Result<BTreeMap<String, String>, String>>;
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
    ) -> BoxFuture<Result<k8s_openapi::api::core::v1::PersistentVolumeClaim, String>>;
    /// Merge-patches the status of claim `namespace/name` with `patch` (a JSON merge patch of
    /// the whole claim; set `metadata.resourceVersion` to make it conditional); returns the
    /// claim as written.
    fn patch_status(
        &self,
        namespace: String,
        name: String,
        patch: serde_json::Value,
    ) -> BoxFuture<Result<k8s_openapi::api::core::v1::PersistentVolumeClaim, String>>;
}

/// Where `clusterTrustBundle` projected sources are read (the API server in cluster mode).
pub trait TrustBundles: Send + Sync + 'static {
    /// The PEM bundle a source selects (by name, or by signer name and label selector), `None`
    /// when no ClusterTrustBundle matches, or why it cannot be read.
    fn bundle(
        &self,
        source: k8s_openapi::api::core::v1::ClusterTrustBundleProjection,
    ) -> BoxFuture<Result<Option<String>, String>>;
}

pub use crate::BoxFuture;

/// What plugins get from the manager: the root directory, the mount layer and node settings.
pub struct PluginHost {
    /// The root directory (`/var/lib/kubevol`).
    pub root: PathBuf,
    /// The root directory, opened once: every path below it is reached relative to this.
    pub root_dir: Dir,
    /// The mount layer.
    pub mounter: Arc<dyn Mounter>,
    /// Host path prefixes pods may use; empty means any.
    pub host_path_allow: Vec<PathBuf>,
    /// Where the kernel lists huge page sizes (`/sys/kernel/mm/hugepages`).
    pub hugepages_dir: PathBuf,
    /// Where the built-in `kubevol.io/local-path` provisioner makes its volumes' directories.
    pub local_path_dir: PathBuf,
    /// The objects pods reference (ConfigMaps, Secrets).
    pub store: Arc<ObjectStore>,
    /// This node's name.
    pub node_name: String,
    /// This node's labels as configured (`--node-labels`); the Node object's labels take
    /// their place once a source delivers it (see [`PluginHost::node_facts`]).
    pub node_labels: std::collections::BTreeMap<String, String>,
    /// What a container without limits is limited by.
    pub node_allocatable: NodeAllocatable,
    /// The CSI drivers.
    pub csi: Arc<crate::csi::Drivers>,
    /// The durable record of what is on the node.
    pub record: Arc<crate::record::Record>,
    /// Whether a busy mount may be detached lazily.
    pub allow_lazy_unmount: bool,
    /// Service account tokens (issued in cluster mode).
    pub tokens: Arc<crate::tokens::Tokens>,
    /// Pod certificates (requested in cluster mode).
    pub certificates: Arc<crate::certificates::PodCertificates>,
    /// Who attaches volumes when kubevol does not (a cluster's attach/detach controller).
    pub attach_controller: std::sync::OnceLock<Arc<dyn AttachController>>,
    /// Where claims' statuses are written (the API server in cluster mode).
    pub claim_status: std::sync::OnceLock<Arc<dyn ClaimStatusWriter>>,
    /// Where cluster trust bundles are read (the API server in cluster mode).
    pub trust_bundles: std::sync::OnceLock<Arc<dyn TrustBundles>>,
    /// Asks the populator to process a pod again (its tokens are due, its bundles are to be
    /// read again, its CSI volumes republished).
    pub refresh: Refresher,
    /// The plugin directories last used, kept open.
    pub(crate) plugin_dirs: PluginDirCache,
    /// The containers' default SELinux file context, or `None`: the node has no SELinux.
    pub selinux_context: Option<String>,
    /// SELinuxMount: every volume, not only ReadWriteOncePod ones, is mounted with its label.
    pub selinux_mount_all: bool,
    /// The metrics.
    pub metrics: Arc<crate::report::metrics::Metrics>,
    /// The pods' events, for what a plugin does beside set-up and teardown (an expansion).
    pub events: Arc<crate::report::events::EventRecorder>,
}

impl PluginHost {
    /// This node's name and labels as PersistentVolumes' nodeAffinity sees them: the labels
    /// of the Node object when a source delivers it (cluster mode), else the configured ones;
    /// the kubelet's own labels (hostname, os, arch) added where missing.
    pub fn node_facts(&self) -> kubevol_core::affinity::NodeFacts {
        match self.store.node(&self.node_name) {
            Some(node) => crate::node::facts(
                &self.node_name,
                node.object
                    .metadata
                    .labels
                    .as_ref()
                    .unwrap_or(&Default::default()),
            ),
            // Without a Node object, the CSI drivers' topology labels are the node's too, as
            // the kubelet puts them on its Node.
            None => {
                let mut labels = self.csi.topology_labels();
                labels.extend(self.node_labels.clone());
                crate::node::facts(&self.node_name, &labels)
            }
        }
    }

    /// Processes `pod` again at `at`: its content volumes are written again.
    pub(crate) fn refresh_at(&self, pod: kubevol_core::PodUid, at: tokio::time::Instant) {
        self.refresh.at(pod, at);
    }
}

/// Asks the populator to process pods again at given times. Each pod has at most one wait, for
/// the earliest time asked: a set-up that asks for a later time while one is pending adds
/// nothing, so the set-ups that each refresh causes never multiply.
#[derive(Clone)]
pub struct Refresher {
    tx: tokio::sync::mpsc::UnboundedSender<kubevol_core::PodUid>,
    due: Arc<std::sync::Mutex<HashMap<kubevol_core::PodUid, tokio::time::Instant>>>,
}

impl Refresher {
    /// Refreshes sent to `tx`.
    pub fn new(tx: tokio::sync::mpsc::UnboundedSender<kubevol_core::PodUid>) -> Self {
        Refresher {
            tx,
            due: Arc::default(),
        }
    }

    /// Sends `pod` at `at`, unless it is already to be sent by then.
    pub(crate) fn at(&self, pod: kubevol_core::PodUid, at: tokio::time::Instant) {
        let now = tokio::time::Instant::now();
        {
            let mut due = crate::sync::lock(&self.due);
            if due.get(&pod).is_some_and(|t| *t <= at && *t > now) {
                return;
            }
            due.insert(pod.clone(), at);
        }
        let (tx, due) = (self.tx.clone(), self.due.clone());
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            {
                let mut due = crate::sync::lock(&due);
                if due.get(&pod) == Some(&at) {
                    due.remove(&pod);
                }
            }
            let _ = tx.send(pod);
        });
    }

    /// How many pods wait for a refresh.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        crate::sync::lock(&self.due).len()
    }
}

/// A filesystem a volume directory is covered with (tmpfs, hugetlbfs).
pub(crate) struct Filesystem {
    pub(crate) source: &'static str,
    pub(crate) fstype: &'static str,
    pub(crate) data: Vec<String>,
}

impl PluginHost {
    /// `pods/<uid>/volumes/<escaped plugin>` relative to the root.
    pub fn pod_plugin_dir(pod: &PodRef, plugin: &str) -> PathBuf {
        Self::pod_plugin_path(&pod.uid, "volumes", plugin)
    }

    /// `pods/<uid>/<kind>/<escaped plugin>` relative to the root: `kind` is `volumes` (where
    /// a pod's filesystem volumes are) or `volumeDevices` (where its block volumes' links are).
    pub(crate) fn pod_plugin_path(pod: &PodUid, kind: &str, plugin: &str) -> PathBuf {
        PathBuf::from(["pods", pod.as_str(), kind, &escape_plugin_name(plugin)].join("/"))
    }

    /// The absolute path of a pod's volume directory.
    /// Built in one allocation of its exact length: the actual state keeps one for every
    /// mounted volume.
    pub fn pod_volume_path(&self, pod: &PodRef, plugin: &str, volume: &str) -> PathBuf {
        let plugin = escape_plugin_name(plugin);
        let plugin: &str = &plugin;
        let parts: [&std::ffi::OsStr; 6] = [
            self.root.as_os_str(),
            "pods".as_ref(),
            pod.uid.as_str().as_ref(),
            "volumes".as_ref(),
            plugin.as_ref(),
            volume.as_ref(),
        ];
        let mut path = PathBuf::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
        for part in parts {
            path.push(part);
        }
        path
    }

    /// The pod's directory for `plugin`, made if missing when `create` (not found otherwise).
    fn plugin_dir<'a>(
        &self,
        pod: &'a PodRef,
        plugin: &'a str,
        create: bool,
    ) -> Result<PluginDir<'a>, MountError> {
        if let Some(dir) = self.plugin_dirs.get(&pod.uid, plugin) {
            return Ok(PluginDir {
                dir,
                pod,
                plugin,
                create,
                kept: true,
            });
        }
        self.fresh_plugin_dir(pod, plugin, create)
    }

    fn fresh_plugin_dir<'a>(
        &self,
        pod: &'a PodRef,
        plugin: &'a str,
        create: bool,
    ) -> Result<PluginDir<'a>, MountError> {
        let rel = Self::pod_plugin_dir(pod, plugin);
        let dir = Arc::new(if create {
            self.root_dir.create_dir_all(&rel, 0o750)?.0
        } else {
            self.root_dir.open_beneath(&rel)?
        });
        self.plugin_dirs.keep(&pod.uid, plugin, dir.clone());
        Ok(PluginDir {
            dir,
            pod,
            plugin,
            create,
            kept: false,
        })
    }

    /// Makes `pods/<uid>/volumes/<plugin>` (0750) if missing, ahead of the pod's volumes.
    /// `pods` is kept open from one pod to the next; one removed since says "not there" to
    /// the mkdir, and the directory at the path now is made and kept instead.
    pub(crate) fn make_plugin_dir(&self, pod: &PodRef, plugin: &str) -> Result<(), MountError> {
        let plugin = escape_plugin_name(plugin);
        let names: [&OsStr; 3] = [
            pod.uid.as_str().as_ref(),
            "volumes".as_ref(),
            OsStr::new(plugin.as_ref()),
        ];
        let make = |pods: &Dir| pods.make_dirs(&names, 0o750);
        let kept = crate::sync::lock(&self.plugin_dirs.pods).clone();
        if let Some(pods) = &kept {
            match make(pods) {
                Err(e) if e.is_not_found() => {}
                r => return r.map(drop),
            }
        }
        let pods = Arc::new(self.root_dir.create_dir_all(Path::new("pods"), 0o750)?.0);
        *crate::sync::lock(&self.plugin_dirs.pods) = Some(pods.clone());
        make(&pods).map(drop)
    }

    /// Removes gone pods' directories with rmdir only, never crossing a mount point, so a
    /// failed unmount can never lose a volume's data. With a pod comes the plugin of its last
    /// volume, which says where its volumes were (`volumes/<plugin>`): that chain goes without
    /// reading a directory, and anything else there is looked for (and reported if not empty).
    /// `pods` is opened once for them all, at its path now: a descriptor kept from before,
    /// of a directory removed since, would find nothing to remove and say it is done.
    pub(crate) fn remove_pod_dirs(
        &self,
        gone: impl IntoIterator<Item = (PodUid, Option<SharedStr>)>,
    ) -> Vec<(PodUid, Result<(), MountError>)> {
        let open = || self.root_dir.open_beneath(Path::new("pods"));
        let pods = open();
        gone.into_iter()
            .map(|(pod, plugin)| {
                self.plugin_dirs.forget(&pod);
                let plugin = plugin.map(|p| escape_plugin_name(&p));
                let chain = plugin.as_deref().map(|p| ["volumes", p]);
                let along = chain.as_ref().map_or(&[][..], |c| &c[..]);
                let removed = match &pods {
                    Ok(pods) => pods.remove_empty_tree_along(pod.as_str(), along),
                    // Each is told why.
                    Err(_) => open().and_then(|p| p.remove_empty_tree_along(pod.as_str(), along)),
                };
                (pod, removed)
            })
            .collect()
    }

    /// Creates `pods/<uid>/volumes/<plugin>/<name>` (with `mode`, parents 0750) and, when `fs` is
    /// given, mounts it there unless it is mounted already (its root with `mode`). Returns the
    /// path and the directory.
    pub(crate) fn set_up_volume_dir(
        &self,
        pod: &PodRef,
        plugin: &str,
        name: &str,
        mode: u32,
        fs: Option<Filesystem>,
    ) -> Result<(PathBuf, VolumeDir), VolumeError> {
        let path = self.pod_volume_path(pod, plugin, name);
        let mut parent = self.plugin_dir(pod, plugin, true)?;
        let Some(mut fs) = fs else {
            let (dir, _) = parent.retry_fresh(self, |p| p.make_child(OsStr::new(name), mode))?;
            return Ok((path, VolumeDir::Open(dir)));
        };
        // The common first set-up: a directory made a moment ago cannot be a mount point. (It
        // is not opened: the filesystem mounted on it is what the caller may want to open.)
        let mount = if parent.retry_fresh(self, |p| p.make_dir(OsStr::new(name), mode))? {
            true
        } else {
            // There already (a repeated or interrupted set-up): mounted already is kept, unless
            // it is dead. A dead mount stacked over the volume's own filesystem is removed layer
            // by layer down to a live one, whose content is kept.
            for _ in 0..16 {
                match parent.open_beneath(Path::new(name)) {
                    Err(e)
                        if e.errno()
                            .is_some_and(kubevol_mount::is_corrupted_mount_errno)
                            && self.mounter.is_mount_point(&path)? =>
                    {
                        tracing::warn!(path = %path.display(), "corrupted mount ({e}): unmounting it");
                        self.mounter.unmount(&path)?;
                    }
                    // Removed meanwhile.
                    Err(e) if e.is_not_found() => {
                        parent.make_dir(OsStr::new(name), mode)?;
                        break;
                    }
                    Err(e) => return Err(e.into()),
                    Ok(_) => break,
                }
            }
            !self.mounter.is_mount_point(&path)?
        };
        if mount {
            // The new filesystem's root, not the directory it covers, must have the mode.
            fs.data.push(format!("mode={mode:04o}"));
            let options = MountOptions {
                data: fs.data,
                ..Default::default()
            };
            self.mounter.mount(fs.source, &path, fs.fstype, &options)?;
        }
        Ok((path, VolumeDir::below(parent.dir, name)))
    }

    /// Tears down what [`PluginHost::set_up_volume_dir`] made: unmounts the volume's own
    /// filesystem (`mounted` says it has one; on a disk volume a mount is someone else's and is
    /// refused), then removes the directory and its contents without leaving its filesystem.
    pub(crate) fn tear_down_volume_dir(
        &self,
        pod: &PodRef,
        plugin: &str,
        name: &str,
        path: &Path,
        mounted: bool,
    ) -> Result<(), VolumeError> {
        let mut parent = match self.plugin_dir(pod, plugin, false) {
            Ok(p) => p,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if mounted {
            // Its own filesystem: unmounted without a look first (umount2 says when nothing is
            // mounted there), then each layer stacked below it, until the rmdir (which never
            // removes a mount point) finds none left.
            match self.unmount_one(path) {
                Err(MountError::Unmount {
                    errno: kubevol_mount::Errno::NOENT,
                    ..
                }) => return Ok(()),
                r => r?,
            };
            for _ in 0..16 {
                match parent.remove_entry(self, name) {
                    Err(MountError::NestedMount { .. }) => self.unmount_all(path)?,
                    r => return Ok(r?),
                }
            }
            return Err(MountError::NestedMount {
                path: path.to_path_buf(),
            }
            .into());
        }
        // A dead mount cannot be looked at, but it is there.
        let present = match parent.has_entry(name) {
            Err(e)
                if e.errno()
                    .is_some_and(kubevol_mount::is_corrupted_mount_errno) =>
            {
                true
            }
            r => r?,
        };
        if present && self.mounter.is_mount_point(path)? {
            // Something else is mounted over a disk volume: never unmount or enter it.
            return Err(MountError::NestedMount {
                path: path.to_path_buf(),
            }
            .into());
        }
        parent.remove_entry(self, name)?;
        Ok(())
    }

    /// Unmounts the top mount at `path`. EBUSY is an error to retry unless lazy unmounts are
    /// allowed.
    fn unmount_one(&self, path: &Path) -> Result<kubevol_mount::Unmounted, MountError> {
        match self.mounter.unmount(path) {
            Err(MountError::Unmount {
                errno: kubevol_mount::Errno::BUSY,
                ..
            }) if self.allow_lazy_unmount => {
                tracing::warn!(path = %path.display(), "mount busy: detaching it lazily (--allow-lazy-unmount)");
                self.mounter.unmount_lazy(path)
            }
            // Who keeps it busy, looked for once per attempt (each a backoff step apart).
            Err(MountError::Unmount {
                errno: kubevol_mount::Errno::BUSY,
                target,
            }) => Err(match self.mounter.holders(&target) {
                Some(holders) => MountError::Busy {
                    target,
                    holders: Box::new(holders),
                },
                None => MountError::Unmount {
                    errno: kubevol_mount::Errno::BUSY,
                    target,
                },
            }),
            r => r,
        }
    }

    /// Unmounts `path`, and whatever is stacked under it there (a dead mount over the
    /// volume's own).
    pub(crate) fn unmount_all(&self, path: &Path) -> Result<(), MountError> {
        for _ in 0..16 {
            let done = self.unmount_one(path)?;
            if done == kubevol_mount::Unmounted::NotMounted || !self.mounter.is_mount_point(path)? {
                return Ok(());
            }
        }
        Ok(())
    }
}

/// The plugin directories of the pods whose volumes were set up or torn down last, kept open:
/// a pod's volumes come one after another, and each would otherwise walk `pods/<uid>/volumes/
/// <plugin>` again (a few are kept, as a pod's configMap, secret and projected volumes take
/// turns). A kept directory may have been removed since (by the pod's cleanup, or by hand); a
/// removed directory holds nothing and takes nothing, so "not there" from a kept one is asked
/// again of the directory at the path now (see [`PluginDir`]).
#[derive(Default)]
pub(crate) struct PluginDirCache {
    kept: std::sync::Mutex<std::collections::VecDeque<KeptDir>>,
    /// `<root>/pods`, which every pod's directory is made in.
    pods: std::sync::Mutex<Option<Arc<Dir>>>,
}

type KeptDir = (PodUid, String, Arc<Dir>);

impl PluginDirCache {
    /// How many directories are kept open.
    const KEPT: usize = 4;

    fn get(&self, pod: &PodUid, plugin: &str) -> Option<Arc<Dir>> {
        crate::sync::lock(&self.kept)
            .iter()
            .find(|(p, name, _)| p == pod && name == plugin)
            .map(|(_, _, dir)| dir.clone())
    }

    fn keep(&self, pod: &PodUid, plugin: &str, dir: Arc<Dir>) {
        let mut kept = crate::sync::lock(&self.kept);
        kept.retain(|(p, name, _)| !(p == pod && name == plugin));
        if kept.len() == Self::KEPT {
            kept.pop_back();
        }
        kept.push_front((pod.clone(), plugin.to_string(), dir));
    }

    fn forget(&self, pod: &PodUid) {
        crate::sync::lock(&self.kept).retain(|(p, _, _)| p != pod);
    }
}

/// A pod's plugin directory as [`PluginHost::plugin_dir`] found it.
struct PluginDir<'a> {
    dir: Arc<Dir>,
    pod: &'a PodRef,
    plugin: &'a str,
    create: bool,
    /// Kept open from before: it may have been removed since.
    kept: bool,
}

impl std::ops::Deref for PluginDir<'_> {
    type Target = Dir;

    fn deref(&self) -> &Dir {
        &self.dir
    }
}

impl PluginDir<'_> {
    /// Opens the directory at the path now in place of the kept one.
    fn refresh(&mut self, host: &PluginHost) -> Result<(), MountError> {
        host.plugin_dirs.forget(&self.pod.uid);
        *self = host.fresh_plugin_dir(self.pod, self.plugin, self.create)?;
        Ok(())
    }

    /// `f` on the directory; again on the directory at the path now when a kept one says
    /// "not found" (`f` must change nothing before it fails so).
    fn retry_fresh<T>(
        &mut self,
        host: &PluginHost,
        f: impl Fn(&Dir) -> Result<T, MountError>,
    ) -> Result<T, MountError> {
        match f(&self.dir) {
            Err(e) if self.kept && e.is_not_found() => {
                self.refresh(host)?;
                f(&self.dir)
            }
            r => r,
        }
    }

    /// Removes the volume directory `name` and what it holds, on its own filesystem. Nothing
    /// there in a kept directory is looked for again in the directory at the path now.
    fn remove_entry(&mut self, host: &PluginHost, name: &str) -> Result<(), MountError> {
        if self.dir.remove_dir_all_one_fs_found(name)? || !self.kept {
            return Ok(());
        }
        match self.refresh(host) {
            Ok(()) => self.dir.remove_dir_all_one_fs(name),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// A volume's directory as set-up left it, opened when the caller needs it (for an fsGroup, or
/// to write content): after the mount, so that it is the new filesystem's root.
pub(crate) enum VolumeDir {
    /// Opened already (no filesystem of its own).
    Open(Dir),
    /// The entry `name` of `parent`, not opened yet.
    Below {
        /// The plugin's directory of the pod.
        parent: Arc<Dir>,
        /// The volume's name.
        name: String,
    },
}

impl VolumeDir {
    fn below(parent: Arc<Dir>, name: &str) -> Self {
        VolumeDir::Below {
            parent,
            name: name.to_string(),
        }
    }

    /// The directory, opened.
    pub(crate) fn open(self) -> Result<Dir, MountError> {
        match self {
            VolumeDir::Open(d) => Ok(d),
            VolumeDir::Below { parent, name } => parent.open_beneath(Path::new(&name)),
        }
    }
}

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
mod tests {
    use super::*;

    /// Every standard plugin's directory name is one spelled out ahead (no string is made for
    /// it at each volume's path), and it is the kubelet's escaping of the plugin's name.
    #[test]
    fn every_standard_plugin_has_its_directory_name_ready() {
        let registry = PluginRegistry::standard();
        for plugin in &registry.plugins {
            let name = plugin.name();
            match escape_plugin_name(name) {
                std::borrow::Cow::Borrowed(dir) => assert_eq!(dir, name.replace('/', "~")),
                std::borrow::Cow::Owned(_) => panic!("{name}: not among the built-in names"),
            }
        }
    }

    /// A refresh asked for while an earlier one is pending adds no wait; an earlier one does;
    /// each pod is sent once per wait that fires.
    #[tokio::test(start_paused = true)]
    async fn refreshes_of_a_pod_do_not_multiply() {
        use std::time::Duration;
        use tokio::time::Instant;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let r = Refresher::new(tx);
        let pod = kubevol_core::PodUid::from("p");
        let now = Instant::now();
        r.at(pod.clone(), now + Duration::from_secs(60));
        for _ in 0..100 {
            r.at(pod.clone(), now + Duration::from_secs(90));
        }
        r.at(pod.clone(), now + Duration::from_secs(30));
        assert_eq!(r.waiting(), 1);
        tokio::time::sleep(Duration::from_secs(31)).await;
        assert_eq!(rx.recv().await, Some(pod.clone()), "the earliest first");
        assert_eq!(r.waiting(), 0);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(
            rx.recv().await,
            Some(pod.clone()),
            "the one at 60 s still fires"
        );
        assert!(
            rx.try_recv().is_err(),
            "the later asks added nothing: {:?}",
            rx.try_recv()
        );
    }
}
