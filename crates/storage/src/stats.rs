//! What a store's writer counts as it commits: groups, their sizes, and
//! the time each group's write and sync took. Lock-free counters the
//! writer bumps and anyone may read at any time (a metrics scrape); they
//! only ever grow while the store is open.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the write-time histogram's buckets, in seconds: from a
/// page-cache write (tens of microseconds) to a disk that stalls.
pub const WRITE_BUCKETS_SECONDS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// Upper bounds of the group-size histogram's buckets, in commits per
/// group (up to [`crate::GROUP_COMMITS_MAX`]).
pub const GROUP_BUCKETS_COMMITS: [f64; 10] =
    [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// A histogram with fixed buckets (cumulative counts, as Prometheus
/// exposes them) and the sum of what it observed.
#[derive(Debug)]
pub struct Histogram<const N: usize> {
    bounds: &'static [f64; N],
    buckets: [AtomicU64; N],
    count: AtomicU64,
    /// The sum, in millionths of the unit (microseconds for seconds).
    sum_micros: AtomicU64,
}

/// A histogram as read at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// Each bucket's upper bound and how many observations were at most it.
    pub buckets: Vec<(f64, u64)>,
    /// Observations in all.
    pub count: u64,
    /// Their sum, in the histogram's unit.
    pub sum: f64,
}

impl HistogramSnapshot {
    /// An empty histogram over `bounds` (ascending), kept by one owner
    /// without atomics (a driver's counters).
    pub fn with_bounds(bounds: &[f64]) -> Self {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]), "bounds ascend");
        HistogramSnapshot {
            buckets: bounds.iter().map(|b| (*b, 0)).collect(),
            count: 0,
            sum: 0.0,
        }
    }

    /// Counts one observation of `value`.
    pub fn observe(&mut self, value: f64) {
        for (bound, n) in &mut self.buckets {
            if value <= *bound {
                *n += 1;
            }
        }
        self.count += 1;
        self.sum += value;
    }

    /// Adds another snapshot with the same bounds (two shards' histograms).
    pub fn merge(&mut self, other: &HistogramSnapshot) {
        if self.buckets.is_empty() {
            self.buckets = other.buckets.clone();
        } else {
            assert_eq!(
                self.buckets.len(),
                other.buckets.len(),
                "histograms merged have the same bounds"
            );
            for (mine, theirs) in self.buckets.iter_mut().zip(&other.buckets) {
                mine.1 += theirs.1;
            }
        }
        self.count += other.count;
        self.sum += other.sum;
    }
}

impl<const N: usize> Histogram<N> {
    /// An empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64; N]) -> Self {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]), "bounds ascend");
        Histogram {
            bounds,
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    /// Counts one observation of `value` (in the histogram's unit).
    pub fn observe(&self, value: f64) {
        for (bound, bucket) in self.bounds.iter().zip(&self.buckets) {
            if value <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((value * 1e6) as u64, Ordering::Relaxed);
    }

    /// Counts one observed duration, in seconds.
    pub fn observe_duration(&self, took: Duration) {
        self.observe(took.as_secs_f64());
    }

    /// What it holds now.
    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            buckets: self
                .bounds
                .iter()
                .zip(&self.buckets)
                .map(|(b, n)| (*b, n.load(Ordering::Relaxed)))
                .collect(),
            count: self.count.load(Ordering::Relaxed),
            sum: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

/// What a store's writer counted.
#[derive(Debug)]
pub struct WriterStats {
    /// Commits accepted (validated and written).
    commits: AtomicU64,
    /// Commits refused (a duplicate id, a fenced owner, an unwritable
    /// store): nothing of them was written.
    refused: AtomicU64,
    /// Commits per group written.
    group_commits: Histogram<{ GROUP_BUCKETS_COMMITS.len() }>,
    /// Time to write one group and make it durable (with `Sync`
    /// durability that includes the fsync; on PostgreSQL the
    /// transaction's round trips and its WAL flush).
    write_seconds: Histogram<{ WRITE_BUCKETS_SECONDS.len() }>,
    /// Nanoseconds the writer waited for a commit with none queued: from
    /// the end of a group after which nothing was queued to the start of
    /// the next, whichever thread commits it.
    idle_nanos: AtomicU64,
    /// Nanoseconds the writer spent validating groups against the store
    /// (reads and checks) before writing them.
    validate_nanos: AtomicU64,
    /// Estimated bytes in the writer's cache (`WriterCache::bytes`) after
    /// its last group.
    cache_bytes: AtomicU64,
}

impl Default for WriterStats {
    fn default() -> Self {
        WriterStats {
            commits: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            group_commits: Histogram::new(&GROUP_BUCKETS_COMMITS),
            write_seconds: Histogram::new(&WRITE_BUCKETS_SECONDS),
            idle_nanos: AtomicU64::new(0),
            validate_nanos: AtomicU64::new(0),
            cache_bytes: AtomicU64::new(0),
        }
    }
}

/// What a store holds in memory, by part (see `Store::memory`); a part the
/// backend does not have is 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreMemory {
    /// Writes not yet flushed to table files (RocksDB's memtables),
    /// bounded by `rocks::MEMTABLES_BYTES_MAX`.
    pub memtables_bytes: u64,
    /// Index and filter blocks of open table files, held outside the
    /// block cache.
    pub table_readers_bytes: u64,
    /// Table blocks cached for reads, bounded by
    /// `rocks::BLOCK_CACHE_BYTES_MAX`.
    pub block_cache_bytes: u64,
    /// The writer's cache of what it wrote, estimated
    /// (`cache::WriterCache::bytes`), bounded by its row limits.
    pub writer_cache_bytes: u64,
}

impl StoreMemory {
    /// Every part together.
    pub fn total_bytes(&self) -> u64 {
        self.memtables_bytes
            + self.table_readers_bytes
            + self.block_cache_bytes
            + self.writer_cache_bytes
    }
}

/// [`WriterStats`] as read at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WriterSnapshot {
    /// Commits accepted.
    pub commits: u64,
    /// Commits refused.
    pub refused: u64,
    /// Commits per group written.
    pub group_commits: HistogramSnapshot,
    /// Seconds per group's write and sync.
    pub write_seconds: HistogramSnapshot,
    /// Seconds the writer waited for a commit with none queued (counted
    /// by the RocksDB writer; 0 on other stores).
    pub idle_seconds: f64,
    /// Seconds the writer spent validating groups before writing them
    /// (counted by the RocksDB writer; 0 on other stores).
    pub validate_seconds: f64,
    /// Estimated bytes the writer keeps of what it wrote
    /// (`cache::WriterCache::bytes`).
    pub cache_bytes: u64,
}

impl WriterStats {
    /// One group written (or tried): `accepted` and `refused` commits, the
    /// write (and sync) taking `took`. A group with nothing to write (all
    /// refused) counts no write time.
    pub fn group(&self, accepted: usize, refused: usize, took: Option<Duration>) {
        self.commits.fetch_add(accepted as u64, Ordering::Relaxed);
        self.refused.fetch_add(refused as u64, Ordering::Relaxed);
        if let Some(took) = took {
            self.group_commits.observe((accepted + refused) as f64);
            self.write_seconds.observe_duration(took);
        }
    }

