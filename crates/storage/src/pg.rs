//! The PostgreSQL store: the same [`Store`] as RocksDB, over tables.
//!
//! Layout (all in one PostgreSQL schema, `keel` unless told otherwise):
//! `events (run bytea, seq int8, v bytea, primary key (run, seq))` holds the
//! histories, one row per event; every other column family is a table
//! `kv_<family> (k bytea primary key, v bytea)` holding the same bytes the
//! RocksDB store keeps, so the validation, derived state, reads and
//! `verify` of [`crate::derive`] and [`crate::store`] run unchanged over it;
//! `version` records the schema version.
//!
//! Commits go through one writer thread, as with RocksDB: it takes every
//! commit waiting, validates each against the rows and the group's earlier
//! writes, and writes the whole group in one transaction (one WAL flush)
//! whose statements are pipelined on one connection.
//!
//! One engine process writes at a time, under the database's write lease:
//! the row `lease` names the owner, a fencing epoch and when the lease
//! ends (by the database's clock, so the processes' clocks do not matter).
//! The owner renews it every fifth of its length; another process takes it
//! only once it ended, and taking it raises the epoch. Every commit's
//! transaction first calls `fence(epoch, owner)`, which locks the lease row
//! (a takeover waits for a commit in flight, and a commit for a takeover in
//! flight) and aborts the transaction unless the epoch is still this
//! process's: a process that paused or lost the database past its lease
//! can never commit again, and reports [`WriteFault::Fenced`] so its engine
//! stops. A process opening a held database waits for the lease (a
//! predecessor that crashed stops renewing, so its lease ends within its
//! length), as a standby forever if told so.
//!
//! Opened [`PgOptions::sharded`], no process holds the whole database:
//! several write at once, each for the shards whose leases it holds
//! ([`ShardLeases`]: rows of `shard_lease`, with the processes alive in
//! `member`). The first such process gives the database-wide lease to
//! `<sharded>` for good, so a process that would write alone is refused
//! rather than writing beside them (and one that did before is fenced).
//! Every commit carries its shard's [`Fence`]: the writer reads the
//! shard's epoch before validating the group (a process that lost the
//! shard hears [`Error::Fenced`], not a clash with the new owner's rows),
//! and the transaction first calls `shard_fence(shard, epoch)`, which
//! holds the lease row shared and aborts unless the epoch is still the
//! shard's, so the commit of a process that lost the shard writes nothing
//! whatever the timing. A group holds commits of one fence only, and the
//! writer's cache of its own writes is not trusted across groups (other
//! processes write too). A process's shards share one commit queue, so
//! their commits come interleaved: the writer holds back those of other
//! fences ([`Held`]) while it fills a group, rather than closing the group
//! at the first one, and each later group takes its fence's held commits
//! first, so a run's commits keep their order.
//!
//! When the connection breaks while a group's transaction is in flight,
//! the writer reconnects and reads one of the group's rows back to learn
//! whether it committed, and answers accordingly: the engine never acts on
//! a commit whose outcome it does not know.
//!
//! Connections use TLS as the connection string's `sslmode` says, with
//! libpq's meaning ([`crate::pg_tls`]).
//!
//! The driver is `tokio-postgres` on a small runtime of the store's own;
//! callers block on its futures, so the store works from any thread, inside
//! an async runtime or not.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};
use tracing::{debug, info_span, warn};

use crate::cache::{CachedView, Learned, ReadAhead, ScanAhead, WriterCache};
use crate::derive::{apply_batch_checked, Checks, CommitAck, CommitBatch, PreparedBatch};
use crate::error::{DatabaseFault, Error, Result};
use crate::health::{HealthCell, StoreHealth, WriteFault};
use crate::ids::Timestamp;
use crate::keys::{prefix_end, Cf};
use crate::kv::{KvRead, Overlay, Writes};
use crate::lease::{self, Fence, Member, ShardLease, ShardLeases};
use crate::pg_tls::{self, Tls};
use crate::relay::{self, Note, Relay, RelayNotices, RelayTo};
use crate::store::{CommitHandle, Durability, Reply, Store};
use crate::{
    COMMIT_QUEUE_MAX, GROUP_COMMITS_MAX, GROUP_COMMIT_BYTES_MAX,
    PG_SCHEMA_VERSION as SCHEMA_VERSION,
};

/// Most connections one store opens for reads (the writer has its own).
pub const PG_READ_CONNECTIONS_MAX: usize = 8;

/// Rows one scan fetches per round trip.
pub const PG_SCAN_PAGE_ROWS: i64 = 512;

/// How long a connection attempt may take before it counts as unreachable,
/// unless the connection string sets `connect_timeout`: the whole of it,
/// socket, TLS, authentication and session setup, per host as libpq counts
/// it. (The
/// driver's own timeout covers the socket only, so a peer that accepts and
/// never answers, such as a client socket the kernel connected to itself
/// while the server was down, would otherwise hold a connect for good.)
pub const PG_CONNECT_TIMEOUT_MS: u64 = 5_000;

/// How long data sent to the server may go unacknowledged before the
/// connection counts as lost (TCP_USER_TIMEOUT), unless the connection
/// string sets `tcp_user_timeout`. Without it, a commit sent into a failed
/// link waits for the kernel's retransmissions, about 15 minutes, while the
/// store still looks healthy. Linux only (TCP_USER_TIMEOUT); elsewhere the
/// keepalive probes alone find a dead link, once nothing is in flight.
pub const PG_TCP_USER_TIMEOUT_MS: u64 = 20_000;

/// Idle time before a connection's first keepalive probe, unless the
/// connection string sets `keepalives_idle` (the driver's default is two
/// hours): a connection waiting for an answer over a failed link sends
/// nothing, so only the probes find it dead, within this plus
/// [`PG_TCP_USER_TIMEOUT_MS`].
pub const PG_KEEPALIVE_IDLE_MS: u64 = 10_000;

/// Time between keepalive probes, unless the connection string sets
/// `keepalives_interval`.
pub const PG_KEEPALIVE_INTERVAL_MS: u64 = 5_000;

/// How long a reader waits for a free connection before giving up.
pub const PG_POOL_WAIT_MS: u64 = 30_000;

/// How long the writer keeps trying to reconnect, after the connection
/// broke, before it answers the commits waiting with an error.
pub const PG_RECONNECT_MS_MAX: u64 = 10_000;

/// Pause between reconnection attempts.
pub const PG_RECONNECT_PAUSE_MS: u64 = 200;

/// How long the write lease lasts unless renewed, by default.
pub const PG_LEASE_MS_DEFAULT: u64 = 5_000;

/// Shortest write lease keel accepts.
pub const PG_LEASE_MS_MIN: u64 = 500;

/// How often a process waiting for the write lease asks for it.
pub const PG_LEASE_POLL_MS: u64 = 250;

/// How full PostgreSQL packs the pages of the tables whose rows keel
/// rewrites (runs, instances, tasks): the rest is room for the next
/// version of a row beside the old one.
const PG_UPDATED_FILLFACTOR_PERCENT: u32 = 70;
/// Engine processes a refused migration names at most.
const PG_LIVE_OWNERS_NAMED_MAX: usize = 8;

/// The SQLSTATE `fence` raises when the lease is no longer this process's.
const FENCED_SQLSTATE: &str = "KL001";

/// What every connection of keel's sets first. keel's reads and writes go
/// by primary key (single keys, key lists, key ranges) save a few rare
/// statements no index serves (forgetting old relay notes, purging members,
/// the version row), which still scan. The planner's statistics
/// of the tables that churn (the relay, the search index, attempts, the
/// outbox) lag far behind them between autovacuum's rounds: with a stale
/// row count or many dead rows it chose sequential scans for
/// `k = any($1)`, 1,038 of them against 346 index scans on `kv_dedupe` in
/// one two-process benchmark, each slower as the table grew. Off, the
/// planner keeps a sequential scan only where no index serves.
const PG_SESSION_SETUP: &str = "set enable_seqscan = off";

/// The SQLSTATE `shard_fence()` raises when a commit's shard lease moved on.
const SHARD_FENCED_SQLSTATE: &str = "KL002";

/// The owner of the database-wide write lease once engine processes share
/// the database ([`PgOptions::sharded`]): it never expires, so no process
/// writes alone beside them.
const SHARDED_OWNER: &str = "<sharded>";

/// Longest PostgreSQL schema name keel accepts.
pub const PG_SCHEMA_NAME_BYTES_MAX: usize = 48;

/// How long a relay listener whose connection failed waits before it
/// connects again (its process polls meanwhile).
pub const PG_LISTEN_RETRY_MS: u64 = 1_000;

/// The `NOTIFY` channel of a schema's relay (a schema name is at most
/// [`PG_SCHEMA_NAME_BYTES_MAX`] lowercase letters, digits and `_`, so this
/// is a valid identifier under PostgreSQL's 63 bytes).
fn relay_channel(schema: &str) -> String {
    format!("keel_relay_{schema}")
}

/// How a [`PgStore`] is opened.
#[derive(Clone, Debug)]
pub struct PgOptions {
    /// A libpq-style connection string: `postgres://user:pass@host:port/db`
    /// or `host=... user=... dbname=...`.
    pub url: String,
    /// The PostgreSQL schema keel's tables live in.
    pub schema: String,
    /// How commits are acknowledged: `Sync` waits for PostgreSQL's WAL
    /// flush (`synchronous_commit = on`), `Buffered` does not
    /// (`synchronous_commit = off`: survives a crash of the engine process,
    /// not of the database server).
    pub durability: Durability,
    /// Most connections for reads.
    pub read_connections: usize,
    /// How long the write lease lasts unless renewed: a process that stops
    /// renewing (killed, paused, cut off) is replaced after at most this
    /// long.
    pub lease_ms: u64,
    /// How long opening waits for another process's lease to end before it
    /// gives up with [`Error::DatabaseLocked`]; `None` waits as long as it
    /// takes (a standby).
    pub lease_wait_ms: Option<u64>,
    /// Several engine processes write at once, each for the shards whose
    /// leases it holds (see [`PgOptions::sharded`]); the database-wide write
    /// lease is held by none of them.
    pub sharded: bool,
}

impl PgOptions {
    /// Options for `url` with the defaults: schema `keel`, `Sync`.
    pub fn new(url: impl Into<String>) -> Self {
        PgOptions {
            url: url.into(),
            schema: "keel".into(),
            durability: Durability::Sync,
            read_connections: PG_READ_CONNECTIONS_MAX,
            lease_ms: PG_LEASE_MS_DEFAULT,
            lease_wait_ms: Some(2 * PG_LEASE_MS_DEFAULT),
            sharded: false,
        }
    }

    /// The same options for a database several engine processes write at
    /// once: no process holds the whole database; each takes shard leases
    /// ([`ShardLeases`]) and every commit must carry its shard's fence,
    /// checked in the commit's own transaction. Commits of different
    /// fences go in different transactions, so one refused fence fails
    /// only its own commits.
    pub fn sharded(mut self) -> Self {
        self.sharded = true;
        self
    }

    /// The same options with another lease length (at least
    /// [`PG_LEASE_MS_MIN`]); the wait for another's lease follows it.
    pub fn lease_ms(mut self, ms: u64) -> Self {
        self.lease_ms = ms.max(PG_LEASE_MS_MIN);
        if self.lease_wait_ms.is_some() {
            self.lease_wait_ms = Some(2 * self.lease_ms);
        }
        self
    }

    /// The same options waiting at most `ms` for another process's lease
    /// (0: refuse at once when the database is held).
    pub fn lease_wait_ms(mut self, ms: u64) -> Self {
        self.lease_wait_ms = Some(ms);
        self
    }

    /// The same options as a standby: opening waits until the process
    /// holding the database stops, then takes over its work.
    pub fn standby(mut self) -> Self {
        self.lease_wait_ms = None;
        self
    }

    /// The same options with another schema.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The same options with another durability.
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }
}

/// True when `text` names a PostgreSQL store rather than a directory.
pub fn is_postgres_url(text: &str) -> bool {
    text.starts_with("postgres://") || text.starts_with("postgresql://")
}

/// The SQL text of every statement, with the schema filled in.
#[derive(Debug)]
struct Sql {
    get: [String; Cf::ALL.len()],
    get_many: [String; Cf::ALL.len()],
    scan_bounded: [String; Cf::ALL.len()],
    scan_open: [String; Cf::ALL.len()],
    put: [String; Cf::ALL.len()],
    delete: [String; Cf::ALL.len()],
    event_get: String,
    event_scan: String,
    event_scan_run: String,
    event_put: String,
    fence: String,
    shard_fence: String,
    shard_epoch: String,
    lease_placeholder: String,
    lease_for_update: String,
    lease_put: String,
    lease_all: String,
    member_put: String,
    member_purge: String,
    shard_count_put: String,
    shard_count_get: String,
    member_all: String,
    relay_put: String,
    relay_take: String,
    relay_forget: String,
}

fn table(schema: &str, cf: Cf) -> String {
    match cf {
        Cf::Events => format!("\"{schema}\".events"),
        other => format!("\"{schema}\".kv_{}", other.name()),
    }
}

