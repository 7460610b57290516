//! Views computed from a history alone: the pending steps of a run and its
//! children. Used by the engine's `describe` and by the CLI offline, so both
//! show the same thing.

use serde::Serialize;

use crate::event::{ChildSchedule, Event, EventKind, GroupPath};
use crate::ids::{AttemptNo, RunId, Step, Timestamp};

/// What a pending step waits for.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    /// An activity execution.
    Activity,
    /// A durable timer.
    Timer,
    /// A child workflow.
    Child,
    /// A signal or stream message sent from workflow code, not yet
    /// answered.
    Send,
}

impl StepKind {
    /// Lowercase name, as the CLI prints it.
    pub fn name(self) -> &'static str {
        match self {
            StepKind::Activity => "activity",
            StepKind::Timer => "timer",
            StepKind::Child => "child",
            StepKind::Send => "send",
        }
    }
}

impl std::fmt::Display for StepKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a parent has seen of a child.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChildState {
    /// Not heard back from.
    Open,
    /// Completed.
    Completed,
    /// Failed, cancelled or terminated.
    Failed,
}

impl ChildState {
    /// Lowercase name, as the CLI prints it.
    pub fn name(self) -> &'static str {
        match self {
            ChildState::Open => "open",
            ChildState::Completed => "completed",
            ChildState::Failed => "failed",
        }
    }
}

/// A durable wait that history shows as open.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, serde::Deserialize)]
pub struct PendingStep {
    /// The command's step.
    pub step: Step,
    /// What it waits for.
    pub kind: StepKind,
    /// Activity or workflow type; empty for a timer.
    pub name: String,
    /// Enclosing `all` barriers.
    pub group: GroupPath,
    /// When it was issued.
    pub since: Timestamp,
    /// Activity: the attempt pending now (after retries).
    pub attempt: Option<AttemptNo>,
    /// Activity: when that attempt is due (a retry's backoff).
    pub due: Option<Timestamp>,
    /// Timer: when it fires.
    pub fire_at: Option<Timestamp>,
    /// Child: its run.
    pub child_run: Option<RunId>,
    /// Activity: the last attempt failure's message.
    pub last_failure: Option<String>,
}

/// A child of a run, as its history records it.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct ChildRecord {
    /// The parent's step that scheduled it.
    pub step: Step,
    /// The child's run.
    pub run_id: RunId,
    /// The child's instance.
    pub instance_id: String,
    /// The child's workflow type.
    pub workflow_type: String,
    /// What the parent has seen of it.
    pub state: ChildState,
}

/// What a history shows, folded one event at a time: the steps still
/// open and the children. Memory follows those, not the history's length,
/// so a reader can stream a long history through it ([`Self::see`]).
#[derive(Debug, Default)]
pub struct HistoryFacts {
    open: std::collections::BTreeMap<Step, PendingStep>,
    children: Vec<ChildRecord>,
    /// Index in `children` by the parent's step.
    child_at: std::collections::HashMap<Step, usize>,
}

