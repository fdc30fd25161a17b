use super::*;
use crate::store::pod_uid;
use k8s_openapi::api::core::v1::{PersistentVolume, Volume};
use kubevol_core::state::{MountedPodVolume, PodMountState, VolumeSpec, VolumeTraits};

/// A node that has waited for thousands of pods holds no memory for them once they are
/// gone: a waiter's signal goes with the waiter, whether it saw its pod ready, saw it
/// gone, or timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_leave_nothing_behind_for_pods_that_are_gone() {
    let t = tempfile::tempdir().unwrap();
    let mut config = Config::new(t.path(), "n");
    config.wait_timeout = std::time::Duration::from_millis(200);
    let m = VolumeManager::new(config, Arc::new(kubevol_mount::FakeMounter::new())).unwrap();
    let run = m.clone();
    tokio::spawn(async move { run.run().await });
    let pods: Vec<Pod> = (0..200)
        .map(|i| {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("p{i}"), "namespace": "default"},
                "spec": {"containers": [{"name": "c", "volumeMounts": [{"name": "m", "mountPath": "/m"}]}],
                         "volumes": [{"name": "m", "emptyDir": {"medium": "Memory"}}]}
            }))
            .unwrap()
        })
        .collect();
    m.add_pods(pods.clone());
    // Waits of 200 ms, each tried again until it holds (on a loaded machine, 200 pods take longer).
    for p in &pods {
        let mut tries = 0..150;
        while m.wait_for_attach_and_mount(p).await.is_err() {
            assert!(tries.next().is_some(), "mounted within 30 s");
        }
    }
    m.remove_pods(&pods);
    let mut tries = 0..150;
    while m.wait_for_all_pods_unmount(&pods).await.is_err() {
        assert!(tries.next().is_some(), "torn down within 30 s");
    }
    // A wait that times out, for a pod that never comes.
    let never: Pod = serde_json::from_value(
        serde_json::json!({"metadata": {"name": "never", "namespace": "default"}}),
    )
    .unwrap();
    assert!(m.wait_for_attach_and_mount(&never).await.is_err());
    assert_eq!(m.parts.world.pod_signals_held(), 0);
    m.shutdown();
}

#[test]
fn extra_supplemental_groups_come_from_mounted_persistent_volumes() {
    let t = tempfile::tempdir().unwrap();
    let m = VolumeManager::new(
        Config::new(t.path(), "n"),
        Arc::new(kubevol_mount::FakeMounter::new()),
    )
    .unwrap();
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"containers": [], "securityContext": {"supplementalGroups": [5]}}
    }))
    .unwrap();
    let uid = pod_uid(&pod);
    let pv = |gid: &str| {
        let mut pv = PersistentVolume::default();
        pv.metadata.annotations =
            Some([("pv.beta.kubernetes.io/gid".to_string(), gid.to_string())].into());
        Arc::new(pv)
    };
    let traits = VolumeTraits {
        plugin: "test/pv".into(),
        attachable: false,
        device_mountable: false,
    };
    // (volume, PV gid annotation): 5 is already the pod's, "x" is not a number.
    for (name, gid) in [
        ("a", Some("1234")),
        ("b", Some("5")),
        ("c", Some("x")),
        ("d", None),
        ("e", Some("1234")),
    ] {
        let spec = Arc::new(VolumeSpec {
            volume: Volume {
                name: name.into(),
                ..Default::default()
            }
            .into(),
            persistent_volume: gid.map(pv),
            block: false,
            extensions: Default::default(),
            selinux_label: None,
            selinux_mount: false,
        });
        m.parts.asw.write().mark_pod_volume(
            &UniqueVolumeName::from(format!("test/pv/{name}")),
            &traits,
            uid.clone(),
            MountedPodVolume {
                pod_ref: crate::populator::pod_ref(&pod, &uid),
                outer_volume_name: name.into(),
                spec,
                state: PodMountState::Mounted,
                path: PathBuf::from("/x"),
                read_only: false,
                content_generation: 0,
                sub_paths: Vec::new(),
            },
        );
    }
    assert_eq!(m.extra_supplemental_groups_for_pod(&pod), vec![1234]);
}
