//! One owner per directory kubevol writes: an exclusive `flock` on a lock file in it, taken
//! before anything there is read or touched and held for the manager's life.
//!
//! - The root directory: `<root>/kubevol.lock`. A second manager (another daemon, a `--once`
//!   beside a daemon, a library user) on the same root is refused with the holder's PID, and
//!   changes nothing.
//! - The local-path directory, where provisioned volumes live: `<dir>/.kubevol.lock`. Two
//!   managers with different roots but one local-path directory would each take the other's
//!   volumes for leftovers of a crash, and a reclaim by one would empty a directory the
//!   other's pod has mounted: the second is refused, naming the first's root.
//!
//! The lock is on the open file description, so it goes with the process however it ends (a
//! SIGKILL included): a stale lock file never keeps a directory from being used. The lock file
//! is opened relative to its directory with `O_NOFOLLOW` and must be a regular file: a link
//! planted in its place is refused, never followed, truncated or written through.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation, Mode, OFlags};

/// The lock file's name in the root directory.
pub const LOCK_FILE: &str = "kubevol.lock";

/// The lock file's name in the local-path directory.
pub const LOCAL_PATH_LOCK_FILE: &str = ".kubevol.lock";

/// The held lock of a directory; released when dropped.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    path: PathBuf,
}

/// The root directory's lock.
pub type RootLock = DirLock;

impl DirLock {
    /// Takes the lock of `root` without waiting, and writes this process's PID into the lock
    /// file. If another holds it, the error (kind `ResourceBusy`) names the root, the lock file
    /// and the holder's PID.
    pub fn take(root: &Path) -> std::io::Result<DirLock> {
        let pid = std::process::id().to_string();
        Self::take_file(root, LOCK_FILE, &pid, |holder, lock| {
            let holder = match holder.split_whitespace().next() {
                None => "another process".to_string(),
                Some(pid) => format!("process {pid}"),
            };
            format!(
                "root directory {} is in use by {holder} (it holds the lock {}): one kubevol serves a root directory at a time, and this one changes nothing; stop the other or give another --root-dir",
                root.display(),
                lock.display()
            )
        })
    }

    /// Takes the lock of the local-path directory `dir` for the manager of `root`, without
    /// waiting. If another manager holds it, the error (kind `ResourceBusy`) names its PID and
    /// root directory.
    pub fn take_local_path(dir: &Path, root: &Path) -> std::io::Result<DirLock> {
        let mark = format!("{} {}", std::process::id(), root.display());
        Self::take_file(dir, LOCAL_PATH_LOCK_FILE, &mark, |holder, lock| {
            let holder = match holder.split_once(' ') {
                Some((pid, other)) => format!("the kubevol of root {other} (process {pid})"),
                None => "another kubevol".to_string(),
            };
            format!(
                "local-path directory {} is in use by {holder}, which holds the lock {}: the volumes provisioned there are that kubevol's, and one kubevol would delete what the other's pods have mounted; give each kubevol its own --local-path-dir",
                dir.display(),
                lock.display()
            )
        })
    }

    /// Takes the lock of the file `name` in `dir` and writes `mark` into it; `busy` words the
    /// refusal from the holder's mark.
    fn take_file(
        dir: &Path,
        name: &str,
        mark: &str,
        busy: impl FnOnce(&str, &Path) -> String,
    ) -> std::io::Result<DirLock> {
        let path = dir.join(name);
        let failed = |e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("cannot lock {}: {e}", path.display()))
        };
        let parent = rustix::fs::open(dir, OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| failed(e.into()))?;
        let flags = OFlags::RDWR
            | OFlags::CREATE
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::NOCTTY
            | OFlags::CLOEXEC;
        let fd =
            rustix::fs::openat(&parent, name, flags, Mode::from_raw_mode(0o644)).map_err(|e| {
                match e {
                    rustix::io::Errno::LOOP => std::io::Error::other(format!(
                    "cannot lock {}: it is a symbolic link, which kubevol never follows; remove it",
                    path.display()
                )),
                    e => failed(e.into()),
                }
            })?;
        let st = rustix::fs::fstat(&fd).map_err(|e| failed(e.into()))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(std::io::Error::other(format!(
                "cannot lock {}: it is not a regular file; remove it",
                path.display()
            )));
        }
        // A hard link to another file would have that file truncated and given the PID.
        if st.st_nlink > 1 {
            return Err(std::io::Error::other(format!(
                "cannot lock {}: it has {} links (a hard link to another file, whose content kubevol would replace); remove it",
                path.display(),
                st.st_nlink
            )));
        }
        let mut file = File::from(fd);
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ResourceBusy,
                    busy(holder.trim(), &path),
                ));
            }
            Err(e) => return Err(failed(e.into())),
        }
        // The mark is for the message of whoever is refused next; losing it loses only that.
        let _ = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{mark}"));
        Ok(DirLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_owner_is_refused_with_the_holders_pid_until_the_first_goes() {
        let root = tempfile::tempdir().unwrap();
        let first = RootLock::take(root.path()).unwrap();
        let e = RootLock::take(root.path()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ResourceBusy);
        let message = e.to_string();
        assert!(
            message.contains(&format!("process {}", std::process::id()))
                && message.contains(&root.path().display().to_string())
                && message.contains(LOCK_FILE),
            "{message}"
        );
        drop(first);
        let again = once_free(|| RootLock::take(root.path()));
        assert_eq!(again.path(), root.path().join(LOCK_FILE));
    }

    #[test]
    fn a_local_path_directory_has_one_owner_named_by_its_root() {
        let dir = tempfile::tempdir().unwrap();
        let first = DirLock::take_local_path(dir.path(), Path::new("/var/lib/a")).unwrap();
        let e = DirLock::take_local_path(dir.path(), Path::new("/var/lib/b")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ResourceBusy);
        assert!(
            e.to_string()
                .contains("the kubevol of root /var/lib/a (process"),
            "{e}"
        );
        drop(first);
        once_free(|| DirLock::take_local_path(dir.path(), Path::new("/var/lib/b")));
    }

    /// `take` once the lock is free: a lock dropped is free at once unless a process that
    /// another test thread forked at that moment still shares its descriptor (from the fork to
    /// its exec, which closes it), so a busy answer is asked again for a while.
    fn once_free<T>(take: impl Fn() -> std::io::Result<T>) -> T {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match take() {
                Ok(taken) => return taken,
                Err(e)
                    if e.kind() == std::io::ErrorKind::ResourceBusy
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(e) => panic!("the lock is not free: {e}"),
            }
        }
    }

    /// A link planted where the lock file goes is never followed, a hard link is refused: the
    /// file behind either keeps its bytes.
    #[test]
    fn a_link_in_place_of_the_lock_file_is_refused_and_its_target_untouched() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("precious");
        std::fs::write(&target, b"keep me").unwrap();
        std::os::unix::fs::symlink(&target, root.path().join(LOCK_FILE)).unwrap();
        let e = RootLock::take(root.path()).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
        let fifo = tempfile::tempdir().unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            fifo.path().join(LOCK_FILE),
            rustix::fs::FileType::Fifo,
            Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        let e = RootLock::take(fifo.path()).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let linked = tempfile::tempdir().unwrap();
        let other = linked.path().join("other");
        std::fs::write(&other, b"keep me too").unwrap();
        std::fs::hard_link(&other, linked.path().join(LOCK_FILE)).unwrap();
        let e = RootLock::take(linked.path()).unwrap_err();
        assert!(e.to_string().contains("has 2 links"), "{e}");
        assert_eq!(std::fs::read(&other).unwrap(), b"keep me too");
    }
}
