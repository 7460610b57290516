//! Goal: `keel resume ID --data DIR` unparks a run offline once the code
//! of this build fits its history, leaves it parked (saying why) while it
//! does not, and refuses to touch a directory an engine holds.
//!
//! Method: park a real run on RocksDB (a build whose code panics where the
//! history has a signal), stop the engine, then call the CLI's `resume`
//! through `keel_cli::run` with a registry holding the broken code (exit
//! 1, marker kept) and the fixed code (exit 0, marker gone), and check the
//! park marker in the store after each. An engine opened afterwards drives
//! the run to its end. The flag that breaks the code is this file's own,
//! so no other test shares it.

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use keel::storage::{RocksStore, Store};
use keel::{Engine, EngineError, Workflow, WorkflowContext, WorkflowError, WorkflowRegistry};
use keel_cli::resume_cmd::ResumeArgs;
use keel_cli::Command;

static BROKEN: AtomicBool = AtomicBool::new(false);

struct Toggle;
impl Workflow for Toggle {
    const NAME: &'static str = "toggle";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let a: u32 = ctx.wait_signal("go").await?;
        if BROKEN.load(Ordering::SeqCst) {
            panic!("a bug after the first signal");
        }
        let b: u32 = ctx.wait_signal("go").await?;
        Ok(format!("went {a} and {b}"))
    }
}

fn engine(dir: &Path) -> Engine {
    Engine::builder()
        .data_dir(dir)
        .register_workflow::<Toggle>()
        .build()
        .expect("engine starts")
}

fn registry() -> WorkflowRegistry {
    let mut r = WorkflowRegistry::new();
    r.register::<Toggle>();
    r
}

fn resume(dir: &Path) -> ExitCode {
    let args = ResumeArgs {
        id: "t".into(),
        data: dir.to_path_buf(),
        json: true,
        server: None,
        token: None,
    };
    keel_cli::run(Command::Resume(args), &registry())
}

fn parked(dir: &Path) -> bool {
    let store = RocksStore::open_read_only(dir).expect("opens read-only");
    let run = store.resolve("t").unwrap().expect("the run exists");
    store.parked(run).unwrap().is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_unparks_offline_only_once_the_code_fits() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    BROKEN.store(false, Ordering::SeqCst);
    {
        let e = engine(dir.path());
        e.client().start::<Toggle>("t", &()).await?;
        e.client().signal("t", "go", &7u32, Some("go-1")).await?;
        e.shutdown().await;
    }
    BROKEN.store(true, Ordering::SeqCst);
    {
        let e = engine(dir.path());
        let err = e
            .client()
            .signal("t", "go", &8u32, Some("go-2"))
            .await
            .unwrap_err();
        assert!(matches!(err, EngineError::Parked { .. }), "{err}");
        // Beside a live engine the directory is refused (exit 2), untouched.
        assert_eq!(resume(dir.path()), ExitCode::from(2));
        e.shutdown().await;
    }
    assert!(parked(dir.path()));

    // This build is still broken: exit 1, the run stays parked.
    assert_eq!(resume(dir.path()), ExitCode::from(1));
    assert!(parked(dir.path()), "a run that does not fit stays parked");

    // Fixed: exit 0, the marker is gone, and the next engine drives it.
    BROKEN.store(false, Ordering::SeqCst);
    assert_eq!(resume(dir.path()), ExitCode::SUCCESS);
    assert!(!parked(dir.path()), "resume clears the park marker");
    // A second resume of a run that is not parked says so and succeeds.
    assert_eq!(resume(dir.path()), ExitCode::SUCCESS);

    let e = engine(dir.path());
    let c = e.client();
    c.signal("t", "go", &8u32, Some("go-2")).await?;
    assert_eq!(c.result::<Toggle>("t").await?, "went 7 and 8");
    e.shutdown().await;
    Ok(())
}
