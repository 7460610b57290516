//! The driver: every decision keel makes around the run machine, as
//! deterministic code with no actix, no tokio, no clock, no threads and no
//! IO.
//!
//! Runs are spread over a fixed number of shards by the hash of their id
//! ([`shard_of`]); a [`Shard`] decides everything for its runs: activating a
//! run by replay, checking inputs against durable ids (and answering a
//! duplicate only once what it duplicates is durable), handing inputs to the
//! machine, asking for commits, running effects from the intent rows a
//! commit's answer names, leases and epochs of activity attempts, their
//! timeouts, heartbeats and redeliveries, durable retries, timers, outbox
//! deliveries, client requests, passivation, recovery and resumption.
//!
//! Like quinn-proto's `Connection`, a shard is driven from outside:
//!
//! - [`Shard::handle`] with each [`ShardInput`] (a client request, a
//!   message from a shard, a read or a commit answered, an attempt's result
//!   or heartbeat) and the current time;
//! - [`Shard::handle_timeout`] when the time [`Shard::poll_timeout`] asked
//!   for has come;
//! - [`Shard::poll_action`] until it returns `None`, performing each
//!   [`Action`]: read the store, commit a batch, run or stop an attempt, send
//!   a message to a shard, reply to a client.
//!
//! The actix engine (`keel-actors`) and the simulator (`keel-sim`) are the
//! two hosts; they decide nothing themselves.
//!
//! Architecture invariant: an effect action names the event it depends on
//! ([`Cause`]); it is only emitted once that event's commit was answered, or
//! when it was read back from the store. Every input ends committed, dropped
//! as a duplicate, or with its run parked and the reason recorded.

mod attempts;
mod backlog;
mod describe;
mod due;
mod handlers;
mod outbox;
mod ownership;
mod read;
mod requests;
mod run;
mod stats;
mod timers;
pub mod wire;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use keel_resilience::CompiledPipeline;
use keel_storage::{
    AttemptNo, CommandId, CommitAck, CommitBatch, Error as StoreError, Failure, InstanceId,
    LeaseEpoch, Outcome, Payload, RunId, Seq, Step, Timestamp,
};

use crate::machine::{Input, StartSpec};
use crate::workflow::WorkflowRegistry;

pub use attempts::{FAILURE_MESSAGE_BYTES_MAX, PROFILE_DEADLINE_MS_DEFAULT};
pub use describe::{AttemptView, ChildView, MachineView, RunDescription};
pub use ownership::{
    leases_unheld, member_gone, shards_taken_since, shards_to_release, shards_to_take,
    SHARD_LEASE_MS_DEFAULT, SHARD_LEASE_RENEW_PERCENT, SHARD_LEASE_RETRY_MS,
};
pub use read::{
    BacklogOf, DescribeFacts, InstanceState, ReadQuery, ReadResult, START_DEDUPE_RUNS_MAX,
};
pub use stats::{ShardStats, REJECTION_POLICIES_MAX, TIMER_LAG_BUCKETS_SECONDS};

use attempts::Attempts;
use backlog::Backlog;
pub use due::DUE_SWEEP_ENTRIES_MIN;
use due::{Due, DueQueue};
use outbox::Outbox;
use run::RunSlot;
use timers::Timers;

/// Lease of an attempt without a heartbeat or start-to-close timeout.
pub const LEASE_MS_DEFAULT: u64 = 60_000;
/// Redeliveries of one attempt after its lease ended before it fails.
pub const LEASE_REDELIVERIES_MAX: u32 = 3;
/// Runs a shard keeps in memory by default; beyond its share of the limit
/// the least recently used idle run is passivated (replayed when needed).
pub const RUN_CACHE_MAX_DEFAULT: usize = 10_000;
/// Least recently used runs one passivation looks at (it runs after every
/// input): while the cache is far over its limit with runs that are busy
/// and cannot leave, looking at all of them after each input made the
/// shard's work grow with the square of the backlog.
pub const PASSIVATE_SCAN_RUNS_MAX: usize = 256;
/// Attempts running at once in one engine process by default.
pub const WORKER_CONCURRENCY_MAX: usize = 1024;
/// Durable timers one read brings into a shard's memory by default (the
/// window): memory holds the soonest due, at most twice this many, and
/// the rest stay in the store until they come near (see `timers.rs`).
pub const TIMERS_IN_MEMORY_MAX: usize = 10_000;
/// How long before the last timer in memory comes due the next window is
/// read.
pub const TIMER_WINDOW_LEAD_MS: u64 = 2_000;
/// Pending attempts, and outbox messages, one read brings into a shard's
/// memory by default (the window): the next window is read once fewer
/// than this many of the rows windows brought in are still held, so a
/// restart over a million queued attempts holds a window of them, not a
/// million (see `backlog.rs`).
pub const INTENTS_IN_MEMORY_MAX: usize = 10_000;
/// How far ahead of now a window takes attempts that wait out a retry
/// backoff; later ones stay in the store until a pass reaches them in
/// time.
pub const BACKLOG_LEAD_MS: u64 = 2_000;
/// How long a window of task or outbox rows may hold the room for the
/// next without getting any of its rows done before the next is read
/// anyway (its rows may wait on rows not read yet).
pub const BACKLOG_STALL_MS: u64 = 5_000;
/// Failed activations (unreadable history) before a run is parked.
pub const RUN_RESTARTS_MAX: u32 = 5;
/// How long a run whose store is out of reach (a database restarting)
/// waits before its history, or its intent rows, are read again. Such
/// failures do not count towards [`RUN_RESTARTS_MAX`]: the history is not
/// at fault.
pub const RUN_UNREACHABLE_RETRY_MS: u64 = 500;

/// How long an attempt a resilience profile refused waits before it is
/// offered again.
pub const PROFILE_REJECTION_RETRY_MS: u64 = 250;
/// First and longest wait between two tries of a delivery that must not be
/// lost (an attempt's result, a timer, an outbox message).
pub const DELIVERY_BACKOFF_MS_MIN: u64 = 5;
/// See [`DELIVERY_BACKOFF_MS_MIN`].
pub const DELIVERY_BACKOFF_MS_MAX: u64 = 5_000;

/// How long an outbox delivery waits for its answer before it is
/// delivered again (the target's process died or lost the shard with the
/// message in hand).
pub const OUTBOX_ANSWER_WAIT_MS: u64 = 10_000;

/// Times the outbox delivers a send from workflow code again after the
/// instance's run answered "closed" (it may have continued as new, and the
/// instance then names the next run) or the instance was unknown (a child
/// whose start is in flight). After that many, the send fails.
pub const SEND_CLOSED_FOLLOWS_MAX: u32 = 4;
/// Requests waiting for one run (its activation, or its commits in flight)
/// before more are refused with a retryable answer: the run's mailbox.
pub const RUN_QUEUE_MAX: usize = 1024;
/// Clients waiting for one run's outcome before more are refused with a
/// retryable answer (a warning is logged at 80%).
pub const RESULT_WAITERS_PER_RUN_MAX: usize = 4096;
/// A client waiting for a run that continued as new is told so only once
/// the next run exists (its hand-off is in flight): checked this often...
pub const CONTINUATION_CHECK_MS: u64 = 10;
/// ...this many times, before the client is answered with a retry.
pub const CONTINUATION_CHECKS_MAX: u32 = 200;
/// Times a start is decided again after another start took the instance.
pub const START_DECISIONS_MAX: u32 = 8;
/// How long an async child waits for its parent to bind its closure before
/// its activation is tried again, and how often before it is parked.
pub const ASYNC_BIND_RETRY_MS: u64 = 20;
/// See [`ASYNC_BIND_RETRY_MS`].
pub const ASYNC_BIND_TRIES_MAX: u32 = 50;

/// A shard of the engine: a fixed slice of runs by hash.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, serde::Serialize, serde::Deserialize,
)]
pub struct ShardId(pub u16);

impl std::fmt::Display for ShardId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard-{}", self.0)
    }
}

/// The answer to a list from the store's read of the index: the same
/// whether a shard read it or a process that runs no shard (the index is
/// shared, so any process may read it).
pub fn list_answer(result: Result<ReadResult, StoreError>) -> Answer {
    match result {
        Ok(ReadResult::Listed(page)) => Answer::Listed(page),
        Ok(ReadResult::ListRefused(why)) => Answer::Refused(Refusal::BadFilter(why)),
        Ok(other) => unreachable!("a list read answers a list: {other:?}"),
        Err(e) => Answer::Retry(format!("index unreadable: {e}")),
    }
}

/// The shard a run belongs to, out of `shards`.
pub fn shard_of(run: RunId, shards: u16) -> ShardId {
    ShardId((shard_hash(run) % u64::from(shards.max(1))) as u16)
}

/// The hash [`shard_of`] reduces modulo the shard count.
fn shard_hash(run: RunId) -> u64 {
    let b = run.as_bytes();
    u64::from_le_bytes(b[8..16].try_into().expect("16-byte id"))
        ^ u64::from_le_bytes(b[..8].try_into().expect("16-byte id")).rotate_left(7)
}

/// A run id made from one random word that lands on the same shard as
/// `beside` for every shard count: an async child's run, whose closure
/// only its parent's process can bind, so both must be owned by one
/// process when several share the store. Keeps 64 bits of randomness.
pub fn run_id_beside(beside: RunId, high: u64) -> RunId {
    // `shard_hash` is the low word's bytes reversed, xored with the high
    // word's rotated: choose the low word that gives `beside`'s hash.
    let rotated = high.swap_bytes().rotate_left(7);
    let id = RunId::from_u64_pair(high, (shard_hash(beside) ^ rotated).swap_bytes());
    debug_assert_eq!(shard_hash(id), shard_hash(beside));
    id
}

