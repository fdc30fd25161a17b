//! Directory operations that cannot be redirected by a symbolic link.
//!
//! Every path below the root directory is reached by a walk that opens one component at a time
//! relative to its parent's file descriptor with `O_NOFOLLOW`, so a link planted anywhere in a
//! pod directory can neither send a create nor a removal outside it. Removal is one-filesystem:
//! it refuses to descend into anything that is a mount root or sits on another device, so a
//! failed unmount can never delete the data of a mounted volume.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, StatxAttributes, StatxFlags};
use rustix::io::Errno;

pub(crate) use crate::at::{io, DIR_FLAGS};
use crate::walk::{At, Visit};
use crate::MountError;

/// When `fsGroup` ownership is applied (`securityContext.fsGroupChangePolicy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FsGroupPolicy {
    /// Every time the volume is set up.
    #[default]
    Always,
    /// Only when the volume's root does not already have the group and permission bits.
    OnRootMismatch,
}

/// An open directory and the path it was reached by (for messages only; never re-resolved).
#[derive(Debug)]
pub struct Dir {
    pub(crate) fd: OwnedFd,
    pub(crate) path: PathBuf,
}

/// Whether the process's umask takes bits from `mode` (a directory made with it must then be
/// given its mode after mkdir). The umask is read once, from `/proc/self/status`: kubevol never
/// changes it, and a node agent that embeds kubevol and changes it later gets its pod
/// directories with the bits its new umask leaves (unknown, it is assumed to take some).
fn umask_takes_from(mode: u32) -> bool {
    static UMASK: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let umask = UMASK.get_or_init(|| {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let value = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
        u32::from_str_radix(value.trim(), 8).ok()
    });
    umask.is_none_or(|u| u & mode & 0o7777 != 0)
}

/// The names of a relative path (`.` components skipped), each `None` where the path is
/// absolute or has `..`.
fn names(rel: &Path) -> impl Iterator<Item = Option<&OsStr>> {
    rel.components().filter_map(|c| match c {
        Component::Normal(n) => Some(Some(n)),
        Component::CurDir => None,
        _ => Some(None),
    })
}

/// How many names a relative path has, without building the list of them; none for a path
/// that is absolute or has `..`.
fn count_names(rel: &Path) -> Option<usize> {
    names(rel).try_fold(0, |count, name| name.map(|_| count + 1))
}

/// Whether `name` is one name (a single normal component, `./` allowed).
pub(crate) fn is_one_name(name: &Path) -> bool {
    count_names(name) == Some(1)
}

fn components(rel: &Path) -> Result<Vec<&OsStr>, MountError> {
    names(rel)
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| MountError::NotRelative {
            path: rel.to_path_buf(),
        })
}

/// Whether `path` (relative to `dir`) is the root of a mount. Uses statx's mount-root attribute
/// and falls back to comparing devices with the parent on kernels without it.
pub fn is_mount_root_at<Fd: AsFd>(dir: Fd, path: &Path) -> Result<bool, MountError> {
    let st = rustix::fs::statx(
        &dir,
        path,
        AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::BASIC_STATS,
    )
    .map_err(io("statx", path))?;
    if st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT) {
        return Ok(st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT));
    }
    let parent = path.parent().unwrap_or(Path::new("/")).join(".");
    let pst = rustix::fs::statx(&dir, &parent, AtFlags::empty(), StatxFlags::BASIC_STATS)
        .map_err(io("statx", &parent))?;
    Ok((st.stx_dev_major, st.stx_dev_minor) != (pst.stx_dev_major, pst.stx_dev_minor))
}

