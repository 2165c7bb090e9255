//! Modes: which one the daemon runs in, chosen from the host's [`Signals`] with hysteresis (or
//! pinned by the operator), and what each one sets ([`Tuning`]).
//!
//! | mode | when (auto) | what changes |
//! |---|---|---|
//! | `thermal` | a thermal zone at or above its passive trip point | background migration rate-limited, prefetch depth 1, flash writes rate-limited |
//! | `powersave` | a battery discharging at or below `powersave_below` percent | pages leave the device as q4 and sooner, fewer flash writes |
//! | `balanced` | on battery above that | the configured ladder, flash writes rate-limited |
//! | `performance` | on mains power, or no battery at all | the configured ladder, the DRAM pool fills before flash |
//!
//! The first row that holds wins. Leaving a mode needs the reading to clear its threshold by a
//! margin (`thermal_hysteresis_mc`, `battery_hysteresis`), so a temperature or charge oscillating
//! around a trip point does not flap. A reading that could not be taken (no zones, no battery, an
//! unreadable capacity) is no reason to enter a mode and no reason to leave one.
//!
//! Memory pressure is not a mode: it is a separate level ([`Pressure`]) that shrinks the device and
//! DRAM budgets of whatever mode is in force, with the same enter/leave hysteresis.
//!
//! Everything here is pure: [`Planner::update`] takes a reading and returns the change, if any.

use std::fmt;

use kvmm_kernels::Format;

use super::sensors::{BatteryStatus, Signals};

/// The daemon's operating mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// On mains power: keep as much as possible at full precision and in memory.
    Performance,
    /// On battery: the configured ladder with fewer flash writes.
    Balanced,
    /// Low battery: compress harder and sooner, write flash rarely.
    Powersave,
    /// Hot: do as little background work as possible.
    Thermal,
}

impl Mode {
    /// Every mode, in the order of the table above (highest precedence last).
    pub const ALL: [Mode; 4] = [Mode::Performance, Mode::Balanced, Mode::Powersave, Mode::Thermal];

    /// The name used in configuration, logs and stats.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Performance => "performance",
            Mode::Balanced => "balanced",
            Mode::Powersave => "powersave",
            Mode::Thermal => "thermal",
        }
    }

    /// Parses a mode name as [`Mode::name`] writes it.
    pub fn parse(name: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == name)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Memory pressure as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pressure {
    /// No stall worth reacting to.
    Normal,
    /// Tasks stall on memory: budgets shrink and the daemon gives memory back.
    High,
}

/// The thresholds of automatic mode choice (the `[policy]` table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModePolicy {
    /// `Some` pins the mode and ignores the signals.
    pub pinned: Option<Mode>,
    /// Powersave when a battery discharges at or below this percentage.
    pub powersave_below: u8,
    /// Powersave ends above `powersave_below + battery_hysteresis` (or on mains power).
    pub battery_hysteresis: u8,
    /// Thermal mode ends when every zone is this many millidegrees below its passive trip.
    pub thermal_hysteresis_mc: i64,
    /// Pressure is high when PSI `some avg10` reaches this percentage...
    pub pressure_enter: u8,
    /// ...and normal again below this one.
    pub pressure_leave: u8,
}

impl Default for ModePolicy {
    fn default() -> Self {
        ModePolicy {
            pinned: None,
            powersave_below: 20,
            battery_hysteresis: 5,
            thermal_hysteresis_mc: 5_000,
            pressure_enter: 10,
            pressure_leave: 2,
        }
    }
}

/// What a mode sets. Percentages are of the configured budgets and watermarks' tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Share of the configured device budget the daemon keeps resident.
    pub device_budget_pct: u8,
    /// Share of the configured DRAM budget.
    pub dram_budget_pct: u8,
    /// The format full 16-bit pages take when they leave the device; `None` keeps them exact.
    pub demote_format: Option<Format>,
    /// Background demotion from the device starts above this percentage of its (tuned) budget...
    pub device_high_watermark: u8,
    /// ...and stops below this one.
    pub device_low_watermark: u8,
    /// The same for the DRAM pool: above `dram_high_watermark` pages go to flash.
    pub dram_high_watermark: u8,
    /// Where moving DRAM pages to flash stops.
    pub dram_low_watermark: u8,
    /// Layers a prefetch hint may ask for ahead of the current one.
    pub prefetch_depth: u32,
    /// Bytes per second the flash tier may be written in the background; `None`: unlimited.
    pub flash_write_bytes_per_s: Option<u64>,
    /// Bytes per second of background migration of any kind; `None`: unlimited.
    pub background_bytes_per_s: Option<u64>,
}

