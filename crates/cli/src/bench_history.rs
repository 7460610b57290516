//! `keel bench history`: what one more event costs as a run's history
//! grows.
//!
//! One run records `--events` side effects in rounds of `--batch`; each
//! round ends with a no-op activity that stamps the time it ran. The time
//! between two stamps is one round: the round's side effects and the
//! activity's schedule committed together, the attempt run and its result
//! committed, and the cached run activated again. A cost that grew with
//! the history (a copy of it per commit, a scan of it per activation)
//! would show as rounds getting slower; the report compares each tenth of
//! the run with the first.

use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use keel::{
    Activity, ActivityContext, ActivityError, Engine, Workflow, WorkflowContext, WorkflowError,
};
use serde::Serialize;

use crate::output::{max_rss_mb, percentile, progress};

/// Arguments of `keel bench history`.
#[derive(clap::Args, Debug)]
pub(crate) struct HistoryArgs {
    /// Side-effect events to record in the one run (its history ends a
    /// little longer: each round adds the activity's two events).
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Side effects per round (one commit each).
    #[arg(long, default_value_t = 1000)]
    batch: u32,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// When each round's activity ran, in round order.
static STAMPS: Mutex<Vec<Instant>> = Mutex::new(Vec::new());

/// Notes the time it runs: the boundary between two rounds.
#[derive(Default)]
struct Stamp;
impl Activity for Stamp {
    const NAME: &'static str = "bench.stamp";
    type Input = u64;
    type Output = ();
    async fn run(&self, _ctx: ActivityContext, _round: u64) -> Result<(), ActivityError> {
        STAMPS.lock().expect("stamps").push(Instant::now());
        Ok(())
    }
}

struct LongHistory;
impl Workflow for LongHistory {
    const NAME: &'static str = "bench.history";
    type Input = (u64, u32);
    type Output = u64;
    async fn run(ctx: WorkflowContext, (rounds, batch): (u64, u32)) -> Result<u64, WorkflowError> {
        for round in 0..rounds {
            for i in 0..batch {
                ctx.side_effect(|| i)?;
            }
            ctx.activity::<Stamp>(round).await?;
        }
        Ok(ctx.history_len())
    }
}

/// One tenth of the run's rounds.
#[derive(Serialize)]
struct Tenth {
    /// History length when its first round began.
    history_from: u64,
    /// Median time of its rounds, ms.
    round_ms_p50: f64,
    /// The same per event of a round, µs.
    event_us_p50: f64,
    /// Its median over the first tenth's.
    vs_first: f64,
}

#[derive(Serialize)]
struct HistoryReport {
    events: u64,
    batch: u32,
    rounds: u64,
    history_len: u64,
    wall_s: f64,
    events_per_s: f64,
    tenths: Vec<Tenth>,
    /// The last tenth's median round over the first's.
    last_vs_first: f64,
    max_rss_mb: f64,
}

/// Events one round adds: its side effects, and the activity's schedule
/// and completion.
fn round_events(batch: u32) -> u64 {
    batch as u64 + 2
}

pub(crate) fn history(args: HistoryArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.batch > 0, "--batch must be at least 1");
    let rounds = args.events.div_ceil(args.batch as u64);
    anyhow::ensure!(
        rounds >= 20,
        "--events must allow 20 rounds of --batch at least"
    );
    let dir = tempfile::Builder::new()
        .prefix("keel-bench-history")
        .tempdir()?;
    let engine = Engine::builder()
        .data_dir(dir.path())
        .register_workflow::<LongHistory>()
        .register_activity::<Stamp>()
        .build()?;
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    STAMPS.lock().expect("stamps").clear();
    let bar = progress(rounds, "rounds");
    let t0 = Instant::now();
    let history_len = rt.block_on(async {
        client
            .start::<LongHistory>("history-1", &(rounds, args.batch))
            .await?;
        let result = client.result::<LongHistory>("history-1");
        tokio::pin!(result);
        loop {
            tokio::select! {
                out = &mut result => break out,
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    bar.set_position(STAMPS.lock().expect("stamps").len() as u64);
                }
            }
        }
    })?;
    let wall = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    engine.shutdown_blocking();

    let stamps = std::mem::take(&mut *STAMPS.lock().expect("stamps"));
    anyhow::ensure!(
        stamps.len() as u64 == rounds,
        "{} rounds stamped, {rounds} expected",
        stamps.len()
    );
    // Round i (from 1) is the time from stamp i-1 to stamp i.
    let rounds_ms: Vec<f64> = stamps
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1000.0)
        .collect();
    let per_tenth = rounds_ms.len() / 10;
    let mut tenths: Vec<Tenth> = Vec::new();
    for t in 0..10 {
        let mut ms = rounds_ms[t * per_tenth..(t + 1) * per_tenth].to_vec();
        ms.sort_by(|a, b| a.total_cmp(b));
        let p50 = percentile(&ms, 0.5);
        let first = tenths.first().map_or(p50, |f| f.round_ms_p50);
        tenths.push(Tenth {
            // The first timed round is round 1 (round 0 has no start stamp).
            history_from: 1 + (1 + t * per_tenth) as u64 * round_events(args.batch),
            round_ms_p50: p50,
            event_us_p50: p50 * 1000.0 / args.batch as f64,
            vs_first: p50 / first.max(1e-9),
        });
    }
    let report = HistoryReport {
        events: rounds * args.batch as u64,
        batch: args.batch,
        rounds,
        history_len,
        wall_s: wall,
        events_per_s: history_len as f64 / wall.max(1e-9),
        last_vs_first: tenths[9].vs_first,
        tenths,
        max_rss_mb: max_rss_mb(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "one run, {} events in {} rounds of {} side effects: {:.2} s, {:.0} events/s, max rss {:.0} MiB",
        report.history_len,
        report.rounds,
        report.batch,
        report.wall_s,
        report.events_per_s,
        report.max_rss_mb
    );
    println!(
        "{:>14}  {:>12}  {:>12}  {:>9}",
        "history from", "round p50 ms", "event p50 µs", "vs first"
    );
    for t in &report.tenths {
        println!(
            "{:>14}  {:>12.3}  {:>12.3}  {:>9.2}",
            t.history_from, t.round_ms_p50, t.event_us_p50, t.vs_first
        );
    }
    Ok(ExitCode::SUCCESS)
}
