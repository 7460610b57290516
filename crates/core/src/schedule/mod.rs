//! Schedules: start a workflow on a calendar (intervals, cron in a time
//! zone), durable across restarts.
//!
//! A schedule is a workflow of keel's own, [`ScheduleWorkflow`]
//! (`keel.schedule`), on instance `keel.schedule/{schedule_id}`: its
//! history is the schedule's durable state, and everything it does is an
//! ordinary command the driver already makes exactly-once. Each trigger
//! starts the action's workflow as a child named
//! `{schedule_id}@{trigger time}` ([`trigger_instance`]); a named instance
//! is never started twice, so a trigger starts once even when the
//! schedule's run is replayed after a crash, and even when a deleted
//! schedule is created again and backfills the same time.
//!
//! The schedule's loop, on each pass: take the results of the runs it
//! started, compute the triggers that came due (recorded as a side effect,
//! so a later time-zone database cannot change a replay), drop those older
//! than the catch-up window, apply the overlap policy, start what may
//! start, then wait for the next trigger, a change (an update) or a run's
//! close. Control is by updates (`pause`, `unpause`, `trigger`, `backfill`,
//! `update`, `delete`), validated before anything is written; `describe`
//! is a query. Triggered runs are abandoned, not cancelled, when the
//! schedule continues as new or is deleted. A schedule whose calendar has
//! ended (`end_at`) closes once nothing waits and its last run closed.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use keel_storage::{InstanceId, ParentClosePolicy, Payload, SearchValue, SelectKey, Timestamp};
use serde::{Deserialize, Serialize};

use crate::child::{AnyChild, ChildHandle};
use crate::context::WorkflowContext;
use crate::workflow::{Workflow, WorkflowError};

pub mod calendar;

pub use calendar::{rfc3339, Calendar, Cron, SCHEDULE_CALENDARS_MAX, SCHEDULE_INTERVAL_MS_MIN};

/// The workflow type of every schedule.
pub const SCHEDULE_WORKFLOW_TYPE: &str = "keel.schedule";
/// Bytes in a schedule id.
pub const SCHEDULE_ID_BYTES_MAX: usize = 200;
/// Trigger records a schedule keeps (newest last), for `describe`.
pub const SCHEDULE_RECENT_MAX: usize = 10;
/// Triggers waiting behind a running one (`BufferAll`); beyond, skipped.
pub const SCHEDULE_BUFFER_MAX: usize = 1_000;
/// Trigger times one backfill may cover.
pub const SCHEDULE_BACKFILL_TRIGGERS_MAX: usize = 1_000;
/// Trigger times one pass of the loop takes in (a longer backlog is taken
/// in several passes, one side-effect event each).
pub const SCHEDULE_DUE_BATCH_MAX: usize = 64;
/// Trigger times older than the catch-up window counted one by one
/// before the rest of the gap is skipped uncounted.
pub const SCHEDULE_MISSED_COUNT_MAX: u64 = 100_000;
/// Default catch-up window: after downtime, triggers up to this old still
/// start.
pub const SCHEDULE_CATCHUP_WINDOW_MS_DEFAULT: u64 = 60 * 60 * 1000;
/// Runs started under `AllowAll` a schedule follows at once; beyond, a
/// trigger is skipped.
pub const SCHEDULE_RUNNING_MAX: usize = 1_000;
/// Bytes in a pause note.
pub const SCHEDULE_NOTE_BYTES_MAX: usize = 1_024;
/// The change id under which a paused schedule drops the calendar
/// triggers it had queued before the pause (schedules started by older
/// builds started them, and still do when replayed).
pub const PAUSE_DROPS_QUEUED_CHANGE: &str = "keel.schedule.pause-drops-queued";

/// A schedule request that cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// No interval and no cron expression.
    #[error("a schedule needs at least one interval or cron expression")]
    Empty,
    /// More calendars than [`SCHEDULE_CALENDARS_MAX`].
    #[error("a schedule has at most {SCHEDULE_CALENDARS_MAX} intervals and cron expressions; this one has {0}")]
    TooManyCalendars(usize),
    /// An interval under [`SCHEDULE_INTERVAL_MS_MIN`].
    #[error("an interval is at least {SCHEDULE_INTERVAL_MS_MIN} ms; this one is {0} ms")]
    IntervalTooShort(u64),
    /// A cron expression that does not parse.
    #[error("cron expression {expr:?}: {why}")]
    BadCron {
        /// The expression.
        expr: String,
        /// What is wrong with it.
        why: String,
    },
    /// A time zone the built-in IANA database does not know.
    #[error("unknown time zone {0:?} (use an IANA name such as \"Europe/Berlin\")")]
    UnknownTimeZone(String),
    /// `end_at` before `start_at`.
    #[error("the schedule ends before it starts")]
    EndsBeforeStart,
    /// An empty, oversized or malformed schedule id.
    #[error("schedule id {0:?}: must be 1 to {SCHEDULE_ID_BYTES_MAX} bytes without '@' or '/'")]
    BadId(String),
    /// A backfill over more than [`SCHEDULE_BACKFILL_TRIGGERS_MAX`] times.
    #[error("a backfill covers at most {SCHEDULE_BACKFILL_TRIGGERS_MAX} trigger times; this one covers more")]
    BackfillTooLong,
    /// A backfill whose end is before its start.
    #[error("a backfill's end is before its start")]
    BackfillBackwards,
    /// A note over [`SCHEDULE_NOTE_BYTES_MAX`].
    #[error("a note is at most {SCHEDULE_NOTE_BYTES_MAX} bytes")]
    NoteTooLong,
    /// No workflow type to start.
    #[error("the action names no workflow type")]
    NoAction,
    /// The action's memo or search attributes break the store's rules.
    #[error("the action's memo or search attributes: {0}")]
    BadMetadata(String),
}

/// Checks a schedule id: 1 to [`SCHEDULE_ID_BYTES_MAX`] bytes, no `@`
/// (it separates the trigger time) and no `/`.
pub fn check_schedule_id(id: &str) -> Result<(), ScheduleError> {
    if id.is_empty() || id.len() > SCHEDULE_ID_BYTES_MAX || id.contains(['@', '/']) {
        return Err(ScheduleError::BadId(id.to_string()));
    }
    Ok(())
}

