//! The concurrency slots of operations. Operations get slots in the order they asked, except
//! that one pod (one volume, for node-wide steps) holds at most a share of them: a pod with
//! thousands of volumes leaves the other slots to pods added meanwhile, which are then served
//! at once instead of after all of its operations. Pods with a few volumes each are served
//! exactly in order, so a burst of them becomes ready pod by pod.

use std::collections::{BTreeMap, VecDeque};

use kubevol_core::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// Whose share an operation counts against: its pod's, or for a node-wide step its volume's.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// A pod's set-up or teardown of one of its volumes.
    Pod(kubevol_core::PodUid),
    /// Attach, mount device, unmount device or detach.
    Volume(kubevol_core::UniqueVolumeName),
}

impl Group {
    /// The group of an operation.
    pub fn of(key: &kubevol_core::reconcile::OperationKey) -> Group {
        match &key.pod {
            Some(p) => Group::Pod(p.clone()),
            None => Group::Volume(key.volume.clone()),
        }
    }
}

struct GroupState {
    /// Slots the group holds.
    held: usize,
    /// Its waiters, oldest first, with their ticket numbers.
    waiting: VecDeque<(u64, oneshot::Sender<()>)>,
    /// Its oldest waiter's place in line, if it waits.
    listed: Option<Place>,
}

/// A place in line: groups under their share first, each part in the order the waiters asked.
type Place = (bool, u64);

struct State<G> {
    free: usize,
    /// How many slots one group may hold before the others' waiters go first.
    share: usize,
    next_ticket: u64,
    groups: HashMap<G, GroupState>,
    /// The oldest waiter of every waiting group, by place: the next to serve is first.
    line: BTreeMap<Place, G>,
}

impl<G: Eq + Hash + Clone> State<G> {
    /// Puts the group's oldest waiter in its place in line (after its share or its waiters
    /// changed).
    fn relist(&mut self, group: &G) {
        let State {
            groups,
            line,
            share,
            ..
        } = self;
        let Some(g) = groups.get_mut(group) else {
            return;
        };
        if let Some(place) = g.listed.take() {
            line.remove(&place);
        }
        if let Some((ticket, _)) = g.waiting.front() {
            let place = (g.held >= *share, *ticket);
            g.listed = Some(place);
            line.insert(place, group.clone());
        }
        if g.held == 0 && g.waiting.is_empty() {
            groups.remove(group);
        }
    }
}

/// Slots shared by every operation.
pub struct Slots<G> {
    state: Arc<Mutex<State<G>>>,
}

/// A held slot; dropping it gives the slot to the next waiter in line.
pub struct Slot<G: Eq + Hash + Clone> {
    state: Arc<Mutex<State<G>>>,
    group: G,
}

impl<G: Eq + Hash + Clone> Slots<G> {
    /// `n` slots (at least one); a group's share is a quarter of them (at least one).
    pub fn new(n: usize) -> Self {
        let n = n.max(1);
        Slots {
            state: Arc::new(Mutex::new(State {
                free: n,
                share: (n / 4).max(1),
                next_ticket: 0,
                groups: HashMap::default(),
                line: BTreeMap::new(),
            })),
        }
    }

    /// Waits for a slot for an operation of `group`. A free slot is taken at once, whatever
    /// the group holds (no slot idles while an operation waits); when none is free, the
    /// operation waits in line.
    pub async fn acquire(&self, group: G) -> Slot<G> {
        let rx = {
            let mut guard = crate::sync::lock(&self.state);
            let s = &mut *guard;
            let g = s.groups.entry(group.clone()).or_insert(GroupState {
                held: 0,
                waiting: VecDeque::new(),
                listed: None,
            });
            if s.free > 0 {
                s.free -= 1;
                g.held += 1;
                return Slot {
                    state: self.state.clone(),
                    group,
                };
            }
            let (tx, rx) = oneshot::channel();
            g.waiting.push_back((s.next_ticket, tx));
            s.next_ticket += 1;
            s.relist(&group);
            rx
        };
        let mut waiting = Waiting {
            rx,
            state: self.state.clone(),
            group: Some(group.clone()),
        };
        // An error would mean the slots were dropped, which cannot happen while `self` lives.
        let _ = (&mut waiting.rx).await;
        waiting.group = None;
        Slot {
            state: self.state.clone(),
            group,
        }
    }
}

