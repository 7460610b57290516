//! The simulated host: the engine's shard drivers (`keel_core::driver`,
//! the code that ships) on virtual time, with a simulated store, workers,
//! clients and network around them.
//!
//! The host decides nothing the engine decides: it performs the drivers'
//! actions (reads, commits, attempts, messages, replies), and injects the
//! faults real hosts meet: a slow or failing store, a crash that drops the
//! unsynced tail, workers that crash, stall, stop heartbeating or run past
//! their limits, results reported twice or late, messages delayed,
//! reordered or delivered twice, stray client requests. Everything runs on
//! one thread, in an event queue ordered by (time, insertion), with one
//! `ChaCha8Rng` for every decision and `BTreeMap`s for everything iterated.
//!
//! What it cannot run, and why: the actix host's threads and mailboxes (a
//! simulated process has no threads; messages between shards are its
//! events, delivered in the order the queue gives them), and real activity
//! code (activities are mocks: a function of input and attempt number, with
//! a simulated duration).

mod clients;
mod io;
mod process;
mod workers;

use std::collections::BTreeMap;
use std::sync::Arc;

use std::collections::VecDeque;

use keel_core::driver::{
    Action, AttemptKey, BreakMode, DriverConfig, RequestId, Shard, ShardId, ShardInput,
    INTENTS_IN_MEMORY_MAX, TIMERS_IN_MEMORY_MAX,
};
use keel_core::WorkflowRegistry;
use keel_resilience::{Clock, CompiledPipeline, ManualClock};
use keel_storage::{AttemptNo, Event, Failure, LeaseEpoch, Outcome, Payload, RunId};
use rand::{Rng, RngExt};
use rand_chacha::ChaCha8Rng;

use crate::check::{Checker, Violation, ViolationKind};
use crate::fault::{FaultKind, FaultPlan, Firings};
use crate::store::SimStore;
use crate::trace::{fnv1a, Trace};
use crate::workload::Workload;

/// A mock activity body: input and attempt number in, result out.
pub(crate) type MockBody =
    Arc<dyn Fn(&Payload, AttemptNo) -> Result<Payload, Failure> + Send + Sync>;
/// A mock activity's fallback for a final failure.
pub(crate) type MockFallback =
    Arc<dyn Fn(&Payload, &Failure) -> Option<Result<Payload, Failure>> + Send + Sync>;

/// A mock activity: its body, how long an attempt normally takes, and its
/// fallback, if it has one.
#[derive(Clone)]
pub(crate) struct Mock {
    pub(crate) body: MockBody,
    pub(crate) duration_ms: (u64, u64),
    pub(crate) fallback: Option<MockFallback>,
}

/// Simulated activity workers.
const WORKERS: usize = 4;
/// How long a client waits for an answer before it sends again.
const CLIENT_TIMEOUT_MS_MAX: u64 = 300;
/// The group commit's sync normally takes up to this long...
const SYNC_MS_MAX: u64 = 2;
/// ...and now and then (a slow disk) up to this long, which widens the
/// window in which the machines are ahead of what is durable.
const SLOW_SYNC_MS_MAX: u64 = 100;

/// How long a commit may go unanswered before a shard takes the store for
/// stalled: well above a slow sync, so that only `store-stall` reaches it.
const COMMIT_STALL_MS: u64 = 500;

/// How long after a disk hang ends a client may still hear "unavailable"
/// (the answer was on its way).
const STALL_ANSWER_SLACK_MS: u64 = 100;
/// A slow read runs this long after it was asked for (a blocking pool
/// busy elsewhere), while commits go on.
const SLOW_READ_MS_MIN: u64 = 5;
const SLOW_READ_MS_MAX: u64 = 60;

