//! Pod certificates for `podCertificate` projected sources.
//!
//! For each source of each pod, a key pair is made on the node and a PodCertificateRequest
//! created for it (in cluster mode, with the API server); once the signer has issued the
//! chain, the key and chain are written into the volume. At the request's `beginRefreshAt`
//! (plus up to five minutes of jitter, so that a node's pods do not all ask at once) a new
//! key is made and asked for; the old credentials stay in the volume until the new ones are
//! issued. A denied or failed request fails the volume until the pod changes, as the kubelet's.
//! The state lives in memory only, as the kubelet's: after a restart new requests are made,
//! and the files already in the volume are kept meanwhile. A private key is never logged and
//! never part of an error, an event or the status.

pub mod keys;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use k8s_openapi::api::certificates::v1beta1::PodCertificateRequestStatus;
use k8s_openapi::api::core::v1::{Pod, PodCertificateProjection};
use kubevol_core::projection::{Credentials, CredentialsError};
use kubevol_core::PodRef;
use tokio::time::Instant;

use crate::report::events::EventRecorder;

/// A PodCertificateRequest as the node reads it, at whichever version the API serves it
/// (`certificates.k8s.io/v1`, or `v1beta1` on 1.36: the node's fields and the signer's answer
/// are the same in both; k8s-openapi's types are bound to one version's `apiVersion`).
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct PodCertificateRequest {
    /// Its metadata.
    #[serde(default)]
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    /// What the node asked for.
    #[serde(default)]
    pub spec: RequestSpec,
    /// The signer's answer.
    #[serde(default)]
    pub status: Option<PodCertificateRequestStatus>,
}

/// The fields of a request's spec that the node reads back.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestSpec {
    /// The pod it is for.
    #[serde(default, rename = "podUID")]
    pub pod_uid: String,
    /// The signer asked.
    #[serde(default)]
    pub signer_name: String,
    /// The node that asked.
    #[serde(default)]
    pub node_name: String,
}

/// Where PodCertificateRequests are made and read (the API server in cluster mode).
pub trait CertificateRequests: Send + Sync + 'static {
    /// Creates `request` (a PodCertificateRequest without its `apiVersion`, which the
    /// implementation sets to the version its server serves; named by `generateName`, in
    /// `namespace`); returns its name. JSON, because the stub PKCS#10 request is newer than
    /// kubevol's API types.
    fn create(
        &self,
        namespace: String,
        request: serde_json::Value,
    ) -> crate::BoxFuture<Result<String, crate::error::ApiError>>;
    /// The request `namespace/name` as it is now: `Ok(None)` when it is gone, `Err` when it
    /// cannot be read (yet).
    fn get(
        &self,
        namespace: String,
        name: String,
    ) -> crate::BoxFuture<Result<Option<PodCertificateRequest>, crate::error::ApiError>>;
    /// The UID of the service account `namespace/name`.
    fn service_account_uid(
        &self,
        namespace: String,
        name: String,
    ) -> crate::BoxFuture<Result<String, crate::error::ApiError>>;
    /// The most that a refresh is put off past a request's `beginRefreshAt`, at random, so that
    /// the pods of a node (and the nodes of a signer) do not all ask at once: five minutes,
    /// the kubelet's spread.
    fn refresh_spread(&self) -> Duration {
        JITTER
    }
}

/// How long a request may take before the node asks again (its lifetime is the signer's
/// business, but a request nobody answers must not leave the pod waiting for ever).
const WAIT_CHECK: Duration = Duration::from_secs(60);

/// The most jitter added to a refresh.
const JITTER: Duration = Duration::from_secs(5 * 60);

/// How long a request that cannot be read is waited for before it is taken as lost and made
/// again (the kubelet's: a request can be deleted before its node has seen it).
const ABANDON_AFTER: Duration = Duration::from_secs(10 * 60);

/// After `beginRefreshAt`, how long before a missing refresh is told as overdue.
const OVERDUE_AFTER: Duration = Duration::from_secs(10 * 60);

/// A source of a pod: (pod UID, volume, index in `sources`).
type SourceKey = (String, String, usize);

/// An issued key and chain, and when to ask for the next.
#[derive(Clone)]
struct Issued {
    credentials: Credentials,
    refresh_at: Instant,
    not_after: Instant,
    /// The pod has been told that the refresh is overdue, that the certificate expired.
    told_overdue: bool,
    told_expired: bool,
}

