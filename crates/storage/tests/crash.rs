// Goal: the in-memory store's crash model is exact, because the simulator's
// durability claims rest on it: in Buffered mode a crash loses exactly the
// commits since the last sync (or keeps a prefix of them, never a hole), in
// Sync mode it loses nothing acknowledged, an injected commit failure writes
// nothing, and the state after any crash verifies clean.
// Method: take a byte snapshot after every commit; after a crash the live
// state must equal the snapshot of the last commit that should survive.

use crate::common::*;
use keel_storage::keys::Cf;
use keel_storage::kv::Maps;
use keel_storage::{CrashMode, Durability, Error, MemStore, Seq, Store};

/// One column family's entries, in key order.
type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// Every column family of a snapshot, for equality checks.
fn bytes(m: &Maps) -> Vec<(Cf, Entries)> {
    Cf::ALL
        .iter()
        .map(|cf| {
            (
                *cf,
                m.cf(*cf)
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            )
        })
        .collect()
}

/// Starts a run and syncs, then makes `n` more commits (one event each,
/// alternating between two runs) without syncing. Returns the snapshots:
/// index 0 is the synced state, index i the state after unsynced commit i.
fn buffered_history(store: &MemStore, n: usize) -> (Vec<RunBuilder>, Vec<Maps>) {
    let mut a = RunBuilder::new(run_id(1), 100);
    let mut b = RunBuilder::new(run_id(2), 100);
    a.commit(store, vec![started(a.run, "a", "wf")]).unwrap();
    b.commit(store, vec![started(b.run, "b", "wf"), scheduled(b.run, 1)])
        .unwrap();
    store.sync().unwrap();
    assert_eq!(store.unsynced_commits(), 0);
    let mut snaps = vec![store.snapshot()];
    for i in 0..n {
        let run = if i % 2 == 0 { &mut a } else { &mut b };
        let kind = match i {
            3 => completed(run.run, 1, 1),
            5 => workflow_completed(),
            _ => signal("s", &[i as u8]),
        };
        run.commit(store, vec![kind]).unwrap();
        snaps.push(store.snapshot());
    }
    assert_eq!(store.unsynced_commits(), n);
    (vec![a, b], snaps)
}

#[test]
fn drop_unsynced_loses_exactly_the_unsynced_commits() {
    let store = MemStore::new(Durability::Buffered);
    let (_, snaps) = buffered_history(&store, 6);
    store.crash(CrashMode::DropUnsynced);
    assert_eq!(bytes(&store.snapshot()), bytes(&snaps[0]));
    assert_eq!(store.unsynced_commits(), 0);
    assert_eq!(store.history(run_id(1)).unwrap().len(), 1);
    assert_eq!(store.history(run_id(2)).unwrap().len(), 2);
    assert_eq!(store.run_meta(run_id(1)).unwrap().unwrap().next_seq, Seq(2));
    let report = store.verify().unwrap();
    assert!(report.ok, "{:?}", report.violations);
    assert_eq!((report.runs, report.events), (2, 3));
    // The lost seqs were never acknowledged durable: the run continues at
    // the first lost seq.
    commit(&store, run_id(1), vec![ev(2, 999, signal("again", b"x"))]).unwrap();
    // A second crash drops that too, and nothing else.
    store.crash(CrashMode::DropUnsynced);
    assert_eq!(bytes(&store.snapshot()), bytes(&snaps[0]));
}

#[test]
fn keep_unsynced_keeps_a_prefix_never_a_hole() {
    for keep in 0..=7 {
        let store = MemStore::new(Durability::Buffered);
        let (_, snaps) = buffered_history(&store, 6);
        store.crash(CrashMode::KeepUnsynced(keep));
        let expect = keep.min(6);
        assert_eq!(
            bytes(&store.snapshot()),
            bytes(&snaps[expect]),
            "KeepUnsynced({keep}) must equal the state after {expect} unsynced commits"
        );
        assert_eq!(store.unsynced_commits(), 0);
        let report = store.verify().unwrap();
        assert!(report.ok, "keep {keep}: {:?}", report.violations);
    }
}

#[test]
fn sync_makes_commits_survive_a_crash() {
    let store = MemStore::new(Durability::Buffered);
    let (mut runs, snaps) = buffered_history(&store, 4);
    store.sync().unwrap();
    assert_eq!(store.unsynced_commits(), 0);
    runs[1]
        .commit(&store, vec![signal("after-sync", b"x")])
        .unwrap();
    store.crash(CrashMode::DropUnsynced);
    assert_eq!(bytes(&store.snapshot()), bytes(&snaps[4]));
    assert!(store.verify().unwrap().ok);
}

#[test]
fn sync_mode_loses_nothing_acknowledged() {
    let store = MemStore::new(Durability::Sync);
    assert_eq!(store.durability(), Durability::Sync);
    let mut a = RunBuilder::new(run_id(1), 100);
    a.commit(&store, vec![started(a.run, "a", "wf")]).unwrap();
    for i in 0..5u8 {
        a.commit(&store, vec![signal("s", &[i])]).unwrap();
        assert_eq!(store.unsynced_commits(), 0);
    }
    let before = store.snapshot();
    for mode in [CrashMode::DropUnsynced, CrashMode::KeepUnsynced(0)] {
        store.crash(mode);
        assert_eq!(bytes(&store.snapshot()), bytes(&before));
    }
    assert_eq!(store.history(a.run).unwrap().len(), 6);
    assert!(store.verify().unwrap().ok);
}

#[test]
fn injected_commit_failures_write_nothing() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let store = MemStore::new(durability);
        let mut a = RunBuilder::new(run_id(1), 100);
        a.commit(&store, vec![started(a.run, "a", "wf")]).unwrap();
        store.sync().unwrap();
        let before = store.snapshot();
        store.fail_next_commits(2);
        for _ in 0..2 {
            let err = a.commit(&store, vec![signal("s", b"x")]).unwrap_err();
            assert!(matches!(err, Error::CommitFailed(_)), "{err}");
            assert_eq!(bytes(&store.snapshot()), bytes(&before));
            assert_eq!(store.unsynced_commits(), 0);
        }
        // The third commit goes through at the seq the failures did not use.
        let ack = a.commit(&store, vec![signal("s", b"x")]).unwrap();
        assert_eq!(ack.appends[0].first, Seq(2));
        // A failed commit leaves nothing for a crash to resurrect either.
        store.sync().unwrap();
        store.crash(CrashMode::KeepUnsynced(usize::MAX));
        assert_eq!(store.history(a.run).unwrap().len(), 2);
        assert!(store.verify().unwrap().ok);
    }
}

#[test]
fn crash_between_runs_of_one_instance_keeps_instance_consistent() {
    // A continue-as-new style hand-over split across two unsynced commits:
    // keeping only the first must not leave the instance pointing at a run
    // that does not exist.
    let store = MemStore::new(Durability::Buffered);
    let mut a = RunBuilder::new(run_id(1), 100);
    a.commit(&store, vec![started(a.run, "inst", "wf")])
        .unwrap();
    store.sync().unwrap();
    a.commit(&store, vec![workflow_completed()]).unwrap();
    let mut b = RunBuilder::new(run_id(2), 500);
    b.commit(&store, vec![started_after(b.run, "inst", "wf", a.run)])
        .unwrap();
    store.crash(CrashMode::KeepUnsynced(1));
    let inst = store
        .instance(&keel_storage::InstanceId::new("inst"))
        .unwrap()
        .unwrap();
    assert_eq!(inst.current_run, a.run);
    assert!(store.run_meta(b.run).unwrap().is_none());
    assert!(store.verify().unwrap().ok);
}
