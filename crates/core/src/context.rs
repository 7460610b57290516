//! [`WorkflowContext`]: the durable tools workflow code uses, and the
//! futures behind them. Each command is issued on its future's first poll,
//! so sequential `.await`s suspend one at a time while a future polled
//! alongside others (in `all`) issues in the same pass.

use std::cell::RefCell;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use keel_storage::{
    ActivityOptions, Backoff, Event, EventKind, ExecutionId, Failure, FailureKind, InstanceId,
    Jitter, Payload, RetrySettings, RunId, Step, Timestamp,
};
use serde::{de::DeserializeOwned, Serialize};

use crate::activity::Activity;
use crate::core::{Core, Issued, IssuedUnbuilt, Resolution, WaitKind};

/// A spawned coroutine waiting to be handed to the executor.
pub(crate) type Spawn = Pin<Box<dyn Future<Output = ()>>>;

/// The handle workflow code uses to reach the outside world durably.
/// Cheap to clone; lives on the run's thread.
#[derive(Clone)]
pub struct WorkflowContext {
    pub(crate) core: Rc<RefCell<Core>>,
    pub(crate) spawns: Rc<RefCell<Vec<Spawn>>>,
    pub(crate) scope_registry: crate::scope::ScopeRegistry,
    pub(crate) closures: crate::concurrency::Closures,
    pub(crate) handlers: crate::handlers::SharedHandlers,
}

impl std::fmt::Debug for WorkflowContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let core = self.core.borrow();
        f.debug_struct("WorkflowContext")
            .field("run_id", &core.run_id)
            .field("instance_id", &core.instance_id)
            .finish()
    }
}

fn decode_failure(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::new(
        FailureKind::Application,
        format!("{what} does not decode: {e}"),
        false,
    )
}

impl WorkflowContext {
    /// This run's id.
    pub fn run_id(&self) -> RunId {
        self.core.borrow().run_id
    }

    /// This run's instance.
    pub fn instance_id(&self) -> InstanceId {
        self.core.borrow().instance_id.clone()
    }

    /// The workflow's time: when the input being processed was committed.
    /// The same on every replay.
    pub fn now(&self) -> Timestamp {
        self.core.borrow().now
    }

    /// A deterministic random number, the same on every replay.
    pub fn random(&self) -> u64 {
        self.core.borrow_mut().next_random()
    }

    /// A deterministic version-4 uuid, the same on every replay.
    pub fn uuid(&self) -> uuid::Uuid {
        let mut core = self.core.borrow_mut();
        let (a, b) = (core.next_random(), core.next_random());
        uuid::Builder::from_u128(((a as u128) << 64) | b as u128)
            .with_version(uuid::Version::Random)
            .with_variant(uuid::Variant::RFC4122)
            .into_uuid()
    }

    /// Calls activity `A`. Configure the call with the builder methods, then
    /// `.await` it; the command is issued on the first poll.
    pub fn activity<A: Activity>(&self, input: A::Input) -> ActivityCall<A> {
        ActivityCall {
            core: self.core.clone(),
            input: Some(
                Payload::encode(&input).map_err(|e| format!("activity input does not encode: {e}")),
            ),
            options: ActivityOptions::default(),
            cancellation: Default::default(),
            step: None,
            _activity: PhantomData,
        }
    }

    /// A durable timer that fires `duration` after the workflow's `now`.
    pub fn timer(&self, duration: Duration) -> Timer {
        Timer {
            core: self.core.clone(),
            duration,
            step: None,
        }
    }

    /// Waits for the next signal named `name` and decodes its payload.
    /// Signals are consumed in the order they were committed.
    pub fn wait_signal<T: DeserializeOwned>(&self, name: &str) -> SignalWait<T> {
        SignalWait {
            core: self.core.clone(),
            name: name.to_string(),
            counted: false,
            _t: PhantomData,
        }
    }

    /// The message stream `name` of this instance: messages sent to it
    /// (`client.send_message`) in offset order, read with a cursor that
    /// continue-as-new carries to the next run. See [`crate::stream`].
    pub fn stream<T: DeserializeOwned>(&self, name: &str) -> crate::stream::MessageStream<T> {
        crate::stream::MessageStream::new(self.core.clone(), name)
    }

