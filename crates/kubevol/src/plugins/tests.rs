use kubevol_core::names::escape_plugin_name;

use super::*;

/// Every standard plugin's directory name is one spelled out ahead (no string is made for
/// it at each volume's path), and it is the kubelet's escaping of the plugin's name.
#[test]
fn every_standard_plugin_has_its_directory_name_ready() {
    let registry = PluginRegistry::standard();
    for plugin in &registry.plugins {
        let name = plugin.name();
        match escape_plugin_name(name) {
            std::borrow::Cow::Borrowed(dir) => assert_eq!(dir, name.replace('/', "~")),
            std::borrow::Cow::Owned(_) => panic!("{name}: not among the built-in names"),
        }
    }
}

/// A refresh asked for while an earlier one is pending adds no wait; an earlier one does;
/// each pod is sent once per wait that fires.
#[tokio::test(start_paused = true)]
async fn refreshes_of_a_pod_do_not_multiply() {
    use std::time::Duration;
    use tokio::time::Instant;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let r = Refresher::new(tx);
    let pod = kubevol_core::PodUid::from("p");
    let now = Instant::now();
    r.at(pod.clone(), now + Duration::from_secs(60));
    for _ in 0..100 {
        r.at(pod.clone(), now + Duration::from_secs(90));
    }
    r.at(pod.clone(), now + Duration::from_secs(30));
    assert_eq!(r.waiting(), 1);
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_eq!(rx.recv().await, Some(pod.clone()), "the earliest first");
    assert_eq!(r.waiting(), 0);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        rx.recv().await,
        Some(pod.clone()),
        "the one at 60 s still fires"
    );
    assert!(
        rx.try_recv().is_err(),
        "the later asks added nothing: {:?}",
        rx.try_recv()
    );
}
