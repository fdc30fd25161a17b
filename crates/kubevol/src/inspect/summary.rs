//! `/stats/summary`: the pods' volumes as the kubelet's Summary API reports them
//! (`pods[].volume[]`, read by eviction and metrics-server): each mounted emptyDir's usage as
//! last measured, and the filesystem it is on.

use std::collections::BTreeMap;

use kubevol_core::PodUid;
use serde_json::{json, Value};

use crate::plugins::usage::Used;
use crate::status::StatusReport;

/// The summary of `status`'s pods, with the measures `usages`.
pub fn summary(status: &StatusReport, usages: &BTreeMap<(PodUid, String), Used>) -> Value {
    let pods: Vec<Value> = status
        .pods
        .iter()
        .filter_map(|p| {
            let uid = PodUid::from(p.uid.as_str());
            let volume: Vec<Value> = p
                .volumes
                .iter()
                .filter_map(|v| {
                    let u = usages.get(&(uid.clone(), v.name.clone()))?;
                    let time =
                        u.at.map(|t| jiff::Timestamp::try_from(t).map(|t| t.to_string()))
                            .and_then(Result::ok);
                    Some(json!({
                        "time": time,
                        "name": v.name,
                        "usedBytes": u.used_bytes,
                        "inodesUsed": u.inodes_used,
                        "capacityBytes": u.capacity_bytes,
                        "availableBytes": u.available_bytes,
                        "inodes": u.inodes,
                        "inodesFree": u.inodes_free,
                        "measuredBy": u.by,
                    }))
                })
                .collect();
            (!volume.is_empty()).then(|| {
                json!({
                    "podRef": {"name": p.name, "namespace": p.namespace, "uid": p.uid},
                    "volume": volume,
                })
            })
        })
        .collect();
    json!({"node": {"nodeName": status.node_name}, "pods": pods})
}
