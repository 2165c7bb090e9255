//! The daemon's shared state and the operations the servers call.
//!
//! Everything mutable lives in [`Core`] behind one mutex: the pool, the sessions and the fd tokens
//! change together (an `Extend` allocates frames and publishes them in a session's table), and every
//! operation under the lock is short (no waiting on clients: pinned pages are skipped, never waited
//! on). The gRPC and fd servers are thin layers over these methods, so the logic is tested without
//! sockets.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvmm_shm::fdpass::{FdRequest, PeerCred};
use kvmm_shm::{ClientRegion, Geometry, Memfd, PageLocation, SessionTable, TableStatus};
use kvmm_store::dram::DramPool;
use kvmm_store::flash::{FlashFile, FlashStats, RUN_BYTES};
use kvmm_store::io::{EngineKind, IoBuffers, probe};
use kvmm_store::seal::SessionKey;
use kvmm_store::tier::{Tier, TierKind, TierStats};
use parking_lot::{Mutex, MutexGuard};

use crate::config::Resolved;
use crate::error::{Error, Result};
use crate::fdpass::{TOKEN_BYTES, TokenStore};
use crate::metrics::Metrics;
use crate::migrate::LockPacer;
use crate::migrate::tiering::{self, PageRef, Scratch, TierCounters};
use crate::policy::live::LivePolicy;
use crate::policy::mode::Tuning;
use crate::policy::precision::Demotion;
use crate::pool::quarantine::Quarantine;
use crate::pool::{Frame, Pool};
use crate::server::conn::{ConnId, ConnInfo};
use crate::session::page_table::Place;
use crate::session::pins::{PinWatch, SessionPins};
use crate::session::registry::WipedBy;
use crate::session::{Counters, Owner, PageTable, Priority, Quota, Registry, Session};

/// The most pages one session may address (its table then takes 32 MiB); bounds what one attach costs.
pub const MAX_PAGES_PER_SESSION: u64 = 1 << 20;
/// Promotion attempts of one `Fault` before it reports the device as exhausted, and the pause
/// between them (room may be held by other clients' pins for a moment).
const FAULT_ATTEMPTS: u32 = 200;
const FAULT_RETRY: std::time::Duration = std::time::Duration::from_millis(2);
/// Longest model id accepted.
pub const MAX_MODEL_ID_BYTES: usize = 256;

/// Mutable state, guarded by [`Daemon::core`].
#[derive(Debug)]
pub struct Core {
    /// Device-tier frames and accounting.
    pub pool: Pool,
    /// Live sessions.
    pub sessions: Registry,
    /// One-time fd tokens.
    pub tokens: TokenStore,
    /// Pages moved between frames since start.
    pub moves: u64,
    /// Moves skipped because a client held a pin.
    pub moves_skipped_pinned: u64,
    /// The DRAM tier, if configured: memory-speed, so it lives under the core lock.
    pub dram: Option<DramPool>,
    /// Traffic between tiers.
    pub tier_counters: TierCounters,
    /// Pages named by `Prefetch` hints, promoted by the tier task.
    pub prefetch_queue: VecDeque<PageRef>,
    /// The daemon's metrics (the same families as [`Daemon::metrics`]), for tier code under the lock.
    pub metrics: Metrics,
    /// Device frames reserved for flash pages being read back: in `pool`'s accounting, in no page
    /// table yet (see [`tiering::Reserved`]). Zero whenever no promotion from flash is under way.
    pub reserved: tiering::Reserved,
    /// Device frames of destroyed sessions that their client still had pinned: zeroed, in `pool`'s
    /// accounting, in no page table, freed when the pin goes ([`Quarantine`]).
    pub quarantine: Quarantine,
    /// DRAM pages a move to flash has taken and is sealing and writing (until it commits them):
    /// no other move takes them meanwhile, so concurrent moves (the flash drain, a request making
    /// room) neither write a page twice nor count its bytes as room twice.
    pub outbound: HashSet<PageRef>,
    /// Pages clients hold pinned, across the pin watch's scans: which of them are stuck.
    pub pins: PinWatch,
}

/// The daemon: configuration, the locked core, and the shutdown flag.
#[derive(Debug)]
pub struct Daemon {
    /// The resolved configuration; fixed for the life of the process.
    pub config: Resolved,
    /// Mutable state.
    pub core: Mutex<Core>,
    /// Set once shutdown starts; from then on no new work is admitted.
    shutting_down: AtomicBool,
    /// Set by admin `Drain`: no new sessions or pages until it is resumed.
    draining: AtomicBool,
    /// Wakes the prefaulter when an allocation may have raised a high-water mark.
    pub prefault_wanted: tokio::sync::Notify,
    /// Start time, for uptime.
    pub started: Instant,
    /// The flash tier, if configured. Never waited for under the core lock, nor the core lock under
    /// it: see `migrate::tiering`'s module doc.
    pub flash: Option<Mutex<FlashFile>>,
    /// The flash file's counters, read without its lock (`Status` holds the core lock, and the
    /// flash lock is held for a write's or a read's whole I/O).
    flash_stats: Option<FlashStats>,
    /// The I/O engine of the flash tier and why it is not the first choice, if it is not.
    pub io_engine: Option<(EngineKind, Option<String>)>,
    /// Wakes the tier task (a prefetch hint arrived, or memory is short).
    pub tier_wanted: crate::migrate::Wakeup,
    /// When the tier mover and the policy loop last went round (the watchdog feeds on them).
    pub heartbeats: crate::systemd::Heartbeats,
    /// The mode in force and what it sets. Taken after the core lock, never before it.
    pub policy: Mutex<LivePolicy>,
    /// Metric families: latencies and counts measured as they happen; encoded (with the families
    /// read from the state above at that moment) by the admin `Metrics` RPC.
    pub metrics: Metrics,
}

/// What a client asks for its session besides the geometry.
#[derive(Clone, Debug, Default)]
pub struct SessionOptions {
    /// Free-text model id, for stats.
    pub model_id: String,
    /// Scheduling class.
    pub priority: Priority,
    /// The most tokens per layer the session may hold (rounded down to whole pages); 0: no quota.
    pub quota_tokens: u32,
    /// Opt-in lossy eviction over the quota.
    pub evict: bool,
    /// How long the session outlives its connection, waiting for a `Resume` (zero: not at all).
    pub linger: std::time::Duration,
}

/// What `Attach` returns.
#[derive(Debug)]
pub struct AttachGrant {
    /// The new session.
    pub session_id: u64,
    /// The one-time fd token.
    pub fd_token: [u8; TOKEN_BYTES],
    /// Arena memfd length.
    pub arena_bytes: u64,
    /// Session-table memfd length.
    pub table_bytes: u64,
    /// Client-region memfd length.
    pub client_region_bytes: u64,
    /// The accepted geometry (defaults filled in).
    pub geometry: Geometry,
    /// How long the session outlives its connection.
    pub linger: std::time::Duration,
    /// Pages already allocated per layer (zero at attach).
    pub allocated_blocks: u32,
}

/// The shape a `Resume` caller can use; `None` fields take whatever the session has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpectedShape {
    pub layers: u32,
    pub kv_heads: u32,
    pub q_heads: u32,
    pub head_dim: u32,
    pub block_tokens: Option<u32>,
    pub element_type: Option<kvmm_kernels::ElementType>,
    pub max_tokens: Option<u32>,
}

impl ExpectedShape {
    /// Why session `id` of geometry `g` does not have this shape, if it does not.
    fn mismatch(&self, id: u64, g: &Geometry) -> Option<Error> {
        let fits = (self.layers, self.kv_heads, self.q_heads, self.head_dim)
            == (g.layers, g.kv_heads, g.q_heads, g.head_dim)
            && self.block_tokens.is_none_or(|b| b == g.block_tokens)
            && self.element_type.is_none_or(|e| e == g.element_type)
            && self.max_tokens.is_none_or(|m| m == g.max_tokens);
        (!fits).then(|| {
            let have = ExpectedShape {
                block_tokens: Some(g.block_tokens),
                element_type: Some(g.element_type),
                max_tokens: Some(g.max_tokens),
                ..ExpectedShape::of_model(g)
            };
            Error::FailedPrecondition(format!(
                "session {id} has {}, not {} as asked: it was attached for another model; it is left as it was",
                have.describe(),
                self.describe()
            ))
        })
    }

    /// The model-fixed part of `g`.
    fn of_model(g: &Geometry) -> ExpectedShape {
        ExpectedShape {
            layers: g.layers,
            kv_heads: g.kv_heads,
            q_heads: g.q_heads,
            head_dim: g.head_dim,
            block_tokens: None,
            element_type: None,
            max_tokens: None,
        }
    }

    /// E.g. `5 layers, 4 KV heads, 8 query heads, head_dim 16, 32 tokens per block`.
    fn describe(&self) -> String {
        let mut out = format!(
            "{} layers, {} KV heads, {} query heads, head_dim {}",
            self.layers, self.kv_heads, self.q_heads, self.head_dim
        );
        if let Some(b) = self.block_tokens {
            out += &format!(", {b} tokens per block");
        }
        if let Some(e) = self.element_type {
            out += &format!(", {} elements", kvmm_kernels::Format::from(e).name());
        }
        if let Some(m) = self.max_tokens {
            out += &format!(", room for {m} tokens");
        }
        out
    }
}

