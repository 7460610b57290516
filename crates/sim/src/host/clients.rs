//! The simulated clients: each starts its instance, then sends its planned
//! signals and cancels, retrying with the same command id until answered,
//! waits for the outcome (following continue-as-new) and describes its
//! instance once. Requests go to the shard their target routes to, as a
//! real client's do.
//!
//! The clients are also probes: what a client is told must already be
//! durable, so every outcome and description answered is checked against
//! the synced store, and a request no answer ever reaches is a violation.

use keel_core::driver::{
    Answer, Refusal, Request, RequestId, ReusePolicy, ShardInput, StartSignal,
};

/// How long a simulated client waits before asking again after the engine
/// answered that its store does not accept writes.
const UNAVAILABLE_PAUSE_MS: u64 = 250;
use std::collections::BTreeMap;

use keel_core::HandlerError;
use keel_storage::{CommandId, EventKind, Failure, InstanceId, Outcome, Payload, RunId};
use rand::RngExt;

use super::{
    Ev, OpRef, World, CLIENT_TIMEOUT_MS_MAX, CLIENT_TRIES_MAX, DESCRIBE_AFTER_MS_MAX,
    RESULT_WAIT_MS,
};
use crate::check::{Violation, ViolationKind};
use crate::fault::FaultKind;
use crate::workload::ClientOpKind;

