//! Client requests and starts.
//!
//! A start reads the instance's current run and decides: the open run
//! answers it (a second start of a running instance), an earlier start with
//! the same command id answers it (a retry), the reuse policy decides for a
//! closed instance, and a chain that continued as new answers with its next
//! run. The new run's `WorkflowStarted` records the run it follows, so the
//! commit refuses the start if another took the instance meanwhile; the
//! start is then decided again.
//!
//! Every other request names an instance or a run; the receiving shard
//! resolves it and hands the operation to the run's shard.

use keel_storage::search;
use keel_storage::{
    CommitBatch, Error as StoreError, Event, Outcome, ParkInfo, RunId, RunStatus, Seq,
};

use super::{
    run::Phase, Answer, Origin, ReadFor, ReadQuery, ReadResult, Refusal, ReplyTo, Request,
    RequestId, ReusePolicy, RunOp, Shard, START_DECISIONS_MAX,
};
use crate::machine::{Input, MachineError, RunMachine, StartSpec};

/// A start being decided.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct StartJob {
    spec: StartSpec,
    then: Option<Input>,
    /// `Some` for a client's start; internal starts (children,
    /// continuations) have no reuse policy.
    reuse: Option<ReusePolicy>,
    reply: ReplyTo,
    decisions: u32,
    /// Times an async child's start waited for its parent to bind its
    /// closure.
    bind_tries: u32,
}

impl StartJob {
    /// Who waits for the start's answer.
    pub(super) fn reply_to(&self) -> ReplyTo {
        self.reply
    }
}

impl Shard {
    pub(super) fn request(&mut self, id: RequestId, request: Request) {
        let reply = ReplyTo::Client(id);
        let writes = !matches!(
            request,
            Request::Result { .. }
                | Request::Describe { .. }
                | Request::Query { .. }
                | Request::List { .. }
        );
        if !self.store_health.is_healthy() && (writes || self.shut_down) {
            let refusal = Refusal::Unavailable(self.store_health.to_string());
            return self.reply(reply, Answer::Refused(refusal), None);
        }
        if self.shut_down {
            return self.reply(reply, Answer::Refused(Refusal::Shutdown), None);
        }
        let (target, op) = match request {
            Request::Start {
                run_id,
                workflow_type,
                instance,
                input,
                command_id,
                reuse,
                random_seed,
                signal,
                memo,
                search_attributes,
                timeouts,
                await_outcome,
            } => {
                // A signal-with-start is answered for its signal when the
                // instance runs already: it does not wait for an outcome.
                if await_outcome && signal.is_none() {
                    self.outcome_starts.insert(id);
                }
                let Some(w) = self.workflows.get(&workflow_type) else {
                    let r = Refusal::UnknownWorkflowType(workflow_type);
                    return self.reply(reply, Answer::Refused(r), None);
                };
                let checked = w.check_input(&input).and_then(|()| {
                    search::start_metadata(None, &search_attributes, &memo)
                        .map(drop)
                        .map_err(|e| format!("memo or search attributes: {e}"))
                });
                if let Err(detail) = checked {
                    let r = Refusal::InvalidInput {
                        workflow_type,
                        detail,
                    };
                    return self.reply(reply, Answer::Refused(r), None);
                }
                let spec = StartSpec {
                    run_id,
                    instance_id: instance,
                    workflow_type,
                    input,
                    command_id,
                    parent: None,
                    continued_from: None,
                    random_seed,
                    previous_run: None,
                    carried: Default::default(),
                    memo,
                    search_attributes,
                    timeouts: timeouts.at(self.now),
                };
                let then = signal.map(|s| Input::Signal {
                    name: s.name,
                    payload: s.payload,
                    command_id: s.command_id,
                });
                let job = StartJob {
                    spec,
                    then,
                    reuse: Some(reuse),
                    reply,
                    decisions: 0,
                    bind_tries: 0,
                };
                return self.decide_start(job);
            }
            Request::Signal {
                target,
                name,
                payload,
                command_id,
            } => (
                target,
                RunOp::Input(Input::Signal {
                    name,
                    payload,
                    command_id,
                }),
            ),
            Request::SendMessage {
                target,
                stream,
                key,
                payload,
            } => {
                if let Err(detail) = keel_storage::check_stream_message(&stream, &key) {
                    return self.reply(reply, Answer::Refused(Refusal::BadMessage(detail)), None);
                }
                (
                    target,
                    RunOp::Input(Input::Message {
                        stream,
                        key,
                        payload,
                    }),
                )
            }
            Request::Cancel {
                target,
                reason,
                command_id,
            } => (
                target,
                RunOp::Input(Input::CancelRequested { reason, command_id }),
            ),
            Request::Terminate {
                target,
                reason,
                command_id,
            } => (
                target,
                RunOp::Input(Input::Terminate { reason, command_id }),
            ),
            Request::Result { target } => (target, RunOp::Result),
            Request::Describe { target } => (target, RunOp::Describe),
            Request::Resume { target } => (target, RunOp::Resume),
            Request::Query { target, name, args } => (target, RunOp::Query { name, args }),
            Request::List {
                filter,
                page_size,
                after,
            } => {
                if let Err(e) = filter.check() {
                    let answer = Answer::Refused(Refusal::BadFilter(e.to_string()));
                    return self.reply(reply, answer, None);
                }
                let query = ReadQuery::List {
                    filter,
                    page_size,
                    after,
                };
                self.read(query, ReadFor::List(reply));
                return;
            }
            Request::Update {
                target,
                name,
                args,
                update_id,
            } => (
                target,
                RunOp::Input(Input::Update {
                    update_id,
                    name,
                    payload: args,
                }),
            ),
        };
        self.resolve(target, op, reply);
    }

