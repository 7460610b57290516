//! The engine: opens the store, starts the actor system on its own threads
//! (one arbiter per shard), the activity runtime, and hands out
//! [`Client`]s. Each shard actor recovers its shard's durable work from the
//! store when it starts.
//!
//! The engine runs on threads of its own, so it embeds the same way in a
//! plain `main`, under `#[tokio::main]`, `#[actix::main]` or inside an
//! actix-web application: no nested runtime, and no call that blocks an
//! async caller for long ([`Engine::build`] waits for its threads to
//! start; prefer [`Engine::shutdown`] to dropping it in async code).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix::{Actor, Addr, Arbiter, ArbiterHandle};
use keel_core::driver::{
    AttemptKey, AttemptOrder, DriverConfig, Message, Shard, ShardId, ShardInput,
    INTENTS_IN_MEMORY_MAX, LEASE_MS_DEFAULT, RUN_CACHE_MAX_DEFAULT, SHARD_LEASE_MS_DEFAULT,
    TIMERS_IN_MEMORY_MAX, WORKER_CONCURRENCY_MAX,
};
use keel_core::{Activity, ActivityRegistry, CancelSignal, Workflow, WorkflowRegistry};
use keel_resilience::CompiledPipeline;
use keel_storage::stats::{Histogram, HistogramSnapshot, WriterSnapshot, WRITE_BUCKETS_SECONDS};
use keel_storage::{
    Durability, Failure, LeaseEpoch, MemStore, PgOptions, PgStore, RelayTo, RocksStore, Store,
    StoreHealth, Timestamp,
};
use parking_lot::Mutex;

use crate::client::{Client, ClientCore, EngineError};
use crate::cluster::{ClusterHandle, Member};
use crate::readers::{ReadQueue, Readers};
use crate::routes::{Local, RelayLink, Report, Routes, Wire};
use crate::shard::{Feed, ShardActor, Stats, Stop};

/// How long a shutdown waits for activity code to reach an await point.
pub const ACTIVITY_SHUTDOWN_MS: u64 = 2_000;

/// The engine's clock, in milliseconds since the Unix epoch.
pub(crate) fn now() -> Timestamp {
    Timestamp(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    )
}

/// Tunables of an engine, each with its unit in the name.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Runs kept in memory, over all shards.
    pub run_cache_max: usize,
    /// Shards (each on its own arbiter thread); runs are spread over them
    /// by the hash of their id.
    pub shards: usize,
    /// Threads of the activity pool, where activity code runs (the first
    /// poll of a `NON_BLOCKING` activity's attempt runs on its shard's
    /// thread).
    pub activity_threads: usize,
    /// Lease of an attempt without heartbeat or start-to-close timeout.
    pub lease_ms_default: u64,
    /// Attempts running at once, over all shards.
    pub worker_concurrency_max: usize,
    /// Durable timers held in memory per window, over all shards (each
    /// holds at most twice its share; the rest stay in the store until
    /// they come near).
    pub timers_in_memory_max: usize,
    /// Pending attempts, and outbox messages, read into memory per window
    /// at recovery, over all shards (the next window is read as those are
    /// done; the rest stay in the store).
    pub intents_in_memory_max: usize,
    /// How commits are made durable.
    pub durability: Durability,
    /// On a store several engine processes share: how long a shard lease
    /// lasts unless renewed (a dead process's shards are taken over within
    /// about this much of its last renewal).
    pub shard_lease_ms: u64,
    /// On a store several engine processes share: an attempt goes to
    /// whichever process takes it first from the store (each takes as
    /// many as it has room for under `worker_concurrency_max`), instead
    /// of running in the process that owns its shard. Its shard still
    /// supervises it under its lease: a copy whose process died is
    /// redelivered when the lease ends.
    pub attempts_anywhere: bool,
    /// How long a commit may go unanswered before its shard takes the
    /// store for stalled: its waiting clients are answered "unavailable",
    /// requests that write are refused, and [`Engine::health`] says
    /// [`keel_storage::WriteFault::Stalled`], until the commit is answered.
    pub commit_stall_ms: u64,
    /// On a RocksDB store with [`Durability::Sync`]: fill the first two
    /// write-ahead logs at open ([`RocksStore::prime_logs`], about 16 MiB
    /// written and synced, a few tens of milliseconds), so that commits
    /// write over recycled logs from the first one on instead of growing
    /// new files, which makes each lone commit's sync about a quarter
    /// slower until some 16 MiB of log has been written.
    pub prime_logs: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        EngineConfig {
            run_cache_max: RUN_CACHE_MAX_DEFAULT,
            shards: cores.max(1),
            activity_threads: cores.max(1),
            lease_ms_default: LEASE_MS_DEFAULT,
            worker_concurrency_max: WORKER_CONCURRENCY_MAX,
            timers_in_memory_max: TIMERS_IN_MEMORY_MAX,
            intents_in_memory_max: INTENTS_IN_MEMORY_MAX,
            durability: Durability::Sync,
            shard_lease_ms: SHARD_LEASE_MS_DEFAULT,
            attempts_anywhere: true,
            commit_stall_ms: keel_core::driver::COMMIT_STALL_MS_DEFAULT,
            prime_logs: true,
        }
    }
}

