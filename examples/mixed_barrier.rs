//! An activity and a child workflow in one barrier (the seed's OrderWorkflow).
#[path = "common.rs"]
mod common;

fn main() -> anyhow::Result<()> {
    common::run::<keel_e2e::seeds::MixedOrderWorkflow>("mixed-1", ())
}