    /// Hands `op` to the run `target` names: at once when this shard knows
    /// it ([`Shard::resolve_here`]), else once the store has told.
    pub(super) fn resolve(&mut self, target: String, op: RunOp, reply: ReplyTo) {
        match self.resolve_here(&target) {
            Some(run) => self.resolved(op, reply, &target, Ok(ReadResult::Resolved(Some(run)))),
            None => {
                let query = ReadQuery::Resolve(target.clone());
                self.read(query, ReadFor::Resolve { op, reply, target });
            }
        }
    }

    /// The request's target resolved: hand the operation to its run.
    pub(super) fn resolved(
        &mut self,
        op: RunOp,
        reply: ReplyTo,
        target: &str,
        result: Result<ReadResult, StoreError>,
    ) {
        match result {
            Ok(ReadResult::Resolved(Some(run))) => {
                if let ReplyTo::Shard(from, token) = reply {
                    if from == self.id {
                        // One of this shard's own sends to an instance.
                        self.outbox_resolved(token, run);
                    }
                }
                if super::shard_of(run, self.config.shards) == self.id {
                    self.run_op(run, op, Origin::Reply(reply));
                } else {
                    self.send(run, op, reply, None);
                }
            }
            Ok(ReadResult::Resolved(None)) => {
                let answer = Answer::Refused(Refusal::UnknownRun(target.to_string()));
                self.reply(reply, answer, None);
            }
            // A signal, cancel or terminate for an instance in the middle
            // of its continue-as-new belongs to the next run: asked again
            // shortly, the instance names it. Reads see the closed run.
            Ok(ReadResult::Continuing { closed, next }) => match op {
                RunOp::Input(_) => {
                    let why = format!(
                        "the instance is continuing as new from run {closed} to run {next}"
                    );
                    self.reply(reply, Answer::Retry(why), None);
                }
                op => self.resolved(op, reply, target, Ok(ReadResult::Resolved(Some(closed)))),
            },
            Ok(_) => {}
            Err(e) => self.reply(reply, Answer::Retry(format!("store unreadable: {e}")), None),
        }
    }

    /// A child's or a continuation's start, from the outbox of a shard.
    pub(super) fn start_internal(&mut self, spec: StartSpec, then: Option<Input>, reply: ReplyTo) {
        if self.shut_down {
            return self.reply(reply, Answer::Retry("the engine is shut down".into()), None);
        }
        let job = StartJob {
            spec,
            then,
            reuse: None,
            reply,
            decisions: 0,
            bind_tries: 0,
        };
        self.decide_start(job);
    }

    fn decide_start(&mut self, mut job: StartJob) {
        job.decisions += 1;
        let Some(job) = self.not_here_yet(job) else {
            return;
        };
        // The first decision is optimistic: most starts are of a new
        // instance (or continue the run they name), and the store refuses
        // a start whose `previous_run` is not the instance's run (written,
        // durable or not). Only a refused start reads the instance and is
        // decided on what is durable.
        if job.decisions == 1 {
            return self.create(job);
        }
        let instance = job.spec.instance_id.clone();
        self.read(
            ReadQuery::Instance(instance),
            ReadFor::Instance(Box::new(job)),
        );
    }

