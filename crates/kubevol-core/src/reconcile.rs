//! The reconciler's decisions: given both states of world, which operations are due.
//!
//! This is a pure function. The manager runs it whenever either state changes, hands the result
//! to the operation executor (which drops keys already in flight or backing off), and never makes
//! a syscall itself. The order follows the kubelet: first tear down what no pod wants any more,
//! then attach, mount device and set up what pods want, then unmount devices and detach volumes
//! that no pod uses.

use crate::names::{PodUid, UniqueVolumeName};

use crate::state::{
    ActualState, ActualVolume, DesiredState, DesiredVolume, DeviceMountState, PodMountState,
};

/// One operation the executor can run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Operation {
    /// Tear down one pod's use of a volume.
    UnmountVolume {
        /// The volume.
        volume: UniqueVolumeName,
        /// The pod.
        pod: PodUid,
    },
    /// Attach a volume to the node.
    Attach {
        /// The volume.
        volume: UniqueVolumeName,
    },
    /// Mount a volume once for the node (CSI stage).
    MountDevice {
        /// The volume.
        volume: UniqueVolumeName,
    },
    /// Set up (or re-set-up) one pod's use of a volume.
    MountVolume {
        /// The volume.
        volume: UniqueVolumeName,
        /// The pod.
        pod: PodUid,
        /// Whether it is already set up and only its content must be rewritten.
        remount: bool,
    },
    /// Undo a node-wide mount (CSI unstage).
    UnmountDevice {
        /// The volume.
        volume: UniqueVolumeName,
    },
    /// Detach a volume from the node.
    Detach {
        /// The volume.
        volume: UniqueVolumeName,
    },
}

/// What the executor keys single-flight and backoff on: a volume, and for per-pod operations the
/// pod. A volume-wide key (`pod: None`) excludes every pod key of the same volume.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OperationKey {
    /// The volume.
    pub volume: UniqueVolumeName,
    /// The pod, for per-pod operations.
    pub pod: Option<PodUid>,
}

impl Operation {
    /// The operation's single-flight key.
    pub fn key(&self) -> OperationKey {
        match self {
            Operation::UnmountVolume { volume, pod }
            | Operation::MountVolume { volume, pod, .. } => OperationKey {
                volume: volume.clone(),
                pod: Some(pod.clone()),
            },
            Operation::Attach { volume }
            | Operation::MountDevice { volume }
            | Operation::UnmountDevice { volume }
            | Operation::Detach { volume } => OperationKey {
                volume: volume.clone(),
                pod: None,
            },
        }
    }

    /// The volume the operation is on.
    pub fn volume(&self) -> &UniqueVolumeName {
        match self {
            Operation::UnmountVolume { volume, .. }
            | Operation::MountVolume { volume, .. }
            | Operation::Attach { volume }
            | Operation::MountDevice { volume }
            | Operation::UnmountDevice { volume }
            | Operation::Detach { volume } => volume,
        }
    }

    /// The kubelet's metric name of the operation (`storage_operation_duration_seconds`).
    pub fn metric_name(&self) -> &'static str {
        match self {
            Operation::UnmountVolume { .. } => "volume_unmount",
            Operation::Attach { .. } => "volume_attach",
            Operation::MountDevice { .. } => "volume_mount_device",
            Operation::MountVolume { .. } => "volume_mount",
            Operation::UnmountDevice { .. } => "unmount_device",
            Operation::Detach { .. } => "volume_detach",
        }
    }

    /// Whether the operation removes something (gated until every pod source has synced).
    pub fn is_teardown(&self) -> bool {
        matches!(
            self,
            Operation::UnmountVolume { .. }
                | Operation::UnmountDevice { .. }
                | Operation::Detach { .. }
        )
    }
}

