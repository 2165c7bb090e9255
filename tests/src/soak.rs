//! The decisions and the bookkeeping of `kvmm-soak` (issue 9): which chaos action comes next, the
//! invariants a snapshot of the daemon's admin view must satisfy, how kvmmd's memory is read, and
//! the final report and its verdict.
//!
//! Nothing here does I/O or reads a clock (the `/proc` readers take the text, the owner check
//! takes `now`); the binary (`src/bin/kvmm-soak.rs`) runs the processes and calls these.
//!
//! # The invariants
//!
//! A check reads admin `Status` twice with `ListSessions` in between (the sandwich):
//!
//! ```text
//!   Status S1 ──► ListSessions L ──► Status S2
//!   └ single-RPC checks on S1 and S2 ┘        └ cross-RPC checks on L only if S1 ≡ S2
//! ```
//!
//! - Within one `Status` (one snapshot under the daemon's core lock, so exact): each tier's pages by
//!   format add up to its pages; the device's `used` equals `session_bytes` (the device pages'
//!   bytes) plus the frames reserved for reads from flash under way, and it owns one frame per
//!   device page plus those (a frame counted for two sessions, or by none, breaks one of these);
//!   DRAM's allocator `used` equals
//!   the bytes of the DRAM pages; every tier's `used` stays within its configured budget. Flash is
//!   the exception: a page is written with only the flash lock held and committed to its page table
//!   under the core lock afterwards, and slots given back are freed after the core lock is released,
//!   so the flash file may hold slots that no table names, and only `used ≥ pages' bytes` holds at
//!   every instant (equality is checked after the run, when
//!   every client is gone and every tier must be empty).
//! - Across the RPCs (pages move between them): `ListSessions` must account for every page
//!   `Status` counts, tier by tier, and for as many sessions. The two `Status` replies bound the
//!   listing: when they agree on sessions, pages per tier and session bytes, nothing that the
//!   comparison looks at changed in between (barring a change and its exact undo, which only makes
//!   a check miss, never invent a violation); when they disagree the snapshot is torn and is taken
//!   again ([`Sandwich::Torn`]), a few times, before the check gives up and counts a torn check.
//! - Owners: every listed session belongs to a client process that is running, or that ended less
//!   than [`OWNER_GRACE`] ago (the daemon destroys a session, and the pins in its client region, when
//!   the connection drops; a session that outlives its owner would keep its pages and pins
//!   forever). The binary re-checks an owner violation once on a fresh listing before counting it.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::{Duration, Instant};

use kvmm_proto::v1::{FormatUsage, ListSessionsResponse, SessionInfo, StatusResponse, TierStatus};
use rand::RngExt;
use serde::Serialize;

/// How long a session may outlive its client process (the daemon notices the closed connection in
/// about a millisecond; this leaves room for a loaded machine).
pub const OWNER_GRACE: Duration = Duration::from_secs(2);

/// Descriptions kept per violation kind, for the report.
pub const DESCRIBED_PER_KIND: usize = 3;

/// The tiers in the order `Status` lists them.
pub const TIERS: [&str; 3] = ["device", "dram", "flash"];

/// `[policy]` bodies the chaos loop switches between (admin `SetPolicy`). Each changes what a
/// demotion does: the mode's format (q8; powersave q4), watermarks and rates (balanced and thermal
/// limit flash writes, thermal background moves), adaptive precision by age and by mass, a floor.
/// Pages are only ever quantized from 16 bits by these (adaptive precision by age steps pages down,
/// but in q8 mode only from the 16-bit pages it kept up; a page already quantized keeps its
/// format), which is what the checking clients expect.
pub const POLICIES: [&str; 5] = [
    "mode = \"performance\"\nadaptive_precision = true\n",
    "mode = \"powersave\"\nadaptive_precision = false\n",
    "mode = \"balanced\"\nadaptive_precision = true\n\n[[floor]]\nlayers = \"0\"\nformat = \"q8\"\n",
    "mode = \"thermal\"\nadaptive_precision = true\nadaptive_ranking = \"mass\"\n",
    "mode = \"auto\"\nadaptive_precision = false\n\n[[floor]]\nlayers = \"last\"\nformat = \"f16\"\n",
];

/// One thing the chaos loop does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// SIGKILL a random client (its slot starts a replacement).
    Kill,
    /// Admin `SetPolicy` with another body of [`POLICIES`].
    Policy,
    /// Admin `WipeSession` of a random client's session (the client then fails with
    /// `FAILED_PRECONDITION`, as it must, and is replaced).
    Wipe,
    /// Admin `Demote` of a random session's full pages to DRAM or flash.
    Demote,
    /// Admin `Compress` of a random session's full pages to q8 (the default demotion format, so the
    /// clients' own quantization of their K/V predicts the bytes).
    Compress,
}

