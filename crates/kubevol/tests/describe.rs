//! `describe`: each step of a volume's chain, the step a volume is stuck on with what to do,
//! and the node's summary. Each test runs in its own private mount namespace.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use kubevol::describe::StepState;
use kubevol::store::Object;
use serde_json::json;

fn object(v: serde_json::Value) -> Object {
    match v["kind"].as_str().unwrap() {
        "ConfigMap" => Object::ConfigMap(serde_json::from_value(v).unwrap()),
        "PersistentVolume" => Object::PersistentVolume(serde_json::from_value(v).unwrap()),
        "PersistentVolumeClaim" => {
            Object::PersistentVolumeClaim(serde_json::from_value(v).unwrap())
        }
        k => panic!("{k}"),
    }
}

mount_test! {
    fn each_step_of_a_chain_says_where_it_stands_and_what_to_do() {
        let root = TestRoot::new();
        let data = root.path().join("disk");
        std::fs::create_dir_all(&data).unwrap();
        runtime().block_on(async {
            let m = manager(root.path(), |c| {
                c.node_labels.insert("zone".into(), "a".into());
            });
            let p = common::pod(json!({
                "metadata": {"name": "app", "namespace": "default"},
                "spec": {"securityContext": {"fsGroup": 1000},
                         "containers": [{"name": "c", "volumeMounts": [
                            {"name": "config", "mountPath": "/c"},
                            {"name": "scratch", "mountPath": "/s"},
                            {"name": "here", "mountPath": "/h"},
                            {"name": "there", "mountPath": "/t"},
                            {"name": "unbound", "mountPath": "/u"}]}],
                         "volumes": [
                            {"name": "config", "configMap": {"name": "settings"}},
                            {"name": "scratch", "emptyDir": {}},
                            {"name": "here", "persistentVolumeClaim": {"claimName": "here"}},
                            {"name": "there", "persistentVolumeClaim": {"claimName": "there"}},
                            {"name": "unbound", "persistentVolumeClaim": {"claimName": "unbound"}}]},
            }));
            let pv = |name: &str, zone: &str| object(json!({
                "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                         "hostPath": {"path": data, "type": "Directory"},
                         "claimRef": {"namespace": "default", "name": name},
                         "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                            {"key": "zone", "operator": "In", "values": [zone]}]}]}}}}));
            let claim = |name: &str, bound: bool| object(json!({
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"accessModes": ["ReadWriteOnce"], "volumeName": if bound { name } else { "" },
                         "storageClassName": "", "resources": {"requests": {"storage": "1Gi"}}},
                "status": {"phase": if bound { "Bound" } else { "Pending" }}}));
            m.library().upsert_objects([
                pv("here", "a"),
                pv("there", "b"),
                claim("here", true),
                claim("there", true),
                claim("unbound", false),
            ]);
            let uid = m.add_pod(p.clone());
            wait_for_status(&m, &p, 120, |s| {
                s.volumes.iter().filter(|v| v.name == "scratch" || v.name == "here").all(|v| v.state == kubevol::status::VolumePhase::Mounted)
            })
            .await;
            // The binder has looked at the unbound claim (and found no volume for it): until it
            // has, the claim's step is waiting for that look.
            storage_decided(&m).await;
            // A set-up's success is noted as its operation is concluded, a moment after the
            // volume shows mounted: looked at until it is.
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            let d = loop {
                let d = m.describe_pod(&uid).expect("described");
                let noted = d.chains.iter().any(|c| c.volume == "scratch" && c.steps[0].detail.contains("(set up or written "));
                if noted || std::time::Instant::now() > deadline {
                    break d;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert_eq!(m.find_pod("default", "app"), Some(uid.clone()));
            let chain = |name: &str| d.chains.iter().find(|c| c.volume == name).unwrap().clone();

            let scratch = chain("scratch");
            assert!(scratch.ready && scratch.waiting_for.is_none(), "{scratch:?}");
            let steps: Vec<(&str, StepState, &str)> = scratch.steps.iter().map(|s| (s.step.as_str(), s.state, s.detail.as_str())).collect();
            assert_eq!(steps[1], ("fsGroup", StepState::Done, "fsGroup 1000: applied by kubevol at set-up"), "{steps:?}");
            assert_eq!((steps[0].0, steps[0].1), ("set up", StepState::Done));
            assert!(steps[0].2.ends_with("s ago)") && steps[0].2.contains("(set up or written "), "{steps:?}");

            let config = chain("config");
            assert!(!config.ready);
            assert_eq!(config.steps[0].step, "ConfigMap default/settings");
            assert_eq!(config.steps[0].state, StepState::Waiting);
            let why = config.waiting_for.clone().unwrap();
            assert!(why.starts_with("ConfigMap default/settings: ") && why.contains("does not exist"), "{why}");

            let here = chain("here");
            assert!(here.ready, "{here:?}");
            let steps: Vec<(&str, StepState)> = here.steps.iter().map(|s| (s.step.as_str(), s.state)).collect();
            assert_eq!(steps, [("claim default/here", StepState::Done), ("PersistentVolume here", StepState::Done), ("set up", StepState::Done), ("fsGroup", StepState::Done)]);
            assert!(here.steps[3].detail.contains("not applied to this type"), "{:?}", here.steps[3]);
            assert!(here.steps[1].detail.contains("hostPath, access modes ReadWriteOnce, capacity 1Gi, nodeAffinity (zone in (a)) (this node matches)"), "{:?}", here.steps[1]);

            let there = chain("there");
            assert!(!there.ready);
            assert_eq!(there.steps[1].state, StepState::Failed);
            assert!(there.steps[1].detail.contains("this node does not match"), "{there:?}");

            // In standalone mode nothing else binds it: it fails until the manifests change.
            let unbound = chain("unbound");
            assert_eq!(unbound.steps[0].state, StepState::Failed, "{unbound:?}");
            let why = unbound.waiting_for.unwrap();
            assert!(why.starts_with("claim default/unbound: PersistentVolumeClaim default/unbound"), "{why}");

            // The ConfigMap appears: its step is done, and so is the volume.
            m.library().upsert_objects([object(json!({
                "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings", "namespace": "default"},
                "data": {"a": "b"}}))]);
            wait_for_status(&m, &p, 120, |s| s.volumes.iter().any(|v| v.name == "config" && v.state == kubevol::status::VolumePhase::Mounted)).await;
            let d = m.describe_pod(&uid).unwrap();
            let config = d.chains.iter().find(|c| c.volume == "config").unwrap();
            assert!(config.ready && config.steps[0].state == StepState::Done, "{config:?}");
            assert_eq!(config.steps[0].detail, "present (from library API)");
            assert_eq!(config.steps.last().unwrap().detail, "fsGroup 1000: the files are written with group 1000");

            let node = m.describe_node();
            assert!(node.not_ready.iter().any(|l| l.starts_with("default/app volume there: ")), "{:?}", node.not_ready);
            assert!(node.pods_by_phase.iter().any(|(p, n)| p == "Failed" && *n == 1), "{:?}", node.pods_by_phase);
            assert!(node.sources.iter().any(|(s, synced)| s == "api" && *synced), "{:?}", node.sources);
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("torn down");
            m.shutdown();
        });
    }
}

mount_test! {
    fn a_stuck_teardown_is_described_with_its_holder() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |c| {
                c.backoff.initial = Duration::from_secs(600);
                c.backoff.max = Duration::from_secs(600);
            });
            let (p, uid, path, holder, _) = busy_memory_pod(&m).await;
            let d = m.describe_pod(&uid).unwrap();
            let chain = &d.chains[0];
            let last = chain.steps.last().unwrap();
            assert_eq!((last.step.as_str(), last.state), ("tear down", StepState::Failed), "{chain:?}");
            let why = chain.waiting_for.clone().unwrap();
            assert!(why.starts_with("tear down: ") && why.contains(&format!("held by pid {} (sleep, cwd {})", holder.pid(), path.display())), "{why}");
            holder.release();
            m.wait_for_unmount(&p).await.expect("torn down once the holder is gone");
            m.shutdown();
        });
    }
}
