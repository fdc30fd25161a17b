//! The CSI services of kubevol-csi-loop: Identity, Controller and Node.
//!
//! A volume is a sparse file `<data-dir>/volumes/<id>.img`, a snapshot a copy of one in
//! `<data-dir>/snapshots/<id>.img`. ControllerPublishVolume attaches it
//! to a loop device; NodeStageVolume formats the device (unless it holds a filesystem already)
//! and mounts it at the staging path; NodePublishVolume bind-mounts the staging path (or, for
//! block access, the device node) at the target. Every call is idempotent: repeating it after
//! success, or after an interruption at any point, converges on the same state.

mod controller;
mod node;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kubevol_csi::registration::registration_server::Registration;
use kubevol_csi::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use kubevol_csi::v1::controller_server::Controller;
use kubevol_csi::v1::identity_server::Identity;
use kubevol_csi::v1::node_server::Node;
use kubevol_csi::v1::*;
use sha2::{Digest, Sha256};

/// The topology segment the driver reports: its volumes are reachable on its node only.
pub const TOPOLOGY_KEY: &str = "topology.loop.csi.kubevol.io/node";
use tonic::{Request, Response, Status};

use crate::faults::Faults;
use crate::sys;

/// The size of a volume nobody gave a size: 100Mi.
pub const DEFAULT_SIZE: i64 = 100 << 20;

/// The volume context key that carries a volume's size (inline ephemeral volumes, and static
/// PersistentVolumes whose backing file is made on first use).
pub const SIZE_KEY: &str = "size";

/// The volume context key the kubelet sets on inline ephemeral volumes.
pub const EPHEMERAL_KEY: &str = "csi.storage.k8s.io/ephemeral";

/// The driver.
pub struct Driver {
    /// The driver's name.
    pub name: String,
    /// This node's ID.
    pub node_id: String,
    /// Where volumes live.
    pub data_dir: PathBuf,
    /// The driver's socket, reported through registration.
    pub endpoint: PathBuf,
    /// The CSI versions offered at registration.
    pub registration_versions: Vec<String>,
    /// Injected faults.
    pub faults: Faults,
    /// One JSON line per call, for tests and audits.
    pub call_log: Option<Mutex<std::fs::File>>,
    /// Where NodeGetInfo reads `max_volumes_per_node` (none: no limit).
    pub max_volumes_file: Option<PathBuf>,
    /// Whether the controller publishes (attaches) volumes; without, it lacks
    /// PUBLISH_UNPUBLISH_VOLUME and the node attaches at stage and detaches at unstage.
    pub controller_publish: bool,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// The driver as its gRPC services see it.
#[derive(Clone)]
pub struct Svc(pub Arc<Driver>);

impl std::ops::Deref for Svc {
    type Target = Driver;
    fn deref(&self) -> &Driver {
        &self.0
    }
}

/// What the driver remembers about a volume beside its image.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Meta {
    /// Made by NodePublishVolume for an inline ephemeral volume, removed by its unpublish.
    ephemeral: bool,
}

fn invalid(what: &str) -> Status {
    Status::invalid_argument(format!("{what} is required"))
}

/// A volume ID is used as a file name: refuse anything that could name another file.
fn check_id(id: &str) -> Result<(), Status> {
    if id.is_empty() {
        return Err(invalid("volume_id"));
    }
    // Cloud-style handles, as migrated in-tree volumes have them, are IDs too: a `/`
    // separates their parts (`projects/UNSPECIFIED/zones/UNSPECIFIED/disks/d`, an Azure disk's
    // URI; the file name has `~` for it, so no part is a path component), and a vSphere
    // volume path has brackets and a space (`[datastore] dir/disk.vmdk`).
    let ok = id.len() <= 128
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-/[] ".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Status::not_found(format!(
            "volume {id:?} does not exist: loop volume IDs are at most 128 characters of [A-Za-z0-9._-/[] ]"
        )))
    }
}