impl Action {
    /// Every action, in report order.
    pub const ALL: [Action; 5] = [Action::Kill, Action::Policy, Action::Wipe, Action::Demote, Action::Compress];

    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Action::Kill => "kill",
            Action::Policy => "policy",
            Action::Wipe => "wipe",
            Action::Demote => "demote",
            Action::Compress => "compress",
        }
    }

    /// Relative weight in [`pick_action`]: kills and policy flips most, the admin page operations
    /// less (each touches one session).
    fn weight(self) -> u32 {
        match self {
            Action::Kill => 3,
            Action::Policy => 3,
            Action::Wipe => 2,
            Action::Demote => 2,
            Action::Compress => 1,
        }
    }
}

/// The next chaos action, drawn by weight.
pub fn pick_action(rng: &mut impl RngExt) -> Action {
    let total: u32 = Action::ALL.iter().map(|a| a.weight()).sum();
    let mut at = rng.random_range(0..total);
    for a in Action::ALL {
        if at < a.weight() {
            return a;
        }
        at -= a.weight();
    }
    Action::Kill
}

/// The pause before the next chaos action: 1 to 3 s.
pub fn action_interval(rng: &mut impl RngExt) -> Duration {
    Duration::from_millis(rng.random_range(1000..=3000))
}

/// The next policy body: any of [`POLICIES`] but the one in force (`current`, an index).
pub fn next_policy(rng: &mut impl RngExt, current: usize) -> usize {
    let step = rng.random_range(1..POLICIES.len());
    (current + step) % POLICIES.len()
}

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// Which invariant (a stable snake_case name; the report counts by it).
    pub kind: &'static str,
    /// What was seen, as a sentence with the numbers.
    pub detail: String,
}

impl Finding {
    fn new(kind: &'static str, detail: String) -> Finding {
        Finding { kind, detail }
    }
}

/// Budgets the daemon was started with, by tier name: the ceiling of each tier's `used` whatever
/// budget is in force (memory pressure lowers the one `Status` shows, and the tier thread drains
/// down to it over time, so a tier may briefly sit above that one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Budgets(pub BTreeMap<String, u64>);

impl Budgets {
    /// The budgets of a `Status` taken before any pressure (at start).
    pub fn of(status: &StatusResponse) -> Budgets {
        Budgets(status.tiers.iter().map(|t| (t.tier.clone(), t.budget_bytes)).collect())
    }
}

/// Pages and bytes of a list of per-format usage.
fn census(formats: &[FormatUsage]) -> (u64, u64) {
    formats.iter().fold((0, 0), |(p, b), f| (p + f.pages, b + f.bytes))
}

/// The invariants of one `Status` reply; see the module doc.
pub fn check_status(s: &StatusResponse, budgets: &Budgets) -> Vec<Finding> {
    let mut out = Vec::new();
    for t in &s.tiers {
        let (pages, bytes) = census(&t.by_format);
        if pages != t.pages {
            out.push(Finding::new(
                "census",
                format!("{}: the per-format census counts {pages} pages, the tier {} pages", t.tier, t.pages),
            ));
        }
        let ceiling = budgets.0.get(&t.tier).copied().unwrap_or(t.budget_bytes).max(t.budget_bytes);
        if t.used_bytes > ceiling {
            out.push(Finding::new(
                "over_budget",
                format!("{}: {} bytes used over a budget of {ceiling}", t.tier, t.used_bytes),
            ));
        }
        match t.tier.as_str() {
            "device" => check_device(s, t, bytes, &mut out),
            "dram" if t.used_bytes != bytes => out.push(Finding::new(
                "tier_bytes",
                format!("dram: the pool's allocator holds {} bytes, its pages' slots {bytes}", t.used_bytes),
            )),
            "flash" if t.used_bytes < bytes => out.push(Finding::new(
                "tier_bytes",
                format!(
                    "flash: the file's allocator holds {} bytes, fewer than its pages' slots ({bytes})",
                    t.used_bytes
                ),
            )),
            _ => {}
        }
    }
    if !s.tiers.iter().any(|t| t.tier == "device") {
        out.push(Finding::new("census", "Status lists no device tier".to_owned()));
    }
    out
}

/// The device tier's part of [`check_status`]: `bytes` is the sum of its pages' footprints. Frames
/// reserved for pages on their way back from flash are in the pool's `used` and `frames` but in no
/// page table yet; `Status` reports them (`reserved_bytes`, `reserved_frames`).
fn check_device(s: &StatusResponse, t: &TierStatus, bytes: u64, out: &mut Vec<Finding>) {
    if t.used_bytes != s.session_bytes + t.reserved_bytes {
        out.push(Finding::new(
            "device_bytes",
            format!(
                "device: the pool has {} bytes in use, the sessions' page tables {} and reads from flash {}",
                t.used_bytes, s.session_bytes, t.reserved_bytes
            ),
        ));
    }
    if bytes != s.session_bytes {
        out.push(Finding::new(
            "device_bytes",
            format!(
                "device: the pages' frames by format add up to {bytes} bytes, session_bytes is {}",
                s.session_bytes
            ),
        ));
    }
    if t.frames != t.pages + t.reserved_frames {
        out.push(Finding::new(
            "device_frames",
            format!(
                "device: {} frames owned for {} pages and {} reads from flash (one frame each)",
                t.frames, t.pages, t.reserved_frames
            ),
        ));
    }
}

