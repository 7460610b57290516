//! `keel bench restart`: an engine reopened over many open runs.
//!
//! Fills a data directory with `--runs` runs waiting on a signal, of which
//! `--timers` first wait on a durable timer due within the next hour and
//! the next `--tasks` first call an activity, and stops that engine. The
//! filling engine runs one activity at a time and that one never ends, so
//! the tasks are left in the store as pending attempts, due at once.
//! Then a fresh process (so its memory is its own) opens the directory
//! and measures how long until a new start is accepted, how long a waiting
//! run takes to complete once signalled, how long until every left-over
//! attempt completed, and its resident memory (at the end and the most it
//! was while the attempts ran); the same process over an empty directory
//! gives the baseline the memory is compared with.

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use keel::{
    Activity, ActivityContext, ActivityError, Engine, EngineConfig, Workflow, WorkflowContext,
    WorkflowError,
};
use serde::{Deserialize, Serialize};

use crate::output::progress;
use crate::output::rss_mb;

/// Starts in flight at once while filling.
const FILL_STARTS_IN_FLIGHT: usize = 512;

/// The longest a timer of the fill waits, ms: they are spread over it.
const FILL_TIMER_SPREAD_MS: u64 = 3_600_000;

/// How often the reopened engine's progress and memory are sampled while
/// the left-over attempts run, ms.
const DRAIN_SAMPLE_MS: u64 = 20;

/// The longest the reopened engine is given to complete the left-over
/// attempts, s.
const DRAIN_WAIT_S_MAX: u64 = 600;

