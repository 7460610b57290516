//! The HTTP/JSON API under `/api/v1`: one handler per client call, each a
//! thin translation between JSON and [`keel::Client`] (or, for history
//! and export, the engine's store). Every state-changing call takes a
//! command id, so a client's retry is the same call; every input is
//! checked before anything is sent to the engine, and a bad one is
//! answered with a 4xx whose JSON body names the field.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use actix_web::dev::Service as _;
use actix_web::error::{JsonPayloadError, PathError, QueryPayloadError};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use keel::{EngineError, ReusePolicy, RunFilter, StartOptions, StartOutcome};
use keel_storage::search::LIST_PAGE_RUNS_MAX;
use keel_storage::{Outcome, Payload, RunMeta, RunStatus, SearchValue, Seq};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::auth::{CanRead, CanWrite};
use super::{HeldStore, ServeState, BODY_BYTES_MAX};
use crate::inspect;

/// Longest instance id, run id, command id, signal, query or update name
/// the API accepts, in bytes.
pub const ID_BYTES_MAX: usize = 512;

/// Longest reason (cancel, terminate), in bytes.
pub const REASON_BYTES_MAX: usize = 4096;

/// Most events one history page holds.
pub const HISTORY_PAGE_EVENTS_MAX: usize = 1000;

/// Events in a history page when the caller names no limit.
const HISTORY_PAGE_EVENTS_DEFAULT: usize = 200;

/// Runs in a list page when the caller names no size.
const LIST_PAGE_RUNS_DEFAULT: usize = 50;

/// Longest a result call waits for the run to close, in milliseconds.
pub const RESULT_WAIT_MS_MAX: u64 = 60_000;

/// First and longest pause between a waiting result call's reads, in
/// milliseconds.
const RESULT_POLL_MS_MIN: u64 = 10;
const RESULT_POLL_MS_MAX: u64 = 200;

/// Most continue-as-new links a result call follows in one request.
const RESULT_CHAIN_RUNS_MAX: usize = 64;

/// An API error: its status, a stable code, a message for people and the
/// input field at fault, sent as `{"error": {"code", "message", "field"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    field: Option<String>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.field {
            Some(field) => write!(f, "{}: {}", field, self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.status);
        if self.status == StatusCode::UNAUTHORIZED {
            res.insert_header(("WWW-Authenticate", "Bearer"));
        }
        res.json(json!({
            "error": {
                "code": self.code,
                "message": self.message,
                "field": self.field,
            }
        }))
    }
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            field: None,
        }
    }

    fn at(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// A bad value in `field`.
    pub(crate) fn bad(field: &str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_input", message).at(field)
    }

    pub(crate) fn unauthorized(message: &str) -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub(crate) fn forbidden(message: &str) -> Self {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// What the engine refused, as the caller should see it.
    fn engine(e: EngineError) -> Self {
        let msg = e.to_string();
        use EngineError as E;
        match e {
            E::UnknownWorkflowType(_) => {
                ApiError::new(StatusCode::BAD_REQUEST, "unknown_workflow_type", msg)
                    .at("workflow_type")
            }
            E::InvalidInput { .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_input", msg).at("input")
            }
            E::Encode(_) => ApiError::new(StatusCode::BAD_REQUEST, "bad_input", msg),
            E::PayloadTooLarge { .. } => {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", msg)
            }
            E::PayloadTooDeep { .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, "payload_too_deep", msg)
            }
            E::UnknownInstance(_) => ApiError::new(StatusCode::NOT_FOUND, "unknown_run", msg),
            E::RunClosed { .. } | E::AlreadyClosed { .. } => {
                ApiError::new(StatusCode::CONFLICT, "run_closed", msg)
            }
            E::Parked { .. } => ApiError::new(StatusCode::CONFLICT, "run_parked", msg),
            E::Handler(_) => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "handler", msg),
            E::UpdateFailed(_) => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "update_failed", msg)
            }
            E::Metadata(_) => ApiError::new(StatusCode::BAD_REQUEST, "bad_metadata", msg),
            E::BadFilter(_) => ApiError::new(StatusCode::BAD_REQUEST, "bad_filter", msg),
            E::BadMessage(_) => ApiError::new(StatusCode::BAD_REQUEST, "bad_message", msg),
            E::StreamFull { .. } => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "stream_full", msg)
            }
            E::Shutdown => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", msg),
            E::Unavailable(_) | E::StoreUnavailable(_) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", msg)
            }
            E::Refused(_) => ApiError::new(StatusCode::CONFLICT, "refused", msg),
            E::Schedule(_) => ApiError::new(StatusCode::BAD_REQUEST, "bad_schedule", msg),
            E::ScheduleExists(_) => ApiError::new(StatusCode::CONFLICT, "schedule_exists", msg),
            E::UnknownSchedule(_) => ApiError::new(StatusCode::NOT_FOUND, "unknown_schedule", msg),
            E::WorkflowFailed(_)
            | E::WorkflowCancelled(_)
            | E::WorkflowTerminated(_)
            | E::WorkflowTimedOut(_)
            | E::ResultDecode(_)
            | E::Store(_) => ApiError::internal(msg),
        }
    }
}

