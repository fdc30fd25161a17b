//! What every descriptor-relative operation of the mount layer shares: the error of a failed
//! call, with the path it was made on (for the message only; never resolved again), and the
//! flags a directory is opened with (never through a link).

use std::path::Path;

use rustix::fs::OFlags;
use rustix::io::Errno;

use crate::MountError;

/// The error of a failed `op` on `path`.
pub(crate) fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(Errno) -> MountError + 'a {
    move |errno| MountError::Io {
        op,
        path: path.to_path_buf(),
        errno,
    }
}

/// The result of a raw system call: its errno when it returned -1.
pub(crate) fn checked(ret: libc::c_long) -> Result<(), Errno> {
    match ret {
        -1 => Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO)),
        _ => Ok(()),
    }
}

/// A directory, opened for reading its entries, never through a symbolic link.
pub(crate) const DIR_FLAGS: OFlags = OFlags::DIRECTORY
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC)
    .union(OFlags::RDONLY);
