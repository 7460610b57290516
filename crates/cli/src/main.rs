//! `keel`: run the demo, inspect and verify data directories, replay
//! histories, simulate faults and measure.
//!
//! Data goes to stdout, everything else (progress, logs) to stderr. Exit
//! codes: 0 success, 1 a check found a problem, 2 bad arguments or a data
//! directory that cannot be opened.

mod bench;
mod bench_fanout;
mod bench_history;
mod bench_restart;
mod bench_torture;
mod demo;
mod sim;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
// The shared commands, helpers and the demo's workflows live in the library
// (`keel_cli`), so that `crate::output`, `crate::demo_app` and
// `crate::registry()` keep working for the binary's own modules.
use keel_cli::{demo_app, output, registry};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Durable workflows for Rust: demo, inspection, replay, simulation, benchmarks.
#[derive(Parser, Debug)]
#[command(name = "keel", version, about, long_about = keel_cli::LONG_ABOUT)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Order processing over N workflows with a real engine crash mid-way.
    Demo(demo::DemoArgs),
    /// (internal) The engine process the demo starts and kills.
    #[command(hide = true)]
    DemoWorker(demo::WorkerArgs),
    #[command(flatten)]
    Tool(keel_cli::Command),
    /// Measure keel on this machine.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Serve an engine over HTTP: the JSON API under /api/v1, the
    /// operator's web page at /, Prometheus metrics at /metrics.
    Serve(keel_cli::serve::ServeArgs),
    /// Run the deterministic simulator: workflows under seeded faults,
    /// every invariant checked. Exit 0 all held, 1 a violation, 2 bad
    /// arguments.
    Sim(sim::SimArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The simulator injects the faults the engine warns about; its report
    // says what matters.
    let default_level = match cli.command {
        Command::Sim(_) => "error",
        _ => "warn",
    };
    let _tracing = match keel_cli::setup_tracing(default_level) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("keel: {e:#}");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::DemoWorker(args) => demo::worker(args),
        Command::Tool(cmd) => Ok(keel_cli::run(cmd, &registry())),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Sim(args) => sim::run(args),
        Command::Serve(args) => {
            keel_cli::serve::run(args, demo_app::engine_builder()).map(|()| ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("keel: {e:#}");
            ExitCode::from(2)
        }
    }
}
