//! The typed history events: the persisted schema of a run's log.
//!
//! Schema evolution rules (see ARCHITECTURE.md and [`crate::codec`]): from
//! event version 8 events are positional msgpack (each struct an array of
//! its fields in declaration order; versions 1 to 7 wrote maps with field
//! names, which still decode); a field is only ever added at the end of its
//! struct or variant with `#[serde(default)]` (an `Option` too: positional
//! bodies give a missing field no implicit `None`), never removed or moved;
//! a new variant bumps [`crate::codec::EVENT_VERSION`]; golden bytes of every
//! released kind live in `tests/data/` and must keep decoding.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{
    AttemptId, AttemptNo, CommandId, ExecutionId, InstanceId, MessageKey, RunId, Seq, Step,
    Timestamp,
};

/// An opaque user value: msgpack bytes of the workflow's or activity's serde
/// type. Stored as a msgpack `bin`, not an array of numbers.
#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Payload(#[serde(with = "serde_bytes")] pub Vec<u8>);

impl Payload {
    /// Wraps already-encoded bytes.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Payload(bytes)
    }

    /// Encodes a serde value as a payload (msgpack map form).
    pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Self, rmp_serde::encode::Error> {
        // keel's own writer first (the same bytes, see `slice_ser`); what it
        // leaves (rmp-serde's extension type, a value whose `Serialize`
        // fails) is written by rmp-serde, whose bytes or error stand.
        // Grown from empty, as rmp-serde's `to_vec_named` does: a payload
        // kept in a cached history holds what it grew to, no more.
        let mut out = Vec::new();
        if crate::slice_ser::write_named(&mut out, value).is_ok() {
            return Ok(Payload(out));
        }
        rmp_serde::to_vec_named(value).map(Payload)
    }

    /// Whether the payload nests arrays and maps deeper than
    /// [`crate::BODY_NESTING_MAX`]: it would not decode.
    pub fn nests_too_deep(&self) -> bool {
        !crate::slice_de::nests_within(&self.0, crate::slice_de::BODY_NESTING_MAX)
    }

    /// Decodes the payload into `T`, refusing trailing bytes.
    pub fn decode<T: serde::de::DeserializeOwned>(&self) -> Result<T, rmp_serde::decode::Error> {
        // The records' fast reader first; what it refuses, rmp-serde's
        // reader decodes or explains (see `codec::decode_body`).
        if let Ok(value) = crate::slice_de::from_slice(&self.0) {
            return Ok(value);
        }
        // Not deeper than the general reader can follow without
        // overflowing the stack (see `BODY_NESTING_MAX`).
        if !crate::slice_de::nests_within(&self.0, crate::slice_de::BODY_NESTING_MAX) {
            return Err(rmp_serde::decode::Error::DepthLimitExceeded);
        }
        let mut de = rmp_serde::Deserializer::new(self.0.as_slice());
        let value = T::deserialize(&mut de)?;
        let rest = de.into_inner();
        if !rest.is_empty() {
            return Err(rmp_serde::decode::Error::Syntax(format!(
                "{} trailing bytes after payload",
                rest.len()
            )));
        }
        Ok(value)
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A short human rendering for `keel show`: JSON when it decodes, hex
    /// otherwise, cut at `max_chars`.
    pub fn preview(&self, max_chars: usize) -> String {
        let text = match rmp_serde::from_slice::<serde_json::Value>(&self.0) {
            Ok(v) => v.to_string(),
            Err(_) => self.0.iter().map(|b| format!("{b:02x}")).collect(),
        };
        if text.chars().count() > max_chars {
            let cut: String = text.chars().take(max_chars.saturating_sub(1)).collect();
            format!("{cut}…")
        } else {
            text
        }
    }
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Payload({})", self.preview(48))
    }
}

/// One entry of a `parallel_group_path`: the enclosing `all` barrier's
/// durable step, its size in leaves, and the leaf's index in it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GroupEntry {
    /// The step at which the barrier was issued.
    pub step: Step,
    /// How many members the barrier has.
    pub size: u32,
    /// This member's index in the barrier.
    pub index: u32,
}

/// The enclosing `all` barriers of a leaf command, outermost first. Empty
/// for a command issued outside any barrier.
pub type GroupPath = Vec<GroupEntry>;

/// What kind of failure a [`Failure`] is; decides retry and display.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub enum FailureKind {
    /// An error returned by user code.
    Application,
    /// A panic caught around user code.
    Panic,
    /// A start-to-close or schedule-to-close timeout.
    Timeout,
    /// The attempt's lease expired more often than the redelivery bound.
    LeaseExpired,
    /// The work was cancelled.
    Cancelled,
    /// A child workflow or the run itself was terminated.
    Terminated,
    /// A resilience policy rejected the work (breaker open, rate limited...).
    Rejected,
    /// A value over its size limit (an activity's result, say).
    PayloadTooLarge,
}

/// A typed failure as committed in history.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Failure {
    /// The failure's kind.
    pub kind: FailureKind,
    /// Human-readable message.
    pub message: String,
    /// Whether user code declared this failure retryable.
    pub retryable: bool,
    /// Optional typed details.
    #[serde(default)]
    pub details: Option<Payload>,
}

