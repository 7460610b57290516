//! The invariants the simulator checks, independently of the store's own
//! validation.
//!
//! During a run (after every step, on the runs the step touched, and on
//! every run after a crash): the log is append-only and gap-free (a shadow
//! copy of every acknowledged event must still be in the store, byte for
//! byte); at most one committed terminal event per durable id (computed
//! from the events with `EventKind::terminal_keys`, not from the store's
//! dedupe records); every effect names an event that is already durable;
//! a `select` winner, once acknowledged, never changes. At the end: offline
//! replay of every final history reproduces it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use keel_core::{Input, RunMachine, StartSpec, WorkflowRegistry};
use keel_storage::codec::{self, RecordKind};
use keel_storage::event::DurableKey;
use keel_storage::keys::{self, Cf};
use keel_storage::{Event, EventKind, RunFilter, RunId, SelectKey, Seq, Step};
use serde::Serialize;

use crate::store::SimStore;

/// What kind of invariant a violation breaks.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ViolationKind {
    /// An acknowledged event changed, or a history has a gap.
    LogRewritten,
    /// An acknowledged event is gone after a crash.
    AckedCommitLost,
    /// A durable id has two committed terminal events.
    DuplicateTerminal,
    /// An effect ran for an event that was not durable.
    EffectBeforeDurable,
    /// An acknowledged `select` winner changed.
    SelectWinnerChanged,
    /// The store refused a commit the engine believed valid.
    CommitRefused,
    /// A run was parked.
    Parked,
    /// A workflow did not finish after the faults stopped.
    NotFinished,
    /// A workflow finished with another outcome than the fault-free run.
    OutcomeMismatch,
    /// Offline replay of a final history does not reproduce it.
    ReplayMismatch,
    /// An instance ran more than one run chain.
    DuplicateRun,
    /// `verify` found the store inconsistent.
    VerifyFailed,
    /// The simulation did not settle within its step or time limit.
    NoQuiescence,
    /// An attempt was delivered under an epoch that was not new: the copy
    /// it replaces is not fenced.
    EpochReused,
    /// Work was left behind once every run closed: an intent row (a pending
    /// attempt, a timer, an outbox message) nothing will ever consume.
    IntentLeftOver,
    /// A client was answered something the durable state does not say (an
    /// outcome or a description ahead of the synced store), or an answer
    /// that does not fit its request.
    WrongAnswer,
    /// A client request went unanswered through every retry.
    RequestUnanswered,
    /// A message stream of a run chain skipped or repeated an offset.
    StreamBroken,
    /// A schedule started one trigger time twice (two commands, or two
    /// runs of its instance).
    TriggerTwice,
    /// A run closed as timed out before its deadline, or on a deadline its
    /// start did not record, or a continue-as-new changed its timeouts.
    TimeoutWrong,
    /// A cancelled activity was handled against its cancellation type: an
    /// abandoned one was asked to cancel, or a scope completed before a
    /// waited-for one closed.
    CancellationBroken,
    /// A process committed for a shard whose lease it no longer held
    /// (several processes): the fence every commit carries was missing.
    FencedCommit,
    /// A process still holds the closure of an async child that closed:
    /// memory that grows with the work done.
    ClosureLeftOver,
}

