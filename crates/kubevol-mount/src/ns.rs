//! Entering a private mount namespace, for the benchmark and the demo: every mount made
//! afterwards is invisible to the rest of the machine and disappears with the process.

use rustix::mount::MountPropagationFlags;
use rustix::thread::UnshareFlags;

use crate::MountError;

/// Moves the calling process into a new mount namespace whose mounts are all private.
///
/// Must be called before the process starts any other thread: unshare(2) of the mount namespace
/// also unshares the filesystem attributes, which fails with EINVAL while they are shared.
pub fn enter_private_mount_namespace() -> Result<(), MountError> {
    #[allow(unsafe_code)]
    // SAFETY: the caller runs this before any other thread exists (documented above), so no
    // other thread can observe the namespace or the working directory changing under it.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWNS) }.map_err(|errno| {
        MountError::Io {
            op: "unshare(CLONE_NEWNS)",
            path: "/".into(),
            errno,
        }
    })?;
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
    )
    .map_err(|errno| MountError::Io {
        op: "make private",
        path: "/".into(),
        errno,
    })
}
