//! What a store's only writer knows from its own writes, so that validating
//! a commit rarely has to ask the store.
//!
//! Every commit is validated against the store (`derive`): it reads its
//! run's record, looks for each terminal event's durable id in `dedupe`
//! (almost always absent), reads the pending attempt a result answers, and
//! a close scans the run's attempts, timers, children and sends. On RocksDB
//! those are memtable searches; on PostgreSQL each is a round trip, which
//! made reads, not writes, the writer's bottleneck. A store's writer is the
//! only writer of its data (RocksDB's exclusive open, PostgreSQL's fenced
//! write lease), so what it wrote is exactly what the store would return:
//!
//! - `records`: the `runs` and `instances` records as last written,
//!   including a run record's rewrites the store leaves out
//!   ([`crate::kv::KvWrite::put_derivable`]), so a record kept here is
//!   current and one read from the store is caught up first; a run's
//!   record leaves with the commit that closes the run.
//! - `born`: for runs this writer created, every row they own in
//!   [`OWNED_CFS`] (all of them were written by this writer, after the
//!   run's first event), with its value. A read of such a row, present or
//!   absent, and a scan of such a run's prefix are answered from memory.
//!   A run leaves `born` when it closes.
//!
//! Facts are learned only after their write succeeded; a failed write, or
//! one whose outcome is unknown, forgets everything, and anything not known
//! is read from the store. Both parts are bounded
//! ([`WRITER_CACHE_RECORDS_MAX`], [`WRITER_CACHE_ROWS_MAX`]) and start over
//! when full.

use std::collections::{BTreeMap, HashMap};

use crate::derive::PreparedBatch;
use crate::error::Result;
use crate::event::EventKind;
use crate::ids::{RunId, Seq};
use crate::keys::{self, Cf};
use crate::kv::{KvRead, Writes};

/// Most `runs` and `instances` records the writer keeps.
pub const WRITER_CACHE_RECORDS_MAX: usize = 16_384;

/// Most rows of runs born here the writer keeps, over all such runs.
pub const WRITER_CACHE_ROWS_MAX: usize = 65_536;

/// Largest record or row value the writer keeps (a closed run's record
/// holds its result and is rarely read again by the writer).
pub const WRITER_CACHE_VALUE_BYTES_MAX: usize = 1024;

/// What one kept entry costs beyond its key and value bytes, as counted
/// by [`WriterCache::bytes`]: the map slot (a family, two vectors' heads),
/// the allocator's header and rounding of two allocations, and the slack
/// of a hash table or B-tree node. An estimate, checked against the
/// process's growth by `keel bench w2`.
pub const WRITER_CACHE_ENTRY_OVERHEAD_BYTES: usize = 96;

/// The families whose rows belong to one run by their key, and are only
/// ever written after that run's first event: `dedupe`, `tasks`,
/// `run_timers` and `children` (`run ‖ ...`), and the sends a run makes
/// from its outbox (`'S' ‖ run ‖ step`, `'D' ‖ run ‖ step`).
pub const OWNED_CFS: [Cf; 5] = [
    Cf::Dedupe,
    Cf::Tasks,
    Cf::RunTimers,
    Cf::Children,
    Cf::Outbox,
];

/// The run that owns `key` in `cf`, if the family is one of [`OWNED_CFS`]
/// and the key is long enough to name it.
fn owner(cf: Cf, key: &[u8]) -> Option<[u8; 16]> {
    match cf {
        Cf::Dedupe | Cf::Tasks | Cf::RunTimers | Cf::Children => key.get(..16)?.try_into().ok(),
        Cf::Outbox if matches!(key.first(), Some(b'S' | b'D')) => key.get(1..17)?.try_into().ok(),
        _ => None,
    }
}

/// Rows read ahead for a group: found (`Some`) or known absent (`None`).
pub type ReadAhead = HashMap<(Cf, Vec<u8>), Option<Vec<u8>>>;

/// Prefix scans read ahead for a group, whole: (family, prefix) → every
/// row under the prefix, in key order.
pub type ScanAhead = HashMap<(Cf, Vec<u8>), Vec<(Vec<u8>, Vec<u8>)>>;

/// The families a run's close scans by the run's prefix (its attempts,
/// timers and children are dropped or given their close policy).
pub const CLOSE_SCANNED_CFS: [Cf; 3] = [Cf::Tasks, Cf::RunTimers, Cf::Children];

