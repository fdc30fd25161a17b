//! What a volume's tree takes: bytes on disk and inodes, as `du` counts them (blocks, a file of
//! several links once, one filesystem only).
//!
//! Where the volume's filesystem accounts project quotas (XFS mounted with `prjquota`, ext4 made
//! with the `project` feature and mounted with `prjquota`) and the volume's directory has a
//! project of its own, given when it was made and inherited by everything made in it, the
//! kernel keeps the sum: one `quotactl` answers, whatever the tree's size. Elsewhere a walk
//! stats each entry once. Project IDs from [`FIRST_PROJECT`] up are kubevol's (the kubelet's
//! range too); the ID lives on the directory itself (read back after a restart), never in
//! `/etc/projects`.
//!
//! The kernel's interfaces here have no safe binding (`FS_IOC_FSGETXATTR`/`FS_IOC_FSSETXATTR`,
//! `quotactl_fd(2)`): the three calls are the crate's only `unsafe` beside `unshare`, each on a
//! plain `#[repr(C)]` struct owned by the caller.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use rustix::fs::{AtFlags, FileType, StatxFlags};
use rustix::io::Errno;

use crate::at::{checked, io};
use crate::safe::Dir;
use crate::walk::{stat_here, At, Visit};
use crate::MountError;

/// The first project ID kubevol gives a volume; lower IDs are left to the administrator.
pub const FIRST_PROJECT: u32 = 1_048_577;

/// What a tree takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes of its blocks.
    pub bytes: u64,
    /// Inodes, the root's included.
    pub inodes: u64,
}

/// `struct fsxattr` of `<linux/fs.h>`.
#[repr(C)]
#[derive(Default)]
struct FsXattr {
    xflags: u32,
    extsize: u32,
    nextents: u32,
    projid: u32,
    cowextsize: u32,
    pad: [u8; 8],
}

/// `struct if_dqinfo` of `<linux/quota.h>`.
#[repr(C)]
#[derive(Default)]
struct DqInfo {
    bgrace: u64,
    igrace: u64,
    flags: u32,
    valid: u32,
}

/// `_IOR('X', 31, struct fsxattr)` and `_IOW('X', 32, struct fsxattr)`.
const FS_IOC_FSGETXATTR: libc::c_ulong = 0x801c_581f;
const FS_IOC_FSSETXATTR: libc::c_ulong = 0x401c_5820;
/// New entries of the directory take its project.
const FS_XFLAG_PROJINHERIT: u32 = 0x0000_0200;

const PRJQUOTA: libc::c_int = 2;
const Q_GETINFO: libc::c_int = 0x80_0005;
const Q_GETQUOTA: libc::c_int = 0x80_0007;

/// `QCMD(cmd, PRJQUOTA)`.
fn project_command(cmd: libc::c_int) -> libc::c_int {
    (cmd << 8) | PRJQUOTA
}

fn get_xattr(fd: BorrowedFd<'_>) -> Result<FsXattr, Errno> {
    let mut x = FsXattr::default();
    #[allow(unsafe_code)]
    // SAFETY: FS_IOC_FSGETXATTR writes one `struct fsxattr` (28 bytes, the layout of FsXattr)
    // through the pointer, which is valid and exclusively borrowed for the call.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), FS_IOC_FSGETXATTR, &mut x as *mut FsXattr) };
    checked(ret.into()).map(|()| x)
}

fn set_xattr(fd: BorrowedFd<'_>, x: &FsXattr) -> Result<(), Errno> {
    #[allow(unsafe_code)]
    // SAFETY: FS_IOC_FSSETXATTR reads one `struct fsxattr` through the pointer, which is valid
    // for the call.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), FS_IOC_FSSETXATTR, x as *const FsXattr) };
    checked(ret.into())
}