impl Failure {
    /// A failure of the given kind and message.
    pub fn new(kind: FailureKind, message: impl Into<String>, retryable: bool) -> Self {
        Failure {
            kind,
            message: message.into(),
            retryable,
            details: None,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

/// How randomness spreads a retry's delay. Persisted as its lowercase name
/// (`"none"`, `"full"`, `"equal"`, `"decorrelated"`), the strings the first
/// schema stored; a name this build does not know makes the record corrupt
/// rather than silently turning jitter off.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Jitter {
    /// Exactly the backoff delay.
    #[default]
    None,
    /// Uniform in `0..=delay`.
    Full,
    /// Uniform in `delay/2..=delay`.
    Equal,
    /// Uniform in `initial..=min(max, 3 * previous delay)`.
    Decorrelated,
}

/// How a retry's raw delay grows with the number of failed attempts `n`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backoff {
    /// `initial` before every retry.
    Constant,
    /// `initial * n`.
    Linear,
    /// `initial * 2^(n-1)`.
    Exponential,
}

/// Retry settings of one activity call, committed with its schedule so that
/// retries are decided the same way after a restart.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct RetrySettings {
    /// Total attempts allowed, including the first (1 = no retry).
    pub attempts_max: u32,
    /// Delay before the first retry.
    pub initial_delay_ms: u64,
    /// Multiplier applied per retry (1.0 = constant), as the first schema
    /// recorded it; [`RetrySettings::backoff`] reads it when `backoff` is
    /// absent.
    pub backoff_factor: f64,
    /// Cap on the delay.
    pub delay_max_ms: u64,
    /// Jitter mode.
    pub jitter: Jitter,
    /// How the delay grows (absent in records of the first schema).
    #[serde(default)]
    pub backoff_mode: Option<Backoff>,
}

impl RetrySettings {
    /// How the delay grows: the recorded mode, or for a record of the first
    /// schema, constant for a factor of at most 1 and exponential otherwise.
    pub fn backoff(&self) -> Backoff {
        match self.backoff_mode {
            Some(mode) => mode,
            None if self.backoff_factor <= 1.0 => Backoff::Constant,
            None => Backoff::Exponential,
        }
    }
}

/// Per-call options of an activity, committed with its schedule.
#[derive(Clone, PartialEq, Debug, Default, Serialize, Deserialize)]
pub struct ActivityOptions {
    /// Limit on one attempt, from dispatch to result.
    pub start_to_close_ms: Option<u64>,
    /// Limit on the whole execution, across attempts and backoff.
    pub schedule_to_close_ms: Option<u64>,
    /// A heartbeat must arrive within this interval or the lease expires.
    pub heartbeat_ms: Option<u64>,
    /// Retry settings; `None` means one attempt.
    pub retry: Option<RetrySettings>,
    /// Resilience profile the engine admits attempts through, if any.
    #[serde(default)]
    pub profile: Option<String>,
    /// Limit from an attempt's due time to its start (waiting behind the
    /// worker limit or a resilience profile).
    #[serde(default)]
    pub schedule_to_start_ms: Option<u64>,
}

/// What a parent does with an open child when the parent closes.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub enum ParentClosePolicy {
    /// Terminate the child.
    #[default]
    Terminate,
    /// Ask the child to cancel.
    RequestCancel,
    /// Leave the child running.
    Abandon,
}

/// The parent of a child run: its run and the step that started the child.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ParentRef {
    /// The parent's instance.
    pub instance_id: InstanceId,
    /// The parent's run.
    pub run_id: RunId,
    /// The parent's step that scheduled this child.
    pub step: Step,
    /// What happens to the child when the parent closes.
    pub close_policy: ParentClosePolicy,
}

/// A `select` member key: a non-empty string or a non-negative integer.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub enum SelectKey {
    /// A string key (never empty).
    Name(String),
    /// An integer key.
    Index(u64),
}

impl fmt::Display for SelectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SelectKey::Name(s) => f.write_str(s),
            SelectKey::Index(i) => write!(f, "{i}"),
        }
    }
}

impl From<&str> for SelectKey {
    fn from(s: &str) -> Self {
        SelectKey::Name(s.to_string())
    }
}

impl From<String> for SelectKey {
    fn from(s: String) -> Self {
        SelectKey::Name(s)
    }
}

impl From<u64> for SelectKey {
    fn from(i: u64) -> Self {
        SelectKey::Index(i)
    }
}

/// The kind of a `select` member's operation.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub enum OperationKind {
    /// An activity execution.
    Activity,
    /// A child workflow.
    Child,
    /// A durable timer.
    Timer,
    /// A wait for a named signal.
    Signal,
    /// A wait for a condition over workflow state.
    Condition,
    /// A nested `all` barrier.
    All,
}

/// The outcome of a finished run or a finished child.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub enum Outcome {
    /// Completed with a result.
    Completed(Payload),
    /// Failed with a typed failure.
    Failed(Failure),
    /// Cancelled cooperatively.
    Cancelled(String),
    /// Terminated from outside.
    Terminated(String),
    /// Closed and continued as a new run.
    ContinuedAsNew(RunId),
    /// Closed by one of its timeouts (the message names which and when).
    TimedOut(String),
}

/// One committed fact in a run's history.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct Event {
    /// Position in the run's history, contiguous from 1.
    pub seq: Seq,
    /// When the shell committed it (the engine's or the simulator's clock).
    pub at: Timestamp,
    /// What happened.
    pub kind: EventKind,
}

/// Most unread signals a run hands to the run that continues it.
pub const CARRIED_SIGNALS_MAX: usize = 1024;

/// Most command ids a run hands to the run that continues it (the newest).
pub const CARRIED_COMMANDS_MAX: usize = 4096;

/// Most messages a stream of a run holds unread: a send to a full stream
/// is refused (the sender retries later), so continue-as-new always
/// carries every unread message.
pub const STREAM_BACKLOG_MAX: usize = 1024;

/// Most streams of one run holding unread messages at once (a send that
/// would make one more is refused for now, like a full stream).
pub const STREAMS_PER_RUN_MAX: usize = 32;

/// Longest stream name, in bytes.
pub const STREAM_NAME_BYTES_MAX: usize = 128;

/// Longest message idempotency key, in bytes.
pub const MESSAGE_KEY_BYTES_MAX: usize = 256;

