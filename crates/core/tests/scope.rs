//! Goal: scopes and channels behave as the TrueAsync seed says, inside the
//! deterministic machine: backpressure, rendezvous, close-then-drain,
//! fail-together cancelling siblings and nested scopes with committed
//! events, and an error handler keeping the rest running.
//! Method: workflows whose coroutines only use channels and timers, driven
//! by hand through `RunMachine` (time passed in, no IO).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use keel_core::{
    Input, RunMachine, StartSpec, Workflow, WorkflowContext, WorkflowError, WorkflowRegistry,
};
use keel_storage::{
    Event, EventKind, Failure, FailureKind, InstanceId, Payload, RunId, Step, Timestamp,
};

/// Capacity `cap`: a producer sends 5 values, a consumer records when it
/// received each relative to the producer's progress.
struct Pipe;
impl Workflow for Pipe {
    const NAME: &'static str = "pipe";
    type Input = usize;
    type Output = Vec<String>;
    async fn run(ctx: WorkflowContext, cap: usize) -> Result<Vec<String>, WorkflowError> {
        let log = Rc::new(RefCell::new(Vec::new()));
        let scope = ctx.scope();
        let (tx, rx) = ctx.channel::<u32>(cap);
        let l = log.clone();
        scope.spawn(async move {
            for i in 0..5 {
                tx.send(i)
                    .await
                    .map_err(|_| Failure::new(FailureKind::Application, "closed", false))?;
                l.borrow_mut().push(format!("sent {i}"));
            }
            tx.close();
            Ok(())
        });
        let l = log.clone();
        scope.spawn(async move {
            while let Some(v) = rx.recv().await {
                l.borrow_mut().push(format!("got {v}"));
            }
            l.borrow_mut().push("closed".into());
            Ok(())
        });
        scope
            .await_completion(ctx.timer(Duration::from_secs(60)))
            .await?;
        let out = log.borrow().clone();
        Ok(out)
    }
}

/// A failing coroutine cancels a sibling waiting on a timer and a nested
/// scope's coroutine; the error reaches `await_completion`.
struct FailTogether;
impl Workflow for FailTogether {
    const NAME: &'static str = "fail-together";
    type Input = bool;
    type Output = String;
    async fn run(ctx: WorkflowContext, handle_errors: bool) -> Result<String, WorkflowError> {
        let scope = ctx.scope();
        let handled = Rc::new(RefCell::new(0));
        if handle_errors {
            let h = handled.clone();
            scope.on_error(move |_s, _who, _f| *h.borrow_mut() += 1);
        }
        let c1 = ctx.clone();
        scope.spawn(async move {
            c1.timer(Duration::from_secs(10)).await;
            Ok(())
        });
        let c2 = ctx.clone();
        scope.spawn(async move {
            let inner = c2.scope();
            let c3 = c2.clone();
            inner.spawn(async move {
                c3.timer(Duration::from_secs(20)).await;
                Ok(())
            });
            inner
                .await_completion(c2.timer(Duration::from_secs(30)))
                .await?;
            Ok(())
        });
        scope.spawn(
            async move { Err(Failure::new(FailureKind::Application, "bad address", false)) },
        );
        match scope
            .await_completion(ctx.timer(Duration::from_secs(60)))
            .await
        {
            Ok(()) => Ok(format!("completed, {} handled", handled.borrow())),
            Err(e) => Ok(format!("aborted: {e}")),
        }
    }
}

fn registry() -> WorkflowRegistry {
    let mut r = WorkflowRegistry::new();
    r.register::<Pipe>().register::<FailTogether>();
    r
}

fn start<W: Workflow>(input: &W::Input) -> (RunMachine, Vec<Event>) {
    let spec = StartSpec {
        run_id: RunId::from_u64_pair(3, 4),
        instance_id: InstanceId::new("s"),
        workflow_type: W::NAME.into(),
        input: Payload::encode(input).unwrap(),
        command_id: None,
        parent: None,
        continued_from: None,
        random_seed: 1,
        previous_run: None,
        carried: Default::default(),
        memo: Vec::new(),
        search_attributes: Vec::new(),
        timeouts: Default::default(),
    };
    RunMachine::start(&registry(), spec, Timestamp(0)).unwrap()
}

