//! `keel demo`: keel's main job, with a real crash in the middle.
//!
//! The demo runs an order-processing application over N workflows in a
//! child process (`keel demo-worker`), kills that process with SIGKILL once
//! about 40% of the orders are done, starts it again on the same data
//! directory, and when every order has finished checks the log: every
//! workflow completed, none lost, no durable id committed twice.
//!
//! On PostgreSQL, `--processes N` starts N engine processes on the same
//! database instead: one holds the write lease and works, the others wait
//! as standbys. The demo SIGKILLs the working process once (a quarter of
//! the way), then the working process and a standby at once (half way),
//! starting a fresh standby for each process it killed. Three quarters of
//! the way it freezes the working process (SIGSTOP) until a standby has
//! taken over, then lets it go on (SIGCONT): the woken process must find
//! itself fenced, commit nothing more and exit. It reports how long each
//! takeover took from the kill or freeze to the new process working.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use keel::{Engine, EngineError, Payload, ReusePolicy};
use keel_storage::{DurableKey, RunStatus};
use serde::Serialize;

use crate::demo_app::{self, ProcessOrder, APPROVAL_CENTS_MIN};
use crate::output::{open_for_reading, progress};

/// Arguments of `keel demo`.
#[derive(clap::Args, Debug)]
pub(crate) struct DemoArgs {
    /// Where the engine keeps its log (RocksDB). A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
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
    /// Engine processes on one PostgreSQL database (one works, the others
    /// stand by); kills them as the module documentation says.
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// With `--processes`: the processes share the database's shards and
    /// all work at once (each starts and awaits its own slice of the
    /// orders; requests for a shard another process runs are relayed);
    /// the demo SIGKILLs one of them a quarter of the way and two at once
    /// half way, restarting each.
    #[arg(long, requires = "processes")]
    sharded: bool,
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
    /// Wait for the database's write lease as long as it takes.
    #[arg(long)]
    standby: bool,
    /// Share the database's shards with other engine processes; this one
    /// starts and awaits the orders `i` with `i % slots == slot`.
    #[arg(long)]
    sharded: bool,
    #[arg(long, default_value_t = 0)]
    slot: usize,
    #[arg(long, default_value_t = 1)]
    slots: usize,
}

/// Shards the sharded demo spreads runs over (the same in every process):
/// several per process, so that a killed process's shards spread over the
/// others.
const DEMO_SHARDS: usize = 12;

#[derive(Serialize)]
struct Summary {
    workflows: u64,
    completed: u64,
    lost: u64,
    duplicate_commits: u64,
    crashes: u32,
    /// Seconds from each kill or freeze of the working process to the
    /// next one working (multi-process runs).
    takeovers_s: Vec<f64>,
    /// Frozen processes that found themselves fenced when woken
    /// (multi-process runs).
    fenced: u32,
    elapsed_s: f64,
    workflows_per_s: f64,
    verify_ok: bool,
    data: String,
    example_instance: String,
}

fn worker_command(exe: &Path, args: &DemoArgs, prefix: &str, standby: bool) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("demo-worker")
        .arg("--data")
        .arg(&args.data)
        .arg("--prefix")
        .arg(prefix)
        .arg("--workflows")
        .arg(args.workflows.to_string())
        .arg("--concurrency")
        .arg(args.concurrency.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if standby {
        cmd.arg("--standby");
    }
    cmd
}

/// What a worker process's output said; processes are named by their
/// slot and the generation of the process in it (a killed process's
/// replacement has the next one).
enum Heard {
    /// It holds the lease and works.
    Working(usize, u64),
    /// It found its lease taken over (after a freeze) and stopped.
    Fenced(usize, u64),
    /// `done N`.
    Done(u64),
    /// Its output ended (it exited or was killed).
    Gone(usize, u64),
}

