//! `keel sim`: the deterministic simulator over one seed or a sweep.
//!
//! Exit codes: 0 every invariant held on every seed, 1 a violation (the
//! reproduction command and a shrunk fault list are printed), 2 bad
//! arguments.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use keel_sim::{BreakMode, FaultKind, Faults, Firings, Report, Shrunk, Simulation, StoreKind};
use serde::Serialize;

use crate::output::progress;

/// Seeds a sweep runs when neither `--seed` nor `--seeds` is given.
const SEEDS_DEFAULT: u64 = 100;
/// Failing seeds listed in the output at most.
const FAILURES_LISTED_MAX: usize = 10;

/// Arguments of `keel sim`.
#[derive(clap::Args, Debug)]
pub(crate) struct SimArgs {
    /// Run this one seed (prints its trace hash).
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Run seeds 0..N [default: 100].
    #[arg(long)]
    seeds: Option<u64>,
    /// Fault kinds: `all`, `none`, or a comma list of kinds, each optionally
    /// with a fixed probability (`engine-crash=0.02`). Kinds: lease-expiry,
    /// redelivery, duplicate-result, late-result, reorder, worker-crash,
    /// outbox-redelivery, timer-skew, commit-failure, engine-crash,
    /// activity-failure, stray-command, silent-worker, slow-attempt,
    /// store-stop, process-pause, process-kill, lease-answer-lost,
    /// remote-copy, copy-lost-alive, taker-kill (those six with
    /// `--processes` 2 or more), slow-read, commit-answer-lost, store-stall.
    #[arg(long, default_value = "all", value_parser = parse_faults)]
    faults: Faults,
    /// Workflows per seed (the default mix: one of each of its shapes in
    /// order, then shapes drawn by weight). The default is one of each, so
    /// a plain `keel sim` runs every shape; fewer leave the last ones out.
    #[arg(long, default_value_t = keel_sim::workload::SHAPES.len() as u64,
        value_parser = clap::value_parser!(u64).range(1..=100_000))]
    workflows: u64,
    /// Store: `mem` (in-memory, unsynced tail dropped or torn on a crash),
    /// `rocksdb` (a temporary directory, reopened on a crash) or `mem-sync`.
    #[arg(long, default_value = "mem", value_parser = parse_store)]
    store: StoreKind,
    /// Engine processes sharing the store: with 2 or more, runs are spread
    /// over shards each process holds under a lease with a fencing epoch,
    /// and processes are frozen past their leases and killed.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=keel_sim::SIM_PROCESSES_MAX as u64))]
    processes: u64,
    /// Run a deliberately broken driver (proof that the checks can fail):
    /// no-attempt-dedupe, effect-before-commit, lose-unsynced-ack,
    /// skip-close-policy, redeliver-same-epoch, query-speculative,
    /// skip-fence (with `--processes` 2 or more). Stops at the first
    /// violating seed.
    #[arg(long = "break", value_parser = parse_break)]
    break_mode: Option<BreakMode>,
    /// Run only these instances of the default mix (indices, as a shrunk
    /// reproduction prints them).
    #[arg(long, value_delimiter = ',', requires = "seed")]
    only_workflows: Option<Vec<usize>>,
    /// Let only these fault firings happen (`kind#index,...`, as a shrunk
    /// reproduction prints them).
    #[arg(long, value_parser = parse_firings, requires = "seed")]
    firings: Option<Firings>,
    /// Print the trace of the seed (with `--seed`).
    #[arg(long, requires = "seed")]
    trace: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn parse_faults(s: &str) -> Result<Faults, String> {
    s.parse()
}

fn parse_store(s: &str) -> Result<StoreKind, String> {
    s.parse()
}

fn parse_break(s: &str) -> Result<BreakMode, String> {
    s.parse()
}

fn parse_firings(s: &str) -> Result<Firings, String> {
    s.parse()
}

#[derive(Serialize)]
struct FailedSeed {
    seed: u64,
    kind: String,
    at_ms: u64,
    detail: String,
    repro: String,
}

#[derive(Serialize)]
struct ShrunkOut {
    seed: u64,
    faults: String,
    workflows: Vec<usize>,
    firings: String,
    violation: String,
    runs: u32,
    repro: String,
}

#[derive(Serialize)]
struct SimOut {
    seeds: u64,
    passed: u64,
    failed: u64,
    violations: Vec<FailedSeed>,
    #[serde(skip_serializing_if = "Option::is_none")]
    trace_hash: Option<String>,
    sim_to_wall_ratio: f64,
    faults_fired: BTreeMap<&'static str, u64>,
    workflows: u64,
    store: &'static str,
    faults: String,
    #[serde(rename = "break")]
    break_mode: Option<&'static str>,
    wall_s: f64,
    virtual_s: f64,
    seeds_per_s: f64,
    commits: u64,
    engine_crashes: u64,
    outbox_messages: u64,
    processes: u64,
    takeovers: u64,
    shards_lost: u64,
    shards_released: u64,
    copies_lost: u64,
    shrunk: Option<ShrunkOut>,
}

