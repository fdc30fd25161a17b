//! Claims whose volume starts from a data source, provisioned by the loop driver: a clone of
//! another claim, a VolumeSnapshot of a snapshot the driver has, and what is refused.

use super::*;

/// A claim of class `loop` whose volume starts from `source` (none if null).
fn claim(name: &str, size: &str, source: serde_json::Value) -> serde_json::Value {
    let mut c = class_claim(name, "loop", size);
    if !source.is_null() {
        c["spec"]["dataSourceRef"] = source;
    }
    c
}

fn pod_of(claim: &str) -> serde_json::Value {
    claim_pod_json(claim, claim)
}

mount_test! {
    /// A clone gets CreateVolume with its source claim's volume and starts with its files; a
    /// claim of a VolumeSnapshot bound to a VolumeSnapshotContent of a snapshot the driver
    /// made starts with the files as they were at the snapshot, not as they are now. Refused,
    /// each with what to change and nothing made: a clone smaller than its source, a data
    /// source of another kind (a volume populator), a VolumeSnapshot that asks for a new
    /// snapshot (kubevol takes none), a VolumeSnapshot that is not defined, and a clone of
    /// another namespace's volume through a claim that names it in its spec.volumeName.
    fn a_claim_starts_from_a_clone_or_a_snapshot_and_what_cannot_be_honoured_is_refused() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        let manifests = t.manifests();
        let class = json!({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "loop"},
            "provisioner": DRIVER, "reclaimPolicy": "Delete", "volumeBindingMode": "WaitForFirstConsumer"});
        write_manifest(&manifests, "objects.json", &list(vec![csi_driver(true), class, claim("data", "32Mi", json!(null)), pod_of("data")]).to_string());
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            let _watch = kubevol::source::ManifestSource::new(&manifests).listen(m.store().sink(kubevol::source::ManifestSource::NAME)).await.unwrap();
            let data = claim_pod("data", "data");
            m.wait_for_attach_and_mount(&data).await.expect("the source claim's volume");
            let canary = mount_path(&m, &data, "data").join("canary");
            std::fs::write(&canary, "at the snapshot").unwrap();
            rustix::fs::sync();

            // A snapshot the driver has, made as a snapshot controller would make it.
            let handle = m.status(false).bindings.iter().find(|b| b.claim.ends_with("/data")).unwrap().volume.clone();
            let mut controller = kubevol_csi::v1::controller_client::ControllerClient::new(kubevol_csi::connect(&driver.socket()));
            let snapshot = controller
                .create_snapshot(kubevol_csi::v1::CreateSnapshotRequest { source_volume_id: handle.clone(), name: "snap-1".into(), ..Default::default() })
                .await.unwrap().into_inner().snapshot.unwrap();
            assert!(snapshot.ready_to_use && snapshot.source_volume_id == handle);
            std::fs::write(&canary, "after the snapshot").unwrap();
            rustix::fs::sync();

            let data_volume = m.store().persistent_volumes().into_iter().find(|v| v.object.spec.as_ref().and_then(|s| s.claim_ref.as_ref()).and_then(|r| r.name.as_deref()) == Some("data")).unwrap().object.metadata.name.clone().unwrap();
            let in_namespace = |mut o: serde_json::Value| {
                o["metadata"]["namespace"] = json!("team-b");
                o
            };
            let clone_of = |name: &str| json!({"kind": "PersistentVolumeClaim", "name": name});
            let snap_of = |name: &str| json!({"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": name});
            let content = json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent", "metadata": {"name": "snap-1-content"},
                "spec": {"driver": DRIVER, "deletionPolicy": "Retain", "source": {"snapshotHandle": snapshot.snapshot_id},
                         "volumeSnapshotRef": {"name": "snap", "namespace": "default"}}});
            let snap = json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "snap", "namespace": "default"},
                "spec": {"source": {"volumeSnapshotContentName": "snap-1-content"}}});
            let take = json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "take", "namespace": "default"},
                "spec": {"volumeSnapshotClassName": "loop", "source": {"persistentVolumeClaimName": "data"}}});
            write_manifest(&manifests, "sources.json", &list(vec![
                content, snap, take,
                claim("copy", "64Mi", clone_of("data")), pod_of("copy"),
                claim("restored", "32Mi", snap_of("snap")), pod_of("restored"),
                claim("small", "16Mi", clone_of("data")), pod_of("small"),
                claim("populated", "32Mi", json!({"apiGroup": "example.com", "kind": "Hello", "name": "h"})), pod_of("populated"),
                claim("taken", "32Mi", snap_of("take")), pod_of("taken"),
                claim("missing", "32Mi", snap_of("nowhere")), pod_of("missing"),
                // Another namespace's claim names data's volume in its spec.volumeName (anyone
                // who writes a claim can), and a clone of it asks for the volume's content.
                in_namespace(json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "src"},
                    "spec": {"storageClassName": "loop", "volumeName": data_volume, "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "32Mi"}}}})),
                in_namespace(claim("steal", "32Mi", clone_of("src"))),
                in_namespace(pod_of("steal")),
            ]).to_string());
            let copy = claim_pod("copy", "copy");
            m.wait_for_attach_and_mount(&copy).await.expect("the clone");
            assert_eq!(std::fs::read_to_string(mount_path(&m, &copy, "data").join("canary")).unwrap(), "after the snapshot");
            let restored = claim_pod("restored", "restored");
            m.wait_for_attach_and_mount(&restored).await.expect("the restored snapshot");
            assert_eq!(std::fs::read_to_string(mount_path(&m, &restored, "data").join("canary")).unwrap(), "at the snapshot");
            let created = driver.requests("CreateVolume");
            assert_eq!(created.len(), 3, "data, copy and restored only: {created:?}");

            for (pod, why) in [
                ("small", "has 33554432 bytes, more than the clone asks for (16777216)"),
                ("populated", "not from volume populators"),
                ("taken", "kubevol runs no snapshot controller and takes no snapshots"),
                ("missing", "VolumeSnapshot default/nowhere is not defined"),
            ] {
                let p = claim_pod(pod, pod);
                wait_for_status(&m, &p, 120, |s| s.volumes.first().is_some_and(|v| v.retry.last_error.as_deref().is_some_and(|e| e.contains(why)))).await;
                let error = m.pod_status(&kubevol::pod_uid(&p)).unwrap().volumes[0].retry.last_error.clone().unwrap();
                assert!(error.contains(&format!("PersistentVolumeClaim default/{pod}")), "names the claim: {error}");
            }
            let steal = kubevol::pod_uid(&serde_json::from_value(in_namespace(pod_of("steal"))).unwrap());
            let why = format!("PersistentVolumeClaim team-b/src names PersistentVolume {data_volume} in spec.volumeName, but that volume is not bound to it");
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            loop {
                let error = m.pod_status(&steal).and_then(|s| s.volumes.first()?.retry.last_error.clone()).unwrap_or_default();
                if error.contains(&why) {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "the clone of another namespace's volume is refused: {error}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(driver.requests("CreateVolume").len(), 3, "nothing made for what is refused");
            m.shutdown();
        });
        drop(driver);
    }
}