/// Several engine processes on one database: see the module documentation.
fn run_processes(
    args: &DemoArgs,
    exe: &Path,
    prefix: &str,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<Disruptions> {
    let (tx, rx) = std::sync::mpsc::channel::<Heard>();
    type Slots = Vec<Option<(u64, std::process::Child)>>;
    let mut slots: Slots = Vec::new();
    let mut generation = 0u64;
    let mut spawn = |slot: usize, slots: &mut Slots| -> anyhow::Result<()> {
        generation += 1;
        let gen = generation;
        let mut child = worker_command(exe, args, prefix, true)
            .spawn()
            .context("starting an engine process")?;
        let stdout = child.stdout.take().context("engine stdout")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let heard = if line == "working" {
                    Heard::Working(slot, gen)
                } else if line == "fenced" {
                    Heard::Fenced(slot, gen)
                } else if let Some(n) = line.strip_prefix("done ").and_then(|n| n.parse().ok()) {
                    Heard::Done(n)
                } else {
                    continue;
                };
                if tx.send(heard).is_err() {
                    return;
                }
            }
            let _ = tx.send(Heard::Gone(slot, gen));
        });
        if slot == slots.len() {
            slots.push(Some((gen, child)));
        } else {
            slots[slot] = Some((gen, child));
        }
        Ok(())
    };
    for slot in 0..args.processes {
        spawn(slot, &mut slots)?;
    }
    let (kill_one_at, kill_two_at) = ((args.workflows / 4).max(1), (args.workflows / 2).max(2));
    let freeze_at = (args.workflows * 3 / 4).max(3);
    let mut working: Option<usize> = None;
    let mut killed_at: Option<Instant> = None;
    let mut takeovers = Vec::new();
    let mut crashes = 0u32;
    let mut done = 0u64;
    // The frozen process (slot, generation, pid) until a standby took over.
    let mut frozen: Option<(usize, u64, u32)> = None;
    // The frozen process once woken, until it reports itself fenced.
    let mut woken: Option<(usize, u64)> = None;
    let mut fenced = 0u32;
    let finished = loop {
        let heard = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .context("no engine process said anything for 120 s")?;
        match heard {
            Heard::Working(slot, gen) => {
                if slots[slot].as_ref().is_none_or(|(g, _)| *g != gen) {
                    // Said by a process killed since.
                    continue;
                }
                working = Some(slot);
                if let Some(at) = killed_at.take() {
                    let s = at.elapsed().as_secs_f64();
                    bar.suspend(|| eprintln!("process {slot} took over {s:.2} s after the kill"));
                    takeovers.push(s);
                }
                if let Some((f, gen, pid)) = frozen.take() {
                    // Wake the frozen one: it must find itself fenced.
                    signal(pid, "CONT")?;
                    woken = Some((f, gen));
                    bar.suspend(|| eprintln!("woke engine process {f} (SIGCONT)"));
                }
            }
            Heard::Fenced(slot, gen) => {
                if slots[slot].as_ref().is_none_or(|(g, _)| *g != gen) {
                    continue;
                }
                fenced += 1;
                woken = None;
                bar.suspend(|| {
                    eprintln!("engine process {slot} found its lease taken over and stopped")
                });
                if let Some((_, mut c)) = slots[slot].take() {
                    let _ = c.wait();
                }
                spawn(slot, &mut slots)?;
            }
            Heard::Done(n) => {
                done = done.max(n);
                bar.set_position(done);
                let victims: Vec<usize> = match (working, crashes) {
                    (Some(w), 0) if !args.no_crash && done >= kill_one_at => vec![w],
                    (Some(w), 1) if !args.no_crash && done >= kill_two_at => {
                        let other = (0..slots.len()).find(|s| *s != w).unwrap_or(w);
                        vec![w, other]
                    }
                    _ => Vec::new(),
                };
                if !args.no_crash && crashes == 2 && frozen.is_none() && done >= freeze_at {
                    if let Some(w) = working.take() {
                        let Some((gen, child)) = slots[w].as_ref() else {
                            continue;
                        };
                        signal(child.id(), "STOP")?;
                        frozen = Some((w, *gen, child.id()));
                        crashes += 1;
                        killed_at = Some(Instant::now());
                        bar.suspend(|| {
                            eprintln!(
                                "froze engine process {w} (SIGSTOP) after {done} of {} orders",
                                args.workflows
                            )
                        });
                    }
                }
                if !victims.is_empty() {
                    for &v in &victims {
                        if let Some((_, mut c)) = slots[v].take() {
                            c.kill().context("killing an engine process")?;
                            let _ = c.wait();
                        }
                    }
                    crashes += 1;
                    working = None;
                    killed_at = Some(Instant::now());
                    bar.suspend(|| {
                        eprintln!(
                            "killed engine process{} {victims:?} (SIGKILL) after {done} of {} orders",
                            if victims.len() > 1 { "es" } else { "" },
                            args.workflows
                        )
                    });
                    for v in victims {
                        spawn(v, &mut slots)?;
                    }
                }
            }
            Heard::Gone(slot, gen) => {
                if slots[slot].as_ref().is_none_or(|(g, _)| *g != gen) {
                    // One the demo killed: its replacement runs in the slot.
                    continue;
                }
                let Some((_, mut child)) = slots[slot].take() else {
                    continue;
                };
                let status = child.wait()?;
                if !status.success() {
                    anyhow::bail!("engine process {slot} failed: {status}");
                }
                break done >= args.workflows;
            }
        }
    };
    // The woken process may not have noticed yet that it was fenced (the
    // others can finish first): wait for it to say so.
    if let Some((slot, gen)) = woken.filter(|_| finished) {
        let until = Instant::now() + std::time::Duration::from_secs(30);
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match rx.recv_timeout(left) {
                Ok(Heard::Fenced(s, g)) if (s, g) == (slot, gen) => {
                    fenced += 1;
                    break;
                }
                Ok(Heard::Gone(s, g)) if (s, g) == (slot, gen) => break,
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }
    // The standbys still wait for the lease; the work is done.
    if let Some((_, _, pid)) = frozen {
        let _ = signal(pid, "CONT");
    }
    for (_, mut c) in slots.into_iter().flatten() {
        let _ = c.kill();
        let _ = c.wait();
    }
    if !finished {
        anyhow::bail!("the working process exited before every order was done");
    }
    Ok(Disruptions {
        crashes,
        takeovers,
        fenced,
    })
}

