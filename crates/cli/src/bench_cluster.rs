//! `keel bench w1 --store postgres://... --processes N`: W1 on N engine
//! processes sharing one database, each a child `keel` process that runs
//! its share of the shards and drives its share of the workflows.
//!
//! The children start, wait until the shards are spread over all of them
//! and say `ready <owner>`; the parent then tells them all to go at once
//! (a line on their stdin). Each says `done <n>` as it goes and finally
//! `result <json>`: every workflow's start time and latency. With
//! `--kill-one`, the parent SIGKILLs the first child a third of the way
//! through and watches the shard leases until the others hold every shard:
//! how long that took after the kill and after the killed leases ended,
//! and the latency of the workflows that were in flight meanwhile. Once
//! the others are done, an engine in the parent takes the shards and
//! awaits every workflow the killed process had started: each must
//! complete, and the database must verify clean (one terminal fact per
//! durable id), or the benchmark fails.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use keel::{Engine, EngineConfig};
use keel_storage::{PgOptions, PgStore, ShardLeases};
use serde::{Deserialize, Serialize};

use super::bench_pg::{ServerCounters, ServerLoad};
use super::{closed_loop, Noop, ThreeSteps};
use crate::output::{percentile, progress};

/// Shards the processes of a cluster benchmark spread runs over (every
/// process must count the same).
pub(crate) const BENCH_SHARDS: usize = 8;

/// How long the children may take to spread the shards between them.
const READY_WAIT_S: u64 = 60;

/// How long a child may stay silent before the benchmark gives up.
const SILENT_WAIT_S: u64 = 120;

/// How often the parent reads the shard leases during a takeover.
const TAKEOVER_POLL_MS: u64 = 20;

/// Arguments of the child process (`keel bench w1-process`, hidden).
#[derive(clap::Args, Debug)]
pub(crate) struct W1ProcessArgs {
    /// The database.
    #[arg(long)]
    store: String,
    /// The schema every process of the run shares.
    #[arg(long)]
    schema: String,
    /// This process's index among `slots`.
    #[arg(long)]
    slot: usize,
    /// Processes in the run.
    #[arg(long)]
    slots: usize,
    /// Workflows this process starts and awaits.
    #[arg(long)]
    workflows: u64,
    /// Workflows in flight at once from this process.
    #[arg(long)]
    concurrency: usize,
}

/// What a child reports at the end.
#[derive(Serialize, Deserialize)]
struct ChildResult {
    /// Per workflow: (start, unix ms; latency, ms).
    samples: Vec<(f64, f64)>,
}

/// How a killed process's shards were taken over.
#[derive(Serialize, Debug)]
pub(crate) struct Takeover {
    /// From the SIGKILL until the other processes held every shard.
    pub(crate) kill_to_taken_ms: f64,
    /// From the end of the killed process's last lease until then (the
    /// part keel controls; the lease itself is `shard_lease_ms`).
    pub(crate) lease_end_to_taken_ms: f64,
    /// Workflows of the surviving processes in flight during the takeover.
    pub(crate) workflows_during: usize,
    /// Their latency.
    pub(crate) p50_during_ms: f64,
    pub(crate) p99_during_ms: f64,
    /// Workflows the killed process had started (committed starts).
    pub(crate) killed_started: u64,
    /// Of those, completed after the takeover.
    pub(crate) killed_completed: u64,
    /// Runs `verify` walked in the database afterwards, all clean.
    pub(crate) verified_runs: u64,
}

/// How long the parent waits for one of the killed process's workflows.
const KILLED_RESULT_WAIT_S: u64 = 60;

