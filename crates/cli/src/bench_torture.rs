//! `keel bench torture`: kills the engine process (`keel demo-worker`)
//! with SIGKILL over and over, at pseudo-random moments from the creation
//! of its data directory to the middle of its commits, and checks after
//! every kill that the next engine opens the directory (no brick, no
//! damage, no lost acknowledged commit) and that, once a round of kills is
//! over and the engine runs to the end, every workflow completed once: one
//! committed result per activity execution (activities themselves run at
//! least once), one run per instance, and `verify` clean. The long form of
//! the crash tests that run in CI.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_storage::{Durability, EventKind, RocksStore, RunStatus, Store};

use keel_cli::output::progress;

/// Arguments of `keel bench torture`.
#[derive(clap::Args, Debug)]
pub(crate) struct TortureArgs {
    /// Kills in all.
    #[arg(long, default_value_t = 1000)]
    cycles: u32,
    /// Kills per round; each round starts a new data directory (so its
    /// first kill lands in the directory's creation) and ends with a run
    /// to completion and the exactly-once checks.
    #[arg(long, default_value_t = 20)]
    kills_per_round: u32,
    /// Workflows per round.
    #[arg(long, default_value_t = 300)]
    workflows: u64,
    /// Longest time before a kill, in milliseconds.
    #[arg(long, default_value_t = 400)]
    kill_ms_max: u64,
    /// Seed of the kill times (the same seed kills at the same moments).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where the rounds' directories go (default: a temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct TortureOut {
    cycles: u32,
    rounds: u32,
    workflows_completed: u64,
    reopens: u32,
    failures: Vec<String>,
    elapsed_s: f64,
}

pub(crate) fn torture(args: TortureArgs) -> anyhow::Result<ExitCode> {
    let exe = std::env::current_exe().context("locating the keel binary")?;
    let temp;
    let root = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            temp = tempfile::tempdir()?;
            temp.path().to_path_buf()
        }
    };
    let per_round = args.kills_per_round.max(1);
    let bar = progress(u64::from(args.cycles), "kills");
    let started = Instant::now();
    let mut state = args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = TortureOut {
        cycles: 0,
        rounds: 0,
        workflows_completed: 0,
        reopens: 0,
        failures: Vec::new(),
        elapsed_s: 0.0,
    };
    while out.cycles < args.cycles && out.failures.is_empty() {
        let round = out.rounds;
        out.rounds += 1;
        let data = root.join(format!("round-{round}"));
        let prefix = format!("t{round}");
        let kills = per_round.min(args.cycles - out.cycles);
        for k in 0..kills {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // The first kill of a round lands while the directory is made.
            let delay = if k == 0 {
                state % 60
            } else {
                state % args.kill_ms_max.max(1)
            };
            let mut child = worker(&exe, &data, &prefix, args.workflows).spawn()?;
            std::thread::sleep(Duration::from_millis(delay));
            let _ = child.kill();
            child.wait()?;
            out.cycles += 1;
            bar.inc(1);
            // The next engine must open it: read-write, as it would.
            if data.exists() {
                match RocksStore::open(&data, Durability::Sync) {
                    Ok(store) => {
                        out.reopens += 1;
                        drop(store);
                    }
                    Err(e) => out.failures.push(format!(
                        "round {round}, kill {k} after {delay} ms: the directory does not open: {e}"
                    )),
                }
            }
            if !out.failures.is_empty() {
                break;
            }
        }
        if !out.failures.is_empty() {
            break;
        }
        let status = worker(&exe, &data, &prefix, args.workflows).status()?;
        if !status.success() {
            out.failures
                .push(format!("round {round}: the final run failed: {status}"));
            break;
        }
        match check_round(&data, &prefix, args.workflows) {
            Ok(()) => {
                out.workflows_completed += args.workflows;
                let _ = std::fs::remove_dir_all(&data);
            }
            Err(e) => out
                .failures
                .push(format!("round {round} ({}): {e:#}", data.display())),
        }
    }
    bar.finish_and_clear();
    out.elapsed_s = started.elapsed().as_secs_f64();
    if args.json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!(
            "keel bench torture: {} kills in {} rounds, {} reopens, {} workflows completed once (one result per activity execution), {:.1} s",
            out.cycles, out.rounds, out.reopens, out.workflows_completed, out.elapsed_s
        );
        for f in &out.failures {
            println!("FAILED {f}");
        }
    }
    if out.failures.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        // Keep the failing round's directory for inspection.
        if args.dir.is_none() {
            let kept = std::env::temp_dir().join(format!("keel-torture-{}", std::process::id()));
            let _ = std::fs::rename(&root, &kept);
            eprintln!("kept the directories in {}", kept.display());
        }
        Ok(ExitCode::from(1))
    }
}

fn worker(exe: &Path, data: &Path, prefix: &str, workflows: u64) -> Command {
    let mut c = Command::new(exe);
    c.args(["demo-worker", "--prefix", prefix, "--workflows"])
        .arg(workflows.to_string())
        .args(["--concurrency", "50", "--data"])
        .arg(data)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

/// Every workflow of the round completed, one committed result per
/// activity execution, one run per instance, and `verify` is clean.
fn check_round(data: &Path, prefix: &str, workflows: u64) -> anyhow::Result<()> {
    let store = RocksStore::open_read_only(data)?;
    let report = store.verify()?;
    anyhow::ensure!(report.ok, "verify: {:?}", report.violations);
    anyhow::ensure!(
        report.runs == workflows,
        "{} runs for {workflows} instances: an instance ran twice",
        report.runs
    );
    for i in 0..workflows {
        let id = format!("{prefix}-{i}");
        let run = store.resolve(&id)?.context(format!("{id} never started"))?;
        let meta = store.run_meta(run)?.context("no run record")?;
        anyhow::ensure!(
            meta.status == RunStatus::Completed,
            "{id}: {:?}",
            meta.status
        );
        let mut results: BTreeMap<u32, u32> = BTreeMap::new();
        for e in store.history(run)? {
            if let EventKind::ActivityCompleted { step, .. } = e.kind {
                *results.entry(step.0).or_default() += 1;
            }
        }
        anyhow::ensure!(
            results.values().all(|n| *n == 1) && results.len() == 4,
            "{id}: completions per step {results:?}"
        );
    }
    Ok(())
}