/// The memfds handed out for one session (duplicates; the daemon keeps its own).
#[derive(Debug)]
pub struct FdGrant {
    /// The trust domain's arena.
    pub arena: Memfd,
    /// The session table (read-only for the client).
    pub table: Memfd,
    /// The client region.
    pub region: Memfd,
}

/// Residency of one page, as `Fault` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Residency {
    /// Layer.
    pub layer: u32,
    /// Block.
    pub block: u32,
    /// Whether the page is in the device tier.
    pub resident: bool,
    /// Generation of the page's table entry.
    pub generation: u32,
    /// Whether the page was dropped by opt-in eviction (it will never be resident again).
    pub dropped: bool,
}

/// What an admin `Demote` did with the pages of its range ([`Daemon::demote`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DemoteReport {
    /// Pages in the target tier afterwards (those already there included; to DRAM, pages in
    /// flash count too).
    pub there: u32,
    /// Pages left where they were, for the reasons below or because they moved meanwhile (a fault).
    pub left: u32,
    /// Of those, pages a client is still writing (fewer than `block_tokens` tokens published).
    pub not_full: u32,
    /// Of those, pages a client held pinned.
    pub pinned: u32,
    /// Of those, pages the target tier (DRAM, on the way to flash too) had no room for.
    pub no_room: u32,
}

/// One orphaned session as `ListOrphans` shows it to its uid.
#[derive(Clone, Debug)]
pub struct OrphanInfo {
    /// Id, for `Resume`.
    pub session_id: u64,
    /// The model id it was attached with.
    pub model_id: String,
    /// Geometry.
    pub geometry: Geometry,
    /// Tokens published (minimum over layers).
    pub tokens: u64,
    /// Blocks allocated per layer.
    pub allocated_blocks: u32,
    /// How long it lingers after its connection closed.
    pub linger: std::time::Duration,
    /// Since its connection closed.
    pub orphaned: std::time::Duration,
    /// Bytes of its pages in every tier.
    pub bytes: u64,
    /// The process that left it.
    pub pid: i32,
    /// That process's name.
    pub process: String,
}

/// Per-session statistics.
#[derive(Clone, Debug)]
pub struct SessionStats {
    /// Id.
    pub session_id: u64,
    /// Geometry.
    pub geometry: Geometry,
    /// Model id.
    pub model_id: String,
    /// Priority.
    pub priority: Priority,
    /// Quota and eviction.
    pub quota: Quota,
    /// Pages dropped by eviction.
    pub dropped_pages: u64,
    /// The owning process's name at attach.
    pub owner_name: String,
    /// Pages held pinned past the pin lease.
    pub stuck_pins: u32,
    /// How long the session outlives its connection.
    pub linger: std::time::Duration,
    /// Blocks allocated per layer.
    pub allocated_blocks: u32,
    /// Tokens published by the client (minimum over layers).
    pub tokens: u64,
    /// Device bytes owned.
    pub device_bytes: u64,
    /// Counters.
    pub counters: Counters,
    /// Bytes and pages in the DRAM and flash tiers, and pages on the device.
    pub dram_bytes: u64,
    pub flash_bytes: u64,
    pub pages: [u64; 3],
}

/// Daemon-wide status.
#[derive(Clone, Debug)]
pub struct Status {
    /// Device budget.
    pub budget: u64,
    /// Device bytes in use (the pool's accounting).
    pub used: u64,
    /// Frames in use.
    pub frames: u64,
    /// Sum over sessions of their page-table bytes: `used` minus `reserved.bytes`.
    pub session_bytes: u64,
    /// Frames in `used` and `frames` but in no page table: reserved for flash pages being read
    /// back, and frames of destroyed sessions whose client still held a pin ([`Quarantine`]).
    pub reserved: tiering::Reserved,
    /// Live sessions.
    pub sessions: u32,
    /// Arenas.
    pub trust_domains: u32,
    /// Moves since start.
    pub moves: u64,
    /// Moves skipped on a pin.
    pub moves_skipped_pinned: u64,
    /// Pages held pinned past the pin lease, as of the last scan.
    pub stuck_pins: u32,
    /// Sessions whose connection closed, waiting for a `Resume`.
    pub orphaned_sessions: u32,
    /// Per tier below the device: its counters.
    pub dram: Option<TierStats>,
    pub flash: Option<TierStats>,
    /// The flash tier's I/O engine and fallback reason.
    pub io_engine: Option<(EngineKind, Option<String>)>,
    /// Traffic between tiers.
    pub tier_counters: TierCounters,
    /// Pages per tier over all sessions.
    pub pages_device: u64,
    pub pages_dram: u64,
    pub pages_flash: u64,
}

impl Daemon {
    /// A daemon with an empty pool, and the DRAM pool and flash file the configuration asks for.
    pub fn new(config: Resolved) -> Result<Arc<Self>> {
        let pool = Pool::new(config.device_budget);
        let t = &config.tiers;
        let dram = (t.dram_budget > 0).then(|| DramPool::new(t.dram_budget, t.seal_dram)).transpose()?;
        let (flash, flash_stats, io_engine) = if t.flash_budget > 0 {
            if let Some(dir) = t.flash_path.parent() {
                create_private_dir(dir)
                    .map_err(|e| Error::io(format!("cannot create the flash directory {}", dir.display()), e))?;
            }
            let buffers = IoBuffers::new(RUN_BYTES, 16).map_err(kvmm_store::tier::TierError::from)?;
            let probed =
                probe(t.io_engine, 64, Some(Arc::clone(&buffers))).map_err(kvmm_store::tier::TierError::from)?;
            let kind = probed.engine.kind();
            let engine: Arc<dyn kvmm_store::io::IoEngine> = if config.debug_io_faults.is_empty() {
                probed.engine
            } else {
                tracing::warn!(faults = ?config.debug_io_faults, "debug I/O faults are armed (a test mode)");
                let faulty = kvmm_store::io::FaultyEngine::new(probed.engine);
                for fault in &config.debug_io_faults {
                    faulty.arm(fault.clone());
                }
                Arc::new(faulty)
            };
            let file = FlashFile::create(&t.flash_path, t.flash_budget, engine, Some(buffers))?;
            tracing::info!(path = %t.flash_path.display(), bytes = t.flash_budget, engine = %kind, direct = file.is_direct(), "flash tier ready");
            let stats = file.stats_handle();
            (Some(Mutex::new(file)), Some(stats), Some((kind, probed.fallback)))
        } else {
            (None, None, None)
        };
        let policy = Mutex::new(LivePolicy::new(&config));
        let metrics = Metrics::new(io_engine.as_ref().map(|(kind, _)| kind.name()));
        let pins = PinWatch::new(config.pin_lease);
        Ok(Arc::new(Daemon {
            policy,
            metrics: metrics.clone(),
            config,
            core: Mutex::new(Core {
                pool,
                sessions: Registry::default(),
                tokens: TokenStore::default(),
                moves: 0,
                moves_skipped_pinned: 0,
                dram,
                tier_counters: TierCounters::default(),
                prefetch_queue: VecDeque::new(),
                metrics,
                reserved: tiering::Reserved::default(),
                quarantine: Quarantine::default(),
                outbound: HashSet::new(),
                pins,
            }),
            shutting_down: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            prefault_wanted: tokio::sync::Notify::new(),
            started: Instant::now(),
            flash,
            flash_stats,
            io_engine,
            tier_wanted: crate::migrate::Wakeup::default(),
            heartbeats: crate::systemd::Heartbeats::default(),
        }))
    }

    /// Reads the policy again (SIGHUP, admin `ReloadPolicy`) and applies it at once. A file that
    /// does not parse or validate leaves the running policy as it was. The host root and the
    /// reading interval apply at the next start.
    pub fn reload_policy(&self) -> Result<()> {
        let fresh = self.config.reload_policy()?;
        if fresh.host_root != self.config.policy.host_root || fresh.interval != self.config.policy.interval {
            tracing::warn!("policy host_root and interval_ms changes take effect when kvmmd restarts");
        }
        self.apply_policy(fresh, "reloaded");
        Ok(())
    }

    /// Puts a freshly resolved policy in force, applied to the last reading at once; `how` says
    /// where it came from in the log ("reloaded", "set by an operator").
    fn apply_policy(&self, fresh: crate::config::Policy, how: &str) {
        if fresh.precision != self.policy.lock().view().precision {
            let floors: Vec<String> = fresh.precision.floors.iter().map(ToString::to_string).collect();
            tracing::info!(adaptive = fresh.precision.adaptive, floors = %floors.join(","), "precision {how}");
        }
        let change = self.policy.lock().reload(&self.config, fresh.modes, fresh.precision);
        match change {
            Some(c) => {
                tracing::info!(mode = %c.mode, memory_pressure = ?c.pressure, cause = %c.cause, "policy {how}")
            }
            None => tracing::info!("policy {how}; the mode is unchanged"),
        }
        self.wake_tiers();
    }

