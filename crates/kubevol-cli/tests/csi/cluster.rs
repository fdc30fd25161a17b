//! CSI volumes on a node of a cluster (the in-process API server and the real one): volumes in
//! use, the attach/detach controller, service account tokens, CSINode allocatable, expansion
//! asked by the resize controller, and in-tree volumes served through CSI migration.

use super::*;

/// Creates in the cluster a claim of `name` on the loop driver and its PersistentVolume (named
/// for the test, [`TestCluster::scoped`], with the volume handle `name`), bound to each other
/// in the test's namespace (the test plays the PV controller: the claim's status says Bound),
/// the CSIDriver, and a pod bound to the node that uses the claim. The CSIDriver's name is
/// the cluster's one for the driver: hold [`TestCluster::exclusive`] on it.
async fn create_claim_pod(
    cluster: &kubevol_testserver::TestCluster,
    name: &str,
    attach: bool,
) -> Pod {
    create_claim_pod_with(cluster, name, csi_driver(attach)).await
}

/// [`create_claim_pod`] with the CSIDriver `driver`.
async fn create_claim_pod_with(
    cluster: &kubevol_testserver::TestCluster,
    name: &str,
    driver: serde_json::Value,
) -> Pod {
    let pv_name = cluster.scoped(name);
    let mut volume = pv(name, "16Mi", "Filesystem");
    volume["metadata"]["name"] = json!(pv_name);
    volume["spec"]["claimRef"]["namespace"] = json!(cluster.namespace());
    let mut claim = pvc(name, "Filesystem");
    claim["spec"]["volumeName"] = json!(pv_name);
    fresh(cluster, driver).await;
    cluster.create(volume).await;
    cluster.create(claim).await;
    cluster.bind_claim(name, &pv_name).await;
    let mut pod = serde_json::to_value(claim_pod("app", name)).unwrap();
    pod["spec"]["nodeName"] = json!(cluster.node_name());
    pod["spec"]["automountServiceAccountToken"] = json!(false);
    serde_json::from_value(cluster.create(pod).await).unwrap()
}

/// Creates `object` (a CSIDriver or the node's Node, which the cluster shares between tests:
/// hold [`TestCluster::exclusive`] on its name), deleting the one a test before left: some of
/// a CSIDriver's fields cannot change.
async fn fresh(cluster: &kubevol_testserver::TestCluster, object: serde_json::Value) {
    let (group_version, plural) = match object["kind"].as_str() {
        Some("CSIDriver") => ("storage.k8s.io/v1", "csidrivers"),
        _ => ("v1", "nodes"),
    };
    let name = object["metadata"]["name"].as_str().unwrap().to_string();
    if cluster.get(group_version, plural, &name).await.is_some() {
        cluster.delete(group_version, plural, &name, None).await;
    }
    cluster.create(object).await;
}

/// The node's Node, made anew.
async fn fresh_node(cluster: &kubevol_testserver::TestCluster) {
    let node =
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": cluster.node_name()}});
    fresh(cluster, node).await;
}

/// A manager as `kubevol run --kubeconfig` makes it: a node of `cluster`.
/// A cluster on `backend` for node `test-node`, and the guard that keeps `driver`'s
/// cluster-wide objects this test's alone while it runs.
async fn cluster_for(
    backend: kubevol_testserver::Backend,
    driver: &str,
) -> (kubevol_testserver::TestCluster, Option<std::fs::File>) {
    let cluster = kubevol_testserver::TestCluster::start_on(backend, "test-node").await;
    let guard = cluster.exclusive(driver);
    (cluster, guard)
}

fn cluster_manager(root: &Path, cluster: &kubevol_testserver::TestCluster) -> VolumeManager {
    cluster_manager_with(root, cluster, |_| {})
}

/// [`cluster_manager`] with `configure` applied to its configuration.
fn cluster_manager_with(
    root: &Path,
    cluster: &kubevol_testserver::TestCluster,
    configure: impl FnOnce(&mut kubevol::Config),
) -> VolumeManager {
    let name = cluster.node_name().to_string();
    let m = manager(root, |c| {
        c.node_name = name;
        configure(c);
    });
    kubevol::source::cluster::join(&m, node_client(cluster));
    m
}

/// The cluster's node with no Node object (a real cluster's test node is one no kubelet runs).
async fn without_node(cluster: &kubevol_testserver::TestCluster) {
    if cluster
        .get("v1", "nodes", cluster.node_name())
        .await
        .is_some()
    {
        cluster
            .delete("v1", "nodes", cluster.node_name(), None)
            .await;
    }
}

