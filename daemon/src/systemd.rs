//! The daemon's side of systemd's service protocol: readiness and status notifications
//! (`sd_notify(3)`), the watchdog, and which loops must be alive to feed it.
//!
//! Notifications are datagrams to `$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace):
//!
//! ```text
//!  READY=1\nSTATUS=serving 2 sessions ...        sockets taken, tiers set up, loops running
//!  RELOADING=1\nMONOTONIC_USEC=123456789          SIGHUP received; READY=1 follows when applied
//!  STATUS=...                                     a one-line summary, when it changes
//!  WATCHDOG=1                                     every half interval, only while the loops beat
//!  STOPPING=1                                     SIGTERM received; orderly shutdown under way
//! ```
//!
//! Without `NOTIFY_SOCKET` (kvmmd started by hand) every notification is a no-op. A notification
//! that cannot be sent is logged once and never stops the daemon.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Where notifications go: `$NOTIFY_SOCKET`, or nowhere.
#[derive(Debug)]
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
    /// Whether a failed send was already logged.
    warned: AtomicBool,
}

impl Notifier {
    /// The notifier `$NOTIFY_SOCKET` names; a value that cannot be used is logged and ignored.
    pub fn from_env() -> Notifier {
        let target = std::env::var_os("NOTIFY_SOCKET").and_then(|raw| {
            let path = raw.to_string_lossy().into_owned();
            let addr = match path.strip_prefix('@') {
                Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
                None => SocketAddr::from_pathname(&path),
            };
            match (addr, UnixDatagram::unbound()) {
                (Ok(addr), Ok(sock)) => Some((sock, addr)),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!(notify_socket = %path, error = %e, "cannot use NOTIFY_SOCKET; systemd will not hear from kvmmd");
                    None
                }
            }
        });
        Notifier { target, warned: AtomicBool::new(false) }
    }

    /// A notifier that sends nothing.
    pub fn none() -> Notifier {
        Notifier { target: None, warned: AtomicBool::new(false) }
    }

    /// Whether a service manager listens.
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// Sends `state` (newline-separated `KEY=value` assignments).
    pub fn notify(&self, state: &str) {
        let Some((sock, addr)) = &self.target else { return };
        if let Err(e) = sock.send_to_addr(state.as_bytes(), addr)
            && !self.warned.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(error = %e, "cannot notify systemd (NOTIFY_SOCKET); further failures are not logged");
        }
    }

    /// `READY=1` with a status line.
    pub fn ready(&self, status: &str) {
        self.notify(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// `RELOADING=1` with the monotonic time systemd 253+ wants (older ones ignore it).
    pub fn reloading(&self) {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        let usec = now.tv_sec as u64 * 1_000_000 + now.tv_nsec as u64 / 1_000;
        self.notify(&format!("RELOADING=1\nMONOTONIC_USEC={usec}"));
    }

    /// `STATUS=` alone.
    pub fn status(&self, status: &str) {
        self.notify(&format!("STATUS={}", one_line(status)));
    }
}

/// A status is one line: systemd shows it in `systemctl status`.
fn one_line(status: &str) -> String {
    status.replace(['\n', '\r'], " ")
}

/// The watchdog interval systemd expects pings within (`$WATCHDOG_USEC`, when `$WATCHDOG_PID` is
/// absent or names this process). Pure over the two values, for tests.
pub fn watchdog_interval(usec: Option<&str>, pid: Option<&str>, own_pid: u32) -> Option<Duration> {
    if let Some(pid) = pid
        && pid.trim().parse::<u32>().ok() != Some(own_pid)
    {
        return None;
    }
    let usec: u64 = usec?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// The watchdog interval from the environment.
pub fn watchdog_from_env() -> Option<Duration> {
    let env = |k: &str| std::env::var(k).ok();
    watchdog_interval(env("WATCHDOG_USEC").as_deref(), env("WATCHDOG_PID").as_deref(), std::process::id())
}

/// Most time between two beats of a live loop: each loop beats at least this often while it runs.
pub const BEAT_EVERY: Duration = Duration::from_secs(1);

/// When each background loop last went round, so the watchdog is fed only while they run: a loop
/// that panicked or hangs (a deadlock, a stuck I/O) stops beating, the pings stop, and systemd
/// restarts the service.
#[derive(Debug)]
pub struct Heartbeats {
    origin: Instant,
    /// Milliseconds after `origin` of the last beat, plus one (0: never beat).
    tiers: AtomicU64,
    flash: AtomicU64,
    policy: AtomicU64,
}

/// A loop the watchdog watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loop {
    /// The tier mover (`kvmm-tiers`): demotion, prefetch, watermarks.
    Tiers,
    /// The flash drain (`kvmm-flash`): DRAM pages to flash past the DRAM watermark.
    Flash,
    /// The policy loop (`kvmm-policy`): sensors and mode.
    Policy,
}

impl Loop {
    /// Name in logs and the status line.
    pub fn name(self) -> &'static str {
        match self {
            Loop::Tiers => "tier mover",
            Loop::Flash => "flash drain",
            Loop::Policy => "policy loop",
        }
    }
}

