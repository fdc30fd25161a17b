//! Online expansion: a volume whose PersistentVolume grew is expanded by its driver. In cluster
//! mode the node's part follows the claim's status as the kubelet's does (Kubernetes 1.34,
//! RecoverVolumeExpansionFailure): it runs while the resize controller says
//! `NodeResizePending` or `NodeResizeInProgress`, marks `NodeResizeInProgress`, and then, in one
//! status patch, records the new capacity and clears the status — or, on a final error, records
//! a `NodeResizeError` condition (and `NodeResizeInfeasible` when the driver says the size
//! cannot be had).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kubevol_core::UniqueVolumeName;
use kubevol_csi::v1::{self as csi};

use crate::csi::{Driver, Drivers};
use crate::error::VolumeError;
use crate::plugins::PluginHost;

use super::*;

/// The claim annotation by which a ReadWriteMany claim says that its volume needs no
/// expansion on each node.
pub const NODE_EXPANSION_NOT_REQUIRED: &str = "volume.kubernetes.io/node-expansion-not-required";

/// The claim conditions of an expansion (the others are kept as they are).
const RESIZE_CONDITIONS: [&str; 4] = [
    "FileSystemResizePending",
    "Resizing",
    "ControllerResizeError",
    "NodeResizeError",
];

/// What the node does about a claim whose volume grew, from the claim's status (the kubelet's
/// node expander's pre-check).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum NodeResize {
    /// Expand on the node; `claimed` when the claim's status is the node's to write (not yet
    /// updated by another node or the controller).
    Expand { claimed: bool },
    /// Nothing to do here: the claim's status already has the size.
    Done,
    /// Not now: the resize controller has not asked the node (why).
    Wait(String),
}

/// The storage quantity of a resource map, in bytes.
fn storage_bytes(
    map: Option<
        &std::collections::BTreeMap<
            String,
            k8s_openapi::apimachinery::pkg::api::resource::Quantity,
        >,
    >,
) -> Option<i64> {
    let q = map?.get("storage")?;
    kubevol_core::quantity::Quantity::parse(&q.0)
        .ok()
        .map(|q| q.value())
}

/// Decides the node's part of an expansion to `new_size` bytes.
pub(crate) fn node_resize(claim: &PersistentVolumeClaim, new_size: i64) -> NodeResize {
    let status = claim.status.clone().unwrap_or_default();
    let resize_status = status
        .allocated_resource_statuses
        .as_ref()
        .and_then(|s| s.get("storage"))
        .cloned()
        .unwrap_or_default();
    let already_updated = storage_bytes(status.capacity.as_ref()).is_some_and(|c| c >= new_size)
        && resize_status.is_empty();
    let many_writers = claim
        .spec
        .as_ref()
        .and_then(|s| s.access_modes.as_ref())
        .is_some_and(|m| m.iter().any(|m| m == "ReadWriteMany"));
    let not_required = claim
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(NODE_EXPANSION_NOT_REQUIRED));
    // A ReadWriteMany volume is expanded on every node that mounts it, unless the claim says
    // the node need not.
    if already_updated && many_writers && !not_required {
        return NodeResize::Expand { claimed: false };
    }
    match resize_status.as_str() {
        "" if already_updated => NodeResize::Done,
        "" => NodeResize::Wait("the claim's status.allocatedResourceStatuses has no storage entry yet: waiting for the resize controller".into()),
        "NodeResizePending" | "NodeResizeInProgress" => NodeResize::Expand { claimed: true },
        other => NodeResize::Wait(format!(
            "the claim's status.allocatedResourceStatuses[storage] is {other}: the node expands only when it is NodeResizePending or NodeResizeInProgress"
        )),
    }
}

/// The claim's conditions after an expansion step, merged as the kubelet merges them: the
/// conditions of other kinds stay; on success every expansion condition goes; on a failure
/// `NodeResizeError` is added (one already true stays as it is) and the other expansion
/// conditions stay.
fn conditions_after(
    claim: &PersistentVolumeClaim,
    error: Option<serde_json::Value>,
) -> serde_json::Value {
    let old = claim
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten();
    let mut out: Vec<serde_json::Value> = Vec::new();
    let failure = error.is_some();
    let mut error = error;
    for c in old {
        let resize = RESIZE_CONDITIONS.contains(&c.type_.as_str());
        if resize && !failure {
            continue;
        }
        if c.type_ == "NodeResizeError" && c.status != "True" {
            continue;
        }
        if c.type_ == "NodeResizeError" {
            error = None;
        }
        out.extend(serde_json::to_value(c).ok());
    }
    out.extend(error);
    serde_json::Value::Array(out)
}

