//! StorageClass secret parameters, as the external-provisioner handles them: the provisioner's
//! secret in CreateVolume and DeleteVolume, the others as the provisioned volume's secret
//! references, which reach ControllerPublish, NodeStage and NodePublish.

use super::*;

mount_test! {
    /// A class naming a secret for every operation, with the sidecars' templates
    /// (`${pvc.namespace}`, `${pv.name}`, `${pvc.annotations['…']}`): each call gets its
    /// Secret's keys (the driver logs their names), the PersistentVolume carries the
    /// references, and DeleteVolume gets the provisioner's secret from the volume's annotations.
    fn storage_class_secrets_reach_each_call_as_the_external_provisioner_sends_them() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        let manifests = t.manifests();
        let secret = |name: &str, ns: &str, key: &str| json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": ns}, "stringData": {key: "value"}});
        let class = json!({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "secure"},
            "provisioner": DRIVER, "reclaimPolicy": "Delete", "volumeBindingMode": "WaitForFirstConsumer",
            "parameters": {
                "flavour": "plain",
                "csi.storage.k8s.io/provisioner-secret-name": "provision-${pvc.namespace}",
                "csi.storage.k8s.io/provisioner-secret-namespace": "storage",
                "csi.storage.k8s.io/controller-publish-secret-name": "attach",
                "csi.storage.k8s.io/controller-publish-secret-namespace": "storage",
                "csi.storage.k8s.io/node-stage-secret-name": "stage-${pv.name}",
                "csi.storage.k8s.io/node-stage-secret-namespace": "${pvc.namespace}",
                "csi.storage.k8s.io/node-publish-secret-name": "${pvc.annotations['example.com/key']}",
                "csi.storage.k8s.io/node-publish-secret-namespace": "${pvc.namespace}",
            }});
        write_manifest(&manifests, "objects.json", &json!({"apiVersion": "v1", "kind": "List", "items": [
            csi_driver(true), class,
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "storage"}},
            secret("provision-default", "storage", "provision-key"),
            secret("attach", "storage", "attach-key"),
            secret("publish-data", "default", "publish-key"),
        ]}).to_string());
        let mut data = class_claim("data", "secure", "16Mi");
        data["metadata"]["annotations"] = json!({"example.com/key": "publish-data"});
        let claim = list(vec![data, claim_pod_json("app", "data")]);
        write_manifest(&manifests, "claim.json", &claim.to_string());
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            let _watch = kubevol::source::ManifestSource::new(&manifests).listen(m.store().sink(kubevol::source::ManifestSource::NAME)).await.unwrap();
            let app = claim_pod("app", "data");
            // The stage secret is named after the volume, known once it is made: written then.
            let volume = loop {
                if let Some(b) = m.status(false).bindings.first() {
                    break b.volume.clone();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            write_manifest(&manifests, "stage.json", &secret(&format!("stage-{volume}"), "default", "stage-key").to_string());
            m.wait_for_attach_and_mount(&app).await.expect("created, attached, staged, published");
            let keys = |call: &str| driver.requests(call).last().map(|r| r["secret_keys"].clone()).unwrap_or_default();
            assert_eq!(keys("CreateVolume"), json!(["provision-key"]));
            assert_eq!(driver.requests("CreateVolume")[0]["context"], json!({"flavour": "plain"}), "no reserved parameter reaches the driver");
            assert_eq!(keys("ControllerPublishVolume"), json!(["attach-key"]));
            assert_eq!(keys("NodeStageVolume"), json!(["stage-key"]));
            assert_eq!(keys("NodePublishVolume"), json!(["publish-key"]));
            let pv = m.store().persistent_volume(&volume).unwrap().object;
            let csi = pv.spec.clone().unwrap().csi.unwrap();
            assert_eq!(csi.node_publish_secret_ref.unwrap().name.as_deref(), Some("publish-data"));
            // The provisioner's identity, as the external-provisioner writes it, reaches the node.
            let identity = csi.volume_attributes.unwrap()["storage.kubernetes.io/csiProvisionerIdentity"].clone();
            let parts: Vec<&str> = identity.splitn(3, '-').collect();
            assert!(parts.len() == 3 && parts[0].parse::<u64>().is_ok() && parts[1].parse::<u32>().is_ok() && parts[2] == DRIVER, "{identity}");
            let staged = driver.requests("NodeStageVolume").last().unwrap()["context"].clone();
            assert_eq!(staged["storage.kubernetes.io/csiProvisionerIdentity"], identity.as_str());
            assert_eq!(pv.metadata.annotations.as_ref().unwrap()["volume.kubernetes.io/provisioner-deletion-secret-name"], "provision-default");

            std::fs::remove_file(manifests.join("claim.json")).unwrap();
            m.wait_for_unmount(&app).await.expect("torn down");
            wait_until("DeleteVolume", 120, || driver.count("DeleteVolume", "Ok") == 1).await;
            assert_eq!(keys("DeleteVolume"), json!(["provision-key"]));
            m.shutdown();
        });
        drop(driver);
    }
}
