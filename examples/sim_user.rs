//! Checking your own workflow under faults with the simulator.
//!
//! A transfer workflow (debit, then credit, each retried; an approval
//! signal the client may send twice; a deadline on the approval) runs on
//! 200 seeds under every fault kind: lease expiry and redelivery, duplicate
//! and late results, reordered deliveries, worker and engine crashes with
//! the unsynced tail dropped, commit failures, injected activity failures.
//! Each seed must end with the same outcome as a fault-free run, with every
//! history replaying to itself.
//!
//! Run: `cargo run --release --example sim_user`

use std::time::Duration;

use keel::{
    Activity, ActivityContext, ActivityError, RetryPolicy, Workflow, WorkflowContext, WorkflowError,
};
use keel_sim::{Faults, Simulation, Workload};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Transfer {
    from: String,
    to: String,
    cents: u64,
}

struct Debit;
impl Activity for Debit {
    const NAME: &'static str = "bank.debit";
    type Input = Transfer;
    type Output = String;
    async fn run(&self, ctx: ActivityContext, t: Transfer) -> Result<String, ActivityError> {
        // The execution id is the idempotency key for the bank's API.
        Ok(format!(
            "debit {} {} key {}",
            t.from,
            t.cents,
            ctx.execution_id()
        ))
    }
}

struct Credit;
impl Activity for Credit {
    const NAME: &'static str = "bank.credit";
    type Input = Transfer;
    type Output = String;
    async fn run(&self, _ctx: ActivityContext, t: Transfer) -> Result<String, ActivityError> {
        Ok(format!("credit {} {}", t.to, t.cents))
    }
}

struct TransferWorkflow;
impl Workflow for TransferWorkflow {
    const NAME: &'static str = "bank.transfer";
    type Input = Transfer;
    type Output = String;
    async fn run(ctx: WorkflowContext, t: Transfer) -> Result<String, WorkflowError> {
        if t.cents > 10_000 {
            let approval = ctx
                .select()
                .signal("approved", "approve")
                .timer("deadline", Duration::from_secs(600))
                .await?;
            if approval.key != "approved".into() {
                return Err(WorkflowError::msg("not approved in time"));
            }
        }
        let retry = RetryPolicy::exponential(6, Duration::from_millis(50), Duration::from_secs(1));
        let debit = ctx
            .activity::<Debit>(t.clone())
            .retry(retry.clone())
            .await?;
        let credit = ctx.activity::<Credit>(t).retry(retry).await?;
        Ok(format!("{debit}; {credit}"))
    }
}

fn simulation(seed: u64) -> Simulation {
    let t = |from: &str, to: &str, cents| Transfer {
        from: from.into(),
        to: to.into(),
        cents,
    };
    Simulation::new(seed)
        .register_workflow::<TransferWorkflow>()
        // Mocks: deterministic, synchronous bodies; the bank is flaky on
        // the first attempt of every debit.
        .mock_activity::<Debit, _>(|t, attempt| {
            if attempt == 1 {
                Err(ActivityError::retryable("bank unavailable"))
            } else {
                Ok(format!("debit {} {}", t.from, t.cents))
            }
        })
        .mock_activity::<Credit, _>(|t, _| Ok(format!("credit {} {}", t.to, t.cents)))
        .faults(Faults::all())
        .workload(
            Workload::new()
                .start::<TransferWorkflow>("small", &t("alice", "bob", 500))
                .start::<TransferWorkflow>("large", &t("bob", "carol", 50_000))
                // The client sends the approval twice with one command id.
                .signal("large", "approve", &true, 200, "approve-large")
                .signal("large", "approve", &true, 260, "approve-large"),
        )
}

fn main() {
    let mut failed = 0;
    for seed in 0..200 {
        let report = simulation(seed).run().expect("the workload is valid");
        if !report.passed {
            failed += 1;
            print!("{report}");
            if let Ok(Some(shrunk)) = simulation(seed).shrink() {
                println!("  shrunk: --faults {}", shrunk.faults);
            }
        }
    }
    println!("200 seeds, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