    pub(super) fn instance_read(
        &mut self,
        mut job: StartJob,
        result: Result<ReadResult, StoreError>,
    ) {
        let state = match result {
            Ok(ReadResult::Instance(state)) => state,
            Ok(_) => return,
            Err(e) => {
                let answer = Answer::Retry(format!("instance unreadable: {e}"));
                return self.reply(job.reply, answer, None);
            }
        };
        let run = job.spec.run_id;
        let previous = match state {
            None => None,
            Some(st) => {
                let current = st.run.run_id;
                if current == run || st.starts.iter().any(|(r, _)| *r == run) {
                    // Delivered again after it committed (a child's start
                    // after a crash, to tell its parent; the run may have
                    // continued as new since).
                    return self.reply(job.reply, Answer::Existing(run), None);
                }
                // A retried start is the run it started, open or closed,
                // whatever ran after it (signal-with-start: its signal was
                // committed with that start).
                let same = job.spec.command_id.as_ref().and_then(|c| {
                    st.starts
                        .iter()
                        .find(|(_, started_by)| started_by.as_ref() == Some(c))
                });
                if let (Some(_), Some(&(started, _))) = (job.reuse, same) {
                    return self.reply(job.reply, Answer::Existing(started), None);
                }
                if !st.run.status.is_closed() {
                    if job.reuse.is_none() {
                        // A child named after an instance another run
                        // holds: never answered as that run.
                        let r = Refusal::Store(format!(
                            "instance {} is running as run {current}",
                            job.spec.instance_id
                        ));
                        return self.reply(job.reply, Answer::Refused(r), None);
                    }
                    return self.existing(job, current);
                }
                match (job.reuse, &st.run.outcome) {
                    // A chain that continued as new is still running.
                    (Some(_), Some(Outcome::ContinuedAsNew(next))) => {
                        // `next`'s own start may not be durable yet. A
                        // start that awaits its outcome waits on the run
                        // that continued, whose outcome is answered once
                        // it is (the client follows it from there); a
                        // signal-with-start resolves the instance (asked
                        // again until `next` holds it); any other start
                        // is told of `next` once it exists.
                        if self.awaits_outcome(job.reply) {
                            return self.existing(job, current);
                        }
                        if matches!(job.then, Some(Input::Signal { .. })) {
                            return self.existing(job, *next);
                        }
                        return self.when_next_exists(current, *next, job.reply, true);
                    }
                    (Some(reuse), _) => {
                        let refuse = match reuse {
                            ReusePolicy::AllowDuplicate => false,
                            ReusePolicy::AllowDuplicateFailedOnly => {
                                st.run.status == RunStatus::Completed
                            }
                            ReusePolicy::RejectDuplicate => true,
                        };
                        if refuse {
                            let r = Refusal::AlreadyClosed {
                                instance: job.spec.instance_id.clone(),
                                run: current,
                                status: st.run.status.name(),
                            };
                            return self.reply(job.reply, Answer::Refused(r), None);
                        }
                        Some(current)
                    }
                    (None, _) => {
                        if job.spec.previous_run != Some(current) {
                            // Internal starts have a fixed place in their
                            // instance (a child's is new; a continuation
                            // follows its run).
                            let r = Refusal::Store(format!(
                                "instance {} moved on to run {current}",
                                job.spec.instance_id
                            ));
                            return self.reply(job.reply, Answer::Refused(r), None);
                        }
                        Some(current)
                    }
                }
            }
        };
        if job.reuse.is_some() {
            job.spec.previous_run = previous;
        }
        self.create(job);
    }

    /// True for a client's start that waits for its run's outcome
    /// ([`Request::Start`]'s `await_outcome`).
    fn awaits_outcome(&self, reply: ReplyTo) -> bool {
        matches!(reply, ReplyTo::Client(id) if self.outcome_starts.contains(&id))
    }

