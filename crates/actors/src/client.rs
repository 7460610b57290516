//! The [`Client`]: starting, signalling, cancelling, terminating, awaiting,
//! describing and resuming workflows. Each call is one request to the
//! shard its target routes to; the shard's driver decides and answers, and
//! the client turns the answer into a result. The client holds no store
//! and no engine thread: once the engine shuts down, every call (and every
//! call still waiting) ends with [`EngineError::Shutdown`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use keel_core::driver::{
    list_answer, Answer, ReadQuery, Refusal, Request, RequestId, Resumed, ReusePolicy,
    RunDescription, ShardId, StartSignal,
};
use keel_core::Workflow;
use keel_storage::search;
use keel_storage::{
    CommandId, Failure, InstanceId, Outcome, PageToken, Payload, RelayTo, RunFilter, RunId,
    RunPage, SearchValue, Store, PAYLOAD_BYTES_MAX,
};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::readers::ReadQueue;
use crate::routes::{Routes, Wire};
use crate::shard::Ask;

/// Times a call is sent again when the engine answered "try again" (a
/// commit failed) before the call fails with [`EngineError::Unavailable`].
pub const CLIENT_RETRIES_MAX: u32 = 8;

/// Times a signal, cancel or terminate for an instance is sent again after
/// the run it reached was closed (it may have continued as new).
pub const CONTINUE_AS_NEW_FOLLOWS_MAX: u32 = 3;

/// The answer a relayed call gets when none came in time (see
/// [`REMOTE_ANSWER_WAIT_MS`]).
const NO_ANSWER: &str = "no answer from the engine process that owns the shard; asking again";

/// Whether `request` is an input for an instance (not for one run by id).
fn names_instance(request: &Request) -> bool {
    match request {
        Request::Signal { target, .. }
        | Request::SendMessage { target, .. }
        | Request::Cancel { target, .. }
        | Request::Terminate { target, .. } => RunId::parse(target).is_none(),
        _ => false,
    }
}

/// Errors the engine and client return. Bad input is refused with a typed
/// error before anything is written.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// No workflow of this type is registered.
    #[error("unknown workflow type {0:?}")]
    UnknownWorkflowType(String),
    /// The input does not decode into the workflow's input type.
    #[error("input for workflow {workflow_type:?} does not decode: {detail}")]
    InvalidInput {
        /// The workflow type.
        workflow_type: String,
        /// The decoder's message.
        detail: String,
    },
    /// A value could not be encoded.
    #[error("value does not encode: {0}")]
    Encode(String),
    /// A payload over the limit.
    #[error("payload of {bytes} bytes exceeds the limit of {max} bytes")]
    PayloadTooLarge {
        /// Its size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// A payload nested deeper than any decoder here follows.
    #[error("payload nests arrays, maps or enum variants deeper than the limit of {max} levels")]
    PayloadTooDeep {
        /// The limit ([`keel_storage::BODY_NESTING_MAX`]).
        max: u32,
    },
    /// No instance or run by that id.
    #[error("unknown instance or run {0:?}")]
    UnknownInstance(String),
    /// The run is closed.
    #[error("run {run} is closed")]
    RunClosed {
        /// The run.
        run: RunId,
    },
    /// The instance's last run is closed and the reuse policy refuses a new one.
    #[error(
        "instance {instance} already ran (run {run}, {status}); the reuse policy refuses a new run"
    )]
    AlreadyClosed {
        /// The instance.
        instance: InstanceId,
        /// Its last run.
        run: RunId,
        /// That run's status.
        status: &'static str,
    },
    /// The run is parked.
    #[error("run {run} is parked: {reason}")]
    Parked {
        /// The run.
        run: RunId,
        /// Why.
        reason: String,
    },
    /// The workflow failed.
    #[error("workflow failed: {0}")]
    WorkflowFailed(Failure),
    /// The workflow was cancelled.
    #[error("workflow cancelled: {0}")]
    WorkflowCancelled(String),
    /// The workflow was terminated.
    #[error("workflow terminated: {0}")]
    WorkflowTerminated(String),
    /// A run or execution timeout of the workflow passed.
    #[error("workflow timed out: {0}")]
    WorkflowTimedOut(String),
    /// The result does not decode into the expected type.
    #[error("result does not decode: {0}")]
    ResultDecode(String),
    /// The store refused the request (a limit), or could not open.
    #[error(transparent)]
    Store(#[from] keel_storage::Error),
    /// The store refused the request's commit for good.
    #[error("the store refused the request: {0}")]
    Refused(String),
    /// The engine kept answering "try again".
    #[error("the engine could not take the request after {CLIENT_RETRIES_MAX} tries: {0}")]
    Unavailable(String),
    /// The engine is shutting down.
    #[error("the engine is shut down")]
    Shutdown,
    /// The run's code did not answer a query or update: no handler by that
    /// name, arguments that do not decode, a validator's rejection, a
    /// handler that panicked or tried to write. Nothing was written.
    #[error(transparent)]
    Handler(#[from] keel_core::HandlerError),
    /// The update's handler failed; the failure is committed.
    #[error("update failed: {0}")]
    UpdateFailed(Failure),
    /// The store does not accept writes (a full or failing disk; see
    /// [`crate::Engine::health`]): the request needs a commit, or waited
    /// for progress that cannot happen. Nothing was written.
    #[error("the store does not accept writes: {0}")]
    StoreUnavailable(String),
    /// Memo fields or search attributes that are not valid or over a
    /// limit. Nothing was written.
    #[error(transparent)]
    Metadata(#[from] keel_storage::MetadataError),
    /// A list filter or page token that does not check. Nothing was read.
    #[error("{0}")]
    BadFilter(String),
    /// A stream message whose stream name or key does not check. Nothing
    /// was written.
    #[error("bad message: {0}")]
    BadMessage(String),
    /// The stream holds as many unread messages as it may (or the run
    /// receives on as many streams as it may). Nothing was written; send
    /// again once the workflow has read.
    #[error("run {run}: {detail}")]
    StreamFull {
        /// The run.
        run: RunId,
        /// Which limit.
        detail: String,
    },
    /// A schedule request that does not check (cron syntax, time zone,
    /// id). Nothing was written.
    #[error(transparent)]
    Schedule(#[from] keel_core::schedule::ScheduleError),
    /// A schedule with this id exists already.
    #[error("schedule {0:?} exists already")]
    ScheduleExists(String),
    /// No schedule has this id (never created, or deleted).
    #[error("no schedule {0:?} (never created, or deleted)")]
    UnknownSchedule(String),
}

/// Where a stream message was committed ([`Client::send_message`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MessageSent {
    /// Its offset in the stream.
    pub offset: u64,
    /// False when an earlier send with the same key committed it: this
    /// one changed nothing.
    pub first: bool,
}

/// How to start a run: a command id that deduplicates the start, the
/// reuse policy, and the memo and search attributes it starts with (the
/// start's commit indexes them, so `list` finds the run at once).
#[derive(Clone, Debug, Default)]
pub struct StartOptions {
    command_id: Option<CommandId>,
    reuse: ReusePolicy,
    memo: Vec<(String, Payload)>,
    search_attributes: Vec<(String, Payload)>,
    timeouts: keel_storage::StartTimeouts,
    encode_error: Option<String>,
}

impl StartOptions {
    /// Default options: no command id, the default reuse policy, no memo,
    /// no search attributes.
    pub fn new() -> Self {
        StartOptions::default()
    }

    /// A retry with the same command id is the same start, even after its
    /// run closed.
    pub fn command_id(mut self, id: impl Into<String>) -> Self {
        self.command_id = Some(CommandId::new(id));
        self
    }

    /// What to do when the instance's last run is closed.
    pub fn reuse(mut self, reuse: ReusePolicy) -> Self {
        self.reuse = reuse;
        self
    }

    /// A memo field to start with.
    pub fn memo<T: Serialize + ?Sized>(mut self, name: &str, value: &T) -> Self {
        match Payload::encode(value) {
            Ok(p) => self.memo.push((name.to_string(), p)),
            Err(e) => self.encode_error = Some(format!("memo {name:?}: {e}")),
        }
        self
    }

    /// A search attribute to start with.
    pub fn search_attribute(mut self, name: &str, value: impl Into<SearchValue>) -> Self {
        self.search_attributes
            .push((name.to_string(), value.into().to_payload()));
        self
    }

    /// Closes each run of the workflow that stays open longer than `d`
    /// (from that run's start) as timed out, without running more of its
    /// code: status `timed-out`, [`EngineError::WorkflowTimedOut`] for
    /// whoever waits, a timeout failure for a parent. Every run a
    /// continue-as-new makes gets the same timeout.
    pub fn run_timeout(mut self, d: std::time::Duration) -> Self {
        self.timeouts = self.timeouts.with_run(d);
        self
    }

    /// Like [`StartOptions::run_timeout`], for the whole chain of runs:
    /// the deadline is fixed at this start and continue-as-new keeps it.
    pub fn execution_timeout(mut self, d: std::time::Duration) -> Self {
        self.timeouts = self.timeouts.with_execution(d);
        self
    }

    /// Checks the memo and search attributes with the store's rules.
    fn check(&self) -> Result<(), EngineError> {
        if let Some(e) = &self.encode_error {
            return Err(EngineError::Encode(e.clone()));
        }
        search::start_metadata(None, &self.search_attributes, &self.memo)?;
        Ok(())
    }
}

/// What `signal_with_start` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalWithStart {
    /// A new run started with the signal (or the same request had started
    /// it before).
    Started(RunId),
    /// The instance had an open run; it got the signal.
    Signalled,
}

/// What `start` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartOutcome {
    /// A new run started.
    Started(RunId),
    /// The instance already had an open run (or the same start, by command
    /// id, was done before); it is returned.
    Existing(RunId),
}

