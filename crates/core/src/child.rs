//! Child workflows: `ctx.child::<W>(input)` awaited for the child's result,
//! or `.start()` awaited until the child's run has started, which yields a
//! [`ChildHandle`] to await, cancel or terminate it later.
//!
//! A child is one command, `ChildScheduled`; its commit writes the outbox
//! row that starts the child, and the parent learns of the start
//! (`ChildStarted`) and of the close (`ChildCompleted`/`ChildFailed`) as
//! inputs. Its instance id derives from this run and step unless the code
//! names one ([`ChildCall::instance_id`]); a named instance that already
//! has a run (open or closed) is not started again: the child fails with
//! "child did not start".

use std::cell::RefCell;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use crate::concurrency::Branch;
use crate::context::WorkflowContext;
use crate::core::{Core, Issued, Resolution, WaitKind};
use crate::workflow::Workflow;
use keel_storage::search;
use keel_storage::{
    EventKind, Failure, FailureKind, InstanceId, OperationKind, ParentClosePolicy, Payload, RunId,
    SearchValue, Step,
};

/// How the failure of a child whose run never started begins (the outbox
/// writes it; [`StartChild`] tells it from a child that started and failed).
pub const CHILD_NOT_STARTED: &str = "child did not start";

fn failure(message: impl Into<String>) -> Failure {
    Failure::new(FailureKind::Application, message, false)
}

/// What a child call's result decodes to: a workflow's `Output`, or the
/// encoded payload for a child named at run time ([`AnyChild`]).
pub trait ChildOutput: 'static {
    /// The decoded result.
    type Output: 'static;
    /// Decodes a child's committed result.
    fn decode(result: Payload) -> Result<Self::Output, Failure>;
}

impl<W: Workflow> ChildOutput for W {
    type Output = W::Output;
    fn decode(result: Payload) -> Result<W::Output, Failure> {
        result
            .decode()
            .map_err(|e| failure(format!("child result does not decode: {e}")))
    }
}

/// A child workflow chosen by type name at run time
/// ([`WorkflowContext::child_named`]): its result stays encoded.
#[derive(Debug)]
pub enum AnyChild {}

impl ChildOutput for AnyChild {
    type Output = Payload;
    fn decode(result: Payload) -> Result<Payload, Failure> {
        Ok(result)
    }
}

/// A call to a child workflow, scheduled on first poll. The child gets
/// its own instance (derived from this run and step unless named) and run
/// ids; its result comes back through the outbox.
pub struct ChildCall<W: ChildOutput> {
    pub(crate) core: Rc<RefCell<Core>>,
    pub(crate) input: Option<Result<Payload, String>>,
    pub(crate) workflow_type: String,
    pub(crate) close_policy: ParentClosePolicy,
    pub(crate) instance_id: Option<InstanceId>,
    pub(crate) memo: Vec<(String, Payload)>,
    pub(crate) search_attributes: Vec<(String, Payload)>,
    pub(crate) timeouts: keel_storage::StartTimeouts,
    pub(crate) cancellation: crate::core::CancellationType,
    /// A memo value that did not encode: the call fails when issued.
    pub(crate) bad_metadata: Option<String>,
    pub(crate) step: Option<Step>,
    pub(crate) _w: PhantomData<fn() -> W>,
}

impl<W: ChildOutput> std::fmt::Debug for ChildCall<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChildCall({}, step {:?})", self.workflow_type, self.step)
    }
}

impl<W: ChildOutput> ChildCall<W> {
    pub(crate) fn new(
        core: Rc<RefCell<Core>>,
        workflow_type: String,
        input: Result<Payload, String>,
    ) -> Self {
        ChildCall {
            core,
            input: Some(input),
            workflow_type,
            close_policy: ParentClosePolicy::default(),
            instance_id: None,
            memo: Vec::new(),
            search_attributes: Vec::new(),
            timeouts: Default::default(),
            cancellation: Default::default(),
            bad_metadata: None,
            step: None,
            _w: PhantomData,
        }
    }

