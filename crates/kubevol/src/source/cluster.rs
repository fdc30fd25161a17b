//! The API server as a pod source (cluster mode).
//!
//! - Pods bound to this node: one list and watch with the field selector
//!   `spec.nodeName=<node>` (the only pod list the Node authorizer allows a node), resumed
//!   from the last resource version and listed again after `410 Gone`. Each complete listing
//!   replaces the pods the server gave before, so a pod deleted while the watch was down goes
//!   after the re-list.
//! - The objects those pods reference (ConfigMaps, Secrets, PersistentVolumeClaims and the
//!   PersistentVolumes they are bound to): each watched on its own with the field selector
//!   `metadata.name=<name>` in its namespace, started when the first pod needs it and stopped
//!   when the last one goes, as the kubelet's watch-based object manager. A read the server
//!   refuses (`403` while its authorizer has not yet learnt that a new pod references the
//!   object) is retried with backoff; the pod's volume waits meanwhile, it does not fail.
//! - CSIDrivers: one list and watch of all of them (cluster-scoped, readable by nodes).
//!
//! Until the pods' first listing is complete the source is not synced, so nothing is torn down;
//! while the server cannot be reached, the source says why in the status and nothing changes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Event as CoreEvent, Node, PersistentVolume, PersistentVolumeClaim, Pod, Secret,
    ServiceAccount,
};
use k8s_openapi::api::storage::v1::CSIDriver;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::watcher::{self, watcher, Event};
use kubevol_core::projection::{referenced_objects, ObjectKind};
use kubevol_core::state::PodExtensions;
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;

use super::{BoxFuture, PodSource, Sink};
use crate::observe::events::PodEvent;
use crate::store::{normalize_pod, pod_uid, Change, Object, ObjectKey, DEFAULT_NAMESPACE};
use crate::tokens::{IssuedToken, TokenIssuer, TokenSpec};

/// Pods and their objects from the API server.
pub struct ClusterSource {
    client: kube::Client,
    node_name: String,
}

impl ClusterSource {
    /// The source's name in the sync gate and the status.
    pub const NAME: &'static str = "api-server";

    /// A source of the pods bound to `node_name`, read with `client` (the node's identity).
    pub fn new(client: kube::Client, node_name: impl Into<String>) -> Self {
        ClusterSource {
            client,
            node_name: node_name.into(),
        }
    }
}

