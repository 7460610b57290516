//! `keel bench w2`: one workflow fanning out to many no-op activities.
//!
//! With `--limit`, the fan-out goes through `all_limited`, which never has
//! more than the limit open: memory follows the limit, not the fan-out.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::{Engine, Workflow, WorkflowContext, WorkflowError};

use crate::bench::Noop;
use serde::Serialize;

use crate::output::{max_rss_mb, percentile, rss_mb};

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
    /// Where the memory was when the process was largest.
    memory: MemoryPeak,
}

/// How often [`MemorySampler`] looks.
const MEMORY_SAMPLE_INTERVAL_MS: u64 = 10;

const MIB: f64 = 1024.0 * 1024.0;

/// The process's peak memory, split into what the store can name and the
/// rest. Each of the store's parts is its own largest sample: a part can
/// shrink (a memtable flushed, a closed run's rows forgotten) while the
/// resident size, which the allocator keeps, does not.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct MemoryPeak {
    /// Resident memory of the idle engine, before the work.
    idle_rss_mb: f64,
    /// Largest resident memory sampled during the work.
    peak_rss_mb: f64,
    /// `peak_rss_mb - idle_rss_mb`.
    growth_mb: f64,
    /// The store's parts at their largest (`Store::memory`), and their
    /// sum's growth over the idle engine's.
    memtables_mb: f64,
    writer_cache_mb: f64,
    block_cache_mb: f64,
    table_readers_mb: f64,
    store_growth_mb: f64,
    /// The growth the store does not name: the engine's runs and machines,
    /// messages in flight, and what the allocator keeps.
    other_growth_mb: f64,
}

/// Samples the process's resident memory and its store's parts every
/// [`MEMORY_SAMPLE_INTERVAL_MS`] on its own thread, keeping the largest
/// of each.
pub(crate) struct MemorySampler {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<MemoryPeak>,
}

impl MemorySampler {
    /// Starts sampling; the memory now counts as the idle engine's.
    pub(crate) fn start(store: Arc<dyn keel_storage::Store>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let parts = move || store.memory().unwrap_or_default();
        let idle_parts = parts();
        let idle_rss = rss_mb();
        let handle = std::thread::Builder::new()
            .name("keel-bench-memory".into())
            .spawn(move || {
                let (mut rss, mut m) = (idle_rss, idle_parts);
                while !stopped.load(Ordering::Relaxed) {
                    rss = rss.max(rss_mb());
                    let now = parts();
                    m.memtables_bytes = m.memtables_bytes.max(now.memtables_bytes);
                    m.writer_cache_bytes = m.writer_cache_bytes.max(now.writer_cache_bytes);
                    m.block_cache_bytes = m.block_cache_bytes.max(now.block_cache_bytes);
                    m.table_readers_bytes = m.table_readers_bytes.max(now.table_readers_bytes);
                    std::thread::sleep(Duration::from_millis(MEMORY_SAMPLE_INTERVAL_MS));
                }
                let mb = |b: u64| b as f64 / MIB;
                let store_growth = (m.total_bytes() as f64 - idle_parts.total_bytes() as f64) / MIB;
                MemoryPeak {
                    idle_rss_mb: idle_rss,
                    peak_rss_mb: rss,
                    growth_mb: rss - idle_rss,
                    memtables_mb: mb(m.memtables_bytes),
                    writer_cache_mb: mb(m.writer_cache_bytes),
                    block_cache_mb: mb(m.block_cache_bytes),
                    table_readers_mb: mb(m.table_readers_bytes),
                    store_growth_mb: store_growth,
                    other_growth_mb: rss - idle_rss - store_growth,
                }
            })?;
        Ok(MemorySampler { stop, handle })
    }

    /// Stops sampling and returns the peak.
    pub(crate) fn finish(self) -> MemoryPeak {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

impl std::fmt::Display for MemoryPeak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rss {:.0} MiB idle, {:.0} MiB at peak (+{:.0}): store +{:.0} (memtables {:.0}, writer cache {:.0}, block cache {:.0}, table readers {:.0}), other +{:.0}",
            self.idle_rss_mb,
            self.peak_rss_mb,
            self.growth_mb,
            self.store_growth_mb,
            self.memtables_mb,
            self.writer_cache_mb,
            self.block_cache_mb,
            self.table_readers_mb,
            self.other_growth_mb
        )
    }
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
    let sampler = MemorySampler::start(engine.store())?;
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
    let memory = sampler.finish();
    engine.shutdown_blocking();
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
        memory,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{}: median wall {:.3} s (min {:.3}, max {:.3}) over {} runs, {:.0} events/s, max rss {:.0} MiB",
            report.workload, report.wall_s, report.wall_s_min, report.wall_s_max, report.runs,
            report.events_per_s, report.max_rss_mb
        );
        println!("  memory: {}", report.memory);
    }
    Ok(ExitCode::SUCCESS)
}

