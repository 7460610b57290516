//! The run actor: one per active run, owning the run's machine.
//!
//! Activation replays the run's log; a delivered input is checked against
//! durable state, handed to the machine, and its events committed through
//! group commit; effects run only after the commit returns. A failed commit
//! throws the machine away: the next input rebuilds it by replay. Commits of
//! one run may be pipelined: the writer's per-run seq check refuses a commit
//! whose predecessor failed, so nothing uncommitted ever leaks out.

use std::sync::Arc;

use actix::prelude::*;
use futures::channel::oneshot;
use futures::future::{FutureExt, Shared as SharedFuture};
use keel_storage::{CommitBatch, Error as StoreError, Event, EventKind, Outcome, ParkInfo, RunId};
use tracing::{info_span, warn};

use super::engine::{EngineError, Shared, StartOutcome};
use super::{RUN_MAILBOX_MAX, RUN_RESTARTS_MAX};
use crate::machine::{Input, MachineError, RunMachine, StartSpec, Verdict};

/// What happened to a delivered input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Its event is committed and effects ran.
    Committed,
    /// Dropped before reaching the machine.
    Dropped(Verdict),
}

#[derive(Message)]
#[rtype(result = "Result<Delivery, EngineError>")]
pub(crate) struct Deliver(pub(crate) Input);

#[derive(Message)]
#[rtype(result = "Result<StartOutcome, EngineError>")]
pub(crate) struct Create(pub(crate) StartSpec);

#[derive(Message)]
#[rtype(result = "Result<MachineView, EngineError>")]
pub(crate) struct Describe;

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Passivate;

/// What only the in-memory machine knows.
#[derive(Debug, Clone)]
pub(crate) struct MachineView {
    pub(crate) signal_waits: Vec<(String, usize)>,
    pub(crate) coroutines: usize,
    pub(crate) scopes: Vec<crate::scope::ScopeView>,
}

pub(crate) struct RunActor {
    run_id: RunId,
    shared: Arc<Shared>,
    machine: Option<RunMachine>,
    parked: Option<String>,
    restarts: u32,
    commits_in_flight: u32,
    passivate_requested: bool,
    /// Resolves when the newest commit in flight is answered (true if it
    /// succeeded): a duplicate is only confirmed once what it duplicates is
    /// durable.
    last_commit: Option<SharedFuture<oneshot::Receiver<bool>>>,
}

impl RunActor {
    pub(crate) fn new(run_id: RunId, shared: Arc<Shared>) -> Self {
        RunActor {
            run_id,
            shared,
            machine: None,
            parked: None,
            restarts: 0,
            commits_in_flight: 0,
            passivate_requested: false,
            last_commit: None,
        }
    }

    fn park(&mut self, err: &MachineError) -> EngineError {
        let reason = err.to_string();
        warn!(run_id = %self.run_id, kind = err.kind(), %reason, "run parked");
        let info = ParkInfo {
            at: self.shared.now(),
            kind: err.kind().to_string(),
            reason: reason.clone(),
        };
        let batch = CommitBatch {
            appends: Vec::new(),
            parked: vec![(self.run_id, Some(info))],
        };
        if let Err(e) = self.shared.store.commit(batch).wait() {
            warn!(run_id = %self.run_id, error = %e, "park marker not written");
        }
        self.machine = None;
        self.parked = Some(reason.clone());
        EngineError::Parked {
            run: self.run_id,
            reason,
        }
    }