/// Parses a size: bytes, or a quantity with a binary (Ki, Mi, Gi, Ti) or decimal (k, M, G, T)
/// suffix.
pub fn parse_size(s: &str) -> Result<i64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: i64 = num
        .parse()
        .map_err(|_| format!("size {s:?} is not a number of bytes or a quantity like 100Mi"))?;
    let mul: i64 = match unit {
        "" => 1,
        "k" => 1000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => return Err(format!("size {s:?}: unknown unit {unit:?}")),
    };
    n.checked_mul(mul)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

fn internal(e: String) -> Status {
    Status::internal(e)
}

fn is_block(cap: &VolumeCapability) -> bool {
    matches!(
        cap.access_type,
        Some(volume_capability::AccessType::Block(_))
    )
}

fn mount_of(cap: &VolumeCapability) -> (String, Vec<String>) {
    match &cap.access_type {
        Some(volume_capability::AccessType::Mount(m)) => (
            if m.fs_type.is_empty() {
                "ext4".into()
            } else {
                m.fs_type.clone()
            },
            m.mount_flags.clone(),
        ),
        _ => ("ext4".into(), Vec::new()),
    }
}

impl Driver {
    /// A driver.
    pub fn new(
        name: String,
        node_id: String,
        data_dir: PathBuf,
        endpoint: PathBuf,
        faults: Faults,
        call_log: Option<std::fs::File>,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(data_dir.join("volumes"))?;
        Ok(Driver {
            name,
            node_id,
            data_dir,
            endpoint,
            registration_versions: kubevol_csi::SUPPORTED_VERSIONS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            faults,
            call_log: call_log.map(Mutex::new),
            max_volumes_file: None,
            controller_publish: true,
            locks: Mutex::new(HashMap::new()),
        })
    }

    /// Logs one answered call; `work` is the time the driver itself spent on it (the volume's
    /// lock and the work, not the injected delay).
    fn log(&self, method: &str, volume: &str, path: &str, code: tonic::Code, work: Duration) {
        tracing::info!(method, volume, path, code = ?code, "call");
        if let Some(f) = &self.call_log {
            let line = serde_json::json!({
                "method": method,
                "volume_id": volume,
                "path": path,
                "code": format!("{code:?}"),
                "work_ms": work.as_secs_f64() * 1e3,
            });
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(f, "{line}");
        }
    }

    /// Logs what a controller publish, stage or publish request carried, for tests and audits:
    /// the volume and publish contexts, the mount flags, the access mode and the read-only flag,
    /// the names of the secrets (never their values) and the claims of service account tokens
    /// passed as secrets.
    #[allow(clippy::too_many_arguments)]
    fn log_request(
        &self,
        method: &str,
        volume: &str,
        context: &HashMap<String, String>,
        publish_context: &HashMap<String, String>,
        secrets: &HashMap<String, String>,
        cap: Option<&VolumeCapability>,
        readonly: bool,
    ) {
        let Some(f) = &self.call_log else {
            return;
        };
        let mut secret_keys: Vec<&String> = secrets.keys().collect();
        secret_keys.sort();
        // Service account tokens in the secrets: by audience, the expiry and the token's claims
        // (its middle part, base64url), never the token itself, which is a credential.
        let secret_tokens = secrets
            .get("csi.storage.k8s.io/serviceAccount.tokens")
            .and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok())
            .and_then(|v| v.as_object().cloned())
            .map(|tokens| {
                tokens
                    .into_iter()
                    .map(|(audience, t)| {
                        let claims = t["token"]
                            .as_str()
                            .and_then(|t| t.split('.').nth(1))
                            .map(String::from);
                        let shown = serde_json::json!({
                            "claims": claims,
                            "expirationTimestamp": t["expirationTimestamp"],
                        });
                        (audience, shown)
                    })
                    .collect::<serde_json::Map<_, _>>()
            });
        let flags = cap.map(|c| mount_of(c).1).unwrap_or_default();
        let access_mode = cap.and_then(|c| c.access_mode.as_ref()).map(|a| a.mode);
        let line = serde_json::json!({
            "access_mode": access_mode,
            "request": method,
            "volume_id": volume,
            "context": context,
            "publish_context": publish_context,
            "secret_keys": secret_keys,
            "secret_tokens": secret_tokens,
            "mount_flags": flags,
            "readonly": readonly,
        });
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(f, "{line}");
    }

    /// Runs one call: injected faults first, then the work under the volume's lock, off the
    /// async threads; then the injected delay.
    async fn call<T, F>(
        &self,
        method: &str,
        volume: &str,
        path: &str,
        work: F,
    ) -> Result<Response<T>, Status>
    where
        T: Default + Send + 'static,
        F: FnOnce() -> Result<T, Status> + Send + 'static,
    {
        let started = std::time::Instant::now();
        if let Some(code) = self.faults.take(method) {
            self.log(method, volume, path, code, started.elapsed());
            // OK: claim success without doing the work, as a buggy driver would.
            if code == tonic::Code::Ok {
                return Ok(Response::new(T::default()));
            }
            return Err(Status::new(code, format!("{method}: injected fault")));
        }
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            locks.entry(volume.to_string()).or_default().clone()
        };
        let result = {
            let _held = lock.lock().await;
            tokio::task::spawn_blocking(work)
                .await
                .unwrap_or_else(|e| Err(Status::internal(format!("{method} task failed: {e}"))))
        };
        let work = started.elapsed();
        if let Some(d) = self.faults.delay(method) {
            tokio::time::sleep(d).await;
        }
        self.log(
            method,
            volume,
            path,
            result
                .as_ref()
                .map_or_else(|s| s.code(), |_| tonic::Code::Ok),
            work,
        );
        result.map(Response::new)
    }

    fn image(&self, id: &str) -> PathBuf {
        sys::image(&self.data_dir, id)
    }

    /// The image file of snapshot `id`: `<data-dir>/snapshots/<id>.img`.
    fn snapshot(&self, id: &str) -> PathBuf {
        self.data_dir.join("snapshots").join(format!("{id}.img"))
    }
}