/// The instance of the schedule `id`'s own workflow.
pub fn schedule_instance(id: &str) -> InstanceId {
    InstanceId::new(format!("{SCHEDULE_WORKFLOW_TYPE}/{id}"))
}

/// The schedule id of a schedule workflow's instance.
pub fn schedule_id_of(instance: &InstanceId) -> Option<&str> {
    instance
        .as_str()
        .strip_prefix(SCHEDULE_WORKFLOW_TYPE)?
        .strip_prefix('/')
}

/// The instance a trigger at `nominal` starts: the schedule id and the
/// trigger time (RFC 3339, UTC), so one trigger is one instance.
pub fn trigger_instance(id: &str, nominal: Timestamp) -> InstanceId {
    InstanceId::new(format!("{id}@{}", rfc3339(nominal)))
}

/// A fixed interval: triggers at `offset_ms + k * every_ms` after the
/// epoch.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntervalSpec {
    /// The period.
    pub every_ms: u64,
    /// The phase within the period.
    pub offset_ms: u64,
}

/// When a schedule triggers: the union of its intervals and cron
/// expressions, within `start_at..=end_at`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleSpec {
    /// Fixed intervals.
    pub intervals: Vec<IntervalSpec>,
    /// Five-field cron expressions (see [`calendar`]).
    pub cron: Vec<String>,
    /// The IANA time zone cron expressions are read in (empty: UTC).
    pub time_zone: String,
    /// No trigger before this time.
    pub start_at: Option<Timestamp>,
    /// No trigger after this time.
    pub end_at: Option<Timestamp>,
    /// Each trigger starts up to this much later than its time, by an
    /// amount derived from the schedule id and the time (the same on every
    /// host and replay): spreads schedules that share a time.
    pub jitter_ms: u64,
}

impl ScheduleSpec {
    /// Every `period`.
    pub fn every(period: Duration) -> Self {
        ScheduleSpec::default().and_every(period)
    }

    /// On a cron expression (UTC unless [`in_time_zone`](Self::in_time_zone)).
    pub fn cron(expr: &str) -> Self {
        ScheduleSpec::default().and_cron(expr)
    }

    /// Adds an interval.
    pub fn and_every(mut self, period: Duration) -> Self {
        self.intervals.push(IntervalSpec {
            every_ms: period.as_millis() as u64,
            offset_ms: 0,
        });
        self
    }

    /// Adds a cron expression.
    pub fn and_cron(mut self, expr: &str) -> Self {
        self.cron.push(expr.to_string());
        self
    }

    /// Reads cron expressions in `tz` (an IANA name).
    pub fn in_time_zone(mut self, tz: &str) -> Self {
        self.time_zone = tz.to_string();
        self
    }

    /// Delays each trigger by up to `max`.
    pub fn jitter(mut self, max: Duration) -> Self {
        self.jitter_ms = max.as_millis() as u64;
        self
    }

    /// No trigger before `at`.
    pub fn starting_at(mut self, at: Timestamp) -> Self {
        self.start_at = Some(at);
        self
    }

    /// No trigger after `at`.
    pub fn ending_at(mut self, at: Timestamp) -> Self {
        self.end_at = Some(at);
        self
    }

    /// Checks the spec (cron syntax, time zone, bounds).
    pub fn check(&self) -> Result<Calendar, ScheduleError> {
        Calendar::new(self)
    }

    /// A one-line summary for tables.
    pub fn summary(&self) -> String {
        let mut parts: Vec<String> = self
            .intervals
            .iter()
            .map(|i| format!("every {}", human_ms(i.every_ms)))
            .collect();
        for c in &self.cron {
            parts.push(format!("cron \"{c}\""));
        }
        let mut s = parts.join(", ");
        if !self.time_zone.is_empty() && !self.cron.is_empty() {
            s.push_str(&format!(" in {}", self.time_zone));
        }
        if self.jitter_ms > 0 {
            s.push_str(&format!(", jitter {}", human_ms(self.jitter_ms)));
        }
        s
    }
}

fn human_ms(ms: u64) -> String {
    match ms {
        m if m % 86_400_000 == 0 => format!("{}d", m / 86_400_000),
        m if m % 3_600_000 == 0 => format!("{}h", m / 3_600_000),
        m if m % 60_000 == 0 => format!("{}m", m / 60_000),
        m if m % 1000 == 0 => format!("{}s", m / 1000),
        m => format!("{m}ms"),
    }
}

/// What a trigger starts: a workflow by type name with an encoded input,
/// memo and search attributes. Every started run also carries the search
/// attributes [`SCHEDULE_ID_ATTRIBUTE`] and [`SCHEDULE_TIME_ATTRIBUTE`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleAction {
    /// The registered workflow type.
    pub workflow_type: String,
    /// Its input.
    pub input: Payload,
    /// Memo fields each run starts with.
    #[serde(default)]
    pub memo: Vec<(String, Payload)>,
    /// Search attributes each run starts with (`SearchValue` payloads).
    #[serde(default)]
    pub search_attributes: Vec<(String, Payload)>,
    /// The run and execution timeouts each run starts with.
    #[serde(default)]
    pub timeouts: keel_storage::StartTimeouts,
}

/// The search attribute naming the schedule that started a run.
pub const SCHEDULE_ID_ATTRIBUTE: &str = "schedule_id";
/// The search attribute holding the trigger time that started a run.
pub const SCHEDULE_TIME_ATTRIBUTE: &str = "schedule_time";

impl ScheduleAction {
    /// Start workflow `W` with `input`.
    pub fn start<W: Workflow>(input: &W::Input) -> Result<Self, String> {
        Ok(ScheduleAction {
            workflow_type: W::NAME.to_string(),
            input: Payload::encode(input).map_err(|e| e.to_string())?,
            ..ScheduleAction::default()
        })
    }

