//! kubevol's mount layer: the only code that calls mount(2) and umount(2), reads the mount table
//! and creates or removes directories under the root directory.
//!
//! Everything above this crate talks to the kernel through the narrow [`Mounter`] trait (so the
//! reconciler and executor can be unit-tested with [`FakeMounter`]) and through [`safe::Dir`],
//! a directory handle whose every operation is relative to a file descriptor and never follows a
//! symbolic link. This crate must never decide *what* to mount: it only does what it is told and
//! reports the truth of the mount table.

#![deny(unsafe_code)]

pub mod alloc;
mod at;
pub mod atomic;
pub mod fake;
pub mod fs_group;
pub mod holders;
pub mod mountinfo;
pub mod ns;
pub mod pin;
pub mod safe;
pub mod subpath;
pub mod usage;
pub mod walk;

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, UnmountFlags};

pub use fake::FakeMounter;
pub use mountinfo::MountInfo;
pub use rustix::io::Errno;

/// An error of the mount layer, with the path and errno that caused it.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// mount(2) failed.
    #[error("mount {fstype} {source_name:?} at {}: {errno}", target.display())]
    Mount {
        /// The mount source.
        source_name: String,
        /// The mount target.
        target: PathBuf,
        /// The filesystem type.
        fstype: String,
        /// The kernel's answer.
        errno: Errno,
    },
    /// umount(2) failed.
    #[error("unmount {}: {errno}{}", target.display(), unmount_hint(*errno, target))]
    Unmount {
        /// The mount point.
        target: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// umount(2) said the mount is busy, and what keeps it busy was looked for.
    #[error("unmount {}: target is busy: {holders}; kubevol tries again as soon as the processes holding it exit (else with backoff) and never kills anything; --allow-lazy-unmount lets it detach the mount lazily instead", target.display())]
    Busy {
        /// The mount point.
        target: PathBuf,
        /// What holds it.
        holders: Box<holders::Holders>,
    },
    /// A file operation failed.
    #[error("{op} {}: {errno}", path.display())]
    Io {
        /// What was attempted.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// A path component is a symbolic link where none may be.
    #[error("{} is a symbolic link; kubevol never follows links inside the root directory", path.display())]
    Symlink {
        /// The link.
        path: PathBuf,
    },
    /// A path is not a plain relative path (absolute, or with `..`).
    #[error("{} is not a plain relative path", path.display())]
    NotRelative {
        /// The path.
        path: PathBuf,
    },
    /// A removal met a mount point or another filesystem and stopped before touching it.
    #[error("{} is a mount point (or another filesystem) inside the volume; unmount it first, its data was not touched", path.display())]
    NestedMount {
        /// The mount point found.
        path: PathBuf,
    },
    /// An rmdir-only removal met something that is not an empty directory.
    #[error("{} is not an empty directory; left in place", path.display())]
    Leftover {
        /// What was left.
        path: PathBuf,
    },
    /// Something kubevol did not create sits where it writes (a link planted at `..data`, at a
    /// visible key, inside a payload directory, or a subPath leading out of its volume). Nothing
    /// was read, written or removed through it.
    #[error("{}: {reason}; kubevol reads, writes and removes nothing through it: remove it", path.display())]
    Unsafe {
        /// The offending entry.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The mount table could not be read or parsed.
    #[error("read mount table: {0}")]
    Table(String),
}

/// What to do about an unmount error.
fn unmount_hint(errno: Errno, target: &Path) -> String {
    if errno == Errno::BUSY {
        format!(
            " (the mount is busy: a process has files open or its working directory in it; `fuser -vm {}` shows which. kubevol retries with backoff; --allow-lazy-unmount lets it detach the mount lazily instead)",
            target.display()
        )
    } else {
        String::new()
    }
}

/// Whether an errno from a mount point means the mount is dead (a FUSE daemon gone, an NFS
/// handle gone stale, an I/O error): it must be unmounted, not used.
pub fn is_corrupted_mount_errno(errno: Errno) -> bool {
    matches!(errno, Errno::NOTCONN | Errno::STALE | Errno::IO)
}

impl MountError {
    /// The errno behind the error, if there is one.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            MountError::Mount { errno, .. }
            | MountError::Unmount { errno, .. }
            | MountError::Io { errno, .. } => Some(*errno),
            MountError::Busy { .. } => Some(Errno::BUSY),
            _ => None,
        }
    }

    /// Whether the error says that a path does not exist.
    pub fn is_not_found(&self) -> bool {
        self.errno() == Some(Errno::NOENT)
    }

    /// Whether the failure may go away by itself (a busy mount, a full disk, a
    /// nested mount someone will remove) rather than needing the user to change something.
    pub fn is_transient(&self) -> bool {
        match self.errno() {
            Some(e) => !matches!(
                e,
                Errno::INVAL | Errno::NOTDIR | Errno::LOOP | Errno::NAMETOOLONG
            ),
            None => matches!(
                self,
                MountError::NestedMount { .. } | MountError::Leftover { .. }
            ),
        }
    }
}

