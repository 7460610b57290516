//! The `Store` trait: one atomic commit path and typed reads over it.
//!
//! The trait is the seam for other backends (DESIGN section 9): it speaks in
//! events, runs and derived records, never in RocksDB types. Typed reads are
//! provided methods written once over [`KvRead`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;

use crate::codec::{self, RecordKind};
use crate::derive::{read_record, CommitAck, CommitBatch};
use crate::error::{Error, Result};
use crate::event::{DurableKey, Event, EventKind};
use crate::ids::{InstanceId, RunId, Seq, Step, Timestamp};
use crate::keys::{self, Cf};
use crate::kv::KvRead;
use crate::search::{self, ListError, PageToken, RunFilter, RunPage};
use crate::state::{
    DedupeEntry, InstanceMeta, OutboxMessage, ParkInfo, RunMeta, RunStatus, TaskEntry, TimerEntry,
};
use crate::verify::{self, VerifyReport};

/// How a commit is made durable before it is acknowledged.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Durability {
    /// Fsync before acknowledging: survives power loss. Group commit shares
    /// one fsync among every commit waiting at that moment.
    #[default]
    Sync,
    /// Write the WAL without fsync: survives a process crash, not power loss.
    Buffered,
}

/// The answer to one commit: a future, a blocking [`CommitHandle::wait`],
/// or a function called with it ([`CommitHandle::then`]).
#[derive(Debug)]
pub struct CommitHandle {
    state: HandleState,
}

#[derive(Debug)]
enum HandleState {
    Ready(Option<Result<CommitAck>>),
    Pending(Arc<AnswerSlot>),
}

/// What a committer does with an answer that has not come yet.
type Then = Box<dyn FnOnce(Result<CommitAck>) + Send>;

/// Where one commit's answer meets its committer: a one-shot channel that
/// either wakes a polling task or calls the function the committer left.
struct AnswerSlot {
    state: Mutex<SlotState>,
}

enum SlotState {
    /// Not answered; the task to wake when it is, if one polled.
    Waiting(Option<Waker>),
    /// Not answered; the function to call with the answer.
    Then(Then),
    /// Answered, not yet taken.
    Answered(Result<CommitAck>),
    /// Taken, or the handle was dropped.
    Done,
}

impl std::fmt::Debug for AnswerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &*self.state.lock() {
            SlotState::Waiting(_) => "waiting",
            SlotState::Then(_) => "then",
            SlotState::Answered(_) => "answered",
            SlotState::Done => "done",
        };
        f.debug_struct("AnswerSlot").field("state", &state).finish()
    }
}

/// Wake-ups deferred to the end of the group being answered on this
/// thread ([`answering`], [`after_answers`]).
type Deferred = Vec<Box<dyn FnOnce()>>;

thread_local! {
    /// While this thread answers a group of commits: what the answers'
    /// [`CommitHandle::then`] functions left to do once all are answered.
    static DEFERRED: std::cell::RefCell<Option<Deferred>> = const { std::cell::RefCell::new(None) };
}

/// Answers a group of commits: runs `answer_all`, which sends each
/// [`Reply`], then what their [`CommitHandle::then`] functions deferred
/// with [`after_answers`].
///
/// Why: waking a committer's thread from inside the group lets it preempt
/// the answering thread on a busy machine, take the one answer there is,
/// sleep, and be woken again by the next: on W1 with two cores the answer
/// thread was preempted by a shard about once every four answers, 26,000
/// times per 30,000 workflows (BENCHMARKS.md). Deferred, a committer with
/// many answers in the group is woken once, after the last.
pub fn answering(answer_all: impl FnOnce()) {
    /// Puts back what was there before (an answer inside an answer:
    /// a `then` function that commits in place), also on a panic, and
    /// runs what was deferred.
    struct Restore(Option<Deferred>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            let deferred = DEFERRED
                .try_with(|d| std::mem::replace(&mut *d.borrow_mut(), outer))
                .ok()
                .flatten();
            // Every wake-up runs even if one panics (a consumer left
            // unwoken would wait for good); the first panic goes on after.
            let mut panicked = None;
            for wake in deferred.into_iter().flatten() {
                if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(wake)) {
                    panicked.get_or_insert(p);
                }
            }
            if let Some(p) = panicked.filter(|_| !std::thread::panicking()) {
                std::panic::resume_unwind(p);
            }
        }
    }
    let outer = DEFERRED
        .try_with(|d| d.borrow_mut().replace(Vec::new()))
        .ok()
        .flatten();
    let _restore = Restore(outer);
    answer_all();
}