impl Dir {
    /// Opens a trusted directory by absolute path (the operator-chosen root directory).
    pub fn open(path: &Path) -> Result<Dir, MountError> {
        let fd = rustix::fs::open(path, OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(io("open", path))?;
        Ok(Dir {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The directory's descriptor.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The path this directory was reached by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn child_path(&self, name: &OsStr) -> PathBuf {
        self.path.join(name)
    }

    pub(crate) fn open_child(&self, name: &OsStr) -> Result<Dir, MountError> {
        let path = self.child_path(name);
        match rustix::fs::openat(&self.fd, name, DIR_FLAGS, Mode::empty()) {
            Ok(fd) => Ok(Dir { fd, path }),
            Err(Errno::LOOP) => Err(MountError::Symlink { path }),
            Err(Errno::NOTDIR) => {
                let st = rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW);
                if st.is_ok_and(|s| FileType::from_raw_mode(s.st_mode) == FileType::Symlink) {
                    Err(MountError::Symlink { path })
                } else {
                    Err(io("open", &path)(Errno::NOTDIR))
                }
            }
            Err(e) => Err(io("open", &path)(e)),
        }
    }

    /// Opens a directory below this one, refusing `..`, absolute paths and symbolic links at
    /// every component. One openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) call where the kernel
    /// has it; otherwise an O_NOFOLLOW walk, one component at a time.
    pub fn open_beneath(&self, rel: &Path) -> Result<Dir, MountError> {
        match count_names(rel) {
            None => {
                return Err(MountError::NotRelative {
                    path: rel.to_path_buf(),
                })
            }
            Some(0) => return self.reopen(),
            Some(_) => {}
        }
        let path = self.path.join(rel);
        let resolve =
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        match rustix::fs::openat2(&self.fd, rel, DIR_FLAGS, Mode::empty(), resolve) {
            Ok(fd) => return Ok(Dir { fd, path }),
            Err(Errno::NOSYS | Errno::LOOP | Errno::XDEV | Errno::AGAIN | Errno::NOTDIR) => {
                // No openat2, or a link or escape somewhere: the walk says exactly where.
            }
            Err(e) => return Err(io("open", &path)(e)),
        }
        self.walk(&components(rel)?)
    }

    fn reopen(&self) -> Result<Dir, MountError> {
        let mut d = self.open_child(OsStr::new("."))?;
        d.path = self.path.clone();
        Ok(d)
    }

    fn walk(&self, names: &[&OsStr]) -> Result<Dir, MountError> {
        let mut cur = self.reopen()?;
        for name in names {
            cur = cur.open_child(name)?;
        }
        Ok(cur)
    }

    /// Creates the directories of `rel` below this one as needed and opens the last. The last
    /// directory, if created, gets exactly `mode` (not reduced by the umask); parents it creates
    /// get 0750, as the kubelet's pod directories; existing ones are left alone. Returns the
    /// directory and whether the last component was created.
    pub fn create_dir_all(&self, rel: &Path, mode: u32) -> Result<(Dir, bool), MountError> {
        self.create_dir_all_with(rel, mode, 0o750)
    }

    /// [`Dir::create_dir_all`] with the mode of created parents given.
    pub fn create_dir_all_with(
        &self,
        rel: &Path,
        mode: u32,
        parent_mode: u32,
    ) -> Result<(Dir, bool), MountError> {
        match self.open_beneath(rel) {
            Ok(d) => return Ok((d, false)),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
        let names = components(rel)?;
        let Some((last, parents)) = names.split_last() else {
            return Ok((self.reopen()?, false));
        };
        let parent = self.make_parents(parents, parent_mode)?;
        parent.as_ref().unwrap_or(self).make_child(last, mode)
    }

    /// Makes (or opens) each of `names` in the one before, from this one, with `mode` where it
    /// makes one; the last, opened (none when `names` is empty: this one).
    fn make_parents(&self, names: &[&OsStr], mode: u32) -> Result<Option<Dir>, MountError> {
        let mut cur: Option<Dir> = None;
        for name in names {
            cur = Some(cur.as_ref().unwrap_or(self).make_child(name, mode)?.0);
        }
        Ok(cur)
    }

    /// Makes the directory `name` in this one with `mode` less the process's umask, without
    /// opening it: for a directory that a filesystem is mounted on at once (whose root then has
    /// the mode). Says whether it was made (false: something is there already, of any type).
    pub fn make_dir(&self, name: &OsStr, mode: u32) -> Result<bool, MountError> {
        if !is_one_name(Path::new(name)) || name == "." {
            return Err(MountError::NotRelative {
                path: PathBuf::from(name),
            });
        }
        match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(mode)) {
            Ok(()) => Ok(true),
            Err(Errno::EXIST) => Ok(false),
            Err(e) => Err(io("mkdir", &self.child_path(name))(e)),
        }
    }

    /// Makes the directory `name` in this one with `mode` (exactly: the umask does not apply),
    /// or opens it if it exists (never through a symlink); says whether it was made.
    pub fn make_child(&self, name: &OsStr, mode: u32) -> Result<(Dir, bool), MountError> {
        let created = self.make_dir(name, mode)?;
        let dir = self.open_child(name)?;
        if created && umask_takes_from(mode) {
            dir.chmod(mode)?;
        }
        Ok((dir, created))
    }

    /// Makes the directories `names`, each in the one before, below this one where missing,
    /// each it makes with `mode` exactly, never through a link. The last is opened only when
    /// the umask took from its mode. Says whether the last was made. (A pod's plugin directory
    /// ahead of its volumes: `<uid>/volumes/<plugin>` below `pods`, six calls where nothing
    /// was there.)
    pub fn make_dirs(&self, names: &[&OsStr], mode: u32) -> Result<bool, MountError> {
        let Some((last, parents)) = names.split_last() else {
            return Ok(false);
        };
        let parent = self.make_parents(parents, mode)?;
        let parent = parent.as_ref().unwrap_or(self);
        if umask_takes_from(mode) {
            // Its mode is set after the mkdir, on the directory opened.
            return parent.make_child(last, mode).map(|(_, made)| made);
        }
        parent.make_dir(last, mode)
    }

    /// Sets this directory's permission bits.
    pub fn chmod(&self, mode: u32) -> Result<(), MountError> {
        rustix::fs::fchmod(&self.fd, Mode::from_raw_mode(mode)).map_err(io("chmod", &self.path))
    }

    /// Whether the entry `name` of this directory is the root of a mount.
    pub fn is_mount_root(&self, name: &str) -> Result<bool, MountError> {
        is_mount_root_at(&self.fd, Path::new(name))
    }

    /// Whether this directory has an entry `name` (of any type, links not followed).
    pub fn has_entry(&self, name: &str) -> Result<bool, MountError> {
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(_) => Ok(true),
            Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(io("stat", &self.child_path(OsStr::new(name)))(e)),
        }
    }

    /// The directory that holds `rel` (made where missing, 0750, when `make`), beneath this
    /// one, and `rel`'s last name.
    fn parent_of<'r>(&self, rel: &'r Path, make: bool) -> Result<(Dir, &'r OsStr), MountError> {
        let names = components(rel)?;
        let Some((last, parents)) = names.split_last() else {
            return Err(MountError::NotRelative {
                path: rel.to_path_buf(),
            });
        };
        let parent: PathBuf = parents.iter().collect();
        let dir = if make {
            self.create_dir_all(&parent, 0o750)?.0
        } else {
            self.open_beneath(&parent)?
        };
        Ok((dir, last))
    }

