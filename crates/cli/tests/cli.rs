//! Goal: every inspection and replay command of the `keel` binary works on
//! a stopped data directory and beside a live engine, reports divergences
//! with exit code 1, and answers bad input (missing or foreign directory,
//! damaged or truncated bundle, unknown id, corrupt record, bad arguments)
//! with one line on stderr, a documented exit code and no panic.
//! Method: an `Engine` in this test process runs the demo's order workflow
//! on a temp dir (a large order stays open, waiting for its approval
//! signal) while the binary runs as a subprocess against the same
//! directory; then the engine shuts down and the same commands run again.
//! Divergence: histories recorded by a different `demo.order` replayed by
//! the binary's real one. Corruption: a record rewritten with the `rocksdb`
//! crate. Waits poll the store with a bound; nothing sleeps blindly.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use keel::{
    Activity, ActivityContext, ActivityError, Engine, Payload, ReusePolicy, Workflow,
    WorkflowContext, WorkflowError, WorkflowRegistry,
};
use keel_cli::demo_app::{self, Order, Receipt};
use keel_storage::{
    CommitBatch, Durability, Event, EventKind, InstanceId, ParentClosePolicy, ParentRef,
    RocksStore, RunId, Seq, Step, Store, Timestamp,
};

const WAIT_MAX: Duration = Duration::from_secs(30);

fn keel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running keel")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts the exit code, and that nothing panicked.
fn expect_code(o: &Output, code: i32, what: &str) {
    assert_eq!(
        o.status.code(),
        Some(code),
        "{what}: exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        stdout(o),
        stderr(o)
    );
    assert!(!stderr(o).contains("panicked"), "{what}: {}", stderr(o));
}

/// Asserts a failure: the exit code and exactly one `keel: ` line on stderr.
fn expect_error(o: &Output, code: i32, what: &str, needle: &str) {
    expect_code(o, code, what);
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "{what}: expected one stderr line, got {err:?}"
    );
    assert!(lines[0].starts_with("keel: "), "{what}: {err:?}");
    assert!(
        lines[0].contains(needle),
        "{what}: {err:?} lacks {needle:?}"
    );
}

fn data_arg(dir: &Path) -> String {
    dir.display().to_string()
}

fn demo_engine(dir: &Path, workflows: &WorkflowRegistry) -> Engine {
    Engine::builder()
        .data_dir(dir)
        .workflows(workflows)
        .register_activity::<demo_app::ChargeCard>()
        .register_activity::<demo_app::ReserveInventory>()
        .register_activity::<demo_app::Ship>()
        .register_activity::<demo_app::Notify>()
        .build()
        .expect("engine starts")
}