/// Runs `wake` once the group of commits being answered on this thread is
/// answered ([`answering`]), or at once outside one (or while the thread
/// ends). For a [`CommitHandle::then`] function that gathers answers and
/// wakes their consumer once per group; `wake` should not panic.
pub fn after_answers(wake: impl FnOnce() + 'static) {
    let mut wake: Option<Box<dyn FnOnce()>> = Some(Box::new(wake));
    let _ = DEFERRED.try_with(|d| {
        if let Some(deferred) = d.borrow_mut().as_mut() {
            deferred.extend(wake.take());
        }
    });
    if let Some(wake) = wake {
        wake();
    }
}

/// The store's end of a [`CommitHandle`]: answers it once. Dropped without
/// an answer (a writer that stopped), it answers [`Error::Closed`].
#[derive(Debug)]
pub struct Reply(Option<Arc<AnswerSlot>>);

impl Reply {
    /// Answers the commit: wakes the task polling its handle, or calls the
    /// function given to [`CommitHandle::then`] on this thread.
    pub fn send(mut self, result: Result<CommitAck>) {
        self.deliver(result);
    }

    fn deliver(&mut self, result: Result<CommitAck>) {
        let Some(slot) = self.0.take() else {
            return;
        };
        let mut state = slot.state.lock();
        match std::mem::replace(&mut *state, SlotState::Done) {
            SlotState::Waiting(waker) => {
                *state = SlotState::Answered(result);
                drop(state);
                if let Some(w) = waker {
                    w.wake();
                }
            }
            SlotState::Then(then) => {
                drop(state);
                then(result);
            }
            // The handle is gone: nobody waits for the answer.
            SlotState::Done => {}
            SlotState::Answered(_) => unreachable!("a commit is answered once"),
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        self.deliver(Err(Error::Closed));
    }
}

impl CommitHandle {
    /// A handle that is already answered.
    pub fn ready(result: Result<CommitAck>) -> Self {
        CommitHandle {
            state: HandleState::Ready(Some(result)),
        }
    }

    /// A handle answered later through its [`Reply`].
    pub fn channel() -> (Reply, CommitHandle) {
        let slot = Arc::new(AnswerSlot {
            state: Mutex::new(SlotState::Waiting(None)),
        });
        let handle = CommitHandle {
            state: HandleState::Pending(slot.clone()),
        };
        (Reply(Some(slot)), handle)
    }

    /// Calls `then` with the answer: now, on this thread, if it is here;
    /// otherwise on the thread that answers, which must not be kept long.
    ///
    /// For a committer that would otherwise poll many handles at once: an
    /// actix actor polls every future it spawned each time it wakes, so a
    /// shard with a hundred commits in flight polled a hundred handles per
    /// message; with `then` the answer comes as a message of its own.
    pub fn then(mut self, then: impl FnOnce(Result<CommitAck>) + Send + 'static) {
        match self.take_state() {
            HandleState::Ready(r) => then(r.unwrap_or(Err(Error::Closed))),
            HandleState::Pending(slot) => {
                let mut state = slot.state.lock();
                match std::mem::replace(&mut *state, SlotState::Done) {
                    SlotState::Answered(r) => {
                        drop(state);
                        then(r);
                    }
                    SlotState::Waiting(_) => *state = SlotState::Then(Box::new(then)),
                    SlotState::Done => {
                        drop(state);
                        then(Err(Error::Closed));
                    }
                    SlotState::Then(_) => unreachable!("`then` consumes its handle"),
                }
            }
        }
    }

    /// Blocks the calling thread until the commit is answered. Do not call
    /// from inside an async task; `.await` the handle there.
    pub fn wait(mut self) -> Result<CommitAck> {
        match self.take_state() {
            HandleState::Ready(r) => r.unwrap_or(Err(Error::Closed)),
            pending => futures::executor::block_on(CommitHandle { state: pending }),
        }
    }

    /// The state, leaving one that `Drop` ignores.
    fn take_state(&mut self) -> HandleState {
        std::mem::replace(&mut self.state, HandleState::Ready(None))
    }
}

impl Future for CommitHandle {
    type Output = Result<CommitAck>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            HandleState::Ready(r) => Poll::Ready(r.take().unwrap_or(Err(Error::Closed))),
            HandleState::Pending(slot) => {
                let mut state = slot.state.lock();
                match &mut *state {
                    SlotState::Waiting(waker) => {
                        match waker {
                            Some(w) if w.will_wake(cx.waker()) => {}
                            _ => *waker = Some(cx.waker().clone()),
                        }
                        Poll::Pending
                    }
                    SlotState::Answered(_) => match std::mem::replace(&mut *state, SlotState::Done)
                    {
                        SlotState::Answered(r) => Poll::Ready(r),
                        _ => unreachable!(),
                    },
                    SlotState::Done => Poll::Ready(Err(Error::Closed)),
                    SlotState::Then(_) => unreachable!("`then` consumes its handle"),
                }
            }
        }
    }
}

