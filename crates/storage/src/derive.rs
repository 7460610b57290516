//! The one place that validates a commit and derives its state.
//!
//! Both stores call [`apply_batch`] on their commit path, and `verify` calls
//! [`apply_append`] to rebuild derived state from events, so validation and
//! derivation are written once. Nothing here does IO beyond the [`KvRead`]
//! view it is handed.

use tracing::warn;

use crate::codec::{self, RecordKind};
use crate::error::{Error, Result};
use crate::event::{
    ChildSchedule, DurableKey, Event, EventKind, Outcome, ParentClosePolicy, ParentRef,
    WorkflowStart,
};
use crate::ids::{RunId, Seq, Step, Timestamp};
use crate::keys::{self, Cf};
use crate::kv::{KvRead, KvWrite, Overlay, Writes};
use crate::search;
use crate::state::{
    ChildEntry, DedupeEntry, InstanceMeta, OutboxMessage, ParkInfo, RunMeta, RunStatus, TaskEntry,
    TimerEntry,
};
use crate::{HISTORY_EVENTS_MAX, LIMIT_WARN_PERCENT, PAYLOAD_BYTES_MAX};

/// Events to append to one run. The first event's seq must continue the
/// run's history exactly.
#[derive(Clone, Debug)]
pub struct RunAppend {
    /// The run.
    pub run_id: RunId,
    /// Its new events, contiguous.
    pub events: Vec<Event>,
}

/// One atomic commit: appends to one or more runs, plus parked markers.
/// Either all of it is written or none of it.
#[derive(Clone, Debug, Default)]
pub struct CommitBatch {
    /// Appends, applied in order.
    pub appends: Vec<RunAppend>,
    /// Parked markers to set (`Some`) or clear (`None`).
    pub parked: Vec<(RunId, Option<ParkInfo>)>,
    /// The shard lease the committer holds: the store refuses the batch
    /// unless the lease still has this epoch ([`crate::lease::check_fence`]).
    /// `None` for a store with one writer (RocksDB's exclusive open).
    pub fence: Option<crate::lease::Fence>,
}

impl CommitBatch {
    /// A batch of one append.
    pub fn append(run_id: RunId, events: Vec<Event>) -> Self {
        CommitBatch {
            appends: vec![RunAppend { run_id, events }],
            parked: Vec::new(),
            fence: None,
        }
    }

    /// Total events in the batch.
    pub fn event_count(&self) -> usize {
        self.appends.iter().map(|a| a.events.len()).sum()
    }
}

/// What one append committed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct AppendAck {
    /// The run.
    pub run_id: RunId,
    /// Seq of its first new event.
    pub first: Seq,
    /// Seq of its last new event.
    pub last: Seq,
}

/// An intent row: an effect that must follow the commit that wrote it.
/// Live effects run from the intents a commit's answer names; recovery runs
/// from every intent row still stored. One code path for both.
#[derive(Clone, PartialEq, Debug)]
pub enum Intent {
    /// The pending attempt of an activity execution: dispatch it at `due`,
    /// or, if `cancel_requested`, stop it.
    Task(TaskEntry),
    /// A timer to fire at its due time.
    Timer(TimerEntry),
    /// A message to deliver at least once.
    Outbox(OutboxMessage),
}

impl Intent {
    /// The key of this row: what a commit that removes it names.
    pub fn key(&self) -> IntentKey {
        match self {
            Intent::Task(t) => IntentKey::Task(t.execution_id.run_id, t.execution_id.step),
            Intent::Timer(t) => IntentKey::Timer(t.run_id, t.step),
            Intent::Outbox(m) => IntentKey::Outbox(m.key()),
        }
    }
}

/// An intent row a commit removed: its effect is done or no longer wanted.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum IntentKey {
    /// The pending attempt of the execution at (run, step).
    Task(RunId, Step),
    /// The timer at (run, step).
    Timer(RunId, Step),
    /// The outbox message with this key (see [`OutboxMessage::key`]).
    Outbox(Vec<u8>),
}

/// What a commit wrote, returned once it is durable (or, in `Buffered`
/// mode, written to the WAL).
#[derive(Clone, PartialEq, Debug, Default)]
pub struct CommitAck {
    /// One entry per append, in order.
    pub appends: Vec<AppendAck>,
    /// The intent rows the commit wrote (new or changed), in key order.
    pub intents: Vec<Intent>,
    /// The intent rows the commit removed.
    pub removed: Vec<IntentKey>,
}

/// A batch with its events already encoded (done on the committer's thread
/// so the single writer only validates and writes).
#[derive(Debug)]
pub struct PreparedBatch {
    pub(crate) batch: CommitBatch,
    pub(crate) encoded: Vec<Vec<Vec<u8>>>,
}

impl PreparedBatch {
    /// Encodes every event of `batch`.
    pub fn new(batch: CommitBatch) -> Result<Self> {
        let mut encoded = Vec::with_capacity(batch.appends.len());
        for a in &batch.appends {
            let mut bytes = Vec::with_capacity(a.events.len());
            for e in &a.events {
                bytes.push(codec::encode(RecordKind::Event, e).map_err(|source| {
                    Error::Corrupt {
                        cf: "events",
                        run: Some(a.run_id),
                        seq: Some(e.seq),
                        source,
                    }
                })?);
            }
            encoded.push(bytes);
        }
        Ok(PreparedBatch { batch, encoded })
    }

    /// Total encoded bytes, for batching limits.
    pub fn bytes(&self) -> usize {
        self.encoded.iter().flatten().map(Vec::len).sum()
    }
}

/// Which commit checks run. Production always runs [`Checks::ALL`]; only
/// the simulator's deliberately broken engine (`keel sim --break
/// no-attempt-dedupe`) switches the duplicate-terminal check off, to prove
/// that its own checker catches what the store would have refused.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Checks {
    /// Refuse a second terminal event for a durable id (and a result for an
    /// attempt that is no longer pending).
    pub duplicate_terminals: bool,
    /// Refuse a run's start whose decision is out of date: it names the
    /// run it was decided against (`previous_run`, `None` for an instance
    /// that had none) and the instance has another run now.
    pub stale_starts: bool,
}