/// Longest simulated stop of the store's writes (a full disk until an
/// operator frees space).
const STORE_STOP_MS_MAX: u64 = 2_000;
/// Sends of one client request before the client gives up.
const CLIENT_TRIES_MAX: u32 = 200;
/// Engine crashes per seed at most (each restart replays everything).
const CRASHES_MAX: u32 = 8;
/// Faults stop this long after the workload's last planned request.
const FAULT_TAIL_MS: u64 = 1_500;
/// Virtual time the liveness phase may take after faults stop.
const LIVENESS_MS: u64 = 600_000;
/// A jump in virtual time at least this long makes the loop check whether
/// everything is done.
const QUIET_GAP_MS: u64 = 10_000;
/// Steps one seed may take at most.
const STEPS_MAX: u64 = 2_000_000;
/// Lease-affecting faults (expiry, worker crash, silence, slowness) one
/// attempt may suffer: below the redelivery bound, so faults never turn
/// into a lease failure that would change the workflow's outcome.
const ATTEMPT_FAULTS_MAX: u32 = keel_core::driver::LEASE_REDELIVERIES_MAX - 1;
/// The lease of an attempt without a timeout of its own (the engine's
/// default is a minute; a second keeps simulated expiries cheap).
const LEASE_MS: u64 = 1_000;

/// A shard's lease when several processes share the store (the engine's
/// default is five seconds; a second keeps simulated takeovers cheap).
const SHARD_LEASE_MS: u64 = 1_000;
/// How often a process of several looks for shards to take.
const LOOK_MS: u64 = 250;
/// Pauses of a process per seed at most.
const PAUSES_MAX: u32 = 6;

/// A client's `result` request waits this long for the run to close
/// before it asks again (the wait is lost when the engine crashes).
const RESULT_WAIT_MS: u64 = 5_000;
/// A client describes its instance once, at most this long after its start
/// was answered.
const DESCRIBE_AFTER_MS_MAX: u64 = 3_000;

/// Which client request.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum OpRef {
    /// The start.
    Start,
    /// Planned signal or cancel `i`.
    Planned(usize),
    /// Waiting for the outcome (following continue-as-new).
    Result,
    /// One describe, at a random point of the run.
    Describe,
}

/// Everything that happens at a point of virtual time.
#[derive(Debug)]
enum Ev {
    ClientSend {
        plan: usize,
        op: OpRef,
        try_no: u32,
    },
    ClientTimeout {
        plan: usize,
        op: OpRef,
        try_no: u32,
    },
    ClientReply {
        plan: usize,
        op: OpRef,
        try_no: u32,
        answer: keel_core::driver::Answer,
    },
    /// An input reaches a shard; `inc` is the process incarnation it was
    /// sent from, if it came from inside an engine process (it is lost
    /// with that process), `None` from outside (clients, stray workers).
    /// A `pinned` input (the answer to an action of that process, a report
    /// from its own worker) goes to that incarnation's shard; any other
    /// goes to whichever process owns the shard when it arrives.
    /// A `relayed` input (a report from a copy another process runs)
    /// waits in the store, until then, for a process to own the shard.
    Input {
        inc: Option<u32>,
        pinned: bool,
        relayed: Option<u64>,
        shard: ShardId,
        input: Box<ShardInput>,
    },
    /// A shard's wake-up time came.
    Wake {
        inc: u32,
        shard: ShardId,
    },
    /// The group commit syncs.
    Flush {
        inc: u32,
    },
    /// A read asked for earlier runs now (see `FaultKind::SlowRead`).
    SlowRead {
        inc: u32,
        shard: ShardId,
        token: keel_core::driver::Token,
        query: Box<keel_core::driver::ReadQuery>,
    },
    /// A copy of an attempt finishes on a worker.
    WorkerDone {
        worker: usize,
        life: u32,
        copy: CopyId,
    },
    /// A copy of an attempt heartbeats.
    WorkerBeat {
        worker: usize,
        life: u32,
        copy: CopyId,
    },
    WorkerCrash {
        worker: usize,
    },
    EngineCrash,
    EngineRestart,
    /// One process of several dies (its memory, copies and group are
    /// lost; the store is a database that lives on). Only incarnation
    /// `inc`: a kill decided for it does not reach a later one.
    ProcessKill {
        p: usize,
        inc: u32,
    },
    /// A process started again, as a new incarnation.
    ProcessRestart {
        p: usize,
    },
    /// A frozen process wakes up and carries on where it stopped.
    ProcessWake {
        p: usize,
        inc: u32,
    },
    /// A process of several looks for shards to take.
    Look {
        p: usize,
        inc: u32,
    },
    /// Space is freed: the stopped store accepts writes again.
    StoreResume,
}