/// The invariants of one `ListSessions` reply: every session's per-format census adds up in each
/// tier, and no session is listed twice.
pub fn check_listing(list: &ListSessionsResponse) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut seen = HashMap::new();
    for s in &list.sessions {
        if let Some(pid) = seen.insert(s.session_id, s.pid) {
            out.push(Finding::new(
                "census",
                format!("session {} is listed twice (owners {pid} and {})", s.session_id, s.pid),
            ));
        }
        for t in &s.tiers {
            let (pages, bytes) = census(&t.by_format);
            if (pages, bytes) != (t.pages, t.bytes) {
                out.push(Finding::new(
                    "census",
                    format!(
                        "session {} {}: {} pages / {} bytes, by format {pages} / {bytes}",
                        s.session_id, t.tier, t.pages, t.bytes
                    ),
                ));
            }
        }
    }
    out
}

/// Pages and bytes per tier over a listing's sessions, in [`TIERS`] order.
fn listed_per_tier(list: &ListSessionsResponse) -> [(u64, u64); 3] {
    let mut per = [(0, 0); 3];
    for t in list.sessions.iter().flat_map(|s| &s.tiers) {
        if let Some(i) = TIERS.iter().position(|n| *n == t.tier) {
            per[i].0 += t.pages;
            per[i].1 += t.bytes;
        }
    }
    per
}

/// Pages per tier of a `Status`, in [`TIERS`] order (0 for a tier it does not list).
fn status_pages(s: &StatusResponse) -> [u64; 3] {
    TIERS.map(|name| s.tiers.iter().find(|t| t.tier == name).map_or(0, |t| t.pages))
}

/// What a sandwich says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sandwich {
    /// The two `Status` replies agree, so the listing was compared; these are its findings.
    Compared(Vec<Finding>),
    /// Something the comparison reads changed between the two `Status` replies: take it again.
    Torn,
}

/// Compares a listing taken between `before` and `after` with them: see the module doc.
pub fn compare(before: &StatusResponse, list: &ListSessionsResponse, after: &StatusResponse) -> Sandwich {
    let key = |s: &StatusResponse| (s.sessions, status_pages(s), s.session_bytes);
    if key(before) != key(after) {
        return Sandwich::Torn;
    }
    let mut out = Vec::new();
    if list.sessions.len() != before.sessions as usize {
        out.push(Finding::new(
            "accounting",
            format!("Status counts {} sessions, ListSessions lists {}", before.sessions, list.sessions.len()),
        ));
    }
    let listed = listed_per_tier(list);
    let counted = status_pages(before);
    for (i, tier) in TIERS.iter().enumerate() {
        if listed[i].0 != counted[i] {
            out.push(Finding::new(
                "accounting",
                format!("{tier}: Status counts {} pages, the sessions listed hold {}", counted[i], listed[i].0),
            ));
        }
    }
    if listed[0].1 != before.session_bytes {
        out.push(Finding::new(
            "accounting",
            format!(
                "device: Status counts {} session bytes, the sessions listed hold {}",
                before.session_bytes, listed[0].1
            ),
        ));
    }
    Sandwich::Compared(out)
}

/// What the soak knows of a client process it started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Still running (or killed but not yet reaped).
    Running,
    /// Reaped at this instant.
    Ended(Instant),
}

/// Sessions whose owner is not a running client of this soak: one that ended more than
/// [`OWNER_GRACE`] before `now`, or a pid the soak never started.
pub fn check_owners(sessions: &[SessionInfo], owners: &HashMap<u32, Owner>, now: Instant) -> Vec<Finding> {
    let mut out = Vec::new();
    for s in sessions {
        let detail = match u32::try_from(s.pid).ok().and_then(|pid| owners.get(&pid)) {
            None => format!("session {} belongs to pid {}, which this soak never started", s.session_id, s.pid),
            Some(Owner::Running) => continue,
            Some(Owner::Ended(at)) => {
                let gone = now.saturating_duration_since(*at);
                if gone <= OWNER_GRACE {
                    continue;
                }
                format!(
                    "session {} ({} pages) outlives its client pid {} by {} ms",
                    s.session_id,
                    s.tiers.iter().map(|t| t.pages).sum::<u64>(),
                    s.pid,
                    gone.as_millis()
                )
            }
        };
        out.push(Finding::new("dead_owner", detail));
    }
    out
}

/// What a `Status` must say once every client is gone: no session, and nothing in any tier.
pub fn check_empty(s: &StatusResponse) -> Vec<Finding> {
    let mut out = Vec::new();
    if s.sessions != 0 {
        out.push(Finding::new("leak", format!("{} sessions are left with every client gone", s.sessions)));
    }
    if s.session_bytes != 0 {
        out.push(Finding::new("leak", format!("{} session bytes are left with every client gone", s.session_bytes)));
    }
    for t in &s.tiers {
        if t.used_bytes != 0 || t.pages != 0 || t.frames != 0 {
            out.push(Finding::new(
                "leak",
                format!(
                    "{}: {} bytes used, {} pages, {} frames left with every client gone",
                    t.tier, t.used_bytes, t.pages, t.frames
                ),
            ));
        }
    }
    out
}

