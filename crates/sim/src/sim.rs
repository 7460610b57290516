//! The user-facing API: [`Simulation`] builds a simulation, runs it (a
//! fault-free reference run, then the run under faults) and returns a
//! [`Report`]; [`Simulation::shrink`] reduces a failing fault list.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use keel_core::{Activity, ActivityError, Workflow, WorkflowRegistry};
use keel_resilience::{CompiledPipeline, ManualClock};
use keel_storage::{AttemptNo, Event, Failure, FailureKind, Outcome, Payload, RunId};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Serialize, Serializer};

pub use keel_core::driver::BreakMode;

use crate::check::{Violation, ViolationKind};
use crate::fault::{FaultKind, Faults, Firings};
use crate::host::{Mock, ProfileSpec, Setup, World, WorldResult};
use crate::store::{SimStore, StoreKind};
use crate::workload::{register_default, Workload};

/// The violations that show a broken driver (`--break`): the first
/// violation of a failing seed is one of them.
pub fn detected_as(mode: BreakMode) -> &'static [ViolationKind] {
    match mode {
        BreakMode::NoAttemptDedupe => &[ViolationKind::DuplicateTerminal],
        BreakMode::EffectBeforeCommit => &[ViolationKind::EffectBeforeDurable],
        BreakMode::LoseUnsyncedAck => &[
            ViolationKind::EffectBeforeDurable,
            ViolationKind::AckedCommitLost,
        ],
        BreakMode::SkipClosePolicy => &[ViolationKind::NotFinished, ViolationKind::IntentLeftOver],
        BreakMode::RedeliverSameEpoch => &[ViolationKind::EpochReused],
        BreakMode::QuerySpeculative => &[ViolationKind::WrongAnswer],
        BreakMode::SkipFence => &[ViolationKind::FencedCommit],
        BreakMode::KeepClosedClosures => &[ViolationKind::ClosureLeftOver],
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

/// A simulation of workflows under faults: the engine's driver, run
/// machine, executor and store validation, on virtual time, driven by one
/// seed.
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
    profiles: BTreeMap<String, ProfileSpec>,
    faults: Faults,
    source: Source,
    /// Only these instances of the workload (by index), when given.
    keep: Option<Vec<usize>>,
    /// Only these fault firings, when given.
    firings: Option<Firings>,
    store: StoreKind,
    breaks: Option<BreakMode>,
    keep_trace: bool,
    processes: usize,
}

impl fmt::Debug for Simulation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Simulation")
            .field("seed", &self.seed)
            .field("workflows", &self.workflows)
            .field("mocks", &self.mocks.keys().collect::<Vec<_>>())
            .field("profiles", &self.profiles.keys().collect::<Vec<_>>())
            .field("faults", &self.faults.to_string())
            .field("store", &self.store)
            .field("breaks", &self.breaks)
            .field("processes", &self.processes)
            .finish()
    }
}

/// Most engine processes one simulation runs on a store.
pub const SIM_PROCESSES_MAX: usize = 8;

fn mock_of<A, F>(body: F) -> impl Fn(&Payload, AttemptNo) -> Result<Payload, Failure>
where
    A: Activity,
    F: Fn(A::Input, u32) -> Result<A::Output, ActivityError>,
{
    move |input: &Payload, attempt: AttemptNo| {
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
    }
}

