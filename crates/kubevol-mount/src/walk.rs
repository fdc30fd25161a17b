//! Walks over a directory tree whose shape someone else chose: a volume's contents, written by
//! a pod, or a payload whose paths a manifest gave.
//!
//! The walk keeps an explicit stack on the heap instead of recursing, so a tree 100,000 levels
//! deep costs memory in proportion to its depth and never the thread's stack. At most
//! [`OPEN_LIMIT`] directory descriptors are open at once: the deepest [`WINDOW`] levels, and
//! anchors above them, evenly spaced (their spacing doubles as the walk goes deeper, so there
//! are never more than [`ANCHORS`]). When the walk comes back up to a level whose descriptor was
//! given up, it opens the levels again from the nearest anchor down, one name at a time with
//! `O_NOFOLLOW`, and takes each only if it is the very directory it left (same device and
//! inode) — never by a path, so a tree moved while it is walked sends the walk nowhere else.
//! (Going up through `..` would cost the kernel a walk up to the mount's root at every level
//! of a bind-mounted volume: minutes for 100,000 levels.)
//!
//! What a walk does at each entry (check, remove, change ownership, compare, count) is a
//! [`Visit`]; this module only moves through the tree.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, Statx, StatxAttributes, StatxFlags};
use rustix::io::Errno;

use crate::at::{io, DIR_FLAGS};
use crate::MountError;

/// The deepest levels whose descriptors a walk keeps open.
pub const WINDOW: usize = 64;

/// The most anchors (open levels above the window) a walk keeps.
pub const ANCHORS: usize = 64;

/// The most directory descriptors one walk keeps open.
pub const OPEN_LIMIT: usize = WINDOW + ANCHORS + 1;

/// How many names of a deep path a message spells out at each end.
const SHOWN_NAMES: usize = 4;

/// Where a walk is: the path of the directory being walked, for messages only (it is never
/// resolved). Deep paths are shortened in the middle.
pub struct At<'w> {
    root: &'w Path,
    frames: &'w [Frame],
}

impl At<'_> {
    /// How many levels below the walk's root the current directory is (the root is 0).
    pub fn depth(&self) -> usize {
        self.frames.len().saturating_sub(1)
    }

    /// The path of the current directory.
    pub fn dir(&self) -> PathBuf {
        let names: Vec<&[u8]> = self.frames[1..].iter().map(|f| f.name.as_slice()).collect();
        let mut path = self.root.to_path_buf();
        if names.len() <= 2 * SHOWN_NAMES {
            names.iter().for_each(|n| path.push(OsStr::from_bytes(n)));
            return path;
        }
        let hidden = names.len() - 2 * SHOWN_NAMES;
        names[..SHOWN_NAMES]
            .iter()
            .for_each(|n| path.push(OsStr::from_bytes(n)));
        path.push(format!("…({hidden} more levels)…"));
        names[names.len() - SHOWN_NAMES..]
            .iter()
            .for_each(|n| path.push(OsStr::from_bytes(n)));
        path
    }

    /// The path of the entry `name` of the current directory relative to the walk's root,
    /// `/`-separated (names that are not UTF-8 are shown lossily).
    pub fn relative(&self, name: &OsStr) -> String {
        let mut rel = String::new();
        for f in &self.frames[1..] {
            rel.push_str(&String::from_utf8_lossy(&f.name));
            rel.push('/');
        }
        rel.push_str(&name.to_string_lossy());
        rel
    }

    /// The path of the entry `name` of the current directory.
    pub fn child(&self, name: &OsStr) -> PathBuf {
        self.dir().join(name)
    }
}

/// What a walk does. Every call gets the descriptor of the directory it concerns, open, and
/// where the walk is.
pub trait Visit {
    /// A directory has been entered, the walk's root included, before its entries.
    fn enter(&mut self, _dir: BorrowedFd<'_>, _at: &At<'_>) -> Result<(), MountError> {
        Ok(())
    }

    /// An entry of `parent` that is not a directory (as the listing said; a walk that opens it
    /// opens it with `O_NOFOLLOW` and checks again).
    fn other(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        file_type: FileType,
        at: &At<'_>,
    ) -> Result<(), MountError>;

