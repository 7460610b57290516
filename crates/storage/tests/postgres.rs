// Goal: what only the PostgreSQL store has is checked against a real
// server: a database of another schema version is refused naming both
// versions; a second writer is refused while the first holds the database;
// a process past its write lease is fenced (its commits refused, its
// health failed) while a standby takes over and carries on; wrong
// credentials, an unreachable server and a malformed address give
// typed errors; and a connection killed between or in the middle of
// commits loses nothing and duplicates nothing: every commit answered Ok
// is in the history, every commit answered with an error is not, so the
// committer can retry it safely. (The store's shared behaviour, the same
// as RocksDB's and the in-memory store's, is checked by the conformance
// tests in commit.rs, list.rs, verify.rs and limits.rs, which run on this
// store too.)
// Method: each test takes a fresh schema on the server `.ci/run` starts
// (scripts/postgres.sh); the server's own SQL (through tokio-postgres)
// changes the version row and kills the store's connections with
// `pg_terminate_backend`, from a thread that keeps killing while commits
// run.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use keel_storage::{DatabaseFault, Error, PgOptions, PgStore, Seq, Store, SCHEMA_VERSION};

/// Runs one SQL statement on the test server (its own runtime: the store's
/// is private).
fn admin(url: &str, sql: &str) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .expect("admin connect");
        tokio::spawn(connection);
        client.execute(sql, &[]).await.expect("admin statement")
    })
}

/// The application name the killed store connects with, so that only its
/// connections are killed (other tests run beside it).
const KILLED_APP: &str = "keel_killed";

/// Kills every connection of the store under test, as a restarted server
/// or a network cut would.
fn kill_store_connections(url: &str) -> u64 {
    admin(
        url,
        &format!(
            "select pg_terminate_backend(pid) from pg_stat_activity \
             where application_name = '{KILLED_APP}' and pid <> pg_backend_pid()"
        ),
    )
}

#[test]
fn another_schema_version_is_refused_naming_both() {
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    drop(PgStore::open(scratch.0.clone()).expect("create"));
    admin(
        &url,
        &format!(
            "update \"{}\".version set schema_version = 99",
            scratch.0.schema
        ),
    );
    for result in [
        PgStore::open(scratch.0.clone()),
        PgStore::open_read_only(scratch.0.clone()),
    ] {
        let err = result.expect_err("a store of version 99 must be refused");
        assert!(
            matches!(err, Error::DatabaseSchemaVersion { found: 99, expected, .. } if expected == SCHEMA_VERSION),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("99") && text.contains(&SCHEMA_VERSION.to_string()),
            "{text}"
        );
    }
}

#[test]
fn a_second_writer_is_refused_while_the_first_holds_the_database() {
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    let first = PgStore::open(scratch.0.clone()).expect("first writer");
    let err = PgStore::open(scratch.0.clone().lease_wait_ms(300)).expect_err("second writer");
    assert!(matches!(err, Error::DatabaseLocked { .. }), "{err}");
    // Readers are welcome beside the writer.
    let reader = PgStore::open_read_only(scratch.0.clone()).expect("reader");
    let mut b = RunBuilder::new(run_id(1), 1_000);
    b.commit(&first, vec![started(b.run, "held", "wf")])
        .expect("commit");
    assert_eq!(reader.history(b.run).expect("read").len(), 1);
    let err = reader
        .commit(keel_storage::CommitBatch::append(b.run, vec![]))
        .wait()
        .expect_err("a read-only store refuses commits");
    assert!(matches!(err, Error::ReadOnly), "{err}");
    drop(first);
    let second = PgStore::open(scratch.0.clone()).expect("writer after the first closed");
    assert_eq!(second.history(b.run).expect("read").len(), 1);
}

