//! SELinux labels of CSI volumes: mounted with `-o context` where the driver and the pod allow
//! it, conflicting labels on one volume refused, and a node without SELinux telling the pod why.

use super::*;

/// A pod bound to nothing that mounts claim `claim`, whose containers' SELinux levels are
/// `levels` (one container each).
fn selinux_pod(name: &str, claim: &str, levels: &[&str]) -> Pod {
    let containers: Vec<serde_json::Value> = levels
        .iter()
        .enumerate()
        .map(|(i, l)| json!({"name": format!("c{i}"), "image": "busybox", "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                             "securityContext": {"seLinuxOptions": {"level": l}}}))
        .collect();
    pod(
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": containers, "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]}}),
    )
}

mount_test! {
    /// SELinux mounts, decided as the kubelet decides them, on a node told it has SELinux (these
    /// machines cannot enable it: the loop driver drops the option at the mount, as libmount
    /// does without SELinux, and its call log records what was asked). With SELinuxMount on and
    /// a CSIDriver with seLinuxMount, a volume is staged and published with
    /// `context="<label>"`; a pod with another label is refused (conflicting labels), as is a pod
    /// whose containers disagree, each counted in the kubelet's metrics; a pod with the same
    /// label shares the volume; the label is kept across a restart.
    fn selinux_labels_are_mounted_with_and_conflicts_refused() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        // SELinuxMount is on by default (GA in Kubernetes 1.37): a ReadWriteOnce volume too.
        let config = |c: &mut kubevol::Config| {
            c.selinux = kubevol::Selinux::Enabled { file_context: "system_u:object_r:container_file_t:s0".into() };
        };
        let label = "system_u:object_r:container_file_t:s0:c1,c2";
        let option = format!("context=\"{label}\"");
        runtime().block_on(async {
            let m = manager(t.path(), config);
            let mut selinux_driver = csi_driver(false);
            selinux_driver["spec"]["seLinuxMount"] = json!(true);
            let volume_objects = json!([selinux_driver, pv("shared", "16Mi", "Filesystem"), pvc("shared", "Filesystem")]);
            m.library().upsert_objects(objects(volume_objects.clone()));
            let a = selinux_pod("a", "shared", &["s0:c1,c2"]);
            m.add_pod(a.clone());
            m.wait_for_attach_and_mount(&a).await.expect("mounted with its label");
            for call in ["NodeStageVolume", "NodePublishVolume"] {
                let flags = driver.requests(call).pop().unwrap()["mount_flags"].clone();
                assert_eq!(flags, json!([option]), "{call}: {flags}");
            }
            let d = m.describe_pod(&kubevol::pod_uid(&a)).unwrap();
            let step = d.chains[0].steps.iter().find(|s| s.step == "SELinux").expect("an SELinux step");
            assert_eq!(step.detail, format!("mounted with -o {option}"));

            // Another label on the same volume: refused, and counted.
            let b = selinux_pod("b", "shared", &["s0:c3"]);
            m.add_pod(b.clone());
            let s = wait_for_status(&m, &b, 120, |s| s.volumes[0].retry.last_error.is_some()).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains(&format!("conflicting SELinux labels of volume kubernetes.io/csi/{DRIVER}^shared: \"{label}\" (pod default/a) and \"system_u:object_r:container_file_t:s0:c3\" (this pod)")), "{e}");
            // Containers that disagree: refused.
            let c = selinux_pod("c", "shared", &["s0:c1,c2", "s0:c4"]);
            m.add_pod(c.clone());
            let s = wait_for_status(&m, &c, 120, |s| s.volumes[0].retry.last_error.is_some()).await;
            assert!(s.volumes[0].retry.last_error.as_deref().unwrap().contains("the containers that use the volume have different SELinux labels"), "{s:#?}");
            // The same label: shared.
            let same = selinux_pod("same", "shared", &["s0:c1,c2"]);
            m.add_pod(same.clone());
            m.wait_for_attach_and_mount(&same).await.expect("the same label shares the volume");
            let metrics = m.metrics_text();
            for line in [
                format!("volume_manager_selinux_volume_context_mismatch_errors_total{{volume_plugin=\"kubernetes.io/csi:{DRIVER}\",access_mode=\"RWO\"}} 1"),
                "volume_manager_selinux_pod_context_mismatch_errors_total{access_mode=\"RWO\"} 1".to_string(),
                format!("volume_manager_selinux_volumes_admitted_total{{volume_plugin=\"kubernetes.io/csi:{DRIVER}\",access_mode=\"RWO\"}} 1"),
            ] {
                assert!(metrics.contains(&line), "{line} in:\n{metrics}");
            }
            for p in [&b, &c] {
                m.remove_pod(p);
            }
            // A restart: the label is kept.
            let stages = driver.requests("NodeStageVolume").len();
            let m = restart(m, t.path(), config).await;
            m.library().upsert_objects(objects(volume_objects));
            m.add_pod(a.clone());
            m.add_pod(same.clone());
            m.wait_for_attach_and_mount(&a).await.unwrap();
            // Staged again (a reconstructed device is uncertain, as for the kubelet), with the label.
            let stage = driver.requests("NodeStageVolume");
            assert!(stage.len() > stages && stage.last().unwrap()["mount_flags"] == json!([option]), "{stage:?}");
            let d = m.describe_pod(&kubevol::pod_uid(&a)).unwrap();
            assert!(d.chains[0].steps.iter().any(|s| s.step == "SELinux" && s.detail.contains(&option)), "{d:#?}");
            for p in [&a, &same] {
                m.remove_pod(p);
                m.wait_for_unmount(p).await.unwrap();
            }
            m.shutdown();
        });
    }
}

