//! Goal: the pure run machine keeps the seed's barrier rules and replays
//! exactly what it did live.
//! Method: drive `RunMachine` by hand (no engine, no IO): start a run, feed
//! activity results in chosen orders, look at the events it returns; then
//! replay the collected history and compare.

use keel_core::{
    Activity, ActivityContext, ActivityError, Input, MachineError, RunMachine, StartSpec, Workflow,
    WorkflowContext, WorkflowError, WorkflowRegistry,
};
use keel_storage::{
    AttemptNo, Event, EventKind, Failure, FailureKind, InstanceId, Payload, RunId, Seq, Step,
    Timestamp,
};
use proptest::prelude::*;

struct Echo;
impl Activity for Echo {
    const NAME: &'static str = "echo";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        Ok(i)
    }
}

struct FanOut;
impl Workflow for FanOut {
    const NAME: &'static str = "fan-out";
    type Input = (u32, u32);
    type Output = u32;
    async fn run(ctx: WorkflowContext, (n, limit): (u32, u32)) -> Result<u32, WorkflowError> {
        let calls = (0..n).map(|i| ctx.activity::<Echo>(i)).collect::<Vec<_>>();
        let out = ctx.all_limited(limit as usize, calls).await?;
        Ok(out.iter().sum())
    }
}

struct Mixed;
impl Workflow for Mixed {
    const NAME: &'static str = "mixed";
    type Input = ();
    type Output = u32;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u32, WorkflowError> {
        let first = ctx.activity::<Echo>(1).await?;
        let (a, (b, c)) = ctx
            .all((
                ctx.activity::<Echo>(2),
                ctx.all((ctx.activity::<Echo>(3), ctx.activity::<Echo>(4))),
            ))
            .await?;
        let bonus: u32 = ctx.wait_signal("bonus").await?;
        Ok(first + a + b + c + bonus)
    }
}

thread_local! {
    /// Polls of [`Counted`] members on this test's thread.
    static LEAF_POLLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// An activity call that counts how often its barrier polls it.
struct Counted(keel_core::ActivityCall<Echo>);

impl keel_core::Branch for Counted {
    type Output = u32;
    fn leaf_count(&self) -> u32 {
        1
    }
    fn poll_branch(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<u32, Failure>> {
        LEAF_POLLS.with(|n| n.set(n.get() + 1));
        self.0.poll_branch(cx)
    }
    fn leaf_step(&self) -> Option<Step> {
        self.0.leaf_step()
    }
    fn operation(&self) -> keel_storage::OperationKind {
        keel_storage::OperationKind::Activity
    }
}

/// `groups` nested vector barriers of `per_group` leaves each, under one
/// vector barrier; returns every result in the input's shape.
struct Wide;
impl Workflow for Wide {
    const NAME: &'static str = "wide";
    type Input = (u32, u32);
    type Output = Vec<Vec<u32>>;
    async fn run(
        ctx: WorkflowContext,
        (groups, per_group): (u32, u32),
    ) -> Result<Vec<Vec<u32>>, WorkflowError> {
        let inner = (0..groups)
            .map(|g| {
                ctx.all(
                    (0..per_group)
                        .map(|i| Counted(ctx.activity::<Echo>(g * per_group + i)))
                        .collect::<Vec<_>>(),
                )
            })
            .collect::<Vec<_>>();
        Ok(ctx.all(inner).await?)
    }
}

/// Reads "tick" signals until the engine suggests continuing as new, then
/// continues with the history length it saw.
struct Ticker;
impl Workflow for Ticker {
    const NAME: &'static str = "ticker";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        loop {
            let _: u32 = ctx.wait_signal("tick").await?;
            if ctx.continue_as_new_suggested() {
                return Err(WorkflowError::continue_as_new(&ctx.history_len()));
            }
        }
    }
}

fn registry() -> WorkflowRegistry {
    let mut r = WorkflowRegistry::new();
    r.register::<FanOut>()
        .register::<Mixed>()
        .register::<Wide>()
        .register::<Ticker>();
    r
}

fn start<W: Workflow>(input: &W::Input) -> (RunMachine, Vec<Event>) {
    start_in::<W>(&registry(), input)
}

