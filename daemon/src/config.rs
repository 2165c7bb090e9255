//! kvmmd's configuration: a TOML file (unknown keys rejected), CLI flags that override it, and embedded
//! defaults that work with no file at all, as root or as an ordinary user.
//!
//! Resolution order for every key: command-line flag, then the file given with `--config`, then the
//! default. [`FileConfig::resolve`] turns the merged values into a [`Resolved`] configuration with every
//! path and byte count decided, reading `MemAvailable` and the environment once.

use std::path::{Path, PathBuf};

use kvmm_kernels::Format;
use kvmm_store::io::EngineChoice;
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::policy::mode::{Mode, ModePolicy};
use crate::policy::precision::{Floors, LayerFloor, PrecisionPolicy, Ranking};

/// Default share of `MemAvailable` given to the device tier when no budget is configured.
pub const DEFAULT_DEVICE_BUDGET: &str = "25%";
/// How long an fd token stays valid after `Attach`.
pub const DEFAULT_FD_TOKEN_TTL_MS: u64 = 10_000;
/// Default pin lease: a page held pinned this long without an unpin is reported as stuck.
pub const DEFAULT_PIN_LEASE_MS: u64 = 10_000;
/// The pin leases an operator may set, in milliseconds.
pub const PIN_LEASE_RANGE_MS: std::ops::RangeInclusive<u64> = 200..=3_600_000;
/// Default longest linger an `Attach` may ask for: a session may outlive its connection this long,
/// waiting for a `Resume`.
pub const DEFAULT_MAX_LINGER_MS: u64 = 300_000;
/// The longest lingers an operator may allow, in milliseconds (0 turns lingering off).
pub const MAX_LINGER_RANGE_MS: std::ops::RangeInclusive<u64> = 0..=86_400_000;
/// How often the compactor looks for holes below the arena's high-water mark.
pub const DEFAULT_COMPACTION_INTERVAL_MS: u64 = 1_000;
/// Default share of `MemAvailable` given to the DRAM tier (the daemon's private pool).
pub const DEFAULT_DRAM_BUDGET: &str = "10%";
/// Default high and low watermarks, in percent of a tier's budget.
pub const DEFAULT_WATERMARKS: (u8, u8) = (90, 80);

/// The configuration file, as written by an operator. Every key is optional.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Directory for the three sockets and the lock file.
    pub runtime_dir: Option<PathBuf>,
    /// Device-tier budget: bytes (`1073741824`), a size with a unit (`512MiB`, `4GiB`, `2G`), or a
    /// percentage of `MemAvailable` at start-up (`25%`).
    pub device_budget: Option<ByteSize>,
    /// Group (name or numeric gid) whose members may use the admin socket besides root and kvmmd's own user.
    pub admin_group: Option<String>,
    /// Lifetime of a one-time fd token, in milliseconds.
    pub fd_token_ttl_ms: Option<u64>,
    /// How long a client may hold one pin on a page before the page is reported as stuck, in
    /// milliseconds.
    pub pin_lease_ms: Option<u64>,
    /// Whether kvmmd revokes (wipes) a session once one of its pages has stayed pinned past the pin
    /// lease, rather than only reporting it.
    pub revoke_stuck_pins: Option<bool>,
    /// The longest a session may outlive its connection waiting for a `Resume` (`linger_ms` at
    /// attach), in milliseconds; 0 turns lingering off.
    pub max_linger_ms: Option<u64>,
    /// Log filter in `tracing` syntax, e.g. `info` or `kvmm_daemon=debug`.
    pub log: Option<String>,
    /// Arena compaction.
    pub compaction: Option<CompactionConfig>,
    /// The tiers below the device.
    pub tiers: Option<TiersConfig>,
    /// Modes and the sensors that choose them.
    pub policy: Option<PolicyConfig>,
}

/// The `[policy]` table.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// `auto` (chosen from the sensors) or a mode to pin: `performance`, `balanced`, `powersave`,
    /// `thermal`.
    pub mode: Option<String>,
    /// Root of the sysfs/procfs tree the sensors read (`/`; tests point it at a fake tree).
    pub host_root: Option<PathBuf>,
    /// Milliseconds between sensor readings (a PSI trigger wakes the loop sooner).
    pub interval_ms: Option<u64>,
    /// Powersave when a battery discharges at or below this percentage.
    pub powersave_below: Option<u8>,
    /// Powersave ends above `powersave_below` plus this many points.
    pub battery_hysteresis: Option<u8>,
    /// Thermal mode ends when every zone is this many degrees Celsius below its passive trip point.
    pub thermal_hysteresis_c: Option<u8>,
    /// Memory pressure (budgets halved) from this PSI `some avg10` percentage...
    pub pressure_enter: Option<u8>,
    /// ...until it falls below this one.
    pub pressure_leave: Option<u8>,
    /// Per-page formats when pages are compressed on demotion (default true), at the mode's
    /// format's bytes, ranked as `adaptive_ranking` says.
    pub adaptive_precision: Option<bool>,
    /// How adaptive precision ranks a layer's pages: `"age"` (default; a 32-token window kept
    /// exact pays for the newest pages past it one step up) or `"mass"` (the most attended pages
    /// up, the least attended down, from the attention mass the client's kernels record).
    pub adaptive_ranking: Option<String>,
    /// Per-layer floors (`[[policy.floor]]`): pages of those layers are never demoted below the
    /// floor's format.
    pub floor: Option<Vec<FloorConfig>>,
}

/// One `[[policy.floor]]` table.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FloorConfig {
    /// The layers: `N`, `N-M`, `first`, `last` or `N-last` (`last` is each session's last layer).
    pub layers: String,
    /// The least precise format their pages may take: `f16`/`bf16` (never compressed), `q8`,
    /// `k8v4`, `q4` or `q2`.
    pub format: String,
}

