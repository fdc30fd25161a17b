use super::*;

fn parse(name: &str, text: &str) -> (Vec<(usize, Object)>, Vec<String>) {
    let (o, e) = parse_manifest(Path::new(name), text);
    (o, e.iter().map(|e| e.to_string()).collect())
}

#[test]
fn multi_document_yaml_with_known_and_unknown_kinds() {
    let (objs, errs) = parse(
        "/m/a.yaml",
        "apiVersion: v1\nkind: Pod\nmetadata: {name: web}\nspec: {containers: [{name: c}]}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: cm}\ndata: {a: b}\n---\n",
    );
    assert!(errs.is_empty(), "{errs:?}");
    assert_eq!(objs.len(), 2);
    assert_eq!(objs[0].0, 1);
    assert_eq!(objs[1].0, 3);
    let Object::Pod(p, _) = &objs[0].1 else {
        panic!("pod expected")
    };
    assert_eq!(p.metadata.namespace.as_deref(), Some("default"));
    assert!(p.metadata.uid.is_some());
}

#[test]
fn flow_style_yaml_parses() {
    let (objs, errs) = parse(
        "/m/flow.yaml",
        r#"{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "flow"}, "spec": {"containers": [{"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}], "volumes": [{"name": "v", "emptyDir": {}}]}}"#,
    );
    assert!(errs.is_empty(), "{errs:?}");
    assert_eq!(objs.len(), 1);
}

#[test]
fn a_document_that_does_not_load_names_its_object() {
    let text = "apiVersion: v1\nkind: Secret\nmetadata: {name: s, namespace: prod}\ndata: {k: \"not base64!\"}\n---\napiVersion: v2\nkind: PersistentVolume\nmetadata: {name: pv, namespace: ignored}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {}\ndata: 3\n";
    let (objs, errs) = parse_manifest(Path::new("/m/o.yaml"), text);
    assert!(objs.is_empty());
    let names: Vec<_> = errs.iter().map(|e| e.object.clone()).collect();
    let name = |kind: &str, namespace: &str, name: &str| {
        Some(ObjectName {
            kind: kind.into(),
            namespace: namespace.into(),
            name: name.into(),
        })
    };
    assert_eq!(
        names,
        [
            name("Secret", "prod", "s"),
            name("PersistentVolume", "", "pv"),
            None
        ],
        "{errs:?}"
    );
    assert!(
        errs[0]
            .to_string()
            .starts_with("/m/o.yaml: document 1, line 4, column 11: invalid Secret: data.k:")
            && errs[0]
                .message
                .ends_with(" (values under data are base64; put plain text under stringData)"),
        "{}",
        errs[0]
    );
}

#[test]
fn syntax_error_names_file_document_line_and_column() {
    let (_, errs) = parse(
        "/m/bad.yaml",
        "apiVersion: v1\nkind: Pod\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: [unclosed\n",
    );
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].starts_with("/m/bad.yaml: document 2, line 7, column 1: did not find expected ',' or ']', while parsing a flow sequence"), "{}", errs[0]);
}

#[test]
fn type_error_is_located() {
    let (objs, errs) = parse(
        "/m/t.yaml",
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\nspec:\n  containers: notalist\n",
    );
    assert!(objs.is_empty());
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].starts_with("/m/t.yaml: document 1, line 6, column"),
        "{}",
        errs[0]
    );
    assert!(errs[0].contains("invalid Pod"), "{}", errs[0]);
}

#[test]
fn json_files_and_their_errors() {
    let (objs, errs) = parse(
        "/m/p.json",
        r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"j"},"spec":{"containers":[]}}"#,
    );
    assert_eq!((objs.len(), errs.len()), (1, 0));
    let (_, errs) = parse("/m/p.json", "{\n  \"kind\": \"Pod\",\n  oops\n}");
    assert!(
        errs[0].starts_with("/m/p.json: document 1, line 3, column"),
        "{}",
        errs[0]
    );
}

#[test]
fn every_kind_is_located_in_json_too() {
    let (_, errs) = parse(
        "/m/pv.json",
        "{\"apiVersion\": \"v1\", \"kind\": \"PersistentVolume\",\n \"metadata\": {\"name\": \"pv\"},\n \"spec\": {\"capacity\": 5}}",
    );
    assert!(
        errs[0].starts_with("/m/pv.json: document 1, line 3, column"),
        "{}",
        errs[0]
    );
}