type ApiResult = Result<HttpResponse, ApiError>;

/// The field serde named in a message like "missing field `x`".
fn field_of(message: &str) -> Option<String> {
    let start = message.find('`')? + 1;
    let len = message[start..].find('`')?;
    Some(message[start..start + len].to_string())
}

pub(crate) fn json_config() -> web::JsonConfig {
    web::JsonConfig::default()
        .limit(BODY_BYTES_MAX)
        // A JSON body must say so: a cross-site form or a no-cors fetch
        // cannot send `application/json` without a preflight this server
        // never grants, so a page elsewhere cannot post to it.
        .content_type_required(true)
        .error_handler(|e, _| {
            let err = match &e {
                JsonPayloadError::Overflow { .. }
                | JsonPayloadError::OverflowKnownLength { .. } => ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    format!("the request body is over the limit of {BODY_BYTES_MAX} bytes"),
                ),
                JsonPayloadError::Deserialize(d) => {
                    let message = d.to_string();
                    let mut err = ApiError::new(StatusCode::BAD_REQUEST, "bad_json", &message);
                    err.field = field_of(&message);
                    err
                }
                JsonPayloadError::ContentType => ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "content_type",
                    "send the body as JSON with `Content-Type: application/json`",
                ),
                other => ApiError::new(StatusCode::BAD_REQUEST, "bad_json", other.to_string()),
            };
            err.into()
        })
}

pub(crate) fn query_config() -> web::QueryConfig {
    web::QueryConfig::default().error_handler(|e, _| {
        let message = match &e {
            QueryPayloadError::Deserialize(d) => d.to_string(),
            other => other.to_string(),
        };
        let mut err = ApiError::new(StatusCode::BAD_REQUEST, "bad_query", &message);
        err.field = field_of(&message);
        err.into()
    })
}

pub(crate) fn path_config() -> web::PathConfig {
    web::PathConfig::default().error_handler(|e: PathError, _| {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_path", e.to_string()).into()
    })
}

/// A resource whose other methods are answered 405 with the JSON error.
fn resource(path: &str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(|req: HttpRequest| async move {
        Err::<HttpResponse, _>(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("{} is not served for {}", req.method(), req.path()),
        ))
    }))
}

/// Anything no route serves.
pub(crate) async fn not_found(req: HttpRequest) -> ApiResult {
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        "no_route",
        format!("no route for {} {}", req.method(), req.path()),
    ))
}

