use std::cell::RefCell;

use kubevol_core::state::SubPathMount;
use serde_json::json;

use super::*;

fn pod(containers: serde_json::Value, volumes: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"containers": containers, "volumes": volumes}
    }))
    .unwrap()
}

fn volume(plugin: &str, path: &str) -> MountedVolume {
    MountedVolume {
        path: path.into(),
        read_only: false,
        sub_paths: Vec::new(),
        plugin: plugin.into(),
        block: false,
        selinux_mount: false,
    }
}

/// Resolves with a kernel that makes recursive read-only mounts, image subPaths taken as
/// written, and every propagation asked for recorded.
fn resolve(
    pod: &Pod,
    container: &str,
    mounted: &BTreeMap<String, MountedVolume>,
    rro: bool,
) -> (
    Result<ContainerMounts, ContainerMountsError>,
    Vec<(PathBuf, Propagation)>,
) {
    let asked = RefCell::new(Vec::new());
    let r = Resolver {
        expand: &|_, _, m| Ok(m.sub_path.clone().or(m.sub_path_expr.clone())),
        propagate: &|p, how| {
            asked.borrow_mut().push((p.to_path_buf(), how));
            Ok(())
        },
        recursive_read_only: rro,
    }
    .resolve(pod, container, mounted);
    (r, asked.into_inner())
}