    /// What the mode in force sets.
    pub fn tuning(&self) -> Tuning {
        self.policy.lock().tuning()
    }

    /// How a demotion now chooses each page's format (the mode's format, adaptive precision and
    /// per-layer floors).
    pub fn demotion(&self) -> Demotion {
        self.policy.lock().demotion()
    }

    /// Records that a watched loop went round. Under `--debug-hang` that loop stops here for good
    /// once its time has come, as a deadlocked one would.
    pub fn beat(&self, which: crate::systemd::Loop) {
        if let Some((hung, after)) = self.config.debug_hang
            && hung == which
            && self.started.elapsed() >= after
        {
            tracing::warn!(loop_ = which.name(), "debug hang: this loop stops here for good (a test mode)");
            loop {
                std::thread::park();
            }
        }
        self.heartbeats.beat(which);
    }

    /// Wakes the tier task.
    pub fn wake_tiers(&self) {
        self.tier_wanted.wake();
    }

    /// Whether pages of new sessions get a sealing key: some tier below the device seals.
    fn seals(&self) -> bool {
        let t = &self.config.tiers;
        t.flash_budget > 0 || (t.dram_budget > 0 && t.seal_dram)
    }

    /// Stops admitting work.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Whether shutdown has started.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Whether admin `Drain` is in force.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// New sessions and pages are refused while draining.
    fn admit_growth(&self) -> Result<()> {
        if self.is_draining() {
            return Err(Error::Busy(
                "kvmmd is draining for maintenance and admits no new sessions or pages; retry once an operator \
                 resumes it (kvmmctl drain --resume)"
                    .to_owned(),
            ));
        }
        Ok(())
    }