impl Simulation {
    /// A simulation for `seed`, every fault kind on, nothing registered.
    pub fn new(seed: u64) -> Self {
        Simulation {
            seed,
            workflows: WorkflowRegistry::new(),
            mocks: BTreeMap::new(),
            profiles: BTreeMap::new(),
            faults: Faults::all(),
            source: Source::Fixed(Workload::new()),
            keep: None,
            firings: None,
            store: StoreKind::Mem,
            breaks: None,
            keep_trace: false,
            processes: 1,
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
    /// long it takes (1 to 40 ms) and whether its worker survives.
    pub fn mock_activity<A, F>(self, body: F) -> Self
    where
        A: Activity,
        F: Fn(A::Input, u32) -> Result<A::Output, ActivityError> + Send + Sync + 'static,
    {
        self.mock_activity_taking::<A, F>(1..=40, body)
    }

    /// Like [`Simulation::mock_activity`], for an activity whose attempts
    /// take `duration_ms` (heartbeating ones, say).
    pub fn mock_activity_taking<A, F>(
        mut self,
        duration_ms: std::ops::RangeInclusive<u64>,
        body: F,
    ) -> Self
    where
        A: Activity,
        F: Fn(A::Input, u32) -> Result<A::Output, ActivityError> + Send + Sync + 'static,
    {
        let mock = Mock {
            body: Arc::new(mock_of::<A, F>(body)),
            duration_ms: (
                *duration_ms.start(),
                *duration_ms.end().max(duration_ms.start()),
            ),
            fallback: None,
        };
        self.mocks.insert(A::NAME.to_string(), mock);
        self
    }

    /// Gives mocked activity `A` a fallback for its final failure (used when
    /// its call's resilience profile enables fallbacks).
    pub fn mock_fallback<A, F>(mut self, fallback: F) -> Self
    where
        A: Activity,
        F: Fn(A::Input) -> A::Output + Send + Sync + 'static,
    {
        if let Some(m) = self.mocks.get_mut(A::NAME) {
            m.fallback = Some(Arc::new(move |input: &Payload, _failure: &Failure| {
                let input: A::Input = input.decode().ok()?;
                Some(
                    Payload::encode(&fallback(input))
                        .map_err(|e| Failure::new(FailureKind::Application, e.to_string(), false)),
                )
            }));
        }
        self
    }

    /// Registers a resilience profile activities may name: `build` compiles
    /// the pipeline on the clock it is given, which follows virtual time.
    pub fn resilience_profile(
        mut self,
        name: &str,
        build: impl Fn(Arc<ManualClock>) -> CompiledPipeline<Failure> + Send + Sync + 'static,
    ) -> Self {
        self.profiles.insert(name.to_string(), Arc::new(build));
        self
    }

    /// Which faults to inject (default: all, probabilities drawn per seed).
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// Only these fault firings happen (a shrunk schedule); see
    /// [`Firings`].
    pub fn firings(mut self, firings: Firings) -> Self {
        self.firings = Some(firings);
        self
    }

    /// The instances to run.
    pub fn workload(mut self, workload: Workload) -> Self {
        self.source = Source::Fixed(workload);
        self
    }

    /// Runs only the instances of the workload at these indices (a shrunk
    /// workload).
    pub fn only_workflows(mut self, indices: Vec<usize>) -> Self {
        self.keep = Some(indices);
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

    /// Runs `n` engine processes on one store (default 1). With more than
    /// one, runs are spread over shards that each process takes under a
    /// lease with a fencing epoch, and the faults include processes frozen
    /// past their leases and processes killed. The store is then the
    /// in-memory one in `Sync` mode, as a shared database commits durably
    /// before it answers (`--store mem` means that; `rocksdb` is refused:
    /// one directory has one writer).
    pub fn processes(mut self, n: usize) -> Self {
        self.processes = n;
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
        let full = match &self.source {
            Source::Fixed(w) => {
                w.check()?;
                w.clone()
            }
            Source::DefaultMix(n) => {
                let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
                rng.set_stream(1);
                Workload::default_mix(&mut rng, *n)
            }
        };
        Ok(match &self.keep {
            Some(keep) => full.subset(keep),
            None => full,
        })
    }

    fn execute(
        &self,
        workload: &Workload,
        faults: &Faults,
        breaks: Option<BreakMode>,
        store: StoreKind,
        keep_trace: bool,
        processes: usize,
    ) -> Result<WorldResult, SimError> {
        let base = ChaCha8Rng::seed_from_u64(self.seed);
        let mut plan_rng = base.clone();
        plan_rng.set_stream(2);
        let plan = faults.plan(&mut plan_rng);
        let mut rng = base;
        rng.set_stream(3);
        let firings = if faults.is_empty() {
            None
        } else {
            self.firings.as_ref()
        };
        let setup = Setup {
            seed: self.seed,
            workflows: &self.workflows,
            mocks: &self.mocks,
            profiles: &self.profiles,
            plan,
            breaks,
            workload,
            keep_trace,
            firings,
            processes,
        };
        let store =
            match (processes, store) {
                (1, s) => s,
                (_, StoreKind::Mem | StoreKind::MemSync) => StoreKind::MemSync,
                (_, StoreKind::RocksDb) => return Err(SimError::Config(
                    "several processes share the in-memory store only (--store mem): a RocksDB \
                     directory has one writer"
                        .into(),
                )),
            };
        Ok(World::new(setup, rng, SimStore::open(store)?).run())
    }

    /// The outcome of every instance in a fault-free run of the workload.
    pub fn reference(&self) -> Result<BTreeMap<String, Outcome>, SimError> {
        let workload = self.workload_for_seed()?;
        let r = self.execute(&workload, &Faults::none(), None, StoreKind::Mem, false, 1)?;
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
        if !(1..=SIM_PROCESSES_MAX).contains(&self.processes) {
            return Err(SimError::Config(format!(
                "--processes takes 1 to {SIM_PROCESSES_MAX}, not {}",
                self.processes
            )));
        }
        if self.breaks == Some(BreakMode::SkipFence) && self.processes < 2 {
            return Err(SimError::Config(
                "--break skip-fence needs several processes (--processes 2 or more)".into(),
            ));
        }
        let workload = self.workload_for_seed()?;
        let mut violations = Vec::new();
        let computed;
        let reference = match reference {
            Some(r) => r,
            None => {
                let r = self.execute(&workload, &Faults::none(), None, StoreKind::Mem, false, 1)?;
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
            self.processes,
        )?;
        let clean = r.violations.is_empty() && violations.is_empty();
        violations.extend(r.violations);
        if clean {
            for p in workload.plans() {
                let (want, got) = (reference.get(&p.instance), r.outcomes.get(&p.instance));
                if want.map(comparable) != got.map(comparable) {
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
            shards: r.shards,
            processes: self.processes,
            takeovers: r.takeovers,
            shards_lost: r.fenced,
            shards_released: r.released,
            copies_lost: r.copies_lost,
            workflows,
            finished: r.outcomes.len(),
            outcomes: r.outcomes,
            histories: r.histories,
            trace: r.trace,
            firings: Firings::keep(r.firings),
            repro: self.repro(&self.faults),
        };
        Ok(report)
    }

    /// How to reproduce this simulation with `faults`: a `keel sim` command
    /// for the default mix, the builder calls for a user workload.
    pub fn repro(&self, faults: &Faults) -> String {
        let mut extra = String::new();
        if let Some(keep) = &self.keep {
            let list: Vec<String> = keep.iter().map(|i| i.to_string()).collect();
            extra.push_str(&format!(" --only-workflows {}", list.join(",")));
        }
        if let Some(f) = &self.firings {
            extra.push_str(&format!(" --firings {f}"));
        }
        if let Source::Fixed(_) = self.source {
            let mut code = format!(
                "Simulation::new({}).faults(\"{faults}\".parse()?)",
                self.seed
            );
            if let Some(keep) = &self.keep {
                code.push_str(&format!(".only_workflows(vec!{keep:?})"));
            }
            if let Some(f) = &self.firings {
                code.push_str(&format!(".firings(\"{f}\".parse()?)"));
            }
            if self.store != StoreKind::Mem {
                code.push_str(&format!(".store(\"{}\".parse()?)", self.store.name()));
            }
            if self.processes != 1 {
                code.push_str(&format!(".processes({})", self.processes));
            }
            if let Some(b) = self.breaks {
                code.push_str(&format!(".break_engine(\"{b}\".parse()?)"));
            }
            return format!("{code} with the same workflows, mocks and workload");
        }
        let workflows = match self.source {
            Source::DefaultMix(n) => n,
            Source::Fixed(_) => 0,
        };
        let mut cmd = format!(
            "keel sim --seed {} --faults {} --workflows {workflows}{extra}",
            self.seed, faults
        );
        if self.store != StoreKind::Mem {
            cmd.push_str(&format!(" --store {}", self.store.name()));
        }
        if self.processes != 1 {
            cmd.push_str(&format!(" --processes {}", self.processes));
        }
        if let Some(b) = self.breaks {
            cmd.push_str(&format!(" --break {b}"));
        }
        cmd
    }

    /// Shrinks a failing seed to a small reproduction that still fails with
    /// the same kind of violation: first the fault kinds (the seed's drawn
    /// probabilities fixed, kinds switched off one at a time), then the
    /// workload (instances dropped one at a time), then the fault schedule
    /// (the firings that happened, dropped half by half and then one by
    /// one). `None` when the seed passes.
    pub fn shrink(&self) -> Result<Option<Shrunk>, SimError> {
        let first = self.run()?;
        let Some(target) = first.violations.first().map(|v| v.kind) else {
            return Ok(None);
        };
        let mut runs = 1u32;
        let mut cur = self.clone();
        let mut faults = Faults::none();
        for (kind, p) in &first.fault_probabilities {
            faults = faults.with(*kind, round(*p));
        }
        let mut last = first;
        let still = |candidate: &Simulation, runs: &mut u32| -> Result<Option<Report>, SimError> {
            *runs += 1;
            let r = candidate.run()?;
            Ok(r.violations.iter().any(|v| v.kind == target).then_some(r))
        };
        // Fault kinds.
        let with_rounded = cur.clone().faults(faults.clone());
        if let Some(r) = still(&with_rounded, &mut runs)? {
            cur = with_rounded;
            last = r;
        }
        let kinds: Vec<FaultKind> = cur.faults.kinds().map(|(k, _)| k).collect();
        for kind in kinds {
            let candidate = cur.clone().faults(cur.faults.clone().without(kind));
            if let Some(r) = still(&candidate, &mut runs)? {
                cur = candidate;
                last = r;
            }
        }
        // The workload.
        let n = cur.workload_for_seed()?.plans().len();
        let mut keep: Vec<usize> = cur.keep.clone().unwrap_or_else(|| (0..n).collect());
        let mut i = 0;
        while i < keep.len() && keep.len() > 1 {
            let mut fewer = keep.clone();
            fewer.remove(i);
            let candidate = Simulation {
                keep: Some(fewer.clone()),
                ..cur.clone()
            };
            if let Some(r) = still(&candidate, &mut runs)? {
                keep = fewer;
                cur = candidate;
                last = r;
            } else {
                i += 1;
            }
        }
        // The fault schedule.
        let mut firings: Vec<(FaultKind, u32)> = last.firings.iter().collect();
        let mut chunk = firings.len().div_ceil(2).max(1);
        while !firings.is_empty() {
            let mut shrank = false;
            let mut start = 0;
            while start < firings.len() {
                let end = (start + chunk).min(firings.len());
                let fewer: Vec<_> = firings[..start]
                    .iter()
                    .chain(&firings[end..])
                    .copied()
                    .collect();
                let candidate = cur.clone().firings(Firings::keep(fewer.clone()));
                if let Some(r) = still(&candidate, &mut runs)? {
                    firings = fewer;
                    cur = candidate;
                    last = r;
                    shrank = true;
                } else {
                    start = end;
                }
            }
            if chunk == 1 && !shrank {
                break;
            }
            chunk = (chunk / 2).max(1);
        }
        let violation = last
            .violations
            .iter()
            .find(|v| v.kind == target)
            .cloned()
            .expect("the kept run fails with the target kind");
        Ok(Some(Shrunk {
            repro: cur.repro(&cur.faults),
            faults: cur.faults.clone(),
            workflows: keep,
            firings: Firings::keep(firings),
            violation,
            runs,
        }))
    }
}

/// `p` to three decimals, never rounded down to zero.
fn round(p: f64) -> f64 {
    ((p * 1e3).round() / 1e3).max(0.001)
}

/// An outcome as runs under different faults must agree on it: a timeout
/// by which timeout it was, not by its deadline (set when the start
/// committed, which faults may delay).
fn comparable(o: &Outcome) -> Outcome {
    match o {
        Outcome::TimedOut(m) => {
            Outcome::TimedOut(m.split(" passed at").next().unwrap_or(m).to_string())
        }
        other => other.clone(),
    }
}

fn show_outcome(o: Option<&Outcome>) -> String {
    match o {
        None => "none (not finished)".into(),
        Some(Outcome::Completed(p)) => format!("completed {}", p.preview(60)),
        Some(Outcome::Failed(f)) => format!("failed ({f})"),
        Some(Outcome::Cancelled(r)) => format!("cancelled ({r})"),
        Some(Outcome::Terminated(r)) => format!("terminated ({r})"),
        Some(Outcome::TimedOut(r)) => format!("timed out ({r})"),
        Some(Outcome::ContinuedAsNew(r)) => format!("continued as new ({r})"),
    }
}

/// A shrunk failing simulation.
#[derive(Clone, Debug)]
pub struct Shrunk {
    /// The smallest fault list found that still fails.
    pub faults: Faults,
    /// The workload's instances (indices) it keeps.
    pub workflows: Vec<usize>,
    /// The fault firings it keeps.
    pub firings: Firings,
    /// The violation it still produces.
    pub violation: Violation,
    /// Simulations run while shrinking.
    pub runs: u32,
    /// The command that reproduces it.
    pub repro: String,
}

fn as_text<S: Serializer, T: fmt::Display>(value: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(value)
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
    /// Engine crashes (with several processes, also processes killed).
    pub engine_crashes: u32,
    /// Messages delivered between shards.
    pub outbox_messages: u64,
    /// Shards the simulated engine ran.
    pub shards: u16,
    /// Engine processes sharing the store.
    pub processes: usize,
    /// Shards a process took from an earlier owner (several processes).
    pub takeovers: u32,
    /// Shards that stopped in a process because they lost their lease.
    pub shards_lost: u32,
    /// Shards a process gave up for another to take (rebalancing).
    pub shards_released: u32,
    /// Copies of attempts lost with a killed process that had taken them
    /// from another process's shard (each reported to its shard).
    pub copies_lost: u32,
    /// The fault firings that happened, as `kind#index` (what `--firings`
    /// takes to replay a subset).
    #[serde(serialize_with = "as_text")]
    pub firings: Firings,
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