enum State {
    /// Nothing asked yet.
    Initial,
    /// A request is out for the first credentials.
    Waiting { key_pem: Vec<u8>, out: Out },
    /// Credentials issued; the next are asked for at `refresh_at`.
    Fresh(Issued),
    /// Credentials issued, and a request out for their successors.
    Refreshing {
        current: Issued,
        key_pem: Vec<u8>,
        out: Out,
    },
    /// The signer denied or failed a request: nothing more is asked until the pod changes.
    Refused { text: String, failed: bool },
}

/// What `kubelet_podcertificate_states` counts of a source: its signer, and its state.
#[derive(Clone)]
struct Summary {
    signer: String,
    state: Summarized,
}

#[derive(Clone, Copy)]
enum Summarized {
    NotYetIssued,
    Issued {
        refresh_at: Instant,
        not_after: Instant,
    },
    Denied,
    Failed,
}

impl State {
    fn summary(&self) -> Summarized {
        match self {
            State::Initial | State::Waiting { .. } => Summarized::NotYetIssued,
            State::Fresh(i) | State::Refreshing { current: i, .. } => Summarized::Issued {
                refresh_at: i.refresh_at,
                not_after: i.not_after,
            },
            State::Refused { failed: false, .. } => Summarized::Denied,
            State::Refused { failed: true, .. } => Summarized::Failed,
        }
    }
}

/// What a source of a pod is, for a request.
pub struct SourceRequest<'a> {
    /// The pod.
    pub pod_ref: &'a PodRef,
    /// Its object.
    pub pod: &'a Pod,
    /// The volume's name.
    pub volume: &'a str,
    /// The source's index in `sources`.
    pub index: usize,
    /// The source.
    pub source: &'a PodCertificateProjection,
    /// This node's name.
    pub node_name: &'a str,
    /// This node's UID, once its Node object is known.
    pub node_uid: Option<String>,
}

/// Credentials for a source, or why there are none, and when to look again.
pub struct Answer {
    /// The credentials.
    pub result: Result<Credentials, CredentialsError>,
    /// When the volume should be written again (a refresh is due, or asked for).
    pub recheck_at: Option<Instant>,
}

/// The pod certificates in use, by pod source.
#[derive(Default)]
pub struct PodCertificates {
    requests: RwLock<Option<Arc<dyn CertificateRequests>>>,
    states: Mutex<HashMap<SourceKey, Arc<tokio::sync::Mutex<State>>>>,
    summaries: Mutex<HashMap<SourceKey, Summary>>,
}

/// A random duration below `max` (refreshes of many pods spread out).
fn jitter(max: Duration) -> Duration {
    let mut bytes = [0u8; 8];
    if getrandom::fill(&mut bytes).is_err() {
        return Duration::ZERO;
    }
    let nanos = u64::from_le_bytes(bytes) % (max.as_nanos() as u64).max(1);
    Duration::from_nanos(nanos)
}

/// The monotonic instant of a wall-clock time (now, if it is past).
fn instant_of(t: SystemTime) -> Instant {
    let now = Instant::now();
    match t.duration_since(SystemTime::now()) {
        Ok(ahead) => now + ahead,
        Err(_) => now,
    }
}

fn waiting(detail: String) -> CredentialsError {
    CredentialsError {
        detail,
        permanent: false,
    }
}

/// The terminal condition of a request: `Issued`, `Denied` or `Failed`, with its reason and
/// message.
fn terminal(status: &PodCertificateRequestStatus) -> Option<(&str, &str, &str)> {
    status.conditions.iter().flatten().find_map(|c| {
        matches!(c.type_.as_str(), "Issued" | "Denied" | "Failed").then_some((
            c.type_.as_str(),
            c.reason.as_str(),
            c.message.as_str(),
        ))
    })
}

/// A request that is out: its name, when to give up on it if it is never seen, and when to
/// look at it next while it refreshes credentials the volume already has.
struct Out {
    request: String,
    abandon_at: Instant,
    next_look: Duration,
}

/// The first look at a refresh's request after it is made; each later one waits twice as
/// long, up to [`WAIT_CHECK`]. (A first request fails the volume, whose retries look at it.)
const FIRST_LOOK: Duration = Duration::from_secs(1);

impl Out {
    fn new(request: String) -> Self {
        Out {
            request,
            abandon_at: Instant::now() + ABANDON_AFTER + jitter(JITTER),
            next_look: FIRST_LOOK,
        }
    }

    /// How long until the request is looked at again: a signer that answers within a second
    /// has its certificate in the volume a second later, one that takes hours is looked at
    /// once a minute. (A watch of the requests, as in cluster mode, nudges the volume as soon
    /// as the answer comes, whichever is sooner.)
    fn look_later(&mut self) -> Duration {
        let wait = self.next_look;
        self.next_look = (wait * 2).min(WAIT_CHECK);
        wait
    }
}

