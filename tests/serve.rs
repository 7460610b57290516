//! Goal: `keel serve`'s HTTP API does what its OpenAPI document says over a
//! real engine: an order started over HTTP waits for its approval, is
//! found by a filtered list, described with its open wait, signalled, and
//! completes; its history pages and its bundle exports. Bad input gets a
//! 4xx naming the field and writes nothing; tokens let exactly the right
//! callers in; `/metrics` is Prometheus text that counts what was served;
//! every route the document lists is served; `/healthz` lists a shard
//! that is down.
//! Method: the demo's engine on a RocksDB directory in a temporary folder,
//! mounted with `keel_cli::serve::configure` into an actix-web test
//! service, called in-process with real HTTP requests and JSON bodies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{test, App};
use keel_cli::serve::{configure, ConfigError, ServeConfig, ServeState, OPENAPI_JSON};
use serde_json::{json, Value};

const FULL: &str = "operator-token-0123456789";
const READ: &str = "viewer-token-0123456789";

fn engine(dir: &std::path::Path) -> Arc<keel::Engine> {
    Arc::new(
        keel_cli::demo_app::engine_builder()
            .data_dir(dir)
            .build()
            .expect("the engine opens a fresh directory"),
    )
}

async fn call<S>(app: &S, req: test::TestRequest) -> (StatusCode, Value)
where
    S: Service<actix_http::Request, Response = ServiceResponse, Error = actix_web::Error>,
{
    let res = test::call_service(app, req.to_request()).await;
    let status = res.status();
    let bytes = res.into_body().try_into_bytes().unwrap_or_default();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, body)
}

fn get(path: &str) -> test::TestRequest {
    test::TestRequest::get().uri(path)
}

fn post(path: &str, body: Value) -> test::TestRequest {
    test::TestRequest::post().uri(path).set_json(body)
}

fn large_order(id: u64) -> Value {
    json!({"id": id, "cents": 75_000, "sku": "sku-9"})
}