/// Builds an [`Engine`].
pub struct EngineBuilder {
    data_dir: Option<PathBuf>,
    postgres: Option<PgOptions>,
    store: Option<Arc<dyn Store>>,
    workflows: WorkflowRegistry,
    activities: ActivityRegistry,
    config: EngineConfig,
    profiles: BTreeMap<String, Arc<CompiledPipeline<Failure>>>,
}

impl std::fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("data_dir", &self.data_dir)
            .field("workflows", &self.workflows)
            .field("activities", &self.activities)
            .finish()
    }
}

impl EngineBuilder {
    /// Keeps the log in RocksDB in `dir` (the default is `./keel-data`).
    pub fn data_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.data_dir = Some(dir.into());
        self
    }

    /// Keeps the log in a PostgreSQL database (`postgres://user:pass@host:port/db`),
    /// in the schema `keel`; see [`EngineBuilder::postgres_options`].
    pub fn postgres(self, url: impl Into<String>) -> Self {
        self.postgres_options(PgOptions::new(url))
    }

    /// Keeps the log in a PostgreSQL database with these options (another
    /// schema, more read connections). The durability set with
    /// [`EngineBuilder::durability`] applies.
    pub fn postgres_options(mut self, options: PgOptions) -> Self {
        self.postgres = Some(options);
        self
    }

    /// Keeps the log in memory (tests).
    pub fn in_memory(mut self) -> Self {
        self.store = Some(Arc::new(MemStore::new(Durability::Sync)));
        self
    }

    /// Uses the given store.
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    /// Durability of commits (`Sync` by default).
    pub fn durability(mut self, d: Durability) -> Self {
        self.config.durability = d;
        self
    }

    /// Replaces the configuration.
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets only the shard count of the configuration (processes sharing
    /// a store must all use the same count).
    pub fn shards(mut self, shards: usize) -> Self {
        self.config.shards = shards;
        self
    }

    /// Registers workflow `W`.
    pub fn register_workflow<W: Workflow>(mut self) -> Self {
        self.workflows.register::<W>();
        self
    }

    /// Registers activity `A`, built with `Default`.
    pub fn register_activity<A: Activity + Default>(mut self) -> Self {
        self.activities.register(A::default());
        self
    }

    /// Registers an activity instance (one carrying its dependencies).
    pub fn activity<A: Activity>(mut self, activity: A) -> Self {
        self.activities.register(activity);
        self
    }

    /// Registers a compiled resilience pipeline as profile `name`. An
    /// activity call that names it (`.profile(name)`) gets all of its
    /// policies: admission through its circuit breaker, retry budget, rate
    /// limit and bulkhead in this engine process; its attempt timeout as the
    /// attempt's start-to-close limit; its retry policy as the call's durable
    /// retry when the call sets none; its classifier to decide what is
    /// retried; and its fallback (the activity's `fallback`) for a final
    /// failure it marks eligible.
    pub fn resilience_profile(mut self, name: &str, pipeline: CompiledPipeline<Failure>) -> Self {
        self.profiles.insert(name.to_string(), Arc::new(pipeline));
        self
    }

    /// Registers every workflow of `registry`.
    pub fn workflows(mut self, registry: &WorkflowRegistry) -> Self {
        for name in registry.names() {
            if let Some(w) = registry.get(name) {
                self.workflows.register_erased(w.clone());
            }
        }
        self
    }

    /// Registers every activity of `registry`.
    pub fn activities(mut self, registry: ActivityRegistry) -> Self {
        self.activities = registry;
        self
    }

    /// Opens the store, starts the actor system and recovers durable work
    /// (timers, pending attempts, outbox). Works inside or outside a tokio
    /// or actix runtime: the engine runs on its own threads.
    pub fn build(self) -> Result<Engine, EngineError> {
        let store: Arc<dyn Store> = match (self.store, self.postgres) {
            (Some(s), _) => s,
            (None, Some(options)) => {
                Arc::new(PgStore::open(options.durability(self.config.durability))?)
            }
            (None, None) => {
                let dir = self.data_dir.unwrap_or_else(|| PathBuf::from("keel-data"));
                let store = RocksStore::open(&dir, self.config.durability)?;
                if self.config.prime_logs && self.config.durability == Durability::Sync {
                    match store.prime_logs() {
                        Ok(report) => tracing::debug!(?report, "write-ahead logs primed"),
                        // Only the first syncs are slower without it.
                        Err(e) => tracing::warn!(error = %e, "priming the write-ahead logs failed"),
                    }
                }
                Arc::new(store)
            }
        };
        Engine::start(
            store,
            self.workflows,
            self.activities,
            self.config,
            self.profiles,
        )
    }
}