impl StartOutcome {
    /// The run, new or existing.
    pub fn run_id(self) -> RunId {
        match self {
            StartOutcome::Started(r) | StartOutcome::Existing(r) => r,
        }
    }
}

/// How long a client waits for the answer to a request it sent through
/// the relay (its shard runs in another engine process) before sending it
/// again: the owner may have died with the request, and the next owner
/// answers the copy.
pub const REMOTE_ANSWER_WAIT_MS: u64 = 5_000;

/// Who waits for the answer to a request.
enum Waiter {
    /// A call of this process.
    Local {
        tx: oneshot::Sender<Answer>,
        /// When it was relayed to another process, if it was.
        relayed_at: Option<Instant>,
        /// The local shard (and its generation) it went to.
        at: Option<(ShardId, u64)>,
    },
    /// A call of another process, relayed here to a local shard.
    Remote {
        from: String,
        id: RequestId,
        at: (ShardId, u64),
    },
}

/// What a caller hears when the shard its request went to stopped here:
/// ask again, and find the shard's next owner.
fn moved(shard: ShardId) -> Answer {
    Answer::Retry(format!("{shard} moved"))
}

/// A client's request on its way into a local shard's mailbox.
///
/// The client does not wait for the shard to take the request, only for
/// its answer: waiting for both woke the client's thread twice per
/// request, once from the middle of the shard's turn. What that wait
/// also caught, a mailbox dropping the request unhandled because its
/// shard stopped, this catches as it is dropped: the caller is told to
/// ask again, and finds the shard's next owner.
pub(crate) struct Asked {
    id: RequestId,
    /// Taken by the shard that handles it.
    request: Option<Request>,
    shard: ShardId,
    client: Weak<ClientCore>,
}

impl Asked {
    /// The request, for the shard that handles it.
    pub(crate) fn take(mut self) -> (RequestId, Request) {
        let request = self.request.take().expect("an asked request is taken once");
        (self.id, request)
    }
}

impl Drop for Asked {
    fn drop(&mut self) {
        if self.request.take().is_some() {
            if let Some(client) = self.client.upgrade() {
                client.answer(self.id, moved(self.shard));
            }
        }
    }
}

/// What clients share: the routes to the shards and the calls waiting for
/// their answer.
pub(crate) struct ClientCore {
    pub(crate) routes: Arc<Routes>,
    /// A shared store and the engine's store readers, for a list on a
    /// process that runs no shard; given up at shutdown (a client kept
    /// alive holds no connection, and the readers are joined).
    store: Mutex<Option<(Arc<dyn Store>, ReadQueue)>>,
    pending: Mutex<HashMap<RequestId, Waiter>>,
    next: AtomicU64,
    rng: Mutex<u64>,
    shutting_down: AtomicBool,
    /// Why the engine stopped, when its store failed for good.
    failed: OnceLock<String>,
    /// Ends retry pauses (see [`Pauses`]).
    pauses: Pauses,
}

