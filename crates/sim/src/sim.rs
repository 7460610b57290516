//! The user-facing API: [`Simulation`] builds a simulation, runs it (a
//! fault-free reference run, then the run under faults) and returns a
//! [`Report`]; [`Simulation::shrink`] reduces a failing fault list.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use keel_actors::{Activity, ActivityError, Workflow, WorkflowRegistry};
use keel_storage::{AttemptNo, Event, Failure, FailureKind, Outcome, Payload, RunId};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Serialize, Serializer};

use crate::check::{Violation, ViolationKind};
use crate::fault::{FaultKind, Faults};
use crate::store::{SimStore, StoreKind};
use crate::workload::{register_default, Workload};
use crate::world::{Mock, Setup, World, WorldResult};

/// A deliberately broken engine, to prove that the checker can fail.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BreakMode {
    /// The shell skips `RunMachine::check` and the store's duplicate-terminal
    /// check is off: a duplicate result (or signal) is committed twice.
    NoAttemptDedupe,
    /// Effects run before the commit returns: an effect can happen for an
    /// event that never becomes durable.
    EffectBeforeCommit,
    /// A commit is acknowledged before it is synced: a crash loses an
    /// acknowledged commit.
    LoseUnsyncedAck,
    /// The timer service drops a fire whose commit failed, as
    /// `keel_actors::shell::timers` does today: the timer is lost until the
    /// next engine start, and the workflow hangs.
    DropFailedTimer,
    /// Starting a child reports any error to the parent as a failed child,
    /// as `Shared::start_child` does today: a failed commit, or a
    /// redelivered start of a child that already finished, fails the
    /// parent's child call.
    FailChildOnStartError,
    /// A duplicate is answered as soon as the run's machine knows the
    /// input, as the shell does today: the machine also knows inputs whose
    /// commit is still in flight, and a crash before the sync loses the
    /// input after the client was told it was done.
    EarlyDuplicateAnswer,
}

impl BreakMode {
    /// Every mode.
    pub const ALL: [BreakMode; 6] = [
        BreakMode::NoAttemptDedupe,
        BreakMode::EffectBeforeCommit,
        BreakMode::LoseUnsyncedAck,
        BreakMode::DropFailedTimer,
        BreakMode::FailChildOnStartError,
        BreakMode::EarlyDuplicateAnswer,
    ];

    /// The `--break` name.
    pub fn name(self) -> &'static str {
        match self {
            BreakMode::NoAttemptDedupe => "no-attempt-dedupe",
            BreakMode::EffectBeforeCommit => "effect-before-commit",
            BreakMode::LoseUnsyncedAck => "lose-unsynced-ack",
            BreakMode::DropFailedTimer => "drop-failed-timer",
            BreakMode::FailChildOnStartError => "fail-child-on-start-error",
            BreakMode::EarlyDuplicateAnswer => "early-duplicate-answer",
        }
    }

    /// The violations that show this mode: the first violation of a failing
    /// seed is one of them. (An acknowledgement before the sync is usually
    /// caught by its effects first: they run for events that are not
    /// durable yet.)
    pub fn detected_as(self) -> &'static [ViolationKind] {
        match self {
            BreakMode::NoAttemptDedupe => &[ViolationKind::DuplicateTerminal],
            BreakMode::EffectBeforeCommit => &[ViolationKind::EffectBeforeDurable],
            BreakMode::LoseUnsyncedAck => &[
                ViolationKind::AckedCommitLost,
                ViolationKind::EffectBeforeDurable,
            ],
            BreakMode::DropFailedTimer => &[ViolationKind::NotFinished],
            BreakMode::FailChildOnStartError => &[
                ViolationKind::OutcomeMismatch,
                ViolationKind::NotFinished,
                ViolationKind::VerifyFailed,
            ],
            BreakMode::EarlyDuplicateAnswer => {
                &[ViolationKind::NotFinished, ViolationKind::OutcomeMismatch]
            }
        }
    }
}

impl fmt::Display for BreakMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BreakMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        BreakMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = BreakMode::ALL.iter().map(|m| m.name()).collect();
                format!(
                    "unknown break mode {s:?}; expected one of: {}",
                    names.join(", ")
                )
            })
    }
}

/// Why a simulation could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The workload is malformed.
    #[error("bad workload: {0}")]
    Workload(String),
    /// The store could not be opened.
    #[error("store: {0}")]
    Store(String),
    /// An invalid combination of options.
    #[error("bad configuration: {0}")]
    Config(String),
}

#[derive(Clone, Debug)]
enum Source {
    Fixed(Workload),
    DefaultMix(usize),
}