    /// Makes `rel`, beneath this directory, a symbolic link to `target` (the directories to it
    /// made where missing), replacing a link or file there; a directory there is refused.
    pub fn replace_symlink(&self, rel: &Path, target: &Path) -> Result<(), MountError> {
        let (dir, name) = self.parent_of(rel, true)?;
        let path = || dir.child_path(name);
        match rustix::fs::unlinkat(&dir.fd, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(io("unlink", &path())(e)),
        }
        rustix::fs::symlinkat(target, &dir.fd, name).map_err(|e| io("symlink", &path())(e))
    }

    /// Removes the entry `rel` beneath this directory: a file or link, or with `dir` an empty
    /// directory (rmdir, which never removes a mount point or anything in it). Gone already is
    /// done.
    pub fn remove_beneath(&self, rel: &Path, dir: bool) -> Result<(), MountError> {
        let (parent, name) = match self.parent_of(rel, false) {
            Ok(p) => p,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => return Err(e),
        };
        let flags = if dir {
            AtFlags::REMOVEDIR
        } else {
            AtFlags::empty()
        };
        match rustix::fs::unlinkat(&parent.fd, name, flags) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(io(
                if dir { "rmdir" } else { "unlink" },
                &parent.child_path(name),
            )(e)),
        }
    }

    /// Writes `bytes` to the file `rel` beneath this directory, whole or not at all: into
    /// `.<name>.tmp` beside it (never through a link), flushed, then renamed over it, the
    /// directory flushed; the directories to it are made where missing (0750).
    pub fn write_file(&self, rel: &Path, bytes: &[u8]) -> Result<(), MountError> {
        let (dir, name) = self.parent_of(rel, true)?;
        let mut tmp = std::ffi::OsString::from(".");
        tmp.push(name);
        tmp.push(".tmp");
        let tmp_path = dir.child_path(&tmp);
        let fd = rustix::fs::openat(
            &dir.fd,
            &tmp,
            OFlags::CREATE | OFlags::TRUNC | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io("create", &tmp_path)(e))?;
        let mut written = 0;
        while written < bytes.len() {
            match rustix::io::write(&fd, &bytes[written..]) {
                Ok(n) => written += n,
                Err(Errno::INTR) => {}
                Err(e) => return Err(io("write", &tmp_path)(e)),
            }
        }
        rustix::fs::fsync(&fd).map_err(|e| io("fsync", &tmp_path)(e))?;
        rustix::fs::renameat(&dir.fd, &tmp, &dir.fd, name)
            .map_err(|e| io("rename", &dir.child_path(name))(e))?;
        rustix::fs::fsync(&dir.fd).map_err(|e| io("fsync", &dir.path)(e))
    }

    /// The content of the regular file `rel` beneath this directory (never through a link),
    /// at most `limit` bytes (more is an error).
    pub fn read_file(&self, rel: &Path, limit: usize) -> Result<Vec<u8>, MountError> {
        let (dir, name) = self.parent_of(rel, false)?;
        let path = || dir.child_path(name);
        let fd = rustix::fs::openat(
            &dir.fd,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::LOOP => MountError::Symlink { path: path() },
            e => io("open", &path())(e),
        })?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io("stat", &path())(e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(MountError::Unsafe {
                path: path(),
                reason: "is not a regular file".into(),
            });
        }
        let mut out = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match rustix::io::read(&fd, &mut buf) {
                Ok(0) => return Ok(out),
                Ok(n) if out.len() + n > limit => {
                    return Err(MountError::Unsafe {
                        path: path(),
                        reason: format!("is larger than {limit} bytes"),
                    })
                }
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(Errno::INTR) => {}
                Err(e) => return Err(io("read", &path())(e)),
            }
        }
    }

    /// Whether this directory has no entries (`.` and `..` aside).
    pub fn is_empty(&self) -> Result<bool, MountError> {
        Ok(self.entries()?.is_empty())
    }

    /// The entries of this directory, read through a descriptor of its own (this one may be
    /// shared, and a reading moves its offset).
    pub(crate) fn entries(&self) -> Result<Vec<(Vec<u8>, FileType)>, MountError> {
        let dup = rustix::fs::openat(&self.fd, ".", DIR_FLAGS, Mode::empty())
            .map_err(io("open", &self.path))?;
        crate::walk::read_entries(dup.as_fd(), || self.path.clone())
    }

    /// Opens the directory `name` of this one on this directory's own mount: a mount point
    /// there is [`MountError::NestedMount`], a link [`MountError::Symlink`].
    fn open_child_same_mount(&self, name: &OsStr) -> Result<Dir, MountError> {
        let path = self.child_path(name);
        let fd = open_same_mount(self.fd.as_fd(), name, || path.clone())?;
        Ok(Dir { fd, path })
    }

    pub(crate) fn device(&self) -> Result<(u32, u32), MountError> {
        let st = rustix::fs::statx(&self.fd, "", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)
            .map_err(io("statx", &self.path))?;
        Ok((st.stx_dev_major, st.stx_dev_minor))
    }

    /// Removes everything inside this directory, staying on its filesystem. It first checks the
    /// whole tree and stops before removing anything if a mount point or another device is
    /// found below; while removing it checks again, so a mount made in between is not entered.
    pub fn remove_contents_one_fs(&self) -> Result<(), MountError> {
        let dev = self.device()?;
        crate::walk::walk(self.fd(), &self.path, &mut CheckOneFs { dev })?;
        crate::walk::walk(self.fd(), &self.path, &mut RemoveOneFs { dev })
    }

    pub(crate) fn open_child_if_exists(&self, name: &str) -> Result<Option<Dir>, MountError> {
        match self.open_child(OsStr::new(name)) {
            Ok(c) => Ok(Some(c)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes the directory `name` of this directory if it exists, after removing its contents
    /// on its own filesystem. A mount point at `name` itself is refused.
    pub fn remove_dir_all_one_fs(&self, name: &str) -> Result<(), MountError> {
        self.remove_dir_all_one_fs_found(name).map(drop)
    }

    /// [`Dir::remove_dir_all_one_fs`], saying whether `name` was there to remove.
    pub fn remove_dir_all_one_fs_found(&self, name: &str) -> Result<bool, MountError> {
        // Spelled out only where it is needed: the common case needs no path.
        let path = || self.child_path(OsStr::new(name));
        if !is_one_name(Path::new(name)) {
            return Err(MountError::NotRelative { path: path() });
        }
        // An empty directory (a volume just unmounted) goes with one rmdir, which never removes
        // a mount point (EBUSY) or anything but a directory; anything else takes the walk.
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR) {
            Ok(()) => return Ok(true),
            Err(Errno::NOENT) => return Ok(false),
            Err(Errno::BUSY) => return Err(MountError::NestedMount { path: path() }),
            Err(_) => {}
        }
        let path = path();
        let Some(child) = self.open_child_if_exists(name)? else {
            return Ok(false);
        };
        if self.is_mount_root(name)? {
            return Err(MountError::NestedMount { path });
        }
        child.remove_contents_one_fs()?;
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => Ok(true),
            Err(e) => Err(io("rmdir", &path)(e)),
        }
    }

    /// [`Dir::remove_empty_tree`] for a tree expected to be the one chain of directories
    /// `along` below `name` (a gone pod's directory that held one plugin's volumes:
    /// `<uid>/volumes/<plugin>`): the chain is removed bottom up, one rmdir each, without
    /// reading a directory; anything else there takes the whole walk, which reports it.
    pub fn remove_empty_tree_along(&self, name: &str, along: &[&str]) -> Result<(), MountError> {
        let Some((next, rest)) = along.split_first() else {
            return self.remove_empty_tree(name);
        };
        let child = match self.open_child_same_mount(OsStr::new(name)) {
            Ok(c) => c,
            Err(e) if e.is_not_found() => return Ok(()),
            // Not a plain directory of this mount, or not to be opened: the walk says why.
            Err(_) => return self.remove_empty_tree(name),
        };
        match child.remove_empty_tree_along(next, rest) {
            Ok(()) => {}
            Err(MountError::Leftover { .. } | MountError::NestedMount { .. }) => {
                return self.remove_empty_tree(name)
            }
            Err(e) => return Err(e),
        }
        drop(child);
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            // More than the chain: the walk removes what is empty and reports the rest.
            Err(Errno::NOTEMPTY | Errno::EXIST) => self.remove_empty_tree(name),
            Err(Errno::BUSY) => Err(MountError::NestedMount {
                path: self.child_path(OsStr::new(name)),
            }),
            Err(e) => Err(io("rmdir", &self.child_path(OsStr::new(name)))(e)),
        }
    }

    /// Removes the directory `name` and the empty directories below it with rmdir only: it never
    /// unlinks a file and never enters a mount point. Anything else found is reported as
    /// [`MountError::Leftover`] (or [`MountError::NestedMount`]) and left in place.
    pub fn remove_empty_tree(&self, name: &str) -> Result<(), MountError> {
        let path = self.child_path(OsStr::new(name));
        // An empty directory goes with one rmdir, which never removes a mount point (EBUSY) or
        // anything but a directory (ENOTDIR); only one with something in it is entered.
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => return Ok(()),
            Err(Errno::BUSY) => return Err(MountError::NestedMount { path }),
            Err(Errno::NOTDIR) => return Err(MountError::Leftover { path }),
            Err(_) => {}
        }
        let child = match self.open_child_same_mount(OsStr::new(name)) {
            Ok(c) => c,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(MountError::Io {
                errno: Errno::NOTDIR,
                ..
            })
            | Err(MountError::Symlink { .. }) => return Err(MountError::Leftover { path }),
            Err(e) => return Err(e),
        };
        // Every empty directory goes, even beside a leftover; the first leftover is reported.
        let mut empty = EmptyTree {
            first_leftover: None,
        };
        crate::walk::walk(child.fd(), child.path(), &mut empty)?;
        drop(child);
        if let Some(e) = empty.first_leftover {
            return Err(e);
        }
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(Errno::NOTEMPTY) => Err(MountError::Leftover { path }),
            Err(e) => Err(io("rmdir", &path)(e)),
        }
    }
}

