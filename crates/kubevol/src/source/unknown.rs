//! Fields an object sets that its API type does not have, at any depth, each with the closest
//! field the type does have: `readonly` in a volumeMount is `readOnly` misspelt, and kubectl's
//! strict validation would say `unknown field "spec.containers[0].volumeMounts[0].readonly"`.
//!
//! The raw value is deserialized into the type once more through a deserializer that follows
//! the path: every struct of the API types names its fields when it asks to be deserialized
//! (`deserialize_struct`), so a key it does not name is unknown there, and the names it gives
//! are what the key was probably meant to be.

use std::cell::RefCell;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::Deserializer;
use serde_json::Value;

pub use kubevol_core::state::UnknownField;

/// One step of a path from the object's root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// A field.
    Key(String),
    /// An element of a list.
    Index(usize),
}

/// A field the type does not have, where it is, and the fields the type has there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unknown {
    /// Where it is, from the object's root.
    pub path: Vec<Part>,
    /// The fields the type has at that place.
    pub known: &'static [&'static str],
}

impl Unknown {
    /// The path as kubectl spells it: `spec.containers[0].volumeMounts[0].readonly`.
    pub fn display_path(&self) -> String {
        let mut out = String::new();
        for p in &self.path {
            match p {
                Part::Key(k) if out.is_empty() => out.push_str(k),
                Part::Key(k) => {
                    out.push('.');
                    out.push_str(k);
                }
                Part::Index(i) => out.push_str(&format!("[{i}]")),
            }
        }
        out
    }

    /// The field it was probably meant to be.
    pub fn suggestion(&self) -> Option<&'static str> {
        let Some(Part::Key(key)) = self.path.last() else {
            return None;
        };
        closest(key, self.known)
    }

    /// The field as the status and the log name it.
    pub fn field(&self, location: Option<String>) -> UnknownField {
        UnknownField {
            path: self.display_path(),
            suggestion: self.suggestion().map(str::to_string),
            location,
        }
    }
}

/// The known name closest to `key`: the same letters in another case, else one within a small
/// edit distance (a third of its length, at most 3).
pub fn closest(key: &str, known: &[&'static str]) -> Option<&'static str> {
    if let Some(k) = known.iter().find(|k| k.eq_ignore_ascii_case(key)) {
        return Some(k);
    }
    let lower = key.to_ascii_lowercase();
    let limit = (key.chars().count() / 3).clamp(1, 3);
    known
        .iter()
        .map(|k| (edit_distance(&lower, &k.to_ascii_lowercase()), *k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// The Levenshtein distance between two strings, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let here = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(row[j]).min(here)
            };
            prev = here;
        }
    }
    row[b.len()]
}

/// The fields `raw` sets that `T` does not have, at any depth, by path. A `raw` that does not
/// deserialize into `T` at all gives what was found before the error (the type error itself is
/// reported by whoever deserializes it for use).
pub fn unknown_fields<T: de::DeserializeOwned>(raw: &Value) -> Vec<Unknown> {
    read_tracked::<T>(raw).1
}

/// `raw` read as a `T` (exactly as `T::deserialize(raw)` reads it), and the fields it sets that
/// `T` does not have, as [`unknown_fields`] finds them: one pass for both, reading `raw` in
/// place. A path is built only for a field that is unknown; the way down to the others is a
/// chain on the stack.
pub fn read_tracked<'v, T: de::Deserialize<'v>>(
    raw: &'v Value,
) -> (Result<T, serde_json::Error>, Vec<Unknown>) {
    let found = RefCell::new(Vec::new());
    let read = T::deserialize(Tracked {
        value: raw,
        path: None,
        found: &found,
    });
    let mut found = found.into_inner();
    found.sort_by_cached_key(Unknown::display_path);
    (read, found)
}

/// One step down from a parent, kept on the stack while what it leads to is read.
struct Link<'p> {
    parent: Option<&'p Link<'p>>,
    step: Step<'p>,
}

/// A [`Part`] borrowed from the value being read.
#[derive(Clone, Copy)]
enum Step<'p> {
    Key(&'p str),
    Index(usize),
}

/// The owned path from the root to `below` and then `key`.
fn path_to(below: Option<&Link<'_>>, key: &str) -> Vec<Part> {
    let mut path = vec![Part::Key(key.to_string())];
    let mut at = below;
    while let Some(link) = at {
        path.push(match link.step {
            Step::Key(k) => Part::Key(k.to_string()),
            Step::Index(i) => Part::Index(i),
        });
        at = link.parent;
    }
    path.reverse();
    path
}

/// A value being deserialized, where it is, and where unknown fields are written.
struct Tracked<'v, 'p> {
    value: &'v Value,
    path: Option<&'p Link<'p>>,
    found: &'p RefCell<Vec<Unknown>>,
}