    /// A memo field the child starts with.
    pub fn memo<T: serde::Serialize + ?Sized>(mut self, name: &str, value: &T) -> Self {
        match Payload::encode(value) {
            Ok(p) => self.memo.push((name.to_string(), p)),
            Err(e) => self.bad_metadata = Some(format!("memo {name:?} does not encode: {e}")),
        }
        self
    }

    /// A search attribute the child starts with (the index finds it from
    /// its start on).
    pub fn search_attribute(mut self, name: &str, value: impl Into<SearchValue>) -> Self {
        self.search_attributes
            .push((name.to_string(), value.into().to_payload()));
        self
    }

    /// Closes each run of the child that stays open longer than `d` (from
    /// that run's start) as timed out; this run sees a failure of kind
    /// `Timeout`. Continue-as-new keeps the timeout.
    pub fn run_timeout(mut self, d: std::time::Duration) -> Self {
        self.timeouts = self.timeouts.with_run(d);
        self
    }

    /// Like [`ChildCall::run_timeout`], for the child's whole chain of
    /// runs, from its first start.
    pub fn execution_timeout(mut self, d: std::time::Duration) -> Self {
        self.timeouts = self.timeouts.with_execution(d);
        self
    }

    /// What cancelling this call does (its scope cancelled, or a lost
    /// `select`): cancel the child per its close policy and go on (the
    /// default), do so and wait until the child has closed, or leave it
    /// running. [`ChildHandle::cancel`] and `terminate` act whatever this
    /// says.
    pub fn cancellation(mut self, cancellation: crate::core::CancellationType) -> Self {
        self.cancellation = cancellation;
        self
    }

    /// What happens to the child if this run closes first.
    pub fn close_policy(mut self, policy: ParentClosePolicy) -> Self {
        self.close_policy = policy;
        self
    }

    /// Starts the child as instance `id` instead of one derived from this
    /// run and step. The id is recorded with the command, so replay names
    /// the same one. An instance that already has a run, open or closed,
    /// is not started again: the child fails with [`CHILD_NOT_STARTED`].
    pub fn instance_id(mut self, id: InstanceId) -> Self {
        self.instance_id = Some(id);
        self
    }

    /// Waits only until the child's run has started (or failed to), and
    /// yields a handle to its result: a start as an awaitable step.
    pub fn start(self) -> StartChild<W> {
        StartChild { call: Some(self) }
    }

    /// Issues the command on first call; the step afterwards.
    fn issue(&mut self) -> Result<Option<Step>, Failure> {
        if let Some(step) = self.step {
            return Ok(Some(step));
        }
        let mut core = self.core.borrow_mut();
        let input = match self.input.take() {
            Some(Ok(p)) => p,
            Some(Err(e)) => return Err(failure(format!("child input does not encode: {e}"))),
            None => return Ok(None),
        };
        // The store's rules, before anything is issued: a child that could
        // never start is refused here, with nothing written.
        if let Some(e) = self.bad_metadata.take() {
            return Err(failure(e));
        }
        if let Err(e) = search::start_metadata(None, &self.search_attributes, &self.memo) {
            return Err(failure(format!("child metadata: {e}")));
        }
        let step = core.take_step();
        let group = core.group();
        // Drawn before issuing, live and on replay alike, so the run's
        // random sequence stays the same.
        let (a, b) = (core.next_random(), core.next_random());
        let child_instance_id = self
            .instance_id
            .clone()
            .unwrap_or_else(|| InstanceId::for_child(core.run_id, step));
        let kind = EventKind::ChildScheduled(Box::new(keel_storage::ChildSchedule {
            step,
            group: group.clone(),
            child_instance_id,
            // An async child's closure is bound only in its parent's
            // process: the child's run lands on the parent's shard (its id
            // keeps 64 random bits, since its low word follows the high).
            // Any other child's id starts with the workflow's time, as a
            // client-made id starts with the client's: children scheduled
            // together sit together in the store's key order.
            child_run_id: if self.workflow_type == crate::concurrency::ASYNC_WORKFLOW_TYPE {
                crate::driver::run_id_beside(core.run_id, a)
            } else {
                RunId::from_u64_pair(crate::driver::run_id_high(core.now.0, a), b)
            },
            workflow_type: self.workflow_type.clone(),
            input,
            close_policy: self.close_policy,
            memo: std::mem::take(&mut self.memo),
            search_attributes: std::mem::take(&mut self.search_attributes),
            timeouts: self.timeouts,
        }));
        self.step = Some(step);
        match core.issue(kind) {
            Issued::Live(e) | Issued::Replayed(e) => {
                let child_run = match &e.kind {
                    EventKind::ChildScheduled(child) => Some(child.child_run_id),
                    _ => None,
                };
                let name = self.workflow_type.clone();
                let w = core.open_wait(step, WaitKind::Child, name, group, e.at);
                w.child_run = child_run;
                w.close_policy = Some(self.close_policy);
                w.cancellation = self.cancellation;
                Ok(Some(step))
            }
            Issued::Diverged => Ok(None),
        }
    }