/// One thread, started at the first pause, that ends every caller's retry
/// pause at its time: a caller may be on any executor, so it awaits a
/// channel rather than a runtime's timer. Not the engine's activity
/// runtime, whose workers activity code may block (a pause must end even
/// then), and not a thread per pause, which under overload grew with the
/// callers. Each call waits on at most one pause, so the queue holds at
/// most one entry per call in flight; the thread ends when the client
/// core is dropped.
#[derive(Default)]
struct Pauses {
    queue: OnceLock<crossbeam_channel::Sender<(Instant, oneshot::Sender<()>)>>,
}

impl Pauses {
    /// A channel answered once `pause` has passed (or at once, dropped, if
    /// the pause thread could not start).
    fn after(&self, pause: Duration) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let queue = self.queue.get_or_init(|| {
            let (queue, pending) = crossbeam_channel::unbounded();
            let _ = std::thread::Builder::new()
                .name("keel-pause".into())
                .spawn(move || end_pauses(pending));
            queue
        });
        let _ = queue.send((Instant::now() + pause, tx));
        rx
    }
}

/// The pause thread: answers each queued pause at its time, earliest first.
fn end_pauses(pending: crossbeam_channel::Receiver<(Instant, oneshot::Sender<()>)>) {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut due: BinaryHeap<Reverse<(Instant, u64)>> = BinaryHeap::new();
    let mut waiting: HashMap<u64, oneshot::Sender<()>> = HashMap::new();
    let mut next = 0u64;
    loop {
        let now = Instant::now();
        while let Some(Reverse((at, id))) = due.peek().copied() {
            if at > now {
                break;
            }
            due.pop();
            if let Some(tx) = waiting.remove(&id) {
                let _ = tx.send(());
            }
        }
        let got = match due.peek() {
            Some(Reverse((at, _))) => pending.recv_timeout(at.saturating_duration_since(now)),
            None => pending
                .recv()
                .map_err(|_| crossbeam_channel::RecvTimeoutError::Disconnected),
        };
        match got {
            Ok((at, tx)) => {
                next += 1;
                due.push(Reverse((at, next)));
                waiting.insert(next, tx);
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            // The client core is gone: nobody awaits what is left.
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        }
    }
}

impl ClientCore {
    pub(crate) fn new(
        seed: u64,
        routes: Arc<Routes>,
        store: Arc<dyn Store>,
        reads: ReadQueue,
    ) -> Self {
        let shared = store.shared().is_some();
        ClientCore {
            routes,
            store: Mutex::new(shared.then_some((store, reads))),
            pending: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            rng: Mutex::new(seed),
            shutting_down: AtomicBool::new(false),
            failed: OnceLock::new(),
            pauses: Pauses::default(),
        }
    }

    /// A shard answered request `id`.
    pub(crate) fn answer(&self, id: RequestId, answer: Answer) {
        let waiter = self.pending.lock().remove(&id);
        match waiter {
            Some(Waiter::Local { tx, .. }) => {
                let _ = tx.send(answer);
            }
            Some(Waiter::Remote { from, id, .. }) => {
                // This process stopping is no reason for the other's
                // call to fail: the shard's next owner answers it.
                let answer = match answer {
                    Answer::Refused(Refusal::Shutdown) => {
                        Answer::Retry("the engine process that ran the shard stopped".into())
                    }
                    other => other,
                };
                self.routes
                    .relay(RelayTo::Process(from), Wire::Answer { id, answer });
            }
            None => {}
        }
    }

    /// A request relayed from process `from`, where it has id `id`: the
    /// id it gets here, under which a shard answers it.
    pub(crate) fn relayed(&self, from: String, id: RequestId, at: (ShardId, u64)) -> RequestId {
        let mine = RequestId(self.next.fetch_add(1, Ordering::Relaxed) + 1);
        self.pending
            .lock()
            .insert(mine, Waiter::Remote { from, id, at });
        mine
    }

    /// Generation `generation` of `shard` stopped here: whoever still
    /// waits on it is told to ask again (the driver may have dropped a
    /// request it was still reading for), and finds the shard's next
    /// owner. A retried request is idempotent by its ids.
    pub(crate) fn shard_stopped(&self, shard: ShardId, generation: u64) {
        let at = Some((shard, generation));
        let waiting: Vec<RequestId> = self
            .pending
            .lock()
            .iter()
            .filter_map(|(id, w)| match w {
                Waiter::Local { at: a, .. } if *a == at => Some(*id),
                Waiter::Remote { at: a, .. } if Some(*a) == at => Some(*id),
                _ => None,
            })
            .collect();
        for id in waiting {
            self.answer(id, moved(shard));
        }
    }

    /// A list read from the store by the engine's store readers (a store
    /// read blocks), for a process with no shard to read it. Queued while
    /// the store is held here, so a list either is queued before shutdown
    /// gives the store up (and the readers, joined at shutdown, finish it)
    /// or finds it gone; with the readers' queue full it is asked again.
    async fn list_here(
        &self,
        filter: RunFilter,
        page_size: usize,
        after: Option<PageToken>,
    ) -> Answer {
        let (tx, rx) = oneshot::channel();
        {
            let held = self.store.lock();
            let Some((store, reads)) = held.as_ref() else {
                return Answer::Retry("no shard runs in this engine process".into());
            };
            let store = store.clone();
            let query = ReadQuery::List {
                filter,
                page_size,
                after,
            };
            let job = Box::new(move || {
                let _ = tx.send(list_answer(query.perform(&*store)));
            });
            if reads.try_submit(job).is_err() {
                // Not to the blocking pool, which shutdown does not wait
                // for: the list would keep the store open after it.
                return Answer::Retry("the store's readers are busy".into());
            }
        }
        rx.await
            .unwrap_or_else(|_| Answer::Retry("the index read stopped".into()))
    }

    /// Calls relayed to another process and unanswered for
    /// [`REMOTE_ANSWER_WAIT_MS`] are told to send again.
    pub(crate) fn expire_relayed(&self, now: Instant) {
        let wait = Duration::from_millis(REMOTE_ANSWER_WAIT_MS);
        let expired: Vec<RequestId> = self
            .pending
            .lock()
            .iter()
            .filter_map(|(id, w)| match w {
                Waiter::Local {
                    relayed_at: Some(at),
                    ..
                } if now.duration_since(*at) >= wait => Some(*id),
                _ => None,
            })
            .collect();
        for id in expired {
            self.answer(id, Answer::Retry(NO_ANSWER.to_string()));
        }
    }

    /// Whether the engine is stopping ([`ClientCore::shut_down`]).
    pub(crate) fn is_shut_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    /// The engine stops: every waiting call ends with a shutdown error
    /// (one relayed from another process is told to ask again: the next
    /// owner of its shard answers it).
    pub(crate) fn shut_down(&self) {
        self.shutting_down.store(true, Ordering::Release);
        self.store.lock().take();
        let waiting: Vec<_> = self.pending.lock().drain().collect();
        for (_, waiter) in waiting {
            match waiter {
                Waiter::Local { tx, .. } => {
                    let _ = tx.send(Answer::Refused(Refusal::Shutdown));
                }
                Waiter::Remote { from, id, .. } => {
                    let answer = Answer::Retry("the engine process stopped".into());
                    self.routes
                        .relay(RelayTo::Process(from), Wire::Answer { id, answer });
                }
            }
        }
    }

    /// The store failed for good: every waiting call and every later one
    /// ends with [`EngineError::StoreUnavailable`] naming the cause.
    pub(crate) fn fail(&self, why: String) {
        let _ = self.failed.set(why.clone());
        self.shutting_down.store(true, Ordering::Release);
        let waiting: Vec<_> = self.pending.lock().drain().collect();
        for (_, waiter) in waiting {
            if let Waiter::Local { tx, .. } = waiter {
                let _ = tx.send(Answer::Refused(Refusal::Unavailable(why.clone())));
            }
        }
    }

    /// The error a call gets once the engine stopped.
    fn stopped(&self) -> EngineError {
        match self.failed.get() {
            Some(why) => EngineError::StoreUnavailable(why.clone()),
            None => EngineError::Shutdown,
        }
    }

    /// Randomness for new runs (ids and seeds): drawn here, recorded in
    /// events, never drawn by the driver.
    fn random(&self) -> u64 {
        let mut s = self.rng.lock();
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Sends `request` to its shard and waits for the answer, following
    /// the run and retrying as the driver says, in a `request` span.
    async fn call(self: &Arc<Self>, request: Request) -> Result<Answer, EngineError> {
        use tracing::Instrument as _;
        let span = tracing::info_span!("request", kind = request.kind());
        self.call_following(request).instrument(span).await
    }

    async fn call_following(self: &Arc<Self>, request: Request) -> Result<Answer, EngineError> {
        let mut tries = 0;
        let mut follows = 0;
        loop {
            let answer = self.call_once(request.clone()).await?;
            match answer {
                // A signal, cancel or terminate for an instance can reach
                // its run just as that run continues as new (it resolved
                // the instance before the close): sent again, it resolves
                // to the next run (the driver answers "try again" until
                // that run exists). A run that closed for good is refused
                // again, and that answer stands.
                Answer::Refused(Refusal::RunClosed(_))
                    if follows < CONTINUE_AS_NEW_FOLLOWS_MAX && names_instance(&request) =>
                {
                    follows += 1;
                }
                // A relayed call nobody answered in time (its shard's
                // owner died with it, or the shard is between owners): sent
                // again, without counting against the retries, since a
                // long wait (a result) looks the same.
                Answer::Retry(why) if why == NO_ANSWER => {}
                Answer::Retry(why) => {
                    tries += 1;
                    if tries >= CLIENT_RETRIES_MAX {
                        return Err(EngineError::Unavailable(why));
                    }
                    // A short pause, awaited through a channel: the caller
                    // may be on any executor.
                    let pause = Duration::from_millis(5u64 << tries.min(6));
                    let _ = self.pauses.after(pause).await;
                }
                Answer::Refused(Refusal::Shutdown) => return Err(self.stopped()),
                other => return Ok(other),
            }
        }
    }

    async fn call_once(self: &Arc<Self>, request: Request) -> Result<Answer, EngineError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(self.stopped());
        }
        let id = RequestId(self.next.fetch_add(1, Ordering::Relaxed) + 1);
        let (tx, rx) = oneshot::channel();
        let shard = request.shard(self.routes.count());
        // A list reads the index every shard shares: any shard of this
        // process serves it.
        let local = match &request {
            Request::List { .. } => self.routes.any_local(),
            _ => self.routes.local_entry(shard),
        };
        match (local, &self.routes.relay) {
            (Some((at, local)), _) => {
                let addr = local.addr;
                self.pending.lock().insert(
                    id,
                    Waiter::Local {
                        tx,
                        relayed_at: None,
                        at: Some((at, local.generation)),
                    },
                );
                let ask = Ask(Asked {
                    id,
                    request: Some(request),
                    shard,
                    client: Arc::downgrade(self),
                });
                let sent = match addr.try_send(ask) {
                    Ok(()) => true,
                    // A full mailbox holds the call back until the shard
                    // has taken it (that send waits for the handling too).
                    Err(actix::prelude::SendError::Full(ask)) => addr.send(ask).await.is_ok(),
                    // Dropped here, the request answers a waiter removed
                    // below: the answer is this call's own.
                    Err(actix::prelude::SendError::Closed(_)) => false,
                };
                if !sent {
                    self.pending.lock().remove(&id);
                    if self.shutting_down.load(Ordering::Acquire) {
                        return Err(self.stopped());
                    }
                    // The shard stopped here (it moved to another process).
                    return Ok(moved(shard));
                }
            }
            (None, Some(link)) if !matches!(request, Request::List { .. }) => {
                self.pending.lock().insert(
                    id,
                    Waiter::Local {
                        tx,
                        relayed_at: Some(Instant::now()),
                        at: None,
                    },
                );
                let wire = Wire::Request {
                    from: link.name.clone(),
                    id,
                    request,
                };
                if !self.routes.relay(RelayTo::Shard(shard.0), wire) {
                    self.pending.lock().remove(&id);
                    return Ok(Answer::Retry(
                        "the relay to other engine processes is full".into(),
                    ));
                }
            }
            (None, _) => {
                if let Request::List {
                    filter,
                    page_size,
                    after,
                } = request
                {
                    // The index is shared: a process that runs no shard
                    // (yet, or any more) reads it itself.
                    return Ok(self.list_here(filter, page_size, after).await);
                }
                return Ok(Answer::Retry(format!(
                    "{shard} does not run in this engine process yet"
                )));
            }
        }
        // Shut down after the request was queued: nobody will answer it.
        if self.shutting_down.load(Ordering::Acquire) {
            self.pending.lock().remove(&id);
        }
        rx.await.map_err(|_| self.stopped())
    }
}

