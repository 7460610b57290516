//! The host's side of the drivers' actions: reads, commits and the group
//! sync, messages between shards, replies to clients. Each effect is
//! checked against the durable log before it happens.

use keel_core::driver::{Action, Message, ReadQuery, ReadResult, ShardId, ShardInput, Token};
use keel_storage::{CommitBatch, Error as StoreError, ShardLease};
use rand::RngExt;

use super::{
    Ev, Pending, World, SLOW_READ_MS_MAX, SLOW_READ_MS_MIN, SLOW_SYNC_MS_MAX, STORE_STOP_MS_MAX,
    SYNC_MS_MAX,
};
use crate::fault::FaultKind;

impl World<'_> {
    /// Performs a read on what is durable now (RocksDB in Sync mode shows
    /// a commit once its fsync returned) and queues its answer to arrive
    /// within `answer_ms_max`.
    pub(super) fn read_now(
        &mut self,
        inc: u32,
        shard: ShardId,
        token: Token,
        query: &ReadQuery,
        answer_ms_max: u64,
    ) {
        let result = query.perform(self.store.reader());
        if let (ReadQuery::List { filter, .. }, Ok(ReadResult::Listed(page))) = (query, &result) {
            self.check_listed(filter, page);
        }
        let at = self.now + self.ms(0, answer_ms_max);
        self.pinned_at(at, inc, shard, ShardInput::Read { token, result });
    }

    pub(super) fn perform(&mut self, p: usize, shard: ShardId, action: Action) {
        let inc = self.processes[p].inc;
        match action {
            Action::Read { token, query } => {
                if self.fault(FaultKind::SlowRead) {
                    // The reader pool is busy: the read runs later and sees
                    // what was committed meanwhile.
                    let at = self.now + self.ms(SLOW_READ_MS_MIN, SLOW_READ_MS_MAX);
                    let query = Box::new(query);
                    self.at(
                        at,
                        Ev::SlowRead {
                            inc,
                            shard,
                            token,
                            query,
                        },
                    );
                    return;
                }
                self.read_now(inc, shard, token, &query, 1);
            }
            // `alone` only lets a host write the commit on its own thread;
            // the simulated stores answer every commit the same way.
            Action::Commit {
                token,
                batch,
                alone,
            } => {
                // Several processes: one may freeze with this commit
                // decided and not yet sent, or be killed.
                if self.may_pause() && self.fault(FaultKind::ProcessPause) {
                    self.pause(
                        p,
                        shard,
                        Action::Commit {
                            token,
                            batch,
                            alone,
                        },
                    );
                    return;
                }
                if self.shared()
                    && self.crashes < super::CRASHES_MAX
                    && self.fault(FaultKind::ProcessKill)
                {
                    let at = self.now + self.ms(0, 3);
                    let inc = self.processes[p].inc;
                    self.at(at, Ev::ProcessKill { p, inc });
                }
                self.commit(p, shard, token, batch)
            }
            Action::RunAttempt { order, cause } => {
                self.effect(cause, "dispatch an attempt");
                self.run_attempt(p, shard, order);
            }
            Action::StopAttempt { key, epoch } => self.stop_attempt(p, shard, key, epoch),
            Action::RunFallback {
                key,
                attempt,
                activity_type,
                input,
                failure,
            } => {
                let result = self
                    .setup
                    .mocks
                    .get(&activity_type)
                    .and_then(|m| m.fallback.as_ref())
                    .and_then(|f| f(&input, &failure));
                let at = self.now + self.ms(0, 5);
                self.pinned_at(
                    at,
                    inc,
                    shard,
                    ShardInput::FallbackDone {
                        key,
                        attempt,
                        result,
                    },
                );
            }
            Action::Send { to, message, cause } => {
                self.effect(cause, "send a message");
                self.send(inc, to, message);
            }
            Action::Reply { id, answer, cause } => {
                self.effect(cause, "answer a client");
                self.reply(id, answer);
            }
            Action::RenewLease { lease } => {
                let now = keel_storage::Timestamp(self.now);
                let result =
                    self.store
                        .leases()
                        .renew_shard_lease(&lease, now, self.config.shard_lease_ms);
                if let Err(e) = &result {
                    self.log(format_args!("{shard} of {} cannot renew: {e}", lease.owner));
                }
                let at = self.now + self.ms(0, 2);
                self.pinned_at(at, inc, shard, ShardInput::LeaseRenewed { result });
            }
            Action::ReleaseLease { lease } => {
                self.released += 1;
                self.released_pending.insert((p, shard));
                let now = keel_storage::Timestamp(self.now);
                if let Err(e) = self.store.leases().release_shard_lease(&lease, now) {
                    self.log(format_args!("{shard} cannot be released: {e}"));
                }
            }
            Action::ShardLost { shard, reason } => {
                if self.released_pending.remove(&(p, shard)) {
                    // Given up, not lost.
                } else {
                    self.fenced += 1;
                }
                let pname = self.processes[p].name.clone();
                self.log(format_args!(
                    "{shard} leaves process {p} ({}): {reason}",
                    pname
                ));
                self.processes[p].shards.remove(&shard);
                self.processes[p].wakes.remove(&shard);
            }
        }
    }

    /// An effect is about to happen: the event it depends on must be
    /// durable.
    fn effect(&mut self, cause: keel_core::driver::Cause, what: &str) {
        if let Some((run, seq)) = cause {
            self.checker.effect(&self.store, run, seq, what, self.now);
        }
    }

    /// Delivers a message between shards, with the network's latency;
    /// `outbox-redelivery` delivers it twice.
    fn send(&mut self, inc: u32, to: ShardId, message: Message) {
        match &message {
            Message::Start { spec, then, .. } => {
                self.outbox_messages += 1;
                let name = self.name(spec.run_id);
                let then = then.as_ref().map(|_| " (then cancel)").unwrap_or("");
                self.log(format_args!("send start {name}{then} to {to}"));
            }
            Message::ToRun { run, op, .. } => {
                self.outbox_messages += 1;
                let name = self.name(*run);
                self.log(format_args!("send {} to {name} on {to}", op_name(op)));
            }
            Message::Answer { token, answer } => {
                self.log(format_args!(
                    "send answer {} {} to {to}",
                    token.0,
                    answer_name(answer)
                ));
            }
        }
        // A message for a shard this process does not run goes through
        // the store's relay, as in the engine: a note that outlives the
        // sender and waits for the shard's next owner. One for a shard
        // here goes to its actor, and dies with the process.
        let here = self.live(inc).is_some_and(|p| self.owner(to) == Some(p));
        let deliver = |w: &mut Self, at: u64, message: Message| {
            if here {
                w.input_at(at, Some(inc), to, ShardInput::Message(message));
            } else {
                w.relay_at(at, to, ShardInput::Message(message));
            }
        };
        if self.fault(FaultKind::OutboxRedelivery) {
            let at = self.now + self.ms(1, 500);
            deliver(self, at, message.clone());
        }
        let at = self.now + self.latency();
        deliver(self, at, message);
    }

    /// Commit path step 4 on the simulated store: written at once, answered
    /// after the group's sync.
    fn commit(&mut self, p: usize, shard: ShardId, token: Token, batch: CommitBatch) {
        if self.fault(FaultKind::CommitFailure) {
            let n = self.rng.random_range(1..=3);
            self.store.fail_next_commits(n);
        }
        if self.store_stopped_until.is_none() && self.fault(FaultKind::StoreStop) {
            let until = self.now + self.ms(20, STORE_STOP_MS_MAX);
            self.store_stopped_until = Some(until);
            self.store_stops += 1;
            self.log(format_args!(
                "store stops accepting writes until {until} ms"
            ));
            self.at(until, Ev::StoreResume);
            self.report_store_health();
        }
        let events: Vec<_> = batch
            .appends
            .iter()
            .map(|a| (a.run_id, a.events.clone()))
            .collect();
        let inc = self.processes[p].inc;
        // `commit-answer-lost`: even odds that the store wrote it.
        let answer_lost = self.fault(FaultKind::CommitAnswerLost);
        let written = !answer_lost || self.rng.random_bool(0.5);
        let result = match self.store_health().error() {
            Some(e) => Err(e),
            None if !written => {
                self.log(format_args!("commit lost with its connection, not written"));
                Err(connection_lost())
            }
            None => self.store.commit(batch),
        };
        match result {
            Ok(ack) => {
                self.check_owner(p, shard);
                self.commits += 1;
                for (run, es) in &events {
                    self.events += es.len() as u64;
                    self.checker.touch(*run);
                    if let (Some(first), Some(last)) = (es.first(), es.last()) {
                        let name = self.name(*run);
                        self.log(format_args!(
                            "{shard} commit {name} seq {}..{} written",
                            first.seq, last.seq
                        ));
                    }
                }
                self.processes[p].group.push(Pending {
                    shard,
                    token,
                    ack,
                    events,
                    answer_lost,
                });
                if !self.processes[p].flush_scheduled {
                    self.processes[p].flush_scheduled = true;
                    let sync_ms = if self.fault(FaultKind::StoreStall) {
                        let ms = self.ms(super::COMMIT_STALL_MS, 3 * super::COMMIT_STALL_MS);
                        self.store_stalls += 1;
                        self.stall_until = self.stall_until.max(self.now + ms);
                        self.log(format_args!("the disk hangs for {ms} ms"));
                        ms
                    } else if self.rng.random_bool(0.1) {
                        self.ms(5, SLOW_SYNC_MS_MAX)
                    } else {
                        self.ms(0, SYNC_MS_MAX)
                    };
                    let at = self.now + sync_ms;
                    self.at(at, Ev::Flush { inc });
                }
                if self.fault(FaultKind::EngineCrash) && self.crashes < super::CRASHES_MAX {
                    let at = self.now + self.ms(0, SYNC_MS_MAX + 1);
                    self.at(at, Ev::EngineCrash);
                }
            }
            Err(e) => {
                if !matches!(
                    e,
                    StoreError::CommitFailed(_)
                        | StoreError::Unwritable { .. }
                        | StoreError::Database { .. }
                ) {
                    self.log(format_args!("commit refused: {e}"));
                }
                let at = self.now + self.ms(0, 1);
                self.pinned_at(
                    at,
                    inc,
                    shard,
                    ShardInput::Committed {
                        token,
                        result: Err(e),
                    },
                );
            }
        }
    }

    /// The group commit: one sync, then every waiting commit is answered in
    /// order.
    pub(super) fn flush(&mut self, p: usize) {
        self.processes[p].flush_scheduled = false;
        if let Err(e) = self.store.sync() {
            self.log(format_args!("sync failed: {e}"));
            return;
        }
        let group = std::mem::take(&mut self.processes[p].group);
        if !group.is_empty() {
            self.log(format_args!("group sync answers {} commits", group.len()));
        }
        for pending in group {
            for (run, events) in &pending.events {
                self.checker.durable(*run, events, self.now);
            }
            let result = if pending.answer_lost {
                self.log(format_args!(
                    "commit written, its answer lost with its connection"
                ));
                Err(connection_lost())
            } else {
                Ok(pending.ack)
            };
            self.feed(
                p,
                pending.shard,
                ShardInput::Committed {
                    token: pending.token,
                    result,
                },
            );
        }
    }

    /// When process `p` holds `shard` under a lease that is no longer the
    /// shard's (several processes only): the epoch it holds, and the
    /// shard's lease as the store records it.
    fn owner_mismatch(
        &self,
        p: usize,
        shard: ShardId,
    ) -> Option<(Option<u64>, Option<ShardLease>)> {
        if !self.shared() {
            return None;
        }
        let held = self.processes[p]
            .shards
            .get(&shard)
            .and_then(|s| s.lease().map(|l| l.epoch));
        let current = self
            .store
            .leases()
            .shard_leases()
            .ok()
            .and_then(|ls| ls.into_iter().find(|l| l.shard == shard.0));
        let stale = held.is_none() || held != current.as_ref().map(|l| l.epoch);
        stale.then_some((held, current))
    }

    /// Whether process `p` holds `shard` under a lease that is no longer
    /// the shard's (several processes only).
    pub(super) fn stale_owner(&self, p: usize, shard: ShardId) -> bool {
        self.owner_mismatch(p, shard).is_some()
    }

    /// A commit was written for `shard` by process `p`: with several
    /// processes, `p` must hold the shard's current lease (the fence is
    /// what guarantees it; `--break skip-fence` removes it).
    fn check_owner(&mut self, p: usize, shard: ShardId) {
        if let Some((held, current)) = self.owner_mismatch(p, shard) {
            let detail = format!(
                "process {p} ({}) committed for {shard} under epoch {held:?}, but the shard's lease is {}",
                self.processes[p].name,
                current.map_or("missing".to_string(), |l| format!("epoch {} of {}", l.epoch, l.owner))
            );
            self.violation(crate::check::ViolationKind::FencedCommit, detail);
        }
    }
}

