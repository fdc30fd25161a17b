//! A watch of one directory's entries with inotify: the names made or moved in, and the names
//! removed or moved out, as they happen. What the CSI plugin registration watches its directory
//! with, on rustix and tokio alone (the manifest source's richer watch is the `manifests`
//! feature's).

use std::ffi::OsString;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use tokio::io::unix::AsyncFd;

/// A change to a watched directory's entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// The entry of this name was made, or moved in.
    Added(OsString),
    /// The entry of this name was removed, or moved out.
    Removed(OsString),
    /// The kernel's queue overflowed: changes were lost, list the directory again.
    Overflow,
}

/// An inotify watch of one directory.
pub struct DirWatch {
    fd: AsyncFd<OwnedFd>,
    buf: Vec<MaybeUninit<u8>>,
}

impl DirWatch {
    /// Watches `dir` (which must be a directory) from now on.
    pub fn new(dir: &Path) -> io::Result<Self> {
        let fd = inotify::init(CreateFlags::NONBLOCK | CreateFlags::CLOEXEC)?;
        inotify::add_watch(
            &fd,
            dir,
            WatchFlags::CREATE
                | WatchFlags::DELETE
                | WatchFlags::MOVED_FROM
                | WatchFlags::MOVED_TO
                | WatchFlags::ONLYDIR,
        )?;
        // `AsyncFd::new` is deprecated for types whose descriptor may change under it; an
        // `OwnedFd` is the descriptor itself, held until the watch is dropped.
        #[allow(deprecated)]
        let fd = AsyncFd::new(fd)?;
        Ok(DirWatch {
            fd,
            // Room for many events of the longest name at once.
            buf: vec![MaybeUninit::uninit(); 64 * 1024],
        })
    }

    /// The changes that happened since the last call, waiting for at least one.
    pub async fn next(&mut self) -> io::Result<Vec<Entry>> {
        let mut out = Vec::new();
        loop {
            let mut ready = self.fd.readable().await?;
            let buf = &mut self.buf;
            // Reads until the queue is empty: the kernel's "would block" then clears the
            // readiness, so that the next wait sleeps until more events come.
            let read = ready.try_io(|fd| -> io::Result<std::convert::Infallible> {
                let mut events = inotify::Reader::new(fd.get_ref(), buf);
                loop {
                    match events.next() {
                        Ok(ev) => out.extend(entry(ev.events(), ev.file_name())),
                        Err(rustix::io::Errno::INTR) => continue,
                        Err(e) => return Err(io::Error::from(e)),
                    }
                }
            });
            match read {
                Ok(Err(e)) => return Err(e),
                Ok(Ok(never)) => match never {},
                Err(_would_block) if out.is_empty() => continue,
                Err(_would_block) => return Ok(out),
            }
        }
    }
}

/// What one inotify event says about the directory's entries.
fn entry(flags: ReadFlags, name: Option<&std::ffi::CStr>) -> Option<Entry> {
    if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
        return Some(Entry::Overflow);
    }
    let name = OsString::from(std::ffi::OsStr::from_bytes(name?.to_bytes()));
    if flags.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO) {
        Some(Entry::Added(name))
    } else if flags.intersects(ReadFlags::DELETE | ReadFlags::MOVED_FROM) {
        Some(Entry::Removed(name))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn entries_made_moved_and_removed_are_reported_in_order() {
        let t = tempfile::tempdir().unwrap();
        let mut w = DirWatch::new(t.path()).unwrap();
        std::fs::write(t.path().join("a"), "").unwrap();
        std::fs::rename(t.path().join("a"), t.path().join("b")).unwrap();
        std::fs::remove_file(t.path().join("b")).unwrap();
        let mut seen = Vec::new();
        while seen.len() < 4 {
            seen.extend(w.next().await.unwrap());
        }
        assert_eq!(
            seen,
            [
                Entry::Added("a".into()),
                Entry::Removed("a".into()),
                Entry::Added("b".into()),
                Entry::Removed("b".into()),
            ]
        );
    }
}
