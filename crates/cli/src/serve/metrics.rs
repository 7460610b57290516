//! `/metrics` in the Prometheus text format (version 0.0.4): what the API
//! served and how fast, and what the engine holds now. Names follow the
//! glossary with the unit last.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use actix_web::{web, HttpResponse};

use keel::storage::stats::{Histogram, HistogramSnapshot};
use keel::EngineStats;

use super::auth::CanRead;
use super::{HeldStore, ServeState};

/// Upper bounds of the API latency histogram's buckets, in seconds.
const LATENCY_BUCKETS_SECONDS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Park markers counted at most per scrape; past it `keel_runs_parked`
/// reads "at least this many" (a scrape stays cheap on a store with a
/// mass of parked runs).
pub(super) const PARKED_COUNT_MAX: usize = 10_000;

/// Open runs counted at most per scrape; past it `keel_runs_open` reads
/// "at least this many".
pub(super) const OPEN_COUNT_MAX: usize = 10_000;

/// Most distinct (method, route, status) series kept; later ones are
/// counted under route `other` so a scan of odd URLs cannot grow memory.
const REQUEST_SERIES_MAX: usize = 512;

/// What the server counts itself.
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, String, u16), u64>>,
    latency: Histogram<{ LATENCY_BUCKETS_SECONDS.len() }>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            latency: Histogram::new(&LATENCY_BUCKETS_SECONDS),
        }
    }
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
        self.latency.observe_duration(took);
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
        histogram(
            out,
            "keel_api_request_duration_seconds",
            "Time to answer an API request.",
            &self.latency.snapshot(),
        );
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn gauge(out: &mut String, name: &str, help: &str, value: impl std::fmt::Display) {
    one(out, "gauge", name, help, value);
}

fn counter(out: &mut String, name: &str, help: &str, value: impl std::fmt::Display) {
    one(out, "counter", name, help, value);
}

fn one(out: &mut String, kind: &str, name: &str, help: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    let _ = writeln!(out, "{name} {value}");
}

/// A counter with one label, one series per value of it.
fn counters<'a, K: AsRef<str> + 'a>(
    out: &mut String,
    name: &str,
    help: &str,
    label: &str,
    series: impl IntoIterator<Item = (&'a K, &'a u64)>,
) {
    labelled(out, "counter", name, help, label, series);
}

/// A series of `kind` with one label, one line per value of it.
fn labelled<'a, K: AsRef<str> + 'a>(
    out: &mut String,
    kind: &str,
    name: &str,
    help: &str,
    label: &str,
    series: impl IntoIterator<Item = (&'a K, &'a u64)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (value, n) in series {
        let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {n}", escape(value.as_ref()));
    }
}

fn histogram(out: &mut String, name: &str, help: &str, h: &HistogramSnapshot) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} histogram");
    for (bound, n) in &h.buckets {
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {n}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum {}", h.sum);
    let _ = writeln!(out, "{name}_count {}", h.count);
}