/// One copy of an attempt on a simulated worker.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
struct CopyId {
    /// The incarnation of the shard's process that dispatched it.
    inc: u32,
    /// The incarnation of the process running it: `inc`, or another
    /// process that took it from the store.
    runner: u32,
    shard: ShardId,
    key: AttemptKey,
    attempt: AttemptNo,
    epoch: LeaseEpoch,
}

/// A copy running on a worker, until it reports.
#[derive(Debug)]
struct Copy {
    result: Result<Payload, Failure>,
    /// Asked to stop: the copy gives up at its next heartbeat.
    stop: bool,
    /// Stopped heartbeating (a silent worker).
    silent: bool,
    heartbeat_ms: Option<u64>,
    /// Sent twice by the transport: a second worker also runs it.
    twin: bool,
    /// The worker it runs on.
    worker: usize,
    /// A final attempt whose lease is its start-to-close limit: losing the
    /// worker would fail it as a timeout with no retry left, changing the
    /// outcome, so worker crashes spare it.
    fragile: bool,
}

/// A commit written to the store and waiting for the group sync.
struct Pending {
    shard: ShardId,
    token: keel_core::driver::Token,
    ack: keel_storage::CommitAck,
    events: Vec<(RunId, Vec<Event>)>,
    /// Written, but its answer is lost with the connection
    /// (`commit-answer-lost`): the shard hears the outcome is unknown.
    answer_lost: bool,
}

/// An engine process: its shards and what it holds in memory. A crash
/// loses all of it.
struct Process {
    up: bool,
    /// Its incarnation, unique over every process of the simulation.
    inc: u32,
    /// Its name as a lease owner (several processes only).
    name: String,
    /// The workflows, with this process's async closures.
    workflows: WorkflowRegistry,
    shards: BTreeMap<ShardId, Shard>,
    /// The wake-up each shard has asked for and the host has queued.
    wakes: BTreeMap<ShardId, u64>,
    group: Vec<Pending>,
    flush_scheduled: bool,
    copies: BTreeMap<CopyId, Copy>,
    /// Frozen (a stop-the-world pause, a `kill -STOP`) until then.
    paused_until: Option<u64>,
    /// Actions it was about to perform when it froze.
    stash: VecDeque<(ShardId, Action)>,
    /// Each shard's lease epoch at its last look: a higher one means a new
    /// owner took the shard since.
    seen_epochs: BTreeMap<u16, u64>,
}

impl Process {
    fn down(inc: u32, workflows: &WorkflowRegistry) -> Self {
        Process {
            up: false,
            inc,
            name: String::new(),
            workflows: workflows.with_fresh_closures(),
            shards: BTreeMap::new(),
            wakes: BTreeMap::new(),
            group: Vec::new(),
            flush_scheduled: false,
            copies: BTreeMap::new(),
            paused_until: None,
            stash: VecDeque::new(),
            seen_epochs: BTreeMap::new(),
        }
    }
}

#[derive(Default)]
struct Client {
    started: bool,
    done: Vec<bool>,
    /// The outcome the client was answered (after following every
    /// continue-as-new).
    result: Option<Outcome>,
    /// The run or instance its `result` request asks about now.
    result_target: String,
    described: bool,
    tries: BTreeMap<OpRef, u32>,
}

/// What a finished simulation hands back.
pub(crate) struct WorldResult {
    pub(crate) violations: Vec<Violation>,
    pub(crate) outcomes: BTreeMap<String, Outcome>,
    pub(crate) histories: BTreeMap<RunId, Vec<Event>>,
    pub(crate) trace_hash: u64,
    pub(crate) trace: Vec<String>,
    pub(crate) faults_fired: BTreeMap<FaultKind, u64>,
    pub(crate) virtual_ms: u64,
    pub(crate) steps: u64,
    pub(crate) commits: u64,
    pub(crate) events: u64,
    pub(crate) crashes: u32,
    pub(crate) outbox_messages: u64,
    pub(crate) shards: u16,
    pub(crate) takeovers: u32,
    pub(crate) fenced: u32,
    pub(crate) released: u32,
    pub(crate) copies_lost: u32,
    pub(crate) firings: Vec<(FaultKind, u32)>,
}

