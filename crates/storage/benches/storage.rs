//! Storage micro-benchmarks (criterion): the event codec, a full scan of the
//! events family, and group commit under many committers.
//!
//! `cargo bench -p keel-storage --bench storage`. The end-to-end numbers of
//! the storage layer come from `keel bench append` / `keel bench read` (see
//! BENCHMARKS.md); these exist to compare changes to the codec and the
//! writer quickly, without building the engine.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use keel_storage::codec::{self, RecordKind};
use keel_storage::event::{attempt_of, execution_of};
use keel_storage::keys::Cf;
use keel_storage::{
    AttemptNo, CommitBatch, Durability, Event, EventKind, InstanceId, Payload, RocksStore, RunId,
    Seq, Step, Store, Timestamp,
};

fn started(run: RunId, instance: String) -> Event {
    Event {
        seq: Seq::FIRST,
        at: Timestamp(1_700_000_000_000),
        kind: EventKind::WorkflowStarted(Box::new(keel_storage::WorkflowStart {
            instance_id: InstanceId::new(instance),
            run_id: run,
            workflow_type: "bench".into(),
            input: Payload::from_bytes(b"input".to_vec()),
            command_id: None,
            parent: None,
            continued_from: None,
            random_seed: 7,
            previous_run: None,
            carried: Default::default(),
            memo: Vec::new(),
            search_attributes: Vec::new(),
            timeouts: Default::default(),
        })),
    }
}

fn signal(seq: u64) -> Event {
    Event {
        seq: Seq(seq),
        at: Timestamp(1_700_000_000_000),
        kind: EventKind::SignalReceived {
            name: "bench".into(),
            payload: Payload::from_bytes(seq.to_le_bytes().to_vec()),
            command_id: None,
        },
    }
}

fn samples(run: RunId) -> Vec<(&'static str, Event)> {
    let step = Step(3);
    vec![
        ("started", started(run, "bench-instance".into())),
        (
            "scheduled",
            Event {
                seq: Seq(6),
                at: Timestamp(1_700_000_000_000),
                kind: EventKind::ActivityScheduled {
                    step,
                    group: Vec::new(),
                    execution_id: execution_of(run, step),
                    activity_type: "bench.noop".into(),
                    input: Payload::from_bytes(vec![1, 2, 3, 4]),
                    options: Box::default(),
                },
            },
        ),
        (
            "completed",
            Event {
                seq: Seq(7),
                at: Timestamp(1_700_000_000_000),
                kind: EventKind::ActivityCompleted {
                    step,
                    attempt_id: attempt_of(run, step, AttemptNo::FIRST),
                    result: Payload::from_bytes(vec![5, 6, 7, 8]),
                },
            },
        ),
        ("signal", signal(9)),
    ]
}

fn codec_benches(c: &mut Criterion) {
    let run = RunId::from_u64_pair(1, 2);
    let mut g = c.benchmark_group("codec");
    for (name, event) in samples(run) {
        let bytes = codec::encode(RecordKind::Event, &event).expect("encodes");
        g.throughput(Throughput::Elements(1));
        g.bench_with_input(BenchmarkId::new("encode", name), &event, |b, e| {
            b.iter(|| codec::encode(RecordKind::Event, std::hint::black_box(e)))
        });
        g.bench_with_input(BenchmarkId::new("decode", name), &bytes, |b, bytes| {
            b.iter(|| codec::decode::<Event>(RecordKind::Event, std::hint::black_box(bytes)))
        });
    }
    g.finish();
}

/// A scan of the events family of a 100,000-event store, decoding each.
fn scan_bench(c: &mut Criterion) {
    const RUNS: u64 = 1000;
    const PER_RUN: u64 = 100;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("data");
    {
        let store = RocksStore::open(&path, Durability::Buffered).expect("open");
        let handles: Vec<_> = (0..RUNS)
            .map(|r| {
                let run = RunId::from_u64_pair(7, r);
                let mut events = vec![started(run, format!("scan-{r}"))];
                events.extend((2..=PER_RUN).map(signal));
                store.commit(CommitBatch::append(run, events))
            })
            .collect();
        for h in handles {
            h.wait().expect("commit");
        }
        store.flush().expect("flush");
    }
    let store = RocksStore::open_read_only(&path).expect("open read-only");
    let mut g = c.benchmark_group("scan");
    g.throughput(Throughput::Elements(RUNS * PER_RUN));
    g.sample_size(20);
    g.bench_function("events_decode", |b| {
        b.iter(|| {
            let mut n = 0u64;
            store
                .view()
                .scan(Cf::Events, &[], &[], &mut |_, v| {
                    let e = codec::decode::<Event>(RecordKind::Event, v).expect("decodes");
                    std::hint::black_box(e);
                    n += 1;
                    true
                })
                .expect("scan");
            assert_eq!(n, RUNS * PER_RUN);
        })
    });
    g.finish();
}

/// `committers` threads each committing `per_thread` single-event appends
/// to a run of their own; returns the wall time of the commits.
fn commit_round(
    store: &Arc<RocksStore>,
    committers: usize,
    per_thread: u64,
    round: u64,
) -> Duration {
    let barrier = Arc::new(Barrier::new(committers + 1));
    let threads: Vec<_> = (0..committers)
        .map(|c| {
            let (store, barrier) = (store.clone(), barrier.clone());
            std::thread::spawn(move || {
                let run = RunId::from_u64_pair(round, c as u64);
                store
                    .commit(CommitBatch::append(
                        run,
                        vec![started(run, format!("c-{round}-{c}"))],
                    ))
                    .wait()
                    .expect("start");
                barrier.wait();
                for seq in 2..2 + per_thread {
                    store
                        .commit(CommitBatch::append(run, vec![signal(seq)]))
                        .wait()
                        .expect("commit");
                }
            })
        })
        .collect();
    barrier.wait();
    let t0 = Instant::now();
    for t in threads {
        t.join().expect("committer");
    }
    t0.elapsed()
}

fn commit_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("commit");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(5));
    for (mode, durability) in [
        ("sync", Durability::Sync),
        ("buffered", Durability::Buffered),
    ] {
        for committers in [1usize, 16, 256] {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = Arc::new(RocksStore::open(dir.path(), durability).expect("open"));
            let mut round = 0u64;
            g.throughput(Throughput::Elements(committers as u64));
            g.bench_function(BenchmarkId::new(mode, committers), |b| {
                // One iteration: every committer commits once.
                b.iter_custom(|iters| {
                    round += 1;
                    commit_round(&store, committers, iters, round)
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, codec_benches, scan_bench, commit_benches);
criterion_main!(benches);
