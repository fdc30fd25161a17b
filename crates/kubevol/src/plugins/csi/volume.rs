//! A CSI volume as the calls see it: its driver, handle, capability, secrets and the
//! CSIDriver's policy, from its PersistentVolume or inline source.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::SecretReference;
use kubevol_core::state::VolumeSpec;
use kubevol_core::{PodRef, PodUid};
use kubevol_csi::v1::volume_capability::{self, access_mode::Mode, AccessMode};
use kubevol_csi::v1::VolumeCapability;
use sha2::{Digest, Sha256};

use crate::csi::Driver;
use crate::error::VolumeError;
use crate::plugins::PluginHost;

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn sha256_hex(s: &str) -> String {
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
pub(super) struct SecretRef {
    pub(super) namespace: String,
    pub(super) name: String,
}

impl SecretRef {
    pub(super) fn of(r: &SecretReference, default_ns: &str) -> Option<SecretRef> {
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
pub(super) struct Resolved {
    pub(super) driver: String,
    pub(super) handle: String,
    /// The PersistentVolume's name, or the pod's volume name for inline volumes.
    pub(super) spec_name: String,
    /// NodePublishVolume's `readonly`, as the kubelet sends it: the claim volume's `readOnly`
    /// (an inline volume's own `readOnly`).
    pub(super) read_only: bool,
    /// ControllerPublishVolume's `readonly`: the PersistentVolume's `spec.csi.readOnly`, as
    /// the external attacher sends it.
    pub(super) controller_read_only: bool,
    pub(super) fs_type: String,
    pub(super) attributes: BTreeMap<String, String>,
    pub(super) mount_options: Vec<String>,
    pub(super) access_modes: Vec<String>,
    pub(super) ephemeral: bool,
    pub(super) block: bool,
    pub(super) capacity: Option<i64>,
    pub(super) stage_secret: Option<SecretRef>,
    pub(super) publish_secret: Option<SecretRef>,
    pub(super) controller_secret: Option<SecretRef>,
    pub(super) expand_secret: Option<SecretRef>,
}

/// The SELinux mount option of `label`, or why there is none.
fn context_option(label: &str) -> Result<String, VolumeError> {
    kubevol_core::selinux::context_option(label).ok_or_else(|| VolumeError::MountOption {
        option: format!("context={label:?}"),
        detail: "holds a character no SELinux label has, which would end the option early: fix the pod's seLinuxOptions",
    })
}

pub(super) fn not_ready(msg: String) -> VolumeError {
    VolumeError::CsiNotReady(msg)
}

/// What the calls of `spec`'s volume need. Its driver and its name become directories under
/// the root: each passes the one constructor of path components.
pub(super) fn resolve(spec: &VolumeSpec, pod: Option<&PodRef>) -> Result<Resolved, VolumeError> {
    let r = resolve_source(spec, pod)?;
    kubevol_core::names::PathName::new("the CSI driver's name", &r.driver)?;
    kubevol_core::names::PathName::new("the volume's name", &r.spec_name)?;
    Ok(r)
}

fn resolve_source(spec: &VolumeSpec, pod: Option<&PodRef>) -> Result<Resolved, VolumeError> {
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
            read_only: spec
                .volume
                .persistent_volume_claim
                .as_ref()
                .and_then(|c| c.read_only)
                .unwrap_or(false),
            controller_read_only: src.read_only.unwrap_or(false),
            fs_type: src.fs_type.clone().unwrap_or_default(),
            attributes: src.volume_attributes.clone().unwrap_or_default(),
            mount_options: {
                let mut options = ps.and_then(|s| s.mount_options.clone()).unwrap_or_default();
                // Stage and publish alike, as the kubelet does.
                if let Some(label) = spec.selinux_label.as_deref().filter(|_| spec.selinux_mount) {
                    options.push(context_option(label)?);
                }
                options
            },
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
        controller_read_only: src.read_only.unwrap_or(false),
        fs_type: src.fs_type.clone().unwrap_or_default(),
        attributes: src.volume_attributes.clone().unwrap_or_default(),
        mount_options: Vec::new(),
        access_modes: vec!["ReadWriteOnce".into()],
        ephemeral: true,
        block: false,
        capacity: None,
        stage_secret: None,
        publish_secret: src.node_publish_secret_ref.as_ref().map(|r| SecretRef {
            namespace: pod.namespace.to_string(),
            name: r.name.clone(),
        }),
        controller_secret: None,
        expand_secret: None,
    })
}

/// The CSI access mode for the volume's Kubernetes access modes, as the kubelet sends it: the
/// PersistentVolume's first access mode (ReadWriteOnce for an inline volume, or a volume that
/// lists none), mapped as the kubelet maps it for a driver with or without the
/// SINGLE_NODE_MULTI_WRITER capability.
pub(super) fn access_mode(r: &Resolved, driver: &Driver) -> i32 {
    csi_access_mode(
        r.access_modes.first().map(String::as_str),
        driver.capabilities.single_node_multi_writer,
    ) as i32
}

/// The mapping of [`access_mode`].
pub(super) fn csi_access_mode(first: Option<&str>, single_node_multi_writer: bool) -> Mode {
    match (first.unwrap_or("ReadWriteOnce"), single_node_multi_writer) {
        ("ReadOnlyMany", _) => Mode::MultiNodeReaderOnly,
        ("ReadWriteMany", _) => Mode::MultiNodeMultiWriter,
        ("ReadWriteOncePod", true) => Mode::SingleNodeSingleWriter,
        ("ReadWriteOnce", true) => Mode::SingleNodeMultiWriter,
        // ReadWriteOnce, and ReadWriteOncePod for a driver without the capability.
        _ => Mode::SingleNodeWriter,
    }
}

pub(super) fn capability(
    r: &Resolved,
    driver: &Driver,
    mount_group: Option<u32>,
) -> VolumeCapability {
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
pub(super) fn secrets(
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

pub(super) fn driver_for(host: &PluginHost, name: &str) -> Result<Arc<Driver>, VolumeError> {
    host.csi
        .get(name)
        .ok_or_else(|| not_ready(not_registered(&host.root, name)))
}

/// Why a driver is not there, and how to register it; also when the registration directory is
/// so deep that the socket a registrar makes there (`<driver>-reg.sock`) cannot be bound.
fn not_registered(root: &std::path::Path, name: &str) -> String {
    let dir = root.join(crate::csi::registration::REGISTRY_DIR);
    let mut message = format!(
        "CSI driver {name} is not registered: start it with a registration socket in {} or run kubevol with --csi-driver {name}=unix:///path/to/csi.sock",
        dir.display()
    );
    // A unix socket's path has 108 bytes, its terminating NUL among them.
    let socket = dir.join(format!("{name}-reg.sock"));
    let len = socket.as_os_str().len();
    if len > 107 {
        message.push_str(&format!(
            " (a socket there, {}, would have a path of {len} bytes, longer than the 107 a unix socket's path can have: give kubevol a shorter --root-dir)",
            socket.display()
        ));
    }
    message
}

/// The CSIDriver object's settings, with the API's defaults when there is none.
pub(super) struct DriverPolicy {
    pub(super) attach_required: bool,
    pub(super) pod_info_on_mount: bool,
    pub(super) fs_group_policy: String,
    /// `tokenRequests`: the audiences (`""`: the API server's own) and lifetimes of the
    /// service account tokens NodePublishVolume carries.
    pub(super) token_requests: Vec<(String, Option<i64>)>,
    /// `requiresRepublish`: NodePublishVolume is called again periodically, on a mounted volume.
    pub(super) requires_republish: bool,
    /// `serviceAccountTokenInSecrets`: the tokens go into NodePublishVolume's secrets, not
    /// into its volume context.
    pub(super) tokens_in_secrets: bool,
}

pub(super) fn policy(host: &PluginHost, driver: &str) -> DriverPolicy {
    let spec = host
        .store
        .csi_driver(driver)
        .map(|d| d.object.spec.clone())
        .unwrap_or_default();
    DriverPolicy {
        attach_required: spec.attach_required.unwrap_or(true),
        pod_info_on_mount: spec.pod_info_on_mount.unwrap_or(false),
        fs_group_policy: spec
            .fs_group_policy
            .unwrap_or_else(|| "ReadWriteOnceWithFSType".into()),
        token_requests: spec
            .token_requests
            .into_iter()
            .flatten()
            .map(|t| (t.audience, t.expiration_seconds))
            .collect(),
        requires_republish: spec.requires_republish.unwrap_or(false),
        tokens_in_secrets: spec.service_account_token_in_secrets.unwrap_or(false),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn the_access_mode_is_the_first_one_mapped_as_the_kubelet_maps_it() {
        use super::{csi_access_mode, Mode};
        let rows = [
            (None, false, Mode::SingleNodeWriter),
            (Some("ReadWriteOnce"), false, Mode::SingleNodeWriter),
            (Some("ReadWriteOnce"), true, Mode::SingleNodeMultiWriter),
            (Some("ReadOnlyMany"), true, Mode::MultiNodeReaderOnly),
            (Some("ReadWriteMany"), false, Mode::MultiNodeMultiWriter),
            (Some("ReadWriteOncePod"), false, Mode::SingleNodeWriter),
            (Some("ReadWriteOncePod"), true, Mode::SingleNodeSingleWriter),
        ];
        for (first, multi, want) in rows {
            assert_eq!(csi_access_mode(first, multi), want, "{first:?} {multi}");
        }
    }

    /// The message says where to register; when the directory is too deep for a registrar's
    /// socket, it says so and what to change.
    #[test]
    fn an_unregistered_driver_is_named_with_where_to_register_it() {
        let short = super::not_registered(Path::new("/var/lib/kubevol"), "loop.csi.kubevol.io");
        assert_eq!(
            short,
            "CSI driver loop.csi.kubevol.io is not registered: start it with a registration socket in /var/lib/kubevol/plugins_registry or run kubevol with --csi-driver loop.csi.kubevol.io=unix:///path/to/csi.sock"
        );
        // 61 bytes of root leave the socket 107: still bindable.
        let root = format!("/{}", "r".repeat(60));
        assert!(
            !super::not_registered(Path::new(&root), "loop.csi.kubevol.io").contains("shorter")
        );
        let root = format!("/{}", "r".repeat(61));
        let deep = super::not_registered(Path::new(&root), "loop.csi.kubevol.io");
        assert!(
            deep.ends_with(&format!(
                " (a socket there, {root}/plugins_registry/loop.csi.kubevol.io-reg.sock, would have a path of 108 bytes, longer than the 107 a unix socket's path can have: give kubevol a shorter --root-dir)"
            )),
            "{deep}"
        );
    }
}
