//! The durable timers a shard holds in memory: a window of its timer rows
//! in the store's order (due time, run, step), never the whole table.
//!
//! Every timer row is durable before the shard learns of it, so memory
//! needs only the ones due soonest. Rows up to the *horizon* are in
//! memory; rows past it stay in the store until the shard reads the next
//! window, shortly before the horizon comes due. A commit that arms a
//! timer past the horizon leaves it to that read; when memory holds more
//! than twice the window, the latest ones are dropped from memory and the
//! horizon moves down to the last one kept. So memory follows the window
//! (`timers_in_memory_max`), not the number of timers: a restart over a
//! million timers reads one window, not a million rows.
//!
//! A window read races commits: a timer armed past the horizon while the
//! read is in flight may be missing from what it read, so it is noted and
//! armed once the read's new horizon is known. (Rows removed while it is
//! in flight are filtered by the shard, as for every intent read.)

use std::collections::{BTreeMap, BTreeSet};

use keel_storage::{RunId, Step, TimerEntry, Timestamp};

/// A timer's place in the store's order.
pub(super) type TimerKey = (Timestamp, RunId, Step);

/// How much of the store's timer rows memory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Horizon {
    /// Every row (no window was ever cut).
    Everything,
    /// Every row up to this key, none after it.
    Upto(TimerKey),
    /// None yet: the first window (recovery) is being read.
    Nothing,
}

impl Horizon {
    fn holds(&self, key: &TimerKey) -> bool {
        match self {
            Horizon::Everything => true,
            Horizon::Upto(h) => key <= h,
            Horizon::Nothing => false,
        }
    }
}

#[derive(Debug)]
pub(super) struct Timers {
    /// Timers in memory (waiting, or fired and not yet answered): their
    /// fire time.
    fire_at: BTreeMap<(RunId, Step), Timestamp>,
    /// Timers in memory not yet fired, in the store's order.
    waiting: BTreeSet<TimerKey>,
    horizon: Horizon,
    /// A window read is in flight.
    reading: bool,
    /// Timers armed past the horizon while a window read was in flight:
    /// their fire time.
    armed_while_reading: BTreeMap<(RunId, Step), Timestamp>,
    /// After a failed window read, the next is not tried before this.
    retry_at: Timestamp,
    /// The window: rows one read brings in; memory holds at most twice it.
    limit: usize,
}

impl Timers {
    pub(super) fn new(limit: usize) -> Self {
        assert!(limit > 0, "a timer window holds at least one timer");
        Timers {
            fire_at: BTreeMap::new(),
            waiting: BTreeSet::new(),
            horizon: Horizon::Everything,
            reading: false,
            armed_while_reading: BTreeMap::new(),
            retry_at: Timestamp(0),
            limit,
        }
    }

    /// The rows one window read asks for.
    pub(super) fn window_rows(&self) -> usize {
        self.limit
    }

    /// Timers in memory.
    pub(super) fn len(&self) -> usize {
        self.fire_at.len()
    }

    /// The fire time of a timer in memory.
    pub(super) fn fire_at(&self, run: RunId, step: Step) -> Option<Timestamp> {
        self.fire_at.get(&(run, step)).copied()
    }

    /// A timer whose row is durable. Held in memory if it is within the
    /// horizon; otherwise a window read brings it in later. Arming one
    /// memory holds already changes nothing.
    pub(super) fn arm(&mut self, run: RunId, step: Step, fire_at: Timestamp) {
        let key = (fire_at, run, step);
        if self.fire_at.get(&(run, step)) == Some(&fire_at) {
            return;
        }
        if !self.horizon.holds(&key) {
            if self.reading {
                self.armed_while_reading.insert((run, step), fire_at);
            }
            return;
        }
        if let Some(old) = self.fire_at.insert((run, step), fire_at) {
            self.waiting.remove(&(old, run, step));
        }
        self.waiting.insert(key);
        self.trim();
    }

    /// Forgets a timer (its row was removed, or its firing was answered).
    pub(super) fn remove(&mut self, run: RunId, step: Step) {
        if let Some(at) = self.fire_at.remove(&(run, step)) {
            self.waiting.remove(&(at, run, step));
        }
        self.armed_while_reading.remove(&(run, step));
    }

    /// When the next waiting timer is due.
    pub(super) fn next_due(&self) -> Option<Timestamp> {
        self.waiting.first().map(|(at, _, _)| *at)
    }

    /// The next waiting timer due at or before `now`, now fired: it stays
    /// in memory until its firing is answered.
    pub(super) fn pop_due(&mut self, now: Timestamp) -> Option<(RunId, Step)> {
        let (at, _, _) = self.waiting.first()?;
        if *at > now {
            return None;
        }
        self.waiting.pop_first().map(|(_, run, step)| (run, step))
    }

