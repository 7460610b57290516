// Goal: the engine keeps every invariant on a few hundred seeds of the
// default workload under all fault kinds, and the sweep really injects
// every kind (a sweep that injected nothing would pass trivially).
// Method: run seeds 0..200 with 20 workflows each and all faults; every
// report must pass; the per-kind counts summed over the sweep must be
// non-zero for every kind; the workload must have exercised crashes and
// the outbox.

use std::collections::BTreeMap;

use keel_sim::{FaultKind, Faults, Simulation};

#[test]
fn two_hundred_seeds_pass_with_every_fault_kind_firing() {
    let mut fired: BTreeMap<FaultKind, u64> = BTreeMap::new();
    let (mut crashes, mut outbox, mut finished) = (0u64, 0u64, 0usize);
    for seed in 0..200 {
        let r = Simulation::new(seed)
            .default_mix(20)
            .faults(Faults::all())
            .run()
            .expect("runs");
        assert!(r.passed, "{r}");
        assert_eq!(r.finished, 20, "{r}");
        for (k, n) in r.faults_fired {
            *fired.entry(k).or_default() += n;
        }
        crashes += u64::from(r.engine_crashes);
        outbox += r.outbox_messages;
        finished += r.finished;
    }
    for kind in FaultKind::ALL.into_iter().filter(|k| !k.needs_processes()) {
        assert!(
            fired.get(&kind).copied().unwrap_or(0) > 0,
            "{kind} never fired: {fired:?}"
        );
    }
    assert!(crashes > 20, "{crashes} engine crashes");
    assert!(outbox > 100, "{outbox} outbox messages");
    assert_eq!(finished, 200 * 20);
}
