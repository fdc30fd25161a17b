//! Service account tokens for projected volumes, from the API server's TokenRequest.

use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::Api;

use super::backoff::api_error;
use crate::error::ApiError;
use crate::source::BoxFuture;
use crate::tokens::{IssuedToken, TokenIssuer, TokenSpec};

/// Service account tokens from the API server's TokenRequest, bound to the pod (its name and
/// UID), with the source's audience and lifetime.
pub struct ClusterTokens {
    client: kube::Client,
}

impl ClusterTokens {
    /// An issuer asking the API server `client` reaches (with the node's identity: the server
    /// grants tokens only for pods bound to the node, for their own service account).
    pub fn new(client: kube::Client) -> Self {
        ClusterTokens { client }
    }
}

impl TokenIssuer for ClusterTokens {
    fn issue(&self, spec: TokenSpec) -> BoxFuture<Result<IssuedToken, ApiError>> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &spec.namespace);
        Box::pin(async move {
            let request = TokenRequest {
                spec: TokenRequestSpec {
                    audiences: spec.audience.clone().into_iter().collect(),
                    expiration_seconds: Some(spec.expiration_seconds),
                    bound_object_ref: Some(BoundObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        name: Some(spec.pod_name.clone()),
                        uid: Some(spec.pod_uid.clone()),
                    }),
                },
                ..Default::default()
            };
            let what = format!(
                "a token of service account {}/{} for pod {}",
                spec.namespace, spec.service_account, spec.pod_name
            );
            let answer = api
                .create_token_request(&spec.service_account, &Default::default(), &request)
                .await
                .map_err(|e| {
                    api_error(
                        format_args!("the API server did not issue {what}"),
                        &e,
                        ApiError::Waiting,
                    )
                })?;
            let status = answer.status.ok_or_else(|| {
                ApiError::Unavailable(format!("the API server's answer for {what} has no status"))
            })?;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64);
            let left = status.expiration_timestamp.0.as_second() - now;
            Ok(IssuedToken {
                token: status.token,
                valid_for: Duration::from_secs(left.max(1) as u64),
            })
        })
    }
}
