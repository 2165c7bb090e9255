//! Sharing a CPU during long work: a loop over many pages (sealing a flash write, opening a flash
//! read, the daemon's recompression and demotion loops) yields its CPU to the daemon's other
//! runnable threads once it has run for its slice, so that a worker woken to serve another client
//! does not wait out the loop's scheduler slice (10–14 ms per call measured on one CPU before the
//! daemon's loops yielded; see the daemon's `migrate::LockPacer`).
//!
//! The slice adapts: it is as long as the others ran the last time the loop yielded, within
//! [`MIN_SLICE`]..=[`MAX_SLICE`]. A request served takes about 0.1 ms, so the loop yields often
//! while requests come; a CPU hog beside it takes a whole scheduler slice after every yield, and a
//! fixed 0.1 ms slice then made a recompression 9 times slower (about 2 times with the adaptive one).

use std::time::{Duration, Instant};

/// The shortest slice: yielding more often than this costs more than it gives.
pub const MIN_SLICE: Duration = Duration::from_micros(100);

/// The longest a loop keeps its CPU before it yields it to other runnable threads.
pub const MAX_SLICE: Duration = Duration::from_millis(2);

/// One loop's share of its CPU; see the module doc.
#[derive(Debug)]
pub struct CpuShare {
    /// When the loop last took its CPU back.
    running_since: Instant,
    /// How long the loop keeps its CPU before it yields it again.
    slice: Duration,
}

impl CpuShare {
    /// A share whose first slice starts now.
    pub fn start() -> CpuShare {
        CpuShare { running_since: Instant::now(), slice: MIN_SLICE }
    }

    /// Whether the loop has run for its slice since it last yielded.
    pub fn used_up(&self) -> bool {
        self.running_since.elapsed() >= self.slice
    }

    /// How long the loop keeps its CPU now.
    pub fn slice(&self) -> Duration {
        self.slice
    }

    /// Yields the CPU through `give_way`, which gets the yield to run with whatever the loop must
    /// not hold meanwhile released (a lock), and sets the next slice to how long the others ran.
    pub fn give_way(&mut self, give_way: impl FnOnce(fn())) {
        let left = Instant::now();
        give_way(std::thread::yield_now);
        self.running_since = Instant::now();
        self.slice = self.running_since.duration_since(left).clamp(MIN_SLICE, MAX_SLICE);
    }

    /// Between two steps of a loop that holds no lock: yields the CPU once the slice is used up.
    pub fn between(&mut self) {
        if self.used_up() {
            self.give_way(|yield_now| yield_now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slice_is_as_long_as_the_others_ran_within_its_bounds() {
        let mut share = CpuShare::start();
        assert_eq!(share.slice(), MIN_SLICE);
        std::thread::sleep(MIN_SLICE);
        assert!(share.used_up());
        // The others ran 5 ms: the loop keeps its CPU for the longest slice next time.
        share.give_way(|_| std::thread::sleep(Duration::from_millis(5)));
        assert_eq!(share.slice(), MAX_SLICE);
        // The others ran at least 0.5 ms.
        share.give_way(|_| std::thread::sleep(Duration::from_micros(500)));
        assert!(share.slice() >= Duration::from_micros(500), "{:?}", share.slice());
        // Nobody else ran.
        share.give_way(|_| {});
        assert_eq!(share.slice(), MIN_SLICE);
    }

    #[test]
    fn between_yields_only_once_the_slice_is_used_up() {
        let since = Instant::now();
        let mut share = CpuShare { running_since: since, slice: Duration::from_secs(3600) };
        share.between();
        assert_eq!(share.running_since, since, "the slice is not used up: no yield");
        share.slice = Duration::ZERO;
        share.between();
        assert!(share.running_since > since, "the slice was used up: it yielded and started a new one");
    }
}
