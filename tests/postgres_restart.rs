//! Goal: restarting the database under load loses nothing and commits
//! nothing twice. While the server is down the engine says so
//! (`Engine::health()` is `Stopped { Unreachable }`, clients needing a
//! commit are answered at once instead of hanging), and once it is back
//! every workflow completes by itself, with a clean `verify`.
//! Method: a PostgreSQL server of this test's own (scripts/postgres.sh,
//! so the shared server other tests use is not disturbed); 60 workflows
//! of three slow activities each; a few seconds in, the server is stopped
//! for 3 s and started again (`keel_pg_restart`). Clients retry calls the
//! engine answered "unavailable" with the same command id. A second test
//! stops the server for good and expects the engine to shut down anyway;
//! a third cuts the network to a server in a namespace of its own.
//! Runs only where `.ci/run` could start a server (KEEL_TEST_POSTGRES_URL
//! set); a [`Watchdog`] ends the test process if a test here hangs.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::storage::{StoreHealth, WriteFault};
use keel::{
    Activity, ActivityContext, ActivityError, Engine, EngineError, PgOptions, StartOptions,
    Workflow, WorkflowContext, WorkflowError,
};

const WORKFLOWS: u64 = 60;

/// The longest a test here may run before its [`Watchdog`] ends the test
/// process (each normally takes seconds; the restart test's own waits add
/// up to a few minutes at worst).
const TEST_LIMIT_S: u64 = 600;

#[derive(Default)]
struct Slow;
impl Activity for Slow {
    const NAME: &'static str = "slow";
    type Input = u64;
    type Output = u64;
    async fn run(&self, _ctx: ActivityContext, n: u64) -> Result<u64, ActivityError> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(n + 1)
    }
}

struct Steps;
impl Workflow for Steps {
    const NAME: &'static str = "steps";
    type Input = u64;
    type Output = u64;
    async fn run(ctx: WorkflowContext, n: u64) -> Result<u64, WorkflowError> {
        let a = ctx.activity::<Slow>(n).await?;
        let b = ctx.activity::<Slow>(a).await?;
        Ok(ctx.activity::<Slow>(b).await?)
    }
}

/// A private server: a shell that sourced scripts/postgres.sh, started a
/// cluster and waits on its stdin; closing stdin stops and removes it.
struct Server {
    shell: Child,
    stdin: Option<ChildStdin>,
    url: String,
    /// The variables the script's functions need for this server
    /// (`KEEL_PG_DIR=...`), as shell assignments.
    vars: String,
}

impl Server {
    /// A server started by `start`, `keel_pg_start` or
    /// `keel_pg_start_isolated`.
    fn start(start: &str) -> Server {
        let root = env!("CARGO_MANIFEST_DIR");
        let mut shell = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "set -e; source {root}/scripts/postgres.sh; {start}; \
                 echo \"$KEEL_TEST_POSTGRES_URL\"; \
                 echo \"KEEL_PG_DIR=$KEEL_PG_DIR KEEL_PG_NETNS=${{KEEL_PG_NETNS:-}} KEEL_PG_VETH=${{KEEL_PG_VETH:-}}\"; \
                 read -r _ || true"
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("bash");
        let mut lines = BufReader::new(shell.stdout.take().expect("stdout")).lines();
        let url = lines.next().expect("the server's URL").expect("read");
        let vars = lines.next().expect("the server's variables").expect("read");
        let stdin = shell.stdin.take();
        Server {
            shell,
            stdin,
            url,
            vars,
        }
    }

    /// A closure running one of scripts/postgres.sh's functions on this
    /// server (for a blocking thread).
    fn script(&self, call: String) -> impl FnOnce() + Send + 'static {
        let vars = self.vars.clone();
        move || {
            let root = env!("CARGO_MANIFEST_DIR");
            let status = Command::new("bash")
                .arg("-c")
                .arg(format!(
                    "set -e; source {root}/scripts/postgres.sh; {vars}; {call}"
                ))
                .status()
                .expect("bash");
            assert!(status.success(), "`{call}` on the test server failed");
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"\n");
        }
        let _ = self.shell.wait();
    }
}

/// Ends the whole test process, naming the test, when a test that drives
/// servers of its own is still running after `limit`: a wait without end
/// there (a server that did not come back, a call that never returns)
/// would otherwise hold the suite until CI's own limit, with no word of
/// where it stood. Dropped at the test's end, it stands down.
struct Watchdog(Option<std::sync::mpsc::Sender<()>>);

impl Watchdog {
    fn new(test: &'static str, limit: Duration) -> Watchdog {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                // Straight to the descriptor: the harness captures
                // `eprintln!`, and would drop it with the process.
                let _ = writeln!(
                    std::io::stderr(),
                    "{test} still runs after {limit:?}: ending the test process"
                );
                std::process::exit(101);
            }
        });
        Watchdog(Some(tx))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.0.take());
    }
}

