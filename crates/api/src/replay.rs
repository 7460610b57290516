//! Offline replay: re-run workflow code against committed histories without
//! running effects, and report the first divergence.
//!
//! A [`Replayer`] holds a [`WorkflowRegistry`] (the workflow code of the
//! build being checked) and replays histories from three sources: a portable
//! [`Bundle`] file written by `keel export`, one run of a data directory, or
//! every run of a data directory that matches a [`RunFilter`]. Each run ends
//! in a [`RunReport`] whose [`ReplayOutcome`] is success, the first
//! divergence (step, recorded command, issued command), or another error
//! with its kind. Replaying the open runs of a production directory with the
//! code about to be deployed is the check that the deploy will not park them.
//!
//! ```no_run
//! use keel::replay::{Bundle, Replayer};
//! use keel::WorkflowRegistry;
//!
//! # fn demo(registry: WorkflowRegistry) -> Result<(), keel::replay::Error> {
//! let replayer = Replayer::new(registry);
//! let report = replayer.replay_bundle(&Bundle::read("order-9.bundle")?);
//! assert!(report.outcome.is_ok(), "{}", report.outcome);
//! # Ok(()) }
//! ```

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use keel_core::{MachineError, RunMachine, WorkflowRegistry};
use keel_storage::codec::{self, RecordKind};
use keel_storage::{
    Error as StorageError, Event, EventKind, ReadHistory, RunFilter, RunId, RunMeta, RunStatus,
    Seq, Step, Store,
};
use serde::{Deserialize, Serialize};

/// The `format` field of every bundle.
pub const BUNDLE_FORMAT: &str = "keel-bundle";

/// The bundle layout version this build writes, and the newest it reads.
pub const BUNDLE_VERSION: u32 = 1;

/// Most problem reports a [`ReplaySummary`] keeps; past it only counts grow.
pub const REPLAY_PROBLEMS_MAX: usize = 1000;

/// Why a bundle or a store could not be replayed at all. A run whose code
/// diverges is not an error: it is a [`RunReport`] with a failed outcome.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bundle file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the file system said.
        source: std::io::Error,
    },
    /// The bytes are not an intact keel record (truncated, bad checksum,
    /// wrong kind, newer version, body that does not decode).
    #[error("bad bundle: {0}")]
    Codec(#[from] codec::Error),
    /// The record decoded but is not a keel bundle.
    #[error("bad bundle: format is {found:?}, expected {BUNDLE_FORMAT:?}")]
    Format {
        /// The format field found.
        found: String,
    },
    /// A bundle layout version this build does not read.
    #[error("bad bundle: layout version {found}, this build reads up to {BUNDLE_VERSION}")]
    Version {
        /// The version found.
        found: u32,
    },
    /// The bundle's run and events do not agree.
    #[error("bad bundle: {0}")]
    Inconsistent(String),
    /// No run or instance by that id in the store.
    #[error("unknown instance or run {0:?}")]
    UnknownRun(String),
    /// The store failed (including a corrupt record).
    #[error(transparent)]
    Store(#[from] keel_storage::Error),
}

/// A portable, checksummed copy of one run's history: its derived metadata
/// and every event. Written inside a keel record envelope of kind
/// [`RecordKind::Bundle`] (magic, kind, version, CRC32C over the whole body),
/// so a truncated or damaged file is refused, never misread.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct Bundle {
    /// Always [`BUNDLE_FORMAT`].
    pub format: String,
    /// The layout version, [`BUNDLE_VERSION`] when written by this build.
    pub version: u32,
    /// The run's metadata as the store had it at export.
    pub run: RunMeta,
    /// The run's history, contiguous from seq 1.
    pub events: Vec<Event>,
}

impl Bundle {
    /// A bundle of `events`, checked like a decoded one.
    pub fn new(run: RunMeta, events: Vec<Event>) -> Result<Self, Error> {
        let bundle = Bundle {
            format: BUNDLE_FORMAT.to_string(),
            version: BUNDLE_VERSION,
            run,
            events,
        };
        bundle.check()?;
        Ok(bundle)
    }