/// Violations by kind, with the first few of each described.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Violations {
    /// Count per kind.
    pub by_kind: BTreeMap<String, u64>,
    /// The first [`DESCRIBED_PER_KIND`] of each kind, with the second of the run they were seen at.
    pub first: Vec<String>,
}

impl Violations {
    /// Counts `f`, seen `at` seconds into the run.
    pub fn add(&mut self, f: &Finding, at: f64) {
        let n = self.by_kind.entry(f.kind.to_owned()).or_default();
        *n += 1;
        if *n as usize <= DESCRIBED_PER_KIND {
            self.first.push(format!("[{at:.1} s] {}: {}", f.kind, f.detail));
        }
    }

    /// All of them.
    pub fn total(&self) -> u64 {
        self.by_kind.values().sum()
    }
}

/// kvmmd's memory at one instant, in KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Memory {
    /// `VmRSS` of `/proc/PID/status`: every page mapped in (heap, the arenas' and session tables'
    /// shared pages, the DRAM pool's touched pages).
    pub rss_kib: u64,
    /// `RssAnon`: private memory (heap, the DRAM pool).
    pub rss_anon_kib: u64,
    /// `RssShmem`: shared memory (the arenas, session tables and client regions).
    pub rss_shmem_kib: u64,
    /// `Pss` of `/proc/PID/smaps_rollup`: shared pages divided among their mappers. The clients map
    /// the arena too, so kvmmd's share moves with which arena pages the clients of the moment have
    /// touched (a fresh client has touched few); reported, not judged. `None` when unreadable.
    pub pss_kib: Option<u64>,
    /// Sessions attached when it was taken.
    pub sessions: u32,
}

/// A `kB` field of a `/proc` status-like text (`VmRSS:    1234 kB`).
pub fn proc_kib(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

impl Memory {
    /// From the texts of `/proc/PID/status` and (if readable) `/proc/PID/smaps_rollup`.
    pub fn parse(status: &str, smaps_rollup: Option<&str>, sessions: u32) -> Option<Memory> {
        Some(Memory {
            rss_kib: proc_kib(status, "VmRSS")?,
            rss_anon_kib: proc_kib(status, "RssAnon").unwrap_or(0),
            rss_shmem_kib: proc_kib(status, "RssShmem").unwrap_or(0),
            pss_kib: smaps_rollup.and_then(|t| proc_kib(t, "Pss")),
            sessions,
        })
    }
}

/// Growth from `start` to `end` in percent (negative: it shrank).
pub fn growth_pct(start: u64, end: u64) -> f64 {
    if start == 0 { 0.0 } else { (end as f64 - start as f64) * 100.0 / start as f64 }
}

/// The warm-up before the first memory sample that the verdict trusts (shorter runs take their
/// first sample after a third of the chaos, and report the growth without judging it).
pub const FULL_WARMUP: std::time::Duration = std::time::Duration::from_secs(30);

/// The most kvmmd's RSS (`VmRSS`) may grow: by its trend over the periodic samples where there
/// are enough of them ([`trend_pct`]), else from the sample after the warm-up to the one at the end.
pub const MAX_GROWTH_PCT: f64 = 5.0;

/// Samples needed for [`trend_pct`]: two minutes past the warm-up at the soak's one every 20 s.
pub const TREND_SAMPLES: usize = 6;

/// The growth in percent that a series of samples (oldest first) shows as a trend: from the
/// highest sample of its first third to the lowest of its last third. A leak lifts even the lowest
/// late sample above every early one; a swing (kvmmd's RSS moves by about 6% within minutes as
/// sessions come and go) gives a growth near or below zero, where two single samples can show
/// the whole swing. `None` with fewer than [`TREND_SAMPLES`] samples.
pub fn trend_pct(samples: &[u64]) -> Option<f64> {
    if samples.len() < TREND_SAMPLES {
        return None;
    }
    let third = samples.len() / 3;
    let early = samples[..third].iter().max()?;
    let late = samples[samples.len() - third..].iter().min()?;
    Some(growth_pct(*early, *late))
}

/// How each client process ended, counted over the run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ClientTally {
    /// Processes started.
    pub started: u64,
    /// Detached and exited 0 after their last append.
    pub finished: u64,
    /// Killed by the chaos loop.
    pub killed: u64,
    /// Ended with `FAILED_PRECONDITION` after the chaos loop wiped their session.
    pub wiped: u64,
    /// Attention outputs checked against the clients' own K/V, summed over their last reports.
    pub attentions_checked: u64,
    /// `FAIL` lines: an attention output that did not match the client's K/V (a wrong byte served).
    pub fails: u64,
    /// Any other end: an error code, a panic, an exit nobody asked for, no answer in time.
    pub unexpected: u64,
}