impl Drop for CommitHandle {
    fn drop(&mut self) {
        if let HandleState::Pending(slot) = &self.state {
            let mut state = slot.state.lock();
            // Leave a function given to `then` for the answer; drop a waker
            // or an answer nobody will take.
            if !matches!(*state, SlotState::Then(_)) {
                *state = SlotState::Done;
            }
        }
    }
}

/// A keel store: one atomic commit path plus reads.
pub trait Store: Send + Sync + 'static {
    /// The byte-level view all typed reads go through.
    fn view(&self) -> &dyn KvRead;

    /// Validates and commits a batch atomically. The handle resolves once
    /// the batch is durable per the store's [`Durability`], or with the
    /// typed reason nothing was written.
    fn commit(&self, batch: CommitBatch) -> CommitHandle;

    /// [`Store::commit`] for a committer that has nothing else in flight:
    /// waiting for this commit is all it would do, so the store may write
    /// the batch on the calling thread and answer before returning, which
    /// saves handing it to a writer thread and being woken by the answer.
    /// A committer with more commits to make soon calls [`Store::commit`]:
    /// queued, they share a group and its sync, while a committer that
    /// wrote each one itself would find the writer idle every time and
    /// sync them one by one. By default the same as `commit`.
    fn commit_alone(&self, batch: CommitBatch) -> CommitHandle {
        self.commit(batch)
    }

    /// Makes everything committed so far durable (fsyncs the WAL).
    fn sync(&self) -> Result<()>;

    /// Moves what the write-ahead log holds into the store's tables, so
    /// the next open has no log to replay: an engine's clean shutdown
    /// calls it last, which makes its restart over a large store read
    /// table files instead of up to a memtable budget of log. A no-op
    /// where there is no such log.
    fn flush_log(&self) -> Result<()> {
        Ok(())
    }

    /// The durability mode commits are acknowledged under.
    fn durability(&self) -> Durability;

    /// Whether the store accepts writes now (see [`crate::health`]).
    fn health(&self) -> crate::health::StoreHealth {
        crate::health::StoreHealth::Healthy
    }

    /// What the store offers engine processes sharing it (shard leases
    /// and the relay), when it is opened to be shared; `None` when one
    /// process writes alone.
    fn shared(&self) -> Option<&dyn crate::relay::SharedStore> {
        None
    }

    /// What the store holds in memory for buffering and caching, by part,
    /// where the backend can tell.
    fn memory(&self) -> Option<crate::stats::StoreMemory> {
        None
    }

    /// What the store's writer counted (groups, their sizes, write and
    /// sync time), where the backend has a writer that counts.
    fn writer_stats(&self) -> Option<crate::stats::WriterSnapshot> {
        None
    }

    /// A run's whole history.
    fn history(&self, run: RunId) -> Result<Vec<Event>> {
        self.history_from(run, Seq::FIRST)
    }

    /// A run's history from `from` on.
    fn history_from(&self, run: RunId, from: Seq) -> Result<Vec<Event>> {
        let mut out = Vec::new();
        self.for_each_event(run, from, &mut |e| {
            out.push(e);
            true
        })?;
        Ok(out)
    }

    /// Streams a run's history from `from`, stopping when `visit` returns
    /// false or at the first record that does not decode (returned as
    /// [`Error::Corrupt`] naming the run and seq).
    fn for_each_event(
        &self,
        run: RunId,
        from: Seq,
        visit: &mut dyn FnMut(Event) -> bool,
    ) -> Result<()> {
        each_event(self.view(), run, from, Pass::Cached, visit)
    }

    /// [`Store::for_each_event`] for a pass that keeps nothing it reads
    /// ([`KvRead::scan_once`]): describing a run streams its whole history
    /// once, and a history of a million events must not fill the block
    /// cache on its way.
    fn for_each_event_once(
        &self,
        run: RunId,
        from: Seq,
        visit: &mut dyn FnMut(Event) -> bool,
    ) -> Result<()> {
        each_event(self.view(), run, from, Pass::Once, visit)
    }

    /// The whole histories of `runs`, one after another in the order
    /// given: `visit(i, read)` is called once for every index of `runs`,
    /// in order, with the run's events (none for a run the store does not
    /// have) and the error that ended its read early, if one did
    /// ([`Error::Corrupt`] naming the run and seq of a record that does not
    /// decode; the events are those before it). `visit` may read the store.
    /// The RocksDB store reads them all through one cursor
    /// ([`histories_through_one_cursor`]), so runs given in key order are
    /// read as one pass over the events (an offline replay).
    fn for_each_history(&self, runs: &[RunId], visit: &mut dyn FnMut(usize, ReadHistory)) {
        for (i, run) in runs.iter().enumerate() {
            let mut events = Vec::new();
            let failure = self
                .for_each_event(*run, Seq::FIRST, &mut |e| {
                    events.push(e);
                    true
                })
                .err();
            visit(i, ReadHistory { events, failure });
        }
    }

    /// A run's derived metadata.
    fn run_meta(&self, run: RunId) -> Result<Option<RunMeta>> {
        let view = self.view();
        let mut meta: Option<RunMeta> =
            read_record(view, Cf::Runs, RecordKind::Run, &keys::run_key(run))?;
        if let Some(m) = meta.as_mut() {
            crate::derive::current_run(view, run, m)?;
        }
        Ok(meta)
    }

    /// An instance's current run.
    fn instance(&self, instance: &InstanceId) -> Result<Option<InstanceMeta>> {
        read_record(
            self.view(),
            Cf::Instances,
            RecordKind::Instance,
            instance.as_str().as_bytes(),
        )
    }

    /// Resolves text that is either a run id or an instance id to a run.
    fn resolve(&self, id: &str) -> Result<Option<RunId>> {
        if let Some(run) = RunId::parse(id) {
            if self.run_meta(run)?.is_some() {
                return Ok(Some(run));
            }
        }
        Ok(self.instance(&InstanceId::new(id))?.map(|i| i.current_run))
    }

    /// Where the terminal event of a durable id is, if it has one.
    fn committed(&self, run: RunId, key: &DurableKey) -> Result<Option<Seq>> {
        let row = |key: &DurableKey| -> Result<Option<Seq>> {
            let entry: Option<DedupeEntry> = read_record(
                self.view(),
                Cf::Dedupe,
                RecordKind::Dedupe,
                &keys::dedupe_key(run, key),
            )?;
            Ok(entry.map(|e| e.seq))
        };
        if let Some(seq) = row(key)? {
            return Ok(Some(seq));
        }
        // An attempt whose result closed its execution has no row of its
        // own: the execution's row points at that result.
        let DurableKey::Attempt(step, attempt) = key else {
            return Ok(None);
        };
        let Some(seq) = row(&DurableKey::Execution(*step))? else {
            return Ok(None);
        };
        let Some(bytes) = self.view().get(Cf::Events, &keys::event_key(run, seq))? else {
            return Ok(None);
        };
        let event: Event =
            codec::decode(RecordKind::Event, &bytes).map_err(|source| Error::Corrupt {
                cf: "events",
                run: Some(run),
                seq: Some(seq),
                source,
            })?;
        let by_attempt = match &event.kind {
            EventKind::ActivityCompleted { attempt_id, .. }
            | EventKind::ActivityAttemptFailed { attempt_id, .. } => attempt_id.attempt == *attempt,
            _ => false,
        };
        Ok(by_attempt.then_some(seq))
    }

    /// Timers due at or before `now`, in due order, at most `limit`.
    fn due_timers(&self, now: Timestamp, limit: usize) -> Result<Vec<TimerEntry>> {
        let mut out = Vec::new();
        let mut failure = None;
        self.view().scan(Cf::Timers, &[], &[], &mut |k, v| {
            if out.len() >= limit
                || k.len() < 8
                || u64::from_be_bytes(k[..8].try_into().unwrap_or([0xff; 8])) > now.0
            {
                return false;
            }
            match codec::decode(RecordKind::Timer, v) {
                Ok(t) => {
                    out.push(t);
                    true
                }
                Err(source) => {
                    failure = Some(corrupt(Cf::Timers, k, source));
                    false
                }
            }
        })?;
        failure.map_or(Ok(out), Err)
    }

    /// Timers in due order (due time, run, step) after `after` (from the
    /// first without it) that `keep` accepts, at most `limit`: a window of
    /// the timers a shard holds in memory.
    fn timers_after(
        &self,
        after: Option<(Timestamp, RunId, Step)>,
        limit: usize,
        keep: &mut dyn FnMut(&TimerEntry) -> bool,
    ) -> Result<Vec<TimerEntry>> {
        let from = after.map_or_else(Vec::new, |(due, run, step)| {
            let mut k = keys::timer_key(due, run, step);
            k.push(0);
            k
        });
        let mut out = Vec::new();
        let mut failure = None;
        self.view().scan(
            Cf::Timers,
            &[],
            &from,
            &mut |k, v| match codec::decode::<TimerEntry>(RecordKind::Timer, v) {
                Ok(t) => {
                    if keep(&t) {
                        out.push(t);
                    }
                    out.len() < limit
                }
                Err(source) => {
                    failure = Some(corrupt(Cf::Timers, k, source));
                    false
                }
            },
        )?;
        failure.map_or(Ok(out), Err)
    }

    /// The earliest timer's due time.
    fn next_timer(&self) -> Result<Option<Timestamp>> {
        let mut due = None;
        self.view().scan(Cf::Timers, &[], &[], &mut |k, _| {
            due = k
                .get(..8)
                .map(|b| Timestamp(u64::from_be_bytes(b.try_into().unwrap_or([0; 8]))));
            false
        })?;
        Ok(due)
    }

    /// A run's open timers.
    fn run_timers(&self, run: RunId) -> Result<Vec<TimerEntry>> {
        scan_typed(
            self.view(),
            Cf::RunTimers,
            RecordKind::Timer,
            run.as_bytes(),
            usize::MAX,
        )
    }

    /// Outbox messages waiting for delivery, at most `limit`.
    fn outbox(&self, limit: usize) -> Result<Vec<OutboxMessage>> {
        scan_typed(self.view(), Cf::Outbox, RecordKind::Outbox, &[], limit)
    }

    /// The outbox message under `key`, if it is waiting for delivery.
    fn outbox_row(&self, key: &[u8]) -> Result<Option<OutboxMessage>> {
        crate::derive::read_record(self.view(), Cf::Outbox, RecordKind::Outbox, key)
    }

    /// Pending activity attempts of every run, at most `limit`.
    fn tasks(&self, limit: usize) -> Result<Vec<TaskEntry>> {
        scan_typed(self.view(), Cf::Tasks, RecordKind::Task, &[], limit)
    }

    /// Pending activity attempts in the store's order (run, step), from
    /// the first whose key follows `after` (from the first without it),
    /// that `keep` accepts, at most `limit`: a window of the attempts a
    /// shard holds in memory. Rows `keep` refuses are read past, not
    /// counted.
    fn tasks_after(
        &self,
        after: Option<&[u8]>,
        limit: usize,
        keep: &mut dyn FnMut(&TaskEntry) -> bool,
    ) -> Result<Vec<TaskEntry>> {
        scan_after(self.view(), Cf::Tasks, RecordKind::Task, after, limit, keep)
    }

    /// Outbox messages in the store's order, from the first whose key
    /// follows `after`, that `keep` accepts, at most `limit` (see
    /// [`Store::tasks_after`]).
    fn outbox_after(
        &self,
        after: Option<&[u8]>,
        limit: usize,
        keep: &mut dyn FnMut(&OutboxMessage) -> bool,
    ) -> Result<Vec<OutboxMessage>> {
        scan_after(
            self.view(),
            Cf::Outbox,
            RecordKind::Outbox,
            after,
            limit,
            keep,
        )
    }

    /// The pending attempt of the execution at `step`, if it is open.
    fn task(&self, run: RunId, step: crate::ids::Step) -> Result<Option<TaskEntry>> {
        read_record(
            self.view(),
            Cf::Tasks,
            RecordKind::Task,
            &keys::run_step_key(run, step),
        )
    }

    /// Pending activity attempts of one run.
    fn run_tasks(&self, run: RunId) -> Result<Vec<TaskEntry>> {
        scan_typed(
            self.view(),
            Cf::Tasks,
            RecordKind::Task,
            run.as_bytes(),
            usize::MAX,
        )
    }

    /// One page of the runs `filter` matches, newest first within the
    /// index it uses, at most `page_size`; `after` is the token the page
    /// before handed out. Read through the index the commits write, never
    /// by reading histories (see [`crate::search`]).
    fn list(
        &self,
        filter: &RunFilter,
        page_size: usize,
        after: Option<&PageToken>,
    ) -> std::result::Result<RunPage, ListError> {
        search::list(self.view(), filter, page_size, after)
    }

    /// Every run `filter` matches, up to its `limit`, page by page.
    fn runs(&self, filter: &RunFilter) -> Result<Vec<RunMeta>> {
        let limit = filter.limit.unwrap_or(usize::MAX);
        let mut out = Vec::new();
        let mut after = None;
        while out.len() < limit {
            let want = (limit - out.len()).min(search::LIST_PAGE_RUNS_MAX);
            let page = match self.list(filter, want, after.as_ref()) {
                Ok(page) => page,
                Err(ListError::Store(e)) => return Err(e),
                Err(e) => {
                    return Err(Error::InvalidFilter(e.to_string()));
                }
            };
            out.extend(page.runs);
            match page.next {
                Some(t) => after = Some(t),
                None => break,
            }
        }
        out.truncate(limit);
        Ok(out)
    }

    /// Why a run is parked, if it is.
    fn parked(&self, run: RunId) -> Result<Option<ParkInfo>> {
        read_record(
            self.view(),
            Cf::Meta,
            RecordKind::Parked,
            &keys::parked_key(run),
        )
    }

    /// Runs in each status, counting at most `limit` per status (a count
    /// equal to `limit` reads "at least").
    fn count_by_status(&self, limit: usize) -> Result<Vec<(RunStatus, usize)>> {
        crate::search::count_by_status(self.view(), limit)
    }

    /// Runs in `status`, counting at most `limit` (a count equal to
    /// `limit` reads "at least").
    fn count_status(&self, status: RunStatus, limit: usize) -> Result<usize> {
        crate::search::count_status(self.view(), status, limit)
    }

    /// How many runs are parked, counting at most `limit` (a bounded
    /// scan of the park markers: a number past it reads "at least").
    fn parked_count(&self, limit: usize) -> Result<usize> {
        let mut n = 0;
        self.view().scan(
            Cf::Meta,
            keys::PARKED_PREFIX,
            keys::PARKED_PREFIX,
            &mut |_, _| {
                n += 1;
                n < limit
            },
        )?;
        Ok(n)
    }

    /// Walks every run and reports gaps, bad records, duplicate terminal
    /// events and derived state that disagrees with the events. Never panics
    /// on bad bytes.
    fn verify(&self) -> Result<VerifyReport> {
        verify::verify(self.view())
    }
}

