//! What a pod's manifest says of its volumes beyond the API types kubevol is built with. The
//! typed pod drops a field its types do not know; this compares the manifest's volumes with
//! the typed ones, so that newer fields are not lost silently: `emptyDir.mode` (Kubernetes
//! 1.37, alpha) is read and honoured, every other unknown field is reported by its path.

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::state::{PodExtensions, VolumeExtensions};
use serde_json::Value;

use super::unknown::{unknown_fields, Part};

/// The highest `emptyDir.mode`: the permission bits and the sticky bit.
pub const MAX_EMPTY_DIR_MODE: i64 = 0o1777;

/// The extensions of `pod`'s volumes, and the fields it sets that the types do not have, from
/// `raw` (the pod as its manifest or the API server wrote it). `locate` says where a field is in
/// its manifest, when there is one. Errors are the API server's validation errors of the
/// fields read here, each with the index of its volume (the field is that volume's
/// `emptyDir.mode`).
pub fn pod_extensions(
    raw: &Value,
    pod: &Pod,
    locate: &dyn Fn(&[Part]) -> Option<String>,
) -> Result<PodExtensions, Vec<(usize, String)>> {
    let mut out = PodExtensions::default();
    let mut errors = Vec::new();
    let typed = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_deref())
        .unwrap_or_default();
    let raw_volumes = raw
        .pointer("/spec/volumes")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut volumes: Vec<VolumeExtensions> = vec![VolumeExtensions::default(); typed.len()];
    for (i, (raw, ext)) in raw_volumes.iter().zip(&mut volumes).enumerate() {
        let path = format!("spec.volumes[{i}]");
        if let Some(mode) = raw
            .get("emptyDir")
            .and_then(|e| e.get("mode"))
            .filter(|m| !m.is_null())
        {
            match mode.as_i64().filter(|m| (0..=MAX_EMPTY_DIR_MODE).contains(m)) {
                Some(m) => ext.empty_dir_mode = u32::try_from(m).ok(),
                None => errors.push((
                    i,
                    format!("{path}.emptyDir.mode: Invalid value: {mode}: must be a number between 0 and 01777 (octal), both inclusive"),
                )),
            }
        }
    }
    for unknown in unknown_fields::<Pod>(raw) {
        let field = unknown.field(locate(&unknown.path));
        match unknown.path.as_slice() {
            [Part::Key(s), Part::Key(v), Part::Index(i), rest @ ..]
                if s == "spec" && v == "volumes" && *i < volumes.len() =>
            {
                // Read and honoured above.
                let mode =
                    matches!(rest, [Part::Key(e), Part::Key(m)] if e == "emptyDir" && m == "mode");
                if !mode {
                    volumes[*i].unknown_fields.push(field);
                }
            }
            _ => out.unknown_fields.push(field),
        }
    }
    for (typed, ext) in typed.iter().zip(volumes) {
        if ext != VolumeExtensions::default() {
            out.volumes.insert(typed.name.clone(), ext);
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn extensions(volumes: Value) -> Result<PodExtensions, Vec<String>> {
        let raw = json!({"spec": {"containers": [], "volumes": volumes}});
        let pod: Pod = serde_json::from_value(raw.clone()).unwrap();
        pod_extensions(&raw, &pod, &|_| None).map_err(|e| e.into_iter().map(|(_, m)| m).collect())
    }

    #[test]
    fn empty_dir_mode_is_read_and_other_unknown_fields_are_named() {
        let ext = extensions(json!([
            {"name": "a", "emptyDir": {"medium": "Memory", "mode": 0o1770}},
            {"name": "b", "emptyDir": {}},
            {"name": "c", "configMap": {"name": "x", "items": [{"key": "k", "path": "p", "future": true}], "shiny": 1}, "alsoNew": {}},
            {"name": "d", "secret": {"secretName": "s", "nullIsNotSet": null}},
        ]))
        .unwrap();
        assert_eq!(ext.volumes.len(), 2, "{ext:?}");
        assert_eq!(
            ext.volumes["a"],
            VolumeExtensions {
                empty_dir_mode: Some(0o1770),
                unknown_fields: vec![]
            }
        );
        let paths: Vec<&str> = ext.volumes["c"]
            .unknown_fields
            .iter()
            .map(|f| f.path.as_str())
            .collect();
        assert_eq!(
            paths,
            vec![
                "spec.volumes[2].alsoNew",
                "spec.volumes[2].configMap.items[0].future",
                "spec.volumes[2].configMap.shiny"
            ]
        );
    }

    #[test]
    fn empty_dir_mode_is_validated_as_the_api_server_does() {
        for bad in [json!(0o2000), json!(-1), json!("0750"), json!(1.5)] {
            let err = extensions(json!([{"name": "a", "emptyDir": {"mode": bad}}])).unwrap_err();
            assert_eq!(err.len(), 1);
            assert!(
                err[0].starts_with("spec.volumes[0].emptyDir.mode: Invalid value: "),
                "{err:?}"
            );
            assert!(
                err[0].ends_with("must be a number between 0 and 01777 (octal), both inclusive"),
                "{err:?}"
            );
        }
        assert_eq!(
            extensions(json!([{"name": "a", "emptyDir": {"mode": 0}}]))
                .unwrap()
                .volumes["a"]
                .empty_dir_mode,
            Some(0)
        );
    }
}
