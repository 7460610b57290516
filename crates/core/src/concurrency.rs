//! Concurrency in workflow code: `all` barriers (nested, mixed, limited),
//! child workflows, and keyed `select` with handles.
//!
//! A barrier takes one durable step and issues every leaf in one pass on its
//! first poll, with each leaf's full `parallel_group_path`; the run then
//! suspends once. Because the machine processes one input at a time, the
//! failure a barrier delivers is the first one committed: replay sees the
//! same order, and a later failure never replaces it.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use keel_storage::{
    EventKind, Failure, FailureKind, OperationKind, Payload, RunId, SelectKey, Step,
};
use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};

use crate::activity::Activity;
use crate::child::ChildCall;
use crate::context::{ActivityCall, Timer, WorkflowContext};
use crate::core::{ActiveGroup, Core, Issued};
use crate::machine::MachineError;
use crate::workflow::{ErasedWorkflow, Workflow, WorkflowError, WorkflowFuture};

fn failure(message: impl Into<String>) -> Failure {
    Failure::new(FailureKind::Application, message, false)
}

/// A member of an `all` barrier: an activity call, a child call or a
/// nested barrier.
pub trait Branch: Unpin {
    /// What the member yields.
    type Output;
    /// Durable leaves under this member (1 for a leaf).
    fn leaf_count(&self) -> u32;
    /// Polls the member; the first poll issues its leaves.
    fn poll_branch(&mut self, cx: &mut Context<'_>) -> Poll<Result<Self::Output, Failure>>;
    /// The durable step of a leaf, once issued.
    ///
    /// A member that names a step here promises that, once issued, only
    /// that step's resolution can move it on: barriers over a `Vec` and
    /// `all_limited` poll it again only when that step resolves (or the
    /// waker changes). A member that also waits on anything else (a
    /// timer, a signal, another step) must return `None`, and is then
    /// polled every time its barrier is.
    fn leaf_step(&self) -> Option<Step> {
        None
    }
    /// The durable steps of every leaf issued so far under this member (the
    /// leaf itself, or a barrier's leaves): what cancelling it cancels.
    fn leaf_steps(&self, out: &mut Vec<Step>) {
        out.extend(self.leaf_step());
    }
    /// The operation kind, for `select`.
    fn operation(&self) -> OperationKind;
}

impl<A: Activity> Branch for ActivityCall<A> {
    type Output = A::Output;
    fn leaf_count(&self) -> u32 {
        1
    }
    fn poll_branch(&mut self, cx: &mut Context<'_>) -> Poll<Result<A::Output, Failure>> {
        Pin::new(self).poll(cx)
    }
    fn leaf_step(&self) -> Option<Step> {
        self.step()
    }
    fn operation(&self) -> OperationKind {
        OperationKind::Activity
    }
}

/// One member's slot: the member and, once done, its output.
#[derive(Debug)]
pub struct Slot<B: Branch> {
    branch: B,
    out: Option<B::Output>,
}

// A slot never pins its output; members are polled through `&mut`.
impl<B: Branch> Unpin for Slot<B> {}

impl<B: Branch> Slot<B> {
    fn new(branch: B) -> Self {
        Slot { branch, out: None }
    }

