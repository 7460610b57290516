//! The activity authoring API: the [`Activity`] trait, the
//! [`ActivityContext`] an attempt runs with, and the registry.
//!
//! Activities are the side effects: they run at least once, so their bodies
//! must be safe to repeat. [`ActivityContext::execution_id`] is the default
//! idempotency key for external systems; [`ActivityContext::attempt_id`]
//! distinguishes attempts where the receiver needs that.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use keel_storage::{AttemptId, AttemptNo, ExecutionId, Failure, FailureKind, Payload};
use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};

/// A side-effecting unit of work, run at least once under a lease.
pub trait Activity: Send + Sync + 'static {
    /// The stable type name recorded in history.
    const NAME: &'static str;
    /// The input.
    type Input: Serialize + DeserializeOwned + Send + 'static;
    /// The result.
    type Output: Serialize + DeserializeOwned + Send + 'static;
    /// Declares that the body never blocks its thread and does little
    /// work before its first `.await` that waits: a no-op, an in-memory
    /// update, a computation of microseconds, a call that starts IO at once.
    /// The engine then polls an attempt's body first on the shard thread
    /// that dispatched it, inside the activity pool's runtime context, and
    /// moves the attempt to the pool only when it does not finish there:
    /// an activity that finishes at once costs no thread hand-off either
    /// way. `false` (the default) for anything that may block or compute
    /// for long, since while that first poll runs, the shard's other runs
    /// wait. During that poll the body is on the shard's thread, not a pool
    /// worker: `tokio::task::block_in_place` panics there (a retryable
    /// failure, every attempt alike), and `spawn_local` would put a task on
    /// the shard's thread; use neither in such an activity. The engine
    /// warns, once per activity type, when such a first poll holds the
    /// shard's thread for 20 ms or more.
    const NON_BLOCKING: bool = false;

    /// The body. Must be safe to repeat: use `ctx.execution_id()` as the
    /// idempotency key of external calls.
    fn run(
        &self,
        ctx: ActivityContext,
        input: Self::Input,
    ) -> impl Future<Output = Result<Self::Output, ActivityError>> + Send;

    /// The value that replaces this activity's final failure, when the
    /// call's resilience profile enables a fallback and its classifier marks
    /// the failure as fallback-eligible. The engine calls it once the
    /// execution has no attempt left; its value is committed as the
    /// execution's result. `None` (the default): no fallback, the failure
    /// stands.
    fn fallback(
        &self,
        _input: Self::Input,
        _failure: &Failure,
    ) -> Option<Result<Self::Output, ActivityError>> {
        None
    }
}

/// How an activity attempt fails.
#[derive(Debug, Clone, PartialEq)]
pub struct ActivityError {
    /// Message for history and `describe`.
    pub message: String,
    /// Whether a retry may help (the retry policy decides whether one runs).
    pub retryable: bool,
}

impl ActivityError {
    /// A retryable failure.
    pub fn retryable(message: impl fmt::Display) -> Self {
        ActivityError {
            message: message.to_string(),
            retryable: true,
        }
    }

    /// A failure no retry can fix.
    pub fn fatal(message: impl fmt::Display) -> Self {
        ActivityError {
            message: message.to_string(),
            retryable: false,
        }
    }
}

impl fmt::Display for ActivityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ActivityError {}

impl From<ActivityError> for Failure {
    fn from(e: ActivityError) -> Self {
        Failure::new(FailureKind::Application, e.message, e.retryable)
    }
}

/// A request to stop, shared between the engine and one running copy of an
/// attempt: the engine raises it, the activity observes it. Needs no
/// runtime.
#[derive(Clone, Default)]
pub struct CancelSignal(Arc<CancelInner>);

#[derive(Default)]
struct CancelInner {
    raised: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
}

impl fmt::Debug for CancelSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CancelSignal({})", self.is_raised())
    }
}

impl CancelSignal {
    /// A signal not raised yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the copy to stop; wakes whoever waits.
    pub fn raise(&self) {
        self.0.raised.store(true, Ordering::Release);
        let wakers = std::mem::take(&mut *self.0.wakers.lock());
        for w in wakers {
            w.wake();
        }
    }

    /// True once raised.
    pub fn is_raised(&self) -> bool {
        self.0.raised.load(Ordering::Acquire)
    }

    /// Resolves once raised.
    pub fn raised(&self) -> Raised {
        Raised(self.clone())
    }
}

/// The future of [`CancelSignal::raised`].
#[derive(Debug)]
pub struct Raised(CancelSignal);

impl Future for Raised {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0.is_raised() {
            return Poll::Ready(());
        }
        {
            let mut wakers = self.0 .0.wakers.lock();
            if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
                wakers.push(cx.waker().clone());
            }
        }
        // Raised between the check and the registration: do not sleep.
        if self.0.is_raised() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// The callback an attempt reports heartbeats through (with optional
/// details, handed to the next delivery or attempt).
pub type HeartbeatFn = Arc<dyn Fn(Option<Payload>) + Send + Sync>;

/// What an attempt knows about itself, and its link back to the engine.
#[derive(Clone)]
pub struct ActivityContext {
    attempt_id: AttemptId,
    heartbeat: HeartbeatFn,
    cancel: CancelSignal,
    details: Option<Payload>,
}

impl fmt::Debug for ActivityContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActivityContext")
            .field("attempt_id", &self.attempt_id)
            .finish()
    }
}

