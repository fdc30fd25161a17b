//! Where in a manifest's text a field is, and how a scalar was written there. The YAML
//! library's value keeps neither, so both are found by walking the document again with the
//! library's deserializer:
//!
//! - [`locate`]: the line and column of the node a field path (from a type error) names. The
//!   walk stops at that node with an error, and the deserializer stamps its error with the
//!   node's position.
//! - [`quoted_modes`]: the mode fields (`defaultMode`, `mode`) written as quoted strings. A
//!   scalar the parser borrows from the text points into it, so the character before it tells
//!   whether it was quoted.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// One step of a field path (the same steps name unknown fields).
pub(crate) use crate::source::unknown::Part as Step;

/// The steps of a path found by `serde_path_to_error`; `None` when a step cannot be followed
/// in the text (an enum variant, an unknown step).
pub(crate) fn steps(path: &serde_path_to_error::Path) -> Option<Vec<Step>> {
    path.iter()
        .map(|s| match s {
            serde_path_to_error::Segment::Seq { index } => Some(Step::Index(*index)),
            serde_path_to_error::Segment::Map { key } => Some(Step::Key(key.clone())),
            _ => None,
        })
        .collect()
}

/// Walks `d` down `steps` and fails at the node they lead to, so that the deserializer's error
/// carries that node's position. Returns `Ok` when the path is not in the text (it came
/// through a merge key, say).
pub(crate) fn locate<'de, D: Deserializer<'de>>(d: D, steps: &[Step]) -> Result<(), D::Error> {
    Seek(steps).deserialize(d)
}

struct Seek<'s>(&'s [Step]);

/// The visitor of the node the path leads to: every kind of node is refused, with its position.
struct Here;

impl<'de> Visitor<'de> for Here {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the field's position")
    }
}

impl<'de> DeserializeSeed<'de> for Seek<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        match self.0.first() {
            None => d.deserialize_any(Here),
            Some(Step::Key(_)) => d.deserialize_map(self),
            Some(Step::Index(_)) => d.deserialize_seq(self),
        }
    }
}

impl<'de> Visitor<'de> for Seek<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map or a sequence on the field's path")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Some((Step::Key(want), rest)) = self.0.split_first() else {
            return Ok(());
        };
        while let Some(key) = map.next_key::<KeyText>()? {
            if key.0.as_deref() == Some(want.as_str()) {
                return map.next_value_seed(Seek(rest));
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Some((Step::Index(want), rest)) = self.0.split_first() else {
            return Ok(());
        };
        for _ in 0..*want {
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
        }
        seq.next_element_seed(Seek(rest)).map(|_| ())
    }
}

/// A map key as text, or `None` for a key that is not a string.
struct KeyText(Option<String>);

