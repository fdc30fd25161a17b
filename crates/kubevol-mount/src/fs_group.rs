//! A pod's fsGroup given to a volume's tree (see [`Dir::apply_fs_group`]): one `statx` per
//! entry, and a change only where the group or the bits are not right, so that a tree given the
//! group before (every later set-up under `fsGroupChangePolicy: Always`) costs a stat per
//! entry. The subdirectories of the volume's root are walked by up to [`MAX_WALKERS`] threads
//! at once (the machine's CPUs): the kernel changes different inodes in parallel.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, StatxFlags};
use rustix::io::Errno;

use crate::at::io;
use crate::safe::{Dir, FsGroupPolicy};
use crate::walk::{stat_here, At, Visit};
use crate::MountError;

/// How many entries an ownership walk looks at between two reports of its progress.
pub const PROGRESS_EVERY: u64 = 4096;

/// How many entries a walker counts by itself before adding them to the walk's count: the
/// walkers run on different CPUs, and one shared counter touched for every entry moved its
/// cache line between them a million times on a tree of a million entries.
const COUNT_BATCH: u64 = 256;

/// The most threads one ownership walk uses.
pub const MAX_WALKERS: usize = 4;

/// What the walkers of one application share.
struct Shared<'p> {
    gid: u32,
    mask: u32,
    dev: (u32, u32),
    /// Entries looked at so far, by every walker.
    seen: AtomicU64,
    progress: &'p (dyn Fn(u64) + Sync),
    /// Set when a walker failed: the others stop taking directories.
    failed: AtomicBool,
}

/// One walker's visit.
struct FsGroup<'s, 'p> {
    shared: &'s Shared<'p>,
    /// Entries looked at and not yet added to [`Shared::seen`] (added when dropped).
    unreported: u64,
    /// Where the root's subdirectories go to be walked by any walker (the first walker's
    /// visit of the root only).
    handoff: Option<&'s mpsc::Sender<(OwnedFd, PathBuf)>>,
}

impl Dir {
    /// Gives the tree below (and including) this directory the pod's fsGroup, as the kubelet
    /// does for `securityContext.fsGroup`: group `gid` on every file and directory, group
    /// read/write (read only for read-only volumes) added to the mode, search and set-group-ID
    /// on directories. Symbolic links are skipped, never followed; nothing on another filesystem
    /// or below a mount point is touched. With [`FsGroupPolicy::OnRootMismatch`] nothing is
    /// walked when this directory already has the group and the bits. Returns whether it
    /// walked.
    pub fn apply_fs_group(
        &self,
        gid: u32,
        read_only: bool,
        policy: FsGroupPolicy,
    ) -> Result<bool, MountError> {
        self.apply_fs_group_reporting(gid, read_only, policy, &|_| {})
    }

    /// [`Dir::apply_fs_group`], telling `progress` how many entries it has looked at every
    /// [`PROGRESS_EVERY`] entries (a long walk is shown, and warned of, as the kubelet does).
    pub fn apply_fs_group_reporting(
        &self,
        gid: u32,
        read_only: bool,
        policy: FsGroupPolicy,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<bool, MountError> {
        let mask = if read_only { 0o440 } else { 0o660 };
        if policy == FsGroupPolicy::OnRootMismatch {
            let st = rustix::fs::fstat(&self.fd).map_err(io("stat", &self.path))?;
            if st.st_gid == gid && wanted(st.st_mode, mask, true) == st.st_mode & 0o7777 {
                return Ok(false);
            }
        }
        apply(self, gid, mask, progress)?;
        Ok(true)
    }
}

/// Gives the tree of `dir` group `gid` and the bits of `mask` (see [`Dir::apply_fs_group`]).
pub(crate) fn apply(
    dir: &Dir,
    gid: u32,
    mask: u32,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(), MountError> {
    let shared = Shared {
        gid,
        mask,
        dev: dir.device()?,
        seen: AtomicU64::new(0),
        progress,
        failed: AtomicBool::new(false),
    };
    let walkers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_WALKERS);
    if walkers < 2 || subdirectories(dir.fd()) < 2 {
        return crate::walk::walk(dir.fd(), dir.path(), &mut FsGroup::new(&shared, None));
    }
    let (tx, rx) = mpsc::channel::<(OwnedFd, PathBuf)>();
    let rx = Mutex::new(rx);
    let take = || {
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        next.ok().filter(|_| !shared.failed.load(Ordering::Relaxed))
    };
    let work = || -> Result<(), MountError> {
        while let Some((fd, path)) = take() {
            let mut visit = FsGroup::new(&shared, None);
            crate::walk::walk(fd.as_fd(), &path, &mut visit).inspect_err(|_| {
                shared.failed.store(true, Ordering::Relaxed);
            })?;
        }
        Ok(())
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..walkers).map(|_| s.spawn(work)).collect();
        let root = crate::walk::walk(dir.fd(), dir.path(), &mut FsGroup::new(&shared, Some(&tx)));
        if root.is_err() {
            shared.failed.store(true, Ordering::Relaxed);
        }
        // No more directories: the walkers end once the queue is empty.
        drop(tx);
        let mine = root.and_then(|()| work());
        helpers
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .fold(mine, Result::and)
    })
}