    /// Admin `Drain`: stops admitting new sessions and pages and demotes every full page off the
    /// device (to flash when there is a flash tier, else to DRAM); with `resume`, admits again.
    /// Returns (draining, pages demoted, pages left on the device).
    pub fn drain(&self, resume: bool) -> Result<(bool, u32, u32)> {
        self.admit()?;
        if resume {
            self.draining.store(false, Ordering::SeqCst);
            tracing::info!("drain ended; admitting again");
            return Ok((false, 0, self.status().pages_device as u32));
        }
        self.draining.store(true, Ordering::SeqCst);
        tracing::warn!("draining: no new sessions or pages, demoting every page off the device");
        let to = if self.flash.is_some() { TierKind::Flash } else { TierKind::Dram };
        let mut demoted = 0;
        if self.config.tiers.any() {
            let ids = self.core.lock().sessions.ids();
            for id in ids {
                let Ok((layers, blocks)) = self.clamp_ranges(id, 0..u32::MAX, 0..u32::MAX) else { continue };
                if blocks.is_empty() {
                    continue;
                }
                match self.demote(id, layers, blocks, to) {
                    Ok(report) => demoted += report.there,
                    Err(e) if e.kind() == crate::error::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok((true, demoted, self.status().pages_device as u32))
    }

    /// The policy in force as a `[policy]` table, and its view.
    pub fn policy_now(&self) -> (String, crate::policy::live::PolicyView) {
        let live = self.policy.lock();
        let view = live.view();
        (crate::config::policy_toml(live.modes(), &view.precision), view)
    }

    /// Admin `SetPolicy`: replaces the running policy with a `[policy]` table's body (validated
    /// like the file's; flags still win), applied to the last reading at once.
    pub fn set_policy(&self, text: &str) -> Result<()> {
        self.apply_policy(self.config.policy_from_toml(text)?, "set by an operator");
        Ok(())
    }

    /// What admin `ListSessions` and `Session` show: every session, or the one asked for.
    pub fn sessions(&self, only: Option<u64>) -> Result<Vec<SessionInfo>> {
        let core = self.core.lock();
        if let Some(id) = only {
            let s = core.sessions.get_unchecked(id).ok_or(Error::UnknownSession(id))?;
            return Ok(vec![SessionInfo::of(s, &core.pins)]);
        }
        Ok(core.sessions.iter().map(|s| SessionInfo::of(s, &core.pins)).collect())
    }

    /// Pages and bytes per tier and format over every session.
    pub fn usage(&self) -> Usage {
        usage_of(&self.core.lock())
    }

    fn admit(&self) -> Result<()> {
        if self.is_shutting_down() { Err(Error::ShuttingDown) } else { Ok(()) }
    }

    /// Creates a session for the caller.
    pub fn attach(&self, caller: ConnInfo, geometry: Geometry, options: SessionOptions) -> Result<AttachGrant> {
        self.admit()?;
        self.admit_growth()?;
        geometry.validate()?;
        let SessionOptions { model_id, priority, quota_tokens, evict, linger } = options;
        let quota = quota_from(&geometry, quota_tokens, evict)?;
        if linger > self.config.max_linger {
            return Err(Error::InvalidArgument(match self.config.max_linger.as_millis() {
                0 => "linger_ms must be 0: this kvmmd keeps no session past its connection (max_linger_ms = 0)"
                    .to_owned(),
                max => format!(
                    "linger_ms is {}; this kvmmd lets a session outlive its connection for at most {max} ms \
                     (max_linger_ms): ask for less",
                    linger.as_millis()
                ),
            }));
        }
        if model_id.len() > MAX_MODEL_ID_BYTES {
            return Err(Error::InvalidArgument(format!(
                "model_id is {} bytes; at most {MAX_MODEL_ID_BYTES} are accepted",
                model_id.len()
            )));
        }
        let pages = u64::from(geometry.layers) * u64::from(geometry.blocks_per_layer());
        if pages > MAX_PAGES_PER_SESSION {
            return Err(Error::InvalidArgument(format!(
                "this geometry addresses {pages} pages ({} layers × {} blocks); at most {MAX_PAGES_PER_SESSION} \
                 are allowed per session: lower max_tokens or raise block_tokens",
                geometry.layers,
                geometry.blocks_per_layer()
            )));
        }
        let name = crate::session::process_name(caller.pid);
        let key = if self.seals() {
            Some(Arc::new(SessionKey::generate().map_err(kvmm_store::tier::TierError::from)?))
        } else {
            None
        };
        let mut core = self.core.lock();
        let core = &mut *core;
        let arena_bytes = core.pool.arena_for(caller.uid)?.memfd().len();
        self.prefault_wanted.notify_one();
        let id = core.sessions.next_id();
        let (table_memfd, table) = SessionTable::create(id, &geometry)?;
        let (region_memfd, region) = ClientRegion::create(&geometry)?;
        let fd_token = core.tokens.issue(id, caller.uid, caller.pid, self.config.fd_token_ttl)?;
        let grant = AttachGrant {
            session_id: id,
            fd_token,
            arena_bytes,
            table_bytes: table_memfd.len(),
            client_region_bytes: region_memfd.len(),
            geometry,
            linger,
            allocated_blocks: 0,
        };
        core.sessions.insert(Session {
            id,
            owner: Owner { uid: caller.uid, gid: caller.gid, pid: caller.pid, name: name.clone(), conn: caller.id },
            geometry,
            model_id,
            priority,
            quota,
            table,
            table_memfd,
            region,
            region_memfd,
            pages: PageTable::new(geometry.layers, geometry.blocks_per_layer()),
            counters: Counters::default(),
            attached_at: Instant::now(),
            last_access: Instant::now(),
            key,
            recent: Default::default(),
            linger,
            orphaned: None,
        });
        crate::limited!(info, session = id, uid = caller.uid, pid = caller.pid, process = %name, ?geometry, "attached");
        Ok(grant)
    }

    /// Hands out `blocks` more pages for every layer of a session; returns (allocated blocks, bytes).
    pub fn extend(&self, caller: ConnInfo, session_id: u64, blocks: u32) -> Result<(u32, u64)> {
        self.admit()?;
        self.admit_growth()?;
        if blocks == 0 {
            return Err(Error::InvalidArgument("blocks must be at least 1".to_owned()));
        }
        let mut core = self.core.lock();
        // Checked again after making room: `make_room` releases the core lock while it writes to
        // flash, so another request (even an Extend of this session) may have run meanwhile.
        let mut made_room = false;
        loop {
            let room = {
                let s = core.sessions.get(session_id, caller.uid, caller.id)?;
                let have = s.pages.allocated_blocks();
                let cap = s.pages.blocks_per_layer();
                if u64::from(have) + u64::from(blocks) > u64::from(cap) {
                    return Err(Error::InvalidArgument(format!(
                        "Extend past the geometry: session {session_id} has {have} of its {cap} blocks per layer \
                         (max_tokens {} at {} tokens per block); {blocks} more would exceed max_tokens",
                        s.geometry.max_tokens, s.geometry.block_tokens
                    )));
                }
                tiering::Room {
                    uid: Some(caller.uid),
                    frame_len: s.geometry.page_bytes(),
                    count: u64::from(blocks) * u64::from(s.geometry.layers),
                }
            };
            // Under its quota first: a session that opted into eviction drops its least-attended
            // pages (which also gives their room back), any other is refused. Dropped pages' flash
            // slots are punched out (like a wipe's) with the core lock released, and then
            // everything is checked again.
            let mut dropped_slots = Vec::new();
            let fitted = crate::migrate::evict::fit_quota(&mut core, session_id, blocks, &mut dropped_slots);
            if !dropped_slots.is_empty() {
                MutexGuard::unlocked(&mut core, || {
                    tiering::discard_flash_slots(self.flash.as_ref(), session_id, dropped_slots)
                });
                fitted?;
                continue;
            }
            fitted?;
            if made_room || !self.config.tiers.any() || core.pool.fits(caller.uid, room.frame_len, room.count) {
                break;
            }
            // Make room below rather than refuse: demote the coldest pages of any session.
            let demotion = self.demotion();
            tiering::make_room(
                &mut core,
                self.flash.as_ref(),
                &demotion,
                room,
                &HashSet::new(),
                &mut Scratch::default(),
            )?;
            self.wake_tiers();
            made_room = true;
        }
        let Core { pool, sessions, .. } = &mut *core;
        let s = sessions.get_mut(session_id, caller.uid, caller.id)?;
        s.last_access = Instant::now();
        let have = s.pages.allocated_blocks();
        let page_bytes = s.geometry.page_bytes();
        let frames = pool.alloc_frames(caller.uid, page_bytes, u64::from(blocks) * u64::from(s.geometry.layers))?;
        // Every new page starts with its header and empty key bounds; the rest of a frame is zero
        // already (fresh memory, or zeroed when it was last freed).
        let (shape, page_format) = (s.geometry.page_shape(), s.geometry.format());
        let mut empty = vec![0u8; shape.page_bytes(page_format)];
        kvmm_kernels::init_page(shape, page_format, &mut empty)?;
        let prefix = &empty[..shape.k_offset(page_format)];
        let arena = pool
            .arena(caller.uid)
            .ok_or_else(|| Error::FailedPrecondition(format!("uid {} has no arena", caller.uid)))?;
        for frame in &frames {
            arena.mapping().write_at(frame.offset as usize, prefix)?;
        }
        let format = page_format.as_u8();
        for (i, frame) in frames.iter().enumerate() {
            let layer = i as u32 / blocks;
            let block = have + i as u32 % blocks;
            s.region.entry(layer, block)?.publish_tokens(0);
            s.table.entry_writer(layer, block)?.publish_new(PageLocation {
                offset: frame.offset,
                len: frame.len as u32,
                format,
                tier: PageLocation::TIER_DEVICE,
            });
        }
        s.pages.extend(blocks, &frames, s.geometry.format());
        self.prefault_wanted.notify_one();
        tracing::debug!(session = session_id, blocks, total = s.pages.allocated_blocks(), "extended");
        Ok((s.pages.allocated_blocks(), s.pages.bytes()))
    }

    /// Gives back every page of a session from block `blocks` on, in every layer, on its owner's
    /// request: the client takes tokens back and appends from there again (see
    /// [`PageTable::truncate`]). Each page is freed where it is: frames zeroed (as every freed frame
    /// is), DRAM slots freed, flash slots punched out. A page of those that the client holds pinned
    /// refuses the whole request, with nothing changed: the claims taken before it are withdrawn.
    pub fn truncate(&self, caller: ConnInfo, session_id: u64, blocks: u32) -> Result<TruncateReport> {
        let mut core = self.core.lock();
        let Core { sessions, dram, reserved, .. } = &mut *core;
        let s = sessions.get_mut(session_id, caller.uid, caller.id)?;
        s.last_access = Instant::now();
        let have = s.pages.allocated_blocks();
        let past = || (0..s.geometry.layers).flat_map(move |l| (blocks..have).map(move |b| (l, b)));
        // Claim every resident page first, so that a pinned one changes nothing.
        let mut claimed = Vec::new();
        for (layer, block) in past() {
            let Some(Place::Device(_)) = s.pages.page(layer, block).map(|p| p.place) else { continue };
            let entry = s.table.entry_writer(layer, block)?;
            match entry.try_begin_migrate(s.region.entry(layer, block)?) {
                Ok(ticket) => claimed.push((entry, ticket)),
                Err(_) => {
                    for (entry, ticket) in claimed {
                        entry.abort_migrate(ticket);
                    }
                    return Err(Error::FailedPrecondition(format!(
                        "session {session_id} has page (layer {layer}, block {block}) pinned: truncate while no \
                         attention or append on the session is running"
                    )));
                }
            }
        }
        for (entry, ticket) in claimed {
            entry.finish_free(ticket);
        }
        for (layer, block) in past() {
            // Pages in DRAM or flash, and pages dropped by eviction: no client can hold them.
            if s.pages.frame(layer, block).is_none() {
                s.table.entry_writer(layer, block)?.clear();
            }
            let client = s.region.entry(layer, block)?;
            client.publish_tokens(0);
            client.set_importance(0.0);
        }
        let mut report = TruncateReport { allocated_blocks: blocks.min(have), ..TruncateReport::default() };
        let (mut frames, mut flash_slots) = (Vec::new(), Vec::new());
        for (_, _, place) in s.pages.truncate(blocks) {
            report.freed_pages += 1;
            report.freed_bytes += place.footprint();
            match place {
                Place::Device(frame) => {
                    reserved.add(frame);
                    frames.push(frame);
                }
                Place::Dram(slot) => {
                    if let Some(dram) = dram.as_mut() {
                        dram.free(slot);
                    }
                }
                Place::Flash(slot) => flash_slots.push(slot),
            }
        }
        report.device_bytes = s.pages.bytes();
        let uid = s.owner.uid;
        discard_unlocked(&mut core, self.flash.as_ref(), session_id, flash_slots);
        free_frames_paced(&mut core, uid, frames)?;
        if report.freed_pages > 0 {
            tracing::debug!(session = session_id, blocks, freed = report.freed_pages, "truncated");
        }
        Ok(report)
    }

    /// Destroys a session on its owner's request (through the connection that attached or resumed it,
    /// or, once it is orphaned, any connection of its uid); returns the bytes wiped.
    pub fn detach(&self, caller: ConnInfo, session_id: u64) -> Result<u64> {
        let mut core = self.core.lock();
        let orphaned = core.sessions.get_to_end(session_id, caller.uid, caller.id)?.orphaned.is_some();
        let bytes = destroy(&mut core, self.flash.as_ref(), session_id, TableStatus::Closed, false)?.total();
        crate::limited!(info, session = session_id, bytes, orphaned, pid = caller.pid, "detached");
        Ok(bytes)
    }

    /// Wipes sessions on an operator's (or, for one session, its owner's) request: every frame
    /// zeroed, every flash slot punched out, the key zeroized, the table marked wiped; their clients
    /// get `FAILED_PRECONDITION` on their next call. Pins do not block a wipe. `as_owner`: the
    /// request came through the session socket, so `by` must own the session. Returns the bytes
    /// wiped per tier and how many sessions.
    pub fn wipe(&self, which: WipeScope, by: ConnInfo, as_owner: bool) -> Result<WipeReport> {
        let mut core = self.core.lock();
        let ids = match which {
            WipeScope::Session(id) if as_owner => vec![core.sessions.get_to_end(id, by.uid, by.id)?.id],
            WipeScope::Session(id) if let Some(gone) = core.sessions.wiped(id) => return Err(gone),
            WipeScope::Session(id) => vec![core.sessions.get_unchecked(id).ok_or(Error::UnknownSession(id))?.id],
            _ if as_owner => {
                return Err(Error::PermissionDenied(
                    "only one's own sessions can be wiped through the session socket; wiping a user's or all \
                     sessions is for the admin socket"
                        .to_owned(),
                ));
            }
            WipeScope::User(uid) => core.sessions.ids_of_uid(uid),
            WipeScope::All => core.sessions.ids(),
        };
        let mut report = WipeReport::default();
        for id in ids {
            let Some(uid) = core.sessions.get_unchecked(id).map(|s| s.owner.uid) else { continue };
            let wiped = destroy(&mut core, self.flash.as_ref(), id, TableStatus::Wiped, !as_owner)?;
            core.sessions.remember_wiped(id, uid, if as_owner { WipedBy::Owner } else { WipedBy::Operator });
            crate::limited!(
                warn,
                session = id,
                uid,
                by_uid = by.uid,
                by_pid = by.pid,
                bytes = wiped.total(),
                "session wiped"
            );
            report.add(&wiped);
            report.sessions += 1;
        }
        Ok(report)
    }

    /// Revokes sessions one of whose pages stayed pinned past the pin lease (`revoke_stuck_pins`):
    /// each is wiped as an operator's wipe would (its pinned frames held until the pin goes), its
    /// table marked revoked, and its client's next call told why.
    pub fn revoke(&self, ids: &[u64]) {
        let mut core = self.core.lock();
        for &id in ids {
            if let Some((uid, wiped)) = self.end_for(&mut core, id, WipedBy::PinLease) {
                crate::limited!(
                    warn,
                    session = id,
                    uid,
                    bytes = wiped.total(),
                    "session revoked: one of its pages stayed pinned past the pin lease"
                );
            }
        }
    }

    /// Ends session `id` for the reason `by`, as [`destroy`] does (an operator's and a revocation
    /// hold pinned frames; the table tells the client which), and remembers why for its client's
    /// next call. Returns its owner's uid and what was wiped; `None` when it is gone already or the
    /// wipe failed (logged).
    fn end_for(&self, core: &mut MutexGuard<'_, Core>, id: u64, by: WipedBy) -> Option<(u32, WipeReport)> {
        let uid = core.sessions.get_unchecked(id)?.owner.uid;
        let (status, hold_pinned) = match by {
            WipedBy::Operator => (TableStatus::Wiped, true),
            WipedBy::Owner => (TableStatus::Wiped, false),
            WipedBy::PinLease => (TableStatus::Revoked, true),
            WipedBy::LingerExpired => (TableStatus::Closed, false),
        };
        match destroy(core, self.flash.as_ref(), id, status, hold_pinned) {
            Ok(wiped) => {
                core.sessions.remember_wiped(id, uid, by);
                Some((uid, wiped))
            }
            Err(e) => {
                tracing::error!(session = id, error = %e, ?by, "wiping a session failed");
                None
            }
        }
    }

    /// Destroys every session attached through a connection that has closed, or orphans it when it
    /// lingers ([`orphan`]).
    pub fn connection_closed(&self, conn: ConnId) {
        let mut core = self.core.lock();
        for id in core.sessions.ids_of_conn(conn) {
            if !self.is_shutting_down()
                && let Some(s) = core.sessions.get_mut_unchecked(id)
                && !s.linger.is_zero()
            {
                let started = Instant::now();
                match orphan(s) {
                    Ok(()) => {
                        let linger_ms = s.linger.as_millis() as u64;
                        let took_us = started.elapsed().as_micros() as u64;
                        core.tokens.remove(id);
                        core.pins.forget(id);
                        crate::limited!(
                            info,
                            session = id,
                            conn = conn.0,
                            linger_ms,
                            took_us,
                            "client went away; session kept for a Resume"
                        );
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(session = id, error = %e, "orphaning a lingering session failed; wiping it")
                    }
                }
            }
            match destroy(&mut core, self.flash.as_ref(), id, TableStatus::Closed, false) {
                Ok(w) => {
                    crate::limited!(
                        info,
                        session = id,
                        conn = conn.0,
                        bytes = w.total(),
                        "client went away; session wiped"
                    )
                }
                Err(e) => tracing::error!(session = id, error = %e, "wiping the session of a closed connection failed"),
            }
        }
        // And the frames held after an administrator's wipe of its sessions: nothing of that
        // connection writes any more.
        let core = &mut *core;
        if let Err(e) = core.quarantine.release(&mut core.pool, Some(conn)) {
            tracing::error!(conn = conn.0, error = %e, "freeing the held frames of a closed connection failed");
        }
    }

    /// Binds an orphaned session of the caller's uid to the caller's connection: the caller's process
    /// receives a fresh fd token, and the session lives and lingers as after `Attach`.
    /// With `expected`, a session of another shape is left as it was (`FAILED_PRECONDITION`).
    pub fn resume(&self, caller: ConnInfo, session_id: u64, expected: Option<ExpectedShape>) -> Result<AttachGrant> {
        self.admit()?;
        let name = crate::session::process_name(caller.pid);
        let mut core = self.core.lock();
        let core = &mut *core;
        let s = core.sessions.get_owned(session_id, caller.uid)?;
        let arena_bytes = core
            .pool
            .arena(s.owner.uid)
            .ok_or_else(|| Error::FailedPrecondition(format!("uid {} has no arena", s.owner.uid)))?
            .memfd()
            .len();
        if s.orphaned.is_none() {
            return Err(Error::FailedPrecondition(format!(
                "session {session_id} is attached through a live connection; only a session whose connection has \
                 closed (and which lingers) can be resumed"
            )));
        }
        if let Some(e) = expected.and_then(|shape| shape.mismatch(session_id, &s.geometry)) {
            return Err(e);
        }
        let fd_token = core.tokens.issue(session_id, caller.uid, caller.pid, self.config.fd_token_ttl)?;
        let Some(s) = core.sessions.get_mut_unchecked(session_id) else {
            return Err(Error::UnknownSession(session_id));
        };
        let waited = s.orphaned.take().map(|since| since.elapsed()).unwrap_or_default();
        s.owner = Owner { uid: caller.uid, gid: caller.gid, pid: caller.pid, name: name.clone(), conn: caller.id };
        s.last_access = Instant::now();
        crate::limited!(
            info,
            session = session_id,
            uid = caller.uid,
            pid = caller.pid,
            process = %name,
            waited_ms = waited.as_millis() as u64,
            "resumed"
        );
        Ok(AttachGrant {
            session_id,
            fd_token,
            arena_bytes,
            table_bytes: s.table_memfd.len(),
            client_region_bytes: s.region_memfd.len(),
            geometry: s.geometry,
            linger: s.linger,
            allocated_blocks: s.pages.allocated_blocks(),
        })
    }

    /// Wipes the orphaned sessions whose linger time has run out (the pin watch calls this).
    pub fn expire_orphans(&self, now: Instant) {
        let mut core = self.core.lock();
        for id in core.sessions.ids_expired(now) {
            if let Some((uid, wiped)) = self.end_for(&mut core, id, WipedBy::LingerExpired) {
                crate::limited!(
                    info,
                    session = id,
                    uid,
                    bytes = wiped.total(),
                    "no process resumed the session within its linger time; session wiped"
                );
            }
        }
    }

    /// Frees the held frames of destroyed sessions whose client has let go of its pin (the tier
    /// thread and the pin watch).
    pub fn release_quarantined(&self) {
        let mut core = self.core.lock();
        let core = &mut *core;
        match core.quarantine.release(&mut core.pool, None) {
            Ok(0) => {}
            Ok(freed) => tracing::debug!(freed, "held frames of destroyed sessions freed"),
            Err(e) => tracing::error!(error = %e, "freeing held frames of destroyed sessions failed"),
        }
    }

    /// Wipes every session (shutdown); returns the bytes wiped.
    pub fn wipe_all(&self) -> u64 {
        let mut core = self.core.lock();
        let mut total = 0;
        for id in core.sessions.ids() {
            match destroy(&mut core, self.flash.as_ref(), id, TableStatus::Closed, false) {
                Ok(w) => total += w.total(),
                Err(e) => tracing::error!(session = id, error = %e, "wiping a session at shutdown failed"),
            }
        }
        total
    }

    /// Checks an fd request against its token and returns duplicates of the session's memfds.
    pub fn grant_fds(&self, peer: PeerCred, request: &FdRequest) -> Result<FdGrant> {
        self.admit()?;
        let mut core = self.core.lock();
        let core = &mut *core;
        core.tokens.redeem(request.session_id, &request.token, peer, Instant::now())?;
        let s = core.sessions.get_owned(request.session_id, peer.uid)?;
        let arena = core
            .pool
            .arena(s.owner.uid)
            .ok_or_else(|| Error::FailedPrecondition(format!("uid {} has no arena", s.owner.uid)))?;
        Ok(FdGrant {
            arena: arena.memfd().try_clone()?,
            table: s.table_memfd.try_clone()?,
            region: s.region_memfd.try_clone()?,
        })
    }

    /// Statistics of one session.
    pub fn session_stats(&self, caller: ConnInfo, session_id: u64) -> Result<SessionStats> {
        let core = self.core.lock();
        let s = core.sessions.get(session_id, caller.uid, caller.id)?;
        Ok(SessionStats {
            session_id,
            geometry: s.geometry,
            model_id: s.model_id.clone(),
            priority: s.priority,
            quota: s.quota,
            dropped_pages: s.pages.dropped(),
            owner_name: s.owner.name.clone(),
            stuck_pins: core.pins.session(session_id).stuck,
            linger: s.linger,
            allocated_blocks: s.pages.allocated_blocks(),
            tokens: s.tokens(),
            device_bytes: s.pages.bytes(),
            counters: s.counters,
            dram_bytes: s.pages.bytes_in(TierKind::Dram),
            flash_bytes: s.pages.bytes_in(TierKind::Flash),
            pages: [TierKind::Device, TierKind::Dram, TierKind::Flash].map(|t| s.pages.count_in(t)),
        })
    }

    /// The caller's uid's orphaned sessions (of model `model_id` when it is not empty), newest first.
    pub fn orphans(&self, caller: ConnInfo, model_id: &str) -> Vec<OrphanInfo> {
        let core = self.core.lock();
        core.sessions
            .orphans_of_uid(caller.uid)
            .into_iter()
            .filter(|s| model_id.is_empty() || s.model_id == model_id)
            .map(|s| OrphanInfo {
                session_id: s.id,
                model_id: s.model_id.clone(),
                geometry: s.geometry,
                tokens: s.tokens(),
                allocated_blocks: s.pages.allocated_blocks(),
                linger: s.linger,
                orphaned: s.orphaned.map(|since| since.elapsed()).unwrap_or_default(),
                bytes: s.pages.all().map(|(_, _, p)| p.place.footprint()).sum(),
                pid: s.owner.pid,
                process: s.owner.name.clone(),
            })
            .collect()
    }

    /// Makes the listed pages resident and reports where they are: DRAM pages are copied back under
    /// the core lock, flash pages are read (one batch) with the core lock released, after making
    /// room on the device by demoting the coldest pages of any session, never those of the layers
    /// named here. A page that fails authentication fails the call with `DATA_LOSS` naming it (the
    /// others are promoted); a page that cannot get a frame fails it with `RESOURCE_EXHAUSTED`.
    pub fn fault(&self, caller: ConnInfo, session_id: u64, pages: &[(u32, u32)]) -> Result<Vec<Residency>> {
        let started = Instant::now();
        let out = self.fault_pages(caller, session_id, pages);
        self.metrics.observe_fault(started.elapsed());
        out
    }

    fn fault_pages(&self, caller: ConnInfo, session_id: u64, pages: &[(u32, u32)]) -> Result<Vec<Residency>> {
        self.admit()?;
        let refs: Vec<PageRef> = {
            let mut core = self.core.lock();
            let s = core.sessions.get_mut(session_id, caller.uid, caller.id)?;
            s.last_access = Instant::now();
            for &(layer, block) in pages {
                check_page(s, layer, block)?;
            }
            s.counters.faults += pages.len() as u64;
            for p in pages.iter().filter_map(|&(l, b)| s.pages.page(l, b)) {
                self.metrics.count_fault(p.place.tier());
            }
            s.counters.fault_hits +=
                pages.iter().filter(|&&(l, b)| s.pages.page(l, b).is_some_and(|p| p.frame().is_some())).count() as u64;
            pages.iter().map(|&(layer, block)| PageRef { session: session_id, layer, block }).collect()
        };
        // Room may be held by other clients' pins or just-promoted pages for a moment: try again a
        // few times before reporting the device as exhausted.
        let mut attempt = 0;
        loop {
            let lost = self.promote(session_id, &refs)?;
            if let Some((page, error)) = lost.into_iter().next() {
                crate::limited!(error, session = session_id, layer = page.layer, block = page.block, error = %error, "page lost");
                return Err(error.into());
            }
            let core = self.core.lock();
            let s = core.sessions.get(session_id, caller.uid, caller.id)?;
            let mut out = Vec::with_capacity(pages.len());
            for &(layer, block) in pages {
                let (generation, flags) = s.table.entry(layer, block)?.load_state(std::sync::atomic::Ordering::Acquire);
                out.push(Residency {
                    layer,
                    block,
                    resident: flags.contains(kvmm_shm::PageFlags::RESIDENT),
                    generation,
                    dropped: flags.contains(kvmm_shm::PageFlags::DROPPED),
                });
            }
            // A dropped page is settled: it is gone, and the client skips it.
            let Some(r) = out.iter().find(|r| !r.resident && !r.dropped) else { return Ok(out) };
            if attempt >= FAULT_ATTEMPTS {
                let need = s.pages.page(r.layer, r.block).map_or(0, |p| p.place.footprint());
                return Err(Error::Exhausted {
                    tier: "device",
                    requested: need,
                    available: core.pool.budget().saturating_sub(core.pool.used()),
                    budget: core.pool.budget(),
                });
            }
            drop(core);
            attempt += 1;
            std::thread::sleep(FAULT_RETRY);
        }
    }

    /// Promotes `refs` (pages of one session) to the device; returns the pages that failed
    /// authentication. Pages already resident, and pages no room could be made for, are left alone.
    pub fn promote(&self, session_id: u64, refs: &[PageRef]) -> Result<Vec<(PageRef, kvmm_store::tier::TierError)>> {
        let mut scratch = Scratch::default();
        let mut core = self.core.lock();
        let Some(s) = core.sessions.get_unchecked(session_id) else { return Ok(Vec::new()) };
        // Every page of the named layers stays: the client is about to read all of them.
        let layers: HashSet<u32> = refs.iter().map(|r| r.layer).collect();
        let mut protect: HashSet<PageRef> = refs.iter().copied().collect();
        for &layer in &layers {
            for block in 0..s.pages.allocated_blocks() {
                protect.insert(PageRef { session: session_id, layer, block });
            }
        }
        let missing: Vec<(PageRef, Place)> = refs
            .iter()
            .filter_map(|&r| s.pages.page(r.layer, r.block).map(|p| (r, p.place)))
            .filter(|(_, place)| !matches!(place, Place::Device(_)))
            .collect();
        if missing.is_empty() {
            return Ok(Vec::new());
        }
        // Frames as large as the largest missing page, one per page: enough whatever their formats.
        let room = tiering::Room {
            uid: Some(s.owner.uid),
            frame_len: missing.iter().map(|(_, p)| p.footprint()).max().unwrap_or(0),
            count: missing.len() as u64,
        };
        let demotion = self.demotion();
        tiering::make_room(&mut core, self.flash.as_ref(), &demotion, room, &protect, &mut scratch)?;
        for &(r, place) in &missing {
            if matches!(place, Place::Dram(_)) {
                tiering::promote_from_dram(&mut core, r, &mut scratch)?;
            }
        }
        let flash_pages: Vec<PageRef> =
            missing.iter().filter(|(_, p)| matches!(p, Place::Flash(_))).map(|(r, _)| *r).collect();
        let (Some(flash), false) = (self.flash.as_ref(), flash_pages.is_empty()) else { return Ok(Vec::new()) };
        let mut inbound = tiering::prepare_flash_reads(&mut core, &flash_pages);
        drop(core);
        let read = tiering::read_from_flash(&mut flash.lock(), &mut inbound, &self.metrics);
        crate::failpoint::hit("promote-after-read");
        let mut core = self.core.lock();
        let mut freed = Vec::new();
        let lost = tiering::commit_flash_reads(&mut core, inbound, read, &mut freed);
        crate::failpoint::hit("promote-after-publish");
        drop(core);
        tiering::free_flash_slots(flash, freed);
        lost
    }

    /// Records a prefetch hint for a range of pages; returns (resident, scheduled).
    pub fn prefetch(
        &self,
        caller: ConnInfo,
        session_id: u64,
        layers: std::ops::Range<u32>,
        blocks: std::ops::Range<u32>,
    ) -> Result<(u32, u32)> {
        self.admit()?;
        let mut core = self.core.lock();
        let s = core.sessions.get_mut(session_id, caller.uid, caller.id)?;
        s.last_access = Instant::now();
        if layers.is_empty() || blocks.is_empty() {
            return Err(Error::InvalidArgument("a prefetch must name at least one layer and one block".to_owned()));
        }
        check_page(s, layers.end - 1, blocks.end - 1)?;
        let n = (layers.end - layers.start) * (blocks.end - blocks.start);
        s.counters.prefetches += u64::from(n);
        let mut scheduled = Vec::new();
        for layer in layers {
            for block in blocks.clone() {
                if s.pages.page(layer, block).is_some_and(|p| !matches!(p.place, Place::Device(_))) {
                    scheduled.push(PageRef { session: session_id, layer, block });
                }
            }
        }
        let count = scheduled.len() as u32;
        if count > 0 {
            core.prefetch_queue.extend(scheduled);
            self.wake_tiers();
        }
        Ok((n - count, count))
    }

    /// Turns open-ended ranges (an end of `u32::MAX`, "to the last") into the session's real extents.
    pub fn clamp_ranges(
        &self,
        session_id: u64,
        layers: std::ops::Range<u32>,
        blocks: std::ops::Range<u32>,
    ) -> Result<(std::ops::Range<u32>, std::ops::Range<u32>)> {
        let core = self.core.lock();
        let s = core.sessions.get_unchecked(session_id).ok_or(Error::UnknownSession(session_id))?;
        let end = |r: std::ops::Range<u32>, last: u32| r.start..if r.end == u32::MAX { last } else { r.end };
        Ok((end(layers, s.geometry.layers), end(blocks, s.pages.allocated_blocks())))
    }

    /// Recompresses a range of a session's pages in place (admin; the policy engine's primitive):
    /// every page to `to`, or with `adaptive` each to the allocation around `to` that a demotion
    /// under adaptive precision would give it (the `[policy]` ranking), within the layers' floors.
    pub fn compress(
        &self,
        session_id: u64,
        layers: std::ops::Range<u32>,
        blocks: std::ops::Range<u32>,
        to: kvmm_kernels::Format,
        adaptive: bool,
    ) -> Result<crate::migrate::recompress::RecompressReport> {
        self.admit()?;
        let mut scratch = Scratch::default();
        let how = Demotion { format: Some(to), adaptive, ..self.demotion() };
        let report = crate::migrate::recompress::recompress(
            &mut self.core.lock(),
            session_id,
            layers,
            blocks,
            &how,
            &mut scratch,
        )?;
        tracing::info!(session = session_id, format = to.name(), adaptive, ?report, "recompressed");
        Ok(report)
    }

    /// Moves the full pages of a range of a session down to `to` (DRAM or flash) now; reports
    /// where the range's pages are afterwards and why those left behind stayed.
    pub fn demote(
        &self,
        session_id: u64,
        layers: std::ops::Range<u32>,
        blocks: std::ops::Range<u32>,
        to: TierKind,
    ) -> Result<DemoteReport> {
        self.admit()?;
        let missing = |tier: &str| {
            Error::FailedPrecondition(format!("kvmmd runs without a {tier} tier; configure tiers.{tier}_budget"))
        };
        match to {
            TierKind::Device => return Err(Error::InvalidArgument("demote to TIER_DRAM or TIER_FLASH".to_owned())),
            TierKind::Dram if self.config.tiers.dram_budget == 0 => return Err(missing("dram")),
            TierKind::Flash if self.flash.is_none() => return Err(missing("flash")),
            _ => {}
        }
        let mut core = self.core.lock();
        let s = core.sessions.get_unchecked(session_id).ok_or(Error::UnknownSession(session_id))?;
        if layers.is_empty()
            || layers.end > s.geometry.layers
            || blocks.is_empty()
            || blocks.end > s.pages.allocated_blocks()
        {
            return Err(Error::InvalidArgument(format!(
                "layers {layers:?} × blocks {blocks:?} are out of range: session {session_id} has layers 0..{} and blocks 0..{}",
                s.geometry.layers,
                s.pages.allocated_blocks()
            )));
        }
        let refs: Vec<PageRef> = layers
            .flat_map(|layer| blocks.clone().map(move |block| PageRef { session: session_id, layer, block }))
            .collect();
        let (on_device, not_full): (Vec<PageRef>, Vec<PageRef>) = refs
            .iter()
            .filter(|r| s.pages.page(r.layer, r.block).is_some_and(|p| matches!(p.place, Place::Device(_))))
            .partition(|r| {
                s.region
                    .entry(r.layer, r.block)
                    .is_ok_and(|e| e.tokens_clamped(s.geometry.block_tokens) == s.geometry.block_tokens)
            });
        let demotion = self.demotion();
        let moved = tiering::demote_to_dram(&mut core, &demotion, &on_device, &mut Scratch::default())?;
        let mut no_room = moved.no_room;
        if let (TierKind::Flash, Some(flash)) = (to, self.flash.as_ref()) {
            let s = core.sessions.get_unchecked(session_id).ok_or(Error::UnknownSession(session_id))?;
            let in_dram: Vec<PageRef> = refs
                .iter()
                .filter(|r| s.pages.page(r.layer, r.block).is_some_and(|p| matches!(p.place, Place::Dram(_))))
                .copied()
                .collect();
            let flashed = tiering::move_to_flash(&mut core, flash, &demotion, &in_dram)?;
            no_room += in_dram.len() as u32 - flashed.min(in_dram.len() as u32);
        }
        let s = core.sessions.get_unchecked(session_id).ok_or(Error::UnknownSession(session_id))?;
        let there = refs
            .iter()
            .filter(|r| {
                s.pages.page(r.layer, r.block).is_some_and(|p| match p.place {
                    Place::Device(_) => false,
                    Place::Dram(_) => to == TierKind::Dram,
                    Place::Flash(_) => true,
                })
            })
            .count() as u32;
        Ok(DemoteReport {
            there,
            left: refs.len() as u32 - there,
            not_full: not_full.len() as u32,
            pinned: moved.pinned,
            no_room,
        })
    }

    /// Daemon-wide status.
    pub fn status(&self) -> Status {
        self.status_of(&self.core.lock())
    }

    /// [`Daemon::status`] and [`Daemon::usage`] taken in one snapshot, so that each tier's pages
    /// by format add up to its page count while pages are moving (admin `Status`).
    pub fn status_with_usage(&self) -> (Status, Usage) {
        let core = self.core.lock();
        (self.status_of(&core), usage_of(&core))
    }

    fn status_of(&self, core: &Core) -> Status {
        Status {
            budget: core.pool.budget(),
            used: core.pool.used(),
            frames: core.pool.frame_count(),
            session_bytes: core.sessions.iter().map(|s| s.pages.bytes()).sum(),
            reserved: core.reserved.plus(core.quarantine.totals()),
            sessions: core.sessions.len() as u32,
            trust_domains: core.pool.arena_count() as u32,
            moves: core.moves,
            moves_skipped_pinned: core.moves_skipped_pinned,
            stuck_pins: core.pins.total(),
            orphaned_sessions: core.sessions.iter().filter(|s| s.orphaned.is_some()).count() as u32,
            dram: core.dram.as_ref().map(Tier::stats),
            flash: self.flash_stats.as_ref().map(FlashStats::get),
            io_engine: self.io_engine.clone(),
            tier_counters: core.tier_counters,
            pages_device: core.sessions.iter().map(|s| s.pages.count_in(TierKind::Device)).sum(),
            pages_dram: core.sessions.iter().map(|s| s.pages.count_in(TierKind::Dram)).sum(),
            pages_flash: core.sessions.iter().map(|s| s.pages.count_in(TierKind::Flash)).sum(),
        }
    }
}

/// Pages and bytes per tier and format over every session of `core`.
fn usage_of(core: &Core) -> Usage {
    let mut all = Usage::default();
    for s in core.sessions.iter() {
        all.add(&Usage::of(s));
    }
    all
}

/// The quota a client asked for, checked: eviction needs a quota, and a quota must hold the pages
/// eviction always keeps.
fn quota_from(geometry: &Geometry, quota_tokens: u32, evict: bool) -> Result<Quota> {
    if quota_tokens == 0 {
        if evict {
            return Err(Error::InvalidArgument(
                "eviction drops pages only over a quota: set quota_tokens as well as evict".to_owned(),
            ));
        }
        return Ok(Quota::default());
    }
    let bt = geometry.block_tokens;
    let least = crate::migrate::evict::min_quota_pages(bt);
    if quota_tokens / bt < least {
        return Err(Error::InvalidArgument(format!(
            "quota_tokens {quota_tokens} is too small: at {bt} tokens per page a session needs at least {} \
             (the first page, the last {} tokens and the page being written)",
            least * bt,
            crate::migrate::tiering::RECENT_WINDOW_TOKENS
        )));
    }
    Ok(Quota { pages_per_layer: Some(quota_tokens / bt), evict })
}

/// Creates `dir` and any missing parents with mode 0700 (the flash file's directory: only the
/// daemon's user may list or open what is in it). A directory that exists is left as it is.
fn create_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

/// Checks that a page is inside the geometry and allocated.
fn check_page(s: &Session, layer: u32, block: u32) -> Result<()> {
    if layer >= s.geometry.layers {
        return Err(Error::InvalidArgument(format!(
            "layer {layer} is out of range: session {} has layers 0..{}",
            s.id, s.geometry.layers
        )));
    }
    if block >= s.pages.allocated_blocks() {
        return Err(Error::InvalidArgument(format!(
            "block {block} is out of range: session {} has blocks 0..{} allocated (call Extend first)",
            s.id,
            s.pages.allocated_blocks()
        )));
    }
    Ok(())
}

/// Pages and bytes per (tier, format code), tiers numbered 0 device, 1 DRAM, 2 flash.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage(pub std::collections::BTreeMap<(u8, u8), (u64, u64)>);

impl Usage {
    /// One session's pages.
    pub fn of(s: &Session) -> Usage {
        let mut u = Usage::default();
        for (_, _, page) in s.pages.all() {
            let tier = match page.place.tier() {
                TierKind::Device => 0,
                TierKind::Dram => 1,
                TierKind::Flash => 2,
            };
            let e = u.0.entry((tier, page.format.as_u8())).or_default();
            e.0 += 1;
            e.1 += page.place.footprint();
        }
        u
    }

    fn add(&mut self, other: &Usage) {
        for (k, (pages, bytes)) in &other.0 {
            let e = self.0.entry(*k).or_default();
            e.0 += pages;
            e.1 += bytes;
        }
    }
}

/// One session as an operator sees it.
#[derive(Clone, Debug)]
pub struct SessionInfo {
    pub id: u64,
    pub uid: u32,
    pub pid: i32,
    pub executable: String,
    pub geometry: Geometry,
    pub model_id: String,
    pub priority: Priority,
    pub tokens: u64,
    pub usage: Usage,
    pub quota: Quota,
    pub dropped_pages: u64,
    pub idle: std::time::Duration,
    pub attached: std::time::Duration,
    pub pins: SessionPins,
    pub linger: std::time::Duration,
    /// Since its connection closed, while it waits for a `Resume`.
    pub orphaned: Option<std::time::Duration>,
}

impl SessionInfo {
    fn of(s: &Session, pins: &PinWatch) -> SessionInfo {
        SessionInfo {
            id: s.id,
            uid: s.owner.uid,
            pid: s.owner.pid,
            executable: s.owner.name.clone(),
            geometry: s.geometry,
            model_id: s.model_id.clone(),
            priority: s.priority,
            tokens: s.tokens(),
            usage: Usage::of(s),
            quota: s.quota,
            dropped_pages: s.pages.dropped(),
            idle: s.last_access.elapsed(),
            attached: s.attached_at.elapsed(),
            pins: pins.session(s.id),
            linger: s.linger,
            orphaned: s.orphaned.map(|since| since.elapsed()),
        }
    }
}

/// Which sessions a wipe takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WipeScope {
    /// One session.
    Session(u64),
    /// Every session of a uid.
    User(u32),
    /// Every session.
    All,
}

/// What [`Daemon::truncate`] gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TruncateReport {
    /// Blocks now allocated per layer.
    pub allocated_blocks: u32,
    /// Pages freed, all layers (pages dropped by eviction had nothing to free).
    pub freed_pages: u32,
    /// Bytes those pages took in their tiers.
    pub freed_bytes: u64,
    /// Bytes of device frames the session owns now.
    pub device_bytes: u64,
}

/// Bytes wiped per tier, and sessions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WipeReport {
    pub device: u64,
    pub dram: u64,
    pub flash: u64,
    pub sessions: u32,
}

