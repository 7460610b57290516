//! What `describe` reports about a run: only committed state. A shard
//! answers it once the run has no commit in flight, from the store (the
//! run's record, and its open steps and children, found by streaming its
//! history through a fold) and from its own memory (the machine's signal
//! waits and scopes, the attempts it supervises). An open run not in
//! memory is activated for the latter; a closed one is not.

use keel_storage::history::PendingStep;
use keel_storage::{Error as StoreError, ParkInfo, RunId, RunStatus, Step, Timestamp};
use serde::Serialize;

use super::run::Phase;
use super::{Answer, Origin, ReadResult, Refusal, ReplyTo, RunOp, Shard};

/// A child run as its parent's history records it.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct ChildView {
    /// The parent's step.
    pub step: Step,
    /// The child's run.
    pub run_id: RunId,
    /// The child's instance.
    pub instance_id: String,
    /// The child's workflow type.
    pub workflow_type: String,
    /// The child's status in the store (`None`: not started yet).
    pub status: Option<RunStatus>,
}

/// One supervised attempt and its lease.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct AttemptView {
    /// The execution's step.
    pub step: Step,
    /// The attempt id.
    pub attempt_id: String,
    /// The lease owner.
    pub lease_owner: String,
    /// The lease's fencing epoch (0 when not running).
    pub epoch: u64,
    /// When the lease expires (when running), when it was refused (when
    /// delayed by a resilience policy), else when it is due.
    pub expires_at: Timestamp,
    /// Deliveries of this attempt so far (1 + redeliveries).
    pub deliveries: u32,
    /// The resilience policy that refused it, while it waits to be offered
    /// again.
    pub delayed_by: Option<String>,
    /// `waiting`, `queued`, `running`, `refused`, `reporting` or
    /// `fallback`; `stored` for an attempt the store holds that the engine
    /// has not read into memory (a backlog window still to come after a
    /// restart, or a parked run's): no lease, due at `expires_at`.
    #[serde(deserialize_with = "super::wire::attempt_state")]
    pub state: super::wire::Word,
    /// Whether its execution was asked to cancel.
    pub cancel_requested: bool,
}

/// What only the run's machine in memory knows.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MachineView {
    /// Signal names coroutines wait for, with how many wait.
    pub signal_waits: Vec<(String, usize)>,
    /// Message streams: offsets, cursors and waiting readers.
    pub streams: Vec<crate::machine::StreamPosition>,
    /// Live coroutines.
    pub coroutines: usize,
    /// Live scopes, in step order; `parent` gives the tree.
    pub scopes: Vec<crate::scope::ScopeView>,
}

/// What `describe` reports about a run.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct RunDescription {
    /// The run.
    pub run_id: RunId,
    /// Its instance.
    pub instance_id: String,
    /// Its workflow type.
    pub workflow_type: String,
    /// Its status.
    pub status: RunStatus,
    /// Events in its history.
    pub history_len: u64,
    /// When it started.
    pub started_at: Timestamp,
    /// When it closed.
    pub closed_at: Option<Timestamp>,
    /// Its parent (run and step), for a child.
    pub parent: Option<(RunId, Step)>,
    /// Open durable waits with their group paths.
    pub pending: Vec<PendingStep>,
    /// Signals coroutines wait for (when the run is in memory).
    pub signal_waits: Vec<(String, usize)>,
    /// Message streams (when the run is in memory): messages committed,
    /// the reader's cursor and how many coroutines wait.
    pub streams: Vec<crate::machine::StreamPosition>,
    /// Live coroutines (when the run is in memory).
    pub coroutines: Option<usize>,
    /// Live scopes, in step order; `parent` gives the tree.
    pub scopes: Vec<crate::scope::ScopeView>,
    /// Supervised attempts and their leases.
    pub attempts: Vec<AttemptView>,
    /// Children.
    pub children: Vec<ChildView>,
    /// Whether cancellation was requested.
    pub cancel_requested: bool,
    /// Why it is parked, if it is.
    pub parked: Option<ParkInfo>,
    /// Memo fields (latest value of each, as JSON text), e.g. progress.
    pub memo: Vec<(String, String)>,
    /// Search attributes, sorted by name: what `list` finds the run by.
    pub search_attributes: Vec<(String, keel_storage::SearchValue)>,
    /// Whether the engine's store accepts writes, as this run's shard last
    /// learned it: a run waiting on a stopped store makes no progress.
    pub store_health: keel_storage::StoreHealth,
}

