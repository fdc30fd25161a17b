//! The node's own credentials: a client certificate rotated on disk is picked up without a
//! restart, an expired one and a server of an unknown authority are named as such.

use crate::certificates::openssl;
use crate::common::*;
use crate::{bound_pod, typed, until, NODE};
use kubevol::source::ClusterSource;
use kubevol_testserver::{Backend, TestCluster};
use serde_json::json;

/// A certificate for the cluster's node from the control plane's CA, valid from `start` to
/// `end` (`YYYYMMDDHHMMSSZ`), for the node's own key; written to `out`.
fn node_certificate(
    cluster: &TestCluster,
    dir: &std::path::Path,
    start: &str,
    end: &str,
    out: &std::path::Path,
) {
    let plane = cluster
        .control_plane_dir()
        .expect("the project's control plane (its CA signs the node's certificates)");
    let node = cluster.node_name();
    let key = plane.join(format!("nodes/{node}.key"));
    std::fs::write(dir.join("index.txt"), "").unwrap();
    std::fs::write(dir.join("serial"), "01\n").unwrap();
    std::fs::write(dir.join("ca.cnf"), "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\nnew_certs_dir = .\nserial = serial\ndefault_md = sha256\npolicy = p\nunique_subject = no\n[p]\ncommonName = supplied\norganizationName = optional\n").unwrap();
    std::fs::write(dir.join("ext"), "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n").unwrap();
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            key.to_str().unwrap(),
            "-subj",
            &format!("/O=system:nodes/CN=system:node:{node}"),
            "-out",
            "node.csr",
        ],
    );
    openssl(
        dir,
        &[
            "ca",
            "-batch",
            "-config",
            "ca.cnf",
            "-cert",
            plane.join("ca.crt").to_str().unwrap(),
            "-keyfile",
            plane.join("ca.key").to_str().unwrap(),
            "-in",
            "node.csr",
            "-out",
            out.to_str().unwrap(),
            "-startdate",
            start,
            "-enddate",
            end,
            "-extfile",
            "ext",
            "-notext",
        ],
    );
    std::fs::remove_file(dir.join("index.txt")).unwrap();
}