    /// A client's start found the instance running as `run`: that run
    /// answers it. A signal-with-start's signal goes to the instance
    /// instead (resolved again, so it follows a continue-as-new).
    fn existing(&mut self, job: StartJob, run: RunId) {
        match (job.reuse, job.then) {
            (Some(_), Some(signal @ Input::Signal { .. })) => {
                let target = job.spec.instance_id.to_string();
                self.resolve(target, RunOp::Input(signal), job.reply);
            }
            _ => self.reply(job.reply, Answer::Existing(run), None),
        }
    }

    /// The start's job, unless its run is in memory here already. A run
    /// whose start is committed or in flight (the start was delivered
    /// twice, or the run was loaded for an input while its start was
    /// decided on a read from before its first start) exists: answered
    /// `Existing` once that is durable, and its machine is never replaced
    /// by a new one. A run still being loaded has no machine yet: the
    /// start goes ahead, its read is ignored when it answers, and what
    /// waited for it waits for the start's answer (`Shard::run_op`); if
    /// the run existed, the start is refused and the run is loaded again.
    fn not_here_yet(&mut self, job: StartJob) -> Option<StartJob> {
        let run = job.spec.run_id;
        match self.runs.get(&run) {
            Some(slot) if slot.exists() => {
                let origin = Origin::Reply(job.reply);
                self.answer_when_durable(run, origin, Answer::Existing(run));
                None
            }
            _ => Some(job),
        }
    }

    /// Starts the run: its first activation's events (and `then`'s) in one
    /// commit.
    fn create(&mut self, job: StartJob) {
        let Some(mut job) = self.not_here_yet(job) else {
            return;
        };
        let run = job.spec.run_id;
        let now = self.now;
        // An async child runs the closure its parent binds when it issues
        // (or replays) the call: after a restart the parent may not have
        // replayed yet. Replay it (wherever its shard is), then try again.
        if let (true, Some(parent)) = (
            job.spec.workflow_type == crate::concurrency::ASYNC_WORKFLOW_TYPE,
            job.spec.parent.as_ref().map(|p| p.run_id),
        ) {
            if !self.workflows.async_bound(run) && job.bind_tries < super::ASYNC_BIND_TRIES_MAX {
                job.bind_tries += 1;
                self.send(parent, RunOp::Activate, ReplyTo::Nobody, None);
                let at = now.plus_ms(super::ASYNC_BIND_RETRY_MS);
                self.due.push(at, super::Due::Start(Box::new(job)));
                return;
            }
        }
        match RunMachine::start(&self.workflows, job.spec.clone(), now) {
            Ok((mut machine, mut events)) => {
                if let Some(then) = job.then.clone() {
                    match machine.handle(then, now) {
                        Ok(more) => events.extend(more),
                        Err(e) => return self.create_parked(job, e),
                    }
                }
                let slot = self.slot(run);
                slot.phase = Phase::Ready(Box::new(machine));
                self.stats.input("start");
                // Operations that wait for the run (they came while it was
                // being loaded: a cancellation sent to a child not started
                // yet) run once the start is answered
                // (`Shard::after_commit`), as later ones do.
                self.commit_run(run, events, Origin::Start(Box::new(job)), true);
            }
            Err(e @ (MachineError::UnknownWorkflowType(_) | MachineError::InputDecode(_)))
                if job.reuse.is_some() =>
            {
                let r = match e {
                    MachineError::UnknownWorkflowType(t) => Refusal::UnknownWorkflowType(t),
                    other => Refusal::InvalidInput {
                        workflow_type: job.spec.workflow_type.clone(),
                        detail: other.to_string(),
                    },
                };
                self.reply(job.reply, Answer::Refused(r), None);
            }
            Err(e) => self.create_parked(job, e),
        }
    }

    /// A run whose first activation cannot run here (its code panicked or
    /// diverged, or a child's type is unknown to this build): its start is
    /// committed with the run parked, visible and resumable, rather than
    /// lost or failed.
    fn create_parked(&mut self, job: StartJob, err: MachineError) {
        let run = job.spec.run_id;
        let spec = job.spec.clone();
        let started = Event {
            seq: Seq::FIRST,
            at: self.now,
            kind: spec.into_event_kind(),
        };
        let reason = err.to_string();
        tracing::warn!(run_id = %run, kind = err.kind(), %reason, "run parked at its start");
        let info = ParkInfo {
            at: self.now,
            kind: err.kind().to_string(),
            reason: reason.clone(),
        };
        let slot = self.slot(run);
        slot.phase = Phase::Parked(reason);
        slot.parked_next = Some(Seq(2));
        let batch = CommitBatch {
            appends: vec![keel_storage::RunAppend {
                run_id: run,
                events: vec![started],
            }],
            parked: vec![(run, Some(info))],
            fence: None,
        };
        self.commit_batch(run, batch, Origin::Start(Box::new(job)), true);
    }