    fn poll_slot(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Failure>> {
        if self.out.is_some() {
            return Poll::Ready(Ok(()));
        }
        match self.branch.poll_branch(cx) {
            Poll::Ready(Ok(v)) => {
                self.out = Some(v);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn take(&mut self) -> B::Output {
        self.out.take().expect("taken once, after the slot is done")
    }
}

/// The members of a barrier, in their nested shape (tuples, vectors).
pub trait Members: Unpin {
    /// The results, in the input's shape.
    type Output;
    /// Whether [`Members::poll_members`] looks at `ready` (else its
    /// barrier passes an empty list instead of collecting one).
    const USES_READY: bool = false;
    /// Durable leaves under these members.
    fn leaf_count(&self) -> u32;
    /// Polls the members not yet done that can have progressed; the first
    /// failure, in the members' order, wins. `ready` holds the steps with a
    /// resolution waiting: a member whose leaf step is not among them would
    /// stay pending, so a vector of members skips it.
    fn poll_members(
        &mut self,
        ready: &[Step],
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::Output, Failure>>;
    /// The leaf steps issued under members not yet done.
    fn leaf_steps(&self, out: &mut Vec<Step>);
}

/// Conversion of a plain tuple or vector of members into [`Members`].
pub trait IntoMembers {
    /// The slots.
    type Members: Members;
    /// Wraps each member in a slot.
    fn into_members(self) -> Self::Members;
}

/// Whether a barrier is polled with the waker its skipped members
/// registered; if not, `saved` becomes the new one and the barrier must
/// poll every member so each registers it.
fn keeps_waker(saved: &mut Option<Waker>, cx: &Context<'_>) -> bool {
    if saved.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
        return true;
    }
    *saved = Some(cx.waker().clone());
    false
}

/// The members of a barrier over a vector.
///
/// The first poll issues every member. After it, only the members that can
/// have progressed are polled: leaves whose step has a resolution waiting,
/// and members without a single step (nested barriers, polled every time).
/// A fan-out of n leaves then costs O(n) polls in all rather than O(n) per
/// result.
/// A leaf skipped keeps the waker it registered; a poll with a different
/// waker polls every member again so each registers the new one.
pub struct VecMembers<B: Branch> {
    slots: Vec<Slot<B>>,
    /// Index of each pending member by its leaf step.
    by_step: crate::core::StepMap<u32>,
    /// Pending members without a single leaf step.
    stepless: Vec<u32>,
    /// Members not yet done.
    pending: usize,
    /// The waker the skipped members registered (none before the first poll).
    waker: Option<Waker>,
}

// Members are polled through `&mut`; nothing is pinned structurally.
impl<B: Branch> Unpin for VecMembers<B> {}

impl<B: Branch> std::fmt::Debug for VecMembers<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "VecMembers(members {}, pending {})",
            self.slots.len(),
            self.pending
        )
    }
}

impl<B: Branch> VecMembers<B> {
    /// Polls member `i`; a pending member is indexed for the next poll.
    fn poll_index(&mut self, i: u32, cx: &mut Context<'_>) -> Poll<Result<(), Failure>> {
        let slot = &mut self.slots[i as usize];
        if slot.out.is_some() {
            return Poll::Ready(Ok(()));
        }
        let r = slot.poll_slot(cx);
        match &r {
            Poll::Ready(Ok(())) => self.pending -= 1,
            Poll::Ready(Err(_)) => {}
            Poll::Pending => self.index(i),
        }
        r
    }

    /// Files pending member `i` where the next poll looks for it: under
    /// its leaf step, or among those polled every time.
    fn index(&mut self, i: u32) {
        let slot = &self.slots[i as usize];
        if slot.out.is_some() {
            return;
        }
        match slot.branch.leaf_step() {
            Some(step) => {
                self.by_step.insert(step, i);
            }
            None => self.stepless.push(i),
        }
    }
}

impl<B: Branch> Members for VecMembers<B> {
    type Output = Vec<B::Output>;
    const USES_READY: bool = true;
    fn leaf_count(&self) -> u32 {
        self.slots.iter().map(|s| s.branch.leaf_count()).sum()
    }
    fn leaf_steps(&self, out: &mut Vec<Step>) {
        for s in self.slots.iter().filter(|s| s.out.is_none()) {
            s.branch.leaf_steps(out);
        }
    }
    fn poll_members(
        &mut self,
        ready: &[Step],
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<B::Output>, Failure>> {
        let candidates: Vec<u32> = if keeps_waker(&mut self.waker, cx) {
            let mut c: Vec<u32> = ready
                .iter()
                .filter_map(|s| self.by_step.remove(s))
                .collect();
            c.append(&mut self.stepless);
            c.sort_unstable();
            c
        } else {
            self.by_step.clear();
            self.stepless.clear();
            (0..self.slots.len() as u32).collect()
        };
        for (n, &i) in candidates.iter().enumerate() {
            if let Poll::Ready(Err(e)) = self.poll_index(i, cx) {
                // The members not reached keep their place for a later poll.
                for &rest in &candidates[n + 1..] {
                    self.index(rest);
                }
                return Poll::Ready(Err(e));
            }
        }
        if self.pending > 0 {
            return Poll::Pending;
        }
        Poll::Ready(Ok(self.slots.iter_mut().map(Slot::take).collect()))
    }
}

impl<B: Branch> IntoMembers for Vec<B> {
    type Members = VecMembers<B>;
    fn into_members(self) -> Self::Members {
        let slots: Vec<Slot<B>> = self.into_iter().map(Slot::new).collect();
        VecMembers {
            pending: slots.len(),
            slots,
            by_step: Default::default(),
            stepless: Vec::new(),
            waker: None,
        }
    }
}

macro_rules! tuple_members {
    ($($b:ident $i:tt),+) => {
        impl<$($b: Branch),+> Members for ($(Slot<$b>,)+) {
            type Output = ($($b::Output,)+);
            fn leaf_count(&self) -> u32 {
                0 $(+ self.$i.branch.leaf_count())+
            }
            fn leaf_steps(&self, out: &mut Vec<Step>) {
                $(
                    if self.$i.out.is_none() {
                        self.$i.branch.leaf_steps(out);
                    }
                )+
            }
            fn poll_members(
                &mut self,
                _ready: &[Step],
                cx: &mut Context<'_>,
            ) -> Poll<Result<Self::Output, Failure>> {
                // A handful of members: each is polled.
                let mut pending = false;
                $(
                    match self.$i.poll_slot(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending => pending = true,
                    }
                )+
                if pending {
                    return Poll::Pending;
                }
                Poll::Ready(Ok(($(self.$i.take(),)+)))
            }
        }

        impl<$($b: Branch),+> IntoMembers for ($($b,)+) {
            type Members = ($(Slot<$b>,)+);
            fn into_members(self) -> Self::Members {
                ($(Slot::new(self.$i),)+)
            }
        }
    };
}

tuple_members!(B0 0);
tuple_members!(B0 0, B1 1);
tuple_members!(B0 0, B1 1, B2 2);
tuple_members!(B0 0, B1 1, B2 2, B3 3);
tuple_members!(B0 0, B1 1, B2 2, B3 3, B4 4);
tuple_members!(B0 0, B1 1, B2 2, B3 3, B4 4, B5 5);

/// An `all` barrier: resolves with every member's result in the input's
/// shape, or with the first failure.
pub struct All<M: Members> {
    core: Rc<RefCell<Core>>,
    members: M,
    step: Option<Step>,
}

impl<M: Members> std::fmt::Debug for All<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "All(step {:?})", self.step)
    }
}