impl WipeReport {
    /// Bytes over all tiers.
    pub fn total(&self) -> u64 {
        self.device + self.dram + self.flash
    }

    fn add(&mut self, other: &WipeReport) {
        self.device += other.device;
        self.dram += other.dram;
        self.flash += other.flash;
    }
}

/// Orphans a lingering session whose connection closed: it gets a fresh client region holding the
/// old one's token counts and attention mass (clamped) but no pins, since the process that held
/// them is gone, or no longer speaks for the session, and a process that is still running keeps
/// writing to the old region, which no one reads any more.
fn orphan(s: &mut Session) -> Result<()> {
    let (memfd, region) = ClientRegion::create(&s.geometry)?;
    let bt = s.geometry.block_tokens;
    for layer in 0..s.geometry.layers {
        for block in 0..s.pages.allocated_blocks() {
            let (old, new) = (s.region.entry(layer, block)?, region.entry(layer, block)?);
            new.publish_tokens(old.tokens_clamped(bt));
            new.set_importance(old.importance_clamped());
        }
    }
    s.region = region;
    s.region_memfd = memfd;
    s.orphaned = Some(Instant::now());
    Ok(())
}

/// Removes a session: marks its shared table `status`, zeroes and frees its frames and DRAM slots
/// (writes the compiler cannot drop), punches its flash slots out, and drops its key (zeroized
/// with its last holder). Pins do not block this: the client is gone, asked for it, or an operator
/// did. With `hold_pinned` (an administrator's wipe, which can come while the client is running),
/// device frames the client still pins are zeroed and held in the quarantine instead of freed.
/// Returns the bytes wiped per tier.
///
/// The session is gone from the registry and its table before its device frames are zeroed, and
/// the core lock is handed to waiting requests between frames ([`LockPacer`]); meanwhile the
/// frames still to be zeroed count as reserved (in `used`, in no page table), so `Status` adds up
/// at every point. An admin wipe of a 270 MB session, zeroed under one lock hold, kept another
/// client's calls waiting up to 15–20 ms; with the lock handed over, 5–6 ms (`cargo bench -p
/// kvmm-client --bench stall`, 2026-12-03).
fn destroy(
    core: &mut MutexGuard<'_, Core>,
    flash: Option<&Mutex<FlashFile>>,
    id: u64,
    status: TableStatus,
    hold_pinned: bool,
) -> Result<WipeReport> {
    let Some(mut s) = core.sessions.remove(id) else { return Ok(WipeReport::default()) };
    core.tokens.remove(id);
    core.pins.forget(id);
    let mut report = WipeReport { sessions: 1, ..WipeReport::default() };
    // The status first, ordered before every write below: a client still running (a wipe) may be
    // reading pages it pinned before the wipe, which are zeroed under it; it looks at the status
    // after every such access and fails the call with FAILED_PRECONDITION rather than return what
    // it read (tests/tests/wipe.rs, found by kvmm-soak: it used to be published last).
    s.table.set_status(status)?;
    // Then the shared entries: the client can pin nothing from here on, and faults get
    // FAILED_PRECONDITION.
    for (layer, block, _) in s.pages.all() {
        s.table.entry_writer(layer, block)?.clear();
    }
    // Dekker's other half (the pin/migrate protocol): a pin the client announced before it saw an
    // entry cleared is visible after this fence. Those frames are zeroed now and held until the pin
    // goes, so that a row write under way cannot land in another session's frame. (A detach or an
    // owner's own wipe needs none of this: the client library gives the session up, or holds it
    // exclusively, for those calls; and a closed connection frees what it held anyway.)
    let mut pinned: Vec<(u32, u32, Frame)> = Vec::new();
    if hold_pinned {
        kvmm_shm::protocol::migrate_fence();
        pinned = s
            .pages
            .all()
            .filter_map(|(layer, block, page)| match page.place {
                Place::Device(frame) => Some((layer, block, frame)),
                _ => None,
            })
            .filter(|&(layer, block, _)| s.region.entry(layer, block).map_or(true, |e| e.pins() != 0))
            .collect();
    }
    if !pinned.is_empty() {
        let arena = core
            .pool
            .arena(s.owner.uid)
            .ok_or_else(|| Error::FailedPrecondition(format!("uid {} has no arena", s.owner.uid)))?;
        for &(_, _, frame) in &pinned {
            arena.zero(frame)?;
        }
        let region = Arc::new(s.region);
        for &(layer, block, frame) in &pinned {
            core.quarantine.hold(s.owner.uid, frame, s.owner.conn, Arc::clone(&region), layer, block);
        }
        tracing::debug!(session = id, frames = pinned.len(), "pinned frames of a destroyed session held");
    }
    let mut flash_slots = Vec::new();
    let mut to_zero = Vec::new();
    for place in s.pages.take_all() {
        match place {
            Place::Device(_) => report.device += place.footprint(),
            Place::Dram(_) => report.dram += place.footprint(),
            Place::Flash(_) => report.flash += place.footprint(),
        }
        match place {
            Place::Device(frame) if pinned.iter().any(|&(_, _, held)| held == frame) => {}
            Place::Device(frame) => {
                core.reserved.add(frame);
                to_zero.push(frame);
            }
            Place::Dram(slot) => {
                if let Some(dram) = core.dram.as_mut() {
                    dram.free(slot);
                }
            }
            Place::Flash(slot) => flash_slots.push(slot),
        }
    }
    discard_unlocked(core, flash, id, flash_slots);
    free_frames_paced(core, s.owner.uid, to_zero)?;
    Ok(report)
}