    /// The start's commit failed. The store validates against everything
    /// written, durable or not; a decision may only rest on what is durable,
    /// which reads show. So when another run holds the instance, or the run
    /// exists already, the start is decided again from a fresh read (which
    /// answers `Existing` once that run's start is durable). A child's start
    /// whose run exists is answered `Existing` at once: no read is needed.
    pub(super) fn start_failed(&mut self, job: StartJob, e: StoreError) {
        let run = job.spec.run_id;
        match e {
            // A child's start delivered again after it committed (its run
            // id is its own, and the run is not in memory here, so its
            // start is durable): however many runs the child has continued
            // to since, the parent is told it started.
            StoreError::SeqGap { run: r, .. } | StoreError::RunClosed { run: r }
                if r == run && job.reuse.is_none() && job.spec.parent.is_some() =>
            {
                self.forget_failed_start(run);
                self.reply(job.reply, Answer::Existing(run), None);
            }
            StoreError::InstanceRunning { .. }
            | StoreError::InstanceMoved { .. }
            | StoreError::SeqGap { .. }
            | StoreError::RunClosed { .. }
                if job.decisions < START_DECISIONS_MAX =>
            {
                self.forget_failed_start(run);
                if job.decisions == 1 {
                    // The optimistic decision was wrong: decide on a read.
                    return self.decide_start(job);
                }
                let at = self.now.plus_ms(Self::backoff(job.decisions));
                self.due.push(at, super::Due::Start(Box::new(job)));
            }
            StoreError::PayloadTooLarge { .. } | StoreError::HistoryTooLong { .. } => {
                self.forget_failed_start(run);
                let answer = Answer::Refused(Refusal::Store(e.to_string()));
                self.reply(job.reply, answer, None);
            }
            other => {
                self.forget_failed_start(run);
                let answer = Answer::Retry(format!("start not committed: {other}"));
                self.reply(job.reply, answer, None);
            }
        }
    }

    pub(super) fn start_again(&mut self, job: StartJob) {
        self.decide_start(job);
    }

    fn forget_failed_start(&mut self, run: RunId) {
        if self.runs.get(&run).is_some_and(|s| s.idle()) {
            self.forget(run);
        }
    }

    /// The answer to a start committed through [`Origin::Start`].
    pub(super) fn start_answered(&mut self, job: StartJob, answer: Answer, cause: super::Cause) {
        self.reply(job.reply, answer, cause);
    }
}

#[cfg(test)]
mod tests {
    // Goal: a start that waits for its outcome leaves nothing behind when
    // it is refused: the refusal reaches the client as it is, and the
    // shard forgets the request (a later answer with the same id is not
    // turned into a wait). Method: a shard with no workflow registered is
    // asked for such a start; its actions and its set of waiting starts
    // are read.
    use super::*;
    use crate::driver::{Action, DriverConfig, ShardId, ShardInput};
    use crate::workflow::WorkflowRegistry;
    use keel_storage::{InstanceId, Payload, Timestamp};

    /// A client's start of `run` as `workflow_type`, instance `instance`,
    /// with no input, signal or metadata.
    fn start_request(
        run: RunId,
        workflow_type: &str,
        instance: &str,
        await_outcome: bool,
    ) -> Request {
        Request::Start {
            run_id: run,
            workflow_type: workflow_type.into(),
            instance: InstanceId::new(instance),
            input: Payload::encode(&()).unwrap(),
            command_id: None,
            reuse: ReusePolicy::default(),
            random_seed: 0,
            signal: None,
            memo: Vec::new(),
            search_attributes: Vec::new(),
            timeouts: Default::default(),
            await_outcome,
        }
    }