/// The `[tiers]` table.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TiersConfig {
    /// DRAM-tier budget (the daemon's private pool): bytes, a size or a percentage of
    /// `MemAvailable`; 0 disables the tier.
    pub dram_budget: Option<ByteSize>,
    /// Flash-tier budget (the size of the preallocated file); 0, the default, disables the tier.
    pub flash_budget: Option<ByteSize>,
    /// Directory of the flash file.
    pub flash_dir: Option<PathBuf>,
    /// `auto`, `io_uring` or `pread`.
    pub io_engine: Option<String>,
    /// Seal pages in the DRAM pool too (flash pages are always sealed).
    pub seal_dram: Option<bool>,
    /// The format pages take when they leave the device: `q8`, `q4`, `q2`, or `none` (lossless:
    /// they keep their format).
    pub demote_format: Option<String>,
    /// Background demotion starts above this percentage of a tier's budget...
    pub high_watermark: Option<u8>,
    /// ...and stops below this one.
    pub low_watermark: Option<u8>,
}

/// The `[compaction]` table.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CompactionConfig {
    /// Milliseconds between compaction passes; 0 disables compaction.
    pub interval_ms: Option<u64>,
}

/// A byte count as written in the file or on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteSize {
    /// An exact number of bytes.
    Bytes(u64),
    /// Percent (1..=100) of `MemAvailable` at start-up.
    PercentOfAvailable(u8),
}

impl ByteSize {
    /// Parses `123`, `123B`, `64KiB`, `512MiB`, `4GiB`, `1TiB`, `2K`/`2M`/`2G`/`2T` (powers of 1024, as
    /// memory is counted), or `25%`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if let Some(pct) = t.strip_suffix('%') {
            return match pct.trim().parse::<u8>() {
                Ok(p @ 1..=100) => Ok(ByteSize::PercentOfAvailable(p)),
                _ => Err(format!("'{text}' is not a percentage from 1% to 100%")),
            };
        }
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (digits, unit) = t.split_at(split);
        let n: u64 = digits.parse().map_err(|_| {
            format!("'{text}' is not a size: write bytes, a size like 512MiB or 4GiB, or a percentage like 25%")
        })?;
        let shift = match unit.trim() {
            "" | "B" => 0,
            "K" | "KiB" | "k" => 10,
            "M" | "MiB" => 20,
            "G" | "GiB" => 30,
            "T" | "TiB" => 40,
            other => return Err(format!("'{other}' in '{text}' is not a size unit: use B, KiB, MiB, GiB or TiB")),
        };
        n.checked_mul(1u64 << shift).map(ByteSize::Bytes).ok_or_else(|| format!("'{text}' is too large"))
    }

    /// The byte count, given `MemAvailable`.
    pub fn bytes(self, mem_available: u64) -> u64 {
        match self {
            ByteSize::Bytes(n) => n,
            ByteSize::PercentOfAvailable(p) => mem_available / 100 * u64::from(p),
        }
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(ByteSize::Bytes(n)),
            Raw::Text(s) => ByteSize::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

impl std::str::FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        ByteSize::parse(s)
    }
}

/// Values given on the command line; each overrides the file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--runtime-dir`.
    pub runtime_dir: Option<PathBuf>,
    /// `--device-budget`.
    pub device_budget: Option<ByteSize>,
    /// `--admin-group`.
    pub admin_group: Option<String>,
    /// `--fd-token-ttl-ms`.
    pub fd_token_ttl_ms: Option<u64>,
    /// `--pin-lease-ms`.
    pub pin_lease_ms: Option<u64>,
    /// `--revoke-stuck-pins` (turns it on over the file).
    pub revoke_stuck_pins: bool,
    /// `--max-linger-ms`.
    pub max_linger_ms: Option<u64>,
    /// `--log`.
    pub log: Option<String>,
    /// `--compaction-interval-ms`.
    pub compaction_interval_ms: Option<u64>,
    /// `--debug-move-churn`: continuously move random unpinned pages (for tests of the move protocol).
    pub debug_move_churn: bool,
    /// `--dram-budget`.
    pub dram_budget: Option<ByteSize>,
    /// `--flash-budget`.
    pub flash_budget: Option<ByteSize>,
    /// `--flash-dir`.
    pub flash_dir: Option<PathBuf>,
    /// `--io-engine`.
    pub io_engine: Option<String>,
    /// `--demote-format`.
    pub demote_format: Option<String>,
    /// `--debug-io-faults`: faults armed in the flash tier's I/O engine at start (tests only).
    pub debug_io_faults: Option<String>,
    /// `--mode`.
    pub mode: Option<String>,
    /// `--host-root`.
    pub host_root: Option<PathBuf>,
    /// `--policy-interval-ms`.
    pub policy_interval_ms: Option<u64>,
    /// `--debug-hang LOOP:MS`: the loop stops for good after MS milliseconds (tests of the watchdog).
    pub debug_hang: Option<String>,
}

/// The merged configuration with every value decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// Directory holding the sockets and the lock file.
    pub runtime_dir: PathBuf,
    /// Device-tier budget in bytes.
    pub device_budget: u64,
    /// Numeric gid allowed on the admin socket (besides root), if any.
    pub admin_gid: Option<u32>,
    /// The admin group as configured (for messages).
    pub admin_group: Option<String>,
    /// Lifetime of fd tokens.
    pub fd_token_ttl: std::time::Duration,
    /// How long one pin may be held before its page is reported as stuck.
    pub pin_lease: std::time::Duration,
    /// Whether a session with a stuck pin is revoked (wiped) rather than only reported.
    pub revoke_stuck_pins: bool,
    /// The longest a session may outlive its connection (zero: lingering is off).
    pub max_linger: std::time::Duration,
    /// Log filter.
    pub log: String,
    /// Compaction period; `None` disables it.
    pub compaction_interval: Option<std::time::Duration>,
    /// Whether the move-churn test driver runs.
    pub debug_move_churn: bool,
    /// Faults armed in the flash tier's I/O engine at start (tests of the failure paths), as
    /// `OP:ERRNO:COUNT` items separated by commas: OP `read` or `write`, ERRNO `EIO` or `ENOSPC`.
    pub debug_io_faults: Vec<kvmm_store::io::Fault>,
    /// A watched loop that hangs for good this long after start (tests of the watchdog).
    pub debug_hang: Option<(crate::systemd::Loop, std::time::Duration)>,
    /// The tiers below the device.
    pub tiers: Tiers,
    /// Modes and sensors.
    pub policy: Policy,
    /// The configuration file it came from, read again by a policy reload.
    pub config_file: Option<PathBuf>,
    /// The command line's values, which a reload keeps over the file's.
    pub overrides: Overrides,
}