/// Most idempotency keys per stream a run hands to the run that continues
/// it (the newest): a retried send whose key is older than that many later
/// sends to the same stream is no longer recognised after continue-as-new.
pub const STREAM_KEYS_CARRIED_MAX: usize = 4096;

/// Checks a stream name and a message key against their limits.
pub fn check_stream_message(stream: &str, key: &MessageKey) -> Result<(), String> {
    if stream.is_empty() || stream.len() > STREAM_NAME_BYTES_MAX {
        return Err(format!(
            "stream name must be 1 to {STREAM_NAME_BYTES_MAX} bytes (got {})",
            stream.len()
        ));
    }
    if key.0.is_empty() || key.0.len() > MESSAGE_KEY_BYTES_MAX {
        return Err(format!(
            "message key must be 1 to {MESSAGE_KEY_BYTES_MAX} bytes (got {})",
            key.0.len()
        ));
    }
    Ok(())
}

/// The timeouts a start asks for, relative to when its first run starts
/// (a client's start, a child's schedule, a schedule's action).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct StartTimeouts {
    /// Longest one run may stay open, from its own start, in milliseconds.
    pub run_ms: Option<u64>,
    /// Longest the instance's chain of runs (continue-as-new included) may
    /// stay open, from the first run's start, in milliseconds.
    pub execution_ms: Option<u64>,
}

impl StartTimeouts {
    /// With a run timeout of `d` (whole milliseconds, at least 1: a zero
    /// timeout would close the run before its first step).
    pub fn with_run(mut self, d: std::time::Duration) -> Self {
        self.run_ms = Some(timeout_ms(d));
        self
    }

    /// With an execution timeout of `d` (as [`StartTimeouts::with_run`]).
    pub fn with_execution(mut self, d: std::time::Duration) -> Self {
        self.execution_ms = Some(timeout_ms(d));
        self
    }

    /// The timeouts of a first run starting at `now`.
    pub fn at(self, now: Timestamp) -> RunTimeouts {
        RunTimeouts {
            run_ms: self.run_ms,
            execution_deadline: self.execution_ms.map(|ms| now.plus_ms(ms)),
        }
    }
}

fn timeout_ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A run's timeouts as its `WorkflowStarted` records them: the run timeout
/// (each run of the chain gets its own) and the execution deadline
/// (fixed at the first run's start and handed on by continue-as-new).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct RunTimeouts {
    /// Longest this run may stay open, from its start, in milliseconds.
    pub run_ms: Option<u64>,
    /// When the instance's chain of runs must have closed.
    pub execution_deadline: Option<Timestamp>,
}

impl RunTimeouts {
    /// No timeout.
    pub fn is_none(&self) -> bool {
        self.run_ms.is_none() && self.execution_deadline.is_none()
    }

    /// The deadlines of a run started at `started_at`, each with the
    /// reserved timer step that fires it.
    pub fn deadlines(&self, started_at: Timestamp) -> Vec<(WorkflowTimeout, Timestamp)> {
        let mut out = Vec::new();
        if let Some(ms) = self.run_ms {
            out.push((WorkflowTimeout::Run, started_at.plus_ms(ms)));
        }
        if let Some(at) = self.execution_deadline {
            out.push((WorkflowTimeout::Execution, at));
        }
        out
    }

    /// The earliest deadline of a run started at `started_at`.
    pub fn first_deadline(&self, started_at: Timestamp) -> Option<(WorkflowTimeout, Timestamp)> {
        self.deadlines(started_at)
            .into_iter()
            .min_by_key(|(_, at)| *at)
    }
}

/// Which of a run's timeouts closed it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub enum WorkflowTimeout {
    /// The run timeout: one run stayed open too long.
    Run,
    /// The execution timeout: the instance's chain of runs did.
    Execution,
}

impl WorkflowTimeout {
    /// The reserved timer step that fires this timeout. No command takes
    /// it: steps of workflow code stay far below (the history limit).
    pub fn timer_step(self) -> Step {
        match self {
            WorkflowTimeout::Run => Step(u32::MAX),
            WorkflowTimeout::Execution => Step(u32::MAX - 1),
        }
    }

    /// The timeout a reserved timer step fires, if it is one.
    pub fn of_timer_step(step: Step) -> Option<WorkflowTimeout> {
        [WorkflowTimeout::Run, WorkflowTimeout::Execution]
            .into_iter()
            .find(|t| t.timer_step() == step)
    }

    /// The outcome of a run this timeout closed at `deadline`.
    pub fn outcome(self, deadline: Timestamp) -> Outcome {
        Outcome::TimedOut(format!(
            "{} passed at {}",
            self.name(),
            deadline.to_rfc3339()
        ))
    }

    /// Lowercase name, as messages and the CLI print it.
    pub fn name(self) -> &'static str {
        match self {
            WorkflowTimeout::Run => "run timeout",
            WorkflowTimeout::Execution => "execution timeout",
        }
    }
}

/// What a run that continues as new hands to the next run of its
/// instance, recorded in both runs' histories.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct Carried {
    /// Signals committed and not read yet, per name in arrival order (at
    /// most [`CARRIED_SIGNALS_MAX`]).
    #[serde(default)]
    pub signals: Vec<CarriedSignal>,
    /// Command ids of signals, cancellations and updates the chain has
    /// committed, oldest first (at most [`CARRIED_COMMANDS_MAX`]): a retry
    /// reaching the next run is still a duplicate.
    #[serde(default)]
    pub commands: Vec<CommandId>,
    /// The run's memo fields when it closed.
    #[serde(default)]
    pub memo: Vec<(String, Payload)>,
    /// The run's search attributes when it closed (each value encoded as
    /// [`EventKind::SearchAttributesUpserted`] holds it).
    #[serde(default)]
    pub search_attributes: Vec<(String, Payload)>,
    /// Each message stream's position, unread messages and newest keys.
    #[serde(default)]
    pub streams: Vec<CarriedStream>,
    /// The run timeout and execution deadline every run of the chain
    /// keeps (event version 7).
    #[serde(default)]
    pub timeouts: RunTimeouts,
}