fn start_in<W: Workflow>(reg: &WorkflowRegistry, input: &W::Input) -> (RunMachine, Vec<Event>) {
    RunMachine::start(reg, spec::<W>(input), Timestamp(1000)).unwrap()
}

/// The start of run (1, 2) of instance `i` as a `W`.
fn spec<W: Workflow>(input: &W::Input) -> StartSpec {
    StartSpec {
        run_id: RunId::from_u64_pair(1, 2),
        instance_id: InstanceId::new("i"),
        workflow_type: W::NAME.into(),
        input: Payload::encode(input).unwrap(),
        command_id: None,
        parent: None,
        continued_from: None,
        random_seed: 7,
        previous_run: None,
        carried: Default::default(),
        memo: Vec::new(),
        search_attributes: Vec::new(),
        timeouts: Default::default(),
    }
}

fn scheduled(events: &[Event]) -> Vec<(Step, u32)> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ActivityScheduled { step, input, .. } => {
                Some((*step, input.decode().unwrap()))
            }
            _ => None,
        })
        .collect()
}

fn complete(step: Step, value: u32) -> Input {
    Input::ActivityCompleted {
        step,
        attempt: AttemptNo::FIRST,
        result: Payload::encode(&value).unwrap(),
    }
}

#[test]
fn limited_fan_out_never_has_more_than_the_limit_open() {
    let (mut m, first) = start::<FanOut>(&(50, 4));
    let mut history = first.clone();
    let mut open = scheduled(&first);
    assert_eq!(open.len(), 4);
    let barrier = match &first[1].kind {
        EventKind::ActivityScheduled { group, .. } => group[0].step,
        _ => unreachable!(),
    };
    let mut max_open = open.len();
    let mut t = 1000;
    while let Some((step, v)) = open.first().copied() {
        open.remove(0);
        t += 1;
        let events = m.handle(complete(step, v), Timestamp(t)).unwrap();
        for e in &events {
            if let EventKind::ActivityScheduled { group, input, .. } = &e.kind {
                let i: u32 = input.decode().unwrap();
                assert_eq!(
                    (group[0].step, group[0].size, group[0].index),
                    (barrier, 50, i)
                );
            }
        }
        open.extend(scheduled(&events));
        max_open = max_open.max(open.len());
        history.extend(events);
    }
    assert_eq!(max_open, 4);
    let last = history.last().unwrap();
    assert_eq!(
        last.kind,
        EventKind::WorkflowCompleted {
            result: Payload::encode(&(0..50u32).sum::<u32>()).unwrap()
        }
    );
    // Replay of the whole history reproduces the closed run.
    let replayed = RunMachine::replay(&registry(), history).unwrap();
    assert!(replayed.is_closed());
}

#[test]
fn a_vector_barrier_polls_a_leaf_only_when_its_result_is_in() {
    // Goal: a vector barrier's cost follows its results, not its width: a
    // leaf is polled once to issue it and once when its result arrives.
    // Method: 4 nested barriers of 64 counted leaves, completed in reverse
    // order one input at a time; count the polls, check the results keep
    // the input's shape, and replay the history (polls counted again).
    let (groups, per_group) = (4u32, 64u32);
    let leaves = u64::from(groups * per_group);
    LEAF_POLLS.with(|n| n.set(0));
    let (mut m, first) = start::<Wide>(&(groups, per_group));
    let mut history = first.clone();
    let open = scheduled(&first);
    assert_eq!(open.len() as u64, leaves, "every leaf issued in one step");
    let mut t = 1000;
    for (step, v) in open.into_iter().rev() {
        t += 1;
        history.extend(m.handle(complete(step, v), Timestamp(t)).unwrap());
    }
    let want: Vec<Vec<u32>> = (0..groups)
        .map(|g| (0..per_group).map(|i| g * per_group + i).collect())
        .collect();
    assert_eq!(
        history.last().unwrap().kind,
        EventKind::WorkflowCompleted {
            result: Payload::encode(&want).unwrap()
        }
    );
    let live = LEAF_POLLS.with(|n| n.replace(0));
    // One poll to issue each leaf and one when its result is in; polling
    // every member after each result would be about n²/2 = 32,896.
    assert!(
        (leaves..=2 * leaves).contains(&live),
        "{live} polls of {leaves} leaves"
    );
    let replayed = RunMachine::replay(&registry(), history).unwrap();
    assert!(replayed.is_closed());
    assert!(LEAF_POLLS.with(|n| n.get()) <= 2 * leaves);
}