/// The VolumeAttachment name the attach/detach controller gives volume `handle` of CSI driver
/// `driver` on node `node`: `csi-` and the SHA-256 of the three, in hex.
fn attachment_name(handle: &str, driver: &str, node: &str) -> String {
    use sha2::Digest;
    let hash = sha2::Sha256::digest(format!("{handle}{driver}{node}").as_bytes());
    format!(
        "csi-{}",
        hash.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

/// For CSI migration as a node of a cluster: the CSIDriver `driver` (`attach`: whether it
/// requires attaching), the node's Node, a PersistentVolume of the in-tree `source` bound to
/// claim `old` of the test's namespace, and a pod of the node that uses the claim. Returns the
/// PersistentVolume's name and the pod.
async fn migrated_claim_pod(
    cluster: &kubevol_testserver::TestCluster,
    driver: &str,
    attach: bool,
    source: serde_json::Value,
) -> (String, Pod) {
    fresh(cluster, json!({"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": driver}, "spec": {"attachRequired": attach}})).await;
    fresh_node(cluster).await;
    let pv_name = cluster.scoped("old");
    let mut spec = json!({"capacity": {"storage": "16Mi"}, "accessModes": ["ReadWriteOnce"], "claimRef": {"namespace": cluster.namespace(), "name": "old"}});
    spec.as_object_mut()
        .unwrap()
        .extend(source.as_object().unwrap().clone());
    cluster
        .create(json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name}, "spec": spec}))
        .await;
    let mut claim = pvc("old", "Filesystem");
    claim["spec"]["volumeName"] = json!(pv_name);
    cluster.create(claim).await;
    cluster.bind_claim("old", &pv_name).await;
    let mut pod = serde_json::to_value(claim_pod("app", "old")).unwrap();
    pod["spec"]["nodeName"] = json!(cluster.node_name());
    pod["spec"]["automountServiceAccountToken"] = json!(false);
    let pod = serde_json::from_value(cluster.create(pod).await).unwrap();
    (pv_name, pod)
}

/// A volume the attach/detach controller attaches: its CSI driver and handle, its
/// PersistentVolume, and its unique name in the Node's `status.volumesAttached`.
struct Attached {
    driver: &'static str,
    handle: &'static str,
    pv: String,
    unique: String,
}

/// Plays the attach/detach controller and the external attacher for `volume` on the cluster's
/// node (`node_id` to the driver): attaches it through the driver's controller service, makes
/// its VolumeAttachment under the name the controller computes (`csi-` and the SHA-256 of the
/// handle, the driver and the node's name), attached, with the attachment metadata the driver
/// gave, and lists it in the Node's `status.volumesAttached`. Returns that metadata.
async fn attach_as_the_controller(
    cluster: &kubevol_testserver::TestCluster,
    driver: &Driver,
    node_id: &str,
    volume: &Attached,
) -> std::collections::HashMap<String, String> {
    use kubevol_csi::v1::controller_client::ControllerClient;
    use kubevol_csi::v1::*;
    let name = cluster.node_name();
    let mut controller = ControllerClient::new(kubevol_csi::connect(&driver.socket()));
    let cap = VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(
            volume_capability::MountVolume {
                fs_type: "ext4".into(),
                ..Default::default()
            },
        )),
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
    };
    let published = controller
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: volume.handle.into(),
            node_id: node_id.into(),
            volume_capability: Some(cap),
            volume_context: [("size".to_string(), "16Mi".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let attachment = attachment_name(volume.handle, volume.driver, name);
    let made = cluster
        .create(json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": attachment},
            "spec": {"attacher": volume.driver, "nodeName": name, "source": {"persistentVolumeName": volume.pv}}}))
        .await;
    // The external attacher's status, through the status subresource.
    let attachments: kube::Api<k8s_openapi::api::storage::v1::VolumeAttachment> =
        kube::Api::all(cluster.admin_client());
    let mut made: k8s_openapi::api::storage::v1::VolumeAttachment =
        serde_json::from_value(made).unwrap();
    made.status = Some(k8s_openapi::api::storage::v1::VolumeAttachmentStatus {
        attached: true,
        attachment_metadata: Some(published.clone().into_iter().collect()),
        ..Default::default()
    });
    attachments
        .replace_status(&attachment, &Default::default(), &made)
        .await
        .unwrap();
    // The attach/detach controller's record on the Node.
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(cluster.admin_client());
    let attached =
        json!({"status": {"volumesAttached": [{"name": volume.unique, "devicePath": ""}]}});
    nodes
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&attached),
        )
        .await
        .unwrap();
    published
}

