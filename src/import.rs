//! The scope seed's import, as a durable workflow: a producer reads a CSV
//! into a bounded channel, ten worker coroutines check each address with an
//! activity, a progress coroutine reports through the run's memo, and the
//! whole group is awaited with a deadline. Fail-together (one bad address
//! aborts the import) or with an error handler (bad addresses are counted,
//! a replacement worker is started, the rest are checked).

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use keel::{
    Activity, ActivityContext, ActivityError, Failure, Receiver, ScopeError, ScopeRef, Workflow,
    WorkflowContext, WorkflowError,
};
use serde::{Deserialize, Serialize};

/// Rows read per `ReadRows` call.
pub const CHUNK_ROWS: u64 = 500;
/// Capacity of the channel between the producer and the workers.
pub const CHANNEL_CAPACITY: usize = 100;

/// Reads a chunk of the CSV's `address` column.
#[derive(Default, Debug)]
pub struct ReadRows;

/// Which rows to read.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct RowRange {
    /// The CSV file.
    pub path: String,
    /// First data row (after the header).
    pub offset: u64,
    /// How many rows.
    pub limit: u64,
}

impl Activity for ReadRows {
    const NAME: &'static str = "import.read_rows";
    type Input = RowRange;
    type Output = Vec<String>;
    async fn run(&self, _ctx: ActivityContext, r: RowRange) -> Result<Vec<String>, ActivityError> {
        let text = std::fs::read_to_string(&r.path).map_err(ActivityError::retryable)?;
        let mut lines = text.lines();
        let header = lines
            .next()
            .ok_or_else(|| ActivityError::fatal("empty file"))?;
        let column = header
            .split(',')
            .position(|c| c.trim() == "address")
            .ok_or_else(|| ActivityError::fatal("no address column"))?;
        Ok(lines
            .skip(r.offset as usize)
            .take(r.limit as usize)
            .map(|l| l.split(',').nth(column).unwrap_or("").to_string())
            .collect())
    }
}

/// Calls of `CheckAddress` per address in this process (for tests).
pub fn check_calls() -> &'static Mutex<HashMap<String, u32>> {
    static CALLS: OnceLock<Mutex<HashMap<String, u32>>> = OnceLock::new();
    CALLS.get_or_init(Default::default)
}

/// Total `CheckAddress` calls in this process.
pub static CHECKS: AtomicU64 = AtomicU64::new(0);

/// How long each `CheckAddress` call takes, in ms (a remote API's latency;
/// tests raise it so a restart can land mid-import).
pub static CHECK_DELAY_MS: AtomicU64 = AtomicU64::new(0);

/// Checks one address; addresses containing `INVALID` fail for good.
#[derive(Default, Debug)]
pub struct CheckAddress;
impl Activity for CheckAddress {
    const NAME: &'static str = "import.check_address";
    type Input = String;
    type Output = bool;
    async fn run(&self, _ctx: ActivityContext, address: String) -> Result<bool, ActivityError> {
        CHECKS.fetch_add(1, Ordering::Relaxed);
        let delay = CHECK_DELAY_MS.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if let Ok(mut m) = check_calls().lock() {
            *m.entry(address.clone()).or_default() += 1;
        }
        if address.contains("INVALID") {
            return Err(ActivityError::fatal(format!(
                "address {address:?} does not exist"
            )));
        }
        Ok(true)
    }
}

/// The import's parameters.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct ImportInput {
    /// The CSV file.
    pub path: String,
    /// Rows in it.
    pub total: u64,
    /// Worker coroutines.
    pub workers: u32,
    /// Count bad addresses and go on, instead of failing together.
    pub log_errors: bool,
    /// The deadline of the whole import, in seconds.
    pub deadline_s: u64,
}

/// What the import did.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ImportReport {
    /// Addresses checked.
    pub checked: u64,
    /// Bad addresses (logged, with the error handler).
    pub bad: u64,
    /// Why the import stopped early, if it did.
    pub aborted: Option<String>,
}

fn spawn_worker(
    scope: &ScopeRef,
    ctx: &WorkflowContext,
    rx: &Receiver<String>,
    checked: &Rc<Cell<u64>>,
) {
    let (ctx, rx, checked) = (ctx.clone(), rx.clone(), checked.clone());
    scope.spawn(async move {
        while let Some(address) = rx.recv().await {
            ctx.activity::<CheckAddress>(address).await?;
            checked.set(checked.get() + 1);
        }
        Ok(())
    });
}

/// The import workflow.
#[derive(Debug)]
pub struct ImportWorkflow;
impl Workflow for ImportWorkflow {
    const NAME: &'static str = "import.addresses";
    type Input = ImportInput;
    type Output = ImportReport;
    async fn run(ctx: WorkflowContext, input: ImportInput) -> Result<ImportReport, WorkflowError> {
        let scope = ctx.scope();
        let checked = Rc::new(Cell::new(0u64));
        let bad = Rc::new(Cell::new(0u64));
        let (tx, rx) = ctx.channel::<String>(CHANNEL_CAPACITY);
        if input.log_errors {
            let (ctx2, rx2, checked2, bad2) =
                (ctx.clone(), rx.clone(), checked.clone(), bad.clone());
            scope.on_error(move |scope: &ScopeRef, _who, failure: Failure| {
                tracing::warn!(error = %failure, "address not checked");
                bad2.set(bad2.get() + 1);
                spawn_worker(scope, &ctx2, &rx2, &checked2);
            });
        }
        for _ in 0..input.workers {
            spawn_worker(&scope, &ctx, &rx, &checked);
        }
        drop(rx);
        // Producer: reads the file in chunks; the channel's backpressure
        // keeps at most CHANNEL_CAPACITY addresses in memory.
        let (pctx, path) = (ctx.clone(), input.path.clone());
        scope.spawn(async move {
            let mut offset = 0;
            loop {
                let rows = pctx
                    .activity::<ReadRows>(RowRange {
                        path: path.clone(),
                        offset,
                        limit: CHUNK_ROWS,
                    })
                    .await?;
                if rows.is_empty() {
                    break;
                }
                offset += rows.len() as u64;
                for row in rows {
                    if tx.send(row).await.is_err() {
                        return Ok(());
                    }
                }
            }
            tx.close();
            Ok(())
        });
        // Progress: reported once a second until every row is done.
        let (gctx, gchecked, gbad, total) =
            (ctx.clone(), checked.clone(), bad.clone(), input.total);
        scope.spawn(async move {
            loop {
                let done = gchecked.get() + gbad.get();
                gctx.upsert_memo("progress", &(done, total))?;
                if done >= total {
                    return Ok(());
                }
                gctx.timer(Duration::from_secs(1)).await;
            }
        });
        let aborted = match scope
            .await_completion(ctx.timer(Duration::from_secs(input.deadline_s)))
            .await
        {
            Ok(()) => None,
            Err(ScopeError::Failed(f)) => Some(format!("import aborted: {}", f.message)),
            Err(ScopeError::Cancelled) => {
                scope.cancel();
                Some("import aborted: deadline passed".to_string())
            }
        };
        Ok(ImportReport {
            checked: checked.get(),
            bad: bad.get(),
            aborted,
        })
    }
}

/// Writes a CSV of `rows` users; rows whose index is in `bad` get an
/// invalid address.
pub fn write_csv(path: &std::path::Path, rows: u64, bad: &[u64]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(f, "id,name,address")?;
    for i in 0..rows {
        let address = if bad.contains(&i) {
            format!("INVALID {i}")
        } else {
            format!("{} Main Street", i + 1)
        };
        writeln!(f, "{i},user {i},{address}")?;
    }
    f.flush()
}
