//! Page migration: the move primitive ([`mover`]), recompression in place ([`recompress`]), the
//! compaction planner and pass ([`compact`]) and the test churn driver ([`churn`]), plus the
//! background tasks that run them.

pub mod churn;
pub mod compact;
pub mod mover;
pub mod recompress;

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