    /// A memo field each run starts with.
    pub fn memo<T: Serialize + ?Sized>(mut self, name: &str, value: &T) -> Result<Self, String> {
        let p = Payload::encode(value).map_err(|e| format!("memo {name:?}: {e}"))?;
        self.memo.push((name.to_string(), p));
        Ok(self)
    }

    /// A search attribute each run starts with.
    pub fn search_attribute(mut self, name: &str, value: impl Into<SearchValue>) -> Self {
        self.search_attributes
            .push((name.to_string(), value.into().to_payload()));
        self
    }

    /// Each run closes as timed out once open longer than `d` (see
    /// `StartOptions::run_timeout`). Under an overlap policy that waits
    /// for the open run, this bounds how long later triggers wait.
    pub fn run_timeout(mut self, d: std::time::Duration) -> Self {
        self.timeouts = self.timeouts.with_run(d);
        self
    }

    /// Each run's chain (continue-as-new included) closes as timed out
    /// once open longer than `d` from the trigger's start.
    pub fn execution_timeout(mut self, d: std::time::Duration) -> Self {
        self.timeouts = self.timeouts.with_execution(d);
        self
    }

    /// The search attributes the run of the trigger at `nominal` starts
    /// with: the action's, then the schedule's own two.
    pub fn attributes_for(&self, id: &str, nominal: Timestamp) -> Vec<(String, Payload)> {
        let mut attrs = self.search_attributes.clone();
        attrs.push((
            SCHEDULE_ID_ATTRIBUTE.to_string(),
            SearchValue::from(id).to_payload(),
        ));
        attrs.push((
            SCHEDULE_TIME_ATTRIBUTE.to_string(),
            SearchValue::Time(nominal).to_payload(),
        ));
        attrs
    }

    /// Checks the action: a workflow type, and memo and attributes within
    /// the store's rules.
    pub fn check(&self) -> Result<(), ScheduleError> {
        if self.workflow_type.is_empty() {
            return Err(ScheduleError::NoAction);
        }
        let attrs = self.attributes_for("x", Timestamp(0));
        keel_storage::search::start_metadata(None, &attrs, &self.memo)
            .map_err(|e| ScheduleError::BadMetadata(e.to_string()))?;
        Ok(())
    }
}

/// What a trigger does while a run it started earlier is still open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum OverlapPolicy {
    /// Skip the trigger.
    #[default]
    Skip,
    /// Start it once the open run closes; keep at most one waiting (later
    /// triggers are skipped).
    BufferOne,
    /// Start each in turn as the one before closes (up to
    /// [`SCHEDULE_BUFFER_MAX`] waiting).
    BufferAll,
    /// Start it at once, next to the open runs.
    AllowAll,
    /// Ask the open run to cancel, then start once it closed (the newest
    /// trigger waits; one it replaces is skipped).
    CancelOther,
    /// Terminate the open run, then start once it closed (the newest
    /// trigger waits).
    TerminateOther,
}

impl OverlapPolicy {
    /// The policy's name in tables and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            OverlapPolicy::Skip => "skip",
            OverlapPolicy::BufferOne => "buffer-one",
            OverlapPolicy::BufferAll => "buffer-all",
            OverlapPolicy::AllowAll => "allow-all",
            OverlapPolicy::CancelOther => "cancel-other",
            OverlapPolicy::TerminateOther => "terminate-other",
        }
    }
}

/// How a schedule behaves around overlap and downtime.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulePolicies {
    /// What a trigger does while an earlier run is open.
    pub overlap: OverlapPolicy,
    /// After downtime, triggers up to this old still start; older ones
    /// are counted as missed.
    pub catchup_window_ms: u64,
}

impl Default for SchedulePolicies {
    fn default() -> Self {
        SchedulePolicies {
            overlap: OverlapPolicy::Skip,
            catchup_window_ms: SCHEDULE_CATCHUP_WINDOW_MS_DEFAULT,
        }
    }
}

/// What became of one trigger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TriggerOutcome {
    /// Its run is open.
    Running,
    /// Its run completed.
    Completed,
    /// Its run failed, was cancelled or terminated.
    Failed(String),
    /// Skipped by the overlap policy or the buffer limit.
    Skipped,
    /// Older than the catch-up window when the schedule saw it.
    Missed,
    /// Its instance could not be started (already used, unknown type).
    NotStarted(String),
    /// Its run was open when the schedule continued as new or was
    /// deleted: not followed any more.
    Abandoned,
}

/// One trigger, for `describe`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TriggerRecord {
    /// The trigger time (what the instance id names).
    pub nominal: Timestamp,
    /// When its run was started.
    pub started_at: Option<Timestamp>,
    /// The instance it started (or would have).
    pub instance: String,
    /// What became of it.
    pub outcome: TriggerOutcome,
    /// Triggered by a person (`trigger`, `backfill`), not the calendar.
    pub manual: bool,
}

/// A trigger waiting to start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingTrigger {
    /// Its time.
    pub nominal: Timestamp,
    /// The overlap policy it starts under.
    pub overlap: OverlapPolicy,
    /// From `trigger` or `backfill`: no jitter.
    pub manual: bool,
}

/// Counters a schedule keeps across continue-as-new.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleCounts {
    /// Runs started.
    pub started: u64,
    /// Triggers skipped by overlap or buffer limits.
    pub skipped: u64,
    /// Triggers older than the catch-up window.
    pub missed: u64,
    /// Triggers whose instance could not be started.
    pub not_started: u64,
    /// Started runs that completed.
    pub completed: u64,
    /// Started runs that failed, were cancelled or terminated.
    pub failed: u64,
}

/// A schedule's whole state: the input of each of its runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleInput {
    /// The schedule id.
    pub id: String,
    /// When it triggers.
    pub spec: ScheduleSpec,
    /// What it starts.
    pub action: ScheduleAction,
    /// Overlap and catch-up.
    pub policies: SchedulePolicies,
    /// Paused: calendar triggers are skipped (manual ones still start).
    pub paused: bool,
    /// Why it was paused or unpaused.
    pub note: String,
    /// Calendar times up to here have been taken in (0: from the
    /// schedule's creation).
    pub cursor: Timestamp,
    /// Triggers waiting to start.
    pub pending: VecDeque<PendingTrigger>,
    /// The newest trigger records.
    pub recent: VecDeque<TriggerRecord>,
    /// Counters.
    pub counts: ScheduleCounts,
}

