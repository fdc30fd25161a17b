//! hostPath: a path on the host handed to the pod, inline or through a claim bound to a hostPath
//! PersistentVolume. Set-up checks (and for the `...OrCreate` types creates) the object at the
//! path. Without an allow-list (`--host-path-allow`) the path handed out is the host path itself,
//! as in the kubelet: any path is allowed, so there is nothing to pin. With one, the path is
//! pinned: opened once, confined beneath the allowed directory's descriptor, checked through
//! that descriptor, and bind-mounted (recursively, so that mounts below it come along and
//! propagate as the host's do) from it at `pods/<uid>/volumes/kubernetes.io~host-path/<volume>`,
//! which is the path handed out: a tenant who swaps a directory of the path for a link after
//! the check changes nothing a runtime is given. Teardown unmounts that bind and removes its
//! empty mount point (rmdir or unlink, which never remove a mount point), and never touches host
//! data.

use std::fs::{self, DirBuilder, OpenOptions, Permissions};
use std::io::ErrorKind;
// create_new (O_CREAT|O_EXCL) never follows a link at the last component.
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::HostPathVolumeSource;
use kubevol_core::names::PathName;
use kubevol_core::state::VolumeSpec;
use kubevol_mount::pin::Missing;
use kubevol_mount::safe::Dir;
use kubevol_mount::MountError;
use rustix::fs::FileType;

use super::{
    blocking, BoxFuture, PluginHost, SetUpRequest, SetUpResult, TearDownRequest, VolumePlugin,
};
use crate::error::VolumeError;

/// The kubelet's name of the plugin.
pub const PLUGIN_NAME: &str = "kubernetes.io/host-path";

/// The hostPath plugin.
pub struct HostPathPlugin;

fn type_error(path: &Path, detail: impl Into<String>) -> VolumeError {
    VolumeError::HostPathType {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// What `kind` is, in words.
fn describe(kind: FileType) -> &'static str {
    match kind {
        FileType::Directory => "a directory",
        FileType::RegularFile => "a regular file",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Fifo => "a FIFO",
        _ => "something else",
    }
}

/// What to do about a host path of `type_` that does not exist: only directories and regular
/// files can be made by a volume's type.
fn missing_hint(type_: &str) -> &'static str {
    match type_ {
        "Directory" => "create it, or use type DirectoryOrCreate",
        "File" => "create it, or use type FileOrCreate",
        "Socket" => {
            "start the program that listens on it (a socket is made by its server; the volume is set up once it exists), or fix the path"
        }
        _ => "create the device node (mknod), or fix the path",
    }
}

/// The kind of object a hostPath `type_` asks for (`None`: anything, the empty type).
fn wanted(path: &Path, type_: &str) -> Result<Option<FileType>, VolumeError> {
    Ok(Some(match type_ {
        "" => return Ok(None),
        "DirectoryOrCreate" | "Directory" => FileType::Directory,
        "FileOrCreate" | "File" => FileType::RegularFile,
        "Socket" => FileType::Socket,
        "CharDevice" => FileType::CharacterDevice,
        "BlockDevice" => FileType::BlockDevice,
        other => return Err(type_error(path, format!("has unknown type {other:?}"))),
    }))
}

/// Whether `kind`, found at `path`, is what `type_` asks for.
fn check_kind(path: &Path, type_: &str, kind: FileType) -> Result<(), VolumeError> {
    match wanted(path, type_)? {
        Some(want) if want != kind => Err(type_error(
            path,
            format!(
                "is {}, not {} (type {type_}); fix the path or the type",
                describe(kind),
                describe(want)
            ),
        )),
        _ => Ok(()),
    }
}

/// The error for a path of `type_` that does not exist (and was not made).
fn missing(path: &Path, type_: &str) -> VolumeError {
    match type_ {
        "FileOrCreate" => type_error(
            path,
            format!(
                "does not exist and its parent directory {} does not exist either; FileOrCreate does not create parents: create it or use DirectoryOrCreate for the parent",
                path.parent().unwrap_or(Path::new("/")).display()
            ),
        ),
        _ => {
            let want = wanted(path, type_).ok().flatten().map_or("something", describe);
            type_error(
                path,
                format!(
                    "does not exist (type {type_} requires {want}); {}",
                    missing_hint(type_)
                ),
            )
        }
    }
}