impl ActivityContext {
    /// Builds a context; the engine, the simulator and tests call this.
    /// `details` are the last heartbeat details of an earlier delivery or
    /// attempt of the same execution.
    pub fn new(
        attempt_id: AttemptId,
        heartbeat: HeartbeatFn,
        cancel: CancelSignal,
        details: Option<Payload>,
    ) -> Self {
        ActivityContext {
            attempt_id,
            heartbeat,
            cancel,
            details,
        }
    }

    /// A context with no engine behind it (for unit-testing activity bodies).
    pub fn detached(attempt_id: AttemptId) -> Self {
        ActivityContext::new(attempt_id, Arc::new(|_| {}), CancelSignal::new(), None)
    }

    /// The logical execution, stable across retries: the idempotency key.
    pub fn execution_id(&self) -> ExecutionId {
        self.attempt_id.execution
    }

    /// This attempt.
    pub fn attempt_id(&self) -> AttemptId {
        self.attempt_id
    }

    /// The attempt number, from 1.
    pub fn attempt(&self) -> AttemptNo {
        self.attempt_id.attempt
    }

    /// Reports progress and extends the lease.
    pub fn heartbeat(&self) {
        (self.heartbeat)(None)
    }

    /// Reports progress with details (how far the attempt got) and extends
    /// the lease. The last details reach the next delivery of this attempt
    /// and the next attempt of the execution, even after a restart, through
    /// [`ActivityContext::heartbeat_details`]. Details that do not encode are
    /// sent as a plain heartbeat.
    pub fn heartbeat_with<T: Serialize>(&self, details: &T) {
        (self.heartbeat)(Payload::encode(details).ok())
    }

    /// The last heartbeat details an earlier delivery or attempt of this
    /// execution reported, if any (and if they decode as `T`).
    pub fn heartbeat_details<T: DeserializeOwned>(&self) -> Option<T> {
        self.details.as_ref().and_then(|p| p.decode().ok())
    }

    /// True once cancellation has been requested (the execution was
    /// cancelled, its deadline passed, or this copy lost its lease).
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_raised()
    }

    /// Resolves when cancellation is requested (never, if it is not).
    pub async fn cancelled(&self) {
        self.cancel.raised().await
    }
}

/// A boxed attempt producing its serialized result.
pub type ActivityFuture = Pin<Box<dyn Future<Output = Result<Payload, Failure>> + Send>>;

/// An activity with its types erased.
pub trait ErasedActivity: Send + Sync {
    /// The activity's name.
    fn name(&self) -> &'static str;
    /// Runs one attempt.
    fn start(&self, ctx: ActivityContext, input: Payload) -> ActivityFuture;
    /// Whether the activity declares [`Activity::NON_BLOCKING`].
    fn non_blocking(&self) -> bool {
        false
    }
    /// The fallback value for a final failure, if the activity has one.
    fn fallback(&self, _input: Payload, _failure: &Failure) -> Option<Result<Payload, Failure>> {
        None
    }
}

struct Typed<A>(Arc<A>);

impl<A: Activity> ErasedActivity for Typed<A> {
    fn name(&self) -> &'static str {
        A::NAME
    }

    fn non_blocking(&self) -> bool {
        A::NON_BLOCKING
    }

    fn start(&self, ctx: ActivityContext, input: Payload) -> ActivityFuture {
        let a = self.0.clone();
        Box::pin(async move {
            let input: A::Input = input.decode().map_err(|e| {
                Failure::new(
                    FailureKind::Application,
                    format!("activity input does not decode: {e}"),
                    false,
                )
            })?;
            let out = a.run(ctx, input).await.map_err(Failure::from)?;
            encode_output(&out)
        })
    }

    fn fallback(&self, input: Payload, failure: &Failure) -> Option<Result<Payload, Failure>> {
        let input: A::Input = input.decode().ok()?;
        let out = self.0.fallback(input, failure)?;
        Some(out.map_err(Failure::from).and_then(|v| encode_output(&v)))
    }
}

fn encode_output<T: Serialize>(out: &T) -> Result<Payload, Failure> {
    Payload::encode(out).map_err(|e| {
        Failure::new(
            FailureKind::Application,
            format!("activity result does not encode: {e}"),
            false,
        )
    })
}

/// A closure activity, for mocks in simulations and tests.
struct FnActivity<F> {
    name: &'static str,
    f: F,
}

impl<F> ErasedActivity for FnActivity<F>
where
    F: Fn(ActivityContext, Payload) -> ActivityFuture + Send + Sync,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn start(&self, ctx: ActivityContext, input: Payload) -> ActivityFuture {
        (self.f)(ctx, input)
    }
}

/// Activities known to an engine or a simulation, by name.
#[derive(Clone, Default)]
pub struct ActivityRegistry {
    map: BTreeMap<&'static str, Arc<dyn ErasedActivity>>,
}

impl fmt::Debug for ActivityRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.map.keys()).finish()
    }
}

impl ActivityRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers an activity instance under its name.
    pub fn register<A: Activity>(&mut self, activity: A) -> &mut Self {
        self.map
            .insert(A::NAME, Arc::new(Typed(Arc::new(activity))));
        self
    }

    /// Registers a closure under `name` (mocks).
    pub fn register_fn<F>(&mut self, name: &'static str, f: F) -> &mut Self
    where
        F: Fn(ActivityContext, Payload) -> ActivityFuture + Send + Sync + 'static,
    {
        self.map.insert(name, Arc::new(FnActivity { name, f }));
        self
    }

    /// The activity registered under `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn ErasedActivity>> {
        self.map.get(name)
    }

    /// Registered names.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.map.keys().copied()
    }
}