impl World<'_> {
    pub(super) fn client_done(&self, plan: usize, op: OpRef) -> bool {
        let c = &self.clients[plan];
        match op {
            OpRef::Start => c.started,
            OpRef::Planned(i) => c.done[i],
            OpRef::Result => c.result.is_some(),
            OpRef::Describe => c.described,
        }
    }

    pub(super) fn client_send(&mut self, plan: usize, op: OpRef, try_no: u32) {
        if self.client_done(plan, op) {
            return;
        }
        if try_no >= CLIENT_TRIES_MAX {
            self.log(format_args!("client {plan} {op:?} gives up"));
            let detail = format!(
                "client of {} sent {op:?} {try_no} times without an answer it could use",
                self.setup.workload.plans()[plan].instance
            );
            self.violation(ViolationKind::RequestUnanswered, detail);
            return;
        }
        self.clients[plan].tries.insert(op, try_no);
        let request = self.request_of(plan, op, try_no);
        self.next_request += 1;
        let id = RequestId(self.next_request);
        self.requests.insert(id, (plan, op, try_no));
        let shard = request.shard(self.config.shards);
        let delay = self.latency();
        self.input_at(
            self.now + delay,
            None,
            shard,
            ShardInput::Request { id, request },
        );
        let timeout = match op {
            OpRef::Result => RESULT_WAIT_MS,
            _ => self.ms(50, CLIENT_TIMEOUT_MS_MAX),
        };
        self.at(self.now + timeout, Ev::ClientTimeout { plan, op, try_no });
    }

    fn request_of(&mut self, plan: usize, op: OpRef, try_no: u32) -> Request {
        let p = &self.setup.workload.plans()[plan];
        let instance = p.instance.clone();
        match op {
            OpRef::Start => {
                let h = self.plan_hash(plan);
                let run = RunId::from_u64_pair(h, u64::from(try_no) + 1);
                self.names.insert(run, format!("{instance}#{try_no}"));
                Request::Start {
                    run_id: run,
                    workflow_type: p.workflow_type.clone(),
                    instance: InstanceId::new(instance.clone()),
                    input: p.input.clone(),
                    command_id: Some(CommandId::new(format!("{instance}/start"))),
                    // A start retried after its run closed must not start
                    // a second run.
                    reuse: ReusePolicy::RejectDuplicate,
                    random_seed: h.rotate_left(17),
                    timeouts: p.timeouts,
                    signal: match &p.start_signal {
                        Some(ClientOpKind::Signal {
                            name,
                            payload,
                            command_id,
                        }) => Some(StartSignal {
                            name: name.clone(),
                            payload: payload.clone(),
                            command_id: command_id.clone(),
                        }),
                        _ => None,
                    },
                    memo: Vec::new(),
                    search_attributes: p.search_attributes.clone(),
                    await_outcome: self.sends_execute(plan, try_no),
                }
            }
            OpRef::Result => Request::Result {
                target: self.clients[plan].result_target.clone(),
            },
            OpRef::Describe => Request::Describe { target: instance },
            OpRef::Planned(i) => match &p.ops[i].kind {
                ClientOpKind::Signal {
                    name,
                    payload,
                    command_id,
                } => Request::Signal {
                    target: instance,
                    name: name.clone(),
                    payload: payload.clone(),
                    command_id: command_id.clone(),
                },
                ClientOpKind::Cancel { reason, command_id } => Request::Cancel {
                    target: instance,
                    reason: reason.clone(),
                    command_id: command_id.clone(),
                },
                ClientOpKind::Update {
                    name,
                    payload,
                    update_id,
                } => Request::Update {
                    target: instance,
                    name: name.clone(),
                    args: payload.clone(),
                    update_id: update_id.clone(),
                },
                ClientOpKind::Query { name } => Request::Query {
                    target: instance,
                    name: name.clone(),
                    args: Payload::encode(&()).expect("unit encodes"),
                },
                ClientOpKind::Send {
                    stream,
                    key,
                    payload,
                } => Request::SendMessage {
                    target: instance,
                    stream: stream.clone(),
                    key: keel_storage::MessageKey::new(key.clone()),
                    payload: payload.clone(),
                },
                ClientOpKind::List { filter } => Request::List {
                    filter: keel_storage::RunFilter::parse(filter)
                        .expect("the workload's filters parse"),
                    page_size: keel_storage::search::LIST_PAGE_RUNS_MAX,
                    after: None,
                },
            },
        }
    }

    /// A reply reaches its client (the network delays it a little).
    pub(super) fn reply(&mut self, id: RequestId, answer: Answer) {
        let Some((plan, op, try_no)) = self.requests.remove(&id) else {
            return; // a stray request's answer: nobody waits
        };
        let at = self.now + self.ms(0, 2);
        self.at(
            at,
            Ev::ClientReply {
                plan,
                op,
                try_no,
                answer,
            },
        );
    }

    /// Whether this try of the plan's start is an `execute` (a start
    /// answered with the run's outcome): the first try of half the plans,
    /// those without a signal-with-start. A retry is a plain start, so a
    /// run that waits for the client's signals still gets them after the
    /// first try times out.
    fn sends_execute(&self, plan: usize, try_no: u32) -> bool {
        try_no == 0
            && self.plan_hash(plan) & 1 == 1
            && self.setup.workload.plans()[plan].start_signal.is_none()
    }

    pub(super) fn client_reply(&mut self, plan: usize, op: OpRef, try_no: u32, answer: Answer) {
        if op == OpRef::Start && self.sends_execute(plan, try_no) {
            // An `execute` answers with the outcome or not at all; one
            // that comes after a retry's plain start is checked too.
            match &answer {
                Answer::Outcome(run, outcome) if self.clients[plan].started => {
                    self.check_outcome_durable(*run, outcome);
                    return;
                }
                Answer::Outcome(..)
                | Answer::Retry(_)
                | Answer::Refused(Refusal::Shutdown)
                | Answer::Refused(Refusal::Unavailable(_)) => {}
                other => {
                    let detail = format!("execute of plan {plan}: unexpected answer {other:?}");
                    self.violation(ViolationKind::WrongAnswer, detail);
                    return;
                }
            }
        }
        if self.client_done(plan, op) {
            return;
        }
        self.log(format_args!(
            "client {plan} {op:?} try {try_no} answered {answer:?}"
        ));
        let stalled =
            self.store_stalls > 0 && self.now <= self.stall_until + super::STALL_ANSWER_SLACK_MS;
        if matches!(answer, Answer::Refused(Refusal::Unavailable(_)))
            && self.store_stops == 0
            && !stalled
        {
            let detail =
                format!("client {plan} {op:?}: answered unavailable, but the store never stopped");
            self.violation(ViolationKind::WrongAnswer, detail);
        }
        let planned = match op {
            OpRef::Planned(i) => Some(self.setup.workload.plans()[plan].ops[i].kind.clone()),
            _ => None,
        };
        let done = match (op, planned) {
            (_, Some(ClientOpKind::Update { update_id, .. })) => {
                self.update_answered(plan, &update_id, &answer)
            }
            (_, Some(ClientOpKind::Query { .. })) => self.query_answered(plan, &answer),
            (_, Some(ClientOpKind::Send { stream, key, .. })) => {
                self.send_answered(plan, &stream, &key, &answer)
            }
            // The page itself was checked when it was read (`io.rs`).
            (_, Some(ClientOpKind::List { .. })) => match &answer {
                Answer::Listed(_) => Some(true),
                Answer::Retry(_) | Answer::Refused(Refusal::Shutdown) => Some(false),
                _ => None,
            },
            // A signal with a command id answered as recorded must be in
            // the durable history of its instance's chain.
            (
                _,
                Some(ClientOpKind::Signal {
                    command_id: Some(c),
                    ..
                }),
            ) if matches!(answer, Answer::Committed | Answer::Duplicate) => {
                let key = keel_storage::DurableKey::Command(c.clone());
                let durable = self
                    .durable_chain(plan)
                    .iter()
                    .any(|k| k.terminal_keys().contains(&key));
                if !durable {
                    let detail =
                        format!("signal {c}: answered {answer:?}, but no durable event holds it");
                    self.violation(ViolationKind::WrongAnswer, detail);
                }
                Some(true)
            }
            (OpRef::Result, _) => self.result_answered(plan, try_no, &answer),
            // An `execute`'s answer: checked as a result's; the start is
            // done either way (a continue-as-new is followed from here).
            (OpRef::Start, _) if matches!(answer, Answer::Outcome(..)) => {
                self.result_answered(plan, try_no, &answer);
                Some(true)
            }
            (OpRef::Describe, _) => self.describe_answered(plan, &answer),
            (OpRef::Start | OpRef::Planned(_), _) => match &answer {
                Answer::Committed
                | Answer::Started(_)
                | Answer::Existing(_)
                | Answer::Duplicate
                | Answer::Refused(Refusal::AlreadyClosed { .. })
                | Answer::Refused(Refusal::RunClosed(_)) => Some(true),
                Answer::Retry(_)
                | Answer::Refused(Refusal::Shutdown)
                | Answer::Refused(Refusal::Unavailable(_)) => Some(false),
                _ => None,
            },
        };
        match done {
            Some(true) => match op {
                OpRef::Start => {
                    self.clients[plan].started = true;
                    self.schedule_ops(plan);
                }
                OpRef::Planned(i) => self.clients[plan].done[i] = true,
                OpRef::Result | OpRef::Describe => {}
            },
            Some(false) if self.clients[plan].tries.get(&op) == Some(&try_no) => {
                // A stopped store is not a blip: back off as a real
                // client would rather than ask again at once.
                let pause = if matches!(answer, Answer::Refused(Refusal::Unavailable(_))) {
                    UNAVAILABLE_PAUSE_MS
                } else {
                    20
                };
                self.at(
                    self.now + pause,
                    Ev::ClientSend {
                        plan,
                        op,
                        try_no: try_no + 1,
                    },
                );
            }
            _ => {}
        }
    }

    /// An answer to the client's `result` request. An outcome must be the
    /// run's durable one; a continue-as-new is followed to the next run.
    /// `Some(true)`: done; `Some(false)`: ask again; `None`: ignored.
    fn result_answered(&mut self, plan: usize, try_no: u32, answer: &Answer) -> Option<bool> {
        let (run, outcome) = match answer {
            Answer::Outcome(run, outcome) => (*run, outcome.clone()),
            Answer::Retry(_)
            | Answer::Refused(Refusal::Shutdown)
            | Answer::Refused(Refusal::Unavailable(_)) => return Some(false),
            other => {
                let detail = format!(
                    "result of {}: unexpected answer {other:?}",
                    self.clients[plan].result_target
                );
                self.violation(ViolationKind::WrongAnswer, detail);
                return None;
            }
        };
        if !self.check_outcome_durable(run, &outcome) {
            return None;
        }
        if let Outcome::ContinuedAsNew(next) = outcome {
            self.clients[plan].result_target = next.to_string();
            self.at(
                self.now,
                Ev::ClientSend {
                    plan,
                    op: OpRef::Result,
                    try_no: try_no + 1,
                },
            );
            return None;
        }
        self.clients[plan].result = Some(outcome);
        Some(true)
    }

    /// An outcome a client was told must be the run's durable one; a
    /// violation otherwise.
    fn check_outcome_durable(&mut self, run: RunId, outcome: &Outcome) -> bool {
        let durable = self
            .store
            .reader()
            .run_meta(run)
            .ok()
            .flatten()
            .and_then(|m| m.outcome);
        if durable.as_ref() != Some(outcome) {
            let detail = format!(
                "result of run {}: answered {outcome:?}, durable {durable:?}",
                self.name(run)
            );
            self.violation(ViolationKind::WrongAnswer, detail);
            return false;
        }
        true
    }

    /// An answer to the client's describe: what it reports must be durable
    /// (no event the store has not synced, no status it has not reached).
    fn describe_answered(&mut self, plan: usize, answer: &Answer) -> Option<bool> {
        let d = match answer {
            Answer::Described(d) => d,
            Answer::Retry(_)
            | Answer::Refused(Refusal::Shutdown)
            | Answer::Refused(Refusal::Unavailable(_)) => return Some(false),
            other => {
                let detail = format!(
                    "describe of {}: unexpected answer {other:?}",
                    self.setup.workload.plans()[plan].instance
                );
                self.violation(ViolationKind::WrongAnswer, detail);
                return None;
            }
        };
        let reader = self.store.reader();
        let durable_len = reader
            .history(d.run_id)
            .map(|h| h.len() as u64)
            .unwrap_or(0);
        let durable_status = reader.run_meta(d.run_id).ok().flatten().map(|m| m.status);
        let status_durable = !d.status.is_closed() || durable_status == Some(d.status);
        if d.history_len > durable_len || !status_durable {
            let detail = format!(
                "describe of run {}: answered {} events and status {:?}; durable {} events, {:?}",
                self.name(d.run_id),
                d.history_len,
                d.status,
                durable_len,
                durable_status
            );
            self.violation(ViolationKind::WrongAnswer, detail);
            return None;
        }
        self.clients[plan].described = true;
        Some(true)
    }

    /// The durable outcomes of the updates of `plan`'s instance, by id
    /// (every run of its chain).
    /// Every durable event of the instance's runs (latest run first).
    fn durable_chain(&self, plan: usize) -> Vec<EventKind> {
        let instance = &self.setup.workload.plans()[plan].instance;
        let reader = self.store.reader();
        let mut out = Vec::new();
        let mut next = reader.resolve(instance).ok().flatten();
        let mut seen = 0;
        // The instance names its latest run; earlier runs of a chain are
        // reached through `previous_run`.
        while let (Some(run), true) = (next, seen < 64) {
            seen += 1;
            next = None;
            for e in reader.history(run).unwrap_or_default() {
                if let EventKind::WorkflowStarted(start) = &e.kind {
                    let keel_storage::WorkflowStart { previous_run, .. } = &**start;
                    next = *previous_run;
                }
                out.push(e.kind);
            }
        }
        out
    }

    fn durable_updates(&self, plan: usize) -> BTreeMap<CommandId, Result<Payload, Failure>> {
        let mut out = BTreeMap::new();
        for kind in self.durable_chain(plan) {
            if let EventKind::UpdateCompleted {
                update_id,
                result,
                failure,
            } = kind
            {
                out.insert(update_id, failure.map_or(Ok(result), Err));
            }
        }
        out
    }

    /// An answer to a stream message: the offset answered must be the one
    /// durable for its key, whether this send committed it or an earlier
    /// one did.
    fn send_answered(
        &mut self,
        plan: usize,
        stream: &str,
        key: &str,
        answer: &Answer,
    ) -> Option<bool> {
        let durable = self
            .durable_chain(plan)
            .into_iter()
            .find_map(|kind| match kind {
                EventKind::MessageReceived {
                    stream: s,
                    key: k,
                    offset,
                    ..
                } if s == stream && k.0 == key => Some(offset),
                _ => None,
            });
        match answer {
            Answer::Sent { offset, .. } => {
                if durable != Some(*offset) {
                    let detail = format!(
                        "message {key} on {stream}: answered offset {offset}, durable {durable:?}"
                    );
                    self.violation(ViolationKind::WrongAnswer, detail);
                    return None;
                }
                Some(true)
            }
            // Sent again after the workflow read everything and finished;
            // or it reached a run that continued as new, and goes to the
            // next run (as `Client::send_message` does).
            Answer::Refused(Refusal::RunClosed(run)) => {
                let continued = self
                    .store
                    .reader()
                    .run_meta(*run)
                    .ok()
                    .flatten()
                    .is_some_and(|m| matches!(m.outcome, Some(Outcome::ContinuedAsNew(_))));
                Some(durable.is_some() || !continued)
            }
            Answer::Retry(_)
            | Answer::Refused(Refusal::Shutdown)
            | Answer::Refused(Refusal::Unavailable(_)) => Some(false),
            other => {
                let detail = format!("message {key} on {stream}: unexpected answer {other:?}");
                self.violation(ViolationKind::WrongAnswer, detail);
                None
            }
        }
    }

    /// An answer to an update: a value or failure must be the one durable
    /// for its id; a rejection must have written nothing for it.
    fn update_answered(&mut self, plan: usize, id: &CommandId, answer: &Answer) -> Option<bool> {
        let durable = self.durable_updates(plan).remove(id);
        match answer {
            Answer::Updated(outcome) => {
                if durable.as_ref() != Some(outcome) {
                    let detail = format!("update {id}: answered {outcome:?}, durable {durable:?}");
                    self.violation(ViolationKind::WrongAnswer, detail);
                    return None;
                }
                Some(true)
            }
            Answer::Refused(Refusal::Handler(HandlerError::Rejected { .. })) => {
                if durable.is_some() {
                    let detail = format!("update {id}: rejected, but completed as {durable:?}");
                    self.violation(ViolationKind::WrongAnswer, detail);
                    return None;
                }
                Some(true)
            }
            // Sent again after the workflow finished (a client retry).
            Answer::Refused(Refusal::RunClosed(_)) => Some(true),
            Answer::Retry(_)
            | Answer::Refused(Refusal::Shutdown)
            | Answer::Refused(Refusal::Unavailable(_)) => Some(false),
            other => {
                let detail = format!("update {id}: unexpected answer {other:?}");
                self.violation(ViolationKind::WrongAnswer, detail);
                None
            }
        }
    }

    /// An answer to the `sum` query: never more than the durable updates
    /// add up to (a query sees committed state only).
    fn query_answered(&mut self, plan: usize, answer: &Answer) -> Option<bool> {
        match answer {
            Answer::Queried(v) => {
                let answered: u64 = v.decode().unwrap_or(u64::MAX);
                let durable: u64 = self
                    .durable_updates(plan)
                    .values()
                    .filter_map(|o| o.as_ref().ok()?.decode::<u64>().ok())
                    .sum();
                if answered > durable {
                    let detail = format!(
                        "query of {}: answered {answered}, durable updates add up to {durable}",
                        self.setup.workload.plans()[plan].instance
                    );
                    self.violation(ViolationKind::WrongAnswer, detail);
                    return None;
                }
                Some(true)
            }
            Answer::Retry(_)
            | Answer::Refused(Refusal::Shutdown)
            | Answer::Refused(Refusal::Unavailable(_)) => Some(false),
            other => {
                let detail = format!("query: unexpected answer {other:?}");
                self.violation(ViolationKind::WrongAnswer, detail);
                None
            }
        }
    }

    pub(super) fn violation(&mut self, kind: ViolationKind, detail: String) {
        self.checker.violations.push(Violation {
            kind,
            at_ms: self.now,
            detail,
        });
    }

    fn schedule_ops(&mut self, plan: usize) {
        let times: Vec<u64> = self.setup.workload.plans()[plan]
            .ops
            .iter()
            .map(|o| o.at_ms)
            .collect();
        for (i, at) in times.into_iter().enumerate() {
            self.at(
                at,
                Ev::ClientSend {
                    plan,
                    op: OpRef::Planned(i),
                    try_no: 0,
                },
            );
        }
        self.at(
            self.now,
            Ev::ClientSend {
                plan,
                op: OpRef::Result,
                try_no: 0,
            },
        );
        let describe_at = self.now + self.ms(0, DESCRIBE_AFTER_MS_MAX);
        self.at(
            describe_at,
            Ev::ClientSend {
                plan,
                op: OpRef::Describe,
                try_no: 0,
            },
        );
        // A signal or cancel the workflow ignores, at an arbitrary point.
        if self.fault(FaultKind::StrayCommand) {
            let p = &self.setup.workload.plans()[plan];
            let cancel = p.ignores_cancel && self.rng.random_bool(0.5);
            let target = p.instance.clone();
            let request = if cancel {
                Request::Cancel {
                    target,
                    reason: "stray cancel".into(),
                    command_id: None,
                }
            } else {
                Request::Signal {
                    target,
                    name: "keel.sim.noise".into(),
                    payload: Payload::default(),
                    command_id: None,
                }
            };
            self.next_request += 1;
            let id = RequestId(self.next_request);
            let shard = request.shard(self.config.shards);
            let at = self.now + self.ms(0, 2_000);
            self.input_at(at, None, shard, ShardInput::Request { id, request });
        }
    }
}
