//! The local lane. A set-up or teardown that its plugin does with a few syscalls on the
//! node's own filesystems (an emptyDir's mkdir, mount and chmod; a tmpfs's unmount and rmdir)
//! runs here, one after another on one thread, instead of as a task of its own that waits for
//! a slot, for the record's writer and for the blocking pool. The lane's thread takes a chunk
//! of operations at a time and queues all their intents for the record (one write, one
//! `fdatasync`), and while the record writes them it runs the chunk before: each operation's
//! side effect once its intent is on disk. What follows a side effect (the actual state, the
//! events, the record's outcome, the key released, the waiters woken) is handed to the
//! finisher, a task on the runtime, a batch at a time: the thread that mounts does nothing
//! else, and the rest runs beside it. One thread loses little on a small node: raw tmpfs
//! mounts from two threads run at 1.5 to 1.8 times one thread's rate on 2 cores (Linux 6.18),
//! but a storm's set-up already keeps both cores busy (the lane one, the populator,
//! reconciler, finisher and record the other), and unmounts go no faster from two threads
//! (each waits for an expedited RCU grace period). Two lane threads, a pod's operations on
//! one, set up 4,000 tmpfs volumes at 0.62 to 1.06 of the one-thread raw floor's rate
//! against 0.62 to 0.86 with one thread, and their teardowns took more CPU.
//!
//! The guarantee of the record is the same as for an operation task: every side effect comes
//! after its intent is on disk.
//!
//! Operations are queued per pod and served in turns of a few, so that a pod with thousands
//! of volumes does not keep a pod added after it waiting, and pods with a few volumes each
//! are served in the order they came.
//!
//! A call that hangs (a hung filesystem where a volume's directory is) is caught by the
//! watchdog after the operation timeout: its pod shows why, and what the chunk had not run yet
//! goes to a new thread. The hung call's thread finishes that one operation if it ever returns,
//! and ends.

use std::collections::VecDeque;
use std::hash::Hash;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use kubevol_core::reconcile::Operation;
use tokio::sync::Notify;
use tokio::time::Instant;

use kubevol_core::collections::HashMap;
use kubevol_core::names::SharedStr;
use kubevol_core::{PodRef, PodUid};
use tokio::sync::mpsc;

use super::slots::Group;
use super::{
    conclude, effected, mount, panic_message, panicked, report_stalled, settle_all, unmount,
};
use super::{Operations, Outcome};
use crate::error::VolumeError;
use crate::plugins::VolumePlugin;
use crate::record;

/// How many operations the lane takes from its queue at a time.
const CHUNK: usize = 64;

/// How many operations are kept prepared ahead of the one running, their intents queued: enough
/// for the record to write them while those before run even where an `fdatasync` takes
/// milliseconds (a disk), so that its batches, and not its syncs, grow with a storm.
const AHEAD: usize = 256;

/// The most operations of one pod a chunk takes while others wait.
const TURN: usize = 8;

/// The most operations run before they are handed to the finisher together (their keys
/// released, their pods' waiters woken once, their record lines queued at once).
const HAND_OVER: usize = 64;

/// The first hand-over after the lane waited for work: the first pods of a storm are ready
/// after their own few operations, not after a whole batch; each hand-over after it is twice
/// as large, up to [`HAND_OVER`].
const FIRST_HAND_OVER: usize = 4;

/// Items waiting in groups, served in turns: each group in the order it first queued, a few
/// items per turn.
struct Turns<G, T> {
    order: VecDeque<G>,
    queued: HashMap<G, VecDeque<T>>,
}

impl<G, T> Default for Turns<G, T> {
    fn default() -> Self {
        Turns {
            order: VecDeque::new(),
            queued: HashMap::default(),
        }
    }
}

impl<G: Eq + Hash + Clone, T> Turns<G, T> {
    fn push(&mut self, group: G, item: T) {
        match self.queued.get_mut(&group) {
            Some(q) => q.push_back(item),
            None => {
                self.order.push_back(group.clone());
                self.queued.insert(group, VecDeque::from([item]));
            }
        }
    }

