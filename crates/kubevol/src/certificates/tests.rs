use super::*;
use serde_json::json;

/// Requests kept in memory, answered by the test.
#[derive(Default)]
struct Requests {
    made: Mutex<Vec<serde_json::Value>>,
    status: Mutex<HashMap<String, Option<serde_json::Value>>>,
}

impl Requests {
    fn made(&self) -> Vec<serde_json::Value> {
        self.made.lock().unwrap().clone()
    }
    /// Makes request `n` unreadable (a watch that has not shown it).
    fn hide(&self, n: usize) {
        self.status.lock().unwrap().remove(&format!("req-{n}"));
    }
    /// Sets request `n`'s status (`None`: deleted).
    fn answer(&self, n: usize, status: Option<serde_json::Value>) {
        self.status
            .lock()
            .unwrap()
            .insert(format!("req-{n}"), status);
    }
}

impl CertificateRequests for Requests {
    fn create(
        &self,
        _: String,
        request: serde_json::Value,
    ) -> crate::BoxFuture<Result<String, crate::error::ApiError>> {
        let mut made = self.made.lock().unwrap();
        made.push(request);
        let name = format!("req-{}", made.len() - 1);
        self.status
            .lock()
            .unwrap()
            .insert(name.clone(), Some(json!({})));
        Box::pin(async move { Ok(name) })
    }
    fn get(
        &self,
        namespace: String,
        name: String,
    ) -> crate::BoxFuture<Result<Option<PodCertificateRequest>, crate::error::ApiError>> {
        let Some(status) = self.status.lock().unwrap().get(&name).cloned() else {
            return Box::pin(async {
                Err(crate::error::ApiError::Waiting("not seen yet".to_string()))
            });
        };
        Box::pin(async move {
            Ok(status.map(|status| {
                serde_json::from_value(json!({"metadata": {"name": name, "namespace": namespace}, "spec": {"signerName": "example.com/s", "podName": "p", "podUID": "u", "serviceAccountName": "default", "serviceAccountUID": "sa", "nodeName": "n", "nodeUID": "nu"}, "status": status})).unwrap()
            }))
        })
    }
    fn service_account_uid(
        &self,
        _: String,
        _: String,
    ) -> crate::BoxFuture<Result<String, crate::error::ApiError>> {
        Box::pin(async { Ok("sa-uid".to_string()) })
    }
}

fn rfc3339(t: SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t)
        .unwrap()
        .to_string()
}

/// An `Issued` status with a chain, due for refresh in an hour, expiring in two.
fn issued(leaf: &str) -> serde_json::Value {
    let now = SystemTime::now();
    json!({
        "conditions": [{"type": "Issued", "status": "True", "reason": "Issued", "message": "", "lastTransitionTime": rfc3339(now)}],
        "certificateChain": format!("-----BEGIN CERTIFICATE-----\n{leaf}\n-----END CERTIFICATE-----\n"),
        "notBefore": rfc3339(now),
        "beginRefreshAt": rfc3339(now + Duration::from_secs(3600)),
        "notAfter": rfc3339(now + Duration::from_secs(7200)),
    })
}

fn refused(kind: &str) -> serde_json::Value {
    json!({"conditions": [{"type": kind, "status": "True", "reason": "UnsupportedKeyType", "message": "use ECDSAP256", "lastTransitionTime": rfc3339(SystemTime::now())}]})
}

struct Fixture {
    pod_ref: PodRef,
    pod: Pod,
    source: PodCertificateProjection,
    certificates: PodCertificates,
    requests: Arc<Requests>,
    events: EventRecorder,
}

impl Fixture {
    fn new() -> Self {
        let requests = Arc::new(Requests::default());
        let certificates = PodCertificates::default();
        certificates.set_requests(requests.clone());
        Fixture {
            pod_ref: PodRef {
                namespace: "ns".into(),
                name: "web".into(),
                uid: kubevol_core::PodUid("pod-uid".into()),
            },
            pod: serde_json::from_value(json!({"metadata": {"name": "web", "namespace": "ns", "uid": "pod-uid"}, "spec": {"serviceAccountName": "app", "containers": []}})).unwrap(),
            source: serde_json::from_value(json!({"signerName": "example.com/s", "keyType": "ECDSAP256", "keyPath": "k", "maxExpirationSeconds": 3600, "userAnnotations": {"example.com/team": "a"}})).unwrap(),
            certificates,
            requests,
            events: EventRecorder::default(),
        }
    }