#[test]
fn the_first_failure_wakes_the_barrier_and_later_ones_do_not_replace_it() {
    let (mut m, first) = start::<Mixed>(&());
    let s1 = scheduled(&first)[0].0;
    let events = m.handle(complete(s1, 1), Timestamp(1001)).unwrap();
    let leaves = scheduled(&events);
    assert_eq!(leaves.len(), 3, "all three leaves issued in one step");
    let fail = |step, msg: &str| Input::ActivityFailed {
        step,
        attempt: AttemptNo::FIRST,
        failure: Failure::new(FailureKind::Application, msg, false),
        retry_at: None,
        heartbeat: None,
    };
    // Leaf 2 fails first; the barrier fails with it at once.
    let events = m
        .handle(fail(leaves[2].0, "leaf two"), Timestamp(1002))
        .unwrap();
    let closing = events.last().unwrap();
    match &closing.kind {
        EventKind::WorkflowFailed { failure } => assert_eq!(failure.message, "leaf two"),
        other => panic!("expected the run to fail, got {other:?}"),
    }
    assert!(m.is_closed());
    // A later failure of another member is refused: the run is closed.
    assert_eq!(
        m.check(&fail(leaves[0].0, "leaf zero")),
        keel_core::Verdict::Closed
    );
}

#[test]
fn a_leaf_recorded_without_its_group_path_is_incompatible_history() {
    let (mut m, first) = start::<Mixed>(&());
    let s1 = scheduled(&first)[0].0;
    let mut history = first;
    history.extend(m.handle(complete(s1, 1), Timestamp(1001)).unwrap());
    // Strip the group path from the first leaf, as an old version wrote it.
    for e in history.iter_mut() {
        if let EventKind::ActivityScheduled { group, .. } = &mut e.kind {
            if !group.is_empty() {
                group.clear();
                break;
            }
        }
    }
    match RunMachine::replay(&registry(), history) {
        Err(MachineError::IncompatibleHistory { detail, .. }) => {
            assert!(detail.contains("group path"), "{detail}")
        }
        other => panic!("expected incompatible history, got {other:?}"),
    }
}

proptest! {
    // Any order of results, signal included: replay of the history equals
    // the live run, at every input boundary.
    #[test]
    fn replay_matches_live_for_any_completion_order(order in Just(vec![0usize, 1, 2]).prop_shuffle(), signal_at in 0usize..4) {
        let (mut m, first) = start::<Mixed>(&());
        let mut history = first.clone();
        let s1 = scheduled(&first)[0].0;
        history.extend(m.handle(complete(s1, 1), Timestamp(1001)).unwrap());
        let leaves = scheduled(&history);
        let leaves = &leaves[1..];
        let mut t = 1002;
        let mut boundaries = vec![history.len()];
        for (k, &i) in order.iter().enumerate() {
            if k == signal_at {
                history.extend(m.handle(Input::Signal { name: "bonus".into(), payload: Payload::encode(&10u32).unwrap(), command_id: None }, Timestamp(t)).unwrap());
                boundaries.push(history.len());
                t += 1;
            }
            let (step, v) = leaves[i];
            history.extend(m.handle(complete(step, v), Timestamp(t)).unwrap());
            boundaries.push(history.len());
            t += 1;
        }
        if signal_at >= order.len() {
            history.extend(m.handle(Input::Signal { name: "bonus".into(), payload: Payload::encode(&10u32).unwrap(), command_id: None }, Timestamp(t)).unwrap());
            boundaries.push(history.len());
        }
        prop_assert!(m.is_closed());
        prop_assert_eq!(&history.last().unwrap().kind, &EventKind::WorkflowCompleted { result: Payload::encode(&20u32).unwrap() });
        for b in boundaries {
            let replayed = RunMachine::replay(&registry(), history[..b].to_vec());
            prop_assert!(replayed.is_ok(), "prefix {} failed: {:?}", b, replayed.err());
            prop_assert_eq!(replayed.unwrap().next_seq().0 as usize, b + 1);
        }
    }
}