impl Checks {
    /// Every check on: the production setting.
    pub const ALL: Checks = Checks {
        duplicate_terminals: true,
        stale_starts: true,
    };

    /// Re-deriving state from committed events (`verify`, migration):
    /// schema-1 histories did not record what a start was decided
    /// against, so that check is left to the commit that wrote them.
    pub const REDERIVE: Checks = Checks {
        duplicate_terminals: true,
        stale_starts: false,
    };
}

impl Default for Checks {
    fn default() -> Self {
        Checks::ALL
    }
}

/// Validates a whole batch against `base` and returns its writes; on any
/// error nothing of the batch is kept.
pub fn apply_batch(base: &dyn KvRead, prepared: &PreparedBatch) -> Result<(Writes, CommitAck)> {
    apply_batch_checked(base, prepared, Checks::ALL)
}

/// [`apply_batch`] with a choice of checks (fault injection only).
pub fn apply_batch_checked(
    base: &dyn KvRead,
    prepared: &PreparedBatch,
    checks: Checks,
) -> Result<(Writes, CommitAck)> {
    let (writes, raw) = apply_batch_raw(base, prepared, checks)?;
    Ok((writes, raw.decode()?))
}

/// A commit's answer before its intent rows are decoded: the single writer
/// only copies the rows, and whoever answers the committer decodes them
/// ([`RawAck::decode`]) off the writer's thread.
#[derive(Debug)]
pub struct RawAck {
    appends: Vec<AppendAck>,
    rows: Vec<(Cf, Vec<u8>, Option<Vec<u8>>)>,
}

impl RawAck {
    /// The commit's answer, its intent rows decoded.
    pub fn decode(self) -> Result<CommitAck> {
        let mut ack = CommitAck {
            appends: self.appends,
            intents: Vec::with_capacity(self.rows.len()),
            removed: Vec::new(),
        };
        for (cf, key, value) in &self.rows {
            intent_of(*cf, key, value.as_deref(), &mut ack)?;
        }
        Ok(ack)
    }
}

/// [`apply_batch_checked`] without decoding the intent rows.
pub fn apply_batch_raw(
    base: &dyn KvRead,
    prepared: &PreparedBatch,
    checks: Checks,
) -> Result<(Writes, RawAck)> {
    // A fresh overlay holds this batch's writes only: an error drops it
    // whole, so no step (and no record of what each write replaced) is
    // needed, and every intent row in it is the batch's.
    let mut overlay = Overlay::new(base);
    let appends = validate_batch(&mut overlay, prepared, checks, EventRows::Written)?;
    // What a store whose records lag leaves out (`KvWrite::put_derivable`):
    // derivable here means from what this batch's own overlay saw, so a
    // key `base` holds pending from its writer (an earlier commit of the
    // group, which may have changed more than progress) is written.
    let (mut writes, derivable) = overlay.into_parts();
    for key in derivable.keys() {
        if !base.get_knowing(key.0, &key.1)?.1 {
            writes.remove(key);
        }
    }
    let rows = writes
        .iter()
        .filter(|((cf, _), _)| is_intent_family(*cf))
        .map(|((cf, k), v)| (*cf, k.clone(), v.clone()))
        .collect();
    Ok((writes, RawAck { appends, rows }))
}

/// The families of intent rows, which a commit's answer carries.
fn is_intent_family(cf: Cf) -> bool {
    matches!(cf, Cf::Timers | Cf::Outbox | Cf::Tasks)
}

/// Validates every append and parking of a batch into `overlay`.
fn validate_batch(
    overlay: &mut Overlay<'_>,
    prepared: &PreparedBatch,
    checks: Checks,
    rows: EventRows,
) -> Result<Vec<AppendAck>> {
    let mut appends = Vec::with_capacity(prepared.batch.appends.len());
    if let Some(fence) = prepared.batch.fence {
        crate::lease::check_fence(overlay, fence)?;
    }
    for (append, encoded) in prepared.batch.appends.iter().zip(&prepared.encoded) {
        appends.push(append_to(
            overlay,
            append.run_id,
            &append.events,
            encoded,
            checks,
            rows,
        )?);
    }
    for (run, info) in &prepared.batch.parked {
        match info {
            Some(info) => overlay.put(
                Cf::Meta,
                keys::parked_key(*run),
                enc(RecordKind::Parked, info)?,
            ),
            None => overlay.delete(Cf::Meta, keys::parked_key(*run)),
        }
    }
    Ok(appends)
}

/// Validates a whole batch as one [step](Overlay::step) of `out`, a group
/// commit's overlay holding the commits validated before it: on success its
/// writes join the group's, on any error `out` is left as it was.
pub fn apply_batch_step(
    out: &mut Overlay<'_>,
    prepared: &PreparedBatch,
    checks: Checks,
    rows: EventRows,
) -> Result<RawAck> {
    let (appends, stepped) = out.step(|overlay| validate_batch(overlay, prepared, checks, rows))?;
    // The batch's intent rows, each once with its value after the batch,
    // in key order (the column families' order: timers, outbox, tasks).
    let mut written: Vec<(Cf, &[u8])> = stepped
        .keys()
        .filter(|(cf, _)| is_intent_family(*cf))
        .collect();
    written.sort_unstable();
    written.dedup();
    let rows = written
        .into_iter()
        .map(|(cf, k)| {
            let value = out
                .pending(cf, k)
                .expect("a key the step wrote is pending in its overlay");
            (cf, k.to_vec(), value.clone())
        })
        .collect();
    Ok(RawAck { appends, rows })
}

