//! The scope seed's import as a durable workflow: 100,000 rows, a channel
//! of 100, ten workers, a progress coroutine, a deadline. Runs both modes:
//! fail-together (one bad address aborts the import) and with an error
//! handler (bad addresses are logged and the rest are checked).
//! `cargo run --release --example import -- [ROWS]`

use std::time::Instant;

use keel_e2e::import::{write_csv, ImportInput, ImportWorkflow};

// The allocator is the application's choice; this one, as the `keel`
// binary's, returns freed memory to the system (BENCHMARKS.md, "the
// allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let rows: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(100_000);
    let dir = tempfile::tempdir()?;
    let csv = dir.path().join("users.csv");
    write_csv(&csv, rows, &[rows / 2, rows / 3])?;
    let engine = keel::Engine::builder()
        .data_dir(dir.path().join("data"))
        .register_workflow::<ImportWorkflow>()
        .register_activity::<keel_e2e::import::ReadRows>()
        .register_activity::<keel_e2e::import::CheckAddress>()
        .build()?;
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let idle_mib = status_mib("VmRSS:");
    let mut done = Vec::new();
    for (id, log_errors) in [("import-fail-together", false), ("import-log-errors", true)] {
        let t0 = Instant::now();
        let input = ImportInput {
            path: csv.display().to_string(),
            total: rows,
            workers: 10,
            log_errors,
            deadline_s: 600,
        };
        let report = rt.block_on(async {
            client.start::<ImportWorkflow>(id, &input).await?;
            client.result::<ImportWorkflow>(id).await
        })?;
        let d = rt.block_on(client.describe(id))?;
        done.push((id, report, d, t0.elapsed().as_secs_f64()));
    }
    // The engine's own peak, before the offline replays below load whole
    // histories into this process.
    let peak_mib = status_mib("VmHWM:");
    println!(
        "engine: rss {idle_mib:.0} MiB idle, {peak_mib:.0} MiB at its peak over both imports (+{:.0})",
        peak_mib - idle_mib
    );
    for (id, report, d, took_s) in done {
        // Offline replay of the import's whole history with the same code.
        let history = engine.store().history(d.run_id)?;
        let mut registry = keel::WorkflowRegistry::new();
        registry.register::<ImportWorkflow>();
        let t1 = Instant::now();
        let outcome = keel::Replayer::new(registry).replay_events(history, true);
        let replay_s = t1.elapsed().as_secs_f64();
        anyhow::ensure!(
            matches!(outcome, keel::ReplayOutcome::Ok),
            "replay: {outcome:?}"
        );
        println!(
            "{id}: checked {}, bad {}, {} ({} events, {:.2} events per row, {:.1} s; replayed at {:.0} events/s)",
            report.checked,
            report.bad,
            report.aborted.as_deref().unwrap_or("complete"),
            d.history_len,
            d.history_len as f64 / rows as f64,
            took_s,
            d.history_len as f64 / replay_s.max(1e-9)
        );
    }
    engine.shutdown_blocking();
    Ok(())
}

/// A line of /proc/self/status in MiB (Linux), 0 where unknown.
fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
