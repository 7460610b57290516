//! keel-cli as a library: the inspection, verify, export and replay
//! commands of the `keel` binary, over any set of workflows.
//!
//! The `keel` binary builds its command line from [`Command`] plus its own
//! demo, simulation and benchmark commands, and replays with [`registry()`].
//! An application builds the same tool over its own workflows in a few
//! lines, so `keel replay` checks *its* code against *its* histories:
//!
//! ```no_run
//! // src/bin/keel-ops.rs
//! # mod app { pub fn workflows() -> keel::WorkflowRegistry { keel::WorkflowRegistry::new() } }
//! fn main() -> std::process::ExitCode {
//!     keel_cli::main_with(app::workflows())
//! }
//! ```
//!
//! Data goes to stdout and everything else (progress, errors) to stderr;
//! the exit codes are in [`LONG_ABOUT`].

pub mod demo_app;
pub mod inspect;
#[cfg(feature = "otlp")]
pub mod otlp;
#[doc(hidden)]
pub mod output;
pub mod recover_cmd;
pub mod remote;
#[doc(hidden)]
pub mod replay_bench;
pub mod replay_cmd;
pub mod resume_cmd;
pub mod schedule_cmd;
pub mod serve;
mod table;
mod verify;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use keel::WorkflowRegistry;

/// The long help of `keel` and of every tool built with [`main_with`]: what
/// the tool does and its exit codes.
pub const LONG_ABOUT: &str = "\
Durable workflows for Rust: inspect, verify, export and replay keel data
directories (and, in the keel binary, run the demo, simulate and measure).

The inspection commands open --data (default keel-data) read-only, so they
work beside a live engine (seeing what it had written by then);
checkpoint copies a live directory's files itself; resume and recover need
the directory to themselves (no engine may hold it). Data goes
to stdout (tables for people, --json for scripts); progress and errors go to
stderr.

Exit codes:
  0  success
  1  a check failed: verify found violations, replay diverged or failed,
     or a record read from the data directory is corrupt
  2  bad arguments, a data directory that cannot be opened, an unknown
     instance or run id, or a bundle that is missing, truncated or fails
     its checksum";

/// The workflows compiled into the `keel` binary: what `keel replay` and
/// `keel describe` run. Register new built-in workflows here.
pub fn registry() -> WorkflowRegistry {
    demo_app::workflows()
}

/// The commands shared by the `keel` binary and tools built with
/// [`main_with`].
#[derive(Subcommand, Debug)]
pub enum Command {
    /// List runs, newest first, optionally by status and workflow type.
    List(inspect::ListArgs),
    /// Print a run's history, one line per event (streams).
    Show(inspect::ShowArgs),
    /// Status, pending steps, children, parked reason of a run.
    Describe(inspect::DescribeArgs),
    /// Check a data directory: gaps, checksums, duplicate terminal events,
    /// derived state. Exit 0 clean, 1 violations, 2 cannot open.
    Verify(inspect::VerifyArgs),
    /// Write a run's history to a portable, checksummed bundle file.
    Export(inspect::ExportArgs),
    /// Write a consistent copy of a data directory (a RocksDB checkpoint).
    Checkpoint(inspect::CheckpointArgs),
    /// Replay histories (bundles, runs by id, or every open run) against
    /// the workflow code of this build; exit 1 on any divergence.
    Replay(replay_cmd::ReplayArgs),
    /// Re-check a parked run against this build's code and unpark it if its
    /// history replays (offline: no engine may hold --data); exit 1 if it
    /// still does not fit.
    Resume(resume_cmd::ResumeArgs),
    /// Open a data directory whose log lost acknowledged commits or is
    /// damaged, keeping the consistent prefix, and report exactly what was
    /// lost (only with --accept-loss; no engine may hold --data). Exit 0
    /// recovered, 1 the prefix fails verify, 2 cannot open.
    Recover(recover_cmd::RecoverArgs),
    /// Schedules: `list` them, or `describe` one (its calendar, policies,
    /// open runs, next times and newest triggers).
    Schedule(schedule_cmd::ScheduleArgs),
    /// Start a workflow on a running `keel serve` (--server URL).
    Start(remote::StartArgs),
    /// Signal a run on a running `keel serve`.
    Signal(remote::SignalArgs),
    /// Send an update to a run on a running `keel serve` and print its
    /// value.
    Update(remote::UpdateArgs),
    /// Ask a run's query on a running `keel serve` and print its value.
    Query(remote::QueryArgs),
    /// Request cooperative cancellation of a run on a running `keel serve`.
    Cancel(remote::CloseArgs),
    /// Terminate a run on a running `keel serve` without running its code.
    Terminate(remote::CloseArgs),
}