impl Shard {
    pub(super) fn describe_read(
        &mut self,
        run: RunId,
        view: Option<MachineView>,
        reply: ReplyTo,
        result: Result<ReadResult, StoreError>,
    ) {
        let facts = match result {
            Ok(ReadResult::Describe(Some(f))) => f,
            Ok(ReadResult::Describe(None)) => {
                let answer = Answer::Refused(Refusal::UnknownRun(run.to_string()));
                self.reply(reply, answer, None);
                return self.forget_if_unused(run);
            }
            Ok(_) => return,
            Err(e) => {
                self.reply(reply, Answer::Retry(format!("run unreadable: {e}")), None);
                return self.forget_if_unused(run);
            }
        };
        let meta = facts.meta;
        if view.is_none() && !meta.status.is_closed() && facts.parked.is_none() {
            // Open, but described without its machine: described again
            // once it is replayed (or, replayed meanwhile, now), with what
            // only the machine knows. A parked run is answered from the
            // store: replaying it would only park it again (and rewrite
            // its marker), and its slot may be passivated meanwhile, which
            // would start the round again.
            let slot = self.runs.get(&run);
            let machine_open = slot
                .and_then(|s| s.machine())
                .is_some_and(|m| !m.is_closed());
            match slot.map(|s| &s.phase) {
                None | Some(Phase::Idle) => {
                    self.queue(run, RunOp::Describe, Origin::Reply(reply));
                    return self.activate(run);
                }
                Some(Phase::Loading) => {
                    return self.queue(run, RunOp::Describe, Origin::Reply(reply));
                }
                Some(Phase::Ready(_)) if machine_open => {
                    return self.describe_when_drained(run, Origin::Reply(reply));
                }
                _ => {}
            }
        }
        let memo = meta
            .memo
            .iter()
            .map(|(k, v)| (k.clone(), v.preview(200)))
            .collect();
        let closed = meta.status.is_closed();
        let description = RunDescription {
            run_id: run,
            instance_id: meta.instance_id.to_string(),
            workflow_type: meta.workflow_type.clone(),
            status: meta.status,
            history_len: meta.next_seq.0 - 1,
            started_at: meta.started_at,
            closed_at: meta.closed_at,
            parent: meta.parent.as_ref().map(|p| (p.run_id, p.step)),
            pending: facts.pending,
            signal_waits: view
                .as_ref()
                .map(|v| v.signal_waits.clone())
                .unwrap_or_default(),
            streams: view.as_ref().map(|v| v.streams.clone()).unwrap_or_default(),
            coroutines: view.as_ref().map(|v| v.coroutines),
            scopes: view.as_ref().map(|v| v.scopes.clone()).unwrap_or_default(),
            attempts: if closed {
                Vec::new()
            } else {
                self.attempt_views_with(run, &facts.tasks)
            },
            children: facts
                .children
                .into_iter()
                .map(|(c, m)| ChildView {
                    step: c.step,
                    run_id: c.run_id,
                    instance_id: c.instance_id,
                    workflow_type: c.workflow_type,
                    status: m.map(|m| m.status),
                })
                .collect(),
            cancel_requested: meta.cancel_requested,
            parked: facts.parked,
            memo,
            search_attributes: meta.search_attributes.clone(),
            store_health: self.store_health.clone(),
        };
        self.reply(reply, Answer::Described(Box::new(description)), None);
        self.forget_if_unused(run);
    }

    /// The attempts the shard supervises for `run` and those of `stored`
    /// (the run's task rows) it does not hold, in step order.
    fn attempt_views_with(
        &self,
        run: RunId,
        stored: &[keel_storage::TaskEntry],
    ) -> Vec<AttemptView> {
        let mut views = self.attempt_views(run);
        let held: std::collections::BTreeSet<Step> = views.iter().map(|v| v.step).collect();
        views.extend(
            stored
                .iter()
                .filter(|t| !held.contains(&t.execution_id.step))
                .map(|t| AttemptView {
                    step: t.execution_id.step,
                    attempt_id: super::attempts::attempt_id(t).to_string(),
                    lease_owner: String::new(),
                    epoch: 0,
                    expires_at: t.due,
                    deliveries: 0,
                    delayed_by: None,
                    state: "stored",
                    cancel_requested: t.cancel_requested,
                }),
        );
        views.sort_by_key(|v| v.step);
        views
    }

    /// A run described from the store alone leaves no slot behind.
    fn forget_if_unused(&mut self, run: RunId) {
        let unused = self
            .runs
            .get(&run)
            .is_some_and(|s| matches!(s.phase, Phase::Idle) && s.idle())
            && !self.results.contains_key(&run)
            && !self.updates.contains_key(&run);
        if unused {
            self.forget(run);
        }
    }
}
