//! `keel serve`: an engine behind an HTTP/JSON API, with the operator's
//! web page and Prometheus metrics, served by one actix-web server.
//!
//! An application serves its own engine with [`serve_with`], or mounts
//! [`configure`] into an actix-web `App` it already runs.
//!
//! Safe by default: the server binds to 127.0.0.1; a non-loopback address
//! needs a bearer token ([`ServeConfig::check`] refuses to start without
//! one). With a token set, every API call must carry it, except reads,
//! which a read-only token may make too. Bodies are limited to
//! [`BODY_BYTES_MAX`]; every input is checked and a bad one answered with
//! a 4xx and a JSON body naming the field.

mod api;
mod auth;
mod metrics;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use actix_web::{web, App, HttpServer};
use keel::{Client, Engine};
use keel_storage::Store;

pub use api::{
    ApiError, HISTORY_PAGE_EVENTS_MAX, ID_BYTES_MAX, REASON_BYTES_MAX, REPLAYS_AT_ONCE_MAX,
    RESULT_WAIT_MS_MAX,
};
pub use metrics::Metrics;

/// Largest request body the API reads, in bytes: a start's input plus its
/// memo fits (a payload is at most `keel::storage::PAYLOAD_BYTES_MAX`,
/// 1 MiB, and JSON is a little larger than msgpack).
pub const BODY_BYTES_MAX: usize = 2 * 1024 * 1024;

/// The address `keel serve` binds to unless told otherwise.
pub const DEFAULT_BIND: &str = "127.0.0.1:8233";

/// Where the OpenAPI document is served.
pub const OPENAPI_PATH: &str = "/api/openapi.json";

/// The OpenAPI document of the API, checked in beside the code
/// (`crates/cli/src/serve/openapi.json`); a test checks that it lists
/// every route the server answers.
pub const OPENAPI_JSON: &str = include_str!("openapi.json");

/// The operator's page: one HTML file and its script, no build chain.
const UI_HTML: &str = include_str!("ui.html");
const UI_JS: &str = include_str!("ui.js");

/// The page's policy: its own script only (nothing injected can run),
/// no framing, no foreign form targets.
const UI_CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// How `keel serve` listens and whom it lets in.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Where to listen.
    pub bind: SocketAddr,
    /// The bearer token for every call. Required on a non-loopback
    /// address.
    pub token: Option<String>,
    /// A bearer token for reads only (list, describe, history, result,
    /// query, export, metrics).
    pub read_token: Option<String>,
    /// HTTP worker threads.
    pub workers: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            bind: DEFAULT_BIND.parse().expect("a valid default address"),
            token: None,
            read_token: None,
            workers: 2,
        }
    }
}

/// Why a configuration cannot serve.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A non-loopback address without a token: anyone on the network
    /// could start, signal and terminate runs.
    #[error("binding to {0} (not a loopback address) needs a bearer token (--token or KEEL_SERVE_TOKEN); refusing to serve the API open to the network")]
    OpenToNetwork(SocketAddr),
    /// A read-only token without a full one: writes would be open while
    /// reads are not.
    #[error("a read-only token needs a full token too (--token or KEEL_SERVE_TOKEN); without one, writes would be open while reads are not")]
    ReadTokenAlone,
    /// A token too short to resist guessing.
    #[error("the {which} token has {len} characters; use at least {TOKEN_CHARS_MIN}")]
    WeakToken {
        /// `full` or `read-only`.
        which: &'static str,
        /// Its length.
        len: usize,
    },
    /// The same text for both tokens would make readers writers.
    #[error("the read-only token must differ from the full token")]
    SameTokens,
}

/// Shortest bearer token accepted, in characters.
pub const TOKEN_CHARS_MIN: usize = 16;

/// How long stopping a server waits for its workers to drop their copies
/// of the state (and with them the engine and its store). actix-web's
/// worker threads end after the server's future, unjoined; a store still
/// open in one of them when the process exits is torn down under RocksDB's
/// background threads, which aborts the process.
pub const SERVE_RELEASE_WAIT_MS_MAX: u64 = 10_000;

