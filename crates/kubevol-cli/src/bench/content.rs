//! The content-volume benchmark: configMap, secret and projected volumes for N pods, then
//! one ConfigMap update that every pod's volumes must show.

use super::*;
use kubevol::store::Object;

const CONFIG_KEYS: usize = 10;
const SECRET_KEYS: usize = 3;
const VOLUMES: usize = 3;

fn value(version: u32, key: usize) -> String {
    format!("value {version} of key {key}: {}", "x".repeat(64))
}

pub(super) fn objects(version: u32) -> Vec<Object> {
    let data: serde_json::Map<String, serde_json::Value> = (0..CONFIG_KEYS)
        .map(|k| (format!("k{k}"), value(version, k).into()))
        .collect();
    let secret: serde_json::Map<String, serde_json::Value> = (0..SECRET_KEYS)
        .map(|k| (format!("s{k}"), format!("secret {k}").into()))
        .collect();
    vec![
        Object::ConfigMap(
            serde_json::from_value(serde_json::json!({"metadata": {"name": "config", "namespace": "bench"}, "data": data}))
                .expect("valid ConfigMap"),
        ),
        Object::Secret(
            serde_json::from_value(serde_json::json!({"metadata": {"name": "secret", "namespace": "bench"}, "stringData": secret}))
                .expect("valid Secret"),
        ),
    ]
}

