//! Real containers on what kubevol mounted: each test resolves a container's mounts
//! ([`kubevol::VolumeManager::container_mounts`]), turns them into an OCI `config.json`
//! ([`kubevol::containers::oci::oci_config`]) on a static busybox root filesystem, and runs it
//! with crun, in the test's own private mount namespace.

#[macro_use]
mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::runtime::{finish, Runtime};
use common::*;
use k8s_openapi::api::core::v1::Pod;
use kubevol::source::ManifestSource;
use kubevol::status::PodPhase;
use kubevol::VolumeManager;

/// Starts a manager on the manifests in `dir`, waits until `pod` is ready and returns both.
async fn ready(root: &TestRoot, manifests: &Path, name: &str) -> (VolumeManager, Pod) {
    let m = manager(root.path(), |c| {
        c.host_path_allow = vec![root.path().join("host")];
    });
    let source = ManifestSource::new(manifests);
    // The watch goes on by itself (its handle is not needed to keep it).
    source
        .listen(m.store().sink(ManifestSource::NAME))
        .await
        .expect("watch manifests");
    let key = pod(
        serde_json::json!({"metadata": {"name": name, "namespace": "default"}, "spec": {"containers": []}}),
    );
    let status = wait_for_status(&m, &key, 120, |s| s.phase == PodPhase::Ready).await;
    assert_eq!(status.phase, PodPhase::Ready, "{status:#?}");
    let uid = kubevol::pod_uid(&key);
    let stored = m.store().pod(&uid).expect("the pod is stored");
    (m, (*stored.pod).clone())
}

const SECRET_AND_CACHE: &str = r#"
apiVersion: v1
kind: Secret
metadata: {name: db}
stringData: {password: "s3cret"}
---
apiVersion: v1
kind: Pod
metadata: {name: batch}
spec:
  securityContext: {runAsUser: 1000, runAsGroup: 1000, fsGroup: 2000}
  containers:
  - name: job
    command: [sh, -c]
    args:
    - |
      id
      cat /run/db/password; echo
      ls -ln /run/db/..data/password
      echo written > /cache/out && echo cache=ok
      if echo x > /frozen/x 2>/dev/null; then echo frozen=writable; else echo frozen=refused; fi
      if echo x > /run/db/x 2>/dev/null; then echo secret=writable; else echo secret=refused; fi
    volumeMounts:
    - {name: db, mountPath: /run/db}
    - {name: cache, mountPath: /cache}
    - {name: cache, mountPath: /frozen, readOnly: true}
  volumes:
  - {name: db, secret: {secretName: db, defaultMode: 0440}}
  - {name: cache, emptyDir: {}}
"#;

mount_test! {
    /// A container running as uid 1000 with fsGroup 2000 reads its Secret (0440, group
    /// 2000), writes its emptyDir (which the host then sees, owned by the container's user),
    /// and is refused writing a read-only mount of the same emptyDir and its Secret.
    fn a_container_reads_its_secret_writes_its_empty_dir_and_is_refused_read_only_mounts() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        write_manifest(&manifests, "batch.yaml", SECRET_AND_CACHE);
        let rt = Runtime::new(&root.path().join("runtime"));
        runtime().block_on(async {
            let (m, pod) = ready(&root, &manifests, "batch").await;
            let out = rt.run(&m, &pod, "job");
            let lines: Vec<&str> = out.lines().collect();
            assert!(lines[0].starts_with("uid=1000 gid=1000 groups=2000"), "{out}");
            assert_eq!(lines[1], "s3cret", "{out}");
            let ls: Vec<&str> = lines[2].split_whitespace().collect();
            assert_eq!((ls[0], ls[2], ls[3]), ("-r--r-----", "0", "2000"), "{out}");
            assert_eq!(&lines[3..], ["cache=ok", "frozen=refused", "secret=refused"], "{out}");
            let cache = &m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["cache"].path;
            assert_eq!(fs::read_to_string(cache.join("out")).unwrap(), "written\n");
            assert_eq!(fs::metadata(cache.join("out")).unwrap().uid(), 1000);
            m.shutdown();
        });
    }
}

fn config_map(value: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: ConfigMap
metadata: {{name: settings}}
data: {{level: "{value}"}}
"#
    )
}