impl PodSource for ClusterSource {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn start(self: Box<Self>, sink: Sink) -> BoxFuture<()> {
        Box::pin(async move {
            let refs = Arc::new(Referenced::new(self.client.clone(), sink.clone()));
            let drivers = tokio::spawn(watch_drivers(Api::all(self.client.clone()), sink.clone()));
            let _drivers = AbortOnDrop(drivers);
            // The node's own Node object: its labels are what PersistentVolumes' nodeAffinity
            // is checked against.
            sink.apply([Change::ClusterPending {
                key: ObjectKey::Node(self.node_name.clone()),
                pending: true,
            }]);
            let node = tokio::spawn(watch_one(
                Api::<Node>::all(self.client.clone()),
                self.node_name.clone(),
                ObjectKey::Node(self.node_name.clone()),
                sink.clone(),
                Object::Node,
                |_| {},
            ));
            let _node = AbortOnDrop(node);
            // Read untyped, then typed: fields newer than kubevol's API types (a volume's
            // `emptyDir.mode`) are kept as the pod's extensions, as for a manifest.
            let pods: Api<DynamicObject> =
                Api::all_with(self.client.clone(), &ApiResource::erase::<Pod>(&()));
            let config =
                watcher::Config::default().fields(&format!("spec.nodeName={}", self.node_name));
            let mut events = watcher(pods, config).boxed();
            let mut backoff = WatchBackoff::default();
            let mut listing: Option<Vec<(Pod, PodExtensions)>> = None;
            let mut synced = false;
            while let Some(event) = events.next().await {
                match event {
                    Ok(Event::Init) => listing = Some(Vec::new()),
                    Ok(Event::InitApply(o)) => {
                        listing.get_or_insert_with(Vec::new).extend(typed_pod(o));
                    }
                    Ok(Event::InitDone) => {
                        backoff.reset();
                        let pods = listing.take().unwrap_or_default();
                        let typed: Vec<Pod> = pods.iter().map(|(p, _)| p.clone()).collect();
                        refs.set_pods(&typed);
                        sink.apply([Change::ClusterPods(
                            pods.into_iter().map(pod_object).collect(),
                        )]);
                        if !synced {
                            sink.synced();
                            synced = true;
                        }
                        sink.problem(None);
                    }
                    Ok(Event::Apply(o)) => {
                        if let Some(pod) = typed_pod(o) {
                            refs.add_pod(&pod.0);
                            sink.apply([Change::ClusterUpsert(Box::new(pod_object(pod)))]);
                        }
                        sink.problem(None);
                    }
                    Ok(Event::Delete(o)) => {
                        if let Some((pod, _)) = typed_pod(o) {
                            let uid = pod_uid(&pod);
                            sink.apply([Change::ClusterRemove(ObjectKey::Pod(uid))]);
                            refs.remove_pod(&pod);
                        }
                        sink.problem(None);
                    }
                    Err(e) => {
                        let delay = backoff.step(refused(&e));
                        tracing::warn!(
                            source = Self::NAME,
                            "watching this node's pods: {e}; retrying in {delay:.1?}"
                        );
                        sink.problem(Some(format!(
                            "the API server's pods of node {} cannot be watched: {e}; retrying with backoff (nothing is torn down meanwhile)",
                            self.node_name
                        )));
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        })
    }
}

/// Makes `manager` the volume manager of its node (`Config::node_name`) in the cluster
/// `client` reaches with the node's identity, as `kubevol run --kubeconfig` does: pods and
/// their objects from the API server ([`ClusterSource`]), tokens from TokenRequest, trust
/// bundles, controller-managed attach, events, `status.volumesInUse` and CSINode. Returns the
/// tasks it started: the watches and publishers, which run until aborted (the mounts stay),
/// and last the event poster, which ends once the manager is gone and its queue is posted.
pub fn join(manager: &crate::VolumeManager, client: kube::Client) -> Vec<JoinHandle<()>> {
    let node = manager.config().node_name.clone();
    manager.set_attach_controller(Arc::new(ControllerAttach::new(
        client.clone(),
        node.clone(),
    )));
    manager.set_token_issuer(Arc::new(ClusterTokens::new(client.clone())));
    manager.set_trust_bundles(Arc::new(ClusterTrustBundles::new(client.clone())));
    let (events, poster) = EventPoster::spawn(client.clone(), node.clone());
    manager.set_event_sink(events);
    vec![
        CsiNodePublisher::spawn(client.clone(), node.clone(), Arc::new(manager.clone())),
        NodeStatusReporter::spawn(client.clone(), node.clone(), Arc::new(manager.clone())),
        manager.add_source(ClusterSource::new(client, node)),
        poster,
    ]
}

/// Service account tokens from the API server's TokenRequest, bound to the pod (its name and
/// UID), with the source's audience and lifetime.
pub struct ClusterTokens {
    client: kube::Client,
}

impl ClusterTokens {
    /// An issuer asking the API server `client` reaches (with the node's identity: the server
    /// grants tokens only for pods bound to the node, for their own service account).
    pub fn new(client: kube::Client) -> Self {
        ClusterTokens { client }
    }
}

impl TokenIssuer for ClusterTokens {
    fn issue(&self, spec: TokenSpec) -> BoxFuture<Result<IssuedToken, String>> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &spec.namespace);
        Box::pin(async move {
            let request = TokenRequest {
                spec: TokenRequestSpec {
                    audiences: spec.audience.clone().into_iter().collect(),
                    expiration_seconds: Some(spec.expiration_seconds),
                    bound_object_ref: Some(BoundObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        name: Some(spec.pod_name.clone()),
                        uid: Some(spec.pod_uid.clone()),
                    }),
                },
                ..Default::default()
            };
            let what = format!(
                "a token of service account {}/{} for pod {}",
                spec.namespace, spec.service_account, spec.pod_name
            );
            let answer = api
                .create_token_request(&spec.service_account, &Default::default(), &request)
                .await
                .map_err(|e| format!("the API server did not issue {what}: {e}"))?;
            let status = answer
                .status
                .ok_or_else(|| format!("the API server's answer for {what} has no status"))?;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64);
            let left = status.expiration_timestamp.0.as_second() - now;
            Ok(IssuedToken {
                token: status.token,
                valid_for: Duration::from_secs(left.max(1) as u64),
            })
        })
    }
}

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