fn standard() -> (Pod, BTreeMap<String, MountedVolume>) {
    let p = pod(
        json!([{"name": "app", "volumeMounts": [
            {"name": "cache", "mountPath": "/cache"},
            {"name": "cache", "mountPath": "/logs", "subPath": "logs"},
            {"name": "config", "mountPath": "/etc/app", "readOnly": true, "recursiveReadOnly": "IfPossible"},
            {"name": "host", "mountPath": "/host", "mountPropagation": "HostToContainer"},
            {"name": "tools", "mountPath": "/tools", "subPath": "bin"},
            {"name": "cache", "mountPath": "/again"},
        ], "volumeDevices": [{"name": "disk", "devicePath": "/dev/xvda"}]}]),
        json!([
            {"name": "cache", "emptyDir": {}},
            {"name": "config", "configMap": {"name": "c"}},
            {"name": "host", "hostPath": {"path": "/srv"}},
            {"name": "tools", "image": {"reference": "registry.example/tools:1", "pullPolicy": "Always"}},
            {"name": "disk", "persistentVolumeClaim": {"claimName": "disk"}},
        ]),
    );
    let mut cache = volume(
        "kubernetes.io/empty-dir",
        "/r/pods/u/volumes/kubernetes.io~empty-dir/cache",
    );
    cache.sub_paths.push(SubPathMount {
        container: "app".into(),
        index: 1,
        sub_path: "logs".into(),
        path: "/r/pods/u/volume-subpaths/cache/app/1".into(),
    });
    let mut config = volume(
        "kubernetes.io/configmap",
        "/r/pods/u/volumes/kubernetes.io~configmap/config",
    );
    config.read_only = true;
    let mut disk = volume(
        "kubernetes.io/csi",
        "/r/pods/u/volumeDevices/kubernetes.io~csi/pv-1",
    );
    disk.block = true;
    let mounted = [
        ("cache", cache),
        ("config", config),
        (
            "host",
            volume(
                "kubernetes.io/host-path",
                "/r/pods/u/volumes/kubernetes.io~host-path/host",
            ),
        ),
        (
            "tools",
            volume(
                "kubernetes.io/image",
                "/r/pods/u/volumes/kubernetes.io~image/tools",
            ),
        ),
        ("disk", disk),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    (p, mounted)
}

#[test]
fn each_mount_is_resolved_as_the_kubelet_makes_it() {
    let (p, mounted) = standard();
    let (r, asked) = resolve(&p, "app", &mounted, true);
    let r = r.unwrap();
    assert_eq!(
        (r.namespace.as_str(), r.pod.as_str(), r.container.as_str()),
        ("shop", "web", "app")
    );
    let m = &r.mounts;
    assert_eq!(
        m.iter()
            .map(|m| m.container_path.as_str())
            .collect::<Vec<_>>(),
        ["/cache", "/logs", "/etc/app", "/host", "/tools", "/again"],
        "in the order of volumeMounts"
    );
    assert_eq!(
        m[0].host_path.as_deref(),
        Some(Path::new("/r/pods/u/volumes/kubernetes.io~empty-dir/cache"))
    );
    assert!(!m[0].read_only && m[0].selinux_relabel && m[0].propagation == Propagation::None);
    // A subPath: its own bind mount, never the volume's path joined again.
    assert_eq!(
        m[1].host_path.as_deref(),
        Some(Path::new("/r/pods/u/volume-subpaths/cache/app/1"))
    );
    assert_eq!(m[1].sub_path.as_deref(), Some("logs"));
    assert!(
        !m[1].selinux_relabel,
        "a volume is relabelled at its first mount only"
    );
    assert!(m[2].read_only && m[2].recursive_read_only);
    assert_eq!(m[3].propagation, Propagation::HostToContainer);
    assert!(
        !m[3].selinux_relabel,
        "the host's own files are not relabelled"
    );
    assert_eq!(
        asked,
        vec![(
            PathBuf::from("/r/pods/u/volumes/kubernetes.io~host-path/host"),
            Propagation::HostToContainer
        )]
    );
    assert_eq!(m[4].host_path, None);
    assert_eq!(
        m[4].image,
        Some(ImageMount {
            reference: "registry.example/tools:1".into(),
            pull_policy: Some("Always".into())
        })
    );
    assert!(m[4].read_only && !m[4].selinux_relabel);
    assert_eq!(m[4].sub_path.as_deref(), Some("bin"));
    assert!(!m[5].selinux_relabel);
    assert_eq!(
        r.devices,
        vec![ContainerDevice {
            volume: "disk".into(),
            container_path: "/dev/xvda".into(),
            host_path: "/r/pods/u/volumeDevices/kubernetes.io~csi/pv-1".into(),
            permissions: "mrw".into(),
        }]
    );
}

#[test]
fn a_volume_read_only_by_itself_is_read_only_whatever_the_mount_asks() {
    let p = pod(
        json!([{"name": "c", "volumeMounts": [{"name": "s", "mountPath": "/s"}]}]),
        json!([{"name": "s", "secret": {"secretName": "s"}}]),
    );
    let mut s = volume("kubernetes.io/secret", "/r/s");
    s.read_only = true;
    let mounted = [("s".to_string(), s)].into();
    let m = resolve(&p, "c", &mounted, true).0.unwrap();
    assert!(m.mounts[0].read_only && !m.mounts[0].recursive_read_only);
}

#[test]
fn recursive_read_only_follows_the_kernel_and_the_apis_rules() {
    let with = |rro: &str, read_only: bool, propagation: Option<&str>| {
        let mut mount = json!({"name": "h", "mountPath": "/h", "readOnly": read_only, "recursiveReadOnly": rro});
        if let Some(p) = propagation {
            mount["mountPropagation"] = json!(p);
        }
        pod(
            json!([{"name": "c", "volumeMounts": [mount]}]),
            json!([{"name": "h", "hostPath": {"path": "/srv"}}]),
        )
    };
    let mounted: BTreeMap<_, _> =
        [("h".to_string(), volume("kubernetes.io/host-path", "/r/h"))].into();
    let rro = |p: &Pod, kernel: bool| {
        resolve(p, "c", &mounted, kernel)
            .0
            .map(|m| m.mounts[0].recursive_read_only)
    };
    assert!(rro(&with("Enabled", true, None), true).unwrap());
    assert!(rro(&with("IfPossible", true, None), true).unwrap());
    assert!(
        !rro(&with("IfPossible", true, None), false).unwrap(),
        "IfPossible falls back"
    );
    assert!(!rro(&with("Disabled", true, None), true).unwrap());
    let e = rro(&with("Enabled", true, None), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("recursiveReadOnly Enabled needs recursive read-only mounts"),
        "{e}"
    );
    let e = rro(&with("Enabled", false, None), true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("may only be specified when readOnly is true"),
        "{e}"
    );
    let e = rro(&with("IfPossible", true, Some("HostToContainer")), true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("mountPropagation is None"), "{e}");
    let e = rro(&with("Sometimes", true, None), true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not one of Disabled, IfPossible, Enabled"),
        "{e}"
    );
}

#[test]
fn bidirectional_is_for_privileged_containers_only() {
    let p = |privileged: bool| {
        pod(
            json!([{"name": "c", "securityContext": {"privileged": privileged},
                    "volumeMounts": [{"name": "h", "mountPath": "/h", "mountPropagation": "Bidirectional"}]}]),
            json!([{"name": "h", "hostPath": {"path": "/srv"}}]),
        )
    };
    let mounted: BTreeMap<_, _> =
        [("h".to_string(), volume("kubernetes.io/host-path", "/r/h"))].into();
    let (r, asked) = resolve(&p(true), "c", &mounted, true);
    assert_eq!(r.unwrap().mounts[0].propagation, Propagation::Bidirectional);
    assert_eq!(
        asked,
        vec![(PathBuf::from("/r/h"), Propagation::Bidirectional)]
    );
    let (r, asked) = resolve(&p(false), "c", &mounted, true);
    let e = r.unwrap_err();
    assert!(!e.is_not_ready());
    assert!(
        e.to_string()
            .contains("available only to privileged containers"),
        "{e}"
    );
    assert!(asked.is_empty());
}

#[test]
fn what_cannot_be_given_yet_or_at_all_says_why() {
    let (p, mounted) = standard();
    let e = resolve(&p, "nope", &mounted, true).0.unwrap_err();
    assert!(matches!(e, ContainerMountsError::NoContainer { .. }));
    assert_eq!(e.to_string(), "pod shop/web has no container \"nope\"");

    // Not mounted yet: the agent waits (409).
    let mut fewer = mounted.clone();
    fewer.remove("config");
    let e = resolve(&p, "app", &fewer, true).0.unwrap_err();
    assert!(e.is_not_ready(), "{e}");
    assert!(
        e.to_string()
            .contains("volume \"config\" of pod shop/web is not mounted"),
        "{e}"
    );

    // Mounted, its subPath not made yet.
    let mut unprepared = mounted.clone();
    unprepared.get_mut("cache").unwrap().sub_paths.clear();
    let e = resolve(&p, "app", &unprepared, true).0.unwrap_err();
    assert!(
        matches!(e, ContainerMountsError::SubPathNotPrepared { .. }) && e.is_not_ready(),
        "{e}"
    );
    assert!(e.to_string().contains("/logs"), "{e}");

    // A block volume mounted as a filesystem, a filesystem used as a device.
    let mut swapped = mounted.clone();
    swapped.get_mut("disk").unwrap().block = false;
    let e = resolve(&p, "app", &swapped, true).0.unwrap_err();
    assert!(e.to_string().contains("it is not a block volume"), "{e}");
    let mut swapped = mounted.clone();
    swapped.get_mut("cache").unwrap().block = true;
    let e = resolve(&p, "app", &swapped, true).0.unwrap_err();
    assert!(e.to_string().contains("use it in volumeDevices"), "{e}");

    // A mount of a volume the pod does not declare.
    let undeclared = pod(
        json!([{"name": "c", "volumeMounts": [{"name": "x", "mountPath": "/x"}]}]),
        json!([]),
    );
    let e = resolve(&undeclared, "c", &mounted, true).0.unwrap_err();
    assert!(matches!(e, ContainerMountsError::NoVolume { .. }), "{e}");
}

#[test]
fn init_and_ephemeral_containers_are_found_and_a_propagation_failure_is_reported() {
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {
            "initContainers": [{"name": "init", "volumeMounts": [{"name": "h", "mountPath": "/h", "mountPropagation": "HostToContainer"}]}],
            "containers": [{"name": "c"}],
            "ephemeralContainers": [{"name": "debug", "volumeMounts": [{"name": "h", "mountPath": "/dbg"}]}],
            "volumes": [{"name": "h", "hostPath": {"path": "/srv"}}]
        }
    }))
    .unwrap();
    let mounted: BTreeMap<_, _> =
        [("h".to_string(), volume("kubernetes.io/host-path", "/r/h"))].into();
    let m = resolve(&p, "debug", &mounted, true).0.unwrap();
    assert_eq!(m.mounts[0].container_path, "/dbg");
    let e = Resolver {
        expand: &|_, _, _| Ok(None),
        propagate: &|_, _| Err("the mount holding /r/h is private".into()),
        recursive_read_only: true,
    }
    .resolve(&p, "init", &mounted)
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("volume \"h\": the mount holding /r/h is private"),
        "{e}"
    );
}

