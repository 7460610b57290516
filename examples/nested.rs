//! A barrier with a nested barrier (the seed's NestedWorkflow).
#[path = "common.rs"]
mod common;

fn main() -> anyhow::Result<()> {
    common::run::<keel_e2e::seeds::NestedWorkflow>("nested-1", ())
}
