//! The storage controllers of standalone mode: what a cluster's PersistentVolume controller,
//! external provisioners and resizer, and ephemeral-volume controller do, for the claims of the
//! manifests and the library.
//!
//! They run beside the sources, as a part of their own: they read the store and the world, and
//! write what they decide — bindings, provisioned PersistentVolumes, the claims of generic
//! ephemeral volumes, why a claim is not bound — into the store, as a source writes its
//! objects. The populator only reads those results: a pod whose claim is not bound yet waits,
//! and says why once the binder has decided. Claims of the API server are the cluster's
//! controllers' to bind, and left alone.
//!
//! - [`ephemeral`]: the claim `<pod>-<volume>` of each generic ephemeral volume, made from its
//!   template for every pod of this node, and removed with its pod;
//! - [`binder`]: a claim nothing binds is bound when its class binds at once (`Immediate`), or
//!   when a pod of this node first uses it (`WaitForFirstConsumer`), to the volume that fits it
//!   best, else to one provisioned for it ([`provision`], of its [`classes`] class);
//! - [`provision::grow`]: a provisioned volume grows with its claim where its class allows it;
//! - [`reclaim`]: a provisioned volume whose claim is gone is deleted once nothing uses it
//!   (`Delete`), or kept Released (`Retain`).

pub mod binder;
pub mod classes;
pub mod ephemeral;
mod error;
pub mod provision;
pub mod reclaim;
mod secrets;
mod snapshots;
mod sources;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub use error::StorageError;

use crate::plugins::PluginHost;
use crate::store::{claim_volume, Origin, DEFAULT_NAMESPACE};

/// A claim, by namespace and name.
type ClaimKey = (String, String);

/// Runs the storage controllers until `stop`: a pass over the claims and pods at every change
/// of the objects (once every source has delivered its first listing, so that no volume a file
/// not read yet reserves is given away), and a look for volumes to reclaim at every change of
/// either state of world too (a volume unmounted with no object changing).
pub async fn run(
    host: Arc<PluginHost>,
    world: Arc<crate::world::World>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut objects = host.store.subscribe();
    let mut states = world.subscribe();
    let mut objects_changed = true;
    // A volume whose deletion failed is looked at again after a backoff of its own, whether or
    // not anything else changes (a mount inside it may go, a driver may recover).
    let (retry_tx, mut retry_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let failures: Arc<std::sync::Mutex<BTreeMap<String, usize>>> = Arc::default();
    // The last failure of each claim's growth, told to its pods once.
    let mut resize_failures = BTreeMap::new();
    loop {
        // The store version a pass starts from: what it reads is this version or newer. (Read,
        // not marked seen: a change the wait below has not woken for yet still wakes it.)
        let mut passed = None;
        if objects_changed && host.store.all_sources_synced() {
            objects_changed = false;
            passed = Some(*objects.borrow());
            pass(&host, &world, &mut resize_failures);
        }
        let volumes_to_reclaim = reclaim::to_reclaim(&host.store, &world);
        if let Some(version) = passed {
            world.storage_looked(version);
        }
        for r in volumes_to_reclaim {
            let (host, retry, failures) = (host.clone(), retry_tx.clone(), failures.clone());
            tokio::spawn(async move {
                let name = r.volume.metadata.name.clone().unwrap_or_default();
                if reclaim::reclaim(host, r).await {
                    crate::sync::lock(&failures).remove(&name);
                    return;
                }
                let delay = {
                    let mut failures = crate::sync::lock(&failures);
                    let n = failures.entry(name).or_default();
                    *n += 1;
                    reclaim::RETRY
                        .delays()
                        .nth(*n - 1)
                        .unwrap_or(reclaim::RETRY.max)
                };
                tokio::time::sleep(delay).await;
                let _ = retry.send(());
            });
        }
        tokio::select! {
            r = objects.changed() => {
                if r.is_err() {
                    return;
                }
                objects_changed = true;
            }
            r = states.changed() => if r.is_err() { return },
            _ = retry_rx.recv() => {}
            _ = stop.changed() => return,
        }
    }
}

/// One pass: the claims of ephemeral volumes made and removed, the claims that should be bound
/// bound (or why not recorded), and provisioned volumes grown.
fn pass(
    host: &Arc<PluginHost>,
    world: &crate::world::World,
    resize_failures: &mut BTreeMap<ClaimKey, String>,
) {
    let store = &host.store;
    // A cluster's pods are the cluster's controllers' to serve.
    let here = store.pods_where(|p| {
        *p.origin() != Origin::Cluster
            && crate::store::is_for_node(&p.pod, &host.node_name)
            && !crate::store::is_terminated(&p.pod)
    });
    ephemeral::remove_orphans(store);
    for (_, stored) in &here {
        ephemeral::make_claims(store, &stored.pod);
    }
    // The claims pods of this node use (an ephemeral volume's only when it controls it), and
    // the pods that use each.
    let mut used: BTreeMap<ClaimKey, Vec<kubevol_core::PodRef>> = BTreeMap::new();
    for (uid, stored) in &here {
        let pod = &stored.pod;
        let pod_ref = crate::store::pod_ref(pod, uid);
        for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
            let Some(name) = kubevol_core::names::claim_name(&pod_ref.name, v) else {
                continue;
            };
            let key = (pod_ref.namespace.to_string(), name.into_owned());
            if v.ephemeral.is_some() {
                let claim = store.persistent_volume_claim(&key.0, &key.1);
                if !claim.is_some_and(|c| {
                    crate::populator::claims::made_for_pod(&pod_ref, &c.object, false)
                }) {
                    continue;
                }
            }
            used.entry(key).or_default().push(pod_ref.clone());
        }
    }
    let mut failing = BTreeSet::new();
    // A cluster's claims are the cluster's controllers' to bind and grow.
    for stored in store.persistent_volume_claims_where(|c| c.origin != Origin::Cluster) {
        let claim = &stored.object;
        let ns = claim
            .metadata
            .namespace
            .as_deref()
            .unwrap_or(DEFAULT_NAMESPACE);
        let name = claim.metadata.name.as_deref().unwrap_or_default();
        let key = (ns.to_string(), name.to_string());
        let bindings = store.bindings();
        if claim_volume(claim).is_none() {
            let wanted = used.contains_key(&key)
                || classes::binds_at_once(store, &classes::class_of(store, claim));
            let (bound_now, why_not) =
                match wanted.then(|| binder::bind_claim(host, ns, name, claim)) {
                    Some(Ok(bound)) => (bound.is_some(), None),
                    Some(Err(why)) => (false, Some(why.to_string())),
                    None => (false, None),
                };
            if bindings.set_unbound(ns, name, why_not) || bound_now {
                // Its pods look again: bound now, or told why not.
                store.touch_claim(ns, name);
            }
        }
        // A claim that asks for more than it may have keeps its volume as it is (the API
        // server would have refused the edit): its pods are told, once per failure.
        if let Err(e) = provision::grow(host, ns, claim).map_err(|e| e.to_string()) {
            failing.insert(key.clone());
            if resize_failures.get(&key) != Some(&e) {
                for pod in used.get(&key).into_iter().flatten() {
                    host.events.record(
                        pod,
                        true,
                        crate::report::events::reason::VOLUME_RESIZE_FAILED,
                        e.clone(),
                    );
                }
                // The pods' status (their events) changed.
                world.announce();
                resize_failures.insert(key, e);
            }
        }
    }
    resize_failures.retain(|k, _| failing.contains(k));
}