/// A message stream's state handed to the next run.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct CarriedStream {
    /// The stream's name.
    pub name: String,
    /// The offset the next message sent to the stream gets.
    pub next_offset: u64,
    /// Messages committed and not read yet, in offset order (at most
    /// [`STREAM_BACKLOG_MAX`]): the reader's cursor is the first one's
    /// offset, or `next_offset` when there is none.
    pub unread: Vec<StreamMessage>,
    /// The newest idempotency keys with the offsets they were committed at
    /// (at most [`STREAM_KEYS_CARRIED_MAX`]), oldest first.
    pub keys: Vec<(MessageKey, u64)>,
}

/// One committed message of a stream.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct StreamMessage {
    /// Its position in the stream, from 0 and without gaps.
    pub offset: u64,
    /// Its idempotency key.
    pub key: MessageKey,
    /// Its payload.
    pub payload: Payload,
}

impl Carried {
    /// True when nothing is carried.
    pub fn is_empty(&self) -> bool {
        self.signals.is_empty()
            && self.commands.is_empty()
            && self.memo.is_empty()
            && self.search_attributes.is_empty()
            && self.timeouts.is_none()
            && self.streams.is_empty()
    }
}

/// An unread signal handed to the next run.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct CarriedSignal {
    /// The signal's name.
    pub name: String,
    /// Its payload.
    pub payload: Payload,
}

/// What workflow code sends to another instance (or its own) through the
/// outbox.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub enum Delivery {
    /// A signal, deduplicated at the target by a command id derived from
    /// the sending run and step.
    Signal {
        /// The signal's name.
        name: String,
        /// Its payload.
        payload: Payload,
    },
    /// A stream message, deduplicated at the target by its key.
    Message {
        /// The stream's name.
        stream: String,
        /// Its idempotency key.
        key: MessageKey,
        /// Its payload.
        payload: Payload,
    },
}

impl Delivery {
    /// Its payload.
    pub fn payload(&self) -> &Payload {
        match self {
            Delivery::Signal { payload, .. } | Delivery::Message { payload, .. } => payload,
        }
    }
}

/// What a run starts with: the body of [`EventKind::WorkflowStarted`].
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct WorkflowStart {
    /// The public instance.
    pub instance_id: InstanceId,
    /// This run.
    pub run_id: RunId,
    /// The registered workflow type name.
    pub workflow_type: String,
    /// The serialized input.
    pub input: Payload,
    /// The command id of the start request, if the client gave one.
    pub command_id: Option<CommandId>,
    /// The parent, for a child run.
    pub parent: Option<ParentRef>,
    /// The run this one continues, after continue-as-new.
    pub continued_from: Option<RunId>,
    /// Seed for the run's deterministic random numbers and uuids.
    pub random_seed: u64,
    /// The instance's run this one follows (the run it continues, or
    /// the closed run a new start replaced): the instance's runs form a
    /// recorded chain, and the commit refuses a start decided against
    /// an instance that moved on meanwhile.
    #[serde(default)]
    pub previous_run: Option<RunId>,
    /// What the run this one continues handed over.
    #[serde(default)]
    pub carried: Carried,
    /// Memo fields given at start (over those carried), as
    /// [`EventKind::MemoUpserted`] holds them.
    #[serde(default)]
    pub memo: Vec<(String, Payload)>,
    /// Search attributes given at start (over those carried), as
    /// [`EventKind::SearchAttributesUpserted`] holds them.
    #[serde(default)]
    pub search_attributes: Vec<(String, Payload)>,
    /// The run's timeouts (event version 7): the commit arms a timer
    /// for each deadline, at a reserved step.
    #[serde(default)]
    pub timeouts: RunTimeouts,
}

/// What a child is started with: the body of [`EventKind::ChildScheduled`].
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct ChildSchedule {
    /// The command's step.
    pub step: Step,
    /// Enclosing `all` barriers.
    pub group: GroupPath,
    /// The child's instance (derived from this run and step, or named
    /// by the code).
    pub child_instance_id: InstanceId,
    /// The child's run.
    pub child_run_id: RunId,
    /// The child's workflow type.
    pub workflow_type: String,
    /// The child's input.
    pub input: Payload,
    /// What happens to the child when this run closes.
    pub close_policy: ParentClosePolicy,
    /// Memo fields the child starts with (event version 6).
    #[serde(default)]
    pub memo: Vec<(String, Payload)>,
    /// Search attributes the child starts with, each a `SearchValue`
    /// payload (event version 6).
    #[serde(default)]
    pub search_attributes: Vec<(String, Payload)>,
    /// The child's run and execution timeouts, counted from its start
    /// (event version 7).
    #[serde(default)]
    pub timeouts: StartTimeouts,
}

/// The most bytes one [`EventKind`] may take in memory. Decoding returns
/// the enum by value through several visitor levels, each a copy of the
/// whole enum, and a replay moves each event several times more (into the
/// read's vector, out of the replay queue, into the run machine), so a
/// large variant slows the decoding and replay of every event: large
/// bodies are boxed instead (a unit test holds the enum to this). At 112
/// bytes an [`Event`] is 128, which the compiler moves with eight inline
/// 16-byte copies instead of a call to `memmove`.
pub const EVENT_KIND_BYTES_MAX: usize = 112;

