//! `kubevol mounts` and the HTTP path it reads: what a container gets of its pod's volumes,
//! in each form, and the answers for what cannot be given (yet).

use super::*;

const PODS: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata: {name: settings}
data: {level: info}
---
apiVersion: v1
kind: Pod
metadata: {name: app}
spec:
  containers:
  - name: c
    volumeMounts:
    - {name: scratch, mountPath: /scratch}
    - {name: settings, mountPath: /etc/level, subPath: level}
    - {name: tools, mountPath: /tools}
  volumes:
  - {name: scratch, emptyDir: {}}
  - {name: settings, configMap: {name: settings}}
  - {name: tools, image: {reference: "registry.example/tools:1"}}
---
apiVersion: v1
kind: Pod
metadata: {name: waiting}
spec:
  containers:
  - name: c
    volumeMounts: [{name: later, mountPath: /later}]
  volumes:
  - {name: later, configMap: {name: not-yet}}
"#;

/// The status code of `GET path` and its body.
fn answer(port: u16, path: &str) -> (u16, String) {
    let a = http_get(port, path);
    let code = a
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (
        code,
        a.split("\r\n\r\n").nth(1).unwrap_or_default().to_string(),
    )
}

mount_test! {
    fn mounts_shows_what_a_container_gets_and_says_why_it_cannot_yet() {
        require_root();
        let (dir, manifests, root) = scratch();
        std::fs::write(manifests.join("pods.yaml"), PODS).unwrap();
        let (_daemon, port, _log) = logged_daemon(dir.path(), &manifests, &root, None);
        let server = format!("http://127.0.0.1:{port}");
        let path = "/api/v1/pods/default/app/containers/c/mounts";
        until_http(port, path, |a| a.starts_with("HTTP/1.1 200") || a.starts_with("HTTP/1.0 200"));

        let table = succeeds(Command::new(BIN).args(["mounts", "default/app", "-c", "c", "--server", &server])).0;
        let rows: Vec<Vec<&str>> = table.lines().map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(rows[0], ["CONTAINER", "PATH", "VOLUME", "MODE", "PROPAGATION", "HOST", "PATH", "OR", "IMAGE"], "{table}");
        assert_eq!(&rows[1][..4], ["/scratch", "scratch", "rw", "None"], "{table}");
        assert!(rows[1][4].ends_with("/volumes/kubernetes.io~empty-dir/scratch"), "{table}");
        assert_eq!(&rows[2][..4], ["/etc/level", "settings", "ro", "None"], "{table}");
        assert!(rows[2][4].ends_with("/volume-subpaths/settings/c/1"), "{table}");
        assert_eq!(rows[3], ["/tools", "tools", "ro", "None", "image", "registry.example/tools:1"], "{table}");

        let json: serde_json::Value = serde_json::from_str(&succeeds(Command::new(BIN).args(["mounts", "app", "-c", "c", "-o", "json", "--server", &server])).0).unwrap();
        assert_eq!(json["mounts"][1]["subPath"], "level");
        let cri: serde_json::Value = serde_json::from_str(&succeeds(Command::new(BIN).args(["mounts", "default/app", "-c", "c", "-o", "cri", "--server", &server])).0).unwrap();
        assert_eq!(cri["mounts"][2]["image"]["image"], "registry.example/tools:1");
        assert_eq!(cri["mounts"][0]["propagation"], "PROPAGATION_PRIVATE");

        // What cannot be given, and why.
        let (code, body) = answer(port, "/api/v1/pods/default/app/containers/c/mounts?format=oci");
        assert_eq!(code, 422, "an image volume has no OCI form: {body}");
        assert!(body.contains("\"tools\" is an image volume"), "{body}");
        let (code, body) = answer(port, "/api/v1/pods/default/waiting/containers/c/mounts");
        assert_eq!(code, 409, "{body}");
        assert!(body.contains("volume \"later\" of pod default/waiting is not mounted"), "{body}");
        let (code, body) = answer(port, "/api/v1/pods/default/app/containers/nope/mounts");
        assert_eq!((code, body.as_str()), (404, "pod default/app has no container \"nope\"\n"));
        let (code, body) = answer(port, "/api/v1/pods/default/nothing/containers/c/mounts");
        assert_eq!((code, body.as_str()), (404, "no pod default/nothing on this node\n"));
        let (code, _) = answer(port, "/api/v1/pods/default/app/containers/c/mounts?format=yaml");
        assert_eq!(code, 400);
        let refused = Command::new(BIN).args(["mounts", "default/Bad_Name", "-c", "c", "--server", &server]).output().unwrap();
        assert!(!refused.status.success());
        assert!(String::from_utf8_lossy(&refused.stderr).contains("pod name \"Bad_Name\""), "{}", String::from_utf8_lossy(&refused.stderr));
    }
}