/// What the shard actors share: the store, the activities and their
/// profiles, the activity runtime, the shards' addresses and the copies of
/// attempts running now.
pub(crate) struct Host {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) activities: ActivityRegistry,
    pub(crate) profiles: BTreeMap<String, Arc<CompiledPipeline<Failure>>>,
    pub(crate) activity_rt: tokio::runtime::Handle,
    /// Where the shards' store reads go (see [`crate::readers`]).
    pub(crate) reads: ReadQueue,
    pub(crate) routes: Arc<Routes>,
    pub(crate) client: Arc<ClientCore>,
    /// How long a shard lease lasts unless renewed (a shared store).
    pub(crate) shard_lease_ms: u64,
    pub(crate) copies: Mutex<HashMap<(AttemptKey, LeaseEpoch), CancelSignal>>,
    /// The `NON_BLOCKING` activity types whose first poll on a shard's
    /// thread ran past [`crate::attempts::FIRST_POLL_WARN_MS`], warned
    /// about once each.
    pub(crate) slow_first_polls: Mutex<std::collections::HashSet<&'static str>>,
    /// Attempts go to whichever process takes them (a shared store with
    /// [`EngineConfig::attempts_anywhere`]).
    pub(crate) attempts_anywhere: bool,
    /// Copies this process runs at most (its attempts, or taken).
    pub(crate) copies_max: usize,
    /// The processes that took copies of this process's shards' attempts
    /// (a stop goes to them), at most [`TAKEN_COPIES_MAX`].
    pub(crate) taken: Mutex<HashMap<(AttemptKey, LeaseEpoch), String>>,
    /// Seconds from a shard asking for a commit to the store's answer
    /// (queueing, validation, the group's write and sync).
    pub(crate) commit_seconds: Histogram<{ WRITE_BUCKETS_SECONDS.len() }>,
    /// When each shard was restarted after a panic, within the last
    /// [`crate::shard::SHARD_RESTART_WINDOW_MS`] (see
    /// `crate::shard::restart_after_panic`).
    pub(crate) shard_restarts: Mutex<HashMap<ShardId, Vec<std::time::Instant>>>,
    /// Shards that panicked too often to be restarted: down until the
    /// engine restarts.
    pub(crate) shards_down: Mutex<std::collections::BTreeSet<ShardId>>,
    /// Shards whose oldest commit has gone unanswered too long, with the
    /// driver's account of it (see [`Engine::health`]).
    pub(crate) stalled: Mutex<BTreeMap<ShardId, StoreHealth>>,
}

