//! local: a PersistentVolume that is a directory or a block device of this node
//! (`spec.local.path`), handed to pods through a claim, as the kubelet's `local-volume` plugin.
//!
//! - volumeMode Filesystem: the directory is bind-mounted at
//!   `pods/<uid>/volumes/kubernetes.io~local-volume/<pv>` (read-only when the claim volume is),
//!   and the pod's fsGroup is applied to it.
//! - volumeMode Block: the device is bind-mounted on the file
//!   `plugins/kubernetes.io/local-volume/volumeDevices/<pv>/<pod uid>` (the device the runtime
//!   gets), and `pods/<uid>/volumeDevices/kubernetes.io~local-volume/<pv>` links to the device.
//!
//! The path is opened once and bound by its descriptor, so nothing can swap it between the
//! check and the mount. It must be inside `--host-path-allow` when that list is set. Teardown
//! unmounts and removes only empty directories and the empty mount-point file it made: the
//! volume's data is never touched, whatever state the mount is found in.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    LocalVolumeSource, PersistentVolume, PersistentVolumeClaimVolumeSource, PersistentVolumeSpec,
    Volume,
};
use kubevol_core::state::{PodVolumeRef, VolumeSpec};
use kubevol_core::{PodRef, PodUid, UniqueVolumeName};
use kubevol_mount::safe::Dir;
use rustix::fs::{FileType, Mode, OFlags};

use super::host_path::check_allowed;
use super::{
    blocking, fs_group, BoxFuture, PluginHost, SetUpRequest, SetUpResult, TearDownRequest,
    VolumePlugin,
};
use crate::error::VolumeError;

/// The kubelet's name of the plugin.
pub const PLUGIN_NAME: &str = "kubernetes.io/local-volume";

/// The local plugin.
pub struct LocalPlugin;

/// The PersistentVolume's name and its local source.
fn source(spec: &VolumeSpec) -> Option<(&str, &LocalVolumeSource)> {
    let pv = spec.persistent_volume.as_ref()?;
    let local = pv.spec.as_ref()?.local.as_ref()?;
    Some((pv.metadata.name.as_deref().unwrap_or_default(), local))
}

/// The directory of a block volume's per-pod device files, relative to the root.
fn global_map_dir(pv: &str) -> PathBuf {
    Path::new("plugins")
        .join(PLUGIN_NAME)
        .join("volumeDevices")
        .join(pv)
}

/// The link to a block volume's device for one pod, relative to the root.
fn pod_device_link(pod: &PodUid, pv: &str) -> PathBuf {
    PluginHost::pod_plugin_path(pod, "volumeDevices", PLUGIN_NAME).join(pv)
}

/// Whether the pod's claim volume is read-only (`persistentVolumeClaim.readOnly`).
fn read_only(spec: &VolumeSpec) -> bool {
    spec.volume
        .persistent_volume_claim
        .as_ref()
        .and_then(|c| c.read_only)
        .unwrap_or(false)
}

/// Opens the local path (following links: the path is the operator's) and checks that it is
/// what the volume mode needs.
fn open_local(pv: &str, path: &Path, block: bool) -> Result<OwnedFd, VolumeError> {
    let problem = |detail: String| VolumeError::LocalPath {
        pv: pv.to_string(),
        path: path.to_path_buf(),
        detail,
    };
    let fd = rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty()).map_err(|e| {
        if e == rustix::io::Errno::NOENT {
            problem("does not exist on this node: create it, or fix the PersistentVolume's spec.local.path (or its nodeAffinity, if the volume is on another node)".into())
        } else {
            problem(format!("cannot be opened: {e}"))
        }
    })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| problem(format!("cannot be examined: {e}")))?;
    let kind = FileType::from_raw_mode(st.st_mode);
    match (block, kind) {
        (false, FileType::Directory) | (true, FileType::BlockDevice) => Ok(fd),
        (false, FileType::BlockDevice) => Err(problem(
            "is a block device, and kubevol mounts a local volume of volumeMode Filesystem only from a directory: format and mount the device and point spec.local.path at the mount point, or use volumeMode Block".into(),
        )),
        (false, other) => Err(problem(format!(
            "is {}, not a directory (volumeMode Filesystem needs one)",
            describe(other)
        ))),
        (true, other) => Err(problem(format!(
            "is {}, not a block device (volumeMode Block needs one)",
            describe(other)
        ))),
    }
}