/// Polls `done` until it holds, at most [`WAIT_MAX`].
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < WAIT_MAX, "timed out waiting for {what}");
        std::thread::yield_now();
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn history_len(store: &dyn Store, instance: &str) -> u64 {
    store
        .resolve(instance)
        .ok()
        .flatten()
        .and_then(|r| store.run_meta(r).ok().flatten())
        .map_or(0, |m| m.next_seq.0 - 1)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Orders 3 (charge retried), 4 (small) complete; order 9 (large) stays
/// open waiting for its approval after charge and reserve (5 events).
fn run_demo_orders(engine: &Engine) {
    let client = engine.client();
    rt().block_on(async {
        for id in [3u64, 4, 9] {
            let input = Payload::encode(&demo_app::order(id)).unwrap();
            client
                .start_raw(
                    "demo.order",
                    &format!("order-{id}"),
                    input,
                    None,
                    ReusePolicy::RejectDuplicate,
                )
                .await
                .expect("start");
        }
        for id in ["order-3", "order-4"] {
            let r: Receipt = client
                .result::<demo_app::ProcessOrder>(id)
                .await
                .expect("result");
            assert!(r.tracking.starts_with("trk_"));
        }
    });
    let store = engine.store();
    wait_until("order-9 to wait for approval", || {
        history_len(&*store, "order-9") >= 5
    });
}

/// Every command against `data`, where order-9 is open and 3, 4 closed.
fn check_every_command(data: &Path, scratch: &Path, label: &str, live: bool) {
    let d = data_arg(data);
    let what = |c: &str| format!("{label}: {c}");

    let o = keel(&["list", "--data", &d]);
    expect_code(&o, 0, &what("list"));
    let out = stdout(&o);
    assert!(out.lines().next().unwrap().starts_with("INSTANCE"), "{out}");
    for id in ["order-3", "order-4", "order-9"] {
        assert!(out.contains(id), "{label}: list lacks {id}:\n{out}");
    }
    let o = keel(&["list", "--data", &d, "--status", "running", "--json"]);
    expect_code(&o, 0, &what("list --status running"));
    let rows: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{label}: {rows:?}");
    assert_eq!(rows[0]["instance_id"], "order-9");
    let o = keel(&["list", "--data", &d, "--type", "no.such.type", "--json"]);
    expect_code(&o, 0, &what("list --type"));
    assert_eq!(stdout(&o), "");

    let o = keel(&["show", "order-3", "--data", &d]);
    expect_code(&o, 0, &what("show"));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("SEQ"), "{out}");
    assert!(lines[1].starts_with("1 ") && lines[1].contains("WorkflowStarted"));
    assert!(out.contains("ActivityAttemptFailed"), "{out}");
    assert!(out.contains("payment gateway timed out"), "{out}");
    assert!(out.contains("WorkflowCompleted"), "{out}");
    let o = keel(&["show", "order-9", "--data", &d, "--json"]);
    expect_code(&o, 0, &what("show --json"));
    let events: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(events.len() >= 5, "{label}: {events:?}");
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["seq"], i as u64 + 1);
    }
    assert_eq!(events[0]["input"]["cents"], 75_000);

    let o = keel(&["describe", "order-9", "--data", &d]);
    expect_code(&o, 0, &what("describe"));
    let out = stdout(&o);
    assert!(out.contains("status       running"), "{out}");
    assert!(out.contains("waiting for approve (1)"), "{out}");
    assert!(out.contains("parked       no"), "{out}");
    let o = keel(&["describe", "order-3", "--data", &d, "--json"]);
    expect_code(&o, 0, &what("describe --json"));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["status"], "completed");
    assert_eq!(v["pending"].as_array().unwrap().len(), 0);

    let o = keel(&["verify", "--data", &d]);
    expect_code(&o, 0, &what("verify"));
    assert!(stdout(&o).starts_with("ok:"), "{}", stdout(&o));

    let bundle = scratch.join(format!("{label}-order-9.bundle"));
    let b = bundle.display().to_string();
    let o = keel(&["export", "order-9", "--data", &d, "-o", &b]);
    expect_code(&o, 0, &what("export"));
    let o = keel(&["replay", &b]);
    expect_code(&o, 0, &what("replay bundle"));
    assert!(stdout(&o).contains("1 ok, 0 diverged"), "{}", stdout(&o));

    let o = keel(&["replay", "--data", &d, "order-3", "order-9"]);
    expect_code(&o, 0, &what("replay ids"));
    assert!(stdout(&o).contains("replayed 2 runs"), "{}", stdout(&o));
    let o = keel(&["replay", "--all", "--data", &d, "--json"]);
    expect_code(&o, 0, &what("replay --all"));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["replayed"], 1, "only the open run: {v}");
    assert_eq!(v["ok"], 1);

    let copy = scratch.join(format!("{label}-checkpoint"));
    let c = copy.display().to_string();
    // Beside a running engine too: keel copies the files itself.
    let o = keel(&["checkpoint", &c, "--data", &d]);
    expect_code(&o, 0, &what("checkpoint"));
    let _ = live;
    let o = keel(&["verify", "--data", &c]);
    expect_code(&o, 0, &what("verify checkpoint"));
    let o = keel(&["show", "order-9", "--data", &c, "--json"]);
    expect_code(&o, 0, &what("show from checkpoint"));
    assert_eq!(stdout(&o).lines().count(), events.len(), "{label}");
    let o = keel(&["checkpoint", &c, "--data", &d]);
    expect_error(
        &o,
        2,
        &what("checkpoint over a directory"),
        "already exists",
    );
}