/// The cache's hashing: seeded per process like the standard library's (run
/// and instance ids come from users), at a fraction of SipHash's cost, which
/// was a visible part of the writer's validation.
type Hashing = foldhash::fast::RandomState;

/// The rows of one run born here: (family, key) → value.
type OwnedRows = BTreeMap<(Cf, Vec<u8>), Vec<u8>>;

/// See the module documentation.
#[derive(Default)]
pub struct WriterCache {
    records: HashMap<(Cf, Vec<u8>), Vec<u8>, Hashing>,
    born: HashMap<[u8; 16], OwnedRows, Hashing>,
    rows: usize,
    /// Estimated bytes of `records` and of `born` (see [`Self::bytes`]).
    records_bytes: usize,
    born_bytes: usize,
}

/// The estimated cost of keeping `key` → `value`.
fn entry_bytes(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + WRITER_CACHE_ENTRY_OVERHEAD_BYTES
}

/// The estimated cost of one run's rows, the run's own entry included.
fn rows_bytes(rows: &OwnedRows) -> usize {
    WRITER_CACHE_ENTRY_OVERHEAD_BYTES
        + rows
            .iter()
            .map(|((_, k), v)| entry_bytes(k, v))
            .sum::<usize>()
}

impl std::fmt::Debug for WriterCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriterCache")
            .field("records", &self.records.len())
            .field("born", &self.born.len())
            .field("rows", &self.rows)
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// One write: (family, key) and the new value (`None`: deleted).
type Write = ((Cf, Vec<u8>), Option<Vec<u8>>);

/// What a group wrote that the cache learns once the group is durable,
/// taken before the group is written.
#[derive(Debug)]
pub struct Learned {
    writes: Vec<Write>,
    born: Vec<[u8; 16]>,
    closed: Vec<[u8; 16]>,
}

impl Learned {
    /// The cacheable part of a group's writes; `batches` are the group's
    /// commits that were accepted (their closes end runs' rows in memory).
    pub fn of<'a>(writes: &Writes, batches: impl IntoIterator<Item = &'a PreparedBatch>) -> Self {
        let mut born = Vec::new();
        let kept = writes
            .iter()
            .filter(|((cf, k), v)| Self::keeps(*cf, k, v, &mut born))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Self::with(kept, born, batches)
    }

    /// [`Learned::of`], taking the writes instead of copying what it keeps
    /// (a writer whose group is already written has no other use for them).
    pub fn take<'a>(writes: Writes, batches: impl IntoIterator<Item = &'a PreparedBatch>) -> Self {
        let mut born = Vec::new();
        let kept = writes
            .into_iter()
            .filter(|((cf, k), v)| Self::keeps(*cf, k, v, &mut born))
            .collect();
        Self::with(kept, born, batches)
    }

    /// Whether the cache keeps a write; a run's first event adds the run to
    /// `born` instead.
    fn keeps(cf: Cf, k: &[u8], v: &Option<Vec<u8>>, born: &mut Vec<[u8; 16]>) -> bool {
        match cf {
            // A run's first event is written exactly once: when it is
            // created.
            Cf::Events => {
                if v.is_some() && keys::parse_event_key(k).is_some_and(|(_, s)| s == Seq::FIRST) {
                    born.extend(keys::run_prefix(k).map(|r| *r.as_bytes()));
                }
                false
            }
            Cf::Runs | Cf::Instances => true,
            cf => owner(cf, k).is_some(),
        }
    }

    fn with<'a>(
        kept: Vec<Write>,
        born: Vec<[u8; 16]>,
        batches: impl IntoIterator<Item = &'a PreparedBatch>,
    ) -> Self {
        let mut born = born;
        let mut closed = Vec::new();
        for append in batches.into_iter().flat_map(|b| &b.batch.appends) {
            // Found here too when the writes leave the events out
            // (`EventRows::Caller`); a run counted twice is born once.
            if append.events.first().is_some_and(|e| e.seq == Seq::FIRST) {
                born.push(*append.run_id.as_bytes());
            }
            if append.events.iter().any(|e| e.kind.closes_run()) {
                closed.push(*append.run_id.as_bytes());
            }
        }
        // Once each: `learn` bounds the cache by how many runs are born.
        born.sort_unstable();
        born.dedup();
        Learned {
            writes: kept,
            born,
            closed,
        }
    }
}