fn corrupt(cf: Cf, key: &[u8], source: codec::Error) -> Error {
    Error::Corrupt {
        cf: cf.name(),
        run: keys::run_prefix(key),
        seq: None,
        source,
    }
}

/// Records of `cf` in key order after the key `after`, those `keep`
/// accepts, at most `limit`.
fn scan_after<T: serde::de::DeserializeOwned>(
    view: &dyn KvRead,
    cf: Cf,
    kind: RecordKind,
    after: Option<&[u8]>,
    limit: usize,
    keep: &mut dyn FnMut(&T) -> bool,
) -> Result<Vec<T>> {
    let from = after.map_or_else(Vec::new, |k| {
        let mut k = k.to_vec();
        k.push(0);
        k
    });
    let mut out = Vec::new();
    let mut failure = None;
    if limit == 0 {
        return Ok(out);
    }
    view.scan(
        cf,
        &[],
        &from,
        &mut |k, v| match codec::decode::<T>(kind, v) {
            Ok(t) => {
                if keep(&t) {
                    out.push(t);
                }
                out.len() < limit
            }
            Err(source) => {
                failure = Some(corrupt(cf, k, source));
                false
            }
        },
    )?;
    failure.map_or(Ok(out), Err)
}

fn scan_typed<T: serde::de::DeserializeOwned>(
    view: &dyn KvRead,
    cf: Cf,
    kind: RecordKind,
    prefix: &[u8],
    limit: usize,
) -> Result<Vec<T>> {
    let mut out = Vec::new();
    let mut failure = None;
    view.scan(cf, prefix, prefix, &mut |k, v| {
        if out.len() >= limit {
            return false;
        }
        match codec::decode(kind, v) {
            Ok(t) => {
                out.push(t);
                true
            }
            Err(source) => {
                failure = Some(corrupt(cf, k, source));
                false
            }
        }
    })?;
    failure.map_or(Ok(out), Err)
}

