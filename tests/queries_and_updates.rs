//! Goal: clients read a workflow's state with queries and change it with
//! validated updates (issue "The rest of the workflow surface", items 1
//! and 2): a query writes nothing and is answered for open, passivated
//! (restarted) and closed runs; a validator's rejection writes nothing; an
//! accepted update's handler may wait on durable things, and a client
//! repeating an update by id gets the first outcome, also across a restart
//! that happened between its acceptance and its completion, and after the
//! run closed and left memory (answered from the durable ids it committed,
//! not by replaying it). Bad input is a typed error naming what was wrong.
//!
//! Method: the real engine on RocksDB. A cart workflow keeps its items in
//! an `Rc<RefCell<..>>`, answers the query "items", accepts the update
//! "add" (validated: not empty, not already there) and the update
//! "reserve" (whose handler waits for the signal "confirm"), and returns
//! its items on the signal "checkout". History lengths come from
//! `describe`, so "writes nothing" is checked on the committed log.

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

use keel::{Engine, EngineError, HandlerError, Workflow, WorkflowContext, WorkflowError};

struct Cart;
impl Workflow for Cart {
    const NAME: &'static str = "cart";
    type Input = ();
    type Output = Vec<String>;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<Vec<String>, WorkflowError> {
        let items = Rc::new(RefCell::new(Vec::<String>::new()));
        let view = items.clone();
        ctx.on_query("items", move |_: ()| view.borrow().clone());
        let probe = ctx.clone();
        // A query that tries to write: refused, nothing changes.
        ctx.on_query("draw", move |_: ()| probe.random());
        let (check, add) = (items.clone(), items.clone());
        ctx.on_update(
            "add",
            move |item: &String| {
                if item.is_empty() {
                    return Err("an item needs a name".into());
                }
                if check.borrow().contains(item) {
                    return Err(format!("{item} is already in the cart"));
                }
                Ok(())
            },
            move |item: String| {
                let add = add.clone();
                async move {
                    add.borrow_mut().push(item);
                    Ok(add.borrow().len())
                }
            },
        );
        let (confirm_ctx, reserved) = (ctx.clone(), items.clone());
        ctx.on_update(
            "reserve",
            |_: &String| Ok(()),
            move |item: String| {
                let (ctx, reserved) = (confirm_ctx.clone(), reserved.clone());
                async move {
                    let ok: bool = ctx.wait_signal("confirm").await?;
                    if !ok {
                        return Err(WorkflowError::msg(format!("{item} was not confirmed")));
                    }
                    reserved.borrow_mut().push(format!("reserved:{item}"));
                    Ok(format!("reserved {item}"))
                }
            },
        );
        let _: () = ctx.wait_signal("checkout").await?;
        let out = items.borrow().clone();
        Ok(out)
    }
}

fn engine(dir: &Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<Cart>()
        .build()?)
}

const WAIT: Duration = Duration::from_secs(10);

