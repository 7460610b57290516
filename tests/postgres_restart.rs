//! Goal: restarting the database under load loses nothing and commits
//! nothing twice. While the server is down the engine says so
//! (`Engine::health()` is `Stopped { Unreachable }`, clients needing a
//! commit are answered at once instead of hanging), and once it is back
//! every workflow completes by itself, with a clean `verify`.
//! Method: a PostgreSQL server of this test's own (scripts/postgres.sh,
//! so the shared server other tests use is not disturbed); 60 workflows
//! of three slow activities each; a few seconds in, the server is stopped
//! for 3 s and started again (`keel_pg_restart`). Clients retry calls the
//! engine answered "unavailable" with the same command id. Runs only where
//! `.ci/run` could start a server (KEEL_TEST_POSTGRES_URL set).

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
    dir: String,
}

impl Server {
    fn start() -> Server {
        let root = env!("CARGO_MANIFEST_DIR");
        let mut shell = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "set -e; source {root}/scripts/postgres.sh; keel_pg_start; \
                 echo \"$KEEL_TEST_POSTGRES_URL\"; echo \"$KEEL_PG_DIR\"; read -r _ || true"
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("bash");
        let mut lines = BufReader::new(shell.stdout.take().expect("stdout")).lines();
        let url = lines.next().expect("the server's URL").expect("read");
        let dir = lines.next().expect("the server's directory").expect("read");
        let stdin = shell.stdin.take();
        Server {
            shell,
            stdin,
            url,
            dir,
        }
    }
}

/// Stops the server in `dir` for `down_s` seconds and starts it again.
fn restart(dir: &str, down_s: u32) {
    let root = env!("CARGO_MANIFEST_DIR");
    let status = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "set -e; source {root}/scripts/postgres.sh; KEEL_PG_DIR={dir}; keel_pg_restart {down_s}"
        ))
        .status()
        .expect("bash");
    assert!(status.success(), "restarting the server failed");
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"\n");
        }
        let _ = self.shell.wait();
    }
}

/// Retries `call` while the engine answers that the store is unavailable
/// (the database is down), for at most a minute.
async fn retried<T, F, Fut>(what: &str, mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, EngineError>>,
{
    let until = Instant::now() + Duration::from_secs(60);
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
    if std::env::var("KEEL_TEST_POSTGRES_URL").map_or(true, |u| u.is_empty()) {
        assert!(
            std::env::var("KEEL_REQUIRE_POSTGRES").as_deref() != Ok("1"),
            "KEEL_REQUIRE_POSTGRES=1 but KEEL_TEST_POSTGRES_URL is not set"
        );
        eprintln!("no PostgreSQL on this machine: skipping the restart test");
        return;
    }
    let server = Server::start();
    let engine = Engine::builder()
        .postgres_options(PgOptions::new(&server.url).lease_ms(30_000))
        .register_workflow::<Steps>()
        .register_activity::<Slow>()
        .build()
        .expect("engine");
    let client = Arc::new(engine.client());
    let mut handles = Vec::new();
    for i in 0..WORKFLOWS {
        let c = client.clone();
        handles.push(tokio::spawn(async move {
            let id = format!("restart-{i}");
            let cmd = format!("start-{i}");
            retried("start", || {
                c.start_with::<Steps>(&id, &i, StartOptions::new().command_id(cmd.clone()))
            })
            .await;
            retried("result", || c.result::<Steps>(&id)).await
        }));
    }
    // Some work is in flight and some done; then the server goes away.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let restart = {
        let dir = server.dir.clone();
        tokio::task::spawn_blocking(move || restart(&dir, 3))
    };
    // While it is down, the engine says why it does not commit.
    let mut saw_stopped = false;
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until && !restart.is_finished() {
        if let StoreHealth::Stopped {
            fault: WriteFault::Unreachable,
            ..
        } = engine.health()
        {
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
