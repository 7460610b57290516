//! One run inside its shard: activation by replay, the check against
//! durable ids, the machine, the commit, and what follows its answer
//! (commit path steps 1 to 6 of ARCHITECTURE.md).
//!
//! A run's commits may be pipelined: the store's per-run seq check refuses
//! a commit whose predecessor failed. Whatever the machine says about an
//! input while commits are in flight (a duplicate, a closed run) rests on
//! state that may not be durable yet, so that answer waits for them; so
//! does `describe`. A failed commit throws the machine away; the next input
//! replays it from the log.

use std::collections::VecDeque;

use keel_storage::{
    CommitAck, CommitBatch, Error as StoreError, Event, EventKind, Intent, OutboxMessage, Outcome,
    ParkInfo, RunId, Seq,
};

use super::{
    Answer, BreakMode, Cause, CommitFor, Due, Origin, ReadFor, ReadQuery, ReadResult, Refusal,
    ReplyTo, Resumed, RunOp, Shard, Token, ASYNC_BIND_RETRY_MS, ASYNC_BIND_TRIES_MAX,
    CONTINUATION_CHECKS_MAX, CONTINUATION_CHECK_MS, PASSIVATE_SCAN_RUNS_MAX,
    RESULT_WAITERS_PER_RUN_MAX, RUN_QUEUE_MAX, RUN_RESTARTS_MAX,
};
use crate::concurrency::ASYNC_WORKFLOW_TYPE;
use crate::machine::{Input, MachineError, RunMachine, Verdict};

/// Where a run's machine is.
pub(super) enum Phase {
    /// Not in memory: the next operation that needs it replays the log.
    Idle,
    /// Its history is being read.
    Loading,
    /// In memory, ready for inputs.
    Ready(Box<RunMachine>),
    /// Parked: its code diverged from its history or panicked.
    Parked(String),
    /// Closed: nothing reaches a machine any more (none is kept; a closed
    /// history is not replayed to answer that).
    Closed,
}

/// A commit of the run, asked for and not answered yet.
pub(super) struct Inflight {
    token: Token,
    origin: Option<Origin>,
    start: bool,
    /// For a start: the instance it makes this run the current one of.
    instance: Option<String>,
    last_seq: Seq,
    closing: Option<Outcome>,
    /// Answers that rest on this commit (and those before it) being
    /// durable: duplicates, closed-run answers.
    deferred: Vec<(Origin, Answer)>,
    /// Updates this commit accepts (their clients wait) and completes.
    accepted: Vec<keel_storage::CommandId>,
    completed: Vec<(
        keel_storage::CommandId,
        Result<keel_storage::Payload, keel_storage::Failure>,
    )>,
    /// The offset of the stream message this commit holds, if it does: its
    /// sender hears it.
    sent: Option<u64>,
    /// Async children this commit schedules, their closures bound already:
    /// forgotten if it fails (a refused start's code ran ahead too).
    unsettled: Vec<RunId>,
}

/// A run of the shard, as long as it is in memory.
pub(super) struct RunSlot {
    pub(super) phase: Phase,
    /// Operations waiting for the machine (activation in progress).
    waiting: VecDeque<(RunOp, Origin)>,
    /// In commit order; answered mostly from the front (a fan-out's
    /// results can hold a thousand at once).
    inflight: VecDeque<Inflight>,
    /// Operations waiting for every commit in flight to be answered.
    drained: Vec<(RunOp, Origin)>,
    restarts: u32,
    async_tries: u32,
    tick: u64,
    /// The read of the activation in progress. A run can leave `Loading`
    /// before its read answers (a child's start delivered again makes the
    /// machine anew) and be activated again: only the newest read may
    /// answer, since an older one can hold a history that ends earlier.
    activation: Option<Token>,
    closed: bool,
    /// A resume waits for the activation it started.
    resuming: Vec<Origin>,
    /// For a parked run: the seq its next event takes, when known (a
    /// termination needs no workflow code and is committed there).
    pub(super) parked_next: Option<Seq>,
    /// Park markers being committed, with the answers that wait for them
    /// (a "parked" answer is given once the reason is durable).
    markers: Vec<(Token, Vec<(Origin, Answer)>)>,
    /// Its instance, once its start committed here or its open history
    /// was replayed (see `Shard::resolve_here`).
    instance: Option<String>,
    /// A closing commit of it had an unknown outcome: it is activated once
    /// nothing is in flight, to learn whether it closed (its closures, and
    /// those of its async children, are forgotten only at a close).
    recheck: bool,
}

impl RunSlot {
    fn new() -> Self {
        RunSlot {
            phase: Phase::Idle,
            waiting: VecDeque::new(),
            inflight: VecDeque::new(),
            drained: Vec::new(),
            restarts: 0,
            async_tries: 0,
            tick: 0,
            activation: None,
            closed: false,
            resuming: Vec::new(),
            parked_next: None,
            markers: Vec::new(),
            instance: None,
            recheck: false,
        }
    }

    /// True when nothing of the run needs it in memory.
    pub(super) fn idle(&self) -> bool {
        self.inflight.is_empty()
            && self.markers.is_empty()
            && self.waiting.is_empty()
            && self.drained.is_empty()
            && self.resuming.is_empty()
            && !self.recheck
            && !matches!(self.phase, Phase::Loading)
    }

    /// The clients and shards waiting on this run (answered when the
    /// shard stops). With `starts`, also the sender of a start whose
    /// commit is in flight (a client, or the shard delivering a child's or
    /// a continuation's start): for a shard that leaves its process, whose
    /// commits are never answered here; not at shutdown, where the commit
    /// still answers (a start told "shut down" might commit after all).
    pub(super) fn take_waiting(&mut self, starts: bool) -> Vec<ReplyTo> {
        let mut out = Vec::new();
        let mut take = |o: &Origin| match o {
            Origin::Reply(reply) => out.push(*reply),
            Origin::Start(job) if starts => out.push(job.reply_to()),
            _ => {}
        };
        for (_, o) in self.waiting.drain(..).chain(self.drained.drain(..)) {
            take(&o);
        }
        for i in &mut self.inflight {
            if let Some(o) = &i.origin {
                take(o);
            }
            for (o, _) in &i.deferred {
                take(o);
            }
        }
        for o in self.resuming.drain(..) {
            take(&o);
        }
        out
    }

    /// True when the run is known to exist: its machine is in memory, it
    /// is parked, or it has commits in flight (its start, say).
    pub(super) fn exists(&self) -> bool {
        matches!(
            self.phase,
            Phase::Ready(_) | Phase::Parked(_) | Phase::Closed
        ) || !self.inflight.is_empty()
    }

    /// True when no commit or park marker of the run is in flight: its
    /// machine holds committed state only.
    pub(super) fn drained_now(&self) -> bool {
        self.inflight.is_empty() && self.markers.is_empty()
    }

    /// Holds an operation until [`drained_now`](Self::drained_now).
    pub(super) fn wait_drained(&mut self, op: RunOp, origin: Origin) {
        self.drained.push((op, origin));
    }

    pub(super) fn machine(&self) -> Option<&RunMachine> {
        match &self.phase {
            Phase::Ready(m) => Some(m),
            _ => None,
        }
    }
}

impl Shard {
    pub(super) fn slot(&mut self, run: RunId) -> &mut RunSlot {
        self.tick += 1;
        let tick = self.tick;
        let slot = self.runs.entry(run).or_insert_with(RunSlot::new);
        let old = std::mem::replace(&mut slot.tick, tick);
        self.lru.remove(&old);
        self.lru.insert(tick, run);
        self.runs.get_mut(&run).expect("inserted above")
    }