/// The resolved `[policy]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The planner's thresholds (and the pinned mode, if any).
    pub modes: ModePolicy,
    /// Where the sensors read.
    pub host_root: PathBuf,
    /// Time between readings.
    pub interval: std::time::Duration,
    /// Adaptive precision and per-layer floors of demoted pages.
    pub precision: PrecisionPolicy,
}

/// Default time between sensor readings.
pub const DEFAULT_POLICY_INTERVAL_MS: u64 = 1000;

/// The resolved `[tiers]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tiers {
    /// DRAM pool bytes; 0: no DRAM tier.
    pub dram_budget: u64,
    /// Flash file bytes; 0: no flash tier.
    pub flash_budget: u64,
    /// The flash file.
    pub flash_path: PathBuf,
    /// The I/O engine asked for.
    pub io_engine: EngineChoice,
    /// Whether DRAM pages are sealed.
    pub seal_dram: bool,
    /// The format full 16-bit pages take when demoted; `None` keeps every page's format (lossless).
    pub demote_format: Option<Format>,
    /// Watermarks in percent of each tier's budget (`low < high ≤ 100`).
    pub high_watermark: u8,
    pub low_watermark: u8,
}

impl Resolved {
    /// The values kvmmd runs with, one `key = value` line each after a first line that says where
    /// they came from (`kvmmd --check-config`).
    pub fn summary(&self) -> String {
        let size = |bytes: u64| format!("{bytes} bytes ({:.1} MiB)", bytes as f64 / f64::from(1 << 20));
        let t = &self.tiers;
        let p = &self.policy;
        let mut lines = vec![
            match &self.config_file {
                Some(path) => format!("configuration OK: {} with the command line's values over it", path.display()),
                None => "configuration OK: embedded defaults with the command line's values over them".to_owned(),
            },
            format!("runtime_dir = {}", self.runtime_dir.display()),
            format!("device_budget = {}", size(self.device_budget)),
            format!(
                "admin_group = {}",
                self.admin_group.as_deref().unwrap_or("(none: root and kvmmd's own user only)")
            ),
            format!("fd_token_ttl_ms = {}", self.fd_token_ttl.as_millis()),
            format!("pin_lease_ms = {}", self.pin_lease.as_millis()),
            format!("revoke_stuck_pins = {}", self.revoke_stuck_pins),
            format!("max_linger_ms = {}", self.max_linger.as_millis()),
            format!("compaction_interval_ms = {}", self.compaction_interval.map_or(0, |d| d.as_millis())),
            format!("log = {}", self.log),
            format!("tiers.dram_budget = {}", size(t.dram_budget)),
            format!("tiers.flash_budget = {}", size(t.flash_budget)),
        ];
        if t.flash_budget > 0 {
            lines.push(format!("tiers.flash_file = {}", t.flash_path.display()));
            lines.push(format!("tiers.io_engine = {}", t.io_engine));
        }
        lines.extend([
            format!("tiers.seal_dram = {}", t.seal_dram),
            format!("tiers.demote_format = {}", t.demote_format.map_or("none".to_owned(), |f| f.to_string())),
            format!("tiers.watermarks = {}% high, {}% low", t.high_watermark, t.low_watermark),
            format!("policy.mode = {}", p.modes.pinned.map_or("auto".to_owned(), |m| m.to_string())),
            format!("policy.host_root = {}", p.host_root.display()),
            format!("policy.interval_ms = {}", p.interval.as_millis()),
            format!("policy.adaptive_precision = {}", p.precision.adaptive),
            format!("policy.adaptive_ranking = {}", p.precision.ranking),
        ]);
        lines.iter().map(|l| format!("{l}\n")).collect()
    }
}

impl Tiers {
    /// Whether any tier below the device exists.
    pub fn any(&self) -> bool {
        self.dram_budget > 0 || self.flash_budget > 0
    }
}

/// The smallest device budget kvmmd accepts: one 2 MiB chunk.
pub const MIN_DEVICE_BUDGET: u64 = 2 << 20;