    /// Up to `max` items, at most `turn` of a group before the next group's turn.
    fn take(&mut self, max: usize, turn: usize, out: &mut Vec<T>) {
        while out.len() < max {
            let Some(group) = self.order.pop_front() else {
                return;
            };
            let Some(q) = self.queued.get_mut(&group) else {
                continue;
            };
            let n = turn.min(max - out.len()).min(q.len());
            out.extend(q.drain(..n));
            if q.is_empty() {
                self.queued.remove(&group);
            } else {
                self.order.push_back(group);
            }
        }
    }
}

/// The operation the lane's worker runs now.
struct Running {
    op: Operation,
    since: std::time::Instant,
    /// Which start of an operation this is, so the watchdog knows it is still the same one.
    seq: u64,
}

/// What the lane's thread did of one operation, for the finisher.
enum Ran {
    /// Ended before any side effect (nothing to do, or a panic), with its record lines.
    Ended(Outcome, Vec<record::Change>),
    /// A set-up and what it did (an error if its intent could not be recorded).
    SetUp(mount::SetUp, mount::Effect),
    /// A teardown and what it did.
    TearDown(unmount::TearDown, Result<(), VolumeError>),
}

/// What the finisher is handed.
enum Job {
    Batch(Vec<(Operation, Instant, Ran)>),
    /// Answered once every batch before it is finished.
    Flush(tokio::sync::oneshot::Sender<()>),
}

#[derive(Default)]
struct State {
    /// Operations run and not handed to the finisher yet.
    batch: Vec<(Operation, Instant, Ran)>,
    /// The finisher's queue (none before the first operation).
    finisher: Option<mpsc::UnboundedSender<Job>>,
    /// The runtime the lane was started on (its blocking pool makes directories ahead).
    runtime: Option<tokio::runtime::Handle>,
    turns: Turns<Group, Operation>,
    /// Operations a stalled worker had not run yet: served first.
    retry: VecDeque<Operation>,
    /// The worker that may take work (0: none started yet). An older one, left on a hung
    /// call, ends once the call returns.
    worker: u64,
    /// The current worker's operations prepared ahead of the one it runs, in order, their
    /// intents queued.
    prepared: VecDeque<Queued>,
    running: Option<Running>,
    seq: u64,
    /// The worker waits for work.
    sleeping: bool,
    /// How many operations run make the next hand-over (0: [`FIRST_HAND_OVER`]).
    hand_over_at: usize,
    /// The watchdog waits for an operation to start.
    watched: bool,
    closed: bool,
}

impl State {
    /// The operations run so far, for the finisher; room is made for as many next (an
    /// operation's outcome is hundreds of bytes: growing the batch one doubling at a time
    /// copied them again and again).
    fn take_batch(&mut self) -> Vec<(Operation, Instant, Ran)> {
        std::mem::replace(&mut self.batch, Vec::with_capacity(HAND_OVER))
    }

    /// Whether a whole chunk is prepared and the next operation can run now (its intent is
    /// on disk, or it has none): then it runs before another chunk is prepared. Where a sync
    /// takes milliseconds (a disk), chunks are prepared, up to [`AHEAD`], while it runs; where
    /// it takes nothing (a tmpfs), the first mount of a storm does not wait for them.
    fn ahead_and_ready(&self) -> bool {
        self.prepared.len() >= CHUNK
            && self.prepared.front().is_some_and(|q| match &q.committed {
                Some(Ok(c)) => c.answered(),
                None | Some(Err(_)) => true,
            })
    }
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the worker when work is queued.
    work: Condvar,
    /// Wakes the watchdog when an operation starts.
    watch: Notify,
    /// Tells [`Lane::close`] that the running operation has ended.
    settled: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    /// Hands the operations run so far to the finisher.
    fn hand_over(&self) {
        let mut st = self.lock();
        let batch = st.take_batch();
        self.send(&st, batch);
    }

    fn send(&self, st: &State, batch: Vec<(Operation, Instant, Ran)>) {
        if batch.is_empty() {
            return;
        }
        if let Some(f) = &st.finisher {
            // The finisher ends only with the runtime, when nothing is left to finish.
            let _ = f.send(Job::Batch(batch));
        }
    }
}

/// The lane of an [`Operations`].
pub(super) struct Lane {
    shared: Arc<Shared>,
}

