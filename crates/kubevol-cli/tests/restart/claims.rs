//! SIGKILL while claims are bound, volumes provisioned and reclaimed: the bindings on disk are
//! the old ones or the new, never half, and no volume's data is lost or given to another claim.

use super::*;

/// kubevol's bindings in `root`, claim to volume, as on disk.
fn bindings_on_disk(root: &Path) -> BTreeMap<String, String> {
    let path = root
        .join(kubevol::record::RECORD_DIR)
        .join(kubevol::store::BINDINGS_FILE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return BTreeMap::new();
    };
    let v: serde_json::Value = serde_json::from_str(&text).expect("the bindings file is whole");
    v["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                format!(
                    "{}/{}",
                    b["namespace"].as_str().unwrap(),
                    b["claim"].as_str().unwrap()
                ),
                b["volume"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// A claim of 100Mi (of class `manual`, or else the default class) and a pod of the same name
/// that mounts it.
fn bound_claim_and_pod(name: &str, manual: bool) -> String {
    let class = if manual {
        "storageClassName: manual, "
    } else {
        ""
    };
    format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {name}}}\nspec: {{{class}accessModes: [ReadWriteOnce], resources: {{requests: {{storage: 100Mi}}}}}}\n---\n\
         apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  containers: [{{name: c, image: busybox, volumeMounts: [{{name: data, mountPath: /data}}]}}]\n  volumes: [{{name: data, persistentVolumeClaim: {{claimName: {name}}}}}]\n"
    )
}

mount_test! {
    /// Binding under SIGKILL: killed before a binding is on disk, the claim is unbound after
    /// the restart and bound then; killed after, it keeps that volume. Then claims are bound
    /// while the daemon is killed at random: after the last restart every binding ever on
    /// disk is unchanged, no volume has two claims, and each pod's volume is the one its claim
    /// is bound to (a file written through the pod lands in that volume's directory).
    fn sigkill_while_claims_are_bound_leaves_the_old_bindings_or_the_new() {
        let env = Env::new();
        let pool: String = (0..8)
            .map(|i| {
                format!(
                    "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: pool-{i}}}\nspec: {{storageClassName: manual, capacity: {{storage: {}Mi}}, accessModes: [ReadWriteOnce], hostPath: {{path: {}, type: DirectoryOrCreate}}}}\n---\n",
                    100 + 10 * i,
                    env.host().join(format!("pool-{i}")).display()
                )
            })
            .collect();
        env.write("pool.yaml", &pool);
        let root = env.root();
        // Killed before a binding reaches the disk, nothing is bound; after, the one binding
        // made (of whichever claim the binder took first) is there, and what was is unchanged.
        let mut before = bindings_on_disk(&root);
        for (claim, point) in [("first", "bind:before"), ("second", "bind:after")] {
            env.write(&format!("{claim}.yaml"), &bound_claim_and_pod(claim, true));
            die_at(&env, point);
            let on_disk = bindings_on_disk(&root);
            match point {
                "bind:before" => assert_eq!(on_disk, before),
                _ => {
                    assert_eq!(on_disk.len(), before.len() + 1, "{on_disk:?}");
                    assert!(before.iter().all(|(k, v)| on_disk.get(k) == Some(v)), "{on_disk:?}");
                }
            }
            before = on_disk;
        }
        let named = bindings_on_disk(&root);
        let mut rng = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos() as u64
            | 1;
        let mut random = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut claims = vec!["first".to_string(), "second".to_string()];
        for round in 0..random_kills() {
            let name = format!("r{round}");
            env.write(&format!("{name}.yaml"), &bound_claim_and_pod(&name, true));
            claims.push(name);
            let mut d = Daemon::start(&env, None, &[]);
            std::thread::sleep(Duration::from_millis(50 + random(400)));
            d.kill();
            let now = bindings_on_disk(&root);
            for (claim, volume) in &named {
                assert_eq!(now.get(claim), Some(volume), "a binding moved");
            }
        }
        // The last daemon runs until every claim that a volume is left for is mounted.
        let d = Daemon::start(&env, None, &[]);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mounted = loop {
            let status = d.status();
            let paths: BTreeMap<String, String> = status
                .iter()
                .flat_map(|s| s["pods"].as_array().cloned().unwrap_or_default())
                .filter(|p| p["volumes"][0]["state"] == "Mounted")
                .map(|p| (format!("default/{}", p["name"].as_str().unwrap()), p["volumes"][0]["path"].as_str().unwrap().to_string()))
                .collect();
            if paths.len() == claims.len().min(8) {
                break paths;
            }
            assert!(Instant::now() < deadline, "not converged: {status:#?}\n{}", d.log_tail());
            std::thread::sleep(Duration::from_millis(50));
        };
        let bound = bindings_on_disk(&root);
        for (claim, volume) in &named {
            assert_eq!(bound.get(claim), Some(volume), "a binding moved");
        }
        let volumes: BTreeSet<&String> = bound.values().collect();
        assert_eq!(volumes.len(), bound.len(), "a volume with two claims: {bound:?}");
        for (claim, path) in &mounted {
            let volume = &bound[claim];
            std::fs::write(Path::new(path).join("canary"), claim).unwrap();
            assert_eq!(
                std::fs::read_to_string(env.host().join(volume).join("canary")).unwrap(),
                *claim,
                "the pod of {claim} uses {volume}"
            );
        }
        eprintln!("{} claims, {} bound: {bound:?}", claims.len(), bound.len());
    }
}