cluster_test! {
    /// As a node of a cluster, a CSI volume is listed in the Node's status.volumesInUse before
    /// it is staged (staging waits for the report) and dropped only after it is unstaged; the
    /// Node's other fields are left as they are.
    fn a_cluster_node_reports_its_volumes_in_use_before_staging_and_after_unstaging(backend) {
        let t = TestRoot::new();
        // NodeUnstageVolume answers 20 s after its work: the volume must stay in use meanwhile.
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &["--delay", "NodeUnstageVolume:20000"]);
        runtime().block_on(async {
            let (cluster, _driver_name) = cluster_for(backend, DRIVER).await;
            let name = cluster.node_name().to_string();
            without_node(&cluster).await;
            let pod = create_claim_pod(&cluster, "data", false).await;
            let m = cluster_manager(t.path(), &cluster);

            // No Node object yet: nothing can be reported, so nothing is staged.
            let uid = kubevol::pod_uid(&pod);
            wait_for_status(&m, &pod, 120, |s| s.uid == uid.as_str()).await;
            wait_until("driver registration", 120, || m.csi_drivers().iter().any(|d| d.name == DRIVER)).await;
            // A pass of the reconciler begun after the registration has planned the volume with
            // its driver there: what it did not stage, it decided not to stage.
            let passes = m.reconciler_passes();
            wait_until("a pass after the registration", 120, || m.reconciler_passes() > passes).await;
            assert_eq!(driver.requests("NodeStageVolume").len(), 0, "staged before it was reported in use");
            cluster.create(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"zone": "a"}}})).await;
            // The node's other status fields (set here as the node's owner would).
            let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(cluster.admin_client());
            let capacity = json!({"status": {"capacity": {"cpu": "2"}}});
            nodes.patch_status(&name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&capacity)).await.unwrap();
            m.wait_for_attach_and_mount(&pod).await.expect("staged and published once reported");
            let status = cluster.get("v1", "nodes", &name).await.unwrap();
            assert_eq!(status["status"]["volumesInUse"], json!([format!("kubernetes.io/csi/{DRIVER}^data")]));
            assert_eq!(status["status"]["capacity"]["cpu"], json!("2"), "other status fields kept");

            // The driver's registration is published: CSINode, the node ID annotation and the
            // topology label.
            let csinode = || cluster.get("storage.k8s.io/v1", "csinodes", &name);
            let published = || async {
                csinode().await.is_some_and(|c| c["spec"]["drivers"].as_array().is_some_and(|d| d.len() == 1) && c["metadata"]["ownerReferences"].is_array())
            };
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while !published().await {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no CSINode entry owned by the Node within 60 s: CSINode {:#?}, Node {:#?}, drivers {:#?}",
                    csinode().await,
                    cluster.get("v1", "nodes", &name).await,
                    m.csi_drivers()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let entry = csinode().await.unwrap()["spec"]["drivers"][0].clone();
            let node_id = m.csi_drivers()[0].node_id.clone();
            assert_eq!(entry, json!({"name": DRIVER, "nodeID": node_id, "topologyKeys": ["topology.loop.csi.kubevol.io/node"]}));
            assert_eq!(csinode().await.unwrap()["metadata"]["ownerReferences"][0]["kind"], json!("Node"));
            // The in-tree plugins served through CSI, for the attach/detach controller.
            assert_eq!(
                csinode().await.unwrap()["metadata"]["annotations"]["storage.alpha.kubernetes.io/migrated-plugins"],
                json!(kubevol_core::migration::migrated_plugins())
            );
            let node_meta = || async { cluster.get("v1", "nodes", &name).await.unwrap()["metadata"].clone() };
            eventually("the Node's CSI annotation", 120, || async { node_meta().await["annotations"]["csi.volume.kubernetes.io/nodeid"].is_string() }).await;
            let meta = node_meta().await;
            let ids: serde_json::Value = serde_json::from_str(meta["annotations"]["csi.volume.kubernetes.io/nodeid"].as_str().unwrap()).unwrap();
            assert_eq!(ids, json!({DRIVER: node_id}));
            assert_eq!(meta["labels"], json!({"zone": "a", "topology.loop.csi.kubevol.io/node": node_id}), "the topology label beside the Node's own");

            cluster.delete("v1", "pods", "app", Some(0)).await;
            let in_use = || async { cluster.get("v1", "nodes", &name).await.unwrap()["status"]["volumesInUse"].clone() };
            // While the unstage is in flight (begun, not answered), the volume is still in use.
            eventually("NodeUnstageVolume begun", 120, || async { !driver.requests("NodeUnstageVolume").is_empty() }).await;
            let during = in_use().await;
            assert_eq!(driver.count("NodeUnstageVolume", "Ok"), 0, "the unstage was still in flight when volumesInUse was read");
            assert!(during.as_array().is_some_and(|v| !v.is_empty()), "in use while the unstage is in flight: {during}");
            eventually("volumesInUse emptied", 120, || async { in_use().await.as_array().is_none_or(Vec::is_empty) }).await;
            assert_eq!(driver.count("NodeUnstageVolume", "Ok"), 1, "dropped from volumesInUse only after the unstage");

            // The driver goes: its entry, annotation and label go with it.
            let mut driver = driver;
            driver.stop();
            eventually("the CSINode entry removed", 120, || async { csinode().await.is_some_and(|c| c["spec"]["drivers"].as_array().is_none_or(Vec::is_empty)) }).await;
            eventually("the Node's CSI annotation and label removed", 120, || async {
                let meta = node_meta().await;
                meta["annotations"].get("csi.volume.kubernetes.io/nodeid").is_none() && meta["labels"] == json!({"zone": "a"})
            })
            .await;
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// As a node of a cluster, an attachable CSI volume is attached by the attach/detach
    /// controller, not by kubevol: kubevol waits until the volume is in the Node's
    /// status.volumesAttached and its VolumeAttachment is attached, stages it with the
    /// VolumeAttachment's attachmentMetadata, and never calls the controller service itself.
    /// (The test plays the controller and the external attacher.)
    fn a_cluster_node_waits_for_the_attach_detach_controller(backend) {
        use kubevol_csi::v1::controller_client::ControllerClient;
        use kubevol_csi::v1::ControllerUnpublishVolumeRequest;
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let (cluster, _driver_name) = cluster_for(backend, DRIVER).await;
            let name = cluster.node_name().to_string();
            fresh_node(&cluster).await;
            let pod = create_claim_pod(&cluster, "att", true).await;
            let m = cluster_manager(t.path(), &cluster);

            let unique = format!("kubernetes.io/csi/{DRIVER}^att");
            let s = wait_for_status(&m, &pod, 120, |s| s.volumes[0].retry.last_error.as_deref().is_some_and(|e| e.contains("volumesAttached"))).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains(&format!("waiting for the attach/detach controller: volume {unique} is not in Node {name}'s status.volumesAttached yet")), "{e}");
            let in_use = || async { cluster.get("v1", "nodes", &name).await.unwrap()["status"]["volumesInUse"].clone() };
            assert_eq!(in_use().await, json!([unique]), "reported in use before it is attached");
            // Described: reported in use, waiting at the attach for the controller.
            let d = m.describe_pod(&kubevol::pod_uid(&pod)).unwrap();
            let states: Vec<(String, kubevol::describe::StepState)> = d.chains[0].steps.iter().map(|s| (s.step.clone(), s.state)).collect();
            use kubevol::describe::StepState::{Done, Failed};
            assert!(states.contains(&("reported in use".into(), Done)) && states.contains(&("attach".into(), Failed)), "{states:?}");
            let why = d.chains[0].waiting_for.clone().unwrap();
            assert!(why.starts_with("attach: ") && why.contains("status.volumesAttached"), "{why}");

            // The controller attaches (through the driver's controller service, as the
            // external attacher does) and records it.
            let node_id = m.csi_drivers()[0].node_id.clone();
            let volume = Attached { driver: DRIVER, handle: "att", pv: cluster.scoped("att"), unique: unique.clone() };
            let published = attach_as_the_controller(&cluster, &driver, &node_id, &volume).await;
            let mut controller = ControllerClient::new(kubevol_csi::connect(&driver.socket()));
            m.wait_for_attach_and_mount(&pod).await.expect("staged and published once the controller attached it");
            let stage = driver.requests("NodeStageVolume");
            assert_eq!(stage.len(), 1);
            for (k, v) in &published {
                assert_eq!(stage[0]["publish_context"][k], json!(v), "the VolumeAttachment's metadata is the publish context: {stage:?}");
            }
            assert_eq!(driver.count("ControllerPublishVolume", "Ok"), 1, "only the controller's own call");

            cluster.delete("v1", "pods", "app", Some(0)).await;
            eventually("volumesInUse emptied", 120, || async { in_use().await.as_array().is_none_or(Vec::is_empty) }).await;
            assert_eq!(driver.count("NodeUnstageVolume", "Ok"), 1);
            assert_eq!(driver.count("ControllerUnpublishVolume", "Ok"), 0, "kubevol leaves the detach to the controller");
            controller
                .controller_unpublish_volume(ControllerUnpublishVolumeRequest { volume_id: "att".into(), node_id, ..Default::default() })
                .await
                .unwrap();
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// A CSIDriver's tokenRequests: NodePublishVolume carries a service account token of each
    /// audience, bound to the pod, with its expiry — in the volume context, or, once the
    /// CSIDriver says `serviceAccountTokenInSecrets`, in the secrets only. With
    /// `requiresRepublish` a mounted volume is published again (here when the CSIDriver
    /// changes). The real server's NodeRestriction lets a node ask only for audiences its pods'
    /// volumes name; the audit check sees no refusal.
    fn csi_service_account_tokens_go_where_the_csi_driver_says(backend) {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let (cluster, _driver_name) = cluster_for(backend, DRIVER).await;
            let audience = cluster.scoped("loop-audience");
            fresh(&cluster, token_driver(&audience, false)).await;
            if !cluster.is_real() {
                // A real cluster's ServiceAccount controller makes `default` by itself.
                cluster.create(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})).await;
            }
            let mut pod = serde_json::to_value(inline_pod("app")).unwrap();
            pod["spec"]["nodeName"] = json!(cluster.node_name());
            pod["spec"]["automountServiceAccountToken"] = json!(false);
            let pod: Pod = serde_json::from_value(cluster.create(pod).await).unwrap();
            let uid = kubevol::pod_uid(&pod);
            let m = cluster_manager(t.path(), &cluster);
            m.wait_for_attach_and_mount(&pod).await.expect("published");

            let publish = driver.requests("NodePublishVolume").pop().unwrap();
            let tokens: serde_json::Value = serde_json::from_str(publish["context"]["csi.storage.k8s.io/serviceAccount.tokens"].as_str().expect("tokens in the context")).unwrap();
            let token = &tokens[&audience];
            let claims = jwt_claims(token["token"].as_str().unwrap());
            assert_eq!(claims["aud"], json!([audience]), "{claims:#}");
            assert_eq!(claims["kubernetes.io"]["pod"]["uid"], json!(uid.as_str()), "bound to the pod: {claims:#}");
            assert_eq!(claims["kubernetes.io"]["pod"]["name"], json!("app"));
            let expires = token["expirationTimestamp"].as_str().unwrap();
            let expires: k8s_openapi::jiff::Timestamp = expires.parse().unwrap();
            assert_eq!(expires.as_second(), claims["exp"].as_i64().unwrap(), "the token's own expiry");
            assert!(!publish["secret_keys"].as_array().unwrap().iter().any(|k| k == "csi.storage.k8s.io/serviceAccount.tokens"), "{publish}");

            // Tokens in the secrets: published again (requiresRepublish), and the context no
            // longer has them.
            cluster.apply(token_driver(&audience, true)).await;
            let publishes = driver.requests("NodePublishVolume").len();
            eventually("a republish with the tokens in the secrets", 120, || {
                let all = driver.requests("NodePublishVolume");
                let done = all.len() > publishes && all.last().is_some_and(|p| !p["secret_tokens"].is_null());
                async move { done }
            })
            .await;
            let publish = driver.requests("NodePublishVolume").pop().unwrap();
            assert!(publish["context"].get("csi.storage.k8s.io/serviceAccount.tokens").is_none(), "{publish}");
            let shown = &publish["secret_tokens"][&audience];
            let claims = jwt_claims(&format!("x.{}.y", shown["claims"].as_str().unwrap()));
            assert_eq!(claims["aud"], json!([audience]), "{claims:#}");
            assert_eq!(claims["kubernetes.io"]["pod"]["uid"], json!(uid.as_str()));
            assert!(shown["expirationTimestamp"].is_string(), "{shown}");
            // The pod's status and events never show a token.
            let shown_everywhere = format!("{}{}", serde_json::to_string(&m.status(true)).unwrap(), serde_json::to_string(&m.events()).unwrap());
            assert!(!shown_everywhere.contains(token["token"].as_str().unwrap()));

            cluster.delete("v1", "pods", "app", Some(0)).await;
            m.wait_for_unmount(&pod).await.unwrap();
            assert!(driver.count("NodeUnpublishVolume", "Ok") >= 1);
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// A CSIDriver's nodeAllocatableUpdatePeriodSeconds: the driver's volume limit is read again
    /// (NodeGetInfo) on that period and CSINode's `allocatable.count` follows it; and, as soon
    /// as an attach failed with ResourceExhausted (the VolumeAttachment's
    /// `attachError.errorCode`), the limit is read again at once, whatever the period, and the
    /// volume's error says the node is full.
    fn csinode_allocatable_follows_the_driver_periodically_and_after_resource_exhausted(backend) {
        let t = TestRoot::new();
        let max = t.path().join("max-volumes");
        std::fs::write(&max, "5").unwrap();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &["--max-volumes-file", max.to_str().unwrap()]);
        runtime().block_on(async {
            let (cluster, _driver_name) = cluster_for(backend, DRIVER).await;
            let name = cluster.node_name().to_string();
            fresh_node(&cluster).await;
            let mut with_period = csi_driver(true);
            with_period["spec"]["nodeAllocatableUpdatePeriodSeconds"] = json!(10);
            fresh(&cluster, with_period.clone()).await;
            let m = cluster_manager(t.path(), &cluster);
            let count = || async {
                cluster.get("storage.k8s.io/v1", "csinodes", &name).await.and_then(|c| c["spec"]["drivers"][0]["allocatable"]["count"].as_i64())
            };
            eventually("CSINode's count from registration", 120, || async { count().await == Some(5) }).await;
            let infos = driver.count("NodeGetInfo", "Ok");

            // Periodically: the driver's share shrinks, CSINode follows within the period.
            std::fs::write(&max, "3").unwrap();
            eventually("CSINode's count read again on the period", 120, || async { count().await == Some(3) }).await;
            assert!(driver.count("NodeGetInfo", "Ok") > infos, "NodeGetInfo was called again");

            // An hour's period: only the failed attach makes the count be read again now. (The
            // attacher has recorded its failure before the pod comes: a node may read a
            // VolumeAttachment only once it exists.)
            with_period["spec"]["nodeAllocatableUpdatePeriodSeconds"] = json!(3600);
            std::fs::write(&max, "1").unwrap();
            let attachment = attachment_name("full", DRIVER, &name);
            let made = cluster.create(json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": attachment},
                "spec": {"attacher": DRIVER, "nodeName": name, "source": {"persistentVolumeName": cluster.scoped("full")}}})).await;
            let attachments: kube::Api<k8s_openapi::api::storage::v1::VolumeAttachment> = kube::Api::all(cluster.admin_client());
            let mut made: k8s_openapi::api::storage::v1::VolumeAttachment = serde_json::from_value(made).unwrap();
            made.status = Some(serde_json::from_value(json!({"attached": false, "attachError": {"message": "no free loop devices", "errorCode": 8, "time": "2026-01-01T00:00:00Z"}})).unwrap());
            attachments.replace_status(&attachment, &Default::default(), &made).await.unwrap();
            let pod = create_claim_pod_with(&cluster, "full", with_period).await;
            let s = wait_for_status(&m, &pod, 120, |s| s.volumes[0].retry.last_error.as_deref().is_some_and(|e| e.contains("ResourceExhausted"))).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains(&format!("failed with ResourceExhausted (VolumeAttachment {attachment}: no free loop devices): this node has no room for more volumes of CSI driver {DRIVER}")), "{e}");
            assert!(e.contains("read again from NodeGetInfo: 1"), "{e}");
            eventually("CSINode's count after the failed attach", 120, || async { count().await == Some(1) }).await;

            cluster.delete("v1", "pods", "app", Some(0)).await;
            m.wait_for_unmount(&pod).await.unwrap();
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

