//! `keel list`, `show`, `describe`, `export` and `checkpoint`: looking at a
//! data directory without changing it, beside a running engine or not.
//!
//! Every command opens the directory with [`open_for_reading`] (read-only:
//! beside a live writer, what it had written by the open). Attempts with
//! their lease owner, epoch and expiry live only in the engine process that
//! holds them; offline, `describe` shows the pending attempt number and its
//! due time from the store.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use keel::replay::{Bundle, Replayer};
use keel::{format_group, WorkflowRegistry};
use keel_storage::history::{children, pending_steps};
use keel_storage::{
    Event, EventKind, GroupPath, ListError, Outcome, PageToken, Payload, RocksStore, RunFilter,
    RunMeta, RunStatus, SearchValue, Seq, Store,
};
use serde::Serialize;
use serde_json::{json, Value};

use crate::bad_input;
use crate::output::{open_for_reading, postgres_of, shown};
use crate::table::{time, to_stdout, Table};

/// Characters of a payload `show` prints for people.
const PREVIEW_CHARS_MAX: usize = 60;

/// Deepest child tree `describe` follows (a guard against a cycle in
/// damaged data, not a limit real workflows reach).
const CHILD_DEPTH_MAX: usize = 16;

/// Most child runs `describe` lists.
const CHILD_NODES_MAX: usize = 10_000;

