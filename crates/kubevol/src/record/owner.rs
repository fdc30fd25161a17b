//! One owner per root directory: an exclusive `flock` on `<root>/kubevol.lock`, taken before
//! the record is read or a mount touched and held for the manager's life. A second manager
//! (another daemon, a `--once` beside a daemon, a library user) on the same root is refused
//! with the holder's PID, and changes nothing.
//!
//! The lock is on the open file description, so it goes with the process however it ends (a
//! SIGKILL included): a stale lock file never keeps a root from being used.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};

/// The lock file's name in the root directory.
pub const LOCK_FILE: &str = "kubevol.lock";

/// The held lock of a root directory; released when dropped.
#[derive(Debug)]
pub struct RootLock {
    _file: File,
    path: PathBuf,
}

impl RootLock {
    /// Takes the lock of `root` without waiting, and writes this process's PID into the lock
    /// file. If another holds it, the error (kind `ResourceBusy`) names the root, the lock file
    /// and the holder's PID.
    pub fn take(root: &Path) -> std::io::Result<RootLock> {
        let path = root.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = match holder.trim() {
                    "" => "another process".to_string(),
                    pid => format!("process {pid}"),
                };
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ResourceBusy,
                    format!(
                        "root directory {} is in use by {holder} (it holds the lock {}): one kubevol serves a root directory at a time, and this one changes nothing; stop the other or give another --root-dir",
                        root.display(),
                        path.display()
                    ),
                ));
            }
            Err(e) => {
                return Err(std::io::Error::new(
                    std::io::Error::from(e).kind(),
                    format!("cannot lock {}: {e}", path.display()),
                ))
            }
        }
        // The PID is for the message of whoever is refused next; losing it loses only that.
        let _ = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{}", std::process::id()));
        Ok(RootLock { _file: file, path })
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
        let again = RootLock::take(root.path()).unwrap();
        assert_eq!(again.path(), root.path().join(LOCK_FILE));
    }
}