/// Whether `.ci/run` could start a PostgreSQL server here (it sets
/// KEEL_TEST_POSTGRES_URL); the tests here start servers of their own
/// beside it. Where it could not, they are skipped, unless
/// KEEL_REQUIRE_POSTGRES=1 says they must run.
fn postgres_here() -> bool {
    if std::env::var("KEEL_TEST_POSTGRES_URL").map_or(true, |u| u.is_empty()) {
        assert!(
            std::env::var("KEEL_REQUIRE_POSTGRES").as_deref() != Ok("1"),
            "KEEL_REQUIRE_POSTGRES=1 but KEEL_TEST_POSTGRES_URL is not set"
        );
        eprintln!("no PostgreSQL on this machine: skipping a test that starts its own server");
        return false;
    }
    true
}

/// An engine on `server` that runs [`Steps`], under a 30 s write lease.
fn engine_on(server: &Server) -> Engine {
    Engine::builder()
        .postgres_options(PgOptions::new(&server.url).lease_ms(30_000))
        .register_workflow::<Steps>()
        .register_activity::<Slow>()
        .build()
        .expect("engine")
}

/// Starts `n` [`Steps`] workflows, `{prefix}-{i}` with input `i`, each on
/// a task of its own that retries its start (with the same command id)
/// and then its result, for at most `result_wait`, while the engine
/// answers "unavailable"; each task ends with the workflow's output.
fn start_steps(
    client: &Arc<keel::Client>,
    prefix: &str,
    n: u64,
    result_wait: Duration,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..n)
        .map(|i| {
            let c = client.clone();
            let id = format!("{prefix}-{i}");
            tokio::spawn(async move {
                let cmd = format!("start-{i}");
                retried("start", || {
                    c.start_with::<Steps>(&id, &i, StartOptions::new().command_id(cmd.clone()))
                })
                .await;
                retried_for("result", result_wait, || c.result::<Steps>(&id)).await
            })
        })
        .collect()
}

/// Whether `health` says the database is out of reach.
fn unreachable(health: &StoreHealth) -> bool {
    matches!(
        health,
        StoreHealth::Stopped {
            fault: WriteFault::Unreachable,
            ..
        }
    )
}

