//! Readings of the host that steer the policy: thermal zones, power supplies and memory pressure,
//! read through one host root (`/` in production, a temp dir in tests).
//!
//! These are the types the planner consumes ([`Signals`]). Every field that could not be read is
//! `None` or absent, never an error: a missing battery, a garbage `temp` file or an EIO from sysfs
//! must not stop the daemon, and the planner treats an unknown reading as "no reason to change".
//! What went wrong is kept in [`Signals::problems`] for the status RPC and the log.
//!
//! # Files read (below the root)
//!
//! ```text
//! sys/class/thermal/thermal_zoneN/      N decimal, zones sorted by N (zone10 after zone2)
//!     type                              free text          -> ThermalZone::kind
//!     temp                              millidegrees C     -> ThermalZone::temp_mc (may be < 0)
//!     trip_point_M_temp                 millidegrees C     -> TripPoint::temp_mc, sorted by M
//!     trip_point_M_type                 active|passive|hot|critical, else Other
//! sys/class/power_supply/NAME/          directories sorted by NAME
//!     type                              Battery, or Mains/USB/UPS/Wireless/...
//!     online      (non-Battery)         0 offline, 1 or 2 online -> Power::on_ac
//!     present     (Battery)             0 absent, 1 present; no file = present
//!     status      (Battery)             Charging|Discharging|Not charging|Full, else Unknown
//!     capacity    (Battery)             percent 0..=100
//! proc/pressure/memory                  "some avg10=A avg60=B avg300=C total=T" and "full ..."
//! proc/meminfo                          "MemAvailable:  N kB", "MemTotal:  N kB" -> bytes
//! ```
//!
//! # Degradation rules
//!
//! - Every file is read whole up to [`READ_CAP_BYTES`], opened `O_NONBLOCK` (a FIFO cannot stall
//!   a reading), and trimmed.
//! - A file or directory that does not exist (`ENOENT`, `ENOTDIR`, `ENODEV`, `ENXIO`) is normal
//!   absence: the reading is `None` or left out and **no** problem is noted. A supply directory that
//!   vanishes between the listing and the reading is absent, or holds what was read before it went.
//! - A file that exists but cannot be read (EIO, EISDIR, EACCES, too long, not UTF-8) or does not
//!   parse gives `None` and one sentence in [`Signals::problems`] naming the path and the fault.
//! - A thermal zone whose `temp` is absent or bad is left out; so is a trip whose temp is. A trip
//!   without a readable type is [`TripKind::Other`]. A zone without a readable `type` has an empty
//!   kind.
//! - `on_ac` is `Some(true)` when any non-battery supply with an `online` file is online,
//!   `Some(false)` when there are such supplies and all are known to be offline, and `None` when
//!   there are none (a desktop) or none is online and one could not be read.
//! - The battery is the first `Battery` supply by name that is present. A missing `status` is
//!   `Unknown`, a bad `capacity` is `None`.
//! - A PSI file without a `full` line is tolerated; without a usable `some avg10=` it is a problem.
//!   A meminfo without `MemAvailable` (old kernels) is tolerated; without either key it is a problem.
//!
//! The parsers (`parse_*`) are pure functions on `&str` that accept any input; the tree walking is
//! apart from them.
//!
//! # The PSI trigger ([`PressureWatch`])
//!
//! Writing `some <stall_us> <window_us>` to `/proc/pressure/memory` asks the kernel to wake pollers
//! of that file with `POLLPRI` when tasks stalled on memory for at least `stall_us` within any
//! `window_us`; it signals at most once per window, and closing the file removes the trigger. The
//! kernel refuses (`EINVAL`) a window of 0 or above 10 s (older kernels also one below 500 ms), a
//! stall of 0 or above the window, and, for an opener without `CAP_SYS_RESOURCE`, a window that is
//! not a multiple of 2 s. Only one trigger fits in one open file (`EBUSY`). The kernel turns the
//! last byte written into the string's NUL, so the line is written with a trailing NUL.
//!
//! [`PressureWatch::open`] rounds the window up to a multiple of 2 s so the same trigger works
//! privileged or not, and refuses a stall of 0 or not below the window itself. When the trigger
//! cannot be armed it falls back to polling: [`PressureWatch::wait`] then sleeps the timeout and
//! returns [`Wake::Polled`], and [`PressureWatch::fallback_reason`] says why — no
//! `proc/pressure/memory` (a kernel without PSI, or booted with `psi=0`), a file that is not on
//! procfs (a fake root: a regular file takes the write but never reports `POLLPRI`), or the errno
//! the kernel gave the write.

use std::fs::File;
use std::io::{ErrorKind, Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::fs::{PROC_SUPER_MAGIC, fstatfs};
use rustix::io::Errno;

/// One reading of every sensor.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Signals {
    /// `sys/class/thermal/thermal_zone*`, in directory order (zone0, zone1, …, numerically).
    pub thermal: Vec<ThermalZone>,
    /// `sys/class/power_supply/*`.
    pub power: Power,
    /// `proc/pressure/memory` and `proc/meminfo`.
    pub memory: Memory,
    /// Files that exist but could not be read or parsed, one sentence each (path and reason).
    pub problems: Vec<String>,
}

/// A thermal zone.
#[derive(Clone, Debug, PartialEq)]
pub struct ThermalZone {
    /// Directory name, e.g. `thermal_zone0`.
    pub name: String,
    /// The zone's `type` file, e.g. `x86_pkg_temp`, `cpu-thermal`.
    pub kind: String,
    /// `temp`, in millidegrees Celsius.
    pub temp_mc: i64,
    /// `trip_point_N_temp` / `trip_point_N_type`, in N order; trips whose temp is unreadable are left out.
    pub trips: Vec<TripPoint>,
}

impl ThermalZone {
    /// The lowest passive trip point, millidegrees Celsius: where the kernel starts throttling.
    pub fn passive_trip(&self) -> Option<i64> {
        self.trips.iter().filter(|t| t.kind == TripKind::Passive).map(|t| t.temp_mc).min()
    }
}

/// A trip point of a thermal zone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TripPoint {
    /// Millidegrees Celsius.
    pub temp_mc: i64,
    /// Its type.
    pub kind: TripKind,
}

/// `trip_point_N_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TripKind {
    /// `active`: a fan.
    Active,
    /// `passive`: the kernel starts throttling here; kvmm enters thermal mode.
    Passive,
    /// `hot`.
    Hot,
    /// `critical`: the system shuts down.
    Critical,
    /// Anything else.
    Other,
}

/// Power supplies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Power {
    /// Whether any `Mains`/`USB`-type supply reports `online` = 1; `None` when the host has none
    /// (a desktop without a battery driver reports nothing at all).
    pub on_ac: Option<bool>,
    /// The first `Battery`-type supply that is `present` (absent `present` counts as present).
    pub battery: Option<Battery>,
}