fn op_name(op: &keel_core::driver::RunOp) -> &'static str {
    use keel_core::driver::RunOp;
    use keel_core::Input;
    match op {
        RunOp::Input(i) => match i {
            Input::ActivityCompleted { .. } => "ActivityCompleted",
            Input::ActivityFailed { .. } => "ActivityFailed",
            Input::ActivityCancelled { .. } => "ActivityCancelled",
            Input::TimerFired { .. } => "TimerFired",
            Input::ChildStarted { .. } => "ChildStarted",
            Input::ChildCompleted { .. } => "ChildCompleted",
            Input::ChildFailed { .. } => "ChildFailed",
            Input::Signal { .. } => "Signal",
            Input::Message { .. } => "Message",
            Input::SendCompleted { .. } => "SendCompleted",
            Input::CancelRequested { .. } => "CancelRequested",
            Input::Terminate { .. } => "Terminate",
            Input::TimedOut { .. } => "TimedOut",
            Input::Update { .. } => "Update",
        },
        RunOp::Query { .. } => "Query",
        RunOp::Result => "Result",
        RunOp::Describe => "Describe",
        RunOp::Resume => "Resume",
        RunOp::Activate => "Activate",
    }
}

fn answer_name(a: &keel_core::driver::Answer) -> String {
    use keel_core::driver::Answer;
    match a {
        Answer::Committed => "committed".into(),
        Answer::Duplicate => "duplicate".into(),
        Answer::Started(_) => "started".into(),
        Answer::Existing(_) => "existing".into(),
        Answer::Refused(r) => format!("refused ({r})"),
        Answer::Retry(why) => format!("retry ({why})"),
        Answer::Outcome(..) => "outcome".into(),
        Answer::Described(_) => "described".into(),
        Answer::Resumed(_) => "resumed".into(),
        Answer::Queried(_) => "queried".into(),
        Answer::Updated(Ok(_)) => "updated".into(),
        Answer::Updated(Err(f)) => format!("update failed ({f})"),
        Answer::Listed(page) => format!("listed ({} runs)", page.runs.len()),
        Answer::Sent { offset, first } => format!("sent (offset {offset}, first {first})"),
    }
}

