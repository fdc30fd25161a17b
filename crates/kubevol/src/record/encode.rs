//! A pod volume's journal line, written directly into the batch's buffer: the same bytes as
//! serde_json writes for it (a test holds the two together), in a fraction of the time.
//!
//! Every set-up and teardown writes three of these lines (about 600 bytes each, nearly all of
//! it strings: the pod, the unique name, the path, the source); serde_json looks at every byte
//! of every key and value for characters to escape, one at a time, and that was the record
//! writer's largest cost. Here the keys are constants, and a value is copied whole once a
//! check that the compiler vectorizes finds nothing in it to escape. The spec is written here
//! too when it is an emptyDir (the commonest volume, and the one of every storm of short-lived
//! pods); every other spec, and a PersistentVolume, is serde_json's.

use std::io;

use k8s_openapi::api::core::v1::{EmptyDirVolumeSource, Volume};

use super::{PodVolumeRecord, PodVolumeState};

/// Appends `r` as its journal line (`{"podVolume":{...}}`, without the newline) to `buf`.
pub(super) fn pod_volume_line(buf: &mut Vec<u8>, r: &PodVolumeRecord) -> io::Result<()> {
    // Every field, so that one added to the record cannot be left out here unnoticed.
    let PodVolumeRecord {
        version,
        state,
        pod,
        source,
        volume,
        unique_name,
        traits,
        path,
        read_only,
        sub_paths,
        spec,
    } = r;
    let Some(path) = path.to_str() else {
        // serde_json's own error for it.
        return serde_json::to_writer(&mut *buf, &super::journal::LineRef::PodVolume(r))
            .map_err(io::Error::other);
    };
    buf.extend_from_slice(b"{\"podVolume\":{\"version\":");
    number(buf, *version);
    buf.extend_from_slice(b",\"state\":");
    buf.extend_from_slice(match state {
        PodVolumeState::SettingUp => b"\"settingUp\"".as_slice(),
        PodVolumeState::SetUp => b"\"setUp\"",
        PodVolumeState::Uncertain => b"\"uncertain\"",
        PodVolumeState::TearingDown => b"\"tearingDown\"",
    });
    buf.extend_from_slice(b",\"pod\":{\"namespace\":");
    string(buf, &pod.namespace);
    buf.extend_from_slice(b",\"name\":");
    string(buf, &pod.name);
    buf.extend_from_slice(b",\"uid\":");
    string(buf, pod.uid.as_str());
    buf.extend_from_slice(b"},\"source\":");
    string(buf, source);
    buf.extend_from_slice(b",\"volume\":");
    string(buf, volume);
    buf.extend_from_slice(b",\"uniqueName\":");
    string(buf, unique_name.as_str());
    let super::TraitsRecord {
        plugin,
        attachable,
        device_mountable,
    } = traits;
    buf.extend_from_slice(b",\"traits\":{\"plugin\":");
    string(buf, plugin);
    buf.extend_from_slice(b",\"attachable\":");
    boolean(buf, *attachable);
    buf.extend_from_slice(b",\"deviceMountable\":");
    boolean(buf, *device_mountable);
    buf.extend_from_slice(b"},\"path\":");
    string(buf, path);
    buf.extend_from_slice(b",\"readOnly\":");
    boolean(buf, *read_only);
    if !sub_paths.is_empty() {
        buf.extend_from_slice(b",\"subPaths\":");
        serde_json::to_writer(&mut *buf, sub_paths).map_err(io::Error::other)?;
    }
    buf.extend_from_slice(b",\"spec\":");
    if !empty_dir_spec(buf, spec) {
        serde_json::to_writer(&mut *buf, spec).map_err(io::Error::other)?;
    }
    buf.extend_from_slice(b"}}");
    Ok(())
}

