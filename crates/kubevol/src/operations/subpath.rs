//! subPath and subPathExpr: after a volume is set up for a pod, each container mount of it with
//! a subPath gets its own bind mount (made by the mount layer from a descriptor, never a path);
//! before the volume is torn down, those mounts go first.

use std::path::Path;
use std::sync::Arc;

use kubevol_core::projection::{container_env, expand_sub_path};
use kubevol_core::state::{DesiredPodVolume, SubPathMount};
use kubevol_core::validation::all_containers;
use kubevol_core::PodRef;
use kubevol_mount::safe::Dir;
use kubevol_mount::subpath;

use crate::error::VolumeError;
use crate::plugins::{PluginHost, StoreObjects};

/// One wanted subPath mount.
struct Wanted {
    container: String,
    index: usize,
    sub_path: String,
    /// The Secret values the path was made with: kept out of every message about it.
    secrets: Vec<String>,
}

/// The subPath mounts the pod's containers want of one volume, with `subPathExpr` expanded
/// from each container's environment. None for an image volume: the runtime mounts its subPath.
fn wanted(host: &PluginHost, want: &DesiredPodVolume) -> Result<Vec<Wanted>, VolumeError> {
    let mut out = Vec::new();
    if crate::plugins::image::source(&want.spec).is_some() {
        return Ok(out);
    }
    for (_, c) in all_containers(&want.pod) {
        for (index, m) in c.volume_mounts.iter().flatten().enumerate() {
            if want.outer_volume_name != m.name.as_str() {
                continue;
            }
            if let Some((sub_path, secrets)) = sub_path_of(host, &want.pod, c, index, m)? {
                out.push(Wanted {
                    container: c.name.clone(),
                    index,
                    sub_path,
                    secrets,
                });
            }
        }
    }
    Ok(out)
}

/// The subPath of the `index`th volumeMount `m` of container `c`, `subPathExpr` expanded from
/// the container's environment, with the Secret values it was made with (none without one).
pub(crate) fn sub_path_of(
    host: &PluginHost,
    pod: &k8s_openapi::api::core::v1::Pod,
    c: &k8s_openapi::api::core::v1::Container,
    index: usize,
    m: &k8s_openapi::api::core::v1::VolumeMount,
) -> Result<Option<(String, Vec<String>)>, VolumeError> {
    Ok(match (m.sub_path.as_deref(), m.sub_path_expr.as_deref()) {
        (Some(p), _) if !p.is_empty() => Some((p.to_string(), Vec::new())),
        (_, Some(expr)) if !expr.is_empty() => {
            let env = container_env(
                pod,
                c,
                &host.node_name,
                &StoreObjects(&host.store),
                &host.node_allocatable,
            );
            let path = expand_sub_path(expr, &env).map_err(|detail| VolumeError::SubPath {
                container: c.name.clone(),
                index,
                detail,
            })?;
            Some((path, env.secret_values()))
        }
        _ => None,
    })
}

fn open_volume(host: &PluginHost, volume_path: &Path) -> Result<Dir, VolumeError> {
    Ok(match volume_path.strip_prefix(&host.root) {
        Ok(rel) => host.root_dir.open_beneath(rel)?,
        // A hostPath volume: the operator-allowed host directory itself.
        Err(_) => Dir::open(volume_path)?,
    })
}

