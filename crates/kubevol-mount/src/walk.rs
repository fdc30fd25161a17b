//! Walks over a directory tree whose shape someone else chose: a volume's contents, written by
//! a pod, or a payload whose paths a manifest gave.
//!
//! The walk keeps an explicit stack on the heap instead of recursing, so a tree 1,000,000
//! levels deep costs memory in proportion to its depth (about 40 bytes a level, its names kept
//! in one buffer) and never the thread's stack. At most [`OPEN_LIMIT`] directory descriptors
//! are open at once: the deepest [`WINDOW`] levels, and anchors above them (see [`kept`]):
//! the levels that are multiples of 16 within the current block of 256 levels, the multiples
//! of 256 within the current block of 4,096, and so on. When the walk comes back up to a level
//! whose descriptor was given up, it opens the levels again from the nearest open one down, one
//! name at a time with `O_NOFOLLOW`, and takes each only if it is the very directory it left
//! (same device and inode) — never by a path, so a tree moved while it is walked sends the walk
//! nowhere else. On the way down it keeps the anchors the level it goes back to needs, so each
//! level of the hierarchy is opened again about once per level the walk climbs: a walk costs
//! a few opens per level it climbs (five for 1,000,000 levels), linear in the tree, where one
//! anchor spacing that grew with the depth cost a reopen of the whole spacing at every window,
//! quadratic in the depth. (Going up through `..` would cost the kernel a walk up to the mount's
//! root at every level of a bind-mounted volume: minutes for 100,000 levels.)
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
pub const WINDOW: usize = 32;

/// The anchors' base: a level that is a multiple of `BASE^k` is an anchor while the walk is in
/// the same block of `BASE^(k+1)` levels.
const BASE: usize = 16;

/// The most anchors (open levels above the window) a walk keeps: `BASE - 1` for each power of
/// [`BASE`] up to the deepest tree a filesystem can hold (2^32 levels, far beyond any
/// inode count).
pub const ANCHORS: usize = (BASE - 1) * 8;

/// The most directory descriptors one walk keeps open.
pub const OPEN_LIMIT: usize = WINDOW + ANCHORS + 1;

/// How many names of a deep path a message spells out at each end.
const SHOWN_NAMES: usize = 4;

/// Where a walk is: the path of the directory being walked, for messages only (it is never
/// resolved). Deep paths are shortened in the middle.
pub struct At<'w> {
    root: &'w Path,
    frames: &'w [Frame],
    names: &'w [u8],
}

impl<'w> At<'w> {
    /// The names of the levels below the root, in order.
    fn names(&self) -> impl DoubleEndedIterator<Item = &'w [u8]> + ExactSizeIterator + '_ {
        let names = self.names;
        self.frames[1..]
            .iter()
            .map(move |f| &names[f.name.0..f.name.1])
    }

    /// How many levels below the walk's root the current directory is (the root is 0).
    pub fn depth(&self) -> usize {
        self.frames.len().saturating_sub(1)
    }

    /// The path of the current directory.
    pub fn dir(&self) -> PathBuf {
        let mut path = self.root.to_path_buf();
        let count = self.names().len();
        if count <= 2 * SHOWN_NAMES {
            self.names().for_each(|n| path.push(OsStr::from_bytes(n)));
            return path;
        }
        let hidden = count - 2 * SHOWN_NAMES;
        self.names()
            .take(SHOWN_NAMES)
            .for_each(|n| path.push(OsStr::from_bytes(n)));
        path.push(format!("…({hidden} more levels)…"));
        self.names()
            .skip(count - SHOWN_NAMES)
            .for_each(|n| path.push(OsStr::from_bytes(n)));
        path
    }