/// Reads `value`, one `step` below `path`, with `seed`.
fn read_below<'v, S: DeserializeSeed<'v>>(
    path: Option<&Link<'_>>,
    step: Step<'_>,
    value: &'v Value,
    found: &RefCell<Vec<Unknown>>,
    seed: S,
) -> Result<S::Value, serde_json::Error> {
    let link = Link { parent: path, step };
    seed.deserialize(Tracked {
        value,
        path: Some(&link),
        found,
    })
}

/// A list's elements, each followed.
struct Seq<'v, 'p> {
    path: Option<&'p Link<'p>>,
    found: &'p RefCell<Vec<Unknown>>,
    items: std::iter::Enumerate<std::slice::Iter<'v, Value>>,
}

impl<'v> SeqAccess<'v> for Seq<'v, '_> {
    type Error = serde_json::Error;

    fn next_element_seed<S: DeserializeSeed<'v>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, Self::Error> {
        let Some((i, value)) = self.items.next() else {
            return Ok(None);
        };
        read_below(self.path, Step::Index(i), value, self.found, seed).map(Some)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.items.len())
    }
}

/// An object's fields, each followed.
struct Map<'v, 'p> {
    path: Option<&'p Link<'p>>,
    found: &'p RefCell<Vec<Unknown>>,
    entries: serde_json::map::Iter<'v>,
    value: Option<(&'v str, &'v Value)>,
}

impl<'v> MapAccess<'v> for Map<'v, '_> {
    type Error = serde_json::Error;