impl WriterCache {
    /// Records a group's writes once the group is durable.
    pub fn learn(&mut self, learned: Learned) {
        if self.records.len() + learned.writes.len() > WRITER_CACHE_RECORDS_MAX {
            self.records.clear();
            self.records_bytes = 0;
        }
        if self.born.len() + learned.born.len() > WRITER_CACHE_RECORDS_MAX
            || self.rows + learned.writes.len() > WRITER_CACHE_ROWS_MAX
        {
            self.born.clear();
            self.rows = 0;
            self.born_bytes = 0;
        }
        // Births first: a run's first rows are written with its birth.
        for run in learned.born {
            if let std::collections::hash_map::Entry::Vacant(e) = self.born.entry(run) {
                e.insert(OwnedRows::new());
                self.born_bytes += WRITER_CACHE_ENTRY_OVERHEAD_BYTES;
            }
        }
        // A run that closed in this group leaves the cache whole: its rows
        // (dropped below) and its record, which holds its result and is
        // rarely read by the writer again. Not learning them first keeps
        // the records to the open runs', instead of clearing them all
        // each time closed runs' records fill the bound.
        let mut closed = learned.closed;
        closed.sort_unstable();
        let closes = |run: &[u8]| closed.binary_search_by(|c| c.as_slice().cmp(run)).is_ok();
        for ((cf, key), value) in learned.writes {
            let fits = value
                .as_ref()
                .is_none_or(|v| v.len() <= WRITER_CACHE_VALUE_BYTES_MAX);
            if cf == Cf::Runs && closes(&key) {
                let cost = entry_bytes(&key, &[]);
                if let Some(old) = self.records.remove(&(cf, key)) {
                    self.records_bytes -= cost + old.len();
                }
                continue;
            }
            if let Some(run) = owner(cf, &key) {
                if closes(&run) {
                    continue;
                }
                if !fits {
                    // Too large to keep: the run's rows are no longer all
                    // known here.
                    self.drop_run(&run);
                    continue;
                }
                let Some(rows) = self.born.get_mut(&run) else {
                    continue;
                };
                let key = (cf, key);
                match value {
                    Some(v) => {
                        self.born_bytes += entry_bytes(&key.1, &v);
                        let cost = entry_bytes(&key.1, &[]);
                        match rows.insert(key, v) {
                            Some(old) => self.born_bytes -= cost + old.len(),
                            None => self.rows += 1,
                        }
                    }
                    None => {
                        if let Some(old) = rows.remove(&key) {
                            self.rows -= 1;
                            self.born_bytes -= entry_bytes(&key.1, &old);
                        }
                    }
                }
                continue;
            }
            let key = (cf, key);
            match value.filter(|_| fits) {
                Some(v) => {
                    self.records_bytes += entry_bytes(&key.1, &v);
                    let cost = entry_bytes(&key.1, &[]);
                    if let Some(old) = self.records.insert(key, v) {
                        self.records_bytes -= cost + old.len();
                    }
                }
                None => {
                    if let Some(old) = self.records.remove(&key) {
                        self.records_bytes -= entry_bytes(&key.1, &old);
                    }
                }
            }
        }
        for run in &closed {
            self.drop_run(run);
        }
    }

    /// Forgets the rows of `run`.
    fn drop_run(&mut self, run: &[u8; 16]) {
        if let Some(rows) = self.born.remove(run) {
            self.rows -= rows.len();
            self.born_bytes -= rows_bytes(&rows);
        }
    }

    /// Estimated bytes this cache holds: every kept key and value, and
    /// [`WRITER_CACHE_ENTRY_OVERHEAD_BYTES`] for each entry and each run.
    pub fn bytes(&self) -> usize {
        self.records_bytes + self.born_bytes
    }

    /// Forgets everything (after a failed write, or one of unknown
    /// outcome).
    pub fn forget(&mut self) {
        self.records.clear();
        self.born.clear();
        self.rows = 0;
        self.records_bytes = 0;
        self.born_bytes = 0;
    }

    /// Whether rows of `run` are all known here.
    pub fn knows_rows_of(&self, run: RunId) -> bool {
        self.born.contains_key(run.as_bytes())
    }