/// One intent row of a commit's writes, decoded into `ack`.
fn intent_of(cf: Cf, key: &[u8], value: Option<&[u8]>, ack: &mut CommitAck) -> Result<()> {
    let corrupt = |source| Error::Corrupt {
        cf: cf.name(),
        run: keys::run_prefix(key),
        seq: None,
        source,
    };
    match (cf, value) {
        (Cf::Tasks, Some(v)) => ack.intents.push(Intent::Task(
            codec::decode(RecordKind::Task, v).map_err(corrupt)?,
        )),
        (Cf::Timers, Some(v)) => ack.intents.push(Intent::Timer(
            codec::decode(RecordKind::Timer, v).map_err(corrupt)?,
        )),
        (Cf::Outbox, Some(v)) => ack.intents.push(Intent::Outbox(
            codec::decode(RecordKind::Outbox, v).map_err(corrupt)?,
        )),
        (Cf::Tasks, None) => {
            if let Some((run, step)) = keys::parse_run_step_key(key) {
                ack.removed.push(IntentKey::Task(run, step));
            }
        }
        (Cf::Timers, None) => {
            if let Some((run, step)) = key.get(8..).and_then(keys::parse_run_step_key) {
                ack.removed.push(IntentKey::Timer(run, step));
            }
        }
        (Cf::Outbox, None) => ack.removed.push(IntentKey::Outbox(key.to_vec())),
        _ => {}
    }
    Ok(())
}

fn enc<T: serde::Serialize>(kind: RecordKind, value: &T) -> Result<Vec<u8>> {
    codec::encode(kind, value).map_err(|source| Error::Corrupt {
        cf: "state",
        run: None,
        seq: None,
        source,
    })
}

/// Reads and decodes a typed derived record.
pub fn read_record<T: serde::de::DeserializeOwned>(
    view: &dyn KvRead,
    cf: Cf,
    kind: RecordKind,
    key: &[u8],
) -> Result<Option<T>> {
    view.get(cf, key)?
        .map(|bytes| decode_record(cf, kind, key, &bytes))
        .transpose()
}

/// A record read at `key` in `cf`, decoded; damage is [`Error::Corrupt`]
/// naming the family and the run the key names.
fn decode_record<T: serde::de::DeserializeOwned>(
    cf: Cf,
    kind: RecordKind,
    key: &[u8],
    bytes: &[u8],
) -> Result<T> {
    codec::decode(kind, bytes).map_err(|source| Error::Corrupt {
        cf: cf.name(),
        run: keys::run_prefix(key),
        seq: None,
        source,
    })
}

/// Warns once a count crosses [`LIMIT_WARN_PERCENT`] of its limit.
fn warn_near(run: RunId, what: &str, value: usize, max: usize) {
    if value * 100 > max * LIMIT_WARN_PERCENT {
        warn!(run_id = %run, value, max, "{what} above {LIMIT_WARN_PERCENT}% of the limit");
    }
}

fn check_limits(run: RunId, events: &[Event], prev_len: u64) -> Result<()> {
    for e in events {
        for p in e.kind.payloads() {
            if p.len() > PAYLOAD_BYTES_MAX {
                return Err(Error::PayloadTooLarge {
                    run,
                    seq: e.seq,
                    bytes: p.len(),
                    max: PAYLOAD_BYTES_MAX,
                });
            }
            if p.len() * 100 > PAYLOAD_BYTES_MAX * LIMIT_WARN_PERCENT {
                warn!(run_id = %run, seq = e.seq.0, bytes = p.len(), max = PAYLOAD_BYTES_MAX,
                    "payload is above {LIMIT_WARN_PERCENT}% of the limit");
            }
        }
    }
    let new_len = prev_len + events.len() as u64;
    if new_len > HISTORY_EVENTS_MAX {
        return Err(Error::HistoryTooLong {
            run,
            events: new_len,
            max: HISTORY_EVENTS_MAX,
        });
    }
    let warn_at = HISTORY_EVENTS_MAX * LIMIT_WARN_PERCENT as u64 / 100;
    if prev_len < warn_at && new_len >= warn_at {
        warn!(run_id = %run, events = new_len, max = HISTORY_EVENTS_MAX,
            "history is above {LIMIT_WARN_PERCENT}% of its length limit; consider continue-as-new");
    }
    Ok(())
}

/// Validates one append against `out` (which already holds earlier appends
/// of the same batch) and writes its events and derived state into `out`.
/// On error, `out` may hold part of the append: callers discard it.
pub fn apply_append(
    out: &mut dyn KvWrite,
    run: RunId,
    events: &[Event],
    encoded: &[Vec<u8>],
) -> Result<AppendAck> {
    apply_append_checked(out, run, events, encoded, Checks::ALL)
}

/// [`apply_append`] with a choice of checks (fault injection only).
pub fn apply_append_checked(
    out: &mut dyn KvWrite,
    run: RunId,
    events: &[Event],
    encoded: &[Vec<u8>],
    checks: Checks,
) -> Result<AppendAck> {
    append_to(out, run, events, encoded, checks, EventRows::Written)
}

/// Where a validated commit's event rows go.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum EventRows {
    /// Into the writes, with the rows derived from them.
    Written,
    /// Nowhere: the caller writes each accepted batch's encoded events
    /// itself ([`event_rows`]). RocksDB's writer does: events are most of a
    /// group's rows and bytes, validation never reads them, and this way
    /// they are neither copied nor sorted into the group's overlay.
    Caller,
}

/// The event rows of an accepted batch: each event's key and its encoded
/// bytes, as [`EventRows::Written`] would have written them.
pub fn event_rows(prepared: &PreparedBatch) -> impl Iterator<Item = ([u8; 24], &[u8])> {
    prepared
        .batch
        .appends
        .iter()
        .zip(&prepared.encoded)
        .flat_map(|(append, encoded)| {
            append
                .events
                .iter()
                .zip(encoded)
                .map(move |(event, bytes)| {
                    (keys::event_key_array(append.run_id, event.seq), &bytes[..])
                })
        })
}

