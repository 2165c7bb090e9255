//! Every metric family kvmmd declares moves under a workload that exercises what it measures.
//!
//! One kvmmd on a fake host tree (a laptop on mains at 50 °C) with device, DRAM and flash tiers is
//! scraped through the admin `Metrics` RPC before and after a workload that demotes pages to DRAM
//! (q8 by default, so the quantization error is sampled) and to flash, faults them back from both,
//! hits RESOURCE_EXHAUSTED (an `Extend` past a quota), fails a page's authentication (a flipped
//! byte on flash), enters thermal mode (the zone passes its passive trip) and holds a pin past the
//! pin lease (a client that never unpins its page). The families are
//! listed from the first scrape's `# TYPE` lines, that is from the registry itself, so a family
//! added without a workload that moves it fails this test.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use kvmm_proto::v1::Tier;
use kvmm_tests::{Daemon, fields, spawn_client};

/// One scrape: family name → (sample name with labels → value).
type Scrape = BTreeMap<String, BTreeMap<String, f64>>;

fn write(root: &Path, rel: &str, text: &str) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, format!("{text}\n")).unwrap();
    std::fs::rename(tmp, path).unwrap();
}

/// A desktop on mains with one thermal zone at 50 °C (passive trip 95 °C) and no memory pressure.
fn fake_host(root: &Path) {
    write(root, "sys/class/power_supply/AC/type", "Mains");
    write(root, "sys/class/power_supply/AC/online", "1");
    write(root, "sys/class/thermal/thermal_zone0/type", "x86_pkg_temp");
    write(root, "sys/class/thermal/thermal_zone0/temp", "50000");
    write(root, "sys/class/thermal/thermal_zone0/trip_point_0_temp", "95000");
    write(root, "sys/class/thermal/thermal_zone0/trip_point_0_type", "passive");
    write(
        root,
        "proc/pressure/memory",
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    );
    write(root, "proc/meminfo", "MemTotal:       24684096 kB\nMemAvailable:   20000000 kB\n");
}

fn metrics_text(daemon: &Daemon) -> String {
    daemon.admin(async |mut a| a.metrics(kvmm_proto::v1::MetricsRequest {}).await.unwrap().into_inner().text)
}

