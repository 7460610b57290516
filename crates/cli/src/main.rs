//! `keel`: run the demo, inspect and verify data directories, replay
//! histories, simulate faults and measure.
//!
//! Data goes to stdout, everything else (progress, logs) to stderr. Exit
//! codes: 0 success, 1 a check found a problem, 2 bad arguments or a data
//! directory that cannot be opened.

mod bench;
mod demo;
mod demo_app;
mod output;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Durable workflows for Rust: demo, inspection, replay, simulation, benchmarks.
#[derive(Parser, Debug)]
#[command(name = "keel", version, about)]
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
    /// Check a data directory: gaps, checksums, duplicate terminal events,
    /// derived state. Exit 0 clean, 1 violations, 2 cannot open.
    Verify {
        /// The data directory.
        #[arg(long, default_value = "keel-data")]
        data: PathBuf,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Measure keel on this machine.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KEEL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::DemoWorker(args) => demo::worker(args),
        Command::Verify { data, json } => verify::run(&data, json),
        Command::Bench(cmd) => bench::run(cmd),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("keel: {e:#}");
            ExitCode::from(2)
        }
    }
}
