use std::path::Path;

use super::*;

/// A file read with these objects.
fn load(s: &ObjectStore, path: &Path, objects: Vec<(usize, Object)>) {
    s.apply([Change::File {
        path: path.to_path_buf(),
        content: FileContent::Objects(objects),
    }]);
}

/// A file's content: one pod of that name, in document 1.
fn one_pod(name: &str) -> Vec<(usize, Object)> {
    vec![(
        1,
        Object::Pod(normalize_pod(pod(None, name)), PodExtensions::default()),
    )]
}

fn gone(path: &Path) -> Change {
    Change::File {
        path: path.to_path_buf(),
        content: FileContent::Gone,
    }
}

fn pod(ns: Option<&str>, name: &str) -> Pod {
    let mut p = Pod::default();
    p.metadata.name = Some(name.into());
    p.metadata.namespace = ns.map(Into::into);
    p
}

#[test]
fn derived_uid_is_stable_and_depends_on_namespace_and_name() {
    let a = pod_uid(&pod(None, "web"));
    assert_eq!(
        a,
        pod_uid(&pod(Some("default"), "web")),
        "namespace defaults to default"
    );
    assert_eq!(a, pod_uid(&pod(None, "web")));
    assert_ne!(a, pod_uid(&pod(Some("prod"), "web")));
    assert!(kubevol_core::validation::is_canonical_uuid(a.as_str()));
    let mut explicit = pod(None, "web");
    explicit.metadata.uid = Some("0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70".into());
    assert_eq!(
        pod_uid(&explicit).as_str(),
        "0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70"
    );
}

#[test]
fn an_invalid_config_map_is_kept_with_its_reason_and_reported_for_its_file() {
    let store = ObjectStore::new();
    let file = std::path::Path::new("/m/config.yaml");
    let cm: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "app", "namespace": "prod"},
        "data": {"ok": "1", "bad/key": "2"},
    }))
    .unwrap();
    load(&store, file, vec![(2, Object::ConfigMap(cm))]);
    let errors = store.file_errors();
    assert_eq!(errors.len(), 1);
    assert_eq!(
        (errors[0].path.as_path(), errors[0].document),
        (file, Some(2))
    );
    assert!(
        errors[0].message.starts_with("ConfigMap prod/app is invalid and pods that use it will fail; fix these fields: data[bad/key]: Invalid value: \"bad/key\": a valid config key"),
        "{}",
        errors[0].message
    );
    let stored = store.config_map("prod", "app").expect("kept");
    assert_eq!(
        stored.invalid.as_deref().unwrap(),
        format!(
            "/m/config.yaml (document 2): {}",
            errors[0]
                .message
                .split("fix these fields: ")
                .nth(1)
                .unwrap()
        )
    );
}

#[test]
fn a_file_is_replaced_as_a_whole_and_duplicates_are_reported() {
    let s = ObjectStore::new();
    let a = PathBuf::from("/m/a.yaml");
    let b = PathBuf::from("/m/b.yaml");
    load(
        &s,
        &a,
        vec![
            (
                1,
                Object::Pod(normalize_pod(pod(None, "x")), PodExtensions::default()),
            ),
            (
                2,
                Object::Pod(normalize_pod(pod(None, "y")), PodExtensions::default()),
            ),
        ],
    );
    assert_eq!(s.pods().len(), 2);
    load(&s, &b, one_pod("x"));
    assert_eq!(s.pods().len(), 2);
    let errs = s.file_errors();
    assert_eq!(errs.len(), 1);
    assert!(
        errs[0]
            .to_string()
            .contains("/m/b.yaml: document 1: pod default/x"),
        "{}",
        errs[0]
    );
    load(&s, &a, one_pod("y"));
    assert_eq!(
        s.pods().len(),
        2,
        "x went away from a.yaml, and b.yaml's definition took its place"
    );
    assert!(s.file_errors().is_empty(), "{:?}", s.file_errors());
    s.apply([gone(&a)]);
    assert_eq!(s.pods().len(), 1);
    s.apply([gone(&b)]);
    assert!(s.pods().is_empty());
}

#[test]
fn reloading_identical_content_changes_nothing() {
    let s = ObjectStore::new();
    let a = PathBuf::from("/m/a.yaml");
    let objs = || one_pod("x");
    load(&s, &a, objs());
    let before = s.pods()[0].1.pod.clone();
    let mut rx = s.subscribe();
    rx.borrow_and_update();
    load(&s, &a, objs());
    assert!(!rx.has_changed().unwrap(), "no change announced");
    assert!(
        Arc::ptr_eq(&before, &s.pods()[0].1.pod),
        "the same object is kept"
    );
    load(&s, &a, one_pod("y"));
    assert!(rx.has_changed().unwrap());
}

/// Every pod's (UID, origin), and whether it is the same object as in `before`.
fn pods_seen(s: &ObjectStore) -> Vec<(PodUid, Origin, Arc<Pod>)> {
    s.pods()
        .into_iter()
        .map(|(u, p)| (u, p.origin().clone(), p.pod))
        .collect()
}

