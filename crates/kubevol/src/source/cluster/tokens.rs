//! Service account tokens for projected volumes, from the API server's TokenRequest.
//!
//! The server's admission (NodeRestriction) looks a node's TokenRequest's pod up in its own
//! informer of pods, which learns a new pod moments after it is made, in the order pods are
//! made: until then it answers `404 pod "<name>" not found`. Such an answer is waited for, as
//! a read refused in the authorizer's lag is (see `lag`): the oldest pod's request is tried
//! again on a short backoff, the requests of newer pods wait for it, and the volume neither
//! fails nor says so meanwhile, for at most [`MAX_WAIT`] (the pod may truly be gone). Until
//! the first request is granted, and again after 30 s without a grant, they ask one at a time
//! ([`Lag::first_alone`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kubevol_core::collections::HashMap;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::Api;

use super::backoff::{api_error, WatchBackoff};
use super::lag::{Lag, Place, MAX_WAIT};
use crate::error::ApiError;
use crate::source::BoxFuture;
use crate::tokens::{IssuedToken, TokenIssuer, TokenSpec};

/// Service account tokens from the API server's TokenRequest, bound to the pod (its name and
/// UID), with the source's audience and lifetime.
pub struct ClusterTokens {
    client: kube::Client,
    order: Arc<Order>,
}

/// The order pods first asked for a token in, and the requests the admission's lag holds.
struct Order {
    lag: Arc<Lag>,
    /// Each pod's place in that order (by UID), while it has not had a token yet.
    places: Mutex<HashMap<String, u64>>,
}

impl ClusterTokens {
    /// An issuer asking the API server `client` reaches (with the node's identity: the server
    /// grants tokens only for pods bound to the node, for their own service account).
    pub fn new(client: kube::Client) -> Self {
        ClusterTokens {
            client,
            order: Arc::new(Order {
                // One at a time only until the first is issued: after that a request waits
                // only behind a refusal, so that a steady stream of pods is not held a round
                // trip each.
                lag: Arc::new(Lag::first_alone()),
                places: Mutex::default(),
            }),
        }
    }
}

impl Order {
    /// The place of the pod `uid` in the order pods asked for tokens.
    fn place(&self, uid: &str) -> Place {
        let mut places = crate::sync::lock(&self.places);
        let place = *places
            .entry(uid.to_string())
            .or_insert_with(|| self.lag.seen());
        Place::of(&self.lag, place)
    }

    fn forget(&self, uid: &str) {
        crate::sync::lock(&self.places).remove(uid);
    }
}

/// Whether the server's admission did not find the pod in its informer: `404` naming a `pod`
/// (the informer's answer; the pod's own storage would name `pods`).
fn pod_not_seen_yet(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404
        && s.details.as_ref().is_some_and(|d| d.kind == "pod"))
}

impl TokenIssuer for ClusterTokens {
    fn issue(&self, spec: TokenSpec) -> BoxFuture<Result<IssuedToken, ApiError>> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &spec.namespace);
        let order = self.order.clone();
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
            let place = order.place(&spec.pod_uid);
            let (mut backoff, start) = (WatchBackoff::default(), tokio::time::Instant::now());
            let answer = loop {
                place.turn().await;
                let asked = api
                    .create_token_request(&spec.service_account, &Default::default(), &request)
                    .await;
                match asked {
                    Ok(answer) => {
                        place.allowed();
                        break answer;
                    }
                    Err(e) if pod_not_seen_yet(&e) && start.elapsed() < MAX_WAIT => {
                        let delay = place.retry_after(&mut backoff, true, false);
                        tracing::debug!(pod = %spec.pod_name, "{what}: {e}; asking again in {delay:.1?}");
                        tokio::time::sleep(delay).await;
                    }
                    Err(e) => {
                        place.answered();
                        order.forget(&spec.pod_uid);
                        return Err(api_error(
                            format_args!("the API server did not issue {what}"),
                            &e,
                            ApiError::Waiting,
                        ));
                    }
                }
            };
            order.forget(&spec.pod_uid);
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