/// A cloneable handle for starting, signalling, awaiting and inspecting
/// workflows.
#[derive(Clone)]
pub struct Client {
    pub(crate) core: Arc<ClientCore>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Client")
    }
}

fn check_limits(p: &Payload) -> Result<(), EngineError> {
    if p.len() > PAYLOAD_BYTES_MAX {
        return Err(EngineError::PayloadTooLarge {
            bytes: p.len(),
            max: PAYLOAD_BYTES_MAX,
        });
    }
    // Refused here, to the sender, rather than written and then failing
    // to decode at every replay of the run.
    if p.nests_too_deep() {
        return Err(EngineError::PayloadTooDeep {
            max: keel_storage::BODY_NESTING_MAX,
        });
    }
    Ok(())
}

/// Encodes a payload a request carries, refused over the size and nesting
/// limits.
fn encode_checked<T: Serialize>(value: &T) -> Result<Payload, EngineError> {
    let p = Payload::encode(value).map_err(|e| EngineError::Encode(e.to_string()))?;
    check_limits(&p)?;
    Ok(p)
}

/// Decodes a value the engine returned (a result, a query's or an
/// update's value).
fn decode_value<R: DeserializeOwned>(p: &Payload) -> Result<R, EngineError> {
    p.decode()
        .map_err(|e| EngineError::ResultDecode(e.to_string()))
}