impl<M: Members> Branch for All<M> {
    type Output = M::Output;
    fn leaf_count(&self) -> u32 {
        self.members.leaf_count()
    }
    fn poll_branch(&mut self, cx: &mut Context<'_>) -> Poll<Result<M::Output, Failure>> {
        if self.step.is_some() {
            let ready: Vec<Step> = match M::USES_READY {
                true => self.core.borrow().resolved.keys().copied().collect(),
                false => Vec::new(),
            };
            return self.members.poll_members(&ready, cx);
        }
        let size = self.members.leaf_count();
        let step = {
            let mut core = self.core.borrow_mut();
            let step = core.take_step();
            core.group_stack.push(ActiveGroup {
                step,
                size,
                next: 0,
                per_leaf: true,
            });
            step
        };
        self.step = Some(step);
        let r = self.members.poll_members(&[], cx);
        self.core.borrow_mut().group_stack.pop();
        r
    }
    fn leaf_steps(&self, out: &mut Vec<Step>) {
        self.members.leaf_steps(out);
    }
    fn operation(&self) -> OperationKind {
        OperationKind::All
    }
}

impl<M: Members> Future for All<M> {
    type Output = Result<M::Output, Failure>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().poll_branch(cx)
    }
}

/// A barrier over a lazily produced sequence of members that never has
/// more than `limit` open. Each member's leaves record the barrier's step,
/// the member count as its size and the member's index.
pub struct AllLimited<I: Iterator>
where
    I::Item: Branch,
{
    core: Rc<RefCell<Core>>,
    source: I,
    size: u32,
    limit: usize,
    next_index: u32,
    open: BTreeMap<u32, I::Item>,
    by_step: crate::core::StepMap<u32>,
    stepless: std::collections::BTreeSet<u32>,
    results: Vec<Option<<I::Item as Branch>::Output>>,
    keep: bool,
    done: u32,
    step: Option<Step>,
    /// The waker the open members registered; a poll with another one
    /// polls every open member so each registers it.
    waker: Option<Waker>,
}

// Members are polled through `&mut` and results are plain values: nothing
// is pinned structurally.
impl<I: Iterator + Unpin> Unpin for AllLimited<I> where I::Item: Branch {}

impl<I: Iterator> std::fmt::Debug for AllLimited<I>
where
    I::Item: Branch,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "AllLimited(step {:?}, open {}, done {})",
            self.step,
            self.open.len(),
            self.done
        )
    }
}

