//! What a PostgreSQL server did during a benchmark: WAL flushes and
//! writes, committed transactions (from its statistics views), and the CPU
//! time of its processes when it runs on this machine.

use keel_storage::PgOptions;

/// Counters read before and after a run.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ServerCounters {
    wal_syncs: i64,
    wal_writes: i64,
    commits: i64,
    /// CPU seconds of every local `postgres` process (0 if none is local).
    cpu_s: f64,
}

/// What the server did between two readings, per second of `wall_s`.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(crate) struct ServerLoad {
    pub(crate) wal_flushes_per_s: f64,
    pub(crate) wal_writes_per_s: f64,
    pub(crate) transactions_per_s: f64,
    /// Share of one core the local server's processes used.
    pub(crate) server_cpu_cores: f64,
}

impl ServerCounters {
    /// Reads the counters. The statistics views lag by up to a second, so
    /// callers wait that long before the second reading.
    pub(crate) fn read(options: &PgOptions) -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (wal_syncs, wal_writes, commits) = rt.block_on(async {
            let (config, tls) = keel_storage::pg_tls::driver_config(&options.url)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let (client, connection) = config.connect(tls).await?;
            tokio::spawn(connection);
            let wal = client
                .query_one("select wal_sync, wal_write from pg_stat_wal", &[])
                .await?;
            let db = client
                .query_one(
                    "select xact_commit from pg_stat_database where datname = current_database()",
                    &[],
                )
                .await?;
            Ok::<_, anyhow::Error>((wal.get(0), wal.get(1), db.get(0)))
        })?;
        Ok(ServerCounters {
            wal_syncs,
            wal_writes,
            commits,
            cpu_s: local_server_cpu_s(),
        })
    }

    /// The load between `self` (earlier) and `later`.
    pub(crate) fn load_until(&self, later: &ServerCounters, wall_s: f64) -> ServerLoad {
        let per_s = |a: i64, b: i64| (b - a) as f64 / wall_s.max(1e-9);
        ServerLoad {
            wal_flushes_per_s: per_s(self.wal_syncs, later.wal_syncs),
            wal_writes_per_s: per_s(self.wal_writes, later.wal_writes),
            transactions_per_s: per_s(self.commits, later.commits),
            server_cpu_cores: (later.cpu_s - self.cpu_s) / wall_s.max(1e-9),
        }
    }
}

/// CPU seconds used so far by every process named `postgres` on this
/// machine, with the backends that already exited (Linux `/proc`; 0
/// elsewhere). A backend lives as long as its connection: the engine
/// processes of a cluster benchmark end, and their backends with them,
/// before the second reading, so their time is found in the postmaster's
/// count of its reaped children.
fn local_server_cpu_s() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let mut ticks = 0u64;
    for entry in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ...`: the fields after the command name.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if &stat[open + 1..close] != "postgres" {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        // utime, stime, cutime and cstime are fields 14 to 17 of the whole
        // line, 12 to 15 after the command name and the state (indices 11
        // to 14 here). A child's time is added to its parent's `c` fields
        // only once it exited and was reaped, so nothing counts twice.
        for i in [11, 12, 13, 14] {
            ticks += fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    // The kernel's USER_HZ is 100 on Linux.
    ticks as f64 / 100.0
}
