//! What CSI drivers report of volumes' and storage's health, written where the kubelet writes
//! it (Kubernetes 1.37, alpha `CSIVolumeHealth`): each pod's `status.volumeHealth` and the
//! CSINode's `status.storageHealth`. A server without the feature drops the pod field and
//! refuses the CSINode subresource; kubevol then keeps the health to itself (status, describe,
//! events, metrics) and says so once.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::{Api, Patch, PatchParams};
use kubevol_core::PodUid;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use crate::report::health::{rfc3339, Condition, Health};
use crate::source::cluster::publish::publish_on_change;

fn conditions_json(conditions: &[Condition]) -> Vec<Value> {
    conditions
        .iter()
        .map(|c| {
            let mut v = json!({"status": c.status, "reason": c.reason});
            if !c.message.is_empty() {
                v["message"] = json!(c.message);
            }
            if let Some(m) = &c.access_mode {
                v["accessMode"] = json!(m);
            }
            if let Some(m) = &c.volume_mode {
                v["volumeMode"] = json!(m);
            }
            if c.since > 0 {
                v["lastTransitionTime"] = json!(rfc3339(c.since));
            }
            v
        })
        .collect()
}

/// One pod's `status.volumeHealth`, with where to write it.
#[derive(Clone, PartialEq)]
struct PodHealth {
    namespace: String,
    name: String,
    volume_health: Value,
}

/// Writes `health` to the API server with `client`: the pods' volume health (pods that
/// `from_server` says the server gave; a static pod's mirror is not its own) and node
/// `node`'s CSINode storage health, each whenever it changes.
pub fn spawn(
    client: kube::Client,
    node: String,
    health: Arc<Health>,
    from_server: Arc<dyn Fn(&PodUid) -> bool + Send + Sync>,
) -> Vec<JoinHandle<()>> {
    let pods = {
        let (client, node, health) = (client.clone(), node.clone(), health.clone());
        tokio::spawn(async move {
            let read = || -> BTreeMap<PodUid, PodHealth> {
                health
                    .pods()
                    .into_iter()
                    .filter(|(uid, _)| from_server(uid))
                    .map(|(uid, (pod, volumes))| {
                        let list: Vec<Value> = volumes
                            .iter()
                            .map(|(name, h)| {
                                json!({
                                    "name": name,
                                    "healthConditions": conditions_json(&h.conditions),
                                    "lastTransitionTime": rfc3339(h.since),
                                })
                            })
                            .collect();
                        let entry = PodHealth {
                            namespace: pod.namespace.to_string(),
                            name: pod.name.to_string(),
                            volume_health: Value::Array(list),
                        };
                        (uid, entry)
                    })
                    .collect()
            };
            publish_on_change(
                health.subscribe(),
                &node,
                "pods' volume health",
                read,
                BTreeMap::new(),
                move |now: BTreeMap<PodUid, PodHealth>, before: BTreeMap<PodUid, PodHealth>| {
                    let client = client.clone();
                    Box::pin(async move {
                        for (uid, h) in &now {
                            if before.get(uid) == Some(h) {
                                continue;
                            }
                            let api: Api<Pod> = Api::namespaced(client.clone(), &h.namespace);
                            // The UID makes the patch fail on another pod of the same name.
                            let patch = json!({
                                "metadata": {"uid": uid.as_str()},
                                "status": {"volumeHealth": h.volume_health},
                            });
                            match api
                                .patch_status(
                                    &h.name,
                                    &PatchParams::default(),
                                    &Patch::Merge(&patch),
                                )
                                .await
                            {
                                Ok(_) => {}
                                // Gone, or replaced by a pod of the same name: nothing to say.
                                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 422 => {}
                                Err(e) => {
                                    return Err(format!(
                                        "the status of pod {}/{}: {e}",
                                        h.namespace, h.name
                                    ))
                                }
                            }
                        }
                        Ok(now)
                    })
                },
            )
            .await;
        })
    };
    let storage = tokio::spawn(async move {
        let csinodes: Api<CSINode> = Api::all(client);
        let said = Arc::new(std::sync::atomic::AtomicBool::new(false));
        publish_on_change(
            health.subscribe(),
            &node.clone(),
            "the CSINode's storage health",
            || health.storage(),
            (),
            move |now: BTreeMap<String, Vec<Condition>>, ()| {
                let (csinodes, node, said) = (csinodes.clone(), node.clone(), said.clone());
                Box::pin(async move {
                    let list: Vec<Value> = now
                        .iter()
                        .map(|(driver, c)| json!({"name": driver, "healthConditions": conditions_json(c)}))
                        .collect();
                    let patch = json!({"status": {"storageHealth": list}});
                    match csinodes
                        .patch_status(&node, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => Ok(()),
                        // Not yet made (the CSINode publisher makes it): tried again.
                        Err(kube::Error::Api(s)) if s.code == 404 => {
                            Err(format!("CSINode {node} is not there yet"))
                        }
                        // Refused: the server does not serve it (CSIVolumeHealth off).
                        Err(kube::Error::Api(s)) if s.code == 403 => {
                            if !said.swap(true, std::sync::atomic::Ordering::Relaxed) {
                                tracing::info!(node = %node, "the API server does not take the CSINode's status (its CSIVolumeHealth feature is off): storage health is shown by kubevol only: {}", s.message);
                            }
                            Ok(())
                        }
                        Err(e) => Err(e.to_string()),
                    }
                })
            },
        )
        .await;
    });
    vec![pods, storage]
}