    async fn get(&self, index: usize) -> Answer {
        let req = SourceRequest {
            pod_ref: &self.pod_ref,
            pod: &self.pod,
            volume: "certs",
            index,
            source: &self.source,
            node_name: "node-1",
            node_uid: Some("node-uid".into()),
        };
        self.certificates
            .get(req, &self.events)
            .await
            .expect("requests can be made")
    }

    /// `kubelet_podcertificate_states` as `state=count` (one signer here).
    fn states(&self) -> Vec<String> {
        self.certificates
            .states()
            .into_iter()
            .map(|((signer, state), n)| {
                assert_eq!(signer, "example.com/s");
                format!("{state}={n}")
            })
            .collect()
    }

    fn reasons(&self) -> Vec<String> {
        self.events
            .for_pod(&self.pod_ref.uid)
            .iter()
            .map(|e| format!("{}x{}", e.reason, e.count))
            .collect()
    }
}

#[tokio::test(start_paused = true)]
async fn a_certificate_is_asked_for_issued_refreshed_and_refused_as_the_signer_answers() {
    let f = Fixture::new();
    assert!(
        PodCertificates::default()
            .get(
                SourceRequest {
                    pod_ref: &f.pod_ref,
                    pod: &f.pod,
                    volume: "v",
                    index: 0,
                    source: &f.source,
                    node_name: "n",
                    node_uid: None
                },
                &f.events
            )
            .await
            .is_none(),
        "nowhere to ask: no answer"
    );

    // Asked for: the request names the pod, its account, the node, and carries the key.
    let a = f.get(0).await;
    let e = a.result.unwrap_err();
    assert!(!e.permanent);
    assert_eq!(
        e.detail,
        "waiting for signer example.com/s to issue PodCertificateRequest ns/req-0"
    );
    let made = f.requests.made();
    assert_eq!(made.len(), 1);
    let r = &made[0];
    assert_eq!(r["metadata"]["generateName"], "req-");
    assert_eq!(
        r["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Pod", "name": "web", "uid": "pod-uid"}])
    );
    assert_eq!(r["spec"]["podUID"], "pod-uid");
    assert_eq!(r["spec"]["serviceAccountName"], "app");
    assert_eq!(r["spec"]["serviceAccountUID"], "sa-uid");
    assert_eq!(r["spec"]["nodeName"], "node-1");
    assert_eq!(r["spec"]["nodeUID"], "node-uid");
    assert_eq!(r["spec"]["maxExpirationSeconds"], 3600);
    assert_eq!(
        r["spec"]["unverifiedUserAnnotations"],
        json!({"example.com/team": "a"})
    );
    let csr = base64::engine::general_purpose::STANDARD
        .decode(r["spec"]["stubPKCS10Request"].as_str().unwrap())
        .unwrap();
    assert_eq!(csr[0], 0x30, "a DER request");
    assert!(r["spec"].get("pkixPublicKey").is_none());

    // Still out: no second request.
    assert!(f.get(0).await.result.is_err());
    assert_eq!(f.requests.made().len(), 1);
    assert_eq!(f.states(), ["not_yet_issued=1"]);

    // Issued: the key made for it and the cleaned chain; looked at again at beginRefreshAt
    // plus at most five minutes.
    f.requests.answer(0, Some(issued("AAEC")));
    let a = f.get(0).await;
    let first = a.result.unwrap();
    assert!(first.key_pem.starts_with(b"-----BEGIN PRIVATE KEY-----\n"));
    assert_eq!(
        first.chain_pem,
        b"-----BEGIN CERTIFICATE-----\nAAEC\n-----END CERTIFICATE-----\n"
    );
    let due = a.recheck_at.unwrap() - Instant::now();
    assert!(
        due >= Duration::from_secs(3590) && due <= Duration::from_secs(3600 + 300),
        "{due:?}"
    );

    assert_eq!(f.states(), ["fresh=1"]);

    // Not due: the same, nothing asked.
    assert_eq!(f.get(0).await.result.unwrap(), first);
    assert_eq!(f.requests.made().len(), 1);

    // Due: a new key asked for; the current credentials are served meanwhile.
    // Looked at again after a second, then two, four, ... up to a minute, so that a quick
    // signer's answer reaches the volume even without a watch's nudge.
    tokio::time::advance(due).await;
    let a = f.get(0).await;
    assert_eq!(a.result.unwrap(), first);
    assert_eq!(
        a.recheck_at.unwrap() - Instant::now(),
        Duration::from_secs(1)
    );
    assert_eq!(f.requests.made().len(), 2);
    for secs in [2, 4, 8, 16, 32, 60, 60] {
        let a = f.get(0).await;
        assert_eq!(a.result.unwrap(), first);
        assert_eq!(
            a.recheck_at.unwrap() - Instant::now(),
            Duration::from_secs(secs)
        );
    }
    assert_eq!(f.requests.made().len(), 2, "one refresh at a time");
    f.requests.answer(1, Some(issued("AwQF")));
    let second = f.get(0).await.result.unwrap();
    assert_ne!(second.key_pem, first.key_pem, "a new key");
    assert_eq!(
        second.chain_pem,
        b"-----BEGIN CERTIFICATE-----\nAwQF\n-----END CERTIFICATE-----\n"
    );

    // A request deleted before it is answered is made again at once.
    assert!(f.get(1).await.result.is_err());
    assert_eq!(f.requests.made().len(), 3);
    f.requests.answer(2, None);
    assert!(f.get(1).await.result.is_err());
    assert_eq!(f.requests.made().len(), 4);

    // Denied: for good, told to the pod once, nothing more asked.
    f.requests.answer(3, Some(refused("Denied")));
    for _ in 0..2 {
        let e = f.get(1).await.result.unwrap_err();
        assert!(e.permanent);
        assert_eq!(e.detail, "PodCertificateRequest ns/req-3 was denied by signer example.com/s, reason=\"UnsupportedKeyType\" message=\"use ECDSAP256\"; change the pod (its signer or key type) to ask again");
    }
    assert_eq!(f.requests.made().len(), 4);
    assert_eq!(f.reasons(), ["Deniedx1"]);
    assert_eq!(f.states(), ["denied=1", "fresh=1"]);

    // Forgotten with its pod: asked for anew.
    f.certificates.forget_pod("pod-uid");
    assert!(f.get(1).await.result.is_err());
    assert_eq!(f.requests.made().len(), 5);
    f.requests.answer(4, Some(refused("Failed")));
    assert!(f
        .get(1)
        .await
        .result
        .unwrap_err()
        .detail
        .contains("req-4 failed by signer"));
    assert_eq!(f.reasons(), ["Deniedx1", "Failedx1"]);
    assert_eq!(
        f.states(),
        ["failed=1"],
        "the forgotten pod's sources went, the first too"
    );
    f.certificates.forget_pod("pod-uid");
    assert!(f.states().is_empty(), "forgotten with the pod");
}

