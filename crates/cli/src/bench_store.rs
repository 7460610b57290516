//! `keel bench append` and `keel bench read`: the storage layer alone,
//! without the engine. Each workload gets a fresh temporary directory.
//!
//! `append` runs OS threads ("committers"), each looping
//! `store.commit(CommitBatch::append(run, events)).wait()` on a run of its
//! own, for a fixed time per workload. Beside each workload it measures the
//! disk's own single-writer fsync rate in the same directory (write + fdatasync
//! of a small record, in a loop): the physical floor that group commit must
//! beat by sharing one fsync among many commits.
//!
//! `read` writes a log of N events (runs of 100 events), flushes it to SST
//! files, closes the store, reopens it read-only and decodes every event:
//! once as a full scan of the events family, once run by run through
//! `Store::for_each_event` (a cursor per run), and once as replay reads
//! them, through `Store::for_each_history` (one cursor for all runs, in
//! the order of their ids).
//!
//! With `--json`, each workload prints one JSON object on its own line
//! (JSON Lines), as soon as it is measured.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use keel_storage::codec::{self, RecordKind};
use keel_storage::event::{attempt_of, execution_of};
use keel_storage::keys::Cf;
use keel_storage::{
    AttemptNo, CommitBatch, Durability, Event, EventKind, InstanceId, Payload, RocksStore,
    RunFilter, RunId, Seq, Step, Store, Timestamp,
};
use serde::Serialize;

use crate::output::percentile;

/// Arguments of `keel bench append`.
#[derive(clap::Args, Debug)]
pub(crate) struct AppendArgs {
    /// Seconds each workload commits for.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Seconds of the fsync-rate measurement beside each workload.
    #[arg(long, default_value_t = 1.0)]
    fsync_seconds: f64,
    /// Concurrent committers (comma-separated list).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 256])]
    committers: Vec<usize>,
    /// Events per commit (comma-separated list).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 10])]
    events: Vec<usize>,
    /// Durability modes (comma-separated: sync, buffered).
    #[arg(long, value_delimiter = ',', default_values_t = [Mode::Sync, Mode::Buffered])]
    mode: Vec<Mode>,
    /// Print one JSON object per workload, one per line.
    #[arg(long)]
    json: bool,
}

/// A durability mode on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Fsync before acknowledging.
    Sync,
    /// WAL write without fsync.
    Buffered,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Sync => "sync",
            Mode::Buffered => "buffered",
        })
    }
}

impl Mode {
    fn durability(self) -> Durability {
        match self {
            Mode::Sync => Durability::Sync,
            Mode::Buffered => Durability::Buffered,
        }
    }
}

#[derive(Serialize)]
struct AppendReport {
    workload: String,
    durability: String,
    committers: usize,
    events_per_commit: usize,
    seconds: f64,
    commits: u64,
    events: u64,
    commits_per_s: f64,
    events_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    fsyncs_per_s: f64,
    /// `commits_per_s / fsyncs_per_s`: how many commits one fsync carried,
    /// relative to a single writer syncing every record.
    commits_per_fsync: f64,
}

