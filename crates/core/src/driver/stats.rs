//! What a shard's driver counted since it started, and what it holds now:
//! the engine's metrics. Counting is bookkeeping like the rest of the
//! driver: no clock is read (a timer's lag is the difference of two times
//! the host fed it), so the simulator counts the same way the engine does.

use std::collections::BTreeMap;

use keel_storage::stats::HistogramSnapshot;

use super::Shard;

/// Upper bounds of the timer-lag histogram's buckets, in seconds: from
/// on time to a shard that was down for minutes.
pub const TIMER_LAG_BUCKETS_SECONDS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 300.0,
];

/// Most distinct resilience policy names counted apart; rejections by
/// further names are counted under `other`, so counting cannot grow
/// memory without bound.
pub const REJECTION_POLICIES_MAX: usize = 64;

/// A shard's counters (since its driver started) and gauges (now).
#[derive(Clone, Debug, PartialEq)]
pub struct ShardStats {
    /// Commits asked of the store.
    pub commits: u64,
    /// Commits the store answered with an error.
    pub commits_failed: u64,
    /// Inputs a run accepted, by kind (`start`, `signal`,
    /// `activity_completed`...).
    pub inputs: BTreeMap<&'static str, u64>,
    /// Inputs a run already had (a redelivered result, a repeated signal
    /// or start): answered, nothing committed.
    pub duplicates_dropped: u64,
    /// Attempts ended, by outcome (`completed`, `failed`, `cancelled`,
    /// `timed_out`, `lease_expired`).
    pub attempts: BTreeMap<&'static str, u64>,
    /// Deliveries whose lease ended without a result.
    pub lease_expiries: u64,
    /// Deliveries of an attempt after its first (a lease ended, a worker
    /// process died).
    pub redeliveries: u64,
    /// Runs dropped from memory (an idle run, a full cache).
    pub passivations: u64,
    /// Histories read to bring a run into memory by replay (open or
    /// parked). A closed run is not replayed: its run record answers (see
    /// `ReadQuery::Activation`).
    pub activations: u64,
    /// Seconds from a timer's due time to the commit of its firing.
    pub timer_lag_seconds: HistogramSnapshot,
    /// Copies a resilience policy refused before they ran, by policy.
    pub rejections: BTreeMap<String, u64>,
    /// Runs held in memory now.
    pub runs_cached: u64,
    /// Attempts supervised now (waiting, queued, running).
    pub attempts_supervised: u64,
    /// Outbox rows not yet delivered.
    pub outbox_backlog: u64,
    /// Timers held in memory now: the window of the soonest due (the
    /// rest wait in the store; see `TIMERS_IN_MEMORY_MAX`).
    pub timers_armed: u64,
    /// Later checks held now (dispatches at a backoff, lease checks,
    /// redeliveries, retries): what is live plus stale entries not yet
    /// swept (see `DUE_SWEEP_ENTRIES_MIN`).
    pub due_entries: u64,
}

impl Default for ShardStats {
    fn default() -> Self {
        ShardStats {
            commits: 0,
            commits_failed: 0,
            inputs: BTreeMap::new(),
            duplicates_dropped: 0,
            attempts: BTreeMap::new(),
            lease_expiries: 0,
            redeliveries: 0,
            passivations: 0,
            activations: 0,
            timer_lag_seconds: HistogramSnapshot::with_bounds(&TIMER_LAG_BUCKETS_SECONDS),
            rejections: BTreeMap::new(),
            runs_cached: 0,
            attempts_supervised: 0,
            outbox_backlog: 0,
            timers_armed: 0,
            due_entries: 0,
        }
    }
}

impl ShardStats {
    /// Adds another shard's numbers (the engine sums its shards).
    pub fn merge(&mut self, other: &ShardStats) {
        self.commits += other.commits;
        self.commits_failed += other.commits_failed;
        for (k, n) in &other.inputs {
            *self.inputs.entry(k).or_default() += n;
        }
        self.duplicates_dropped += other.duplicates_dropped;
        for (k, n) in &other.attempts {
            *self.attempts.entry(k).or_default() += n;
        }
        self.lease_expiries += other.lease_expiries;
        self.redeliveries += other.redeliveries;
        self.passivations += other.passivations;
        self.activations += other.activations;
        self.timer_lag_seconds.merge(&other.timer_lag_seconds);
        for (k, n) in &other.rejections {
            *self.rejections.entry(k.clone()).or_default() += n;
        }
        self.runs_cached += other.runs_cached;
        self.attempts_supervised += other.attempts_supervised;
        self.outbox_backlog += other.outbox_backlog;
        self.timers_armed += other.timers_armed;
        self.due_entries += other.due_entries;
    }

    pub(super) fn input(&mut self, kind: &'static str) {
        *self.inputs.entry(kind).or_default() += 1;
    }

    pub(super) fn attempt_ended(&mut self, outcome: &'static str) {
        *self.attempts.entry(outcome).or_default() += 1;
    }

    pub(super) fn rejected(&mut self, policy: &str) {
        let key = if self.rejections.len() < REJECTION_POLICIES_MAX
            || self.rejections.contains_key(policy)
        {
            policy.to_string()
        } else {
            "other".to_string()
        };
        *self.rejections.entry(key).or_default() += 1;
    }
}

impl Shard {
    /// What this shard counted and holds now.
    pub fn stats(&self) -> ShardStats {
        let mut s = self.stats.clone();
        s.runs_cached = self.runs.len() as u64;
        s.attempts_supervised = self.attempts.len() as u64;
        s.outbox_backlog = self.outbox.len() as u64;
        s.timers_armed = self.timers.len() as u64;
        s.due_entries = self.due.len() as u64;
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: policy names past the limit are counted under `other`, so a
    // caller minting names cannot grow the shard's memory.
    #[test]
    fn rejections_past_the_name_limit_count_as_other() {
        let mut s = ShardStats::default();
        for i in 0..REJECTION_POLICIES_MAX + 10 {
            s.rejected(&format!("p{i}"));
        }
        s.rejected("p0");
        assert_eq!(s.rejections.len(), REJECTION_POLICIES_MAX + 1);
        assert_eq!(s.rejections["other"], 10);
        assert_eq!(s.rejections["p0"], 2);
    }
}