/// Arguments of `keel list`.
#[derive(clap::Args, Debug)]
pub struct ListArgs {
    /// The data directory. A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: PathBuf,
    /// Only runs in this status: running, completed, failed, cancelled,
    /// terminated, continued-as-new, timed-out.
    #[arg(long, value_parser = parse_status)]
    pub status: Option<RunStatus>,
    /// Only runs of this workflow type.
    #[arg(long = "type")]
    pub workflow_type: Option<String>,
    /// Only runs that match: conditions joined by `and`, each `field op
    /// value` with op one of = != < <= > >=; fields `status`, `type`,
    /// `instance`, `start_time`, `close_time` or a search attribute, e.g.
    /// `customer = "c-42" and status = running`.
    #[arg(long = "where", value_name = "FILTER")]
    pub filter: Option<String>,
    /// At most this many runs.
    #[arg(long)]
    pub limit: Option<usize>,
    /// One page of this many runs (the token of the next page is printed
    /// on stderr).
    #[arg(long)]
    pub page_size: Option<usize>,
    /// The page after this token (from a `--page-size` listing).
    #[arg(long, value_name = "TOKEN")]
    pub after: Option<String>,
    /// One JSON object per run, one per line.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `keel show`.
#[derive(clap::Args, Debug)]
pub struct ShowArgs {
    /// An instance id (its current run) or a run id.
    pub id: String,
    /// The data directory. A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: PathBuf,
    /// One JSON object per event, one per line.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `keel describe`.
#[derive(clap::Args, Debug)]
pub struct DescribeArgs {
    /// An instance id (its current run) or a run id.
    pub id: String,
    /// The data directory. A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `keel verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The data directory. A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `keel export`.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// An instance id (its current run) or a run id.
    pub id: String,
    /// The bundle file to write.
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// The data directory. A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: PathBuf,
    /// Print what was written as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `keel checkpoint`.
#[derive(clap::Args, Debug)]
pub struct CheckpointArgs {
    /// Where to write the copy; must not exist.
    pub dir: PathBuf,
    /// The data directory. A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: PathBuf,
}

fn parse_status(s: &str) -> Result<RunStatus, String> {
    RunStatus::parse(s).ok_or_else(|| {
        let names: Vec<&str> = RunStatus::ALL.iter().map(|s| s.name()).collect();
        format!("expected one of {}", names.join(", "))
    })
}

/// Opens a data directory for reading; failure is exit code 2.
pub(crate) fn open(data: &Path) -> anyhow::Result<Box<dyn Store>> {
    open_for_reading(data).map_err(|e| bad_input(format!("cannot open {}: {e}", shown(data))))
}

/// Resolves an instance or run id; an unknown one is exit code 2.
pub(crate) fn resolve(store: &dyn Store, data: &Path, id: &str) -> anyhow::Result<RunMeta> {
    let run = store.resolve(id)?;
    match run.map(|r| store.run_meta(r)).transpose()?.flatten() {
        Some(meta) => Ok(meta),
        None => Err(bad_input(format!(
            "unknown instance or run {id:?} in {}",
            shown(data)
        ))),
    }
}

// ---------------------------------------------------------------- list

pub(crate) fn list(args: ListArgs) -> anyhow::Result<ExitCode> {
    let mut filter = match &args.filter {
        Some(text) => RunFilter::parse(text).map_err(|e| bad_input(format!("--where: {e}")))?,
        None => RunFilter::all(),
    };
    if let Some(s) = args.status {
        filter = filter.status(s);
    }
    if let Some(t) = &args.workflow_type {
        filter = filter.workflow_type(t);
    }
    let store = open(&args.data)?;
    let paged = args.page_size.is_some() || args.after.is_some();
    let (runs, next) = if paged {
        let after = args.after.clone().map(PageToken);
        let size = args.page_size.unwrap_or(100);
        let page = store
            .list(&filter, size, after.as_ref())
            .map_err(|e| match e {
                ListError::Store(e) => anyhow::Error::new(e),
                other => bad_input(other.to_string()),
            })?;
        (page.runs, page.next)
    } else {
        if let Some(n) = args.limit {
            filter = filter.limit(n);
        }
        (store.runs(&filter)?, None)
    };
    let mut parked = Vec::with_capacity(runs.len());
    for m in &runs {
        parked.push(store.parked(m.run_id)?);
    }
    to_stdout(|out| {
        if args.json {
            for (m, p) in runs.iter().zip(&parked) {
                writeln!(out, "{}", run_json(m, p.as_ref()))?;
            }
            return Ok(());
        }
        let mut t = Table::new(&[
            "INSTANCE",
            "RUN",
            "TYPE",
            "STATUS",
            "EVENTS",
            "STARTED",
            "CLOSED",
            "ATTRIBUTES",
        ]);
        for (m, p) in runs.iter().zip(&parked) {
            let status = match p {
                Some(p) => format!("{} (parked: {})", m.status.name(), p.kind),
                None => m.status.name().to_string(),
            };
            t.row(vec![
                m.instance_id.to_string(),
                m.run_id.to_string(),
                m.workflow_type.clone(),
                status,
                (m.next_seq.0 - 1).to_string(),
                time(m.started_at),
                m.closed_at.map_or("-".into(), time),
                attributes_text(&m.search_attributes),
            ]);
        }
        t.write(out, "")
    })?;
    match next {
        Some(token) => eprintln!("{} runs; next page: --after {token}", runs.len()),
        None => eprintln!("{} runs", runs.len()),
    }
    Ok(ExitCode::SUCCESS)
}

/// One run as `list --json` prints it (and the HTTP API lists it).
pub(crate) fn run_json(m: &RunMeta, parked: Option<&keel_storage::ParkInfo>) -> Value {
    serde_json::to_value(RunJson::new(m, parked)).expect("a run's JSON has string keys only")
}

/// A run as `list --json` and the HTTP API's list show it. Serialised
/// straight to the output, with no `serde_json::Value` tree in between: a
/// page of 1,000 runs is the API's largest answer, and building the tree
/// cost as much as reading the runs.
#[derive(Serialize)]
pub(crate) struct RunJson<'a> {
    instance_id: &'a str,
    #[serde(serialize_with = "as_text")]
    run_id: keel_storage::RunId,
    workflow_type: &'a str,
    status: &'static str,
    events: u64,
    started_at: u64,
    updated_at: u64,
    closed_at: Option<u64>,
    parent_run_id: Option<String>,
    parked: Option<&'a str>,
    search_attributes: Attributes<'a>,
    memo: Memo<'a>,
}

impl<'a> RunJson<'a> {
    pub(crate) fn new(m: &'a RunMeta, parked: Option<&'a keel_storage::ParkInfo>) -> Self {
        RunJson {
            instance_id: m.instance_id.as_str(),
            run_id: m.run_id,
            workflow_type: &m.workflow_type,
            status: m.status.name(),
            events: m.next_seq.0 - 1,
            started_at: m.started_at.0,
            updated_at: m.updated_at.0,
            closed_at: m.closed_at.map(|t| t.0),
            parent_run_id: m.parent.as_ref().map(|p| p.run_id.to_string()),
            parked: parked.map(|p| p.kind.as_str()),
            search_attributes: Attributes(&m.search_attributes),
            memo: Memo(&m.memo),
        }
    }
}

fn as_text<T: std::fmt::Display, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Search attributes as a JSON object of plain values (times as RFC 3339),
/// written without an intermediate tree.
struct Attributes<'a>(&'a [(String, SearchValue)]);

impl Serialize for Attributes<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, v) in self.0 {
            match v {
                SearchValue::Keyword(text) => map.serialize_entry(name, text)?,
                SearchValue::Int(i) => map.serialize_entry(name, i)?,
                SearchValue::Double(d) => map.serialize_entry(name, d)?,
                SearchValue::Bool(b) => map.serialize_entry(name, b)?,
                SearchValue::Time(t) => map.serialize_entry(name, &t.to_rfc3339())?,
            }
        }
        map.end()
    }
}

