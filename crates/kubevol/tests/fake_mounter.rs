//! The engine over the fake mount layer: no root needed, every mount call recorded.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubevol::{Config, VolumeManager, WaitError};
use kubevol_mount::fake::{FakeOp, MountCall};
use kubevol_mount::FakeMounter;

mod common;
use common::{until_announced, wait_for_status};

fn pod(name: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"memory": "16Mi"}}, "volumeMounts": [{"name": "m", "mountPath": "/m"}]}],
            "volumes": [{"name": "m", "emptyDir": {"medium": "Memory"}}]
        }
    }))
    .unwrap()
}

fn start(root: &std::path::Path, fake: Arc<FakeMounter>) -> VolumeManager {
    start_with_sources(root, fake, &[]).0
}

/// A running manager whose pod sources are registered before it starts, as a daemon does.
fn start_with_sources(
    root: &std::path::Path,
    fake: Arc<FakeMounter>,
    sources: &[&'static str],
) -> (VolumeManager, Vec<kubevol::source::Sink>) {
    start_configured(root, fake, sources, |_| {})
}

/// A manager whose waits time out after `wait`.
fn start_waiting(root: &std::path::Path, fake: Arc<FakeMounter>, wait: Duration) -> VolumeManager {
    start_configured(root, fake, &[], |c| c.wait_timeout = wait).0
}

/// [`start_with_sources`], with the test's own settings over the fast backoff.
fn start_configured(
    root: &std::path::Path,
    fake: Arc<FakeMounter>,
    sources: &[&'static str],
    tweak: impl FnOnce(&mut Config),
) -> (VolumeManager, Vec<kubevol::source::Sink>) {
    let mut c = Config::new(root, "n");
    c.backoff.initial = Duration::from_millis(5);
    c.backoff.max = Duration::from_millis(20);
    c.wait_timeout = Duration::from_secs(120);
    tweak(&mut c);
    let m = VolumeManager::new(c, fake).unwrap();
    let sinks = sources.iter().map(|s| m.store().sink(s)).collect();
    let r = m.clone();
    tokio::spawn(async move { r.run().await });
    (m, sinks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mount_failures_are_retried_until_success_then_torn_down() {
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    fake.fail(FakeOp::Mount, None, rustix_errno_busy(), 2);
    let m = start(t.path(), fake.clone());
    let p = pod("retry");
    let uid = m.add_pod(p.clone());
    m.wait_for_attach_and_mount(&p)
        .await
        .expect("third attempt mounts");
    let target = m
        .config()
        .root_dir
        .join(format!("pods/{uid}/volumes/kubernetes.io~empty-dir/m"));
    let mounts: Vec<MountCall> = fake
        .calls()
        .into_iter()
        .filter(|c| matches!(c, MountCall::Mount { .. }))
        .collect();
    assert_eq!(mounts.len(), 3, "two failures, one success: {mounts:?}");
    let MountCall::Mount {
        target: t0,
        fstype,
        options,
        ..
    } = &mounts[2]
    else {
        unreachable!()
    };
    assert_eq!(t0, &target);
    assert_eq!(fstype, "tmpfs");
    assert_eq!(
        options.data,
        vec![format!("size={}", 16 << 20), "mode=0777".to_string()],
        "pod memory limit sizes the tmpfs"
    );
    assert!(fake.is_mounted(&target));

    m.remove_pod(&p);
    m.wait_for_unmount(&p).await.unwrap();
    assert!(!fake.is_mounted(&target));
    assert!(!target.exists());
    // The unmount's duration is observed as its batch concludes, a moment after the volume is
    // marked unmounted; the announcement that follows wakes this.
    let unmounted = r#"operation_name="volume_unmount",status="success""#;
    until_announced(&m, 120, "the unmount's metric", || {
        m.metrics_text().contains(unmounted)
    })
    .await;
    let text = m.metrics_text();
    assert!(
        text.contains(r#"operation_name="volume_mount",status="fail-unknown""#),
        "{text}"
    );
    m.shutdown();
}

/// A pod's plugin directory is kept open from one of its volumes to the next; removed and made
/// again behind kubevol's back, the directory now at the path is the one set up and torn down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_directory_made_again_behind_kubevols_back_is_the_one_used() {
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    let m = start(t.path(), fake.clone());
    let mut p = pod("again");
    let spec = p.spec.as_mut().unwrap();
    spec.containers[0]
        .volume_mounts
        .as_mut()
        .unwrap()
        .push(serde_json::from_value(serde_json::json!({"name": "n", "mountPath": "/n"})).unwrap());
    spec.volumes.as_mut().unwrap().push(
        serde_json::from_value(serde_json::json!({"name": "n", "emptyDir": {"medium": "Memory"}}))
            .unwrap(),
    );
    let uid = kubevol::pod_uid(&p);
    let dir = m
        .config()
        .root_dir
        .join(format!("pods/{uid}/volumes/kubernetes.io~empty-dir"));
    // `n` fails until the first volume is set up and its directory is replaced.
    fake.fail(
        FakeOp::Mount,
        Some(&dir.join("n")),
        rustix_errno_busy(),
        u32::MAX,
    );
    m.add_pod(p.clone());
    until_announced(&m, 120, "m set up", || fake.is_mounted(&dir.join("m"))).await;
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir(&dir).unwrap();
    fake.clear_failures();
    m.wait_for_attach_and_mount(&p)
        .await
        .expect("n is set up in the directory now at the path");
    assert!(dir.join("n").is_dir());

    // Again before the teardown: both volume directories are made anew, and both go.
    std::fs::remove_dir_all(&dir).unwrap();
    for v in ["m", "n"] {
        std::fs::create_dir_all(dir.join(v)).unwrap();
        std::fs::write(dir.join(v).join("data"), "what the pod wrote").unwrap();
    }
    m.remove_pod(&p);
    m.wait_for_unmount(&p).await.unwrap();
    assert!(!dir.join("m").exists() && !dir.join("n").exists());
    m.shutdown();
}

/// The pods directory is kept open from one pod to the next; removed behind kubevol's back,
/// the next pod's directory is made, and removed, at the path, not in the removed one — also
/// when it is replaced while a pod is set up, and that pod's teardown is the next thing done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_directory_removed_behind_kubevols_back_is_made_again() {
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    let m = start(t.path(), fake.clone());
    let pods = m.config().root_dir.join("pods");
    for (i, how) in ["removed", "removed and made again", "replaced under a pod"]
        .into_iter()
        .enumerate()
    {
        let p = pod(&format!("p{i}"));
        let uid = kubevol::pod_uid(&p);
        m.add_pod(p.clone());
        m.wait_for_attach_and_mount(&p)
            .await
            .unwrap_or_else(|e| panic!("pods directory {how}: {e}"));
        let volume = pods.join(format!("{uid}/volumes/kubernetes.io~empty-dir/m"));
        assert!(fake.is_mounted(&volume), "{how}");
        assert!(volume.is_dir(), "{how}");
        if i == 2 {
            std::fs::remove_dir_all(&pods).unwrap();
            std::fs::create_dir_all(&volume).unwrap();
        }
        m.remove_pod(&p);
        m.wait_for_unmount(&p).await.unwrap();
        let dir = pods.join(uid.as_str());
        let what = format!("pods directory {how}: the pod's directory removed");
        until_announced(&m, 120, &what, || !dir.exists()).await;
        if i < 2 {
            std::fs::remove_dir(&pods).unwrap();
        }
        if i == 1 {
            std::fs::create_dir(&pods).unwrap();
        }
    }
    m.shutdown();
}

/// A wait for many pods' teardown: the pods whose volumes go are done, and a timeout names each
/// pod still holding a volume, with the volume and its last error (once, whatever the number of
/// pods waited for); once the volume goes, the same wait succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_many_pods_unmount_names_each_pod_still_mounted() {
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    let m = start_waiting(t.path(), fake.clone(), Duration::from_millis(1500));
    let pods: Vec<Pod> = ["first", "stuck", "last"].into_iter().map(pod).collect();
    for p in &pods {
        m.add_pod(p.clone());
        m.wait_for_attach_and_mount(p).await.unwrap();
    }
    let target = |p: &Pod| {
        m.config().root_dir.join(format!(
            "pods/{}/volumes/kubernetes.io~empty-dir/m",
            kubevol::pod_uid(p)
        ))
    };
    fake.fail(
        FakeOp::Unmount,
        Some(&target(&pods[1])),
        rustix_errno_busy(),
        u32::MAX,
    );
    m.remove_pods(&pods);
    // The wait below is given the state it is about: the stuck one failed, the others gone.
    wait_for_status(&m, &pods[1], 120, |s| {
        s.volumes.iter().any(|v| {
            v.retry
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("busy"))
        })
    })
    .await;
    until_announced(&m, 120, "the other pods torn down", || {
        !fake.is_mounted(&target(&pods[0])) && !fake.is_mounted(&target(&pods[2]))
    })
    .await;
    let err = m
        .wait_for_all_pods_unmount(&pods)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("timed out after 1.5s waiting for volumes of pod 1 of 3 pods: default/stuck: still mounted volumes=[m (UnmountVolume.TearDown failed for volume \"m\""),
        "{err}"
    );
    assert_eq!(err.matches("still mounted").count(), 1, "{err}");
    assert!(!err.contains("first") && !err.contains("last"), "{err}");
    assert!(!fake.is_mounted(&target(&pods[0])) && !fake.is_mounted(&target(&pods[2])));
    assert!(fake.is_mounted(&target(&pods[1])));

    fake.clear_failures();
    m.wait_for_all_pods_unmount(&pods)
        .await
        .expect("torn down once the unmount works");
    assert!(!fake.is_mounted(&target(&pods[1])));
    m.shutdown();
}