/// Opens the directory `name` of `parent` on the parent's own mount: a mount point there is
/// [`MountError::NestedMount`], a link [`MountError::Symlink`]. One openat2 call
/// (RESOLVE_NO_XDEV) where the kernel has it.
fn open_same_mount(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    path: impl Fn() -> PathBuf,
) -> Result<OwnedFd, MountError> {
    let resolve = ResolveFlags::BENEATH
        | ResolveFlags::NO_SYMLINKS
        | ResolveFlags::NO_MAGICLINKS
        | ResolveFlags::NO_XDEV;
    match rustix::fs::openat2(parent, name, DIR_FLAGS, Mode::empty(), resolve) {
        Ok(fd) => Ok(fd),
        Err(Errno::XDEV) => Err(MountError::NestedMount { path: path() }),
        Err(Errno::LOOP) => Err(MountError::Symlink { path: path() }),
        Err(Errno::NOSYS) => {
            let fd = match rustix::fs::openat(parent, name, DIR_FLAGS, Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::LOOP) => return Err(MountError::Symlink { path: path() }),
                Err(e) => return Err(io("open", &path())(e)),
            };
            if is_mount_root_at(parent, Path::new(name))? {
                return Err(MountError::NestedMount { path: path() });
            }
            Ok(fd)
        }
        Err(e) => Err(io("open", &path())(e)),
    }
}

