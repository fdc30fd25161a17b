//! Certificates projected from the API server: ClusterTrustBundles by name or by signer, and
//! pod certificates requested, issued by a test signer and written, or refused.

use std::time::Duration;

use crate::common::*;
use crate::{bound_pod, cluster_manager, typed, NODE};
use kubevol::source::ClusterSource;
use kubevol_testserver::TestCluster;
use serde_json::{json, Value};

/// Test certificates (self-signed, P-256): a real server checks that a bundle parses.
const CERTS: [&str; 4] = [
    include_str!("../certs/a.pem"),
    include_str!("../certs/b.pem"),
    include_str!("../certs/c.pem"),
    include_str!("../certs/d.pem"),
];

cluster_test_with_faults! {
    fn cluster_trust_bundles_are_projected_by_name_or_signer_and_their_absence_is_explained(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            let [a, b, c, d] = CERTS;
            let m = manager(root.path(), |c| c.node_name = node.clone());
            m.set_trust_bundles(std::sync::Arc::new(kubevol::source::cluster::ClusterTrustBundles::new(node_client(&cluster))));
            m.add_source(ClusterSource::new(node_client(&cluster), &node));
            let sources = json!([{"name": "ca", "projected": {"sources": [
                {"clusterTrustBundle": {"name": "kubevol-test-plain", "path": "plain.pem"}},
                {"clusterTrustBundle": {"signerName": "kubevol.io/test-signer", "labelSelector": {"matchLabels": {"trust": "yes"}}, "path": "signer.pem"}},
                {"clusterTrustBundle": {"name": "kubevol-test-absent", "path": "absent.pem", "optional": true}}]}}]);
            let version = cluster.certificates_version("clustertrustbundles").await;
            let served = version.is_some();
            assert!(served || !cluster.is_project_plane(), "the project's control plane serves ClusterTrustBundles: this test must project them there");
            assert_default_release_serves(&cluster, "clustertrustbundles", version).await;
            if let Some(version) = version {
                for (name, signer, pem) in [
                    ("kubevol.io:test-signer:a", Some("kubevol.io/test-signer"), format!("{a}{b}")),
                    ("kubevol.io:test-signer:b", Some("kubevol.io/test-signer"), format!("{b}{c}")),
                    ("kubevol-test-plain", None, d.to_string()),
                ] {
                    let mut bundle = json!({"apiVersion": format!("certificates.k8s.io/{version}"), "kind": "ClusterTrustBundle",
                                            "metadata": {"name": name, "labels": {"trust": "yes"}}, "spec": {"trustBundle": pem}});
                    if let Some(s) = signer {
                        bundle["spec"]["signerName"] = json!(s);
                    }
                    cluster.create(bundle).await;
                }
                let p = typed(&cluster.create(bound_pod("app", &node, sources.clone())).await);
                m.wait_for_attach_and_mount(&p).await.expect("mounted with the bundles");
                let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["ca"].path.clone();
                assert_eq!(std::fs::read_to_string(dir.join("plain.pem")).unwrap(), d);
                let signer = std::fs::read_to_string(dir.join("signer.pem")).unwrap();
                let mut each = [a, b, c];
                each.sort();
                assert_eq!(signer, each.concat(), "every bundle of the signer, each certificate once, in a stable order");
                assert!(!dir.join("absent.pem").exists(), "an optional source that matches nothing is skipped");

                // Ten volumes that select the same bundles share one read (each set-up reads):
                // at most one more LIST, with one answer kept for the rest.
                let lists = || cluster.node_requests().map(|r| r.get("list clustertrustbundles").copied().unwrap_or(0));
                let before = lists();
                let same: Vec<Value> = (0..10).map(|i| json!({"name": format!("ca{i}"), "projected": {"sources": [
                    {"clusterTrustBundle": {"signerName": "kubevol.io/test-signer", "labelSelector": {"matchLabels": {"trust": "yes"}}, "path": "signer.pem"}}]}})).collect();
                let many = typed(&cluster.create(bound_pod("many", &node, json!(same))).await);
                m.wait_for_attach_and_mount(&many).await.expect("ten volumes of one selection");
                if let (Some(before), Some(after)) = (before, lists()) {
                    assert!(after - before <= 1, "{} LISTs for ten volumes of one selection", after - before);
                }
            }

            // A server without the API: the volume says so.
            if let Some(server) = cluster.server() {
                server.disable("clustertrustbundles");
            } else if served {
                m.shutdown();
                cluster.clean_up().await;
                return;
            }
            // (A selection of its own: an answer read for another is kept a while.)
            let _ = sources;
            let later = json!([{"name": "ca", "projected": {"sources": [{"clusterTrustBundle": {"name": "kubevol-test-later", "path": "later.pem"}}]}}]);
            let q = typed(&cluster.create(bound_pod("later", &node, later)).await);
            // (Waits for the error that names the missing API: a retried error of another
            // kind may come first.)
            let unserved = "the API server does not serve ClusterTrustBundles (certificates.k8s.io/v1 or v1beta1)";
            wait_for_status(&m, &q, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.as_ref().is_some_and(|e| e.contains(unserved)))).await;
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

/// On the project's plane of the default release (1.37), `plural` is served at `v1` and not at
/// `v1beta1`: the plane runs as a default 1.37 cluster runs, without `--runtime-config`.
async fn assert_default_release_serves(cluster: &TestCluster, plural: &str, version: Option<&str>) {
    let release = std::env::var("KUBEVOL_K8S_RELEASE").unwrap_or_else(|_| "1.37".into());
    if cluster.is_project_plane() && release == "1.37" {
        assert_eq!(
            version,
            Some("v1"),
            "{plural} at certificates.k8s.io/v1 on a default 1.37 server"
        );
        assert!(
            !cluster.serves("certificates.k8s.io/v1beta1", plural).await,
            "a default 1.37 server does not serve {plural} at v1beta1"
        );
    }
}

/// The PodCertificateRequests of the test's namespace, at `version`, as an administrator reads
/// them.
fn requests_api(cluster: &TestCluster, version: &str) -> kube::Api<kube::api::DynamicObject> {
    let resource = kube::api::ApiResource {
        group: "certificates.k8s.io".into(),
        version: version.into(),
        api_version: format!("certificates.k8s.io/{version}"),
        kind: "PodCertificateRequest".into(),
        plural: "podcertificaterequests".into(),
    };
    kube::Api::namespaced_with(cluster.admin_client(), cluster.namespace(), &resource)
}

/// A signer of the test's own, as a cluster's signer controller is: it answers the
/// PodCertificateRequests of the test's namespace with an administrator's identity, issuing a
/// day's certificate from a CA made with OpenSSL (which also checks each stub request's
/// signature) for `kubevol.io/test-signer`, and denying every request for
/// `kubevol.io/test-denier`. The API server checks what it writes as it checks any signer's.
struct TestSigner {
    task: tokio::task::JoinHandle<()>,
    dir: tempfile::TempDir,
}

/// Runs `openssl` with `args` in `dir`; its output.
pub(crate) fn openssl(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs (the test command installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl TestSigner {
    fn start(cluster: &TestCluster, version: &str) -> Self {
        use base64::Engine as _;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        openssl(
            &d,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "2",
                "-subj",
                "/CN=kubevol-test-signer",
            ],
        );
        let api = requests_api(cluster, version);
        let task = tokio::spawn(async move {
            let mut answered = std::collections::HashSet::new();
            loop {
                for r in api
                    .list(&Default::default())
                    .await
                    .map(|l| l.items)
                    .unwrap_or_default()
                {
                    let name = r.metadata.name.clone().unwrap_or_default();
                    if answered.contains(&name) {
                        continue;
                    }
                    let spec = &r.data["spec"];
                    let now = chrono_now();
                    let status = if spec["signerName"] == "kubevol.io/test-denier" {
                        json!({"conditions": [{"type": "Denied", "status": "True", "reason": "Test", "message": "this signer denies everything", "lastTransitionTime": now}]})
                    } else {
                        let der = base64::engine::general_purpose::STANDARD
                            .decode(spec["stubPKCS10Request"].as_str().unwrap())
                            .unwrap();
                        std::fs::write(d.join("req.der"), der).unwrap();
                        openssl(
                            &d,
                            &[
                                "x509",
                                "-req",
                                "-inform",
                                "DER",
                                "-in",
                                "req.der",
                                "-CA",
                                "ca.crt",
                                "-CAkey",
                                "ca.key",
                                "-days",
                                "1",
                                "-set_serial",
                                &format!("{}", answered.len() + 1),
                                "-out",
                                "leaf.pem",
                            ],
                        );
                        let dates = openssl(
                            &d,
                            &[
                                "x509",
                                "-in",
                                "leaf.pem",
                                "-noout",
                                "-startdate",
                                "-enddate",
                                "-dateopt",
                                "iso_8601",
                            ],
                        );
                        let date = |key: &str| {
                            dates
                                .lines()
                                .find_map(|l| l.strip_prefix(key))
                                .unwrap()
                                .replace(' ', "T")
                        };
                        let (not_before, not_after) = (date("notBefore="), date("notAfter="));
                        let begin: k8s_openapi::jiff::Timestamp = not_before.parse().unwrap();
                        let begin = begin + k8s_openapi::jiff::SignedDuration::from_hours(12);
                        let chain = std::fs::read_to_string(d.join("leaf.pem")).unwrap()
                            + &std::fs::read_to_string(d.join("ca.crt")).unwrap();
                        json!({"conditions": [{"type": "Issued", "status": "True", "reason": "Issued", "message": "issued by the test signer", "lastTransitionTime": now}],
                               "certificateChain": chain, "notBefore": not_before, "notAfter": not_after, "beginRefreshAt": begin.to_string()})
                    };
                    let patch = kube::api::Patch::Merge(json!({"status": status}));
                    api.patch_status(&name, &Default::default(), &patch)
                        .await
                        .expect("the API server takes the signer's answer");
                    answered.insert(name);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        TestSigner { task, dir }
    }

    fn ca(&self) -> std::path::PathBuf {
        self.dir.path().join("ca.crt")
    }
}

impl Drop for TestSigner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Now, as the API writes times.
fn chrono_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .unwrap()
        .to_string()
}

cluster_test_with_faults! {
    /// podCertificate projected sources: for each source the node makes a key pair and a
    /// PodCertificateRequest (for its pod, service account and node, by UID), and once the
    /// signer has issued the chain writes the key and chain where the source says: the bundle
    /// key first, or separate files whose key is the certificate's. A denied request fails the
    /// volume for good, saying why, and is told to the pod. On the real control plane (the
    /// feature on) the API server checks every request; a server without the API (the
    /// in-process one) makes the volume say so.
    fn pod_certificates_are_requested_issued_and_written_or_refused(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            ensure_node(&cluster).await;
            if !cluster.is_real() {
                cluster.create(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})).await;
            }
            let m = cluster_manager(root.path(), &cluster);
            m.set_token_issuer(std::sync::Arc::new(kubevol::source::cluster::ClusterTokens::new(node_client(&cluster))));
            m.set_certificate_requests(std::sync::Arc::new(kubevol::source::cluster::ClusterCertificates::new(&m, node_client(&cluster))));
            let sources = |signer: &str| json!([{"name": "certs", "projected": {"sources": [
                {"podCertificate": {"signerName": signer, "keyType": "ED25519", "credentialBundlePath": "bundle.pem", "userAnnotations": {"kubevol.io/purpose": "test"}}},
                {"podCertificate": {"signerName": signer, "keyType": "ECDSAP384", "keyPath": "tls.key", "certificateChainPath": "tls.crt", "maxExpirationSeconds": 86400}}]}}]);
            let version = cluster.certificates_version("podcertificaterequests").await;
            assert!(version.is_some() || !cluster.is_project_plane(), "the project's control plane serves PodCertificateRequests: this test must issue them there");
            assert_default_release_serves(&cluster, "podcertificaterequests", version).await;
            let Some(version) = version else {
                let p = typed(&cluster.create(bound_pod("app", &node, sources("kubevol.io/test-signer"))).await);
                // Until the node's watch has brought the Node object, the volume waits for its
                // UID (a retried error of its own); then it says the API is missing.
                let unserved = "the API server does not serve PodCertificateRequests (certificates.k8s.io/v1 or v1beta1)";
                let s = wait_for_status(&m, &p, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.as_ref().is_some_and(|e| e.contains(unserved)))).await;
                assert!(!s.volumes[0].retry.permanent, "the API may be turned on: retried");
                m.shutdown();
                cluster.clean_up().await;
                return;
            };
            let signer = TestSigner::start(&cluster, version);
            let p = typed(&cluster.create(bound_pod("app", &node, sources("kubevol.io/test-signer"))).await);
            m.wait_for_attach_and_mount(&p).await.expect("mounted once the certificates are issued");
            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["certs"].path.clone();
            let ca = signer.ca();
            let ca = ca.to_str().unwrap();

            // The bundle: the key, then the chain; the key is the certificate's.
            let bundle = std::fs::read_to_string(dir.join("bundle.pem")).unwrap();
            assert!(bundle.starts_with("-----BEGIN PRIVATE KEY-----\n"), "{bundle}");
            assert_eq!(bundle.matches("-----BEGIN CERTIFICATE-----").count(), 2, "leaf and CA");
            let work = root.path().join("check");
            std::fs::create_dir(&work).unwrap();
            std::fs::write(work.join("bundle.pem"), &bundle).unwrap();
            let pubkey = |args: &[&str]| openssl(&work, args);
            assert_eq!(pubkey(&["pkey", "-in", "bundle.pem", "-pubout"]), pubkey(&["x509", "-in", "bundle.pem", "-noout", "-pubkey"]));
            assert!(pubkey(&["x509", "-in", "bundle.pem", "-noout", "-text"]).contains("ED25519"));
            // The separate files: a P-384 key and its chain, verified up to the signer's CA.
            let key = dir.join("tls.key");
            let crt = dir.join("tls.crt");
            assert_eq!(
                pubkey(&["pkey", "-in", key.to_str().unwrap(), "-pubout"]),
                pubkey(&["x509", "-in", crt.to_str().unwrap(), "-noout", "-pubkey"])
            );
            assert!(pubkey(&["pkey", "-in", key.to_str().unwrap(), "-noout", "-text"]).contains("NIST CURVE: P-384"));
            assert!(pubkey(&["verify", "-CAfile", ca, crt.to_str().unwrap()]).contains("OK"));
            use std::os::unix::fs::PermissionsExt as _;
            assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o644, "the volume's default mode");

            // The requests: one per source, for this pod, its account and this node, by UID.
            let pcrs = requests_api(&cluster, version);
            let requests: Vec<Value> = pcrs.list(&Default::default()).await.unwrap().items.into_iter().map(|o| serde_json::to_value(o).unwrap()).collect();
            assert_eq!(requests.len(), 2, "{requests:#?}");
            let node_uid = cluster.get("v1", "nodes", &node).await.unwrap()["metadata"]["uid"].clone();
            let account_uid = cluster.get("v1", "serviceaccounts", "default").await.unwrap()["metadata"]["uid"].clone();
            for r in &requests {
                let spec = &r["spec"];
                assert_eq!(spec["podUID"], p.metadata.uid.clone().unwrap().as_str(), "{r:#}");
                assert_eq!(spec["nodeName"], node.as_str());
                assert_eq!(spec["nodeUID"], node_uid);
                assert_eq!(spec["serviceAccountUID"], account_uid);
                assert_eq!(r["metadata"]["ownerReferences"][0]["uid"], spec["podUID"]);
            }
            assert!(requests.iter().any(|r| r["spec"]["unverifiedUserAnnotations"] == json!({"kubevol.io/purpose": "test"})));

            // Denied: the volume fails for good and the pod is told.
            let q = typed(&cluster.create(bound_pod("denied", &node, sources("kubevol.io/test-denier"))).await);
            let s = wait_for_status(&m, &q, 60, |s| s.volumes[0].retry.permanent).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("was denied by signer kubevol.io/test-denier, reason=\"Test\" message=\"this signer denies everything\""), "{e}");
            assert!(m.events().iter().any(|e| e.reason == "Denied" && e.message.contains("kubevol.io/test-denier")), "a Denied event");
            let metrics = m.metrics_text();
            // (The second denied source may not have been looked at: the first failed the
            // volume for good.)
            for line in [r#"kubelet_podcertificate_states{signer_name="kubevol.io/test-signer",state="fresh"} 2"#,
                         r#"kubelet_podcertificate_states{signer_name="kubevol.io/test-denier",state="denied"} "#] {
                assert!(metrics.contains(line), "{line}\n{metrics}");
            }
            m.shutdown();
            drop(signer);
            cluster.clean_up().await;
        });
    }
}
