//! Where the kubelet puts a CSI volume's staging and publish paths, and the `vol_data.json`
//! files beside them that let a restart find staged volumes again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kubevol_core::state::{PodVolumeRef, VolumeSpec};
use kubevol_core::{PodUid, UniqueVolumeName};

use crate::error::VolumeError;
use crate::plugins::PluginHost;

use super::*;

pub(super) fn csi_dir() -> PathBuf {
    Path::new("plugins").join("kubernetes.io").join("csi")
}

/// Where a volume is staged, relative to the root, and the directory of its `vol_data.json`.
pub(super) fn staging(r: &Resolved) -> (PathBuf, PathBuf) {
    if r.block {
        let d = csi_dir().join("volumeDevices");
        (
            d.join("staging").join(&r.spec_name),
            d.join(&r.spec_name).join("data"),
        )
    } else {
        let d = csi_dir().join(&r.driver).join(sha256_hex(&r.handle));
        (d.join("globalmount"), d)
    }
}

/// Where a volume is published for a pod, relative to the root, and the directory of its
/// `vol_data.json`.
pub(super) fn publish(r: &Resolved, pod: &PodUid) -> (PathBuf, PathBuf) {
    if r.block {
        let d = csi_dir().join("volumeDevices");
        (
            d.join("publish").join(&r.spec_name).join(pod.as_str()),
            d.join(&r.spec_name).join("data"),
        )
    } else {
        let d = PluginHost::pod_plugin_path(pod, "volumes", PLUGIN_NAME).join(&r.spec_name);
        (d.join("mount"), d)
    }
}

pub(super) fn pod_device_link(r: &Resolved, pod: &PodUid) -> PathBuf {
    PluginHost::pod_plugin_path(pod, "volumeDevices", PLUGIN_NAME).join(&r.spec_name)
}

pub(super) const VOL_DATA: &str = "vol_data.json";

/// The temporary file `vol_data.json` is written to before its rename (see
/// `kubevol_mount::safe::Dir::write_file`): left behind only when kubevol was killed in between,
/// and removed with the directory.
const VOL_DATA_TMP: &str = ".vol_data.json.tmp";

/// Writes `vol_data.json` durably into `dir` (relative to the root; made if missing), relative
/// to the root's descriptor: a temporary file beside it, flushed, renamed over it.
pub(super) fn write_vol_data(
    host: &PluginHost,
    dir: &Path,
    data: &BTreeMap<&str, String>,
) -> Result<(), VolumeError> {
    let body = serde_json::to_vec(data).unwrap_or_default();
    host.root_dir
        .write_file(&dir.join(VOL_DATA), &body)
        .map_err(|e| {
            not_ready(format!(
                "cannot write {}: {e}",
                host.root.join(dir).join(VOL_DATA).display()
            ))
        })
}

/// The most a `vol_data.json` may hold (it holds a few names).
const VOL_DATA_LIMIT: usize = 64 << 10;

/// Reads the `vol_data.json` of `dir` (below the root, relative or absolute), never through a
/// link.
pub(super) fn read_vol_data(host: &PluginHost, dir: &Path) -> Option<BTreeMap<String, String>> {
    let rel = dir.strip_prefix(&host.root).unwrap_or(dir);
    let bytes = host
        .root_dir
        .read_file(&rel.join(VOL_DATA), VOL_DATA_LIMIT)
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The spec of a persistent CSI volume as reconstruction knows it: the PV's name, driver and
/// handle (what unpublish and unstage need).
pub(super) fn persistent_spec(pv_name: &str, driver: &str, handle: &str) -> VolumeSpec {
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, PersistentVolume, PersistentVolumeClaimVolumeSource,
        PersistentVolumeSpec, Volume,
    };
    let mut pv = PersistentVolume::default();
    pv.metadata.name = Some(pv_name.to_string());
    pv.spec = Some(PersistentVolumeSpec {
        csi: Some(CSIPersistentVolumeSource {
            driver: driver.to_string(),
            volume_handle: handle.to_string(),
            ..Default::default()
        }),
        ..Default::default()
    });
    VolumeSpec {
        volume: PodVolumeRef::from(Volume {
            name: pv_name.to_string(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource::default()),
            ..Default::default()
        }),
        persistent_volume: Some(Arc::new(pv)),
        block: false,
        extensions: Default::default(),
        selinux_label: None,
        selinux_mount: false,
    }
}

/// The staged (globally mounted) filesystem volumes the plugin directory tells of:
/// `plugins/kubernetes.io/csi/<driver>/<hash>/vol_data.json` beside `globalmount`.
pub(crate) fn staged_volumes(host: &PluginHost) -> Vec<(UniqueVolumeName, VolumeSpec, PathBuf)> {
    let mut out = Vec::new();
    let base = host.root.join(csi_dir());
    use crate::plugins::subdirs as dirs;
    for driver_dir in dirs(&base) {
        if driver_dir.file_name().is_some_and(|n| n == "volumeDevices") {
            continue;
        }
        for vol_dir in dirs(&driver_dir) {
            let Some(data) = read_vol_data(host, &vol_dir) else {
                continue;
            };
            let (Some(driver), Some(handle)) = (data.get("driverName"), data.get("volumeHandle"))
            else {
                continue;
            };
            out.push((
                UniqueVolumeName::from(format!("{PLUGIN_NAME}/{driver}^{handle}")),
                persistent_spec("", driver, handle),
                vol_dir.join("globalmount"),
            ));
        }
    }
    out
}

/// Removes `vol_data.json` (and a temporary one a kill mid-write left) and then the directory
/// `dir` and its empty parents up to `stop`, with rmdir only (a directory with anything else in
/// it stays).
pub(super) fn remove_vol_data(host: &PluginHost, dir: &Path, stop: &Path) {
    let _ = host.root_dir.remove_beneath(&dir.join(VOL_DATA), false);
    let _ = host.root_dir.remove_beneath(&dir.join(VOL_DATA_TMP), false);
    let mut d = dir.to_path_buf();
    while d.starts_with(stop) && d != stop {
        if host.root_dir.remove_beneath(&d, true).is_err() {
            break;
        }
        if !d.pop() {
            break;
        }
    }
}