/// The engine's own series: what its shards counted and hold, and what
/// its store's writer did.
fn write_engine(out: &mut String, e: &EngineStats) {
    let s = &e.shards;
    gauge(
        out,
        "keel_shards_owned",
        "Shards this engine process runs now.",
        e.shards_owned,
    );
    counter(
        out,
        "keel_commits_total",
        "Commits the shards asked of the store and had answered.",
        s.commits,
    );
    counter(
        out,
        "keel_commits_failed_total",
        "Commits the store answered with an error (nothing of them written).",
        s.commits_failed,
    );
    histogram(out, "keel_commit_duration_seconds", "Time from a shard asking for a commit to the store's answer (queueing, validation, the group's write and sync).", &e.commit_seconds);
    if let Some(w) = &e.writer {
        counter(
            out,
            "keel_store_commits_total",
            "Commits the store's writer validated and wrote.",
            w.commits,
        );
        counter(out, "keel_store_commits_refused_total", "Commits the store's writer refused (a duplicate id, a fenced owner, an unwritable store).", w.refused);
        histogram(
            out,
            "keel_store_group_size_commits",
            "Commits written together in one group (one write and one sync).",
            &w.group_commits,
        );
        histogram(out, "keel_store_write_sync_duration_seconds", "Time to write one group and make it durable: the fsync with Sync durability on RocksDB, the transaction and its WAL flush on PostgreSQL.", &w.write_seconds);
    }
    gauge(
        out,
        "keel_runs_cached",
        "Runs whose machines the engine holds in memory.",
        s.runs_cached,
    );
    counter(out, "keel_passivations_total", "Runs dropped from memory (idle past the cache's limit); they replay from the log when needed.", s.passivations);
    counter(out, "keel_activations_total", "Histories read to bring a run back into memory by replay (an open or parked run; a closed one is answered from its run record).", s.activations);
    counters(
        out,
        "keel_inputs_total",
        "Inputs runs accepted, by kind.",
        "kind",
        &s.inputs,
    );
    counter(out, "keel_duplicates_dropped_total", "Inputs a run already had (a redelivered result, a repeated signal): answered, nothing committed.", s.duplicates_dropped);
    counters(
        out,
        "keel_attempts_total",
        "Activity attempts ended, by outcome.",
        "outcome",
        &s.attempts,
    );
    gauge(
        out,
        "keel_attempts_supervised",
        "Activity attempts the engine supervises now.",
        s.attempts_supervised,
    );
    counter(
        out,
        "keel_lease_expiries_total",
        "Deliveries whose lease ended without a result.",
        s.lease_expiries,
    );
    counter(
        out,
        "keel_redeliveries_total",
        "Attempts delivered again after a lease ended.",
        s.redeliveries,
    );
    gauge(
        out,
        "keel_timers_armed",
        "Timers the engine holds in memory now (the soonest due; the rest wait in the store).",
        s.timers_armed,
    );
    gauge(
        out,
        "keel_due_entries",
        "Later checks the engine holds (dispatches at a backoff, lease checks, redeliveries); stale ones are swept as the queue doubles.",
        s.due_entries,
    );
    histogram(
        out,
        "keel_timer_lag_seconds",
        "Time from a timer's due time to the commit of its firing.",
        &s.timer_lag_seconds,
    );
    gauge(
        out,
        "keel_outbox_backlog_rows",
        "Outbox rows (child starts, cancellations, results to parents) not yet delivered.",
        s.outbox_backlog,
    );
    counters(
        out,
        "keel_resilience_rejections_total",
        "Attempt copies a resilience policy refused before they ran, by policy.",
        "policy",
        &s.rejections,
    );
}

/// `GET /metrics`.
pub(crate) async fn scrape(_: CanRead, state: web::Data<ServeState>) -> HttpResponse {
    let mut out = String::with_capacity(4096);
    if let Some(engine) = &state.engine {
        write_engine(&mut out, &engine.stats().await);
    }
    let store = HeldStore::of(&state);
    let counted = web::block(move || {
        Ok::<_, keel_storage::Error>((
            store.count_status(keel_storage::RunStatus::Running, OPEN_COUNT_MAX)?,
            store.parked_count(PARKED_COUNT_MAX)?,
        ))
    })
    .await;
    if let Ok(Ok((open, parked))) = counted {
        gauge(
            &mut out,
            "keel_runs_open",
            &format!("Runs open in the whole store (every shard and process), counted up to {OPEN_COUNT_MAX}."),
            open,
        );
        gauge(
            &mut out,
            "keel_runs_parked",
            &format!("Runs parked (code that diverged from their history, or panicked), counted up to {PARKED_COUNT_MAX}."),
            parked,
        );
    }
    let health = state.health();
    gauge(
        &mut out,
        "keel_store_writable",
        "1 when the store accepts commits, 0 when it refuses them (a full or failing disk, a lost lease).",
        u8::from(matches!(health, keel_storage::StoreHealth::Healthy)),
    );
    if let Some(engine) = &state.engine {
        gauge(
            &mut out,
            "keel_shards_down",
            "Shards of this process that panicked more often than the engine restarts them; their runs wait for the engine's restart.",
            engine.shards_down().len(),
        );
    }
    if let Some(m) = state.store.memory() {
        labelled(
            &mut out,
            "gauge",
            "keel_store_memory_bytes",
            "Memory the store itself uses, by part: memtables, table readers, the block cache, the writer's cache (estimated). Sum them for the total.",
            "part",
            [
                (&"memtables", &m.memtables_bytes),
                (&"table_readers", &m.table_readers_bytes),
                (&"block_cache", &m.block_cache_bytes),
                (&"writer_cache", &m.writer_cache_bytes),
            ],
        );
    }
    state.metrics.write(&mut out);
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(out)
}
