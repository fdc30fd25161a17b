//! The manifest directory watch, without root: reads happen when a writer is done, and
//! kubevol's own reads never trigger more reads.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod common;

use kubevol::source::ManifestSource;
use kubevol::store::ObjectStore;

const POD: &str =
    "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: [{name: c}]}\n";

async fn until(store: &ObjectStore, cond: impl Fn(&ObjectStore) -> bool) {
    let mut rx = store.subscribe();
    while !cond(store) {
        tokio::time::timeout(Duration::from_secs(120), rx.changed())
            .await
            .expect("store changed in time")
            .unwrap();
    }
}

/// A directory holding `a.yaml` (one pod), watched into a new store.
struct Watched {
    dir: tempfile::TempDir,
    /// `a.yaml`.
    path: std::path::PathBuf,
    store: Arc<ObjectStore>,
    /// How many files the source has read.
    reads: Arc<std::sync::atomic::AtomicU64>,
    /// How many empty files read at their writer's close the source has held back.
    holds: Arc<std::sync::atomic::AtomicU64>,
    watch: tokio::task::JoinHandle<()>,
}

async fn watched_pod_file() -> Watched {
    watched_pod_file_with(|source| source).await
}

/// [`watched_pod_file`], its source set up by `setup` first.
async fn watched_pod_file_with(setup: impl FnOnce(ManifestSource) -> ManifestSource) -> Watched {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.yaml");
    std::fs::write(&path, POD).unwrap();
    let store = Arc::new(ObjectStore::new());
    let source = setup(ManifestSource::new(dir.path()));
    let (reads, holds) = (source.reads(), source.holds());
    let watch = source
        .listen(store.sink(ManifestSource::NAME))
        .await
        .unwrap();
    assert_eq!(store.pods().len(), 1);
    Watched {
        dir,
        path,
        store,
        reads,
        holds,
        watch,
    }
}

/// A file is read when it is written, and not again while nothing is written: the source's own
/// reads (and the store's changes they cause) never make it read again. Counted by the source's
/// reads, over a window longer than the settling of events (1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_reads_do_not_trigger_reloads() {
    let Watched {
        dir,
        store,
        reads,
        watch,
        ..
    } = watched_pod_file().await;
    let at_start = reads.load(Ordering::Relaxed);
    assert!(at_start >= 1, "the first listing read a.yaml");
    // Written whole and renamed in: one event, one read.
    std::fs::write(dir.path().join(".b.tmp"), POD.replace("name: a", "name: b")).unwrap();
    std::fs::rename(dir.path().join(".b.tmp"), dir.path().join("b.yaml")).unwrap();
    until(&store, |s| s.pods().len() == 2).await;
    let after_write = reads.load(Ordering::Relaxed);
    assert!(after_write > at_start, "the write was read");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        reads.load(Ordering::Relaxed),
        after_write,
        "no file is read again while nothing is written (no reload loop)"
    );
    watch.abort();
}

/// A file rewritten in place, in two steps, never takes its pod away: the watcher is made to
/// read it half-written (another writer's close between the steps), and waited for, before
/// the rest is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_written_in_steps_never_loses_its_pod() {
    let Watched {
        dir: _dir,
        path,
        store,
        reads,
        watch,
        ..
    } = watched_pod_file().await;
    let (lost, observer) = watch_for_loss(&store);
    for round in 0..20 {
        let text = POD.replace("name: c", &format!("name: c{round}"));
        let (head, tail) = text.split_at(text.len() / 2);
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(head.as_bytes()).unwrap();
        f.flush().unwrap();
        // Another writer closes the file: the watcher reads it as it is, half-written.
        let before = reads.load(Ordering::Relaxed);
        drop(std::fs::OpenOptions::new().write(true).open(&path).unwrap());
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while reads.load(Ordering::Relaxed) == before {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: the half-written file was read"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        f.write_all(tail.as_bytes()).unwrap();
        drop(f);
        let want = format!("c{round}");
        until(&store, |s| {
            s.pods()
                .first()
                .is_some_and(|(_, p)| p.pod.spec.as_ref().unwrap().containers[0].name == want)
        })
        .await;
    }
    assert!(
        !lost.load(Ordering::SeqCst),
        "the pod disappeared while its file was being rewritten"
    );
    observer.abort();
    watch.abort();
}

