//! A node shared by tenants: what one tenant, with a namespaced Role and nothing more, can make
//! the node do, against the real control plane.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::{bound_pod, cluster_manager, typed, NODE};
use kubevol_testserver::{Backend, TestCluster};
use serde_json::json;

/// A client of `cluster` with a tenant's identity: a ServiceAccount of the test's namespace
/// bound to a Role that allows pods, Secrets, ConfigMaps, claims and service accounts there,
/// and nothing else.
async fn tenant_client(cluster: &TestCluster) -> kube::Client {
    let ns = cluster.namespace().to_string();
    cluster
        .create(
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant"}}),
        )
        .await;
    let admin = cluster.admin_client();
    let role: k8s_openapi::api::rbac::v1::Role = serde_json::from_value(json!({"metadata": {"name": "tenant"},
        "rules": [{"apiGroups": [""], "resources": ["pods", "secrets", "configmaps", "persistentvolumeclaims", "serviceaccounts"],
                   "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}]})).unwrap();
    kube::Api::namespaced(admin.clone(), &ns)
        .create(&Default::default(), &role)
        .await
        .expect("the tenant's Role");
    let binding: k8s_openapi::api::rbac::v1::RoleBinding =
        serde_json::from_value(json!({"metadata": {"name": "tenant"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}]}))
        .unwrap();
    kube::Api::namespaced(admin, &ns)
        .create(&Default::default(), &binding)
        .await
        .expect("the tenant's RoleBinding");
    let accounts: kube::Api<k8s_openapi::api::core::v1::ServiceAccount> =
        kube::Api::namespaced(cluster.admin_client(), &ns);
    let request: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 3600}}))
            .unwrap();
    let token = accounts
        .create_token_request("tenant", &Default::default(), &request)
        .await
        .expect("a token for the tenant");
    let token = token.status.expect("issued").token;
    let mut config = cluster.node_config();
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..Default::default()
    };
    config.default_namespace = ns;
    kubevol::source::cluster::client(config).expect("the tenant's client")
}

