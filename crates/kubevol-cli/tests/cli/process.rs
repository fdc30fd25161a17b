//! The daemon as a process: it serves status and metrics and stops cleanly on SIGTERM and SIGHUP,
//! survives closed and full pipes and a flood of half-sent requests, and its help says what it
//! is.

use super::*;

mount_test! {
    fn the_daemon_serves_status_and_metrics_and_stops_cleanly_on_sigterm() {
        require_root();
        let root = tempfile::tempdir().unwrap();
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let server = format!("http://{listen}");
        let manifests = examples_without_csi();
        let mut child = daemon(manifests.path(), root.path(), &listen)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        // The log's lines, read on a thread of their own: a line that never comes fails the
        // test after a while instead of holding it for ever.
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut lines = std::iter::from_fn(|| rx.recv_timeout(Duration::from_secs(120)).ok());
        let mut synced = false;
        let mut serving = false;
        let mut mounted = 0;
        for line in lines.by_ref() {
            synced |= line.contains("reconciler states synced");
            serving |= line.contains("serving /healthz");
            // One line a pod at info once all its volumes are mounted (each volume's at debug).
            mounted += usize::from(line.contains("every volume of the pod is mounted"));
            if synced && serving && mounted == 4 {
                break;
            }
        }
        assert!(synced && serving && mounted == 4, "daemon did not come up");

        let table = status(&server, &[]);
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("default/web") && l.contains("cache") && l.contains("Mounted")),
            "{table}"
        );
        // A reader that stops reading (`kubevol status | head -3`) ends it quietly.
        let mut closed = Command::new(BIN)
            .args(["status", "--server", &server, "-o", "wide"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(closed.stdout.take());
        let out = closed.wait_with_output().unwrap();
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "{:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let wide = status(&server, &["-o", "wide"]);
        assert!(
            wide.contains("Events of default/web") && wide.contains("SuccessfulMountVolume"),
            "{wide}"
        );
        let json: serde_json::Value = serde_json::from_str(&status(&server, &["-o", "json"])).unwrap();
        assert_eq!(json["states_synced"], true);
        assert_eq!(json["pods"].as_array().unwrap().len(), 4);

        let get = |path: &str| http_get(port, path);
        // An operation's duration is observed as its batch concludes, a moment after its success
        // is logged: the metrics are read until they hold it.
        let wanted = [
            "volume_manager_total_volumes{plugin_name=\"kubernetes.io/empty-dir\",state=\"actual_state_of_world\"} 5",
            "volume_manager_total_volumes{plugin_name=\"kubernetes.io/configmap\",state=\"actual_state_of_world\"} 1",
            "storage_operation_duration_seconds_count{volume_plugin=\"kubernetes.io/host-path\",operation_name=\"volume_mount\",status=\"success\",migrated=\"false\"} 3",
            "volume_operation_total_seconds_count{plugin_name=\"kubernetes.io/host-path\",operation_name=\"overall_volume_mount\"} 3",
            "kubevol_pod_volumes_ready_duration_seconds_count 4",
        ];
        until_http(port, "/metrics", |metrics| {
            wanted.iter().all(|w| metrics.contains(w))
        });
        assert!(
            get("/readyz").starts_with("HTTP/1.0 200") || get("/readyz").starts_with("HTTP/1.1 200")
        );
        assert!(get("/healthz").contains("ok"));
        assert!(get("/api/v1/events").contains("SuccessfulMountVolume"));

        let code = sigterm(&mut child);
        assert!(code.success(), "SIGTERM stops the daemon cleanly: {code:?}");
        let rest: Vec<String> = lines.collect();
        assert!(
            rest.iter().any(|l| l.contains("mounts stay in place")),
            "{rest:?}"
        );
    }
}