#[actix_web::test]
async fn an_order_started_over_http_waits_is_signalled_and_completes() {
    let dir = tempfile::tempdir().unwrap();
    let state = ServeState::new(engine(dir.path()), &ServeConfig::default()).unwrap();
    let app = test::init_service(App::new().configure(configure(state))).await;

    let start = json!({
        "workflow_type": "demo.order",
        "instance_id": "order-9",
        "input": large_order(9),
        "command_id": "start-order-9",
        "search_attributes": {"customer": "c-42"},
    });
    let (status, started) = call(&app, post("/api/v1/runs", start.clone())).await;
    assert_eq!(status, StatusCode::CREATED, "{started}");
    assert_eq!(started["started"], true);
    let run_id = started["run_id"].as_str().unwrap().to_string();
    // The same command again is the same start.
    let (status, again) = call(&app, post("/api/v1/runs", start)).await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(again["run_id"], run_id.as_str());
    assert_eq!(again["started"], false);

    // It waits for its approval: describe shows the open wait.
    let deadline = Instant::now() + Duration::from_secs(20);
    let described = loop {
        let (status, d) = call(&app, get("/api/v1/runs/order-9")).await;
        assert_eq!(status, StatusCode::OK, "{d}");
        let waits = d["signal_waits"].as_array().cloned().unwrap_or_default();
        if waits.iter().any(|w| w[0] == "approve") {
            break d;
        }
        assert!(Instant::now() < deadline, "never waited for approve: {d}");
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(described["status"], "running");
    assert_eq!(described["run_id"], run_id.as_str());
    assert_eq!(described["search_attributes"]["customer"], "c-42");

    // A filtered list finds it; another filter does not.
    let (status, page) = call(
        &app,
        get("/api/v1/runs?where=customer%20%3D%20%22c-42%22&status=running"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert_eq!(page["runs"].as_array().unwrap().len(), 1, "{page}");
    assert_eq!(page["runs"][0]["instance_id"], "order-9");
    let (_, none) = call(&app, get("/api/v1/runs?status=completed")).await;
    assert_eq!(none["runs"].as_array().unwrap().len(), 0, "{none}");

    // Not closed yet: the result says so at once.
    let (status, running) = call(&app, get("/api/v1/runs/order-9/result")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{running}");
    assert_eq!(running["status"], "running");

    let signal = json!({"name": "approve", "payload": "ops-team", "command_id": "approve-9"});
    let (status, body) = call(&app, post("/api/v1/runs/order-9/signal", signal)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, outcome) = call(&app, get("/api/v1/runs/order-9/result?wait_ms=20000")).await;
    assert_eq!(status, StatusCode::OK, "{outcome}");
    assert_eq!(outcome["status"], "completed", "{outcome}");
    assert_eq!(outcome["result"]["approved_by"], "ops-team", "{outcome}");

    // The store-wide counts the page shows: one completed run, nothing
    // open or parked, every status named.
    let (status, counts) = call(&app, get("/api/v1/counts")).await;
    assert_eq!(status, StatusCode::OK, "{counts}");
    assert_eq!(counts["counts"]["completed"], 1, "{counts}");
    assert_eq!(counts["counts"]["running"], 0, "{counts}");
    assert_eq!(counts["counts"].as_object().unwrap().len(), 7, "{counts}");
    assert_eq!(counts["parked"], 0, "{counts}");
    assert_eq!(counts["limit"], 10_000, "{counts}");

    // The history pages; the pages join up to the whole history.
    let (status, first) = call(&app, get("/api/v1/runs/order-9/history?limit=3")).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["events"].as_array().unwrap().len(), 3);
    assert_eq!(first["next_from"], 4);
    let total = first["total"].as_u64().unwrap();
    let (_, rest) = call(&app, get("/api/v1/runs/order-9/history?from=4&limit=1000")).await;
    assert_eq!(rest["events"].as_array().unwrap().len() as u64, total - 3);
    assert_eq!(rest["next_from"], Value::Null);
    assert_eq!(rest["events"][0]["seq"], 4);
    assert!(rest["events"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["kind"] == "SignalReceived" || e["payload"] == "ops-team"));

    // The bundle is the one `keel replay` reads.
    let res = test::call_service(&app, get("/api/v1/runs/order-9/export").to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let bytes = res.into_body().try_into_bytes().unwrap();
    let bundle = keel::Bundle::decode(&bytes).expect("a valid bundle");
    assert_eq!(bundle.events.len() as u64, total);

    // This build's code replays the history as recorded (what the page
    // shows beside a parked run); an unknown run is a 404.
    let (status, replay) = call(&app, get("/api/v1/runs/order-9/replay")).await;
    assert_eq!(status, StatusCode::OK, "{replay}");
    assert_eq!(replay["result"], "ok", "{replay}");
    assert_eq!(replay["events"], total, "{replay}");
    assert_eq!(replay["status"], "completed", "{replay}");
    assert_eq!(replay["run_id"], run_id.as_str(), "{replay}");
    let (status, missing) = call(&app, get("/api/v1/runs/no-such-order/replay")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{missing}");
}

#[actix_web::test]
async fn bad_input_gets_a_4xx_naming_the_field_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = ServeState::new(engine(dir.path()), &ServeConfig::default()).unwrap();
    let app = test::init_service(App::new().configure(configure(state))).await;
    let error = |body: &Value| {
        (
            body["error"]["code"].as_str().unwrap_or("").to_string(),
            body["error"]["field"].as_str().unwrap_or("").to_string(),
        )
    };

    let malformed = test::TestRequest::post()
        .uri("/api/v1/runs")
        .insert_header(("content-type", "application/json"))
        .set_payload("{\"workflow_type\": ");
    let (status, body) = call(&app, malformed).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(error(&body).0, "bad_json");

    let cases = [
        (
            json!({"workflow_type": "demo.order", "instance_id": "a", "input": large_order(1)}),
            StatusCode::BAD_REQUEST,
            "bad_json",
            "command_id",
        ),
        (
            json!({"workflow_type": "demo.order", "instance_id": "a", "command_id": "c", "colour": 1}),
            StatusCode::BAD_REQUEST,
            "bad_json",
            "colour",
        ),
        (
            json!({"workflow_type": "no.such", "instance_id": "a", "command_id": "c"}),
            StatusCode::BAD_REQUEST,
            "unknown_workflow_type",
            "workflow_type",
        ),
        (
            json!({"workflow_type": "demo.order", "instance_id": "", "command_id": "c"}),
            StatusCode::BAD_REQUEST,
            "bad_input",
            "instance_id",
        ),
        (
            json!({"workflow_type": "demo.order", "instance_id": "a", "command_id": "c", "reuse": "sometimes"}),
            StatusCode::BAD_REQUEST,
            "bad_input",
            "reuse",
        ),
        (
            json!({"workflow_type": "demo.order", "instance_id": "a", "command_id": "c", "input": {"id": "not a number"}}),
            StatusCode::BAD_REQUEST,
            "invalid_input",
            "input",
        ),
    ];
    for (body, want_status, want_code, want_field) in cases {
        let (status, got) = call(&app, post("/api/v1/runs", body.clone())).await;
        assert_eq!(status, want_status, "{body} -> {got}");
        assert_eq!(
            error(&got),
            (want_code.to_string(), want_field.to_string()),
            "{body} -> {got}"
        );
    }

    let huge = "x".repeat(keel_cli::serve::BODY_BYTES_MAX + 1);
    let big = json!({"workflow_type": "demo.order", "instance_id": "a", "command_id": "c", "input": huge});
    let (status, body) = call(&app, post("/api/v1/runs", big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    let over_payload = "x".repeat(keel::storage::PAYLOAD_BYTES_MAX + 16);
    let big = json!({"workflow_type": "demo.order", "instance_id": "a", "command_id": "c", "input": over_payload});
    let (status, body) = call(&app, post("/api/v1/runs", big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert_eq!(error(&body).1, "input");

    let (status, body) = call(&app, get("/api/v1/runs/no-such-order")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let signal = json!({"name": "approve", "payload": "x", "command_id": "c"});
    let (status, body) = call(&app, post("/api/v1/runs/no-such-order/signal", signal)).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("no-such-order"),
        "the refusal names the id: {body}"
    );
    let (status, body) = call(&app, get("/api/v1/runs?status=sleeping")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(error(&body).1, "status");
    let (status, body) = call(&app, get("/api/v1/runs?page_size=0")).await;
    assert_eq!(error(&body).1, "page_size", "{status} {body}");
    let (status, body) = call(&app, get("/api/v1/runs?where=customer%20%3D")).await;
    assert_eq!(
        (status, error(&body).1),
        (StatusCode::BAD_REQUEST, "where".into()),
        "{body}"
    );
    let (status, body) = call(&app, get("/api/v1/runs?colour=red")).await;
    assert_eq!(
        (status, error(&body).1),
        (StatusCode::BAD_REQUEST, "colour".into()),
        "{body}"
    );
    // A body that does not say it is JSON (what a cross-site form sends).
    let form = test::TestRequest::post()
        .uri("/api/v1/runs/x/terminate")
        .insert_header(("content-type", "text/plain"))
        .set_payload("{\"reason\": \"\", \"command_id\": \"c\"}");
    let (status, body) = call(&app, form).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{body}");
    // Without a token: only loopback names, only loopback origins.
    let rebound = get("/api/v1/runs").insert_header(("host", "evil.example:8233"));
    let (status, body) = call(&app, rebound).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let foreign = get("/api/v1/runs")
        .insert_header(("host", "127.0.0.1:8233"))
        .insert_header(("origin", "https://evil.example"));
    let (status, body) = call(&app, foreign).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let local = get("/api/v1/runs")
        .insert_header(("host", "localhost:8233"))
        .insert_header(("origin", "http://localhost:8233"));
    let (status, body) = call(&app, local).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // An optional body, once sent, is checked like any other.
    let (status, body) = call(&app, post("/api/v1/runs/x/resume", json!({"colour": 1}))).await;
    assert_eq!(
        (status, error(&body).1),
        (StatusCode::BAD_REQUEST, "colour".into()),
        "{body}"
    );
    let (status, body) = call(&app, get("/api/v1/runs/x/signal")).await;
    assert_eq!(
        (status, error(&body).0),
        (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed".into()),
        "{body}"
    );
    let (status, body) = call(&app, get("/api/v1/nothing/here")).await;
    assert_eq!(
        (status, error(&body).0),
        (StatusCode::NOT_FOUND, "no_route".into()),
        "{body}"
    );

    // Nothing above wrote a run.
    let (_, page) = call(&app, get("/api/v1/runs")).await;
    assert_eq!(page["runs"].as_array().unwrap().len(), 0, "{page}");
}

#[actix_web::test]
async fn tokens_let_exactly_the_right_callers_in() {
    let dir = tempfile::tempdir().unwrap();
    let config = ServeConfig {
        token: Some(FULL.into()),
        read_token: Some(READ.into()),
        ..ServeConfig::default()
    };
    let state = ServeState::new(engine(dir.path()), &config).unwrap();
    let app = test::init_service(App::new().configure(configure(state))).await;
    let start = json!({"workflow_type": "demo.order", "instance_id": "o-1", "input": {"id": 1, "cents": 100, "sku": "s"}, "command_id": "c-1"});
    let bearer = |t: &str| ("Authorization", format!("Bearer {t}"));

    let (status, body) = call(&app, get("/api/v1/runs")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let (status, _) = call(
        &app,
        get("/api/v1/runs").insert_header(bearer("guess-guess-guess-guess")),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = call(&app, get("/metrics")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // The health probe alone needs no token, and says only the state.
    let (status, health) = call(&app, get("/healthz")).await;
    assert_eq!(status, StatusCode::OK, "{health}");
    assert_eq!(health, json!({"store": "healthy"}));

    let (status, body) = call(
        &app,
        post("/api/v1/runs", start.clone()).insert_header(bearer(READ)),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let (status, who) = call(&app, get("/api/v1/whoami").insert_header(bearer(READ))).await;
    assert_eq!(
        (status, who["access"].as_str()),
        (StatusCode::OK, Some("read"))
    );
    let (status, body) = call(
        &app,
        post("/api/v1/runs", start).insert_header(bearer(FULL)),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, page) = call(&app, get("/api/v1/runs").insert_header(bearer(READ))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(page["runs"].as_array().unwrap().len(), 1);
    // The page itself holds no data and is served to anyone.
    let res = test::call_service(&app, get("/").to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
}

#[actix_web::test]
async fn a_server_open_to_the_network_needs_a_token() {
    let open = ServeConfig {
        bind: "0.0.0.0:8233".parse().unwrap(),
        ..ServeConfig::default()
    };
    assert!(matches!(open.check(), Err(ConfigError::OpenToNetwork(_))));
    let guarded = ServeConfig {
        token: Some(FULL.into()),
        ..open.clone()
    };
    assert_eq!(guarded.check(), Ok(()));
    let weak = ServeConfig {
        token: Some("short".into()),
        ..open.clone()
    };
    assert!(matches!(weak.check(), Err(ConfigError::WeakToken { .. })));
    let readers_only = ServeConfig {
        read_token: Some(READ.into()),
        ..ServeConfig::default()
    };
    assert_eq!(readers_only.check(), Err(ConfigError::ReadTokenAlone));
    assert_eq!(ServeConfig::default().check(), Ok(()));
    let v6 = ServeConfig {
        bind: "[::1]:8233".parse().unwrap(),
        ..ServeConfig::default()
    };
    assert_eq!(v6.check(), Ok(()));
}

#[actix_web::test]
async fn metrics_are_prometheus_text_counting_what_was_served() {
    let dir = tempfile::tempdir().unwrap();
    let state = ServeState::new(engine(dir.path()), &ServeConfig::default()).unwrap();
    let app = test::init_service(App::new().configure(configure(state))).await;
    let start = json!({"workflow_type": "demo.order", "instance_id": "m-1", "input": {"id": 1, "cents": 100, "sku": "s"}, "command_id": "c-1"});
    let (status, _) = call(&app, post("/api/v1/runs", start)).await;
    assert_eq!(status, StatusCode::CREATED);
    call(&app, get("/api/v1/runs/nope")).await;
    // It runs its activities and completes: the engine counts commits,
    // inputs and attempts.
    let (status, done) = call(&app, get("/api/v1/runs/m-1/result?wait_ms=20000")).await;
    assert_eq!(status, StatusCode::OK, "{done}");
    // A large order waits for approval; the same signal sent twice is
    // committed once and its repeat dropped as a duplicate.
    let big = json!({"workflow_type": "demo.order", "instance_id": "m-2", "input": large_order(2), "command_id": "c-2"});
    let (status, _) = call(&app, post("/api/v1/runs", big)).await;
    assert_eq!(status, StatusCode::CREATED);
    // While it waits, the store holds one open run.
    let res = test::call_service(&app, get("/metrics").to_request()).await;
    let text = String::from_utf8(res.into_body().try_into_bytes().unwrap().to_vec()).unwrap();
    assert!(text.lines().any(|l| l == "keel_runs_open 1"), "{text}");
    let signal = json!({"name": "approve", "payload": "ops", "command_id": "approve-m-2"});
    for _ in 0..2 {
        let (status, body) = call(&app, post("/api/v1/runs/m-2/signal", signal.clone())).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let (status, done) = call(&app, get("/api/v1/runs/m-2/result?wait_ms=20000")).await;
    assert_eq!(status, StatusCode::OK, "{done}");
    let res = test::call_service(&app, get("/metrics").to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let kind = res
        .headers()
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(kind.starts_with("text/plain; version=0.0.4"), "{kind}");
    let text = String::from_utf8(res.into_body().try_into_bytes().unwrap().to_vec()).unwrap();
    for want in [
        "keel_api_requests_total{method=\"POST\",route=\"/api/v1/runs\",status=\"201\"} 2",
        "keel_api_requests_total{method=\"GET\",route=\"/api/v1/runs/{id}\",status=\"404\"} 1",
        "keel_api_requests_total{method=\"POST\",route=\"/api/v1/runs/{id}/signal\",status=\"200\"} 2",
        "keel_api_request_duration_seconds_count 7",
        "keel_api_request_duration_seconds_bucket{le=\"+Inf\"} 7",
        "# TYPE keel_runs_cached gauge",
        "keel_store_writable 1",
        "keel_inputs_total{kind=\"signal\"} 1",
        "keel_inputs_total{kind=\"start\"} 2",
        "keel_duplicates_dropped_total 1",
        "keel_runs_parked 0",
        "keel_runs_open 0",
        "keel_lease_expiries_total 0",
        "# TYPE keel_commit_duration_seconds histogram",
        "# TYPE keel_store_write_sync_duration_seconds histogram",
        "# TYPE keel_timer_lag_seconds histogram",
        "# TYPE keel_resilience_rejections_total counter",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    let value = |name: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .unwrap_or_else(|| panic!("no sample {name} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    // Two orders of four activities each (the demo's charge may fail and
    // retry): every attempt that ended is counted by outcome.
    assert!(
        value("keel_attempts_total{outcome=\"completed\"}") >= 8.0,
        "{text}"
    );
    assert!(
        value("keel_inputs_total{kind=\"activity_completed\"}") >= 8.0,
        "{text}"
    );
    // Each accepted input and each start is a commit; the store's writer
    // wrote them in groups and timed each group's sync.
    let commits = value("keel_commits_total");
    assert!(commits >= 10.0, "{text}");
    assert_eq!(
        value("keel_commit_duration_seconds_count"),
        commits,
        "{text}"
    );
    assert!(value("keel_store_commits_total") >= commits, "{text}");
    let groups = value("keel_store_group_size_commits_count");
    assert!(
        groups >= 1.0
            && groups
                <= value("keel_store_commits_total") + value("keel_store_commits_refused_total"),
        "{text}"
    );
    assert_eq!(
        value("keel_store_write_sync_duration_seconds_count"),
        groups,
        "{text}"
    );
    assert_eq!(value("keel_outbox_backlog_rows"), 0.0, "{text}");

    // The sample Grafana dashboard graphs only series this endpoint has.
    let dashboard: Value = serde_json::from_str(include_str!("../docs/grafana-dashboard.json"))
        .expect("the dashboard is JSON");
    let mut graphed = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for (at, _) in expr.match_indices("keel_") {
                let name: String = expr[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(&name);
                assert!(
                    text.contains(&format!("# TYPE {family} ")),
                    "the dashboard graphs {name}, which /metrics does not export"
                );
                graphed += 1;
            }
        }
    }
    assert!(graphed >= 20, "{graphed}");
    // Every sample line is `name{labels} value` with a number for value.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let value = line.rsplit(' ').next().unwrap();
        assert!(value.parse::<f64>().is_ok(), "not a sample: {line}");
    }
}

#[actix_web::test]
async fn every_route_the_openapi_document_lists_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let state = ServeState::new(engine(dir.path()), &ServeConfig::default()).unwrap();
    let app = test::init_service(App::new().configure(configure(state))).await;
    let doc: Value = serde_json::from_str(OPENAPI_JSON).expect("the document is JSON");
    assert_eq!(doc["openapi"], "3.0.3");
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 12, "{}", paths.len());
    for (path, ops) in paths {
        for method in ops.as_object().unwrap().keys() {
            let uri = format!("/api/v1{}", path.replace("{id}", "no-such-run"));
            let req = match method.as_str() {
                "get" => get(&uri),
                "post" => post(&uri, json!({})),
                other => panic!("unexpected method {other}"),
            };
            let (_, body) = call(&app, req).await;
            assert_ne!(body["error"]["code"], "no_route", "{method} {uri}: {body}");
        }
    }
    // And the other way: every resource the API's code mounts is in the
    // document (read from the source the server is built from).
    let source = include_str!("../crates/cli/src/serve/api.rs");
    let mounted: Vec<&str> = source
        .split("resource(\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .filter(|p| p.starts_with('/'))
        .collect();
    assert!(mounted.len() >= 12, "{mounted:?}");
    for path in mounted {
        assert!(
            paths.contains_key(path),
            "{path} is served but not documented"
        );
    }
    let res = test::call_service(&app, get("/api/openapi.json").to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let served = res.into_body().try_into_bytes().unwrap();
    assert_eq!(&served[..], OPENAPI_JSON.as_bytes());
}

/// Goal: the CLI's `--server` commands drive a real `keel serve` over
/// TCP: start, signal, query-free resume of an unparked run, and a refusal
/// printed with the server's field. Method: a real actix-web server on a
/// loopback port, the commands run through `keel_cli::run` as the binary
/// runs them, the run's completion checked through the engine.
#[actix_web::test]
async fn the_cli_drives_a_running_server() {
    use keel_cli::remote::{ServerArgs, SignalArgs, StartArgs};
    use std::process::ExitCode;
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(dir.path());
    let client = engine.client();
    let config = ServeConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        workers: 1,
        ..ServeConfig::default()
    };
    let serving = keel_cli::serve::spawn(engine, &config).unwrap();
    let server = ServerArgs {
        server: serving.url(),
        token: None,
        json: true,
    };
    let registry = keel_cli::registry();
    let run = move |cmd: keel_cli::Command| {
        let registry = registry.clone();
        std::thread::spawn(move || keel_cli::run(cmd, &registry))
            .join()
            .unwrap()
    };
    let start = StartArgs {
        server: server.clone(),
        workflow_type: "demo.order".into(),
        instance_id: "cli-9".into(),
        input: large_order(9).to_string(),
        command_id: Some("start-cli-9".into()),
        reuse: None,
    };
    assert_eq!(run(keel_cli::Command::Start(start)), ExitCode::SUCCESS);
    let bad = StartArgs {
        server: server.clone(),
        workflow_type: "no.such".into(),
        instance_id: "cli-x".into(),
        input: "null".into(),
        command_id: None,
        reuse: None,
    };
    assert_eq!(run(keel_cli::Command::Start(bad)), ExitCode::from(2));
    let signal = SignalArgs {
        server: server.clone(),
        id: "cli-9".into(),
        name: "approve".into(),
        payload: "\"cli\"".into(),
        command_id: Some("approve-cli-9".into()),
    };
    assert_eq!(run(keel_cli::Command::Signal(signal)), ExitCode::SUCCESS);
    let receipt = tokio::time::timeout(
        Duration::from_secs(20),
        client.result::<keel_cli::demo_app::ProcessOrder>("cli-9"),
    )
    .await
    .expect("completes once approved")
    .unwrap();
    assert_eq!(receipt.approved_by.as_deref(), Some("cli"));
    serving.stop().unwrap();
}

/// Goal: cancel and terminate over HTTP reach real runs (a waiting order
/// records the cancel request, the same command again changes nothing,
/// another order is terminated at once); schedules are listed, described,
/// paused and unpaused, with 404 for an unknown one, 400 for a note too
/// long and 403 for a viewer. Method: the demo's engine, one schedule
/// created through the engine's client, calls through the API.
#[actix_web::test]
async fn runs_close_and_schedules_pause_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(dir.path());
    engine
        .client()
        .schedules()
        .create(
            "hourly-order",
            keel::NewSchedule::new(
                keel::ScheduleSpec::every(Duration::from_secs(3600)),
                keel::ScheduleAction::start::<keel_cli::demo_app::ProcessOrder>(
                    &keel_cli::demo_app::order(1),
                )
                .unwrap(),
            ),
        )
        .await
        .unwrap();
    let config = ServeConfig {
        token: Some(FULL.into()),
        read_token: Some(READ.into()),
        ..ServeConfig::default()
    };
    let state = ServeState::new(engine, &config).unwrap();
    let app = test::init_service(App::new().configure(configure(state))).await;
    let auth = |t: &str| ("Authorization", format!("Bearer {t}"));

    // Two large orders wait for their approval.
    for id in [1, 2] {
        let start = json!({"workflow_type": "demo.order", "instance_id": format!("big-{id}"),
            "input": large_order(id), "command_id": format!("start-big-{id}")});
        let (status, body) =
            call(&app, post("/api/v1/runs", start).insert_header(auth(FULL))).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }
    let cancel = json!({"reason": "customer asked", "command_id": "cancel-big-1"});
    let (status, body) = call(
        &app,
        post("/api/v1/runs/big-1/cancel", cancel.clone()).insert_header(auth(FULL)),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, again) = call(
        &app,
        post("/api/v1/runs/big-1/cancel", cancel).insert_header(auth(FULL)),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "the same command again: {again}");
    // Cancellation is cooperative: the order, which does not look for
    // it, stays open with the request recorded.
    let (status, d) = call(&app, get("/api/v1/runs/big-1").insert_header(auth(READ))).await;
    assert_eq!(status, StatusCode::OK, "{d}");
    assert_eq!(d["cancel_requested"], true, "{d}");
    assert_eq!(d["status"], "running", "{d}");

    let terminate = json!({"reason": "stuck", "command_id": "terminate-big-2"});
    let (status, body) = call(
        &app,
        post("/api/v1/runs/big-2/terminate", terminate).insert_header(auth(FULL)),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, d) = call(&app, get("/api/v1/runs/big-2").insert_header(auth(READ))).await;
    assert_eq!(d["status"], "terminated", "{d}");
    assert_eq!(d["outcome"]["reason"], "stuck", "{d}");

    // Schedules.
    let (status, list) = call(&app, get("/api/v1/schedules").insert_header(auth(READ))).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    let rows = list["schedules"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{list}");
    assert_eq!(rows[0]["id"], "hourly-order");
    assert_eq!(rows[0]["summary"]["workflow_type"], "demo.order", "{list}");
    assert_eq!(rows[0]["summary"]["paused"], false, "{list}");
    let (status, d) = call(
        &app,
        get("/api/v1/schedules/hourly-order").insert_header(auth(READ)),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{d}");
    assert_eq!(d["spec"]["intervals"][0]["every_ms"], 3_600_000, "{d}");
    assert_eq!(d["next"].as_array().unwrap().len(), 5, "{d}");
    assert_eq!(d["instance_id"], "keel.schedule/hourly-order", "{d}");

    let note = json!({"note": "inventory count"});
    let (status, body) = call(
        &app,
        post("/api/v1/schedules/hourly-order/pause", note.clone()).insert_header(auth(READ)),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "a viewer cannot pause: {body}"
    );
    // The engine keeps notes up to its own limit, which the API checks.
    let long = json!({"note": "x".repeat(keel::schedule::SCHEDULE_NOTE_BYTES_MAX + 1)});
    let (status, body) = call(
        &app,
        post("/api/v1/schedules/hourly-order/pause", long).insert_header(auth(FULL)),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["field"], "note", "{body}");
    let (status, body) = call(
        &app,
        post("/api/v1/schedules/hourly-order/pause", note).insert_header(auth(FULL)),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, d) = call(
        &app,
        get("/api/v1/schedules/hourly-order").insert_header(auth(READ)),
    )
    .await;
    assert_eq!(
        (d["paused"].clone(), d["note"].clone()),
        (json!(true), json!("inventory count")),
        "{d}"
    );
    assert_eq!(
        d["next"].as_array().unwrap().len(),
        0,
        "no next times while paused: {d}"
    );
    // The body may be left out.
    let (status, body) = call(
        &app,
        test::TestRequest::post()
            .uri("/api/v1/schedules/hourly-order/unpause")
            .insert_header(auth(FULL)),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, d) = call(
        &app,
        get("/api/v1/schedules/hourly-order").insert_header(auth(READ)),
    )
    .await;
    assert_eq!(d["paused"], false, "{d}");
    let (status, body) = call(
        &app,
        get("/api/v1/schedules/no-such").insert_header(auth(READ)),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
}

// Goal: `/healthz` answers 503 and lists a shard that stays down (one that
// panicked more often than the engine restarts it), while the store itself
// is still healthy, so a load balancer takes the process out.
// Method: the demo's engine with one shard on a store that panics on every
// commit once armed (`engine::CountingStore`); starts over HTTP make the
// shard commit until the engine gives it up; then the probe is read.
#[actix_web::test]
async fn healthz_lists_a_shard_that_is_down() {
    let store = Arc::new(crate::engine::CountingStore::new());
    let engine = Arc::new(
        keel_cli::demo_app::engine_builder()
            .store(store.clone())
            .shards(1)
            .build()
            .expect("the engine starts"),
    );
    let state = ServeState::new(engine.clone(), &ServeConfig::default()).unwrap();
    let app = test::init_service(App::new().configure(configure(state))).await;
    let (status, health) = call(&app, get("/healthz")).await;
    assert_eq!(
        (status, health),
        (StatusCode::OK, json!({"store": "healthy"}))
    );

    store
        .panics
        .store(u32::MAX, std::sync::atomic::Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut n = 0u64;
    while engine.shards_down().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the shard was given up within 60 s"
        );
        n += 1;
        let start = json!({"workflow_type": "demo.order", "instance_id": format!("down-{n}"),
            "input": {"id": n, "cents": 100, "sku": "s"}, "command_id": format!("c-{n}")});
        let answered = tokio::time::timeout(
            Duration::from_secs(20),
            call(&app, post("/api/v1/runs", start)),
        )
        .await;
        assert!(answered.is_ok(), "a start on a panicking shard is answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, health) = call(&app, get("/healthz")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{health}");
    assert_eq!(health, json!({"store": "healthy", "shards_down": [0]}));
}
