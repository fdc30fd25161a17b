//! Errors of volume operations, each knowing what the executor should do with it.

use std::path::PathBuf;

use kubevol_mount::MountError;

/// What a failed operation leaves behind, which decides the next state of the volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ErrorClass {
    /// Nothing was done; retrying only helps once the user or the node changes something.
    Final,
    /// Nothing lasting was done, and a retry may succeed by itself (busy, full, racing).
    Transient,
    /// The operation may have been partly done: the volume is *uncertain*, and must still be
    /// torn down if the pod goes away.
    Uncertain,
}

/// Why a volume operation failed.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The mount layer failed.
    #[error(transparent)]
    Mount(#[from] MountError),
    /// A hostPath does not have the type the pod asks for.
    #[error("hostPath type check failed: {} {detail}", path.display())]
    HostPathType {
        /// The host path.
        path: PathBuf,
        /// What is wrong, in words the user can act on.
        detail: String,
    },
    /// A hostPath is outside the operator's allow-list.
    #[error("host path {} resolves to {} which is outside the allowed host paths [{allowed}]; ask the node operator to allow it (--host-path-allow) or use another volume type", path.display(), resolved.display())]
    HostPathNotAllowed {
        /// The host path.
        path: PathBuf,
        /// Where it resolves to.
        resolved: PathBuf,
        /// The allowed prefixes.
        allowed: String,
    },
    /// A local PersistentVolume's path is not what its volumeMode needs.
    #[error("local PersistentVolume {pv}: {} {detail}", path.display())]
    LocalPath {
        /// The PersistentVolume.
        pv: String,
        /// Its `spec.local.path`.
        path: PathBuf,
        /// What is wrong, in words the user can act on.
        detail: String,
    },
    /// The node cannot back a HugePages emptyDir.
    #[error("emptyDir medium {medium}: {detail}")]
    HugePages {
        /// The medium asked for.
        medium: String,
        /// Why it cannot be had.
        detail: String,
    },
    /// The plugin cannot do this operation.
    #[error("plugin {plugin} does not support {operation}")]
    Unsupported {
        /// The plugin.
        plugin: &'static str,
        /// The operation.
        operation: &'static str,
    },
    /// The content of a configMap, secret, downwardAPI or projected volume cannot be computed.
    #[error(transparent)]
    Content(#[from] kubevol_core::projection::ProjectionError),
    /// A container's subPath cannot be mounted for a reason in the pod's spec.
    #[error("container {container:?}, volumeMounts[{index}]: {detail}")]
    SubPath {
        /// The container.
        container: String,
        /// The mount's index in the container's volumeMounts.
        index: usize,
        /// What is wrong.
        detail: String,
    },
    /// A CSI call failed.
    #[error(transparent)]
    Csi(#[from] crate::csi::CsiError),
    /// A CSI volume cannot be handled yet: its driver is not registered, it needs a
    /// controller that is not configured, or a secret it references is missing.
    #[error("{0}")]
    CsiNotReady(String),
    /// A CSI driver answered an unpublish or unstage with OK, but its target is still mounted.
    #[error("CSI driver {driver} answered {call} with OK but {} is still mounted: the driver claims success but left its mount. kubevol never removes a directory with a filesystem on it and tries again; check the driver's logs", path.display())]
    DriverLeftMount {
        /// The driver.
        driver: String,
        /// The call it answered.
        call: &'static str,
        /// The target still mounted.
        path: PathBuf,
    },
    /// A blocking task died.
    #[error("operation task failed: {0}")]
    Task(String),
    /// The intent could not be recorded: nothing was done on the node.
    #[error("cannot record the intent in {} ({source}); nothing was done on the node and it is tried again: make room or fix permissions there", dir.display())]
    Record {
        /// The record's directory.
        dir: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

impl VolumeError {
    /// What the failure leaves behind.
    pub fn class(&self) -> ErrorClass {
        match self {
            VolumeError::Mount(e) => {
                if e.is_transient() {
                    ErrorClass::Transient
                } else {
                    ErrorClass::Final
                }
            }
            VolumeError::Task(_) => ErrorClass::Uncertain,
            VolumeError::Csi(e) if e.is_final() => ErrorClass::Final,
            VolumeError::Csi(_) => ErrorClass::Uncertain,
            VolumeError::CsiNotReady(_)
            | VolumeError::Record { .. }
            | VolumeError::DriverLeftMount { .. } => ErrorClass::Transient,
            VolumeError::Content(e) if e.is_transient() => ErrorClass::Transient,
            VolumeError::Content(_) | VolumeError::SubPath { .. } => ErrorClass::Final,
            VolumeError::HostPathType { .. }
            | VolumeError::HostPathNotAllowed { .. }
            | VolumeError::LocalPath { .. }
            | VolumeError::HugePages { .. }
            | VolumeError::Unsupported { .. } => ErrorClass::Final,
        }
    }
}
