//! The commands that act on a running `keel serve` over its HTTP API:
//! `keel start|signal|update|query|cancel|terminate --server URL`, and
//! `keel resume ID --server URL` (without `--server`, resume works offline
//! on a data directory). Tables for people, `--json` for scripts (the
//! server's answer as it is). Every state-changing command takes a command
//! id; without one a fresh id is drawn and printed, so the same call can be
//! repeated safely by passing it.

use std::process::ExitCode;
use std::time::Duration;

use serde_json::{json, Value};

use crate::bad_input;

/// How long one API call may take, in milliseconds (a result's long poll
/// adds its own wait).
const REQUEST_TIMEOUT_MS: u64 = 30_000;

/// The largest answer a call reads, in bytes (a page of 1,000 runs is
/// about a megabyte).
pub const ANSWER_BYTES_MAX: usize = 64 << 20;

/// An answer's body, read into a buffer of its announced length: ureq's
/// `into_string` reads in small growing steps (a tenth of a page walk's
/// time in `keel bench serve`) and refuses answers over 10 MB. An answer
/// over [`ANSWER_BYTES_MAX`] is an error, never cut short.
pub fn answer_body(response: ureq::Response) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let announced: usize = response
        .header("content-length")
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    let mut body = Vec::with_capacity(announced.min(ANSWER_BYTES_MAX));
    response
        .into_reader()
        .take(ANSWER_BYTES_MAX as u64 + 1)
        .read_to_end(&mut body)?;
    if body.len() > ANSWER_BYTES_MAX {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("an answer over {ANSWER_BYTES_MAX} bytes"),
        ));
    }
    Ok(body)
}

/// Where the server is and who calls it.
#[derive(clap::Args, Debug, Clone)]
pub struct ServerArgs {
    /// The `keel serve` to call, e.g. http://127.0.0.1:8233.
    #[arg(long, value_name = "URL")]
    pub server: String,
    /// Its bearer token (default: the environment variable KEEL_SERVE_TOKEN).
    #[arg(long)]
    pub token: Option<String>,
    /// Print the server's JSON answer.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `keel start`.
#[derive(clap::Args, Debug)]
pub struct StartArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The workflow type, e.g. demo.order.
    #[arg(long = "type", value_name = "TYPE")]
    pub workflow_type: String,
    /// The instance id.
    #[arg(long = "id", value_name = "INSTANCE")]
    pub instance_id: String,
    /// The input as JSON.
    #[arg(long, default_value = "null")]
    pub input: String,
    /// Deduplicates the start (a fresh one is drawn and printed if absent).
    #[arg(long)]
    pub command_id: Option<String>,
    /// allow_duplicate, allow_duplicate_failed_only or reject_duplicate.
    #[arg(long)]
    pub reuse: Option<String>,
}

/// Arguments of `keel signal`.
#[derive(clap::Args, Debug)]
pub struct SignalArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The instance or run id.
    pub id: String,
    /// The signal's name.
    pub name: String,
    /// The payload as JSON.
    #[arg(long, default_value = "null")]
    pub payload: String,
    /// Deduplicates the signal (a fresh one is drawn and printed if absent).
    #[arg(long)]
    pub command_id: Option<String>,
}

/// Arguments of `keel update`.
#[derive(clap::Args, Debug)]
pub struct UpdateArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The instance or run id.
    pub id: String,
    /// The update's name.
    pub name: String,
    /// Its arguments as JSON.
    #[arg(long, default_value = "null")]
    pub args: String,
    /// Deduplicates the update (a fresh one is drawn and printed if absent).
    #[arg(long)]
    pub update_id: Option<String>,
}

/// Arguments of `keel query`.
#[derive(clap::Args, Debug)]
pub struct QueryArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The instance or run id.
    pub id: String,
    /// The query's name.
    pub name: String,
    /// Its arguments as JSON.
    #[arg(long, default_value = "null")]
    pub args: String,
}

/// Arguments of `keel cancel` and `keel terminate`.
#[derive(clap::Args, Debug)]
pub struct CloseArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The instance or run id.
    pub id: String,
    /// Why.
    #[arg(long, default_value = "")]
    pub reason: String,
    /// Deduplicates the request (a fresh one is drawn and printed if absent).
    #[arg(long)]
    pub command_id: Option<String>,
}

fn json_arg(flag: &str, text: &str) -> anyhow::Result<Value> {
    serde_json::from_str(text).map_err(|e| bad_input(format!("{flag}: not JSON: {e}")))
}

/// A command id for a call the user gave none, printed so the call can be
/// repeated as the same call.
fn command_id(given: Option<String>, what: &str) -> String {
    given.unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let id = format!("cli-{what}-{:x}-{nanos:x}", std::process::id());
        eprintln!("command id: {id} (pass --command-id {id} to repeat this call safely)");
        id
    })
}

/// The answer of a call: its status and JSON body.
struct Answer {
    status: u16,
    body: Value,
}

