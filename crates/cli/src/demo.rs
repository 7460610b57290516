//! `keel demo`: keel's main job, with a real crash in the middle.
//!
//! The demo runs an order-processing application over N workflows in a
//! child process (`keel demo-worker`), kills that process with SIGKILL once
//! about 40% of the orders are done, starts it again on the same data
//! directory, and when every order has finished checks the log: every
//! workflow completed, none lost, no durable id committed twice.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use keel::{Engine, EngineError, Payload, ReusePolicy};
use keel_storage::{DurableKey, RunStatus, Store};
use serde::Serialize;

use crate::demo_app::{self, ProcessOrder, APPROVAL_CENTS_MIN};
use crate::output::{open_for_reading, progress};

/// Arguments of `keel demo`.
#[derive(clap::Args, Debug)]
pub(crate) struct DemoArgs {
    /// Where the engine keeps its log (RocksDB).
    #[arg(long, default_value = "keel-data")]
    data: PathBuf,
    /// How many orders to process.
    #[arg(long, default_value_t = 1000)]
    workflows: u64,
    /// Orders in flight at once.
    #[arg(long, default_value_t = 200)]
    concurrency: usize,
    /// Do not kill the engine mid-way.
    #[arg(long)]
    no_crash: bool,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    json: bool,
}

/// Arguments of the hidden `keel demo-worker`.
#[derive(clap::Args, Debug)]
pub(crate) struct WorkerArgs {
    #[arg(long)]
    data: PathBuf,
    #[arg(long)]
    prefix: String,
    #[arg(long)]
    workflows: u64,
    #[arg(long)]
    concurrency: usize,
}

#[derive(Serialize)]
struct Summary {
    workflows: u64,
    completed: u64,
    lost: u64,
    duplicate_commits: u64,
    crashes: u32,
    elapsed_s: f64,
    workflows_per_s: f64,
    verify_ok: bool,
    data: String,
    example_instance: String,
}

pub(crate) fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let prefix = format!(
        "order-{}",
        SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis()
    );
    let exe = std::env::current_exe().context("locating the keel binary")?;
    let bar = progress(args.workflows, "orders");
    let kill_at = (args.workflows * 2 / 5).max(1);
    let started = Instant::now();
    let mut crashes = 0u32;
    loop {
        let mut child = Command::new(&exe)
            .arg("demo-worker")
            .arg("--data")
            .arg(&args.data)
            .arg("--prefix")
            .arg(&prefix)
            .arg("--workflows")
            .arg(args.workflows.to_string())
            .arg("--concurrency")
            .arg(args.concurrency.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the engine process")?;
        let stdout = child.stdout.take().context("engine stdout")?;
        let mut killed = false;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            if let Some(n) = line
                .strip_prefix("done ")
                .and_then(|n| n.parse::<u64>().ok())
            {
                bar.set_position(n);
                if !args.no_crash && crashes == 0 && n >= kill_at {
                    child.kill().context("killing the engine process")?;
                    killed = true;
                    break;
                }
            }
        }
        let status = child.wait()?;
        if killed {
            crashes += 1;
            let at = bar.position();
            bar.suspend(|| {
                eprintln!(
                    "killed the engine process (SIGKILL) after {at} of {} orders; restarting it on the same data",
                    args.workflows
                )
            });
            continue;
        }
        if !status.success() {
            anyhow::bail!("the engine process failed: {status}");
        }
        break;
    }
    bar.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();
    let summary = check(&args, &prefix, crashes, elapsed)?;
    let ok = summary.lost == 0 && summary.duplicate_commits == 0 && summary.verify_ok;
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        println!(
            "keel demo: order processing over {} workflows",
            summary.workflows
        );
        println!("  completed           {}", summary.completed);
        println!("  lost                {}", summary.lost);
        println!("  duplicate commits   {}", summary.duplicate_commits);
        println!(
            "  engine crashes      {} (SIGKILL, then restart on the same data)",
            summary.crashes
        );
        println!(
            "  log verified        {}",
            if summary.verify_ok {
                "ok"
            } else {
                "VIOLATIONS"
            }
        );
        println!(
            "  elapsed             {:.2} s ({:.0} workflows/s)",
            summary.elapsed_s, summary.workflows_per_s
        );
        println!();
        println!("Look at one order:");
        println!(
            "  keel show {} --data {}",
            summary.example_instance, summary.data
        );
        println!(
            "  keel describe {} --data {}",
            summary.example_instance, summary.data
        );
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn check(args: &DemoArgs, prefix: &str, crashes: u32, elapsed: f64) -> anyhow::Result<Summary> {
    let store = open_for_reading(&args.data)?;
    let mut completed = 0;
    let mut duplicates = 0;
    for i in 0..args.workflows {
        let id = format!("{prefix}-{i}");
        let Some(run) = store.resolve(&id)? else {
            continue;
        };
        if store
            .run_meta(run)?
            .is_some_and(|m| m.status == RunStatus::Completed)
        {
            completed += 1;
        }
        // Count terminal events per durable id straight from the history.
        let mut seen: std::collections::HashSet<DurableKey> = Default::default();
        for e in store.history(run)? {
            for k in e.kind.terminal_keys() {
                if !seen.insert(k) {
                    duplicates += 1;
                }
            }
        }
    }
    let report = store.verify()?;
    let dup_violations = report
        .violations
        .iter()
        .filter(|v| matches!(v, keel_storage::Violation::DuplicateTerminal { .. }))
        .count() as u64;
    Ok(Summary {
        workflows: args.workflows,
        completed,
        lost: args.workflows - completed,
        duplicate_commits: duplicates + dup_violations,
        crashes,
        elapsed_s: elapsed,
        workflows_per_s: args.workflows as f64 / elapsed.max(1e-9),
        verify_ok: report.ok,
        data: args.data.display().to_string(),
        example_instance: format!("{prefix}-9"),
    })
}