/// Memo fields as a JSON object of their decoded values.
struct Memo<'a>(&'a [(String, Payload)]);

impl Serialize for Memo<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, p) in self.0 {
            map.serialize_entry(name, &payload_json(p))?;
        }
        map.end()
    }
}

/// Search attributes as `name=value` pairs for a table cell.
fn attributes_text(attrs: &[(String, SearchValue)]) -> String {
    if attrs.is_empty() {
        return "-".into();
    }
    let text: Vec<String> = attrs
        .iter()
        .map(|(n, v)| format!("{n}={}", v.plain()))
        .collect();
    text.join(" ")
}

/// Search attributes as a JSON object of plain values (times as RFC 3339).
pub(crate) fn attributes_json(attrs: &[(String, SearchValue)]) -> Value {
    serde_json::to_value(Attributes(attrs)).expect("attribute names are strings")
}

/// Memo fields as a JSON object of their values (as `show` decodes
/// payloads).
pub(crate) fn memo_json(memo: &[(String, Payload)]) -> Value {
    serde_json::to_value(Memo(memo)).expect("memo names are strings")
}

// ---------------------------------------------------------------- show

/// One field of an event line.
enum Field<'a> {
    Text(String),
    Number(u64),
    Payload(&'a Payload),
}

fn text(s: impl ToString) -> Field<'static> {
    Field::Text(s.to_string())
}