/// How one simulated execution is set up.
pub(crate) struct Setup<'a> {
    pub(crate) seed: u64,
    pub(crate) workflows: &'a WorkflowRegistry,
    pub(crate) mocks: &'a BTreeMap<String, Mock>,
    pub(crate) profiles: &'a BTreeMap<String, ProfileSpec>,
    pub(crate) plan: FaultPlan,
    pub(crate) breaks: Option<BreakMode>,
    pub(crate) workload: &'a Workload,
    pub(crate) keep_trace: bool,
    /// Only these fault firings happen (shrinking), when given.
    pub(crate) firings: Option<&'a Firings>,
    /// Engine processes sharing the store (1: no shard leases).
    pub(crate) processes: usize,
}

/// A resilience profile as the simulator builds it for each execution (on
/// a manual clock that follows virtual time).
pub(crate) type ProfileSpec =
    Arc<dyn Fn(Arc<ManualClock>) -> CompiledPipeline<Failure> + Send + Sync>;

/// One simulated execution.
pub(crate) struct World<'a> {
    setup: Setup<'a>,
    now: u64,
    queue: BTreeMap<(u64, u64), Ev>,
    next_ev: u64,
    rng: ChaCha8Rng,
    store: SimStore,
    processes: Vec<Process>,
    /// The last incarnation handed out.
    last_inc: u32,
    config: DriverConfig,
    clock: Arc<ManualClock>,
    workers: Vec<u32>,
    clients: Vec<Client>,
    /// Client requests in flight, by id.
    requests: BTreeMap<RequestId, (usize, OpRef, u32)>,
    next_request: u64,
    checker: Checker,
    trace: Trace,
    fault_until: u64,
    attempt_faults: BTreeMap<(RunId, keel_storage::Step, AttemptNo), u32>,
    names: BTreeMap<RunId, String>,
    fired: BTreeMap<FaultKind, u64>,
    /// Every firing in order, as (kind, occurrence index of that kind).
    firings: Vec<(FaultKind, u32)>,
    /// How many times each kind's dice came up so far.
    rolls_won: BTreeMap<FaultKind, u32>,
    commits: u64,
    events: u64,
    crashes: u32,
    outbox_messages: u64,
    /// The highest lease epoch seen per execution (epochs only grow).
    epochs: BTreeMap<AttemptKey, LeaseEpoch>,
    /// Until when the store refuses writes (a simulated full disk).
    store_stopped_until: Option<u64>,
    /// How many times the store stopped.
    store_stops: u32,
    /// Disk hangs injected (`store-stall`), and when the last one to end
    /// ends: a shard may answer "unavailable" until then.
    store_stalls: u32,
    stall_until: u64,
    /// Shards taken from an earlier owner (several processes).
    takeovers: u32,
    /// Shards that stopped because they lost their lease.
    fenced: u32,
    /// Shards given up for another process to take (a rebalance).
    released: u32,
    /// Copies lost with a killed process that had taken them from
    /// another process's shard.
    copies_lost: u32,
    /// Shards given up whose `ShardLost` is still to come.
    released_pending: std::collections::BTreeSet<(usize, ShardId)>,
    pauses: u32,
}

