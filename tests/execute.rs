//! Goal: `Client::execute` (a start and the wait for its result as one
//! request with one answer) answers as `start` then `result` would: the
//! run's output, its failure, a run already open for the instance (not a
//! second one), a retry by command id after its run closed (that run's
//! output), the end of a continue-as-new chain, and a typed refusal for an
//! unknown type or a closed instance its reuse policy keeps closed.
//!
//! Method: the real engine on RocksDB. Each case runs a small workflow
//! through `execute` and compares the answer with what the store holds
//! (the runs of the instance) or with the plain calls' answer.

use std::time::Duration;

use keel::{
    Activity, ActivityContext, ActivityError, Engine, EngineError, ReusePolicy, StartOptions,
    Workflow, WorkflowContext, WorkflowError,
};

#[derive(Default)]
struct Double;
impl Activity for Double {
    const NAME: &'static str = "execute.double";
    type Input = u32;
    type Output = u32;
    const NON_BLOCKING: bool = true;
    async fn run(&self, _ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        Ok(i * 2)
    }
}

/// Two activities, then its output; an input of 0 fails.
struct TwoSteps;
impl Workflow for TwoSteps {
    const NAME: &'static str = "execute.two-steps";
    type Input = u32;
    type Output = u32;
    async fn run(ctx: WorkflowContext, i: u32) -> Result<u32, WorkflowError> {
        if i == 0 {
            return Err(WorkflowError::msg("zero"));
        }
        let a = ctx.activity::<Double>(i).await?;
        Ok(ctx.activity::<Double>(a).await? + 1)
    }
}

/// Returns the signal "go"'s payload.
struct Waits;
impl Workflow for Waits {
    const NAME: &'static str = "execute.waits";
    type Input = u32;
    type Output = u32;
    async fn run(ctx: WorkflowContext, i: u32) -> Result<u32, WorkflowError> {
        let go: u32 = ctx.wait_signal("go").await?;
        Ok(i + go)
    }
}

/// Continues as new until its input reaches 3.
struct Counts;
impl Workflow for Counts {
    const NAME: &'static str = "execute.counts";
    type Input = u32;
    type Output = u32;
    async fn run(_ctx: WorkflowContext, i: u32) -> Result<u32, WorkflowError> {
        if i >= 3 {
            return Ok(i * 100);
        }
        Err(WorkflowError::continue_as_new(&(i + 1)))
    }
}

/// Registered nowhere.
struct Unknown;
impl Workflow for Unknown {
    const NAME: &'static str = "execute.unknown";
    type Input = ();
    type Output = ();
    async fn run(_ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        Ok(())
    }
}

fn engine(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<TwoSteps>()
        .register_workflow::<Waits>()
        .register_workflow::<Counts>()
        .register_activity::<Double>()
        .build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_answers_with_the_output_or_the_failure() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let e = engine(dir.path())?;
    let c = e.client();
    assert_eq!(c.execute::<TwoSteps>("a", &5).await?, 21);
    let first = c.describe("a").await?.run_id;
    // The same instance again: closed, so the default policy starts anew.
    assert_eq!(c.execute::<TwoSteps>("a", &1).await?, 5);
    assert_ne!(c.describe("a").await?.run_id, first, "a second run");
    match c.execute::<TwoSteps>("z", &0).await {
        Err(EngineError::WorkflowFailed(f)) => assert!(f.message.contains("zero"), "{f:?}"),
        other => panic!("expected the run's failure, got {other:?}"),
    }
    // A policy that keeps a closed instance closed refuses, typed.
    let keep = StartOptions::new().reuse(ReusePolicy::RejectDuplicate);
    match c.execute_with::<TwoSteps>("a", &9, keep).await {
        Err(EngineError::AlreadyClosed { .. }) => {}
        other => panic!("expected AlreadyClosed, got {other:?}"),
    }
    match c.execute::<Unknown>("u", &()).await {
        Err(EngineError::UnknownWorkflowType(t)) => assert_eq!(t, "execute.unknown"),
        other => panic!("expected UnknownWorkflowType, got {other:?}"),
    }
    // A retry by command id after its run closed waits for that run (not
    // a new one): the same output, the same run.
    let once = || StartOptions::new().command_id("b-once");
    assert_eq!(c.execute_with::<TwoSteps>("b", &2, once()).await?, 9);
    let run = c.describe("b").await?.run_id;
    assert_eq!(c.execute_with::<TwoSteps>("b", &3, once()).await?, 9);
    assert_eq!(c.describe("b").await?.run_id, run, "no second run");
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_of_an_open_instance_waits_for_that_run() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let e = engine(dir.path())?;
    let c = e.client();
    let first = c.start::<Waits>("w", &10).await?.run_id();
    let waiting = {
        let c = c.clone();
        tokio::spawn(async move { c.execute::<Waits>("w", &99).await })
    };
    // The execute is in: its start found the open run and now waits.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "answered before the run closed");
    c.signal("w", "go", &7u32, None).await?;
    let out = tokio::time::timeout(Duration::from_secs(10), waiting).await???;
    assert_eq!(out, 17, "the first run's output, not a second run's");
    assert_eq!(c.describe("w").await?.run_id, first, "no second run");
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_follows_a_continue_as_new_chain_to_its_end() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let e = engine(dir.path())?;
    let c = e.client();
    assert_eq!(c.execute::<Counts>("chain", &0).await?, 300);
    assert_eq!(c.result::<Counts>("chain").await?, 300);
    e.shutdown().await;
    Ok(())
}