#[test]
fn locations_are_stripped_from_messages() {
    let rows = [
        ("bad at line 3 column 7", "bad"),
        (
            "bad at line 3 column 7, while parsing",
            "bad, while parsing",
        ),
        ("bad at line 12", "bad"),
        ("no location here", "no location here"),
    ];
    for (msg, want) in rows {
        assert_eq!(strip_location(msg), want, "row {msg:?}");
    }
}

#[test]
fn wrong_api_version_and_missing_kind() {
    let (_, errs) = parse(
        "/m/v.yaml",
        "apiVersion: v2\nkind: Pod\n---\nmetadata: {name: x}\n",
    );
    assert!(
        errs[0].contains("document 1: apiVersion \"v2\" is not supported for kind Pod"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].contains("document 2: the document has no kind"),
        "{}",
        errs[1]
    );
}

#[test]
fn octal_modes_as_kubernetes_reads_them() {
    let (objs, errs) = parse(
        "p.yaml",
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers: []\n  volumes:\n  - name: s\n    secret: {secretName: s, defaultMode: 0400, items: [{key: k, path: k, mode: 0644}]}\n  - name: c\n    configMap: {name: c, defaultMode: 420}\n",
    );
    assert!(errs.is_empty(), "{errs:?}");
    let Object::Pod(p, _) = &objs[0].1 else {
        panic!("a pod")
    };
    let vols = p.spec.as_ref().unwrap().volumes.as_ref().unwrap();
    let s = vols[0].secret.as_ref().unwrap();
    assert_eq!(s.default_mode, Some(0o400));
    assert_eq!(s.items.as_ref().unwrap()[0].mode, Some(0o644));
    assert_eq!(vols[1].config_map.as_ref().unwrap().default_mode, Some(420));
    let (_, errs) = parse("p.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [], volumes: [{name: s, secret: {defaultMode: 0800}}]}\n");
    assert_eq!(errs.len(), 1, "0800 is not octal: {errs:?}");
    // A quoted mode is a string, which the API server refuses: so does kubevol, at its place.
    let rows = [
        ("\"0644\"", "spec.volumes[0].secret.defaultMode: Invalid value: \"0644\": a mode is an integer, not a string: remove the quotes (0644 is then read as an octal number, as Kubernetes reads YAML) or write the decimal 420"),
        ("'0600'", "spec.volumes[0].secret.defaultMode: Invalid value: \"0600\""),
        ("\"420\"", "spec.volumes[0].secret.defaultMode: invalid type: string \"420\", expected i32"),
    ];
    for (mode, want) in rows {
        let spec = format!("spec: {{containers: [{{name: c}}], volumes: [{{name: s, secret: {{defaultMode: {mode}}}}}]}}");
        let column = spec.find(mode).unwrap() + 1;
        let text = format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\n{spec}\n");
        let (objs, errs) = parse("p.yaml", &text);
        assert!(
            objs.is_empty() && errs.len() == 1,
            "row {mode}: {objs:?} {errs:?}"
        );
        let want = format!("p.yaml: document 1, line 4, column {column}: invalid Pod: {want}");
        assert!(
            errs[0].starts_with(&want),
            "row {mode}: {}\n want {want}",
            errs[0]
        );
    }
}

