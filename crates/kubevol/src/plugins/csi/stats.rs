//! Volume usage for `kubelet_volume_stats_*`: NodeGetVolumeStats, or statfs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kubevol_core::state::VolumeSpec;
use kubevol_core::PodRef;
use kubevol_csi::v1::{self as csi};

use crate::csi::Drivers;
use crate::error::VolumeError;
use crate::plugins::{blocking, PluginHost};

use super::*;

/// The usage of a mounted volume from a claim: NodeGetVolumeStats for a CSI driver that has
/// GET_VOLUME_STATS, statfs of the mounted path for any other filesystem volume.
pub(crate) async fn volume_stats(
    host: &Arc<PluginHost>,
    spec: &VolumeSpec,
    pod: &PodRef,
    path: &Path,
) -> Result<Option<crate::metrics::VolumeUsage>, VolumeError> {
    let csi_volume = spec
        .persistent_volume
        .as_ref()
        .and_then(|pv| pv.spec.as_ref())
        .is_some_and(|s| s.csi.is_some());
    if !csi_volume {
        if spec.block {
            return Ok(None);
        }
        let path = path.to_path_buf();
        return blocking(move || {
            let s = rustix::fs::statvfs(&path)
                .map_err(|e| not_ready(format!("statfs {}: {e}", path.display())))?;
            let f = s.f_frsize as i64;
            Ok(Some(crate::metrics::VolumeUsage {
                capacity_bytes: s.f_blocks as i64 * f,
                available_bytes: s.f_bavail as i64 * f,
                used_bytes: (s.f_blocks as i64 - s.f_bfree as i64) * f,
                inodes: s.f_files as i64,
                inodes_free: s.f_ffree as i64,
                inodes_used: s.f_files as i64 - s.f_ffree as i64,
                abnormal: false,
            }))
        })
        .await;
    }
    let r = resolve(spec, Some(pod))?;
    let driver = driver_for(host, &r.driver)?;
    if !driver.capabilities.get_volume_stats {
        return Ok(None);
    }
    let staging_path = if driver.capabilities.stage_unstage_volume {
        host.root.join(staging(&r).0).display().to_string()
    } else {
        String::new()
    };
    let mut client = Drivers::node_client(&driver);
    let resp = host
        .csi
        .call(
            &r.driver,
            "Node",
            "NodeGetVolumeStats",
            client.node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: r.handle.clone(),
                volume_path: path.display().to_string(),
                staging_target_path: staging_path,
            }),
        )
        .await?;
    let mut u = crate::metrics::VolumeUsage {
        abnormal: resp.volume_condition.is_some_and(|c| c.abnormal),
        ..Default::default()
    };
    for usage in resp.usage {
        match csi::volume_usage::Unit::try_from(usage.unit) {
            Ok(csi::volume_usage::Unit::Bytes) => {
                u.capacity_bytes = usage.total;
                u.available_bytes = usage.available;
                u.used_bytes = usage.used;
            }
            Ok(csi::volume_usage::Unit::Inodes) => {
                u.inodes = usage.total;
                u.inodes_free = usage.available;
                u.inodes_used = usage.used;
            }
            _ => {}
        }
    }
    Ok(Some(u))
}

/// Gathers `kubelet_volume_stats_*` for every mounted volume that comes from a claim:
/// NodeGetVolumeStats for CSI drivers that offer it, statfs for the rest.
pub(crate) async fn stats_loop(
    world: Arc<crate::world::World>,
    host: Arc<PluginHost>,
    metrics: Arc<crate::metrics::Metrics>,
    period: std::time::Duration,
) {
    loop {
        tokio::time::sleep(period).await;
        let volumes: Vec<(
            String,
            String,
            Arc<kubevol_core::state::VolumeSpec>,
            PathBuf,
            kubevol_core::PodRef,
        )> = {
            let asw = world.asw();
            asw.volumes()
                .flat_map(|v| v.pods.values())
                .filter(|m| m.state == kubevol_core::state::PodMountState::Mounted)
                .filter_map(|m| {
                    let claim = kubevol_core::names::claim_name(&m.pod_ref.name, &m.spec.volume)?;
                    Some((
                        m.pod_ref.namespace.to_string(),
                        claim.into_owned(),
                        m.spec.clone(),
                        m.path.clone(),
                        m.pod_ref.clone(),
                    ))
                })
                .collect()
        };
        let mut stats = BTreeMap::new();
        for (ns, claim, spec, path, pod) in volumes {
            if stats.contains_key(&(ns.clone(), claim.clone())) {
                continue;
            }
            match volume_stats(&host, &spec, &pod, &path).await {
                Ok(Some(u)) => {
                    stats.insert((ns, claim), u);
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(claim = %claim, namespace = %ns, "volume stats: {e}"),
            }
        }
        metrics.set_volume_stats(&stats);
    }
}
