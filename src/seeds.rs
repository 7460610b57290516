//! The examples of the concurrency seed (Durable Workflow v2), written as
//! keel workflows: sequential and parallel activities, a select with a
//! deadline, nested barriers, an async closure, a mixed activity/child
//! barrier, and parallel children.

use std::path::Path;
use std::time::Duration;

use keel::{
    Activity, ActivityContext, ActivityError, ActivityRegistry, Engine, EngineError, Workflow,
    WorkflowContext, WorkflowError, WorkflowRegistry,
};
use serde::{Deserialize, Serialize};

/// How long each example activity takes, so a restart can land mid-run.
pub const ACTIVITY_MS: u64 = 40;

async fn work() {
    tokio::time::sleep(Duration::from_millis(ACTIVITY_MS)).await;
}

macro_rules! simple_activity {
    ($ty:ident, $name:literal, $out:literal) => {
        #[doc = concat!("The seed's `", stringify!($ty), "`.")]
        #[derive(Default, Debug)]
        pub struct $ty;
        impl Activity for $ty {
            const NAME: &'static str = $name;
            type Input = ();
            type Output = String;
            async fn run(&self, _ctx: ActivityContext, _: ()) -> Result<String, ActivityError> {
                work().await;
                Ok($out.to_string())
            }
        }
    };
}

simple_activity!(MyActivity1, "seeds.my_activity_1", "result 1");
simple_activity!(MyActivity2, "seeds.my_activity_2", "result 2");
simple_activity!(MyActivity3, "seeds.my_activity_3", "result 3");
simple_activity!(BuildSummary, "seeds.build_summary", "summary");
simple_activity!(BuildInvoice, "seeds.build_invoice", "invoice");
simple_activity!(BuildShipment, "seeds.build_shipment", "shipment");
simple_activity!(ChargeCustomer, "seeds.charge_customer", "charged");
simple_activity!(ShipOrder, "seeds.ship_order", "shipped");

/// Resolves a request: `fast-*` requests in a moment, others take 10 s
/// (so the select's deadline wins). Honours cancellation.
#[derive(Default, Debug)]
pub struct ResolveRequest;
impl Activity for ResolveRequest {
    const NAME: &'static str = "seeds.resolve_request";
    type Input = String;
    type Output = String;
    async fn run(&self, ctx: ActivityContext, id: String) -> Result<String, ActivityError> {
        let wait = if id.starts_with("fast") {
            ACTIVITY_MS
        } else {
            10_000
        };
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait)) => Ok(format!("resolved {id}")),
            _ = ctx.cancelled() => Err(ActivityError::fatal("cancelled")),
        }
    }
}

/// A customer record.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Customer {
    /// Its id.
    pub id: String,
    /// Its name.
    pub name: String,
}

/// Loads a customer.
#[derive(Default, Debug)]
pub struct LoadCustomer;
impl Activity for LoadCustomer {
    const NAME: &'static str = "seeds.load_customer";
    type Input = String;
    type Output = Customer;
    async fn run(&self, _ctx: ActivityContext, id: String) -> Result<Customer, ActivityError> {
        work().await;
        Ok(Customer {
            name: format!("customer {id}"),
            id,
        })
    }
}

/// Scores a customer.
#[derive(Default, Debug)]
pub struct ScoreCustomer;
impl Activity for ScoreCustomer {
    const NAME: &'static str = "seeds.score_customer";
    type Input = String;
    type Output = u32;
    async fn run(&self, _ctx: ActivityContext, id: String) -> Result<u32, ActivityError> {
        work().await;
        Ok(id.bytes().map(u32::from).sum::<u32>() % 100)
    }
}

/// Three activities, one after another.
#[derive(Debug)]
pub struct SequentialWorkflow;
impl Workflow for SequentialWorkflow {
    const NAME: &'static str = "seeds.sequential";
    type Input = ();
    type Output = Vec<String>;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<Vec<String>, WorkflowError> {
        Ok(vec![
            ctx.activity::<MyActivity1>(()).await?,
            ctx.activity::<MyActivity2>(()).await?,
            ctx.activity::<MyActivity3>(()).await?,
        ])
    }
}

/// Three activities in one barrier: issued in one step, one suspension.
#[derive(Debug)]
pub struct ParallelWorkflow;
impl Workflow for ParallelWorkflow {
    const NAME: &'static str = "seeds.parallel";
    type Input = ();
    type Output = (String, String, String);
    async fn run(ctx: WorkflowContext, _: ()) -> Result<Self::Output, WorkflowError> {
        Ok(ctx
            .all((
                ctx.activity::<MyActivity1>(()),
                ctx.activity::<MyActivity2>(()),
                ctx.activity::<MyActivity3>(()),
            ))
            .await?)
    }
}

/// What `ResolveInRealTime` returns.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Resolution {
    /// `resolved` or `timed_out`.
    pub status: String,
    /// The winning member's key.
    pub source: Option<String>,
    /// The winning value.
    pub value: Option<String>,
}

/// The seed's select with a deadline: the resolver, a manual signal, and a
/// 2-second timer started at the same durable step.
#[derive(Debug)]
pub struct ResolveInRealTime;
impl Workflow for ResolveInRealTime {
    const NAME: &'static str = "seeds.resolve_in_real_time";
    type Input = String;
    type Output = Resolution;
    async fn run(ctx: WorkflowContext, request_id: String) -> Result<Resolution, WorkflowError> {
        let selected = ctx
            .select()
            .branch("resolved", ctx.activity::<ResolveRequest>(request_id))
            .signal("manual", "resolution.received")
            .timer("deadline", Duration::from_secs(2))
            .await?;
        if selected.key == "deadline".into() {
            if let Some(h) = selected.handle("resolved") {
                h.cancel();
            }
            return Ok(Resolution {
                status: "timed_out".into(),
                source: None,
                value: None,
            });
        }
        // The deadline is not cancelled just because another member won.
        if let Some(h) = selected.handle("deadline") {
            h.cancel();
        }
        Ok(Resolution {
            status: "resolved".into(),
            source: Some(selected.key.to_string()),
            value: Some(selected.result::<String>()?),
        })
    }
}

