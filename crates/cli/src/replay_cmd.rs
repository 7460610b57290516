//! `keel replay`: replay bundles, runs of a data directory, or every open
//! run, against the workflow code compiled into this build, and report the
//! first divergence of each run. Exit 1 when any run diverged or failed to
//! replay, which makes `keel replay --all` a check before a deploy.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use keel::replay::{Bundle, ReplayOutcome, ReplaySummary, Replayer, RunReport};
use keel::WorkflowRegistry;
use keel_storage::{RunFilter, RunStatus, Store};

use crate::bad_input;
use crate::inspect::open;
use crate::output::progress;
use crate::table::to_stdout;

/// Arguments of `keel replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// Bundle files (written by `keel export`) and/or instance or run ids
    /// in --data. A target that names an existing file is a bundle.
    pub targets: Vec<String>,
    /// The data directory ids are looked up in. A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: PathBuf,
    /// Replay every open run in --data (the check before a deploy).
    #[arg(long, conflicts_with = "targets")]
    pub all: bool,
    /// With --all: closed runs too.
    #[arg(long, requires = "all")]
    pub include_closed: bool,
    /// Print one JSON object (the summary, with every problem).
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn run(args: ReplayArgs, registry: &WorkflowRegistry) -> anyhow::Result<ExitCode> {
    let replayer = Replayer::new(registry.clone());
    let (summary, oks) = if args.all {
        (replay_all(&args, &replayer)?, Vec::new())
    } else if args.targets.is_empty() {
        return Err(bad_input(
            "nothing to replay: give bundle files, ids with --data, or --all",
        ));
    } else {
        replay_targets(&args, &replayer)?
    };
    to_stdout(|out| {
        if args.json {
            return writeln!(out, "{}", serde_json::to_string(&summary)?);
        }
        for r in &oks {
            writeln!(out, "{}", ok_line(r))?;
        }
        writeln!(
            out,
            "replayed {} runs ({} events): {} ok, {} diverged, {} failed",
            summary.replayed, summary.events, summary.ok, summary.diverged, summary.failed
        )?;
        for r in &summary.problems {
            writeln!(out, "  {}", problem_line(r))?;
        }
        if summary.truncated {
            writeln!(out, "  (more problems not listed)")?;
        }
        Ok(())
    })?;
    Ok(if summary.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn problem_line(r: &RunReport) -> String {
    let what = match &r.outcome {
        ReplayOutcome::Ok => "ok".to_string(),
        ReplayOutcome::Diverged {
            step,
            recorded,
            issued,
        } => format!(
            "DIVERGED at step {step}: history recorded {recorded}; the code issued {issued}"
        ),
        ReplayOutcome::Failed { kind, message, .. } => format!("FAILED ({kind}): {message}"),
    };
    format!(
        "{} run {} ({}, {}): {what}",
        r.instance_id,
        r.run_id,
        r.workflow_type,
        r.status.name()
    )
}

fn ok_line(r: &RunReport) -> String {
    format!(
        "{} run {} ({}, {}): ok, {} events",
        r.instance_id,
        r.run_id,
        r.workflow_type,
        r.status.name(),
        r.events
    )
}

fn replay_all(args: &ReplayArgs, replayer: &Replayer) -> anyhow::Result<ReplaySummary> {
    let store = open(&args.data)?;
    let filter = match args.include_closed {
        true => RunFilter::all(),
        false => RunFilter::all().status(RunStatus::Running),
    };
    let runs = store.runs(&filter)?;
    let bar = progress(runs.len() as u64, "replay");
    let summary = replayer.replay_runs(store.as_ref(), &runs, &mut |report| {
        if !report.outcome.is_ok() {
            let line = problem_line(report);
            bar.suspend(|| eprintln!("{line}"));
        }
        bar.inc(1);
    });
    bar.finish_and_clear();
    Ok(summary)
}

/// Replays each target; returns the summary and the runs that replayed
/// cleanly (problems are in the summary).
fn replay_targets(
    args: &ReplayArgs,
    replayer: &Replayer,
) -> anyhow::Result<(ReplaySummary, Vec<RunReport>)> {
    let mut store: Option<Box<dyn Store>> = None;
    let mut summary = ReplaySummary::default();
    let mut oks = Vec::new();
    for target in &args.targets {
        let path = Path::new(target);
        let report = if path.is_file() {
            let bundle =
                Bundle::read(path).map_err(|e| bad_input(format!("{}: {e}", path.display())))?;
            replayer.replay_bundle(&bundle)
        } else if target.ends_with(".bundle") {
            return Err(bad_input(format!("no bundle file {target}")));
        } else {
            if store.is_none() {
                store = Some(open(&args.data)?);
            }
            let s: &dyn Store = store.as_deref().expect("opened above");
            let meta = crate::inspect::resolve(s, &args.data, target)?;
            replayer.replay_meta(s, &meta)
        };
        if report.outcome.is_ok() {
            oks.push(report.clone());
        }
        summary.add(report);
    }
    Ok((summary, oks))
}