mount_test! {
    fn a_closed_log_pipe_changes_nothing_and_sighup_stops_cleanly() {
        require_root();
        let root = tempfile::tempdir().unwrap();
        let manifests = tempfile::tempdir().unwrap();
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        // stdout and stderr are pipes whose reading ends are closed at once (`... 2>&1 | head -0`).
        let mut child = daemon(manifests.path(), root.path(), &listen)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        drop(child.stderr.take());
        until_http(port, "/readyz", |a| a.contains(" 200 "));
        // Every pod added now is mounted although every log line fails to be written.
        for i in 0..5 {
            std::fs::write(
                manifests.path().join(format!("ok{i}.yaml")),
                OK_POD.replace("name: ok", &format!("name: ok{i}")),
            )
            .unwrap();
        }
        until_http(port, "/api/v1/pods", |a| {
            a.matches("\"phase\":\"Ready\"").count() == 5
        });
        let metrics = until_http(port, "/metrics", |a| {
            a.contains("kubevol_log_lines_dropped_total")
        });
        let dropped: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("kubevol_log_lines_dropped_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{metrics}"));
        assert!(dropped > 0.0, "the lost lines are counted: {metrics}");
        let st = Command::new("kill")
            .args(["-HUP", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
        let code = child.wait().unwrap();
        assert!(
            code.success(),
            "SIGHUP stops the daemon as SIGTERM does: {code:?}"
        );
    }
}

mount_test! {
    fn a_full_stderr_or_a_closed_stdout_never_panics() {
        require_root();
        let root = tempfile::tempdir().unwrap();
        let manifests = tempfile::tempdir().unwrap();
        std::fs::write(manifests.path().join("ok.yaml"), OK_POD).unwrap();
        let args = [
            "run",
            "--once",
            "--manifests",
            manifests.path().to_str().unwrap(),
            "--root-dir",
            root.path().to_str().unwrap(),
        ];
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = in_namespace(&args).stderr(full).output().unwrap();
        assert!(
            out.status.success(),
            "the pod mounts although stderr is full: {:?}",
            out.status
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("default/ok"),
            "the table is printed"
        );
        // stdout closed before the table is printed: an error of the write, not a panic (101).
        let mut child = in_namespace(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(101), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

mount_test! {
    fn help_says_what_kubevol_is_and_logs_to_a_pipe_have_no_colour() {
        let help = Command::new(BIN).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        assert!(
            help.starts_with("kubevol: the Kubernetes node volume manager."),
            "{help}"
        );
        let run = Command::new(BIN).args(["run", "--help"]).output().unwrap();
        let run = String::from_utf8_lossy(&run.stdout);
        let node = run
            .split("--node-name")
            .nth(1)
            .and_then(|r| r.split("--listen").next())
            .unwrap_or_default();
        assert!(node.contains("[default: "), "{run}");
        require_root();
        let root = tempfile::tempdir().unwrap();
        let manifests = tempfile::tempdir().unwrap();
        std::fs::write(manifests.path().join("ok.yaml"), OK_POD).unwrap();
        let out = run_once(&[], manifests.path(), root.path());
        assert!(out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("every volume of the pod is mounted"), "{stderr}");
        assert!(
            !stderr.contains('\x1b'),
            "no colour escapes in a pipe: {stderr:?}"
        );
    }
}

mount_test! {
    fn a_flood_of_half_sent_requests_neither_starves_the_engine_nor_holds_the_stop() {
        require_root();
        let (_tmp, manifests, root) = scratch();
        std::fs::write(manifests.join("ok.yaml"), OK_POD).unwrap();
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        // A hard limit of 400 descriptors, which kubevol cannot raise: fewer than the clients'.
        let child = Command::new("prlimit")
            .args([
                "--nofile=400:400",
                "--",
                "unshare",
                "--mount",
                "--propagation",
                "private",
                BIN,
            ])
            .args(["run", "--manifests"])
            .arg(&manifests)
            .arg("--root-dir")
            .arg(&root)
            .args(["--listen", &listen])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut child = Running(child);
        until_http(port, "/api/v1/pods", |a| a.contains("\"phase\":\"Ready\""));
        let clients: Vec<std::net::TcpStream> = (0..600)
            .filter_map(|_| {
                use std::io::Write;
                let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
                let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n");
                Some(s)
            })
            .collect();
        assert!(clients.len() > 400, "{} connections", clients.len());
        // A pod added while the clients hold on is read and mounted.
        std::fs::write(
            manifests.join("late.yaml"),
            OK_POD.replace("name: ok", "name: late"),
        )
        .unwrap();
        let pods = until_http(port, "/api/v1/pods", |a| {
            a.contains("\"name\":\"late\"") && !a.contains("\"phase\":\"Pending\"")
        });
        assert!(
            !pods.contains("Too many open files") && pods.matches("\"phase\":\"Ready\"").count() == 2,
            "{pods}"
        );
        // A stop does not wait for a client that never finishes its request.
        let held = {
            use std::io::Write;
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"GET /healthz HTTP/1.1\r\n").unwrap();
            s
        };
        let started = Instant::now();
        let code = sigterm(&mut child);
        assert!(code.success(), "{code:?}");
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the stop waited {:?} for clients",
            started.elapsed()
        );
        drop((clients, held));
    }
}
