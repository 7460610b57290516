//! `keel resume ID`: re-checks a parked run against the workflow code of
//! this build, offline, on a data directory no engine holds. If the run's
//! history replays, its park marker is cleared, and the engine that opens
//! the directory next drives the run again (its timers, attempts and
//! messages are recovered from their intent rows). If not, it stays parked
//! and the divergence is printed. Beside a live engine, call
//! `client.resume(id)` in the application instead: the engine holds the
//! directory and resumes the run itself.

use std::path::PathBuf;
use std::process::ExitCode;

use keel::replay::{ReplayOutcome, Replayer};
use keel::WorkflowRegistry;
use keel_storage::{CommitBatch, Durability, Error as StoreError, PgStore, RocksStore, Store};

use crate::output::postgres_of;

use crate::bad_input;
use crate::table::to_stdout;

/// Arguments of `keel resume`.
#[derive(clap::Args, Debug)]
pub struct ResumeArgs {
    /// The run's id or its instance's id.
    pub id: String,
    /// The data directory (opened read-write: no engine may hold it). A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Resume on this running `keel serve` instead (its engine holds the
    /// data and re-checks the run against its own code), e.g.
    /// http://127.0.0.1:8233.
    #[arg(long, value_name = "URL", conflicts_with = "data")]
    pub server: Option<String>,
    /// The server's bearer token (default: KEEL_SERVE_TOKEN).
    #[arg(long, requires = "server")]
    pub token: Option<String>,
}

#[derive(serde::Serialize)]
struct ResumeOut {
    run_id: String,
    instance_id: String,
    was_parked: bool,
    fits: bool,
    reason: Option<String>,
}

pub(crate) fn run(args: ResumeArgs, registry: &WorkflowRegistry) -> anyhow::Result<ExitCode> {
    if let Some(server) = args.server {
        let server = crate::remote::ServerArgs {
            server,
            token: args.token,
            json: args.json,
        };
        return crate::remote::resume(&args.id, &server);
    }
    let opened: Result<Box<dyn Store>, StoreError> = match postgres_of(&args.data) {
        Some(options) => PgStore::open(options).map(|s| Box::new(s) as Box<dyn Store>),
        None => {
            RocksStore::open(&args.data, Durability::Sync).map(|s| Box::new(s) as Box<dyn Store>)
        }
    };
    let store = match opened {
        Ok(s) => s,
        Err(StoreError::DatabaseLocked { target, .. }) => {
            return Err(bad_input(format!(
                "{target} is held by a running engine: resume the run there (client.resume({:?}))",
                args.id
            )))
        }
        Err(StoreError::Locked { path }) => {
            return Err(bad_input(format!(
                "{} is held by a running engine: resume the run there (client.resume({:?}))",
                path.display(),
                args.id
            )))
        }
        Err(e) => return Err(e.into()),
    };
    let run = store
        .resolve(&args.id)?
        .ok_or_else(|| bad_input(format!("unknown instance or run {:?}", args.id)))?;
    let marker = store.parked(run)?;
    let report = Replayer::new(registry.clone()).replay_id(store.as_ref(), &run.to_string())?;
    let (fits, reason) = match &report.outcome {
        ReplayOutcome::Ok => (true, None),
        other => (false, Some(format!("{}: {other:?}", other.kind()))),
    };
    if fits && marker.is_some() {
        store
            .commit(CommitBatch {
                appends: Vec::new(),
                parked: vec![(run, None)],
                fence: None,
            })
            .wait()?;
    }
    let out = ResumeOut {
        run_id: run.to_string(),
        instance_id: report.instance_id.clone(),
        was_parked: marker.is_some(),
        fits,
        reason,
    };
    to_stdout(|w| {
        if args.json {
            return writeln!(w, "{}", serde_json::to_string(&out)?);
        }
        match (out.was_parked, out.fits) {
            (true, true) => writeln!(
                w,
                "run {} ({}) fits this build: unparked; the next engine start drives it",
                out.run_id, out.instance_id
            ),
            (false, true) => writeln!(
                w,
                "run {} ({}) is not parked, and its history replays",
                out.run_id, out.instance_id
            ),
            (_, false) => writeln!(
                w,
                "run {} ({}) still does not fit this build; it stays parked: {}",
                out.run_id,
                out.instance_id,
                out.reason.as_deref().unwrap_or("")
            ),
        }
    })?;
    Ok(if fits {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
