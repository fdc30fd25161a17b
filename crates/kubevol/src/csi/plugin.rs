//! The `kubernetes.io/csi` volume plugin: persistent volumes (through a claim) and inline
//! ephemeral volumes of any CSI driver, driven as the kubelet drives them.
//!
//! Paths are the kubelet's, so drivers and tools find what they expect:
//! - staging: `plugins/kubernetes.io/csi/<driver>/<sha256(handle)>/globalmount`, with the
//!   device's `vol_data.json` beside it;
//! - publish: `pods/<uid>/volumes/kubernetes.io~csi/<name>/mount`, with `vol_data.json` beside
//!   it (`<name>` is the PersistentVolume's name, or the pod's volume name for inline volumes);
//! - block: staged at `plugins/kubernetes.io/csi/volumeDevices/staging/<name>`, published at
//!   `plugins/kubernetes.io/csi/volumeDevices/publish/<name>/<pod uid>` (the device the
//!   runtime gets), data in `plugins/kubernetes.io/csi/volumeDevices/<name>/data/`, and a link
//!   to the device at `pods/<uid>/volumeDevices/kubernetes.io~csi/<name>`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Pod, SecretReference};
use kubevol_core::names::escape_plugin_name;
use kubevol_core::state::{VolumeSpec, VolumeTraits};
use kubevol_core::{PodRef, PodUid, UniqueVolumeName};
use kubevol_csi::v1::volume_capability::{self, access_mode::Mode, AccessMode};
use kubevol_csi::v1::{self as csi, VolumeCapability};
use sha2::{Digest, Sha256};

use super::{Driver, Drivers};
use crate::error::VolumeError;
use crate::plugins::{
    blocking, fs_group, BoxFuture, DeviceRequest, PluginHost, SetUpRequest, SetUpResult,
    TearDownRequest, VolumePlugin,
};

/// The plugin's name.
pub const PLUGIN_NAME: &str = "kubernetes.io/csi";

/// Volume context keys added for drivers whose CSIDriver sets `podInfoOnMount`.
pub const POD_NAME_KEY: &str = "csi.storage.k8s.io/pod.name";
/// See [`POD_NAME_KEY`].
pub const POD_NAMESPACE_KEY: &str = "csi.storage.k8s.io/pod.namespace";
/// See [`POD_NAME_KEY`].
pub const POD_UID_KEY: &str = "csi.storage.k8s.io/pod.uid";
/// See [`POD_NAME_KEY`].
pub const SERVICE_ACCOUNT_KEY: &str = "csi.storage.k8s.io/serviceAccount.name";
/// See [`POD_NAME_KEY`].
pub const EPHEMERAL_KEY: &str = "csi.storage.k8s.io/ephemeral";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256_hex(s: &str) -> String {
    hex(&Sha256::digest(s.as_bytes()))
}

/// The volume handle of an inline ephemeral volume: `csi-` and the SHA-256 of the pod UID and
/// the volume's name, as the kubelet makes it.
pub fn ephemeral_handle(pod: &PodUid, volume: &str) -> String {
    format!("csi-{}", sha256_hex(&format!("{}{volume}", pod.as_str())))
}

/// The attachment ID the kubelet gives a volume on a node.
pub fn attachment_id(handle: &str, driver: &str, node: &str) -> String {
    format!("csi-{}", sha256_hex(&format!("{handle}{driver}{node}")))
}

/// A secret a volume references.
#[derive(Clone, Debug)]
struct SecretRef {
    namespace: String,
    name: String,
}

impl SecretRef {
    fn of(r: &SecretReference, default_ns: &str) -> Option<SecretRef> {
        Some(SecretRef {
            name: r.name.clone().filter(|n| !n.is_empty())?,
            namespace: r
                .namespace
                .clone()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| default_ns.to_string()),
        })
    }
}

/// Everything about a CSI volume that the calls need, from its PersistentVolume or inline
/// source.
#[derive(Clone, Debug)]
struct Resolved {
    driver: String,
    handle: String,
    /// The PersistentVolume's name, or the pod's volume name for inline volumes.
    spec_name: String,
    read_only: bool,
    fs_type: String,
    attributes: BTreeMap<String, String>,
    mount_options: Vec<String>,
    access_modes: Vec<String>,
    ephemeral: bool,
    block: bool,
    capacity: Option<i64>,
    stage_secret: Option<SecretRef>,
    publish_secret: Option<SecretRef>,
    controller_secret: Option<SecretRef>,
    expand_secret: Option<SecretRef>,
}

