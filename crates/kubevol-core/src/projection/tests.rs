use super::*;
use serde_json::json;

struct Fixed {
    cms: BTreeMap<String, Lookup<ConfigMap>>,
    secrets: BTreeMap<String, Lookup<Secret>>,
}

impl Objects for Fixed {
    fn config_map(&self, ns: &str, name: &str) -> Lookup<ConfigMap> {
        self.cms
            .get(&format!("{ns}/{name}"))
            .cloned()
            .unwrap_or(Lookup::Missing)
    }
    fn secret(&self, ns: &str, name: &str) -> Lookup<Secret> {
        self.secrets
            .get(&format!("{ns}/{name}"))
            .cloned()
            .unwrap_or(Lookup::Missing)
    }
}

fn objects() -> Fixed {
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "cm", "namespace": "ns"},
        "data": {"a": "alpha", "b": "beta"},
        "binaryData": {"bin": "AAEC"},
    }))
    .unwrap();
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": "s", "namespace": "ns"},
        "data": {"user": "YWRtaW4=", "pass": "czNjcjN0"},
    }))
    .unwrap();
    Fixed {
        cms: BTreeMap::from([
            ("ns/cm".to_string(), Lookup::Found(Arc::new(cm))),
            (
                "ns/bad".to_string(),
                Lookup::Invalid("x.yaml (document 1): data[..a]: must not start with '..'".into()),
            ),
        ]),
        secrets: BTreeMap::from([("ns/s".to_string(), Lookup::Found(Arc::new(s)))]),
    }
}

const NODE: NodeAllocatable = NodeAllocatable {
    cpu_milli: 4000,
    memory: 8 << 30,
    ephemeral_storage: 100 << 30,
};

fn pod() -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "ns", "uid": "0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70",
            "labels": {"app": "web", "tier": "front \"end\"\n"}, "annotations": {"b": "2", "a": "1"}},
        "spec": {"containers": [
            {"name": "c", "resources": {"limits": {"cpu": "500m", "memory": "100Mi"}, "requests": {"cpu": "250m"}},
             "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                     {"name": "DIR", "value": "logs/$(POD)"},
                     {"name": "EMPTY", "value": ""},
                     {"name": "USER", "valueFrom": {"secretKeyRef": {"name": "s", "key": "user"}}},
                     {"name": "GREETING", "value": "hi-$(USER)"},
                     {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]},
            {"name": "d"}]},
    }))
    .unwrap()
}

fn payload(volume: serde_json::Value) -> Result<Payload, ProjectionError> {
    let v: Volume = serde_json::from_value(volume).unwrap();
    volume_payload(&pod(), &v, &objects(), &NODE).expect("a content volume")
}

fn text(p: &Payload, path: &str) -> (String, u32) {
    let f = &p[path];
    (String::from_utf8(f.data.clone()).unwrap(), f.mode)
}

#[test]
fn config_map_all_keys_and_items() {
    let p = payload(json!({"name": "v", "configMap": {"name": "cm"}})).unwrap();
    assert_eq!(p.keys().collect::<Vec<_>>(), ["a", "b", "bin"]);
    assert_eq!(text(&p, "a"), ("alpha".into(), 0o644));
    assert_eq!(p["bin"].data, [0, 1, 2]);
    let p = payload(
        json!({"name": "v", "configMap": {"name": "cm", "defaultMode": 0o600,
        "items": [{"key": "a", "path": "dir/./x"}, {"key": "b", "path": "y", "mode": 0o400}]}}),
    )
    .unwrap();
    assert_eq!(text(&p, "dir/x"), ("alpha".into(), 0o600));
    assert_eq!(text(&p, "y"), ("beta".into(), 0o400));
    assert_eq!(p.len(), 2);
}