/// `GET /healthz`: 200 while the store takes commits and every shard of
/// the engine runs, 503 otherwise (a shard that panicked more often than
/// the engine restarts it is listed under `shards_down`). It needs no
/// token (load balancers and orchestrators probe it), so it says only the
/// state and the kind of fault, never the storage's message.
pub(crate) async fn healthz(state: web::Data<ServeState>) -> HttpResponse {
    let health = state.health();
    let down: Vec<u16> = state
        .engine
        .as_ref()
        .map(|e| e.shards_down().into_iter().map(|s| s.0).collect())
        .unwrap_or_default();
    let mut body = match &health {
        keel_storage::StoreHealth::Healthy => json!({"store": "healthy"}),
        keel_storage::StoreHealth::Stopped { fault, .. } => {
            json!({"store": "stopped", "fault": fault.to_string()})
        }
        keel_storage::StoreHealth::Failed { fault, .. } => {
            json!({"store": "failed", "fault": fault.to_string()})
        }
    };
    if !down.is_empty() {
        body["shards_down"] = json!(down);
    }
    if health.is_healthy() && down.is_empty() {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

/// The `/api/v1` routes, each counted in the metrics.
pub(crate) fn scope() -> actix_web::Scope<
    impl actix_web::dev::ServiceFactory<
        actix_web::dev::ServiceRequest,
        Config = (),
        Response = actix_web::dev::ServiceResponse,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    web::scope("/api/v1")
        .wrap_fn(|req, srv| {
            let start = Instant::now();
            let metrics = req
                .app_data::<web::Data<ServeState>>()
                .map(|s| s.metrics.clone());
            let method = req.method().to_string();
            let call = srv.call(req);
            async move {
                let res = call.await?;
                if let Some(m) = metrics {
                    let route = res
                        .request()
                        .match_pattern()
                        .unwrap_or_else(|| "unmatched".into());
                    m.observe(&method, &route, res.status().as_u16(), start.elapsed());
                }
                Ok(res)
            }
        })
        .service(resource("/whoami").route(web::get().to(whoami)))
        .service(resource("/counts").route(web::get().to(counts)))
        .service(
            resource("/runs")
                .route(web::post().to(start))
                .route(web::get().to(list)),
        )
        .service(resource("/runs/{id}").route(web::get().to(describe)))
        .service(resource("/runs/{id}/history").route(web::get().to(history)))
        .service(resource("/runs/{id}/result").route(web::get().to(result)))
        .service(resource("/runs/{id}/export").route(web::get().to(export)))
        .service(resource("/runs/{id}/replay").route(web::get().to(replay)))
        .service(resource("/runs/{id}/signal").route(web::post().to(signal)))
        .service(resource("/runs/{id}/query").route(web::post().to(query)))
        .service(resource("/runs/{id}/update").route(web::post().to(update)))
        .service(resource("/runs/{id}/cancel").route(web::post().to(cancel)))
        .service(resource("/runs/{id}/terminate").route(web::post().to(terminate)))
        .service(resource("/runs/{id}/resume").route(web::post().to(resume)))
        .service(resource("/schedules").route(web::get().to(schedules)))
        .service(resource("/schedules/{id}").route(web::get().to(schedule)))
        .service(resource("/schedules/{id}/pause").route(web::post().to(schedule_pause)))
        .service(resource("/schedules/{id}/unpause").route(web::post().to(schedule_unpause)))
        .default_service(web::to(not_found))
}

/// Runs counted per status (and parked) at most by `GET /api/v1/counts`:
/// each count is a scan of index keys, so this bounds a call's cost on a
/// large store; a count at the limit reads "at least".
pub(crate) const COUNT_RUNS_MAX: usize = 10_000;

/// `GET /api/v1/counts`: runs in each status across the store, and the
/// parked ones (the page's live counts).
async fn counts(_: CanRead, state: web::Data<ServeState>) -> ApiResult {
    let store = HeldStore::of(&state);
    let (by_status, parked) = blocking(move || {
        let internal = |e: keel_storage::Error| ApiError::internal(e.to_string());
        let by_status = store.count_by_status(COUNT_RUNS_MAX).map_err(internal)?;
        let parked = store.parked_count(COUNT_RUNS_MAX).map_err(internal)?;
        Ok((by_status, parked))
    })
    .await?;
    let counts: serde_json::Map<String, Value> = by_status
        .into_iter()
        .map(|(status, n)| (status.name().to_string(), json!(n)))
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "counts": counts,
        "parked": parked,
        "limit": COUNT_RUNS_MAX,
    })))
}

/// `GET /api/v1/whoami`: what the caller's token allows (the page
/// disables its forms for a read-only token).
async fn whoami(req: HttpRequest, state: web::Data<ServeState>) -> ApiResult {
    let header = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let access = state.tokens.access(header)?;
    Ok(HttpResponse::Ok().json(json!({
        "access": match access {
            super::auth::Access::Read => "read",
            super::auth::Access::Write => "write",
        },
        "token_required": state.tokens.required(),
    })))
}

// ------------------------------------------------------------ checks

/// A required identifier: not empty, not too long, no control characters.
fn id(field: &str, value: &str) -> Result<(), ApiError> {
    if value.trim().is_empty() {
        return Err(ApiError::bad(field, "must not be empty"));
    }
    if value.len() > ID_BYTES_MAX {
        return Err(ApiError::bad(
            field,
            format!("{} bytes; at most {ID_BYTES_MAX}", value.len()),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(ApiError::bad(field, "must not hold control characters"));
    }
    Ok(())
}

fn reason(value: &str) -> Result<(), ApiError> {
    text_len("reason", value, REASON_BYTES_MAX)
}

/// A free text of at most `max` bytes.
fn text_len(field: &str, value: &str, max: usize) -> Result<(), ApiError> {
    if value.len() > max {
        return Err(ApiError::bad(
            field,
            format!("{} bytes; at most {max}", value.len()),
        ));
    }
    Ok(())
}

fn payload(field: &str, value: &Value) -> Result<Payload, ApiError> {
    let p = Payload::encode(value).map_err(|e| ApiError::bad(field, e.to_string()))?;
    if p.len() > keel_storage::PAYLOAD_BYTES_MAX {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!(
                "{} bytes encoded; at most {}",
                p.len(),
                keel_storage::PAYLOAD_BYTES_MAX
            ),
        )
        .at(field));
    }
    Ok(p)
}

