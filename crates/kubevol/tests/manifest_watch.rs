//! The manifest directory watch, without root: reads happen when a writer is done, and
//! kubevol's own reads never trigger more reads.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kubevol::source::ManifestSource;
use kubevol::store::ObjectStore;

const POD: &str =
    "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: [{name: c}]}\n";

async fn until(store: &ObjectStore, cond: impl Fn(&ObjectStore) -> bool) {
    let mut rx = store.subscribe();
    while !cond(store) {
        tokio::time::timeout(Duration::from_secs(10), rx.changed())
            .await
            .expect("store changed in time")
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_reads_do_not_trigger_reloads() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), POD).unwrap();
    let store = Arc::new(ObjectStore::new());
    let watch = ManifestSource::new(dir.path(), store.clone())
        .unwrap()
        .start()
        .unwrap();
    assert_eq!(store.pods().len(), 1);
    std::fs::write(dir.path().join("b.yaml"), POD.replace("name: a", "name: b")).unwrap();
    until(&store, |s| s.pods().len() == 2).await;
    let mut rx = store.subscribe();
    rx.borrow_and_update();
    let quiet = tokio::time::timeout(Duration::from_millis(300), rx.changed()).await;
    assert!(
        quiet.is_err(),
        "the store must stay unchanged while nothing is written (no reload loop)"
    );
    watch.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_written_in_steps_never_loses_its_pod() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.yaml");
    std::fs::write(&path, POD).unwrap();
    let store = Arc::new(ObjectStore::new());
    let watch = ManifestSource::new(dir.path(), store.clone())
        .unwrap()
        .start()
        .unwrap();
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
    for round in 0..20 {
        let text = POD.replace("name: c", &format!("name: c{round}"));
        let (head, tail) = text.split_at(text.len() / 2);
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(head.as_bytes()).unwrap();
        f.flush().unwrap();
        tokio::task::yield_now().await;
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