    pub(crate) fn poll_raw(&mut self, cx: &mut Context<'_>) -> Poll<Result<Payload, Failure>> {
        let step = match self.issue() {
            Ok(Some(step)) => step,
            Ok(None) => return Poll::Pending,
            Err(f) => return Poll::Ready(Err(f)),
        };
        let mut core = self.core.borrow_mut();
        match core.resolved.remove(&step) {
            Some(Resolution::Value(p)) => Poll::Ready(Ok(p)),
            Some(Resolution::Failed(f)) => Poll::Ready(Err(f)),
            None => {
                core.wait_on(step, cx.waker());
                Poll::Pending
            }
        }
    }
}

impl<W: ChildOutput> Branch for ChildCall<W> {
    type Output = W::Output;
    fn leaf_count(&self) -> u32 {
        1
    }
    fn poll_branch(&mut self, cx: &mut Context<'_>) -> Poll<Result<W::Output, Failure>> {
        self.poll_raw(cx).map(|r| r.and_then(W::decode))
    }
    fn leaf_step(&self) -> Option<Step> {
        self.step
    }
    fn operation(&self) -> OperationKind {
        OperationKind::Child
    }
}

impl<W: ChildOutput> Future for ChildCall<W> {
    type Output = Result<W::Output, Failure>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().poll_branch(cx)
    }
}

/// The future of [`ChildCall::start`]: ready once the child's run has
/// started (`ChildStarted` committed, or its result already in), or with
/// the failure of a child that could not start.
pub struct StartChild<W: ChildOutput> {
    call: Option<ChildCall<W>>,
}

impl<W: ChildOutput> std::fmt::Debug for StartChild<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StartChild({:?})", self.call)
    }
}

impl<W: ChildOutput> Future for StartChild<W> {
    type Output = Result<ChildHandle<W>, Failure>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(call) = this.call.as_mut() else {
            return Poll::Pending;
        };
        let step = match call.issue() {
            Ok(Some(step)) => step,
            Ok(None) => return Poll::Pending,
            Err(f) => return Poll::Ready(Err(f)),
        };
        let mut core = call.core.borrow_mut();
        let started = match (core.open.get(&step), core.resolved.get(&step)) {
            (Some(w), _) => w.child_started.then_some(w.child_run),
            (None, Some(Resolution::Failed(f))) if f.message.starts_with(CHILD_NOT_STARTED) => {
                let Some(Resolution::Failed(f)) = core.resolved.remove(&step) else {
                    unreachable!("matched above")
                };
                drop(core);
                this.call = None;
                return Poll::Ready(Err(f));
            }
            // Closed before the start's notice came: it did start.
            (None, Some(_)) => Some(None),
            (None, None) => None,
        };
        let Some(run) = started else {
            // `ChildStarted` is an input: woken after every one.
            core.wait_any(cx.waker());
            return Poll::Pending;
        };
        let instance_id = call
            .instance_id
            .clone()
            .unwrap_or_else(|| InstanceId::for_child(core.run_id, step));
        drop(core);
        let call = this.call.take().expect("checked above");
        Poll::Ready(Ok(ChildHandle {
            core: call.core,
            step,
            instance_id,
            run_id: run,
            _w: PhantomData,
        }))
    }
}

