//! Workflows of the shapes the seeds do not cover, kept so that their
//! golden histories (`tests/data/histories/shapes/`) replay on every
//! build: a scope with two coroutines, an update with a query, and a
//! version marker.

use std::cell::RefCell;
use std::rc::Rc;

use keel::{Workflow, WorkflowContext, WorkflowError, WorkflowRegistry};

use crate::seeds::{MyActivity1, MyActivity2, MyActivity3};

/// A scope with two coroutines, one of which calls two activities in turn.
#[derive(Debug)]
pub struct ScopeShape;
impl Workflow for ScopeShape {
    const NAME: &'static str = "shapes.scope";
    type Input = ();
    type Output = Vec<String>;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<Vec<String>, WorkflowError> {
        let out = Rc::new(RefCell::new(Vec::new()));
        let scope = ctx.scope();
        let (c1, o1) = (ctx.clone(), out.clone());
        scope.spawn(async move {
            let v = c1.activity::<MyActivity1>(()).await?;
            o1.borrow_mut().push(v);
            Ok(())
        });
        let (c2, o2) = (ctx.clone(), out.clone());
        scope.spawn(async move {
            let a = c2.activity::<MyActivity2>(()).await?;
            let b = c2.activity::<MyActivity3>(()).await?;
            o2.borrow_mut().extend([a, b]);
            Ok(())
        });
        scope
            .await_completion(std::future::pending::<()>())
            .await
            .map_err(WorkflowError::msg)?;
        let mut v = out.borrow().clone();
        v.sort();
        Ok(v)
    }
}

/// A counter changed by the update `add` (validated: positive), read by
/// the query `count`; finishes on the signal `done`.
#[derive(Debug)]
pub struct UpdateShape;
impl Workflow for UpdateShape {
    const NAME: &'static str = "shapes.update";
    type Input = ();
    type Output = u64;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u64, WorkflowError> {
        let count = Rc::new(RefCell::new(0u64));
        let view = count.clone();
        ctx.on_query("count", move |_: ()| *view.borrow());
        let (add, actx) = (count.clone(), ctx.clone());
        ctx.on_update(
            "add",
            |n: &u64| match n {
                0 => Err("add a positive number".to_string()),
                _ => Ok(()),
            },
            move |n: u64| {
                let (add, ctx) = (add.clone(), actx.clone());
                async move {
                    // The handler awaits an activity: accepted and
                    // completed are separate commits.
                    ctx.activity::<MyActivity1>(()).await?;
                    *add.borrow_mut() += n;
                    Ok(*add.borrow())
                }
            },
        );
        let _: () = ctx.wait_signal("done").await?;
        let n = *count.borrow();
        Ok(n)
    }
}

/// A change shipped with `patched`: runs that recorded the marker call the
/// second activity instead of the first.
#[derive(Debug)]
pub struct VersionShape;
impl Workflow for VersionShape {
    const NAME: &'static str = "shapes.version";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let v = if ctx.patched("second-activity") {
            ctx.activity::<MyActivity2>(()).await?
        } else {
            ctx.activity::<MyActivity1>(()).await?
        };
        let version = ctx.version("third-step", 1, 2);
        let w = match version {
            2 => ctx.activity::<MyActivity3>(()).await?,
            _ => String::new(),
        };
        Ok(format!("{v} {w} (v{version})"))
    }
}

/// Search attributes and memo: given at start, upserted, removed.
#[derive(Debug)]
pub struct SearchShape;
impl Workflow for SearchShape {
    const NAME: &'static str = "shapes.search";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        ctx.upsert_search_attributes([
            ("stage", keel::SearchValue::from("paid")),
            ("amount", keel::SearchValue::Int(1250)),
        ])?;
        ctx.upsert_memo("note", &"gift wrap")?;
        let v = ctx.activity::<MyActivity1>(()).await?;
        ctx.remove_search_attribute("amount")?;
        ctx.upsert_search_attribute("stage", "shipped")?;
        Ok(v)
    }
}