/// Workflow `W`'s output from a run's outcome (continue-as-new already
/// followed).
fn output_of<W: Workflow>(outcome: Outcome) -> Result<W::Output, EngineError> {
    match outcome {
        Outcome::Completed(p) => decode_value(&p),
        Outcome::Failed(f) => Err(EngineError::WorkflowFailed(f)),
        Outcome::Cancelled(r) => Err(EngineError::WorkflowCancelled(r)),
        Outcome::Terminated(r) => Err(EngineError::WorkflowTerminated(r)),
        Outcome::TimedOut(r) => Err(EngineError::WorkflowTimedOut(r)),
        Outcome::ContinuedAsNew(_) => unreachable!("continue-as-new is followed first"),
    }
}

/// The error for an answer no call expects.
fn unexpected(answer: Answer) -> EngineError {
    EngineError::Refused(format!("unexpected answer {answer:?}"))
}

fn refused(r: Refusal) -> EngineError {
    match r {
        Refusal::UnknownWorkflowType(t) => EngineError::UnknownWorkflowType(t),
        Refusal::InvalidInput {
            workflow_type,
            detail,
        } => EngineError::InvalidInput {
            workflow_type,
            detail,
        },
        Refusal::UnknownRun(id) => EngineError::UnknownInstance(id),
        Refusal::RunClosed(run) => EngineError::RunClosed { run },
        Refusal::AlreadyClosed {
            instance,
            run,
            status,
        } => EngineError::AlreadyClosed {
            instance,
            run,
            status,
        },
        Refusal::Parked { run, reason } => EngineError::Parked { run, reason },
        Refusal::NothingOpen { run, detail } => {
            EngineError::Refused(format!("run {run}: {detail}"))
        }
        Refusal::Store(detail) => EngineError::Refused(detail),
        Refusal::Shutdown => EngineError::Shutdown,
        Refusal::Unavailable(why) => EngineError::StoreUnavailable(why),
        Refusal::Handler(e) => EngineError::Handler(e),
        Refusal::BadFilter(why) => EngineError::BadFilter(why),
        Refusal::BadMessage(why) => EngineError::BadMessage(why),
        Refusal::StreamFull { run, detail } => EngineError::StreamFull { run, detail },
        r @ Refusal::UpdateInEarlierRun { .. } => EngineError::Refused(r.to_string()),
    }
}

impl Client {
    /// Starts workflow `W` as `instance`. A second start of an instance
    /// with an open run returns that run.
    pub async fn start<W: Workflow>(
        &self,
        instance: &str,
        input: &W::Input,
    ) -> Result<StartOutcome, EngineError> {
        let payload = Payload::encode(input).map_err(|e| EngineError::Encode(e.to_string()))?;
        self.start_raw(W::NAME, instance, payload, None, ReusePolicy::default())
            .await
    }

    /// Starts workflow `W` as `instance` with options: a command id, the
    /// reuse policy, memo and search attributes.
    pub async fn start_with<W: Workflow>(
        &self,
        instance: &str,
        input: &W::Input,
        options: StartOptions,
    ) -> Result<StartOutcome, EngineError> {
        let payload = Payload::encode(input).map_err(|e| EngineError::Encode(e.to_string()))?;
        self.start_raw_with(W::NAME, instance, payload, options)
            .await
    }

    /// Starts a workflow by type name with a serialized input. A retry with
    /// the same `command_id` is the same start, even after its run closed.
    pub async fn start_raw(
        &self,
        workflow_type: &str,
        instance: &str,
        input: Payload,
        command_id: Option<CommandId>,
        reuse: ReusePolicy,
    ) -> Result<StartOutcome, EngineError> {
        let options = StartOptions {
            command_id,
            reuse,
            ..StartOptions::default()
        };
        self.start_raw_with(workflow_type, instance, input, options)
            .await
    }

    /// [`Client::start_raw`] with [`StartOptions`].
    pub async fn start_raw_with(
        &self,
        workflow_type: &str,
        instance: &str,
        input: Payload,
        options: StartOptions,
    ) -> Result<StartOutcome, EngineError> {
        options.check()?;
        match self
            .start_request(workflow_type, instance, input, options, None, false)
            .await?
        {
            Answer::Started(run) => Ok(StartOutcome::Started(run)),
            Answer::Existing(run) => Ok(StartOutcome::Existing(run)),
            Answer::Refused(r) => Err(refused(r)),
            other => Err(unexpected(other)),
        }
    }