impl Sql {
    fn new(schema: &str) -> Self {
        let each = |f: &dyn Fn(&str) -> String| -> [String; Cf::ALL.len()] {
            std::array::from_fn(|i| f(&table(schema, Cf::ALL[i])))
        };
        let events = table(schema, Cf::Events);
        Sql {
            get: each(&|t| format!("select v from {t} where k = $1")),
            get_many: each(&|t| format!("select k, v from {t} where k = any($1::bytea[])")),
            scan_bounded: each(&|t| {
                format!("select k, v from {t} where k >= $1 and k < $2 order by k limit $3")
            }),
            scan_open: each(&|t| format!("select k, v from {t} where k >= $1 order by k limit $2")),
            put: std::array::from_fn(|i| {
                let t = table(schema, Cf::ALL[i]);
                if Cf::ALL[i] == Cf::Dedupe {
                    // A durable id's row is written once: validation (under
                    // `Checks::ALL`) found it absent, so a plain insert
                    // suffices, and a row that is there after all (another
                    // writer's) fails the group instead of being
                    // overwritten.
                    format!("insert into {t} (k, v) select * from unnest($1::bytea[], $2::bytea[])")
                } else {
                    format!(
                        "insert into {t} (k, v) select * from unnest($1::bytea[], $2::bytea[]) \
                         on conflict (k) do update set v = excluded.v"
                    )
                }
            }),
            delete: each(&|t| format!("delete from {t} where k = any($1::bytea[])")),
            event_get: format!("select v from {events} where run = $1 and seq = $2"),
            event_scan: format!(
                "select run, seq, v from {events} where (run, seq) >= ($1, $2) \
                 order by run, seq limit $3"
            ),
            event_scan_run: format!(
                "select run, seq, v from {events} where run = $1 and seq >= $2 \
                 order by seq limit $3"
            ),
            fence: format!("select \"{schema}\".fence($1, $2)"),
            shard_fence: format!("select \"{schema}\".shard_fence($1, $2)"),
            shard_epoch: format!("select epoch from \"{schema}\".shard_lease where shard = $1"),
            lease_placeholder: format!(
                "insert into \"{schema}\".shard_lease values ($1, '', 0, 0) on conflict do nothing"
            ),
            lease_for_update: format!(
                "select shard, owner, epoch, expires_at_ms from \"{schema}\".shard_lease \
                 where shard = $1 for update"
            ),
            lease_put: format!(
                "update \"{schema}\".shard_lease set owner = $2, epoch = $3, expires_at_ms = $4 \
                 where shard = $1"
            ),
            lease_all: format!(
                "select shard, owner, epoch, expires_at_ms from \"{schema}\".shard_lease \
                 where owner <> '' order by shard"
            ),
            member_put: format!(
                "insert into \"{schema}\".member values ($1, $2) \
                 on conflict (owner) do update set expires_at_ms = excluded.expires_at_ms"
            ),
            member_purge: format!("delete from \"{schema}\".member where expires_at_ms < $1"),
            shard_count_put: format!(
                "insert into {} (k, v) values ($1, $2) on conflict do nothing",
                table(schema, Cf::Meta)
            ),
            shard_count_get: format!("select v from {} where k = $1", table(schema, Cf::Meta)),
            member_all: format!(
                "select owner, expires_at_ms from \"{schema}\".member order by owner collate \"C\""
            ),
            // The notes, and one notice per address once they commit.
            relay_put: format!(
                "with put as (insert into \"{schema}\".relay (dest, at_ms, body) \
                 select * from unnest($1::text[], $2::int8[], $3::bytea[]) returning dest) \
                 select pg_notify('{channel}', d.dest) from (select distinct dest from put) d",
                channel = relay_channel(schema)
            ),
            relay_take: format!(
                "delete from \"{schema}\".relay where id in (select id from \"{schema}\".relay \
                 where dest = any($1::text[]) order by id limit $2 for update skip locked) \
                 returning id, dest, body"
            ),
            relay_forget: format!("delete from \"{schema}\".relay where at_ms < $1"),
            event_put: format!(
                "insert into {events} (run, seq, v) \
                 select * from unnest($1::bytea[], $2::int8[], $3::bytea[])"
            ),
        }
    }

    /// Statements creating the schema, in order (idempotent).
    fn create(schema: &str) -> Vec<String> {
        let mut out = vec![
            format!("create schema if not exists \"{schema}\""),
            format!(
                "create table if not exists \"{schema}\".version (\
                 schema_version int4 not null, created_by text not null, \
                 created_at timestamptz not null default now())"
            ),
            format!(
                "create table if not exists {} (run bytea not null, seq int8 not null, \
                 v bytea not null, primary key (run, seq))",
                table(schema, Cf::Events)
            ),
        ];
        for cf in Cf::ALL {
            if cf != Cf::Events {
                // Rows rewritten in place (a run's record on every commit)
                // leave room on their page, so the new version is a
                // heap-only tuple and the key's index is not touched.
                let room = match cf {
                    Cf::Runs | Cf::Instances | Cf::Tasks => {
                        format!(" with (fillfactor = {PG_UPDATED_FILLFACTOR_PERCENT})")
                    }
                    _ => String::new(),
                };
                out.push(format!(
                    "create table if not exists {} (k bytea primary key, v bytea not null){room}",
                    table(schema, cf)
                ));
                if !room.is_empty() {
                    // Tables created before keel set it get it too (pages
                    // written from now on leave the room).
                    out.push(format!(
                        "alter table {}{}",
                        table(schema, cf),
                        room.replace(" with", " set")
                    ));
                }
            }
        }
        out.push(format!(
            "create table if not exists \"{schema}\".lease (shard int4 primary key, \
             owner text not null, epoch int8 not null, expires_at timestamptz not null)"
        ));
        out.push(format!(
            "insert into \"{schema}\".lease values (0, '', 0, '-infinity') on conflict do nothing"
        ));
        out.push(format!(
            "create or replace function \"{schema}\".fence(p_epoch int8, p_owner text) \
             returns void language plpgsql as $fence$ begin \
             perform 1 from \"{schema}\".lease \
             where shard = 0 and epoch = p_epoch and owner = p_owner for share; \
             if not found then raise exception \
             'keel: the write lease of epoch % is no longer held by %', p_epoch, p_owner \
             using errcode = '{FENCED_SQLSTATE}'; end if; end $fence$"
        ));
        // Shared by several processes: one row per shard that was ever
        // taken (an empty owner: never), and the processes alive.
        out.push(format!(
            "create table if not exists \"{schema}\".shard_lease (shard int4 primary key, \
             owner text not null, epoch int8 not null, expires_at_ms int8 not null)"
        ));
        out.push(format!(
            "create table if not exists \"{schema}\".member (owner text primary key, \
             expires_at_ms int8 not null)"
        ));
        // Notes between the processes (see `crate::relay`).
        out.push(format!(
            "create table if not exists \"{schema}\".relay (id bigserial primary key, \
             dest text not null, at_ms int8 not null, body bytea not null)"
        ));
        out.push(format!(
            "create index if not exists relay_dest on \"{schema}\".relay (dest, id)"
        ));
        out.push(format!(
            "create or replace function \"{schema}\".shard_fence(p_shard int4, p_epoch int8) \
             returns void language plpgsql as $fence$ begin \
             perform 1 from \"{schema}\".shard_lease \
             where shard = p_shard and epoch = p_epoch and epoch > 0 for share; \
             if not found then raise exception \
             'keel: the lease of shard % at epoch % is no longer held', p_shard, p_epoch \
             using errcode = '{SHARD_FENCED_SQLSTATE}'; end if; end $fence$"
        ));
        out
    }
}

/// One connection with its prepared statements.
struct Conn {
    client: Client,
    prepared: Mutex<HashMap<String, Statement>>,
}

impl Conn {
    fn statement(&self, shared: &Shared, sql: &str) -> Result<Statement> {
        if let Some(s) = self.prepared.lock().get(sql) {
            return Ok(s.clone());
        }
        let s = block(self.client.prepare(sql)).map_err(|e| shared.error(&e))?;
        self.prepared.lock().insert(sql.to_string(), s.clone());
        Ok(s)
    }

    fn query(
        &self,
        shared: &Shared,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>> {
        let st = self.statement(shared, sql)?;
        block(self.client.query(&st, params)).map_err(|e| shared.error(&e))
    }
}

/// What the store's threads share.
struct Shared {
    config: tokio_postgres::Config,
    /// TLS to the server, as the connection string's `sslmode` says.
    tls: Tls,
    /// Runs the connections' tasks; `None` only while dropping.
    runtime: Option<tokio::runtime::Runtime>,
    target: String,
    schema: String,
    sql: Sql,
    durability: Durability,
    /// This process's name in the lease row (host, pid and a random part).
    owner: String,
    lease_ms: u64,
    /// The epoch of the lease this store holds (0 before it took one, and
    /// always when `sharded`).
    epoch: AtomicI64,
    /// Several processes write, each under its shard leases.
    sharded: bool,
    health: HealthCell,
    /// What the writer counted.
    stats: crate::stats::WriterStats,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The store may be dropped inside an async runtime (an engine
        // shutting down), where a blocking runtime shutdown panics.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PgStore({})", self.target)
    }
}

/// Blocks the calling thread on a driver future. The futures of a
/// `tokio-postgres` client only talk to its connection task (which runs on
/// the store's runtime) through channels, so any thread may wait on them.
fn block<F: std::future::Future>(f: F) -> F::Output {
    futures::executor::block_on(f)
}

impl Shared {
    /// The typed error for a driver error.
    fn error(&self, e: &tokio_postgres::Error) -> Error {
        let fault = match e.code() {
            Some(c)
                if *c == SqlState::INVALID_PASSWORD
                    || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
                    || *c == SqlState::INVALID_CATALOG_NAME
                    || *c == SqlState::TOO_MANY_CONNECTIONS =>
            {
                DatabaseFault::Refused
            }
            Some(c) if *c == SqlState::ADMIN_SHUTDOWN || *c == SqlState::CRASH_SHUTDOWN => {
                DatabaseFault::Lost
            }
            // The server is starting up or shutting down: it will be back.
            Some(c) if *c == SqlState::CANNOT_CONNECT_NOW => DatabaseFault::Unreachable,
            Some(_) => DatabaseFault::Statement,
            // No SQLSTATE: the connection closed or its socket failed
            // (the server went away), or the driver could not make sense
            // of an answer, which retrying the same statement will not
            // change.
            None if e.is_closed() || io_source(e) => DatabaseFault::Lost,
            None => DatabaseFault::Statement,
        };
        self.fault(fault, describe(e))
    }

    fn fault(&self, fault: DatabaseFault, detail: impl Into<String>) -> Error {
        Error::Database {
            target: self.target.clone(),
            fault,
            detail: detail.into(),
        }
    }

    /// A new connection, its task running on the store's runtime.
    fn connect(&self) -> Result<Conn> {
        let config = self.config.clone();
        let tls = self.tls.clone();
        let Some(runtime) = self.runtime.as_ref() else {
            return Err(Error::Closed);
        };
        let limit = connect_limit(&config);
        let task = runtime.spawn(async move {
            let mut driving = None;
            let handshake = async {
                let (client, connection) = pg_tls::connect(&config, tls).await?;
                driving = Some(tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        debug!(error = %e, "postgres connection ended");
                    }
                }));
                client.batch_execute(PG_SESSION_SETUP).await?;
                Ok::<_, tokio_postgres::Error>(client)
            };
            // Dropped at the limit, a connection still in its handshake
            // closes its socket; one waiting for its session setup's
            // answer is stopped here (its task would wait for that answer).
            let made = tokio::time::timeout(limit, handshake).await;
            if made.is_err() {
                if let Some(task) = driving {
                    task.abort();
                }
            }
            made
        });
        let client = match block(task) {
            Ok(Ok(Ok(client))) => client,
            Ok(Err(_elapsed)) => {
                return Err(self.fault(
                    DatabaseFault::Unreachable,
                    format!(
                        "the server did not complete the connection within {} ms",
                        limit.as_millis()
                    ),
                ))
            }
            Ok(Ok(Err(e))) => {
                return Err(match e.code() {
                    Some(_) => self.error(&e),
                    None if pg_tls::is_tls_refusal(&e) => {
                        self.fault(DatabaseFault::Tls, describe(&e))
                    }
                    None => self.fault(DatabaseFault::Unreachable, describe(&e)),
                })
            }
            Err(join) => return Err(self.fault(DatabaseFault::Unreachable, join.to_string())),
        };
        Ok(Conn {
            client,
            prepared: Mutex::new(HashMap::new()),
        })
    }
}

/// Whether a connection string (URL or `key=value` form) sets `option`:
/// the driver reports some options only with its default filled in.
fn names_option(url: &str, option: &str) -> bool {
    url.split(|c: char| c == '?' || c == '&' || c.is_whitespace())
        .filter_map(|part| part.split_once('='))
        .any(|(key, _)| key == option)
}

/// How long a whole connection attempt may take (see
/// [`PG_CONNECT_TIMEOUT_MS`]): the limit per host, times the hosts the
/// connection string names, so that a silent first host leaves the
/// others their turn.
fn connect_limit(config: &tokio_postgres::Config) -> Duration {
    let per_host = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(Duration::from_millis(PG_CONNECT_TIMEOUT_MS));
    let hosts = u32::try_from(config.get_hosts().len().max(1)).unwrap_or(u32::MAX);
    per_host.saturating_mul(hosts)
}

/// Whether a driver error comes from the socket (the connection failed
/// under it).
fn io_source(e: &tokio_postgres::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// A driver error with its cause (the driver's own text is terse: "db
/// error", "error connecting to server").
fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{} ({}): {}", db.severity(), db.code().code(), db.message());
    }
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Connections for reads, opened on demand up to a limit.
struct Pool {
    idle: Mutex<PoolState>,
    freed: Condvar,
    max: usize,
}

struct PoolState {
    idle: Vec<Conn>,
    open: usize,
}

impl Pool {
    fn take(&self, shared: &Shared) -> Result<Conn> {
        let mut state = self.idle.lock();
        loop {
            while let Some(c) = state.idle.pop() {
                if !c.client.is_closed() {
                    return Ok(c);
                }
                state.open -= 1;
            }
            if state.open < self.max {
                state.open += 1;
                drop(state);
                return shared.connect().inspect_err(|_| self.idle.lock().open -= 1);
            }
            if self
                .freed
                .wait_for(&mut state, Duration::from_millis(PG_POOL_WAIT_MS))
                .timed_out()
            {
                return Err(shared.fault(
                    DatabaseFault::Unreachable,
                    format!(
                        "all {} read connections stayed busy for {PG_POOL_WAIT_MS} ms",
                        self.max
                    ),
                ));
            }
        }
    }

    fn give(&self, conn: Conn) {
        let mut state = self.idle.lock();
        if conn.client.is_closed() {
            state.open -= 1;
        } else {
            state.idle.push(conn);
        }
        drop(state);
        self.freed.notify_one();
    }
}

