//! The Node's `status.volumesInUse`, which the attach/detach controller reads.

use std::sync::Arc;

use kube::api::Api;
use tokio::task::JoinHandle;

use crate::source::cluster::publish::publish_on_change;

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
