//! Three activities one after another (the seed's sequential example).
#[path = "common.rs"]
mod common;

fn main() -> anyhow::Result<()> {
    common::run::<keel_e2e::seeds::SequentialWorkflow>("sequential-1", ())
}