/// A file written twice in quick succession never takes its pod away: the first writer's close
/// event is often read after the second writer has truncated the file, before it writes. Repeated
/// until that happened three times (the source counts the empty files it held back). The source
/// holds an empty file for a minute here, so that a loaded machine's delay before the second
/// write cannot turn into an empty file applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_read_after_the_next_writers_truncation_never_loses_the_pod() {
    let Watched {
        dir: _dir,
        path,
        store,
        holds,
        watch,
        ..
    } = watched_pod_file_with(|s| s.with_empty_quiet(Duration::from_secs(60))).await;
    let (lost, observer) = watch_for_loss(&store);
    let container = |store: &ObjectStore, want: &str| {
        store
            .pods()
            .first()
            .is_some_and(|(_, p)| p.pod.spec.as_ref().unwrap().containers[0].name == want)
    };
    let mut raced = 0;
    for round in 0..500 {
        if raced == 3 {
            break;
        }
        let (first, second) = (format!("first{round}"), format!("second{round}"));
        let held_before = holds.load(Ordering::SeqCst);
        std::fs::write(&path, POD.replace("name: c", &format!("name: {first}"))).unwrap();
        let mut writer = std::fs::File::create(&path).unwrap();
        // The first writer's close is read before the truncation (its pod is stored) or after
        // it (the empty file is held).
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            if holds.load(Ordering::SeqCst) > held_before {
                raced += 1;
                break;
            }
            if container(&store, &first) {
                break;
            }
            assert!(
                !lost.load(Ordering::SeqCst),
                "round {round}: the empty file between the two writers was applied"
            );
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: the first writer's close was read"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        writer
            .write_all(
                POD.replace("name: c", &format!("name: {second}"))
                    .as_bytes(),
            )
            .unwrap();
        drop(writer);
        until(&store, |s| container(s, &second)).await;
    }
    assert_eq!(raced, 3, "the close was read after the next truncation");
    assert!(
        !lost.load(Ordering::SeqCst),
        "the pod disappeared while its file was being rewritten"
    );
    observer.abort();
    watch.abort();
}