/// A simulation of workflows under faults: the real run machine, executor
/// and store validation, on virtual time, driven by one seed.
///
/// ```
/// use keel_sim::{Faults, Simulation};
/// let report = Simulation::new(7).default_mix(5).faults(Faults::all()).run().unwrap();
/// assert!(report.passed, "{report}");
/// ```
#[derive(Clone)]
pub struct Simulation {
    seed: u64,
    workflows: WorkflowRegistry,
    mocks: BTreeMap<String, Mock>,
    faults: Faults,
    source: Source,
    store: StoreKind,
    breaks: Option<BreakMode>,
    keep_trace: bool,
}

impl fmt::Debug for Simulation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Simulation")
            .field("seed", &self.seed)
            .field("workflows", &self.workflows)
            .field("mocks", &self.mocks.keys().collect::<Vec<_>>())
            .field("faults", &self.faults.to_string())
            .field("store", &self.store)
            .field("breaks", &self.breaks)
            .finish()
    }
}

impl Simulation {
    /// A simulation for `seed`, every fault kind on, nothing registered.
    pub fn new(seed: u64) -> Self {
        Simulation {
            seed,
            workflows: WorkflowRegistry::new(),
            mocks: BTreeMap::new(),
            faults: Faults::all(),
            source: Source::Fixed(Workload::new()),
            store: StoreKind::Mem,
            breaks: None,
            keep_trace: false,
        }
    }

    /// The same simulation with another seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Registers workflow `W`.
    pub fn register_workflow<W: Workflow>(mut self) -> Self {
        self.workflows.register::<W>();
        self
    }

    /// Mocks activity `A` with a deterministic, synchronous body: input and
    /// attempt number (from 1) in, result out. The simulator decides how
    /// long it takes and whether its worker survives.
    pub fn mock_activity<A, F>(mut self, body: F) -> Self
    where
        A: Activity,
        F: Fn(A::Input, u32) -> Result<A::Output, ActivityError> + Send + Sync + 'static,
    {
        let mock: Mock = Arc::new(move |input: &Payload, attempt: AttemptNo| {
            let input: A::Input = input.decode().map_err(|e| {
                Failure::new(
                    FailureKind::Application,
                    format!("activity input does not decode: {e}"),
                    false,
                )
            })?;
            let out = body(input, attempt.0).map_err(Failure::from)?;
            Payload::encode(&out).map_err(|e| {
                Failure::new(
                    FailureKind::Application,
                    format!("activity result does not encode: {e}"),
                    false,
                )
            })
        });
        self.mocks.insert(A::NAME.to_string(), mock);
        self
    }

    /// Which faults to inject (default: all, probabilities drawn per seed).
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// The instances to run.
    pub fn workload(mut self, workload: Workload) -> Self {
        self.source = Source::Fixed(workload);
        self
    }

    /// Runs the default mix of `workflows` instances (drawn from the seed)
    /// and registers its workflows and mocks.
    pub fn default_mix(self, workflows: usize) -> Self {
        let mut s = register_default(self);
        s.source = Source::DefaultMix(workflows);
        s
    }

    /// Which store to run on (default: in-memory).
    pub fn store(mut self, store: StoreKind) -> Self {
        self.store = store;
        self
    }

    /// Runs a deliberately broken engine.
    pub fn break_engine(mut self, mode: BreakMode) -> Self {
        self.breaks = Some(mode);
        self
    }

    /// Keeps the trace lines in the report (they are always hashed).
    pub fn keep_trace(mut self, keep: bool) -> Self {
        self.keep_trace = keep;
        self
    }

    fn workload_for_seed(&self) -> Result<Workload, SimError> {
        match &self.source {
            Source::Fixed(w) => {
                w.check()?;
                Ok(w.clone())
            }
            Source::DefaultMix(n) => {
                let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
                rng.set_stream(1);
                Ok(Workload::default_mix(&mut rng, *n))
            }
        }
    }

    fn execute(
        &self,
        workload: &Workload,
        faults: &Faults,
        breaks: Option<BreakMode>,
        store: StoreKind,
        keep_trace: bool,
    ) -> Result<WorldResult, SimError> {
        let base = ChaCha8Rng::seed_from_u64(self.seed);
        let mut plan_rng = base.clone();
        plan_rng.set_stream(2);
        let plan = faults.plan(&mut plan_rng);
        let mut rng = base;
        rng.set_stream(3);
        let setup = Setup {
            seed: self.seed,
            workflows: &self.workflows,
            mocks: &self.mocks,
            plan,
            breaks,
            workload,
            keep_trace,
        };
        Ok(World::new(setup, rng, SimStore::open(store)?).run())
    }

    /// The outcome of every instance in a fault-free run of the workload.
    pub fn reference(&self) -> Result<BTreeMap<String, Outcome>, SimError> {
        let workload = self.workload_for_seed()?;
        let r = self.execute(&workload, &Faults::none(), None, StoreKind::Mem, false)?;
        if let Some(v) = r.violations.first() {
            return Err(SimError::Config(format!(
                "the fault-free run of the workload fails: {v}"
            )));
        }
        Ok(r.outcomes)
    }