#[test]
fn type_errors_name_the_line_column_and_field() {
    let pod = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  labels:\n    version: 2\nspec:\n  containers: [{name: c}]\n  volumes:\n  - name: a\n    emptyDir: {medium: 5}\n";
    let (_, errs) = parse("/m/p.yaml", pod);
    assert_eq!(errs, vec!["/m/p.yaml: document 1, line 6, column 14: invalid Pod: metadata.labels.version: invalid type: integer `2`, expected a string".to_string()]);
    let fixed = pod.replace("version: 2", "version: \"2\"");
    let (_, errs) = parse("/m/p.yaml", &fixed);
    assert_eq!(errs, vec!["/m/p.yaml: document 1, line 11, column 24: invalid Pod: spec.volumes[0].emptyDir.medium: invalid type: integer `5`, expected a string".to_string()]);
    // In a List, and in JSON.
    let list = "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: ConfigMap, metadata: {name: a}}\n- apiVersion: v1\n  kind: ConfigMap\n  metadata: {name: b}\n  data: {k: [1]}\n";
    let (_, errs) = parse("/m/l.yaml", list);
    assert_eq!(errs, vec!["/m/l.yaml: document 1, line 8, column 13: invalid ConfigMap: data.k: invalid type: sequence, expected a string".to_string()]);
    let json = "{\"apiVersion\": \"v1\", \"kind\": \"ConfigMap\",\n \"metadata\": {\"name\": \"c\", \"labels\": {\"a\": true}}}";
    let (_, errs) = parse("/m/c.json", json);
    assert_eq!(errs.len(), 1);
    assert!(
        errs[0].starts_with("/m/c.json: document 1, line 2, column "),
        "{}",
        errs[0]
    );
    assert!(
        errs[0].ends_with(
            "invalid ConfigMap: metadata.labels.a: invalid type: boolean `true`, expected a string"
        ),
        "{}",
        errs[0]
    );
}

/// The ConfigMap a YAML text defines, as its data.
fn config_data(text: &str) -> Result<std::collections::BTreeMap<String, String>, Vec<String>> {
    let (objs, errs) = parse("/m/c.yaml", text);
    if !errs.is_empty() {
        return Err(errs);
    }
    match objs.into_iter().next() {
        Some((_, Object::ConfigMap(c))) => Ok(c.data.unwrap_or_default()),
        _ => Err(vec!["no ConfigMap".into()]),
    }
}

#[test]
fn yaml_that_kubectl_accepts_loads_the_same() {
    let head = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n";
    // (row, data section, key, the value the Go YAML library gives)
    let rows = [
        (
            "escaped single quote",
            "data:\n  k: \"it\\'s\"\n",
            "k",
            "it's",
        ),
        (
            "other escapes",
            "data:\n  k: \"a\\tb\\\\c\\\"d\\'e\"\n",
            "k",
            "a\tb\\c\"d'e",
        ),
        (
            "flow style",
            "data: {k: \"x\\'y\", l: 'p''q'}\n",
            "k",
            "x'y",
        ),
        (
            "single-quoted backslash is literal",
            "data:\n  k: 'a\\'\n",
            "k",
            "a\\",
        ),
        (
            "block scalar kept as written",
            "data:\n  k: |\n    echo \"it\\'s\"\n    # not a comment\n  l: \"\\'\"\n",
            "k",
            "echo \"it\\'s\"\n# not a comment\n",
        ),
        (
            "after a block scalar",
            "data:\n  k: |\n    x\n  l: \"\\'\"\n",
            "l",
            "'",
        ),
        ("comment", "data:\n  k: v # a \"comment\\' here\n", "k", "v"),
        (
            "anchors and aliases",
            "data:\n  k: &v shared\n  l: *v\n",
            "l",
            "shared",
        ),
        ("tab inside a value", "data:\n  k: \"a\tb\"\n", "k", "a\tb"),
    ];
    for (row, data, key, want) in rows {
        let got =
            config_data(&format!("{head}{data}")).unwrap_or_else(|e| panic!("row {row}: {e:?}"));
        assert_eq!(got.get(key).map(String::as_str), Some(want), "row {row}");
    }
    // Merge keys, applied as Go's YAML library applies them.
    let (objs, errs) = parse(
        "/m/p.yaml",
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - &base {name: a, image: x}\n  - <<: *base\n    name: b\n",
    );
    assert!(errs.is_empty(), "{errs:?}");
    let Some((_, Object::Pod(p, _))) = objs.first() else {
        panic!("a pod")
    };
    let c = &p.spec.as_ref().unwrap().containers[1];
    assert_eq!((c.name.as_str(), c.image.as_deref()), ("b", Some("x")));
    // What the API server refuses is refused: a duplicate key.
    let e = config_data(&format!("{head}data:\n  k: a\n  k: b\n")).unwrap_err();
    assert!(e[0].contains("duplicate"), "{e:?}");
}