/// Whether the entry `name` of `parent` (not followed) is a mount root or lies on another
/// device than `dev`: a walk that must stay on one filesystem stops there.
pub(crate) fn leaves_filesystem(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    dev: (u32, u32),
    at: &At<'_>,
) -> Result<bool, MountError> {
    let st = rustix::fs::statx(
        parent,
        name,
        AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::BASIC_STATS,
    )
    .map_err(|e| io("statx", &at.child(name))(e))?;
    Ok(!crate::walk::on_filesystem(&st, dev))
}

/// The device of the directory open at `fd`.
fn device_of(fd: BorrowedFd<'_>, at: &At<'_>) -> Result<(u32, u32), MountError> {
    let st = rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)
        .map_err(|e| io("statx", &at.dir())(e))?;
    Ok((st.stx_dev_major, st.stx_dev_minor))
}

/// Finds anything below a directory that is a mount root or on another device than `dev`.
struct CheckOneFs {
    dev: (u32, u32),
}

impl Visit for CheckOneFs {
    fn other(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        _: FileType,
        at: &At<'_>,
    ) -> Result<(), MountError> {
        if leaves_filesystem(parent, name, self.dev, at)? {
            return Err(MountError::NestedMount {
                path: at.child(name),
            });
        }
        Ok(())
    }

