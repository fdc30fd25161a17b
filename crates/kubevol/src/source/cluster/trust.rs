//! `clusterTrustBundle` projected sources from the API server's ClusterTrustBundles.

use std::collections::{BTreeSet, HashMap};

use kube::api::{Api, DynamicObject};

use super::backoff::api_error;
use super::served::Served;
use crate::error::ApiError;

/// `clusterTrustBundle` projected sources from the API server's ClusterTrustBundles (at the
/// version the server serves: `certificates.k8s.io/v1` from 1.37, `v1beta1` on 1.36): the one
/// named, or every one of a signer that the label selector matches (an unset selector matches
/// none, an empty one all), their certificates deduplicated in a stable order. Where the server
/// does not serve the API, the volume says so.
///
/// Every volume that selects the same bundles (the same name, or the same signer and selector)
/// shares one read: a read in flight is joined, and its answer is kept for [`KEEP`], so that
/// the volumes' minutely rewrites cost one LIST a minute for each selection, not one for each
/// volume (100 volumes cost 300 LISTs in two minutes).
pub struct ClusterTrustBundles {
    client: kube::Client,
    served: std::sync::Arc<Served>,
    reads: std::sync::Mutex<HashMap<String, Read>>,
}

/// How long a selection's answer serves the volumes that ask for it: under the minute between
/// two rewrites of a volume, so that each rewrite reads what is at most this old.
pub const KEEP: std::time::Duration = std::time::Duration::from_secs(30);

type Answer = Result<Option<String>, ApiError>;

/// A selection's read: in flight (shared), or its answer and when it was read.
struct Read {
    answer: futures_util::future::Shared<futures_util::future::BoxFuture<'static, Answer>>,
    at: tokio::time::Instant,
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
            reads: std::sync::Mutex::default(),
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

/// What identifies a selection: the bundle named, or the signer and the selector.
fn selection(source: &k8s_openapi::api::core::v1::ClusterTrustBundleProjection) -> String {
    match (&source.name, &source.signer_name) {
        (Some(name), _) => format!("name={name}"),
        (None, signer) => format!(
            "signer={}\n{}",
            signer.as_deref().unwrap_or_default(),
            source
                .label_selector
                .as_ref()
                .map(selector_query)
                .unwrap_or_else(|| "<unset>".into())
        ),
    }
}

impl crate::plugins::TrustBundles for ClusterTrustBundles {
    fn bundle(
        &self,
        source: k8s_openapi::api::core::v1::ClusterTrustBundleProjection,
    ) -> crate::plugins::BoxFuture<Result<Option<String>, ApiError>> {
        use futures_util::FutureExt;
        let key = selection(&source);
        let now = tokio::time::Instant::now();
        let answer = {
            let mut reads = crate::sync::lock(&self.reads);
            reads.retain(|_, r| now.duration_since(r.at) < KEEP);
            match reads.get(&key) {
                // In flight, or read less than KEEP ago (an error is not kept: see below).
                Some(r) if r.answer.peek().is_none_or(|a| a.is_ok()) => r.answer.clone(),
                _ => {
                    let answer = read(self.client.clone(), self.served.clone(), source)
                        .boxed()
                        .shared();
                    reads.insert(
                        key,
                        Read {
                            answer: answer.clone(),
                            at: now,
                        },
                    );
                    answer
                }
            }
        };
        Box::pin(answer)
    }
}

/// Reads the bundles `source` selects.
fn read(
    client: kube::Client,
    served: std::sync::Arc<Served>,
    source: k8s_openapi::api::core::v1::ClusterTrustBundleProjection,
) -> impl std::future::Future<Output = Answer> + Send + 'static {
    {
        async move {
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
        }
    }
}
