//! The owners of a content volume's files (Kubernetes 1.37, `AtomicWriteVolumeUserFields`): an
//! item's `user`, else the volume's `defaultUser`, else the writer's own (as the kubelet
//! resolves them). The fields are newer than kubevol's API types and come from the volume's
//! extensions.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{KeyToPath, Volume};

use crate::state::VolumeExtensions;
use crate::validation::clean_item_path;

/// Who owns each file of a volume's payload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileOwners {
    /// The volume's `defaultUser`: every file no item names.
    pub default: Option<u32>,
    /// Files an item or source names with a `user`, by cleaned path.
    pub by_path: BTreeMap<String, u32>,
}

impl FileOwners {
    /// The owner of the file at `path` (cleaned, as the payload names it).
    pub fn of(&self, path: &str) -> Option<u32> {
        self.by_path.get(path).copied().or(self.default)
    }

    /// The owners `volume`'s extensions ask for.
    pub fn of_volume(volume: &Volume, ext: &VolumeExtensions) -> FileOwners {
        let mut by_path = BTreeMap::new();
        let mut name = |source: usize, item: usize, path: &str| {
            if let Some(u) = ext.item_users.get(&(source, item)) {
                by_path.insert(clean_item_path(path), *u);
            }
        };
        let key_paths = |items: Option<&Vec<KeyToPath>>| -> Vec<String> {
            items
                .into_iter()
                .flatten()
                .map(|i| i.path.clone())
                .collect()
        };
        let mut paths_of = |source: usize, paths: Vec<String>| {
            for (j, p) in paths.iter().enumerate() {
                name(source, j, p);
            }
        };
        if let Some(s) = &volume.secret {
            paths_of(0, key_paths(s.items.as_ref()));
        }
        if let Some(c) = &volume.config_map {
            paths_of(0, key_paths(c.items.as_ref()));
        }
        if let Some(d) = &volume.downward_api {
            paths_of(
                0,
                d.items.iter().flatten().map(|i| i.path.clone()).collect(),
            );
        }
        let mut own = Vec::new();
        if let Some(p) = &volume.projected {
            for (i, s) in p.sources.iter().flatten().enumerate() {
                if let Some(x) = &s.secret {
                    paths_of(i, key_paths(x.items.as_ref()));
                }
                if let Some(x) = &s.config_map {
                    paths_of(i, key_paths(x.items.as_ref()));
                }
                if let Some(x) = &s.downward_api {
                    paths_of(
                        i,
                        x.items.iter().flatten().map(|f| f.path.clone()).collect(),
                    );
                }
                let Some(u) = ext.source_users.get(&i) else {
                    continue;
                };
                if let Some(t) = &s.service_account_token {
                    own.push((t.path.clone(), *u));
                }
                if let Some(b) = &s.cluster_trust_bundle {
                    own.push((b.path.clone(), *u));
                }
                if let Some(c) = &s.pod_certificate {
                    let paths = [
                        &c.credential_bundle_path,
                        &c.key_path,
                        &c.certificate_chain_path,
                    ];
                    own.extend(paths.into_iter().flatten().map(|p| (p.clone(), *u)));
                }
            }
        }
        for (p, u) in own {
            by_path.insert(clean_item_path(&p), u);
        }
        FileOwners {
            default: ext.default_user,
            by_path,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_items_user_wins_over_the_volumes_default_user() {
        let volume: Volume = serde_json::from_value(json!({"name": "v", "projected": {"sources": [
            {"secret": {"name": "s", "items": [{"key": "a", "path": "./dir//a"}, {"key": "b", "path": "b"}]}},
            {"serviceAccountToken": {"path": "token"}},
            {"downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
        ]}}))
        .unwrap();
        let ext = VolumeExtensions {
            default_user: Some(1000),
            item_users: [((0, 0), 2000), ((2, 0), 3000)].into(),
            source_users: [(1, 4000)].into(),
            ..Default::default()
        };
        let owners = FileOwners::of_volume(&volume, &ext);
        assert_eq!(owners.of("dir/a"), Some(2000));
        assert_eq!(
            owners.of("b"),
            Some(1000),
            "no user of its own: the default"
        );
        assert_eq!(owners.of("token"), Some(4000));
        assert_eq!(owners.of("labels"), Some(3000));
        assert_eq!(
            FileOwners::of_volume(&volume, &VolumeExtensions::default()).of("b"),
            None
        );
    }
}
