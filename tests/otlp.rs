//! Goal: built with the `otlp` feature, keel ships its spans to an
//! OpenTelemetry collector over OTLP/HTTP as the protocol's JSON: the
//! engine's `request`, `commit`, `attempt` and `replay` spans arrive with
//! their ids as attributes, valid trace and span ids, a child span in its
//! parent's trace, events inside a span as span events and an error event
//! as the span's error status. A collector that is down costs spans, never
//! blocks the engine, and every span is accounted for.
//! Method: a real HTTP server (actix-web on a loopback port) plays the
//! collector and keeps every body posted to /v1/traces; the exporter is
//! installed as the test binary's global subscriber (the engine makes its
//! spans on its own threads), and an engine on a RocksDB directory runs a
//! workflow through an activity to a signal wait, restarts and replays it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel::{
    Activity, ActivityContext, ActivityError, Engine, Workflow, WorkflowContext, WorkflowError,
};
use keel_cli::otlp::{self, OtlpConfig, OTLP_QUEUE_SPANS_MAX};
use serde_json::Value;
use tracing::Instrument as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::{filter::LevelFilter, Layer};

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
        .build()
        .expect("the engine opens its directory")
}

/// A collector: every JSON body posted to /v1/traces, kept in order.
struct Collector {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

fn collector() -> Collector {
    let bodies: Arc<Mutex<Vec<Value>>> = Arc::default();
    let (tx, rx) = std::sync::mpsc::channel();
    let kept = bodies.clone();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let server = actix_web::HttpServer::new(move || {
                let kept = kept.clone();
                actix_web::App::new().route(
                    "/v1/traces",
                    actix_web::web::post().to(
                        move |req: actix_web::HttpRequest, body: actix_web::web::Bytes| {
                            let kept = kept.clone();
                            async move {
                                let json = req
                                    .headers()
                                    .get("content-type")
                                    .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
                                match serde_json::from_slice::<Value>(&body) {
                                    Ok(v) if json => {
                                        kept.lock().unwrap().push(v);
                                        actix_web::HttpResponse::Ok()
                                            .content_type("application/json")
                                            .body("{}")
                                    }
                                    _ => actix_web::HttpResponse::BadRequest().finish(),
                                }
                            }
                        },
                    ),
                )
            })
            .workers(1)
            .bind("127.0.0.1:0")
            .expect("the collector binds a loopback port");
            tx.send(server.addrs()[0]).unwrap();
            server.run().await.unwrap();
        });
    });
    let addr = rx.recv().expect("the collector starts");
    Collector {
        url: format!("http://{addr}"),
        bodies,
    }
}

/// The value of attribute `key` of `span`, as the JSON OTLP gave it.
fn attribute<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| &a["value"])
}

