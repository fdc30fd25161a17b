//! What the daemon finds when it starts again, or when a mount will not let go: a pod deleted
//! while it was down, a pod source missing at start, hung and dead FUSE mounts, a busy volume,
//! a second kubevol on the same root, pod directories it never recorded, a manifest broken at
//! start.

use super::*;

mount_test! {
    fn a_pod_deleted_while_down_is_torn_down_on_return_even_with_a_corrupt_record() {
        let env = Env::new();
        let mut w = World::new(&env, 1);
        for name in ["memory", "csi-a", "csi-b"] {
            let i = index(&w, name);
            w.toggle(&env, i);
        }
        let mut d = Daemon::start(&env, None, &[]);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        d.kill();

        // While down: two pods go, and the record of one of their volumes is cut in half.
        for name in ["memory", "csi-a"] {
            let i = index(&w, name);
            w.toggle(&env, i);
        }
        let memory = &w.pods[index(&w, "memory")];
        let record = env.root().join("volume-record").join(kubevol::record::JOURNAL);
        let text = std::fs::read_to_string(&record).unwrap();
        let cut: Vec<String> = text
            .lines()
            .map(|l| {
                if l.contains(&memory.uid) && l.contains("\"volume\":\"cache\"") {
                    l[..l.len() / 2].to_string()
                } else {
                    l.to_string()
                }
            })
            .collect();
        assert_ne!(cut.join("\n") + "\n", text, "the emptyDir's record lines");
        // A whole line after them (a removal of nothing), so that they are not a write cut short.
        let after = r#"{"removePodVolume":{"pod":"none","unique":"none"}}"#;
        let torn = r#"{"podVolume":{"version":1,"pod":{"namespace":"default","name":"gone","uid":"00000000-0000-4000-8000-0000000000aa"},"#;
        std::fs::write(&record, cut.join("\n") + "\n" + torn + "\n" + after + "\n").unwrap();
        // A gone pod's directory with a file of someone else's in it: kept and reported. Its
        // record is a line that cannot be read, which still names it as kubevol's.
        let orphan = env.root().join("pods/00000000-0000-4000-8000-0000000000aa");
        std::fs::create_dir_all(orphan.join("volumes")).unwrap();
        std::fs::write(orphan.join("notes.txt"), "not kubevol's\n").unwrap();

        let d = Daemon::start(&env, None, &[]);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        let s = d.status().unwrap();
        let problems = s["reconstruction"]["problems"].to_string();
        assert!(
            problems.contains(&record.display().to_string()) && problems.contains("possibly mounted"),
            "the corrupt record is reported: {problems}"
        );
        assert!(s["reconstruction"]["from_layout"].as_u64().unwrap() >= 1, "{s}");
        wait_status(&d, 120, "the orphan's leftover is reported", |s| {
            s["leftovers"].to_string().contains("notes.txt")
        });
        assert_eq!(
            std::fs::read_to_string(orphan.join("notes.txt")).unwrap(),
            "not kubevol's\n",
            "never force-deleted"
        );
        assert!(!orphan.join("volumes").exists(), "its empty directories are removed");
        let metrics = d.get("/metrics").unwrap().1;
        assert!(
            metrics.contains("kubelet_orphan_pod_cleaned_volumes_errors 1"),
            "{metrics}"
        );
        let calls = env.driver.calls();
        let unpublished = calls
            .iter()
            .any(|c| c.0 == "NodeUnpublishVolume" && c.1 == "pv-a" && c.3 == "Ok");
        assert!(unpublished, "the deleted pod's claim was unpublished");
        // Its claim comes back with another pod: the canary written before is still there.
        let i = index(&w, "csi-a2");
        w.toggle(&env, i);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
    }
}

mount_test! {
    fn a_pod_source_missing_for_a_minute_at_start_unmounts_nothing() {
        let env = Env::new();
        let mut w = World::new(&env, 1);
        for name in ["memory", "csi-a", "disk", "host"] {
            let i = index(&w, name);
            w.toggle(&env, i);
        }
        let mut d = Daemon::start(&env, None, &[]);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        let before = mount_ids(&env.root());
        d.kill();

        let away = env.tmp.path().join("manifests.away");
        std::fs::rename(env.manifests(), &away).unwrap();
        let d = Daemon::start(&env, None, &[]);
        let outage = Instant::now();
        while outage.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_secs(1));
            assert_eq!(mount_ids(&env.root()), before, "nothing is unmounted or remounted while the source is missing");
            if let Some((code, _)) = d.get("/readyz") {
                assert_eq!(code, 503, "not ready before the source is listed");
            }
        }
        let s = d.status().expect("the daemon serves its status while it waits");
        assert_eq!(s["states_synced"], false);
        assert!(
            std::fs::read_to_string(&d.log).unwrap().contains("cannot read the manifest directory"),
            "the wait is logged"
        );
        std::fs::rename(&away, env.manifests()).unwrap();
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        assert_eq!(mount_ids(&env.root()), before, "the same mounts: set up again without a second mount");
        assert_eq!(d.get("/readyz").map(|r| r.0), Some(200));
    }
}

