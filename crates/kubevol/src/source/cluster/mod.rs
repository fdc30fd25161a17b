//! The API server, in cluster mode: the node's pods as a pod source, and the jobs a node does
//! for the cluster, a file each, each handed only the client and what it uses of the manager.
//!
//! - Pods bound to this node (here): one list and watch with the field selector
//!   `spec.nodeName=<node>` (the only pod list the Node authorizer allows a node), resumed
//!   from the last resource version and listed again after `410 Gone`. Each complete listing
//!   replaces the pods the server gave before, so a pod deleted while the watch was down goes
//!   after the re-list.
//! - `objects`: what those pods reference, while a pod needs it. ConfigMaps and Secrets are
//!   watched by name (`metadata.name=<name>`, as the kubelet's watch-based object manager);
//!   PersistentVolumeClaims and the PersistentVolumes they are bound to are read with GET, the
//!   only verb the Node authorizer allows on them; CSIDrivers are listed and watched whole. A
//!   read the server refuses (`403` while its authorizer has not yet learnt that a new pod
//!   references the object) is retried with backoff; the pod's volume waits meanwhile.
//! - `tokens` (TokenRequest), `events` (the event recorder), `node_status`
//!   (`status.volumesInUse`), `csinode` (CSINode and the Node's CSI annotation and labels),
//!   `health` (pods' `status.volumeHealth`, the CSINode's `status.storageHealth`),
//!   `attach` (the attach/detach controller's record), `claims` (claims' statuses during an
//!   expansion), `trust` (ClusterTrustBundles), `certificates` (PodCertificateRequests);
//!   `backoff`, `publish` and `listings` (the count of complete listings) are what they share.
//!
//! Until the pods' first listing is complete the source is not synced, so nothing is torn down;
//! while the server cannot be reached, the source says why in the status and nothing changes.

mod attach;
mod backoff;
mod certificates;
mod claims;
mod connection;
mod credentials;
mod csinode;
mod events;
mod health;
mod lag;
mod listings;
mod node_status;
mod objects;
mod publish;
mod raw;
mod served;
mod tokens;
mod trust;

pub use attach::ControllerAttach;
pub use certificates::ClusterCertificates;
pub use claims::ClusterClaims;
pub use connection::{client, STREAMS_PER_CONNECTION};
pub use csinode::{CsiNodePublisher, NodeDrivers, NODE_ID_ANNOTATION};
pub use events::EventPoster;
pub use listings::Listings;
pub use node_status::{NodeStatusReporter, NodeVolumes};
pub use tokens::ClusterTokens;
pub use trust::ClusterTrustBundles;

use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::watcher::{self, watcher, Event};
use kubevol_core::state::PodExtensions;
use tokio::task::JoinHandle;

use crate::source::cluster::backoff::{refused, AbortOnDrop, WatchBackoff};
use crate::source::cluster::lag::Place;
use crate::source::cluster::objects::{watch_drivers, watch_one, Keep, Referenced};
use crate::source::{BoxFuture, PodSource, Sink};
use crate::store::{normalize_pod, pod_uid_of, Change, Object, ObjectKey};

/// Pods and their objects from the API server.
pub struct ClusterSource {
    client: kube::Client,
    node_name: String,
    listings: Listings,
}

impl ClusterSource {
    /// The source's name in the sync gate and the status.
    pub const NAME: &'static str = crate::store::API_SERVER_SOURCE;

    /// A source of the pods bound to `node_name`, read with `client` (the node's identity).
    pub fn new(client: kube::Client, node_name: impl Into<String>) -> Self {
        ClusterSource {
            client,
            node_name: node_name.into(),
            listings: Listings::default(),
        }
    }

    /// The count of this source's listings, read while it runs.
    pub fn listings(&self) -> Listings {
        self.listings.clone()
    }
}