impl HistoryFacts {
    /// Folds in the next event.
    pub fn see(&mut self, e: &Event) {
        self.see_child(e);
        let open = &mut self.open;
        match &e.kind {
            EventKind::ActivityScheduled {
                step,
                group,
                activity_type,
                ..
            } => {
                open.insert(
                    *step,
                    PendingStep {
                        step: *step,
                        kind: StepKind::Activity,
                        name: activity_type.clone(),
                        group: group.clone(),
                        since: e.at,
                        attempt: Some(AttemptNo::FIRST),
                        due: Some(e.at),
                        fire_at: None,
                        child_run: None,
                        last_failure: None,
                    },
                );
            }
            EventKind::ActivityAttemptFailed {
                step,
                retry_at: Some(at),
                attempt_id,
                failure,
                ..
            } => {
                if let Some(p) = open.get_mut(step) {
                    p.attempt = Some(attempt_id.attempt.next());
                    p.due = Some(*at);
                    p.last_failure = Some(failure.message.clone());
                }
            }
            EventKind::TimerStarted {
                step,
                group,
                fire_at,
            } => {
                open.insert(
                    *step,
                    PendingStep {
                        step: *step,
                        kind: StepKind::Timer,
                        name: String::new(),
                        group: group.clone(),
                        since: e.at,
                        attempt: None,
                        due: None,
                        fire_at: Some(*fire_at),
                        child_run: None,
                        last_failure: None,
                    },
                );
            }
            EventKind::ChildScheduled(child) => {
                let ChildSchedule {
                    step,
                    group,
                    workflow_type,
                    child_run_id,
                    ..
                } = &**child;
                open.insert(
                    *step,
                    PendingStep {
                        step: *step,
                        kind: StepKind::Child,
                        name: workflow_type.clone(),
                        group: group.clone(),
                        since: e.at,
                        attempt: None,
                        due: None,
                        fire_at: None,
                        child_run: Some(*child_run_id),
                        last_failure: None,
                    },
                );
            }
            EventKind::ExternalSendScheduled { step, target, .. } => {
                open.insert(
                    *step,
                    PendingStep {
                        step: *step,
                        kind: StepKind::Send,
                        name: target.clone(),
                        group: Vec::new(),
                        since: e.at,
                        attempt: None,
                        due: None,
                        fire_at: None,
                        child_run: None,
                        last_failure: None,
                    },
                );
            }
            EventKind::ActivityAttemptFailed {
                step,
                retry_at: None,
                ..
            }
            | EventKind::ExternalSendCompleted { step, .. }
            | EventKind::ActivityCompleted { step, .. }
            | EventKind::ActivityCancelled { step, .. }
            | EventKind::TimerFired { step, .. }
            | EventKind::TimerCancelled { step, .. }
            | EventKind::ChildCompleted { step, .. }
            | EventKind::ChildFailed { step, .. } => {
                open.remove(step);
            }
            _ => {}
        }
        if e.kind.closes_run() || matches!(e.kind, EventKind::WorkflowTerminated { .. }) {
            open.clear();
        }
    }

    fn see_child(&mut self, e: &Event) {
        match &e.kind {
            EventKind::ChildScheduled(child) => {
                let ChildSchedule {
                    step,
                    child_instance_id,
                    child_run_id,
                    workflow_type,
                    ..
                } = &**child;
                self.child_at.insert(*step, self.children.len());
                self.children.push(ChildRecord {
                    step: *step,
                    run_id: *child_run_id,
                    instance_id: child_instance_id.to_string(),
                    workflow_type: workflow_type.clone(),
                    state: ChildState::Open,
                });
            }
            EventKind::ChildCompleted { step, .. } | EventKind::ChildFailed { step, .. } => {
                let done = if matches!(e.kind, EventKind::ChildCompleted { .. }) {
                    ChildState::Completed
                } else {
                    ChildState::Failed
                };
                if let Some(&i) = self.child_at.get(step) {
                    self.children[i].state = done;
                }
            }
            _ => {}
        }
    }

    /// The steps open, in step order, and the children in the order they
    /// were scheduled, with what the parent has seen of them.
    pub fn into_parts(self) -> (Vec<PendingStep>, Vec<ChildRecord>) {
        (self.open.into_values().collect(), self.children)
    }
}

/// The steps a history shows as open, in step order.
pub fn pending_steps(history: &[Event]) -> Vec<PendingStep> {
    fold(history).into_parts().0
}

/// The children a history records, with what the parent has seen of them.
pub fn children(history: &[Event]) -> Vec<ChildRecord> {
    fold(history).into_parts().1
}

fn fold(history: &[Event]) -> HistoryFacts {
    let mut facts = HistoryFacts::default();
    for e in history {
        facts.see(e);
    }
    facts
}

#[cfg(test)]
mod tests {
    //! Goal: a send from workflow code shows as pending until its answer
    //! is committed (a run held back by an unanswered send says why).
    //! Method: a hand-made history, before and after the answer.
    use super::*;
    use crate::event::{Delivery, Payload};
    use crate::ids::Seq;

    fn ev(seq: u64, kind: EventKind) -> Event {
        Event {
            seq: Seq(seq),
            at: Timestamp(seq),
            kind,
        }
    }

    #[test]
    fn an_unanswered_send_is_pending() {
        let mut h = vec![ev(
            2,
            EventKind::ExternalSendScheduled {
                step: Step(3),
                target: "billing-7".into(),
                delivery: Delivery::Signal {
                    name: "paid".into(),
                    payload: Payload::default(),
                },
            },
        )];
        let pending = pending_steps(&h);
        assert_eq!(pending.len(), 1);
        assert_eq!(
            (pending[0].kind, pending[0].name.as_str()),
            (StepKind::Send, "billing-7")
        );
        h.push(ev(
            3,
            EventKind::ExternalSendCompleted {
                step: Step(3),
                offset: None,
                failure: None,
            },
        ));
        assert!(pending_steps(&h).is_empty());
    }
}