impl FileConfig {
    /// Reads and parses a configuration file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("cannot read the configuration file {}", path.display()), e))?;
        Self::parse(&text)
            .map_err(|msg| Error::InvalidArgument(format!("configuration file {}: {msg}", path.display())))
    }

    /// Parses configuration text; the error is the parser's sentence (with line and column).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string().trim_end().to_owned())
    }

    /// Merges the file with command-line overrides and decides every value.
    pub fn resolve(self, cli: Overrides, env: &Environment) -> Result<Resolved> {
        let tiers = resolve_tiers(self.tiers.clone().unwrap_or_default(), &cli, env)?;
        let policy = resolve_policy(self.policy.clone().unwrap_or_default(), &cli)?;
        let overrides = cli.clone();
        let runtime_dir = cli.runtime_dir.or(self.runtime_dir).map(Ok).unwrap_or_else(|| env.default_runtime_dir())?;
        let budget = cli
            .device_budget
            .or(self.device_budget)
            .unwrap_or(ByteSize::PercentOfAvailable(25))
            .bytes(env.mem_available);
        if budget < MIN_DEVICE_BUDGET {
            return Err(Error::InvalidArgument(format!(
                "the device budget resolves to {budget} bytes; it must be at least {MIN_DEVICE_BUDGET} bytes (2 MiB)"
            )));
        }
        let admin_group = cli.admin_group.or(self.admin_group);
        let admin_gid = admin_group.as_deref().map(resolve_group).transpose()?;
        let ttl_ms = cli.fd_token_ttl_ms.or(self.fd_token_ttl_ms).unwrap_or(DEFAULT_FD_TOKEN_TTL_MS);
        if !(100..=600_000).contains(&ttl_ms) {
            return Err(Error::InvalidArgument(format!(
                "fd_token_ttl_ms is {ttl_ms}; it must be between 100 and 600000 milliseconds"
            )));
        }
        let lease_ms = cli.pin_lease_ms.or(self.pin_lease_ms).unwrap_or(DEFAULT_PIN_LEASE_MS);
        if !PIN_LEASE_RANGE_MS.contains(&lease_ms) {
            return Err(Error::InvalidArgument(format!(
                "pin_lease_ms is {lease_ms}; it must be between {} and {} milliseconds",
                PIN_LEASE_RANGE_MS.start(),
                PIN_LEASE_RANGE_MS.end()
            )));
        }
        let linger_ms = cli.max_linger_ms.or(self.max_linger_ms).unwrap_or(DEFAULT_MAX_LINGER_MS);
        if !MAX_LINGER_RANGE_MS.contains(&linger_ms) {
            return Err(Error::InvalidArgument(format!(
                "max_linger_ms is {linger_ms}; it must be between {} and {} milliseconds (0 turns lingering off)",
                MAX_LINGER_RANGE_MS.start(),
                MAX_LINGER_RANGE_MS.end()
            )));
        }
        let interval = cli
            .compaction_interval_ms
            .or(self.compaction.and_then(|c| c.interval_ms))
            .unwrap_or(DEFAULT_COMPACTION_INTERVAL_MS);
        Ok(Resolved {
            tiers,
            policy,
            config_file: None,
            overrides,
            runtime_dir,
            device_budget: budget,
            admin_gid,
            admin_group,
            fd_token_ttl: std::time::Duration::from_millis(ttl_ms),
            pin_lease: std::time::Duration::from_millis(lease_ms),
            revoke_stuck_pins: cli.revoke_stuck_pins || self.revoke_stuck_pins.unwrap_or(false),
            max_linger: std::time::Duration::from_millis(linger_ms),
            log: cli.log.or(self.log).unwrap_or_else(|| "info".to_owned()),
            compaction_interval: (interval > 0).then(|| std::time::Duration::from_millis(interval)),
            debug_move_churn: cli.debug_move_churn,
            debug_io_faults: cli.debug_io_faults.as_deref().map(parse_io_faults).transpose()?.unwrap_or_default(),
            debug_hang: cli.debug_hang.as_deref().map(parse_hang).transpose()?,
        })
    }
}

/// Parses `--debug-io-faults`: `OP:ERRNO:COUNT[,...]`, OP `read` or `write`, ERRNO `EIO` or `ENOSPC`.
fn parse_io_faults(text: &str) -> Result<Vec<kvmm_store::io::Fault>> {
    text.split(',')
        .map(|item| {
            let bad = || {
                Error::InvalidArgument(format!(
                    "--debug-io-faults item '{item}' is not OP:ERRNO:COUNT (read|write : EIO|ENOSPC : a number)"
                ))
            };
            let mut parts = item.trim().split(':');
            let (op, errno, count) = (parts.next(), parts.next(), parts.next().and_then(|n| n.parse::<u32>().ok()));
            let errno = match errno {
                Some("EIO") => libc::EIO,
                Some("ENOSPC") => libc::ENOSPC,
                _ => return Err(bad()),
            };
            match (op, count) {
                (Some("read"), Some(n)) => Ok(kvmm_store::io::Fault::read_error(errno, n)),
                (Some("write"), Some(n)) => Ok(kvmm_store::io::Fault::write_error(errno, n)),
                _ => Err(bad()),
            }
        })
        .collect()
}

/// `--debug-hang LOOP:MS`, LOOP `tiers`, `flash` or `policy`.
fn parse_hang(text: &str) -> Result<(crate::systemd::Loop, std::time::Duration)> {
    let bad =
        || Error::InvalidArgument(format!("--debug-hang '{text}' is not LOOP:MS (tiers|flash|policy : milliseconds)"));
    let (which, ms) = text.split_once(':').ok_or_else(bad)?;
    let which = match which {
        "tiers" => crate::systemd::Loop::Tiers,
        "flash" => crate::systemd::Loop::Flash,
        "policy" => crate::systemd::Loop::Policy,
        _ => return Err(bad()),
    };
    Ok((which, std::time::Duration::from_millis(ms.parse().map_err(|_| bad())?)))
}

/// Decides the `[tiers]` values: flags over the file over defaults.
fn resolve_tiers(file: TiersConfig, cli: &Overrides, env: &Environment) -> Result<Tiers> {
    let default_dram = ByteSize::parse(DEFAULT_DRAM_BUDGET).map_err(Error::InvalidArgument)?;
    let dram_budget = cli.dram_budget.or(file.dram_budget).unwrap_or(default_dram).bytes(env.mem_available);
    let flash_budget = cli.flash_budget.or(file.flash_budget).map_or(0, |b| b.bytes(env.mem_available));
    let flash_dir = match cli.flash_dir.clone().or(file.flash_dir) {
        Some(dir) => dir,
        None if flash_budget == 0 => PathBuf::new(),
        None => env.default_state_dir()?,
    };
    let io_engine = cli
        .io_engine
        .clone()
        .or(file.io_engine)
        .map_or(Ok(EngineChoice::Auto), |e| e.parse::<EngineChoice>())
        .map_err(|e| Error::InvalidArgument(format!("io_engine: {e}")))?;
    let demote_format = match cli.demote_format.clone().or(file.demote_format).as_deref() {
        None => Some(Format::Q8),
        Some("none") => None,
        Some(name) => match Format::from_name(name) {
            Some(f @ (Format::Q8 | Format::Q4 | Format::Q2 | Format::K8V4)) => Some(f),
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "demote_format \"{name}\" is not a compressed format; use \"q8\", \"q4\", \"q2\", \"k8v4\" or \"none\""
                )));
            }
        },
    };
    let (high, low) =
        (file.high_watermark.unwrap_or(DEFAULT_WATERMARKS.0), file.low_watermark.unwrap_or(DEFAULT_WATERMARKS.1));
    if !(low < high && high <= 100) {
        return Err(Error::InvalidArgument(format!(
            "watermarks low {low}% and high {high}% must satisfy low < high ≤ 100"
        )));
    }
    if flash_budget > 0 && dram_budget == 0 {
        return Err(Error::InvalidArgument(
            "a flash tier needs a DRAM tier (pages pass through DRAM on their way to flash); set tiers.dram_budget"
                .to_owned(),
        ));
    }
    Ok(Tiers {
        dram_budget,
        flash_budget,
        flash_path: flash_dir.join("kvmm.flash"),
        io_engine,
        seal_dram: file.seal_dram.unwrap_or(false),
        demote_format,
        high_watermark: high,
        low_watermark: low,
    })
}