#[test]
fn every_command_beside_a_live_engine_and_on_a_stopped_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let engine = demo_engine(&data, &demo_app::workflows());
    run_demo_orders(&engine);
    check_every_command(&data, tmp.path(), "live", true);

    // Each command opens afresh beside the live writer: a signal committed
    // now is seen by the next command.
    rt().block_on(async {
        engine
            .client()
            .signal("order-9", "approve", &"ops".to_string(), Some("approve-9"))
            .await
            .unwrap();
        let r: Receipt = engine
            .client()
            .result::<demo_app::ProcessOrder>("order-9")
            .await
            .unwrap();
        assert_eq!(r.approved_by.as_deref(), Some("ops"));
    });
    let o = keel(&["describe", "order-9", "--data", &data_arg(&data), "--json"]);
    expect_code(&o, 0, "live describe after approval");
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["status"], "completed", "{v}");
    engine.shutdown_blocking();

    // Stopped: a fresh directory where order-9 is still open.
    let data = tmp.path().join("stopped");
    let engine = demo_engine(&data, &demo_app::workflows());
    run_demo_orders(&engine);
    engine.shutdown_blocking();
    check_every_command(&data, tmp.path(), "stopped", false);
}

// ---------------------------------------------------------------- divergence

#[derive(Default, Debug)]
struct Audit;
impl Activity for Audit {
    const NAME: &'static str = "test.audit";
    type Input = Order;
    type Output = ();
    async fn run(&self, _ctx: ActivityContext, _o: Order) -> Result<(), ActivityError> {
        Ok(())
    }
}

/// An older `demo.order`: audits first, then waits for approval.
struct OldOrder;
impl Workflow for OldOrder {
    const NAME: &'static str = "demo.order";
    type Input = Order;
    type Output = Receipt;
    async fn run(ctx: WorkflowContext, order: Order) -> Result<Receipt, WorkflowError> {
        ctx.activity::<Audit>(order).await?;
        let by = ctx.wait_signal::<String>("approve").await?;
        Err(WorkflowError::msg(by))
    }
}

/// A data directory holding one open `demo.order` run recorded by
/// [`OldOrder`], and one run the binary's code replays cleanly.
fn diverged_dir(dir: &Path) {
    let mut old = WorkflowRegistry::new();
    old.register::<OldOrder>();
    let engine = Engine::builder()
        .data_dir(dir)
        .workflows(&old)
        .register_activity::<Audit>()
        .build()
        .unwrap();
    rt().block_on(async {
        engine
            .client()
            .start::<OldOrder>("old-order", &demo_app::order(1))
            .await
            .unwrap();
    });
    let store = engine.store();
    wait_until("the audit to complete", || {
        history_len(&*store, "old-order") >= 3
    });
    // The engine's store closes when its last handle goes.
    drop(store);
    engine.shutdown_blocking();
    let engine = demo_engine(dir, &demo_app::workflows());
    run_demo_orders(&engine);
    engine.shutdown_blocking();
}

#[test]
fn replay_reports_the_first_divergence_and_exits_1() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    diverged_dir(&data);
    let d = data_arg(&data);

    let o = keel(&["replay", "--all", "--data", &d]);
    expect_code(&o, 1, "replay --all");
    let out = stdout(&o);
    assert!(
        out.contains("replayed 2 runs") && out.contains("1 ok, 1 diverged, 0 failed"),
        "{out}"
    );
    assert!(
        out.contains("old-order") && out.contains("DIVERGED at step 1"),
        "{out}"
    );
    assert!(
        out.contains("test.audit") && out.contains("demo.charge"),
        "{out}"
    );
    // The problem is also reported on stderr as it is found.
    assert!(stderr(&o).contains("old-order"), "{}", stderr(&o));

    let o = keel(&["replay", "--all", "--data", &d, "--json"]);
    expect_code(&o, 1, "replay --all --json");
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["diverged"], 1);
    assert_eq!(v["problems"][0]["instance_id"], "old-order");
    assert_eq!(v["problems"][0]["result"], "diverged");
    assert_eq!(v["problems"][0]["step"], 1);

    let o = keel(&["replay", "--data", &d, "old-order"]);
    expect_code(&o, 1, "replay id");
    let bundle = tmp.path().join("old.bundle");
    let b = bundle.display().to_string();
    expect_code(
        &keel(&["export", "old-order", "--data", &d, "-o", &b]),
        0,
        "export",
    );
    let o = keel(&["replay", &b]);
    expect_code(&o, 1, "replay bundle");
    assert!(stdout(&o).contains("DIVERGED at step 1"), "{}", stdout(&o));

    // Describe shows that this build's code no longer fits the run.
    let o = keel(&["describe", "old-order", "--data", &d]);
    expect_code(&o, 0, "describe");
    assert!(stdout(&o).contains("replay with this build's code fails"));

    // The library entry point with a registry that knows the old code: the
    // same bundle replays cleanly there.
    let mut old = WorkflowRegistry::new();
    old.register::<OldOrder>();
    #[derive(Parser)]
    struct Tool {
        #[command(subcommand)]
        command: keel_cli::Command,
    }
    let tool = Tool::try_parse_from(["tool", "replay", b.as_str()]).unwrap();
    assert_eq!(
        keel_cli::run(tool.command, &old),
        std::process::ExitCode::SUCCESS
    );
    let tool = Tool::try_parse_from(["tool", "replay", b.as_str()]).unwrap();
    assert_eq!(
        keel_cli::run(tool.command, &keel_cli::registry()),
        std::process::ExitCode::from(1)
    );
}