/// The numbers `/metrics` shows of an engine (see [`Engine::stats`]).
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    /// What the shards this process runs counted since they started here
    /// (summed) and hold now.
    pub shards: keel_core::driver::ShardStats,
    /// Shards this process runs now.
    pub shards_owned: u64,
    /// Seconds from a shard asking for a commit to the store's answer.
    pub commit_seconds: HistogramSnapshot,
    /// What the store's writer counted, where it counts.
    pub writer: Option<WriterSnapshot>,
}

/// Copies of attempts taken by other processes whose taker is remembered,
/// at most: past it a stop reaches only copies run here (the others end
/// with their lease, and their results are refused as stale).
pub(crate) const TAKEN_COPIES_MAX: usize = 65_536;

impl Host {
    /// Delivers a message to a shard (a hand-off between live actors: their
    /// mailboxes never refuse it; at shutdown the store still holds the
    /// work, and the next start recovers it). A shard another process runs
    /// gets it through the relay; one nobody runs now, when its next owner
    /// takes it. A message lost on the way (a process killed) is sent again
    /// by the outbox until answered.
    pub(crate) fn send(&self, to: ShardId, message: Message) {
        match self.routes.local(to) {
            Some(addr) => addr.do_send(Feed(ShardInput::Message(message))),
            None => {
                self.routes
                    .relay(keel_storage::RelayTo::Shard(to.0), Wire::Message(message));
            }
        }
    }

    /// Asks the copy of an attempt with this lease epoch to stop, here or
    /// in the process that took it.
    pub(crate) fn stop_copy(&self, key: AttemptKey, epoch: LeaseEpoch) {
        if let Some(c) = self.copies.lock().get(&(key, epoch)) {
            c.raise();
        }
        if let Some(by) = self.taken.lock().remove(&(key, epoch)) {
            self.routes
                .relay(RelayTo::Process(by), Wire::Stop { key, epoch });
        }
    }

    /// Runs an attempt of shard `shard` (whose actor is `actor`): here when
    /// this process runs its activity type and has room for a copy (the
    /// cheap path: no round trip through the store), else, with attempts
    /// anywhere, through the relay for whichever process takes it (here
    /// after all if the relay is full).
    pub(crate) fn run_attempt(
        host: &Arc<Host>,
        shard: ShardId,
        actor: Addr<ShardActor>,
        order: AttemptOrder,
    ) {
        let runs_here = host.activities.get(&order.activity_type).is_some()
            && host.copies.lock().len() < host.copies_max;
        let order = if host.attempts_anywhere && !runs_here {
            let to = RelayTo::Work(order.activity_type.clone());
            match host.routes.try_relay(to, Wire::Attempt { shard, order }) {
                Ok(()) => return,
                // The relay is full: run it here if this process can, else
                // its lease's end redelivers it.
                Err(refused) => match *refused {
                    Wire::Attempt { order, .. }
                        if host.activities.get(&order.activity_type).is_some() =>
                    {
                        order
                    }
                    _ => return,
                },
            }
        } else {
            order
        };
        crate::attempts::run(
            host,
            ReportTo::Actor(actor),
            order,
            crate::attempts::Caller::ShardThread,
        );
    }

