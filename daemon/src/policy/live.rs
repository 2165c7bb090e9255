//! The policy in a running daemon: the planner's state, the [`Tuning`] in force, the precision
//! settings of demoted pages, the last sensor reading, and the thread that keeps them current.
//!
//! The policy thread reads the sensors every `policy.interval` (sooner when the kernel's PSI
//! trigger fires), feeds the reading to the [`Planner`], logs every mode or pressure change with its
//! cause, and wakes the tier thread, which reads the [`Tuning`] on each pass. Nothing here takes the
//! core lock: [`LivePolicy`] has a lock of its own, taken after the core lock when both are needed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::mode::{Change, Mode, ModePolicy, Planner, Pressure, Tuning, tuning};
use super::precision::{Demotion, PrecisionPolicy};
use super::sensors::{HostRoot, PressureWatch, Signals, Wake};
use crate::config::Resolved;
use crate::daemon::Daemon;

/// PSI trigger: wake when tasks stall on memory for 150 ms within a 2 s window (the shortest
/// window an unprivileged trigger may use; kvmmd usually runs unprivileged).
const PSI_STALL_US: u64 = 150_000;
const PSI_WINDOW_US: u64 = 2_000_000;

/// The policy state of a running daemon.
#[derive(Debug)]
pub struct LivePolicy {
    planner: Planner,
    tuning: Tuning,
    /// Adaptive precision and floors: from the configuration at start, replaced by a reload.
    precision: PrecisionPolicy,
    signals: Signals,
    changes: u64,
    /// Entries into thermal mode since start (a metric); written by [`LivePolicy::observe`].
    thermal_entries: u64,
    since: Instant,
    /// How memory pressure is watched: the trigger, or why it is polled.
    pressure_watch: String,
    /// Problems of the last reading that were already logged.
    logged_problems: Vec<String>,
}

/// What the status RPC shows of the policy.
#[derive(Clone, Debug)]
pub struct PolicyView {
    /// The mode in force.
    pub mode: Mode,
    /// Memory pressure level.
    pub pressure: Pressure,
    /// Why.
    pub cause: String,
    /// Mode or pressure changes since start.
    pub changes: u64,
    /// Entries into thermal mode since start.
    pub thermal_entries: u64,
    /// How long the current mode and pressure have held.
    pub held_for: Duration,
    /// What the mode sets.
    pub tuning: Tuning,
    /// Adaptive precision and floors.
    pub precision: PrecisionPolicy,
    /// The last reading.
    pub signals: Signals,
    /// How memory pressure is watched.
    pub pressure_watch: String,
}

impl LivePolicy {
    /// The state before the first reading.
    pub fn new(config: &Resolved) -> LivePolicy {
        let planner = Planner::new(config.policy.modes.clone());
        let tuning = tuning_for(config, planner.mode(), planner.pressure());
        LivePolicy {
            planner,
            tuning,
            precision: config.policy.precision.clone(),
            signals: Signals::default(),
            changes: 0,
            thermal_entries: 0,
            since: Instant::now(),
            pressure_watch: "not started".to_owned(),
            logged_problems: Vec::new(),
        }
    }

    /// The tuning in force.
    pub fn tuning(&self) -> Tuning {
        self.tuning
    }

    /// How a demotion now chooses each page's format: the mode's format with the configured
    /// adaptive precision, its ranking and floors.
    pub fn demotion(&self) -> Demotion {
        Demotion {
            format: self.tuning.demote_format,
            adaptive: self.precision.adaptive,
            ranking: self.precision.ranking,
            floors: self.precision.floors.clone(),
        }
    }

    /// Takes a reading: returns the change, if the mode or pressure changed.
    pub fn observe(&mut self, config: &Resolved, signals: Signals) -> Option<Change> {
        let before = self.planner.mode();
        let change = self.planner.update(&signals);
        if let Some(c) = &change {
            if c.mode == Mode::Thermal && before != Mode::Thermal {
                self.thermal_entries += 1;
            }
            self.tuning = tuning_for(config, c.mode, c.pressure);
            self.changes += 1;
            self.since = Instant::now();
        }
        if signals.problems != self.logged_problems {
            for problem in signals.problems.iter().filter(|p| !self.logged_problems.contains(p)) {
                tracing::warn!(problem = %problem, "a sensor could not be read");
            }
            self.logged_problems = signals.problems.clone();
        }
        self.signals = signals;
        change
    }

    /// Replaces the planner's thresholds and the precision settings (a reload) and applies them
    /// to the last reading at once; returns the change, if the mode or pressure changed.
    pub fn reload(&mut self, config: &Resolved, modes: ModePolicy, precision: PrecisionPolicy) -> Option<Change> {
        self.planner.set_policy(modes);
        self.precision = precision;
        let signals = std::mem::take(&mut self.signals);
        self.observe(config, signals)
    }

    /// The thresholds (and pinned mode) in force.
    pub fn modes(&self) -> &crate::policy::mode::ModePolicy {
        self.planner.policy()
    }

    /// A snapshot for the status RPC.
    pub fn view(&self) -> PolicyView {
        PolicyView {
            mode: self.planner.mode(),
            pressure: self.planner.pressure(),
            cause: self.planner.cause().to_owned(),
            changes: self.changes,
            thermal_entries: self.thermal_entries,
            held_for: self.since.elapsed(),
            tuning: self.tuning,
            precision: self.precision.clone(),
            signals: self.signals.clone(),
            pressure_watch: self.pressure_watch.clone(),
        }
    }
}

fn tuning_for(config: &Resolved, mode: Mode, pressure: Pressure) -> Tuning {
    let t = &config.tiers;
    tuning(mode, t.demote_format, (t.high_watermark, t.low_watermark), pressure)
}

/// The policy thread: reads the sensors and updates the daemon's policy until shutdown.
pub fn policy_task(daemon: Arc<Daemon>) {
    let config = &daemon.config;
    let root = HostRoot::new(config.policy.host_root.clone());
    let mut watch = PressureWatch::open(&root, PSI_STALL_US, PSI_WINDOW_US);
    let how = match (watch.trigger(), watch.fallback_reason()) {
        (Some(trigger), _) => format!("PSI trigger \"{trigger}\" on {}", watch.path().display()),
        (None, Some(why)) => format!("polled every {:?}: {why}", config.policy.interval),
        (None, None) => format!("polled every {:?}", config.policy.interval),
    };
    tracing::info!(root = %config.policy.host_root.display(), pressure = %how, "policy engine started");
    daemon.policy.lock().pressure_watch = how;
    while !daemon.is_shutting_down() {
        let signals = root.read();
        let change = daemon.policy.lock().observe(config, signals);
        if let Some(c) = change {
            tracing::info!(mode = %c.mode, memory_pressure = ?c.pressure, cause = %c.cause, "policy mode");
            daemon.wake_tiers();
        }
        // Wait out the interval in beats, so the watchdog sees the loop alive however long the
        // interval; a PSI trigger ends the wait early.
        let next = Instant::now() + config.policy.interval;
        loop {
            daemon.beat(crate::systemd::Loop::Policy);
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() || daemon.is_shutting_down() {
                break;
            }
            if watch.wait(left.min(crate::systemd::BEAT_EVERY)) == Wake::Triggered {
                break;
            }
        }
    }
}