/// Appends `spec` as serde_json writes it when it is an emptyDir volume and nothing else (its
/// fields in the order the API types write them: the source, then the name); false, with
/// nothing appended, for any other spec.
fn empty_dir_spec(buf: &mut Vec<u8>, spec: &super::SpecRecord) -> bool {
    let super::SpecRecord {
        volume,
        persistent_volume,
        block,
        selinux,
    } = spec;
    // Every field, so that a source added to the API types cannot be missed here.
    let Volume {
        aws_elastic_block_store,
        azure_disk,
        azure_file,
        cephfs,
        cinder,
        config_map,
        csi,
        downward_api,
        empty_dir,
        ephemeral,
        fc,
        flex_volume,
        flocker,
        gce_persistent_disk,
        git_repo,
        glusterfs,
        host_path,
        image,
        iscsi,
        name,
        nfs,
        persistent_volume_claim,
        photon_persistent_disk,
        portworx_volume,
        projected,
        quobyte,
        rbd,
        scale_io,
        secret,
        storageos,
        vsphere_volume,
    } = &**volume;
    let Some(EmptyDirVolumeSource { medium, size_limit }) = empty_dir else {
        return false;
    };
    let others = [
        aws_elastic_block_store.is_some(),
        azure_disk.is_some(),
        azure_file.is_some(),
        cephfs.is_some(),
        cinder.is_some(),
        config_map.is_some(),
        csi.is_some(),
        downward_api.is_some(),
        ephemeral.is_some(),
        fc.is_some(),
        flex_volume.is_some(),
        flocker.is_some(),
        gce_persistent_disk.is_some(),
        git_repo.is_some(),
        glusterfs.is_some(),
        host_path.is_some(),
        image.is_some(),
        iscsi.is_some(),
        nfs.is_some(),
        persistent_volume_claim.is_some(),
        photon_persistent_disk.is_some(),
        portworx_volume.is_some(),
        projected.is_some(),
        quobyte.is_some(),
        rbd.is_some(),
        scale_io.is_some(),
        secret.is_some(),
        storageos.is_some(),
        vsphere_volume.is_some(),
        persistent_volume.is_some(),
        selinux.is_some(),
    ];
    if others.contains(&true) {
        return false;
    }
    buf.extend_from_slice(b"{\"volume\":{\"emptyDir\":{");
    let mut first = true;
    for (key, value) in [
        (b"\"medium\":".as_slice(), medium.as_deref()),
        (b"\"sizeLimit\":", size_limit.as_ref().map(|q| q.0.as_str())),
    ] {
        if let Some(value) = value {
            if !first {
                buf.push(b',');
            }
            first = false;
            buf.extend_from_slice(key);
            string(buf, value);
        }
    }
    buf.extend_from_slice(b"},\"name\":");
    string(buf, name);
    buf.extend_from_slice(b"},\"block\":");
    boolean(buf, *block);
    buf.push(b'}');
    true
}

/// A JSON string: copied whole when nothing in it needs escaping (no control character, quote
/// or backslash, the only bytes serde_json escapes), else escaped by serde_json.
fn string(buf: &mut Vec<u8>, s: &str) {
    // Every byte looked at, without a branch per byte (which keeps the loop from being
    // vectorized): a path is a hundred bytes.
    let plain = !s.bytes().fold(false, |escape, b| {
        escape | (b < 0x20) | (b == b'"') | (b == b'\\')
    });
    if plain {
        buf.reserve(s.len() + 2);
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
    } else {
        // Writing into a Vec cannot fail, nor can a str's serialization.
        let _ = serde_json::to_writer(&mut *buf, s);
    }
}

fn boolean(buf: &mut Vec<u8>, b: bool) {
    buf.extend_from_slice(if b { b"true" } else { b"false" });
}

