//! Structured concurrency in workflow code: scopes and deterministic
//! channels.
//!
//! A [`Scope`] groups coroutines under one owner. By default they fail
//! together: the first unhandled error cancels the others and is delivered
//! to whoever awaits completion. With [`Scope::on_error`] they are
//! independent. Cancelling a scope commits a `ScopeCancelled` event, cancels
//! the durable waits of its coroutines (timers cancelled, activities asked
//! to cancel), drops the coroutines at their current wait, and recurses into
//! nested scopes. Everything happens at deterministic points of the code,
//! so replay reproduces it.
//!
//! Channels are in-memory queues between coroutines of one run: no events,
//! deterministic because the executor is.

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::task::{Context, Poll, Waker};

use keel_storage::{EventKind, Failure, FailureKind, Step};
use serde::Serialize;

use crate::context::WorkflowContext;
use crate::core::Core;

/// The scopes of one run by step (weak: a scope lives as long as its owner).
pub(crate) type ScopeRegistry = Rc<RefCell<BTreeMap<Step, Weak<RefCell<ScopeState>>>>>;

/// A live scope, for `describe`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ScopeView {
    /// The scope's step.
    pub step: Step,
    /// The scope it is nested in.
    pub parent: Option<Step>,
    /// Coroutines still running.
    pub running: usize,
    /// Coroutines spawned in all.
    pub spawned: u32,
    /// Whether it was cancelled.
    pub cancelled: bool,
}

/// The live scopes of a registry, in step order.
pub(crate) fn views(registry: &ScopeRegistry) -> Vec<ScopeView> {
    registry
        .borrow()
        .values()
        .filter_map(Weak::upgrade)
        .map(|s| {
            let s = s.borrow();
            ScopeView {
                step: s.step,
                parent: s.parent,
                running: s.running(),
                spawned: s.next,
                cancelled: s.cancelled,
            }
        })
        .collect()
}

/// Why [`Scope::await_completion`] returned without every coroutine done.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScopeError {
    /// The cancellation given to `await_completion` fired first; the
    /// coroutines keep running until the caller cancels the scope.
    #[error("waiting for the scope was cancelled")]
    Cancelled,
    /// A coroutine failed (fail-together); the others were cancelled.
    #[error("a coroutine of the scope failed: {0}")]
    Failed(Failure),
}

impl From<ScopeError> for Failure {
    fn from(e: ScopeError) -> Failure {
        match e {
            ScopeError::Cancelled => {
                Failure::new(FailureKind::Cancelled, "scope wait cancelled", false)
            }
            ScopeError::Failed(f) => f,
        }
    }
}

impl From<ScopeError> for crate::workflow::WorkflowError {
    fn from(e: ScopeError) -> Self {
        crate::workflow::WorkflowError::Failed(e.into())
    }
}

/// Identity of a coroutine within its scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CoroutineRef {
    /// The scope's step.
    pub scope: Step,
    /// The coroutine's index in the scope, in spawn order.
    pub index: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CoState {
    Running,
    Done,
    Failed,
    Cancelled,
}

type Handler = Box<dyn FnMut(&ScopeRef, CoroutineRef, Failure)>;

pub(crate) struct ScopeState {
    step: Step,
    parent: Option<Step>,
    coroutines: BTreeMap<u32, (CoState, Option<Waker>)>,
    next: u32,
    first_error: Option<Failure>,
    handler: Option<Rc<RefCell<Handler>>>,
    cancelled: bool,
    children: Vec<Weak<RefCell<ScopeState>>>,
    waiters: Vec<Waker>,
}

impl ScopeState {
    fn running(&self) -> usize {
        self.coroutines
            .values()
            .filter(|(s, _)| *s == CoState::Running)
            .count()
    }

    fn wake_waiters(&mut self) {
        for w in self.waiters.drain(..) {
            w.wake();
        }
    }
}

/// A shared reference to a scope, for use inside its coroutines and error
/// handler (spawning replacements, cancelling). Dropping it does nothing.
#[derive(Clone)]
pub struct ScopeRef {
    ctx: WorkflowContext,
    state: Rc<RefCell<ScopeState>>,
}

impl std::fmt::Debug for ScopeRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.borrow();
        write!(f, "Scope(step {}, {} running)", s.step, s.running())
    }
}

/// A scope owned by workflow code. Dropping it cancels whatever still runs
/// in it (structured concurrency: nothing outlives its owner).
#[derive(Debug)]
pub struct Scope {
    inner: ScopeRef,
}