/// Sets a flag whenever the store holds no pod, until aborted.
fn watch_for_loss(store: &Arc<ObjectStore>) -> (Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
    let lost = Arc::new(AtomicBool::new(false));
    let observer = tokio::spawn({
        let (store, lost) = (store.clone(), lost.clone());
        async move {
            let mut rx = store.subscribe();
            loop {
                if store.pods().is_empty() {
                    lost.store(true, Ordering::SeqCst);
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        }
    });
    (lost, observer)
}

/// The periodic listing (every 20 s, on a paused clock here) that finds a file between its
/// writer's truncation and its writes leaves the file's pod alone: an empty file a listing
/// finds is one being written. The writer's close then reads it, and a file its writer left
/// empty (closed) defines nothing: its pod goes.
#[tokio::test(start_paused = true)]
async fn a_listing_never_takes_a_pod_away_from_a_file_being_written() {
    let w = watched_pod_file().await;
    let Watched {
        path, store, reads, ..
    } = &w;

    // Truncated, still open for writing: no event says the writer is done.
    let mut writer = std::fs::File::create(path).unwrap();
    let before = reads.load(Ordering::Relaxed);
    for _ in 0..1_000 {
        if reads.load(Ordering::Relaxed) > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        reads.load(Ordering::Relaxed) > before,
        "a listing looked at the changed file"
    );
    // Let the listing's outcome, if any, reach the store.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(store.pods().len(), 1, "the listing left the pod alone");
    assert!(store.file_errors().is_empty(), "{:?}", store.file_errors());

    // From here the reads follow inotify's events, which a paused clock would outrun.
    tokio::time::resume();
    writer
        .write_all(POD.replace("name: c", "name: rewritten").as_bytes())
        .unwrap();
    drop(writer);
    until(store, |s| {
        s.pods()
            .first()
            .is_some_and(|(_, p)| p.pod.spec.as_ref().unwrap().containers[0].name == "rewritten")
    })
    .await;

    drop(std::fs::File::create(path).unwrap());
    until(store, |s| s.pods().is_empty()).await;
    w.watch.abort();
}

/// A pod manifest named `name` (no volumes: the store is what is tested here).
fn pod_yaml(name: &str) -> String {
    POD.replace("name: a", &format!("name: {name}"))
}

/// Writes a marker pod in a file of its own and waits until the store has it: every event
/// before it was handled. (A file of its own: an event of an earlier round's marker file, still
/// queued, would read this round's content from a shared one before the events in between.)
async fn settle(dir: &std::path::Path, store: &ObjectStore, round: usize) {
    let marker = format!("marker-{round}");
    std::fs::write(dir.join(format!("{marker}.yaml")), pod_yaml(&marker)).unwrap();
    until(store, |s| {
        s.pods()
            .iter()
            .any(|(_, p)| p.pod.metadata.name.as_deref() == Some(marker.as_str()))
    })
    .await;
}

/// The pod named `name`, as the store holds it.
fn stored(store: &ObjectStore, name: &str) -> Option<kubevol::store::StoredPod> {
    store
        .pods()
        .into_iter()
        .map(|(_, p)| p)
        .find(|p| p.pod.metadata.name.as_deref() == Some(name))
}

fn origin_file(p: &kubevol::store::StoredPod) -> std::path::PathBuf {
    match p.origin() {
        kubevol::store::Origin::File { path, .. } => path.clone(),
        other => panic!("from a file, not {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_manifest_keeps_the_same_pod_object() {
    let dir = tempfile::tempdir().unwrap();
    let d = std::fs::canonicalize(dir.path()).unwrap();
    std::fs::write(d.join("web.yaml"), pod_yaml("web")).unwrap();
    let store = Arc::new(ObjectStore::new());
    let watch = ManifestSource::new(&d)
        .listen(store.sink(ManifestSource::NAME))
        .await
        .unwrap();
    let first = stored(&store, "web").expect("loaded").pod;
    // New names that sort before and after the old one: either may be read first.
    let names = [
        "00-web.yaml",
        "zz-web.yaml",
        "web.yaml",
        "a.yaml",
        "web.yml",
    ];
    let mut current = "web.yaml";
    for (round, next) in names.iter().cycle().take(20).enumerate() {
        std::fs::rename(d.join(current), d.join(next)).unwrap();
        current = next;
        settle(&d, &store, round).await;
        let now = stored(&store, "web").expect("the pod is still there");
        assert!(
            Arc::ptr_eq(&now.pod, &first),
            "round {round}: the same object (never removed and added again)"
        );
        assert_eq!(origin_file(&now), d.join(current), "round {round}");
        assert!(store.file_errors().is_empty(), "{:?}", store.file_errors());
    }
    watch.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_file_that_wins_a_duplicate_goes_the_other_takes_over() {
    let dir = tempfile::tempdir().unwrap();
    let d = std::fs::canonicalize(dir.path()).unwrap();
    std::fs::write(d.join("b.yaml"), pod_yaml("web")).unwrap();
    let store = Arc::new(ObjectStore::new());
    let watch = ManifestSource::new(&d)
        .listen(store.sink(ManifestSource::NAME))
        .await
        .unwrap();
    let first = stored(&store, "web").unwrap().pod;
    std::fs::write(d.join("a.yaml"), pod_yaml("web")).unwrap();
    settle(&d, &store, 0).await;
    let now = stored(&store, "web").unwrap();
    assert_eq!(origin_file(&now), d.join("a.yaml"), "the first path wins");
    assert!(Arc::ptr_eq(&now.pod, &first), "same content: same object");
    let errs = store.file_errors();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].path, d.join("b.yaml"));
    std::fs::remove_file(d.join("a.yaml")).unwrap();
    settle(&d, &store, 1).await;
    let now = stored(&store, "web").expect("b.yaml still defines it");
    assert_eq!(origin_file(&now), d.join("b.yaml"));
    assert!(Arc::ptr_eq(&now.pod, &first), "never removed");
    assert!(store.file_errors().is_empty(), "{:?}", store.file_errors());
    watch.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_ends_with_exactly_the_pods_the_directory_defines() {
    let dir = tempfile::tempdir().unwrap();
    let d = std::fs::canonicalize(dir.path()).unwrap();
    let store = Arc::new(ObjectStore::new());
    let watch = ManifestSource::new(&d)
        .listen(store.sink(ManifestSource::NAME))
        .await
        .unwrap();
    // Creates, renames, copies and removals of 12 files defining 8 pods, some of them in two
    // files at once.
    common::churn_manifests(&d, 12, 8, 1000, 0x2545_f491_4f6c_dd1d, pod_yaml);
    settle(&d, &store, 0).await;
    let want = common::defined_pods(&d);
    let have: std::collections::BTreeSet<String> = store
        .pods()
        .into_iter()
        .map(|(_, p)| p.pod.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(have, want);
    watch.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_that_are_not_regular_or_too_big_are_reported_and_never_block() {
    let dir = tempfile::tempdir().unwrap();
    let d = std::fs::canonicalize(dir.path()).unwrap();
    let fifo = d.join("fifo-target");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo");
    std::os::unix::fs::symlink(&fifo, d.join("fifo.yaml")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", d.join("zero.yaml")).unwrap();
    std::fs::create_dir(d.join("dir.yaml")).unwrap();
    std::fs::write(d.join("big.yaml"), pod_yaml("big") + &"#".repeat(4096)).unwrap();
    std::fs::write(d.join("ok.yaml"), pod_yaml("ok")).unwrap();
    let store = Arc::new(ObjectStore::new());
    // Listing must finish although nobody ever writes to the FIFO.
    let watch = tokio::time::timeout(
        Duration::from_secs(120),
        // Links followed wherever they lead (/dev/zero is outside): what they lead to is still
        // read only if it is a regular file.
        ManifestSource::new(&d)
            .with_max_file_size(1024)
            .with_links_followed(true)
            .listen(store.sink(ManifestSource::NAME)),
    )
    .await
    .expect("the first listing does not wait for a FIFO")
    .unwrap();
    assert!(stored(&store, "ok").is_some());
    let errs = |store: &ObjectStore| -> Vec<String> {
        store.file_errors().iter().map(|e| e.to_string()).collect()
    };
    let want = [
        ("big.yaml", "is 4"),
        (
            "dir.yaml",
            "is a directory (after following links), not a regular file",
        ),
        (
            "fifo.yaml",
            "is a FIFO (named pipe) (after following links), not a regular file",
        ),
        (
            "zero.yaml",
            "is a character device (after following links), not a regular file",
        ),
    ];
    let have = errs(&store);
    assert_eq!(have.len(), want.len(), "{have:#?}");
    for ((file, text), e) in want.iter().zip(&have) {
        assert!(
            e.starts_with(&d.join(file).display().to_string()) && e.contains(text),
            "{file}: {e}"
        );
    }
    assert!(
        have[0].contains("more than the limit of 1024 bytes"),
        "{}",
        have[0]
    );
    // While running: a FIFO written into place is reported, and later files still load.
    std::os::unix::fs::symlink(&fifo, d.join("fifo2.yaml")).unwrap();
    std::fs::write(d.join("later.yaml"), pod_yaml("later")).unwrap();
    until(&store, |s| stored(s, "later").is_some()).await;
    until(&store, |s| errs(s).iter().any(|e| e.contains("fifo2.yaml"))).await;
    // Made regular and small, a file loads.
    std::fs::write(d.join("big.yaml"), pod_yaml("big")).unwrap();
    until(&store, |s| stored(s, "big").is_some()).await;
    watch.abort();
}

/// The names of the pods the store holds, sorted.
fn names(store: &ObjectStore) -> Vec<String> {
    let mut n: Vec<String> = store
        .pods()
        .iter()
        .filter_map(|(_, p)| p.pod.metadata.name.clone())
        .collect();
    n.sort();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_directory_is_listed_anew_and_its_old_one_no_longer_counts() {
    let base = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(base.path()).unwrap();
    let dir = base.join("manifests");
    std::fs::create_dir(&dir).unwrap();
    for name in ["db", "shop"] {
        std::fs::write(dir.join(format!("{name}.yaml")), pod_yaml(name)).unwrap();
    }
    let store = Arc::new(ObjectStore::new());
    let watch = ManifestSource::new(&dir)
        .listen(store.sink(ManifestSource::NAME))
        .await
        .unwrap();
    assert_eq!(names(&store), ["db", "shop"]);
    // `mv manifests manifests.old; mkdir manifests; cp manifests.old/db.yaml manifests/`
    let old = base.join("manifests.old");
    std::fs::rename(&dir, &old).unwrap();
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(old.join("db.yaml"), dir.join("db.yaml")).unwrap();
    until(&store, |s| names(s) == ["db"]).await;
    assert_eq!(
        origin_file(&stored(&store, "db").unwrap()),
        dir.join("db.yaml")
    );
    // Edits in the old directory are not the directory's any more.
    std::fs::write(old.join("shop.yaml"), pod_yaml("shop")).unwrap();
    std::fs::write(old.join("db.yaml"), pod_yaml("db-old")).unwrap();
    settle(&dir, &store, 0).await;
    assert_eq!(names(&store), ["db", "marker-0"]);
    watch.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlinked_directory_switched_to_a_new_release_is_followed() {
    let base = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(base.path()).unwrap();
    for (rel, pod) in [("rel1", "web"), ("rel2", "web2")] {
        std::fs::create_dir(base.join(rel)).unwrap();
        std::fs::write(base.join(rel).join("app.yaml"), pod_yaml(pod)).unwrap();
    }
    let current = base.join("current");
    std::os::unix::fs::symlink("rel1", &current).unwrap();
    let store = Arc::new(ObjectStore::new());
    let watch = ManifestSource::new(&current)
        .listen(store.sink(ManifestSource::NAME))
        .await
        .unwrap();
    assert_eq!(names(&store), ["web"]);
    // `ln -sfn rel2 current.tmp && mv -T current.tmp current`: seen through the watch of the
    // way to the directory (`until` waits 10 s, the periodic listing comes every 20 s).
    std::os::unix::fs::symlink("rel2", base.join("current.tmp")).unwrap();
    std::fs::rename(base.join("current.tmp"), &current).unwrap();
    until(&store, |s| names(s) == ["web2"]).await;
    assert_eq!(
        origin_file(&stored(&store, "web2").unwrap()),
        base.join("rel2/app.yaml")
    );
    watch.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_that_is_gone_takes_nothing_away_until_it_is_back() {
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("manifests");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("a.yaml"), pod_yaml("a")).unwrap();
    std::fs::write(dir.join("b.yaml"), pod_yaml("b")).unwrap();
    let store = Arc::new(ObjectStore::new());
    let watch = ManifestSource::new(&dir)
        .listen(store.sink(ManifestSource::NAME))
        .await
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    until(&store, |s| {
        s.source_problems()
            .iter()
            .any(|p| p.contains("is gone; nothing is torn down until it is back"))
    })
    .await;
    assert_eq!(names(&store), ["a", "b"], "nothing is taken away meanwhile");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("b.yaml"), pod_yaml("b")).unwrap();
    until(&store, |s| {
        s.source_problems().is_empty() && names(s) == ["b"]
    })
    .await;
    watch.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_periodic_listing_reads_a_manifest_whose_link_target_was_switched() {
    // As a ConfigMap mounted by the kubelet: `app.yaml -> ..data/app.yaml`, and `..data` a link
    // switched from one hidden directory to the next; inotify reports only hidden names.
    let dir = tempfile::tempdir().unwrap();
    let d = std::fs::canonicalize(dir.path()).unwrap();
    for (v, pod) in [("..v1", "one"), ("..v2", "two")] {
        std::fs::create_dir(d.join(v)).unwrap();
        std::fs::write(d.join(v).join("app.yaml"), pod_yaml(pod)).unwrap();
    }
    std::os::unix::fs::symlink("..v1", d.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/app.yaml", d.join("app.yaml")).unwrap();
    let store = Arc::new(ObjectStore::new());
    let watch = ManifestSource::new(&d)
        .listen(store.sink(ManifestSource::NAME))
        .await
        .unwrap();
    assert_eq!(names(&store), ["one"]);
    std::os::unix::fs::symlink("..v2", d.join("..data_tmp")).unwrap();
    std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
    let mut rx = store.subscribe();
    tokio::time::timeout(Duration::from_secs(120), async {
        while names(&store) != ["two"] {
            rx.changed().await.unwrap();
        }
    })
    .await
    .expect("the re-listing (every 20 s) reads the switched file");
    watch.abort();
}

#[test]
fn a_manifest_read_that_failed_for_too_many_open_files_is_read_again() {
    // In a process of its own (the test re-executed), whose open files are then used up.
    common::in_private_mount_ns(
        "a_manifest_read_that_failed_for_too_many_open_files_is_read_again",
        || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let dir = tempfile::tempdir().unwrap();
                let staged = tempfile::tempdir().unwrap();
                std::fs::write(dir.path().join("a.yaml"), pod_yaml("a")).unwrap();
                std::fs::write(staged.path().join("b.yaml"), pod_yaml("b")).unwrap();
                let store = Arc::new(ObjectStore::new());
                let watch = ManifestSource::new(dir.path())
                    .listen(store.sink(ManifestSource::NAME))
                    .await
                    .unwrap();
                let mut limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
                limit.current = Some(256);
                rustix::process::setrlimit(rustix::process::Resource::Nofile, limit).unwrap();
                let mut held = Vec::new();
                loop {
                    match std::fs::File::open("/dev/null") {
                        Ok(f) => held.push(f),
                        Err(e) if e.raw_os_error() == Some(libc_emfile()) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                // A rename needs no descriptor: the file arrives while none is left to read it.
                std::fs::rename(staged.path().join("b.yaml"), dir.path().join("b.yaml")).unwrap();
                until(&store, |s| {
                    s.file_errors()
                        .iter()
                        .any(|e| e.message.contains("it is read again shortly"))
                })
                .await;
                drop(held);
                until(&store, |s| {
                    names(s) == ["a", "b"] && s.file_errors().is_empty()
                })
                .await;
                watch.abort();
            });
        },
    );
}

/// EMFILE, "Too many open files".
fn libc_emfile() -> i32 {
    rustix::io::Errno::MFILE.raw_os_error()
}