#[tokio::test(start_paused = true)]
async fn a_request_never_seen_is_taken_as_lost_after_ten_minutes() {
    let f = Fixture::new();
    assert!(f.get(0).await.result.is_err());
    f.requests.hide(0);
    let e = f.get(0).await.result.unwrap_err();
    assert!(
        e.detail.ends_with("(it cannot be read yet: not seen yet)"),
        "{}",
        e.detail
    );
    tokio::time::advance(ABANDON_AFTER - Duration::from_secs(1)).await;
    assert!(f.get(0).await.result.is_err());
    assert_eq!(f.requests.made().len(), 1, "waited for");
    tokio::time::advance(JITTER + Duration::from_secs(1)).await;
    assert!(f.get(0).await.result.is_err());
    assert_eq!(f.requests.made().len(), 2, "made again");
}

#[tokio::test(start_paused = true)]
async fn a_refresh_nobody_answers_is_told_overdue_then_expired_once_each() {
    let f = Fixture::new();
    assert!(f.get(0).await.result.is_err());
    f.requests.answer(0, Some(issued("AAEC")));
    let a = f.get(0).await;
    let current = a.result.unwrap();
    tokio::time::advance(a.recheck_at.unwrap() - Instant::now()).await;
    assert_eq!(f.get(0).await.result.unwrap(), current, "refresh asked for");
    assert!(f.reasons().is_empty());
    tokio::time::advance(OVERDUE_AFTER + Duration::from_secs(1)).await;
    for _ in 0..2 {
        assert_eq!(
            f.get(0).await.result.unwrap(),
            current,
            "kept while the signer is silent"
        );
    }
    assert_eq!(f.reasons(), ["CertificateOverdueForRefreshx1"]);
    assert_eq!(f.states(), ["overdue_for_refresh=1"]);
    tokio::time::advance(Duration::from_secs(3600)).await;
    assert_eq!(f.states(), ["expired=1"]);
    for _ in 0..2 {
        f.get(0).await.result.unwrap();
    }
    assert_eq!(
        f.reasons(),
        ["CertificateOverdueForRefreshx1", "CertificateExpiredx1"]
    );
    assert_eq!(
        f.requests.made().len(),
        2,
        "the one refresh request stays out"
    );
}