    fn next_key_seed<K: DeserializeSeed<'v>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        match self.entries.next() {
            Some((k, v)) => {
                let key = seed.deserialize(
                    de::value::BorrowedStrDeserializer::<Self::Error>::new(k.as_str()),
                )?;
                self.value = Some((k.as_str(), v));
                Ok(Some(key))
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'v>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let (key, value) = self
            .value
            .take()
            .ok_or_else(|| de::Error::custom("a value without its key"))?;
        read_below(self.path, Step::Key(key), value, self.found, seed)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

macro_rules! forward {
    ($($method:ident)*) => {
        $(
            fn $method<V: Visitor<'v>>(self, visitor: V) -> Result<V::Value, Self::Error> {
                self.value.$method(visitor)
            }
        )*
    };
}

impl<'v> Deserializer<'v> for Tracked<'v, '_> {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'v>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.value {
            Value::Array(_) => self.deserialize_seq(visitor),
            Value::Object(_) => self.deserialize_map(visitor),
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_option<V: Visitor<'v>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.value {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'v>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'v>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.value {
            Value::Array(items) => visitor.visit_seq(Seq {
                path: self.path,
                found: self.found,
                items: items.iter().enumerate(),
            }),
            other => other.deserialize_seq(visitor),
        }
    }

    fn deserialize_map<V: Visitor<'v>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.value {
            Value::Object(entries) => visitor.visit_map(Map {
                path: self.path,
                found: self.found,
                entries: entries.iter(),
                value: None,
            }),
            other => other.deserialize_map(visitor),
        }
    }

    fn deserialize_struct<V: Visitor<'v>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let Value::Object(entries) = self.value else {
            // (A list read as a struct, field by field, as serde_json reads it.)
            return self.value.deserialize_struct(name, fields, visitor);
        };
        for (k, v) in entries {
            if !v.is_null() && !fields.contains(&k.as_str()) {
                self.found.borrow_mut().push(Unknown {
                    path: path_to(self.path, k),
                    known: fields,
                });
            }
        }
        self.deserialize_map(visitor)
    }

    fn deserialize_tuple<V: Visitor<'v>>(
        self,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'v>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_enum<V: Visitor<'v>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.value.deserialize_enum(name, variants, visitor)
    }

    fn deserialize_unit_struct<V: Visitor<'v>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.value.deserialize_unit_struct(name, visitor)
    }

    forward! {
        deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
        deserialize_i128 deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
        deserialize_u128 deserialize_f32 deserialize_f64 deserialize_char deserialize_str
        deserialize_string deserialize_bytes deserialize_byte_buf deserialize_unit
        deserialize_identifier deserialize_ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, Pod};
    use serde_json::json;

    fn described<T: de::DeserializeOwned>(raw: Value) -> Vec<String> {
        unknown_fields::<T>(&raw)
            .iter()
            .map(|u| u.field(None).to_string())
            .collect()
    }

    #[test]
    fn unknown_fields_are_found_at_every_depth_with_the_field_meant() {
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "labelz": {"a": "b"}, "labels": {"any": "key"}},
            "spec": {
                "containers": [{"name": "c", "image": "x",
                    "volumeMounts": [{"name": "v", "mountpath": "/v", "readonly": true}],
                    "resources": {"limits": {"memory": "1Gi"}}}],
                "volumes": [{"name": "v", "configmap": {"name": "cm"}},
                            {"name": "w", "emptyDir": {"sizeLimt": "1Gi", "medium": "Memory"}}],
                "nodeSelector": {"any": "label"},
                "novelField": 1,
                "securityContext": {"fsGroup": 1, "nullIsUnset": null}
            }
        });
        assert_eq!(
            described::<Pod>(pod),
            [
                r#"unknown field "metadata.labelz" (did you mean "labels"?)"#,
                r#"unknown field "spec.containers[0].volumeMounts[0].mountpath" (did you mean "mountPath"?)"#,
                r#"unknown field "spec.containers[0].volumeMounts[0].readonly" (did you mean "readOnly"?)"#,
                r#"unknown field "spec.novelField""#,
                r#"unknown field "spec.volumes[0].configmap" (did you mean "configMap"?)"#,
                r#"unknown field "spec.volumes[1].emptyDir.sizeLimt" (did you mean "sizeLimit"?)"#,
            ]
        );
    }

    #[test]
    fn maps_of_any_keys_and_valid_objects_have_no_unknown_fields() {
        let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"},
                        "data": {"anyKey": "v", "other": "w"}});
        assert!(described::<ConfigMap>(cm).is_empty());
        let pv = json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "a"},
                        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                                 "hostPath": {"path": "/x", "typo": "Directory"}}});
        assert_eq!(
            described::<PersistentVolume>(pv),
            [r#"unknown field "spec.hostPath.typo" (did you mean "type"?)"#]
        );
    }

    /// The one-pass reading gives exactly what the type reads from the same value, for any
    /// pod-like value: the fields of a pod and their misspellings, nested any way, with
    /// values of every JSON kind in places where they fit and where they do not.
    #[test]
    fn reading_while_tracking_reads_what_the_type_reads() {
        use proptest::prelude::*;
        let key = prop::sample::select(vec![
            "apiVersion",
            "kind",
            "metadata",
            "name",
            "namespace",
            "uid",
            "labels",
            "spec",
            "containers",
            "image",
            "volumeMounts",
            "mountPath",
            "readOnly",
            "readonly",
            "volumes",
            "emptyDir",
            "medium",
            "sizeLimit",
            "mode",
            "configMap",
            "items",
            "key",
            "path",
            "defaultMode",
            "projected",
            "sources",
            "secret",
            "secretName",
            "optional",
            "status",
            "nodeName",
            "securityContext",
            "fsGroup",
            "resources",
            "limits",
            "novel",
            "",
        ]);
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0u32..0o2000).prop_map(Value::from),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            prop::sample::select(vec![
                "",
                "v",
                "Memory",
                "1Gi",
                "x/y",
                "2024-01-01T00:00:00Z"
            ])
            .prop_map(Value::from),
        ];
        let object = |key: BoxedStrategy<&'static str>, inner: BoxedStrategy<Value>| {
            prop::collection::btree_map(key, inner, 0..6).prop_map(|m| {
                Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            })
        };
        let key = key.boxed();
        let (k, o) = (key.clone(), object);
        let value = leaf.prop_recursive(6, 64, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                o(k.clone(), inner.boxed()),
            ]
        });
        // A pod's shape with anything in its volumes, and anything at all.
        let volume = object(key, value.clone().boxed());
        let named = |mut v: Value, name: String| {
            v.as_object_mut()
                .unwrap()
                .insert("name".into(), name.into());
            v
        };
        let pod = (volume.clone(), prop::collection::vec(volume, 0..4)).prop_map(move |(container, volumes)| {
            let volumes: Vec<Value> = volumes.into_iter().enumerate().map(|(i, v)| named(v, format!("v{i}"))).collect();
            serde_json::json!({"metadata": {"name": "p"}, "spec": {"containers": [named(container, "c".into())], "volumes": volumes}})
        });
        proptest!(|(raw in prop_oneof![pod, value])| {
            let (tracked, _) = read_tracked::<Pod>(&raw);
            match (tracked, <Pod as de::Deserialize>::deserialize(&raw)) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "tracked {a:?} against direct {b:?} for {raw}"),
            }
        });
    }

    #[test]
    fn the_closest_name_is_the_same_letters_or_a_near_spelling() {
        let known = &["readOnly", "mountPath", "name", "subPath", "subPathExpr"];
        assert_eq!(closest("readonly", known), Some("readOnly"));
        assert_eq!(closest("mountPth", known), Some("mountPath"));
        assert_eq!(closest("subpathexpr", known), Some("subPathExpr"));
        assert_eq!(closest("color", known), None);
        assert_eq!(closest("nme", known), Some("name"));
    }
}
