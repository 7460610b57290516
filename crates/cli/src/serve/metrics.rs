//! `/metrics` in the Prometheus text format (version 0.0.4): what the API
//! served and how fast, and what the engine holds now. Names follow the
//! glossary with the unit last.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use actix_web::{web, HttpResponse};

use super::auth::CanRead;
use super::ServeState;

/// Upper bounds of the API latency histogram's buckets, in seconds.
const LATENCY_BUCKETS_SECONDS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Most distinct (method, route, status) series kept; later ones are
/// counted under route `other` so a scan of odd URLs cannot grow memory.
const REQUEST_SERIES_MAX: usize = 512;

/// What the server counts itself.
#[derive(Default, Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, String, u16), u64>>,
    latency_buckets: [AtomicU64; LATENCY_BUCKETS_SECONDS.len()],
    latency_count: AtomicU64,
    latency_sum_micros: AtomicU64,
}

impl Metrics {
    /// Counts one answered API request.
    pub fn observe(&self, method: &str, route: &str, status: u16, took: Duration) {
        // Any token is a method to HTTP: only the ones the API serves are
        // labels, so made-up methods cannot grow the series.
        let method = match method {
            "GET" | "POST" | "HEAD" | "PUT" | "DELETE" | "PATCH" | "OPTIONS" => method,
            _ => "OTHER",
        };
        {
            let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
            let key = (method.to_string(), route.to_string(), status);
            if requests.len() >= REQUEST_SERIES_MAX && !requests.contains_key(&key) {
                *requests
                    .entry((method.to_string(), "other".into(), status))
                    .or_default() += 1;
            } else {
                *requests.entry(key).or_default() += 1;
            }
        }
        let secs = took.as_secs_f64();
        for (bound, bucket) in LATENCY_BUCKETS_SECONDS.iter().zip(&self.latency_buckets) {
            if secs <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        self.latency_sum_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// The server's own series, in the text format.
    fn write(&self, out: &mut String) {
        out.push_str(
            "# HELP keel_api_requests_total API requests answered, by method, route and status.\n",
        );
        out.push_str("# TYPE keel_api_requests_total counter\n");
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        for ((method, route, status), n) in requests.iter() {
            let _ = writeln!(
                out,
                "keel_api_requests_total{{method=\"{}\",route=\"{}\",status=\"{status}\"}} {n}",
                escape(method),
                escape(route)
            );
        }
        drop(requests);
        out.push_str("# HELP keel_api_request_duration_seconds Time to answer an API request.\n");
        out.push_str("# TYPE keel_api_request_duration_seconds histogram\n");
        for (bound, bucket) in LATENCY_BUCKETS_SECONDS.iter().zip(&self.latency_buckets) {
            let _ = writeln!(
                out,
                "keel_api_request_duration_seconds_bucket{{le=\"{bound}\"}} {}",
                bucket.load(Ordering::Relaxed)
            );
        }
        let count = self.latency_count.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "keel_api_request_duration_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            out,
            "keel_api_request_duration_seconds_sum {}",
            self.latency_sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "keel_api_request_duration_seconds_count {count}");
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn gauge(out: &mut String, name: &str, help: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    let _ = writeln!(out, "{name} {value}");
}

/// `GET /metrics`.
pub(crate) async fn scrape(_: CanRead, state: web::Data<ServeState>) -> HttpResponse {
    let mut out = String::with_capacity(4096);
    if let Some(engine) = &state.engine {
        let (runs, attempts) = engine.in_memory().await;
        gauge(
            &mut out,
            "keel_runs_cached",
            "Runs whose machines the engine holds in memory.",
            runs,
        );
        gauge(
            &mut out,
            "keel_attempts_supervised",
            "Activity attempts the engine supervises now.",
            attempts,
        );
    }
    let health = state.store.health();
    gauge(
        &mut out,
        "keel_store_writable",
        "1 when the store accepts commits, 0 when it refuses them (a full or failing disk, a lost lease).",
        u8::from(matches!(health, keel_storage::StoreHealth::Healthy)),
    );
    if let Some(bytes) = state.store.memory_bytes() {
        gauge(
            &mut out,
            "keel_store_memory_bytes",
            "Memory the store itself uses (caches, memtables).",
            bytes,
        );
    }
    state.metrics.write(&mut out);
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(out)
}
