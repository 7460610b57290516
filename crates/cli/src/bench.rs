//! `keel bench`: measurements on this machine (never timed tests).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Subcommand;
use keel::{
    Activity, ActivityContext, ActivityError, Engine, Workflow, WorkflowContext, WorkflowError,
};
use serde::Serialize;

use crate::output::{max_rss_mb, percentile, progress};

#[path = "bench_cluster.rs"]
mod bench_cluster;
#[path = "bench_pg.rs"]
mod bench_pg;
#[path = "bench_serve.rs"]
mod bench_serve;
#[path = "bench_store.rs"]
mod bench_store;

/// Benchmarks.
#[derive(Subcommand, Debug)]
pub(crate) enum BenchCommand {
    /// W1: N workflows of 3 sequential no-op activities, Sync durability.
    W1(W1Args),
    /// (internal) One engine process of `w1 --processes N`.
    #[command(hide = true)]
    W1Process(bench_cluster::W1ProcessArgs),
    /// W2: one workflow fanning out to N no-op activities (`all`, or
    /// `all_limited` with `--limit`).
    W2(crate::bench_fanout::W2Args),
    /// Memory per run of N runs waiting on a signal, cached or passivated.
    Idle(crate::bench_fanout::IdleArgs),
    /// One run's history grown to N events: what one more event costs at
    /// each length (a long history must cost no more per event).
    History(crate::bench_history::HistoryArgs),
    /// An engine reopened over N runs waiting on signals (some on timers
    /// too): time to accept a new start, to complete a signalled run, and
    /// memory over an empty directory.
    Restart(crate::bench_restart::RestartArgs),
    /// (internal) The reopening process of `restart`.
    #[command(hide = true)]
    RestartOpen(crate::bench_restart::RestartOpenArgs),
    /// Storage only: commits/s and latency of concurrent committers, Sync
    /// and Buffered, beside the disk's own fsync rate.
    Append(bench_store::AppendArgs),
    /// Storage only: events/s decoded offline from a 1M-event log.
    Read(bench_store::ReadArgs),
    /// Offline replay: events/s replaying a ~1M-event log with the Replayer.
    Replay(keel_cli::replay_bench::ReplayBenchArgs),
    /// Time to the first event line of `keel show` on a 100,000-event history.
    Show(keel_cli::replay_bench::ShowBenchArgs),
    /// Kill the engine process over and over (SIGKILL, from directory
    /// creation to mid-commit); after each kill the directory must open,
    /// and after each round every workflow must complete exactly once.
    Torture(crate::bench_torture::TortureArgs),
    /// `keel serve` over real HTTP: describe and list latency over a store
    /// of N runs, and what a scraper of /metrics costs W1.
    Serve(bench_serve::ServeBenchArgs),
}

pub(crate) fn run(cmd: BenchCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCommand::W1(args) => w1(args),
        BenchCommand::W1Process(args) => bench_cluster::w1_process(args),
        BenchCommand::W2(args) => crate::bench_fanout::w2(args),
        BenchCommand::Idle(args) => crate::bench_fanout::idle(args),
        BenchCommand::History(args) => crate::bench_history::history(args),
        BenchCommand::Restart(args) => crate::bench_restart::restart(args),
        BenchCommand::RestartOpen(args) => crate::bench_restart::restart_open(args),
        BenchCommand::Append(args) => bench_store::append(args),
        BenchCommand::Read(args) => bench_store::read(args),
        BenchCommand::Replay(args) => keel_cli::replay_bench::replay(args),
        BenchCommand::Show(args) => keel_cli::replay_bench::show(args),
        BenchCommand::Torture(args) => crate::bench_torture::torture(args),
        BenchCommand::Serve(args) => bench_serve::serve(args),
    }
}

