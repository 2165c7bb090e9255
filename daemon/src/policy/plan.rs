//! The pure tier planner: (pool view, tuning, rate allowances) → what the tier thread does this
//! pass. The mode planner ([`crate::policy::mode`]) turns signals into a [`Tuning`]; this turns the
//! tuning and the pools' state into byte amounts; the tier thread picks the pages
//! ([`crate::migrate::tiering::pick_victims`]) and moves them.
//!
//! ```text
//!  signals ──Planner::update──▶ mode, pressure ──tuning()──▶ Tuning ──plan()──▶ Plan ──tier thread──▶ moves
//! ```
//!
//! Promotion is not planned here: it follows faults and prefetch hints at once. Dropping is decided
//! per session at `Extend` ([`crate::migrate::evict::drop_order`]).

use crate::config::MIN_DEVICE_BUDGET;
use crate::policy::mode::Tuning;

/// What the planner needs to know about the pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolView {
    /// The configured device budget and the device bytes in use.
    pub device_configured: u64,
    pub device_used: u64,
    /// The DRAM pool's size and bytes in use, if there is one.
    pub dram: Option<(u64, u64)>,
    /// Whether a flash tier exists.
    pub flash: bool,
}

/// Bytes the rate limits let the tier thread move now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allowance {
    /// Background migration of any kind.
    pub background: u64,
    /// Flash writes.
    pub flash_writes: u64,
}

/// What one pass of the tier thread does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The device budget in force.
    pub device_budget: u64,
    /// The DRAM pool's limit in force.
    pub dram_limit: Option<u64>,
    /// Whether a watermark drain of the device is under way (it starts above the high watermark
    /// and goes on, across passes, down to the low one).
    pub draining: bool,
    /// Device bytes to demote now (coldest first).
    pub demote_device: u64,
    /// DRAM bytes to move to flash now (coldest first).
    pub spill_dram: u64,
    /// Whether the budgets are shrunk under memory pressure: the rates do not apply, and free
    /// memory is given back to the system.
    pub shrunk: bool,
}

/// `pct` percent of `bytes`, exact at 100.
pub fn percent_of(bytes: u64, pct: u8) -> u64 {
    (u128::from(bytes) * u128::from(pct) / 100) as u64
}

/// Whether `tuning` shrinks the budgets (memory pressure).
pub fn shrunk(tuning: &Tuning) -> bool {
    tuning.device_budget_pct < 100 || tuning.dram_budget_pct < 100
}