/// Keeps what the API server holds of this node in step with a local value: on every change,
/// `read` it and, when it differs from what was last published, `publish` it, retrying with
/// backoff until the server takes it (each failure logged, naming `what`). `publish` gets the
/// value and what its last success returned (starting from `state`).
async fn publish_on_change<T: PartialEq + Clone, S: Clone>(
    mut changes: tokio::sync::watch::Receiver<u64>,
    node: &str,
    what: &str,
    read: impl Fn() -> T,
    mut state: S,
    publish: impl Fn(T, S) -> BoxFuture<Result<S, String>>,
) {
    let mut published: Option<T> = None;
    let mut backoff = WatchBackoff::default();
    loop {
        changes.borrow_and_update();
        let now = read();
        if published.as_ref() != Some(&now) {
            match publish(now.clone(), state.clone()).await {
                Ok(next) => {
                    state = next;
                    published = Some(now);
                    backoff.reset();
                }
                Err(e) => {
                    tracing::warn!(node = %node, "cannot publish {what}: {e}; retrying");
                    tokio::time::sleep(backoff.step(false)).await;
                    continue;
                }
            }
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// What the node status reporter needs of the volume manager.
pub trait NodeVolumes: Send + Sync + 'static {
    /// The attachable and device-mountable volumes the node uses.
    fn volumes_in_use(&self) -> Vec<kubevol_core::UniqueVolumeName>;
    /// Records that the node reported exactly these.
    fn mark_reported(&self, names: &[kubevol_core::UniqueVolumeName]);
    /// Told of every change.
    fn changes(&self) -> tokio::sync::watch::Receiver<u64>;
    /// From now on, attach and stage wait for the volume to be reported.
    fn wait_for_reports(&self);
}

/// Keeps the Node's `status.volumesInUse` equal to the volumes the node uses, in the kubelet's
/// spelling (`kubernetes.io/csi/<driver>^<volumeHandle>`), patched on that field alone (a merge
/// patch of the status subresource: the Node's other fields stay as they are) whenever the set
/// changes. A volume is listed before it is attached or staged (the volume manager waits for
/// the report) and dropped only once it is unstaged and detached, so the attach/detach
/// controller never detaches a volume in use (the kubelet's `MarkVolumesAsReportedInUse`).
pub struct NodeStatusReporter;

impl NodeStatusReporter {
    /// Reports for `volumes` (the volume manager, which from now on waits for the reports) to
    /// the Node `node_name` with `client`.
    pub fn spawn(
        client: kube::Client,
        node_name: impl Into<String>,
        volumes: Arc<dyn NodeVolumes>,
    ) -> JoinHandle<()> {
        let node = node_name.into();
        volumes.wait_for_reports();
        tokio::spawn(async move {
            let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client);
            publish_on_change(
                volumes.changes(),
                &node,
                "the volumes in use in the Node's status",
                || volumes.volumes_in_use(),
                (),
                |now: Vec<kubevol_core::UniqueVolumeName>, ()| {
                    let (nodes, node, volumes) = (nodes.clone(), node.clone(), volumes.clone());
                    Box::pin(async move {
                        let names: Vec<String> = now.iter().map(|n| n.to_string()).collect();
                        let patch = serde_json::json!({"status": {"volumesInUse": names}});
                        nodes
                            .patch_status(
                                &node,
                                &kube::api::PatchParams::default(),
                                &kube::api::Patch::Merge(&patch),
                            )
                            .await
                            .map_err(|e| e.to_string())?;
                        volumes.mark_reported(&now);
                        Ok(())
                    })
                },
            )
            .await;
        })
    }
}

/// The attach/detach controller of a cluster as the volume manager sees it: a volume is
/// attached once its unique name is in the Node's `status.volumesAttached` and its
/// VolumeAttachment says `attached`; the VolumeAttachment's `attachmentMetadata` is the
/// publish context NodeStageVolume gets, as the kubelet's CSI plugin does.
pub struct ControllerAttach {
    client: kube::Client,
    node_name: String,
}

impl ControllerAttach {
    /// Reads the Node `node_name` and VolumeAttachments with `client`.
    pub fn new(client: kube::Client, node_name: impl Into<String>) -> Self {
        ControllerAttach {
            client,
            node_name: node_name.into(),
        }
    }
}

impl crate::plugins::AttachController for ControllerAttach {
    fn attached(
        &self,
        volume: kubevol_core::UniqueVolumeName,
        attachment: String,
    ) -> crate::plugins::BoxFuture<Result<BTreeMap<String, String>, String>> {
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client.clone());
        let attachments: Api<k8s_openapi::api::storage::v1::VolumeAttachment> =
            Api::all(self.client.clone());
        let node = self.node_name.clone();
        Box::pin(async move {
            let n = nodes.get(&node).await.map_err(|e| {
                format!("cannot read Node {node} to see whether volume {volume} is attached: {e}")
            })?;
            let listed = n
                .status
                .and_then(|s| s.volumes_attached)
                .unwrap_or_default()
                .iter()
                .any(|a| a.name == volume.as_str());
            if !listed {
                return Err(format!(
                    "waiting for the attach/detach controller: volume {volume} is not in Node {node}'s status.volumesAttached yet"
                ));
            }
            let va = attachments.get(&attachment).await.map_err(|e| {
                format!("cannot read VolumeAttachment {attachment} of volume {volume}: {e}")
            })?;
            let status = va.status.unwrap_or_default();
            if !status.attached {
                let why = status
                    .attach_error
                    .and_then(|e| e.message)
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default();
                return Err(format!(
                    "waiting for the attach/detach controller: VolumeAttachment {attachment} of volume {volume} is not attached yet{why}"
                ));
            }
            Ok(status.attachment_metadata.unwrap_or_default())
        })
    }
}