    /// Reads the run `id` (a run id or an instance id) from a store. Events
    /// are read up to the run's metadata as first read, so a bundle taken
    /// beside a live engine is one consistent prefix of the history; they
    /// are read once, without filling the store's block cache (an export
    /// from `keel serve` reads a history of any length in the engine's own
    /// process).
    pub fn from_store(store: &dyn Store, id: &str) -> Result<Self, Error> {
        let run = store
            .resolve(id)?
            .ok_or_else(|| Error::UnknownRun(id.to_string()))?;
        let meta = store
            .run_meta(run)?
            .ok_or_else(|| Error::UnknownRun(id.to_string()))?;
        let last = meta.next_seq.0.saturating_sub(1);
        let mut events = Vec::with_capacity(last.min(1 << 20) as usize);
        store.for_each_event_once(run, Seq::FIRST, &mut |e| {
            if e.seq.0 > last {
                return false;
            }
            events.push(e);
            true
        })?;
        Bundle::new(meta, events)
    }

    /// The record bytes: a keel envelope around the msgpack body.
    pub fn encode(&self) -> Result<Vec<u8>, Error> {
        Ok(codec::encode(RecordKind::Bundle, self)?)
    }

    /// Decodes and checks bundle bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        let bundle: Bundle = codec::decode(RecordKind::Bundle, bytes)?;
        bundle.check()?;
        Ok(bundle)
    }

    /// Reads and checks a bundle file.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::decode(&bytes)
    }

    /// Writes the bundle to `path` through a temporary file and a rename, so
    /// a crash never leaves half a bundle under the final name.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), Error> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let bytes = self.encode()?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, &bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// True when the history ends with an event that closes the run.
    pub fn is_closed(&self) -> bool {
        self.run.status.is_closed() || self.events.last().is_some_and(|e| closes(&e.kind))
    }

    fn check(&self) -> Result<(), Error> {
        if self.format != BUNDLE_FORMAT {
            return Err(Error::Format {
                found: self.format.clone(),
            });
        }
        if self.version == 0 || self.version > BUNDLE_VERSION {
            return Err(Error::Version {
                found: self.version,
            });
        }
        let Some(first) = self.events.first() else {
            return Err(Error::Inconsistent("no events".into()));
        };
        match &first.kind {
            EventKind::WorkflowStarted(start) if start.run_id == self.run.run_id => {}
            EventKind::WorkflowStarted(start) => {
                return Err(Error::Inconsistent(format!(
                    "metadata is for run {}, the history starts run {}",
                    self.run.run_id, start.run_id
                )))
            }
            other => {
                return Err(Error::Inconsistent(format!(
                    "the first event is {}, expected WorkflowStarted",
                    other.name()
                )))
            }
        }
        for (i, e) in self.events.iter().enumerate() {
            let expected = i as u64 + 1;
            if e.seq.0 != expected {
                return Err(Error::Inconsistent(format!(
                    "expected seq {expected}, found seq {}",
                    e.seq
                )));
            }
        }
        Ok(())
    }
}

fn closes(kind: &EventKind) -> bool {
    kind.closes_run() || matches!(kind, EventKind::WorkflowTerminated { .. })
}

/// How replaying one run ended.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ReplayOutcome {
    /// The code issued exactly the recorded commands (and, for a closed
    /// run, closed it the same way).
    Ok,
    /// The first command the code issued differently from history.
    Diverged {
        /// The step.
        step: Step,
        /// What history holds there.
        recorded: String,
        /// What the code issued instead.
        issued: String,
    },
    /// Replay stopped for another reason (panic, unknown workflow type,
    /// input that no longer decodes, malformed or unreadable history).
    Failed {
        /// A short kind: a [`MachineError::kind`], `not_closed`, `corrupt`
        /// or `replay_panic`.
        kind: String,
        /// The step, where known.
        step: Option<Step>,
        /// What happened.
        message: String,
    },
}

impl ReplayOutcome {
    /// True for [`ReplayOutcome::Ok`].
    pub fn is_ok(&self) -> bool {
        matches!(self, ReplayOutcome::Ok)
    }

    /// `ok`, `non_determinism`, or the failure's kind.
    pub fn kind(&self) -> &str {
        match self {
            ReplayOutcome::Ok => "ok",
            ReplayOutcome::Diverged { .. } => "non_determinism",
            ReplayOutcome::Failed { kind, .. } => kind,
        }
    }

    fn from_machine(e: MachineError) -> Self {
        match e {
            MachineError::NonDeterminism {
                step,
                recorded,
                issued,
            } => ReplayOutcome::Diverged {
                step,
                recorded,
                issued,
            },
            other => ReplayOutcome::Failed {
                kind: other.kind().to_string(),
                step: other.step(),
                message: other.to_string(),
            },
        }
    }
}