    /// Signal-with-start: sends the signal `name` to the instance's open
    /// run, or starts workflow `W` with `input` and commits the signal in
    /// the same commit as its start, so the workflow sees it from its
    /// first step. `command_id` deduplicates the signal (and the start):
    /// a retry neither starts a second run nor signals twice.
    pub async fn signal_with_start<W: Workflow, T: Serialize>(
        &self,
        instance: &str,
        input: &W::Input,
        name: &str,
        payload: &T,
        command_id: Option<&str>,
    ) -> Result<SignalWithStart, EngineError> {
        let input = Payload::encode(input).map_err(|e| EngineError::Encode(e.to_string()))?;
        let payload = encode_checked(payload)?;
        let signal = StartSignal {
            name: name.to_string(),
            payload,
            command_id: command_id.map(CommandId::new),
        };
        let options = StartOptions {
            command_id: command_id.map(|c| CommandId::new(format!("{c}/start"))),
            ..StartOptions::default()
        };
        match self
            .start_request(W::NAME, instance, input, options, Some(signal), false)
            .await?
        {
            Answer::Started(run) => Ok(SignalWithStart::Started(run)),
            // The start was done before (by command id): so was its signal.
            Answer::Existing(run) => Ok(SignalWithStart::Started(run)),
            Answer::Committed | Answer::Duplicate => Ok(SignalWithStart::Signalled),
            Answer::Refused(r) => Err(refused(r)),
            other => Err(unexpected(other)),
        }
    }

    async fn start_request(
        &self,
        workflow_type: &str,
        instance: &str,
        input: Payload,
        options: StartOptions,
        signal: Option<StartSignal>,
        await_outcome: bool,
    ) -> Result<Answer, EngineError> {
        check_limits(&input)?;
        // The run lives on the shard that resolves the instance's name, so
        // this start and later requests naming the instance meet there.
        let shards = self.core.routes.count();
        let home = keel_core::driver::shard_of_target(instance, shards);
        let request = Request::Start {
            run_id: keel_core::driver::run_id_on_shard(
                keel_core::driver::run_id_high(crate::engine::now().0, self.core.random()),
                self.core.random(),
                home,
                shards,
            ),
            workflow_type: workflow_type.to_string(),
            instance: InstanceId::new(instance),
            input,
            command_id: options.command_id,
            reuse: options.reuse,
            random_seed: self.core.random(),
            signal,
            memo: options.memo,
            search_attributes: options.search_attributes,
            timeouts: options.timeouts,
            await_outcome,
        };
        self.core.call(request).await
    }

    /// Sends a signal to the instance's current run (or a run by id);
    /// `command_id` deduplicates retries of the same signal.
    pub async fn signal<T: Serialize>(
        &self,
        instance: &str,
        name: &str,
        payload: &T,
        command_id: Option<&str>,
    ) -> Result<(), EngineError> {
        let payload = encode_checked(payload)?;
        let request = Request::Signal {
            target: instance.to_string(),
            name: name.to_string(),
            payload,
            command_id: command_id.map(CommandId::new),
        };
        self.done(request).await
    }

    /// Sends a message to the stream `stream` of the instance's current
    /// run (or a run by id). `key` is its idempotency key: a send repeated
    /// with the same key, before or after a restart or a continue-as-new,
    /// commits nothing and answers with the offset the first one got. The
    /// workflow reads the stream in offset order
    /// (`ctx.stream::<T>(stream).next().await`).
    pub async fn send_message<T: Serialize>(
        &self,
        instance: &str,
        stream: &str,
        key: &str,
        payload: &T,
    ) -> Result<MessageSent, EngineError> {
        let payload = encode_checked(payload)?;
        let request = Request::SendMessage {
            target: instance.to_string(),
            stream: stream.to_string(),
            key: keel_storage::MessageKey::new(key),
            payload,
        };
        match self.core.call(request).await? {
            Answer::Sent { offset, first } => Ok(MessageSent { offset, first }),
            Answer::Refused(r) => Err(refused(r)),
            other => Err(unexpected(other)),
        }
    }

    /// Requests cooperative cancellation; workflow code observes it. A
    /// closed run answers [`EngineError::RunClosed`]. The request carries
    /// a fresh command id, so this call's own retries are deduplicated;
    /// give one with [`Client::cancel_with`] to deduplicate yours.
    pub async fn cancel(&self, instance: &str, reason: &str) -> Result<(), EngineError> {
        let id = self.fresh_command_id("cancel");
        self.cancel_with(instance, reason, Some(&id)).await
    }

    /// A command id for a request the caller gave none.
    fn fresh_command_id(&self, what: &str) -> String {
        format!(
            "{what}-{:016x}{:016x}",
            self.core.random(),
            self.core.random()
        )
    }

    /// [`Client::cancel`] with a command id that deduplicates retries.
    pub async fn cancel_with(
        &self,
        instance: &str,
        reason: &str,
        command_id: Option<&str>,
    ) -> Result<(), EngineError> {
        let request = Request::Cancel {
            target: instance.to_string(),
            reason: reason.to_string(),
            command_id: command_id.map(CommandId::new),
        };
        self.done(request).await
    }

    /// Terminates the current run without running workflow code (a parked
    /// run too). A closed run answers [`EngineError::RunClosed`]. The
    /// request carries a fresh command id, so this call's own retries are
    /// deduplicated; give one with [`Client::terminate_with`] to
    /// deduplicate yours.
    pub async fn terminate(&self, instance: &str, reason: &str) -> Result<(), EngineError> {
        let id = self.fresh_command_id("terminate");
        self.terminate_with(instance, reason, Some(&id)).await
    }

    /// [`Client::terminate`] with a command id: a repeat, before or after a
    /// restart, answers `Ok` for the run it terminated (it is recorded in
    /// `WorkflowTerminated`) instead of `RunClosed`.
    pub async fn terminate_with(
        &self,
        instance: &str,
        reason: &str,
        command_id: Option<&str>,
    ) -> Result<(), EngineError> {
        let request = Request::Terminate {
            target: instance.to_string(),
            reason: reason.to_string(),
            command_id: command_id.map(CommandId::new),
        };
        self.done(request).await
    }

