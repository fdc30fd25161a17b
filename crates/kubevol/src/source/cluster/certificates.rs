//! `podCertificate` projected sources: PodCertificateRequests made with the node's identity
//! and read from a watch of this node's requests (as the kubelet reads them from an
//! informer: a GET of a request just made would be refused until the Node authorizer learns
//! of it). A pod is processed again as soon as the signer answers one of its requests.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::runtime::watcher::{self, watcher, Event};

use crate::certificates::{CertificateRequests, PodCertificateRequest};
use crate::error::ApiError;
use crate::plugins::Refresher;
use crate::source::cluster::backoff::{api_error, refused, AbortOnDrop, WatchBackoff};
use crate::source::cluster::served::Served;
use crate::source::BoxFuture;

/// (namespace, name) of a request.
type RequestKey = (String, String);

/// The node's requests as the watch last delivered them, and every request it has shown.
#[derive(Default)]
struct Seen {
    requests: HashMap<RequestKey, PodCertificateRequest>,
    ever: HashSet<RequestKey>,
}

fn key_of(r: &PodCertificateRequest) -> RequestKey {
    (
        r.metadata.namespace.clone().unwrap_or_default(),
        r.metadata.name.clone().unwrap_or_default(),
    )
}

/// PodCertificateRequests in the API server, at the version it serves them
/// (`certificates.k8s.io/v1` from 1.37, `v1beta1` on 1.36 where the `PodCertificateRequest`
/// feature is on). The watch of the node's requests starts with the first request made, so a
/// node whose pods have no such source never asks for it.
pub struct ClusterCertificates {
    client: kube::Client,
    watch: Arc<RequestWatch>,
    seen: Arc<Mutex<Seen>>,
    served: Arc<Served>,
}

/// The watch of this node's requests, started with the first request made.
struct RequestWatch {
    client: kube::Client,
    node: String,
    refresher: Refresher,
    seen: Arc<Mutex<Seen>>,
    task: Mutex<Option<AbortOnDrop>>,
}

/// A request as the node reads it, from the object the server sent.
fn typed(o: DynamicObject) -> Option<PodCertificateRequest> {
    serde_json::to_value(o)
        .and_then(serde_json::from_value)
        .ok()
}

impl ClusterCertificates {
    /// Requests for `manager`'s pods, made with `client` (the node's identity); a pod whose
    /// request the signer answers is processed again at once.
    pub fn new(manager: &crate::VolumeManager, client: kube::Client) -> Self {
        let served = Served::new(
            client.clone(),
            "certificates.k8s.io",
            &["v1", "v1beta1"],
            "PodCertificateRequest",
            "podcertificaterequests",
        );
        let seen: Arc<Mutex<Seen>> = Arc::default();
        let watch = RequestWatch {
            client: client.clone(),
            node: manager.config().node_name.clone(),
            refresher: manager.refresher(),
            seen: seen.clone(),
            task: Mutex::new(None),
        };
        ClusterCertificates {
            client,
            watch: Arc::new(watch),
            seen,
            served: Arc::new(served),
        }
    }
}

impl RequestWatch {
    /// Starts the watch of this node's requests (`resource`, at the version served), once. A
    /// node may list and watch them only with the field selector `spec.nodeName=<node>`.
    fn start(&self, resource: &ApiResource) {
        let mut watch = crate::sync::lock(&self.task);
        if watch.is_some() {
            return;
        }
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), resource);
        let config = watcher::Config::default().fields(&format!("spec.nodeName={}", self.node));
        let refresher = self.refresher.clone();
        let seen = self.seen.clone();
        *watch = Some(AbortOnDrop(tokio::spawn(async move {
            let mut events = watcher(api, config).boxed();
            let mut backoff = WatchBackoff::default();
            let mut listing: Option<HashMap<RequestKey, PodCertificateRequest>> = None;
            while let Some(event) = events.next().await {
                let changed = match event {
                    Ok(Event::Init) => {
                        listing = Some(HashMap::new());
                        continue;
                    }
                    Ok(Event::InitApply(r)) => {
                        if let Some(r) = typed(r) {
                            listing
                                .get_or_insert_with(HashMap::new)
                                .insert(key_of(&r), r);
                        }
                        continue;
                    }
                    Ok(Event::InitDone) => {
                        backoff.reset();
                        let listed = listing.take().unwrap_or_default();
                        let mut s = crate::sync::lock(&seen);
                        s.ever.extend(listed.keys().cloned());
                        // Every pod with a request, listed or gone, looks again.
                        let pods: HashSet<String> = s
                            .requests
                            .values()
                            .chain(listed.values())
                            .map(|r| r.spec.pod_uid.clone())
                            .collect();
                        s.requests = listed;
                        pods
                    }
                    Ok(Event::Apply(r)) => {
                        let Some(r) = typed(r) else { continue };
                        let pod = r.spec.pod_uid.clone();
                        let mut s = crate::sync::lock(&seen);
                        s.ever.insert(key_of(&r));
                        s.requests.insert(key_of(&r), r);
                        HashSet::from([pod])
                    }
                    Ok(Event::Delete(r)) => {
                        let Some(r) = typed(r) else { continue };
                        crate::sync::lock(&seen).requests.remove(&key_of(&r));
                        HashSet::from([r.spec.pod_uid.clone()])
                    }
                    Err(e) => {
                        let delay = backoff.step(refused(&e));
                        tracing::debug!("watching this node's PodCertificateRequests: {e}; retrying in {delay:.1?}");
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                };
                let now = tokio::time::Instant::now();
                for pod in changed {
                    refresher.at(kubevol_core::PodUid(pod.as_str().into()), now);
                }
            }
        })));
    }
}