fn not_ready(msg: String) -> VolumeError {
    VolumeError::CsiNotReady(msg)
}

fn resolve(spec: &VolumeSpec, pod: Option<&PodRef>) -> Result<Resolved, VolumeError> {
    if let Some(pv) = &spec.persistent_volume {
        let pv_name = pv.metadata.name.clone().unwrap_or_default();
        let ps = pv.spec.as_ref();
        let Some(src) = ps.and_then(|s| s.csi.as_ref()) else {
            return Err(not_ready(format!(
                "PersistentVolume {pv_name} has no spec.csi"
            )));
        };
        let pv_ns = pod.map(|p| p.namespace.as_str()).unwrap_or("default");
        let capacity = ps
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get("storage"))
            .and_then(|q| kubevol_core::quantity::Quantity::parse(&q.0).ok())
            .map(|q| q.value());
        return Ok(Resolved {
            driver: src.driver.clone(),
            handle: src.volume_handle.clone(),
            spec_name: pv_name,
            read_only: src.read_only.unwrap_or(false)
                || spec
                    .volume
                    .persistent_volume_claim
                    .as_ref()
                    .and_then(|c| c.read_only)
                    .unwrap_or(false),
            fs_type: src.fs_type.clone().unwrap_or_default(),
            attributes: src.volume_attributes.clone().unwrap_or_default(),
            mount_options: ps.and_then(|s| s.mount_options.clone()).unwrap_or_default(),
            access_modes: ps.and_then(|s| s.access_modes.clone()).unwrap_or_default(),
            ephemeral: false,
            block: spec.block,
            capacity,
            stage_secret: src
                .node_stage_secret_ref
                .as_ref()
                .and_then(|r| SecretRef::of(r, pv_ns)),
            publish_secret: src
                .node_publish_secret_ref
                .as_ref()
                .and_then(|r| SecretRef::of(r, pv_ns)),
            controller_secret: src
                .controller_publish_secret_ref
                .as_ref()
                .and_then(|r| SecretRef::of(r, pv_ns)),
            expand_secret: src
                .node_expand_secret_ref
                .as_ref()
                .and_then(|r| SecretRef::of(r, pv_ns)),
        });
    }
    let Some(src) = &spec.volume.csi else {
        return Err(not_ready("the volume is not a CSI volume".into()));
    };
    let Some(pod) = pod else {
        return Err(not_ready("an inline CSI volume needs its pod".into()));
    };
    Ok(Resolved {
        driver: src.driver.clone(),
        handle: ephemeral_handle(&pod.uid, &spec.volume.name),
        spec_name: spec.volume.name.clone(),
        read_only: src.read_only.unwrap_or(false),
        fs_type: src.fs_type.clone().unwrap_or_default(),
        attributes: src.volume_attributes.clone().unwrap_or_default(),
        mount_options: Vec::new(),
        access_modes: vec!["ReadWriteOnce".into()],
        ephemeral: true,
        block: false,
        capacity: None,
        stage_secret: None,
        publish_secret: src.node_publish_secret_ref.as_ref().map(|r| SecretRef {
            namespace: pod.namespace.clone(),
            name: r.name.clone(),
        }),
        controller_secret: None,
        expand_secret: None,
    })
}

/// The CSI access mode for the volume's Kubernetes access modes, as the kubelet maps them.
fn access_mode(r: &Resolved, driver: &Driver) -> i32 {
    let has = |m: &str| r.access_modes.iter().any(|a| a == m);
    let mode = if has("ReadWriteOncePod") {
        if driver.capabilities.single_node_multi_writer {
            Mode::SingleNodeSingleWriter
        } else {
            Mode::SingleNodeWriter
        }
    } else if has("ReadWriteMany") {
        Mode::MultiNodeMultiWriter
    } else if has("ReadOnlyMany") && !has("ReadWriteOnce") {
        Mode::MultiNodeReaderOnly
    } else if has("ReadWriteOnce") && driver.capabilities.single_node_multi_writer {
        Mode::SingleNodeMultiWriter
    } else {
        Mode::SingleNodeWriter
    };
    mode as i32
}