/// A claim of the API server whose status the node writes during an expansion.
pub(super) struct ClusterClaim {
    /// The claim's name (in the pod's namespace).
    pub(super) name: String,
    pub(super) claim: Arc<PersistentVolumeClaim>,
    /// The PersistentVolume's capacity as written (the claim's new `status.capacity`).
    pub(super) new_capacity: String,
    /// The pod whose set-up expands it (its events say how the expansion went).
    pub(super) pod: kubevol_core::PodRef,
}

pub(super) async fn expand_if_grown(
    host: &Arc<PluginHost>,
    sizes: &Mutex<HashMap<UniqueVolumeName, i64>>,
    volume: &UniqueVolumeName,
    r: &Resolved,
    driver: &Arc<Driver>,
    path: &Path,
    claim: Option<ClusterClaim>,
) -> Result<(), VolumeError> {
    let Some(want) = r.capacity else {
        return Ok(());
    };
    let seen = {
        let mut s = crate::sync::lock(sizes);
        *s.entry(volume.clone()).or_insert_with(|| {
            // After a restart: the size recorded when it was last expanded; at the first
            // mount of a claim of the API server, the size its status has (a resize pending
            // then is done at mount, as the kubelet does); else the volume's.
            host.record
                .device(volume)
                .and_then(|d| d.expanded_size)
                .or_else(|| {
                    let status = claim.as_ref()?.claim.status.as_ref()?;
                    storage_bytes(status.capacity.as_ref())
                })
                .unwrap_or(want)
        })
    };
    if want <= seen || !driver.capabilities.expand_volume {
        if want > seen {
            tracing::warn!(driver = %r.driver, volume = %r.handle, "capacity grew but the driver cannot expand volumes on the node");
            crate::sync::lock(sizes).insert(volume.clone(), want);
        }
        return Ok(());
    }
    let range = csi::CapacityRange {
        required_bytes: want,
        limit_bytes: 0,
    };
    let secrets = secrets(host, r.expand_secret.as_ref())?;
    if let Some(claim) = claim {
        return expand_for_cluster(host, sizes, volume, r, driver, path, claim, range, secrets)
            .await;
    }
    use kubevol_csi::v1::controller_service_capability::rpc::Type;
    if host
        .csi
        .controller_has(&r.driver, Type::ExpandVolume)
        .await?
    {
        if let Some(mut c) = host.csi.controller_client(&r.driver) {
            host.csi
                .call(
                    &r.driver,
                    "Controller",
                    "ControllerExpandVolume",
                    c.controller_expand_volume(csi::ControllerExpandVolumeRequest {
                        volume_id: r.handle.clone(),
                        capacity_range: Some(range),
                        secrets: secrets.clone(),
                        volume_capability: Some(capability(r, driver, None)),
                    }),
                )
                .await?;
        }
    }
    node_expand(host, r, driver, path, range, secrets).await?;
    expanded(host, sizes, volume, want).await
}

/// NodeExpandVolume.
async fn node_expand(
    host: &Arc<PluginHost>,
    r: &Resolved,
    driver: &Arc<Driver>,
    path: &Path,
    range: csi::CapacityRange,
    secrets: HashMap<String, String>,
) -> Result<(), VolumeError> {
    let staging_path = if driver.capabilities.stage_unstage_volume {
        host.root.join(staging(r).0).display().to_string()
    } else {
        String::new()
    };
    let mut client = Drivers::node_client(driver);
    let resp = host
        .csi
        .call(
            &r.driver,
            "Node",
            "NodeExpandVolume",
            client.node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: r.handle.clone(),
                volume_path: path.display().to_string(),
                capacity_range: Some(range),
                staging_target_path: staging_path,
                volume_capability: Some(capability(r, driver, None)),
                secrets,
            }),
        )
        .await?;
    tracing::info!(driver = %r.driver, volume = %r.handle, bytes = resp.capacity_bytes, "volume expanded on the node");
    Ok(())
}

/// Remembers (durably) that the volume has `size` bytes on this node.
async fn expanded(
    host: &Arc<PluginHost>,
    sizes: &Mutex<HashMap<UniqueVolumeName, i64>>,
    volume: &UniqueVolumeName,
    size: i64,
) -> Result<(), VolumeError> {
    crate::sync::lock(sizes).insert(volume.clone(), size);
    host.record
        .set_expanded_size(volume, size)
        .await
        .map_err(|e| not_ready(format!("cannot record the expanded size: {e}")))
}