/// What `describe` shows of a schedule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleDescription {
    /// The schedule id.
    pub id: String,
    /// When it triggers.
    pub spec: ScheduleSpec,
    /// The workflow type it starts.
    pub workflow_type: String,
    /// Overlap and catch-up.
    pub policies: SchedulePolicies,
    /// Whether calendar triggers are skipped.
    pub paused: bool,
    /// The pause note.
    pub note: String,
    /// Instances it started that are open.
    pub running: Vec<String>,
    /// Triggers waiting to start.
    pub pending: Vec<PendingTrigger>,
    /// The next calendar trigger times (at most 5; none while paused).
    pub next: Vec<Timestamp>,
    /// The newest trigger records, oldest first.
    pub recent: Vec<TriggerRecord>,
    /// Counters.
    pub counts: ScheduleCounts,
    /// Deleted: no more triggers.
    pub deleted: bool,
}

/// Changes `update` makes; `None` keeps the current value.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleChange {
    /// A new calendar (checked before it is accepted).
    pub spec: Option<ScheduleSpec>,
    /// A new action.
    pub action: Option<ScheduleAction>,
    /// New policies.
    pub policies: Option<SchedulePolicies>,
}

/// A backfill request: every calendar time in `start..=end`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backfill {
    /// First time covered.
    pub start: Timestamp,
    /// Last time covered.
    pub end: Timestamp,
    /// The overlap policy the backfilled triggers start under (`None`:
    /// the schedule's).
    pub overlap: Option<OverlapPolicy>,
}

/// The memo field a schedule keeps its summary in (`keel schedule list`
/// reads it from the run's record, never from its history).
pub const SCHEDULE_MEMO_FIELD: &str = "schedule";

/// The summary a schedule keeps in its memo.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleMemo {
    /// When it triggers.
    pub spec: ScheduleSpec,
    /// The workflow type it starts.
    pub workflow_type: String,
    /// Its overlap policy.
    pub overlap: OverlapPolicy,
    /// Whether calendar triggers are skipped.
    pub paused: bool,
    /// The pause note.
    pub note: String,
    /// The newest trigger.
    pub last: Option<TriggerRecord>,
    /// Counters.
    pub counts: ScheduleCounts,
}

/// The result of a deleted schedule's run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleClosed {
    /// Counters at deletion.
    pub counts: ScheduleCounts,
}

/// keel's schedule workflow (registered in every [`crate::WorkflowRegistry`]).
#[derive(Debug)]
pub struct ScheduleWorkflow;

impl Workflow for ScheduleWorkflow {
    const NAME: &'static str = SCHEDULE_WORKFLOW_TYPE;
    type Input = ScheduleInput;
    type Output = ScheduleClosed;

    async fn run(
        ctx: WorkflowContext,
        input: ScheduleInput,
    ) -> Result<ScheduleClosed, WorkflowError> {
        Scheduler::new(ctx, input).run().await
    }
}

/// A run the schedule started and still follows.
struct Running {
    nominal: Timestamp,
    handle: ChildHandle<AnyChild>,
    /// Started under a policy other than `AllowAll`: later triggers wait
    /// for it (or skip).
    blocks: bool,
    /// A cancel or terminate was issued for it.
    stopping: bool,
}

/// State the loop, the query and the update handlers share.
struct Shared {
    input: ScheduleInput,
    /// Bumped by every accepted update: the loop re-plans.
    changed: u64,
    /// The calendar changed: the cached next time is stale.
    replan: bool,
    deleted: bool,
    running: Vec<String>,
}

/// The calendar times a pass takes in, recorded as one side effect.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Due {
    /// Times in the catch-up window, up to now, oldest first.
    due: Vec<Timestamp>,
    /// Times older than the window.
    missed: u64,
    /// The newest missed time.
    last_missed: Option<Timestamp>,
    /// The cursor after this pass.
    cursor: Timestamp,
    /// The first time after `cursor` (`None`: no more).
    next: Option<Timestamp>,
}

fn take_due(cal: &Calendar, cursor: Timestamp, now: Timestamp, window_ms: u64) -> Due {
    let window_start = Timestamp(now.as_millis().saturating_sub(window_ms));
    let mut out = Due {
        cursor,
        ..Due::default()
    };
    loop {
        match cal.next_after(out.cursor) {
            Some(t) if t < window_start => {
                out.missed += 1;
                out.last_missed = Some(t);
                out.cursor = t;
                if out.missed >= SCHEDULE_MISSED_COUNT_MAX {
                    // The rest of the gap is skipped uncounted.
                    out.cursor = Timestamp(window_start.as_millis().saturating_sub(1));
                    break;
                }
            }
            _ => break,
        }
    }
    while out.due.len() < SCHEDULE_DUE_BATCH_MAX {
        match cal.next_after(out.cursor) {
            Some(t) if t <= now => {
                out.due.push(t);
                out.cursor = t;
            }
            _ => break,
        }
    }
    out.next = cal.next_after(out.cursor);
    out
}

/// The jitter of the trigger at `nominal`: a hash of the schedule id and
/// the time, below `max_ms`.
fn jitter_ms(id: &str, nominal: Timestamp, max_ms: u64) -> u64 {
    if max_ms == 0 {
        return 0;
    }
    // FNV-1a: stable across builds and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes().chain(nominal.as_millis().to_be_bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h % max_ms
}

struct Scheduler {
    ctx: WorkflowContext,
    shared: Rc<RefCell<Shared>>,
    running: Vec<Running>,
    /// The next calendar time, once computed (recorded) for the cursor.
    next: Option<Option<Timestamp>>,
    /// The memo last written.
    memo: Option<ScheduleMemo>,
}

