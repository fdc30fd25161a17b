//! A [`Mounter`] for tests of the logic above the mount layer: it keeps a mount table in memory,
//! records every call with its typed arguments, and can be told to fail the next N calls of an
//! operation with an errno.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rustix::io::Errno;

use crate::{MountError, MountInfo, MountOptions, Mounter, Unmounted};

/// One recorded call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MountCall {
    /// A mount.
    Mount {
        /// Source.
        source: String,
        /// Target.
        target: PathBuf,
        /// Filesystem type.
        fstype: String,
        /// Options.
        options: MountOptions,
    },
    /// An unmount.
    Unmount {
        /// Target.
        target: PathBuf,
    },
}

/// Which operation an injected failure applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FakeOp {
    /// [`Mounter::mount`].
    Mount,
    /// [`Mounter::unmount`].
    Unmount,
}

#[derive(Default)]
struct State {
    table: Vec<MountInfo>,
    calls: Vec<MountCall>,
    failures: Vec<(FakeOp, Option<PathBuf>, Errno, u32)>,
    next_id: u32,
}

/// The in-memory [`Mounter`].
#[derive(Default)]
pub struct FakeMounter {
    state: Mutex<State>,
}

impl FakeMounter {
    /// A fake with an empty mount table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the next `count` calls of `op` (on `target`, or on any target) fail with `errno`.
    pub fn fail(&self, op: FakeOp, target: Option<&Path>, errno: Errno, count: u32) {
        self.lock()
            .failures
            .push((op, target.map(Path::to_path_buf), errno, count));
    }

    /// Forgets the failures not injected yet.
    pub fn clear_failures(&self) {
        self.lock().failures.clear();
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<MountCall> {
        self.lock().calls.clone()
    }

    /// Whether `target` is in the fake mount table.
    pub fn is_mounted(&self, target: &Path) -> bool {
        self.lock().table.iter().any(|m| m.mount_point == target)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn injected(state: &mut State, op: FakeOp, target: &Path) -> Option<Errno> {
        let slot = state
            .failures
            .iter_mut()
            .find(|(o, t, _, n)| *o == op && *n > 0 && t.as_deref().is_none_or(|t| t == target))?;
        slot.3 -= 1;
        Some(slot.2)
    }
}

impl Mounter for FakeMounter {
    fn mount(
        &self,
        source: &str,
        target: &Path,
        fstype: &str,
        options: &MountOptions,
    ) -> Result<(), MountError> {
        let mut s = self.lock();
        s.calls.push(MountCall::Mount {
            source: source.into(),
            target: target.into(),
            fstype: fstype.into(),
            options: options.clone(),
        });
        if let Some(errno) = Self::injected(&mut s, FakeOp::Mount, target) {
            return Err(MountError::Mount {
                source_name: source.into(),
                target: target.into(),
                fstype: fstype.into(),
                errno,
            });
        }
        if options.remount {
            return match s.table.iter_mut().rev().find(|m| m.mount_point == target) {
                Some(m) => {
                    m.super_options = options.data.join(",");
                    Ok(())
                }
                None => Err(MountError::Mount {
                    source_name: source.into(),
                    target: target.into(),
                    fstype: fstype.into(),
                    errno: Errno::INVAL,
                }),
            };
        }
        s.next_id += 1;
        let id = s.next_id;
        s.table.push(MountInfo {
            id,
            parent_id: 0,
            major_minor: "0:0".into(),
            root: "/".into(),
            mount_point: target.into(),
            mount_options: if options.read_only { "ro" } else { "rw" }.into(),
            fs_type: fstype.into(),
            source: source.into(),
            super_options: options.data.join(","),
            optional: String::new(),
        });
        Ok(())
    }

    fn bind_fd(
        &self,
        _source: std::os::fd::BorrowedFd<'_>,
        source_path: &Path,
        target_dir: &crate::safe::Dir,
        name: &str,
        _recursive: bool,
    ) -> Result<(), MountError> {
        let options = MountOptions::default();
        let source = source_path.display().to_string();
        self.mount(&source, &target_dir.path().join(name), "bind", &options)
    }

    fn make_shared(&self, target: &Path) -> Result<(), MountError> {
        let mut s = self.lock();
        match s.table.iter_mut().rev().find(|m| m.mount_point == target) {
            Some(m) => {
                m.optional = format!("shared:{}", m.id);
                Ok(())
            }
            None => Err(MountError::Mount {
                source_name: "make-rshared".into(),
                target: target.into(),
                fstype: "".into(),
                errno: Errno::INVAL,
            }),
        }
    }

    fn remount_read_only(&self, target: &Path) -> Result<(), MountError> {
        let mut s = self.lock();
        match s.table.iter_mut().rev().find(|m| m.mount_point == target) {
            Some(m) => {
                m.mount_options = "ro".into();
                Ok(())
            }
            None => Err(MountError::Mount {
                source_name: "remount".into(),
                target: target.into(),
                fstype: "bind,ro".into(),
                errno: Errno::INVAL,
            }),
        }
    }

    fn unmount(&self, target: &Path) -> Result<Unmounted, MountError> {
        let mut s = self.lock();
        s.calls.push(MountCall::Unmount {
            target: target.into(),
        });
        if let Some(errno) = Self::injected(&mut s, FakeOp::Unmount, target) {
            return Err(MountError::Unmount {
                target: target.into(),
                errno,
            });
        }
        match s.table.iter().rposition(|m| m.mount_point == target) {
            Some(i) => {
                s.table.remove(i);
                Ok(Unmounted::Done)
            }
            None => Ok(Unmounted::NotMounted),
        }
    }

    fn is_mount_point(&self, path: &Path) -> Result<bool, MountError> {
        Ok(self.is_mounted(path))
    }

    fn mount_table(&self) -> Result<Vec<MountInfo>, MountError> {
        Ok(self.lock().table.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_injects_failures() {
        let f = FakeMounter::new();
        let t = Path::new("/t");
        f.fail(FakeOp::Mount, Some(t), Errno::NOSPC, 1);
        let opts = MountOptions::default();
        assert!(f.mount("tmpfs", t, "tmpfs", &opts).is_err());
        assert!(f.mount("tmpfs", t, "tmpfs", &opts).is_ok());
        assert!(f.is_mount_point(t).unwrap());
        assert_eq!(f.unmount(t).unwrap(), Unmounted::Done);
        assert_eq!(f.unmount(t).unwrap(), Unmounted::NotMounted);
        assert_eq!(f.calls().len(), 4);
    }
}