fn capability(r: &Resolved, driver: &Driver, mount_group: Option<u32>) -> VolumeCapability {
    let access_type = if r.block {
        volume_capability::AccessType::Block(volume_capability::BlockVolume {})
    } else {
        volume_capability::AccessType::Mount(volume_capability::MountVolume {
            fs_type: r.fs_type.clone(),
            mount_flags: r.mount_options.clone(),
            volume_mount_group: mount_group.map(|g| g.to_string()).unwrap_or_default(),
        })
    };
    VolumeCapability {
        access_type: Some(access_type),
        access_mode: Some(AccessMode {
            mode: access_mode(r, driver),
        }),
    }
}

/// A Secret's data as CSI passes secrets. A missing Secret is an error naming it; its values
/// never appear in any message.
fn secrets(
    host: &PluginHost,
    r: Option<&SecretRef>,
) -> Result<HashMap<String, String>, VolumeError> {
    let Some(r) = r else {
        return Ok(HashMap::new());
    };
    let Some(s) = host.store.secret(&r.namespace, &r.name) else {
        return Err(not_ready(format!(
            "Secret {}/{} referenced by the volume {}",
            r.namespace,
            r.name,
            host.store.absence("Secret", &r.namespace, &r.name)
        )));
    };
    Ok(s.object
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), String::from_utf8_lossy(&v.0).into_owned()))
        .collect())
}

fn driver_for(host: &PluginHost, name: &str) -> Result<Arc<Driver>, VolumeError> {
    host.csi.get(name).ok_or_else(|| {
        not_ready(format!(
            "CSI driver {name} is not registered: start it with a registration socket in {}/{} or run kubevol with --csi-driver {name}=unix:///path/to/csi.sock",
            host.root.display(),
            super::registration::REGISTRY_DIR
        ))
    })
}

/// The CSIDriver object's settings, with the API's defaults when there is none.
struct DriverPolicy {
    attach_required: bool,
    pod_info_on_mount: bool,
    fs_group_policy: String,
}

fn policy(host: &PluginHost, driver: &str) -> DriverPolicy {
    let spec = host.store.csi_driver(driver).map(|d| d.object.spec.clone());
    DriverPolicy {
        attach_required: spec
            .as_ref()
            .and_then(|s| s.attach_required)
            .unwrap_or(true),
        pod_info_on_mount: spec
            .as_ref()
            .and_then(|s| s.pod_info_on_mount)
            .unwrap_or(false),
        fs_group_policy: spec
            .as_ref()
            .and_then(|s| s.fs_group_policy.clone())
            .unwrap_or_else(|| "ReadWriteOnceWithFSType".into()),
    }
}

fn csi_dir() -> PathBuf {
    Path::new("plugins").join("kubernetes.io").join("csi")
}

/// Where a volume is staged, relative to the root, and the directory of its `vol_data.json`.
fn staging(r: &Resolved) -> (PathBuf, PathBuf) {
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
fn publish(r: &Resolved, pod: &PodUid) -> (PathBuf, PathBuf) {
    if r.block {
        let d = csi_dir().join("volumeDevices");
        (
            d.join("publish").join(&r.spec_name).join(pod.as_str()),
            d.join(&r.spec_name).join("data"),
        )
    } else {
        let d = Path::new("pods")
            .join(pod.as_str())
            .join("volumes")
            .join(escape_plugin_name(PLUGIN_NAME))
            .join(&r.spec_name);
        (d.join("mount"), d)
    }
}

fn pod_device_link(r: &Resolved, pod: &PodUid) -> PathBuf {
    Path::new("pods")
        .join(pod.as_str())
        .join("volumeDevices")
        .join(escape_plugin_name(PLUGIN_NAME))
        .join(&r.spec_name)
}

const VOL_DATA: &str = "vol_data.json";

/// Writes `vol_data.json` durably (temporary file, fsync, rename) into `dir`, made if missing.
fn write_vol_data(
    host: &PluginHost,
    dir: &Path,
    data: &BTreeMap<&str, String>,
) -> Result<(), VolumeError> {
    host.root_dir.create_dir_all(dir, 0o750)?;
    let abs = host.root.join(dir);
    let body = serde_json::to_vec(data).unwrap_or_default();
    let tmp = abs.join(".vol_data.json.tmp");
    let io = |what: &str, e: std::io::Error| {
        not_ready(format!("{what} {}: {e}", abs.join(VOL_DATA).display()))
    };
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(|e| io("cannot write", e))?;
        f.write_all(&body).map_err(|e| io("cannot write", e))?;
        f.sync_all().map_err(|e| io("cannot sync", e))?;
    }
    std::fs::rename(&tmp, abs.join(VOL_DATA)).map_err(|e| io("cannot write", e))?;
    Ok(())
}