fn append_to(
    out: &mut dyn KvWrite,
    run: RunId,
    events: &[Event],
    encoded: &[Vec<u8>],
    checks: Checks,
    rows: EventRows,
) -> Result<AppendAck> {
    debug_assert_eq!(events.len(), encoded.len());
    let invalid = |detail: String| Error::InvalidCommit { run, detail };
    let (first, last) = match (events.first(), events.last()) {
        (Some(f), Some(l)) => (f, l),
        _ => return Err(invalid("an append needs at least one event".into())),
    };
    let run_key = keys::run_key(run);
    let lag = out.records_lag();
    let (stored, current) = out.get_knowing(Cf::Runs, &run_key)?;
    let mut old: Option<RunMeta> = stored
        .map(|bytes| decode_record(Cf::Runs, RecordKind::Run, &run_key, &bytes))
        .transpose()?;
    if let Some(m) = old.as_mut() {
        // A record read from a store whose records lag, and not known here
        // from this writer's own writes, may trail the run's events: the
        // seq this commit must continue from is the last event's.
        if lag && !current && !m.status.is_closed() {
            catch_up(&*out, run, m)?;
        }
    }
    let expected = old.as_ref().map_or(Seq::FIRST, |m| m.next_seq);
    if first.seq != expected {
        return Err(Error::SeqGap {
            run,
            expected,
            found: first.seq,
        });
    }
    for pair in events.windows(2) {
        if pair[1].seq != pair[0].seq.next() {
            return Err(invalid(format!(
                "events are not contiguous: seq {} follows seq {}",
                pair[1].seq, pair[0].seq
            )));
        }
    }
    if let Some(m) = &old {
        if m.status.is_closed() {
            return Err(Error::RunClosed { run });
        }
    } else if !matches!(&first.kind, EventKind::WorkflowStarted(start) if start.run_id == run) {
        return Err(Error::UnknownRun { run });
    }
    check_limits(run, events, expected.0 - 1)?;

    let mut meta = old.clone();
    for (event, bytes) in events.iter().zip(encoded) {
        if meta.as_ref().is_some_and(|m| m.status.is_closed()) {
            return Err(Error::RunClosed { run });
        }
        let terminal = event.kind.terminal_keys();
        let also = execution_also_checked(&event.kind);
        for key in terminal.iter().chain(&also) {
            let dk = keys::dedupe_key(run, key);
            let found: Option<DedupeEntry> = read_record(out, Cf::Dedupe, RecordKind::Dedupe, &dk)?;
            if let Some(entry) = found.filter(|_| checks.duplicate_terminals) {
                return Err(Error::DuplicateTerminal {
                    run,
                    key: key.clone(),
                    committed: entry.seq,
                });
            }
        }
        let closes = closes_execution(&event.kind);
        for key in terminal {
            if closes && matches!(key, DurableKey::Attempt(..)) {
                continue;
            }
            out.put(
                Cf::Dedupe,
                keys::dedupe_key(run, &key),
                enc(RecordKind::Dedupe, &DedupeEntry { seq: event.seq })?,
            );
        }
        derive_event(out, run, &mut meta, event, checks)?;
        if rows == EventRows::Written {
            out.put(Cf::Events, keys::event_key(run, event.seq), bytes.clone());
        }
    }
    let mut meta = meta.expect("the first event of a new run is WorkflowStarted");
    meta.next_seq = last.seq.next();
    meta.updated_at = last.at;
    // The index entries of the run move in the commit that moves the run.
    match &old {
        Some(o) if search::same_index_keys(o, &meta) => {}
        _ => {
            let before = old.as_ref().map(search::index_keys).unwrap_or_default();
            let after = search::index_keys(&meta);
            for k in before.iter().filter(|k| !after.contains(k)) {
                out.delete(Cf::Index, k.clone());
            }
            for k in after.into_iter().filter(|k| !before.contains(k)) {
                out.put(Cf::Index, k, Vec::new());
            }
        }
    }
    let record = enc(RecordKind::Run, &meta)?;
    match &old {
        // Only the progress moved, which the events just written say: a
        // store whose records lag leaves the rewrite out.
        Some(o) if lag && o.same_but_progress(&meta) => {
            out.put_derivable(Cf::Runs, run_key, record)
        }
        _ => out.put(Cf::Runs, run_key, record),
    }
    Ok(AppendAck {
        run_id: run,
        first: first.seq,
        last: last.seq,
    })
}

/// Brings an open run's record, as read from a store whose records lag
/// ([`KvRead::records_lag`]), up to the run's last event: its `next_seq`
/// and `updated_at` are the last event's, which the commits that left the
/// record alone wrote. One seek to the run's last event, however far the
/// record trails. Returns whether that event closes the run (a reader
/// then holds a record read before the close: see [`current_run`]).
pub(crate) fn catch_up<V: KvRead + ?Sized>(
    view: &V,
    run: RunId,
    meta: &mut RunMeta,
) -> Result<bool> {
    let Some((key, bytes)) = view.last(Cf::Events, run.as_bytes())? else {
        return Ok(false);
    };
    let corrupt = |seq, source| Error::Corrupt {
        cf: Cf::Events.name(),
        run: Some(run),
        seq,
        source,
    };
    // The run's prefix holds only event keys: anything else is damage, and
    // the record must not pass for current.
    let Some((_, seq)) = keys::parse_event_key(&key) else {
        return Err(corrupt(None, codec::Error::TooShort { len: key.len() }));
    };
    if seq < meta.next_seq {
        return Ok(false);
    }
    let event: Event =
        codec::decode(RecordKind::Event, &bytes).map_err(|source| corrupt(Some(seq), source))?;
    meta.next_seq = seq.next();
    meta.updated_at = event.at;
    Ok(event.kind.closes_run())
}

/// A run's record as a reader gets it: as stored, caught up with its
/// events where the store's records lag ([`catch_up`]). Closed runs'
/// records are always current (a close rewrites the record); one that
/// closed between reading the record and its last event is read again.
pub(crate) fn current_run(view: &dyn KvRead, run: RunId, meta: &mut RunMeta) -> Result<()> {
    if view.records_lag() && !meta.status.is_closed() && catch_up(view, run, meta)? {
        if let Some(closed) = read_record(view, Cf::Runs, RecordKind::Run, &keys::run_key(run))? {
            *meta = closed;
        }
    }
    Ok(())
}