    /// An operation on a run of this shard.
    pub(super) fn run_op(&mut self, run: RunId, op: RunOp, origin: Origin) {
        if self.shut_down {
            self.answer(origin, Answer::Refused(Refusal::Shutdown), None);
            return;
        }
        match op {
            RunOp::Result => return self.result_op(run, origin),
            RunOp::Resume => return self.resume(run, origin),
            _ => {}
        }
        let slot = self.slot(run);
        match &slot.phase {
            Phase::Parked(reason) => {
                let reason = reason.clone();
                let next = slot.parked_next.filter(|_| slot.inflight.is_empty());
                match (op, next) {
                    (RunOp::Describe, _) => self.describe_when_drained(run, origin),
                    // Termination and a timeout run no workflow code: they
                    // close a parked run too.
                    (
                        RunOp::Input(input @ (Input::Terminate { .. } | Input::TimedOut { .. })),
                        Some(seq),
                    ) => {
                        let kind = match input {
                            Input::Terminate { reason, command_id } => {
                                EventKind::WorkflowTerminated { reason, command_id }
                            }
                            Input::TimedOut { timeout, deadline } => {
                                EventKind::WorkflowTimedOut { timeout, deadline }
                            }
                            _ => unreachable!("matched above"),
                        };
                        let event = Event {
                            seq,
                            at: self.now,
                            kind,
                        };
                        let batch = CommitBatch {
                            appends: vec![keel_storage::RunAppend {
                                run_id: run,
                                events: vec![event],
                            }],
                            parked: vec![(run, None)],
                            fence: None,
                        };
                        self.commit_batch(run, batch, origin, false);
                    }
                    _ => {
                        let answer = Answer::Refused(Refusal::Parked { run, reason });
                        self.answer_after_marker(run, origin, answer);
                    }
                }
            }
            Phase::Loading => self.queue(run, op, origin),
            // A run not in memory is described from the store first: a
            // closed one needs no replay (describing a finished import of
            // 200,000 events replayed all of them); an open one is then
            // activated for its coroutines and scopes
            // (`Shard::describe_read`).
            Phase::Idle if matches!(op, RunOp::Describe) => self.describe_when_drained(run, origin),
            Phase::Idle => {
                self.queue(run, op, origin);
                self.activate(run);
            }
            // Its start is in flight: an operation now would build on a
            // machine that exists only if that start commits. (A start
            // delivered twice may be decided on a read from before the
            // first one: its commit is refused, and a commit behind it
            // could line up with the durable history's seqs.) It waits
            // for the start's answer (`Shard::after_commit`).
            // (A start is always a run's first commit.)
            Phase::Ready(_) if slot.inflight.front().is_some_and(|i| i.start) => {
                self.queue(run, op, origin)
            }
            Phase::Ready(_) => self.ready_op(run, op, origin),
            Phase::Closed => self.closed_op(run, op, origin),
        }
    }

    /// An operation on a run known to be closed.
    fn closed_op(&mut self, run: RunId, op: RunOp, origin: Origin) {
        match op {
            // A repeat of something the run committed before it closed gets
            // the first outcome: looked up by its durable id once every
            // commit in flight is durable.
            RunOp::Input(input) => match repeat_key(&input) {
                Some(key) => {
                    let slot = self.slot(run);
                    if slot.inflight.is_empty() && slot.markers.is_empty() {
                        self.read(
                            ReadQuery::Committed { run, key },
                            ReadFor::ClosedInput { run, input, origin },
                        );
                    } else {
                        slot.wait_drained(RunOp::Input(input), origin);
                    }
                }
                None => {
                    let answer = Answer::Refused(Refusal::RunClosed(run));
                    self.answer_when_durable(run, origin, answer);
                }
            },
            RunOp::Describe => self.describe_when_drained(run, origin),
            RunOp::Query { name, args } => self.query_closed(run, name, args, origin),
            // Only an async child that finds no closure asks (see
            // `Shard::bind_replay_read`).
            RunOp::Activate => {
                // Once at a time: children asking together are served by
                // the one replay.
                let pending = self
                    .reads
                    .values()
                    .any(|r| matches!(r, ReadFor::BindReplay(p) if *p == run));
                if !pending {
                    self.read(ReadQuery::History(run), ReadFor::BindReplay(run));
                }
            }
            RunOp::Result | RunOp::Resume => {}
        }
    }

    /// A repeat reached a closed run: the event committed under its
    /// durable id, if any, says what the first outcome was (else
    /// `RunClosed`).
    pub(super) fn closed_input_read(
        &mut self,
        run: RunId,
        input: Input,
        origin: Origin,
        result: Result<ReadResult, StoreError>,
    ) {
        let history = match result {
            Ok(ReadResult::Committed(found)) => found.into_iter().collect::<Vec<_>>(),
            Ok(_) => return,
            Err(e) => {
                let answer = Answer::Retry(format!("history unreadable: {e}"));
                return self.answer(origin, answer, None);
            }
        };
        let first = history.iter().find_map(|e| match (&input, &e.kind) {
            (
                Input::Message { stream, key, .. },
                EventKind::MessageReceived {
                    stream: s,
                    key: k,
                    offset,
                    ..
                },
            ) if s == stream && k == key => Some(Answer::Sent {
                offset: *offset,
                first: false,
            }),
            (
                Input::Update { update_id, .. },
                EventKind::UpdateCompleted {
                    update_id: u,
                    result,
                    failure,
                },
            ) if u == update_id => Some(Answer::Updated(match failure {
                Some(f) => Err(f.clone()),
                None => Ok(result.clone()),
            })),
            (
                Input::Signal {
                    command_id: Some(c),
                    ..
                }
                | Input::CancelRequested {
                    command_id: Some(c),
                    ..
                }
                | Input::Terminate {
                    command_id: Some(c),
                    ..
                },
                kind,
            ) if kind
                .terminal_keys()
                .contains(&keel_storage::DurableKey::Command(c.clone())) =>
            {
                Some(Answer::Duplicate)
            }
            _ => None,
        });
        let answer = first.unwrap_or(Answer::Refused(Refusal::RunClosed(run)));
        self.answer(origin, answer, None);
    }

    /// Answers once every commit of `run` in flight is durable.
    pub(super) fn answer_when_durable(&mut self, run: RunId, origin: Origin, answer: Answer) {
        let slot = self.slot(run);
        match slot.inflight.back_mut() {
            Some(last) => last.deferred.push((origin, answer)),
            None => self.answer(origin, answer, None),
        }
    }

    pub(super) fn queue(&mut self, run: RunId, op: RunOp, origin: Origin) {
        let slot = self.slot(run);
        if slot.waiting.len() >= RUN_QUEUE_MAX {
            let why = format!("run {run} has {RUN_QUEUE_MAX} requests waiting");
            self.answer(origin, Answer::Retry(why), None);
            return;
        }
        slot.waiting.push_back((op, origin));
    }