/// How [`each_event`] reads: through the store's cache, or once
/// ([`KvRead::scan_once`]).
#[derive(Clone, Copy)]
enum Pass {
    Cached,
    Once,
}

/// The events of `run` from `from` in `view`, decoded, each given to
/// `visit` until it returns false; a record that does not decode ends the
/// read with its error.
fn each_event(
    view: &dyn KvRead,
    run: RunId,
    from: Seq,
    pass: Pass,
    visit: &mut dyn FnMut(Event) -> bool,
) -> Result<()> {
    let mut failure = None;
    let mut rows = |k: &[u8], v: &[u8]| match decode_event(run, k, v) {
        Ok(e) => visit(e),
        Err(e) => {
            failure = Some(e);
            false
        }
    };
    let start = keys::event_key(run, from);
    match pass {
        Pass::Cached => view.scan(Cf::Events, run.as_bytes(), &start, &mut rows)?,
        Pass::Once => view.scan_once(Cf::Events, run.as_bytes(), &start, &mut rows)?,
    }
    failure.map_or(Ok(()), Err)
}

/// One record of the events family, decoded; a record that does not decode
/// is [`Error::Corrupt`], naming its run and seq.
fn decode_event(run: RunId, key: &[u8], value: &[u8]) -> Result<Event> {
    codec::decode::<Event>(RecordKind::Event, value).map_err(|source| Error::Corrupt {
        cf: "events",
        run: Some(run),
        seq: keys::parse_event_key(key).map(|(_, s)| s),
        source,
    })
}