impl Scheduler {
    fn new(ctx: WorkflowContext, mut input: ScheduleInput) -> Self {
        if input.cursor == Timestamp(0) {
            // A new schedule triggers from its creation on.
            input.cursor = ctx.now();
        }
        let shared = Rc::new(RefCell::new(Shared {
            input,
            changed: 0,
            replan: false,
            deleted: false,
            running: Vec::new(),
        }));
        let s = Scheduler {
            ctx,
            shared,
            running: Vec::new(),
            next: None,
            memo: None,
        };
        s.register_handlers();
        s
    }

    fn register_handlers(&self) {
        let ctx = &self.ctx;
        let sh = self.shared.clone();
        ctx.on_query("describe", move |_: ()| describe(&sh.borrow()));

        let sh = self.shared.clone();
        ctx.on_update(
            "pause",
            |note: &String| check_note(note),
            move |note: String| {
                let sh = sh.clone();
                async move {
                    let mut s = sh.borrow_mut();
                    s.input.paused = true;
                    s.input.note = note;
                    s.changed += 1;
                    Ok(())
                }
            },
        );
        let sh = self.shared.clone();
        let ctx2 = ctx.clone();
        ctx.on_update(
            "unpause",
            |note: &String| check_note(note),
            move |note: String| {
                let sh = sh.clone();
                let now = ctx2.now();
                async move {
                    let mut s = sh.borrow_mut();
                    if s.input.paused {
                        // Calendar times while paused are not caught up.
                        s.input.cursor = s.input.cursor.max(now);
                        s.replan = true;
                    }
                    s.input.paused = false;
                    s.input.note = note;
                    s.changed += 1;
                    Ok(())
                }
            },
        );
        let sh = self.shared.clone();
        let ctx2 = ctx.clone();
        ctx.on_update(
            "trigger",
            |_: &Option<OverlapPolicy>| Ok(()),
            move |overlap: Option<OverlapPolicy>| {
                let sh = sh.clone();
                let now = ctx2.now();
                async move {
                    let mut s = sh.borrow_mut();
                    let overlap = overlap.unwrap_or(s.input.policies.overlap);
                    s.input.pending.push_back(PendingTrigger {
                        nominal: now,
                        overlap,
                        manual: true,
                    });
                    s.changed += 1;
                    Ok(rfc3339(now))
                }
            },
        );
        let sh = self.shared.clone();
        let sh_v = self.shared.clone();
        let ctx2 = ctx.clone();
        ctx.on_update(
            "backfill",
            move |b: &Backfill| {
                if b.end < b.start {
                    return Err(ScheduleError::BackfillBackwards.to_string());
                }
                let cal = sh_v
                    .borrow()
                    .input
                    .spec
                    .check()
                    .map_err(|e| e.to_string())?;
                let times = backfill_times(&cal, b, SCHEDULE_BACKFILL_TRIGGERS_MAX + 1);
                if times.len() > SCHEDULE_BACKFILL_TRIGGERS_MAX {
                    return Err(ScheduleError::BackfillTooLong.to_string());
                }
                Ok(())
            },
            move |b: Backfill| {
                let sh = sh.clone();
                let ctx = ctx2.clone();
                async move {
                    let spec = sh.borrow().input.spec.clone();
                    // Recorded: a later time-zone database replays the same.
                    let times: Vec<Timestamp> = ctx.side_effect(|| match spec.check() {
                        Ok(cal) => backfill_times(&cal, &b, SCHEDULE_BACKFILL_TRIGGERS_MAX),
                        Err(_) => Vec::new(),
                    })?;
                    let mut s = sh.borrow_mut();
                    let overlap = b.overlap.unwrap_or(s.input.policies.overlap);
                    for nominal in &times {
                        s.input.pending.push_back(PendingTrigger {
                            nominal: *nominal,
                            overlap,
                            manual: true,
                        });
                    }
                    s.changed += 1;
                    Ok(times.len() as u64)
                }
            },
        );
        let sh = self.shared.clone();
        ctx.on_update(
            "update",
            |c: &ScheduleChange| {
                if let Some(spec) = &c.spec {
                    spec.check().map_err(|e| e.to_string())?;
                }
                if let Some(a) = &c.action {
                    a.check().map_err(|e| e.to_string())?;
                }
                Ok(())
            },
            move |c: ScheduleChange| {
                let sh = sh.clone();
                async move {
                    let mut s = sh.borrow_mut();
                    if let Some(spec) = c.spec {
                        s.input.spec = spec;
                        s.replan = true;
                    }
                    if let Some(action) = c.action {
                        s.input.action = action;
                    }
                    if let Some(p) = c.policies {
                        s.input.policies = p;
                    }
                    s.changed += 1;
                    Ok(())
                }
            },
        );
        let sh = self.shared.clone();
        ctx.on_update(
            "delete",
            |_: &()| Ok(()),
            move |_: ()| {
                let sh = sh.clone();
                async move {
                    let mut s = sh.borrow_mut();
                    s.deleted = true;
                    s.changed += 1;
                    Ok(())
                }
            },
        );
    }

    fn record(&self, rec: TriggerRecord) {
        let mut s = self.shared.borrow_mut();
        let counts = &mut s.input.counts;
        match &rec.outcome {
            TriggerOutcome::Running => counts.started += 1,
            TriggerOutcome::Skipped => counts.skipped += 1,
            TriggerOutcome::Missed => counts.missed += 1,
            TriggerOutcome::NotStarted(_) => counts.not_started += 1,
            TriggerOutcome::Completed => counts.completed += 1,
            TriggerOutcome::Failed(_) => counts.failed += 1,
            TriggerOutcome::Abandoned => {}
        }
        let recent = &mut s.input.recent;
        // A run's close updates the record of its start (nothing else
        // does: a refused repeat of a running time gets its own record).
        let closes = matches!(
            rec.outcome,
            TriggerOutcome::Completed | TriggerOutcome::Failed(_) | TriggerOutcome::Abandoned
        );
        if let Some(r) = recent
            .iter_mut()
            .find(|r| closes && r.instance == rec.instance && r.outcome == TriggerOutcome::Running)
        {
            r.outcome = rec.outcome;
            return;
        }
        recent.push_back(rec);
        while recent.len() > SCHEDULE_RECENT_MAX {
            recent.pop_front();
        }
    }

