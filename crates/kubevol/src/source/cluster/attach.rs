//! Controller-managed attach: the attach/detach controller's record, read with GET.

use std::collections::BTreeMap;

use kube::api::Api;

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
