//! What the kernel benches share.

use std::time::Instant;

/// Best (smallest) wall time of `runs` calls of `f`, after one warm-up call. The minimum rather than
/// the median: on a shared machine (other builds running) most of the spread is time spent waiting
/// for a core, which only ever adds.
pub fn best_seconds(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}
