//! Integrity verification: rebuild derived state from events and compare.
//!
//! Two passes over the events: the first checks every record (envelope,
//! checksum, seq in key equals seq in record, contiguity from 1) run by run;
//! the second folds each sound run's events, oldest run first, through the
//! same `apply_append_checked` the commit path uses (without the check of
//! a start's decision, which only the commit that made it can judge), into
//! fresh column families, then compares those with the stored derived
//! families key by key.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::codec::{self, RecordKind};
use crate::derive::{apply_append_checked, Checks};
use crate::error::{Error, Result};
use crate::event::{Event, EventKind, WorkflowStart};
use crate::ids::{RunId, Seq, Timestamp};
use crate::keys::{self, Cf};
use crate::kv::{KvRead, KvWrite, Maps, Overlay};
use crate::state::{InstanceMeta, OutboxMessage, RunMeta};
use crate::VERIFY_VIOLATIONS_MAX;

/// One integrity violation.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Violation {
    /// A record does not decode (bad checksum, bad envelope, bad body).
    Corrupt {
        /// Column family.
        cf: String,
        /// The run, where the key names one.
        run: Option<String>,
        /// The seq, for an event.
        seq: Option<u64>,
        /// What is wrong.
        detail: String,
    },
    /// A run's seqs skip a number.
    Gap {
        /// The run.
        run: String,
        /// The seq expected next.
        expected: u64,
        /// The seq found.
        found: u64,
    },
    /// The seq in an event's key differs from the one in its record.
    SeqMismatch {
        /// The run.
        run: String,
        /// Seq in the key.
        key_seq: u64,
        /// Seq in the record.
        record_seq: u64,
    },
    /// A durable id has a second terminal event.
    DuplicateTerminal {
        /// The run.
        run: String,
        /// The durable id.
        key: String,
        /// The first terminal event.
        first_seq: u64,
        /// The second one.
        seq: u64,
    },
    /// A history that the commit path would have refused.
    InvalidHistory {
        /// The run.
        run: String,
        /// The offending event.
        seq: u64,
        /// Why.
        detail: String,
    },
    /// Stored derived state disagrees with what the events imply.
    DerivedMismatch {
        /// Column family.
        cf: String,
        /// The key, hex.
        key: String,
        /// `missing` (implied, not stored), `extra` (stored, not implied) or
        /// `differs`.
        problem: String,
    },
}

/// The result of [`crate::Store::verify`].
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct VerifyReport {
    /// True when there are no violations.
    pub ok: bool,
    /// Runs found in the events.
    pub runs: u64,
    /// Events read.
    pub events: u64,
    /// The violations, at most [`VERIFY_VIOLATIONS_MAX`].
    pub violations: Vec<Violation>,
    /// True when more violations were found than listed.
    pub truncated: bool,
}

struct Report {
    inner: VerifyReport,
}

impl Report {
    fn push(&mut self, v: Violation) {
        if self.inner.violations.len() < VERIFY_VIOLATIONS_MAX {
            self.inner.violations.push(v);
        } else {
            self.inner.truncated = true;
        }
    }
}

/// State rebuilt from events. Outbox messages cross runs (a parent's
/// schedule is removed by its child's start, a child's result by its
/// parent's receipt), and runs are folded one whole history at a time, so a
/// removal may be folded before its addition: an outbox key removed at any
/// point stays removed.
#[derive(Default)]
struct Rebuilt {
    maps: Maps,
    outbox_removed: BTreeSet<Vec<u8>>,
}

impl KvRead for Rebuilt {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.maps.get(cf, key)
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        self.maps.scan(cf, prefix, from, visit)
    }

    /// Rebuilt from the events, every record whole.
    fn records_lag(&self) -> bool {
        false
    }
}

impl KvWrite for Rebuilt {
    fn put(&mut self, cf: Cf, key: Vec<u8>, value: Vec<u8>) {
        if cf == Cf::Outbox && self.outbox_removed.contains(&key) {
            return;
        }
        self.maps.put(cf, key, value);
    }

    fn delete(&mut self, cf: Cf, key: Vec<u8>) {
        if cf == Cf::Outbox {
            self.outbox_removed.insert(key.clone());
        }
        self.maps.delete(cf, key);
    }
}

/// Verifies a store through its byte-level view.
pub fn verify(view: &dyn KvRead) -> Result<VerifyReport> {
    let (rebuilt, broken, mut report) = rebuild_inner(view)?;
    compare(view, &rebuilt, &broken, &mut report)?;
    report.inner.ok = report.inner.violations.is_empty();
    Ok(report.inner)
}