/// Reads a `vol_data.json`.
fn read_vol_data(path: &Path) -> Option<BTreeMap<String, String>> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// The spec of a persistent CSI volume as reconstruction knows it: the PV's name, driver and
/// handle (what unpublish and unstage need).
fn persistent_spec(pv_name: &str, driver: &str, handle: &str) -> VolumeSpec {
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
        volume: Volume {
            name: pv_name.to_string(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource::default()),
            ..Default::default()
        },
        persistent_volume: Some(Arc::new(pv)),
        block: false,
    }
}

/// The staged (globally mounted) filesystem volumes the plugin directory tells of:
/// `plugins/kubernetes.io/csi/<driver>/<hash>/vol_data.json` beside `globalmount`.
pub(crate) fn staged_volumes(host: &PluginHost) -> Vec<(UniqueVolumeName, VolumeSpec, PathBuf)> {
    let mut out = Vec::new();
    let base = host.root.join(csi_dir());
    use crate::reconstruct::dirs;
    for driver_dir in dirs(&base) {
        if driver_dir.file_name().is_some_and(|n| n == "volumeDevices") {
            continue;
        }
        for vol_dir in dirs(&driver_dir) {
            let Some(data) = read_vol_data(&vol_dir.join(VOL_DATA)) else {
                continue;
            };
            let (Some(driver), Some(handle)) = (data.get("driverName"), data.get("volumeHandle"))
            else {
                continue;
            };
            out.push((
                UniqueVolumeName(format!("{PLUGIN_NAME}/{driver}^{handle}")),
                persistent_spec("", driver, handle),
                vol_dir.join("globalmount"),
            ));
        }
    }
    out
}

/// Removes `vol_data.json` and then the directory `dir` and its empty parents up to `stop`,
/// with rmdir only (a directory with anything else in it stays).
fn remove_vol_data(host: &PluginHost, dir: &Path, stop: &Path) {
    let _ = std::fs::remove_file(host.root.join(dir).join(VOL_DATA));
    let mut d = dir.to_path_buf();
    while d.starts_with(stop) && d != stop {
        if std::fs::remove_dir(host.root.join(&d)).is_err() {
            break;
        }
        if !d.pop() {
            break;
        }
    }
}

/// The CSI plugin. It remembers the size each volume was last expanded to.
#[derive(Default)]
pub struct CsiPlugin {
    sizes: Arc<Mutex<HashMap<UniqueVolumeName, i64>>>,
}