impl ServeConfig {
    /// Refuses what would expose the engine: a non-loopback address with
    /// no token, weak or identical tokens, a read-only token alone.
    pub fn check(&self) -> Result<(), ConfigError> {
        for (which, t) in [("full", &self.token), ("read-only", &self.read_token)] {
            if let Some(t) = t {
                if t.chars().count() < TOKEN_CHARS_MIN {
                    return Err(ConfigError::WeakToken {
                        which,
                        len: t.chars().count(),
                    });
                }
            }
        }
        if self.read_token.is_some() && self.token.is_none() {
            return Err(ConfigError::ReadTokenAlone);
        }
        if self.token.is_some() && self.token == self.read_token {
            return Err(ConfigError::SameTokens);
        }
        if self.token.is_none() && !is_loopback(self.bind.ip()) {
            return Err(ConfigError::OpenToNetwork(self.bind));
        }
        Ok(())
    }
}

pub(crate) fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v| v.is_loopback()),
    }
}

/// What the handlers share: the engine's client and store, the tokens and
/// the metrics.
#[derive(Clone)]
pub struct ServeState {
    pub(crate) client: Client,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) engine: Option<Arc<Engine>>,
    pub(crate) tokens: auth::Tokens,
    pub(crate) metrics: Arc<Metrics>,
    /// Replays running now (at most `api::REPLAYS_AT_ONCE_MAX`).
    pub(crate) replays: Arc<std::sync::atomic::AtomicUsize>,
    /// One strong count per copy of this state; stopping a server waits
    /// for the count to reach zero ([`Released`]).
    copies: Arc<()>,
}

impl std::fmt::Debug for ServeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeState")
            .field("token_required", &self.tokens.required())
            .finish_non_exhaustive()
    }
}

impl ServeState {
    /// Whether commits are written: the engine's view when one is served
    /// (which also sees a commit that hangs), else the store's.
    pub(crate) fn health(&self) -> keel_storage::StoreHealth {
        match &self.engine {
            Some(engine) => engine.health(),
            None => self.store.health(),
        }
    }

    /// The state for serving `engine` under `config`'s tokens; refused
    /// when `config` would expose the engine ([`ServeConfig::check`]), so an
    /// application mounting [`configure`] gets the same protection as
    /// `keel serve`.
    pub fn new(engine: Arc<Engine>, config: &ServeConfig) -> Result<Self, ConfigError> {
        config.check()?;
        Ok(ServeState {
            client: engine.client(),
            store: engine.store(),
            engine: Some(engine),
            tokens: auth::Tokens::new(config.token.clone(), config.read_token.clone()),
            metrics: Arc::new(Metrics::default()),
            replays: Arc::default(),
            copies: Arc::default(),
        })
    }

    /// Watches this state's copies: [`Released::wait`] returns once every
    /// copy is dropped.
    fn released(&self) -> Released {
        Released(Arc::downgrade(&self.copies))
    }
}

/// The store for a read on a blocking thread: it holds the state's copy
/// until the read ends, so a server stopping waits for reads a caller
/// left behind.
pub(crate) struct HeldStore(web::Data<ServeState>);

impl HeldStore {
    pub(crate) fn of(state: &web::Data<ServeState>) -> Self {
        HeldStore(state.clone())
    }
}

impl std::ops::Deref for HeldStore {
    type Target = dyn Store;
    fn deref(&self) -> &(dyn Store + 'static) {
        self.0.store.as_ref()
    }
}

/// Whether every copy of a [`ServeState`] is gone, so the engine and the
/// store they shared are the owner's alone again.
#[derive(Debug)]
struct Released(std::sync::Weak<()>);