/// Runs a store read off the server's threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    web::block(f)
        .await
        .map_err(|e| ApiError::internal(format!("the read did not finish: {e}")))?
}

// ------------------------------------------------------------ start

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartBody {
    workflow_type: String,
    instance_id: String,
    #[serde(default)]
    input: Value,
    command_id: String,
    /// `allow_duplicate` (default), `allow_duplicate_failed_only` or
    /// `reject_duplicate`.
    #[serde(default)]
    reuse: Option<String>,
    #[serde(default)]
    memo: BTreeMap<String, Value>,
    #[serde(default)]
    search_attributes: BTreeMap<String, Value>,
}

fn reuse_of(text: Option<&str>) -> Result<ReusePolicy, ApiError> {
    match text {
        None | Some("allow_duplicate") => Ok(ReusePolicy::AllowDuplicate),
        Some("allow_duplicate_failed_only") => Ok(ReusePolicy::AllowDuplicateFailedOnly),
        Some("reject_duplicate") => Ok(ReusePolicy::RejectDuplicate),
        Some(other) => Err(ApiError::bad(
            "reuse",
            format!(
                "{other:?}: use allow_duplicate, allow_duplicate_failed_only or reject_duplicate"
            ),
        )),
    }
}

fn search_value(name: &str, v: &Value) -> Result<SearchValue, ApiError> {
    let field = format!("search_attributes.{name}");
    match v {
        Value::String(s) => Ok(SearchValue::from(s.as_str())),
        Value::Bool(b) => Ok(SearchValue::from(*b)),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Ok(SearchValue::from(i)),
            (None, Some(f)) => Ok(SearchValue::from(f)),
            _ => Err(ApiError::bad(&field, "number out of range")),
        },
        _ => Err(ApiError::bad(
            &field,
            "must be a string, a number or a boolean",
        )),
    }
}

async fn start(_: CanWrite, state: web::Data<ServeState>, body: web::Json<StartBody>) -> ApiResult {
    let body = body.into_inner();
    id("workflow_type", &body.workflow_type)?;
    id("instance_id", &body.instance_id)?;
    id("command_id", &body.command_id)?;
    let reuse = reuse_of(body.reuse.as_deref())?;
    let input = payload("input", &body.input)?;
    let mut options = StartOptions::new()
        .command_id(body.command_id.clone())
        .reuse(reuse);
    for (name, value) in &body.memo {
        options = options.memo(name, value);
    }
    for (name, value) in &body.search_attributes {
        options = options.search_attribute(name, search_value(name, value)?);
    }
    let outcome = state
        .client
        .start_raw_with(&body.workflow_type, &body.instance_id, input, options)
        .await
        .map_err(ApiError::engine)?;
    let (status, started, run) = match outcome {
        StartOutcome::Started(run) => (StatusCode::CREATED, true, run),
        StartOutcome::Existing(run) => (StatusCode::OK, false, run),
    };
    Ok(HttpResponse::build(status).json(json!({
        "run_id": run.to_string(),
        "instance_id": body.instance_id,
        "started": started,
    })))
}

// ------------------------------------------------------------ list

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListParams {
    /// A filter as `keel list --where` takes it.
    #[serde(rename = "where")]
    filter: Option<String>,
    status: Option<String>,
    #[serde(rename = "type")]
    workflow_type: Option<String>,
    page_size: Option<usize>,
    after: Option<String>,
}

fn status_of(text: &str) -> Result<RunStatus, ApiError> {
    RunStatus::ALL
        .iter()
        .copied()
        .find(|s| s.name() == text)
        .ok_or_else(|| {
            let names: Vec<&str> = RunStatus::ALL.iter().map(|s| s.name()).collect();
            ApiError::bad(
                "status",
                format!("{text:?}: use one of {}", names.join(", ")),
            )
        })
}