impl<'a> World<'a> {
    pub(crate) fn new(setup: Setup<'a>, mut rng: ChaCha8Rng, store: SimStore) -> Self {
        let plans = setup.workload.plans();
        let last = plans
            .iter()
            .flat_map(|p| std::iter::once(p.start_at_ms).chain(p.ops.iter().map(|o| o.at_ms)))
            .max()
            .unwrap_or(0);
        let clients = plans
            .iter()
            .map(|p| Client {
                done: vec![false; p.ops.len()],
                result_target: p.instance.clone(),
                ..Client::default()
            })
            .collect();
        let keep = setup.keep_trace;
        if setup.breaks == Some(BreakMode::NoAttemptDedupe) {
            store.set_duplicate_terminal_check(false);
        }
        // The engine's shape for this seed: shards, cache and worker
        // limits small enough that passivation and queueing happen.
        let mut shape = rng.clone();
        shape.set_stream(4);
        let shards = if setup.processes > 1 {
            shape.random_range(2..=6u16)
        } else {
            shape.random_range(1..=3u16)
        };
        let clock = Arc::new(ManualClock::new());
        let profiles = setup
            .profiles
            .iter()
            .map(|(name, build)| (name.clone(), Arc::new(build(clock.clone()))))
            .collect();
        // The draws keep their order, so a seed keeps its shape.
        let run_cache_max = if shape.random_bool(0.5) {
            shape.random_range(2..=8)
        } else {
            10_000
        };
        let worker_concurrency_max = shape.random_range(2..=16);
        // Small windows half the time, so that timers, attempts and
        // outbox messages come in by window reads (timers are also dropped
        // from memory past the horizon).
        let small_window = if shape.random_bool(0.5) {
            Some(shape.random_range(1..=4))
        } else {
            None
        };
        let config = DriverConfig {
            shards,
            run_cache_max,
            lease_ms_default: LEASE_MS,
            worker_concurrency_max,
            timers_in_memory_max: small_window.unwrap_or(TIMERS_IN_MEMORY_MAX),
            intents_in_memory_max: small_window.unwrap_or(INTENTS_IN_MEMORY_MAX),
            profiles,
            shard_lease_ms: SHARD_LEASE_MS,
            commit_stall_ms: COMMIT_STALL_MS,
            breaks: setup.breaks,
        };
        let _ = rng.next_u64();
        let processes = (0..setup.processes)
            .map(|_| Process::down(0, setup.workflows))
            .collect();
        let mut w = World {
            processes,
            last_inc: 0,
            setup,
            now: 0,
            queue: BTreeMap::new(),
            next_ev: 0,
            rng,
            store,
            config,
            clock,
            workers: vec![0; WORKERS],
            clients,
            requests: BTreeMap::new(),
            next_request: 0,
            checker: Checker::default(),
            trace: Trace::new(keep),
            fault_until: last + FAULT_TAIL_MS,
            attempt_faults: BTreeMap::new(),
            names: BTreeMap::new(),
            fired: BTreeMap::new(),
            firings: Vec::new(),
            rolls_won: BTreeMap::new(),
            commits: 0,
            events: 0,
            crashes: 0,
            outbox_messages: 0,
            epochs: BTreeMap::new(),
            store_stopped_until: None,
            store_stops: 0,
            store_stalls: 0,
            stall_until: 0,
            takeovers: 0,
            fenced: 0,
            released: 0,
            copies_lost: 0,
            released_pending: Default::default(),
            pauses: 0,
        };
        for p in 0..w.processes.len() {
            w.boot(p);
        }
        w
    }

    // ----- plumbing ---------------------------------------------------

    fn at(&mut self, at: u64, ev: Ev) {
        self.next_ev += 1;
        self.queue.insert((at.max(self.now), self.next_ev), ev);
    }

    /// Queues an input for shard `shard` of whichever process owns it
    /// when it arrives; `inc` is the sender's incarnation (lost with it).
    fn input_at(&mut self, at: u64, inc: Option<u32>, shard: ShardId, input: ShardInput) {
        self.at(
            at,
            Ev::Input {
                inc,
                pinned: false,
                relayed: None,
                shard,
                input: Box::new(input),
            },
        );
    }

    /// Queues an input for shard `shard` of incarnation `inc` itself (an
    /// answer to its own action, a report of its own worker).
    fn pinned_at(&mut self, at: u64, inc: u32, shard: ShardId, input: ShardInput) {
        self.at(
            at,
            Ev::Input {
                inc: Some(inc),
                pinned: true,
                relayed: None,
                shard,
                input: Box::new(input),
            },
        );
    }

    /// Queues a report of `copy` for its shard: pinned to the process that
    /// dispatched it when it runs there, else relayed through the store to
    /// whichever process owns the shard (kept there for a few shard
    /// leases, as the relay keeps a note until it is taken).
    fn report_at(&mut self, at: u64, copy: CopyId, input: ShardInput) {
        if copy.runner == copy.inc {
            return self.pinned_at(at, copy.inc, copy.shard, input);
        }
        self.relay_at(at, copy.shard, input);
    }

    /// Queues an input for `shard` through the store's relay: a note that
    /// outlives its sender and waits (a few shard leases here) for a
    /// process to own the shard.
    fn relay_at(&mut self, at: u64, shard: ShardId, input: ShardInput) {
        let keep_until = at + 4 * self.config.shard_lease_ms;
        self.at(
            at,
            Ev::Input {
                inc: None,
                pinned: false,
                relayed: Some(keep_until),
                shard,
                input: Box::new(input),
            },
        );
    }