/// The derived state the events of `view` imply, folded through the
/// commit path's own code (what a schema migration writes), with the
/// problems found on the way (runs with gaps, bad records or histories the
/// commit path would refuse are left out of the state).
pub fn rebuild(view: &dyn KvRead) -> Result<(Maps, VerifyReport)> {
    let (rebuilt, _, mut report) = rebuild_inner(view)?;
    report.inner.ok = report.inner.violations.is_empty();
    Ok((rebuilt.maps, report.inner))
}

fn rebuild_inner(view: &dyn KvRead) -> Result<(Rebuilt, BTreeSet<RunId>, Report)> {
    let mut report = Report {
        inner: VerifyReport {
            ok: true,
            runs: 0,
            events: 0,
            violations: Vec::new(),
            truncated: false,
        },
    };

    // Pass 1: every record, run by run.
    let mut sound: Vec<RunScan> = Vec::new();
    let mut broken: BTreeSet<RunId> = BTreeSet::new();
    let mut current: Option<RunScan> = None;
    let finish = |cur: Option<RunScan>, sound: &mut Vec<RunScan>, broken: &mut BTreeSet<RunId>| {
        if let Some(scan) = cur {
            if scan.ok && scan.started.is_some() {
                sound.push(scan);
            } else {
                broken.insert(scan.run);
            }
        }
    };
    view.scan(Cf::Events, &[], &[], &mut |k, v| {
        report.inner.events += 1;
        let Some((run, key_seq)) = keys::parse_event_key(k) else {
            report.push(Violation::Corrupt {
                cf: "events".into(),
                run: None,
                seq: None,
                detail: format!("malformed key {}", hex(k)),
            });
            return true;
        };
        if current.as_ref().map(|c| c.run) != Some(run) {
            finish(current.take(), &mut sound, &mut broken);
            report.inner.runs += 1;
            current = Some(RunScan {
                run,
                next: Seq::FIRST,
                started: None,
                closed: None,
                previous: None,
                ok: true,
            });
        }
        let cur = current.as_mut().expect("set above");
        if key_seq != cur.next {
            report.push(Violation::Gap {
                run: run.to_string(),
                expected: cur.next.0,
                found: key_seq.0,
            });
            cur.ok = false;
        }
        // Saturating: a damaged key may carry the largest seq.
        cur.next = Seq(key_seq.0.saturating_add(1));
        match codec::decode::<Event>(RecordKind::Event, v) {
            Ok(e) => {
                if e.seq != key_seq {
                    report.push(Violation::SeqMismatch {
                        run: run.to_string(),
                        key_seq: key_seq.0,
                        record_seq: e.seq.0,
                    });
                    cur.ok = false;
                }
                if key_seq == Seq::FIRST {
                    if let EventKind::WorkflowStarted(start) = &e.kind {
                        let WorkflowStart {
                            continued_from,
                            previous_run,
                            ..
                        } = &**start;
                        cur.started = Some(e.at);
                        cur.previous = previous_run.or(*continued_from);
                    }
                }
                if e.kind.closes_run() {
                    cur.closed = Some(e.at);
                }
            }
            Err(err) => {
                report.push(Violation::Corrupt {
                    cf: "events".into(),
                    run: Some(run.to_string()),
                    seq: Some(key_seq.0),
                    detail: err.to_string(),
                });
                cur.ok = false;
            }
        }
        true
    })?;
    finish(current.take(), &mut sound, &mut broken);
    for run in &broken {
        if !report
            .inner
            .violations
            .iter()
            .any(|v| violation_run(v) == Some(run.to_string()))
        {
            report.push(Violation::InvalidHistory {
                run: run.to_string(),
                seq: 1,
                detail: "the first event is not WorkflowStarted".into(),
            });
        }
    }

    // Pass 2: fold sound runs, oldest first, through the commit path's code.
    let order = fold_order(&sound);
    let mut rebuilt = Rebuilt::default();
    for run in &order {
        let mut events = Vec::new();
        view.scan(Cf::Events, run.as_bytes(), run.as_bytes(), &mut |_, v| {
            if let Ok(e) = codec::decode::<Event>(RecordKind::Event, v) {
                events.push((e, v.to_vec()));
            }
            true
        })?;
        for (event, bytes) in events {
            let seq = event.seq;
            let mut overlay = Overlay::new(&rebuilt);
            match apply_append_checked(&mut overlay, *run, &[event], &[bytes], Checks::REDERIVE) {
                Ok(_) => {
                    let writes = overlay.into_writes();
                    for ((cf, k), v) in writes {
                        match v {
                            Some(v) => rebuilt.put(cf, k, v),
                            None => rebuilt.delete(cf, k),
                        }
                    }
                }
                Err(Error::DuplicateTerminal { key, committed, .. }) => {
                    report.push(Violation::DuplicateTerminal {
                        run: run.to_string(),
                        key: key.to_string(),
                        first_seq: committed.0,
                        seq: seq.0,
                    });
                    broken.insert(*run);
                    break;
                }
                Err(e) => {
                    report.push(Violation::InvalidHistory {
                        run: run.to_string(),
                        seq: seq.0,
                        detail: e.to_string(),
                    });
                    broken.insert(*run);
                    break;
                }
            }
        }
    }

    Ok((rebuilt, broken, report))
}