/// Runs one command and returns its exit code. Errors are printed to
/// stderr as one line starting with `keel: `.
pub fn run(command: Command, registry: &WorkflowRegistry) -> ExitCode {
    let result = match command {
        Command::List(args) => inspect::list(args),
        Command::Show(args) => inspect::show(args),
        Command::Describe(args) => inspect::describe(args, registry),
        Command::Verify(args) => verify::run(&args.data, args.json),
        Command::Export(args) => inspect::export(args),
        Command::Checkpoint(args) => inspect::checkpoint(args),
        Command::Replay(args) => replay_cmd::run(args, registry),
        Command::Resume(args) => resume_cmd::run(args, registry),
        Command::Recover(args) => recover_cmd::run(args),
        Command::Schedule(args) => schedule_cmd::run(args, registry),
        Command::Start(args) => remote::start(args),
        Command::Signal(args) => remote::signal(args),
        Command::Update(args) => remote::update(args),
        Command::Query(args) => remote::query(args),
        Command::Cancel(args) => remote::close(args, false),
        Command::Terminate(args) => remote::close(args, true),
    };
    finish(result)
}

/// Turns a command's result into an exit code, printing an error as one
/// line on stderr: code 1 for corrupt data, 2 for everything else unless
/// the error says otherwise.
pub fn finish(result: anyhow::Result<ExitCode>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(e) => {
            let line = format!("{e:#}").replace('\n', " ");
            eprintln!("keel: {line}");
            ExitCode::from(exit_code_of(&e))
        }
    }
}

/// An error that carries its exit code.
#[derive(Debug)]
pub(crate) struct Exit {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}

/// An error with exit code 2 (bad input).
pub(crate) fn bad_input(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Exit {
        code: 2,
        message: message.into(),
    })
}

fn exit_code_of(e: &anyhow::Error) -> u8 {
    for cause in e.chain() {
        if let Some(exit) = cause.downcast_ref::<Exit>() {
            return exit.code;
        }
        let storage = cause.downcast_ref::<keel_storage::Error>().or_else(|| {
            match cause.downcast_ref::<keel::replay::Error>() {
                Some(keel::replay::Error::Store(s)) => Some(s),
                _ => None,
            }
        });
        if matches!(storage, Some(keel_storage::Error::Corrupt { .. })) {
            return 1;
        }
    }
    2
}

/// Keeps tracing's exporter running: hold it until the end of `main`
/// (dropping it sends the spans still queued).
#[must_use = "dropping the guard stops span export"]
#[derive(Debug)]
pub struct TracingGuard {
    #[cfg(feature = "otlp")]
    _otlp: Option<otlp::OtlpGuard>,
}

/// The variables that turn OTLP export on.
#[cfg(not(feature = "otlp"))]
const OTLP_ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// Installs the global `tracing` subscriber: log lines to stderr at
/// `KEEL_LOG`'s level (default `default_level`), and, built with the
/// `otlp` feature and `OTEL_EXPORTER_OTLP_ENDPOINT` set, spans exported
/// over OTLP at `KEEL_OTLP_FILTER`'s level (default `info`, which holds
/// keel's `request`, `commit`, `attempt` and `replay` spans). Does nothing
/// if a subscriber is installed already. Errs on bad OTLP settings.
pub fn setup_tracing(default_level: &str) -> anyhow::Result<TracingGuard> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Layer};

    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            EnvFilter::try_from_env("KEEL_LOG").unwrap_or_else(|_| EnvFilter::new(default_level)),
        );
    #[cfg(feature = "otlp")]
    {
        let (export, guard) = match otlp::OtlpConfig::from_env()? {
            Some(config) => {
                let (layer, guard) = otlp::layer(config);
                let filter = EnvFilter::try_from_env("KEEL_OTLP_FILTER")
                    .unwrap_or_else(|_| EnvFilter::new("info"));
                (Some(layer.with_filter(filter)), Some(guard))
            }
            None => (None, None),
        };
        let _ = tracing_subscriber::registry()
            .with(log)
            .with(export)
            .try_init();
        Ok(TracingGuard { _otlp: guard })
    }
    #[cfg(not(feature = "otlp"))]
    {
        let _ = tracing_subscriber::registry().with(log).try_init();
        if let Some(var) = OTLP_ENDPOINT_VARS
            .iter()
            .find(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
        {
            tracing::warn!(
                "{var} is set, but this keel was built without the `otlp` feature: \
                 no spans are exported (build with `--features keel-cli/otlp`)"
            );
        }
        Ok(TracingGuard {})
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "keel",
    version,
    about = "Inspect, verify, export and replay keel data directories",
    long_about = LONG_ABOUT
)]
struct ToolCli {
    #[command(subcommand)]
    command: Command,
}

/// The `keel` inspection and replay tool over your own workflows: parses
/// the command line (`list`, `show`, `describe`, `verify`, `export`,
/// `checkpoint`, `replay`, `resume`) and runs it with `registry` as the code that
/// `replay` checks. Call it from your binary's `main`.
pub fn main_with(registry: WorkflowRegistry) -> ExitCode {
    let cli = ToolCli::parse();
    let _tracing = match setup_tracing("warn") {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("keel: {e:#}");
            return ExitCode::from(2);
        }
    };
    run(cli.command, &registry)
}