#[test]
fn missing_objects_and_keys() {
    let e = payload(json!({"name": "v", "configMap": {"name": "nope"}})).unwrap_err();
    assert_eq!(e.to_string(), "configMap ns/nope not found; create it, or set optional: true to mount the volume without it");
    assert!(e.is_transient());
    assert!(
        payload(json!({"name": "v", "configMap": {"name": "nope", "optional": true}}))
            .unwrap()
            .is_empty()
    );
    let e = payload(json!({"name": "v", "secret": {"secretName": "s", "items": [{"key": "token", "path": "t"}]}})).unwrap_err();
    assert!(
        e.to_string().contains("secret ns/s has no key \"token\""),
        "{e}"
    );
    let p = payload(json!({"name": "v", "secret": {"secretName": "s", "optional": true, "items": [{"key": "token", "path": "t"}, {"key": "user", "path": "u"}]}})).unwrap();
    assert_eq!(
        p.keys().collect::<Vec<_>>(),
        ["u"],
        "a missing optional key is skipped"
    );
    let e =
        payload(json!({"name": "v", "configMap": {"name": "bad", "optional": true}})).unwrap_err();
    assert!(
        e.to_string()
            .contains("configMap ns/bad is invalid: x.yaml (document 1)"),
        "an invalid object fails even when optional: {e}"
    );
}

