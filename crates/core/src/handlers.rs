//! Query and update handlers: what workflow code registers so that clients
//! can read its state (`ctx.on_query`) and change it with a validated
//! request (`ctx.on_update`).
//!
//! A query runs against the machine's state between inputs and writes
//! nothing; a handler that tries to (issues a command, draws a random
//! number) is refused and its change undone. An update is validated the
//! same way (read-only) before anything is written; once accepted
//! (`UpdateAccepted`, an input) its handler runs as a coroutine of the run
//! and its value or failure is committed as `UpdateCompleted`, a command,
//! matched by update id on replay.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;

use keel_storage::{Failure, FailureKind, Payload};
use serde::{de::DeserializeOwned, Serialize};

use crate::context::WorkflowContext;
use crate::workflow::WorkflowError;

/// Most query and update handlers one run may register.
pub const HANDLERS_PER_RUN_MAX: usize = 256;

type QueryFn = Rc<dyn Fn(&Payload) -> Result<Payload, String>>;
type ValidateFn = Rc<dyn Fn(&Payload) -> Result<(), String>>;
type UpdateFuture = Pin<Box<dyn Future<Output = Result<Payload, Failure>>>>;
type UpdateFn = Rc<dyn Fn(Payload) -> UpdateFuture>;

/// The handlers a run's code registered so far.
#[derive(Default)]
pub(crate) struct Handlers {
    queries: BTreeMap<String, QueryFn>,
    updates: BTreeMap<String, (ValidateFn, UpdateFn)>,
}

/// Shared between a run's contexts and its machine.
pub(crate) type SharedHandlers = Rc<RefCell<Handlers>>;

/// Why a query or an update was not answered by the run's code. Nothing was
/// written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum HandlerError {
    /// The run's code registered no handler by that name (yet).
    #[error("no {kind} handler named {name:?} (registered: {known})")]
    Unknown {
        /// `query` or `update`.
        #[serde(deserialize_with = "crate::driver::wire::handler_kind")]
        kind: crate::driver::wire::Word,
        /// The name asked for.
        name: String,
        /// The names registered, comma-separated.
        known: String,
    },
    /// The arguments do not decode into the handler's argument type.
    #[error("arguments of {name:?} do not decode: {detail}")]
    BadArguments {
        /// The handler.
        name: String,
        /// The decoder's message.
        detail: String,
    },
    /// The update's validator refused it.
    #[error("update {name:?} rejected: {reason}")]
    Rejected {
        /// The update.
        name: String,
        /// The validator's reason.
        reason: String,
    },
    /// The handler panicked, or tried to change workflow state.
    #[error("{kind} handler {name:?} failed: {detail}")]
    Failed {
        /// `query` or `update`.
        #[serde(deserialize_with = "crate::driver::wire::handler_kind")]
        kind: crate::driver::wire::Word,
        /// The handler.
        name: String,
        /// What happened.
        detail: String,
    },
}

const BAD_ARGS: &str = "\u{0}bad-arguments\u{0}";

fn bad_args(e: impl std::fmt::Display) -> String {
    format!("{BAD_ARGS}{e}")
}

impl Handlers {
    fn count(&self) -> usize {
        self.queries.len() + self.updates.len()
    }

    /// The handler `name` of `map`, or the error listing what there is.
    fn lookup<V: Clone>(
        map: &BTreeMap<String, V>,
        kind: &'static str,
        name: &str,
    ) -> Result<V, HandlerError> {
        map.get(name).cloned().ok_or_else(|| HandlerError::Unknown {
            kind,
            name: name.into(),
            known: match map.is_empty() {
                true => "none".into(),
                false => map.keys().cloned().collect::<Vec<_>>().join(", "),
            },
        })
    }

    pub(crate) fn query(&self, name: &str) -> Result<QueryFn, HandlerError> {
        Self::lookup(&self.queries, "query", name)
    }

    pub(crate) fn update(&self, name: &str) -> Result<(ValidateFn, UpdateFn), HandlerError> {
        Self::lookup(&self.updates, "update", name)
    }
}

/// Calls a read-only handler; the outer error is a panic's message.
pub(crate) fn call_read_only<T>(
    kind: &'static str,
    name: &str,
    f: impl FnOnce() -> Result<T, String>,
) -> Result<Result<T, String>, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let message = crate::panic_message(payload.as_ref());
        format!("{kind} handler {name:?} panicked: {message}")
    })
}

/// True when a handler's error says its arguments did not decode.
pub(crate) fn is_bad_arguments(detail: &str) -> bool {
    detail.starts_with(BAD_ARGS)
}

