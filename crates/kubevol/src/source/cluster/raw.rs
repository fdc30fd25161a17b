//! A pod as the API server wrote it, for the pod watch: its JSON read once into a value, with
//! its metadata typed beside it (the watcher reads resource versions from it). The typed pod
//! and the fields newer than kubevol's types are both read from that value afterwards, in one
//! pass ([`crate::source::unknown::read_tracked`]).

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::NamespaceResourceScope;
use serde::de::Error as _;
use serde_json::Value;

/// A pod's JSON and its metadata.
#[derive(Clone, Debug)]
pub struct RawPod {
    pub metadata: ObjectMeta,
    pub raw: Value,
}

impl<'de> serde::Deserialize<'de> for RawPod {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Value::deserialize(d)?;
        let metadata = match raw.get("metadata") {
            Some(m) => ObjectMeta::deserialize(m).map_err(D::Error::custom)?,
            None => ObjectMeta::default(),
        };
        Ok(RawPod { metadata, raw })
    }
}

impl kube::Resource for RawPod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Pod".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "pods".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raw_pod_keeps_the_whole_json_and_types_its_metadata() {
        let text = r#"{"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "n", "uid": "u", "resourceVersion": "7"},
            "spec": {"volumes": [{"name": "v", "emptyDir": {"mode": 448}}]}}"#;
        let pod: RawPod = serde_json::from_str(text).unwrap();
        assert_eq!(pod.raw, serde_json::from_str::<Value>(text).unwrap());
        assert_eq!(pod.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(kube::Resource::meta(&pod).name.as_deref(), Some("p"));
        assert_eq!(
            <RawPod as kube::Resource>::url_path(&(), Some("n")),
            "/api/v1/namespaces/n/pods"
        );
        // Metadata that does not read as metadata is refused, as for any typed object.
        assert!(serde_json::from_str::<RawPod>(r#"{"metadata": {"name": 1}}"#).is_err());
    }
}
