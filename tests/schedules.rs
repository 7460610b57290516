//! Goal: schedules on the real engine (issue "The rest of the workflow
//! surface", item 7): each trigger starts one instance named after the
//! schedule id and the trigger time, once, across an engine restart and
//! the downtime before it (caught up inside the window); overlap policies,
//! pause, trigger-now, backfill, update and delete do what they say; bad
//! requests are typed errors that write nothing.
//!
//! Method: one-second interval schedules against the wall clock. Started
//! runs are found through `list` (the index), and their instance ids must
//! be distinct whole-second trigger times; counters and trigger records
//! come from `describe` (a query).

use std::collections::BTreeSet;
use std::time::Duration;

use keel::schedule::{ScheduleError, TriggerOutcome};
use keel::{
    Engine, EngineError, NewSchedule, OverlapPolicy, RunFilter, RunStatus, ScheduleAction,
    ScheduleChange, ScheduleSpec, Timestamp, Workflow, WorkflowContext, WorkflowError,
};

struct Tick;
impl Workflow for Tick {
    const NAME: &'static str = "tick";
    type Input = u32;
    type Output = u32;
    async fn run(_: WorkflowContext, n: u32) -> Result<u32, WorkflowError> {
        Ok(n)
    }
}

/// Runs until signalled "done", or cancelled.
struct Long;
impl Workflow for Long {
    const NAME: &'static str = "long";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        let c = ctx.clone();
        let sel = ctx
            .select()
            .signal("done", "done")
            .condition("cancel", move || c.is_cancel_requested())
            .await?;
        if sel.key == "cancel".into() {
            return Err(WorkflowError::Cancelled("asked to".into()));
        }
        Ok(())
    }
}

fn engine(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<Tick>()
        .register_workflow::<Long>()
        .build()?)
}

const WAIT: Duration = Duration::from_secs(30);

/// The instances of runs of `workflow_type`, with their statuses.
async fn runs_of(
    c: &keel::Client,
    workflow_type: &str,
) -> anyhow::Result<Vec<(String, RunStatus)>> {
    let filter = RunFilter::parse(&format!("type = \"{workflow_type}\""))?;
    let page = c.list(&filter, 10_000, None).await?;
    Ok(page
        .runs
        .into_iter()
        .map(|r| (r.instance_id.to_string(), r.status))
        .collect())
}