const WATCHER: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: watcher}
spec:
  containers:
  - name: watch
    command: [sh, -c]
    args:
    - |
      echo started > /scratch/started
      i=0
      while [ "$(cat /settings/level)" = v1 ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
      echo "directory=$(cat /settings/level)"
      echo "subPath=$(cat /level)"
    volumeMounts:
    - {name: settings, mountPath: /settings}
    - {name: settings, mountPath: /level, subPath: level}
    - {name: scratch, mountPath: /scratch}
  volumes:
  - {name: settings, configMap: {name: settings}}
  - {name: scratch, emptyDir: {}}
"#;

mount_test! {
    /// A ConfigMap changed while its container runs: the directory mount shows the new value
    /// (how soon is printed), the key mounted through subPath keeps the value it had when the
    /// container started, as in Kubernetes.
    fn a_config_map_key_through_sub_path_keeps_its_value_while_the_directory_follows() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        write_manifest(&manifests, "settings.yaml", &config_map("v1"));
        write_manifest(&manifests, "watcher.yaml", WATCHER);
        let rt = Runtime::new(&root.path().join("runtime"));
        runtime().block_on(async {
            let (m, pod) = ready(&root, &manifests, "watcher").await;
            let container = rt.start(&m, &pod, "watch");
            let scratch = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["scratch"].path.clone();
            let begun = Instant::now();
            while !scratch.join("started").exists() {
                assert!(begun.elapsed() < Duration::from_secs(60), "the container never started");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let changed = Instant::now();
            write_manifest(&manifests, "settings.yaml", &config_map("v2"));
            let out = tokio::task::spawn_blocking(move || finish(container)).await.unwrap();
            let seen = changed.elapsed();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
            assert_eq!(text, "directory=v2\nsubPath=v1\n");
            println!("the container saw the ConfigMap's change after {} ms", seen.as_millis());
            m.shutdown();
        });
    }
}

const NESTED: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: nested}
spec:
  containers:
  - name: probe
    command: [sh, -c]
    args:
    - |
      for d in /rro /ro; do
        if echo x > $d/top 2>/dev/null; then echo "$d/top=writable"; else echo "$d/top=refused"; fi
        if echo x > $d/sub/inner 2>/dev/null; then echo "$d/sub=writable"; else echo "$d/sub=refused"; fi
      done
    volumeMounts:
    - {name: data, mountPath: /rro, readOnly: true, recursiveReadOnly: Enabled}
    - {name: data, mountPath: /ro, readOnly: true}
  volumes:
  - name: data
    hostPath: {path: HOST, type: Directory}
"#;

mount_test! {
    /// `recursiveReadOnly: Enabled` makes a mount below a read-only hostPath read-only too;
    /// a plain `readOnly` leaves it writable (the kernel's bind remount is not recursive).
    fn recursive_read_only_makes_a_submount_of_a_read_only_host_path_read_only() {
        let root = TestRoot::new();
        let host = root.path().join("host/data");
        fs::create_dir_all(host.join("sub")).unwrap();
        rustix::mount::mount("tmpfs", host.join("sub"), "tmpfs", rustix::mount::MountFlags::empty(), None).unwrap();
        let manifests = root.manifests();
        write_manifest(&manifests, "nested.yaml", &NESTED.replace("HOST", host.to_str().unwrap()));
        let rt = Runtime::new(&root.path().join("runtime"));
        runtime().block_on(async {
            let (m, pod) = ready(&root, &manifests, "nested").await;
            let out = rt.run(&m, &pod, "probe");
            assert_eq!(out, "/rro/top=refused\n/rro/sub=refused\n/ro/top=refused\n/ro/sub=writable\n");
            m.shutdown();
        });
    }
}