    /// The prefix scans validating `batches` will make for certain and this
    /// cache cannot answer: the [`CLOSE_SCANNED_CFS`] of each run not born
    /// here that closes. A store where a scan is a round trip reads them
    /// with the rows read ahead ([`CachedView::scans`]).
    pub fn scans_wanted<'a>(
        &self,
        batches: impl IntoIterator<Item = &'a PreparedBatch>,
    ) -> Vec<(Cf, Vec<u8>)> {
        let mut wanted = Vec::new();
        for append in batches.into_iter().flat_map(|b| &b.batch.appends) {
            let run = append.run_id;
            if !self.knows_rows_of(run) && append.events.iter().any(|e| e.kind.closes_run()) {
                let prefix = run.as_bytes().to_vec();
                wanted.extend(CLOSE_SCANNED_CFS.map(|cf| (cf, prefix.clone())));
            }
        }
        wanted
    }

    /// The rows validating `batches` will read for certain and this cache
    /// does not know, by family: each run's record, a new run's instance,
    /// and, of runs not born here, the durable ids of terminal events and
    /// the pending attempt each attempt's answer or cancel checks. A
    /// store where a read is a round trip reads them in one
    /// ([`CachedView::ahead`]).
    pub fn wanted<'a>(
        &self,
        batches: impl IntoIterator<Item = &'a PreparedBatch>,
    ) -> BTreeMap<Cf, Vec<Vec<u8>>> {
        let mut wanted: BTreeMap<Cf, std::collections::BTreeSet<Vec<u8>>> = BTreeMap::new();
        let mut want = |cf: Cf, key: Vec<u8>| {
            if !self.records.contains_key(&(cf, key.clone())) {
                wanted.entry(cf).or_default().insert(key);
            }
        };
        for append in batches.into_iter().flat_map(|b| &b.batch.appends) {
            let run = append.run_id;
            want(Cf::Runs, keys::run_key(run));
            if self.knows_rows_of(run) {
                continue;
            }
            for event in &append.events {
                if let EventKind::WorkflowStarted(start) = &event.kind {
                    want(
                        Cf::Instances,
                        start.instance_id.as_str().as_bytes().to_vec(),
                    );
                }
                let also = crate::derive::execution_also_checked(&event.kind);
                for key in event.kind.terminal_keys().iter().chain(&also) {
                    want(Cf::Dedupe, keys::dedupe_key(run, key));
                }
                // What an attempt's answer or a cancel validates against:
                // the execution's pending attempt.
                if let EventKind::ActivityAttemptFailed { step, .. }
                | EventKind::ActivityCompleted { step, .. }
                | EventKind::ActivityCancelRequested { step, .. }
                | EventKind::ActivityCancelled { step, .. } = &event.kind
                {
                    want(Cf::Tasks, keys::run_step_key(run, *step));
                }
            }
        }
        wanted
            .into_iter()
            .map(|(cf, keys)| (cf, keys.into_iter().collect()))
            .collect()
    }
}

/// A store as its writer sees it: `base`, with what the writer knows from
/// its own writes answered from [`WriterCache`] and, first, what was read
/// ahead for the group (`ahead`: found or known absent).
pub struct CachedView<'a> {
    /// The store.
    pub base: &'a dyn KvRead,
    /// What the writer knows.
    pub cache: &'a WriterCache,
    /// Rows read ahead for this group.
    pub ahead: &'a ReadAhead,
    /// Prefix scans read ahead for this group.
    pub scans: &'a ScanAhead,
}

impl std::fmt::Debug for CachedView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedView")
            .field("cache", self.cache)
            .field("ahead", &self.ahead.len())
            .field("scans", &self.scans.len())
            .finish()
    }
}

impl CachedView<'_> {
    /// What the view answers for `key` without the store: `None` when it
    /// does not know.
    pub fn known(&self, cf: Cf, key: &[u8]) -> Option<Option<Vec<u8>>> {
        // Empty unless the store reads ahead (PostgreSQL).
        if !self.ahead.is_empty() {
            if let Some(v) = self.ahead.get(&(cf, key.to_vec())) {
                return Some(v.clone());
            }
        }
        if matches!(cf, Cf::Runs | Cf::Instances) {
            return self
                .cache
                .records
                .get(&(cf, key.to_vec()))
                .map(|v| Some(v.clone()));
        }
        let rows = self.cache.born.get(&owner(cf, key)?)?;
        Some(rows.get(&(cf, key.to_vec())).cloned())
    }
}