/// Checks (and for the `...OrCreate` types creates) the object at `path` as the kubelet does,
/// by path: for a hostPath without an allow-list.
pub fn check_host_path_type(path: &Path, type_: &str) -> Result<(), VolumeError> {
    let kind = |m: fs::Metadata| FileType::from_raw_mode(m.mode());
    let existing = match fs::metadata(path) {
        Ok(m) => Some(kind(m)),
        Err(e) if e.kind() == ErrorKind::NotFound => None,
        Err(e) => return Err(type_error(path, format!("cannot be examined: {e}"))),
    };
    if wanted(path, type_)?.is_none() {
        return Ok(());
    }
    match existing {
        Some(k) => check_kind(path, type_, k),
        None if type_ == "DirectoryOrCreate" => {
            DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(path)
                .map_err(|e| {
                    type_error(
                        path,
                        format!("does not exist and could not be created: {e}"),
                    )
                })?;
            fs::set_permissions(path, Permissions::from_mode(0o755)).map_err(|e| {
                type_error(
                    path,
                    format!("was created but its mode could not be set: {e}"),
                )
            })?;
            check_host_path_type(path, "Directory")
        }
        None if type_ == "FileOrCreate" => {
            let created = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .open(path);
            match created {
                Ok(f) => f
                    .set_permissions(Permissions::from_mode(0o644))
                    .map_err(|e| {
                        type_error(
                            path,
                            format!("was created but its mode could not be set: {e}"),
                        )
                    })?,
                Err(e) if e.kind() == ErrorKind::NotFound => return Err(missing(path, type_)),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(type_error(
                        path,
                        format!("does not exist and could not be created: {e}"),
                    ))
                }
            }
            check_host_path_type(path, "File")
        }
        None => Err(missing(path, type_)),
    }
}

/// Where `path` leads once symbolic links are resolved, component by component: the part that
/// exists is resolved by the kernel (links and `..` alike), and past it, where nothing can be a
/// link, `.` is dropped and `..` takes the last component off. So neither a link nor a `..`
/// after a name that does not exist yet (`/data/x/../../etc`) can lead out of a prefix.
fn resolve(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    let mut exists = true;
    for c in path.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => out.push(c),
            Component::CurDir => {}
            // `out` has no link in it: its parent is its last component taken off.
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(name) => {
                out.push(name);
                if exists {
                    match fs::canonicalize(&out) {
                        Ok(r) => out = r,
                        Err(_) => exists = false,
                    }
                }
            }
        }
    }
    out
}

/// Checks the operator's allow-list, comparing whole path components of the resolved path, so
/// that `/data` allows `/data/x` but not `/database` and a symbolic link cannot lead out.
pub fn check_allowed(path: &Path, allow: &[PathBuf]) -> Result<(), VolumeError> {
    allowed_base(path, allow).map(drop)
}