/// Per action: done, skipped (no target), and refusals the soak expects (the session ended
/// between the pick and the call).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ActionTally {
    /// Carried out.
    pub done: u64,
    /// No client or session to act on at that moment.
    pub skipped: u64,
    /// Refused with `NOT_FOUND` or `FAILED_PRECONDITION` because the session had just gone.
    pub target_gone: u64,
}

/// Page traffic between tiers over the run (from the last `Status`): proof that pages moved.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Traffic {
    /// Pages moved device → DRAM, DRAM → flash, and back up, since kvmmd started.
    pub demoted_to_dram: u64,
    pub demoted_to_flash: u64,
    pub promoted_from_dram: u64,
    pub promoted_from_flash: u64,
    /// Moves within the device (compaction).
    pub pages_moved: u64,
    /// Mode changes the policy thread counted (each `SetPolicy` that changed the mode is one).
    pub policy_mode_changes: u64,
}

impl Traffic {
    /// From a `Status`.
    pub fn of(s: &StatusResponse) -> Traffic {
        Traffic {
            demoted_to_dram: s.demoted_to_dram,
            demoted_to_flash: s.demoted_to_flash,
            promoted_from_dram: s.promoted_from_dram,
            promoted_from_flash: s.promoted_from_flash,
            pages_moved: s.pages_moved,
            policy_mode_changes: s.policy.as_ref().map_or(0, |p| p.mode_changes),
        }
    }
}

/// The soak's final report.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// The seed every random choice came from.
    pub seed: u64,
    /// Client slots kept running.
    pub clients: u32,
    /// The chaos phase asked for, and how long it ran.
    pub minutes: f64,
    pub chaos_seconds: f64,
    /// The whole run, start-up to the daemon's exit.
    pub total_seconds: f64,
    /// The kvmmd arguments (tiers and budgets).
    pub daemon_args: Vec<String>,
    /// Chaos actions by kind.
    pub actions: BTreeMap<Action, ActionTally>,
    /// Invariant checks run (one per second), and those whose cross-RPC part was torn every try.
    pub checks: u64,
    pub torn_checks: u64,
    /// Every violation.
    pub violations: Violations,
    /// The client processes.
    pub client_processes: ClientTally,
    /// Pages moved between tiers.
    pub traffic: Traffic,
    /// kvmmd's memory after the warm-up and at the end, and the growth of its RSS and PSS.
    pub memory_start: Option<Memory>,
    pub memory_end: Option<Memory>,
    /// kvmmd's memory every 20 s after the warm-up (seconds into the chaos, and the sample; whatever
    /// sessions were attached): a leak climbs steadily, a warm-up levels off.
    pub memory_series: Vec<(f64, Memory)>,
    pub rss_growth_pct: Option<f64>,
    pub pss_growth_pct: Option<f64>,
    /// [`trend_pct`] of the RSS samples of [`Report::memory_series`]; where there is one, the
    /// verdict judges it instead of [`Report::rss_growth_pct`].
    pub rss_trend_pct: Option<f64>,
    /// Whether the RSS growth counts in the verdict: only after the full warm-up
    /// ([`FULL_WARMUP`]); a smoke run's first sample is taken while kvmmd's heaps still grow.
    pub memory_judged: bool,
    /// Every tier empty once the clients were gone, and kvmmd's clean exit on SIGTERM.
    pub drained_empty: bool,
    pub daemon_exit: String,
    /// The verdict, and why not.
    pub passed: bool,
    pub failures: Vec<String>,
}