fn rustix_errno_busy() -> kubevol_mount::Errno {
    kubevol_mount::Errno::BUSY
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmount_waits_until_sources_synced() {
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    let (m, sinks) = start_with_sources(t.path(), fake.clone(), &["slow-source"]);
    let p = pod("gated");
    let uid = m.add_pod(p.clone());
    m.wait_for_attach_and_mount(&p)
        .await
        .expect("mounting does not wait for sources");
    assert!(!m.reconciler_states_synced());

    m.remove_pod(&p);
    // Proof that the removal was planned: the pod left the desired state (it is Terminating),
    // and the reconciler made a pass after that.
    let mut passes = 0;
    until_announced(&m, 120, "the pod left the desired state", || {
        passes = m.reconciler_passes();
        m.pod_status(&uid)
            .is_some_and(|s| s.phase == kubevol::status::PodPhase::Terminating)
    })
    .await;
    // A pass that begins after that has planned the removal (at the latest, the resync's).
    kubevol_testserver::cluster::eventually("a pass planned the removal", 120, || {
        let after = m.reconciler_passes() > passes;
        async move { after }
    })
    .await;
    assert!(
        !fake
            .calls()
            .iter()
            .any(|c| matches!(c, kubevol_mount::fake::MountCall::Unmount { .. })),
        "nothing is torn down before every source has synced"
    );
    assert!(m.has_possibly_mounted_volumes(&uid));

    sinks[0].synced();
    m.wait_for_unmount(&p).await.expect("torn down once synced");
    assert!(m.reconciler_states_synced());
    m.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_queries_answer_from_the_states_of_world() {
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    let m = start(t.path(), fake);
    let mut p = pod("lib");
    p.spec.as_mut().unwrap().security_context =
        Some(k8s_openapi::api::core::v1::PodSecurityContext {
            supplemental_groups: Some(vec![5]),
            ..Default::default()
        });
    let uid = m.add_pod(p.clone());
    m.wait_for_attach_and_mount(&p).await.unwrap();
    assert!(m.has_possibly_mounted_volumes(&uid));
    assert_eq!(
        m.mounted_volumes_for_pod(&uid).keys().collect::<Vec<_>>(),
        vec!["m"]
    );
    assert!(
        m.volumes_in_use().is_empty(),
        "emptyDir is neither attachable nor device-mountable"
    );
    let name = kubevol_core::UniqueVolumeName::for_pod_volume("kubernetes.io/empty-dir", &uid, "m");
    assert!(
        m.volume_is_attached(&name),
        "a volume that needs no attach is attached once set up"
    );
    assert!(
        m.extra_supplemental_groups_for_pod(&p).is_empty(),
        "no PersistentVolume, no extra group"
    );
    m.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_path_mounts_are_removed_before_their_volume() {
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    let m = start(t.path(), fake.clone());
    let p: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "sub"},
        "spec": {
            "containers": [{"name": "c", "volumeMounts": [{"name": "m", "mountPath": "/logs", "subPath": "logs"}]}],
            "volumes": [{"name": "m", "emptyDir": {"medium": "Memory"}}]
        }
    }))
    .unwrap();
    let uid = m.add_pod(p.clone());
    m.wait_for_attach_and_mount(&p).await.expect("mounted");
    let pod_dir = m.config().root_dir.join(format!("pods/{uid}"));
    let volume = pod_dir.join("volumes/kubernetes.io~empty-dir/m");
    let sub_path = pod_dir.join("volume-subpaths/m/c/0");
    assert!(fake.is_mounted(&volume) && fake.is_mounted(&sub_path));
    assert!(
        volume.join("logs").is_dir(),
        "the missing subPath was created"
    );
    m.remove_pod(&p);
    m.wait_for_unmount(&p).await.unwrap();
    let unmounted: Vec<_> = fake
        .calls()
        .into_iter()
        .filter_map(|c| match c {
            MountCall::Unmount { target } => Some(target),
            MountCall::Mount { .. } => None,
        })
        .collect();
    let at = |p: &std::path::Path| unmounted.iter().position(|t| t == p);
    assert!(
        at(&sub_path).is_some() && at(&sub_path) < at(&volume),
        "subPath first, then its volume: {unmounted:?}"
    );
    assert!(!pod_dir.exists());
    m.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_volumes_say_what_they_are_and_what_is_supported() {
    let t = tempfile::tempdir().unwrap();
    let m = start(t.path(), Arc::new(FakeMounter::new()));
    let objects: Vec<kubevol::store::Object> = [
        serde_json::json!({"metadata": {"name": "nfs-pv"}, "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "nfs": {"server": "nfs.example", "path": "/x"}, "claimRef": {"namespace": "default", "name": "c"}}}),
    ]
    .into_iter()
    .map(|v| kubevol::store::Object::PersistentVolume(serde_json::from_value(v).unwrap()))
    .chain([kubevol::store::Object::PersistentVolumeClaim(
        serde_json::from_value(serde_json::json!({"metadata": {"name": "c", "namespace": "default"}, "spec": {"volumeName": "nfs-pv", "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}, "status": {"phase": "Bound"}})).unwrap(),
    )])
    .collect();
    assert!(m.library().upsert_objects(objects).is_empty());
    let p: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {
            "containers": [{"name": "c", "volumeMounts": [{"name": "claim", "mountPath": "/a"}, {"name": "share", "mountPath": "/b"}]}],
            "volumes": [
                {"name": "claim", "persistentVolumeClaim": {"claimName": "c"}},
                {"name": "share", "nfs": {"server": "nfs.example", "path": "/y"}}
            ]
        }
    }))
    .unwrap();
    let uid = m.add_pod(p.clone());
    let mut errors: Vec<String> = Vec::new();
    until_announced(&m, 120, "both volumes refused", || {
        errors = m
            .pod_status(&uid)
            .iter()
            .flat_map(|s| &s.volumes)
            .filter_map(|v| v.retry.last_error.clone())
            .collect();
        errors.len() == 2
    })
    .await;
    assert!(
        errors[0]
            .contains("PersistentVolume nfs-pv is a nfs volume, a type kubevol does not mount yet"),
        "{errors:?}"
    );
    assert!(
        errors[1].contains("volume type nfs is not supported by kubevol yet")
            && errors[1].contains(", persistentVolumeClaim, ephemeral, awsElasticBlockStore,"),
        "{errors:?}"
    );
    m.shutdown();
}

/// An idle node is not woken: once everything is mounted, the reconciler makes its safety-net
/// full pass after the last change and then no pass at all until something changes, however
/// many resync periods go by (before, it planned every volume every period). A change after
/// that is still acted on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_node_is_not_woken_by_the_resync() {
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    let resync = Duration::from_millis(20);
    let (m, _) = start_configured(t.path(), fake.clone(), &[], |c| c.resync_period = resync);
    let pods: Vec<Pod> = (0..3).map(|i| pod(&format!("idle-{i}"))).collect();
    for p in &pods {
        m.add_pod(p.clone());
    }
    for p in &pods {
        m.wait_for_attach_and_mount(p).await.unwrap();
    }
    // Quiet: no pass over 25 resync periods. With a pass every period this never holds.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let before = m.reconciler_passes();
        tokio::time::sleep(resync * 25).await;
        if m.reconciler_passes() == before {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the reconciler never went quiet: a pass every resync period of {resync:?}"
        );
    }
    m.remove_pod(&pods[0]);
    m.wait_for_unmount(&pods[0])
        .await
        .expect("a change after idle is acted on");
    m.shutdown();
}

/// A Secret whose watch has started (pending) when its pod comes, and which is listed a
/// moment later: the pod's volume waits for it, and is set up as soon as it is there. Content
/// rewrites are paced (here to one an hour), but the change that brings the object the volume
/// waits for is not a rewrite and is never held back, however soon after the watch's start it
/// comes (it used to wait for the object's next turn, a second later by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_listed_just_after_its_watch_started_is_not_held_back() {
    use kubevol::store::{Change, Object, ObjectKey};
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    let (m, sinks) = start_configured(t.path(), fake, &["cluster"], |c| {
        c.content_pace = Duration::from_secs(3600);
    });
    let cluster = &sinks[0];
    cluster.synced();
    let p: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "reads-a-secret", "namespace": "default"},
        "spec": {
            "containers": [{"name": "c", "volumeMounts": [{"name": "creds", "mountPath": "/creds"}]}],
            "volumes": [{"name": "creds", "secret": {"secretName": "s"}}]
        }
    }))
    .unwrap();
    m.add_pod(p.clone());
    let creds = |phase: kubevol::status::VolumePhase| {
        move |s: &kubevol::status::PodStatus| {
            s.volumes
                .iter()
                .any(|v| v.name == "creds" && v.state == phase)
        }
    };
    // The Secret does not exist yet.
    wait_for_status(&m, &p, 120, creds(kubevol::status::VolumePhase::Retrying)).await;
    // Its watch starts: the populator sees it pending.
    let key = ObjectKey::Secret(("default".into(), "s".into()));
    cluster.apply([Change::ClusterPending {
        key: key.clone(),
        pending: true,
    }]);
    wait_for_status(&m, &p, 120, creds(kubevol::status::VolumePhase::Pending)).await;
    let secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "s", "namespace": "default"},
        "data": {"password": "c2VjcmV0"}
    }))
    .unwrap();
    cluster.apply([
        Change::ClusterUpsert(Box::new(Object::Secret(secret))),
        Change::ClusterPending {
            key,
            pending: false,
        },
    ]);
    m.wait_for_attach_and_mount(&p)
        .await
        .expect("set up once the Secret is there, not at its next turn an hour later");
    let path = m
        .pod_status(&kubevol::pod_uid(&p))
        .and_then(|s| s.volumes.into_iter().find(|v| v.name == "creds")?.path)
        .expect("the volume's path");
    assert_eq!(
        std::fs::read(std::path::Path::new(&path).join("password")).unwrap(),
        b"secret"
    );
    m.shutdown();
}

