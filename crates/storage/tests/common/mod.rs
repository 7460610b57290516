//! Shared helpers for keel-storage's integration tests: deterministic ids,
//! an event builder that keeps seqs contiguous, a runner that executes one
//! test body against every store kind, and a byte-level dump of a store for
//! "nothing was written" checks.

#![allow(dead_code, unreachable_pub)]

use keel_storage::event::{attempt_of, execution_of};
use keel_storage::keys::Cf;
use keel_storage::{
    AttemptNo, CommitAck, CommitBatch, Durability, Event, EventKind, Failure, FailureKind,
    InstanceId, MemStore, Payload, PgOptions, PgStore, RocksStore, RunId, Seq, Step, Store,
    Timestamp,
};

/// A deterministic run id; `n` tells runs of one test apart.
pub fn run_id(n: u64) -> RunId {
    RunId::from_u64_pair(0x6b65_656c_0000_0000, n)
}

/// An event at `seq`, committed at `at` ms.
pub fn ev(seq: u64, at: u64, kind: EventKind) -> Event {
    Event {
        seq: Seq(seq),
        at: Timestamp(at),
        kind,
    }
}

/// A `WorkflowStarted` for `run` of `instance`.
pub fn started(run: RunId, instance: &str, workflow_type: &str) -> EventKind {
    EventKind::WorkflowStarted(Box::new(keel_storage::WorkflowStart {
        instance_id: InstanceId::new(instance),
        run_id: run,
        workflow_type: workflow_type.into(),
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
    }))
}

/// A `WorkflowStarted` for `run` of `instance`, decided against the
/// instance's earlier run `previous` (a new run after a close, or a
/// continuation).
pub fn started_after(
    run: RunId,
    instance: &str,
    workflow_type: &str,
    previous: RunId,
) -> EventKind {
    let mut kind = started(run, instance, workflow_type);
    if let EventKind::WorkflowStarted(start) = &mut kind {
        let keel_storage::WorkflowStart { previous_run, .. } = &mut **start;
        *previous_run = Some(previous);
    }
    kind
}

/// `ActivityScheduled` at `step` of `run`.
pub fn scheduled(run: RunId, step: u32) -> EventKind {
    EventKind::ActivityScheduled {
        step: Step(step),
        group: Vec::new(),
        execution_id: execution_of(run, Step(step)),
        activity_type: "charge".into(),
        input: Payload::from_bytes(vec![step as u8]),
        options: Box::default(),
    }
}

/// `ActivityCompleted` of attempt `attempt` at `step` of `run`.
pub fn completed(run: RunId, step: u32, attempt: u32) -> EventKind {
    EventKind::ActivityCompleted {
        step: Step(step),
        attempt_id: attempt_of(run, Step(step), AttemptNo(attempt)),
        result: Payload::from_bytes(b"ok".to_vec()),
    }
}

/// `ActivityAttemptFailed` of attempt `attempt`, retried at `retry_at`.
pub fn attempt_failed(run: RunId, step: u32, attempt: u32, retry_at: Option<u64>) -> EventKind {
    EventKind::ActivityAttemptFailed {
        step: Step(step),
        attempt_id: attempt_of(run, Step(step), AttemptNo(attempt)),
        failure: Box::new(Failure::new(FailureKind::Application, "boom", true)),
        retry_at: retry_at.map(Timestamp),
        heartbeat: None,
    }
}

/// `TimerStarted` at `step` firing at `fire_at`.
pub fn timer_started(step: u32, fire_at: u64) -> EventKind {
    EventKind::TimerStarted {
        step: Step(step),
        group: Vec::new(),
        fire_at: Timestamp(fire_at),
    }
}

/// `TimerFired` at `step`.
pub fn timer_fired(step: u32, fire_at: u64) -> EventKind {
    EventKind::TimerFired {
        step: Step(step),
        fire_at: Timestamp(fire_at),
    }
}

/// `SignalReceived` with a payload.
pub fn signal(name: &str, payload: &[u8]) -> EventKind {
    EventKind::SignalReceived {
        name: name.into(),
        payload: Payload::from_bytes(payload.to_vec()),
        command_id: None,
    }
}

/// `WorkflowCompleted`.
pub fn workflow_completed() -> EventKind {
    EventKind::WorkflowCompleted {
        result: Payload::from_bytes(b"done".to_vec()),
    }
}