    /// Sends a message to the stream `stream` of `instance` (an instance
    /// id or a run id; its own instance too), deduplicated at the target
    /// by `key`. Durable: delivered at least once through the outbox after
    /// this command is committed, committed by the target once. Resolves
    /// with the message's offset (`Ok(Some(offset))`), or a failure if the
    /// instance is unknown or closed. See [`crate::stream::ExternalSend`].
    pub fn send_message<T: Serialize>(
        &self,
        instance: &str,
        stream: &str,
        key: &str,
        payload: &T,
    ) -> crate::stream::ExternalSend {
        let key = keel_storage::MessageKey::new(key);
        let delivery = keel_storage::check_stream_message(stream, &key)
            .and_then(|()| Payload::encode(payload).map_err(|e| e.to_string()))
            .map(|payload| keel_storage::Delivery::Message {
                stream: stream.to_string(),
                key,
                payload,
            })
            .map_err(|e| Failure::new(FailureKind::Application, e, false));
        crate::stream::ExternalSend::new(self.core.clone(), instance, delivery)
    }

    /// Sends the signal `name` to `instance` (an instance id or a run id),
    /// durably through the outbox like [`WorkflowContext::send_message`];
    /// the target deduplicates redeliveries by an id derived from this run
    /// and step. Resolves with `Ok(None)` once the signal is committed.
    pub fn signal_workflow<T: Serialize>(
        &self,
        instance: &str,
        name: &str,
        payload: &T,
    ) -> crate::stream::ExternalSend {
        let delivery = Payload::encode(payload)
            .map(|payload| keel_storage::Delivery::Signal {
                name: name.to_string(),
                payload,
            })
            .map_err(|e| {
                let why = format!("signal payload does not encode: {e}");
                Failure::new(FailureKind::Application, why, false)
            });
        crate::stream::ExternalSend::new(self.core.clone(), instance, delivery)
    }

    /// Resolves once `predicate` over workflow state holds. Re-checked after
    /// every input the run receives.
    pub fn condition<F: FnMut() -> bool>(&self, predicate: F) -> Condition<F> {
        Condition {
            core: self.core.clone(),
            predicate,
        }
    }

    /// Runs `f` once and records its value; replay returns the recorded
    /// value without running `f` again.
    pub fn side_effect<T, F>(&self, f: F) -> Result<T, Failure>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> T,
    {
        let mut core = self.core.borrow_mut();
        let step = core.take_step();
        let value = if core.replaying() {
            Payload::default()
        } else {
            Payload::encode(&f()).map_err(|e| decode_failure("side effect value", e))?
        };
        match core.issue(EventKind::SideEffectRecorded { step, value }) {
            Issued::Live(e) | Issued::Replayed(e) => match e.kind {
                EventKind::SideEffectRecorded { value, .. } => value
                    .decode()
                    .map_err(|e| decode_failure("side effect value", e)),
                _ => unreachable!("issue returns the matching kind"),
            },
            Issued::Diverged => Err(Failure::new(
                FailureKind::Application,
                "history diverged; the run will be parked",
                false,
            )),
        }
    }

    /// Whether this run takes the new branch of change `change_id`:
    /// `true` for code running live (a version marker is recorded, so every
    /// replay answers the same) and for a run whose history recorded the
    /// marker; `false` while the run is rebuilt from history recorded by
    /// code from before the change. Once true, true for the rest of the run.
    ///
    /// ```ignore
    /// if ctx.patched("send-receipt") {
    ///     ctx.activity::<SendReceipt>(order.clone()).await?;
    /// }
    /// ```
    ///
    /// Keep the calls of one run in the order the code first made them.
    /// When no open run took the old branch any more (`keel replay --all`
    /// passes with the old branch removed), replace the call with
    /// [`deprecate_patch`](Self::deprecate_patch), and later remove it.
    pub fn patched(&self, change_id: &str) -> bool {
        self.core.borrow_mut().version(change_id, 0, 1) >= 1
    }

    /// The version of change `change_id` this run follows, between `min`
    /// and `max`: the recorded version when history holds its marker, 0
    /// when the run is rebuilt from history recorded before the change
    /// existed, and `max` (recorded as a marker) for code running live.
    /// A run whose version is outside `min..=max` (code that dropped a
    /// branch some open run still needs) is parked as non-deterministic,
    /// never failed or rewritten.
    ///
    /// # Panics
    /// If `min > max` (a programming error).
    pub fn version(&self, change_id: &str, min: u32, max: u32) -> u32 {
        self.core.borrow_mut().version(change_id, min, max)
    }