fn call(
    server: &ServerArgs,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<Answer> {
    let base = server.server.trim_end_matches('/');
    if base.starts_with("https://") {
        return Err(bad_input(
            "--server: this build calls servers over plain HTTP only (keel serve listens on HTTP; put TLS in a proxy in front and call it from inside)",
        ));
    }
    if !base.starts_with("http://") {
        return Err(bad_input(format!(
            "--server {base:?}: give a URL like http://127.0.0.1:8233"
        )));
    }
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_millis(REQUEST_TIMEOUT_MS))
        .build();
    let mut req = agent
        .request(method, &format!("{base}/api/v1{path}"))
        .set("Accept", "application/json");
    let token = server.token.clone().or_else(|| {
        std::env::var("KEEL_SERVE_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
    });
    if let Some(t) = token {
        req = req.set("Authorization", &format!("Bearer {t}"));
    }
    let sent = match body {
        Some(b) => req
            .set("Content-Type", "application/json")
            .send_string(&b.to_string()),
        None => req.call(),
    };
    let res = match sent {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(ureq::Error::Transport(t)) => {
            return Err(bad_input(format!("cannot reach {base}: {t}")));
        }
    };
    let status = res.status();
    let text = answer_body(res)
        .and_then(|bytes| {
            String::from_utf8(bytes)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        })
        .map_err(|e| {
            bad_input(format!(
                "{base} answered {status} with an unreadable body: {e}"
            ))
        })?;
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Ok(Answer { status, body })
}

/// Prints an answer: the JSON for scripts, or `human` of it for people; a
/// 4xx/5xx answer is an error naming the server's code and field.
fn finish(
    server: &ServerArgs,
    answer: Answer,
    human: impl FnOnce(&Value) -> String,
) -> anyhow::Result<ExitCode> {
    if answer.status >= 400 {
        let e = &answer.body["error"];
        let field = e["field"]
            .as_str()
            .map(|f| format!(" (field {f})"))
            .unwrap_or_default();
        let message = e["message"]
            .as_str()
            .map_or_else(|| answer.body.to_string(), str::to_string);
        let code = e["code"].as_str().unwrap_or("error");
        if server.json {
            println!("{}", answer.body);
        }
        return Err(bad_input(format!(
            "the server refused ({} {code}){field}: {message}",
            answer.status
        )));
    }
    if server.json {
        println!("{}", answer.body);
    } else {
        println!("{}", human(&answer.body));
    }
    Ok(ExitCode::SUCCESS)
}

fn target(id: &str) -> String {
    // Ids are path segments: anything but unreserved characters is escaped.
    id.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub(crate) fn start(args: StartArgs) -> anyhow::Result<ExitCode> {
    let input = json_arg("--input", &args.input)?;
    let body = json!({
        "workflow_type": args.workflow_type,
        "instance_id": args.instance_id,
        "input": input,
        "command_id": command_id(args.command_id, "start"),
        "reuse": args.reuse,
    });
    let answer = call(&args.server, "POST", "/runs", Some(body))?;
    finish(&args.server, answer, |b| {
        let verb = if b["started"] == json!(true) {
            "started"
        } else {
            "already open as"
        };
        format!(
            "{} {verb} run {}",
            b["instance_id"].as_str().unwrap_or("?"),
            b["run_id"].as_str().unwrap_or("?")
        )
    })
}

pub(crate) fn signal(args: SignalArgs) -> anyhow::Result<ExitCode> {
    let payload = json_arg("--payload", &args.payload)?;
    let body = json!({
        "name": args.name,
        "payload": payload,
        "command_id": command_id(args.command_id, "signal"),
    });
    let path = format!("/runs/{}/signal", target(&args.id));
    let answer = call(&args.server, "POST", &path, Some(body))?;
    finish(&args.server, answer, |_| {
        format!("signal {} committed to {}", args.name, args.id)
    })
}

pub(crate) fn update(args: UpdateArgs) -> anyhow::Result<ExitCode> {
    let a = json_arg("--args", &args.args)?;
    let body = json!({
        "name": args.name,
        "args": a,
        "update_id": command_id(args.update_id, "update"),
    });
    let path = format!("/runs/{}/update", target(&args.id));
    let answer = call(&args.server, "POST", &path, Some(body))?;
    finish(&args.server, answer, |b| b["value"].to_string())
}

pub(crate) fn query(args: QueryArgs) -> anyhow::Result<ExitCode> {
    let a = json_arg("--args", &args.args)?;
    let body = json!({"name": args.name, "args": a});
    let path = format!("/runs/{}/query", target(&args.id));
    let answer = call(&args.server, "POST", &path, Some(body))?;
    finish(&args.server, answer, |b| b["value"].to_string())
}

pub(crate) fn close(args: CloseArgs, terminate: bool) -> anyhow::Result<ExitCode> {
    let what = if terminate { "terminate" } else { "cancel" };
    let body = json!({
        "reason": args.reason,
        "command_id": command_id(args.command_id, what),
    });
    let path = format!("/runs/{}/{what}", target(&args.id));
    let answer = call(&args.server, "POST", &path, Some(body))?;
    finish(&args.server, answer, |_| {
        if terminate {
            format!("{} terminated", args.id)
        } else {
            format!("cancellation of {} requested", args.id)
        }
    })
}

pub(crate) fn resume(id: &str, server: &ServerArgs) -> anyhow::Result<ExitCode> {
    let path = format!("/runs/{}/resume", target(id));
    let answer = call(server, "POST", &path, Some(json!({})))?;
    let fits = answer.body["fits"] != json!(false);
    let code = finish(server, answer, |b| {
        match (b["was_parked"] == json!(true), b["fits"] == json!(true)) {
            (false, _) => format!("{id} was not parked"),
            (true, true) => format!("{id} resumed: its history replays against the server's code"),
            (true, false) => format!(
                "{id} stays parked: {}",
                b["reason"]
                    .as_str()
                    .unwrap_or("its history does not replay")
            ),
        }
    })?;
    Ok(if fits { code } else { ExitCode::from(1) })
}