/// Arguments of `keel bench idle`.
#[derive(clap::Args, Debug)]
pub(crate) struct IdleArgs {
    /// Workflows to start; each then waits on a signal.
    #[arg(long, default_value_t = 100_000)]
    runs: u64,
    /// Keep every run's actor and machine in memory (`cached`) or keep at
    /// most 1,000 and passivate the rest (`passivated`).
    #[arg(long, default_value = "passivated")]
    mode: String,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

struct WaitForSignal;
impl Workflow for WaitForSignal {
    const NAME: &'static str = "bench.idle";
    type Input = u64;
    type Output = String;
    async fn run(ctx: WorkflowContext, _i: u64) -> Result<String, WorkflowError> {
        Ok(ctx.wait_signal::<String>("go").await?)
    }
}

#[derive(Serialize)]
struct IdleReport {
    workload: String,
    runs: u64,
    mode: String,
    rss_before_mb: f64,
    rss_after_mb: f64,
    bytes_per_run: f64,
    store_memory_mb: f64,
    bytes_per_run_excluding_store: f64,
    start_s: f64,
}

/// Starts `keel bench idle` keeps in flight.
const IDLE_STARTS_IN_FLIGHT: usize = 256;

/// Memory per run of N runs waiting on a signal, cached or passivated.
pub(crate) fn idle(args: IdleArgs) -> anyhow::Result<ExitCode> {
    let cached = match args.mode.as_str() {
        "cached" => true,
        "passivated" => false,
        other => anyhow::bail!("--mode must be cached or passivated, not {other:?}"),
    };
    let dir = tempfile::Builder::new()
        .prefix("keel-bench-idle")
        .tempdir()?;
    let config = keel::EngineConfig {
        run_cache_max: if cached {
            args.runs as usize + 1
        } else {
            1_000
        },
        ..Default::default()
    };
    let engine = Engine::builder()
        .data_dir(dir.path())
        .config(config)
        .register_workflow::<WaitForSignal>()
        .build()?;
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let before = rss_mb();
    let t0 = Instant::now();
    rt.block_on(async {
        // At most IDLE_STARTS_IN_FLIGHT starts at once, each reaped as it
        // ends: a finished task kept until the end would be counted as
        // the engine's memory (about 250 bytes a run).
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..args.runs {
            if tasks.len() >= IDLE_STARTS_IN_FLIGHT {
                if let Some(done) = tasks.join_next().await {
                    done??;
                }
            }
            let c = client.clone();
            tasks.spawn(async move { c.start::<WaitForSignal>(&format!("idle-{i}"), &i).await });
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        Ok::<(), anyhow::Error>(())
    })?;
    let start_s = t0.elapsed().as_secs_f64();
    // Let passivation and RocksDB settle before reading memory.
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_mb();
    let store_mb =
        engine.store().memory().map_or(0, |m| m.total_bytes()) as f64 / (1024.0 * 1024.0);
    let report = IdleReport {
        workload: format!("idle runs={} mode={}", args.runs, args.mode),
        runs: args.runs,
        mode: args.mode.clone(),
        rss_before_mb: before,
        rss_after_mb: after,
        bytes_per_run: (after - before).max(0.0) * 1024.0 * 1024.0 / args.runs as f64,
        store_memory_mb: store_mb,
        bytes_per_run_excluding_store: (after - before - store_mb).max(0.0) * 1024.0 * 1024.0
            / args.runs as f64,
        start_s,
    };
    engine.shutdown_blocking();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{}: {:.0} bytes per run, {:.0} excluding the store's {:.0} MiB of memtables and caches (rss {:.0} -> {:.0} MiB), started in {:.1} s",
            report.workload,
            report.bytes_per_run,
            report.bytes_per_run_excluding_store,
            report.store_memory_mb,
            report.rss_before_mb,
            report.rss_after_mb,
            report.start_s
        );
    }
    Ok(ExitCode::SUCCESS)
}
