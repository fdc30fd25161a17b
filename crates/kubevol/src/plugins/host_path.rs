//! hostPath: a path on the host handed to the pod as it is, inline or through a claim bound to
//! a hostPath PersistentVolume. Set-up only checks (and for the `...OrCreate` types creates) the
//! object at the path; the path reported to the runtime is the host path itself, as in the
//! kubelet. Teardown never touches host data.

use std::fs::{self, DirBuilder, OpenOptions, Permissions};
use std::io::ErrorKind;
// create_new (O_CREAT|O_EXCL) never follows a link at the last component.
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::HostPathVolumeSource;
use kubevol_core::state::VolumeSpec;

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

/// What is at `path`, in words.
fn describe(ft: fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_file() {
        "a regular file"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_fifo() {
        "a FIFO"
    } else {
        "something else"
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

/// Checks (and for the `...OrCreate` types creates) the object at `path` as the kubelet does.
pub fn check_host_path_type(path: &Path, type_: &str) -> Result<(), VolumeError> {
    let existing = match fs::metadata(path) {
        Ok(m) => Some(m.file_type()),
        Err(e) if e.kind() == ErrorKind::NotFound => None,
        Err(e) => return Err(type_error(path, format!("cannot be examined: {e}"))),
    };
    let want: (&str, fn(&fs::FileType) -> bool) = match type_ {
        "" => return Ok(()),
        "DirectoryOrCreate" | "Directory" => ("a directory", fs::FileType::is_dir),
        "FileOrCreate" | "File" => ("a regular file", fs::FileType::is_file),
        "Socket" => ("a socket", FileTypeExt::is_socket),
        "CharDevice" => ("a character device", FileTypeExt::is_char_device),
        "BlockDevice" => ("a block device", FileTypeExt::is_block_device),
        other => return Err(type_error(path, format!("has unknown type {other:?}"))),
    };
    match existing {
        Some(ft) if want.1(&ft) => Ok(()),
        Some(ft) => Err(type_error(
            path,
            format!(
                "is {}, not {} (type {type_}); fix the path or the type",
                describe(ft),
                want.0
            ),
        )),
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
                    .map_err(|e| type_error(path, format!("was created but its mode could not be set: {e}")))?,
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    return Err(type_error(
                        path,
                        format!(
                            "does not exist and its parent directory {} does not exist either; FileOrCreate does not create parents: create it or use DirectoryOrCreate for the parent",
                            path.parent().unwrap_or(Path::new("/")).display()
                        ),
                    ))
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(e) => return Err(type_error(path, format!("does not exist and could not be created: {e}"))),
            }
            check_host_path_type(path, "File")
        }
        None => Err(type_error(
            path,
            format!(
                "does not exist (type {type_} requires {}); {}",
                want.0,
                missing_hint(type_)
            ),
        )),
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
    if allow.is_empty() {
        return Ok(());
    }
    let resolved = resolve(path);
    if allow.iter().any(|a| resolved.starts_with(resolve(a))) {
        return Ok(());
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
            check_allowed(&path, &host.host_path_allow)?;
            check_host_path_type(&path, hp.type_.as_deref().unwrap_or(""))?;
            Ok(SetUpResult {
                path,
                read_only: false,
            })
        })
    }

    fn tear_down(
        &self,
        _host: Arc<PluginHost>,
        _req: TearDownRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        // The volume is the host's own path: there is nothing of kubevol's to remove.
        Box::pin(async { Ok(()) })
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