/// A run id made from two random words that lands on `shard` (of
/// `shards`): a client starting an instance gives its run the shard that
/// resolves the instance's name, so the start, the `result` and the signals
/// naming the instance are decided on one shard, without a hop between
/// arbiters. Keeps all but about `log2(shards) + 1` bits of the randomness.
pub fn run_id_on_shard(high: u64, low: u64, shard: ShardId, shards: u16) -> RunId {
    let s = u64::from(shards.max(1));
    let t = u64::from(shard.0) % s;
    // `shard_of` hashes the id's bytes: the low word's bytes reversed,
    // xored with the high word's rotated. Choose that hash, then the low
    // word that gives it.
    let rotated = high.swap_bytes().rotate_left(7);
    let hash = ((low >> 1) / s) * s + t;
    let id = RunId::from_u64_pair(high, (hash ^ rotated).swap_bytes());
    debug_assert_eq!(shard_of(id, shards), ShardId(t as u16));
    id
}

/// Bits of a client-made run id's high word that hold the time it was
/// made, in milliseconds since the UNIX epoch (enough until the year 2109);
/// the other bits of that word are random.
pub const RUN_ID_TIME_BITS: u32 = 42;

/// The high word of a run id a client makes at `unix_ms`: the time, then
/// the top bits of `random`. Runs started together get neighbouring ids,
/// so their run records and histories sit together in the store's key
/// order, and a list of runs by start time reads a few blocks rather than
/// one per run. The low word (see [`run_id_on_shard`]) stays random.
pub fn run_id_high(unix_ms: u64, random: u64) -> u64 {
    (unix_ms << (64 - RUN_ID_TIME_BITS)) | (random >> RUN_ID_TIME_BITS)
}

/// The shard that resolves a request naming `target` (an instance id or a
/// run id): any shard would do; hashing spreads them.
pub fn shard_of_target(target: &str, shards: u16) -> ShardId {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in target.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    ShardId((h % u64::from(shards.max(1))) as u16)
}

/// A client request's id, chosen by the host; its [`Action::Reply`] carries
/// it back.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, serde::Serialize, serde::Deserialize,
)]
pub struct RequestId(pub u64);

/// A token a shard hands out with a read, a commit or a message that
/// expects an answer; the answer carries it back.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, serde::Serialize, serde::Deserialize,
)]
pub struct Token(pub u64);

/// One activity execution as its shard supervises it: (run, step).
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, serde::Serialize, serde::Deserialize,
)]
pub struct AttemptKey {
    /// The run.
    pub run: RunId,
    /// The step that scheduled the execution.
    pub step: Step,
}

/// The event an effect depends on: `(run, seq)` must be durable before the
/// effect happens. `None` for effects of rows read back from the store.
pub type Cause = Option<(RunId, Seq)>;

/// What `start` does when the instance's last run is closed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ReusePolicy {
    /// Start a new run.
    #[default]
    AllowDuplicate,
    /// Start a new run only if the last one did not complete.
    AllowDuplicateFailedOnly,
    /// Refuse: the instance ran once.
    RejectDuplicate,
}

/// A client request.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub enum Request {
    /// Start a run of `workflow_type` as `instance`; `run_id` is the new
    /// run's id if one starts (drawn by the host).
    Start {
        /// The new run's id.
        run_id: RunId,
        /// The registered workflow type.
        workflow_type: String,
        /// The instance.
        instance: InstanceId,
        /// The serialized input.
        input: Payload,
        /// Deduplicates retries of this start.
        command_id: Option<CommandId>,
        /// What to do when the instance's last run is closed.
        reuse: ReusePolicy,
        /// The run's seed (drawn by the host).
        random_seed: u64,
        /// Signal-with-start: this signal is committed with the new run's
        /// start, or sent to the instance's open run if it has one.
        signal: Option<StartSignal>,
        /// Memo fields to start with (an empty payload is no field).
        memo: Vec<(String, Payload)>,
        /// Search attributes to start with, each a `SearchValue` payload:
        /// the start's commit indexes them.
        search_attributes: Vec<(String, Payload)>,
        /// The run and execution timeouts, from the start.
        timeouts: keel_storage::StartTimeouts,
        /// Answer with the run's outcome once it closes (as
        /// [`Request::Result`] would) instead of once the start is
        /// durable: a start and a wait for one request and one answer.
        /// Ignored with a `signal` (a signal-with-start is answered for
        /// its signal when the instance runs already).
        #[serde(default)]
        await_outcome: bool,
    },
    /// A signal to the instance's current run (or a run by id).
    Signal {
        /// Instance or run id.
        target: String,
        /// The signal's name.
        name: String,
        /// Its payload.
        payload: Payload,
        /// Deduplicates retries.
        command_id: Option<CommandId>,
    },
    /// Cooperative cancellation.
    Cancel {
        /// Instance or run id.
        target: String,
        /// Why.
        reason: String,
        /// Deduplicates retries.
        command_id: Option<CommandId>,
    },
    /// A message to a stream of the instance's current run (or a run by
    /// id), committed once per `key`.
    SendMessage {
        /// Instance or run id.
        target: String,
        /// The stream's name.
        stream: String,
        /// The idempotency key: a repeat answers with the first offset.
        key: keel_storage::MessageKey,
        /// Its payload.
        payload: Payload,
    },
    /// Termination without running workflow code.
    Terminate {
        /// Instance or run id.
        target: String,
        /// Why.
        reason: String,
        /// Deduplicates retries.
        command_id: Option<CommandId>,
    },
    /// The run's outcome, once it closes.
    Result {
        /// Instance or run id.
        target: String,
    },
    /// Status, open waits, attempts, children, parked reason.
    Describe {
        /// Instance or run id.
        target: String,
    },
    /// Re-checks a parked run against the current code.
    Resume {
        /// Instance or run id.
        target: String,
    },
    /// Asks a query handler of the run's code; writes nothing.
    Query {
        /// Instance or run id.
        target: String,
        /// The handler's name.
        name: String,
        /// Its serialized arguments.
        args: Payload,
    },
    /// Asks an update handler of the run's code to change its state.
    Update {
        /// Instance or run id.
        target: String,
        /// The handler's name.
        name: String,
        /// Its serialized arguments.
        args: Payload,
        /// The update's id: a repeat gets the first outcome.
        update_id: CommandId,
    },
    /// One page of the runs a filter matches, read through the store's
    /// index (committed state only).
    #[serde(skip)]
    List {
        /// Which runs.
        filter: keel_storage::RunFilter,
        /// At most this many (clamped to `LIST_PAGE_RUNS_MAX`).
        page_size: usize,
        /// The token the page before handed out.
        after: Option<keel_storage::PageToken>,
    },
}

/// The signal of a signal-with-start ([`Request::Start`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StartSignal {
    /// The signal's name.
    pub name: String,
    /// Its payload.
    pub payload: Payload,
    /// Deduplicates the signal.
    pub command_id: Option<CommandId>,
}

impl Request {
    /// The shard this request goes to.
    pub fn shard(&self, shards: u16) -> ShardId {
        match self {
            Request::Start { run_id, .. } => shard_of(*run_id, shards),
            Request::Signal { target, .. }
            | Request::SendMessage { target, .. }
            | Request::Cancel { target, .. }
            | Request::Terminate { target, .. }
            | Request::Result { target }
            | Request::Describe { target }
            | Request::Resume { target }
            | Request::Query { target, .. }
            | Request::Update { target, .. } => shard_of_target(target, shards),
            // Any shard reads the index; the first one is as good as any.
            Request::List { .. } => ShardId(0),
        }
    }

    /// Its kind, as spans and logs name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Start { .. } => "start",
            Request::Signal { .. } => "signal",
            Request::Cancel { .. } => "cancel",
            Request::SendMessage { .. } => "send_message",
            Request::Terminate { .. } => "terminate",
            Request::Result { .. } => "result",
            Request::Describe { .. } => "describe",
            Request::Resume { .. } => "resume",
            Request::Query { .. } => "query",
            Request::Update { .. } => "update",
            Request::List { .. } => "list",
        }
    }
}

/// Why a request was refused for good. Nothing was written.
#[derive(Clone, Debug, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum Refusal {
    /// No workflow of this type is registered.
    #[error("unknown workflow type {0:?}")]
    UnknownWorkflowType(String),
    /// The input does not decode into the workflow's input type.
    #[error("input for workflow {workflow_type:?} does not decode: {detail}")]
    InvalidInput {
        /// The workflow type.
        workflow_type: String,
        /// The decoder's message.
        detail: String,
    },
    /// No instance or run by that id.
    #[error("unknown instance or run {0:?}")]
    UnknownRun(String),
    /// The run is closed.
    #[error("run {0} is closed")]
    RunClosed(RunId),
    /// The instance's last run is closed and the reuse policy refuses a new one.
    #[error(
        "instance {instance} already ran (run {run}, {status}); the reuse policy refuses a new run"
    )]
    AlreadyClosed {
        /// The instance.
        instance: InstanceId,
        /// Its last run.
        run: RunId,
        /// That run's status.
        #[serde(deserialize_with = "wire::run_status")]
        status: wire::Word,
    },
    /// The run is parked.
    #[error("run {run} is parked: {reason}")]
    Parked {
        /// The run.
        run: RunId,
        /// Why.
        reason: String,
    },
    /// The input refers to nothing open in the run (dropped).
    #[error("run {run}: {detail}")]
    NothingOpen {
        /// The run.
        run: RunId,
        /// What was not open.
        detail: String,
    },
    /// The store refused the request's commit for a reason retrying cannot
    /// fix (a payload or history over its limit).
    #[error("the store refused it: {0}")]
    Store(String),
    /// The engine is shutting down.
    #[error("the engine is shut down")]
    Shutdown,
    /// The store does not accept writes (a full or failing disk): the
    /// request needs a commit, or waits for progress that cannot happen.
    /// Nothing was written; trying again once the store is healthy may
    /// succeed.
    #[error("the store does not accept writes: {0}")]
    Unavailable(String),
    /// A query or update the run's code did not answer: no handler by
    /// that name, arguments that do not decode, a validator's rejection,
    /// a handler that panicked or tried to write.
    #[error(transparent)]
    Handler(crate::handlers::HandlerError),
    /// A list filter or page token that does not check; nothing was read.
    #[error("{0}")]
    BadFilter(String),
    /// A stream message whose stream name or key does not check.
    #[error("bad message: {0}")]
    BadMessage(String),
    /// The stream (or the run's set of streams) is full: nothing was
    /// written; sending again once the workflow has read may succeed.
    #[error("run {run}: {detail}")]
    StreamFull {
        /// The run.
        run: RunId,
        /// Which limit.
        detail: String,
    },
    /// The update was applied by an earlier run of the instance, which
    /// continued as new to `run`: not applied again (its outcome is in the
    /// earlier run's history).
    #[error(
        "update {update_id} was applied by an earlier run of this instance, which continued as \
         new to run {run}; its outcome is in that run's history"
    )]
    UpdateInEarlierRun {
        /// The update.
        update_id: CommandId,
        /// The run it reached now.
        run: RunId,
    },
}