fn pod_dir(host: &PluginHost, pod: &PodRef) -> Result<Option<Dir>, VolumeError> {
    match host
        .root_dir
        .open_beneath(&Path::new("pods").join(pod.uid.as_str()))
    {
        Ok(d) => Ok(Some(d)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Makes the subPath mounts of one set-up volume. Idempotent: mounts already made are kept.
pub(crate) async fn bind_all(
    host: Arc<PluginHost>,
    want: &DesiredPodVolume,
    volume_path: &Path,
) -> Result<Vec<SubPathMount>, VolumeError> {
    let wanted = wanted(&host, want)?;
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let volume_path = volume_path.to_path_buf();
    let pod = want.pod_ref.clone();
    let volume_name = want.outer_volume_name.clone();
    crate::plugins::blocking(move || bind(&host, wanted, &volume_path, &pod, &volume_name)).await
}

/// [`bind_all`] on this thread.
pub(crate) fn bind_all_now(
    host: &PluginHost,
    want: &DesiredPodVolume,
    volume_path: &Path,
) -> Result<Vec<SubPathMount>, VolumeError> {
    let wanted = wanted(host, want)?;
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    bind(
        host,
        wanted,
        volume_path,
        &want.pod_ref,
        &want.outer_volume_name,
    )
}

fn bind(
    host: &PluginHost,
    wanted: Vec<Wanted>,
    volume_path: &Path,
    pod: &PodRef,
    volume_name: &str,
) -> Result<Vec<SubPathMount>, VolumeError> {
    let volume = open_volume(host, volume_path)?;
    let (pod_dir, _) = host
        .root_dir
        .create_dir_all(&Path::new("pods").join(pod.uid.as_str()), 0o750)?;
    let mut made = Vec::new();
    for w in wanted {
        let path = subpath::bind_sub_path(
            host.mounter.as_ref(),
            &volume,
            &w.sub_path,
            &pod_dir,
            volume_name,
            &w.container,
            w.index,
        )
        .map_err(|e| {
            let e = match e {
                kubevol_mount::MountError::Unsafe { .. } => VolumeError::SubPath {
                    container: w.container.clone(),
                    index: w.index,
                    detail: format!("subPath {:?}: {e}", w.sub_path),
                },
                e => e.into(),
            };
            VolumeError::redacted(e, &w.secrets)
        })?;
        made.push(SubPathMount {
            container: w.container,
            index: w.index,
            sub_path: w.sub_path,
            path,
        });
    }
    Ok(made)
}

/// Removes every subPath mount of one of a pod's volumes.
pub(crate) async fn unmount_all(
    host: Arc<PluginHost>,
    pod: &PodRef,
    volume_name: &str,
) -> Result<(), VolumeError> {
    let pod = pod.clone();
    let volume_name = volume_name.to_string();
    crate::plugins::blocking(move || unmount_all_now(&host, &pod, &volume_name)).await
}

/// [`unmount_all`] on this thread.
pub(crate) fn unmount_all_now(
    host: &PluginHost,
    pod: &PodRef,
    volume_name: &str,
) -> Result<(), VolumeError> {
    let Some(dir) = pod_dir(host, pod)? else {
        return Ok(());
    };
    // The same unmount as a volume's: every stacked or dead layer, lazily if allowed.
    subpath::unmount_sub_paths(&|p| host.unmount_all(p), &dir, volume_name)?;
    Ok(())
}

/// Makes shared the mounts of kubevol's own (below the root directory) that the pod's
/// containers mount with `mountPropagation` HostToContainer or Bidirectional: the volume's own
/// mount, or a subPath's bind mount of it, as the kubelet makes its root directory shared. Done
/// at set-up, so that a read of a container's mounts never has to change the node. A plain
/// directory is left as it is (it must lie on a shared mount, which the read checks).
pub(crate) fn share_for_propagation(
    host: &PluginHost,
    want: &DesiredPodVolume,
    volume_path: &Path,
    subs: &[SubPathMount],
) -> Result<(), VolumeError> {
    for (_, c) in all_containers(&want.pod) {
        for (index, m) in c.volume_mounts.iter().flatten().enumerate() {
            let propagates = matches!(
                m.mount_propagation.as_deref(),
                Some("HostToContainer" | "Bidirectional")
            );
            if want.outer_volume_name != m.name.as_str() || !propagates {
                continue;
            }
            let path = subs
                .iter()
                .find(|s| s.container == c.name && s.index == index)
                .map_or(volume_path, |s| s.path.as_path());
            if path.starts_with(&host.root) && host.mounter.is_mount_point(path)? {
                host.mounter.make_shared(path)?;
            }
        }
    }
    Ok(())
}
