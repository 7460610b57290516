//! Message streams: ordered, deduplicated messages a run reads with a
//! cursor.
//!
//! A client (or another workflow) sends a message to a named stream of an
//! instance with an idempotency key. The run commits it as
//! `MessageReceived` with the stream's next offset; a second send with the
//! same key is a duplicate and answers with the first offset. Workflow code
//! reads in offset order through [`MessageStream::next`]; what it has not
//! read, the offsets and the newest keys are carried across
//! continue-as-new, so the next run's reader continues at the same cursor.
//! Reading writes nothing: replay of the same code reads the same messages.

use std::cell::RefCell;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use keel_storage::{Failure, FailureKind, MessageKey, StreamMessage};
use serde::de::DeserializeOwned;

use crate::core::Core;

/// One message read from a stream.
#[derive(Clone, Debug, PartialEq)]
pub struct Message<T> {
    /// Its position in the stream (from 0, without gaps, across the
    /// instance's runs).
    pub offset: u64,
    /// The sender's idempotency key.
    pub key: MessageKey,
    /// Its decoded payload.
    pub value: T,
}

/// The reading end of a named message stream of this run
/// ([`crate::WorkflowContext::stream`]). Every handle of the same name
/// shares one cursor.
pub struct MessageStream<T> {
    core: Rc<RefCell<Core>>,
    name: String,
    _t: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for MessageStream<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageStream")
            .field("name", &self.name)
            .finish()
    }
}

impl<T: DeserializeOwned> MessageStream<T> {
    pub(crate) fn new(core: Rc<RefCell<Core>>, name: &str) -> Self {
        MessageStream {
            core,
            name: name.to_string(),
            _t: PhantomData,
        }
    }

    /// Waits for the message at the cursor and moves the cursor past it.
    /// A payload that does not decode into `T` is an `Err` (the cursor
    /// still moves: the message was read).
    pub fn next(&self) -> NextMessage<T> {
        NextMessage {
            core: self.core.clone(),
            name: self.name.clone(),
            counted: false,
            _t: PhantomData,
        }
    }

    /// The message at the cursor if one is committed, without waiting.
    pub fn try_next(&self) -> Option<Result<Message<T>, Failure>> {
        let mut core = self.core.borrow_mut();
        take(&mut core, &self.name).map(decode)
    }

    /// The offset the next read returns.
    pub fn cursor(&self) -> u64 {
        let core = self.core.borrow();
        core.streams.get(&self.name).map_or(0, |s| s.cursor())
    }

    /// Messages committed and not read yet.
    pub fn backlog(&self) -> usize {
        let core = self.core.borrow();
        core.streams.get(&self.name).map_or(0, |s| s.unread.len())
    }
}

fn take(core: &mut Core, name: &str) -> Option<StreamMessage> {
    if core.in_read_only {
        // A query or validator must not move the cursor: nothing is
        // taken, and the handler fails as having changed state.
        core.read_only_touched = true;
        return None;
    }
    core.streams.get_mut(name)?.unread.pop_front()
}

fn decode<T: DeserializeOwned>(m: StreamMessage) -> Result<Message<T>, Failure> {
    match m.payload.decode() {
        Ok(value) => Ok(Message {
            offset: m.offset,
            key: m.key,
            value,
        }),
        Err(e) => Err(Failure::new(
            FailureKind::Application,
            format!(
                "message {} at offset {} does not decode: {e}",
                m.key, m.offset
            ),
            false,
        )),
    }
}

/// A wait for the message at a stream's cursor ([`MessageStream::next`]).
pub struct NextMessage<T> {
    core: Rc<RefCell<Core>>,
    name: String,
    counted: bool,
    _t: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for NextMessage<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NextMessage")
            .field("stream", &self.name)
            .finish()
    }
}

impl<T> NextMessage<T> {
    fn uncount(&mut self, core: &mut Core) {
        if !std::mem::take(&mut self.counted) {
            return;
        }
        if let Some(n) = core.stream_waits.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                core.stream_waits.remove(&self.name);
            }
        }
    }
}

impl<T: DeserializeOwned> Future for NextMessage<T> {
    type Output = Result<Message<T>, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let core_rc = this.core.clone();
        let mut core = core_rc.borrow_mut();
        if let Some(m) = take(&mut core, &this.name) {
            this.uncount(&mut core);
            return Poll::Ready(decode(m));
        }
        if !this.counted {
            this.counted = true;
            *core.stream_waits.entry(this.name.clone()).or_default() += 1;
        }
        core.wait_any(cx.waker());
        Poll::Pending
    }
}

impl<T> Drop for NextMessage<T> {
    fn drop(&mut self) {
        // A wait dropped unfinished (it lost a select, its scope was
        // cancelled) no longer counts as waiting.
        if let Ok(mut core) = self.core.clone().try_borrow_mut() {
            self.uncount(&mut core);
        }
    }
}

/// A signal or stream message workflow code sent to an instance
/// ([`crate::WorkflowContext::send_message`],
/// [`crate::WorkflowContext::signal_workflow`]). The send is a command:
/// `ExternalSendScheduled` is committed, and only then does the outbox
/// deliver it, at least once, with the target deduplicating (a message by
/// its key, a signal by an id derived from this run and step). Resolves
/// once the target answered for good: `Ok(Some(offset))` for a message,
/// `Ok(None)` for a signal, `Err` if the instance is unknown or closed.
/// A run whose code returns while a send is unanswered closes only once
/// it is answered; dropping the future does not take the send back.
pub struct ExternalSend {
    core: Rc<RefCell<Core>>,
    target: String,
    delivery: Option<Result<keel_storage::Delivery, Failure>>,
    step: Option<keel_storage::Step>,
}

impl std::fmt::Debug for ExternalSend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalSend")
            .field("target", &self.target)
            .field("step", &self.step)
            .finish()
    }
}

impl ExternalSend {
    pub(crate) fn new(
        core: Rc<RefCell<Core>>,
        target: &str,
        delivery: Result<keel_storage::Delivery, Failure>,
    ) -> Self {
        ExternalSend {
            core,
            target: target.to_string(),
            delivery: Some(delivery),
            step: None,
        }
    }
}

impl Future for ExternalSend {
    type Output = Result<Option<u64>, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        use crate::core::{Issued, Resolution, WaitKind};
        use keel_storage::EventKind;
        let this = self.get_mut();
        let mut core = this.core.borrow_mut();
        let step = match this.step {
            Some(s) => s,
            None => {
                let delivery = match this.delivery.take() {
                    Some(Ok(d)) => d,
                    Some(Err(f)) => return Poll::Ready(Err(f)),
                    None => return Poll::Pending,
                };
                let step = core.take_step();
                this.step = Some(step);
                match core.issue(EventKind::ExternalSendScheduled {
                    step,
                    target: this.target.clone(),
                    delivery,
                }) {
                    Issued::Live(e) | Issued::Replayed(e) => {
                        let group = core.group();
                        core.open_wait(step, WaitKind::Send, this.target.clone(), group, e.at);
                    }
                    Issued::Diverged => return Poll::Pending,
                }
                step
            }
        };
        match core.resolved.remove(&step) {
            Some(Resolution::Value(p)) => Poll::Ready(Ok(p.decode::<Option<u64>>().ok().flatten())),
            Some(Resolution::Failed(f)) => Poll::Ready(Err(f)),
            None => {
                core.wait_on(step, cx.waker());
                Poll::Pending
            }
        }
    }
}