/// What a multi-process demo did to its processes.
struct Disruptions {
    /// Kills and freezes.
    crashes: u32,
    /// Seconds from each kill or freeze to the next process working.
    takeovers: Vec<f64>,
    /// Frozen processes that found themselves fenced when woken.
    fenced: u32,
}

/// Several engine processes sharing the database's shards, all working:
/// process `slot` starts and awaits its slice of the orders. One is
/// SIGKILLed a quarter of the way and two at once half way; each is
/// started again (as a new member, which gets shards back as the others
/// give them up). Every process must exit cleanly once its slice is done.
fn run_sharded(
    args: &DemoArgs,
    exe: &Path,
    prefix: &str,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<Disruptions> {
    // (slot, generation, `done N` or `None` once its output ended)
    let (tx, rx) = std::sync::mpsc::channel::<(usize, u64, Option<u64>)>();
    let mut slots: Vec<Option<(u64, std::process::Child)>> = Vec::new();
    let mut generation = 0u64;
    let mut spawn = |slot: usize| -> anyhow::Result<(u64, std::process::Child)> {
        generation += 1;
        let gen = generation;
        let mut child = worker_command(exe, args, prefix, false)
            .arg("--sharded")
            .args(["--slot", &slot.to_string()])
            .args(["--slots", &args.processes.to_string()])
            .spawn()
            .context("starting an engine process")?;
        let stdout = child.stdout.take().context("engine stdout")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(n) = line.strip_prefix("done ").and_then(|n| n.parse().ok()) {
                    if tx.send((slot, gen, Some(n))).is_err() {
                        return;
                    }
                }
            }
            let _ = tx.send((slot, gen, None));
        });
        Ok((gen, child))
    };
    for slot in 0..args.processes {
        slots.push(Some(spawn(slot)?));
    }
    // Per slot, the most orders of its slice any of its processes saw done
    // (a restarted one counts the finished ones again).
    let mut done = vec![0u64; args.processes];
    let mut finished = vec![false; args.processes];
    let (kill_one_at, kill_two_at) = ((args.workflows / 4).max(1), (args.workflows / 2).max(2));
    let mut crashes = 0u32;
    while !finished.iter().all(|f| *f) {
        let (slot, gen, heard) = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .context("no engine process said anything for 120 s")?;
        if slots[slot].as_ref().is_none_or(|(g, _)| *g != gen) {
            continue; // said by a process killed since
        }
        let Some(n) = heard else {
            let Some((_, mut child)) = slots[slot].take() else {
                continue;
            };
            let status = child.wait()?;
            anyhow::ensure!(status.success(), "engine process {slot} failed: {status}");
            finished[slot] = true;
            continue;
        };
        done[slot] = done[slot].max(n);
        let total: u64 = done.iter().sum();
        bar.set_position(total);
        let victims: Vec<usize> = match crashes {
            0 if !args.no_crash && total >= kill_one_at => vec![0],
            1 if !args.no_crash && total >= kill_two_at => {
                (1..=2).map(|s| s % args.processes).collect()
            }
            _ => Vec::new(),
        };
        let victims: Vec<usize> = victims.into_iter().filter(|v| !finished[*v]).collect();
        if victims.is_empty() {
            continue;
        }
        crashes += 1;
        for &v in &victims {
            if let Some((_, mut c)) = slots[v].take() {
                c.kill().context("killing an engine process")?;
                let _ = c.wait();
            }
        }
        bar.suspend(|| {
            eprintln!(
                "killed engine process{} {victims:?} (SIGKILL) after {total} of {} orders; starting them again",
                if victims.len() > 1 { "es" } else { "" },
                args.workflows
            )
        });
        for v in victims {
            slots[v] = Some(spawn(v)?);
        }
    }
    Ok(Disruptions {
        crashes,
        takeovers: Vec::new(),
        fenced: 0,
    })
}