fn result<T: serde::de::DeserializeOwned>(events: &[Event]) -> T {
    match &events.last().unwrap().kind {
        EventKind::WorkflowCompleted { result } => result.decode().unwrap(),
        other => panic!("not completed: {other:?}"),
    }
}

#[test]
fn bounded_channel_backpressure_and_close() {
    let (_, events) = start::<Pipe>(&2);
    let log: Vec<String> = result(&events);
    // Two fit before the consumer runs; then they alternate; the consumer
    // drains after close and sees the end.
    assert_eq!(log.first().map(String::as_str), Some("sent 0"));
    assert_eq!(log.iter().filter(|l| l.starts_with("got")).count(), 5);
    assert_eq!(log.last().map(String::as_str), Some("closed"));
    let first_got = log.iter().position(|l| l.starts_with("got")).unwrap();
    assert_eq!(first_got, 2, "the producer stops at capacity: {log:?}");
}

#[test]
fn capacity_zero_is_a_rendezvous() {
    let (_, events) = start::<Pipe>(&0);
    let log: Vec<String> = result(&events);
    // A send completes only once its value was taken.
    for i in 0..5 {
        let sent = log.iter().position(|l| *l == format!("sent {i}")).unwrap();
        let got = log.iter().position(|l| *l == format!("got {i}")).unwrap();
        assert!(
            got < sent,
            "value {i} taken before its send returned: {log:?}"
        );
    }
}

#[test]
fn fail_together_cancels_siblings_and_nested_scopes_with_events() {
    let (_, events) = start::<FailTogether>(&false);
    let out: String = result(&events);
    assert!(
        out.starts_with("aborted: a coroutine of the scope failed: "),
        "{out}"
    );
    let cancelled_scopes: Vec<Step> = events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::ScopeCancelled { step, .. } => Some(step),
            _ => None,
        })
        .collect();
    assert_eq!(cancelled_scopes.len(), 2, "the scope and its nested scope");
    // Every timer a scope coroutine started is cancelled (the nested
    // coroutine was cancelled before it first ran, so it started none);
    // only the owner's own deadline stays open.
    let started: Vec<Step> = events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::TimerStarted { step, .. } => Some(step),
            _ => None,
        })
        .collect();
    let cancelled: Vec<Step> = events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::TimerCancelled { step, .. } => Some(step),
            _ => None,
        })
        .collect();
    assert_eq!(
        cancelled.len(),
        started.len() - 1,
        "started {started:?}, cancelled {cancelled:?}"
    );
    // Replay reproduces the same cancellations.
    let replayed = RunMachine::replay(&registry(), events).unwrap();
    assert!(replayed.is_closed());
}

#[test]
fn an_error_handler_keeps_the_others_running() {
    let (mut m, events) = start::<FailTogether>(&true);
    assert!(!events
        .iter()
        .any(|e| matches!(e.kind, EventKind::ScopeCancelled { .. })));
    // Fire the timers (10 s, 20 s); the group completes.
    let mut all = events.clone();
    let timers: Vec<(Step, Timestamp)> = events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::TimerStarted { step, fire_at, .. } => Some((step, fire_at)),
            _ => None,
        })
        .collect();
    let mut fire: Vec<_> = timers
        .into_iter()
        .filter(|(_, at)| at.0 <= 20_000)
        .collect();
    fire.sort_by_key(|(_, at)| *at);
    for (step, at) in fire {
        if !m.is_closed() {
            all.extend(m.handle(Input::TimerFired { step }, at).unwrap());
        }
    }
    let out: String = result(&all);
    assert_eq!(out, "completed, 1 handled");
}