    /// The writer waited `took` for a commit, none being queued.
    pub fn idle(&self, took: Duration) {
        self.idle_nanos
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// The writer validated a group in `took`.
    pub fn validated(&self, took: Duration) {
        self.validate_nanos
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// The writer's cache holds an estimated `bytes` now.
    pub fn cache_holds(&self, bytes: usize) {
        self.cache_bytes.store(bytes as u64, Ordering::Relaxed);
    }

    /// What it holds now.
    pub fn snapshot(&self) -> WriterSnapshot {
        WriterSnapshot {
            commits: self.commits.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            group_commits: self.group_commits.snapshot(),
            write_seconds: self.write_seconds.snapshot(),
            idle_seconds: self.idle_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            validate_seconds: self.validate_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            cache_bytes: self.cache_bytes.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the histogram's buckets are cumulative (an observation counts
    // in every bucket whose bound it does not exceed), as the Prometheus
    // text format expects, and the sum keeps microseconds.
    #[test]
    fn buckets_are_cumulative_and_the_sum_adds_up() {
        let h = Histogram::new(&WRITE_BUCKETS_SECONDS);
        h.observe_duration(Duration::from_micros(300));
        h.observe_duration(Duration::from_millis(3));
        h.observe_duration(Duration::from_secs(10));
        let s = h.snapshot();
        assert_eq!(s.count, 3);
        assert!((s.sum - 10.0033).abs() < 1e-9, "{}", s.sum);
        let at = |bound: f64| s.buckets.iter().find(|(b, _)| *b == bound).unwrap().1;
        assert_eq!(at(0.00025), 0);
        assert_eq!(at(0.0005), 1);
        assert_eq!(at(0.005), 2);
        assert_eq!(at(2.5), 2, "10 s is only in +Inf, which is the count");
    }

    // Goal: merging two shards' snapshots adds bucket by bucket.
    #[test]
    fn snapshots_merge_bucket_by_bucket() {
        let a = Histogram::new(&GROUP_BUCKETS_COMMITS);
        let b = Histogram::new(&GROUP_BUCKETS_COMMITS);
        a.observe(1.0);
        b.observe(3.0);
        b.observe(100.0);
        let mut m = HistogramSnapshot::default();
        m.merge(&a.snapshot());
        m.merge(&b.snapshot());
        assert_eq!(m.count, 3);
        assert_eq!(m.buckets[0], (1.0, 1));
        assert_eq!(m.buckets[2], (4.0, 2));
        assert_eq!(m.buckets[7], (128.0, 3));
        assert_eq!(m.sum, 104.0);
    }
}