    /// Runs the workload fault-free (the reference), then under faults, and
    /// checks every invariant. Same seed and build, same report.
    pub fn run(&self) -> Result<Report, SimError> {
        self.run_against(None)
    }

    fn run_against(
        &self,
        reference: Option<&BTreeMap<String, Outcome>>,
    ) -> Result<Report, SimError> {
        if self.breaks.is_some() && self.store != StoreKind::Mem {
            return Err(SimError::Config(
                "--break runs on the in-memory store (--store mem) only".into(),
            ));
        }
        let workload = self.workload_for_seed()?;
        let mut violations = Vec::new();
        let computed;
        let reference = match reference {
            Some(r) => r,
            None => {
                let r = self.execute(&workload, &Faults::none(), None, StoreKind::Mem, false)?;
                for v in r.violations {
                    violations.push(Violation {
                        detail: format!("fault-free run: {}", v.detail),
                        ..v
                    });
                }
                computed = r.outcomes;
                &computed
            }
        };
        let r = self.execute(
            &workload,
            &self.faults,
            self.breaks,
            self.store,
            self.keep_trace,
        )?;
        let clean = r.violations.is_empty() && violations.is_empty();
        violations.extend(r.violations);
        if clean {
            for p in workload.plans() {
                let (want, got) = (reference.get(&p.instance), r.outcomes.get(&p.instance));
                if want != got {
                    violations.push(Violation {
                        kind: ViolationKind::OutcomeMismatch,
                        at_ms: r.virtual_ms,
                        detail: format!(
                            "{}: fault-free outcome {}, under faults {}",
                            p.instance,
                            show_outcome(want),
                            show_outcome(got)
                        ),
                    });
                }
            }
        }
        let mut base = ChaCha8Rng::seed_from_u64(self.seed);
        base.set_stream(2);
        let plan = self.faults.plan(&mut base);
        let workflows = workload.plans().len();
        let report = Report {
            seed: self.seed,
            passed: violations.is_empty(),
            violations,
            trace_hash: r.trace_hash,
            faults: self.faults.to_string(),
            fault_probabilities: plan.active(),
            faults_fired: r.faults_fired,
            virtual_ms: r.virtual_ms,
            steps: r.steps,
            commits: r.commits,
            events: r.events,
            engine_crashes: r.crashes,
            outbox_messages: r.outbox_messages,
            workflows,
            finished: r.outcomes.len(),
            outcomes: r.outcomes,
            histories: r.histories,
            trace: r.trace,
            repro: self.repro(&self.faults, workflows),
        };
        Ok(report)
    }

    /// How to reproduce this simulation with `faults`: a `keel sim` command
    /// for the default mix, the builder calls for a user workload.
    pub fn repro(&self, faults: &Faults, workflows: usize) -> String {
        if let Source::Fixed(_) = self.source {
            let mut code = format!(
                "Simulation::new({}).faults(\"{faults}\".parse()?)",
                self.seed
            );
            if self.store != StoreKind::Mem {
                code.push_str(&format!(".store(\"{}\".parse()?)", self.store.name()));
            }
            if let Some(b) = self.breaks {
                code.push_str(&format!(".break_engine(\"{b}\".parse()?)"));
            }
            return format!("{code} with the same workflows, mocks and workload");
        }
        let mut cmd = format!(
            "keel sim --seed {} --faults {} --workflows {workflows}",
            self.seed, faults
        );
        if self.store != StoreKind::Mem {
            cmd.push_str(&format!(" --store {}", self.store.name()));
        }
        if let Some(b) = self.breaks {
            cmd.push_str(&format!(" --break {b}"));
        }
        cmd
    }

