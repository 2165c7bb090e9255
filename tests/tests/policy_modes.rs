//! The policy engine in a real kvmmd that reads a fake host tree (`--host-root`): a battery that
//! starts discharging at 15% puts the daemon in powersave within 2 s and the next demotions use the
//! powersave ladder (q4); a thermal zone past its passive trip point puts it in thermal mode, which
//! cuts the bytes the tier thread migrates per second at least 4×.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use kvmm_proto::v1::{StatusResponse, Tier};
use kvmm_tests::{Daemon, fields, spawn_client};

/// A laptop's sysfs/procfs, as files below a temp dir: mains online, BAT0 charging at 80%, one
/// thermal zone at 50 °C with a passive trip at 95 °C, no memory pressure.
struct FakeHost {
    dir: tempfile::TempDir,
}

impl FakeHost {
    fn laptop() -> FakeHost {
        let host = FakeHost { dir: tempfile::tempdir().unwrap() };
        host.write("sys/class/power_supply/AC/type", "Mains");
        host.write("sys/class/power_supply/AC/online", "1");
        host.write("sys/class/power_supply/BAT0/type", "Battery");
        host.write("sys/class/power_supply/BAT0/present", "1");
        host.write("sys/class/power_supply/BAT0/status", "Charging");
        host.write("sys/class/power_supply/BAT0/capacity", "80");
        host.write("sys/class/thermal/thermal_zone0/type", "x86_pkg_temp");
        host.write("sys/class/thermal/thermal_zone0/temp", "50000");
        host.write("sys/class/thermal/thermal_zone0/trip_point_0_temp", "95000");
        host.write("sys/class/thermal/thermal_zone0/trip_point_0_type", "passive");
        host.write("sys/class/thermal/thermal_zone0/trip_point_1_temp", "105000");
        host.write("sys/class/thermal/thermal_zone0/trip_point_1_type", "critical");
        host.write(
            "proc/pressure/memory",
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        );
        host.write("proc/meminfo", "MemTotal:       24684096 kB\nMemAvailable:   20000000 kB\n");
        host
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    /// Replaces a file the way sysfs changes: the new contents appear at once.
    fn write(&self, rel: &str, text: &str) {
        let path = self.dir.path().join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let tmp = path.with_extension("new");
        std::fs::write(&tmp, format!("{text}\n")).unwrap();
        std::fs::rename(tmp, path).unwrap();
    }
}

fn mode(s: &StatusResponse) -> &str {
    s.policy.as_ref().map_or("", |p| p.mode.as_str())
}

/// Waits for `want` chosen from a reading (before the first one the daemon reports its initial
/// mode with the cause "no reading yet"); returns the status and how long it took.
fn wait_mode(daemon: &Daemon, want: &str) -> (StatusResponse, Duration) {
    let read = |s: &StatusResponse| s.policy.as_ref().is_some_and(|p| p.mode_changes > 0);
    let (s, took) = daemon.wait_status(Duration::from_secs(10), |s| mode(s) == want && read(s));
    assert_eq!(mode(&s), want, "{:?}\nlog:\n{}", s.policy, daemon.log());
    (s, took)
}

/// A client of 2 layers × 1,000 tokens whose 62 full pages the admin `Demote` sends to DRAM, then
/// one checked round of attention over them; returns the client and the formats it read.
fn demoted_client(daemon: &Daemon, seed: &str) -> (kvmm_tests::Worker, String) {
    let mut c = spawn_client("run", daemon, &["--layers", "2", "--tokens", "1000", "--seed", seed]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    assert_eq!(daemon.demote(session, Tier::Dram).demoted, 62);
    c.send("check 1");
    let seen = fields(&c.expect_line("checked"))["formats_seen"].clone();
    (c, seen)
}

#[test]
fn a_battery_discharging_at_15_percent_enters_powersave_within_2_s_and_demotes_as_q4() {
    let host = FakeHost::laptop();
    let root = host.root().to_str().unwrap();
    let daemon = Daemon::start(&[
        "--host-root",
        root,
        "--policy-interval-ms",
        "200",
        "--device-budget",
        "64MiB",
        "--dram-budget",
        "16MiB",
    ]);
    let (s, _) = wait_mode(&daemon, "performance");
    let p = s.policy.unwrap();
    assert!(p.cause.contains("mains"), "{p:?}");
    assert_eq!((p.demote_format.as_str(), p.power.as_str()), ("q8", "mains"), "{p:?}");
    assert_eq!(p.battery, "BAT0 charging 80%");
    assert_eq!(p.thermal.len(), 1);
    assert_eq!((p.thermal[0].celsius, p.thermal[0].passive_trip_celsius), (50.0, 95.0));
    assert!(p.pressure_watch.contains("not procfs"), "a fake tree is polled: {}", p.pressure_watch);

    // On mains: pages leave the device as the configured q8.
    let (before, seen) = demoted_client(&daemon, "3");
    assert!(seen.contains("q8:") && !seen.contains("q4:"), "{seen}");

    // Unplugged, discharging at 15%.
    host.write("sys/class/power_supply/AC/online", "0");
    host.write("sys/class/power_supply/BAT0/capacity", "15");
    host.write("sys/class/power_supply/BAT0/status", "Discharging");
    let (s, took) = wait_mode(&daemon, "powersave");
    assert!(took < Duration::from_secs(2), "powersave after {took:?}");
    let p = s.policy.unwrap();
    assert!(p.cause.contains("BAT0 discharging at 15%"), "{p:?}");
    assert_eq!((p.demote_format.as_str(), p.prefetch_depth, p.power.as_str()), ("q4", 2, "battery"), "{p:?}");
    assert!(daemon.log().contains("powersave"), "the change is logged with its cause");

    // The next demotion uses the powersave ladder: q4, and under adaptive precision by age the
    // newest 17 pages past the 32-token window k8v4 (29 candidates per layer: 12 q4, 17 k8v4);
    // the client's checks (against its own K/V through the same quantizer) still hold.
    let (after, seen) = demoted_client(&daemon, "4");
    assert!(seen.contains("q4:24,") && seen.contains("k8v4:34") && !seen.contains("q8:"), "{seen}");

    // Plugged in again: back to performance.
    host.write("sys/class/power_supply/AC/online", "1");
    host.write("sys/class/power_supply/BAT0/status", "Charging");
    let (s, took) = wait_mode(&daemon, "performance");
    assert!(took < Duration::from_secs(2), "performance after {took:?}");
    assert_eq!(s.policy.unwrap().mode_changes, 3, "start, powersave, performance");
    for mut c in [before, after] {
        c.send("exit");
        c.expect_line("detached");
    }
    assert!(daemon.stop().success());
}

/// Fills the device past its high watermark with a fresh client and measures the tier thread's
/// background migration: bytes moved over the time from the last status before the first move to
/// the first status after the last one (an overestimate of the time, so an underestimate of the
/// rate). Returns (bytes, seconds).
fn measure_background_drain(daemon: &Daemon, seed: &str) -> (u64, f64) {
    let start = daemon.status().background_bytes;
    // 6 layers × 6,700 tokens of SmolLM2-shaped pages (25,408 bytes per 32 tokens): about 95% of
    // the 32 MiB device.
    let mut c = spawn_client(
        "run",
        daemon,
        &["--layers", "6", "--tokens", "6700", "--max-tokens", "8192", "--no-attend", "--seed", seed],
    );
    let mut samples: Vec<(Instant, u64)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut settled_since: Option<Instant> = None;
    loop {
        let now = Instant::now();
        let moved = daemon.status().background_bytes - start;
        if samples.last().is_some_and(|&(_, m)| m == moved) && moved > 0 {
            let since = *settled_since.get_or_insert(now);
            if now - since > Duration::from_millis(500) {
                break;
            }
        } else {
            settled_since = None;
        }
        samples.push((now, moved));
        assert!(now < deadline, "background migration did not settle in 60 s: {:?}", samples.last());
        std::thread::sleep(Duration::from_millis(5));
    }
    c.expect_line("appended");
    c.send("exit");
    c.expect_line("detached");
    let total = samples.last().unwrap().1;
    let began = samples.iter().rev().find(|&&(_, m)| m == 0).unwrap().0;
    let ended = samples.iter().find(|&&(_, m)| m == total).unwrap().0;
    (total, (ended - began).as_secs_f64())
}

#[test]
fn a_zone_past_its_passive_trip_enters_thermal_mode_and_cuts_background_migration_4x() {
    let host = FakeHost::laptop();
    let config = tempfile::NamedTempFile::new().unwrap();
    // Demotion starts at 90% of the device and goes down to 10%: one long drain per fill. Lossless
    // demotion (a copy into DRAM) so the unthrottled drain is fast.
    std::fs::write(config.path(), "[tiers]\nhigh_watermark = 90\nlow_watermark = 10\ndemote_format = \"none\"\n")
        .unwrap();
    let daemon = Daemon::start(&[
        "--config",
        config.path().to_str().unwrap(),
        "--host-root",
        host.root().to_str().unwrap(),
        "--policy-interval-ms",
        "200",
        "--device-budget",
        "32MiB",
        "--dram-budget",
        "64MiB",
        "--compaction-interval-ms",
        "0",
    ]);
    let (s, _) = wait_mode(&daemon, "performance");
    assert_eq!(s.policy.unwrap().background_limit_bytes_per_s, 0, "unlimited on mains");
    let (cool_bytes, cool_secs) = measure_background_drain(&daemon, "21");

    host.write("sys/class/thermal/thermal_zone0/temp", "97000");
    let (s, took) = wait_mode(&daemon, "thermal");
    assert!(took < Duration::from_secs(2), "thermal after {took:?}");
    let p = s.policy.unwrap();
    assert!(p.cause.contains("thermal_zone0 (x86_pkg_temp) at 97.0 °C"), "{p:?}");
    assert_eq!(p.prefetch_depth, 1);
    assert!(p.background_limit_bytes_per_s > 0, "{p:?}");
    let (hot_bytes, hot_secs) = measure_background_drain(&daemon, "22");

    let cool_rate = cool_bytes as f64 / cool_secs;
    let hot_rate = hot_bytes as f64 / hot_secs;
    eprintln!(
        "background migration: performance {:.1} MiB/s ({cool_bytes} B in {cool_secs:.3} s), thermal {:.1} MiB/s \
         ({hot_bytes} B in {hot_secs:.3} s), cut {:.1}×",
        cool_rate / 1048576.0,
        hot_rate / 1048576.0,
        cool_rate / hot_rate
    );
    assert!(cool_bytes > 16 << 20 && hot_bytes > 16 << 20, "both fills drained most of the device");
    assert!(cool_rate >= 4.0 * hot_rate, "thermal mode must cut background migration at least 4×");
    assert!(daemon.stop().success());
}

/// Reads `read` until `done` holds of the value or 10 s pass; returns the last value.
fn wait_for(read: impl Fn() -> u64, done: impl Fn(u64) -> bool) -> u64 {
    let start = Instant::now();
    loop {
        let v = read();
        if done(v) || start.elapsed() > Duration::from_secs(10) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn device(s: &StatusResponse) -> (u64, u64) {
    let t = s.tiers.iter().find(|t| t.tier == "device").unwrap();
    (t.budget_bytes, t.used_bytes)
}

#[test]
fn memory_pressure_shrinks_the_budgets_gives_memory_back_and_grows_back() {
    let host = FakeHost::laptop();
    let flash = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(&[
        "--host-root",
        host.root().to_str().unwrap(),
        "--policy-interval-ms",
        "200",
        "--device-budget",
        "64MiB",
        "--dram-budget",
        "8MiB",
        "--flash-budget",
        "128MiB",
        "--flash-dir",
        flash.path().to_str().unwrap(),
    ]);
    wait_mode(&daemon, "performance");
    // 6 layers × 11,500 tokens of SmolLM2-shaped pages: about 55 MB, under the 90% watermark.
    let mut c = spawn_client(
        "run",
        &daemon,
        &["--layers", "6", "--tokens", "11500", "--max-tokens", "16384", "--no-attend", "--seed", "31"],
    );
    c.expect_line("appended");
    let (budget, used_before) = device(&daemon.status());
    assert_eq!(budget, 64 << 20);
    assert!(used_before > 50 << 20, "{used_before}");
    std::thread::sleep(Duration::from_millis(500));
    let held_before = daemon.memfd_allocated();

    host.write(
        "proc/pressure/memory",
        "some avg10=42.00 avg60=10.00 avg300=2.00 total=123456\nfull avg10=8.00 avg60=1.00 avg300=0.10 total=2345\n",
    );
    let (s, took) = daemon.wait_status(Duration::from_secs(10), |s| {
        s.policy.as_ref().is_some_and(|p| p.memory_pressure) && device(s).1 <= (32 << 20) / 100 * 90
    });
    let p = s.policy.clone().unwrap();
    assert!(p.memory_pressure && p.cause.contains("stalled 42.0%"), "{p:?}\n{}", daemon.log());
    assert_eq!((p.device_budget_percent, device(&s).0), (50, 32 << 20), "{p:?}");
    let used_after = device(&s).1;
    assert!(used_after <= (32 << 20) / 100 * 90, "demoted under the shrunk budget in {took:?}: {used_after}");
    // The memory behind the freed frames goes back to the system: the daemon's memfds hold about
    // the bytes that left the device fewer (they went to flash; DRAM is shrunk too). Counted as
    // allocated memfd blocks, not the daemon's Rss, which misses pages only the client touched and
    // moves with the tier thread's heap scratch.
    let freed = used_before - used_after;
    let held_after = wait_for(|| daemon.memfd_allocated(), |held| held_before.saturating_sub(held) >= freed / 2);
    eprintln!(
        "memory pressure: device used {used_before} -> {used_after} B; kvmmd memfds hold {held_before} -> {held_after} B"
    );
    assert!(held_before.saturating_sub(held_after) >= freed / 2, "memfds {held_before} -> {held_after}, freed {freed}");

    // Pressure clears: the budgets come back and the client's pages can come back to the device.
    host.write(
        "proc/pressure/memory",
        "some avg10=0.50 avg60=5.00 avg300=2.00 total=123999\nfull avg10=0.00 avg60=1.00 avg300=0.10 total=2345\n",
    );
    let (s, _) = daemon.wait_status(Duration::from_secs(10), |s| {
        s.policy.as_ref().is_some_and(|p| !p.memory_pressure) && device(s).0 == 64 << 20
    });
    assert_eq!(device(&s).0, 64 << 20, "{:?}", s.policy);
    let held_base = daemon.memfd_allocated();
    c.send("prefetch");
    let f = fields(&c.expect_line("prefetched"));
    assert!(f["scheduled"].parse::<u64>().unwrap() > 0, "{f:?}");
    let (s, _) = daemon.wait_status(Duration::from_secs(20), |s| device(s).1 > used_after + (8 << 20));
    let used_back = device(&s).1;
    assert!(used_back > used_after + (8 << 20), "the pages (now q8) came back to the device: {:?}", device(&s));
    // Memory grows back with them: at least half the bytes that came back to the device.
    let came_back = used_back - used_after;
    let held_grown = wait_for(|| daemon.memfd_allocated(), |held| held.saturating_sub(held_base) >= came_back / 2);
    eprintln!(
        "after pressure: device used {used_after} -> {used_back} B; kvmmd memfds hold {held_base} -> {held_grown} B"
    );
    assert!(
        held_grown.saturating_sub(held_base) >= came_back / 2,
        "memfds {held_base} -> {held_grown}, came back {came_back}"
    );
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

#[test]
fn under_pressure_a_background_sessions_pages_leave_the_device_before_a_foreground_ones() {
    let host = FakeHost::laptop();
    let daemon = Daemon::start(&[
        "--host-root",
        host.root().to_str().unwrap(),
        "--policy-interval-ms",
        "200",
        "--device-budget",
        "32MiB",
        "--dram-budget",
        "32MiB",
    ]);
    wait_mode(&daemon, "performance");
    // Two sessions of about 12 MB each: 6 layers × 2,600 tokens (81 full pages per layer). The
    // foreground one attaches and writes first, so by age alone its pages would go first.
    let args = |priority: &'static str, seed: &'static str| {
        vec!["--layers", "6", "--tokens", "2600", "--no-attend", "--seed", seed, "--priority", priority]
    };
    let mut fg = spawn_client("run", &daemon, &args("foreground", "41"));
    fg.expect_line("appended");
    let mut bg = spawn_client("run", &daemon, &args("background", "42"));
    bg.expect_line("appended");
    let pages = |c: &mut kvmm_tests::Worker| {
        c.send("stats");
        let f = fields(&c.expect_line("stats"));
        (f["device_pages"].parse::<u64>().unwrap(), f["dram_pages"].parse::<u64>().unwrap())
    };
    let (fg_before, bg_before) = (pages(&mut fg), pages(&mut bg));
    assert_eq!((fg_before.1, bg_before.1), (0, 0));

    // Pressure halves the budget to 16 MiB; the drain to its low watermark (12.8 MiB) must move
    // about 11 MB, less than the background session holds.
    host.write("proc/pressure/memory", "some avg10=30.00 avg60=3.00 avg300=1.00 total=9999\n");
    let (s, _) = daemon.wait_status(Duration::from_secs(10), |s| device(s).1 <= (16 << 20) / 100 * 90);
    assert!(device(&s).1 <= (16 << 20) / 100 * 90, "{:?}", device(&s));
    let (fg_after, bg_after) = (pages(&mut fg), pages(&mut bg));
    eprintln!("device pages: foreground {fg_before:?} -> {fg_after:?}, background {bg_before:?} -> {bg_after:?}");
    assert_eq!(fg_after, fg_before, "the foreground session kept every page on the device");
    assert!(bg_after.0 < bg_before.0 && bg_after.1 > 0, "the background session's pages went to DRAM");
    for mut c in [fg, bg] {
        c.send("exit");
        c.expect_line("detached");
    }
    assert!(daemon.stop().success());
}

#[test]
fn sighup_and_the_reload_rpc_apply_a_new_policy_at_once_and_a_bad_one_changes_nothing() {
    let host = FakeHost::laptop();
    host.write("sys/class/power_supply/AC/online", "0");
    host.write("sys/class/power_supply/BAT0/status", "Discharging");
    host.write("sys/class/power_supply/BAT0/capacity", "10");
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), "[policy]\nmode = \"performance\"\n").unwrap();
    let daemon = Daemon::start(&[
        "--config",
        config.path().to_str().unwrap(),
        "--host-root",
        host.root().to_str().unwrap(),
        "--policy-interval-ms",
        "5000",
    ]);
    let (s, _) = wait_mode(&daemon, "performance");
    assert!(s.policy.unwrap().cause.contains("pinned"));

    // SIGHUP with the pin removed: powersave from the last reading, without waiting for the next.
    std::fs::write(config.path(), "[policy]\nmode = \"auto\"\npowersave_below = 15\n").unwrap();
    daemon.signal(rustix::process::Signal::HUP);
    let (s, took) = wait_mode(&daemon, "powersave");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(s.policy.unwrap().cause.contains("BAT0 discharging at 10% (powersave at or below 15%)"));

    // A policy that does not validate is refused with the reason, and nothing changes.
    std::fs::write(config.path(), "[policy]\nmode = \"turbo\"\n").unwrap();
    let err = daemon.reload_policy().unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("\"turbo\" is not a mode"), "{}", err.message());
    daemon.signal(rustix::process::Signal::HUP);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(mode(&daemon.status()), "powersave");
    assert!(daemon.log().contains("policy reload refused"), "{}", daemon.log());

    // The RPC answers with the policy in force.
    std::fs::write(config.path(), "[policy]\nmode = \"thermal\"\n").unwrap();
    let p = daemon.reload_policy().unwrap().policy.unwrap();
    assert_eq!((p.mode.as_str(), p.prefetch_depth), ("thermal", 1), "{p:?}");
    std::fs::remove_file(config.path()).unwrap();
    let err = daemon.reload_policy().unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{}", err.message());
    assert!(daemon.stop().success());
}