pub(crate) fn run(args: SimArgs) -> anyhow::Result<ExitCode> {
    if args.break_mode.is_some() && args.store != StoreKind::Mem {
        anyhow::bail!("--break runs on --store mem only");
    }
    let seeds: Vec<u64> = match (args.seed, args.seeds) {
        (Some(s), _) => vec![s],
        (None, Some(n)) => (0..n).collect(),
        (None, None) => (0..SEEDS_DEFAULT).collect(),
    };
    let mut template = Simulation::new(0)
        .default_mix(args.workflows as usize)
        .faults(args.faults.clone())
        .store(args.store)
        .processes(args.processes as usize)
        .keep_trace(args.trace);
    if let Some(mode) = args.break_mode {
        template = template.break_engine(mode);
    }
    if let Some(keep) = &args.only_workflows {
        template = template.only_workflows(keep.clone());
    }
    if let Some(f) = &args.firings {
        template = template.firings(f.clone());
    }
    let bar = progress(seeds.len() as u64, "sim");
    let wall = Instant::now();
    let mut passed = 0u64;
    let mut failed: Vec<Report> = Vec::new();
    let mut failed_count = 0u64;
    let mut ran = 0u64;
    let mut fired: BTreeMap<&'static str, u64> =
        FaultKind::ALL.iter().map(|k| (k.name(), 0)).collect();
    let (mut virtual_ms, mut commits, mut crashes, mut outbox) = (0u64, 0u64, 0u64, 0u64);
    let (mut takeovers, mut shards_lost, mut shards_released) = (0u64, 0u64, 0u64);
    let mut copies_lost = 0u64;
    let mut single: Option<Report> = None;
    for &seed in &seeds {
        let report = template.clone().seed(seed).run()?;
        ran += 1;
        virtual_ms += report.virtual_ms;
        commits += report.commits;
        crashes += u64::from(report.engine_crashes);
        outbox += report.outbox_messages;
        takeovers += u64::from(report.takeovers);
        shards_lost += u64::from(report.shards_lost);
        shards_released += u64::from(report.shards_released);
        copies_lost += u64::from(report.copies_lost);
        for (k, n) in &report.faults_fired {
            *fired.entry(k.name()).or_default() += n;
        }
        bar.inc(1);
        let stop = !report.passed && args.break_mode.is_some();
        if report.passed {
            passed += 1;
        } else {
            failed_count += 1;
            if failed.len() < FAILURES_LISTED_MAX {
                failed.push(report.clone());
            }
        }
        if seeds.len() == 1 {
            single = Some(report);
        }
        if stop {
            break;
        }
    }
    bar.finish_and_clear();
    let wall_s = wall.elapsed().as_secs_f64();
    let shrunk: Option<(u64, Shrunk)> = match failed.first() {
        Some(r) => template.clone().seed(r.seed).shrink()?.map(|s| (r.seed, s)),
        None => None,
    };
    if args.trace {
        if let Some(r) = &single {
            for line in &r.trace {
                eprintln!("{line}");
            }
        }
    }
    let out = SimOut {
        seeds: ran,
        passed,
        failed: failed_count,
        violations: failed
            .iter()
            .flat_map(|r| {
                r.violations.iter().map(|v| FailedSeed {
                    seed: r.seed,
                    kind: v.kind.name().to_string(),
                    at_ms: v.at_ms,
                    detail: v.detail.clone(),
                    repro: r.repro.clone(),
                })
            })
            .collect(),
        trace_hash: single.as_ref().map(|r| format!("{:016x}", r.trace_hash)),
        sim_to_wall_ratio: if wall_s > 0.0 {
            virtual_ms as f64 / 1000.0 / wall_s
        } else {
            0.0
        },
        faults_fired: fired,
        workflows: args.workflows,
        store: args.store.name(),
        faults: args.faults.to_string(),
        break_mode: args.break_mode.map(BreakMode::name),
        wall_s,
        virtual_s: virtual_ms as f64 / 1000.0,
        seeds_per_s: if wall_s > 0.0 {
            ran as f64 / wall_s
        } else {
            0.0
        },
        commits,
        engine_crashes: crashes,
        outbox_messages: outbox,
        processes: args.processes,
        takeovers,
        shards_lost,
        shards_released,
        copies_lost,
        shrunk: shrunk.map(|(seed, s)| ShrunkOut {
            seed,
            faults: s.faults.to_string(),
            workflows: s.workflows.clone(),
            firings: s.firings.to_string(),
            violation: s.violation.to_string(),
            runs: s.runs,
            repro: s.repro,
        }),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_human(&out, &failed);
    }
    Ok(if failed_count == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn print_human(out: &SimOut, failed: &[Report]) {
    println!(
        "keel sim: {} seeds, {} passed, {} failed ({} workflows each, store {}, faults {}{})",
        out.seeds,
        out.passed,
        out.failed,
        out.workflows,
        out.store,
        out.faults,
        out.break_mode
            .map(|b| format!(", broken engine: {b}"))
            .unwrap_or_default()
    );
    if let Some(h) = &out.trace_hash {
        println!("trace hash {h}");
    }
    println!(
        "{:.1} s wall, {:.1} s virtual (x{:.0}), {:.1} seeds/s, {} commits, {} engine crashes",
        out.wall_s,
        out.virtual_s,
        out.sim_to_wall_ratio,
        out.seeds_per_s,
        out.commits,
        out.engine_crashes
    );
    if out.processes > 1 {
        println!(
            "{} processes per seed: {} shard takeovers, {} shards stopped on a lost lease, {} given up to rebalance, {} copies lost with a process that took them",
            out.processes, out.takeovers, out.shards_lost, out.shards_released, out.copies_lost
        );
    }
    let fired: Vec<String> = out
        .faults_fired
        .iter()
        .map(|(k, n)| format!("{k}={n}"))
        .collect();
    println!("faults fired: {}", fired.join(" "));
    for r in failed {
        print!("{r}");
    }
    if let Some(s) = &out.shrunk {
        println!(
            "shrunk (seed {}, {} runs): {} workflows, {} fault firings\n  {}\n  reproduce: {}",
            s.seed,
            s.runs,
            s.workflows.len(),
            if s.firings == "none" {
                0
            } else {
                s.firings.split(',').count()
            },
            s.violation,
            s.repro
        );
    }
}