impl std::ops::Deref for Scope {
    type Target = ScopeRef;
    fn deref(&self) -> &ScopeRef {
        &self.inner
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let running = self.inner.state.borrow().running();
        let tearing_down = self
            .inner
            .ctx
            .core
            .try_borrow()
            .map_or(true, |c| c.tearing_down || c.closed);
        if running > 0 && !tearing_down {
            self.inner.cancel_with("scope dropped by its owner");
        }
    }
}

impl WorkflowContext {
    /// A new scope, nested in the scope of the coroutine that creates it
    /// (cancelling that scope cancels this one too). It takes one step.
    pub fn scope(&self) -> Scope {
        let (step, parent) = {
            let mut core = self.core.borrow_mut();
            let (step, parent) = (core.take_step(), core.current_owner.map(|(s, _)| s));
            core.scope_parents.insert(step, parent);
            (step, parent)
        };
        let state = Rc::new(RefCell::new(ScopeState {
            step,
            parent,
            coroutines: BTreeMap::new(),
            next: 0,
            first_error: None,
            handler: None,
            cancelled: false,
            children: Vec::new(),
            waiters: Vec::new(),
        }));
        if let Some(parent) =
            parent.and_then(|p| self.scopes().borrow().get(&p).and_then(Weak::upgrade))
        {
            parent.borrow_mut().children.push(Rc::downgrade(&state));
        }
        self.scopes()
            .borrow_mut()
            .insert(step, Rc::downgrade(&state));
        Scope {
            inner: ScopeRef {
                ctx: self.clone(),
                state,
            },
        }
    }

    fn scopes(&self) -> Rc<RefCell<BTreeMap<Step, Weak<RefCell<ScopeState>>>>> {
        self.scope_registry.clone()
    }

    /// A deterministic bounded channel between coroutines of this run.
    /// `send` waits while `capacity` values are buffered; capacity 0 is a
    /// rendezvous (`send` completes when a receiver takes the value).
    pub fn channel<T: 'static>(&self, capacity: usize) -> (Sender<T>, Receiver<T>) {
        let chan = Rc::new(RefCell::new(Chan {
            buf: VecDeque::new(),
            capacity,
            closed: false,
            sent: 0,
            taken: 0,
            recv_waiters: Vec::new(),
            send_waiters: Vec::new(),
            senders: 1,
        }));
        (Sender { chan: chan.clone() }, Receiver { chan })
    }
}

impl ScopeRef {
    /// The scope's step (its durable identity).
    pub fn step(&self) -> Step {
        self.state.borrow().step
    }

    /// Coroutines still running.
    pub fn running(&self) -> usize {
        self.state.borrow().running()
    }

    /// Makes the coroutines independent: a failed coroutine is handed to
    /// `handler` (with the scope, so it can spawn a replacement) and the
    /// others keep running.
    pub fn on_error(&self, handler: impl FnMut(&ScopeRef, CoroutineRef, Failure) + 'static) {
        self.state.borrow_mut().handler = Some(Rc::new(RefCell::new(Box::new(handler))));
    }

    /// Starts a coroutine in the scope. It may issue any durable command.
    /// An `Err` is unhandled unless an error handler is set.
    pub fn spawn<F>(&self, fut: F) -> CoroutineRef
    where
        F: Future<Output = Result<(), Failure>> + 'static,
    {
        let (index, step) = {
            let mut st = self.state.borrow_mut();
            let i = st.next;
            st.next += 1;
            st.coroutines.insert(i, (CoState::Running, None));
            (i, st.step)
        };
        let co = Coroutine {
            scope: self.clone(),
            index,
            inner: Some(Box::pin(fut)),
        };
        self.ctx.spawn_local(co);
        CoroutineRef { scope: step, index }
    }

    /// Cancels every coroutine at its current durable wait, and every
    /// nested scope. Commits `ScopeCancelled`.
    pub fn cancel(&self) {
        self.cancel_with("scope cancelled");
    }

    fn cancel_with(&self, reason: &str) {
        let (step, children) = {
            let mut st = self.state.borrow_mut();
            if st.cancelled {
                return;
            }
            st.cancelled = true;
            (st.step, st.children.clone())
        };
        {
            let mut core = self.ctx.core.borrow_mut();
            let _ = core.issue(EventKind::ScopeCancelled {
                step,
                reason: reason.to_string(),
            });
            cancel_waits_of(&mut core, step, reason);
        }
        let mut wakers = Vec::new();
        {
            let mut st = self.state.borrow_mut();
            for (state, waker) in st.coroutines.values_mut() {
                if *state == CoState::Running {
                    *state = CoState::Cancelled;
                    wakers.extend(waker.take());
                }
            }
            st.wake_waiters();
        }
        for w in wakers {
            w.wake();
        }
        for child in children.iter().filter_map(Weak::upgrade) {
            ScopeRef {
                ctx: self.ctx.clone(),
                state: child,
            }
            .cancel_with(reason);
        }
    }