mount_test! {
    /// A tenant patches a Secret eight times a second that its pods all mount: each volume
    /// is written again at most once a second, however many patches (the cost is volumes per
    /// second, not patches × volumes), and every volume ends with the last version.
    /// `KUBEVOL_TEST_TENANT_PODS` sets the pods (100; the docs' figure is of 1,000).
    fn a_tenants_secret_patched_eight_times_a_second_costs_a_write_a_second_per_volume() {
        let pods: usize = std::env::var("KUBEVOL_TEST_TENANT_PODS").ok().and_then(|s| s.parse().ok()).unwrap_or(100);
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let tenant = tenant_client(&cluster).await;
            let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> = kube::Api::default_namespaced(tenant.clone());
            let pods_api: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::default_namespaced(tenant.clone());
            let secret = |v: usize| -> k8s_openapi::api::core::v1::Secret {
                serde_json::from_value(json!({"metadata": {"name": "hot"}, "stringData": {"v": v.to_string()}})).unwrap()
            };
            secrets.create(&Default::default(), &secret(0)).await.expect("the tenant makes its Secret");
            let m = cluster_manager(root.path(), &cluster);
            let mut made = Vec::new();
            for i in 0..pods {
                let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(bound_pod(&format!("reader-{i}"), &node, json!([{"name": "s", "secret": {"secretName": "hot"}}]))).unwrap();
                made.push(pods_api.create(&Default::default(), &pod).await.expect("the tenant makes its pods"));
            }
            let mut dirs = Vec::new();
            for p in &made {
                let p = typed(&serde_json::to_value(p).unwrap());
                m.wait_for_attach_and_mount(&p).await.expect("mounted");
                dirs.push(m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["s"].path.clone());
            }
            let before = volume_writes(&m, "kubernetes.io/secret");
            let start = Instant::now();
            let mut last = 0;
            while start.elapsed() < Duration::from_secs(5) {
                last += 1;
                secrets.replace("hot", &Default::default(), &secret(last)).await.expect("the tenant patches its Secret");
                tokio::time::sleep(Duration::from_millis(125)).await;
            }
            // The writes are bounded by the patches' window alone: a turn a second while they
            // came, the first and the last each one more; reaching the last version may take
            // a loaded machine longer, which is timed apart and costs no more writes.
            let window = start.elapsed();
            let reads = |want: usize| dirs.iter().all(|d| std::fs::read_to_string(d.join("v")).is_ok_and(|v| v == want.to_string()));
            kubevol_testserver::cluster::eventually("the last version in every volume", 120, || async { reads(last) }).await;
            let elapsed = start.elapsed();
            let writes = volume_writes(&m, "kubernetes.io/secret") - before;
            println!("{pods} pods x 1 Secret patched {last} times in {window:.1?} (the last version everywhere after {elapsed:.1?}): {writes} volume writes, {:.2} per volume per second of patches",
                writes as f64 / window.as_secs_f64() / pods as f64);
            let turns = window.as_secs() + 2;
            assert!(writes <= (pods as u64) * turns, "{writes} writes of {pods} volumes in {turns} turns");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// A tenant patches its own pod's annotation ten times a second: the configMap volumes
    /// (which project nothing of the pod) are not set up again at all, and the downwardAPI
    /// volumes that project the annotations are written at most once a second each (those that
    /// project only the labels not at all), ending with the last value.
    fn a_pods_own_changes_rewrite_only_the_volumes_that_project_them_and_at_a_pace() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let tenant = tenant_client(&cluster).await;
            let configs: kube::Api<k8s_openapi::api::core::v1::ConfigMap> = kube::Api::default_namespaced(tenant.clone());
            let pods_api: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::default_namespaced(tenant.clone());
            configs.create(&Default::default(), &serde_json::from_value(json!({"metadata": {"name": "cfg"}, "data": {"k": "v"}})).unwrap()).await.expect("the tenant's ConfigMap");
            let downward = |field: &str| json!({"items": [{"path": "f", "fieldRef": {"fieldPath": field}}]});
            let mut volumes: Vec<serde_json::Value> = (0..20).map(|i| json!({"name": format!("cm{i}"), "configMap": {"name": "cfg"}})).collect();
            volumes.extend((0..10).map(|i| json!({"name": format!("ann{i}"), "downwardAPI": downward("metadata.annotations")})));
            volumes.extend((0..10).map(|i| json!({"name": format!("lab{i}"), "downwardAPI": downward("metadata.labels")})));
            let mut pod = bound_pod("busy", &node, json!(volumes));
            pod["metadata"]["annotations"] = json!({"n": "0"});
            let m = cluster_manager(root.path(), &cluster);
            let made = pods_api.create(&Default::default(), &serde_json::from_value(pod).unwrap()).await.expect("the tenant's pod");
            let p = typed(&serde_json::to_value(&made).unwrap());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let ann = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["ann0"].path.clone();
            let (cm_before, dw_before) = (volume_writes(&m, "kubernetes.io/configmap"), volume_writes(&m, "kubernetes.io/downward-api"));
            let start = Instant::now();
            let mut last = 0;
            while start.elapsed() < Duration::from_secs(3) {
                last += 1;
                let patch = kube::api::Patch::Merge(json!({"metadata": {"annotations": {"n": last.to_string()}}}));
                pods_api.patch("busy", &Default::default(), &patch).await.expect("the tenant patches its pod");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let window = start.elapsed();
            let want = format!("n=\"{last}\"");
            kubevol_testserver::cluster::eventually("the last annotation in the volume", 120, || async { std::fs::read_to_string(ann.join("f")).is_ok_and(|t| t == want) }).await;
            let (cm, dw) = (volume_writes(&m, "kubernetes.io/configmap") - cm_before, volume_writes(&m, "kubernetes.io/downward-api") - dw_before);
            println!("1 pod of 20 configMap and 20 downwardAPI volumes, its annotation patched {last} times in {window:.1?}: {cm} configMap set-ups, {dw} downwardAPI writes");
            assert_eq!(cm, 0, "a configMap volume projects nothing of its pod");
            let turns = window.as_secs() + 2;
            assert!(dw >= 1 && dw <= 10 * turns, "{dw} writes of the 10 annotation volumes in {turns} turns (the label volumes none)");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// Five projected volumes read the same ten Secrets, and the tenant patches each Secret
    /// once a second: each volume is written at most once a second, however many of its
    /// sources changed (each object's own pace let every volume be written once per object).
    fn a_volume_of_many_changing_objects_is_written_once_a_turn() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let tenant = tenant_client(&cluster).await;
            let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> = kube::Api::default_namespaced(tenant.clone());
            let pods_api: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::default_namespaced(tenant.clone());
            let secret = |i: usize, v: usize| -> k8s_openapi::api::core::v1::Secret {
                serde_json::from_value(json!({"metadata": {"name": format!("s{i}")}, "stringData": {format!("k{i}"): v.to_string()}})).unwrap()
            };
            for i in 0..10 {
                secrets.create(&Default::default(), &secret(i, 0)).await.expect("the tenant's Secrets");
            }
            let sources: Vec<serde_json::Value> = (0..10).map(|i| json!({"secret": {"name": format!("s{i}")}})).collect();
            let volumes: Vec<serde_json::Value> = (0..5).map(|v| json!({"name": format!("all{v}"), "projected": {"sources": sources}})).collect();
            let m = cluster_manager(root.path(), &cluster);
            let made = pods_api.create(&Default::default(), &serde_json::from_value(bound_pod("fan-in", &node, json!(volumes))).unwrap()).await.expect("the tenant's pod");
            let p = typed(&serde_json::to_value(&made).unwrap());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let dirs: Vec<_> = (0..5).map(|v| m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))[&format!("all{v}")].path.clone()).collect();
            let before = volume_writes(&m, "kubernetes.io/projected");
            let start = Instant::now();
            let mut round = 0;
            while start.elapsed() < Duration::from_secs(4) {
                round += 1;
                for i in 0..10 {
                    secrets.replace(&format!("s{i}"), &Default::default(), &secret(i, round)).await.expect("the tenant patches its Secret");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            let window = start.elapsed();
            let done = || dirs.iter().all(|d| (0..10).all(|i| std::fs::read_to_string(d.join(format!("k{i}"))).is_ok_and(|v| v == round.to_string())));
            kubevol_testserver::cluster::eventually("the last version of every Secret in every volume", 120, || async { done() }).await;
            let writes = volume_writes(&m, "kubernetes.io/projected") - before;
            println!("5 projected volumes of 10 Secrets, each patched once a second for {window:.1?}: {writes} volume writes");
            let turns = window.as_secs() + 2;
            assert!(writes <= 5 * turns, "{writes} writes of 5 volumes in {turns} turns");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// A tenant's pod mounts a hostPath the node allows; the tenant (who can write the allowed
    /// directory, as a hostPath pod can) swaps it for a link to `/etc`: the path kubevol hands
    /// out is still the directory checked, and the tenant's next pod naming the path is refused.
    fn a_tenants_allowed_host_path_swapped_for_a_link_hands_out_what_was_checked() {
        let root = TestRoot::new();
        let allowed = root.path().join("hostok");
        std::fs::create_dir_all(allowed.join("swap")).unwrap();
        std::fs::write(allowed.join("swap/canary"), "checked").unwrap();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let tenant = tenant_client(&cluster).await;
            let pods_api: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::default_namespaced(tenant);
            let allow = allowed.clone();
            let m = manager(root.path(), move |c| {
                c.node_name = node.clone();
                c.host_path_allow = vec![allow];
            });
            m.add_source(kubevol::source::ClusterSource::new(node_client(&cluster), cluster.node_name()));
            let pod = |name: &str| -> k8s_openapi::api::core::v1::Pod {
                serde_json::from_value(bound_pod(name, cluster.node_name(), json!([{"name": "host", "hostPath": {"path": allowed.join("swap"), "type": "Directory"}}]))).unwrap()
            };
            let p = pods_api.create(&Default::default(), &pod("first")).await.expect("the tenant's pod");
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let handed = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["host"].path.clone();
            std::fs::rename(allowed.join("swap"), allowed.join("swap.old")).unwrap();
            std::os::unix::fs::symlink("/etc", allowed.join("swap")).unwrap();
            assert_eq!(std::fs::read_to_string(handed.join("canary")).unwrap(), "checked", "the directory checked, not /etc");
            assert!(!handed.join("passwd").exists());
            let q = pods_api.create(&Default::default(), &pod("second")).await.expect("the tenant's pod");
            wait_for_status(&m, &q, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.as_ref().is_some_and(|e| e.contains("outside the allowed host paths")))).await;
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

/// A manager of the cluster's node whose failed operations back off 2 s each time (a tenant's
/// volume that keeps failing is tried no more often than that on its own).
fn slow_retrying_manager(root: &std::path::Path, cluster: &TestCluster) -> kubevol::VolumeManager {
    let node = cluster.node_name().to_string();
    let m = manager(root, |c| {
        c.node_name = node;
        c.backoff.initial = Duration::from_secs(2);
        c.backoff.max = Duration::from_secs(2);
    });
    m.add_source(kubevol::source::ClusterSource::new(
        node_client(cluster),
        cluster.node_name(),
    ));
    m
}

mount_test! {
    /// A tenant's pod whose ConfigMap volumes would take more than its ephemeral-storage limit
    /// (each key a page: 100 keys, 400 KiB a volume, 1 MiB allowed): the third volume is
    /// refused, saying what each takes and the budget; the others are mounted.
    fn a_tenants_content_volumes_past_its_budget_are_refused() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let tenant = tenant_client(&cluster).await;
            let data: serde_json::Map<String, serde_json::Value> = (0..100).map(|i| (format!("k{i}"), json!("v"))).collect();
            let cm: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(json!({"metadata": {"name": "many"}, "data": data})).unwrap();
            kube::Api::<k8s_openapi::api::core::v1::ConfigMap>::default_namespaced(tenant.clone()).create(&Default::default(), &cm).await.expect("the tenant's ConfigMap");
            let volumes: Vec<_> = (0..3).map(|i| json!({"name": format!("c{i}"), "configMap": {"name": "many"}})).collect();
            let mut pod = bound_pod("greedy", &node, serde_json::Value::Array(volumes));
            pod["spec"]["containers"][0]["resources"] = json!({"limits": {"ephemeral-storage": "1Mi"}});
            let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod).unwrap();
            let m = cluster_manager(root.path(), &cluster);
            let p = kube::Api::<k8s_openapi::api::core::v1::Pod>::default_namespaced(tenant).create(&Default::default(), &pod).await.expect("the tenant's pod");
            let s = wait_for_status(&m, &p, 120, |s| s.volumes.iter().filter(|v| v.state == kubevol::status::VolumePhase::Mounted).count() == 2
                && s.volumes.iter().any(|v| v.retry.last_error.is_some())).await;
            let e = s.volumes.iter().find_map(|v| v.retry.last_error.clone()).unwrap();
            assert!(e.contains("past the pod's budget of 1024 KiB") && e.contains("its ephemeral-storage limit"), "{e}");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// A tenant's one-key ConfigMap projected at deep item paths: the directories the paths
    /// make count in the pod's budget (ten items of 30 levels, 300 directories, take 1.2 MiB:
    /// refused under a limit of 1 MiB, which counting the files alone, 40 KiB, let through), a
    /// path deeper than kubevol's 32 levels is refused by its field, and the set-ups hold no
    /// more descriptors than the deepest path has levels (kubevol's own stay far from its
    /// limit). A shallow pod beside them is mounted.
    fn a_tenants_deep_item_paths_count_in_its_budget_and_are_bounded() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let tenant = tenant_client(&cluster).await;
            let cm: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(json!({"metadata": {"name": "one"}, "data": {"k": "v"}})).unwrap();
            kube::Api::<k8s_openapi::api::core::v1::ConfigMap>::default_namespaced(tenant.clone()).create(&Default::default(), &cm).await.expect("the tenant's ConfigMap");
            let deep = |levels: usize, i: usize| format!("{}f{i}", format!("d{i}/").repeat(levels - 1));
            let items = |levels: usize, n: usize| -> Vec<serde_json::Value> { (0..n).map(|i| json!({"key": "k", "path": deep(levels, i)})).collect() };
            let pods_api = kube::Api::<k8s_openapi::api::core::v1::Pod>::default_namespaced(tenant);
            let mut budgeted = bound_pod("deep", &node, json!([{"name": "c", "configMap": {"name": "one", "items": items(31, 10)}}]));
            budgeted["spec"]["containers"][0]["resources"] = json!({"limits": {"ephemeral-storage": "1Mi"}});
            let too_deep = bound_pod("deeper", &node, json!([{"name": "c", "configMap": {"name": "one", "items": items(40, 1)}}]));
            let shallow = bound_pod("shallow", &node, json!([{"name": "c", "configMap": {"name": "one", "items": items(8, 10)}}]));
            let m = cluster_manager(root.path(), &cluster);
            let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
            let before = fds();
            let mut made = Vec::new();
            for pod in [budgeted, too_deep, shallow] {
                made.push(pods_api.create(&Default::default(), &serde_json::from_value(pod).unwrap()).await.expect("the tenant's pod"));
            }
            // (The error the budget gives: a volume waits for its ConfigMap's first read first.)
            let s = wait_for_status(&m, &made[0], 120, |s| s.volumes[0].retry.last_error.as_ref().is_some_and(|e| e.contains("past the pod's budget"))).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("past the pod's budget of 1024 KiB") && e.contains("its content takes 1240 KiB"), "{e}");
            let s = wait_for_status(&m, &made[1], 120, |s| s.phase == kubevol::status::PodPhase::Rejected).await;
            assert!(s.errors.iter().any(|e| e.contains("spec.volumes[0].configMap.items[0].path") && e.contains("must have at most 32 path elements")), "{:?}", s.errors);
            m.wait_for_attach_and_mount(&made[2]).await.expect("the shallow pod mounted");
            let after = fds();
            assert!(after < before + 200, "{before} descriptors open before, {after} after");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

/// This process's TCP connections to port `port` of 127.0.0.1 that are established.
fn connections_to(port: u16) -> usize {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|t| {
            t.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')
                .map(String::from)
        })
        .collect();
    let want = format!("0100007F:{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // remote address, state 01 (established), inode
            f.len() > 9 && f[2] == want && f[3] == "01" && inodes.contains(f[9])
        })
        .count()
}