impl KvRead for CachedView<'_> {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        // RocksDB's writer leaves a group's events out of its overlay
        // (`EventRows::Caller`), so a read of them here would miss the
        // group's own.
        debug_assert_ne!(cf, Cf::Events, "validation reads no events");
        match self.known(cf, key) {
            Some(v) => Ok(v),
            None => self.base.get(cf, key),
        }
    }

    fn records_lag(&self) -> bool {
        self.base.records_lag()
    }

    /// Of events: a run record read from the store is caught up
    /// (`derive::catch_up`) only for a run none of whose commits is in
    /// this group (such a commit left the run's current record in the
    /// group's overlay), so none of its events are missing from the store.
    fn last(&self, cf: Cf, prefix: &[u8]) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        let answered_here = owner(cf, prefix).is_some_and(|run| self.cache.born.contains_key(&run))
            || self.scans.contains_key(&(cf, prefix.to_vec()));
        if answered_here {
            crate::kv::last_by_scan(self, cf, prefix)
        } else {
            self.base.last(cf, prefix)
        }
    }

    fn get_knowing(&self, cf: Cf, key: &[u8]) -> Result<(Option<Vec<u8>>, bool)> {
        // What was read ahead came from the store; what the cache keeps,
        // from the writer's own writes.
        let ahead = !self.ahead.is_empty() && self.ahead.contains_key(&(cf, key.to_vec()));
        match self.known(cf, key) {
            Some(v) => Ok((v, !ahead)),
            None => Ok((self.base.get(cf, key)?, false)),
        }
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        debug_assert_ne!(cf, Cf::Events, "validation reads no events");
        let Some(rows) = owner(cf, prefix).and_then(|run| self.cache.born.get(&run)) else {
            if let Some(rows) = self.scans.get(&(cf, prefix.to_vec())) {
                let from = from.max(prefix);
                for (k, v) in rows.iter().filter(|(k, _)| k.as_slice() >= from) {
                    if !visit(k, v) {
                        break;
                    }
                }
                return Ok(());
            }
            return self.base.scan(cf, prefix, from, visit);
        };
        let start = (cf, from.max(prefix).to_vec());
        for ((c, k), v) in rows.range(start..) {
            if *c != cf || !k.starts_with(prefix) || !visit(k, v) {
                break;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! Goal: the writer's cache answers exactly what the store would, for
    //! every read and scan, while it is fed the writes as the writer makes
    //! them; it knows what it claims to know and no more.
    //! Method: random groups of writes over a small key space (three runs,
    //! every owned family, records, births) are applied to an in-memory
    //! base and learned by the cache; after each group every key and every
    //! run prefix is read through the cache and compared with the base.
    //! Writes to a run's owned rows before its birth are not generated:
    //! that is the rule the cache relies on (`OWNED_CFS`). The estimate of
    //! the bytes kept, maintained as entries come and go, is compared with
    //! a count from scratch after each group.

    use proptest::prelude::*;

    use super::*;
    use crate::ids::Step;
    use crate::kv::{mutations_of, Maps};

    fn run(i: u8) -> RunId {
        RunId::from_u64_pair(u64::from(i) + 1, 7)
    }

    /// The key of write `kind` for `run` at `n`.
    fn key_of(kind: u8, r: RunId, n: u8) -> (Cf, Vec<u8>) {
        let step = Step(u32::from(n));
        match kind % 7 {
            0 => (
                Cf::Dedupe,
                keys::dedupe_key(r, &crate::DurableKey::Execution(step)),
            ),
            1 => (Cf::Tasks, keys::run_step_key(r, step)),
            2 => (Cf::RunTimers, keys::run_step_key(r, step)),
            3 => (Cf::Children, keys::run_step_key(r, step)),
            4 => (Cf::Outbox, keys::outbox_start_key(r, step)),
            5 => (Cf::Runs, keys::run_key(r)),
            _ => (Cf::Instances, vec![b'i', n]),
        }
    }

    fn check_agrees(base: &Maps, cache: &WriterCache) {
        let ahead = ReadAhead::new();
        // The close scans of the last run read ahead from the base, as a
        // group's would be: answered from them unless the run is born here.
        let mut scans = ScanAhead::new();
        for cf in CLOSE_SCANNED_CFS {
            let prefix = run(2).as_bytes().to_vec();
            let mut rows = Vec::new();
            base.scan(cf, &prefix, &prefix, &mut |k, v| {
                rows.push((k.to_vec(), v.to_vec()));
                true
            })
            .unwrap();
            scans.insert((cf, prefix), rows);
        }
        let view = CachedView {
            base,
            cache,
            ahead: &ahead,
            scans: &scans,
        };
        for r in 0..3 {
            for kind in 0..7 {
                for n in 0..4 {
                    let (cf, k) = key_of(kind, run(r), n);
                    assert_eq!(
                        view.get(cf, &k).unwrap(),
                        base.get(cf, &k).unwrap(),
                        "{cf:?} {k:?}"
                    );
                }
            }
            for cf in OWNED_CFS {
                let prefix = match cf {
                    Cf::Outbox => {
                        let mut p = vec![b'S'];
                        p.extend_from_slice(run(r).as_bytes());
                        p
                    }
                    _ => run(r).as_bytes().to_vec(),
                };
                let mut from = prefix.clone();
                from.extend_from_slice(&[0, 0, 0, 1]);
                for start in [&prefix, &from] {
                    let (mut got, mut want) = (Vec::new(), Vec::new());
                    view.scan(cf, &prefix, start, &mut |k, v| {
                        got.push((k.to_vec(), v.to_vec()));
                        true
                    })
                    .unwrap();
                    base.scan(cf, &prefix, start, &mut |k, v| {
                        want.push((k.to_vec(), v.to_vec()));
                        true
                    })
                    .unwrap();
                    assert_eq!(got, want, "scan of {cf:?}");
                }
            }
        }
    }

    /// (run, kind, n, value: None deletes, Some(len) puts a value that long).
    type Op = (u8, u8, u8, Option<u16>);

    fn ops() -> impl Strategy<Value = Vec<Vec<Op>>> {
        let op = (0u8..3, 0u8..9, 0u8..4, prop::option::of(0u16..1200));
        prop::collection::vec(prop::collection::vec(op, 1..8), 1..30)
    }

    proptest! {
        #[test]
        fn reads_through_the_cache_equal_the_store(groups in ops(), fail_at in 0usize..40) {
            let mut base = Maps::default();
            let mut cache = WriterCache::default();
            let mut born = [false; 3];
            for (g, group) in groups.into_iter().enumerate() {
                let mut writes = Writes::new();
                let mut closed = Vec::new();
                for (r, kind, n, value) in group {
                    if kind == 8 {
                        // The run closes in this group (its rows and
                        // record leave the cache).
                        closed.push(*run(r).as_bytes());
                        continue;
                    }
                    if kind == 7 {
                        // The run's birth: its first event, written once.
                        if born[r as usize] {
                            continue;
                        }
                        writes.insert((Cf::Events, keys::event_key(run(r), Seq::FIRST)), Some(vec![1]));
                        born[r as usize] = true;
                        continue;
                    }
                    let (cf, k) = key_of(kind, run(r), n);
                    if owner(cf, &k).is_some() && !born[r as usize] {
                        continue;
                    }
                    let value = value.map(|len| vec![n; usize::from(len)]);
                    writes.insert((cf, k), value);
                }
                let mut learned = Learned::of(&writes, []);
                learned.closed = closed;
                base.apply(&mutations_of(writes));
                if g == fail_at {
                    // A failed write: the cache forgets (here the write
                    // landed anyway, as after an unknown outcome).
                    cache.forget();
                } else {
                    cache.learn(learned);
                }
                check_agrees(&base, &cache);
                prop_assert_eq!(cache.bytes(), recounted(&cache), "bytes kept incrementally");
            }
        }
    }

    /// [`WriterCache::bytes`] counted from scratch.
    fn recounted(cache: &WriterCache) -> usize {
        let records: usize = cache
            .records
            .iter()
            .map(|((_, k), v)| entry_bytes(k, v))
            .sum();
        records + cache.born.values().map(rows_bytes).sum::<usize>()
    }

    #[test]
    fn a_run_born_here_answers_from_memory_and_leaves_when_it_closes() {
        let r = run(0);
        let mut cache = WriterCache::default();
        let mut writes = Writes::new();
        writes.insert((Cf::Events, keys::event_key(r, Seq::FIRST)), Some(vec![1]));
        writes.insert((Cf::Runs, keys::run_key(r)), Some(vec![2]));
        cache.learn(Learned::of(&writes, []));
        assert!(cache.knows_rows_of(r));
        assert!(!cache.knows_rows_of(run(1)));
        // A base that fails every read proves the answers come from memory.
        struct Unreachable;
        impl KvRead for Unreachable {
            fn get(&self, _: Cf, _: &[u8]) -> Result<Option<Vec<u8>>> {
                Err(crate::error::Error::Closed)
            }
            fn scan(
                &self,
                _: Cf,
                _: &[u8],
                _: &[u8],
                _: &mut dyn FnMut(&[u8], &[u8]) -> bool,
            ) -> Result<()> {
                Err(crate::error::Error::Closed)
            }
        }
        let ahead = ReadAhead::new();
        let view = CachedView {
            base: &Unreachable,
            cache: &cache,
            ahead: &ahead,
            scans: &ScanAhead::new(),
        };
        let dk = keys::dedupe_key(r, &crate::DurableKey::Run);
        assert_eq!(view.get(Cf::Dedupe, &dk).unwrap(), None);
        assert_eq!(
            view.get(Cf::Runs, &keys::run_key(r)).unwrap(),
            Some(vec![2])
        );
        view.scan(Cf::Tasks, r.as_bytes(), r.as_bytes(), &mut |_, _| {
            panic!("no rows")
        })
        .unwrap();
        assert!(view
            .get(
                Cf::Dedupe,
                &keys::dedupe_key(run(1), &crate::DurableKey::Run)
            )
            .is_err());
        // A commit of it wants only its record read, which is known.
        let closing = PreparedBatch::new(crate::CommitBatch::append(
            r,
            vec![crate::Event {
                seq: Seq(2),
                at: crate::Timestamp(5),
                kind: EventKind::WorkflowCompleted {
                    result: crate::Payload(Vec::new()),
                },
            }],
        ))
        .unwrap();
        assert!(cache.wanted([&closing]).is_empty());
        let other = PreparedBatch::new(crate::CommitBatch::append(
            run(1),
            closing.batch.appends[0].events.clone(),
        ))
        .unwrap();
        let wanted = cache.wanted([&other]);
        assert_eq!(wanted.get(&Cf::Runs).map(Vec::len), Some(1));
        assert_eq!(
            wanted.get(&Cf::Dedupe).map(Vec::len),
            Some(1),
            "its durable id"
        );
        // Its close scans are read ahead too; those of a run born here not.
        assert_eq!(
            cache.scans_wanted([&other]),
            CLOSE_SCANNED_CFS.map(|cf| (cf, run(1).as_bytes().to_vec()))
        );
        assert!(cache.scans_wanted([&closing]).is_empty());
        // An attempt's answer also wants the pending attempt it checks.
        let answered = PreparedBatch::new(crate::CommitBatch::append(
            run(1),
            vec![crate::Event {
                seq: Seq(3),
                at: crate::Timestamp(5),
                kind: EventKind::ActivityCompleted {
                    step: Step(2),
                    attempt_id: crate::event::attempt_of(
                        run(1),
                        Step(2),
                        crate::ids::AttemptNo::FIRST,
                    ),
                    result: crate::Payload(Vec::new()),
                },
            }],
        ))
        .unwrap();
        assert_eq!(
            cache.wanted([&answered]).get(&Cf::Tasks),
            Some(&vec![keys::run_step_key(run(1), Step(2))]),
            "the pending attempt"
        );
        // Once its close is written the run's rows are no longer kept.
        cache.learn(Learned::of(&Writes::new(), [&closing]));
        assert!(!cache.knows_rows_of(r));
        // What remains is the run's record, and the bytes counted say so.
        assert_eq!(cache.bytes(), entry_bytes(&keys::run_key(r), &[2]));
        cache.learn(Learned::of(&writes, []));
        cache.forget();
        assert!(!cache.knows_rows_of(r));
        assert_eq!(cache.bytes(), 0);
    }
}