/// Waits until the engine's health says the database is out of reach,
/// failing the test after `limit`; how long that took.
async fn until_unreachable(engine: &Engine, limit: Duration, what: &str) -> Duration {
    let since = Instant::now();
    while !unreachable(&engine.health()) {
        assert!(
            since.elapsed() < limit,
            "health still says {} {limit:?} after {what}",
            engine.health()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    since.elapsed()
}

/// Retries `call` while the engine answers that the store is unavailable
/// (the database is down), for at most a minute.
async fn retried<T, F, Fut>(what: &str, call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, EngineError>>,
{
    retried_for(what, Duration::from_secs(60), call).await
}

/// [`retried`] for at most `limit`.
async fn retried_for<T, F, Fut>(what: &str, limit: Duration, mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, EngineError>>,
{
    let until = Instant::now() + limit;
    loop {
        match call().await {
            Ok(v) => return v,
            Err(EngineError::StoreUnavailable(_) | EngineError::Unavailable(_))
                if Instant::now() < until =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_under_load_loses_nothing() {
    if !postgres_here() {
        return;
    }
    let _watchdog = Watchdog::new(
        "a_database_restart_under_load_loses_nothing",
        Duration::from_secs(TEST_LIMIT_S),
    );
    let server = Server::start("keel_pg_start");
    let engine = engine_on(&server);
    let client = Arc::new(engine.client());
    let handles = start_steps(&client, "restart", WORKFLOWS, Duration::from_secs(60));
    // Some work is in flight and some done; then the server goes away.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let restart = tokio::task::spawn_blocking(server.script("keel_pg_restart 3".into()));
    // While it is down, the engine says why it does not commit.
    let mut saw_stopped = false;
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until && !restart.is_finished() {
        if unreachable(&engine.health()) {
            saw_stopped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    restart.await.expect("restart");
    assert!(
        saw_stopped,
        "health never said the database was unreachable"
    );
    // Every workflow completes by itself; one that does not within two
    // minutes is described, so the failure says where it stands.
    for (i, h) in handles.into_iter().enumerate() {
        match tokio::time::timeout(Duration::from_secs(120), h).await {
            Ok(done) => assert_eq!(done.expect("workflow task"), i as u64 + 3),
            Err(_) => {
                let mut stuck = String::new();
                for j in i as u64..WORKFLOWS {
                    let d = client.describe(&format!("restart-{j}")).await;
                    stuck.push_str(&format!("\nrestart-{j}: {d:?}"));
                }
                panic!(
                    "workflows did not complete after the restart (health {}):{stuck}",
                    engine.health()
                );
            }
        }
    }
    assert!(engine.health().is_healthy(), "{}", engine.health());
    let report = engine.store().verify().expect("verify");
    assert!(report.ok, "{:?}", report.violations);
    assert_eq!(report.runs, WORKFLOWS);
    engine.shutdown_blocking();
    drop(server);
}

/// Goal: an engine whose database went away for good still shuts down,
/// in bounded time, and ends every call waiting on it, rather than
/// waiting for a database that will not come back.
/// Method: workflows of slow activities in flight on a private server;
/// the server is stopped and left down; once health says the database is
/// unreachable, `shutdown_blocking` runs on a thread of its own and must
/// return within `SHUTDOWN_WAIT`, and every waiting `result` ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_database_is_gone_still_shuts_down() {
    const SHUTDOWN_WAIT: Duration = Duration::from_secs(60);
    if !postgres_here() {
        return;
    }
    let _watchdog = Watchdog::new(
        "an_engine_whose_database_is_gone_still_shuts_down",
        Duration::from_secs(TEST_LIMIT_S),
    );
    let server = Server::start("keel_pg_start");
    let engine = engine_on(&server);
    let client = Arc::new(engine.client());
    let mut results = Vec::new();
    for i in 0..10u64 {
        let id = format!("gone-{i}");
        client
            .start_with::<Steps>(&id, &i, StartOptions::new())
            .await
            .expect("start");
        let c = client.clone();
        results.push(tokio::spawn(async move { c.result::<Steps>(&id).await }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    tokio::task::spawn_blocking(server.script("keel_pg_down".into()))
        .await
        .expect("stop the server");
    until_unreachable(&engine, Duration::from_secs(30), "the server stopped").await;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    // Dropped in async code, as a test that panics drops it.
    tokio::spawn(async move {
        drop(engine);
        let _ = done_tx.send(());
    });
    let shut = tokio::task::spawn_blocking(move || done_rx.recv_timeout(SHUTDOWN_WAIT))
        .await
        .expect("wait");
    assert!(
        shut.is_ok(),
        "the engine did not shut down within {SHUTDOWN_WAIT:?} of its database going away"
    );
    for r in results {
        let answer = tokio::time::timeout(Duration::from_secs(10), r)
            .await
            .expect("a result call still waits after the shutdown")
            .expect("result task");
        // Workflows that finished before the server went away have their
        // output; the others end with the shutdown or the store's fault.
        match answer {
            Ok(_)
            | Err(EngineError::Shutdown)
            | Err(EngineError::StoreUnavailable(_))
            | Err(EngineError::Unavailable(_)) => {}
            Err(e) => panic!("a waiting result ended with {e}"),
        }
    }
    drop(server);
}

/// Goal: a network cut between the engine and its database (packets
/// vanish, nothing is reset, as with a failed link) is found within
/// bounds: health says the database is unreachable, and once the link is
/// back every workflow completes by itself, once, with a clean `verify`.
/// Without keel's TCP settings the cut is found only after the kernel's
/// retransmissions, about 15 minutes, while health says all is well.
/// Method: a private server in a network namespace of its own, reached
/// over a veth pair (`keel_pg_start_isolated`, root only: skipped for
/// other users); 20 workflows of
/// three slow activities; the server's end of the link goes down
/// (`keel_pg_partition on`) until health says `Unreachable` (at most
/// `CUT_FOUND_WAIT`), and comes back up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_cut_to_the_database_is_found_and_healed() {
    const CUT_FOUND_WAIT: Duration = Duration::from_secs(120);
    const RUNS: u64 = 20;
    if !postgres_here() {
        return;
    }
    // Network namespaces are root's: elsewhere (a developer's own `.ci/run`
    // as a user) the test is skipped; CI runs as root.
    let uid = Command::new("id").arg("-u").output().expect("id -u");
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        eprintln!("not root: skipping the network-cut test (it needs network namespaces)");
        return;
    }
    let _watchdog = Watchdog::new(
        "a_network_cut_to_the_database_is_found_and_healed",
        Duration::from_secs(TEST_LIMIT_S),
    );
    let server = Server::start("keel_pg_start_isolated");
    let engine = engine_on(&server);
    let client = Arc::new(engine.client());
    let handles = start_steps(&client, "cut", RUNS, Duration::from_secs(300));
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::spawn_blocking(server.script("keel_pg_partition on".into()))
        .await
        .expect("cut the link");
    let found =
        until_unreachable(&engine, CUT_FOUND_WAIT, "the link to the database was cut").await;
    eprintln!("the cut was found after {found:?}");
    tokio::task::spawn_blocking(server.script("keel_pg_partition off".into()))
        .await
        .expect("restore the link");
    for (i, h) in handles.into_iter().enumerate() {
        match tokio::time::timeout(Duration::from_secs(180), h).await {
            Ok(done) => assert_eq!(done.expect("workflow task"), i as u64 + 3),
            Err(_) => panic!(
                "cut-{i} did not complete after the link came back (health {})",
                engine.health()
            ),
        }
    }
    assert!(engine.health().is_healthy(), "{}", engine.health());
    let report = engine.store().verify().expect("verify");
    assert!(report.ok, "{:?}", report.violations);
    assert_eq!(report.runs, RUNS);
    engine.shutdown_blocking();
    drop(server);
}
