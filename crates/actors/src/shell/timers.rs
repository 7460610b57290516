//! The timer service: fires durable timers into runs and releases retry
//! attempts when their backoff has passed.
//!
//! It holds due times in memory, loaded from the store's timer index and
//! pending attempts at start and fed by commit effects afterwards. A timer
//! stays in the store until its `TimerFired` event is committed, so a fire
//! lost to a crash is re-armed by the next start.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use keel_storage::{RunId, Step, Timestamp};

use super::engine::Shared;
use super::workers::{AttemptTask, Dispatch};
use crate::machine::Input;

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Arm {
    pub(crate) run_id: RunId,
    pub(crate) step: Step,
    pub(crate) fire_at: Timestamp,
}

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct ScheduleTask {
    pub(crate) task: AttemptTask,
    pub(crate) due: Timestamp,
}

enum Item {
    Fire(RunId, Step),
    Task(Box<AttemptTask>),
}

pub(crate) struct TimerService {
    shared: Arc<Shared>,
    queue: BTreeMap<(Timestamp, u64), Item>,
    next: u64,
    wake: Option<(Timestamp, SpawnHandle)>,
}

impl TimerService {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        TimerService {
            shared,
            queue: BTreeMap::new(),
            next: 0,
            wake: None,
        }
    }

    fn insert(&mut self, due: Timestamp, item: Item, ctx: &mut Context<Self>) {
        self.next += 1;
        self.queue.insert((due, self.next), item);
        self.reschedule(ctx);
    }

    fn reschedule(&mut self, ctx: &mut Context<Self>) {
        let Some(&(due, _)) = self.queue.keys().next() else {
            return;
        };
        if let Some((at, handle)) = self.wake {
            if at <= due {
                return;
            }
            ctx.cancel_future(handle);
        }
        let now = self.shared.now();
        let delay = Duration::from_millis(due.0.saturating_sub(now.0));
        let handle = ctx.run_later(delay, |act, ctx| {
            act.wake = None;
            act.fire_due(ctx);
        });
        self.wake = Some((due, handle));
    }

    fn fire_due(&mut self, ctx: &mut Context<Self>) {
        let now = self.shared.now();
        while let Some(entry) = self.queue.first_entry() {
            if entry.key().0 > now {
                break;
            }
            match entry.remove() {
                Item::Fire(run, step) => {
                    let shared = self.shared.clone();
                    actix::spawn(async move {
                        shared
                            .deliver_until_final(run, Input::TimerFired { step })
                            .await;
                    });
                }
                Item::Task(task) => self.shared.workers().do_send(Dispatch(*task)),
            }
        }
        self.reschedule(ctx);
    }
}

impl Actor for TimerService {
    type Context = Context<Self>;
}

impl Handler<Arm> for TimerService {
    type Result = ();

    fn handle(&mut self, msg: Arm, ctx: &mut Self::Context) {
        self.insert(msg.fire_at, Item::Fire(msg.run_id, msg.step), ctx);
    }
}

impl Handler<ScheduleTask> for TimerService {
    type Result = ();

    fn handle(&mut self, msg: ScheduleTask, ctx: &mut Self::Context) {
        self.insert(msg.due, Item::Task(Box::new(msg.task)), ctx);
    }
}
