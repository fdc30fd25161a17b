//! CSI migration: in-tree volumes served by the CSI driver that replaced each plugin, with the
//! handle and attributes the Kubernetes translation library gives, through the real loop driver
//! running under each driver's name (the disks made beforehand, as a cloud's are).

use super::*;
use kubevol_csi::v1::controller_client::ControllerClient;
use kubevol_csi::v1::*;

/// Makes the disk `handle` in the driver behind `socket`, as a cloud's disk exists before its
/// in-tree PersistentVolume names it.
async fn make_disk(socket: &Path, handle: &str) {
    let mut c = ControllerClient::new(kubevol_csi::connect(socket));
    let cap = VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(
            volume_capability::MountVolume::default(),
        )),
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
    };
    c.create_volume(CreateVolumeRequest {
        name: handle.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: 16 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap],
        ..Default::default()
    })
    .await
    .unwrap();
}

mount_test! {
    /// In-tree volumes through their CSI driver (CSI migration), with what the translation
    /// gives: a gcePersistentDisk PersistentVolume (zone label, ReadWriteMany, which in-tree
    /// treated as ReadWriteOnce) and an inline gcePersistentDisk, served by a driver named
    /// pd.csi.storage.gke.io (the loop driver under that name, the disks made beforehand as a
    /// cloud's are), attached, staged and published with the translated handles and attributes.
    fn in_tree_volumes_are_served_by_their_csi_driver() {
        const GCE: &str = "pd.csi.storage.gke.io";
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &["--driver-name", GCE]);
        runtime().block_on(async {
            let zonal = "projects/UNSPECIFIED/zones/europe-west1-b/disks/disk-1";
            let unspecified = "projects/UNSPECIFIED/zones/UNSPECIFIED/disks/disk-2";
            for handle in [zonal, unspecified] {
                make_disk(&driver.socket(), handle).await;
            }
            let socket = t.path().join("driver/csi.sock");
            let m = manager(t.path(), |c| {
                c.csi_controllers = vec![(GCE.into(), socket)];
                c.node_labels = [("topology.kubernetes.io/zone".to_string(), "europe-west1-b".to_string())].into();
            });
            m.library().upsert_objects(objects(json!([
                {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "old-disk", "labels": {"topology.kubernetes.io/zone": "europe-west1-b"}},
                 "spec": {"capacity": {"storage": "16Mi"}, "accessModes": ["ReadWriteMany"], "claimRef": {"namespace": "default", "name": "old"},
                          "gcePersistentDisk": {"pdName": "disk-1", "fsType": "ext4"},
                          "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["europe-west1-b"]}]}]}}}},
            ])));
            let mut claim = pvc("old", "Filesystem");
            claim["spec"]["volumeName"] = json!("old-disk");
            m.library().upsert_objects(objects(json!([claim])));
            let p = claim_pod("app", "old");
            let inline = pod_with_volumes("inline", json!([{"name": "disk", "gcePersistentDisk": {"pdName": "disk-2", "fsType": "ext4"}}]));
            m.add_pod(p.clone());
            m.add_pod(inline.clone());
            m.wait_for_attach_and_mount(&p).await.expect("the PersistentVolume through CSI");
            m.wait_for_attach_and_mount(&inline).await.expect("the inline volume through CSI");

            let s = m.pod_status(&kubevol::pod_uid(&p)).unwrap();
            assert_eq!(s.volumes[0].unique_name.as_deref(), Some(format!("kubernetes.io/csi/{GCE}^{zonal}").as_str()), "{s:#?}");
            let stage = driver.requests("NodeStageVolume");
            let staged: Vec<&str> = stage.iter().filter_map(|r| r["volume_id"].as_str()).collect();
            assert!(staged.contains(&zonal) && staged.contains(&unspecified), "{stage:?}");
            let first = stage.iter().find(|r| r["volume_id"] == zonal).unwrap();
            assert_eq!(first["context"], json!({"partition": ""}), "the translation's attributes: {first}");
            let single_node_writer = kubevol_csi::v1::volume_capability::access_mode::Mode::SingleNodeWriter as i32;
            assert_eq!(first["access_mode"], json!(single_node_writer), "ReadWriteMany is ReadWriteOnce for a migrated GCE PD");
            assert_eq!(driver.count("ControllerPublishVolume", "Ok"), 2, "both attached through the driver's controller");
            // The inline volume's directory is named after the translated volume.
            let path = mount_path(&m, &inline, "disk");
            assert!(path.ends_with(format!("volumes/kubernetes.io~csi/{GCE}-disk-2/mount")), "{}", path.display());
            std::fs::write(path.join("kept"), "yes").unwrap();

            for q in [&p, &inline] {
                m.remove_pod(q);
                m.wait_for_unmount(q).await.unwrap();
            }
            wait_until("both detached", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 2).await;
            m.shutdown();
        });
    }
}