/// A commit waiting for the writer.
struct Request {
    prepared: PreparedBatch,
    /// On a sharded store, the fence checked in the commit's transaction
    /// (taken out of the batch: the rows the shared validation would read
    /// it from live in `shard_lease`, not in a table it reads).
    fence: Option<Fence>,
    reply: Reply,
}

/// A keel store in a PostgreSQL database.
pub struct PgStore {
    shared: Arc<Shared>,
    pool: Pool,
    tx: Option<Sender<Request>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PgStore({}, {})",
            self.shared.target,
            if self.tx.is_some() {
                "read-write"
            } else {
                "read-only"
            }
        )
    }
}

impl PgStore {
    /// Opens the store for reading and writing: creates the schema if it is
    /// not there, checks its version, and takes the database's write lease
    /// (waiting for it as [`PgOptions::lease_wait_ms`] says).
    pub fn open(options: PgOptions) -> Result<Self> {
        let (shared, pool) = Self::connect_shared(&options)?;
        let mut conn = shared.connect()?;
        create_or_check(&shared, &conn)?;
        let epoch = loop {
            if shared.sharded {
                claim_sharded(&shared, &conn)?;
                break 0;
            }
            match take_lease(&shared, &conn, options.lease_wait_ms) {
                // A standby waits out a database restart too.
                Err(Error::Database {
                    fault: DatabaseFault::Lost | DatabaseFault::Unreachable,
                    detail,
                    ..
                }) if options.lease_wait_ms.is_none() => {
                    warn!(%detail, "lost the database while waiting for the write lease; reconnecting");
                    std::thread::sleep(Duration::from_millis(PG_RECONNECT_PAUSE_MS));
                    match shared.connect() {
                        Ok(c) => conn = c,
                        Err(e) => debug!(error = %e, "reconnecting"),
                    }
                }
                other => break other?,
            }
        };
        shared.epoch.store(epoch, Ordering::Release);
        if shared.durability == Durability::Buffered {
            block(conn.client.batch_execute("set synchronous_commit = off"))
                .map_err(|e| shared.error(&e))?;
        }
        let (tx, rx) = crossbeam_channel::bounded(COMMIT_QUEUE_MAX);
        let writer_shared = shared.clone();
        let writer = std::thread::Builder::new()
            .name("keel-pg-writer".into())
            .spawn(move || writer_loop(&writer_shared, conn, rx))
            .map_err(Error::Io)?;
        Ok(PgStore {
            shared,
            pool,
            tx: Some(tx),
            writer: Some(writer),
        })
    }

    /// Opens the store for reading only, beside a running engine: creates
    /// nothing and takes no lock; commits are refused.
    pub fn open_read_only(options: PgOptions) -> Result<Self> {
        let (shared, pool) = Self::connect_shared(&options)?;
        let conn = pool.take(&shared)?;
        let found = read_version(&shared, &conn);
        pool.give(conn);
        match found? {
            None => Err(shared.fault(
                DatabaseFault::Missing,
                format!(
                    "schema \"{}\" has no keel tables (an engine creates them)",
                    shared.schema
                ),
            )),
            Some(v) if v != SCHEMA_VERSION => Err(Error::DatabaseSchemaVersion {
                target: shared.target.clone(),
                found: v,
                expected: SCHEMA_VERSION,
            }),
            Some(_) => Ok(PgStore {
                shared,
                pool,
                tx: None,
                writer: None,
            }),
        }
    }