mount_test! {
    /// Another namespace's manifest writer names the handle of a provisioned ReadWriteOncePod
    /// volume in a PersistentVolume of its own, ReadWriteMany, with a claim and a pod: the
    /// volume that names the handle second is refused (bound or not), and the first keeps its
    /// pod and its data.
    fn a_persistent_volume_naming_another_volumes_handle_is_refused() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        let manifests = t.manifests();
        let class = json!({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "loop"},
            "provisioner": DRIVER, "reclaimPolicy": "Delete", "volumeBindingMode": "WaitForFirstConsumer"});
        let mut data = claim("data", "32Mi", json!(null));
        data["spec"]["accessModes"] = json!(["ReadWriteOncePod"]);
        write_manifest(&manifests, "objects.json", &list(vec![csi_driver(true), class, data, pod_of("data")]).to_string());
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            let _watch = kubevol::source::ManifestSource::new(&manifests).listen(m.store().sink(kubevol::source::ManifestSource::NAME)).await.unwrap();
            let data = claim_pod("data", "data");
            m.wait_for_attach_and_mount(&data).await.expect("the provisioned volume");
            std::fs::write(mount_path(&m, &data, "data").join("secret"), "TEAM-A-SECRET-DATA").unwrap();
            let pv = m.store().persistent_volumes().into_iter().find(|v| v.object.spec.as_ref().and_then(|s| s.claim_ref.as_ref()).and_then(|r| r.name.as_deref()) == Some("data")).unwrap().object;
            let handle = pv.spec.as_ref().unwrap().csi.as_ref().unwrap().volume_handle.clone();

            let steal_pv = json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "steal-pv"},
                "spec": {"capacity": {"storage": "32Mi"}, "accessModes": ["ReadWriteMany"], "persistentVolumeReclaimPolicy": "Retain",
                         "csi": {"driver": DRIVER, "volumeHandle": handle, "fsType": "ext4"},
                         "claimRef": {"namespace": "team-b", "name": "steal"}}});
            let steal = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "steal", "namespace": "team-b"},
                "spec": {"storageClassName": "", "volumeName": "steal-pv", "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "32Mi"}}}});
            let mut thief = pod_of("steal");
            thief["metadata"]["namespace"] = json!("team-b");
            // A name that sorts first: the origin order alone would give it the handle.
            write_manifest(&manifests, "000-steal.json", &list(vec![steal_pv, steal, thief.clone()]).to_string());
            let thief = kubevol::pod_uid(&serde_json::from_value(thief).unwrap());
            let why = format!("PersistentVolume steal-pv names volume {handle:?} of CSI driver {DRIVER}, which PersistentVolume {} ", pv.metadata.name.as_deref().unwrap());
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            loop {
                let error = m.pod_status(&thief).and_then(|s| s.volumes.first()?.retry.last_error.clone()).unwrap_or_default();
                if error.contains(&why) {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "the volume that names another's handle is refused: {error}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(m.pod_status(&kubevol::pod_uid(&data)).unwrap().phase, kubevol::status::PodPhase::Ready);
            assert_eq!(std::fs::read_to_string(mount_path(&m, &data, "data").join("secret")).unwrap(), "TEAM-A-SECRET-DATA");
            assert_eq!(driver.requests("NodePublishVolume").len(), 1, "published for team-a's pod only");
            m.shutdown();
        });
        drop(driver);
    }
}