/// The node's part of an expansion of a claim of the API server (see the module's text).
#[allow(clippy::too_many_arguments)]
async fn expand_for_cluster(
    host: &Arc<PluginHost>,
    sizes: &Mutex<HashMap<UniqueVolumeName, i64>>,
    volume: &UniqueVolumeName,
    r: &Resolved,
    driver: &Arc<Driver>,
    path: &Path,
    c: ClusterClaim,
    range: csi::CapacityRange,
    secrets: HashMap<String, String>,
) -> Result<(), VolumeError> {
    let want = range.required_bytes;
    let Some(writer) = host.claim_status.get().cloned() else {
        return Err(not_ready("no writer of claims' statuses is set".into()));
    };
    let namespace = c.pod.namespace.to_string();
    let what = format!("PersistentVolumeClaim {namespace}/{}", c.name);
    // The claim as it is now: the store's copy may be a minute old, and this node's own last
    // patch (an infeasible size) must be seen.
    let fresh = writer.get(namespace.clone(), c.name.clone()).await?;
    let c = ClusterClaim {
        claim: Arc::new(fresh),
        ..c
    };
    let claimed = match node_resize(&c.claim, want) {
        NodeResize::Done => return expanded(host, sizes, volume, want).await,
        NodeResize::Wait(why) => {
            // Not an error: the volume is in use as it is; a change of the claim brings the
            // set-up, and this check, back.
            tracing::debug!(claim = %what, "expansion not started on the node: {why}");
            return Ok(());
        }
        NodeResize::Expand { claimed } => claimed,
    };
    let patch =
        |body: serde_json::Value| writer.patch_status(namespace.clone(), c.name.clone(), body);
    let mut rv = c.claim.metadata.resource_version.clone();
    if claimed {
        let body = serde_json::json!({
            "metadata": {"resourceVersion": rv},
            "status": {"allocatedResourceStatuses": {"storage": "NodeResizeInProgress"}},
        });
        let written = patch(body).await.map_err(|e| {
            not_ready(format!(
                "cannot mark the expansion of {what} in progress on the node: {e}"
            ))
        })?;
        rv = written.metadata.resource_version;
    }
    let event = |warning: bool, reason: &'static str, message: String| {
        host.events.record(&c.pod, warning, reason, message);
    };
    if let Err(e) = node_expand(host, r, driver, path, range, secrets).await {
        event(
            true,
            crate::report::events::reason::FILE_SYSTEM_RESIZE_FAILED,
            format!("MountVolume.NodeExpandVolume failed for volume {volume} ({what}): {e}"),
        );
        let VolumeError::Csi(csi_error) = &e else {
            return Err(e);
        };
        if !csi_error.is_final() {
            return Err(e);
        }
        if csi_error.code == tonic::Code::FailedPrecondition {
            // The driver cannot expand a volume in use: the mount goes on, and the node does
            // not try again (as the kubelet).
            tracing::warn!(claim = %what, "{e}; the volume is used at its old size");
            return expanded(host, sizes, volume, want).await;
        }
        if claimed {
            let infeasible = matches!(
                csi_error.code,
                tonic::Code::InvalidArgument | tonic::Code::OutOfRange | tonic::Code::NotFound
            );
            failed(&*writer, &c, &what, e.to_string(), infeasible).await?;
        }
        return Err(e);
    }
    event(
        false,
        crate::report::events::reason::FILE_SYSTEM_RESIZE_SUCCESSFUL,
        format!(
            "MountVolume.NodeExpandVolume succeeded for volume {volume} ({what}) {}",
            host.node_name
        ),
    );
    if claimed {
        // One patch: the new capacity, the status cleared, the expansion's conditions gone.
        let body = serde_json::json!({
            "metadata": {"resourceVersion": rv},
            "status": {
                "capacity": {"storage": c.new_capacity},
                "allocatedResourceStatuses": {"storage": null},
                "conditions": conditions_after(&c.claim, None),
            },
        });
        patch(body)
            .await
            .map_err(|e| not_ready(format!("the volume was expanded on the node, but {e}")))?;
    }
    expanded(host, sizes, volume, want).await
}

