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
    /// A content volume would take a pod's content volumes past its budget.
    #[error("its content takes {} KiB and the pod's other content volumes {} KiB: past the pod's budget of {} KiB for the content of its ConfigMap, Secret, projected and downwardAPI volumes ({of})", need / 1024, used / 1024, budget / 1024)]
    ContentBudget {
        /// What this volume's content takes (its files in whole pages).
        need: u64,
        /// What the pod's other content volumes take.
        used: u64,
        /// The budget.
        budget: u64,
        /// Where the budget comes from (the cap that applied), and what to do.
        of: String,
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
    /// A mount option made from the pod's spec or a PersistentVolume holds what would end the
    /// option early (a quote, a line break): it is never passed on.
    #[error("mount option {option:?} {detail}")]
    MountOption {
        /// The option, as it would have been written.
        option: String,
        /// What is wrong, and what to change.
        detail: &'static str,
    },
    /// A name that would become a directory under the root cannot be one.
    #[error(transparent)]
    PathName(#[from] kubevol_core::names::PathNameError),
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
    /// A request to the API server that the volume needs failed (cluster mode).
    #[error(transparent)]
    Api(#[from] ApiError),
    /// A CSIDriver asks for what only an API server gives: service account tokens.
    #[error("CSIDriver {driver} asks for service account tokens (spec.tokenRequests), which only a Kubernetes API server issues and standalone mode does not have; remove tokenRequests from the CSIDriver, or run kubevol as a cluster node agent")]
    CsiNeedsCluster {
        /// The driver.
        driver: String,
    },
    /// A CSI driver answered an unpublish or unstage with OK, but its target is still mounted.
    #[error("CSI driver {driver} answered {call} with OK but {} is still mounted{}: the driver claims success but left its mount. kubevol never removes a directory with a filesystem on it and tries again; check the driver's logs", path.display(), holders.as_ref().filter(|h| !h.holders.is_empty()).map(|h| format!(" ({h})")).unwrap_or_default())]
    DriverLeftMount {
        /// The driver.
        driver: String,
        /// The call it answered.
        call: &'static str,
        /// The target still mounted.
        path: PathBuf,
        /// What keeps it mounted, when that could be looked for (a process in it makes a
        /// driver's unmount fail).
        holders: Option<Box<kubevol_mount::holders::Holders>>,
    },
    /// A blocking task died.
    #[error("operation task failed: {0}")]
    Task(String),
    /// An error whose text held a Secret's value (a path made with `subPathExpr` from a
    /// Secret-backed variable), with the value replaced.
    #[error("{message}")]
    Redacted {
        /// The message, without the value.
        message: String,
        /// The class of the error it replaces.
        class: ErrorClass,
        /// Whether the error it replaces is permanent.
        permanent: bool,
    },
    /// A set-up that failed after it made something on the node (the volume's directory, its
    /// tmpfs): the volume is uncertain, so that it is torn down (what was made removed) if the
    /// pod goes before a retry succeeds. A directory left by a write that ran out of
    /// descriptors was otherwise kept for ever, and after a restart taken for a foreign pod's.
    #[error("{message}")]
    Partial {
        /// The error's message.
        message: String,
        /// Whether the error it stands for is permanent.
        permanent: bool,
    },
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
    /// `e`, with every one of `secrets` kept out of its message (`e` itself when there are
    /// none).
    pub fn redacted(e: VolumeError, secrets: &[String]) -> VolumeError {
        if secrets.is_empty() {
            return e;
        }
        VolumeError::Redacted {
            message: kubevol_core::projection::redact(&e.to_string(), secrets),
            class: e.class(),
            permanent: e.is_permanent(),
        }
    }

    /// This error, of a set-up that made something on the node before it failed: uncertain.
    pub(crate) fn after_something_made(self) -> VolumeError {
        if self.class() == ErrorClass::Uncertain {
            return self;
        }
        VolumeError::Partial {
            message: self.to_string(),
            permanent: self.is_permanent(),
        }
    }

    /// Whether the failure cannot clear without a change of the pod's spec (or an object it
    /// reads) or of the node's configuration: the operation is not retried on a timer, only
    /// when the pod or an object it reads changes, and `run --once` counts its pod as failed
    /// for good. Failures that can clear by themselves (an object or a host path that may
    /// appear, a driver that may register or recover, a busy or full filesystem) are retried
    /// with backoff.
    pub fn is_permanent(&self) -> bool {
        use kubevol_core::projection::ProjectionError as P;
        match self {
            VolumeError::HostPathNotAllowed { .. }
            | VolumeError::HugePages { .. }
            | VolumeError::Unsupported { .. }
            | VolumeError::CsiNeedsCluster { .. }
            | VolumeError::MountOption { .. }
            | VolumeError::PathName(_)
            | VolumeError::SubPath { .. } => true,
            VolumeError::Redacted { permanent, .. } | VolumeError::Partial { permanent, .. } => {
                *permanent
            }
            VolumeError::Content(e) => {
                matches!(e, P::NeedsCluster { .. } | P::Field { .. } | P::Path { .. })
                    || matches!(e, P::Certificate { error, .. } if error.permanent)
            }
            VolumeError::Mount(_)
            | VolumeError::HostPathType { .. }
            | VolumeError::LocalPath { .. }
            | VolumeError::Csi(_)
            | VolumeError::CsiNotReady(_)
            | VolumeError::DriverLeftMount { .. }
            | VolumeError::Api(_)
            | VolumeError::Task(_)
            | VolumeError::ContentBudget { .. }
            | VolumeError::Record { .. } => false,
        }
    }

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
            VolumeError::Task(_) | VolumeError::Partial { .. } => ErrorClass::Uncertain,
            VolumeError::Redacted { class, .. } => *class,
            VolumeError::Csi(e) if e.is_final() => ErrorClass::Final,
            VolumeError::Csi(_) => ErrorClass::Uncertain,
            VolumeError::CsiNotReady(_)
            | VolumeError::Api(_)
            | VolumeError::Record { .. }
            | VolumeError::DriverLeftMount { .. } => ErrorClass::Transient,
            VolumeError::Content(e) if e.is_transient() => ErrorClass::Transient,
            VolumeError::Content(_) | VolumeError::SubPath { .. } => ErrorClass::Final,
            VolumeError::HostPathType { .. }
            | VolumeError::HostPathNotAllowed { .. }
            | VolumeError::LocalPath { .. }
            | VolumeError::HugePages { .. }
            | VolumeError::CsiNeedsCluster { .. }
            | VolumeError::MountOption { .. }
            | VolumeError::PathName(_)
            | VolumeError::ContentBudget { .. }
            | VolumeError::Unsupported { .. } => ErrorClass::Final,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubevol_core::projection::{ObjectKind, ProjectionError as P};

    /// Every kind of volume error, and whether it ends a pod's wait for good (a change of the
    /// pod, an object it reads or the node's configuration is needed) or is retried because it
    /// can clear by itself.
    #[test]
    fn each_error_kind_is_either_permanent_or_retried() {
        let path = PathBuf::from("/x");
        let errno = rustix::io::Errno::NOENT;
        let object = |kind| P::MissingObject {
            kind,
            namespace: "ns".into(),
            name: "n".into(),
        };
        let csi = |code| {
            VolumeError::Csi(crate::csi::CsiError {
                driver: "d".into(),
                method: "NodePublishVolume",
                code,
                message: "m".into(),
            })
        };
        let rows: Vec<(VolumeError, bool)> = vec![
            // The operator's allow-list, the node's huge pages, an unsupported operation, a
            // subPath the spec makes impossible, a source needing an API server, a downward
            // API field or an item path that cannot work: only a change makes them work.
            (
                VolumeError::HostPathNotAllowed {
                    path: path.clone(),
                    resolved: path.clone(),
                    allowed: "/data".into(),
                },
                true,
            ),
            (
                VolumeError::HugePages {
                    medium: "HugePages-1Gi".into(),
                    detail: "none reserved".into(),
                },
                true,
            ),
            (
                VolumeError::Unsupported {
                    plugin: "p",
                    operation: "o",
                },
                true,
            ),
            (
                VolumeError::PathName(
                    kubevol_core::names::PathName::new("the name", "a/b").unwrap_err(),
                ),
                true,
            ),
            (
                VolumeError::MountOption {
                    option: "context=\"a\"b\"".into(),
                    detail: "holds a quote",
                },
                true,
            ),
            (
                VolumeError::SubPath {
                    container: "c".into(),
                    index: 0,
                    detail: "absolute".into(),
                },
                true,
            ),
            (
                VolumeError::Content(P::NeedsCluster {
                    kind: "serviceAccountToken",
                    index: 0,
                }),
                true,
            ),
            (
                VolumeError::Content(P::Certificate {
                    index: 0,
                    error: kubevol_core::projection::CredentialsError {
                        detail: "denied".into(),
                        permanent: true,
                    },
                }),
                true,
            ),
            (
                VolumeError::Content(P::Certificate {
                    index: 0,
                    error: kubevol_core::projection::CredentialsError {
                        detail: "waiting for the signer".into(),
                        permanent: false,
                    },
                }),
                false,
            ),
            (
                VolumeError::Content(P::Field {
                    field: "f".into(),
                    detail: "d".into(),
                }),
                true,
            ),
            (
                VolumeError::Content(P::Path {
                    path: "../x".into(),
                    detail: "d".into(),
                }),
                true,
            ),
            // Objects, keys, tokens and bundles may appear; host paths and local paths may be
            // made; drivers register and recover; filesystems are busy or full for a while.
            (VolumeError::Content(object(ObjectKind::ConfigMap)), false),
            (VolumeError::Content(object(ObjectKind::Secret)), false),
            (
                VolumeError::Content(P::MissingKey {
                    kind: ObjectKind::ConfigMap,
                    namespace: "ns".into(),
                    name: "n".into(),
                    key: "k".into(),
                }),
                false,
            ),
            (
                VolumeError::Content(P::InvalidObject {
                    kind: ObjectKind::Secret,
                    namespace: "ns".into(),
                    name: "n".into(),
                    detail: "d".into(),
                }),
                false,
            ),
            (
                VolumeError::Content(P::TrustBundle {
                    index: 0,
                    detail: "d".into(),
                }),
                false,
            ),
            (
                VolumeError::Content(P::Token {
                    index: 0,
                    detail: "d".into(),
                }),
                false,
            ),
            (
                VolumeError::HostPathType {
                    path: path.clone(),
                    detail: "does not exist".into(),
                },
                false,
            ),
            (
                VolumeError::LocalPath {
                    pv: "pv".into(),
                    path: path.clone(),
                    detail: "does not exist".into(),
                },
                false,
            ),
            (
                VolumeError::Mount(MountError::Io {
                    op: "mkdir",
                    path: path.clone(),
                    errno,
                }),
                false,
            ),
            (csi(tonic::Code::InvalidArgument), false),
            (csi(tonic::Code::DeadlineExceeded), false),
            (VolumeError::CsiNeedsCluster { driver: "d".into() }, true),
            (
                VolumeError::CsiNotReady("driver not registered".into()),
                false,
            ),
            (
                VolumeError::DriverLeftMount {
                    driver: "d".into(),
                    call: "NodeUnpublishVolume",
                    path: path.clone(),
                    holders: None,
                },
                false,
            ),
            (VolumeError::Task("panicked".into()), false),
            (
                VolumeError::redacted(
                    VolumeError::SubPath {
                        container: "c".into(),
                        index: 0,
                        detail: "s3cret".into(),
                    },
                    &["s3cret".into()],
                ),
                true,
            ),
            (
                VolumeError::Record {
                    dir: path.clone(),
                    source: std::io::Error::other("full"),
                },
                false,
            ),
        ];
        for (e, permanent) in rows {
            assert_eq!(e.is_permanent(), permanent, "{e}");
            if permanent {
                assert_eq!(e.class(), ErrorClass::Final, "{e}: nothing was done");
            }
        }
    }
}

/// Why a request the node makes of the API server failed (cluster mode), as the parts that read
/// and write through it (service account tokens, trust bundles, pod certificates, attachments,
/// claims' status) act on it. The text names the object and what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The server refused the request as it is (forbidden, invalid): asking again the same
    /// way gets the same answer.
    #[error("{0}")]
    Refused(String),
    /// The server does not serve the API the request needs.
    #[error("{0}")]
    NotServed(String),
    /// What is asked for is not there yet: another component (a controller, a signer) is to
    /// make it.
    #[error("{0}")]
    Waiting(String),
    /// The server could not be reached or failed, or asked the node to come back later.
    #[error("{0}")]
    Unavailable(String),
}

impl ApiError {
    /// What the request's caller does next: `Final` waits for a change of the cluster's
    /// objects or configuration; `Transient` asks again with backoff.
    pub fn class(&self) -> ErrorClass {
        match self {
            ApiError::Refused(_) | ApiError::NotServed(_) => ErrorClass::Final,
            ApiError::Waiting(_) | ApiError::Unavailable(_) => ErrorClass::Transient,
        }
    }
}