    /// Reads the history to replay the run, unless a read is in flight or
    /// its commits are (then it starts once they are answered).
    pub(super) fn activate(&mut self, run: RunId) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        if !matches!(slot.phase, Phase::Idle)
            || !slot.inflight.is_empty()
            || !slot.markers.is_empty()
        {
            return;
        }
        slot.phase = Phase::Loading;
        let token = self.read(ReadQuery::Activation(run), ReadFor::Activate(run));
        if let Some(slot) = self.runs.get_mut(&run) {
            slot.activation = Some(token);
        }
    }

    /// An activation found the run closed (its history ends with a closing
    /// event, or its run record says so): what waited for it is answered
    /// as for any closed run.
    fn activated_closed(&mut self, run: RunId) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        slot.phase = Phase::Closed;
        slot.closed = true;
        // A closed run needs no closure (see `forget_open_async`).
        self.workflows.unbind_async(run);
        self.settle_unsure_async_closed(run);
        self.instance_closed(run);
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        for origin in std::mem::take(&mut slot.resuming) {
            self.answer(origin, Answer::Resumed(Resumed::fitting(run, false)), None);
        }
        self.run_waiting(run);
    }

    pub(super) fn retry_activation(&mut self, run: RunId) {
        // Inputs, a resume or a recheck wait for the activation.
        if self
            .runs
            .get(&run)
            .is_some_and(|s| !s.waiting.is_empty() || !s.resuming.is_empty() || s.recheck)
        {
            self.activate(run);
        }
    }

    pub(super) fn history_read(
        &mut self,
        run: RunId,
        token: Token,
        result: Result<ReadResult, StoreError>,
    ) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        if !matches!(slot.phase, Phase::Loading) || slot.activation != Some(token) {
            // Stale: the run was started here meanwhile (an operation for a
            // child came before the child's start), or this is the read of
            // an activation before that start, answering after the next
            // activation began: its history may end before the commits made
            // since, and a machine built on it would drop their results.
            return;
        }
        slot.activation = None;
        slot.phase = Phase::Idle;
        if matches!(result, Ok(ReadResult::History(..) | ReadResult::Closed)) {
            slot.recheck = false;
        }
        let (history, marker) = match result {
            Ok(ReadResult::History(h, marker)) => (h, marker),
            Ok(ReadResult::Closed) => return self.activated_closed(run),
            Ok(_) => return,
            Err(e) if e.is_transient() => {
                // The database is away, not the history at fault: the
                // inputs wait and the history is read again later.
                tracing::debug!(%run, error = %e, "history unreachable; reading it again later");
                let at = self.now.plus_ms(super::RUN_UNREACHABLE_RETRY_MS);
                self.due.push(at, Due::Activate(run));
                return;
            }
            Err(e) => {
                slot.restarts += 1;
                if slot.restarts >= RUN_RESTARTS_MAX {
                    let reason = format!("history unreadable {} times: {e}", slot.restarts);
                    self.park(run, &MachineError::InvalidHistory(reason), None);
                } else {
                    if slot.recheck {
                        // Nothing else may activate it again.
                        let at = self.now.plus_ms(super::RUN_UNREACHABLE_RETRY_MS);
                        self.due.push(at, Due::Activate(run));
                    }
                    self.fail_waiting(run, Answer::Retry(format!("history unreadable: {e}")));
                }
                return;
            }
        };
        let Some(first) = history.first() else {
            self.fail_waiting(run, Answer::Refused(Refusal::UnknownRun(run.to_string())));
            self.forget(run);
            // A start whose outcome was unknown was not written.
            self.settle_unsure_async(run, None);
            return;
        };
        self.stats.activations += 1;
        if history.last().is_some_and(|e| e.kind.closes_run()) && marker.is_none() {
            return self.activated_closed(run);
        }
        let child_of = match &first.kind {
            EventKind::WorkflowStarted(start) => start
                .parent
                .as_ref()
                .map(|parent| (&start.workflow_type, parent)),
            _ => None,
        };
        if let Some((workflow_type, parent)) = child_of {
            let closed = history.last().is_some_and(|e| e.kind.closes_run());
            if workflow_type == ASYNC_WORKFLOW_TYPE && !closed && !self.workflows.async_bound(run) {
                // Its closure lives in its parent's code: replay the parent
                // (wherever its shard is), then try again.
                slot.async_tries += 1;
                if slot.async_tries > ASYNC_BIND_TRIES_MAX {
                    let reason = format!(
                        "the closure of async child {run} was not bound by its parent {} \
                         after {ASYNC_BIND_TRIES_MAX} activations",
                        parent.run_id
                    );
                    let next = Seq(history.len() as u64 + 1);
                    self.park(run, &MachineError::InvalidHistory(reason), Some(next));
                } else {
                    let parent = parent.run_id;
                    self.send(parent, RunOp::Activate, ReplyTo::Nobody, None);
                    let at = self.now.plus_ms(ASYNC_BIND_RETRY_MS);
                    self.due.push(at, Due::Activate(run));
                }
                return;
            }
        }
        let next = Seq(history.len() as u64 + 1);
        // Open (checked above), so its instance's current run: the store
        // starts no other run of an instance while one is open.
        let instance = match &first.kind {
            EventKind::WorkflowStarted(start) if marker.is_none() => {
                Some(start.instance_id.as_str().to_string())
            }
            _ => None,
        };
        let mut closed = Vec::new();
        let replayed = {
            let _span =
                tracing::info_span!("replay", run_id = %run, events = history.len()).entered();
            RunMachine::replay_taking_closed(&self.workflows, history, &mut closed)
        };
        // Also when it diverged: those children are closed all the same.
        self.forget_async(closed);
        match replayed {
            Ok(m) => {
                self.settle_unsure_async(run, Some(&m));
                if let Some(instance) = instance {
                    self.instance_open(run, instance);
                }
                let slot = self.runs.get_mut(&run).expect("checked above");
                slot.restarts = 0;
                slot.async_tries = 0;
                slot.phase = Phase::Ready(Box::new(m));
                let was_parked = marker.is_some();
                if was_parked {
                    // It fits the code now: clear the marker and drive the
                    // work its parking dropped (timers, attempts, messages).
                    self.set_marker(run, None);
                    self.read(ReadQuery::IntentsOf(run), ReadFor::RunIntents(run, true));
                }
                let slot = self.runs.get_mut(&run).expect("checked above");
                for origin in std::mem::take(&mut slot.resuming) {
                    let answer = Answer::Resumed(Resumed::fitting(run, was_parked));
                    self.answer_after_marker(run, origin, answer);
                }
                self.run_waiting(run);
            }
            Err(e) => self.park(run, &e, Some(next)),
        }
    }

    fn fail_waiting(&mut self, run: RunId, answer: Answer) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let waiting: Vec<_> = slot.waiting.drain(..).collect();
        let resuming = std::mem::take(&mut slot.resuming);
        for (_, origin) in waiting {
            self.answer(origin, answer.clone(), None);
        }
        for origin in resuming {
            self.answer(origin, answer.clone(), None);
        }
    }

    /// Hands the waiting operations to the machine, in arrival order.
    pub(super) fn run_waiting(&mut self, run: RunId) {
        loop {
            let Some(slot) = self.runs.get_mut(&run) else {
                return;
            };
            let closed = match slot.phase {
                Phase::Ready(_) => false,
                Phase::Closed => true,
                _ => return,
            };
            let Some((op, origin)) = slot.waiting.pop_front() else {
                return;
            };
            if closed {
                self.closed_op(run, op, origin);
            } else {
                self.ready_op(run, op, origin);
            }
        }
    }

    /// An operation on a run whose machine is in memory.
    fn ready_op(&mut self, run: RunId, op: RunOp, origin: Origin) {
        let input = match op {
            RunOp::Input(input) => input,
            RunOp::Describe => return self.describe_when_drained(run, origin),
            RunOp::Query { name, args } => return self.query_ready(run, name, args, origin),
            RunOp::Activate => return,
            RunOp::Result | RunOp::Resume => unreachable!("handled before the machine"),
        };
        let (input, origin) = match input {
            Input::Update { .. } => {
                let Some(input) = self.update_ready(run, input, origin.clone()) else {
                    return;
                };
                // New and valid: its client waits for the completion.
                if let Input::Update { update_id, .. } = &input {
                    self.wait_update(run, update_id.clone(), origin.clone());
                }
                let origin = match origin {
                    Origin::Reply(_) => Origin::Reply(ReplyTo::Nobody),
                    other => other,
                };
                (input, origin)
            }
            input => (input, origin),
        };
        let skip_check = self.breaks(BreakMode::NoAttemptDedupe);
        let now = self.now;
        let slot = self.runs.get_mut(&run).expect("ready");
        let Phase::Ready(machine) = &mut slot.phase else {
            unreachable!("ready_op on a run without its machine")
        };
        let verdict = if skip_check {
            Verdict::Accept
        } else {
            machine.check(&input)
        };
        match verdict {
            Verdict::Accept => self.stats.input(input.kind()),
            Verdict::Duplicate => self.stats.duplicates_dropped += 1,
            _ => {}
        }
        let dropped = match verdict {
            Verdict::Accept => None,
            Verdict::Duplicate => Some(match &input {
                // A repeated send hears the offset the first one got.
                Input::Message { stream, key, .. } => match machine.message_offset(stream, key) {
                    Some(offset) => Answer::Sent {
                        offset,
                        first: false,
                    },
                    None => Answer::Duplicate,
                },
                _ => Answer::Duplicate,
            }),
            Verdict::Full(detail) => Some(Answer::Refused(Refusal::StreamFull { run, detail })),
            Verdict::Closed => Some(Answer::Refused(Refusal::RunClosed(run))),
            Verdict::Unknown(detail) => Some(Answer::Refused(Refusal::NothingOpen { run, detail })),
        };
        if let Some(answer) = dropped {
            // What the machine knows may rest on commits still in flight:
            // answer once they are durable.
            let known = machine.next_seq().0.saturating_sub(1);
            match slot.inflight.back_mut() {
                Some(last) => last.deferred.push((origin, answer)),
                None => self.answer(origin, answer, Some((run, Seq(known)))),
            }
            return;
        }
        let committed_next = machine.next_seq();
        let handled = machine.handle(input, now);
        let closed_async = machine.take_closed_async_children();
        self.forget_async(closed_async);
        match handled {
            Ok(events) => self.commit_run(run, events, origin, false),
            Err(e) => {
                self.park(run, &e, Some(committed_next));
                let reason = e.to_string();
                self.answer(
                    origin,
                    Answer::Refused(Refusal::Parked { run, reason }),
                    None,
                );
            }
        }
    }

    /// Asks for the commit of a run's events (commit path step 4).
    pub(super) fn commit_run(
        &mut self,
        run: RunId,
        events: Vec<Event>,
        origin: Origin,
        start: bool,
    ) {
        self.commit_batch(run, CommitBatch::append(run, events), origin, start);
    }

    pub(super) fn commit_batch(
        &mut self,
        run: RunId,
        batch: CommitBatch,
        origin: Origin,
        start: bool,
    ) {
        let events = &batch.appends[0].events;
        let last_seq = events.last().expect("a commit has events").seq;
        let closing = events.iter().find_map(|e| outcome_of(&e.kind));
        let instance = events.iter().find_map(|e| match &e.kind {
            EventKind::WorkflowStarted(started) if start => {
                Some(started.instance_id.as_str().to_string())
            }
            _ => None,
        });
        let mut accepted = Vec::new();
        let mut completed = Vec::new();
        let mut sent = None;
        for e in events {
            match &e.kind {
                EventKind::MessageReceived { offset, .. } => sent = Some(*offset),
                EventKind::UpdateAccepted { update_id, .. } => accepted.push(update_id.clone()),
                EventKind::UpdateCompleted {
                    update_id,
                    result,
                    failure,
                } => completed.push((
                    update_id.clone(),
                    match failure {
                        Some(f) => Err(f.clone()),
                        None => Ok(result.clone()),
                    },
                )),
                _ => {}
            }
        }
        let token = self.token();
        self.commits.insert(token, CommitFor::Run(run));
        let mut origin = Some(origin);
        if self.breaks(BreakMode::EffectBeforeCommit) {
            // Broken on purpose: attempts run before their event is durable.
            for e in events {
                if let EventKind::ActivityScheduled {
                    step,
                    execution_id,
                    activity_type,
                    input,
                    options,
                    group,
                } = &e.kind
                {
                    let task = keel_storage::TaskEntry {
                        execution_id: *execution_id,
                        attempt: keel_storage::AttemptNo::FIRST,
                        activity_type: activity_type.clone(),
                        input: input.clone(),
                        options: (**options).clone(),
                        group: group.clone(),
                        scheduled_at: e.at,
                        due: e.at,
                        cancel_requested: false,
                        heartbeat: None,
                    };
                    let _ = step;
                    self.task_intent(task, Some((run, e.seq)), false);
                }
            }
        }
        if self.breaks(BreakMode::LoseUnsyncedAck)
            && matches!(origin, Some(Origin::Reply(ReplyTo::Client(_))))
        {
            // Broken on purpose: the client hears "done" before it is.
            let answer = if start {
                Answer::Started(run)
            } else {
                Answer::Committed
            };
            let o = origin.take().expect("checked above");
            self.answer(o, answer, Some((run, last_seq)));
        }
        let slot = self.slot(run);
        let unsettled = match &mut slot.phase {
            Phase::Ready(machine) => machine.take_unsettled_async_children(),
            _ => Vec::new(),
        };
        slot.inflight.push_back(Inflight {
            token,
            origin,
            start,
            instance,
            last_seq,
            closing,
            deferred: Vec::new(),
            accepted,
            completed,
            sent,
            unsettled,
        });
        self.push_commit(token, batch);
    }

    /// A run's commit was answered (commit path steps 5 and 6).
    pub(super) fn run_committed(
        &mut self,
        run: RunId,
        token: Token,
        result: Result<CommitAck, StoreError>,
    ) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let Some(i) = slot.inflight.iter().position(|f| f.token == token) else {
            return;
        };
        let mut entry = slot.inflight.remove(i).expect("found above");
        // Answers resting on this commit also rest on the ones before it.
        // Not those of a commit that failed: they rested on state that
        // never became durable (a duplicate of the input it held, say) and
        // are answered "retry" below, never with an earlier commit.
        if i > 0 && result.is_ok() {
            let deferred = std::mem::take(&mut entry.deferred);
            slot.inflight[i - 1].deferred.extend(deferred);
        }
        match result {
            Ok(ack) => {
                let cause: Cause = Some((run, entry.last_seq));
                if let Some(instance) = entry.instance.take() {
                    self.instance_open(run, instance);
                }
                self.removed(ack.removed);
                self.intents(ack.intents, cause);
                if let Some(origin) = entry.origin {
                    let answer = match (entry.start, entry.sent) {
                        (true, _) => Answer::Started(run),
                        (false, Some(offset)) => Answer::Sent {
                            offset,
                            first: true,
                        },
                        (false, None) => Answer::Committed,
                    };
                    self.answer(origin, answer, cause);
                }
                for (origin, answer) in entry.deferred {
                    self.answer(origin, answer, cause);
                }
                self.updates_completed(run, entry.completed, cause);
                if let Some(outcome) = entry.closing {
                    self.run_closed(run, outcome, cause);
                }
            }
            Err(e) => {
                // A close whose outcome is unknown may have been written.
                let closed_maybe = e.outcome_unknown() && entry.closing.is_some();
                if entry.start || closed_maybe {
                    self.result_waiters_read(run);
                }
                // Thrown away: the next input replays from the log.
                let slot = self.runs.get_mut(&run).expect("checked above");
                if closed_maybe {
                    // Settled as at a close if the activation finds it
                    // closed (`settle_unsure_async_closed`).
                    if let Phase::Ready(machine) = &slot.phase {
                        entry.unsettled.extend(open_async_children(machine));
                    }
                }
                if closed_maybe || (e.outcome_unknown() && !entry.unsettled.is_empty()) {
                    // Learned from its history: whether it closed, which
                    // children it scheduled.
                    slot.recheck = true;
                }
                // A parked run's termination too: the activation finds it
                // closed, or parks it again.
                let learn = slot.recheck && matches!(slot.phase, Phase::Parked(_));
                if matches!(slot.phase, Phase::Ready(_)) || learn {
                    slot.phase = Phase::Idle;
                }
                tracing::debug!(%run, error = %e, "commit failed; the run replays on its next input");
                if !e.outcome_unknown() {
                    // Nothing of it was written: the children it would
                    // have scheduled do not exist (the replay binds again
                    // those that do).
                    for child in &entry.unsettled {
                        self.workflows.unbind_async(*child);
                    }
                } else {
                    // The commit may have been written (the database went
                    // away with it in flight): the intent rows it would
                    // have handed over are read back and driven, as at
                    // recovery. (A commit refused at once, the store
                    // stopped, wrote nothing: no read-back.) Its children's
                    // closures wait for the run's next replay to say
                    // whether they were scheduled.
                    if !entry.unsettled.is_empty() {
                        let unsure = self.unsure_async.entry(run).or_default();
                        unsure.append(&mut entry.unsettled);
                    }
                    self.read(ReadQuery::IntentsOf(run), ReadFor::RunIntents(run, false));
                }
                let retry = Answer::Retry(format!("commit failed: {e}"));
                match entry.origin {
                    Some(Origin::Start(job)) => self.start_failed(*job, e),
                    Some(origin) => {
                        let answer = match &e {
                            StoreError::HistoryTooLong { .. }
                            | StoreError::PayloadTooLarge { .. } => {
                                Answer::Refused(Refusal::Store(e.to_string()))
                            }
                            _ => retry.clone(),
                        };
                        self.answer(origin, answer, None);
                    }
                    None => {}
                }
                for (origin, _) in entry.deferred {
                    self.answer(origin, retry.clone(), None);
                }
                // Accepted by a commit that failed: their clients try again.
                for reply in self.take_update_waiters(run, |id| entry.accepted.contains(id)) {
                    self.reply(reply, retry.clone(), None);
                }
            }
        }
        self.after_commit(run);
    }

    /// Once a run has no commit in flight: describe what waited, activate
    /// if inputs wait, forget a closed run.
    fn after_commit(&mut self, run: RunId) {
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        if !slot.inflight.is_empty() || !slot.markers.is_empty() {
            return;
        }
        let drained = std::mem::take(&mut slot.drained);
        let closed = slot.closed;
        for (op, origin) in drained {
            match op {
                RunOp::Query { name, args } => self.query_ready(run, name, args, origin),
                op @ RunOp::Input(_) => self.closed_op(run, op, origin),
                _ => self.describe_now(run, origin),
            }
        }
        // Operations that waited for its start (see `Shard::run_op`).
        if self.runs.get(&run).is_some_and(|s| {
            matches!(s.phase, Phase::Ready(_) | Phase::Closed) && !s.waiting.is_empty()
        }) {
            self.run_waiting(run);
        }
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        if matches!(slot.phase, Phase::Idle)
            && (!slot.waiting.is_empty() || !slot.resuming.is_empty() || slot.recheck)
        {
            self.activate(run);
        } else if closed && slot.idle() {
            self.forget(run);
        }
    }

    pub(super) fn forget(&mut self, run: RunId) {
        if let Some(slot) = self.runs.remove(&run) {
            self.lru.remove(&slot.tick);
            self.instance_gone(run, slot.instance.as_deref());
        }
    }

    /// `run`, in memory, is its instance's open run.
    fn instance_open(&mut self, run: RunId, instance: String) {
        self.open_instances.insert(instance.clone(), run);
        if let Some(slot) = self.runs.get_mut(&run) {
            slot.instance = Some(instance);
        }
    }

    /// `run`, still in memory, is no longer its instance's open run.
    fn instance_closed(&mut self, run: RunId) {
        let instance = self.runs.get_mut(&run).and_then(|s| s.instance.take());
        self.instance_gone(run, instance.as_deref());
    }

    /// `run` is no longer its instance's open run in memory here.
    fn instance_gone(&mut self, run: RunId, instance: Option<&str>) {
        if let Some(instance) = instance {
            if self.open_instances.get(instance) == Some(&run) {
                self.open_instances.remove(instance);
            }
        }
    }

    /// The run `target` (an instance id or a run id) names, when this
    /// shard knows it without reading the store: a run in memory whose
    /// start is durable and that has not closed is its instance's current
    /// run. `None`: the store decides.
    pub(super) fn resolve_here(&self, target: &str) -> Option<RunId> {
        let by_id = RunId::parse(target);
        let run = match by_id {
            Some(run) => run,
            None => *self.open_instances.get(target)?,
        };
        let slot = self.runs.get(&run)?;
        let open = matches!(slot.phase, Phase::Ready(_))
            && !slot.closed
            && !slot.inflight.iter().any(|i| i.start)
            && (by_id.is_some() || slot.instance.as_deref() == Some(target));
        open.then_some(run)
    }

    /// `run` was replayed (`None`: it does not exist): of the closures its
    /// commits whose outcome was unknown bound ahead, those of children
    /// the durable history does not leave open are forgotten (that commit
    /// was not written, or the child closed since). The replay bound the
    /// others again.
    fn settle_unsure_async(&mut self, run: RunId, replayed: Option<&RunMachine>) {
        let Some(children) = self.unsure_async.remove(&run) else {
            return;
        };
        let open = replayed.map(open_async_children).unwrap_or_default();
        for child in children {
            if !open.contains(&child) {
                self.workflows.unbind_async(child);
            }
        }
    }

    /// `run` closed with closures its commits whose outcome was unknown
    /// bound ahead: its closing commit was one of them, so those children
    /// exist; each is forgotten once found closed, as at any close.
    fn settle_unsure_async_closed(&mut self, run: RunId) {
        if let Some(children) = self.unsure_async.remove(&run) {
            self.forget_async_found_closed(children);
        }
    }

    /// A closed parent's history, read because an async child of it found
    /// no closure (a child it left running, whose start or activation
    /// came after a restart). The parent's code is replayed, which binds
    /// the closures of every call it issued; those of children it saw
    /// close are forgotten at once, and its other children are checked as
    /// at its close (`forget_open_async`). The machine is dropped.
    pub(super) fn bind_replay_read(&mut self, run: RunId, result: Result<ReadResult, StoreError>) {
        let Ok(ReadResult::History(history, _)) = result else {
            // Unreadable now: the child asks again.
            return;
        };
        let _span = tracing::debug_span!("bind_replay", run_id = %run).entered();
        let mut closed = Vec::new();
        let replayed = RunMachine::replay_taking_closed(&self.workflows, history, &mut closed);
        self.forget_async(closed);
        let Ok(machine) = replayed else {
            // It no longer replays against this code: the child parks.
            return;
        };
        let children = open_async_children(&machine);
        self.forget_async_found_closed(children);
    }

    /// `run` closed with async children whose outcome it never applied
    /// (it was terminated, timed out or cancelled first). A replay of it
    /// bound their closures again, also of one that had closed already: one
    /// known closed here is forgotten now, one not in memory is activated
    /// (`activated_closed` forgets it if it closed), and one still open
    /// forgets its own when it closes.
    fn forget_open_async(&mut self, run: RunId) {
        let Some(machine) = self.runs.get(&run).and_then(|s| s.machine()) else {
            return;
        };
        let children = open_async_children(machine);
        self.forget_async_found_closed(children);
    }

    /// Of `children`, forgets the closures of those known closed here, and
    /// activates those not in memory (`activated_closed` forgets one that
    /// closed).
    fn forget_async_found_closed(&mut self, children: Vec<RunId>) {
        let children: Vec<RunId> = children
            .into_iter()
            .filter(|child| self.workflows.async_bound(*child))
            .collect();
        for child in children {
            match self.runs.get(&child).map(|s| (&s.phase, s.closed)) {
                Some((Phase::Closed, _)) | Some((_, true)) => self.workflows.unbind_async(child),
                Some((Phase::Idle, _)) | None => {
                    self.send(child, RunOp::Activate, ReplyTo::Nobody, None)
                }
                Some(_) => {}
            }
        }
    }

    /// Forgets the closures of `children`, async children a machine saw
    /// close (a parent replayed after they closed binds them again as it
    /// re-issues the calls; kept, they would grow the table with work
    /// done).
    fn forget_async(&self, children: Vec<RunId>) {
        if self.breaks(BreakMode::KeepClosedClosures) {
            return;
        }
        for child in children {
            self.workflows.unbind_async(child);
        }
    }

    /// A closing commit of `run` was answered: whoever waits for its
    /// outcome hears it; its closures are forgotten.
    fn run_closed(&mut self, run: RunId, outcome: Outcome, cause: Cause) {
        self.forget_open_async(run);
        self.settle_unsure_async_closed(run);
        if let Some(slot) = self.runs.get_mut(&run) {
            slot.closed = true;
        }
        self.instance_closed(run);
        self.updates_end(run, Answer::Refused(Refusal::RunClosed(run)));
        self.workflows.unbind_async(run);
        if let Some(waiters) = self.results.remove(&run) {
            for reply in waiters.into_values() {
                self.answer_outcome(run, outcome.clone(), reply, cause);
            }
        }
    }

    /// Tells a client `run`'s outcome. A continue-as-new is told only once
    /// the next run exists, so that a client following it finds it: the
    /// hand-off that starts it is delivered after the closing commit.
    fn answer_outcome(&mut self, run: RunId, outcome: Outcome, reply: ReplyTo, cause: Cause) {
        let Outcome::ContinuedAsNew(next) = outcome else {
            return self.reply(reply, Answer::Outcome(run, outcome), cause);
        };
        self.when_next_exists(run, next, reply, false);
    }

    /// Tells `reply` of `next`, the run `closed` continued as, once
    /// `next`'s start is durable (its hand-off is delivered after the
    /// closing commit): a client told earlier could not find it. Its
    /// outcome as `ContinuedAsNew(next)`, or, for a start that found the
    /// instance in between, `Existing(next)`.
    pub(super) fn when_next_exists(
        &mut self,
        closed: RunId,
        next: RunId,
        reply: ReplyTo,
        existing: bool,
    ) {
        let token = self.token();
        self.continuing
            .insert(token, (closed, next, reply, 0, existing));
        self.continuation_check(token);
    }

    pub(super) fn continuation_check(&mut self, token: Token) {
        let Some(&(_, next, _, _, _)) = self.continuing.get(&token) else {
            return;
        };
        self.read(ReadQuery::RunMeta(next), ReadFor::Continuation(token));
    }

    pub(super) fn continuation_read(
        &mut self,
        token: Token,
        result: Result<ReadResult, StoreError>,
    ) {
        let Some((run, next, reply, checks, existing)) = self.continuing.remove(&token) else {
            return;
        };
        let answer = match result {
            Ok(ReadResult::RunMeta(Some(_))) if existing => Answer::Existing(next),
            Ok(ReadResult::RunMeta(Some(_))) => Answer::Outcome(run, Outcome::ContinuedAsNew(next)),
            Ok(ReadResult::RunMeta(None)) if checks < CONTINUATION_CHECKS_MAX => {
                self.continuing
                    .insert(token, (run, next, reply, checks + 1, existing));
                let at = self.now.plus_ms(CONTINUATION_CHECK_MS);
                self.due.push(at, Due::Continuation(token));
                return;
            }
            Ok(_) => Answer::Retry(format!(
                "run {run} continued as run {next}, which has not started yet"
            )),
            Err(e) => Answer::Retry(format!("run {next} unreadable: {e}")),
        };
        self.reply(reply, answer, None);
    }

    /// Parks a run: its marker is committed, everything waiting on it hears
    /// why, and nothing reaches its machine until it is resumed.
    pub(super) fn park(&mut self, run: RunId, err: &MachineError, next: Option<Seq>) {
        let reason = err.to_string();
        tracing::warn!(run_id = %run, kind = err.kind(), %reason, "run parked");
        let info = ParkInfo {
            at: self.now,
            kind: err.kind().to_string(),
            reason: reason.clone(),
        };
        self.set_marker(run, Some(info));
        self.updates_end(
            run,
            Answer::Refused(Refusal::Parked {
                run,
                reason: reason.clone(),
            }),
        );
        let slot = self.slot(run);
        slot.phase = Phase::Parked(reason.clone());
        slot.parked_next = next;
        // Its resume or termination learns the rest (`unsure_async` waits).
        slot.recheck = false;
        let waiting: Vec<_> = slot.waiting.drain(..).collect();
        let resuming = std::mem::take(&mut slot.resuming);
        for (op, origin) in waiting {
            if op == RunOp::Describe {
                self.describe_when_drained(run, origin);
            } else if matches!(
                op,
                RunOp::Input(Input::Terminate { .. } | Input::TimedOut { .. })
            ) {
                // They run no workflow code: they close the parked run (a
                // deadline timer is not retried like a client's request).
                self.run_op(run, op, origin);
            } else {
                let answer = Answer::Refused(Refusal::Parked {
                    run,
                    reason: reason.clone(),
                });
                self.answer_after_marker(run, origin, answer);
            }
        }
        for origin in resuming {
            let answer = Answer::Resumed(Resumed::still_parked(run, reason.clone()));
            self.answer_after_marker(run, origin, answer);
        }
    }

    /// Commits a run's park marker (set, or cleared).
    pub(super) fn set_marker(&mut self, run: RunId, info: Option<ParkInfo>) {
        let token = self.token();
        self.commits.insert(token, CommitFor::Marker(run));
        self.slot(run).markers.push((token, Vec::new()));
        let batch = CommitBatch {
            appends: Vec::new(),
            parked: vec![(run, info)],
            fence: None,
        };
        self.push_commit(token, batch);
    }

    /// Answers once the run's park marker being committed is durable.
    fn answer_after_marker(&mut self, run: RunId, origin: Origin, answer: Answer) {
        match self.runs.get_mut(&run).and_then(|s| s.markers.last_mut()) {
            Some((_, waiting)) => waiting.push((origin, answer)),
            None => self.answer(origin, answer, None),
        }
    }

    /// A park marker's commit was answered.
    pub(super) fn marker_committed(
        &mut self,
        run: RunId,
        token: Token,
        result: Result<CommitAck, StoreError>,
    ) {
        if let Err(e) = &result {
            tracing::warn!(run_id = %run, error = %e, "park marker not written");
        }
        let Some(slot) = self.runs.get_mut(&run) else {
            return;
        };
        let Some(i) = slot.markers.iter().position(|(t, _)| *t == token) else {
            return;
        };
        let (_, waiting) = slot.markers.remove(i);
        for (origin, answer) in waiting {
            self.answer(origin, answer, None);
        }
        self.after_commit(run);
    }

    /// Re-checks a run against the current code: a parked run (in memory,
    /// or marked in the store) is replayed again.
    pub(super) fn resume(&mut self, run: RunId, origin: Origin) {
        let slot = self.slot(run);
        match slot.phase {
            Phase::Ready(_) | Phase::Closed => {
                self.answer(origin, Answer::Resumed(Resumed::fitting(run, false)), None);
            }
            Phase::Loading => slot.resuming.push(origin),
            Phase::Parked(_) | Phase::Idle => {
                slot.phase = Phase::Idle;
                slot.resuming.push(origin);
                slot.async_tries = 0;
                slot.restarts = 0;
                self.activate(run);
            }
        }
    }

    /// A run's intent rows, read back (see [`ReadFor::RunIntents`]). Only
    /// the rows of runs on this shard are driven here, and, for a resumed
    /// run, the results and cancellations addressed to it: every other
    /// row is its own shard's to drive. (A child's start row, say, read
    /// back by the child's shard and driven there, would have that shard
    /// tell the parent of the start by running the parent's machine: two
    /// shards committing to one run.)
    /// Whether the outbox row `msg` is this shard's to drive: its owner
    /// runs here.
    pub(super) fn owns_row(&self, msg: &OutboxMessage) -> bool {
        super::shard_of(msg.owner(), self.config.shards) == self.id
    }

    pub(super) fn run_intents_read(
        &mut self,
        run: RunId,
        resumed: bool,
        result: Result<ReadResult, StoreError>,
    ) {
        match result {
            Ok(ReadResult::Intents(mut rows)) => {
                rows.retain(|row| match row {
                    Intent::Outbox(msg) => {
                        self.owns_row(msg)
                            || (resumed
                                && matches!(
                                    msg,
                                    OutboxMessage::ChildResult { .. }
                                        | OutboxMessage::CancelChild { .. }
                                ))
                    }
                    Intent::Task(_) | Intent::Timer(_) => true,
                });
                self.intents_read_back(rows, false)
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(run_id = %run, error = %e, "intents of a run unreadable; reading them again later");
                let at = self.now.plus_ms(super::RUN_UNREACHABLE_RETRY_MS);
                self.due.push(at, Due::Intents(run, resumed));
            }
        }
    }

    // ---- results --------------------------------------------------------

    fn result_op(&mut self, run: RunId, origin: Origin) {
        let Origin::Reply(reply) = origin else {
            return;
        };
        // Registered before the read: a close answered meanwhile reaches it.
        let token = self.token();
        let waiters = self.results.entry(run).or_default();
        if waiters.len() >= RESULT_WAITERS_PER_RUN_MAX {
            let why = format!("{RESULT_WAITERS_PER_RUN_MAX} clients wait for run {run}'s result");
            self.reply(reply, Answer::Retry(why), None);
            return;
        }
        if waiters.len() == RESULT_WAITERS_PER_RUN_MAX * 4 / 5 {
            tracing::warn!(run_id = %run, waiters = waiters.len(),
                limit = RESULT_WAITERS_PER_RUN_MAX, "many clients wait for this run's result");
        }
        waiters.insert(token, reply);
        // A run in memory that has not closed: its close answers the
        // waiter, no read needed. If its start is still in flight, the
        // start's commit decides: a failed start sends its waiters to the
        // store (`result_waiters_read`). (While the store is stopped the
        // read decides: an open run's waiter is answered at once.)
        let open_here = self.store_health.is_healthy()
            && self
                .runs
                .get(&run)
                .is_some_and(|slot| matches!(slot.phase, Phase::Ready(_)) && !slot.closed);
        if !open_here {
            self.read(ReadQuery::RunMeta(run), ReadFor::Result(run, token));
        }
    }

    /// A start commit failed, or a closing one whose outcome is unknown:
    /// the clients that waited on it for the run's result learn from the
    /// store whether the run exists after all (an earlier start of it, or
    /// a start whose outcome is unknown), or whether it closed.
    fn result_waiters_read(&mut self, run: RunId) {
        let tokens: Vec<Token> = self
            .results
            .get(&run)
            .map(|w| w.keys().copied().collect())
            .unwrap_or_default();
        for token in tokens {
            self.read(ReadQuery::RunMeta(run), ReadFor::Result(run, token));
        }
    }

    pub(super) fn result_read(
        &mut self,
        run: RunId,
        waiter: Token,
        result: Result<ReadResult, StoreError>,
    ) {
        let answer = match result {
            Ok(ReadResult::RunMeta(Some(meta))) if meta.status.is_closed() => Answer::Outcome(
                run,
                meta.outcome
                    .unwrap_or(Outcome::Terminated("unknown".into())),
            ),
            Ok(ReadResult::RunMeta(Some(_))) if !self.store_health.is_healthy() => {
                // No progress until the store resumes: do not hang.
                Answer::Refused(Refusal::Unavailable(self.store_health.to_string()))
            }
            Ok(ReadResult::RunMeta(Some(_))) => return, // it waits for the close
            Ok(ReadResult::RunMeta(None)) => Answer::Refused(Refusal::UnknownRun(run.to_string())),
            Ok(_) => return,
            Err(e) => Answer::Retry(format!("run unreadable: {e}")),
        };
        let Some(waiters) = self.results.get_mut(&run) else {
            return;
        };
        let Some(reply) = waiters.remove(&waiter) else {
            return; // answered by the close already
        };
        if waiters.is_empty() {
            self.results.remove(&run);
        }
        match answer {
            Answer::Outcome(run, outcome) => self.answer_outcome(run, outcome, reply, None),
            answer => self.reply(reply, answer, None),
        }
    }

    // ---- describe -------------------------------------------------------

    pub(super) fn describe_when_drained(&mut self, run: RunId, origin: Origin) {
        let slot = self.slot(run);
        if slot.inflight.is_empty() && slot.markers.is_empty() {
            self.describe_now(run, origin);
        } else {
            slot.drained.push((RunOp::Describe, origin));
        }
    }

    fn describe_now(&mut self, run: RunId, origin: Origin) {
        let Origin::Reply(reply) = origin else {
            return;
        };
        let view = self
            .runs
            .get(&run)
            .and_then(|s| s.machine())
            .filter(|m| !m.is_closed())
            .map(|m| super::MachineView {
                signal_waits: m.signal_waits(),
                streams: m.streams(),
                coroutines: m.coroutines(),
                scopes: m.scopes(),
            });
        self.read(
            ReadQuery::Describe(run),
            ReadFor::Describe(run, view, reply),
        );
    }

    // ---- passivation ----------------------------------------------------

    /// Keeps the shard's runs in memory under its limit: the least recently
    /// used idle ones are dropped (they replay from the log when needed).
    pub(super) fn passivate(&mut self) {
        let limit = self.config.run_cache_max.max(1);
        if self.runs.len() <= limit {
            return;
        }
        let mut over = self.runs.len() - limit;
        let want = (over * 4 + 16).min(PASSIVATE_SCAN_RUNS_MAX);
        // A walk that looked at its most and still left the cache over its
        // limit goes on behind where it stopped next time, so that busy runs
        // at the front (waited on for a long time) do not hide the idle
        // ones behind them; one that reaches the end starts at the front.
        let candidates: Vec<(u64, RunId)> = self
            .lru
            .range(self.passivate_from..)
            .take(want)
            .map(|(t, r)| (*t, *r))
            .collect();
        let capped = candidates.len() == want;
        let last = candidates.last().map(|(t, _)| *t);
        for (_, run) in candidates {
            if over == 0 {
                break;
            }
            let idle = self.runs.get(&run).is_some_and(RunSlot::idle)
                && !self.results.contains_key(&run)
                && !self.updates.contains_key(&run);
            if idle {
                self.forget(run);
                self.stats.passivations += 1;
                over -= 1;
            }
        }
        self.passivate_from = match last {
            Some(t) if over > 0 && capped => t + 1,
            _ => 0,
        };
    }
}