    #[test]
    fn a_refused_start_that_awaits_its_outcome_is_answered_and_forgotten() {
        let mut shard = Shard::new(
            ShardId(0),
            WorkflowRegistry::new(),
            DriverConfig::default(),
            0,
        );
        let request = start_request(RunId::from_u64_pair(1, 1), "nowhere", "i", true);
        shard.handle(
            Timestamp(1),
            ShardInput::Request {
                id: RequestId(3),
                request,
            },
        );
        let actions: Vec<Action> = std::iter::from_fn(|| shard.poll_action()).collect();
        assert!(
            matches!(
                actions.as_slice(),
                [Action::Reply {
                    id: RequestId(3),
                    answer: Answer::Refused(Refusal::UnknownWorkflowType(_)),
                    ..
                }]
            ),
            "{actions:?}"
        );
        assert!(shard.outcome_starts.is_empty(), "the request is forgotten");
    }

    // Goal: a start delivered again never replaces the machine of its run.
    // A continuation's start, redelivered, is refused by the store (the run
    // exists), decided again on a read of the instance, and meanwhile the
    // run is loaded from its durable history for an input; the read,
    // taken before the first start, says the run has not started. The
    // second start used to build a new machine over the loaded one: its
    // commit was refused, but inputs built on it were committed after the
    // durable history (the simulator found a timer's fire time taken from
    // that machine). And an input that arrives while any start is in flight
    // waits for its answer, so nothing is built on a start that is refused.
    // Method: a shard with one workflow (a 300 ms timer) is handed the
    // messages and read answers of that race by hand; its actions are read.

    use crate::driver::{Message, RunOp};
    use crate::{Workflow, WorkflowContext, WorkflowError};
    use keel_storage::{
        Carried, Error as StoreError, Event, InstanceMeta, RunMeta, RunStatus, Seq,
    };