/// Every kind of history event. Variants are only ever added at the end.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub enum EventKind {
    /// The run started. Always seq 1. Its body is boxed: it is the largest
    /// event, and every event is as large as the enum's largest variant
    /// (rmp-serde writes a newtype variant of a struct with the same bytes
    /// as the struct variant it was before).
    WorkflowStarted(Box<WorkflowStart>),
    /// The workflow returned a value.
    WorkflowCompleted {
        /// The serialized result.
        result: Payload,
    },
    /// The workflow returned an error.
    WorkflowFailed {
        /// The failure.
        failure: Failure,
    },
    /// Cancellation was requested from outside; workflow code observes it.
    WorkflowCancelRequested {
        /// The client's command id, deduplicating the request.
        command_id: Option<CommandId>,
        /// Why.
        reason: String,
    },
    /// The workflow finished by honouring a cancellation.
    WorkflowCancelled {
        /// Why.
        reason: String,
    },
    /// The run was terminated from outside, without running workflow code.
    WorkflowTerminated {
        /// Why.
        reason: String,
        /// The client's command id, deduplicating the termination.
        #[serde(default)]
        command_id: Option<CommandId>,
    },
    /// The run closed and a new run of the same instance continues it.
    WorkflowContinuedAsNew {
        /// The new run.
        new_run_id: RunId,
        /// Its input.
        input: Payload,
        /// What the new run takes over: unread signals, command ids seen
        /// (boxed: see [`EVENT_KIND_BYTES_MAX`]).
        #[serde(default)]
        carried: Box<Carried>,
    },
    /// An activity execution was scheduled (its first attempt is implied).
    ActivityScheduled {
        /// The command's step.
        step: Step,
        /// Enclosing `all` barriers, outermost first.
        group: GroupPath,
        /// The execution's id.
        execution_id: ExecutionId,
        /// The registered activity type name.
        activity_type: String,
        /// The serialized input.
        input: Payload,
        /// Timeouts and retry policy for this call (boxed: see
        /// [`EVENT_KIND_BYTES_MAX`]).
        options: Box<ActivityOptions>,
    },
    /// One attempt failed; `retry_at` says whether and when the next attempt
    /// is due (a durable backoff). Without it the execution has failed.
    ActivityAttemptFailed {
        /// The schedule's step.
        step: Step,
        /// The attempt that failed.
        attempt_id: AttemptId,
        /// The failure (boxed: see [`EVENT_KIND_BYTES_MAX`]).
        failure: Box<Failure>,
        /// When the next attempt is due, if there is one.
        retry_at: Option<Timestamp>,
        /// The last heartbeat details the attempt reported: the next
        /// attempt starts with them.
        #[serde(default)]
        heartbeat: Option<Payload>,
    },
    /// An attempt completed; the execution's result.
    ActivityCompleted {
        /// The schedule's step.
        step: Step,
        /// The attempt that produced it.
        attempt_id: AttemptId,
        /// The serialized result.
        result: Payload,
    },
    /// Workflow code asked to cancel an execution.
    ActivityCancelRequested {
        /// The schedule's step.
        step: Step,
        /// The execution.
        execution_id: ExecutionId,
    },
    /// The execution was cancelled; no further result will be committed.
    ActivityCancelled {
        /// The schedule's step.
        step: Step,
        /// The execution.
        execution_id: ExecutionId,
    },
    /// A durable timer started.
    TimerStarted {
        /// The command's step.
        step: Step,
        /// Enclosing `all` barriers.
        group: GroupPath,
        /// When it fires.
        fire_at: Timestamp,
    },
    /// A timer fired.
    TimerFired {
        /// The timer's step.
        step: Step,
        /// When it was due.
        fire_at: Timestamp,
    },
    /// A timer was cancelled before firing.
    TimerCancelled {
        /// The timer's step.
        step: Step,
        /// When it would have fired.
        fire_at: Timestamp,
    },
    /// A child workflow was scheduled; the outbox starts it. Boxed, as
    /// [`EventKind::WorkflowStarted`] is.
    ChildScheduled(Box<ChildSchedule>),
    /// The child run has started.
    ChildStarted {
        /// The scheduling step.
        step: Step,
        /// The child's run.
        child_run_id: RunId,
    },
    /// The child completed.
    ChildCompleted {
        /// The scheduling step.
        step: Step,
        /// The child's run.
        child_run_id: RunId,
        /// Its result.
        result: Payload,
    },
    /// The child failed, was cancelled or terminated.
    ChildFailed {
        /// The scheduling step.
        step: Step,
        /// The child's run.
        child_run_id: RunId,
        /// The failure.
        failure: Failure,
    },
    /// A signal arrived.
    SignalReceived {
        /// The signal's name.
        name: String,
        /// Its payload.
        payload: Payload,
        /// The client's command id, deduplicating the signal.
        command_id: Option<CommandId>,
    },
    /// An update was accepted.
    UpdateAccepted {
        /// The update's id (the client's command id).
        update_id: CommandId,
        /// The update's name.
        name: String,
        /// Its payload.
        payload: Payload,
    },
    /// An update completed.
    UpdateCompleted {
        /// The update's id.
        update_id: CommandId,
        /// Its result (empty when it failed).
        result: Payload,
        /// Its failure, when the handler failed.
        #[serde(default)]
        failure: Option<Failure>,
    },
    /// A side effect's value was recorded (also used for `now`, `random`,
    /// `uuid`).
    SideEffectRecorded {
        /// The command's step.
        step: Step,
        /// The recorded value.
        value: Payload,
    },
    /// A `select` winner was recorded under the run's commit.
    SelectionWinnerRecorded {
        /// The select's step.
        step: Step,
        /// The winner's index.
        member_index: u32,
        /// The winner's key.
        key: SelectKey,
        /// The winner's operation kind.
        operation: OperationKind,
        /// The durable step of the winner's operation.
        member_step: Step,
    },
    /// A losing `select` member's operation was cancelled before completing.
    SelectionOperationCancelled {
        /// The select's step.
        step: Step,
        /// The cancelled member's index.
        member_index: u32,
        /// The durable step of the member's operation.
        member_step: Step,
    },
    /// A code version marker, for evolving workflow code.
    VersionMarker {
        /// The command's step.
        step: Step,
        /// The change's id.
        change_id: String,
        /// The version chosen.
        version: u32,
    },
    /// Memo fields were upserted (not indexed; shown by `describe` and
    /// `list`). An empty payload removes the field.
    MemoUpserted {
        /// Field name and value pairs.
        fields: Vec<(String, Payload)>,
    },
    /// Search attributes were upserted: indexed, so `list` finds runs by
    /// them. Each value is a [`crate::search::SearchValue`] encoded as a
    /// payload; an empty payload removes the attribute.
    SearchAttributesUpserted {
        /// Attribute name and value pairs.
        attributes: Vec<(String, Payload)>,
    },
    /// A scope of workflow coroutines was cancelled.
    ScopeCancelled {
        /// The scope's step.
        step: Step,
        /// Why.
        reason: String,
    },
    /// Workflow code cancelled an open child (its scope was cancelled, or a
    /// `select` or barrier member that is the child was cancelled). The
    /// commit writes a cancellation intent that the outbox delivers to the
    /// child, even one whose start is still in the outbox.
    ChildCancelRequested {
        /// The child's scheduling step.
        step: Step,
        /// The child's run.
        child_run_id: RunId,
        /// Terminate it, or ask it to cancel.
        policy: ParentClosePolicy,
        /// Why.
        reason: String,
    },
    /// A message arrived on a stream. Its offset is the stream's next, in
    /// the order messages were committed; its key was not committed on the
    /// stream before (in this run or, within the carried window, an earlier
    /// run of the instance).
    MessageReceived {
        /// The stream's name.
        stream: String,
        /// Its position in the stream.
        offset: u64,
        /// The sender's idempotency key.
        key: MessageKey,
        /// Its payload.
        payload: Payload,
    },
    /// Workflow code sent a signal or a stream message to an instance; the
    /// outbox delivers it at least once and the target deduplicates.
    ExternalSendScheduled {
        /// The command's step.
        step: Step,
        /// The receiving instance (or run id).
        target: String,
        /// What is sent.
        delivery: Delivery,
    },
    /// The target answered the send for good: committed (with the
    /// message's offset), or refused (`failure`).
    ExternalSendCompleted {
        /// The sending step.
        step: Step,
        /// The stream offset a message was committed at.
        offset: Option<u64>,
        /// Why it was not delivered.
        failure: Option<Failure>,
    },
    /// A deadline of the run passed before it closed: the run closed
    /// without running more workflow code (event version 7).
    WorkflowTimedOut {
        /// Which timeout.
        timeout: WorkflowTimeout,
        /// The deadline that passed.
        deadline: Timestamp,
    },
}

