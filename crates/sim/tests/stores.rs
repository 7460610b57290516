// Goal: the in-memory store and RocksDB end in the same logical state for
// the same seed, so sweeps on the fast store speak for the durable one.
// Method: run a few seeds under every fault kind on the in-memory store in
// Sync mode (commits durable when they return, as on RocksDB) and on
// RocksDB in a temporary directory (a crash closes and reopens it); the
// simulator draws the same decisions on both, so the trace hashes and
// every run's final history must be equal, and both must pass.

use keel_sim::{Faults, Simulation, StoreKind};

#[test]
fn mem_and_rocksdb_end_in_the_same_state() {
    for seed in [3, 11, 42] {
        let sim = Simulation::new(seed).default_mix(12).faults(Faults::all());
        let mem = sim
            .clone()
            .store(StoreKind::MemSync)
            .run()
            .expect("mem runs");
        let rocks = sim.store(StoreKind::RocksDb).run().expect("rocksdb runs");
        assert!(mem.passed, "{mem}");
        assert!(rocks.passed, "{rocks}");
        assert!(!mem.histories.is_empty());
        assert_eq!(mem.histories, rocks.histories, "seed {seed}");
        assert_eq!(mem.trace_hash, rocks.trace_hash, "seed {seed}");
        assert_eq!(mem.outcomes, rocks.outcomes, "seed {seed}");
    }
}