/// `clusterTrustBundle` projected sources from the API server's ClusterTrustBundles
/// (`certificates.k8s.io/v1beta1`): the one named, or every one of a signer that the label
/// selector matches (an unset selector matches none, an empty one all), their certificates
/// deduplicated in a stable order. Where the server does not serve the API, the volume says
/// so.
pub struct ClusterTrustBundles {
    client: kube::Client,
}

impl ClusterTrustBundles {
    /// Reads with `client`.
    pub fn new(client: kube::Client) -> Self {
        ClusterTrustBundles { client }
    }
}

/// A label selector in the API's query syntax.
fn selector_query(s: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector) -> String {
    let mut terms: Vec<String> = s
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in s.match_expressions.iter().flatten() {
        let values = e.values.clone().unwrap_or_default().join(",");
        terms.push(match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "DoesNotExist" => format!("!{}", e.key),
            _ => e.key.clone(),
        });
    }
    terms.join(",")
}

/// The certificates of `bundles`, deduplicated, in a stable order, as one PEM bundle.
fn merge_pem<'a>(bundles: impl Iterator<Item = &'a str>) -> String {
    const END: &str = "-----END CERTIFICATE-----";
    let mut certs = BTreeSet::new();
    for b in bundles {
        for part in b.split_inclusive(END) {
            let cert = part.trim();
            if cert.ends_with(END) {
                certs.insert(cert.to_string());
            }
        }
    }
    let mut out = certs.into_iter().collect::<Vec<_>>().join("\n");
    out.push('\n');
    out
}

impl crate::plugins::TrustBundles for ClusterTrustBundles {
    fn bundle(
        &self,
        source: k8s_openapi::api::core::v1::ClusterTrustBundleProjection,
    ) -> crate::plugins::BoxFuture<Result<Option<String>, String>> {
        use k8s_openapi::api::certificates::v1beta1::ClusterTrustBundle;
        let api: Api<ClusterTrustBundle> = Api::all(self.client.clone());
        Box::pin(async move {
            let params = match (&source.name, &source.signer_name) {
                (Some(name), _) => {
                    kube::api::ListParams::default().fields(&format!("metadata.name={name}"))
                }
                (None, Some(signer)) => match &source.label_selector {
                    // An unset selector matches nothing.
                    None => return Ok(None),
                    Some(s) => kube::api::ListParams::default()
                        .fields(&format!("spec.signerName={signer}"))
                        .labels(&selector_query(s)),
                },
                (None, None) => {
                    return Err("names neither a ClusterTrustBundle nor a signer".into())
                }
            };
            let list = api.list(&params).await.map_err(|e| match &e {
                kube::Error::Api(s) if s.code == 404 => "the API server does not serve ClusterTrustBundles (certificates.k8s.io/v1beta1): enable that API on the server, or remove the source".to_string(),
                _ => format!("cannot read ClusterTrustBundles: {e}"),
            })?;
            if list.items.is_empty() {
                return Ok(None);
            }
            Ok(Some(merge_pem(
                list.items.iter().map(|b| b.spec.trust_bundle.as_str()),
            )))
        })
    }
}

/// What the CSINode publisher needs of the volume manager.
pub trait NodeDrivers: Send + Sync + 'static {
    /// The CSI drivers registered on the node.
    fn csi_drivers(&self) -> Vec<crate::csi::DriverStatus>;
    /// Told when a driver registers or goes.
    fn driver_changes(&self) -> tokio::sync::watch::Receiver<u64>;
}

/// What is published of one driver: its name, node ID, topology segments and volume limit.
type Published = (String, String, BTreeMap<String, String>, i64);

/// The Node annotation listing each CSI driver's node ID, as JSON.
pub const NODE_ID_ANNOTATION: &str = "csi.volume.kubernetes.io/nodeid";

/// Keeps the CSINode object named after the node, and the Node's CSI annotation and topology
/// labels, in step with the CSI drivers registered on the node, as the kubelet's CSI plugin
/// does: each driver's entry has its name, node ID, topology keys and allocatable volume count
/// (from NodeGetInfo); the Node gets `csi.volume.kubernetes.io/nodeid` (driver → node ID) and
/// the drivers' topology segments as labels. A driver that goes is removed from both.
pub struct CsiNodePublisher;

impl CsiNodePublisher {
    /// Publishes `drivers` for node `node_name` with `client`.
    pub fn spawn(
        client: kube::Client,
        node_name: impl Into<String>,
        drivers: Arc<dyn NodeDrivers>,
    ) -> JoinHandle<()> {
        let node = node_name.into();
        tokio::spawn(async move {
            publish_on_change(
                drivers.driver_changes(),
                &node,
                "the CSI drivers in CSINode and the Node",
                || -> Vec<Published> {
                    drivers
                        .csi_drivers()
                        .into_iter()
                        .map(|d| (d.name, d.node_id, d.topology, d.max_volumes_per_node))
                        .collect()
                },
                // What the previous publication labelled the Node with, to remove what goes.
                BTreeSet::new(),
                |now: Vec<Published>, labelled: BTreeSet<String>| {
                    let (client, node) = (client.clone(), node.clone());
                    Box::pin(async move { Self::publish(&client, &node, &now, &labelled).await })
                },
            )
            .await;
        })
    }