    /// Rebuilds the machine from the log if it is not in memory.
    fn activate(&mut self) -> Result<(), EngineError> {
        if self.machine.is_some() {
            return Ok(());
        }
        if let Some(reason) = &self.parked {
            return Err(EngineError::Parked {
                run: self.run_id,
                reason: reason.clone(),
            });
        }
        let span = info_span!("run", run_id = %self.run_id);
        let _enter = span.enter();
        let history = match self.shared.store.history(self.run_id) {
            Ok(h) => h,
            Err(e) => {
                self.restarts += 1;
                if self.restarts >= RUN_RESTARTS_MAX {
                    let reason = format!("history unreadable {} times: {e}", self.restarts);
                    return Err(self.park(&MachineError::InvalidHistory(reason)));
                }
                return Err(e.into());
            }
        };
        if history.is_empty() {
            return Err(EngineError::UnknownInstance(self.run_id.to_string()));
        }
        match RunMachine::replay(&self.shared.workflows, history) {
            Ok(m) => {
                self.restarts = 0;
                if let Ok(Some(_)) = self.shared.store.parked(self.run_id) {
                    // The code was fixed: replay passes now, clear the marker.
                    let batch = CommitBatch {
                        appends: Vec::new(),
                        parked: vec![(self.run_id, None)],
                    };
                    let _ = self.shared.store.commit(batch).wait();
                }
                self.machine = Some(m);
                Ok(())
            }
            Err(e) => Err(self.park(&e)),
        }
    }

    fn commit(
        &mut self,
        events: Vec<Event>,
        ctx: &mut Context<Self>,
    ) -> ResponseActFuture<Self, Result<(), EngineError>> {
        let _ = ctx;
        self.commits_in_flight += 1;
        let (done_tx, done_rx) = oneshot::channel();
        self.last_commit = Some(done_rx.shared());
        let handle = self
            .shared
            .store
            .commit(CommitBatch::append(self.run_id, events.clone()));
        Box::pin(handle.into_actor(self).map(move |res, act, ctx| {
            act.commits_in_flight -= 1;
            let _ = done_tx.send(res.is_ok());
            let r = match res {
                Ok(_) => {
                    act.after_commit(&events, ctx);
                    Ok(())
                }
                Err(e) => {
                    // Thrown away: the next input replays from the log.
                    act.machine = None;
                    Err(EngineError::Store(e))
                }
            };
            if act.passivate_requested && act.commits_in_flight == 0 {
                ctx.stop();
            }
            r
        }))
    }

    fn after_commit(&mut self, events: &[Event], ctx: &mut Context<Self>) {
        self.shared.effects(self.run_id, events);
        // A cancelled scope cancels the child workflows its coroutines
        // started, per each child's close policy.
        for e in events {
            if let EventKind::ScopeCancelled { step, .. } = &e.kind {
                let children = self
                    .machine
                    .as_ref()
                    .map(|m| m.children_of_scope(*step))
                    .unwrap_or_default();
                for (child, policy) in children {
                    self.shared
                        .cancel_child(self.run_id, child, policy, "its scope was cancelled");
                }
            }
        }
        let closing = events.iter().find_map(|e| match &e.kind {
            EventKind::WorkflowCompleted { result } => Some(Outcome::Completed(result.clone())),
            EventKind::WorkflowFailed { failure } => Some(Outcome::Failed(failure.clone())),
            EventKind::WorkflowCancelled { reason } => Some(Outcome::Cancelled(reason.clone())),
            EventKind::WorkflowTerminated { reason } => Some(Outcome::Terminated(reason.clone())),
            EventKind::WorkflowContinuedAsNew { new_run_id, .. } => {
                Some(Outcome::ContinuedAsNew(*new_run_id))
            }
            _ => None,
        });
        if let Some(outcome) = closing {
            let parent = self.machine.as_ref().and_then(|m| match m.started() {
                Some(EventKind::WorkflowStarted { parent, .. }) => parent.clone(),
                _ => None,
            });
            self.shared.run_closed(self.run_id, outcome, parent);
            self.shared.forget(self.run_id, &ctx.address());
            ctx.stop();
        }
    }
}

impl Actor for RunActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(RUN_MAILBOX_MAX);
    }
}

impl Handler<Create> for RunActor {
    type Result = ResponseActFuture<Self, Result<StartOutcome, EngineError>>;