impl Resolved {
    /// The `[policy]` table as it reads now: the configuration file read again (embedded defaults
    /// without one), with the command line's values still over it. Only the policy is re-read; the
    /// rest of the file applies at the next start.
    pub fn reload_policy(&self) -> Result<Policy> {
        let file = match &self.config_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    Error::FailedPrecondition(format!(
                        "cannot read the configuration file {} to reload the policy: {e}",
                        path.display()
                    ))
                })?;
                FileConfig::parse(&text)
                    .map_err(|msg| Error::InvalidArgument(format!("configuration file {}: {msg}", path.display())))?
            }
            None => FileConfig::default(),
        };
        resolve_policy(file.policy.unwrap_or_default(), &self.overrides)
    }
}

impl Resolved {
    /// The policy a `[policy]` table's body (TOML, as sent by admin `SetPolicy`) gives, validated as
    /// the configuration file's is; the command line's values still win.
    pub fn policy_from_toml(&self, text: &str) -> Result<Policy> {
        let table: PolicyConfig = toml::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("the [policy] table does not parse: {}", e.message())))?;
        resolve_policy(table, &self.overrides)
    }
}

/// A policy as the body of a `[policy]` table, the form `SetPolicy` takes back (host root and
/// interval apply only at start, so they are left out).
pub fn policy_toml(modes: &ModePolicy, precision: &PrecisionPolicy) -> String {
    let mut out = format!(
        "mode = \"{}\"\npowersave_below = {}\nbattery_hysteresis = {}\nthermal_hysteresis_c = {}\n\
         pressure_enter = {}\npressure_leave = {}\nadaptive_precision = {}\nadaptive_ranking = \"{}\"\n",
        modes.pinned.map_or("auto", Mode::name),
        modes.powersave_below,
        modes.battery_hysteresis,
        modes.thermal_hysteresis_mc / 1000,
        modes.pressure_enter,
        modes.pressure_leave,
        precision.adaptive,
        precision.ranking
    );
    for floor in precision.floors.iter() {
        let text = floor.to_string();
        let (layers, format) = text.rsplit_once(':').unwrap_or((text.as_str(), ""));
        out += &format!("\n[[floor]]\nlayers = \"{layers}\"\nformat = \"{format}\"\n");
    }
    out
}

/// Decides the `[policy]` values: flags over the file over defaults.
fn resolve_policy(file: PolicyConfig, cli: &Overrides) -> Result<Policy> {
    let defaults = ModePolicy::default();
    let pinned = match cli.mode.clone().or(file.mode).as_deref() {
        None | Some("auto") => None,
        Some(name) => Some(Mode::parse(name).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "mode \"{name}\" is not a mode; use \"auto\", \"performance\", \"balanced\", \"powersave\" or \"thermal\""
            ))
        })?),
    };
    let percent = |key: &str, value: Option<u8>, default: u8| -> Result<u8> {
        let v = value.unwrap_or(default);
        if v > 100 {
            return Err(Error::InvalidArgument(format!("policy.{key} is {v}; it is a percentage (0 to 100)")));
        }
        Ok(v)
    };
    let modes = ModePolicy {
        pinned,
        powersave_below: percent("powersave_below", file.powersave_below, defaults.powersave_below)?,
        battery_hysteresis: percent("battery_hysteresis", file.battery_hysteresis, defaults.battery_hysteresis)?,
        thermal_hysteresis_mc: file
            .thermal_hysteresis_c
            .map_or(defaults.thermal_hysteresis_mc, |c| i64::from(c) * 1000),
        pressure_enter: percent("pressure_enter", file.pressure_enter, defaults.pressure_enter)?,
        pressure_leave: percent("pressure_leave", file.pressure_leave, defaults.pressure_leave)?,
    };
    if modes.pressure_leave >= modes.pressure_enter {
        return Err(Error::InvalidArgument(format!(
            "policy.pressure_leave ({}%) must be below policy.pressure_enter ({}%)",
            modes.pressure_leave, modes.pressure_enter
        )));
    }
    let interval_ms = cli.policy_interval_ms.or(file.interval_ms).unwrap_or(DEFAULT_POLICY_INTERVAL_MS);
    if !(50..=60_000).contains(&interval_ms) {
        return Err(Error::InvalidArgument(format!(
            "policy interval_ms is {interval_ms}; it must be between 50 and 60000 milliseconds"
        )));
    }
    let floors = file
        .floor
        .unwrap_or_default()
        .iter()
        .map(|f| LayerFloor::parse(&f.layers, &f.format))
        .collect::<std::result::Result<Vec<_>, String>>()
        .map_err(Error::InvalidArgument)?;
    let ranking = match file.adaptive_ranking.as_deref() {
        None => Ranking::default(),
        Some(name) => Ranking::from_name(name).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "policy.adaptive_ranking \"{name}\" is not a ranking; use \"age\" (the default) or \"mass\""
            ))
        })?,
    };
    let precision = PrecisionPolicy {
        adaptive: file.adaptive_precision.unwrap_or(PrecisionPolicy::default().adaptive),
        ranking,
        floors: Floors::new(floors),
    };
    Ok(Policy {
        modes,
        host_root: cli.host_root.clone().or(file.host_root).unwrap_or_else(|| PathBuf::from("/")),
        interval: std::time::Duration::from_millis(interval_ms),
        precision,
    })
}