    fn connect_shared(options: &PgOptions) -> Result<(Arc<Shared>, Pool)> {
        let bad = |detail: String| Error::Database {
            target: redact(&options.url),
            fault: DatabaseFault::Config,
            detail,
        };
        let schema = &options.schema;
        if schema.is_empty()
            || schema.len() > PG_SCHEMA_NAME_BYTES_MAX
            || !schema.starts_with(|c: char| c.is_ascii_lowercase())
            || !schema
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(bad(format!(
                "schema name {schema:?} must be 1 to {PG_SCHEMA_NAME_BYTES_MAX} lowercase letters, digits or underscores, starting with a letter"
            )));
        }
        let (mut config, tls) = pg_tls::driver_config(&options.url).map_err(bad)?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_millis(PG_CONNECT_TIMEOUT_MS));
        }
        // A failed link is found within bounds (see PG_TCP_USER_TIMEOUT_MS),
        // unless the connection string says otherwise.
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(Duration::from_millis(PG_TCP_USER_TIMEOUT_MS));
        }
        if config.get_keepalives() && !names_option(&options.url, "keepalives_idle") {
            config.keepalives_idle(Duration::from_millis(PG_KEEPALIVE_IDLE_MS));
        }
        if config.get_keepalives() && config.get_keepalives_interval().is_none() {
            config.keepalives_interval(Duration::from_millis(PG_KEEPALIVE_INTERVAL_MS));
        }
        if config.get_application_name().is_none() {
            config.application_name("keel");
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("keel-pg")
            .enable_all()
            .build()
            .map_err(Error::Io)?;
        let shared = Arc::new(Shared {
            target: target_of(&config, schema),
            sql: Sql::new(schema),
            schema: schema.clone(),
            durability: options.durability,
            config,
            tls,
            runtime: Some(runtime),
            owner: format!(
                "{} pid {} {}",
                hostname(),
                std::process::id(),
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            ),
            lease_ms: options.lease_ms.max(PG_LEASE_MS_MIN),
            epoch: AtomicI64::new(0),
            sharded: options.sharded,
            health: HealthCell::default(),
            stats: crate::stats::WriterStats::default(),
        });
        let pool = Pool {
            idle: Mutex::new(PoolState {
                idle: Vec::new(),
                open: 0,
            }),
            freed: Condvar::new(),
            max: options.read_connections.max(1),
        };
        Ok((shared, pool))
    }

    /// The database and schema this store is in (no password).
    pub fn target(&self) -> &str {
        &self.shared.target
    }

    /// Drops every keel table of `options.schema` (tests and `keel`'s
    /// clean-up of a scratch schema). Close the stores on it first.
    pub fn drop_schema(options: &PgOptions) -> Result<()> {
        let (shared, _pool) = Self::connect_shared(options)?;
        let conn = shared.connect()?;
        block(conn.client.batch_execute(&format!(
            "drop schema if exists \"{}\" cascade",
            shared.schema
        )))
        .map_err(|e| shared.error(&e))
    }

    fn with_conn<T>(&self, f: impl Fn(&Conn) -> Result<T>) -> Result<T> {
        // A read is retried once on a fresh connection when the one taken
        // from the pool turns out to be broken (the server restarted).
        let once = |f: &dyn Fn(&Conn) -> Result<T>| {
            let conn = self.pool.take(&self.shared)?;
            let result = f(&conn);
            self.pool.give(conn);
            result
        };
        match once(&f) {
            Err(Error::Database {
                fault: DatabaseFault::Lost,
                ..
            }) => once(&f),
            other => other,
        }
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// This machine's name, for the lease's owner.
fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// `host:port/dbname schema S`, never the password.
fn target_of(config: &tokio_postgres::Config, schema: &str) -> String {
    use tokio_postgres::config::Host;
    let host = config
        .get_hosts()
        .first()
        .map(|h| match h {
            Host::Tcp(h) => h.clone(),
            #[cfg(unix)]
            Host::Unix(p) => p.display().to_string(),
        })
        .unwrap_or_else(|| "localhost".into());
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config
        .get_dbname()
        .or(config.get_user())
        .unwrap_or("postgres");
    format!("{host}:{port}/{db} schema {schema}")
}

/// A connection string with any password replaced.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url
            .split_whitespace()
            .map(|kv| {
                if kv.starts_with("password=") {
                    "password=***"
                } else {
                    kv
                }
            })
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// Takes the write lease, waiting up to `wait_ms` (forever for `None`)
/// while another process holds it; returns the new epoch.
fn take_lease(shared: &Shared, conn: &Conn, wait_ms: Option<u64>) -> Result<i64> {
    let started = std::time::Instant::now();
    let mut announced = false;
    loop {
        let rows = conn.query(
            shared,
            &format!(
                "update \"{}\".lease set owner = $1, epoch = epoch + 1, \
                 expires_at = clock_timestamp() + make_interval(secs => $2::float8 / 1000) \
                 where shard = 0 and (expires_at < clock_timestamp() or owner = $1) \
                 returning epoch",
                shared.schema
            ),
            &[&shared.owner, &(shared.lease_ms as f64)],
        )?;
        if let Some(row) = rows.first() {
            let epoch: i64 = row.get(0);
            tracing::info!(target = %shared.target, epoch, owner = %shared.owner, "took the write lease");
            return Ok(epoch);
        }
        // Who holds it, and for how long yet (capped: a sharded database's
        // lease never ends).
        let holder = conn
            .query(
                shared,
                &format!(
                    "select owner, (extract(epoch from least(greatest(expires_at, clock_timestamp()), clock_timestamp() + interval '1 day') - clock_timestamp()) * 1000)::int8 \
                     from \"{}\".lease where shard = 0",
                    shared.schema
                ),
                &[],
            )?
            .first()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
            .unwrap_or_default();
        if holder.0 == SHARDED_OWNER {
            return Err(Error::DatabaseLocked {
                target: shared.target.clone(),
                detail:
                    "several engine processes share it (it was opened sharded); open it sharded too"
                        .into(),
            });
        }
        let waited = started.elapsed().as_millis() as u64;
        if wait_ms.is_some_and(|w| waited >= w) {
            return Err(Error::DatabaseLocked {
                target: shared.target.clone(),
                detail: format!(
                    "its write lease is held by {} and renewed; it ends {} ms after the holder stops",
                    holder.0, holder.1
                ),
            });
        }
        if !announced {
            tracing::info!(target = %shared.target, holder = %holder.0, "waiting for the write lease");
            announced = true;
        }
        std::thread::sleep(Duration::from_millis(PG_LEASE_POLL_MS));
    }
}

/// Marks the database shared by engine processes: the write lease goes to
/// [`SHARDED_OWNER`] for good, so a process that would write alone waits
/// for nothing and is refused ([`take_lease`]), and one that wrote alone
/// before is fenced. Refused while such a process holds the lease.
fn claim_sharded(shared: &Shared, conn: &Conn) -> Result<()> {
    let schema = &shared.schema;
    let claimed = conn.query(
        shared,
        &format!(
            "update \"{schema}\".lease set owner = $1, expires_at = 'infinity', \
             epoch = case when owner = $1 then epoch else epoch + 1 end \
             where shard = 0 and (expires_at < clock_timestamp() or owner = $1) \
             returning epoch"
        ),
        &[&SHARDED_OWNER],
    )?;
    if !claimed.is_empty() {
        return Ok(());
    }
    let holder: String = conn
        .query(
            shared,
            &format!("select owner from \"{schema}\".lease where shard = 0"),
            &[],
        )?
        .first()
        .map(|r| r.get(0))
        .unwrap_or_default();
    Err(Error::DatabaseLocked {
        target: shared.target.clone(),
        detail: format!(
            "{holder} writes to it alone; stop it before engine processes share the database"
        ),
    })
}

/// Extends this store's lease; `Ok(false)` when it is no longer ours.
fn renew_lease(shared: &Shared, conn: &Conn) -> Result<bool> {
    let rows = conn.query(
        shared,
        &format!(
            "update \"{}\".lease set expires_at = clock_timestamp() + make_interval(secs => $3::float8 / 1000) \
             where shard = 0 and epoch = $1 and owner = $2 returning epoch",
            shared.schema
        ),
        &[
            &shared.epoch.load(Ordering::Acquire),
            &shared.owner,
            &(shared.lease_ms as f64),
        ],
    )?;
    Ok(!rows.is_empty())
}

/// Ends this store's lease at once (a clean close), so the next process
/// does not wait for it to run out.
fn release_lease(shared: &Shared, conn: &Conn) -> Result<()> {
    conn.query(
        shared,
        &format!(
            "update \"{}\".lease set expires_at = '-infinity' \
             where shard = 0 and epoch = $1 and owner = $2 returning epoch",
            shared.schema
        ),
        &[&shared.epoch.load(Ordering::Acquire), &shared.owner],
    )
    .map(|_| ())
}

impl Shared {
    /// Marks the store fenced: another process owns the database now.
    /// The writer could not connect: commits stop (answered at once)
    /// until it can again.
    fn unreachable(&self, detail: String) {
        let before = self.health.get();
        if before.is_failed() {
            return;
        }
        if before.is_healthy() {
            tracing::error!(target = %self.target, %detail, "database unreachable: commits stop until it answers again");
        }
        self.health.set(StoreHealth::Stopped {
            fault: WriteFault::Unreachable,
            detail,
        });
    }

    /// The writer connected again after [`Shared::unreachable`].
    fn reachable(&self) {
        if let StoreHealth::Stopped {
            fault: WriteFault::Unreachable,
            ..
        } = self.health.get()
        {
            self.health.set(StoreHealth::Healthy);
            tracing::info!(target = %self.target, "database reachable again: commits resume");
        }
    }

    fn fenced(&self, detail: String) {
        let before = self.health.set(StoreHealth::Failed {
            fault: WriteFault::Fenced,
            detail: detail.clone(),
        });
        if before.is_healthy() {
            tracing::error!(target = %self.target, %detail, "write lease lost: this process no longer commits");
        }
    }
}

/// The recorded schema version, `None` when there are no keel tables.
fn read_version(shared: &Shared, conn: &Conn) -> Result<Option<u32>> {
    let rows = block(conn.client.query(
        "select to_regclass($1) is not null",
        &[&format!("\"{}\".version", shared.schema)],
    ))
    .map_err(|e| shared.error(&e))?;
    if !rows.first().map(|r| r.get::<_, bool>(0)).unwrap_or(false) {
        return Ok(None);
    }
    let rows = block(conn.client.query(
        &format!(
            "select schema_version from \"{}\".version limit 1",
            shared.schema
        ),
        &[],
    ))
    .map_err(|e| shared.error(&e))?;
    Ok(rows.first().map(|r| r.get::<_, i32>(0) as u32))
}

/// Checks the version recorded, if any (a database of another version is
/// left untouched); when something is missing, creates it (every statement
/// is idempotent, so a database created by an earlier build of this
/// version gets the tables added since) and records the version. A
/// complete database is only read: an engine's role needs no CREATE
/// privilege once the tables exist. Concurrent openers serialise on a
/// transaction-scoped advisory lock. A database of
/// [`crate::SCHEMA_VERSION_READ_AS_IS`] or a newer older schema is
/// migrated in one transaction: its rows are read as they are, the rows
/// this build no longer writes are deleted ([`migration_deletes`]) and the
/// current version is recorded. Engine processes of the older build must
/// be stopped first, since they cannot read the rows this build writes.
fn create_or_check(shared: &Shared, conn: &Conn) -> Result<()> {
    let recorded = read_version(shared, conn)?;
    if let Some(found) = recorded {
        if read_as_is(found) && schema_complete(shared, conn)? {
            // Engines of the older version still at work would read rows
            // they cannot decode: migrate only when none holds a shard
            // lease, a membership or the single writer's lease (checked
            // again under the lock).
            let now_ms = wall_clock_ms();
            refuse_if_live(shared, conn, found, now_ms)?;
            // The version row changes and, from before schema 6, rows of
            // `kv_dedupe` are deleted, from before schema 7 rows of
            // `kv_index`: no CREATE or ownership needed, but DELETE on
            // those tables.
            let script = format!(
                "begin;\nselect pg_advisory_xact_lock(hashtext('keel-create:{s}')::int8);\n\
                 {live}{dropped}\
                 update \"{s}\".version set schema_version = {SCHEMA_VERSION} \
                 where schema_version = {found};\ncommit;",
                s = shared.schema,
                live = live_engines_refused(shared, now_ms),
                dropped = migration_deletes(&shared.schema, found),
            );
            if let Err(e) = block(conn.client.batch_execute(&script)) {
                // One joined between the check and the lock. The failed
                // script left its transaction open, failed: end it first.
                let _ = block(conn.client.batch_execute("rollback"));
                refuse_if_live(shared, conn, found, now_ms)?;
                return Err(shared.error(&e));
            }
            let now = read_version(shared, conn)?.unwrap_or(found);
            return check_version(shared, now);
        }
        if !read_as_is(found) {
            check_version(shared, found)?;
            if schema_complete(shared, conn)? {
                return Ok(());
            }
        }
    }
    let mut script = String::from("begin;\n");
    script.push_str(&format!(
        "select pg_advisory_xact_lock(hashtext('keel-create:{}')::int8);\n",
        shared.schema
    ));
    for s in Sql::create(&shared.schema) {
        script.push_str(&s);
        script.push_str(";\n");
    }
    script.push_str(&format!(
        "insert into \"{s}\".version (schema_version, created_by) \
         select {SCHEMA_VERSION}, 'keel {}' \
         where not exists (select 1 from \"{s}\".version);\n",
        env!("CARGO_PKG_VERSION"),
        s = shared.schema
    ));
    // An older schema read as it is, missing objects added since: created
    // above, and migrated here in the same transaction, once no engine
    // process holds the database (the tables the check reads exist now).
    if let Some(found) = recorded.filter(|v| read_as_is(*v)) {
        let now_ms = wall_clock_ms();
        script.push_str(&live_engines_refused(shared, now_ms));
        script.push_str(&migration_deletes(&shared.schema, found));
        script.push_str(&format!(
            "update \"{s}\".version set schema_version = {SCHEMA_VERSION} \
             where schema_version = {found};\n",
            s = shared.schema
        ));
    }
    script.push_str("commit;");
    if let Err(e) = block(conn.client.batch_execute(&script)) {
        // A migration held back by a live engine process: named (after
        // ending the failed transaction the script left open).
        if let Some(found) = recorded.filter(|v| read_as_is(*v)) {
            let _ = block(conn.client.batch_execute("rollback"));
            let live = refuse_if_live(shared, conn, found, wall_clock_ms());
            if let Err(
                in_use @ Error::Database {
                    fault: DatabaseFault::InUse,
                    ..
                },
            ) = live
            {
                return Err(in_use);
            }
        }
        return Err(shared.error(&e));
    }
    match read_version(shared, conn)? {
        Some(found) => check_version(shared, found),
        None => Err(shared.fault(
            DatabaseFault::Missing,
            "the tables were created but the version row is missing",
        )),
    }
}

/// This machine's clock in milliseconds since the Unix epoch, as the
/// lease rows hold it.
fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A statement (ending in a newline) that raises an exception, failing
/// the transaction it is in, while an engine process holds a shard lease
/// or a membership ending after `now_ms`, or another single writer holds
/// the write lease: run under the creation lock before a migration, so that
/// none joins between the check and the migration.
fn live_engines_refused(shared: &Shared, now_ms: i64) -> String {
    format!(
        "do $$ begin if exists (select 1 from \"{s}\".shard_lease \
         where owner <> '' and expires_at_ms > {now_ms}) \
         or exists (select 1 from \"{s}\".member where expires_at_ms > {now_ms}) \
         or exists (select 1 from \"{s}\".lease where shard = 0 \
             and owner not in ('', '{sharded}', '{me}') \
             and expires_at > clock_timestamp()) \
         then raise exception 'keel: engine processes hold the database'; \
         end if; end $$;\n",
        s = shared.schema,
        sharded = SHARDED_OWNER,
        me = shared.owner.replace('\'', "''"),
    )
}

/// Whether a database of schema `found` is migrated by an engine's open:
/// an older schema whose rows this build reads as they are.
fn read_as_is(found: u32) -> bool {
    (crate::SCHEMA_VERSION_READ_AS_IS..SCHEMA_VERSION).contains(&found)
}

/// The statements (each ending in `;` and a newline) that migrate the rows
/// of a database of schema `found` that this build reads as they are:
/// before [`crate::SCHEMA_VERSION_ATTEMPT_ROWS_DROPPED`], the attempt rows
/// written by the same event as their execution's row (so holding the
/// same bytes) are deleted, as `derive::attempt_rows_beside_executions`
/// finds them in a data directory. Key layout (`keys::dedupe_key`): the
/// run's 16 bytes, `a`, the step and the attempt (4 bytes each) for an
/// attempt; the run, `x` and the step for an execution. Before
/// [`crate::SCHEMA_VERSION_INDEX_NARROWED`], the index keys by type alone
/// and of every run (those starting with
/// [`crate::search::DROPPED_INDEX_PREFIXES`]) are deleted, a key range each.
fn migration_deletes(schema: &str, found: u32) -> String {
    let mut sql = String::new();
    if found < crate::SCHEMA_VERSION_ATTEMPT_ROWS_DROPPED {
        let dedupe = table(schema, Cf::Dedupe);
        sql.push_str(&format!(
            "delete from {dedupe} a using {dedupe} x \
             where length(a.k) = 25 and get_byte(a.k, 16) = {attempt} \
             and x.k = substr(a.k, 1, 16) || '\\x{execution:02x}'::bytea || substr(a.k, 18, 4) \
             and x.v = a.v;\n",
            attempt = b'a',
            execution = b'x',
        ));
    }
    if found < crate::SCHEMA_VERSION_INDEX_NARROWED {
        let index = table(schema, Cf::Index);
        for first in crate::search::DROPPED_INDEX_PREFIXES {
            sql.push_str(&format!(
                "delete from {index} where k >= '\\x{first:02x}'::bytea \
                 and k < '\\x{end:02x}'::bytea;\n",
                end = first + 1,
            ));
        }
    }
    sql
}

/// Refuses to migrate a database of schema `found` while engine processes
/// hold shard leases or memberships that end after `now_ms`, or a single
/// writer holds the write lease (by the database's clock): naming them.
fn refuse_if_live(shared: &Shared, conn: &Conn, found: u32, now_ms: i64) -> Result<()> {
    let s = &shared.schema;
    let rows = block(conn.client.query(
        &format!(
            "select owner, expires_at_ms from \"{s}\".shard_lease \
             where owner <> '' and expires_at_ms > $1 \
             union select owner, expires_at_ms from \"{s}\".member where expires_at_ms > $1 \
             union select owner, $1 + (extract(epoch from least(expires_at, \
                 clock_timestamp() + interval '1 day') - clock_timestamp()) * 1000)::int8 \
             from \"{s}\".lease where shard = 0 and owner not in ('', $2, $3) \
                 and expires_at > clock_timestamp() \
             order by 1 limit {PG_LIVE_OWNERS_NAMED_MAX}"
        ),
        &[&now_ms, &SHARDED_OWNER, &shared.owner],
    ))
    .map_err(|e| shared.error(&e))?;
    if rows.is_empty() {
        return Ok(());
    }
    let mut owners: Vec<String> = rows.iter().map(|r| r.get::<_, String>(0)).collect();
    owners.dedup();
    let until_ms = rows
        .iter()
        .map(|r| r.get::<_, i64>(1))
        .max()
        .unwrap_or(now_ms);
    Err(shared.fault(
        DatabaseFault::InUse,
        format!(
            "schema {found} migrates to {SCHEMA_VERSION} only when no engine process of the \
             older version is running, and {} still hold leases (for up to {} ms more): stop \
             them, or wait for their leases to end, then open again",
            owners.join(", "),
            until_ms.saturating_sub(now_ms)
        ),
    ))
}

/// Whether the objects added within this schema version (for engine
/// processes sharing the database, and the room left on the pages of
/// rewritten tables) are there.
fn schema_complete(shared: &Shared, conn: &Conn) -> Result<bool> {
    let s = &shared.schema;
    let rows = block(conn.client.query(
        "select to_regclass($1) is not null and to_regclass($2) is not null \
         and to_regprocedure($3) is not null and to_regclass($4) is not null \
         and coalesce((select reloptions from pg_class where oid = to_regclass($5)) \
             @> array[$6], false)",
        &[
            &format!("\"{s}\".shard_lease"),
            &format!("\"{s}\".member"),
            &format!("\"{s}\".shard_fence(int4, int8)"),
            &format!("\"{s}\".relay"),
            &table(s, Cf::Runs),
            &format!("fillfactor={PG_UPDATED_FILLFACTOR_PERCENT}"),
        ],
    ))
    .map_err(|e| shared.error(&e))?;
    Ok(rows.first().is_some_and(|r| r.get::<_, bool>(0)))
}

fn check_version(shared: &Shared, found: u32) -> Result<()> {
    if found == SCHEMA_VERSION {
        Ok(())
    } else {
        Err(Error::DatabaseSchemaVersion {
            target: shared.target.clone(),
            found,
            expected: SCHEMA_VERSION,
        })
    }
}

/// Rows of one scan page, as (key, value).
type KvRows = Vec<(Vec<u8>, Vec<u8>)>;

/// Reads the page of rows from a start key, under an end key if any.
type ReadPage<'a> = dyn FnMut(&[u8], Option<&[u8]>) -> Result<KvRows> + 'a;

/// Reads through one connection.
struct ConnView<'a> {
    shared: &'a Shared,
    conn: &'a Conn,
}

fn event_key_parts(key: &[u8]) -> Option<(&[u8], i64)> {
    if key.len() != 24 {
        return None;
    }
    let seq = u64::from_be_bytes(key[16..24].try_into().ok()?);
    Some((&key[..16], i64::try_from(seq).ok()?))
}