/// Gives a freed slot of `from` to the first waiter in line, or keeps it free.
fn release<G: Eq + Hash + Clone>(state: &Mutex<State<G>>, from: &G) {
    let mut guard = crate::sync::lock(state);
    let s = &mut *guard;
    if let Some(g) = s.groups.get_mut(from) {
        g.held = g.held.saturating_sub(1);
    }
    s.relist(from);
    while let Some((_, group)) = s.line.pop_first() {
        let Some(g) = s.groups.get_mut(&group) else {
            continue;
        };
        g.listed = None;
        let Some((_, tx)) = g.waiting.pop_front() else {
            continue;
        };
        // A waiter that gave up no longer takes it: the next one does.
        let granted = tx.send(()).is_ok();
        if granted {
            g.held += 1;
        }
        s.relist(&group);
        if granted {
            return;
        }
    }
    s.free += 1;
}

impl<G: Eq + Hash + Clone> Drop for Slot<G> {
    fn drop(&mut self) {
        release(&self.state, &self.group);
    }
}

/// A waiter; if it is dropped before it took the slot it may have been granted, the slot is
/// passed on.
struct Waiting<G: Eq + Hash + Clone> {
    rx: oneshot::Receiver<()>,
    state: Arc<Mutex<State<G>>>,
    /// Set until the slot is taken.
    group: Option<G>,
}

impl<G: Eq + Hash + Clone> Drop for Waiting<G> {
    fn drop(&mut self) {
        let Some(group) = self.group.take() else {
            return;
        };
        self.rx.close();
        if self.rx.try_recv().is_ok() {
            release(&self.state, &group);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spawns a task per (group, index) that takes a slot, reports, and gives it back when told;
    /// each is queued before the next is spawned.
    async fn queue(
        slots: &Arc<Slots<&'static str>>,
        ops: &[(&'static str, usize)],
    ) -> (
        Vec<tokio::task::JoinHandle<()>>,
        tokio::sync::mpsc::UnboundedReceiver<(&'static str, usize)>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for &(group, i) in ops {
            let (mine, tx) = (slots.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let slot = mine.acquire(group).await;
                tx.send((group, i)).unwrap();
                drop(slot);
            }));
            let queued = |n: usize| {
                crate::sync::lock(&slots.state)
                    .groups
                    .values()
                    .map(|g| g.waiting.len())
                    .sum::<usize>()
                    >= n
            };
            while !queued(tasks.len()) {
                tokio::task::yield_now().await;
            }
        }
        (tasks, rx)
    }

    #[tokio::test]
    async fn in_order_but_no_group_holds_more_than_its_share() {
        // Four slots, a share of one: "big" holds one, so "small" and "a", asking later, get
        // the next slots.
        let slots = Arc::new(Slots::new(4));
        let held: Vec<_> = futures_join(&slots, ["other", "other", "other", "big"]).await;
        let ops = [
            ("big", 1),
            ("big", 2),
            ("big", 3),
            ("small", 1),
            ("a", 1),
            ("a", 2),
        ];
        let (tasks, mut rx) = queue(&slots, &ops).await;
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        let order: Vec<_> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(order.len(), ops.len());
        assert_eq!(
            order[..2],
            [("small", 1), ("a", 1)],
            "groups under their share go before the big one, which holds its share: {order:?}"
        );
        let s = crate::sync::lock(&slots.state);
        assert_eq!(s.free, 4, "every slot came back");
        assert!(s.groups.is_empty() && s.line.is_empty());
    }

    #[tokio::test]
    async fn groups_under_their_share_are_served_first_come_first_served() {
        let slots = Arc::new(Slots::new(8));
        let held: Vec<_> = futures_join(&slots, ["x"; 8]).await;
        let ops = [("p1", 1), ("p1", 2), ("p2", 1), ("p2", 2), ("p3", 1)];
        let (tasks, mut rx) = queue(&slots, &ops).await;
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        let order: Vec<_> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(order, ops, "a burst of small pods is served pod by pod");
    }

    /// Takes one slot per group given (the slots must be free).
    async fn futures_join(
        slots: &Arc<Slots<&'static str>>,
        groups: impl IntoIterator<Item = &'static str>,
    ) -> Vec<Slot<&'static str>> {
        let mut held = Vec::new();
        for g in groups {
            held.push(slots.acquire(g).await);
        }
        held
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_passes_its_slot_on() {
        let slots = Arc::new(Slots::new(1));
        let held = slots.acquire("a").await;
        let gone = tokio::spawn({
            let slots = slots.clone();
            async move {
                let _slot = slots.acquire("b").await;
            }
        });
        while crate::sync::lock(&slots.state).line.is_empty() {
            tokio::task::yield_now().await;
        }
        gone.abort();
        let _ = gone.await;
        drop(held);
        let again = tokio::time::timeout(std::time::Duration::from_secs(10), slots.acquire("c"))
            .await
            .expect("the slot is not lost");
        drop(again);
        assert_eq!(crate::sync::lock(&slots.state).free, 1);
    }
}