/// Most events a history's vector is sized for before its first event is
/// read (from the length of the history read before it).
const HISTORY_READ_AHEAD_EVENTS_MAX: usize = 4096;

/// [`Store::for_each_history`] through [`KvRead::scan_prefixes`]: one
/// cursor where the view has one. `visit` is called from inside the scan,
/// so a view that holds a lock while it scans (the in-memory store) must
/// not use this: `visit` may read the store.
pub(crate) fn histories_through_one_cursor(
    view: &dyn KvRead,
    runs: &[RunId],
    visit: &mut dyn FnMut(usize, ReadHistory),
) {
    let prefixes: Vec<Vec<u8>> = runs.iter().map(|r| r.as_bytes().to_vec()).collect();
    // The run being read, and how many runs were handed over before it.
    let mut reading: Option<(usize, ReadHistory)> = None;
    let mut handed = 0;
    // The last history's length: the next one's vector starts that large
    // (the runs of one read are often alike), instead of growing from
    // empty and copying its events at every doubling.
    let last_len = std::cell::Cell::new(0);
    let mut hand_over_until =
        |end: usize, reading: &mut Option<(usize, ReadHistory)>, handed: &mut usize| {
            if let Some((i, mut read)) = reading.take() {
                last_len.set(read.events.len());
                // Not handed over much larger than it is.
                if read.events.capacity() > 2 * read.events.len() {
                    read.events.shrink_to_fit();
                }
                visit(i, read);
                *handed = i + 1;
            }
            while *handed < end {
                visit(*handed, ReadHistory::default());
                *handed += 1;
            }
        };
    view.scan_prefixes(Cf::Events, &prefixes, &mut |i, item| {
        if reading.as_ref().is_none_or(|(j, _)| *j != i) {
            hand_over_until(i, &mut reading, &mut handed);
            let events = Vec::with_capacity(last_len.get().min(HISTORY_READ_AHEAD_EVENTS_MAX));
            reading = Some((
                i,
                ReadHistory {
                    events,
                    failure: None,
                },
            ));
        }
        let (_, read) = reading.as_mut().expect("set above");
        if read.failure.is_some() {
            return false;
        }
        match item.and_then(|(k, v)| decode_event(runs[i], k, v)) {
            Ok(e) => {
                read.events.push(e);
                true
            }
            Err(e) => {
                read.failure = Some(e);
                false
            }
        }
    });
    hand_over_until(runs.len(), &mut reading, &mut handed);
}

