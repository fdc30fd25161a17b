//! Fault injection for tests: `--inject METHOD:CODE[:COUNT]` makes the next COUNT calls of a
//! method (every call, without COUNT) fail with a gRPC code before doing anything (with `OK`,
//! answer success without doing anything, as a driver with a bug would);
//! `--delay METHOD:MS` makes every call of a method take MS milliseconds longer (after its work,
//! so a caller that gives up first leaves the work done, as a real slow driver does).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tonic::Code;

/// A parsed `--inject` flag.
#[derive(Clone, Debug)]
pub struct Inject {
    method: String,
    code: Code,
    count: Option<u32>,
}

/// The gRPC code named `name` (`UNAVAILABLE`, `Unavailable` or `14`).
pub fn parse_code(name: &str) -> Result<Code, String> {
    if let Ok(n) = name.parse::<i32>() {
        return Ok(Code::from_i32(n));
    }
    let norm: String = name
        .chars()
        .filter(|c| *c != '_')
        .collect::<String>()
        .to_ascii_lowercase();
    let all = [
        Code::Ok,
        Code::Cancelled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];
    all.into_iter()
        .find(|c| {
            format!("{c:?}").to_ascii_lowercase() == norm
                || (norm == "canceled" && *c == Code::Cancelled)
        })
        .ok_or_else(|| format!("unknown gRPC code {name:?}"))
}

impl std::str::FromStr for Inject {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let (Some(method), Some(code)) = (parts.next(), parts.next()) else {
            return Err(format!("{s:?}: write METHOD:CODE[:COUNT]"));
        };
        let count = parts
            .next()
            .map(|c| c.parse::<u32>().map_err(|e| format!("{s:?}: count: {e}")))
            .transpose()?;
        Ok(Inject {
            method: method.to_string(),
            code: parse_code(code)?,
            count,
        })
    }
}

/// A parsed `--delay` flag.
#[derive(Clone, Debug)]
pub struct Delay {
    method: String,
    delay: Duration,
}

impl std::str::FromStr for Delay {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (method, ms) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?}: write METHOD:MS"))?;
        Ok(Delay {
            method: method.to_string(),
            delay: Duration::from_millis(ms.parse().map_err(|e| format!("{s:?}: {e}"))?),
        })
    }
}

/// The faults in force.
#[derive(Debug, Default)]
pub struct Faults {
    remaining: Mutex<Vec<Inject>>,
    delays: HashMap<String, Duration>,
}

impl Faults {
    /// Faults from the flags.
    pub fn new(injects: Vec<Inject>, delays: Vec<Delay>) -> Self {
        Faults {
            remaining: Mutex::new(injects),
            delays: delays.into_iter().map(|d| (d.method, d.delay)).collect(),
        }
    }

    /// The code this call of `method` must fail with, if any (and uses one of its count).
    pub fn take(&self, method: &str) -> Option<Code> {
        let mut all = self.remaining.lock().unwrap_or_else(|e| e.into_inner());
        let i = all
            .iter()
            .position(|f| f.method == method && f.count != Some(0))?;
        let f = &mut all[i];
        if let Some(c) = f.count.as_mut() {
            *c -= 1;
        }
        Some(f.code)
    }

    /// The extra time a call of `method` takes.
    pub fn delay(&self, method: &str) -> Option<Duration> {
        self.delays.get(method).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_counts() {
        let f = Faults::new(
            vec![
                "NodeStageVolume:UNAVAILABLE:2".parse().unwrap(),
                "NodePublishVolume:deadline_exceeded".parse().unwrap(),
            ],
            vec!["NodeUnstageVolume:250".parse().unwrap()],
        );
        assert_eq!(f.take("NodeStageVolume"), Some(Code::Unavailable));
        assert_eq!(f.take("NodeStageVolume"), Some(Code::Unavailable));
        assert_eq!(f.take("NodeStageVolume"), None);
        for _ in 0..5 {
            assert_eq!(f.take("NodePublishVolume"), Some(Code::DeadlineExceeded));
        }
        assert_eq!(
            f.delay("NodeUnstageVolume"),
            Some(Duration::from_millis(250))
        );
        assert_eq!(parse_code("14").unwrap(), Code::Unavailable);
        assert_eq!(parse_code("Canceled").unwrap(), Code::Cancelled);
        assert!("NodeStageVolume".parse::<Inject>().is_err());
        assert!(parse_code("NOPE").is_err());
    }
}