/// The answer to a request or a message: one vocabulary for everything a
/// shard answers.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Answer {
    /// Committed: its event is durable.
    Committed,
    /// Already committed before (a redelivery, a retry, a late result):
    /// dropped, and what it duplicates is durable.
    Duplicate,
    /// A new run started.
    Started(RunId),
    /// The start found its run already there (an open run of the instance,
    /// or an earlier start with the same command id).
    Existing(RunId),
    /// Refused for good.
    Refused(Refusal),
    /// Not done; trying again may succeed (a commit failed).
    Retry(String),
    /// A run's outcome.
    Outcome(RunId, Outcome),
    /// A run's description.
    Described(Box<RunDescription>),
    /// What a resume found.
    Resumed(Resumed),
    /// A query's value.
    Queried(Payload),
    /// An update's outcome: its handler's value or failure.
    Updated(Result<Payload, keel_storage::Failure>),
    /// A page of runs.
    #[serde(skip)]
    Listed(keel_storage::RunPage),
    /// A stream message is committed at `offset`; `first` is false when a
    /// send with the same key committed it before.
    Sent {
        /// Its offset in the stream.
        offset: u64,
        /// Whether this send committed it.
        first: bool,
    },
}

/// What [`Request::Resume`] found.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Resumed {
    /// The run.
    pub run: RunId,
    /// Whether it was parked.
    pub was_parked: bool,
    /// Whether its history replays against the current code now; if not,
    /// the run stays parked and `reason` says why.
    pub fits: bool,
    /// Why it does not fit.
    pub reason: Option<String>,
}

impl Resumed {
    /// The run replays against the current code (and, if it was parked, is
    /// no longer).
    pub fn fitting(run: RunId, was_parked: bool) -> Self {
        Resumed {
            run,
            was_parked,
            fits: true,
            reason: None,
        }
    }

    /// The run still does not fit the current code and stays parked.
    pub fn still_parked(run: RunId, reason: String) -> Self {
        Resumed {
            run,
            was_parked: true,
            fits: false,
            reason: Some(reason),
        }
    }
}

/// Where an answer goes.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum ReplyTo {
    /// Nobody waits.
    Nobody,
    /// A client: the shard emits [`Action::Reply`].
    Client(RequestId),
    /// A shard: [`Message::Answer`] with this token.
    Shard(ShardId, Token),
}

/// What a message asks of a run.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RunOp {
    /// An input.
    Input(Input),
    /// The run's outcome once it closes.
    Result,
    /// Its description.
    Describe,
    /// Re-check a parked run.
    Resume,
    /// Replay it, so that the closures of its async children are bound.
    Activate,
    /// A query.
    Query {
        /// The handler's name.
        name: String,
        /// Its arguments.
        args: Payload,
    },
}

/// A message between shards (a shard may send one to itself).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Message {
    /// An operation on a run of the receiving shard.
    ToRun {
        /// The run.
        run: RunId,
        /// What to do.
        op: RunOp,
        /// Who waits for the answer.
        reply: ReplyTo,
    },
    /// Start a run of the receiving shard (a child, a continuation), then
    /// hand it `then` in the same commit (a pending cancellation).
    Start {
        /// The run.
        spec: Box<StartSpec>,
        /// An input for the new run, committed with its start.
        then: Option<Input>,
        /// Who waits for the answer.
        reply: ReplyTo,
    },
    /// The answer to a message that carried [`ReplyTo::Shard`].
    Answer {
        /// The token the request carried.
        token: Token,
        /// The answer.
        answer: Answer,
    },
}

/// Everything a host hands a shard.
#[derive(Debug)]
pub enum ShardInput {
    /// A client request routed here (see [`Request::shard`]).
    Request {
        /// Its id, for the reply.
        id: RequestId,
        /// The request.
        request: Request,
    },
    /// A message from a shard.
    Message(Message),
    /// A read asked for with [`Action::Read`], done.
    Read {
        /// Its token.
        token: Token,
        /// What it found.
        result: Result<ReadResult, StoreError>,
    },
    /// A commit asked for with [`Action::Commit`], answered by the store.
    Committed {
        /// Its token.
        token: Token,
        /// The store's answer.
        result: Result<CommitAck, StoreError>,
    },
    /// A copy of an attempt finished.
    AttemptFinished {
        /// The execution.
        key: AttemptKey,
        /// The attempt.
        attempt: AttemptNo,
        /// The copy's lease epoch.
        epoch: LeaseEpoch,
        /// Its result.
        result: Result<Payload, Failure>,
    },
    /// A copy of an attempt reported progress.
    Heartbeat {
        /// The execution.
        key: AttemptKey,
        /// The copy's lease epoch.
        epoch: LeaseEpoch,
        /// Details for a later delivery or attempt.
        details: Option<Payload>,
    },
    /// A resilience profile refused a copy in this process before it ran.
    AttemptRefused {
        /// The execution.
        key: AttemptKey,
        /// The copy's lease epoch.
        epoch: LeaseEpoch,
        /// The policy that refused it.
        policy: String,
    },
    /// The engine process that took the copy is gone (its member record
    /// ended; see [`member_gone`]): its lease counts as ended now.
    CopyLost {
        /// The execution.
        key: AttemptKey,
        /// The copy's lease epoch.
        epoch: LeaseEpoch,
    },
    /// The store's health changed (the host reports what it observes; see
    /// `keel_storage::health`). The driver learns it only from here, never
    /// from a failed commit: an answer that arrives late must not flip a
    /// healthy view back.
    StoreHealth(keel_storage::StoreHealth),
    /// Another shard of the engine was taken by a new owner (a host that
    /// reads the shard leases tells every shard it runs). Deliveries to it
    /// still waiting for their answers may have been lost with its earlier
    /// owner: they are delivered again now, not after
    /// [`OUTBOX_ANSWER_WAIT_MS`].
    PeerTaken(ShardId),
    /// The renewal asked for with [`Action::RenewLease`], done: the lease
    /// as renewed, or why not ([`keel_storage::Error::Fenced`]: another
    /// process took the shard).
    LeaseRenewed {
        /// The store's answer.
        result: Result<keel_storage::ShardLease, StoreError>,
    },
    /// The fallback asked for with [`Action::RunFallback`], done.
    FallbackDone {
        /// The execution.
        key: AttemptKey,
        /// The attempt whose failure it replaces.
        attempt: AttemptNo,
        /// The fallback's value, if the activity has one.
        result: Option<Result<Payload, Failure>>,
    },
}

/// One attempt for a host to run, under a lease (it may travel to another
/// engine process that takes it: see `keel_actors`' shared attempts).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AttemptOrder {
    /// The execution.
    pub key: AttemptKey,
    /// The attempt.
    pub attempt: AttemptNo,
    /// The lease's fencing epoch: results and heartbeats carry it back.
    pub epoch: LeaseEpoch,
    /// The activity type.
    pub activity_type: String,
    /// Its input.
    pub input: Payload,
    /// The resilience profile to admit it through in this process.
    pub profile: Option<String>,
    /// Whether it is a retry (for the profile's retry budget).
    pub is_retry: bool,
    /// Time left to the execution's deadline (for the profile's context).
    pub deadline_ms: u64,
    /// The last heartbeat details of an earlier delivery or attempt.
    pub heartbeat: Option<Payload>,
    /// When the lease ends unless a heartbeat extends it.
    pub lease_until: Timestamp,
    /// The interval within which the attempt must heartbeat, if any.
    pub heartbeat_ms: Option<u64>,
    /// The attempt's limit from start to result (the call's or its
    /// profile's), if any.
    pub start_to_close_ms: Option<u64>,
    /// True when no retry follows a failure of this attempt (its policy's
    /// last attempt, or no retry policy).
    pub final_attempt: bool,
}

