//! The CSINode object and the Node's CSI annotation and topology labels.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kube::api::Api;
use tokio::task::JoinHandle;

use crate::source::cluster::publish::publish_on_change;

/// What the CSINode publisher needs of the volume manager.
pub trait NodeDrivers: Send + Sync + 'static {
    /// The CSI drivers registered on the node.
    fn csi_drivers(&self) -> Vec<crate::csi::DriverStatus>;
    /// Told when a driver registers or goes.
    fn driver_changes(&self) -> tokio::sync::watch::Receiver<u64>;
    /// The period on which a driver's CSIDriver asks for its volume limit to be read again
    /// (`nodeAllocatableUpdatePeriodSeconds`), if it does.
    fn allocatable_period(&self, driver: &str) -> Option<Duration>;
    /// Told when an object (a CSIDriver among them) may have changed.
    fn object_changes(&self) -> tokio::sync::watch::Receiver<u64>;
    /// Reads a driver's node information again (NodeGetInfo): its volume limit now, and
    /// whether it changed (then [`NodeDrivers::driver_changes`] tells).
    fn refresh_allocatable(
        &self,
        driver: &str,
    ) -> crate::BoxFuture<Result<(i64, bool), crate::csi::CsiError>>;
}

/// Reads each driver's volume limit again on its CSIDriver's `nodeAllocatableUpdatePeriodSeconds`
/// (Kubernetes 1.36, the kubelet's CSINode updater): a change wakes the CSINode publisher,
/// which writes the new `allocatable.count`. The periods are looked at again when a driver
/// registers or goes and when an object changes.
async fn refresh_allocatable(drivers: Arc<dyn NodeDrivers>) {
    let (mut registrations, mut objects) = (drivers.driver_changes(), drivers.object_changes());
    // Each driver's period and next reading; a changed period starts anew, as the kubelet
    // restarts its ticker.
    let mut next: BTreeMap<String, (Duration, tokio::time::Instant)> = BTreeMap::new();
    loop {
        let now = tokio::time::Instant::now();
        let periods: BTreeMap<String, Duration> = drivers
            .csi_drivers()
            .into_iter()
            .filter_map(|d| Some((d.name.clone(), drivers.allocatable_period(&d.name)?)))
            .collect();
        next.retain(|name, (period, _)| periods.get(name) == Some(period));
        for (name, period) in &periods {
            let (_, at) = *next.entry(name.clone()).or_insert((*period, now + *period));
            if at > now {
                continue;
            }
            match drivers.refresh_allocatable(name).await {
                Ok((count, true)) => {
                    tracing::info!(driver = %name, count, "CSI driver's allocatable volume count changed; CSINode is updated")
                }
                Ok(_) => {
                    tracing::debug!(driver = %name, "CSI driver's allocatable volume count unchanged")
                }
                Err(e) => {
                    tracing::warn!(driver = %name, "cannot read the CSI driver's volume limit again: {e}")
                }
            }
            next.insert(
                name.clone(),
                (*period, tokio::time::Instant::now() + *period),
            );
        }
        let wake = next.values().map(|(_, at)| *at).min();
        objects.borrow_and_update();
        tokio::select! {
            _ = tokio::time::sleep_until(wake.unwrap_or(now)), if wake.is_some() => {}
            changed = registrations.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            changed = objects.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}

/// What is published of one driver: its name, node ID, topology segments and volume limit.
type Published = (String, String, BTreeMap<String, String>, i64);

/// The Node annotation listing each CSI driver's node ID, as JSON.
pub const NODE_ID_ANNOTATION: &str = "csi.volume.kubernetes.io/nodeid";

/// Keeps the CSINode object named after the node, and the Node's CSI annotation and topology
/// labels, in step with the CSI drivers registered on the node, as the kubelet's CSI plugin
/// does: each driver's entry has its name, node ID, topology keys and allocatable volume count
/// (from NodeGetInfo); the Node gets `csi.volume.kubernetes.io/nodeid` (driver → node ID) and
/// the drivers' topology segments as labels. A driver that goes is removed from both. A driver
/// whose CSIDriver has `nodeAllocatableUpdatePeriodSeconds` is asked for its limit again on that
/// period, and its entry follows.
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
            let refresher = refresh_allocatable(drivers.clone());
            let publisher = publish_on_change(
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
            );
            tokio::join!(refresher, publisher);
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
        // The in-tree plugins this node serves through their CSI drivers, so that the
        // attach/detach controller attaches their volumes through CSI, as for a kubelet.
        let migrated = kubevol_core::migration::migrated_plugins();
        let annotate = |meta: &mut kube::api::ObjectMeta| {
            meta.annotations
                .get_or_insert_with(Default::default)
                .insert(
                    kubevol_core::migration::MIGRATED_PLUGINS_ANNOTATION.to_string(),
                    migrated.clone(),
                );
        };
        match csinodes.get_opt(node).await.map_err(|e| e.to_string())? {
            Some(mut current) => {
                current.spec = CSINodeSpec { drivers: entries };
                annotate(&mut current.metadata);
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
                let mut object = CSINode {
                    metadata: kube::api::ObjectMeta {
                        name: Some(node.into()),
                        owner_references: owner,
                        ..Default::default()
                    },
                    spec: CSINodeSpec { drivers: entries },
                };
                annotate(&mut object.metadata);
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