impl PodSource for ClusterSource {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn start(self: Box<Self>, sink: Sink) -> BoxFuture<()> {
        Box::pin(async move {
            let refs = Arc::new(Referenced::new(
                self.client.clone(),
                sink.clone(),
                self.listings.clone(),
            ));
            let drivers = tokio::spawn(watch_drivers(Api::all(self.client.clone()), sink.clone()));
            let _drivers = AbortOnDrop(drivers);
            // The node's own Node object: its labels are what PersistentVolumes' nodeAffinity
            // is checked against.
            sink.apply([Change::ClusterPending {
                key: ObjectKey::Node(self.node_name.clone()),
                pending: true,
            }]);
            let keep = Keep {
                key: ObjectKey::Node(self.node_name.clone()),
                sink: sink.clone(),
                place: Place::none(),
            };
            let node = tokio::spawn(watch_one(
                Api::<Node>::all(self.client.clone()),
                self.node_name.clone(),
                keep,
                Object::Node,
                self.listings.clone(),
                |_| false,
            ));
            let _node = AbortOnDrop(node);
            // Read untyped, then typed: fields newer than kubevol's API types (a volume's
            // `emptyDir.mode`) are kept as the pod's extensions, as for a manifest.
            let pods: Api<raw::RawPod> = Api::all(self.client.clone());
            let selector = format!("spec.nodeName={}", self.node_name);
            let probe = Probe {
                api: pods.clone(),
                params: kube::api::ListParams::default().fields(&selector).limit(1),
            };
            let config = watcher::Config::default().fields(&selector);
            let mut events = watcher(pods, config).boxed();
            // The watch is read as fast as the server sends, into a queue, and processed
            // beside it: a watcher that falls ten events behind is closed by the server's
            // watch cache ("unresponsive"), which 1,000 pods created at once did seven times.
            // The reader also keeps the backoff: after a failure it waits before the watch is
            // tried again.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let reader = tokio::spawn(async move {
                let mut backoff = WatchBackoff::default();
                // After a failure, the watch tried again says nothing once it is back (a
                // resumed watch is silent until a pod changes): a list of one pod beside it
                // says when the server answers again.
                let mut answering: Option<BoxFuture<()>> = None;
                loop {
                    let event = match answering.as_mut() {
                        None => events.next().await,
                        Some(answered) => tokio::select! {
                            event = events.next() => event,
                            () = answered => {
                                answering = None;
                                if tx.send(Read::Answering).is_err() {
                                    return;
                                }
                                continue;
                            }
                        },
                    };
                    let Some(event) = event else { return };
                    let delay = match &event {
                        Err(e) => Some(backoff.step(refused(e))),
                        Ok(Event::InitDone) => {
                            backoff.reset();
                            None
                        }
                        Ok(_) => None,
                    };
                    if tx.send(Read::Event(event, delay)).is_err() {
                        return;
                    }
                    if let Some(delay) = delay {
                        tokio::time::sleep(delay).await;
                        answering = Some(Box::pin(probe.clone().until_answered()));
                    }
                }
            });
            let _reader = AbortOnDrop(reader);
            let mut listing: Option<Vec<(Pod, PodExtensions)>> = None;
            let mut synced = false;
            let mut queued = Vec::new();
            while rx.recv_many(&mut queued, 256).await > 0 {
                // Changes of the pods are applied together, one batch for what was queued.
                let mut changes = Vec::new();
                for read in queued.drain(..) {
                    let (event, delay) = match read {
                        Read::Event(event, delay) => (event, delay),
                        Read::Answering => {
                            sink.problem(None);
                            continue;
                        }
                    };
                    match event {
                        Ok(Event::Init) => listing = Some(Vec::new()),
                        Ok(Event::InitApply(o)) => {
                            listing.get_or_insert_with(Vec::new).extend(typed_pod(o));
                        }
                        Ok(Event::InitDone) => {
                            self.listings.listed_pods();
                            if !changes.is_empty() {
                                sink.apply(std::mem::take(&mut changes));
                            }
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
                                changes.push(Change::ClusterUpsert(Box::new(pod_object(pod))));
                            }
                            sink.problem(None);
                        }
                        Ok(Event::Delete(o)) => {
                            // Its identity is all that is used: the rest is not read. The pod
                            // goes before what it read: applied now, so that it never lacks an
                            // object it still names.
                            let uid = pod_uid_of(&o.metadata);
                            changes.push(Change::ClusterRemove(ObjectKey::Pod(uid.clone())));
                            sink.apply(std::mem::take(&mut changes));
                            refs.remove_pod(&uid);
                            sink.problem(None);
                        }
                        Err(e) => {
                            let delay = delay.unwrap_or_default();
                            tracing::warn!(
                                source = Self::NAME,
                                "watching this node's pods: {e}; retrying in {delay:.1?}"
                            );
                            sink.problem(Some(format!(
                                "the API server's pods of node {} cannot be watched: {e}; retrying with backoff (nothing is torn down meanwhile)",
                                self.node_name
                            )));
                        }
                    }
                }
                if !changes.is_empty() {
                    sink.apply(changes);
                }
            }
        })
    }
}