    /// Reports a copy's input to shard `shard`: to its actor when it runs
    /// here, else through the relay to whichever process owns it.
    pub(crate) fn report(&self, shard: ShardId, input: ShardInput) {
        match self.routes.local(shard) {
            Some(addr) => addr.do_send(Feed(input)),
            None => {
                if let Some(report) = Report::of(input) {
                    self.routes
                        .relay(RelayTo::Shard(shard.0), Wire::Report(report));
                }
            }
        }
    }

    /// Tells shard `shard`, in another process, that this process took a
    /// copy of its attempt.
    pub(crate) fn report_taken(&self, shard: ShardId, taken: Report) {
        self.routes
            .relay(RelayTo::Shard(shard.0), Wire::Report(taken));
    }

    /// A report from a copy another process runs: remembered (a taker)
    /// or forgotten (a result), and passed on to the shard's actor.
    pub(crate) fn reported(&self, actor: &Addr<ShardActor>, report: Report) {
        let copy = report.copy();
        match report {
            Report::Taken { by, .. } => {
                let mut taken = self.taken.lock();
                if taken.len() < TAKEN_COPIES_MAX {
                    taken.insert(copy, by);
                } else {
                    tracing::warn!(limit = TAKEN_COPIES_MAX, "too many copies taken by other processes to remember; a stop reaches only this process's");
                }
            }
            other => {
                if !matches!(other, Report::Heartbeat { .. }) {
                    self.taken.lock().remove(&copy);
                }
                if let Some(input) = other.into_input() {
                    actor.do_send(Feed(input));
                }
            }
        }
    }
}

/// Where a copy of an attempt reports: the actor of its shard (it runs in
/// the shard's process), or the shard wherever it runs (taken from the
/// relay).
#[derive(Clone)]
pub(crate) enum ReportTo {
    Actor(Addr<ShardActor>),
    Shard(ShardId),
}

impl ReportTo {
    pub(crate) fn send(&self, host: &Host, input: ShardInput) {
        match self {
            ReportTo::Actor(addr) => addr.do_send(Feed(input)),
            ReportTo::Shard(shard) => host.report(*shard, input),
        }
    }
}

/// This process's name among the engine processes sharing a store:
/// machine, process id and a random part (a restarted process is a new
/// member).
fn member_name(seed: u64) -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}:{:06x}", std::process::id(), seed & 0xff_ffff)
}

/// A running engine. Dropping it shuts it down; in async code prefer
/// [`Engine::shutdown`].
pub struct Engine {
    host: Option<Arc<Host>>,
    client: Arc<ClientCore>,
    /// The member thread, on a store several engine processes share.
    cluster: Option<ClusterHandle>,
    system: Option<actix::System>,
    thread: Option<std::thread::JoinHandle<()>>,
    activity_rt: Option<tokio::runtime::Runtime>,
    readers: Option<Readers>,
    workflows: WorkflowRegistry,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("workflows", &self.workflows)
            .finish()
    }
}

impl Engine {
    /// A builder with nothing registered.
    pub fn builder() -> EngineBuilder {
        EngineBuilder {
            data_dir: None,
            postgres: None,
            store: None,
            workflows: WorkflowRegistry::new(),
            activities: ActivityRegistry::new(),
            config: EngineConfig::default(),
            profiles: BTreeMap::new(),
        }
    }

