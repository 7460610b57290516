//! OpenTelemetry export of keel's `tracing` spans over OTLP/HTTP with JSON
//! bodies (the `otlp` cargo feature).
//!
//! [`OtlpLayer`] is a `tracing-subscriber` layer: it gives every span a
//! trace and span id (a child inherits its parent's trace), records its
//! fields as attributes and the events inside it as span events, and when
//! the span closes hands it to an exporter thread through a bounded queue.
//! The thread posts batches to the collector's `/v1/traces` every
//! [`OTLP_FLUSH_INTERVAL_MS`] or at [`OTLP_BATCH_SPANS_MAX`] spans. A full
//! queue drops spans (counted, and warned about), so a slow or absent
//! collector never slows the engine or grows its memory.
//!
//! Configured from the standard environment variables
//! ([`OtlpConfig::from_env`]): `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the
//! full URL) or `OTEL_EXPORTER_OTLP_ENDPOINT` (the base, `/v1/traces` is
//! appended), `OTEL_EXPORTER_OTLP_HEADERS` (`key=value,...`, for an API
//! key) and `OTEL_SERVICE_NAME` (default `keel`). Plain `http://` only:
//! send to a collector agent beside the process, which forwards over TLS.
//!
//! Why not the `opentelemetry` SDK crates: they bring their own runtime
//! integration, gRPC or an HTTP client stack, and unbounded defaults; this
//! is one thread, one bounded queue and the HTTP client keel already has.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// Spans waiting for the exporter thread; more are dropped and counted.
pub const OTLP_QUEUE_SPANS_MAX: usize = 8_192;
/// Spans in one export request.
pub const OTLP_BATCH_SPANS_MAX: usize = 512;
/// Longest a closed span waits before it is sent, in milliseconds.
pub const OTLP_FLUSH_INTERVAL_MS: u64 = 1_000;
/// Longest one export request may take, in milliseconds.
pub const OTLP_EXPORT_TIMEOUT_MS: u64 = 5_000;
/// Events kept per span (the first ones); later events are counted in
/// the span's `dropped_events_count`.
pub const OTLP_SPAN_EVENTS_MAX: usize = 32;
/// Longest string attribute value sent, in bytes; longer ones are cut.
pub const OTLP_ATTRIBUTE_BYTES_MAX: usize = 4_096;

/// The path a base endpoint gets for traces (OTLP/HTTP).
const TRACES_PATH: &str = "/v1/traces";
/// `SPAN_KIND_INTERNAL`.
const SPAN_KIND_INTERNAL: u8 = 1;
/// `STATUS_CODE_ERROR`.
const STATUS_CODE_ERROR: u8 = 2;

/// What is wrong with the OTLP settings.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OtlpError {
    /// The endpoint is not a plain `http://` URL.
    #[error(
        "{var}={value:?}: the endpoint must be an http:// URL (send to a collector beside \
         the process; it forwards over TLS)"
    )]
    BadEndpoint {
        /// The variable that held it.
        var: &'static str,
        /// What it held.
        value: String,
    },
    /// A header entry is not `key=value`.
    #[error("OTEL_EXPORTER_OTLP_HEADERS: {entry:?} is not key=value")]
    BadHeader {
        /// The entry.
        entry: String,
    },
}

/// Where and how spans are exported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpConfig {
    /// The full URL the batches are posted to (`.../v1/traces`).
    pub traces_url: String,
    /// `service.name` of the resource.
    pub service_name: String,
    /// Extra request headers (an API key, a tenant).
    pub headers: Vec<(String, String)>,
}

impl OtlpConfig {
    /// The settings from the process environment; `None` when no endpoint
    /// is set (export off).
    pub fn from_env() -> Result<Option<OtlpConfig>, OtlpError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The settings from `var`, which looks a variable up by name.
    pub fn from_vars(
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<OtlpConfig>, OtlpError> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let traces_url = if let Some(url) = set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            check_http("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url.trim())?
        } else if let Some(base) = set("OTEL_EXPORTER_OTLP_ENDPOINT") {
            let base = check_http("OTEL_EXPORTER_OTLP_ENDPOINT", base.trim())?;
            format!("{}{TRACES_PATH}", base.trim_end_matches('/'))
        } else {
            return Ok(None);
        };
        let mut headers = Vec::new();
        for entry in set("OTEL_EXPORTER_OTLP_HEADERS")
            .iter()
            .flat_map(|h| h.split(','))
        {
            if entry.trim().is_empty() {
                continue;
            }
            match entry.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() => {
                    headers.push((k.trim().to_string(), v.trim().to_string()))
                }
                _ => {
                    return Err(OtlpError::BadHeader {
                        entry: entry.to_string(),
                    })
                }
            }
        }
        Ok(Some(OtlpConfig {
            traces_url,
            service_name: set("OTEL_SERVICE_NAME").unwrap_or_else(|| "keel".to_string()),
            headers,
        }))
    }
}

