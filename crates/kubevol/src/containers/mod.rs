//! From mounted volumes to a container: what the kubelet's `makeMounts` and `makeDevices` make
//! of a container's `volumeMounts` and `volumeDevices` once its pod's volumes are mounted, for
//! a node agent to hand its container runtime ([`forms`] gives the CRI and OCI forms).
//!
//! Only what the actual state of world holds is handed out: the volume's path as set-up made
//! it (a pinned hostPath's bind, never the host path again), a subPath's own bind mount
//! (never a path resolved again), a block volume's device. The runtime's own mounts (`/etc/hosts`,
//! `/dev/termination-log`, `/etc/resolv.conf`) are not the volume manager's and are not here.

pub mod forms;
pub mod oci;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Pod, VolumeDevice, VolumeMount};
use kubevol_mount::Mounter;
use serde::Serialize;

use crate::world::MountedVolume;

/// What one container gets of its pod's volumes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerMounts {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container.
    pub container: String,
    /// Its `volumeMounts`, in their order.
    pub mounts: Vec<ContainerMount>,
    /// Its `volumeDevices`, in their order.
    pub devices: Vec<ContainerDevice>,
}

/// How mounts propagate between the host and the container (`mountPropagation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Propagation {
    /// `None`: a private mount (`rprivate`).
    None,
    /// Mounts made on the host below the volume reach the container (`rslave`).
    HostToContainer,
    /// Both ways (`rshared`); privileged containers only.
    Bidirectional,
}

/// One of a container's `volumeMounts`, resolved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerMount {
    /// The pod's name for the volume.
    pub volume: String,
    /// Where the container sees it (`mountPath`).
    pub container_path: String,
    /// What the runtime bind-mounts there; none for an image volume.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_path: Option<PathBuf>,
    /// The image the runtime mounts there, for an image volume.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageMount>,
    /// The subPath (`subPathExpr` expanded) whose own bind mount `host_path` is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sub_path: Option<String>,
    /// Read-only: the mount asks for it, or the volume is read-only whatever it asks.
    pub read_only: bool,
    /// Read-only with every mount below it too (`recursiveReadOnly`).
    pub recursive_read_only: bool,
    /// Propagation.
    pub propagation: Propagation,
    /// Whether the runtime relabels the volume for the container's SELinux context (a volume
    /// of the pod's own that was not mounted with the context; the first mount of it).
    pub selinux_relabel: bool,
}

/// An image volume as the runtime gets it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageMount {
    /// The image or artifact reference.
    pub reference: String,
    /// When the runtime pulls it (`Always`, `Never`, `IfNotPresent`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pull_policy: Option<String>,
}

/// One of a container's `volumeDevices`, resolved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDevice {
    /// The pod's name for the volume.
    pub volume: String,
    /// Where the container sees the device (`devicePath`).
    pub container_path: String,
    /// The device the volume manager published for the pod.
    pub host_path: PathBuf,
    /// The cgroup permissions, as the kubelet gives them: `mrw`.
    pub permissions: String,
}

/// Why a container's mounts cannot be given.
#[derive(Debug, thiserror::Error)]
pub enum ContainerMountsError {
    /// The pod has no such container.
    #[error("pod {pod} has no container {container:?}")]
    NoContainer {
        /// `namespace/name`.
        pod: String,
        /// The container asked for.
        container: String,
    },
    /// A mount or device names a volume the pod does not declare.
    #[error("container {container:?} of pod {pod} uses volume {volume:?}, which the pod does not declare in spec.volumes")]
    NoVolume {
        /// `namespace/name`.
        pod: String,
        /// The container.
        container: String,
        /// The volume named.
        volume: String,
    },
    /// The volume is not mounted (yet, or any more).
    #[error("volume {volume:?} of pod {pod} is not mounted: wait for the pod's volumes (wait_for_attach_and_mount) before starting container {container:?}")]
    NotMounted {
        /// `namespace/name`.
        pod: String,
        /// The container.
        container: String,
        /// The volume.
        volume: String,
    },
    /// The volume is mounted but the subPath's own mount is not made.
    #[error("volume {volume:?} of pod {pod} is mounted, but the subPath of container {container:?}'s mount at {container_path:?} is not prepared (yet): wait for the pod's volumes")]
    SubPathNotPrepared {
        /// `namespace/name`.
        pod: String,
        /// The container.
        container: String,
        /// The volume.
        volume: String,
        /// The mount's `mountPath`.
        container_path: String,
    },
    /// The mount cannot be given as asked (a block volume in volumeMounts, a recursive
    /// read-only mount the kernel cannot make, a propagation the host's mounts cannot give).
    #[error("container {container:?} of pod {pod}, volume {volume:?}: {why}")]
    Refused {
        /// `namespace/name`.
        pod: String,
        /// The container.
        container: String,
        /// The volume.
        volume: String,
        /// What is wrong and what to do.
        why: String,
    },
}