/// Sorts a handler's error string into the typed error.
pub(crate) fn classify(kind: &'static str, name: &str, detail: String) -> HandlerError {
    match detail.strip_prefix(BAD_ARGS) {
        Some(d) => HandlerError::BadArguments {
            name: name.into(),
            detail: d.into(),
        },
        None => HandlerError::Failed {
            kind,
            name: name.into(),
            detail,
        },
    }
}

impl WorkflowContext {
    fn register_handler(&self, what: &str, name: &str, f: impl FnOnce(&mut Handlers)) {
        let mut h = self.handlers.borrow_mut();
        let replacing = h.queries.contains_key(name) || h.updates.contains_key(name);
        assert!(
            replacing || h.count() < HANDLERS_PER_RUN_MAX,
            "{what} handler {name:?}: a run registers at most {HANDLERS_PER_RUN_MAX} handlers"
        );
        f(&mut h);
    }

    /// Registers (or replaces) the query `name`: `client.query` calls it
    /// with the decoded arguments and gets its value, read from the run's
    /// committed state. A query writes nothing to history; one that tries
    /// to (issues a command, draws a random number) fails and its change is
    /// undone. For a run that is not in memory, or closed, the engine
    /// replays the history first, so register handlers early in the code.
    ///
    /// ```ignore
    /// let items = Rc::new(RefCell::new(Vec::<String>::new()));
    /// let view = items.clone();
    /// ctx.on_query("items", move |_: ()| view.borrow().clone());
    /// ```
    ///
    /// # Panics
    /// Past [`HANDLERS_PER_RUN_MAX`] handlers (a programming error).
    pub fn on_query<A, R, F>(&self, name: &str, handler: F)
    where
        A: DeserializeOwned + 'static,
        R: Serialize + 'static,
        F: Fn(A) -> R + 'static,
    {
        let f: QueryFn = Rc::new(move |args: &Payload| {
            let a: A = args.decode().map_err(bad_args)?;
            Payload::encode(&handler(a)).map_err(|e| format!("the value does not encode: {e}"))
        });
        self.register_handler("query", name, |h| {
            h.queries.insert(name.to_string(), f);
        });
    }

    /// Registers (or replaces) the update `name`. `validate` sees the
    /// arguments before anything is written and may refuse them
    /// (`Err(reason)`: the client hears the reason, history is untouched);
    /// like a query it must not change state. An accepted update is
    /// committed (`UpdateAccepted`), then `handler` runs as a coroutine of
    /// the run (it may await activities, timers, anything) and its value or
    /// failure is committed (`UpdateCompleted`) and returned to the client.
    /// Updates are deduplicated by their id: a client repeating one gets
    /// the first outcome, across restarts.
    ///
    /// # Panics
    /// Past [`HANDLERS_PER_RUN_MAX`] handlers (a programming error).
    pub fn on_update<A, R, V, F, Fut>(&self, name: &str, validate: V, handler: F)
    where
        A: DeserializeOwned + 'static,
        R: Serialize + 'static,
        V: Fn(&A) -> Result<(), String> + 'static,
        F: Fn(A) -> Fut + 'static,
        Fut: Future<Output = Result<R, WorkflowError>> + 'static,
    {
        let v: ValidateFn = Rc::new(move |args: &Payload| {
            let a: A = args.decode().map_err(bad_args)?;
            validate(&a)
        });
        let handler = Rc::new(handler);
        let u: UpdateFn = Rc::new(move |args: Payload| {
            let handler = handler.clone();
            Box::pin(async move {
                let a: A = args.decode().map_err(|e| {
                    Failure::new(
                        FailureKind::Application,
                        format!("update arguments do not decode: {e}"),
                        false,
                    )
                })?;
                match handler(a).await {
                    Ok(r) => Payload::encode(&r).map_err(|e| {
                        Failure::new(
                            FailureKind::Application,
                            format!("update value does not encode: {e}"),
                            false,
                        )
                    }),
                    Err(WorkflowError::Failed(f)) => Err(f),
                    Err(WorkflowError::Cancelled(reason)) => {
                        Err(Failure::new(FailureKind::Cancelled, reason, false))
                    }
                    Err(WorkflowError::ContinueAsNew(_)) => Err(Failure::new(
                        FailureKind::Application,
                        "an update handler cannot continue as new; return from the workflow body",
                        false,
                    )),
                }
            })
        });
        self.register_handler("update", name, |h| {
            h.updates.insert(name.to_string(), (v, u));
        });
    }
}
