//! Goal: the engine runs workflows end to end through the public API:
//! activities with retries, signals, timers, restarts on the same data
//! directory, deduplicated starts and signals, typed errors for bad input,
//! and parking on an incompatible code change.
//! Method: small workflows on the in-memory store and on RocksDB in a temp
//! dir; restarts are a shutdown and a new engine over the same directory.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel::storage::keys::Cf;
use keel::storage::kv::KvRead;
use keel::storage::{CommitBatch, CommitHandle, MemStore, Store};
use keel::{
    Activity, ActivityContext, ActivityError, Engine, EngineError, RetryPolicy, Workflow,
    WorkflowContext, WorkflowError,
};
use serde::{Deserialize, Serialize};

static CHARGE_CALLS: AtomicU32 = AtomicU32::new(0);

#[derive(Default)]
struct Charge;
impl Activity for Charge {
    const NAME: &'static str = "charge";
    type Input = u64;
    type Output = String;
    async fn run(&self, ctx: ActivityContext, cents: u64) -> Result<String, ActivityError> {
        CHARGE_CALLS.fetch_add(1, Ordering::SeqCst);
        if ctx.attempt().0 == 1 {
            return Err(ActivityError::retryable("gateway hiccup"));
        }
        Ok(format!("charged {cents} on attempt {}", ctx.attempt()))
    }
}

