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
use std::sync::Arc;

use keel_storage::{AttemptId, AttemptNo, ExecutionId, Failure, FailureKind, Payload};
use serde::{de::DeserializeOwned, Serialize};
use tokio::sync::watch;

/// A side-effecting unit of work, run at least once under a lease.
pub trait Activity: Send + Sync + 'static {
    /// The stable type name recorded in history.
    const NAME: &'static str;
    /// The input.
    type Input: Serialize + DeserializeOwned + Send + 'static;
    /// The result.
    type Output: Serialize + DeserializeOwned + Send + 'static;

    /// The body. Must be safe to repeat: use `ctx.execution_id()` as the
    /// idempotency key of external calls.
    fn run(
        &self,
        ctx: ActivityContext,
        input: Self::Input,
    ) -> impl Future<Output = Result<Self::Output, ActivityError>> + Send;
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

/// What an attempt knows about itself, and its link back to the engine.
#[derive(Clone)]
pub struct ActivityContext {
    attempt_id: AttemptId,
    heartbeat: Arc<dyn Fn(Option<Payload>) + Send + Sync>,
    cancel: watch::Receiver<bool>,
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
    pub fn new(
        attempt_id: AttemptId,
        heartbeat: Arc<dyn Fn(Option<Payload>) + Send + Sync>,
        cancel: watch::Receiver<bool>,
    ) -> Self {
        ActivityContext {
            attempt_id,
            heartbeat,
            cancel,
        }
    }

    /// A context with no engine behind it (for unit-testing activity bodies).
    pub fn detached(attempt_id: AttemptId) -> Self {
        let (_tx, rx) = watch::channel(false);
        ActivityContext::new(attempt_id, Arc::new(|_| {}), rx)
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

    /// True once cancellation has been requested.
    pub fn is_cancelled(&self) -> bool {
        *self.cancel.borrow()
    }

    /// Resolves when cancellation is requested (never, if it is not).
    pub async fn cancelled(&self) {
        let mut rx = self.cancel.clone();
        loop {
            if *rx.borrow_and_update() {
                return;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
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
}

struct Typed<A>(Arc<A>);

impl<A: Activity> ErasedActivity for Typed<A> {
    fn name(&self) -> &'static str {
        A::NAME
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
            Payload::encode(&out).map_err(|e| {
                Failure::new(
                    FailureKind::Application,
                    format!("activity result does not encode: {e}"),
                    false,
                )
            })
        })
    }
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