    /// Writes the CSINode and patches the Node; returns the topology labels now set.
    async fn publish(
        client: &kube::Client,
        node: &str,
        drivers: &[Published],
        labelled: &BTreeSet<String>,
    ) -> Result<BTreeSet<String>, String> {
        use k8s_openapi::api::storage::v1::{
            CSINode, CSINodeDriver, CSINodeSpec, VolumeNodeResources,
        };
        let entries: Vec<CSINodeDriver> = drivers
            .iter()
            .map(|(name, id, topology, max)| CSINodeDriver {
                name: name.clone(),
                node_id: id.clone(),
                topology_keys: Some(topology.keys().cloned().collect()),
                allocatable: (*max > 0).then(|| VolumeNodeResources {
                    count: i32::try_from(*max).ok(),
                }),
            })
            .collect();
        let csinodes: Api<CSINode> = Api::all(client.clone());
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
        // Owned by the Node, so it goes with it: nothing is published before the Node exists
        // (as the kubelet does), or a CSINode made meanwhile would have no owner.
        let uid = nodes
            .get_opt(node)
            .await
            .map_err(|e| e.to_string())?
            .and_then(|n| n.metadata.uid)
            .ok_or_else(|| format!("the Node {node} does not exist yet (whoever runs the node creates it, or --register-node)"))?;
        let owner = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.into(),
                uid,
                ..Default::default()
            },
        ]);
        match csinodes.get_opt(node).await.map_err(|e| e.to_string())? {
            Some(mut current) => {
                current.spec = CSINodeSpec { drivers: entries };
                if current
                    .metadata
                    .owner_references
                    .as_ref()
                    .is_none_or(Vec::is_empty)
                {
                    current.metadata.owner_references = owner;
                }
                csinodes
                    .replace(node, &Default::default(), &current)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            None => {
                let object = CSINode {
                    metadata: kube::api::ObjectMeta {
                        name: Some(node.into()),
                        owner_references: owner,
                        ..Default::default()
                    },
                    spec: CSINodeSpec { drivers: entries },
                };
                csinodes
                    .create(&Default::default(), &object)
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        let ids: BTreeMap<&str, &str> = drivers
            .iter()
            .map(|(n, id, _, _)| (n.as_str(), id.as_str()))
            .collect();
        let mut labels = serde_json::Map::new();
        let mut now = BTreeSet::new();
        for (_, _, topology, _) in drivers {
            for (k, v) in topology {
                labels.insert(k.clone(), serde_json::json!(v));
                now.insert(k.clone());
            }
        }
        for gone in labelled.difference(&now) {
            labels.insert(gone.clone(), serde_json::Value::Null);
        }
        let annotation = if ids.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::json!(serde_json::to_string(&ids).unwrap_or_default())
        };
        let patch = serde_json::json!({"metadata": {"annotations": {NODE_ID_ANNOTATION: annotation}, "labels": labels}});
        nodes
            .patch(
                node,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .map_err(|e| e.to_string())?;
        Ok(now)
    }
}

/// The retry delays of the watches, reads and publishers: 0.5 s, doubling up to 8 s while the
/// server cannot be reached (a node whose API server is back should learn of the pods deleted
/// meanwhile soon), and up to 30 s while it refuses (a forbidden or failing request is not
/// made better by asking again soon: client-go's reflectors wait up to 30 s), with ±25 %
/// jitter so that many nodes do not retry in step against a recovering server. Reset only by a
/// success: a watch's complete listing, a read, a publication (kube-runtime's own backoff is
/// reset by the `Init` event that comes before every list, so it never grew).
struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const FIRST: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(8);
    const MAX_REFUSED: Duration = Duration::from_secs(30);

    /// The delay before the next try, after a failure (`refused`: the server answered with
    /// an error, rather than not at all).
    fn step(&mut self, refused: bool) -> Duration {
        let cap = if refused {
            Self::MAX_REFUSED
        } else {
            Self::MAX
        };
        let base = self.next.min(cap);
        self.next = (base * 2).min(cap);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        // A factor in [0.75, 1.25).
        let factor = 0.75 + f64::from(nanos % 1000) / 2000.0;
        base.mul_f64(factor)
    }

    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff { next: Self::FIRST }
    }
}

/// Whether a watch's failure is the server's answer (refused, or an error status), rather
/// than the server not being reached.
fn refused(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => api_refused(e),
        watcher::Error::WatchError(_) | watcher::Error::NoResourceVersion => true,
    }
}

/// Whether a request's failure is the server's answer rather than the server not reached.
fn api_refused(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(_))
}

/// A pod as the store keeps it (the API server has validated and defaulted it).
fn pod_object((pod, extensions): (Pod, PodExtensions)) -> Object {
    Object::Pod(normalize_pod(pod), extensions)
}