/// The ids and payloads of an event, in the order `show` prints them.
fn fields(e: &Event) -> Vec<(&'static str, Field<'_>)> {
    use EventKind as K;
    match &e.kind {
        K::WorkflowStarted(start) => {
            let keel_storage::WorkflowStart {
                instance_id,
                run_id,
                workflow_type,
                input,
                command_id,
                parent,
                continued_from,
                timeouts,
                ..
            } = &**start;
            let mut f = vec![
                ("instance", text(instance_id)),
                ("run", text(run_id)),
                ("type", text(workflow_type)),
            ];
            if let Some(ms) = timeouts.run_ms {
                f.push(("run_timeout_ms", Field::Number(ms)));
            }
            if let Some(at) = timeouts.execution_deadline {
                f.push(("execution_deadline", text(at.to_rfc3339())));
            }
            if let Some(p) = parent {
                f.push(("parent", text(format!("{}@{}", p.run_id, p.step))));
            }
            if let Some(r) = continued_from {
                f.push(("continued_from", text(r)));
            }
            if let Some(c) = command_id {
                f.push(("command", text(c)));
            }
            f.push(("input", Field::Payload(input)));
            f
        }
        K::WorkflowCompleted { result } => vec![("result", Field::Payload(result))],
        K::WorkflowFailed { failure } => vec![("failure", text(failure))],
        K::WorkflowCancelRequested { command_id, reason } => {
            let mut f = vec![("reason", text(reason))];
            if let Some(c) = command_id {
                f.push(("command", text(c)));
            }
            f
        }
        K::WorkflowCancelled { reason } | K::WorkflowTerminated { reason, .. } => {
            vec![("reason", text(reason))]
        }
        K::WorkflowTimedOut { timeout, deadline } => vec![
            ("timeout", text(timeout.name())),
            ("deadline", text(deadline.to_rfc3339())),
        ],
        K::WorkflowContinuedAsNew {
            new_run_id,
            input,
            carried,
        } => vec![
            ("new_run", text(new_run_id)),
            ("input", Field::Payload(input)),
            (
                "carried_signals",
                Field::Number(carried.signals.len() as u64),
            ),
            (
                "carried_commands",
                Field::Number(carried.commands.len() as u64),
            ),
        ],
        K::ActivityScheduled {
            execution_id,
            activity_type,
            input,
            ..
        } => vec![
            ("type", text(activity_type)),
            ("execution", text(execution_id)),
            ("input", Field::Payload(input)),
        ],
        K::ActivityAttemptFailed {
            attempt_id,
            failure,
            retry_at,
            ..
        } => vec![
            ("attempt", Field::Number(attempt_id.attempt.0.into())),
            (
                "retry_at",
                text(retry_at.map_or("none (execution failed)".into(), time)),
            ),
            ("failure", text(failure)),
        ],
        K::ActivityCompleted {
            attempt_id, result, ..
        } => vec![
            ("attempt", Field::Number(attempt_id.attempt.0.into())),
            ("result", Field::Payload(result)),
        ],
        K::ActivityCancelRequested { execution_id, .. }
        | K::ActivityCancelled { execution_id, .. } => {
            vec![("execution", text(execution_id))]
        }
        K::TimerStarted { fire_at, .. }
        | K::TimerFired { fire_at, .. }
        | K::TimerCancelled { fire_at, .. } => vec![("fire_at", text(time(*fire_at)))],
        K::ChildScheduled(child) => vec![
            ("type", text(&child.workflow_type)),
            ("child_instance", text(&child.child_instance_id)),
            ("child_run", text(child.child_run_id)),
            ("close_policy", text(format!("{:?}", child.close_policy))),
            ("input", Field::Payload(&child.input)),
        ],
        K::ChildStarted { child_run_id, .. } => vec![("child_run", text(child_run_id))],
        K::ChildCancelRequested {
            child_run_id,
            policy,
            reason,
            ..
        } => vec![
            ("child_run", text(child_run_id)),
            ("policy", text(format!("{policy:?}"))),
            ("reason", text(reason)),
        ],
        K::ChildCompleted {
            child_run_id,
            result,
            ..
        } => vec![
            ("child_run", text(child_run_id)),
            ("result", Field::Payload(result)),
        ],
        K::ChildFailed {
            child_run_id,
            failure,
            ..
        } => vec![
            ("child_run", text(child_run_id)),
            ("failure", text(failure)),
        ],
        K::SignalReceived {
            name,
            payload,
            command_id,
        } => {
            let mut f = vec![("name", text(name))];
            if let Some(c) = command_id {
                f.push(("command", text(c)));
            }
            f.push(("payload", Field::Payload(payload)));
            f
        }
        K::MessageReceived {
            stream,
            offset,
            key,
            payload,
        } => vec![
            ("stream", text(stream)),
            ("offset", text(offset)),
            ("key", text(key)),
            ("payload", Field::Payload(payload)),
        ],
        K::ExternalSendScheduled {
            step,
            target,
            delivery,
        } => match delivery {
            keel::storage::Delivery::Signal { name, payload } => vec![
                ("step", text(step)),
                ("target", text(target)),
                ("signal", text(name)),
                ("payload", Field::Payload(payload)),
            ],
            keel::storage::Delivery::Message {
                stream,
                key,
                payload,
            } => vec![
                ("step", text(step)),
                ("target", text(target)),
                ("stream", text(stream)),
                ("key", text(key)),
                ("payload", Field::Payload(payload)),
            ],
        },
        K::ExternalSendCompleted {
            step,
            offset,
            failure,
        } => {
            let mut f = vec![("step", text(step))];
            if let Some(o) = offset {
                f.push(("offset", text(o)));
            }
            if let Some(x) = failure {
                f.push(("failure", text(x)));
            }
            f
        }
        K::UpdateAccepted {
            update_id,
            name,
            payload,
        } => vec![
            ("update", text(update_id)),
            ("name", text(name)),
            ("payload", Field::Payload(payload)),
        ],
        K::UpdateCompleted {
            update_id,
            result,
            failure,
        } => match failure {
            Some(f) => vec![("update", text(update_id)), ("failure", text(f))],
            None => vec![
                ("update", text(update_id)),
                ("result", Field::Payload(result)),
            ],
        },
        K::SideEffectRecorded { value, .. } => vec![("value", Field::Payload(value))],
        K::SelectionWinnerRecorded {
            member_index,
            key,
            operation,
            member_step,
            ..
        } => vec![
            ("member", Field::Number((*member_index).into())),
            ("key", text(key)),
            ("operation", text(format!("{operation:?}"))),
            ("member_step", Field::Number(member_step.0.into())),
        ],
        K::SelectionOperationCancelled {
            member_index,
            member_step,
            ..
        } => vec![
            ("member", Field::Number((*member_index).into())),
            ("member_step", Field::Number(member_step.0.into())),
        ],
        K::VersionMarker {
            change_id, version, ..
        } => vec![
            ("change", text(change_id)),
            ("version", Field::Number((*version).into())),
        ],
        K::MemoUpserted { fields: pairs } | K::SearchAttributesUpserted { attributes: pairs } => {
            let names: Vec<&str> = pairs.iter().map(|(n, _)| n.as_str()).collect();
            vec![("names", text(names.join(",")))]
        }
        K::ScopeCancelled { reason, .. } => vec![("reason", text(reason))],
    }
}

fn group_text(g: Option<&GroupPath>) -> String {
    match g {
        Some(g) if !g.is_empty() => format_group(g),
        _ => "-".into(),
    }
}

/// A payload as JSON for scripts: the decoded value, or its bytes in hex.
pub(crate) fn payload_json(p: &Payload) -> Value {
    p.decode::<Value>().unwrap_or_else(|_| {
        Value::String(p.0.iter().map(|b| format!("{b:02x}")).collect::<String>())
    })
}