impl World<'_> {
    /// A page of runs must hold exactly the runs whose durable histories
    /// match the filter, folded here from the events (never from the
    /// index or the run records the page was read through).
    fn check_listed(&mut self, filter: &keel_storage::RunFilter, page: &keel_storage::RunPage) {
        if page.next.is_some() {
            return; // the simulator's runs fit one page; a partial one is not compared
        }
        let reader = self.store.reader();
        let mut runs = Vec::new();
        let scanned = reader
            .view()
            .scan(keel_storage::keys::Cf::Runs, &[], &[], &mut |k, _| {
                runs.extend(keel_storage::keys::run_prefix(k));
                true
            });
        if scanned.is_err() {
            return;
        }
        let mut expected = Vec::new();
        let mut progress = std::collections::HashMap::new();
        for run in runs {
            let Ok(history) = reader.history(run) else {
                return;
            };
            if let Some(meta) = folded_meta(&history) {
                if filter.matches(&meta) {
                    expected.push(run);
                }
                progress.insert(run, (meta.next_seq, meta.updated_at));
            }
        }
        // A listed run's progress is its history's, however far its stored
        // record trails (the embedded stores leave progress-only rewrites
        // to the events).
        for meta in &page.runs {
            let folded = progress.get(&meta.run_id);
            if folded.is_some_and(|f| *f != (meta.next_seq, meta.updated_at)) {
                let detail = format!(
                    "list {filter}: run {} listed at seq {} (updated {}), its durable history at {:?}",
                    meta.run_id, meta.next_seq, meta.updated_at.0, folded
                );
                self.violation(crate::check::ViolationKind::WrongAnswer, detail);
            }
        }
        let mut listed: Vec<_> = page.runs.iter().map(|m| m.run_id).collect();
        listed.sort();
        expected.sort();
        if listed != expected {
            let detail = format!(
                "list {filter}: listed {} runs, the durable histories match {}",
                listed.len(),
                expected.len()
            );
            self.violation(crate::check::ViolationKind::WrongAnswer, detail);
        }
    }
}

