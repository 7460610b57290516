//! The outbox: messages a commit wrote for another run (start a child,
//! deliver a child's result, cancel a child, start a continuation, deliver
//! a signal or stream message workflow code sent),
//! delivered at least once by the shard of the run that wrote them, until
//! the target answers for good. A row leaves the store in the commit that
//! consumes it (the child's start, the parent's receipt of a result, the
//! child's close, the continuation's start); its delivery stops earlier, as
//! soon as the target has answered.

use std::collections::BTreeMap;

use keel_storage::keys;
use keel_storage::{
    CommandId, Delivery, Failure, FailureKind, OutboxMessage, ParentClosePolicy, RunId, Timestamp,
};

use super::{
    shard_of, Answer, BreakMode, Cause, Due, Message, Origin, ReadFor, ReadQuery, Refusal, ReplyTo,
    RunOp, Shard, ShardId, Token,
};
use crate::machine::{Input, StartSpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Delivering the message itself.
    Deliver,
    /// A child's start was answered: telling its parent.
    Notify,
}

#[derive(Debug)]
struct Row {
    msg: OutboxMessage,
    cause: Cause,
    tries: u32,
    stage: Stage,
    /// The parent's input once a child's start was answered.
    notify: Option<Input>,
    /// The delivery whose answer is awaited.
    awaiting: Option<Token>,
    /// A send to an instance: the run that delivery was resolved to, so
    /// that a takeover of that run's shard finds it.
    resolved: Option<RunId>,
    /// Its consuming commit was answered in this shard: it is not
    /// delivered again, only its awaited answer is still followed.
    consumed: bool,
    /// Times a send was delivered again because its target answered
    /// "closed" or "unknown" (see [`super::SEND_CLOSED_FOLLOWS_MAX`]).
    follows: u32,
    /// A window of the shard's backlog brought it in (see `backlog.rs`).
    windowed: bool,
}

/// The outbox rows one shard delivers.
#[derive(Debug, Default)]
pub(super) struct Outbox {
    rows: BTreeMap<Vec<u8>, Row>,
    pending: BTreeMap<Token, Vec<u8>>,
    /// Rows in `rows` a backlog window brought in.
    windowed: usize,
    /// When one of them was last done (left memory).
    windowed_done_at: Timestamp,
}

impl Outbox {
    pub(super) fn len(&self) -> usize {
        self.rows.len()
    }

    /// Rows held that a backlog window brought in, and when one of them
    /// was last done.
    pub(super) fn windowed(&self) -> (usize, Timestamp) {
        (self.windowed, self.windowed_done_at)
    }

    /// Holds `row`. One that takes the place of a row a window brought in
    /// (rewritten by a commit) still counts against the window.
    fn insert(&mut self, key: Vec<u8>, mut row: Row) {
        let was = self.rows.get(&key).is_some_and(|r| r.windowed);
        row.windowed |= was;
        if row.windowed && !was {
            self.windowed += 1;
        }
        self.rows.insert(key, row);
    }

    fn remove(&mut self, key: &[u8], now: Timestamp) {
        if self.rows.remove(key).is_some_and(|row| row.windowed) {
            self.windowed -= 1;
            self.windowed_done_at = now;
        }
    }

    /// Whether a row with this key is in memory (being delivered).
    pub(super) fn holds(&self, key: &[u8]) -> bool {
        self.rows.contains_key(key)
    }
}

/// The input that cancels a child per `policy`. A cancel request carries a
/// command id derived from its origin, so redeliveries are duplicates.
fn cancel_input(
    parent: RunId,
    step: keel_storage::Step,
    policy: ParentClosePolicy,
    reason: &str,
) -> Input {
    match policy {
        ParentClosePolicy::RequestCancel | ParentClosePolicy::Abandon => Input::CancelRequested {
            reason: reason.to_string(),
            command_id: Some(CommandId::new(format!("keel.cancel/{parent}/{step}"))),
        },
        ParentClosePolicy::Terminate => Input::Terminate {
            reason: reason.to_string(),
            command_id: Some(CommandId::new(format!("keel.terminate/{parent}/{step}"))),
        },
    }
}