/// A battery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Battery {
    /// Directory name, e.g. `BAT0`.
    pub name: String,
    /// `status`.
    pub status: BatteryStatus,
    /// `capacity`, percent (0–100); `None` when unreadable or out of range.
    pub capacity: Option<u8>,
}

/// A battery's `status` file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatteryStatus {
    /// `Charging`.
    Charging,
    /// `Discharging`.
    Discharging,
    /// `Not charging` (plugged in, held at a threshold).
    NotCharging,
    /// `Full`.
    Full,
    /// `Unknown` or anything unrecognised.
    Unknown,
}

impl BatteryStatus {
    /// Lower-case words for status output.
    pub fn name(self) -> &'static str {
        match self {
            BatteryStatus::Charging => "charging",
            BatteryStatus::Discharging => "discharging",
            BatteryStatus::NotCharging => "not charging",
            BatteryStatus::Full => "full",
            BatteryStatus::Unknown => "unknown",
        }
    }
}

/// Memory.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Memory {
    /// `/proc/pressure/memory` `some avg10` (percent of wall time some task stalled on memory).
    pub some_avg10: Option<f64>,
    /// `full avg10` (percent of wall time all non-idle tasks stalled).
    pub full_avg10: Option<f64>,
    /// `MemAvailable`, bytes.
    pub mem_available: Option<u64>,
    /// `MemTotal`, bytes.
    pub mem_total: Option<u64>,
}

/// Reads [`Signals`] below a host root.
#[derive(Clone, Debug)]
pub struct HostRoot {
    /// `/` in production.
    pub root: PathBuf,
}

// ---------------------------------------------------------------------------------------------
// Reading the tree
// ---------------------------------------------------------------------------------------------

/// Most bytes read from one file. Every file read here is far shorter (`/proc/meminfo` is the
/// longest); a longer file is treated as garbage rather than read in part.
pub const READ_CAP_BYTES: u64 = 4096;

impl HostRoot {
    /// A host root: `/` in production, a temp dir holding a fake `sys/` and `proc/` in tests.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// One reading of every sensor. Never fails and never panics; see the module doc for what an
    /// absent, unreadable or garbage file turns into.
    pub fn read(&self) -> Signals {
        let mut problems = Vec::new();
        let thermal = read_thermal(&self.root.join("sys/class/thermal"), &mut problems);
        let power = read_power(&self.root.join("sys/class/power_supply"), &mut problems);
        let memory = read_memory(&self.root.join("proc"), &mut problems);
        Signals { thermal, power, memory, problems }
    }
}

/// Reads one file, trimmed. `Ok(None)` when it does not exist (absence is normal: no battery, no
/// PSI); `Err` holds a sentence naming the path and what went wrong.
///
/// The file is opened `O_NONBLOCK`, so a FIFO planted where a sysfs file belongs reads as empty
/// instead of blocking; sysfs, procfs and regular files ignore the flag.
fn read_text(path: &Path) -> Result<Option<String>, String> {
    let file = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path) {
        Ok(file) => file,
        Err(e) if is_absence(&e) => return Ok(None),
        Err(e) => return Err(format!("cannot open {}: {e}", path.display())),
    };
    let mut bytes = Vec::new();
    match file.take(READ_CAP_BYTES + 1).read_to_end(&mut bytes) {
        Ok(_) => {}
        // The file (or the device behind it) went away between open and read.
        Err(e) if is_absence(&e) => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    }
    if bytes.len() as u64 > READ_CAP_BYTES {
        return Err(format!("{} is longer than {READ_CAP_BYTES} bytes; a sensor file never is", path.display()));
    }
    match String::from_utf8(bytes) {
        Ok(text) => Ok(Some(text.trim().to_owned())),
        Err(_) => Err(format!("{} holds bytes that are not UTF-8", path.display())),
    }
}

/// Errors that mean "the file is not there": it never existed, a directory on its path is gone or
/// is a plain file, or the device behind a sysfs file was unplugged.
fn is_absence(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::NotFound || matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ENODEV | libc::ENXIO))
}

/// Reads and parses one file. `None` when it is absent (silently) or unreadable or does not parse
/// (with a problem noted). `what` completes "… which is not": "a temperature in millidegrees".
fn read_parsed<T>(
    path: &Path,
    what: &str,
    parse: impl FnOnce(&str) -> Option<T>,
    problems: &mut Vec<String>,
) -> Option<T> {
    let text = match read_text(path) {
        Ok(text) => text?,
        Err(problem) => {
            problems.push(problem);
            return None;
        }
    };
    let value = parse(&text);
    if value.is_none() {
        problems.push(garbage(path, &text, what));
    }
    value
}

/// A problem sentence for a file whose contents do not parse.
fn garbage(path: &Path, text: &str, what: &str) -> String {
    const SHOWN_CHARS: usize = 40;
    let shown: String = text.chars().take(SHOWN_CHARS).collect();
    let ellipsis = if text.chars().nth(SHOWN_CHARS).is_some() { "…" } else { "" };
    format!("{} holds {shown:?}{ellipsis}, which is not {what}", path.display())
}

/// The names in `dir` of the form `<prefix><N><suffix>` with N decimal digits, sorted by N
/// (so `thermal_zone10` comes after `thermal_zone2`). A missing `dir` has no entries.
fn numbered_entries(dir: &Path, prefix: &str, suffix: &str, problems: &mut Vec<String>) -> Vec<(u32, String)> {
    let mut found: Vec<(u32, String)> = entry_names(dir, problems)
        .into_iter()
        .filter_map(|name| {
            let digits = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some((digits.parse().ok()?, name))
        })
        .collect();
    found.sort();
    found
}

/// The UTF-8 names in `dir`, unsorted. A missing `dir` (or one that vanished) has none; any other
/// listing error is a problem.
fn entry_names(dir: &Path, problems: &mut Vec<String>) -> Vec<String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if is_absence(&e) => return Vec::new(),
        Err(e) => {
            problems.push(format!("cannot list {}: {e}", dir.display()));
            return Vec::new();
        }
    };
    // An entry that fails mid-listing (its directory was removed) is skipped like a vanished one.
    entries.filter_map(Result::ok).filter_map(|entry| entry.file_name().into_string().ok()).collect()
}

fn read_thermal(class: &Path, problems: &mut Vec<String>) -> Vec<ThermalZone> {
    numbered_entries(class, "thermal_zone", "", problems)
        .into_iter()
        .filter_map(|(_, name)| read_zone(&class.join(&name), name, problems))
        .collect()
}