#[test]
fn secret_values_never_appear_in_errors() {
    // (row, document, the value that must not appear, what the message must say)
    let rows = [
        ("stringData number", "stringData: {pin: 98765432}", "98765432", "stringData.pin: invalid type: integer, expected a string (values under stringData are text: quote the value)"),
        ("data number", "data: {password: 424242424242}", "424242424242", "data.password: invalid type: integer, expected a base64-encoded string"),
        ("data not base64", "data: {password: \"c2VjcmV0_dmFsdWU=\"}", "_", "data.password: the character at offset 8 is not a base64 character"),
        ("data float", "data: {password: 1.5e300}", "1.5e300", "data.password: invalid type: floating point, expected a base64-encoded string"),
        ("stringData map", "stringData: {pin: {nested: hunter2}}", "hunter2", "stringData.pin: invalid type: map, expected a string"),
        ("stringData bool", "stringData: {pin: true}", "true", "stringData.pin: invalid type: boolean, expected a string"),
    ];
    for (row, body, secret, want) in rows {
        let text = format!("apiVersion: v1\nkind: Secret\nmetadata: {{name: s}}\n{body}\n");
        let (_, errs) = parse("/m/s.yaml", &text);
        assert_eq!(errs.len(), 1, "row {row}: {errs:?}");
        let msg = errs[0].split("invalid Secret: ").nth(1).unwrap_or(&errs[0]);
        assert!(!msg.contains(secret), "row {row}: the value leaks: {msg}");
        assert!(msg.starts_with(want), "row {row}: {msg} / {}", errs[0]);
        // Inside a List too.
        let list = format!("apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Secret\n  metadata: {{name: s}}\n  {body}\n");
        let (_, errs) = parse("/m/l.yaml", &list);
        assert_eq!(errs.len(), 1, "row {row} in a List: {errs:?}");
        let msg = errs[0].split("invalid Secret: ").nth(1).unwrap_or(&errs[0]);
        assert!(
            !msg.contains(secret),
            "row {row} in a List: the value leaks: {msg}"
        );
    }
}

#[test]
fn base64_errors_name_the_character_outside_secrets() {
    let rows = [
        (
            "Invalid symbol 95, offset 7.",
            "'_' at offset 7 is not a base64 character",
        ),
        (
            "x: Invalid symbol 10, offset 2. (hint)",
            "x: byte 0x0a at offset 2 is not a base64 character (hint)",
        ),
        (
            "Invalid last symbol 66, offset 3.",
            "'B' at offset 3 cannot end base64 data (it leaves bits over)",
        ),
        (
            "Invalid input length: 5",
            "5 base64 characters cannot be decoded (base64 comes in groups of 4, padded with '=')",
        ),
        ("Invalid padding", "the base64 padding ('=') is wrong"),
    ];
    for (msg, want) in rows {
        assert_eq!(humanize(msg, false), want, "row {msg:?}");
    }
    let (_, errs) = parse(
        "/m/c.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\nbinaryData: {b: \"YWJj_ZGVm\"}\n",
    );
    assert!(
        errs[0].contains("binaryData.b: '_' at offset 4 is not a base64 character"),
        "{errs:?}"
    );
}

/// An unknown field is placed at its own line, and at its value's column, in the second and
/// later documents of a YAML file, and in a JSON file, as in the first document.
#[test]
fn unknown_fields_are_located_in_every_document_and_in_json() {
    let yaml = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata: {k: v}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\ndata: {k: v}\nbinaryDatta: {}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\n  lables: {x: y}\n";
    let parsed = parse_file(Path::new("/m/three.yaml"), yaml);
    let at: Vec<(Option<usize>, Option<usize>, Option<usize>)> = parsed
        .warnings
        .iter()
        .map(|w| (w.document, w.line, w.column))
        .collect();
    assert_eq!(
        at,
        [(Some(2), Some(10), Some(14)), (Some(3), Some(16), Some(11))],
        "{:?}",
        parsed.warnings
    );
    let json = "{\n  \"apiVersion\": \"v1\",\n  \"kind\": \"ConfigMap\",\n  \"metadata\": {\"name\": \"j\"},\n  \"dataa\": {}\n}\n";
    let parsed = parse_file(Path::new("/m/j.json"), json);
    assert_eq!(parsed.warnings.len(), 1, "{:?}", parsed.warnings);
    assert_eq!(
        (parsed.warnings[0].line, parsed.warnings[0].column),
        (Some(5), Some(12)),
        "{:?}",
        parsed.warnings
    );
}

