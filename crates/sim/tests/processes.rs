// Goal: several engine processes on one store keep every invariant while
// processes are frozen past their shard leases and killed, and the
// simulation really exercises takeovers and fencing (a sweep where no
// shard ever changed hands would pass trivially). Method: seeds of the
// default mix on three processes with every fault kind; each must pass and
// finish every workflow with the outcome of a fault-free single-process
// run (the simulator compares them); summed over the sweep, processes were
// paused and killed, shards were taken over, shards stopped on a lost
// lease, shards were given up to spread the load (the first process
// takes every shard; the others join), takes whose answer was lost
// left leases their process released, attempts ran in processes other
// than their shard's (attempts anywhere) and some of those copies were
// lost with their process and reported to the shard. Same seed, same
// trace.

use keel_sim::{FaultKind, Faults, Simulation};

/// Seeds in the CI sweep; `keel sim --processes 3 --seeds N` runs more.
const SEEDS: u64 = 200;

#[test]
fn three_processes_keep_every_invariant_under_pauses_and_kills() {
    let (mut pauses, mut kills, mut takeovers, mut lost) = (0u64, 0u64, 0u64, 0u64);
    let (mut released, mut answers_lost) = (0u64, 0u64);
    let (mut remote, mut copies_lost, mut lost_alive) = (0u64, 0u64, 0u64);
    for seed in 0..SEEDS {
        let r = Simulation::new(seed)
            .default_mix(20)
            .processes(3)
            .faults(Faults::all())
            .run()
            .expect("runs");
        assert!(r.passed, "{r}");
        assert_eq!(r.finished, 20, "{r}");
        pauses += r
            .faults_fired
            .get(&FaultKind::ProcessPause)
            .copied()
            .unwrap_or(0);
        kills += r
            .faults_fired
            .get(&FaultKind::ProcessKill)
            .copied()
            .unwrap_or(0);
        answers_lost += r
            .faults_fired
            .get(&FaultKind::LeaseAnswerLost)
            .copied()
            .unwrap_or(0);
        let fired = |k| r.faults_fired.get(&k).copied().unwrap_or(0);
        remote += fired(FaultKind::RemoteCopy);
        lost_alive += fired(FaultKind::CopyLostAlive);
        copies_lost += u64::from(r.copies_lost);
        takeovers += u64::from(r.takeovers);
        lost += u64::from(r.shards_lost);
        released += u64::from(r.shards_released);
    }
    assert!(pauses > 5, "{pauses} pauses");
    assert!(kills > 5, "{kills} kills");
    assert!(takeovers > 10, "{takeovers} takeovers");
    assert!(lost > 5, "{lost} shards stopped on a lost lease");
    assert!(released > 10, "{released} shards given up to rebalance");
    assert!(
        answers_lost > 5,
        "{answers_lost} takes whose answer was lost"
    );
    assert!(remote > 100, "{remote} copies run by another process");
    assert!(
        copies_lost > 10,
        "{copies_lost} copies lost with their taker"
    );
    assert!(
        lost_alive > 10,
        "{lost_alive} copies reported lost while alive"
    );
}

#[test]
fn the_same_seed_gives_the_same_trace_with_several_processes() {
    for seed in [3, 11] {
        let sim = Simulation::new(seed).default_mix(10).processes(3);
        let a = sim.run().expect("runs");
        let b = sim.run().expect("runs");
        assert_eq!(a.trace_hash, b.trace_hash, "seed {seed}");
    }
}

#[test]
fn several_processes_refuse_a_rocksdb_store() {
    let err = Simulation::new(1)
        .default_mix(2)
        .processes(2)
        .store(keel_sim::StoreKind::RocksDb)
        .run()
        .unwrap_err();
    assert!(err.to_string().contains("one writer"), "{err}");
}