    fn handle(&mut self, msg: Create, ctx: &mut Self::Context) -> Self::Result {
        let now = self.shared.now();
        let (machine, events) = match RunMachine::start(&self.shared.workflows, msg.0, now) {
            Ok(x) => x,
            Err(MachineError::UnknownWorkflowType(t)) => {
                return Box::pin(fut::ready(Err(EngineError::UnknownWorkflowType(t))))
            }
            Err(MachineError::InputDecode(detail)) => {
                return Box::pin(fut::ready(Err(EngineError::InvalidInput {
                    workflow_type: String::new(),
                    detail,
                })))
            }
            Err(e) => {
                // The first activation panicked or diverged: nothing was
                // committed, so the start is refused.
                return Box::pin(fut::ready(Err(EngineError::WorkflowFailed(
                    keel_storage::Failure::new(
                        keel_storage::FailureKind::Panic,
                        e.to_string(),
                        false,
                    ),
                ))));
            }
        };
        self.machine = Some(machine);
        let run = self.run_id;
        Box::pin(
            self.commit(events, ctx)
                .map(move |res, act, ctx| match res {
                    Ok(()) => Ok(StartOutcome::Started(run)),
                    Err(EngineError::Store(StoreError::InstanceRunning {
                        run: existing, ..
                    })) => {
                        act.shared.forget(act.run_id, &ctx.address());
                        ctx.stop();
                        Ok(StartOutcome::Existing(existing))
                    }
                    Err(e) => {
                        act.shared.forget(act.run_id, &ctx.address());
                        ctx.stop();
                        Err(e)
                    }
                }),
        )
    }
}

impl Handler<Deliver> for RunActor {
    type Result = ResponseActFuture<Self, Result<Delivery, EngineError>>;

    fn handle(&mut self, msg: Deliver, ctx: &mut Self::Context) -> Self::Result {
        if let Err(e) = self.activate() {
            return Box::pin(fut::ready(Err(e)));
        }
        let machine = self.machine.as_mut().expect("activated");
        match machine.check(&msg.0) {
            Verdict::Accept => {}
            Verdict::Duplicate if self.commits_in_flight > 0 => {
                // What this duplicates may still be in flight: answer only
                // once it is durable; if its commit failed, the caller
                // delivers again and the input is taken afresh.
                let waiter = self.last_commit.clone();
                return Box::pin(
                    async move {
                        match waiter {
                            Some(w) => w.await.unwrap_or(false),
                            None => true,
                        }
                    }
                    .into_actor(self)
                    .map(|durable, _, _| {
                        if durable {
                            Ok(Delivery::Dropped(Verdict::Duplicate))
                        } else {
                            Err(EngineError::Store(StoreError::CommitFailed(
                                "the input this duplicates was not committed".into(),
                            )))
                        }
                    }),
                );
            }
            v => return Box::pin(fut::ready(Ok(Delivery::Dropped(v)))),
        }
        let events = match machine.handle(msg.0, self.shared.now()) {
            Ok(e) => e,
            Err(err) => {
                let e = self.park(&err);
                return Box::pin(fut::ready(Err(e)));
            }
        };
        Box::pin(
            self.commit(events, ctx)
                .map(|res, _, _| res.map(|()| Delivery::Committed)),
        )
    }
}

impl Handler<Describe> for RunActor {
    type Result = Result<MachineView, EngineError>;

    fn handle(&mut self, _: Describe, _: &mut Self::Context) -> Self::Result {
        self.activate()?;
        let m = self.machine.as_ref().expect("activated");
        Ok(MachineView {
            signal_waits: m.signal_waits(),
            coroutines: m.coroutines(),
            scopes: m.scopes(),
        })
    }
}

impl Handler<Passivate> for RunActor {
    type Result = ();

    fn handle(&mut self, _: Passivate, ctx: &mut Self::Context) {
        // Queued inputs were handled before this message (FIFO mailbox);
        // the log holds everything, so stopping loses nothing. A commit
        // still in flight must run its effects first.
        if self.commits_in_flight == 0 {
            ctx.stop();
        } else {
            self.passivate_requested = true;
        }
    }
}