/// Compares the stored derived families with the rebuilt ones, skipping
/// keys of runs already reported.
fn compare(
    view: &dyn KvRead,
    rebuilt: &Rebuilt,
    broken: &BTreeSet<RunId>,
    report: &mut Report,
) -> Result<()> {
    for cf in Cf::DERIVED {
        let mut stored: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        view.scan(cf, &[], &[], &mut |k, v| {
            stored.insert(k.to_vec(), v.to_vec());
            true
        })?;
        if cf == Cf::Runs && view.records_lag() {
            catch_up_stored(view, &mut stored);
        }
        let expected = rebuilt.maps.cf(cf);
        let skip = |k: &[u8], v: &[u8]| {
            key_run(cf, k)
                .into_iter()
                .chain(value_runs(cf, v))
                .any(|r| broken.contains(&r))
        };
        for (k, v) in expected {
            if skip(k, v) || stored.get(k).is_some_and(|s| skip(k, s)) {
                continue;
            }
            match stored.get(k) {
                None => report.push(mismatch(cf, k, "missing")),
                Some(s) if !same_record(cf, s, v) => report.push(mismatch(cf, k, "differs")),
                Some(_) => {}
            }
        }
        for (k, v) in &stored {
            if !expected.contains_key(k) && !skip(k, v) {
                report.push(mismatch(cf, k, "extra"));
            }
        }
    }
    Ok(())
}

/// Brings the stored records of open runs up to their events, as every
/// reader does (`derive::catch_up`): a store whose records lag leaves out
/// the rewrites that only move a run's progress, and the rebuilt records
/// have them. A record that does not decode, or whose events do not, is
/// left as stored for the comparison to report.
fn catch_up_stored(view: &dyn KvRead, stored: &mut BTreeMap<Vec<u8>, Vec<u8>>) {
    for (k, v) in stored.iter_mut() {
        let Some(run) = keys::run_prefix(k) else {
            continue;
        };
        let Ok(mut meta) = codec::decode::<RunMeta>(RecordKind::Run, v) else {
            continue;
        };
        if meta.status.is_closed() {
            continue;
        }
        if crate::derive::catch_up(view, run, &mut meta).is_ok() {
            if let Ok(bytes) = codec::encode(RecordKind::Run, &meta) {
                *v = bytes;
            }
        }
    }
}

/// Whether a stored derived record says what the rebuilt one says. Equal
/// bytes do; otherwise the stored one may be an older build's encoding
/// (a map with field names, an older version) of the same value, so it is
/// decoded as its family's record and encoded again by this build.
fn same_record(cf: Cf, stored: &[u8], rebuilt: &[u8]) -> bool {
    fn again<T: Serialize + serde::de::DeserializeOwned>(
        kind: RecordKind,
        stored: &[u8],
    ) -> Option<Vec<u8>> {
        let value: T = codec::decode(kind, stored).ok()?;
        codec::encode(kind, &value).ok()
    }
    if stored == rebuilt {
        return true;
    }
    let current = match cf {
        Cf::Runs => again::<RunMeta>(RecordKind::Run, stored),
        Cf::Instances => again::<InstanceMeta>(RecordKind::Instance, stored),
        Cf::Dedupe => again::<crate::state::DedupeEntry>(RecordKind::Dedupe, stored),
        Cf::Timers | Cf::RunTimers => again::<crate::TimerEntry>(RecordKind::Timer, stored),
        Cf::Outbox => again::<OutboxMessage>(RecordKind::Outbox, stored),
        Cf::Tasks => again::<crate::TaskEntry>(RecordKind::Task, stored),
        Cf::Children => again::<crate::ChildEntry>(RecordKind::Child, stored),
        Cf::Events | Cf::Index | Cf::Meta => None,
    };
    current.is_some_and(|c| c == rebuilt)
}