impl ViolationKind {
    /// The kebab-case name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            ViolationKind::LogRewritten => "log-rewritten",
            ViolationKind::AckedCommitLost => "acked-commit-lost",
            ViolationKind::DuplicateTerminal => "duplicate-terminal",
            ViolationKind::EffectBeforeDurable => "effect-before-durable",
            ViolationKind::SelectWinnerChanged => "select-winner-changed",
            ViolationKind::CommitRefused => "commit-refused",
            ViolationKind::Parked => "parked",
            ViolationKind::NotFinished => "not-finished",
            ViolationKind::OutcomeMismatch => "outcome-mismatch",
            ViolationKind::ReplayMismatch => "replay-mismatch",
            ViolationKind::DuplicateRun => "duplicate-run",
            ViolationKind::VerifyFailed => "verify-failed",
            ViolationKind::NoQuiescence => "no-quiescence",
            ViolationKind::EpochReused => "epoch-reused",
            ViolationKind::IntentLeftOver => "intent-left-over",
            ViolationKind::WrongAnswer => "wrong-answer",
            ViolationKind::RequestUnanswered => "request-unanswered",
            ViolationKind::StreamBroken => "stream-broken",
            ViolationKind::TriggerTwice => "trigger-twice",
            ViolationKind::TimeoutWrong => "timeout-wrong",
            ViolationKind::CancellationBroken => "cancellation-broken",
            ViolationKind::FencedCommit => "fenced-commit",
            ViolationKind::ClosureLeftOver => "closure-left-over",
        }
    }
}

impl fmt::Display for ViolationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One broken invariant.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct Violation {
    /// Which invariant.
    pub kind: ViolationKind,
    /// Virtual time it was found at, in milliseconds.
    pub at_ms: u64,
    /// What was expected and what was found.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{} at {} ms] {}", self.kind, self.at_ms, self.detail)
    }
}

#[derive(Default)]
struct Shadow {
    /// Encoded bytes of every event known durable: acknowledged, or found
    /// in the store after a crash.
    events: BTreeMap<Seq, Vec<u8>>,
    /// Terminal durable ids of those events.
    terminals: BTreeMap<DurableKey, Seq>,
}

/// The checker's own record of what was acknowledged.
#[derive(Default)]
pub(crate) struct Checker {
    runs: BTreeMap<RunId, Shadow>,
    winners: BTreeMap<(RunId, Step), (u32, SelectKey)>,
    touched: BTreeSet<RunId>,
    pub(crate) violations: Vec<Violation>,
}

pub(crate) fn encode_event(e: &Event) -> Vec<u8> {
    codec::encode(RecordKind::Event, e).expect("an event the machine produced encodes")
}

impl Checker {
    fn violate(&mut self, kind: ViolationKind, at_ms: u64, detail: String) {
        self.violations.push(Violation {
            kind,
            at_ms,
            detail,
        });
    }

    pub(crate) fn failed(&self) -> bool {
        !self.violations.is_empty()
    }

    /// Marks a run as touched by this step (its commit was written).
    pub(crate) fn touch(&mut self, run: RunId) {
        self.touched.insert(run);
    }

    /// Records events as durable: acknowledged by the group commit, or
    /// found in the store after a crash.
    pub(crate) fn durable(&mut self, run: RunId, events: &[Event], now: u64) {
        self.touched.insert(run);
        for e in events {
            let bytes = encode_event(e);
            let shadow = self.runs.entry(run).or_default();
            if let Some(old) = shadow.events.get(&e.seq) {
                if *old != bytes {
                    self.violate(
                        ViolationKind::LogRewritten,
                        now,
                        format!(
                            "run {run} seq {}: acknowledged twice with different contents ({})",
                            e.seq,
                            e.kind.name()
                        ),
                    );
                }
                continue;
            }
            shadow.events.insert(e.seq, bytes);
            let mut dup = None;
            for key in e.kind.terminal_keys() {
                match shadow.terminals.get(&key) {
                    Some(first) if *first != e.seq => dup = Some((key, *first)),
                    Some(_) => {}
                    None => {
                        shadow.terminals.insert(key, e.seq);
                    }
                }
            }
            if let Some((key, first)) = dup {
                self.violate(
                    ViolationKind::DuplicateTerminal,
                    now,
                    format!(
                        "run {run}: {key} has terminal events at seq {first} and seq {} ({})",
                        e.seq,
                        e.kind.name()
                    ),
                );
            }
            if let EventKind::SelectionWinnerRecorded {
                step,
                member_index,
                key,
                ..
            } = &e.kind
            {
                let winner = (*member_index, key.clone());
                match self.winners.get(&(run, *step)) {
                    Some(w) if *w != winner => {
                        let detail = format!(
                            "run {run} select at step {step}: winner {} ({}) became {} ({})",
                            w.0, w.1, winner.0, winner.1
                        );
                        self.violate(ViolationKind::SelectWinnerChanged, now, detail);
                    }
                    Some(_) => {}
                    None => {
                        self.winners.insert((run, *step), winner);
                    }
                }
            }
        }
    }

