//! `clusterTrustBundle` projected sources from the API server's ClusterTrustBundles.

use std::collections::BTreeSet;

use kube::api::{Api, DynamicObject};

use super::backoff::api_error;
use super::served::Served;
use crate::error::ApiError;

/// `clusterTrustBundle` projected sources from the API server's ClusterTrustBundles (at the
/// version the server serves: `certificates.k8s.io/v1` from 1.37, `v1beta1` on 1.36): the one
/// named, or every one of a signer that the label selector matches (an unset selector matches
/// none, an empty one all), their certificates deduplicated in a stable order. Where the server
/// does not serve the API, the volume says so.
pub struct ClusterTrustBundles {
    client: kube::Client,
    served: std::sync::Arc<Served>,
}

impl ClusterTrustBundles {
    /// Reads with `client`.
    pub fn new(client: kube::Client) -> Self {
        let served = Served::new(
            client.clone(),
            "certificates.k8s.io",
            &["v1", "v1beta1"],
            "ClusterTrustBundle",
            "clustertrustbundles",
        );
        ClusterTrustBundles {
            client,
            served: std::sync::Arc::new(served),
        }
    }
}

/// What a volume says where the server serves no ClusterTrustBundles.
fn not_served(served: &Served) -> String {
    format!(
        "the API server does not serve ClusterTrustBundles ({}): enable that API on the server (on 1.36, the ClusterTrustBundle feature and certificates.k8s.io/v1beta1), or remove the source",
        served.spelled()
    )
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
        let (client, served) = (self.client.clone(), self.served.clone());
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
            let resource = served.resource(|| not_served(&served)).await?;
            let api: Api<DynamicObject> = Api::all_with(client, &resource);
            let list = api.list(&params).await.map_err(|e| match &e {
                kube::Error::Api(s) if s.code == 404 => {
                    served.forget();
                    ApiError::NotServed(not_served(&served))
                }
                _ => api_error("cannot read ClusterTrustBundles", &e, ApiError::NotServed),
            })?;
            if list.items.is_empty() {
                return Ok(None);
            }
            let bundle =
                |b: &DynamicObject| b.data["spec"]["trustBundle"].as_str().map(String::from);
            let bundles: Vec<String> = list.items.iter().filter_map(bundle).collect();
            Ok(Some(merge_pem(bundles.iter().map(String::as_str))))
        })
    }
}