/// Arguments of `keel bench w1`.
#[derive(clap::Args, Debug)]
pub(crate) struct W1Args {
    /// Workflows to run.
    #[arg(long, default_value_t = 10_000)]
    workflows: u64,
    /// Workflows in flight at once (closed loop).
    #[arg(long, default_value_t = 200)]
    concurrency: usize,
    /// Start workflows open-loop at this many per second instead.
    #[arg(long)]
    rate: Option<f64>,
    /// Run on a PostgreSQL database (`postgres://user:password@host:port/db`)
    /// instead of RocksDB in a temporary directory; the run uses a schema
    /// of its own and drops it afterwards.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// With `--store`: this many engine processes share the database, each
    /// a child process running its share of the shards and of the
    /// workflows (1: one engine in this process, the database its own).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// With `--processes` of 2 or more: SIGKILL one of them a third of the
    /// way through and report how long the others took to take its shards
    /// over, and the latency of the workflows in flight meanwhile.
    #[arg(long)]
    kill_one: bool,
    /// Acknowledge commits before they are synced (`Durability::Buffered`):
    /// beside a default run, what the workload costs without waiting for
    /// the disk.
    #[arg(long)]
    buffered: bool,
    /// Start every attempt on the activity pool, as an activity that does
    /// not declare itself non-blocking would (the default no-op declares
    /// it, so a shard polls its attempts first where it dispatches them).
    #[arg(long)]
    on_pool: bool,
    /// Start each workflow, then ask for its result: two requests and two
    /// answers, where the default `Client::execute` makes one of each
    /// (runs with `--processes` always make the two calls).
    #[arg(long)]
    start_then_result: bool,
    /// Run this many workflows first, at concurrency 200, and measure only
    /// what follows: an engine in its steady state. The first two
    /// write-ahead logs of every open grow as they are written, which
    /// costs each sync an inode write; from the second flush of the
    /// memtables on (about 16 MiB of log, some 8,000 W1 workflows) RocksDB
    /// writes over recycled logs instead.
    #[arg(long, default_value_t = 0, value_name = "WORKFLOWS")]
    warm_up: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Workflows in flight during `keel bench w1 --warm-up`.
const W1_WARM_UP_CONCURRENCY: u64 = 200;

/// The no-op activity every engine benchmark uses. It neither blocks nor
/// waits, and says so: its attempts are polled first on the shard thread
/// that dispatches them.
#[derive(Default)]
pub(crate) struct Noop;
impl Activity for Noop {
    const NAME: &'static str = "bench.noop";
    type Input = u32;
    type Output = u32;
    const NON_BLOCKING: bool = true;
    async fn run(&self, _ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        Ok(i + 1)
    }
}

/// The same no-op under the same name, without the declaration: every
/// attempt starts on the activity pool (`keel bench w1 --on-pool`).
#[derive(Default)]
struct PooledNoop;
impl Activity for PooledNoop {
    const NAME: &'static str = Noop::NAME;
    type Input = u32;
    type Output = u32;
    async fn run(&self, ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        Noop.run(ctx, i).await
    }
}

pub(crate) struct ThreeSteps;
impl Workflow for ThreeSteps {
    const NAME: &'static str = "bench.w1";
    type Input = u32;
    type Output = u32;
    async fn run(ctx: WorkflowContext, i: u32) -> Result<u32, WorkflowError> {
        let a = ctx.activity::<Noop>(i).await?;
        let b = ctx.activity::<Noop>(a).await?;
        Ok(ctx.activity::<Noop>(b).await?)
    }
}

#[derive(Serialize)]
struct W1Report {
    workload: String,
    workflows: u64,
    concurrency: Option<usize>,
    rate: Option<f64>,
    workflows_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    wall_s: f64,
    events: u64,
    events_per_s: f64,
    max_rss_mb: f64,
    store: &'static str,
    /// Engine processes (each its own OS process when more than one).
    processes: usize,
    /// What the database server did (PostgreSQL runs).
    server: Option<bench_pg::ServerLoad>,
    /// With `--kill-one`: how the killed process's shards moved.
    takeover: Option<bench_cluster::Takeover>,
    /// What the store's writer did (one-process runs): how commits were
    /// grouped and how long each group's write and sync took.
    writer: Option<WriterLoad>,
    /// The disk under the data directory, measured in the same run
    /// (RocksDB only).
    disk: Option<DiskSync>,
}

/// What one commit of a lone committer is bound by: the data directory's
/// disk syncing an appended record, measured just before and just after
/// the workload (the disk's speed drifts through a day).
#[derive(Serialize)]
struct DiskSync {
    /// Median `write` + `fdatasync` of a 64-byte append.
    fsync_p50_ms: f64,
    /// The workflows' median latency over the syncs their commits need
    /// (`p50_ms / (commits per workflow x fsync_p50_ms)`): 1.0 would be a
    /// workflow that costs nothing but its syncs. Meaningful at
    /// concurrency 1, where no commit shares a sync.
    p50_over_syncs: f64,
    /// The same median over the commits as the store answered them
    /// (`p50_ms / (commits per workflow x commit_ms_mean)`): what the
    /// engine adds to its commits (running the workflow, dispatching and
    /// completing its activities, the hand-offs between threads), apart
    /// from what a commit costs beyond its sync (the write-ahead log's
    /// write, the memtable, validation).
    p50_over_commits: f64,
}

/// How long the disk is probed before and after a W1 run, each time.
const W1_FSYNC_PROBE_MS: u64 = 500;

/// The store writer's work during a run, from the engine's own counters.
#[derive(Serialize)]
struct WriterLoad {
    commits: u64,
    commits_per_workflow: f64,
    groups: u64,
    groups_per_s: f64,
    commits_per_group: f64,
    /// Mean time to write and sync one group.
    write_sync_ms_mean: f64,
    /// Share of the wall time the writer spent writing and syncing: near
    /// 100 % the sync is the bottleneck (and groups should grow), well
    /// below it the work reaches the writer too slowly to fill groups.
    writer_busy_percent: f64,
    /// Share of the wall time the writer waited with no commit queued:
    /// near 0 the writer is the bottleneck, well above it the work reaches
    /// it too slowly (RocksDB only).
    writer_idle_percent: f64,
    /// Share of the wall time the writer spent validating groups against
    /// the store before writing them (RocksDB only).
    writer_validate_percent: f64,
    /// Mean time from a shard asking for a commit to its answer.
    commit_ms_mean: f64,
}

/// The writer's cumulative counters a [`WriterLoad`] is computed from.
#[derive(Clone, Copy, Default)]
struct WriterCounters {
    commits: u64,
    groups: u64,
    group_commits_sum: f64,
    writes: u64,
    write_seconds: f64,
    idle_seconds: f64,
    validate_seconds: f64,
    commits_answered: u64,
    commit_seconds: f64,
}

impl WriterCounters {
    fn of(stats: &keel::EngineStats) -> Option<WriterCounters> {
        let w = stats.writer.as_ref()?;
        Some(WriterCounters {
            commits: w.commits,
            groups: w.group_commits.count,
            group_commits_sum: w.group_commits.sum,
            writes: w.write_seconds.count,
            write_seconds: w.write_seconds.sum,
            idle_seconds: w.idle_seconds,
            validate_seconds: w.validate_seconds,
            commits_answered: stats.commit_seconds.count,
            commit_seconds: stats.commit_seconds.sum,
        })
    }
}

impl WriterLoad {
    /// The writer's load between two readings of the counters (`before`
    /// the measured part, after a warm-up; zero for a whole run).
    fn between(
        before: WriterCounters,
        after: WriterCounters,
        workflows: u64,
        wall_s: f64,
    ) -> WriterLoad {
        let per = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let commits = after.commits.saturating_sub(before.commits);
        let groups = after.groups.saturating_sub(before.groups);
        let writes = after.writes.saturating_sub(before.writes) as f64;
        let write_seconds = after.write_seconds - before.write_seconds;
        let answered = after
            .commits_answered
            .saturating_sub(before.commits_answered) as f64;
        WriterLoad {
            commits,
            commits_per_workflow: per(commits as f64, workflows as f64),
            groups,
            groups_per_s: per(groups as f64, wall_s),
            commits_per_group: per(
                after.group_commits_sum - before.group_commits_sum,
                groups as f64,
            ),
            write_sync_ms_mean: per(write_seconds * 1000.0, writes),
            writer_busy_percent: per(write_seconds * 100.0, wall_s),
            writer_idle_percent: per((after.idle_seconds - before.idle_seconds) * 100.0, wall_s),
            writer_validate_percent: per(
                (after.validate_seconds - before.validate_seconds) * 100.0,
                wall_s,
            ),
            commit_ms_mean: per(
                (after.commit_seconds - before.commit_seconds) * 1000.0,
                answered,
            ),
        }
    }
}

/// The client tasks of a W1 run, joined as the run goes: a finished
/// task's memory (its future, about 3.5 KB in the `bench` profile) stays
/// until its handle is joined, and holding every handle to the end made a
/// run's max RSS grow with the number of workflows: the harness, not the
/// engine (BENCHMARKS.md, "the harness, not the engine").
pub(crate) struct ClientTasks<T> {
    running: tokio::task::JoinSet<Result<T, keel::EngineError>>,
    done: Vec<T>,
}

impl<T: Send + 'static> ClientTasks<T> {
    pub(crate) fn new(expected: u64) -> Self {
        ClientTasks {
            running: tokio::task::JoinSet::new(),
            done: Vec::with_capacity(expected as usize),
        }
    }

