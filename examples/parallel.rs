//! Three activities in one `all` barrier: one step, one suspension.
#[path = "common.rs"]
mod common;

fn main() -> anyhow::Result<()> {
    common::run::<keel_e2e::seeds::ParallelWorkflow>("parallel-1", ())
}
