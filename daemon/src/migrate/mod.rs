//! Page migration: the move primitive ([`mover`]), recompression in place ([`recompress`]), moves
//! between tiers ([`tiering`]), opt-in eviction under a quota ([`evict`]), the compaction planner and pass ([`compact`]) and the test churn
//! driver ([`churn`]), plus the background tasks that run them.

pub mod churn;
pub mod compact;
pub mod evict;
pub mod mover;
pub mod recompress;
pub mod tiering;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmm_store::dram::DramPool;
use kvmm_store::pace::CpuShare;

use parking_lot::Mutex;

use crate::daemon::Daemon;
use crate::policy::mode::Tuning;
use crate::policy::plan::{self, Allowance, Plan, PoolView};
use crate::policy::rate::RateLimit;

/// How long a loop over many pages holds the core lock before it hands it to a waiting request.
const LOCK_SLICE: Duration = Duration::from_micros(100);

/// Paces a loop that works on many pages under the core lock (recompression, demotion, taking DRAM
/// pages for flash, compaction, zeroing a destroyed session's frames): every page's move begins and
/// ends under the lock, and between pages the pacer shares the lock and the CPU.
/// - Once the loop has held the lock for [`LOCK_SLICE`], it hands it to a waiting request
///   ([`parking_lot::MutexGuard::bump`], a fair handoff; nothing happens when no one waits) and
///   takes it back. An admin `Compress` of 2,048 Llama-3-8B pages made another client's
///   `SessionStats` calls wait 73–99 ms (all of it) before.
/// - Once it has run for its CPU slice ([`CpuShare`]), it also yields the CPU (`sched_yield`) with
///   the lock released. Without that, a worker woken on the loop's CPU to serve another client
///   waited out the loop's scheduler slice: 10–14 ms, every call when kvmmd ran on one CPU.
///
/// With both, the other client's calls during a `Compress` or `Demote` of 270 MB had a p99 of
/// 0.27–1.4 ms and a maximum of 0.9–7.6 ms, pinned to one CPU or not (`cargo bench -p kvmm-client
/// --bench stall`, 2026-12-03; see ARCHITECTURE.md, "Concurrency").
#[derive(Debug)]
pub struct LockPacer {
    /// When the loop last took the lock back.
    locked_since: Instant,
    /// The loop's share of its CPU.
    cpu: CpuShare,
}

impl LockPacer {
    /// A pacer whose slices start now.
    pub fn start() -> LockPacer {
        LockPacer { locked_since: Instant::now(), cpu: CpuShare::start() }
    }

    /// Between two pages: hands the lock over if its slice is used up, and yields the CPU too if
    /// the CPU's slice is.
    pub fn between_pages(&mut self, core: &mut parking_lot::MutexGuard<'_, crate::daemon::Core>) {
        if self.locked_since.elapsed() < LOCK_SLICE {
            return;
        }
        if self.cpu.used_up() {
            self.cpu.give_way(|yield_now| parking_lot::MutexGuard::unlocked_fair(core, yield_now));
        } else {
            parking_lot::MutexGuard::bump(core);
        }
        self.locked_since = Instant::now();
    }
}

/// Moves per arena in one compaction pass; bounds how long one pass holds the core lock.
const COMPACTION_MOVES_PER_PASS: usize = 256;

/// Runs compaction every `interval` until the daemon shuts down.
pub async fn compaction_task(daemon: Arc<Daemon>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !daemon.is_shutting_down() {
        tick.tick().await;
        // On the blocking pool: a pass copies up to 256 pages per arena, which would hold up the
        // requests queued on an async worker meanwhile.
        let passing = daemon.clone();
        let report =
            tokio::task::spawn_blocking(move || compact::run_pass(&mut passing.core.lock(), COMPACTION_MOVES_PER_PASS))
                .await;
        match report {
            Ok(Ok(r)) if r.moved > 0 => tracing::debug!(moved = r.moved, skipped = r.skipped, "compaction pass"),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "compaction pass failed"),
            Err(e) => tracing::error!(error = %e, "the compaction task failed"),
        }
    }
}