impl Default for Lane {
    fn default() -> Self {
        Lane {
            shared: Arc::new(Shared {
                state: Mutex::default(),
                work: Condvar::new(),
                watch: Notify::new(),
                settled: Notify::new(),
            }),
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.work.notify_all();
        self.shared.watch.notify_one();
    }
}

impl Lane {
    /// Queues `op`, whose key the executor has reserved, starting the worker and its watchdog
    /// on first use. Returns the operation back if no thread could be started for it (the
    /// caller runs it as a task).
    pub(super) fn push(&self, ops: &Arc<Operations>, op: Operation) -> Result<(), Operation> {
        let mut st = self.shared.lock();
        if st.closed {
            return Err(op);
        }
        if st.worker == 0 {
            let Ok(rt) = tokio::runtime::Handle::try_current() else {
                return Err(op);
            };
            if !spawn_worker(&self.shared, ops, 1) {
                return Err(op);
            }
            st.worker = 1;
            let (tx, rx) = mpsc::unbounded_channel();
            st.finisher = Some(tx);
            rt.spawn(finisher(Arc::downgrade(ops), rx));
            rt.spawn(watchdog(self.shared.clone(), Arc::downgrade(ops)));
            st.runtime = Some(rt);
        }
        st.turns.push(Group::of(&op.key()), op);
        if st.sleeping {
            st.sleeping = false;
            self.shared.work.notify_one();
        }
        Ok(())
    }

    /// Stops the lane: the operation running ends (unless it hangs) and is finished, the
    /// queued ones are dropped with their keys (the manager is stopping; an intent recorded
    /// without its side effect is checked at the next start).
    pub(super) async fn close(&self) {
        self.settle().await;
        self.shared.hand_over();
        let flushed = {
            let st = self.shared.lock();
            st.finisher.as_ref().map(|f| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let _ = f.send(Job::Flush(tx));
                rx
            })
        };
        if let Some(flushed) = flushed {
            let _ = flushed.await;
        }
    }

    /// Closes the lane and waits until no operation runs on its current worker.
    async fn settle(&self) {
        loop {
            let settled = self.shared.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            {
                let mut st = self.shared.lock();
                st.closed = true;
                self.shared.work.notify_all();
                self.shared.watch.notify_one();
                if st.running.is_none() {
                    return;
                }
            }
            settled.await;
        }
    }
}

fn spawn_worker(shared: &Arc<Shared>, ops: &Arc<Operations>, me: u64) -> bool {
    let (shared, ops) = (shared.clone(), Arc::downgrade(ops));
    let spawned = std::thread::Builder::new()
        .name("kubevol-lane".into())
        .spawn(move || work(&shared, &ops, me));
    match spawned {
        Ok(_) => true,
        Err(e) => {
            tracing::error!(
                "cannot start the local lane's thread: {e}; its operations run as tasks"
            );
            false
        }
    }
}

/// An operation prepared, its intent queued for the record.
struct Queued {
    op: Operation,
    step: Step,
    /// None without an intent; else its commit (or why it could not be queued).
    committed: Option<std::io::Result<record::Committed>>,
}

