//! Attach as the external-attacher does it: a controller that lacks PUBLISH_UNPUBLISH_VOLUME
//! is asked for its capabilities and never sent ControllerPublishVolume or
//! ControllerUnpublishVolume, whatever the CSIDriver says of attach (or without a CSIDriver).

use super::*;

mount_test! {
    /// The loop driver with `--no-controller-publish` (as csi-driver-host-path without
    /// `--enable-attach`): a claim's volume that needs attach by its CSIDriver, and one of a
    /// driver without a CSIDriver object, are attached at once with no ControllerPublishVolume
    /// call (the driver would refuse one with Unimplemented), staged (the node attaches its
    /// loop device), published and written; at teardown no ControllerUnpublishVolume is sent,
    /// and the node detaches its devices at unstage.
    fn a_controller_without_publish_unpublish_is_attached_without_a_call() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &["--no-controller-publish"]);
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            // Without a CSIDriver object attach is required, as in Kubernetes.
            m.library().upsert_objects(objects(json!([pv("one", "16Mi", "Filesystem"), pvc("one", "Filesystem")])));
            let p = claim_pod("p", "one");
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.unwrap();
            std::fs::write(mount_path(&m, &p, "data").join("f"), "x").unwrap();
            // A CSIDriver that says attachRequired: the same.
            m.library().upsert_objects(objects(json!([csi_driver(true), pv("two", "16Mi", "Filesystem"), pvc("two", "Filesystem")])));
            let q = claim_pod("q", "two");
            m.add_pod(q.clone());
            m.wait_for_attach_and_mount(&q).await.unwrap();
            assert_eq!(driver.count("NodeStageVolume", "Ok"), 2);
            // The kubelet's metrics name a CSI volume's plugin with its driver (a set-up may
            // have run again for the second claim's arrival: at least two).
            let metrics = m.metrics_text();
            let count = |series: &str| {
                metrics.lines().find_map(|l| l.strip_prefix(series)?.trim().parse::<u64>().ok())
            };
            let mounts = count(&format!("storage_operation_duration_seconds_count{{volume_plugin=\"kubernetes.io/csi:{DRIVER}\",operation_name=\"volume_mount\",status=\"success\",migrated=\"false\"}}"));
            assert!(mounts >= Some(2), "{metrics}");
            let first = count(&format!("volume_operation_total_seconds_count{{plugin_name=\"kubernetes.io/csi:{DRIVER}\",operation_name=\"overall_volume_mount\"}}"));
            assert_eq!(first, Some(2), "one end-to-end time per volume's first set-up: {metrics}");
            m.remove_pods(&[p.clone(), q.clone()]);
            m.wait_for_all_pods_unmount(&[p, q]).await.unwrap();
            wait_until("both volumes unstaged", 120, || driver.count("NodeUnstageVolume", "Ok") == 2).await;
            let controller_calls: Vec<_> = driver.calls().into_iter().filter(|c| c.0.starts_with("ControllerPublish") || c.0.starts_with("ControllerUnpublish")).collect();
            assert_eq!(controller_calls, vec![], "no publish call reached the driver");
            assert!(mounts_under(t.path()).is_empty(), "{:?}", mounts_under(t.path()));
            m.shutdown();
        });
    }
}

mount_test! {
    /// After a restart, a volume the record shows attached is not attached again (the
    /// external-attacher trusts its VolumeAttachment the same way): one ControllerPublishVolume
    /// in all; the device is staged again, as the kubelet re-stages what it reconstructs, with
    /// the publish context recorded.
    fn a_restart_trusts_the_recorded_attach_and_stages_again() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            let objects_of = || objects(json!([csi_driver(true), pv("kept", "16Mi", "Filesystem"), pvc("kept", "Filesystem")]));
            m.library().upsert_objects(objects_of());
            let p = claim_pod("p", "kept");
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.unwrap();
            std::fs::write(mount_path(&m, &p, "data").join("f"), "kept").unwrap();
            let m = restart(m, t.path(), |c| {
                c.csi_controllers = vec![(DRIVER.into(), t.path().join("driver").join("csi.sock"))];
                c.csi_timeout = Duration::from_secs(60);
            })
            .await;
            m.library().upsert_objects(objects_of());
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.unwrap();
            wait_until("staged again", 120, || driver.count("NodeStageVolume", "Ok") == 2).await;
            assert_eq!(driver.count("ControllerPublishVolume", "Ok"), 1, "attached once, before the restart");
            let staged = driver.requests("NodeStageVolume");
            assert_eq!(staged[1]["publish_context"], staged[0]["publish_context"], "the recorded publish context");
            assert_eq!(std::fs::read_to_string(mount_path(&m, &p, "data").join("f")).unwrap(), "kept");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.unwrap();
            wait_until("detached", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 1).await;
            m.shutdown();
        });
    }
}
