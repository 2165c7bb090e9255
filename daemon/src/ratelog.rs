//! Rate limits for log lines a client can trigger (attach, detach, refused requests, fd refusals,
//! stuck pins and the revocations they lead to): a local process looping on a failing call, or
//! pinning many pages for good, must not flood the journal.
//!
//! Each call site of [`limited!`](crate::limited) owns a static [`RateLimit`]: at most
//! [`LINES_PER_WINDOW`] lines per [`WINDOW`]; lines past that are counted, not written, and the
//! first line of a later window is preceded by one line "suppressed K lines". [`Window`] is the
//! pure decision (the clock is passed in), tested without sleeping.
//!
//! Invariant: every line offered is either written or counted in exactly one "suppressed" report
//! (the report may wait until the call site logs again).

use std::time::{Duration, Instant};

/// Lines one call site may write per [`WINDOW`].
pub const LINES_PER_WINDOW: u32 = 10;
/// The length of a window.
pub const WINDOW: Duration = Duration::from_secs(1);

/// What to do with one line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Write it, after a line reporting `suppressed` lines dropped since the last one written
    /// (when not 0).
    Write { suppressed: u64 },
    /// Drop it (counted for the next report).
    Suppress,
}

/// One call site's count in the current window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// When the current window opened; `None` before the first line.
    start: Option<Instant>,
    /// Lines written in the current window.
    written: u32,
    /// Lines dropped since the last report.
    suppressed: u64,
}

impl Window {
    /// A window before any line.
    pub const fn new() -> Window {
        Window { start: None, written: 0, suppressed: 0 }
    }

    /// Decides one line offered at `now`: at most `limit` per `length`.
    pub fn admit(&mut self, now: Instant, limit: u32, length: Duration) -> Verdict {
        match self.start {
            Some(start) if now.saturating_duration_since(start) < length => {
                if self.written < limit {
                    self.written += 1;
                    Verdict::Write { suppressed: 0 }
                } else {
                    self.suppressed += 1;
                    Verdict::Suppress
                }
            }
            _ => {
                self.start = Some(now);
                self.written = 1;
                Verdict::Write { suppressed: std::mem::take(&mut self.suppressed) }
            }
        }
    }
}

/// The limiter of one call site (a `static` the [`limited!`](crate::limited) macro declares).
#[derive(Debug)]
pub struct RateLimit {
    window: std::sync::Mutex<Window>,
}

impl RateLimit {
    /// A limiter that has seen no line.
    pub const fn new() -> RateLimit {
        RateLimit { window: std::sync::Mutex::new(Window::new()) }
    }

    /// Decides one line offered now.
    pub fn admit(&self) -> Verdict {
        // A poisoned count is still a count: a panic elsewhere must not silence the log.
        let mut w = self.window.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        w.admit(Instant::now(), LINES_PER_WINDOW, WINDOW)
    }
}

impl Default for RateLimit {
    fn default() -> Self {
        RateLimit::new()
    }
}

/// `tracing::<level>!(...)` limited to [`LINES_PER_WINDOW`] lines per [`WINDOW`] at this call site;
/// e.g. `limited!(info, session = id, "detached")`.
#[macro_export]
macro_rules! limited {
    ($level:ident, $($line:tt)+) => {{
        static LIMIT: $crate::ratelog::RateLimit = $crate::ratelog::RateLimit::new();
        if let $crate::ratelog::Verdict::Write { suppressed } = LIMIT.admit() {
            if suppressed > 0 {
                tracing::$level!(
                    suppressed,
                    "suppressed {suppressed} lines from here (more than {} a second)",
                    $crate::ratelog::LINES_PER_WINDOW
                );
            }
            tracing::$level!($($line)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_writes_the_limit_then_reports_what_it_dropped_when_the_window_reopens() {
        let t0 = Instant::now();
        let mut w = Window::new();
        let burst: Vec<Verdict> = (0..25).map(|i| w.admit(t0 + Duration::from_millis(i), 10, WINDOW)).collect();
        assert!(burst[..10].iter().all(|v| *v == Verdict::Write { suppressed: 0 }), "{burst:?}");
        assert!(burst[10..].iter().all(|v| *v == Verdict::Suppress), "{burst:?}");
        // The next window opens with one report of the 15 dropped lines, then counts afresh.
        assert_eq!(w.admit(t0 + Duration::from_millis(1000), 10, WINDOW), Verdict::Write { suppressed: 15 });
        assert_eq!(w.admit(t0 + Duration::from_millis(1001), 10, WINDOW), Verdict::Write { suppressed: 0 });
    }

    #[test]
    fn a_quiet_call_site_is_never_limited() {
        let t0 = Instant::now();
        let mut w = Window::new();
        for i in 0..100 {
            assert_eq!(w.admit(t0 + Duration::from_millis(200 * i), 10, WINDOW), Verdict::Write { suppressed: 0 });
        }
    }

    #[test]
    fn every_line_is_written_or_reported_exactly_once() {
        let t0 = Instant::now();
        let mut w = Window::new();
        let (mut written, mut reported) = (0u64, 0u64);
        let offered = 5_000u64;
        // Bursty arrivals over about 20 s, then one late line that flushes the count.
        for i in 0..offered {
            let at = t0 + Duration::from_micros(i * i % 20_000_000);
            match w.admit(at, 7, WINDOW) {
                Verdict::Write { suppressed } => {
                    written += 1;
                    reported += suppressed;
                }
                Verdict::Suppress => {}
            }
        }
        if let Verdict::Write { suppressed } = w.admit(t0 + Duration::from_secs(60), 7, WINDOW) {
            reported += suppressed;
        }
        assert_eq!(written + reported, offered);
        assert!(reported > 0);
    }

    #[test]
    fn the_macro_limits_each_call_site_on_its_own() {
        let limit = RateLimit::new();
        let writes = (0..50).filter(|_| matches!(limit.admit(), Verdict::Write { .. })).count();
        assert!((10..=20).contains(&writes), "{writes} written: 10 per second at most");
        for _ in 0..50 {
            crate::limited!(info, n = 1, "a line a client triggers");
        }
    }
}