/// How many subdirectories `dir` has, as its listing says (0 if it cannot be listed: the walk
/// reports why).
fn subdirectories(dir: BorrowedFd<'_>) -> usize {
    let Ok(entries) = rustix::fs::Dir::read_from(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| e.file_type() == FileType::Directory)
        .filter(|e| e.file_name() != c"." && e.file_name() != c"..")
        .take(2)
        .count()
}

impl<'s, 'p> FsGroup<'s, 'p> {
    fn new(shared: &'s Shared<'p>, handoff: Option<&'s mpsc::Sender<(OwnedFd, PathBuf)>>) -> Self {
        FsGroup {
            shared,
            unreported: 0,
            handoff,
        }
    }

    fn count(&mut self) {
        self.unreported += 1;
        if self.unreported == COUNT_BATCH {
            self.report();
        }
    }

    /// Adds this walker's entries to the walk's count, and tells the progress when the count
    /// passed a multiple of [`PROGRESS_EVERY`].
    fn report(&mut self) {
        let n = std::mem::take(&mut self.unreported);
        if n == 0 {
            return;
        }
        let before = self.shared.seen.fetch_add(n, Ordering::Relaxed);
        let seen = before + n;
        if before / PROGRESS_EVERY != seen / PROGRESS_EVERY {
            (self.shared.progress)(seen);
        }
    }
}

impl Drop for FsGroup<'_, '_> {
    fn drop(&mut self) {
        self.report();
    }
}

/// The mode an entry of mode `mode` is to have with the group bits `mask` (directories also
/// get search and set-group-ID).
fn wanted(mode: u32, mask: u32, dir: bool) -> u32 {
    let extra = if dir { 0o110 | 0o2000 } else { 0 };
    (mode & 0o7777) | mask | extra
}

impl Visit for FsGroup<'_, '_> {
    /// A directory: its group and bits, changed through its descriptor, and only where they are
    /// not already right. (A directory's chown leaves its mode alone.)
    fn enter(&mut self, dir: BorrowedFd<'_>, at: &At<'_>) -> Result<(), MountError> {
        self.count();
        let st = rustix::fs::fstat(dir).map_err(|e| io("stat", &at.dir())(e))?;
        if st.st_gid != self.shared.gid {
            let gid = Some(rustix::fs::Gid::from_raw(self.shared.gid));
            rustix::fs::fchown(dir, None, gid).map_err(|e| io("chown", &at.dir())(e))?;
        }
        let mode = wanted(st.st_mode, self.shared.mask, true);
        if mode != st.st_mode & 0o7777 {
            rustix::fs::fchmod(dir, Mode::from_raw_mode(mode))
                .map_err(|e| io("chmod", &at.dir())(e))?;
        }
        Ok(())
    }