impl fmt::Display for ReplayOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplayOutcome::Ok => f.write_str("ok"),
            ReplayOutcome::Diverged {
                step,
                recorded,
                issued,
            } => write!(
                f,
                "diverged at step {step}: history recorded {recorded}, the code issued {issued}"
            ),
            ReplayOutcome::Failed { kind, message, .. } => write!(f, "{kind}: {message}"),
        }
    }
}

/// The replay of one run.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct RunReport {
    /// The run.
    pub run_id: RunId,
    /// Its instance.
    pub instance_id: String,
    /// Its workflow type.
    pub workflow_type: String,
    /// Its recorded status.
    pub status: RunStatus,
    /// Events replayed.
    pub events: u64,
    /// How the replay ended.
    #[serde(flatten)]
    pub outcome: ReplayOutcome,
}

/// The replay of many runs: counts, and the runs that did not replay.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize)]
pub struct ReplaySummary {
    /// Runs replayed.
    pub replayed: u64,
    /// Events replayed.
    pub events: u64,
    /// Runs that replayed cleanly.
    pub ok: u64,
    /// Runs whose code diverged from history.
    pub diverged: u64,
    /// Runs whose replay failed otherwise.
    pub failed: u64,
    /// The runs that diverged or failed, at most [`REPLAY_PROBLEMS_MAX`].
    pub problems: Vec<RunReport>,
    /// True when more problems happened than `problems` lists.
    pub truncated: bool,
}

impl ReplaySummary {
    /// True when every run replayed cleanly.
    pub fn is_ok(&self) -> bool {
        self.diverged == 0 && self.failed == 0
    }

    /// Counts one run's report.
    pub fn add(&mut self, report: RunReport) {
        self.replayed += 1;
        self.events += report.events;
        match report.outcome {
            ReplayOutcome::Ok => {
                self.ok += 1;
                return;
            }
            ReplayOutcome::Diverged { .. } => self.diverged += 1,
            ReplayOutcome::Failed { .. } => self.failed += 1,
        }
        if self.problems.len() < REPLAY_PROBLEMS_MAX {
            self.problems.push(report);
        } else {
            self.truncated = true;
        }
    }
}

/// Replays committed histories against the workflow code of a registry.
#[derive(Clone, Debug)]
pub struct Replayer {
    registry: WorkflowRegistry,
}

impl Replayer {
    /// A replayer for the workflows of `registry`.
    pub fn new(registry: WorkflowRegistry) -> Self {
        Replayer { registry }
    }

    /// The workflows this replayer knows.
    pub fn registry(&self) -> &WorkflowRegistry {
        &self.registry
    }

    /// Replays one history. `closed` says the run was closed when the
    /// history was taken; the replayed code must then close it too.
    ///
    /// Besides the divergences the run machine finds while matching
    /// recorded commands, this reports code that issues new commands after
    /// the last recorded input: every commit holds an input together with
    /// the commands it caused, so a complete history leaves nothing to
    /// issue, and the engine would leave such a run waiting on a command
    /// that was never committed.
    pub fn replay_events(&self, history: Vec<Event>, closed: bool) -> ReplayOutcome {
        let recorded = history.len() as u64;
        let step_max = history
            .iter()
            .filter_map(|e| e.kind.step())
            .max()
            .unwrap_or_default();
        let replayed = catch_unwind(AssertUnwindSafe(|| {
            RunMachine::replay(&self.registry, history)
        }));
        let machine = match replayed {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return ReplayOutcome::from_machine(e),
            Err(panic) => {
                let message = keel_core::panic_message(panic.as_ref());
                return ReplayOutcome::Failed {
                    kind: "replay_panic".into(),
                    step: None,
                    message: format!("replay panicked: {message}"),
                };
            }
        };
        let extra = machine.next_seq().0.saturating_sub(recorded + 1);
        if extra > 0 {
            let new_wait = machine.open_waits().into_iter().find(|w| w.step > step_max);
            let (step, issued) = match new_wait {
                Some(w) => {
                    let what = match w.kind {
                        keel_core::WaitKind::Activity => format!("schedule activity {}", w.name),
                        keel_core::WaitKind::Timer => "start timer".to_string(),
                        keel_core::WaitKind::Child => format!("start child {}", w.name),
                        keel_core::WaitKind::Send => format!("send to {}", w.name),
                    };
                    (w.step, format!("{what} at step {}", w.step))
                }
                None if machine.is_closed() => (
                    Step(step_max.0 + 1),
                    "a close of the run (it finishes here now)".to_string(),
                ),
                None => (
                    Step(step_max.0 + 1),
                    format!("{extra} new event(s) past the end of history"),
                ),
            };
            return ReplayOutcome::Diverged {
                step,
                recorded: format!("nothing (history ends at seq {recorded}; the run waits)"),
                issued,
            };
        }
        if closed && !machine.is_closed() {
            return ReplayOutcome::Failed {
                kind: "not_closed".into(),
                step: None,
                message: format!(
                    "the history is closed but the replayed run is still open after {recorded} events"
                ),
            };
        }
        ReplayOutcome::Ok
    }

