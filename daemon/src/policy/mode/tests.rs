use super::*;
use crate::policy::sensors::{Battery, Memory, Power, ThermalZone, TripKind, TripPoint};

/// A reading: one zone with a passive trip at 95 °C and a critical one at 105 °C, the given power
/// state and PSI `some avg10`.
fn reading(temp_c: f64, ac: Option<bool>, battery: Option<(BatteryStatus, Option<u8>)>, psi: Option<f64>) -> Signals {
    Signals {
        thermal: vec![ThermalZone {
            name: "thermal_zone0".to_owned(),
            kind: "x86_pkg_temp".to_owned(),
            temp_mc: (temp_c * 1000.0) as i64,
            trips: vec![
                TripPoint { temp_mc: 105_000, kind: TripKind::Critical },
                TripPoint { temp_mc: 95_000, kind: TripKind::Passive },
            ],
        }],
        power: Power {
            on_ac: ac,
            battery: battery.map(|(status, capacity)| Battery { name: "BAT0".to_owned(), status, capacity }),
        },
        memory: Memory { some_avg10: psi, full_avg10: None, mem_available: None, mem_total: None },
        problems: Vec::new(),
    }
}

const DIS: BatteryStatus = BatteryStatus::Discharging;
const CHG: BatteryStatus = BatteryStatus::Charging;

#[test]
fn signals_choose_the_mode_from_a_fresh_start() {
    // (reading, expected mode, words the cause must contain)
    let cases: Vec<(Signals, Mode, &str)> = vec![
        (reading(50.0, Some(true), None, None), Mode::Performance, "mains"),
        (reading(50.0, None, None, None), Mode::Performance, "no battery"),
        (reading(50.0, Some(true), Some((CHG, Some(10))), None), Mode::Performance, "mains"),
        (reading(50.0, Some(false), Some((DIS, Some(64))), None), Mode::Balanced, "BAT0 discharging at 64%"),
        (reading(50.0, None, Some((DIS, None)), None), Mode::Balanced, "on battery"),
        (reading(50.0, Some(false), Some((DIS, Some(20))), None), Mode::Powersave, "BAT0 discharging at 20%"),
        (reading(50.0, Some(false), Some((DIS, Some(15))), None), Mode::Powersave, "15%"),
        // Plugged in but the charger holds it: not discharging, not powersave.
        (reading(50.0, Some(false), Some((BatteryStatus::NotCharging, Some(5))), None), Mode::Performance, ""),
        // Mains online wins over a battery that still says discharging (sysfs lags).
        (reading(50.0, Some(true), Some((DIS, Some(5))), None), Mode::Performance, "mains"),
        (reading(95.0, Some(true), None, None), Mode::Thermal, "passive trip point 95.0"),
        (reading(99.5, Some(false), Some((DIS, Some(5))), None), Mode::Thermal, "99.5"),
        (reading(94.9, Some(true), None, None), Mode::Performance, "mains"),
    ];
    for (i, (signals, mode, words)) in cases.into_iter().enumerate() {
        let mut p = Planner::new(ModePolicy::default());
        p.update(&signals);
        assert_eq!(p.mode(), mode, "case {i}: {signals:?}");
        assert!(p.cause().contains(words), "case {i}: cause {:?} lacks {words:?}", p.cause());
    }
}

#[test]
fn a_temperature_oscillating_around_the_trip_point_does_not_flap() {
    let mut p = Planner::new(ModePolicy::default());
    let first = p.update(&reading(93.0, Some(true), None, None)).unwrap();
    assert_eq!(first.mode, Mode::Performance, "the first reading always reports");
    let mut changes = Vec::new();
    // One reading a second for ten minutes: 94, 96, 94, 96 … around the 95 °C passive trip.
    for second in 0..600 {
        let temp = if second % 2 == 0 { 94.0 } else { 96.0 };
        changes.extend(p.update(&reading(temp, Some(true), None, None)));
    }
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert_eq!(changes[0].mode, Mode::Thermal);
    // It leaves only once the zone is the hysteresis (5 °C) below the trip.
    assert_eq!(p.update(&reading(90.5, Some(true), None, None)), None);
    let left = p.update(&reading(90.0, Some(true), None, None)).unwrap();
    assert_eq!(left.mode, Mode::Performance);
}

