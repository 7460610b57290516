//! `keel schedule list` and `keel schedule describe`: schedules in a data
//! directory, read beside a running engine or not.
//!
//! `list` reads the schedules' run records through the index (their memo
//! holds each one's summary), never a history. `describe` replays one
//! schedule's history with this build's code and asks its `describe`
//! query, so it shows what the engine would answer.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use keel::replay::Replayer;
use keel::schedule::{
    schedule_id_of, schedule_instance, ScheduleDescription, ScheduleMemo, TriggerOutcome,
    TriggerRecord, SCHEDULE_MEMO_FIELD, SCHEDULE_WORKFLOW_TYPE,
};
use keel::{Payload, WorkflowRegistry};
use keel_storage::{RunFilter, RunStatus};
use serde_json::json;

use crate::bad_input;
use crate::inspect::{history_of, open, resolve};
use crate::table::{time, to_stdout, Table};

/// Arguments of `keel schedule`.
#[derive(clap::Args, Debug)]
pub struct ScheduleArgs {
    #[command(subcommand)]
    pub command: ScheduleCommand,
}

/// `keel schedule` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum ScheduleCommand {
    /// Every schedule: calendar, workflow, overlap policy, paused, the
    /// newest trigger and counters.
    List {
        /// The data directory. A PostgreSQL store is named by its URL
        /// instead: `--store postgres://user:password@host:port/database`.
        #[arg(long, alias = "store", default_value = "keel-data")]
        data: PathBuf,
        /// One JSON object per schedule, one per line.
        #[arg(long)]
        json: bool,
    },
    /// One schedule: calendar, policies, open runs, waiting triggers, the
    /// next times and the newest triggers.
    Describe {
        /// The schedule id.
        id: String,
        /// The data directory. A PostgreSQL store is named by its URL
        /// instead: `--store postgres://user:password@host:port/database`.
        #[arg(long, alias = "store", default_value = "keel-data")]
        data: PathBuf,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) fn run(args: ScheduleArgs, registry: &WorkflowRegistry) -> anyhow::Result<ExitCode> {
    match args.command {
        ScheduleCommand::List { data, json } => list(&data, json),
        ScheduleCommand::Describe { id, data, json } => describe(&id, &data, json, registry),
    }
}

fn outcome_text(o: &TriggerOutcome) -> String {
    match o {
        TriggerOutcome::Running => "running".into(),
        TriggerOutcome::Completed => "completed".into(),
        TriggerOutcome::Failed(why) => format!("failed: {why}"),
        TriggerOutcome::Skipped => "skipped".into(),
        TriggerOutcome::Missed => "missed".into(),
        TriggerOutcome::NotStarted(why) => format!("not started: {why}"),
        TriggerOutcome::Abandoned => "abandoned".into(),
    }
}

fn last_text(r: &Option<TriggerRecord>) -> String {
    match r {
        Some(r) => format!("{} {}", time(r.nominal), outcome_text(&r.outcome)),
        None => "-".into(),
    }
}

fn list(data: &std::path::Path, as_json: bool) -> anyhow::Result<ExitCode> {
    let store = open(data)?;
    let filter = RunFilter::all()
        .workflow_type(SCHEDULE_WORKFLOW_TYPE)
        .status(RunStatus::Running);
    let runs = store.runs(&filter)?;
    let mut rows = Vec::new();
    for m in &runs {
        let Some(id) = schedule_id_of(&m.instance_id) else {
            continue;
        };
        let memo: Option<ScheduleMemo> = m
            .memo
            .iter()
            .find(|(n, _)| n == SCHEDULE_MEMO_FIELD)
            .and_then(|(_, p)| p.decode().ok());
        rows.push((id.to_string(), m.run_id, memo));
    }
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    to_stdout(|out| {
        if as_json {
            for (id, run, memo) in &rows {
                let v = json!({
                    "id": id,
                    "run_id": run.to_string(),
                    "calendar": memo.as_ref().map(|m| m.spec.summary()),
                    "workflow_type": memo.as_ref().map(|m| m.workflow_type.clone()),
                    "overlap": memo.as_ref().map(|m| m.overlap.name()),
                    "paused": memo.as_ref().map(|m| m.paused),
                    "note": memo.as_ref().map(|m| m.note.clone()),
                    "last": memo.as_ref().and_then(|m| m.last.as_ref()).map(|r| json!({
                        "at": r.nominal.0,
                        "instance": r.instance,
                        "outcome": outcome_text(&r.outcome),
                    })),
                    "counts": memo.as_ref().map(|m| serde_json::to_value(&m.counts).unwrap_or_default()),
                });
                writeln!(out, "{v}")?;
            }
            return Ok(());
        }
        let mut t = Table::new(&[
            "SCHEDULE", "CALENDAR", "WORKFLOW", "OVERLAP", "PAUSED", "STARTED", "SKIPPED",
            "MISSED", "LAST",
        ]);
        for (id, _, memo) in &rows {
            let Some(m) = memo else {
                t.row(vec![id.clone(), "(no summary yet)".into()]);
                continue;
            };
            t.row(vec![
                id.clone(),
                m.spec.summary(),
                m.workflow_type.clone(),
                m.overlap.name().into(),
                if m.paused {
                    format!("yes: {}", m.note)
                } else {
                    "no".into()
                },
                m.counts.started.to_string(),
                m.counts.skipped.to_string(),
                m.counts.missed.to_string(),
                last_text(&m.last),
            ]);
        }
        t.write(out, "")
    })?;
    eprintln!("{} schedules", rows.len());
    Ok(ExitCode::SUCCESS)
}

