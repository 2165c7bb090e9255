//! Stuck pins: pages a client has held pinned past the pin lease.
//!
//! The daemon never waits on a pin (a pinned page is skipped), so a client that pins a page and
//! never lets go keeps it where it is for good: it cannot be demoted, compressed or compacted, and
//! its frame stays out of the shared budget. [`PinWatch`] finds such pages from what the client
//! region shows (`kvmm_shm::layout` module doc): a page whose pin count stays above zero while its
//! unpin count stands still holds the same pin. A busy client that pins and unpins a page a
//! thousand times a second moves the unpin count, so its pages are never taken for stuck ones.
//!
//! ```text
//!   scan n:   pins > 0, unpins u ──► held since now (first seen)
//!   scan n+1: pins > 0, unpins u ──► same pin; stuck once now − since ≥ lease (reported once)
//!             pins > 0, unpins u′ ─► another pin: held since now
//!             pins = 0 ────────────► forgotten
//! ```
//!
//! A hold is measured from the first scan that saw it, so it reads short by up to one scan
//! interval. Pure: a task of its own scans the sessions and feeds it ([`crate::migrate::watch_pins`]);
//! the operator sees the result in `Status`, `ListSessions` and the metrics, and revokes a session
//! with a wipe.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::migrate::tiering::PageRef;

/// One pinned page, as the watch last saw it.
#[derive(Clone, Copy, Debug)]
struct Held {
    /// The page's unpin count when this hold was first seen.
    unpins: u32,
    /// When this hold was first seen.
    since: Instant,
    /// Whether the hold was reported stuck already.
    reported: bool,
}

/// A page held past the lease, as reported once when it crosses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StuckPin {
    pub page: PageRef,
    /// How long the pin has been held (at least the lease).
    pub held: Duration,
}

/// One session's stuck pins.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionPins {
    /// Pages held past the lease.
    pub stuck: u32,
    /// The longest of those holds (zero when none).
    pub longest: Duration,
}

/// Pinned pages across scans (module doc).
#[derive(Debug)]
pub struct PinWatch {
    lease: Duration,
    /// The pages the last scan saw pinned.
    held: HashMap<PageRef, Held>,
    /// When the last scan ran, which is "now" for the holds it reports.
    last: Option<Instant>,
}

impl PinWatch {
    /// A watch that calls a pin stuck once it has been held for `lease`.
    pub fn new(lease: Duration) -> PinWatch {
        PinWatch { lease, held: HashMap::new(), last: None }
    }

    /// The lease in force.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// One scan at `now`: `pinned` lists every page whose pin count is above zero, with its unpin
    /// count. Pages it leaves out are no longer pinned. Returns the holds that crossed the lease in
    /// this scan.
    pub fn observe(&mut self, now: Instant, pinned: impl IntoIterator<Item = (PageRef, u32)>) -> Vec<StuckPin> {
        self.last = Some(now);
        // Pages this scan leaves out are dropped with the last scan's map.
        let before = std::mem::take(&mut self.held);
        let mut crossed = Vec::new();
        for (page, unpins) in pinned {
            let held = self.held.entry(page).or_insert_with(|| {
                let same_pin = before.get(&page).filter(|h| h.unpins == unpins);
                same_pin.copied().unwrap_or(Held { unpins, since: now, reported: false })
            });
            let for_ = now.saturating_duration_since(held.since);
            if !held.reported && for_ >= self.lease {
                held.reported = true;
                crossed.push(StuckPin { page, held: for_ });
            }
        }
        crossed
    }

    /// Session `session`'s stuck pins as of the last scan.
    pub fn session(&self, session: u64) -> SessionPins {
        self.stuck().filter(|(page, _)| page.session == session).fold(SessionPins::default(), |acc, (_, held)| {
            SessionPins { stuck: acc.stuck + 1, longest: acc.longest.max(held) }
        })
    }

    /// Stuck pins over every session as of the last scan.
    pub fn total(&self) -> u32 {
        self.stuck().count() as u32
    }

    /// Forgets every hold of `session` (it is gone).
    pub fn forget(&mut self, session: u64) {
        self.held.retain(|page, _| page.session != session);
    }