pub(crate) fn event_json(e: &Event) -> Value {
    let mut obj = serde_json::Map::new();
    obj.insert("seq".into(), json!(e.seq.0));
    obj.insert("at".into(), json!(e.at.0));
    obj.insert("time".into(), json!(time(e.at)));
    obj.insert("kind".into(), json!(e.kind.name()));
    obj.insert("step".into(), json!(e.kind.step().map(|s| s.0)));
    obj.insert(
        "group".into(),
        json!(e.kind.group().map(|g| g
            .iter()
            .map(|x| json!({"step": x.step.0, "size": x.size, "index": x.index}))
            .collect::<Vec<_>>())),
    );
    for (name, f) in fields(e) {
        let v = match f {
            Field::Text(s) => Value::String(s),
            Field::Number(n) => json!(n),
            Field::Payload(p) => payload_json(p),
        };
        obj.insert(name.into(), v);
    }
    Value::Object(obj)
}

struct ShowWidths {
    seq: usize,
}

const KIND_WIDTH: usize = 27;
const STEP_WIDTH: usize = 4;
const GROUP_WIDTH: usize = 9;

fn event_line(e: &Event, w: &ShowWidths) -> String {
    let mut detail = String::new();
    for (name, f) in fields(e) {
        if !detail.is_empty() {
            detail.push(' ');
        }
        let v = match f {
            Field::Text(s) => s,
            Field::Number(n) => n.to_string(),
            Field::Payload(p) => p.preview(PREVIEW_CHARS_MAX),
        };
        detail.push_str(name);
        detail.push('=');
        detail.push_str(&v);
    }
    format!(
        "{:<sw$}  {}  {:<KIND_WIDTH$}  {:<STEP_WIDTH$}  {:<GROUP_WIDTH$}  {}",
        e.seq.0,
        time(e.at),
        e.kind.name(),
        e.kind.step().map_or("-".into(), |s| s.to_string()),
        group_text(e.kind.group()),
        detail,
        sw = w.seq,
    )
}

pub(crate) fn show(args: ShowArgs) -> anyhow::Result<ExitCode> {
    let store = open(&args.data)?;
    let meta = resolve(store.as_ref(), &args.data, &args.id)?;
    let last = meta.next_seq.0.saturating_sub(1);
    let widths = ShowWidths {
        seq: last.to_string().len().max(3),
    };
    let mut read = Ok(());
    let mut count = 0u64;
    let mut reader_gone = false;
    to_stdout(|out| {
        if !args.json {
            writeln!(
                out,
                "{:<sw$}  {:<24}  {:<KIND_WIDTH$}  {:<STEP_WIDTH$}  {:<GROUP_WIDTH$}  DETAIL",
                "SEQ",
                "TIME",
                "KIND",
                "STEP",
                "GROUP",
                sw = widths.seq
            )?;
        }
        let mut io_err = None;
        read = store.for_each_event(meta.run_id, Seq::FIRST, &mut |e| {
            if e.seq.0 > last {
                return false;
            }
            let line = if args.json {
                event_json(&e).to_string()
            } else {
                event_line(&e, &widths)
            };
            let mut written = writeln!(out, "{line}");
            count += 1;
            if count == 1 {
                // The first line goes out at once: a long history starts
                // printing before it has been read.
                written = written.and_then(|()| out.flush());
            }
            match written {
                Ok(()) => true,
                Err(e) => {
                    reader_gone = e.kind() == std::io::ErrorKind::BrokenPipe;
                    io_err = Some(e);
                    false
                }
            }
        });
        io_err.map_or(Ok(()), Err)
    })?;
    read.with_context(|| format!("reading run {}", meta.run_id))?;
    if count < last && !reader_gone {
        eprintln!("printed {count} of {last} events");
    }
    Ok(ExitCode::SUCCESS)
}

// ---------------------------------------------------------------- describe

/// One pending step as `describe` shows it.
#[derive(Serialize, Debug)]
struct PendingView {
    step: u32,
    kind: &'static str,
    name: String,
    group: String,
    since: u64,
    attempt: Option<u32>,
    due: Option<u64>,
    fire_at: Option<u64>,
    child_run: Option<String>,
    last_failure: Option<String>,
    cancel_requested: bool,
}

/// A child run and its own children.
#[derive(Serialize, Debug)]
struct ChildNode {
    step: u32,
    run_id: String,
    instance_id: String,
    workflow_type: String,
    status: String,
    children: Vec<ChildNode>,
}