/// A message stream: reads three messages in offset order (one sent
/// twice), continuing as new after the first so the next run reads on from
/// the carried cursor; returns their sum.
#[derive(Debug)]
pub struct StreamShape;
impl Workflow for StreamShape {
    const NAME: &'static str = "shapes.stream";
    /// Read so far and their sum.
    type Input = (u64, u64);
    type Output = u64;
    async fn run(ctx: WorkflowContext, (read, mut sum): (u64, u64)) -> Result<u64, WorkflowError> {
        let items = ctx.stream::<u64>("items");
        if read == 1 {
            // The second run: the cursor came with it.
            assert_eq!(items.cursor(), 1, "the cursor was carried");
        }
        for n in read..3 {
            sum += items.next().await?.value;
            if n == 0 {
                return Err(WorkflowError::continue_as_new(&(1u64, sum)));
            }
        }
        Ok(sum)
    }
}

/// Sends from workflow code: a stream message (twice, one key) and a
/// signal to its own instance through the outbox, then reads both.
#[derive(Debug)]
pub struct SendShape;
impl Workflow for SendShape {
    const NAME: &'static str = "shapes.send";
    type Input = ();
    type Output = u64;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u64, WorkflowError> {
        let me = ctx.instance_id().to_string();
        let first = ctx.send_message(&me, "inbox", "k-1", &40u64).await?;
        let again = ctx.send_message(&me, "inbox", "k-1", &40u64).await?;
        assert_eq!((first, again), (Some(0), Some(0)));
        ctx.signal_workflow(&me, "bump", &2u64).await?;
        let bump: u64 = ctx.wait_signal("bump").await?;
        Ok(ctx.stream::<u64>("inbox").next().await?.value + bump)
    }
}

/// What the `schedule` shape's schedule starts: its input plus one.
#[derive(Debug)]
pub struct TickShape;
impl Workflow for TickShape {
    const NAME: &'static str = "shapes.tick";
    type Input = u64;
    type Output = u64;
    async fn run(_: WorkflowContext, n: u64) -> Result<u64, WorkflowError> {
        Ok(n + 1)
    }
}

/// A scope whose slow activity is cancelled with
/// `WaitCancellationCompleted`: the scope completes once the activity has
/// stopped, and one more activity follows.
#[derive(Debug)]
pub struct CancelWaitShape;
impl Workflow for CancelWaitShape {
    const NAME: &'static str = "shapes.cancel-wait";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let scope = ctx.scope();
        let c = ctx.clone();
        scope.spawn(async move {
            let call = c
                .activity::<crate::seeds::ResolveRequest>("slow-1".to_string())
                .cancellation(keel::CancellationType::WaitCancellationCompleted);
            let _ = call.await;
            Ok(())
        });
        ctx.timer(std::time::Duration::from_millis(50)).await;
        scope.cancel();
        scope
            .await_completion(std::future::pending::<()>())
            .await
            .map_err(WorkflowError::msg)?;
        Ok(ctx.activity::<MyActivity1>(()).await?)
    }
}

/// A run only its run timeout ends: it waits for a signal nobody sends.
#[derive(Debug)]
pub struct DeadlineShape;
impl Workflow for DeadlineShape {
    const NAME: &'static str = "shapes.deadline";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        let _: () = ctx.wait_signal("never").await?;
        Ok(())
    }
}

/// A run left open on purpose: it starts a child that waits for a signal
/// nobody sends, then waits an hour on a timer. Its bundle is exported
/// while both wait, so the rows only an open run holds (its timer in both
/// timer families, its child) are pinned by the golden derived rows.
#[derive(Debug)]
pub struct OpenShape;
impl Workflow for OpenShape {
    const NAME: &'static str = "shapes.open";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        let child = ctx.child::<DeadlineShape>(()).start().await?;
        ctx.timer(std::time::Duration::from_secs(3600)).await;
        child.result().await?;
        Ok(())
    }
}

/// Every shape workflow, plus the seed workflows.
pub fn workflows() -> WorkflowRegistry {
    let mut r = crate::seeds::workflows();
    r.register::<ScopeShape>()
        .register::<UpdateShape>()
        .register::<VersionShape>()
        .register::<SearchShape>()
        .register::<StreamShape>()
        .register::<SendShape>()
        .register::<TickShape>()
        .register::<CancelWaitShape>()
        .register::<DeadlineShape>()
        .register::<OpenShape>();
    r
}
