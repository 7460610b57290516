//! Goal: operators find workflows by business key (issue "The rest of the
//! workflow surface", item 4, and the memo and search attributes item 6
//! carries): search attributes given at start and upserted by workflow
//! code are found by `client.list` as soon as their commit is durable,
//! through a restart, across continue-as-new (which carries them and the
//! memo), page by page; bad names, values and filters are typed errors
//! and write nothing.
//!
//! Method: the real engine on RocksDB. An order workflow starts with
//! `customer` (and a memo), sets `stage` and `amount`, waits for "pay",
//! may continue as new once, then waits for "ship". Three orders are
//! listed by customer, amount, stage and status before and after a
//! restart; `describe` shows the carried attributes and memo.

use std::time::Duration;

use keel::{
    Engine, EngineError, Field, Op, RunFilter, RunStatus, SearchValue, StartOptions, Workflow,
    WorkflowContext, WorkflowError,
};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
struct OrderIn {
    amount: i64,
    continue_after_pay: bool,
}

struct Order;
impl Workflow for Order {
    const NAME: &'static str = "order";
    type Input = OrderIn;
    type Output = String;
    async fn run(ctx: WorkflowContext, input: OrderIn) -> Result<String, WorkflowError> {
        // A reserved name is refused before anything is written.
        let refused = ctx.upsert_search_attribute("status", "mine").is_err();
        let continued = ctx.memo::<bool>("continued").unwrap_or(false);
        if !continued {
            ctx.upsert_search_attributes([
                ("stage", SearchValue::from("placed")),
                ("amount", SearchValue::Int(input.amount)),
            ])?;
            ctx.wait_signal::<()>("pay").await?;
            ctx.upsert_search_attribute("stage", "paid")?;
            if input.continue_after_pay {
                ctx.upsert_memo("continued", &true)?;
                return Err(WorkflowError::continue_as_new(&input));
            }
        }
        ctx.wait_signal::<()>("ship").await?;
        ctx.upsert_search_attributes([("stage", SearchValue::from("shipped"))])?;
        ctx.remove_search_attribute("amount")?;
        let customer = ctx
            .search_attributes()
            .into_iter()
            .find(|(n, _)| n == "customer")
            .map(|(_, v)| v.plain())
            .unwrap_or_default();
        Ok(format!("{customer} refused={refused}"))
    }
}

fn engine(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<Order>()
        .build()?)
}

const WAIT: Duration = Duration::from_secs(10);

/// The instances a filter lists, in the order listed.
async fn listed(engine: &Engine, filter: &str) -> anyhow::Result<Vec<String>> {
    let page = engine
        .client()
        .list(&RunFilter::parse(filter)?, 100, None)
        .await?;
    assert!(page.next.is_none());
    Ok(page
        .runs
        .iter()
        .map(|m| m.instance_id.to_string())
        .collect())
}

/// Waits until `filter` lists `n` runs (an upsert is committed after the
/// signal's commit that wakes the code).
async fn until_listed(engine: &Engine, filter: &str, n: usize) -> anyhow::Result<Vec<String>> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let found = listed(engine, filter).await?;
        if found.len() == n || tokio::time::Instant::now() > deadline {
            return Ok(found);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_are_found_by_search_attributes_across_restarts_and_continue_as_new(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let e = engine(&data)?;
    let c = e.client();
    for (id, customer, amount, cont) in [
        ("o-1", "c-42", 120, false),
        ("o-2", "c-42", 30, false),
        ("o-3", "c-7", 500, true),
    ] {
        let options = StartOptions::new()
            .search_attribute("customer", customer)
            .memo("note", "gift wrap");
        let input = OrderIn {
            amount,
            continue_after_pay: cont,
        };
        c.start_with::<Order>(id, &input, options).await?;
    }
    // Found by the attribute given at start, at once: the start's commit
    // wrote the index entry.
    let mut by_customer = listed(&e, r#"customer = "c-42""#).await?;
    by_customer.sort();
    assert_eq!(by_customer, ["o-1", "o-2"]);
    assert_eq!(until_listed(&e, r#"stage = "placed""#, 3).await?.len(), 3);
    for id in ["o-1", "o-2", "o-3"] {
        c.signal(id, "pay", &(), None).await?;
    }
    assert_eq!(
        until_listed(&e, r#"stage = "paid" and status = running"#, 3)
            .await?
            .len(),
        3
    );
    e.shutdown().await;

    // After a restart, the index is what the commits left.
    let e = engine(&data)?;
    let c = e.client();
    let mut big = listed(&e, "amount >= 100 and status = running").await?;
    big.sort();
    assert_eq!(big, ["o-1", "o-3"], "o-3's next run carries its amount");
    assert_eq!(
        listed(&e, "status = continued-as-new").await?,
        ["o-3"],
        "the closed run of o-3 is listed too"
    );
    let d = c.describe("o-3").await?;
    assert!(
        d.search_attributes
            .contains(&("customer".into(), SearchValue::from("c-7"))),
        "{:?}",
        d.search_attributes
    );
    assert!(
        d.memo
            .iter()
            .any(|(n, v)| n == "note" && v.contains("gift wrap")),
        "{:?}",
        d.memo
    );
    for id in ["o-1", "o-2", "o-3"] {
        c.signal(id, "ship", &(), None).await?;
    }
    for (id, customer) in [("o-1", "c-42"), ("o-2", "c-42"), ("o-3", "c-7")] {
        let out = tokio::time::timeout(WAIT, c.result::<Order>(id)).await??;
        assert_eq!(out, format!("{customer} refused=true"));
    }
    let mut done = listed(&e, r#"customer = "c-42" and status = completed"#).await?;
    done.sort();
    assert_eq!(done, ["o-1", "o-2"]);
    assert!(listed(&e, "amount > 0 and status = completed")
        .await?
        .is_empty());

    // Page by page: every run once, newest first.
    let all = listed(&e, "").await?;
    assert_eq!(all.len(), 4, "three orders and the run o-3 continued");
    let mut paged = Vec::new();
    let mut after = None;
    loop {
        let page = c.list(&RunFilter::all(), 1, after.as_ref()).await?;
        paged.extend(page.runs.iter().map(|m| m.instance_id.to_string()));
        match page.next {
            Some(t) => after = Some(t),
            None => break,
        }
    }
    assert_eq!(paged, all);

    // Bad input is typed and writes nothing.
    let bad = RunFilter::all().and(Field::Status, Op::Lt, "running");
    match c.list(&bad, 10, None).await {
        Err(EngineError::BadFilter(why)) => assert!(why.contains("= or !="), "{why}"),
        other => panic!("a status compared with < must be refused, got {other:?}"),
    }
    let options = StartOptions::new().search_attribute("type", "x");
    let input = OrderIn {
        amount: 1,
        continue_after_pay: false,
    };
    match c.start_with::<Order>("o-bad", &input, options).await {
        Err(EngineError::Metadata(e)) => assert!(e.to_string().contains("run field"), "{e}"),
        other => panic!("a reserved attribute name must be refused, got {other:?}"),
    }
    assert!(listed(&e, r#"instance = "o-bad""#).await?.is_empty());
    let store = e.store();
    assert!(store.verify()?.ok);
    assert_eq!(
        store
            .runs(&RunFilter::all().status(RunStatus::Completed))?
            .len(),
        3
    );
    e.shutdown().await;
    Ok(())
}