#[test]
fn a_renamed_file_keeps_its_pods_in_any_order_of_events() {
    let web = || one_pod("web");
    let (old, new) = (
        PathBuf::from("/m/web.yaml"),
        PathBuf::from("/m/00-web.yaml"),
    );
    let file = |p: &Path| Origin::File {
        path: p.to_path_buf(),
        document: 1,
    };
    // (row, the changes a rename gives, applied one batch at a time)
    let rows: [(&str, Vec<Vec<Change>>); 3] = [
        (
            "one batch",
            vec![vec![
                gone(&old),
                Change::File {
                    path: new.clone(),
                    content: FileContent::Objects(web()),
                },
            ]],
        ),
        (
            "new name read first, old name gone later",
            vec![
                vec![Change::File {
                    path: new.clone(),
                    content: FileContent::Objects(web()),
                }],
                vec![gone(&old)],
            ],
        ),
        (
            "old name gone first, in the same batch as the new name",
            vec![vec![
                Change::File {
                    path: new.clone(),
                    content: FileContent::Objects(web()),
                },
                gone(&old),
            ]],
        ),
    ];
    for (row, batches) in rows {
        let s = ObjectStore::new();
        load(&s, &old, web());
        let before = pods_seen(&s);
        assert_eq!(before[0].1, file(&old), "row {row}");
        let rx = s.subscribe();
        for batch in batches {
            s.apply(batch);
            let now = pods_seen(&s);
            assert_eq!(now.len(), 1, "row {row}: the pod is never gone");
            assert!(
                Arc::ptr_eq(&now[0].2, &before[0].2),
                "row {row}: the same object, so nothing is set up again"
            );
        }
        assert_eq!(pods_seen(&s)[0].1, file(&new), "row {row}");
        assert!(
            s.file_errors().is_empty(),
            "row {row}: {:?}",
            s.file_errors()
        );
        assert!(rx.has_changed().unwrap(), "row {row}: the origin changed");
    }
}

#[test]
fn the_first_file_wins_a_duplicate_whatever_order_they_are_read_in() {
    let (a, b) = (PathBuf::from("/m/a.yaml"), PathBuf::from("/m/b.yaml"));
    let with_label = |v: &str| {
        let mut p = pod(None, "x");
        p.metadata.labels = Some([("from".to_string(), v.to_string())].into());
        vec![(1, Object::Pod(normalize_pod(p), PodExtensions::default()))]
    };
    for order in [[&a, &b], [&b, &a]] {
        let s = ObjectStore::new();
        for path in order {
            let from = path.file_name().unwrap().to_str().unwrap();
            load(&s, path, with_label(from));
        }
        let (_, stored) = s.pods().remove(0);
        let label =
            |stored: &StoredPod| stored.pod.metadata.labels.as_ref().unwrap()["from"].clone();
        assert_eq!(label(&stored), "a.yaml", "order {order:?}");
        let errs = s.file_errors();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(
            errs[0].to_string().starts_with("/m/b.yaml: document 1: pod default/x (uid ")
                && errs[0].message.contains("is also defined by /m/a.yaml (document 1) (the file whose path sorts first wins)"),
            "{}",
            errs[0]
        );
        // The winner goes: the other definition takes over without its file being read.
        s.apply([gone(&a)]);
        let (_, stored) = s.pods().remove(0);
        assert_eq!(label(&stored), "b.yaml");
        assert!(s.file_errors().is_empty());
    }
}

#[test]
fn a_broken_file_keeps_what_it_delivered() {
    let s = ObjectStore::new();
    let a = PathBuf::from("/m/a.yaml");
    load(&s, &a, one_pod("x"));
    let err = ManifestError {
        path: a.clone(),
        document: Some(1),
        line: Some(3),
        column: Some(1),
        message: "bad".into(),
        object: None,
    };
    s.apply([Change::File {
        path: a.clone(),
        content: FileContent::Broken(vec![err.clone()]),
    }]);
    assert_eq!(s.pods().len(), 1);
    assert_eq!(s.file_errors(), vec![err]);
    load(&s, &a, one_pod("x"));
    assert!(s.file_errors().is_empty());
    assert_eq!(s.pods().len(), 1);
}

#[test]
fn the_library_api_wins_over_files_and_removes_only_its_own() {
    let s = ObjectStore::new();
    let a = PathBuf::from("/m/a.yaml");
    load(&s, &a, one_pod("x"));
    let uid = pod_uid(&pod(None, "x"));
    s.apply([Change::Upsert(Box::new(Object::Pod(
        pod(None, "x"),
        PodExtensions::default(),
    )))]);
    assert_eq!(*s.pod(&uid).unwrap().origin(), Origin::Api);
    assert!(s.file_errors()[0]
        .message
        .contains("the library API's definition wins"));
    s.apply([Change::RemovePod(uid.clone())]);
    assert!(
        matches!(s.pod(&uid).unwrap().origin(), Origin::File { .. }),
        "the file's definition is back"
    );
}

#[test]
fn sources_gate_until_all_synced() {
    let s = ObjectStore::new();
    assert!(s.all_sources_synced());
    s.register_source("file");
    assert!(!s.all_sources_synced());
    s.mark_source_synced("file");
    assert!(s.all_sources_synced());
}