async fn list(
    _: CanRead,
    state: web::Data<ServeState>,
    params: web::Query<ListParams>,
) -> ApiResult {
    let params = params.into_inner();
    let mut filter = match params.filter.as_deref().filter(|f| !f.trim().is_empty()) {
        Some(text) => RunFilter::parse(text).map_err(|e| ApiError::bad("where", e.to_string()))?,
        None => RunFilter::all(),
    };
    if let Some(s) = params.status.as_deref().filter(|s| !s.is_empty()) {
        filter = filter.status(status_of(s)?);
    }
    if let Some(t) = params.workflow_type.as_deref().filter(|t| !t.is_empty()) {
        id("type", t)?;
        filter = filter.workflow_type(t);
    }
    let size = params.page_size.unwrap_or(LIST_PAGE_RUNS_DEFAULT);
    if size == 0 || size > LIST_PAGE_RUNS_MAX {
        return Err(ApiError::bad(
            "page_size",
            format!("{size}: between 1 and {LIST_PAGE_RUNS_MAX}"),
        ));
    }
    let after = params
        .after
        .filter(|a| !a.is_empty())
        .map(keel_storage::PageToken);
    let page = state
        .client
        .list(&filter, size, after.as_ref())
        .await
        .map_err(|e| match e {
            EngineError::BadFilter(m) if after.is_some() => ApiError::bad("after", m),
            other => ApiError::engine(other),
        })?;
    let store = HeldStore::of(&state);
    let runs = page.runs;
    let (runs, parked) = blocking(move || {
        // Park markers are rare: one seek tells whether the store holds
        // any before each listed run's marker is read.
        let any_parked = store
            .parked_count(1)
            .map_err(|e| ApiError::internal(e.to_string()))?
            > 0;
        let parked = runs
            .iter()
            .map(|m| match any_parked {
                true => store
                    .parked(m.run_id)
                    .map_err(|e| ApiError::internal(e.to_string())),
                false => Ok(None),
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        Ok((runs, parked))
    })
    .await?;
    /// The page as it goes out, written without a JSON value tree.
    #[derive(Serialize)]
    struct Page<'a> {
        runs: Vec<inspect::RunJson<'a>>,
        next: Option<String>,
    }
    let body = Page {
        runs: runs
            .iter()
            .zip(&parked)
            .map(|(m, p)| inspect::RunJson::new(m, p.as_ref()))
            .collect(),
        next: page.next.map(|t| t.0),
    };
    Ok(HttpResponse::Ok().json(&body))
}

// ------------------------------------------------------------ describe

/// The store's record of `id` (an instance or a run id), read off the
/// server's threads.
async fn meta_of(state: &web::Data<ServeState>, id_text: &str) -> Result<RunMeta, ApiError> {
    id("id", id_text)?;
    let store = HeldStore::of(state);
    let text = id_text.to_string();
    blocking(move || {
        let run = store
            .resolve(&text)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        run.map(|r| store.run_meta(r))
            .transpose()
            .map_err(|e| ApiError::internal(e.to_string()))?
            .flatten()
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "unknown_run",
                    format!("unknown instance or run {text:?}"),
                )
            })
    })
    .await
}

fn outcome_json(o: &Outcome) -> Value {
    match o {
        Outcome::Completed(p) => json!({"status": "completed", "result": inspect::payload_json(p)}),
        Outcome::Failed(f) => json!({"status": "failed", "failure": f.to_string()}),
        Outcome::Cancelled(r) => json!({"status": "cancelled", "reason": r}),
        Outcome::Terminated(r) => json!({"status": "terminated", "reason": r}),
        Outcome::TimedOut(r) => json!({"status": "timed-out", "reason": r}),
        Outcome::ContinuedAsNew(r) => {
            json!({"status": "continued-as-new", "next_run_id": r.to_string()})
        }
    }
}

async fn describe(_: CanRead, state: web::Data<ServeState>, path: web::Path<String>) -> ApiResult {
    let id_text = path.into_inner();
    id("id", &id_text)?;
    let d = state
        .client
        .describe(&id_text)
        .await
        .map_err(ApiError::engine)?;
    let meta = meta_of(&state, &d.run_id.to_string()).await?;
    let mut v = serde_json::to_value(&d).map_err(|e| ApiError::internal(e.to_string()))?;
    if let Value::Object(obj) = &mut v {
        obj.insert("status".into(), json!(d.status.name()));
        obj.insert("run_id".into(), json!(d.run_id.to_string()));
        obj.insert("updated_at".into(), json!(meta.updated_at.0));
        obj.insert(
            "outcome".into(),
            meta.outcome.as_ref().map_or(Value::Null, outcome_json),
        );
        obj.insert(
            "search_attributes".into(),
            inspect::attributes_json(&d.search_attributes),
        );
        obj.insert("memo".into(), inspect::memo_json(&meta.memo));
        obj.insert(
            "parent".into(),
            d.parent.as_ref().map_or(
                Value::Null,
                |(run, step)| json!({"run_id": run.to_string(), "step": step.0}),
            ),
        );
        obj.insert("store_health".into(), json!(d.store_health.to_string()));
    }
    Ok(HttpResponse::Ok().json(v))
}