#[test]
fn the_cri_and_oci_forms_say_what_the_runtimes_read() {
    let (p, mounted) = standard();
    let m = resolve(&p, "app", &mounted, true).0.unwrap();
    let cri = m.to_cri();
    assert_eq!(
        cri["mounts"][2],
        json!({"container_path": "/etc/app", "host_path": "/r/pods/u/volumes/kubernetes.io~configmap/config",
               "readonly": true, "recursive_read_only": true, "selinux_relabel": true, "propagation": "PROPAGATION_PRIVATE"})
    );
    assert_eq!(
        cri["mounts"][3]["propagation"],
        "PROPAGATION_HOST_TO_CONTAINER"
    );
    assert_eq!(
        cri["mounts"][4]["image"],
        json!({"image": "registry.example/tools:1"})
    );
    assert_eq!(cri["mounts"][4]["image_sub_path"], "bin");
    assert!(cri["mounts"][4].get("host_path").is_none());
    assert_eq!(
        cri["devices"],
        json!([{"container_path": "/dev/xvda", "host_path": "/r/pods/u/volumeDevices/kubernetes.io~csi/pv-1", "permissions": "mrw"}])
    );
    // An image volume has no OCI form.
    let e = m.to_oci().unwrap_err();
    assert!(e.contains("\"tools\" is an image volume"), "{e}");

    let mut plain = m.clone();
    plain.mounts.retain(|m| m.image.is_none());
    plain.devices.clear();
    let oci = plain.to_oci().unwrap();
    assert_eq!(
        oci["mounts"][0],
        json!({"destination": "/cache", "type": "bind", "source": "/r/pods/u/volumes/kubernetes.io~empty-dir/cache",
               "options": ["rbind", "rprivate", "rw"]})
    );
    assert_eq!(
        oci["mounts"][2]["options"],
        json!(["rbind", "rprivate", "ro", "rro"])
    );
    assert_eq!(
        oci["mounts"][3]["options"],
        json!(["rbind", "rslave", "rw"])
    );
    assert_eq!(oci["linux"]["devices"], json!([]));
    assert_eq!(
        oci["linux"]["rootfsPropagation"], "rslave",
        "a HostToContainer mount needs the tree to receive"
    );

    // A device is looked up for its numbers.
    let mut dev = plain.clone();
    dev.mounts.clear();
    dev.devices.push(ContainerDevice {
        volume: "null".into(),
        container_path: "/dev/x".into(),
        host_path: "/dev/null".into(),
        permissions: "mrw".into(),
    });
    let oci = dev.to_oci().unwrap();
    assert_eq!(
        oci["linux"]["devices"][0],
        json!({"path": "/dev/x", "type": "c", "major": 1, "minor": 3, "fileMode": 0o660, "uid": 0, "gid": 0})
    );
    assert_eq!(
        oci["linux"]["resources"]["devices"][0],
        json!({"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"})
    );
    dev.devices[0].host_path = "/etc/hostname".into();
    assert!(dev.to_oci().unwrap_err().contains("is not a device"));
}