fn describe(kind: FileType) -> &'static str {
    match kind {
        FileType::Directory => "a directory",
        FileType::RegularFile => "a regular file",
        FileType::BlockDevice => "a block device",
        FileType::CharacterDevice => "a character device",
        FileType::Socket => "a socket",
        FileType::Fifo => "a FIFO",
        _ => "something else",
    }
}

/// Bind-mounts the directory for one pod; returns the mount point.
fn set_up_directory(
    host: &PluginHost,
    req: &SetUpRequest,
    pv: &str,
    path: &Path,
) -> Result<SetUpResult, VolumeError> {
    let source = open_local(pv, path, false)?;
    let read_only = read_only(&req.spec);
    let (parent, _) = host.root_dir.create_dir_all(
        &PluginHost::pod_plugin_dir(&req.pod_ref, PLUGIN_NAME),
        0o750,
    )?;
    parent.create_dir_all(Path::new(pv), 0o750)?;
    let target = parent.path().join(pv);
    // Mounted already (a repeated or interrupted set-up): kept.
    if !host.mounter.is_mount_point(&target)? {
        host.mounter
            .bind_fd(source.as_fd(), path, &parent, pv, false)?;
    }
    if read_only {
        host.mounter.remount_read_only(&target)?;
    } else if let Some((gid, policy)) = fs_group(&req.pod) {
        let dir = parent.open_beneath(Path::new(pv))?;
        host.apply_fs_group(&req.pod_ref, &req.outer_volume_name, &dir, gid, policy)?;
    }
    Ok(SetUpResult {
        path: target,
        read_only,
    })
}

/// Bind-mounts the device on the pod's device file and links the pod's device path to it;
/// returns the device file.
fn set_up_block(
    host: &PluginHost,
    req: &SetUpRequest,
    pv: &str,
    path: &Path,
) -> Result<SetUpResult, VolumeError> {
    let source = open_local(pv, path, true)?;
    let uid = req.pod_ref.uid.as_str();
    let (dir, _) = host.root_dir.create_dir_all(&global_map_dir(pv), 0o750)?;
    let file = dir.path().join(uid);
    if !(dir.has_entry(uid)? && host.mounter.is_mount_point(&file)?) {
        let made = rustix::fs::openat(
            dir.fd(),
            uid,
            OFlags::CREATE | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o640),
        )
        .map_err(|e| {
            VolumeError::Mount(kubevol_mount::MountError::Io {
                op: "create",
                path: file.clone(),
                errno: e,
            })
        })?;
        drop(made);
        host.mounter
            .bind_fd(source.as_fd(), path, &dir, uid, false)?;
    }
    let link = pod_device_link(&req.pod_ref.uid, pv);
    host.root_dir
        .replace_symlink(&link, path)
        .map_err(|e| VolumeError::LocalPath {
            pv: pv.to_string(),
            path: path.to_path_buf(),
            detail: format!(
                "cannot be linked at {}: {e}",
                host.root.join(&link).display()
            ),
        })?;
    Ok(SetUpResult {
        path: file,
        read_only: read_only(&req.spec),
    })
}