impl Shard {
    /// An outbox row was written (or read back; `windowed` when a backlog
    /// window brought it): deliver it.
    pub(super) fn outbox_intent(&mut self, msg: OutboxMessage, cause: Cause, windowed: bool) {
        if matches!(msg, OutboxMessage::CancelChild { .. })
            && self.breaks(BreakMode::SkipClosePolicy)
        {
            return; // broken on purpose: cancellations are never delivered
        }
        let key = msg.key();
        self.outbox.insert(
            key.clone(),
            Row {
                msg,
                cause,
                tries: 0,
                stage: Stage::Deliver,
                notify: None,
                awaiting: None,
                resolved: None,
                consumed: false,
                follows: 0,
                windowed,
            },
        );
        self.deliver_outbox(&key);
    }

    /// The row's consuming commit was answered (in this shard): it is not
    /// delivered again. A delivery whose answer is awaited is still
    /// followed (a child's start still tells its parent).
    pub(super) fn outbox_removed(&mut self, key: &[u8]) {
        match self.outbox.rows.get_mut(key) {
            Some(row) if row.awaiting.is_some() => row.consumed = true,
            Some(_) => {
                self.outbox.remove(key, self.now);
            }
            None => {}
        }
    }

    pub(super) fn deliver_outbox(&mut self, key: &[u8]) {
        let Some(row) = self.outbox.rows.get(key) else {
            return;
        };
        let cause = row.cause;
        if row.consumed && row.stage == Stage::Deliver {
            self.outbox.remove(key, self.now);
            return;
        }
        if row.stage == Stage::Notify {
            let Some(input) = row.notify.clone() else {
                return;
            };
            let parent = row.msg.owner();
            let origin = Origin::Outbox(key.to_vec());
            return self.run_op(parent, RunOp::Input(input), origin);
        }
        let msg = row.msg.clone();
        let token = self.token();
        self.outbox.pending.insert(token, key.to_vec());
        if let Some(row) = self.outbox.rows.get_mut(key) {
            row.awaiting = Some(token);
            row.resolved = None;
        }
        // The target's process may die or lose its shard with the message
        // in hand: without an answer in time, it is delivered again.
        let at = self.now.plus_ms(super::OUTBOX_ANSWER_WAIT_MS);
        self.due.push(at, Due::OutboxAnswer(key.to_vec(), token));
        let reply = ReplyTo::Shard(self.id, token);
        match msg {
            OutboxMessage::StartChild {
                parent,
                child_instance_id,
                child_run_id,
                workflow_type,
                input,
                memo,
                search_attributes,
                timeouts,
            } => {
                // A cancellation already written for the child rides with
                // its start, in the same commit.
                let then = match self.outbox.rows.get(&keys::outbox_cancel_key(child_run_id)) {
                    Some(Row {
                        msg:
                            OutboxMessage::CancelChild {
                                parent,
                                policy,
                                reason,
                                ..
                            },
                        ..
                    }) => Some(cancel_input(parent.run_id, parent.step, *policy, reason)),
                    _ => None,
                };
                let mut spec = StartSpec::child(
                    parent,
                    child_instance_id,
                    child_run_id,
                    workflow_type,
                    input,
                );
                spec.memo = memo;
                spec.search_attributes = search_attributes;
                spec.timeouts = timeouts.at(self.now);
                self.start_message(spec, then, reply, cause);
            }
            OutboxMessage::ChildResult {
                parent,
                child_run_id,
                outcome,
            } => {
                let Some(input) = Input::child_closed(parent.step, child_run_id, outcome) else {
                    self.outbox.remove(key, self.now);
                    return;
                };
                self.send(parent.run_id, RunOp::Input(input), reply, cause);
            }
            OutboxMessage::CancelChild {
                parent,
                child_run_id,
                policy,
                reason,
            } => {
                let input = cancel_input(parent.run_id, parent.step, policy, &reason);
                self.send(child_run_id, RunOp::Input(input), reply, cause);
            }
            OutboxMessage::Continue {
                from,
                instance_id,
                workflow_type,
                new_run_id,
                input,
                parent,
                carried,
            } => {
                let spec = StartSpec::continuation(
                    from,
                    instance_id,
                    workflow_type,
                    new_run_id,
                    input,
                    parent,
                    carried,
                );
                self.start_message(spec, None, reply, cause);
            }
            OutboxMessage::Deliver {
                sender,
                step,
                target,
                delivery,
            } => {
                let input = match delivery {
                    Delivery::Signal { name, payload } => Input::Signal {
                        name,
                        payload,
                        command_id: Some(CommandId::new(format!("keel.signal/{sender}/{step}"))),
                    },
                    Delivery::Message {
                        stream,
                        key,
                        payload,
                    } => Input::Message {
                        stream,
                        key,
                        payload,
                    },
                };
                // Resolved like a client's request naming the instance:
                // a continue-as-new in progress answers "try again".
                let op = RunOp::Input(input);
                // Through the store, never at once: this runs inside the
                // answer to the sender's commit.
                let query = ReadQuery::Resolve(target.clone());
                self.read(query, ReadFor::Resolve { op, reply, target });
            }
        }
    }

