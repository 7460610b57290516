//! Goal: histories recorded by earlier builds keep replaying with the
//! current workflow code, so a change that would park old runs fails CI.
//! Method: replay every `*.bundle` in `tests/data/histories/` (written by
//! `keel export`; adding one needs no code) with the registry compiled into
//! the `keel` binary, `keel_cli::registry()`, and fail on any divergence or
//! replay error. A second test proves the check has teeth: the same
//! bundles replayed against a changed `demo.order` must diverge.

use std::path::PathBuf;

use keel::replay::{Bundle, ReplayOutcome, Replayer};
use keel::{
    Activity, ActivityContext, ActivityError, Workflow, WorkflowContext, WorkflowError,
    WorkflowRegistry,
};

fn bundles() -> Vec<PathBuf> {
    let dir = manifest_dir().join("tests/data/histories");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "bundle"))
        .collect();
    out.sort();
    assert!(
        out.len() >= 3,
        "expected the golden bundles in {}, found {}",
        dir.display(),
        out.len()
    );
    out
}

#[test]
fn every_golden_history_replays_with_the_current_code() {
    let replayer = Replayer::new(keel_cli::registry());
    let mut failures = Vec::new();
    for path in bundles() {
        let bundle = match Bundle::read(&path) {
            Ok(b) => b,
            Err(e) => {
                failures.push(format!("{}: {e}", path.display()));
                continue;
            }
        };
        // The replayer checks that a closed history closes again and that
        // an open one issues nothing past its end.
        let report = replayer.replay_bundle(&bundle);
        if !report.outcome.is_ok() {
            failures.push(format!("{}: {}", path.display(), report.outcome));
        }
    }
    assert!(
        failures.is_empty(),
        "golden histories no longer replay:\n{}",
        failures.join("\n")
    );
}

#[derive(Default, Debug)]
struct Refund;
impl Activity for Refund {
    const NAME: &'static str = "demo.refund";
    type Input = keel_cli::demo_app::Order;
    type Output = String;
    async fn run(
        &self,
        _ctx: ActivityContext,
        _o: keel_cli::demo_app::Order,
    ) -> Result<String, ActivityError> {
        Ok(String::new())
    }
}

/// `demo.order` rewritten so that its first command is another activity.
struct ChangedOrder;
impl Workflow for ChangedOrder {
    const NAME: &'static str = "demo.order";
    type Input = keel_cli::demo_app::Order;
    type Output = keel_cli::demo_app::Receipt;
    async fn run(
        ctx: WorkflowContext,
        order: keel_cli::demo_app::Order,
    ) -> Result<keel_cli::demo_app::Receipt, WorkflowError> {
        let charge = ctx.activity::<Refund>(order).await?;
        Err(WorkflowError::msg(charge))
    }
}

#[test]
fn a_changed_workflow_diverges_on_every_golden_history() {
    let mut registry = WorkflowRegistry::new();
    registry.register::<ChangedOrder>();
    let replayer = Replayer::new(registry);
    for path in bundles() {
        let report = replayer.replay_bundle(&Bundle::read(&path).expect("golden bundle reads"));
        match &report.outcome {
            ReplayOutcome::Diverged {
                step,
                recorded,
                issued,
            } => {
                assert_eq!(step.0, 1, "{}", path.display());
                assert!(recorded.contains("demo.charge"), "{recorded}");
                assert!(issued.contains("demo.refund"), "{issued}");
            }
            other => panic!("{}: expected a divergence, got {other}", path.display()),
        }
    }
}

/// The package directory at run time. `cargo test` sets it for every test
/// binary; the compile-time `env!` would name whichever clone compiled the
/// binary, and clones sharing one target directory reuse each other's
/// binaries when their sources match.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}