mount_test! {
    /// The node's certificate expires; the status and `/readyz` say that it did, and where it
    /// is; a fresh one written over the same files is picked up without a restart (the old
    /// connections dropped): a pod created meanwhile is mounted.
    fn a_client_certificate_rotated_on_disk_is_picked_up_without_a_restart() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let creds = root.path().join("creds");
            std::fs::create_dir_all(&creds).unwrap();
            let (cert, key) = (creds.join("node.crt"), creds.join("node.key"));
            let plane = cluster.control_plane_dir().unwrap().to_path_buf();
            std::fs::copy(plane.join(format!("nodes/{node}.key")), &key).unwrap();
            node_certificate(&cluster, &creds, "20200101000000Z", "20200102000000Z", &cert);
            let mut config = cluster.node_config();
            config.auth_info.client_certificate_data = None;
            config.auth_info.client_key_data = None;
            config.auth_info.client_certificate = Some(cert.display().to_string());
            config.auth_info.client_key = Some(key.display().to_string());
            cluster.expect_refusals();
            let m = manager(root.path(), |c| c.node_name = node.clone());
            m.add_source(ClusterSource::new(kubevol::source::cluster::client(config).unwrap(), &node));
            until(&m, 60, "the expired certificate named", || kubevol::http::readiness(&m).is_err_and(|e| e.contains("expired at 2020-01-02T00:00:00Z") && e.contains(&cert.display().to_string()))).await;
            let p = typed(&cluster.create(bound_pod("app", &node, json!([{"name": "tmp", "emptyDir": {}}]))).await);

            // Renewed in place, as a certificate manager does.
            std::fs::copy(plane.join(format!("nodes/{node}.crt")), &cert).unwrap();
            m.wait_for_attach_and_mount(&p).await.expect("mounted with the renewed certificate");
            until(&m, 120, "ready", || kubevol::http::readiness(&m).is_ok()).await;
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// The node's certificate expires while its watches run (a watch started before goes on):
    /// the first new read refused with 401 makes `/readyz` unavailable naming the expiry, and
    /// a new pod's Secret volume says the server refuses the node's reads, not only that the
    /// Secret has not been read yet.
    fn a_certificate_that_expires_while_watches_run_is_named_at_the_first_refused_read() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let creds = root.path().join("creds");
            std::fs::create_dir_all(&creds).unwrap();
            let (cert, key) = (creds.join("node.crt"), creds.join("node.key"));
            let plane = cluster.control_plane_dir().unwrap().to_path_buf();
            std::fs::copy(plane.join(format!("nodes/{node}.key")), &key).unwrap();
            let stamp = |t: k8s_openapi::jiff::Timestamp| t.strftime("%Y%m%d%H%M%SZ").to_string();
            let now = k8s_openapi::jiff::Timestamp::now();
            let end = now + k8s_openapi::jiff::SignedDuration::from_secs(20);
            node_certificate(&cluster, &creds, &stamp(now - k8s_openapi::jiff::SignedDuration::from_hours(1)), &stamp(end), &cert);
            let mut config = cluster.node_config();
            config.auth_info.client_certificate_data = None;
            config.auth_info.client_key_data = None;
            config.auth_info.client_certificate = Some(cert.display().to_string());
            config.auth_info.client_key = Some(key.display().to_string());
            cluster.expect_refusals();
            let m = manager(root.path(), |c| c.node_name = node.clone());
            m.add_source(ClusterSource::new(kubevol::source::cluster::client(config).unwrap(), &node));
            until(&m, 120, "ready with the certificate still valid", || kubevol::http::readiness(&m).is_ok()).await;
            // The certificate's end, by the clock (its last second included).
            while k8s_openapi::jiff::Timestamp::now() <= end + k8s_openapi::jiff::SignedDuration::from_secs(1) {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            assert!(kubevol::http::readiness(&m).is_ok(), "nothing refused yet: the pods' watch goes on");
            cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"}, "stringData": {"k": "v"}})).await;
            let p = typed(&cluster.create(bound_pod("late", &node, json!([{"name": "s", "secret": {"secretName": "creds"}}]))).await);
            until(&m, 120, "the expiry named by /readyz", || kubevol::http::readiness(&m).is_err_and(|e| e.contains("refuses the node's new reads") && e.contains("expired at") && e.contains(&cert.display().to_string()))).await;
            wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.last_error.as_ref().is_some_and(|e| e.contains("which refuses the node's reads") && e.contains("expired at"))).await;

            // Renewed in place: the pod's Secret is read, and the node is ready again.
            std::fs::copy(plane.join(format!("nodes/{node}.crt")), &cert).unwrap();
            m.wait_for_attach_and_mount(&p).await.expect("mounted with the renewed certificate");
            until(&m, 120, "ready", || kubevol::http::readiness(&m).is_ok()).await;
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// A server whose certificate another authority signed: the status says it is a TLS
    /// error of the server's certificate, not a bare "Connect".
    fn a_server_of_an_unknown_authority_is_named_as_a_tls_error() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let dir = root.path().join("other-ca");
            std::fs::create_dir_all(&dir).unwrap();
            openssl(&dir, &["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key", "-subj", "/CN=another-ca", "-days", "1", "-outform", "DER", "-out", "ca.der"]);
            let mut config = cluster.node_config();
            config.root_cert = Some(vec![std::fs::read(dir.join("ca.der")).unwrap()]);
            let m = manager(root.path(), |c| c.node_name = node.clone());
            m.add_source(ClusterSource::new(kubevol::source::cluster::client(config).unwrap(), &node));
            until(&m, 60, "a TLS error named", || kubevol::http::readiness(&m).is_err_and(|e| e.contains("invalid peer certificate") && e.contains("UnknownIssuer"))).await;
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}
