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

mod layout;
mod resize;

/// The CSI access mode (`VolumeCapability.AccessMode.Mode`) of a volume whose first access
/// mode is `first`, for a driver with or without SINGLE_NODE_MULTI_WRITER, as the kubelet maps
/// it.
pub(crate) fn csi_access_mode(first: Option<&str>, single_node_multi_writer: bool) -> i32 {
    volume::csi_access_mode(first, single_node_multi_writer) as i32
}
mod health;
mod stats;
mod volume;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::state::{VolumeSpec, VolumeTraits};
use kubevol_core::{PodRef, UniqueVolumeName};
use kubevol_csi::v1::{self as csi};

use crate::csi::{Driver, Drivers};
use crate::error::VolumeError;
use crate::plugins::{
    blocking, fs_group, BoxFuture, DeviceRequest, PluginHost, SetUpRequest, SetUpResult,
    TearDownRequest, VolumePlugin,
};

pub(crate) use layout::staged_volumes;
use layout::*;
use resize::{expand_if_grown, ClusterClaim};
pub(crate) use stats::stats_loop;
use volume::*;
pub use volume::{attachment_id, ephemeral_handle};

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
/// The volume context key (or, with the CSIDriver's `serviceAccountTokenInSecrets`, the
/// secrets key) of the service account tokens the CSIDriver's `tokenRequests` ask for.
pub const TOKENS_KEY: &str = "csi.storage.k8s.io/serviceAccount.tokens";

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

    fn serves_persistent(&self) -> bool {
        true
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
            plugin: kubevol_core::names::SharedStr::interned(PLUGIN_NAME),
            attachable: attach_required,
            device_mountable: persistent,
        }
    }

    fn reconstruct(
        &self,
        host: &PluginHost,
        _pod: &PodRef,
        _name: &str,
        dir: &Path,
        _mounted: bool,
    ) -> Option<(VolumeSpec, PathBuf)> {
        let data = read_vol_data(host, dir)?;
        let (driver, handle, spec_name) = (
            data.get("driverName")?,
            data.get("volumeHandle")?,
            data.get("specVolID")?,
        );
        let spec = if data.get("volumeLifecycleMode").map(String::as_str) == Some("Ephemeral") {
            VolumeSpec {
                volume: kubevol_core::state::PodVolumeRef::from(
                    k8s_openapi::api::core::v1::Volume {
                        name: spec_name.clone(),
                        csi: Some(k8s_openapi::api::core::v1::CSIVolumeSource {
                            driver: driver.clone(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                ),
                persistent_volume: None,
                block: false,
                extensions: Default::default(),
                selinux_label: None,
                selinux_mount: false,
            }
        } else {
            persistent_spec(spec_name, driver, handle)
        };
        Some((spec, dir.join("mount")))
    }

    fn supports_selinux_mount(&self, host: &PluginHost, spec: &VolumeSpec) -> bool {
        let driver = spec
            .persistent_volume
            .as_ref()
            .and_then(|pv| pv.spec.as_ref()?.csi.as_ref());
        driver.is_some_and(|csi| {
            host.store
                .csi_driver(&csi.driver)
                .is_some_and(|d| d.object.spec.se_linux_mount == Some(true))
        })
    }

    fn requires_remount(&self) -> bool {
        // Set-up runs again when the claim or volume changes: that is how a grown capacity
        // reaches NodeExpandVolume (set-up of a published volume only expands).
        true
    }

    fn volume_name(&self, pod: &PodRef, spec: &VolumeSpec) -> UniqueVolumeName {
        match resolve(spec, Some(pod)) {
            Ok(r) if !r.ephemeral => {
                UniqueVolumeName::from(format!("{PLUGIN_NAME}/{}^{}", r.driver, r.handle))
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
            if let Some(controller) = host.attach_controller.get() {
                // The cluster's attach/detach controller attaches it; its VolumeAttachment
                // carries the publish context.
                let attachment = attachment_id(&r.handle, &r.driver, &host.node_name);
                return Ok(controller.attached(req.volume.clone(), attachment).await?);
            }
            let driver = driver_for(&host, &r.driver)?;
            let Some(mut client) = host.csi.controller_client(&r.driver) else {
                return Err(not_ready(format!(
                    "volume {} needs attaching (its CSIDriver requires attach, or there is no CSIDriver object {1}) but kubevol has no controller endpoint for driver {}: run kubevol with --csi-controller {1}=unix:///path/to/controller.sock, or set attachRequired: false in the CSIDriver",
                    r.handle, r.driver
                )));
            };
            if !publishes(&host, &r.driver).await? {
                // As the external-attacher: a controller without PUBLISH_UNPUBLISH_VOLUME has
                // nothing to attach; the volume is attached at once, with no publish context.
                return Ok(BTreeMap::new());
            }
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
                        readonly: r.controller_read_only,
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
            if host.attach_controller.get().is_some() {
                // The controller detaches once the node no longer reports it in use.
                return Ok(());
            }
            let r = resolve(&req.spec, None)?;
            let driver = driver_for(&host, &r.driver)?;
            let Some(mut client) = host.csi.controller_client(&r.driver) else {
                return Err(not_ready(format!(
                    "volume {} must be detached but kubevol has no controller endpoint for driver {}: run kubevol with --csi-controller {1}=unix:///path/to/controller.sock",
                    r.handle, r.driver
                )));
            };
            if !publishes(&host, &r.driver).await? {
                return Ok(());
            }
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
            let driver = r.driver.clone();
            blocking(move || {
                let abs = host.root.join(&target);
                not_left_mounted(&host, &abs, driver, "NodeUnstageVolume")?;
                let _ = host.root_dir.remove_beneath(&target, true);
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
            // A driver with requiresRepublish is called again on a mounted volume (to renew
            // what it got with it, such as tokens), each time the volume is set up again.
            if !published || pol.requires_republish {
                publish_volume(&host, &req, &r, &driver, &pol, &target, &data_dir).await?;
            }
            if !r.ephemeral && !r.block {
                let claim = cluster_claim(&host, &req);
                expand_if_grown(&host, &sizes, &req.volume, &r, &driver, &abs, claim).await?;
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
            let driver = r.driver.clone();
            blocking(move || {
                let abs = host.root.join(&target);
                not_left_mounted(&host, &abs, driver, "NodeUnpublishVolume")?;
                if r.block {
                    let root = &host.root_dir;
                    let _ = root.remove_beneath(&pod_device_link(&r, &req.pod_ref.uid), false);
                    let _ = root.remove_beneath(&target, false);
                    if let Some(parent) = target.parent() {
                        let _ = root.remove_beneath(parent, true);
                    }
                    // The block data directory is shared by every pod of the volume: it goes
                    // with the staging (unmount device), not here.
                } else {
                    let _ = host.root_dir.remove_beneath(&target, true);
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
        context.insert(POD_NAME_KEY.into(), pod.name.to_string());
        context.insert(POD_NAMESPACE_KEY.into(), pod.namespace.to_string());
        context.insert(POD_UID_KEY.into(), pod.uid.to_string());
        context.insert(
            SERVICE_ACCOUNT_KEY.into(),
            crate::tokens::service_account(&req.pod),
        );
        context.insert(EPHEMERAL_KEY.into(), r.ephemeral.to_string());
    }
    let mut secrets = secrets(host, r.publish_secret.as_ref())?;
    if let Some(tokens) = service_account_tokens(host, req, &r.driver, pol).await? {
        if pol.tokens_in_secrets {
            secrets.insert(TOKENS_KEY.into(), tokens);
        } else {
            context.insert(TOKENS_KEY.into(), tokens);
        }
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
                secrets,
                volume_context: context,
            }),
        )
        .await?;
    let (host, target) = (host.clone(), target.to_path_buf());
    let (block, pod_uid, r2) = (r.block, pod.uid.clone(), r.clone());
    let (pod_ref, volume) = (pod.clone(), req.outer_volume_name.clone());
    blocking(move || {
        if block {
            let link = pod_device_link(&r2, &pod_uid);
            host.root_dir
                .replace_symlink(&link, &host.root.join(&target))
                .map_err(|e| {
                    not_ready(format!(
                        "cannot link {}: {e}",
                        host.root.join(&link).display()
                    ))
                })?;
        } else if let FsGroupBy::Kubevol(gid, change) = group_by {
            let dir = host.root_dir.open_beneath(&target)?;
            host.apply_fs_group(&pod_ref, &volume, &dir, gid, change)?;
        }
        Ok(())
    })
    .await
}

/// The claim of a volume when it comes from the API server (whose status the node writes
/// during an expansion), with the PersistentVolume's capacity.
fn cluster_claim(host: &PluginHost, req: &SetUpRequest) -> Option<ClusterClaim> {
    host.claim_status.get()?;
    let name = kubevol_core::names::claim_name(&req.pod_ref.name, &req.spec.volume)?;
    let stored = host
        .store
        .persistent_volume_claim(&req.pod_ref.namespace, &name)
        .filter(|s| s.origin == crate::store::Origin::Cluster)?;
    let new_capacity = req
        .spec
        .persistent_volume
        .as_ref()?
        .spec
        .as_ref()?
        .capacity
        .as_ref()?
        .get("storage")?
        .0
        .clone();
    Some(ClusterClaim {
        name: name.into_owned(),
        claim: stored.object,
        new_capacity,
        pod: req.pod_ref.clone(),
    })
}

/// How often a volume of a driver with `requiresRepublish` is published again when no token
/// falls due sooner (the kubelet republishes at each pod sync, about once a minute).
const REPUBLISH_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

/// The service account tokens the CSIDriver's `tokenRequests` ask for, bound to the pod, as
/// the kubelet hands them to NodePublishVolume: a JSON object of audience to `{"token",
/// "expirationTimestamp"}`. With `requiresRepublish` the pod is set up again when the first
/// token is due for refreshing, and at least every [`REPUBLISH_PERIOD`]. `None` when the driver
/// asks for none.
async fn service_account_tokens(
    host: &PluginHost,
    req: &SetUpRequest,
    driver: &str,
    pol: &DriverPolicy,
) -> Result<Option<String>, VolumeError> {
    let pod = &req.pod_ref;
    let mut due = pol
        .requires_republish
        .then(|| tokio::time::Instant::now() + REPUBLISH_PERIOD);
    if pol.token_requests.is_empty() {
        if let Some(at) = due {
            host.refresh_at(pod.uid.clone(), at);
        }
        return Ok(None);
    }
    let mut out = serde_json::Map::new();
    for (audience, expiration) in &pol.token_requests {
        let spec = crate::tokens::TokenSpec::for_pod(pod, &req.pod, Some(audience), *expiration);
        let granted = match host.tokens.get(spec).await {
            Some(Ok(g)) => g,
            Some(Err(why)) => {
                return Err(not_ready(format!(
                    "a service account token for audience {audience:?} of CSIDriver {driver} (spec.tokenRequests) was not issued: {why}"
                )))
            }
            // No issuer: standalone mode.
            None => {
                return Err(VolumeError::CsiNeedsCluster {
                    driver: driver.to_string(),
                })
            }
        };
        // Only a driver that is published again gets new tokens on a mounted volume.
        if pol.requires_republish {
            due = Some(due.map_or(granted.refresh_at, |d| d.min(granted.refresh_at)));
        }
        let expires = k8s_openapi::jiff::Timestamp::try_from(granted.expires)
            .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time)
            .map_err(|e| not_ready(format!("a token's expiry cannot be written: {e}")))?;
        out.insert(
            audience.clone(),
            serde_json::json!({"token": granted.token, "expirationTimestamp": expires}),
        );
    }
    if let Some(at) = due {
        host.refresh_at(pod.uid.clone(), at);
    }
    Ok(Some(serde_json::Value::Object(out).to_string()))
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

/// After a driver answered `call` (an unpublish or unstage) with OK: its target must not be
/// mounted any more, since a directory with a filesystem on it is never removed.
fn not_left_mounted(
    host: &PluginHost,
    target: &Path,
    driver: String,
    call: &'static str,
) -> Result<(), VolumeError> {
    if target.exists() && host.mounter.is_mount_point(target)? {
        return Err(VolumeError::DriverLeftMount {
            driver,
            call,
            path: target.to_path_buf(),
            holders: host.mounter.holders(target).map(Box::new),
        });
    }
    Ok(())
}

/// Who applies the pod's fsGroup to a CSI volume, in words (for `describe`): the decision the
/// set-up makes, from the same inputs.
pub(crate) fn fs_group_decision(host: &PluginHost, spec: &VolumeSpec, pod: &Pod) -> Option<String> {
    let group = fs_group(pod)?;
    let r = volume::resolve(spec, None).ok()?;
    let pol = policy(host, &r.driver);
    let mounts_group = host
        .csi
        .status()
        .iter()
        .any(|d| d.name == r.driver && d.capabilities.volume_mount_group);
    let policy = &pol.fs_group_policy;
    Some(match fs_group_by(policy, &r, mounts_group, Some(group)) {
        FsGroupBy::Kubevol(gid, _) => {
            format!("fsGroup {gid}: applied by kubevol after publish (fsGroupPolicy {policy})")
        }
        FsGroupBy::Driver(gid) => {
            format!("fsGroup {gid}: applied by the driver (it has VOLUME_MOUNT_GROUP)")
        }
        FsGroupBy::Nobody => format!(
            "fsGroup {}: not applied (fsGroupPolicy {policy}{})",
            group.0,
            if r.block {
                ", a block volume"
            } else if r.read_only {
                ", read-only"
            } else {
                ""
            }
        ),
    })
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

/// The data of the Secret `r` names (in `default_ns` when it names no namespace), for the
/// `secrets` of a CSI call the provisioner makes.
pub(crate) fn secret_data(
    host: &PluginHost,
    r: &k8s_openapi::api::core::v1::SecretReference,
    default_ns: &str,
) -> Result<HashMap<String, String>, VolumeError> {
    volume::secrets(host, volume::SecretRef::of(r, default_ns).as_ref())
}

/// Whether `driver`'s controller publishes volumes (`PUBLISH_UNPUBLISH_VOLUME`, asked once).
async fn publishes(host: &PluginHost, driver: &str) -> Result<bool, VolumeError> {
    use kubevol_csi::v1::controller_service_capability::rpc::Type;
    Ok(host
        .csi
        .controller_has(driver, Type::PublishUnpublishVolume)
        .await?)
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
            controller_read_only: read_only,
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
