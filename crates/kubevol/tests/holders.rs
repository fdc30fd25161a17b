//! Who holds a busy mount: each kind of holder found, the holder named in a pod's error and
//! event, the teardown tried again as soon as the holder exits, and a scan of a node with
//! thousands of processes bounded by its deadline. Each test runs in its own private mount
//! namespace; every process it starts is ended by its PID.

#[macro_use]
mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kubevol_mount::holders::{find, Hold};

/// Processes started by a test, killed (by PID) when it ends however it ends.
#[derive(Default)]
struct Children(Vec<Child>);

impl Children {
    fn spawn(&mut self, c: &mut Command) -> u32 {
        let child = c
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        let pid = child.id();
        self.0.push(child);
        pid
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn tmpfs(at: &Path) {
    std::fs::create_dir_all(at).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "tmpfs"])
        .arg(at)
        .status()
        .unwrap();
    assert!(st.success());
}

/// Waits until `cond` holds for what is found at `target` (a process just spawned may not have
/// opened its file yet).
fn holders_until(
    target: &Path,
    what: &str,
    cond: impl Fn(&[kubevol_mount::holders::Holder]) -> bool,
) -> kubevol_mount::holders::Holders {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let found = find(target, Instant::now() + Duration::from_secs(120)).unwrap();
        if cond(&found.holders) {
            return found;
        }
        assert!(Instant::now() < deadline, "{what}: {found:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

mount_test! {
    fn every_kind_of_holder_is_found() {
        let root = TestRoot::new();
        let v = root.path().join("volume");
        tmpfs(&v);
        std::fs::write(v.join("data.log"), "x").unwrap();
        std::fs::copy("/bin/sleep", v.join("sleep")).unwrap();
        let mut kids = Children::default();
        let cwd = kids.spawn(Command::new("sleep").arg("600").current_dir(&v));
        let open = kids.spawn(Command::new("sh").args(["-c", "exec 3<\"$0\"; exec sleep 600"]).arg(v.join("data.log")));
        let mapped = kids.spawn(Command::new(v.join("sleep")).arg("600").current_dir("/"));
        // Another mount namespace, where the volume shows at another place and a process works
        // in it.
        let elsewhere = root.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        let script = "mount --bind \"$0\" \"$1\" && cd \"$1\" && exec sleep 600";
        let other = kids.spawn(
            Command::new("unshare")
                .args(["--mount", "--propagation", "private", "sh", "-c", script])
                .arg(&v)
                .arg(&elsewhere),
        );
        let top = v.join("sub");
        tmpfs(&top);

        let found = holders_until(&v, "every holder", |h| {
            let has = |pid: u32, f: &dyn Fn(&Hold) -> bool| h.iter().any(|x| x.pid == pid && f(&x.how));
            has(cwd, &|how| *how == Hold::Cwd(v.clone()))
                && has(open, &|how| *how == Hold::OpenFile(v.join("data.log")))
                && has(mapped, &|how| *how == Hold::Map(v.join("sleep")))
                && has(other, &|how| *how == Hold::Cwd(elsewhere.clone()))
                && has(other, &|how| matches!(how, Hold::MountInNamespace(_)))
                && has(0, &|how| *how == Hold::MountOnTop(top.clone()))
        });
        assert!(found.complete);
        let text = found.to_string();
        assert!(
            text.contains(&format!("pid {cwd} (sleep, cwd {})", v.display()))
                && text.contains(&format!("a mount on top at {}", top.display())),
            "{text}"
        );
        assert!(
            found.holders.iter().all(|h| h.pid != std::process::id()),
            "the scan itself holds nothing: {text}"
        );
        // Nothing is found in a mount that nothing holds.
        let idle = root.path().join("idle");
        tmpfs(&idle);
        let none = find(&idle, Instant::now() + Duration::from_secs(120)).unwrap();
        assert!(none.holders.is_empty() && none.complete, "{none:?}");
        assert_eq!(none.to_string(), "no process found holding it");
        drop(kids);
    }
}

mount_test! {
    fn a_busy_teardown_names_its_holder_and_is_tried_again_when_it_exits() {
        let root = TestRoot::new();
        runtime().block_on(async {
            // A backoff far longer than the test: only the holder's exit can bring the retry.
            let m = manager(root.path(), |c| {
                c.backoff.initial = Duration::from_secs(600);
                c.backoff.max = Duration::from_secs(600);
                c.wait_timeout = Duration::from_secs(60);
            });
            let (p, _, path, held, s) = busy_memory_pod(&m).await;
            let holder = held.pid();
            let error = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(
                error.contains(&format!("held by pid {holder} (sleep, cwd {})", path.display())),
                "{error}"
            );
            let events = m.status(true).pods.into_iter().find(|p| p.name == "db").unwrap().events;
            assert!(
                events.iter().any(|e| e.reason == "FailedUnMount" && e.message.contains(&format!("pid {holder}"))),
                "{events:?}"
            );
            held.release();
            m.wait_for_unmount(&p).await.expect("torn down once its holder is gone, not after the backoff");
            assert!(mounts_under(&path).is_empty());
            m.shutdown();
        });
    }
}

mount_test! {
    fn a_scan_of_thousands_of_processes_ends_by_its_deadline() {
        let root = TestRoot::new();
        let v = root.path().join("volume");
        tmpfs(&v);
        let mut kids = Children::default();
        let holder = kids.spawn(Command::new("sleep").arg("600").current_dir(&v));
        for _ in 0..5000 {
            kids.spawn(Command::new("sleep").arg("600").current_dir("/"));
        }
        // A deadline already passed: the scan stops at once, with what it saw, and says so.
        let cut = find(&v, Instant::now()).unwrap();
        assert!(!cut.complete && cut.processes < 5000, "{} processes, complete: {}", cut.processes, cut.complete);
        assert!(cut.to_string().contains("the scan stopped after"), "{cut}");
        let deadline = Duration::from_millis(300);
        let started = Instant::now();
        let found = find(&v, started + deadline).unwrap();
        // What the scan says holds whether or not it ran out (how far it got in 300 ms is the
        // machine's business; a deadline already passed, above, stops it for sure).
        let _ = started;
        assert!(found.processes > 0);
        if found.complete {
            assert!(found.holders.iter().any(|h| h.pid == holder), "{found:?}");
            assert!(found.processes >= 5000);
        } else {
            assert!(found.to_string().contains("the scan stopped after"), "{found}");
        }
        // With time enough, the whole node is looked at and the holder found.
        let all = find(&v, Instant::now() + Duration::from_secs(120)).unwrap();
        assert!(all.complete && all.processes >= 5000, "{} processes", all.processes);
        assert!(all.holders.iter().any(|h| h.pid == holder), "{all:?}");
        drop(kids);
    }
}