/// The allowed directory `path` is in (resolved) and the rest of the resolved path below it,
/// or the refusal; `None` when there is no list (everything is allowed).
fn allowed_base(path: &Path, allow: &[PathBuf]) -> Result<Option<(PathBuf, PathBuf)>, VolumeError> {
    if allow.is_empty() {
        return Ok(None);
    }
    let resolved = resolve(path);
    for a in allow {
        let base = resolve(a);
        if let Ok(rel) = resolved.strip_prefix(&base) {
            return Ok(Some((base, rel.to_path_buf())));
        }
    }
    Err(VolumeError::HostPathNotAllowed {
        path: path.to_path_buf(),
        resolved,
        allowed: allow
            .iter()
            .map(|a| a.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// Pins the allowed host `path` (`base`/`rel` resolved) for the pod: opened confined beneath
/// `base`, made as its `type_` says (an empty type makes the directory, as a runtime given a
/// missing path does), checked through its descriptor, and bind-mounted recursively from it at
/// the volume's directory of the pod; returns that directory.
fn pin(
    host: &PluginHost,
    req: &SetUpRequest,
    path: &Path,
    type_: &str,
    (base, rel): (PathBuf, PathBuf),
) -> Result<PathBuf, VolumeError> {
    wanted(path, type_)?;
    let make = match type_ {
        "" | "DirectoryOrCreate" => Missing::Directories,
        "FileOrCreate" => Missing::File,
        _ => Missing::Refuse,
    };
    let base_dir = Dir::open(&base)?;
    let (fd, kind) = match kubevol_mount::pin::open_pinned(&base_dir, &rel, make) {
        Err(e) if e.is_not_found() => return Err(missing(path, type_)),
        // Swapped for a link leading out between the resolution and the opening: looked at
        // again after a backoff.
        Err(MountError::Unsafe { reason, .. }) => return Err(type_error(path, reason)),
        r => r?,
    };
    check_kind(path, type_, kind)?;
    let name = PathName::new("the volume's name", &req.outer_volume_name)?;
    let (parent, _) = host.root_dir.create_dir_all(
        &PluginHost::pod_plugin_dir(&req.pod_ref, PLUGIN_NAME),
        0o750,
    )?;
    Ok(kubevol_mount::pin::bind_at(
        &*host.mounter,
        fd.as_fd(),
        kind == FileType::Directory,
        path,
        &parent,
        name.as_str(),
        true,
    )?)
}

/// Undoes [`pin`]: detaches the bind at `path` with the mounts it took along (a recursive
/// bind of the host's own tree, holding no data of its own: detached at once, as a runtime
/// detaches its `rbind`s) and removes its mount point with rmdir or unlink, which never remove
/// a mount point nor a directory with anything in it.
fn unpin(host: &PluginHost, req: &TearDownRequest) -> Result<(), VolumeError> {
    let name = PathName::new("the volume's name", &req.outer_volume_name)?;
    let rel = PluginHost::pod_plugin_dir(&req.pod_ref, PLUGIN_NAME).join(name.as_str());
    let is_dir = match fs::symlink_metadata(&req.path) {
        Ok(m) => m.is_dir(),
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(type_error(&req.path, format!("cannot be examined: {e}"))),
    };
    for _ in 0..16 {
        if host.mounter.unmount_detached(&req.path)? == kubevol_mount::Unmounted::NotMounted {
            break;
        }
    }
    host.root_dir.remove_beneath(&rel, is_dir)?;
    Ok(())
}

/// The hostPath a volume names: its own, or its PersistentVolume's.
fn source(spec: &VolumeSpec) -> Option<&HostPathVolumeSource> {
    spec.volume.host_path.as_ref().or_else(|| {
        spec.persistent_volume
            .as_ref()?
            .spec
            .as_ref()?
            .host_path
            .as_ref()
    })
}

impl VolumePlugin for HostPathPlugin {
    fn name(&self) -> &'static str {
        PLUGIN_NAME
    }

    fn source_field(&self) -> &'static str {
        "hostPath"
    }

    fn serves_persistent(&self) -> bool {
        true
    }

    fn can_support(&self, spec: &VolumeSpec) -> bool {
        source(spec).is_some()
    }

    fn set_up(
        &self,
        host: Arc<PluginHost>,
        req: SetUpRequest,
    ) -> BoxFuture<Result<SetUpResult, VolumeError>> {
        blocking(move || {
            let hp = source(&req.spec).cloned().unwrap_or_default();
            let path = PathBuf::from(&hp.path);
            let type_ = hp.type_.as_deref().unwrap_or("");
            let path = match allowed_base(&path, &host.host_path_allow)? {
                Some(allowed) => pin(&host, &req, &path, type_, allowed)?,
                None => {
                    check_host_path_type(&path, type_)?;
                    path
                }
            };
            Ok(SetUpResult {
                path,
                read_only: false,
            })
        })
    }

    fn tear_down(
        &self,
        host: Arc<PluginHost>,
        req: TearDownRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        let pinned = host.pod_volume_path(&req.pod_ref, PLUGIN_NAME, &req.outer_volume_name);
        if req.path != pinned {
            // The host's own path: there is nothing of kubevol's to remove.
            return Box::pin(async { Ok(()) });
        }
        blocking(move || unpin(&host, &req))
    }

    fn reconstruct(
        &self,
        _host: &PluginHost,
        _pod: &kubevol_core::PodRef,
        name: &str,
        dir: &Path,
        _mounted: bool,
    ) -> Option<(VolumeSpec, PathBuf)> {
        // A pinned directory without its record: what it pinned is not known, but its
        // teardown (an unmount and an rmdir) needs nothing more, and a pod that still has the
        // volume sets it up again from its own spec.
        let volume = k8s_openapi::api::core::v1::Volume {
            name: name.to_string(),
            host_path: Some(HostPathVolumeSource::default()),
            ..Default::default()
        };
        super::reconstructed(volume, dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_path_says_what_can_make_it() {
        let t = tempfile::tempdir().unwrap();
        let missing = t.path().join("nothing");
        let rows = [
            ("Directory", "or use type DirectoryOrCreate"),
            ("File", "or use type FileOrCreate"),
            ("Socket", "start the program that listens on it"),
            ("CharDevice", "create the device node (mknod)"),
            ("BlockDevice", "create the device node (mknod)"),
        ];
        for (type_, hint) in rows {
            let e = check_host_path_type(&missing, type_)
                .unwrap_err()
                .to_string();
            assert!(e.contains(hint), "{type_}: {e}");
            assert!(
                !e.contains("OrCreate") || type_ == "Directory" || type_ == "File",
                "{e}"
            );
        }
    }

    #[test]
    fn allow_list_compares_components_and_resolves_links() {
        let t = tempfile::tempdir().unwrap();
        let data = t.path().join("data");
        fs::create_dir_all(&data).unwrap();
        fs::create_dir_all(t.path().join("database")).unwrap();
        std::os::unix::fs::symlink("/etc", data.join("etc-link")).unwrap();
        let allow = vec![data.clone()];
        assert!(check_allowed(&data.join("x/y"), &allow).is_ok());
        assert!(
            check_allowed(&t.path().join("database"), &allow).is_err(),
            "/data must not allow /database"
        );
        for escape in ["x/../../etc", "x/y/../../../etc/z", "./x/../.."] {
            assert!(
                check_allowed(&data.join(escape), &allow).is_err(),
                "{escape}: a `..` past a name that does not exist must not lead out"
            );
        }
        assert!(check_allowed(&data.join("x/../y"), &allow).is_ok());
        let e = check_allowed(&data.join("etc-link"), &allow).unwrap_err();
        assert!(e.to_string().contains("resolves to /etc"), "{e}");
        assert!(
            check_allowed(Path::new("/etc"), &[]).is_ok(),
            "no list allows all"
        );
    }
}
