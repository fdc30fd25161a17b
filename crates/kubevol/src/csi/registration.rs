//! The kubelet's plugin registration, v1: drivers put a socket in `<root>/plugins_registry/`;
//! kubevol asks it `GetInfo`, checks the answer (a `CSIPlugin` with a name and a CSI version
//! kubevol speaks), registers the driver (NodeGetInfo, NodeGetCapabilities) and tells the
//! plugin the outcome with `NotifyRegistrationStatus`. A socket that disappears deregisters its
//! driver; a socket that comes back registers it again.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kubevol_csi::registration::registration_client::RegistrationClient;
use kubevol_csi::registration::{InfoRequest, PluginInfo, RegistrationStatus};
use tracing::{info, warn};

use super::{DriverSource, Drivers};
use crate::dir_watch::Entry;

/// The directory under the root where plugins register.
pub const REGISTRY_DIR: &str = "plugins_registry";

/// Why kubevol refuses a plugin, or `None` if it takes it.
pub fn check_info(info: &PluginInfo) -> Option<String> {
    if info.r#type != "CSIPlugin" {
        return Some(format!(
            "plugin type {:?} is not handled by kubevol: only CSIPlugin is",
            info.r#type
        ));
    }
    if info.name.is_empty() {
        return Some("the plugin reported no name".into());
    }
    if kubevol_core::validation::dns1123_subdomain_error(&info.name).is_some()
        || info.name.len() > 63
    {
        return Some(format!(
            "driver name {:?} is not a DNS subdomain of at most 63 characters",
            info.name
        ));
    }
    let speaks = info.supported_versions.iter().any(|v| {
        let v = v.trim_start_matches('v');
        v.split('.').next() == Some("1")
    });
    if !speaks {
        return Some(format!(
            "none of the plugin's CSI versions {:?} is supported: kubevol speaks {:?}",
            info.supported_versions,
            kubevol_csi::SUPPORTED_VERSIONS
        ));
    }
    None
}

fn is_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

/// Why a plugin behind a registration socket is not registered.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    /// The plugin did not answer GetInfo (it may still be starting: its socket is tried again
    /// when it is made anew).
    #[error("registration socket {}: GetInfo failed: {last}", socket.display())]
    NoInfo {
        /// The registration socket.
        socket: PathBuf,
        /// The last failure.
        last: String,
    },
    /// What the plugin says of itself is refused (its type, name, versions or endpoint).
    #[error("{0}")]
    Refused(String),
    /// The driver could not be registered under its name (another has it, or it does not
    /// answer).
    #[error(transparent)]
    Driver(#[from] super::CsiError),
}

/// Registers the plugin behind one registration socket; the outcome is told to the plugin.
pub async fn register_socket(
    drivers: &Drivers,
    socket: &Path,
) -> Result<String, RegistrationError> {
    let mut client = RegistrationClient::new(kubevol_csi::connect(socket));
    // A socket appears at bind(), a moment before its server accepts: try a few times.
    let mut info = None;
    let mut last = String::new();
    let delays = kubevol_core::backoff::BackoffPolicy {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(800),
    }
    .delays();
    for delay in delays.take(10) {
        match tokio::time::timeout(drivers.timeout(), client.get_info(InfoRequest {})).await {
            Ok(Ok(r)) => {
                info = Some(r.into_inner());
                break;
            }
            Ok(Err(s)) => last = format!("{}: {}", super::code_name(s.code()), s.message()),
            Err(_) => last = "GetInfo timed out".into(),
        }
        tokio::time::sleep(delay).await;
    }
    let Some(info) = info else {
        return Err(RegistrationError::NoInfo {
            socket: socket.to_path_buf(),
            last,
        });
    };
    let outcome = match check_info(&info) {
        Some(refusal) => Err(RegistrationError::Refused(refusal)),
        None => {
            let endpoint = if info.endpoint.is_empty() {
                Ok(socket.to_path_buf())
            } else {
                kubevol_csi::socket_path(&info.endpoint)
            };
            let version =
                super::highest_supported_version(&info.supported_versions).unwrap_or_default();
            match endpoint {
                Ok(endpoint) => drivers
                    .register(
                        &info.name,
                        endpoint,
                        DriverSource::Registration {
                            socket: socket.to_path_buf(),
                            version,
                        },
                    )
                    .await
                    .map(|_| info.name.clone())
                    .map_err(RegistrationError::from),
                Err(e) => Err(RegistrationError::Refused(e)),
            }
        }
    };
    let status = RegistrationStatus {
        plugin_registered: outcome.is_ok(),
        error: outcome
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default(),
    };
    if let Err(e) = client.notify_registration_status(status).await {
        warn!(socket = %socket.display(), "NotifyRegistrationStatus failed: {}", e.message());
    }
    match &outcome {
        Ok(name) => {
            info!(driver = %name, socket = %socket.display(), "plugin registration accepted")
        }
        Err(e) => {
            warn!(plugin = %info.name, socket = %socket.display(), "plugin registration refused: {e}")
        }
    }
    outcome
}