    fn start_message(
        &mut self,
        spec: StartSpec,
        then: Option<Input>,
        reply: ReplyTo,
        cause: Cause,
    ) {
        let to = shard_of(spec.run_id, self.config.shards);
        self.actions.push_back(super::Action::Send {
            to,
            message: Message::Start {
                spec: Box::new(spec),
                then,
                reply,
            },
            cause,
        });
    }

    /// No answer came to the delivery `token` of row `key` in time: unless
    /// one came since, the row is delivered again (durable ids make the
    /// repeat harmless if the first one arrived after all).
    pub(super) fn outbox_unanswered(&mut self, key: &[u8], token: Token) {
        let Some(row) = self.outbox.rows.get_mut(key) else {
            return;
        };
        if row.awaiting != Some(token) {
            return;
        }
        row.awaiting = None;
        self.outbox.pending.remove(&token);
        tracing::debug!(shard = %self.id, "an outbox delivery was not answered in time; delivering it again");
        self.deliver_outbox(key);
    }

    /// Shard `taken` has a new owner: a delivery to it still waiting for
    /// its answer may have been lost with the owner before (a process that
    /// died with the message in hand, or a message that came while no
    /// process held the shard), so it is delivered again now rather than
    /// after `OUTBOX_ANSWER_WAIT_MS`. Deliveries are idempotent by their
    /// durable ids, and an answer to the earlier one is ignored. A send to
    /// an instance counts once its read resolved it to a run; one still
    /// being resolved waits for its own time.
    pub(super) fn peer_taken(&mut self, taken: ShardId) {
        let shards = self.config.shards;
        let waiting: Vec<(Vec<u8>, Token)> = self
            .outbox
            .rows
            .iter()
            .filter_map(|(key, row)| {
                let token = row.awaiting?;
                let run = target_run(&row.msg).or(row.resolved)?;
                (shard_of(run, shards) == taken).then(|| (key.clone(), token))
            })
            .collect();
        for (key, token) in waiting {
            self.outbox_unanswered(&key, token);
        }
    }

    /// The delivery `token` of a send to an instance was resolved to
    /// `run`.
    pub(super) fn outbox_resolved(&mut self, token: Token, run: RunId) {
        let Some(key) = self.outbox.pending.get(&token) else {
            return;
        };
        if let Some(row) = self.outbox.rows.get_mut(key) {
            if row.awaiting == Some(token) {
                row.resolved = Some(run);
            }
        }
    }

