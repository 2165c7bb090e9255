//! Page migration: the move primitive ([`mover`]), recompression in place ([`recompress`]), moves
//! between tiers ([`tiering`]), the compaction planner and pass ([`compact`]) and the test churn
//! driver ([`churn`]), plus the background tasks that run them.

pub mod churn;
pub mod compact;
pub mod mover;
pub mod recompress;
pub mod tiering;

use std::sync::Arc;
use std::time::Duration;

use crate::daemon::Daemon;

/// Moves per arena in one compaction pass; bounds how long one pass holds the core lock.
const COMPACTION_MOVES_PER_PASS: usize = 256;

/// Runs compaction every `interval` until the daemon shuts down.
pub async fn compaction_task(daemon: Arc<Daemon>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !daemon.is_shutting_down() {
        tick.tick().await;
        let report = compact::run_pass(&mut daemon.core.lock(), COMPACTION_MOVES_PER_PASS);
        match report {
            Ok(r) if r.moved > 0 => tracing::debug!(moved = r.moved, skipped = r.skipped, "compaction pass"),
            Ok(_) => {}
            Err(e) => tracing::error!(error = %e, "compaction pass failed"),
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

/// The tier task, on a thread of its own (flash I/O blocks): carries out prefetch hints, and keeps
/// the device and the DRAM pool under their high watermarks by demoting their coldest pages down to
/// the low watermarks. Runs until the daemon shuts down.
pub fn tier_task(daemon: Arc<Daemon>) {
    let t = daemon.config.tiers.clone();
    let mut scratch = tiering::Scratch::default();
    let none = std::collections::HashSet::new();
    while !daemon.is_shutting_down() {
        {
            let (flag, cv) = &daemon.tier_wanted;
            let mut wanted = flag.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !*wanted {
                wanted = cv.wait_timeout(wanted, TIER_TICK).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
            }
            *wanted = false;
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
        let device = {
            let mut core = daemon.core.lock();
            let budget = core.pool.budget();
            if core.pool.used() > budget / 100 * u64::from(t.high_watermark) {
                let need = budget - budget / 100 * u64::from(t.low_watermark);
                let room = tiering::Room { uid: None, frame_len: need, count: 1 };
                tiering::make_room(&mut core, daemon.flash.as_ref(), t.demote_format, room, &none, &mut scratch)
            } else {
                Ok(true)
            }
        };
        if let Err(e) = device {
            tracing::warn!(error = %e, "background demotion from the device failed");
        }
        if let Some(flash) = daemon.flash.as_ref() {
            let mut core = daemon.core.lock();
            let over = core.dram.as_ref().map(kvmm_store::tier::Tier::stats).and_then(|d| {
                (d.used > d.budget / 100 * u64::from(t.high_watermark))
                    .then(|| d.used - d.budget / 100 * u64::from(t.low_watermark))
            });
            if let Some(bytes) = over {
                let victims = tiering::pick_victims(&core, tiering::VictimTier::Dram, bytes, &none);
                if let Err(e) = tiering::move_to_flash(&mut core, flash, &victims) {
                    tracing::warn!(error = %e, "background demotion to flash failed");
                }
            }
        }
    }
}