    async fn done(&self, request: Request) -> Result<(), EngineError> {
        match self.core.call(request).await? {
            Answer::Committed | Answer::Duplicate => Ok(()),
            Answer::Refused(r) => Err(refused(r)),
            other => Err(unexpected(other)),
        }
    }

    /// Waits for the instance's outcome, following continue-as-new.
    pub async fn outcome(&self, instance: &str) -> Result<Outcome, EngineError> {
        let mut target = instance.to_string();
        loop {
            let request = Request::Result {
                target: target.clone(),
            };
            match self.core.call(request).await? {
                Answer::Outcome(_, Outcome::ContinuedAsNew(next)) => target = next.to_string(),
                Answer::Outcome(_, other) => return Ok(other),
                Answer::Refused(r) => return Err(refused(r)),
                other => return Err(unexpected(other)),
            }
        }
    }

    /// Waits for workflow `W`'s result.
    pub async fn result<W: Workflow>(&self, instance: &str) -> Result<W::Output, EngineError> {
        output_of::<W>(self.outcome(instance).await?)
    }

    /// Starts workflow `W` as `instance` and waits for its result:
    /// [`Client::start`] then [`Client::result`], as one request with one
    /// answer. An instance with an open run is not started again: the
    /// call waits for that run, as `start` then `result` would.
    ///
    /// An error such as [`EngineError::Shutdown`] or
    /// [`EngineError::StoreUnavailable`] can come after the run started,
    /// and the run goes on. To retry without starting a second run once
    /// the first has closed, give the start a command id
    /// ([`Client::execute_with`], [`StartOptions::command_id`]): a retry
    /// then waits for the run that id started.
    pub async fn execute<W: Workflow>(
        &self,
        instance: &str,
        input: &W::Input,
    ) -> Result<W::Output, EngineError> {
        self.execute_with::<W>(instance, input, StartOptions::default())
            .await
    }

    /// [`Client::execute`] with [`StartOptions`].
    pub async fn execute_with<W: Workflow>(
        &self,
        instance: &str,
        input: &W::Input,
        options: StartOptions,
    ) -> Result<W::Output, EngineError> {
        options.check()?;
        let payload = Payload::encode(input).map_err(|e| EngineError::Encode(e.to_string()))?;
        let answer = self
            .start_request(W::NAME, instance, payload, options, None, true)
            .await?;
        let outcome = match answer {
            Answer::Outcome(_, Outcome::ContinuedAsNew(next)) => {
                self.outcome(&next.to_string()).await?
            }
            Answer::Outcome(_, other) => other,
            // The shard's process predates `await_outcome` and answered
            // the start alone: wait as `result` would.
            Answer::Started(run) | Answer::Existing(run) => self.outcome(&run.to_string()).await?,
            Answer::Refused(r) => return Err(refused(r)),
            other => return Err(unexpected(other)),
        };
        output_of::<W>(outcome)
    }

    /// Status, open waits with group paths, attempts and leases, children
    /// and parked reason of the instance's current run (or of a run by
    /// id). Only committed state: a run's commits in flight are answered
    /// first.
    pub async fn describe(&self, id: &str) -> Result<RunDescription, EngineError> {
        let request = Request::Describe {
            target: id.to_string(),
        };
        match self.core.call(request).await? {
            Answer::Described(d) => Ok(*d),
            Answer::Refused(r) => Err(refused(r)),
            other => Err(unexpected(other)),
        }
    }

    /// One page of the runs `filter` matches, newest first, at most
    /// `page_size` (up to `LIST_PAGE_RUNS_MAX`); pass the page's `next`
    /// token as `after` for the page that follows. Read through the index
    /// each commit writes (never by reading histories): a run is listed by
    /// a value once the commit that set it is durable.
    pub async fn list(
        &self,
        filter: &RunFilter,
        page_size: usize,
        after: Option<&PageToken>,
    ) -> Result<RunPage, EngineError> {
        filter
            .check()
            .map_err(|e| EngineError::BadFilter(e.to_string()))?;
        let request = Request::List {
            filter: filter.clone(),
            page_size,
            after: after.cloned(),
        };
        match self.core.call(request).await? {
            Answer::Listed(page) => Ok(page),
            Answer::Refused(r) => Err(refused(r)),
            other => Err(unexpected(other)),
        }
    }

    /// Asks the query `name` of the instance's current run (or a run by
    /// id, open or closed) and decodes its value. Answered from committed
    /// state only; writes nothing. A run not in memory is rebuilt from its
    /// history first.
    pub async fn query<A: Serialize, R: DeserializeOwned>(
        &self,
        instance: &str,
        name: &str,
        args: &A,
    ) -> Result<R, EngineError> {
        let args = encode_checked(args)?;
        let request = Request::Query {
            target: instance.to_string(),
            name: name.to_string(),
            args,
        };
        match self.core.call(request).await? {
            Answer::Queried(v) => decode_value(&v),
            Answer::Refused(r) => Err(refused(r)),
            other => Err(unexpected(other)),
        }
    }

    /// Sends the update `name` to the instance's current run (or a run by
    /// id) and waits for its outcome: the validator may refuse it
    /// ([`EngineError::Handler`], nothing written); once accepted its
    /// handler runs in the workflow and its value (or
    /// [`EngineError::UpdateFailed`]) is committed and returned.
    /// `update_id` deduplicates: repeating an update with the same id, even
    /// after a restart, returns the first outcome. Without one a fresh id
    /// is drawn, so only this call's own retries are deduplicated.
    pub async fn update<A: Serialize, R: DeserializeOwned>(
        &self,
        instance: &str,
        name: &str,
        args: &A,
        update_id: Option<&str>,
    ) -> Result<R, EngineError> {
        let args = encode_checked(args)?;
        let update_id = match update_id {
            Some(id) => CommandId::new(id),
            None => CommandId::new(self.fresh_command_id("update")),
        };
        let request = Request::Update {
            target: instance.to_string(),
            name: name.to_string(),
            args,
            update_id,
        };
        match self.core.call(request).await? {
            Answer::Updated(Ok(v)) => decode_value(&v),
            Answer::Updated(Err(f)) => Err(EngineError::UpdateFailed(f)),
            Answer::Refused(r) => Err(refused(r)),
            other => Err(unexpected(other)),
        }
    }