impl VolumePlugin for CsiPlugin {
    fn name(&self) -> &'static str {
        PLUGIN_NAME
    }

    fn source_field(&self) -> &'static str {
        "csi"
    }

    fn can_support(&self, spec: &VolumeSpec) -> bool {
        match &spec.persistent_volume {
            Some(pv) => pv.spec.as_ref().is_some_and(|s| s.csi.is_some()),
            None => spec.volume.csi.is_some(),
        }
    }

    fn traits(&self, host: &PluginHost, spec: &VolumeSpec) -> VolumeTraits {
        let persistent = spec.persistent_volume.is_some();
        let attach_required = persistent
            && resolve(spec, None)
                .map(|r| policy(host, &r.driver).attach_required)
                .unwrap_or(true);
        VolumeTraits {
            plugin: PLUGIN_NAME.to_string(),
            attachable: attach_required,
            device_mountable: persistent,
        }
    }

    fn reconstruct(
        &self,
        _host: &PluginHost,
        _pod: &PodRef,
        _name: &str,
        dir: &Path,
        _mounted: bool,
    ) -> Option<(VolumeSpec, PathBuf)> {
        let data = read_vol_data(&dir.join(VOL_DATA))?;
        let (driver, handle, spec_name) = (
            data.get("driverName")?,
            data.get("volumeHandle")?,
            data.get("specVolID")?,
        );
        let spec = if data.get("volumeLifecycleMode").map(String::as_str) == Some("Ephemeral") {
            VolumeSpec {
                volume: k8s_openapi::api::core::v1::Volume {
                    name: spec_name.clone(),
                    csi: Some(k8s_openapi::api::core::v1::CSIVolumeSource {
                        driver: driver.clone(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                persistent_volume: None,
                block: false,
            }
        } else {
            persistent_spec(spec_name, driver, handle)
        };
        Some((spec, dir.join("mount")))
    }

    fn requires_remount(&self) -> bool {
        // Set-up runs again when the claim or volume changes: that is how a grown capacity
        // reaches NodeExpandVolume (set-up of a published volume only expands).
        true
    }

    fn volume_name(&self, pod: &PodRef, spec: &VolumeSpec) -> UniqueVolumeName {
        match resolve(spec, Some(pod)) {
            Ok(r) if !r.ephemeral => {
                UniqueVolumeName(format!("{PLUGIN_NAME}/{}^{}", r.driver, r.handle))
            }
            _ => UniqueVolumeName::for_pod_volume(PLUGIN_NAME, &pod.uid, &spec.volume.name),
        }
    }

    fn attach(
        &self,
        host: Arc<PluginHost>,
        req: DeviceRequest,
    ) -> BoxFuture<Result<BTreeMap<String, String>, VolumeError>> {
        Box::pin(async move {
            let r = resolve(&req.spec, None)?;
            let driver = driver_for(&host, &r.driver)?;
            let Some(mut client) = host.csi.controller_client(&r.driver) else {
                return Err(not_ready(format!(
                    "volume {} needs attaching (its CSIDriver requires attach, or there is no CSIDriver object {0}) but kubevol has no controller endpoint for driver {}: run kubevol with --csi-controller {1}=unix:///path/to/controller.sock, or set attachRequired: false in the CSIDriver",
                    r.handle, r.driver
                )));
            };
            let resp = host
                .csi
                .call(
                    &r.driver,
                    "Controller",
                    "ControllerPublishVolume",
                    client.controller_publish_volume(csi::ControllerPublishVolumeRequest {
                        volume_id: r.handle.clone(),
                        node_id: driver.node_id.clone(),
                        volume_capability: Some(capability(&r, &driver, None)),
                        readonly: r.read_only,
                        secrets: secrets(&host, r.controller_secret.as_ref())?,
                        volume_context: r.attributes.clone().into_iter().collect(),
                    }),
                )
                .await?;
            Ok(resp.publish_context.into_iter().collect())
        })
    }

    fn detach(
        &self,
        host: Arc<PluginHost>,
        req: DeviceRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        Box::pin(async move {
            let r = resolve(&req.spec, None)?;
            let driver = driver_for(&host, &r.driver)?;
            let Some(mut client) = host.csi.controller_client(&r.driver) else {
                return Err(not_ready(format!(
                    "volume {} must be detached but kubevol has no controller endpoint for driver {}: run kubevol with --csi-controller {1}=unix:///path/to/controller.sock",
                    r.handle, r.driver
                )));
            };
            host.csi
                .call(
                    &r.driver,
                    "Controller",
                    "ControllerUnpublishVolume",
                    client.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                        volume_id: r.handle.clone(),
                        node_id: driver.node_id.clone(),
                        secrets: secrets(&host, r.controller_secret.as_ref())?,
                    }),
                )
                .await?;
            Ok(())
        })
    }

    fn mount_device(
        &self,
        host: Arc<PluginHost>,
        req: DeviceRequest,
    ) -> BoxFuture<Result<Option<PathBuf>, VolumeError>> {
        Box::pin(async move {
            let r = resolve(&req.spec, None)?;
            let driver = driver_for(&host, &r.driver)?;
            if !driver.capabilities.stage_unstage_volume {
                return Ok(None);
            }
            let (target, data_dir) = staging(&r);
            let data = BTreeMap::from([
                ("driverName", r.driver.clone()),
                ("volumeHandle", r.handle.clone()),
            ]);
            {
                let (host, target, data_dir) = (host.clone(), target.clone(), data_dir.clone());
                blocking(move || {
                    write_vol_data(&host, &data_dir, &data)?;
                    host.root_dir.create_dir_all(&target, 0o750)?;
                    Ok(())
                })
                .await?;
            }
            let mut client = Drivers::node_client(&driver);
            host.csi
                .call(
                    &r.driver,
                    "Node",
                    "NodeStageVolume",
                    client.node_stage_volume(csi::NodeStageVolumeRequest {
                        volume_id: r.handle.clone(),
                        publish_context: req.publish_context.clone().into_iter().collect(),
                        staging_target_path: host.root.join(&target).display().to_string(),
                        volume_capability: Some(capability(&r, &driver, None)),
                        secrets: secrets(&host, r.stage_secret.as_ref())?,
                        volume_context: r.attributes.clone().into_iter().collect(),
                    }),
                )
                .await?;
            Ok(Some(host.root.join(target)))
        })
    }

    fn unmount_device(
        &self,
        host: Arc<PluginHost>,
        req: DeviceRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        let sizes = self.sizes.clone();
        Box::pin(async move {
            let r = resolve(&req.spec, None)?;
            let driver = driver_for(&host, &r.driver)?;
            if driver.capabilities.stage_unstage_volume {
                let (target, _) = staging(&r);
                let mut client = Drivers::node_client(&driver);
                host.csi
                    .call(
                        &r.driver,
                        "Node",
                        "NodeUnstageVolume",
                        client.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                            volume_id: r.handle.clone(),
                            staging_target_path: host.root.join(&target).display().to_string(),
                        }),
                    )
                    .await?;
            }
            crate::sync::lock(&sizes).remove(&req.volume);
            let (target, data_dir) = staging(&r);
            blocking(move || {
                let abs = host.root.join(&target);
                if abs.exists() && host.mounter.is_mount_point(&abs)? {
                    return Err(VolumeError::Mount(kubevol_mount::MountError::NestedMount {
                        path: abs,
                    }));
                }
                let _ = std::fs::remove_dir(&abs);
                remove_vol_data(&host, &data_dir, &csi_dir());
                Ok(())
            })
            .await
        })
    }

    fn set_up(
        &self,
        host: Arc<PluginHost>,
        req: SetUpRequest,
    ) -> BoxFuture<Result<SetUpResult, VolumeError>> {
        let sizes = self.sizes.clone();
        Box::pin(async move {
            let r = resolve(&req.spec, Some(&req.pod_ref))?;
            let driver = driver_for(&host, &r.driver)?;
            let pol = policy(&host, &r.driver);
            let (target, data_dir) = publish(&r, &req.pod_ref.uid);
            let abs = host.root.join(&target);
            let published = {
                let (host, abs) = (host.clone(), abs.clone());
                blocking(move || Ok(abs.exists() && host.mounter.is_mount_point(&abs)?)).await?
            };
            if !published {
                publish_volume(&host, &req, &r, &driver, &pol, &target, &data_dir).await?;
            }
            if !r.ephemeral && !r.block {
                expand_if_grown(&host, &sizes, &req.volume, &r, &driver, &abs).await?;
            }
            Ok(SetUpResult {
                path: abs,
                read_only: r.read_only,
            })
        })
    }

    fn tear_down(
        &self,
        host: Arc<PluginHost>,
        req: TearDownRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        Box::pin(async move {
            let r = resolve(&req.spec, Some(&req.pod_ref))?;
            let driver = driver_for(&host, &r.driver)?;
            let (target, data_dir) = publish(&r, &req.pod_ref.uid);
            let mut client = Drivers::node_client(&driver);
            host.csi
                .call(
                    &r.driver,
                    "Node",
                    "NodeUnpublishVolume",
                    client.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                        volume_id: r.handle.clone(),
                        target_path: host.root.join(&target).display().to_string(),
                    }),
                )
                .await?;
            blocking(move || {
                let abs = host.root.join(&target);
                if abs.exists() && host.mounter.is_mount_point(&abs)? {
                    // The driver said it unpublished but something is still mounted there:
                    // never remove a directory with a filesystem on it.
                    return Err(VolumeError::Mount(kubevol_mount::MountError::NestedMount {
                        path: abs,
                    }));
                }
                if r.block {
                    let _ =
                        std::fs::remove_file(host.root.join(pod_device_link(&r, &req.pod_ref.uid)));
                    let _ = std::fs::remove_file(&abs);
                    let _ = std::fs::remove_dir(abs.parent().unwrap_or(&abs));
                    // The block data directory is shared by every pod of the volume: it goes
                    // with the staging (unmount device), not here.
                } else {
                    let _ = std::fs::remove_dir(&abs);
                    remove_vol_data(
                        &host,
                        &data_dir,
                        &Path::new("pods")
                            .join(req.pod_ref.uid.as_str())
                            .join("volumes"),
                    );
                }
                Ok(())
            })
            .await
        })
    }
}