/// What a shard asks its host to do.
#[derive(Debug)]
pub enum Action {
    /// Read the store (see [`ReadQuery::perform`]); answer with
    /// [`ShardInput::Read`].
    Read {
        /// The token for the answer.
        token: Token,
        /// What to read.
        query: ReadQuery,
    },
    /// Commit a batch; answer with [`ShardInput::Committed`] once the store
    /// answered (durable per its durability mode).
    Commit {
        /// The token for the answer.
        token: Token,
        /// The batch.
        batch: CommitBatch,
        /// No other commit, read or running attempt of the shard is in
        /// flight and no action is queued behind this one: the shard most
        /// likely waits for this commit alone, so the host may have it
        /// written on its own thread ([`keel_storage::Store::commit_alone`]).
        /// A heuristic: a fallback, an outbox delivery or a message from
        /// elsewhere may still arrive meanwhile, and waits at most one sync.
        /// Set when the host takes the action ([`Shard::poll_action`]).
        alone: bool,
    },
    /// Run an attempt; report with [`ShardInput::AttemptFinished`],
    /// [`ShardInput::Heartbeat`], [`ShardInput::AttemptRefused`].
    RunAttempt {
        /// The attempt.
        order: AttemptOrder,
        /// The event it depends on.
        cause: Cause,
    },
    /// Ask the copy with this epoch to stop (cancelled, timed out, its
    /// lease ended, or its run closed).
    StopAttempt {
        /// The execution.
        key: AttemptKey,
        /// The copy's epoch.
        epoch: LeaseEpoch,
    },
    /// Call the activity's fallback for a final failure; answer with
    /// [`ShardInput::FallbackDone`].
    RunFallback {
        /// The execution.
        key: AttemptKey,
        /// The attempt whose failure it replaces.
        attempt: AttemptNo,
        /// The activity type.
        activity_type: String,
        /// Its input.
        input: Payload,
        /// The failure.
        failure: Failure,
    },
    /// Deliver a message to a shard.
    Send {
        /// The receiving shard.
        to: ShardId,
        /// The message.
        message: Message,
        /// The event it depends on.
        cause: Cause,
    },
    /// Answer a client request.
    Reply {
        /// The request.
        id: RequestId,
        /// The answer.
        answer: Answer,
        /// The event it depends on.
        cause: Cause,
    },
    /// Renew the shard's lease in the store; answer with
    /// [`ShardInput::LeaseRenewed`].
    RenewLease {
        /// The lease as the shard holds it.
        lease: keel_storage::ShardLease,
    },
    /// Release the shard's lease in the store, so another process takes
    /// the shard at once (after [`Shard::release`]); nothing answers.
    ReleaseLease {
        /// The lease as the shard held it.
        lease: keel_storage::ShardLease,
    },
    /// The shard lost its lease and stopped (see [`Shard::hold`]): perform
    /// the actions before this one, then drop the shard; another process
    /// owns its runs now, or will once the lease can be taken.
    ShardLost {
        /// The shard.
        shard: ShardId,
        /// Why.
        reason: String,
    },
}

/// A deliberately broken driver, for the simulator to prove that its checks
/// can fail (`keel sim --break`). Production never sets one.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BreakMode {
    /// Inputs are not checked against durable ids (and the store's
    /// duplicate-terminal check is off): a duplicate result is committed
    /// twice.
    NoAttemptDedupe,
    /// Attempts of a commit are dispatched when the commit is asked for,
    /// before it is durable.
    EffectBeforeCommit,
    /// A client is told "committed" when the commit is asked for, before
    /// it is durable: a crash loses an acknowledged commit.
    LoseUnsyncedAck,
    /// The close-policy and cancellation intents of the outbox are never
    /// delivered: children outlive the parent and the scope that cancelled
    /// them.
    SkipClosePolicy,
    /// A lease that ended is redelivered under the same epoch: the copy it
    /// should fence keeps its lease.
    RedeliverSameEpoch,
    /// A query is answered while the run's commits are in flight: it can
    /// show state that is not durable yet.
    QuerySpeculative,
    /// Commits carry no shard fence: a process that lost its shard's
    /// lease while a commit was on its way still writes it.
    SkipFence,
    /// The closures of async children a run saw close are kept: a parent
    /// replayed after its children closed binds them again, and the table
    /// grows with the work done.
    KeepClosedClosures,
}

impl BreakMode {
    /// Every mode.
    pub const ALL: [BreakMode; 8] = [
        BreakMode::NoAttemptDedupe,
        BreakMode::EffectBeforeCommit,
        BreakMode::LoseUnsyncedAck,
        BreakMode::SkipClosePolicy,
        BreakMode::RedeliverSameEpoch,
        BreakMode::QuerySpeculative,
        BreakMode::SkipFence,
        BreakMode::KeepClosedClosures,
    ];

    /// The `--break` name.
    pub fn name(self) -> &'static str {
        match self {
            BreakMode::NoAttemptDedupe => "no-attempt-dedupe",
            BreakMode::EffectBeforeCommit => "effect-before-commit",
            BreakMode::LoseUnsyncedAck => "lose-unsynced-ack",
            BreakMode::SkipClosePolicy => "skip-close-policy",
            BreakMode::RedeliverSameEpoch => "redeliver-same-epoch",
            BreakMode::QuerySpeculative => "query-speculative",
            BreakMode::SkipFence => "skip-fence",
            BreakMode::KeepClosedClosures => "keep-closed-closures",
        }
    }
}

impl std::fmt::Display for BreakMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BreakMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        BreakMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = BreakMode::ALL.iter().map(|m| m.name()).collect();
                format!(
                    "unknown break mode {s:?}; expected one of: {}",
                    names.join(", ")
                )
            })
    }
}

/// What a shard needs to decide: the workflows, the limits, the activity
/// profiles.
#[derive(Clone)]
pub struct DriverConfig {
    /// Shards in the engine.
    pub shards: u16,
    /// Runs this shard keeps in memory before passivating idle ones.
    pub run_cache_max: usize,
    /// Lease of an attempt without a heartbeat or start-to-close timeout.
    pub lease_ms_default: u64,
    /// Attempts this shard runs at once.
    pub worker_concurrency_max: usize,
    /// Durable timers one window read brings into memory (memory holds at
    /// most twice as many; see [`TIMERS_IN_MEMORY_MAX`]).
    pub timers_in_memory_max: usize,
    /// Pending attempts, and outbox messages, one window read brings into
    /// memory at recovery (see [`INTENTS_IN_MEMORY_MAX`]).
    pub intents_in_memory_max: usize,
    /// Resilience profiles activities may name. The driver reads their
    /// attempt timeout, retry policy, classifier and fallback switch; the
    /// host admits attempts through them.
    pub profiles: BTreeMap<String, Arc<CompiledPipeline<Failure>>>,
    /// How long a shard lease lasts unless renewed, when the store is
    /// shared by several processes (see [`Shard::hold`]).
    pub shard_lease_ms: u64,
    /// How long a commit may go unanswered before the shard takes the
    /// store for stalled ([`COMMIT_STALL_MS_DEFAULT`]).
    pub commit_stall_ms: u64,
    /// A deliberately broken driver (simulator only).
    pub breaks: Option<BreakMode>,
}

impl std::fmt::Debug for DriverConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverConfig")
            .field("shards", &self.shards)
            .field("run_cache_max", &self.run_cache_max)
            .field("lease_ms_default", &self.lease_ms_default)
            .field("worker_concurrency_max", &self.worker_concurrency_max)
            .field("timers_in_memory_max", &self.timers_in_memory_max)
            .field("intents_in_memory_max", &self.intents_in_memory_max)
            .field("shard_lease_ms", &self.shard_lease_ms)
            .field("profiles", &self.profiles.keys().collect::<Vec<_>>())
            .field("breaks", &self.breaks)
            .finish()
    }
}

/// How long a commit may go unanswered, by default, before its shard takes
/// the store for stalled (a hung disk, a database that holds the
/// connection and answers nothing): clients waiting on the shard are
/// answered [`Refusal::Unavailable`] and requests that write are refused,
/// as when the store reports a stop, until the commit is answered; the
/// host's health says so ([`keel_storage::WriteFault::Stalled`]). A healthy
/// group commit takes milliseconds; a flush or compaction that holds
/// writes back takes seconds at most.
pub const COMMIT_STALL_MS_DEFAULT: u64 = 10_000;

/// Answered commits a shard's stall check may still list behind an old
/// unanswered one before it sweeps them out (see `Shard::commit_asked`).
const COMMITS_ASKED_SLACK: usize = 64;

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            shards: 1,
            run_cache_max: RUN_CACHE_MAX_DEFAULT,
            lease_ms_default: LEASE_MS_DEFAULT,
            worker_concurrency_max: WORKER_CONCURRENCY_MAX,
            timers_in_memory_max: TIMERS_IN_MEMORY_MAX,
            intents_in_memory_max: INTENTS_IN_MEMORY_MAX,
            profiles: BTreeMap::new(),
            shard_lease_ms: SHARD_LEASE_MS_DEFAULT,
            commit_stall_ms: COMMIT_STALL_MS_DEFAULT,
            breaks: None,
        }
    }
}

/// What a pending read is for.
#[derive(Debug)]
enum ReadFor {
    Activate(RunId),
    Instance(Box<requests::StartJob>),
    Resolve {
        op: RunOp,
        reply: ReplyTo,
        /// The instance or run id the request named, for its refusal.
        target: String,
    },
    Result(RunId, Token),
    Continuation(Token),
    Describe(RunId, Option<MachineView>, ReplyTo),
    /// A window of a shard's task or outbox rows.
    Backlog(BacklogOf),
    /// A run's intent rows, read back after a commit of it whose outcome
    /// is unknown, or after it was resumed (`true`): then the results
    /// and cancellations other runs addressed to it are delivered again
    /// too (their senders dropped them when it was parked).
    RunIntents(RunId, bool),
    /// A child's start row (its key) its cancellation waits for (see
    /// `Shard::outbox_answered`).
    StartRow(Vec<u8>),
    TimerWindow,
    List(ReplyTo),
    QueryClosed {
        run: RunId,
        name: String,
        args: Payload,
        reply: ReplyTo,
    },
    ClosedInput {
        run: RunId,
        input: Input,
        origin: Origin,
    },
    /// A closed parent's history, replayed to bind the closures of the
    /// async children it left running (see `Shard::bind_replay`).
    BindReplay(RunId),
}

impl ReadFor {
    /// Whether the read brings intent rows in, so a removal racing it must
    /// be remembered until it is answered.
    fn reads_intents(&self) -> bool {
        matches!(
            self,
            ReadFor::Backlog(_)
                | ReadFor::RunIntents(..)
                | ReadFor::StartRow(_)
                | ReadFor::TimerWindow
        )
    }
}

/// What a pending commit is for.
#[derive(Debug)]
enum CommitFor {
    /// A run's events.
    Run(RunId),
    /// A run's park marker set or cleared.
    Marker(RunId),
}

