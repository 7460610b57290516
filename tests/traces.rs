//! Goal: the engine's work shows up as `tracing` spans named after the
//! glossary, carrying the ids an operator searches by: a client `request`
//! (its kind), the store's group `commit` (how many commits), an
//! `attempt` (run, step, attempt, epoch) and the `replay` of a run
//! activated from its log (run, events). An activity that declares itself
//! `NON_BLOCKING` but blocks its first poll is warned about, naming its
//! type.
//! Method: a subscriber layer that records every new span's name and
//! fields, installed for this whole test binary (the engine's spans are
//! made on its own threads); an engine on a RocksDB directory runs a
//! workflow through an activity to a signal wait and is restarted, and
//! the signal makes the new engine replay the waiting run. Then a run of an
//! activity that sleeps its thread 60 ms while declaring `NON_BLOCKING`;
//! the layer records events too.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel::{
    Activity, ActivityContext, ActivityError, Engine, Workflow, WorkflowContext, WorkflowError,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::{filter::LevelFilter, Layer};

/// Every span made: its name and its fields as `name=value` pairs.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

struct Recorder(Seen);

impl<S: Subscriber> Layer<S> for Recorder {
    fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
        let mut fields = Fields(String::new());
        attrs.record(&mut fields);
        self.0
            .lock()
            .unwrap()
            .push((attrs.metadata().name().to_string(), fields.0));
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        self.0
            .lock()
            .unwrap()
            .push((format!("event {}", event.metadata().level()), fields.0));
    }
}

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, "{}={:?} ", field.name(), value);
    }
}

#[derive(Default)]
struct Pack;
impl Activity for Pack {
    const NAME: &'static str = "pack";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _: ActivityContext, n: u32) -> Result<u32, ActivityError> {
        Ok(n + 1)
    }
}

/// Declares `NON_BLOCKING`, then blocks its thread: a wrong declaration.
#[derive(Default)]
struct Sleepy;
impl Activity for Sleepy {
    const NAME: &'static str = "sleepy";
    type Input = u32;
    type Output = u32;
    const NON_BLOCKING: bool = true;
    async fn run(&self, _: ActivityContext, n: u32) -> Result<u32, ActivityError> {
        std::thread::sleep(Duration::from_millis(60));
        Ok(n)
    }
}

struct Nap;
impl Workflow for Nap {
    const NAME: &'static str = "nap";
    type Input = u32;
    type Output = u32;
    async fn run(ctx: WorkflowContext, n: u32) -> Result<u32, WorkflowError> {
        Ok(ctx.activity::<Sleepy>(n).await?)
    }
}

struct Parcel;
impl Workflow for Parcel {
    const NAME: &'static str = "parcel";
    type Input = u32;
    type Output = String;
    async fn run(ctx: WorkflowContext, n: u32) -> Result<String, WorkflowError> {
        let packed = ctx.activity::<Pack>(n).await?;
        let by = ctx.wait_signal::<String>("ship").await?;
        Ok(format!("{packed} shipped by {by}"))
    }
}

fn engine(dir: &std::path::Path) -> Engine {
    Engine::builder()
        .data_dir(dir)
        .register_workflow::<Parcel>()
        .register_activity::<Pack>()
        .register_workflow::<Nap>()
        .register_activity::<Sleepy>()
        .build()
        .expect("the engine opens its directory")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_traces_requests_commits_attempts_and_replays() -> anyhow::Result<()> {
    let seen: Seen = Arc::default();
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry().with(Recorder(seen.clone()).with_filter(LevelFilter::INFO)),
    )?;
    let dir = tempfile::tempdir()?;
    let run = {
        let engine = engine(dir.path());
        let c = engine.client();
        let run = c.start::<Parcel>("p-1", &41).await?.run_id();
        let mut waiting = false;
        for _ in 0..1000 {
            if c.describe("p-1")
                .await?
                .signal_waits
                .iter()
                .any(|(n, _)| n == "ship")
            {
                waiting = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(waiting, "the run never waited for its signal");
        engine.shutdown().await;
        run
    };
    let engine = engine(dir.path());
    let c = engine.client();
    c.signal("p-1", "ship", &"ops".to_string(), Some("ship-1"))
        .await?;
    assert_eq!(c.result::<Parcel>("p-1").await?, "42 shipped by ops");
    c.start::<Nap>("nap-1", &7).await?;
    assert_eq!(c.result::<Nap>("nap-1").await?, 7);
    engine.shutdown().await;

    let seen = seen.lock().unwrap();
    let find = |name: &str, has: &[String]| {
        seen.iter()
            .any(|(n, f)| n == name && has.iter().all(|h| f.contains(h)))
    };
    let run_field = format!("run_id={run}");
    for (name, has) in [
        ("request", vec!["kind=\"start\"".to_string()]),
        ("request", vec!["kind=\"signal\"".to_string()]),
        ("commit", vec!["commits=".to_string()]),
        (
            "attempt",
            vec![
                run_field.clone(),
                "step=".into(),
                "attempt=1".into(),
                "epoch=".into(),
            ],
        ),
        ("replay", vec![run_field.clone(), "events=".into()]),
        (
            "event WARN",
            vec![
                "activity_type=\"sleepy\"".into(),
                "NON_BLOCKING activity's first poll held".into(),
            ],
        ),
    ] {
        assert!(
            find(name, &has),
            "no span {name} with {has:?}; spans seen: {:?}",
            seen.iter()
                .map(|(n, _)| n.as_str())
                .collect::<std::collections::BTreeSet<_>>()
        );
    }
    Ok(())
}
