//! `keel bench replay` and `keel bench show`: offline replay throughput and
//! the time `keel show` takes to print its first event line. Measurements,
//! never timed tests.
//!
//! Histories are made by the pure run machine (start, then one activity
//! result after another, exactly the inputs a live engine would feed) and
//! committed through the store's ordinary commit path, so they are real
//! histories that `verify` accepts, written without running an engine.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use keel::machine::{Input, RunMachine, StartSpec};
use keel::replay::Replayer;
use keel::{
    Activity, ActivityContext, ActivityError, Workflow, WorkflowContext, WorkflowError,
    WorkflowRegistry,
};
use keel_storage::{
    CommitBatch, Durability, InstanceId, Payload, RocksStore, RunFilter, RunId, Store, Timestamp,
};
use serde::Serialize;

use crate::output::{max_rss_mb, progress};

/// Arguments of `keel bench replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayBenchArgs {
    /// Events to write and replay (rounded to whole runs).
    #[arg(long, default_value_t = 1_000_000)]
    pub events: u64,
    /// Sequential activities per run (each adds two events).
    #[arg(long, default_value_t = 100)]
    pub activities: u32,
    /// Leave the newest histories in the write-ahead log, as a crash
    /// leaves them, instead of moving the log into table files as an
    /// engine's clean shutdown does: the replay then iterates memtables
    /// rebuilt from the log for up to the memtable budget of its events.
    #[arg(long)]
    pub in_wal: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `keel bench show`.
#[derive(clap::Args, Debug)]
pub struct ShowBenchArgs {
    /// Events in the history `keel show` prints.
    #[arg(long, default_value_t = 100_000)]
    pub events: u64,
    /// Times to run `keel show` (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
    /// Write the history into this new directory and keep it (instance
    /// `bench-show`), instead of a temporary one.
    #[arg(long)]
    pub keep: Option<std::path::PathBuf>,
    /// Leave the history in the write-ahead log instead of flushing it to
    /// table files: the worst case, where every reader replays the WAL.
    #[arg(long)]
    pub in_wal: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The activity of the benchmark workflow (never run: only its name is
/// recorded).
#[derive(Default, Debug)]
pub struct Noop;
impl Activity for Noop {
    const NAME: &'static str = "bench.replay.noop";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        Ok(i + 1)
    }
}

/// N sequential no-op activities.
#[derive(Debug)]
pub struct Sequential;
impl Workflow for Sequential {
    const NAME: &'static str = "bench.replay";
    type Input = u32;
    type Output = u32;
    async fn run(ctx: WorkflowContext, n: u32) -> Result<u32, WorkflowError> {
        let mut acc = 0;
        for _ in 0..n {
            acc = ctx.activity::<Noop>(acc).await?;
        }
        Ok(acc)
    }
}

/// The registry the benchmarks write and replay with.
pub fn workflows() -> WorkflowRegistry {
    let mut r = WorkflowRegistry::new();
    r.register::<Sequential>();
    r
}

/// Events in one run of [`Sequential`] with `n` activities: started, n x
/// (scheduled, completed), completed.
pub fn events_per_run(n: u32) -> u64 {
    2 * n as u64 + 2
}

/// Writes one closed run of `activities` sequential activities to `store`,
/// committing at most `commit_events` events at a time. Returns its run.
pub fn write_run(
    store: &dyn Store,
    registry: &WorkflowRegistry,
    instance: &str,
    run_no: u64,
    activities: u32,
    commit_events: usize,
) -> anyhow::Result<RunId> {
    let run_id = RunId::from_u64_pair(0x6b65_656c, run_no);
    let spec = StartSpec {
        run_id,
        instance_id: InstanceId::new(instance),
        workflow_type: Sequential::NAME.to_string(),
        input: Payload::encode(&activities)?,
        command_id: None,
        parent: None,
        continued_from: None,
        random_seed: run_no,
        previous_run: None,
        carried: Default::default(),
        memo: Vec::new(),
        search_attributes: Vec::new(),
        timeouts: Default::default(),
    };
    let mut now = Timestamp(1_700_000_000_000);
    let (mut machine, first) = RunMachine::start(registry, spec, now)
        .map_err(|e| anyhow::anyhow!("starting the benchmark run: {e}"))?;
    let mut pending = first;
    let mut acc = 0u32;
    for step in 1..=activities {
        now = now.plus_ms(1);
        acc += 1;
        let events = machine
            .handle(
                Input::ActivityCompleted {
                    step: keel::Step(step),
                    attempt: keel::AttemptNo::FIRST,
                    result: Payload::encode(&acc)?,
                },
                now,
            )
            .map_err(|e| anyhow::anyhow!("benchmark run step {step}: {e}"))?;
        pending.extend(events);
        if pending.len() >= commit_events {
            store
                .commit(CommitBatch::append(run_id, std::mem::take(&mut pending)))
                .wait()?;
        }
    }
    if !pending.is_empty() {
        store.commit(CommitBatch::append(run_id, pending)).wait()?;
    }
    anyhow::ensure!(machine.is_closed(), "the benchmark run did not close");
    Ok(run_id)
}

#[derive(Serialize)]
struct ReplayReport {
    workload: String,
    runs: u64,
    events: u64,
    in_wal: bool,
    write_s: f64,
    replay_s: f64,
    events_per_s: f64,
    ok: bool,
    max_rss_mb: f64,
}

/// `keel bench replay`.
pub fn replay(args: ReplayBenchArgs) -> anyhow::Result<ExitCode> {
    let activities = args.activities.max(1);
    let per_run = events_per_run(activities);
    let runs = args.events.div_ceil(per_run).max(1);
    let dir = tempfile::Builder::new()
        .prefix("keel-bench-replay")
        .tempdir()?;
    let registry = workflows();
    let t0 = Instant::now();
    {
        let store = RocksStore::open(dir.path(), Durability::Buffered)?;
        let bar = progress(runs, "writing");
        for i in 0..runs {
            write_run(
                &store,
                &registry,
                &format!("bench-{i}"),
                i,
                activities,
                usize::MAX,
            )?;
            bar.inc(1);
        }
        bar.finish_and_clear();
        if !args.in_wal {
            store.flush_log()?;
        }
        store.sync()?;
        store.close()?;
    }
    let write_s = t0.elapsed().as_secs_f64();
    let store = RocksStore::open_read_only(dir.path())?;
    let replayer = Replayer::new(registry);
    let bar = progress(runs, "replaying");
    let t1 = Instant::now();
    let summary = replayer.replay_store(&store, &RunFilter::default(), &mut |_| bar.inc(1))?;
    let replay_s = t1.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let report = ReplayReport {
        workload: format!(
            "replay {runs} runs x {activities} sequential activities{}",
            if args.in_wal {
                ", newest in the write-ahead log"
            } else {
                ""
            }
        ),
        runs: summary.replayed,
        events: summary.events,
        in_wal: args.in_wal,
        write_s,
        replay_s,
        events_per_s: summary.events as f64 / replay_s.max(1e-9),
        ok: summary.is_ok(),
        max_rss_mb: max_rss_mb(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{}: {} events replayed in {:.2} s = {:.0} events/s (read, decode, replay; written in {:.2} s); all ok: {}; max rss {:.0} MiB",
            report.workload,
            report.events,
            report.replay_s,
            report.events_per_s,
            report.write_s,
            report.ok,
            report.max_rss_mb
        );
    }
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

#[derive(Serialize)]
struct ShowReport {
    events: u64,
    repeat: u32,
    first_line_ms: f64,
    first_line_ms_max: f64,
    all_lines_ms: f64,
}

/// Runs `keel show` once; returns (ms to the first event line, ms to the end).
fn time_show(exe: &Path, data: &Path, id: &str) -> anyhow::Result<(f64, f64)> {
    let t0 = Instant::now();
    let mut child = Command::new(exe)
        .arg("show")
        .arg(id)
        .arg("--data")
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut first = None;
    let mut lines = 0u64;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        lines += 1;
        // Line 1 is the header; line 2 is the first event.
        if first.is_none() && lines == 2 {
            anyhow::ensure!(line.starts_with('1'), "unexpected first line {line:?}");
            first = Some(t0.elapsed().as_secs_f64() * 1000.0);
        }
    }
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "keel show failed: {status}");
    let first = first.ok_or_else(|| anyhow::anyhow!("keel show printed no event"))?;
    Ok((first, t0.elapsed().as_secs_f64() * 1000.0))
}