#[test]
fn battery_charge_around_the_threshold_does_not_flap() {
    let mut p = Planner::new(ModePolicy::default());
    let mut changes = Vec::new();
    for (i, capacity) in [22u8, 20, 21, 20, 21, 22, 24, 25, 21].into_iter().enumerate() {
        changes.extend(p.update(&reading(50.0, Some(false), Some((DIS, Some(capacity))), None)).map(|c| (i, c.mode)));
    }
    // Balanced at 22% (the first reading), powersave at 20%, stays there up to 20 + 5 = 25%.
    assert_eq!(changes, vec![(0, Mode::Balanced), (1, Mode::Powersave)]);
    let out = p.update(&reading(50.0, Some(false), Some((DIS, Some(26))), None)).unwrap();
    assert_eq!(out.mode, Mode::Balanced);
    // Plugging in ends powersave at any charge.
    p.update(&reading(50.0, Some(false), Some((DIS, Some(3))), None));
    assert_eq!(p.mode(), Mode::Powersave);
    assert_eq!(p.update(&reading(50.0, Some(true), Some((CHG, Some(3))), None)).unwrap().mode, Mode::Performance);
}

#[test]
fn an_unreadable_reading_neither_enters_nor_leaves_a_mode() {
    let mut p = Planner::new(ModePolicy::default());
    p.update(&reading(50.0, Some(false), Some((DIS, Some(10))), None));
    assert_eq!(p.mode(), Mode::Powersave);
    // The capacity file turned to garbage: still powersave.
    assert_eq!(p.update(&reading(50.0, Some(false), Some((DIS, None)), None)), None);
    // The thermal zones could not be read: thermal mode holds until a reading says it is cool.
    let mut hot = Planner::new(ModePolicy::default());
    hot.update(&reading(97.0, Some(true), None, None));
    assert_eq!(hot.mode(), Mode::Thermal);
    let mut no_zones = reading(0.0, Some(true), None, None);
    no_zones.thermal.clear();
    assert_eq!(hot.update(&no_zones), None);
    assert!(hot.cause().contains("could be read"), "{}", hot.cause());
    assert_eq!(hot.update(&reading(60.0, Some(true), None, None)).map(|c| c.mode), Some(Mode::Performance));
    // An unknown PSI keeps the pressure level.
    let mut pressured = Planner::new(ModePolicy::default());
    pressured.update(&reading(50.0, Some(true), None, Some(30.0)));
    assert_eq!(pressured.pressure(), Pressure::High);
    assert!(pressured.cause().contains("mains power; memory pressure"), "{}", pressured.cause());
    assert_eq!(pressured.update(&reading(50.0, Some(true), None, None)), None);
    assert_eq!(pressured.pressure(), Pressure::High);
}

#[test]
fn memory_pressure_enters_and_clears_with_hysteresis() {
    let mut p = Planner::new(ModePolicy::default());
    p.update(&reading(50.0, Some(true), None, Some(0.0)));
    let mut levels = Vec::new();
    for psi in [0.0, 9.9, 10.0, 5.0, 2.1, 1.9, 9.0, 10.5] {
        levels.extend(p.update(&reading(50.0, Some(true), None, Some(psi))).map(|c| (psi, c.pressure, c.cause)));
    }
    let seen: Vec<(f64, Pressure)> = levels.iter().map(|(psi, level, _)| (*psi, *level)).collect();
    assert_eq!(seen, vec![(10.0, Pressure::High), (1.9, Pressure::Normal), (10.5, Pressure::High)]);
    assert!(levels[0].2.contains("stalled 10.0%"), "{}", levels[0].2);
    // The mode is untouched; the budgets shrink.
    assert_eq!(p.mode(), Mode::Performance);
    let t = tuning(p.mode(), Some(Format::Q8), (90, 80), p.pressure());
    assert_eq!((t.device_budget_pct, t.dram_budget_pct), (PRESSURE_BUDGET_PCT, PRESSURE_BUDGET_PCT));
}