fn describe(
    id: &str,
    data: &std::path::Path,
    as_json: bool,
    registry: &WorkflowRegistry,
) -> anyhow::Result<ExitCode> {
    let store = open(data)?;
    let instance = schedule_instance(id);
    let meta = resolve(store.as_ref(), data, instance.as_str()).map_err(|_| {
        bad_input(format!(
            "no schedule {id:?} in {}",
            crate::output::shown(data)
        ))
    })?;
    if meta.status.is_closed() {
        return Err(bad_input(format!(
            "schedule {id:?} was deleted ({})",
            meta.status.name()
        )));
    }
    let history = history_of(store.as_ref(), &meta)?;
    let mut machine = Replayer::new(registry.clone())
        .rebuild(history)
        .map_err(|e| anyhow::anyhow!("schedule {id:?} does not replay with this build: {e}"))?;
    let args = Payload::encode(&()).context("encoding the query")?;
    let answer = machine
        .query("describe", &args)
        .map_err(|e| anyhow::anyhow!("schedule {id:?}: {e}"))?;
    let d: ScheduleDescription = answer.decode().context("the schedule's description")?;
    to_stdout(|out| {
        if as_json {
            return writeln!(out, "{}", serde_json::to_string(&d)?);
        }
        let row = |out: &mut dyn Write, k: &str, v: &str| writeln!(out, "{k:<10} {v}");
        row(out, "schedule", &d.id)?;
        row(out, "run", &meta.run_id.to_string())?;
        row(out, "calendar", &d.spec.summary())?;
        row(out, "workflow", &d.workflow_type)?;
        row(out, "overlap", d.policies.overlap.name())?;
        row(
            out,
            "catch-up",
            &format!("{} s", d.policies.catchup_window_ms / 1000),
        )?;
        let paused = match d.paused {
            true => format!("yes: {}", d.note),
            false => "no".into(),
        };
        row(out, "paused", &paused)?;
        let c = &d.counts;
        row(
            out,
            "counts",
            &format!(
                "started {}, completed {}, failed {}, skipped {}, missed {}, not started {}",
                c.started, c.completed, c.failed, c.skipped, c.missed, c.not_started
            ),
        )?;
        let running = match d.running.is_empty() {
            true => "none".into(),
            false => d.running.join(", "),
        };
        row(out, "running", &running)?;
        row(out, "waiting", &d.pending.len().to_string())?;
        let next: Vec<String> = d.next.iter().map(|t| time(*t)).collect();
        row(
            out,
            "next",
            &if next.is_empty() {
                "-".into()
            } else {
                next.join(", ")
            },
        )?;
        if !d.recent.is_empty() {
            writeln!(out, "recent")?;
            let mut t = Table::new(&["TIME", "INSTANCE", "OUTCOME", "BY"]);
            for r in &d.recent {
                t.row(vec![
                    time(r.nominal),
                    r.instance.clone(),
                    outcome_text(&r.outcome),
                    if r.manual { "request" } else { "calendar" }.into(),
                ]);
            }
            t.write(out, "  ")?;
        }
        Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}