    /// The path of the entry `name` of the current directory relative to the walk's root,
    /// `/`-separated (names that are not UTF-8 are shown lossily).
    pub fn relative(&self, name: &OsStr) -> String {
        let mut rel = String::new();
        for n in self.names() {
            rel.push_str(&String::from_utf8_lossy(n));
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
    /// Open while the level is in the window or an anchor ([`kept`]).
    fd: Option<OwnedFd>,
    /// Which directory it is, to know it again when it is reopened.
    id: (u64, u64),
    /// Its name in its parent: a range of the walk's buffer of names (empty for the root).
    name: (usize, usize),
    /// Its subdirectories not entered yet: a range of the walk's list of names.
    pending: (usize, usize),
}

/// The levels of a walk, and the names they hold on the heap: one buffer of names, and one list
/// of ranges of it, each level's subdirectories after its parent's. A level's entries stay until
/// its parent is left (its own name is one of them), so a level costs its frame, one range and
/// its name's bytes.
struct Levels {
    frames: Vec<Frame>,
    list: Vec<(usize, usize)>,
    names: Vec<u8>,
}

impl Levels {
    fn at<'w>(&'w self, root: &'w Path) -> At<'w> {
        self.at_level(root, self.frames.len())
    }

    /// Where the walk is at the directory of level `below - 1`.
    fn at_level<'w>(&'w self, root: &'w Path, below: usize) -> At<'w> {
        At {
            root,
            frames: &self.frames[..below],
            names: &self.names,
        }
    }

    fn name(&self, range: (usize, usize)) -> &OsStr {
        OsStr::from_bytes(&self.names[range.0..range.1])
    }

    /// The next subdirectory of the deepest level to enter (a range of the names).
    fn next_pending(&mut self) -> Option<(usize, usize)> {
        let top = self.frames.last_mut().expect("a level");
        let (next, end) = top.pending;
        (next < end).then(|| {
            top.pending.0 += 1;
            self.list[next]
        })
    }

    /// Lets go of the entries of the deepest level, which was just left: its parent's are the
    /// last ones kept.
    fn forget_entries_below(&mut self, parent: usize) {
        let end = self.frames[parent].pending.1;
        self.list.truncate(end);
        self.names.truncate(self.list.last().map_or(0, |r| r.1));
    }
}

/// Whether `level` keeps its descriptor while the walk is at depth `top`: the root, the
/// deepest [`WINDOW`] levels, and above them each level that is a multiple of `BASE^k` while
/// it lies in the same block of `BASE^(k+1)` levels as `top` (at most `BASE - 1` for each k).
fn kept(level: usize, top: usize) -> bool {
    if level == 0 || level + WINDOW > top {
        return true;
    }
    let mut block = BASE;
    while level.is_multiple_of(block) {
        let Some(outer) = block.checked_mul(BASE) else {
            return true;
        };
        if level / outer == top / outer {
            return true;
        }
        block = outer;
    }
    false
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

/// Calls `each` with every entry of the directory open at `fd` (which must be freshly opened:
/// it is read from its own offset), `.` and `..` left out; an entry whose type the filesystem
/// does not say is looked at.
fn for_each_entry(
    fd: BorrowedFd<'_>,
    path: impl Fn() -> PathBuf,
    mut each: impl FnMut(&[u8], FileType) -> Result<(), MountError>,
) -> Result<(), MountError> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
    let mut dir = rustix::fs::RawDir::new(fd, &mut buf);
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
        each(name, ft)?;
    }
    Ok(())
}

/// The entries of the directory open at `fd` (see [`for_each_entry`]).
pub(crate) fn read_entries(
    fd: BorrowedFd<'_>,
    path: impl Fn() -> PathBuf,
) -> Result<Vec<(Vec<u8>, FileType)>, MountError> {
    let mut out = Vec::new();
    for_each_entry(fd, path, |name, ft| {
        out.push((name.to_vec(), ft));
        Ok(())
    })?;
    Ok(out)
}

/// Walks the tree below the directory open at `root` (reached by `path`, for messages), which
/// is entered first, calling `visit` at every entry:
/// [`Visit::enter`] before a directory's entries, [`Visit::other`] for each entry that is not a
/// directory, [`Visit::descend`] for each that is, and [`Visit::leave`] after a directory's
/// whole tree. The root itself is never left (it has no parent here). Subdirectories are
/// entered in the order the directory lists them.
pub fn walk(root: BorrowedFd<'_>, path: &Path, visit: &mut dyn Visit) -> Result<(), MountError> {
    let fd = rustix::fs::openat(root, ".", DIR_FLAGS, Mode::empty()).map_err(io("open", path))?;
    let id = identity(fd.as_fd(), || path.to_path_buf())?;
    let mut levels = Levels {
        frames: vec![Frame {
            fd: Some(fd),
            id,
            name: (0, 0),
            pending: (0, 0),
        }],
        list: Vec::new(),
        names: Vec::new(),
    };
    enter(path, &mut levels, visit)?;
    loop {
        let top = levels.frames.len() - 1;
        if let Some(range) = levels.next_pending() {
            let at = levels.at(path);
            let name = levels.name(range);
            let parent = levels.frames[top]
                .fd
                .as_ref()
                .expect("the deepest level is open");
            let Some(child) = visit.descend(parent.as_fd(), name, &at)? else {
                continue;
            };
            let id = identity(child.as_fd(), || at.child(name))?;
            let from = levels.list.len();
            levels.frames.push(Frame {
                fd: Some(child),
                id,
                name: range,
                pending: (from, from),
            });
            give_up_descriptors(&mut levels.frames);
            enter(path, &mut levels, visit)?;
            continue;
        }
        // This level is done: go back up to its parent.
        if top == 0 {
            return Ok(());
        }
        let done = levels.frames.pop().expect("a level to leave");
        drop(done.fd);
        if levels.frames[top - 1].fd.is_none() {
            reopen(path, &mut levels)?;
        }
        let at = levels.at(path);
        let parent = levels.frames[top - 1]
            .fd
            .as_ref()
            .expect("the parent was reopened");
        visit.leave(parent.as_fd(), levels.name(done.name), &at)?;
        levels.forget_entries_below(top - 1);
    }
}

/// After a level was pushed: the level that left the window gives up its descriptor unless it
/// is an anchor, and when the walk entered a new block of `BASE^(k+1)` levels, the anchors of
/// the block it left that are no longer [`kept`] give up theirs.
fn give_up_descriptors(frames: &mut [Frame]) {
    let top = frames.len() - 1;
    let Some(left) = top.checked_sub(WINDOW) else {
        return;
    };
    if !kept(left, top) {
        frames[left].fd = None;
    }
    let mut block = BASE;
    while let Some(outer) = block.checked_mul(BASE) {
        if !top.is_multiple_of(outer) {
            break;
        }
        for level in (top - outer..=left).step_by(block) {
            if !kept(level, top) {
                frames[level].fd = None;
            }
        }
        block = outer;
    }
}

/// Opens again the deepest level, whose descriptor was given up: from the nearest open level
/// down, one name at a time, each checked to be the directory it was, keeping on the way the
/// window and the anchors that the deepest level needs ([`kept`]).
fn reopen(root: &Path, levels: &mut Levels) -> Result<(), MountError> {
    let top = levels.frames.len() - 1;
    let anchor = (0..top)
        .rev()
        .find(|&l| levels.frames[l].fd.is_some())
        .expect("the root is open");
    // The directory of the level before: an open level's (borrowed), or one opened on the way.
    let mut above: Option<OwnedFd> = None;
    for level in anchor + 1..=top {
        let fd = {
            let at = levels.at_level(root, level);
            let name = levels.name(levels.frames[level].name);
            let parent = match &above {
                Some(fd) => fd.as_fd(),
                None => levels.frames[level - 1]
                    .fd
                    .as_ref()
                    .expect("an open anchor")
                    .as_fd(),
            };
            let fd = match rustix::fs::openat(parent, name, DIR_FLAGS, Mode::empty()) {
                Ok(fd) => fd,
                Err(e) => return Err(moved(at.child(name), e)),
            };
            #[cfg(test)]
            tests::REOPENED.with(|n| n.set(n.get() + 1));
            if identity(fd.as_fd(), || at.child(name))? != levels.frames[level].id {
                return Err(moved(at.child(name), Errno::STALE));
            }
            fd
        };
        if kept(level, top) {
            levels.frames[level].fd = Some(fd);
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
fn enter(root: &Path, levels: &mut Levels, visit: &mut dyn Visit) -> Result<(), MountError> {
    let Levels {
        frames,
        list,
        names,
    } = levels;
    let at = At {
        root,
        frames,
        names,
    };
    let top = frames.last().expect("a level to enter");
    let fd = top.fd.as_ref().expect("the deepest level is open").as_fd();
    visit.enter(fd, &at)?;
    let mut dirs = Vec::new();
    let mut dir_names = Vec::new();
    for_each_entry(
        fd,
        || at.dir(),
        |name, ft| {
            if ft == FileType::Directory {
                let start = dir_names.len();
                dir_names.extend_from_slice(name);
                dirs.push((start, dir_names.len()));
                Ok(())
            } else {
                visit.other(fd, OsStr::from_bytes(name), ft, &at)
            }
        },
    )?;
    let base = names.len();
    names.extend_from_slice(&dir_names);
    let from = list.len();
    list.extend(dirs.iter().map(|(s, e)| (base + s, base + e)));
    frames.last_mut().expect("a level to enter").pending = (from, list.len());
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    thread_local! {
        /// How many levels this thread's walks opened again.
        pub(crate) static REOPENED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// A chain walked climbs back through every level, and opens each again a few times at
    /// most, however deep: the anchors' hierarchy keeps the walk linear in the depth (one
    /// anchor spacing that grew with the depth reopened the whole spacing at every window).
    /// Every level is visited once, and no more than [`OPEN_LIMIT`] descriptors are open.
    #[test]
    fn a_deep_chain_is_walked_back_up_in_linear_time_within_the_descriptor_limit() {
        let _one_at_a_time = deep_trees();
        let t = memory_tempdir();
        for depth in [1, WINDOW - 1, WINDOW, WINDOW + 1, 300, 5_000, 70_000] {
            let top = t.path().join(format!("c{depth}"));
            std::fs::create_dir(&top).unwrap();
            drop(chain(&top, depth));
            let before = open_descriptors();
            REOPENED.with(|n| n.set(0));
            let mut count = Count {
                dirs: 0,
                files: 0,
                deepest: 0,
                open_at_deepest: 0,
            };
            walk_path(&top, &mut count).unwrap();
            let reopened = REOPENED.with(|n| n.get());
            assert_eq!(
                (count.dirs, count.files, count.deepest),
                (depth, depth, depth)
            );
            assert!(
                count.open_at_deepest <= before + OPEN_LIMIT,
                "{depth} levels: {} descriptors open at the deepest, {before} before",
                count.open_at_deepest
            );
            // Levels of the hierarchy below the depth (16, 256, 4096, 65536): each costs
            // about one reopen per level climbed, the window another.
            let hierarchy = (1..).take_while(|k| BASE.pow(*k) <= depth).count();
            eprintln!("{depth} levels: opened again {reopened}");
            assert!(
                reopened <= depth * (hierarchy + 2),
                "{depth} levels opened again {reopened} times"
            );
            crate::safe::Dir::open(t.path())
                .unwrap()
                .remove_dir_all_one_fs(&format!("c{depth}"))
                .unwrap();
        }
    }

    /// Which levels keep their descriptors: the window, and per power of the base at most
    /// `BASE - 1` anchors, never more than [`ANCHORS`] in all.
    #[test]
    fn the_anchors_are_few_at_any_depth() {
        for top in [0usize, 5, 100, 4_096, 65_535, 65_536, 1_048_575, 1_500_000] {
            let anchors = (1..(top + 1).saturating_sub(WINDOW))
                .filter(|&l| kept(l, top))
                .count();
            let powers = (1..).take_while(|k| BASE.pow(*k) <= top).count();
            assert!(anchors <= (BASE - 1) * powers, "{top}: {anchors} anchors");
            assert!(anchors <= ANCHORS, "{top}: {anchors} anchors");
        }
        assert!(kept(0, 1_000_000) && kept(999_990, 1_000_000));
        assert!(
            kept(999_936, 1_000_000),
            "a multiple of 16 in the same block of 256"
        );
        assert!(
            !kept(999_680 - 16, 1_000_000),
            "a multiple of 16 of an earlier block of 256"
        );
        assert!(
            kept(999_680 - 256, 1_000_000),
            "a multiple of 256 of the same block of 4,096"
        );
        assert!(!kept(999_937, 1_000_000) || 999_937 + WINDOW > 1_000_000);
    }

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
