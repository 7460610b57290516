//! `keel bench w2`: one workflow fanning out to many no-op activities.
//!
//! With `--limit`, the fan-out goes through `all_limited`, which never has
//! more than the limit open: memory follows the limit, not the fan-out.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use keel::{
    Activity, ActivityContext, ActivityError, Engine, Workflow, WorkflowContext, WorkflowError,
};
use serde::Serialize;

use crate::output::{max_rss_mb, percentile};

/// Arguments of `keel bench w2`.
#[derive(clap::Args, Debug)]
pub(crate) struct W2Args {
    /// Activities in the fan-out.
    #[arg(long, default_value_t = 1000)]
    fanout: u32,
    /// Most activities open at once (`all_limited`); without it, one `all`.
    #[arg(long)]
    limit: Option<u32>,
    /// Runs to take the median over.
    #[arg(long, default_value_t = 5)]
    runs: u32,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Default)]
struct Noop;
impl Activity for Noop {
    const NAME: &'static str = "bench.noop";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        Ok(i)
    }
}

struct FanOut;
impl Workflow for FanOut {
    const NAME: &'static str = "bench.w2";
    type Input = (u32, Option<u32>);
    type Output = u64;
    async fn run(
        ctx: WorkflowContext,
        (n, limit): (u32, Option<u32>),
    ) -> Result<u64, WorkflowError> {
        let calls = (0..n).map(|i| ctx.activity::<Noop>(i));
        let done = match limit {
            Some(l) => {
                ctx.for_each_limited(l as usize, calls).await?;
                n as u64
            }
            None => ctx.all(calls.collect::<Vec<_>>()).await?.len() as u64,
        };
        Ok(done)
    }
}

#[derive(Serialize)]
struct W2Report {
    workload: String,
    fanout: u32,
    limit: Option<u32>,
    runs: u32,
    wall_s: f64,
    wall_s_min: f64,
    wall_s_max: f64,
    events_per_s: f64,
    max_rss_mb: f64,
}

pub(crate) fn w2(args: W2Args) -> anyhow::Result<ExitCode> {
    let dir = tempfile::Builder::new().prefix("keel-bench-w2").tempdir()?;
    let engine = Engine::builder()
        .data_dir(dir.path())
        .register_workflow::<FanOut>()
        .register_activity::<Noop>()
        .build()?;
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut walls = Vec::new();
    for r in 0..args.runs.max(1) {
        let t0 = Instant::now();
        let id = format!("w2-{r}");
        let n = rt.block_on(async {
            client
                .start::<FanOut>(&id, &(args.fanout, args.limit))
                .await?;
            client.result::<FanOut>(&id).await
        })?;
        anyhow::ensure!(n == args.fanout as u64, "fan-out returned {n} results");
        walls.push(t0.elapsed().as_secs_f64());
    }
    engine.shutdown(Duration::from_secs(10));
    walls.sort_by(|a, b| a.total_cmp(b));
    let median = percentile(&walls, 0.5);
    // started + per member (scheduled + completed) + completed
    let events = 2.0 + 2.0 * args.fanout as f64;
    let report = W2Report {
        workload: match args.limit {
            Some(l) => format!("w2 fanout={} limit={l}", args.fanout),
            None => format!("w2 fanout={} all", args.fanout),
        },
        fanout: args.fanout,
        limit: args.limit,
        runs: walls.len() as u32,
        wall_s: median,
        wall_s_min: walls[0],
        wall_s_max: walls[walls.len() - 1],
        events_per_s: events / median.max(1e-9),
        max_rss_mb: max_rss_mb(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{}: median wall {:.3} s (min {:.3}, max {:.3}) over {} runs, {:.0} events/s, max rss {:.0} MiB",
            report.workload, report.wall_s, report.wall_s_min, report.wall_s_max, report.runs,
            report.events_per_s, report.max_rss_mb
        );
    }
    Ok(ExitCode::SUCCESS)
}
