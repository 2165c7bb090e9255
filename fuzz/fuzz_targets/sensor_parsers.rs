//! kvmmd's text parsers over arbitrary text: the sysfs and procfs files the policy's sensors read
//! (a host root can hold anything: a driver's odd output, a test tree, a file cut short), the
//! configuration file, the `[policy]` body an operator sends with admin `SetPolicy`, and the values
//! of the command line. None may panic, and what each accepts must keep its stated invariant:
//!
//! - a reading the sensors accept is within its range (capacity ≤ 100, a PSI figure in 0–100,
//!   memory a whole number of KiB) and does not depend on surrounding whitespace;
//! - a mode, byte size, layer floor or temperature that parses prints back to text that parses to
//!   the same value;
//! - a configuration that resolves has a `[policy]` table that `policy_toml` writes out and
//!   `SetPolicy` reads back unchanged (`GetPolicy` then `SetPolicy` is a no-op), and so has any
//!   `SetPolicy` body that is accepted.
//!
//! The input is read as UTF-8 with invalid bytes replaced, whole and line by line.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use kvmm_daemon::config::{ByteSize, Environment, FileConfig, Overrides, Resolved, policy_toml};
use kvmm_daemon::policy::mode::Mode;
use kvmm_daemon::policy::precision::LayerFloor;
use kvmm_daemon::policy::sensors::{
    PSI_WINDOW_MAX_US, PSI_WINDOW_STEP_US, parse_battery_status, parse_capacity, parse_flag, parse_meminfo,
    parse_millidegrees, parse_online, parse_psi_avg10, parse_trip_kind, trigger_spec,
};
use libfuzzer_sys::fuzz_target;

/// A fixed environment, so that resolution reads nothing of the process running the fuzzer.
fn environment() -> Environment {
    Environment {
        runtime_directory: None,
        xdg_runtime_dir: Some(PathBuf::from("/run/user/1000")),
        euid: 1000,
        mem_available: 8 << 30,
        state_directory: None,
        xdg_state_home: Some(PathBuf::from("/home/u/.local/state")),
    }
}

/// The configuration of a daemon started without a file: what `SetPolicy` bodies are resolved
/// against.
fn defaults() -> &'static Resolved {
    static DEFAULTS: OnceLock<Resolved> = OnceLock::new();
    DEFAULTS.get_or_init(|| {
        FileConfig::default().resolve(Overrides::default(), &environment()).expect("the embedded defaults resolve")
    })
}

/// The sysfs and procfs parsers, on `text` as read and wrapped as the kernel writes its files.
fn sensors(text: &str) {
    let padded = format!(" \t{text}\n");
    if let Some(temp) = parse_millidegrees(text) {
        assert_eq!(parse_millidegrees(&temp.to_string()), Some(temp), "a temperature prints back");
    }
    assert_eq!(parse_millidegrees(&padded), parse_millidegrees(text));
    assert_eq!(parse_trip_kind(&padded), parse_trip_kind(text));
    assert_eq!(parse_battery_status(&padded), parse_battery_status(text));
    let capacity = parse_capacity(text);
    assert!(capacity.is_none_or(|c| c <= 100), "capacity {capacity:?} is a percentage");
    assert_eq!(parse_capacity(&padded), capacity);
    let (online, flag) = (parse_online(text), parse_flag(text));
    if flag.is_some() {
        assert_eq!(online, flag, "a 0/1 flag reads the same as a supply's online");
    }
    assert_eq!(parse_online(&padded), online);
    assert_eq!(parse_flag(&padded), flag);

    for report in [text.to_owned(), format!("some avg10={text}\nfull avg10={text}\n")] {
        let (some, full) = parse_psi_avg10(&report);
        for percent in [some, full].into_iter().flatten() {
            assert!((0.0..=100.0).contains(&percent), "PSI avg10 {percent} is a percentage");
        }
    }
    for meminfo in [text.to_owned(), format!("MemTotal: {text} kB\nMemAvailable: {text}\n")] {
        let (available, total) = parse_meminfo(&meminfo);
        for bytes in [available, total].into_iter().flatten() {
            assert_eq!(bytes % 1024, 0, "meminfo's {bytes} bytes are whole KiB");
        }
    }
}

/// The PSI trigger line from two numbers of the input.
fn trigger(data: &[u8]) {
    let [a, b, c, d, e, f, g, h, rest @ ..] = data else { return };
    let stall = u64::from_le_bytes([*a, *b, *c, *d, 0, 0, 0, 0]);
    let window = u64::from_le_bytes([*e, *f, *g, *h, rest.first().copied().unwrap_or(0), 0, 0, 0]);
    if let Ok(line) = trigger_spec(stall, window) {
        let words: Vec<&str> = line.split(' ').collect();
        let rounded: u64 = words[2].parse().expect("the window is a number");
        assert!(words[0] == "some" && words[1] == stall.to_string(), "{line}");
        assert!(rounded >= window && rounded % PSI_WINDOW_STEP_US == 0 && rounded <= PSI_WINDOW_MAX_US, "{line}");
        assert!(0 < stall && stall < window, "{line}");
    }
}