    /// An effect is about to run because of event `seq` of `run`: that
    /// event must be durable already.
    pub(crate) fn effect(&mut self, store: &SimStore, run: RunId, seq: Seq, what: &str, now: u64) {
        if store.durable_event(run, seq).is_none() {
            self.violate(
                ViolationKind::EffectBeforeDurable,
                now,
                format!("{what} for run {run} ran before its event at seq {seq} was durable"),
            );
        }
    }

    /// After a crash: every acknowledged event must still be there, and
    /// whatever the store kept is durable from now on.
    pub(crate) fn after_crash(&mut self, store: &SimStore, now: u64) {
        let known: Vec<RunId> = self.runs.keys().copied().collect();
        for run in known {
            self.check_run(store, run, now, true);
        }
        let metas = match store.store().runs(&RunFilter::default()) {
            Ok(m) => m,
            Err(e) => {
                self.violate(
                    ViolationKind::LogRewritten,
                    now,
                    format!("runs unreadable after the crash: {e}"),
                );
                return;
            }
        };
        for meta in metas {
            match store.store().history(meta.run_id) {
                Ok(h) => self.durable(meta.run_id, &h, now),
                Err(e) => self.violate(
                    ViolationKind::LogRewritten,
                    now,
                    format!("run {} unreadable after the crash: {e}", meta.run_id),
                ),
            }
        }
        self.touched.clear();
    }

    /// Checks the runs touched since the last call.
    pub(crate) fn check_touched(&mut self, store: &SimStore, now: u64) {
        let touched = std::mem::take(&mut self.touched);
        for run in touched {
            self.check_run(store, run, now, false);
        }
    }

    /// Checks every run.
    pub(crate) fn check_all(&mut self, store: &SimStore, now: u64) {
        let known: Vec<RunId> = self.runs.keys().copied().collect();
        for run in known {
            self.check_run(store, run, now, false);
        }
        self.touched.clear();
    }