mount_test! {
    /// The other migrated block plugins end to end, each through its own driver: an
    /// awsElasticBlockStore, azureDisk, cinder, vsphereVolume and portworxVolume
    /// PersistentVolume bound to a claim is attached, staged and published by
    /// ebs.csi.aws.com, disk.csi.azure.com, cinder.csi.openstack.org, csi.vsphere.vmware.com
    /// and pxd.portworx.com with the translated handle and attributes, under the CSI unique
    /// name, and detached after its pod.
    fn every_migrated_block_plugin_is_served_by_its_csi_driver() {
        let azure_uri = "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/rg/providers/Microsoft.Compute/disks/disk-a";
        let cases = [
            ("ebs.csi.aws.com", json!({"awsElasticBlockStore": {"volumeID": "aws://eu-west-1a/vol-0a1b2c3d4e5f67890", "fsType": "ext4"}}),
             "vol-0a1b2c3d4e5f67890", json!({"partition": "0"})),
            ("disk.csi.azure.com", json!({"azureDisk": {"diskName": "disk-a", "diskURI": azure_uri, "kind": "Managed", "cachingMode": "ReadOnly", "fsType": "ext4"}}),
             azure_uri, json!({"cachingmode": "ReadOnly", "fstype": "ext4", "kind": "Managed"})),
            ("cinder.csi.openstack.org", json!({"cinder": {"volumeID": "8b2c4f6e-0000-4000-8000-000000000001", "fsType": "ext4"}}),
             "8b2c4f6e-0000-4000-8000-000000000001", json!({})),
            ("csi.vsphere.vmware.com", json!({"vsphereVolume": {"volumePath": "[vsanDatastore] kubevols/disk-v.vmdk", "fsType": "ext4", "storagePolicyName": "gold"}}),
             "[vsanDatastore] kubevols/disk-v.vmdk", json!({"storagepolicyname": "gold"})),
            ("pxd.portworx.com", json!({"portworxVolume": {"volumeID": "px-vol-1", "fsType": "ext4"}}),
             "px-vol-1", json!({})),
        ];
        let t = TestRoot::new();
        for (i, (driver_name, source, handle, context)) in cases.into_iter().enumerate() {
            let dir = t.path().join(format!("case-{i}"));
            let driver = Driver::start(&dir.join("driver"), Some(&registry(&dir)), &["--driver-name", driver_name]);
            runtime().block_on(async {
                make_disk(&driver.socket(), handle).await;
                let m = manager(&dir, |c| c.csi_controllers = vec![(driver_name.into(), driver.socket())]);
                let mut spec = json!({"capacity": {"storage": "16Mi"}, "accessModes": ["ReadWriteOnce"], "claimRef": {"namespace": "default", "name": "old"}});
                spec.as_object_mut().unwrap().extend(source.as_object().unwrap().clone());
                let mut claim = pvc("old", "Filesystem");
                claim["spec"]["volumeName"] = json!("old-disk");
                m.library().upsert_objects(objects(json!([
                    {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "old-disk"}, "spec": spec},
                    claim,
                ])));
                let p = claim_pod("app", "old");
                m.add_pod(p.clone());
                m.wait_for_attach_and_mount(&p).await.unwrap_or_else(|e| panic!("{driver_name}: {e}"));

                let s = m.pod_status(&kubevol::pod_uid(&p)).unwrap();
                assert_eq!(s.volumes[0].unique_name.as_deref(), Some(format!("kubernetes.io/csi/{driver_name}^{handle}").as_str()), "{s:#?}");
                let published = driver.requests("ControllerPublishVolume");
                assert_eq!(published.len(), 1, "{driver_name}: attached through the driver's controller: {published:?}");
                assert_eq!(published[0]["volume_id"], json!(handle), "{driver_name}");
                let stage = driver.requests("NodeStageVolume");
                assert_eq!(stage.len(), 1, "{driver_name}: {stage:?}");
                assert_eq!(stage[0]["volume_id"], json!(handle), "{driver_name}");
                assert_eq!(stage[0]["context"].as_object().cloned().unwrap_or_default(), context.as_object().cloned().unwrap(), "{driver_name}: the translation's attributes");
                let path = mount_path(&m, &p, "data");
                std::fs::write(path.join("written"), driver_name).unwrap();

                m.remove_pod(&p);
                m.wait_for_unmount(&p).await.unwrap();
                wait_until("detached", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 1).await;
                m.shutdown();
            });
        }
    }
}
