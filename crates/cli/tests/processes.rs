//! Goal: several real engine processes on one PostgreSQL database lose no
//! workflow and commit nothing twice while they are killed and frozen:
//! SIGKILL of the working process, SIGKILL of the working process and a
//! standby at once, and SIGSTOP of the working process past its lease (a
//! standby takes over; the woken process must find itself fenced and
//! commit nothing more). Afterwards `keel verify` against the database is
//! clean.
//! The same with the processes sharing the database's shards
//! (`--sharded`): all three work, one is SIGKILLed, then two at once.
//! Method: `keel demo --store URL --processes 3 --json` on a database of
//! this test's own (created and dropped here) on the server `.ci/run`
//! starts; the demo's summary counts completed, lost and duplicated
//! workflows from the histories, and `keel verify --store URL --json` runs
//! as its own process. Without a server the test says so and passes,
//! unless `KEEL_REQUIRE_POSTGRES=1` (set by `.ci/run`).

use std::process::Command;

const WORKFLOWS: u64 = 300;

fn postgres_url() -> Option<String> {
    match std::env::var("KEEL_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("KEEL_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "KEEL_REQUIRE_POSTGRES=1 but KEEL_TEST_POSTGRES_URL is not set: run the tests through .ci/run"
            );
            eprintln!("KEEL_TEST_POSTGRES_URL is not set: skipping the multi-process test");
            None
        }
    }
}

/// Runs one SQL statement on the server's `postgres` database.
fn admin(url: &str, sql: &str) {
    let admin_url = with_database(url, "postgres");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (client, conn) = tokio_postgres::connect(&admin_url, tokio_postgres::NoTls)
            .await
            .expect("connecting to the test server");
        let task = tokio::spawn(conn);
        client.batch_execute(sql).await.expect(sql);
        drop(client);
        let _ = task.await;
    });
}

/// `url` naming database `db` instead.
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = url.split_once('?').map_or((url, ""), |(b, q)| (b, q));
    let slash = base.rfind('/').expect("a URL with a database");
    let mut out = format!("{}/{db}", &base[..slash]);
    if !query.is_empty() {
        out.push('?');
        out.push_str(query);
    }
    out
}

/// The test's database, dropped at the end.
struct Database {
    admin: String,
    name: String,
}

impl Drop for Database {
    fn drop(&mut self) {
        admin(
            &self.admin,
            &format!("drop database if exists {} with (force)", self.name),
        );
    }
}

/// Runs `keel demo --processes 3` with `extra` on a database of its own,
/// checks that every order completed once, and runs `keel verify` on it;
/// returns the demo's summary and its error output.
fn demo_on_own_database(tag: &str, extra: &[&str]) -> Option<(serde_json::Value, String)> {
    let url = postgres_url()?;
    let name = format!("keel_procs_{tag}_{}", std::process::id());
    admin(
        &url,
        &format!("drop database if exists {name} with (force)"),
    );
    admin(&url, &format!("create database {name}"));
    let db = Database {
        admin: url.clone(),
        name: name.clone(),
    };
    let store = with_database(&url, &db.name);
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["demo", "--processes", "3", "--concurrency", "50", "--json"])
        .args(["--workflows", &WORKFLOWS.to_string(), "--store", &store])
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "demo failed: {stderr}");
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("demo printed no JSON ({e}): {stderr}"));
    assert_eq!(summary["completed"], WORKFLOWS, "{summary}");
    assert_eq!(summary["lost"], 0, "{summary}");
    assert_eq!(summary["duplicate_commits"], 0, "{summary}");
    assert_eq!(summary["verify_ok"], true, "{summary}");

    let verify = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["verify", "--json", "--store", &store])
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&verify.stdout).unwrap_or_else(|e| {
        panic!(
            "verify printed no JSON ({e}): {}",
            String::from_utf8_lossy(&verify.stderr)
        )
    });
    assert!(verify.status.success(), "{report}");
    assert_eq!(report["ok"], true, "{report}");
    drop(db);
    Some((summary, stderr))
}

#[test]
fn killed_and_frozen_processes_lose_nothing_and_commit_nothing_twice() {
    let Some((summary, stderr)) = demo_on_own_database("standby", &[]) else {
        return;
    };
    // Two kills and one freeze, each followed by a takeover; the frozen
    // process was fenced when it woke.
    assert_eq!(summary["crashes"], 3, "{summary}\n{stderr}");
    assert_eq!(
        summary["takeovers_s"].as_array().map(Vec::len),
        Some(3),
        "{summary}\n{stderr}"
    );
    assert_eq!(summary["fenced"], 1, "{summary}\n{stderr}");
}

#[test]
fn processes_sharing_the_shards_lose_nothing_when_killed() {
    // All three work at once, each on the shards it leases, serving each
    // other's clients through the relay; one is killed, then two at once.
    let Some((summary, stderr)) = demo_on_own_database("sharded", &["--sharded"]) else {
        return;
    };
    assert_eq!(summary["crashes"], 2, "{summary}\n{stderr}");
}