/// Many pods given at once are all set up, their UIDs come back in the order given, and a
/// caller that keeps only who each pod is (a `PodRef`, not the pod) waits for them, removes
/// them and waits for their teardown; a wait for a pod never given names it when it times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_given_at_once_are_waited_for_and_removed_by_who_they_are() {
    use kubevol::PodIdentity;
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    // Waits for what comes are given all the time a loaded machine needs; the wait for a pod
    // that never comes runs out, on a manager of its own with a short wait.
    let m = start_waiting(t.path(), fake.clone(), Duration::from_secs(600));
    let n = 135;
    let pods: Vec<Pod> = (0..n).map(|i| pod(&format!("p{i}"))).collect();
    let who: Vec<kubevol_core::PodRef> = pods.iter().map(|p| p.pod_ref()).collect();
    let uids = m.add_pods(pods);
    assert_eq!(uids, who.iter().map(|w| w.uid.clone()).collect::<Vec<_>>());
    for w in &who {
        assert_eq!(w.to_string(), format!("default/{}", w.name));
        m.wait_for_attach_and_mount(w).await.expect("mounted");
    }
    let mounted = || {
        uids.iter()
            .filter(|uid| {
                fake.is_mounted(
                    &m.config()
                        .root_dir
                        .join(format!("pods/{uid}/volumes/kubernetes.io~empty-dir/m")),
                )
            })
            .count()
    };
    assert_eq!(mounted(), n);

    let ghost = pod("ghost").pod_ref();
    let elsewhere = tempfile::tempdir().unwrap();
    let short = start_waiting(
        elsewhere.path(),
        Arc::new(FakeMounter::new()),
        Duration::from_millis(300),
    );
    let err = short
        .wait_for_attach_and_mount(&ghost)
        .await
        .unwrap_err()
        .to_string();
    short.shutdown();
    assert!(
        err.starts_with("timed out after 300ms waiting for volumes of pod default/ghost"),
        "{err}"
    );

    m.remove_pods(&who);
    m.wait_for_all_pods_unmount(&who).await.expect("torn down");
    assert_eq!(mounted(), 0);
    m.shutdown();
}