// ------------------------------------------------------------ history

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HistoryParams {
    /// The first event's sequence number (1 is the first event).
    from: Option<u64>,
    limit: Option<usize>,
}

async fn history(
    _: CanRead,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    params: web::Query<HistoryParams>,
) -> ApiResult {
    let meta = meta_of(&state, &path.into_inner()).await?;
    let from = params.from.unwrap_or(1);
    if from == 0 {
        return Err(ApiError::bad("from", "sequence numbers start at 1"));
    }
    let limit = params.limit.unwrap_or(HISTORY_PAGE_EVENTS_DEFAULT);
    if limit == 0 || limit > HISTORY_PAGE_EVENTS_MAX {
        return Err(ApiError::bad(
            "limit",
            format!("{limit}: between 1 and {HISTORY_PAGE_EVENTS_MAX}"),
        ));
    }
    let store = HeldStore::of(&state);
    let last = meta.next_seq.0.saturating_sub(1);
    let run = meta.run_id;
    let (events, more) = blocking(move || {
        let mut events = Vec::with_capacity(limit.min(last as usize));
        let mut more = false;
        store
            .for_each_event(run, Seq(from), &mut |e| {
                if e.seq.0 > last {
                    return false;
                }
                if events.len() == limit {
                    more = true;
                    return false;
                }
                events.push(inspect::event_json(&e));
                true
            })
            .map_err(|e| ApiError::internal(format!("reading run {run}: {e}")))?;
        Ok((events, more))
    })
    .await?;
    let next_from = more.then(|| from + events.len() as u64);
    Ok(HttpResponse::Ok().json(json!({
        "run_id": run.to_string(),
        "events": events,
        "total": last,
        "next_from": next_from,
    })))
}

// ------------------------------------------------------------ result

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultParams {
    /// How long to wait for the run to close, in milliseconds (0: answer
    /// at once).
    wait_ms: Option<u64>,
}

async fn result(
    _: CanRead,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    params: web::Query<ResultParams>,
) -> ApiResult {
    let id_text = path.into_inner();
    let wait = params.wait_ms.unwrap_or(0);
    if wait > RESULT_WAIT_MS_MAX {
        return Err(ApiError::bad(
            "wait_ms",
            format!("{wait}: at most {RESULT_WAIT_MS_MAX}"),
        ));
    }
    // Read from the store, following continue-as-new, until the run closes
    // or `wait` passes. Polling rather than the engine's result waiter: a
    // client that gives up leaves nothing registered in the engine.
    let deadline = Instant::now() + Duration::from_millis(wait);
    let mut target = id_text;
    let mut pause_ms = RESULT_POLL_MS_MIN;
    let mut hops = 0;
    loop {
        let meta = meta_of(&state, &target).await?;
        match &meta.outcome {
            Some(Outcome::ContinuedAsNew(next)) if hops < RESULT_CHAIN_RUNS_MAX => {
                hops += 1;
                target = next.to_string();
                continue;
            }
            Some(o) => return Ok(HttpResponse::Ok().json(outcome_json(o))),
            None => {}
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(HttpResponse::Accepted()
                .json(json!({"status": "running", "run_id": meta.run_id.to_string()})));
        }
        let pause = Duration::from_millis(pause_ms).min(deadline - now);
        actix_web::rt::time::sleep(pause).await;
        pause_ms = (pause_ms * 2).min(RESULT_POLL_MS_MAX);
    }
}

// ------------------------------------------------------------ export

async fn export(_: CanRead, state: web::Data<ServeState>, path: web::Path<String>) -> ApiResult {
    let meta = meta_of(&state, &path.into_inner()).await?;
    let store = HeldStore::of(&state);
    let run = meta.run_id;
    let bytes = blocking(move || {
        let bundle = keel::Bundle::from_store(&*store, &run.to_string())
            .map_err(|e| ApiError::internal(format!("reading run {run}: {e}")))?;
        bundle
            .encode()
            .map_err(|e| ApiError::internal(format!("encoding run {run}: {e}")))
    })
    .await?;
    Ok(HttpResponse::Ok()
        .content_type("application/octet-stream")
        .insert_header((
            "Content-Disposition",
            format!("attachment; filename=\"{run}.keel-bundle\""),
        ))
        .body(bytes))
}

