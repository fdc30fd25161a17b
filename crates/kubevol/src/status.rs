//! The status report: every pod's volumes with state, path, last error and next retry, as the
//! HTTP API serves it and `kubevol status` prints it. These types are the API's wire format.

use serde::{Deserialize, Serialize};

use crate::events::Event;

/// Where a pod's volumes stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PodPhase {
    /// Every volume the pod's containers use is mounted.
    Ready,
    /// Volumes are being set up.
    Pending,
    /// At least one volume failed (and is retried with backoff), or cannot be processed.
    Failed,
    /// The pod is invalid; nothing was created for it.
    Rejected,
    /// The pod is gone or terminated and its volumes are being torn down.
    Terminating,
}

impl std::fmt::Display for PodPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// Where one volume of a pod stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VolumePhase {
    /// Set up.
    Mounted,
    /// May or may not be set up; will be set up again or torn down.
    Uncertain,
    /// Not set up yet.
    Pending,
    /// The last attempt failed; retried after backoff.
    Failed,
    /// Cannot be processed (unsupported type, bad reference).
    Unsupported,
    /// Being torn down.
    Unmounting,
}

impl std::fmt::Display for VolumePhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// One volume of a pod.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VolumeStatus {
    /// The volume's name in the pod's spec.
    pub name: String,
    /// The volume source (`emptyDir`, `hostPath`, ...).
    #[serde(rename = "type")]
    pub type_: String,
    /// The unique volume name, when the volume was processed.
    pub unique_name: Option<String>,
    /// Where it stands.
    pub state: VolumePhase,
    /// The path handed to the container runtime.
    pub path: Option<String>,
    /// Whether the runtime must mount it read-only.
    pub read_only: bool,
    /// The last error and the retry schedule.
    #[serde(flatten)]
    pub retry: RetryInfo,
}

/// A volume's last failure and when it is tried again.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RetryInfo {
    /// The last error, naming what to change.
    pub last_error: Option<String>,
    /// Consecutive failures.
    pub failures: u32,
    /// Milliseconds until the next retry, while backing off.
    pub next_retry_ms: Option<u64>,
}

/// One pod.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PodStatus {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// Where the pod came from (manifest file and document, or the library API).
    pub source: String,
    /// Where its volumes stand.
    pub phase: PodPhase,
    /// Validation errors of a rejected pod, by field path.
    pub errors: Vec<String>,
    /// Its volumes.
    pub volumes: Vec<VolumeStatus>,
    /// Its recent events, oldest first.
    pub events: Vec<Event>,
}

/// The whole report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The node's name.
    pub node_name: String,
    /// The root directory.
    pub root_dir: String,
    /// Whether the reconciler's states are synced (teardown allowed, first pass done).
    pub states_synced: bool,
    /// The pods.
    pub pods: Vec<PodStatus>,
    /// Manifest files with errors (file, document, line, column, message).
    pub manifest_errors: Vec<String>,
    /// What reconstruction found at start.
    #[serde(default)]
    pub reconstruction: crate::reconstruct::Reconstruction,
    /// Orphaned pod directories that could not be removed, and why.
    #[serde(default)]
    pub leftovers: Vec<crate::reconstruct::Leftover>,
}