/// The manager's stop ends every wait: those already asleep on their pods' signals (polled
/// once before the stop; two share a pod) and one begun after it. The clock is paused, so a
/// wait the stop did not wake runs into its deadline at once and fails as a timeout, not a
/// hang. A wait stays small: a node agent keeps one for every pod it starts.
#[tokio::test(start_paused = true)]
async fn a_stop_ends_every_wait_asleep_or_begun_after() {
    use kubevol::PodIdentity;
    use std::future::Future;
    let t = tempfile::tempdir().unwrap();
    let mut c = Config::new(t.path(), "n");
    c.wait_timeout = Duration::from_secs(600);
    let m = VolumeManager::new(c, Arc::new(FakeMounter::new())).unwrap();
    let (never, other) = (pod("never-given").pod_ref(), pod("other").pod_ref());
    let asleep = m.wait_for_attach_and_mount(&never);
    let size = std::mem::size_of_val(&asleep);
    assert!(size <= 512, "a wait for a pod's volumes takes {size} bytes");
    let beside = m.wait_for_attach_and_mount(&never);
    let apart = m.wait_for_attach_and_mount(&other);
    tokio::pin!(asleep, beside, apart);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(asleep.as_mut().poll(&mut cx).is_pending());
    assert!(beside.as_mut().poll(&mut cx).is_pending());
    assert!(apart.as_mut().poll(&mut cx).is_pending());

    m.shutdown();
    for r in [asleep.await, beside.await, apart.await] {
        assert!(matches!(r, Err(WaitError::Stopped)), "{r:?}");
    }
    let after = m.wait_for_attach_and_mount(&never).await;
    assert!(matches!(after, Err(WaitError::Stopped)), "{after:?}");
}

