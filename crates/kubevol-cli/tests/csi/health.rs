//! Volume and storage health (CSI 1.13, Kubernetes' CSIVolumeHealth) as the loop driver reports
//! it: a volume whose backing file is gone is Inaccessible, a driver whose backing directory is
//! gone has its storage unreachable; both clear when the file and directory are back.

use super::*;

mount_test! {
    /// A mounted claim's volume is asked for its health every stats period. Its backing file
    /// moved away: the pod's volume shows `Inaccessible (BackingFileMissing)` in the status and
    /// `describe`, with a warning event and `kubelet_volume_stats_health_status_abnormal` 1;
    /// moved back, the volume shows it recovered (no conditions, the entry kept) with a normal
    /// event. The driver's directory of backing files moved away: its storage is
    /// `StorageUnreachable` in the drivers' list and `csi_node_storage_health_status`; back,
    /// both clear.
    fn a_volume_and_a_drivers_storage_report_their_health_and_recover() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            m.library().upsert_objects(objects(json!([csi_driver(true), pv("data", "16Mi", "Filesystem"), pvc("data", "Filesystem")])));
            let p = claim_pod("p", "data");
            let uid = kubevol::pod_uid(&p);
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.unwrap();
            let caps = m.csi_drivers()[0].capabilities;
            assert!(caps.get_volume_health && caps.get_storage_health, "{caps:?}");
            wait_until("a health probe", 120, || driver.count("NodeGetVolumeHealth", "Ok") >= 2).await;
            let health = |m: &VolumeManager| m.pod_status(&uid).unwrap().volumes[0].health.clone();
            assert_eq!(health(&m), None, "a healthy volume has no entry");
            let abnormal = r#"kubelet_volume_stats_health_status_abnormal{namespace="default",persistentvolumeclaim="data"}"#;
            assert!(m.metrics_text().contains(&format!("{abnormal} 0")), "{}", m.metrics_text());

            let image = driver.image("data");
            let away = image.with_extension("away");
            std::fs::rename(&image, &away).unwrap();
            wait_until("the volume inaccessible", 120, || health(&m).is_some_and(|h| !h.conditions.is_empty())).await;
            let h = health(&m).unwrap();
            assert_eq!((h.conditions[0].status.as_str(), h.conditions[0].reason.as_str()), ("Inaccessible", "BackingFileMissing"), "{h:?}");
            let status = m.pod_status(&uid).unwrap();
            assert_eq!(status.volumes[0].state, kubevol::status::VolumePhase::Mounted, "an unhealthy volume stays mounted");
            let event = status.events.iter().find(|e| e.reason == "VolumeConditionAbnormal").expect("a warning event");
            assert_eq!(event.type_, "Warning");
            assert!(event.message.starts_with(r#"volume "data": Inaccessible (BackingFileMissing): "#), "{}", event.message);
            let d = m.describe_pod(&uid).unwrap();
            let step = d.chains[0].steps.iter().find(|s| s.step == "health").expect("a health step");
            assert_eq!(step.state, kubevol::describe::StepState::Failed);
            assert!(step.error.as_deref().unwrap().contains("BackingFileMissing"), "{step:?}");
            wait_until("the abnormal gauge", 120, || m.metrics_text().contains(&format!("{abnormal} 1"))).await;

            std::fs::rename(&away, &image).unwrap();
            wait_until("the volume recovered", 120, || health(&m).is_some_and(|h| h.conditions.is_empty())).await;
            let status = m.pod_status(&uid).unwrap();
            assert!(status.events.iter().any(|e| e.reason == "VolumeConditionNormal" && e.type_ == "Normal"), "{:?}", status.events);
            wait_until("the abnormal gauge back to 0", 120, || m.metrics_text().contains(&format!("{abnormal} 0"))).await;

            let volumes = image.parent().unwrap().to_path_buf();
            let volumes_away = volumes.with_extension("away");
            std::fs::rename(&volumes, &volumes_away).unwrap();
            let storage = |m: &VolumeManager| m.csi_drivers()[0].storage_health.clone();
            wait_until("the storage unreachable", 120, || !storage(&m).is_empty()).await;
            let s = storage(&m);
            assert_eq!((s[0].status.as_str(), s[0].reason.as_str()), ("StorageUnreachable", "BackingDirectoryUnreachable"), "{s:?}");
            let gauge = format!(r#"csi_node_storage_health_status{{driver_name="{DRIVER}",status="StorageUnreachable",reason="BackingDirectoryUnreachable"}} 1"#);
            wait_until("the storage gauge", 120, || m.metrics_text().contains(&gauge)).await;
            std::fs::rename(&volumes_away, &volumes).unwrap();
            wait_until("the storage reachable", 120, || storage(&m).is_empty()).await;
            wait_until("the storage gauge gone", 120, || !m.metrics_text().contains("csi_node_storage_health_status{")).await;

            // The pod gone, its volume's entry goes with it.
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.unwrap();
            m.shutdown();
        });
    }
}