/// What a volume says where the server serves no PodCertificateRequests.
fn not_served(served: &Served) -> String {
    format!(
        "the API server does not serve PodCertificateRequests ({}): enable that API on the server (on 1.36, the PodCertificateRequest feature and certificates.k8s.io/v1beta1), or remove the source",
        served.spelled()
    )
}

/// What a refusal of the API means for a source.
fn explain(e: kube::Error, served: &Served) -> ApiError {
    match &e {
        // Made in the pod's namespace, which exists: the resource is what is missing.
        kube::Error::Api(s) if s.code == 404 => {
            served.forget();
            ApiError::NotServed(not_served(served))
        }
        _ => api_error(
            "cannot make a PodCertificateRequest",
            &e,
            ApiError::NotServed,
        ),
    }
}

impl CertificateRequests for ClusterCertificates {
    fn create(
        &self,
        namespace: String,
        request: serde_json::Value,
    ) -> BoxFuture<Result<String, ApiError>> {
        let (client, served, watch) =
            (self.client.clone(), self.served.clone(), self.watch.clone());
        Box::pin(async move {
            let resource = served.resource(|| not_served(&served)).await?;
            watch.start(&resource);
            let api: Api<DynamicObject> = Api::namespaced_with(client, &namespace, &resource);
            let mut request = request;
            request["apiVersion"] = serde_json::json!(resource.api_version);
            let object: DynamicObject = serde_json::from_value(request)
                .map_err(|e| ApiError::Refused(format!("cannot encode: {e}")))?;
            let created = api
                .create(&PostParams::default(), &object)
                .await
                .map_err(|e| explain(e, &served))?;
            created.metadata.name.ok_or_else(|| {
                ApiError::Unavailable("the API server's answer names no request".to_string())
            })
        })
    }

    fn get(
        &self,
        namespace: String,
        name: String,
    ) -> BoxFuture<Result<Option<PodCertificateRequest>, ApiError>> {
        let key = (namespace, name);
        let s = crate::sync::lock(&self.seen);
        let answer = match s.requests.get(&key) {
            Some(r) => Ok(Some(r.clone())),
            // Shown by the watch, then deleted.
            None if s.ever.contains(&key) => Ok(None),
            None => Err(ApiError::Waiting(
                "the watch of this node's requests has not shown it yet".to_string(),
            )),
        };
        Box::pin(async move { answer })
    }

    fn service_account_uid(
        &self,
        namespace: String,
        name: String,
    ) -> BoxFuture<Result<String, ApiError>> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &namespace);
        Box::pin(async move {
            let account = api.get(&name).await.map_err(|e| {
                api_error(
                    format_args!("cannot read ServiceAccount {namespace}/{name}"),
                    &e,
                    ApiError::Waiting,
                )
            })?;
            account.metadata.uid.ok_or_else(|| {
                ApiError::Unavailable("the API server's service account has no UID".to_string())
            })
        })
    }
}

impl std::fmt::Debug for ClusterCertificates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCertificates")
            .field("node", &self.watch.node)
            .finish_non_exhaustive()
    }
}