// ---------------------------------------------------------------- bad input

fn raw_db(path: &Path) -> rocksdb::DB {
    let opts = rocksdb::Options::default();
    let names = rocksdb::DB::list_cf(&opts, path).unwrap();
    rocksdb::DB::open_cf(&opts, path, &names).unwrap()
}

#[test]
fn bad_input_gives_one_line_and_a_documented_exit_code() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let engine = demo_engine(&data, &demo_app::workflows());
    run_demo_orders(&engine);
    let run3 = engine.store().resolve("order-3").unwrap().unwrap();
    engine.shutdown_blocking();
    let d = data_arg(&data);

    // Missing and foreign directories.
    let missing = tmp.path().join("missing").display().to_string();
    for cmd in [
        vec!["list", "--data", &missing],
        vec!["show", "order-3", "--data", &missing],
        vec!["describe", "order-3", "--data", &missing],
        vec!["replay", "--all", "--data", &missing],
        vec!["checkpoint", "/nonexistent/x", "--data", &missing],
    ] {
        expect_error(&keel(&cmd), 2, &cmd.join(" "), "cannot open");
    }
    let o = keel(&["verify", "--data", &missing]);
    expect_error(&o, 2, "verify missing", "cannot open");
    assert!(!Path::new(&missing).exists(), "a command created {missing}");
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "hello").unwrap();
    let f = data_arg(&foreign);
    expect_error(
        &keel(&["list", "--data", &f]),
        2,
        "foreign",
        "not a keel data directory",
    );

    // Unknown ids.
    for cmd in [
        vec!["show", "no-such-order", "--data", &d],
        vec!["describe", "no-such-order", "--data", &d],
        vec![
            "export",
            "no-such-order",
            "--data",
            &d,
            "-o",
            "/tmp/never.bundle",
        ],
        vec!["replay", "--data", &d, "no-such-order"],
    ] {
        expect_error(&keel(&cmd), 2, &cmd.join(" "), "unknown instance or run");
    }
    assert!(!Path::new("/tmp/never.bundle").exists());

    // Bad arguments (clap's own usage errors are exit 2, several lines).
    expect_code(
        &keel(&["list", "--status", "bogus", "--data", &d]),
        2,
        "status",
    );
    expect_error(&keel(&["replay"]), 2, "replay nothing", "nothing to replay");
    expect_error(
        &keel(&["replay", "missing.bundle"]),
        2,
        "missing bundle",
        "no bundle file",
    );

    // Damaged and truncated bundles.
    let good = tmp.path().join("good.bundle");
    let g = good.display().to_string();
    expect_code(
        &keel(&["export", "order-3", "--data", &d, "-o", &g]),
        0,
        "export",
    );
    let bytes = std::fs::read(&good).unwrap();
    let flipped = tmp.path().join("flipped.bundle");
    let mut b = bytes.clone();
    let at = b.len() - 10;
    b[at] ^= 0x20;
    std::fs::write(&flipped, &b).unwrap();
    expect_error(
        &keel(&["replay", &flipped.display().to_string()]),
        2,
        "flipped bundle",
        "checksum mismatch",
    );
    let truncated = tmp.path().join("truncated.bundle");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    expect_error(
        &keel(&["replay", &truncated.display().to_string()]),
        2,
        "truncated bundle",
        "bad bundle",
    );
    let tiny = tmp.path().join("tiny.bundle");
    std::fs::write(&tiny, &bytes[..5]).unwrap();
    expect_error(
        &keel(&["replay", &tiny.display().to_string()]),
        2,
        "tiny bundle",
        "shorter than",
    );

    // A corrupt event record: commands that read it exit 1 naming run and
    // seq; verify reports it; commands that do not read it still work.
    {
        let db = raw_db(&data);
        let cf = db.cf_handle("events").unwrap();
        let key = keel_storage::keys::event_key(run3, Seq(3));
        let mut v = db.get_cf(&cf, &key).unwrap().unwrap();
        let last = v.len() - 1;
        v[last] ^= 0x40;
        db.put_cf(&cf, &key, &v).unwrap();
        db.flush_cf(&cf).unwrap();
    }
    let needle = format!("corrupt record in events run {run3} seq 3");
    for cmd in [
        vec!["show", "order-3", "--data", &d],
        vec!["describe", "order-3", "--data", &d],
        vec!["export", "order-3", "--data", &d, "-o", &g],
    ] {
        expect_error(&keel(&cmd), 1, &cmd.join(" "), &needle);
    }
    let o = keel(&["replay", "--data", &d, "order-3"]);
    expect_code(&o, 1, "replay corrupt");
    assert!(stdout(&o).contains("FAILED (corrupt)"), "{}", stdout(&o));
    let o = keel(&["verify", "--data", &d]);
    expect_code(&o, 1, "verify corrupt");
    assert!(stdout(&o).contains("seq 3"), "{}", stdout(&o));
    expect_code(
        &keel(&["show", "order-4", "--data", &d]),
        0,
        "show sound run",
    );
    expect_code(&keel(&["list", "--data", &d]), 0, "list");
}

