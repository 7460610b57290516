//! Goal: workflow run and execution timeouts (issue "The rest of the
//! workflow surface", item 9). A run open past its run timeout, or a
//! chain of runs (continue-as-new) open past its execution timeout,
//! closes as timed out without running more of its code: status
//! `timed-out`, `EngineError::WorkflowTimedOut` for whoever waits, a
//! `Timeout` failure for a parent. The deadline is an intent armed by the
//! start's commit, so an engine restarted before it still fires it, and
//! continue-as-new keeps the execution deadline and the run timeout.
//!
//! Method: real engines on a RocksDB directory. A workflow that waits for
//! a signal that never comes is started with a run timeout; a chain that
//! continues as new every 200 ms is started with an execution timeout and
//! the engine restarted midway; a parent calls a child with a run timeout.
//! Each outcome is read through the client and the histories through the
//! store.

use std::time::Duration;

use keel::storage::EventKind;
use keel::{
    Engine, EngineError, FailureKind, RunStatus, StartOptions, Workflow, WorkflowContext,
    WorkflowError, WorkflowTimeout,
};

struct Waits;
impl Workflow for Waits {
    const NAME: &'static str = "waits";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        let _: () = ctx.wait_signal("never").await?;
        Ok(())
    }
}

/// Continues as new after a short timer, forever.
struct Chain;
impl Workflow for Chain {
    const NAME: &'static str = "chain";
    type Input = u32;
    type Output = ();
    async fn run(ctx: WorkflowContext, n: u32) -> Result<(), WorkflowError> {
        ctx.timer(Duration::from_millis(200)).await;
        Err(WorkflowError::continue_as_new(&(n + 1)))
    }
}

/// Calls `Waits` as a child with a run timeout and returns the failure's
/// kind and message.
struct Parent;
impl Workflow for Parent {
    const NAME: &'static str = "parent";
    type Input = ();
    type Output = (String, String);
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(String, String), WorkflowError> {
        match ctx
            .child::<Waits>(())
            .run_timeout(Duration::from_millis(300))
            .await
        {
            Ok(()) => Ok(("none".into(), String::new())),
            Err(f) => Ok((format!("{:?}", f.kind), f.message)),
        }
    }
}

/// Panics at once: its run is parked.
struct Broken;
impl Workflow for Broken {
    const NAME: &'static str = "broken";
    type Input = ();
    type Output = ();
    async fn run(_: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        panic!("a bug in the first step")
    }
}

fn engine(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<Broken>()
        .register_workflow::<Waits>()
        .register_workflow::<Chain>()
        .register_workflow::<Parent>()
        .build()?)
}

const WAIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_open_past_its_run_timeout_closes_as_timed_out() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let e = engine(dir.path())?;
    let c = e.client();
    let options = StartOptions::new().run_timeout(Duration::from_millis(300));
    c.start_with::<Waits>("w", &(), options).await?;
    let err = tokio::time::timeout(WAIT, c.result::<Waits>("w"))
        .await?
        .expect_err("the run times out");
    assert!(
        matches!(&err, EngineError::WorkflowTimedOut(m) if m.contains("run timeout")),
        "{err}"
    );
    let d = c.describe("w").await?;
    assert_eq!(d.status, RunStatus::TimedOut);
    let history = e.store().history(d.run_id)?;
    let last = history.last().expect("a history");
    let EventKind::WorkflowTimedOut { timeout, deadline } = &last.kind else {
        panic!("the last event is {:?}", last.kind);
    };
    assert_eq!(*timeout, WorkflowTimeout::Run);
    assert_eq!(deadline.as_millis(), history[0].at.as_millis() + 300);
    assert!(last.at >= *deadline, "closed before its deadline");
    // Nothing is left armed for the closed run.
    assert!(e.store().run_timers(d.run_id)?.is_empty());
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_timeout_spans_continue_as_new_and_a_restart() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let options = StartOptions::new().execution_timeout(Duration::from_millis(1_500));
    {
        let e = engine(dir.path())?;
        e.client().start_with::<Chain>("chain", &0, options).await?;
        // Let a few runs pass, then stop the engine before the deadline.
        tokio::time::sleep(Duration::from_millis(500)).await;
        e.shutdown().await;
    }
    let e = engine(dir.path())?;
    let c = e.client();
    let err = tokio::time::timeout(WAIT, c.result::<Chain>("chain"))
        .await?
        .expect_err("the chain times out");
    assert!(
        matches!(&err, EngineError::WorkflowTimedOut(m) if m.contains("execution timeout")),
        "{err}"
    );
    // Every run of the chain recorded the same deadline; the last one
    // closed on it.
    let runs = e
        .store()
        .runs(&keel::storage::RunFilter::default())?
        .into_iter()
        .filter(|r| r.instance_id.as_str() == "chain")
        .collect::<Vec<_>>();
    assert!(runs.len() >= 3, "only {} runs", runs.len());
    let mut deadlines = std::collections::BTreeSet::new();
    let mut timed_out = 0;
    for r in &runs {
        let history = e.store().history(r.run_id)?;
        if let EventKind::WorkflowStarted(start) = &history[0].kind {
            let keel::storage::WorkflowStart { timeouts, .. } = &**start;
            deadlines.insert(timeouts.execution_deadline);
        }
        if let Some(EventKind::WorkflowTimedOut { timeout, .. }) = history.last().map(|e| &e.kind) {
            assert_eq!(*timeout, WorkflowTimeout::Execution);
            timed_out += 1;
        }
    }
    assert_eq!(
        deadlines.len(),
        1,
        "one deadline for the chain: {deadlines:?}"
    );
    assert!(deadlines.into_iter().next().flatten().is_some());
    assert_eq!(timed_out, 1, "exactly the last run timed out");
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_past_its_run_timeout_fails_its_parent_wait_with_a_timeout() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let e = engine(dir.path())?;
    let c = e.client();
    c.start::<Parent>("p", &()).await?;
    let (kind, message) = tokio::time::timeout(WAIT, c.result::<Parent>("p")).await??;
    assert_eq!(kind, format!("{:?}", FailureKind::Timeout));
    assert!(message.contains("run timeout"), "{message}");
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_run_still_times_out_after_a_restart() -> anyhow::Result<()> {
    // A parked run runs no code, but its deadline still closes it, also
    // when the engine restarted and the run is no longer in memory.
    let dir = tempfile::tempdir()?;
    {
        let e = engine(dir.path())?;
        let options = StartOptions::new().run_timeout(Duration::from_millis(800));
        e.client().start_with::<Broken>("b", &(), options).await?;
        e.shutdown().await;
    }
    let e = engine(dir.path())?;
    let c = e.client();
    let err = tokio::time::timeout(WAIT, c.result::<Broken>("b"))
        .await?
        .expect_err("the parked run times out");
    assert!(matches!(err, EngineError::WorkflowTimedOut(_)), "{err}");
    let d = c.describe("b").await?;
    assert_eq!(d.status, RunStatus::TimedOut);
    assert!(
        d.parked.is_none(),
        "closing clears the park marker: {:?}",
        d.parked
    );
    e.shutdown().await;
    Ok(())
}
