use keel_sim::workload::*;
use keel_sim::*;
fn w() -> Workload {
    let mut w = Workload::new();
    for i in 0..20 {
        let inst = format!("sig-{i}");
        w = w
            .start_at::<SignalsWf>(&inst, &1, i * 7)
            .signal(&inst, "add", &5u64, 100 + i * 13, "c")
            .signal(&inst, "add", &5u64, 100 + i * 13, "c");
    }
    w
}
#[test]
fn smoke() {
    for mode in [None, Some(BreakMode::EarlyDuplicateAnswer)] {
        let mut fails = 0;
        let mut first = None;
        for seed in 0..200 {
            let mut s = register_default(Simulation::new(seed))
                .workload(w())
                .faults(
                    Faults::none()
                        .with(FaultKind::EngineCrash, 0.3)
                        .with(FaultKind::Reorder, 0.5),
                );
            if let Some(m) = mode {
                s = s.break_engine(m);
            }
            let r = s.run().unwrap();
            if !r.passed {
                fails += 1;
                if first.is_none() {
                    first = Some(seed);
                    println!("{r}");
                }
            }
        }
        println!("{mode:?}: fails {fails} first {first:?}");
    }
    for seed in [3055, 3789] {
        let r = Simulation::new(seed).default_mix(20).run().unwrap();
        println!("{r}");
        let r = Simulation::new(seed)
            .default_mix(20)
            .break_engine(BreakMode::EarlyDuplicateAnswer)
            .run()
            .unwrap();
        println!("{r}");
    }
}
