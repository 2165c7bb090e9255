//! Fail points for the crash-and-restart scenarios (`tests/tests/crash_restart.rs`): named places in
//! a demotion or a promotion where a test makes kvmmd kill itself with `SIGKILL`, as a power cut or
//! the OOM killer would, between two steps that are never meant to be separated.
//!
//! Compiled only into debug builds (the builds the test suite runs); in a release build [`hit`] is
//! an empty inline function. A debug kvmmd reads `KVMM_FAILPOINT=NAME[:N[:pause-MS]]` once: the
//! `N`-th time (default 1) execution reaches the point `NAME`, it logs the point and kills itself;
//! with `pause-MS` it sleeps MS milliseconds there instead and carries on, so that a test can look
//! at the daemon between the two steps (`flash-before-write` and `promote-after-read` are reached
//! with no lock held, so other requests are served meanwhile; the others hold the core lock).
//!
//! The points (each between the two steps its name says):
//!
//! | name | where |
//! |---|---|
//! | `dram-after-store` | device → DRAM: the page is stored in the pool, still `MIGRATING` in the shared table |
//! | `flash-before-write` | DRAM → flash: pages copied out of the pool and the core lock released, before the flash lock is taken and the pages are sealed and written |
//! | `flash-after-write` | DRAM → flash: sealed and written, before the page table points at the slot |
//! | `flash-after-index` | DRAM → flash: the page table points at the slot, before the DRAM slot is freed |
//! | `promote-after-read` | flash → device: read and authenticated into a fresh frame, before it is published |
//! | `promote-after-publish` | flash → device: published resident, before the `Fault` reply |

/// The point names [`hit`] knows, for the tests.
pub const POINTS: [&str; 6] = [
    "dram-after-store",
    "flash-before-write",
    "flash-after-write",
    "flash-after-index",
    "promote-after-read",
    "promote-after-publish",
];

/// Kills kvmmd at `name`, or pauses there, when `KVMM_FAILPOINT` chose it (debug builds only).
#[cfg(debug_assertions)]
pub fn hit(name: &str) {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    static CHOSEN: OnceLock<Option<(String, u64, Option<u64>)>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    let chosen = CHOSEN.get_or_init(|| {
        let text = std::env::var("KVMM_FAILPOINT").ok()?;
        let mut parts = text.split(':');
        let point = parts.next()?.to_owned();
        let nth = parts.next().and_then(|n| n.parse().ok()).unwrap_or(1);
        let pause_ms = parts.next().and_then(|a| a.strip_prefix("pause-")?.parse().ok());
        Some((point, nth, pause_ms))
    });
    let Some((point, nth, pause_ms)) = chosen else { return };
    if point != name || HITS.fetch_add(1, Ordering::Relaxed) + 1 != *nth {
        return;
    }
    if let Some(ms) = pause_ms {
        tracing::warn!(point = name, ms, "fail point reached: kvmmd pauses here (KVMM_FAILPOINT)");
        std::thread::sleep(std::time::Duration::from_millis(*ms));
        return;
    }
    tracing::error!(point = name, "fail point reached: kvmmd kills itself (KVMM_FAILPOINT)");
    rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL).ok();
    // SIGKILL cannot be caught; should delivery lag, go no further than the point.
    std::process::abort();
}

/// Fail points are not compiled into release builds.
#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn hit(_name: &str) {}