impl ContainerMountsError {
    /// Whether it passes once the pod's volumes are mounted (a 409, not a 404).
    pub fn is_not_ready(&self) -> bool {
        matches!(
            self,
            ContainerMountsError::NotMounted { .. }
                | ContainerMountsError::SubPathNotPrepared { .. }
        )
    }
}

/// The container as makeMounts reads it, whatever its kind.
struct ContainerView<'a> {
    name: &'a str,
    mounts: &'a [VolumeMount],
    devices: &'a [VolumeDevice],
    privileged: bool,
}

fn find_container<'a>(
    pod: &'a Pod,
    name: &str,
) -> Option<(
    ContainerView<'a>,
    Option<&'a k8s_openapi::api::core::v1::Container>,
)> {
    let spec = pod.spec.as_ref()?;
    let privileged = |s: Option<&k8s_openapi::api::core::v1::SecurityContext>| {
        s.and_then(|s| s.privileged).unwrap_or(false)
    };
    if let Some(c) = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .find(|c| c.name == name)
    {
        let view = ContainerView {
            name: &c.name,
            mounts: c.volume_mounts.as_deref().unwrap_or_default(),
            devices: c.volume_devices.as_deref().unwrap_or_default(),
            privileged: privileged(c.security_context.as_ref()),
        };
        return Some((view, Some(c)));
    }
    let c = spec
        .ephemeral_containers
        .iter()
        .flatten()
        .find(|c| c.name == name)?;
    let view = ContainerView {
        name: &c.name,
        mounts: c.volume_mounts.as_deref().unwrap_or_default(),
        devices: c.volume_devices.as_deref().unwrap_or_default(),
        privileged: privileged(c.security_context.as_ref()),
    };
    Some((view, None))
}

/// Expands the subPath of a container's (`&Container`) `index`th mount (`&VolumeMount`).
pub(crate) type ExpandSubPath<'a> = dyn Fn(
        &k8s_openapi::api::core::v1::Container,
        usize,
        &VolumeMount,
    ) -> Result<Option<String>, String>
    + 'a;

/// What resolving needs beyond the pod and its mounted volumes.
pub(crate) struct Resolver<'a> {
    /// The subPath of an image volume's mount (`subPathExpr` expanded from the container's
    /// environment), given the container, the mount's index and the mount.
    pub expand: &'a ExpandSubPath<'a>,
    /// Makes mounts propagate from a path handed out as a propagation needs (see
    /// [`propagating`]).
    pub propagate: &'a dyn Fn(&Path, Propagation) -> Result<(), String>,
    /// Whether the kernel makes recursive read-only mounts.
    pub recursive_read_only: bool,
}