    /// The directory `name` of `parent`: its descriptor, opened as this walk wants it (see
    /// [`open_dir`]), to enter it; `None` to pass it by.
    fn descend(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        at: &At<'_>,
    ) -> Result<Option<OwnedFd>, MountError>;

    /// The directory `name` of `parent`, entered earlier, has been walked whole.
    fn leave(
        &mut self,
        _parent: BorrowedFd<'_>,
        _name: &OsStr,
        _at: &At<'_>,
    ) -> Result<(), MountError> {
        Ok(())
    }
}

/// One level of the walk.
struct Frame {
    /// Open while the level is one of the deepest [`OPEN_LIMIT`].
    fd: Option<OwnedFd>,
    /// Which directory it is, to know it again when it is reopened through `..`.
    id: (u64, u64),
    /// Its name in its parent (empty for the root).
    name: Vec<u8>,
    /// Its subdirectories not entered yet.
    pending: Vec<Vec<u8>>,
}

fn identity(fd: BorrowedFd<'_>, path: impl FnOnce() -> PathBuf) -> Result<(u64, u64), MountError> {
    let st = rustix::fs::fstat(fd).map_err(|e| io("stat", &path())(e))?;
    Ok((st.st_dev, st.st_ino))
}

/// The entry `name` of `parent` stated without following a link (`what`, and its device and
/// whether it is a mount root); `None` when it is gone since it was listed, is a mount root,
/// or lies on another device than `dev`: what a walk that stays on one filesystem passes by.
pub(crate) fn stat_here(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    what: StatxFlags,
    dev: (u32, u32),
    at: &At<'_>,
) -> Result<Option<Statx>, MountError> {
    match rustix::fs::statx(parent, name, AtFlags::SYMLINK_NOFOLLOW, what) {
        Ok(st) => Ok(on_filesystem(&st, dev).then_some(st)),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(io("statx", &at.child(name))(e)),
    }
}

/// Whether the entry stated as `st` lies on the device `dev` and is not a mount root.
pub(crate) fn on_filesystem(st: &Statx, dev: (u32, u32)) -> bool {
    let mount_root = st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT)
        && st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT);
    !mount_root && (st.stx_dev_major, st.stx_dev_minor) == dev
}

/// The subdirectory `name` of `parent`, opened to be walked (see [`open_dir`]); `None` also
/// when it is a symbolic link now: a walk that changes or counts what it finds passes links by.
pub(crate) fn open_subdir(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    at: &At<'_>,
) -> Result<Option<OwnedFd>, MountError> {
    match open_dir(parent, name, at) {
        Err(MountError::Symlink { .. }) => Ok(None),
        r => r,
    }
}

/// Opens the directory `name` of `parent` with `O_NOFOLLOW`: `None` when it is gone, or no
/// longer a directory, since it was listed; [`MountError::Symlink`] when it is a link now.
pub fn open_dir(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    at: &At<'_>,
) -> Result<Option<OwnedFd>, MountError> {
    match rustix::fs::openat(parent, name, DIR_FLAGS, Mode::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::NOENT | Errno::NOTDIR) => Ok(None),
        Err(Errno::LOOP) => Err(MountError::Symlink {
            path: at.child(name),
        }),
        Err(e) => Err(io("open", &at.child(name))(e)),
    }
}

/// The entries of the directory open at `fd` (which must be freshly opened: it is read from
/// its own offset), `.` and `..` left out; an entry whose type the filesystem does not say
/// is looked at.
pub(crate) fn read_entries(
    fd: BorrowedFd<'_>,
    path: impl Fn() -> PathBuf,
) -> Result<Vec<(Vec<u8>, FileType)>, MountError> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
    let mut dir = rustix::fs::RawDir::new(fd, &mut buf);
    let mut out = Vec::new();
    while let Some(entry) = dir.next() {
        let entry = entry.map_err(|e| io("readdir", &path())(e))?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let ft = match entry.file_type() {
            FileType::Unknown => {
                match rustix::fs::statat(fd, name, AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) => FileType::from_raw_mode(st.st_mode),
                    // Gone since it was listed.
                    Err(Errno::NOENT) => continue,
                    Err(e) => {
                        return Err(io("stat", &path().join(OsStr::from_bytes(name)))(e));
                    }
                }
            }
            ft => ft,
        };
        out.push((name.to_vec(), ft));
    }
    Ok(out)
}

