//! [`Schedules`]: create, describe, list, change and delete schedules
//! through a [`Client`]. A schedule is keel's own workflow
//! (`keel.schedule`, see [`keel_core::schedule`]) on instance
//! `keel.schedule/{id}`, so each call here is a start, a query, an update
//! or a list of the engine's, with every guarantee those have.

use keel_core::driver::ReusePolicy;
use keel_core::schedule::{
    check_schedule_id, schedule_id_of, schedule_instance, Backfill, OverlapPolicy, ScheduleAction,
    ScheduleChange, ScheduleDescription, ScheduleError, ScheduleInput, ScheduleMemo,
    SchedulePolicies, ScheduleSpec, SCHEDULE_MEMO_FIELD, SCHEDULE_NOTE_BYTES_MAX,
    SCHEDULE_WORKFLOW_TYPE,
};
use keel_storage::{Payload, RunFilter, RunId, Timestamp};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Duration;

use crate::client::{Client, EngineError, StartOptions, StartOutcome};

/// Schedules [`Schedules::list`] returns at most.
pub const SCHEDULES_LIST_MAX: usize = 10_000;
const LIST_PAGE: usize = 500;

/// A schedule to create: when, what, and how it behaves.
#[derive(Clone, Debug)]
pub struct NewSchedule {
    spec: ScheduleSpec,
    action: ScheduleAction,
    policies: SchedulePolicies,
    paused: Option<String>,
}

impl NewSchedule {
    /// Starts `action` on `spec`, skipping a trigger while the run before
    /// is open, catching up an hour after downtime.
    pub fn new(spec: ScheduleSpec, action: ScheduleAction) -> Self {
        NewSchedule {
            spec,
            action,
            policies: SchedulePolicies::default(),
            paused: None,
        }
    }

    /// What a trigger does while an earlier run is open.
    pub fn overlap(mut self, policy: OverlapPolicy) -> Self {
        self.policies.overlap = policy;
        self
    }

    /// After downtime, triggers up to `window` old still start.
    pub fn catchup_window(mut self, window: Duration) -> Self {
        self.policies.catchup_window_ms = window.as_millis() as u64;
        self
    }

    /// Creates it paused, with a note saying why.
    pub fn paused(mut self, note: &str) -> Self {
        self.paused = Some(note.to_string());
        self
    }
}

/// One schedule in [`Schedules::list`], read from its run's record.
#[derive(Clone, Debug)]
pub struct ScheduleSummary {
    /// The schedule id.
    pub id: String,
    /// Its current run.
    pub run_id: RunId,
    /// Its summary (calendar, workflow type, paused, newest trigger,
    /// counters), as of its last commit.
    pub memo: Option<ScheduleMemo>,
}

/// Schedules of one engine ([`Client::schedules`]).
#[derive(Debug, Clone, Copy)]
pub struct Schedules<'a> {
    client: &'a Client,
}

impl Client {
    /// The engine's schedules.
    pub fn schedules(&self) -> Schedules<'_> {
        Schedules { client: self }
    }
}

