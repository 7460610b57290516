// Shared by the seed examples: run one workflow on a fresh engine and print
// its result as JSON.
use keel::Workflow;

pub fn run<W: Workflow>(instance: &str, input: W::Input) -> anyhow::Result<()>
where
    W::Output: serde::Serialize,
{
    let dir = tempfile::tempdir()?;
    let engine = keel_e2e::seeds::engine(dir.path())?;
    let client = engine.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let out = rt.block_on(async {
        client.start::<W>(instance, &input).await?;
        client.result::<W>(instance).await
    })?;
    println!("{}: {}", W::NAME, serde_json::to_string(&out)?);
    Ok(())
}
