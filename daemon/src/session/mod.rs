//! Sessions: one sequence of one client, with its geometry, owner, authoritative page table and the
//! shared-memory views it publishes.

pub mod page_table;
pub mod pins;
pub mod registry;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmm_shm::{ClientRegion, Geometry, Memfd, SessionTable};
use kvmm_store::seal::SessionKey;

pub use page_table::PageTable;
pub use registry::Registry;

use crate::server::conn::ConnId;

/// Who owns a session: the peer credentials of the gRPC connection that attached it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    /// `SO_PEERCRED` uid; selects the trust domain (arena).
    pub uid: u32,
    /// `SO_PEERCRED` gid.
    pub gid: u32,
    /// `SO_PEERCRED` pid; the fd token is only honoured from this pid.
    pub pid: i32,
    /// The process's name at attach (from `/proc/PID/stat` through sysinfo), for stats and logs;
    /// empty when it could not be read. Informational only: never used to decide anything.
    pub name: String,
    /// The connection that attached (or last resumed) the session; when it closes, the session is
    /// destroyed, or orphaned when it lingers.
    pub conn: ConnId,
}

/// The name of process `pid`, or an empty string when it cannot be read (it exited, or procfs
/// hides it).
pub fn process_name(pid: i32) -> String {
    let Ok(pid) = u32::try_from(pid) else { return String::new() };
    let pid = sysinfo::Pid::from_u32(pid);
    let mut host = sysinfo::System::new();
    host.refresh_processes_specifics(
        sysinfo::ProcessesToUpdate::Some(&[pid]),
        false,
        sysinfo::ProcessRefreshKind::nothing(),
    );
    host.process(pid).map(|p| p.name().to_string_lossy().into_owned()).unwrap_or_default()
}

/// Scheduling class: victims of demotion are taken batch → background → foreground (orphaned
/// sessions, whatever their class, before all of them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Priority {
    /// Interactive work; demoted last.
    #[default]
    Foreground,
    /// Work that can wait.
    Background,
    /// Bulk work; demoted first.
    Batch,
}

/// Per-session counters, written by the daemon under the core lock.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    /// Pages moved between frames.
    pub moves: u64,
    /// Pages named in `Fault` requests.
    pub faults: u64,
    /// Pages named in `Prefetch` hints.
    pub prefetches: u64,
    /// Pages named in `Fault` requests that were resident already (hits).
    pub fault_hits: u64,
    /// Pages brought back to the device from DRAM and from flash (faults and prefetches).
    pub promoted_from_dram: u64,
    pub promoted_from_flash: u64,
}

/// How much a session may hold, and what happens past it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    /// The most pages per layer the session may hold in any tier; `None`: no quota.
    pub pages_per_layer: Option<u32>,
    /// Opt-in lossy eviction: past the quota, the pages with the least attention mass are dropped
    /// (never the sink page or the recent window) instead of `Extend` failing.
    pub evict: bool,
}

/// One attached session.
#[derive(Debug)]
pub struct Session {
    /// Daemon-wide unique id, never reused while the daemon runs.
    pub id: u64,
    /// Owner, fixed at attach.
    pub owner: Owner,
    /// Geometry, validated at attach and fixed.
    pub geometry: Geometry,
    /// Free-text model id from the client, for stats.
    pub model_id: String,
    /// Scheduling class.
    pub priority: Priority,
    /// Quota and eviction, fixed at attach.
    pub quota: Quota,
    /// The daemon's read-write view of the shared session table; published from `pages`.
    pub table: SessionTable,
    /// The table memfd, handed to the client once over the fd socket; dropped with the session.
    pub table_memfd: Memfd,
    /// The daemon's view of the client-written region (pins, token counts, importance).
    pub region: ClientRegion,
    /// The client-region memfd, handed out with the table.
    pub region_memfd: Memfd,
    /// The authoritative page table.
    pub pages: PageTable,
    /// Counters for stats.
    pub counters: Counters,
    /// When the session was attached.
    pub attached_at: Instant,
    /// When the client last made an RPC on it (Extend, Fault, Prefetch); per-token work happens in
    /// shared memory and is not seen here.
    pub last_access: Instant,
    /// The key that seals this session's pages outside the device (in locked memory; zeroized when
    /// the last holder drops it: the session, or a move in flight). `None` when no tier seals.
    pub key: Option<Arc<SessionKey>>,
    /// Pages promoted recently, with when: victim selection leaves them alone for a moment.
    pub recent: HashMap<(u32, u32), Instant>,
    /// How long the session outlives its connection, waiting for a `Resume` (zero: not at all).
    pub linger: Duration,
    /// Since when its connection has been closed, while it lingers; `None` while attached.
    pub orphaned: Option<Instant>,
}

impl Session {
    /// Whether page `(layer, block)` was promoted within [`crate::migrate::tiering::HOT_AFTER_FAULT`]
    /// of `now`.
    pub fn hot(&self, layer: u32, block: u32, now: Instant) -> bool {
        self.recent
            .get(&(layer, block))
            .is_some_and(|&t| now.duration_since(t) < crate::migrate::tiering::HOT_AFTER_FAULT)
    }

    /// Records that page `(layer, block)` was just promoted (and forgets promotions long past).
    pub fn mark_hot(&mut self, layer: u32, block: u32) {
        let now = Instant::now();
        if self.recent.len() > 4096 {
            self.recent.retain(|_, t| now.duration_since(*t) < crate::migrate::tiering::HOT_AFTER_FAULT);
        }
        self.recent.insert((layer, block), now);
    }

    /// Tokens the client has published, taken as the minimum over layers (a layer is only complete
    /// up to its own count). Client-written values are clamped to the page size.
    pub fn tokens(&self) -> u64 {
        (0..self.geometry.layers).map(|layer| self.layer_tokens(layer)).min().unwrap_or(0)
    }

    /// Tokens the client has published in `layer`: its allocated blocks' counts, each clamped to
    /// the page size.
    pub fn layer_tokens(&self, layer: u32) -> u64 {
        let bt = self.geometry.block_tokens;
        (0..self.pages.allocated_blocks())
            .map(|b| self.region.entry(layer, b).map_or(0, |e| u64::from(e.tokens_clamped(bt))))
            .sum()
    }
}
