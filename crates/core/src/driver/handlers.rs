//! Queries and updates on the driver's side.
//!
//! A query is answered from the run's machine once none of its commits is
//! in flight, so it sees committed state only, never what an input being
//! committed changed; a run not in memory is activated by replay first,
//! and a closed run is replayed into a machine of its own that is dropped
//! after the answer. Nothing is written.
//!
//! An update is checked against the run's updates by id first: a completed
//! one answers with its recorded outcome (once durable), an accepted one
//! waits for it. A new one is validated (nothing written on a rejection),
//! committed as `UpdateAccepted`, and its client waits for the commit that
//! holds its `UpdateCompleted`: the same commit when the handler finishes
//! at once, a later one when it awaits something.

use keel_storage::{CommandId, Error as StoreError, Failure, Payload, RunId};

use super::{
    run::Phase, Answer, Origin, ReadFor, ReadQuery, ReadResult, Refusal, ReplyTo, RunOp, Shard,
    RESULT_WAITERS_PER_RUN_MAX,
};
use crate::machine::{Input, RunMachine, UpdateStatus};

impl Shard {
    /// A query on a run whose machine is in memory: answered once its
    /// commits in flight are durable.
    pub(super) fn query_ready(&mut self, run: RunId, name: String, args: Payload, origin: Origin) {
        let speculate = self.breaks(super::BreakMode::QuerySpeculative);
        let slot = self.slot(run);
        if !slot.drained_now() && !speculate {
            slot.wait_drained(RunOp::Query { name, args }, origin);
            return;
        }
        let Phase::Ready(machine) = &mut slot.phase else {
            return self.query_closed(run, name, args, origin);
        };
        let answer = match machine.query(&name, &args) {
            Ok(value) => Answer::Queried(value),
            Err(e) => Answer::Refused(Refusal::Handler(e)),
        };
        self.answer(origin, answer, None);
    }

    /// A query on a closed run: its history is replayed into a machine of
    /// its own.
    pub(super) fn query_closed(&mut self, run: RunId, name: String, args: Payload, origin: Origin) {
        let Origin::Reply(reply) = origin else {
            return;
        };
        self.read(
            ReadQuery::History(run),
            ReadFor::QueryClosed {
                run,
                name,
                args,
                reply,
            },
        );
    }

    pub(super) fn query_closed_read(
        &mut self,
        run: RunId,
        name: String,
        args: Payload,
        reply: ReplyTo,
        result: Result<ReadResult, StoreError>,
    ) {
        let history = match result {
            Ok(ReadResult::History(h, _)) => h,
            Ok(_) => return,
            Err(e) => {
                let answer = Answer::Retry(format!("history unreadable: {e}"));
                return self.reply(reply, answer, None);
            }
        };
        // Against a table of closures of its own, dropped after: a closed
        // run's replay binds the closures of async children it never heard
        // close again, and nothing would forget them.
        let workflows = self.workflows.with_fresh_closures();
        let answer = match RunMachine::replay(&workflows, history) {
            Ok(mut machine) => match machine.query(&name, &args) {
                Ok(value) => Answer::Queried(value),
                Err(e) => Answer::Refused(Refusal::Handler(e)),
            },
            Err(e) => Answer::Refused(Refusal::Parked {
                run,
                reason: format!("its history does not replay against this code: {e}"),
            }),
        };
        self.reply(reply, answer, None);
    }

    /// An update reaching a run whose machine is in memory. Returns the
    /// input to hand to the machine when the update is new and valid.
    pub(super) fn update_ready(
        &mut self,
        run: RunId,
        input: Input,
        origin: Origin,
    ) -> Option<Input> {
        let Input::Update {
            update_id,
            name,
            payload,
        } = &input
        else {
            return Some(input);
        };
        let slot = self.runs.get_mut(&run).expect("ready");
        let Phase::Ready(machine) = &mut slot.phase else {
            unreachable!("update_ready on a run without its machine")
        };
        if machine.is_closed() {
            return Some(input);
        }
        match machine.update_status(update_id) {
            UpdateStatus::Completed(outcome) => {
                self.answer_when_durable(run, origin, Answer::Updated(outcome));
                None
            }
            UpdateStatus::Accepted => {
                self.wait_update(run, update_id.clone(), origin);
                None
            }
            UpdateStatus::EarlierRun => {
                let r = Refusal::UpdateInEarlierRun {
                    update_id: update_id.clone(),
                    run,
                };
                self.answer_when_durable(run, origin, Answer::Refused(r));
                None
            }
            UpdateStatus::New => match machine.validate_update(name, payload) {
                Ok(()) => Some(input),
                Err(e) => {
                    // Nothing written; what the validator saw may rest on
                    // commits in flight.
                    let answer = Answer::Refused(Refusal::Handler(e));
                    self.answer_when_durable(run, origin, answer);
                    None
                }
            },
        }
    }

    /// The client of an accepted update waits for its completion.
    pub(super) fn wait_update(&mut self, run: RunId, update_id: CommandId, origin: Origin) {
        let Origin::Reply(reply) = origin else {
            return;
        };
        let waiters = self.updates.entry(run).or_default();
        if waiters.len() >= RESULT_WAITERS_PER_RUN_MAX {
            let why = format!("{RESULT_WAITERS_PER_RUN_MAX} clients wait for updates of run {run}");
            return self.reply(reply, Answer::Retry(why), None);
        }
        waiters.push((update_id, reply));
    }

    /// A commit of `run` holding these completions is durable.
    pub(super) fn updates_completed(
        &mut self,
        run: RunId,
        completed: Vec<(CommandId, Result<Payload, Failure>)>,
        cause: super::Cause,
    ) {
        for (id, outcome) in completed {
            for reply in self.take_update_waiters(run, |w| *w == id) {
                self.reply(reply, Answer::Updated(outcome.clone()), cause);
            }
        }
    }

    /// Removes and returns the clients waiting on updates of `run` that
    /// `pick` selects.
    pub(super) fn take_update_waiters(
        &mut self,
        run: RunId,
        pick: impl Fn(&CommandId) -> bool,
    ) -> Vec<ReplyTo> {
        let Some(waiters) = self.updates.get_mut(&run) else {
            return Vec::new();
        };
        let mut taken = Vec::new();
        waiters.retain(|(id, reply)| {
            let hit = pick(id);
            if hit {
                taken.push(*reply);
            }
            !hit
        });
        if waiters.is_empty() {
            self.updates.remove(&run);
        }
        taken
    }

    /// The run closed or parked: updates still running never complete in
    /// it; their clients hear `answer`.
    pub(super) fn updates_end(&mut self, run: RunId, answer: Answer) {
        for (_, reply) in self.updates.remove(&run).unwrap_or_default() {
            self.reply(reply, answer.clone(), None);
        }
    }
}