impl Released {
    /// Waits, at most [`SERVE_RELEASE_WAIT_MS_MAX`], until no copy of the
    /// state lives; a typed `TimedOut` error names what is still held.
    fn wait(&self) -> std::io::Result<()> {
        let deadline =
            std::time::Instant::now() + std::time::Duration::from_millis(SERVE_RELEASE_WAIT_MS_MAX);
        loop {
            let held = self.0.strong_count();
            if held == 0 {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "{held} copies of the server's state (the engine, its store) are still \
                         held {SERVE_RELEASE_WAIT_MS_MAX} ms after the server stopped"
                    ),
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

/// Mounts the API, the page, the OpenAPI document and `/metrics` on an
/// actix-web app: `App::new().configure(keel_cli::serve::configure(state))`.
pub fn configure(state: ServeState) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        cfg.app_data(web::Data::new(state))
            .app_data(api::json_config())
            .app_data(api::query_config())
            .app_data(api::path_config())
            .default_service(web::to(api::not_found))
            .route("/", web::get().to(ui))
            .route("/runs/{id}", web::get().to(ui))
            .route("/schedules", web::get().to(ui))
            .route("/schedules/{id}", web::get().to(ui))
            .route("/ui.js", web::get().to(ui_js))
            .route(OPENAPI_PATH, web::get().to(openapi))
            .route("/healthz", web::get().to(api::healthz))
            .route("/metrics", web::get().to(metrics::scrape))
            .service(api::scope());
    }
}

async fn ui() -> actix_web::HttpResponse {
    actix_web::HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .insert_header(("Content-Security-Policy", UI_CSP))
        .insert_header(("X-Content-Type-Options", "nosniff"))
        .body(UI_HTML)
}

async fn ui_js() -> actix_web::HttpResponse {
    actix_web::HttpResponse::Ok()
        .content_type("text/javascript; charset=utf-8")
        .insert_header(("X-Content-Type-Options", "nosniff"))
        .body(UI_JS)
}

async fn openapi() -> actix_web::HttpResponse {
    actix_web::HttpResponse::Ok()
        .content_type("application/json")
        .body(OPENAPI_JSON)
}

/// Arguments of `keel serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The data directory (created if missing). A PostgreSQL store is
    /// named by its URL instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: std::path::PathBuf,
    /// Where to listen. Anything but a loopback address needs --token.
    #[arg(long, default_value = DEFAULT_BIND)]
    pub bind: SocketAddr,
    /// The bearer token every call must carry (default: the environment
    /// variable KEEL_SERVE_TOKEN; none on a loopback address means open).
    #[arg(long)]
    pub token: Option<String>,
    /// A bearer token that may only read (default: KEEL_SERVE_READ_TOKEN).
    #[arg(long)]
    pub read_token: Option<String>,
    /// With a PostgreSQL store: run as one of several engine processes
    /// sharing the database, over this many shards (every process must
    /// use the same number; `keel demo --processes` uses 12). Without it
    /// the engine holds the whole database alone.
    #[arg(long, value_name = "N")]
    pub shards: Option<usize>,
}

/// Runs `keel serve`: builds the engine from `builder` on `--data` and
/// serves it until interrupted.
pub fn run(args: ServeArgs, builder: keel::EngineBuilder) -> anyhow::Result<()> {
    let from_env = |name: &str| std::env::var(name).ok().filter(|t| !t.is_empty());
    let config = ServeConfig {
        bind: args.bind,
        token: args.token.or_else(|| from_env("KEEL_SERVE_TOKEN")),
        read_token: args
            .read_token
            .or_else(|| from_env("KEEL_SERVE_READ_TOKEN")),
        ..ServeConfig::default()
    };
    // Refused before the store is opened: a bad configuration touches
    // no data.
    config.check()?;
    let builder = match (crate::output::postgres_of(&args.data), args.shards) {
        (Some(options), Some(shards)) => {
            anyhow::ensure!(shards > 0, "--shards must be at least 1");
            builder.postgres_options(options.sharded()).shards(shards)
        }
        (Some(options), None) => builder.postgres_options(options),
        (None, Some(_)) => anyhow::bail!(
            "--shards shares a PostgreSQL database between engine processes; \
             a data directory is opened by one process"
        ),
        (None, None) => builder.data_dir(&args.data),
    };
    let engine = builder
        .build()
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", crate::output::shown(&args.data)))?;
    serve_with(engine, config)
}

