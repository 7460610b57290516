//! The simulated clients: each starts its instance, then sends its planned
//! signals and cancels, retrying with the same command id until answered;
//! and the engine side of their requests (`Client::start_raw`,
//! `Client::signal`, `Client::cancel`).

use super::*;

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
        let delay = self.latency();
        self.at(
            self.now + delay,
            Ev::Arrive {
                inc: None,
                req: Request::Client { plan, op, try_no },
            },
        );
        let timeout = self.ms(50, CLIENT_TIMEOUT_MS_MAX);
        self.at(self.now + timeout, Ev::ClientTimeout { plan, op, try_no });
    }

    pub(super) fn client_reply(&mut self, plan: usize, op: OpRef, try_no: u32, answer: Answer) {
        if self.client_done(plan, op) {
            return;
        }
        let (ok, retry) = match &answer {
            Answer::Committed
            | Answer::Started(_)
            | Answer::Existing(_)
            | Answer::AlreadyClosed
            | Answer::Dropped(_) => (true, false),
            Answer::Failed(_) => (false, true),
            Answer::Refused(_) | Answer::Parked => (false, false),
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

    pub(super) fn schedule_ops(&mut self, plan: usize) {
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
        // Signals and cancels the workflow ignores, at arbitrary points.
        if self.fault(FaultKind::StrayCommand) {
            let cancel =
                self.setup.workload.plans()[plan].ignores_cancel && self.rng.random_bool(0.5);
            let at = self.now + self.ms(0, 2_000);
            self.fired(FaultKind::StrayCommand);
            self.at(
                at,
                Ev::Arrive {
                    inc: None,
                    req: Request::Stray { plan, cancel },
                },
            );
        }
    }

    /// A client request reaches the engine: mirrors `Client::start_raw`,
    /// `Client::signal` and `Client::cancel`.
    pub(super) fn client_request(&mut self, plan: usize, op: OpRef, try_no: u32) {
        let p = &self.setup.workload.plans()[plan];
        let instance = InstanceId::new(p.instance.clone());
        let origin = Origin::Client { plan, op, try_no };
        match op {
            None => {
                let store = self.store.store();
                let current = store
                    .instance(&instance)
                    .ok()
                    .flatten()
                    .and_then(|i| store.run_meta(i.current_run).ok().flatten());
                if let Some(meta) = current {
                    // The reuse policy the simulated client uses is
                    // `RejectDuplicate`: a start retried after its run
                    // closed finds it closed, and is answered as done.
                    let answer = if meta.status.is_closed() {
                        Answer::AlreadyClosed
                    } else {
                        Answer::Existing(meta.run_id)
                    };
                    self.respond(origin, answer);
                    return;
                }
                let h = self.plan_hash(plan);
                let run = RunId::from_u64_pair(h, u64::from(try_no) + 1);
                self.names.insert(run, format!("{}#{try_no}", p.instance));
                let spec = StartSpec {
                    run_id: run,
                    instance_id: instance,
                    workflow_type: p.workflow_type.clone(),
                    input: p.input.clone(),
                    command_id: Some(CommandId::new(format!("{}/start", p.instance))),
                    parent: None,
                    continued_from: None,
                    random_seed: h.rotate_left(17),
                };
                self.create(spec, origin);
            }
            Some(i) => {
                let input = match &p.ops[i].kind {
                    ClientOpKind::Signal {
                        name,
                        payload,
                        command_id,
                    } => Input::Signal {
                        name: name.clone(),
                        payload: payload.clone(),
                        command_id: command_id.clone(),
                    },
                    ClientOpKind::Cancel { reason, command_id } => Input::CancelRequested {
                        reason: reason.clone(),
                        command_id: command_id.clone(),
                    },
                };
                match self.store.store().resolve(instance.as_str()) {
                    Ok(Some(run)) => self.deliver(run, input, origin),
                    _ => self.respond(
                        origin,
                        Answer::Failed(format!("unknown instance {instance}")),
                    ),
                }
            }
        }
    }

    pub(super) fn stray(&mut self, plan: usize, cancel: bool) {
        let instance = self.setup.workload.plans()[plan].instance.clone();
        let Ok(Some(run)) = self.store.store().resolve(&instance) else {
            return;
        };
        let input = if cancel {
            Input::CancelRequested {
                reason: "stray cancel".into(),
                command_id: None,
            }
        } else {
            Input::Signal {
                name: "keel.sim.noise".into(),
                payload: Payload::default(),
                command_id: None,
            }
        };
        self.log(format_args!("stray {input:?} to {}", self.name(run)));
        self.deliver(run, input, Origin::Ghost);
    }
}
