// Goal: proof that the checks can fail. Each deliberately broken driver
// (`BreakMode`, a hook inside the engine's own driver) must be reported
// within 500 seeds, with the violation that shows it. Method: for each
// mode, run seeds from 0 until the first failing one (stop there, to keep
// the test fast); its first violation must be one the mode is detected as;
// the shrinker must keep a failing reproduction (fewer or as many faults,
// workflows and firings) that fails again on its own.

use keel_sim::{detected_as, BreakMode, Simulation};

/// The simulation a mode is looked for in: fencing needs several
/// processes.
fn sim(seed: u64, mode: BreakMode) -> Simulation {
    let s = Simulation::new(seed).default_mix(20).break_engine(mode);
    match mode {
        BreakMode::SkipFence => s.processes(3),
        _ => s,
    }
}

fn first_failing(mode: BreakMode) -> Option<(u64, keel_sim::Report)> {
    (0..500).find_map(|seed| {
        let r = sim(seed, mode).run().expect("runs");
        (!r.passed).then_some((seed, r))
    })
}

fn check(mode: BreakMode) {
    let (seed, report) =
        first_failing(mode).unwrap_or_else(|| panic!("{mode}: no violation in 500 seeds"));
    let first = &report.violations[0];
    assert!(
        detected_as(mode).contains(&first.kind),
        "{mode}: seed {seed} failed with {first}, expected one of {:?}",
        detected_as(mode)
    );
    assert!(
        report.repro.contains(&format!("--seed {seed}")),
        "{}",
        report.repro
    );
    assert!(
        report.repro.contains(&format!("--break {mode}")),
        "{}",
        report.repro
    );
}

#[test]
fn no_attempt_dedupe_is_found() {
    check(BreakMode::NoAttemptDedupe);
}

#[test]
fn effect_before_commit_is_found() {
    check(BreakMode::EffectBeforeCommit);
}

#[test]
fn lose_unsynced_ack_is_found() {
    check(BreakMode::LoseUnsyncedAck);
}

#[test]
fn skip_close_policy_is_found() {
    check(BreakMode::SkipClosePolicy);
}

#[test]
fn redeliver_same_epoch_is_found() {
    check(BreakMode::RedeliverSameEpoch);
}

#[test]
fn query_speculative_is_found() {
    check(BreakMode::QuerySpeculative);
}

#[test]
fn skip_fence_is_found() {
    check(BreakMode::SkipFence);
}

#[test]
fn keep_closed_closures_is_found() {
    check(BreakMode::KeepClosedClosures);
}

#[test]
fn a_failing_seed_shrinks_to_a_smaller_reproduction_that_still_fails() {
    let mode = BreakMode::SkipClosePolicy;
    let (seed, report) = first_failing(mode).expect("found");
    let sim = Simulation::new(seed).default_mix(20).break_engine(mode);
    let shrunk = sim.shrink().expect("runs").expect("the seed fails");
    assert_eq!(shrunk.violation.kind, report.violations[0].kind);
    assert!(shrunk.faults.kinds().count() <= report.fault_probabilities.len());
    assert!(shrunk.workflows.len() <= 20);
    assert!(shrunk.firings.len() <= report.firings.len());
    // The shrunk workload, faults and firings are a reproduction on their own.
    let again = sim
        .clone()
        .faults(shrunk.faults.clone())
        .only_workflows(shrunk.workflows.clone())
        .firings(shrunk.firings.clone())
        .run()
        .expect("runs");
    assert!(!again.passed, "{again}");
    assert!(
        shrunk.repro.contains("--break skip-close-policy"),
        "{}",
        shrunk.repro
    );
    assert!(
        shrunk.repro.contains("--only-workflows"),
        "{}",
        shrunk.repro
    );
}