    /// Shrinks the fault list of a failing seed: fixes the seed's drawn
    /// probabilities, then greedily switches kinds off one at a time and
    /// halves the remaining probabilities, keeping each change that still
    /// fails with the same kind of violation. `None` when the seed passes.
    pub fn shrink(&self) -> Result<Option<Shrunk>, SimError> {
        let reference = self.reference().ok();
        let first = self.run_against(reference.as_ref())?;
        let Some(target) = first.violations.first().map(|v| v.kind) else {
            return Ok(None);
        };
        let mut runs = 1u32;
        let mut current = Faults::none();
        for (kind, p) in &first.fault_probabilities {
            current = current.with(*kind, *p);
        }
        let mut last = first;
        let still_fails = |faults: &Faults, runs: &mut u32| -> Result<Option<Report>, SimError> {
            *runs += 1;
            let r = self
                .clone()
                .faults(faults.clone())
                .run_against(reference.as_ref())?;
            Ok(r.violations.iter().any(|v| v.kind == target).then_some(r))
        };
        // Round the drawn probabilities, for a readable command line.
        let mut rounded = Faults::none();
        for (kind, p) in current.kinds() {
            rounded = rounded.with(kind, round(p.unwrap_or(0.0)));
        }
        if let Some(r) = still_fails(&rounded, &mut runs)? {
            current = rounded;
            last = r;
        }
        let kinds: Vec<FaultKind> = current.kinds().map(|(k, _)| k).collect();
        for kind in kinds {
            let candidate = current.clone().without(kind);
            if let Some(r) = still_fails(&candidate, &mut runs)? {
                current = candidate;
                last = r;
            }
        }
        for _ in 0..3 {
            let kinds: Vec<(FaultKind, f64)> = current
                .kinds()
                .map(|(k, p)| (k, p.unwrap_or(0.0)))
                .collect();
            for (kind, p) in kinds {
                let candidate = current.clone().with(kind, round(p / 2.0));
                if let Some(r) = still_fails(&candidate, &mut runs)? {
                    current = candidate;
                    last = r;
                }
            }
        }
        let violation = last
            .violations
            .iter()
            .find(|v| v.kind == target)
            .cloned()
            .expect("the kept run fails with the target kind");
        Ok(Some(Shrunk {
            repro: self.repro(&current, last.workflows),
            faults: current,
            violation,
            runs,
        }))
    }
}

/// `p` to three decimals, never rounded down to zero.
fn round(p: f64) -> f64 {
    ((p * 1e3).round() / 1e3).max(0.001)
}

fn show_outcome(o: Option<&Outcome>) -> String {
    match o {
        None => "none (not finished)".into(),
        Some(Outcome::Completed(p)) => format!("completed {}", p.preview(60)),
        Some(Outcome::Failed(f)) => format!("failed ({f})"),
        Some(Outcome::Cancelled(r)) => format!("cancelled ({r})"),
        Some(Outcome::Terminated(r)) => format!("terminated ({r})"),
        Some(Outcome::ContinuedAsNew(r)) => format!("continued as new ({r})"),
    }
}

/// A shrunk failing fault list.
#[derive(Clone, Debug)]
pub struct Shrunk {
    /// The smallest fault list found that still fails.
    pub faults: Faults,
    /// The violation it still produces.
    pub violation: Violation,
    /// Simulations run while shrinking.
    pub runs: u32,
    /// The command that reproduces it.
    pub repro: String,
}

fn kinds_by_name<S: Serializer, V: Serialize>(
    map: &BTreeMap<FaultKind, V>,
    s: S,
) -> Result<S::Ok, S::Error> {
    let named: BTreeMap<&str, &V> = map.iter().map(|(k, v)| (k.name(), v)).collect();
    named.serialize(s)
}

/// What one simulated seed found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// True when every invariant held.
    pub passed: bool,
    /// Every broken invariant (a run stops at the first one found while it
    /// runs; the end checks may add several).
    pub violations: Vec<Violation>,
    /// FNV-1a 64 of the trace: equal for the same seed on the same build.
    pub trace_hash: u64,
    /// The `--faults` list.
    pub faults: String,
    /// The probability each kind drew for this seed (non-zero ones).
    #[serde(serialize_with = "kinds_by_name")]
    pub fault_probabilities: BTreeMap<FaultKind, f64>,
    /// How often each kind fired.
    #[serde(serialize_with = "kinds_by_name")]
    pub faults_fired: BTreeMap<FaultKind, u64>,
    /// Virtual time simulated, in milliseconds.
    pub virtual_ms: u64,
    /// Simulated steps.
    pub steps: u64,
    /// Commits written.
    pub commits: u64,
    /// Events written.
    pub events: u64,
    /// Engine crashes.
    pub engine_crashes: u32,
    /// Outbox messages delivered (none until a workload starts children).
    pub outbox_messages: u64,
    /// Instances in the workload.
    pub workflows: usize,
    /// Instances that finished.
    pub finished: usize,
    /// Every instance's final outcome.
    #[serde(skip)]
    pub outcomes: BTreeMap<String, Outcome>,
    /// Every run's final history.
    #[serde(skip)]
    pub histories: BTreeMap<RunId, Vec<Event>>,
    /// The trace, when kept.
    #[serde(skip)]
    pub trace: Vec<String>,
    /// The command that reproduces this run.
    pub repro: String,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seed {}: {} ({} workflows, {} finished, {} commits, {} ms virtual, trace {:016x})",
            self.seed,
            if self.passed { "passed" } else { "FAILED" },
            self.workflows,
            self.finished,
            self.commits,
            self.virtual_ms,
            self.trace_hash
        )?;
        for v in &self.violations {
            writeln!(f, "  {v}")?;
        }
        if !self.passed {
            writeln!(f, "  reproduce: {}", self.repro)?;
        }
        Ok(())
    }
}