/// Who waits for the answer to an operation on a run of this shard.
#[derive(Clone, Debug, PartialEq)]
enum Origin {
    Reply(ReplyTo),
    Attempt(AttemptKey, AttemptNo),
    Timer(RunId, Step),
    Outbox(Vec<u8>),
    Start(Box<requests::StartJob>),
}

/// One shard's driver. See the module docs for how a host drives it.
pub struct Shard {
    id: ShardId,
    config: DriverConfig,
    workflows: WorkflowRegistry,
    now: Timestamp,
    next_token: u64,
    next_epoch: u64,
    /// The epoch base this shard started from: a copy under a lower epoch
    /// was dispatched by an earlier owner of the shard.
    epoch_base: u64,
    actions: VecDeque<Action>,
    due: DueQueue,
    runs: BTreeMap<RunId, RunSlot>,
    /// Instances whose current run is open in memory here (started here,
    /// or replayed open), by instance id: a client's request naming one
    /// is resolved without a read. One entry per such run, dropped when
    /// it closes or is forgotten.
    open_instances: BTreeMap<String, RunId>,
    lru: BTreeMap<u64, RunId>,
    /// Where the next passivation walk starts in `lru` (see
    /// `Shard::passivate`).
    passivate_from: u64,
    tick: u64,
    reads: BTreeMap<Token, ReadFor>,
    /// Reads of intent rows in flight (recovery, or one run's rows).
    intent_reads: u32,
    /// Intent rows commits removed while an intent read was in flight:
    /// that read may have seen them before the removal, and must not
    /// bring back work already done. Cleared when no such read is left.
    removed_while_reading: BTreeSet<keel_storage::IntentKey>,
    commits: BTreeMap<Token, CommitFor>,
    /// Who waits for a run's outcome, by the token of their registration.
    results: BTreeMap<RunId, BTreeMap<Token, ReplyTo>>,
    /// Clients' starts that wait for their run's outcome
    /// ([`Request::Start`]'s `await_outcome`): the start's answer turns
    /// into a wait for the run it names.
    outcome_starts: BTreeSet<RequestId>,
    /// Who waits for an accepted update's completion, per run.
    updates: BTreeMap<RunId, Vec<(CommandId, ReplyTo)>>,
    /// Clients told of a continue-as-new only once the next run exists:
    /// (closed run, next run, the client, checks so far), by token.
    /// Also starts that found the instance between the two: they are
    /// told `Existing(next)` then (the last field).
    continuing: BTreeMap<Token, (RunId, RunId, ReplyTo, u32, bool)>,
    /// The window of durable timers held in memory.
    timers: Timers,
    attempts: Attempts,
    outbox: Outbox,
    /// The task rows not read yet (see `backlog.rs`).
    task_backlog: Backlog,
    /// The outbox rows not read yet.
    outbox_backlog: Backlog,
    shut_down: bool,
    /// Whether the store accepts writes, as last learned: as its host
    /// reported it (`store_reported`), or stalled (`stalled_since`).
    store_health: keel_storage::StoreHealth,
    /// The store's health as the host last reported it.
    store_reported: keel_storage::StoreHealth,
    /// Commits asked for, oldest first, with when; answered ones leave
    /// from the front (see [`Shard::check_stall`]).
    commits_asked: VecDeque<(Token, Timestamp)>,
    /// When the oldest commit still unanswered was asked for, while it is
    /// older than [`DriverConfig::commit_stall_ms`].
    stalled_since: Option<Timestamp>,
    /// A [`Due::CommitStall`] is queued (one at a time).
    stall_check_armed: bool,
    /// The shard's lease on a shared store (see [`Shard::hold`]).
    lease: Option<keel_storage::ShardLease>,
    /// A renewal is in flight.
    renewing: bool,
    /// When the lease is next checked (renewed, or found ended): the one
    /// [`Due::ShardLease`] that counts; earlier ones are stale.
    lease_check_at: Option<Timestamp>,
    /// The lease was lost: the shard does nothing more.
    lost: bool,
    /// Per run, the async children whose closures its code bound ahead of
    /// a commit whose outcome is unknown: settled at the run's next
    /// replay or close (`Shard::settle_unsure_async`), which such a commit
    /// asks for at once (`RunSlot::recheck`). One entry per such run; a
    /// run parked by that replay keeps its entry until it is resumed or
    /// terminated.
    unsure_async: BTreeMap<RunId, Vec<RunId>>,
    /// What this shard counted (see [`Shard::stats`]).
    stats: ShardStats,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("id", &self.id)
            .field("runs", &self.runs.len())
            .field("attempts", &self.attempts.len())
            .field("timers", &self.timers.len())
            .field("outbox", &self.outbox.len())
            .finish()
    }
}

impl Shard {
    /// A shard with nothing in memory. `epoch_base` must be larger than any
    /// lease epoch an earlier process of this engine handed out: epochs
    /// only grow. A host alone on its store derives it from its clock;
    /// hosts sharing a store derive it from the shard lease's epoch, which
    /// the store raises at every takeover, so a later owner's attempt
    /// epochs are above every earlier owner's.
    pub fn new(
        id: ShardId,
        workflows: WorkflowRegistry,
        config: DriverConfig,
        epoch_base: u64,
    ) -> Shard {
        let timers = Timers::new(config.timers_in_memory_max.max(1));
        let intents_window = config.intents_in_memory_max.max(1);
        Shard {
            id,
            config,
            workflows,
            now: Timestamp(0),
            // Tokens start where epochs do: an answer meant for an earlier
            // instance of this shard (one that lost its lease in this
            // process, which took the shard again) matches nothing here.
            next_token: epoch_base,
            next_epoch: epoch_base,
            epoch_base,
            actions: VecDeque::new(),
            due: DueQueue::default(),
            runs: BTreeMap::new(),
            open_instances: BTreeMap::new(),
            lru: BTreeMap::new(),
            passivate_from: 0,
            tick: 0,
            reads: BTreeMap::new(),
            intent_reads: 0,
            removed_while_reading: BTreeSet::new(),
            commits: BTreeMap::new(),
            results: BTreeMap::new(),
            outcome_starts: BTreeSet::new(),
            updates: BTreeMap::new(),
            continuing: BTreeMap::new(),
            timers,
            attempts: Attempts::default(),
            outbox: Outbox::default(),
            task_backlog: Backlog::new(intents_window),
            outbox_backlog: Backlog::new(intents_window),
            shut_down: false,
            store_health: keel_storage::StoreHealth::Healthy,
            store_reported: keel_storage::StoreHealth::Healthy,
            commits_asked: VecDeque::new(),
            stalled_since: None,
            stall_check_armed: false,
            lease: None,
            renewing: false,
            lease_check_at: None,
            lost: false,
            unsure_async: BTreeMap::new(),
            stats: ShardStats::default(),
        }
    }

    /// This shard.
    pub fn id(&self) -> ShardId {
        self.id
    }

    /// The workflows it runs.
    pub fn workflows(&self) -> &WorkflowRegistry {
        &self.workflows
    }

    /// How it was configured.
    pub fn config(&self) -> &DriverConfig {
        &self.config
    }

    /// The least `epoch_base` a later instance of this shard in this
    /// process may start from ([`Shard::new`]): above every lease epoch
    /// and every token this one handed out, so that neither a copy it
    /// dispatched nor an answer meant for it is taken for the later one's.
    pub fn next_epoch_base(&self) -> u64 {
        self.next_epoch.max(self.next_token).saturating_add(1)
    }

    /// Starts recovery: reads the first window of the intent rows this
    /// shard owns (pending attempts, outbox messages, timers) and drives
    /// each exactly as if a commit had just written it; the next windows
    /// follow as those are done (see `backlog.rs` and `timers.rs`). Call
    /// once, after [`Shard::new`].
    pub fn recover(&mut self, now: Timestamp) {
        self.now = self.now.max(now);
        self.task_backlog.start_recovery();
        self.outbox_backlog.start_recovery();
        self.read_backlogs();
        let after = self.timers.start_recovery();
        self.read_timer_window(after);
    }

    /// Reads the next window of task rows, and of outbox rows, when one
    /// is due and memory has room for it.
    fn read_backlogs(&mut self) {
        self.read_backlog(BacklogOf::Tasks);
        self.read_backlog(BacklogOf::Outbox);
    }

    fn read_backlog(&mut self, of: BacklogOf) {
        let now = self.now;
        let (backlog, held) = match of {
            BacklogOf::Tasks => (&mut self.task_backlog, self.attempts.windowed()),
            BacklogOf::Outbox => (&mut self.outbox_backlog, self.outbox.windowed()),
        };
        let Some(after) = backlog.start_window(now, held) else {
            return;
        };
        let query = ReadQuery::Backlog {
            shard: self.id,
            shards: self.config.shards,
            of,
            after,
            limit: backlog.window_rows(),
            // Outbox rows are due at once: only attempts are read past.
            due_before: now.plus_ms(BACKLOG_LEAD_MS),
        };
        self.read(query, ReadFor::Backlog(of));
    }

    fn backlog_read(&mut self, of: BacklogOf, result: Result<ReadResult, StoreError>) {
        let retry_at = self.now.plus_ms(RUN_UNREACHABLE_RETRY_MS);
        let shard = self.id;
        let backlog = match of {
            BacklogOf::Tasks => &mut self.task_backlog,
            BacklogOf::Outbox => &mut self.outbox_backlog,
        };
        match result {
            Ok(ReadResult::Backlog {
                rows,
                last,
                skipped_due,
            }) => {
                let pass_at = skipped_due.map(|d| Timestamp(d.0.saturating_sub(BACKLOG_LEAD_MS)));
                backlog.window_read(last, pass_at);
                tracing::debug!(%shard, ?of, rows = rows.len(), "read a window of durable work");
                self.intents_read_back(rows, true);
            }
            Ok(other) => {
                tracing::error!(?other, "a backlog read answered the wrong query");
                backlog.window_failed(retry_at);
            }
            Err(e) => {
                // Without its rows the shard would forget work: try again.
                tracing::warn!(%shard, ?of, error = %e, "reading durable work failed; retrying");
                backlog.window_failed(retry_at);
            }
        }
    }