    /// Spawns `task` and joins every task finished by now.
    pub(crate) fn spawn(
        &mut self,
        task: impl std::future::Future<Output = Result<T, keel::EngineError>> + Send + 'static,
    ) -> anyhow::Result<()> {
        self.running.spawn(task);
        while let Some(finished) = self.running.try_join_next() {
            self.done.push(finished??);
        }
        Ok(())
    }

    /// Waits for the rest; every task's output, in the order they finished.
    pub(crate) async fn finish(mut self) -> anyhow::Result<Vec<T>> {
        while let Some(finished) = self.running.join_next().await {
            self.done.push(finished??);
        }
        Ok(self.done)
    }
}

/// Runs `one(i)` for every `i` in `0..total`, `lanes` of them at a time:
/// each lane is a task that takes the next index when its last one ends,
/// as a pool of clients would. Outputs come in no particular order.
///
/// A closed loop without a spawner: one task per workflow behind a
/// semaphore woke the thread that spawned them once per workflow, a cost
/// of the benchmark's own that W1 paid on the engine's two cores.
pub(crate) async fn closed_loop<T, F, Fut>(lanes: u64, total: u64, one: F) -> anyhow::Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<T, keel::EngineError>> + Send,
{
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let one = Arc::new(one);
    let mut lanes_running = tokio::task::JoinSet::new();
    for _ in 0..lanes.clamp(1, total.max(1)) {
        let (next, one) = (next.clone(), one.clone());
        lanes_running.spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= total {
                    return Ok::<_, keel::EngineError>(out);
                }
                out.push(one(i).await?);
            }
        });
    }
    let mut done = Vec::with_capacity(total as usize);
    while let Some(lane) = lanes_running.join_next().await {
        done.extend(lane??);
    }
    Ok(done)
}