fn meta_path(image: &Path) -> PathBuf {
    image.with_extension("json")
}

fn read_meta(image: &Path) -> Meta {
    std::fs::read(meta_path(image))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn write_meta(image: &Path, meta: &Meta) -> Result<(), Status> {
    let tmp = image.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(meta).unwrap_or_default())
        .and_then(|_| std::fs::rename(&tmp, meta_path(image)))
        .map_err(|e| Status::internal(format!("cannot record volume metadata: {e}")))
}

/// Makes the sparse file for a volume of `size` bytes unless it exists.
fn create_image(image: &Path, size: i64) -> Result<i64, Status> {
    match std::fs::metadata(image) {
        Ok(m) => Ok(m.len() as i64),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            place_image(image, size, |tmp| std::fs::File::create(tmp).map(drop))?;
            Ok(size)
        }
        Err(e) => Err(internal(format!("{}: {e}", image.display()))),
    }
}

/// Makes `image` whole or not at all: `fill` makes a file at a temporary name beside it, which
/// is sized to `size` bytes, synced and renamed into place.
fn place_image(
    image: &Path,
    size: i64,
    fill: impl FnOnce(&Path) -> std::io::Result<()>,
) -> Result<(), Status> {
    let tmp = image.with_extension("img.tmp");
    fill(&tmp).map_err(|e| internal(format!("make {}: {e}", tmp.display())))?;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&tmp)
        .map_err(|e| internal(format!("open {}: {e}", tmp.display())))?;
    f.set_len(size as u64)
        .map_err(|e| internal(format!("size {}: {e}", tmp.display())))?;
    f.sync_all()
        .map_err(|e| internal(format!("sync {}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, image).map_err(|e| internal(format!("rename {}: {e}", image.display())))
}

/// The image of an existing volume, or of one made now from the context's `size`.
fn existing_or_sized(
    image: &Path,
    id: &str,
    context: &HashMap<String, String>,
) -> Result<(), Status> {
    if image.exists() {
        return Ok(());
    }
    match context.get(SIZE_KEY) {
        Some(s) => create_image(image, parse_size(s).map_err(Status::invalid_argument)?).map(drop),
        None => Err(Status::not_found(format!(
            "volume {id} does not exist (no {} and no {SIZE_KEY:?} in its volume attributes)",
            image.display()
        ))),
    }
}

/// The device a staged or published volume uses: the attach's, or attached now.
fn device(image: &Path, publish_context: &HashMap<String, String>) -> Result<String, Status> {
    let attached = sys::loops_of(image).map_err(internal)?;
    if let Some(dev) = publish_context.get("devicePath") {
        if attached.contains(dev) {
            return Ok(dev.clone());
        }
    }
    sys::attach(image).map_err(internal)
}

#[tonic::async_trait]
impl Identity for Svc {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        let name = self.name.clone();
        self.call("GetPluginInfo", "", "", move || {
            Ok(GetPluginInfoResponse {
                name,
                vendor_version: env!("CARGO_PKG_VERSION").to_string(),
                manifest: HashMap::new(),
            })
        })
        .await
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        use plugin_capability::{service, volume_expansion, Service, Type, VolumeExpansion};
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: vec![
                PluginCapability {
                    r#type: Some(Type::Service(Service {
                        r#type: service::Type::ControllerService as i32,
                    })),
                },
                PluginCapability {
                    r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                        r#type: volume_expansion::Type::Online as i32,
                    })),
                },
            ],
        }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        self.call("Probe", "", "", || Ok(ProbeResponse { ready: Some(true) }))
            .await
    }
}