/// The typed pod of an untyped one from the API server, with what its volumes say beyond the
/// types. `None` (logged) if it does not read as a pod.
fn typed_pod(o: DynamicObject) -> Option<(Pod, PodExtensions)> {
    let name = format!(
        "{}/{}",
        o.metadata.namespace.as_deref().unwrap_or_default(),
        o.metadata.name.as_deref().unwrap_or_default()
    );
    let raw = serde_json::to_value(&o).ok()?;
    let pod: Pod = match serde_json::from_value(raw.clone()) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(pod = %name, "the API server's pod does not read as a v1 Pod: {e}; skipped");
            return None;
        }
    };
    let extensions = crate::source::extensions::pod_extensions(raw.pointer("/spec/volumes"), &pod)
        .unwrap_or_else(|errors| {
            // The server validated the pod: what it accepted is used as the types read it.
            for (_, e) in errors {
                tracing::warn!(pod = %name, "{e}; the field is ignored");
            }
            PodExtensions::default()
        });
    Some((pod, extensions))
}

/// A task aborted when this is dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One object a pod references, by kind, namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ref {
    ConfigMap(String, String),
    Secret(String, String),
    Claim(String, String),
    Volume(String),
}

impl Ref {
    fn key(&self) -> ObjectKey {
        match self {
            Ref::ConfigMap(ns, n) => ObjectKey::ConfigMap((ns.clone(), n.clone())),
            Ref::Secret(ns, n) => ObjectKey::Secret((ns.clone(), n.clone())),
            Ref::Claim(ns, n) => ObjectKey::PersistentVolumeClaim((ns.clone(), n.clone())),
            Ref::Volume(n) => ObjectKey::PersistentVolume(n.clone()),
        }
    }
}

/// The objects a pod's volumes reference (a claim's PersistentVolume is found once the claim
/// is read).
fn refs_of(pod: &Pod) -> BTreeSet<Ref> {
    let ns = pod
        .metadata
        .namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| DEFAULT_NAMESPACE.into());
    let mut out = BTreeSet::new();
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        for r in referenced_objects(pod, v) {
            out.insert(match r.kind {
                ObjectKind::ConfigMap => Ref::ConfigMap(r.namespace, r.name),
                ObjectKind::Secret => Ref::Secret(r.namespace, r.name),
            });
        }
        if let Some(c) = &v.persistent_volume_claim {
            out.insert(Ref::Claim(ns.clone(), c.claim_name.clone()));
        }
        if let Some(s) = v
            .csi
            .as_ref()
            .and_then(|c| c.node_publish_secret_ref.as_ref())
        {
            out.insert(Ref::Secret(ns.clone(), s.name.clone()));
        }
    }
    out
}

/// The watches of referenced objects, counted by who needs them: pods, and claims (for the
/// PersistentVolume they are bound to).
struct Referenced {
    client: kube::Client,
    sink: Sink,
    state: Mutex<RefState>,
}

#[derive(Default)]
struct RefState {
    /// Each pod's references, by pod UID.
    pods: BTreeMap<String, BTreeSet<Ref>>,
    /// Each claim's PersistentVolume.
    claims: BTreeMap<Ref, String>,
    /// The watch or reader of each referenced object, how many hold it, and (a reader) what
    /// makes it read again at once.
    watches: BTreeMap<Ref, Held>,
}

/// A referenced object's watch or reader.
struct Held {
    holders: usize,
    _task: AbortOnDrop,
    /// A reader's nudge: a new holder wants the object as it is now, not as last read.
    reread: Option<Arc<tokio::sync::Notify>>,
}

