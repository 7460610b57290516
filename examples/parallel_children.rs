//! Three child workflows in one barrier (the seed's ParentWorkflow).
#[path = "common.rs"]
mod common;

fn main() -> anyhow::Result<()> {
    common::run::<keel_e2e::seeds::ParentWorkflow>("parent-1", ())
}