    /// An answer from a shard to a message this shard sent.
    pub(super) fn peer_answer(&mut self, token: Token, answer: Answer) {
        let Some(key) = self.outbox.pending.remove(&token) else {
            return;
        };
        match self.outbox.rows.get_mut(&key) {
            // An answer to an earlier delivery of a row delivered again
            // since: the newer delivery decides.
            Some(row) if row.awaiting != Some(token) => {}
            Some(row) => {
                row.awaiting = None;
                self.outbox_answered(&key, answer);
            }
            None => {}
        }
    }

    /// The parent answered the input that tells it of its child's start.
    /// Only a row still telling it takes the answer: the answer of the
    /// "started" input is never read as the answer to a start.
    pub(super) fn notify_answered(&mut self, key: &[u8], answer: Answer) {
        match self.outbox.rows.get(key) {
            Some(row) if row.stage == Stage::Notify => self.outbox_answered(key, answer),
            _ => {}
        }
    }

    pub(super) fn outbox_answered(&mut self, key: &[u8], answer: Answer) {
        let now = self.now;
        let Some(row) = self.outbox.rows.get_mut(key) else {
            return;
        };
        let again = |row: &mut Row| {
            row.tries += 1;
            now.plus_ms(Shard::backoff(row.tries))
        };
        if row.stage == Stage::Notify {
            match answer {
                Answer::Retry(_) => {
                    let at = again(row);
                    self.due.push(at, Due::Outbox(key.to_vec()));
                }
                _ => {
                    self.outbox.remove(key, self.now);
                }
            }
            return;
        }
        match (&row.msg, answer) {
            (_, Answer::Retry(_)) if row.consumed => {
                self.outbox.remove(key, self.now);
            }
            (_, Answer::Retry(_)) => {
                let at = again(row);
                self.due.push(at, Due::Outbox(key.to_vec()));
            }
            (
                OutboxMessage::StartChild {
                    parent,
                    child_run_id,
                    ..
                },
                answer,
            ) => {
                let input = match answer {
                    Answer::Started(_) | Answer::Existing(_) => Input::ChildStarted {
                        step: parent.step,
                        child_run_id: *child_run_id,
                    },
                    other => Input::ChildFailed {
                        step: parent.step,
                        child_run_id: *child_run_id,
                        failure: Failure::new(
                            FailureKind::Application,
                            format!("{}: {}", crate::child::CHILD_NOT_STARTED, describe(&other)),
                            false,
                        ),
                    },
                };
                row.stage = Stage::Notify;
                row.tries = 0;
                row.notify = Some(input);
                self.deliver_outbox(key);
            }
            (OutboxMessage::Deliver { step, .. }, answer) => {
                let (offset, failure) = match answer {
                    Answer::Sent { offset, .. } => (Some(offset), None),
                    Answer::Committed | Answer::Duplicate => (None, None),
                    // Full, parked or shutting down for now: deliver again
                    // later (after a restart, the row is read back).
                    Answer::Refused(
                        Refusal::StreamFull { .. } | Refusal::Parked { .. } | Refusal::Shutdown,
                    ) => {
                        let at = again(row);
                        self.due.push(at, Due::Outbox(key.to_vec()));
                        return;
                    }
                    // The run it reached may have continued as new (the
                    // instance names the next one), or the instance may not
                    // be started yet (a child whose start is in flight).
                    Answer::Refused(Refusal::RunClosed(_) | Refusal::UnknownRun(_))
                        if row.follows < super::SEND_CLOSED_FOLLOWS_MAX
                            && matches!(&row.msg, OutboxMessage::Deliver { target, .. }
                                if RunId::parse(target).is_none()) =>
                    {
                        row.follows += 1;
                        let at = again(row);
                        self.due.push(at, Due::Outbox(key.to_vec()));
                        return;
                    }
                    other => (
                        None,
                        Some(Failure::new(
                            FailureKind::Application,
                            format!("not delivered: {}", describe(&other)),
                            false,
                        )),
                    ),
                };
                row.stage = Stage::Notify;
                row.tries = 0;
                row.notify = Some(Input::SendCompleted {
                    step: *step,
                    offset,
                    failure,
                });
                self.deliver_outbox(key);
            }
            (
                OutboxMessage::CancelChild { parent, .. },
                Answer::Refused(Refusal::UnknownRun(_)),
            ) => {
                // Its start has not been committed yet: try again. That
                // start is a row of this shard too, which no window may
                // have brought in yet: windows read the outbox in key
                // order, cancellations before starts, and this row would
                // hold its window while the start waited behind it (after
                // a restart, for as long as the window stalls). So the
                // start row is read now, unless memory drives it already
                // or a read of it is in flight.
                let start = keys::outbox_start_key(parent.run_id, parent.step);
                let at = again(row);
                self.due.push(at, Due::Outbox(key.to_vec()));
                let reading = self
                    .reads
                    .values()
                    .any(|r| matches!(r, ReadFor::StartRow(k) if *k == start));
                if !self.outbox.holds(&start) && !reading {
                    self.read(
                        ReadQuery::OutboxRow(start.clone()),
                        ReadFor::StartRow(start),
                    );
                }
            }
            // Delivered for good: committed, a duplicate, closed, parked (a
            // resume drives the rows addressed to it again).
            _ => {
                self.outbox.remove(key, self.now);
            }
        }
    }
}

