//! The reconciler loop: it asks the pure planner in `kubevol-core` what is due, hands each
//! operation to [`Operations::start`] (which drops keys in flight or backing off), and sleeps
//! until something changes: a DSW or ASW change, a finished operation, the earliest backoff
//! expiry, or the slow safety-net resync. It reads the world and never writes it, and never
//! makes a syscall.

use std::sync::Arc;
use std::time::Duration;

use kubevol_core::reconcile::plan;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::info;

use crate::operations::executor::NotStarted;
use crate::operations::Operations;

/// One pass: plans, starts what is due, and returns when the earliest backoff expires (or the
/// resync is due).
fn pass(ops: &Arc<Operations>, resync: Duration) -> Instant {
    let world = ops.world();
    let now = Instant::now();
    let teardown_allowed = world.dsw_synced();
    let planned = {
        let dsw = world.dsw();
        let asw = world.asw();
        plan(
            &dsw,
            &asw,
            teardown_allowed,
            world.reported_in_use_required(),
        )
    };
    let mut next = now + resync;
    for op in planned {
        match ops.start(op, now) {
            Ok(()) | Err(NotStarted::Busy) => {}
            Err(NotStarted::BackingOff(at)) => next = next.min(at),
        }
    }
    if teardown_allowed && world.mark_states_synced() {
        info!("reconciler states synced");
    }
    ops.prune_errors();
    next
}

/// Runs until `stop` says so.
pub(crate) async fn run(ops: Arc<Operations>, resync: Duration, mut stop: watch::Receiver<bool>) {
    let world = ops.world();
    loop {
        if *stop.borrow_and_update() {
            return;
        }
        // A pass that panics (a bug hit by one input) is reported, and the next wake-up or the
        // resync makes a new one: the node keeps converging.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pass(&ops, resync)));
        let next = outcome.unwrap_or_else(|_| {
            tracing::error!("the reconciler panicked in a pass; the next one starts on the next change or the resync");
            Instant::now() + resync
        });
        tokio::select! {
            _ = world.reconciler_woken() => {}
            _ = tokio::time::sleep_until(next) => {}
            _ = stop.changed() => return,
        }
    }
}