    /// The process running incarnation `inc`, if it is up.
    fn live(&self, inc: u32) -> Option<usize> {
        self.processes.iter().position(|p| p.up && p.inc == inc)
    }

    /// The process that owns `shard` now: the one up holding it under the
    /// newest lease (a process frozen past its lease may still hold an
    /// older one in memory).
    fn owner(&self, shard: ShardId) -> Option<usize> {
        self.processes
            .iter()
            .enumerate()
            .filter(|(_, p)| p.up)
            .filter_map(|(i, p)| p.shards.get(&shard).map(|s| (i, s)))
            .filter(|(_, s)| !s.lost())
            .max_by_key(|(_, s)| s.lease().map_or(0, |l| l.epoch))
            .map(|(i, _)| i)
    }

    /// Whether several processes share the store (shard leases on).
    fn shared(&self) -> bool {
        self.processes.len() > 1
    }

    fn log(&mut self, args: std::fmt::Arguments<'_>) {
        self.trace.line(self.now, args);
    }

    /// Draws whether a fault of `kind` fires now (always draws, so that the
    /// random stream does not depend on which faults are on), and records
    /// the firing.
    fn fault(&mut self, kind: FaultKind) -> bool {
        let p = self.setup.plan.p(kind);
        let roll: f64 = self.rng.random();
        if !(self.now < self.fault_until && roll < p) {
            return false;
        }
        let n = self.rolls_won.entry(kind).or_default();
        let index = *n;
        *n += 1;
        if let Some(allowed) = self.setup.firings {
            if !allowed.contains(kind, index) {
                return false;
            }
        }
        self.firings.push((kind, index));
        *self.fired.entry(kind).or_default() += 1;
        self.log(format_args!("fault {kind} #{index}"));
        true
    }

    fn ms(&mut self, lo: u64, hi: u64) -> u64 {
        self.rng.random_range(lo..=hi)
    }

    /// Latency of a message; `reorder` holds some back.
    fn latency(&mut self) -> u64 {
        let base = self.ms(0, 2);
        if self.fault(FaultKind::Reorder) {
            base + self.ms(5, 600)
        } else {
            base
        }
    }

    fn name(&self, run: RunId) -> String {
        self.names
            .get(&run)
            .cloned()
            .unwrap_or_else(|| run.to_string())
    }

    fn plan_hash(&self, plan: usize) -> u64 {
        let instance = &self.setup.workload.plans()[plan].instance;
        fnv1a(
            fnv1a(0xcbf2_9ce4_8422_2325, &self.setup.seed.to_le_bytes()),
            instance.as_bytes(),
        )
    }

    // ----- the main loop ----------------------------------------------