/// `keel bench show`: time to the first event line of `keel show` on one
/// long history, measured from spawning the process (open, resolve, first
/// read included).
pub fn show(args: ShowBenchArgs) -> anyhow::Result<ExitCode> {
    let activities = (args.events.saturating_sub(2) / 2).max(1) as u32;
    let temp = tempfile::Builder::new()
        .prefix("keel-bench-show")
        .tempdir()?;
    let dir = match &args.keep {
        Some(d) if d.exists() => anyhow::bail!("{} already exists", d.display()),
        Some(d) => d.clone(),
        None => temp.path().to_path_buf(),
    };
    let registry = workflows();
    {
        let store = RocksStore::open(&dir, Durability::Buffered)?;
        write_run(&store, &registry, "bench-show", 1, activities, 10_000)?;
        if !args.in_wal {
            store.flush()?;
        }
        store.sync()?;
        store.close()?;
    }
    let exe = std::env::current_exe()?;
    let mut firsts = Vec::new();
    let mut alls = Vec::new();
    for _ in 0..args.repeat.max(1) {
        let (first, all) = time_show(&exe, &dir, "bench-show")?;
        firsts.push(first);
        alls.push(all);
    }
    firsts.sort_by(f64::total_cmp);
    alls.sort_by(f64::total_cmp);
    let report = ShowReport {
        events: events_per_run(activities),
        repeat: args.repeat.max(1),
        first_line_ms: firsts[firsts.len() / 2],
        first_line_ms_max: firsts[firsts.len() - 1],
        all_lines_ms: alls[alls.len() / 2],
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "show of a {}-event history: first event line after {:.1} ms (median of {}, max {:.1} ms); all lines after {:.0} ms",
            report.events, report.first_line_ms, report.repeat, report.first_line_ms_max, report.all_lines_ms
        );
    }
    Ok(ExitCode::SUCCESS)
}