/// Flags and filesystem data for one mount, parsed in one place.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MountOptions {
    /// `ro`.
    pub read_only: bool,
    /// `nosuid`.
    pub nosuid: bool,
    /// `nodev`.
    pub nodev: bool,
    /// `noexec`.
    pub noexec: bool,
    /// Filesystem-specific options (`size=67108864`, `pagesize=2M`), joined with commas.
    pub data: Vec<String>,
    /// Changes the options of the filesystem mounted at the target (`remount`: a tmpfs's
    /// `size=` grows or shrinks, its files stay).
    pub remount: bool,
}

impl MountOptions {
    fn flags(&self) -> MountFlags {
        let mut f = MountFlags::empty();
        if self.read_only {
            f |= MountFlags::RDONLY;
        }
        if self.nosuid {
            f |= MountFlags::NOSUID;
        }
        if self.nodev {
            f |= MountFlags::NODEV;
        }
        if self.noexec {
            f |= MountFlags::NOEXEC;
        }
        f
    }
}

/// What an unmount found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmounted {
    /// A mount was removed.
    Done,
    /// Nothing was mounted there (EINVAL from umount), which is what was wanted.
    NotMounted,
}

/// The mount operations kubevol needs, behind a trait so that logic above can be tested without
/// root. Every implementation must be idempotent where the kernel is: unmounting what is not
/// mounted is [`Unmounted::NotMounted`], not an error.
pub trait Mounter: Send + Sync + 'static {
    /// Mounts `source` of type `fstype` at `target`, which must be an existing directory.
    fn mount(
        &self,
        source: &str,
        target: &Path,
        fstype: &str,
        options: &MountOptions,
    ) -> Result<(), MountError>;

    /// Bind-mounts the file or directory open at `source` (an `O_PATH` descriptor obtained by a
    /// safe walk) onto the entry `name` of `target_dir`, which must exist and be of the same
    /// kind; `recursive` takes the mounts below it along (`rbind`). No path is resolved for the
    /// source, so nothing can swap it between the walk and the mount. `source_path` is for
    /// messages only.
    fn bind_fd(
        &self,
        source: BorrowedFd<'_>,
        source_path: &Path,
        target_dir: &safe::Dir,
        name: &str,
        recursive: bool,
    ) -> Result<(), MountError>;

    /// Makes the bind mount at `target` read-only (a bind remount: the filesystem under it and
    /// its other mounts stay writable).
    fn remount_read_only(&self, target: &Path) -> Result<(), MountError>;

    /// Makes the mount at `target` and every mount below it shared (`--make-rshared`), so that
    /// a mount made below it later reaches a container's copy of it (`mountPropagation`).
    fn make_shared(&self, target: &Path) -> Result<(), MountError>;

    /// Unmounts `target` without following a symbolic link at its last component.
    fn unmount(&self, target: &Path) -> Result<Unmounted, MountError>;

    /// Detaches `target` lazily (MNT_DETACH): it disappears now and is freed when no longer
    /// busy. Only when the operator allowed it.
    fn unmount_lazy(&self, target: &Path) -> Result<Unmounted, MountError> {
        self.unmount(target)
    }

    /// Detaches `target` and every mount below it at once (MNT_DETACH), for a bind that holds
    /// no data of its own (a pinned host path, bound recursively): nothing is lost however
    /// busy it is.
    fn unmount_detached(&self, target: &Path) -> Result<Unmounted, MountError> {
        self.unmount_lazy(target)
    }

    /// Whether `path` is the root of a mount.
    fn is_mount_point(&self, path: &Path) -> Result<bool, MountError>;

    /// The mount table of this process's mount namespace.
    fn mount_table(&self) -> Result<Vec<MountInfo>, MountError>;

    /// Who keeps the mount at `target` busy (see [`holders::find`]), looked for within
    /// [`HOLDERS_DEADLINE`]; `None` where that cannot be told (a fake mounter).
    fn holders(&self, _target: &Path) -> Option<holders::Holders> {
        None
    }
}

/// How long a look for what holds a busy mount may take (a node with many processes is
/// looked at in part, and says so).
pub const HOLDERS_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether the kernel makes a mount read-only with everything below it
/// (`mount_setattr(2)` with `AT_RECURSIVE`, Linux 5.12), which `recursiveReadOnly` needs.
pub fn recursive_read_only_supported() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (5, 12)
}