fn check_http(var: &'static str, value: &str) -> Result<String, OtlpError> {
    let rest = value.strip_prefix("http://").unwrap_or("");
    if rest.is_empty() || rest.starts_with('/') {
        return Err(OtlpError::BadEndpoint {
            var,
            value: value.to_string(),
        });
    }
    Ok(value.to_string())
}

/// Counts of the exporter, for tests and shutdown messages.
#[derive(Debug, Default)]
pub struct OtlpStats {
    /// Spans the collector accepted.
    pub exported: AtomicU64,
    /// Spans dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Spans lost because a request failed.
    pub failed: AtomicU64,
    /// Set by the guard's drop: the exporter sends what it can within one
    /// export timeout and stops, whatever the queue holds.
    stopping: std::sync::atomic::AtomicBool,
}

enum Msg {
    Span(Box<Value>),
    Flush(SyncSender<()>),
    Stop,
}

/// The layer to add to a `tracing_subscriber::registry()`; see
/// [`layer`].
pub struct OtlpLayer {
    tx: SyncSender<Msg>,
    stats: Arc<OtlpStats>,
    ids: IdSource,
    // Wall time read once; span times are this plus a monotonic offset,
    // so they never go backwards within the process.
    epoch_unix_ns: u64,
    epoch: Instant,
}

/// Owns the exporter thread: [`OtlpGuard::flush`] sends what is queued;
/// dropping it sends the rest and stops the thread. Keep it alive for as
/// long as spans should be exported.
pub struct OtlpGuard {
    tx: SyncSender<Msg>,
    stats: Arc<OtlpStats>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for OtlpLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpLayer")
            .field("stats", &self.stats)
            .finish()
    }
}

impl std::fmt::Debug for OtlpGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpGuard")
            .field("stats", &self.stats)
            .finish()
    }
}

/// A layer exporting to `config`, and the guard of its exporter thread.
pub fn layer(config: OtlpConfig) -> (OtlpLayer, OtlpGuard) {
    let (tx, rx) = mpsc::sync_channel(OTLP_QUEUE_SPANS_MAX);
    let stats = Arc::new(OtlpStats::default());
    let thread = {
        let stats = stats.clone();
        std::thread::Builder::new()
            .name("keel-otlp".into())
            .spawn(move || Exporter::new(config, stats).run(rx))
            .expect("the OTLP exporter thread starts")
    };
    let epoch_unix_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    (
        OtlpLayer {
            tx: tx.clone(),
            stats: stats.clone(),
            ids: IdSource::new(),
            epoch_unix_ns,
            epoch: Instant::now(),
        },
        OtlpGuard {
            tx,
            stats,
            thread: Some(thread),
        },
    )
}

impl OtlpGuard {
    /// Sends every span closed so far; waits for the answer up to
    /// [`OTLP_EXPORT_TIMEOUT_MS`] (plus the queue ahead of it).
    pub fn flush(&self) {
        let (ack, done) = mpsc::sync_channel(1);
        if self.tx.send(Msg::Flush(ack)).is_ok() {
            let _ = done.recv_timeout(Duration::from_millis(2 * OTLP_EXPORT_TIMEOUT_MS));
        }
    }

    /// The exporter's counts (they stay readable after the guard is
    /// dropped).
    pub fn stats(&self) -> Arc<OtlpStats> {
        self.stats.clone()
    }
}