/// The plan for one pass. `was_draining` is the previous pass's [`Plan::draining`]; `allowed` is
/// what the rate limits allow now (ignored while the budgets are shrunk).
pub fn plan(view: PoolView, tuning: &Tuning, was_draining: bool, allowed: Allowance) -> Plan {
    let shrunk = shrunk(tuning);
    let allowed = if shrunk { Allowance { background: u64::MAX, flash_writes: u64::MAX } } else { allowed };
    let device_budget = percent_of(view.device_configured, tuning.device_budget_pct).max(MIN_DEVICE_BUDGET);
    let low = device_budget / 100 * u64::from(tuning.device_low_watermark);
    let high = device_budget / 100 * u64::from(tuning.device_high_watermark);
    let used = view.device_used;
    let draining = used > low && (was_draining || used > high);
    let demote_device = if draining { (used - low).min(allowed.background) } else { 0 };
    let dram_limit = view.dram.map(|(capacity, _)| percent_of(capacity, tuning.dram_budget_pct));
    let spill_dram = match (view.dram, dram_limit, view.flash) {
        (Some((_, used)), Some(limit), true) if used > limit / 100 * u64::from(tuning.dram_high_watermark) => {
            let left = allowed.background.saturating_sub(demote_device);
            (used - limit / 100 * u64::from(tuning.dram_low_watermark)).min(left).min(allowed.flash_writes)
        }
        _ => 0,
    };
    Plan { device_budget, dram_limit, draining, demote_device, spill_dram, shrunk }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::mode::{Mode, ModePolicy, Planner, Pressure, tuning};
    use crate::policy::sensors::{Battery, BatteryStatus, Memory, Power, Signals, ThermalZone, TripKind, TripPoint};

    const MIB: u64 = 1 << 20;

    /// A reading with one zone (passive trip at 95 °C), a battery or mains, and PSI some avg10.
    fn reading(temp_c: f64, battery: Option<(BatteryStatus, u8)>, psi: f64) -> Signals {
        Signals {
            thermal: vec![ThermalZone {
                name: "thermal_zone0".to_owned(),
                kind: "x86_pkg_temp".to_owned(),
                temp_mc: (temp_c * 1000.0) as i64,
                trips: vec![TripPoint { temp_mc: 95_000, kind: TripKind::Passive }],
            }],
            power: Power {
                on_ac: Some(battery.is_none()),
                battery: battery.map(|(status, c)| Battery { name: "BAT0".to_owned(), status, capacity: Some(c) }),
            },
            memory: Memory { some_avg10: Some(psi), full_avg10: None, mem_available: None, mem_total: None },
            problems: Vec::new(),
        }
    }

    /// 64 MiB device with `device_used` in use, 64 MiB DRAM with `dram_used`, flash present.
    fn view(device_used: u64, dram_used: u64) -> PoolView {
        PoolView { device_configured: 64 * MIB, device_used, dram: Some((64 * MIB, dram_used)), flash: true }
    }

    /// A tick's worth of allowance at each mode's rates (100 ms), or plenty where unlimited.
    fn allowance(t: &Tuning) -> Allowance {
        let tick = |rate: Option<u64>| rate.map_or(u64::MAX, |r| r / 10);
        Allowance { background: tick(t.background_bytes_per_s), flash_writes: tick(t.flash_write_bytes_per_s) }
    }

    #[test]
    fn signals_give_a_mode_and_the_mode_a_plan() {
        // (readings in order, the pools, expected mode, expected plan)
        struct Case {
            readings: Vec<Signals>,
            pools: PoolView,
            mode: Mode,
            pressure: Pressure,
            demote_device: u64,
            spill_dram: u64,
            device_budget: u64,
        }
        let dis = BatteryStatus::Discharging;
        let cases = [
            // Mains, device at 95% (over the 90% high watermark): drain to 70%, unlimited.
            Case {
                readings: vec![reading(50.0, None, 0.0)],
                pools: view(61 * MIB, 0),
                mode: Mode::Performance,
                pressure: Pressure::Normal,
                demote_device: 61 * MIB - 64 * MIB / 100 * 70,
                spill_dram: 0,
                device_budget: 64 * MIB,
            },
            // Performance keeps DRAM until 95%: at 92% nothing goes to flash.
            Case {
                readings: vec![reading(50.0, None, 0.0)],
                pools: view(10 * MIB, 59 * MIB),
                mode: Mode::Performance,
                pressure: Pressure::Normal,
                demote_device: 0,
                spill_dram: 0,
                device_budget: 64 * MIB,
            },
            // Balanced (on battery) spills DRAM above 90%, at most 256 MiB/s of flash writes.
            Case {
                readings: vec![reading(50.0, Some((dis, 60)), 0.0)],
                pools: view(10 * MIB, 62 * MIB),
                mode: Mode::Balanced,
                pressure: Pressure::Normal,
                demote_device: 0,
                spill_dram: 62 * MIB - 64 * MIB / 100 * 70,
                device_budget: 64 * MIB,
            },
            // Powersave at 15%: demotion starts at 80% (and goes to 50%), flash writes 32 MiB/s.
            Case {
                readings: vec![reading(50.0, Some((dis, 15)), 0.0)],
                pools: view(52 * MIB, 63 * MIB),
                mode: Mode::Powersave,
                pressure: Pressure::Normal,
                demote_device: 52 * MIB - 64 * MIB / 100 * 50,
                spill_dram: 32 * MIB / 10,
                device_budget: 64 * MIB,
            },
            // Thermal: background work at 16 MiB/s in all, device demotion first.
            Case {
                readings: vec![reading(97.0, None, 0.0)],
                pools: view(63 * MIB, 63 * MIB),
                mode: Mode::Thermal,
                pressure: Pressure::Normal,
                demote_device: 16 * MIB / 10,
                spill_dram: 0,
                device_budget: 64 * MIB,
            },
            // Memory pressure: budgets halve, the drain to the new low watermark is unlimited.
            Case {
                readings: vec![reading(50.0, None, 25.0)],
                pools: view(40 * MIB, 40 * MIB),
                mode: Mode::Performance,
                pressure: Pressure::High,
                demote_device: 40 * MIB - 32 * MIB / 100 * 70,
                spill_dram: 40 * MIB - 32 * MIB / 100 * 90,
                device_budget: 32 * MIB,
            },
            // Pressure that eased to 5% (above the 2% leave threshold) is still pressure...
            Case {
                readings: vec![reading(50.0, None, 25.0), reading(50.0, None, 5.0)],
                pools: view(40 * MIB, 0),
                mode: Mode::Performance,
                pressure: Pressure::High,
                demote_device: 40 * MIB - 32 * MIB / 100 * 70,
                spill_dram: 0,
                device_budget: 32 * MIB,
            },
            // ...and below 2% the budgets come back: 40 MiB of 64 is under the high watermark.
            Case {
                readings: vec![reading(50.0, None, 25.0), reading(50.0, None, 1.0)],
                pools: view(40 * MIB, 0),
                mode: Mode::Performance,
                pressure: Pressure::Normal,
                demote_device: 0,
                spill_dram: 0,
                device_budget: 64 * MIB,
            },
        ];
        for (i, c) in cases.into_iter().enumerate() {
            let mut planner = Planner::new(ModePolicy::default());
            for r in &c.readings {
                planner.update(r);
            }
            assert_eq!((planner.mode(), planner.pressure()), (c.mode, c.pressure), "case {i}");
            let t = tuning(planner.mode(), Some(kvmm_kernels::Format::Q8), (90, 70), planner.pressure());
            let p = plan(c.pools, &t, false, allowance(&t));
            assert_eq!(
                (p.demote_device, p.spill_dram, p.device_budget),
                (c.demote_device, c.spill_dram, c.device_budget),
                "case {i}: {:?} {t:?}",
                c.mode
            );
            assert_eq!(p.shrunk, c.pressure == Pressure::High, "case {i}");
        }
    }

    #[test]
    fn a_drain_runs_from_the_high_watermark_down_to_the_low_one_across_passes() {
        let t = tuning(Mode::Performance, None, (90, 70), Pressure::Normal);
        let plenty = Allowance { background: u64::MAX, flash_writes: u64::MAX };
        // Between the watermarks a drain does not start...
        assert!(!plan(view(50 * MIB, 0), &t, false, plenty).draining);
        // ...but one under way goes on, in steps of what the rate allows.
        let step = Allowance { background: MIB, flash_writes: MIB };
        let p = plan(view(50 * MIB, 0), &t, true, step);
        assert!(p.draining && p.demote_device == MIB, "{p:?}");
        // It ends at the low watermark.
        assert!(!plan(view(64 * MIB / 100 * 70, 0), &t, true, plenty).draining);
    }

    #[test]
    fn without_flash_or_dram_nothing_is_spilled_and_the_budget_never_goes_below_the_minimum() {
        let t = tuning(Mode::Balanced, Some(kvmm_kernels::Format::Q8), (90, 70), Pressure::High);
        let p = plan(
            PoolView { device_configured: 3 * MIB, device_used: 0, dram: None, flash: false },
            &t,
            false,
            Allowance { background: 0, flash_writes: 0 },
        );
        assert_eq!((p.device_budget, p.dram_limit, p.spill_dram), (MIN_DEVICE_BUDGET, None, 0));
        let no_flash = PoolView { flash: false, ..view(0, 64 * MIB) };
        assert_eq!(plan(no_flash, &t, false, Allowance { background: 0, flash_writes: 0 }).spill_dram, 0);
    }
}