mount_test! {
    fn hung_fuse_mounts_stall_only_their_own_pod_and_dead_ones_are_unmounted() {
        let env = Env::new();
        let mut w = World::new(&env, 1);
        let hung = env.tmp.path().join("hung");
        std::fs::create_dir_all(&hung).unwrap();
        let hung_fd = hung_fuse_mount(&hung);
        env.write(
            "stuck.yaml",
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: stuck, namespace: default, uid: 00000000-0000-4000-8000-0000000000ff}}\n\
                 spec: {{containers: [{{name: c, volumeMounts: [{{name: data, mountPath: /data}}]}}], volumes: [{{name: data, hostPath: {{path: {}, type: Directory}}}}]}}\n",
                hung.display()
            ),
        );
        let i = index(&w, "memory");
        w.toggle(&env, i);
        let mut d = Daemon::start(&env, None, &["--operation-timeout", "2s"]);
        // The pod on the hung filesystem says so; the other one mounts meanwhile.
        wait_status(&d, 60, "memory ready while stuck stalls", |s| {
            let ready = status_of(s, "memory").is_some_and(|p| p["phase"] == "Ready");
            let stalled = status_of(s, "stuck").is_some_and(|p| {
                p["volumes"][0]["last_error"]
                    .as_str()
                    .is_some_and(|e| e.contains("has not finished after"))
            });
            ready && stalled
        });
        let memory = &w.pods[i];
        let cache = env
            .root()
            .join("pods")
            .join(&memory.uid)
            .join("volumes/kubernetes.io~empty-dir/cache");
        std::fs::write(cache.join("canary"), "in memory\n").unwrap();
        // A thread is blocked in the hung filesystem: the stop does not wait for it.
        let took = d.terminate();
        assert!(took < Duration::from_secs(120), "SIGTERM took {took:?} with a blocked thread");

        // Down: a hung mount lands on the memory volume too, and another pod arrives.
        let stacked_fd = hung_fuse_mount(&cache);
        let j = index(&w, "disk");
        w.toggle(&env, j);
        let d = Daemon::start(&env, None, &["--operation-timeout", "2s"]);
        wait_status(&d, 60, "the new pod is ready while memory's volume hangs", |s| {
            status_of(s, "disk").is_some_and(|p| p["phase"] == "Ready")
                && s["states_synced"] == true
        });
        // The filesystems die: the stacked dead mount is removed, the tmpfs below kept.
        drop(stacked_fd);
        drop(hung_fd);
        wait_status(&d, 60, "stuck fails with the dead mount's error", |s| {
            status_of(s, "stuck").is_some_and(|p| {
                p["volumes"][0]["last_error"]
                    .as_str()
                    .is_some_and(|e| e.contains("not connected"))
            })
        });
        env.remove("stuck.yaml");
        {
            use kubevol_mount::Mounter;
            kubevol_mount::LinuxMounter.unmount(&hung).unwrap();
        }
        converge(&env, &d, &w, 60);
        assert_eq!(
            std::fs::read_to_string(cache.join("canary")).unwrap(),
            "in memory\n",
            "the memory volume under the dead mount kept its content"
        );
        // A dead mount over a volume whose pod is deleted: unmounted with it.
        let dead = hung_fuse_mount(&cache);
        drop(dead);
        w.toggle(&env, i);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
    }
}

/// The storm's "memory" pod, ready under a daemon started with `extra`, with a file `work`
/// in its memory emptyDir: (world, the pod's index, daemon, the volume's path).
fn memory_pod_with_work(env: &Env, extra: &[&str]) -> (World, usize, Daemon, PathBuf) {
    let mut w = World::new(env, 1);
    let i = index(&w, "memory");
    w.toggle(env, i);
    let d = Daemon::start(env, None, extra);
    converge(env, &d, &w, 60);
    let cache = env
        .root()
        .join("pods")
        .join(&w.pods[i].uid)
        .join("volumes/kubernetes.io~empty-dir/cache");
    std::fs::write(cache.join("work"), "unsaved\n").unwrap();
    (w, i, d, cache)
}