/// The outcome a closing event records.
pub(super) fn outcome_of(kind: &EventKind) -> Option<Outcome> {
    Some(match kind {
        EventKind::WorkflowCompleted { result } => Outcome::Completed(result.clone()),
        EventKind::WorkflowFailed { failure } => Outcome::Failed(failure.clone()),
        EventKind::WorkflowCancelled { reason } => Outcome::Cancelled(reason.clone()),
        EventKind::WorkflowTerminated { reason, .. } => Outcome::Terminated(reason.clone()),
        EventKind::WorkflowTimedOut { timeout, deadline } => timeout.outcome(*deadline),
        EventKind::WorkflowContinuedAsNew { new_run_id, .. } => {
            Outcome::ContinuedAsNew(*new_run_id)
        }
        _ => return None,
    })
}

/// The durable id under which a closed run committed an input's first
/// copy, for an input whose repeat it answers (a command id, a message
/// key, an update id).
fn repeat_key(input: &Input) -> Option<keel_storage::DurableKey> {
    use keel_storage::DurableKey;
    match input {
        Input::Signal { command_id, .. }
        | Input::CancelRequested { command_id, .. }
        | Input::Terminate { command_id, .. } => command_id.clone().map(DurableKey::Command),
        Input::Message { stream, key, .. } => {
            Some(DurableKey::Message(stream.clone(), key.clone()))
        }
        Input::Update { update_id, .. } => Some(DurableKey::UpdateCompleted(update_id.clone())),
        _ => None,
    }
}

