//! `keel bench restart`: an engine reopened over many open runs.
//!
//! Fills a data directory with `--runs` runs waiting on a signal, of which
//! `--timers` first wait on a durable timer due within the next hour, and
//! stops that engine. Then a fresh process (so its memory is its own)
//! opens the directory and measures how long until a new start is
//! accepted, how long a waiting run takes to complete once signalled, and
//! its resident memory; the same process over an empty directory gives
//! the baseline the memory is compared with.

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use keel::{Engine, Workflow, WorkflowContext, WorkflowError};
use serde::{Deserialize, Serialize};

use crate::output::progress;
use crate::output::rss_mb;

/// Starts in flight at once while filling.
const FILL_STARTS_IN_FLIGHT: usize = 512;

/// The longest a timer of the fill waits, ms: they are spread over it.
const FILL_TIMER_SPREAD_MS: u64 = 3_600_000;

/// Arguments of `keel bench restart`.
#[derive(clap::Args, Debug)]
pub(crate) struct RestartArgs {
    /// Runs left waiting on a signal.
    #[arg(long, default_value_t = 1_000_000)]
    runs: u64,
    /// Of those, how many wait on a timer first (spread over an hour).
    #[arg(long, default_value_t = 100_000)]
    timers: u64,
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
}

/// Waits on a timer (when given one) and then on the signal `go`.
struct Waiter;
impl Workflow for Waiter {
    const NAME: &'static str = "bench.waiter";
    type Input = Option<u64>;
    type Output = ();
    async fn run(ctx: WorkflowContext, timer_ms: Option<u64>) -> Result<(), WorkflowError> {
        if let Some(ms) = timer_ms {
            ctx.timer(Duration::from_millis(ms)).await;
        }
        ctx.wait_signal::<()>("go").await?;
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

fn engine(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<Waiter>()
        .register_workflow::<Quick>()
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
}

#[derive(Serialize)]
struct RestartReport {
    runs: u64,
    timers: u64,
    fill_s: f64,
    empty: Reopened,
    full: Reopened,
    /// `full.rss_mb - empty.rss_mb`.
    rss_growth_mb: f64,
}

pub(crate) fn restart(args: RestartArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(args.timers <= args.runs, "--timers cannot exceed --runs");
    let empty_dir = tempfile::Builder::new()
        .prefix("keel-bench-restart")
        .tempdir()?;
    let full_dir = tempfile::Builder::new()
        .prefix("keel-bench-restart")
        .tempdir()?;

    // Fill: the first `timers` runs wait on a timer first; the last run
    // (no timer) is the one the reopened engine signals.
    let t0 = Instant::now();
    {
        let engine = engine(full_dir.path())?;
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
                        let timer =
                            (i < args.timers).then(|| 60_000 + i * 7919 % FILL_TIMER_SPREAD_MS);
                        client.start::<Waiter>(&format!("wait-{i}"), &timer).await
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
    let empty = reopen(empty_dir.path(), None)?;
    let full = reopen(full_dir.path(), Some(&last))?;
    let report = RestartReport {
        runs: args.runs,
        timers: args.timers,
        fill_s,
        rss_growth_mb: full.rss_mb - empty.rss_mb,
        empty,
        full,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{} runs waiting ({} on timers first), filled in {:.1} s",
        report.runs, report.timers, report.fill_s
    );
    println!(
        "{:>22}  {:>9}  {:>15}  {:>16}  {:>8}  {:>16}",
        "reopened", "open ms", "new start ms", "signalled ms", "rss MiB", "timers in memory"
    );
    for (name, r) in [
        ("empty directory", &report.empty),
        ("filled directory", &report.full),
    ] {
        println!(
            "{:>22}  {:>9.1}  {:>15.1}  {:>16}  {:>8.1}  {:>16}",
            name,
            r.open_ms,
            r.start_accepted_ms,
            r.signalled_done_ms
                .map_or("-".to_string(), |ms| format!("{ms:.1}")),
            r.rss_mb,
            r.timers_in_memory
        );
    }
    println!(
        "memory over the empty directory: {:.1} MiB",
        report.rss_growth_mb
    );
    Ok(ExitCode::SUCCESS)
}

/// Runs `keel bench restart-open` on `dir` and reads what it measured.
fn reopen(dir: &std::path::Path, signal: Option<&str>) -> anyhow::Result<Reopened> {
    let exe = std::env::current_exe().context("locating the keel binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "restart-open", "--data"]).arg(dir);
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
/// waiting run, and prints what it measured as JSON.
pub(crate) fn restart_open(args: RestartOpenArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let engine = engine(&args.data)?;
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
    let rss_mb = rss_mb();
    let timers_in_memory = rt.block_on(engine.stats()).shards.timers_armed;
    engine.shutdown_blocking();
    let report = Reopened {
        open_ms,
        start_accepted_ms,
        signalled_done_ms,
        rss_mb,
        timers_in_memory,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(ExitCode::SUCCESS)
}