fn close(
    out: &mut dyn KvWrite,
    run: RunId,
    meta: &mut RunMeta,
    status: RunStatus,
    outcome: Outcome,
    at: Timestamp,
) -> Result<()> {
    meta.status = status;
    meta.closed_at = Some(at);
    // A closed run has no pending attempts or timers: drop them with it.
    let mut tasks = Vec::new();
    out.scan(Cf::Tasks, run.as_bytes(), run.as_bytes(), &mut |k, _| {
        tasks.push(k.to_vec());
        true
    })?;
    for k in tasks {
        out.delete(Cf::Tasks, k);
    }
    let mut timers = Vec::new();
    out.scan(
        Cf::RunTimers,
        run.as_bytes(),
        run.as_bytes(),
        &mut |k, v| {
            timers.push((k.to_vec(), v.to_vec()));
            true
        },
    )?;
    for (k, v) in timers {
        let entry: TimerEntry =
            codec::decode(RecordKind::Timer, &v).map_err(|source| Error::Corrupt {
                cf: Cf::RunTimers.name(),
                run: Some(run),
                seq: None,
                source,
            })?;
        out.delete(Cf::Timers, keys::timer_key(entry.fire_at, run, entry.step));
        out.delete(Cf::RunTimers, k);
    }
    // The close policy of every child not heard back from, as intents in
    // this same commit: a crash right after the close cannot lose them. A
    // child that closed already needs none; its result, which this run will
    // never take, is dropped.
    let mut children = Vec::new();
    out.scan(Cf::Children, run.as_bytes(), run.as_bytes(), &mut |k, v| {
        children.push((k.to_vec(), v.to_vec()));
        true
    })?;
    for (k, v) in children {
        let entry: ChildEntry =
            codec::decode(RecordKind::Child, &v).map_err(|source| Error::Corrupt {
                cf: Cf::Children.name(),
                run: Some(run),
                seq: None,
                source,
            })?;
        let step = keys::parse_run_step_key(&k).map_or(Step(0), |(_, s)| s);
        out.delete(Cf::Children, k);
        out.delete(Cf::Outbox, keys::outbox_result_key(entry.child_run_id));
        // A child that started keeps its start row only for this run's
        // notice, which it will never take now; one not started yet still
        // starts (its start commit drops the row, seeing this run closed).
        let started: Option<RunMeta> = read_record(
            out,
            Cf::Runs,
            RecordKind::Run,
            &keys::run_key(entry.child_run_id),
        )?;
        if started.is_some() {
            out.delete(Cf::Outbox, keys::outbox_start_key(run, step));
        }
        if entry.close_policy != ParentClosePolicy::Abandon {
            let parent = ParentRef {
                instance_id: meta.instance_id.clone(),
                run_id: run,
                step,
                close_policy: entry.close_policy,
            };
            let reason = format!("parent {run} closed ({})", status.name());
            cancel_child(out, parent, entry.child_run_id, entry.close_policy, reason)?;
        }
    }
    // A cancellation addressed to this run is done once it closes. Only a
    // child is ever sent one (`cancel_child`): a run without a parent
    // writes no tombstone, which every close would otherwise leave in the
    // family the outbox windows scan.
    if meta.parent.is_some() {
        out.delete(Cf::Outbox, keys::outbox_cancel_key(run));
    }
    // Sends still in flight: a run closes only once they are answered
    // (the machine holds its close back), except when terminated, which
    // drops them.
    if matches!(outcome, Outcome::Terminated(_) | Outcome::TimedOut(_)) {
        let prefix = keys::outbox_deliver_key(run, Step(0));
        let prefix = &prefix[..prefix.len() - 4];
        let mut sends = Vec::new();
        out.scan(Cf::Outbox, prefix, prefix, &mut |k, _| {
            sends.push(k.to_vec());
            true
        })?;
        for k in sends {
            out.delete(Cf::Outbox, k);
        }
    }
    // A child that continues as new reports through its chain's last run.
    let continues = matches!(outcome, Outcome::ContinuedAsNew(_));
    if let Some(parent) = meta.parent.as_ref().filter(|_| !continues) {
        // A parent that closed first never takes the result.
        let parent_meta: Option<RunMeta> = read_record(
            out,
            Cf::Runs,
            RecordKind::Run,
            &keys::run_key(parent.run_id),
        )?;
        if !parent_meta.is_some_and(|m| m.status.is_closed()) {
            let msg = OutboxMessage::ChildResult {
                parent: parent.clone(),
                child_run_id: run,
                outcome: outcome.clone(),
            };
            out.put(
                Cf::Outbox,
                keys::outbox_result_key(run),
                enc(RecordKind::Outbox, &msg)?,
            );
        }
    }
    meta.outcome = Some(outcome);
    Ok(())
}

/// Writes the intent to cancel `child` (unless it closed already); of two
/// intents for one child, terminating wins over asking.
fn cancel_child(
    out: &mut dyn KvWrite,
    parent: ParentRef,
    child: RunId,
    policy: ParentClosePolicy,
    reason: String,
) -> Result<()> {
    let child_meta: Option<RunMeta> =
        read_record(out, Cf::Runs, RecordKind::Run, &keys::run_key(child))?;
    if child_meta.is_some_and(|m| m.status.is_closed()) {
        return Ok(());
    }
    let key = keys::outbox_cancel_key(child);
    let existing: Option<OutboxMessage> = read_record(out, Cf::Outbox, RecordKind::Outbox, &key)?;
    if let Some(OutboxMessage::CancelChild {
        policy: ParentClosePolicy::Terminate,
        ..
    }) = existing
    {
        return Ok(());
    }
    let msg = OutboxMessage::CancelChild {
        parent,
        child_run_id: child,
        policy,
        reason,
    };
    out.put(Cf::Outbox, key, enc(RecordKind::Outbox, &msg)?);
    Ok(())
}

