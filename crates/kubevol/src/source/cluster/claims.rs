//! Claims' statuses, written as the kubelet writes them: the node's part of an expansion.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, Patch, PatchParams};

use super::backoff::api_error;
use crate::error::ApiError;
use crate::source::BoxFuture;

/// Writes claims' statuses with the node's identity (the Node authorizer lets a node patch
/// `persistentvolumeclaims/status` of its pods' claims, and NodeRestriction only their
/// capacity, conditions and allocated resources).
pub struct ClusterClaims {
    client: kube::Client,
}

impl ClusterClaims {
    /// A writer through `client`.
    pub fn new(client: kube::Client) -> Self {
        ClusterClaims { client }
    }
}

impl crate::plugins::ClaimStatusWriter for ClusterClaims {
    fn get(
        &self,
        namespace: String,
        name: String,
    ) -> BoxFuture<Result<PersistentVolumeClaim, ApiError>> {
        let api: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &namespace);
        Box::pin(async move {
            api.get(&name).await.map_err(|e| {
                api_error(
                    format_args!("cannot read PersistentVolumeClaim {namespace}/{name}"),
                    &e,
                    ApiError::Waiting,
                )
            })
        })
    }

    fn patch_status(
        &self,
        namespace: String,
        name: String,
        patch: serde_json::Value,
    ) -> BoxFuture<Result<PersistentVolumeClaim, ApiError>> {
        let api: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &namespace);
        Box::pin(async move {
            api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| {
                    api_error(
                        format_args!(
                            "cannot write the status of PersistentVolumeClaim {namespace}/{name}"
                        ),
                        &e,
                        ApiError::Waiting,
                    )
                })
        })
    }
}