impl ConnView<'_> {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let sql = &self.shared.sql;
        let rows = if cf == Cf::Events {
            let Some((run, seq)) = event_key_parts(key) else {
                return Ok(None);
            };
            self.conn
                .query(self.shared, &sql.event_get, &[&run, &seq])?
        } else {
            self.conn
                .query(self.shared, &sql.get[cf.index()], &[&key])?
        };
        Ok(rows.first().map(|r| r.get::<_, Vec<u8>>(0)))
    }

    /// The values at `keys`, in their order, in one round trip (events,
    /// keyed by run and seq, one at a time).
    fn get_many(&self, cf: Cf, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        if cf == Cf::Events || keys.is_empty() {
            return keys.iter().map(|k| self.get(cf, k)).collect();
        }
        let (found, _) = self.read_ahead(&BTreeMap::from([(cf, keys.to_vec())]), &[])?;
        Ok(keys
            .iter()
            .map(|k| found.get(&(cf, k.clone())).cloned().flatten())
            .collect())
    }

    /// Reads `wanted` (keys by family; not `events`) and the prefix scans
    /// `scans` in one round trip: every key, found or known absent, and
    /// every scan that fits in one page ([`PG_SCAN_PAGE_ROWS`]; a longer
    /// one is left to be read when it is made).
    fn read_ahead(
        &self,
        wanted: &BTreeMap<Cf, Vec<Vec<u8>>>,
        scans: &[(Cf, Vec<u8>)],
    ) -> Result<(ReadAhead, ScanAhead)> {
        let sql = &self.shared.sql;
        let mut statements = Vec::with_capacity(wanted.len());
        for (cf, keys) in wanted {
            debug_assert!(*cf != Cf::Events, "events are never read ahead");
            statements.push((
                *cf,
                keys,
                self.conn
                    .statement(self.shared, &sql.get_many[cf.index()])?,
            ));
        }
        let mut scanning = Vec::with_capacity(scans.len());
        for (cf, prefix) in scans {
            debug_assert!(*cf != Cf::Events, "events are never read ahead");
            let Some(end) = prefix_end(prefix) else {
                continue;
            };
            scanning.push((
                (*cf, prefix.clone()),
                end,
                self.conn
                    .statement(self.shared, &sql.scan_bounded[cf.index()])?,
            ));
        }
        let client = &self.conn.client;
        let params: Vec<[&(dyn ToSql + Sync); 1]> =
            statements.iter().map(|(_, keys, _)| [*keys as _]).collect();
        let scan_params: Vec<[&(dyn ToSql + Sync); 3]> = scanning
            .iter()
            .map(|((_, prefix), end, _)| [prefix as _, end as _, &PG_SCAN_PAGE_ROWS as _])
            .collect();
        // Both sets go out together: one round trip.
        let (answers, scanned) = block(futures::future::join(
            futures::future::join_all(
                statements
                    .iter()
                    .zip(&params)
                    .map(|((_, _, st), p)| client.query(st, p)),
            ),
            futures::future::join_all(
                scanning
                    .iter()
                    .zip(&scan_params)
                    .map(|((_, _, st), p)| client.query(st, p)),
            ),
        ));
        let mut whole = ScanAhead::new();
        for ((at, _, _), rows) in scanning.into_iter().zip(scanned) {
            let rows = rows.map_err(|e| self.shared.error(&e))?;
            if (rows.len() as i64) < PG_SCAN_PAGE_ROWS {
                whole.insert(at, rows.iter().map(|r| (r.get(0), r.get(1))).collect());
            }
        }
        let mut out = ReadAhead::new();
        for ((cf, keys, _), rows) in statements.iter().zip(answers) {
            let rows = rows.map_err(|e| self.shared.error(&e))?;
            for k in keys.iter() {
                out.insert((*cf, k.clone()), None);
            }
            for r in rows {
                out.insert((*cf, r.get(0)), Some(r.get(1)));
            }
        }
        Ok((out, whole))
    }

    /// One page of a scan: rows with key `>= start` (and under `end`), in
    /// key order, as (key, value).
    fn page(&self, cf: Cf, start: &[u8], end: Option<&[u8]>) -> Result<KvRows> {
        let sql = &self.shared.sql;
        if cf == Cf::Events {
            return self.event_page(start, end);
        }
        let rows = match end {
            Some(end) => self.conn.query(
                self.shared,
                &sql.scan_bounded[cf.index()],
                &[&start, &end, &PG_SCAN_PAGE_ROWS],
            )?,
            None => self.conn.query(
                self.shared,
                &sql.scan_open[cf.index()],
                &[&start, &PG_SCAN_PAGE_ROWS],
            )?,
        };
        Ok(rows.into_iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    fn event_page(&self, start: &[u8], end: Option<&[u8]>) -> Result<KvRows> {
        // Keys are `run ‖ seq`: a start key becomes a (run, seq) lower
        // bound; an end within one run keeps the scan on that run's rows.
        let mut run = [0u8; 16];
        let n = start.len().min(16);
        run[..n].copy_from_slice(&start[..n]);
        let mut seq_bytes = [0u8; 8];
        if start.len() > 16 {
            let m = (start.len() - 16).min(8);
            seq_bytes[..m].copy_from_slice(&start[16..16 + m]);
        }
        let mut seq = u64::from_be_bytes(seq_bytes);
        if start.len() > 24 {
            // A key past `run ‖ seq` (the next page starts at the last
            // key plus a zero byte): every key at or after it has a later
            // seq.
            seq = seq.saturating_add(1);
        }
        let seq = i64::try_from(seq).unwrap_or(i64::MAX);
        let one_run = end.is_some_and(|e| {
            e.len() == 16 && start.len() >= 16 && {
                // The end of a 16-byte prefix is that run plus one.
                prefix_end(&start[..16]).as_deref() == Some(e)
            }
        });
        let sql = &self.shared.sql;
        let rows = if one_run {
            self.conn.query(
                self.shared,
                &sql.event_scan_run,
                &[&&run[..], &seq, &PG_SCAN_PAGE_ROWS],
            )?
        } else {
            self.conn.query(
                self.shared,
                &sql.event_scan,
                &[&&run[..], &seq, &PG_SCAN_PAGE_ROWS],
            )?
        };
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let run: Vec<u8> = r.get(0);
            let seq: i64 = r.get(1);
            let mut key = run;
            key.extend_from_slice(&(seq as u64).to_be_bytes());
            if end.is_some_and(|e| key.as_slice() >= e) {
                break;
            }
            out.push((key, r.get(2)));
        }
        Ok(out)
    }
}

/// Visits keys `>= from` under `prefix` page by page: each page is read
/// through a connection that is given back before `visit` runs, so `visit`
/// may read the store again.
fn scan_pages(
    prefix: &[u8],
    from: &[u8],
    read_page: &mut ReadPage<'_>,
    visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
) -> Result<()> {
    let end = prefix_end(prefix);
    let mut start = if from > prefix {
        from.to_vec()
    } else {
        prefix.to_vec()
    };
    loop {
        let page = read_page(&start, end.as_deref())?;
        let full = page.len() as i64 >= PG_SCAN_PAGE_ROWS;
        let Some(last) = page.last().map(|(k, _)| k.clone()) else {
            return Ok(());
        };
        for (k, v) in &page {
            if !k.starts_with(prefix) || !visit(k, v) {
                return Ok(());
            }
        }
        if !full {
            return Ok(());
        }
        // The next key after `last`.
        start = last;
        start.push(0);
    }
}

impl KvRead for ConnView<'_> {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        ConnView::get(self, cf, key)
    }

    fn get_many(&self, cf: Cf, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        ConnView::get_many(self, cf, keys)
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        scan_pages(
            prefix,
            from,
            &mut |start, end| self.page(cf, start, end),
            visit,
        )
    }

    /// Every record is written whole here: other processes read them.
    fn records_lag(&self) -> bool {
        false
    }
}

impl KvRead for PgStore {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.with_conn(|conn| {
            ConnView {
                shared: &self.shared,
                conn,
            }
            .get(cf, key)
        })
    }

    fn get_many(&self, cf: Cf, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        self.with_conn(|conn| {
            ConnView {
                shared: &self.shared,
                conn,
            }
            .get_many(cf, keys)
        })
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        scan_pages(
            prefix,
            from,
            &mut |start, end| {
                self.with_conn(|conn| {
                    ConnView {
                        shared: &self.shared,
                        conn,
                    }
                    .page(cf, start, end)
                })
            },
            visit,
        )
    }

    fn records_lag(&self) -> bool {
        false
    }
}

impl Store for PgStore {
    fn view(&self) -> &dyn KvRead {
        self
    }

    fn shared(&self) -> Option<&dyn crate::relay::SharedStore> {
        self.shared
            .sharded
            .then_some(self as &dyn crate::relay::SharedStore)
    }

    fn commit(&self, mut batch: CommitBatch) -> CommitHandle {
        let Some(tx) = &self.tx else {
            return CommitHandle::ready(Err(Error::ReadOnly));
        };
        let fence = if self.shared.sharded {
            match batch.fence.take() {
                Some(f) => Some(f),
                None => {
                    return CommitHandle::ready(Err(Error::FenceRequired {
                        target: self.shared.target.clone(),
                    }))
                }
            }
        } else {
            None
        };
        let prepared = match PreparedBatch::new(batch) {
            Ok(p) => p,
            Err(e) => return CommitHandle::ready(Err(e)),
        };
        let (reply, handle) = CommitHandle::channel();
        match tx.send(Request {
            prepared,
            fence,
            reply,
        }) {
            Ok(()) => handle,
            Err(_) => CommitHandle::ready(Err(Error::Closed)),
        }
    }

    fn sync(&self) -> Result<()> {
        if self.shared.durability == Durability::Sync || self.tx.is_none() {
            return Ok(());
        }
        // A synchronous commit flushes the WAL up to itself, which covers
        // every asynchronous commit before it.
        self.with_conn(|conn| {
            block(conn.client.batch_execute(&format!(
                "begin; set local synchronous_commit = on; \
                 update \"{}\".version set created_by = created_by; commit;",
                self.shared.schema
            )))
            .map_err(|e| self.shared.error(&e))
        })
    }

    fn durability(&self) -> Durability {
        self.shared.durability
    }

    fn health(&self) -> StoreHealth {
        self.shared.health.get()
    }

    fn writer_stats(&self) -> Option<crate::stats::WriterSnapshot> {
        Some(self.shared.stats.snapshot())
    }

    fn memory(&self) -> Option<crate::stats::StoreMemory> {
        Some(crate::stats::StoreMemory {
            writer_cache_bytes: self.shared.stats.snapshot().cache_bytes,
            ..Default::default()
        })
    }
}

impl PgStore {
    /// Runs `f` in one transaction on a pooled connection: committed when
    /// it returns `Ok`, rolled back otherwise. Like every keel
    /// transaction, ended by the server if it stays open past a lease.
    fn in_transaction<T>(&self, f: impl Fn(&Conn) -> Result<T>) -> Result<T> {
        let shared = &self.shared;
        // A lock held by a commit of a frozen process is given up on after
        // a lease rather than waited for without end.
        let begin = format!(
            "begin; set local idle_in_transaction_session_timeout = {ms}; \
             set local lock_timeout = {ms}",
            ms = shared.lease_ms
        );
        self.with_conn(|conn| {
            block(conn.client.batch_execute(&begin)).map_err(|e| shared.error(&e))?;
            match f(conn) {
                Ok(v) => {
                    block(conn.client.batch_execute("commit")).map_err(|e| shared.error(&e))?;
                    Ok(v)
                }
                Err(e) => {
                    if let Err(r) = block(conn.client.batch_execute("rollback")) {
                        debug!(error = %r, "rolling back a lease transaction");
                    }
                    Err(e)
                }
            }
        })
    }

    /// Applies `decide` to shard `shard`'s lease row, locked for the rest
    /// of the transaction (a commit's `shard_fence()` waits for it, and it
    /// for a commit in flight), and writes what it decides.
    fn update_lease(
        &self,
        shard: u16,
        decide: impl Fn(Option<&ShardLease>) -> Result<Option<ShardLease>>,
    ) -> Result<Option<ShardLease>> {
        let shared = &self.shared;
        let sql = &shared.sql;
        let row = i32::from(shard);
        self.in_transaction(|conn| {
            // A shard never taken gets its row first, so that two
            // processes taking it at once queue on the row's lock.
            conn.query(shared, &sql.lease_placeholder, &[&row])?;
            let current = conn
                .query(shared, &sql.lease_for_update, &[&row])?
                .first()
                .and_then(lease_of_row);
            let decided = decide(current.as_ref())?;
            if let Some(l) = &decided {
                conn.query(
                    shared,
                    &sql.lease_put,
                    &[&row, &l.owner, &(l.epoch as i64), &(l.expires_at.0 as i64)],
                )?;
            }
            Ok(decided)
        })
    }
}

/// The rules of [`crate::lease`], applied in transactions: a lease row is
/// locked while a process decides on it, and a commit's `shard_fence()`
/// holds it shared, so a takeover and a commit of the old owner are
/// ordered: the commit either comes first or is refused. Times are the
/// callers' clocks (the processes must agree within a small part of a
/// lease; the fence keeps the data safe if they do not).
impl ShardLeases for PgStore {
    fn take_shard_lease(
        &self,
        shard: u16,
        owner: &str,
        now: Timestamp,
        ttl_ms: u64,
    ) -> Result<ShardLease> {
        let taken = self.update_lease(shard, |current| {
            lease::decide_take(current, shard, owner, now, ttl_ms).map(Some)
        })?;
        Ok(taken.expect("a take decides a lease or fails"))
    }

    fn renew_shard_lease(
        &self,
        held: &ShardLease,
        now: Timestamp,
        ttl_ms: u64,
    ) -> Result<ShardLease> {
        let renewed = self.update_lease(held.shard, |current| {
            lease::decide_renew(current, held, now, ttl_ms).map(Some)
        })?;
        Ok(renewed.expect("a renewal decides a lease or fails"))
    }

    fn release_shard_lease(&self, held: &ShardLease, now: Timestamp) -> Result<()> {
        self.update_lease(held.shard, |current| {
            Ok(lease::decide_release(current, held, now))
        })
        .map(|_| ())
    }

    fn heartbeat_member(&self, owner: &str, now: Timestamp, ttl_ms: u64) -> Result<()> {
        let member = lease::decide_member(owner, now, ttl_ms)?;
        let shared = &self.shared;
        let gone_before = now.0.saturating_sub(ttl_ms) as i64;
        self.with_conn(|conn| {
            conn.query(
                shared,
                &shared.sql.member_put,
                &[&member.owner, &(member.expires_at.0 as i64)],
            )?;
            // Members gone for a whole lease more are forgotten.
            conn.query(shared, &shared.sql.member_purge, &[&gone_before])?;
            Ok(())
        })
    }

    fn members(&self) -> Result<Vec<Member>> {
        let shared = &self.shared;
        self.with_conn(|conn| {
            Ok(conn
                .query(shared, &shared.sql.member_all, &[])?
                .iter()
                .map(|r| Member {
                    owner: r.get(0),
                    expires_at: Timestamp(r.get::<_, i64>(1) as u64),
                })
                .collect())
        })
    }

    fn shard_leases(&self) -> Result<Vec<ShardLease>> {
        let shared = &self.shared;
        self.with_conn(|conn| {
            Ok(conn
                .query(shared, &shared.sql.lease_all, &[])?
                .iter()
                .filter_map(lease_of_row)
                .collect())
        })
    }

    /// The first process's count is inserted if no row is there; whatever
    /// row is there afterwards is the count every process must have.
    fn agree_shard_count(&self, shards: u16) -> Result<()> {
        let shared = &self.shared;
        let key = crate::keys::SHARD_COUNT_KEY;
        let mine = lease::encode_shard_count(shards)?;
        let recorded = self.with_conn(|conn| {
            conn.query(shared, &shared.sql.shard_count_put, &[&key, &mine])?;
            let rows = conn.query(shared, &shared.sql.shard_count_get, &[&key])?;
            Ok(rows.first().map(|r| r.get::<_, Vec<u8>>(0)))
        })?;
        let recorded = recorded
            .map(|bytes| lease::decode_shard_count(&bytes))
            .transpose()?;
        lease::decide_shard_count(recorded, shards).map(|_| ())
    }
}