mount_test! {
    /// On a node without SELinux a pod that asks for a label is not held up: its
    /// ReadWriteOncePod volume is mounted without `-o context`, and a warning event says what is
    /// missing.
    fn without_selinux_a_label_is_not_used_and_the_pod_is_told_why() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let m = manager(t.path(), |c| c.selinux = kubevol::Selinux::Disabled);
            let mut selinux_driver = csi_driver(false);
            selinux_driver["spec"]["seLinuxMount"] = json!(true);
            let mut volume = pv("once", "16Mi", "Filesystem");
            volume["spec"]["accessModes"] = json!(["ReadWriteOncePod"]);
            let mut claim = pvc("once", "Filesystem");
            claim["spec"]["accessModes"] = json!(["ReadWriteOncePod"]);
            m.library().upsert_objects(objects(json!([selinux_driver, volume, claim])));
            let a = selinux_pod("a", "once", &["s0:c1,c2"]);
            m.add_pod(a.clone());
            m.wait_for_attach_and_mount(&a).await.expect("mounted without the label");
            assert_eq!(driver.requests("NodeStageVolume").pop().unwrap()["mount_flags"], json!([]));
            let e = m.events().into_iter().find(|e| e.reason == "SELinuxUnavailable").expect("a warning event");
            assert!(e.message.contains("this node has no SELinux (no selinuxfs at /sys/fs/selinux)"), "{e:?}");
            m.remove_pod(&a);
            m.wait_for_unmount(&a).await.unwrap();
            m.shutdown();
        });
    }
}

mount_test! {
    /// `seLinuxChangePolicy: Recursive` opts a pod out of mounting with its label (the runtime
    /// relabels the files instead): its volume is staged and published with no context option,
    /// on the same node and driver that mount others with one.
    fn a_pod_with_the_recursive_change_policy_is_mounted_without_a_context() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        let config = |c: &mut kubevol::Config| {
            c.selinux = kubevol::Selinux::Enabled { file_context: "system_u:object_r:container_file_t:s0".into() };
            c.selinux_mount = true;
        };
        runtime().block_on(async {
            let m = manager(t.path(), config);
            let mut selinux_driver = csi_driver(false);
            selinux_driver["spec"]["seLinuxMount"] = json!(true);
            m.library().upsert_objects(objects(json!([selinux_driver, pv("recursive", "16Mi", "Filesystem"), pvc("recursive", "Filesystem")])));
            let p = pod(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "relabelled", "namespace": "default"},
                "spec": {"securityContext": {"seLinuxChangePolicy": "Recursive", "seLinuxOptions": {"level": "s0:c5,c6"}},
                         "containers": [{"name": "c", "image": "busybox", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                         "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "recursive"}}]}}));
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            for call in ["NodeStageVolume", "NodePublishVolume"] {
                let request = driver.requests(call).pop().unwrap_or_else(|| panic!("{call} was made"));
                let flags = request["mount_flags"].as_array().cloned().unwrap_or_default();
                assert!(
                    flags.iter().all(|f| !f.as_str().unwrap_or_default().starts_with("context=")),
                    "{call} with no context option: {flags:?}"
                );
            }
            m.shutdown();
        });
    }
}

mount_test! {
    /// SELinuxMount turned off (`--selinux-mount=false`, the 1.36 default): a ReadWriteOnce
    /// volume is mounted without a context, a ReadWriteOncePod one still with its label.
    fn with_selinux_mount_off_only_read_write_once_pod_volumes_get_a_context() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        let config = |c: &mut kubevol::Config| {
            c.selinux = kubevol::Selinux::Enabled { file_context: "system_u:object_r:container_file_t:s0".into() };
            c.selinux_mount = false;
        };
        runtime().block_on(async {
            let m = manager(t.path(), config);
            let mut selinux_driver = csi_driver(false);
            selinux_driver["spec"]["seLinuxMount"] = json!(true);
            let mut rwop = pv("single", "16Mi", "Filesystem");
            rwop["spec"]["accessModes"] = json!(["ReadWriteOncePod"]);
            let mut rwop_claim = pvc("single", "Filesystem");
            rwop_claim["spec"]["accessModes"] = json!(["ReadWriteOncePod"]);
            m.library().upsert_objects(objects(json!([selinux_driver, pv("many", "16Mi", "Filesystem"), pvc("many", "Filesystem"), rwop, rwop_claim])));
            let context = |call: &str, volume: &str| {
                driver.requests(call).into_iter().filter(|r| r.to_string().contains(volume)).map(|r| r["mount_flags"].clone()).next_back()
            };
            for (claim, want) in [("many", json!(null)), ("single", json!(["context=\"system_u:object_r:container_file_t:s0:c7,c8\""]))] {
                let p = selinux_pod(claim, claim, &["s0:c7,c8"]);
                m.add_pod(p.clone());
                m.wait_for_attach_and_mount(&p).await.expect("mounted");
                let flags = context("NodeStageVolume", claim).expect("staged");
                let none = flags.is_null() || flags == json!([]);
                if want.is_null() {
                    assert!(none, "{claim}: {flags}");
                } else {
                    assert_eq!(flags, want, "{claim}");
                }
            }
            m.shutdown();
        });
    }
}