/// A PersistentVolume of the loop driver grown to `grown` (its file still `size`), and its
/// claim bound to it whose status says the resize controller's part is done and the node's is
/// pending, as the external-resizer leaves it; then a pod bound to the node that uses it.
async fn create_resize_pending_pod(
    cluster: &kubevol_testserver::TestCluster,
    name: &str,
    size: &str,
    grown: &str,
) -> Pod {
    let pv_name = cluster.scoped(name);
    // xfs: growing ext4 online needs CAP_SYS_RESOURCE, which containers often drop; 300Mi is
    // xfs's minimum.
    let mut volume = pv_fs(name, size, "Filesystem", "xfs");
    volume["metadata"]["name"] = json!(pv_name);
    volume["spec"]["capacity"]["storage"] = json!(grown);
    volume["spec"]["claimRef"]["namespace"] = json!(cluster.namespace());
    cluster.create(volume).await;
    let mut claim = pvc(name, "Filesystem");
    claim["spec"]["volumeName"] = json!(pv_name);
    claim["spec"]["resources"]["requests"]["storage"] = json!(grown);
    cluster.create(claim).await;
    // Bound (by the cluster's binder, or the test in process), then the resizer's part: the
    // controller has grown the volume, the node's part is pending.
    cluster.bind_claim(name, &pv_name).await;
    let status = json!({"status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": size},
        "allocatedResources": {"storage": grown}, "allocatedResourceStatuses": {"storage": "NodeResizePending"},
        "conditions": [{"type": "FileSystemResizePending", "status": "True"}, {"type": "Custom", "status": "True"}]}});
    let claims: kube::Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        kube::Api::namespaced(cluster.admin_client(), cluster.namespace());
    claims
        .patch_status(name, &Default::default(), &kube::api::Patch::Merge(status))
        .await
        .unwrap();
    let mut pod = serde_json::to_value(claim_pod(name, name)).unwrap();
    pod["spec"]["nodeName"] = json!(cluster.node_name());
    pod["spec"]["automountServiceAccountToken"] = json!(false);
    serde_json::from_value(cluster.create(pod).await).unwrap()
}