    fn descend(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        at: &At<'_>,
    ) -> Result<Option<OwnedFd>, MountError> {
        self.other(parent, name, FileType::Directory, at)?;
        crate::walk::open_dir(parent, name, at)
    }
}

/// Removes everything below a directory on the device `dev`, bottom up, and stops at a mount
/// point or another device.
struct RemoveOneFs {
    dev: (u32, u32),
}

impl Visit for RemoveOneFs {
    fn other(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        _: FileType,
        at: &At<'_>,
    ) -> Result<(), MountError> {
        match rustix::fs::unlinkat(parent, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(Errno::BUSY) => Err(MountError::NestedMount {
                path: at.child(name),
            }),
            Err(e) => Err(io("unlink", &at.child(name))(e)),
        }
    }

    fn descend(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        at: &At<'_>,
    ) -> Result<Option<OwnedFd>, MountError> {
        let Some(child) = crate::walk::open_dir(parent, name, at)? else {
            return Ok(None);
        };
        if device_of(child.as_fd(), at)? != self.dev || is_mount_root_at(parent, Path::new(name))? {
            return Err(MountError::NestedMount {
                path: at.child(name),
            });
        }
        Ok(Some(child))
    }

    fn leave(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        at: &At<'_>,
    ) -> Result<(), MountError> {
        rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
            .map_err(|e| io("rmdir", &at.child(name))(e))
    }
}

