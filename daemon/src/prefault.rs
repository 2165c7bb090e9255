//! The prefaulter: keeps each arena's memory faulted in a headroom ahead of its high-water mark, so
//! the first touch of fresh memfd memory (~0.6 s/GiB) is paid neither on an `Extend` nor by a client.
//!
//! It takes work under the core lock (cheap: which range is next), populates outside it (the mapping
//! is shared through an `Arc`), and records the result under the lock again. It wakes when `Extend`
//! raises a high-water mark and otherwise every [`IDLE_TICK`].

use std::sync::Arc;
use std::time::Duration;

use kvmm_shm::Access;

use crate::daemon::Daemon;

/// Most bytes populated per job; bounds how long one `madvise` runs.
const MAX_STEP: u64 = 8 << 20;
/// How often the prefaulter looks when nobody wakes it.
const IDLE_TICK: Duration = Duration::from_millis(200);

/// Bytes kept populated beyond each arena's high-water mark: a sixteenth of the budget, between one
/// 2 MiB chunk and 64 MiB.
pub fn headroom(budget: u64) -> u64 {
    (budget / 16).clamp(2 << 20, 64 << 20)
}

/// Runs until the daemon shuts down.
pub async fn prefault_task(daemon: Arc<Daemon>) {
    let headroom = headroom(daemon.config.device_budget);
    while !daemon.is_shutting_down() {
        let jobs = {
            let core = daemon.core.lock();
            // While the budget is shrunk (memory pressure) nothing is faulted in ahead of need.
            let ahead = if core.pool.budget() < core.pool.configured_budget() { 0 } else { headroom };
            core.pool.prefault_jobs(ahead, MAX_STEP)
        };
        if jobs.is_empty() {
            let _ = tokio::time::timeout(IDLE_TICK, daemon.prefault_wanted.notified()).await;
            continue;
        }
        for job in jobs {
            let populated = tokio::task::spawn_blocking(move || {
                let r = job.map.populate(job.start as usize, (job.end - job.start) as usize, Access::ReadWrite);
                (job, r)
            })
            .await;
            match populated {
                Ok((job, Ok(()))) => daemon.core.lock().pool.prefault_done(&job),
                Ok((job, Err(e))) => {
                    // Not fatal: whoever touches the memory first faults it in. Back off.
                    tracing::warn!(uid = job.uid, error = %e, "prefaulting arena memory failed");
                    tokio::time::sleep(IDLE_TICK).await;
                }
                Err(e) => tracing::error!(error = %e, "the prefault worker panicked"),
            }
        }
    }
}