fn number(buf: &mut Vec<u8>, n: u32) {
    let mut digits = [0u8; 10];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::{PersistentVolume, Volume};
    use kubevol_core::state::{PodVolumeRef, SubPathMount};
    use kubevol_core::{PodRef, PodUid, UniqueVolumeName};

    use super::super::journal::LineRef;
    use super::super::{PodVolumeRecord, PodVolumeState, SpecRecord, TraitsRecord};
    use super::*;

    fn record(text: &str, state: PodVolumeState) -> PodVolumeRecord {
        record_of(
            text,
            state,
            serde_json::json!({
                "name": "v",
                "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"},
            }),
        )
    }

    fn record_of(text: &str, state: PodVolumeState, volume: serde_json::Value) -> PodVolumeRecord {
        let volume: Volume = serde_json::from_value(volume).unwrap();
        PodVolumeRecord {
            version: 1,
            state,
            pod: PodRef {
                namespace: format!("ns{text}").as_str().into(),
                name: format!("name{text}").as_str().into(),
                uid: PodUid::from(format!("uid-{text}").as_str()),
            },
            source: format!("/etc/kubevol/{text}.yaml (document 1)").into(),
            volume: format!("vol{text}").as_str().into(),
            unique_name: UniqueVolumeName::from(format!("kubernetes.io/empty-dir/uid-{text}")),
            traits: TraitsRecord {
                plugin: format!("kubernetes.io/{text}").as_str().into(),
                attachable: text.len().is_multiple_of(2),
                device_mountable: text.len().is_multiple_of(3),
            },
            path: PathBuf::from(format!("/var/lib/kubevol/pods/{text}/volumes/v")),
            read_only: !text.len().is_multiple_of(2),
            sub_paths: Vec::new(),
            spec: SpecRecord {
                volume: PodVolumeRef::from(volume),
                persistent_volume: None,
                block: false,
                selinux: None,
            },
        }
    }

    fn serde_line(r: &PodVolumeRecord) -> Vec<u8> {
        serde_json::to_vec(&LineRef::PodVolume(r)).unwrap()
    }

    fn fast_line(r: &PodVolumeRecord) -> Vec<u8> {
        let mut buf = b"earlier lines\n".to_vec();
        pod_volume_line(&mut buf, r).unwrap();
        buf.split_off(b"earlier lines\n".len())
    }

    /// The line is serde_json's, byte for byte: every state, strings that need escaping
    /// (quotes, backslashes, every control character) or none, non-ASCII text, subPath mounts
    /// and a PersistentVolume, versions of any width.
    #[test]
    fn a_pod_volume_line_is_the_one_serde_json_writes() {
        let mut texts: Vec<String> = vec![
            String::new(),
            "plain".into(),
            "with \"quotes\" and \\backslashes\\".into(),
            "ünïcödé ✓ 日本".into(),
            "tab\tnewline\ncr\r".into(),
            "\u{7f} is not escaped".into(),
        ];
        texts.extend((0u8..0x20).map(|c| format!("control {}", c as char)));
        let states = [
            PodVolumeState::SettingUp,
            PodVolumeState::SetUp,
            PodVolumeState::Uncertain,
            PodVolumeState::TearingDown,
        ];
        for (i, text) in texts.iter().enumerate() {
            let mut r = record(text, states[i % states.len()]);
            r.version = [0, 1, 9, 10, 4_294_967_295][i % 5];
            if i % 3 == 0 {
                r.sub_paths.push(SubPathMount {
                    container: format!("c{text}"),
                    index: i,
                    sub_path: format!("sub/{text}"),
                    path: PathBuf::from(format!("/x/{text}")),
                });
            }
            if i % 4 == 0 {
                r.spec.persistent_volume = Some(Arc::new(
                    serde_json::from_value::<PersistentVolume>(serde_json::json!({
                        "metadata": {"name": format!("pv{text}")},
                        "spec": {"capacity": {"storage": "1Gi"}, "local": {"path": "/data"}},
                    }))
                    .unwrap(),
                ));
                r.spec.block = true;
            }
            assert_eq!(
                String::from_utf8_lossy(&fast_line(&r)),
                String::from_utf8_lossy(&serde_line(&r)),
                "{text:?}"
            );
        }
    }

    proptest::proptest! {
        /// Whatever the strings of a record hold (they come from manifests and volumes), the
        /// line written by hand is serde_json's, and reads back as the record it was.
        #[test]
        fn any_record_is_written_as_serde_json_writes_it(
            text in proptest::prelude::any::<String>(),
            other in proptest::prelude::any::<String>(),
            version in proptest::prop_oneof![proptest::prelude::Just(super::super::VERSION), proptest::prelude::any::<u32>()],
            state in 0usize..4,
        ) {
            let states = [
                PodVolumeState::SettingUp,
                PodVolumeState::SetUp,
                PodVolumeState::Uncertain,
                PodVolumeState::TearingDown,
            ];
            let mut r = record(&text, states[state]);
            r.version = version;
            r.source = other.clone().into();
            r.volume = other.into();
            let (fast, serde) = (fast_line(&r), serde_line(&r));
            proptest::prop_assert_eq!(String::from_utf8_lossy(&fast), String::from_utf8_lossy(&serde));
            // It reads back; a line of another format version is refused as such.
            match super::super::journal::parse(&fast) {
                Ok(_) => proptest::prop_assert_eq!(version, super::super::VERSION),
                Err(e) => proptest::prop_assert!(version != super::super::VERSION && matches!(e, super::super::journal::FormatError::Version { .. }), "{}", e),
            }
        }

        /// Any bytes in the journal are a record or a refused line, never a panic.
        #[test]
        fn any_line_is_read_or_refused(line in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = super::super::journal::parse(&line);
        }
    }

    /// An emptyDir spec is serde_json's too, with or without its medium and size, whatever its
    /// name holds, as a raw block volume; a spec with another source beside it, or of another
    /// kind, or with a PersistentVolume, is left to serde_json.
    #[test]
    fn a_spec_is_the_one_serde_json_writes() {
        let names = ["v", "with \"quotes\"", "ünï\tcode", ""];
        let sources = [
            serde_json::json!({"emptyDir": {}}),
            serde_json::json!({"emptyDir": {"medium": "Memory"}}),
            serde_json::json!({"emptyDir": {"sizeLimit": "1Mi"}}),
            serde_json::json!({"emptyDir": {"medium": "HugePages-2Mi", "sizeLimit": "2Mi"}}),
            serde_json::json!({"emptyDir": {"medium": "\\odd\u{1}"}}),
            serde_json::json!({"emptyDir": {}, "configMap": {"name": "both"}}),
            serde_json::json!({"emptyDir": {}, "vsphereVolume": {"volumePath": "/p"}}),
            serde_json::json!({"emptyDir": {}, "awsElasticBlockStore": {"volumeID": "a"}}),
            serde_json::json!({"hostPath": {"path": "/data"}}),
            serde_json::json!({"projected": {"sources": []}}),
        ];
        let mut written_here = 0;
        for (i, source) in sources.iter().enumerate() {
            for (j, name) in names.iter().enumerate() {
                let mut volume = source.clone();
                volume["name"] = (*name).into();
                let mut r = record_of(name, PodVolumeState::SetUp, volume);
                r.spec.block = (i + j) % 2 == 0;
                if (i + j) % 3 == 0 {
                    r.spec.persistent_volume = Some(Arc::new(
                        serde_json::from_value::<PersistentVolume>(serde_json::json!({
                            "metadata": {"name": "pv"},
                            "spec": {"local": {"path": "/data"}},
                        }))
                        .unwrap(),
                    ));
                }
                let mut buf = Vec::new();
                written_here += usize::from(empty_dir_spec(&mut buf, &r.spec));
                assert_eq!(
                    String::from_utf8_lossy(&fast_line(&r)),
                    String::from_utf8_lossy(&serde_line(&r)),
                    "{source} named {name:?}"
                );
            }
        }
        // The five emptyDir-only sources, less those with a PersistentVolume.
        assert_eq!(written_here, 13);
    }

    /// A path that is not UTF-8 is refused as serde_json refuses it, and nothing of the line
    /// is left in the buffer.
    #[test]
    fn a_path_that_is_not_utf8_is_an_error() {
        use std::os::unix::ffi::OsStrExt;
        let mut r = record("p", PodVolumeState::SetUp);
        r.path = PathBuf::from(std::ffi::OsStr::from_bytes(b"/bad/\xff"));
        let mut buf = b"earlier".to_vec();
        let fast = LineRef::PodVolume(&r)
            .encode_into(&mut buf)
            .unwrap_err()
            .to_string();
        let serde = serde_json::to_vec(&LineRef::PodVolume(&r))
            .unwrap_err()
            .to_string();
        assert_eq!(fast, serde);
        assert_eq!(buf, b"earlier");
    }
}