/// The worker: keeps a chunk prepared ahead of the operation it runs, so that the record
/// writes a chunk's intents while the chunk before it runs; ends when the lane closes or a
/// newer worker has taken its place.
fn work(shared: &Shared, ops: &Weak<Operations>, me: u64) {
    loop {
        let chunk = {
            let mut st = shared.lock();
            loop {
                if st.closed || st.worker != me {
                    return;
                }
                if st.prepared.is_empty() {
                    // Nothing prepared is left: what ran is handed over before the worker waits.
                    let batch = st.take_batch();
                    shared.send(&st, batch);
                }
                let mut chunk = Vec::new();
                if st.prepared.len() < AHEAD && !st.ahead_and_ready() {
                    let n = st.retry.len().min(CHUNK);
                    chunk.extend(st.retry.drain(..n));
                    st.turns.take(CHUNK, TURN, &mut chunk);
                }
                if !chunk.is_empty() || !st.prepared.is_empty() {
                    break chunk;
                }
                st.sleeping = true;
                st.hand_over_at = 0;
                st = shared
                    .work
                    .wait(st)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        let Some(ops) = ops.upgrade() else {
            return;
        };
        if !chunk.is_empty() {
            queue(shared, &ops, chunk);
        } else if !run_one(shared, &ops, me) {
            return;
        }
    }
}

/// Prepares a chunk from the world as it is now, and queues its intents. One with nothing to
/// do ends here.
fn queue(shared: &Shared, ops: &Operations, chunk: Vec<Operation>) {
    let mut steps = Vec::with_capacity(chunk.len());
    let mut ended = Vec::new();
    let mut intents = Vec::with_capacity(chunk.len());
    for (op, seen) in Seen::of(ops, chunk) {
        let started = Instant::now();
        let mut records = Vec::new();
        let step = guarded(|| Step::prepare(ops, &op, seen))
            .unwrap_or_else(|panic| Err(panicked(ops, &op, &panic, &mut records)));
        match step {
            Ok((step, intent)) => {
                let recorded = intent.is_some();
                intents.extend(intent);
                steps.push((op, step, recorded));
            }
            Err(done) => ended.push((op, started, Ran::Ended(done, records))),
        }
    }
    // The chunk's intents go to the record together: one wake-up of its writer, one commit.
    let mut committed = ops
        .host
        .record
        .queue_durable_all(intents)
        .map(Vec::into_iter);
    let prepared: Vec<Queued> = steps
        .into_iter()
        .map(|(op, step, recorded)| {
            let committed = recorded.then(|| match &mut committed {
                Ok(each) => each.next().ok_or_else(|| {
                    std::io::Error::other("the record answered fewer intents than were queued")
                }),
                Err(e) => Err(record::copy_error(e)),
            });
            Queued {
                op,
                step,
                committed,
            }
        })
        .collect();
    // What the chunk's first set-ups can do before their intents are recorded runs on the
    // blocking pool meanwhile, on the other core, instead of on the lane.
    let mut ahead: Vec<(Arc<dyn VolumePlugin>, PodRef)> = Vec::new();
    for q in &prepared {
        if let Step::SetUp(s) = &q.step {
            if let Some((plugin, pod)) = s.first() {
                if ahead.last().is_none_or(|(_, last)| last.uid != pod.uid) {
                    ahead.push((plugin.clone(), pod.clone()));
                }
            }
        }
    }
    let mut st = shared.lock();
    if let (false, Some(rt)) = (ahead.is_empty(), &st.runtime) {
        let host = ops.host.clone();
        rt.spawn_blocking(move || {
            for (plugin, pod) in ahead {
                if let Some(quick) = plugin.quick() {
                    quick.set_up_ahead(&host, &pod);
                }
            }
        });
    }
    if st.prepared.capacity() == 0 {
        st.prepared.reserve(AHEAD + CHUNK);
    }
    st.prepared.extend(prepared);
    st.batch.extend(ended);
}

/// Runs the next prepared operation once its intent is on disk. False: this worker is to stop
/// (the lane closed, or a stall handed what it had not run to a newer worker).
fn run_one(shared: &Shared, ops: &Operations, me: u64) -> bool {
    let q = {
        let mut st = shared.lock();
        if st.closed || st.worker != me {
            return false;
        }
        let Some(q) = st.prepared.pop_front() else {
            return true;
        };
        st.seq += 1;
        st.running = Some(Running {
            op: q.op.clone(),
            since: std::time::Instant::now(),
            seq: st.seq,
        });
        if st.watched {
            st.watched = false;
            shared.watch.notify_one();
        }
        q
    };
    let Queued {
        op,
        step,
        committed,
    } = q;
    let started = Instant::now();
    let recorded = committed.is_some();
    let committed = match committed {
        None => Ok(()),
        Some(c) => c.and_then(record::Committed::wait),
    };
    let ran = match committed {
        Ok(()) => guarded(|| step.run(ops, recorded)),
        Err(source) => Ok(step.not_recorded(VolumeError::Record {
            dir: ops.host.record.dir().to_path_buf(),
            source,
        })),
    };
    let ran = ran.unwrap_or_else(|panic| {
        let mut records = Vec::new();
        let outcome = panicked(ops, &op, &panic, &mut records);
        Ran::Ended(outcome, records)
    });
    let (stop, full) = {
        let mut st = shared.lock();
        let mine = st.worker == me;
        if mine {
            st.running = None;
        }
        st.batch.push((op, started, ran));
        let at = st.hand_over_at.max(FIRST_HAND_OVER);
        let full = st.batch.len() >= at;
        if full {
            st.hand_over_at = (at * 2).min(HAND_OVER);
        }
        (!mine || st.closed, full)
    };
    if full || stop {
        shared.hand_over();
    }
    if stop {
        // A close waits for this: what ran is handed over.
        shared.settled.notify_waiters();
    }
    !stop
}

/// One operation of the chunk, prepared.
enum Step {
    SetUp(mount::SetUp),
    TearDown(unmount::TearDown),
}

/// What a chunk's operations read of the world: the DSW once and the ASW once for the whole
/// chunk (each alone, as everywhere), not per operation, where every read waited behind a
/// writer queued meanwhile (a populator's pod, behind a reconciler's plan).
enum Seen {
    SetUp(mount::Wanted, mount::Had),
    TearDown(unmount::Had),
    Other,
}

impl Seen {
    fn of(ops: &Operations, chunk: Vec<Operation>) -> Vec<(Operation, Seen)> {
        let wanted: Vec<mount::Wanted> = {
            let dsw = ops.world().dsw();
            chunk
                .iter()
                .map(|op| match op {
                    Operation::MountVolume { volume, pod, .. } => mount::wanted(&dsw, volume, pod),
                    _ => None,
                })
                .collect()
        };
        let asw = ops.world().asw();
        chunk
            .into_iter()
            .zip(wanted)
            .map(|(op, want)| {
                let seen = match &op {
                    Operation::MountVolume { volume, pod, .. } => {
                        Seen::SetUp(want, mount::had(&asw, volume, pod))
                    }
                    Operation::UnmountVolume { volume, pod } => {
                        Seen::TearDown(unmount::had(&asw, volume, pod))
                    }
                    _ => Seen::Other,
                };
                (op, seen)
            })
            .collect()
    }
}

impl Step {
    /// The step, and its intent to record before its side effect.
    fn prepare(
        ops: &Operations,
        op: &Operation,
        seen: Seen,
    ) -> Result<(Step, Option<record::Change>), Outcome> {
        match (op, seen) {
            (
                Operation::MountVolume {
                    volume,
                    pod,
                    remount,
                },
                Seen::SetUp(want, had),
            ) => mount::prepare_from(ops, volume, pod, *remount, want, || had)
                .map(|(s, intent)| (Step::SetUp(s), intent)),
            (Operation::UnmountVolume { volume, pod }, Seen::TearDown(have)) => {
                unmount::prepare_from(ops, volume, pod, have)
                    .map(|(t, intent)| (Step::TearDown(t), Some(intent)))
            }
            // Never queued here (`Operations::is_quick` takes only pod volumes' set-ups and
            // teardowns); said, not assumed, should that change.
            (other, _) => Err((
                kubevol_core::names::SharedStr::default(),
                Err(format!(
                    "{} of volume {} is not an operation of the local lane (a kubevol bug; it is retried)",
                    other.metric_name(),
                    other.volume()
                )
                .into()),
                true,
            )),
        }
    }

    /// Its intent could not be recorded: nothing was done.
    fn not_recorded(self, e: VolumeError) -> Ran {
        match self {
            Step::SetUp(s) => Ran::SetUp(s, Err((e, None))),
            Step::TearDown(t) => Ran::TearDown(t, Err(e)),
        }
    }

    /// Its intent (if it has one: `recorded`) on disk: the side effect.
    fn run(self, ops: &Operations, recorded: bool) -> Ran {
        match self {
            Step::SetUp(s) => {
                if recorded {
                    record::fail_point("set_up", "before");
                }
                let result = effected("set_up", s.effect_now(ops));
                Ran::SetUp(s, result)
            }
            Step::TearDown(t) => {
                record::fail_point("tear_down", "before");
                let torn = effected("tear_down", t.effect_now(ops));
                Ran::TearDown(t, torn)
            }
        }
    }
}

/// Finishes what the lane's thread hands over, a batch at a time: the outcomes in the actual
/// state and the events, the record lines queued, the directories of pods with nothing left
/// removed, then the keys released and the waiters woken.
async fn finisher(ops: Weak<Operations>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    while let Some(job) = jobs.recv().await {
        let batch = match job {
            Job::Batch(batch) => batch,
            Job::Flush(done) => {
                let _ = done.send(());
                continue;
            }
        };
        let Some(ops) = ops.upgrade() else {
            return;
        };
        let mut records = Vec::new();
        // Pods with nothing left, and the plugin of their last volume.
        let mut gone: Vec<(PodUid, SharedStr)> = Vec::new();
        let mut concluded = Vec::with_capacity(batch.len());
        for (op, started, ran) in batch {
            let outcome = guarded(|| match ran {
                Ran::Ended(outcome, mut lines) => {
                    records.append(&mut lines);
                    outcome
                }
                Ran::SetUp(s, effect) => mount::finish(&ops, s, effect, &mut records),
                Ran::TearDown(t, torn) => {
                    let pod = t.pod.clone();
                    let (outcome, idle) = unmount::finish(&ops, t, torn, &mut records);
                    if idle {
                        gone.push((pod, outcome.0.clone()));
                    }
                    outcome
                }
            })
            .unwrap_or_else(|panic| panicked(&ops, &op, &panic, &mut records));
            concluded.push((op, started, outcome));
        }
        settle_all(&ops, records);
        if !gone.is_empty() {
            gone.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            gone.dedup_by(|a, b| a.0 == b.0);
            unmount::remove_pod_dirs(&ops, gone).await;
        }
        conclude(&ops, concluded);
    }
}

/// Runs `f`, turning a panic into its message.
fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| panic_message(&*p))
}