    fn read_timer_window(&mut self, after: Option<timers::TimerKey>) {
        let query = ReadQuery::Timers {
            shard: self.id,
            shards: self.config.shards,
            after,
            limit: self.timers.window_rows(),
        };
        self.read(query, ReadFor::TimerWindow);
    }

    fn timer_window_read(&mut self, result: Result<ReadResult, StoreError>) {
        match result {
            Ok(ReadResult::Timers(rows)) => {
                // The horizon is the last row read, even one removed since.
                let full = rows.len() >= self.timers.window_rows();
                let last = match rows.last() {
                    Some(t) if full => Some((t.fire_at, t.run_id, t.step)),
                    _ => None,
                };
                let rows = rows
                    .into_iter()
                    .filter(|t| {
                        let key = keel_storage::IntentKey::Timer(t.run_id, t.step);
                        !self.removed_while_reading.contains(&key)
                    })
                    .collect();
                self.timers.window_read(rows, last);
            }
            Ok(other) => {
                tracing::error!(?other, "a timer window read answered the wrong query");
                self.timers
                    .window_failed(self.now.plus_ms(RUN_UNREACHABLE_RETRY_MS));
            }
            Err(e) => {
                tracing::warn!(shard = %self.id, error = %e, "timer window read failed; retrying");
                self.timers
                    .window_failed(self.now.plus_ms(RUN_UNREACHABLE_RETRY_MS));
            }
        }
    }

    /// Feeds one input at time `now`.
    pub fn handle(&mut self, now: Timestamp, input: ShardInput) {
        self.now = self.now.max(now);
        if self.lost {
            return;
        }
        if let Some(reason) = self.lease_over() {
            // Whoever sent the input learns to ask the next owner.
            self.turn_away(input);
            self.lose(reason);
            return;
        }
        match input {
            ShardInput::Request { id, request } => self.request(id, request),
            ShardInput::Message(m) => self.message(m),
            ShardInput::Read { token, result } => self.read_done(token, result),
            ShardInput::Committed { token, result } => self.commit_done(token, result),
            ShardInput::AttemptFinished {
                key,
                attempt,
                epoch,
                result,
            } => self.attempt_finished(key, attempt, epoch, result),
            ShardInput::Heartbeat {
                key,
                epoch,
                details,
            } => self.heartbeat(key, epoch, details),
            ShardInput::AttemptRefused { key, epoch, policy } => {
                self.attempt_refused(key, epoch, policy)
            }
            ShardInput::CopyLost { key, epoch } => self.copy_lost(key, epoch),
            ShardInput::FallbackDone {
                key,
                attempt,
                result,
            } => self.fallback_done(key, attempt, result),
            ShardInput::StoreHealth(health) => self.store_health_changed(health),
            ShardInput::LeaseRenewed { result } => self.lease_renewed(result),
            ShardInput::PeerTaken(shard) => self.peer_taken(shard),
        }
        self.passivate();
        if self.due.wants_sweep() {
            self.sweep_due();
        }
    }

    /// Whether the store accepts writes, as its host last reported it (a
    /// host compares it with what it observes and reports a change).
    pub fn reported_store_health(&self) -> &keel_storage::StoreHealth {
        &self.store_reported
    }

    /// The store's health as this shard acts on it: as its host reported
    /// it, or stalled ([`Shard::stalled_since`]).
    pub fn acting_store_health(&self) -> &keel_storage::StoreHealth {
        &self.store_health
    }

    /// Since when a commit of this shard has gone unanswered, if longer
    /// than [`DriverConfig::commit_stall_ms`]: the shard treats the store
    /// as stopped ([`keel_storage::WriteFault::Stalled`]) meanwhile.
    pub fn stalled_since(&self) -> Option<Timestamp> {
        self.stalled_since
    }

    /// The store's health as this shard acts on it: as reported, or
    /// stalled while a commit has gone unanswered too long.
    fn health_now(&self) -> keel_storage::StoreHealth {
        match self.stalled_since {
            Some(_) if self.store_reported.is_healthy() => keel_storage::StoreHealth::Stopped {
                fault: keel_storage::WriteFault::Stalled,
                detail: format!(
                    "{} has a commit unanswered for over {} ms",
                    self.id, self.config.commit_stall_ms
                ),
            },
            _ => self.store_reported.clone(),
        }
    }

    /// A commit was asked for (`token`): noted with its time, the answered
    /// ones ahead of it dropped (so the queue holds about what is in
    /// flight), and a stall check armed if none is.
    pub(super) fn commit_asked(&mut self, token: Token) {
        self.drop_answered_asks();
        if self.commits_asked.len() > 2 * self.commits.len() + COMMITS_ASKED_SLACK {
            // One old commit unanswered (or answers out of order): the
            // answered ones behind it go too.
            let commits = &self.commits;
            self.commits_asked.retain(|(t, _)| commits.contains_key(t));
        }
        self.commits_asked.push_back((token, self.now));
        if self.stalled_since.is_none() {
            let at = self.commits_asked.front().map_or(self.now, |(_, at)| *at);
            self.arm_stall_check(at);
        }
    }

    fn drop_answered_asks(&mut self) {
        while let Some((token, _)) = self.commits_asked.front() {
            if self.commits.contains_key(token) {
                break;
            }
            self.commits_asked.pop_front();
        }
    }

    /// Queues the stall check for a commit asked for at `asked`, unless one
    /// is queued already (it re-arms itself for the next oldest).
    fn arm_stall_check(&mut self, asked: Timestamp) {
        if !self.stall_check_armed {
            self.stall_check_armed = true;
            self.due
                .push(asked.plus_ms(self.config.commit_stall_ms), Due::CommitStall);
        }
    }

    /// The queued stall check is due.
    fn stall_check_due(&mut self) {
        self.stall_check_armed = false;
        self.check_stall();
    }

    /// Whether the oldest commit still unanswered is older than
    /// [`DriverConfig::commit_stall_ms`]: the shard then acts as if the
    /// store had stopped, until it is answered. Checked when that commit
    /// would turn stalled, and at every answer while stalled: while not
    /// stalled, one check is due whenever a commit is in flight; while
    /// stalled, none is, and the answers drive it.
    fn check_stall(&mut self) {
        self.drop_answered_asks();
        let stall_ms = self.config.commit_stall_ms;
        let oldest = self.commits_asked.front().map(|(_, at)| *at);
        let stalled = oldest.filter(|at| self.now.0.saturating_sub(at.0) >= stall_ms);
        if let (Some(at), None) = (oldest, stalled) {
            self.arm_stall_check(at);
        }
        if stalled.is_some() == self.stalled_since.is_some() {
            // Still stalled, maybe on a later commit now.
            self.stalled_since = stalled;
            return;
        }
        match stalled {
            Some(at) => {
                tracing::warn!(shard = %self.id, unanswered_ms = self.now.0.saturating_sub(at.0),
                "a commit has gone unanswered too long; the store is taken for stalled")
            }
            None => tracing::info!(shard = %self.id, "the stalled commit was answered"),
        }
        self.stalled_since = stalled;
        self.apply_health();
    }

    /// The store stopped or resumed accepting writes. While it is stopped,
    /// requests that need a commit and clients waiting for an outcome are
    /// answered [`Refusal::Unavailable`] at once instead of waiting for
    /// progress that cannot happen; the durable work itself (timers,
    /// attempts, the outbox) keeps retrying and goes on when the store
    /// resumes. A store that gave up for good shuts the shard down.
    fn store_health_changed(&mut self, health: keel_storage::StoreHealth) {
        self.store_reported = health;
        self.apply_health();
    }

    /// Acts on the store's health as this shard now sees it
    /// ([`Shard::health_now`], see [`Shard::store_health_changed`]).
    fn apply_health(&mut self) {
        let health = self.health_now();
        if health == self.store_health {
            return;
        }
        let was_healthy = self.store_health.is_healthy();
        self.store_health = health;
        if self.store_health.is_healthy() {
            tracing::info!(shard = %self.id, "the store accepts writes again");
            return;
        }
        let refusal = Refusal::Unavailable(self.store_health.to_string());
        if self.store_health.is_failed() {
            tracing::error!(shard = %self.id, health = %self.store_health, "the store failed for good; the shard stops");
            self.stop_answering(Answer::Refused(refusal), false);
            return;
        }
        if was_healthy {
            tracing::info!(shard = %self.id, health = %self.store_health,
                "the store stopped accepting writes; waiting clients are answered");
            // A parent's wait for its child's outcome stays: it is durable
            // work, answered when it can be.
            let mut clients = Vec::new();
            for waiters in self.results.values_mut() {
                waiters.retain(|_, reply| match reply {
                    ReplyTo::Client(id) => {
                        clients.push(*id);
                        false
                    }
                    _ => true,
                });
            }
            self.results.retain(|_, waiters| !waiters.is_empty());
            for (_, reply) in std::mem::take(&mut self.updates).into_values().flatten() {
                if let ReplyTo::Client(id) = reply {
                    clients.push(id);
                }
            }
            for id in clients {
                self.actions.push_back(Action::Reply {
                    id,
                    answer: Answer::Refused(refusal.clone()),
                    cause: None,
                });
            }
        }
    }