fn w1(args: W1Args) -> anyhow::Result<ExitCode> {
    if args.processes > 1 {
        anyhow::ensure!(
            args.warm_up == 0,
            "--warm-up runs with one process (--processes 1)"
        );
        return w1_cluster(args);
    }
    anyhow::ensure!(!args.kill_one, "--kill-one needs --processes 2 or more");
    let dir = tempfile::Builder::new().prefix("keel-bench-w1").tempdir()?;
    let postgres = match &args.store {
        Some(url) if keel_storage::pg::is_postgres_url(url) => Some(
            keel_storage::PgOptions::new(url)
                .schema(format!("bench_w1_{}", std::process::id()))
                .lease_wait_ms(0),
        ),
        Some(other) => anyhow::bail!("--store takes a postgres:// URL, not {other:?}"),
        None => None,
    };
    let builder = match &postgres {
        Some(options) => Engine::builder().postgres_options(options.clone()),
        None => Engine::builder().data_dir(dir.path()),
    };
    let before = postgres
        .as_ref()
        .map(bench_pg::ServerCounters::read)
        .transpose()?;
    let probe = Duration::from_millis(W1_FSYNC_PROBE_MS);
    let mut fsyncs_ms = match postgres {
        Some(_) => Vec::new(),
        None => bench_store::fsync_times_ms(dir.path(), probe)?,
    };
    let durability = if args.buffered {
        keel::Durability::Buffered
    } else {
        keel::Durability::Sync
    };
    let builder = builder
        .durability(durability)
        .register_workflow::<ThreeSteps>();
    let engine = if args.on_pool {
        builder.register_activity::<PooledNoop>()
    } else {
        builder.register_activity::<Noop>()
    }
    .build()?;
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if args.warm_up > 0 {
        let bar = progress(args.warm_up, "w1 warm-up");
        let (warm_client, warm_bar) = (client.clone(), bar.clone());
        rt.block_on(closed_loop(
            W1_WARM_UP_CONCURRENCY,
            args.warm_up,
            move |i| {
                let (client, bar) = (warm_client.clone(), warm_bar.clone());
                async move {
                    let id = format!("w1-warm-up-{i}");
                    client.execute::<ThreeSteps>(&id, &(i as u32)).await?;
                    bar.inc(1);
                    Ok(())
                }
            },
        ))?;
        bar.finish_and_clear();
    }
    let counted_from = WriterCounters::of(&rt.block_on(engine.stats())).unwrap_or_default();
    let bar = progress(args.workflows, "w1");
    let started = Instant::now();
    let latencies: Vec<f64> = rt.block_on(async {
        let two_calls = args.start_then_result;
        let one = {
            let (client, bar) = (client.clone(), bar.clone());
            move |i: u64| {
                let (client, bar) = (client.clone(), bar.clone());
                async move {
                    let t0 = Instant::now();
                    let id = format!("w1-{i}");
                    if two_calls {
                        client.start::<ThreeSteps>(&id, &(i as u32)).await?;
                        client.result::<ThreeSteps>(&id).await?;
                    } else {
                        client.execute::<ThreeSteps>(&id, &(i as u32)).await?;
                    }
                    bar.inc(1);
                    Ok::<f64, keel::EngineError>(t0.elapsed().as_secs_f64() * 1000.0)
                }
            }
        };
        let Some(rate) = args.rate else {
            return closed_loop(args.concurrency as u64, args.workflows, one).await;
        };
        let mut tasks = ClientTasks::new(args.workflows);
        let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1e-3)));
        for i in 0..args.workflows {
            ticker.tick().await;
            tasks.spawn(one(i))?;
        }
        tasks.finish().await
    })?;
    let wall = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let writer = WriterCounters::of(&rt.block_on(engine.stats()))
        .map(|now| WriterLoad::between(counted_from, now, args.workflows, wall));
    if postgres.is_none() {
        fsyncs_ms.extend(bench_store::fsync_times_ms(dir.path(), probe)?);
    }
    let server = match (&postgres, before) {
        (Some(options), Some(before)) => {
            // The statistics views lag by up to a second.
            std::thread::sleep(Duration::from_millis(1_100));
            let after = bench_pg::ServerCounters::read(options)?;
            Some(before.load_until(&after, wall))
        }
        _ => None,
    };
    let mut sorted = latencies;
    sorted.sort_by(|a, b| a.total_cmp(b));
    fsyncs_ms.sort_by(|a, b| a.total_cmp(b));
    let disk = match (&writer, fsyncs_ms.is_empty() || args.buffered) {
        (Some(w), false) => {
            let fsync_p50_ms = percentile(&fsyncs_ms, 0.50);
            let syncs_ms = w.commits_per_workflow * fsync_p50_ms;
            let commits_ms = w.commits_per_workflow * w.commit_ms_mean;
            let over = |ms: f64| {
                if ms > 0.0 {
                    percentile(&sorted, 0.50) / ms
                } else {
                    0.0
                }
            };
            Some(DiskSync {
                fsync_p50_ms,
                p50_over_syncs: over(syncs_ms),
                p50_over_commits: over(commits_ms),
            })
        }
        _ => None,
    };
    // Every W1 run commits the same 8 events: started, 3 x (scheduled,
    // completed), completed.
    let events = args.workflows * 8;
    let report = W1Report {
        workload: match args.rate {
            Some(r) => format!("w1 rate={r}/s"),
            None => format!("w1 concurrency={}", args.concurrency),
        } + if args.buffered { " buffered" } else { "" }
            + if args.on_pool { " on-pool" } else { "" }
            + if args.start_then_result {
                " start-then-result"
            } else {
                ""
            }
            + &if args.warm_up > 0 {
                format!(" after a warm-up of {}", args.warm_up)
            } else {
                String::new()
            },
        workflows: args.workflows,
        concurrency: args.rate.is_none().then_some(args.concurrency),
        rate: args.rate,
        workflows_per_s: args.workflows as f64 / wall,
        p50_ms: percentile(&sorted, 0.50),
        p99_ms: percentile(&sorted, 0.99),
        wall_s: wall,
        events,
        events_per_s: events as f64 / wall,
        max_rss_mb: max_rss_mb(),
        store: if postgres.is_some() {
            "postgres"
        } else {
            "rocksdb"
        },
        processes: 1,
        server,
        takeover: None,
        writer,
        disk,
    };
    engine.shutdown_blocking();
    if let Some(options) = &postgres {
        keel_storage::PgStore::drop_schema(options)?;
    }
    print_w1(&report, args.json)
}