/// Moves random pages continuously (test driver) until the daemon shuts down.
pub async fn churn_task(daemon: Arc<Daemon>) {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    let mut picker = churn::Picker::new(seed);
    while !daemon.is_shutting_down() {
        if let Err(e) = churn::churn(&mut daemon.core.lock(), &mut picker, 8) {
            tracing::error!(error = %e, "move churn failed");
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// How often the tier task looks at the watermarks when nothing wakes it.
const TIER_TICK: Duration = Duration::from_millis(20);

/// How often the pin counts are read for `lease`: a quarter of it, within 50 ms to 1 s (a stuck
/// pin is reported at most a quarter of its lease late).
fn pin_scan_every(lease: Duration) -> Duration {
    (lease / 4).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// Reads the pin counts ([`watch_pins`]) every [`pin_scan_every`] the lease until the daemon shuts
/// down, on the blocking pool (a scan holds the core lock for as long as it reads every page),
/// revokes the sessions with a new stuck pin where `revoke_stuck_pins` says so, and
/// frees the held frames whose pin went ([`Daemon::release_quarantined`]; the tier thread does too,
/// more often, but it runs only with a tier below the device), and wipes the orphaned sessions whose
/// linger time ran out ([`Daemon::expire_orphans`]: at most one scan period late).
pub async fn pin_watch_task(daemon: Arc<Daemon>) {
    let every = pin_scan_every(daemon.config.pin_lease);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !daemon.is_shutting_down() {
        tick.tick().await;
        let scanning = daemon.clone();
        let scan = tokio::task::spawn_blocking(move || {
            let stuck = watch_pins(&mut scanning.core.lock(), Instant::now());
            if scanning.config.revoke_stuck_pins {
                scanning.revoke(&stuck);
            }
            scanning.release_quarantined();
            scanning.expire_orphans(Instant::now());
        })
        .await;
        if let Err(e) = scan {
            tracing::error!(error = %e, "the pin watch failed");
        }
    }
}

/// Reads the pin and unpin counts of every allocated page from the client regions, feeds them to
/// the pin watch ([`crate::session::pins`]) and logs each pin that crossed the lease in this scan.
/// Under the core lock: two relaxed loads per page, and a map entry per pinned page. Returns the
/// sessions with a pin that crossed the lease in this scan.
pub fn watch_pins(core: &mut crate::daemon::Core, now: Instant) -> Vec<u64> {
    let crate::daemon::Core { sessions, pins, .. } = core;
    let mut pinned = Vec::new();
    let mut pages = 0;
    for s in sessions.iter() {
        let blocks = s.pages.allocated_blocks() as usize;
        for layer in 0..s.geometry.layers {
            let Ok(entries) = s.region.entries_of_layer(layer) else { continue };
            pages += blocks.min(entries.len());
            for (block, e) in (0u32..).zip(entries.iter().take(blocks)) {
                if e.pins() != 0 {
                    pinned.push((tiering::PageRef { session: s.id, layer, block }, e.unpins()));
                }
            }
        }
    }
    tracing::trace!(pages, pinned = pinned.len(), took_us = now.elapsed().as_micros() as u64, "pin scan");
    let crossed = pins.observe(now, pinned);
    let mut sessions_crossed: Vec<u64> = crossed.iter().map(|stuck| stuck.page.session).collect();
    sessions_crossed.sort_unstable();
    sessions_crossed.dedup();
    for stuck in crossed {
        let r = stuck.page;
        let (uid, pid) = sessions.get_unchecked(r.session).map_or((0, 0), |s| (s.owner.uid, s.owner.pid));
        // A client that pins many pages for good would otherwise write a line for each.
        crate::limited!(
            warn,
            session = r.session,
            layer = r.layer,
            block = r.block,
            uid,
            pid,
            held_ms = stuck.held.as_millis() as u64,
            lease_ms = pins.lease().as_millis() as u64,
            "a page has been pinned past the pin lease without an unpin: it cannot move until its client unpins it; \
             `kvmmctl wipe SESSION` revokes the session"
        );
    }
    sessions_crossed
}

/// What the tier mover and the flash drain share: the byte budgets of background migration (the
/// background limit covers what both move, the flash-write limit what the drain writes) and the
/// drain's wake-up.
#[derive(Debug)]
pub struct Shared {
    rates: Mutex<Rates>,
    /// Woken when the tier mover finds the DRAM pool over its watermark.
    flash_wanted: Wakeup,
}

#[derive(Debug)]
struct Rates {
    background: RateLimit,
    flash_writes: RateLimit,
}

impl Shared {
    fn new(tuning: &Tuning, now: Instant) -> Shared {
        Shared {
            rates: Mutex::new(Rates {
                background: RateLimit::new(tuning.background_bytes_per_s, now),
                flash_writes: RateLimit::new(tuning.flash_write_bytes_per_s, now),
            }),
            flash_wanted: Wakeup::default(),
        }
    }

    /// Puts the rates of `tuning` in force (none while the budgets are shrunk under memory
    /// pressure: the memory has to go back now) and returns what they allow now.
    fn allowance(&self, tuning: &Tuning, now: Instant) -> Allowance {
        let shrunk = plan::shrunk(tuning);
        let mut rates = self.rates.lock();
        rates.background.set_rate(if shrunk { None } else { tuning.background_bytes_per_s }, now);
        rates.flash_writes.set_rate(if shrunk { None } else { tuning.flash_write_bytes_per_s }, now);
        Allowance { background: rates.background.available(now), flash_writes: rates.flash_writes.available(now) }
    }
}

/// A wake-up a background loop waits on: set by whoever has work for it, cleared when it wakes.
#[derive(Debug, Default)]
pub struct Wakeup {
    wanted: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Wakeup {
    /// Wakes the loop (at once if it waits, else at its next wait).
    pub fn wake(&self) {
        *self.wanted.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        self.cv.notify_one();
    }

    /// Waits until woken or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        let mut wanted = self.wanted.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !*wanted {
            wanted = self.cv.wait_timeout(wanted, timeout).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
        }
        *wanted = false;
    }
}

/// Starts the tier mover ([`tier_task`]) and, with a flash tier, the flash drain
/// ([`flash_task`]), each on a thread of its own, so compressing device pages into DRAM and sealing
/// and writing DRAM pages to flash overlap.
pub fn start(daemon: &Arc<Daemon>) -> crate::error::Result<()> {
    let shared = Arc::new(Shared::new(&daemon.tuning(), Instant::now()));
    let spawn = |name: &str, task: fn(Arc<Daemon>, Arc<Shared>)| {
        let (daemon, shared) = (daemon.clone(), shared.clone());
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || task(daemon, shared))
            .map(drop)
            .map_err(|e| crate::error::Error::io(format!("cannot start the {name} thread"), e))
    };
    spawn("kvmm-tiers", tier_task)?;
    if daemon.flash.is_some() {
        spawn("kvmm-flash", flash_task)?;
    }
    Ok(())
}

/// The pools as the planner sees them.
fn pool_view(daemon: &Daemon, core: &crate::daemon::Core) -> PoolView {
    PoolView {
        device_configured: core.pool.configured_budget(),
        device_used: core.pool.used(),
        dram: core.dram.as_ref().map(|d| (d.capacity(), dram_used(core))),
        flash: daemon.flash.is_some(),
    }
}

/// The tier task, on a thread of its own: carries out prefetch hints, and keeps the device under
/// its high watermark by demoting its coldest pages down to the low watermark (into DRAM, which
/// the flash drain keeps under its own watermark). The mode in force
/// ([`crate::policy::mode::Tuning`], read on every pass) sets the watermarks, the demotion format
/// and the byte rates of background migration and of flash writes; the pure planner
/// ([`plan::plan`]) turns them and the pools' state into the bytes this pass moves, and the
/// `[policy]` precision settings ([`crate::policy::precision::Demotion`]) refine the format per
/// page. Runs until the daemon shuts down.
pub fn tier_task(daemon: Arc<Daemon>, shared: Arc<Shared>) {
    let mut scratch = tiering::Scratch::default();
    // Whether a watermark drain of the device is under way.
    let mut draining = false;
    // When free memory was last given back under pressure.
    let mut last_release: Option<Instant> = None;
    let mut last_trim = Instant::now();
    while !daemon.is_shutting_down() {
        daemon.beat(crate::systemd::Loop::Tiers);
        daemon.tier_wanted.wait(TIER_TICK);
        let (tuning, demotion) = {
            let policy = daemon.policy.lock();
            (policy.tuning(), policy.demotion())
        };
        let now = Instant::now();
        let allowed = shared.allowance(&tuning, now);
        let plan = plan::plan(pool_view(&daemon, &daemon.core.lock()), &tuning, draining, allowed);
        apply_budgets(&daemon, &plan, &mut last_release, now);
        daemon.release_quarantined();
        if now.duration_since(last_trim) >= crate::malloc::TRIM_INTERVAL {
            crate::malloc::trim();
            last_trim = now;
        }
        let queued: Vec<tiering::PageRef> = daemon.core.lock().prefetch_queue.drain(..).collect();
        let mut sessions: Vec<u64> = queued.iter().map(|r| r.session).collect();
        sessions.dedup();
        for session in sessions {
            let refs: Vec<tiering::PageRef> = queued.iter().filter(|r| r.session == session).copied().collect();
            if let Err(e) = daemon.promote(session, &refs) {
                tracing::warn!(session, error = %e, "prefetch failed");
            }
        }
        draining = plan.draining;
        if plan.demote_device > 0 {
            let mut core = daemon.core.lock();
            let flash = daemon.flash.as_ref();
            let demoted = tiering::demote_coldest(&mut core, flash, &demotion, plan.demote_device, &mut scratch);
            scratch.wipe();
            match demoted {
                Ok(moved) => {
                    shared.rates.lock().background.spend(moved);
                    core.tier_counters.background_bytes += moved;
                    // Nothing left that may move (pinned, or no room below): wait for the next crossing.
                    draining &= moved > 0;
                }
                Err(e) => tracing::warn!(error = %e, "background demotion from the device failed"),
            }
        }
        if plan.spill_dram > 0 {
            shared.flash_wanted.wake();
        }
    }
}

/// The flash drain, on a thread of its own (started only with a flash tier): keeps the DRAM pool
/// under its high watermark by moving its coldest pages to flash, down to the low watermark, at
/// the rates the mode allows. The core lock is held only to pick and copy the pages and to commit
/// them ([`tiering::move_to_flash`]), so the tier mover compresses more pages into DRAM while
/// these are sealed and written. Runs until the daemon shuts down.
pub fn flash_task(daemon: Arc<Daemon>, shared: Arc<Shared>) {
    let Some(flash) = daemon.flash.as_ref() else { return };
    let none = std::collections::HashSet::new();
    while !daemon.is_shutting_down() {
        daemon.beat(crate::systemd::Loop::Flash);
        shared.flash_wanted.wait(TIER_TICK);
        let (tuning, demotion) = {
            let policy = daemon.policy.lock();
            (policy.tuning(), policy.demotion())
        };
        let allowed = shared.allowance(&tuning, Instant::now());
        let mut core = daemon.core.lock();
        // The device drain is the tier mover's; only the DRAM watermark is acted on here.
        let spill = plan::plan(pool_view(&daemon, &core), &tuning, false, allowed).spill_dram;
        if spill == 0 {
            continue;
        }
        let before = dram_used(&core);
        if let Err(e) = tiering::spill_dram(&mut core, flash, &demotion, spill, &none, tiering::Need::Cold) {
            tracing::warn!(error = %e, "background demotion to flash failed");
        }
        let moved = before.saturating_sub(dram_used(&core));
        core.tier_counters.background_bytes += moved;
        drop(core);
        let mut rates = shared.rates.lock();
        rates.background.spend(moved);
        rates.flash_writes.spend(moved);
    }
}

/// Bytes in the DRAM pool (0 without one).
fn dram_used(core: &crate::daemon::Core) -> u64 {
    core.dram.as_ref().map_or(0, |d| kvmm_store::tier::Tier::stats(d).used)
}

/// How often free memory is given back while the budgets are shrunk.
const RELEASE_EVERY: Duration = Duration::from_millis(500);

/// Sets the device and DRAM budgets the plan puts in force and, while they are shrunk, gives the
/// memory of free frames back to the system every [`RELEASE_EVERY`] (the watermark drain demotes
/// what is over the new budgets first).
fn apply_budgets(daemon: &Daemon, plan: &Plan, last_release: &mut Option<Instant>, now: Instant) {
    let mut core = daemon.core.lock();
    if plan.device_budget != core.pool.budget() {
        tracing::info!(bytes = plan.device_budget, "device budget in force");
        core.pool.set_budget(plan.device_budget);
    }
    if let (Some(dram), Some(limit)) = (core.dram.as_mut(), plan.dram_limit) {
        dram.set_limit(limit);
    }
    if !plan.shrunk {
        *last_release = None;
        return;
    }
    if last_release.is_some_and(|t| now.duration_since(t) < RELEASE_EVERY) {
        return;
    }
    *last_release = Some(now);
    let device = core.pool.release_free();
    let dram = core.dram.as_mut().map_or(0, DramPool::release_free);
    match device {
        Ok(bytes) => tracing::debug!(device = bytes, dram, "free memory given back"),
        Err(e) => tracing::warn!(error = %e, "giving free device memory back failed"),
    }
}