    /// When the shard next needs [`Shard::handle_timeout`], if ever.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        if self.lost {
            return None;
        }
        [
            self.due.next(),
            self.timers.next_due(),
            self.timers.window_at(TIMER_WINDOW_LEAD_MS),
            self.task_backlog.window_at(self.attempts.windowed()),
            self.outbox_backlog.window_at(self.outbox.windowed()),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs everything due at `now`.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.now = self.now.max(now);
        if self.lost {
            return;
        }
        if let Some(reason) = self.lease_over() {
            self.lose(reason);
            return;
        }
        loop {
            if self.lost {
                return;
            }
            // Timers and the rest in time order (timers first at a tie).
            let timer_first = match (self.timers.next_due(), self.due.next()) {
                (Some(t), Some(d)) => t <= d,
                (Some(_), None) => true,
                (None, _) => false,
            };
            if timer_first {
                if let Some((run, step)) = self.timers.pop_due(self.now) {
                    self.fire_timer(run, step);
                    continue;
                }
            }
            let Some(due) = self.due.pop(self.now) else {
                break;
            };
            match due {
                Due::Timer(run, step) => self.fire_timer(run, step),
                Due::Task(key, attempt) => self.task_due(key, attempt),
                Due::Lease(key, epoch) => self.lease_check(key, epoch),
                Due::StartDeadline(key, attempt) => self.start_deadline(key, attempt),
                Due::Report(key, attempt) => self.report_again(key, attempt),
                Due::Outbox(key) => self.deliver_outbox(&key),
                Due::OutboxAnswer(key, token) => self.outbox_unanswered(&key, token),
                Due::Activate(run) => self.retry_activation(run),
                Due::Intents(run, resumed) => {
                    self.read(ReadQuery::IntentsOf(run), ReadFor::RunIntents(run, resumed));
                }
                Due::Continuation(token) => self.continuation_check(token),
                Due::Start(job) => self.start_again(*job),
                Due::ShardLease => self.lease_due(),
                Due::CommitStall => self.stall_check_due(),
            }
        }
        if !self.lost {
            if let Some(after) = self.timers.start_window(self.now, TIMER_WINDOW_LEAD_MS) {
                self.read_timer_window(after);
            }
            self.read_backlogs();
        }
        self.passivate();
    }

    /// The next action to perform, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        let mut action = self.actions.pop_front()?;
        if let Action::Commit { alone, .. } = &mut action {
            // The commit itself is among `commits` already, and stays there
            // until its answer is fed, even one written on the host's
            // thread (the actix host feeds it from a later message, never
            // within the turn that asked for it), so the commits made
            // meanwhile are not alone and share the writer's next group.
            *alone = self.actions.is_empty()
                && self.commits.len() <= 1
                && self.reads.is_empty()
                && self.attempts.running == 0;
        }
        Some(action)
    }

    /// Stops: every client still waiting is answered that the engine shuts
    /// down; nothing more is started.
    pub fn shutdown(&mut self) {
        self.stop_answering(Answer::Refused(Refusal::Shutdown), false);
    }

    /// Stops, answering every waiting client with `answer`, and every
    /// waiting shard too when `shards` (a shard that moves to another
    /// process: its peers go on; at shutdown they stop as well).
    fn stop_answering(&mut self, answer: Answer, shards: bool) {
        self.shut_down = true;
        let mut waiting = Vec::new();
        for slot in self.runs.values_mut() {
            waiting.extend(slot.take_waiting(shards));
        }
        for waiters in std::mem::take(&mut self.results).into_values() {
            waiting.extend(waiters.into_values());
        }
        for (_, reply) in std::mem::take(&mut self.updates).into_values().flatten() {
            waiting.push(reply);
        }
        for (_, _, reply, _, _) in std::mem::take(&mut self.continuing).into_values() {
            waiting.push(reply);
        }
        // Starts waiting to be decided again: their senders wait too, and
        // they are not decided any more.
        for due in self.due.take_where(|due| matches!(due, Due::Start(_))) {
            if let Due::Start(job) = due {
                waiting.push(job.reply_to());
            }
        }
        // No read is answered from here on (see `read_done`).
        self.intent_reads = 0;
        self.removed_while_reading.clear();
        for read in std::mem::take(&mut self.reads).into_values() {
            match read {
                ReadFor::Resolve { reply, .. }
                | ReadFor::Describe(_, _, reply)
                | ReadFor::QueryClosed { reply, .. }
                | ReadFor::List(reply)
                | ReadFor::ClosedInput {
                    origin: Origin::Reply(reply),
                    ..
                } => waiting.push(reply),
                ReadFor::Instance(job) => waiting.push(job.reply_to()),
                _ => {}
            }
        }
        waiting.retain(|r| match r {
            ReplyTo::Nobody => false,
            ReplyTo::Client(_) => true,
            ReplyTo::Shard(..) => shards,
        });
        waiting.sort();
        waiting.dedup();
        for reply in waiting {
            self.reply(reply, answer.clone(), None);
        }
    }

    /// Runs in memory (activated, loading or with work in flight).
    pub fn runs_in_memory(&self) -> usize {
        self.runs.len()
    }

    /// Attempts supervised now.
    pub fn attempts_supervised(&self) -> usize {
        self.attempts.len()
    }

    fn token(&mut self) -> Token {
        self.next_token += 1;
        Token(self.next_token)
    }

    fn breaks(&self, mode: BreakMode) -> bool {
        self.config.breaks == Some(mode)
    }

    fn message(&mut self, m: Message) {
        match m {
            Message::ToRun { run, op, reply } => self.run_op(run, op, Origin::Reply(reply)),
            Message::Start { spec, then, reply } => self.start_internal(*spec, then, reply),
            Message::Answer { token, answer } => self.peer_answer(token, answer),
        }
    }

    /// Sends an answer to whoever waits for it.
    fn answer(&mut self, origin: Origin, answer: Answer, cause: Cause) {
        match origin {
            Origin::Reply(reply) => self.reply(reply, answer, cause),
            Origin::Attempt(key, attempt) => self.report_answered(key, attempt, answer),
            Origin::Timer(run, step) => self.fire_answered(run, step, answer),
            Origin::Outbox(key) => self.notify_answered(&key, answer),
            Origin::Start(job) => self.start_answered(*job, answer, cause),
        }
    }

    fn reply(&mut self, reply: ReplyTo, answer: Answer, cause: Cause) {
        match reply {
            ReplyTo::Nobody => {}
            ReplyTo::Client(id) if self.outcome_starts.remove(&id) => match answer {
                Answer::Started(run) | Answer::Existing(run) => {
                    let wait = RunOp::Result;
                    if shard_of(run, self.config.shards) == self.id {
                        self.run_op(run, wait, Origin::Reply(reply));
                    } else {
                        self.send(run, wait, reply, cause);
                    }
                }
                // Refused, or to be asked again: the client hears it.
                answer => self.actions.push_back(Action::Reply { id, answer, cause }),
            },
            ReplyTo::Client(id) => self.actions.push_back(Action::Reply { id, answer, cause }),
            ReplyTo::Shard(to, token) => self.actions.push_back(Action::Send {
                to,
                message: Message::Answer { token, answer },
                cause,
            }),
        }
    }

    fn send(&mut self, to_run: RunId, op: RunOp, reply: ReplyTo, cause: Cause) {
        let to = shard_of(to_run, self.config.shards);
        self.actions.push_back(Action::Send {
            to,
            message: Message::ToRun {
                run: to_run,
                op,
                reply,
            },
            cause,
        });
    }

    fn read(&mut self, query: ReadQuery, purpose: ReadFor) -> Token {
        let token = self.token();
        if purpose.reads_intents() {
            self.intent_reads += 1;
        }
        self.reads.insert(token, purpose);
        self.actions.push_back(Action::Read { token, query });
        token
    }

    fn read_done(&mut self, token: Token, result: Result<ReadResult, StoreError>) {
        let Some(purpose) = self.reads.remove(&token) else {
            return;
        };
        let intents = purpose.reads_intents();
        if intents {
            self.intent_reads -= 1;
        }
        self.read_answered(token, purpose, result);
        if intents && self.intent_reads == 0 {
            self.removed_while_reading.clear();
        }
    }

    fn read_answered(
        &mut self,
        token: Token,
        purpose: ReadFor,
        result: Result<ReadResult, StoreError>,
    ) {
        match purpose {
            ReadFor::Activate(run) => self.history_read(run, token, result),
            ReadFor::Instance(job) => self.instance_read(*job, result),
            ReadFor::Resolve { op, reply, target } => self.resolved(op, reply, &target, result),
            ReadFor::Result(run, waiter) => self.result_read(run, waiter, result),
            ReadFor::Continuation(token) => self.continuation_read(token, result),
            ReadFor::Describe(run, view, reply) => self.describe_read(run, view, reply, result),
            ReadFor::Backlog(of) => self.backlog_read(of, result),
            ReadFor::TimerWindow => self.timer_window_read(result),
            ReadFor::RunIntents(run, resumed) => self.run_intents_read(run, resumed, result),
            // Unreadable now: the cancellation waiting for it asks again.
            ReadFor::StartRow(_) => {
                if let Ok(ReadResult::Intents(mut rows)) = result {
                    // Its own cancellation asked for it, so it is this
                    // shard's; checked all the same (see
                    // `Shard::run_intents_read`).
                    rows.retain(|row| match row {
                        keel_storage::Intent::Outbox(msg) => self.owns_row(msg),
                        _ => true,
                    });
                    self.intents_read_back(rows, false);
                }
            }
            ReadFor::ClosedInput { run, input, origin } => {
                self.closed_input_read(run, input, origin, result)
            }
            ReadFor::List(reply) => self.reply(reply, list_answer(result), None),
            ReadFor::QueryClosed {
                run,
                name,
                args,
                reply,
            } => self.query_closed_read(run, name, args, reply, result),
            ReadFor::BindReplay(run) => self.bind_replay_read(run, result),
        }
    }

    fn commit_done(&mut self, token: Token, result: Result<CommitAck, StoreError>) {
        self.stats.commits += 1;
        if result.is_err() {
            self.stats.commits_failed += 1;
        }
        if let Err(e @ StoreError::Fenced { .. }) = &result {
            // Another process owns the shard: nothing here is current.
            let reason = e.to_string();
            self.lose(reason);
            return;
        }
        match self.commits.remove(&token) {
            Some(CommitFor::Run(run)) => self.run_committed(run, token, result),
            Some(CommitFor::Marker(run)) => self.marker_committed(run, token, result),
            None => {}
        }
        if self.stalled_since.is_some() {
            self.check_stall();
        }
    }

    /// Every intent row of `rows` drives its effect: written by a commit
    /// just answered (`cause` names it) or read back at recovery.
    fn intents(&mut self, rows: Vec<keel_storage::Intent>, cause: Cause) {
        for row in rows {
            self.intent(row, cause, false);
        }
    }

    /// Intent rows a read brought back. The read ran at some moment after
    /// it was asked for, while commits went on: a row a commit removed
    /// meanwhile is done (a child started, an attempt completed) and is
    /// skipped; one still in memory is merged with what memory knows.
    /// `windowed`: a window of the shard's backlog brought them (they
    /// count against its room until done).
    fn intents_read_back(&mut self, rows: Vec<keel_storage::Intent>, windowed: bool) {
        let mut stale = 0;
        for row in rows {
            let key = row.key();
            // An outbox row memory drives is as new as any read of it (a
            // live commit that rewrites it, a cancellation turned into a
            // termination, replaces it when answered), and memory knows
            // how far its delivery got.
            let driven = match &key {
                keel_storage::IntentKey::Outbox(k) => self.outbox.holds(k),
                _ => false,
            };
            if driven || self.removed_while_reading.contains(&key) {
                stale += 1;
            } else {
                self.intent(row, None, windowed);
            }
        }
        if stale > 0 {
            tracing::debug!(shard = %self.id, stale, "intent rows read back were removed or are driven already; skipped");
        }
    }

    fn intent(&mut self, row: keel_storage::Intent, cause: Cause, windowed: bool) {
        match row {
            keel_storage::Intent::Task(task) => self.task_intent(task, cause, windowed),
            keel_storage::Intent::Timer(t) => self.timers.arm(t.run_id, t.step, t.fire_at),
            keel_storage::Intent::Outbox(msg) => self.outbox_intent(msg, cause, windowed),
        }
    }

    fn removed(&mut self, keys: Vec<keel_storage::IntentKey>) {
        for key in keys {
            if self.intent_reads > 0 {
                self.removed_while_reading.insert(key.clone());
            }
            match key {
                keel_storage::IntentKey::Task(run, step) => {
                    self.task_removed(AttemptKey { run, step })
                }
                keel_storage::IntentKey::Timer(run, step) => self.timers.remove(run, step),
                keel_storage::IntentKey::Outbox(key) => self.outbox_removed(&key),
            }
        }
    }

    // ---- timers -------------------------------------------------------

    fn fire_timer(&mut self, run: RunId, step: Step) {
        let Some(fire_at) = self.timers.fire_at(run, step) else {
            return; // cancelled, fired, or its run closed
        };
        // A run's deadline is a timer at a reserved step: it closes the run.
        let input = match keel_storage::WorkflowTimeout::of_timer_step(step) {
            Some(timeout) => Input::TimedOut {
                timeout,
                deadline: fire_at,
            },
            None => Input::TimerFired { step },
        };
        self.run_op(run, RunOp::Input(input), Origin::Timer(run, step));
    }

    fn fire_answered(&mut self, run: RunId, step: Step, answer: Answer) {
        match answer {
            Answer::Retry(_) => {
                let at = self.now.plus_ms(DELIVERY_BACKOFF_MS_MIN * 2);
                self.due.push(at, Due::Timer(run, step));
            }
            // Committed, a duplicate, its run closed or parked (a resume
            // re-arms it from its row).
            _ => {
                if let (Answer::Committed, Some(fire_at)) =
                    (&answer, self.timers.fire_at(run, step))
                {
                    let lag_ms = self.now.0.saturating_sub(fire_at.0);
                    self.stats.timer_lag_seconds.observe(lag_ms as f64 / 1000.0);
                }
                self.timers.remove(run, step);
            }
        }
    }

    /// Backoff before try `tries + 1` of a delivery.
    fn backoff(tries: u32) -> u64 {
        DELIVERY_BACKOFF_MS_MIN
            .saturating_mul(1u64 << tries.min(16))
            .min(DELIVERY_BACKOFF_MS_MAX)
    }
}

