//! Goal: message streams on the real engine (issue "The rest of the
//! workflow surface", item 8, and the message cursor of item 6): messages
//! sent with an idempotency key are committed once, read in offset order
//! through a cursor that survives restarts and continue-as-new, and a
//! repeated send answers with the first offset; bad messages and a full
//! stream are typed errors that write nothing.
//!
//! Method: a reader takes three messages per run and continues as new
//! until it has read nine. Five messages are sent (one twice) before a
//! restart, the rest after it, with a retry of a message the first run
//! committed reaching the second run. The result lists what the reader got,
//! and the chain's histories, read from the store, must hold each key
//! exactly once at offsets 0..9. A second workflow never reads, to fill its
//! stream to `STREAM_BACKLOG_MAX`.

use std::time::Duration;

use keel::storage::{EventKind, STREAM_BACKLOG_MAX};
use keel::{Engine, EngineError, Workflow, WorkflowContext, WorkflowError};

struct Reader;
impl Workflow for Reader {
    const NAME: &'static str = "reader";
    /// What earlier runs read: (offset, value) pairs.
    type Input = Vec<(u64, u64)>;
    type Output = Vec<(u64, u64)>;
    async fn run(
        ctx: WorkflowContext,
        mut read: Vec<(u64, u64)>,
    ) -> Result<Vec<(u64, u64)>, WorkflowError> {
        let orders = ctx.stream::<u64>("orders");
        assert_eq!(orders.cursor(), read.len() as u64, "the cursor was carried");
        for _ in 0..3 {
            let m = orders.next().await?;
            read.push((m.offset, m.value));
        }
        if read.len() >= 9 {
            return Ok(read);
        }
        Err(WorkflowError::continue_as_new(&read))
    }
}

/// Never reads its stream; finishes on a signal.
struct Idle;
impl Workflow for Idle {
    const NAME: &'static str = "idle";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        // A query must not move a cursor: this one tries.
        let probe = ctx.clone();
        ctx.on_query("peek", move |_: ()| {
            probe
                .stream::<usize>("s")
                .try_next()
                .map(|m| m.map(|m| m.offset).ok())
        });
        let _: () = ctx.wait_signal("stop").await?;
        Ok(())
    }
}

/// Sends nine messages to the instance named by its input, from workflow
/// code: four, then (after the signal "more") the rest with a repeat of
/// the first key and a signal to the reader's instance before the last;
/// then a send to an instance that does not exist. Returns the offsets it was
/// answered and whether the last send failed.
struct Producer;
impl Workflow for Producer {
    const NAME: &'static str = "producer";
    type Input = String;
    type Output = (Vec<u64>, bool);
    async fn run(ctx: WorkflowContext, target: String) -> Result<(Vec<u64>, bool), WorkflowError> {
        let mut offsets = Vec::new();
        let keys = (0..4).chain([0]).chain(4..8).map(|i| format!("order-{i}"));
        for (n, key) in keys.enumerate() {
            if n == 4 {
                let _: () = ctx.wait_signal("more").await?;
            }
            let value = 100 + key[6..].parse::<u64>().expect("numbered");
            let offset = ctx.send_message(&target, "orders", &key, &value).await?;
            offsets.push(offset.expect("a message has an offset"));
        }
        // Before the last message: the reader closes once it has nine.
        ctx.signal_workflow(&target, "hello", &"from the producer")
            .await?;
        let last = ctx.send_message(&target, "orders", "order-8", &108u64);
        offsets.push(last.await?.expect("a message has an offset"));
        let lost = ctx.send_message("ghost", "orders", "x", &0u64).await;
        Ok((offsets, lost.is_err()))
    }
}

