//! The budget of a pod's content volumes (ConfigMap, Secret, projected, downwardAPI): what
//! their files take, counted per pod, and a volume refused when it would take the pod past its
//! budget, so that one pod's volumes of a large object cannot fill the node's disk or memory
//! (each key is a file of at least a page: 150 volumes of a 1 MiB ConfigMap of 3,300 keys
//! wrote 1.9 GB). The budget is the pod's `ephemeral-storage` limit when it sets one (the
//! kubelet's eviction counts these volumes against it), else [`DEFAULT_BUDGET`].

use kubevol_core::collections::HashMap;
use kubevol_core::PodUid;
use std::sync::Mutex;

/// A pod's budget when it sets no ephemeral-storage limit.
pub const DEFAULT_BUDGET: u64 = 256 << 20;

/// The kubelet's default hard eviction threshold of memory (`memory.available<100Mi`): a node
/// with less free is short of memory, and its pods are evicted.
pub const EVICTION_MEMORY: u64 = 100 << 20;

/// The kubelet's default hard eviction threshold of the node's filesystem, in percent of it
/// (`nodefs.available<10%`).
pub const EVICTION_NODEFS_PERCENT: u64 = 10;

/// A pod's budget for its content volumes, and in words which cap applied and what to do: its
/// `ephemeral-storage` limit (else [`DEFAULT_BUDGET`]), but never more than the node has for it
/// (its allocatable memory for content kept in memory, its allocatable ephemeral storage for
/// the rest, less the kubelet's eviction threshold): a pod that gave itself a limit of 100Ti
/// would be evicted by the kubelet long before it got that, and must not get it here.
pub(crate) fn budget_of(
    pod: &k8s_openapi::api::core::v1::Pod,
    in_memory: bool,
    node: &kubevol_core::projection::NodeAllocatable,
) -> (u64, String) {
    let limit = super::empty_dir::pod_limit(pod, "ephemeral-storage")
        .and_then(|l| u64::try_from(l).ok())
        .filter(|l| *l > 0);
    let (own, own_why) = match limit {
        Some(l) => (l, format!("its ephemeral-storage limit of {l} bytes")),
        None => (
            DEFAULT_BUDGET,
            "256 MiB without an ephemeral-storage limit".to_string(),
        ),
    };
    let (cap, cap_why) = if in_memory {
        let memory = u64::try_from(node.memory).unwrap_or(0);
        (
            memory.saturating_sub(EVICTION_MEMORY),
            format!("the node's allocatable memory of {memory} bytes less the kubelet's eviction threshold of 100 MiB, as the volume's files are in memory"),
        )
    } else {
        let storage = u64::try_from(node.ephemeral_storage).unwrap_or(0);
        (
            storage / 100 * (100 - EVICTION_NODEFS_PERCENT),
            format!("the node's allocatable ephemeral storage of {storage} bytes less the kubelet's eviction threshold of 10 %"),
        )
    };
    if cap > 0 && cap < own {
        return (
            cap,
            format!("{cap_why}, which is below {own_why}: the kubelet would evict the pod before its volumes got more; use fewer or smaller objects"),
        );
    }
    (
        own,
        format!(
            "{own_why}; use fewer or smaller objects, or raise the pod's ephemeral-storage limit"
        ),
    )
}

/// What each content volume of each pod takes, by pod: a set-up looks at its own pod's
/// volumes only.
#[derive(Default)]
pub struct ContentUsage {
    by_pod: Mutex<HashMap<PodUid, HashMap<String, u64>>>,
}

/// The bytes a file of `len` bytes takes: whole pages, one at least.
pub(crate) fn pages(len: usize) -> u64 {
    const PAGE: u64 = 4096;
    (len as u64).div_ceil(PAGE).max(1) * PAGE
}

/// How many directories the payload paths `paths` make (each distinct parent, at any depth).
pub(crate) fn directories<'a>(paths: impl Iterator<Item = &'a str>) -> u64 {
    let mut dirs = std::collections::HashSet::new();
    for p in paths {
        for (i, c) in p.char_indices() {
            if c == '/' {
                dirs.insert(&p[..i]);
            }
        }
    }
    dirs.len() as u64
}

impl ContentUsage {
    /// Counts `need` bytes for `volume` of `pod` (in place of what it took before), unless
    /// that takes the pod's content past `budget`: then what the pod's other content volumes
    /// take, and nothing is counted.
    pub(crate) fn take(
        &self,
        pod: &PodUid,
        volume: &str,
        need: u64,
        budget: u64,
    ) -> Result<(), u64> {
        let mut map = crate::sync::lock(&self.by_pod);
        let volumes = map.entry(pod.clone()).or_default();
        let others: u64 = volumes
            .iter()
            .filter(|(v, _)| v.as_str() != volume)
            .map(|(_, n)| *n)
            .sum();
        if others.saturating_add(need) > budget {
            if volumes.is_empty() {
                map.remove(pod);
            }
            return Err(others);
        }
        volumes.insert(volume.to_string(), need);
        Ok(())
    }

    /// Forgets `volume` of `pod` (torn down), and the pod with its last volume.
    pub(crate) fn release(&self, pod: &PodUid, volume: &str) {
        let mut map = crate::sync::lock(&self.by_pod);
        if let Some(volumes) = map.get_mut(pod) {
            volumes.remove(volume);
            if volumes.is_empty() {
                map.remove(pod);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_content_is_counted_against_its_budget_per_volume() {
        let u = ContentUsage::default();
        let (a, b) = (PodUid("a".into()), PodUid("b".into()));
        assert_eq!(pages(0), 4096);
        assert_eq!(pages(4097), 8192);
        u.take(&a, "one", 600, 1000).unwrap();
        assert_eq!(
            u.take(&a, "two", 500, 1000),
            Err(600),
            "past the budget: refused"
        );
        u.take(&b, "two", 500, 1000).unwrap();
        u.take(&a, "one", 400, 1000).unwrap();
        u.take(&a, "two", 600, 1000).unwrap();
        u.release(&a, "one");
        u.take(&a, "three", 400, 1000).unwrap();
        for v in ["two", "three"] {
            u.release(&a, v);
        }
        u.release(&b, "two");
        assert!(
            crate::sync::lock(&u.by_pod).is_empty(),
            "nothing kept of pods gone"
        );
    }
}
