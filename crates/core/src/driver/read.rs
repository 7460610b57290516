//! The reads a shard asks its host for, and how a host performs them.
//!
//! A shard never reads the store itself: it emits [`super::Action::Read`]
//! and the host calls [`ReadQuery::perform`] wherever reading may block (a
//! reader thread in the actix engine; at once in the simulator) and feeds
//! the result back. So the host's part is one call, and what is read for
//! which decision stays in the driver.

use keel_storage::history::ChildRecord;
use keel_storage::{
    CommandId, Error as StoreError, Event, EventKind, InstanceId, InstanceMeta, Intent,
    OutboxMessage, Outcome, ParkInfo, RunId, RunMeta, Seq, Store,
};

use super::{shard_of, ShardId};

/// What to read.
#[derive(Clone, Debug, PartialEq)]
pub enum ReadQuery {
    /// A run's whole history (to replay a closed run for a query).
    History(RunId),
    /// What activating a run needs: its whole history to replay, unless
    /// its run record says it closed and it is not marked parked, when
    /// [`ReadResult::Closed`] answers without reading a single event (a
    /// result or a signal for a long-finished run costs one record, not
    /// its history).
    Activation(RunId),
    /// An instance's current run, with the command id of its start (to
    /// decide a start).
    Instance(InstanceId),
    /// A run id or an instance id, to the run it names. An instance whose
    /// run continued as new and whose next run has not started yet (the
    /// hand-off is in the outbox) resolves to [`ReadResult::Continuing`].
    Resolve(String),
    /// The event a run committed under a durable id, if it did: what a
    /// repeated signal, update or message that reached the run after it
    /// closed is answered from (one record and one event, not the history).
    Committed {
        /// The run.
        run: RunId,
        /// The durable id the repeat carries.
        key: keel_storage::DurableKey,
    },
    /// A run's metadata.
    RunMeta(RunId),
    /// What `describe` shows of a run that the store knows.
    Describe(RunId),
    /// The next window of a shard's pending attempts or of the outbox
    /// messages its runs wrote, in the store's order (see `backlog.rs`):
    /// the rows after the key `after` (from the first without it) that
    /// belong to the shard, at most `limit`. Attempts due at or after
    /// `due_before` (and not asked to cancel) are read past, and the
    /// earliest of their due times is answered instead; attempts of parked
    /// runs are left out (a resume reads them).
    Backlog {
        /// The shard.
        shard: ShardId,
        /// Shards in the engine.
        shards: u16,
        /// Task rows or outbox rows.
        of: BacklogOf,
        /// The key of the last row the pass read.
        after: Option<Vec<u8>>,
        /// At most this many.
        limit: usize,
        /// Attempts due from this time on are not taken.
        due_before: keel_storage::Timestamp,
    },
    /// A run's intent rows, and the outbox messages addressed to it (to
    /// drive them again after the run is resumed).
    IntentsOf(RunId),
    /// The outbox row under this key, if the store holds it (answered as
    /// [`ReadResult::Intents`], with one row or none).
    OutboxRow(Vec<u8>),
    /// The next window of a shard's timers in due order: those after
    /// `after` (from the first without it), at most `limit`.
    Timers {
        /// The shard.
        shard: ShardId,
        /// Shards in the engine.
        shards: u16,
        /// The last timer (due time, run, step) the shard holds already.
        after: Option<(keel_storage::Timestamp, RunId, keel_storage::Step)>,
        /// At most this many.
        limit: usize,
    },
    /// One page of the runs a filter matches (`Store::list`).
    List {
        /// Which runs.
        filter: keel_storage::RunFilter,
        /// At most this many.
        page_size: usize,
        /// The token the page before handed out.
        after: Option<keel_storage::PageToken>,
    },
}

/// Which intent rows a [`ReadQuery::Backlog`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BacklogOf {
    /// Pending activity attempts.
    Tasks,
    /// Outbox messages.
    Outbox,
}

/// An instance's current run as a start sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceState {
    /// The instance record.
    pub instance: InstanceMeta,
    /// Its current run.
    pub run: RunMeta,
    /// The instance's runs, newest first (the current one, then each
    /// run's `previous_run`), at most [`START_DEDUPE_RUNS_MAX`], with the
    /// command id each one's start carried: a retried start is answered
    /// with the run it started, even after later runs.
    pub starts: Vec<(RunId, Option<CommandId>)>,
}

/// How many runs of an instance, newest first, a start's command id is
/// compared with.
pub const START_DEDUPE_RUNS_MAX: usize = 32;

/// What `describe` reads of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct DescribeFacts {
    /// The run's metadata.
    pub meta: RunMeta,
    /// The durable waits its history shows as open, in step order (the
    /// history is streamed through a fold, not held: describing a run of a
    /// million events takes memory for its open steps and children only).
    pub pending: Vec<keel_storage::history::PendingStep>,
    /// Its children as its history records them, with their status in the
    /// store (`None`: not started).
    pub children: Vec<(ChildRecord, Option<RunMeta>)>,
    /// Why it is parked, if it is.
    pub parked: Option<ParkInfo>,
    /// Its pending attempts as the store holds them (none once it is
    /// closed): the shard may not hold them all (a backlog window not
    /// read yet, a parked run), and describe shows every one.
    pub tasks: Vec<keel_storage::TaskEntry>,
}

