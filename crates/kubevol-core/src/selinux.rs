//! The SELinux label a volume is mounted with (`-o context="<label>"`), decided as the
//! kubelet decides it (KEP-1710: SELinuxMountReadWriteOncePod and SELinuxChangePolicy, GA in
//! 1.36; SELinuxMount, beta and off by default): mounting with the label spares the container
//! runtime a recursive relabelling of every file, and keeps two pods with different labels from
//! sharing the volume.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Pod, SELinuxOptions};

/// The default file context of containers when the node's policy says none
/// (`/etc/selinux/<policy>/contexts/lxc_contexts`, `file = …`).
pub const DEFAULT_FILE_CONTEXT: &str = "system_u:object_r:container_file_t:s0";

/// The SELinux label of files a container with `opts` writes: the node's default container file
/// context with the options' user and level (their role and type are the process's, not the
/// files'). `None` when the options set nothing.
pub fn file_label(default: &str, opts: &SELinuxOptions) -> Option<String> {
    let given = |f: &Option<String>| f.clone().filter(|s| !s.is_empty());
    let (user, role, type_, level) = (
        given(&opts.user),
        given(&opts.role),
        given(&opts.type_),
        given(&opts.level),
    );
    if user.is_none() && role.is_none() && type_.is_none() && level.is_none() {
        return None;
    }
    // user:role:type:level, where the level may itself hold colons (s0:c1,c2).
    let mut parts = default.splitn(4, ':');
    let (d_user, d_role, d_type, d_level) = (
        parts.next().unwrap_or("system_u"),
        parts.next().unwrap_or("object_r"),
        parts.next().unwrap_or("container_file_t"),
        parts.next().unwrap_or("s0"),
    );
    Some(format!(
        "{}:{d_role}:{d_type}:{}",
        user.as_deref().unwrap_or(d_user),
        level.as_deref().unwrap_or(d_level)
    ))
}

/// The effective SELinux options of each container of `pod` that uses the volume `volume` (in
/// `volumeMounts` or `volumeDevices`): the container's own, which replace the pod's whole.
pub fn container_options(pod: &Pod, volume: &str) -> Vec<Option<SELinuxOptions>> {
    let pod_opts = pod
        .spec
        .as_ref()
        .and_then(|s| s.security_context.as_ref())
        .and_then(|c| c.se_linux_options.clone());
    crate::validation::all_containers(pod)
        .into_iter()
        .map(|(_, c)| c)
        .filter(|c| {
            c.volume_mounts.iter().flatten().any(|m| m.name == volume)
                || c.volume_devices.iter().flatten().any(|d| d.name == volume)
        })
        .map(|c| {
            c.security_context
                .as_ref()
                .and_then(|s| s.se_linux_options.clone())
                .or_else(|| pod_opts.clone())
        })
        .collect()
}

/// Whether the pod opted out of mounting with the label: `seLinuxChangePolicy: Recursive` (the
/// runtime relabels the files instead).
pub fn recursive_change(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.security_context.as_ref())
        .and_then(|c| c.se_linux_change_policy.as_deref())
        == Some("Recursive")
}

/// The volume's label for `pod`, or the labels when its containers disagree.
pub fn volume_label(pod: &Pod, volume: &str, default: &str) -> Result<Option<String>, Vec<String>> {
    let labels: BTreeSet<String> = container_options(pod, volume)
        .iter()
        .flatten()
        .filter_map(|o| file_label(default, o))
        .collect();
    match labels.len() {
        0 => Ok(None),
        1 => Ok(labels.into_iter().next()),
        _ => Err(labels.into_iter().collect()),
    }
}

/// The access mode the SELinux metrics are labelled with: the "highest" of the volume's
/// (ReadWriteMany, ReadOnlyMany, ReadWriteOnce, ReadWriteOncePod), `inline` without one.
pub fn metric_access_mode(modes: Option<&[String]>) -> &'static str {
    let Some(modes) = modes else {
        return "inline";
    };
    let has = |m: &str| modes.iter().any(|x| x == m);
    [
        ("ReadWriteMany", "RWX"),
        ("ReadOnlyMany", "ROX"),
        ("ReadWriteOnce", "RWO"),
        ("ReadWriteOncePod", "RWOP"),
    ]
    .into_iter()
    .find_map(|(m, short)| has(m).then_some(short))
    .unwrap_or("")
}

/// Whether a volume of these access modes is mounted with the label: a ReadWriteOncePod volume
/// (that mode alone) always, any volume when SELinuxMount is on. Inline volumes never.
pub fn mode_allows_mount(modes: Option<&[String]>, selinux_mount_all: bool) -> bool {
    match modes {
        None => false,
        Some(_) if selinux_mount_all => true,
        Some(m) => m.len() == 1 && m[0] == "ReadWriteOncePod",
    }
}

