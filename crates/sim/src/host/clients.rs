//! The simulated clients: each starts its instance, then sends its planned
//! signals and cancels, retrying with the same command id until answered.
//! Requests go to the shard their target routes to, as a real client's do.

use keel_core::driver::{Answer, Refusal, Request, RequestId, ReusePolicy, ShardInput};
use keel_storage::{CommandId, InstanceId, Payload, RunId};
use rand::RngExt;

use super::{Ev, OpRef, World, CLIENT_TIMEOUT_MS_MAX, CLIENT_TRIES_MAX};
use crate::fault::FaultKind;
use crate::workload::ClientOpKind;

impl World<'_> {
    pub(super) fn client_done(&self, plan: usize, op: OpRef) -> bool {
        let c = &self.clients[plan];
        match op {
            None => c.started,
            Some(i) => c.done[i],
        }
    }

    pub(super) fn client_send(&mut self, plan: usize, op: OpRef, try_no: u32) {
        if self.client_done(plan, op) {
            return;
        }
        if try_no >= CLIENT_TRIES_MAX {
            self.log(format_args!("client {plan} {op:?} gives up"));
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
        let timeout = self.ms(50, CLIENT_TIMEOUT_MS_MAX);
        self.at(self.now + timeout, Ev::ClientTimeout { plan, op, try_no });
    }

    fn request_of(&mut self, plan: usize, op: OpRef, try_no: u32) -> Request {
        let p = &self.setup.workload.plans()[plan];
        let instance = p.instance.clone();
        match op {
            None => {
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
                }
            }
            Some(i) => match &p.ops[i].kind {
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

    pub(super) fn client_reply(&mut self, plan: usize, op: OpRef, try_no: u32, answer: Answer) {
        if self.client_done(plan, op) {
            return;
        }
        let (ok, retry) = match &answer {
            Answer::Committed
            | Answer::Started(_)
            | Answer::Existing(_)
            | Answer::Duplicate
            | Answer::Outcome(..)
            | Answer::Refused(Refusal::AlreadyClosed { .. })
            | Answer::Refused(Refusal::RunClosed(_)) => (true, false),
            Answer::Retry(_) | Answer::Refused(Refusal::Shutdown) => (false, true),
            _ => (false, false),
        };
        self.log(format_args!(
            "client {plan} {op:?} try {try_no} answered {answer:?}"
        ));
        if ok {
            match op {
                None => {
                    self.clients[plan].started = true;
                    self.schedule_ops(plan);
                }
                Some(i) => self.clients[plan].done[i] = true,
            }
        } else if retry && self.clients[plan].tries.get(&op) == Some(&try_no) {
            self.at(
                self.now + 20,
                Ev::ClientSend {
                    plan,
                    op,
                    try_no: try_no + 1,
                },
            );
        }
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
                    op: Some(i),
                    try_no: 0,
                },
            );
        }
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