/// What a read found.
#[derive(Clone, Debug, PartialEq)]
pub enum ReadResult {
    /// See [`ReadQuery::History`]: the events, and the park marker if the
    /// run is marked parked.
    History(Vec<Event>, Option<ParkInfo>),
    /// See [`ReadQuery::Activation`]: the run closed.
    Closed,
    /// See [`ReadQuery::Committed`].
    Committed(Option<Event>),
    /// See [`ReadQuery::Instance`].
    Instance(Option<InstanceState>),
    /// See [`ReadQuery::Resolve`].
    Resolved(Option<RunId>),
    /// See [`ReadQuery::Resolve`]: the instance's run `closed` continued as
    /// `next`, which does not exist yet.
    Continuing {
        /// The instance's current run, closed.
        closed: RunId,
        /// The run it continues as.
        next: RunId,
    },
    /// See [`ReadQuery::RunMeta`].
    RunMeta(Option<RunMeta>),
    /// See [`ReadQuery::Describe`]; `None` when the store has no such run.
    Describe(Option<Box<DescribeFacts>>),
    /// See [`ReadQuery::IntentsOf`].
    Intents(Vec<Intent>),
    /// See [`ReadQuery::Backlog`].
    Backlog {
        /// The rows taken, in the store's order.
        rows: Vec<Intent>,
        /// The key of the last row taken when the read stopped at its
        /// limit (the store may hold more); `None` when it read to the end.
        last: Option<Vec<u8>>,
        /// The earliest due time of the attempts read past.
        skipped_due: Option<keel_storage::Timestamp>,
    },
    /// See [`ReadQuery::Timers`], in due order.
    Timers(Vec<keel_storage::TimerEntry>),
    /// See [`ReadQuery::List`].
    Listed(keel_storage::RunPage),
    /// See [`ReadQuery::List`]: the filter or the page token does not
    /// check; why.
    ListRefused(String),
}