/// Parses the Prometheus text format: every sample under the family its `# TYPE` line declared
/// (histograms' `_bucket`, `_sum` and `_count` samples under the histogram).
fn parse(text: &str) -> Scrape {
    let mut out = Scrape::new();
    for line in text.lines() {
        if let Some(decl) = line.strip_prefix("# TYPE ") {
            out.insert(decl.split_whitespace().next().unwrap().to_owned(), BTreeMap::new());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (sample, value) = line.rsplit_once(' ').unwrap();
        let name = sample.split('{').next().unwrap();
        let family =
            [name, name.trim_end_matches("_bucket"), name.trim_end_matches("_sum"), name.trim_end_matches("_count")]
                .into_iter()
                .find(|f| out.contains_key(*f))
                .unwrap_or_else(|| panic!("sample {sample} belongs to no declared family"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("value of {line}"));
        out.get_mut(family).unwrap().insert(sample.to_owned(), value);
    }
    out
}

fn value(scrape: &Scrape, family: &str, sample: &str) -> f64 {
    scrape[family].get(sample).copied().unwrap_or_else(|| panic!("no sample {sample} in {:?}", scrape[family]))
}

/// Offset of the flash record of `(session, layer, block)` (header: magic `KVMMSLT1`, session at
/// byte 24, layer at 32, block at 36; records at 4 KiB boundaries).
fn record_of(flash: &[u8], session: u64, layer: u32, block: u32) -> usize {
    (0..flash.len() / 4096)
        .map(|i| i * 4096)
        .find(|&at| {
            let h = &flash[at..at + 64];
            h.starts_with(b"KVMMSLT1")
                && h[24..32] == session.to_le_bytes()
                && h[32..36] == layer.to_le_bytes()
                && h[36..40] == block.to_le_bytes()
        })
        .expect("the page has a record in the flash file")
}

fn flip_flash_byte(path: &Path, at: usize) {
    let bytes = std::fs::read(path).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[bytes[at] ^ 0x40], at as u64).unwrap();
    file.sync_all().unwrap();
}

#[test]
fn every_declared_metric_moves_under_a_workload() {
    let host = tempfile::tempdir().unwrap();
    fake_host(host.path());
    let flash = tempfile::tempdir().unwrap();
    let host_root = host.path().to_str().unwrap();
    let daemon = Daemon::start_tiered(
        "8MiB",
        flash.path(),
        &["--host-root", host_root, "--policy-interval-ms", "100", "--pin-lease-ms", "200"],
    );
    let (s, _) = daemon.wait_status(Duration::from_secs(10), |s| {
        s.policy.as_ref().is_some_and(|p| p.mode == "performance" && p.mode_changes > 0)
    });
    assert_eq!(s.policy.unwrap().mode, "performance");
    let before = parse(&metrics_text(&daemon));
    assert!(before.len() >= 16, "{before:?}");
    assert_eq!(value(&before, "kvmm_policy_mode", "kvmm_policy_mode{mode=\"performance\"}"), 1.0);

    // Pages to DRAM (q8 outside the sink page and the recent window) and back on a fault.
    let mut a = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "11"]);
    let session_a: u64 = fields(&a.expect_line("appended"))["session"].parse().unwrap();
    assert_eq!(daemon.demote(session_a, Tier::Dram).demoted, 18);
    a.send("check 1");
    a.expect_line("checked");
    // Pages to flash and back on a fault.
    assert_eq!(daemon.demote(session_a, Tier::Flash).demoted, 18);
    a.send("check 1");
    let f = fields(&a.expect_line("checked"));
    assert!(f["formats_seen"].contains("q8:"), "{f:?}");

    // A page that fails authentication: DATA_LOSS for its client.
    let mut b = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "12"]);
    let session_b: u64 = fields(&b.expect_line("appended"))["session"].parse().unwrap();
    assert_eq!(daemon.demote(session_b, Tier::Flash).demoted, 18);
    let path = flash.path().join("kvmm.flash");
    let at = record_of(&std::fs::read(&path).unwrap(), session_b, 1, 2) + 64 + 1000;
    flip_flash_byte(&path, at);
    b.send("check 1");
    let line = b.expect_line("error");
    assert!(line.contains("code=DataLoss"), "{line}");

    // An Extend past a quota: RESOURCE_EXHAUSTED.
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "600", "--quota-tokens", "512"]);
    let e = c.expect_line("error");
    assert_eq!(fields(&e)["code"], "ResourceExhausted", "{e}");

    // Hot: thermal mode.
    write(host.path(), "sys/class/thermal/thermal_zone0/temp", "99000");
    let (s, _) =
        daemon.wait_status(Duration::from_secs(10), |s| s.policy.as_ref().is_some_and(|p| p.mode == "thermal"));
    assert_eq!(s.policy.unwrap().mode, "thermal");

    // A pin held past the lease.
    let mut holder = spawn_client("hold-pin", &daemon, &["--layers", "1"]);
    holder.expect_line("pinned");
    daemon.wait_status(Duration::from_secs(10), |s| s.stuck_pins == 1);

    // A lingering session whose client died.
    let mut gone = spawn_client("raw-attach", &daemon, &["--linger-ms", "60000"]);
    gone.expect_line("attached");
    gone.kill9();
    daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 1);

    let after = parse(&metrics_text(&daemon));
    let declared: BTreeSet<&String> = before.keys().collect();
    assert_eq!(declared, after.keys().collect(), "the registry declares the same families on every scrape");
    let still: Vec<&String> = before.keys().filter(|family| before[*family] == after[*family]).collect();
    assert!(still.is_empty(), "families that did not move: {still:?}\nbefore: {before:#?}\nafter: {after:#?}");

    // And they moved the right way.
    let code =
        |s: &Scrape, c: &str| value(s, "kvmm_rpc_errors_total", &format!("kvmm_rpc_errors_total{{code=\"{c}\"}}"));
    assert!(code(&after, "resource_exhausted") >= code(&before, "resource_exhausted") + 1.0);
    assert!(code(&after, "data_loss") >= code(&before, "data_loss") + 1.0);
    assert_eq!(value(&after, "kvmm_seal_auth_failures_total", "kvmm_seal_auth_failures_total"), 1.0);
    assert_eq!(value(&after, "kvmm_policy_thermal_throttles_total", "kvmm_policy_thermal_throttles_total"), 1.0);
    assert_eq!(value(&after, "kvmm_policy_mode", "kvmm_policy_mode{mode=\"thermal\"}"), 1.0);
    assert_eq!(value(&after, "kvmm_policy_mode", "kvmm_policy_mode{mode=\"performance\"}"), 0.0);
    assert_eq!(value(&after, "kvmm_tier_demotions_total", "kvmm_tier_demotions_total{tier=\"flash\"}"), 36.0);
    assert!(value(&after, "kvmm_tier_promotions_total", "kvmm_tier_promotions_total{tier=\"flash\"}") >= 18.0);
    assert!(value(&after, "kvmm_tier_promotions_total", "kvmm_tier_promotions_total{tier=\"dram\"}") >= 18.0);
    assert!(value(&after, "kvmm_fault_pages_total", "kvmm_fault_pages_total{tier=\"flash\"}") >= 18.0);
    assert!(value(&after, "kvmm_fault_latency_seconds", "kvmm_fault_latency_seconds_count") >= 2.0);
    assert!(
        value(
            &after,
            "kvmm_demotion_quantization_error_ratio",
            "kvmm_demotion_quantization_error_ratio_count{format=\"q8\"}"
        ) >= 1.0
    );
    let engine = daemon.status().io_engine;
    let flash_bytes = |dir: &str| {
        value(
            &after,
            &format!("kvmm_flash_{dir}_bytes_total"),
            &format!("kvmm_flash_{dir}_bytes_total{{engine=\"{engine}\"}}"),
        )
    };
    assert!(flash_bytes("read") > 0.0 && flash_bytes("written") > 0.0);
    // Client a is still attached, its 2 layers × 12 pages (extended 4 at a time) all back on the
    // device, and so is the holder with its one pinned page; the orphan has none.
    assert_eq!(value(&after, "kvmm_daemon_sessions", "kvmm_daemon_sessions"), 3.0);
    assert_eq!(value(&after, "kvmm_daemon_orphaned_sessions", "kvmm_daemon_orphaned_sessions"), 1.0);
    assert_eq!(value(&after, "kvmm_daemon_stuck_pins", "kvmm_daemon_stuck_pins"), 1.0);
    let device_pages: f64 =
        after["kvmm_tier_pages"].iter().filter(|(k, _)| k.contains("tier=\"device\"")).map(|(_, v)| v).sum();
    assert_eq!(device_pages, 25.0);

    // The RPC spans name the session in the lines logged on its behalf.
    let log = daemon.log();
    assert!(log.contains(&format!("Fault{{session={session_b}")) && log.contains("page lost"), "{log}");
    a.send("exit");
    a.expect_line("detached");
    holder.send("exit");
    assert!(daemon.stop().success());
}