impl Resolver<'_> {
    /// The mounts and devices of `container` of `pod`, from its `mounted` volumes.
    pub(crate) fn resolve(
        &self,
        pod: &Pod,
        container: &str,
        mounted: &BTreeMap<String, MountedVolume>,
    ) -> Result<ContainerMounts, ContainerMountsError> {
        let namespace = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = pod.metadata.name.clone().unwrap_or_default();
        let pod_name = format!("{namespace}/{name}");
        let Some((c, full)) = find_container(pod, container) else {
            return Err(ContainerMountsError::NoContainer {
                pod: pod_name,
                container: container.into(),
            });
        };
        let declared = |volume: &str| {
            pod.spec
                .as_ref()
                .and_then(|s| s.volumes.as_ref())
                .and_then(|vs| vs.iter().find(|v| v.name == volume))
        };
        let refused = |volume: &str, why: String| ContainerMountsError::Refused {
            pod: pod_name.clone(),
            container: c.name.into(),
            volume: volume.into(),
            why,
        };
        let mut mounts = Vec::with_capacity(c.mounts.len());
        let mut relabelled: Vec<&str> = Vec::new();
        for (index, m) in c.mounts.iter().enumerate() {
            let Some(volume) = declared(&m.name) else {
                return Err(ContainerMountsError::NoVolume {
                    pod: pod_name,
                    container: c.name.into(),
                    volume: m.name.clone(),
                });
            };
            let Some(v) = mounted.get(&m.name) else {
                return Err(ContainerMountsError::NotMounted {
                    pod: pod_name,
                    container: c.name.into(),
                    volume: m.name.clone(),
                });
            };
            if v.block {
                return Err(refused(&m.name, "it is a block volume (volumeMode Block): use it in volumeDevices, not volumeMounts".into()));
            }
            let propagation = match m.mount_propagation.as_deref() {
                None | Some("None") => Propagation::None,
                Some("HostToContainer") => Propagation::HostToContainer,
                Some("Bidirectional") if c.privileged => Propagation::Bidirectional,
                Some("Bidirectional") => {
                    return Err(refused(&m.name, "Bidirectional mount propagation is available only to privileged containers".into()))
                }
                Some(other) => {
                    return Err(refused(&m.name, format!("mountPropagation {other:?} is not one of None, HostToContainer, Bidirectional")))
                }
            };
            let read_only = m.read_only.unwrap_or(false) || v.read_only;
            let recursive_read_only = match m.recursive_read_only.as_deref() {
                None | Some("Disabled") => false,
                Some(rro @ ("Enabled" | "IfPossible")) => {
                    if !m.read_only.unwrap_or(false) {
                        return Err(refused(&m.name, format!("recursiveReadOnly {rro} may only be specified when readOnly is true")));
                    }
                    if propagation != Propagation::None {
                        return Err(refused(&m.name, format!("recursiveReadOnly {rro} may only be specified when mountPropagation is None or unset")));
                    }
                    if rro == "Enabled" && !self.recursive_read_only {
                        return Err(refused(&m.name, "recursiveReadOnly Enabled needs recursive read-only mounts (mount_setattr, Linux 5.12), which this kernel lacks: use IfPossible, or a newer kernel".into()));
                    }
                    self.recursive_read_only
                }
                Some(other) => {
                    return Err(refused(
                        &m.name,
                        format!(
                        "recursiveReadOnly {other:?} is not one of Disabled, IfPossible, Enabled"
                    ),
                    ))
                }
            };
            let has_sub_path = m.sub_path.as_deref().is_some_and(|p| !p.is_empty())
                || m.sub_path_expr.as_deref().is_some_and(|p| !p.is_empty());
            if let Some(image) = &volume.image {
                // The runtime mounts the image (and its subPath) itself.
                let sub_path = match (has_sub_path, full) {
                    (false, _) => None,
                    (true, Some(full)) => {
                        (self.expand)(full, index, m).map_err(|why| refused(&m.name, why))?
                    }
                    (true, None) => {
                        return Err(refused(
                            &m.name,
                            "an ephemeral container may not use subPath".into(),
                        ))
                    }
                };
                mounts.push(ContainerMount {
                    volume: m.name.clone(),
                    container_path: m.mount_path.clone(),
                    host_path: None,
                    image: Some(ImageMount {
                        reference: image.reference.clone().unwrap_or_default(),
                        pull_policy: image.pull_policy.clone(),
                    }),
                    sub_path,
                    read_only: true,
                    recursive_read_only,
                    propagation,
                    selinux_relabel: false,
                });
                continue;
            }
            let (host_path, sub_path) = if has_sub_path {
                match v
                    .sub_paths
                    .iter()
                    .find(|s| s.container == c.name && s.index == index)
                {
                    Some(s) => (s.path.clone(), Some(s.sub_path.clone())),
                    None => {
                        return Err(ContainerMountsError::SubPathNotPrepared {
                            pod: pod_name,
                            container: c.name.into(),
                            volume: m.name.clone(),
                            container_path: m.mount_path.clone(),
                        })
                    }
                }
            } else {
                (v.path.clone(), None)
            };
            if propagation != Propagation::None {
                (self.propagate)(&host_path, propagation).map_err(|why| refused(&m.name, why))?;
            }
            let relabel = relabels(v) && !relabelled.contains(&m.name.as_str());
            if relabel {
                relabelled.push(&m.name);
            }
            mounts.push(ContainerMount {
                volume: m.name.clone(),
                container_path: m.mount_path.clone(),
                host_path: Some(host_path),
                image: None,
                sub_path,
                read_only,
                recursive_read_only,
                propagation,
                selinux_relabel: relabel,
            });
        }
        let mut devices = Vec::with_capacity(c.devices.len());
        for d in c.devices {
            if declared(&d.name).is_none() {
                return Err(ContainerMountsError::NoVolume {
                    pod: pod_name,
                    container: c.name.into(),
                    volume: d.name.clone(),
                });
            }
            let Some(v) = mounted.get(&d.name) else {
                return Err(ContainerMountsError::NotMounted {
                    pod: pod_name,
                    container: c.name.into(),
                    volume: d.name.clone(),
                });
            };
            if !v.block {
                return Err(refused(&d.name, "it is not a block volume: use it in volumeMounts, or a claim with volumeMode Block".into()));
            }
            devices.push(ContainerDevice {
                volume: d.name.clone(),
                container_path: d.device_path.clone(),
                host_path: v.path.clone(),
                permissions: "mrw".into(),
            });
        }
        Ok(ContainerMounts {
            namespace,
            pod: name,
            container: container.into(),
            mounts,
            devices,
        })
    }
}

