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

/// The kernel's calls of project quotas, behind a trait so that what kubevol asks of them (the
/// command, the ID, the flags it sets) is tested against a recording fake where the machine's
/// kernel accounts no quotas.
trait QuotaCalls {
    fn get_xattr(&self, fd: BorrowedFd<'_>) -> Result<FsXattr, Errno>;
    fn set_xattr(&self, fd: BorrowedFd<'_>, x: &FsXattr) -> Result<(), Errno>;
    /// `Q_GETINFO` of project quotas: whether the filesystem accounts them.
    fn info(&self, fd: BorrowedFd<'_>) -> Result<(), Errno>;
    /// `Q_GETQUOTA` of project `id`: its bytes and inodes.
    fn get_quota(&self, fd: BorrowedFd<'_>, id: u32) -> Result<(u64, u64), Errno>;
}

/// The kernel itself.
struct Kernel;

impl QuotaCalls for Kernel {
    fn get_xattr(&self, fd: BorrowedFd<'_>) -> Result<FsXattr, Errno> {
        get_xattr(fd)
    }

    fn set_xattr(&self, fd: BorrowedFd<'_>, x: &FsXattr) -> Result<(), Errno> {
        set_xattr(fd, x)
    }

    fn info(&self, fd: BorrowedFd<'_>) -> Result<(), Errno> {
        let mut info = DqInfo::default();
        quotactl(fd, Q_GETINFO, 0, &mut info)
    }

    fn get_quota(&self, fd: BorrowedFd<'_>, id: u32) -> Result<(u64, u64), Errno> {
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
        quotactl(fd, Q_GETQUOTA, id, &mut q).map(|()| (q.dqb_curspace, q.dqb_curinodes))
    }
}

/// Whether the filesystem of `dir` accounts project quotas now.
pub fn project_quotas(dir: &Dir) -> bool {
    project_quotas_with(&Kernel, dir)
}

fn project_quotas_with(k: &dyn QuotaCalls, dir: &Dir) -> bool {
    k.info(dir.fd()).is_ok() && k.get_xattr(dir.fd()).is_ok()
}

/// The project of `dir` when it is one kubevol gives (from [`FIRST_PROJECT`], inherited by new
/// entries), else `None`.
pub fn project(dir: &Dir) -> Result<Option<u32>, MountError> {
    project_with(&Kernel, dir)
}

fn project_with(k: &dyn QuotaCalls, dir: &Dir) -> Result<Option<u32>, MountError> {
    let x = k
        .get_xattr(dir.fd())
        .map_err(io("FS_IOC_FSGETXATTR", dir.path()))?;
    Ok((x.projid >= FIRST_PROJECT && x.xflags & FS_XFLAG_PROJINHERIT != 0).then_some(x.projid))
}

/// What project `id` holds on the filesystem of `dir` (nothing for a project never used).
pub fn project_usage(dir: &Dir, id: u32) -> Result<Usage, MountError> {
    project_usage_with(&Kernel, dir, id)
}

fn project_usage_with(k: &dyn QuotaCalls, dir: &Dir, id: u32) -> Result<Usage, MountError> {
    match k.get_quota(dir.fd(), id) {
        Ok((bytes, inodes)) => Ok(Usage { bytes, inodes }),
        // XFS keeps no record of a project nothing was ever charged to.
        Err(Errno::NOENT) => Ok(Usage::default()),
        Err(e) => Err(io("quotactl(Q_GETQUOTA)", dir.path())(e)),
    }
}

/// Gives the empty directory `dir` the project `id`, inherited by whatever is made in it, when
/// the project holds nothing anywhere on the filesystem (an ID in use by another directory, or
/// left over, is not shared): `Ok(false)` when it does.
pub fn give_project(dir: &Dir, id: u32) -> Result<bool, MountError> {
    give_project_with(&Kernel, dir, id)
}

fn give_project_with(k: &dyn QuotaCalls, dir: &Dir, id: u32) -> Result<bool, MountError> {
    if project_usage_with(k, dir, id)? != Usage::default() {
        return Ok(false);
    }
    set_project_with(k, dir, id)?;
    Ok(true)
}

/// Gives `dir` the project `id`, inherited by what is made in it (whether or not the
/// filesystem accounts projects: XFS keeps the ID regardless).
pub fn set_project(dir: &Dir, id: u32) -> Result<(), MountError> {
    set_project_with(&Kernel, dir, id)
}

fn set_project_with(k: &dyn QuotaCalls, dir: &Dir, id: u32) -> Result<(), MountError> {
    let mut x = k
        .get_xattr(dir.fd())
        .map_err(io("FS_IOC_FSGETXATTR", dir.path()))?;
    x.projid = id;
    x.xflags |= FS_XFLAG_PROJINHERIT;
    k.set_xattr(dir.fd(), &x)
        .map_err(io("FS_IOC_FSSETXATTR", dir.path()))
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

    /// What kubevol asks of the quota calls, recorded: a project's usage is the kernel's
    /// `Q_GETQUOTA` of that ID, none when the kernel keeps no record (ENOENT); a project is given
    /// only when it holds nothing, with PROJINHERIT set and the other flags kept; a directory's
    /// project is kubevol's only from FIRST_PROJECT up and inherited.
    #[test]
    fn the_quota_calls_ask_what_they_must_and_read_what_they_get() {
        use std::cell::RefCell;
        #[derive(Default)]
        struct Recording {
            calls: RefCell<Vec<String>>,
            xflags: u32,
            projid: u32,
            usage: Option<(u64, u64)>,
            accounted: bool,
        }
        impl QuotaCalls for Recording {
            fn get_xattr(&self, _: BorrowedFd<'_>) -> Result<FsXattr, Errno> {
                self.calls.borrow_mut().push("get_xattr".into());
                Ok(FsXattr {
                    xflags: self.xflags,
                    projid: self.projid,
                    ..Default::default()
                })
            }
            fn set_xattr(&self, _: BorrowedFd<'_>, x: &FsXattr) -> Result<(), Errno> {
                self.calls.borrow_mut().push(format!(
                    "set_xattr projid={} xflags={:#x}",
                    x.projid, x.xflags
                ));
                Ok(())
            }
            fn info(&self, _: BorrowedFd<'_>) -> Result<(), Errno> {
                self.calls.borrow_mut().push("info".into());
                if self.accounted {
                    Ok(())
                } else {
                    Err(Errno::NOSYS)
                }
            }
            fn get_quota(&self, _: BorrowedFd<'_>, id: u32) -> Result<(u64, u64), Errno> {
                self.calls.borrow_mut().push(format!("get_quota {id}"));
                self.usage.ok_or(Errno::NOENT)
            }
        }
        let t = tempfile::tempdir().unwrap();
        let dir = Dir::open(t.path()).unwrap();
        let id = FIRST_PROJECT + 7;
        let used = Recording {
            usage: Some((4096 * 3, 5)),
            accounted: true,
            ..Default::default()
        };
        assert!(project_quotas_with(&used, &dir));
        assert_eq!(
            project_usage_with(&used, &dir, id).unwrap(),
            Usage {
                bytes: 12288,
                inodes: 5
            }
        );
        assert!(
            !give_project_with(&used, &dir, id).unwrap(),
            "a project that holds something is not given"
        );
        assert!(!used
            .calls
            .borrow()
            .iter()
            .any(|c| c.starts_with("set_xattr")));
        let unused = Recording {
            xflags: 0x1,
            ..Default::default()
        };
        assert!(
            !project_quotas_with(&unused, &dir),
            "Q_GETINFO refused: not accounted"
        );
        assert_eq!(
            project_usage_with(&unused, &dir, id).unwrap(),
            Usage::default(),
            "ENOENT: none"
        );
        assert!(give_project_with(&unused, &dir, id).unwrap());
        assert_eq!(
            unused.calls.borrow().last().unwrap(),
            &format!(
                "set_xattr projid={id} xflags={:#x}",
                0x1 | FS_XFLAG_PROJINHERIT
            )
        );
        for (projid, xflags, want) in [
            (id, FS_XFLAG_PROJINHERIT, Some(id)),
            (id, 0, None),
            (FIRST_PROJECT - 1, FS_XFLAG_PROJINHERIT, None),
        ] {
            let r = Recording {
                projid,
                xflags,
                ..Default::default()
            };
            assert_eq!(
                project_with(&r, &dir).unwrap(),
                want,
                "projid {projid} xflags {xflags:#x}"
            );
        }
    }

    #[test]
    fn the_project_command_is_the_kernels_qcmd() {
        // QCMD(Q_GETQUOTA, PRJQUOTA) as <linux/quota.h> computes it.
        assert_eq!(project_command(Q_GETQUOTA), 0x8000_0702u32 as i32);
        assert_eq!(std::mem::size_of::<FsXattr>(), 28);
    }
}
