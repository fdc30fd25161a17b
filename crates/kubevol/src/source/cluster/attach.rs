//! Controller-managed attach: the attach/detach controller's record, read with GET.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::api::Api;

use super::NodeDrivers;

/// The attach/detach controller of a cluster as the volume manager sees it: a volume is
/// attached once its unique name is in the Node's `status.volumesAttached` and its
/// VolumeAttachment says `attached`; the VolumeAttachment's `attachmentMetadata` is the
/// publish context NodeStageVolume gets, as the kubelet's CSI plugin does.
///
/// As the kubelet does for a driver whose CSIDriver sets `nodeAllocatableUpdatePeriodSeconds`,
/// an attach that failed with ResourceExhausted (the VolumeAttachment's `attachError.errorCode`)
/// makes the driver's volume limit be read again at once, so that CSINode's `allocatable.count`
/// tells the scheduler that the node is full.
pub struct ControllerAttach {
    client: kube::Client,
    node_name: String,
    drivers: Arc<dyn NodeDrivers>,
}

impl ControllerAttach {
    /// Reads the Node `node_name` and VolumeAttachments with `client`; `drivers` are the
    /// node's CSI drivers.
    pub fn new(
        client: kube::Client,
        node_name: impl Into<String>,
        drivers: Arc<dyn NodeDrivers>,
    ) -> Self {
        ControllerAttach {
            client,
            node_name: node_name.into(),
            drivers,
        }
    }
}

/// The gRPC code ResourceExhausted, as a VolumeAttachment's `attachError.errorCode` has it.
const RESOURCE_EXHAUSTED: i32 = 8;

/// The CSI driver of a CSI volume's unique name (`kubernetes.io/csi/<driver>^<handle>`).
fn csi_driver_of(volume: &str) -> Option<&str> {
    volume
        .strip_prefix("kubernetes.io/csi/")?
        .split_once('^')
        .map(|(driver, _)| driver)
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
        let drivers = self.drivers.clone();
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
            let kept_current = csi_driver_of(volume.as_str())
                .filter(|d| drivers.allocatable_periods().iter().any(|(n, _)| n == d))
                .map(String::from);
            if let (false, Some(driver)) = (listed, kept_current) {
                // Read only for such drivers, as the kubelet does: before the controller makes
                // it, a node may not read a VolumeAttachment (the answer is 403).
                let failed = attachments
                    .get_opt(&attachment)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|va| {
                        va.status?
                            .attach_error
                            .filter(|e| e.error_code == Some(RESOURCE_EXHAUSTED))
                    });
                if let Some(e) = failed {
                    let count = match drivers.refresh_allocatable(&driver).await {
                        Ok((count, _)) => format!("read again from NodeGetInfo: {count}"),
                        Err(e) => format!("could not be read again: {e}"),
                    };
                    return Err(format!(
                        "the attach of volume {volume} failed with ResourceExhausted (VolumeAttachment {attachment}: {}): this node has no room for more volumes of CSI driver {driver}; its allocatable volume count in CSINode {count}",
                        e.message.unwrap_or_default()
                    ));
                }
            }
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
