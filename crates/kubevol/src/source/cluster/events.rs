//! Pod events posted to the API server, folded and rate-limited as the kubelet's recorder does.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Event as CoreEvent;
use kube::api::Api;
use tokio::task::JoinHandle;

use crate::report::events::PodEvent;

/// Posts pod events to the API server as the kubelet's event recorder does: on the pod
/// (`involvedObject`), from component `kubevol` on the node; a repeat of the same type, reason
/// and message for a pod bumps the count of its Event (a merge patch) instead of creating
/// another, and each pod may post a burst of 25 events, then one every 5 minutes (client-go's
/// spam filter), so a failing volume cannot flood the server.
pub struct EventPoster;

/// What repeats of an event have in common: (pod UID, warning, reason, message). Each is
/// posted once, as (namespace, Event name, count).
type Folded = (String, bool, String, String);

/// A pod's event budget.
struct Budget {
    tokens: f64,
    at: std::time::Instant,
}

impl EventPoster {
    const BURST: f64 = 25.0;
    const REFILL_EVERY: Duration = Duration::from_secs(300);
    /// How many distinct events are remembered for folding repeats.
    const REMEMBERED: usize = 4096;

    /// Starts posting with `client` as node `node_name`; returns the queue to hand to
    /// [`VolumeManager::set_event_sink`](crate::VolumeManager::set_event_sink), and the
    /// poster's task, which ends once every sender is gone and what was queued is posted.
    pub fn spawn(
        client: kube::Client,
        node_name: impl Into<String>,
    ) -> (tokio::sync::mpsc::Sender<PodEvent>, JoinHandle<()>) {
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        let task = tokio::spawn(Self::run(client, node_name.into(), rx));
        (tx, task)
    }

    async fn run(
        client: kube::Client,
        node: String,
        mut rx: tokio::sync::mpsc::Receiver<PodEvent>,
    ) {
        let mut posted: BTreeMap<Folded, (String, String, i32)> = BTreeMap::new();
        let mut order: std::collections::VecDeque<Folded> = Default::default();
        let mut budgets: BTreeMap<String, Budget> = BTreeMap::new();
        while let Some(ev) = rx.recv().await {
            let uid = ev.pod.uid.to_string();
            let now = std::time::Instant::now();
            if budgets.len() > Self::REMEMBERED {
                // Budgets that have refilled completely are as good as new.
                let full = Self::REFILL_EVERY.mul_f64(Self::BURST);
                budgets.retain(|_, b| now.duration_since(b.at) < full);
            }
            let budget = budgets.entry(uid.clone()).or_insert(Budget {
                tokens: Self::BURST,
                at: now,
            });
            budget.tokens = (budget.tokens
                + now.duration_since(budget.at).as_secs_f64() / Self::REFILL_EVERY.as_secs_f64())
            .min(Self::BURST);
            budget.at = now;
            if budget.tokens < 1.0 {
                tracing::debug!(pod = %ev.pod, reason = %ev.reason, "event not posted: the pod's event budget is spent");
                continue;
            }
            budget.tokens -= 1.0;
            let stamp = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            );
            let key = (
                uid.clone(),
                ev.warning,
                ev.reason.to_string(),
                ev.message.clone(),
            );
            let api = |ns: &str| Api::<CoreEvent>::namespaced(client.clone(), ns);
            if let Some((ns, name, count)) = posted.get_mut(&key) {
                let patch = serde_json::json!({"count": *count + 1, "lastTimestamp": stamp});
                match api(ns)
                    .patch(
                        name,
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(&patch),
                    )
                    .await
                {
                    Ok(_) => {
                        *count += 1;
                        continue;
                    }
                    Err(e) => {
                        tracing::debug!("cannot bump event {ns}/{name}: {e}; posting a new one")
                    }
                }
            }
            let ns = ev.pod.namespace.to_string();
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let name = format!("{}.{nanos:x}", ev.pod.name);
            let event = CoreEvent {
                metadata: kube::api::ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(ns.clone()),
                    ..Default::default()
                },
                involved_object: k8s_openapi::api::core::v1::ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(ev.pod.name.to_string()),
                    namespace: Some(ns.clone()),
                    uid: Some(uid.clone()),
                    ..Default::default()
                },
                reason: Some(ev.reason.to_string()),
                message: Some(ev.message.clone()),
                type_: Some(if ev.warning { "Warning" } else { "Normal" }.into()),
                count: Some(1),
                first_timestamp: Some(stamp.clone()),
                last_timestamp: Some(stamp),
                source: Some(k8s_openapi::api::core::v1::EventSource {
                    component: Some("kubevol".into()),
                    host: Some(node.clone()),
                }),
                reporting_component: Some("kubevol".into()),
                reporting_instance: Some(node.clone()),
                ..Default::default()
            };
            match api(&ns).create(&Default::default(), &event).await {
                Ok(_) => {
                    posted.insert(key.clone(), (ns, name, 1));
                    order.push_back(key);
                    while order.len() > Self::REMEMBERED {
                        if let Some(old) = order.pop_front() {
                            posted.remove(&old);
                        }
                    }
                }
                Err(e) => tracing::debug!(pod = %ev.pod, "cannot post event: {e}"),
            }
        }
    }
}