#[derive(Serialize, Debug)]
struct Description {
    run_id: String,
    instance_id: String,
    workflow_type: String,
    status: &'static str,
    events: u64,
    started_at: u64,
    updated_at: u64,
    closed_at: Option<u64>,
    parent: Option<String>,
    cancel_requested: bool,
    outcome: Option<String>,
    /// A completed run's result, decoded.
    result: Option<Value>,
    parked: Option<keel_storage::ParkInfo>,
    pending: Vec<PendingView>,
    /// Signals the code waits for, from replaying the history with this
    /// build's code (open runs of a known type only).
    signal_waits: Option<Vec<(String, usize)>>,
    /// Why `signal_waits` is missing, when it is.
    replay_note: Option<String>,
    attempts_note: &'static str,
    children: Vec<ChildNode>,
    children_truncated: bool,
}

const ATTEMPTS_NOTE: &str = "leases (owner, epoch, expiry) are held in the engine process; offline this shows the pending attempt and when it is due";

fn outcome_text(o: &Outcome) -> String {
    match o {
        Outcome::Completed(p) => format!("completed: {}", p.preview(PREVIEW_CHARS_MAX)),
        Outcome::Failed(f) => format!("failed: {f}"),
        Outcome::Cancelled(r) => format!("cancelled: {r}"),
        Outcome::Terminated(r) => format!("terminated: {r}"),
        Outcome::TimedOut(r) => format!("timed out: {r}"),
        Outcome::ContinuedAsNew(r) => format!("continued as new in run {r}"),
    }
}

fn child_tree(
    store: &dyn Store,
    history: &[Event],
    depth: usize,
    budget: &mut usize,
) -> anyhow::Result<Vec<ChildNode>> {
    let mut out = Vec::new();
    for c in children(history) {
        if *budget == 0 {
            break;
        }
        *budget -= 1;
        let meta = store.run_meta(c.run_id)?;
        let grandchildren = match &meta {
            Some(_) if depth < CHILD_DEPTH_MAX => {
                let h = store.history(c.run_id)?;
                child_tree(store, &h, depth + 1, budget)?
            }
            _ => Vec::new(),
        };
        out.push(ChildNode {
            step: c.step.0,
            run_id: c.run_id.to_string(),
            instance_id: c.instance_id,
            workflow_type: c.workflow_type,
            status: meta.map_or_else(|| "not started".into(), |m| m.status.name().to_string()),
            children: grandchildren,
        });
    }
    Ok(out)
}

/// A run's history up to its record's last event (a live writer may be
/// ahead of the record a read-only open read).
pub(crate) fn history_of(store: &dyn Store, meta: &RunMeta) -> anyhow::Result<Vec<Event>> {
    let last = meta.next_seq.0.saturating_sub(1);
    let mut history = Vec::with_capacity(last.min(1 << 20) as usize);
    store
        .for_each_event(meta.run_id, Seq::FIRST, &mut |e| {
            if e.seq.0 > last {
                return false;
            }
            history.push(e);
            true
        })
        .with_context(|| format!("reading run {}", meta.run_id))?;
    Ok(history)
}

fn describe_run(
    store: &dyn Store,
    meta: &RunMeta,
    registry: &WorkflowRegistry,
) -> anyhow::Result<Description> {
    let last = meta.next_seq.0.saturating_sub(1);
    let history = history_of(store, meta)?;
    let mut pending = Vec::new();
    for p in pending_steps(&history) {
        let task = if p.kind == keel_storage::history::StepKind::Activity {
            store.task(meta.run_id, p.step)?
        } else {
            None
        };
        pending.push(PendingView {
            step: p.step.0,
            kind: p.kind.name(),
            name: p.name,
            group: group_text(Some(&p.group)),
            since: p.since.0,
            attempt: task
                .as_ref()
                .map(|t| t.attempt.0)
                .or(p.attempt.map(|a| a.0)),
            due: task.as_ref().map(|t| t.due.0).or(p.due.map(|d| d.0)),
            fire_at: p.fire_at.map(|t| t.0),
            child_run: p.child_run.map(|r| r.to_string()),
            last_failure: p.last_failure,
            cancel_requested: task.is_some_and(|t| t.cancel_requested),
        });
    }
    let mut budget = CHILD_NODES_MAX;
    let kids = child_tree(store, &history, 1, &mut budget)?;
    let (signal_waits, replay_note) = if meta.status.is_closed() {
        (None, None)
    } else if registry.get(&meta.workflow_type).is_none() {
        (
            None,
            Some(format!(
                "workflow type {:?} is not compiled into this tool; signal waits unknown",
                meta.workflow_type
            )),
        )
    } else {
        match Replayer::new(registry.clone()).rebuild(history) {
            Ok(m) => (Some(m.signal_waits()), None),
            Err(e) => (
                None,
                Some(format!("replay with this build's code fails: {e}")),
            ),
        }
    };
    Ok(Description {
        run_id: meta.run_id.to_string(),
        instance_id: meta.instance_id.to_string(),
        workflow_type: meta.workflow_type.clone(),
        status: meta.status.name(),
        events: last,
        started_at: meta.started_at.0,
        updated_at: meta.updated_at.0,
        closed_at: meta.closed_at.map(|t| t.0),
        parent: meta
            .parent
            .as_ref()
            .map(|p| format!("{} step {}", p.run_id, p.step)),
        cancel_requested: meta.cancel_requested,
        outcome: meta.outcome.as_ref().map(outcome_text),
        result: match &meta.outcome {
            Some(Outcome::Completed(p)) => Some(payload_json(p)),
            _ => None,
        },
        parked: store.parked(meta.run_id)?,
        pending,
        signal_waits,
        replay_note,
        attempts_note: ATTEMPTS_NOTE,
        children: kids,
        children_truncated: budget == 0,
    })
}

