use super::*;
use crate::store::pod_uid;
use k8s_openapi::api::core::v1::{PersistentVolume, Volume};
use kubevol_core::state::{MountedPodVolume, PodMountState, VolumeSpec, VolumeTraits};

/// A manager on a fake mounter, running, whose waits time out after `wait_timeout`; with its
/// root, removed when dropped.
fn running_manager(wait_timeout: std::time::Duration) -> (tempfile::TempDir, VolumeManager) {
    let t = tempfile::tempdir().unwrap();
    let mut config = Config::new(t.path(), "n");
    config.wait_timeout = wait_timeout;
    let m = VolumeManager::new(config, Arc::new(kubevol_mount::FakeMounter::new())).unwrap();
    let run = m.clone();
    tokio::spawn(async move { run.run().await });
    (t, m)
}

/// A node that has waited for thousands of pods holds no memory for them once they are
/// gone: a waiter's signal goes with the waiter, whether it saw its pod ready, saw it
/// gone, or timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_leave_nothing_behind_for_pods_that_are_gone() {
    let (_t, m) = running_manager(std::time::Duration::from_millis(200));
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

/// A waiter that looks before its pod comes hears when the pod is desired and ready already
/// (no volumes to set up), when it is rejected, and when its volumes are mounted: the
/// populator wakes a pod's waiters only for what they decide on, and no waiter is left
/// waiting for its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_came_first_hears_when_its_pod_is_ready_or_rejected() {
    use std::future::Future;
    use std::task::Poll;
    let (_t, m) = running_manager(std::time::Duration::from_secs(600));
    let pod = |name: &str, container: &str, volumes: bool| -> Pod {
        let (mounts, vols) = if volumes {
            (
                serde_json::json!([{"name": "m", "mountPath": "/m"}]),
                serde_json::json!([{"name": "m", "emptyDir": {}}]),
            )
        } else {
            (serde_json::json!([]), serde_json::json!([]))
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": container, "image": "i", "volumeMounts": mounts}],
                     "volumes": vols}
        }))
        .unwrap()
    };
    let pods = [
        pod("plain", "c", false),
        pod("invalid", "Not_A_Name", false),
        pod("mounted", "c", true),
    ];
    let mut waits: Vec<_> = pods
        .iter()
        .map(|p| Box::pin(m.wait_for_attach_and_mount(p)))
        .collect();
    // Each waiter looks once, finds its pod unknown, and waits.
    for w in &mut waits {
        let first = std::future::poll_fn(|cx| Poll::Ready(w.as_mut().poll(cx))).await;
        assert!(first.is_pending(), "the pod is not known yet");
    }
    m.add_pods(pods.clone());
    let mut outcomes = Vec::new();
    for w in waits {
        let heard = tokio::time::timeout(std::time::Duration::from_secs(60), w).await;
        outcomes.push(heard.expect("the waiter was woken"));
    }
    assert!(outcomes[0].is_ok(), "plain: {:?}", outcomes[0]);
    assert!(
        matches!(outcomes[1], Err(WaitError::Rejected { .. })),
        "invalid: {:?}",
        outcomes[1]
    );
    assert!(outcomes[2].is_ok(), "mounted: {:?}", outcomes[2]);
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