// ---------------------------------------------------------------- streaming and trees

#[test]
fn show_streams_and_stops_quietly_when_the_reader_goes_away() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = keel_cli::replay_bench::workflows();
    {
        let store = RocksStore::open(tmp.path(), Durability::Buffered).unwrap();
        keel_cli::replay_bench::write_run(&store, &registry, "long", 1, 20_000, 5_000).unwrap();
        store.close().unwrap();
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["show", "long", "--data", &data_arg(tmp.path())])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::BufRead;
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(line.starts_with("SEQ"), "{line}");
        line.clear();
        out.read_line(&mut line).unwrap();
        assert!(line.contains("WorkflowStarted"), "{line}");
        // Dropping the reader closes the pipe mid-history.
    }
    let o = child.wait_with_output().unwrap();
    expect_code(&o, 0, "show into a closed pipe");

    // The whole history, in order, through --json.
    let o = keel(&["show", "long", "--data", &data_arg(tmp.path()), "--json"]);
    expect_code(&o, 0, "show --json");
    let n = stdout(&o).lines().count() as u64;
    assert_eq!(n, keel_cli::replay_bench::events_per_run(20_000));
    let o = keel(&["replay", "--data", &data_arg(tmp.path()), "long"]);
    // `bench.replay` is not compiled into the binary: a typed failure.
    expect_code(&o, 1, "replay of an unknown type");
    assert!(
        stdout(&o).contains("unknown_workflow_type"),
        "{}",
        stdout(&o)
    );
}

fn ev(seq: u64, kind: EventKind) -> Event {
    Event {
        seq: Seq(seq),
        at: Timestamp(1_700_000_000_000 + seq),
        kind,
    }
}

fn started(instance: &InstanceId, run: RunId, ty: &str, parent: Option<ParentRef>) -> EventKind {
    EventKind::WorkflowStarted(Box::new(keel_storage::WorkflowStart {
        instance_id: instance.clone(),
        run_id: run,
        workflow_type: ty.into(),
        input: Payload::encode(&0u32).unwrap(),
        command_id: None,
        parent,
        continued_from: None,
        random_seed: 7,
        previous_run: None,
        carried: Default::default(),
        memo: Vec::new(),
        search_attributes: Vec::new(),
        timeouts: Default::default(),
    }))
}

fn schedule_child(step: u32, parent: RunId, child: RunId) -> EventKind {
    EventKind::ChildScheduled(Box::new(keel_storage::ChildSchedule {
        step: Step(step),
        group: Vec::new(),
        child_instance_id: InstanceId::for_child(parent, Step(step)),
        child_run_id: child,
        workflow_type: "test.child".into(),
        input: Payload::encode(&0u32).unwrap(),
        close_policy: ParentClosePolicy::Terminate,
        memo: Vec::new(),
        search_attributes: Vec::new(),
        timeouts: Default::default(),
    }))
}