    /// Anything but a directory: one `statx` (without following a link) says what it is, where
    /// it lives, and its group and mode; nothing more is done where both are right. The group
    /// is changed by name without following a link; the mode of a regular file by name without
    /// following one either (`fchmodat2`; a plain chmod by name would follow a link swapped in
    /// meanwhile, to anywhere on the node), or, on a kernel without it, through a descriptor
    /// opened without following one. Links, mount points and entries of another filesystem
    /// are passed by.
    fn other(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        _listed: FileType,
        at: &At<'_>,
    ) -> Result<(), MountError> {
        self.count();
        let what = StatxFlags::TYPE | StatxFlags::MODE | StatxFlags::GID;
        // Removed since it was listed, a mount point or another filesystem: nothing to change.
        let Some(st) = stat_here(parent, name, what, self.shared.dev, at)? else {
            return Ok(());
        };
        let ft = FileType::from_raw_mode(st.stx_mode.into());
        if ft == FileType::Symlink {
            return Ok(());
        }
        let mode = u32::from(st.stx_mode) & 0o7777;
        let regular = ft == FileType::RegularFile;
        // Sockets, FIFOs and devices keep their mode: only their group changes.
        let wanted = if regular {
            wanted(mode, self.shared.mask, false)
        } else {
            mode
        };
        let regroup = st.stx_gid != self.shared.gid;
        if regroup {
            let gid = Some(rustix::fs::Gid::from_raw(self.shared.gid));
            match rustix::fs::chownat(parent, name, None, gid, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(io("chown", &at.child(name))(e)),
            }
        }
        // A chown clears set-user-ID and set-group-ID of a file: they are given back, as the
        // kubelet's chmod after its chown gives them back.
        let chmod = wanted != mode || (regroup && mode & 0o6000 != 0);
        if !chmod || !regular {
            return Ok(());
        }
        match chmod_nofollow(parent, name, wanted) {
            // Swapped for a link (whose mode Linux does not change), or removed, since it was
            // looked at: not a file to change.
            Ok(()) | Err(Errno::OPNOTSUPP | Errno::NOENT) => return Ok(()),
            Err(Errno::NOSYS) => {}
            Err(e) => return Err(io("chmod", &at.child(name))(e)),
        }
        // A kernel before 6.6: through a descriptor opened without following a link.
        let flags =
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
        let fd = match rustix::fs::openat(parent, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            // Swapped for a link, a socket or a device without a driver, or removed, since it
            // was looked at: not a file to change.
            Err(Errno::LOOP | Errno::NOENT | Errno::NXIO | Errno::NODEV) => return Ok(()),
            Err(e) => return Err(io("open", &at.child(name))(e)),
        };
        // Whatever the name leads to now is an entry of this volume (a link is never followed,
        // and a mount is something only the node makes): one swapped in since the statx is the
        // pod's own, as is every other file here.
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(wanted))
            .map_err(|e| io("chmod", &at.child(name))(e))
    }

    /// A subdirectory on the same filesystem, never through a link: walked here, or, for the
    /// root's subdirectories when several walkers share the work, handed to whichever is free.
    fn descend(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        at: &At<'_>,
    ) -> Result<Option<OwnedFd>, MountError> {
        // Removed since it was listed, a mount point or another filesystem: not walked.
        if stat_here(parent, name, StatxFlags::TYPE, self.shared.dev, at)?.is_none() {
            return Ok(None);
        }
        match (self.handoff, crate::walk::open_subdir(parent, name, at)?) {
            (Some(tx), Some(fd)) if at.depth() == 0 => {
                // The receivers live until every sender is gone.
                let _ = tx.send((fd, at.child(name)));
                Ok(None)
            }
            (_, fd) => Ok(fd),
        }
    }
}

/// Whether the kernel has `fchmodat2` (Linux 6.6), until a call says it has not.
static FCHMODAT2: AtomicBool = AtomicBool::new(true);

/// `fchmodat2(parent, name, mode, AT_SYMLINK_NOFOLLOW)`: the mode of the entry `name` changed
/// without following a link (a link is refused with `EOPNOTSUPP`); `ENOSYS` on a kernel
/// without the call.
fn chmod_nofollow(parent: BorrowedFd<'_>, name: &OsStr, mode: u32) -> Result<(), Errno> {
    use rustix::path::Arg;
    if !FCHMODAT2.load(Ordering::Relaxed) {
        return Err(Errno::NOSYS);
    }
    let r = name.into_with_c_str(|name| {
        #[allow(unsafe_code)]
        // SAFETY: fchmodat2(2) reads the NUL-terminated name, valid for the call, and takes the
        // descriptor, the mode and the flags by value; it writes nothing of ours.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_fchmodat2,
                std::os::fd::AsRawFd::as_raw_fd(&parent),
                name.as_ptr(),
                mode as libc::c_uint,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        crate::at::checked(ret)
    });
    if r == Err(Errno::NOSYS) {
        FCHMODAT2.store(false, Ordering::Relaxed);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A long ownership walk tells its progress once for each [`PROGRESS_EVERY`]
    /// entries passed, in order, however many walkers count (each adds its entries in batches).
    #[test]
    fn an_ownership_walk_tells_its_progress_once_per_block_of_entries() {
        let t = crate::walk::tests::memory_tempdir();
        let v = t.path().join("v");
        for d in 0..4 {
            std::fs::create_dir_all(v.join(format!("d{d}"))).unwrap();
            for f in 0..2_500 {
                std::fs::write(v.join(format!("d{d}/f{f}")), b"").unwrap();
            }
        }
        let entries = 1 + 4 + 4 * 2_500;
        let told = std::sync::Mutex::new(Vec::new());
        let gid = rustix::process::getgid().as_raw();
        let vol = Dir::open(&v).unwrap();
        vol.apply_fs_group_reporting(gid, false, FsGroupPolicy::Always, &|n| {
            told.lock().unwrap().push(n)
        })
        .unwrap();
        let told = told.into_inner().unwrap();
        assert_eq!(told.len() as u64, entries / PROGRESS_EVERY, "{told:?}");
        for (i, n) in told.iter().enumerate() {
            let passed = (i as u64 + 1) * PROGRESS_EVERY;
            assert!(
                (passed..passed + PROGRESS_EVERY).contains(n) && *n <= entries,
                "report {i} says {n}: {told:?}"
            );
        }
    }
}
