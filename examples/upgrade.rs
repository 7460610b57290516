// Shipping new workflow code while runs of the old code are open.
//
// Version 1 of `order` charges, then waits for an "approve" signal. Version
// 2 adds a fraud check before the charge, behind `ctx.patched`. The
// example starts two orders on version 1 and stops the engine; replays
// every open run against version 2 as the deploy gate (what `keel replay
// --all` does); restarts on version 2; approves the old orders (they keep
// their old branch: no fraud check) and starts a new one (it takes the new
// branch and records a marker, so it keeps it after the next restart).
//
//     cargo run --release --example upgrade

use keel::replay::Replayer;
use keel::storage::{RunFilter, RunStatus};
use keel::{Activity, ActivityContext, ActivityError, Engine, Workflow, WorkflowContext};
use keel::{WorkflowError, WorkflowRegistry};

#[derive(Default)]
struct Charge;
impl Activity for Charge {
    const NAME: &'static str = "upgrade.charge";
    type Input = u64;
    type Output = String;
    async fn run(&self, _: ActivityContext, cents: u64) -> Result<String, ActivityError> {
        Ok(format!("charged {cents}"))
    }
}

#[derive(Default)]
struct FraudCheck;
impl Activity for FraudCheck {
    const NAME: &'static str = "upgrade.fraud_check";
    type Input = u64;
    type Output = String;
    async fn run(&self, _: ActivityContext, cents: u64) -> Result<String, ActivityError> {
        Ok(if cents > 100_000 { "review" } else { "clear" }.into())
    }
}

struct OrderV1;
impl Workflow for OrderV1 {
    const NAME: &'static str = "upgrade.order";
    type Input = u64;
    type Output = String;
    async fn run(ctx: WorkflowContext, cents: u64) -> Result<String, WorkflowError> {
        let charged = ctx.activity::<Charge>(cents).await?;
        let who: String = ctx.wait_signal("approve").await?;
        Ok(format!("{charged}, approved by {who}"))
    }
}

struct OrderV2;
impl Workflow for OrderV2 {
    const NAME: &'static str = "upgrade.order";
    type Input = u64;
    type Output = String;
    async fn run(ctx: WorkflowContext, cents: u64) -> Result<String, WorkflowError> {
        // New runs check for fraud first; runs that charged before this
        // change replay their history without the check.
        let fraud = if ctx.patched("fraud-check") {
            ctx.activity::<FraudCheck>(cents).await?
        } else {
            "not checked".to_string()
        };
        let charged = ctx.activity::<Charge>(cents).await?;
        let who: String = ctx.wait_signal("approve").await?;
        Ok(format!("{charged}, fraud {fraud}, approved by {who}"))
    }
}

fn engine<W: Workflow>(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<W>()
        .register_activity::<Charge>()
        .register_activity::<FraudCheck>()
        .build()?)
}

async fn approve(e: &Engine, id: &str) -> anyhow::Result<String> {
    let c = e.client();
    c.signal(id, "approve", &"ops", Some(&format!("{id}-approve")))
        .await?;
    Ok(c.result::<OrderV2>(id).await?)
}

async fn wait_charged(e: &Engine, id: &str) -> anyhow::Result<()> {
    while e.client().describe(id).await?.signal_waits.is_empty() {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let data = tmp.path().join("data");

    let e = engine::<OrderV1>(&data)?;
    for (id, cents) in [("old-1", 5_000u64), ("old-2", 250_000)] {
        e.client().start::<OrderV1>(id, &cents).await?;
        wait_charged(&e, id).await?;
    }
    e.shutdown().await;
    println!("version 1: old-1 and old-2 charged, waiting for approval");

    // The deploy gate: every open run must replay against the new code.
    let store = keel::storage::RocksStore::open_read_only(&data)?;
    let mut registry = WorkflowRegistry::new();
    registry.register::<OrderV2>();
    let filter = RunFilter::all().status(RunStatus::Running);
    let summary = Replayer::new(registry).replay_store(&store, &filter, &mut |_| {})?;
    anyhow::ensure!(
        summary.is_ok(),
        "version 2 would park open runs: {summary:?}"
    );
    println!("gate: version 2 replays {} open runs", summary.replayed);
    drop(store);

    let e = engine::<OrderV2>(&data)?;
    println!("old-1: {}", approve(&e, "old-1").await?);
    e.client().start::<OrderV2>("new-1", &7_500u64).await?;
    wait_charged(&e, "new-1").await?;
    e.shutdown().await;

    let e = engine::<OrderV2>(&data)?;
    println!("old-2: {}", approve(&e, "old-2").await?);
    println!("new-1: {}", approve(&e, "new-1").await?);
    e.shutdown().await;
    Ok(())
}