/// The values whose text form the daemon prints itself.
fn values(text: &str) {
    if let Some(mode) = Mode::parse(text) {
        assert_eq!(mode.name(), text, "a mode parses only from its name");
    }
    match ByteSize::parse(text) {
        Ok(ByteSize::Bytes(n)) => assert_eq!(ByteSize::parse(&n.to_string()), Ok(ByteSize::Bytes(n))),
        Ok(ByteSize::PercentOfAvailable(p)) => {
            assert!((1..=100).contains(&p), "{p}% is a percentage");
            assert_eq!(ByteSize::parse(&format!("{p}%")), Ok(ByteSize::PercentOfAvailable(p)));
        }
        Err(_) => {}
    }
    let (layers, format) = text.rsplit_once(':').unwrap_or((text, "q8"));
    if let Ok(floor) = LayerFloor::parse(layers, format) {
        let printed = floor.to_string();
        let (layers, format) = printed.rsplit_once(':').expect("a floor prints as LAYERS:FORMAT");
        assert_eq!(LayerFloor::parse(layers, format), Ok(floor), "{printed}");
        for layer_count in [1, 2, 32, 512] {
            let _ = floor.covers(layer_count - 1, layer_count);
        }
    }
}

/// `GetPolicy` then `SetPolicy` with its text gives the same policy.
fn policy_round_trip(resolved: &Resolved, policy: &kvmm_daemon::config::Policy) {
    let body = policy_toml(&policy.modes, &policy.precision);
    let again = resolved.policy_from_toml(&body).unwrap_or_else(|e| panic!("{e}: the written policy\n{body}"));
    assert_eq!(again.modes, policy.modes, "{body}");
    assert_eq!(again.precision, policy.precision, "{body}");
}

/// The keys of a `[policy]` body (a `SetPolicy` body is parsed as a `[policy]` table).
const POLICY_KEYS: [&str; 10] = [
    "mode",
    "powersave_below",
    "battery_hysteresis",
    "thermal_hysteresis_c",
    "pressure_enter",
    "pressure_leave",
    "adaptive_precision",
    "adaptive_ranking",
    "interval_ms",
    "host_root",
];

/// A `[policy]` body built from the input's lines, so that most inputs get past the TOML syntax to
/// the checks behind it: a line's first character picks a key (or, one time in eleven, a floor), the
/// rest is the value as written (a floor's: `LAYERS:FORMAT`).
fn policy_body(text: &str) -> String {
    let (mut keys, mut floors) = (String::new(), String::new());
    for line in text.lines() {
        let mut chars = line.chars();
        let Some(pick) = chars.next() else { continue };
        let value = chars.as_str();
        match POLICY_KEYS.get(pick as usize % (POLICY_KEYS.len() + 1)) {
            Some(key) => keys += &format!("{key} = {value}\n"),
            None => {
                let (layers, format) = value.rsplit_once(':').unwrap_or((value, "q8"));
                floors += &format!("\n[[floor]]\nlayers = \"{layers}\"\nformat = \"{format}\"\n");
            }
        }
    }
    keys + &floors
}

/// The configuration file, a `SetPolicy` body, and the command line's values.
fn config(text: &str) {
    if let Ok(file) = FileConfig::parse(text)
        && let Ok(resolved) = file.resolve(Overrides::default(), &environment())
    {
        policy_round_trip(&resolved, &resolved.policy);
    }
    let defaults = defaults();
    for body in [text.to_owned(), policy_body(text)] {
        if let Ok(policy) = defaults.policy_from_toml(&body) {
            policy_round_trip(defaults, &policy);
        }
    }
    // One command-line value per line, in the order of the fields below.
    let mut lines = text.lines().map(str::to_owned);
    let cli = Overrides {
        mode: lines.next(),
        io_engine: lines.next(),
        demote_format: lines.next(),
        debug_io_faults: lines.next(),
        debug_hang: lines.next(),
        device_budget: lines.next().and_then(|t| ByteSize::parse(&t).ok()),
        ..Overrides::default()
    };
    let _ = FileConfig::default().resolve(cli, &environment());
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    sensors(&text);
    for line in text.lines() {
        sensors(line);
        values(line);
    }
    values(&text);
    trigger(data);
    config(&text);
});