/// One `thermal_zoneN` directory; `None` when its `temp` is absent or unreadable.
fn read_zone(dir: &Path, name: String, problems: &mut Vec<String>) -> Option<ThermalZone> {
    let temp_mc =
        read_parsed(&dir.join("temp"), "a temperature in millidegrees Celsius", parse_millidegrees, problems)?;
    let kind = match read_text(&dir.join("type")) {
        Ok(kind) => kind.unwrap_or_default(),
        Err(problem) => {
            problems.push(problem);
            String::new()
        }
    };
    let trips = numbered_entries(dir, "trip_point_", "_temp", problems)
        .into_iter()
        .filter_map(|(n, temp_name)| {
            let temp_mc = read_parsed(
                &dir.join(temp_name),
                "a temperature in millidegrees Celsius",
                parse_millidegrees,
                problems,
            )?;
            let kind = match read_text(&dir.join(format!("trip_point_{n}_type"))) {
                Ok(Some(text)) => parse_trip_kind(&text),
                Ok(None) => TripKind::Other,
                Err(problem) => {
                    problems.push(problem);
                    TripKind::Other
                }
            };
            Some(TripPoint { temp_mc, kind })
        })
        .collect();
    Some(ThermalZone { name, kind, temp_mc, trips })
}

/// What one `power_supply/*` directory contributes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Supply {
    /// A non-battery supply with an `online` file; `None` when that file is unreadable.
    Line { online: Option<bool> },
    /// A present battery.
    Battery(Battery),
}

fn read_power(class: &Path, problems: &mut Vec<String>) -> Power {
    let mut names = entry_names(class, problems);
    names.sort();
    let mut lines = Vec::new();
    let mut battery = None;
    for name in names {
        match read_supply(&class.join(&name), name, problems) {
            Some(Supply::Line { online }) => lines.push(online),
            Some(Supply::Battery(found)) => {
                battery.get_or_insert(found);
            }
            None => {}
        }
    }
    Power { on_ac: on_ac(&lines), battery }
}

/// One supply directory. `None` when it contributes nothing: it has no `type` (or vanished before
/// it was read), it is a battery whose `present` is 0, or it is neither a battery nor has an
/// `online` file. A directory that vanishes halfway yields what was read before it went.
fn read_supply(dir: &Path, name: String, problems: &mut Vec<String>) -> Option<Supply> {
    let kind = match read_text(&dir.join("type")) {
        Ok(kind) => kind?,
        Err(problem) => {
            problems.push(problem);
            return None;
        }
    };
    if kind == "Battery" {
        // Absent or unparsable `present` counts as present: most batteries have no such file.
        let present = read_parsed(&dir.join("present"), "0 or 1", parse_flag, problems).unwrap_or(true);
        if !present {
            return None;
        }
        let status = match read_text(&dir.join("status")) {
            Ok(Some(text)) => parse_battery_status(&text),
            Ok(None) => BatteryStatus::Unknown,
            Err(problem) => {
                problems.push(problem);
                BatteryStatus::Unknown
            }
        };
        let capacity = read_parsed(&dir.join("capacity"), "a percentage from 0 to 100", parse_capacity, problems);
        return Some(Supply::Battery(Battery { name, status, capacity }));
    }
    match read_text(&dir.join("online")) {
        Ok(Some(text)) => {
            let online = parse_online(&text);
            if online.is_none() {
                problems.push(garbage(&dir.join("online"), &text, "0, 1 or 2"));
            }
            Some(Supply::Line { online })
        }
        Ok(None) => None,
        Err(problem) => {
            problems.push(problem);
            Some(Supply::Line { online: None })
        }
    }
}

/// Folds the `online` readings of the line supplies: on AC when any is online; off AC when there
/// are some and every one is known to be offline; unknown when there are none, or none is online
/// and one could not be read.
fn on_ac(lines: &[Option<bool>]) -> Option<bool> {
    if lines.contains(&Some(true)) {
        Some(true)
    } else if lines.is_empty() || lines.contains(&None) {
        None
    } else {
        Some(false)
    }
}

fn read_memory(proc: &Path, problems: &mut Vec<String>) -> Memory {
    let mut memory = Memory::default();
    let psi = proc.join("pressure/memory");
    match read_text(&psi) {
        Ok(Some(text)) => {
            (memory.some_avg10, memory.full_avg10) = parse_psi_avg10(&text);
            // A missing `full` line is tolerated (the system-wide cpu file never has one); a
            // missing `some` line means the file is not what it should be.
            if memory.some_avg10.is_none() {
                problems.push(garbage(&psi, &text, "a PSI report with a `some avg10=` figure"));
            }
        }
        Ok(None) => {}
        Err(problem) => problems.push(problem),
    }
    let meminfo = proc.join("meminfo");
    match read_text(&meminfo) {
        Ok(Some(text)) => {
            (memory.mem_available, memory.mem_total) = parse_meminfo(&text);
            // Kernels before `MemAvailable` existed still report `MemTotal`.
            if memory.mem_available.is_none() && memory.mem_total.is_none() {
                problems.push(garbage(&meminfo, &text, "a meminfo report with `MemTotal:` in kB"));
            }
        }
        Ok(None) => {}
        Err(problem) => problems.push(problem),
    }
    memory
}

// ---------------------------------------------------------------------------------------------
// Parsers: pure, total, and given text already trimmed or not (they trim themselves)
// ---------------------------------------------------------------------------------------------

/// A thermal `temp` or `trip_point_N_temp`: a decimal integer of millidegrees Celsius, possibly
/// negative.
pub fn parse_millidegrees(text: &str) -> Option<i64> {
    text.trim().parse().ok()
}

/// A `trip_point_N_type`.
pub fn parse_trip_kind(text: &str) -> TripKind {
    match text.trim() {
        "active" => TripKind::Active,
        "passive" => TripKind::Passive,
        "hot" => TripKind::Hot,
        "critical" => TripKind::Critical,
        _ => TripKind::Other,
    }
}

/// A battery `status`.
pub fn parse_battery_status(text: &str) -> BatteryStatus {
    match text.trim() {
        "Charging" => BatteryStatus::Charging,
        "Discharging" => BatteryStatus::Discharging,
        "Not charging" => BatteryStatus::NotCharging,
        "Full" => BatteryStatus::Full,
        _ => BatteryStatus::Unknown,
    }
}

/// A battery `capacity`: percent, 0 to 100.
pub fn parse_capacity(text: &str) -> Option<u8> {
    let percent: i64 = text.trim().parse().ok()?;
    u8::try_from(percent).ok().filter(|p| *p <= 100)
}

/// A supply's `online`: 0 is offline; 1 (fixed voltage) and 2 (programmable voltage, USB PD
/// supplies) are online, as the sysfs power-supply ABI lists them.
pub fn parse_online(text: &str) -> Option<bool> {
    match text.trim() {
        "0" => Some(false),
        "1" | "2" => Some(true),
        _ => None,
    }
}