    /// Waits until every coroutine has finished, or until `cancellation`
    /// (a timer, a deadline, any future) fires first: then
    /// `ScopeError::Cancelled`, and the caller decides whether to wait more
    /// or cancel the scope. In fail-together mode the first failure is
    /// returned once the others are cancelled.
    pub fn await_completion<C: Future<Output = ()> + Unpin>(
        &self,
        cancellation: C,
    ) -> AwaitCompletion<C> {
        AwaitCompletion {
            scope: self.clone(),
            cancellation,
        }
    }
}

/// Issues the cancellation commands for every open wait owned by a
/// coroutine of the scope at `step`, in step order: timers cancelled,
/// activities asked to cancel, children cancelled per their close policy.
fn cancel_waits_of(core: &mut Core, step: Step, reason: &str) {
    let mut owned: Vec<Step> = core
        .open
        .values()
        .filter(|w| w.owner.is_some_and(|(s, _)| s == step))
        .map(|w| w.step)
        .collect();
    // The open waits are hashed: the order is the steps'.
    owned.sort_unstable();
    for s in owned {
        core.cancel_wait(s, reason);
    }
}

/// A coroutine body as the scope holds it.
type Body = Pin<Box<dyn Future<Output = Result<(), Failure>>>>;

struct Coroutine {
    scope: ScopeRef,
    index: u32,
    inner: Option<Body>,
}

impl Future for Coroutine {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let index = self.index;
        let (state, step) = {
            let mut st = self.scope.state.borrow_mut();
            let step = st.step;
            let entry = st.coroutines.get_mut(&index).expect("spawned");
            entry.1 = Some(cx.waker().clone());
            (entry.0, step)
        };
        if state != CoState::Running {
            // Cancelled: drop the body at its current wait.
            self.inner = None;
            return Poll::Ready(());
        }
        let core = self.scope.ctx.core.clone();
        let previous = core.borrow_mut().current_owner.replace((step, index));
        let polled = self.inner.as_mut().expect("running").as_mut().poll(cx);
        core.borrow_mut().current_owner = previous;
        let result = match polled {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(r) => r,
        };
        self.inner = None;
        let handler = {
            let mut st = self.scope.state.borrow_mut();
            let entry = st.coroutines.get_mut(&index).expect("spawned");
            entry.0 = if result.is_ok() {
                CoState::Done
            } else {
                CoState::Failed
            };
            entry.1 = None;
            st.wake_waiters();
            st.handler.clone()
        };
        if let Err(failure) = result {
            let who = CoroutineRef { scope: step, index };
            match handler {
                Some(h) => (h.borrow_mut())(&self.scope, who, failure),
                None => {
                    let first = {
                        let mut st = self.scope.state.borrow_mut();
                        if st.first_error.is_none() {
                            st.first_error = Some(failure);
                            true
                        } else {
                            false
                        }
                    };
                    if first {
                        self.scope.cancel_with("a coroutine failed");
                    }
                }
            }
        }
        Poll::Ready(())
    }
}

/// The future of [`ScopeRef::await_completion`].
pub struct AwaitCompletion<C> {
    scope: ScopeRef,
    cancellation: C,
}

impl<C> std::fmt::Debug for AwaitCompletion<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AwaitCompletion({:?})", self.scope)
    }
}

impl<C: Future<Output = ()> + Unpin> Future for AwaitCompletion<C> {
    type Output = Result<(), ScopeError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        {
            let mut st = self.scope.state.borrow_mut();
            if st.running() == 0 {
                // Cancelled waits that asked to be waited for hold the
                // completion until they have closed.
                let mut core = self.scope.ctx.core.borrow_mut();
                if !core.draining_under(st.step) {
                    return Poll::Ready(match st.first_error.clone() {
                        Some(f) => Err(ScopeError::Failed(f)),
                        None => Ok(()),
                    });
                }
                core.wait_any(cx.waker());
            }
            st.waiters.push(cx.waker().clone());
        }
        match Pin::new(&mut self.cancellation).poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(ScopeError::Cancelled)),
            Poll::Pending => Poll::Pending,
        }
    }
}

