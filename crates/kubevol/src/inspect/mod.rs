//! What an operator reads: the status report, each volume's chain of steps (`describe`) and
//! the HTTP server that serves them with the metrics. Everything here reads snapshots of the
//! other parts and changes nothing.

pub mod describe;
#[cfg(feature = "http")]
pub mod http;
pub mod status;
pub mod summary;