const PROPAGATED: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: follower}
spec:
  containers:
  - name: follow
    command: [sh, -c]
    args:
    - |
      echo started > /scratch/started
      i=0
      while ! [ -e /host/later/hello -a -e /memory/later/hello ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
      cat /host/later/hello || echo "the mount made below the host path never showed"
      cat /memory/later/hello || echo "the mount made below the volume never showed"
    volumeMounts:
    - {name: host, mountPath: /host, mountPropagation: HostToContainer}
    - {name: memory, mountPath: /memory, mountPropagation: HostToContainer}
    - {name: scratch, mountPath: /scratch}
  volumes:
  - {name: host, hostPath: {path: HOST, type: Directory}}
  - {name: memory, emptyDir: {medium: Memory}}
  - {name: scratch, emptyDir: {}}
"#;

mount_test! {
    /// `HostToContainer`: a filesystem mounted on the host below the hostPath after the
    /// container started shows in the container, and so does one mounted below a
    /// memory-backed emptyDir: the host's directory lies on a shared mount, as systemd makes
    /// every mount (kubevol's pinned bind of it joins its peers); the emptyDir's tmpfs, made
    /// private in this private namespace, kubevol makes shared.
    fn host_to_container_shows_a_mount_made_on_the_host_after_the_container_started() {
        let root = TestRoot::new();
        let host = root.path().join("host/shared");
        fs::create_dir_all(host.join("later")).unwrap();
        let bind = rustix::mount::MountFlags::BIND;
        rustix::mount::mount(&host, &host, "", bind, None).unwrap();
        use rustix::mount::MountPropagationFlags as P;
        rustix::mount::mount_change(&host, P::SHARED | P::REC).unwrap();
        let manifests = root.manifests();
        write_manifest(&manifests, "follower.yaml", &PROPAGATED.replace("HOST", host.to_str().unwrap()));
        let rt = Runtime::new(&root.path().join("runtime"));
        runtime().block_on(async {
            let (m, pod) = ready(&root, &manifests, "follower").await;
            // The set-up made the emptyDir's own mount shared; reading the container's mounts
            // changes no mount.
            let table = || {
                use kubevol_mount::Mounter;
                kubevol_mount::LinuxMounter.mount_table().unwrap().into_iter().map(|m| (m.mount_point.clone(), m.is_shared())).collect::<Vec<_>>()
            };
            let memory = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["memory"].path.clone();
            let before = table();
            assert!(before.contains(&(memory.clone(), true)), "the emptyDir's mount is shared after its set-up: {before:?}");
            m.container_mounts(&pod, "follow").expect("the container's mounts");
            assert_eq!(table(), before, "a read changed a mount");
            let container = rt.start(&m, &pod, "follow");
            let scratch = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["scratch"].path.clone();
            let begun = Instant::now();
            while !scratch.join("started").exists() {
                assert!(begun.elapsed() < Duration::from_secs(60), "the container never started");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let memory = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["memory"].path.clone();
            for (dir, text) in [(host.clone(), "below the host path\n"), (memory, "below the volume\n")] {
                fs::create_dir_all(dir.join("later")).unwrap();
                rustix::mount::mount("tmpfs", dir.join("later"), "tmpfs", rustix::mount::MountFlags::empty(), None).unwrap();
                fs::write(dir.join("later/hello"), text).unwrap();
            }
            let out = tokio::task::spawn_blocking(move || finish(container)).await.unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout), "below the host path\nbelow the volume\n");
            m.shutdown();
        });
    }
}

const PROJECTED: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata: {name: app}
data: {mode: "fast", "multi.line": "a\nb\n"}
---
apiVersion: v1
kind: Secret
metadata: {name: token}
stringData: {token: "t0k3n"}
---
apiVersion: v1
kind: Pod
metadata:
  name: reader
  labels: {app: reader, tier: back}
  annotations: {note: "hello world"}
spec:
  containers:
  - name: read
    command: [sh, -c]
    args:
    - |
      cd /all && for f in mode multi.line token name; do echo "== $f"; cat $f; echo; done
      cd /info && for f in labels annotations namespace cpu; do echo "== $f"; cat $f; echo; done
    resources: {limits: {cpu: 500m}}
    volumeMounts:
    - {name: all, mountPath: /all}
    - {name: info, mountPath: /info}
  volumes:
  - name: all
    projected:
      sources:
      - configMap: {name: app}
      - secret: {name: token}
      - downwardAPI: {items: [{path: name, fieldRef: {fieldPath: metadata.name}}]}
  - name: info
    downwardAPI:
      items:
      - {path: labels, fieldRef: {fieldPath: metadata.labels}}
      - {path: annotations, fieldRef: {fieldPath: metadata.annotations}}
      - {path: namespace, fieldRef: {fieldPath: metadata.namespace}}
      - {path: cpu, resourceFieldRef: {containerName: read, resource: limits.cpu, divisor: 1m}}
"#;

mount_test! {
    /// A projected volume (a ConfigMap, a Secret and the pod's name) and a downwardAPI volume
    /// (labels, annotations, namespace, a resource limit) read back exactly in the container.
    fn projected_and_downward_api_volumes_read_back_exactly_in_a_container() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        write_manifest(&manifests, "reader.yaml", PROJECTED);
        let rt = Runtime::new(&root.path().join("runtime"));
        runtime().block_on(async {
            let (m, pod) = ready(&root, &manifests, "reader").await;
            let out = rt.run(&m, &pod, "read");
            assert_eq!(
                out,
                "== mode\nfast\n== multi.line\na\nb\n\n== token\nt0k3n\n== name\nreader\n\
                 == labels\napp=\"reader\"\ntier=\"back\"\n== annotations\nnote=\"hello world\"\n\
                 == namespace\ndefault\n== cpu\n500\n"
            );
            m.shutdown();
        });
    }
}