impl ReadQuery {
    /// Performs the read against `store`.
    pub fn perform(&self, store: &dyn Store) -> Result<ReadResult, StoreError> {
        Ok(match self {
            ReadQuery::History(run) => {
                ReadResult::History(store.history(*run)?, store.parked(*run)?)
            }
            ReadQuery::Committed { run, key } => {
                let mut found = None;
                if let Some(seq) = store.committed(*run, key)? {
                    // One point read (a scan would fetch a page of events).
                    let bytes = store.view().get(
                        keel_storage::keys::Cf::Events,
                        &keel_storage::keys::event_key(*run, seq),
                    )?;
                    if let Some(bytes) = bytes {
                        let event: Event = keel_storage::codec::decode(
                            keel_storage::codec::RecordKind::Event,
                            &bytes,
                        )
                        .map_err(|source| StoreError::Corrupt {
                            cf: "events",
                            run: Some(*run),
                            seq: Some(seq),
                            source,
                        })?;
                        found = (event.seq == seq).then_some(event);
                    }
                }
                ReadResult::Committed(found)
            }
            ReadQuery::Activation(run) => {
                let parked = store.parked(*run)?;
                let closed =
                    parked.is_none() && store.run_meta(*run)?.is_some_and(|m| m.status.is_closed());
                if closed {
                    ReadResult::Closed
                } else {
                    ReadResult::History(store.history(*run)?, parked)
                }
            }
            ReadQuery::Instance(instance) => {
                let state = match store.instance(instance)? {
                    None => None,
                    Some(i) => match store.run_meta(i.current_run)? {
                        None => None,
                        Some(run) => {
                            let mut starts = Vec::new();
                            let mut next = Some(run.run_id);
                            while let Some(r) = next.take() {
                                if starts.len() >= START_DEDUPE_RUNS_MAX {
                                    break;
                                }
                                let mut command = None;
                                store.for_each_event(r, Seq::FIRST, &mut |e| {
                                    if let EventKind::WorkflowStarted(start) = &e.kind {
                                        command = start.command_id.clone();
                                        next = start.previous_run;
                                    }
                                    false
                                })?;
                                starts.push((r, command));
                            }
                            Some(InstanceState {
                                instance: i,
                                run,
                                starts,
                            })
                        }
                    },
                };
                ReadResult::Instance(state)
            }
            ReadQuery::Resolve(target) => {
                let run = store.resolve(target)?;
                let by_instance = run.is_some_and(|r| RunId::parse(target) != Some(r));
                let continuing = match run {
                    Some(closed) if by_instance => match store.run_meta(closed)? {
                        Some(RunMeta {
                            outcome: Some(Outcome::ContinuedAsNew(next)),
                            ..
                        }) if store.run_meta(next)?.is_none() => Some((closed, next)),
                        _ => None,
                    },
                    _ => None,
                };
                match continuing {
                    Some((closed, next)) => ReadResult::Continuing { closed, next },
                    None => ReadResult::Resolved(run),
                }
            }
            ReadQuery::RunMeta(run) => ReadResult::RunMeta(store.run_meta(*run)?),
            ReadQuery::List {
                filter,
                page_size,
                after,
            } => match store.list(filter, *page_size, after.as_ref()) {
                Ok(page) => ReadResult::Listed(page),
                Err(keel_storage::ListError::Store(e)) => return Err(e),
                Err(e) => ReadResult::ListRefused(e.to_string()),
            },
            ReadQuery::Describe(run) => match store.run_meta(*run)? {
                None => ReadResult::Describe(None),
                Some(meta) => {
                    let mut facts = keel_storage::history::HistoryFacts::default();
                    store.for_each_event_once(*run, Seq::FIRST, &mut |e| {
                        facts.see(&e);
                        true
                    })?;
                    let (pending, children) = facts.into_parts();
                    let mut kids = Vec::new();
                    for c in children {
                        let m = store.run_meta(c.run_id)?;
                        kids.push((c, m));
                    }
                    let parked = store.parked(*run)?;
                    let tasks = if meta.status.is_closed() {
                        Vec::new()
                    } else {
                        store.run_tasks(*run)?
                    };
                    ReadResult::Describe(Some(Box::new(DescribeFacts {
                        meta,
                        pending,
                        children: kids,
                        parked,
                        tasks,
                    })))
                }
            },
            ReadQuery::Backlog {
                shard,
                shards,
                of,
                after,
                limit,
                due_before,
            } => {
                let mine = |run: RunId| shard_of(run, *shards) == *shard;
                let mut skipped_due: Option<keel_storage::Timestamp> = None;
                let (rows, last): (Vec<Intent>, Option<Vec<u8>>) = match of {
                    BacklogOf::Tasks => {
                        let tasks = store.tasks_after(after.as_deref(), *limit, &mut |t| {
                            if !mine(t.execution_id.run_id) {
                                return false;
                            }
                            if t.due >= *due_before && !t.cancel_requested {
                                skipped_due = Some(skipped_due.map_or(t.due, |s| s.min(t.due)));
                                return false;
                            }
                            true
                        })?;
                        let last = tasks.last().filter(|_| tasks.len() >= *limit).map(|t| {
                            keel_storage::keys::run_step_key(
                                t.execution_id.run_id,
                                t.execution_id.step,
                            )
                        });
                        // A parked run's attempts wait for its resume, which
                        // reads them again (`IntentsOf`): dispatched now they
                        // would run only to be refused, on every pass.
                        let mut parked = std::collections::BTreeMap::new();
                        let mut rows = Vec::with_capacity(tasks.len());
                        for t in tasks {
                            let run = t.execution_id.run_id;
                            let is_parked = match parked.get(&run) {
                                Some(p) => *p,
                                None => {
                                    let p = store.parked(run)?.is_some();
                                    parked.insert(run, p);
                                    p
                                }
                            };
                            if !is_parked {
                                rows.push(Intent::Task(t));
                            }
                        }
                        (rows, last)
                    }
                    BacklogOf::Outbox => {
                        let msgs = store
                            .outbox_after(after.as_deref(), *limit, &mut |m| mine(m.owner()))?;
                        let last = msgs
                            .last()
                            .filter(|_| msgs.len() >= *limit)
                            .map(OutboxMessage::key);
                        (msgs.into_iter().map(Intent::Outbox).collect(), last)
                    }
                };
                ReadResult::Backlog {
                    rows,
                    last,
                    skipped_due,
                }
            }
            ReadQuery::Timers {
                shard,
                shards,
                after,
                limit,
            } => ReadResult::Timers(store.timers_after(*after, *limit, &mut |t| {
                shard_of(t.run_id, *shards) == *shard
            })?),
            ReadQuery::OutboxRow(key) => ReadResult::Intents(
                store
                    .outbox_row(key)?
                    .into_iter()
                    .map(Intent::Outbox)
                    .collect(),
            ),
            ReadQuery::IntentsOf(run) => {
                let mut rows: Vec<Intent> = store
                    .run_tasks(*run)?
                    .into_iter()
                    .map(Intent::Task)
                    .collect();
                rows.extend(store.run_timers(*run)?.into_iter().map(Intent::Timer));
                // Read past the other runs' messages rather than load the
                // whole outbox: only this run's rows are held.
                rows.extend(
                    store
                        .outbox_after(None, usize::MAX, &mut |m: &OutboxMessage| {
                            m.target() == *run || m.owner() == *run
                        })?
                        .into_iter()
                        .map(Intent::Outbox),
                );
                ReadResult::Intents(rows)
            }
        })
    }
}