impl Drop for OtlpGuard {
    fn drop(&mut self) {
        self.stats.stopping.store(true, Ordering::Release);
        // Wakes the exporter if it waits; a full queue wakes it anyway.
        let _ = self.tx.try_send(Msg::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Trace and span ids: a process-random key hashing a counter, so ids
/// are unique within the process and unpredictable across processes.
struct IdSource {
    key: RandomState,
    next: AtomicU64,
}

impl IdSource {
    fn new() -> Self {
        IdSource {
            key: RandomState::new(),
            next: AtomicU64::new(1),
        }
    }

    fn draw(&self) -> u64 {
        loop {
            let mut h = self.key.build_hasher();
            h.write_u64(self.next.fetch_add(1, Ordering::Relaxed));
            let id = h.finish();
            // An all-zero id is invalid in OTLP.
            if id != 0 {
                return id;
            }
        }
    }
}

/// What the layer keeps in a span's extensions while it is open.
struct OpenSpan {
    trace_id: [u64; 2],
    span_id: u64,
    parent_span_id: Option<u64>,
    start_unix_ns: u64,
    attributes: Vec<Value>,
    events: Vec<Value>,
    dropped_events: u32,
    error: Option<String>,
}

impl OtlpLayer {
    fn now_unix_ns(&self) -> u64 {
        self.epoch_unix_ns + self.epoch.elapsed().as_nanos() as u64
    }
}

impl<S> Layer<S> for OtlpLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let parent = span.parent().and_then(|p| {
            p.extensions()
                .get::<OpenSpan>()
                .map(|o| (o.trace_id, o.span_id))
        });
        let (trace_id, parent_span_id) = match parent {
            Some((trace, parent_id)) => (trace, Some(parent_id)),
            None => ([self.ids.draw(), self.ids.draw()], None),
        };
        let mut attributes = Vec::new();
        attrs.record(&mut Attrs(&mut attributes));
        span.extensions_mut().insert(OpenSpan {
            trace_id,
            span_id: self.ids.draw(),
            parent_span_id,
            start_unix_ns: self.now_unix_ns(),
            attributes,
            events: Vec::new(),
            dropped_events: 0,
            error: None,
        });
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(open) = span.extensions_mut().get_mut::<OpenSpan>() {
                values.record(&mut Attrs(&mut open.attributes));
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut ext = span.extensions_mut();
        let Some(open) = ext.get_mut::<OpenSpan>() else {
            return;
        };
        let level = *event.metadata().level();
        let mut attributes = vec![attr("level", json!({"stringValue": level.as_str()}))];
        let mut message = None;
        event.record(&mut EventFields {
            attributes: &mut attributes,
            message: &mut message,
        });
        let name = cut(message.as_deref().unwrap_or(event.metadata().name())).to_string();
        if level == Level::ERROR && open.error.is_none() {
            open.error = Some(name.clone());
        }
        if open.events.len() >= OTLP_SPAN_EVENTS_MAX {
            open.dropped_events += 1;
            return;
        }
        open.events.push(json!({
            "timeUnixNano": self.now_unix_ns().to_string(),
            "name": name,
            "attributes": attributes,
        }));
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(open) = span.extensions_mut().remove::<OpenSpan>() else {
            return;
        };
        let meta = span.metadata();
        let mut attributes = open.attributes;
        attributes.push(attr(
            "code.namespace",
            json!({"stringValue": meta.target()}),
        ));
        let mut out = json!({
            "traceId": format!("{:016x}{:016x}", open.trace_id[0], open.trace_id[1]),
            "spanId": format!("{:016x}", open.span_id),
            "name": meta.name(),
            "kind": SPAN_KIND_INTERNAL,
            "startTimeUnixNano": open.start_unix_ns.to_string(),
            "endTimeUnixNano": self.now_unix_ns().to_string(),
            "attributes": attributes,
            "events": open.events,
            "droppedEventsCount": open.dropped_events,
        });
        if let Some(parent) = open.parent_span_id {
            out["parentSpanId"] = json!(format!("{parent:016x}"));
        }
        if let Some(message) = open.error {
            out["status"] = json!({"code": STATUS_CODE_ERROR, "message": message});
        }
        match self.tx.try_send(Msg::Span(Box::new(out))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn attr(key: &str, value: Value) -> Value {
    json!({"key": key, "value": value})
}

fn string_value(s: &str) -> Value {
    json!({"stringValue": cut(s)})
}

/// `s` cut to at most [`OTLP_ATTRIBUTE_BYTES_MAX`] bytes, on a character
/// boundary.
fn cut(s: &str) -> &str {
    let mut end = s.len().min(OTLP_ATTRIBUTE_BYTES_MAX);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Records fields as OTLP attributes (a field recorded again replaces
/// the earlier value).
struct Attrs<'a>(&'a mut Vec<Value>);

impl Attrs<'_> {
    fn put(&mut self, field: &Field, value: Value) {
        let key = field.name();
        if let Some(existing) = self.0.iter_mut().find(|a| a["key"] == key) {
            existing["value"] = value;
        } else {
            self.0.push(attr(key, value));
        }
    }
}

impl Visit for Attrs<'_> {
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, json!({"intValue": value.to_string()}));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        match i64::try_from(value) {
            Ok(v) => self.put(field, json!({"intValue": v.to_string()})),
            Err(_) => self.put(field, string_value(&value.to_string())),
        }
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        // JSON has no NaN or infinities; the protobuf JSON mapping spells
        // them as strings.
        let v = if value.is_nan() {
            json!("NaN")
        } else if value.is_infinite() {
            json!(if value > 0.0 { "Infinity" } else { "-Infinity" })
        } else {
            json!(value)
        };
        self.put(field, json!({ "doubleValue": v }));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, json!({"boolValue": value}));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, string_value(value));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.put(field, string_value(&format!("{value:?}")));
    }
}