    struct Nap;
    impl Workflow for Nap {
        const NAME: &'static str = "nap";
        type Input = ();
        type Output = ();
        async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
            ctx.timer(std::time::Duration::from_millis(300)).await;
            Ok(())
        }
    }

    struct Race {
        shard: Shard,
        spec: StartSpec,
        /// The run's durable history: started at 100, its timer due at 400.
        durable: Vec<Event>,
    }

    fn race() -> Race {
        let mut reg = WorkflowRegistry::new();
        reg.register::<Nap>();
        let config = DriverConfig {
            shards: 1,
            ..DriverConfig::default()
        };
        let shard = Shard::new(ShardId(0), reg.clone(), config, 0);
        let spec = StartSpec::continuation(
            RunId::from_u64_pair(1, 1),
            InstanceId::new("nap"),
            Nap::NAME.into(),
            RunId::from_u64_pair(1, 2),
            Payload::encode(&()).unwrap(),
            None,
            Carried::default(),
        );
        let (_, durable) = RunMachine::start(&reg, spec.clone(), Timestamp(100)).unwrap();
        Race {
            shard,
            spec,
            durable,
        }
    }

    /// Instance `nap` as its run (1, 1) left it: continued as new to
    /// `next`, whose start is not durable yet.
    fn continued_to(next: RunId) -> crate::driver::InstanceState {
        let closed = RunMeta {
            run_id: RunId::from_u64_pair(1, 1),
            instance_id: InstanceId::new("nap"),
            workflow_type: Nap::NAME.into(),
            status: RunStatus::ContinuedAsNew,
            next_seq: Seq(3),
            parent: None,
            started_at: Timestamp(10),
            updated_at: Timestamp(90),
            closed_at: Some(Timestamp(90)),
            outcome: Some(keel_storage::Outcome::ContinuedAsNew(next)),
            cancel_requested: false,
            search_attributes: Vec::new(),
            memo: Vec::new(),
        };
        crate::driver::InstanceState {
            instance: InstanceMeta {
                current_run: closed.run_id,
                started_at: Timestamp(10),
            },
            run: closed,
            starts: Vec::new(),
        }
    }

    fn actions(shard: &mut Shard) -> Vec<Action> {
        std::iter::from_fn(|| shard.poll_action()).collect()
    }

    fn commits(actions: &[Action]) -> Vec<(crate::driver::Token, Vec<Event>)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Commit { token, batch, .. } => Some((
                    *token,
                    batch
                        .appends
                        .iter()
                        .flat_map(|a| a.events.clone())
                        .collect(),
                )),
                _ => None,
            })
            .collect()
    }

    fn read_token(actions: &[Action], what: impl Fn(&ReadQuery) -> bool) -> crate::driver::Token {
        actions
            .iter()
            .find_map(|a| match a {
                Action::Read { token, query } if what(query) => Some(*token),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no such read in {actions:?}"))
    }

    fn start(r: &mut Race, at: u64) {
        let message = Message::Start {
            spec: Box::new(r.spec.clone()),
            then: None,
            reply: ReplyTo::Nobody,
        };
        r.shard.handle(Timestamp(at), ShardInput::Message(message));
    }

    fn signal(r: &mut Race, at: u64) {
        let message = Message::ToRun {
            run: r.spec.run_id,
            op: RunOp::Input(Input::Signal {
                name: "s".into(),
                payload: Payload::encode(&()).unwrap(),
                command_id: None,
            }),
            reply: ReplyTo::Nobody,
        };
        r.shard.handle(Timestamp(at), ShardInput::Message(message));
    }

    /// Answers the activation read among `asked` with the durable history;
    /// the signal waiting for it is then committed after that history.
    fn signal_on_the_durable_history(r: &mut Race, asked: &[Action]) {
        let history = read_token(asked, |q| matches!(q, ReadQuery::Activation(_)));
        r.shard.handle(
            Timestamp(153),
            ShardInput::Read {
                token: history,
                result: Ok(ReadResult::History(r.durable.clone(), None)),
            },
        );
        let signalled = commits(&actions(&mut r.shard));
        assert_eq!(
            signalled.len(),
            1,
            "the signal, on the loaded run: {signalled:?}"
        );
        assert_eq!(signalled[0].1[0].seq, Seq(3));
    }

    fn refuse(r: &mut Race, token: crate::driver::Token, at: u64) {
        let e = StoreError::SeqGap {
            run: r.spec.run_id,
            expected: Seq(3),
            found: Seq::FIRST,
        };
        r.shard.handle(
            Timestamp(at),
            ShardInput::Committed {
                token,
                result: Err(e),
            },
        );
    }

    #[test]
    fn a_start_decided_on_a_stale_read_does_not_replace_a_loaded_run() {
        let mut r = race();
        let run = r.spec.run_id;
        start(&mut r, 150);
        let first = commits(&actions(&mut r.shard));
        assert_eq!(first.len(), 1, "the optimistic start: {first:?}");
        refuse(&mut r, first[0].0, 151);
        let after = actions(&mut r.shard);
        let instance = read_token(&after, |q| matches!(q, ReadQuery::Instance(_)));
        // An input loads the run from its durable history meanwhile.
        signal(&mut r, 152);
        let loading = actions(&mut r.shard);
        signal_on_the_durable_history(&mut r, &loading);
        // The instance read answers as before the first start.
        let state = continued_to(run);
        r.shard.handle(
            Timestamp(154),
            ShardInput::Read {
                token: instance,
                result: Ok(ReadResult::Instance(Some(state))),
            },
        );
        let decided = commits(&actions(&mut r.shard));
        assert!(
            decided.is_empty(),
            "no second start over the loaded run: {decided:?}"
        );
        // The loaded machine is the durable one: its timer fires at 400.
        let message = Message::ToRun {
            run,
            op: RunOp::Input(Input::TimerFired {
                step: keel_storage::Step(1),
            }),
            reply: ReplyTo::Nobody,
        };
        r.shard.handle(Timestamp(400), ShardInput::Message(message));
        let fired = commits(&actions(&mut r.shard));
        let fire_at = fired
            .iter()
            .flat_map(|(_, es)| es)
            .find_map(|e| match &e.kind {
                keel_storage::EventKind::TimerFired { fire_at, .. } => Some(*fire_at),
                _ => None,
            });
        assert_eq!(fire_at, Some(Timestamp(400)), "{fired:?}");
    }

    #[test]
    fn an_input_waits_for_its_runs_start_to_be_answered() {
        let mut r = race();
        start(&mut r, 150);
        let first = commits(&actions(&mut r.shard));
        assert_eq!(first.len(), 1);
        signal(&mut r, 151);
        let while_starting = commits(&actions(&mut r.shard));
        assert!(
            while_starting.is_empty(),
            "nothing is built on a start in flight: {while_starting:?}"
        );
        // The start is refused (the run exists): the input is taken on the
        // durable history.
        refuse(&mut r, first[0].0, 152);
        let after = actions(&mut r.shard);
        assert!(commits(&after).is_empty(), "{after:?}");
        signal_on_the_durable_history(&mut r, &after);
    }

    // Goal: a shard that leaves its process answers the sender of a start
    // whose commit is in flight. Its in-flight commits' other waiters were
    // answered "moved", but a start's sender (the shard delivering a
    // continuation's start, say) was not, and waited for its own timeout
    // (`OUTBOX_ANSWER_WAIT_MS`, 10 s) to deliver it again: `keel sim
    // --processes 3` found a continuation stuck that long behind a process
    // that froze past its lease. Method: a start from another shard is
    // handed to a shard, which commits it; the shard then loses its lease.
    #[test]
    fn a_shard_that_moves_answers_the_sender_of_a_start_in_flight() {
        let mut r = race();
        let message = Message::Start {
            spec: Box::new(r.spec.clone()),
            then: None,
            reply: ReplyTo::Shard(ShardId(2), crate::driver::Token(7)),
        };
        r.shard.handle(Timestamp(150), ShardInput::Message(message));
        assert_eq!(
            commits(&actions(&mut r.shard)).len(),
            1,
            "the start's commit"
        );
        r.shard.lose("its lease ended".into());
        let after = actions(&mut r.shard);
        assert!(
            after.iter().any(|a| matches!(
                a,
                Action::Send {
                    to: ShardId(2),
                    message: Message::Answer {
                        token: crate::driver::Token(7),
                        answer: Answer::Retry(_),
                    },
                    ..
                }
            )),
            "the sender is told to deliver it again: {after:?}"
        );
    }

    // Goal: a client's start that finds its instance between a run that
    // continued as new and the next run's start is told of the next run
    // only once that run exists; told earlier, it could not find it (a
    // describe or a result by run id would say "unknown run"). Method: a
    // shard is asked for a start of instance `nap`; its commit is refused
    // (the instance has a run) and the instance read that follows says
    // "continued as new to run N"; the shard must read N's record instead
    // of answering, read it again while N is missing, and answer
    // `Existing(N)` once it is there.
    #[test]
    fn a_start_in_the_continue_as_new_window_is_told_of_the_next_run_once_it_exists() {
        let mut reg = WorkflowRegistry::new();
        reg.register::<Nap>();
        let mut shard = Shard::new(ShardId(0), reg, DriverConfig::default(), 0);
        let next = RunId::from_u64_pair(1, 2);
        let request = start_request(RunId::from_u64_pair(1, 3), Nap::NAME, "nap", false);
        let id = RequestId(4);
        shard.handle(Timestamp(1), ShardInput::Request { id, request });
        // Decided as a first start; the store says the instance has a run.
        let (token, _) = commits(&actions(&mut shard)).remove(0);
        let moved = StoreError::InstanceMoved {
            instance: InstanceId::new("nap"),
            expected: None,
            found: Some(RunId::from_u64_pair(1, 1)),
        };
        shard.handle(
            Timestamp(2),
            ShardInput::Committed {
                token,
                result: Err(moved),
            },
        );
        let first = actions(&mut shard);
        let instance = read_token(&first, |q| matches!(q, ReadQuery::Instance(_)));
        shard.handle(
            Timestamp(2),
            ShardInput::Read {
                token: instance,
                result: Ok(ReadResult::Instance(Some(continued_to(next)))),
            },
        );
        let told = |actions: &[Action]| {
            actions.iter().find_map(|a| match a {
                Action::Reply { id: i, answer, .. } if *i == id => Some(answer.clone()),
                _ => None,
            })
        };
        let mut now = 2;
        for present in [false, true] {
            let checking = actions(&mut shard);
            assert_eq!(told(&checking), None, "not told before {next} exists");
            let meta = read_token(
                &checking,
                |q| matches!(q, ReadQuery::RunMeta(r) if *r == next),
            );
            let record = present.then(|| {
                let mut m = continued_to(next).run;
                m.run_id = next;
                m
            });
            shard.handle(
                Timestamp(now),
                ShardInput::Read {
                    token: meta,
                    result: Ok(ReadResult::RunMeta(record)),
                },
            );
            now += crate::driver::CONTINUATION_CHECK_MS;
            shard.handle_timeout(Timestamp(now));
        }
        let last = actions(&mut shard);
        assert_eq!(told(&last), Some(Answer::Existing(next)), "{last:?}");
    }
}