/// A run's history as [`Store::for_each_history`] read it.
#[derive(Debug, Default)]
pub struct ReadHistory {
    /// Its events in seq order: all of them, or those before `failure`.
    pub events: Vec<Event>,
    /// The error that ended the read early, if one did.
    pub failure: Option<Error>,
}

#[cfg(test)]
mod tests {
    // Goal: a commit's answer reaches its committer exactly once whichever
    // way it waits (polled, blocked on, or a function left with `then`)
    // and in whichever order the answer and the wait come, and a store
    // that drops its end answers `Closed`.
    // Method: drive both ends of `CommitHandle::channel` by hand, with a
    // counting waker for the polled case.
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn ack() -> Result<CommitAck> {
        Ok(CommitAck::default())
    }

    #[test]
    fn then_is_called_once_whether_the_answer_comes_before_or_after() {
        for answer_first in [false, true] {
            let got = Arc::new(Mutex::new(Vec::new()));
            let (reply, handle) = CommitHandle::channel();
            let sink = got.clone();
            let then = move |r: Result<CommitAck>| sink.lock().push(r.is_ok());
            if answer_first {
                reply.send(ack());
                handle.then(then);
            } else {
                handle.then(then);
                assert!(got.lock().is_empty(), "called before the answer");
                reply.send(ack());
            }
            assert_eq!(*got.lock(), vec![true], "answer first: {answer_first}");
        }
    }