impl Default for Heartbeats {
    fn default() -> Self {
        Heartbeats {
            origin: Instant::now(),
            tiers: AtomicU64::new(0),
            flash: AtomicU64::new(0),
            policy: AtomicU64::new(0),
        }
    }
}

impl Heartbeats {
    fn slot(&self, which: Loop) -> &AtomicU64 {
        match which {
            Loop::Tiers => &self.tiers,
            Loop::Flash => &self.flash,
            Loop::Policy => &self.policy,
        }
    }

    /// Records that `which` went round.
    pub fn beat(&self, which: Loop) {
        let ms = self.origin.elapsed().as_millis() as u64 + 1;
        self.slot(which).store(ms, Ordering::Relaxed);
    }

    /// How long ago `which` last beat; `None` if it never did.
    pub fn age(&self, which: Loop, now: Instant) -> Option<Duration> {
        let ms = self.slot(which).load(Ordering::Relaxed);
        let at = self.origin + Duration::from_millis(ms.checked_sub(1)?);
        Some(now.saturating_duration_since(at))
    }

    /// The first of `loops` that has not beat within `limit` (or never did), if any.
    pub fn stalled(&self, loops: &[Loop], limit: Duration, now: Instant) -> Option<(Loop, Option<Duration>)> {
        loops.iter().find_map(|&l| match self.age(l, now) {
            Some(age) if age <= limit => None,
            age => Some((l, age)),
        })
    }
}

/// How stale a loop may be before the watchdog stops being fed: the interval systemd enforces,
/// but never under a few beats (a loop busy with one batch of I/O is not dead).
pub fn stall_limit(interval: Duration) -> Duration {
    interval.max(BEAT_EVERY * 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_interval_applies_only_to_the_process_it_names() {
        assert_eq!(watchdog_interval(Some("2000000"), None, 5), Some(Duration::from_secs(2)));
        assert_eq!(watchdog_interval(Some("2000000"), Some("5"), 5), Some(Duration::from_secs(2)));
        assert_eq!(watchdog_interval(Some("2000000"), Some("6"), 5), None);
        assert_eq!(watchdog_interval(Some("0"), None, 5), None);
        assert_eq!(watchdog_interval(Some("soon"), None, 5), None);
        assert_eq!(watchdog_interval(None, Some("5"), 5), None);
    }

    #[test]
    fn a_loop_that_never_beat_or_stopped_beating_stalls_the_watchdog() {
        let beats = Heartbeats::default();
        let both = [Loop::Tiers, Loop::Policy];
        let limit = Duration::from_secs(3);
        let t0 = Instant::now();
        assert_eq!(beats.stalled(&both, limit, t0), Some((Loop::Tiers, None)));
        beats.beat(Loop::Tiers);
        assert_eq!(beats.stalled(&both, limit, t0), Some((Loop::Policy, None)));
        beats.beat(Loop::Policy);
        assert_eq!(beats.stalled(&both, limit, Instant::now()), None);
        // Four seconds on, with no beat since: stalled, with its age.
        let later = Instant::now() + Duration::from_secs(4);
        let (which, age) = beats.stalled(&both, limit, later).unwrap();
        assert_eq!(which, Loop::Tiers);
        assert!(age.unwrap() > limit);
        // A daemon without tiers watches only the policy loop.
        beats.beat(Loop::Policy);
        assert_eq!(beats.stalled(&[Loop::Policy], limit, Instant::now()), None);
    }

    #[test]
    fn the_stall_limit_is_the_interval_but_never_under_three_beats() {
        assert_eq!(stall_limit(Duration::from_secs(30)), Duration::from_secs(30));
        assert_eq!(stall_limit(Duration::from_millis(500)), BEAT_EVERY * 3);
    }

    #[test]
    fn notifications_reach_a_notify_socket_and_status_stays_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        let addr = SocketAddr::from_pathname(&path).unwrap();
        let n = Notifier { target: Some((UnixDatagram::unbound().unwrap(), addr)), warned: AtomicBool::new(false) };
        n.ready("a\nb");
        let mut buf = [0u8; 256];
        let len = listener.recv(&mut buf).unwrap();
        assert_eq!(std::str::from_utf8(&buf[..len]).unwrap(), "READY=1\nSTATUS=a b");
        n.reloading();
        let len = listener.recv(&mut buf).unwrap();
        assert!(std::str::from_utf8(&buf[..len]).unwrap().starts_with("RELOADING=1\nMONOTONIC_USEC="));
        assert!(!Notifier::none().enabled());
        Notifier::none().notify("READY=1");
    }
}