/// Records an event's fields, its `message` apart (it names the event).
struct EventFields<'a> {
    attributes: &'a mut Vec<Value>,
    message: &'a mut Option<String>,
}

impl Visit for EventFields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            *self.message = Some(value.to_string());
        } else {
            Attrs(self.attributes).record_str(field, value);
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            *self.message = Some(format!("{value:?}"));
        } else {
            Attrs(self.attributes).record_debug(field, value);
        }
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        Attrs(self.attributes).record_i64(field, value);
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        Attrs(self.attributes).record_u64(field, value);
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        Attrs(self.attributes).record_f64(field, value);
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        Attrs(self.attributes).record_bool(field, value);
    }
}

/// The exporter thread: batches spans and posts them.
struct Exporter {
    config: OtlpConfig,
    stats: Arc<OtlpStats>,
    agent: ureq::Agent,
    resource: Value,
    batch: Vec<Value>,
    dropped_warned: u64,
    failures_warned: u64,
}

impl Exporter {
    fn new(config: OtlpConfig, stats: Arc<OtlpStats>) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_millis(OTLP_EXPORT_TIMEOUT_MS))
            .build();
        let resource = json!({"attributes": [
            attr("service.name", json!({"stringValue": config.service_name})),
            attr("telemetry.sdk.name", json!({"stringValue": "keel"})),
            attr("telemetry.sdk.language", json!({"stringValue": "rust"})),
            attr("telemetry.sdk.version", json!({"stringValue": env!("CARGO_PKG_VERSION")})),
        ]});
        Exporter {
            config,
            stats,
            agent,
            resource,
            batch: Vec::with_capacity(OTLP_BATCH_SPANS_MAX),
            dropped_warned: 0,
            failures_warned: 0,
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        let interval = Duration::from_millis(OTLP_FLUSH_INTERVAL_MS);
        let mut deadline = Instant::now() + interval;
        loop {
            if self.stats.stopping.load(Ordering::Acquire) {
                self.finish(&rx);
                return;
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(Msg::Span(span)) => {
                    self.batch.push(*span);
                    if self.batch.len() >= OTLP_BATCH_SPANS_MAX {
                        self.send();
                    }
                }
                Ok(Msg::Flush(ack)) => {
                    self.send();
                    let _ = ack.send(());
                }
                Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => {
                    self.finish(&rx);
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.send();
                    deadline = Instant::now() + interval;
                }
            }
        }
    }

    /// Sends what is still queued, for at most one export timeout; what is
    /// left then is dropped (and counted), so a collector that does not
    /// answer cannot hold the process's exit.
    fn finish(&mut self, rx: &Receiver<Msg>) {
        let until = Instant::now() + Duration::from_millis(OTLP_EXPORT_TIMEOUT_MS);
        while let Ok(msg) = rx.try_recv() {
            match msg {
                Msg::Span(span) if Instant::now() < until => {
                    self.batch.push(*span);
                    if self.batch.len() >= OTLP_BATCH_SPANS_MAX {
                        self.send();
                    }
                }
                Msg::Span(_) => {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                }
                Msg::Flush(ack) => {
                    let _ = ack.send(());
                }
                Msg::Stop => {}
            }
        }
        if Instant::now() < until {
            self.send();
        } else {
            let left = self.batch.len() as u64;
            self.stats.dropped.fetch_add(left, Ordering::Relaxed);
            self.batch.clear();
        }
    }

    fn send(&mut self) {
        self.warn_drops();
        if self.batch.is_empty() {
            return;
        }
        let spans = std::mem::take(&mut self.batch);
        let n = spans.len() as u64;
        let body = json!({"resourceSpans": [{
            "resource": self.resource,
            "scopeSpans": [{
                "scope": {"name": "keel", "version": env!("CARGO_PKG_VERSION")},
                "spans": spans,
            }],
        }]});
        let mut request = self
            .agent
            .post(&self.config.traces_url)
            .set("content-type", "application/json");
        for (k, v) in &self.config.headers {
            request = request.set(k, v);
        }
        match request.send_string(&body.to_string()) {
            Ok(_) => {
                self.stats.exported.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                let failed = self.stats.failed.fetch_add(n, Ordering::Relaxed) + n;
                // Once, then at every thousand more lost spans: a collector
                // that is down must not flood the log.
                if self.failures_warned == 0 || failed >= self.failures_warned + 1_000 {
                    self.failures_warned = failed;
                    tracing::warn!(
                        url = %self.config.traces_url,
                        spans_lost = failed,
                        "OTLP export failed: {e}"
                    );
                }
            }
        }
        self.batch = Vec::with_capacity(OTLP_BATCH_SPANS_MAX);
    }

    fn warn_drops(&mut self) {
        let dropped = self.stats.dropped.load(Ordering::Relaxed);
        if dropped > self.dropped_warned {
            tracing::warn!(
                spans_dropped = dropped,
                queue_spans_max = OTLP_QUEUE_SPANS_MAX,
                "OTLP export queue full: spans dropped (the collector is slower than the engine)"
            );
            self.dropped_warned = dropped;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn settings_come_from_the_standard_variables() {
        // Goal: the OTEL_* variables configure export as the OpenTelemetry
        // specification says; bad values are typed errors naming the
        // variable. Method: from_vars over fixed maps.
        assert_eq!(OtlpConfig::from_vars(vars(&[])), Ok(None));
        let c = OtlpConfig::from_vars(vars(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")]))
            .unwrap()
            .unwrap();
        assert_eq!(c.traces_url, "http://c:4318/v1/traces");
        assert_eq!(c.service_name, "keel");
        let c = OtlpConfig::from_vars(vars(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://ignored:1"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/custom"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=abc, tenant = t1"),
            ("OTEL_SERVICE_NAME", "orders"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(c.traces_url, "http://c:4318/custom");
        assert_eq!(c.service_name, "orders");
        assert_eq!(
            c.headers,
            vec![
                ("x-api-key".into(), "abc".into()),
                ("tenant".into(), "t1".into())
            ]
        );
        assert_eq!(
            OtlpConfig::from_vars(vars(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318")])),
            Err(OtlpError::BadEndpoint {
                var: "OTEL_EXPORTER_OTLP_ENDPOINT",
                value: "https://c:4318".into()
            })
        );
        assert_eq!(
            OtlpConfig::from_vars(vars(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "novalue")
            ])),
            Err(OtlpError::BadHeader {
                entry: "novalue".into()
            })
        );
    }

    #[test]
    fn long_strings_are_cut_on_a_character_boundary() {
        // Goal: an attribute never exceeds OTLP_ATTRIBUTE_BYTES_MAX and is
        // still valid UTF-8. Method: a string of 3-byte characters.
        let long = "€".repeat(OTLP_ATTRIBUTE_BYTES_MAX);
        let v = string_value(&long);
        let s = v["stringValue"].as_str().unwrap();
        assert!(s.len() <= OTLP_ATTRIBUTE_BYTES_MAX && s.len() > OTLP_ATTRIBUTE_BYTES_MAX - 3);
    }
}