/// A 0/1 flag such as a battery's `present`.
pub fn parse_flag(text: &str) -> Option<bool> {
    match text.trim() {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}

/// A PSI report (`/proc/pressure/memory`): the `avg10` of the `some` line and of the `full` line,
/// in that order. A figure that is missing, not a number, or outside 0–100 is `None`; the first
/// line of each kind counts.
pub fn parse_psi_avg10(text: &str) -> (Option<f64>, Option<f64>) {
    let (mut some, mut full) = (None, None);
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let slot = match words.next() {
            Some("some") => &mut some,
            Some("full") => &mut full,
            _ => continue,
        };
        if slot.is_some() {
            continue;
        }
        *slot = words
            .find_map(|word| word.strip_prefix("avg10="))
            .and_then(|figure| figure.parse::<f64>().ok())
            .filter(|percent| (0.0..=100.0).contains(percent));
    }
    (some, full)
}

/// `/proc/meminfo`: `MemAvailable` and `MemTotal`, in that order, converted from kB to bytes. A
/// line without the `kB` unit, with a value that is not a number, or whose byte count overflows
/// `u64` is `None`; the first line of each key counts.
pub fn parse_meminfo(text: &str) -> (Option<u64>, Option<u64>) {
    let (mut available, mut total) = (None, None);
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let slot = match words.next() {
            Some("MemAvailable:") => &mut available,
            Some("MemTotal:") => &mut total,
            _ => continue,
        };
        if slot.is_some() {
            continue;
        }
        let (Some(value), Some("kB"), None) = (words.next(), words.next(), words.next()) else {
            continue;
        };
        *slot = value.parse::<u64>().ok().and_then(|kib| kib.checked_mul(1024));
    }
    (available, total)
}

// ---------------------------------------------------------------------------------------------
// PSI trigger
// ---------------------------------------------------------------------------------------------

/// Unprivileged PSI trigger windows must be a multiple of this (the kernel then evaluates them on
/// its 2 s averaging work and spawns no real-time thread).
pub const PSI_WINDOW_STEP_US: u64 = 2_000_000;

/// The longest PSI trigger window the kernel accepts (`WINDOW_MAX_US`).
pub const PSI_WINDOW_MAX_US: u64 = 10_000_000;

/// The trigger line for `stall_us` of "some" memory stall within `window_us`, the window rounded
/// up to a multiple of [`PSI_WINDOW_STEP_US`] so that the trigger is accepted without
/// `CAP_SYS_RESOURCE`. `Err` says why the pair is refused: the stall must be above zero and below
/// the window as asked, and the rounded window at most [`PSI_WINDOW_MAX_US`].
pub fn trigger_spec(stall_us: u64, window_us: u64) -> Result<String, String> {
    if stall_us == 0 || stall_us >= window_us {
        return Err(format!(
            "a memory-pressure trigger needs 0 < stall < window; got a stall of {stall_us} µs in a window of \
             {window_us} µs"
        ));
    }
    let window = window_us.div_ceil(PSI_WINDOW_STEP_US).saturating_mul(PSI_WINDOW_STEP_US);
    if window > PSI_WINDOW_MAX_US {
        return Err(format!(
            "a memory-pressure trigger window of {window_us} µs rounds up to {window} µs, above the kernel's \
             limit of {PSI_WINDOW_MAX_US} µs"
        ));
    }
    Ok(format!("some {stall_us} {window}"))
}

/// What ended a [`PressureWatch::wait`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// The trigger fired (`poll` reported `POLLPRI`): the stall threshold was crossed in the window.
    Triggered,
    /// The trigger is armed but did not fire before the timeout.
    Timeout,
    /// No trigger: the watch slept the whole timeout; read [`HostRoot::read`] to see the pressure.
    Polled,
}

/// A memory-pressure trigger on `<root>/proc/pressure/memory`, or a polling fallback when the
/// host cannot give one. Dropping it closes the file, which removes the trigger.
#[derive(Debug)]
pub struct PressureWatch {
    /// The file the trigger was written to (or would have been).
    path: PathBuf,
    /// The open trigger file; `None` in the fallback. Set by `open`, cleared by `wait` if `poll`
    /// ever fails on it, closed on drop.
    trigger: Option<File>,
    /// The trigger line written, without its NUL, e.g. `some 150000 2000000`; `None` in the
    /// fallback.
    spec: Option<String>,
    /// Why the watch polls; `None` while the trigger is armed.
    fallback: Option<String>,
}

impl PressureWatch {
    /// Arms a trigger for `stall_us` of "some" memory stall within `window_us` (rounded up to a
    /// multiple of 2 s, see [`trigger_spec`]), or falls back to polling and says why in
    /// [`fallback_reason`](Self::fallback_reason). Never fails.
    pub fn open(root: &HostRoot, stall_us: u64, window_us: u64) -> PressureWatch {
        let path = root.root.join("proc/pressure/memory");
        match arm(&path, stall_us, window_us) {
            Ok((file, spec)) => PressureWatch { path, trigger: Some(file), spec: Some(spec), fallback: None },
            Err(reason) => PressureWatch { path, trigger: None, spec: None, fallback: Some(reason) },
        }
    }

    /// Waits up to `timeout` for the trigger; in the fallback, sleeps `timeout` and returns
    /// [`Wake::Polled`]. If `poll` fails on an armed trigger, the watch drops to the fallback
    /// (with the reason recorded) and sleeps out the rest of the timeout.
    pub fn wait(&mut self, timeout: Duration) -> Wake {
        let deadline = Instant::now().checked_add(timeout);
        let Some(file) = &self.trigger else {
            std::thread::sleep(timeout);
            return Wake::Polled;
        };
        let failure = loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let timespec = match left.map(Timespec::try_from) {
                Some(Ok(timespec)) => Some(timespec),
                // Beyond what `Timespec` holds (hundreds of billions of years): wait forever.
                Some(Err(_)) | None => None,
            };
            // Only POLLPRI is asked for: the PSI file also reports itself readable and writable at
            // all times, which `poll` masks out unless asked.
            let mut fds = [PollFd::new(file, PollFlags::PRI)];
            match poll(&mut fds, timespec.as_ref()) {
                Ok(0) => return Wake::Timeout,
                Ok(_) => {
                    let revents = fds[0].revents();
                    if revents.contains(PollFlags::PRI) && !revents.contains(PollFlags::ERR) {
                        return Wake::Triggered;
                    }
                    // POLLERR|POLLPRI is what the kernel reports for a file without a trigger;
                    // anything else is unexpected. Either way, polling it again would spin.
                    break format!("poll on {} reported {revents:?} instead of POLLPRI", self.path.display());
                }
                Err(Errno::INTR) => continue,
                Err(e) => break format!("poll on {} failed: {e}", self.path.display()),
            }
        };
        self.trigger = None;
        self.spec = None;
        self.fallback = Some(failure);
        if let Some(left) = deadline.map(|d| d.saturating_duration_since(Instant::now())) {
            std::thread::sleep(left);
        }
        Wake::Polled
    }

    /// Why the watch polls instead of waiting on a trigger; `None` while the trigger is armed.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// The trigger line written (without its NUL), e.g. `some 150000 2000000`; `None` in the
    /// fallback.
    pub fn trigger(&self) -> Option<&str> {
        self.spec.as_deref()
    }

    /// `<root>/proc/pressure/memory`.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Opens `path` and writes the trigger; `Err` is the fallback reason.
