//! Goal: cancellation types for activities and children (issue "The rest
//! of the workflow surface", item 9). When a scope is cancelled, a call
//! made with `WaitCancellationCompleted` is asked to stop and the scope's
//! completion waits until it has closed, across an engine restart; a call
//! made with `Abandon` is not asked at all and runs on; the default
//! (`TryCancel`) asks and goes on.
//!
//! Method: a workflow spawns, in one scope, an activity that takes 300 ms
//! to stop once asked and a child that takes 300 ms to cancel, both with
//! the cancellation type its input names; it cancels the scope, awaits the
//! scope's completion and then schedules one last activity. The history
//! says what was asked and in which order things closed. The waiting case
//! restarts the engine between the cancel request and the close.

use std::time::Duration;

use keel::storage::{DurableKey, Event, EventKind};
use keel::{
    Activity, ActivityContext, ActivityError, CancellationType, Engine, ParentClosePolicy,
    Workflow, WorkflowContext, WorkflowError,
};

/// Runs for up to 2 s; once asked to stop it takes 300 ms to clean up.
#[derive(Default)]
struct Stubborn;
impl Activity for Stubborn {
    const NAME: &'static str = "stubborn";
    type Input = ();
    type Output = u32;
    async fn run(&self, ctx: ActivityContext, _: ()) -> Result<u32, ActivityError> {
        tokio::select! {
            _ = ctx.cancelled() => {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Err(ActivityError::fatal("stopped after cleaning up"))
            }
            _ = tokio::time::sleep(Duration::from_secs(2)) => Ok(1),
        }
    }
}

#[derive(Default)]
struct Quick;
impl Activity for Quick {
    const NAME: &'static str = "quick";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _: ActivityContext, x: u32) -> Result<u32, ActivityError> {
        Ok(x)
    }
}

/// Waits for a cancellation, then takes 300 ms (a durable timer) to
/// honour it.
struct Tidy;
impl Workflow for Tidy {
    const NAME: &'static str = "tidy";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        let reason = ctx.cancelled().await;
        ctx.timer(Duration::from_millis(300)).await;
        Err(WorkflowError::Cancelled(reason))
    }
}

fn mode(name: &str) -> CancellationType {
    match name {
        "wait" | "wait-abandoned-child" => CancellationType::WaitCancellationCompleted,
        "abandon" => CancellationType::Abandon,
        _ => CancellationType::TryCancel,
    }
}

struct Cleanup;
impl Workflow for Cleanup {
    const NAME: &'static str = "cleanup";
    type Input = String;
    type Output = u32;
    async fn run(ctx: WorkflowContext, how: String) -> Result<u32, WorkflowError> {
        let scope = ctx.scope();
        let c = ctx.clone();
        let how2 = how.clone();
        scope.spawn(async move {
            let _ = c.activity::<Stubborn>(()).cancellation(mode(&how2)).await;
            Ok(())
        });
        let c = ctx.clone();
        let how2 = how.clone();
        scope.spawn(async move {
            // A child abandoned at close is never asked to cancel, so
            // there is no cancellation to wait for.
            let policy = match how2.as_str() {
                "wait-abandoned-child" => ParentClosePolicy::Abandon,
                _ => ParentClosePolicy::RequestCancel,
            };
            let _ = c
                .child::<Tidy>(())
                .close_policy(policy)
                .cancellation(mode(&how2))
                .await;
            Ok(())
        });
        ctx.timer(Duration::from_millis(200)).await;
        scope.cancel();
        let _ = scope.await_completion(std::future::pending()).await;
        Ok(ctx.activity::<Quick>(5).await?)
    }
}

fn engine(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<Cleanup>()
        .register_workflow::<Tidy>()
        .register_activity::<Stubborn>()
        .register_activity::<Quick>()
        .build()?)
}

const WAIT: Duration = Duration::from_secs(20);

/// The seq of the first event matching `f`.
fn seq_of(history: &[Event], f: impl Fn(&EventKind) -> bool) -> Option<u64> {
    history.iter().find(|e| f(&e.kind)).map(|e| e.seq.0)
}

/// (the stubborn step's close, the child's close, the last activity's
/// schedule, whether each was asked to cancel).
struct Order {
    activity_closed: Option<u64>,
    child_closed: Option<u64>,
    last_scheduled: u64,
    activity_asked: bool,
    child_asked: bool,
}

