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
// run. Opened sharded (several processes at once), the store fences every
// commit by its shard's lease, per shard, relays notes between processes
// with a notice to the addressee, and binds every process to the first
// one's shard count. TLS follows libpq's `sslmode`: roles the test server
// lets in only encrypted (keel_tls) or only with a client certificate
// (keel_cert) prove the connection really is encrypted, and certificates
// of the wrong authority or for another host name are refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::common::*;
use keel_storage::{
    CommitBatch, DatabaseFault, Error, Fence, Note, PgOptions, PgStore, Relay, RelayTo, Seq,
    ShardLease, ShardLeases, Store, Timestamp, PG_SCHEMA_VERSION as SCHEMA_VERSION,
    SCHEMA_VERSION_READ_AS_IS,
};

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

/// The TLS test server's address and certificate directory, when the test
/// script set TLS up (it does wherever openssl is, which Debian's
/// PostgreSQL package depends on).
fn postgres_tls() -> Option<(String, std::path::PathBuf)> {
    postgres_url()?;
    match (
        std::env::var("KEEL_TEST_POSTGRES_TLS_URL"),
        std::env::var("KEEL_TEST_POSTGRES_TLS_DIR"),
    ) {
        (Ok(url), Ok(dir)) if !url.is_empty() => Some((url, dir.into())),
        _ => {
            assert!(
                std::env::var("KEEL_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "KEEL_REQUIRE_POSTGRES=1 but the test server has no TLS (KEEL_TEST_POSTGRES_TLS_URL unset)"
            );
            None
        }
    }
}

/// Opens a store at `url` in a fresh schema, commits one event and reads
/// it back.
fn round_trip(url: &str) -> Result<(), Error> {
    let scratch = PgScratch::new(url);
    let store = PgStore::open(scratch.0.clone())?;
    let mut b = RunBuilder::new(run_id(3), 1_000);
    b.commit(&store, vec![started(b.run, "tls", "wf")])?;
    assert_eq!(store.history(b.run)?.len(), 1);
    Ok(())
}

fn fault_of(result: Result<(), Error>) -> DatabaseFault {
    match result {
        Err(Error::Database { fault, .. }) => fault,
        other => panic!("expected a database error, got {other:?}"),
    }
}

#[test]
fn tls_follows_sslmode_and_refuses_untrusted_servers() {
    let Some((url, dir)) = postgres_tls() else {
        return;
    };
    let file = |name: &str| dir.join(name).display().to_string();
    let with = |params: &str| format!("{url}&{params}");
    // keel_tls may only connect encrypted: that these work proves TLS.
    round_trip(&url).expect("sslmode defaults to prefer, which encrypts when it can");
    round_trip(&with("sslmode=require")).expect("require");
    round_trip(&with(&format!(
        "sslmode=verify-full&sslrootcert={}",
        file("ca.crt")
    )))
    .expect("verify-full against the right authority");
    assert_eq!(
        fault_of(round_trip(&with("sslmode=disable"))),
        DatabaseFault::Refused,
        "the server refuses keel_tls unencrypted"
    );

    // The certificate of another authority (the client's own certificate
    // as the only trusted root) is refused, and not as a passing outage.
    let err = round_trip(&with(&format!(
        "sslmode=verify-full&sslrootcert={}",
        file("client.crt")
    )))
    .expect_err("untrusted");
    assert!(!err.is_transient(), "{err}");
    assert_eq!(fault_of(Err(err)), DatabaseFault::Tls);
    // `require` with a root file checks the chain too, as libpq does.
    assert_eq!(
        fault_of(round_trip(&with(&format!(
            "sslmode=require&sslrootcert={}",
            file("client.crt")
        )))),
        DatabaseFault::Tls
    );

    // The server's certificate names localhost, not db.invalid: verify-full
    // refuses it, verify-ca (the chain only) accepts it.
    let other_name = url.replace("@localhost:", "@db.invalid:");
    assert_ne!(other_name, url);
    let root = format!("sslrootcert={}", file("ca.crt"));
    assert_eq!(
        fault_of(round_trip(&format!(
            "{other_name}&sslmode=verify-full&{root}"
        ))),
        DatabaseFault::Tls
    );
    round_trip(&format!("{other_name}&sslmode=verify-ca&{root}"))
        .expect("verify-ca does not check the name");

    // keel_cert authenticates by its client certificate only.
    let at = url.find('@').expect("credentials");
    let cert_url = format!("postgres://keel_cert{}", &url[at..]);
    round_trip(&format!(
        "{cert_url}&sslmode=verify-full&{root}&sslcert={}&sslkey={}",
        file("client.crt"),
        file("client.key")
    ))
    .expect("a client certificate");
    assert_eq!(
        fault_of(round_trip(&format!(
            "{cert_url}&sslmode=verify-full&{root}"
        ))),
        DatabaseFault::Refused,
        "no client certificate"
    );
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

/// Checks that an engine's open of `options` is refused as in use while
/// an older engine process is live, naming its `owner`.
fn open_refused_as_in_use(options: &PgOptions, owner: &str) {
    let err = PgStore::open(options.clone()).expect_err("an older process is live");
    assert!(
        matches!(
            err,
            Error::Database {
                fault: DatabaseFault::InUse,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains(owner), "{err}");
}

/// Records an older schema version in a database, and checks that a
/// reader is then refused, naming both versions and saying that an
/// engine's open migrates it.
fn mark_older_database(url: &str, options: &PgOptions, version: u32) {
    admin(
        url,
        &format!(
            "update \"{}\".version set schema_version = {version}",
            options.schema
        ),
    );
    let err = PgStore::open_read_only(options.clone()).expect_err("an older schema");
    assert!(
        matches!(err, Error::DatabaseSchemaVersion { found, expected, .. }
            if found == version && expected == SCHEMA_VERSION),
        "{err}"
    );
    assert!(err.to_string().contains("migrates"), "{err}");
}

#[test]
fn a_schema_4_database_is_read_as_it_is_and_migrated_in_place() {
    // Goal: as for a data directory, a database of schema 4 (derived rows
    // as msgpack maps with field names) is migrated by an engine's open
    // without rewriting a row: a reader is refused until then,
    // and afterwards the old rows read back as before and verify clean.
    // Schemas before 7 also wrote index rows by type alone and of every
    // run, which the migration deletes (verify would report them).
    // Method: a run committed, its run record rewritten as a schema 4
    // build wrote it, its two older index rows added and the version set
    // to 4, then both opens.
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    let store = PgStore::open(scratch.0.clone()).expect("create");
    let mut run = RunBuilder::new(run_id(41), 100);
    run.commit(
        &store,
        vec![started(run.run, "old", "wf"), timer_started(1, 9_000)],
    )
    .unwrap();
    let before = store.run_meta(run.run).unwrap().expect("run record");
    drop(store);
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let old = as_schema_4(keel_storage::codec::RecordKind::Run, &before);
    assert!(body_is_map(&old));
    let s = &scratch.0.schema;
    let updated = admin(
        &url,
        &format!(
            "update \"{s}\".kv_runs set v = '\\x{}'::bytea where k = '\\x{}'::bytea",
            hex(&old),
            hex(run.run.as_bytes())
        ),
    );
    assert_eq!(updated, 1, "the run record was rewritten");
    let mut tail = (u64::MAX - before.started_at.0).to_be_bytes().to_vec();
    tail.extend_from_slice(run.run.as_bytes());
    for old_key in [
        [&b"Twf\0\x01"[..], &tail].concat(),
        [&b"R"[..], &tail].concat(),
    ] {
        let inserted = admin(
            &url,
            &format!(
                "insert into \"{s}\".kv_index (k, v) values ('\\x{}'::bytea, ''::bytea)",
                hex(&old_key)
            ),
        );
        assert_eq!(inserted, 1, "an index row of schema 6");
    }
    mark_older_database(&url, &scratch.0, SCHEMA_VERSION_READ_AS_IS);

    // An engine process of the older version still at work (its
    // membership renewed into the future) holds the migration back, named.
    let far = i64::MAX / 2;
    admin(
        &url,
        &format!("insert into \"{s}\".member values ('old-engine-7', {far})"),
    );
    let refused_naming = |owner: &str| open_refused_as_in_use(&scratch.0, owner);
    refused_naming("old-engine-7");
    let err = PgStore::open_read_only(scratch.0.clone()).expect_err("still schema 4");
    assert!(matches!(err, Error::DatabaseSchemaVersion { .. }), "{err}");
    // Its membership ends; a single writer of the older version still
    // holds the write lease: held back too.
    admin(
        &url,
        &format!("update \"{s}\".member set expires_at_ms = 0 where owner = 'old-engine-7'"),
    );
    admin(
        &url,
        &format!(
            "update \"{s}\".lease set owner = 'old-writer-3', \
             expires_at = clock_timestamp() + interval '1 hour' where shard = 0"
        ),
    );
    refused_naming("old-writer-3");
    // Its lease ends: the migration goes ahead.
    admin(
        &url,
        &format!("update \"{s}\".lease set expires_at = '-infinity' where shard = 0"),
    );

    let store = PgStore::open(scratch.0.clone()).expect("an engine's open migrates");
    assert_eq!(store.run_meta(run.run).unwrap(), Some(before));
    assert!(
        store.verify().unwrap().ok,
        "the stored map equals the rebuilt record, and the older index rows are gone"
    );
    let of_type = keel_storage::search::RunFilter::all().workflow_type("wf");
    let found: Vec<_> = store
        .runs(&of_type)
        .unwrap()
        .into_iter()
        .map(|m| m.run_id)
        .collect();
    assert_eq!(found, vec![run.run]);
    drop(store);
    PgStore::open_read_only(scratch.0.clone()).expect("migrated: a reader opens it");
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

/// Goal: a peer that accepts the connection and never answers, as a
/// stalled server does, or a client socket the kernel connected to itself
/// while the server was down (which held the port a restarted test server
/// needed, and the store's writer for good), is a typed "unreachable"
/// within the connect timeout, not a wait without end.
/// Method: a TCP listener of the test's own accepts and keeps every
/// connection silent; the store opens against it with a 1 s
/// `connect_timeout`, on a thread, and must answer within `ANSWER_WAIT`.
/// No PostgreSQL server is needed.
#[test]
fn a_server_that_never_answers_is_unreachable_within_the_connect_timeout() {
    const ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(30);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for socket in listener.incoming() {
            match socket {
                Ok(s) => held.push(s),
                Err(_) => return,
            }
        }
    });
    for url in [
        format!("postgres://keel:x@127.0.0.1:{port}/keel?connect_timeout=1"),
        format!("postgres://keel:x@127.0.0.1:{port}/keel?connect_timeout=1&sslmode=disable"),
    ] {
        let (tx, rx) = std::sync::mpsc::channel();
        let options = PgOptions::new(&url);
        std::thread::spawn(move || {
            let _ = tx.send(PgStore::open(options).map(|_| ()));
        });
        let answer = rx
            .recv_timeout(ANSWER_WAIT)
            .unwrap_or_else(|_| panic!("opening {url} still waits after {ANSWER_WAIT:?}"));
        let err = answer.expect_err("a silent server cannot be opened");
        assert!(err.to_string().contains("1000 ms"), "{err}");
        assert_eq!(fault_of(Err(err)), DatabaseFault::Unreachable);
    }
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

#[test]
fn processes_sharing_a_database_are_fenced_per_shard() {
    // Goal: on a database several engine processes share (opened sharded),
    // a commit must carry a fence; two processes taking one shard at once
    // get one lease between them; and a process that lost one of its
    // shards keeps committing for the others while its commit for the lost
    // shard, sent in the same breath, is refused and writes nothing.
    // Method: two stores on one fresh schema as two processes; the takes
    // race on threads; the two commits are both sent before either is
    // waited for, so the writer has them together.
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    let p1 = PgStore::open(scratch.0.clone().sharded()).expect("p1");
    let p2 = PgStore::open(scratch.0.clone().sharded()).expect("p2");

    let run = |n: u64, shard: u16, epoch: u64, seq: u64| CommitBatch {
        fence: Some(Fence { shard, epoch }),
        ..CommitBatch::append(
            run_id(n),
            vec![if seq == 1 {
                ev(1, 100, started(run_id(n), &format!("i{n}"), "wf"))
            } else {
                ev(seq, 100 * seq, signal("s", b"x"))
            }],
        )
    };
    let unfenced = CommitBatch::append(run_id(9), vec![ev(1, 1, started(run_id(9), "u", "wf"))]);
    let err = p1.commit(unfenced).wait().expect_err("unfenced");
    assert!(matches!(err, Error::FenceRequired { .. }), "{err}");

    // Two processes take shard 5 at once: one lease, one refusal.
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| p1.take_shard_lease(5, "p1", Timestamp(0), 1_000));
        let b = s.spawn(|| p2.take_shard_lease(5, "p2", Timestamp(0), 1_000));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(
        a.is_ok() != b.is_ok(),
        "exactly one take wins: {a:?} / {b:?}"
    );
    let leases = p1.shard_leases().unwrap();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].epoch, 1);

    // p1 holds shards 1 and 2 and starts a run on each.
    let s1 = p1.take_shard_lease(1, "p1", Timestamp(0), 1_000).unwrap();
    let s2 = p1.take_shard_lease(2, "p1", Timestamp(0), 1_000).unwrap();
    p1.commit(run(1, 1, s1.epoch, 1)).wait().unwrap();
    p1.commit(run(2, 2, s2.epoch, 1)).wait().unwrap();
    // Its lease on shard 2 ends and p2 takes it.
    let taken = p2
        .take_shard_lease(2, "p2", Timestamp(1_000), 1_000)
        .unwrap();
    assert_eq!(taken.epoch, s2.epoch + 1);
    let renewed = p1.renew_shard_lease(&s1, Timestamp(1_000), 1_000).unwrap();
    // The new owner goes on where p1 stopped.
    p2.commit(run(2, 2, taken.epoch, 2)).wait().unwrap();
    // p1, unaware, sends commits for both shards, alternating, before it
    // waits for any: the writer has several queued and must not let a
    // refused fence fail another shard's commits. Its commits for shard 2
    // also clash with p2's row at seq 2: still refused as fenced, so p1
    // learns that it lost the shard.
    let handles: Vec<_> = (2..12)
        .flat_map(|seq| {
            [
                (1, p1.commit(run(1, 1, renewed.epoch, seq))),
                (2, p1.commit(run(2, 2, s2.epoch, 2))),
            ]
        })
        .collect();
    for (shard, handle) in handles {
        match (shard, handle.wait()) {
            (1, result) => {
                result.expect("shard 1 is still p1's");
            }
            (_, result) => {
                let err = result.expect_err("shard 2 is p2's");
                assert!(
                    matches!(err, Error::Fenced { shard: 2, epoch, current: Some(c) } if epoch == s2.epoch && c == taken.epoch),
                    "{err}"
                );
            }
        }
    }
    assert_eq!(
        p2.history(run_id(1)).unwrap().len(),
        11,
        "shard 1's commits were written"
    );
    assert_eq!(
        p2.history(run_id(2)).unwrap().len(),
        2,
        "the fenced commits wrote nothing"
    );
    assert!(p2.verify().unwrap().ok);

    // A process that would write alone is refused beside processes that
    // share the database, and the reverse.
    let alone = PgStore::open(scratch.0.clone().lease_wait_ms(0)).expect_err("alone");
    assert!(
        matches!(&alone, Error::DatabaseLocked { detail, .. } if detail.contains("sharded")),
        "{alone}"
    );
    let other = PgScratch::new(&url);
    let writer = PgStore::open(other.0.clone()).expect("a writer alone");
    let shared = PgStore::open(other.0.clone().sharded()).expect_err("sharded beside it");
    assert!(matches!(shared, Error::DatabaseLocked { .. }), "{shared}");
    drop(writer);
}

#[test]
fn a_takeover_fences_every_later_commit_of_the_old_owner() {
    // Goal: the cluster invariant at the store, under real concurrency:
    // once a process's take of a shard at epoch e returned, no commit sent
    // afterwards under an older epoch of that shard is written; every
    // commit answered Ok is in the history and every refused one is not.
    // Method: two sharded stores on one schema as two processes, each on
    // its own thread, share three shards on a common clock advanced by
    // both; each takes free shards, commits once per round to a run of its
    // own per (shard, epoch), so that only the fence (not a sequence
    // clash) can refuse a stale owner, and renews only in some rounds, so
    // leases lapse and are taken over while the old owner still commits.
    // A global counter orders every take's return before or after every
    // commit's sending.
    use std::collections::HashMap;
    use std::sync::atomic::AtomicU64;
    use std::sync::Mutex;

    const SHARDS: u16 = 3;
    const ROUNDS: u64 = 40;
    const TTL_MS: u64 = 1_000;
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    let stores: Vec<PgStore> = (0..2)
        .map(|_| PgStore::open(scratch.0.clone().sharded()).expect("open"))
        .collect();
    let clock = AtomicU64::new(0);
    let order = AtomicU64::new(0);
    // (shard, epoch, when the take returned)
    let takes = Mutex::new(Vec::<(u16, u64, u64)>::new());
    // (shard, epoch, when it was sent, run, seq, written)
    let commits = Mutex::new(Vec::<(u16, u64, u64, u64, u64, bool)>::new());
    std::thread::scope(|s| {
        for (p, store) in stores.iter().enumerate() {
            let (clock, order, takes, commits) = (&clock, &order, &takes, &commits);
            s.spawn(move || {
                let me = format!("p{p}");
                // shard -> (lease, run number, next seq)
                let mut held: HashMap<u16, (ShardLease, u64, u64)> = HashMap::new();
                for round in 0..ROUNDS {
                    let now = Timestamp(clock.fetch_add(100, Ordering::SeqCst));
                    for shard in 0..SHARDS {
                        if held.contains_key(&shard) {
                            continue;
                        }
                        if let Ok(lease) = store.take_shard_lease(shard, &me, now, TTL_MS) {
                            let at = order.fetch_add(1, Ordering::SeqCst);
                            takes.lock().unwrap().push((shard, lease.epoch, at));
                            let run = u64::from(shard) * 1_000 + lease.epoch;
                            held.insert(shard, (lease, run, 1));
                        }
                    }
                    let mut lost = Vec::new();
                    for (shard, (lease, run, next)) in held.iter_mut() {
                        let kind = if *next == 1 {
                            started(run_id(*run), &format!("i{run}"), "wf")
                        } else {
                            signal("s", b"x")
                        };
                        let batch = CommitBatch {
                            fence: Some(lease.fence()),
                            ..CommitBatch::append(run_id(*run), vec![ev(*next, *next, kind)])
                        };
                        let sent = order.fetch_add(1, Ordering::SeqCst);
                        let result = store.commit(batch).wait();
                        let ok = match &result {
                            Ok(_) => true,
                            Err(Error::Fenced { .. }) => false,
                            Err(e) => panic!("p{p}: unexpected commit error: {e}"),
                        };
                        commits
                            .lock()
                            .unwrap()
                            .push((*shard, lease.epoch, sent, *run, *next, ok));
                        if ok {
                            *next += 1;
                        } else {
                            lost.push(*shard);
                        }
                    }
                    // Renew in some rounds only: the leases lapse now and then.
                    if (round + p as u64) % 9 < 4 {
                        for (shard, (lease, _, _)) in held.iter_mut() {
                            match store.renew_shard_lease(lease, now, TTL_MS) {
                                Ok(l) => *lease = l,
                                Err(Error::Fenced { .. }) => lost.push(*shard),
                                Err(e) => panic!("p{p}: unexpected renewal error: {e}"),
                            }
                        }
                    }
                    for shard in lost {
                        held.remove(&shard);
                    }
                }
            });
        }
    });
    let takes = takes.into_inner().unwrap();
    let commits = commits.into_inner().unwrap();
    for &(shard, epoch, sent, run, seq, ok) in &commits {
        let superseded = takes
            .iter()
            .any(|&(s, e, at)| s == shard && e > epoch && at < sent);
        assert!(
            !(ok && superseded),
            "shard {shard}: a commit of epoch {epoch} (run {run}, seq {seq}) was written after a newer epoch was taken"
        );
    }
    let takeovers = takes.iter().filter(|(_, epoch, _)| *epoch > 1).count();
    let refused = commits.iter().filter(|c| !c.5).count();
    assert!(
        takeovers >= 3,
        "the test must take shards over: {takeovers}"
    );
    assert!(refused >= 1, "the test must fence a stale owner: {refused}");
    let mut written: HashMap<u64, u64> = HashMap::new();
    for c in commits.iter().filter(|c| c.5) {
        *written.entry(c.3).or_default() += 1;
    }
    for (run, count) in written {
        let history = stores[0].history(run_id(run)).unwrap();
        assert_eq!(
            history.len() as u64,
            count,
            "run {run}: the history holds exactly the commits answered Ok"
        );
    }
    assert!(stores[0].verify().unwrap().ok);
}

#[test]
fn processes_relay_notes_with_notices_and_agree_on_the_shard_count() {
    // Goal: on a shared database, a note left by one process is taken once,
    // by the process it is for, which hears of it through a notice
    // (LISTEN/NOTIFY) without polling; and the first process's shard count
    // binds the others. Method: two stores on one fresh schema as two
    // processes; p2 listens, p1 leaves notes for p2 and for a shard; p2
    // waits on its notices (bounded), then takes what they name. Then p1
    // records 8 shards, p2 agrees with 8 and is refused with 6.
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    let p1 = PgStore::open(scratch.0.clone().sharded()).expect("p1");
    let p2 = PgStore::open(scratch.0.clone().sharded()).expect("p2");
    let notices = p2.relay_listen().expect("PostgreSQL gives notices");
    // The listening connection is set up on the store's runtime: notes
    // left before it listens are not announced, so wait for one to be.
    let me = RelayTo::Process("p2".into());
    let note = |to: &RelayTo, b: u8| Note {
        to: to.clone(),
        body: vec![b],
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let heard = loop {
        p1.relay_send(&[note(&me, 0)], Timestamp(1)).expect("send");
        match notices.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(key) => break key,
            Err(_) => assert!(std::time::Instant::now() < deadline, "no notice came"),
        }
    };
    assert_eq!(heard, me.key());
    while notices.try_recv().is_ok() {}
    p2.relay_take(std::slice::from_ref(&me), 100)
        .expect("drain");

    p1.relay_send(&[note(&me, 1), note(&RelayTo::Shard(3), 2)], Timestamp(2))
        .expect("send");
    // (A late notice of the first loop may come first: wait for both.)
    let mut keys = std::collections::BTreeSet::new();
    while keys.len() < 2 {
        let key = notices
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("a notice per address");
        assert!(key == me.key() || key == RelayTo::Shard(3).key(), "{key}");
        keys.insert(key);
    }
    let mine = p2.relay_take(std::slice::from_ref(&me), 100).expect("take");
    assert_eq!(mine, [note(&me, 1)]);
    assert!(p1
        .relay_take(std::slice::from_ref(&me), 100)
        .expect("again")
        .is_empty());
    assert_eq!(
        p1.relay_take(&[RelayTo::Shard(3)], 100).expect("shard"),
        [note(&RelayTo::Shard(3), 2)]
    );

    p1.agree_shard_count(8)
        .expect("the first count is recorded");
    p2.agree_shard_count(8).expect("the same count agrees");
    let err = p2.agree_shard_count(6).expect_err("another count");
    assert!(
        matches!(
            err,
            Error::ShardCountDiffers {
                recorded: 8,
                configured: 6
            }
        ),
        "{err}"
    );
}

#[test]
fn a_commit_validated_over_a_refused_one_is_validated_again() {
    // Goal: the writer validates the next group while the one before is in
    // flight, over that one's writes; when the server refuses the one in
    // flight, the next must not be written as validated (here that would
    // leave a gap in the run's history) but validated again, and refused.
    // Method: runs born in this store, so the writer answers their durable
    // ids from memory; a row for one of them slipped into `kv_dedupe`
    // behind its back makes the server refuse the commit that writes it.
    // The commit after it, sent right behind it (at once, or after a short
    // pause so that it arrives while the first is in flight), continues
    // the same run from the refused commit's last seq: it must be refused
    // too, and the history must hold neither.
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    let store = PgStore::open(scratch.0.clone()).expect("open");
    for (i, pause_us) in [0u64, 100, 300, 600, 1_000, 2_000].into_iter().enumerate() {
        let mut b = RunBuilder::new(run_id(100 + i as u64), 1_000);
        b.commit(
            &store,
            vec![
                started(b.run, &format!("pipelined-{i}"), "wf"),
                scheduled(b.run, 2),
            ],
        )
        .expect("start");
        let key = keel_storage::keys::dedupe_key(
            b.run,
            &keel_storage::DurableKey::Execution(keel_storage::Step(2)),
        );
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        admin(
            &url,
            &format!(
                "insert into \"{}\".kv_dedupe values ('\\x{hex}'::bytea, '\\x00'::bytea)",
                scratch.0.schema
            ),
        );
        let first = vec![b.next(completed(b.run, 2, 1))];
        let second = vec![b.next(signal("after", b"1"))];
        let h1 = store.commit(CommitBatch::append(b.run, first));
        std::thread::sleep(std::time::Duration::from_micros(pause_us));
        let h2 = store.commit(CommitBatch::append(b.run, second));
        let e1 = h1
            .wait()
            .expect_err("the server refuses the planted durable id");
        let e2 = h2.wait().expect_err("validated over a refused commit");
        assert_eq!(
            store.history(b.run).expect("read").len(),
            2,
            "pause {pause_us} us: {e1} / {e2}"
        );
        // The store still takes the run's next commit at the right seq.
        let mut again = RunBuilder::new(b.run, b.at);
        again.next = 3;
        again
            .commit(&store, vec![signal("later", b"2")])
            .expect("the run goes on after the refusals");
    }
}

#[test]
fn rewritten_tables_leave_room_on_their_pages_in_older_databases_too() {
    // Goal: the tables whose rows keel rewrites (a run's record on every
    // commit) leave room on their pages, so the server can update a row
    // beside itself, in a database created before keel asked for that too.
    // Method: a store's schema has the room; the test takes it away (as a
    // database of an earlier keel had it), and opening the store again
    // brings it back.
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    drop(PgStore::open(scratch.0.clone()).expect("create"));
    let runs = format!("\"{}\".kv_runs", scratch.0.schema);
    let roomy = || {
        admin(
            &url,
            &format!(
                "select 1 from pg_class where oid = '{runs}'::regclass \
                 and reloptions @> array['fillfactor=70']"
            ),
        )
    };
    assert_eq!(roomy(), 1, "a new schema has the room");
    admin(&url, &format!("alter table {runs} reset (fillfactor)"));
    assert_eq!(roomy(), 0);
    drop(PgStore::open(scratch.0.clone()).expect("reopen"));
    assert_eq!(roomy(), 1, "opening an older schema gives it the room");
}

/// Copies each execution's dedupe row of `run` under the key of the
/// attempt that closed it (`closing`, from `closed_three_ways`), as a
/// schema 5 build wrote them.
fn plant_schema_5_attempt_rows(
    url: &str,
    schema: &str,
    run: keel_storage::RunId,
    closing: &[(u32, u32, Seq)],
) {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    for (step, attempt, _) in closing {
        let step = keel_storage::Step(*step);
        let execution =
            keel_storage::keys::dedupe_key(run, &keel_storage::DurableKey::Execution(step));
        let key = keel_storage::DurableKey::Attempt(step, keel_storage::AttemptNo(*attempt));
        let planted = admin(
            url,
            &format!(
                "insert into \"{schema}\".kv_dedupe select '\\x{}'::bytea, v \
                 from \"{schema}\".kv_dedupe where k = '\\x{}'::bytea",
                hex(&keel_storage::keys::dedupe_key(run, &key)),
                hex(&execution)
            ),
        );
        assert_eq!(planted, 1, "{key}");
    }
}

#[test]
fn a_schema_5_database_loses_only_the_attempt_rows_its_executions_stand_for() {
    // Goal: as for a data directory, an engine's open of a schema 5
    // database deletes the attempt rows written beside their execution's
    // (schema 6 writes the execution's alone), in the transaction that
    // records the new version, and keeps every other row, a retried
    // attempt's included; each attempt still reads as committed at its
    // result, and the database verifies clean. Both ways an open migrates:
    // a database with every object of this version, and one missing some
    // (created in the same transaction), which is also held back while an
    // engine process of the older version is live. Method: a run closing
    // its three executions in each way (`closed_three_ways`); each
    // execution's row copied under its closing attempt's key in SQL, as a
    // schema 5 build wrote it, and the version set to 5; for the second
    // way the runs table also loses its page room, which this version adds.
    let Some(url) = postgres_url() else { return };
    for (i, incomplete) in [false, true].into_iter().enumerate() {
        let scratch = PgScratch::new(&url);
        let store = PgStore::open(scratch.0.clone()).expect("create");
        let (run, closing) = closed_three_ways(&store, 43 + i as u64);
        let written = dedupe_rows(&store);
        drop(store);
        plant_schema_5_attempt_rows(&url, &scratch.0.schema, run, &closing);
        let s = &scratch.0.schema;
        mark_older_database(&url, &scratch.0, 5);
        if incomplete {
            admin(
                &url,
                &format!("alter table \"{s}\".kv_runs reset (fillfactor)"),
            );
            let far = i64::MAX / 2;
            admin(
                &url,
                &format!("insert into \"{s}\".member values ('old-engine-5', {far})"),
            );
            open_refused_as_in_use(&scratch.0, "old-engine-5");
            let err = PgStore::open_read_only(scratch.0.clone()).expect_err("still schema 5");
            assert!(
                matches!(err, Error::DatabaseSchemaVersion { found: 5, .. }),
                "{err}"
            );
            admin(
                &url,
                &format!(
                    "update \"{s}\".member set expires_at_ms = 0 where owner = 'old-engine-5'"
                ),
            );
        }

        let store = PgStore::open(scratch.0.clone()).expect("migrated by an engine's open");
        assert_eq!(dedupe_rows(&store), written, "only the planted rows went");
        assert_migrated_attempts(&store, run, &closing);
        drop(store);
        PgStore::open_read_only(scratch.0.clone()).expect("inspection opens it again");
    }
}

#[test]
fn an_engine_role_without_ownership_migrates_a_schema_5_database_with_delete_granted() {
    // Goal: an engine's role needs no CREATE or ownership once the tables
    // exist, to migrate an older database read as it is too: the
    // migration deletes rows of `kv_dedupe`, so it needs DELETE there.
    // Without it the open fails with the server's refusal and the
    // database is left as it was (schema 5, every row); with it the open
    // migrates. Method: a schema 5 database made by the owner (planted
    // attempt rows, version 5); a login role granted only what an engine
    // uses (the schema, rows of every table, its sequences and functions)
    // but DELETE on `kv_dedupe`; opened as that role, then again after
    // the grant.
    let Some(url) = postgres_url() else { return };
    let scratch = PgScratch::new(&url);
    let store = PgStore::open(scratch.0.clone()).expect("create");
    let (run, closing) = closed_three_ways(&store, 61);
    drop(store);
    let s = scratch.0.schema.clone();
    plant_schema_5_attempt_rows(&url, &s, run, &closing);
    mark_older_database(&url, &scratch.0, 5);

    let role = format!("keel_rows_{}", std::process::id());
    admin(&url, &format!("create role {role} login password 'rows'"));
    for grant in [
        format!("grant usage on schema \"{s}\" to {role}"),
        format!("grant select, insert, update, delete on all tables in schema \"{s}\" to {role}"),
        format!("grant usage, select on all sequences in schema \"{s}\" to {role}"),
        format!("grant execute on all functions in schema \"{s}\" to {role}"),
        format!("revoke delete on \"{s}\".kv_dedupe from {role}"),
    ] {
        admin(&url, &grant);
    }
    let at = url.find('@').expect("url has credentials");
    let role_url = format!("postgres://{role}:rows{}", &url[at..]);
    let as_role = PgOptions::new(&role_url).schema(s.clone());
    let err = PgStore::open(as_role.clone()).expect_err("no DELETE on kv_dedupe");
    assert!(
        matches!(err, Error::Database { .. }) && err.to_string().contains("permission denied"),
        "{err}"
    );
    let err = PgStore::open_read_only(scratch.0.clone()).expect_err("still schema 5");
    assert!(
        matches!(err, Error::DatabaseSchemaVersion { found: 5, .. }),
        "{err}"
    );
    admin(
        &url,
        &format!("grant delete on \"{s}\".kv_dedupe to {role}"),
    );
    let store = PgStore::open(as_role).expect("migrated by the engine's role");
    assert_migrated_attempts(&store, run, &closing);
    drop(store);
    drop(scratch);
    admin(&url, &format!("drop owned by {role}"));
    admin(&url, &format!("drop role {role}"));
}
