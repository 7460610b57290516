//! The workflow authoring API: the [`Workflow`] trait, its error type, and
//! the type-erased registry the engine, the simulator and the replayer use.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use keel_storage::{Failure, FailureKind, Payload};
use serde::{de::DeserializeOwned, Serialize};

use crate::context::WorkflowContext;

/// Deterministic workflow code. It is replayed from its history, so it must
/// reach the outside world only through the [`WorkflowContext`]: no clocks,
/// no randomness, no IO, no thread-local state of its own.
///
/// ```ignore
/// struct Greet;
/// impl Workflow for Greet {
///     const NAME: &'static str = "greet";
///     type Input = String;
///     type Output = String;
///     async fn run(ctx: WorkflowContext, name: String) -> Result<String, WorkflowError> {
///         let text = ctx.activity::<Format>(name).await?;
///         Ok(text)
///     }
/// }
/// ```
pub trait Workflow: 'static {
    /// The stable type name recorded in history; never change it for a
    /// workflow with open runs.
    const NAME: &'static str;
    /// The input.
    type Input: Serialize + DeserializeOwned + 'static;
    /// The result.
    type Output: Serialize + DeserializeOwned + 'static;

    /// The workflow body.
    fn run(
        ctx: WorkflowContext,
        input: Self::Input,
    ) -> impl Future<Output = Result<Self::Output, WorkflowError>> + 'static;
}

/// How workflow code ends other than with a value.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkflowError {
    /// The workflow failed; the run closes as failed.
    Failed(Failure),
    /// The workflow honoured a cancellation request; the run closes as
    /// cancelled.
    Cancelled(String),
    /// Close this run and continue in a new run of the same instance with
    /// this input.
    ContinueAsNew(Payload),
}

impl WorkflowError {
    /// A failure with a message.
    pub fn msg(message: impl fmt::Display) -> Self {
        WorkflowError::Failed(Failure::new(
            FailureKind::Application,
            message.to_string(),
            false,
        ))
    }

    /// Continue as new with `input`.
    pub fn continue_as_new<T: Serialize>(input: &T) -> Self {
        match Payload::encode(input) {
            Ok(p) => WorkflowError::ContinueAsNew(p),
            Err(e) => WorkflowError::msg(format!("continue-as-new input does not encode: {e}")),
        }
    }
}

impl fmt::Display for WorkflowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkflowError::Failed(failure) => write!(f, "workflow failed: {failure}"),
            WorkflowError::Cancelled(r) => write!(f, "workflow cancelled: {r}"),
            WorkflowError::ContinueAsNew(_) => write!(f, "workflow continues as new"),
        }
    }
}

impl std::error::Error for WorkflowError {}

impl From<Failure> for WorkflowError {
    fn from(f: Failure) -> Self {
        WorkflowError::Failed(f)
    }
}

/// A boxed workflow body producing its serialized result.
pub type WorkflowFuture = Pin<Box<dyn Future<Output = Result<Payload, WorkflowError>>>>;

/// A workflow with its types erased: decodes input, runs, encodes output.
pub trait ErasedWorkflow: Send + Sync {
    /// The workflow's name.
    fn name(&self) -> &'static str;
    /// Checks that `input` decodes into the workflow's input type.
    fn check_input(&self, input: &Payload) -> Result<(), String>;
    /// Starts the body.
    fn start(&self, ctx: WorkflowContext, input: &Payload) -> Result<WorkflowFuture, String>;
}

/// Decodes a workflow's input. Its `Deserialize` is the user's code and runs
/// on the shard's thread, outside the workflow's own guard: a panic in it
/// refuses that input (`Refusal::InvalidInput`) rather than ending the
/// shard.
fn decode_input<T: DeserializeOwned>(input: &Payload) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| input.decode::<T>())) {
        Ok(decoded) => decoded.map_err(|e| e.to_string()),
        Err(payload) => Err(format!(
            "decoding the input panicked: {}",
            crate::panic_message(payload.as_ref())
        )),
    }
}

struct Typed<W>(std::marker::PhantomData<fn() -> W>);

impl<W: Workflow> ErasedWorkflow for Typed<W> {
    fn name(&self) -> &'static str {
        W::NAME
    }

    fn check_input(&self, input: &Payload) -> Result<(), String> {
        decode_input::<W::Input>(input).map(|_| ())
    }

    fn start(&self, ctx: WorkflowContext, input: &Payload) -> Result<WorkflowFuture, String> {
        let input: W::Input = decode_input(input)?;
        Ok(Box::pin(async move {
            let out = W::run(ctx, input).await?;
            Payload::encode(&out)
                .map_err(|e| WorkflowError::msg(format!("result does not encode: {e}")))
        }))
    }
}

/// Workflows known to an engine, a simulation or a replayer, by name.
///
/// Clones share the table of bound async closures (see
/// [`WorkflowContext::run_async`]); [`WorkflowRegistry::with_fresh_closures`]
/// gives a registry of the same workflows with a table of its own, as a
/// restarted process has.
#[derive(Clone)]
pub struct WorkflowRegistry {
    map: BTreeMap<&'static str, Arc<dyn ErasedWorkflow>>,
    pub(crate) closures: crate::concurrency::Closures,
}

impl Default for WorkflowRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for WorkflowRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.map.keys()).finish()
    }
}

impl WorkflowRegistry {
    /// A registry holding only the system workflows (`keel.async`, `keel.schedule`).
    pub fn new() -> Self {
        let mut r = WorkflowRegistry {
            map: BTreeMap::new(),
            closures: Default::default(),
        };
        r.register_erased(Arc::new(crate::concurrency::AsyncSystem));
        r.register::<crate::schedule::ScheduleWorkflow>();
        r
    }

    /// Registers `W` under its name. A second registration of the same name
    /// replaces the first.
    pub fn register<W: Workflow>(&mut self) -> &mut Self {
        self.register_erased(Arc::new(Typed::<W>(std::marker::PhantomData)))
    }

    /// Registers an erased workflow (for system types such as `keel.async`).
    pub fn register_erased(&mut self, w: Arc<dyn ErasedWorkflow>) -> &mut Self {
        self.map.insert(w.name(), w);
        self
    }

    /// The workflow registered under `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn ErasedWorkflow>> {
        self.map.get(name)
    }

    /// Registered names.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.map.keys().copied()
    }

    /// The same workflows with an empty table of bound async closures: what
    /// a process that just started has.
    pub fn with_fresh_closures(&self) -> Self {
        WorkflowRegistry {
            map: self.map.clone(),
            closures: Default::default(),
        }
    }

    /// True if the closure of async child `child` is bound (its parent has
    /// issued or replayed the call in this registry's process).
    pub fn async_bound(&self, child: keel_storage::RunId) -> bool {
        self.closures.is_bound(child)
    }

    /// Forgets the closure of a closed async child.
    pub fn unbind_async(&self, child: keel_storage::RunId) {
        self.closures.unbind(child);
    }

    /// Forgets the closures of every async child `which` picks (those of a
    /// shard this process stopped running).
    pub fn unbind_async_where(&self, which: impl Fn(keel_storage::RunId) -> bool) {
        self.closures.unbind_where(which);
    }

    /// The async children whose closures are bound in this registry's
    /// process, in run order (what a check of the table reads).
    pub fn async_bound_runs(&self) -> Vec<keel_storage::RunId> {
        self.closures.runs()
    }
}
