//! What the parts of the manager report as they work: events (the kubelet's reasons, folded
//! and kept per pod), Prometheus metrics and the health CSI drivers report. Every part below the manager writes here; nothing
//! here reads any other part.

pub mod events;
pub mod health;
pub mod metrics;