/// After a `--kill-one` run: every workflow the killed process (`slot`,
/// `count` workflows) had started is awaited by an engine in this process,
/// which takes the shards over once the survivors left them, and must
/// complete; then the database must verify clean. (started, completed,
/// runs verified).
fn finish_killed(options: &PgOptions, slot: usize, count: u64) -> anyhow::Result<(u64, u64, u64)> {
    let engine = cluster_engine(options.clone())?;
    let store = engine.store();
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut started, mut completed) = (0, 0);
    for i in 0..count {
        let id = format!("w1-{slot}-{i}");
        if store.resolve(&id)?.is_none() {
            continue; // killed before its start committed
        }
        started += 1;
        let wait = Duration::from_secs(KILLED_RESULT_WAIT_S);
        // The timer is made inside the runtime: it needs its clock.
        let result = rt
            .block_on(async { tokio::time::timeout(wait, client.result::<ThreeSteps>(&id)).await });
        match result {
            Ok(Ok(_)) => completed += 1,
            Ok(Err(e)) => anyhow::bail!("workflow {id} of the killed process: {e}"),
            Err(_) => anyhow::bail!(
                "workflow {id} of the killed process did not complete within {KILLED_RESULT_WAIT_S} s of the takeover"
            ),
        }
    }
    let report = store.verify()?;
    engine.shutdown_blocking();
    anyhow::ensure!(
        report.ok,
        "the database does not verify after the takeover: {:?}",
        report.violations
    );
    Ok((started, completed, report.runs))
}

/// The result of a cluster run, folded into the W1 report.
pub(crate) struct ClusterRun {
    pub(crate) workflows: u64,
    pub(crate) wall_s: f64,
    pub(crate) sorted_ms: Vec<f64>,
    pub(crate) server: ServerLoad,
    pub(crate) takeover: Option<Takeover>,
}

fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        * 1000.0
}

/// An engine of the cluster: W1's workflow and activity, the benchmark's
/// shard count.
fn cluster_engine(options: PgOptions) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .postgres_options(options)
        .config(EngineConfig {
            shards: BENCH_SHARDS,
            ..EngineConfig::default()
        })
        .register_workflow::<ThreeSteps>()
        .register_activity::<Noop>()
        .build()?)
}