impl Schedules<'_> {
    /// Creates schedule `id`. Its first trigger is the first calendar time
    /// after its creation. Refused with nothing written when the id, the
    /// calendar or the action does not check, or when the schedule exists.
    pub async fn create(&self, id: &str, schedule: NewSchedule) -> Result<RunId, EngineError> {
        check_schedule_id(id)?;
        schedule.spec.check()?;
        schedule.action.check()?;
        let note = schedule.paused.clone().unwrap_or_default();
        if note.len() > SCHEDULE_NOTE_BYTES_MAX {
            return Err(ScheduleError::NoteTooLong.into());
        }
        let memo = ScheduleMemo {
            spec: schedule.spec.clone(),
            workflow_type: schedule.action.workflow_type.clone(),
            overlap: schedule.policies.overlap,
            paused: schedule.paused.is_some(),
            note: note.clone(),
            last: None,
            counts: Default::default(),
        };
        let input = ScheduleInput {
            id: id.to_string(),
            spec: schedule.spec,
            action: schedule.action,
            policies: schedule.policies,
            paused: schedule.paused.is_some(),
            note,
            ..ScheduleInput::default()
        };
        let payload = Payload::encode(&input).map_err(|e| EngineError::Encode(e.to_string()))?;
        // A deleted schedule's id may be used again.
        let options = StartOptions::new()
            .reuse(ReusePolicy::AllowDuplicate)
            .memo(SCHEDULE_MEMO_FIELD, &memo);
        let instance = schedule_instance(id);
        match self
            .client
            .start_raw_with(SCHEDULE_WORKFLOW_TYPE, instance.as_str(), payload, options)
            .await?
        {
            StartOutcome::Started(run) => Ok(run),
            StartOutcome::Existing(_) => Err(EngineError::ScheduleExists(id.to_string())),
        }
    }

    /// The schedule's state: calendar, policies, paused, open runs,
    /// waiting triggers, the next times, the newest triggers, counters.
    pub async fn describe(&self, id: &str) -> Result<ScheduleDescription, EngineError> {
        check_schedule_id(id)?;
        let instance = schedule_instance(id);
        let d: ScheduleDescription = self
            .client
            .query(instance.as_str(), "describe", &())
            .await
            .map_err(|e| unknown(id, e))?;
        if d.deleted {
            return Err(EngineError::UnknownSchedule(id.to_string()));
        }
        Ok(d)
    }

    /// Every schedule (up to [`SCHEDULES_LIST_MAX`]), through the index.
    pub async fn list(&self) -> Result<Vec<ScheduleSummary>, EngineError> {
        let filter = RunFilter::parse(&format!(
            "type = \"{SCHEDULE_WORKFLOW_TYPE}\" and status = running"
        ))
        .map_err(|e| EngineError::BadFilter(e.to_string()))?;
        let mut out = Vec::new();
        let mut after = None;
        loop {
            let page = self.client.list(&filter, LIST_PAGE, after.as_ref()).await?;
            for run in page.runs {
                let Some(id) = schedule_id_of(&run.instance_id) else {
                    continue;
                };
                let memo = run
                    .memo
                    .iter()
                    .find(|(name, _)| name == SCHEDULE_MEMO_FIELD)
                    .and_then(|(_, p)| p.decode().ok());
                out.push(ScheduleSummary {
                    id: id.to_string(),
                    run_id: run.run_id,
                    memo,
                });
            }
            match page.next {
                Some(next) if out.len() < SCHEDULES_LIST_MAX => after = Some(next),
                _ => break,
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out.truncate(SCHEDULES_LIST_MAX);
        Ok(out)
    }

    /// Pauses calendar triggers (manual ones still start).
    pub async fn pause(&self, id: &str, note: &str) -> Result<(), EngineError> {
        self.call(id, "pause", &note.to_string()).await
    }

    /// Resumes calendar triggers from now on (times while paused are not
    /// caught up).
    pub async fn unpause(&self, id: &str, note: &str) -> Result<(), EngineError> {
        self.call(id, "unpause", &note.to_string()).await
    }

    /// Triggers now under the schedule's overlap policy; returns the
    /// trigger time its instance id names.
    pub async fn trigger(&self, id: &str) -> Result<String, EngineError> {
        self.call(id, "trigger", &None::<OverlapPolicy>).await
    }

    /// Triggers now under `overlap`.
    pub async fn trigger_with(
        &self,
        id: &str,
        overlap: OverlapPolicy,
    ) -> Result<String, EngineError> {
        self.call(id, "trigger", &Some(overlap)).await
    }

    /// Triggers every calendar time in `start..=end` (each its own
    /// instance: a time already started is not started again); returns how
    /// many times it covers.
    pub async fn backfill(
        &self,
        id: &str,
        start: Timestamp,
        end: Timestamp,
        overlap: Option<OverlapPolicy>,
    ) -> Result<u64, EngineError> {
        let b = Backfill {
            start,
            end,
            overlap,
        };
        self.call(id, "backfill", &b).await
    }

    /// Changes the calendar, the action or the policies.
    pub async fn update(&self, id: &str, change: ScheduleChange) -> Result<(), EngineError> {
        if let Some(spec) = &change.spec {
            spec.check()?;
        }
        if let Some(action) = &change.action {
            action.check()?;
        }
        self.call(id, "update", &change).await
    }

    /// Deletes the schedule: no more triggers; runs it started go on.
    pub async fn delete(&self, id: &str) -> Result<(), EngineError> {
        self.call(id, "delete", &()).await
    }

    async fn call<A: Serialize, R: DeserializeOwned>(
        &self,
        id: &str,
        name: &str,
        args: &A,
    ) -> Result<R, EngineError> {
        check_schedule_id(id)?;
        let instance = schedule_instance(id);
        self.client
            .update(instance.as_str(), name, args, None)
            .await
            .map_err(|e| unknown(id, e))
    }
}

/// A schedule whose instance is unknown or closed is an unknown schedule.
fn unknown(id: &str, e: EngineError) -> EngineError {
    match e {
        EngineError::UnknownInstance(_) | EngineError::RunClosed { .. } => {
            EngineError::UnknownSchedule(id.to_string())
        }
        other => other,
    }
}