/// What pass 1 learned about one run's events.
struct RunScan {
    run: RunId,
    /// The seq expected next.
    next: Seq,
    /// When its WorkflowStarted (seq 1) was committed.
    started: Option<Timestamp>,
    /// When its closing event was committed.
    closed: Option<Timestamp>,
    /// The instance's run it follows (`previous_run`, or for histories
    /// written before that field, the run it continues).
    previous: Option<RunId>,
    /// No gap, no bad record.
    ok: bool,
}

/// The order to fold sound runs in: the order their instances saw them.
/// Each start records the instance's run it follows, so the runs of one
/// instance form a chain: they are folded along it (root first), whatever
/// their clocks said. Runs without a recorded link (histories of the first
/// schema) fall back to start, then close time (open runs last).
fn fold_order(sound: &[RunScan]) -> Vec<RunId> {
    let by_run: BTreeMap<RunId, &RunScan> = sound.iter().map(|s| (s.run, s)).collect();
    let root_and_depth = |scan: &RunScan| {
        let mut d = 0usize;
        let mut at = scan;
        // Bounded: a damaged chain may loop.
        while let Some(prev) = at.previous.and_then(|p| by_run.get(&p)) {
            if d >= sound.len() {
                break;
            }
            d += 1;
            at = prev;
        }
        (at.started, d)
    };
    let mut keyed: Vec<_> = sound
        .iter()
        .map(|s| {
            let closed = s.closed.unwrap_or(Timestamp(u64::MAX));
            let (root_started, depth) = root_and_depth(s);
            ((root_started, depth, s.started, closed, s.run), s.run)
        })
        .collect();
    keyed.sort();
    keyed.into_iter().map(|(_, run)| run).collect()
}

/// Runs a derived record's value refers to beyond its key: an instance's
/// current run, an outbox message's parent and child. A record of a broken
/// run is not compared, because that run was not folded.
fn value_runs(cf: Cf, value: &[u8]) -> Vec<RunId> {
    match cf {
        Cf::Instances => codec::decode::<InstanceMeta>(RecordKind::Instance, value)
            .map(|i| vec![i.current_run])
            .unwrap_or_default(),
        Cf::Outbox => match codec::decode::<OutboxMessage>(RecordKind::Outbox, value) {
            Ok(OutboxMessage::StartChild {
                parent,
                child_run_id,
                ..
            })
            | Ok(OutboxMessage::ChildResult {
                parent,
                child_run_id,
                ..
            })
            | Ok(OutboxMessage::CancelChild {
                parent,
                child_run_id,
                ..
            }) => vec![parent.run_id, child_run_id],
            Ok(OutboxMessage::Continue {
                from, new_run_id, ..
            }) => vec![from, new_run_id],
            Ok(OutboxMessage::Deliver { sender, .. }) => vec![sender],
            Err(_) => Vec::new(),
        },
        _ => Vec::new(),
    }
}

fn violation_run(v: &Violation) -> Option<String> {
    match v {
        Violation::Corrupt { run, .. } => run.clone(),
        Violation::Gap { run, .. }
        | Violation::SeqMismatch { run, .. }
        | Violation::DuplicateTerminal { run, .. }
        | Violation::InvalidHistory { run, .. } => Some(run.clone()),
        Violation::DerivedMismatch { .. } => None,
    }
}

fn mismatch(cf: Cf, key: &[u8], problem: &str) -> Violation {
    Violation::DerivedMismatch {
        cf: cf.name().into(),
        key: hex(key),
        problem: problem.into(),
    }
}

/// The run a derived key belongs to, where the key layout names one.
fn key_run(cf: Cf, key: &[u8]) -> Option<RunId> {
    match cf {
        Cf::Runs | Cf::Dedupe | Cf::RunTimers | Cf::Tasks | Cf::Events | Cf::Children => {
            keys::run_prefix(key)
        }
        Cf::Timers => key.get(8..).and_then(keys::run_prefix),
        Cf::Outbox => key.get(1..).and_then(keys::run_prefix),
        Cf::Index => key
            .len()
            .checked_sub(16)
            .and_then(|start| keys::run_prefix(&key[start..])),
        Cf::Instances | Cf::Meta => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
