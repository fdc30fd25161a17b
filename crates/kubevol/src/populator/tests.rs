use super::*;

fn pod(extra: serde_json::Value) -> Pod {
    let mut v = serde_json::json!({"metadata": {"name": "p"}, "spec": {"containers": []}});
    if let (Some(base), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
        for (k, val) in extra {
            if k == "metadata" {
                base["metadata"]
                    .as_object_mut()
                    .unwrap()
                    .extend(val.as_object().unwrap().clone());
            } else {
                base.insert(k.clone(), val.clone());
            }
        }
    }
    serde_json::from_value(v).unwrap()
}

#[test]
fn terminated_pods_are_finished_or_being_deleted() {
    let rows = [
        ("no status", serde_json::json!({}), false),
        (
            "running",
            serde_json::json!({"status": {"phase": "Running"}}),
            false,
        ),
        (
            "pending",
            serde_json::json!({"status": {"phase": "Pending"}}),
            false,
        ),
        (
            "succeeded",
            serde_json::json!({"status": {"phase": "Succeeded"}}),
            true,
        ),
        (
            "failed",
            serde_json::json!({"status": {"phase": "Failed"}}),
            true,
        ),
        (
            "deleting",
            serde_json::json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}),
            true,
        ),
    ];
    for (name, extra, want) in rows {
        assert_eq!(is_terminated(&pod(extra)), want, "row {name}");
    }
}

#[test]
fn a_long_pass_wakes_the_reconciler_every_so_many_changed_pods() {
    let mut w = Wake::default();
    let woken: Vec<usize> = (1..=3 * WAKE_EVERY)
        .filter(|i| w.count(i % 3 != 0))
        .collect();
    // Two of every three pods change: a wake-up after each WAKE_EVERY of those.
    assert_eq!(
        woken,
        vec![WAKE_EVERY * 3 / 2 - 1, WAKE_EVERY * 3 - 1],
        "unchanged pods do not count"
    );
}

#[test]
fn node_assignment() {
    let on = |node: Option<&str>| {
        let mut p = pod(serde_json::json!({}));
        p.spec.as_mut().unwrap().node_name = node.map(Into::into);
        is_for_node(&p, "node-a")
    };
    assert!(on(None), "no nodeName: this node, as for static pods");
    assert!(on(Some("")));
    assert!(on(Some("node-a")));
    assert!(!on(Some("node-b")));
}