    /// Re-checks a parked run against the code registered now: if its
    /// history replays, the run goes on (its timers, attempts and messages
    /// are driven again); if not, it stays parked and the answer says why.
    pub async fn resume(&self, id: &str) -> Result<Resumed, EngineError> {
        let request = Request::Resume {
            target: id.to_string(),
        };
        match self.core.call(request).await? {
            Answer::Resumed(r) => Ok(r),
            Answer::Refused(r) => Err(refused(r)),
            other => Err(unexpected(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Goal: a process that runs no shard (it has just started, or gave
    //! its shards away) still lists the runs of the store it shares,
    //! instead of being told to ask again forever, and reads it on the
    //! engine's store readers, so nothing holds the store after shutdown.
    //! Method: a client core whose routes hold no local shard lists an
    //! empty shared store; it must get a page (no runs), not a retry; once
    //! it shut down and the readers are joined, the test holds the store's
    //! only reference.

    use super::*;
    use keel_storage::{Durability, MemStore};

    #[test]
    fn pauses_end_at_their_time_without_a_runtime() {
        // Goal: a retry pause ends, and no earlier than asked, for a caller
        // on no runtime at all, whatever order pauses were queued in.
        // Method: queue three pauses out of order, wait on each with a
        // plain executor, and time it; the short one must not wait for the
        // long one queued before it.
        let pauses = Pauses::default();
        let asked = Instant::now();
        let long = pauses.after(Duration::from_millis(1_000));
        let short = pauses.after(Duration::from_millis(10));
        let middle = pauses.after(Duration::from_millis(30));
        let mut ended = Vec::new();
        for (name, rx) in [("short", short), ("middle", middle), ("long", long)] {
            assert_eq!(futures::executor::block_on(rx), Ok(()), "{name}");
            ended.push((name, asked.elapsed()));
        }
        assert!(ended[0].1 >= Duration::from_millis(10), "{ended:?}");
        assert!(ended[0].1 < Duration::from_millis(1_000), "{ended:?}");
        assert!(ended[1].1 >= Duration::from_millis(30), "{ended:?}");
        assert!(ended[2].1 >= Duration::from_millis(1_000), "{ended:?}");
    }

    #[test]
    fn a_request_dropped_before_its_shard_took_it_is_asked_again() {
        // Goal: a client no longer waits for a shard to take its request,
        // so a request its mailbox drops unhandled (the shard stopped)
        // must still end its caller's wait, with "ask again"; a request
        // the shard took is answered by the shard alone.
        // Method: two waiters on one client core; the request of one is
        // dropped untaken, the other's is taken. The first waiter must
        // hear a retry naming the shard, the second nothing yet.
        let store: Arc<dyn Store> = Arc::new(MemStore::new(Durability::Sync));
        let overflow = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (reads, readers) = crate::readers::Readers::start(overflow.handle().clone()).unwrap();
        let routes = Arc::new(Routes::new(4, None));
        let core = Arc::new(ClientCore::new(1, routes, store, reads));
        let shard = ShardId(2);
        let ask = |id: u64| {
            let (tx, rx) = oneshot::channel();
            let waiter = Waiter::Local {
                tx,
                relayed_at: None,
                at: Some((shard, 1)),
            };
            core.pending.lock().insert(RequestId(id), waiter);
            let asked = Asked {
                id: RequestId(id),
                request: Some(Request::Describe {
                    target: format!("instance-{id}"),
                }),
                shard,
                client: Arc::downgrade(&core),
            };
            (asked, rx)
        };
        let (dropped, mut dropped_rx) = ask(1);
        let (taken, mut taken_rx) = ask(2);
        drop(dropped);
        let (id, request) = taken.take();
        assert_eq!(id, RequestId(2));
        assert!(matches!(request, Request::Describe { target } if target == "instance-2"));
        match dropped_rx.try_recv() {
            Ok(Some(Answer::Retry(why))) => assert!(why.contains(&shard.to_string()), "{why}"),
            other => panic!("a dropped request's caller heard {other:?}"),
        }
        assert!(
            matches!(taken_rx.try_recv(), Ok(None)),
            "a taken request was answered"
        );
        assert!(core.pending.lock().contains_key(&RequestId(2)));
        core.shut_down();
        readers.join();
    }

    #[test]
    fn a_process_without_shards_lists_the_shared_index() {
        let store: Arc<dyn Store> = Arc::new(MemStore::shared_by_processes(Durability::Sync));
        let routes = Arc::new(Routes::new(4, None));
        let overflow = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (reads, readers) = crate::readers::Readers::start(overflow.handle().clone()).unwrap();
        let core = Arc::new(ClientCore::new(1, routes, store.clone(), reads));
        let request = Request::List {
            filter: RunFilter::default(),
            page_size: 10,
            after: None,
        };
        match futures::executor::block_on(core.call_once(request)) {
            Ok(Answer::Listed(page)) => {
                assert!(page.runs.is_empty() && page.next.is_none());
            }
            other => panic!("a list without a local shard answered {other:?}"),
        }
        core.shut_down();
        readers.join();
        assert_eq!(
            Arc::strong_count(&store),
            1,
            "something still holds the store after shutdown"
        );
    }

    // Goal: a client is refused a payload nested deeper than any decoder
    // follows, before anything is sent or written (it would fail to decode
    // at every replay of the run). Method: a recursive enum one level
    // within the limit and one past it.
    #[test]
    fn a_payload_nested_past_the_limit_is_refused_before_it_is_sent() {
        #[derive(serde::Serialize)]
        enum Expr {
            Lit(u8),
            Neg(Box<Expr>),
        }
        let nest = |levels: usize| {
            let mut e = Expr::Lit(1);
            for _ in 0..levels {
                e = Expr::Neg(Box::new(e));
            }
            e
        };
        let max = keel_storage::BODY_NESTING_MAX;
        assert!(encode_checked(&nest(max as usize - 1)).is_ok());
        assert!(matches!(
            encode_checked(&nest(max as usize)),
            Err(EngineError::PayloadTooDeep { max: m }) if m == max
        ));
    }
}