/// The check of a container's mounts reads the mount table and changes nothing: a volume's
/// own mount that is not shared (the set-up makes it so) is reported, not made shared; a plain
/// directory needs a shared mount (or, for HostToContainer, a slave) and says what to do.
#[test]
fn propagation_is_checked_without_changing_a_mount() {
    use kubevol_mount::{FakeMounter, MountOptions};
    let fake = FakeMounter::new();
    let t = Path::new("/r/pods/u/volumes/t");
    fake.mount("tmpfs", t, "tmpfs", &MountOptions::default())
        .unwrap();
    let e = propagating(&fake, t, Propagation::HostToContainer).unwrap_err();
    assert!(
        e.contains("to be shared or a slave, and it is private"),
        "{e}"
    );
    assert!(
        !fake.mount_table().unwrap()[0].is_shared(),
        "a read made it shared"
    );
    fake.make_shared(t).unwrap();
    propagating(&fake, t, Propagation::HostToContainer).unwrap();
    let e = propagating(
        &fake,
        Path::new("/r/pods/u/volumes/t/sub/dir"),
        Propagation::Bidirectional,
    );
    assert!(e.is_ok(), "below a shared mount: {e:?}");
    fake.mount("ext4", Path::new("/r"), "ext4", &MountOptions::default())
        .unwrap();
    let e = propagating(
        &fake,
        Path::new("/r/pods/u/volumes/d"),
        Propagation::HostToContainer,
    )
    .unwrap_err();
    assert!(
        e.contains("needs the mount holding /r/pods/u/volumes/d (/r) to be shared or a slave"),
        "{e}"
    );
    assert!(e.contains("mount --make-rshared /r"), "{e}");
}