mount_test! {
    fn a_busy_volume_is_retried_with_the_reason_shown_and_never_lazily_detached() {
        let env = Env::new();
        let (mut w, i, d, cache) = memory_pod_with_work(&env, &[]);
        // Without the test's pipes: a failed test is not held until it ends.
        let mut holder = Command::new("sleep")
            .arg("600")
            .current_dir(&cache)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        w.toggle(&env, i);
        wait_status(&d, 60, "the busy unmount is shown", |s| {
            status_of(s, "memory").is_some_and(|p| {
                p["phase"] == "Terminating"
                    && p["volumes"]
                        .to_string()
                        .contains("target is busy: held by pid")
            })
        });
        assert!(
            actual_mounts(&env.root()).contains(&cache),
            "still mounted: no lazy unmount without --allow-lazy-unmount"
        );
        assert_eq!(std::fs::read_to_string(cache.join("work")).unwrap(), "unsaved\n");
        let _ = holder.kill();
        let _ = holder.wait();
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
    }
}

mount_test! {
    fn allow_lazy_unmount_detaches_a_busy_volume_and_the_holder_keeps_its_files() {
        let env = Env::new();
        let (mut w, i, d, cache) = memory_pod_with_work(&env, &["--allow-lazy-unmount"]);
        // The holder reads its file through its working directory once the pod is gone.
        let mut holder = Command::new("sh")
            .args(["-c", "read _; cat work"])
            .current_dir(&cache)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        w.toggle(&env, i);
        converge(&env, &d, &w, 60);
        assert!(
            std::fs::read_to_string(&d.log).unwrap().contains("detaching it lazily"),
            "the lazy detach is logged"
        );
        holder.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let mut out = String::new();
        holder.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        let _ = holder.wait();
        assert_eq!(out, "unsaved\n", "the detached tmpfs lives on for its last user");
        check_invariants(&env, &mut w);
    }
}