impl<'de> de::Deserialize<'de> for KeyText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeyText;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyText, E> {
                Ok(KeyText(Some(v.to_string())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<KeyText, E> {
                Ok(KeyText(Some(v.to_string())))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<KeyText, E> {
                Ok(KeyText(Some(v.to_string())))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<KeyText, E> {
                Ok(KeyText(Some(v.to_string())))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<KeyText, E> {
                Ok(KeyText(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<KeyText, E> {
                Ok(KeyText(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<KeyText, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(KeyText(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<KeyText, A::Error> {
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(KeyText(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// A mode field written as a quoted string: its path, its value and its byte offset in the
/// text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct QuotedMode {
    pub(crate) path: String,
    pub(crate) value: String,
    pub(crate) offset: usize,
}

/// The mode fields (`defaultMode`, `mode`) of the document `d` of `text` whose value is a
/// quoted string (`defaultMode: "0644"`). The API's modes are integers: only a plain `0644`
/// is the YAML 1.1 octal number Kubernetes reads; a quoted one is a string it refuses.
pub(crate) fn quoted_modes<'de>(
    text: &'de str,
    d: serde_yaml_ng::Deserializer<'de>,
) -> Result<Vec<QuotedMode>, serde_yaml_ng::Error> {
    let mut found = Vec::new();
    Modes {
        text,
        path: String::new(),
        is_mode: false,
        found: &mut found,
    }
    .deserialize(d)?;
    Ok(found)
}

struct Modes<'a, 'de> {
    text: &'de str,
    path: String,
    /// The node is the value of a `defaultMode` or `mode` key.
    is_mode: bool,
    found: &'a mut Vec<QuotedMode>,
}

impl<'de> DeserializeSeed<'de> for Modes<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Modes<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<(), E> {
        if !self.is_mode {
            return Ok(());
        }
        // A scalar borrowed from the text lies inside it; the character before it is the
        // opening quote of a quoted scalar.
        let start = self.text.as_ptr() as usize;
        let at = v.as_ptr() as usize;
        if at > start && at <= start + self.text.len() {
            let offset = at - start;
            if matches!(self.text.as_bytes()[offset - 1], b'"' | b'\'') {
                self.found.push(QuotedMode {
                    path: self.path,
                    value: v.to_string(),
                    offset: offset - 1,
                });
            }
        }
        Ok(())
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        // Not borrowed: a quoted scalar with escapes or a folded one, never a plain number.
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_i128<E: de::Error>(self, _: i128) -> Result<(), E> {
        Ok(())
    }

    fn visit_u128<E: de::Error>(self, _: u128) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        // A tagged node: its content is walked as any other.
        let (_, variant) = data.variant::<IgnoredAny>()?;
        de::VariantAccess::newtype_variant_seed(variant, self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<KeyText>()? {
            let key = key.0.unwrap_or_default();
            let path = if self.path.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.path)
            };
            map.next_value_seed(Modes {
                text: self.text,
                path,
                is_mode: key == "defaultMode" || key == "mode",
                found: &mut *self.found,
            })?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0;
        loop {
            let next = Modes {
                text: self.text,
                path: format!("{}[{i}]", self.path),
                is_mode: false,
                found: &mut *self.found,
            };
            if seq.next_element_seed(next)?.is_none() {
                return Ok(());
            }
            i += 1;
        }
    }
}

/// The 1-based line and column of byte `offset` of `text`.
pub(crate) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml_location(text: &str, steps: &[Step]) -> Option<(usize, usize)> {
        let d = serde_yaml_ng::Deserializer::from_str(text);
        locate(d, steps)
            .err()
            .and_then(|e| e.location().map(|l| (l.line(), l.column())))
    }

    #[test]
    fn a_path_leads_to_its_node_in_yaml_and_json() {
        let text = "metadata:\n  name: p\n  labels: {app: web, version: 2}\nspec:\n  volumes:\n  - name: a\n    emptyDir: {}\n  - name: b\n    emptyDir:\n      medium: 5\n";
        let k = |s: &str| Step::Key(s.into());
        assert_eq!(
            yaml_location(text, &[k("metadata"), k("labels"), k("version")]),
            Some((3, 31))
        );
        assert_eq!(
            yaml_location(
                text,
                &[
                    k("spec"),
                    k("volumes"),
                    Step::Index(1),
                    k("emptyDir"),
                    k("medium")
                ]
            ),
            Some((10, 15))
        );
        assert_eq!(yaml_location(text, &[k("spec"), k("nothing")]), None);
        assert_eq!(
            yaml_location(text, &[k("spec"), k("volumes"), Step::Index(7)]),
            None
        );
        let json = "{\"spec\": {\"volumes\": [{\"name\": \"a\"},\n {\"name\": 5}]}}";
        let mut d = serde_json::Deserializer::from_str(json);
        let e = locate(
            &mut d,
            &[k("spec"), k("volumes"), Step::Index(1), k("name")],
        )
        .unwrap_err();
        assert_eq!((e.line(), e.column()), (2, 11));
    }

    #[test]
    fn quoted_modes_are_found_and_plain_ones_are_not() {
        let text = "spec:\n  volumes:\n  - secret: {defaultMode: \"0644\", items: [{key: k, path: k, mode: '0600'}]}\n  - configMap: {defaultMode: 0644, items: [{key: k, path: k, mode: 0400}]}\n  - name: \"mode\"\n";
        let found = quoted_modes(text, serde_yaml_ng::Deserializer::from_str(text)).unwrap();
        let got: Vec<(&str, &str, (usize, usize))> = found
            .iter()
            .map(|q| {
                (
                    q.path.as_str(),
                    q.value.as_str(),
                    line_column(text, q.offset),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("spec.volumes[0].secret.defaultMode", "0644", (3, 27)),
                ("spec.volumes[0].secret.items[0].mode", "0600", (3, 67)),
            ]
        );
    }
}