proptest::proptest! {
    /// Whatever a pod's mounts say (names, paths, subPaths, flags), resolving never panics and
    /// hands out only paths the actual state holds: a volume's path or a prepared subPath's
    /// mount, never one made of the pod's strings.
    #[test]
    fn only_paths_the_actual_state_holds_are_handed_out(
        mounts in proptest::collection::vec(
            ("[a-c]{1,2}", "[ -~]{0,12}", proptest::option::of("[ -~]{0,12}"), proptest::option::of(proptest::bool::ANY),
             proptest::option::of(proptest::sample::select(vec!["None", "HostToContainer", "Bidirectional", "x"])),
             proptest::option::of(proptest::sample::select(vec!["Disabled", "IfPossible", "Enabled", ""]))),
            0..6),
        privileged in proptest::bool::ANY,
    ) {
        let volume_mounts: Vec<serde_json::Value> = mounts.iter().map(|(name, path, sub, ro, prop, rro)| {
            json!({"name": name, "mountPath": path, "subPath": sub, "readOnly": ro, "mountPropagation": prop, "recursiveReadOnly": rro})
        }).collect();
        let p = pod(
            json!([{"name": "c", "securityContext": {"privileged": privileged}, "volumeMounts": volume_mounts}]),
            json!([{"name": "a", "emptyDir": {}}, {"name": "b", "hostPath": {"path": "/srv"}}, {"name": "ab", "secret": {"secretName": "s"}}]),
        );
        let mut a = volume("kubernetes.io/empty-dir", "/r/a");
        for (index, (_, _, sub, ..)) in mounts.iter().enumerate() {
            if sub.is_some() {
                a.sub_paths.push(SubPathMount { container: "c".into(), index, sub_path: "s".into(), path: format!("/r/sub/{index}").into() });
            }
        }
        let mounted: BTreeMap<_, _> = [("a".to_string(), a), ("b".to_string(), volume("kubernetes.io/host-path", "/r/b"))].into();
        if let Ok(m) = resolve(&p, "c", &mounted, true).0 {
            for m in &m.mounts {
                let path = m.host_path.as_ref().expect("no image volume here");
                let s = path.to_str().unwrap();
                proptest::prop_assert!(s == "/r/a" || s == "/r/b" || s.starts_with("/r/sub/"), "{s}");
            }
        }
    }
}

/// Fixed cases of the property's inputs, which holds of a resolver that refuses everything: a
/// plain mount and a subPath mount resolve, to the volume's path and the subPath's mount.
#[test]
fn the_propertys_plain_inputs_resolve_to_the_states_paths() {
    let p = pod(
        json!([{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/x"}, {"name": "a", "mountPath": "/y", "subPath": "s"}, {"name": "b", "mountPath": "/z", "readOnly": true}]}]),
        json!([{"name": "a", "emptyDir": {}}, {"name": "b", "hostPath": {"path": "/srv"}}]),
    );
    let mut a = volume("kubernetes.io/empty-dir", "/r/a");
    a.sub_paths.push(SubPathMount {
        container: "c".into(),
        index: 1,
        sub_path: "s".into(),
        path: "/r/sub/1".into(),
    });
    let mounted: BTreeMap<_, _> = [
        ("a".to_string(), a),
        ("b".to_string(), volume("kubernetes.io/host-path", "/r/b")),
    ]
    .into();
    let m = resolve(&p, "c", &mounted, true)
        .0
        .expect("plain mounts resolve");
    let paths: Vec<_> = m
        .mounts
        .iter()
        .map(|m| {
            (
                m.container_path.as_str(),
                m.host_path.clone().unwrap(),
                m.read_only,
            )
        })
        .collect();
    assert_eq!(
        paths,
        [
            ("/x", "/r/a".into(), false),
            ("/y", "/r/sub/1".into(), false),
            ("/z", "/r/b".into(), true)
        ]
    );
}