struct Chan<T> {
    buf: VecDeque<T>,
    capacity: usize,
    closed: bool,
    sent: u64,
    taken: u64,
    recv_waiters: Vec<Waker>,
    send_waiters: Vec<Waker>,
    senders: usize,
}

impl<T> Chan<T> {
    fn wake_receivers(&mut self) {
        for w in self.recv_waiters.drain(..) {
            w.wake();
        }
    }

    fn wake_senders(&mut self) {
        for w in self.send_waiters.drain(..) {
            w.wake();
        }
    }
}

/// The sending side of a workflow channel. Cloneable; the channel closes
/// when [`Sender::close`] is called or every sender is dropped.
pub struct Sender<T> {
    chan: Rc<RefCell<Chan<T>>>,
}

impl<T> std::fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sender({} buffered)", self.chan.borrow().buf.len())
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.chan.borrow_mut().senders += 1;
        Sender {
            chan: self.chan.clone(),
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let mut c = self.chan.borrow_mut();
        c.senders -= 1;
        if c.senders == 0 {
            c.closed = true;
            c.wake_receivers();
        }
    }
}

/// Why a send failed: the channel is closed. The value comes back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the channel is closed")]
pub struct Closed<T>(pub T);

impl<T> Sender<T> {
    /// Sends `value`, waiting while the channel is full (backpressure).
    pub fn send(&self, value: T) -> Send<'_, T> {
        Send {
            sender: self,
            value: Some(value),
            ticket: None,
        }
    }

    /// Closes the channel: receivers drain what is buffered, then get `None`.
    pub fn close(&self) {
        let mut c = self.chan.borrow_mut();
        c.closed = true;
        c.wake_receivers();
        c.wake_senders();
    }
}

/// The future of [`Sender::send`].
pub struct Send<'a, T> {
    sender: &'a Sender<T>,
    value: Option<T>,
    ticket: Option<u64>,
}

impl<T> std::fmt::Debug for Send<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Send(ticket {:?})", self.ticket)
    }
}

impl<T> Unpin for Send<'_, T> {}

impl<T> Future for Send<'_, T> {
    type Output = Result<(), Closed<T>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut c = self.sender.chan.borrow_mut();
        if let Some(ticket) = self.ticket {
            // Rendezvous: done once a receiver took our value.
            if c.taken > ticket {
                return Poll::Ready(Ok(()));
            }
            c.send_waiters.push(cx.waker().clone());
            return Poll::Pending;
        }
        if c.closed {
            let v = self.value.take().expect("sent once");
            return Poll::Ready(Err(Closed(v)));
        }
        if c.buf.len() < c.capacity.max(1) && (c.capacity > 0 || c.buf.is_empty()) {
            let v = self.value.take().expect("sent once");
            c.buf.push_back(v);
            let ticket = c.sent;
            c.sent += 1;
            c.wake_receivers();
            if c.capacity == 0 {
                drop(c);
                self.ticket = Some(ticket);
                let mut c = self.sender.chan.borrow_mut();
                c.send_waiters.push(cx.waker().clone());
                return Poll::Pending;
            }
            return Poll::Ready(Ok(()));
        }
        c.send_waiters.push(cx.waker().clone());
        Poll::Pending
    }
}

/// The receiving side of a workflow channel. Cloneable: several coroutines
/// may take from one channel, in FIFO order of their waits.
pub struct Receiver<T> {
    chan: Rc<RefCell<Chan<T>>>,
}

impl<T> std::fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Receiver({} buffered)", self.chan.borrow().buf.len())
    }
}

impl<T> Clone for Receiver<T> {
    fn clone(&self) -> Self {
        Receiver {
            chan: self.chan.clone(),
        }
    }
}

impl<T> Receiver<T> {
    /// The next value, or `None` once the channel is closed and drained.
    pub fn recv(&self) -> Recv<'_, T> {
        Recv { receiver: self }
    }
}

/// The future of [`Receiver::recv`].
pub struct Recv<'a, T> {
    receiver: &'a Receiver<T>,
}

impl<T> std::fmt::Debug for Recv<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Recv")
    }
}

impl<T> Future for Recv<'_, T> {
    type Output = Option<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut c = self.receiver.chan.borrow_mut();
        if let Some(v) = c.buf.pop_front() {
            c.taken += 1;
            c.wake_senders();
            return Poll::Ready(Some(v));
        }
        if c.closed {
            return Poll::Ready(None);
        }
        c.recv_waiters.push(cx.waker().clone());
        Poll::Pending
    }
}