/// A server [`spawn`] started on a thread of its own.
#[derive(Debug)]
pub struct Serving {
    addrs: Vec<SocketAddr>,
    handle: actix_web::dev::ServerHandle,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    released: Released,
}

impl Serving {
    /// The address it listens on (the port chosen, if port 0 was asked).
    pub fn addr(&self) -> SocketAddr {
        self.addrs[0]
    }

    /// `http://` and [`Serving::addr`]: the base of every route.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// Stops accepting, lets the requests in flight finish, and waits for
    /// the server's thread and until its workers dropped every copy of the
    /// state: the engine is left running, and the caller's alone again (an
    /// `Arc::try_unwrap` of it succeeds). `TimedOut` if a copy is still held
    /// after [`SERVE_RELEASE_WAIT_MS_MAX`].
    pub fn stop(mut self) -> std::io::Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> std::io::Result<()> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        futures::executor::block_on(self.handle.stop(true));
        thread
            .join()
            .map_err(|_| std::io::Error::other("the server's thread panicked"))??;
        self.released.wait()
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Err(e) = self.stop_and_join() {
            tracing::warn!(error = %e, "stopping the API server");
        }
    }
}

/// Serves `engine` under `config` from a thread of its own (an actix
/// system with `config.workers` workers; no signal handling) and returns
/// once it listens: for an application that serves its engine next to its
/// own work, and for tests and benchmarks (bind `127.0.0.1:0` for a free
/// port). [`Serving::stop`], or dropping it, stops the server.
pub fn spawn(engine: Arc<Engine>, config: &ServeConfig) -> anyhow::Result<Serving> {
    config.check()?;
    let state = ServeState::new(engine, config)?;
    let released = state.released();
    let bind = config.bind;
    let workers = config.workers.max(1);
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("keel-serve".into())
        .spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let server =
                    HttpServer::new(move || App::new().configure(configure(state.clone())))
                        .workers(workers)
                        .disable_signals()
                        .bind(bind);
                let server = match server {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return Ok(());
                    }
                };
                let addrs = server.addrs();
                let server = server.run();
                let _ = tx.send(Ok((addrs, server.handle())));
                server.await
            })
        })?;
    match rx.recv() {
        Ok(Ok((addrs, handle))) => Ok(Serving {
            addrs,
            handle,
            thread: Some(thread),
            released,
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(anyhow::anyhow!("cannot listen on {bind}: {e}"))
        }
        Err(_) => {
            let _ = thread.join();
            Err(anyhow::anyhow!(
                "the API server's thread ended before it listened"
            ))
        }
    }
}

/// Serves `engine` under `config` until the process is interrupted
/// (SIGINT or SIGTERM), then shuts the engine down. Blocks; call it from
/// `main`, not from inside an async runtime.
pub fn serve_with(engine: Engine, config: ServeConfig) -> anyhow::Result<()> {
    config.check()?;
    let engine = Arc::new(engine);
    let state = ServeState::new(engine.clone(), &config)?;
    let released = state.released();
    let bind = config.bind;
    actix_web::rt::System::new().block_on(async move {
        let server = HttpServer::new(move || App::new().configure(configure(state.clone())))
            .workers(config.workers.max(1))
            .bind(bind)
            .map_err(|e| anyhow::anyhow!("cannot listen on {bind}: {e}"))?;
        let addrs = server.addrs();
        for a in &addrs {
            eprintln!(
                "keel serve: listening on http://{a}/ (API under /api/v1, metrics at /metrics)"
            );
        }
        server.run().await?;
        anyhow::Ok(())
    })?;
    eprintln!("keel serve: stopping the engine");
    if let Err(e) = released.wait() {
        tracing::warn!(error = %e, "waiting for the server's workers");
    }
    match Arc::try_unwrap(engine) {
        Ok(engine) => engine.shutdown_blocking(),
        Err(_) => {
            tracing::warn!("the engine is still shared at exit; its store closes with the process")
        }
    }
    Ok(())
}