#[tonic::async_trait]
impl Registration for Svc {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: "CSIPlugin".into(),
            name: self.name.clone(),
            endpoint: self.endpoint.to_string_lossy().into_owned(),
            supported_versions: self.registration_versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let r = req.into_inner();
        if r.plugin_registered {
            tracing::info!(driver = %self.name, "registered with the node agent");
            self.log(
                "NotifyRegistrationStatus",
                "",
                "",
                tonic::Code::Ok,
                Duration::ZERO,
            );
        } else {
            tracing::error!(driver = %self.name, error = %r.error, "the node agent refused the registration");
            self.log(
                "NotifyRegistrationStatus",
                "",
                &r.error,
                tonic::Code::FailedPrecondition,
                Duration::ZERO,
            );
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// Detaches the loop devices of every volume under `data_dir` (`--detach-all`).
pub fn detach_all(data_dir: &Path) -> Result<(), String> {
    // By where their backing files lie, not by the images' names: a backing file renamed or
    // removed while attached is still under the data directory.
    let data_dir = data_dir
        .canonicalize()
        .unwrap_or_else(|_| data_dir.to_path_buf());
    for dev in sys::loops_under(&data_dir) {
        sys::run("losetup", &["--detach", &dev])?;
    }
    Ok(())
}

/// Grows a volume's image to `want` bytes (never shrinks) and tells its loop devices.
fn grow_image(image: &Path, id: &str, want: i64) -> Result<i64, Status> {
    let m = std::fs::metadata(image)
        .map_err(|_| Status::not_found(format!("volume {id} does not exist")))?;
    let have = m.len() as i64;
    if want <= have {
        return Ok(have);
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(image)
        .map_err(|e| internal(format!("open {}: {e}", image.display())))?;
    f.set_len(want as u64)
        .map_err(|e| internal(format!("grow {}: {e}", image.display())))?;
    f.sync_all()
        .map_err(|e| internal(format!("sync {}: {e}", image.display())))?;
    for dev in sys::loops_of(image).map_err(internal)? {
        sys::run("losetup", &["--set-capacity", &dev]).map_err(internal)?;
    }
    Ok(want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("100Mi").unwrap(), 100 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("1.5Gi").is_err());
        assert!(parse_size("10Xi").is_err());
        assert!(parse_size("99999999999999Ti").is_err());
    }

    #[test]
    fn ids_cannot_name_other_files() {
        assert!(check_id("pv-data.1").is_ok());
        assert!(check_id("projects/UNSPECIFIED/zones/z/disks/d").is_ok());
        let dir = Path::new("/data");
        assert_eq!(
            sys::image(dir, "projects/p/disks/d"),
            dir.join("volumes/projects~p~disks~d.img")
        );
        for bad in ["", "..", "../x", "a~b", ".hidden", &"x".repeat(129)] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }
}