#[test]
fn describe_shows_the_tree_of_children() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, mid, leaf) = (
        RunId::from_u64_pair(1, 1),
        RunId::from_u64_pair(2, 2),
        RunId::from_u64_pair(3, 3),
    );
    let root_instance = InstanceId::new("tree-root");
    {
        let store = RocksStore::open(tmp.path(), Durability::Sync).unwrap();
        let commit = |run: RunId, events: Vec<Event>| {
            store
                .commit(CommitBatch::append(run, events))
                .wait()
                .unwrap();
        };
        commit(
            root,
            vec![
                ev(1, started(&root_instance, root, "test.root", None)),
                ev(2, schedule_child(1, root, mid)),
            ],
        );
        let parent_of = |run: RunId, instance: InstanceId| ParentRef {
            instance_id: instance,
            run_id: run,
            step: Step(1),
            close_policy: ParentClosePolicy::Terminate,
        };
        let mid_instance = InstanceId::for_child(root, Step(1));
        commit(
            mid,
            vec![
                ev(
                    1,
                    started(
                        &mid_instance,
                        mid,
                        "test.child",
                        Some(parent_of(root, root_instance.clone())),
                    ),
                ),
                ev(2, schedule_child(1, mid, leaf)),
            ],
        );
        store.close().unwrap();
    }
    let d = data_arg(tmp.path());
    let o = keel(&["describe", "tree-root", "--data", &d]);
    expect_code(&o, 0, "describe tree");
    let out = stdout(&o);
    assert!(
        out.contains(&format!(
            "- step 1: test.child {root}/child-1 (running) run {mid}"
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "    - step 1: test.child {mid}/child-1 (not started) run {leaf}"
        )),
        "{out}"
    );
    assert!(out.contains("not compiled into this tool"), "{out}");
    let o = keel(&["describe", &mid.to_string(), "--data", &d, "--json"]);
    expect_code(&o, 0, "describe by run id");
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["parent"], format!("{root} step 1"));
    assert_eq!(v["pending"][0]["kind"], "child");
}

