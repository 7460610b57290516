//! Goal: the operator's page works in a real browser against a running
//! `keel serve`: the run list shows the demo's orders and filters them,
//! a run's page shows what it waits for, a waiting order signalled from
//! its page completes, a parked run is resumed from its page, a run
//! parked by a code change shows the recorded and the new command side by
//! side, and a schedule is found, read and paused from its page.
//!
//! Method: the demo's engine (plus one workflow that panics while a flag
//! is set, to park a run, and one whose code changes between two engines
//! on the same directory) on a RocksDB directory, served by a real
//! actix-web server on a loopback port; headless Chromium (the
//! distribution's package; `.ci/run` installs it and sets
//! KEEL_REQUIRE_BROWSER=1, so a missing browser fails there instead of
//! skipping) is driven over the DevTools protocol: it loads the pages,
//! fills and submits the forms, clicks the buttons, and the test reads
//! the rendered page, and the engine, after each step. With
//! KEEL_SCREENSHOTS_DIR set, the main pages are saved there as PNG (the
//! README's pictures under docs/ come from this test).

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use keel::{Workflow, WorkflowContext, WorkflowError};
use keel_cli::serve::ServeConfig;
use serde_json::{json, Value};
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

/// How long the test waits for the page to show something.
const PAGE_WAIT_MS_MAX: u64 = 20_000;

static BROKEN: AtomicBool = AtomicBool::new(false);

/// Waits for two signals; panics between them while `BROKEN` is set, so
/// its run is parked until the code is "fixed" and the run resumed.
struct Toggle;
impl Workflow for Toggle {
    const NAME: &'static str = "ops.toggle";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let a: u32 = ctx.wait_signal("go").await?;
        if BROKEN.load(Ordering::SeqCst) {
            panic!("a bug after the first signal");
        }
        let b: u32 = ctx.wait_signal("go").await?;
        Ok(format!("went {a} and {b}"))
    }
}

static CHANGED: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
struct Stamp;
impl keel::Activity for Stamp {
    const NAME: &'static str = "ops.stamp";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _: keel::ActivityContext, n: u32) -> Result<u32, keel::ActivityError> {
        Ok(n)
    }
}

#[derive(Default)]
struct Label;
impl keel::Activity for Label {
    const NAME: &'static str = "ops.label";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _: keel::ActivityContext, n: u32) -> Result<u32, keel::ActivityError> {
        Ok(n)
    }
}

/// Stamps, then waits for a signal; once `CHANGED` is set, its code
/// labels where history recorded a stamp: a run of the old code replayed
/// by the new one is parked for non-determinism.
struct Route;
impl Workflow for Route {
    const NAME: &'static str = "ops.route";
    type Input = ();
    type Output = u32;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u32, WorkflowError> {
        let n = if CHANGED.load(Ordering::SeqCst) {
            ctx.activity::<Label>(7).await?
        } else {
            ctx.activity::<Stamp>(7).await?
        };
        let m: u32 = ctx.wait_signal("go").await?;
        Ok(n + m)
    }
}

/// What the test's schedule starts: done at once.
struct Ping;
impl Workflow for Ping {
    const NAME: &'static str = "ops.ping";
    type Input = ();
    type Output = ();
    async fn run(_: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        Ok(())
    }
}

fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    for name in ["chromium", "chromium-browser", "google-chrome", "chrome"] {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    None
}

/// A headless browser and one page, driven over the DevTools protocol.
struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

struct Browser {
    _child: KillOnDrop,
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
    session: String,
    next_id: u64,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Asks the browser to close all its processes; the guard kills
        // the main one if it did not.
        let _ = self.try_call("Browser.close", json!({}), false);
    }
}

