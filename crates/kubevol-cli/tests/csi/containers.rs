//! A block volume of the loop driver in a real container (crun): the device appears at the
//! container's `devicePath` and reads its size.

use super::*;
use common::runtime::Runtime;

mount_test! {
    /// A claim with volumeMode Block, used in volumeDevices: the container finds a block
    /// device at its devicePath, of the volume's size, and what it writes there is on the
    /// volume's device on the host.
    fn a_block_volume_appears_in_a_container_at_its_device_path_with_its_size() {
        let t = TestRoot::new();
        let _driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        let rt = Runtime::new(&t.path().join("runtime"));
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            m.library().upsert_objects(objects(json!([csi_driver(true), pv("raw", "16Mi", "Block"), pvc("raw", "Block")])));
            let block = pod(json!({"metadata": {"name": "blk", "namespace": "default"}, "spec": {
                "containers": [{"name": "c", "command": ["sh", "-c",
                    "stat -c %F /dev/xvda; blockdev --getsize64 /dev/xvda; echo marked | dd of=/dev/xvda conv=notrunc 2>/dev/null"],
                    "volumeDevices": [{"name": "raw", "devicePath": "/dev/xvda"}]}],
                "volumes": [{"name": "raw", "persistentVolumeClaim": {"claimName": "raw"}}]}}));
            m.add_pod(block.clone());
            m.wait_for_attach_and_mount(&block).await.unwrap();
            let mounts = m.container_mounts(&block, "c").unwrap();
            assert_eq!(mounts.devices.len(), 1, "{mounts:?}");
            assert_eq!(mounts.devices[0].container_path, "/dev/xvda");
            let out = rt.run(&m, &block, "c");
            assert_eq!(out, "block special file\n16777216\n");
            let mut head = [0u8; 7];
            use std::io::Read;
            std::fs::File::open(&mounts.devices[0].host_path).unwrap().read_exact(&mut head).unwrap();
            assert_eq!(&head, b"marked\n");
            m.remove_pod(&block);
            m.wait_for_unmount(&block).await.unwrap();
            m.shutdown();
        });
    }
}