impl Referenced {
    fn new(client: kube::Client, sink: Sink) -> Self {
        Referenced {
            client,
            sink,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RefState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The complete set of pods (a listing): pods not in it are forgotten.
    fn set_pods(self: &Arc<Self>, pods: &[Pod]) {
        let listed: BTreeSet<String> = pods.iter().map(|p| pod_uid(p).to_string()).collect();
        let gone: Vec<String> = self
            .lock()
            .pods
            .keys()
            .filter(|k| !listed.contains(*k))
            .cloned()
            .collect();
        for uid in gone {
            self.set(&uid, BTreeSet::new());
        }
        for p in pods {
            self.add_pod(p);
        }
    }

    fn add_pod(self: &Arc<Self>, pod: &Pod) {
        self.set(pod_uid(pod).as_str(), refs_of(pod));
    }

    fn remove_pod(self: &Arc<Self>, pod: &Pod) {
        self.set(pod_uid(pod).as_str(), BTreeSet::new());
    }

    fn set(self: &Arc<Self>, uid: &str, refs: BTreeSet<Ref>) {
        let mut st = self.lock();
        let old = if refs.is_empty() {
            st.pods.remove(uid).unwrap_or_default()
        } else {
            st.pods
                .insert(uid.to_string(), refs.clone())
                .unwrap_or_default()
        };
        for r in refs.difference(&old) {
            self.hold(&mut st, r.clone());
        }
        for r in old.difference(&refs) {
            self.release(&mut st, r);
        }
    }

    fn hold(self: &Arc<Self>, st: &mut RefState, r: Ref) {
        if let Some(held) = st.watches.get_mut(&r) {
            held.holders += 1;
            if let Some(reread) = &held.reread {
                reread.notify_one();
            }
            return;
        }
        // What reads it waits until the watch has listed it, or the reader read it.
        self.sink.apply([Change::ClusterPending {
            key: r.key(),
            pending: true,
        }]);
        let (task, reread) = self.start_watch(&r);
        st.watches.insert(
            r,
            Held {
                holders: 1,
                _task: AbortOnDrop(task),
                reread,
            },
        );
    }

    fn release(self: &Arc<Self>, st: &mut RefState, r: &Ref) {
        let Some(held) = st.watches.get_mut(r) else {
            return;
        };
        held.holders -= 1;
        if held.holders > 0 {
            return;
        }
        // The last holder is gone: the watch stops and the object leaves the store.
        st.watches.remove(r);
        if let Some(pv) = st.claims.remove(r) {
            self.release(st, &Ref::Volume(pv));
        }
        self.sink.apply([
            Change::ClusterRemove(r.key()),
            Change::ClusterPending {
                key: r.key(),
                pending: false,
            },
        ]);
    }

    /// A claim's PersistentVolume is now `pv` (or none): its watch follows.
    fn claim_bound(self: &Arc<Self>, claim: &Ref, pv: Option<String>) {
        let mut st = self.lock();
        if !st.watches.contains_key(claim) {
            return;
        }
        let old = st.claims.get(claim).cloned();
        if old == pv {
            return;
        }
        match &pv {
            Some(n) => {
                st.claims.insert(claim.clone(), n.clone());
                self.hold(&mut st, Ref::Volume(n.clone()));
            }
            None => {
                st.claims.remove(claim);
            }
        }
        if let Some(o) = old {
            self.release(&mut st, &Ref::Volume(o));
        }
    }

    /// Starts keeping the store's copy of `r`: ConfigMaps and Secrets are watched by name
    /// (the Node authorizer lets a node list and watch those its pods reference); claims and
    /// PersistentVolumes are read with GET (all it lets a node do with them), with the nudge
    /// that makes the reader read again at once.
    fn start_watch(
        self: &Arc<Self>,
        r: &Ref,
    ) -> (JoinHandle<()>, Option<Arc<tokio::sync::Notify>>) {
        let (client, sink) = (self.client.clone(), self.sink.clone());
        let me = Arc::downgrade(self);
        let reread = Arc::new(tokio::sync::Notify::new());
        let task = match r.clone() {
            Ref::ConfigMap(ns, n) => {
                let api = Api::<ConfigMap>::namespaced(client, &ns);
                return (
                    tokio::spawn(watch_one(api, n, r.key(), sink, Object::ConfigMap, |_| {})),
                    None,
                );
            }
            Ref::Secret(ns, n) => {
                let api = Api::<Secret>::namespaced(client, &ns);
                return (
                    tokio::spawn(watch_one(api, n, r.key(), sink, Object::Secret, |_| {})),
                    None,
                );
            }
            Ref::Volume(n) => tokio::spawn(read_one(
                Api::<PersistentVolume>::all(client),
                n,
                r.key(),
                sink,
                reread.clone(),
                Object::PersistentVolume,
                |_| {},
                |_| true,
            )),
            Ref::Claim(ns, n) => {
                let claim = r.clone();
                tokio::spawn(read_one(
                    Api::<PersistentVolumeClaim>::namespaced(client, &ns),
                    n,
                    r.key(),
                    sink,
                    reread.clone(),
                    Object::PersistentVolumeClaim,
                    move |c: Option<&PersistentVolumeClaim>| {
                        let pv = c
                            .and_then(|c| c.spec.as_ref())
                            .and_then(|s| s.volume_name.clone())
                            .filter(|n| !n.is_empty());
                        if let Some(me) = me.upgrade() {
                            me.claim_bound(&claim, pv);
                        }
                    },
                    |c| {
                        c.spec
                            .as_ref()
                            .and_then(|s| s.volume_name.as_deref())
                            .is_some_and(|n| !n.is_empty())
                            && c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                    },
                ))
            }
        };
        (task, Some(reread))
    }
}

/// How often an object read with GET is read again once it is settled (a claim bound, a
/// PersistentVolume there): a resize or a rebinding is noticed within this, the kubelet's
/// volume-stats period.
const REREAD: Duration = Duration::from_secs(60);

/// Reads one object by name with GET, as the kubelet reads claims and PersistentVolumes, and
/// keeps the store's copy of it; `seen` is told of each reading (or of its absence). It is
/// read at once, again after a backoff step while it is missing, refused, unreachable or not
/// yet `settled` (a claim the controller has not bound), every [`REREAD`] once it is, and at
/// once when `reread` is notified (a new pod needs it). A missing object is marked absent, so
/// that what needs it says so and is looked at again at each reading.
#[allow(clippy::too_many_arguments)]
async fn read_one<K>(
    api: Api<K>,
    name: String,
    key: ObjectKey,
    sink: Sink,
    reread: Arc<tokio::sync::Notify>,
    object: fn(K) -> Object,
    seen: impl Fn(Option<&K>) + Send + 'static,
    settled: fn(&K) -> bool,
) where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let mut backoff = WatchBackoff::default();
    loop {
        let wait = match api.get_opt(&name).await {
            Ok(Some(o)) => {
                let done = settled(&o);
                seen(Some(&o));
                sink.apply([
                    Change::ClusterUpsert(Box::new(object(o))),
                    Change::ClusterPending {
                        key: key.clone(),
                        pending: false,
                    },
                ]);
                if done {
                    backoff.reset();
                    REREAD
                } else {
                    backoff.step(false)
                }
            }
            Ok(None) => {
                seen(None);
                sink.apply([
                    Change::ClusterAbsent(key.clone()),
                    Change::ClusterPending {
                        key: key.clone(),
                        pending: false,
                    },
                ]);
                backoff.step(false)
            }
            // Refused (the authorizer has not learnt that a pod of the node needs it yet) or
            // unreachable: what the store has stays, and the reader tries again.
            Err(e) => {
                let delay = backoff.step(api_refused(&e));
                tracing::debug!(object = ?key, "read: {e}; reading again in {delay:.1?}");
                delay
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = reread.notified() => {}
        }
    }
}

/// Watches one object by name and keeps the store's copy of it; `seen` is told of each new
/// version (or of its absence).
async fn watch_one<K>(
    api: Api<K>,
    name: String,
    key: ObjectKey,
    sink: Sink,
    object: fn(K) -> Object,
    seen: impl Fn(Option<&K>) + Send + 'static,
) where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher(api, config).boxed();
    let mut backoff = WatchBackoff::default();
    let mut listed = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => listed = false,
            Ok(Event::InitApply(o) | Event::Apply(o)) => {
                listed = true;
                seen(Some(&o));
                sink.apply([Change::ClusterUpsert(Box::new(object(o)))]);
            }
            Ok(Event::InitDone) => {
                backoff.reset();
                if !listed {
                    seen(None);
                    sink.apply([Change::ClusterRemove(key.clone())]);
                }
                sink.apply([Change::ClusterPending {
                    key: key.clone(),
                    pending: false,
                }]);
            }
            Ok(Event::Delete(_)) => {
                seen(None);
                sink.apply([Change::ClusterRemove(key.clone())]);
            }
            // Refused (the authorizer has not learnt the relationship yet) or unreachable: the
            // watch is tried again after a backoff, and what the store has stays.
            Err(e) => {
                let delay = backoff.step(refused(&e));
                tracing::debug!(object = ?key, "watch: {e}; retrying in {delay:.1?}");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Lists and watches every CSIDriver (the one cluster-scoped kind read whole).
async fn watch_drivers(api: Api<CSIDriver>, sink: Sink) {
    let object = Object::CSIDriver;
    let mut events = watcher(api, watcher::Config::default()).boxed();
    let mut backoff = WatchBackoff::default();
    let mut listing: BTreeSet<String> = BTreeSet::new();
    let mut known: BTreeSet<String> = BTreeSet::new();
    let key_of = |o: &CSIDriver| ObjectKey::CSIDriver(o.metadata.name.clone().unwrap_or_default());
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => listing.clear(),
            Ok(Event::InitApply(o)) => {
                listing.insert(o.metadata.name.clone().unwrap_or_default());
                sink.apply([Change::ClusterUpsert(Box::new(object(o)))]);
            }
            Ok(Event::InitDone) => {
                backoff.reset();
                let gone: Vec<Change> = known
                    .difference(&listing)
                    .map(|n| Change::ClusterRemove(ObjectKey::CSIDriver(n.clone())))
                    .collect();
                sink.apply(gone);
                known = std::mem::take(&mut listing);
            }
            Ok(Event::Apply(o)) => {
                known.insert(o.metadata.name.clone().unwrap_or_default());
                sink.apply([Change::ClusterUpsert(Box::new(object(o)))]);
            }
            Ok(Event::Delete(o)) => {
                known.remove(o.metadata.name.as_deref().unwrap_or_default());
                sink.apply([Change::ClusterRemove(key_of(&o))]);
            }
            Err(e) => {
                let delay = backoff.step(refused(&e));
                tracing::debug!("watching CSIDrivers: {e}; retrying in {delay:.1?}");
                tokio::time::sleep(delay).await;
            }
        }
    }
}