/// `w1 --processes N`: the same workload over N engine processes sharing
/// one PostgreSQL database.
fn w1_cluster(args: W1Args) -> anyhow::Result<ExitCode> {
    let Some(url) = args
        .store
        .as_deref()
        .filter(|u| keel_storage::pg::is_postgres_url(u))
    else {
        anyhow::bail!(
            "--processes needs --store postgres://...: a data directory is opened by one process"
        );
    };
    anyhow::ensure!(
        args.rate.is_none(),
        "--processes runs closed-loop: drop --rate"
    );
    anyhow::ensure!(
        !args.buffered,
        "--buffered runs one process: drop --processes"
    );
    anyhow::ensure!(
        !args.on_pool,
        "--on-pool runs one process: drop --processes"
    );
    let run = bench_cluster::run(
        url,
        args.processes,
        args.workflows,
        args.concurrency,
        args.kill_one,
    )?;
    let events = run.workflows * 8;
    let report = W1Report {
        workload: format!(
            "w1 concurrency={} processes={}",
            args.concurrency, args.processes
        ),
        workflows: run.workflows,
        concurrency: Some(args.concurrency),
        rate: None,
        workflows_per_s: run.workflows as f64 / run.wall_s,
        p50_ms: percentile(&run.sorted_ms, 0.50),
        p99_ms: percentile(&run.sorted_ms, 0.99),
        wall_s: run.wall_s,
        events,
        events_per_s: events as f64 / run.wall_s,
        max_rss_mb: max_rss_mb(),
        store: "postgres",
        processes: args.processes,
        server: Some(run.server),
        takeover: run.takeover,
        writer: None,
        disk: None,
    };
    print_w1(&report, args.json)
}

