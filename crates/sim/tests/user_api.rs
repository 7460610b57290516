// Goal: users check their own workflows under faults through the public
// builder: a correct workflow passes, and a non-deterministic one is
// caught.
// Method: a small order workflow (a retried charge activity mocked by a
// closure that fails its first attempt, an approval signal retried by the
// client with one command id, a timer) runs under every fault kind on a
// few seeds and must pass with the expected outcome; then a workflow whose
// commands depend on a process-wide counter (the classic replay bug) must
// be reported, because replay of its history issues other commands.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keel_core::{
    Activity, ActivityContext, ActivityError, RetryPolicy, Workflow, WorkflowContext, WorkflowError,
};
use keel_sim::{Faults, Simulation, ViolationKind, Workload};
use keel_storage::{Outcome, Payload};

struct Charge;
impl Activity for Charge {
    const NAME: &'static str = "user.charge";
    type Input = u64;
    type Output = String;
    async fn run(&self, _ctx: ActivityContext, cents: u64) -> Result<String, ActivityError> {
        Ok(format!("receipt-{cents}"))
    }
}

struct Order;
impl Workflow for Order {
    const NAME: &'static str = "user.order";
    type Input = u64;
    type Output = String;
    async fn run(ctx: WorkflowContext, cents: u64) -> Result<String, WorkflowError> {
        let approved: bool = ctx.wait_signal("approve").await?;
        if !approved {
            return Err(WorkflowError::msg("rejected"));
        }
        ctx.timer(Duration::from_millis(250)).await;
        let receipt = ctx
            .activity::<Charge>(cents)
            .retry(RetryPolicy::constant(5, Duration::from_millis(50)))
            .await?;
        Ok(receipt)
    }
}

fn order_sim(seed: u64) -> Simulation {
    Simulation::new(seed)
        .register_workflow::<Order>()
        .mock_activity::<Charge, _>(|cents, attempt| {
            if attempt < 2 {
                Err(ActivityError::retryable("gateway timeout"))
            } else {
                Ok(format!("receipt-{cents}"))
            }
        })
        .faults(Faults::all())
        .workload(
            Workload::new()
                .start::<Order>("order-1", &1299)
                .signal("order-1", "approve", &true, 100, "approve-1")
                .signal("order-1", "approve", &true, 180, "approve-1")
                .start_at::<Order>("order-2", &500, 40)
                .signal("order-2", "approve", &false, 300, "approve-2"),
        )
}

#[test]
fn a_correct_user_workflow_passes_under_faults() {
    for seed in 0..30 {
        let r = order_sim(seed).run().expect("runs");
        assert!(r.passed, "{r}");
        assert_eq!(
            r.outcomes.get("order-1"),
            Some(&Outcome::Completed(
                Payload::encode(&"receipt-1299").expect("encodes")
            )),
            "{r}"
        );
        assert!(
            matches!(r.outcomes.get("order-2"), Some(Outcome::Failed(f)) if f.message == "rejected"),
            "{r}"
        );
    }
}

static CALLS: AtomicU64 = AtomicU64::new(0);

/// Reads process-wide state: replay issues other commands than the live run.
struct Flipping;
impl Workflow for Flipping {
    const NAME: &'static str = "user.flipping";
    type Input = u64;
    type Output = u64;
    async fn run(ctx: WorkflowContext, v: u64) -> Result<u64, WorkflowError> {
        if CALLS.fetch_add(1, Ordering::Relaxed).is_multiple_of(2) {
            Ok(ctx.activity::<Charge>(v).await?.len() as u64)
        } else {
            ctx.timer(Duration::from_millis(5)).await;
            Ok(0)
        }
    }
}

#[test]
fn a_non_deterministic_user_workflow_is_caught() {
    let r = Simulation::new(1)
        .register_workflow::<Flipping>()
        .mock_activity::<Charge, _>(|cents, _| Ok(format!("receipt-{cents}")))
        .faults(Faults::none())
        .workload(Workload::new().start::<Flipping>("flip-1", &7))
        .run()
        .expect("runs");
    assert!(!r.passed, "{r}");
    assert!(
        r.violations.iter().any(|v| matches!(
            v.kind,
            ViolationKind::ReplayMismatch | ViolationKind::Parked | ViolationKind::OutcomeMismatch
        )),
        "{r}"
    );
}

#[test]
fn a_bad_workload_is_refused_before_anything_runs() {
    let err = Simulation::new(1)
        .register_workflow::<Order>()
        .workload(Workload::new().signal("nobody", "approve", &true, 0, "x"))
        .run()
        .expect_err("refused");
    assert!(err.to_string().contains("nobody"), "{err}");
}