/// `quotactl_fd(fd, QCMD(cmd, PRJQUOTA), id, out)`, `out` being what `cmd` writes.
fn quotactl<T>(fd: BorrowedFd<'_>, cmd: libc::c_int, id: u32, out: &mut T) -> Result<(), Errno> {
    #[allow(unsafe_code)]
    // SAFETY: quotactl_fd(2) takes a descriptor, a command, an ID and a pointer it writes the
    // command's struct to; the callers pass the struct the command writes (if_dqinfo for
    // Q_GETINFO, if_dqblk for Q_GETQUOTA), valid and exclusively borrowed for the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_quotactl_fd,
            fd.as_raw_fd(),
            project_command(cmd) as libc::c_uint,
            id as libc::c_int,
            out as *mut T,
        )
    };
    checked(ret)
}

/// Whether the filesystem of `dir` accounts project quotas now.
pub fn project_quotas(dir: &Dir) -> bool {
    let mut info = DqInfo::default();
    quotactl(dir.fd(), Q_GETINFO, 0, &mut info).is_ok() && get_xattr(dir.fd()).is_ok()
}

/// The project of `dir` when it is one kubevol gives (from [`FIRST_PROJECT`], inherited by new
/// entries), else `None`.
pub fn project(dir: &Dir) -> Result<Option<u32>, MountError> {
    let x = get_xattr(dir.fd()).map_err(io("FS_IOC_FSGETXATTR", dir.path()))?;
    Ok((x.projid >= FIRST_PROJECT && x.xflags & FS_XFLAG_PROJINHERIT != 0).then_some(x.projid))
}

/// What project `id` holds on the filesystem of `dir` (nothing for a project never used).
pub fn project_usage(dir: &Dir, id: u32) -> Result<Usage, MountError> {
    let mut q = libc::dqblk {
        dqb_bhardlimit: 0,
        dqb_bsoftlimit: 0,
        dqb_curspace: 0,
        dqb_ihardlimit: 0,
        dqb_isoftlimit: 0,
        dqb_curinodes: 0,
        dqb_btime: 0,
        dqb_itime: 0,
        dqb_valid: 0,
    };
    match quotactl(dir.fd(), Q_GETQUOTA, id, &mut q) {
        Ok(()) => Ok(Usage {
            bytes: q.dqb_curspace,
            inodes: q.dqb_curinodes,
        }),
        // XFS keeps no record of a project nothing was ever charged to.
        Err(Errno::NOENT) => Ok(Usage::default()),
        Err(e) => Err(io("quotactl(Q_GETQUOTA)", dir.path())(e)),
    }
}

/// Gives the empty directory `dir` the project `id`, inherited by whatever is made in it, when
/// the project holds nothing anywhere on the filesystem (an ID in use by another directory, or
/// left over, is not shared): `Ok(false)` when it does.
pub fn give_project(dir: &Dir, id: u32) -> Result<bool, MountError> {
    if project_usage(dir, id)? != Usage::default() {
        return Ok(false);
    }
    set_project(dir, id)?;
    Ok(true)
}

/// Gives `dir` the project `id`, inherited by what is made in it (whether or not the
/// filesystem accounts projects: XFS keeps the ID regardless).
pub fn set_project(dir: &Dir, id: u32) -> Result<(), MountError> {
    let mut x = get_xattr(dir.fd()).map_err(io("FS_IOC_FSGETXATTR", dir.path()))?;
    x.projid = id;
    x.xflags |= FS_XFLAG_PROJINHERIT;
    set_xattr(dir.fd(), &x).map_err(io("FS_IOC_FSSETXATTR", dir.path()))
}

/// What the tree of `dir` takes, walked: every entry stated once (never through a link), a file
/// of several links counted once, mount points and other filesystems passed by. An explicit
/// stack (`crate::walk`), so a tree's depth costs memory, not the thread's stack.
pub fn walk_usage(dir: &Dir) -> Result<Usage, MountError> {
    let root = rustix::fs::statx(dir.fd(), "", AtFlags::EMPTY_PATH, WHAT)
        .map_err(io("statx", dir.path()))?;
    let mut visit = Du {
        dev: (root.stx_dev_major, root.stx_dev_minor),
        usage: Usage {
            bytes: root.stx_blocks * 512,
            inodes: 1,
        },
        linked: HashSet::new(),
    };
    crate::walk::walk(dir.fd(), dir.path(), &mut visit)?;
    Ok(visit.usage)
}