#[test]
fn downward_api_formats() {
    let p = payload(json!({"name": "v", "downwardAPI": {"items": [
        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
        {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
        {"path": "app", "fieldRef": {"fieldPath": "metadata.labels['app']"}},
        {"path": "none", "fieldRef": {"fieldPath": "metadata.annotations['missing']"}},
        {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
        {"path": "ns", "fieldRef": {"fieldPath": "metadata.namespace"}},
        {"path": "uid", "fieldRef": {"fieldPath": "metadata.uid"}, "mode": 0o400},
        {"path": "cpu", "resourceFieldRef": {"containerName": "c", "resource": "limits.cpu", "divisor": "1m"}},
        {"path": "cpu-cores", "resourceFieldRef": {"containerName": "c", "resource": "limits.cpu"}},
        {"path": "cpu-req", "resourceFieldRef": {"containerName": "c", "resource": "requests.cpu", "divisor": "1m"}},
        {"path": "mem", "resourceFieldRef": {"containerName": "c", "resource": "limits.memory", "divisor": "1Mi"}},
        {"path": "mem-req", "resourceFieldRef": {"containerName": "c", "resource": "requests.memory"}},
        {"path": "mem-d", "resourceFieldRef": {"containerName": "d", "resource": "limits.memory", "divisor": "1Gi"}},
        {"path": "cpu-d-req", "resourceFieldRef": {"containerName": "d", "resource": "requests.cpu"}},
        {"path": "eph-d", "resourceFieldRef": {"containerName": "d", "resource": "limits.ephemeral-storage", "divisor": "1G"}},
    ]}}))
    .unwrap();
    assert_eq!(
        text(&p, "labels").0,
        "app=\"web\"\ntier=\"front \\\"end\\\"\\n\""
    );
    assert_eq!(text(&p, "annotations").0, "a=\"1\"\nb=\"2\"");
    assert_eq!(text(&p, "app").0, "web");
    assert_eq!(text(&p, "none").0, "");
    assert_eq!(text(&p, "name").0, "web");
    assert_eq!(text(&p, "ns").0, "ns");
    assert_eq!(
        text(&p, "uid"),
        ("0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70".into(), 0o400)
    );
    assert_eq!(text(&p, "cpu").0, "500");
    assert_eq!(text(&p, "cpu-cores").0, "1", "500m in cores rounds up");
    assert_eq!(text(&p, "cpu-req").0, "250");
    assert_eq!(text(&p, "mem").0, "100");
    assert_eq!(
        text(&p, "mem-req").0,
        (100 << 20).to_string(),
        "a missing request is the limit"
    );
    assert_eq!(text(&p, "mem-d").0, "8", "no limit: the node's allocatable");
    assert_eq!(text(&p, "cpu-d-req").0, "0");
    assert_eq!(text(&p, "eph-d").0, "108", "100Gi in G, rounded up");
}

#[test]
fn projected_mix_and_cluster_only_sources() {
    let p = payload(json!({"name": "v", "projected": {"defaultMode": 0o440, "sources": [
        {"configMap": {"name": "cm", "items": [{"key": "a", "path": "cfg/a"}]}},
        {"secret": {"name": "s"}},
        {"configMap": {"name": "gone", "optional": true}},
        {"downwardAPI": {"items": [{"path": "cfg/name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
    ]}}))
    .unwrap();
    assert_eq!(
        p.keys().collect::<Vec<_>>(),
        ["cfg/a", "cfg/name", "pass", "user"]
    );
    assert_eq!(text(&p, "user"), ("admin".into(), 0o440));
    let e = payload(json!({"name": "v", "projected": {"sources": [{"configMap": {"name": "cm"}}, {"serviceAccountToken": {"path": "token"}}]}})).unwrap_err();
    assert!(
        e.to_string().starts_with(
            "projected source serviceAccountToken (sources[1]) needs a Kubernetes API server"
        ),
        "{e}"
    );
    assert!(!e.is_transient());
    let e = payload(json!({"name": "v", "projected": {"sources": [{"clusterTrustBundle": {"path": "b", "signerName": "x"}}]}})).unwrap_err();
    assert!(e.to_string().contains("clusterTrustBundle"), "{e}");
}

/// What a podCertificate source writes: the key and chain, each where asked, and both in
/// one bundle (key first); 0600 under an fsGroup; why there are none, transient or not.
#[test]
fn pod_certificates_are_written_where_their_source_says() {
    struct Issued(Result<Credentials, CredentialsError>);
    impl Objects for Issued {
        fn config_map(&self, _: &str, _: &str) -> Lookup<ConfigMap> {
            Lookup::Missing
        }
        fn secret(&self, _: &str, _: &str) -> Lookup<Secret> {
            Lookup::Missing
        }
        fn pod_certificate(&self, index: usize) -> Option<Result<Credentials, CredentialsError>> {
            assert_eq!(index, 1, "the source's index among all sources");
            Some(self.0.clone())
        }
        fn in_cluster(&self) -> bool {
            true
        }
    }
    let creds = Credentials {
        key_pem: b"KEY\n".to_vec(),
        chain_pem: b"LEAF\nCA\n".to_vec(),
    };
    let v: Volume = serde_json::from_value(json!({"name": "v", "projected": {"defaultMode": 0o644, "sources": [
        {"downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
        {"podCertificate": {"signerName": "example.com/s", "keyType": "ED25519", "credentialBundlePath": "creds/bundle.pem", "keyPath": "tls.key", "certificateChainPath": "tls.crt"}},
    ]}})).unwrap();
    let p = volume_payload(&pod(), &v, &Issued(Ok(creds.clone())), &NODE)
        .unwrap()
        .unwrap();
    assert_eq!(
        text(&p, "creds/bundle.pem"),
        ("KEY\nLEAF\nCA\n".into(), 0o644)
    );
    assert_eq!(text(&p, "tls.key"), ("KEY\n".into(), 0o644));
    assert_eq!(text(&p, "tls.crt"), ("LEAF\nCA\n".into(), 0o644));
    assert!(
        !format!("{creds:?}").contains("KEY"),
        "a key is never printed"
    );

    let mut grouped = pod();
    grouped.spec.as_mut().unwrap().security_context =
        Some(serde_json::from_value(json!({"fsGroup": 2000})).unwrap());
    let p = volume_payload(&grouped, &v, &Issued(Ok(creds)), &NODE)
        .unwrap()
        .unwrap();
    assert_eq!(
        text(&p, "tls.key").1,
        0o600,
        "the key is the owner's alone under an fsGroup (the writer adds the group)"
    );
    assert_eq!(
        text(&p, "name").1,
        0o644,
        "other files keep the volume's mode"
    );

    let waiting = CredentialsError {
        detail: "waiting for the signer".into(),
        permanent: false,
    };
    let e = volume_payload(&pod(), &v, &Issued(Err(waiting)), &NODE)
        .unwrap()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "projected source podCertificate (sources[1]): waiting for the signer"
    );
    assert!(e.is_transient());
    let denied = CredentialsError {
        detail: "denied".into(),
        permanent: true,
    };
    let e = volume_payload(&pod(), &v, &Issued(Err(denied)), &NODE)
        .unwrap()
        .unwrap_err();
    assert!(!e.is_transient());
    let e = volume_payload(&pod(), &v, &objects(), &NODE)
        .unwrap()
        .unwrap_err();
    assert!(
        e.to_string().starts_with(
            "projected source podCertificate (sources[1]) needs a Kubernetes API server"
        ),
        "{e}"
    );
}

#[test]
fn references() {
    let v: Volume = serde_json::from_value(json!({"name": "v", "projected": {"sources": [{"configMap": {"name": "a"}}, {"secret": {"name": "b"}}, {"downwardAPI": {}}]}})).unwrap();
    let refs = referenced_objects(&pod(), &v);
    assert_eq!(refs.len(), 2);
    assert_eq!(
        (
            refs[1].kind,
            refs[1].namespace.as_str(),
            refs[1].name.as_str()
        ),
        (ObjectKind::Secret, "ns", "b")
    );
}

#[test]
fn go_quoting() {
    assert_eq!(go_quote("a\"b\\c"), "\"a\\\"b\\\\c\"");
    assert_eq!(go_quote("\t\u{1}é"), "\"\\t\\x01é\"");
    assert_eq!(go_quote("\u{7f}\u{85}"), "\"\\x7f\\u0085\"");
}

#[test]
fn expansion_rules() {
    let env = BTreeMap::from([
        ("A".to_string(), "x".to_string()),
        ("E".to_string(), String::new()),
    ]);
    let look = |k: &str| env.get(k).cloned();
    let rows = [
        ("$(A)/y", "x/y", 0),
        ("$$(A)", "$(A)", 0),
        ("$(B)", "$(B)", 1),
        ("$(A", "$(A", 0),
        ("a$b", "a$b", 0),
        ("$(A)$(A)", "xx", 0),
        ("end$", "end$", 0),
    ];
    for (input, want, missing) in rows {
        let (out, m) = expand(input, look);
        assert_eq!((out.as_str(), m.len()), (want, missing), "input {input:?}");
    }
}

#[test]
fn sub_path_expr() {
    let c = pod().spec.unwrap().containers[0].clone();
    let env = container_env(&pod(), &c, "node-a", &objects(), &NODE);
    assert_eq!(
        env.values["DIR"], "logs/web",
        "earlier variables expand in values"
    );
    assert_eq!(env.values["USER"], "admin");
    assert!(
        !env.values.contains_key("IP"),
        "status fields are not known on a standalone node"
    );
    assert_eq!(
        expand_sub_path("$(DIR)/$(USER)", &env).unwrap(),
        "logs/web/admin"
    );
    let e = expand_sub_path("$(IP)/$(EMPTY)", &env).unwrap_err();
    assert!(e.contains("missing value for IP, EMPTY"), "{e}");
    let mut env = env;
    assert_eq!(
        env.secret,
        ["GREETING".to_string(), "USER".to_string()].into(),
        "a Secret's key is known as such, and so is a value made with it"
    );
    env.values.insert("HOME".into(), "/home/admin".into());
    env.secret.insert("HOME".into());
    let e = expand_sub_path("$(HOME)", &env).unwrap_err();
    assert!(
        e.contains(
            "must be a relative path (not shown: it holds the value of HOME, from a Secret)"
        ) && !e.contains("admin"),
        "{e}"
    );
    assert_eq!(
        redact("mkdir /v/admin/x: EACCES", &env.secret_values()),
        "mkdir /v/<redacted: a Secret's value>/x: EACCES"
    );
    env.values.insert("UP".into(), "../etc".into());
    env.values.insert("ABS".into(), "/etc".into());
    assert!(expand_sub_path("$(UP)", &env)
        .unwrap_err()
        .contains("must not contain '..'"));
    assert!(expand_sub_path("$(ABS)", &env)
        .unwrap_err()
        .contains("must be a relative path"));
}
