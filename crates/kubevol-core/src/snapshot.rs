//! VolumeSnapshot and VolumeSnapshotContent (`snapshot.storage.k8s.io/v1`, the external
//! snapshotter's custom resources): the fields a node reads to fill a claim's volume from a
//! snapshot that exists already (a VolumeSnapshotContent with a `snapshotHandle`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// The API version of both kinds.
pub const API_VERSION: &str = "snapshot.storage.k8s.io/v1";

/// An object of a custom resource: its type's fields, the spec, and the status a controller
/// writes (kept as it is: a node reads none of it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Custom<S> {
    /// `snapshot.storage.k8s.io/v1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// The kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Its metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// What it asks for.
    pub spec: S,
    /// What its controller wrote (ignored on a node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<serde_json::Value>,
}

/// A request for a snapshot of a claim, or a name for a snapshot that exists.
pub type VolumeSnapshot = Custom<VolumeSnapshotSpec>;

/// A snapshot on the storage.
pub type VolumeSnapshotContent = Custom<VolumeSnapshotContentSpec>;

/// A VolumeSnapshot's spec.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSpec {
    /// Its source: exactly one of a claim to take a snapshot of, or a content that exists.
    pub source: VolumeSnapshotSource,
    /// The class of a snapshot to take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_class_name: Option<String>,
}

/// A VolumeSnapshot's source.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSource {
    /// A claim of the snapshot's namespace to take a snapshot of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim_name: Option<String>,
    /// The VolumeSnapshotContent of a snapshot that exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_content_name: Option<String>,
}

/// A VolumeSnapshotContent's spec.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotContentSpec {
    /// The CSI driver that holds the snapshot.
    pub driver: String,
    /// `Delete` or `Retain`.
    #[serde(default)]
    pub deletion_policy: String,
    /// The snapshot (`snapshotHandle`) or the volume to take one of (`volumeHandle`).
    pub source: VolumeSnapshotContentSource,
    /// The VolumeSnapshot it is bound to.
    #[serde(default)]
    pub volume_snapshot_ref: k8s_openapi::api::core::v1::ObjectReference,
    /// The class it was taken with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_class_name: Option<String>,
    /// The volume mode of the volume it was taken of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_volume_mode: Option<String>,
}

/// A VolumeSnapshotContent's source.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotContentSource {
    /// The driver's ID of a snapshot that exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_handle: Option<String>,
    /// The driver's ID of a volume to take a snapshot of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_handle: Option<String>,
}