/// Arguments of `keel bench restart`.
#[derive(clap::Args, Debug)]
pub(crate) struct RestartArgs {
    /// Runs left waiting on a signal.
    #[arg(long, default_value_t = 1_000_000)]
    runs: u64,
    /// Of those, how many wait on a timer first (spread over an hour).
    #[arg(long, default_value_t = 100_000)]
    timers: u64,
    /// Of those, how many (after the timers' runs) call an activity first,
    /// left pending in the store when the filling engine stops.
    #[arg(long, default_value_t = 0)]
    tasks: u64,
    /// Pending attempts (and outbox rows) the reopened engine reads per
    /// window, over all shards; a number above `--tasks` reads them all at
    /// once, as recovery did before it read in windows.
    #[arg(long, default_value_t = keel::driver::INTENTS_IN_MEMORY_MAX)]
    intents_window: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Arguments of the hidden `keel bench restart-open`.
#[derive(clap::Args, Debug)]
pub(crate) struct RestartOpenArgs {
    /// The data directory to open.
    #[arg(long)]
    data: std::path::PathBuf,
    /// The run to signal, if any.
    #[arg(long)]
    signal: Option<String>,
    /// Left-over attempts to wait for.
    #[arg(long, default_value_t = 0)]
    tasks: u64,
    /// Pending attempts read per window.
    #[arg(long, default_value_t = keel::driver::INTENTS_IN_MEMORY_MAX)]
    intents_window: usize,
}

/// What a waiting run does before it waits on the signal `go`.
#[derive(Serialize, Deserialize, Clone, Copy)]
enum Before {
    Nothing,
    Timer(u64),
    Activity,
}

/// Waits on a timer or an activity (if told to) and then on the signal
/// `go`.
struct Waiter;
impl Workflow for Waiter {
    const NAME: &'static str = "bench.waiter";
    type Input = Before;
    type Output = ();
    async fn run(ctx: WorkflowContext, before: Before) -> Result<(), WorkflowError> {
        match before {
            Before::Nothing => {}
            Before::Timer(ms) => {
                ctx.timer(Duration::from_millis(ms)).await;
            }
            Before::Activity => {
                ctx.activity::<Step>(()).await?;
            }
        }
        ctx.wait_signal::<()>("go").await?;
        Ok(())
    }
}

/// The activity a waiting run calls first. In the filling engine it never
/// ends (it is dropped when that engine stops); in the reopened one it
/// returns at once.
struct Step {
    stalls: bool,
}
impl Activity for Step {
    const NAME: &'static str = "bench.step";
    type Input = ();
    type Output = ();
    async fn run(&self, _ctx: ActivityContext, _: ()) -> Result<(), ActivityError> {
        if self.stalls {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// Completes at once: the new start after the restart.
struct Quick;
impl Workflow for Quick {
    const NAME: &'static str = "bench.quick";
    type Input = ();
    type Output = ();
    async fn run(_ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        Ok(())
    }
}

/// The engine over `dir`; a filling one runs one attempt at a time, and
/// that one stalls.
fn engine(dir: &std::path::Path, filling: bool, intents_window: usize) -> anyhow::Result<Engine> {
    let config = EngineConfig {
        worker_concurrency_max: if filling {
            1
        } else {
            EngineConfig::default().worker_concurrency_max
        },
        intents_in_memory_max: intents_window,
        ..EngineConfig::default()
    };
    Ok(Engine::builder()
        .data_dir(dir)
        .config(config)
        .register_workflow::<Waiter>()
        .register_workflow::<Quick>()
        .activity(Step { stalls: filling })
        .build()?)
}

/// What one reopening measured.
#[derive(Serialize, Deserialize, Debug)]
struct Reopened {
    /// From the start of the open until the engine was built, ms.
    open_ms: f64,
    /// From the start of the open until a new start was committed, ms.
    start_accepted_ms: f64,
    /// From the signal to the signalled run's completion, ms.
    signalled_done_ms: Option<f64>,
    /// Resident memory after both, MiB.
    rss_mb: f64,
    /// Durable timers the engine held in memory then (a window of them).
    timers_in_memory: u64,
    /// From the start of the open until every left-over attempt
    /// completed, ms.
    tasks_done_ms: Option<f64>,
    /// The most resident memory seen while they ran, MiB.
    peak_rss_mb: f64,
    /// The most attempts the engine held in memory at a sample.
    attempts_in_memory_max: u64,
}

#[derive(Serialize)]
struct RestartReport {
    runs: u64,
    timers: u64,
    tasks: u64,
    fill_s: f64,
    empty: Reopened,
    full: Reopened,
    /// `full.rss_mb - empty.rss_mb`.
    rss_growth_mb: f64,
    /// `full.peak_rss_mb - empty.peak_rss_mb`.
    peak_rss_growth_mb: f64,
}

pub(crate) fn restart(args: RestartArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(
        args.timers + args.tasks < args.runs,
        "--timers and --tasks together must leave at least one run waiting on the signal alone"
    );
    let empty_dir = tempfile::Builder::new()
        .prefix("keel-bench-restart")
        .tempdir()?;
    let full_dir = tempfile::Builder::new()
        .prefix("keel-bench-restart")
        .tempdir()?;

    // Fill: the first `timers` runs wait on a timer first, the next
    // `tasks` on an activity; the last run (neither) is the one the
    // reopened engine signals.
    let t0 = Instant::now();
    {
        let engine = engine(full_dir.path(), true, args.intents_window)?;
        let client = engine.client();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let bar = progress(args.runs, "runs started");
        rt.block_on(async {
            let mut starts = futures::stream::iter(0..args.runs)
                .map(|i| {
                    let client = client.clone();
                    async move {
                        let before = if i < args.timers {
                            Before::Timer(60_000 + i * 7919 % FILL_TIMER_SPREAD_MS)
                        } else if i < args.timers + args.tasks {
                            Before::Activity
                        } else {
                            Before::Nothing
                        };
                        client.start::<Waiter>(&format!("wait-{i}"), &before).await
                    }
                })
                .buffer_unordered(FILL_STARTS_IN_FLIGHT);
            while let Some(started) = starts.next().await {
                started?;
                bar.inc(1);
            }
            anyhow::Ok(())
        })?;
        bar.finish_and_clear();
        engine.shutdown_blocking();
    }
    let fill_s = t0.elapsed().as_secs_f64();

    let last = format!("wait-{}", args.runs - 1);
    let empty = reopen(empty_dir.path(), None, 0, args.intents_window)?;
    let full = reopen(
        full_dir.path(),
        Some(&last),
        args.tasks,
        args.intents_window,
    )?;
    let report = RestartReport {
        runs: args.runs,
        timers: args.timers,
        tasks: args.tasks,
        fill_s,
        rss_growth_mb: full.rss_mb - empty.rss_mb,
        peak_rss_growth_mb: full.peak_rss_mb - empty.peak_rss_mb,
        empty,
        full,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{} runs waiting ({} on timers first, {} on left-over attempts), filled in {:.1} s",
        report.runs, report.timers, report.tasks, report.fill_s
    );
    println!(
        "{:>18}  {:>8}  {:>12}  {:>12}  {:>13}  {:>8}  {:>9}  {:>16}  {:>18}",
        "reopened",
        "open ms",
        "new start ms",
        "signalled ms",
        "attempts done",
        "rss MiB",
        "peak MiB",
        "timers in memory",
        "attempts in memory"
    );
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |ms| format!("{ms:.1}"));
    for (name, r) in [
        ("empty directory", &report.empty),
        ("filled directory", &report.full),
    ] {
        println!(
            "{:>18}  {:>8.1}  {:>12.1}  {:>12}  {:>13}  {:>8.1}  {:>9.1}  {:>16}  {:>18}",
            name,
            r.open_ms,
            r.start_accepted_ms,
            ms(r.signalled_done_ms),
            ms(r.tasks_done_ms),
            r.rss_mb,
            r.peak_rss_mb,
            r.timers_in_memory,
            r.attempts_in_memory_max
        );
    }
    println!(
        "memory over the empty directory: {:.1} MiB at the end, {:.1} MiB at the most",
        report.rss_growth_mb, report.peak_rss_growth_mb
    );
    Ok(ExitCode::SUCCESS)
}

/// Runs `keel bench restart-open` on `dir` and reads what it measured.
fn reopen(
    dir: &std::path::Path,
    signal: Option<&str>,
    tasks: u64,
    intents_window: usize,
) -> anyhow::Result<Reopened> {
    let exe = std::env::current_exe().context("locating the keel binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "restart-open", "--data"]).arg(dir);
    cmd.args(["--tasks", &tasks.to_string()]);
    cmd.args(["--intents-window", &intents_window.to_string()]);
    if let Some(run) = signal {
        cmd.args(["--signal", run]);
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("starting the reopening process")?;
    anyhow::ensure!(
        out.status.success(),
        "the reopening process failed: {}",
        out.status
    );
    serde_json::from_slice(&out.stdout).context("reading what the reopening process measured")
}

/// The reopening process: opens `--data`, starts a new run, signals one
/// waiting run, waits for the left-over attempts, and prints what it
/// measured as JSON.
pub(crate) fn restart_open(args: RestartOpenArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let engine = engine(&args.data, false, args.intents_window)?;
    let open_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (start_accepted_ms, signalled_done_ms) = rt.block_on(async {
        client.start::<Quick>("after-restart", &()).await?;
        let start_accepted_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let signalled = match &args.signal {
            None => None,
            Some(run) => {
                let t1 = Instant::now();
                client.signal(run, "go", &(), None).await?;
                client.result::<Waiter>(run).await?;
                Some(t1.elapsed().as_secs_f64() * 1000.0)
            }
        };
        client.result::<Quick>("after-restart").await?;
        anyhow::Ok((start_accepted_ms, signalled))
    })?;
    // The left-over attempts: sampled until every one completed.
    let mut peak_rss_mb = rss_mb();
    let mut attempts_in_memory_max = 0;
    let tasks_done_ms = rt.block_on(async {
        loop {
            let stats = engine.stats().await.shards;
            attempts_in_memory_max = attempts_in_memory_max.max(stats.attempts_supervised);
            peak_rss_mb = peak_rss_mb.max(rss_mb());
            let done = stats.attempts.get("completed").copied().unwrap_or(0);
            if done >= args.tasks {
                break anyhow::Ok((args.tasks > 0).then(|| t0.elapsed().as_secs_f64() * 1000.0));
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(DRAIN_WAIT_S_MAX),
                "only {done} of {} left-over attempts completed in {DRAIN_WAIT_S_MAX} s",
                args.tasks
            );
            tokio::time::sleep(Duration::from_millis(DRAIN_SAMPLE_MS)).await;
        }
    })?;
    let rss_mb = rss_mb();
    let timers_in_memory = rt.block_on(engine.stats()).shards.timers_armed;
    engine.shutdown_blocking();
    let report = Reopened {
        open_ms,
        start_accepted_ms,
        signalled_done_ms,
        rss_mb,
        timers_in_memory,
        tasks_done_ms,
        peak_rss_mb: peak_rss_mb.max(rss_mb),
        attempts_in_memory_max,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(ExitCode::SUCCESS)
}