/// `kubevol ARGS` on the test's root with an empty manifest directory, to its end: (success,
/// stdout, stderr).
fn kubevol_on_root(env: &Env, args: &[&str]) -> (bool, String, String) {
    let empty = env.tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let port = free_port();
    let out = Command::new(BIN)
        .args(["run", "--manifests"])
        .arg(&empty)
        .arg("--root-dir")
        .arg(env.root())
        .args(["--node-name", "test-node", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

mount_test! {
    fn a_second_kubevol_on_the_same_root_refuses_and_changes_nothing() {
        let env = Env::new();
        let (mut w, i, mut d, cache) = memory_pod_with_work(&env, &[]);
        let pid = d.child.as_ref().unwrap().id();
        let lock = env.root().join(kubevol::record::LOCK_FILE);
        // The record and the bindings, byte for byte, once the first has nothing left to do.
        converge(&env, &d, &w, 60);
        let record = |root: &Path| -> BTreeMap<PathBuf, Vec<u8>> {
            let mut out = BTreeMap::new();
            let mut todo = vec![root.join(kubevol::record::RECORD_DIR)];
            while let Some(dir) = todo.pop() {
                for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                    let path = e.path();
                    if e.file_type().unwrap().is_dir() {
                        todo.push(path);
                    } else {
                        out.insert(path.clone(), std::fs::read(&path).unwrap());
                    }
                }
            }
            out
        };
        let before = record(&env.root());
        assert!(!before.is_empty(), "the first wrote its record");
        for extra in [&[][..], &["--once", "--timeout", "120s"][..]] {
            let (ok, _, stderr) = kubevol_on_root(&env, extra);
            assert!(!ok, "{extra:?} must refuse: {stderr}");
            assert!(
                stderr.contains(&format!("in use by process {pid}"))
                    && stderr.contains(&lock.display().to_string())
                    && stderr.contains(&env.root().display().to_string()),
                "{extra:?}: the root, the lock and the holder are named: {stderr}"
            );
        }
        assert!(record(&env.root()) == before, "the second wrote nothing of the record or the bindings");
        assert_eq!(std::fs::read_to_string(cache.join("work")).unwrap(), "unsaved\n");
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        // The lock goes with its holder however it ends.
        d.kill();
        let (ok, stdout, stderr) = kubevol_on_root(&env, &["--once", "--timeout", "120s"]);
        assert!(ok, "the root is free once its owner is gone: {stdout}\n{stderr}");
        let _ = i;
    }
}

mount_test! {
    fn pod_directories_kubevol_never_recorded_are_left_alone_unless_adopted() {
        let env = Env::new();
        let (mut w, i, mut d, _) = memory_pod_with_work(&env, &[]);
        d.kill();
        // While down: the pod is removed, and someone else's pod appears under the root, with a
        // mounted volume holding data.
        w.toggle(&env, i);
        let foreign = env.root().join("pods/00000000-0000-4000-8000-0000000000fe");
        let volume = foreign.join("volumes/kubernetes.io~empty-dir/data");
        std::fs::create_dir_all(&volume).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "tmpfs"])
            .arg(&volume)
            .status()
            .unwrap();
        assert!(st.success());
        std::fs::write(volume.join("db"), "someone else's\n").unwrap();

        let d = Daemon::start(&env, None, &[]);
        // Kubevol's own gone pod is torn down and swept; the foreign one is reported.
        let own = env.root().join("pods").join(&w.pods[i].uid);
        let s = wait_status(&d, 60, "the own pod is swept, the foreign one reported", |s| {
            s["states_synced"] == true
                && s["pods"] == serde_json::json!([])
                && !own.exists()
                && s["reconstruction"]["foreign_pods"]
                    .to_string()
                    .contains("0000000000fe")
        });
        assert!(
            s["reconstruction"]["foreign_pods"].to_string().contains("kubernetes.io/empty-dir/data"),
            "{s}"
        );
        assert!(actual_mounts(&env.root()).contains(&volume), "its mount stays");
        assert_eq!(std::fs::read_to_string(volume.join("db")).unwrap(), "someone else's\n");
        assert!(
            std::fs::read_to_string(&d.log).unwrap().contains("--adopt-foreign-pods"),
            "the log says how to adopt them"
        );
        let out = Command::new(BIN)
            .args(["status", "--server", &format!("http://127.0.0.1:{}", d.port)])
            .output()
            .unwrap();
        let table = String::from_utf8_lossy(&out.stdout);
        assert!(
            table.contains("Foreign pod directories") && table.contains(&foreign.display().to_string()),
            "{table}"
        );
        drop(d);

        // Adopted: it is kubevol's to tear down.
        let d = Daemon::start(&env, None, &["--adopt-foreign-pods"]);
        wait_status(&d, 60, "the adopted pod is torn down", |_| !foreign.exists());
        assert!(!actual_mounts(&env.root()).contains(&volume));
        let s = d.status().unwrap();
        assert_eq!(s["reconstruction"]["foreign_pods"], serde_json::json!([]), "{s}");
    }
}

mount_test! {
    fn a_pod_whose_manifest_is_broken_at_start_keeps_its_volumes_until_the_file_is_fixed() {
        let env = Env::new();
        let (mut w, i, mut d, cache) = memory_pod_with_work(&env, &[]);
        let j = index(&w, "disk");
        w.toggle(&env, j);
        converge(&env, &d, &w, 60);
        d.kill();
        // While down, the memory pod's file is left half-saved.
        let file = env.manifests().join("memory.yaml");
        let text = std::fs::read_to_string(&file).unwrap();
        std::fs::write(&file, &text[..text.len() / 2]).unwrap();

        let d = Daemon::start(&env, None, &[]);
        let s = wait_status(&d, 60, "the pod is held", |s| {
            s["states_synced"] == true
                && status_of(s, "memory").is_some_and(|p| p["phase"] == "Held")
                && status_of(s, "disk").is_some_and(|p| p["phase"] == "Ready")
        });
        let memory = status_of(&s, "memory").unwrap();
        assert!(
            memory["errors"].to_string().contains("memory.yaml has errors"),
            "it says why: {memory}"
        );
        for v in memory["volumes"].as_array().unwrap() {
            // Found at start, and neither set up again nor torn down while held.
            assert!(v["state"] == "Uncertain" || v["state"] == "Mounted", "{v}");
        }
        assert!(actual_mounts(&env.root()).contains(&cache), "still mounted");
        assert_eq!(std::fs::read_to_string(cache.join("work")).unwrap(), "unsaved\n");
        // Fixed: the pod is back, with its data.
        std::fs::write(&file, &text).unwrap();
        converge(&env, &d, &w, 60);
        assert_eq!(std::fs::read_to_string(cache.join("work")).unwrap(), "unsaved\n");
        let _ = i;
    }
}