/// A started child: await its result, or cancel or terminate it. Clones
/// name the same child.
pub struct ChildHandle<W: ChildOutput> {
    core: Rc<RefCell<Core>>,
    step: Step,
    instance_id: InstanceId,
    run_id: Option<RunId>,
    _w: PhantomData<fn() -> W>,
}

impl<W: ChildOutput> Clone for ChildHandle<W> {
    fn clone(&self) -> Self {
        ChildHandle {
            core: self.core.clone(),
            step: self.step,
            instance_id: self.instance_id.clone(),
            run_id: self.run_id,
            _w: PhantomData,
        }
    }
}

impl<W: ChildOutput> std::fmt::Debug for ChildHandle<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChildHandle({}, step {})", self.instance_id, self.step)
    }
}

impl<W: ChildOutput> ChildHandle<W> {
    /// The step that scheduled the child.
    pub fn step(&self) -> Step {
        self.step
    }

    /// The child's instance.
    pub fn instance_id(&self) -> &InstanceId {
        &self.instance_id
    }

    /// The child's run, when its start was seen before its close.
    pub fn run_id(&self) -> Option<RunId> {
        self.run_id
    }

    /// Whether the child's close is committed in this run (its result is
    /// ready). Usable in a condition.
    pub fn is_closed(&self) -> bool {
        self.core.borrow().resolved.contains_key(&self.step)
    }

    /// Waits for the child's result. Take it once: a second wait never
    /// resolves.
    pub fn result(&self) -> ChildResult<W> {
        ChildResult {
            core: self.core.clone(),
            step: self.step,
            _w: PhantomData,
        }
    }

    /// Asks the child to cancel (it sees a cancellation request), whatever
    /// its close policy. Nothing is recorded once the child closed.
    pub fn cancel(&self, reason: &str) {
        self.core
            .borrow_mut()
            .cancel_child(self.step, ParentClosePolicy::RequestCancel, reason);
    }

    /// Terminates the child, whatever its close policy. Nothing is
    /// recorded once the child closed.
    pub fn terminate(&self, reason: &str) {
        self.core
            .borrow_mut()
            .cancel_child(self.step, ParentClosePolicy::Terminate, reason);
    }
}

/// The future of [`ChildHandle::result`].
pub struct ChildResult<W: ChildOutput> {
    core: Rc<RefCell<Core>>,
    step: Step,
    _w: PhantomData<fn() -> W>,
}

impl<W: ChildOutput> std::fmt::Debug for ChildResult<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChildResult(step {})", self.step)
    }
}

impl<W: ChildOutput> Future for ChildResult<W> {
    type Output = Result<W::Output, Failure>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut core = self.core.borrow_mut();
        match core.resolved.remove(&self.step) {
            Some(Resolution::Value(p)) => Poll::Ready(W::decode(p)),
            Some(Resolution::Failed(f)) => Poll::Ready(Err(f)),
            None => {
                core.wait_on(self.step, cx.waker());
                Poll::Pending
            }
        }
    }
}

impl WorkflowContext {
    /// Calls child workflow `W`.
    pub fn child<W: Workflow>(&self, input: W::Input) -> ChildCall<W> {
        let input = Payload::encode(&input).map_err(|e| e.to_string());
        ChildCall::new(self.core.clone(), W::NAME.to_string(), input)
    }

    /// Calls the child workflow registered as `workflow_type` with an
    /// encoded input; its result stays encoded. For code that picks the
    /// type at run time (a schedule's action).
    pub fn child_named(&self, workflow_type: &str, input: Payload) -> ChildCall<AnyChild> {
        ChildCall::new(self.core.clone(), workflow_type.to_string(), Ok(input))
    }
}