    fn trigger_record(&self, p: &PendingTrigger, outcome: TriggerOutcome) -> TriggerRecord {
        let id = self.shared.borrow().input.id.clone();
        TriggerRecord {
            nominal: p.nominal,
            started_at: None,
            instance: trigger_instance(&id, p.nominal).to_string(),
            outcome,
            manual: p.manual,
        }
    }

    fn blocked(&self) -> bool {
        self.running.iter().any(|r| r.blocks)
    }

    /// Queues a calendar trigger, or skips it per the overlap policy.
    fn enqueue(&self, p: PendingTrigger) {
        let waiting = self.shared.borrow().input.pending.len();
        if matches!(
            p.overlap,
            OverlapPolicy::CancelOther | OverlapPolicy::TerminateOther
        ) && self.blocked()
            && waiting >= 1
        {
            // The newest trigger replaces the one waiting for the open run
            // to stop (a run that ignores its cancellation keeps one
            // trigger waiting, not a growing queue).
            let old = self.shared.borrow_mut().input.pending.pop_back();
            if let Some(old) = old {
                let rec = self.trigger_record(&old, TriggerOutcome::Skipped);
                self.record(rec);
            }
            self.shared.borrow_mut().input.pending.push_back(p);
            return;
        }
        let skip = match p.overlap {
            OverlapPolicy::Skip => self.blocked(),
            // One may wait behind the run; when none runs, the head of
            // the queue is about to start and one more may wait behind it.
            OverlapPolicy::BufferOne => waiting >= if self.blocked() { 1 } else { 2 },
            _ => waiting >= SCHEDULE_BUFFER_MAX,
        };
        if skip {
            let rec = self.trigger_record(&p, TriggerOutcome::Skipped);
            self.record(rec);
        } else {
            self.shared.borrow_mut().input.pending.push_back(p);
        }
    }