#[test]
fn a_pinned_mode_ignores_the_signals() {
    let policy = ModePolicy { pinned: Some(Mode::Powersave), ..ModePolicy::default() };
    let mut p = Planner::new(policy);
    assert_eq!(p.mode(), Mode::Powersave);
    assert_eq!(p.update(&reading(120.0, Some(true), None, None)).unwrap().mode, Mode::Powersave);
    assert_eq!(p.update(&reading(120.0, Some(true), None, None)), None);
    assert!(p.cause().contains("pinned"), "{}", p.cause());
    // A reload that unpins it goes back to the signals.
    p.set_policy(ModePolicy::default());
    assert_eq!(p.update(&reading(120.0, Some(true), None, None)).unwrap().mode, Mode::Thermal);
}

#[test]
fn each_mode_sets_its_ladder_prefetch_and_rates() {
    let wm = (90, 80);
    let perf = tuning(Mode::Performance, Some(Format::Q8), wm, Pressure::Normal);
    let bal = tuning(Mode::Balanced, Some(Format::Q8), wm, Pressure::Normal);
    let save = tuning(Mode::Powersave, Some(Format::Q8), wm, Pressure::Normal);
    let hot = tuning(Mode::Thermal, Some(Format::Q8), wm, Pressure::Normal);
    // Ladders: q8 except powersave, which goes to q4, and sooner.
    assert_eq!(
        [perf.demote_format, bal.demote_format, save.demote_format, hot.demote_format],
        [Some(Format::Q8), Some(Format::Q8), Some(Format::Q4), Some(Format::Q8)]
    );
    assert!(save.device_high_watermark < bal.device_high_watermark);
    // Flash late in performance.
    assert!(perf.dram_high_watermark > bal.dram_high_watermark);
    // Prefetch depth: thermal 1, the rest deeper.
    assert_eq!(hot.prefetch_depth, 1);
    assert!(perf.prefetch_depth > 1 && bal.prefetch_depth > 1 && save.prefetch_depth > 1);
    // Rates: thermal throttles background work; fewer flash writes on battery.
    assert_eq!(perf.background_bytes_per_s, None);
    assert!(hot.background_bytes_per_s.is_some());
    let flash = |t: Tuning| t.flash_write_bytes_per_s.unwrap_or(u64::MAX);
    assert!(flash(save) < flash(bal) && flash(bal) < flash(perf));
    // A lossless configuration stays lossless; a harder one than q4 is kept.
    assert_eq!(tuning(Mode::Powersave, None, wm, Pressure::Normal).demote_format, None);
    assert_eq!(tuning(Mode::Powersave, Some(Format::Q2), wm, Pressure::Normal).demote_format, Some(Format::Q2));
    // Watermarks stay ordered in every mode, whatever the configuration.
    for mode in Mode::ALL {
        for wm in [(90, 80), (100, 99), (2, 1), (30, 10)] {
            let t = tuning(mode, Some(Format::Q8), wm, Pressure::High);
            assert!(
                t.device_low_watermark < t.device_high_watermark && t.device_high_watermark <= 100,
                "{mode} {wm:?}"
            );
            assert!(t.dram_low_watermark < t.dram_high_watermark && t.dram_high_watermark <= 100, "{mode} {wm:?}");
        }
    }
}

#[test]
fn mode_names_round_trip() {
    for m in Mode::ALL {
        assert_eq!(Mode::parse(m.name()), Some(m));
    }
    assert_eq!(Mode::parse("turbo"), None);
}