/// The mount option for `label`, as the kubelet writes it: `context="<label>"`. `None` for a
/// label with anything but what the four parts of a context may hold (see
/// [`crate::validation::selinux_options_errors`]): a quote, a backslash or a line break would end the option early and let
/// the rest be read as options of its own.
pub fn context_option(label: &str) -> Option<String> {
    let safe = !label.is_empty()
        && label
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-' | b':' | b','));
    safe.then(|| format!("context=\"{label}\""))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": v})).unwrap()
    }

    #[test]
    fn the_file_label_is_the_default_with_the_pods_user_and_level() {
        let opts = |v: serde_json::Value| -> SELinuxOptions { serde_json::from_value(v).unwrap() };
        assert_eq!(
            file_label(DEFAULT_FILE_CONTEXT, &opts(json!({"level": "s0:c1,c2"}))).as_deref(),
            Some("system_u:object_r:container_file_t:s0:c1,c2")
        );
        assert_eq!(
            file_label(
                DEFAULT_FILE_CONTEXT,
                &opts(json!({"user": "u", "role": "r", "type": "spc_t"}))
            )
            .as_deref(),
            Some("u:object_r:container_file_t:s0"),
            "role and type are the process's"
        );
        assert_eq!(
            file_label(
                "system_u:object_r:svirt_sandbox_file_t:s0:c5",
                &opts(json!({"type": "x"}))
            )
            .as_deref(),
            Some("system_u:object_r:svirt_sandbox_file_t:s0:c5")
        );
        assert_eq!(file_label(DEFAULT_FILE_CONTEXT, &opts(json!({}))), None);
        assert_eq!(
            context_option("a:b:c:s0:c1,c2").as_deref(),
            Some("context=\"a:b:c:s0:c1,c2\"")
        );
    }

    #[test]
    fn containers_that_use_the_volume_must_agree() {
        let p = pod(
            json!({"securityContext": {"seLinuxOptions": {"level": "s0:c1"}}, "containers": [
            {"name": "a", "volumeMounts": [{"name": "v", "mountPath": "/v"}]},
            {"name": "b", "volumeMounts": [{"name": "v", "mountPath": "/v"}], "securityContext": {"seLinuxOptions": {"level": "s0:c2"}}},
            {"name": "c", "securityContext": {"seLinuxOptions": {"level": "s0:c3"}}}]}),
        );
        assert_eq!(
            volume_label(&p, "v", DEFAULT_FILE_CONTEXT),
            Err(vec![
                "system_u:object_r:container_file_t:s0:c1".to_string(),
                "system_u:object_r:container_file_t:s0:c2".to_string()
            ])
        );
        let same = pod(
            json!({"securityContext": {"seLinuxOptions": {"level": "s0:c1"}}, "containers": [
            {"name": "a", "volumeMounts": [{"name": "v", "mountPath": "/v"}]},
            {"name": "c", "securityContext": {"seLinuxOptions": {"level": "s0:c3"}}}]}),
        );
        assert_eq!(
            volume_label(&same, "v", DEFAULT_FILE_CONTEXT),
            Ok(Some("system_u:object_r:container_file_t:s0:c1".to_string())),
            "a container that does not use it does not count"
        );
        assert_eq!(
            volume_label(
                &pod(
                    json!({"containers": [{"name": "a", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}]})
                ),
                "v",
                DEFAULT_FILE_CONTEXT
            ),
            Ok(None)
        );
        assert!(recursive_change(&pod(
            json!({"securityContext": {"seLinuxChangePolicy": "Recursive"}, "containers": []})
        )));
    }

    #[test]
    fn only_read_write_once_pod_volumes_unless_selinux_mount_is_on() {
        let modes = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(mode_allows_mount(
            Some(&modes(&["ReadWriteOncePod"])),
            false
        ));
        assert!(!mode_allows_mount(Some(&modes(&["ReadWriteOnce"])), false));
        assert!(!mode_allows_mount(
            Some(&modes(&["ReadWriteOncePod", "ReadWriteOnce"])),
            false
        ));
        assert!(mode_allows_mount(Some(&modes(&["ReadWriteMany"])), true));
        assert!(!mode_allows_mount(None, true), "inline volumes never");
        assert_eq!(
            metric_access_mode(Some(&modes(&["ReadWriteOnce", "ReadOnlyMany"]))),
            "ROX"
        );
        assert_eq!(metric_access_mode(None), "inline");
    }
}
