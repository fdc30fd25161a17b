//! Controller-managed attach: the attach/detach controller's record, read with GET.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::api::Api;

use super::backoff::api_error;
use super::NodeDrivers;
use crate::error::ApiError;

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
    /// When each volume was first found not attached: its VolumeAttachment is read only after
    /// [`EXHAUSTED_CHECK_AFTER`].
    waiting_since: Arc<std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>>,
}

/// How long a volume waits for the attach/detach controller before its VolumeAttachment is
/// read for a ResourceExhausted failure: the controller makes it at once, and before it does
/// the Node authorizer refuses the read (the kubelet reads it only after its two-minute mount
/// timeout).
const EXHAUSTED_CHECK_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

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
            waiting_since: Arc::default(),
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
    ) -> crate::plugins::BoxFuture<Result<BTreeMap<String, String>, ApiError>> {
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client.clone());
        let attachments: Api<k8s_openapi::api::storage::v1::VolumeAttachment> =
            Api::all(self.client.clone());
        let node = self.node_name.clone();
        let drivers = self.drivers.clone();
        let waiting_since = self.waiting_since.clone();
        Box::pin(async move {
            let n = nodes.get(&node).await.map_err(|e| {
                api_error(
                    format_args!(
                        "cannot read Node {node} to see whether volume {volume} is attached"
                    ),
                    &e,
                    ApiError::Waiting,
                )
            })?;
            let listed = n
                .status
                .and_then(|s| s.volumes_attached)
                .unwrap_or_default()
                .iter()
                .any(|a| a.name == volume.as_str());
            let kept_current = csi_driver_of(volume.as_str())
                .filter(|d| drivers.allocatable_period(d).is_some())
                .map(String::from);
            let waited = {
                let mut since = crate::sync::lock(&waiting_since);
                // Volumes whose pods went while they waited are forgotten in time.
                since.retain(|_, t| t.elapsed() < std::time::Duration::from_secs(3600));
                if listed {
                    since.remove(volume.as_str());
                    std::time::Duration::ZERO
                } else {
                    since
                        .entry(volume.to_string())
                        .or_insert_with(std::time::Instant::now)
                        .elapsed()
                }
            };
            if let (false, Some(driver), true) =
                (listed, kept_current, waited >= EXHAUSTED_CHECK_AFTER)
            {
                // Read only for such drivers, as the kubelet does, and only once the volume has
                // waited a while: before the controller makes it, a node may not read a
                // VolumeAttachment (the answer is 403).
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
                    return Err(ApiError::Unavailable(format!(
                        "the attach of volume {volume} failed with ResourceExhausted (VolumeAttachment {attachment}: {}): this node has no room for more volumes of CSI driver {driver}; its allocatable volume count in CSINode {count}",
                        e.message.unwrap_or_default()
                    )));
                }
            }
            if !listed {
                return Err(ApiError::Waiting(format!(
                    "waiting for the attach/detach controller: volume {volume} is not in Node {node}'s status.volumesAttached yet"
                )));
            }
            let va = attachments.get(&attachment).await.map_err(|e| {
                api_error(
                    format_args!("cannot read VolumeAttachment {attachment} of volume {volume}"),
                    &e,
                    ApiError::Waiting,
                )
            })?;
            let status = va.status.unwrap_or_default();
            if !status.attached {
                let why = status
                    .attach_error
                    .and_then(|e| e.message)
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default();
                return Err(ApiError::Waiting(format!(
                    "waiting for the attach/detach controller: VolumeAttachment {attachment} of volume {volume} is not attached yet{why}"
                )));
            }
            Ok(status.attachment_metadata.unwrap_or_default())
        })
    }
}