/// NodePublishVolume for one pod: `vol_data.json` first, then the call, then fsGroup.
async fn publish_volume(
    host: &Arc<PluginHost>,
    req: &SetUpRequest,
    r: &Resolved,
    driver: &Arc<Driver>,
    pol: &DriverPolicy,
    target: &Path,
    data_dir: &Path,
) -> Result<(), VolumeError> {
    let pod = &req.pod_ref;
    let node = host.node_name.clone();
    let data = BTreeMap::from([
        ("specVolID", r.spec_name.clone()),
        ("volumeHandle", r.handle.clone()),
        ("driverName", r.driver.clone()),
        ("nodeName", node.clone()),
        ("attachmentID", attachment_id(&r.handle, &r.driver, &node)),
        (
            "volumeLifecycleMode",
            if r.ephemeral {
                "Ephemeral"
            } else {
                "Persistent"
            }
            .to_string(),
        ),
    ]);
    {
        let (host, target, data_dir, block) = (
            host.clone(),
            target.to_path_buf(),
            data_dir.to_path_buf(),
            r.block,
        );
        blocking(move || {
            write_vol_data(&host, &data_dir, &data)?;
            // The driver makes the target itself; its parent is kubevol's.
            if let Some(parent) = target.parent() {
                host.root_dir.create_dir_all(parent, 0o750)?;
            }
            let _ = block;
            Ok(())
        })
        .await?;
    }
    let mut context: HashMap<String, String> = r.attributes.clone().into_iter().collect();
    if pol.pod_info_on_mount {
        context.insert(POD_NAME_KEY.into(), pod.name.clone());
        context.insert(POD_NAMESPACE_KEY.into(), pod.namespace.clone());
        context.insert(POD_UID_KEY.into(), pod.uid.to_string());
        context.insert(SERVICE_ACCOUNT_KEY.into(), service_account(&req.pod));
        context.insert(EPHEMERAL_KEY.into(), r.ephemeral.to_string());
    }
    let group_by = fs_group_by(
        &pol.fs_group_policy,
        r,
        driver.capabilities.volume_mount_group,
        fs_group(&req.pod),
    );
    let mount_group = match group_by {
        FsGroupBy::Driver(g) => Some(g),
        _ => None,
    };
    let staging_path = if driver.capabilities.stage_unstage_volume && !r.ephemeral {
        host.root.join(staging(r).0).display().to_string()
    } else {
        String::new()
    };
    let mut client = Drivers::node_client(driver);
    host.csi
        .call(
            &r.driver,
            "Node",
            "NodePublishVolume",
            client.node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: r.handle.clone(),
                publish_context: req.publish_context.clone().into_iter().collect(),
                staging_target_path: staging_path,
                target_path: host.root.join(target).display().to_string(),
                volume_capability: Some(capability(r, driver, mount_group)),
                readonly: r.read_only,
                secrets: secrets(host, r.publish_secret.as_ref())?,
                volume_context: context,
            }),
        )
        .await?;
    let (host, target) = (host.clone(), target.to_path_buf());
    let (block, pod_uid, r2) = (r.block, pod.uid.clone(), r.clone());
    blocking(move || {
        if block {
            let link = host.root.join(pod_device_link(&r2, &pod_uid));
            if let Some(parent) = pod_device_link(&r2, &pod_uid).parent() {
                host.root_dir.create_dir_all(parent, 0o750)?;
            }
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(host.root.join(&target), &link)
                .map_err(|e| not_ready(format!("cannot link {}: {e}", link.display())))?;
        } else if let FsGroupBy::Kubevol(gid, change) = group_by {
            host.root_dir
                .open_beneath(&target)?
                .apply_fs_group(gid, false, change)?;
        }
        Ok(())
    })
    .await
}