/// What became of a request that is out.
enum Outcome {
    /// Still out: no terminal condition yet.
    Pending(String),
    /// Not to be read yet (a watch that has not shown it).
    Unseen(String),
    /// Gone: another is to be made.
    Gone,
    /// The signer's answer.
    Answered(Answered),
}

/// What a signer answered.
enum Answered {
    /// Issued.
    Issued(Issued),
    /// Denied or failed, with the message for the pod.
    Refused {
        reason: &'static str,
        text: String,
        failed: bool,
    },
}

impl PodCertificates {
    /// Sets where requests are made.
    pub fn set_requests(&self, requests: Arc<dyn CertificateRequests>) {
        *crate::sync::write(&self.requests) = Some(requests);
    }

    /// Whether certificates can be had at all.
    pub fn has_requests(&self) -> bool {
        crate::sync::read(&self.requests).is_some()
    }

    /// Forgets the sources of pod `uid` (it is gone, or no longer runs): their keys are
    /// dropped, and a new pod with the same sources asks anew.
    pub fn forget_pod(&self, uid: &str) {
        crate::sync::lock(&self.states).retain(|(p, _, _), _| p != uid);
        crate::sync::lock(&self.summaries).retain(|(p, _, _), _| p != uid);
    }

    /// How many sources are in each state, by signer, as `kubelet_podcertificate_states`
    /// counts them: `not_yet_issued`, `fresh`, `overdue_for_refresh` (10 minutes past the
    /// refresh time), `expired`, `denied`, `failed`.
    pub fn states(&self) -> std::collections::BTreeMap<(String, &'static str), i64> {
        let now = Instant::now();
        let mut out = std::collections::BTreeMap::new();
        for s in crate::sync::lock(&self.summaries).values() {
            let state = match s.state {
                Summarized::NotYetIssued => "not_yet_issued",
                Summarized::Issued { not_after, .. } if now > not_after => "expired",
                Summarized::Issued { refresh_at, .. } if now > refresh_at + OVERDUE_AFTER => {
                    "overdue_for_refresh"
                }
                Summarized::Issued { .. } => "fresh",
                Summarized::Denied => "denied",
                Summarized::Failed => "failed",
            };
            *out.entry((s.signer.clone(), state)).or_default() += 1;
        }
        out
    }

    /// The credentials of a source: those issued, or why there are none yet. `None` when
    /// there is nowhere to ask.
    pub async fn get(&self, req: SourceRequest<'_>, events: &EventRecorder) -> Option<Answer> {
        let api = crate::sync::read(&self.requests).clone()?;
        let key = (
            req.pod_ref.uid.to_string(),
            req.volume.to_string(),
            req.index,
        );
        let state = crate::sync::lock(&self.states)
            .entry(key.clone())
            .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(State::Initial)))
            .clone();
        let mut state = state.lock().await;
        let answer = self.step(&*api, &req, &mut state, events).await;
        let summary = Summary {
            signer: req.source.signer_name.clone(),
            state: state.summary(),
        };
        // Only while the source is still known (not forgotten meanwhile).
        if crate::sync::lock(&self.states).contains_key(&key) {
            crate::sync::lock(&self.summaries).insert(key, summary);
        }
        Some(answer)
    }

    async fn step(
        &self,
        api: &dyn CertificateRequests,
        req: &SourceRequest<'_>,
        state: &mut State,
        events: &EventRecorder,
    ) -> Answer {
        let now = Instant::now();
        let answer = |result, recheck_at| Answer { result, recheck_at };
        match std::mem::replace(state, State::Initial) {
            State::Initial => match make_request(api, req).await {
                Ok((key_pem, request)) => {
                    let detail = format!(
                        "waiting for signer {} to issue PodCertificateRequest {}/{request}",
                        req.source.signer_name, req.pod_ref.namespace
                    );
                    let out = Out::new(request);
                    *state = State::Waiting { key_pem, out };
                    answer(Err(waiting(detail)), Some(now + WAIT_CHECK))
                }
                Err(e) => answer(Err(waiting(e)), None),
            },
            State::Waiting { key_pem, out } => {
                match outcome(api, req, &out, &key_pem).await {
                    Outcome::Pending(detail) | Outcome::Unseen(detail) => {
                        *state = State::Waiting { key_pem, out };
                        answer(Err(waiting(detail)), Some(now + WAIT_CHECK))
                    }
                    // Deleted before it was answered: ask again.
                    Outcome::Gone => Box::pin(self.step(api, req, state, events)).await,
                    Outcome::Answered(a) => concluded(a, state, req, events),
                }
            }
            State::Fresh(mut current) if now >= current.refresh_at => {
                tell_late(&mut current, req, events, now);
                let result = Ok(current.credentials.clone());
                match make_request(api, req).await {
                    Ok((key_pem, request)) => {
                        let mut out = Out::new(request);
                        let look = now + out.look_later();
                        *state = State::Refreshing {
                            current,
                            key_pem,
                            out,
                        };
                        answer(result, Some(look))
                    }
                    Err(e) => {
                        tracing::warn!(pod = %req.pod_ref, volume = req.volume, "the pod certificate is due for refreshing: {e}; the current one is kept");
                        *state = State::Fresh(current);
                        answer(result, Some(now + WAIT_CHECK))
                    }
                }
            }
            State::Fresh(current) => {
                let at = current.refresh_at;
                let result = Ok(current.credentials.clone());
                *state = State::Fresh(current);
                answer(result, Some(at))
            }
            State::Refreshing {
                mut current,
                key_pem,
                mut out,
            } => {
                tell_late(&mut current, req, events, now);
                match outcome(api, req, &out, &key_pem).await {
                    Outcome::Pending(_) | Outcome::Unseen(_) => {
                        let result = Ok(current.credentials.clone());
                        let look = now + out.look_later();
                        *state = State::Refreshing {
                            current,
                            key_pem,
                            out,
                        };
                        answer(result, Some(look))
                    }
                    Outcome::Gone => {
                        // Ask again at once.
                        current.refresh_at = now;
                        *state = State::Fresh(current);
                        Box::pin(self.step(api, req, state, events)).await
                    }
                    // Refused, as the kubelet: the volume fails; the files already written
                    // stay.
                    Outcome::Answered(a) => concluded(a, state, req, events),
                }
            }
            State::Refused { text, failed } => {
                *state = State::Refused {
                    text: text.clone(),
                    failed,
                };
                answer(Err(refused(text)), None)
            }
        }
    }
}