    /// The clean-up step of a change whose old branch is gone: accepts the
    /// marker `patched(change_id)` recorded in older histories and records
    /// nothing new. Markers of a change the code no longer names are passed
    /// over on replay as well, so the call can go too once the runs that
    /// recorded it closed.
    pub fn deprecate_patch(&self, change_id: &str) {
        self.core.borrow_mut().deprecate_patch(change_id)
    }

    /// The number of events in this run's history so far (including the
    /// ones the current input is adding).
    pub fn history_len(&self) -> u64 {
        self.core.borrow().next_seq.0 - 1
    }

    /// True once the history reached
    /// [`CONTINUE_AS_NEW_SUGGESTED_EVENTS`](crate::CONTINUE_AS_NEW_SUGGESTED_EVENTS):
    /// a long-lived workflow should then finish its current unit of work
    /// and continue as new, so activation stays cheap and the run never
    /// meets the history limit.
    pub fn continue_as_new_suggested(&self) -> bool {
        self.history_len() >= crate::CONTINUE_AS_NEW_SUGGESTED_EVENTS
    }

    /// True once cancellation of this run has been requested.
    pub fn is_cancel_requested(&self) -> bool {
        self.core.borrow().cancel_requested.is_some()
    }

    /// Resolves with the reason once cancellation is requested.
    pub fn cancelled(&self) -> CancelRequested {
        CancelRequested {
            core: self.core.clone(),
        }
    }

    /// Starts a coroutine of this run (used by scopes). It is polled in FIFO
    /// order with the others.
    pub fn spawn_local(&self, fut: impl Future<Output = ()> + 'static) {
        self.spawns.borrow_mut().push(Box::pin(fut));
    }
}

/// Retry policy of one activity call: attempts, backoff, jitter. The
/// delays come from the resilience crate's backoff (one implementation for
/// in-process pipelines and durable retries); every retry is a new attempt
/// after a durable backoff, so retries survive restarts.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Total attempts, including the first.
    pub attempts_max: u32,
    /// Delay before the first retry.
    pub initial_delay: Duration,
    /// How the delay grows.
    pub backoff: Backoff,
    /// Cap on the delay.
    pub delay_max: Duration,
    /// How randomness spreads the delay (drawn per attempt, deterministic).
    pub jitter: Jitter,
}

impl RetryPolicy {
    /// Exponential backoff (doubling) without jitter.
    pub fn exponential(attempts_max: u32, initial_delay: Duration, delay_max: Duration) -> Self {
        RetryPolicy {
            attempts_max,
            initial_delay,
            backoff: Backoff::Exponential,
            delay_max,
            jitter: Jitter::None,
        }
    }

    /// Constant delay between attempts.
    pub fn constant(attempts_max: u32, delay: Duration) -> Self {
        RetryPolicy {
            attempts_max,
            initial_delay: delay,
            backoff: Backoff::Constant,
            delay_max: delay,
            jitter: Jitter::None,
        }
    }

    /// Linearly growing delay (`initial * n`), capped at `delay_max`.
    pub fn linear(attempts_max: u32, initial_delay: Duration, delay_max: Duration) -> Self {
        RetryPolicy {
            attempts_max,
            initial_delay,
            backoff: Backoff::Linear,
            delay_max,
            jitter: Jitter::None,
        }
    }

    /// With a jitter mode.
    pub fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// Checks the numbers the way the resilience crate does (attempts in
    /// `1..=100`, a positive initial delay, a cap at least the initial
    /// delay and at most a day, decorrelated jitter only with exponential
    /// backoff) and returns what history records.
    pub fn settings(&self) -> Result<RetrySettings, String> {
        let settings = RetrySettings {
            attempts_max: self.attempts_max,
            initial_delay_ms: u64::try_from(self.initial_delay.as_millis()).unwrap_or(u64::MAX),
            backoff_factor: match self.backoff {
                Backoff::Exponential => 2.0,
                Backoff::Constant | Backoff::Linear => 1.0,
            },
            delay_max_ms: u64::try_from(self.delay_max.as_millis()).unwrap_or(u64::MAX),
            jitter: self.jitter,
            backoff_mode: Some(self.backoff),
        };
        crate::retry::policy_of(&settings).map_err(|e| e.to_string())?;
        Ok(settings)
    }
}