/// Registers every plugin whose socket is in `dir` now, concurrently; returns when each has
/// been accepted or refused.
pub async fn register_present(dir: &Path, drivers: &Arc<Drivers>) -> BTreeSet<PathBuf> {
    let mut tasks = tokio::task::JoinSet::new();
    let present = sockets_in(dir);
    for socket in &present {
        let (d, socket) = (drivers.clone(), socket.clone());
        tasks.spawn(async move {
            let _ = register_socket(&d, &socket).await;
        });
    }
    while tasks.join_next().await.is_some() {}
    present
}

/// The sockets in `dir` now.
fn sockets_in(dir: &Path) -> BTreeSet<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| is_socket(p))
        .collect()
}

/// Watches `dir` until the task is dropped: registers every socket that appears (those present
/// at start are [`register_present`]'s: `handled`), and deregisters drivers whose socket goes
/// away. A socket that appeared after the start's listing and before the watch began is
/// registered too: the directory is listed again once the watch is in place.
pub async fn watch(dir: PathBuf, drivers: Arc<Drivers>, handled: BTreeSet<PathBuf>) {
    if let Err(e) = std::fs::create_dir_all(&dir) {
        warn!(dir = %dir.display(), "cannot create the plugin registry directory: {e}");
        return;
    }
    let mut watch = match crate::dir_watch::DirWatch::new(&dir) {
        Ok(w) => w,
        Err(e) => {
            warn!(dir = %dir.display(), "cannot watch the plugin registry directory: {e}");
            return;
        }
    };
    info!(dir = %dir.display(), "watching for CSI plugin registrations");
    let spawn = |path: PathBuf| {
        let d = drivers.clone();
        tokio::spawn(async move {
            let _ = register_socket(&d, &path).await;
        });
    };
    // Registered by this second listing: the same socket file may also be reported by the
    // watch (it appeared after the watch began), and is not registered twice.
    let mut listed: HashMap<PathBuf, (u64, u64)> = HashMap::new();
    for socket in sockets_in(&dir).difference(&handled) {
        listed.extend(identity(socket).map(|id| (socket.clone(), id)));
        spawn(socket.clone());
    }
    loop {
        let changes = match watch.next().await {
            Ok(changes) => changes,
            Err(e) => {
                warn!(dir = %dir.display(), "the watch of the plugin registry directory failed: {e}");
                return;
            }
        };
        for change in changes {
            match change {
                Entry::Added(name) => {
                    let path = dir.join(name);
                    if !is_socket(&path) {
                        continue;
                    }
                    let again = listed
                        .remove(&path)
                        .is_some_and(|id| identity(&path) == Some(id));
                    if !again {
                        spawn(path);
                    }
                }
                Entry::Removed(name) => {
                    let path = dir.join(name);
                    if !path.exists() {
                        listed.remove(&path);
                        drivers.deregister_socket(&path);
                    }
                }
                Entry::Overflow => {
                    // Changes were lost: what is there now is registered, what is gone
                    // deregistered.
                    warn!(dir = %dir.display(), "the watch of the plugin registry directory overflowed: listing it again");
                    let present = sockets_in(&dir);
                    let registered = drivers.registration_sockets();
                    for gone in registered.difference(&present) {
                        drivers.deregister_socket(gone);
                    }
                    for new in present.difference(&registered) {
                        spawn(new.clone());
                    }
                }
            }
        }
    }
}

/// Which file a path is now (device and inode): a socket made anew is another file.
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(t: &str, name: &str, versions: &[&str]) -> PluginInfo {
        PluginInfo {
            r#type: t.into(),
            name: name.into(),
            endpoint: String::new(),
            supported_versions: versions.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn checks_type_name_and_version() {
        assert_eq!(
            check_info(&info("CSIPlugin", "loop.csi.kubevol.io", &["1.0.0"])),
            None
        );
        assert_eq!(
            check_info(&info("CSIPlugin", "x.io", &["0.3.0", "v1.2.0"])),
            None
        );
        let refused = [
            info("DevicePlugin", "x.io", &["1.0.0"]),
            info("CSIPlugin", "", &["1.0.0"]),
            info("CSIPlugin", "Not_A_Name", &["1.0.0"]),
            info("CSIPlugin", "x.io", &["0.3.0"]),
            info("CSIPlugin", "x.io", &[]),
        ];
        for i in refused {
            assert!(check_info(&i).is_some(), "{i:?}");
        }
    }
}