    /// When the next window is to be read: `lead_ms` before the horizon
    /// comes due (at once when nothing is held), not before a failed
    /// read's retry time; never while a read is in flight or when memory
    /// holds every row, nor while memory holds more than a window of
    /// waiting timers or of fired ones not yet answered (a backlog of
    /// overdue timers comes in a window at a time, as the last is done).
    pub(super) fn window_at(&self, lead_ms: u64) -> Option<Timestamp> {
        let fired = self.fire_at.len() - self.waiting.len();
        if self.reading || self.waiting.len() > self.limit || fired >= self.limit {
            return None;
        }
        let at = match self.horizon {
            Horizon::Everything => return None,
            Horizon::Upto(h) => Timestamp(h.0 .0.saturating_sub(lead_ms)),
            Horizon::Nothing => Timestamp(0),
        };
        Some(at.max(self.retry_at))
    }

    /// Whether the next window should be read at `now` (see
    /// [`Timers::window_at`]); if so the read is taken as started and its
    /// query's `after` is returned.
    pub(super) fn start_window(
        &mut self,
        now: Timestamp,
        lead_ms: u64,
    ) -> Option<Option<TimerKey>> {
        if self.window_at(lead_ms)? > now {
            return None;
        }
        self.reading = true;
        Some(match self.horizon {
            Horizon::Upto(h) => Some(h),
            Horizon::Everything | Horizon::Nothing => None,
        })
    }

    /// Recovery: nothing is held until the first window is read.
    pub(super) fn start_recovery(&mut self) -> Option<TimerKey> {
        self.horizon = Horizon::Nothing;
        self.reading = true;
        None
    }

    /// A window read failed: the next try, not before `retry_at`, reads
    /// from the same place and sees every timer armed meanwhile (their
    /// rows are durable).
    pub(super) fn window_failed(&mut self, retry_at: Timestamp) {
        self.reading = false;
        self.retry_at = retry_at;
        self.armed_while_reading.clear();
        self.trim();
    }

    /// A window read answered `rows` (in the store's order, without rows
    /// removed while it was in flight); `last` is the last row it read,
    /// removed or not, when it stopped at its limit (the store may hold
    /// more), `None` when it read to the end.
    pub(super) fn window_read(&mut self, rows: Vec<TimerEntry>, last: Option<TimerKey>) {
        self.reading = false;
        self.horizon = last.map_or(Horizon::Everything, Horizon::Upto);
        for t in rows {
            self.arm(t.run_id, t.step, t.fire_at);
        }
        for ((run, step), at) in std::mem::take(&mut self.armed_while_reading) {
            self.arm(run, step, at);
        }
        self.trim();
    }

    /// Over twice the window in memory: drops the latest waiting timers
    /// down to the window and moves the horizon to the last one kept. Not
    /// while a read is in flight: its answer sets the horizon past rows
    /// dropped now, which would then never be read again.
    fn trim(&mut self) {
        if self.reading || self.waiting.len() <= self.limit.saturating_mul(2) {
            return;
        }
        while self.waiting.len() > self.limit {
            if let Some((_, run, step)) = self.waiting.pop_last() {
                self.fire_at.remove(&(run, step));
            }
        }
        if let Some(last) = self.waiting.last() {
            self.horizon = Horizon::Upto(*last);
        }
    }
}

#[cfg(test)]
mod tests {
    // Goal: memory holds at most twice the window of waiting timers
    // however many are armed, and every timer row fires exactly once, in
    // the store's order, with the window reads a shard makes in between:
    // including timers armed past the horizon, rows removed (cancelled),
    // and reads failing, while a read is in flight, and firings answered
    // late. Method: a model store (a sorted set of rows) and a model of
    // the shard around `Timers`, driven by random steps from fixed seeds;
    // a read is answered from the model when it starts (the worst case for
    // the race) and delivered later without the rows removed meanwhile,
    // as the shard filters them.
    use super::*;

    fn run(n: u64) -> RunId {
        RunId::from_u64_pair(n, n)
    }

    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// A read in flight: the rows it saw, and the last one when it
    /// stopped at its limit.
    type Read = (Vec<TimerEntry>, Option<TimerKey>);

    struct Model {
        store: BTreeSet<TimerKey>,
        t: Timers,
        now: Timestamp,
        limit: usize,
        read: Option<Read>,
        removed_while_reading: BTreeSet<(RunId, Step)>,
        /// Fired, not yet answered.
        firing: Vec<TimerKey>,
        fired: Vec<TimerKey>,
    }

