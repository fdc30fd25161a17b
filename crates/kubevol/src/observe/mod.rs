//! What an operator sees: the status report, events, Prometheus metrics and the HTTP server
//! that serves them. Everything here reads snapshots of the other parts and changes nothing
//! but its own counters.

pub mod describe;
pub mod events;
pub mod http;
pub mod metrics;
pub mod status;