/// What the defaults depend on, read once from the process environment (or built by tests).
#[derive(Clone, Debug)]
pub struct Environment {
    /// `$RUNTIME_DIRECTORY` (set by systemd's `RuntimeDirectory=`).
    pub runtime_directory: Option<PathBuf>,
    /// `$XDG_RUNTIME_DIR`.
    pub xdg_runtime_dir: Option<PathBuf>,
    /// The effective uid.
    pub euid: u32,
    /// Available memory (`MemAvailable`) at start-up, in bytes.
    pub mem_available: u64,
    /// `$STATE_DIRECTORY` (set by systemd's `StateDirectory=`).
    pub state_directory: Option<PathBuf>,
    /// `$XDG_STATE_HOME`, else `$HOME/.local/state`.
    pub xdg_state_home: Option<PathBuf>,
}

impl Environment {
    /// Reads the real environment.
    pub fn from_process() -> Result<Self> {
        // The real host's memory through sysinfo (the policy's sensors read a possibly fake host
        // root with parsers of their own).
        let mut host = sysinfo::System::new();
        host.refresh_memory();
        let mem_available = host.available_memory();
        if mem_available == 0 {
            return Err(Error::FailedPrecondition(
                "cannot read the available memory from /proc/meminfo; set device_budget and dram_budget explicitly"
                    .to_owned(),
            ));
        }
        Ok(Environment {
            // systemd may pass several colon-separated directories; the first is ours.
            runtime_directory: std::env::var_os("RUNTIME_DIRECTORY")
                .and_then(|v| v.to_str().and_then(|s| s.split(':').next()).map(PathBuf::from))
                .filter(|p| !p.as_os_str().is_empty()),
            xdg_runtime_dir: std::env::var_os("XDG_RUNTIME_DIR")
                .map(PathBuf::from)
                .filter(|p| !p.as_os_str().is_empty()),
            euid: rustix::process::geteuid().as_raw(),
            mem_available,
            state_directory: std::env::var_os("STATE_DIRECTORY")
                .and_then(|v| v.to_str().and_then(|s| s.split(':').next()).map(PathBuf::from))
                .filter(|p| !p.as_os_str().is_empty()),
            xdg_state_home: std::env::var_os("XDG_STATE_HOME")
                .map(PathBuf::from)
                .filter(|p| !p.as_os_str().is_empty())
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state"))),
        })
    }

    /// `$STATE_DIRECTORY`, else `/var/lib/kvmm` as root, else `$XDG_STATE_HOME/kvmm`.
    pub fn default_state_dir(&self) -> Result<PathBuf> {
        if let Some(dir) = &self.state_directory {
            return Ok(dir.clone());
        }
        if self.euid == 0 {
            return Ok(PathBuf::from("/var/lib/kvmm"));
        }
        self.xdg_state_home.as_ref().map(|d| d.join("kvmm")).ok_or_else(|| {
            Error::FailedPrecondition(
                "no state directory for the flash file: $STATE_DIRECTORY, $XDG_STATE_HOME and $HOME are unset; \
                 set tiers.flash_dir"
                    .to_owned(),
            )
        })
    }

    /// `$RUNTIME_DIRECTORY`, else `/run/kvmm` as root, else `$XDG_RUNTIME_DIR/kvmm`.
    pub fn default_runtime_dir(&self) -> Result<PathBuf> {
        if let Some(dir) = &self.runtime_directory {
            return Ok(dir.clone());
        }
        if self.euid == 0 {
            return Ok(PathBuf::from("/run/kvmm"));
        }
        match &self.xdg_runtime_dir {
            Some(dir) => Ok(dir.join("kvmm")),
            None => Err(Error::FailedPrecondition(
                "no runtime directory: $RUNTIME_DIRECTORY and $XDG_RUNTIME_DIR are unset and kvmmd is not \
                 root; pass --runtime-dir DIR"
                    .to_owned(),
            )),
        }
    }
}