/// A call to activity `A`, issued on first poll.
pub struct ActivityCall<A: Activity> {
    core: Rc<RefCell<Core>>,
    input: Option<Result<Payload, String>>,
    options: ActivityOptions,
    cancellation: crate::core::CancellationType,
    step: Option<Step>,
    _activity: PhantomData<fn() -> A>,
}

impl<A: Activity> std::fmt::Debug for ActivityCall<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActivityCall({}, step {:?})", A::NAME, self.step)
    }
}

impl<A: Activity> ActivityCall<A> {
    /// The durable step, once the call has been issued.
    pub fn step(&self) -> Option<Step> {
        self.step
    }

    /// Limit on one attempt, from dispatch to result.
    pub fn start_to_close(mut self, d: Duration) -> Self {
        self.options.start_to_close_ms = Some(d.as_millis() as u64);
        self
    }

    /// Limit on the whole execution across attempts.
    pub fn schedule_to_close(mut self, d: Duration) -> Self {
        self.options.schedule_to_close_ms = Some(d.as_millis() as u64);
        self
    }

    /// The activity must heartbeat within this interval.
    pub fn heartbeat_timeout(mut self, d: Duration) -> Self {
        self.options.heartbeat_ms = Some(d.as_millis() as u64);
        self
    }

    /// Retries per `policy`, each a new attempt after a durable backoff. A
    /// policy with invalid numbers fails the call when it is awaited, with
    /// a failure naming the problem, and issues nothing.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        match policy.settings() {
            Ok(s) => self.options.retry = Some(s),
            Err(e) => self.input = Some(Err(format!("invalid retry policy: {e}"))),
        }
        self
    }

    /// Fails a dispatched attempt that has not started within `d` of its
    /// due time (waiting behind the worker limit or a resilience profile).
    pub fn schedule_to_start(mut self, d: Duration) -> Self {
        self.options.schedule_to_start_ms = Some(d.as_millis() as u64);
        self
    }

    /// What cancelling this call does (its scope cancelled, or a lost
    /// `select`): ask the activity to stop and go on (the default), ask
    /// and wait until it has stopped, or leave it running.
    pub fn cancellation(mut self, cancellation: crate::core::CancellationType) -> Self {
        self.cancellation = cancellation;
        self
    }

    /// Admits attempts through the engine's resilience profile `name`
    /// (rate limit, circuit breaker, bulkhead per engine process).
    pub fn profile(mut self, name: &str) -> Self {
        self.options.profile = Some(name.into());
        self
    }
}

fn take_resolution(core: &mut Core, step: Step, cx: &Context<'_>) -> Option<Resolution> {
    match core.resolved.remove(&step) {
        Some(r) => Some(r),
        None => {
            core.wait_on(step, cx.waker());
            None
        }
    }
}

impl<A: Activity> Future for ActivityCall<A> {
    type Output = Result<A::Output, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut core = this.core.borrow_mut();
        let step = match this.step {
            Some(s) => s,
            None => {
                let input = match this.input.take() {
                    Some(Ok(p)) => p,
                    Some(Err(e)) => {
                        return Poll::Ready(Err(Failure::new(FailureKind::Application, e, false)))
                    }
                    None => return Poll::Pending,
                };
                let step = core.take_step();
                let group = core.group();
                let run_id = core.run_id;
                this.step = Some(step);
                // Replaying, the recorded command is compared where it
                // lies; the event (type name, options) is built only live.
                let issued = core.issue_unbuilt(
                    |recorded| {
                        matches!(recorded, EventKind::ActivityScheduled {
                            step: s, group: g, activity_type: t, ..
                        } if *s == step && *g == group && t == A::NAME)
                    },
                    || EventKind::ActivityScheduled {
                        step,
                        group: group.clone(),
                        execution_id: ExecutionId { run_id, step },
                        activity_type: A::NAME.to_string(),
                        input,
                        options: Box::new(this.options.clone()),
                    },
                );
                let (at, name) = match issued {
                    IssuedUnbuilt::Replayed(Event {
                        at,
                        kind: EventKind::ActivityScheduled { activity_type, .. },
                        ..
                    }) => (at, activity_type),
                    IssuedUnbuilt::Replayed(e) => (e.at, A::NAME.to_string()),
                    IssuedUnbuilt::Live(at) => (at, A::NAME.to_string()),
                    IssuedUnbuilt::Diverged => return Poll::Pending,
                };
                let w = core.open_wait(step, WaitKind::Activity, name, group, at);
                w.cancellation = this.cancellation;
                step
            }
        };
        match take_resolution(&mut core, step, cx) {
            Some(Resolution::Value(p)) => {
                Poll::Ready(p.decode().map_err(|e| decode_failure("activity result", e)))
            }
            Some(Resolution::Failed(f)) => Poll::Ready(Err(f)),
            None => Poll::Pending,
        }
    }
}