/// A barrier with a nested barrier: three leaves, two group levels.
#[derive(Debug)]
pub struct NestedWorkflow;
impl Workflow for NestedWorkflow {
    const NAME: &'static str = "seeds.nested";
    type Input = ();
    type Output = (String, (String, String));
    async fn run(ctx: WorkflowContext, _: ()) -> Result<Self::Output, WorkflowError> {
        Ok(ctx
            .all((
                ctx.activity::<BuildSummary>(()),
                ctx.all((
                    ctx.activity::<BuildInvoice>(()),
                    ctx.activity::<BuildShipment>(()),
                )),
            ))
            .await?)
    }
}

/// A customer profile built by an async closure.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Profile {
    /// The customer.
    pub customer: Customer,
    /// Its score.
    pub score: u32,
}

/// The seed's `CustomerWorkflow`: an async closure as a durable child.
#[derive(Debug)]
pub struct CustomerWorkflow;
impl Workflow for CustomerWorkflow {
    const NAME: &'static str = "seeds.customer";
    type Input = String;
    type Output = Profile;
    async fn run(ctx: WorkflowContext, customer_id: String) -> Result<Profile, WorkflowError> {
        let profile = ctx
            .run_async(customer_id, |ctx: WorkflowContext, id: String| async move {
                let customer = ctx.activity::<LoadCustomer>(id).await?;
                let score = ctx.activity::<ScoreCustomer>(customer.id.clone()).await?;
                Ok(Profile { customer, score })
            })
            .await?;
        Ok(profile)
    }
}

/// A child that ships an order.
#[derive(Debug)]
pub struct ShipOrderWorkflow;
impl Workflow for ShipOrderWorkflow {
    const NAME: &'static str = "seeds.ship_order_workflow";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        Ok(ctx.activity::<ShipOrder>(()).await?)
    }
}

/// The seed's `OrderWorkflow`: an activity and a child in one barrier.
#[derive(Debug)]
pub struct MixedOrderWorkflow;
impl Workflow for MixedOrderWorkflow {
    const NAME: &'static str = "seeds.mixed_order";
    type Input = ();
    type Output = (String, String);
    async fn run(ctx: WorkflowContext, _: ()) -> Result<Self::Output, WorkflowError> {
        Ok(ctx
            .all((
                ctx.activity::<ChargeCustomer>(()),
                ctx.child::<ShipOrderWorkflow>(()),
            ))
            .await?)
    }
}

macro_rules! child_workflow {
    ($ty:ident, $name:literal, $act:ident) => {
        #[doc = concat!("The seed's `", stringify!($ty), "`.")]
        #[derive(Debug)]
        pub struct $ty;
        impl Workflow for $ty {
            const NAME: &'static str = $name;
            type Input = ();
            type Output = String;
            async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
                Ok(ctx.activity::<$act>(()).await?)
            }
        }
    };
}

child_workflow!(MyChild1, "seeds.my_child_1", MyActivity1);
child_workflow!(MyChild2, "seeds.my_child_2", MyActivity2);
child_workflow!(MyChild3, "seeds.my_child_3", MyActivity3);

/// The seed's `ParentWorkflow`: three children in one barrier.
#[derive(Debug)]
pub struct ParentWorkflow;
impl Workflow for ParentWorkflow {
    const NAME: &'static str = "seeds.parent";
    type Input = ();
    type Output = (String, String, String);
    async fn run(ctx: WorkflowContext, _: ()) -> Result<Self::Output, WorkflowError> {
        Ok(ctx
            .all((
                ctx.child::<MyChild1>(()),
                ctx.child::<MyChild2>(()),
                ctx.child::<MyChild3>(()),
            ))
            .await?)
    }
}

/// Every seed workflow.
pub fn workflows() -> WorkflowRegistry {
    let mut r = WorkflowRegistry::new();
    r.register::<SequentialWorkflow>()
        .register::<ParallelWorkflow>()
        .register::<ResolveInRealTime>()
        .register::<NestedWorkflow>()
        .register::<CustomerWorkflow>()
        .register::<ShipOrderWorkflow>()
        .register::<MixedOrderWorkflow>()
        .register::<MyChild1>()
        .register::<MyChild2>()
        .register::<MyChild3>()
        .register::<ParentWorkflow>();
    r
}

/// Every seed activity.
pub fn activities() -> ActivityRegistry {
    let mut r = ActivityRegistry::new();
    r.register(MyActivity1)
        .register(MyActivity2)
        .register(MyActivity3)
        .register(BuildSummary)
        .register(BuildInvoice)
        .register(BuildShipment)
        .register(ChargeCustomer)
        .register(ShipOrder)
        .register(ResolveRequest)
        .register(LoadCustomer)
        .register(ScoreCustomer);
    r
}

/// An engine over `dir` with every seed workflow and activity.
pub fn engine(dir: &Path) -> Result<Engine, EngineError> {
    Engine::builder()
        .data_dir(dir)
        .workflows(&workflows())
        .activities(activities())
        .build()
}