/// A PersistentVolume and a StorageClass whose `mountOptions` hold an unclosed quote (`a"`,
/// which would swallow the options after it) are refused end to end: the pods that use them
/// say which field to fix, nothing is provisioned for the class's claim, and no mount call
/// carries the option.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mount_options_that_open_a_quote_never_reach_a_mount() {
    use kubevol::store::Object;
    let t = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeMounter::new());
    let m = start(t.path(), fake.clone());
    let json = |v: serde_json::Value| v;
    let objects = vec![
        Object::StorageClass(serde_json::from_value(json(serde_json::json!({"metadata": {"name": "quoted"}, "provisioner": "kubevol.io/local-path", "mountOptions": ["noatime", "a\""]}))).unwrap()),
        Object::PersistentVolumeClaim(serde_json::from_value(json(serde_json::json!({"metadata": {"name": "by-class", "namespace": "default"},
            "spec": {"storageClassName": "quoted", "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Mi"}}}}))).unwrap()),
        Object::PersistentVolume(serde_json::from_value(json(serde_json::json!({"metadata": {"name": "quoted-pv"},
            "spec": {"capacity": {"storage": "1Mi"}, "accessModes": ["ReadWriteOnce"], "mountOptions": ["a\""], "storageClassName": "",
                     "hostPath": {"path": t.path().join("data").to_str().unwrap(), "type": "DirectoryOrCreate"},
                     "claimRef": {"namespace": "default", "name": "by-volume"}}}))).unwrap()),
        Object::PersistentVolumeClaim(serde_json::from_value(json(serde_json::json!({"metadata": {"name": "by-volume", "namespace": "default"},
            "spec": {"storageClassName": "", "volumeName": "quoted-pv", "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Mi"}}}}))).unwrap()),
    ];
    m.library().upsert_objects(objects);
    let claim_pod = |name: &str, claim: &str| -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "volumeMounts": [{"name": "d", "mountPath": "/d"}]}],
                     "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": claim}}]}}))
        .unwrap()
    };
    for (pod, claim, why) in [
        ("by-class", "by-class", "StorageClass quoted"),
        (
            "by-volume",
            "by-volume",
            "PersistentVolume quoted-pv is invalid",
        ),
    ] {
        let p = claim_pod(pod, claim);
        m.add_pod(p.clone());
        let s = wait_for_status(&m, &p, 120, |s| {
            s.volumes[0]
                .retry
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("must close every double quote it opens"))
        })
        .await;
        let e = s.volumes[0].retry.last_error.clone().unwrap();
        assert!(e.contains(why) && e.contains("mountOptions["), "{pod}: {e}");
    }
    assert!(
        m.status(false)
            .bindings
            .iter()
            .all(|b| b.claim != "default/by-class"),
        "nothing provisioned for the class's claim"
    );
    let carried = fake.calls().into_iter().any(|c| matches!(&c, MountCall::Mount { options, .. } if options.data.iter().any(|o| o.contains('"'))));
    assert!(
        !carried,
        "no mount call carries the quoted option: {:?}",
        fake.calls()
    );
    m.shutdown();
}