/// Budgets shrink to this share of the mode's own while memory pressure is high.
pub const PRESSURE_BUDGET_PCT: u8 = 50;

const MIB: u64 = 1 << 20;

/// What `mode` sets, given the operator's configured demotion format and watermarks (the
/// configuration is what `balanced` and `performance` use; a lossless configuration stays lossless
/// in every mode) and the memory pressure.
pub fn tuning(mode: Mode, configured: Option<Format>, watermarks: (u8, u8), pressure: Pressure) -> Tuning {
    let (high, low) = watermarks;
    let harder = configured.map(|f| if bits(f) > bits(Format::Q4) { Format::Q4 } else { f });
    let base = Tuning {
        device_budget_pct: 100,
        dram_budget_pct: 100,
        demote_format: configured,
        device_high_watermark: high,
        device_low_watermark: low,
        dram_high_watermark: high,
        dram_low_watermark: low,
        prefetch_depth: 4,
        flash_write_bytes_per_s: None,
        background_bytes_per_s: None,
    };
    let mut t = match mode {
        Mode::Performance => Tuning {
            // Flash late: the DRAM pool fills further before pages go to flash.
            dram_high_watermark: high.max(95),
            dram_low_watermark: low.max(90),
            ..base
        },
        Mode::Balanced => Tuning { flash_write_bytes_per_s: Some(256 * MIB), ..base },
        Mode::Powersave => Tuning {
            demote_format: harder,
            // Sooner: demotion starts with more headroom on the device.
            device_high_watermark: high.saturating_sub(10).max(20),
            device_low_watermark: low.saturating_sub(20).max(10),
            prefetch_depth: 2,
            flash_write_bytes_per_s: Some(32 * MIB),
            ..base
        },
        Mode::Thermal => Tuning {
            prefetch_depth: 1,
            flash_write_bytes_per_s: Some(16 * MIB),
            background_bytes_per_s: Some(16 * MIB),
            ..base
        },
    };
    if pressure == Pressure::High {
        t.device_budget_pct = PRESSURE_BUDGET_PCT;
        t.dram_budget_pct = PRESSURE_BUDGET_PCT;
    }
    t
}

/// Bits per element of keys and values together (to order formats by size).
fn bits(f: Format) -> u32 {
    f.k_bits() + f.v_bits()
}

/// A change the planner decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    /// The mode now in force.
    pub mode: Mode,
    /// The pressure level now in force.
    pub pressure: Pressure,
    /// One sentence: which reading caused it.
    pub cause: String,
}

/// The mode planner's state: the mode and pressure in force and why.
#[derive(Clone, Debug)]
pub struct Planner {
    policy: ModePolicy,
    mode: Mode,
    pressure: Pressure,
    cause: String,
    /// Whether a reading was taken yet.
    read: bool,
}

impl Planner {
    /// Starts in the pinned mode, or `performance` until the first reading.
    pub fn new(policy: ModePolicy) -> Planner {
        let (mode, cause) = match policy.pinned {
            Some(m) => (m, format!("pinned to {m} by the policy")),
            None => (Mode::Performance, "no reading yet".to_owned()),
        };
        Planner { policy, mode, pressure: Pressure::Normal, cause, read: false }
    }

    /// The mode in force.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The pressure level in force.
    pub fn pressure(&self) -> Pressure {
        self.pressure
    }

    /// Why the mode (or pressure) is what it is.
    pub fn cause(&self) -> &str {
        &self.cause
    }

    /// The policy in force.
    pub fn policy(&self) -> &ModePolicy {
        &self.policy
    }

    /// Replaces the policy (a reload); the next [`Planner::update`] applies it.
    pub fn set_policy(&mut self, policy: ModePolicy) {
        self.policy = policy;
    }