impl<I: Iterator + Unpin> Future for AllLimited<I>
where
    I::Item: Branch,
{
    type Output = Result<Vec<<I::Item as Branch>::Output>, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let step = match this.step {
            Some(s) => s,
            None => {
                let s = this.core.borrow_mut().take_step();
                this.step = Some(s);
                s
            }
        };
        loop {
            // Poll only the members that can have progressed: leaves whose
            // step has a resolution waiting, and members without a single
            // step (nested barriers). The cost per input follows what
            // changed, not how many members are open.
            let candidates: Vec<u32> = if keeps_waker(&mut this.waker, cx) {
                let mut c: Vec<u32> = {
                    let core = this.core.borrow();
                    core.resolved
                        .keys()
                        .filter_map(|s| this.by_step.get(s).copied())
                        .collect()
                };
                c.extend(this.stepless.iter().copied());
                c.sort_unstable();
                c
            } else {
                this.open.keys().copied().collect()
            };
            let mut finished = Vec::new();
            for i in candidates {
                let Some(m) = this.open.get_mut(&i) else {
                    continue;
                };
                match m.poll_branch(cx) {
                    Poll::Ready(Ok(v)) => finished.push((i, Some(v))),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {}
                }
            }
            for (i, v) in finished {
                if let Some(m) = this.open.remove(&i) {
                    match m.leaf_step() {
                        Some(s) => {
                            this.by_step.remove(&s);
                        }
                        None => {
                            this.stepless.remove(&i);
                        }
                    }
                }
                this.done += 1;
                if this.keep {
                    this.results[i as usize] = v;
                }
            }
            // Issue new members while below the limit.
            let mut issued = false;
            while this.open.len() < this.limit && this.next_index < this.size {
                let Some(mut member) = this.source.next() else {
                    break;
                };
                let index = this.next_index;
                this.next_index += 1;
                this.core.borrow_mut().group_stack.push(ActiveGroup {
                    step,
                    size: this.size,
                    next: index,
                    per_leaf: false,
                });
                let r = member.poll_branch(cx);
                this.core.borrow_mut().group_stack.pop();
                match r {
                    Poll::Ready(Ok(v)) => {
                        this.done += 1;
                        if this.keep {
                            this.results[index as usize] = Some(v);
                        }
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        match member.leaf_step() {
                            Some(s) => {
                                this.by_step.insert(s, index);
                            }
                            None => {
                                this.stepless.insert(index);
                            }
                        }
                        this.open.insert(index, member);
                    }
                }
                issued = true;
            }
            if this.done == this.size {
                let out = if this.keep {
                    this.results
                        .drain(..)
                        .map(|r| r.expect("every member done"))
                        .collect()
                } else {
                    Vec::new()
                };
                return Poll::Ready(Ok(out));
            }
            if !issued {
                return Poll::Pending;
            }
        }
    }
}

impl WorkflowContext {
    /// A barrier over `members` (a tuple or a vector of activity calls,
    /// child calls and nested barriers). Every leaf is issued in one step;
    /// the results come back in the input's shape.
    pub fn all<M: IntoMembers>(&self, members: M) -> All<M::Members> {
        All {
            core: self.core.clone(),
            members: members.into_members(),
            step: None,
        }
    }

    /// A barrier over `members` that never has more than `limit` open:
    /// fan-out to any number of members with memory bounded by the limit.
    pub fn all_limited<I>(&self, limit: usize, members: I) -> AllLimited<I::IntoIter>
    where
        I: IntoIterator,
        I::IntoIter: ExactSizeIterator + Unpin,
        I::Item: Branch,
    {
        self.limited(limit, members, true)
    }

    /// Like [`WorkflowContext::all_limited`] but keeps no results: for
    /// fan-outs whose members' effects are what matters.
    pub fn for_each_limited<I>(&self, limit: usize, members: I) -> AllLimited<I::IntoIter>
    where
        I: IntoIterator,
        I::IntoIter: ExactSizeIterator + Unpin,
        I::Item: Branch,
    {
        self.limited(limit, members, false)
    }

    fn limited<I>(&self, limit: usize, members: I, keep: bool) -> AllLimited<I::IntoIter>
    where
        I: IntoIterator,
        I::IntoIter: ExactSizeIterator + Unpin,
        I::Item: Branch,
    {
        let source = members.into_iter();
        let size = source.len() as u32;
        AllLimited {
            core: self.core.clone(),
            source,
            size,
            limit: limit.max(1),
            next_index: 0,
            open: BTreeMap::new(),
            by_step: Default::default(),
            stepless: Default::default(),
            results: if keep {
                (0..size).map(|_| None).collect()
            } else {
                Vec::new()
            },
            keep,
            done: 0,
            step: None,
            waker: None,
        }
    }

    /// A keyed first-completion selection. Add members with the builder
    /// methods, then `.await` it.
    pub fn select(&self) -> Select {
        Select {
            core: self.core.clone(),
            members: Vec::new(),
            step: None,
            error: None,
        }
    }
}