#[test]
fn continue_as_new_is_suggested_at_its_threshold_and_replays() {
    // Goal: `continue_as_new_suggested` turns true exactly when the history
    // reaches CONTINUE_AS_NEW_SUGGESTED_EVENTS, and a run that continues
    // there replays. Method: feed signals by hand until the code continues.
    let (mut m, mut history) = start::<Ticker>(&());
    let mut now = 1000;
    let closing = loop {
        now += 1;
        let tick = Input::Signal {
            name: "tick".into(),
            payload: Payload::encode(&1u32).unwrap(),
            command_id: None,
        };
        let events = m.handle(tick, Timestamp(now)).unwrap();
        history.extend(events.iter().cloned());
        if let Some(e) = events.iter().find(|e| e.kind.closes_run()) {
            break e.clone();
        }
        assert!(history.len() < 20_000, "never suggested");
    };
    let threshold = keel_core::CONTINUE_AS_NEW_SUGGESTED_EVENTS;
    match closing.kind {
        EventKind::WorkflowContinuedAsNew { input, carried, .. } => {
            assert_eq!(input.decode::<u64>().unwrap(), threshold);
            assert!(carried.signals.is_empty());
        }
        other => panic!("expected a continue-as-new, got {other:?}"),
    }
    // Started, then threshold - 1 signals; the closing event follows.
    assert_eq!(history.len() as u64, threshold + 1);
    let replayed = RunMachine::replay(&registry(), history).unwrap();
    assert!(replayed.is_closed());
}

thread_local! {
    /// What `Holds` captured in its handlers, watched from outside.
    static CAPTURED: std::cell::RefCell<Option<std::rc::Weak<()>>> = const { std::cell::RefCell::new(None) };
}

/// Registers a query and an update whose handlers capture its context (as
/// an update that runs activities must) and a value watched by the test,
/// then waits for a signal that never comes.
struct Holds;
impl Workflow for Holds {
    const NAME: &'static str = "holds";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        let watched = std::rc::Rc::new(());
        CAPTURED.with(|c| *c.borrow_mut() = Some(std::rc::Rc::downgrade(&watched)));
        let (query_ctx, kept) = (ctx.clone(), watched.clone());
        ctx.on_query("run", move |_: ()| {
            let _ = &kept;
            query_ctx.run_id().to_string()
        });
        let update_ctx = ctx.clone();
        ctx.on_update(
            "echo",
            |_: &u32| Ok(()),
            move |v: u32| {
                let ctx = update_ctx.clone();
                async move { Ok(ctx.activity::<Echo>(v).await?) }
            },
        );
        drop(watched);
        ctx.wait_signal::<()>("never").await?;
        Ok(())
    }
}

// Goal: a machine whose handlers capture the run's context frees the run's
// state when it is dropped. The handlers and the context hold each other;
// the engine drops a machine at every passivation, restart and query
// replay, so a cycle leaked one run's state per activation (`keel sim`
// grew by about 60 KB per seed from its `updates` shape alone). Method:
// start such a run, drop its machine, and check that what its handlers
// captured is gone.
#[test]
fn a_dropped_machine_frees_what_its_handlers_captured() {
    let mut reg = registry();
    reg.register::<Holds>();
    let (machine, _) = start_in::<Holds>(&reg, &());
    let captured = CAPTURED
        .with(|c| c.borrow().clone())
        .expect("the run registered its handlers");
    assert!(captured.upgrade().is_some(), "held while the machine lives");
    drop(machine);
    assert!(
        captured.upgrade().is_none(),
        "the handlers' captures outlive the machine"
    );
}

/// Two async closures, one after the other.
struct TwoAsync;
impl Workflow for TwoAsync {
    const NAME: &'static str = "two-async";
    type Input = ();
    type Output = u32;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u32, WorkflowError> {
        let a: u32 = ctx
            .run_async(1u32, |_: WorkflowContext, x: u32| async move { Ok(x + 1) })
            .await?;
        let b: u32 = ctx
            .run_async(a, |_: WorkflowContext, x: u32| async move { Ok(x * 10) })
            .await?;
        Ok(b)
    }
}