/// The engine process: starts (or re-attaches to) every order, approves the
/// large ones, and prints `done N` as orders finish.
pub(crate) fn worker(args: WorkerArgs) -> anyhow::Result<ExitCode> {
    let engine = Engine::builder()
        .data_dir(&args.data)
        .workflows(&demo_app::workflows())
        .register_activity::<demo_app::ChargeCard>()
        .register_activity::<demo_app::ReserveInventory>()
        .register_activity::<demo_app::Ship>()
        .register_activity::<demo_app::Notify>()
        .build()?;
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let done = Arc::new(AtomicU64::new(0));
    let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let result: anyhow::Result<()> = rt.block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
        let mut tasks = Vec::new();
        for i in 0..args.workflows {
            let permit = sem.clone().acquire_owned().await?;
            let (client, done, out, prefix) = (
                client.clone(),
                done.clone(),
                out.clone(),
                args.prefix.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let _permit = permit;
                let id = format!("{prefix}-{i}");
                let order = demo_app::order(i);
                let input = Payload::encode(&order).map_err(|e| anyhow::anyhow!(e))?;
                let fresh = match client
                    .start_raw("demo.order", &id, input, None, ReusePolicy::RejectDuplicate)
                    .await
                {
                    Ok(_) => true,
                    Err(EngineError::AlreadyClosed { .. }) => false,
                    Err(e) => return Err(anyhow::anyhow!("starting {id}: {e}")),
                };
                if fresh {
                    if order.cents >= APPROVAL_CENTS_MIN {
                        let cmd = format!("approve-{id}");
                        match client
                            .signal(&id, "approve", &"ops-team".to_string(), Some(&cmd))
                            .await
                        {
                            Ok(()) | Err(EngineError::RunClosed { .. }) => {}
                            Err(e) => return Err(anyhow::anyhow!("approving {id}: {e}")),
                        }
                    }
                    client
                        .result::<ProcessOrder>(&id)
                        .await
                        .map_err(|e| anyhow::anyhow!("order {id}: {e}"))?;
                }
                let n = done.fetch_add(1, Ordering::SeqCst) + 1;
                let mut out = out.lock().map_err(|_| anyhow::anyhow!("stdout poisoned"))?;
                writeln!(out, "done {n}")?;
                out.flush()?;
                Ok::<(), anyhow::Error>(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        Ok(())
    });
    result?;
    engine.shutdown_blocking();
    Ok(ExitCode::SUCCESS)
}