/// A type-erased select member.
trait Pollable {
    fn poll_payload(&mut self, cx: &mut Context<'_>) -> Poll<Result<Payload, Failure>>;
    fn step(&self) -> Option<Step>;
    fn leaf_steps(&self, out: &mut Vec<Step>) {
        out.extend(self.step());
    }
    fn operation(&self) -> OperationKind;
}

struct BranchMember<B>(B);

impl<B: Branch> Pollable for BranchMember<B>
where
    B::Output: Serialize,
{
    fn poll_payload(&mut self, cx: &mut Context<'_>) -> Poll<Result<Payload, Failure>> {
        self.0.poll_branch(cx).map(|r| {
            r.and_then(|v| {
                Payload::encode(&v).map_err(|e| failure(format!("result does not encode: {e}")))
            })
        })
    }
    fn step(&self) -> Option<Step> {
        self.0.leaf_step()
    }
    fn leaf_steps(&self, out: &mut Vec<Step>) {
        self.0.leaf_steps(out);
    }
    fn operation(&self) -> OperationKind {
        self.0.operation()
    }
}

struct TimerMember(Timer);

impl Pollable for TimerMember {
    fn poll_payload(&mut self, cx: &mut Context<'_>) -> Poll<Result<Payload, Failure>> {
        // A timer's value is `()`, so its handle's result decodes as `()`.
        Pin::new(&mut self.0)
            .poll(cx)
            .map(|()| Payload::encode(&()).map_err(|e| failure(e.to_string())))
    }
    fn step(&self) -> Option<Step> {
        self.0.step()
    }
    fn operation(&self) -> OperationKind {
        OperationKind::Timer
    }
}

struct SignalMember {
    core: Rc<RefCell<Core>>,
    name: String,
}
impl Pollable for SignalMember {
    fn poll_payload(&mut self, cx: &mut Context<'_>) -> Poll<Result<Payload, Failure>> {
        let mut core = self.core.borrow_mut();
        if let Some(p) = core.signals.get_mut(&self.name).and_then(|q| q.pop_front()) {
            return Poll::Ready(Ok(p));
        }
        core.wait_any(cx.waker());
        Poll::Pending
    }
    fn step(&self) -> Option<Step> {
        None
    }
    fn operation(&self) -> OperationKind {
        OperationKind::Signal
    }
}

struct ConditionMember {
    core: Rc<RefCell<Core>>,
    predicate: Box<dyn FnMut() -> bool>,
}

impl Pollable for ConditionMember {
    fn poll_payload(&mut self, cx: &mut Context<'_>) -> Poll<Result<Payload, Failure>> {
        if (self.predicate)() {
            return Poll::Ready(Ok(Payload::default()));
        }
        self.core.borrow_mut().wait_any(cx.waker());
        Poll::Pending
    }
    fn step(&self) -> Option<Step> {
        None
    }
    fn operation(&self) -> OperationKind {
        OperationKind::Condition
    }
}

struct MemberState {
    key: SelectKey,
    member: Box<dyn Pollable>,
    done: Option<Result<Payload, Failure>>,
    cancelled: bool,
}

/// A keyed first-completion selection over activities, children, timers,
/// signal waits, condition waits and nested barriers.
pub struct Select {
    core: Rc<RefCell<Core>>,
    members: Vec<Rc<RefCell<MemberState>>>,
    step: Option<Step>,
    error: Option<String>,
}

impl std::fmt::Debug for Select {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Select({} members, step {:?})",
            self.members.len(),
            self.step
        )
    }
}

impl Select {
    fn push(mut self, key: impl Into<SelectKey>, member: Box<dyn Pollable>) -> Self {
        let key = key.into();
        if matches!(&key, SelectKey::Name(n) if n.is_empty()) {
            self.error =
                Some("a select key must be a non-empty string or a non-negative integer".into());
        }
        if self.members.iter().any(|m| m.borrow().key == key) {
            self.error = Some(format!("select key {key} is used twice"));
        }
        self.members.push(Rc::new(RefCell::new(MemberState {
            key,
            member,
            done: None,
            cancelled: false,
        })));
        self
    }

    /// Adds an activity call, child call or nested barrier.
    pub fn branch<B: Branch + 'static>(self, key: impl Into<SelectKey>, b: B) -> Self
    where
        B::Output: Serialize,
    {
        self.push(key, Box::new(BranchMember(b)))
    }

    /// Adds a durable timer.
    pub fn timer(self, key: impl Into<SelectKey>, duration: Duration) -> Self {
        let t = Timer::new(self.core.clone(), duration);
        self.push(key, Box::new(TimerMember(t)))
    }

    /// Adds a wait for the next signal named `name`.
    pub fn signal(self, key: impl Into<SelectKey>, name: &str) -> Self {
        let core = self.core.clone();
        self.push(
            key,
            Box::new(SignalMember {
                core,
                name: name.to_string(),
            }),
        )
    }