    /// Every stuck hold with how long it has been held at the last scan.
    fn stuck(&self) -> impl Iterator<Item = (PageRef, Duration)> + '_ {
        let now = self.last;
        self.held
            .iter()
            .filter(|(_, h)| h.reported)
            .map(move |(&page, h)| (page, now.map_or(Duration::ZERO, |now| now.saturating_duration_since(h.since))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(10);

    fn page(session: u64, block: u32) -> PageRef {
        PageRef { session, layer: 0, block }
    }

    fn secs(t0: Instant, s: u64) -> Instant {
        t0 + Duration::from_secs(s)
    }

    #[test]
    fn a_pin_held_past_the_lease_is_reported_once_and_counted_until_it_goes() {
        let t0 = Instant::now();
        let mut w = PinWatch::new(LEASE);
        assert!(w.observe(t0, [(page(1, 0), 7)]).is_empty());
        assert!(w.observe(secs(t0, 9), [(page(1, 0), 7)]).is_empty(), "9 s is inside the lease");
        assert_eq!(w.total(), 0);
        let crossed = w.observe(secs(t0, 10), [(page(1, 0), 7)]);
        assert_eq!(crossed, vec![StuckPin { page: page(1, 0), held: LEASE }]);
        assert!(w.observe(secs(t0, 15), [(page(1, 0), 7)]).is_empty(), "reported once");
        assert_eq!(w.session(1), SessionPins { stuck: 1, longest: Duration::from_secs(15) });
        assert_eq!(w.session(2), SessionPins::default());
        assert_eq!(w.total(), 1);
        assert!(w.observe(secs(t0, 16), []).is_empty());
        assert_eq!(w.total(), 0, "unpinned: no longer stuck");
        assert_eq!(w.session(1), SessionPins::default());
    }

    #[test]
    fn a_page_pinned_at_every_scan_by_new_pins_is_never_stuck() {
        let t0 = Instant::now();
        let mut w = PinWatch::new(LEASE);
        for (s, unpins) in (0..60).zip(100u32..) {
            assert!(w.observe(secs(t0, s), [(page(1, 3), unpins)]).is_empty(), "second {s}");
        }
        assert_eq!(w.total(), 0);
    }

    #[test]
    fn the_unpin_count_wrapping_is_just_another_pin() {
        let t0 = Instant::now();
        let mut w = PinWatch::new(LEASE);
        w.observe(t0, [(page(1, 0), u32::MAX)]);
        assert!(w.observe(secs(t0, 11), [(page(1, 0), 0)]).is_empty());
        assert_eq!(w.observe(secs(t0, 21), [(page(1, 0), 0)]).len(), 1);
    }

    #[test]
    fn a_pin_released_and_taken_again_between_scans_starts_over() {
        let t0 = Instant::now();
        let mut w = PinWatch::new(LEASE);
        w.observe(t0, [(page(1, 0), 5)]);
        w.observe(secs(t0, 8), []);
        // Same unpin count as before (a client that lies, or wrapped): the gap still restarts it.
        assert!(w.observe(secs(t0, 12), [(page(1, 0), 5)]).is_empty());
        assert_eq!(w.observe(secs(t0, 22), [(page(1, 0), 5)]).len(), 1);
    }

    #[test]
    fn sessions_are_counted_apart_and_forgotten_when_they_go() {
        let t0 = Instant::now();
        let mut w = PinWatch::new(LEASE);
        let pins = [(page(1, 0), 0), (page(1, 1), 0), (page(2, 0), 0)];
        w.observe(t0, pins);
        w.observe(secs(t0, 4), [(page(1, 1), 0)].into_iter().chain(pins));
        let crossed = w.observe(secs(t0, 12), pins);
        assert_eq!(crossed.len(), 3);
        assert_eq!(w.session(1), SessionPins { stuck: 2, longest: Duration::from_secs(12) });
        assert_eq!(w.session(2).stuck, 1);
        w.forget(1);
        assert_eq!((w.session(1).stuck, w.total()), (0, 1));
    }
}