// ------------------------------------------------------------ schedules

/// `GET /api/v1/schedules`: every schedule (up to 10,000, the engine's
/// `SCHEDULES_LIST_MAX`) with the summary its run keeps.
async fn schedules(_: CanRead, state: web::Data<ServeState>) -> ApiResult {
    let list = state
        .client
        .schedules()
        .list()
        .await
        .map_err(ApiError::engine)?;
    let rows: Vec<Value> = list
        .iter()
        .map(|s| {
            json!({
                "id": s.id,
                "run_id": s.run_id.to_string(),
                "instance_id": keel::schedule::schedule_instance(&s.id).as_str(),
                "summary": s.memo,
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({ "schedules": rows })))
}

/// `GET /api/v1/schedules/{id}`: its calendar, policies, open runs,
/// waiting triggers, next times, newest triggers and counters.
async fn schedule(_: CanRead, state: web::Data<ServeState>, path: web::Path<String>) -> ApiResult {
    let sid = path.into_inner();
    id("id", &sid)?;
    let d = state
        .client
        .schedules()
        .describe(&sid)
        .await
        .map_err(ApiError::engine)?;
    let mut v = serde_json::to_value(&d).map_err(|e| ApiError::internal(e.to_string()))?;
    v["instance_id"] = json!(keel::schedule::schedule_instance(&sid).as_str());
    Ok(HttpResponse::Ok().json(v))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NoteBody {
    #[serde(default)]
    note: String,
}

/// `POST /api/v1/schedules/{id}/pause`: calendar triggers are skipped
/// until unpaused (idempotent: pausing a paused schedule changes nothing
/// but its note). The body (`{"note": ...}`) is optional.
async fn schedule_pause(
    w: CanWrite,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Bytes,
) -> ApiResult {
    set_paused(w, state, path, body, true).await
}

/// `POST /api/v1/schedules/{id}/unpause`: calendar triggers start again
/// from now on.
async fn schedule_unpause(
    w: CanWrite,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Bytes,
) -> ApiResult {
    set_paused(w, state, path, body, false).await
}

async fn set_paused(
    _: CanWrite,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Bytes,
    paused: bool,
) -> ApiResult {
    let sid = path.into_inner();
    id("id", &sid)?;
    let body: NoteBody = optional_json(&body)?;
    text_len("note", &body.note, keel::schedule::SCHEDULE_NOTE_BYTES_MAX)?;
    let schedules = state.client.schedules();
    let done = if paused {
        schedules.pause(&sid, &body.note).await
    } else {
        schedules.unpause(&sid, &body.note).await
    };
    done.map_err(ApiError::engine)?;
    Ok(HttpResponse::Ok().json(json!({"id": sid, "paused": paused})))
}

/// A JSON body that may be left out (empty or only whitespace).
fn optional_json<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| {
        let message = e.to_string();
        let mut err = ApiError::new(StatusCode::BAD_REQUEST, "bad_json", &message);
        err.field = field_of(&message);
        err
    })
}

// ------------------------------------------------------------ replay

/// Replays the API runs at once; more are answered 503.
pub const REPLAYS_AT_ONCE_MAX: usize = 2;

/// One of the [`REPLAYS_AT_ONCE_MAX`] replay slots, given back on drop.
struct ReplaySlot(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl ReplaySlot {
    fn take(running: &std::sync::Arc<std::sync::atomic::AtomicUsize>) -> Option<Self> {
        use std::sync::atomic::Ordering;
        if running.fetch_add(1, Ordering::AcqRel) >= REPLAYS_AT_ONCE_MAX {
            running.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(ReplaySlot(running.clone()))
    }
}

impl Drop for ReplaySlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Replays the run's history against this build's workflows (read only):
/// where a parked run's history and the code part ways.
async fn replay(_: CanRead, state: web::Data<ServeState>, path: web::Path<String>) -> ApiResult {
    let meta = meta_of(&state, &path.into_inner()).await?;
    // A replay runs workflow code over a whole history: a few at a time,
    // so readers cannot take the server's blocking threads.
    let slot = ReplaySlot::take(&state.replays).ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "replays_busy",
            format!("{REPLAYS_AT_ONCE_MAX} replays are running; try again"),
        )
    })?;
    // The registry only: a copy of the engine here could outlive the
    // state's count when the server stops.
    let Some(workflows) = state.engine.as_ref().map(|e| e.workflows().clone()) else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_engine",
            "this server has no engine whose code could replay the run",
        ));
    };
    let report = blocking(move || {
        // Held until the replay ends, even if the caller went away; the
        // state too, so a server stopping waits for this replay.
        let _slot = slot;
        let store = state.store.as_ref();
        Ok(keel::Replayer::new(workflows).replay_meta(store, &meta))
    })
    .await?;
    let mut v = serde_json::to_value(&report).map_err(|e| ApiError::internal(e.to_string()))?;
    v["run_id"] = json!(report.run_id.to_string());
    v["status"] = json!(report.status.name());
    Ok(HttpResponse::Ok().json(v))
}