/// The child: one engine process of the cluster.
pub(crate) fn w1_process(args: W1ProcessArgs) -> anyhow::Result<ExitCode> {
    let options = PgOptions::new(&args.store)
        .schema(args.schema.clone())
        .sharded();
    let engine = cluster_engine(options)?;
    // Ready once every process holds some of the shards.
    let store = engine.store();
    let shared = store.shared().context("a sharded store is shared")?;
    let until = Instant::now() + Duration::from_secs(READY_WAIT_S);
    let owner = loop {
        let leases = shared.shard_leases()?;
        let owners: BTreeSet<&str> = leases.iter().map(|l| l.owner.as_str()).collect();
        let here = engine.shards_here();
        if leases.len() == BENCH_SHARDS && owners.len() == args.slots && !here.is_empty() {
            let mine = leases.iter().find(|l| l.shard == here[0]);
            break mine.map(|l| l.owner.clone()).context("a lease of ours")?;
        }
        anyhow::ensure!(
            Instant::now() < until,
            "the shards were not spread over {} processes in {READY_WAIT_S} s",
            args.slots
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    println!("ready {owner}");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go)?;
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let every = (args.workflows / 100).max(1);
    let slot = args.slot;
    let samples = rt.block_on(async {
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        closed_loop(args.concurrency as u64, args.workflows, move |i| {
            let (client, done) = (client.clone(), done.clone());
            async move {
                let (at, t0) = (unix_ms(), Instant::now());
                let id = format!("w1-{slot}-{i}");
                client.start::<ThreeSteps>(&id, &(i as u32)).await?;
                client.result::<ThreeSteps>(&id).await?;
                let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if n % every == 0 {
                    println!("done {n}");
                }
                Ok::<_, keel::EngineError>((at, t0.elapsed().as_secs_f64() * 1000.0))
            }
        })
        .await
    })?;
    println!(
        "result {}",
        serde_json::to_string(&ChildResult { samples })?
    );
    std::io::stdout().flush()?;
    engine.shutdown_blocking();
    Ok(ExitCode::SUCCESS)
}

/// What a child said.
enum Said {
    Ready(String),
    Done(u64),
    Result(ChildResult),
    Ended,
}

/// One child as the parent keeps it.
struct Proc {
    child: Child,
    owner: String,
    done: u64,
    result: Option<ChildResult>,
    killed: bool,
}

/// The parent: starts `processes` children on a fresh schema, runs W1
/// across them, and collects their samples.
pub(crate) fn run(
    url: &str,
    processes: usize,
    workflows: u64,
    concurrency: usize,
    kill_one: bool,
) -> anyhow::Result<ClusterRun> {
    anyhow::ensure!(
        (2..=BENCH_SHARDS).contains(&processes),
        "--processes takes 2 to {BENCH_SHARDS} (1 is the plain run)"
    );
    let schema = format!("bench_w1_cluster_{}", std::process::id());
    let options = PgOptions::new(url).schema(schema.clone()).sharded();
    // Created before the children race to create it.
    let watcher = PgStore::open(options.clone())?;
    let before = ServerCounters::read(&options)?;
    let exe = std::env::current_exe().context("locating the keel binary")?;
    let (tx, rx) = mpsc::channel::<(usize, Said)>();
    let mut procs = Vec::with_capacity(processes);
    for slot in 0..processes {
        let share = |n: u64| n / processes as u64 + u64::from((slot as u64) < n % processes as u64);
        let mut child = Command::new(&exe)
            .args(["bench", "w1-process", "--store", url, "--schema", &schema])
            .args([
                "--slot",
                &slot.to_string(),
                "--slots",
                &processes.to_string(),
            ])
            .args(["--workflows", &share(workflows).to_string()])
            .args([
                "--concurrency",
                &share(concurrency as u64).max(1).to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting an engine process")?;
        let stdout = child.stdout.take().context("engine stdout")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let said = if let Some(o) = line.strip_prefix("ready ") {
                    Said::Ready(o.to_string())
                } else if let Some(n) = line.strip_prefix("done ").and_then(|n| n.parse().ok()) {
                    Said::Done(n)
                } else if let Some(r) = line
                    .strip_prefix("result ")
                    .and_then(|r| serde_json::from_str(r).ok())
                {
                    Said::Result(r)
                } else {
                    continue;
                };
                if tx.send((slot, said)).is_err() {
                    return;
                }
            }
            let _ = tx.send((slot, Said::Ended));
        });
        procs.push(Proc {
            child,
            owner: String::new(),
            done: 0,
            result: None,
            killed: false,
        });
    }
    drop(tx);
    let outcome = drive(&mut procs, &rx, &watcher, workflows, kill_one);
    for p in &mut procs {
        let _ = p.child.kill();
        let _ = p.child.wait();
    }
    let outcome = outcome.and_then(|(wall_s, kill)| {
        std::thread::sleep(Duration::from_millis(1_100)); // the statistics views lag
        let server = before.load_until(&ServerCounters::read(&options)?, wall_s);
        Ok((wall_s, kill, server))
    });
    drop(watcher);
    let outcome = outcome.and_then(|(wall_s, kill, server)| {
        // Slot 0 was killed; its share of the workflows, as it was given.
        let share0 =
            workflows / processes as u64 + u64::from(!workflows.is_multiple_of(processes as u64));
        let killed = match kill {
            Some(_) => Some(finish_killed(&options, 0, share0)?),
            None => None,
        };
        Ok((wall_s, kill, server, killed))
    });
    let _ = PgStore::drop_schema(&options);
    let (wall_s, kill, server, killed) = outcome?;
    let samples: Vec<(f64, f64)> = procs
        .iter()
        .filter_map(|p| p.result.as_ref())
        .flat_map(|r| r.samples.iter().copied())
        .collect();
    let takeover = kill.map(|(killed_at, lease_end, taken_at)| {
        let mut during: Vec<f64> = samples
            .iter()
            .filter(|(at, ms)| *at <= taken_at && at + ms >= killed_at)
            .map(|(_, ms)| *ms)
            .collect();
        during.sort_by(|a, b| a.total_cmp(b));
        let (killed_started, killed_completed, verified_runs) = killed.unwrap_or_default();
        Takeover {
            killed_started,
            killed_completed,
            verified_runs,
            kill_to_taken_ms: taken_at - killed_at,
            lease_end_to_taken_ms: taken_at - lease_end,
            workflows_during: during.len(),
            p50_during_ms: percentile(&during, 0.50),
            p99_during_ms: percentile(&during, 0.99),
        }
    });
    let mut sorted_ms: Vec<f64> = samples.iter().map(|(_, ms)| *ms).collect();
    sorted_ms.sort_by(|a, b| a.total_cmp(b));
    Ok(ClusterRun {
        workflows: sorted_ms.len() as u64,
        wall_s,
        sorted_ms,
        server,
        takeover,
    })
}