impl Report {
    /// Decides the verdict: no violation, no client FAIL or unexpected end, memory within
    /// [`MAX_GROWTH_PCT`], every tier empty at the end, a clean daemon exit.
    pub fn decide(&mut self) {
        let mut why = Vec::new();
        if self.violations.total() > 0 {
            why.push(format!("{} invariant violations", self.violations.total()));
        }
        if self.client_processes.fails > 0 {
            why.push(format!("{} client FAILs (wrong attention output)", self.client_processes.fails));
        }
        if self.client_processes.unexpected > 0 {
            why.push(format!("{} clients ended unexpectedly", self.client_processes.unexpected));
        }
        let (growth, measure) = match self.rss_trend_pct {
            Some(trend) => (Some(trend), "as a trend over the periodic samples"),
            None => (self.rss_growth_pct, "from the sample after the warm-up to the end"),
        };
        match (growth, self.memory_judged) {
            (_, false) => {}
            (Some(g), true) if g > MAX_GROWTH_PCT => {
                why.push(format!("kvmmd's RSS grew {g:.2}% {measure} (limit {MAX_GROWTH_PCT}%)"));
            }
            (Some(_), true) => {}
            (None, true) => why.push("kvmmd's memory was not measured at both ends".to_owned()),
        }
        if !self.drained_empty {
            why.push("the tiers were not empty after every client left".to_owned());
        }
        if self.daemon_exit != "clean" {
            why.push(format!("kvmmd did not exit cleanly: {}", self.daemon_exit));
        }
        self.passed = why.is_empty();
        self.failures = why;
    }
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn memory_line(m: &Option<Memory>) -> String {
    match m {
        Some(m) => format!(
            "RSS {} KiB (anon {}, shmem {}), PSS {} KiB, {} sessions",
            thousands(m.rss_kib),
            thousands(m.rss_anon_kib),
            thousands(m.rss_shmem_kib),
            m.pss_kib.map_or("?".to_owned(), thousands),
            m.sessions
        ),
        None => "not measured".to_owned(),
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvmm-soak: seed {}, {} clients, {:.1} s of chaos ({:.2} min asked), {:.1} s in all",
            self.seed, self.clients, self.chaos_seconds, self.minutes, self.total_seconds
        )?;
        writeln!(f, "kvmmd {}", self.daemon_args.join(" "))?;
        writeln!(f)?;
        writeln!(f, "| action | done | skipped (no target) | target gone |")?;
        writeln!(f, "|---|---:|---:|---:|")?;
        for (a, t) in &self.actions {
            writeln!(f, "| {} | {} | {} | {} |", a.name(), thousands(t.done), t.skipped, t.target_gone)?;
        }
        writeln!(f)?;
        let c = &self.client_processes;
        writeln!(
            f,
            "clients: {} started, {} finished, {} killed, {} wiped; {} attention outputs checked; {} FAIL, {} \
             unexpected ends",
            c.started,
            c.finished,
            c.killed,
            c.wiped,
            thousands(c.attentions_checked),
            c.fails,
            c.unexpected
        )?;
        let t = &self.traffic;
        writeln!(
            f,
            "pages: {} demoted to DRAM, {} to flash, {} promoted from DRAM, {} from flash, {} moved within the \
             device; {} policy mode changes",
            thousands(t.demoted_to_dram),
            thousands(t.demoted_to_flash),
            thousands(t.promoted_from_dram),
            thousands(t.promoted_from_flash),
            thousands(t.pages_moved),
            t.policy_mode_changes
        )?;
        writeln!(
            f,
            "invariant checks: {} ({} torn every try); violations: {}",
            thousands(self.checks),
            self.torn_checks,
            self.violations.total()
        )?;
        for (kind, n) in &self.violations.by_kind {
            writeln!(f, "  {kind}: {n}")?;
        }
        for line in &self.violations.first {
            writeln!(f, "  {line}")?;
        }
        if !self.memory_series.is_empty() {
            let rss: Vec<String> =
                self.memory_series.iter().map(|(at, m)| format!("{at:.0} s {}", thousands(m.rss_kib))).collect();
            writeln!(f, "RSS during the chaos (KiB): {}", rss.join(", "))?;
        }
        writeln!(f, "memory start: {}", memory_line(&self.memory_start))?;
        writeln!(f, "memory end:   {}", memory_line(&self.memory_end))?;
        let pct = |g: Option<f64>| g.map_or("?".to_owned(), |g| format!("{g:+.2}%"));
        let trend = match self.rss_trend_pct {
            Some(t) => format!(
                "; RSS trend {t:+.2}% (the lowest of the last third of the samples against the highest of the \
                 first), judged instead"
            ),
            None => String::new(),
        };
        writeln!(
            f,
            "memory growth: RSS {}, PSS {}{trend}{}",
            pct(self.rss_growth_pct),
            pct(self.pss_growth_pct),
            if self.memory_judged { "" } else { " (not judged: the run is too short for the 30 s warm-up)" }
        )?;
        writeln!(f, "tiers empty after the clients left: {}; kvmmd exit: {}", self.drained_empty, self.daemon_exit)?;
        if self.passed { write!(f, "PASSED") } else { write!(f, "FAILED: {}", self.failures.join("; ")) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmm_proto::v1::TierUsage;
    use rand::SeedableRng;

    fn fmt(name: &str, pages: u64, bytes: u64) -> FormatUsage {
        FormatUsage { format: name.to_owned(), pages, bytes }
    }

    fn tier(name: &str, used: u64, pages: u64, by_format: Vec<FormatUsage>) -> TierStatus {
        let frames = if name == "device" { pages } else { 0 };
        TierStatus {
            tier: name.to_owned(),
            budget_bytes: 1 << 20,
            used_bytes: used,
            frames,
            pages,
            by_format,
            ..Default::default()
        }
    }

    /// Two sessions: session 1 with 2 f16 device pages (100 B each) and 1 q8 DRAM page (64 B);
    /// session 2 with 1 f16 device page and 1 q8 flash page (4096 B).
    fn consistent() -> (StatusResponse, ListSessionsResponse) {
        let status = StatusResponse {
            tiers: vec![
                tier("device", 300, 3, vec![fmt("f16", 3, 300)]),
                tier("dram", 64, 1, vec![fmt("q8", 1, 64)]),
                tier("flash", 4096, 1, vec![fmt("q8", 1, 4096)]),
            ],
            sessions: 2,
            session_bytes: 300,
            ..Default::default()
        };
        let usage = |name: &str, pages, bytes, f: &str| TierUsage {
            tier: name.to_owned(),
            pages,
            bytes,
            by_format: vec![fmt(f, pages, bytes)],
        };
        let list = ListSessionsResponse {
            sessions: vec![
                SessionInfo {
                    session_id: 1,
                    pid: 10,
                    tiers: vec![usage("device", 2, 200, "f16"), usage("dram", 1, 64, "q8")],
                    ..Default::default()
                },
                SessionInfo {
                    session_id: 2,
                    pid: 11,
                    tiers: vec![usage("device", 1, 100, "f16"), usage("flash", 1, 4096, "q8")],
                    ..Default::default()
                },
            ],
        };
        (status, list)
    }

    fn kinds(findings: &[Finding]) -> Vec<&'static str> {
        findings.iter().map(|f| f.kind).collect()
    }

    #[test]
    fn a_consistent_snapshot_has_no_findings() {
        let (status, list) = consistent();
        let budgets = Budgets::of(&status);
        assert_eq!(check_status(&status, &budgets), vec![]);
        assert_eq!(check_listing(&list), vec![]);
        assert_eq!(compare(&status, &list, &status), Sandwich::Compared(vec![]));
    }

    #[test]
    fn a_frame_counted_for_two_sessions_breaks_the_device_equality() {
        let (mut status, _) = consistent();
        // The page tables name 400 bytes of frames, the allocator handed out 300.
        status.session_bytes = 400;
        assert_eq!(kinds(&check_status(&status, &Budgets::of(&status))), vec!["device_bytes", "device_bytes"]);
    }

    #[test]
    fn frames_reserved_for_a_flash_read_count_only_when_status_reports_them() {
        let (mut status, _) = consistent();
        let budgets = Budgets::of(&status);
        status.tiers[0].used_bytes += 100;
        status.tiers[0].frames += 1;
        assert_eq!(kinds(&check_status(&status, &budgets)), vec!["device_bytes", "device_frames"]);
        status.tiers[0].reserved_bytes = 100;
        status.tiers[0].reserved_frames = 1;
        assert_eq!(check_status(&status, &budgets), vec![]);
    }

    #[test]
    fn a_census_that_does_not_add_up_is_found_in_status_and_in_the_listing() {
        let (mut status, mut list) = consistent();
        status.tiers[1].by_format.push(fmt("q4", 1, 40));
        assert!(kinds(&check_status(&status, &Budgets::of(&status))).contains(&"census"));
        list.sessions[0].tiers[0].pages = 3;
        assert_eq!(kinds(&check_listing(&list)), vec!["census"]);
    }

    #[test]
    fn dram_must_match_exactly_but_flash_may_hold_slots_in_flight() {
        let (mut status, _) = consistent();
        let budgets = Budgets::of(&status);
        status.tiers[2].used_bytes = 8192;
        assert_eq!(check_status(&status, &budgets), vec![]);
        status.tiers[2].used_bytes = 0;
        status.tiers[1].used_bytes = 128;
        assert_eq!(kinds(&check_status(&status, &budgets)), vec!["tier_bytes", "tier_bytes"]);
    }

    #[test]
    fn used_is_held_to_the_configured_budget_even_when_pressure_lowers_the_one_in_force() {
        let (status, _) = consistent();
        let budgets = Budgets::of(&status);
        let mut shrunk = status.clone();
        shrunk.tiers[0].budget_bytes = 200;
        assert_eq!(check_status(&shrunk, &budgets), vec![]);
        let mut over = status;
        over.tiers[1].used_bytes = 2 << 20;
        over.tiers[1].by_format[0].bytes = 2 << 20;
        assert_eq!(kinds(&check_status(&over, &budgets)), vec!["over_budget"]);
    }

    #[test]
    fn a_listing_between_two_different_statuses_is_torn_not_a_violation() {
        let (status, list) = consistent();
        let mut moved = status.clone();
        moved.tiers[0].pages = 2;
        moved.tiers[1].pages = 2;
        assert_eq!(compare(&status, &list, &moved), Sandwich::Torn);
    }

    #[test]
    fn a_page_no_session_lists_is_an_accounting_violation() {
        let (status, mut list) = consistent();
        list.sessions[1].tiers.pop();
        let Sandwich::Compared(findings) = compare(&status, &list, &status) else { panic!("torn") };
        assert_eq!(kinds(&findings), vec!["accounting"]);
        list.sessions.pop();
        let Sandwich::Compared(findings) = compare(&status, &list, &status) else { panic!("torn") };
        // Sessions, device and flash pages, device bytes.
        assert_eq!(kinds(&findings), vec!["accounting"; 4]);
    }

    #[test]
    fn a_session_may_outlive_its_killed_client_only_for_the_grace_period() {
        let (_, list) = consistent();
        let t0 = Instant::now();
        let mut owners = HashMap::from([(10, Owner::Running), (11, Owner::Ended(t0))]);
        assert_eq!(check_owners(&list.sessions, &owners, t0 + Duration::from_secs(1)), vec![]);
        let late = check_owners(&list.sessions, &owners, t0 + OWNER_GRACE + Duration::from_millis(1));
        assert_eq!(kinds(&late), vec!["dead_owner"]);
        assert!(late[0].detail.contains("session 2"), "{}", late[0].detail);
        owners.remove(&10);
        assert_eq!(kinds(&check_owners(&list.sessions, &owners, t0)), vec!["dead_owner"]);
    }

    #[test]
    fn an_empty_daemon_passes_the_final_check_and_a_leftover_frame_does_not() {
        let empty =
            StatusResponse { tiers: TIERS.iter().map(|n| tier(n, 0, 0, vec![])).collect(), ..Default::default() };
        assert_eq!(check_empty(&empty), vec![]);
        let mut left = empty;
        left.tiers[0].frames = 1;
        assert_eq!(kinds(&check_empty(&left)), vec!["leak"]);
    }

    #[test]
    fn proc_fields_are_read_in_kib() {
        let status = "Name:\tkvmmd\nVmRSS:\t   41236 kB\nRssAnon:\t   20000 kB\nRssShmem:\t 16384 kB\n";
        let rollup = "00400000-7fff [rollup]\nRss:   41236 kB\nPss:   30000 kB\n";
        let m = Memory::parse(status, Some(rollup), 6).expect("parsed");
        assert_eq!((m.rss_kib, m.rss_anon_kib, m.rss_shmem_kib, m.pss_kib), (41236, 20000, 16384, Some(30000)));
        assert_eq!(Memory::parse("Name: x\n", None, 0), None);
        assert_eq!(proc_kib(rollup, "Pss_Anon"), None);
    }

    #[test]
    fn growth_is_relative_to_the_start() {
        assert!((growth_pct(1000, 1050) - 5.0).abs() < 1e-9);
        assert!((growth_pct(1000, 900) + 10.0).abs() < 1e-9);
        assert_eq!(growth_pct(0, 5), 0.0);
    }

    #[test]
    fn a_trend_needs_six_samples_and_sees_a_climb_but_not_a_swing() {
        assert_eq!(trend_pct(&[100, 110, 120, 130, 140]), None);
        // A steady climb of 2% a minute over 9 minutes: the late minimum far above the early maximum.
        let climb: Vec<u64> = (0..9).map(|m| 40_000 + 800 * m).collect();
        let t = trend_pct(&climb).expect("nine samples");
        assert!((t - growth_pct(40_000 + 800 * 2, 40_000 + 800 * 6)).abs() < 1e-9, "{t}");
        assert!(t > MAX_GROWTH_PCT);
        // A swing with no trend, like that of a 20-minute soak (39,692–42,124 KiB, no climb).
        let swing = [41_176, 40_468, 41_564, 39_692, 40_904, 41_316, 40_080, 40_252, 41_772, 42_124];
        let t = trend_pct(&swing).expect("ten samples");
        assert!(t <= 0.0, "{t}");
        assert!(growth_pct(39_692, 42_124) > MAX_GROWTH_PCT, "two samples of the swing would fail it");
    }

    #[test]
    fn every_action_is_drawn_and_policy_flips_always_change_the_body() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let drawn: std::collections::BTreeSet<Action> = (0..1000).map(|_| pick_action(&mut rng)).collect();
        assert_eq!(drawn.len(), Action::ALL.len());
        for current in 0..POLICIES.len() {
            for _ in 0..50 {
                let next = next_policy(&mut rng, current);
                assert!(next != current && next < POLICIES.len());
            }
        }
        assert!((0..100).all(|_| (1000..=3000).contains(&action_interval(&mut rng).as_millis())));
    }