fn print_w1(report: &W1Report, json: bool) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!(
            "{}: {} workflows in {:.2} s = {:.0} workflows/s, {:.0} events/s; latency p50 {:.2} ms, p99 {:.2} ms; max rss {:.0} MiB",
            report.workload, report.workflows, report.wall_s, report.workflows_per_s, report.events_per_s,
            report.p50_ms, report.p99_ms, report.max_rss_mb
        );
        if let Some(w) = &report.writer {
            println!(
                "store writer: {} commits ({:.1} per workflow) in {} groups ({:.0}/s, {:.1} commits each); write+sync {:.2} ms per group, busy {:.0} % of the run; commit answered in {:.2} ms on average",
                w.commits, w.commits_per_workflow, w.groups, w.groups_per_s, w.commits_per_group,
                w.write_sync_ms_mean, w.writer_busy_percent, w.commit_ms_mean
            );
            if w.writer_idle_percent > 0.0 || w.writer_validate_percent > 0.0 {
                println!(
                    "store writer's time: write+sync {:.0} %, validating {:.0} %, idle with nothing queued {:.0} %, the rest (taking, learning, answering) {:.0} %",
                    w.writer_busy_percent,
                    w.writer_validate_percent,
                    w.writer_idle_percent,
                    (100.0 - w.writer_busy_percent - w.writer_validate_percent - w.writer_idle_percent).max(0.0)
                );
            }
        }
        if let (Some(d), Some(w)) = (&report.disk, &report.writer) {
            // Beside other workflows a commit shares its sync: the ratio
            // says something only when each waits for its own.
            if report.concurrency == Some(1) {
                println!(
                    "disk: fsync p50 {:.3} ms (measured before and after the run); p50 / ({:.1} commits x fsync p50) = {:.2}x",
                    d.fsync_p50_ms, w.commits_per_workflow, d.p50_over_syncs
                );
                println!(
                    "of which: a commit as the store answered it took {:.2}x an fsync; p50 / ({:.1} commits x {:.3} ms) = {:.2}x is the engine's own share",
                    w.commit_ms_mean / d.fsync_p50_ms.max(f64::MIN_POSITIVE),
                    w.commits_per_workflow,
                    w.commit_ms_mean,
                    d.p50_over_commits
                );
            } else {
                println!(
                    "disk: fsync p50 {:.3} ms (measured before and after the run)",
                    d.fsync_p50_ms
                );
            }
        }
        if let Some(s) = &report.server {
            println!(
                "postgres: {:.0} WAL flushes/s, {:.0} WAL writes/s, {:.0} transactions/s, server CPU {:.2} cores",
                s.wal_flushes_per_s, s.wal_writes_per_s, s.transactions_per_s, s.server_cpu_cores
            );
        }
        if let Some(t) = &report.takeover {
            println!(
                "takeover: every shard held again {:.0} ms after the kill ({:.0} ms after the killed leases ended); {} workflows in flight meanwhile: p50 {:.0} ms, p99 {:.0} ms",
                t.kill_to_taken_ms, t.lease_end_to_taken_ms, t.workflows_during, t.p50_during_ms, t.p99_during_ms
            );
            println!(
                "the killed process's workflows: {} started, {} completed after the takeover; verify clean over {} runs",
                t.killed_started, t.killed_completed, t.verified_runs
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
