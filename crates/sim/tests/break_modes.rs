// Goal: proof that the checker can fail. Each deliberately broken engine
// must be reported within 500 seeds, with the violation that shows it.
// Method: for each `BreakMode`, run seeds from 0 until the first failing
// one (stop there, to keep the test fast); its first violation must be one
// the mode is detected as; the shrinker must keep a failing fault list and
// print a reproduction naming the mode.

use keel_sim::{BreakMode, Simulation};

fn first_failing(mode: BreakMode) -> Option<(u64, keel_sim::Report)> {
    (0..500).find_map(|seed| {
        let r = Simulation::new(seed)
            .default_mix(20)
            .break_engine(mode)
            .run()
            .expect("runs");
        (!r.passed).then_some((seed, r))
    })
}

fn check(mode: BreakMode) {
    let (seed, report) =
        first_failing(mode).unwrap_or_else(|| panic!("{mode}: no violation in 500 seeds"));
    let first = &report.violations[0];
    assert!(
        mode.detected_as().contains(&first.kind),
        "{mode}: seed {seed} failed with {first}, expected one of {:?}",
        mode.detected_as()
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
fn drop_failed_timer_is_found() {
    check(BreakMode::DropFailedTimer);
}

#[test]
fn fail_child_on_start_error_is_found() {
    check(BreakMode::FailChildOnStartError);
}

#[test]
fn a_failing_seed_shrinks_to_a_list_that_still_fails() {
    let (seed, report) = first_failing(BreakMode::DropFailedTimer).expect("found");
    let shrunk = Simulation::new(seed)
        .default_mix(20)
        .break_engine(BreakMode::DropFailedTimer)
        .shrink()
        .expect("runs")
        .expect("the seed fails");
    assert_eq!(shrunk.violation.kind, report.violations[0].kind);
    assert!(shrunk.faults.kinds().count() <= report.fault_probabilities.len());
    // The shrunk list is a reproduction on its own.
    let again = Simulation::new(seed)
        .default_mix(20)
        .break_engine(BreakMode::DropFailedTimer)
        .faults(shrunk.faults.clone())
        .run()
        .expect("runs");
    assert!(!again.passed, "{again}");
    assert!(
        shrunk.repro.contains("--break drop-failed-timer"),
        "{}",
        shrunk.repro
    );
}