mount_test! {
    /// A tenant's pod reads 300 Secrets in one projected volume: the node watches each by name,
    /// over more than one connection (90 watches a connection). Once the pod is deleted and its
    /// watches end, the connections they took are closed (they stayed for hyper's 90 s idle
    /// timeout): one is left for what comes next.
    fn the_connections_a_deleted_pods_watches_took_are_closed() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let port: u16 = cluster.node_config().cluster_url.port_u16().expect("the server's port");
            let tenant = tenant_client(&cluster).await;
            let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> = kube::Api::default_namespaced(tenant.clone());
            for i in 0..300 {
                let s = serde_json::from_value(json!({"metadata": {"name": format!("s{i}")}, "stringData": {format!("k{i}"): "v"}})).unwrap();
                secrets.create(&Default::default(), &s).await.expect("the tenant's Secrets");
            }
            let sources: Vec<serde_json::Value> = (0..300).map(|i| json!({"secret": {"name": format!("s{i}")}})).collect();
            let pods_api: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::default_namespaced(tenant);
            let m = cluster_manager(root.path(), &cluster);
            let made = pods_api.create(&Default::default(), &serde_json::from_value(bound_pod("wide", &node, json!([{"name": "all", "projected": {"sources": sources}}]))).unwrap()).await.expect("the tenant's pod");
            let p = typed(&serde_json::to_value(&made).unwrap());
            m.wait_for_attach_and_mount(&p).await.expect("mounted with its 300 Secrets");
            let during = connections_to(port);
            assert!(during >= 4, "300 watches take at least 4 connections: {during}");
            // Deleted for good (as the kubelet deletes a pod once its containers are gone).
            pods_api.delete("wide", &kube::api::DeleteParams::default().grace_period(0)).await.expect("the tenant deletes its pod");
            m.wait_for_unmount(&p).await.expect("torn down");
            kubevol_testserver::cluster::eventually("the connections of the ended watches closed", 60, || async { connections_to(port) <= 2 }).await;
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// A tenant's pod with a volume whose ConfigMap is missing and ten siblings whose
    /// ConfigMaps the tenant makes one by one: each of those is news only to the volume that
    /// reads it, and the one left failing is tried on its own backoff (2 s), not once per
    /// sibling's object; made at last, its ConfigMap mounts it at once.
    fn a_tenants_failing_volume_is_retried_for_what_it_reads_only() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let tenant = tenant_client(&cluster).await;
            let config_maps: kube::Api<k8s_openapi::api::core::v1::ConfigMap> = kube::Api::default_namespaced(tenant.clone());
            let cm = |name: &str| -> k8s_openapi::api::core::v1::ConfigMap { serde_json::from_value(json!({"metadata": {"name": name}, "data": {"k": "v"}})).unwrap() };
            let mut volumes = vec![json!({"name": "stuck", "configMap": {"name": "missing"}})];
            volumes.extend((0..10).map(|i| json!({"name": format!("v{i}"), "configMap": {"name": format!("cm-{i}")}})));
            let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(bound_pod("app", &node, serde_json::Value::Array(volumes))).unwrap();
            let m = slow_retrying_manager(root.path(), &cluster);
            let p = kube::Api::<k8s_openapi::api::core::v1::Pod>::default_namespaced(tenant).create(&Default::default(), &pod).await.expect("the tenant's pod");
            let tries = |m: &kubevol::VolumeManager| -> u32 {
                m.events().iter().filter(|e| e.reason == "FailedMount" && e.message.contains("volume \"stuck\"")).map(|e| e.count).sum()
            };
            wait_for_status(&m, &p, 120, |_| tries(&m) >= 1).await;
            let start = Instant::now();
            let before = tries(&m);
            for i in 0..10 {
                config_maps.create(&Default::default(), &cm(&format!("cm-{i}"))).await.expect("a sibling's ConfigMap");
                // Each its own news: the node has seen it before the next comes.
                let v = format!("v{i}");
                wait_for_status(&m, &p, 120, |s| s.volumes.iter().any(|x| x.name == v && x.state == kubevol::status::VolumePhase::Mounted)).await;
            }
            wait_for_status(&m, &p, 120, |s| s.volumes.iter().filter(|v| v.name != "stuck").all(|v| v.state == kubevol::status::VolumePhase::Mounted)).await;
            let allowed = 2 + start.elapsed().as_secs() as u32 / 2;
            let seen = tries(&m) - before;
            assert!(seen <= allowed, "{seen} more tries of the failing volume, {allowed} allowed");
            config_maps.create(&Default::default(), &cm("missing")).await.expect("its own ConfigMap");
            m.wait_for_attach_and_mount(&p).await.expect("mounted once its ConfigMap exists");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}
