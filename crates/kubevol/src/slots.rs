//! The concurrency slots of operations, handed out fairly: operations wait in one queue per
//! pod (per volume for node-wide steps), and a freed slot goes to the queues in turn. A pod
//! with thousands of volumes therefore cannot make a small pod added meanwhile wait for all of
//! them: the small pod's operations get the next slots, one per turn.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// Whose queue an operation waits in: its pod's, or for a node-wide step its volume's.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// A pod's set-up or teardown of one of its volumes.
    Pod(kubevol_core::PodUid),
    /// Attach, mount device, unmount device or detach.
    Volume(kubevol_core::UniqueVolumeName),
}

impl Group {
    /// The queue of an operation.
    pub fn of(key: &kubevol_core::reconcile::OperationKey) -> Group {
        match &key.pod {
            Some(p) => Group::Pod(p.clone()),
            None => Group::Volume(key.volume.clone()),
        }
    }
}

struct State<G> {
    free: usize,
    /// Waiters by group; a group is in `turns` exactly while it has waiters.
    waiting: HashMap<G, VecDeque<oneshot::Sender<()>>>,
    turns: VecDeque<G>,
}

/// Slots shared by every operation, with one queue per group `G`.
pub struct Slots<G> {
    state: Arc<Mutex<State<G>>>,
}

/// A held slot; dropping it gives the slot to the next group in turn.
pub struct Slot<G: Eq + Hash> {
    state: Arc<Mutex<State<G>>>,
}

impl<G: Eq + Hash + Clone> Slots<G> {
    /// `n` slots (at least one).
    pub fn new(n: usize) -> Self {
        Slots {
            state: Arc::new(Mutex::new(State {
                free: n.max(1),
                waiting: HashMap::new(),
                turns: VecDeque::new(),
            })),
        }
    }

    /// Waits for a slot, queued behind the earlier waiters of `group` and taking turns with
    /// the other groups.
    pub async fn acquire(&self, group: G) -> Slot<G> {
        let rx = {
            let mut guard = crate::sync::lock(&self.state);
            let s = &mut *guard;
            if s.free > 0 && s.turns.is_empty() {
                s.free -= 1;
                return Slot {
                    state: self.state.clone(),
                };
            }
            let (tx, rx) = oneshot::channel();
            let queue = s.waiting.entry(group.clone()).or_default();
            if queue.is_empty() {
                s.turns.push_back(group);
            }
            queue.push_back(tx);
            rx
        };
        let mut waiting = Waiting {
            rx,
            state: self.state.clone(),
            granted: false,
        };
        // An error would mean the slots were dropped, which cannot happen while `self` lives.
        let _ = (&mut waiting.rx).await;
        waiting.granted = true;
        Slot {
            state: self.state.clone(),
        }
    }
}

/// Hands a freed slot to the next group in turn, or keeps it free.
fn release<G: Eq + Hash>(state: &Mutex<State<G>>) {
    let mut guard = crate::sync::lock(state);
    let s = &mut *guard;
    while let Some(group) = s.turns.pop_front() {
        let Some(queue) = s.waiting.get_mut(&group) else {
            continue;
        };
        let next = queue.pop_front();
        if queue.is_empty() {
            s.waiting.remove(&group);
        } else {
            s.turns.push_back(group);
        }
        // A waiter that gave up no longer takes it: try the next.
        if next.is_some_and(|tx| tx.send(()).is_ok()) {
            return;
        }
    }
    s.free += 1;
}

impl<G: Eq + Hash> Drop for Slot<G> {
    fn drop(&mut self) {
        release(&self.state);
    }
}

/// A waiter; if it is dropped before it took the slot it may have been granted, the slot is
/// passed on.
struct Waiting<G: Eq + Hash> {
    rx: oneshot::Receiver<()>,
    state: Arc<Mutex<State<G>>>,
    granted: bool,
}

impl<G: Eq + Hash> Drop for Waiting<G> {
    fn drop(&mut self) {
        if self.granted {
            return;
        }
        self.rx.close();
        if self.rx.try_recv().is_ok() {
            release(&self.state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_groups_in_turn() {
        let slots = Arc::new(Slots::new(1));
        let held = slots.acquire("big").await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        // The big pod queues five operations, then the small pod one.
        for (group, i) in [
            ("big", 1),
            ("big", 2),
            ("big", 3),
            ("big", 4),
            ("big", 5),
            ("small", 1),
        ] {
            let (mine, tx) = (slots.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let slot = mine.acquire(group).await;
                tx.send((group, i)).unwrap();
                drop(slot);
            }));
            // Each waiter is queued before the next is spawned.
            while crate::sync::lock(&slots.state)
                .waiting
                .values()
                .map(VecDeque::len)
                .sum::<usize>()
                < tasks.len()
            {
                tokio::task::yield_now().await;
            }
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        let order: Vec<_> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(
            order,
            [
                ("big", 1),
                ("small", 1),
                ("big", 2),
                ("big", 3),
                ("big", 4),
                ("big", 5)
            ],
            "the small pod's operation is second, not sixth"
        );
        assert_eq!(
            crate::sync::lock(&slots.state).free,
            1,
            "every slot came back"
        );
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_passes_its_slot_on() {
        let slots = Arc::new(Slots::new(1));
        let held = slots.acquire(1).await;
        let gone = tokio::spawn({
            let slots = slots.clone();
            async move {
                let _slot = slots.acquire(2).await;
            }
        });
        while crate::sync::lock(&slots.state).turns.is_empty() {
            tokio::task::yield_now().await;
        }
        gone.abort();
        let _ = gone.await;
        drop(held);
        let again = tokio::time::timeout(std::time::Duration::from_secs(10), slots.acquire(3))
            .await
            .expect("the slot is not lost");
        drop(again);
        assert_eq!(crate::sync::lock(&slots.state).free, 1);
    }
}