/// The async children `machine` still waits for.
fn open_async_children(machine: &RunMachine) -> Vec<RunId> {
    machine
        .open_waits()
        .into_iter()
        .filter(|w| w.name == ASYNC_WORKFLOW_TYPE)
        .filter_map(|w| w.child_run)
        .collect()
}

#[cfg(test)]
mod tests {
    // Goal: only the newest activation read of a run may answer it. A run
    // can leave `Loading` before its read answers (a child's start made
    // the machine anew, its commit failed, the machine was thrown away)
    // and be activated again; the first read, answering late, holds a
    // history that may end before the commits made since.
    // Method: a run is activated, put back to idle as a failed commit
    // would, and activated again; the first read then answers with an
    // empty history (which, taken for the run's, would forget it), and
    // the run must still wait for the second read.
    use super::*;
    use crate::driver::{DriverConfig, ShardId, ShardInput};
    use crate::workflow::WorkflowRegistry;
    use keel_storage::Timestamp;

    fn activation_tokens(shard: &mut Shard) -> Vec<Token> {
        std::iter::from_fn(|| shard.poll_action())
            .filter_map(|a| match a {
                crate::driver::Action::Read {
                    token,
                    query: ReadQuery::Activation(_),
                } => Some(token),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn an_older_activation_read_does_not_answer_a_newer_activation() {
        let mut shard = Shard::new(
            ShardId(0),
            WorkflowRegistry::new(),
            DriverConfig::default(),
            0,
        );
        let run = RunId::from_u64_pair(7, 7);
        shard.slot(run);
        shard.activate(run);
        let first = activation_tokens(&mut shard);
        assert_eq!(first.len(), 1);
        // Thrown away, as after a failed commit, and activated again.
        shard.runs.get_mut(&run).expect("in memory").phase = Phase::Idle;
        shard.activate(run);
        let second = activation_tokens(&mut shard);
        assert_eq!(second.len(), 1);
        shard.handle(
            Timestamp(1),
            ShardInput::Read {
                token: first[0],
                result: Ok(ReadResult::History(Vec::new(), None)),
            },
        );
        let slot = shard
            .runs
            .get(&run)
            .expect("the stale read did not forget it");
        assert!(
            matches!(slot.phase, Phase::Loading),
            "still waits for the newer read"
        );
        shard.handle(
            Timestamp(2),
            ShardInput::Read {
                token: second[0],
                result: Ok(ReadResult::History(Vec::new(), None)),
            },
        );
        assert!(
            !shard.runs.contains_key(&run),
            "the newer read answers (an empty history: the run is unknown)"
        );
    }

    /// A parent whose one async child waits for a signal that never comes.
    struct LeavesAChild;
    impl crate::Workflow for LeavesAChild {
        const NAME: &'static str = "leaves-a-child";
        type Input = ();
        type Output = u64;
        async fn run(ctx: crate::WorkflowContext, _: ()) -> Result<u64, crate::WorkflowError> {
            Ok(ctx
                .run_async(1u64, |ctx: crate::WorkflowContext, x: u64| async move {
                    let more: u64 = ctx.wait_signal("never").await?;
                    Ok(x + more)
                })
                .await?)
        }
    }

    /// A shard holding `parent`'s machine, started, with its one async
    /// child's closure bound; that child; the start's events.
    fn parent_with_a_child(reg: &WorkflowRegistry, parent: RunId) -> (Shard, RunId, Vec<Event>) {
        let mut shard = Shard::new(ShardId(0), reg.clone(), DriverConfig::default(), 0);
        let (machine, events) = RunMachine::start(reg, start_spec(parent), Timestamp(1)).unwrap();
        let child = events
            .iter()
            .find_map(|e| match &e.kind {
                EventKind::ChildScheduled(c) => Some(c.child_run_id),
                _ => None,
            })
            .expect("the child is scheduled");
        assert!(reg.async_bound(child));
        shard.slot(parent).phase = Phase::Ready(Box::new(machine));
        (shard, child, events)
    }

    /// Commits `parent`'s `events` through `shard`, and answers the
    /// commit with `error`.
    fn commit_failing(
        shard: &mut Shard,
        parent: RunId,
        events: Vec<Event>,
        start: bool,
        error: keel_storage::Error,
    ) {
        shard.commit_run(parent, events, Origin::Reply(ReplyTo::Nobody), start);
        let token = std::iter::from_fn(|| shard.poll_action())
            .find_map(|a| match a {
                crate::driver::Action::Commit { token, .. } => Some(token),
                _ => None,
            })
            .expect("a commit");
        shard.handle(
            Timestamp(2),
            ShardInput::Committed {
                token,
                result: Err(error),
            },
        );
    }

    fn start_spec(parent: RunId) -> crate::StartSpec {
        crate::StartSpec {
            run_id: parent,
            instance_id: keel_storage::InstanceId::new("parent"),
            workflow_type: <LeavesAChild as crate::Workflow>::NAME.into(),
            input: keel_storage::Payload::encode(&()).unwrap(),
            command_id: None,
            parent: None,
            continued_from: None,
            random_seed: 7,
            previous_run: None,
            carried: Default::default(),
            memo: Vec::new(),
            search_attributes: Vec::new(),
            timeouts: Default::default(),
        }
    }

    // Goal: a parent that closes before it applied its async child's
    // outcome (terminated, timed out) does not leave the closure its
    // replay may have bound for a child that closed already. Method: a
    // parent's machine with one open async child; the parent's close is
    // answered. A child known closed here is forgotten at once; one not in
    // memory is activated, and forgotten when its read says it closed; one
    // still being loaded keeps its closure (it may run on).
    #[test]
    fn a_closing_parent_forgets_the_closures_of_children_found_closed() {
        use crate::driver::Action;
        let mut reg = WorkflowRegistry::new();
        reg.register::<LeavesAChild>();
        let terminated = Outcome::Terminated("by hand".into());

        let (mut shard, child, _) = parent_with_a_child(&reg, RunId::from_u64_pair(1, 1));
        let slot = shard.slot(child);
        slot.phase = Phase::Closed;
        slot.closed = true;
        shard.run_closed(RunId::from_u64_pair(1, 1), terminated.clone(), None);
        assert!(!reg.async_bound(child), "known closed: forgotten at once");

        let (mut shard, child, _) = parent_with_a_child(&reg, RunId::from_u64_pair(2, 2));
        shard.run_closed(RunId::from_u64_pair(2, 2), terminated.clone(), None);
        assert!(reg.async_bound(child), "not known yet");
        let mut reads: Vec<Token> = Vec::new();
        for _ in 0..4 {
            let actions: Vec<Action> = std::iter::from_fn(|| shard.poll_action()).collect();
            for a in actions {
                match a {
                    Action::Read {
                        token,
                        query: ReadQuery::Activation(r),
                    } if r == child => reads.push(token),
                    Action::Send {
                        message: crate::driver::Message::ToRun { run, op, reply },
                        ..
                    } => shard.handle(
                        Timestamp(2),
                        ShardInput::Message(crate::driver::Message::ToRun { run, op, reply }),
                    ),
                    _ => {}
                }
            }
        }
        let [token] = reads[..] else {
            panic!("one activation read of the child: {reads:?}")
        };
        shard.handle(
            Timestamp(3),
            ShardInput::Read {
                token,
                result: Ok(ReadResult::Closed),
            },
        );
        assert!(!reg.async_bound(child), "found closed: forgotten");

        let (mut shard, child, _) = parent_with_a_child(&reg, RunId::from_u64_pair(3, 3));
        shard.slot(child).phase = Phase::Loading;
        shard.run_closed(RunId::from_u64_pair(3, 3), terminated, None);
        assert!(reg.async_bound(child), "still being loaded: it may run on");
    }

    // Goal: code that ran ahead of a commit that then failed (a start
    // delivered again after its run existed, a write error) leaves no
    // closure for an async child that was never scheduled, and takes none
    // that another machine of the run bound. Method: a parent's first
    // activation binds its child's closure; the commit of its events is
    // refused; the closure must be gone. A commit whose outcome is unknown
    // (it may have been written) keeps it. Then the same start again, its
    // child bound already by the run that exists: the refused commit
    // leaves that closure alone.
    #[test]
    fn a_failed_commit_forgets_the_closures_its_code_bound_ahead() {
        let mut reg = WorkflowRegistry::new();
        reg.register::<LeavesAChild>();
        for (error, kept) in [
            (keel_storage::Error::CommitFailed("refused".into()), false),
            (connection_lost(), true),
        ] {
            let parent = RunId::from_u64_pair(4, 4);
            let (mut shard, child, events) = parent_with_a_child(&reg, parent);
            commit_failing(&mut shard, parent, events, false, error);
            assert_eq!(reg.async_bound(child), kept, "kept: {kept}");
            reg.unbind_async(child);
        }

        let parent = RunId::from_u64_pair(5, 5);
        // The run that exists, with its child running.
        let (_existing, _) = RunMachine::start(&reg, start_spec(parent), Timestamp(1)).unwrap();
        let (mut shard, child, events) = parent_with_a_child(&reg, parent);
        let exists = keel_storage::Error::SeqGap {
            run: parent,
            expected: Seq(3),
            found: Seq(1),
        };
        commit_failing(&mut shard, parent, events, true, exists);
        assert!(reg.async_bound(child), "the existing run's child keeps it");
    }

    /// A commit's answer when the database went away with it in flight.
    fn connection_lost() -> keel_storage::Error {
        keel_storage::Error::Database {
            target: "db".into(),
            fault: keel_storage::DatabaseFault::Lost,
            detail: "gone mid-commit".into(),
        }
    }

    // Goal: the closures code bound ahead of a commit whose outcome is
    // unknown do not stay for good. They are kept while the commit may
    // have been written (its child may start from the read-back), and
    // settled at the run's next activation: kept when the history leaves
    // the child open, forgotten when the run does not exist (nothing was
    // written). Method: a parent's start commit, its child's closure
    // bound, is answered "connection lost"; the parent is activated, and
    // its read answered with the start's events, or with nothing.
    #[test]
    fn closures_bound_ahead_of_a_commit_of_unknown_outcome_are_settled_at_the_next_replay() {
        let mut reg = WorkflowRegistry::new();
        reg.register::<LeavesAChild>();
        for written in [true, false] {
            let parent = RunId::from_u64_pair(8, 8);
            let (mut shard, child, events) = parent_with_a_child(&reg, parent);
            commit_failing(&mut shard, parent, events.clone(), true, connection_lost());
            assert!(reg.async_bound(child), "kept while the outcome is unknown");
            shard.activate(parent);
            let tokens = activation_tokens(&mut shard);
            let [token] = tokens[..] else {
                panic!("one activation read: {tokens:?}")
            };
            let history = if written { events } else { Vec::new() };
            shard.handle(
                Timestamp(3),
                ShardInput::Read {
                    token,
                    result: Ok(ReadResult::History(history, None)),
                },
            );
            assert_eq!(reg.async_bound(child), written, "written: {written}");
            assert!(shard.unsure_async.is_empty(), "settled");
            reg.unbind_async(child);
        }
    }

    /// Commits `parent`'s termination at `seq` through `shard`, answered
    /// "connection lost"; the actions that follow.
    fn terminate_of_unknown_outcome(
        shard: &mut Shard,
        parent: RunId,
        seq: Seq,
    ) -> Vec<crate::driver::Action> {
        let terminated = Event {
            seq,
            at: Timestamp(2),
            kind: EventKind::WorkflowTerminated {
                reason: "by hand".into(),
                command_id: None,
            },
        };
        commit_failing(shard, parent, vec![terminated], false, connection_lost());
        std::iter::from_fn(|| shard.poll_action()).collect()
    }

    // Goal: a run whose closing commit had an unknown outcome (written,
    // its answer lost) learns whether it closed: the close is what
    // forgets its closures and those of its async children, and what
    // tells the clients waiting for its result. Method: a parent with an
    // open async child and a client waiting for its result commits its
    // termination, answered "connection lost". The waiter's run record
    // must be read, and the parent activated; the activation finds it
    // closed, and the child (not in memory) is asked to activate, as at
    // any close, so that its closure goes once it is found closed.
    #[test]
    fn a_close_of_unknown_outcome_is_learned_by_an_activation() {
        use crate::driver::{Action, Message};
        let mut reg = WorkflowRegistry::new();
        reg.register::<LeavesAChild>();
        let parent = RunId::from_u64_pair(9, 9);
        let (mut shard, child, events) = parent_with_a_child(&reg, parent);
        let next = Seq(events.len() as u64 + 1);
        shard
            .results
            .entry(parent)
            .or_default()
            .insert(Token(u64::MAX), ReplyTo::Nobody);
        let actions = terminate_of_unknown_outcome(&mut shard, parent, next);
        let read_of = |want: &dyn Fn(&ReadQuery) -> bool| {
            actions.iter().find_map(|a| match a {
                Action::Read { token, query } if want(query) => Some(*token),
                _ => None,
            })
        };
        assert!(
            read_of(&|q| matches!(q, ReadQuery::RunMeta(r) if *r == parent)).is_some(),
            "the result's waiter reads the run record: {actions:?}"
        );
        let token = read_of(&|q| matches!(q, ReadQuery::Activation(r) if *r == parent))
            .unwrap_or_else(|| panic!("the run is activated: {actions:?}"));
        shard.handle(
            Timestamp(3),
            ShardInput::Read {
                token,
                result: Ok(ReadResult::Closed),
            },
        );
        let after: Vec<Action> = std::iter::from_fn(|| shard.poll_action()).collect();
        assert!(
            after.iter().any(|a| matches!(a,
                Action::Send { message: Message::ToRun { run, op: RunOp::Activate, .. }, .. }
                    if *run == child)),
            "its open child is looked at, as at a close: {after:?}"
        );
        assert!(shard.unsure_async.is_empty(), "settled");
        assert!(!shard.runs.get(&parent).is_some_and(|s| s.recheck));

        // A parked run's termination (it runs no code) of unknown outcome
        // is learned the same way: the run leaves its parked phase for the
        // activation, which finds it closed or parks it again.
        let parent = RunId::from_u64_pair(10, 10);
        let (mut shard, _, events) = parent_with_a_child(&reg, parent);
        shard.slot(parent).phase = Phase::Parked("diverged".into());
        let actions =
            terminate_of_unknown_outcome(&mut shard, parent, Seq(events.len() as u64 + 1));
        assert!(
            actions.iter().any(|a| matches!(a,
                Action::Read { query: ReadQuery::Activation(r), .. } if *r == parent)),
            "the parked run is activated: {actions:?}"
        );
    }

    // Goal: an async child left running by a parent that closed finds its
    // closure after a restart. Only the parent's code can bind it, and a
    // closed run is never activated, so the child parked after its tries.
    // Method: a process with no closures holds the parent closed (its
    // history: the start with the child's call, then its termination);
    // the child's request to activate the parent must read the parent's
    // history (once, however many children ask together), and its replay
    // bind the child's closure.
    #[test]
    fn a_closed_parent_binds_the_closure_of_a_child_it_left_running() {
        use crate::driver::Action;
        let mut reg = WorkflowRegistry::new();
        reg.register::<LeavesAChild>();
        let parent = RunId::from_u64_pair(6, 6);
        let (_, mut history) = RunMachine::start(&reg, start_spec(parent), Timestamp(1)).unwrap();
        let child = history
            .iter()
            .find_map(|e| match &e.kind {
                EventKind::ChildScheduled(c) => Some(c.child_run_id),
                _ => None,
            })
            .expect("the child is scheduled");
        history.push(Event {
            seq: Seq(history.len() as u64 + 1),
            at: Timestamp(2),
            kind: EventKind::WorkflowTerminated {
                reason: "by hand".into(),
                command_id: None,
            },
        });
        // A process that just started.
        let fresh = reg.with_fresh_closures();
        let mut shard = Shard::new(ShardId(0), fresh.clone(), DriverConfig::default(), 0);
        let slot = shard.slot(parent);
        slot.phase = Phase::Closed;
        slot.closed = true;
        // Two children ask together: one read serves both.
        shard.run_op(parent, RunOp::Activate, Origin::Reply(ReplyTo::Nobody));
        shard.run_op(parent, RunOp::Activate, Origin::Reply(ReplyTo::Nobody));
        let reads: Vec<Token> = std::iter::from_fn(|| shard.poll_action())
            .filter_map(|a| match a {
                Action::Read {
                    token,
                    query: ReadQuery::History(r),
                } if r == parent => Some(token),
                _ => None,
            })
            .collect();
        let [token] = reads[..] else {
            panic!("one read of the parent's history: {reads:?}")
        };
        assert!(!fresh.async_bound(child));
        shard.handle(
            Timestamp(3),
            ShardInput::Read {
                token,
                result: Ok(ReadResult::History(history, None)),
            },
        );
        assert!(fresh.async_bound(child), "the replay bound it");
    }
}