    fn start(
        store: Arc<dyn Store>,
        workflows: WorkflowRegistry,
        activities: ActivityRegistry,
        config: EngineConfig,
        profiles: BTreeMap<String, Arc<CompiledPipeline<Failure>>>,
    ) -> Result<Self, EngineError> {
        let shards = config.shards.clamp(1, usize::from(u16::MAX));
        // Processes sharing a store must spread runs over the same shards,
        // or two of them would own one run.
        if let Some(shared) = store.shared() {
            shared.agree_shard_count(shards as u16)?;
        }
        let activity_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.activity_threads.max(1))
            .thread_name("keel-activity")
            .enable_all()
            .build()
            .map_err(keel_storage::Error::from)?;
        let (reads, readers) =
            Readers::start(activity_rt.handle().clone()).map_err(keel_storage::Error::from)?;
        let clock = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        // Lease epochs only grow, across restarts too: start from the clock.
        let epoch_base = clock.as_micros() as u64;
        let seed = clock.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32);
        // On a store several engine processes share, this process runs the
        // shards it holds leases for, and reaches the others through the
        // store's relay.
        let shared = store.shared().is_some();
        let name = member_name(seed);
        let (relay, outgoing) = if shared {
            let (tx, rx) = crossbeam_channel::bounded(crate::routes::RELAY_QUEUE_MAX);
            let link = RelayLink {
                name: name.clone(),
                tx,
            };
            (Some(link), Some(rx))
        } else {
            (None, None)
        };
        let routes = Arc::new(Routes::new(shards as u16, relay));
        let client = Arc::new(ClientCore::new(
            seed,
            routes.clone(),
            store.clone(),
            reads.clone(),
        ));
        let host = Arc::new(Host {
            store,
            activities,
            profiles,
            activity_rt: activity_rt.handle().clone(),
            reads,
            routes,
            client: client.clone(),
            shard_lease_ms: config.shard_lease_ms,
            copies: Mutex::new(HashMap::new()),
            slow_first_polls: Mutex::new(std::collections::HashSet::new()),
            attempts_anywhere: shared && config.attempts_anywhere,
            copies_max: config.worker_concurrency_max.max(1),
            taken: Mutex::new(HashMap::new()),
            commit_seconds: Histogram::new(&WRITE_BUCKETS_SECONDS),
            shard_restarts: Mutex::new(HashMap::new()),
            shards_down: Mutex::new(std::collections::BTreeSet::new()),
            stalled: Mutex::new(BTreeMap::new()),
        });
        let driver = DriverConfig {
            shards: shards as u16,
            run_cache_max: (config.run_cache_max / shards).max(1),
            lease_ms_default: config.lease_ms_default,
            worker_concurrency_max: (config.worker_concurrency_max / shards).max(1),
            timers_in_memory_max: (config.timers_in_memory_max / shards).max(1),
            intents_in_memory_max: (config.intents_in_memory_max / shards).max(1),
            profiles: host.profiles.clone(),
            shard_lease_ms: config.shard_lease_ms,
            commit_stall_ms: config.commit_stall_ms.max(1),
            breaks: None,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let h2 = host.clone();
        let (w2, d2) = (workflows.clone(), driver.clone());
        let thread = std::thread::Builder::new()
            .name("keel-engine".into())
            .spawn(move || {
                let sys = actix::System::new();
                let arbiters: Vec<Arbiter> = (0..shards).map(|_| Arbiter::new()).collect();
                if !shared {
                    // Alone on its store: every shard runs here.
                    for (i, a) in arbiters.iter().enumerate() {
                        let (workflows, config) = (w2.clone(), d2.clone());
                        let host = h2.clone();
                        // Built on its arbiter: a shard holds run machines,
                        // which stay on one thread.
                        let addr = ShardActor::start_in_arbiter(&a.handle(), move |_| {
                            let shard =
                                Shard::new(ShardId(i as u16), workflows, config, epoch_base);
                            ShardActor::new(shard, host, 0)
                        });
                        let local = Local {
                            addr,
                            fence: None,
                            generation: 0,
                        };
                        h2.routes.set(ShardId(i as u16), local);
                    }
                }
                drop(h2);
                let handles: Vec<ArbiterHandle> = arbiters.iter().map(Arbiter::handle).collect();
                let _ = tx.send((actix::System::current(), handles));
                sys.run().ok();
                for a in arbiters {
                    a.stop();
                    let _ = a.join();
                }
            })
            .map_err(keel_storage::Error::from)?;
        let (system, arbiters) = rx.recv().map_err(|_| EngineError::Shutdown)?;
        let cluster = match outgoing {
            Some(outgoing) => Some(
                Member {
                    host: host.clone(),
                    name,
                    workflows: workflows.clone(),
                    driver,
                    arbiters,
                    outgoing,
                    work: if host.attempts_anywhere {
                        host.activities
                            .names()
                            .map(|t| RelayTo::Work(t.to_string()))
                            .collect()
                    } else {
                        Vec::new()
                    },
                }
                .spawn()
                .map_err(keel_storage::Error::from)?,
            ),
            None => None,
        };
        Ok(Engine {
            host: Some(host),
            client,
            cluster,
            system: Some(system),
            thread: Some(thread),
            activity_rt: Some(activity_rt),
            readers: Some(readers),
            workflows,
        })
    }

    /// The shards running in this process now.
    fn local_shards(&self) -> Vec<Addr<ShardActor>> {
        self.host.as_ref().map_or_else(Vec::new, |h| {
            h.routes
                .all_local()
                .into_iter()
                .map(|(_, l)| l.addr)
                .collect()
        })
    }

    /// Whether this process shares its store with other engine processes,
    /// and which shards it runs now.
    pub fn shards_here(&self) -> Vec<u16> {
        self.host.as_ref().map_or_else(Vec::new, |h| {
            h.routes.all_local().iter().map(|(s, _)| s.0).collect()
        })
    }

    /// The workflows this engine runs: the code a replay of its histories
    /// is checked against (`keel::Replayer::new(engine.workflows().clone())`).
    pub fn workflows(&self) -> &WorkflowRegistry {
        &self.workflows
    }

    /// A client for this engine.
    pub fn client(&self) -> Client {
        Client {
            core: self.client.clone(),
        }
    }

    /// The store (for inspection and tests). Holding it past the engine's
    /// shutdown keeps the data directory open.
    pub fn store(&self) -> Arc<dyn Store> {
        self.host
            .as_ref()
            .map(|h| h.store.clone())
            .expect("the store is open while the engine runs")
    }

    /// Whether the engine's store accepts writes. After
    /// [`StoreHealth::Failed`] the engine has stopped serving (every call
    /// ends with [`EngineError::StoreUnavailable`]): shut it down and exit
    /// non-zero. While [`StoreHealth::Stopped`], calls that need a commit
    /// fail fast and the engine goes on by itself once the cause is gone.
    /// A store that reports itself healthy is still `Stopped` with
    /// [`keel_storage::WriteFault::Stalled`] while a shard's commit has gone
    /// unanswered longer than [`EngineConfig::commit_stall_ms`] (a hung
    /// disk, a database that answers nothing).
    pub fn health(&self) -> StoreHealth {
        let Some(host) = &self.host else {
            return StoreHealth::default();
        };
        let health = host.store.health();
        if !health.is_healthy() {
            return health;
        }
        let stalled = host.stalled.lock().values().next().cloned();
        stalled.unwrap_or(health)
    }

    /// Shards of this engine that panicked more often than it restarts
    /// them ([`crate::shard::SHARD_RESTARTS_MAX`] within
    /// [`crate::shard::SHARD_RESTART_WINDOW_MS`]): their runs wait until the
    /// engine restarts. A shard that panicked fewer times is started again
    /// after a short wait, and is not listed.
    pub fn shards_down(&self) -> Vec<ShardId> {
        self.host
            .as_ref()
            .map(|h| h.shards_down.lock().iter().copied().collect())
            .unwrap_or_default()
    }

    /// The numbers `/metrics` shows: what the shards this process runs
    /// counted (summed over them) and hold now, how long commits took as
    /// the shards saw them, and what the store's writer counted.
    pub async fn stats(&self) -> EngineStats {
        let mut stats = EngineStats::default();
        for s in self.local_shards() {
            if let Ok(one) = s.send(Stats).await {
                stats.shards.merge(&one);
                stats.shards_owned += 1;
            }
        }
        if let Some(h) = &self.host {
            stats.commit_seconds = h.commit_seconds.snapshot();
            stats.writer = h.store.writer_stats();
        }
        stats
    }

    /// Stops: every waiting call (a `result()` too) ends with
    /// [`EngineError::Shutdown`], the actors stop, and the store is closed
    /// (its writer answers every commit it queued), so the data directory
    /// can be opened again at once, whatever [`Client`]s still live.
    pub async fn shutdown(mut self) {
        self.stop_shards_async().await;
        let (tx, rx) = futures::channel::oneshot::channel();
        let mut parts = self.take_parts();
        std::thread::spawn(move || {
            parts.finish();
            let _ = tx.send(());
        });
        let _ = rx.await;
    }

    /// [`Engine::shutdown`] for code that is not async: blocks until the
    /// engine stopped and its store is closed.
    pub fn shutdown_blocking(mut self) {
        self.client.shut_down();
        // No shard is taken from now on; the ones here stop and give
        // their leases back.
        if let Some(c) = &self.cluster {
            c.quiesce();
        }
        {
            for s in self.local_shards() {
                // Waits for the shard to answer its clients; a stopped
                // shard answers nothing, which is the same.
                let _ = futures::executor::block_on(s.send(Stop));
            }
        }
        let mut parts = self.take_parts();
        std::thread::spawn(move || parts.finish()).join().ok();
    }

    async fn stop_shards_async(&self) {
        self.client.shut_down();
        // No shard is taken from now on; the ones here stop and give
        // their leases back.
        if let Some(c) = &self.cluster {
            c.quiesce();
        }
        {
            for s in self.local_shards() {
                let _ = s.send(Stop).await;
            }
        }
    }

    fn take_parts(&mut self) -> Parts {
        Parts {
            cluster: self.cluster.take(),
            system: self.system.take(),
            thread: self.thread.take(),
            activity_rt: self.activity_rt.take(),
            host: self.host.take(),
            readers: self.readers.take(),
        }
    }
}