/// Reports an operation that has run longer than the operation timeout, and gives what is
/// left of its chunk to a new worker. Sleeps while nothing runs.
async fn watchdog(shared: Arc<Shared>, ops: Weak<Operations>) {
    loop {
        let running = {
            let mut st = shared.lock();
            if st.closed {
                return;
            }
            let running = st.running.as_ref().map(|r| (r.since, r.seq));
            st.watched = running.is_none();
            running
        };
        let Some((since, seq)) = running else {
            shared.watch.notified().await;
            continue;
        };
        let Some(timeout) = ops.upgrade().map(|o| o.timeout) else {
            return;
        };
        tokio::time::sleep_until(Instant::from_std(since + timeout)).await;
        let stalled = {
            let mut st = shared.lock();
            let same = !st.closed && st.running.as_ref().is_some_and(|r| r.seq == seq);
            // Still the same operation: it has run for the whole timeout.
            let hung = if same { st.running.take() } else { None };
            match hung {
                Some(r) => {
                    st.worker += 1;
                    // Their intents are on disk or queued; the new worker queues them again.
                    let mut retry: VecDeque<Operation> =
                        st.prepared.drain(..).map(|q| q.op).collect();
                    retry.append(&mut st.retry);
                    st.retry = retry;
                    Some((r.op, st.worker))
                }
                None => None,
            }
        };
        let Some((op, worker)) = stalled else {
            continue;
        };
        let Some(ops) = ops.upgrade() else {
            return;
        };
        // What the hung worker ran before it is finished now.
        shared.hand_over();
        report_stalled(&ops, &op);
        if !spawn_worker(&shared, &ops, worker) {
            // Without a thread, what is queued runs as tasks.
            let queued: Vec<Operation> = {
                let mut st = shared.lock();
                let mut all: Vec<Operation> = st.retry.drain(..).collect();
                st.turns.take(usize::MAX, usize::MAX, &mut all);
                st.closed = true;
                all
            };
            for op in queued {
                ops.spawn_task(op);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Turns;

    fn take(t: &mut Turns<&'static str, u32>, max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        t.take(max, 2, &mut out);
        out
    }

    #[test]
    fn groups_take_turns_and_small_ones_keep_their_order() {
        let mut t = Turns::default();
        for i in 0..7 {
            t.push("big", 100 + i);
        }
        t.push("a", 1);
        t.push("b", 2);
        t.push("b", 3);
        // Two of the big group, then the others in the order they came, then big again.
        assert_eq!(take(&mut t, 4), vec![100, 101, 1, 2]);
        t.push("c", 4);
        assert_eq!(take(&mut t, 5), vec![102, 103, 3, 4, 104]);
        assert_eq!(take(&mut t, 10), vec![105, 106]);
        assert!(take(&mut t, 10).is_empty());
        // A group that emptied queues at the back when it comes again.
        t.push("x", 7);
        t.push("big", 200);
        assert_eq!(take(&mut t, 10), vec![7, 200]);
    }
}