impl Browser {
    fn launch(binary: &PathBuf) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(binary)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                "--window-size=1280,900",
                "--lang=en-US",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chromium starts");
        let stderr = child.stderr.take().unwrap();
        // Killed even if starting fails below.
        let child = KillOnDrop(Some(child));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(url) = line.split("DevTools listening on ").nth(1) {
                    let _ = tx.send(url.trim().to_string());
                }
            }
        });
        let url = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("chromium prints its DevTools address");
        let (ws, _) = tungstenite::connect(url.as_str()).expect("connects to DevTools");
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        }
        let mut b = Browser {
            _child: child,
            ws,
            session: String::new(),
            next_id: 0,
            _profile: profile,
        };
        let target = b.call("Target.createTarget", json!({"url": "about:blank"}));
        let attached = b.call(
            "Target.attachToTarget",
            json!({"targetId": target["targetId"], "flatten": true}),
        );
        b.session = attached["sessionId"].as_str().unwrap().to_string();
        b.call("Page.enable", json!({}));
        b.call("Runtime.enable", json!({}));
        b
    }

    /// One DevTools command; its result (events in between are skipped).
    fn call(&mut self, method: &str, params: Value) -> Value {
        match self.try_call(method, params, true) {
            Ok(v) => v,
            Err(e) => panic!("{method}: {e}"),
        }
    }

    /// One DevTools command, in the page's session or the browser's.
    fn try_call(&mut self, method: &str, params: Value, in_page: bool) -> Result<Value, String> {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if in_page && !self.session.is_empty() {
            msg["sessionId"] = json!(self.session);
        }
        self.ws
            .send(Message::text(msg.to_string()))
            .map_err(|e| e.to_string())?;
        loop {
            let text = match self.ws.read().map_err(|e| e.to_string())? {
                Message::Text(t) => t.to_string(),
                _ => continue,
            };
            let v: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
            if v["id"] == json!(id) {
                if let Some(e) = v.get("error") {
                    return Err(e.to_string());
                }
                return Ok(v["result"].clone());
            }
        }
    }

    /// Evaluates `js` in the page and returns its value.
    fn eval(&mut self, js: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": js, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(
            r.get("exceptionDetails").is_none(),
            "{js}: {}",
            r["exceptionDetails"]
        );
        r["result"]["value"].clone()
    }

    fn open(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
    }

    /// Waits until `js` is true in the page.
    fn wait_for(&mut self, js: &str, what: &str) {
        let deadline = Instant::now() + Duration::from_millis(PAGE_WAIT_MS_MAX);
        let probe =
            format!("(() => {{ try {{ return !!({js}); }} catch (e) {{ return false; }} }})()");
        loop {
            // While the page navigates its context may be gone: not yet.
            let r = self.try_call(
                "Runtime.evaluate",
                json!({"expression": probe, "returnByValue": true}),
                true,
            );
            if matches!(r, Ok(v) if v["result"]["value"] == json!(true)) {
                return;
            }
            if Instant::now() > deadline {
                let text = self.eval("document.body ? document.body.innerText : ''");
                panic!(
                    "the page never showed {what}; it shows:\n{}",
                    text.as_str().unwrap_or("")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn screenshot(&mut self, name: &str) {
        let Some(dir) = std::env::var_os("KEEL_SCREENSHOTS_DIR") else {
            return;
        };
        let shot = self.call(
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": true}),
        );
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        let dir = PathBuf::from(dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let path = dir.join(name);
        std::fs::write(&path, png).unwrap();
        eprintln!("saved {}", path.display());
    }
}

#[test]
fn an_operator_finds_an_order_signals_it_and_resumes_a_parked_run() {
    let Some(binary) = chromium() else {
        assert!(
            std::env::var_os("KEEL_REQUIRE_BROWSER").is_none(),
            "KEEL_REQUIRE_BROWSER is set but no chromium is on PATH"
        );
        eprintln!("skipped: no chromium on PATH (scripts/chromium.sh installs it)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let builder = || {
        keel_cli::demo_app::engine_builder()
            .register_workflow::<Toggle>()
            .register_workflow::<Route>()
            .register_workflow::<Ping>()
            .register_activity::<Stamp>()
            .register_activity::<Label>()
            .data_dir(dir.path())
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The old code stamps route-1 and leaves it waiting; the engine that
    // serves runs the new code.
    rt.block_on(async {
        let old = builder().build().unwrap();
        let c = old.client();
        c.start::<Route>("route-1", &()).await.unwrap();
        let deadline = Instant::now() + Duration::from_millis(PAGE_WAIT_MS_MAX);
        while !c
            .describe("route-1")
            .await
            .unwrap()
            .signal_waits
            .iter()
            .any(|(n, _)| n == "go")
        {
            assert!(Instant::now() < deadline, "route-1 never waited");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        old.shutdown().await;
    });
    CHANGED.store(true, Ordering::SeqCst);
    let engine = Arc::new(builder().build().unwrap());
    let client = engine.client();

    // Twelve orders; the tenth is large and waits for approval.
    rt.block_on(async {
        for i in 0..12u64 {
            let order = keel_cli::demo_app::order(i);
            client
                .start::<keel_cli::demo_app::ProcessOrder>(&format!("order-{i}"), &order)
                .await
                .unwrap();
        }
        for i in (0..12u64).filter(|i| *i != 9) {
            let id = format!("order-{i}");
            let done = tokio::time::timeout(
                Duration::from_millis(PAGE_WAIT_MS_MAX),
                client.result::<keel_cli::demo_app::ProcessOrder>(&id),
            );
            done.await.expect("small orders complete").unwrap();
        }
        // A run parked by a bug: the signal that hits it is refused
        // (nothing written) and the run parked.
        client.start::<Toggle>("toggle-1", &()).await.unwrap();
        BROKEN.store(true, Ordering::SeqCst);
        let err = client
            .signal("toggle-1", "go", &1u32, Some("go-1"))
            .await
            .unwrap_err();
        assert!(matches!(err, keel::EngineError::Parked { .. }), "{err}");
        // A schedule pinging every second.
        client
            .schedules()
            .create(
                "ping",
                keel::NewSchedule::new(
                    keel::ScheduleSpec::every(Duration::from_secs(1)),
                    keel::ScheduleAction::start::<Ping>(&()).unwrap(),
                ),
            )
            .await
            .unwrap();
        // The signal makes the new code replay route-1: parked.
        let _ = client.signal("route-1", "go", &1u32, Some("go-r1")).await;
        let deadline = Instant::now() + Duration::from_millis(PAGE_WAIT_MS_MAX);
        loop {
            let d = client.describe("route-1").await.unwrap();
            if let Some(p) = d.parked {
                assert_eq!(p.kind, "non_determinism", "{p:?}");
                break;
            }
            assert!(Instant::now() < deadline, "route-1 was never parked");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });

    let config = ServeConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        workers: 1,
        ..ServeConfig::default()
    };
    let server = keel_cli::serve::spawn(engine.clone(), &config).unwrap();
    let base = server.url();

    let mut b = Browser::launch(&binary);

    // The list shows every run.
    b.open(&format!("{base}/"));
    b.wait_for(
        "document.querySelectorAll('#rows tr').length >= 13",
        "13 runs",
    );
    b.wait_for(
        "document.querySelector('#rows').innerText.includes('order-9')",
        "order-9",
    );
    // Above the list, the whole store's counts, each a link to its filter.
    b.wait_for(
        "document.querySelector('#store-counts').innerText.includes('in the store') \
         && document.querySelector('#store-counts a[href=\"/?status=completed\"]') \
         && document.querySelector('#store-counts a[href=\"/?status=running\"]')",
        "the store's counts by status",
    );
    b.screenshot("ui-runs.png");

    // Filtered to running orders: only the one waiting for approval.
    b.eval(
        "(() => { const f = document.querySelector('#filters'); \
         f.elements.status.value = 'running'; f.elements.type.value = 'demo.order'; \
         f.requestSubmit(); })()",
    );
    b.wait_for(
        "location.search.includes('status=running') && document.querySelectorAll('#rows tr').length === 1 \
         && document.querySelector('#rows').innerText.includes('order-9')",
        "only order-9 when filtered to running orders",
    );

    // Its page says what it waits for.
    b.eval("document.querySelector('#rows a').click()");
    b.wait_for("location.pathname.startsWith('/runs/')", "the run's page");
    b.wait_for(
        "document.querySelector('h1').innerText.includes('order-9') && document.body.innerText.includes('approve')",
        "order-9 waiting for approve",
    );
    b.screenshot("ui-run-waiting.png");

    // Signalled from its page, it completes.
    b.eval(
        "(() => { const f = document.querySelector('#signal-form'); \
         f.elements.name.value = 'approve'; f.elements.payload.value = '\"ops-team\"'; \
         f.requestSubmit(); })()",
    );
    b.wait_for(
        "document.body.innerText.includes('Signal committed')",
        "the signal committed",
    );
    let receipt = rt
        .block_on(async {
            tokio::time::timeout(
                Duration::from_millis(PAGE_WAIT_MS_MAX),
                client.result::<keel_cli::demo_app::ProcessOrder>("order-9"),
            )
            .await
        })
        .expect("order-9 completes once signalled")
        .unwrap();
    assert_eq!(receipt.approved_by.as_deref(), Some("ops-team"));
    b.open(&format!("{base}/runs/order-9"));
    b.wait_for(
        "document.querySelector('h1 .badge').innerText === 'completed'",
        "order-9 completed",
    );
    b.wait_for(
        "document.querySelector('#events').innerText.includes('ops-team')",
        "the signal in the history",
    );
    b.screenshot("ui-run-completed.png");

    // The parked run: its reason is shown, and once the code is fixed a
    // click on Resume lets it go on.
    b.open(&format!("{base}/runs/toggle-1"));
    b.wait_for(
        "document.querySelector('.parked') && document.querySelector('.parked').innerText.includes('panic')",
        "the parked run's reason",
    );
    b.screenshot("ui-run-parked.png");
    // A panic is no divergence: this build replays the history.
    b.wait_for(
        "document.querySelector('#divergence').innerText.includes('replays all')",
        "the panicked run's history replays against this build",
    );
    BROKEN.store(false, Ordering::SeqCst);
    b.eval("document.querySelector('#resume').click()");
    b.wait_for(
        "document.body.innerText.includes('Resumed')",
        "the resume answer",
    );
    // The run parked by the code change: the recorded and the new
    // command side by side.
    b.open(&format!("{base}/runs/route-1"));
    b.wait_for(
        "document.querySelector('table.side') \
         && document.querySelector('table.side td.recorded').innerText.includes('ops.stamp') \
         && document.querySelector('table.side td.issued').innerText.includes('ops.label')",
        "route-1's recorded and new commands side by side",
    );
    b.screenshot("ui-run-diverged.png");

    // The schedule: listed, its page shows its calendar, next times and
    // triggers, and it is paused from there.
    b.open(&format!("{base}/schedules"));
    b.wait_for(
        "document.querySelector('#schedule-rows') && document.querySelector('#schedule-rows').innerText.includes('ping') \
         && document.querySelector('#schedule-rows').innerText.includes('every 1 s')",
        "the schedule in the list",
    );
    b.eval("document.querySelector('#schedule-rows a').click()");
    b.wait_for(
        "location.pathname === '/schedules/ping'",
        "the schedule's page",
    );
    b.wait_for(
        "document.querySelector('#next-times') && document.querySelector('#next-times').innerText.match(/\\d/) \
         && document.querySelector('#triggers').innerText.includes('completed')",
        "its next times and a completed trigger",
    );
    b.screenshot("ui-schedule.png");
    b.eval(
        "(() => { const f = document.querySelector('#pause-form'); \
         f.elements.note.value = 'maintenance window'; f.requestSubmit(); })()",
    );
    b.wait_for(
        "document.querySelector('h1 .badge').innerText === 'paused' \
         && document.body.innerText.includes('maintenance window')",
        "the schedule paused, with its note",
    );
    rt.block_on(async {
        let d = client.schedules().describe("ping").await.unwrap();
        assert!(d.paused, "{d:?}");
        assert_eq!(d.note, "maintenance window");
    });
    b.open(&format!("{base}/runs/toggle-1"));
    b.wait_for("!document.querySelector('.parked')", "the parked box gone");
    // The engine agrees: the run goes on; the refused signal, sent again,
    // and the next complete it.
    rt.block_on(async {
        let d = client.describe("toggle-1").await.unwrap();
        assert!(d.parked.is_none(), "{d:?}");
        client
            .signal("toggle-1", "go", &1u32, Some("go-1"))
            .await
            .unwrap();
        client
            .signal("toggle-1", "go", &2u32, Some("go-2"))
            .await
            .unwrap();
        let out =
            tokio::time::timeout(Duration::from_secs(20), client.result::<Toggle>("toggle-1"))
                .await;
        assert_eq!(
            out.ok().and_then(Result::ok).as_deref(),
            Some("went 1 and 2")
        );
    });

    drop(b);
    // Stopping the server gives the engine back whole: no worker thread
    // keeps a copy (a store still open in one when the process exits is
    // torn down under RocksDB's threads, which aborted this test once).
    server.stop().unwrap();
    drop(rt);
    let engine = Arc::try_unwrap(engine).expect("the stopped server released the engine");
    engine.shutdown_blocking();
}
