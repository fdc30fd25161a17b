//! Why the storage controllers could not bind, provision or grow a claim's volume, and what
//! that means for the claim: it waits for a change (final), for a call that goes on by itself
//! (pending), or for a retry of a step that failed on the node (transient).

use std::path::PathBuf;

use crate::error::ErrorClass;

/// Why a claim has no volume (yet), or its volume could not grow.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The claim breaks the API server's rules: nothing is bound, provisioned or mounted for it.
    #[error("{0}")]
    InvalidClaim(String),
    /// No volume fits the claim and none is made for it.
    #[error("PersistentVolumeClaim {claim} is not bound: {volumes}, and {why_not}")]
    Unbound {
        /// The claim, `namespace/name`.
        claim: String,
        /// What the volumes there are lack (the closest few).
        volumes: String,
        /// Why none is provisioned.
        why_not: Box<StorageError>,
    },
    /// The claim's class cannot give it a volume as it is asked for.
    #[error("{0}")]
    Refused(String),
    /// The claim asks for no storage.
    #[error("the claim asks for no storage (resources.requests.storage): set it")]
    NoRequest,
    /// A CSI driver is creating the claim's volume, or is to be asked again after a backoff.
    #[error("{0}")]
    Creating(String),
    /// The directory of a local-path volume is there already and holds files.
    #[error("the directory {} of a {} volume is there already and holds files: kubevol takes only an empty one (made before a crash) and never another's data; move it away, or remove it if nobody needs it", path.display(), super::classes::LOCAL_PATH_PROVISIONER)]
    Occupied {
        /// The directory.
        path: PathBuf,
    },
    /// The directory of a local-path volume cannot be made or opened.
    #[error("cannot make the directory {} of a {} volume: {source}", path.display(), super::classes::LOCAL_PATH_PROVISIONER)]
    Directory {
        /// The directory.
        path: PathBuf,
        /// What the mount layer said.
        source: kubevol_mount::MountError,
    },
    /// A name of the claim cannot be part of a directory name.
    #[error(transparent)]
    PathName(#[from] kubevol_core::names::PathNameError),
    /// The volume, or its binding, cannot be written to `bindings.json`.
    #[error(
        "PersistentVolumeClaim {claim} cannot be bound to PersistentVolume {volume}: {source}"
    )]
    Record {
        /// The claim, `namespace/name`.
        claim: String,
        /// The volume.
        volume: String,
        /// Why the write failed.
        source: std::io::Error,
    },
    /// A call to the CSI driver failed.
    #[error(transparent)]
    Csi(#[from] crate::csi::CsiError),
    /// A CSI driver needed for the volume is not there.
    #[error("{0}")]
    NoDriver(String),
}

impl StorageError {
    /// What a failed write of volume `volume`, bound to claim `namespace/claim`, becomes.
    pub(super) fn recording(
        namespace: &str,
        claim: &str,
        volume: &str,
    ) -> impl FnOnce(std::io::Error) -> StorageError {
        let (claim, volume) = (format!("{namespace}/{claim}"), volume.to_string());
        move |source| StorageError::Record {
            claim,
            volume,
            source,
        }
    }

    /// What the claim does next: `Final` waits for a change of the claim, its class or the
    /// volumes; `Transient` is tried again by itself; `Uncertain` is a CSI call that may still
    /// be creating the volume.
    pub fn class(&self) -> ErrorClass {
        match self {
            StorageError::InvalidClaim(_)
            | StorageError::Refused(_)
            | StorageError::NoRequest
            | StorageError::Occupied { .. }
            | StorageError::PathName(_) => ErrorClass::Final,
            StorageError::Unbound { why_not, .. } => why_not.class(),
            StorageError::Creating(_)
            | StorageError::Directory { .. }
            | StorageError::Record { .. }
            | StorageError::NoDriver(_) => ErrorClass::Transient,
            StorageError::Csi(e) if e.is_final() => ErrorClass::Final,
            StorageError::Csi(_) => ErrorClass::Uncertain,
        }
    }
}