/// What the pods' reader hands on: an event of the watch (with the delay before the watch is
/// tried again after a failure), or word that the server answers again after one. (Events are
/// nearly all of it and as large unboxed as they were before: nothing to gain by a box each.)
#[allow(clippy::large_enum_variant)]
enum Read {
    Event(
        Result<Event<raw::RawPod>, watcher::Error>,
        Option<std::time::Duration>,
    ),
    Answering,
}

/// A list of at most one of the node's pods: whether the server answers the node again.
#[derive(Clone)]
struct Probe {
    api: Api<raw::RawPod>,
    params: kube::api::ListParams,
}

impl Probe {
    /// Lists until the server answers, with the watches' backoff between tries; a try
    /// that hangs (a connection the network froze) is given up after ten seconds.
    async fn until_answered(self) {
        const TRY: std::time::Duration = std::time::Duration::from_secs(10);
        let mut backoff = WatchBackoff::default();
        loop {
            let failed = match tokio::time::timeout(TRY, self.api.list_metadata(&self.params)).await
            {
                Ok(Ok(_)) => return,
                Ok(Err(e)) => refused(&watcher::Error::InitialListFailed(e)),
                Err(_) => false,
            };
            tokio::time::sleep(backoff.step(failed)).await;
        }
    }
}

/// Makes `manager` the volume manager of its node (`Config::node_name`) in the cluster
/// `client` reaches with the node's identity, as `kubevol run --kubeconfig` does: pods and
/// their objects from the API server ([`ClusterSource`]), tokens from TokenRequest, trust
/// bundles, pod certificates, controller-managed attach, events, `status.volumesInUse`, CSINode
/// and volume health. Returns the
/// tasks it started: the watches and publishers, which run until aborted (the mounts stay),
/// and last the event poster, which ends once the manager is gone and its queue is posted.
pub fn join(manager: &crate::VolumeManager, client: kube::Client) -> Vec<JoinHandle<()>> {
    let node = manager.config().node_name.clone();
    manager.set_attach_controller(Arc::new(ControllerAttach::new(
        client.clone(),
        node.clone(),
        manager.node_drivers(),
    )));
    manager.set_token_issuer(Arc::new(ClusterTokens::new(client.clone())));
    manager.set_claim_status_writer(Arc::new(ClusterClaims::new(client.clone())));
    manager.set_trust_bundles(Arc::new(ClusterTrustBundles::new(client.clone())));
    manager.set_certificate_requests(Arc::new(ClusterCertificates::new(manager, client.clone())));
    let (events, poster) = EventPoster::spawn(client.clone(), node.clone());
    manager.set_event_sink(events);
    let mut jobs = health::spawn(
        client.clone(),
        node.clone(),
        manager.health(),
        manager.api_server_pods(),
    );
    jobs.extend([
        CsiNodePublisher::spawn(client.clone(), node.clone(), manager.node_drivers()),
        NodeStatusReporter::spawn(client.clone(), node.clone(), Arc::new(manager.clone())),
        manager.add_source(ClusterSource::new(client, node)),
        poster,
    ]);
    jobs
}

/// A pod as the store keeps it (the API server has validated and defaulted it).
fn pod_object((pod, extensions): (Pod, PodExtensions)) -> Object {
    Object::Pod(normalize_pod(pod), extensions)
}

/// The typed pod of an untyped one from the API server, with what its volumes say beyond the
/// types. `None` (logged) if it does not read as a pod.
fn typed_pod(o: raw::RawPod) -> Option<(Pod, PodExtensions)> {
    let name = format!(
        "{}/{}",
        o.metadata.namespace.as_deref().unwrap_or_default(),
        o.metadata.name.as_deref().unwrap_or_default()
    );
    let raw = o.raw;
    // Read from the value in place (a copy of every pod's whole JSON cost half of this), the
    // fields newer than the types found in the same pass.
    let (pod, unknown) = crate::source::unknown::read_tracked::<Pod>(&raw);
    let pod = match pod {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(pod = %name, "the API server's pod does not read as a v1 Pod: {e}; skipped");
            return None;
        }
    };
    let extensions = crate::source::extensions::pod_extensions(&raw, &pod, unknown, &|_| None)
        .unwrap_or_else(|errors| {
            // The server validated the pod: what it accepted is used as the types read it.
            for (_, e) in errors {
                tracing::warn!(pod = %name, "{e}; the field is ignored");
            }
            PodExtensions::default()
        });
    Some((pod, extensions))
}