/// Removes the empty directories below a directory with rmdir alone; keeps the first thing
/// found that is not one (see [`Dir::remove_empty_tree`]).
struct EmptyTree {
    first_leftover: Option<MountError>,
}

impl EmptyTree {
    fn found(&mut self, e: MountError) {
        self.first_leftover.get_or_insert(e);
    }
}

impl Visit for EmptyTree {
    fn other(
        &mut self,
        _: BorrowedFd<'_>,
        name: &OsStr,
        _: FileType,
        at: &At<'_>,
    ) -> Result<(), MountError> {
        self.found(MountError::Leftover {
            path: at.child(name),
        });
        Ok(())
    }

    fn descend(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        at: &At<'_>,
    ) -> Result<Option<OwnedFd>, MountError> {
        // An empty directory goes with one rmdir; only one with something in it is entered.
        match rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => return Ok(None),
            Err(Errno::BUSY) => {
                self.found(MountError::NestedMount {
                    path: at.child(name),
                });
                return Ok(None);
            }
            Err(_) => {}
        }
        match open_same_mount(parent, name, || at.child(name)) {
            Ok(fd) => Ok(Some(fd)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e @ MountError::NestedMount { .. }) => {
                self.found(e);
                Ok(None)
            }
            Err(
                MountError::Io {
                    errno: Errno::NOTDIR,
                    ..
                }
                | MountError::Symlink { .. },
            ) => {
                self.found(MountError::Leftover {
                    path: at.child(name),
                });
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn leave(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        at: &At<'_>,
    ) -> Result<(), MountError> {
        match rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(Errno::NOTEMPTY | Errno::EXIST) => {
                self.found(MountError::Leftover {
                    path: at.child(name),
                });
                Ok(())
            }
            Err(Errno::BUSY) => {
                self.found(MountError::NestedMount {
                    path: at.child(name),
                });
                Ok(())
            }
            Err(e) => Err(io("rmdir", &at.child(name))(e)),
        }
    }
}

#[cfg(test)]
mod tests;
