//! The objects the node's pods reference: ConfigMaps and Secrets watched by name, claims and
//! PersistentVolumes read with GET (all the Node authorizer lets a node do with them),
//! CSIDrivers listed and watched whole; each kept while a pod needs it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::storage::v1::CSIDriver;
use kube::api::Api;
use kube::runtime::watcher::{self, watcher, Event};
use kubevol_core::projection::{referenced_objects, ObjectKind};
use kubevol_core::PodUid;
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;

use crate::source::cluster::backoff::{
    forbidden, object_refused, object_watch_refused, refused, watch_forbidden, AbortOnDrop,
    WatchBackoff,
};
use crate::source::cluster::lag::{Lag, Place};
use crate::source::cluster::listings::Listings;
use crate::store::{
    claim_bound, claim_volume, pod_uid, Change, Object, ObjectKey, Sink, DEFAULT_NAMESPACE,
};

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
        let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
        if let Some(c) = kubevol_core::names::claim_name(pod_name, v) {
            out.insert(Ref::Claim(ns.clone(), c.into_owned()));
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
pub(super) struct Referenced {
    client: kube::Client,
    sink: Sink,
    listings: Listings,
    state: Mutex<RefState>,
    /// The order the node saw its pods in, and the reads the authorizer's lag holds.
    lag: Arc<Lag>,
}

#[derive(Default)]
struct RefState {
    /// Each pod's references and place in the order the node saw the pods, by pod UID.
    pods: BTreeMap<String, (BTreeSet<Ref>, u64)>,
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
    pub(super) fn new(client: kube::Client, sink: Sink, listings: Listings) -> Self {
        Referenced {
            client,
            sink,
            listings,
            state: Mutex::default(),
            lag: Arc::new(Lag::one_at_a_time()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RefState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The complete set of pods (a listing): pods not in it are forgotten.
    pub(super) fn set_pods(self: &Arc<Self>, pods: &[Pod]) {
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

    pub(super) fn add_pod(self: &Arc<Self>, pod: &Pod) {
        self.set(pod_uid(pod).as_str(), refs_of(pod));
    }

    pub(super) fn remove_pod(self: &Arc<Self>, uid: &PodUid) {
        self.set(uid.as_str(), BTreeSet::new());
    }

    fn set(self: &Arc<Self>, uid: &str, refs: BTreeSet<Ref>) {
        let mut st = self.lock();
        let (old, place) = match (refs.is_empty(), st.pods.remove(uid)) {
            (true, old) => (old.map(|(r, _)| r).unwrap_or_default(), 0),
            (false, Some((old, place))) => (old, place),
            (false, None) => (BTreeSet::new(), self.lag.seen()),
        };
        if !refs.is_empty() {
            st.pods.insert(uid.to_string(), (refs.clone(), place));
        }
        for r in refs.difference(&old) {
            self.hold(&mut st, r.clone(), Place::of(&self.lag, place));
        }
        for r in old.difference(&refs) {
            self.release(&mut st, r);
        }
    }

    /// Holds `r` for a pod (at `place` in the authorizer's order) or a claim.
    fn hold(self: &Arc<Self>, st: &mut RefState, r: Ref, place: Place) {
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
        let (task, reread) = self.start_watch(&r, place);
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
                // Related to the node through its claim, not in the pods' order.
                self.hold(&mut st, Ref::Volume(n.clone()), Place::none());
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
        place: Place,
    ) -> (JoinHandle<()>, Option<Arc<tokio::sync::Notify>>) {
        let client = self.client.clone();
        let listings = self.listings.clone();
        let reread = Arc::new(tokio::sync::Notify::new());
        let keep = Keep {
            key: r.key(),
            sink: self.sink.clone(),
            place,
        };
        match r.clone() {
            Ref::ConfigMap(ns, n) => {
                let api = Api::<ConfigMap>::namespaced(client, &ns);
                let frozen = |c: &ConfigMap| c.immutable == Some(true);
                let watch = watch_one(api, n, keep, Object::ConfigMap, listings, frozen);
                (tokio::spawn(watch), None)
            }
            Ref::Secret(ns, n) => {
                let api = Api::<Secret>::namespaced(client, &ns);
                let frozen = |s: &Secret| s.immutable == Some(true);
                let watch = watch_one(api, n, keep, Object::Secret, listings, frozen);
                (tokio::spawn(watch), None)
            }
            Ref::Volume(n) => {
                let read = read_one(
                    Api::<PersistentVolume>::all(client),
                    n,
                    keep,
                    reread.clone(),
                    Object::PersistentVolume,
                    |_| {},
                    |_| true,
                );
                (tokio::spawn(read), Some(reread))
            }
            Ref::Claim(ns, n) => {
                let (claim, me) = (r.clone(), Arc::downgrade(self));
                let read = read_one(
                    Api::<PersistentVolumeClaim>::namespaced(client, &ns),
                    n,
                    keep,
                    reread.clone(),
                    Object::PersistentVolumeClaim,
                    move |c: Option<&PersistentVolumeClaim>| {
                        let pv = c.and_then(claim_volume).map(String::from);
                        if let Some(me) = me.upgrade() {
                            me.claim_bound(&claim, pv);
                        }
                    },
                    claim_bound,
                );
                (tokio::spawn(read), Some(reread))
            }
        }
    }
}

/// What keeps the store's copy of one object: its key, the store, and the place of the pod it
/// was read for first in the authorizer's order.
pub(super) struct Keep {
    pub(super) key: ObjectKey,
    pub(super) sink: Sink,
    pub(super) place: Place,
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
async fn read_one<K>(
    api: Api<K>,
    name: String,
    keep: Keep,
    reread: Arc<tokio::sync::Notify>,
    object: fn(K) -> Object,
    seen: impl Fn(Option<&K>) + Send + 'static,
    settled: fn(&K) -> bool,
) where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let Keep { key, sink, place } = keep;
    let mut backoff = WatchBackoff::default();
    loop {
        place.turn().await;
        let read = api.get_opt(&name).await;
        match &read {
            Ok(_) => {
                place.allowed();
                sink.refused(None);
            }
            Err(e) => {
                if let Some(why) = super::connection::refusal(e) {
                    sink.refused(Some(why));
                }
            }
        }
        let wait = match read {
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
                let delay = place.retry_after(&mut backoff, forbidden(&e), object_refused(&e));
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

/// Lists and watches one object by name (a field selector, all the Node authorizer allows a
/// node for the ConfigMaps and Secrets its pods reference), keeping the store's copy of it: one
/// streaming list (a watch whose first events are the listing) where the server has the
/// WatchList feature, else a list and a watch; the listing marks it present or absent and no
/// longer pending; each event updates it; a refusal
/// (the authorizer has not learnt the relationship yet) or an unreachable server is tried again
/// after a backoff, and what the store has stays. Once the object is `frozen` (an immutable
/// ConfigMap or Secret, as the kubelet stops watching one) it is kept as read and no longer
/// watched.
pub(super) async fn watch_one<K>(
    api: Api<K>,
    name: String,
    keep: Keep,
    object: fn(K) -> Object,
    listings: Listings,
    frozen: fn(&K) -> bool,
) where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let Keep { key, sink, place } = keep;
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    // One request, where the server streams lists (WatchList, Kubernetes 1.32 on): a watch
    // that sends the object, marks the end of the listing and goes on.
    let mut streaming = listings.streams();
    let mut events = match streaming {
        true => watcher(api.clone(), config.clone().streaming_lists()).boxed(),
        false => watcher(api.clone(), config.clone()).boxed(),
    };
    let mut backoff = WatchBackoff::default();
    let (mut listed, mut is_frozen) = (false, false);
    // (The watcher lists when it is first polled, and again after a failure.)
    place.turn().await;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => {
                (listed, is_frozen) = (false, false);
                // A streaming list's watch has started: the server authorized it (a list
                // says so only once it is answered, at `InitDone`).
                if streaming {
                    place.allowed();
                }
            }
            Ok(Event::InitApply(o)) => {
                (listed, is_frozen) = (true, frozen(&o));
                sink.apply([Change::ClusterUpsert(Box::new(object(o)))]);
            }
            Ok(Event::Apply(o)) => {
                let now_frozen = frozen(&o);
                sink.apply([Change::ClusterUpsert(Box::new(object(o)))]);
                if now_frozen {
                    return;
                }
            }
            Ok(Event::InitDone) => {
                backoff.reset();
                place.allowed();
                sink.refused(None);
                listings.listed_object();
                if !listed {
                    // A streaming list comes from the server's watch cache at whatever version
                    // it has (kube-runtime asks with resourceVersion 0): an object made an
                    // instant before may not be in it yet. Its absence is confirmed with a
                    // GET, which reads the server's store itself.
                    let confirmed = match streaming {
                        true => api.get_opt(&name).await.unwrap_or_else(|e| {
                            tracing::debug!(object = ?key, "reading what the listing lacked: {e}; absent");
                            None
                        }),
                        false => None,
                    };
                    match confirmed {
                        Some(o) => {
                            is_frozen = frozen(&o);
                            sink.apply([Change::ClusterUpsert(Box::new(object(o)))]);
                        }
                        None => sink.apply([Change::ClusterRemove(key.clone())]),
                    }
                }
                sink.apply([Change::ClusterPending {
                    key: key.clone(),
                    pending: false,
                }]);
                // Read, and never to change: no watch is opened.
                if is_frozen {
                    return;
                }
            }
            Ok(Event::Delete(_)) => {
                sink.apply([Change::ClusterRemove(key.clone())]);
            }
            Err(e) if streaming && streaming_refused(&e) => {
                tracing::info!(object = ?key, "the API server does not stream lists ({e}): objects are listed, then watched");
                listings.cannot_stream();
                streaming = false;
                place.answered();
                events = watcher(api.clone(), config.clone()).boxed();
            }
            Err(e) => {
                if let Some(why) = super::connection::watch_refusal(&e) {
                    sink.refused(Some(why));
                }
                let lagging = watch_forbidden(&e);
                let delay = place.retry_after(&mut backoff, lagging, object_watch_refused(&e));
                tracing::debug!(object = ?key, "watch: {e}; retrying in {delay:.1?}");
                tokio::time::sleep(delay).await;
                place.turn().await;
            }
        }
    }
}

/// Whether the server refused a streaming list as invalid (422): it has no WatchList feature
/// (turned off, or older than Kubernetes 1.27, which refuses `resourceVersionMatch` on a
/// watch).
fn streaming_refused(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 422)
}

/// Lists and watches every CSIDriver (the one cluster-scoped kind read whole).
pub(super) async fn watch_drivers(api: Api<CSIDriver>, sink: Sink) {
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
