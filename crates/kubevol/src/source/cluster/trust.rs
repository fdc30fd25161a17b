//! `clusterTrustBundle` projected sources from the API server's ClusterTrustBundles.

use std::collections::BTreeSet;

use kube::api::Api;

use super::backoff::api_error;
use crate::error::ApiError;

/// `clusterTrustBundle` projected sources from the API server's ClusterTrustBundles
/// (`certificates.k8s.io/v1beta1`): the one named, or every one of a signer that the label
/// selector matches (an unset selector matches none, an empty one all), their certificates
/// deduplicated in a stable order. Where the server does not serve the API, the volume says
/// so.
pub struct ClusterTrustBundles {
    client: kube::Client,
}

impl ClusterTrustBundles {
    /// Reads with `client`.
    pub fn new(client: kube::Client) -> Self {
        ClusterTrustBundles { client }
    }
}

/// A label selector in the API's query syntax.
fn selector_query(s: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector) -> String {
    let mut terms: Vec<String> = s
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in s.match_expressions.iter().flatten() {
        let values = e.values.clone().unwrap_or_default().join(",");
        terms.push(match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "DoesNotExist" => format!("!{}", e.key),
            _ => e.key.clone(),
        });
    }
    terms.join(",")
}

/// The certificates of `bundles`, deduplicated, in a stable order, as one PEM bundle.
fn merge_pem<'a>(bundles: impl Iterator<Item = &'a str>) -> String {
    const END: &str = "-----END CERTIFICATE-----";
    let mut certs = BTreeSet::new();
    for b in bundles {
        for part in b.split_inclusive(END) {
            let cert = part.trim();
            if cert.ends_with(END) {
                certs.insert(cert.to_string());
            }
        }
    }
    let mut out = certs.into_iter().collect::<Vec<_>>().join("\n");
    out.push('\n');
    out
}

impl crate::plugins::TrustBundles for ClusterTrustBundles {
    fn bundle(
        &self,
        source: k8s_openapi::api::core::v1::ClusterTrustBundleProjection,
    ) -> crate::plugins::BoxFuture<Result<Option<String>, ApiError>> {
        use k8s_openapi::api::certificates::v1beta1::ClusterTrustBundle;
        let api: Api<ClusterTrustBundle> = Api::all(self.client.clone());
        Box::pin(async move {
            let params = match (&source.name, &source.signer_name) {
                (Some(name), _) => {
                    kube::api::ListParams::default().fields(&format!("metadata.name={name}"))
                }
                (None, Some(signer)) => match &source.label_selector {
                    // An unset selector matches nothing.
                    None => return Ok(None),
                    Some(s) => kube::api::ListParams::default()
                        .fields(&format!("spec.signerName={signer}"))
                        .labels(&selector_query(s)),
                },
                (None, None) => {
                    return Err(ApiError::Refused(
                        "names neither a ClusterTrustBundle nor a signer".into(),
                    ))
                }
            };
            let list = api.list(&params).await.map_err(|e| match &e {
                kube::Error::Api(s) if s.code == 404 => ApiError::NotServed("the API server does not serve ClusterTrustBundles (certificates.k8s.io/v1beta1): enable that API on the server, or remove the source".to_string()),
                _ => api_error("cannot read ClusterTrustBundles", &e, ApiError::NotServed),
            })?;
            if list.items.is_empty() {
                return Ok(None);
            }
            Ok(Some(merge_pem(
                list.items.iter().map(|b| b.spec.trust_bundle.as_str()),
            )))
        })
    }
}