/// Sends `SIGNAL` (`STOP`, `CONT`) to a process.
fn signal(pid: u32, name: &str) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .context("running kill")?;
    anyhow::ensure!(status.success(), "kill -{name} {pid} failed: {status}");
    Ok(())
}

pub(crate) fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let prefix = format!(
        "order-{}",
        SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis()
    );
    let exe = std::env::current_exe().context("locating the keel binary")?;
    let bar = progress(args.workflows, "orders");
    if args.processes > 1 {
        if crate::output::postgres_of(&args.data).is_none() {
            anyhow::bail!(
                "--processes needs a PostgreSQL store (--store postgres://...): a data directory is opened by one process"
            );
        }
        let started = Instant::now();
        let disruptions = if args.sharded {
            run_sharded(&args, &exe, &prefix, &bar)?
        } else {
            run_processes(&args, &exe, &prefix, &bar)?
        };
        bar.finish_and_clear();
        let mut summary = check(
            &args,
            &prefix,
            disruptions.crashes,
            disruptions.takeovers,
            started.elapsed().as_secs_f64(),
        )?;
        summary.fenced = disruptions.fenced;
        return report(&args, summary);
    }
    let kill_at = (args.workflows * 2 / 5).max(1);
    let started = Instant::now();
    let mut crashes = 0u32;
    loop {
        let mut child = worker_command(&exe, &args, &prefix, false)
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
    let summary = check(&args, &prefix, crashes, Vec::new(), elapsed)?;
    report(&args, summary)
}