/// Runs a daemon armed with fail point `point` until it dies there.
fn die_at(env: &Env, point: &str) {
    let mut d = Daemon::start(env, Some(point), &[]);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !d.exited() {
        assert!(
            Instant::now() < deadline,
            "{point} not reached:\n{}",
            d.log_tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = std::fs::read_to_string(&d.log).unwrap_or_default();
    assert!(
        log.contains(&format!("fail point {point} reached")),
        "{}",
        d.log_tail()
    );
}

/// Waits until `ready` holds of the daemon's status; panics after 60 s.
fn until_status(
    d: &Daemon,
    what: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = d.status().filter(|s| ready(s)) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within 60 s: {:#?}\n{}",
            d.status(),
            d.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The path of pod `name`'s first volume once it is mounted.
fn mounted_path(status: &serde_json::Value, name: &str) -> Option<PathBuf> {
    status["pods"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)
        .filter(|p| p["volumes"][0]["state"] == "Mounted")
        .and_then(|p| p["volumes"][0]["path"].as_str())
        .map(PathBuf::from)
}

mount_test! {
    /// Provisioning and reclaiming under SIGKILL. Killed before a provisioned volume is on
    /// disk and after; before a removed claim's volume is deleted and after: each restart
    /// converges, the volumes of present claims keep their data, a deleted one leaves no
    /// directory and no record, and nothing else under the local-path directory is touched.
    fn sigkill_while_volumes_are_provisioned_and_reclaimed_loses_nothing() {
        let env = Env::new();
        let claim = |name: &str| bound_claim_and_pod(name, false);
        for (name, point) in [("p1", "bind:before"), ("p2", "bind:after")] {
            env.write(&format!("{name}.yaml"), &claim(name));
            die_at(&env, point);
        }
        let local = env.root().join("local-path");
        std::fs::create_dir_all(&local).unwrap();
        std::fs::write(local.join("not-a-volume"), "someone else's").unwrap();
        let d = Daemon::start(&env, None, &[]);
        let s = until_status(&d, "both provisioned and mounted", |s| mounted_path(s, "p1").is_some() && mounted_path(s, "p2").is_some());
        for name in ["p1", "p2"] {
            std::fs::write(mounted_path(&s, name).unwrap().join("canary"), name).unwrap();
        }
        drop(d);
        let provisioned = || {
            let text = std::fs::read_to_string(env.root().join(kubevol::record::RECORD_DIR).join(kubevol::store::BINDINGS_FILE)).unwrap();
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            v["provisioned"].as_array().unwrap().len()
        };
        assert_eq!(provisioned(), 2);
        let dirs = || {
            // (Without the directory's lock file, `.kubevol.lock`.)
            let mut d: Vec<String> = std::fs::read_dir(&local).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n != kubevol::record::LOCAL_PATH_LOCK_FILE).collect();
            d.sort();
            d
        };
        assert_eq!(dirs().len(), 3, "{:?}", dirs());

        // p1 removed: killed before its directory goes, then after.
        env.remove("p1.yaml");
        die_at(&env, "reclaim:before");
        assert_eq!(dirs().len(), 3, "nothing removed yet");
        let p2 = dirs().into_iter().find(|d| d.ends_with("_default_p2")).unwrap();
        assert_eq!(std::fs::read_to_string(local.join(&p2).join("canary")).unwrap(), "p2", "a present claim's data");
        env.remove("p2.yaml");
        die_at(&env, "reclaim:after");
        let d = Daemon::start(&env, None, &[]);
        until_status(&d, "both deleted", |s| s["pods"].as_array().is_some_and(|p| p.is_empty()) && s.get("bindings").is_none_or(|b| b.as_array().is_some_and(|b| b.is_empty())));
        let deadline = Instant::now() + Duration::from_secs(120);
        while dirs() != ["not-a-volume"] || provisioned() != 0 {
            assert!(Instant::now() < deadline, "{:?} {}\n{}", dirs(), provisioned(), d.log_tail());
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(std::fs::read_to_string(local.join("not-a-volume")).unwrap(), "someone else's");
    }
}