    /// Replays a bundle.
    pub fn replay_bundle(&self, bundle: &Bundle) -> RunReport {
        let closed = bundle.is_closed();
        RunReport {
            run_id: bundle.run.run_id,
            instance_id: bundle.run.instance_id.to_string(),
            workflow_type: bundle.run.workflow_type.clone(),
            status: bundle.run.status,
            events: bundle.events.len() as u64,
            outcome: self.replay_events(bundle.events.clone(), closed),
        }
    }

    /// Reads and replays a bundle file.
    pub fn replay_file(&self, path: impl AsRef<Path>) -> Result<RunReport, Error> {
        Ok(self.replay_bundle(&Bundle::read(path)?))
    }

    /// Replays one run of a store, by run id or instance id.
    pub fn replay_id(&self, store: &dyn Store, id: &str) -> Result<RunReport, Error> {
        let run = store
            .resolve(id)?
            .ok_or_else(|| Error::UnknownRun(id.to_string()))?;
        let meta = store
            .run_meta(run)?
            .ok_or_else(|| Error::UnknownRun(id.to_string()))?;
        Ok(self.replay_meta(store, &meta))
    }

    /// Replays one run given its metadata. A history that cannot be read
    /// (a corrupt record) is reported as a failed outcome of kind `corrupt`.
    pub fn replay_meta(&self, store: &dyn Store, meta: &RunMeta) -> RunReport {
        let last = meta.next_seq.0.saturating_sub(1);
        let mut events = Vec::with_capacity(last.min(1 << 20) as usize);
        let failure = store
            .for_each_event(meta.run_id, Seq::FIRST, &mut |e| {
                if e.seq.0 > last {
                    return false;
                }
                events.push(e);
                true
            })
            .err();
        self.replay_read(meta, ReadHistory { events, failure })
    }

    /// Replays a run from its history as read. Events past the run's
    /// record (committed after it was read) are left out, and so is a
    /// failure to read them.
    fn replay_read(&self, meta: &RunMeta, read: ReadHistory) -> RunReport {
        let last = meta.next_seq.0.saturating_sub(1);
        let ReadHistory {
            mut events,
            mut failure,
        } = read;
        let kept = events.partition_point(|e| e.seq.0 <= last);
        let past_record = kept < events.len()
            || matches!(&failure, Some(StorageError::Corrupt { seq: Some(s), .. }) if s.0 > last);
        if past_record {
            failure = None;
        }
        events.truncate(kept);
        let count = events.len() as u64;
        let outcome = match failure {
            None => self.replay_events(events, meta.status.is_closed()),
            Some(e) => ReplayOutcome::Failed {
                kind: "corrupt".into(),
                step: None,
                message: e.to_string(),
            },
        };
        RunReport {
            run_id: meta.run_id,
            instance_id: meta.instance_id.to_string(),
            workflow_type: meta.workflow_type.clone(),
            status: meta.status,
            events: count,
            outcome,
        }
    }

    /// Replays every run of `store` that matches `filter`, calling `each`
    /// after every run (for progress and streaming output), in the order of
    /// [`Replayer::replay_runs`].
    pub fn replay_store(
        &self,
        store: &dyn Store,
        filter: &RunFilter,
        each: &mut dyn FnMut(&RunReport),
    ) -> Result<ReplaySummary, Error> {
        Ok(self.replay_runs(store, &store.runs(filter)?, each))
    }

    /// Replays `runs`, calling `each` after every run. Runs are read and
    /// replayed in the order of their ids, which is the order of their
    /// events in the store: one pass over the events, through one cursor
    /// on RocksDB ([`Store::for_each_history`]).
    pub fn replay_runs(
        &self,
        store: &dyn Store,
        runs: &[RunMeta],
        each: &mut dyn FnMut(&RunReport),
    ) -> ReplaySummary {
        let mut order: Vec<usize> = (0..runs.len()).collect();
        order.sort_by_key(|&i| runs[i].run_id);
        let ids: Vec<RunId> = order.iter().map(|&i| runs[i].run_id).collect();
        let mut summary = ReplaySummary::default();
        store.for_each_history(&ids, &mut |k, read| {
            let report = self.replay_read(&runs[order[k]], read);
            each(&report);
            summary.add(report);
        });
        summary
    }