    /// Adds a wait for a condition over workflow state.
    pub fn condition(
        self,
        key: impl Into<SelectKey>,
        predicate: impl FnMut() -> bool + 'static,
    ) -> Self {
        let core = self.core.clone();
        self.push(
            key,
            Box::new(ConditionMember {
                core,
                predicate: Box::new(predicate),
            }),
        )
    }
}

/// The outcome of a [`Select`]: the winner and a handle per member.
#[derive(Debug)]
pub struct Selected {
    /// The winner's key.
    pub key: SelectKey,
    /// The winner's index.
    pub index: u32,
    /// The winner's operation kind.
    pub operation: OperationKind,
    /// The durable step of the winner's operation (`None` for signal and
    /// condition waits, which have no command of their own).
    pub step: Option<Step>,
    /// The winner's result or typed failure.
    pub outcome: Result<Payload, Failure>,
    /// A handle per member, in member order (the winner's included).
    pub handles: Vec<(SelectKey, SelectHandle)>,
}

impl Selected {
    /// The winner's result decoded as `T`.
    pub fn result<T: DeserializeOwned>(&self) -> Result<T, Failure> {
        match &self.outcome {
            Ok(p) => p
                .decode()
                .map_err(|e| failure(format!("select result does not decode: {e}"))),
            Err(f) => Err(f.clone()),
        }
    }

    /// The handle of the member with `key`.
    pub fn handle(&self, key: impl Into<SelectKey>) -> Option<&SelectHandle> {
        let key = key.into();
        self.handles.iter().find(|(k, _)| *k == key).map(|(_, h)| h)
    }

    /// The winner's handle.
    pub fn winner(&self) -> &SelectHandle {
        &self.handles[self.index as usize].1
    }
}

/// A handle to one select member: await its result later, or cancel it.
#[derive(Clone)]
pub struct SelectHandle {
    core: Rc<RefCell<Core>>,
    select_step: Step,
    index: u32,
    state: Rc<RefCell<MemberState>>,
}

impl std::fmt::Debug for SelectHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SelectHandle({})", self.state.borrow().key)
    }
}

impl SelectHandle {
    /// Requests cancellation of the member. Returns nothing: the history
    /// says whether it took effect. If the member had already completed,
    /// nothing is recorded; otherwise a `SelectionOperationCancelled` event
    /// is committed (with a timer cancel or an activity cancel request).
    pub fn cancel(&self) {
        let mut st = self.state.borrow_mut();
        if st.done.is_some() || st.cancelled {
            return;
        }
        let mut core = self.core.borrow_mut();
        let member_step = st.member.step();
        if let Some(step) = member_step {
            if core.resolved.contains_key(&step) || !core.open.contains_key(&step) {
                return; // completed first: a committed no-op
            }
        }
        let mut leaves = Vec::new();
        st.member.leaf_steps(&mut leaves);
        st.cancelled = true;
        let kind = EventKind::SelectionOperationCancelled {
            step: self.select_step,
            member_index: self.index,
            member_step: member_step.unwrap_or_default(),
        };
        if let Issued::Diverged = core.issue(kind) {
            return;
        }
        // Cancel what the member waits on: its leaf (a timer, an activity,
        // a child per its close policy), or every open leaf of a barrier.
        for step in leaves {
            if !core.resolved.contains_key(&step) {
                core.cancel_wait(step, "select member cancelled");
            }
        }
    }

    /// Waits for the member's result (the recorded one for the winner).
    pub fn result<T: DeserializeOwned>(&self) -> HandleResult<T> {
        HandleResult {
            handle: self.clone(),
            _t: PhantomData,
        }
    }
}

/// The future of [`SelectHandle::result`].
pub struct HandleResult<T> {
    handle: SelectHandle,
    _t: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for HandleResult<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HandleResult({:?})", self.handle)
    }
}

impl<T: DeserializeOwned> Future for HandleResult<T> {
    type Output = Result<T, Failure>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = self.handle.state.borrow_mut();
        if st.done.is_none() {
            if st.cancelled {
                let step = st.member.step();
                let resolved =
                    step.is_some_and(|s| self.handle.core.borrow().resolved.contains_key(&s));
                if !resolved {
                    return Poll::Ready(Err(Failure::new(
                        FailureKind::Cancelled,
                        "select member cancelled",
                        false,
                    )));
                }
            }
            match st.member.poll_payload(cx) {
                Poll::Ready(r) => st.done = Some(r),
                Poll::Pending => return Poll::Pending,
            }
        }
        let r = st.done.clone().expect("set above");
        Poll::Ready(r.and_then(|p| {
            p.decode()
                .map_err(|e| failure(format!("result does not decode: {e}")))
        }))
    }
}