pub(super) fn pod(i: usize) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("bench-{i}"), "namespace": "bench"},
        "spec": {
            "containers": [{"name": "c", "volumeMounts": [
                {"name": "config", "mountPath": "/config"},
                {"name": "secret", "mountPath": "/secret"},
                {"name": "all", "mountPath": "/all"}]}],
            "volumes": [
                {"name": "config", "configMap": {"name": "config"}},
                {"name": "secret", "secret": {"secretName": "secret"}},
                {"name": "all", "projected": {"sources": [
                    {"configMap": {"name": "config"}},
                    {"secret": {"name": "secret"}},
                    {"downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}}]}}],
        },
    }))
    .expect("benchmark pod is valid")
}

/// Writes one volume the way the atomic writer lays it out, with plain syscalls.
fn raw_write(dir: &Path, version: u32, keys: &[(String, String)]) -> std::io::Result<()> {
    let ts = dir.join(format!("..v{version}"));
    std::fs::create_dir(&ts)?;
    for (k, v) in keys {
        std::fs::write(ts.join(k), v)?;
    }
    std::os::unix::fs::symlink(format!("..v{version}"), dir.join("..data_tmp"))?;
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data"))?;
    if version == 1 {
        for (k, _) in keys {
            std::os::unix::fs::symlink(format!("..data/{k}"), dir.join(k))?;
        }
    } else {
        std::fs::remove_dir_all(dir.join(format!("..v{}", version - 1)))?;
    }
    Ok(())
}

fn keys(version: u32, name: &str) -> [Vec<(String, String)>; 3] {
    let config: Vec<(String, String)> = (0..CONFIG_KEYS)
        .map(|k| (format!("k{k}"), value(version, k)))
        .collect();
    let secret: Vec<(String, String)> = (0..SECRET_KEYS)
        .map(|k| (format!("s{k}"), format!("secret {k}")))
        .collect();
    let mut all = config.clone();
    all.extend(secret.clone());
    all.push(("name".into(), name.into()));
    [config, secret, all]
}

/// The floor: the same directories, tmpfs mounts, files and links, made directly; then the
/// update of the configMap and projected volumes; then the tear-down.
fn raw_floor(dir: &Path, pods: usize) -> anyhow::Result<(Duration, Duration)> {
    let m = LinuxMounter;
    let t0 = Instant::now();
    for i in 0..pods {
        let sets = keys(1, &format!("bench-{i}"));
        for (v, set) in sets.iter().enumerate() {
            let p = dir.join(format!("{i}-{v}"));
            std::fs::create_dir(&p)?;
            if v > 0 {
                m.mount("tmpfs", &p, "tmpfs", &MountOptions::default())?;
            }
            raw_write(&p, 1, set)?;
        }
    }
    let set_up = t0.elapsed();
    let t1 = Instant::now();
    for i in 0..pods {
        let sets = keys(2, &format!("bench-{i}"));
        for v in [0, 2] {
            raw_write(&dir.join(format!("{i}-{v}")), 2, &sets[v])?;
        }
    }
    let update = t1.elapsed();
    for i in 0..pods {
        for v in 0..VOLUMES {
            let p = dir.join(format!("{i}-{v}"));
            if v > 0 {
                m.unmount(&p)?;
            }
            std::fs::remove_dir_all(&p)?;
        }
    }
    Ok((set_up, update))
}

/// Waits until every watched volume directory shows the wanted value in its `k0`: an
/// inotify watch per directory reports each rename onto `..data` (the atomic writer's
/// publish), and only that directory is read then.
struct UpdateWatch {
    inotify: std::os::fd::OwnedFd,
    dirs: std::collections::HashMap<i32, std::path::PathBuf>,
    want: String,
}

impl UpdateWatch {
    fn new(dirs: Vec<std::path::PathBuf>, want: String) -> anyhow::Result<Self> {
        use rustix::fs::inotify;
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC).context("inotify_init1")?;
        let mut watched = std::collections::HashMap::with_capacity(dirs.len());
        for dir in dirs {
            let wd = inotify::add_watch(
                &fd,
                &dir,
                inotify::WatchFlags::MOVED_TO | inotify::WatchFlags::ONLYDIR,
            )
            .with_context(|| format!("watching {}", dir.display()))?;
            watched.insert(wd, dir);
        }
        Ok(Self {
            inotify: fd,
            dirs: watched,
            want,
        })
    }

    /// The seconds from `start` at which each directory showed the value, sorted.
    fn wait(self, start: Instant) -> anyhow::Result<Vec<f64>> {
        use rustix::fs::inotify;
        let Self {
            inotify,
            mut dirs,
            want,
        } = self;
        let shows = |dir: &Path| std::fs::read_to_string(dir.join("k0")).is_ok_and(|s| s == want);
        let mut seen = Vec::with_capacity(dirs.len());
        let take_all = |dirs: &mut std::collections::HashMap<i32, std::path::PathBuf>,
                        seen: &mut Vec<f64>| {
            dirs.retain(|_, dir| {
                let done = shows(dir);
                if done {
                    seen.push(start.elapsed().as_secs_f64());
                }
                !done
            })
        };
        // A directory already written before its watch saw a rename shows it now.
        take_all(&mut dirs, &mut seen);
        let mut buf = vec![std::mem::MaybeUninit::<u8>::uninit(); 64 * 1024];
        let mut events = inotify::Reader::new(&inotify, &mut buf);
        while !dirs.is_empty() {
            let event = events.next().context("reading inotify events")?;
            if event.events().contains(inotify::ReadFlags::QUEUE_OVERFLOW) {
                // Events were lost: look at every directory still waited for.
                take_all(&mut dirs, &mut seen);
            } else if event.file_name().is_some_and(|n| n.to_bytes() == b"..data") {
                let wd = event.wd();
                if dirs.get(&wd).is_some_and(|dir| shows(dir)) {
                    dirs.remove(&wd);
                    seen.push(start.elapsed().as_secs_f64());
                }
            }
        }
        seen.sort_by(|a, b| a.total_cmp(b));
        Ok(seen)
    }
}

