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
                    let mut used =
                        serde_json::to_value(usages.get(&(uid.clone(), v.name.clone()))?).ok()?;
                    used["name"] = json!(v.name);
                    Some(used)
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