fn async_children(events: &[Event]) -> Vec<(Step, RunId)> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ChildScheduled(c) => Some((c.step, c.child_run_id)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_run_tells_which_async_children_it_saw_close_live_and_in_replay() {
    // Goal: the engine can forget the closure of an async child once it
    // closed, also when its parent is replayed after that (the replay binds
    // every call again as the code re-issues it). Method: run a parent of
    // two async children by hand; complete the first; the machine names it
    // (and only it) as closed, once. Replay the history in a process with
    // no closures bound: the replay binds both, and names the first as
    // closed; the second, still open, stays bound and unnamed.
    let mut reg = WorkflowRegistry::new();
    reg.register::<TwoAsync>();
    let (mut m, mut history) = start_in::<TwoAsync>(&reg, &());
    let first = async_children(&history);
    assert_eq!(first.len(), 1);
    let (step1, child1) = first[0];
    assert!(reg.async_bound(child1));
    assert!(m.take_closed_async_children().is_empty());

    let events = m
        .handle(
            Input::ChildCompleted {
                step: step1,
                child_run_id: child1,
                result: Payload::encode(&2u32).unwrap(),
            },
            Timestamp(2000),
        )
        .unwrap();
    let second = async_children(&events);
    assert_eq!(second.len(), 1);
    let child2 = second[0].1;
    history.extend(events);
    assert_eq!(m.take_closed_async_children(), vec![child1]);
    assert!(m.take_closed_async_children().is_empty(), "named once");
    assert!(reg.async_bound(child2));

    let fresh = reg.with_fresh_closures();
    let mut replayed = RunMachine::replay(&fresh, history.clone()).unwrap();
    assert!(fresh.async_bound(child1), "the replay binds the call again");
    assert!(fresh.async_bound(child2));
    assert_eq!(replayed.take_closed_async_children(), vec![child1]);

    // A replay that diverges after the first child closed (the history
    // records one command more than the code issues) still names it: the
    // engine parks the run and throws the machine away with its list.
    let mut diverged = history;
    let mut extra = diverged.last().cloned().expect("a history");
    extra.seq = Seq(extra.seq.0 + 1);
    diverged.push(extra);
    let fresh = reg.with_fresh_closures();
    let mut closed = Vec::new();
    let replayed = RunMachine::replay_taking_closed(&fresh, diverged, &mut closed);
    assert!(
        matches!(replayed, Err(MachineError::NonDeterminism { .. })),
        "diverged"
    );
    assert_eq!(closed, vec![child1], "named although the replay failed");
}

/// A barrier member whose poll panics: workflow code that fails after
/// another member issued its call.
struct Boom;

impl keel_core::Branch for Boom {
    type Output = u32;
    fn leaf_count(&self) -> u32 {
        1
    }
    fn poll_branch(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<u32, Failure>> {
        panic!("a bug after the async call was issued")
    }
    fn leaf_step(&self) -> Option<Step> {
        None
    }
    fn operation(&self) -> keel_storage::OperationKind {
        keel_storage::OperationKind::Activity
    }
}

/// Issues an async call, then panics in the same activation.
struct AsyncThenPanic;
impl Workflow for AsyncThenPanic {
    const NAME: &'static str = "async-then-panic";
    type Input = ();
    type Output = u32;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u32, WorkflowError> {
        let (a, b) = ctx
            .all((
                ctx.run_async(1u32, |_: WorkflowContext, x: u32| async move { Ok(x) }),
                Boom,
            ))
            .await?;
        Ok(a + b)
    }
}

#[test]
fn code_that_fails_after_an_async_call_leaves_no_closure_bound() {
    // Goal: nothing of an activation whose code fails is committed, so an
    // async child it issued is never scheduled and its closure must not
    // stay bound. Method: a workflow issues an async call and panics in the
    // same activation; its start fails; the registry holds no closure.
    let mut reg = WorkflowRegistry::new();
    reg.register::<AsyncThenPanic>();
    let started = RunMachine::start(&reg, spec::<AsyncThenPanic>(&()), Timestamp(1000));
    assert!(started.is_err(), "the code panicked");
    assert!(
        reg.async_bound_runs().is_empty(),
        "{:?}",
        reg.async_bound_runs()
    );
}