struct Du {
    dev: (u32, u32),
    usage: Usage,
    /// Inodes of several links seen so far.
    linked: HashSet<u64>,
}

impl Du {
    /// Counts the entry `st` (a file of several links once).
    fn count(&mut self, st: &rustix::fs::Statx) {
        let directory = FileType::from_raw_mode(st.stx_mode.into()) == FileType::Directory;
        if !directory && st.stx_nlink > 1 && !self.linked.insert(st.stx_ino) {
            return;
        }
        self.usage.bytes += st.stx_blocks * 512;
        self.usage.inodes += 1;
    }
}

/// What a walk states of each entry.
const WHAT: StatxFlags = StatxFlags::TYPE
    .union(StatxFlags::BLOCKS)
    .union(StatxFlags::INO)
    .union(StatxFlags::NLINK);

impl Visit for Du {
    fn other(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        _file_type: FileType,
        at: &At<'_>,
    ) -> Result<(), MountError> {
        if let Some(st) = stat_here(parent, name, WHAT, self.dev, at)? {
            self.count(&st);
        }
        Ok(())
    }

    /// A subdirectory on the same filesystem, counted and entered, never through a link.
    fn descend(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        at: &At<'_>,
    ) -> Result<Option<OwnedFd>, MountError> {
        let Some(st) = stat_here(parent, name, WHAT, self.dev, at)? else {
            return Ok(None);
        };
        let fd = crate::walk::open_subdir(parent, name, at)?;
        if fd.is_some() {
            self.count(&st);
        }
        Ok(fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_walk_counts_every_entry_once_and_a_file_of_two_links_once() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        std::fs::create_dir_all(root.join("a/b/c")).unwrap();
        std::fs::write(root.join("a/b/c/f"), vec![1u8; 10_000]).unwrap();
        std::fs::hard_link(root.join("a/b/c/f"), root.join("a/g")).unwrap();
        std::fs::write(root.join("h"), b"x").unwrap();
        std::os::unix::fs::symlink("/", root.join("link")).unwrap();
        let dir = Dir::open(root).unwrap();
        let u = walk_usage(&dir).unwrap();
        // The root, a, b, c, f (twice linked, once counted), h, the link.
        assert_eq!(u.inodes, 7, "{u:?}");
        let blocks = |p: &str| {
            use std::os::unix::fs::MetadataExt;
            std::fs::symlink_metadata(root.join(p)).unwrap().blocks() * 512
        };
        let want: u64 = ["", "a", "a/b", "a/b/c", "a/b/c/f", "h", "link"]
            .iter()
            .map(|p| blocks(p))
            .sum();
        assert_eq!(u.bytes, want);
    }

    /// A tree 20,000 levels deep, walked on a thread with a small stack, and removed without
    /// recursion.
    #[test]
    fn a_deep_tree_is_walked_without_recursion() {
        let _one_at_a_time = crate::walk::tests::deep_trees();
        let t = crate::walk::tests::memory_tempdir();
        let v = t.path().join("v");
        std::fs::create_dir(&v).unwrap();
        drop(crate::walk::tests::chain(&v, 20_000));
        let top = t.path().to_path_buf();
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                let u = walk_usage(&Dir::open(&top.join("v")).unwrap()).unwrap();
                // v, and each level's directory and file.
                assert_eq!(u.inodes, 1 + 2 * 20_000);
                Dir::open(&top).unwrap().remove_dir_all_one_fs("v").unwrap();
            })
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn the_project_command_is_the_kernels_qcmd() {
        // QCMD(Q_GETQUOTA, PRJQUOTA) as <linux/quota.h> computes it.
        assert_eq!(project_command(Q_GETQUOTA), 0x8000_0702u32 as i32);
        assert_eq!(std::mem::size_of::<FsXattr>(), 28);
    }
}