/// Builds a run's events with contiguous seqs and an advancing clock.
#[derive(Debug, Clone)]
pub struct RunBuilder {
    pub run: RunId,
    pub next: u64,
    pub at: u64,
}

impl RunBuilder {
    /// A run whose first event will be seq 1 at `at` ms.
    pub fn new(run: RunId, at: u64) -> Self {
        RunBuilder { run, next: 1, at }
    }

    /// The next event, advancing seq and clock.
    pub fn next(&mut self, kind: EventKind) -> Event {
        let e = ev(self.next, self.at, kind);
        self.next += 1;
        self.at += 10;
        e
    }

    /// Commits `kinds` as one append to `store`, advancing only on success.
    pub fn commit(
        &mut self,
        store: &dyn Store,
        kinds: Vec<EventKind>,
    ) -> keel_storage::Result<CommitAck> {
        let run = self.run;
        self.commit_with(kinds, |events| commit(store, run, events))
    }

    /// [`RunBuilder::commit`] through [`Store::commit_alone`]: the RocksDB
    /// store writes it on this thread when its writer is idle.
    pub fn commit_alone(
        &mut self,
        store: &dyn Store,
        kinds: Vec<EventKind>,
    ) -> keel_storage::Result<CommitAck> {
        let run = self.run;
        self.commit_with(kinds, |events| {
            store
                .commit_alone(keel_storage::CommitBatch::append(run, events))
                .wait()
        })
    }

    fn commit_with(
        &mut self,
        kinds: Vec<EventKind>,
        commit: impl FnOnce(Vec<Event>) -> keel_storage::Result<CommitAck>,
    ) -> keel_storage::Result<CommitAck> {
        let saved = (self.next, self.at);
        let events: Vec<Event> = kinds.into_iter().map(|k| self.next(k)).collect();
        let r = commit(events);
        if r.is_err() {
            (self.next, self.at) = saved;
        }
        r
    }
}

/// Commits one append and waits for the answer.
pub fn commit(
    store: &dyn Store,
    run: RunId,
    events: Vec<Event>,
) -> keel_storage::Result<CommitAck> {
    store.commit(CommitBatch::append(run, events)).wait()
}

/// Every key and value of every column family, in key order.
pub type Dump = Vec<(Cf, Vec<u8>, Vec<u8>)>;

/// Dumps a store's bytes through its view.
pub fn dump(store: &dyn Store) -> Dump {
    let mut out = Vec::new();
    for cf in Cf::ALL {
        store
            .view()
            .scan(cf, &[], &[], &mut |k, v| {
                out.push((cf, k.to_vec(), v.to_vec()));
                true
            })
            .expect("scan");
    }
    out
}

/// A store under test with whatever keeps it alive (fields drop in order:
/// the store before its directory or schema).
pub struct Subject {
    pub name: &'static str,
    pub store: Box<dyn Store>,
    _dir: Option<tempfile::TempDir>,
    _schema: Option<PgScratch>,
}

/// The test PostgreSQL server's address, exported by `scripts/postgres.sh`
/// (which `.ci/run` sources). Without it the PostgreSQL store's tests are
/// skipped with a line on stderr, unless `KEEL_REQUIRE_POSTGRES=1` (set by
/// `.ci/run`), which makes a missing server a failure.
pub fn postgres_url() -> Option<String> {
    match std::env::var("KEEL_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("KEEL_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "KEEL_REQUIRE_POSTGRES=1 but KEEL_TEST_POSTGRES_URL is not set: run the tests through .ci/run, which starts PostgreSQL"
            );
            eprintln!("KEEL_TEST_POSTGRES_URL is not set: skipping the PostgreSQL store");
            None
        }
    }
}

/// A schema of its own for one test, dropped afterwards.
pub struct PgScratch(pub PgOptions);

impl PgScratch {
    /// Options for a fresh schema on the test server.
    pub fn new(url: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        PgScratch(PgOptions::new(url).schema(format!("t{}_{n}", std::process::id())))
    }
}

impl Drop for PgScratch {
    fn drop(&mut self) {
        if let Err(e) = PgStore::drop_schema(&self.0) {
            eprintln!("dropping test schema {}: {e}", self.0.schema);
        }
    }
}