/// Undoes [`set_up_block`] for one pod.
fn tear_down_block(host: &PluginHost, pod: &PodRef, pv: &str) -> Result<(), VolumeError> {
    host.root_dir
        .remove_beneath(&pod_device_link(&pod.uid, pv), false)?;
    let dir = match host.root_dir.open_beneath(&global_map_dir(pv)) {
        Ok(d) => d,
        Err(e) if e.is_not_found() => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let uid = pod.uid.as_str();
    if dir.has_entry(uid)? {
        host.unmount_all(&dir.path().join(uid))?;
        remove_empty_file(&dir, uid)?;
    }
    // Other pods' device files keep the directory.
    let _ = rustix::fs::unlinkat(
        host.root_dir.fd(),
        global_map_dir(pv).as_path(),
        rustix::fs::AtFlags::REMOVEDIR,
    );
    Ok(())
}

/// Removes the empty regular file `name` of `dir` (a device's mount point once unmounted);
/// anything else is left in place and reported.
fn remove_empty_file(dir: &Dir, name: &str) -> Result<(), VolumeError> {
    let path = dir.path().join(name);
    let st = rustix::fs::statat(dir.fd(), name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).map_err(
        |errno| kubevol_mount::MountError::Io {
            op: "stat",
            path: path.clone(),
            errno,
        },
    )?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile || st.st_size != 0 {
        return Err(kubevol_mount::MountError::Leftover { path }.into());
    }
    rustix::fs::unlinkat(dir.fd(), name, rustix::fs::AtFlags::empty()).map_err(|errno| {
        kubevol_mount::MountError::Io {
            op: "unlink",
            path,
            errno,
        }
        .into()
    })
}

impl VolumePlugin for LocalPlugin {
    fn name(&self) -> &'static str {
        PLUGIN_NAME
    }

    fn source_field(&self) -> &'static str {
        "local"
    }

    fn serves_inline(&self) -> bool {
        false
    }

    fn serves_persistent(&self) -> bool {
        true
    }

    fn can_support(&self, spec: &VolumeSpec) -> bool {
        source(spec).is_some()
    }

    /// Keyed by the PersistentVolume's name, which is also its directory's, so a volume found
    /// in the pods directory after a restart has the key the pod's claim gives it.
    fn volume_name(&self, pod: &PodRef, spec: &VolumeSpec) -> UniqueVolumeName {
        let pv = source(spec).map_or(spec.volume.name.as_str(), |(pv, _)| pv);
        UniqueVolumeName::for_pod_volume(PLUGIN_NAME, &pod.uid, pv)
    }

    fn reconstruct(
        &self,
        _host: &PluginHost,
        _pod: &PodRef,
        name: &str,
        dir: &Path,
        _mounted: bool,
    ) -> Option<(VolumeSpec, PathBuf)> {
        // Teardown needs only the name: it unmounts whatever is there and removes empty
        // directories. The path is not known without the record, and not needed.
        let mut pv = PersistentVolume::default();
        pv.metadata.name = Some(name.to_string());
        pv.spec = Some(PersistentVolumeSpec {
            local: Some(LocalVolumeSource::default()),
            ..Default::default()
        });
        Some((
            VolumeSpec {
                volume: PodVolumeRef::from(Volume {
                    name: name.to_string(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource::default()),
                    ..Default::default()
                }),
                persistent_volume: Some(Arc::new(pv)),
                block: false,
                extensions: Default::default(),
                selinux_label: None,
                selinux_mount: false,
            },
            dir.to_path_buf(),
        ))
    }

    fn set_up(
        &self,
        host: Arc<PluginHost>,
        req: SetUpRequest,
    ) -> BoxFuture<Result<SetUpResult, VolumeError>> {
        blocking(move || {
            let Some((pv, local)) = source(&req.spec) else {
                return Err(VolumeError::Unsupported {
                    plugin: PLUGIN_NAME,
                    operation: "set up a volume that is not a local PersistentVolume",
                });
            };
            kubevol_core::names::PathName::new("the PersistentVolume's name", pv)?;
            let path = PathBuf::from(&local.path);
            // The local-path provisioner's own directory is allowed where host paths are
            // limited: kubevol chose it.
            let mut allow = host.host_path_allow.clone();
            if !allow.is_empty() {
                allow.push(host.local_path_dir.clone());
            }
            check_allowed(&path, &allow)?;
            if req.spec.block {
                set_up_block(&host, &req, pv, &path)
            } else {
                set_up_directory(&host, &req, pv, &path)
            }
        })
    }

    fn tear_down(
        &self,
        host: Arc<PluginHost>,
        req: TearDownRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        blocking(move || {
            let pv = source(&req.spec).map_or(req.outer_volume_name.as_str(), |(pv, _)| pv);
            if req.spec.block {
                return tear_down_block(&host, &req.pod_ref, pv);
            }
            let parent = match host
                .root_dir
                .open_beneath(&PluginHost::pod_plugin_dir(&req.pod_ref, PLUGIN_NAME))
            {
                Ok(p) => p,
                Err(e) if e.is_not_found() => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            let present = match parent.has_entry(pv) {
                Err(e)
                    if e.errno()
                        .is_some_and(kubevol_mount::is_corrupted_mount_errno) =>
                {
                    true
                }
                r => r?,
            };
            if !present {
                return Ok(());
            }
            host.unmount_all(&parent.path().join(pv))?;
            // rmdir only: if the directory is not empty, something wrote into it while it was
            // not mounted, and that is left for the operator.
            parent.remove_empty_tree(pv)?;
            Ok(())
        })
    }
}