    #[test]
    fn answers_from_another_thread_race_then_and_each_arrives_once() {
        let got = Arc::new(AtomicUsize::new(0));
        for _ in 0..2_000 {
            let (reply, handle) = CommitHandle::channel();
            let answerer = std::thread::spawn(move || reply.send(ack()));
            let sink = got.clone();
            handle.then(move |r| {
                assert!(r.is_ok());
                sink.fetch_add(1, Ordering::SeqCst);
            });
            answerer.join().unwrap();
        }
        assert_eq!(got.load(Ordering::SeqCst), 2_000);
    }

    /// Goal: a `then` function's deferred wake-up runs once the whole group
    /// is answered, not between its answers, and at once outside a group;
    /// a group answered inside another keeps the outer group's wake-ups
    /// for the outer group's end. Method: three handles whose functions log
    /// their answer and defer a logged wake-up, answered inside
    /// `answering`, and the same without it.
    #[test]
    fn wake_ups_deferred_by_answers_run_after_the_group() {
        let log = Arc::new(Mutex::new(Vec::<String>::new()));
        let handles = |n: usize| {
            (0..n)
                .map(|i| {
                    let (reply, handle) = CommitHandle::channel();
                    let log = log.clone();
                    handle.then(move |_| {
                        log.lock().push(format!("answer {i}"));
                        let log = log.clone();
                        after_answers(move || log.lock().push(format!("wake {i}")));
                    });
                    reply
                })
                .collect::<Vec<_>>()
        };
        let replies = handles(3);
        answering(|| {
            for reply in replies {
                reply.send(ack());
            }
        });
        let group = [
            "answer 0", "answer 1", "answer 2", "wake 0", "wake 1", "wake 2",
        ];
        assert_eq!(*log.lock(), group);

        log.lock().clear();
        for reply in handles(2) {
            reply.send(ack());
        }
        assert_eq!(*log.lock(), ["answer 0", "wake 0", "answer 1", "wake 1"]);

        log.lock().clear();
        let (outer, inner) = (handles(1), handles(1));
        answering(|| {
            for reply in outer {
                reply.send(ack());
            }
            answering(|| {
                for reply in inner {
                    reply.send(ack());
                }
            });
            log.lock().push("inner done".into());
        });
        assert_eq!(
            *log.lock(),
            ["answer 0", "answer 0", "wake 0", "inner done", "wake 0"],
            "the inner group wakes at its own end, the outer at the outer's"
        );
    }

    /// Goal: a deferred wake-up that panics neither keeps the others of
    /// its group from running nor is swallowed, and leaves the thread
    /// outside any group. Method: two wake-ups deferred in one group, the
    /// first panicking; then one deferred outside a group.
    #[test]
    fn a_panicking_wake_up_runs_the_others_and_panics_after() {
        let ran = Arc::new(AtomicUsize::new(0));
        let counted = ran.clone();
        let result = std::panic::catch_unwind(move || {
            answering(|| {
                after_answers(|| panic!("a wake-up panics"));
                after_answers(move || {
                    counted.fetch_add(1, Ordering::SeqCst);
                });
            })
        });
        assert!(result.is_err(), "the panic goes on after the group");
        assert_eq!(ran.load(Ordering::SeqCst), 1, "the other wake-up ran");
        let counted = ran.clone();
        after_answers(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 2, "outside a group: at once");
    }

    #[test]
    fn a_dropped_reply_answers_closed() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let (reply, handle) = CommitHandle::channel();
        let sink = got.clone();
        handle.then(move |r| sink.lock().push(matches!(r, Err(Error::Closed))));
        drop(reply);
        assert_eq!(*got.lock(), vec![true]);

        let (reply, handle) = CommitHandle::channel();
        drop(reply);
        assert!(matches!(handle.wait(), Err(Error::Closed)));
    }

    #[test]
    fn a_polled_handle_is_woken_once_and_takes_the_answer() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let (reply, mut handle) = CommitHandle::channel();
        assert!(Pin::new(&mut handle).poll(&mut cx).is_pending());
        assert!(Pin::new(&mut handle).poll(&mut cx).is_pending());
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        reply.send(ack());
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(matches!(
            Pin::new(&mut handle).poll(&mut cx),
            Poll::Ready(Ok(_))
        ));
    }

    #[test]
    fn an_answer_to_a_dropped_handle_is_dropped() {
        let (reply, handle) = CommitHandle::channel();
        drop(handle);
        reply.send(ack());
        let (reply, handle) = CommitHandle::channel();
        reply.send(ack());
        assert!(handle.wait().is_ok());
        let ready = CommitHandle::ready(ack());
        let got = Arc::new(Mutex::new(0));
        let sink = got.clone();
        ready.then(move |r| *sink.lock() += usize::from(r.is_ok()));
        assert_eq!(*got.lock(), 1);
    }
}