/// Waits until `check` holds for the schedule's description.
async fn until(
    c: &keel::Client,
    id: &str,
    what: &str,
    check: impl Fn(&keel::schedule::ScheduleDescription) -> bool,
) -> anyhow::Result<keel::schedule::ScheduleDescription> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let d = c.schedules().describe(id).await?;
        if check(&d) {
            return Ok(d);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "never: {what} ({d:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_trigger_starts_once_across_a_restart_and_its_downtime() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let every = ScheduleSpec::every(Duration::from_secs(1));
    let action = ScheduleAction::start::<Tick>(&7).map_err(anyhow::Error::msg)?;
    let before;
    {
        let e = engine(&data)?;
        let c = e.client();
        c.schedules()
            .create(
                "tick",
                // Every trigger starts, even next to an open run.
                NewSchedule::new(every.clone(), action.clone()).overlap(OverlapPolicy::AllowAll),
            )
            .await?;
        let d = until(&c, "tick", "two runs completed", |d| {
            d.counts.completed >= 2
        })
        .await?;
        assert_eq!(d.next.len(), 5, "the next five times are shown");
        assert!(d
            .next
            .windows(2)
            .all(|w| w[1].as_millis() - w[0].as_millis() == 1000));
        before = d.counts.started;
        e.shutdown().await;
    }
    // Down for two and a half triggers: inside the catch-up window, so
    // they start after the restart.
    let down_from = now();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let down_to = now();
    let e = engine(&data)?;
    let c = e.client();
    let d = until(&c, "tick", "the downtime caught up", |d| {
        d.counts.completed >= before + 3
    })
    .await?;
    assert_eq!((d.counts.missed, d.counts.skipped), (0, 0));
    c.schedules().delete("tick").await?;
    let runs = runs_of(&c, "tick").await?;
    // Every run it started carries the schedule's id as a search
    // attribute.
    let filter = RunFilter::parse("schedule_id = \"tick\"")?;
    assert_eq!(c.list(&filter, 10_000, None).await?.runs.len(), runs.len());
    let names: BTreeSet<&str> = runs.iter().map(|(i, _)| i.as_str()).collect();
    assert_eq!(names.len(), runs.len(), "one run per instance");
    let mut times = Vec::new();
    for name in &names {
        let at = name
            .strip_prefix("tick@")
            .ok_or_else(|| anyhow::anyhow!("instance {name} is not named after its trigger"))?;
        let ts: jiff::Timestamp = at.parse()?;
        assert_eq!(
            ts.subsec_nanosecond(),
            0,
            "{name}: a whole-second trigger time"
        );
        times.push(ts.as_millisecond() as u64);
    }
    let during = times
        .iter()
        .filter(|t| **t > down_from.0 && **t < down_to.0)
        .count();
    assert!(
        during >= 2,
        "triggers due while the engine was down started ({times:?})"
    );
    // The schedule's counters match what the index holds.
    let gone = c.schedules().describe("tick").await;
    assert!(
        matches!(gone, Err(EngineError::UnknownSchedule(_))),
        "{gone:?}"
    );
    let started = runs.len();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        runs_of(&c, "tick").await?.len(),
        started,
        "a deleted schedule starts nothing"
    );
    assert!(c.schedules().list().await?.is_empty());
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_pause_trigger_backfill_and_update() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let e = engine(&dir.path().join("data"))?;
    let c = e.client();
    let s = c.schedules();
    let action = ScheduleAction::start::<Long>(&()).map_err(anyhow::Error::msg)?;
    let every = ScheduleSpec::every(Duration::from_secs(1));
    s.create("long", NewSchedule::new(every, action)).await?;
    assert!(matches!(
        s.create(
            "long",
            NewSchedule::new(ScheduleSpec::cron("@daily"), ScheduleAction::default())
        )
        .await,
        Err(EngineError::Schedule(ScheduleError::NoAction))
    ));

    // Skip: one run open, later triggers skipped.
    let d = until(&c, "long", "a trigger skipped", |d| d.counts.skipped >= 2).await?;
    assert_eq!(d.counts.started, 1);
    assert_eq!(d.running.len(), 1);
    let first = d.running[0].clone();

    // Terminate-other: the next trigger terminates the open run and
    // starts its own.
    s.update(
        "long",
        ScheduleChange {
            policies: Some(keel::schedule::SchedulePolicies {
                overlap: OverlapPolicy::TerminateOther,
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await?;
    let d = until(&c, "long", "the open run replaced", |d| {
        d.counts.started >= 2 && !d.running.contains(&first)
    })
    .await?;
    let runs = runs_of(&c, "long").await?;
    let status = |name: &str| runs.iter().find(|(i, _)| i == name).map(|(_, s)| *s);
    assert_eq!(status(&first), Some(RunStatus::Terminated), "{runs:?}");
    assert!(d.counts.failed >= 1);

    // Paused: no calendar trigger starts; a manual trigger still does.
    s.pause("long", "maintenance").await?;
    let paused = s.describe("long").await?;
    assert!(paused.paused && paused.next.is_empty());
    let listed = s.list().await?;
    assert_eq!(listed.len(), 1);
    let memo = listed[0].memo.as_ref().expect("the list shows the memo");
    assert!(memo.paused);
    assert_eq!(memo.note, "maintenance");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let still = s.describe("long").await?;
    assert_eq!(
        still.counts.started, paused.counts.started,
        "paused starts nothing"
    );
    let at = s.trigger_with("long", OverlapPolicy::AllowAll).await?;
    let d = until(&c, "long", "the manual trigger started", |d| {
        d.running.iter().any(|r| r.ends_with(&at))
    })
    .await?;
    assert!(d
        .recent
        .iter()
        .any(|r| r.manual && r.instance.ends_with(&at)));

    // Backfill three past seconds next to the open runs; the same range
    // again starts nothing new (one instance per trigger time).
    let base = (now().0 / 1000 - 60) * 1000;
    let (from, to) = (Timestamp(base), Timestamp(base + 2_000));
    let n = s
        .backfill("long", from, to, Some(OverlapPolicy::AllowAll))
        .await?;
    assert_eq!(n, 3);
    until(&c, "long", "the backfill started", |d| {
        d.counts.started >= still.counts.started + 4
    })
    .await?;
    assert_eq!(
        s.backfill("long", from, to, Some(OverlapPolicy::AllowAll))
            .await?,
        3
    );
    let d = until(&c, "long", "the repeat refused", |d| {
        d.counts.not_started >= 3
    })
    .await?;
    assert!(d
        .recent
        .iter()
        .any(|r| matches!(&r.outcome, TriggerOutcome::NotStarted(_))));
    let runs = runs_of(&c, "long").await?;
    let backfilled = runs
        .iter()
        .filter(|(i, _)| {
            (0..3).any(|k| {
                *i == keel::schedule::trigger_instance("long", Timestamp(base + k * 1000))
                    .to_string()
            })
        })
        .count();
    assert_eq!(backfilled, 3, "each backfilled time started once");

    // Requests that do not check write nothing.
    let bad_cron = NewSchedule::new(
        ScheduleSpec::cron("61 * * * *"),
        ScheduleAction::start::<Tick>(&1).map_err(anyhow::Error::msg)?,
    );
    assert!(matches!(
        s.create("bad", bad_cron).await,
        Err(EngineError::Schedule(ScheduleError::BadCron { .. }))
    ));
    let bad_tz = ScheduleSpec::cron("@daily").in_time_zone("Mars/Olympus");
    assert!(matches!(
        s.update(
            "long",
            ScheduleChange {
                spec: Some(bad_tz),
                ..Default::default()
            }
        )
        .await,
        Err(EngineError::Schedule(ScheduleError::UnknownTimeZone(_)))
    ));
    assert!(matches!(
        s.describe("nope").await,
        Err(EngineError::UnknownSchedule(_))
    ));
    assert!(matches!(
        s.pause("a@b", "").await,
        Err(EngineError::Schedule(ScheduleError::BadId(_)))
    ));
    let far = s.backfill("long", Timestamp(0), now(), None).await;
    assert!(matches!(far, Err(EngineError::Handler(_))), "{far:?}");
    assert!(runs_of(&c, "keel.schedule")
        .await?
        .iter()
        .all(|(i, _)| i == "keel.schedule/long"));
    e.shutdown().await;
    Ok(())
}

fn now() -> Timestamp {
    Timestamp(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_millis() as u64,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffer_one_waits_for_the_open_run_and_cancel_other_cancels_it() -> anyhow::Result<()> {
    // Goal: `BufferOne` keeps one trigger waiting while a run is open
    // (later ones skipped) and starts it when the run closes;
    // `CancelOther` asks the open run to cancel and starts once it did.
    let dir = tempfile::tempdir()?;
    let e = engine(&dir.path().join("data"))?;
    let c = e.client();
    let s = c.schedules();
    let action = ScheduleAction::start::<Long>(&()).map_err(anyhow::Error::msg)?;
    let every = ScheduleSpec::every(Duration::from_secs(1));
    s.create(
        "buf",
        NewSchedule::new(every, action).overlap(OverlapPolicy::BufferOne),
    )
    .await?;
    let d = until(&c, "buf", "one waiting, one skipped", |d| {
        d.pending.len() == 1 && d.counts.skipped >= 1
    })
    .await?;
    assert_eq!(d.counts.started, 1);
    let first = d.running[0].clone();
    c.signal(&first, "done", &(), None).await?;
    let d = until(&c, "buf", "the waiting trigger started", |d| {
        d.counts.started >= 2 && d.counts.completed >= 1
    })
    .await?;
    let second = d
        .running
        .iter()
        .find(|r| **r != first)
        .cloned()
        .expect("the buffered trigger runs");
    s.update(
        "buf",
        ScheduleChange {
            policies: Some(keel::schedule::SchedulePolicies {
                overlap: OverlapPolicy::CancelOther,
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await?;
    until(&c, "buf", "the open run cancelled and replaced", |d| {
        !d.running.contains(&second) && d.counts.started >= 3
    })
    .await?;
    assert_eq!(c.describe(&second).await?.status, RunStatus::Cancelled);
    s.delete("buf").await?;
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_drops_calendar_triggers_queued_before_it() -> anyhow::Result<()> {
    // Goal: a paused schedule starts no calendar trigger, not even one
    // buffered before the pause behind an open run; a manual trigger
    // still starts. Method: `BufferOne` over a run that waits for a
    // signal, so one trigger waits; pause, let the run finish, and check
    // the waiting trigger was skipped instead of started.
    let dir = tempfile::tempdir()?;
    let e = engine(&dir.path().join("data"))?;
    let c = e.client();
    let s = c.schedules();
    let action = ScheduleAction::start::<Long>(&()).map_err(anyhow::Error::msg)?;
    let every = ScheduleSpec::every(Duration::from_secs(1));
    s.create(
        "held",
        NewSchedule::new(every, action).overlap(OverlapPolicy::BufferOne),
    )
    .await?;
    let d = until(&c, "held", "one running, one waiting", |d| {
        d.pending.len() == 1 && d.running.len() == 1
    })
    .await?;
    let first = d.running[0].clone();
    s.pause("held", "maintenance").await?;
    c.signal(&first, "done", &(), None).await?;
    let d = until(&c, "held", "the first run closed, the queue dropped", |d| {
        d.running.is_empty() && d.pending.is_empty()
    })
    .await?;
    assert_eq!(d.counts.started, 1, "nothing started while paused");
    // A manual trigger ignores the pause.
    s.trigger("held").await?;
    until(&c, "held", "the manual trigger started", |d| {
        d.counts.started == 2
    })
    .await?;
    s.delete("held").await?;
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_run_timeout_frees_the_schedule_from_a_stuck_run() -> anyhow::Result<()> {
    // Goal: a schedule's action can carry a run timeout, so a run that
    // never finishes times out and the trigger waiting behind it starts.
    // Method: `BufferOne` over a run that waits for a signal nobody sends,
    // with a 1.5 s run timeout; the first run must close as timed out and
    // a second start follow.
    let dir = tempfile::tempdir()?;
    let e = engine(&dir.path().join("data"))?;
    let c = e.client();
    let s = c.schedules();
    let action = ScheduleAction::start::<Long>(&())
        .map_err(anyhow::Error::msg)?
        .run_timeout(Duration::from_millis(1_500));
    let every = ScheduleSpec::every(Duration::from_secs(1));
    s.create(
        "bounded",
        NewSchedule::new(every, action).overlap(OverlapPolicy::BufferOne),
    )
    .await?;
    let d = until(
        &c,
        "bounded",
        "the first run timed out, the next started",
        |d| d.counts.failed >= 1 && d.counts.started >= 2,
    )
    .await?;
    let timed_out = d
        .recent
        .iter()
        .any(|r| matches!(&r.outcome, TriggerOutcome::Failed(m) if m.contains("run timeout")));
    assert!(timed_out, "{:?}", d.recent);
    s.delete("bounded").await?;
    e.shutdown().await;
    Ok(())
}
