//! The reconciler loop: it asks the pure planner in `kubevol-core` what is due, hands each
//! operation to [`Operations::start`] (which drops keys in flight or backing off), and sleeps
//! until something changes: a DSW or ASW change, a finished operation, the earliest backoff
//! expiry, or the slow safety-net resync. It reads the world and never writes it, and never
//! makes a syscall.
//!
//! The safety net is armed by change: a full pass follows every change within the resync
//! period, and a full pass over a converged world (it plans nothing and nothing backs off) is
//! the last until something changes again. A pass plans from the two states only, so a second
//! full pass over states that did not change would plan the same nothing: an idle node is not
//! woken at all, however many volumes it has.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kubevol_core::reconcile::plan;
use kubevol_core::UniqueVolumeName;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::info;

use crate::operations::executor::NotStarted;
use crate::operations::Operations;

/// How many changed volumes are planned under one read of the states.
const PLAN_SLICE: usize = 128;

/// What the reconciler remembers between passes.
struct Memory {
    /// When volumes whose operations back off are to be planned again.
    retries: BTreeMap<Instant, BTreeSet<UniqueVolumeName>>,
    /// When every volume is planned again whatever changed (the safety net); `None` once a full
    /// pass found the world converged, until the next change.
    next_full: Option<Instant>,
}

/// One pass: plans the volumes whose state changed or whose backoff expired (every volume at
/// the start and at each resync), starts what is due, and returns when the next pass is due
/// without a wake-up: the earliest backoff expiry, or the resync; `None`: not before a change.
fn pass(ops: &Arc<Operations>, resync: Duration, memory: &mut Memory) -> Option<Instant> {
    let world = ops.world();
    let now = Instant::now();
    let teardown_allowed = world.dsw_synced();
    let dirty = world.take_dirty();
    world.count_pass();
    let full = dirty.all || memory.next_full.is_some_and(|at| now >= at);
    let changed = full || !dirty.volumes.is_empty();
    let mut only = dirty.volumes;
    if full {
        memory.retries.clear();
        memory.next_full = None;
    } else {
        let later = memory.retries.split_off(&(now + Duration::from_nanos(1)));
        for (_, volumes) in std::mem::replace(&mut memory.retries, later) {
            only.extend(volumes);
        }
    }
    let require_reported = world.reported_in_use_required();
    let plan_under_locks = |only: Option<&[UniqueVolumeName]>| {
        let dsw = world.dsw();
        let asw = world.asw();
        plan(&dsw, &asw, teardown_allowed, require_reported, only)
    };
    let planned = if full {
        plan_under_locks(None)
    } else {
        // A slice at a time: the states' read locks are held briefly, so the populator's
        // writes and the operations' reads queued behind them do not wait for a whole storm.
        // By name: a pod's volumes are planned (and queued) together.
        let mut only: Vec<UniqueVolumeName> = only.into_iter().collect();
        only.sort_unstable();
        only.chunks(PLAN_SLICE)
            .flat_map(|slice| plan_under_locks(Some(slice)))
            .collect()
    };
    let planned_any = !planned.is_empty();
    for op in planned {
        match ops.start(op.clone(), now) {
            Ok(()) | Err(NotStarted::Busy) => {}
            Err(NotStarted::BackingOff(at)) => {
                memory
                    .retries
                    .entry(at)
                    .or_default()
                    .insert(op.volume().clone());
            }
        }
    }
    if teardown_allowed && world.mark_states_synced() {
        info!("reconciler states synced");
    }
    // Errors of keys gone from both states are forgotten on full passes (one follows every
    // change within the resync period): a look at every key on every pass of a storm cost
    // 8 % of cluster mode's CPU with 1,000 pods coming.
    if full {
        ops.prune_errors();
    }
    let converged = full && !planned_any && memory.retries.is_empty();
    if changed && !converged && memory.next_full.is_none() {
        memory.next_full = Some(now + resync);
    }
    let retry = memory.retries.keys().next().copied();
    retry.into_iter().chain(memory.next_full).min()
}

/// Runs until `stop` says so.
pub(crate) async fn run(ops: Arc<Operations>, resync: Duration, mut stop: watch::Receiver<bool>) {
    let world = ops.world();
    let mut memory = Memory {
        retries: BTreeMap::new(),
        next_full: None,
    };
    loop {
        if *stop.borrow_and_update() {
            return;
        }
        // A pass that panics (a bug hit by one input) is reported, and the next wake-up or the
        // resync makes a new one, over every volume: the node keeps converging.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pass(&ops, resync, &mut memory)
        }));
        let next = outcome.unwrap_or_else(|_| {
            tracing::error!("the reconciler panicked in a pass; the next one starts on the next change or the resync");
            world.touch_all();
            Some(Instant::now() + resync)
        });
        tokio::select! {
            _ = world.reconciler_woken() => {}
            _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {}
            _ = stop.changed() => return,
        }
    }
}