mount_test! {
    /// An image volume has nothing to set up: its pod is ready at once, the runtime gets the
    /// reference (and subPath), nothing is made on the node for it, a restart finds it again
    /// without a problem, and its teardown leaves nothing.
    fn an_image_volume_is_handed_to_the_runtime_by_reference_and_survives_a_restart() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let p = pod(serde_json::json!({"metadata": {"name": "tools", "namespace": "default"}, "spec": {
                "containers": [{"name": "c", "volumeMounts": [{"name": "t", "mountPath": "/t", "subPath": "bin"}]}],
                "volumes": [{"name": "t", "image": {"reference": "registry.example/tools:1", "pullPolicy": "IfNotPresent"}}]}}));
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.unwrap();
            let mounts = m.container_mounts(&p, "c").unwrap();
            let t = &mounts.mounts[0];
            assert_eq!(t.image.as_ref().map(|i| i.reference.as_str()), Some("registry.example/tools:1"));
            assert_eq!((t.host_path.as_ref(), t.sub_path.as_deref(), t.read_only), (None, Some("bin"), true));
            let pod_dir = m.config().root_dir.join("pods").join(kubevol::pod_uid(&p).as_str());
            assert!(!pod_dir.join("volumes/kubernetes.io~image").exists(), "nothing is made for it");
            assert!(mounts_under(&pod_dir).is_empty());
            let status = m.pod_status(&kubevol::pod_uid(&p)).unwrap();
            assert_eq!(status.volumes[0].path.as_deref(), Some("image registry.example/tools:1"), "the status names what the runtime gets");

            let m = restart(m, root.path(), |_| {}).await;
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.unwrap();
            assert_eq!(m.status(false).reconstruction.problems, Vec::<String>::new());
            assert_eq!(m.container_mounts(&p, "c").unwrap(), mounts);
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.unwrap();
            assert!(!pod_dir.exists() || mounts_under(&pod_dir).is_empty());
            m.shutdown();
        });
    }
}

fn owned_secret(default_user: u32) -> String {
    format!(
        r#"
apiVersion: v1
kind: Secret
metadata: {{name: keys}}
stringData: {{mine: "for 1000", theirs: "for 2000"}}
---
apiVersion: v1
kind: Pod
metadata: {{name: owner}}
spec:
  securityContext: {{runAsUser: 1000, runAsGroup: 1000}}
  containers:
  - name: read
    command: [sh, -c]
    args:
    - |
      cat /keys/mine; echo
      if cat /keys/theirs 2>/dev/null; then echo; else echo "theirs: refused"; fi
      ls -ln /keys/..data/ | awk 'NR>1 {{print $3, $9}}'
    volumeMounts: [{{name: keys, mountPath: /keys}}]
  volumes:
  - name: keys
    secret:
      secretName: keys
      defaultMode: 0400
      defaultUser: {default_user}
      items: [{{key: mine, path: mine}}, {{key: theirs, path: theirs, user: 2000}}]
"#
    )
}

mount_test! {
    /// `defaultUser` and an item's `user` (Kubernetes 1.37, `AtomicWriteVolumeUserFields`)
    /// own a Secret's files: a container running as uid 1000 reads the 0400 file it owns and
    /// is refused the one owned by 2000; a changed `defaultUser` gives the files their new
    /// owner though their content is the same.
    fn a_secrets_files_belong_to_their_default_user_and_item_users() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        write_manifest(&manifests, "owner.yaml", &owned_secret(1000));
        let rt = Runtime::new(&root.path().join("runtime"));
        runtime().block_on(async {
            let (m, pod) = ready(&root, &manifests, "owner").await;
            let out = rt.run(&m, &pod, "read");
            assert_eq!(out, "for 1000\ntheirs: refused\n1000 mine\n2000 theirs\n");
            let keys = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["keys"].path.clone();
            let link = fs::symlink_metadata(keys.join("mine")).unwrap();
            assert_eq!(link.uid(), 1000, "the visible link is the file's owner's too");

            write_manifest(&manifests, "owner.yaml", &owned_secret(3000));
            let owner = || fs::metadata(keys.join("mine")).map(|m| m.uid()).unwrap_or(0);
            let begun = Instant::now();
            while owner() != 3000 {
                assert!(begun.elapsed() < Duration::from_secs(120), "the new defaultUser never took");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(fs::metadata(keys.join("theirs")).unwrap().uid(), 2000);
            m.shutdown();
        });
    }
}