/// A failure for good: only a change of the pod helps.
fn refused(detail: String) -> CredentialsError {
    CredentialsError {
        detail,
        permanent: true,
    }
}

/// The state and answer once the signer has issued or refused a request (a request still out
/// or gone is the caller's).
fn concluded(
    answered: Answered,
    state: &mut State,
    req: &SourceRequest<'_>,
    events: &EventRecorder,
) -> Answer {
    match answered {
        Answered::Issued(issued) => {
            let result = Ok(issued.credentials.clone());
            let at = issued.refresh_at;
            *state = State::Fresh(issued);
            Answer {
                result,
                recheck_at: Some(at),
            }
        }
        Answered::Refused {
            reason,
            text,
            failed,
        } => {
            events.record(req.pod_ref, true, reason, text.clone());
            *state = State::Refused {
                text: text.clone(),
                failed,
            };
            Answer {
                result: Err(refused(text)),
                recheck_at: None,
            }
        }
    }
}

/// Tells the pod once that its certificate's refresh is overdue, and once that it expired.
fn tell_late(current: &mut Issued, req: &SourceRequest<'_>, events: &EventRecorder, now: Instant) {
    if now > current.refresh_at + OVERDUE_AFTER && !current.told_overdue {
        current.told_overdue = true;
        events.record(
            req.pod_ref,
            true,
            crate::report::events::reason::CERTIFICATE_OVERDUE_FOR_REFRESH,
            format!(
                "PodCertificate refresh overdue (volume {}, sources[{}])",
                req.volume, req.index
            ),
        );
    }
    if now > current.not_after && !current.told_expired {
        current.told_expired = true;
        events.record(
            req.pod_ref,
            true,
            crate::report::events::reason::CERTIFICATE_EXPIRED,
            format!(
                "PodCertificate expired (volume {}, sources[{}])",
                req.volume, req.index
            ),
        );
    }
}