impl Future for Select {
    type Output = Result<Selected, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some(e) = this.error.take() {
            return Poll::Ready(Err(failure(e)));
        }
        if this.members.is_empty() {
            return Poll::Ready(Err(failure("select needs at least one member")));
        }
        let select_step = match this.step {
            Some(s) => s,
            None => {
                let s = this.core.borrow_mut().take_step();
                this.step = Some(s);
                s
            }
        };
        // Poll every member (the first poll starts them all); the first
        // ready one in member order wins.
        let mut winner = None;
        for (i, m) in this.members.iter().enumerate() {
            let mut st = m.borrow_mut();
            if st.done.is_none() {
                if let Poll::Ready(r) = st.member.poll_payload(cx) {
                    st.done = Some(r);
                }
            }
            if winner.is_none() && st.done.is_some() {
                winner = Some(i as u32);
            }
        }
        let Some(index) = winner else {
            return Poll::Pending;
        };
        let (key, operation, member_step, outcome) = {
            let st = this.members[index as usize].borrow();
            (
                st.key.clone(),
                st.member.operation(),
                st.member.step(),
                st.done.clone().expect("winner is done"),
            )
        };
        let recorded = {
            let mut core = this.core.borrow_mut();
            core.issue(EventKind::SelectionWinnerRecorded {
                step: select_step,
                member_index: index,
                key: key.clone(),
                operation,
                member_step: member_step.unwrap_or_default(),
            })
        };
        match recorded {
            Issued::Live(_) => {}
            Issued::Replayed(e) => {
                if let EventKind::SelectionWinnerRecorded { member_index, .. } = e.kind {
                    if member_index != index {
                        let mut core = this.core.borrow_mut();
                        core.error = Some(MachineError::NonDeterminism {
                            step: select_step,
                            recorded: format!("select winner #{member_index}"),
                            issued: format!("select winner #{index}"),
                        });
                        return Poll::Pending;
                    }
                }
            }
            Issued::Diverged => return Poll::Pending,
        }
        let handles = this
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                (
                    m.borrow().key.clone(),
                    SelectHandle {
                        core: this.core.clone(),
                        select_step,
                        index: i as u32,
                        state: m.clone(),
                    },
                )
            })
            .collect();
        Poll::Ready(Ok(Selected {
            key,
            index,
            operation,
            step: member_step,
            outcome,
            handles,
        }))
    }
}

/// System workflow type of async closures.
pub const ASYNC_WORKFLOW_TYPE: &str = "keel.async";

pub(crate) type BoundClosure =
    Arc<dyn Fn(WorkflowContext, Payload) -> Result<WorkflowFuture, String> + Send + Sync>;

/// Closures of async children, bound by the parent when it issues (or
/// replays) the call, keyed by the child's run. The closure lives in the
/// parent's binary: a child can only run where its parent's code is. The
/// table belongs to a [`crate::WorkflowRegistry`] (every clone shares it), so
/// an engine, a simulated engine process or a replayer each have their own,
/// and a simulated crash loses it with the process.
#[derive(Clone, Default)]
pub(crate) struct Closures(Arc<Mutex<HashMap<RunId, BoundClosure>>>);

impl Closures {
    /// Binds `child`'s closure; true if none was bound.
    pub(crate) fn bind(&self, child: RunId, f: BoundClosure) -> bool {
        self.0.lock().insert(child, f).is_none()
    }

    pub(crate) fn get(&self, child: RunId) -> Option<BoundClosure> {
        self.0.lock().get(&child).cloned()
    }

    pub(crate) fn unbind(&self, child: RunId) {
        self.0.lock().remove(&child);
    }

    pub(crate) fn is_bound(&self, child: RunId) -> bool {
        self.0.lock().contains_key(&child)
    }

    pub(crate) fn unbind_where(&self, which: impl Fn(RunId) -> bool) {
        self.0.lock().retain(|run, _| !which(*run));
    }

    pub(crate) fn runs(&self) -> Vec<RunId> {
        let mut runs: Vec<RunId> = self.0.lock().keys().copied().collect();
        runs.sort();
        runs
    }
}

#[derive(Serialize, serde::Deserialize)]
struct AsyncInput {
    closure: String,
    input: Payload,
}

/// The `keel.async` system workflow: runs the closure its parent bound.
pub(crate) struct AsyncSystem;

impl ErasedWorkflow for AsyncSystem {
    fn name(&self) -> &'static str {
        ASYNC_WORKFLOW_TYPE
    }

    fn check_input(&self, input: &Payload) -> Result<(), String> {
        input
            .decode::<AsyncInput>()
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn start(&self, ctx: WorkflowContext, input: &Payload) -> Result<WorkflowFuture, String> {
        let wrapper: AsyncInput = input.decode().map_err(|e| e.to_string())?;
        let run = ctx.run_id();
        let f = ctx.closures.get(run).ok_or_else(|| {
            format!(
                "closure {} of async child {run} is not bound: its parent must be replayed first",
                wrapper.closure
            )
        })?;
        f(ctx, wrapper.input)
    }
}