/// One of each store kind: in-memory (both durabilities), RocksDB, and
/// PostgreSQL when the test server is up (see [`postgres_url`]).
pub fn subjects() -> Vec<Subject> {
    let dir = tempfile::tempdir().expect("tempdir");
    let rocks = RocksStore::open(dir.path().join("db"), Durability::Sync).expect("open rocks");
    let mut subjects = vec![
        Subject {
            name: "mem-sync",
            store: Box::new(MemStore::new(Durability::Sync)),
            _dir: None,
            _schema: None,
        },
        Subject {
            name: "mem-buffered",
            store: Box::new(MemStore::new(Durability::Buffered)),
            _dir: None,
            _schema: None,
        },
        Subject {
            name: "rocks",
            store: Box::new(rocks),
            _dir: Some(dir),
            _schema: None,
        },
    ];
    if let Some(url) = postgres_url() {
        let scratch = PgScratch::new(&url);
        let store = PgStore::open(scratch.0.clone()).expect("open postgres");
        subjects.push(Subject {
            name: "postgres",
            store: Box::new(store),
            _dir: None,
            _schema: Some(scratch),
        });
    }
    subjects
}

/// Runs `body` once per store kind; a failure names the store.
pub fn for_each_store(body: impl Fn(&dyn Store)) {
    for s in subjects() {
        eprintln!("store: {}", s.name);
        body(s.store.as_ref());
    }
}

/// `value` as a build of schema 4 wrote it: a msgpack map with field names
/// in an envelope of state version 3 (to check that this build reads such
/// records as they are).
pub fn as_schema_4<T: serde::Serialize>(
    kind: keel_storage::codec::RecordKind,
    value: &T,
) -> Vec<u8> {
    let mut out = vec![keel_storage::codec::MAGIC, kind as u8, 3, 0, 0, 0, 0, 0];
    out.extend_from_slice(&rmp_serde::to_vec_named(value).expect("encode"));
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[..4]), &out[8..]);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Whether a record's body is a msgpack map (field names), not an array.
pub fn body_is_map(record: &[u8]) -> bool {
    matches!(
        record.get(keel_storage::codec::HEADER_BYTES),
        Some(0x80..=0x8f | 0xde | 0xdf)
    )
}

/// A run whose three activities close in each way an attempt's result can
/// close its execution, for the schema 5 to 6 migration: step 1 completes
/// on its first attempt, step 2 on its second after a failure to retry
/// (whose attempt keeps a row of its own), step 3 fails for good on its
/// first. Returns the run and the (step, attempt, seq) of each closing
/// result.
pub fn closed_three_ways(store: &dyn Store, n: u64) -> (RunId, Vec<(u32, u32, Seq)>) {
    let mut r = RunBuilder::new(run_id(n), 100);
    r.commit(
        store,
        vec![
            started(r.run, &format!("three-ways-{n}"), "wf"),
            scheduled(r.run, 1),
            scheduled(r.run, 2),
            scheduled(r.run, 3),
        ],
    )
    .expect("start");
    let mut closing = Vec::new();
    for (kind, closes) in [
        (completed(r.run, 1, 1), Some((1, 1))),
        (attempt_failed(r.run, 2, 1, Some(5_000)), None),
        (completed(r.run, 2, 2), Some((2, 2))),
        (attempt_failed(r.run, 3, 1, None), Some((3, 1))),
    ] {
        r.commit(store, vec![kind]).expect("an attempt's result");
        if let Some((step, attempt)) = closes {
            closing.push((step, attempt, Seq(r.next - 1)));
        }
    }
    (r.run, closing)
}

/// Every row of the `dedupe` family, as (key, value), in key order.
pub fn dedupe_rows(store: &dyn Store) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut rows = Vec::new();
    store
        .view()
        .scan(keel_storage::keys::Cf::Dedupe, &[], &[], &mut |k, v| {
            rows.push((k.to_vec(), v.to_vec()));
            true
        })
        .expect("scan dedupe");
    rows
}

/// After a migration to schema 6: `store` verifies clean, and each attempt
/// in `closing` (from [`closed_three_ways`]) still reads as committed at
/// its result, through its execution's row.
pub fn assert_migrated_attempts(store: &dyn Store, run: RunId, closing: &[(u32, u32, Seq)]) {
    let report = store.verify().expect("verify");
    assert!(report.ok, "{report:?}");
    for (step, attempt, seq) in closing {
        let key = keel_storage::DurableKey::Attempt(Step(*step), AttemptNo(*attempt));
        assert_eq!(
            store.committed(run, &key).expect("read"),
            Some(*seq),
            "{key}"
        );
    }
}
