//! Volume usage for `kubelet_volume_stats_*` (NodeGetVolumeStats, or statfs) and the health of
//! CSI volumes and storage, gathered together every `--volume-stats-period`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kubevol_core::state::VolumeSpec;
use kubevol_core::PodRef;
use kubevol_csi::v1::{self as csi};

use crate::csi::Drivers;
use crate::error::VolumeError;
use crate::plugins::{blocking, PluginHost};
use crate::report::health::{Change, Condition};

use super::*;

/// The usage of a mounted volume from a claim: NodeGetVolumeStats for a CSI driver that has
/// GET_VOLUME_STATS, statfs of the mounted path for any other filesystem volume; with the
/// abnormal condition a driver of CSI 1.12 or earlier may report beside.
pub(crate) async fn volume_stats(
    host: &Arc<PluginHost>,
    spec: &VolumeSpec,
    pod: &PodRef,
    path: &Path,
) -> Result<Option<(crate::metrics::VolumeUsage, Option<Condition>)>, VolumeError> {
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
            Ok(Some((
                crate::metrics::VolumeUsage {
                    capacity_bytes: s.f_blocks as i64 * f,
                    available_bytes: s.f_bavail as i64 * f,
                    used_bytes: (s.f_blocks as i64 - s.f_bfree as i64) * f,
                    inodes: s.f_files as i64,
                    inodes_free: s.f_ffree as i64,
                    inodes_used: s.f_files as i64 - s.f_ffree as i64,
                    abnormal: false,
                },
                None,
            )))
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
    let condition = resp
        .volume_condition
        .as_ref()
        .and_then(super::health::legacy_condition);
    let mut u = crate::metrics::VolumeUsage {
        abnormal: condition.is_some(),
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
    Ok(Some((u, condition)))
}

/// A mounted volume of a pod.
struct Mounted {
    pod: PodRef,
    /// The pod's name of the volume.
    volume: String,
    spec: Arc<VolumeSpec>,
    path: PathBuf,
    /// `(namespace, claim)` of a volume from a claim.
    claim: Option<(String, String)>,
}

/// Every `period`: `kubelet_volume_stats_*` for every mounted volume that comes from a claim,
/// and the health of CSI volumes and of the drivers' storage.
pub(crate) async fn stats_loop(
    world: Arc<crate::world::World>,
    host: Arc<PluginHost>,
    metrics: Arc<crate::metrics::Metrics>,
    period: std::time::Duration,
) {
    loop {
        tokio::time::sleep(period).await;
        let mounted: Vec<Mounted> = {
            let asw = world.asw();
            asw.volumes()
                .flat_map(|v| v.pods.values())
                .filter(|m| m.state == kubevol_core::state::PodMountState::Mounted)
                .map(|m| Mounted {
                    pod: m.pod_ref.clone(),
                    volume: m.outer_volume_name.to_string(),
                    spec: m.spec.clone(),
                    path: m.path.clone(),
                    claim: kubevol_core::names::claim_name(&m.pod_ref.name, &m.spec.volume)
                        .map(|c| (m.pod_ref.namespace.to_string(), c.into_owned())),
                })
                .collect()
        };
        let mut stats = BTreeMap::new();
        let mut legacy = BTreeMap::new();
        for m in &mounted {
            let Some(claim) = &m.claim else { continue };
            if stats.contains_key(claim) {
                continue;
            }
            match volume_stats(&host, &m.spec, &m.pod, &m.path).await {
                Ok(Some((u, condition))) => {
                    stats.insert(claim.clone(), u);
                    legacy.insert(claim.clone(), condition);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::debug!(claim = %claim.1, namespace = %claim.0, "volume stats: {e}")
                }
            }
        }
        for m in &mounted {
            let Some(conditions) = volume_conditions(&host, m, &legacy).await else {
                continue;
            };
            if let Some(u) = m.claim.as_ref().and_then(|c| stats.get_mut(c)) {
                u.abnormal |= !conditions.is_empty();
            }
            let volume = &m.volume;
            match host.health.set_volume(&m.pod, volume, conditions) {
                Change::None => {}
                Change::Abnormal(what) => host.events.record(
                    &m.pod,
                    true,
                    crate::report::health::reason::VOLUME_CONDITION_ABNORMAL,
                    format!("volume {volume:?}: {what}"),
                ),
                Change::Recovered => host.events.record(
                    &m.pod,
                    false,
                    crate::report::health::reason::VOLUME_CONDITION_NORMAL,
                    format!("volume {volume:?}: no adverse condition is reported any more"),
                ),
            }
        }
        metrics.set_volume_stats(&stats);
        let live: BTreeSet<(&str, &str)> = mounted
            .iter()
            .map(|m| (m.pod.uid.as_str(), m.volume.as_str()))
            .collect();
        host.health
            .retain(|uid, volume| live.contains(&(uid.as_str(), volume)));
        storage_conditions(&host).await;
        metrics.set_storage_health(&host.health.storage());
    }
}

/// The conditions of a mounted volume of a CSI PersistentVolume: from NodeGetVolumeHealth, or
/// from NodeGetVolumeStats (`legacy`, by claim) for a driver of CSI 1.12 or earlier; `None`
/// where the driver reports no health, or could not be asked now (what it said last stays).
async fn volume_conditions(
    host: &PluginHost,
    m: &Mounted,
    legacy: &BTreeMap<(String, String), Option<Condition>>,
) -> Option<Vec<Condition>> {
    let claim = m.claim.as_ref()?;
    let r = resolve(&m.spec, Some(&m.pod)).ok()?;
    let driver = host.csi.get(&r.driver)?;
    if driver.capabilities.get_volume_health {
        let staging_path = if driver.capabilities.stage_unstage_volume {
            host.root.join(staging(&r).0).display().to_string()
        } else {
            String::new()
        };
        let publish_path = m.path.display().to_string();
        return super::health::volume_health(host, &driver, &r.handle, publish_path, staging_path)
            .await
            .inspect_err(
                |e| tracing::debug!(pod = %m.pod, volume = %m.volume, "volume health: {e}"),
            )
            .ok();
    }
    if driver.capabilities.volume_condition {
        return legacy.get(claim).map(|c| c.iter().cloned().collect());
    }
    None
}

/// NodeGetStorageHealth of every driver that offers it; drivers gone are forgotten.
async fn storage_conditions(host: &PluginHost) {
    let drivers = host.csi.all();
    for d in &drivers {
        if !d.capabilities.get_storage_health {
            continue;
        }
        match super::health::storage_health(host, d).await {
            Ok(conditions) => {
                host.health.set_storage(&d.name, conditions);
            }
            Err(e) => tracing::debug!(driver = %d.name, "storage health: {e}"),
        }
    }
    let names: BTreeSet<&str> = drivers.iter().map(|d| d.name.as_str()).collect();
    host.health.retain_storage(|d| names.contains(d));
}