/// Notes as rows of `relay`: taken with `for update skip locked`, so two
/// processes reading the same address never take the same note.
impl Relay for PgStore {
    fn relay_send(&self, notes: &[Note], now: Timestamp) -> Result<()> {
        notes.iter().try_for_each(relay::check_note)?;
        if notes.is_empty() {
            return Ok(());
        }
        let dests: Vec<String> = notes.iter().map(|n| n.to.key()).collect();
        let ats: Vec<i64> = vec![now.0 as i64; notes.len()];
        let bodies: Vec<&[u8]> = notes.iter().map(|n| n.body.as_slice()).collect();
        let shared = &self.shared;
        self.with_conn(|conn| {
            conn.query(shared, &shared.sql.relay_put, &[&dests, &ats, &bodies])?;
            Ok(())
        })
    }

    fn relay_take(&self, to: &[RelayTo], max: usize) -> Result<Vec<Note>> {
        let dests: Vec<String> = to.iter().map(RelayTo::key).collect();
        let limit = max as i64;
        let shared = &self.shared;
        let mut rows: Vec<(i64, Note)> = self.with_conn(|conn| {
            Ok(conn
                .query(shared, &shared.sql.relay_take, &[&dests, &limit])?
                .iter()
                .filter_map(|r| {
                    let to = RelayTo::parse(r.get::<_, &str>(1))?;
                    Some((r.get::<_, i64>(0), Note { to, body: r.get(2) }))
                })
                .collect())
        })?;
        rows.sort_by_key(|(id, _)| *id);
        Ok(rows.into_iter().map(|(_, n)| n).collect())
    }

    fn relay_forget(&self, before: Timestamp) -> Result<u64> {
        let shared = &self.shared;
        let before = before.0 as i64;
        self.with_conn(|conn| {
            let st = conn.statement(shared, &shared.sql.relay_forget)?;
            block(conn.client.execute(&st, &[&before])).map_err(|e| shared.error(&e))
        })
    }

    /// A connection of its own `LISTEN`s on the relay's channel and passes
    /// each notice on; when it fails it connects again after
    /// [`PG_LISTEN_RETRY_MS`], and it ends once the notices' reader is gone.
    fn relay_listen(&self) -> Option<RelayNotices> {
        let runtime = self.shared.runtime.as_ref()?;
        let (tx, rx) = crossbeam_channel::bounded(relay::RELAY_NOTICES_QUEUED_MAX);
        let config = self.shared.config.clone();
        let tls = self.shared.tls.clone();
        let channel = relay_channel(&self.shared.schema);
        runtime.spawn(async move {
            loop {
                match listen(&config, tls.clone(), &channel, &tx).await {
                    Ok(Listening::ReaderGone) => return,
                    Ok(Listening::Closed) => debug!("the relay's listening connection closed"),
                    Ok(Listening::Unanswered) => {
                        debug!(
                            "the server did not complete the relay's listening connection in time"
                        )
                    }
                    Err(e) => {
                        debug!(error = %describe(&e), "the relay's listening connection failed")
                    }
                }
                tokio::time::sleep(Duration::from_millis(PG_LISTEN_RETRY_MS)).await;
            }
        });
        Some(rx)
    }
}

/// How one listening connection ended.
enum Listening {
    /// Nobody reads the notices any more.
    ReaderGone,
    /// The server closed the connection.
    Closed,
    /// The connection was not made, or its `LISTEN` not answered, within
    /// its limit ([`connect_limit`]).
    Unanswered,
}

/// Listens on `channel` over a new connection until it ends, passing the
/// payload of every notification (a note's address) to `to`.
async fn listen(
    config: &tokio_postgres::Config,
    tls: Tls,
    channel: &str,
    to: &crossbeam_channel::Sender<String>,
) -> std::result::Result<Listening, tokio_postgres::Error> {
    use futures::StreamExt;
    let Ok(connected) =
        tokio::time::timeout(connect_limit(config), pg_tls::connect(config, tls)).await
    else {
        return Ok(Listening::Unanswered);
    };
    let (client, mut connection) = connected?;
    let to = to.clone();
    // The connection must be polled for the `listen` below to be answered,
    // and for the notifications after it.
    let messages = tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message? {
                if !relay::notify(&to, n.payload().to_string()) {
                    return Ok(Listening::ReaderGone);
                }
            }
        }
        Ok::<_, tokio_postgres::Error>(Listening::Closed)
    });
    let statement = format!("listen \"{channel}\"");
    let listen = client.batch_execute(&statement);
    let Ok(listening) = tokio::time::timeout(connect_limit(config), listen).await else {
        messages.abort();
        return Ok(Listening::Unanswered);
    };
    listening?;
    let ended = messages.await.unwrap_or(Ok(Listening::Closed));
    drop(client);
    ended
}

/// A `shard_lease` row (shard, owner, epoch, expires_at_ms) as a lease;
/// `None` for the row of a shard never taken (no owner).
fn lease_of_row(r: &tokio_postgres::Row) -> Option<ShardLease> {
    let owner: String = r.get(1);
    (!owner.is_empty()).then(|| ShardLease {
        shard: r.get::<_, i32>(0) as u16,
        owner,
        epoch: r.get::<_, i64>(2) as u64,
        expires_at: Timestamp(r.get::<_, i64>(3) as u64),
    })
}

/// Shard `shard`'s lease epoch now, `None` if it was never taken.
fn shard_epoch(shared: &Shared, conn: &Conn, shard: u16) -> Result<Option<u64>> {
    Ok(conn
        .query(shared, &shared.sql.shard_epoch, &[&i32::from(shard)])?
        .first()
        .map(|r| r.get::<_, i64>(0) as u64)
        .filter(|epoch| *epoch > 0))
}

/// Keys and values of one table, as two arrays to bind.
type Columns = (Vec<Vec<u8>>, Vec<Vec<u8>>);

/// The group's rows, as arrays per table, ready to bind.
#[derive(Default)]
struct Rows {
    puts: Vec<Columns>,
    deletes: Vec<Vec<Vec<u8>>>,
    event_runs: Vec<Vec<u8>>,
    event_seqs: Vec<i64>,
    event_values: Vec<Vec<u8>>,
}

impl Rows {
    fn of(writes: &Writes) -> Self {
        let mut rows = Rows {
            puts: vec![(Vec::new(), Vec::new()); Cf::ALL.len()],
            deletes: vec![Vec::new(); Cf::ALL.len()],
            ..Rows::default()
        };
        for ((cf, k), v) in writes {
            match (cf, v) {
                (Cf::Events, Some(v)) => {
                    if let Some((run, seq)) = event_key_parts(k) {
                        rows.event_runs.push(run.to_vec());
                        rows.event_seqs.push(seq);
                        rows.event_values.push(v.clone());
                    }
                }
                (cf, Some(v)) => {
                    rows.puts[cf.index()].0.push(k.clone());
                    rows.puts[cf.index()].1.push(v.clone());
                }
                (cf, None) => rows.deletes[cf.index()].push(k.clone()),
            }
        }
        rows
    }
}

/// What a statement of a group's transaction binds.
enum Bind {
    Fence,
    ShardFence,
    Events,
    Put(usize),
    Delete(usize),
}

/// What became of a group's transaction.
enum Written {
    Committed,
    /// The server refused it: nothing was written.
    Refused(Error),
    /// The connection broke with the transaction in flight.
    Unknown(Error),
}

/// A group's transaction once sent: its statements are on their way (or
/// done), the answer is read by polling.
type WriteFuture = Pin<Box<dyn Future<Output = Option<tokio_postgres::Error>>>>;

/// Prepares the transaction writing `writes` under the database's write
/// lease or, on a sharded store, under `fence`, and sends it: every
/// statement, `begin` to `commit`, goes out at once (pipelined), and the
/// returned future yields the first error, if any. Polled once here with
/// `waker`, which is woken when there is more to read.
fn start_write(
    shared: &Shared,
    conn: &Arc<Conn>,
    writes: &Writes,
    fence: Option<Fence>,
    waker: &Waker,
) -> Result<(WriteFuture, Option<Option<tokio_postgres::Error>>)> {
    let rows = Rows::of(writes);
    let sql = &shared.sql;
    let mut plan: Vec<(Statement, Bind)> = Vec::new();
    // First: the lease is still ours, and stays so until the commit.
    if shared.sharded {
        plan.push((conn.statement(shared, &sql.shard_fence)?, Bind::ShardFence));
    } else {
        plan.push((conn.statement(shared, &sql.fence)?, Bind::Fence));
    }
    if !rows.event_runs.is_empty() {
        plan.push((conn.statement(shared, &sql.event_put)?, Bind::Events));
    }
    for cf in Cf::ALL {
        let i = cf.index();
        if !rows.puts[i].0.is_empty() {
            plan.push((conn.statement(shared, &sql.put[i])?, Bind::Put(i)));
        }
        if !rows.deletes[i].is_empty() {
            plan.push((conn.statement(shared, &sql.delete[i])?, Bind::Delete(i)));
        }
    }
    let epoch = shared.epoch.load(Ordering::Acquire);
    let owner = shared.owner.clone();
    let (fence_shard, fence_epoch) = fence.map_or((0, 0), |f| (i32::from(f.shard), f.epoch as i64));
    // keel never leaves a transaction open between its statements, but a
    // process paused mid-commit would: its `fence()` share lock would hold
    // off the takeover for as long as it stays paused. The server ends
    // such a transaction after one lease, so a takeover waits at most that
    // long (and the paused commit is rolled back, not written). Set per
    // transaction rather than as a startup option, which poolers refuse.
    let begin_sql = format!(
        "begin; set local idle_in_transaction_session_timeout = {}",
        shared.lease_ms
    );
    let conn = conn.clone();
    let mut future: WriteFuture = Box::pin(async move {
        let params: Vec<Vec<&(dyn ToSql + Sync)>> = plan
            .iter()
            .map(|(_, bind)| -> Vec<&(dyn ToSql + Sync)> {
                match bind {
                    Bind::Fence => vec![&epoch, &owner],
                    Bind::ShardFence => vec![&fence_shard, &fence_epoch],
                    Bind::Events => vec![&rows.event_runs, &rows.event_seqs, &rows.event_values],
                    Bind::Put(i) => vec![&rows.puts[*i].0, &rows.puts[*i].1],
                    Bind::Delete(i) => vec![&rows.deletes[*i]],
                }
            })
            .collect();
        let client = &conn.client;
        // The first poll sends all three in this order: the driver queues
        // a request before it first waits for its answer.
        let begin = client.batch_execute(&begin_sql);
        let writes = futures::future::join_all(
            plan.iter()
                .zip(&params)
                .map(|((st, _), p)| client.execute(st, p.as_slice())),
        );
        let commit = client.batch_execute("commit");
        let (begin, writes, commit) = futures::join!(begin, writes, commit);
        begin
            .err()
            .into_iter()
            .chain(writes.into_iter().filter_map(|r| r.err()))
            .chain(commit.err())
            .next()
    });
    let first = match future.as_mut().poll(&mut Context::from_waker(waker)) {
        Poll::Ready(done) => Some(done),
        Poll::Pending => None,
    };
    Ok((future, first))
}

/// What the first error of a group's transaction (`None`: it committed)
/// means for the group.
fn outcome_of(
    shared: &Shared,
    conn: &Conn,
    first_error: Option<tokio_postgres::Error>,
    fence: Option<Fence>,
) -> Written {
    match first_error {
        None => Written::Committed,
        Some(e) if e.code().is_some_and(|c| c.code() == SHARD_FENCED_SQLSTATE) => {
            // The transaction was rolled back: the connection is usable.
            let (shard, epoch) = fence.map_or((0, 0), |f| (f.shard, f.epoch));
            let current = shard_epoch(shared, conn, shard).ok().flatten();
            Written::Refused(Error::Fenced {
                shard,
                epoch,
                current,
            })
        }
        Some(e) if e.code().is_some_and(|c| c.code() == FENCED_SQLSTATE) => {
            let detail = describe(&e);
            shared.fenced(detail.clone());
            Written::Refused(Error::Unwritable {
                fault: WriteFault::Fenced,
                detail,
            })
        }
        Some(e) if e.code().is_some() && !conn.client.is_closed() => {
            // A statement failed: the transaction was aborted and its
            // `commit` rolled it back.
            Written::Refused(shared.error(&e))
        }
        Some(e) => Written::Unknown(shared.error(&e)),
    }
}

/// After the connection broke mid-transaction: reconnects (taking the
/// writer lock again) and reads back the group's first row to learn
/// whether the transaction committed. `None` when that could not be
/// learned within [`PG_RECONNECT_MS_MAX`].
fn resolve(shared: &Shared, writes: &Writes) -> (Option<Conn>, Option<bool>) {
    let deadline = std::time::Instant::now() + Duration::from_millis(PG_RECONNECT_MS_MAX);
    loop {
        match reconnect(shared) {
            Ok(conn) => {
                let view = ConnView {
                    shared,
                    conn: &conn,
                };
                let probe = writes
                    .iter()
                    .find(|((cf, _), v)| *cf == Cf::Events && v.is_some())
                    .or_else(|| writes.iter().next());
                let known = match probe {
                    None => Ok(true),
                    Some(((cf, k), Some(v))) => view.get(*cf, k).map(|got| got.as_ref() == Some(v)),
                    Some(((cf, k), None)) => view.get(*cf, k).map(|got| got.is_none()),
                };
                match known {
                    Ok(k) => return (Some(conn), Some(k)),
                    Err(e) => warn!(error = %e, "reading back a commit of unknown outcome failed"),
                }
            }
            Err(e) => debug!(error = %e, "reconnecting"),
        }
        if std::time::Instant::now() >= deadline {
            return (None, None);
        }
        std::thread::sleep(Duration::from_millis(PG_RECONNECT_PAUSE_MS));
    }
}

/// A new writer connection holding the writer lock. A failure to connect
/// stops the store's commits ([`WriteFault::Unreachable`]) until a later
/// call succeeds.
fn reconnect(shared: &Shared) -> Result<Conn> {
    let conn = match shared.connect() {
        Ok(c) => c,
        Err(e) => {
            if let Error::Database {
                fault: DatabaseFault::Unreachable,
                detail,
                ..
            } = &e
            {
                shared.unreachable(detail.clone());
            }
            return Err(e);
        }
    };
    shared.reachable();
    if shared.durability == Durability::Buffered {
        block(conn.client.batch_execute("set synchronous_commit = off"))
            .map_err(|e| shared.error(&e))?;
    }
    Ok(conn)
}

