//! Goal: cancelling a scope cancels the child workflows its coroutines
//! started, per each child's close policy, as well as its timers.
//! Method: a parent whose scope starts two children that wait forever
//! (one with the default terminate policy, one asking to cancel), waits on
//! the scope with a 100 ms deadline, then cancels the scope; we check how
//! each child closed.

use std::time::Duration;

use keel::{Engine, ParentClosePolicy, RunStatus, Workflow, WorkflowContext, WorkflowError};

struct Forever;
impl Workflow for Forever {
    const NAME: &'static str = "forever";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let reason = ctx.cancelled().await;
        Err(WorkflowError::Cancelled(reason))
    }
}

struct Parent;
impl Workflow for Parent {
    const NAME: &'static str = "scope-parent";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let scope = ctx.scope();
        let c1 = ctx.clone();
        scope.spawn(async move {
            c1.child::<Forever>(()).await?;
            Ok(())
        });
        let c2 = ctx.clone();
        scope.spawn(async move {
            c2.child::<Forever>(())
                .close_policy(ParentClosePolicy::RequestCancel)
                .await?;
            Ok(())
        });
        match scope
            .await_completion(ctx.timer(Duration::from_millis(100)))
            .await
        {
            Ok(()) => Ok("finished".into()),
            Err(e) => {
                scope.cancel();
                Ok(format!("gave up: {e}"))
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_scope_cancels_its_children_per_policy() -> anyhow::Result<()> {
    let engine = Engine::builder()
        .in_memory()
        .register_workflow::<Parent>()
        .register_workflow::<Forever>()
        .build()?;
    let c = engine.client();
    c.start::<Parent>("p", &()).await?;
    assert_eq!(
        c.result::<Parent>("p").await?,
        "gave up: waiting for the scope was cancelled"
    );
    let d = c.describe("p").await?;
    assert_eq!(d.children.len(), 2);
    let store = engine.store();
    let mut statuses = Vec::new();
    for child in &d.children {
        for _ in 0..200 {
            let m = store.run_meta(child.run_id)?.expect("child started");
            if m.status.is_closed() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        statuses.push(store.run_meta(child.run_id)?.expect("child").status);
    }
    statuses.sort();
    assert_eq!(statuses, vec![RunStatus::Cancelled, RunStatus::Terminated]);
    Ok(())
}