pub(crate) fn append(args: AppendArgs) -> anyhow::Result<ExitCode> {
    if !args.json {
        println!(
            "{:<28} {:>12} {:>12} {:>9} {:>9} {:>9} {:>10} {:>8}",
            "workload",
            "commits/s",
            "events/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "fsyncs/s",
            "x fsync"
        );
    }
    for &mode in &args.mode {
        for &events in &args.events {
            for &committers in &args.committers {
                let r = append_workload(
                    mode,
                    committers.max(1),
                    events.max(1),
                    Duration::from_secs_f64(args.seconds.max(0.1)),
                    Duration::from_secs_f64(args.fsync_seconds.max(0.1)),
                )?;
                if args.json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    println!(
                        "{:<28} {:>12.0} {:>12.0} {:>9.3} {:>9.3} {:>9.3} {:>10.0} {:>8.1}",
                        r.workload,
                        r.commits_per_s,
                        r.events_per_s,
                        r.p50_ms,
                        r.p99_ms,
                        r.max_ms,
                        r.fsyncs_per_s,
                        r.commits_per_fsync
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Fsyncs per second of one writer appending `write` + `fdatasync` of a
/// 64-byte record to a file in `dir`.
pub(crate) fn fsync_rate(dir: &Path, for_: Duration) -> anyhow::Result<f64> {
    let started = Instant::now();
    let n = fsync_times_ms(dir, for_)?.len();
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// How long each `write` + `fdatasync` of a 64-byte record appended to a
/// file in `dir` took, in milliseconds, for about `for_`: what one commit
/// of a lone committer cannot be faster than.
pub(crate) fn fsync_times_ms(dir: &Path, for_: Duration) -> anyhow::Result<Vec<f64>> {
    let path = dir.join("fsync-probe");
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)?;
    let record = [0x4bu8; 64];
    let started = Instant::now();
    let mut times = Vec::new();
    while started.elapsed() < for_ {
        let one = Instant::now();
        f.write_all(&record)?;
        f.sync_data()?;
        times.push(one.elapsed().as_secs_f64() * 1000.0);
    }
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(times)
}

fn started_event(run: RunId, instance: String, at: u64) -> Event {
    Event {
        seq: Seq::FIRST,
        at: Timestamp(at),
        kind: EventKind::WorkflowStarted(Box::new(keel_storage::WorkflowStart {
            instance_id: InstanceId::new(instance),
            run_id: run,
            workflow_type: "bench.append".into(),
            input: Payload::from_bytes(b"input".to_vec()),
            command_id: None,
            parent: None,
            continued_from: None,
            random_seed: 7,
            previous_run: None,
            carried: Default::default(),
            memo: Vec::new(),
            search_attributes: Vec::new(),
            timeouts: Default::default(),
        })),
    }
}

fn signal_event(seq: u64, at: u64) -> Event {
    Event {
        seq: Seq(seq),
        at: Timestamp(at),
        kind: EventKind::SignalReceived {
            name: "bench".into(),
            payload: Payload::from_bytes(seq.to_le_bytes().to_vec()),
            command_id: None,
        },
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn append_workload(
    mode: Mode,
    committers: usize,
    events_per_commit: usize,
    run_for: Duration,
    fsync_for: Duration,
) -> anyhow::Result<AppendReport> {
    let dir = tempfile::Builder::new()
        .prefix("keel-bench-append")
        .tempdir()?;
    let fsyncs_per_s = fsync_rate(dir.path(), fsync_for)?;
    let store = Arc::new(RocksStore::open(
        dir.path().join("data"),
        mode.durability(),
    )?);
    let barrier = Arc::new(Barrier::new(committers + 1));
    let mut threads = Vec::with_capacity(committers);
    for c in 0..committers {
        let (store, barrier) = (store.clone(), barrier.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("committer-{c}"))
                .spawn(move || -> anyhow::Result<(u64, Vec<f64>)> {
                    let run = RunId::new_random();
                    let at = now_ms();
                    // Setup, not measured: the run's WorkflowStarted.
                    store
                        .commit(CommitBatch::append(
                            run,
                            vec![started_event(run, format!("bench-append-{c}"), at)],
                        ))
                        .wait()?;
                    let mut next = 2u64;
                    let mut latencies = Vec::with_capacity(1 << 14);
                    barrier.wait();
                    let deadline = Instant::now() + run_for;
                    let mut commits = 0u64;
                    while Instant::now() < deadline {
                        let events: Vec<Event> = (0..events_per_commit as u64)
                            .map(|i| signal_event(next + i, at))
                            .collect();
                        let t0 = Instant::now();
                        store.commit(CommitBatch::append(run, events)).wait()?;
                        latencies.push(t0.elapsed().as_secs_f64() * 1000.0);
                        next += events_per_commit as u64;
                        commits += 1;
                    }
                    Ok((commits, latencies))
                })?,
        );
    }
    barrier.wait();
    let started = Instant::now();
    let mut commits = 0u64;
    let mut latencies = Vec::new();
    for t in threads {
        let (c, l) = t
            .join()
            .map_err(|_| anyhow::anyhow!("a committer thread panicked"))??;
        commits += c;
        latencies.extend(l);
    }
    let wall = started.elapsed().as_secs_f64();
    drop(store);
    latencies.sort_by(|a, b| a.total_cmp(b));
    let commits_per_s = commits as f64 / wall;
    let events = commits * events_per_commit as u64;
    Ok(AppendReport {
        workload: format!("append {mode} c={committers} e={events_per_commit}"),
        durability: mode.to_string(),
        committers,
        events_per_commit,
        seconds: wall,
        commits,
        events,
        commits_per_s,
        events_per_s: events as f64 / wall,
        p50_ms: percentile(&latencies, 0.50),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: latencies.last().copied().unwrap_or(0.0),
        fsyncs_per_s,
        commits_per_fsync: if fsyncs_per_s > 0.0 {
            commits_per_s / fsyncs_per_s
        } else {
            0.0
        },
    })
}

/// Arguments of `keel bench read`.
#[derive(clap::Args, Debug)]
pub(crate) struct ReadArgs {
    /// Events in the log.
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Events per run (a WorkflowStarted, then activity schedule/complete
    /// pairs, then a signal).
    #[arg(long, default_value_t = 100)]
    events_per_run: u64,
    /// Print one JSON object per workload, one per line.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct ReadReport {
    workload: String,
    events: u64,
    runs: u64,
    bytes: u64,
    seconds: f64,
    events_per_s: f64,
    mb_per_s: f64,
    /// Time to write, flush and close the log (not part of the measurement).
    build_s: f64,
}

/// The log's size and build time, shared by every way of reading it.
struct ReadLog {
    runs: u64,
    bytes: u64,
    build_s: f64,
}

impl ReadLog {
    /// One way of reading the log: `events` read in `seconds`.
    fn report(&self, workload: &str, events: u64, seconds: f64) -> ReadReport {
        ReadReport {
            workload: workload.into(),
            events,
            runs: self.runs,
            bytes: self.bytes,
            seconds,
            events_per_s: events as f64 / seconds,
            mb_per_s: self.bytes as f64 / seconds / 1e6,
            build_s: self.build_s,
        }
    }
}

/// The `i`-th event (seq `i + 1`) of a benchmark run of `len` events.
fn read_log_event(run: RunId, i: u64, len: u64, at: u64) -> Event {
    let seq = i + 1;
    let kind = if i == 0 {
        return started_event(run, format!("bench-read-{run}"), at);
    } else if i == len - 1 {
        EventKind::SignalReceived {
            name: "bench".into(),
            payload: Payload::from_bytes(b"last".to_vec()),
            command_id: None,
        }
    } else {
        let step = Step(i.div_ceil(2) as u32);
        if i % 2 == 1 {
            EventKind::ActivityScheduled {
                step,
                group: Vec::new(),
                execution_id: execution_of(run, step),
                activity_type: "bench.noop".into(),
                input: Payload::from_bytes(vec![1, 2, 3, 4]),
                options: Box::default(),
            }
        } else {
            EventKind::ActivityCompleted {
                step,
                attempt_id: attempt_of(run, step, AttemptNo::FIRST),
                result: Payload::from_bytes(vec![5, 6, 7, 8]),
            }
        }
    };
    Event {
        seq: Seq(seq),
        at: Timestamp(at + i),
        kind,
    }
}

pub(crate) fn read(args: ReadArgs) -> anyhow::Result<ExitCode> {
    let per_run = args.events_per_run.max(2);
    let runs = args.events.div_ceil(per_run).max(1);
    let dir = tempfile::Builder::new()
        .prefix("keel-bench-read")
        .tempdir()?;
    let path = dir.path().join("data");

    // Build: Buffered, commits pipelined (256 in flight), one run per commit.
    let t_build = Instant::now();
    {
        let store = RocksStore::open(&path, Durability::Buffered)?;
        let at = now_ms();
        let mut pending = std::collections::VecDeque::new();
        let mut written = 0u64;
        for _ in 0..runs {
            let run = RunId::new_random();
            let len = per_run.min(args.events.saturating_sub(written)).max(2);
            let events = (0..len).map(|i| read_log_event(run, i, len, at)).collect();
            written += len;
            pending.push_back(store.commit(CommitBatch::append(run, events)));
            if pending.len() >= 256 {
                if let Some(h) = pending.pop_front() {
                    h.wait()?;
                }
            }
        }
        for h in pending {
            h.wait()?;
        }
        store.sync()?;
        store.flush()?;
        store.close()?;
    }
    let build_s = t_build.elapsed().as_secs_f64();

    let store = RocksStore::open_read_only(&path)?;
    let mut reports = Vec::new();

    // 1. A full scan of the events family, decoding every record.
    let t0 = Instant::now();
    let (mut events, mut bytes) = (0u64, 0u64);
    let mut failure = None;
    store.view().scan(
        Cf::Events,
        &[],
        &[],
        &mut |_, v| match codec::decode::<Event>(RecordKind::Event, v) {
            Ok(e) => {
                std::hint::black_box(&e);
                events += 1;
                bytes += v.len() as u64;
                true
            }
            Err(e) => {
                failure = Some(e);
                false
            }
        },
    )?;
    if let Some(e) = failure {
        anyhow::bail!("event record does not decode: {e}");
    }
    let log = ReadLog {
        runs,
        bytes,
        build_s,
    };
    reports.push(log.report("read scan", events, t0.elapsed().as_secs_f64()));

    // 2. Run by run through `Store::for_each_event` (what reading one run does).
    let run_ids: Vec<RunId> = store
        .runs(&RunFilter::default())?
        .into_iter()
        .map(|m| m.run_id)
        .collect();
    anyhow::ensure!(
        run_ids.len() as u64 == runs,
        "the log holds {} runs, {runs} were written",
        run_ids.len()
    );
    let t0 = Instant::now();
    let mut per_run_events = 0u64;
    for run in &run_ids {
        store.for_each_event(*run, Seq::FIRST, &mut |e| {
            std::hint::black_box(&e);
            per_run_events += 1;
            true
        })?;
    }
    let secs = t0.elapsed().as_secs_f64();
    reports.push(log.report("read per-run", per_run_events, secs));
    anyhow::ensure!(
        events == per_run_events,
        "the scan saw {events} events, the per-run reads {per_run_events}"
    );

    // 3. Every run's history through one cursor, in the order of their
    // ids (what replay reads).
    let mut in_key_order = run_ids.clone();
    in_key_order.sort();
    let t0 = Instant::now();
    let mut history_events = 0u64;
    let mut failed = None;
    store.for_each_history(&in_key_order, &mut |_, read| {
        history_events += read.events.len() as u64;
        std::hint::black_box(&read.events);
        if read.failure.is_some() {
            failed = read.failure;
        }
    });
    if let Some(e) = failed {
        anyhow::bail!("a history does not read: {e}");
    }
    let secs = t0.elapsed().as_secs_f64();
    reports.push(log.report("read histories", history_events, secs));
    anyhow::ensure!(
        events == history_events,
        "the scan saw {events} events, the history reads {history_events}"
    );

    for r in &reports {
        if args.json {
            println!("{}", serde_json::to_string(r)?);
        } else {
            println!(
                "{}: {} events ({} runs, {:.1} MB) decoded in {:.3} s = {:.0} events/s, {:.0} MB/s (log built in {:.1} s)",
                r.workload, r.events, r.runs, r.bytes as f64 / 1e6, r.seconds, r.events_per_s, r.mb_per_s, r.build_s
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