/// The operations due now. `teardown_allowed` is false until every pod source has delivered a
/// complete first listing: before that, a pod missing from the DSW may just not be listed yet.
/// A pod the DSW holds ([`DesiredState::held`]) keeps its volumes though no pod wants them.
/// With `require_reported` (a node of a cluster), an attachable or device-mountable volume is
/// not attached or staged before the node has reported it in `status.volumesInUse`, so that
/// the attach/detach controller never detaches a volume the node is about to use.
///
/// With `only`, just those volumes are looked at (the ones whose desired or actual state
/// changed, or whose backoff expired): what is due for any other volume was due before too.
pub fn plan(
    dsw: &DesiredState,
    asw: &ActualState,
    teardown_allowed: bool,
    require_reported: bool,
    only: Option<&[UniqueVolumeName]>,
) -> Vec<Operation> {
    let (actual, desired): (Vec<&ActualVolume>, Vec<&DesiredVolume>) = match only {
        // Every volume, by name: a full pass plans in the same order whatever the states'
        // maps hold.
        None => {
            let mut actual: Vec<&ActualVolume> = asw.volumes().collect();
            let mut desired: Vec<&DesiredVolume> = dsw.volumes().collect();
            actual.sort_unstable_by(|a, b| a.name.cmp(&b.name));
            desired.sort_unstable_by(|a, b| a.name.cmp(&b.name));
            (actual, desired)
        }
        Some(names) => (
            names.iter().filter_map(|n| asw.volume(n)).collect(),
            names.iter().filter_map(|n| dsw.volume(n)).collect(),
        ),
    };
    let mut ops = Vec::new();
    if teardown_allowed {
        for v in &actual {
            for uid in v.pods.keys() {
                if dsw.pod_volume(&v.name, uid).is_none() && dsw.held(uid).is_none() {
                    ops.push(Operation::UnmountVolume {
                        volume: v.name.clone(),
                        pod: uid.clone(),
                    });
                }
            }
        }
    }
    for want in desired {
        let have = asw.volume(&want.name);
        if require_reported && want.traits.node_wide() && !want.reported_in_use {
            continue;
        }
        if want.traits.attachable && !have.is_some_and(|h| h.attached) {
            ops.push(Operation::Attach {
                volume: want.name.clone(),
            });
            continue;
        }
        if want.traits.device_mountable
            && !have.is_some_and(|h| h.device_state == DeviceMountState::Mounted)
        {
            ops.push(Operation::MountDevice {
                volume: want.name.clone(),
            });
            continue;
        }
        for (uid, pv) in &want.pods {
            let mounted = have.and_then(|h| h.pods.get(uid));
            let due = match mounted {
                None => Some(false),
                Some(m) if m.state == PodMountState::Uncertain => Some(false),
                Some(m) if m.content_generation < pv.content_generation => Some(true),
                Some(_) => None,
            };
            if let Some(remount) = due {
                ops.push(Operation::MountVolume {
                    volume: want.name.clone(),
                    pod: uid.clone(),
                    remount,
                });
            }
        }
    }
    if teardown_allowed {
        for v in actual {
            if !v.pods.is_empty() || dsw.volume(&v.name).is_some() {
                continue;
            }
            if v.device_state != DeviceMountState::NotMounted {
                ops.push(Operation::UnmountDevice {
                    volume: v.name.clone(),
                });
            } else if v.traits.attachable && (v.attached || v.attach_uncertain) {
                ops.push(Operation::Detach {
                    volume: v.name.clone(),
                });
            }
        }
    }
    ops
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::PathBuf;
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::{Pod, Volume};

    use super::*;
    use crate::names::PodRef;
    use crate::state::*;

    fn pod_ref(n: &str) -> PodRef {
        PodRef {
            namespace: "default".into(),
            name: n.into(),
            uid: PodUid::from(format!("uid-{n}")),
        }
    }

    fn traits(attachable: bool, device_mountable: bool) -> VolumeTraits {
        VolumeTraits {
            plugin: "test/plugin".into(),
            attachable,
            device_mountable,
        }
    }

    fn spec(name: &str) -> Arc<VolumeSpec> {
        Arc::new(VolumeSpec {
            volume: crate::state::PodVolumeRef::from(Volume {
                name: name.into(),
                ..Default::default()
            }),
            persistent_volume: None,
            block: false,
            extensions: Default::default(),
            selinux_label: None,
            selinux_mount: false,
        })
    }

    fn wish(vol: &str, pod: &str, t: VolumeTraits, generation: u64) -> PodVolumeWish {
        PodVolumeWish {
            name: UniqueVolumeName(vol.into()),
            traits: t,
            pod_volume: DesiredPodVolume {
                pod_ref: pod_ref(pod),
                pod: Arc::new(Pod::default()),
                outer_volume_name: "v".into(),
                spec: spec("v"),
                content_generation: generation,
            },
        }
    }

    fn mounted(pod: &str, state: PodMountState, generation: u64) -> MountedPodVolume {
        MountedPodVolume {
            pod_ref: pod_ref(pod),
            outer_volume_name: "v".into(),
            spec: spec("v"),
            state,
            path: PathBuf::from("/x"),
            read_only: false,
            content_generation: generation,
            sub_paths: Vec::new(),
        }
    }

    fn vol(n: &str) -> UniqueVolumeName {
        UniqueVolumeName(n.into())
    }

    /// The kubelet's operation names in `storage_operation_duration_seconds`.
    #[test]
    fn each_operation_has_the_kubelets_metric_name() {
        let (volume, pod) = (vol("v"), PodUid("uid-a".into()));
        let rows = [
            (
                Operation::UnmountVolume {
                    volume: volume.clone(),
                    pod: pod.clone(),
                },
                "volume_unmount",
            ),
            (
                Operation::Attach {
                    volume: volume.clone(),
                },
                "volume_attach",
            ),
            (
                Operation::MountDevice {
                    volume: volume.clone(),
                },
                "volume_mount_device",
            ),
            (
                Operation::MountVolume {
                    volume: volume.clone(),
                    pod,
                    remount: false,
                },
                "volume_mount",
            ),
            (
                Operation::UnmountDevice {
                    volume: volume.clone(),
                },
                "unmount_device",
            ),
            (Operation::Detach { volume }, "volume_detach"),
        ];
        for (op, name) in rows {
            assert_eq!(op.metric_name(), name, "{op:?}");
        }
    }

    /// In cluster mode a node-wide volume waits to be reported in use before it is attached or
    /// staged: one only device-mountable (staged, not attached) as much as an attachable one.
    #[test]
    fn a_device_mountable_volume_waits_to_be_reported_in_use() {
        let mut dsw = DesiredState::default();
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", traits(false, true), 0)],
            BTreeMap::new(),
        );
        let asw = ActualState::default();
        assert!(
            plan(&dsw, &asw, true, true, None).is_empty(),
            "nothing before the report"
        );
        dsw.mark_reported_in_use(&[vol("v1")]);
        assert_eq!(
            plan(&dsw, &asw, true, true, None),
            vec![Operation::MountDevice { volume: vol("v1") }]
        );
    }

    #[test]
    fn wanted_volume_is_mounted() {
        let mut dsw = DesiredState::default();
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", traits(false, false), 0)],
            BTreeMap::new(),
        );
        let ops = plan(&dsw, &ActualState::default(), false, false, None);
        assert_eq!(
            ops,
            vec![Operation::MountVolume {
                volume: vol("v1"),
                pod: PodUid("uid-a".into()),
                remount: false
            }]
        );
    }

    #[test]
    fn a_plan_of_some_volumes_looks_at_those_only() {
        let mut dsw = DesiredState::default();
        let t = traits(false, false);
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", t.clone(), 0), wish("v2", "a", t.clone(), 0)],
            BTreeMap::new(),
        );
        let mut asw = ActualState::default();
        // v3 is mounted for a pod that no longer wants it.
        asw.mark_pod_volume(
            &vol("v3"),
            &t,
            PodUid("uid-b".into()),
            mounted("b", PodMountState::Mounted, 0),
        );
        let only = [vol("v2"), vol("v3")];
        assert_eq!(
            plan(&dsw, &asw, true, false, Some(&only)),
            vec![
                Operation::UnmountVolume {
                    volume: vol("v3"),
                    pod: PodUid("uid-b".into()),
                },
                Operation::MountVolume {
                    volume: vol("v2"),
                    pod: PodUid("uid-a".into()),
                    remount: false
                },
            ]
        );
        assert_eq!(plan(&dsw, &asw, true, false, None).len(), 3, "all of them");
    }

    #[test]
    fn mounted_volume_needs_nothing() {
        let mut dsw = DesiredState::default();
        let t = traits(false, false);
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", t.clone(), 0)],
            BTreeMap::new(),
        );
        let mut asw = ActualState::default();
        asw.mark_pod_volume(
            &vol("v1"),
            &t,
            PodUid("uid-a".into()),
            mounted("a", PodMountState::Mounted, 0),
        );
        assert!(plan(&dsw, &asw, true, false, None).is_empty());
    }

    #[test]
    fn uncertain_volume_is_set_up_again() {
        let mut dsw = DesiredState::default();
        let t = traits(false, false);
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", t.clone(), 0)],
            BTreeMap::new(),
        );
        let mut asw = ActualState::default();
        asw.mark_pod_volume(
            &vol("v1"),
            &t,
            PodUid("uid-a".into()),
            mounted("a", PodMountState::Uncertain, 0),
        );
        assert!(matches!(
            plan(&dsw, &asw, true, false, None)[..],
            [Operation::MountVolume { remount: false, .. }]
        ));
    }

    #[test]
    fn newer_content_generation_remounts() {
        let mut dsw = DesiredState::default();
        let t = traits(false, false);
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", t.clone(), 2)],
            BTreeMap::new(),
        );
        let mut asw = ActualState::default();
        asw.mark_pod_volume(
            &vol("v1"),
            &t,
            PodUid("uid-a".into()),
            mounted("a", PodMountState::Mounted, 1),
        );
        assert!(matches!(
            plan(&dsw, &asw, true, false, None)[..],
            [Operation::MountVolume { remount: true, .. }]
        ));
    }

    #[test]
    fn unwanted_volume_is_unmounted_only_after_sources_synced() {
        let t = traits(false, false);
        let mut asw = ActualState::default();
        asw.mark_pod_volume(
            &vol("v1"),
            &t,
            PodUid("uid-a".into()),
            mounted("a", PodMountState::Uncertain, 0),
        );
        let dsw = DesiredState::default();
        assert!(
            plan(&dsw, &asw, false, false, None).is_empty(),
            "no teardown before sources synced"
        );
        assert_eq!(
            plan(&dsw, &asw, true, false, None),
            vec![Operation::UnmountVolume {
                volume: vol("v1"),
                pod: PodUid("uid-a".into())
            }]
        );
    }

    #[test]
    fn a_held_pods_volumes_are_kept_and_torn_down_once_released() {
        let t = traits(false, false);
        let mut asw = ActualState::default();
        for p in ["a", "b"] {
            asw.mark_pod_volume(
                &vol(&format!("v-{p}")),
                &t,
                PodUid(format!("uid-{p}").into()),
                mounted(p, PodMountState::Mounted, 0),
            );
        }
        let mut dsw = DesiredState::default();
        let held = BTreeMap::from([(PodUid("uid-a".into()), "its file is broken".to_string())]);
        assert_eq!(dsw.set_held(held), vec![PodUid("uid-a".into())]);
        assert_eq!(
            dsw.held(&PodUid("uid-a".into())),
            Some("its file is broken")
        );
        assert_eq!(
            plan(&dsw, &asw, true, false, None),
            vec![Operation::UnmountVolume {
                volume: vol("v-b"),
                pod: PodUid("uid-b".into())
            }],
            "only the pod that is not held"
        );
        assert_eq!(dsw.set_held(BTreeMap::new()), vec![PodUid("uid-a".into())]);
        assert_eq!(plan(&dsw, &asw, true, false, None).len(), 2);
    }

    #[test]
    fn attachable_volume_is_attached_then_staged_then_set_up() {
        let t = traits(true, true);
        let mut dsw = DesiredState::default();
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", t.clone(), 0)],
            BTreeMap::new(),
        );
        let mut asw = ActualState::default();
        assert_eq!(
            plan(&dsw, &asw, true, false, None),
            vec![Operation::Attach { volume: vol("v1") }]
        );
        asw.mark_attached(&vol("v1"), &t, BTreeMap::new(), spec("v1"));
        assert_eq!(
            plan(&dsw, &asw, true, false, None),
            vec![Operation::MountDevice { volume: vol("v1") }]
        );
        asw.mark_device_state(
            &vol("v1"),
            &t,
            DeviceMountState::Mounted,
            Some("/g".into()),
            spec("v1"),
        );
        assert!(matches!(
            plan(&dsw, &asw, true, false, None)[..],
            [Operation::MountVolume { .. }]
        ));
    }

    #[test]
    fn uncertain_attach_is_retried_while_wanted_and_detached_when_not() {
        let t = traits(true, true);
        let mut dsw = DesiredState::default();
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", t.clone(), 0)],
            BTreeMap::new(),
        );
        let mut asw = ActualState::default();
        asw.mark_attach_uncertain(&vol("v1"), &t, spec("v1"));
        assert_eq!(
            plan(&dsw, &asw, true, false, None),
            vec![Operation::Attach { volume: vol("v1") }]
        );
        dsw.remove_pod(&PodUid("uid-a".into()));
        assert!(
            plan(&dsw, &asw, false, false, None).is_empty(),
            "gated until sources synced"
        );
        assert_eq!(
            plan(&dsw, &asw, true, false, None),
            vec![Operation::Detach { volume: vol("v1") }]
        );
        asw.mark_detached(&vol("v1"));
        assert!(asw.volume(&vol("v1")).is_none());
    }

    #[test]
    fn last_pod_gone_unmounts_device_then_detaches() {
        let t = traits(true, true);
        let dsw = DesiredState::default();
        let mut asw = ActualState::default();
        asw.mark_attached(&vol("v1"), &t, BTreeMap::new(), spec("v1"));
        asw.mark_device_state(
            &vol("v1"),
            &t,
            DeviceMountState::Uncertain,
            None,
            spec("v1"),
        );
        asw.mark_pod_volume(
            &vol("v1"),
            &t,
            PodUid("uid-a".into()),
            mounted("a", PodMountState::Mounted, 0),
        );
        assert!(matches!(
            plan(&dsw, &asw, true, false, None)[..],
            [Operation::UnmountVolume { .. }]
        ));
        asw.mark_pod_unmounted(&vol("v1"), &PodUid("uid-a".into()));
        assert_eq!(
            plan(&dsw, &asw, true, false, None),
            vec![Operation::UnmountDevice { volume: vol("v1") }]
        );
        asw.mark_device_state(
            &vol("v1"),
            &t,
            DeviceMountState::NotMounted,
            None,
            spec("v1"),
        );
        assert_eq!(
            plan(&dsw, &asw, true, false, None),
            vec![Operation::Detach { volume: vol("v1") }]
        );
        asw.mark_detached(&vol("v1"));
        assert!(asw.volume(&vol("v1")).is_none());
        assert!(plan(&dsw, &asw, true, false, None).is_empty());
    }

    #[test]
    fn shared_volume_stays_while_another_pod_wants_it() {
        let t = traits(false, true);
        let mut dsw = DesiredState::default();
        dsw.set_pod(
            pod_ref("b"),
            vec![wish("v1", "b", t.clone(), 0)],
            BTreeMap::new(),
        );
        let mut asw = ActualState::default();
        asw.mark_device_state(&vol("v1"), &t, DeviceMountState::Mounted, None, spec("v1"));
        asw.mark_pod_volume(
            &vol("v1"),
            &t,
            PodUid("uid-a".into()),
            mounted("a", PodMountState::Mounted, 0),
        );
        asw.mark_pod_volume(
            &vol("v1"),
            &t,
            PodUid("uid-b".into()),
            mounted("b", PodMountState::Mounted, 0),
        );
        assert_eq!(
            plan(&dsw, &asw, true, false, None),
            vec![Operation::UnmountVolume {
                volume: vol("v1"),
                pod: PodUid("uid-a".into())
            }],
            "pod a is torn down; the device stays for pod b"
        );
    }

    #[test]
    fn pod_volume_removed_from_spec_is_dropped_from_dsw() {
        let t = traits(false, false);
        let mut dsw = DesiredState::default();
        let mut w2 = wish("v2", "a", t.clone(), 0);
        w2.pod_volume.outer_volume_name = "w".into();
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", t.clone(), 0), w2],
            BTreeMap::new(),
        );
        assert_eq!(dsw.volumes().count(), 2);
        dsw.set_pod(pod_ref("a"), vec![wish("v1", "a", t, 0)], BTreeMap::new());
        assert_eq!(dsw.volumes().count(), 1);
        assert!(dsw.remove_pod(&PodUid("uid-a".into())));
        assert_eq!(dsw.volumes().count(), 0);
    }

    #[test]
    fn a_node_wide_volume_waits_to_be_reported_in_use_where_that_is_required() {
        let mut dsw = DesiredState::default();
        dsw.set_pod(
            pod_ref("p"),
            vec![wish("v1", "p", traits(true, true), 0)],
            BTreeMap::new(),
        );
        dsw.set_pod(
            pod_ref("q"),
            vec![wish("v2", "q", traits(false, false), 0)],
            BTreeMap::new(),
        );
        let asw = ActualState::default();
        let ops = plan(&dsw, &asw, true, true, None);
        assert_eq!(ops.len(), 1, "only the per-pod volume: {ops:?}");
        assert!(matches!(&ops[0], Operation::MountVolume { volume, .. } if *volume == vol("v2")));
        dsw.mark_reported_in_use(&[vol("v1")]);
        let ops = plan(&dsw, &asw, true, true, None);
        assert!(
            ops.contains(&Operation::Attach { volume: vol("v1") }),
            "{ops:?}"
        );
        assert!(
            plan(&dsw, &asw, true, false, None).contains(&Operation::Attach { volume: vol("v1") }),
            "standalone: no wait"
        );
    }

    #[test]
    fn reported_in_use_marks_exactly_the_named_volumes() {
        let t = traits(true, false);
        let mut dsw = DesiredState::default();
        let mut w2 = wish("v2", "a", t.clone(), 0);
        w2.pod_volume.outer_volume_name = "w".into();
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("v1", "a", t, 0), w2],
            BTreeMap::new(),
        );
        dsw.mark_reported_in_use(&[vol("v1")]);
        assert!(dsw.volume(&vol("v1")).unwrap().reported_in_use);
        assert!(!dsw.volume(&vol("v2")).unwrap().reported_in_use);
        dsw.mark_reported_in_use(&[vol("v2")]);
        assert!(
            !dsw.volume(&vol("v1")).unwrap().reported_in_use,
            "a mark not repeated is cleared"
        );
        assert!(dsw.volume(&vol("v2")).unwrap().reported_in_use);
    }

    #[test]
    fn the_states_keep_the_names_of_their_node_wide_volumes() {
        let names = |it: &mut dyn Iterator<Item = &UniqueVolumeName>| -> Vec<String> {
            it.map(|n| n.to_string()).collect()
        };
        let mut dsw = DesiredState::default();
        dsw.set_pod(
            pod_ref("a"),
            vec![
                wish("local", "a", traits(false, false), 0),
                wish("staged", "a", traits(false, true), 0),
                wish("attached", "a", traits(true, false), 0),
            ],
            BTreeMap::new(),
        );
        assert_eq!(names(&mut dsw.node_wide_volumes()), ["attached", "staged"]);
        // The pod no longer has one of them, and another pod shares the rest.
        dsw.set_pod(
            pod_ref("a"),
            vec![wish("staged", "a", traits(false, true), 0)],
            BTreeMap::new(),
        );
        dsw.set_pod(
            pod_ref("b"),
            vec![wish("staged", "b", traits(false, true), 0)],
            BTreeMap::new(),
        );
        assert_eq!(names(&mut dsw.node_wide_volumes()), ["staged"]);
        dsw.remove_pod(&PodUid("uid-a".into()));
        assert_eq!(names(&mut dsw.node_wide_volumes()), ["staged"], "b has it");
        dsw.remove_pod(&PodUid("uid-b".into()));
        assert_eq!(dsw.node_wide_volumes().count(), 0);

        let mut asw = ActualState::default();
        let (t, local) = (traits(true, false), traits(false, false));
        asw.mark_attached(&vol("attached"), &t, BTreeMap::new(), spec("v"));
        let uid = PodUid("uid-a".into());
        let m = mounted("a", PodMountState::Mounted, 0);
        asw.mark_pod_volume(&vol("local"), &local, uid.clone(), m.clone());
        asw.mark_pod_volume(&vol("attached"), &t, uid.clone(), m);
        assert_eq!(names(&mut asw.node_wide_volumes()), ["attached"]);
        asw.mark_pod_unmounted(&vol("attached"), &uid);
        assert_eq!(
            names(&mut asw.node_wide_volumes()),
            ["attached"],
            "still attached"
        );
        asw.mark_detached(&vol("attached"));
        assert_eq!(asw.node_wide_volumes().count(), 0);
    }

    #[test]
    fn operation_keys_nest_per_volume() {
        let m = Operation::MountVolume {
            volume: vol("v"),
            pod: PodUid("p".into()),
            remount: false,
        };
        let d = Operation::MountDevice { volume: vol("v") };
        assert_eq!(m.key().volume, d.key().volume);
        assert_eq!(d.key().pod, None);
        assert!(Operation::Detach { volume: vol("v") }.is_teardown());
        assert!(!d.is_teardown());
    }
}