fn describe(answer: &Answer) -> String {
    match answer {
        Answer::Refused(r) => r.to_string(),
        other => format!("{other:?}"),
    }
}

/// The run a delivery of `msg` goes to, when the message names it (a send
/// to an instance is resolved first).
fn target_run(msg: &OutboxMessage) -> Option<RunId> {
    match msg {
        OutboxMessage::StartChild { child_run_id, .. }
        | OutboxMessage::CancelChild { child_run_id, .. } => Some(*child_run_id),
        OutboxMessage::ChildResult { parent, .. } => Some(parent.run_id),
        OutboxMessage::Continue { new_run_id, .. } => Some(*new_run_id),
        OutboxMessage::Deliver { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    // Goal: a child's cancellation that reaches no run (the child's start
    // is not committed) does not wait for a backlog window to bring the
    // start in. Windows read the outbox in key order, cancellations before
    // starts; with the cancellation holding the window, the start came in
    // only once the window stalled (`BACKLOG_STALL_MS`, counted again from
    // every restart), and rows after it (a continuation's start) waited as
    // long. Method: a shard recovering with a one-row window is handed the
    // cancellation alone; its delivery is answered "no such run"; the
    // shard must read the start row at once, and deliver the start with
    // the cancellation riding on it.
    use super::*;
    use crate::driver::{Action, DriverConfig, ReadResult, ShardId, ShardInput};
    use crate::workflow::WorkflowRegistry;
    use keel_storage::{InstanceId, Intent, ParentRef, Payload, Step, Timestamp};

    fn actions(shard: &mut Shard) -> Vec<Action> {
        std::iter::from_fn(|| shard.poll_action()).collect()
    }

    /// The outbox row starting `child` for `parent`'s step.
    fn child_start(parent: &ParentRef, child: RunId) -> OutboxMessage {
        OutboxMessage::StartChild {
            parent: parent.clone(),
            child_instance_id: InstanceId::new(format!("parent/child-{}", parent.step.0)),
            child_run_id: child,
            workflow_type: "child".into(),
            input: Payload::encode(&()).unwrap(),
            memo: Vec::new(),
            search_attributes: Vec::new(),
            timeouts: Default::default(),
        }
    }

    /// The `n`th run id (counting from 0) that routes to `shard` of two.
    fn on(shard: u16, n: usize) -> RunId {
        (1..)
            .map(|i| RunId::from_u64_pair(i, i))
            .filter(|r| crate::driver::shard_of(*r, 2) == ShardId(shard))
            .nth(n)
            .expect("run ids for every shard")
    }

    /// Recovers `shard` at `now`, its first outbox window reading `rows`
    /// (up to `last`), and nothing else due.
    fn recover_with_outbox(
        shard: &mut Shard,
        now: Timestamp,
        rows: Vec<Intent>,
        last: Option<Vec<u8>>,
    ) {
        shard.recover(now);
        for action in actions(shard) {
            let Action::Read { token, query } = action else {
                continue;
            };
            let result = match query {
                ReadQuery::Backlog {
                    of: crate::driver::BacklogOf::Outbox,
                    ..
                } => ReadResult::Backlog {
                    rows: rows.clone(),
                    last: last.clone(),
                    skipped_due: None,
                },
                ReadQuery::Backlog { .. } => ReadResult::Backlog {
                    rows: Vec::new(),
                    last: None,
                    skipped_due: None,
                },
                ReadQuery::Timers { .. } => ReadResult::Timers(Vec::new()),
                other => panic!("unexpected read at recovery: {other:?}"),
            };
            shard.handle(
                now,
                ShardInput::Read {
                    token,
                    result: Ok(result),
                },
            );
        }
    }

    #[test]
    fn a_cancellation_of_an_unstarted_child_reads_the_childs_start_at_once() {
        let config = DriverConfig {
            shards: 1,
            intents_in_memory_max: 1,
            ..DriverConfig::default()
        };
        let mut shard = Shard::new(ShardId(0), WorkflowRegistry::new(), config, 0);
        let parent = ParentRef {
            instance_id: InstanceId::new("parent"),
            run_id: RunId::from_u64_pair(1, 1),
            step: Step(4),
            close_policy: ParentClosePolicy::Terminate,
        };
        let child = RunId::from_u64_pair(2, 2);
        let cancel = OutboxMessage::CancelChild {
            parent: parent.clone(),
            child_run_id: child,
            policy: ParentClosePolicy::Terminate,
            reason: "scope cancelled".into(),
        };
        let start = child_start(&parent, child);
        assert!(cancel.key() < start.key(), "the order the windows read");

        let mut now = Timestamp(1);
        // The first outbox window: the cancellation fills it.
        recover_with_outbox(
            &mut shard,
            now,
            vec![Intent::Outbox(cancel.clone())],
            Some(cancel.key()),
        );
        let delivered = actions(&mut shard);
        let token = delivered
            .iter()
            .find_map(|a| match a {
                Action::Send {
                    message:
                        Message::ToRun {
                            run,
                            reply: ReplyTo::Shard(_, token),
                            ..
                        },
                    ..
                } if *run == child => Some(*token),
                _ => None,
            })
            .unwrap_or_else(|| panic!("the cancellation is delivered: {delivered:?}"));
        now = now.plus_ms(1);
        let answer = Answer::Refused(Refusal::UnknownRun(child.to_string()));
        shard.handle(now, ShardInput::Message(Message::Answer { token, answer }));
        let after = actions(&mut shard);
        let read = after
            .iter()
            .find_map(|a| match a {
                Action::Read {
                    token,
                    query: ReadQuery::OutboxRow(key),
                } if *key == start.key() => Some(*token),
                _ => None,
            })
            .unwrap_or_else(|| panic!("the child's start row is read at once: {after:?}"));
        shard.handle(
            now,
            ShardInput::Read {
                token: read,
                result: Ok(ReadResult::Intents(vec![Intent::Outbox(start.clone())])),
            },
        );
        let started = actions(&mut shard);
        assert!(
            started.iter().any(|a| matches!(
                a,
                Action::Send {
                    message: Message::Start { spec, then: Some(Input::Terminate { .. }), .. },
                    ..
                } if spec.run_id == child
            )),
            "the start is delivered with the cancellation riding on it: {started:?}"
        );
    }

    // Goal: a shard taken by a new owner gets, at once, the deliveries a
    // shard sent it and still waits to hear of; deliveries to other shards
    // keep waiting. A start that arrived while no process held its shard
    // (its owner was killed) was lost, and its sender waited for
    // `OUTBOX_ANSWER_WAIT_MS` (10 s) to deliver it again: `keel sim
    // --processes 3 --seeds 20000` found an instance stuck that long in
    // continue-as-new (seeds 16057 and 19468). Method: a shard of two
    // recovers two child starts, one for a run on each shard, and delivers
    // both; then it hears that shard 1 was taken.
    #[test]
    fn a_taken_shard_gets_the_deliveries_still_waiting_for_its_answer_at_once() {
        let config = DriverConfig {
            shards: 2,
            ..DriverConfig::default()
        };
        let mut shard = Shard::new(ShardId(0), WorkflowRegistry::new(), config, 0);
        let parent = ParentRef {
            instance_id: InstanceId::new("parent"),
            run_id: on(0, 0),
            step: Step(4),
            close_policy: ParentClosePolicy::Terminate,
        };
        let (here, there) = (on(0, 1), on(1, 0));
        let start = |child: RunId, step: u32| {
            child_start(
                &ParentRef {
                    step: Step(step),
                    ..parent.clone()
                },
                child,
            )
        };
        let rows = vec![
            Intent::Outbox(start(here, 4)),
            Intent::Outbox(start(there, 5)),
        ];
        let now = Timestamp(1);
        recover_with_outbox(&mut shard, now, rows, None);
        let starts = |actions: &[Action]| -> Vec<RunId> {
            actions
                .iter()
                .filter_map(|a| match a {
                    Action::Send {
                        message: Message::Start { spec, .. },
                        ..
                    } => Some(spec.run_id),
                    _ => None,
                })
                .collect()
        };
        let first = actions(&mut shard);
        let mut delivered = starts(&first);
        delivered.sort();
        let mut both = vec![here, there];
        both.sort();
        assert_eq!(delivered, both, "both starts are delivered: {first:?}");
        // Well before `OUTBOX_ANSWER_WAIT_MS`, shard 1 has a new owner.
        shard.handle(now.plus_ms(100), ShardInput::PeerTaken(ShardId(1)));
        let again = actions(&mut shard);
        assert_eq!(
            starts(&again),
            vec![there],
            "only the start for the taken shard is delivered again: {again:?}"
        );
        // Told of shard 0's takeover too: only the start waiting for shard
        // 0 goes again.
        shard.handle(now.plus_ms(200), ShardInput::PeerTaken(ShardId(0)));
        let third = actions(&mut shard);
        assert_eq!(starts(&third), vec![here], "{third:?}");
    }

    // Goal: a send to an instance (a signal from a workflow) waiting for
    // its answer is delivered again as soon as the shard of the run it was
    // resolved to has a new owner, as a child's start is, and not after
    // `OUTBOX_ANSWER_WAIT_MS`. Method: a shard of two recovers with one
    // such row; its delivery resolves the instance through a read (a
    // takeover before the read answers changes nothing), answered with a
    // run of shard 1, and goes there. A takeover of shard 0 leaves it
    // alone; one of shard 1 delivers it again (a new resolve read).
    #[test]
    fn a_send_to_an_instance_goes_again_when_the_shard_it_went_to_is_taken() {
        let config = DriverConfig {
            shards: 2,
            ..DriverConfig::default()
        };
        let mut shard = Shard::new(ShardId(0), WorkflowRegistry::new(), config, 0);
        let (sender, there) = (on(0, 0), on(1, 0));
        let signal = OutboxMessage::Deliver {
            sender,
            step: Step(3),
            target: "receiver".into(),
            delivery: Delivery::Signal {
                name: "go".into(),
                payload: Payload::default(),
            },
        };
        let now = Timestamp(1);
        recover_with_outbox(&mut shard, now, vec![Intent::Outbox(signal)], None);
        let resolves = |actions: &[Action]| -> Vec<Token> {
            actions
                .iter()
                .filter_map(|a| match a {
                    Action::Read {
                        token,
                        query: ReadQuery::Resolve(target),
                    } if target == "receiver" => Some(*token),
                    _ => None,
                })
                .collect()
        };
        let first = actions(&mut shard);
        let [token] = resolves(&first)[..] else {
            panic!("one resolve read: {first:?}")
        };
        // Not resolved yet: no shard is known to be its target.
        shard.handle(now, ShardInput::PeerTaken(ShardId(1)));
        let unresolved = actions(&mut shard);
        assert!(resolves(&unresolved).is_empty(), "{unresolved:?}");
        shard.handle(
            now,
            ShardInput::Read {
                token,
                result: Ok(ReadResult::Resolved(Some(there))),
            },
        );
        let sent = actions(&mut shard);
        assert!(
            sent.iter().any(|a| matches!(a,
                Action::Send { to: ShardId(1), message: Message::ToRun { run, .. }, .. }
                    if *run == there)),
            "the signal goes to the run it resolved to: {sent:?}"
        );
        shard.handle(now.plus_ms(100), ShardInput::PeerTaken(ShardId(0)));
        let calm = actions(&mut shard);
        assert!(resolves(&calm).is_empty(), "{calm:?}");
        shard.handle(now.plus_ms(200), ShardInput::PeerTaken(ShardId(1)));
        let again = actions(&mut shard);
        assert_eq!(resolves(&again).len(), 1, "delivered again: {again:?}");
    }

    // Goal: a run's intent rows read back after a commit of it whose
    // outcome is unknown drive only the rows this shard's runs own. A
    // child's shard once drove its parent's start row for it and, told
    // the child exists, ran the parent's machine there: two shards
    // committing to one run (the simulator's `commit-answer-lost`). Read
    // back for a resume, the results and cancellations addressed to the
    // run are still delivered again (their senders dropped them when it
    // was parked). Method: shard 0 of two holds a child whose parent is
    // on shard 1 and whose own child is on shard 1 too; each read-back
    // holds the parent's start row for the child, the child's result row
    // for its parent, and the grandchild's result row for the child.
    #[test]
    fn a_runs_rows_read_back_drive_only_what_this_shards_runs_own() {
        let parent_of = |run: RunId| ParentRef {
            instance_id: InstanceId::new(format!("parent-{run}")),
            run_id: run,
            step: Step(3),
            close_policy: ParentClosePolicy::Terminate,
        };
        let (parent, child, grandchild) = (on(1, 0), on(0, 0), on(1, 1));
        let start = child_start(&parent_of(parent), child);
        let result_of = |parent: RunId, child: RunId| OutboxMessage::ChildResult {
            parent: parent_of(parent),
            child_run_id: child,
            outcome: keel_storage::Outcome::Terminated("by hand".into()),
        };
        let (own, addressed) = (result_of(parent, child), result_of(child, grandchild));
        for resumed in [false, true] {
            let config = DriverConfig {
                shards: 2,
                ..DriverConfig::default()
            };
            let mut shard = Shard::new(ShardId(0), WorkflowRegistry::new(), config, 0);
            let token = shard.read(
                ReadQuery::IntentsOf(child),
                crate::driver::ReadFor::RunIntents(child, resumed),
            );
            actions(&mut shard);
            let rows = [&start, &own, &addressed]
                .into_iter()
                .map(|m| Intent::Outbox(m.clone()))
                .collect();
            shard.handle(
                Timestamp(1),
                ShardInput::Read {
                    token,
                    result: Ok(ReadResult::Intents(rows)),
                },
            );
            let sent = actions(&mut shard);
            assert!(
                !shard.outbox.holds(&start.key())
                    && !sent.iter().any(|a| matches!(
                        a,
                        Action::Send {
                            message: Message::Start { .. },
                            ..
                        }
                    )),
                "the parent's row is its own shard's (resumed: {resumed}): {sent:?}"
            );
            assert!(shard.outbox.holds(&own.key()), "the child's own row");
            assert_eq!(
                shard.outbox.holds(&addressed.key()),
                resumed,
                "a result addressed to the child, driven again only at a resume"
            );
        }
    }
}