/// Records a final failure of the node's expansion on the claim: a `NodeResizeError`
/// condition, and `NodeResizeInfeasible` when the size cannot be had (the resize controller then
/// lets the user ask for another size).
async fn failed(
    writer: &dyn crate::plugins::ClaimStatusWriter,
    c: &ClusterClaim,
    what: &str,
    why: String,
    infeasible: bool,
) -> Result<(), VolumeError> {
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    let condition = serde_json::json!({
        "type": "NodeResizeError", "status": "True", "lastTransitionTime": now,
        "message": format!("failed to expand pvc with {why}"),
    });
    let mut status = serde_json::json!({"conditions": conditions_after(&c.claim, Some(condition))});
    if infeasible {
        status["allocatedResourceStatuses"] =
            serde_json::json!({"storage": "NodeResizeInfeasible"});
    }
    writer
        .patch_status(
            c.pod.namespace.to_string(),
            c.name.clone(),
            serde_json::json!({"status": status}),
        )
        .await
        .map_err(|e| not_ready(format!("the expansion of {what} failed ({why}), and {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{node_resize, NodeResize};
    use serde_json::json;

    fn claim(
        modes: &[&str],
        capacity: &str,
        status: Option<&str>,
        not_required: bool,
    ) -> k8s_openapi::api::core::v1::PersistentVolumeClaim {
        let mut c = json!({"metadata": {"name": "c", "namespace": "ns"},
            "spec": {"accessModes": modes},
            "status": {"capacity": {"storage": capacity}}});
        if let Some(s) = status {
            c["status"]["allocatedResourceStatuses"] = json!({"storage": s});
        }
        if not_required {
            c["metadata"]["annotations"] = json!({super::NODE_EXPANSION_NOT_REQUIRED: "true"});
        }
        serde_json::from_value(c).unwrap()
    }

    /// The claim's conditions after a success and after a failure, merged as the kubelet
    /// merges them.
    #[test]
    fn conditions_are_merged_as_the_kubelet_merges_them() {
        let claim =
            |conditions: serde_json::Value| -> k8s_openapi::api::core::v1::PersistentVolumeClaim {
                serde_json::from_value(
                    json!({"metadata": {"name": "c"}, "status": {"conditions": conditions}}),
                )
                .unwrap()
            };
        let types = |v: serde_json::Value| -> Vec<String> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    format!(
                        "{}={}",
                        c["type"].as_str().unwrap(),
                        c["status"].as_str().unwrap()
                    )
                })
                .collect()
        };
        let error = json!({"type": "NodeResizeError", "status": "True", "message": "new"});
        let pending = claim(
            json!([{"type": "FileSystemResizePending", "status": "True"}, {"type": "Custom", "status": "True"}]),
        );
        assert_eq!(
            types(super::conditions_after(&pending, None)),
            ["Custom=True"]
        );
        assert_eq!(
            types(super::conditions_after(&pending, Some(error.clone()))),
            [
                "FileSystemResizePending=True",
                "Custom=True",
                "NodeResizeError=True"
            ]
        );
        // A true error stays as it was (its message too); a false one is replaced.
        let failed = claim(
            json!([{"type": "NodeResizeError", "status": "True", "message": "old"}, {"type": "Resizing", "status": "True"}]),
        );
        let merged = super::conditions_after(&failed, Some(error.clone()));
        assert_eq!(
            types(merged.clone()),
            ["NodeResizeError=True", "Resizing=True"]
        );
        assert_eq!(merged[0]["message"], "old");
        let cleared = claim(json!([{"type": "NodeResizeError", "status": "False"}]));
        assert_eq!(
            super::conditions_after(&cleared, Some(error))[0]["message"],
            "new"
        );
    }

    /// The kubelet's pre-check, row by row (to 2 GiB).
    #[test]
    fn the_node_expands_when_the_resize_controller_asks_it_to() {
        let two = 2 << 30;
        let wait = |s: &str| matches!(s, "wait");
        let rows: Vec<(
            &str,
            k8s_openapi::api::core::v1::PersistentVolumeClaim,
            &str,
        )> = vec![
            (
                "pending",
                claim(&["ReadWriteOnce"], "1Gi", Some("NodeResizePending"), false),
                "expand claimed",
            ),
            (
                "in progress (again after a restart)",
                claim(
                    &["ReadWriteOnce"],
                    "1Gi",
                    Some("NodeResizeInProgress"),
                    false,
                ),
                "expand claimed",
            ),
            (
                "the controller's part still running",
                claim(
                    &["ReadWriteOnce"],
                    "1Gi",
                    Some("ControllerResizeInProgress"),
                    false,
                ),
                "wait",
            ),
            (
                "infeasible: the user must ask again",
                claim(
                    &["ReadWriteOnce"],
                    "1Gi",
                    Some("NodeResizeInfeasible"),
                    false,
                ),
                "wait",
            ),
            (
                "no status yet",
                claim(&["ReadWriteOnce"], "1Gi", None, false),
                "wait",
            ),
            (
                "done by the controller alone",
                claim(&["ReadWriteOnce"], "2Gi", None, false),
                "done",
            ),
            (
                "ReadWriteMany done elsewhere: this node too",
                claim(&["ReadWriteMany"], "2Gi", None, false),
                "expand unclaimed",
            ),
            (
                "ReadWriteMany the claim says needs no node",
                claim(&["ReadWriteMany"], "2Gi", None, true),
                "done",
            ),
        ];
        for (name, c, want) in rows {
            let got = node_resize(&c, two);
            let ok = match (&got, want) {
                (NodeResize::Expand { claimed: true }, "expand claimed") => true,
                (NodeResize::Expand { claimed: false }, "expand unclaimed") => true,
                (NodeResize::Done, "done") => true,
                (NodeResize::Wait(_), w) => wait(w),
                _ => false,
            };
            assert!(ok, "{name}: {got:?}, want {want}");
        }
    }
}