/// Whether `e` is a connection lost (nothing known to be written by it).
fn is_lost(e: &Error) -> bool {
    matches!(
        e,
        Error::Database {
            fault: DatabaseFault::Lost,
            ..
        }
    )
}

/// A group as the writer builds it: its commits, each one's answer so far,
/// and the rows they write. Each commit is validated as it is taken, over
/// the store, the writer's cache, the rows read ahead for the group and,
/// while another group is in flight, that group's writes.
struct Group {
    requests: Vec<Request>,
    results: Vec<Result<CommitAck>>,
    writes: Writes,
    ahead: ReadAhead,
    scans: ScanAhead,
    bytes: usize,
    fence: Option<Fence>,
    /// A read failed while validating (the connection broke), or the
    /// writes validated under did not commit: validate again before
    /// writing.
    stale: bool,
    /// The writer's [`Writer::generation`] the group was validated in
    /// (`None`: not yet); another one at the time of writing means the
    /// store it was validated against may not be the one written to.
    generation: Option<u64>,
}

impl Group {
    fn new(fence: Option<Fence>) -> Self {
        Group {
            requests: Vec::new(),
            results: Vec::new(),
            writes: Writes::new(),
            ahead: ReadAhead::new(),
            scans: ScanAhead::new(),
            bytes: 0,
            fence,
            stale: false,
            generation: None,
        }
    }

    fn is_full(&self) -> bool {
        self.requests.len() >= GROUP_COMMITS_MAX || self.bytes >= GROUP_COMMIT_BYTES_MAX
    }

    /// Answers every commit: with its own result, or with the group's
    /// write error if it had none.
    fn reply(self, written: Result<()>) {
        crate::store::answering(|| {
            for (req, result) in self.requests.into_iter().zip(self.results) {
                let result = match (&written, result) {
                    (Err(e @ (Error::Database { .. } | Error::Fenced { .. })), Ok(_)) => {
                        Err(e.clone_shallow())
                    }
                    (Err(e), Ok(_)) => Err(Error::CommitFailed(e.to_string())),
                    (_, r) => r,
                };
                req.reply.send(result);
            }
        });
    }

    /// Answers every commit with `e`, nothing written.
    fn refuse(self, e: &Error) {
        let (group, written) = self.refused(e);
        group.reply(written);
    }

    /// The group with every commit's answer set to `e`, nothing written.
    fn refused(mut self, e: &Error) -> (Group, Result<()>) {
        self.results = self
            .requests
            .iter()
            .map(|_| Err(e.clone_shallow()))
            .collect();
        (self, Ok(()))
    }
}

/// Most commits the writer holds back because their fence is not the one
/// of the group it is filling; the queue is not read further while this
/// many wait.
pub const PG_HELD_COMMITS_MAX: usize = GROUP_COMMITS_MAX;

/// Commits taken from the queue under another fence than the group being
/// filled, in the order they came. All of them came before anything still
/// queued, so a group that takes its fence's held commits before the
/// queue's keeps every run's commits in order (a run's commits share its
/// shard's fence).
#[derive(Default)]
struct Held(VecDeque<Request>);

impl Held {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn is_full(&self) -> bool {
        self.0.len() >= PG_HELD_COMMITS_MAX
    }

    /// The oldest held commit: the first of the next group.
    fn pop_front(&mut self) -> Option<Request> {
        self.0.pop_front()
    }

    fn push(&mut self, r: Request) {
        self.0.push_back(r);
    }

    /// Takes the held commits under `fence`, oldest first, while `fits`
    /// says the group has room for the next one; one pass.
    fn take(
        &mut self,
        fence: Option<Fence>,
        mut fits: impl FnMut(&Request) -> bool,
    ) -> Vec<Request> {
        if !self.0.iter().any(|r| r.fence == fence) {
            return Vec::new();
        }
        let mut taken = Vec::new();
        let mut room = true;
        let mut kept = VecDeque::with_capacity(self.0.len());
        for r in self.0.drain(..) {
            if room && r.fence == fence {
                room = fits(&r);
                if room {
                    taken.push(r);
                    continue;
                }
            }
            kept.push_back(r);
        }
        self.0 = kept;
        taken
    }
}

/// Takes the commits that fit in `group` behind `first`: those of its
/// fence held back, oldest first, then those queued; a queued commit under
/// another fence is held for a later group. `first` must be the oldest
/// commit of its fence not yet in a group.
fn take_queued(
    rx: &Receiver<Request>,
    held: &mut Held,
    group: &Group,
    first: Request,
) -> Vec<Request> {
    let mut count = group.requests.len() + 1;
    let mut bytes = group.bytes + first.prepared.bytes();
    let mut out = vec![first];
    let fits =
        |count: usize, bytes: usize| count < GROUP_COMMITS_MAX && bytes < GROUP_COMMIT_BYTES_MAX;
    out.extend(held.take(group.fence, |r| {
        let room = fits(count, bytes);
        if room {
            count += 1;
            bytes += r.prepared.bytes();
        }
        room
    }));
    while fits(count, bytes) && !held.is_full() {
        match rx.try_recv() {
            Ok(r) if r.fence != group.fence => held.push(r),
            Ok(r) => {
                count += 1;
                bytes += r.prepared.bytes();
                out.push(r);
            }
            Err(_) => break,
        }
    }
    out
}

/// A group whose transaction was sent.
struct Flight {
    group: Group,
    future: WriteFuture,
    /// The first error, once the transaction is done.
    done: Option<Option<tokio_postgres::Error>>,
    /// When it was sent (its round trips and WAL flush are timed).
    sent: std::time::Instant,
}

impl Flight {
    /// Whether the transaction is done; reads what arrived, `waker` is
    /// woken when more does.
    fn poll(&mut self, waker: &Waker) -> bool {
        if self.done.is_none() {
            if let Poll::Ready(first) = self.future.as_mut().poll(&mut Context::from_waker(waker)) {
                self.done = Some(first);
            }
        }
        self.done.is_some()
    }
}

/// What sending a group came to.
enum Sent {
    /// Its transaction is on its way.
    Flight(Flight),
    /// Nothing was sent: answer the group so.
    Answer((Group, Result<()>)),
}

impl Sent {
    /// The flight; a group answered at once is answered here.
    fn flight(self) -> Option<Flight> {
        match self {
            Sent::Flight(f) => Some(f),
            Sent::Answer((group, written)) => {
                group.reply(written);
                None
            }
        }
    }
}

/// What landing a flight came to.
enum Landed {
    /// Committed or not, known: answer the group so.
    Done(Group, Result<()>),
    /// The connection broke and the read-back found the transaction not
    /// written: the group may be validated and written again.
    Retry(Group, Error),
}

/// Wakes the writer thread when a transaction in flight has more to read.
struct ChannelWaker(Sender<()>);

impl futures::task::ArcWake for ChannelWaker {
    fn wake_by_ref(this: &Arc<Self>) {
        let _ = this.0.try_send(());
    }
}

/// The writer thread: takes commits from the queue, validates them in
/// groups (with the shared validation of `derive`) and writes each group
/// in one transaction.
///
/// Groups are pipelined two deep. While one group's transaction is in
/// flight (its statements executing, its commit waiting for the WAL
/// flush), the next group is taken and validated over the first's writes,
/// its reads going through a second connection; once the first is known
/// committed, the next is sent at once and then the first's committers are
/// answered (a group the writer answers without sending is answered after
/// them, in the order the commits were taken). If the first did not commit, or the
/// writer's connection or cache changed since (a new `generation`: the
/// server may have restarted), the next is validated again from the store
/// before it is written: a group is only ever written over a store that
/// holds what it was validated against.
struct Writer<'a> {
    shared: &'a Shared,
    conn: Option<Arc<Conn>>,
    /// Reads for validating the next group while the writer's connection
    /// has a transaction in flight.
    reader: Option<Arc<Conn>>,
    cache: WriterCache,
    /// Counts what makes earlier validation unsure: a new connection (the
    /// server may have restarted and, with buffered durability, lost
    /// commits, or failed over to a standby behind it) and a forgotten
    /// cache. A group is written only in the generation it was validated
    /// in.
    generation: u64,
    waker: Waker,
    woken: Receiver<()>,
}

impl Writer<'_> {
    /// Empties the cache; what was validated with it is validated again.
    fn forget(&mut self) {
        self.cache.forget();
        self.shared.stats.cache_holds(0);
        self.generation += 1;
    }

    /// The writer's connection, reconnecting if it broke (which empties
    /// the cache: the server may have restarted and, with buffered
    /// durability, lost commits the cache remembers).
    fn conn(&mut self) -> Result<Arc<Conn>> {
        if let Some(c) = self.conn.as_ref().filter(|c| !c.client.is_closed()) {
            return Ok(c.clone());
        }
        let c = Arc::new(reconnect(self.shared)?);
        self.forget();
        self.conn = Some(c.clone());
        Ok(c)
    }

    /// The connection for reads beside a transaction in flight.
    fn reader(&mut self) -> Result<Arc<Conn>> {
        if let Some(c) = self.reader.as_ref().filter(|c| !c.client.is_closed()) {
            return Ok(c.clone());
        }
        if self.reader.is_some() {
            // A new reader: what the old one read may predate a restart.
            self.generation += 1;
        }
        let c = Arc::new(self.shared.connect()?);
        self.reader = Some(c.clone());
        Ok(c)
    }

    /// Validates `batch` into `group`, reading through `conn`, over
    /// `prior` (the writes of the group in flight, if any).
    fn check(&mut self, use_reader: bool, group: &mut Group, batch: Vec<Request>, prior: &Writes) {
        if group.requests.is_empty() && self.shared.sharded {
            // Other processes write too: what this writer learned from its
            // own writes may be out of date (a shard it held was taken
            // over).
            self.forget();
        }
        let conn = if use_reader {
            self.reader()
        } else {
            self.conn()
        };
        let fail = |group: &mut Group, batch: Vec<Request>, e: &Error| {
            // A failed read on the second connection says nothing of the
            // writer's: those commits are validated again there.
            group.stale |= use_reader || is_lost(e);
            for req in batch {
                group.bytes += req.prepared.bytes();
                group.results.push(Err(e.clone_shallow()));
                group.requests.push(req);
            }
        };
        let conn = match conn {
            Ok(c) => c,
            Err(e) => return fail(group, batch, &e),
        };
        // After the connection: taking it may have started a generation.
        match group.generation {
            None => group.generation = Some(self.generation),
            Some(g) if g != self.generation => group.stale = true,
            Some(_) => {}
        }
        let conn = &*conn;
        let view = ConnView {
            shared: self.shared,
            conn,
        };
        if let (Some(fence), true) = (group.fence, group.requests.is_empty()) {
            // A process that lost the shard learns it as such, not as a
            // validation error against the new owner's writes. The check
            // in the transaction stays the one that counts.
            match shard_epoch(self.shared, conn, fence.shard) {
                Ok(current) if current == Some(fence.epoch) => {}
                Ok(current) => {
                    let fenced = Error::Fenced {
                        shard: fence.shard,
                        epoch: fence.epoch,
                        current,
                    };
                    return fail(group, batch, &fenced);
                }
                Err(e) => return fail(group, batch, &e),
            }
        }
        if let Some(Err(fenced @ Error::Fenced { .. })) = group.results.first() {
            // The group's shard was found lost: so are its later commits.
            let fenced = fenced.clone_shallow();
            return fail(group, batch, &fenced);
        }
        // What validation reads for certain, in one round trip; most of
        // the rest is known from this writer's own writes.
        let mut wanted = self.cache.wanted(batch.iter().map(|r| &r.prepared));
        for (cf, keys) in wanted.iter_mut() {
            keys.retain(|k| {
                let key = (*cf, k.clone());
                !group.ahead.contains_key(&key) && !prior.contains_key(&key)
            });
        }
        wanted.retain(|_, keys| !keys.is_empty());
        let mut scans = self.cache.scans_wanted(batch.iter().map(|r| &r.prepared));
        scans.retain(|s| !group.scans.contains_key(s));
        if !wanted.is_empty() || !scans.is_empty() {
            match view.read_ahead(&wanted, &scans) {
                Ok((ahead, scanned)) => {
                    group.ahead.extend(ahead);
                    group.scans.extend(scanned);
                }
                Err(e) => return fail(group, batch, &e),
            }
        }
        let cached = CachedView {
            base: &view,
            cache: &self.cache,
            ahead: &group.ahead,
            scans: &group.scans,
        };
        let under = Overlay::over(&cached, prior);
        let mut overlay = Overlay::with(&under, std::mem::take(&mut group.writes));
        for req in batch {
            match apply_batch_checked(&overlay, &req.prepared, Checks::ALL) {
                Ok((writes, ack)) => {
                    overlay.absorb(writes);
                    group.results.push(Ok(ack));
                }
                Err(e) => {
                    // A database error on the second connection (a
                    // statement timeout, say) says nothing of the
                    // commit: it is validated again on the writer's.
                    group.stale |=
                        (use_reader && matches!(e, Error::Database { .. })) || is_lost(&e);
                    group.results.push(Err(e));
                }
            }
            group.bytes += req.prepared.bytes();
            group.requests.push(req);
        }
        group.writes = overlay.into_writes();
    }

    /// Validates `group` again from the store alone, on the writer's
    /// connection (a second try on a fresh one if it broke).
    fn recheck(&mut self, group: Group) -> Group {
        let Group {
            mut requests,
            fence,
            ..
        } = group;
        let mut tries_left = 2;
        loop {
            tries_left -= 1;
            let mut fresh = Group::new(fence);
            self.check(
                false,
                &mut fresh,
                std::mem::take(&mut requests),
                &Writes::new(),
            );
            if !fresh.stale || tries_left == 0 {
                // Still stale after the second try: what validated is
                // written, the commits whose reads failed are refused.
                fresh.stale = false;
                return fresh;
            }
            self.conn = None;
            requests = fresh.requests;
        }
    }

    /// Sends `group`'s transaction; or, when there is nothing to write or
    /// it cannot be sent, the answer the group is to hear (the caller
    /// answers, keeping the committers' order).
    fn send(&mut self, mut group: Group) -> Sent {
        if let Some(e) = self.shared.health.get().error() {
            // Fenced (nothing is written any more), or the database out of
            // reach (answered at once).
            return Sent::Answer(group.refused(&e));
        }
        let mut tries_left = 2;
        loop {
            tries_left -= 1;
            if group.stale || group.generation != Some(self.generation) {
                group = self.recheck(group);
            }
            let conn = match self.conn() {
                Ok(c) => c,
                Err(e) if is_lost(&e) && tries_left > 0 => continue,
                Err(e) => {
                    return Sent::Answer(group.refused(&e));
                }
            };
            if group.generation != Some(self.generation) {
                // A new connection since the group was validated (taking
                // one just now may have started a generation).
                if tries_left > 0 {
                    group.stale = true;
                    continue;
                }
                let e = self.shared.fault(
                    DatabaseFault::Lost,
                    "the connection to the database kept breaking while the commits were validated",
                );
                return Sent::Answer(group.refused(&e));
            }
            if group.writes.is_empty() {
                return Sent::Answer((group, Ok(())));
            }
            match start_write(self.shared, &conn, &group.writes, group.fence, &self.waker) {
                Ok((future, done)) => {
                    return Sent::Flight(Flight {
                        group,
                        future,
                        done,
                        sent: std::time::Instant::now(),
                    })
                }
                // Preparing failed on a broken connection: nothing was
                // sent for this group.
                Err(e) if is_lost(&e) && tries_left > 0 => {
                    self.conn = None;
                    group.stale = true;
                }
                Err(e) => {
                    self.forget();
                    return Sent::Answer((group, Err(e)));
                }
            }
        }
    }

    /// Waits for `flight`'s transaction and learns its outcome (reading it
    /// back after a broken connection).
    fn land(&mut self, mut flight: Flight) -> Landed {
        while !flight.poll(&self.waker) {
            let _ = self.woken.recv();
        }
        let first_error = flight.done.take().expect("polled to the end");
        let took = flight.sent.elapsed();
        let group = flight.group;
        let conn = self.conn.clone().expect("a flight has a connection");
        let written = match outcome_of(self.shared, &conn, first_error, group.fence) {
            Written::Committed => Ok(()),
            Written::Refused(e) => Err(e),
            Written::Unknown(e) => {
                warn!(error = %e, "connection lost with a commit in flight; finding out whether it committed");
                let (fresh, known) = resolve(self.shared, &group.writes);
                self.conn = fresh.map(Arc::new);
                // A new connection: see `conn`. Only this group's
                // read-back is learned from here.
                self.forget();
                match known {
                    Some(true) => Ok(()),
                    Some(false) => return Landed::Retry(group, e),
                    None => Err(Error::Database {
                        target: self.shared.target.clone(),
                        fault: DatabaseFault::Lost,
                        detail: format!(
                            "{e}; whether the commit was written is unknown (the database stayed out of reach for {PG_RECONNECT_MS_MAX} ms); the engine reloads the run from the database before going on"
                        ),
                    }),
                }
            }
        };
        match &written {
            Ok(()) => {
                let accepted = group
                    .requests
                    .iter()
                    .zip(&group.results)
                    .filter(|(_, r)| r.is_ok())
                    .map(|(req, _)| &req.prepared);
                self.cache.learn(Learned::of(&group.writes, accepted));
                self.shared.stats.cache_holds(self.cache.bytes());
                let ok = group.results.iter().filter(|r| r.is_ok()).count();
                self.shared
                    .stats
                    .group(ok, group.results.len() - ok, Some(took));
            }
            Err(_) => {
                self.forget();
                self.shared.stats.group(0, group.results.len(), Some(took));
            }
        }
        Landed::Done(group, written)
    }

    /// Validates and writes once more a group whose transaction was found
    /// not written after a broken connection, and answers it.
    fn retry(&mut self, group: Group, first: Error) {
        let group = self.recheck(group);
        if let Some(flight) = self.send(group).flight() {
            match self.land(flight) {
                Landed::Done(group, written) => group.reply(written),
                Landed::Retry(group, _) => group.reply(Err(first)),
            }
        }
    }

    /// Renews the lease through the writer's connection (reconnecting
    /// first if it broke); marks the store fenced when the lease is gone.
    fn renew(&mut self) {
        let c = match self.conn() {
            Ok(c) => c,
            Err(e) => {
                debug!(error = %e, "cannot reach the database to renew the write lease");
                return;
            }
        };
        if self.shared.sharded {
            return; // no database-wide lease: each shard's is its engine's
        }
        match renew_lease(self.shared, &c) {
            Ok(true) => {}
            Ok(false) => self.shared.fenced(format!(
                "the write lease of epoch {} was taken over by another process",
                self.shared.epoch.load(Ordering::Acquire)
            )),
            Err(e) => warn!(error = %e, "renewing the write lease failed"),
        }
    }
}