fn derive_event(
    out: &mut dyn KvWrite,
    run: RunId,
    meta: &mut Option<RunMeta>,
    event: &Event,
    checks: Checks,
) -> Result<()> {
    let invalid = |detail: String| Error::InvalidCommit { run, detail };
    if let EventKind::WorkflowStarted(start) = &event.kind {
        let WorkflowStart {
            instance_id,
            workflow_type,
            parent,
            continued_from,
            previous_run,
            carried,
            memo,
            search_attributes,
            timeouts,
            ..
        } = &**start;
        if meta.is_some() {
            return Err(invalid(format!("WorkflowStarted at seq {}", event.seq)));
        }
        let ikey = instance_id.as_str().as_bytes().to_vec();
        let current: Option<InstanceMeta> =
            read_record(out, Cf::Instances, RecordKind::Instance, &ikey)?;
        if let Some(cur) = &current {
            let cur_meta: Option<RunMeta> = read_record(
                out,
                Cf::Runs,
                RecordKind::Run,
                &keys::run_key(cur.current_run),
            )?;
            if cur_meta.is_some_and(|m| !m.status.is_closed()) {
                return Err(Error::InstanceRunning {
                    instance: instance_id.clone(),
                    run: cur.current_run,
                });
            }
        }
        // A start is decided against the instance's run at the time (none,
        // or a closed one the reuse policy lets go, or the run continuing
        // as new); it is refused if another run took the instance
        // meanwhile, even one that has closed since.
        let found = current.as_ref().map(|c| c.current_run);
        if checks.stale_starts && found != *previous_run {
            return Err(Error::InstanceMoved {
                instance: instance_id.clone(),
                expected: *previous_run,
                found,
            });
        }
        if continued_from.is_some() {
            out.delete(Cf::Outbox, keys::outbox_continue_key(run));
        }
        if let Some(p) = parent {
            // The parent's record of its child follows the child's chain,
            // so its close policy reaches the run that is open; a parent
            // that closed already applies it at once.
            let ckey = keys::run_step_key(p.run_id, p.step);
            let entry: Option<ChildEntry> =
                read_record(out, Cf::Children, RecordKind::Child, &ckey)?;
            if let Some(mut entry) = entry {
                entry.child_run_id = run;
                out.put(Cf::Children, ckey, enc(RecordKind::Child, &entry)?);
            }
            let parent_meta: Option<RunMeta> =
                read_record(out, Cf::Runs, RecordKind::Run, &keys::run_key(p.run_id))?;
            let parent_closed = parent_meta.as_ref().is_some_and(|m| m.status.is_closed());
            if parent_closed && p.close_policy != ParentClosePolicy::Abandon {
                let reason = format!("parent {} closed", p.run_id);
                cancel_child(out, p.clone(), run, p.close_policy, reason)?;
            }
            // The start row stays until the parent commits `ChildStarted`
            // (its delivery tells the parent, again after a crash); a
            // parent that closed will never take the notice. (A parent not
            // derived yet, as `verify` rebuilds runs in any order, removes
            // the row its `ChildScheduled` writes by its own later events,
            // as it did live.)
            if parent_closed && continued_from.is_none() {
                out.delete(Cf::Outbox, keys::outbox_start_key(p.run_id, p.step));
            }
        }
        let inst = InstanceMeta {
            current_run: run,
            started_at: event.at,
        };
        out.put(Cf::Instances, ikey, enc(RecordKind::Instance, &inst)?);
        let mut started = RunMeta {
            run_id: run,
            instance_id: instance_id.clone(),
            workflow_type: workflow_type.clone(),
            status: RunStatus::Running,
            next_seq: Seq::FIRST,
            parent: parent.clone(),
            started_at: event.at,
            updated_at: event.at,
            closed_at: None,
            outcome: None,
            cancel_requested: false,
            search_attributes: Vec::new(),
            memo: Vec::new(),
        };
        (started.search_attributes, started.memo) =
            search::start_metadata(Some(carried), search_attributes, memo)
                .map_err(|source| Error::Metadata { run, source })?;
        // Each deadline is a timer at its reserved step, an intent like any
        // other: the close removes it, recovery re-arms it.
        for (timeout, fire_at) in timeouts.deadlines(event.at) {
            let entry = TimerEntry {
                run_id: run,
                step: timeout.timer_step(),
                fire_at,
            };
            let bytes = enc(RecordKind::Timer, &entry)?;
            out.put(
                Cf::Timers,
                keys::timer_key(fire_at, run, entry.step),
                bytes.clone(),
            );
            out.put(Cf::RunTimers, keys::run_step_key(run, entry.step), bytes);
        }
        *meta = Some(started);
        return Ok(());
    }
    let m = meta.as_mut().ok_or(Error::UnknownRun { run })?;
    let task_key = |step| keys::run_step_key(run, step);
    match &event.kind {
        EventKind::WorkflowStarted { .. } => unreachable!("handled above"),
        EventKind::WorkflowCompleted { result } => close(
            out,
            run,
            m,
            RunStatus::Completed,
            Outcome::Completed(result.clone()),
            event.at,
        )?,
        EventKind::WorkflowFailed { failure } => close(
            out,
            run,
            m,
            RunStatus::Failed,
            Outcome::Failed(failure.clone()),
            event.at,
        )?,
        EventKind::WorkflowCancelled { reason } => close(
            out,
            run,
            m,
            RunStatus::Cancelled,
            Outcome::Cancelled(reason.clone()),
            event.at,
        )?,
        EventKind::WorkflowTerminated { reason, .. } => close(
            out,
            run,
            m,
            RunStatus::Terminated,
            Outcome::Terminated(reason.clone()),
            event.at,
        )?,
        EventKind::WorkflowTimedOut { timeout, deadline } => close(
            out,
            run,
            m,
            RunStatus::TimedOut,
            timeout.outcome(*deadline),
            event.at,
        )?,
        EventKind::WorkflowContinuedAsNew {
            new_run_id,
            input,
            carried,
        } => {
            close(
                out,
                run,
                m,
                RunStatus::ContinuedAsNew,
                Outcome::ContinuedAsNew(*new_run_id),
                event.at,
            )?;
            let msg = OutboxMessage::Continue {
                from: run,
                instance_id: m.instance_id.clone(),
                workflow_type: m.workflow_type.clone(),
                new_run_id: *new_run_id,
                input: input.clone(),
                parent: m.parent.clone(),
                carried: (**carried).clone(),
            };
            out.put(
                Cf::Outbox,
                keys::outbox_continue_key(*new_run_id),
                enc(RecordKind::Outbox, &msg)?,
            );
        }
        EventKind::WorkflowCancelRequested { .. } => m.cancel_requested = true,
        EventKind::ActivityScheduled {
            step,
            group,
            execution_id,
            activity_type,
            input,
            options,
        } => {
            if execution_id.run_id != run || execution_id.step != *step {
                return Err(invalid(format!(
                    "execution id {execution_id} does not match step {step}"
                )));
            }
            let task = TaskEntry {
                execution_id: *execution_id,
                attempt: crate::ids::AttemptNo::FIRST,
                activity_type: activity_type.clone(),
                input: input.clone(),
                options: (**options).clone(),
                group: group.clone(),
                scheduled_at: event.at,
                due: event.at,
                cancel_requested: false,
                heartbeat: None,
            };
            out.put(Cf::Tasks, task_key(*step), enc(RecordKind::Task, &task)?);
        }
        // Without the duplicate check, a result for an attempt that is no
        // longer pending is let through unchanged (the broken engine's
        // duplicate commit); the pending task stays as it was.
        EventKind::ActivityAttemptFailed {
            step, attempt_id, ..
        }
        | EventKind::ActivityCompleted {
            step, attempt_id, ..
        } if !checks.duplicate_terminals
            && pending_attempt(out, run, *step).ok() != Some(attempt_id.attempt) => {}
        EventKind::ActivityAttemptFailed {
            step,
            attempt_id,
            retry_at,
            heartbeat,
            ..
        } => {
            let mut task = pending_task(out, run, *step)?;
            if task.attempt != attempt_id.attempt {
                return Err(invalid(format!(
                    "attempt {} failed but the pending attempt at step {step} is {}",
                    attempt_id.attempt, task.attempt
                )));
            }
            match retry_at {
                Some(at) => {
                    task.attempt = task.attempt.next();
                    task.due = *at;
                    if heartbeat.is_some() {
                        task.heartbeat = heartbeat.clone();
                    }
                    out.put(Cf::Tasks, task_key(*step), enc(RecordKind::Task, &task)?);
                }
                None => out.delete(Cf::Tasks, task_key(*step)),
            }
        }
        EventKind::ActivityCompleted {
            step, attempt_id, ..
        } => {
            let pending = pending_attempt(out, run, *step)?;
            if pending != attempt_id.attempt {
                return Err(invalid(format!(
                    "attempt {} completed but the pending attempt at step {step} is {pending}",
                    attempt_id.attempt
                )));
            }
            out.delete(Cf::Tasks, task_key(*step));
        }
        EventKind::ActivityCancelRequested { step, .. } => {
            let mut task = pending_task(out, run, *step)?;
            task.cancel_requested = true;
            out.put(Cf::Tasks, task_key(*step), enc(RecordKind::Task, &task)?);
        }
        EventKind::ActivityCancelled { step, .. } => {
            pending_attempt(out, run, *step)?;
            out.delete(Cf::Tasks, task_key(*step));
        }
        EventKind::TimerStarted { step, fire_at, .. } => {
            let entry = TimerEntry {
                run_id: run,
                step: *step,
                fire_at: *fire_at,
            };
            let bytes = enc(RecordKind::Timer, &entry)?;
            out.put(
                Cf::Timers,
                keys::timer_key(*fire_at, run, *step),
                bytes.clone(),
            );
            out.put(Cf::RunTimers, task_key(*step), bytes);
        }
        EventKind::TimerFired { step, .. } | EventKind::TimerCancelled { step, .. } => {
            // The due-order key holds the fire time committed by
            // TimerStarted; delete by that one, not the event's copy, so a
            // misstated time cannot leave a timer due forever.
            let open: Option<TimerEntry> =
                read_record(out, Cf::RunTimers, RecordKind::Timer, &task_key(*step))?;
            let Some(open) = open else {
                return Err(invalid(format!("no open timer at step {step}")));
            };
            out.delete(Cf::Timers, keys::timer_key(open.fire_at, run, *step));
            out.delete(Cf::RunTimers, task_key(*step));
        }
        EventKind::ChildScheduled(child) => {
            let ChildSchedule {
                step,
                child_instance_id,
                child_run_id,
                workflow_type,
                input,
                close_policy,
                memo,
                search_attributes,
                timeouts,
                ..
            } = &**child;
            // Checked here as the child's start will be: a parent cannot
            // commit a child that could never start.
            crate::search::start_metadata(None, search_attributes, memo)
                .map_err(|e| invalid(format!("child at step {step}: {e}")))?;
            let msg = OutboxMessage::StartChild {
                parent: ParentRef {
                    instance_id: m.instance_id.clone(),
                    run_id: run,
                    step: *step,
                    close_policy: *close_policy,
                },
                child_instance_id: child_instance_id.clone(),
                child_run_id: *child_run_id,
                workflow_type: workflow_type.clone(),
                input: input.clone(),
                memo: memo.clone(),
                search_attributes: search_attributes.clone(),
                timeouts: *timeouts,
            };
            out.put(
                Cf::Outbox,
                keys::outbox_start_key(run, *step),
                enc(RecordKind::Outbox, &msg)?,
            );
            let entry = ChildEntry {
                child_run_id: *child_run_id,
                close_policy: *close_policy,
            };
            out.put(
                Cf::Children,
                task_key(*step),
                enc(RecordKind::Child, &entry)?,
            );
        }
        EventKind::ChildCompleted {
            step, child_run_id, ..
        }
        | EventKind::ChildFailed {
            step, child_run_id, ..
        } => {
            out.delete(Cf::Outbox, keys::outbox_result_key(*child_run_id));
            // A child that could not start fails its parent's wait: its
            // start is done with too.
            out.delete(Cf::Outbox, keys::outbox_start_key(run, *step));
            out.delete(Cf::Children, task_key(*step));
            // So is a cancellation sent to it: a child that never started
            // never closes to remove it, and its delivery would meet "no
            // such run" forever. (A child that ran removed it at its close.)
            if matches!(event.kind, EventKind::ChildFailed { .. }) {
                out.delete(Cf::Outbox, keys::outbox_cancel_key(*child_run_id));
            }
        }
        EventKind::ChildCancelRequested {
            step,
            child_run_id,
            policy,
            reason,
        } => {
            let parent = ParentRef {
                instance_id: m.instance_id.clone(),
                run_id: run,
                step: *step,
                close_policy: *policy,
            };
            cancel_child(out, parent, *child_run_id, *policy, reason.clone())?;
        }
        EventKind::MessageReceived { stream, key, .. } => {
            crate::event::check_stream_message(stream, key).map_err(invalid)?;
        }
        EventKind::ExternalSendScheduled {
            step,
            target,
            delivery,
        } => {
            if let crate::event::Delivery::Message { stream, key, .. } = delivery {
                crate::event::check_stream_message(stream, key).map_err(invalid)?;
            }
            let msg = OutboxMessage::Deliver {
                sender: run,
                step: *step,
                target: target.clone(),
                delivery: delivery.clone(),
            };
            out.put(
                Cf::Outbox,
                keys::outbox_deliver_key(run, *step),
                enc(RecordKind::Outbox, &msg)?,
            );
        }
        EventKind::ExternalSendCompleted { step, .. } => {
            out.delete(Cf::Outbox, keys::outbox_deliver_key(run, *step));
        }
        // The parent heard of the start: the start row, kept until now so
        // a crash between the child's start and this commit cannot lose
        // the notice, is done with.
        EventKind::ChildStarted { step, .. } => {
            out.delete(Cf::Outbox, keys::outbox_start_key(run, *step));
        }
        EventKind::SignalReceived { .. }
        | EventKind::UpdateAccepted { .. }
        | EventKind::UpdateCompleted { .. }
        | EventKind::SideEffectRecorded { .. }
        | EventKind::SelectionWinnerRecorded { .. }
        | EventKind::SelectionOperationCancelled { .. } => {}
        EventKind::MemoUpserted { fields } => {
            search::upsert_memo(&mut m.memo, fields)
                .map_err(|source| Error::Metadata { run, source })?;
            warn_near(
                run,
                "memo bytes",
                search::memo_bytes(&m.memo),
                search::MEMO_BYTES_MAX,
            );
        }
        EventKind::SearchAttributesUpserted { attributes } => {
            search::upsert_attributes(&mut m.search_attributes, attributes)
                .map_err(|source| Error::Metadata { run, source })?;
            warn_near(
                run,
                "search attributes",
                m.search_attributes.len(),
                search::SEARCH_ATTRIBUTES_PER_RUN_MAX,
            );
        }
        EventKind::VersionMarker { .. } | EventKind::ScopeCancelled { .. } => {}
    }
    Ok(())
}