/// Makes a key pair and a request for it: the private key (PEM) and the request's name.
async fn make_request(
    api: &dyn CertificateRequests,
    req: &SourceRequest<'_>,
) -> Result<(Vec<u8>, String), String> {
    let kind = keys::KeyType::parse(&req.source.key_type).ok_or_else(|| {
        format!(
            "key type {:?} is not one the API allows",
            req.source.key_type
        )
    })?;
    let node_uid = req.node_uid.clone().ok_or_else(|| {
        format!(
            "waiting for the Node object of {} (its UID goes into the request)",
            req.node_name
        )
    })?;
    let account = crate::tokens::service_account(req.pod);
    let namespace = req.pod_ref.namespace.to_string();
    let account_uid = api
        .service_account_uid(namespace.clone(), account.clone())
        .await
        .map_err(|e| format!("cannot read service account {namespace}/{account}: {e}"))?;
    let pair = tokio::task::spawn_blocking(move || keys::generate(kind))
        .await
        .map_err(|e| format!("key generation did not finish: {e}"))??;
    let der = base64::engine::general_purpose::STANDARD.encode(&pair.request_der);
    let mut spec = serde_json::json!({
        "signerName": req.source.signer_name,
        "podName": req.pod_ref.name.as_str(),
        "podUID": req.pod_ref.uid.as_str(),
        "serviceAccountName": account,
        "serviceAccountUID": account_uid,
        "nodeName": req.node_name,
        "nodeUID": node_uid,
        "stubPKCS10Request": der,
    });
    if let Some(secs) = req.source.max_expiration_seconds {
        spec["maxExpirationSeconds"] = secs.into();
    }
    if let Some(a) = &req.source.user_annotations {
        spec["unverifiedUserAnnotations"] = serde_json::json!(a);
    }
    let request = serde_json::json!({
        "kind": "PodCertificateRequest",
        "metadata": {
            "namespace": namespace,
            "generateName": "req-",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": req.pod_ref.name.as_str(), "uid": req.pod_ref.uid.as_str()}],
        },
        "spec": spec,
    });
    let name = api.create(namespace, request).await.map_err(|e| {
        format!(
            "cannot create a PodCertificateRequest for signer {}: {e}",
            req.source.signer_name
        )
    })?;
    tracing::info!(pod = %req.pod_ref, volume = req.volume, source = req.index, request = %name, signer = %req.source.signer_name, "PodCertificateRequest created");
    Ok((pair.key_pem, name))
}

/// What became of the request `out`.
async fn outcome(
    api: &dyn CertificateRequests,
    req: &SourceRequest<'_>,
    out: &Out,
    key_pem: &[u8],
) -> Outcome {
    let namespace = req.pod_ref.namespace.to_string();
    let full = format!("{namespace}/{}", out.request);
    let detail = |why: String| {
        format!(
            "waiting for signer {} to issue PodCertificateRequest {full}{why}",
            req.source.signer_name
        )
    };
    let pcr = match api.get(namespace, out.request.clone()).await {
        Ok(Some(pcr)) => pcr,
        Ok(None) => {
            tracing::info!(pod = %req.pod_ref, request = %full, "PodCertificateRequest is gone; another is made");
            return Outcome::Gone;
        }
        Err(e) if Instant::now() >= out.abandon_at => {
            tracing::info!(pod = %req.pod_ref, request = %full, "PodCertificateRequest still cannot be read ({e}); taken as lost, another is made");
            return Outcome::Gone;
        }
        Err(e) => return Outcome::Unseen(detail(format!(" (it cannot be read yet: {e})"))),
    };
    let status = pcr.status.unwrap_or_default();
    match terminal(&status) {
        None => Outcome::Pending(detail(String::new())),
        Some(("Issued", _, _)) => {
            let chain = keys::clean_chain(status.certificate_chain.as_deref().unwrap_or_default());
            let when = |t: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>| {
                t.as_ref().map(|t| SystemTime::from(t.0))
            };
            let now = Instant::now();
            let refresh_at = when(&status.begin_refresh_at)
                .map(instant_of)
                .unwrap_or(now + WAIT_CHECK)
                + jitter(api.refresh_spread());
            let not_after = when(&status.not_after)
                .map(instant_of)
                .unwrap_or(refresh_at);
            tracing::info!(pod = %req.pod_ref, volume = req.volume, source = req.index, request = %full, "pod certificate issued");
            Outcome::Answered(Answered::Issued(Issued {
                credentials: Credentials {
                    key_pem: key_pem.to_vec(),
                    chain_pem: chain,
                },
                refresh_at,
                not_after,
                told_overdue: false,
                told_expired: false,
            }))
        }
        Some((kind, reason, message)) => {
            let (event, verb) = if kind == "Denied" {
                (crate::report::events::reason::DENIED, "was denied")
            } else {
                (crate::report::events::reason::FAILED, "failed")
            };
            Outcome::Answered(Answered::Refused {
                reason: event,
                failed: kind != "Denied",
                text: format!(
                    "PodCertificateRequest {full} {verb} by signer {}, reason={reason:?} message={message:?}; change the pod (its signer or key type) to ask again",
                    req.source.signer_name
                ),
            })
        }
    }
}

#[cfg(test)]
mod tests;
