//! A memory-backed emptyDir resized in place when its pod's size changes (Kubernetes 1.37,
//! `InPlacePodVerticalScalingMemoryBackedVolumes`).

use super::*;
use kubevol_testserver::cluster::eventually;

fn cache_pod(size_limit: &str) -> k8s_openapi::api::core::v1::Pod {
    pod_with_volumes(
        "cache",
        json!([{"name": "c", "emptyDir": {"medium": "Memory", "sizeLimit": size_limit}}]),
    )
}

/// The size of the tmpfs at `path`, in bytes.
fn size_of(path: &std::path::Path) -> u64 {
    let st = rustix::fs::statfs(path).unwrap();
    st.f_blocks * st.f_bsize as u64
}

mount_test! {
    /// A changed `sizeLimit` remounts the tmpfs with the new size and keeps its files; a size
    /// below what it holds is refused with a `VolumeResizeFailed` event and the volume keeps
    /// its size; a size it fits in is taken; without a sizeLimit it is the node's memory.
    fn a_memory_empty_dir_is_resized_in_place_and_never_below_what_it_holds() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let p = cache_pod("8Mi");
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.unwrap();
            let path = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["c"].path.clone();
            assert_eq!(size_of(&path), 8 << 20);
            std::fs::write(path.join("data"), vec![7u8; 3 << 20]).unwrap();

            m.add_pod(cache_pod("16Mi"));
            eventually("grown to 16Mi", 120, || async { size_of(&path) == 16 << 20 }).await;
            assert_eq!(std::fs::read(path.join("data")).unwrap().len(), 3 << 20, "its files are kept");

            m.add_pod(cache_pod("2Mi"));
            let refused = || async {
                m.events().iter().any(|e| e.reason == "VolumeResizeFailed" && e.message.contains("cannot shrink to 2097152 bytes: it holds"))
            };
            eventually("the shrink below what it holds refused", 120, refused).await;
            assert_eq!(size_of(&path), 16 << 20, "it keeps its size");
            assert_eq!(m.pod_status(&kubevol::pod_uid(&p)).unwrap().phase, PodPhase::Ready, "and stays mounted");

            m.add_pod(cache_pod("4Mi"));
            eventually("shrunk to 4Mi", 120, || async { size_of(&path) == 4 << 20 }).await;
            assert_eq!(std::fs::read(path.join("data")).unwrap().len(), 3 << 20);

            // Without a sizeLimit (nor a memory limit) it is the node's allocatable memory, as
            // the kubelet sizes it: never unlimited, and so after a restart.
            let node_memory = kubevol::node::allocatable(&root.path().join("root")).memory as u64;
            let pages = node_memory.div_ceil(4096) * 4096;
            m.add_pod(pod_with_volumes("cache", json!([{"name": "c", "emptyDir": {"medium": "Memory"}}])));
            eventually("sized to the node's memory", 120, || async { size_of(&path) == pages }).await;
            let m = restart(m, root.path(), |_| {}).await;
            let unlimited = pod_with_volumes("cache", json!([{"name": "c", "emptyDir": {"medium": "Memory"}}]));
            m.add_pod(unlimited.clone());
            m.wait_for_attach_and_mount(&unlimited).await.unwrap();
            assert_eq!(size_of(&path), pages, "a restart keeps it sized");
            assert_eq!(std::fs::read(path.join("data")).unwrap().len(), 3 << 20);
            m.shutdown();
        });
    }
}