fn is_hex(s: &Value, len: usize) -> bool {
    s.as_str().is_some_and(|s| {
        s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit()) && s.bytes().any(|b| b != b'0')
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_spans_reach_a_collector_over_otlp() -> anyhow::Result<()> {
    let collector = collector();
    let config = OtlpConfig::from_vars(|name| match name {
        "OTEL_EXPORTER_OTLP_ENDPOINT" => Some(collector.url.clone()),
        "OTEL_SERVICE_NAME" => Some("keel-otlp-test".into()),
        "OTEL_EXPORTER_OTLP_HEADERS" => Some("x-tenant=t1".into()),
        _ => None,
    })?
    .expect("an endpoint turns export on");
    let (layer, guard) = otlp::layer(config);
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry().with(layer.with_filter(LevelFilter::INFO)),
    )?;

    let dir = tempfile::tempdir()?;
    let run = {
        let engine = engine(dir.path());
        let c = engine.client();
        // The caller's own span: the engine's request span joins its trace.
        let checkout = tracing::info_span!("checkout", order = 7);
        let run = async {
            tracing::info!(step = "start", "starting the parcel");
            let run = c.start::<Parcel>("p-1", &41).await?.run_id();
            tracing::error!("the printer is out of paper");
            anyhow::Ok(run)
        }
        .instrument(checkout)
        .await?;
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
    engine.shutdown().await;
    guard.flush();
    // Dropping the guard sends the rest and joins the exporter: every body
    // is in before the counts are compared.
    let stats = guard.stats();
    drop(guard);

    let bodies = collector.bodies.lock().unwrap().clone();
    assert!(!bodies.is_empty(), "the collector received nothing");
    let mut spans = Vec::new();
    for body in &bodies {
        for rs in body["resourceSpans"].as_array().expect("resourceSpans") {
            let service = rs["resource"]["attributes"]
                .as_array()
                .and_then(|a| a.iter().find(|a| a["key"] == "service.name"))
                .map(|a| a["value"]["stringValue"].clone());
            assert_eq!(service, Some(Value::from("keel-otlp-test")));
            for ss in rs["scopeSpans"].as_array().expect("scopeSpans") {
                assert_eq!(ss["scope"]["name"], "keel");
                spans.extend(ss["spans"].as_array().expect("spans").iter().cloned());
            }
        }
    }
    assert_eq!(
        stats.exported.load(std::sync::atomic::Ordering::Relaxed),
        spans.len() as u64,
        "the exporter counts what the collector received"
    );
    for s in &spans {
        assert!(is_hex(&s["traceId"], 32), "bad traceId in {s}");
        assert!(is_hex(&s["spanId"], 16), "bad spanId in {s}");
        let start: u64 = s["startTimeUnixNano"].as_str().unwrap().parse()?;
        let end: u64 = s["endTimeUnixNano"].as_str().unwrap().parse()?;
        assert!(
            start > 1_600_000_000_000_000_000 && end >= start,
            "bad times in {s}"
        );
    }
    let named = |name: &'static str| spans.iter().filter(move |s| s["name"] == name);
    let run_id = Value::from(run.to_string());

    let checkout = named("checkout").next().expect("the caller's span");
    let start_request = named("request")
        .find(|s| attribute(s, "kind") == Some(&serde_json::json!({"stringValue": "start"})))
        .expect("a request span of kind start");
    assert_eq!(
        start_request["traceId"], checkout["traceId"],
        "the request joins the caller's trace"
    );
    assert_eq!(start_request["parentSpanId"], checkout["spanId"]);
    let events = checkout["events"].as_array().unwrap();
    assert!(
        events.iter().any(|e| e["name"] == "starting the parcel"
            && e["attributes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|a| a["key"] == "step")),
        "the span event with its field: {events:?}"
    );
    assert_eq!(
        checkout["status"]["code"], 2,
        "an error event marks the span failed"
    );
    assert_eq!(checkout["status"]["message"], "the printer is out of paper");

    assert!(named("request")
        .any(|s| attribute(s, "kind").map(|v| &v["stringValue"]) == Some(&Value::from("signal"))));
    assert!(
        named("commit").any(|s| attribute(s, "commits").is_some_and(|v| v["intValue"].is_string()))
    );
    let attempt = named("attempt")
        .find(|s| attribute(s, "run_id").map(|v| &v["stringValue"]) == Some(&run_id))
        .expect("the activity's attempt span");
    for key in ["step", "attempt", "epoch"] {
        assert!(
            attribute(attempt, key).is_some(),
            "attempt span lacks {key}: {attempt}"
        );
    }
    assert_eq!(attribute(attempt, "attempt").unwrap()["intValue"], "1");
    let replay = named("replay")
        .find(|s| attribute(s, "run_id").map(|v| &v["stringValue"]) == Some(&run_id))
        .expect("the replay of the waiting run after the restart");
    assert!(attribute(replay, "events").is_some());
    Ok(())
}

#[test]
fn a_collector_that_never_answers_costs_spans_never_blocks() {
    // A collector that takes connections and never answers: each export
    // request hangs until its timeout. Spans made meanwhile must be
    // dropped at the full queue, not wait for room.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let config =
        OtlpConfig::from_vars(|name| (name == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| url.clone()))
            .unwrap()
            .unwrap();
    let (layer, guard) = otlp::layer(config);
    let stats = guard.stats();
    let total = OTLP_QUEUE_SPANS_MAX as u64 * 2;
    let subscriber = tracing_subscriber::registry().with(layer.with_filter(LevelFilter::INFO));
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..total {
            let _span = tracing::info_span!("burst", i).entered();
        }
    });
    let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    // Twice the queue was made while the exporter hangs on its first
    // request: at least the overflow was dropped, not waited for.
    assert!(
        load(&stats.dropped) >= total - OTLP_QUEUE_SPANS_MAX as u64 - 1_024,
        "dropped {} of {total}",
        load(&stats.dropped)
    );
    // Dropping the guard gives the exporter one timeout to send the rest,
    // then it drops what is left and stops.
    drop(guard);
    assert_eq!(load(&stats.exported), 0, "nothing was answered");
    assert_eq!(
        load(&stats.dropped) + load(&stats.failed),
        total,
        "every span is either dropped or lost with its batch"
    );
    drop(silent);
}
