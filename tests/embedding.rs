//! Goal: the engine embeds in an application's own runtime: built, used
//! and shut down from `#[tokio::main]` (current-thread and multi-thread),
//! from an actix `System` (`#[actix::main]`), and from inside an actix-web
//! request handler, with no nested-runtime panic and without blocking the
//! caller; dropped inside async code without a panic; shut down with
//! `shutdown().await` beside drop.
//! Method: each test builds the engine inside the runtime it names, runs a
//! workflow to its result, and stops it; the actix-web test serves a
//! handler that starts and awaits a workflow, and calls it over a plain TCP
//! socket.

use std::io::{Read, Write};
use std::time::Duration;

use keel::{
    Activity, ActivityContext, ActivityError, Engine, Workflow, WorkflowContext, WorkflowError,
};

#[derive(Default)]
struct Double;
impl Activity for Double {
    const NAME: &'static str = "double";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _ctx: ActivityContext, x: u32) -> Result<u32, ActivityError> {
        Ok(x * 2)
    }
}

struct Twice;
impl Workflow for Twice {
    const NAME: &'static str = "twice";
    type Input = u32;
    type Output = u32;
    async fn run(ctx: WorkflowContext, x: u32) -> Result<u32, WorkflowError> {
        let y = ctx.activity::<Double>(x).await?;
        ctx.timer(Duration::from_millis(5)).await;
        Ok(ctx.activity::<Double>(y).await?)
    }
}

fn engine() -> Engine {
    Engine::builder()
        .in_memory()
        .register_workflow::<Twice>()
        .register_activity::<Double>()
        .build()
        .expect("the engine starts inside any runtime")
}

async fn roundtrip(engine: &Engine, id: &str) -> u32 {
    let c = engine.client();
    c.start::<Twice>(id, &3).await.expect("starts");
    c.result::<Twice>(id).await.expect("completes")
}

#[tokio::test(flavor = "current_thread")]
async fn under_a_current_thread_tokio_runtime() {
    let engine = engine();
    assert_eq!(roundtrip(&engine, "ct").await, 12);
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_multi_thread_tokio_runtime_and_dropped_in_async_code() {
    let engine = engine();
    assert_eq!(roundtrip(&engine, "mt").await, 12);
    // Dropping (rather than `shutdown().await`) inside async code must not
    // panic with "cannot drop a runtime in an async context".
    drop(engine);
}

#[test]
fn under_an_actix_system() {
    actix::System::new().block_on(async {
        let engine = engine();
        assert_eq!(roundtrip(&engine, "ax").await, 12);
        engine.shutdown().await;
    });
}

#[test]
fn from_a_plain_thread_with_a_blocking_shutdown() {
    let engine = engine();
    let v = futures::executor::block_on(roundtrip(&engine, "plain"));
    assert_eq!(v, 12);
    engine.shutdown_blocking();
}

#[actix_web::get("/twice/{x}")]
async fn twice(
    client: actix_web::web::Data<keel::Client>,
    x: actix_web::web::Path<u32>,
) -> actix_web::HttpResponse {
    let x = x.into_inner();
    let id = format!("web-{x}");
    if let Err(e) = client.start::<Twice>(&id, &x).await {
        return actix_web::HttpResponse::InternalServerError().body(e.to_string());
    }
    match client.result::<Twice>(&id).await {
        Ok(v) => actix_web::HttpResponse::Ok().body(v.to_string()),
        Err(e) => actix_web::HttpResponse::InternalServerError().body(e.to_string()),
    }
}

#[test]
fn inside_an_actix_web_application() {
    actix_rt::System::new().block_on(async {
        let engine = engine();
        let client = actix_web::web::Data::new(engine.client());
        let server = actix_web::HttpServer::new(move || {
            actix_web::App::new()
                .app_data(client.clone())
                .service(twice)
        })
        .workers(1)
        .bind(("127.0.0.1", 0))
        .expect("binds");
        let addr = server.addrs()[0];
        let server = server.run();
        let handle = server.handle();
        actix_rt::spawn(server);
        let body = actix_rt::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).expect("connects");
            s.write_all(b"GET /twice/5 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .expect("writes");
            let mut out = String::new();
            s.read_to_string(&mut out).expect("reads");
            out
        })
        .await
        .expect("the request thread");
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
        assert!(body.ends_with("20"), "{body}");
        handle.stop(true).await;
        engine.shutdown().await;
    });
}