fn write_tree(out: &mut dyn Write, nodes: &[ChildNode], indent: usize) -> std::io::Result<()> {
    for n in nodes {
        writeln!(
            out,
            "{:indent$}- step {}: {} {} ({}) run {}",
            "",
            n.step,
            n.workflow_type,
            n.instance_id,
            n.status,
            n.run_id,
            indent = indent
        )?;
        write_tree(out, &n.children, indent + 2)?;
    }
    Ok(())
}

pub(crate) fn describe(
    args: DescribeArgs,
    registry: &WorkflowRegistry,
) -> anyhow::Result<ExitCode> {
    let store = open(&args.data)?;
    let meta = resolve(store.as_ref(), &args.data, &args.id)?;
    let d = describe_run(store.as_ref(), &meta, registry)?;
    to_stdout(|out| {
        if args.json {
            return writeln!(out, "{}", serde_json::to_string(&d)?);
        }
        let row = |out: &mut dyn Write, k: &str, v: &str| writeln!(out, "{k:<12} {v}");
        row(out, "run", &d.run_id)?;
        row(out, "instance", &d.instance_id)?;
        row(out, "type", &d.workflow_type)?;
        row(out, "status", d.status)?;
        row(out, "events", &d.events.to_string())?;
        row(out, "started", &time(keel::Timestamp(d.started_at)))?;
        row(out, "updated", &time(keel::Timestamp(d.updated_at)))?;
        row(
            out,
            "closed",
            &d.closed_at.map_or("-".into(), |t| time(keel::Timestamp(t))),
        )?;
        row(out, "parent", d.parent.as_deref().unwrap_or("-"))?;
        row(
            out,
            "cancel",
            if d.cancel_requested { "requested" } else { "-" },
        )?;
        if let Some(o) = &d.outcome {
            row(out, "outcome", o)?;
        }
        match &d.parked {
            Some(p) => row(
                out,
                "parked",
                &format!("{}: {} (since {})", p.kind, p.reason, time(p.at)),
            )?,
            None => row(out, "parked", "no")?,
        }
        match (&d.signal_waits, &d.replay_note) {
            (Some(w), _) if !w.is_empty() => {
                let s: Vec<String> = w.iter().map(|(n, c)| format!("{n} ({c})")).collect();
                row(out, "signals", &format!("waiting for {}", s.join(", ")))?
            }
            (_, Some(note)) => row(out, "signals", note)?,
            _ => {}
        }
        if d.pending.is_empty() {
            row(out, "pending", "none")?;
        } else {
            writeln!(out, "pending")?;
            let mut t = Table::new(&[
                "STEP", "KIND", "NAME", "GROUP", "SINCE", "ATTEMPT", "DUE", "NOTE",
            ]);
            for p in &d.pending {
                let mut note = Vec::new();
                if let Some(f) = &p.fire_at {
                    note.push(format!("fires {}", time(keel::Timestamp(*f))));
                }
                if let Some(c) = &p.child_run {
                    note.push(format!("child run {c}"));
                }
                if let Some(f) = &p.last_failure {
                    note.push(format!("last failure: {f}"));
                }
                if p.cancel_requested {
                    note.push("cancel requested".into());
                }
                t.row(vec![
                    p.step.to_string(),
                    p.kind.to_string(),
                    if p.name.is_empty() {
                        "-".into()
                    } else {
                        p.name.clone()
                    },
                    p.group.clone(),
                    time(keel::Timestamp(p.since)),
                    p.attempt.map_or("-".into(), |a| a.to_string()),
                    p.due.map_or("-".into(), |t| time(keel::Timestamp(t))),
                    note.join("; "),
                ]);
            }
            t.write(out, "  ")?;
            if d.pending.iter().any(|p| p.kind == "activity") {
                writeln!(out, "  ({})", d.attempts_note)?;
            }
        }
        if d.children.is_empty() {
            row(out, "children", "none")?;
        } else {
            writeln!(out, "children")?;
            write_tree(out, &d.children, 2)?;
            if d.children_truncated {
                writeln!(out, "  (more children not listed)")?;
            }
        }
        Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

// ---------------------------------------------------------------- export

pub(crate) fn export(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let store = open(&args.data)?;
    let meta = resolve(store.as_ref(), &args.data, &args.id)?;
    let bundle = Bundle::from_store(store.as_ref(), &meta.run_id.to_string())
        .with_context(|| format!("reading run {}", meta.run_id))?;
    bundle
        .write(&args.output)
        .map_err(|e| bad_input(format!("cannot write bundle: {e}")))?;
    let bytes = std::fs::metadata(&args.output).map_or(0, |m| m.len());
    if args.json {
        println!(
            "{}",
            json!({
                "file": args.output.display().to_string(),
                "run_id": meta.run_id.to_string(),
                "instance_id": meta.instance_id.as_str(),
                "workflow_type": meta.workflow_type,
                "status": meta.status.name(),
                "events": bundle.events.len(),
                "bytes": bytes,
            })
        );
    } else {
        eprintln!(
            "exported run {} of {} ({}, {} events, {bytes} bytes) to {}",
            meta.run_id,
            meta.instance_id,
            meta.status.name(),
            bundle.events.len(),
            args.output.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

// ---------------------------------------------------------------- checkpoint

pub(crate) fn checkpoint(args: CheckpointArgs) -> anyhow::Result<ExitCode> {
    if args.dir.exists() {
        return Err(bad_input(format!(
            "{} already exists; a checkpoint needs a new directory",
            args.dir.display()
        )));
    }
    if postgres_of(&args.data).is_some() {
        return Err(bad_input(
            "`keel checkpoint` copies data directories; back a PostgreSQL store up with the database's own tools (pg_dump of keel's schema, or a base backup with WAL archiving)".to_string(),
        ));
    }
    let cannot = |e: &dyn std::fmt::Display| {
        bad_input(format!(
            "cannot checkpoint {} to {}: {e}",
            args.data.display(),
            args.dir.display()
        ))
    };
    // Refuse a missing or foreign directory before trying a read-write
    // open, which would create a store there.
    drop(open(&args.data)?);
    // Without a running engine, a read-write handle takes a complete
    // checkpoint (RocksDB flushes its memtables first).
    match RocksStore::open(&args.data, keel_storage::Durability::Sync) {
        Ok(rw) => {
            let r = rw.checkpoint(&args.dir);
            rw.close()?;
            if let Err(e) = r {
                let _ = std::fs::remove_dir_all(&args.dir);
                return Err(cannot(&e));
            }
        }
        Err(keel_storage::Error::Locked { .. }) => checkpoint_beside_engine(&args)?,
        Err(e) => {
            return Err(bad_input(format!(
                "cannot open {}: {e}",
                args.data.display()
            )))
        }
    }
    eprintln!(
        "checkpoint of {} written to {}",
        args.data.display(),
        args.dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Beside a running engine RocksDB's checkpoint needs the engine's own
/// handle, so keel copies the files itself (`RocksStore::copy_live`: the
/// write-ahead logs included). The copy is then opened, checked against
/// what a read-only open saw before it started (every run at least as far) and
/// verified; anything short is refused and removed.
fn checkpoint_beside_engine(args: &CheckpointArgs) -> anyhow::Result<()> {
    // What the engine had committed when the copy started: the copy must
    // hold at least that much of every run.
    let source = open(&args.data)?;
    let before = source.runs(&RunFilter::default())?;
    drop(source);
    let refuse = |detail: String| -> anyhow::Error {
        let _ = std::fs::remove_dir_all(&args.dir);
        bad_input(format!(
            "cannot checkpoint {} while an engine runs on it: {detail}",
            args.data.display()
        ))
    };
    RocksStore::copy_live(&args.data, &args.dir).map_err(|e| refuse(e.to_string()))?;
    let copy = RocksStore::open_read_only(&args.dir).map_err(|e| refuse(e.to_string()))?;
    let mut short = 0usize;
    for m in &before {
        if copy
            .run_meta(m.run_id)?
            .is_none_or(|c| c.next_seq < m.next_seq)
        {
            short += 1;
        }
    }
    if short > 0 {
        return Err(refuse(format!(
            "the copy lacks events of {short} of {} runs",
            before.len()
        )));
    }
    let report = copy.verify()?;
    if !report.ok {
        return Err(refuse(format!(
            "the copy fails verify: {} violations",
            report.violations.len()
        )));
    }
    Ok(())
}
