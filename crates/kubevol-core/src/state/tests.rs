#[test]
fn a_pod_volume_is_read_in_place_in_its_pod() {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "p"},
        "spec": {"containers": [], "volumes": [{"name": "a", "emptyDir": {}}, {"name": "b", "emptyDir": {"medium": "Memory"}}]}
    }))
    .unwrap();
    let pod = Arc::new(pod);
    let b = PodVolumeRef::in_pod(pod.clone(), 1).expect("the pod has a second volume");
    let in_pod = &pod.spec.as_ref().unwrap().volumes.as_ref().unwrap()[1];
    assert!(std::ptr::eq(&*b, in_pod), "no copy of the volume");
    assert_eq!(b.name, "b");
    assert!(PodVolumeRef::in_pod(pod.clone(), 2).is_none());
    let owned: PodVolumeRef = in_pod.clone().into();
    assert_eq!(owned, b, "equal by value, however held");
}

#[test]
fn pod_map_keeps_uid_order_and_one_value_per_pod() {
    let uid = |s: &str| PodUid(s.into());
    let mut m: PodMap<u32> = ["c", "a", "b"]
        .iter()
        .zip(1..)
        .map(|(k, v)| (uid(k), v))
        .collect();
    assert_eq!(
        m.keys().map(|k| k.as_str()).collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
    assert_eq!(m.insert(uid("b"), 20), Some(3), "replaced, not added");
    assert_eq!(m.len(), 3);
    *m.get_mut(&uid("a")).unwrap() += 100;
    assert_eq!(
        (&m).into_iter().map(|(_, v)| *v).collect::<Vec<_>>(),
        [102, 20, 1]
    );
    assert_eq!(m.remove(&uid("z")), None);
    assert_eq!(m.remove(&uid("b")), Some(20));
    assert!(!m.contains_key(&uid("b")) && m.get(&uid("c")) == Some(&1));
    m.remove(&uid("a"));
    m.remove(&uid("c"));
    assert!(m.is_empty());
    assert_eq!(m.values().count(), 0);
}

use super::*;

fn mounted(state: PodMountState) -> MountedPodVolume {
    MountedPodVolume {
        pod_ref: PodRef {
            namespace: "default".into(),
            name: "p".into(),
            uid: PodUid("u".into()),
        },
        outer_volume_name: "v".into(),
        spec: Arc::new(VolumeSpec {
            volume: Volume::default().into(),
            persistent_volume: None,
            block: false,
            extensions: Default::default(),
            selinux_label: None,
            selinux_mount: false,
        }),
        state,
        path: PathBuf::from("/x"),
        read_only: false,
        content_generation: 0,
        sub_paths: Vec::new(),
    }
}

#[test]
fn the_mounted_count_follows_every_change_of_state() {
    let traits = VolumeTraits {
        plugin: "p".into(),
        attachable: false,
        device_mountable: false,
    };
    let (a, b) = (UniqueVolumeName("a".into()), UniqueVolumeName("b".into()));
    let uid = PodUid("u".into());
    let mut asw = ActualState::default();
    asw.mark_pod_volume(&a, &traits, uid.clone(), mounted(PodMountState::Uncertain));
    assert_eq!(asw.mounted_count(&uid), 0);
    asw.mark_pod_volume(&a, &traits, uid.clone(), mounted(PodMountState::Mounted));
    asw.mark_pod_volume(&a, &traits, uid.clone(), mounted(PodMountState::Mounted));
    asw.mark_pod_volume(&b, &traits, uid.clone(), mounted(PodMountState::Mounted));
    assert_eq!(asw.mounted_count(&uid), 2, "set up again: counted once");
    asw.set_pod_state(&a, &uid, PodMountState::Uncertain);
    assert_eq!(asw.mounted_count(&uid), 1);
    asw.mark_pod_unmounted(&a, &uid);
    asw.mark_pod_unmounted(&b, &uid);
    asw.mark_pod_unmounted(&b, &uid);
    assert_eq!(asw.mounted_count(&uid), 0);
    assert!(asw.mounted_by_pod.is_empty(), "nothing kept for a gone pod");
}