// ------------------------------------------------------------ signal, query, update

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalBody {
    name: String,
    #[serde(default)]
    payload: Value,
    command_id: String,
}

async fn signal(
    _: CanWrite,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Json<SignalBody>,
) -> ApiResult {
    let target = path.into_inner();
    id("id", &target)?;
    id("name", &body.name)?;
    id("command_id", &body.command_id)?;
    payload("payload", &body.payload)?;
    state
        .client
        .signal(&target, &body.name, &body.payload, Some(&body.command_id))
        .await
        .map_err(ApiError::engine)?;
    Ok(HttpResponse::Ok().json(json!({"signalled": true})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QueryBody {
    name: String,
    #[serde(default)]
    args: Value,
}

async fn query(
    _: CanRead,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Json<QueryBody>,
) -> ApiResult {
    let target = path.into_inner();
    id("id", &target)?;
    id("name", &body.name)?;
    payload("args", &body.args)?;
    let value: Value = state
        .client
        .query(&target, &body.name, &body.args)
        .await
        .map_err(ApiError::engine)?;
    Ok(HttpResponse::Ok().json(json!({"value": value})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateBody {
    name: String,
    #[serde(default)]
    args: Value,
    update_id: String,
}

async fn update(
    _: CanWrite,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Json<UpdateBody>,
) -> ApiResult {
    let target = path.into_inner();
    id("id", &target)?;
    id("name", &body.name)?;
    id("update_id", &body.update_id)?;
    payload("args", &body.args)?;
    let value: Value = state
        .client
        .update(&target, &body.name, &body.args, Some(&body.update_id))
        .await
        .map_err(ApiError::engine)?;
    Ok(HttpResponse::Ok().json(json!({"value": value})))
}

// ------------------------------------------------------------ cancel, terminate, resume

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CloseBody {
    #[serde(default)]
    reason: String,
    command_id: String,
}

async fn cancel(
    w: CanWrite,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Json<CloseBody>,
) -> ApiResult {
    close(w, state, path, body, false).await
}

async fn terminate(
    w: CanWrite,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Json<CloseBody>,
) -> ApiResult {
    close(w, state, path, body, true).await
}

/// A cancel request or a termination: the same checks, one client call.
async fn close(
    _: CanWrite,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Json<CloseBody>,
    terminate: bool,
) -> ApiResult {
    let target = path.into_inner();
    id("id", &target)?;
    id("command_id", &body.command_id)?;
    reason(&body.reason)?;
    let (client, command) = (&state.client, Some(body.command_id.as_str()));
    let answer = if terminate {
        client.terminate_with(&target, &body.reason, command).await
    } else {
        client.cancel_with(&target, &body.reason, command).await
    };
    answer.map_err(ApiError::engine)?;
    Ok(HttpResponse::Ok().json(match terminate {
        true => json!({"terminated": true}),
        false => json!({"cancel_requested": true}),
    }))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ResumeBody {
    /// Accepted for uniformity; a resume needs none to be repeated safely
    /// (it re-checks the run against the code, which is idempotent).
    #[serde(default)]
    command_id: Option<String>,
}

async fn resume(
    _: CanWrite,
    state: web::Data<ServeState>,
    path: web::Path<String>,
    body: web::Bytes,
) -> ApiResult {
    let target = path.into_inner();
    id("id", &target)?;
    // The body is optional, but one that is sent is checked like any other.
    let parsed: ResumeBody = optional_json(&body)?;
    if let Some(c) = parsed.command_id.as_deref() {
        id("command_id", c)?;
    }
    let r = state
        .client
        .resume(&target)
        .await
        .map_err(ApiError::engine)?;
    Ok(HttpResponse::Ok().json(json!({
        "run_id": r.run.to_string(),
        "was_parked": r.was_parked,
        "fits": r.fits,
        "reason": r.reason,
    })))
}