/// What a run's history says of the fields a filter tests.
fn folded_meta(history: &[keel_storage::Event]) -> Option<keel_storage::RunMeta> {
    use keel_storage::{search, EventKind as K, RunStatus};
    let first = history.first()?;
    let K::WorkflowStarted(start) = &first.kind else {
        return None;
    };
    let keel_storage::WorkflowStart {
        instance_id,
        run_id,
        workflow_type,
        carried,
        memo,
        search_attributes,
        ..
    } = &**start;
    let (mut attrs, fields) =
        search::start_metadata(Some(carried), search_attributes, memo).ok()?;
    let mut status = RunStatus::Running;
    let mut closed_at = None;
    for e in history {
        let closed = match &e.kind {
            K::SearchAttributesUpserted { attributes } => {
                search::upsert_attributes(&mut attrs, attributes).ok()?;
                None
            }
            K::WorkflowCompleted { .. } => Some(RunStatus::Completed),
            K::WorkflowFailed { .. } => Some(RunStatus::Failed),
            K::WorkflowCancelled { .. } => Some(RunStatus::Cancelled),
            K::WorkflowTerminated { .. } => Some(RunStatus::Terminated),
            K::WorkflowTimedOut { .. } => Some(RunStatus::TimedOut),
            K::WorkflowContinuedAsNew { .. } => Some(RunStatus::ContinuedAsNew),
            _ => None,
        };
        if let Some(s) = closed {
            status = s;
            closed_at = Some(e.at);
        }
    }
    Some(keel_storage::RunMeta {
        run_id: *run_id,
        instance_id: instance_id.clone(),
        workflow_type: workflow_type.clone(),
        status,
        next_seq: keel_storage::Seq(history.len() as u64 + 1),
        parent: None,
        started_at: first.at,
        updated_at: history.last().map_or(first.at, |e| e.at),
        closed_at,
        outcome: None,
        cancel_requested: false,
        search_attributes: attrs,
        memo: fields,
    })
}

/// What a shard hears of a commit whose connection broke in flight
/// (`commit-answer-lost`): it may or may not have been written.
fn connection_lost() -> StoreError {
    StoreError::Database {
        target: "simulated store".into(),
        fault: keel_storage::DatabaseFault::Lost,
        detail: "the connection broke with the commit in flight".into(),
    }
}
