//! A token bucket in bytes per second: how the modes' flash-write and background-migration limits
//! are enforced by the tier thread.

use std::time::{Duration, Instant};

/// At most this much time's worth of bytes accumulates while nothing moves, so a limit is not
/// followed by a burst after an idle minute.
const BURST: Duration = Duration::from_millis(250);

/// A byte budget refilled at a fixed rate; `None` means unlimited.
#[derive(Clone, Debug)]
pub struct RateLimit {
    bytes_per_s: Option<u64>,
    tokens: f64,
    last: Instant,
}

impl RateLimit {
    /// A bucket at `bytes_per_s` (`None`: unlimited), full.
    pub fn new(bytes_per_s: Option<u64>, now: Instant) -> RateLimit {
        let mut r = RateLimit { bytes_per_s, tokens: 0.0, last: now };
        r.tokens = r.capacity();
        r
    }

    /// The rate in force.
    pub fn rate(&self) -> Option<u64> {
        self.bytes_per_s
    }

    /// Changes the rate (a mode change), keeping what has accumulated up to the new burst size.
    pub fn set_rate(&mut self, bytes_per_s: Option<u64>, now: Instant) {
        if bytes_per_s != self.bytes_per_s {
            self.refill(now);
            self.bytes_per_s = bytes_per_s;
            self.tokens = self.tokens.min(self.capacity());
        }
    }

    /// Bytes that may move now; `u64::MAX` when unlimited.
    pub fn available(&mut self, now: Instant) -> u64 {
        if self.bytes_per_s.is_none() {
            return u64::MAX;
        }
        self.refill(now);
        self.tokens as u64
    }

    /// Records `bytes` moved (they may exceed what was available: a page is not split, and the
    /// debt is paid before anything else moves).
    pub fn spend(&mut self, bytes: u64) {
        if self.bytes_per_s.is_some() {
            self.tokens -= bytes as f64;
        }
    }

    fn capacity(&self) -> f64 {
        self.bytes_per_s.map_or(0.0, |r| r as f64 * BURST.as_secs_f64())
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        if let Some(rate) = self.bytes_per_s {
            self.tokens = (self.tokens + rate as f64 * elapsed).min(self.capacity());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlimited_never_holds_anything_back() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(None, t0);
        r.spend(u64::MAX / 2);
        assert_eq!(r.available(t0), u64::MAX);
    }

    #[test]
    fn a_limit_allows_its_rate_over_time_and_no_more() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(Some(16 << 20), t0);
        // Full at start: a quarter second's worth.
        assert_eq!(r.available(t0), 4 << 20);
        let mut moved = 0u64;
        // Ten seconds in 10 ms steps, moving 1 MiB pages whenever at least one byte is allowed.
        for step in 1..=1000u32 {
            let now = t0 + Duration::from_millis(u64::from(step) * 10);
            while r.available(now) > 0 {
                r.spend(1 << 20);
                moved += 1 << 20;
            }
        }
        let expected = 10 * (16u64 << 20) + (4 << 20);
        // Within one page of the rate plus the initial burst.
        assert!(moved.abs_diff(expected) <= 1 << 20, "moved {moved}, expected about {expected}");
    }

    #[test]
    fn idle_time_does_not_bank_more_than_the_burst() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(Some(1 << 20), t0);
        r.spend(1 << 18);
        assert_eq!(r.available(t0 + Duration::from_secs(60)), 1 << 18);
    }

    #[test]
    fn debt_is_paid_before_more_moves() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(Some(1 << 20), t0);
        r.spend(4 << 20);
        assert_eq!(r.available(t0 + Duration::from_secs(1)), 0);
        assert!(r.available(t0 + Duration::from_secs(4)) > 0);
    }

    #[test]
    fn a_new_rate_caps_what_accumulated() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(Some(64 << 20), t0);
        r.set_rate(Some(4 << 20), t0);
        assert_eq!(r.available(t0), 1 << 20);
        r.set_rate(None, t0);
        assert_eq!(r.available(t0), u64::MAX);
    }
}