    impl Model {
        fn start_read(&mut self, after: Option<TimerKey>) {
            let rows: Vec<TimerEntry> = self
                .store
                .iter()
                .filter(|k| after.is_none_or(|a| **k > a))
                .take(self.limit)
                .map(|&(fire_at, run_id, step)| TimerEntry {
                    run_id,
                    step,
                    fire_at,
                })
                .collect();
            let last = match rows.last() {
                Some(t) if rows.len() == self.limit => Some((t.fire_at, t.run_id, t.step)),
                _ => None,
            };
            self.read = Some((rows, last));
        }

        fn deliver(&mut self, fail: bool) {
            let Some((rows, last)) = self.read.take() else {
                return;
            };
            if fail {
                self.t.window_failed(Timestamp(self.now.0 + 3));
            } else {
                let rows = rows
                    .into_iter()
                    .filter(|r| !self.removed_while_reading.contains(&(r.run_id, r.step)))
                    .collect();
                self.t.window_read(rows, last);
            }
            self.removed_while_reading.clear();
        }

        /// A commit removes a row (a cancel, or a firing's commit).
        fn remove(&mut self, key: TimerKey) {
            self.store.remove(&key);
            if self.read.is_some() {
                self.removed_while_reading.insert((key.1, key.2));
            }
            self.t.remove(key.1, key.2);
        }

        fn tick(&mut self, by: u64) {
            self.now = Timestamp(self.now.0 + by);
            while let Some((r, s)) = self.t.pop_due(self.now) {
                let at = self.t.fire_at(r, s).expect("a fired timer is in memory");
                assert!(at <= self.now, "fired early");
                assert!(self.store.contains(&(at, r, s)), "fired a removed row");
                assert!(!self.fired.contains(&(at, r, s)), "fired twice");
                self.fired.push((at, r, s));
                self.firing.push((at, r, s));
            }
            if self.read.is_none() {
                if let Some(after) = self.t.start_window(self.now, 10) {
                    self.start_read(after);
                }
            }
        }
    }

    #[test]
    fn memory_follows_the_window_and_every_timer_fires_once_in_order() {
        for seed in 1..=40u64 {
            let limit = 1 + (seed % 5) as usize;
            let mut rng = Rng(seed * 7919);
            let mut m = Model {
                store: BTreeSet::new(),
                t: Timers::new(limit),
                now: Timestamp(0),
                limit,
                read: None,
                removed_while_reading: BTreeSet::new(),
                firing: Vec::new(),
                fired: Vec::new(),
            };
            // Recovery over rows written before the shard started.
            for i in 0..rng.below(30) {
                m.store
                    .insert((Timestamp(1 + rng.below(500)), run(i), Step(1)));
            }
            let after = m.t.start_recovery();
            m.start_read(after);
            let mut cancelled = 0;
            let mut next_run = 1000;
            for _ in 0..4000 {
                match rng.below(8) {
                    0 | 1 => {
                        // A commit arms a timer (its row durable first).
                        let key = (
                            Timestamp(m.now.0 + 1 + rng.below(400)),
                            run(next_run),
                            Step(2),
                        );
                        next_run += 1;
                        m.store.insert(key);
                        m.t.arm(key.1, key.2, key.0);
                    }
                    2 => {
                        // A commit cancels a row, in memory or not.
                        let n = m.store.len() as u64;
                        if n > 0 {
                            let key = *m.store.iter().nth(rng.below(n) as usize).expect("a row");
                            if !m.firing.contains(&key) {
                                m.remove(key);
                                cancelled += 1;
                            }
                        }
                    }
                    3 => {
                        let fail = rng.below(5) == 0;
                        m.deliver(fail);
                    }
                    4 => {
                        // A firing is answered: its commit removed the row.
                        if !m.firing.is_empty() {
                            let key = m.firing.remove(rng.below(m.firing.len() as u64) as usize);
                            m.remove(key);
                        }
                    }
                    _ => {
                        let by = rng.below(5);
                        m.tick(by);
                    }
                }
                assert!(
                    m.t.reading || m.t.waiting.len() <= 2 * limit,
                    "seed {seed}: {} waiting over a window of {limit}",
                    m.t.waiting.len()
                );
            }
            // Drain: time passes, reads and firings are answered, until
            // every row has fired.
            for _ in 0..100_000 {
                if m.store.is_empty() {
                    break;
                }
                m.deliver(false);
                for key in std::mem::take(&mut m.firing) {
                    m.remove(key);
                }
                m.tick(1);
            }
            assert!(
                m.store.is_empty(),
                "seed {seed}: {} timers never fired",
                m.store.len()
            );
            assert!(
                m.fired.windows(2).all(|w| w[0] < w[1]),
                "seed {seed}: fired out of the store's order"
            );
            assert!(
                cancelled > 0 && m.fired.len() > 100,
                "seed {seed}: the steps did too little"
            );
        }
    }
}
