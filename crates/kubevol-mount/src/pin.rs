//! Host paths pinned: a path allowed by the operator's list is opened once, with the kernel
//! confining its resolution beneath the allowed directory's descriptor, and what is handed out
//! is a bind mount made from that descriptor. Whatever a tenant swaps into the path afterwards
//! (a directory renamed and a link to `/etc` put in its place), the mount is the object that was
//! checked.

use std::ffi::OsStr;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::at::io;
use crate::safe::Dir;
use crate::{MountError, Mounter};

/// What the allowed directory is called in a refusal.
const ALLOWED: &str = "the allowed directory";

/// What to make when the path does not exist yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missing {
    /// Nothing: not found is the answer.
    Refuse,
    /// Each missing directory, 0755 (hostPath `DirectoryOrCreate`).
    Directories,
    /// The file, 0644, in its existing directory (hostPath `FileOrCreate`).
    File,
}

/// Opens `rel` beneath `base` as an `O_PATH` descriptor, resolution confined beneath `base`
/// (links that stay inside resolve; an absolute link, a link or `..` above it is refused with
/// [`MountError::Unsafe`]), after making it as `missing` says (through descriptors, never
/// following a link). Returns the descriptor and what it is.
pub fn open_pinned(
    base: &Dir,
    rel: &Path,
    missing: Missing,
) -> Result<(OwnedFd, FileType), MountError> {
    let shown = base.path().join(rel);
    let rel = match rel.to_str() {
        Some("") => ".",
        Some(r) => r,
        None => {
            return Err(MountError::Unsafe {
                path: shown,
                reason: "is not UTF-8".into(),
            })
        }
    };
    let fd = match (open_confined(base, rel, ALLOWED), missing) {
        (Err(e), Missing::Directories) if e.is_not_found() => {
            base.create_dir_all_with(Path::new(rel), 0o755, 0o755)?;
            open_confined(base, rel, ALLOWED)?
        }
        (Err(e), Missing::File) if e.is_not_found() => {
            let (parent, name) = match rel.rsplit_once('/') {
                Some((p, n)) => (open_confined(base, p, ALLOWED)?, n),
                None => (open_confined(base, ".", ALLOWED)?, rel),
            };
            match rustix::fs::openat(
                &parent,
                name,
                OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            ) {
                // The mode exactly, whatever the umask.
                Ok(made) => rustix::fs::fchmod(&made, Mode::from_raw_mode(0o644))
                    .map_err(io("chmod", &shown))?,
                Err(Errno::EXIST) => {}
                Err(e) => return Err(io("create", &shown)(e)),
            }
            open_confined(base, rel, ALLOWED)?
        }
        (r, _) => r?,
    };
    let st = rustix::fs::fstat(&fd).map_err(io("stat", &shown))?;
    Ok((fd, FileType::from_raw_mode(st.st_mode)))
}

/// Bind-mounts the object open at `source` (`shown` is its path, for messages only) on the
/// entry `name` of `parent`, made first (a directory 0750 for a directory, an empty file 0640
/// for anything else, never through a link), and returns the mount point's path; `recursive`
/// takes the mounts below the source along. Mounted already is success.
pub fn bind_at(
    mounter: &dyn Mounter,
    source: BorrowedFd<'_>,
    is_dir: bool,
    shown: &Path,
    parent: &Dir,
    name: &str,
    recursive: bool,
) -> Result<PathBuf, MountError> {
    let target = parent.path().join(name);
    if !crate::safe::is_one_name(Path::new(name)) || name == "." {
        return Err(MountError::NotRelative { path: target });
    }
    if parent.has_entry(name)? && mounter.is_mount_point(&target)? {
        return Ok(target);
    }
    if is_dir {
        match rustix::fs::mkdirat(parent.fd(), name, Mode::from_raw_mode(0o750)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(io("mkdir", &target)(e)),
        }
        parent.open_child(OsStr::new(name))?;
    } else {
        let fd = rustix::fs::openat(
            parent.fd(),
            name,
            OFlags::CREATE | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o640),
        )
        .map_err(io("create", &target))?;
        let st = rustix::fs::fstat(&fd).map_err(io("stat", &target))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(MountError::Unsafe {
                path: target,
                reason: "is not a regular file".into(),
            });
        }
    }
    mounter.bind_fd(source, shown, parent, name, recursive)?;
    Ok(target)
}

/// `rel` below `base` would lead out of it (`base` is `what`, in words).
pub(crate) fn escape_from(base: &Dir, rel: &str, what: &str) -> MountError {
    MountError::Unsafe {
        path: base.path().join(rel),
        reason: format!("leads outside {what} (through a symbolic link, an absolute link or '..')"),
    }
}

/// Opens `rel` below `base` as an `O_PATH` descriptor with the kernel confining the
/// resolution beneath it: links that stay inside resolve, an absolute link, a link or `..`
/// above `base`, and `/proc` magic links are refused (`base` is `what`, in words).
pub(crate) fn open_confined(base: &Dir, rel: &str, what: &str) -> Result<OwnedFd, MountError> {
    let shown = || base.path().join(rel);
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    match rustix::fs::openat2(
        base.fd(),
        Path::new(rel),
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        resolve,
    ) {
        Ok(fd) => Ok(fd),
        Err(Errno::XDEV | Errno::LOOP) => Err(escape_from(base, rel, what)),
        Err(Errno::NOSYS) => {
            // No openat2: walk one component at a time and refuse every link.
            let (parent, name) = match rel.rsplit_once('/') {
                Some((p, n)) => (base.open_beneath(Path::new(p))?, n),
                None => (base.open_beneath(Path::new(""))?, rel),
            };
            let fd = rustix::fs::openat(
                parent.fd(),
                name,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(io("open", &shown()))?;
            let st = rustix::fs::fstat(&fd).map_err(io("stat", &shown()))?;
            if FileType::from_raw_mode(st.st_mode) == FileType::Symlink {
                return Err(escape_from(base, rel, what));
            }
            Ok(fd)
        }
        Err(e) => Err(io("open", &shown())(e)),
    }
}
