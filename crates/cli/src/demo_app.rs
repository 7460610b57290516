//! The demo's order-processing application: keel's main job in miniature.
//! Charge, reserve inventory, a short warehouse timer, manual approval of
//! large orders by signal, ship, notify. Compiled into the `keel` binary so
//! `keel replay` can replay demo histories.

use std::time::Duration;

use keel::{
    Activity, ActivityContext, ActivityError, RetryPolicy, Workflow, WorkflowContext,
    WorkflowError, WorkflowRegistry,
};
use serde::{Deserialize, Serialize};

/// Orders above this many cents wait for a manual approval signal.
pub const APPROVAL_CENTS_MIN: u64 = 50_000;

/// One order.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Order {
    pub id: u64,
    pub cents: u64,
    pub sku: String,
}

/// What a processed order returns.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Receipt {
    pub charge: String,
    pub reservation: String,
    pub approved_by: Option<String>,
    pub tracking: String,
}

fn deterministic_fail(id: u64, attempt: u32) -> bool {
    // One order in twenty fails its first charge attempt (a gateway
    // hiccup), so the demo exercises durable retries.
    id % 20 == 3 && attempt == 1
}

// The activities below are in-memory stand-ins: they never block, and say
// so (`NON_BLOCKING`), so a shard runs each where it dispatches it. A real
// gateway called through an async client could say so too; one called
// through a blocking client must not.

#[derive(Default, Debug)]
pub struct ChargeCard;
impl Activity for ChargeCard {
    const NAME: &'static str = "demo.charge";
    const NON_BLOCKING: bool = true;
    type Input = Order;
    type Output = String;
    async fn run(&self, ctx: ActivityContext, o: Order) -> Result<String, ActivityError> {
        if deterministic_fail(o.id, ctx.attempt().0) {
            return Err(ActivityError::retryable("payment gateway timed out"));
        }
        Ok(format!("ch_{}", ctx.execution_id().step))
    }
}

#[derive(Default, Debug)]
pub struct ReserveInventory;
impl Activity for ReserveInventory {
    const NAME: &'static str = "demo.reserve";
    const NON_BLOCKING: bool = true;
    type Input = Order;
    type Output = String;
    async fn run(&self, _ctx: ActivityContext, o: Order) -> Result<String, ActivityError> {
        Ok(format!("rsv_{}_{}", o.sku, o.id))
    }
}

#[derive(Default, Debug)]
pub struct Ship;
impl Activity for Ship {
    const NAME: &'static str = "demo.ship";
    const NON_BLOCKING: bool = true;
    type Input = Order;
    type Output = String;
    async fn run(&self, _ctx: ActivityContext, o: Order) -> Result<String, ActivityError> {
        Ok(format!("trk_{:08}", o.id * 7919 % 100_000_000))
    }
}

#[derive(Default, Debug)]
pub struct Notify;
impl Activity for Notify {
    const NAME: &'static str = "demo.notify";
    const NON_BLOCKING: bool = true;
    type Input = String;
    type Output = ();
    async fn run(&self, _ctx: ActivityContext, _msg: String) -> Result<(), ActivityError> {
        Ok(())
    }
}

/// The order workflow.
#[derive(Debug)]
pub struct ProcessOrder;
impl Workflow for ProcessOrder {
    const NAME: &'static str = "demo.order";
    type Input = Order;
    type Output = Receipt;
    async fn run(ctx: WorkflowContext, order: Order) -> Result<Receipt, WorkflowError> {
        let retry =
            RetryPolicy::exponential(5, Duration::from_millis(10), Duration::from_millis(200));
        let charge = ctx
            .activity::<ChargeCard>(order.clone())
            .retry(retry.clone())
            .start_to_close(Duration::from_secs(10))
            .await?;
        let reservation = ctx
            .activity::<ReserveInventory>(order.clone())
            .retry(retry.clone())
            .await?;
        let approved_by = if order.cents >= APPROVAL_CENTS_MIN {
            Some(ctx.wait_signal::<String>("approve").await?)
        } else {
            None
        };
        // The warehouse picks in batches: a short durable wait.
        ctx.timer(Duration::from_millis(20)).await;
        let tracking = ctx
            .activity::<Ship>(order.clone())
            .retry(retry.clone())
            .await?;
        ctx.activity::<Notify>(format!("order {} shipped as {tracking}", order.id))
            .retry(retry)
            .await?;
        Ok(Receipt {
            charge,
            reservation,
            approved_by,
            tracking,
        })
    }
}

/// Registers the demo's workflows.
pub fn workflows() -> WorkflowRegistry {
    let mut r = WorkflowRegistry::new();
    r.register::<ProcessOrder>();
    r
}

/// An engine builder with the demo's workflows and activities registered:
/// what `keel demo`'s engine processes and `keel serve` run.
pub fn engine_builder() -> keel::EngineBuilder {
    keel::Engine::builder()
        .workflows(&workflows())
        .register_activity::<ChargeCard>()
        .register_activity::<ReserveInventory>()
        .register_activity::<Ship>()
        .register_activity::<Notify>()
}

/// The n-th demo order (every tenth is large and needs approval).
pub fn order(id: u64) -> Order {
    let cents = if id % 10 == 9 {
        75_000
    } else {
        1_000 + (id * 37) % 9_000
    };
    Order {
        id,
        cents,
        sku: format!("sku-{}", id % 17),
    }
}