/// Whether mounts propagate as `propagation` needs from the mount that holds `path`: a mount of
/// the volume manager's own there (a pinned hostPath, a tmpfs, a CSI volume, a subPath) was
/// made shared at its set-up ([`crate::operations`]), as the kubelet makes its root directory
/// shared; a plain directory must lie on a mount that is shared already (or, for
/// `HostToContainer`, a slave of one), as systemd makes every mount. Only reads the mount
/// table: a read of a container's mounts never changes the node.
pub(crate) fn propagating(
    mounter: &dyn Mounter,
    path: &Path,
    propagation: Propagation,
) -> Result<(), String> {
    let failed =
        |e: kubevol_mount::MountError| format!("cannot read the mounts of {}: {e}", path.display());
    let table = mounter.mount_table().map_err(failed)?;
    let holder = table
        .iter()
        .rev()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.as_os_str().len());
    match holder {
        Some(m) if m.is_shared() => Ok(()),
        Some(m) if m.receives_propagation() && propagation == Propagation::HostToContainer => Ok(()),
        Some(m) => Err(format!(
            "{propagation:?} propagation needs the mount holding {} ({}) to be shared{}, and it is private: make it so (mount --make-rshared {}), as systemd does",
            path.display(),
            m.mount_point.display(),
            if propagation == Propagation::HostToContainer { " or a slave" } else { "" },
            m.mount_point.display()
        )),
        None => Err(format!("no mount holds {}", path.display())),
    }
}

/// Whether the runtime relabels the volume for the container, as the kubelet's plugins say
/// (`SELinuxRelabel` of a volume they manage): not the host's own paths, not a volume mounted
/// with the pod's context already, not a device.
fn relabels(v: &MountedVolume) -> bool {
    let plugin: &str = &v.plugin;
    !v.block
        && !v.selinux_mount
        && plugin != crate::plugins::image::PLUGIN_NAME
        && plugin != "kubernetes.io/host-path"
}

#[cfg(test)]
mod tests;