cluster_test! {
    /// The node's part of an expansion, as the kubelet's: with the claim's
    /// `allocatedResourceStatuses[storage]` at NodeResizePending, the node marks
    /// NodeResizeInProgress, calls NodeExpandVolume, and in one patch records the new capacity,
    /// clears the status and drops the expansion's conditions (others stay). A final error the
    /// driver calls out of range marks NodeResizeInfeasible with a NodeResizeError condition,
    /// and the volume is then used at its old size until the user asks again.
    fn a_claim_is_expanded_on_the_node_when_the_resize_controller_asks(backend) {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &["--inject", "NodeExpandVolume:OUT_OF_RANGE:1"]);
        runtime().block_on(async {
            let (cluster, _driver_name) = cluster_for(backend, DRIVER).await;
            fresh(&cluster, csi_driver(false)).await;
            // The node reports its volumes in use before staging them.
            fresh_node(&cluster).await;
            let m = cluster_manager(t.path(), &cluster);
            let status = |name: &'static str| {
                let cluster = &cluster;
                async move { cluster.get("v1", "persistentvolumeclaims", name).await.unwrap()["status"].clone() }
            };

            // The first expansion fails out of range: infeasible, and the volume is used as it is.
            let first = create_resize_pending_pod(&cluster, "first", "300Mi", "600Mi").await;
            eventually("the first claim marked infeasible", 60, || async { status("first").await["allocatedResourceStatuses"]["storage"] == "NodeResizeInfeasible" }).await;
            let s = status("first").await;
            let error = s["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "NodeResizeError").cloned().expect("a NodeResizeError condition");
            assert!(error["message"].as_str().unwrap().starts_with("failed to expand pvc with") && error["message"].as_str().unwrap().contains("OutOfRange"), "{s:#}");
            assert_eq!(s["capacity"]["storage"], "300Mi", "{s:#}");
            m.wait_for_attach_and_mount(&first).await.expect("mounted at its old size");
            assert_eq!(std::fs::metadata(driver.image("first")).unwrap().len(), 300 << 20);

            // The second succeeds: one patch with the capacity, the status cleared, and only the
            // expansion's conditions gone.
            let second = create_resize_pending_pod(&cluster, "second", "300Mi", "600Mi").await;
            m.wait_for_attach_and_mount(&second).await.expect("mounted");
            eventually("the second claim's new capacity", 60, || async { status("second").await["capacity"]["storage"] == "600Mi" }).await;
            let s = status("second").await;
            assert!(s["allocatedResourceStatuses"].get("storage").is_none(), "{s:#}");
            let kinds: Vec<&str> = s["conditions"].as_array().unwrap().iter().filter_map(|c| c["type"].as_str()).collect();
            // Other controllers' conditions stay (1.37's controller manager adds `Unused`).
            assert!(kinds.contains(&"Custom"), "{s:#}");
            let expansion = ["Resizing", "FileSystemResizePending", "ControllerResizeError", "NodeResizeError"];
            assert!(!kinds.iter().any(|k| expansion.contains(k)), "{s:#}");
            assert_eq!(std::fs::metadata(driver.image("second")).unwrap().len(), 600 << 20, "expanded by NodeExpandVolume");
            assert_eq!(driver.count("NodeExpandVolume", "Ok"), 1);
            assert_eq!(driver.count("NodeExpandVolume", "OutOfRange"), 1, "the infeasible one is not tried again");
            let events = m.events();
            let said = |pod: &str, reason: &str| events.iter().any(|e| e.pod.ends_with(&format!("/{pod}")) && e.reason == reason);
            assert!(said("first", "FileSystemResizeFailed") && said("second", "FileSystemResizeSuccessful"), "{events:#?}");

            for name in ["first", "second"] {
                cluster.delete("v1", "pods", name, Some(0)).await;
            }
            m.wait_for_unmount(&first).await.unwrap();
            m.wait_for_unmount(&second).await.unwrap();
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// CSI migration as a node of a cluster: a gcePersistentDisk PersistentVolume bound to a
    /// claim is served by pd.csi.storage.gke.io with the translated handle, and reported in
    /// `volumesInUse` under the CSI unique name the controllers compute.
    fn a_cluster_nodes_in_tree_volume_is_served_and_reported_as_csi(backend) {
        use kubevol_csi::v1::controller_client::ControllerClient;
        use kubevol_csi::v1::*;
        const GCE: &str = "pd.csi.storage.gke.io";
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &["--driver-name", GCE]);
        runtime().block_on(async {
            let (cluster, _driver_name) = cluster_for(backend, GCE).await;
            let name = cluster.node_name().to_string();
            // The disk is this test's driver's own (its data directory): its name need not be
            // scoped.
            let disk = "disk-1";
            let handle = format!("projects/UNSPECIFIED/zones/UNSPECIFIED/disks/{disk}");
            let mut c = ControllerClient::new(kubevol_csi::connect(&driver.socket()));
            c.create_volume(CreateVolumeRequest {
                name: handle.clone(),
                capacity_range: Some(CapacityRange { required_bytes: 16 << 20, limit_bytes: 0 }),
                volume_capabilities: vec![VolumeCapability {
                    access_type: Some(volume_capability::AccessType::Mount(volume_capability::MountVolume::default())),
                    access_mode: Some(volume_capability::AccessMode { mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32 }),
                }],
                ..Default::default()
            })
            .await
            .unwrap();
            let (_, pod) = migrated_claim_pod(&cluster, GCE, false, json!({"gcePersistentDisk": {"pdName": disk, "fsType": "ext4"}})).await;
            let m = cluster_manager(t.path(), &cluster);
            m.wait_for_attach_and_mount(&pod).await.expect("served by the CSI driver");
            let unique = format!("kubernetes.io/csi/{GCE}^{handle}");
            let in_use = || async { cluster.get("v1", "nodes", &name).await.unwrap()["status"]["volumesInUse"].clone() };
            assert_eq!(in_use().await, json!([unique]));
            let stage = driver.requests("NodeStageVolume");
            assert_eq!(stage[0]["volume_id"], json!(handle), "{stage:?}");

            cluster.delete("v1", "pods", "app", Some(0)).await;
            eventually("volumesInUse emptied", 120, || async { in_use().await.as_array().is_none_or(Vec::is_empty) }).await;
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// A migrated attachable volume as a node of a cluster: an awsElasticBlockStore
    /// PersistentVolume, whose CSIDriver ebs.csi.aws.com requires attaching, waits for the
    /// VolumeAttachment the attach/detach controller makes under the name it computes from the
    /// translated handle (`vol-…`, not the in-tree `aws://zone/vol-…`) and the CSI driver's name,
    /// and is staged with its attachment metadata once that is attached.
    fn a_migrated_volume_waits_for_the_volume_attachment_the_controller_names(backend) {
        const EBS: &str = "ebs.csi.aws.com";
        const HANDLE: &str = "vol-0a1b2c3d4e5f67890";
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &["--driver-name", EBS]);
        runtime().block_on(async {
            let (cluster, _driver_name) = cluster_for(backend, EBS).await;
            let source = json!({"awsElasticBlockStore": {"volumeID": format!("aws://eu-west-1a/{HANDLE}"), "fsType": "ext4"}});
            let (pv_name, pod) = migrated_claim_pod(&cluster, EBS, true, source).await;
            let m = cluster_manager(t.path(), &cluster);
            let unique = format!("kubernetes.io/csi/{EBS}^{HANDLE}");
            let s = wait_for_status(&m, &pod, 120, |s| s.volumes[0].retry.last_error.as_deref().is_some_and(|e| e.contains("volumesAttached"))).await;
            assert!(s.volumes[0].retry.last_error.as_deref().unwrap().contains(&unique), "{s:#?}");

            let node_id = m.csi_drivers()[0].node_id.clone();
            let volume = Attached { driver: EBS, handle: HANDLE, pv: pv_name.clone(), unique };
            let published = attach_as_the_controller(&cluster, &driver, &node_id, &volume).await;
            m.wait_for_attach_and_mount(&pod).await.expect("staged once the controller's VolumeAttachment is attached");
            let stage = driver.requests("NodeStageVolume");
            assert_eq!(stage.len(), 1, "{stage:?}");
            assert_eq!(stage[0]["volume_id"], json!(HANDLE));
            for (k, v) in &published {
                assert_eq!(stage[0]["publish_context"][k], json!(v), "the VolumeAttachment's metadata: {stage:?}");
            }
            assert_eq!(driver.count("ControllerPublishVolume", "Ok"), 1, "only the controller's own call");

            cluster.delete("v1", "pods", "app", Some(0)).await;
            m.wait_for_unmount(&pod).await.expect("torn down");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// Volume health reaches the API server as the kubelet writes it (Kubernetes 1.37,
    /// CSIVolumeHealth): the loop driver's volume whose backing file is gone shows
    /// `Inaccessible` in the pod's `status.volumeHealth`, and the driver's storage whose
    /// directory is gone shows `StorageUnreachable` in the CSINode's `status.storageHealth`;
    /// both clear when the file and the directory are back (the pod's entry kept, empty, as
    /// the kubelet keeps it). A server without the fields (1.36) keeps the pod running and
    /// the health in kubevol's own status.
    fn volume_and_storage_health_reach_the_pod_and_the_csinode(backend) {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let (cluster, _driver_name) = cluster_for(backend, DRIVER).await;
            let name = cluster.node_name().to_string();
            fresh_node(&cluster).await;
            let pod = create_claim_pod(&cluster, "data", false).await;
            let m = cluster_manager_with(t.path(), &cluster, |c| c.volume_stats_period = Duration::from_millis(200));
            m.wait_for_attach_and_mount(&pod).await.unwrap();
            let version = cluster.admin_client().apiserver_version().await.unwrap();
            let served = version.minor.trim_end_matches('+').parse::<u32>().unwrap() >= 37;
            let pod_name = pod.metadata.name.clone().unwrap();
            let volume_health = || async {
                let p = cluster.get("v1", "pods", &pod_name).await.unwrap();
                p["status"]["volumeHealth"].clone()
            };
            let storage_health = || async {
                let c = cluster.get("storage.k8s.io/v1", "csinodes", &name).await;
                c.map(|c| c["status"]["storageHealth"].clone()).unwrap_or_default()
            };

            let image = driver.image("data");
            let away = image.with_extension("away");
            std::fs::rename(&image, &away).unwrap();
            let uid = kubevol::pod_uid(&pod);
            wait_until("kubevol sees the volume inaccessible", 120, || {
                m.pod_status(&uid).unwrap().volumes[0].health.as_ref().is_some_and(|h| !h.conditions.is_empty())
            }).await;
            if served {
                eventually("the pod's status.volumeHealth", 120, || async {
                    let h = volume_health().await;
                    h[0]["name"] == "data"
                        && h[0]["healthConditions"][0]["status"] == "Inaccessible"
                        && h[0]["healthConditions"][0]["reason"] == "BackingFileMissing"
                        && h[0]["lastTransitionTime"].is_string()
                }).await;
            } else {
                assert!(volume_health().await.is_null(), "a 1.36 server has no such field");
            }
            std::fs::rename(&away, &image).unwrap();
            if served {
                eventually("the pod's volume recovered", 120, || async {
                    let h = volume_health().await;
                    h[0]["name"] == "data" && h[0]["healthConditions"].as_array().is_none_or(|c| c.is_empty())
                }).await;
            }

            let volumes = image.parent().unwrap().to_path_buf();
            let volumes_away = volumes.with_extension("away");
            std::fs::rename(&volumes, &volumes_away).unwrap();
            wait_until("kubevol sees the storage unreachable", 120, || {
                m.csi_drivers().iter().any(|d| !d.storage_health.is_empty())
            }).await;
            if served {
                eventually("the CSINode's status.storageHealth", 120, || async {
                    let s = storage_health().await;
                    s[0]["name"] == DRIVER
                        && s[0]["healthConditions"][0]["status"] == "StorageUnreachable"
                        && s[0]["healthConditions"][0]["reason"] == "BackingDirectoryUnreachable"
                }).await;
            }
            std::fs::rename(&volumes_away, &volumes).unwrap();
            wait_until("kubevol sees the storage back", 120, || {
                m.csi_drivers().iter().all(|d| d.storage_health.is_empty())
            }).await;
            if served {
                eventually("the CSINode's storage health cleared", 120, || async {
                    let s = storage_health().await;
                    s.as_array().is_none_or(|s| s.is_empty())
                }).await;
            }
            m.shutdown();
        });
    }
}
