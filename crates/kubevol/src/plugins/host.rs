//! What plugins work through: the manager's root directory (opened once, every path below it
//! reached relative to it), the mount layer, node settings, the pods' plugin directories kept
//! open, and the refreshes a plugin asks for.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kubevol_core::names::{escape_plugin_name, SharedStr};
use kubevol_core::projection::NodeAllocatable;
use kubevol_core::{PodRef, PodUid};
use kubevol_mount::safe::Dir;
use kubevol_mount::{MountError, MountOptions, Mounter};

use super::{AttachController, ClaimStatusWriter, TrustBundles};
use crate::error::VolumeError;
use crate::store::ObjectStore;

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
    /// What each pod's content volumes take, against its budget.
    pub content_usage: super::budget::ContentUsage,
    /// The project IDs given to disk-backed emptyDir volumes.
    pub projects: super::usage::Projects,
    /// What each mounted emptyDir held when last measured.
    pub usages: super::usage::Usages,
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
    /// The health CSI drivers report of their volumes and storage.
    pub health: Arc<crate::report::health::Health>,
    /// The fsGroup walks under way.
    pub ownership: super::ownership::Walks,
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
    pub(super) fn waiting(&self) -> usize {
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

    /// The tmpfs whose root is open as `root`: its size and what it holds, in bytes, and its
    /// block (page) size; `None` when it cannot be looked at.
    pub(crate) fn tmpfs_usage(root: &kubevol_mount::safe::Dir) -> Option<TmpfsUsage> {
        let st = rustix::fs::fstatfs(root.fd()).ok()?;
        let block = st.f_bsize as u64;
        Some(TmpfsUsage {
            size: st.f_blocks.saturating_mul(block),
            used: st.f_blocks.saturating_sub(st.f_bfree).saturating_mul(block),
            block,
        })
    }

    /// Remounts the tmpfs at `path` with `size=` bytes (0: no limit), keeping its files.
    pub(crate) fn resize_tmpfs(&self, path: &Path, size: u64) -> Result<(), VolumeError> {
        let options = MountOptions {
            data: vec![format!("size={size}")],
            remount: true,
            ..Default::default()
        };
        self.mounter.mount("tmpfs", path, "tmpfs", &options)?;
        Ok(())
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
            let (dir, made) = parent.retry_fresh(self, |p| p.make_child(OsStr::new(name), mode))?;
            return Ok((path, VolumeDir::Open(dir, made)));
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
        Ok((path, VolumeDir::below(parent.dir, name, mount)))
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
    /// Opened already (no filesystem of its own), and whether it was made just now.
    Open(Dir, bool),
    /// The entry `name` of `parent`, not opened yet.
    Below {
        /// The plugin's directory of the pod.
        parent: Arc<Dir>,
        /// The volume's name.
        name: String,
        /// Whether its filesystem was mounted just now, with the options asked for (a tmpfs
        /// then has the size asked for: nothing to check or resize).
        mounted_now: bool,
    },
}

impl VolumeDir {
    fn below(parent: Arc<Dir>, name: &str, mounted_now: bool) -> Self {
        VolumeDir::Below {
            parent,
            name: name.to_string(),
            mounted_now,
        }
    }

    /// Whether its filesystem was mounted just now, with the options asked for.
    pub(crate) fn mounted_now(&self) -> bool {
        matches!(
            self,
            VolumeDir::Below {
                mounted_now: true,
                ..
            }
        )
    }

    /// The directory, opened.
    pub(crate) fn open(self) -> Result<Dir, MountError> {
        match self {
            VolumeDir::Open(d, _) => Ok(d),
            VolumeDir::Below { parent, name, .. } => parent.open_beneath(Path::new(&name)),
        }
    }
}

/// What [`PluginHost::tmpfs_usage`] finds of a tmpfs, in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TmpfsUsage {
    /// Its size (0: no limit).
    pub size: u64,
    /// What its files take.
    pub used: u64,
    /// Its block size (a page).
    pub block: u64,
}