fn arm(path: &Path, stall_us: u64, window_us: u64) -> Result<(File, String), String> {
    let spec = trigger_spec(stall_us, window_us)?;
    let file =
        std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(|e| {
            match e.kind() {
                ErrorKind::NotFound => {
                    format!("no {} (kernel without PSI, or PSI disabled with psi=0)", path.display())
                }
                _ => format!("cannot open {} for a trigger: {e}", path.display()),
            }
        })?;
    // A regular file takes the write and then polls readable forever without POLLPRI, so only
    // the real procfs file is trusted to carry a trigger.
    let fs = fstatfs(&file).map_err(|e| format!("cannot tell which filesystem {} is on: {e}", path.display()))?;
    if fs.f_type != PROC_SUPER_MAGIC {
        return Err(format!(
            "{} is not procfs (filesystem magic {:#x}), so it cannot carry a PSI trigger",
            path.display(),
            fs.f_type
        ));
    }
    // `psi_write` overwrites the last byte written with a NUL, so the line is sent with one.
    let mut line = spec.clone().into_bytes();
    line.push(0);
    match (&file).write(&line) {
        Ok(n) if n == line.len() => Ok((file, spec)),
        Ok(n) => Err(format!("{} took {n} of the {} bytes of the trigger {spec:?}", path.display(), line.len())),
        Err(e) => Err(format!("{} does not accept the trigger {spec:?}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Writes `files` (path below the root, contents) into a fresh temp dir.
    fn tree(files: &[(&str, &str)]) -> (tempfile::TempDir, HostRoot) {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        let root = HostRoot::new(dir.path());
        (dir, root)
    }

    const PSI: &str = "some avg10=1.23 avg60=0.50 avg300=0.10 total=12345\n\
                       full avg10=0.40 avg60=0.20 avg300=0.05 total=6789\n";
    const MEMINFO: &str = "MemTotal:       16318464 kB\nMemFree:         1234567 kB\n\
                           MemAvailable:    8159232 kB\nBuffers:          123456 kB\n";

    fn laptop() -> Vec<(&'static str, &'static str)> {
        vec![
            ("sys/class/thermal/thermal_zone0/type", "acpitz\n"),
            ("sys/class/thermal/thermal_zone0/temp", "52000\n"),
            ("sys/class/thermal/thermal_zone0/trip_point_0_temp", "95000\n"),
            ("sys/class/thermal/thermal_zone0/trip_point_0_type", "passive\n"),
            ("sys/class/thermal/thermal_zone0/trip_point_1_temp", "110000\n"),
            ("sys/class/thermal/thermal_zone0/trip_point_1_type", "critical\n"),
            ("sys/class/thermal/thermal_zone1/type", "x86_pkg_temp\n"),
            ("sys/class/thermal/thermal_zone1/temp", "61000\n"),
            ("sys/class/thermal/thermal_zone1/trip_point_0_temp", "90000\n"),
            ("sys/class/thermal/thermal_zone1/trip_point_0_type", "passive\n"),
            ("sys/class/thermal/thermal_zone1/trip_point_1_temp", "105000\n"),
            ("sys/class/thermal/thermal_zone1/trip_point_1_type", "critical\n"),
            ("sys/class/power_supply/AC/type", "Mains\n"),
            ("sys/class/power_supply/AC/online", "0\n"),
            ("sys/class/power_supply/BAT0/type", "Battery\n"),
            ("sys/class/power_supply/BAT0/present", "1\n"),
            ("sys/class/power_supply/BAT0/status", "Discharging\n"),
            ("sys/class/power_supply/BAT0/capacity", "15\n"),
            ("proc/pressure/memory", PSI),
            ("proc/meminfo", MEMINFO),
        ]
    }

    fn trip(temp_mc: i64, kind: TripKind) -> TripPoint {
        TripPoint { temp_mc, kind }
    }

    #[test]
    fn a_laptop_on_battery_reads_whole() {
        let (_dir, root) = tree(&laptop());
        let expected = Signals {
            thermal: vec![
                ThermalZone {
                    name: "thermal_zone0".into(),
                    kind: "acpitz".into(),
                    temp_mc: 52_000,
                    trips: vec![trip(95_000, TripKind::Passive), trip(110_000, TripKind::Critical)],
                },
                ThermalZone {
                    name: "thermal_zone1".into(),
                    kind: "x86_pkg_temp".into(),
                    temp_mc: 61_000,
                    trips: vec![trip(90_000, TripKind::Passive), trip(105_000, TripKind::Critical)],
                },
            ],
            power: Power {
                on_ac: Some(false),
                battery: Some(Battery { name: "BAT0".into(), status: BatteryStatus::Discharging, capacity: Some(15) }),
            },
            memory: Memory {
                some_avg10: Some(1.23),
                full_avg10: Some(0.40),
                mem_available: Some(8_159_232 * 1024),
                mem_total: Some(16_318_464 * 1024),
            },
            problems: vec![],
        };
        assert_eq!(root.read(), expected);
    }

    #[test]
    fn a_desktop_without_power_supplies_or_thermal_zones_has_no_problems() {
        let (_dir, root) = tree(&[("proc/pressure/memory", PSI), ("proc/meminfo", MEMINFO)]);
        let signals = root.read();
        assert_eq!(signals.thermal, vec![]);
        assert_eq!(signals.power, Power { on_ac: None, battery: None });
        assert_eq!(signals.memory.mem_total, Some(16_318_464 * 1024));
        assert_eq!(signals.problems, Vec::<String>::new());
    }

    #[test]
    fn an_empty_root_reads_as_nothing_known_and_no_problems() {
        let (_dir, root) = tree(&[]);
        assert_eq!(root.read(), Signals::default());
    }

    #[test]
    fn garbage_in_every_file_gives_unknowns_and_a_problem_naming_each_file() {
        let mut files = laptop();
        for (_, text) in &mut files {
            *text = "garbage \u{1}";
        }
        let (dir, root) = tree(&files);
        let signals = root.read();
        // Bad `temp` files drop their zones; `type` files are free text and so never garbage.
        assert_eq!(signals.thermal, vec![]);
        assert_eq!(signals.power, Power { on_ac: None, battery: None });
        assert_eq!(signals.memory, Memory::default());
        // The supplies' `type` is garbage too, so neither is a battery nor is read further.
        let parsed_files = [
            "sys/class/thermal/thermal_zone0/temp",
            "sys/class/thermal/thermal_zone1/temp",
            "sys/class/power_supply/AC/online",
            "proc/pressure/memory",
            "proc/meminfo",
        ];
        for file in parsed_files {
            let path = dir.path().join(file).display().to_string();
            assert!(
                signals.problems.iter().any(|p| p.contains(&path) && p.contains("garbage")),
                "no problem names {path}: {:?}",
                signals.problems
            );
        }
        assert_eq!(signals.problems.len(), parsed_files.len(), "{:?}", signals.problems);
    }

    #[test]
    fn garbage_in_every_battery_and_trip_file_keeps_the_rest() {
        let (_dir, root) = tree(&[
            ("sys/class/thermal/thermal_zone0/temp", "40000"),
            ("sys/class/thermal/thermal_zone0/trip_point_0_temp", "hot"),
            ("sys/class/thermal/thermal_zone0/trip_point_1_temp", "80000"),
            ("sys/class/thermal/thermal_zone0/trip_point_1_type", "\u{0}\u{0}"),
            ("sys/class/power_supply/BAT0/type", "Battery"),
            ("sys/class/power_supply/BAT0/present", "yes"),
            ("sys/class/power_supply/BAT0/status", "Exploding"),
            ("sys/class/power_supply/BAT0/capacity", "150"),
        ]);
        let signals = root.read();
        assert_eq!(
            signals.thermal,
            vec![ThermalZone {
                name: "thermal_zone0".into(),
                kind: String::new(),
                temp_mc: 40_000,
                trips: vec![trip(80_000, TripKind::Other)],
            }]
        );
        // An unparsable `present` counts as present.
        assert_eq!(
            signals.power.battery,
            Some(Battery { name: "BAT0".into(), status: BatteryStatus::Unknown, capacity: None })
        );
        let problems = signals.problems.join("\n");
        for file in ["trip_point_0_temp", "BAT0/present", "BAT0/capacity"] {
            assert!(problems.contains(file), "{file} missing from {problems}");
        }
        assert!(problems.contains("a percentage from 0 to 100"), "{problems}");
        assert_eq!(signals.problems.len(), 3, "{problems}");
    }

    #[test]
    fn an_absent_battery_is_skipped_for_the_next_present_one() {
        let (_dir, root) = tree(&[
            ("sys/class/power_supply/BAT0/type", "Battery"),
            ("sys/class/power_supply/BAT0/present", "0"),
            ("sys/class/power_supply/BAT0/status", "Unknown"),
            ("sys/class/power_supply/BAT1/type", "Battery"),
            ("sys/class/power_supply/BAT1/present", "1"),
            ("sys/class/power_supply/BAT1/status", "Charging"),
            ("sys/class/power_supply/BAT1/capacity", "80"),
            ("sys/class/power_supply/BAT2/type", "Battery"),
            ("sys/class/power_supply/BAT2/status", "Full"),
        ]);
        let signals = root.read();
        assert_eq!(
            signals.power,
            Power {
                on_ac: None,
                battery: Some(Battery { name: "BAT1".into(), status: BatteryStatus::Charging, capacity: Some(80) }),
            }
        );
        assert_eq!(signals.problems, Vec::<String>::new());
    }

    #[test]
    fn a_battery_without_a_present_file_counts_as_present() {
        let (_dir, root) = tree(&[
            ("sys/class/power_supply/BAT0/type", "Battery"),
            ("sys/class/power_supply/BAT0/status", "Not charging"),
            ("sys/class/power_supply/BAT0/capacity", "100"),
        ]);
        assert_eq!(
            root.read().power.battery,
            Some(Battery { name: "BAT0".into(), status: BatteryStatus::NotCharging, capacity: Some(100) })
        );
    }

    #[test]
    fn any_online_line_supply_means_on_ac_and_supplies_without_online_do_not_count() {
        let (_dir, root) = tree(&[
            ("sys/class/power_supply/AC/type", "Mains"),
            ("sys/class/power_supply/AC/online", "0"),
            ("sys/class/power_supply/ucsi-source-psy-1/type", "USB"),
            ("sys/class/power_supply/ucsi-source-psy-1/online", "2"),
            ("sys/class/power_supply/hidpp_battery_0/type", "Battery"),
            ("sys/class/power_supply/hidpp_battery_0/status", "Discharging"),
            ("sys/class/power_supply/wacom/type", "USB"),
        ]);
        let power = root.read().power;
        assert_eq!(power.on_ac, Some(true));
        assert_eq!(power.battery.map(|b| b.name), Some("hidpp_battery_0".to_owned()));
        assert_eq!(on_ac(&[Some(false)]), Some(false));
        assert_eq!(on_ac(&[]), None);
        assert_eq!(on_ac(&[Some(false), None]), None);
        assert_eq!(on_ac(&[None, Some(true)]), Some(true));
    }

    #[test]
    fn zone10_sorts_after_zone2_and_trip10_after_trip2() {
        let mut files = Vec::new();
        let names: Vec<(String, String)> =
            [10, 2, 0, 1]
                .iter()
                .map(|n| (format!("sys/class/thermal/thermal_zone{n}/temp"), format!("{n}000")))
                .chain([10, 2, 0].iter().map(|n| {
                    (format!("sys/class/thermal/thermal_zone0/trip_point_{n}_temp"), format!("{}", 90_000 + n))
                }))
                .collect();
        for (path, text) in &names {
            files.push((path.as_str(), text.as_str()));
        }
        // Not zones: no digits, or something after them.
        files.push(("sys/class/thermal/thermal_zone/temp", "1"));
        files.push(("sys/class/thermal/thermal_zone3x/temp", "1"));
        files.push(("sys/class/thermal/cooling_device0/cur_state", "0"));
        let (_dir, root) = tree(&files);
        let signals = root.read();
        let zones: Vec<&str> = signals.thermal.iter().map(|z| z.name.as_str()).collect();
        assert_eq!(zones, ["thermal_zone0", "thermal_zone1", "thermal_zone2", "thermal_zone10"]);
        let trips: Vec<i64> = signals.thermal[0].trips.iter().map(|t| t.temp_mc).collect();
        assert_eq!(trips, [90_000, 90_002, 90_010]);
        assert_eq!(signals.thermal[3].temp_mc, 10_000);
    }

    #[test]
    fn negative_temperatures_are_kept() {
        let (_dir, root) = tree(&[
            ("sys/class/thermal/thermal_zone0/type", "outdoor"),
            ("sys/class/thermal/thermal_zone0/temp", "-12500\n"),
            ("sys/class/thermal/thermal_zone0/trip_point_0_temp", "-40000"),
            ("sys/class/thermal/thermal_zone0/trip_point_0_type", "hot"),
            ("sys/class/thermal/thermal_zone0/trip_point_1_temp", "-1"),
            ("sys/class/thermal/thermal_zone0/trip_point_1_type", "active"),
        ]);
        let signals = root.read();
        assert_eq!(signals.thermal[0].temp_mc, -12_500);
        assert_eq!(signals.thermal[0].trips, [trip(-40_000, TripKind::Hot), trip(-1, TripKind::Active)]);
        assert_eq!(signals.problems, Vec::<String>::new());
    }

    #[test]
    fn a_psi_file_with_only_a_some_line_gives_no_full_and_no_problem() {
        let (_dir, root) = tree(&[("proc/pressure/memory", "some avg10=7.50 avg60=2.00 avg300=0.30 total=99\n")]);
        let signals = root.read();
        assert_eq!(signals.memory.some_avg10, Some(7.5));
        assert_eq!(signals.memory.full_avg10, None);
        assert_eq!(signals.problems, Vec::<String>::new());
    }

    #[test]
    fn meminfo_without_mem_available_keeps_mem_total() {
        let (_dir, root) = tree(&[("proc/meminfo", "MemTotal:        2048 kB\nMemFree:  1024 kB\n")]);
        let signals = root.read();
        assert_eq!(signals.memory.mem_total, Some(2048 * 1024));
        assert_eq!(signals.memory.mem_available, None);
        assert_eq!(signals.problems, Vec::<String>::new());
    }

    /// EIO takes the same path as this EISDIR: any read error other than absence is a problem.
    #[test]
    fn a_directory_where_a_file_belongs_is_a_problem_not_a_panic() {
        let (dir, root) = tree(&[
            ("sys/class/thermal/thermal_zone0/temp/oops", ""),
            ("sys/class/power_supply/BAT0/type", "Battery"),
            ("sys/class/power_supply/BAT0/capacity/oops", ""),
            ("proc/meminfo/oops", ""),
        ]);
        let signals = root.read();
        assert_eq!(signals.thermal, vec![]);
        assert_eq!(signals.power.battery.map(|b| b.capacity), Some(None));
        assert_eq!(signals.memory, Memory::default());
        assert_eq!(signals.problems.len(), 3, "{:?}", signals.problems);
        for file in ["sys/class/thermal/thermal_zone0/temp", "sys/class/power_supply/BAT0/capacity", "proc/meminfo"] {
            let path = dir.path().join(file).display().to_string();
            assert!(
                signals.problems.iter().any(|p| p.contains(&path) && p.contains("os error")),
                "{file}: {:?}",
                signals.problems
            );
        }
    }

    /// A real EIO without privileges: reading `/proc/self/mem` at offset 0 (unmapped) fails with
    /// EIO, and a symlink puts it where a sysfs file belongs.
    #[test]
    fn an_eio_on_read_is_a_problem_naming_the_file() {
        let (dir, root) = tree(&[("sys/class/power_supply/BAT0/type", "Battery")]);
        let capacity = dir.path().join("sys/class/power_supply/BAT0/capacity");
        std::os::unix::fs::symlink("/proc/self/mem", &capacity).unwrap();
        let signals = root.read();
        assert_eq!(signals.power.battery.map(|b| b.capacity), Some(None));
        assert_eq!(signals.problems.len(), 1, "{:?}", signals.problems);
        assert!(signals.problems[0].contains(&capacity.display().to_string()), "{:?}", signals.problems);
        println!("{}", signals.problems[0]);
    }

    #[test]
    fn a_fifo_where_a_file_belongs_does_not_block() {
        let (dir, root) = tree(&[("proc/pressure/.keep", "")]);
        rustix::fs::mkfifoat(rustix::fs::CWD, dir.path().join("proc/pressure/memory"), 0o600.into()).unwrap();
        let started = Instant::now();
        let signals = root.read();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(signals.memory.some_avg10, None);
        assert_eq!(signals.problems.len(), 1, "{:?}", signals.problems);
    }

    #[test]
    fn an_endless_file_is_capped_and_reported() {
        let (dir, root) = tree(&[]);
        std::fs::create_dir_all(dir.path().join("proc")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("proc/meminfo")).unwrap();
        let signals = root.read();
        assert_eq!(signals.memory.mem_total, None);
        assert!(signals.problems[0].contains("longer than 4096 bytes"), "{:?}", signals.problems);
    }

    #[test]
    fn a_battery_that_vanishes_after_the_listing_is_absent() {
        let (dir, _root) = tree(&laptop());
        let class = dir.path().join("sys/class/power_supply");
        let mut problems = Vec::new();
        let mut names = entry_names(&class, &mut problems);
        names.sort();
        assert_eq!(names, ["AC", "BAT0"]);
        std::fs::remove_dir_all(class.join("BAT0")).unwrap();
        assert_eq!(read_supply(&class.join("BAT0"), "BAT0".into(), &mut problems), None);
        assert_eq!(problems, Vec::<String>::new());
    }

    #[test]
    fn a_battery_that_vanishes_halfway_is_partly_read() {
        // Only `type` was read before the rest of the directory went.
        let (dir, _root) = tree(&[("sys/class/power_supply/BAT0/type", "Battery")]);
        let mut problems = Vec::new();
        let supply = read_supply(&dir.path().join("sys/class/power_supply/BAT0"), "BAT0".into(), &mut problems);
        assert_eq!(
            supply,
            Some(Supply::Battery(Battery { name: "BAT0".into(), status: BatteryStatus::Unknown, capacity: None }))
        );
        assert_eq!(problems, Vec::<String>::new());
    }

    #[test]
    fn a_dangling_supply_link_is_absent() {
        // sysfs class entries are symlinks to device directories; an unplugged device leaves none.
        let (dir, root) = tree(&[("sys/class/power_supply/.keep", "")]);
        std::os::unix::fs::symlink(dir.path().join("gone"), dir.path().join("sys/class/power_supply/BAT0")).unwrap();
        assert_eq!(root.read(), Signals::default());
    }

    #[test]
    fn parsers_read_the_kernel_formats() {
        assert_eq!(parse_millidegrees(" -273150\n"), Some(-273_150));
        assert_eq!(parse_millidegrees("45.5"), None);
        assert_eq!(parse_trip_kind("critical\n"), TripKind::Critical);
        assert_eq!(parse_trip_kind("Critical"), TripKind::Other);
        assert_eq!(parse_battery_status("Not charging\n"), BatteryStatus::NotCharging);
        assert_eq!(parse_battery_status("Unknown"), BatteryStatus::Unknown);
        assert_eq!(parse_capacity("0"), Some(0));
        assert_eq!(parse_capacity("101"), None);
        assert_eq!(parse_capacity("-1"), None);
        assert_eq!(parse_online("2"), Some(true));
        assert_eq!(parse_online("3"), None);
        assert_eq!(parse_psi_avg10(PSI), (Some(1.23), Some(0.40)));
        assert_eq!(parse_psi_avg10("some avg10=nan\nfull avg10=inf"), (None, None));
        assert_eq!(parse_psi_avg10("some avg10=100.00\nfull avg10=-0.5"), (Some(100.0), None));
        assert_eq!(parse_meminfo(MEMINFO), (Some(8_159_232 * 1024), Some(16_318_464 * 1024)));
        assert_eq!(parse_meminfo("MemTotal: 18446744073709551615 kB\nMemAvailable: 1 MB"), (None, None));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\nMemTotal: 2 kB"), (None, Some(1024)));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn parsers_never_panic_on_any_text(text in any::<String>()) {
            let _ = parse_millidegrees(&text);
            let _ = parse_trip_kind(&text);
            let _ = parse_battery_status(&text);
            let _ = parse_capacity(&text);
            let _ = parse_online(&text);
            let _ = parse_flag(&text);
            let _ = parse_psi_avg10(&text);
            let _ = parse_meminfo(&text);
            let _ = trigger_spec(text.len() as u64, 0);
        }

        #[test]
        fn parsers_never_panic_on_kernel_shaped_text(
            text in "((some|full|MemTotal:|MemAvailable:) ?(avg10=)?[-+0-9.eEnaifINF]{0,24} ?(kB|MB)?\n?){0,4}"
        ) {
            let (some, full) = parse_psi_avg10(&text);
            for percent in [some, full].into_iter().flatten() {
                prop_assert!((0.0..=100.0).contains(&percent));
            }
            let _ = parse_meminfo(&text);
        }

        #[test]
        fn millidegrees_round_trip(temp in any::<i64>()) {
            prop_assert_eq!(parse_millidegrees(&format!("{temp}\n")), Some(temp));
        }

        #[test]
        fn meminfo_kb_become_bytes_or_none_on_overflow(total in any::<u64>(), available in any::<u64>()) {
            let text = format!("MemTotal: {total} kB\nMemAvailable: {available} kB\n");
            prop_assert_eq!(parse_meminfo(&text), (available.checked_mul(1024), total.checked_mul(1024)));
        }

        #[test]
        fn psi_avg10_round_trips(some in 0u32..=10_000, full in 0u32..=10_000) {
            let (some, full) = (f64::from(some) / 100.0, f64::from(full) / 100.0);
            let text = format!(
                "some avg10={some:.2} avg60=0.00 avg300=0.00 total=1\n\
                 full avg10={full:.2} avg60=0.00 avg300=0.00 total=0\n"
            );
            prop_assert_eq!(parse_psi_avg10(&text), (Some(some), Some(full)));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// The whole walk over a laptop tree whose every file holds arbitrary bytes.
        #[test]
        fn reading_a_tree_of_arbitrary_bytes_never_panics(
            contents in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 20)
        ) {
            let dir = tempfile::tempdir().unwrap();
            for ((path, _), bytes) in laptop().iter().zip(&contents) {
                let path = dir.path().join(path);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(path, bytes).unwrap();
            }
            let signals = HostRoot::new(dir.path()).read();
            let root = dir.path().display().to_string();
            for problem in &signals.problems {
                prop_assert!(problem.contains(&root), "{}", problem);
            }
        }
    }

    #[test]
    fn trigger_windows_round_up_to_two_seconds() {
        assert_eq!(trigger_spec(150_000, 1_000_000).unwrap(), "some 150000 2000000");
        assert_eq!(trigger_spec(150_000, 2_000_000).unwrap(), "some 150000 2000000");
        assert_eq!(trigger_spec(150_000, 2_000_001).unwrap(), "some 150000 4000000");
        assert_eq!(trigger_spec(9_000_000, 10_000_000).unwrap(), "some 9000000 10000000");
        assert!(trigger_spec(150_000, 10_000_001).unwrap_err().contains("above the kernel's limit"));
        assert!(trigger_spec(2_000_000, 2_000_000).unwrap_err().contains("0 < stall < window"));
        assert!(trigger_spec(0, 2_000_000).is_err());
        assert!(trigger_spec(0, 0).is_err());
        assert!(trigger_spec(u64::MAX - 1, u64::MAX).is_err());
    }

    #[test]
    fn a_plain_file_is_not_procfs_and_the_watch_polls() {
        let (_dir, root) = tree(&[("proc/pressure/memory", PSI)]);
        let mut watch = PressureWatch::open(&root, 150_000, 2_000_000);
        let reason = watch.fallback_reason().unwrap();
        assert!(reason.contains("not procfs"), "{reason}");
        assert_eq!(watch.trigger(), None);
        let started = Instant::now();
        assert_eq!(watch.wait(Duration::from_millis(50)), Wake::Polled);
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(50) && waited < Duration::from_secs(2), "{waited:?}");
        // Nothing was written into the fake file.
        assert_eq!(std::fs::read_to_string(watch.path()).unwrap(), PSI);
    }

    #[test]
    fn a_kernel_without_psi_polls_and_says_so() {
        let (_dir, root) = tree(&[]);
        let watch = PressureWatch::open(&root, 150_000, 2_000_000);
        let reason = watch.fallback_reason().unwrap();
        assert!(reason.contains("kernel without PSI"), "{reason}");
    }

    #[test]
    fn a_refused_trigger_polls_and_says_why() {
        let (_dir, root) = tree(&[("proc/pressure/memory", PSI)]);
        let watch = PressureWatch::open(&root, 3_000_000, 2_000_000);
        assert!(watch.fallback_reason().unwrap().contains("0 < stall < window"));
    }

    /// A procfs file that has no trigger support (`/proc/version`) refuses the write; the reason
    /// carries the kernel's errno.
    #[test]
    fn a_procfs_file_that_refuses_the_write_polls_with_the_errno() {
        let (dir, root) = tree(&[("proc/pressure/.keep", "")]);
        std::os::unix::fs::symlink("/proc/version", dir.path().join("proc/pressure/memory")).unwrap();
        let watch = PressureWatch::open(&root, 150_000, 2_000_000);
        let reason = watch.fallback_reason().unwrap();
        println!("{reason}");
        // Root opens it and the write fails; anyone else cannot open it for writing.
        assert!(reason.contains("os error"), "{reason}");
    }

    /// The real `/proc/pressure/memory`: as root the trigger must register; otherwise either a
    /// trigger or an explicit reason. A 2 s window with a 1.9 s stall threshold does not fire on an
    /// idle 50 ms wait.
    #[test]
    fn the_real_psi_file_takes_a_trigger_and_times_out_without_pressure() {
        let mut watch = PressureWatch::open(&HostRoot::new("/"), 1_900_000, 2_000_000);
        if let Some(reason) = watch.fallback_reason() {
            println!("no PSI trigger on this host: {reason}");
            assert!(!reason.is_empty());
            if !Path::new("/proc/pressure/memory").exists() {
                assert!(reason.contains("kernel without PSI"), "{reason}");
            } else {
                assert!(!rustix::process::geteuid().is_root(), "root must be able to arm a trigger: {reason}");
            }
        } else {
            println!("PSI trigger armed on the real file: {:?}", watch.trigger());
            assert_eq!(watch.trigger(), Some("some 1900000 2000000"));
        }
        let started = Instant::now();
        let wake = watch.wait(Duration::from_millis(50));
        let waited = started.elapsed();
        let expected = if watch.fallback_reason().is_some() { Wake::Polled } else { Wake::Timeout };
        assert_eq!(wake, expected);
        assert!(waited >= Duration::from_millis(45) && waited < Duration::from_secs(2), "{waited:?}");
    }
}
