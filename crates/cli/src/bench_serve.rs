//! `keel bench serve`: what `keel serve` answers and what it costs the
//! engine, over real HTTP on a loopback port.
//!
//! One engine on a temporary RocksDB directory runs `--runs` W1 workflows
//! to completion (the store the list is measured over) and holds
//! `WAITING_RUNS` runs waiting on a signal (cached: what describe is
//! measured on). The API is then served on 127.0.0.1 by one actix-web
//! worker and called by one keep-alive client: describe of a cached run,
//! a filtered list page (default and largest page size), a walk of every
//! page of the filter, and the store-wide counts. Last, W1 runs in rounds
//! alternating without and with a scraper that fetches `/metrics` every
//! second (in ABBA order, as the store grows), and the median
//! throughputs are compared.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::{Engine, Workflow, WorkflowContext, WorkflowError};
use serde::Serialize;

use crate::bench::{ClientTasks, Noop, ThreeSteps};
use crate::output::{max_rss_mb, percentile, progress};

/// Runs held waiting on a signal for describe to read.
const WAITING_RUNS: u64 = 100;
/// How often the scraper fetches `/metrics`, in milliseconds.
const SCRAPE_INTERVAL_MS: u64 = 1_000;

/// Arguments of `keel bench serve`.
#[derive(clap::Args, Debug)]
pub(crate) struct ServeBenchArgs {
    /// Completed runs in the store the list is measured over.
    #[arg(long, default_value_t = 10_000)]
    runs: u64,
    /// Describe calls measured.
    #[arg(long, default_value_t = 5_000)]
    describes: u64,
    /// List calls measured per page size.
    #[arg(long, default_value_t = 200)]
    lists: u64,
    /// Walks over every page of the filter, per state of the store (the
    /// memtables, then flushed).
    #[arg(long, default_value_t = 10)]
    walks: usize,
    /// W1 workflows per round of the scraper comparison.
    #[arg(long, default_value_t = 10_000)]
    workflows: u64,
    /// Rounds of W1 without and with the scraper (alternating).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// W1 workflows in flight at once.
    #[arg(long, default_value_t = 200)]
    concurrency: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Waits for one signal: a run that stays open and cached.
struct Parked;
impl Workflow for Parked {
    const NAME: &'static str = "bench.wait";
    type Input = u32;
    type Output = u32;
    async fn run(ctx: WorkflowContext, i: u32) -> Result<u32, WorkflowError> {
        let _: u32 = ctx.wait_signal("go").await?;
        Ok(i)
    }
}

#[derive(Serialize, Default)]
struct Latency {
    calls: u64,
    p50_ms: f64,
    p99_ms: f64,
}

impl Latency {
    fn of(mut ms: Vec<f64>) -> Self {
        ms.sort_by(|a, b| a.total_cmp(b));
        Latency {
            calls: ms.len() as u64,
            p50_ms: percentile(&ms, 0.50),
            p99_ms: percentile(&ms, 0.99),
        }
    }
}

#[derive(Serialize)]
struct ServeReport {
    runs_in_store: u64,
    describe_cached: Latency,
    list_filtered_page_50: Latency,
    list_filtered_page_1000: Latency,
    /// Every page of the filter (pages of 1,000): all `runs_in_store` runs,
    /// one walk per call; p50 and p99 over `--walks` walks.
    list_filtered_all: Latency,
    /// The same after the memtables were flushed to SST files.
    list_filtered_all_flushed: Latency,
    counts: Latency,
    metrics: Latency,
    /// One scrape's p50 over the scrape interval: the share of one core a
    /// scraper takes from the engine, at most.
    scrape_core_percent: f64,
    w1_workflows_per_round: u64,
    w1_without_scraper_per_s: Vec<f64>,
    w1_with_scraper_per_s: Vec<f64>,
    scrapes: u64,
    /// Per pair of rounds (without, then with): (without - with) /
    /// without in percent; the report's figure is their median.
    scraper_cost_percent_by_pair: Vec<f64>,
    scraper_cost_percent: f64,
    max_rss_mb: f64,
}

pub(crate) fn serve(args: ServeBenchArgs) -> anyhow::Result<std::process::ExitCode> {
    anyhow::ensure!(
        args.runs > 0 && args.rounds > 0 && args.walks > 0,
        "--runs, --rounds and --walks must be positive"
    );
    let dir = tempfile::Builder::new()
        .prefix("keel-bench-serve")
        .tempdir()?;
    // The bench opens the store itself to flush it between the two walks.
    let store = Arc::new(keel_storage::RocksStore::open(
        dir.path(),
        keel::EngineConfig::default().durability,
    )?);
    let engine = Arc::new(
        Engine::builder()
            .store(store.clone())
            .register_workflow::<ThreeSteps>()
            .register_workflow::<Parked>()
            .register_activity::<Noop>()
            .build()?,
    );
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    // The store: completed runs, and runs waiting (cached).
    w1_round(&rt, &client, "fill", args.runs, args.concurrency)?;
    rt.block_on(async {
        for i in 0..WAITING_RUNS {
            client
                .start::<Parked>(&format!("wait-{i}"), &(i as u32))
                .await?;
        }
        anyhow::Ok(())
    })?;

    let config = keel_cli::serve::ServeConfig {
        bind: "127.0.0.1:0".parse()?,
        workers: 1,
        ..keel_cli::serve::ServeConfig::default()
    };
    let server = keel_cli::serve::spawn(engine.clone(), &config)?;
    let base = server.url();
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build();
    let get = |path: &str| -> anyhow::Result<f64> {
        let t0 = Instant::now();
        let body = body_of(agent.get(&format!("{base}{path}")).call()?)?;
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        anyhow::ensure!(!body.is_empty(), "{path}: empty answer");
        Ok(ms)
    };

    // Describe: wait until the runs wait (they are cached then).
    for i in 0..WAITING_RUNS {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let d: serde_json::Value = agent
                .get(&format!("{base}/api/v1/runs/wait-{i}"))
                .call()?
                .into_string()
                .map(|s| serde_json::from_str(&s))??;
            if d["signal_waits"].as_array().is_some_and(|w| !w.is_empty()) {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "wait-{i} never waited");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let bar = progress(args.describes + 3 * args.lists, "serve api");
    let mut ms = Vec::with_capacity(args.describes as usize);
    for i in 0..args.describes {
        ms.push(get(&format!("/api/v1/runs/wait-{}", i % WAITING_RUNS))?);
        bar.inc(1);
    }
    let describe_cached = Latency::of(ms);
    let filter = "status=completed&type=bench.w1";
    let page = |size: usize| -> anyhow::Result<Latency> {
        let mut ms = Vec::new();
        for _ in 0..args.lists {
            ms.push(get(&format!("/api/v1/runs?{filter}&page_size={size}"))?);
            bar.inc(1);
        }
        Ok(Latency::of(ms))
    };
    let list_filtered_page_50 = page(50)?;
    let list_filtered_page_1000 = page(1000)?;
    // The whole filter, page after page. The client reads each page as a
    // script would: it counts the runs and follows `next` (parsing every
    // run into a JSON value tree would time the client, not the API).
    #[derive(serde::Deserialize)]
    struct WalkPage {
        runs: Vec<serde::de::IgnoredAny>,
        next: Option<String>,
    }
    let walk = || -> anyhow::Result<Latency> {
        let mut walks = Vec::with_capacity(args.walks);
        for _ in 0..args.walks {
            let t0 = Instant::now();
            let mut after: Option<String> = None;
            let mut listed = 0u64;
            loop {
                let mut url = format!("{base}/api/v1/runs?{filter}&page_size=1000");
                if let Some(a) = &after {
                    url.push_str(&format!("&after={a}"));
                }
                let page: WalkPage = serde_json::from_slice(&body_of(agent.get(&url).call()?)?)?;
                listed += page.runs.len() as u64;
                match page.next {
                    Some(next) => after = Some(next),
                    None => break,
                }
            }
            walks.push(t0.elapsed().as_secs_f64() * 1000.0);
            anyhow::ensure!(
                listed == args.runs,
                "the filter listed {listed} runs, the store holds {}",
                args.runs
            );
        }
        Ok(Latency::of(walks))
    };
    // Just filled, the runs are in the memtables; a store that has lived a
    // while (or was opened again) holds them in SST files.
    let list_filtered_all = walk()?;
    store.flush()?;
    let list_filtered_all_flushed = walk()?;
    let mut ms = Vec::new();
    for _ in 0..args.lists {
        ms.push(get("/api/v1/counts")?);
        bar.inc(1);
    }
    let counts = Latency::of(ms);
    let mut ms = Vec::new();
    for _ in 0..args.lists {
        ms.push(get("/metrics")?);
        bar.inc(1);
    }
    let metrics = Latency::of(ms);
    bar.finish_and_clear();

    // W1 without and with a scraper, alternating.
    let (mut without, mut with) = (Vec::new(), Vec::new());
    let scrapes = Arc::new(AtomicU64::new(0));
    for round in 0..args.rounds {
        // ABBA: the store grows as rounds run, so the order alternates.
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for scraped in order {
            let stop = Arc::new(AtomicBool::new(false));
            let scraper = scraped.then(|| {
                let (stop, scrapes, agent) = (stop.clone(), scrapes.clone(), agent.clone());
                let url = format!("{base}/metrics");
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let t0 = Instant::now();
                        if let Ok(r) = agent.get(&url).call() {
                            let _ = r.into_string();
                            scrapes.fetch_add(1, Ordering::Relaxed);
                        }
                        let next = t0 + Duration::from_millis(SCRAPE_INTERVAL_MS);
                        while Instant::now() < next && !stop.load(Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                })
            });
            let name = format!("{}-{round}", if scraped { "scraped" } else { "plain" });
            let rate = w1_round(&rt, &client, &name, args.workflows, args.concurrency)?;
            stop.store(true, Ordering::Relaxed);
            if let Some(s) = scraper {
                let _ = s.join();
            }
            if scraped {
                with.push(rate);
            } else {
                without.push(rate);
            }
        }
    }
    let median = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        percentile(&s, 0.5)
    };
    let (m_without, m_with) = (median(&without), median(&with));
    let by_pair: Vec<f64> = without
        .iter()
        .zip(&with)
        .map(|(a, b)| (a - b) / a * 100.0)
        .collect();
    let scrape_core_percent = metrics.p50_ms / SCRAPE_INTERVAL_MS as f64 * 100.0;
    let report = ServeReport {
        runs_in_store: args.runs,
        describe_cached,
        list_filtered_page_50,
        list_filtered_page_1000,
        list_filtered_all,
        list_filtered_all_flushed,
        counts,
        metrics,
        scrape_core_percent,
        w1_workflows_per_round: args.workflows,
        w1_without_scraper_per_s: without,
        w1_with_scraper_per_s: with,
        scrapes: scrapes.load(Ordering::Relaxed),
        scraper_cost_percent: median(&by_pair),
        scraper_cost_percent_by_pair: by_pair,
        max_rss_mb: max_rss_mb(),
    };
    server.stop()?;
    // The server's state held the other reference; it is gone with it.
    if let Ok(engine) = Arc::try_unwrap(engine) {
        engine.shutdown_blocking();
    }

    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let r = &report;
        println!(
            "keel serve over {} runs (one worker, one keep-alive client, loopback):",
            r.runs_in_store
        );
        for (what, l) in [
            ("describe, cached run", &r.describe_cached),
            ("list, filter, page of 50", &r.list_filtered_page_50),
            ("list, filter, page of 1000", &r.list_filtered_page_1000),
            ("counts, store-wide", &r.counts),
            ("metrics (a scrape)", &r.metrics),
        ] {
            println!(
                "  {what:<28} p50 {:>7.3} ms  p99 {:>7.3} ms  ({} calls)",
                l.p50_ms, l.p99_ms, l.calls
            );
        }
        for (state, l) in [
            ("memtables", &r.list_filtered_all),
            ("flushed", &r.list_filtered_all_flushed),
        ] {
            println!(
                "  list, filter, all {} runs, {state:<9} p50 {:>7.1} ms  p99 {:>7.1} ms  ({} walks, pages of 1000)",
                r.runs_in_store, l.p50_ms, l.p99_ms, l.calls
            );
        }
        println!(
            "W1 ({} workflows per round): without scraper {:.0}/s, with /metrics every {} ms {:.0}/s (medians of {}); cost {:.1} % (median of pairs {:?}); {} scrapes",
            r.w1_workflows_per_round, m_without, SCRAPE_INTERVAL_MS, m_with, args.rounds,
            r.scraper_cost_percent,
            r.scraper_cost_percent_by_pair.iter().map(|c| format!("{c:.1}")).collect::<Vec<_>>(),
            r.scrapes
        );
        println!(
            "a scrape takes {:.2} % of one core at one per {} ms; max rss {:.0} MiB",
            r.scrape_core_percent, SCRAPE_INTERVAL_MS, r.max_rss_mb
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The body of `response`, as `keel ... --server` reads it.
fn body_of(response: ureq::Response) -> anyhow::Result<Vec<u8>> {
    Ok(keel_cli::remote::answer_body(response)?)
}

/// One W1 round of `n` workflows, closed loop; workflows per second.
fn w1_round(
    rt: &tokio::runtime::Runtime,
    client: &keel::Client,
    prefix: &str,
    n: u64,
    concurrency: usize,
) -> anyhow::Result<f64> {
    let bar = progress(n, &format!("w1 {prefix}"));
    let t0 = Instant::now();
    rt.block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
        let mut tasks = ClientTasks::new(n);
        for i in 0..n {
            let permit = sem.clone().acquire_owned().await?;
            let (client, bar, id) = (client.clone(), bar.clone(), format!("{prefix}-{i}"));
            tasks.spawn(async move {
                let _permit = permit;
                client.start::<ThreeSteps>(&id, &(i as u32)).await?;
                client.result::<ThreeSteps>(&id).await?;
                bar.inc(1);
                Ok::<(), keel::EngineError>(())
            })?;
        }
        tasks.finish().await.map(drop)
    })?;
    bar.finish_and_clear();
    Ok(n as f64 / t0.elapsed().as_secs_f64())
}