/// What stopping an engine takes apart, in order.
struct Parts {
    cluster: Option<ClusterHandle>,
    system: Option<actix::System>,
    thread: Option<std::thread::JoinHandle<()>>,
    activity_rt: Option<tokio::runtime::Runtime>,
    host: Option<Arc<Host>>,
    readers: Option<Readers>,
}

impl Parts {
    fn finish(&mut self) {
        // The answers queued for other processes' clients go out; then
        // nothing takes shards or notes any more.
        if let Some(mut c) = self.cluster.take() {
            c.stop();
        }
        if let Some(sys) = self.system.take() {
            sys.stop();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(rt) = self.activity_rt.take() {
            // Activity code still running is dropped at its next await (a
            // copy that never yields is left behind after the limit), so
            // nothing holds the store when it closes below. Inside an async
            // runtime (a drop in async code) nothing may block: it is left
            // to finish in the background.
            if tokio::runtime::Handle::try_current().is_ok() {
                rt.shutdown_background();
            } else {
                rt.shutdown_timeout(std::time::Duration::from_millis(ACTIVITY_SHUTDOWN_MS));
            }
        }
        // The shards are stopped, so nothing queues reads any more: the
        // queued ones finish (their answers go nowhere) and no reader holds
        // the store after this.
        if let Some(readers) = self.readers.take() {
            readers.join();
        }
        if let Some(host) = self.host.take() {
            let _ = host.store.sync();
            if let Err(e) = host.store.flush_log() {
                tracing::warn!(error = %e, "moving the log into tables at shutdown failed; the next open replays it");
            }
            // The last reference: the store closes here (its writer drains).
            drop(host);
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.system.is_none() {
            return; // shut down already
        }
        self.client.shut_down();
        // No shard is taken from now on; the ones here stop and give
        // their leases back.
        if let Some(c) = &self.cluster {
            c.quiesce();
        }
        {
            for s in self.local_shards() {
                s.do_send(Stop);
            }
        }
        let mut parts = self.take_parts();
        parts.finish();
    }
}