/// A durable timer, started on first poll.
#[derive(Debug)]
pub struct Timer {
    core: Rc<RefCell<Core>>,
    duration: Duration,
    step: Option<Step>,
}

impl Timer {
    pub(crate) fn new(core: Rc<RefCell<Core>>, duration: Duration) -> Self {
        Timer {
            core,
            duration,
            step: None,
        }
    }

    /// The durable step, once the timer has been started.
    pub fn step(&self) -> Option<Step> {
        self.step
    }
}

impl Future for Timer {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut core = this.core.borrow_mut();
        let step = match this.step {
            Some(s) => s,
            None => {
                let step = core.take_step();
                let group = core.group();
                let fire_at = core.now.plus_ms(this.duration.as_millis() as u64);
                this.step = Some(step);
                match core.issue(EventKind::TimerStarted {
                    step,
                    group: group.clone(),
                    fire_at,
                }) {
                    Issued::Live(e) | Issued::Replayed(e) => {
                        let fire_at = match e.kind {
                            EventKind::TimerStarted { fire_at, .. } => fire_at,
                            _ => fire_at,
                        };
                        core.open_wait(step, WaitKind::Timer, String::new(), group, e.at)
                            .fire_at = Some(fire_at);
                    }
                    Issued::Diverged => return Poll::Pending,
                }
                step
            }
        };
        match take_resolution(&mut core, step, cx) {
            Some(_) => Poll::Ready(()),
            None => Poll::Pending,
        }
    }
}

/// A wait for the next signal of a name.
#[derive(Debug)]
pub struct SignalWait<T> {
    core: Rc<RefCell<Core>>,
    name: String,
    counted: bool,
    _t: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> Future for SignalWait<T> {
    type Output = Result<T, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut core = this.core.borrow_mut();
        if let Some(p) = core.signals.get_mut(&this.name).and_then(|q| q.pop_front()) {
            if this.counted {
                if let Some(n) = core.signal_waits.get_mut(&this.name) {
                    *n -= 1;
                    if *n == 0 {
                        core.signal_waits.remove(&this.name);
                    }
                }
            }
            return Poll::Ready(p.decode().map_err(|e| decode_failure("signal payload", e)));
        }
        if !this.counted {
            this.counted = true;
            *core.signal_waits.entry(this.name.clone()).or_default() += 1;
        }
        core.wait_any(cx.waker());
        Poll::Pending
    }
}

/// A wait until a predicate over workflow state holds.
pub struct Condition<F> {
    core: Rc<RefCell<Core>>,
    predicate: F,
}

impl<F> std::fmt::Debug for Condition<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Condition")
    }
}

impl<F: FnMut() -> bool + Unpin> Future for Condition<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if (this.predicate)() {
            return Poll::Ready(());
        }
        this.core.borrow_mut().wait_any(cx.waker());
        Poll::Pending
    }
}

/// Resolves with the reason once the run's cancellation is requested.
#[derive(Debug)]
pub struct CancelRequested {
    core: Rc<RefCell<Core>>,
}

impl Future for CancelRequested {
    type Output = String;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<String> {
        let mut core = self.core.borrow_mut();
        if let Some(r) = &core.cancel_requested {
            return Poll::Ready(r.clone());
        }
        core.wait_any(cx.waker());
        Poll::Pending
    }
}