impl WorkflowContext {
    /// Runs `f` as a durable child run of the system type `keel.async`.
    /// The parent sees it as a child wait, with the same ids and lineage as
    /// [`WorkflowContext::child`]. `f` follows the same rules as workflow
    /// code; values it needs come in `input` (serialized with the child).
    ///
    /// The closure lives in the parent's binary and is re-bound when the
    /// parent replays, so an async child can run only where its parent's
    /// code is, and only once the parent has issued (or replayed) the call.
    /// Across deployments prefer a named child workflow: its type is a
    /// stable name, a closure's is not.
    pub fn run_async<I, O, F, Fut>(&self, input: I, f: F) -> AsyncCall<O>
    where
        I: Serialize + DeserializeOwned + 'static,
        O: Serialize + DeserializeOwned + 'static,
        F: Fn(WorkflowContext, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, WorkflowError>> + 'static,
    {
        let closure_name = std::any::type_name::<F>().to_string();
        let wrapped = Payload::encode(&input)
            .map_err(|e| e.to_string())
            .and_then(|p| {
                Payload::encode(&AsyncInput {
                    closure: closure_name,
                    input: p,
                })
                .map_err(|e| e.to_string())
            });
        let f = Arc::new(f);
        let bind: BoundClosure = Arc::new(move |ctx: WorkflowContext, p: Payload| {
            let input: I = p.decode().map_err(|e| e.to_string())?;
            let fut = f(ctx, input);
            Ok(Box::pin(async move {
                let out = fut.await?;
                Payload::encode(&out)
                    .map_err(|e| WorkflowError::msg(format!("result does not encode: {e}")))
            }) as WorkflowFuture)
        });
        AsyncCall {
            call: ChildCall::new(self.core.clone(), ASYNC_WORKFLOW_TYPE.to_string(), wrapped),
            closures: self.closures.clone(),
            bind: Some(bind),
            _o: PhantomData,
        }
    }
}

/// The system workflow an [`AsyncCall`] schedules (for typing only).
#[derive(Debug)]
pub struct AsyncChild;

impl Workflow for AsyncChild {
    const NAME: &'static str = ASYNC_WORKFLOW_TYPE;
    type Input = Payload;
    type Output = Payload;
    async fn run(_ctx: WorkflowContext, _input: Payload) -> Result<Payload, WorkflowError> {
        Err(WorkflowError::msg(
            "keel.async runs through its bound closure",
        ))
    }
}

/// An async closure running as a child run.
pub struct AsyncCall<O> {
    call: ChildCall<AsyncChild>,
    closures: Closures,
    bind: Option<BoundClosure>,
    _o: PhantomData<fn() -> O>,
}

impl<O> std::fmt::Debug for AsyncCall<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AsyncCall(step {:?})", self.call.step)
    }
}

impl<O: DeserializeOwned> Branch for AsyncCall<O> {
    type Output = O;
    fn leaf_count(&self) -> u32 {
        1
    }
    fn poll_branch(&mut self, cx: &mut Context<'_>) -> Poll<Result<O, Failure>> {
        let r = self.call.poll_raw(cx);
        if let Some(bind) = self.bind.take() {
            // Bind the closure to the child's run as soon as the call is
            // issued (live) or matched (replay).
            let child = self.call.step.and_then(|s| {
                self.call
                    .core
                    .borrow()
                    .open
                    .get(&s)
                    .and_then(|w| w.child_run)
            });
            match child {
                Some(run) => {
                    let fresh = self.closures.bind(run, bind);
                    let mut core = self.call.core.borrow_mut();
                    if fresh && !core.historical {
                        // Bound before the call's scheduling is durable,
                        // and by nothing else (another machine of the
                        // run, whose child may run, bound it before).
                        core.async_unsettled.push(run);
                    }
                }
                None => self.bind = Some(bind),
            }
        }
        r.map(|r| {
            r.and_then(|p| {
                p.decode()
                    .map_err(|e| failure(format!("async result does not decode: {e}")))
            })
        })
    }
    fn leaf_step(&self) -> Option<Step> {
        self.call.step
    }
    fn operation(&self) -> OperationKind {
        OperationKind::Child
    }
}

impl<O: DeserializeOwned> Future for AsyncCall<O> {
    type Output = Result<O, Failure>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().poll_branch(cx)
    }
}