    /// Rebuilds a run's machine from its history (to look at what the code
    /// waits for: signals, coroutines, open steps).
    pub fn rebuild(&self, history: Vec<Event>) -> Result<RunMachine, MachineError> {
        catch_unwind(AssertUnwindSafe(|| {
            RunMachine::replay(&self.registry, history)
        }))
        .unwrap_or_else(|_| {
            Err(MachineError::Panic {
                message: "replay panicked".into(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    // Goal: bundles round-trip and refuse damage with typed errors; replay
    // reports success, a recorded-command mismatch, new commands past the
    // end of history, and unknown workflow types, each with its kind.
    // Method: histories made by the run machine from one workflow version,
    // replayed with that version and with changed ones.
    use super::*;
    use keel_core::machine::{Input, StartSpec};
    use keel_core::WorkflowError;
    use keel_core::{Activity, ActivityContext, ActivityError, Workflow, WorkflowContext};
    use keel_storage::{AttemptNo, InstanceId, Payload, Seq, Timestamp};

    #[derive(Default)]
    struct A;
    impl Activity for A {
        const NAME: &'static str = "t.a";
        type Input = u32;
        type Output = u32;
        async fn run(&self, _: ActivityContext, i: u32) -> Result<u32, ActivityError> {
            Ok(i)
        }
    }

    #[derive(Default)]
    struct B;
    impl Activity for B {
        const NAME: &'static str = "t.b";
        type Input = u32;
        type Output = u32;
        async fn run(&self, _: ActivityContext, i: u32) -> Result<u32, ActivityError> {
            Ok(i)
        }
    }

    /// Version 1: A, then wait for `go`.
    struct V1;
    impl Workflow for V1 {
        const NAME: &'static str = "t.flow";
        type Input = u32;
        type Output = u32;
        async fn run(ctx: WorkflowContext, i: u32) -> Result<u32, WorkflowError> {
            let a = ctx.activity::<A>(i).await?;
            let go = ctx.wait_signal::<u32>("go").await?;
            Ok(a + go)
        }
    }

    /// Version 2: A, then B (new), then wait for `go`.
    struct V2;
    impl Workflow for V2 {
        const NAME: &'static str = "t.flow";
        type Input = u32;
        type Output = u32;
        async fn run(ctx: WorkflowContext, i: u32) -> Result<u32, WorkflowError> {
            let a = ctx.activity::<A>(i).await?;
            let b = ctx.activity::<B>(a).await?;
            let go = ctx.wait_signal::<u32>("go").await?;
            Ok(b + go)
        }
    }

    /// Version 3: B first.
    struct V3;
    impl Workflow for V3 {
        const NAME: &'static str = "t.flow";
        type Input = u32;
        type Output = u32;
        async fn run(ctx: WorkflowContext, i: u32) -> Result<u32, WorkflowError> {
            Ok(ctx.activity::<B>(i).await?)
        }
    }

    fn registry<W: Workflow>() -> WorkflowRegistry {
        let mut r = WorkflowRegistry::new();
        r.register::<W>();
        r
    }

    /// V1's history: started, A scheduled and completed, then (when
    /// `close`) the signal and the completion.
    fn history(close: bool) -> (RunMeta, Vec<Event>) {
        let run_id = RunId::from_u64_pair(9, 9);
        let spec = StartSpec {
            run_id,
            instance_id: InstanceId::new("t-1"),
            workflow_type: "t.flow".into(),
            input: Payload::encode(&5u32).unwrap(),
            command_id: None,
            parent: None,
            continued_from: None,
            random_seed: 1,
            previous_run: None,
            carried: Default::default(),
            memo: Vec::new(),
            search_attributes: Vec::new(),
            timeouts: Default::default(),
        };
        let reg = registry::<V1>();
        let (mut m, mut events) = RunMachine::start(&reg, spec, Timestamp(1)).unwrap();
        let input = Input::ActivityCompleted {
            step: Step(1),
            attempt: AttemptNo::FIRST,
            result: Payload::encode(&5u32).unwrap(),
        };
        events.extend(m.handle(input, Timestamp(2)).unwrap());
        if close {
            let go = Input::Signal {
                name: "go".into(),
                payload: Payload::encode(&1u32).unwrap(),
                command_id: None,
            };
            events.extend(m.handle(go, Timestamp(3)).unwrap());
            assert!(m.is_closed());
        }
        let meta = RunMeta {
            run_id,
            instance_id: InstanceId::new("t-1"),
            workflow_type: "t.flow".into(),
            status: if close {
                RunStatus::Completed
            } else {
                RunStatus::Running
            },
            next_seq: Seq(events.len() as u64 + 1),
            parent: None,
            started_at: Timestamp(1),
            updated_at: Timestamp(3),
            closed_at: None,
            outcome: None,
            cancel_requested: false,
            search_attributes: Vec::new(),
            memo: Vec::new(),
        };
        (meta, events)
    }

    #[test]
    fn bundles_round_trip_and_refuse_damage() {
        let (meta, events) = history(true);
        let bundle = Bundle::new(meta.clone(), events.clone()).unwrap();
        let bytes = bundle.encode().unwrap();
        assert_eq!(Bundle::decode(&bytes).unwrap(), bundle);
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(matches!(
            Bundle::decode(&flipped),
            Err(Error::Codec(codec::Error::Checksum { .. }))
        ));
        assert!(matches!(
            Bundle::decode(&bytes[..bytes.len() / 2]),
            Err(Error::Codec(_))
        ));
        let mut gap = events.clone();
        gap.remove(1);
        assert!(matches!(
            Bundle::new(meta.clone(), gap),
            Err(Error::Inconsistent(_))
        ));
        let mut other = meta.clone();
        other.run_id = RunId::from_u64_pair(1, 2);
        assert!(matches!(
            Bundle::new(other, events.clone()),
            Err(Error::Inconsistent(_))
        ));
        let foreign = Bundle {
            format: "zip".into(),
            ..bundle.clone()
        };
        let bytes = codec::encode(RecordKind::Bundle, &foreign).unwrap();
        assert!(matches!(Bundle::decode(&bytes), Err(Error::Format { .. })));
        let newer = Bundle {
            version: BUNDLE_VERSION + 1,
            ..bundle
        };
        let bytes = codec::encode(RecordKind::Bundle, &newer).unwrap();
        assert!(matches!(Bundle::decode(&bytes), Err(Error::Version { .. })));
    }

    #[test]
    fn replay_reports_each_outcome_with_its_kind() {
        let (meta, closed) = history(true);
        let (_, open) = history(false);
        let v1 = Replayer::new(registry::<V1>());
        assert_eq!(v1.replay_events(closed.clone(), true), ReplayOutcome::Ok);
        assert_eq!(v1.replay_events(open.clone(), false), ReplayOutcome::Ok);
        let report = v1.replay_bundle(&Bundle::new(meta, closed.clone()).unwrap());
        assert!(report.outcome.is_ok() && report.events == closed.len() as u64);

        // A recorded command that the code now issues differently.
        match Replayer::new(registry::<V3>()).replay_events(closed.clone(), true) {
            ReplayOutcome::Diverged {
                step,
                recorded,
                issued,
            } => {
                assert_eq!(step, Step(1));
                assert!(
                    recorded.contains("t.a") && issued.contains("t.b"),
                    "{recorded} / {issued}"
                );
            }
            other => panic!("expected a divergence, got {other}"),
        }

        // New code that issues a command after the last recorded input: the
        // engine would wait on a command that was never committed.
        let v2 = Replayer::new(registry::<V2>());
        match v2.replay_events(open, false) {
            ReplayOutcome::Diverged {
                step,
                recorded,
                issued,
            } => {
                assert_eq!(step, Step(2));
                assert!(recorded.contains("end of the history"), "{recorded}");
                assert!(issued.contains("schedule activity t.b"), "{issued}");
            }
            other => panic!("expected a divergence, got {other}"),
        }
        // On the closed history V2 diverges where history recorded the close.
        assert_eq!(
            v2.replay_events(closed.clone(), true).kind(),
            "non_determinism"
        );

        let none = Replayer::new(WorkflowRegistry::new());
        let out = none.replay_events(closed, true);
        assert_eq!(out.kind(), "unknown_workflow_type", "{out}");
        assert!(!out.is_ok());
        assert_eq!(
            none.replay_events(Vec::new(), false).kind(),
            "invalid_history"
        );
    }
}