/// Base64 values written across lines (a YAML `|` block, as the Kubernetes documentation's
/// `kubernetes.io/ssh-auth` and `dockercfg` examples write them) decode as the API server
/// decodes them, line breaks skipped; a ConfigMap's binaryData too; a space is still an error.
#[test]
fn base64_values_across_lines_decode_as_the_api_server_decodes_them() {
    let text = "apiVersion: v1\nkind: Secret\nmetadata: {name: ssh}\ntype: kubernetes.io/ssh-auth\ndata:\n  ssh-privatekey: |\n    c2VjcmV0\n    LXZhbHVl\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: bin}\nbinaryData:\n  blob: \"AAEC\\r\\nAw==\"\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: beside}\nspec: {containers: [{name: c}]}\n";
    let (objects, errors) = parse("docs.yaml", text);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(objects.len(), 3, "the pod beside them is read too");
    match &objects[0].1 {
        Object::Secret(s) => assert_eq!(
            s.data.as_ref().unwrap()["ssh-privatekey"].0,
            b"secret-value"
        ),
        o => panic!("{o:?}"),
    }
    match &objects[1].1 {
        Object::ConfigMap(c) => assert_eq!(c.binary_data.as_ref().unwrap()["blob"].0, [0, 1, 2, 3]),
        o => panic!("{o:?}"),
    }
    let (_, errors) = parse(
        "bad.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\ndata: {k: \"c2Vj cmV0\"}\n",
    );
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("is not a base64 character"),
        "{errors:?}"
    );
}

thread_local! {
    /// How many times this thread's parses walked a file again to locate a field.
    pub(super) static WALKS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Every error, warning and quoted mode of a file is located in the layout of its one pass,
/// however many it has: a ConfigMap of 4,000 unknown fields, 2,000 documents with a type error,
/// 1,000 valid pods with octal modes and 1,000 with quoted ones are each read with no second
/// parse, and every message has its line.
#[test]
fn a_file_is_parsed_once_whatever_its_errors_warnings_and_modes() {
    let unknown: String = (0..4_000).map(|i| format!("extra{i}: x\n")).collect();
    let config_map = format!("apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c}}\n{unknown}");
    let typed: String = (0..2_000)
        .map(|i| {
            format!("apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c{i}}}\ndata: 5\n---\n")
        })
        .collect();
    let pod = |i: usize, mode: &str| {
        format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: p{i}}}\nspec:\n  containers: [{{name: c, image: i}}]\n  volumes:\n  - name: s\n    secret: {{secretName: s, defaultMode: {mode}}}\n---\n")
    };
    let octal: String = (0..1_000).map(|i| pod(i, "0644")).collect();
    let quoted: String = (0..1_000).map(|i| pod(i, "\"0644\"")).collect();
    for (name, text, objects, errors, warnings) in [
        ("unknown.yaml", config_map, 1, 0, 4_000),
        ("typed.yaml", typed, 0, 2_000, 0),
        ("octal.yaml", octal, 1_000, 0, 0),
        ("quoted.yaml", quoted, 0, 1_000, 0),
    ] {
        WALKS.with(|w| w.set(0));
        let parsed = parse_file(Path::new(name), &text);
        assert_eq!(WALKS.with(|w| w.get()), 0, "{name}: walked again");
        assert_eq!(
            (
                parsed.objects.len(),
                parsed.errors.len(),
                parsed.warnings.len()
            ),
            (objects, errors, warnings),
            "{name}"
        );
        for e in parsed.errors.iter().chain(&parsed.warnings) {
            assert!(e.line.is_some() && e.column.is_some(), "{name}: {e:?}");
        }
    }
    let quoted = parse_file(Path::new("q.yaml"), &pod(0, "'0600'"));
    assert_eq!(
        (quoted.errors[0].line, quoted.errors[0].column),
        (Some(8), Some(42)),
        "{:?}",
        quoted.errors
    );
}
