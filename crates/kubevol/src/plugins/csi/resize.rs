//! Online expansion: a volume whose PersistentVolume grew is expanded by its driver.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use kubevol_core::UniqueVolumeName;
use kubevol_csi::v1::{self as csi};

use crate::csi::{Driver, Drivers};
use crate::error::VolumeError;
use crate::plugins::PluginHost;

use super::*;

/// NodeExpandVolume (after ControllerExpandVolume when a controller that can expand is
/// configured) when the PersistentVolume's capacity grew past the size last seen.
pub(super) async fn expand_if_grown(
    host: &Arc<PluginHost>,
    sizes: &Mutex<HashMap<UniqueVolumeName, i64>>,
    volume: &UniqueVolumeName,
    r: &Resolved,
    driver: &Arc<Driver>,
    path: &Path,
) -> Result<(), VolumeError> {
    let Some(want) = r.capacity else {
        return Ok(());
    };
    let seen = {
        let mut s = crate::sync::lock(sizes);
        *s.entry(volume.clone()).or_insert_with(|| {
            // After a restart: the size recorded when it was last expanded.
            host.record
                .device(volume)
                .and_then(|d| d.expanded_size)
                .unwrap_or(want)
        })
    };
    if want <= seen || !driver.capabilities.expand_volume {
        if want > seen {
            tracing::warn!(driver = %r.driver, volume = %r.handle, "capacity grew but the driver cannot expand volumes on the node");
            crate::sync::lock(sizes).insert(volume.clone(), want);
        }
        return Ok(());
    }
    let range = csi::CapacityRange {
        required_bytes: want,
        limit_bytes: 0,
    };
    let secrets = secrets(host, r.expand_secret.as_ref())?;
    use kubevol_csi::v1::controller_service_capability::rpc::Type;
    if host
        .csi
        .controller_has(&r.driver, Type::ExpandVolume)
        .await?
    {
        if let Some(mut c) = host.csi.controller_client(&r.driver) {
            host.csi
                .call(
                    &r.driver,
                    "Controller",
                    "ControllerExpandVolume",
                    c.controller_expand_volume(csi::ControllerExpandVolumeRequest {
                        volume_id: r.handle.clone(),
                        capacity_range: Some(range),
                        secrets: secrets.clone(),
                        volume_capability: Some(capability(r, driver, None)),
                    }),
                )
                .await?;
        }
    }
    let staging_path = if driver.capabilities.stage_unstage_volume {
        host.root.join(staging(r).0).display().to_string()
    } else {
        String::new()
    };
    let mut client = Drivers::node_client(driver);
    let resp = host
        .csi
        .call(
            &r.driver,
            "Node",
            "NodeExpandVolume",
            client.node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: r.handle.clone(),
                volume_path: path.display().to_string(),
                capacity_range: Some(range),
                staging_target_path: staging_path,
                volume_capability: Some(capability(r, driver, None)),
                secrets,
            }),
        )
        .await?;
    tracing::info!(driver = %r.driver, volume = %r.handle, bytes = resp.capacity_bytes, "volume expanded on the node");
    crate::sync::lock(sizes).insert(volume.clone(), want);
    host.record
        .set_expanded_size(volume, want)
        .await
        .map_err(|e| not_ready(format!("cannot record the expanded size: {e}")))
}