fn engine(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<Reader>()
        .register_workflow::<Idle>()
        .register_workflow::<Producer>()
        .build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_sends_messages_and_signals_to_another_across_a_restart() -> anyhow::Result<()> {
    // Goal: sends from workflow code (item 8 "from another workflow", item
    // 9 "signal another workflow"): delivered through the outbox, each
    // committed once by the target, answered with its offset, surviving an
    // engine restart between sends; a send to an unknown instance fails.
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    {
        let e = engine(&data)?;
        let c = e.client();
        c.start::<Reader>("r", &Vec::new()).await?;
        c.start::<Producer>("p", &"r".to_string()).await?;
        let deadline = tokio::time::Instant::now() + WAIT;
        while !c
            .describe("p")
            .await?
            .signal_waits
            .iter()
            .any(|(n, _)| n == "more")
        {
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "never waited");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        e.shutdown().await;
    }
    let e = engine(&data)?;
    let c = e.client();
    c.signal("p", "more", &(), None).await?;
    let (offsets, lost) = tokio::time::timeout(WAIT, c.result::<Producer>("p")).await??;
    assert_eq!(offsets, vec![0, 1, 2, 3, 0, 4, 5, 6, 7, 8]);
    assert!(lost, "a send to an instance that does not exist fails");
    let read = tokio::time::timeout(WAIT, c.result::<Reader>("r")).await??;
    assert_eq!(read, (0..9).map(|i| (i, 100 + i)).collect::<Vec<_>>());
    // The signal is in the reader's chain once.
    let store = e.store();
    let (mut run, mut signals) = (store.resolve("r")?, 0);
    while let Some(r) = run {
        run = None;
        for ev in store.history(r)? {
            match ev.kind {
                EventKind::SignalReceived { name, .. } if name == "hello" => signals += 1,
                EventKind::WorkflowStarted(start) => run = start.continued_from,
                _ => {}
            }
        }
    }
    assert_eq!(
        signals, 1,
        "the signal is committed once in the reader's chain"
    );
    assert!(
        e.store().outbox(usize::MAX)?.is_empty(),
        "every delivery's row was consumed"
    );
    e.shutdown().await;
    Ok(())
}

const WAIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_read_in_order_once_across_restarts_and_continue_as_new() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let key = |i: u64| format!("order-{i}");
    {
        let e = engine(&data)?;
        let c = e.client();
        c.start::<Reader>("r", &Vec::new()).await?;
        for i in 0..5u64 {
            let sent = c.send_message("r", "orders", &key(i), &(100 + i)).await?;
            assert_eq!((sent.offset, sent.first), (i, true));
        }
        // A client that lost the answer sends again: the first offset.
        let again = c.send_message("r", "orders", &key(1), &101u64).await?;
        assert_eq!((again.offset, again.first), (1, false));
        e.shutdown().await;
    }
    let e = engine(&data)?;
    let c = e.client();
    // The first run read three and continued as new carrying two unread;
    // a retry of one it committed still answers with its offset.
    let again = c.send_message("r", "orders", &key(0), &100u64).await?;
    assert_eq!((again.offset, again.first), (0, false));
    for i in 5..9u64 {
        let sent = c.send_message("r", "orders", &key(i), &(100 + i)).await?;
        assert_eq!((sent.offset, sent.first), (i, true));
    }
    let read = tokio::time::timeout(WAIT, c.result::<Reader>("r")).await??;
    assert_eq!(
        read,
        (0..9).map(|i| (i, 100 + i)).collect::<Vec<_>>(),
        "every message read once, in offset order"
    );

    // The chain's histories hold each key once, at offsets 0..9 in order.
    let store = e.store();
    let mut run = store.resolve("r")?;
    let (mut runs, mut chain) = (Vec::new(), Vec::new());
    while let Some(r) = run {
        runs.push(r);
        run = match store.history(r)?.first().map(|e| e.kind.clone()) {
            Some(EventKind::WorkflowStarted(start)) => start.continued_from,
            _ => None,
        };
    }
    for r in runs.iter().rev() {
        for ev in store.history(*r)? {
            if let EventKind::MessageReceived { offset, key, .. } = ev.kind {
                chain.push((offset, key.to_string()));
            }
        }
    }
    assert_eq!(runs.len(), 3, "three runs of three messages");
    assert_eq!(chain, (0..9).map(|i| (i, key(i))).collect::<Vec<_>>());
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_and_a_full_stream_are_refused_with_nothing_written() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let e = engine(&dir.path().join("data"))?;
    let c = e.client();
    let run = c.start::<Idle>("idle", &()).await?.run_id();
    let len = || -> anyhow::Result<usize> { Ok(e.store().history(run)?.len()) };
    let before = len()?;
    match c.send_message("idle", "", "k", &1u64).await {
        Err(EngineError::BadMessage(why)) => assert!(why.contains("stream name"), "{why}"),
        other => panic!("an empty stream name is refused: {other:?}"),
    }
    let long = "k".repeat(keel::storage::MESSAGE_KEY_BYTES_MAX + 1);
    match c.send_message("idle", "s", &long, &1u64).await {
        Err(EngineError::BadMessage(why)) => assert!(why.contains("message key"), "{why}"),
        other => panic!("an oversized key is refused: {other:?}"),
    }
    assert_eq!(len()?, before, "nothing written for bad messages");

    // Fill the stream (the workflow never reads it), eight senders at once.
    let mut sends = Vec::new();
    for w in 0..8 {
        let c = c.clone();
        sends.push(tokio::spawn(async move {
            let mut offsets = Vec::new();
            for i in (w..STREAM_BACKLOG_MAX).step_by(8) {
                let sent = c.send_message("idle", "s", &format!("m-{i}"), &i).await?;
                offsets.push((i, sent.offset));
            }
            anyhow::Ok(offsets)
        }));
    }
    let mut offsets = std::collections::BTreeMap::new();
    for s in sends {
        offsets.extend(s.await??);
    }
    let mut distinct: Vec<u64> = offsets.values().copied().collect();
    distinct.sort();
    assert_eq!(distinct, (0..STREAM_BACKLOG_MAX as u64).collect::<Vec<_>>());
    let full = len()?;
    assert_eq!(full, before + STREAM_BACKLOG_MAX);
    match c.send_message("idle", "s", "one-more", &0usize).await {
        Err(EngineError::StreamFull { detail, .. }) => {
            assert!(detail.contains("STREAM_BACKLOG_MAX"), "{detail}")
        }
        other => panic!("a full stream refuses the next message: {other:?}"),
    }
    // A repeat of a committed message is still answered: it adds nothing.
    let again = c.send_message("idle", "s", "m-7", &7usize).await?;
    assert_eq!((again.offset, again.first), (offsets[&7], false));
    assert_eq!(
        len()?,
        full,
        "nothing written for refused or repeated sends"
    );

    // A query that tries to read the stream fails and takes nothing.
    match c.query::<_, Option<Option<u64>>>("idle", "peek", &()).await {
        Err(EngineError::Handler(e)) => assert!(e.to_string().contains("peek"), "{e}"),
        other => panic!("a query that reads a stream fails: {other:?}"),
    }
    let d = c.describe("idle").await?;
    let s = d.streams.iter().find(|s| s.name == "s").expect("listed");
    assert_eq!(
        (s.next_offset, s.cursor),
        (STREAM_BACKLOG_MAX as u64, 0),
        "all committed, none read"
    );
    c.signal("idle", "stop", &(), None).await?;
    tokio::time::timeout(WAIT, c.outcome("idle")).await??;
    e.shutdown().await;
    Ok(())
}
