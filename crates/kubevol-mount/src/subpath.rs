//! subPath mounts: a file or directory inside a volume, bind-mounted on its own so a container
//! sees only that part.
//!
//! The kubelet's subPath bugs were path races: it resolved the subPath, checked the result, then
//! mounted by path, and a container could swap a directory for a symbolic link in between. Here
//! the subPath is opened once, relative to the volume directory's descriptor, with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: the kernel refuses any resolution that
//! leaves the volume (an absolute link, a link or `..` above the volume root), while links that
//! stay inside (a configMap key pointing into `..data`) resolve as they do for the container. The
//! mount is then made from that descriptor (open_tree + move_mount), never from a path.
//!
//! Mounts live at `pods/<uid>/volume-subpaths/<volume>/<container>/<index>`, the kubelet's
//! layout, where `<index>` is the position of the mount in the container's `volumeMounts`.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType};
use rustix::io::Errno;

use crate::at::io;
use crate::safe::Dir;
use crate::{MountError, Mounter};

/// The directory under a pod's directory that holds its subPath mounts.
pub const SUBPATHS_DIR: &str = "volume-subpaths";

fn escape(volume: &Dir, sub_path: &str) -> MountError {
    crate::pin::escape_from(volume, sub_path, "the volume")
}

fn open_beneath_path(volume: &Dir, sub_path: &str) -> Result<OwnedFd, MountError> {
    crate::pin::open_confined(volume, sub_path, "the volume")
}

/// Opens the subPath inside `volume`, creating missing directories (with the volume root's
/// mode, as the kubelet does) when it does not exist. Returns the descriptor and whether it is a
/// directory.
pub fn open_sub_path(volume: &Dir, sub_path: &str) -> Result<(OwnedFd, bool), MountError> {
    let fd = match open_beneath_path(volume, sub_path) {
        Err(e) if e.is_not_found() => {
            let st = rustix::fs::fstat(volume.fd()).map_err(io("stat", volume.path()))?;
            let mode = st.st_mode & 0o7777;
            volume
                .create_dir_all_with(Path::new(sub_path), mode, mode)
                .map_err(|e| match e {
                    MountError::Symlink { .. } => escape(volume, sub_path),
                    e => e,
                })?;
            open_beneath_path(volume, sub_path)?
        }
        r => r?,
    };
    let st = rustix::fs::fstat(&fd).map_err(io("stat", &volume.path().join(sub_path)))?;
    Ok((
        fd,
        FileType::from_raw_mode(st.st_mode) == FileType::Directory,
    ))
}

/// Where a subPath's bind mount goes: `<pod_dir>/volume-subpaths/<volume_name>/<container>/<index>`.
pub struct SubPathTarget<'a> {
    /// The pod's directory.
    pub pod_dir: &'a Dir,
    /// The volume's name in the pod.
    pub volume_name: &'a str,
    /// The container.
    pub container: &'a str,
    /// The index of the volume mount in the container.
    pub index: usize,
}

/// Bind-mounts `sub_path` of `volume` at `<pod_dir>/volume-subpaths/<volume_name>/<container>/<index>`
/// and returns that path. Already mounted is success.
pub fn bind_sub_path(
    mounter: &dyn Mounter,
    volume: &Dir,
    sub_path: &str,
    pod_dir: &Dir,
    volume_name: &str,
    container: &str,
    index: usize,
) -> Result<PathBuf, MountError> {
    let (source, is_dir) = open_sub_path(volume, sub_path)?;
    let target = SubPathTarget {
        pod_dir,
        volume_name,
        container,
        index,
    };
    bind_opened(
        mounter,
        source.as_fd(),
        is_dir,
        &volume.path().join(sub_path),
        &target,
    )
}

/// Bind-mounts the subPath opened as `source` ([`open_sub_path`]; `shown` is its path, for
/// messages only) at `target`, and returns the mount point's path: the mount is made from the
/// descriptor, so whatever the path leads to by now, the mounted file is the one opened.
pub fn bind_opened(
    mounter: &dyn Mounter,
    source: BorrowedFd<'_>,
    is_dir: bool,
    shown: &Path,
    target: &SubPathTarget<'_>,
) -> Result<PathBuf, MountError> {
    let rel = Path::new(SUBPATHS_DIR)
        .join(target.volume_name)
        .join(target.container);
    let (parent, _) = target.pod_dir.create_dir_all(&rel, 0o750)?;
    let name = target.index.to_string();
    crate::pin::bind_at(mounter, source, is_dir, shown, &parent, &name, false)
}

/// Unmounts every subPath mount of one volume of a pod with `unmount` (which must remove every
/// layer mounted at a path, and treat "not mounted" as done) and removes their mount points
/// (empty directories and the empty files made for file subPaths). Run before the volume
/// itself is torn down.
pub fn unmount_sub_paths(
    unmount: &dyn Fn(&Path) -> Result<(), MountError>,
    pod_dir: &Dir,
    volume_name: &str,
) -> Result<(), MountError> {
    let Some(subpaths) = pod_dir.open_child_if_exists(SUBPATHS_DIR)? else {
        return Ok(());
    };
    let Some(vol) = subpaths.open_child_if_exists(volume_name)? else {
        return Ok(());
    };
    for (container, ft) in vol.entries()? {
        if ft != FileType::Directory {
            continue;
        }
        let container = String::from_utf8_lossy(&container).into_owned();
        let cdir = vol.open_child(OsStr::new(&container))?;
        for (entry, _) in cdir.entries()? {
            let entry = String::from_utf8_lossy(&entry).into_owned();
            unmount(&cdir.path().join(&entry))?;
            remove_mount_point(&cdir, &entry)?;
        }
        vol.remove_empty_tree(&container)?;
    }
    subpaths.remove_empty_tree(volume_name)
}

fn remove_mount_point(dir: &Dir, name: &str) -> Result<(), MountError> {
    let path = dir.path().join(name);
    let st = match rustix::fs::statat(dir.fd(), name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(io("stat", &path)(e)),
    };
    match FileType::from_raw_mode(st.st_mode) {
        FileType::Directory => dir.remove_empty_tree(name),
        FileType::RegularFile if st.st_size == 0 => {
            match rustix::fs::unlinkat(dir.fd(), name, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => Ok(()),
                Err(e) => Err(io("unlink", &path)(e)),
            }
        }
        _ => Err(MountError::Leftover { path }),
    }
}