async fn history_len(engine: &Engine, id: &str) -> anyhow::Result<u64> {
    Ok(engine.client().describe(id).await?.history_len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_read_and_updates_change_state_without_stray_writes() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let e = engine(&data)?;
    let c = e.client();
    c.start::<Cart>("cart-1", &()).await?;
    let items: Vec<String> = c.query("cart-1", "items", &()).await?;
    assert!(items.is_empty());

    let n: usize = c
        .update("cart-1", "add", &"apple", Some("add-apple"))
        .await?;
    assert_eq!(n, 1);
    let items: Vec<String> = c.query("cart-1", "items", &()).await?;
    assert_eq!(items, ["apple"]);
    let len = history_len(&e, "cart-1").await?;

    // Repeated by id: the first outcome, nothing written.
    let again: usize = c
        .update("cart-1", "add", &"apple", Some("add-apple"))
        .await?;
    assert_eq!(again, 1);
    assert_eq!(history_len(&e, "cart-1").await?, len);

    // Rejections and bad input: typed, nothing written.
    match c.update::<_, usize>("cart-1", "add", &"", None).await {
        Err(EngineError::Handler(HandlerError::Rejected { name, reason })) => {
            assert_eq!(name, "add");
            assert!(reason.contains("needs a name"), "{reason}");
        }
        other => panic!("an empty item must be rejected, got {other:?}"),
    }
    match c.update::<_, usize>("cart-1", "add", &"apple", None).await {
        Err(EngineError::Handler(HandlerError::Rejected { reason, .. })) => {
            assert!(reason.contains("already"), "{reason}")
        }
        other => panic!("a second apple must be rejected, got {other:?}"),
    }
    match c
        .update::<_, usize>("cart-1", "remove", &"apple", None)
        .await
    {
        Err(EngineError::Handler(HandlerError::Unknown { kind, name, known })) => {
            assert_eq!((kind, name.as_str()), ("update", "remove"));
            assert!(
                known.contains("add") && known.contains("reserve"),
                "{known}"
            );
        }
        other => panic!("an unknown update must be refused, got {other:?}"),
    }
    match c.query::<_, Vec<String>>("cart-1", "item", &()).await {
        Err(EngineError::Handler(HandlerError::Unknown { kind: "query", .. })) => {}
        other => panic!("an unknown query must be refused, got {other:?}"),
    }
    match c.update::<_, usize>("cart-1", "add", &42u32, None).await {
        Err(EngineError::Handler(HandlerError::BadArguments { name, .. })) => {
            assert_eq!(name, "add")
        }
        other => panic!("arguments of the wrong type must be refused, got {other:?}"),
    }
    match c.query::<_, u64>("cart-1", "draw", &()).await {
        Err(EngineError::Handler(HandlerError::Failed { detail, .. })) => {
            assert!(detail.contains("read-only"), "{detail}")
        }
        other => panic!("a query that writes must fail, got {other:?}"),
    }
    assert_eq!(history_len(&e, "cart-1").await?, len);
    e.shutdown().await;

    // After a restart the run is rebuilt to answer; the update id still
    // deduplicates.
    let e = engine(&data)?;
    let c = e.client();
    let items: Vec<String> = c.query("cart-1", "items", &()).await?;
    assert_eq!(items, ["apple"]);
    let again: usize = c
        .update("cart-1", "add", &"apple", Some("add-apple"))
        .await?;
    assert_eq!(again, 1);
    let n: usize = c.update("cart-1", "add", &"pear", Some("add-pear")).await?;
    assert_eq!(n, 2);
    assert_eq!(history_len(&e, "cart-1").await?, len + 2);

    // Closed: a query replays the history; an update is refused.
    c.signal("cart-1", "checkout", &(), Some("checkout-1"))
        .await?;
    let out = tokio::time::timeout(WAIT, c.result::<Cart>("cart-1")).await??;
    assert_eq!(out, ["apple", "pear"]);
    let items: Vec<String> = c.query("cart-1", "items", &()).await?;
    assert_eq!(items, ["apple", "pear"]);
    match c.update::<_, usize>("cart-1", "add", &"fig", None).await {
        Err(EngineError::RunClosed { .. }) => {}
        other => panic!("an update to a closed run must be refused, got {other:?}"),
    }
    e.shutdown().await;

    // Closed and no longer in memory: repeats get their first outcomes and
    // new inputs are refused, from the run record and the durable ids it
    // committed, without reading its history to replay it.
    let e = engine(&data)?;
    let c = e.client();
    let again: usize = c
        .update("cart-1", "add", &"apple", Some("add-apple"))
        .await?;
    assert_eq!(again, 1, "the first outcome of update add-apple");
    c.signal("cart-1", "checkout", &(), Some("checkout-1"))
        .await?;
    match c
        .signal("cart-1", "checkout", &(), Some("checkout-2"))
        .await
    {
        Err(EngineError::RunClosed { .. }) => {}
        other => panic!("a new signal to a closed run must be refused, got {other:?}"),
    }
    match c.update::<_, usize>("cart-1", "add", &"fig", None).await {
        Err(EngineError::RunClosed { .. }) => {}
        other => panic!("an update to a closed run must be refused, got {other:?}"),
    }
    let out = c.result::<Cart>("cart-1").await?;
    assert_eq!(out, ["apple", "pear"]);
    assert_eq!(
        e.stats().await.shards.activations,
        0,
        "a closed run is answered without replaying its history"
    );
    e.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_accepted_before_a_restart_completes_once_after_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    {
        let e = engine(&data)?;
        let c = e.client();
        c.start::<Cart>("cart-2", &()).await?;
        // Accepted, then waits for "confirm": the engine stops under it.
        let pending = {
            let c = c.clone();
            tokio::spawn(async move {
                c.update::<_, String>("cart-2", "reserve", &"lamp", Some("reserve-lamp"))
                    .await
            })
        };
        let deadline = tokio::time::Instant::now() + WAIT;
        while history_len(&e, "cart-2").await? < 2 {
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "never accepted");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        e.shutdown().await;
        match pending.await? {
            Err(EngineError::Shutdown) => {}
            other => panic!("the waiting client hears the shutdown, got {other:?}"),
        }
    }
    let e = engine(&data)?;
    let c = e.client();
    let again = {
        let c = c.clone();
        tokio::spawn(async move {
            c.update::<_, String>("cart-2", "reserve", &"lamp", Some("reserve-lamp"))
                .await
        })
    };
    // The repeat waits for the accepted update; the signal completes it.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !again.is_finished(),
        "the update is not complete before the signal"
    );
    c.signal("cart-2", "confirm", &true, None).await?;
    let v = tokio::time::timeout(WAIT, again).await???;
    assert_eq!(v, "reserved lamp");
    let items: Vec<String> = c.query("cart-2", "items", &()).await?;
    assert_eq!(items, ["reserved:lamp"]);
    // Accepted once, completed once: start, accepted, signal, completed.
    assert_eq!(history_len(&e, "cart-2").await?, 4);

    // A handler's failure is committed and returned, also on repeat.
    let failing = {
        let c = c.clone();
        tokio::spawn(async move {
            c.update::<_, String>("cart-2", "reserve", &"sofa", Some("reserve-sofa"))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.signal("cart-2", "confirm", &false, None).await?;
    match tokio::time::timeout(WAIT, failing).await?? {
        Err(EngineError::UpdateFailed(f)) => assert!(f.message.contains("sofa"), "{f}"),
        other => panic!("a failing handler's update fails, got {other:?}"),
    }
    match c
        .update::<_, String>("cart-2", "reserve", &"sofa", Some("reserve-sofa"))
        .await
    {
        Err(EngineError::UpdateFailed(f)) => assert!(f.message.contains("sofa"), "{f}"),
        other => panic!("the repeat gets the recorded failure, got {other:?}"),
    }
    e.shutdown().await;
    Ok(())
}