/// Walks the tree below the directory open at `root` (reached by `path`, for messages), which
/// is entered first, calling `visit` at every entry:
/// [`Visit::enter`] before a directory's entries, [`Visit::other`] for each entry that is not a
/// directory, [`Visit::descend`] for each that is, and [`Visit::leave`] after a directory's
/// whole tree. The root itself is never left (it has no parent here).
pub fn walk(root: BorrowedFd<'_>, path: &Path, visit: &mut dyn Visit) -> Result<(), MountError> {
    let fd = rustix::fs::openat(root, ".", DIR_FLAGS, Mode::empty()).map_err(io("open", path))?;
    let id = identity(fd.as_fd(), || path.to_path_buf())?;
    let mut frames = vec![Frame {
        fd: Some(fd),
        id,
        name: Vec::new(),
        pending: Vec::new(),
    }];
    // Above the window, only the levels that are multiples of this keep their descriptors.
    let mut spacing = 1;
    enter(path, &mut frames, visit)?;
    loop {
        let top = frames.len() - 1;
        if let Some(name) = frames[top].pending.pop() {
            let at = At {
                root: path,
                frames: &frames,
            };
            let parent = frames[top].fd.as_ref().expect("the deepest level is open");
            let Some(child) = visit.descend(parent.as_fd(), OsStr::from_bytes(&name), &at)? else {
                continue;
            };
            let id = identity(child.as_fd(), || at.child(OsStr::from_bytes(&name)))?;
            frames.push(Frame {
                fd: Some(child),
                id,
                name,
                pending: Vec::new(),
            });
            spacing = give_up_descriptors(&mut frames, spacing);
            enter(path, &mut frames, visit)?;
            continue;
        }
        // This level is done: go back up to its parent.
        if top == 0 {
            return Ok(());
        }
        let done = frames.pop().expect("a level to leave");
        drop(done.fd);
        if frames[top - 1].fd.is_none() {
            reopen(path, &mut frames, spacing)?;
        }
        let at = At {
            root: path,
            frames: &frames,
        };
        let parent = frames[top - 1]
            .fd
            .as_ref()
            .expect("the parent was reopened");
        visit.leave(parent.as_fd(), OsStr::from_bytes(&done.name), &at)?;
    }
}

/// After a level was pushed: the level that left the window gives up its descriptor unless it
/// is an anchor; when there are more than [`ANCHORS`] anchors, the spacing doubles and every
/// other one goes. Returns the spacing.
fn give_up_descriptors(frames: &mut [Frame], mut spacing: usize) -> usize {
    let Some(left) = (frames.len() - 1).checked_sub(WINDOW) else {
        return spacing;
    };
    if left % spacing != 0 {
        frames[left].fd = None;
    }
    while left / spacing + 1 > ANCHORS {
        spacing *= 2;
        for level in (spacing / 2..=left).step_by(spacing) {
            frames[level].fd = None;
        }
    }
    spacing
}

/// Opens again the deepest level, whose descriptor was given up, and the levels of the window
/// above it: from the nearest anchor down, one name at a time, each checked to be the
/// directory it was.
fn reopen(root: &Path, frames: &mut [Frame], spacing: usize) -> Result<(), MountError> {
    let top = frames.len() - 1;
    let anchor = (0..top)
        .rev()
        .find(|&l| frames[l].fd.is_some())
        .expect("the root or an anchor is open");
    let keep_from = (top + 1).saturating_sub(WINDOW);
    // The directory of the level before: an open level's (borrowed), or one opened on the way.
    let mut above: Option<OwnedFd> = None;
    for level in anchor + 1..=top {
        let at = At {
            root,
            frames: &frames[..level],
        };
        let name = OsStr::from_bytes(&frames[level].name);
        let parent = match &above {
            Some(fd) => fd.as_fd(),
            None => frames[level - 1]
                .fd
                .as_ref()
                .expect("an open anchor")
                .as_fd(),
        };
        let fd = match rustix::fs::openat(parent, name, DIR_FLAGS, Mode::empty()) {
            Ok(fd) => fd,
            Err(e) => return Err(moved(at.child(name), e)),
        };
        if identity(fd.as_fd(), || at.child(name))? != frames[level].id {
            return Err(moved(at.child(name), Errno::STALE));
        }
        if level >= keep_from || level % spacing == 0 {
            frames[level].fd = Some(fd);
            above = None;
        } else {
            above = Some(fd);
        }
    }
    Ok(())
}