#[cfg(test)]
mod stall_tests {
    // Goal: a commit left unanswered past `commit_stall_ms` makes the shard
    // act as if the store had stopped (a client waiting for a run's
    // outcome is answered "unavailable") and say so (`stalled_since`), until
    // that commit is answered; a commit answered in time never does, and
    // what the host reported of the store stays as it was (the host
    // compares it with the store's own health). Method: a shard with a
    // 1,000 ms limit asks for a commit at 0 and another at 600; time
    // passes by hand; the first is answered at 1,200 (the second, 600 ms
    // old, is in time), then the second at 1,700, after it stalled too.
    use super::*;

    fn commit(shard: &mut Shard) -> Token {
        let token = shard.token();
        let run = RunId::from_u64_pair(1, 1);
        shard.commits.insert(token, CommitFor::Run(run));
        shard.push_commit(token, keel_storage::CommitBatch::default());
        token
    }

    fn answer(shard: &mut Shard, at: u64, token: Token) {
        let result = Err(StoreError::CommitFailed("answered".into()));
        shard.handle(Timestamp(at), ShardInput::Committed { token, result });
    }

    fn stalled(shard: &Shard) -> bool {
        matches!(
            shard.store_health,
            keel_storage::StoreHealth::Stopped {
                fault: keel_storage::WriteFault::Stalled,
                ..
            }
        )
    }

    #[test]
    fn a_commit_unanswered_too_long_stops_the_shard_until_it_is_answered() {
        let config = DriverConfig {
            commit_stall_ms: 1_000,
            ..DriverConfig::default()
        };
        let mut shard = Shard::new(ShardId(0), WorkflowRegistry::new(), config, 0);
        shard.handle_timeout(Timestamp(0));
        let client = RequestId(7);
        let waiting_run = RunId::from_u64_pair(2, 2);
        shard
            .results
            .entry(waiting_run)
            .or_default()
            .insert(Token(u64::MAX), ReplyTo::Client(client));
        let first = commit(&mut shard);
        shard.handle_timeout(Timestamp(600));
        let second = commit(&mut shard);
        shard.handle_timeout(Timestamp(999));
        assert_eq!(shard.stalled_since(), None, "in time");
        assert!(shard.store_health.is_healthy());

        shard.handle_timeout(Timestamp(1_000));
        assert_eq!(shard.stalled_since(), Some(Timestamp(0)));
        assert!(stalled(&shard), "{:?}", shard.store_health);
        assert!(
            shard.reported_store_health().is_healthy(),
            "what the host reported is kept"
        );
        let told: Vec<Action> = std::iter::from_fn(|| shard.poll_action()).collect();
        assert!(
            told.iter().any(|a| matches!(a,
                Action::Reply { id, answer: Answer::Refused(Refusal::Unavailable(_)), .. }
                    if *id == client)),
            "the waiting client is told: {told:?}"
        );

        answer(&mut shard, 1_200, first);
        assert_eq!(shard.stalled_since(), None, "the next is 600 ms old");
        assert!(shard.store_health.is_healthy());
        // The second goes past its limit unanswered, and is answered late.
        shard.handle_timeout(Timestamp(1_599));
        assert_eq!(shard.stalled_since(), None);
        shard.handle_timeout(Timestamp(1_600));
        assert_eq!(shard.stalled_since(), Some(Timestamp(600)));
        answer(&mut shard, 1_700, second);
        assert_eq!(shard.stalled_since(), None);
        assert!(shard.store_health.is_healthy());
        // Nothing in flight: the next check empties the list.
        shard.check_stall();
        assert!(shard.commits_asked.is_empty());
    }
}

#[cfg(test)]
mod shard_tests {
    // Goal: a run id made for a shard lands there, for any random words
    // and any shard count. Method: property test over both words, the
    // shard count and the shard.
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_run_id_made_for_a_shard_lands_there(
            high in any::<u64>(),
            low in any::<u64>(),
            shards in 1u16..=u16::MAX,
            pick in any::<u16>(),
        ) {
            let shard = ShardId(pick % shards);
            let id = run_id_on_shard(high, low, shard, shards);
            prop_assert_eq!(shard_of(id, shards), shard);
        }

        #[test]
        fn a_run_id_made_beside_another_shares_its_shard(
            a in any::<u64>(),
            b in any::<u64>(),
            high in any::<u64>(),
            shards in 1u16..=u16::MAX,
        ) {
            let parent = RunId::from_u64_pair(a, b);
            let child = run_id_beside(parent, high);
            prop_assert_eq!(shard_of(child, shards), shard_of(parent, shards));
            prop_assert_eq!(&child.as_bytes()[..8], &high.to_be_bytes()[..], "the random word is kept");
        }

        #[test]
        fn client_run_ids_sort_by_the_time_they_were_made(
            at in 0u64..(1 << RUN_ID_TIME_BITS),
            later in 1u64..86_400_000,
            r1 in any::<u64>(),
            r2 in any::<u64>(),
            l1 in any::<u64>(),
            l2 in any::<u64>(),
            shards in 1u16..=u16::MAX,
            p1 in any::<u16>(),
            p2 in any::<u16>(),
        ) {
            let later = (at + later).min((1 << RUN_ID_TIME_BITS) - 1);
            prop_assume!(later > at);
            // Different shards and low words: the time decides the order.
            let (s1, s2) = (ShardId(p1 % shards), ShardId(p2 % shards));
            let a = run_id_on_shard(run_id_high(at, r1), l1, s1, shards);
            let b = run_id_on_shard(run_id_high(later, r2), l2, s2, shards);
            prop_assert!(a < b, "{a:?} made before {b:?}");
            prop_assert_eq!(shard_of(a, shards), s1);
            prop_assert_eq!(shard_of(b, shards), s2);
            prop_assert_eq!(run_id_high(at, r1) >> (64 - RUN_ID_TIME_BITS), at);
        }
    }
}