/// umount2(2): EINVAL (nothing mounted there) is what was wanted.
fn umount(target: &Path, flags: UnmountFlags) -> Result<Unmounted, MountError> {
    match rustix::mount::unmount(target, flags) {
        Ok(()) => Ok(Unmounted::Done),
        Err(Errno::INVAL) => Ok(Unmounted::NotMounted),
        Err(errno) => Err(MountError::Unmount {
            target: target.into(),
            errno,
        }),
    }
}

/// The real [`Mounter`]: mount(2), umount2(2), statx(2) and `/proc/self/mountinfo`.
#[derive(Clone, Copy, Debug, Default)]
pub struct LinuxMounter;

impl Mounter for LinuxMounter {
    fn holders(&self, target: &Path) -> Option<holders::Holders> {
        holders::find(target, std::time::Instant::now() + HOLDERS_DEADLINE).ok()
    }

    fn mount(
        &self,
        source: &str,
        target: &Path,
        fstype: &str,
        options: &MountOptions,
    ) -> Result<(), MountError> {
        let failed = |errno| MountError::Mount {
            source_name: source.into(),
            target: target.into(),
            fstype: fstype.into(),
            errno,
        };
        let data =
            std::ffi::CString::new(options.data.join(",")).map_err(|_| failed(Errno::INVAL))?;
        let data = (!options.data.is_empty()).then_some(data.as_c_str());
        if options.remount {
            let data = data.unwrap_or_default();
            return rustix::mount::mount_remount(target, options.flags(), data).map_err(failed);
        }
        rustix::mount::mount(source, target, fstype, options.flags(), data).map_err(failed)
    }

    fn bind_fd(
        &self,
        source: BorrowedFd<'_>,
        source_path: &Path,
        target_dir: &safe::Dir,
        name: &str,
        recursive: bool,
    ) -> Result<(), MountError> {
        use rustix::mount::{MoveMountFlags, OpenTreeFlags};
        let recursive_flag = if recursive {
            OpenTreeFlags::AT_RECURSIVE
        } else {
            OpenTreeFlags::empty()
        };
        let target = target_dir.path().join(name);
        let failed = |errno| MountError::Mount {
            source_name: source_path.display().to_string(),
            target: target.clone(),
            fstype: "bind".into(),
            errno,
        };
        match rustix::mount::open_tree(
            source,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH
                | recursive_flag,
        ) {
            Ok(tree) => rustix::mount::move_mount(
                &tree,
                "",
                target_dir.fd(),
                name,
                MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
            )
            .map_err(failed),
            Err(Errno::NOSYS) => {
                // Kernels before 5.2: bind the descriptor through its /proc link, which names
                // exactly the open inode.
                let proc_source = format!("/proc/self/fd/{}", source.as_raw_fd());
                let proc_target = format!("/proc/self/fd/{}/{name}", target_dir.fd().as_raw_fd());
                if recursive {
                    rustix::mount::mount_bind_recursive(proc_source.as_str(), proc_target.as_str())
                } else {
                    rustix::mount::mount_bind(proc_source.as_str(), proc_target.as_str())
                }
                .map_err(failed)
            }
            Err(e) => Err(failed(e)),
        }
    }

    fn remount_read_only(&self, target: &Path) -> Result<(), MountError> {
        rustix::mount::mount_remount(target, MountFlags::BIND | MountFlags::RDONLY, "").map_err(
            |errno| MountError::Mount {
                source_name: "remount".into(),
                target: target.into(),
                fstype: "bind,ro".into(),
                errno,
            },
        )
    }

    fn make_shared(&self, target: &Path) -> Result<(), MountError> {
        use rustix::mount::MountPropagationFlags as P;
        rustix::mount::mount_change(target, P::SHARED | P::REC).map_err(|errno| MountError::Mount {
            source_name: "make-rshared".into(),
            target: target.into(),
            fstype: "".into(),
            errno,
        })
    }

    fn unmount(&self, target: &Path) -> Result<Unmounted, MountError> {
        umount(target, UnmountFlags::NOFOLLOW)
    }

    fn unmount_lazy(&self, target: &Path) -> Result<Unmounted, MountError> {
        umount(target, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH)
    }

    fn is_mount_point(&self, path: &Path) -> Result<bool, MountError> {
        match safe::is_mount_root_at(rustix::fs::CWD, path) {
            // A dead mount cannot be looked at, but it is a mount: the table says where.
            Err(e) if e.errno().is_some_and(is_corrupted_mount_errno) => {
                let table = self.mount_table()?;
                if table.iter().any(|m| m.mount_point == path) {
                    Ok(true)
                } else {
                    Err(e)
                }
            }
            r => r,
        }
    }

    fn mount_table(&self) -> Result<Vec<MountInfo>, MountError> {
        let text = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| MountError::Table(e.to_string()))?;
        mountinfo::parse(&text).map_err(MountError::Table)
    }
}