    /// Takes a reading; returns the change if the mode or the pressure level changed (the first
    /// reading always reports, so the log says why the daemon starts in its mode). The cause kept
    /// for status follows every reading.
    pub fn update(&mut self, signals: &Signals) -> Option<Change> {
        let (mode, mode_cause) = self.choose_mode(signals);
        let (pressure, pressure_cause) = self.choose_pressure(signals);
        let changed = !self.read || mode != self.mode || pressure != self.pressure;
        let change_cause = if mode != self.mode || !self.read { mode_cause.clone() } else { pressure_cause.clone() };
        self.read = true;
        self.mode = mode;
        self.pressure = pressure;
        self.cause = match pressure {
            Pressure::High => format!("{mode_cause}; {pressure_cause}"),
            Pressure::Normal => mode_cause,
        };
        changed.then_some(Change { mode, pressure, cause: change_cause })
    }

    fn choose_mode(&self, s: &Signals) -> (Mode, String) {
        if let Some(m) = self.policy.pinned {
            return (m, format!("pinned to {m} by the policy"));
        }
        if let Some(why) = self.thermal(s) {
            return (Mode::Thermal, why);
        }
        if let Some(why) = self.low_battery(s) {
            return (Mode::Powersave, why);
        }
        match on_battery(s) {
            Some(why) => (Mode::Balanced, why),
            None if s.power.on_ac == Some(true) => (Mode::Performance, "on mains power".to_owned()),
            None => (Mode::Performance, "no battery is discharging".to_owned()),
        }
    }

    /// Why thermal mode holds, if it does: entering needs a zone at or above its passive trip,
    /// staying needs one within the hysteresis below it.
    fn thermal(&self, s: &Signals) -> Option<String> {
        let staying = self.mode == Mode::Thermal;
        if staying && s.thermal.iter().all(|z| z.passive_trip().is_none()) {
            return Some("no thermal zone with a passive trip point could be read".to_owned());
        }
        s.thermal.iter().find_map(|zone| {
            let trip = zone.passive_trip()?;
            let holds =
                if staying { zone.temp_mc > trip - self.policy.thermal_hysteresis_mc } else { zone.temp_mc >= trip };
            holds.then(|| {
                format!(
                    "{} ({}) at {} °C, passive trip point {} °C",
                    zone.name,
                    zone.kind,
                    celsius(zone.temp_mc),
                    celsius(trip)
                )
            })
        })
    }

    /// Why powersave holds, if it does.
    fn low_battery(&self, s: &Signals) -> Option<String> {
        if s.power.on_ac == Some(true) {
            return None;
        }
        let battery = s.power.battery.as_ref()?;
        if battery.status != BatteryStatus::Discharging {
            return None;
        }
        let capacity = match battery.capacity {
            Some(c) => c,
            // Unknown charge: no reason to enter, no reason to leave.
            None if self.mode == Mode::Powersave => {
                return Some(format!("{} discharging, charge unknown", battery.name));
            }
            None => return None,
        };
        let limit = if self.mode == Mode::Powersave {
            self.policy.powersave_below.saturating_add(self.policy.battery_hysteresis)
        } else {
            self.policy.powersave_below
        };
        (capacity <= limit)
            .then(|| format!("{} discharging at {capacity}% (powersave at or below {}%)", battery.name, limit))
    }

    fn choose_pressure(&self, s: &Signals) -> (Pressure, String) {
        let Some(some) = s.memory.some_avg10 else {
            return (self.pressure, "memory pressure unknown".to_owned());
        };
        let high = match self.pressure {
            Pressure::Normal => some >= f64::from(self.policy.pressure_enter),
            Pressure::High => some >= f64::from(self.policy.pressure_leave),
        };
        let level = if high { Pressure::High } else { Pressure::Normal };
        let cause = match level {
            Pressure::High => format!(
                "memory pressure: tasks stalled {some:.1}% of the last 10 s (budgets shrink at {}%)",
                self.policy.pressure_enter
            ),
            Pressure::Normal => format!("memory pressure cleared: {some:.1}% stalled over the last 10 s"),
        };
        (level, cause)
    }
}

/// Why the host counts as on battery, if it does.
fn on_battery(s: &Signals) -> Option<String> {
    if s.power.on_ac == Some(true) {
        return None;
    }
    let battery = s.power.battery.as_ref()?;
    (battery.status == BatteryStatus::Discharging).then(|| match battery.capacity {
        Some(c) => format!("on battery ({} discharging at {c}%)", battery.name),
        None => format!("on battery ({} discharging)", battery.name),
    })
}

/// Millidegrees as degrees with one decimal.
fn celsius(mc: i64) -> String {
    format!("{:.1}", mc as f64 / 1000.0)
}

#[cfg(test)]
mod tests;