/// The two kinds of history event. Every [`EventKind`] is exactly one: an
/// input reaches the run from outside and is handed to the machine; a
/// command is issued by workflow code and matched against history on
/// replay. The machine, the store and the simulator's checker all ask
/// [`EventKind::class`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum EventClass {
    /// From outside: start, results, timers fired, signals, updates,
    /// cancellation and termination.
    Input,
    /// Issued by workflow code (including the run's own closing result).
    Command,
}

/// A durable id that may receive at most one committed terminal event.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub enum DurableKey {
    /// The run itself: one terminal event.
    Run,
    /// One activity execution: one final outcome.
    Execution(Step),
    /// One attempt: one result.
    Attempt(Step, AttemptNo),
    /// One timer: fired or cancelled, once.
    Timer(Step),
    /// One child: one result.
    Child(Step),
    /// One `select`: one winner.
    SelectionWinner(Step),
    /// One `select` member: at most one cancellation.
    SelectionCancel(Step, u32),
    /// One client command (signal, cancel, update) to this run.
    Command(CommandId),
    /// One update: one completion.
    UpdateCompleted(CommandId),
    /// One scope: cancelled once.
    Scope(Step),
    /// One child: its cancellation requested once.
    ChildCancel(Step),
    /// One message of a stream: committed once per idempotency key.
    Message(String, MessageKey),
    /// One send to another instance: answered once.
    Send(Step),
}

impl fmt::Display for DurableKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DurableKey::Run => write!(f, "run"),
            DurableKey::Execution(s) => write!(f, "execution@{s}"),
            DurableKey::Attempt(s, a) => write!(f, "attempt@{s}#{a}"),
            DurableKey::Timer(s) => write!(f, "timer@{s}"),
            DurableKey::Child(s) => write!(f, "child@{s}"),
            DurableKey::SelectionWinner(s) => write!(f, "selection@{s}"),
            DurableKey::SelectionCancel(s, m) => write!(f, "selection-cancel@{s}#{m}"),
            DurableKey::Command(c) => write!(f, "command:{c}"),
            DurableKey::UpdateCompleted(c) => write!(f, "update:{c}"),
            DurableKey::Scope(s) => write!(f, "scope@{s}"),
            DurableKey::ChildCancel(s) => write!(f, "child-cancel@{s}"),
            DurableKey::Message(stream, key) => write!(f, "message:{stream}/{key}"),
            DurableKey::Send(s) => write!(f, "send@{s}"),
        }
    }
}