    #[test]
    fn the_verdict_names_each_reason() {
        let mut r = Report {
            rss_growth_pct: Some(6.0),
            memory_judged: true,
            drained_empty: true,
            daemon_exit: "clean".to_owned(),
            ..Default::default()
        };
        r.violations.add(&Finding::new("census", "x".to_owned()), 1.0);
        r.client_processes.fails = 1;
        r.decide();
        assert!(!r.passed);
        assert_eq!(r.failures.len(), 3, "{:?}", r.failures);
        let mut ok = Report { rss_growth_pct: Some(1.0), drained_empty: true, daemon_exit: "clean".to_owned(), ..r };
        ok.violations = Violations::default();
        ok.client_processes.fails = 0;
        ok.decide();
        assert!(ok.passed, "{:?}", ok.failures);
        let mut swing = Report { rss_growth_pct: Some(6.0), rss_trend_pct: Some(-1.0), ..ok.clone() };
        swing.decide();
        assert!(swing.passed, "the trend is judged where there is one: {:?}", swing.failures);
        let mut leak = Report { rss_growth_pct: Some(1.0), rss_trend_pct: Some(5.5), ..ok.clone() };
        leak.decide();
        assert_eq!(leak.failures, ["kvmmd's RSS grew 5.50% as a trend over the periodic samples (limit 5%)"]);
        let mut smoke = Report { rss_growth_pct: Some(20.0), memory_judged: false, ..ok };
        smoke.decide();
        assert!(smoke.passed, "a smoke run's memory is reported, not judged: {:?}", smoke.failures);
        assert_eq!(thousands(1234567), "1,234,567");
    }
}