/// Who gives a published volume the pod's fsGroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FsGroupBy {
    /// Nobody: no fsGroup, a block or read-only volume, or the CSIDriver's policy says not to.
    Nobody,
    /// The driver, told through `volume_mount_group` (it has VOLUME_MOUNT_GROUP).
    Driver(u32),
    /// kubevol, by walking the volume after publish.
    Kubevol(u32, kubevol_mount::safe::FsGroupPolicy),
}

/// The kubelet's decision, from the CSIDriver's `fsGroupPolicy`: `None` never; a driver with
/// VOLUME_MOUNT_GROUP applies it itself; `File` always; `ReadWriteOnceWithFSType` (the default)
/// only for a volume with an fsType that is ReadWriteOnce (inline volumes count as such).
fn fs_group_by(
    policy: &str,
    r: &Resolved,
    driver_mounts_group: bool,
    group: Option<(u32, kubevol_mount::safe::FsGroupPolicy)>,
) -> FsGroupBy {
    let Some((gid, change)) = group else {
        return FsGroupBy::Nobody;
    };
    if r.block || policy == "None" {
        return FsGroupBy::Nobody;
    }
    if driver_mounts_group {
        return FsGroupBy::Driver(gid);
    }
    let applies = match policy {
        "File" => true,
        _ => {
            !r.fs_type.is_empty()
                && (r.ephemeral || r.access_modes.iter().any(|m| m == "ReadWriteOnce"))
        }
    };
    if applies && !r.read_only {
        FsGroupBy::Kubevol(gid, change)
    } else {
        FsGroupBy::Nobody
    }
}