    /// Takes the results of runs that closed.
    async fn reap(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if !self.running[i].handle.is_closed() {
                i += 1;
                continue;
            }
            let r = self.running.remove(i);
            let outcome = match r.handle.result().await {
                Ok(_) => TriggerOutcome::Completed,
                Err(f) => TriggerOutcome::Failed(clip(f.message)),
            };
            let id = self.shared.borrow().input.id.clone();
            self.record(TriggerRecord {
                nominal: r.nominal,
                started_at: None,
                instance: trigger_instance(&id, r.nominal).to_string(),
                outcome,
                manual: false,
            });
        }
        let names = self
            .running
            .iter()
            .map(|r| r.handle.instance_id().to_string())
            .collect();
        self.shared.borrow_mut().running = names;
    }

    /// Takes in the calendar times that came due.
    fn take_in(&mut self) -> Result<(), WorkflowError> {
        let now = self.ctx.now();
        if std::mem::take(&mut self.shared.borrow_mut().replan) {
            self.next = None;
        }
        loop {
            if self.shared.borrow().input.paused {
                return Ok(());
            }
            if let Some(next) = self.next {
                if next.is_none_or(|t| t > now) {
                    return Ok(());
                }
            }
            let (spec, cursor, window) = {
                let s = self.shared.borrow();
                let i = &s.input;
                (i.spec.clone(), i.cursor, i.policies.catchup_window_ms)
            };
            // Recorded: a replay under a later time-zone database (or a
            // changed calendar) takes in the same times.
            let due: Due = self.ctx.side_effect(move || match spec.check() {
                Ok(cal) => take_due(&cal, cursor, now, window),
                Err(_) => Due {
                    cursor,
                    ..Due::default()
                },
            })?;
            self.shared.borrow_mut().input.cursor = due.cursor;
            self.next = Some(due.next);
            if due.missed > 0 {
                let overlap = self.shared.borrow().input.policies.overlap;
                let p = PendingTrigger {
                    nominal: due.last_missed.unwrap_or(cursor),
                    overlap,
                    manual: false,
                };
                let rec = self.trigger_record(&p, TriggerOutcome::Missed);
                self.record(rec);
                self.shared.borrow_mut().input.counts.missed += due.missed - 1;
            }
            for nominal in due.due {
                let overlap = self.shared.borrow().input.policies.overlap;
                self.enqueue(PendingTrigger {
                    nominal,
                    overlap,
                    manual: false,
                });
            }
        }
    }

    /// Starts what may start; returns when the head must wait (blocked,
    /// or its jitter not yet over).
    async fn start_ready(&mut self) -> Result<Option<Timestamp>, WorkflowError> {
        loop {
            if self.shared.borrow().deleted {
                // Deleted while starting: nothing more starts.
                return Ok(None);
            }
            let now = self.ctx.now();
            let (head, id, jitter, action) = {
                let s = self.shared.borrow();
                let Some(head) = s.input.pending.front().cloned() else {
                    return Ok(None);
                };
                (
                    head,
                    s.input.id.clone(),
                    s.input.spec.jitter_ms,
                    s.input.action.clone(),
                )
            };
            let ready_at = match head.manual {
                true => head.nominal,
                false => head.nominal.plus_ms(jitter_ms(&id, head.nominal, jitter)),
            };
            if ready_at > now {
                return Ok(Some(ready_at));
            }
            // A pause skips calendar triggers, those queued before it too.
            let paused = self.shared.borrow().input.paused;
            if paused && !head.manual && self.ctx.patched(PAUSE_DROPS_QUEUED_CHANGE) {
                self.shared.borrow_mut().input.pending.pop_front();
                let rec = self.trigger_record(&head, TriggerOutcome::Skipped);
                self.record(rec);
                continue;
            }
            if head.overlap != OverlapPolicy::AllowAll && self.blocked() {
                match head.overlap {
                    OverlapPolicy::CancelOther | OverlapPolicy::TerminateOther => {
                        for r in self.running.iter_mut().filter(|r| r.blocks && !r.stopping) {
                            r.stopping = true;
                            let why = format!("schedule {id}: a newer trigger replaces it");
                            match head.overlap {
                                OverlapPolicy::CancelOther => r.handle.cancel(&why),
                                _ => r.handle.terminate(&why),
                            }
                        }
                        return Ok(None);
                    }
                    OverlapPolicy::Skip => {
                        // Queued before the run it overlaps started.
                        self.shared.borrow_mut().input.pending.pop_front();
                        let rec = self.trigger_record(&head, TriggerOutcome::Skipped);
                        self.record(rec);
                        continue;
                    }
                    _ => return Ok(None),
                }
            }
            self.shared.borrow_mut().input.pending.pop_front();
            if self.running.len() >= SCHEDULE_RUNNING_MAX {
                let rec = self.trigger_record(&head, TriggerOutcome::Skipped);
                self.record(rec);
                continue;
            }
            let instance = trigger_instance(&id, head.nominal);
            let mut call = self
                .ctx
                .child_named(&action.workflow_type, action.input.clone())
                .instance_id(instance.clone())
                .close_policy(ParentClosePolicy::Abandon);
            call.memo = action.memo.clone();
            call.search_attributes = action.attributes_for(&id, head.nominal);
            call.timeouts = action.timeouts;
            let started = call.start().await;
            match started {
                Ok(handle) => {
                    let mut rec = self.trigger_record(&head, TriggerOutcome::Running);
                    rec.started_at = Some(self.ctx.now());
                    self.record(rec);
                    self.running.push(Running {
                        nominal: head.nominal,
                        handle,
                        blocks: head.overlap != OverlapPolicy::AllowAll,
                        stopping: false,
                    });
                }
                Err(f) => {
                    let rec =
                        self.trigger_record(&head, TriggerOutcome::NotStarted(clip(f.message)));
                    self.record(rec);
                }
            }
        }
    }

    fn write_memo(&mut self) -> Result<(), WorkflowError> {
        let memo = {
            let s = self.shared.borrow();
            let i = &s.input;
            ScheduleMemo {
                spec: i.spec.clone(),
                workflow_type: i.action.workflow_type.clone(),
                overlap: i.policies.overlap,
                paused: i.paused,
                note: i.note.clone(),
                last: i.recent.back().cloned(),
                counts: i.counts.clone(),
            }
        };
        if self.memo.as_ref() != Some(&memo) {
            self.ctx.upsert_memo(SCHEDULE_MEMO_FIELD, &memo)?;
            self.memo = Some(memo);
        }
        Ok(())
    }

    async fn run(mut self) -> Result<ScheduleClosed, WorkflowError> {
        self.memo = self.ctx.memo(SCHEDULE_MEMO_FIELD);
        loop {
            self.reap().await;
            if self.shared.borrow().deleted {
                break;
            }
            self.take_in()?;
            let ready_at = self.start_ready().await?;
            if self.running.iter().any(|r| r.handle.is_closed()) {
                // A run closed while others started: take its result and
                // start what it held back before waiting.
                continue;
            }
            // Nothing to take in: this publishes the open runs for
            // `describe`.
            self.reap().await;
            self.write_memo()?;
            if self.shared.borrow().deleted {
                break;
            }
            // The calendar has ended and nothing waits or runs: done.
            let idle = self.shared.borrow().input.pending.is_empty() && self.running.is_empty();
            if self.next == Some(None) && idle {
                break;
            }
            // Continue as new between triggers once the history is long,
            // unless a run later triggers wait for is open (a new run
            // could not follow it).
            if self.ctx.continue_as_new_suggested() && !self.blocked() {
                let mut input = self.shared.borrow().input.clone();
                for r in &self.running {
                    let name = r.handle.instance_id().as_str();
                    if let Some(x) = input
                        .recent
                        .iter_mut()
                        .find(|x| x.instance == name && x.outcome == TriggerOutcome::Running)
                    {
                        x.outcome = TriggerOutcome::Abandoned;
                    }
                }
                return Err(WorkflowError::continue_as_new(&input));
            }
            let now = self.ctx.now();
            let paused = self.shared.borrow().input.paused;
            let calendar = match (paused, self.next) {
                (false, Some(Some(t))) => Some(t),
                _ => None,
            };
            let wake = [calendar, ready_at].into_iter().flatten().min();
            let seen = self.shared.borrow().changed;
            let sh = self.shared.clone();
            let handles: Vec<ChildHandle<AnyChild>> =
                self.running.iter().map(|r| r.handle.clone()).collect();
            let mut select = self.ctx.select().condition("change", move || {
                sh.borrow().changed != seen || handles.iter().any(|h| h.is_closed())
            });
            if let Some(at) = wake {
                let wait =
                    Duration::from_millis(at.as_millis().saturating_sub(now.as_millis()).max(1));
                select = select.timer("due", wait);
            }
            let selected = select.await?;
            if let Some(h) = selected.handle("due") {
                if selected.key != SelectKey::Name("due".into()) {
                    h.cancel();
                }
            }
        }
        let counts = {
            let s = self.shared.borrow();
            s.input.counts.clone()
        };
        for r in std::mem::take(&mut self.running) {
            let id = self.shared.borrow().input.id.clone();
            self.record(TriggerRecord {
                nominal: r.nominal,
                started_at: None,
                instance: trigger_instance(&id, r.nominal).to_string(),
                outcome: TriggerOutcome::Abandoned,
                manual: false,
            });
        }
        self.write_memo()?;
        Ok(ScheduleClosed { counts })
    }
}

/// Bytes of a failure message a trigger record keeps (the records ride in
/// the memo, which has a size limit).
pub const TRIGGER_MESSAGE_BYTES_MAX: usize = 200;

fn clip(mut message: String) -> String {
    if message.len() > TRIGGER_MESSAGE_BYTES_MAX {
        let mut end = TRIGGER_MESSAGE_BYTES_MAX;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push('…');
    }
    message
}

fn check_note(note: &str) -> Result<(), String> {
    if note.len() > SCHEDULE_NOTE_BYTES_MAX {
        return Err(ScheduleError::NoteTooLong.to_string());
    }
    Ok(())
}