    /// The store's history of `run` is gap-free from seq 1, holds every
    /// shadow event byte for byte, and its events beyond the shadow close
    /// no durable id twice.
    fn check_run(&mut self, store: &SimStore, run: RunId, now: u64, after_crash: bool) {
        let mut expected = Seq::FIRST;
        let mut problems: Vec<(ViolationKind, String)> = Vec::new();
        let mut tail: Vec<Vec<u8>> = Vec::new();
        let shadow = self.runs.get(&run);
        let mut matched = 0usize;
        let scan = store.store().view().scan(
            Cf::Events,
            run.as_bytes(),
            &keys::event_key(run, Seq::FIRST),
            &mut |k, v| {
                let seq = keys::parse_event_key(k).map(|(_, s)| s);
                if seq != Some(expected) {
                    problems.push((
                        ViolationKind::LogRewritten,
                        format!("run {run}: expected seq {expected}, found {seq:?} (a gap)"),
                    ));
                    return false;
                }
                match shadow.and_then(|s| s.events.get(&expected)) {
                    Some(bytes) if bytes.as_slice() == v => matched += 1,
                    Some(_) => problems.push((
                        ViolationKind::LogRewritten,
                        format!("run {run} seq {expected}: an acknowledged event was rewritten"),
                    )),
                    None => tail.push(v.to_vec()),
                }
                expected = expected.next();
                true
            },
        );
        if let Err(e) = scan {
            problems.push((
                ViolationKind::LogRewritten,
                format!("run {run}: events unreadable: {e}"),
            ));
        }
        let shadow_len = shadow.map_or(0, |s| s.events.len());
        if matched < shadow_len {
            let lost = shadow
                .map(|s| {
                    s.events
                        .keys()
                        .filter(|seq| **seq >= expected)
                        .map(|s| s.0.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            let kind = if after_crash {
                ViolationKind::AckedCommitLost
            } else {
                ViolationKind::LogRewritten
            };
            problems.push((
                kind,
                format!("run {run}: acknowledged events at seq {lost} are no longer in the store"),
            ));
        }
        // Events written but not known durable yet: decode them for the
        // terminal-id check (few: the group commit acknowledges quickly).
        let mut seen: BTreeMap<DurableKey, Seq> =
            shadow.map(|s| s.terminals.clone()).unwrap_or_default();
        for bytes in tail {
            let e: Event = match codec::decode(RecordKind::Event, &bytes) {
                Ok(e) => e,
                Err(err) => {
                    problems.push((
                        ViolationKind::LogRewritten,
                        format!("run {run}: an event does not decode: {err}"),
                    ));
                    continue;
                }
            };
            for key in e.kind.terminal_keys() {
                if let Some(first) = seen.get(&key) {
                    problems.push((
                        ViolationKind::DuplicateTerminal,
                        format!(
                            "run {run}: {key} has terminal events at seq {first} and seq {} ({})",
                            e.seq,
                            e.kind.name()
                        ),
                    ));
                } else {
                    seen.insert(key, e.seq);
                }
            }
        }
        for (kind, detail) in problems {
            self.violate(kind, now, detail);
        }
    }

    /// Message streams, over each chain of runs continued as new: one
    /// committed message per idempotency key, and offsets from 0 without a
    /// gap or a repeat, in the order the chain committed them.
    pub(crate) fn check_streams(&mut self, histories: &BTreeMap<RunId, Vec<Event>>, now: u64) {
        let mut next_of: BTreeMap<RunId, RunId> = BTreeMap::new();
        let mut roots = Vec::new();
        for (run, history) in histories {
            if let Some(EventKind::WorkflowStarted(start)) = history.first().map(|e| &e.kind) {
                match &start.continued_from {
                    Some(from) => {
                        next_of.insert(*from, *run);
                    }
                    None => roots.push(*run),
                }
            }
        }
        let mut problems = Vec::new();
        // Per instance: the offset each (stream, key) was committed at.
        let mut committed: BTreeMap<String, BTreeMap<(String, String), u64>> = BTreeMap::new();
        for root in roots {
            let instance = match histories
                .get(&root)
                .and_then(|h| h.first())
                .map(|e| &e.kind)
            {
                Some(EventKind::WorkflowStarted(start)) => start.instance_id.to_string(),
                _ => continue,
            };
            let offsets = committed.entry(instance).or_default();
            // Per stream: the next offset, and the keys committed.
            let mut streams: BTreeMap<&str, (u64, BTreeMap<&str, u64>)> = BTreeMap::new();
            let mut run = Some(root);
            while let Some(r) = run {
                for e in histories.get(&r).into_iter().flatten() {
                    let EventKind::MessageReceived {
                        stream,
                        offset,
                        key,
                        ..
                    } = &e.kind
                    else {
                        continue;
                    };
                    offsets.insert((stream.clone(), key.0.clone()), *offset);
                    let (next, keys) = streams.entry(stream.as_str()).or_default();
                    if let Some(first) = keys.insert(key.0.as_str(), *offset) {
                        problems.push((
                            ViolationKind::DuplicateTerminal,
                            format!(
                                "chain of run {root}: message {key} on {stream} committed at \
                                 offsets {first} and {offset}"
                            ),
                        ));
                    }
                    if *offset != *next {
                        problems.push((
                            ViolationKind::StreamBroken,
                            format!(
                                "chain of run {root}: run {r} seq {} commits offset {offset} on \
                                 {stream}, the stream's next is {next}",
                                e.seq
                            ),
                        ));
                    }
                    *next = offset + 1;
                }
                run = next_of.get(&r).copied();
            }
        }
        // A send from workflow code was answered with the offset its
        // target's chain committed the key at.
        for (run, history) in histories {
            let mut sent = BTreeMap::new();
            for e in history {
                match &e.kind {
                    EventKind::ExternalSendScheduled {
                        step,
                        target,
                        delivery: keel_storage::Delivery::Message { stream, key, .. },
                    } => {
                        sent.insert(*step, (target.clone(), stream.clone(), key.0.clone()));
                    }
                    EventKind::ExternalSendCompleted {
                        step,
                        offset: Some(answered),
                        ..
                    } => {
                        let Some((target, stream, key)) = sent.get(step) else {
                            continue;
                        };
                        let durable = committed
                            .get(target)
                            .and_then(|o| o.get(&(stream.clone(), key.clone())));
                        if durable != Some(answered) {
                            problems.push((
                                ViolationKind::WrongAnswer,
                                format!(
                                    "run {run} step {step}: send of {key} on {stream} to \
                                     {target} answered offset {answered}, committed at \
                                     {durable:?}"
                                ),
                            ));
                        }
                    }
                    _ => {}
                }
            }
        }
        for (kind, detail) in problems {
            self.violate(kind, now, detail);
        }
    }

    /// Schedules: each trigger time is one command in the schedule's
    /// histories (its whole chain) and one run of the instance it names.
    pub(crate) fn check_schedules(&mut self, histories: &BTreeMap<RunId, Vec<Event>>, now: u64) {
        use keel_core::schedule::SCHEDULE_WORKFLOW_TYPE;
        let mut problems = Vec::new();
        // Per schedule instance: the trigger instances its runs scheduled.
        let mut commands: BTreeMap<String, BTreeMap<String, u32>> = BTreeMap::new();
        // Per trigger instance: its runs.
        let mut runs: BTreeMap<String, Vec<RunId>> = BTreeMap::new();
        let mut schedule_runs = std::collections::BTreeSet::new();
        for (run, history) in histories {
            if let Some(EventKind::WorkflowStarted(start)) = history.first().map(|e| &e.kind) {
                let keel_storage::WorkflowStart {
                    instance_id,
                    workflow_type,
                    ..
                } = &**start;
                if workflow_type == SCHEDULE_WORKFLOW_TYPE {
                    schedule_runs.insert(*run);
                    let triggers = commands.entry(instance_id.to_string()).or_default();
                    for e in history {
                        if let EventKind::ChildScheduled(child) = &e.kind {
                            let keel_storage::ChildSchedule {
                                child_instance_id, ..
                            } = &**child;
                            *triggers.entry(child_instance_id.to_string()).or_default() += 1;
                        }
                    }
                }
            }
        }
        for (run, history) in histories {
            let Some(EventKind::WorkflowStarted(start)) = history.first().map(|e| &e.kind) else {
                continue;
            };
            if let keel_storage::WorkflowStart {
                instance_id,
                parent: Some(parent),
                continued_from: None,
                ..
            } = &**start
            {
                // A trigger's run that continued as new is one chain.
                if schedule_runs.contains(&parent.run_id) {
                    runs.entry(instance_id.to_string()).or_default().push(*run);
                }
            }
        }
        for (schedule, triggers) in &commands {
            for (trigger, n) in triggers {
                if *n > 1 {
                    problems.push(format!("{schedule} scheduled {trigger} {n} times"));
                }
            }
        }
        for (trigger, r) in &runs {
            if r.len() > 1 {
                problems.push(format!("trigger instance {trigger} has runs {r:?}"));
            }
        }
        for detail in problems {
            self.violate(ViolationKind::TriggerTwice, now, detail);
        }
    }

    /// Timeouts: a run closes as timed out at or after the deadline its
    /// start recorded, and a continuation keeps the timeouts of the run
    /// it continues.
    pub(crate) fn check_timeouts(&mut self, histories: &BTreeMap<RunId, Vec<Event>>, now: u64) {
        let mut problems = Vec::new();
        for (run, history) in histories {
            let Some(first) = history.first() else {
                continue;
            };
            let EventKind::WorkflowStarted(start) = &first.kind else {
                continue;
            };
            let keel_storage::WorkflowStart {
                timeouts, carried, ..
            } = &**start;
            if let Some(EventKind::WorkflowContinuedAsNew { carried: next, .. }) =
                history.last().map(|e| &e.kind)
            {
                if next.timeouts != *timeouts {
                    problems.push(format!(
                        "run {run} continued as new with timeouts {:?}, its own are {timeouts:?}",
                        next.timeouts
                    ));
                }
            }
            if !carried.timeouts.is_none() && carried.timeouts != *timeouts {
                problems.push(format!(
                    "run {run} started with timeouts {timeouts:?}, handed {:?}",
                    carried.timeouts
                ));
            }
            let Some(last) = history.last() else {
                continue;
            };
            if let EventKind::WorkflowTimedOut { timeout, deadline } = &last.kind {
                let recorded = timeouts
                    .deadlines(first.at)
                    .into_iter()
                    .find(|(t, _)| t == timeout)
                    .map(|(_, at)| at);
                if recorded != Some(*deadline) {
                    problems.push(format!(
                        "run {run} timed out on {timeout:?} at {deadline:?}; its start recorded {recorded:?}"
                    ));
                }
                if last.at < *deadline {
                    problems.push(format!(
                        "run {run} timed out at {:?}, before its deadline {deadline:?}",
                        last.at
                    ));
                }
            }
        }
        for detail in problems {
            self.violate(ViolationKind::TimeoutWrong, now, detail);
        }
    }

    /// Cancellation types, on the `cancel-types` shape: its first long
    /// activity (wait for the cancellation) has closed before the third
    /// activity is scheduled, and its second (abandon) is never asked to
    /// cancel.
    pub(crate) fn check_cancellation_types(
        &mut self,
        histories: &BTreeMap<RunId, Vec<Event>>,
        now: u64,
    ) {
        let mut problems = Vec::new();
        for (run, history) in histories {
            let is_shape = matches!(history.first().map(|e| &e.kind),
                Some(EventKind::WorkflowStarted(start))
                    if start.workflow_type == crate::workload::CANCEL_TYPES_WORKFLOW);
            if !is_shape {
                continue;
            }
            let scheduled: Vec<(Step, Seq)> = history
                .iter()
                .filter_map(|e| match &e.kind {
                    EventKind::ActivityScheduled { step, .. } => Some((*step, e.seq)),
                    _ => None,
                })
                .collect();
            let (Some(&(waited, _)), Some(&(abandoned, _))) = (scheduled.first(), scheduled.get(1))
            else {
                continue;
            };
            if history.iter().any(|e| {
                matches!(&e.kind, EventKind::ActivityCancelRequested { step, .. } if *step == abandoned)
            }) {
                problems.push(format!(
                    "run {run}: the abandoned activity at step {abandoned} was asked to cancel"
                ));
            }
            let Some(&(_, last_at)) = scheduled.get(2) else {
                continue;
            };
            let closed = history.iter().find(|e| {
                e.kind.step() == Some(waited)
                    && e.kind
                        .terminal_keys()
                        .contains(&keel_storage::DurableKey::Execution(waited))
            });
            match closed {
                Some(e) if e.seq < last_at => {}
                other => problems.push(format!(
                    "run {run}: the activity at step {waited} closed at {:?}, after the scope's \
                     completion let seq {last_at} schedule the next one",
                    other.map(|e| e.seq)
                )),
            }
        }
        for detail in problems {
            self.violate(ViolationKind::CancellationBroken, now, detail);
        }
    }

    /// The winners acknowledged so far must match the final histories.
    pub(crate) fn check_winners(&mut self, histories: &BTreeMap<RunId, Vec<Event>>, now: u64) {
        let mut problems = Vec::new();
        for ((run, step), (index, key)) in &self.winners {
            let found = histories.get(run).and_then(|h| {
                h.iter().find_map(|e| match &e.kind {
                    EventKind::SelectionWinnerRecorded {
                        step: s,
                        member_index,
                        key,
                        ..
                    } if s == step => Some((*member_index, key.clone())),
                    _ => None,
                })
            });
            if found.as_ref() != Some(&(*index, key.clone())) {
                problems.push(format!(
                    "run {run} select at step {step}: acknowledged winner {index} ({key}), final history has {found:?}"
                ));
            }
        }
        for p in problems {
            self.violate(ViolationKind::SelectWinnerChanged, now, p);
        }
    }
}

/// The live input that produced an input event.
fn input_of(kind: &EventKind) -> Option<Input> {
    Some(match kind.clone() {
        EventKind::ActivityCompleted {
            step,
            attempt_id,
            result,
        } => Input::ActivityCompleted {
            step,
            attempt: attempt_id.attempt,
            result,
        },
        EventKind::ActivityAttemptFailed {
            step,
            attempt_id,
            failure,
            retry_at,
            heartbeat,
        } => Input::ActivityFailed {
            step,
            attempt: attempt_id.attempt,
            failure: *failure,
            retry_at,
            heartbeat,
        },
        EventKind::ActivityCancelled { step, .. } => Input::ActivityCancelled { step },
        EventKind::TimerFired { step, .. } => Input::TimerFired { step },
        EventKind::ChildStarted { step, child_run_id } => {
            Input::ChildStarted { step, child_run_id }
        }
        EventKind::ChildCompleted {
            step,
            child_run_id,
            result,
        } => Input::ChildCompleted {
            step,
            child_run_id,
            result,
        },
        EventKind::ChildFailed {
            step,
            child_run_id,
            failure,
        } => Input::ChildFailed {
            step,
            child_run_id,
            failure,
        },
        EventKind::SignalReceived {
            name,
            payload,
            command_id,
        } => Input::Signal {
            name,
            payload,
            command_id,
        },
        EventKind::WorkflowCancelRequested { command_id, reason } => {
            Input::CancelRequested { reason, command_id }
        }
        EventKind::WorkflowTerminated { reason, command_id } => {
            Input::Terminate { reason, command_id }
        }
        EventKind::WorkflowTimedOut { timeout, deadline } => Input::TimedOut { timeout, deadline },
        EventKind::ExternalSendCompleted {
            step,
            offset,
            failure,
        } => Input::SendCompleted {
            step,
            offset,
            failure,
        },
        EventKind::MessageReceived {
            stream,
            key,
            payload,
            ..
        } => Input::Message {
            stream,
            key,
            payload,
        },
        _ => return None,
    })
}

/// Offline replay of a closed run's final history reproduces it: replay
/// succeeds and ends closed, and re-running the last input on a machine
/// replayed up to it produces exactly the recorded tail (the final commit).
pub(crate) fn replay_check(reg: &WorkflowRegistry, history: &[Event]) -> Result<(), String> {
    let m = RunMachine::replay(reg, history.to_vec()).map_err(|e| format!("replay failed: {e}"))?;
    if !m.is_closed() {
        return Err("replay of the final history does not end closed".into());
    }
    let k = history
        .iter()
        .rposition(|e| e.kind.is_input())
        .ok_or("the history has no input")?;
    let input_event = &history[k];
    let produced = if k == 0 {
        let spec = StartSpec::of_started(&input_event.kind)
            .ok_or("the first event is not WorkflowStarted")?;
        RunMachine::start(reg, spec, input_event.at)
            .map_err(|e| format!("re-running the start failed: {e}"))?
            .1
    } else {
        let Some(input) = input_of(&input_event.kind) else {
            return Ok(());
        };
        let mut m = RunMachine::replay(reg, history[..k].to_vec())
            .map_err(|e| format!("replay up to seq {} failed: {e}", input_event.seq))?;
        m.handle(input, input_event.at)
            .map_err(|e| format!("re-running seq {} failed: {e}", input_event.seq))?
    };
    if produced.as_slice() != &history[k..] {
        let names = |es: &[Event]| {
            es.iter()
                .map(|e| format!("{}:{}", e.seq, e.kind.name()))
                .collect::<Vec<_>>()
                .join(" ")
        };
        return Err(format!(
            "re-running the last input (seq {}) produced [{}], history has [{}]",
            input_event.seq,
            names(&produced),
            names(&history[k..])
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    // Goal: each in-run detector of the checker fires on exactly what it
    // guards against, independently of the engine model (the simulator's
    // broken modes are usually caught by an earlier detector, so these
    // prove the later ones can fail too). Method: drive the checker by hand
    // against an in-memory store: acknowledge without syncing and crash,
    // run an effect for an unsynced event, acknowledge two terminal events
    // for one command id.

    use super::*;
    use crate::store::{SimStore, StoreKind};
    use keel_storage::{CommandId, CommitBatch, CrashMode, InstanceId, Payload, Timestamp};

    fn started(run: RunId) -> Event {
        Event {
            seq: Seq::FIRST,
            at: Timestamp(1),
            kind: EventKind::WorkflowStarted(Box::new(keel_storage::WorkflowStart {
                instance_id: InstanceId::new("i"),
                run_id: run,
                workflow_type: "w".into(),
                input: Payload::default(),
                command_id: None,
                parent: None,
                continued_from: None,
                random_seed: 0,
                previous_run: None,
                carried: Default::default(),
                memo: Vec::new(),
                search_attributes: Vec::new(),
                timeouts: Default::default(),
            })),
        }
    }

    fn signal(seq: u64, command: &str) -> Event {
        Event {
            seq: Seq(seq),
            at: Timestamp(2),
            kind: EventKind::SignalReceived {
                name: "s".into(),
                payload: Payload::default(),
                command_id: Some(CommandId::new(command)),
            },
        }
    }

    #[test]
    fn an_acknowledged_commit_dropped_by_a_crash_is_reported() {
        let mut store = SimStore::open(StoreKind::Mem).expect("opens");
        let run = RunId::from_u64_pair(1, 1);
        let events = vec![started(run)];
        store
            .commit(CommitBatch::append(run, events.clone()))
            .expect("commits");
        let mut c = Checker::default();
        c.durable(run, &events, 1);
        c.check_touched(&store, 1);
        assert!(c.violations.is_empty(), "{:?}", c.violations);
        store.crash(CrashMode::DropUnsynced).expect("crashes");
        c.after_crash(&store, 2);
        assert_eq!(c.violations[0].kind, ViolationKind::AckedCommitLost);
    }

    #[test]
    fn an_effect_for_an_unsynced_event_is_reported_and_a_synced_one_is_not() {
        let mut store = SimStore::open(StoreKind::Mem).expect("opens");
        let run = RunId::from_u64_pair(1, 2);
        let e = started(run);
        store
            .commit(CommitBatch::append(run, vec![e.clone()]))
            .expect("commits");
        let mut c = Checker::default();
        c.effect(&store, run, e.seq, "dispatch", 1);
        assert_eq!(c.violations.len(), 1);
        assert_eq!(c.violations[0].kind, ViolationKind::EffectBeforeDurable);
        store.sync().expect("syncs");
        c.effect(&store, run, e.seq, "dispatch", 2);
        assert_eq!(c.violations.len(), 1);
    }

    #[test]
    fn two_terminal_events_for_one_command_id_are_reported() {
        let run = RunId::from_u64_pair(1, 3);
        let mut c = Checker::default();
        c.durable(run, &[started(run), signal(2, "c1"), signal(3, "c2")], 1);
        assert!(c.violations.is_empty(), "{:?}", c.violations);
        c.durable(run, &[signal(4, "c1")], 2);
        assert_eq!(c.violations[0].kind, ViolationKind::DuplicateTerminal);
    }
}