#[test]
fn bad_addresses_and_credentials_get_typed_errors() {
    let Some(url) = postgres_url() else { return };
    // Wrong password: swap the password part of the URL.
    let at = url.find('@').expect("url has credentials");
    let colon = url[..at].rfind(':').expect("url has a password");
    let wrong = format!("{}:not-the-password{}", &url[..colon], &url[at..]);
    let err = PgStore::open(PgOptions::new(&wrong)).expect_err("wrong password");
    assert!(
        matches!(
            err,
            Error::Database {
                fault: DatabaseFault::Refused,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("password"), "{err}");
    assert!(!err.to_string().contains("not-the-password"), "{err}");

    // Nothing listens on port 1.
    let err = PgStore::open(PgOptions::new("postgres://keel:x@127.0.0.1:1/keel"))
        .expect_err("unreachable");
    assert!(
        matches!(
            err,
            Error::Database {
                fault: DatabaseFault::Unreachable,
                ..
            }
        ),
        "{err}"
    );

    let err = PgStore::open(PgOptions::new("postgres://keel@127.0.0.1:notaport/x"))
        .expect_err("malformed");
    assert!(
        matches!(
            err,
            Error::Database {
                fault: DatabaseFault::Config,
                ..
            }
        ),
        "{err}"
    );
    let err = PgStore::open(PgOptions::new(&url).schema("Robert'); drop table x;--"))
        .expect_err("bad schema name");
    assert!(
        matches!(
            err,
            Error::Database {
                fault: DatabaseFault::Config,
                ..
            }
        ),
        "{err}"
    );

    // A read-only open of a schema without keel tables creates nothing.
    let scratch = PgScratch::new(&url);
    let err = PgStore::open_read_only(scratch.0.clone()).expect_err("empty schema");
    assert!(
        matches!(
            err,
            Error::Database {
                fault: DatabaseFault::Missing,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn commits_survive_killed_connections_exactly_once() {
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    let mut options = scratch.0.clone();
    options.url = format!("{url}?application_name={KILLED_APP}");
    let store = PgStore::open(options).expect("open");
    let mut b = RunBuilder::new(run_id(7), 1_000);
    b.commit(&store, vec![started(b.run, "killed", "wf")])
        .expect("start");

    // Killed between commits: the next commit reconnects first.
    assert!(kill_store_connections(&url) >= 1);
    b.commit(&store, vec![signal("a", b"1")])
        .expect("commit after the connection was killed");
    assert_eq!(store.history(b.run).expect("read").len(), 2);

    // Killed at random moments while commits run: each answer must agree
    // with the history.
    let stop = Arc::new(AtomicBool::new(false));
    let killer = {
        let (stop, url) = (stop.clone(), url.clone());
        std::thread::spawn(move || {
            let mut kills = 0u64;
            while !stop.load(Ordering::Relaxed) {
                kills += kill_store_connections(&url);
                std::thread::sleep(std::time::Duration::from_millis(3));
            }
            kills
        })
    };
    let (mut ok, mut failed) = (0, 0);
    while ok < 150 {
        let before = b.next;
        match b.commit(&store, vec![signal("s", &before.to_le_bytes())]) {
            Ok(ack) => {
                ok += 1;
                assert_eq!(ack.appends[0].first, Seq(before));
            }
            Err(e) => {
                failed += 1;
                assert!(failed < 5_000, "commits keep failing: {e}");
            }
        }
        // Whatever the answer, the history ends exactly where the answers
        // say: nothing answered Ok is missing, nothing refused is there.
        let history = loop {
            match store.history(b.run) {
                Ok(h) => break h,
                Err(_) => continue,
            }
        };
        assert_eq!(
            history.len() as u64,
            b.next - 1,
            "after {ok} ok, {failed} failed"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let kills = killer.join().expect("killer");
    eprintln!("{ok} commits ok, {failed} answered with an error, {kills} connections killed");
    let report = store.verify().expect("verify");
    assert!(report.ok, "{:?}", report.violations);
}

#[test]
fn an_owner_past_its_lease_is_fenced_and_a_standby_takes_over() {
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    let first = PgStore::open(scratch.0.clone().lease_ms(1_000)).expect("first owner");
    let mut b = RunBuilder::new(run_id(9), 1_000);
    b.commit(&first, vec![started(b.run, "fenced", "wf")])
        .expect("start");

    // A standby waits for the lease while the owner renews it (bounded
    // here, so a failure cannot hang the suite).
    let standby = {
        let options = scratch.0.clone().lease_ms(1_000).lease_wait_ms(15_000);
        std::thread::spawn(move || PgStore::open(options))
    };
    std::thread::sleep(std::time::Duration::from_millis(1_500));
    assert!(
        !standby.is_finished(),
        "the standby took a lease that is renewed"
    );

    // The owner "pauses" past its lease and the lease moves on without it:
    // a newer epoch under another name, already ended. Merely ending the
    // owner's lease would not do: the owner is not really paused, so its
    // writer would renew it before the standby asked again.
    admin(
        &url,
        &format!(
            "update \"{}\".lease set epoch = epoch + 1, owner = 'a process that came and went', \
             expires_at = '-infinity'",
            scratch.0.schema
        ),
    );
    let second = standby
        .join()
        .expect("standby thread")
        .expect("the standby takes over once the lease ended");

    // The old owner wakes up and tries to commit: refused, and it knows.
    let err = b
        .commit(&first, vec![signal("late", b"x")])
        .expect_err("a fenced owner must not commit");
    assert!(err.to_string().contains("write lease"), "{err}");
    assert!(matches!(
        first.health(),
        keel_storage::StoreHealth::Failed {
            fault: keel_storage::WriteFault::Fenced,
            ..
        }
    ));
    // The new owner carries on from what the old one committed.
    assert_eq!(second.history(b.run).expect("read").len(), 1);
    b.commit(&second, vec![signal("on-time", b"y")])
        .expect("the new owner commits");
    assert_eq!(second.history(b.run).expect("read").len(), 2);
    drop(first);
    // A clean close hands the lease on at once.
    drop(second);
    let started = std::time::Instant::now();
    let third = PgStore::open(scratch.0.clone().lease_wait_ms(0)).expect("lease was released");
    assert!(started.elapsed() < std::time::Duration::from_secs(2));
    drop(third);
}
