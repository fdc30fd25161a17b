//! image (Kubernetes 1.33, GA in 1.35): an OCI image or artifact mounted read-only. The
//! container runtime pulls and mounts it; the volume manager has nothing to set up, as the
//! kubelet's `kubernetes.io/image` plugin has nothing: the volume is ready at once, its path
//! (`pods/<uid>/volumes/kubernetes.io~image/<volume>`) is never made, and
//! [`crate::VolumeManager::container_mounts`] hands the runtime the image reference instead of
//! a host path.

use std::sync::Arc;

use k8s_openapi::api::core::v1::ImageVolumeSource;
use kubevol_core::state::VolumeSpec;

use super::{BoxFuture, PluginHost, SetUpRequest, SetUpResult, TearDownRequest, VolumePlugin};
use crate::error::VolumeError;

/// The kubelet's name for the plugin.
pub const PLUGIN_NAME: &str = "kubernetes.io/image";

/// The image volume plugin.
pub struct ImagePlugin;

/// The volume's image source, if it is an image volume.
pub fn source(spec: &VolumeSpec) -> Option<&ImageVolumeSource> {
    spec.volume.image.as_ref()
}

impl VolumePlugin for ImagePlugin {
    fn name(&self) -> &'static str {
        PLUGIN_NAME
    }

    fn source_field(&self) -> &'static str {
        "image"
    }

    fn can_support(&self, spec: &VolumeSpec) -> bool {
        source(spec).is_some() && spec.persistent_volume.is_none()
    }

    fn set_up(
        &self,
        host: Arc<PluginHost>,
        req: SetUpRequest,
    ) -> BoxFuture<Result<SetUpResult, VolumeError>> {
        let path = host.pod_volume_path(&req.pod_ref, PLUGIN_NAME, &req.outer_volume_name);
        Box::pin(async move {
            Ok(SetUpResult {
                path,
                read_only: true,
            })
        })
    }

    fn tear_down(
        &self,
        _host: Arc<PluginHost>,
        _req: TearDownRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        Box::pin(async { Ok(()) })
    }
}