impl EventKind {
    /// The variant's name, as `keel show` prints it.
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::WorkflowStarted { .. } => "WorkflowStarted",
            EventKind::WorkflowCompleted { .. } => "WorkflowCompleted",
            EventKind::WorkflowFailed { .. } => "WorkflowFailed",
            EventKind::WorkflowCancelRequested { .. } => "WorkflowCancelRequested",
            EventKind::WorkflowCancelled { .. } => "WorkflowCancelled",
            EventKind::WorkflowTerminated { .. } => "WorkflowTerminated",
            EventKind::WorkflowContinuedAsNew { .. } => "WorkflowContinuedAsNew",
            EventKind::ActivityScheduled { .. } => "ActivityScheduled",
            EventKind::ActivityAttemptFailed { .. } => "ActivityAttemptFailed",
            EventKind::ActivityCompleted { .. } => "ActivityCompleted",
            EventKind::ActivityCancelRequested { .. } => "ActivityCancelRequested",
            EventKind::ActivityCancelled { .. } => "ActivityCancelled",
            EventKind::TimerStarted { .. } => "TimerStarted",
            EventKind::TimerFired { .. } => "TimerFired",
            EventKind::TimerCancelled { .. } => "TimerCancelled",
            EventKind::ChildScheduled { .. } => "ChildScheduled",
            EventKind::ChildStarted { .. } => "ChildStarted",
            EventKind::ChildCompleted { .. } => "ChildCompleted",
            EventKind::ChildFailed { .. } => "ChildFailed",
            EventKind::SignalReceived { .. } => "SignalReceived",
            EventKind::UpdateAccepted { .. } => "UpdateAccepted",
            EventKind::UpdateCompleted { .. } => "UpdateCompleted",
            EventKind::SideEffectRecorded { .. } => "SideEffectRecorded",
            EventKind::SelectionWinnerRecorded { .. } => "SelectionWinnerRecorded",
            EventKind::SelectionOperationCancelled { .. } => "SelectionOperationCancelled",
            EventKind::VersionMarker { .. } => "VersionMarker",
            EventKind::MemoUpserted { .. } => "MemoUpserted",
            EventKind::SearchAttributesUpserted { .. } => "SearchAttributesUpserted",
            EventKind::ScopeCancelled { .. } => "ScopeCancelled",
            EventKind::ChildCancelRequested { .. } => "ChildCancelRequested",
            EventKind::MessageReceived { .. } => "MessageReceived",
            EventKind::ExternalSendScheduled { .. } => "ExternalSendScheduled",
            EventKind::ExternalSendCompleted { .. } => "ExternalSendCompleted",
            EventKind::WorkflowTimedOut { .. } => "WorkflowTimedOut",
        }
    }

    /// Input or command. No wildcard: a new variant must be classified.
    pub fn class(&self) -> EventClass {
        use EventKind as K;
        match self {
            K::WorkflowStarted { .. }
            | K::ActivityCompleted { .. }
            | K::ActivityAttemptFailed { .. }
            | K::ActivityCancelled { .. }
            | K::TimerFired { .. }
            | K::ChildStarted { .. }
            | K::ChildCompleted { .. }
            | K::ChildFailed { .. }
            | K::SignalReceived { .. }
            | K::MessageReceived { .. }
            | K::ExternalSendCompleted { .. }
            | K::UpdateAccepted { .. }
            | K::WorkflowCancelRequested { .. }
            | K::WorkflowTerminated { .. }
            | K::WorkflowTimedOut { .. } => EventClass::Input,
            K::WorkflowCompleted { .. }
            | K::WorkflowFailed { .. }
            | K::WorkflowCancelled { .. }
            | K::WorkflowContinuedAsNew { .. }
            | K::ActivityScheduled { .. }
            | K::ActivityCancelRequested { .. }
            | K::TimerStarted { .. }
            | K::TimerCancelled { .. }
            | K::ChildScheduled { .. }
            | K::ChildCancelRequested { .. }
            | K::UpdateCompleted { .. }
            | K::SideEffectRecorded { .. }
            | K::SelectionWinnerRecorded { .. }
            | K::SelectionOperationCancelled { .. }
            | K::VersionMarker { .. }
            | K::MemoUpserted { .. }
            | K::SearchAttributesUpserted { .. }
            | K::ScopeCancelled { .. }
            | K::ExternalSendScheduled { .. } => EventClass::Command,
        }
    }

    /// True for an input (see [`EventKind::class`]).
    pub fn is_input(&self) -> bool {
        self.class() == EventClass::Input
    }

    /// True for a command (see [`EventKind::class`]).
    pub fn is_command(&self) -> bool {
        self.class() == EventClass::Command
    }

    /// The durable ids this event closes, if it is a terminal event. The
    /// store refuses a second terminal event for any of them.
    pub fn terminal_keys(&self) -> Vec<DurableKey> {
        match self {
            EventKind::WorkflowTerminated {
                command_id: Some(c),
                ..
            } => vec![DurableKey::Run, DurableKey::Command(c.clone())],
            EventKind::WorkflowCompleted { .. }
            | EventKind::WorkflowFailed { .. }
            | EventKind::WorkflowCancelled { .. }
            | EventKind::WorkflowTerminated { .. }
            | EventKind::WorkflowTimedOut { .. }
            | EventKind::WorkflowContinuedAsNew { .. } => vec![DurableKey::Run],
            EventKind::ActivityAttemptFailed {
                step,
                attempt_id,
                retry_at,
                ..
            } => {
                let mut keys = vec![DurableKey::Attempt(*step, attempt_id.attempt)];
                if retry_at.is_none() {
                    keys.push(DurableKey::Execution(*step));
                }
                keys
            }
            EventKind::ActivityCompleted {
                step, attempt_id, ..
            } => vec![
                DurableKey::Attempt(*step, attempt_id.attempt),
                DurableKey::Execution(*step),
            ],
            EventKind::ActivityCancelled { step, .. } => vec![DurableKey::Execution(*step)],
            EventKind::TimerFired { step, .. } | EventKind::TimerCancelled { step, .. } => {
                vec![DurableKey::Timer(*step)]
            }
            EventKind::ChildCompleted { step, .. } | EventKind::ChildFailed { step, .. } => {
                vec![DurableKey::Child(*step)]
            }
            EventKind::SelectionWinnerRecorded { step, .. } => {
                vec![DurableKey::SelectionWinner(*step)]
            }
            EventKind::SelectionOperationCancelled {
                step, member_index, ..
            } => vec![DurableKey::SelectionCancel(*step, *member_index)],
            EventKind::SignalReceived {
                command_id: Some(c),
                ..
            }
            | EventKind::WorkflowCancelRequested {
                command_id: Some(c),
                ..
            } => vec![DurableKey::Command(c.clone())],
            EventKind::UpdateAccepted { update_id, .. } => {
                vec![DurableKey::Command(update_id.clone())]
            }
            EventKind::UpdateCompleted { update_id, .. } => {
                vec![DurableKey::UpdateCompleted(update_id.clone())]
            }
            EventKind::ScopeCancelled { step, .. } => vec![DurableKey::Scope(*step)],
            EventKind::ChildCancelRequested { step, .. } => vec![DurableKey::ChildCancel(*step)],
            EventKind::MessageReceived { stream, key, .. } => {
                vec![DurableKey::Message(stream.clone(), key.clone())]
            }
            EventKind::ExternalSendCompleted { step, .. } => vec![DurableKey::Send(*step)],
            _ => Vec::new(),
        }
    }

    /// True for the events that close a run.
    pub fn closes_run(&self) -> bool {
        matches!(self.terminal_keys().first(), Some(DurableKey::Run))
    }

    /// The step this event belongs to, where it has one.
    pub fn step(&self) -> Option<Step> {
        match self {
            EventKind::ActivityScheduled { step, .. }
            | EventKind::ActivityAttemptFailed { step, .. }
            | EventKind::ActivityCompleted { step, .. }
            | EventKind::ActivityCancelRequested { step, .. }
            | EventKind::ActivityCancelled { step, .. }
            | EventKind::TimerStarted { step, .. }
            | EventKind::TimerFired { step, .. }
            | EventKind::TimerCancelled { step, .. }
            | EventKind::ChildStarted { step, .. }
            | EventKind::ChildCompleted { step, .. }
            | EventKind::ChildFailed { step, .. }
            | EventKind::SideEffectRecorded { step, .. }
            | EventKind::SelectionWinnerRecorded { step, .. }
            | EventKind::SelectionOperationCancelled { step, .. }
            | EventKind::VersionMarker { step, .. }
            | EventKind::ScopeCancelled { step, .. }
            | EventKind::ChildCancelRequested { step, .. }
            | EventKind::ExternalSendScheduled { step, .. }
            | EventKind::ExternalSendCompleted { step, .. } => Some(*step),
            EventKind::ChildScheduled(child) => Some(child.step),
            _ => None,
        }
    }

    /// The group path of a leaf command, where it has one.
    pub fn group(&self) -> Option<&GroupPath> {
        match self {
            EventKind::ActivityScheduled { group, .. } | EventKind::TimerStarted { group, .. } => {
                Some(group)
            }
            EventKind::ChildScheduled(child) => Some(&child.group),
            _ => None,
        }
    }

    /// Every payload the event carries, for the size limit.
    pub fn payloads(&self) -> Vec<&Payload> {
        match self {
            EventKind::WorkflowStarted(start) => std::iter::once(&start.input)
                .chain(start.memo.iter().map(|(_, p)| p))
                .chain(start.search_attributes.iter().map(|(_, p)| p))
                .chain(start.carried.memo.iter().map(|(_, p)| p))
                .chain(start.carried.search_attributes.iter().map(|(_, p)| p))
                .chain(
                    start
                        .carried
                        .streams
                        .iter()
                        .flat_map(|s| s.unread.iter().map(|m| &m.payload)),
                )
                .collect(),
            EventKind::WorkflowContinuedAsNew { input, .. }
            | EventKind::ActivityScheduled { input, .. } => vec![input],
            EventKind::ChildScheduled(child) => vec![&child.input],
            EventKind::WorkflowCompleted { result }
            | EventKind::ActivityCompleted { result, .. }
            | EventKind::ChildCompleted { result, .. }
            | EventKind::UpdateCompleted { result, .. } => vec![result],
            EventKind::SignalReceived { payload, .. }
            | EventKind::MessageReceived { payload, .. }
            | EventKind::UpdateAccepted { payload, .. } => vec![payload],
            EventKind::SideEffectRecorded { value, .. } => vec![value],
            EventKind::ExternalSendScheduled { delivery, .. } => vec![delivery.payload()],
            EventKind::ExternalSendCompleted { failure, .. } => {
                failure.iter().flat_map(|f| f.details.iter()).collect()
            }
            EventKind::MemoUpserted { fields: pairs }
            | EventKind::SearchAttributesUpserted { attributes: pairs } => {
                pairs.iter().map(|(_, p)| p).collect()
            }
            EventKind::WorkflowFailed { failure } | EventKind::ChildFailed { failure, .. } => {
                failure.details.iter().collect()
            }
            EventKind::ActivityAttemptFailed { failure, .. } => failure.details.iter().collect(),
            _ => Vec::new(),
        }
    }
}

/// Convenience: the execution id an activity event refers to.
pub fn execution_of(run_id: RunId, step: Step) -> ExecutionId {
    ExecutionId { run_id, step }
}

/// Convenience: the attempt id of attempt `attempt` of the execution at `step`.
pub fn attempt_of(run_id: RunId, step: Step, attempt: AttemptNo) -> AttemptId {
    AttemptId {
        execution: execution_of(run_id, step),
        attempt,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the enum every decoded event passes through stays small, so a
    // new large variant or field fails here, not silently in `keel bench
    // read`. Method: compare `size_of` with the named limit.
    #[test]
    fn an_event_kind_fits_its_byte_limit() {
        let bytes = std::mem::size_of::<EventKind>();
        assert!(
            bytes <= EVENT_KIND_BYTES_MAX,
            "EventKind is {bytes} bytes, over {EVENT_KIND_BYTES_MAX}: box the large variant's body"
        );
    }
}
