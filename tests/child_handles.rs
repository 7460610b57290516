//! Goal: a child start as an awaitable step (issue "The rest of the
//! workflow surface", item 9): `.start().await` returns once the child's
//! run has started, with a handle the parent awaits later, cancels or
//! terminates whatever the child's close policy; a child named after an
//! instance that already has a run is never started again and its start
//! fails with "child did not start".
//!
//! A child starts with the memo and search attributes its call names.
//!
//! Method: a parent starts two named children (one that waits forever,
//! one that echoes), starts the echo's instance a second time, terminates
//! the waiting one through its handle, and returns what it saw; the
//! children's runs are then read through the client and the store.

use std::time::Duration;

use keel::{
    Engine, EngineError, InstanceId, ParentClosePolicy, RunStatus, Workflow, WorkflowContext,
    WorkflowError,
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

struct Echo;
impl Workflow for Echo {
    const NAME: &'static str = "echo";
    type Input = u64;
    type Output = u64;
    async fn run(_: WorkflowContext, n: u64) -> Result<u64, WorkflowError> {
        Ok(n)
    }
}

/// (echoed value, the second start's failure, the terminated child's
/// failure, the waiting child's run id known).
struct Starter;
impl Workflow for Starter {
    const NAME: &'static str = "starter";
    type Input = ();
    type Output = (u64, String, String, bool, String);
    async fn run(ctx: WorkflowContext, _: ()) -> Result<Self::Output, WorkflowError> {
        let waiting = ctx
            .child::<Waits>(())
            .instance_id(InstanceId::new("job-waits"))
            // Abandoned at close; terminated below through the handle.
            .close_policy(ParentClosePolicy::Abandon)
            .start()
            .await?;
        let echo = ctx
            .child::<Echo>(5)
            .instance_id(InstanceId::new("job-echo"))
            .memo("note", "from the starter")
            .search_attribute("batch", "b-1")
            .start()
            .await?;
        // Metadata the store would refuse fails the call, writing nothing.
        let bad = match ctx.child::<Echo>(7).search_attribute("1bad", "x").await {
            Ok(_) => String::new(),
            Err(f) => f.message,
        };
        assert_eq!(echo.instance_id().as_str(), "job-echo");
        let again = ctx
            .child::<Echo>(6)
            .instance_id(InstanceId::new("job-echo"))
            .start()
            .await;
        let refused = match again {
            Ok(_) => String::new(),
            Err(f) => f.message,
        };
        let value = echo.result().await?;
        waiting.terminate("no longer needed");
        let stopped = match waiting.result().await {
            Ok(()) => String::new(),
            Err(f) => format!("{:?}", f.kind),
        };
        Ok((value, refused, stopped, waiting.run_id().is_some(), bad))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_started_child_is_awaited_later_and_stopped_through_its_handle() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let e = Engine::builder()
        .data_dir(dir.path().join("data"))
        .register_workflow::<Waits>()
        .register_workflow::<Echo>()
        .register_workflow::<Starter>()
        .build()?;
    let c = e.client();
    c.start::<Starter>("starter", &()).await?;
    let (value, refused, stopped, known, bad) =
        tokio::time::timeout(Duration::from_secs(20), c.result::<Starter>("starter")).await??;
    assert_eq!(value, 5);
    assert!(
        refused.starts_with(keel::child::CHILD_NOT_STARTED),
        "a named instance with a run is not started again: {refused:?}"
    );
    assert_eq!(stopped, "Terminated");
    assert!(known, "the handle knows the child's run");
    assert!(bad.contains("child metadata"), "{bad:?}");
    // The child started with its memo and search attribute: the index
    // finds it.
    let found = c
        .list(&keel::RunFilter::parse("batch = \"b-1\"")?, 10, None)
        .await?;
    assert_eq!(found.runs.len(), 1);
    assert_eq!(found.runs[0].instance_id.as_str(), "job-echo");
    let note: String = found.runs[0].memo[0].1.decode()?;
    assert_eq!(note, "from the starter");
    // One run per named instance; the abandoned child was terminated by
    // its handle, not by the parent's close.
    assert_eq!(c.describe("job-waits").await?.status, RunStatus::Terminated);
    assert_eq!(c.describe("job-echo").await?.status, RunStatus::Completed);
    let runs = e
        .store()
        .runs(&keel::RunFilter::all().workflow_type("echo"))?;
    assert_eq!(runs.len(), 1, "the second start wrote no run");
    assert!(matches!(
        c.describe("job-nothing").await,
        Err(EngineError::UnknownInstance(_))
    ));
    e.shutdown().await;
    Ok(())
}

/// Starts a child, waits, starts another, then continues as new once.
struct Spaced;
impl Workflow for Spaced {
    const NAME: &'static str = "spaced";
    type Input = bool;
    type Output = ();
    async fn run(ctx: WorkflowContext, again: bool) -> Result<(), WorkflowError> {
        if !again {
            return Ok(());
        }
        ctx.child::<Echo>(1).await?;
        ctx.timer(Duration::from_millis(40)).await;
        ctx.child::<Echo>(2).await?;
        Err(WorkflowError::continue_as_new(&false))
    }
}

/// The milliseconds in a run id's leading bits (`run_id_high`'s layout).
fn id_ms(run: keel::RunId) -> u64 {
    let high = u64::from_be_bytes(run.as_bytes()[..8].try_into().unwrap());
    high >> (64 - keel::driver::RUN_ID_TIME_BITS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_and_continuations_get_run_ids_in_time_order() -> anyhow::Result<()> {
    // Goal: a child's run id and a continuation's start with the workflow's
    // time when it made them, as client-made ids do, so runs made later
    // sort later in the store's key order. Method: a parent starts a child,
    // waits 40 ms, starts another and continues as new; the ids in its
    // history carry times inside the test's wall-clock window, in order
    // and at least the timer apart.
    let dir = tempfile::tempdir()?;
    let e = Engine::builder()
        .data_dir(dir.path().join("data"))
        .register_workflow::<Echo>()
        .register_workflow::<Spaced>()
        .build()?;
    let c = e.client();
    let wall_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    let before = wall_ms();
    let first = c.start::<Spaced>("spaced", &true).await?.run_id();
    tokio::time::timeout(Duration::from_secs(20), c.result::<Spaced>("spaced")).await??;
    let after = wall_ms();
    let history = e.store().history(first)?;
    let children: Vec<keel::RunId> = history
        .iter()
        .filter_map(|ev| match &ev.kind {
            keel::storage::EventKind::ChildScheduled(child) => Some(child.child_run_id),
            _ => None,
        })
        .collect();
    let continued = history
        .iter()
        .find_map(|ev| match &ev.kind {
            keel::storage::EventKind::WorkflowContinuedAsNew { new_run_id, .. } => {
                Some(*new_run_id)
            }
            _ => None,
        })
        .expect("the run continued as new");
    assert_eq!(children.len(), 2);
    let times: Vec<u64> = [children[0], children[1], continued]
        .into_iter()
        .map(id_ms)
        .collect();
    for t in &times {
        assert!(
            (before..=after).contains(t),
            "{times:?} outside {before}..={after}"
        );
    }
    assert!(
        times[1] >= times[0] + 40,
        "the timer lies between: {times:?}"
    );
    assert!(times[2] >= times[1], "{times:?}");
    assert!(children[0].as_bytes() < children[1].as_bytes());
    assert_eq!(c.describe("spaced").await?.run_id, continued);
    Ok(())
}
