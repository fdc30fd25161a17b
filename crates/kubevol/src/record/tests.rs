use super::*;

/// A volume's SELinux label survives the record, so that reconstruction knows the label
/// the volume is mounted with.
#[test]
fn the_selinux_label_is_recorded() {
    let spec = kubevol_core::state::VolumeSpec {
        volume: serde_json::from_value::<Volume>(
            serde_json::json!({"name": "v", "persistentVolumeClaim": {"claimName": "c"}}),
        )
        .unwrap()
        .into(),
        persistent_volume: None,
        block: false,
        extensions: Default::default(),
        selinux_label: Some("system_u:object_r:container_file_t:s0:c1,c2".into()),
        selinux_mount: true,
    };
    let text = serde_json::to_string(&SpecRecord::of(&spec)).unwrap();
    let back: SpecRecord = serde_json::from_str(&text).unwrap();
    let again = back.spec();
    assert_eq!(again.selinux_label, spec.selinux_label, "{text}");
    assert!(again.selinux_mount);
    // Records written before the label existed read as no label.
    let old: SpecRecord =
        serde_json::from_str(r#"{"volume": {"name": "v", "emptyDir": {}}}"#).unwrap();
    assert!(old.selinux.is_none());
}

fn pod_record(uid: &str, volume: &str) -> PodVolumeRecord {
    PodVolumeRecord {
        version: VERSION,
        state: PodVolumeState::SettingUp,
        pod: PodRef {
            namespace: "default".into(),
            name: "web".into(),
            uid: PodUid(uid.into()),
        },
        source: "/m/web.yaml, document 1".into(),
        volume: volume.into(),
        unique_name: UniqueVolumeName::from(format!("kubernetes.io/empty-dir/{uid}-{volume}")),
        traits: TraitsRecord {
            plugin: "kubernetes.io/empty-dir".into(),
            attachable: false,
            device_mountable: false,
        },
        path: PathBuf::from("/r/pods/x/volumes/kubernetes.io~empty-dir/cache"),
        read_only: false,
        sub_paths: Vec::new(),
        spec: SpecRecord {
            volume: Volume {
                name: volume.into(),
                ..Default::default()
            }
            .into(),
            persistent_volume: None,
            block: false,
            selinux: None,
        },
    }
}

fn journal_lines(root: &Path) -> Vec<String> {
    std::fs::read_to_string(root.join(RECORD_DIR).join(JOURNAL))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commits_are_batched_and_keep_their_order_per_volume() {
    let t = tempfile::tempdir().unwrap();
    let rec = Arc::new(Record::open(t.path()).unwrap());
    // Many pods at once, each an intent then its outcome.
    let mut tasks = Vec::new();
    for i in 0..300 {
        let rec = rec.clone();
        tasks.push(tokio::spawn(async move {
            let mut r = pod_record(&format!("uid-{i}"), "cache");
            rec.commit(Change::PodVolume(r.clone()), true).await?;
            r.state = PodVolumeState::SetUp;
            rec.commit(Change::PodVolume(r), false).await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    // Two changes to one volume submitted together: applied in the order submitted.
    let mut last = pod_record("uid-0", "cache");
    last.state = PodVolumeState::TearingDown;
    let (a, b) = tokio::join!(
        rec.commit(
            Change::RemovePodVolume {
                pod: PodUid("uid-1".into()),
                volume: "cache".into(),
                unique: pod_record("uid-1", "cache").unique_name,
            },
            false
        ),
        rec.commit(Change::PodVolume(last), true)
    );
    a.unwrap();
    b.unwrap();
    let loaded = Record::read(t.path()).unwrap();
    assert!(loaded.corrupt.is_empty(), "{:?}", loaded.corrupt);
    assert_eq!(loaded.pods.len(), 299, "uid-1 removed");
    let state = |uid: &str| {
        loaded
            .pods
            .iter()
            .find(|p| p.pod.uid.as_str() == uid)
            .map(|p| p.state)
    };
    assert_eq!(state("uid-0"), Some(PodVolumeState::TearingDown));
    assert_eq!(state("uid-1"), None);
    assert_eq!(state("uid-299"), Some(PodVolumeState::SetUp));
    assert_eq!(
        journal_lines(t.path()).len(),
        602,
        "an intent and an outcome per pod, a removal and an intent"
    );
    assert_eq!(rec.load().pods.len(), 299, "the writer's view is the same");
}

/// The files of this process's open descriptors under `dir`.
fn open_under(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|target| target.starts_with(dir))
        .collect()
}

#[tokio::test]
async fn a_dropped_record_leaves_nothing_open_under_the_root() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().canonicalize().unwrap();
    let rec = Arc::new(Record::open(&root).unwrap());
    rec.commit(Change::PodVolume(pod_record("u1", "cache")), true)
        .await
        .unwrap();
    assert!(
        !open_under(&root).is_empty(),
        "the writer thread holds the journal open"
    );
    drop(rec);
    assert_eq!(open_under(&root), Vec::<PathBuf>::new());
}

#[tokio::test]
async fn records_round_trip_and_are_human_readable() {
    let t = tempfile::tempdir().unwrap();
    let rec = Arc::new(Record::open(t.path()).unwrap());
    let mut r = pod_record("u1", "cache");
    rec.commit(Change::PodVolume(r.clone()), true)
        .await
        .unwrap();
    r.state = PodVolumeState::SetUp;
    rec.commit(Change::PodVolume(r.clone()), false)
        .await
        .unwrap();
    let lines = journal_lines(t.path());
    assert_eq!(lines.len(), 2, "one line per change: {lines:?}");
    assert!(lines[0].contains("\"version\":1"), "{}", lines[0]);
    assert!(lines[0].contains("\"state\":\"settingUp\""), "{}", lines[0]);
    assert!(lines[1].contains("\"state\":\"setUp\""), "{}", lines[1]);
    rec.commit(Change::PodVolume(r.clone()), false)
        .await
        .unwrap();
    assert_eq!(
        journal_lines(t.path()).len(),
        2,
        "an unchanged outcome writes nothing"
    );
    let loaded = rec.load();
    assert_eq!(loaded.pods.len(), 1);
    assert_eq!(loaded.pods[0].state, PodVolumeState::SetUp);
    // The same volume recorded under its directory's name replaces the first record.
    let mut renamed = r.clone();
    renamed.volume = "cache-dir".into();
    rec.commit(Change::PodVolume(renamed), false).await.unwrap();
    let loaded = rec.load();
    assert_eq!(loaded.pods.len(), 1);
    assert_eq!(loaded.pods[0].volume, "cache-dir");
    let removal = Change::RemovePodVolume {
        pod: r.pod.uid.clone(),
        volume: r.volume.clone(),
        unique: r.unique_name.clone(),
    };
    rec.commit(removal.clone(), false).await.unwrap();
    assert!(rec.load().pods.is_empty());
    rec.commit(removal, false).await.unwrap();
    assert_eq!(
        journal_lines(t.path()).len(),
        4,
        "removing what is not there writes nothing"
    );
    drop(rec);
    let reopened = Record::open(t.path()).unwrap();
    assert!(reopened.load().pods.is_empty(), "the removal is read back");
}

#[tokio::test]
async fn torn_corrupt_and_foreign_version_lines_are_dropped_or_reported() {
    let t = tempfile::tempdir().unwrap();
    let rec = Arc::new(Record::open(t.path()).unwrap());
    for uid in ["u1", "u2", "u3"] {
        let r = pod_record(uid, "cache");
        rec.commit(Change::PodVolume(r), true).await.unwrap();
    }
    drop(rec);
    let journal = t.path().join(RECORD_DIR).join(JOURNAL);
    let lines = journal_lines(t.path());
    // Line 1 cut in half, line 2 of a format to come, line 3 whole, then a write cut short.
    let text = format!(
        "{}\n{}\n{}\n{}",
        &lines[0][..lines[0].len() / 2],
        lines[1].replace("\"version\":1", "\"version\":7"),
        lines[2],
        &lines[0][..10],
    );
    std::fs::write(&journal, &text).unwrap();
    let read = Record::read(t.path()).unwrap();
    assert_eq!(
        std::fs::read_to_string(&journal).unwrap(),
        text,
        "reading changes nothing"
    );
    assert_eq!(read.pods.len(), 1);
    let rec = Record::open(t.path()).unwrap();
    let loaded = rec.load();
    assert_eq!(loaded.pods.len(), 1);
    assert_eq!(loaded.pods[0].pod.uid.as_str(), "u3");
    assert_eq!(loaded.corrupt.len(), 2, "{:?}", loaded.corrupt);
    assert_eq!(loaded.corrupt[0].line, Some(1));
    let message = loaded.corrupt[1].to_string();
    assert!(message.contains(", line 2,"), "{message}");
    assert!(message.contains("format version 7"), "{message}");
    assert!(message.contains("possibly mounted"), "{message}");
    assert_eq!(
        std::fs::read_to_string(journal.with_file_name("journal.corrupt")).unwrap(),
        text,
        "the journal as it was is kept"
    );
    assert_eq!(
        journal_lines(t.path()).len(),
        1,
        "compacted to what is live"
    );
    drop(rec);
    assert!(
        Record::open(t.path()).unwrap().load().corrupt.is_empty(),
        "reported once"
    );
}

#[tokio::test]
async fn records_of_the_earlier_layout_move_into_the_journal() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join(RECORD_DIR);
    let r = pod_record("u1", "cache");
    let pods = dir.join("pods").join("u1");
    std::fs::create_dir_all(&pods).unwrap();
    let file = pods.join("cache.0123456789abcdef.json");
    std::fs::write(&file, serde_json::to_vec_pretty(&r).unwrap()).unwrap();
    std::fs::write(pods.join("other.1.json.tmp"), "{").unwrap();
    let bad = pods.join("broken.2.json");
    std::fs::write(&bad, "{\"version\": 1,").unwrap();
    std::fs::create_dir_all(dir.join("volumes")).unwrap();
    let rec = Arc::new(Record::open(t.path()).unwrap());
    let loaded = rec.load();
    assert_eq!(loaded.pods.len(), 1);
    assert_eq!(loaded.pods[0].volume, "cache");
    assert_eq!(loaded.corrupt.len(), 1);
    assert!(
        loaded.corrupt[0]
            .to_string()
            .contains("(volume \"broken\" of pod u1)"),
        "{}",
        loaded.corrupt[0]
    );
    assert!(!file.exists(), "moved into the journal");
    assert!(bad.exists(), "an unreadable file is left for a human");
    assert!(!pods.join("other.1.json.tmp").exists());
    assert_eq!(journal_lines(t.path()).len(), 1);
    let mut done = r.clone();
    done.state = PodVolumeState::SetUp;
    rec.commit(Change::PodVolume(done), false).await.unwrap();
    drop(rec);
    let loaded = Record::open(t.path()).unwrap().load();
    assert_eq!(loaded.pods[0].state, PodVolumeState::SetUp);
}

#[tokio::test]
async fn a_journal_with_many_dead_lines_is_compacted() {
    let t = tempfile::tempdir().unwrap();
    let rec = Arc::new(Record::open(t.path()).unwrap());
    rec.commit(Change::PodVolume(pod_record("other", "v")), false)
        .await
        .unwrap();
    let device = UniqueVolumeName::from("kubernetes.io/csi/loop^pv1");
    rec.commit(Change::Device(device_record(&device)), false)
        .await
        .unwrap();
    let mut r = pod_record("u1", "cache");
    let rounds = journal::COMPACT_SLACK + 100;
    for i in 0..rounds {
        r.state = if i % 2 == 0 {
            PodVolumeState::SettingUp
        } else {
            PodVolumeState::SetUp
        };
        rec.commit(Change::PodVolume(r.clone()), false)
            .await
            .unwrap();
    }
    let lines = journal_lines(t.path()).len();
    assert!(lines < 200, "{lines} lines for 3 records: compacted");
    assert_eq!(
        rec.device(&device).unwrap().expanded_size,
        Some(1 << 30),
        "a node-wide record is read from where the compaction put it"
    );

    // The running record follows its lines into the compacted journal.
    let last = rec.load();
    assert_eq!(last.pods.len(), 2);
    let u1 = last
        .pods
        .iter()
        .find(|p| p.pod.uid.as_str() == "u1")
        .unwrap();
    assert_eq!(u1.state, r.state, "the latest line is the live one");
    rec.commit(Change::PodVolume(r.clone()), false)
        .await
        .unwrap();
    assert_eq!(
        journal_lines(t.path()).len(),
        lines,
        "an unchanged outcome is seen as unchanged in the new journal: nothing written"
    );
    r.state = PodVolumeState::TearingDown;
    rec.commit(Change::PodVolume(r.clone()), false)
        .await
        .unwrap();
    assert_eq!(journal_lines(t.path()).len(), lines + 1);
    let u1 = rec
        .load()
        .pods
        .into_iter()
        .find(|p| p.pod.uid.as_str() == "u1");
    assert_eq!(u1.unwrap().state, PodVolumeState::TearingDown);

    drop(rec);
    let loaded = Record::read(t.path()).unwrap();
    assert_eq!(loaded.pods.len(), 2);
    assert!(!t.path().join(RECORD_DIR).join("journal.new").exists());
}

fn device_record(name: &UniqueVolumeName) -> DeviceRecord {
    DeviceRecord {
        version: VERSION,
        unique_name: name.clone(),
        traits: TraitsRecord {
            plugin: "kubernetes.io/csi".into(),
            attachable: true,
            device_mountable: true,
        },
        attach: Some(DeviceStepState::Done),
        device_mount: Some(DeviceStepState::Starting),
        device_mount_path: Some("/r/plugins/g".into()),
        publish_context: [("devicePath".to_string(), "/dev/loop3".to_string())].into(),
        expanded_size: Some(1 << 30),
        spec: pod_record("u", "v").spec,
    }
}

#[tokio::test]
async fn device_records_keep_attach_stage_and_size() {
    let t = tempfile::tempdir().unwrap();
    let rec = Arc::new(Record::open(t.path()).unwrap());
    let name = UniqueVolumeName::from("kubernetes.io/csi/loop^pv1");
    let d = device_record(&name);
    rec.commit(Change::Device(d.clone()), true).await.unwrap();
    assert_eq!(rec.device(&name).unwrap().expanded_size, Some(1 << 30));
    let loaded = Record::read(t.path()).unwrap();
    assert_eq!(loaded.devices.len(), 1);
    assert_eq!(
        loaded.devices[0].device_mount,
        Some(DeviceStepState::Starting)
    );
    assert_eq!(
        loaded.devices[0].publish_context["devicePath"],
        "/dev/loop3"
    );
    let later = DeviceRecord {
        expanded_size: None,
        device_mount: Some(DeviceStepState::Done),
        ..d.clone()
    };
    rec.commit(Change::Device(later), false).await.unwrap();
    assert_eq!(
        rec.device(&name).unwrap().expanded_size,
        Some(1 << 30),
        "a later write keeps the recorded size"
    );
    rec.set_expanded_size(&name, 2 << 30).await.unwrap();
    let loaded = Record::read(t.path()).unwrap();
    assert_eq!(loaded.devices[0].expanded_size, Some(2 << 30));
    rec.commit(Change::RemoveDevice(name.clone()), false)
        .await
        .unwrap();
    assert!(rec.load().devices.is_empty());
}
