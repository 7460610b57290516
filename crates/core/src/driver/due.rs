//! What a shard must do at a later time: fire a timer, dispatch a task at
//! its backoff, check a lease, retry a delivery. Ordered by (time, order of
//! insertion), so two hosts that feed the same inputs see the same order.
//!
//! Entries are not removed when their reason goes away (a timer cancelled,
//! a lease renewed, an attempt finished); each is checked against the
//! shard's state when it comes due, and dropped if it no longer applies.
//! So that stale entries do not pile up (every attempt leaves a lease
//! check behind, due a lease's length later), the queue is swept of those
//! that can never apply again whenever it has doubled since the last sweep
//! or since it was last that small ([`DueQueue::wants_sweep`]): stale lease
//! checks stay within about as many as the entries live, plus
//! [`DUE_SWEEP_ENTRIES_MIN`], instead of following the attempts of the
//! last lease's length. (Dispatches and start deadlines of attempts not in
//! memory are kept until due: their run may come back.)

use std::collections::BTreeMap;

use keel_storage::{AttemptNo, LeaseEpoch, RunId, Step, Timestamp};

use super::AttemptKey;

/// One thing due.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Due {
    /// A durable timer fires.
    Timer(RunId, Step),
    /// A pending attempt is due (first dispatch, a retry's backoff, a
    /// profile's refusal over).
    Task(AttemptKey, AttemptNo),
    /// A lease may have ended.
    Lease(AttemptKey, LeaseEpoch),
    /// An attempt's schedule-to-start limit.
    StartDeadline(AttemptKey, AttemptNo),
    /// An attempt's result is reported again (its commit failed).
    Report(AttemptKey, AttemptNo),
    /// An outbox message is delivered again.
    Outbox(Vec<u8>),
    /// An outbox delivery's answer is overdue.
    OutboxAnswer(Vec<u8>, super::Token),
    /// Whether the oldest commit in flight has gone unanswered too long
    /// (see `Shard::check_stall`).
    CommitStall,
    /// A run's activation is tried again (an async child whose closure its
    /// parent has not bound yet).
    Activate(RunId),
    /// A run's intent rows are read again (the store was out of reach);
    /// whether it was resumed (see [`super::ReadFor::RunIntents`]).
    Intents(RunId, bool),
    /// Whether a continue-as-new's next run exists is checked again.
    Continuation(super::Token),
    /// A start is decided again (another run held its instance).
    Start(Box<super::requests::StartJob>),
    /// The shard's lease is to be renewed, or has ended.
    ShardLease,
}

/// Entries below which the queue is never swept.
pub const DUE_SWEEP_ENTRIES_MIN: usize = 4096;

#[derive(Debug, Default)]
pub(super) struct DueQueue {
    queue: BTreeMap<(Timestamp, u64), Due>,
    next: u64,
    /// Entries left by the last sweep.
    swept_to: usize,
}

impl DueQueue {
    pub(super) fn push(&mut self, at: Timestamp, due: Due) {
        self.next += 1;
        self.queue.insert((at, self.next), due);
    }

    /// The earliest due time.
    pub(super) fn next(&self) -> Option<Timestamp> {
        self.queue.keys().next().map(|(t, _)| *t)
    }

    /// Removes and returns, in due order, the entries `take` picks (a
    /// stopping shard's starts: answered instead of decided).
    pub(super) fn take_where(&mut self, take: impl Fn(&Due) -> bool) -> Vec<Due> {
        let keys: Vec<(Timestamp, u64)> = self
            .queue
            .iter()
            .filter(|(_, due)| take(due))
            .map(|(k, _)| *k)
            .collect();
        keys.iter().filter_map(|k| self.queue.remove(k)).collect()
    }

    /// Entries held.
    pub(super) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether the queue has doubled (and holds at least
    /// [`DUE_SWEEP_ENTRIES_MIN`]) since it was last swept.
    pub(super) fn wants_sweep(&self) -> bool {
        self.queue.len() >= DUE_SWEEP_ENTRIES_MIN.max(2 * self.swept_to)
    }

    /// Drops the entries `applies` says can never apply again; the rest
    /// keep their order. Sweeping only removes what would have been
    /// dropped when it came due, so it changes no decision (the shard's
    /// `applies` keeps what a break mode could bring back).
    pub(super) fn sweep(&mut self, mut applies: impl FnMut(&Due) -> bool) {
        self.queue.retain(|_, due| applies(due));
        self.swept_to = self.queue.len();
    }

    /// The earliest entry due at or before `now`.
    pub(super) fn pop(&mut self, now: Timestamp) -> Option<Due> {
        let entry = self.queue.first_entry()?;
        if entry.key().0 > now {
            return None;
        }
        let due = entry.remove();
        self.swept_to = self.swept_to.min(self.queue.len());
        Some(due)
    }
}
