//! Asking CSI drivers how their volumes and storage are (CSI 1.13, alpha; Kubernetes'
//! `CSIVolumeHealth`): NodeGetVolumeHealth for each mounted volume of a PersistentVolume where
//! the driver offers GET_VOLUME_HEALTH, else the condition a driver of an earlier CSI version
//! puts in NodeGetVolumeStats (VOLUME_CONDITION); NodeGetStorageHealth for each driver that
//! offers GET_STORAGE_HEALTH. Conditions of kinds kubevol does not know are left out, as the
//! kubelet leaves them out.

use kubevol_csi::v1::{self as csi};

use crate::csi::{Driver, Drivers};
use crate::error::VolumeError;
use crate::plugins::PluginHost;
use crate::report::health::Condition;

/// The status a driver of CSI 1.12 or earlier means by an abnormal `volume_condition`: the
/// condition has no kind, so it is taken as the mildest.
const LEGACY_STATUS: &str = "Degraded";
/// The reason given to such a condition.
const LEGACY_REASON: &str = "VolumeConditionAbnormal";

/// A volume health entry as the API names its status, or `None` for a kind kubevol does not
/// know.
fn volume_condition(e: &csi::volume_health::VolumeHealthEntry) -> Option<Condition> {
    use csi::VolumeHealthErrorType as T;
    let status = match T::try_from(e.status).ok()? {
        T::Inaccessible => "Inaccessible",
        T::DataLoss => "DataLoss",
        T::Degraded => "Degraded",
        T::UnknownVolumeHealthType => return None,
    };
    Some(Condition::new(status, &e.reason, &e.message))
}

/// What an abnormal `volume_condition` of NodeGetVolumeStats (CSI 1.12 and earlier) becomes.
pub(crate) fn legacy_condition(c: &csi::VolumeCondition) -> Option<Condition> {
    c.abnormal
        .then(|| Condition::new(LEGACY_STATUS, LEGACY_REASON, &c.message))
}

/// NodeGetVolumeHealth of volume `handle` of `driver`, published at `publish_path` and staged
/// at `staging_path` (empty where the driver does not stage).
pub(crate) async fn volume_health(
    host: &PluginHost,
    driver: &Driver,
    handle: &str,
    publish_path: String,
    staging_path: String,
) -> Result<Vec<Condition>, VolumeError> {
    let mut client = Drivers::node_client(driver);
    let resp = host
        .csi
        .call(
            &driver.name,
            "Node",
            "NodeGetVolumeHealth",
            client.node_get_volume_health(csi::NodeGetVolumeHealthRequest {
                volume_id: handle.to_string(),
                volume_publish_path: publish_path,
                staging_target_path: staging_path,
            }),
        )
        .await?;
    Ok(resp
        .volume_health
        .map(|h| {
            h.health_statuses
                .iter()
                .filter_map(volume_condition)
                .collect()
        })
        .unwrap_or_default())
}

/// NodeGetStorageHealth of `driver`.
pub(crate) async fn storage_health(
    host: &PluginHost,
    driver: &Driver,
) -> Result<Vec<Condition>, VolumeError> {
    use csi::StorageHealthErrorType as T;
    let mut client = Drivers::node_client(driver);
    let resp = host
        .csi
        .call(
            &driver.name,
            "Node",
            "NodeGetStorageHealth",
            client.node_get_storage_health(csi::NodeGetStorageHealthRequest::default()),
        )
        .await?;
    Ok(resp
        .backend_health
        .iter()
        .filter_map(|b| {
            let status = match T::try_from(b.status).ok()? {
                T::StorageUnreachable => "StorageUnreachable",
                T::StorageDegraded => "StorageDegraded",
                T::UnknownStorageHealthErrorType => return None,
            };
            let mut c = Condition::new(status, &b.reason, &b.message);
            if let Some(cap) = &b.volume_capability {
                let (access_mode, volume_mode) = capability_modes(cap);
                c.access_mode = access_mode;
                c.volume_mode = volume_mode;
            }
            Some(c)
        })
        .collect())
}

/// The access mode and volume mode, as the API names them, that a storage condition's
/// capability is limited to.
fn capability_modes(cap: &csi::VolumeCapability) -> (Option<String>, Option<String>) {
    use csi::volume_capability::access_mode::Mode;
    use csi::volume_capability::AccessType;
    let access = cap
        .access_mode
        .as_ref()
        .and_then(|m| match Mode::try_from(m.mode).ok()? {
            Mode::SingleNodeWriter | Mode::SingleNodeMultiWriter => Some("ReadWriteOnce"),
            Mode::SingleNodeSingleWriter => Some("ReadWriteOncePod"),
            Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly => Some("ReadOnlyMany"),
            Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter => Some("ReadWriteMany"),
            Mode::Unknown => None,
        });
    let volume = cap.access_type.as_ref().map(|t| match t {
        AccessType::Block(_) => "Block",
        AccessType::Mount(_) => "Filesystem",
    });
    (access.map(str::to_string), volume.map(str::to_string))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_kubevol_does_not_know_are_left_out() {
        use csi::volume_health::VolumeHealthEntry;
        let entry = |status: i32| VolumeHealthEntry {
            status,
            reason: "R".into(),
            message: "m".into(),
        };
        assert_eq!(
            volume_condition(&entry(csi::VolumeHealthErrorType::DataLoss as i32))
                .unwrap()
                .status,
            "DataLoss"
        );
        assert!(volume_condition(&entry(0)).is_none());
        assert!(volume_condition(&entry(99)).is_none());
    }

    #[test]
    fn a_legacy_condition_counts_only_when_abnormal() {
        let c = csi::VolumeCondition {
            abnormal: true,
            message: "disk gone".into(),
        };
        assert_eq!(
            legacy_condition(&c).unwrap().to_string(),
            "Degraded (VolumeConditionAbnormal): disk gone"
        );
        assert!(legacy_condition(&csi::VolumeCondition::default()).is_none());
    }
}