pub(super) fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let (tmp, floor_dir) = BenchRoot::new(args)?;
    let total = args.pods() * VOLUMES;
    println!(
        "kubevol bench --content: {} pods x (configMap {CONFIG_KEYS} keys, secret {SECRET_KEYS} keys, projected {} files) = {total} volumes",
        args.pods(),
        CONFIG_KEYS + SECRET_KEYS + 1
    );
    let (floor_setup_a, floor_update_a) =
        raw_floor(&floor_dir, args.pods()).context("raw floor")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let root = tmp.path().join("root");
    let (lat, ready_elapsed, update_elapsed, update_lat) = runtime.block_on(async {
        let (manager, running) = start_manager(&root, args, |_| {})?;
        manager.library().upsert_objects(objects(1));
        let written = tokio::time::Instant::now();
        let input: Vec<Pod> = (0..args.pods()).map(pod).collect();
        let pods = handles(&input);
        let start = tokio::time::Instant::now();
        let (uids, latencies) = add_and_wait(&manager, input, &pods).await?;
        let ready_elapsed = start.elapsed();

        // One ConfigMap update; every pod's configMap and projected volume must show it.
        // Each volume's directory is watched for the rename that publishes a new `..data`,
        // so seeing the update costs nothing while kubevol writes (a polling loop would
        // take one of the machine's two cores from it).
        let dirs: Vec<std::path::PathBuf> = uids
            .iter()
            .flat_map(|u| {
                let vols = manager.mounted_volumes_for_pod(u);
                [vols["config"].path.clone(), vols["all"].path.clone()]
            })
            .collect();
        let updated = UpdateWatch::new(dirs, value(2, 0))?;
        // An object's volumes are rewritten at most once a turn (a change sooner is held back
        // until then): the update comes after the objects' first turn, so that what is
        // measured is the rewrite, not the wait for the turn.
        tokio::time::sleep_until(written + kubevol::populator::CONTENT_EVERY).await;
        let t = tokio::time::Instant::now();
        manager.library().upsert_objects(objects(2));
        let watching = tokio::task::spawn_blocking(move || updated.wait(t.into_std()));
        let update_lat = tokio::time::timeout(Duration::from_secs(600), watching)
            .await
            .context("update not seen in 600 s")???;
        let update_elapsed = Duration::from_secs_f64(update_lat.last().copied().unwrap_or(0.0));
        manager.remove_pods(&pods);
        manager.wait_for_all_pods_unmount(&pods).await?;
        manager.shutdown();
        let _ = running.await;
        anyhow::Ok((latencies, ready_elapsed, update_elapsed, update_lat))
    })?;
    let (floor_setup_b, floor_update_b) =
        raw_floor(&floor_dir, args.pods()).context("raw floor")?;
    let floor_setup = (floor_setup_a + floor_setup_b) / 2;
    let floor_update = (floor_update_a + floor_update_b) / 2;
    let ms = |d: f64| d * 1e3;
    println!();
    println!("pod ready latency (all pods added at once, 3 content volumes each):");
    println!(
        "  p50 {:.1} ms   p99 {:.1} ms   all ready after {:.1} ms (raw floor {:.1} ms, ratio {:.2})",
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.99)),
        ms(ready_elapsed.as_secs_f64()),
        ms(floor_setup.as_secs_f64()),
        floor_setup.as_secs_f64() / ready_elapsed.as_secs_f64()
    );
    println!("ConfigMap update, {} volumes rewritten:", args.pods() * 2);
    println!(
        "  p50 {:.1} ms   p99 {:.1} ms   all after {:.1} ms (raw floor {:.1} ms, ratio {:.2})",
        ms(percentile(&update_lat, 0.5)),
        ms(percentile(&update_lat, 0.99)),
        ms(update_elapsed.as_secs_f64()),
        ms(floor_update.as_secs_f64()),
        floor_update.as_secs_f64() / update_elapsed.as_secs_f64()
    );
    println!("(ratio = raw floor time / kubevol time; 1.0 is the floor)");
    println!("peak RSS: {:.1} MiB", peak_rss_mib());
    tmp.release()?;
    Ok(ExitCode::SUCCESS)
}
