//! The kubevol-csi-loop driver as a child process of a test, and other helpers shared by the
//! test files.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

pub const DRIVER: &str = "loop.csi.kubevol.io";

/// A TCP port nothing listens on now, for a daemon's `--listen`.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn driver_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kubevol-csi-loop"))
}

/// A running kubevol-csi-loop. Dropping it kills it and detaches its volumes' loop devices.
pub struct Driver {
    child: Option<Child>,
    dir: PathBuf,
    pub args: Vec<String>,
}

impl Driver {
    /// Starts the driver with its socket and data under `dir`, registering through
    /// `registry` when given.
    pub fn start(dir: &Path, registry: Option<&Path>, extra: &[&str]) -> Driver {
        std::fs::create_dir_all(dir).unwrap();
        let mut args = vec![
            "--endpoint".to_string(),
            format!("unix://{}", dir.join("csi.sock").display()),
            "--data-dir".into(),
            dir.join("data").display().to_string(),
            "--node-id".into(),
            "test-node".into(),
            "--call-log".into(),
            dir.join("calls.json").display().to_string(),
        ];
        if let Some(r) = registry {
            args.push("--registration-dir".into());
            args.push(r.display().to_string());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut d = Driver {
            child: None,
            dir: dir.to_path_buf(),
            args,
        };
        d.restart();
        d
    }

    pub fn restart(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("driver.log"))
            .unwrap();
        let _ = std::fs::remove_file(self.socket());
        self.child = Some(
            Command::new(driver_binary())
                .args(&self.args)
                .stderr(log)
                .spawn()
                .expect("start kubevol-csi-loop"),
        );
        // Ready once it accepts a connection: its socket file appears at bind(), a moment
        // before it listens, and a loaded machine can stretch that moment.
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while std::time::Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(self.socket()).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the driver did not listen on {}", self.socket().display());
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("csi.sock")
    }

    /// SIGKILL: nothing is cleaned up, as when a driver crashes.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM: the driver removes its sockets and exits.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let _ = c.wait();
        }
    }

    /// The calls the driver has answered: (method, volume, path, code).
    pub fn calls(&self) -> Vec<(String, String, String, String)> {
        std::fs::read_to_string(self.dir.join("calls.json"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| {
                let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
                (s("method"), s("volume_id"), s("path"), s("code"))
            })
            .collect()
    }

    pub fn count(&self, method: &str, code: &str) -> usize {
        self.calls()
            .iter()
            .filter(|c| c.0 == method && c.3 == code)
            .count()
    }

    /// What the stage or publish requests of a method carried, in order.
    pub fn requests(&self, method: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.join("calls.json"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["request"] == method)
            .collect()
    }

    pub fn image(&self, id: &str) -> PathBuf {
        self.dir
            .join("data/volumes")
            .join(format!("{}.img", id.replace('/', "~")))
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.kill();
        let _ = Command::new(driver_binary())
            .arg("--detach-all")
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .status();
    }
}