fn service_account(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into())
}

/// NodeExpandVolume (after ControllerExpandVolume when a controller that can expand is
/// configured) when the PersistentVolume's capacity grew past the size last seen.
async fn expand_if_grown(
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

#[cfg(test)]
mod tests {
    use kubevol_mount::safe::FsGroupPolicy::Always;

    use super::*;

    fn volume(fs_type: &str, modes: &[&str], read_only: bool, block: bool) -> Resolved {
        Resolved {
            driver: "d".into(),
            handle: "h".into(),
            spec_name: "pv".into(),
            read_only,
            fs_type: fs_type.into(),
            attributes: BTreeMap::new(),
            mount_options: Vec::new(),
            access_modes: modes.iter().map(|m| m.to_string()).collect(),
            ephemeral: false,
            block,
            capacity: None,
            stage_secret: None,
            publish_secret: None,
            controller_secret: None,
            expand_secret: None,
        }
    }

    #[test]
    fn fs_group_follows_the_csidriver_policy() {
        let g = Some((1000, Always));
        let rwo_ext4 = volume("ext4", &["ReadWriteOnce"], false, false);
        let rwx_ext4 = volume("ext4", &["ReadWriteMany"], false, false);
        let rwo_no_fs = volume("", &["ReadWriteOnce"], false, false);
        let rows = [
            (
                "default, RWO with fsType",
                "ReadWriteOnceWithFSType",
                &rwo_ext4,
                false,
                g,
                FsGroupBy::Kubevol(1000, Always),
            ),
            (
                "default, RWX",
                "ReadWriteOnceWithFSType",
                &rwx_ext4,
                false,
                g,
                FsGroupBy::Nobody,
            ),
            (
                "default, no fsType",
                "ReadWriteOnceWithFSType",
                &rwo_no_fs,
                false,
                g,
                FsGroupBy::Nobody,
            ),
            (
                "File, RWX without fsType",
                "File",
                &volume("", &["ReadWriteMany"], false, false),
                false,
                g,
                FsGroupBy::Kubevol(1000, Always),
            ),
            ("None", "None", &rwo_ext4, false, g, FsGroupBy::Nobody),
            (
                "None, even with VOLUME_MOUNT_GROUP",
                "None",
                &rwo_ext4,
                true,
                g,
                FsGroupBy::Nobody,
            ),
            (
                "driver applies it",
                "File",
                &rwo_ext4,
                true,
                g,
                FsGroupBy::Driver(1000),
            ),
            (
                "driver applies it under the default too",
                "ReadWriteOnceWithFSType",
                &rwx_ext4,
                true,
                g,
                FsGroupBy::Driver(1000),
            ),
            (
                "read-only",
                "File",
                &volume("ext4", &["ReadWriteOnce"], true, false),
                false,
                g,
                FsGroupBy::Nobody,
            ),
            (
                "block",
                "File",
                &volume("", &["ReadWriteOnce"], false, true),
                true,
                g,
                FsGroupBy::Nobody,
            ),
            (
                "no fsGroup",
                "File",
                &rwo_ext4,
                false,
                None,
                FsGroupBy::Nobody,
            ),
        ];
        for (name, policy, r, driver, group, want) in rows {
            assert_eq!(fs_group_by(policy, r, driver, group), want, "row {name}");
        }
    }
}