/// Whether an attempt's result closes its execution: a completion or a
/// final failure. Such a result records the execution's durable id alone,
/// not its attempt's as well: the execution's row refuses every later
/// result of every attempt of it (see [`execution_also_checked`]), so a
/// second row would refuse nothing more.
fn closes_execution(kind: &EventKind) -> bool {
    matches!(
        kind,
        EventKind::ActivityCompleted { .. }
            | EventKind::ActivityAttemptFailed { retry_at: None, .. }
    )
}

/// The durable id whose row refuses `kind` beside its terminal keys: for
/// an attempt's failure to be retried, its execution's, which stands for
/// the attempt that closed it (see [`closes_execution`]). The other
/// results of an attempt name their execution among their terminal keys.
pub(crate) fn execution_also_checked(kind: &EventKind) -> Option<DurableKey> {
    match kind {
        EventKind::ActivityAttemptFailed {
            step,
            retry_at: Some(_),
            ..
        } => Some(DurableKey::Execution(*step)),
        _ => None,
    }
}

/// The attempt rows a store of schema 5 or older holds that schema 6 no
/// longer writes: each written by the same event as its execution's row
/// (see [`closes_execution`]), so the two hold the same bytes. Their keys,
/// in key order; a migration deletes them.
pub(crate) fn attempt_rows_beside_executions(view: &dyn KvRead) -> Result<Vec<Vec<u8>>> {
    // (attempt row's key, its execution row's key, its value)
    let mut attempts = Vec::new();
    view.scan(Cf::Dedupe, &[], &[], &mut |k, v| {
        if let Some((run, step, _)) = keys::parse_attempt_dedupe_key(k) {
            let execution = keys::dedupe_key(run, &DurableKey::Execution(step));
            attempts.push((k.to_vec(), execution, v.to_vec()));
        }
        true
    })?;
    let mut found = Vec::new();
    for (key, execution, value) in attempts {
        if view.get(Cf::Dedupe, &execution)?.as_deref() == Some(&value[..]) {
            found.push(key);
        }
    }
    Ok(found)
}

fn pending_task(out: &dyn KvRead, run: RunId, step: crate::ids::Step) -> Result<TaskEntry> {
    read_record(
        out,
        Cf::Tasks,
        RecordKind::Task,
        &keys::run_step_key(run, step),
    )?
    .ok_or_else(|| no_pending_task(run, step))
}

fn no_pending_task(run: RunId, step: crate::ids::Step) -> Error {
    Error::InvalidCommit {
        run,
        detail: format!("no pending activity execution at step {step}"),
    }
}

/// The attempt a pending task waits for, read without building the rest of
/// the row: a completion checks only this, and decoding the whole
/// [`TaskEntry`] (its type name, input, options and group) was most of
/// what checking a completion cost the writer.
fn pending_attempt(
    out: &dyn KvRead,
    run: RunId,
    step: crate::ids::Step,
) -> Result<crate::ids::AttemptNo> {
    let key = keys::run_step_key(run, step);
    match out.get(Cf::Tasks, &key)? {
        None => Err(no_pending_task(run, step)),
        Some(bytes) => TaskEntry::attempt_of(&bytes).map_err(|source| Error::Corrupt {
            cf: Cf::Tasks.name(),
            run: keys::run_prefix(&key),
            seq: None,
            source,
        }),
    }
}