/// Prints the summary; exit code 1 when anything was lost or duplicated.
fn report(args: &DemoArgs, summary: Summary) -> anyhow::Result<ExitCode> {
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
        if args.sharded {
            println!(
                "  engine processes    {} sharing one database's {DEMO_SHARDS} shards, all working",
                args.processes
            );
            println!(
                "  kills               {} (SIGKILL one process, then two at once; each started again)",
                summary.crashes
            );
        } else if args.processes > 1 {
            println!(
                "  engine processes    {} on one database (one works, the others stand by)",
                args.processes
            );
            println!(
                "  kills and freezes   {} (SIGKILL the working process, then it and a standby at once; SIGSTOP the working one past its lease)",
                summary.crashes
            );
            println!(
                "  fenced on waking    {} (the frozen process committed nothing more and stopped)",
                summary.fenced
            );
            let takeovers: Vec<String> = summary
                .takeovers_s
                .iter()
                .map(|s| format!("{s:.2} s"))
                .collect();
            println!(
                "  takeovers           {} (from each kill or freeze to the next process working)",
                takeovers.join(", ")
            );
        } else {
            println!(
                "  engine crashes      {} (SIGKILL, then restart on the same data)",
                summary.crashes
            );
        }
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
        if crate::output::postgres_of(&args.data).is_some() {
            println!("  (with the database's password in place of ***)");
        }
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

fn check(
    args: &DemoArgs,
    prefix: &str,
    crashes: u32,
    takeovers_s: Vec<f64>,
    elapsed: f64,
) -> anyhow::Result<Summary> {
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
        takeovers_s,
        elapsed_s: elapsed,
        workflows_per_s: args.workflows as f64 / elapsed.max(1e-9),
        verify_ok: report.ok,
        fenced: 0,
        data: crate::output::shown(&args.data),
        example_instance: format!("{prefix}-9"),
    })
}

/// The engine process: starts (or re-attaches to) every order, approves the
/// large ones, and prints `done N` as orders finish.
pub(crate) fn worker(args: WorkerArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.slot < args.slots.max(1),
        "--slot {} is not below --slots {}",
        args.slot,
        args.slots
    );
    let builder = match crate::output::postgres_of(&args.data) {
        Some(options) if args.sharded => Engine::builder()
            .postgres_options(options.sharded())
            .config(keel::EngineConfig {
                shards: DEMO_SHARDS,
                ..keel::EngineConfig::default()
            }),
        None if args.sharded => anyhow::bail!("--sharded needs a PostgreSQL store"),
        Some(options) if args.standby => Engine::builder().postgres_options(options.standby()),
        Some(options) => Engine::builder().postgres_options(options),
        None => Engine::builder().data_dir(&args.data),
    };
    let engine = builder
        .workflows(&demo_app::workflows())
        .register_activity::<demo_app::ChargeCard>()
        .register_activity::<demo_app::ReserveInventory>()
        .register_activity::<demo_app::Ship>()
        .register_activity::<demo_app::Notify>()
        .build()?;
    // Holds the store (for PostgreSQL: the write lease) from here on.
    println!("working");
    std::io::stdout().flush()?;
    // A process frozen past its lease finds, once woken, that another took
    // the database over: it says so and stops at once (its engine commits
    // nothing more either way).
    let store = engine.store();
    std::thread::spawn(move || loop {
        if let keel_storage::StoreHealth::Failed {
            fault: keel_storage::WriteFault::Fenced,
            ..
        } = store.health()
        {
            println!("fenced");
            let _ = std::io::stdout().flush();
            std::process::exit(3);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    });
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let done = Arc::new(AtomicU64::new(0));
    let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let result: anyhow::Result<()> = rt.block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
        // Joined as they finish, not held to the end: a finished task's
        // memory is freed only once joined, so a long demo would otherwise
        // grow with the orders it ran (as `bench`'s client loops did).
        let mut tasks = tokio::task::JoinSet::new();
        let slots = args.slots.max(1);
        for i in (0..args.workflows).filter(|i| *i as usize % slots == args.slot) {
            let permit = sem.clone().acquire_owned().await?;
            let (client, done, out, prefix) = (
                client.clone(),
                done.clone(),
                out.clone(),
                args.prefix.clone(),
            );
            tasks.spawn(async move {
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
            });
            while let Some(finished) = tasks.try_join_next() {
                finished??;
            }
        }
        while let Some(finished) = tasks.join_next().await {
            finished??;
        }
        Ok(())
    });
    if result.is_err() {
        if let keel_storage::StoreHealth::Failed {
            fault: keel_storage::WriteFault::Fenced,
            ..
        } = engine.health()
        {
            // Its clients failed because the lease moved on: not a fault
            // of this demo.
            println!("fenced");
            std::io::stdout().flush()?;
            std::process::exit(3);
        }
    }
    result?;
    engine.shutdown_blocking();
    Ok(ExitCode::SUCCESS)
}