/// Goal: a data directory other users can write to is reported, since they
/// could change or remove every workflow's history. Method: create one,
/// make it world-writable, and run `keel verify` on it.
#[cfg(unix)]
#[test]
fn a_directory_others_can_write_to_is_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    drop(RocksStore::open(&data, keel_storage::Durability::Sync).unwrap());
    let d = data.to_str().unwrap();
    let quiet = keel(&["verify", "--data", d]);
    expect_code(&quiet, 0, "verify a private directory");
    assert!(
        !stderr(&quiet).contains("other users"),
        "{}",
        stderr(&quiet)
    );
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o777)).unwrap();
    let o = keel(&["verify", "--data", d]);
    expect_code(&o, 0, "verify a world-writable directory");
    assert!(
        stderr(&o).contains("can be written by other users"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn inspection_leaves_nothing_in_the_temp_dir_whatever_sits_there() {
    // Goal: an inspection command opens read-only and leaves nothing in the
    // temp dir (older builds made a scratch directory there for RocksDB
    // secondaries), and files at the names those builds used are left
    // alone, without a warning. Method: the binary runs `list` against a
    // stopped directory with TMPDIR pointing at a fresh temp dir holding
    // such files; the temp dir is listed afterwards.
    let uid = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").unwrap().uid()
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    drop(RocksStore::open(&data, keel_storage::Durability::Sync).unwrap());
    let d = data.to_str().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let names = || {
        let mut names: Vec<String> = std::fs::read_dir(&tmp)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let list = || {
        Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(["list", "--data", d])
            .env("TMPDIR", &tmp)
            .stdin(Stdio::null())
            .output()
            .expect("running keel")
    };
    let o = list();
    expect_code(&o, 0, "list");
    assert!(names().is_empty(), "{:?}", names());

    let held = [format!("keel-{uid}"), format!("keel-scratch-{uid}")];
    for name in &held {
        std::fs::write(tmp.join(name), b"a user's file").unwrap();
    }
    let o = list();
    expect_code(&o, 0, "list beside files at the old scratch names");
    assert!(!stderr(&o).contains("WARN"), "{}", stderr(&o));
    assert_eq!(names(), held);
    for name in &held {
        assert_eq!(std::fs::read(tmp.join(name)).unwrap(), b"a user's file");
    }
}

#[test]
fn list_finds_runs_by_search_attributes_and_pages() {
    // Goal: `keel list --where` finds runs by search attributes and status
    // through the index, prints them as a table or JSON, pages with a
    // token, and refuses a bad filter naming where it is wrong (exit 2).
    // Method: three runs committed straight to a store, then the binary.
    let tmp = tempfile::tempdir().unwrap();
    {
        let store = RocksStore::open(tmp.path(), Durability::Sync).unwrap();
        for (n, customer, close) in [(1u64, "c-42", false), (2, "c-42", true), (3, "c-7", false)] {
            let run = RunId::from_u64_pair(9, n);
            let mut start = started(
                &InstanceId::new(format!("order-{n}")),
                run,
                "test.order",
                None,
            );
            if let EventKind::WorkflowStarted(start) = &mut start {
                let keel_storage::WorkflowStart {
                    search_attributes,
                    memo,
                    ..
                } = &mut **start;
                search_attributes.push((
                    "customer".into(),
                    keel_storage::SearchValue::from(customer).to_payload(),
                ));
                memo.push(("note".into(), Payload::encode("gift wrap").unwrap()));
            }
            let mut events = vec![ev(1, start)];
            events.push(ev(
                2,
                EventKind::SearchAttributesUpserted {
                    attributes: vec![(
                        "amount".into(),
                        keel_storage::SearchValue::Int(n as i64 * 100).to_payload(),
                    )],
                },
            ));
            if close {
                events.push(ev(
                    3,
                    EventKind::WorkflowCompleted {
                        result: Payload::encode(&0u32).unwrap(),
                    },
                ));
            }
            store
                .commit(CommitBatch::append(run, events))
                .wait()
                .unwrap();
        }
    }
    let data = data_arg(tmp.path());
    let o = keel(&[
        "list",
        "--data",
        &data,
        "--where",
        r#"customer = "c-42" and status = running"#,
        "--json",
    ]);
    expect_code(&o, 0, "list --where --json");
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{}", stdout(&o));
    assert_eq!(lines[0]["instance_id"], "order-1");
    assert_eq!(lines[0]["search_attributes"]["customer"], "c-42");
    assert_eq!(lines[0]["search_attributes"]["amount"], 100);
    assert_eq!(lines[0]["memo"]["note"], "gift wrap");
    let o = keel(&["list", "--data", &data, "--where", "amount >= 200"]);
    expect_code(&o, 0, "list --where amount");
    let table = stdout(&o);
    assert!(
        table.contains("order-2") && table.contains("order-3"),
        "{table}"
    );
    assert!(!table.contains("order-1"), "{table}");
    assert!(table.contains("customer=c-7"), "{table}");
    // Pages of one, following the token printed on stderr.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..5 {
        let mut args = vec!["list", "--data", &data, "--page-size", "1", "--json"];
        if let Some(t) = &after {
            args.extend(["--after", t.as_str()]);
        }
        let o = keel(&args);
        expect_code(&o, 0, "list --page-size");
        seen.extend(stdout(&o).lines().map(str::to_string));
        after = stderr(&o)
            .split("--after ")
            .nth(1)
            .map(|t| t.trim().to_string());
        if after.is_none() {
            break;
        }
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
    expect_error(
        &keel(&["list", "--data", &data, "--where", "status = sleeping"]),
        2,
        "a bad filter",
        "unknown status",
    );
    expect_error(
        &keel(&[
            "list",
            "--data",
            &data,
            "--where",
            "customer = 'c-42' or amount > 1",
        ]),
        2,
        "or",
        "only `and`",
    );
}

#[test]
fn schedule_list_and_describe_read_a_data_directory() {
    // Goal: `keel schedule list` shows each schedule's calendar, workflow,
    // policy and pause from its run record, and `keel schedule describe`
    // replays one and shows what its `describe` query answers, as a table
    // and as JSON; an unknown schedule is one line and exit 2.
    // Method: an engine creates and pauses a daily schedule in Berlin
    // time, shuts down, then the binary reads the directory.
    let tmp = tempfile::tempdir().unwrap();
    let workflows = demo_app::workflows();
    {
        let engine = demo_engine(tmp.path(), &workflows);
        let client = engine.client();
        rt().block_on(async {
            let spec = keel::ScheduleSpec::cron("30 6 * * MON-FRI").in_time_zone("Europe/Berlin");
            let action =
                keel::ScheduleAction::start::<demo_app::ProcessOrder>(&demo_app::order(1)).unwrap();
            let s = client.schedules();
            s.create(
                "morning",
                keel::NewSchedule::new(spec, action).overlap(keel::OverlapPolicy::BufferOne),
            )
            .await
            .unwrap();
            s.pause("morning", "holidays").await.unwrap();
            s.unpause("morning", "back").await.unwrap();
        });
        engine.shutdown_blocking();
    }
    let data = data_arg(tmp.path());
    let o = keel(&["schedule", "list", "--data", &data]);
    expect_code(&o, 0, "schedule list");
    let out = stdout(&o);
    assert!(out.contains("morning"), "{out}");
    assert!(
        out.contains("cron \"30 6 * * MON-FRI\" in Europe/Berlin"),
        "{out}"
    );
    assert!(
        out.contains("demo.order") && out.contains("buffer-one"),
        "{out}"
    );
    let o = keel(&["schedule", "list", "--data", &data, "--json"]);
    expect_code(&o, 0, "schedule list --json");
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["id"], "morning");
    assert_eq!(v["paused"], false);
    assert_eq!(v["note"], "back");
    let o = keel(&["schedule", "describe", "morning", "--data", &data]);
    expect_code(&o, 0, "schedule describe");
    let out = stdout(&o);
    assert!(out.contains("overlap    buffer-one"), "{out}");
    // The next five weekday mornings, 06:30 in Berlin (05:30 or 04:30 UTC).
    let next = out.lines().find(|l| l.starts_with("next")).unwrap();
    assert_eq!(next.matches(":30:00.000Z").count(), 5, "{next}");
    let o = keel(&["schedule", "describe", "morning", "--data", &data, "--json"]);
    expect_code(&o, 0, "schedule describe --json");
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["next"].as_array().map(Vec::len), Some(5));
    let o = keel(&["schedule", "describe", "evening", "--data", &data]);
    expect_error(&o, 2, "unknown schedule", "no schedule \"evening\"");
}

/// `keel bench w1` measures the disk in the same run and reports the
/// workflows' median over the syncs they need; `--buffered` runs the same
/// workload without waiting for syncs and reports no such ratio (nothing
/// waited for the disk). Checked on a tiny run: the numbers' relation,
/// not their size.
#[test]
fn bench_w1_reports_its_p50_over_the_disks_fsync() {
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "bench",
            "w1",
            "--workflows",
            "20",
            "--concurrency",
            "1",
            "--json",
        ];
        args.extend_from_slice(extra);
        let o = keel(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str(stdout(&o).trim()).expect("one JSON object")
    };
    let synced = run(&[]);
    let per_workflow = synced["writer"]["commits_per_workflow"].as_f64().unwrap();
    assert_eq!(
        per_workflow, 4.0,
        "the start and three results, the last with the end"
    );
    let fsync = synced["disk"]["fsync_p50_ms"].as_f64().unwrap();
    assert!(fsync > 0.0, "the disk was probed: {synced}");
    let ratio = synced["disk"]["p50_over_syncs"].as_f64().unwrap();
    let p50 = synced["p50_ms"].as_f64().unwrap();
    assert!(
        (ratio - p50 / (per_workflow * fsync)).abs() < 1e-9,
        "the ratio is the p50 over four syncs: {synced}"
    );
    let commit = synced["writer"]["commit_ms_mean"].as_f64().unwrap();
    let engine_share = synced["disk"]["p50_over_commits"].as_f64().unwrap();
    assert!(
        commit > 0.0 && (engine_share - p50 / (per_workflow * commit)).abs() < 1e-9,
        "the engine's share is the p50 over four commits as answered: {synced}"
    );
    let buffered = run(&["--buffered"]);
    assert_eq!(buffered["workload"], "w1 concurrency=1 buffered");
    assert!(buffered["disk"].is_null(), "{buffered}");
}