fn writer_loop(shared: &Shared, conn: Conn, rx: Receiver<Request>) {
    let renew_every = Duration::from_millis(shared.lease_ms / 5);
    let mut renewed = std::time::Instant::now();
    let mut last_reconnect = renewed;
    let (wake, woken) = crossbeam_channel::bounded(1);
    let mut w = Writer {
        shared,
        conn: Some(Arc::new(conn)),
        reader: None,
        cache: WriterCache::default(),
        generation: 0,
        waker: futures::task::waker(Arc::new(ChannelWaker(wake))),
        woken,
    };
    let never = crossbeam_channel::never::<Request>();
    // Commits under another fence than the group being filled.
    let mut held = Held::default();
    let mut flight: Option<Flight> = None;
    let mut closed = false;
    loop {
        // Renewing is also how a store stopped by an unreachable database
        // finds it back.
        let health = shared.health.get();
        let due = renewed.elapsed() >= renew_every && !health.is_failed();
        let Some(mut in_flight) = flight.take() else {
            if closed && held.is_empty() {
                break;
            }
            if due {
                renewed = std::time::Instant::now();
                w.renew();
            }
            // Idle: wait for a commit, renewing the lease meanwhile (a
            // failed store renews nothing: it only answers).
            let wait = if health.is_failed() {
                renew_every
            } else {
                renew_every.saturating_sub(renewed.elapsed())
            };
            let first = match held.pop_front() {
                Some(r) => r,
                None => match rx.recv_timeout(wait) {
                    Ok(r) => r,
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                },
            };
            let health = shared.health.get();
            if health.error().is_some()
                && !health.is_failed()
                && last_reconnect.elapsed() >= Duration::from_millis(PG_RECONNECT_PAUSE_MS)
            {
                // The database was out of reach: a commit is a reason to
                // try it now rather than at the next renewal.
                last_reconnect = std::time::Instant::now();
                renewed = last_reconnect;
                w.renew();
            }
            let mut group = Group::new(first.fence);
            let batch = take_queued(&rx, &mut held, &group, first);
            if let Some(e) = shared.health.get().error() {
                // Fenced (nothing is written any more), or the database
                // still out of reach (answered at once).
                group.requests = batch;
                group.refuse(&e);
                continue;
            }
            w.check(false, &mut group, batch, &Writes::new());
            flight = w.send(group).flight();
            continue;
        };
        // A group in flight: take and validate the next as its commits
        // arrive, until the transaction is done.
        let mut next: Option<Group> = None;
        let span = info_span!("commit", commits = in_flight.group.requests.len());
        let _enter = span.enter();
        loop {
            if in_flight.poll(&w.waker) {
                break;
            }
            if next.is_none() {
                // Commits held back start the next group, before any
                // queued after them.
                if let Some(first) = held.pop_front() {
                    let mut group = Group::new(first.fence);
                    let batch = take_queued(&rx, &mut held, &group, first);
                    w.check(true, &mut group, batch, &in_flight.group.writes);
                    next = Some(group);
                }
            }
            let taking = !closed && !held.is_full() && !next.as_ref().is_some_and(Group::is_full);
            crossbeam_channel::select! {
                recv(if taking { &rx } else { &never }) -> r => match r {
                    Ok(r) => {
                        let group = next.get_or_insert_with(|| Group::new(r.fence));
                        if r.fence != group.fence {
                            held.push(r);
                            continue;
                        }
                        let batch = take_queued(&rx, &mut held, group, r);
                        w.check(true, group, batch, &in_flight.group.writes);
                    }
                    Err(_) => closed = true,
                },
                recv(w.woken) -> _ => {}
            }
        }
        drop(_enter);
        let (answer, committed) = match w.land(in_flight) {
            Landed::Done(group, written) => {
                let committed = written.is_ok();
                (Some((group, written)), committed)
            }
            Landed::Retry(group, first) => {
                w.retry(group, first);
                (None, false)
            }
        };
        if due {
            renewed = std::time::Instant::now();
            w.renew();
        }
        let sent = next.map(|mut group| {
            // Validated over the writes of the group that just landed:
            // that holds only if they committed.
            group.stale |= !committed;
            w.send(group)
        });
        // The next group went out first (answering wakes many committers,
        // which then compete with the writer for the cores); the answers
        // keep the order the commits were taken in (a run's commits
        // follow each other through the groups).
        if let Some((group, written)) = answer {
            group.reply(written);
        }
        flight = sent.and_then(Sent::flight);
    }
    // Closed: hand the lease on at once rather than let it run out.
    if shared.health.get().is_healthy() && !shared.sharded {
        if let Some(c) = w.conn.as_ref().filter(|c| !c.client.is_closed()) {
            if let Err(e) = release_lease(shared, c) {
                debug!(error = %e, "releasing the write lease");
            }
        }
    }
}

impl Error {
    /// A copy of a database error for answering many committers with it.
    fn clone_shallow(&self) -> Error {
        match self {
            Error::Database {
                target,
                fault,
                detail,
            } => Error::Database {
                target: target.clone(),
                fault: *fault,
                detail: detail.clone(),
            },
            Error::DatabaseLocked { target, detail } => Error::DatabaseLocked {
                target: target.clone(),
                detail: detail.clone(),
            },
            Error::Fenced {
                shard,
                epoch,
                current,
            } => Error::Fenced {
                shard: *shard,
                epoch: *epoch,
                current: *current,
            },
            Error::Unwritable { fault, detail } => Error::Unwritable {
                fault: *fault,
                detail: detail.clone(),
            },
            other => Error::CommitFailed(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A commit of `run` (its first event) under `fence`.
    fn request(run: u64, fence: Option<Fence>) -> Request {
        let batch = crate::CommitBatch::append(
            crate::RunId::from_u64_pair(run, 1),
            vec![crate::Event {
                seq: crate::Seq(1),
                at: Timestamp(1),
                kind: crate::EventKind::WorkflowCompleted {
                    result: crate::Payload(Vec::new()),
                },
            }],
        );
        Request {
            prepared: PreparedBatch::new(batch).unwrap(),
            fence,
            reply: CommitHandle::channel().0,
        }
    }

    fn runs(batch: &[Request]) -> Vec<u64> {
        batch
            .iter()
            .map(|r| r.prepared.batch.appends[0].run_id.0.as_u64_pair().0)
            .collect()
    }

    /// Goal: keel's TCP defaults give way to what a connection string sets,
    /// in either form, and only to that option (the driver reports
    /// `keepalives_idle` with its default filled in, so keel reads the
    /// string). Method: look for options in strings that set them, set
    /// others, or set one whose name starts the same way.
    #[test]
    fn an_option_the_connection_string_sets_is_found_in_either_form() {
        assert!(names_option(
            "postgres://k@h/db?keepalives_idle=30",
            "keepalives_idle"
        ));
        assert!(names_option(
            "postgres://k@h/db?sslmode=disable&keepalives_idle=30",
            "keepalives_idle"
        ));
        assert!(names_option(
            "host=h user=k keepalives_idle=30",
            "keepalives_idle"
        ));
        assert!(!names_option(
            "postgres://k@h/db?keepalives=1",
            "keepalives_idle"
        ));
        assert!(!names_option(
            "postgres://k@h/db?keepalives_idle_x=1",
            "keepalives_idle"
        ));
        assert!(!names_option(
            "postgres://k@h/keepalives_idle",
            "keepalives_idle"
        ));
    }

    /// Goal: a sharded process's commits, queued with their shards
    /// interleaved, fill one group per fence instead of a group per run of
    /// equal fences, and every fence's commits keep the order they came in.
    /// Method: queue commits of two fences alternately (odd runs under one,
    /// even under the other), take groups as the writer does (the oldest
    /// held commit starts the next), and compare each group's runs.
    #[test]
    fn interleaved_fences_fill_one_group_each_in_order() {
        let a = Some(Fence { shard: 0, epoch: 1 });
        let b = Some(Fence { shard: 1, epoch: 1 });
        let (tx, rx) = crossbeam_channel::unbounded();
        for run in 1..=8u64 {
            tx.send(request(run, if run % 2 == 1 { a } else { b }))
                .unwrap();
        }
        let mut held = Held::default();
        let first = rx.try_recv().unwrap();
        let group = Group::new(first.fence);
        assert_eq!(
            runs(&take_queued(&rx, &mut held, &group, first)),
            [1, 3, 5, 7]
        );
        // Arriving meanwhile, after the held ones of its fence.
        tx.send(request(10, b)).unwrap();
        tx.send(request(9, a)).unwrap();
        let first = held.pop_front().unwrap();
        let group = Group::new(first.fence);
        assert_eq!(
            runs(&take_queued(&rx, &mut held, &group, first)),
            [2, 4, 6, 8, 10]
        );
        let first = held.pop_front().unwrap();
        let group = Group::new(first.fence);
        assert_eq!(runs(&take_queued(&rx, &mut held, &group, first)), [9]);
        assert!(held.is_empty());
    }
}