/// [`tiering::discard_flash_slots`] with the core lock released for it, when there is anything to
/// discard: releasing it for nothing would let another request see a state the caller has not
/// finished (a destroyed session's frames still reserved, not yet freed).
fn discard_unlocked(
    core: &mut MutexGuard<'_, Core>,
    flash: Option<&Mutex<FlashFile>>,
    session: u64,
    slots: Vec<kvmm_store::flash::FlashSlot>,
) {
    if flash.is_some() && !slots.is_empty() {
        MutexGuard::unlocked(core, || tiering::discard_flash_slots(flash, session, slots));
    }
}

/// Frees `frames` of `uid`'s arena (which zeroes them), handing the core lock over between them
/// ([`LockPacer`]); each must be in `core.reserved` until then, so that the pool's accounting holds
/// while the lock is away. Every frame is freed even if one fails; the first failure is returned.
fn free_frames_paced(core: &mut MutexGuard<'_, Core>, uid: u32, frames: Vec<Frame>) -> Result<()> {
    let mut pacer = LockPacer::start();
    let mut failed = None;
    for frame in frames {
        core.reserved.remove(frame);
        if let Err(e) = core.pool.free_frame(uid, frame) {
            failed.get_or_insert(e);
        }
        pacer.between_pages(core);
    }
    debug_assert_eq!(core.pool.used(), core.pool.used_by_arenas());
    failed.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::{ExpectedShape, Geometry, create_private_dir};

    #[test]
    fn a_resume_takes_a_session_whose_shape_fits_and_says_why_one_does_not() {
        let g = Geometry {
            layers: 5,
            kv_heads: 4,
            q_heads: 8,
            head_dim: 16,
            block_tokens: 32,
            element_type: kvmm_kernels::ElementType::F16,
            max_tokens: 256,
        };
        let model = ExpectedShape::of_model(&g);
        assert!(model.mismatch(7, &g).is_none(), "unset fields take the session's");
        let exact = ExpectedShape { block_tokens: Some(32), max_tokens: Some(256), ..model };
        assert!(exact.mismatch(7, &g).is_none());
        for wrong in [
            ExpectedShape { layers: 6, ..model },
            ExpectedShape { head_dim: 32, ..model },
            ExpectedShape { block_tokens: Some(16), ..model },
            ExpectedShape { element_type: Some(kvmm_kernels::ElementType::Bf16), ..model },
            ExpectedShape { max_tokens: Some(512), ..model },
        ] {
            let e = wrong.mismatch(7, &g).unwrap().to_string();
            assert!(
                e.starts_with(
                    "session 7 has 5 layers, 4 KV heads, 8 query heads, head_dim 16, 32 tokens per block, \
                               f16 elements, room for 256 tokens, not "
                ) && e.ends_with("as asked: it was attached for another model; it is left as it was"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_flash_directory_is_created_private_and_an_existing_one_is_left_alone() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("state/kvmm");
        create_private_dir(&dir).unwrap();
        for d in [&dir, &root.path().join("state")] {
            assert_eq!(std::fs::metadata(d).unwrap().permissions().mode() & 0o777, 0o700, "{}", d.display());
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750)).unwrap();
        create_private_dir(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o750);
    }
}