/// A level that is not where the walk left it.
fn moved(path: PathBuf, errno: Errno) -> MountError {
    MountError::Unsafe {
        path,
        reason: format!("was moved while kubevol walked the tree below it ({errno})"),
    }
}

/// Enters the deepest level: [`Visit::enter`], then its entries read, those that are not
/// directories visited at once and the directories kept to be entered in the order read.
fn enter(root: &Path, frames: &mut [Frame], visit: &mut dyn Visit) -> Result<(), MountError> {
    let pending = {
        let at = At {
            root,
            frames: &*frames,
        };
        let top = frames.last().expect("a level to enter");
        let fd = top.fd.as_ref().expect("the deepest level is open").as_fd();
        visit.enter(fd, &at)?;
        let mut dirs = Vec::new();
        for (name, ft) in read_entries(fd, || at.dir())? {
            if ft == FileType::Directory {
                dirs.push(name);
            } else {
                visit.other(fd, OsStr::from_bytes(&name), ft, &at)?;
            }
        }
        // Taken from the end: entered in the order they were read.
        dirs.reverse();
        dirs
    };
    frames.last_mut().expect("a level to enter").pending = pending;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A temporary directory in memory where there is a tmpfs for it (a deep tree is made
    /// and removed ten times faster than on a disk).
    /// Walks the tree at `path`.
    pub(crate) fn walk_path(path: &Path, visit: &mut dyn Visit) -> Result<(), MountError> {
        let dir = rustix::fs::open(path, DIR_FLAGS, Mode::empty()).unwrap();
        walk(dir.as_fd(), path, visit)
    }

    /// One test of a tree 100,000 levels deep at a time: each counts the process's open
    /// descriptors (another walking beside it changes that count under it, and the count's
    /// underflow panicked; the panic's unwinding then dropped the deep tree through std's
    /// recursive removal, which overflowed the stack and hid the panic).
    pub(crate) fn deep_trees() -> std::sync::MutexGuard<'static, ()> {
        static DEEP: std::sync::Mutex<()> = std::sync::Mutex::new(());
        DEEP.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn memory_tempdir() -> tempfile::TempDir {
        tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
    }

    /// Makes a chain of `depth` directories named `d` below `top`, each holding a file `f`;
    /// returns the descriptor of the deepest.
    pub(crate) fn chain(top: &Path, depth: usize) -> OwnedFd {
        let mut cur = rustix::fs::open(top, DIR_FLAGS, Mode::empty()).unwrap();
        for _ in 0..depth {
            rustix::fs::mkdirat(&cur, "d", Mode::from_raw_mode(0o755)).unwrap();
            let f = rustix::fs::openat(
                &cur,
                "f",
                rustix::fs::OFlags::CREATE | rustix::fs::OFlags::WRONLY,
                Mode::from_raw_mode(0o600),
            )
            .unwrap();
            drop(f);
            cur = rustix::fs::openat(&cur, "d", DIR_FLAGS, Mode::empty()).unwrap();
        }
        cur
    }

    pub(crate) struct Count {
        pub(crate) dirs: usize,
        pub(crate) files: usize,
        pub(crate) deepest: usize,
        pub(crate) open_at_deepest: usize,
    }

    pub(crate) fn open_descriptors() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }

    impl Visit for Count {
        fn enter(&mut self, _: BorrowedFd<'_>, at: &At<'_>) -> Result<(), MountError> {
            if at.depth() > self.deepest {
                self.deepest = at.depth();
                self.open_at_deepest = open_descriptors();
            }
            Ok(())
        }

        fn other(
            &mut self,
            _: BorrowedFd<'_>,
            _: &OsStr,
            _: FileType,
            _: &At<'_>,
        ) -> Result<(), MountError> {
            self.files += 1;
            Ok(())
        }

        fn descend(
            &mut self,
            parent: BorrowedFd<'_>,
            name: &OsStr,
            at: &At<'_>,
        ) -> Result<Option<OwnedFd>, MountError> {
            self.dirs += 1;
            open_dir(parent, name, at)
        }
    }

    #[test]
    fn a_deep_path_is_shortened_in_messages() {
        let t = tempfile::tempdir().unwrap();
        drop(chain(t.path(), 50));
        struct Deepest(Option<PathBuf>);
        impl Visit for Deepest {
            fn enter(&mut self, _: BorrowedFd<'_>, at: &At<'_>) -> Result<(), MountError> {
                if at.depth() == 50 {
                    self.0 = Some(at.child(OsStr::new("x")));
                }
                Ok(())
            }
            fn other(
                &mut self,
                _: BorrowedFd<'_>,
                _: &OsStr,
                _: FileType,
                _: &At<'_>,
            ) -> Result<(), MountError> {
                Ok(())
            }
            fn descend(
                &mut self,
                parent: BorrowedFd<'_>,
                name: &OsStr,
                at: &At<'_>,
            ) -> Result<Option<OwnedFd>, MountError> {
                open_dir(parent, name, at)
            }
        }
        let mut deepest = Deepest(None);
        walk_path(t.path(), &mut deepest).unwrap();
        let shown = deepest.0.unwrap();
        assert_eq!(
            shown,
            t.path().join("d/d/d/d/…(42 more levels)…/d/d/d/d/x"),
            "{}",
            shown.display()
        );
    }

    /// A level moved elsewhere while the walk is below it is never taken as its old parent.
    #[test]
    fn a_tree_moved_while_it_is_walked_stops_the_walk() {
        let t = tempfile::tempdir().unwrap();
        let tree = t.path().join("tree");
        std::fs::create_dir(&tree).unwrap();
        drop(chain(&tree, 1000));
        std::fs::create_dir(t.path().join("elsewhere")).unwrap();
        struct Mover {
            tree: PathBuf,
            elsewhere: PathBuf,
            moved: bool,
            left: Vec<usize>,
        }
        impl Visit for Mover {
            fn enter(&mut self, _: BorrowedFd<'_>, at: &At<'_>) -> Result<(), MountError> {
                if at.depth() == 4 * OPEN_LIMIT && !self.moved {
                    // Level 10 (long since closed) goes to another parent.
                    let from = self.tree.join("d/".repeat(10).trim_end_matches('/'));
                    std::fs::rename(from, self.elsewhere.join("d")).unwrap();
                    self.moved = true;
                }
                Ok(())
            }
            fn other(
                &mut self,
                _: BorrowedFd<'_>,
                _: &OsStr,
                _: FileType,
                _: &At<'_>,
            ) -> Result<(), MountError> {
                Ok(())
            }
            fn descend(
                &mut self,
                parent: BorrowedFd<'_>,
                name: &OsStr,
                at: &At<'_>,
            ) -> Result<Option<OwnedFd>, MountError> {
                open_dir(parent, name, at)
            }
            fn leave(
                &mut self,
                _: BorrowedFd<'_>,
                _: &OsStr,
                at: &At<'_>,
            ) -> Result<(), MountError> {
                self.left.push(at.depth());
                Ok(())
            }
        }
        let mut mover = Mover {
            tree: tree.clone(),
            elsewhere: t.path().join("elsewhere"),
            moved: false,
            left: Vec::new(),
        };
        let e = walk_path(&tree, &mut mover).unwrap_err();
        assert!(mover.moved);
        assert!(
            matches!(&e, MountError::Unsafe { reason, .. } if reason.contains("was moved")),
            "{e}"
        );
        assert!(
            mover.left.iter().all(|d| *d >= 10),
            "nothing above the moved level was visited again: {:?}",
            mover.left.iter().min()
        );
    }
}