fn backfill_times(cal: &Calendar, b: &Backfill, max: usize) -> Vec<Timestamp> {
    let from = Timestamp(b.start.as_millis().saturating_sub(1));
    cal.upcoming(from, max)
        .into_iter()
        .take_while(|t| *t <= b.end)
        .collect()
}

fn describe(s: &Shared) -> ScheduleDescription {
    let i = &s.input;
    let next = match (i.paused, i.spec.check()) {
        (false, Ok(cal)) => cal.upcoming(i.cursor, 5),
        _ => Vec::new(),
    };
    ScheduleDescription {
        id: i.id.clone(),
        spec: i.spec.clone(),
        workflow_type: i.action.workflow_type.clone(),
        policies: i.policies.clone(),
        paused: i.paused,
        note: i.note.clone(),
        running: s.running.clone(),
        pending: i.pending.iter().cloned().collect(),
        next,
        recent: i.recent.iter().cloned().collect(),
        counts: i.counts.clone(),
        deleted: s.deleted,
    }
}

#[cfg(test)]
mod tests {
    //! Goal: the pure parts of the schedule loop: what a pass takes in
    //! after downtime (due, missed, the cursor), jitter (bounded, the
    //! same for the same trigger), and the names a trigger gets. Method:
    //! fixed calendars and times; a property over random cron
    //! expressions against a minute-by-minute search.
    use super::*;
    use jiff::tz::TimeZone;
    use proptest::prelude::*;

    fn every_second() -> Calendar {
        ScheduleSpec::every(Duration::from_secs(1))
            .check()
            .expect("valid")
    }

    #[test]
    fn a_pass_takes_in_the_window_and_counts_the_rest_as_missed() {
        let cal = every_second();
        // Down from 10 s to 100 s with a 5 s window: 11..=94 missed,
        // 95..=100 due, the next at 101.
        let due = take_due(&cal, Timestamp(10_000), Timestamp(100_000), 5_000);
        assert_eq!(due.missed, 84);
        assert_eq!(due.last_missed, Some(Timestamp(94_000)));
        assert_eq!(
            due.due,
            (95..=100).map(|s| Timestamp(s * 1000)).collect::<Vec<_>>()
        );
        assert_eq!(
            (due.cursor, due.next),
            (Timestamp(100_000), Some(Timestamp(101_000)))
        );
        // A backlog longer than a batch is taken in over several passes.
        let due = take_due(&cal, Timestamp(0), Timestamp(1_000_000), u64::MAX);
        assert_eq!(due.due.len(), SCHEDULE_DUE_BATCH_MAX);
        assert_eq!(due.cursor, Timestamp(SCHEDULE_DUE_BATCH_MAX as u64 * 1000));
    }

    #[test]
    fn jitter_is_bounded_and_the_same_for_the_same_trigger() {
        let mut seen = std::collections::BTreeSet::new();
        for s in 0..200u64 {
            let j = jitter_ms("nightly", Timestamp(s * 1000), 30_000);
            assert!(j < 30_000);
            assert_eq!(j, jitter_ms("nightly", Timestamp(s * 1000), 30_000));
            seen.insert(j);
        }
        assert!(seen.len() > 150, "spread over the range: {}", seen.len());
        assert_eq!(jitter_ms("nightly", Timestamp(5), 0), 0);
    }

    #[test]
    fn ids_and_names() {
        assert_eq!(
            trigger_instance("nightly", Timestamp(1_796_000_000_000)).as_str(),
            "nightly@2026-11-30T00:53:20Z"
        );
        assert_eq!(
            trigger_instance("t", Timestamp(1_500)).as_str(),
            "t@1970-01-01T00:00:01.500Z"
        );
        assert_eq!(schedule_id_of(&schedule_instance("a-b")), Some("a-b"));
        assert_eq!(schedule_id_of(&InstanceId::new("order-1")), None);
        assert!(check_schedule_id("ok-1").is_ok());
        for bad in ["", "a@b", "a/b"] {
            assert!(matches!(
                check_schedule_id(bad),
                Err(ScheduleError::BadId(_))
            ));
        }
        assert!(check_schedule_id(&"x".repeat(SCHEDULE_ID_BYTES_MAX + 1)).is_err());
    }

    fn field(lo: u32, hi: u32) -> impl Strategy<Value = String> {
        prop_oneof![
            Just("*".to_string()),
            (lo..=hi).prop_map(|v| v.to_string()),
            (lo..=hi, 0..=5u32).prop_map(move |(a, w)| format!("{a}-{}", (a + w).min(hi))),
            (1..=7u32).prop_map(|s| format!("*/{s}")),
            (lo..=hi, lo..=hi).prop_map(|(a, b)| format!("{a},{b}")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn cron_next_is_the_first_matching_minute(
            m in field(0, 59), h in field(0, 23), dom in field(1, 28), mon in field(1, 12),
            dow in field(0, 6), start in 0u64..(400 * 86_400),
        ) {
            let expr = format!("{m} {h} {dom} {mon} {dow}");
            let cron = Cron::parse(&expr).expect("generated expressions parse");
            let after = Timestamp(1_767_225_600_000 + start * 1000); // from 2026-01-01
            let next = cron.next_after(&TimeZone::UTC, after);
            // Minute by minute for up to 400 days.
            let mut t = (after.as_millis() / 60_000 + 1) * 60_000;
            let limit = after.as_millis() + 400 * 86_400_000;
            let mut expected = None;
            while t <= limit {
                let dt = jiff::Timestamp::from_millisecond(t as i64).unwrap().to_zoned(TimeZone::UTC).datetime();
                if cron.day_matches(dt.date())
                    && cron.hours & (1 << dt.hour()) != 0
                    && cron.minutes & (1u64 << dt.minute()) != 0
                {
                    expected = Some(Timestamp(t));
                    break;
                }
                t += 60_000;
            }
            match expected {
                Some(e) => prop_assert_eq!(next, Some(e), "{}", expr),
                None => prop_assert!(next.is_none_or(|n| n.as_millis() > limit), "{}", expr),
            }
        }
    }
}