fn order(history: &[Event]) -> Order {
    let step_of = |name: &str| {
        history.iter().find_map(|e| match &e.kind {
            EventKind::ActivityScheduled {
                step,
                activity_type,
                ..
            } if activity_type == name => Some(*step),
            _ => None,
        })
    };
    let stubborn = step_of("stubborn").expect("stubborn scheduled");
    let child = history
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::ChildScheduled(child) => Some(child.step),
            _ => None,
        })
        .expect("child scheduled");
    let quick = step_of("quick").expect("quick scheduled");
    Order {
        activity_closed: seq_of(history, |k| {
            k.terminal_keys().contains(&DurableKey::Execution(stubborn))
        }),
        child_closed: seq_of(history, |k| {
            k.terminal_keys().contains(&DurableKey::Child(child))
        }),
        last_scheduled: seq_of(
            history,
            |k| matches!(k, EventKind::ActivityScheduled { step, .. } if *step == quick),
        )
        .expect("quick scheduled"),
        activity_asked: seq_of(
            history,
            |k| matches!(k, EventKind::ActivityCancelRequested { step, .. } if *step == stubborn),
        )
        .is_some(),
        child_asked: seq_of(
            history,
            |k| matches!(k, EventKind::ChildCancelRequested { step, .. } if *step == child),
        )
        .is_some(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_for_cancellation_holds_the_scope_across_a_restart() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    {
        let e = engine(dir.path())?;
        let c = e.client();
        c.start::<Cleanup>("wait", &"wait".to_string()).await?;
        // Stop the engine once the cancellation is asked for, before the
        // activity and the child have finished stopping.
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let d = c.describe("wait").await?;
            let h = e.store().history(d.run_id)?;
            if h.iter()
                .any(|e| matches!(e.kind, EventKind::ActivityCancelRequested { .. }))
            {
                break;
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "never cancelled");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        e.shutdown().await;
    }
    let e = engine(dir.path())?;
    let c = e.client();
    let v = tokio::time::timeout(WAIT, c.result::<Cleanup>("wait")).await??;
    assert_eq!(v, 5);
    let d = c.describe("wait").await?;
    let o = order(&e.store().history(d.run_id)?);
    assert!(o.activity_asked && o.child_asked, "both were asked to stop");
    let (a, ch) = (
        o.activity_closed.expect("the activity closed"),
        o.child_closed.expect("the child closed"),
    );
    assert!(
        a < o.last_scheduled && ch < o.last_scheduled,
        "the scope completed only after both closed: activity {a}, child {ch}, next {}",
        o.last_scheduled
    );
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_call_is_not_asked_to_stop_and_a_try_cancel_does_not_wait(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let e = engine(dir.path())?;
    let c = e.client();
    c.start::<Cleanup>("abandon", &"abandon".to_string())
        .await?;
    c.start::<Cleanup>("try", &"try".to_string()).await?;
    assert_eq!(
        tokio::time::timeout(WAIT, c.result::<Cleanup>("abandon")).await??,
        5
    );
    assert_eq!(
        tokio::time::timeout(WAIT, c.result::<Cleanup>("try")).await??,
        5
    );

    let d = c.describe("abandon").await?;
    let o = order(&e.store().history(d.run_id)?);
    assert!(
        !o.activity_asked && !o.child_asked,
        "nothing was asked to stop"
    );
    // The scope did not wait: the last activity came before either closed
    // (the activity runs 2 s, the child until its parent's close policy).
    assert!(o.activity_closed.is_none_or(|a| a > o.last_scheduled));
    assert!(o.child_closed.is_none_or(|c| c > o.last_scheduled));

    let d = c.describe("try").await?;
    let o = order(&e.store().history(d.run_id)?);
    assert!(o.activity_asked && o.child_asked, "both were asked to stop");
    assert!(
        o.activity_closed.is_none_or(|a| a > o.last_scheduled),
        "try-cancel does not wait for the activity to stop"
    );
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_child_that_is_never_asked_does_not_hang() -> anyhow::Result<()> {
    // Goal: a child whose close policy is `Abandon` is not asked to cancel,
    // so waiting for its cancellation would wait forever: the scope only
    // waits for what was asked (here the activity).
    let dir = tempfile::tempdir()?;
    let e = engine(dir.path())?;
    let c = e.client();
    c.start::<Cleanup>("w", &"wait-abandoned-child".to_string())
        .await?;
    assert_eq!(
        tokio::time::timeout(WAIT, c.result::<Cleanup>("w")).await??,
        5
    );
    let d = c.describe("w").await?;
    let o = order(&e.store().history(d.run_id)?);
    assert!(o.activity_asked && !o.child_asked);
    assert!(o.activity_closed.expect("the activity closed") < o.last_scheduled);
    e.shutdown().await;
    Ok(())
}