/// Resolves a group name or numeric gid from `/etc/group`.
fn resolve_group(group: &str) -> Result<u32> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let text = std::fs::read_to_string("/etc/group")
        .map_err(|e| Error::io("cannot read /etc/group to resolve admin_group", e))?;
    text.lines()
        .find_map(|line| {
            let mut fields = line.split(':');
            (fields.next()? == group).then(|| fields.nth(1)?.parse().ok())?
        })
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "admin_group '{group}' is not a group in /etc/group; create it or give a numeric gid"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(euid: u32) -> Environment {
        Environment {
            runtime_directory: None,
            xdg_runtime_dir: Some(PathBuf::from("/run/user/1000")),
            euid,
            mem_available: 8 << 30,
            state_directory: None,
            xdg_state_home: Some(PathBuf::from("/home/u/.local/state")),
        }
    }

    #[test]
    fn defaults_work_without_a_file() {
        let r = FileConfig::default().resolve(Overrides::default(), &env(1000)).unwrap();
        assert_eq!(r.runtime_dir, PathBuf::from("/run/user/1000/kvmm"));
        assert_eq!(r.device_budget, (8u64 << 30) / 100 * 25);
        let root = FileConfig::default().resolve(Overrides::default(), &env(0)).unwrap();
        assert_eq!(root.runtime_dir, PathBuf::from("/run/kvmm"));
    }

    #[test]
    fn systemd_runtime_directory_wins_over_defaults() {
        let mut e = env(0);
        e.runtime_directory = Some(PathBuf::from("/run/kvmm-unit"));
        let r = FileConfig::default().resolve(Overrides::default(), &e).unwrap();
        assert_eq!(r.runtime_dir, PathBuf::from("/run/kvmm-unit"));
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_name() {
        let err = FileConfig::parse("device_budgt = \"1GiB\"\n").unwrap_err();
        assert!(err.contains("device_budgt"), "{err}");
        let err = FileConfig::parse("[compaction]\nintervl_ms = 3\n").unwrap_err();
        assert!(err.contains("intervl_ms"), "{err}");
    }

    #[test]
    fn cli_overrides_the_file() {
        let file = FileConfig::parse("device_budget = \"1GiB\"\nruntime_dir = \"/a\"\n").unwrap();
        let cli = Overrides { device_budget: Some(ByteSize::Bytes(64 << 20)), ..Default::default() };
        let r = file.resolve(cli, &env(1000)).unwrap();
        assert_eq!(r.device_budget, 64 << 20);
        assert_eq!(r.runtime_dir, PathBuf::from("/a"));
    }

    #[test]
    fn byte_sizes_parse_units_and_percentages() {
        assert_eq!(ByteSize::parse("512MiB"), Ok(ByteSize::Bytes(512 << 20)));
        assert_eq!(ByteSize::parse("4G"), Ok(ByteSize::Bytes(4 << 30)));
        assert_eq!(ByteSize::parse("123"), Ok(ByteSize::Bytes(123)));
        assert_eq!(ByteSize::parse("25%"), Ok(ByteSize::PercentOfAvailable(25)));
        assert!(ByteSize::parse("0%").is_err());
        assert!(ByteSize::parse("12 parsecs").unwrap_err().contains("parsecs"));
        let file = FileConfig::parse("device_budget = 1048576\n").unwrap();
        assert_eq!(file.device_budget, Some(ByteSize::Bytes(1 << 20)));
    }

    #[test]
    fn a_budget_below_one_chunk_is_refused() {
        let cli = Overrides { device_budget: Some(ByteSize::Bytes(4096)), ..Default::default() };
        let err = FileConfig::default().resolve(cli, &env(0)).unwrap_err();
        assert!(err.to_string().contains("at least"), "{err}");
    }

    #[test]
    fn the_example_file_parses_with_every_key_uncommented() {
        let example = include_str!("../../systemd/kvmmd.toml.example");
        FileConfig::parse(example).unwrap();
        let uncommented: String = example
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest) if rest.contains(" = ") || rest.starts_with("[[") => rest,
                _ => l,
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let file = FileConfig::parse(&uncommented).unwrap();
        assert_eq!(file.device_budget, Some(ByteSize::Bytes(4 << 30)));
        assert_eq!(file.compaction.clone().and_then(|c| c.interval_ms), Some(1000));
        assert_eq!(file.admin_group.as_deref(), Some("kvmm-admin"));
        let tiers = file.tiers.clone().unwrap();
        assert_eq!(tiers.flash_budget, Some(ByteSize::Bytes(8 << 30)));
        assert_eq!(tiers.demote_format.as_deref(), Some("q8"));
        let tiers = resolve_tiers(tiers, &Overrides::default(), &env(0)).unwrap();
        assert_eq!(tiers.flash_path, PathBuf::from("/var/lib/kvmm/kvmm.flash"));
        let mut policy = resolve_policy(file.policy.clone().unwrap(), &Overrides::default()).unwrap();
        let floors: Vec<String> = policy.precision.floors.iter().map(ToString::to_string).collect();
        assert_eq!(floors, ["0-1:q8"]);
        policy.precision.floors = Floors::default();
        assert_eq!(policy, FileConfig::default().resolve(Overrides::default(), &env(0)).unwrap().policy);
    }

    #[test]
    fn adaptive_precision_defaults_on_and_floors_parse_from_policy_tables() {
        let r = FileConfig::default().resolve(Overrides::default(), &env(0)).unwrap();
        let by_age = PrecisionPolicy { adaptive: true, ranking: Ranking::Age, floors: Floors::default() };
        assert_eq!(r.policy.precision, by_age);
        let file = FileConfig::parse("[policy]\nadaptive_ranking = \"mass\"\n").unwrap();
        assert_eq!(file.resolve(Overrides::default(), &env(0)).unwrap().policy.precision.ranking, Ranking::Mass);
        let file = FileConfig::parse(
            "[policy]\nadaptive_precision = false\n\n[[policy.floor]]\nlayers = \"0-1\"\nformat = \"q8\"\n\n\
             [[policy.floor]]\nlayers = \"last\"\nformat = \"f16\"\n",
        )
        .unwrap();
        let p = file.resolve(Overrides::default(), &env(0)).unwrap().policy.precision;
        assert!(!p.adaptive);
        let floors: Vec<String> = p.floors.iter().map(ToString::to_string).collect();
        assert_eq!(floors, ["0-1:q8", "last:f16"]);
        assert_eq!(
            (p.floors.of(1, 24), p.floors.of(23, 24), p.floors.of(5, 24)),
            (Some(Format::Q8), Some(Format::F16), None)
        );
        // A floor above a lossless configuration is accepted (it changes nothing).
        let file = FileConfig::parse(
            "[tiers]\ndemote_format = \"none\"\n[policy]\nfloor = [{ layers = \"0\", format = \"q8\" }]\n",
        )
        .unwrap();
        assert_eq!(file.resolve(Overrides::default(), &env(0)).unwrap().policy.precision.floors.iter().count(), 1);
    }

    #[test]
    fn policy_defaults_to_auto_on_the_real_root_and_flags_win() {
        let r = FileConfig::default().resolve(Overrides::default(), &env(0)).unwrap();
        assert_eq!(r.policy.modes, ModePolicy::default());
        assert_eq!(r.policy.host_root, PathBuf::from("/"));
        assert_eq!(r.policy.interval, std::time::Duration::from_millis(DEFAULT_POLICY_INTERVAL_MS));
        let file = FileConfig::parse(
            "[policy]\nmode = \"balanced\"\nhost_root = \"/srv/fake\"\nthermal_hysteresis_c = 3\npowersave_below = 30\n",
        )
        .unwrap();
        let r = file.clone().resolve(Overrides::default(), &env(0)).unwrap();
        assert_eq!(r.policy.modes.pinned, Some(Mode::Balanced));
        assert_eq!(r.policy.modes.thermal_hysteresis_mc, 3000);
        assert_eq!(r.policy.modes.powersave_below, 30);
        assert_eq!(r.policy.host_root, PathBuf::from("/srv/fake"));
        let cli = Overrides {
            mode: Some("auto".to_owned()),
            host_root: Some(PathBuf::from("/tmp/root")),
            policy_interval_ms: Some(200),
            ..Overrides::default()
        };
        let r = file.resolve(cli, &env(0)).unwrap();
        assert_eq!(r.policy.modes.pinned, None);
        assert_eq!(r.policy.host_root, PathBuf::from("/tmp/root"));
        assert_eq!(r.policy.interval, std::time::Duration::from_millis(200));
    }

    #[test]
    fn bad_policy_values_are_refused_with_the_fix() {
        for (text, needle) in [
            ("[policy]\nmode = \"turbo\"\n", "\"turbo\" is not a mode"),
            ("[policy]\npowersave_below = 120\n", "policy.powersave_below is 120"),
            ("[policy]\npressure_enter = 5\npressure_leave = 5\n", "must be below policy.pressure_enter"),
            ("[policy]\ninterval_ms = 10\n", "between 50 and 60000"),
            ("[[policy.floor]]\nlayers = \"3-1\"\nformat = \"q8\"\n", "layers \"3-1\" is not a range of layers"),
            ("[[policy.floor]]\nlayers = \"0\"\nformat = \"q3\"\n", "format \"q3\" is not a page format"),
            ("[[policy.floor]]\nlayers = \"0\"\n", "missing field `format`"),
            ("[[policy.floor]]\nlayers = \"0\"\nformat = \"q8\"\nbits = 8\n", "bits"),
            ("[policy]\nadaptive_precision = \"yes\"\n", "adaptive_precision"),
            (
                "[policy]\nadaptive_ranking = \"heat\"\n",
                "\"heat\" is not a ranking; use \"age\" (the default) or \"mass\"",
            ),
        ] {
            // Shape errors (a missing or unknown key, a wrong type) come from the parser, values from
            // resolution.
            let err = match FileConfig::parse(text) {
                Ok(file) => file.resolve(Overrides::default(), &env(0)).unwrap_err().to_string(),
                Err(e) => e,
            };
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn tiers_default_to_a_q8_dram_pool_and_no_flash() {
        let r = FileConfig::default().resolve(Overrides::default(), &env(1000)).unwrap();
        assert_eq!(r.tiers.dram_budget, (8u64 << 30) / 100 * 10);
        assert_eq!(r.tiers.flash_budget, 0);
        assert_eq!(r.tiers.demote_format, Some(Format::Q8));
        assert_eq!(r.tiers.io_engine, EngineChoice::Auto);
        let file = FileConfig::parse("[tiers]\nflash_budget = \"1GiB\"\ndemote_format = \"none\"\n").unwrap();
        let r = file.resolve(Overrides::default(), &env(1000)).unwrap();
        assert_eq!(r.tiers.flash_path, PathBuf::from("/home/u/.local/state/kvmm/kvmm.flash"));
        assert_eq!(r.tiers.demote_format, None);
        let root = FileConfig::parse("[tiers]\nflash_budget = \"1GiB\"\n")
            .unwrap()
            .resolve(Overrides::default(), &env(0))
            .unwrap();
        assert_eq!(root.tiers.flash_path, PathBuf::from("/var/lib/kvmm/kvmm.flash"));
    }

    #[test]
    fn the_longest_linger_defaults_to_five_minutes_and_stays_in_its_range() {
        let r = FileConfig::default().resolve(Overrides::default(), &env(0)).unwrap();
        assert_eq!(r.max_linger, std::time::Duration::from_secs(300));
        let file = FileConfig::parse("max_linger_ms = 0\n").unwrap();
        assert_eq!(file.clone().resolve(Overrides::default(), &env(0)).unwrap().max_linger.as_millis(), 0);
        let cli = Overrides { max_linger_ms: Some(1500), ..Default::default() };
        assert_eq!(file.resolve(cli, &env(0)).unwrap().max_linger.as_millis(), 1500, "the command line wins");
        let cli = Overrides { max_linger_ms: Some(86_400_001), ..Default::default() };
        let err = FileConfig::default().resolve(cli, &env(0)).unwrap_err().to_string();
        assert!(err.contains("max_linger_ms is 86400001") && err.contains("between 0 and 86400000"), "{err}");
    }

    #[test]
    fn the_pin_lease_defaults_to_ten_seconds_and_stays_in_its_range() {
        let r = FileConfig::default().resolve(Overrides::default(), &env(0)).unwrap();
        assert_eq!(r.pin_lease, std::time::Duration::from_secs(10));
        let file = FileConfig::parse("pin_lease_ms = 2500\n").unwrap();
        assert_eq!(file.clone().resolve(Overrides::default(), &env(0)).unwrap().pin_lease.as_millis(), 2500);
        let cli = Overrides { pin_lease_ms: Some(400), ..Default::default() };
        let r = file.resolve(cli, &env(0)).unwrap();
        assert_eq!(r.pin_lease.as_millis(), 400, "the command line wins");
        assert!(!r.revoke_stuck_pins, "report only by default");
        let file = FileConfig::parse("revoke_stuck_pins = true\n").unwrap();
        assert!(file.resolve(Overrides::default(), &env(0)).unwrap().revoke_stuck_pins);
        let cli = Overrides { revoke_stuck_pins: true, ..Default::default() };
        assert!(FileConfig::default().resolve(cli, &env(0)).unwrap().revoke_stuck_pins);
        for bad in [0, 199, 3_600_001] {
            let cli = Overrides { pin_lease_ms: Some(bad), ..Default::default() };
            let err = FileConfig::default().resolve(cli, &env(0)).unwrap_err().to_string();
            assert!(
                err.contains(&format!("pin_lease_ms is {bad}")) && err.contains("between 200 and 3600000"),
                "{err}"
            );
        }
    }

    #[test]
    fn bad_tier_values_are_refused_with_the_fix() {
        for (text, needle) in [
            ("[tiers]\nio_engine = \"uring\"\n", "io_engine"),
            ("[tiers]\ndemote_format = \"f16\"\n", "demote_format"),
            ("[tiers]\nhigh_watermark = 70\nlow_watermark = 80\n", "watermarks"),
        ] {
            let err = FileConfig::parse(text).unwrap().resolve(Overrides::default(), &env(0)).unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}