/// (kill time, end of the killed leases, all shards taken again), unix ms.
type Kill = (f64, f64, f64);

/// Waits for the children to be ready, lets them go, kills one when asked
/// and waits for the others' results: the run's wall time and the kill.
fn drive(
    procs: &mut [Proc],
    rx: &mpsc::Receiver<(usize, Said)>,
    watcher: &PgStore,
    workflows: u64,
    kill_one: bool,
) -> anyhow::Result<(f64, Option<Kill>)> {
    let silent = Duration::from_secs(SILENT_WAIT_S);
    while procs.iter().any(|p| p.owner.is_empty()) {
        let (slot, said) = rx
            .recv_timeout(Duration::from_secs(READY_WAIT_S + 5))
            .context("the engine processes did not get ready")?;
        match said {
            Said::Ready(owner) => procs[slot].owner = owner,
            Said::Ended => anyhow::bail!("engine process {slot} ended before it was ready"),
            _ => {}
        }
    }
    let started = Instant::now();
    for p in procs.iter_mut() {
        let stdin = p.child.stdin.as_mut().context("engine stdin")?;
        stdin.write_all(b"go\n")?;
        stdin.flush()?;
    }
    let bar = progress(workflows, "w1");
    let mut kill: Option<Kill> = None;
    let mut watching: Option<(f64, f64)> = None;
    loop {
        let live = procs.iter().filter(|p| !p.killed && p.result.is_none());
        if live.count() == 0 && watching.is_none() {
            break;
        }
        let wait = if watching.is_some() {
            Duration::from_millis(TAKEOVER_POLL_MS)
        } else {
            silent
        };
        match rx.recv_timeout(wait) {
            Ok((slot, Said::Done(n))) => procs[slot].done = procs[slot].done.max(n),
            Ok((slot, Said::Result(r))) => procs[slot].result = Some(r),
            Ok((slot, Said::Ended)) => {
                anyhow::ensure!(
                    procs[slot].killed || procs[slot].result.is_some(),
                    "engine process {slot} ended without a result"
                );
            }
            Ok((_, Said::Ready(_))) => {}
            Err(mpsc::RecvTimeoutError::Timeout) if watching.is_some() => {}
            Err(e) => anyhow::bail!("waiting for the engine processes: {e}"),
        }
        let total: u64 = procs.iter().map(|p| p.done).sum();
        bar.set_position(total);
        if kill_one && kill.is_none() && watching.is_none() && total >= workflows / 3 {
            let victim = &mut procs[0];
            let leases = watcher.shard_leases()?;
            let lease_end = leases
                .iter()
                .filter(|l| l.owner == victim.owner)
                .map(|l| l.expires_at.0 as f64)
                .fold(0.0, f64::max);
            victim.child.kill().context("killing an engine process")?;
            let killed_at = unix_ms();
            let _ = victim.child.wait();
            victim.killed = true;
            bar.suspend(|| eprintln!("killed engine process 0 (SIGKILL) after {total} workflows"));
            watching = Some((killed_at, lease_end));
        }
        if let Some((killed_at, lease_end)) = watching {
            let leases = watcher.shard_leases()?;
            let now = unix_ms();
            let dead = &procs[0].owner;
            let taken = leases.len() == BENCH_SHARDS
                && leases
                    .iter()
                    .all(|l| &l.owner != dead && (l.expires_at.0 as f64) > now);
            if taken {
                kill = Some((killed_at, lease_end, now));
                watching = None;
                bar.suspend(|| {
                    eprintln!(
                        "its shards were taken over {:.0} ms after the kill ({:.0} ms after its leases ended)",
                        now - killed_at,
                        now - lease_end
                    )
                });
            }
        }
    }
    bar.finish_and_clear();
    Ok((started.elapsed().as_secs_f64(), kill))
}