    pub(crate) fn run(mut self) -> WorldResult {
        for (i, p) in self.setup.workload.plans().iter().enumerate() {
            let at = p.start_at_ms;
            self.at(
                at,
                Ev::ClientSend {
                    plan: i,
                    op: OpRef::Start,
                    try_no: 0,
                },
            );
        }
        let deadline = self.fault_until + LIVENESS_MS;
        let mut steps = 0u64;
        let mut quiet_checked = 0;
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            // Several processes look for shards every `LOOK_MS`, so virtual
            // time never jumps: whether all is done is checked as often.
            let check =
                t > self.now + QUIET_GAP_MS || (self.shared() && t >= quiet_checked + QUIET_GAP_MS);
            if check {
                quiet_checked = t;
            }
            if check && self.quiescent() && !(self.shared() && self.intents_left()) {
                let left = self.queue.len() + 1;
                self.log(format_args!("quiescent; {left} queued events left"));
                break;
            }
            if t > deadline {
                self.log(format_args!(
                    "liveness phase over; {} queued events left",
                    self.queue.len() + 1
                ));
                break;
            }
            if steps >= STEPS_MAX {
                let detail = format!("still busy after {steps} steps at {t} ms of virtual time");
                self.checker.violations.push(Violation {
                    kind: ViolationKind::NoQuiescence,
                    at_ms: t,
                    detail,
                });
                break;
            }
            self.now = t;
            self.clock_to_now();
            steps += 1;
            self.step(ev);
            self.pump();
            self.checker.check_touched(&self.store, self.now);
            if self.checker.failed() {
                break;
            }
        }
        self.finish(steps)
    }

    /// Keeps the profiles' manual clock at virtual time.
    fn clock_to_now(&mut self) {
        let now = std::time::Duration::from_millis(self.now);
        let behind = now.saturating_sub(self.clock.now().since_epoch());
        if !behind.is_zero() {
            self.clock.advance(behind);
        }
    }

    /// Nothing left to do: the engine is up with nothing waiting to be
    /// acknowledged, every client request is answered, and no run is open.
    fn quiescent(&self) -> bool {
        self.processes
            .iter()
            .all(|p| p.up && p.paused_until.is_none() && p.group.is_empty())
            && self.clients.iter().all(|c| {
                c.started && c.done.iter().all(|d| *d) && c.result.is_some() && c.described
            })
            && self
                .store
                .store()
                .runs(
                    &keel_storage::RunFilter::all()
                        .status(keel_storage::RunStatus::Running)
                        .limit(1),
                )
                .is_ok_and(|r| r.is_empty())
    }

    /// Whether an intent row (a pending attempt, a timer, an outbox
    /// message) is still in the store. With several processes virtual
    /// time never jumps, so the end is when the work is gone.
    fn intents_left(&self) -> bool {
        let store = self.store.store();
        !store.tasks(1).unwrap_or_default().is_empty()
            || !store
                .due_timers(keel_storage::Timestamp(u64::MAX), 1)
                .unwrap_or_default()
                .is_empty()
            || !store.outbox(1).unwrap_or_default().is_empty()
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::ClientSend { plan, op, try_no } => self.client_send(plan, op, try_no),
            Ev::ClientTimeout { plan, op, try_no } => {
                if !self.client_done(plan, op) && self.clients[plan].tries.get(&op) == Some(&try_no)
                {
                    self.log(format_args!(
                        "client {plan} {op:?} timed out (try {try_no})"
                    ));
                    self.client_send(plan, op, try_no + 1);
                }
            }
            Ev::ClientReply {
                plan,
                op,
                try_no,
                answer,
            } => self.client_reply(plan, op, try_no, answer),
            Ev::Input {
                inc,
                pinned,
                relayed,
                shard,
                input,
            } => {
                if inc.is_some_and(|i| self.live(i).is_none()) {
                    self.log(format_args!("lost with its process: {input:?}"));
                    return;
                }
                let to = match (pinned, inc) {
                    (true, Some(i)) => self.live(i),
                    _ => self.owner(shard),
                };
                let owned = to.is_some_and(|p| self.processes[p].shards.contains_key(&shard));
                // In the store until a process owns the shard again, or
                // waiting for the owner to wake: delivered again later.
                let later = if !owned && relayed.is_some_and(|until| self.now < until) {
                    Some(self.now + self.ms(10, 100))
                } else {
                    to.and_then(|p| self.processes[p].paused_until)
                };
                if let Some(at) = later {
                    let ev = Ev::Input {
                        inc,
                        pinned,
                        relayed,
                        shard,
                        input,
                    };
                    self.at(at, ev);
                    return;
                }
                let Some(p) = to else {
                    self.log(format_args!("no process owns {shard}; lost: {input:?}"));
                    return;
                };
                if !self.processes[p].shards.contains_key(&shard) {
                    self.log(format_args!("{shard} left its process; lost: {input:?}"));
                    return;
                }
                self.feed(p, shard, *input);
            }
            Ev::Wake { inc, shard } => {
                let Some(p) = self.live(inc) else {
                    return;
                };
                if let Some(until) = self.processes[p].paused_until {
                    self.at(until, Ev::Wake { inc, shard });
                    return;
                }
                self.processes[p].wakes.remove(&shard);
                let now = keel_storage::Timestamp(self.now);
                if let Some(s) = self.processes[p].shards.get_mut(&shard) {
                    s.handle_timeout(now);
                }
            }
            Ev::SlowRead {
                inc,
                shard,
                token,
                query,
            } => {
                if self.live(inc).is_some() {
                    // Its answer waits behind the shard's other inputs too.
                    self.read_now(inc, shard, token, &query, SLOW_READ_MS_MAX);
                }
            }
            Ev::Flush { inc } => {
                let Some(p) = self.live(inc) else {
                    return;
                };
                if let Some(until) = self.processes[p].paused_until {
                    self.at(until, Ev::Flush { inc });
                    return;
                }
                self.flush(p);
            }
            Ev::ProcessKill { p, inc } => {
                if self.processes[p].inc == inc {
                    self.process_kill(p);
                }
            }
            Ev::ProcessRestart { p } => self.process_restart(p),
            Ev::ProcessWake { p, inc } => self.process_wake(p, inc),
            Ev::Look { p, inc } => {
                let Some(q) = self.live(inc) else {
                    return;
                };
                if let Some(until) = self.processes[q].paused_until {
                    self.at(until, Ev::Look { p, inc });
                    return;
                }
                self.look(p);
            }
            Ev::WorkerDone { worker, life, copy } => self.worker_done(worker, life, copy),
            Ev::WorkerBeat { worker, life, copy } => self.worker_beat(worker, life, copy),
            Ev::WorkerCrash { worker } => self.worker_crash(worker),
            Ev::EngineCrash => self.engine_crash(),
            Ev::EngineRestart => self.engine_restart(),
            Ev::StoreResume => {
                self.store_stopped_until = None;
                self.log(format_args!("store accepts writes again"));
                self.report_store_health();
            }
        }
    }

    /// The store's health as the host observes it.
    fn store_health(&self) -> keel_storage::StoreHealth {
        match self.store_stopped_until {
            Some(_) => keel_storage::StoreHealth::Stopped {
                fault: keel_storage::WriteFault::NoSpace,
                detail: "simulated full disk".into(),
            },
            None => keel_storage::StoreHealth::Healthy,
        }
    }

    /// Reports the store's health to every shard whose view differs, as the
    /// actix host's poll does.
    pub(super) fn report_store_health(&mut self) {
        let health = self.store_health();
        for p in 0..self.processes.len() {
            // A frozen process learns nothing until it wakes (then the
            // next report reaches it).
            if !self.running(p) {
                continue;
            }
            let stale: Vec<ShardId> = self.processes[p]
                .shards
                .iter()
                .filter(|(_, s)| *s.reported_store_health() != health)
                .map(|(id, _)| *id)
                .collect();
            for shard in stale {
                self.feed(p, shard, ShardInput::StoreHealth(health.clone()));
            }
        }
    }

    /// Hands an input to shard `shard` of process `p`.
    fn feed(&mut self, p: usize, shard: ShardId, input: ShardInput) {
        let now = keel_storage::Timestamp(self.now);
        if let Some(s) = self.processes[p].shards.get_mut(&shard) {
            s.handle(now, input);
        }
    }

    /// Performs every action the shards asked for, until none is left, and
    /// queues the wake-ups they want.
    fn pump(&mut self) {
        for p in 0..self.processes.len() {
            self.pump_process(p);
        }
    }

    /// Whether process `p` runs now (up and not frozen).
    fn running(&self, p: usize) -> bool {
        self.processes[p].up && self.processes[p].paused_until.is_none()
    }

    fn pump_process(&mut self, p: usize) {
        loop {
            if !self.running(p) {
                return;
            }
            let mut any = false;
            let ids: Vec<ShardId> = self.processes[p].shards.keys().copied().collect();
            for shard in ids {
                loop {
                    if !self.running(p) {
                        return;
                    }
                    let Some(action) = self.processes[p]
                        .shards
                        .get_mut(&shard)
                        .and_then(Shard::poll_action)
                    else {
                        break;
                    };
                    any = true;
                    self.perform(p, shard, action);
                }
            }
            if !any {
                break;
            }
        }
        let timeouts: Vec<(ShardId, u64)> = self.processes[p]
            .shards
            .iter()
            .filter_map(|(id, s)| s.poll_timeout().map(|t| (*id, t.0)))
            .collect();
        for (shard, t) in timeouts {
            let t = t.max(self.now);
            if self.processes[p].wakes.get(&shard).is_none_or(|w| t < *w) {
                self.processes[p].wakes.insert(shard, t);
                let inc = self.processes[p].inc;
                // A host wakes late now and then (a busy thread, a coarse
                // timer): the shard sees a later `now`.
                let late = if self.fault(FaultKind::TimerSkew) {
                    self.ms(1, 800)
                } else {
                    0
                };
                self.at(t + late, Ev::Wake { inc, shard });
            }
        }
    }
}
