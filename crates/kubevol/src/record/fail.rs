//! Fail points: named steps of operations where a crash test makes the process die (or an
//! operation panic), armed through an environment variable.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// The environment variable that arms fail points: a comma-separated list of
/// `<operation>:<step>[:<n>][:panic]`. Each kills the process with SIGKILL (or, with `:panic`,
/// panics the operation's task) the n-th time (default: the first) the step is reached.
/// Operations: `attach`, `mount_device`, `set_up`, `tear_down`, `unmount_device`, `detach`;
/// steps: `before` (the intent is on disk, the side effect not started) and `after` (the side
/// effect is done, the record not yet updated); `bind` (a claim bound to a volume, or a
/// volume provisioned for it): `before` (chosen, not yet on disk) and `after` (on disk, not
/// yet used); `reclaim` (a provisioned volume of a removed claim deleted): `before` (its
/// directory not yet removed) and `after` (removed, the record not yet updated). For crash
/// tests.
pub const FAIL_POINT_ENV: &str = "KUBEVOL_FAIL_POINT";

/// Every fail point.
pub const FAIL_POINTS: [&str; 16] = [
    "attach:before",
    "attach:after",
    "mount_device:before",
    "mount_device:after",
    "set_up:before",
    "set_up:after",
    "tear_down:before",
    "tear_down:after",
    "unmount_device:before",
    "unmount_device:after",
    "detach:before",
    "detach:after",
    "bind:before",
    "bind:after",
    "reclaim:before",
    "reclaim:after",
];

/// What an armed fail point does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Kill,
    Panic,
}

#[derive(Debug)]
struct Armed {
    name: String,
    at: u32,
    action: Action,
    hits: AtomicU32,
}

/// Parses one `<operation>:<step>[:<n>][:panic]`.
fn parse_fail_point(spec: &str) -> Result<Armed, String> {
    let mut parts = spec.split(':');
    let name = match (parts.next(), parts.next()) {
        (Some(op), Some(step)) => format!("{op}:{step}"),
        _ => return Err(format!("{spec:?}: write <operation>:<step>[:<n>][:panic]")),
    };
    if !FAIL_POINTS.contains(&name.as_str()) {
        return Err(format!(
            "{spec:?}: no such fail point (known: {FAIL_POINTS:?})"
        ));
    }
    let (mut at, mut action) = (1, Action::Kill);
    for part in parts {
        match (part.parse::<u32>(), part) {
            (Ok(n), _) => at = n.max(1),
            (_, "panic") => action = Action::Panic,
            (_, "kill") => action = Action::Kill,
            _ => {
                return Err(format!(
                    "{spec:?}: {part:?} is neither a count nor panic or kill"
                ))
            }
        }
    }
    Ok(Armed {
        name,
        at,
        action,
        hits: AtomicU32::new(0),
    })
}

fn armed() -> &'static [Armed] {
    static ARMED: OnceLock<Vec<Armed>> = OnceLock::new();
    ARMED.get_or_init(|| {
        let Ok(v) = std::env::var(FAIL_POINT_ENV) else {
            return Vec::new();
        };
        v.split(',')
            .filter(|s| !s.trim().is_empty())
            .filter_map(|spec| {
                parse_fail_point(spec.trim())
                    .map_err(|e| tracing::error!("{FAIL_POINT_ENV}: {e}"))
                    .ok()
            })
            .collect()
    })
}

/// A named step of an operation: when armed through [`FAIL_POINT_ENV`], the process dies here
/// with SIGKILL, as it would if killed from outside at this instant (or the operation panics).
pub fn fail_point(operation: &str, step: &str) {
    for a in armed() {
        if a.name.split_once(':') != Some((operation, step)) {
            continue;
        }
        if a.hits.fetch_add(1, Ordering::SeqCst) + 1 != a.at {
            continue;
        }
        match a.action {
            Action::Panic => panic!("fail point {operation}:{step} reached"),
            Action::Kill => {
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "kubevol: fail point {operation}:{step} reached, killing the process"
                );
                let _ = rustix::process::kill_process(
                    rustix::process::getpid(),
                    rustix::process::Signal::KILL,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_points_parse_with_count_and_action() {
        let a = parse_fail_point("set_up:after").unwrap();
        assert_eq!(
            (a.name.as_str(), a.at, a.action),
            ("set_up:after", 1, Action::Kill)
        );
        let a = parse_fail_point("tear_down:before:3:panic").unwrap();
        assert_eq!(
            (a.name.as_str(), a.at, a.action),
            ("tear_down:before", 3, Action::Panic)
        );
        for bad in ["set_up", "nope:after", "set_up:after:x"] {
            assert!(parse_fail_point(bad).is_err(), "{bad}");
        }
    }
}