#[derive(Default)]
struct Ship;
impl Activity for Ship {
    const NAME: &'static str = "ship";
    type Input = String;
    type Output = String;
    async fn run(&self, _ctx: ActivityContext, what: String) -> Result<String, ActivityError> {
        Ok(format!("shipped {what}"))
    }
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Order {
    cents: u64,
    item: String,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Receipt {
    charge: String,
    approved_by: Option<String>,
    shipment: String,
}

struct OrderWorkflow;
impl Workflow for OrderWorkflow {
    const NAME: &'static str = "order";
    type Input = Order;
    type Output = Receipt;
    async fn run(ctx: WorkflowContext, order: Order) -> Result<Receipt, WorkflowError> {
        let charge = ctx
            .activity::<Charge>(order.cents)
            .retry(RetryPolicy::constant(3, Duration::from_millis(5)))
            .await?;
        let approved_by = if order.cents > 1000 {
            Some(ctx.wait_signal::<String>("approve").await?)
        } else {
            None
        };
        ctx.timer(Duration::from_millis(10)).await;
        let shipment = ctx.activity::<Ship>(order.item).await?;
        Ok(Receipt {
            charge,
            approved_by,
            shipment,
        })
    }
}

fn engine_in(dir: &std::path::Path) -> Engine {
    Engine::builder()
        .data_dir(dir)
        .register_workflow::<OrderWorkflow>()
        .register_activity::<Charge>()
        .register_activity::<Ship>()
        .build()
        .expect("engine starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_order_completes_in_memory_with_a_retry() -> anyhow::Result<()> {
    let engine = Engine::builder()
        .in_memory()
        .register_workflow::<OrderWorkflow>()
        .register_activity::<Charge>()
        .register_activity::<Ship>()
        .build()?;
    let client = engine.client();
    let order = Order {
        cents: 500,
        item: "book".into(),
    };
    let run = client
        .start::<OrderWorkflow>("o-small", &order)
        .await?
        .run_id();
    // A second start of the same open instance returns the same run.
    let again = client.start::<OrderWorkflow>("o-small", &order).await?;
    assert_eq!(again.run_id(), run);
    let receipt = client.result::<OrderWorkflow>("o-small").await?;
    assert_eq!(receipt.charge, "charged 500 on attempt 2");
    assert_eq!(receipt.shipment, "shipped book");
    let report = engine.store().verify()?;
    assert!(report.ok, "{:?}", report.violations);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_order_waits_for_approval_across_a_restart() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let order = Order {
        cents: 5000,
        item: "piano".into(),
    };
    {
        let engine = engine_in(dir.path());
        let client = engine.client();
        client.start::<OrderWorkflow>("o-large", &order).await?;
        // Wait until the run is parked on the signal (charge done).
        for _ in 0..200 {
            let d = client.describe("o-large").await?;
            if d.signal_waits.iter().any(|(n, _)| n == "approve") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let d = client.describe("o-large").await?;
        assert_eq!(d.signal_waits, vec![("approve".to_string(), 1)]);
        engine.shutdown_blocking();
    }
    let engine = engine_in(dir.path());
    let client = engine.client();
    // Not in memory after the restart: describing it replays it, so what
    // only the machine knows (the signal it waits for) is there.
    let d = client.describe("o-large").await?;
    assert_eq!(d.signal_waits, vec![("approve".to_string(), 1)]);
    assert_eq!(d.status, keel::RunStatus::Running);
    client
        .signal("o-large", "approve", &"ops".to_string(), Some("approve-1"))
        .await?;
    // The same command id again is deduplicated.
    client
        .signal("o-large", "approve", &"ops".to_string(), Some("approve-1"))
        .await?;
    let receipt = client.result::<OrderWorkflow>("o-large").await?;
    assert_eq!(receipt.approved_by.as_deref(), Some("ops"));
    assert_eq!(receipt.shipment, "shipped piano");
    // Closed and dropped from memory: described from the store alone.
    let run = client.describe("o-large").await?;
    assert_eq!(run.status, keel::RunStatus::Completed);
    assert!(run.pending.is_empty() && run.coroutines.is_none());
    let history = engine.store().history(run.run_id)?;
    let signals = history
        .iter()
        .filter(|e| e.kind.name() == "SignalReceived")
        .count();
    assert_eq!(signals, 1, "the duplicate signal was not committed");
    assert!(engine.store().verify()?.ok);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_typed_errors_and_writes_nothing() -> anyhow::Result<()> {
    let engine = Engine::builder()
        .in_memory()
        .register_workflow::<OrderWorkflow>()
        .build()?;
    let client = engine.client();
    let err = client
        .start_raw(
            "no-such",
            "x",
            keel::Payload::encode(&1u8)?,
            None,
            Default::default(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, EngineError::UnknownWorkflowType(ref t) if t == "no-such"),
        "{err}"
    );
    let err = client
        .start_raw(
            "order",
            "x",
            keel::Payload::encode(&"not an order")?,
            None,
            Default::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::InvalidInput { .. }), "{err}");
    let big = Order {
        cents: 1,
        item: "x".repeat(keel::storage::PAYLOAD_BYTES_MAX + 1),
    };
    let err = client.start::<OrderWorkflow>("x", &big).await.unwrap_err();
    assert!(matches!(err, EngineError::PayloadTooLarge { .. }), "{err}");
    let err = client
        .signal("nobody", "approve", &"x", None)
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::UnknownInstance(_)), "{err}");
    let report = engine.store().verify()?;
    assert_eq!(report.runs, 0, "nothing was written");
    Ok(())
}

/// An input whose own `Deserialize` panics on 13: user code the shard runs
/// when it checks a start's input.
struct Picky(u32);

impl serde::Serialize for Picky {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Picky {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u32::deserialize(d)?;
        assert!(n != 13, "thirteen is unlucky");
        Ok(Picky(n))
    }
}

struct PickyEcho;
impl Workflow for PickyEcho {
    const NAME: &'static str = "picky-echo";
    type Input = Picky;
    type Output = u32;
    async fn run(_ctx: WorkflowContext, input: Picky) -> Result<u32, WorkflowError> {
        Ok(input.0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_whose_decoding_panics_is_refused_and_its_shard_lives_on() -> anyhow::Result<()> {
    // One shard, so the start after the refused one meets the same shard.
    let engine = Engine::builder()
        .in_memory()
        .shards(1)
        .register_workflow::<PickyEcho>()
        .build()?;
    let client = engine.client();
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        client.start::<PickyEcho>("unlucky", &Picky(13)),
    )
    .await?
    .unwrap_err();
    match &refused {
        EngineError::InvalidInput { detail, .. } => {
            assert!(detail.contains("thirteen is unlucky"), "{refused}")
        }
        other => panic!("expected InvalidInput, got {other}"),
    }
    client.start::<PickyEcho>("lucky", &Picky(7)).await?;
    let out = tokio::time::timeout(Duration::from_secs(10), client.result::<PickyEcho>("lucky"))
        .await??;
    assert_eq!(out, 7);
    assert_eq!(engine.store().verify()?.runs, 1, "only the lucky run");
    Ok(())
}

/// Version 2 of `order` issues a different first command: incompatible.
struct OrderWorkflowV2;
impl Workflow for OrderWorkflowV2 {
    const NAME: &'static str = "order";
    type Input = Order;
    type Output = Receipt;
    async fn run(ctx: WorkflowContext, order: Order) -> Result<Receipt, WorkflowError> {
        let shipment = ctx.activity::<Ship>(order.item).await?;
        Ok(Receipt {
            charge: String::new(),
            approved_by: None,
            shipment,
        })
    }
}

/// An engine on `dir` running the changed order workflow.
fn engine_v2_in(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<OrderWorkflowV2>()
        .register_activity::<Charge>()
        .register_activity::<Ship>()
        .build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incompatible_code_change_parks_the_run() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    {
        let engine = engine_in(dir.path());
        let client = engine.client();
        client
            .start::<OrderWorkflow>(
                "o-park",
                &Order {
                    cents: 5000,
                    item: "car".into(),
                },
            )
            .await?;
        for _ in 0..200 {
            if !client.describe("o-park").await?.signal_waits.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        engine.shutdown_blocking();
    }
    let engine = engine_v2_in(dir.path())?;
    let client = engine.client();
    let err = client
        .signal("o-park", "approve", &"ops", None)
        .await
        .unwrap_err();
    let EngineError::Parked { reason, .. } = err else {
        panic!("expected parked, got {err}")
    };
    assert!(reason.contains("step 1"), "{reason}");
    assert!(reason.contains("schedule activity charge"), "{reason}");
    assert!(reason.contains("schedule activity ship"), "{reason}");
    let d = client.describe("o-park").await?;
    assert_eq!(d.status, keel::RunStatus::Running, "parked, not failed");
    let marked = d.parked.clone().expect("parked");
    assert_eq!(marked.kind, "non_determinism");
    engine.shutdown_blocking();
    // Not in memory after a restart: a parked run is described from the
    // store, not replayed (which would park it again and move its marker).
    let engine = engine_v2_in(dir.path())?;
    let client = engine.client();
    tokio::time::sleep(Duration::from_millis(20)).await;
    for _ in 0..2 {
        let d = client.describe("o-park").await?;
        assert_eq!(d.parked.as_ref(), Some(&marked), "the marker is the same");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activities_run_at_least_once_and_commit_once() -> anyhow::Result<()> {
    // Many concurrent workflows: each execution has exactly one completion.
    let engine = Engine::builder()
        .in_memory()
        .register_workflow::<OrderWorkflow>()
        .register_activity::<Charge>()
        .register_activity::<Ship>()
        .build()?;
    let client = Arc::new(engine.client());
    let mut handles = Vec::new();
    for i in 0..50 {
        let c = client.clone();
        handles.push(tokio::spawn(async move {
            let id = format!("bulk-{i}");
            c.start::<OrderWorkflow>(
                &id,
                &Order {
                    cents: 10,
                    item: format!("i{i}"),
                },
            )
            .await?;
            c.result::<OrderWorkflow>(&id).await
        }));
    }
    for h in handles {
        h.await??;
    }
    let report = engine.store().verify()?;
    assert!(report.ok, "{:?}", report.violations);
    assert_eq!(report.runs, 50);
    Ok(())
}

/// Waits for signals `a` and `b` and returns their sum.
struct TwoSignals;
impl Workflow for TwoSignals {
    const NAME: &'static str = "two-signals";
    type Input = ();
    type Output = u32;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u32, WorkflowError> {
        let a: u32 = ctx.wait_signal("a").await?;
        let b: u32 = ctx.wait_signal("b").await?;
        Ok(a + b)
    }
}

/// An in-memory store that counts the reads of instance records and, when
/// armed, panics on as many of its next commits that write something (a
/// broken store, or a broken invariant on the shard's thread), or holds
/// them unanswered until released (a hung disk).
pub(crate) struct CountingStore {
    inner: Arc<MemStore>,
    instance_reads: AtomicU32,
    pub(crate) panics: AtomicU32,
    hold: std::sync::atomic::AtomicBool,
    held: std::sync::Mutex<Vec<(CommitBatch, keel::storage::Reply)>>,
}

impl CountingStore {
    /// Writes and answers the commits held, in order, and holds no more.
    fn release(&self) {
        self.hold.store(false, SeqCst);
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        for (batch, reply) in held {
            reply.send(self.inner.commit(batch).wait());
        }
    }

    pub(crate) fn new() -> Self {
        CountingStore {
            inner: Arc::new(MemStore::new(keel::Durability::Sync)),
            instance_reads: AtomicU32::new(0),
            panics: AtomicU32::new(0),
            hold: std::sync::atomic::AtomicBool::new(false),
            held: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl KvRead for CountingStore {
    fn get(&self, cf: Cf, key: &[u8]) -> keel::storage::Result<Option<Vec<u8>>> {
        if cf == Cf::Instances {
            self.instance_reads.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.view().get(cf, key)
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> keel::storage::Result<()> {
        self.inner.view().scan(cf, prefix, from, visit)
    }
}

impl Store for CountingStore {
    fn view(&self) -> &dyn KvRead {
        self
    }
    fn commit(&self, batch: CommitBatch) -> CommitHandle {
        let armed = |n: u32| n.checked_sub(1);
        if !batch.appends.is_empty() && self.panics.fetch_update(SeqCst, SeqCst, armed).is_ok() {
            panic!("a store that panics on commit (test)");
        }
        let mut held = self.held.lock().unwrap();
        if !batch.appends.is_empty() && (self.hold.load(SeqCst) || !held.is_empty()) {
            let (reply, handle) = CommitHandle::channel();
            held.push((batch, reply));
            return handle;
        }
        self.inner.commit(batch)
    }
    fn sync(&self) -> keel::storage::Result<()> {
        self.inner.sync()
    }
    fn durability(&self) -> keel::Durability {
        self.inner.durability()
    }
}

/// Asks `ready` every 20 ms until it says yes; fails the test, naming
/// `what` it waited for, after `limit`.
async fn wait_until<F, R>(limit: Duration, what: &str, mut ready: F)
where
    F: FnMut() -> R,
    R: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !ready().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {limit:?} for this: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// Goal: a request naming an instance whose run is open in the engine's
// memory reaches that run without reading the store, and once the run has
// closed the store decides again (and answers correctly).
// Method: an engine on a store that counts instance-record reads; signal
// and describe a waiting run by its instance name, then ask for the
// closed run's result; then the same for a run replayed after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_instance_is_resolved_without_reading_the_store() -> anyhow::Result<()> {
    let store = Arc::new(CountingStore::new());
    let engine = Engine::builder()
        .store(store.clone())
        .register_workflow::<TwoSignals>()
        .build()?;
    let client = engine.client();
    client.start::<TwoSignals>("sum", &()).await?;
    let before = store.instance_reads.load(Ordering::SeqCst);
    client.signal("sum", "a", &2u32, None).await?;
    let described = client.describe("sum").await?;
    assert_eq!(described.status, keel::RunStatus::Running);
    assert_eq!(
        store.instance_reads.load(Ordering::SeqCst),
        before,
        "the open run was found in memory"
    );
    // Closed: the store resolves the name, and the outcome is the same.
    client.signal("sum", "b", &3u32, None).await?;
    assert_eq!(client.result::<TwoSignals>("sum").await?, 5);
    assert!(store.instance_reads.load(Ordering::SeqCst) > before);

    // After a restart the first request reads, the run is replayed open,
    // and the next requests find it in memory again.
    client.start::<TwoSignals>("later", &()).await?;
    engine.shutdown().await;
    let engine = Engine::builder()
        .store(store.clone())
        .register_workflow::<TwoSignals>()
        .build()?;
    let client = engine.client();
    client.signal("later", "a", &4u32, None).await?;
    let after_replay = store.instance_reads.load(Ordering::SeqCst);
    client.describe("later").await?;
    client.signal("later", "b", &5u32, None).await?;
    assert_eq!(store.instance_reads.load(Ordering::SeqCst), after_replay);
    assert_eq!(client.result::<TwoSignals>("later").await?, 9);
    engine.shutdown().await;
    Ok(())
}

// Goal: a panic on a shard's thread does not leave the calls that shard
// had taken waiting for ever, and does not leave the shard's runs without
// a shard: the engine starts it again, and its runs go on; a shard that
// keeps panicking stays down (listed as such) instead of looping, and the
// engine still shuts down. Method: one shard; a caller waits for a run's
// result; the store is armed to panic on the next commit, which the signal
// sent next makes on the shard's thread. The signal's and the result's
// calls must end within seconds, and the run must then take its signals
// and complete. Then the store panics on every commit: the shard is
// started again at most `SHARD_RESTARTS_MAX` times, and is then listed
// down, with calls to it failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_shard_leaves_no_call_waiting_and_starts_again() -> anyhow::Result<()> {
    let store = Arc::new(CountingStore::new());
    let engine = Engine::builder()
        .store(store.clone())
        .shards(1)
        .register_workflow::<TwoSignals>()
        .build()?;
    let client = engine.client();
    client.start::<TwoSignals>("doomed", &()).await?;
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move { client.result::<TwoSignals>("doomed").await })
    };
    // The result call is taken by the shard before the panic.
    client.describe("doomed").await?;
    store.panics.store(1, SeqCst);
    let limit = Duration::from_secs(20);
    let signalled = tokio::time::timeout(limit, client.signal("doomed", "a", &1u32, None))
        .await
        .expect("the signal's call ended");
    // The shard starts again after a short wait.
    let c = &client;
    wait_until(limit, "the shard starts again", move || async move {
        c.describe("doomed").await.is_ok()
    })
    .await;
    assert_eq!(engine.shards_down(), Vec::new(), "started again");
    if signalled.is_err() {
        // Its commit panicked, and its tries ran out before the restart.
        client.signal("doomed", "a", &1u32, None).await?;
    }
    client.signal("doomed", "b", &2u32, None).await?;
    assert_eq!(client.result::<TwoSignals>("doomed").await?, 3);
    let waited = tokio::time::timeout(limit, waiting)
        .await
        .expect("the waiting result's call ended")?;
    if let Ok(sum) = waited {
        assert_eq!(sum, 3, "the result it waited for");
    }

    // A shard that panics whenever it commits.
    store.panics.store(u32::MAX, SeqCst);
    let e = &engine;
    wait_until(
        Duration::from_secs(60),
        "the shard is given up",
        move || async move {
            c.start::<TwoSignals>("again", &()).await.ok();
            !e.shards_down().is_empty()
        },
    )
    .await;
    assert_eq!(engine.shards_down(), vec![keel::driver::ShardId(0)]);
    let described = tokio::time::timeout(limit, client.describe("doomed"))
        .await
        .expect("a call to the shard that is down ended");
    assert!(described.is_err(), "{described:?}");
    tokio::time::timeout(limit, engine.shutdown())
        .await
        .expect("the engine shut down");
    Ok(())
}

// Goal: a store that takes a commit and answers nothing (a hung disk, a
// database that holds the connection) shows in the engine's health once a
// commit has waited `commit_stall_ms`, and a call waiting on that shard's
// progress is told the store is unavailable instead of hanging; once the
// commit is answered the engine is healthy again and the run goes on.
// Method: one shard, a 300 ms limit; the store holds the commit of a
// signal; the engine's health must turn `Stopped` with `Stalled`, and a
// client waiting for the run's result must be answered; the commits are
// then released, health must turn healthy, and the run take its signals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_hangs_shows_in_health_until_it_is_answered() -> anyhow::Result<()> {
    let store = Arc::new(CountingStore::new());
    let engine = Engine::builder()
        .store(store.clone())
        .config(keel::EngineConfig {
            shards: 1,
            commit_stall_ms: 300,
            ..keel::EngineConfig::default()
        })
        .register_workflow::<TwoSignals>()
        .build()?;
    let client = engine.client();
    client.start::<TwoSignals>("stuck", &()).await?;
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move { client.result::<TwoSignals>("stuck").await })
    };
    client.describe("stuck").await?;
    store.hold.store(true, SeqCst);
    let signal = {
        let client = client.clone();
        tokio::spawn(async move { client.signal("stuck", "a", &1u32, None).await })
    };
    let stalled = |h: &keel::StoreHealth| {
        matches!(
            h,
            keel::StoreHealth::Stopped {
                fault: keel::storage::WriteFault::Stalled,
                ..
            }
        )
    };
    let limit = Duration::from_secs(20);
    let e = &engine;
    wait_until(limit, "the health says stalled", move || async move {
        stalled(&e.health())
    })
    .await;
    let waited = tokio::time::timeout(limit, waiting)
        .await
        .expect("the waiting result's call was answered")?;
    assert!(
        matches!(waited, Err(EngineError::StoreUnavailable(_))),
        "{waited:?}"
    );

    store.release();
    wait_until(limit, "the health is healthy again", move || async move {
        e.health().is_healthy()
    })
    .await;
    let signalled = tokio::time::timeout(limit, signal)
        .await
        .expect("the signal's call ended")?;
    if signalled.is_err() {
        client.signal("stuck", "a", &1u32, None).await?;
    }
    client.signal("stuck", "b", &2u32, None).await?;
    assert_eq!(client.result::<TwoSignals>("stuck").await?, 3);
    engine.shutdown().await;
    Ok(())
}

// Goal: an engine on a Sync RocksDB store primes its write-ahead logs at
// open by default, so its first commits write over a recycled file, and
// `EngineConfig::prime_logs = false` leaves the logs as RocksDB made them.
// Method: build an engine over a fresh directory each way and look at the
// newest log file: primed, it is already as long as a primed log (an
// earlier log's file, renamed); not primed, it is the open's new log,
// holding next to nothing. Either way a workflow then runs to its result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_primes_its_logs_at_open_unless_told_not_to() -> anyhow::Result<()> {
    use keel::storage::rocks::PRIMED_LOG_BYTES;
    assert!(keel::EngineConfig::default().prime_logs, "on by default");
    for prime_logs in [true, false] {
        let dir = tempfile::tempdir()?;
        let engine = Engine::builder()
            .data_dir(dir.path())
            .config(keel::EngineConfig {
                prime_logs,
                ..keel::EngineConfig::default()
            })
            .register_workflow::<OrderWorkflow>()
            .register_activity::<Charge>()
            .register_activity::<Ship>()
            .build()?;
        let newest = keel::storage::wal::log_files(dir.path())?
            .pop()
            .expect("a write-ahead log");
        let bytes = std::fs::metadata(&newest)?.len();
        assert_eq!(
            bytes >= PRIMED_LOG_BYTES as u64,
            prime_logs,
            "prime_logs = {prime_logs}: {} holds {bytes} bytes",
            newest.display()
        );
        let client = engine.client();
        let order = Order {
            cents: 500,
            item: "lamp".into(),
        };
        let instance = format!("o-primed-{prime_logs}");
        client.start::<OrderWorkflow>(&instance, &order).await?;
        let receipt = client.result::<OrderWorkflow>(&instance).await?;
        assert_eq!(receipt.shipment, "shipped lamp");
        engine.shutdown().await;
    }
    Ok(())
}
