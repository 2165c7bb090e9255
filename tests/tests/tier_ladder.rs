//! The tier ladder with real processes: pages travel device → DRAM → flash (sealed, through the real
//! I/O engine) and back while clients keep running.
//!
//! - With compression off, pages forced down to flash and faulted back give bit-identical attention
//!   outputs (the lossless ladder), on both I/O engines.
//! - With the default q8 demotion, outputs stay equal to a reference over the client's own K/V
//!   passed through the same quantizer, and the sink page and the last 128 tokens stay f16.
//! - Three clients whose KV is 4× the device budget and 2× device + DRAM run 2,000-token workloads
//!   with attention on every layer at every step: all complete with every output checked, nobody
//!   gets RESOURCE_EXHAUSTED, and the tier counters add up to the pages.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvmm_proto::v1::Tier;
use kvmm_tests::{Daemon, Worker, admin_status, fields, spawn_client};

/// A SmolLM2-shaped f16 page: 3 KV heads × 64 channels × 32 tokens, with header and bounds.
const PAGE_BYTES: u64 = 25_408;

fn start(flash_dir: &std::path::Path, extra: &[&str]) -> Daemon {
    let mut args = vec!["--flash-dir", flash_dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

/// A daemon with room to spare in every tier (64 MiB device, 16 MiB DRAM and flash), so pages move
/// only when a test moves them, plus `extra`.
fn start_roomy(flash_dir: &std::path::Path, extra: &[&str]) -> Daemon {
    Daemon::start_tiered("64MiB", flash_dir, extra)
}

fn lossless_ladder_on(engine: &str) {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start_roomy(flash.path(), &["--demote-format", "none", "--io-engine", engine]);
    let status = daemon.status();
    assert_eq!(status.io_engine, engine, "fallback: {}", status.io_fallback);
    // 300 tokens per layer: 9 full pages and a tail of 12 tokens in each of 2 layers.
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "5"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    c.send("digest");
    let before = fields(&c.expect_line("digest"));
    assert_eq!(before["flash_pages"], "0");

    let r = daemon.demote(session, Tier::Flash);
    assert_eq!(r.demoted, 18, "every full page went down: {r:?}");
    c.send("stats");
    let down = fields(&c.expect_line("stats"));
    assert_eq!((down["flash_pages"].as_str(), down["device_pages"].as_str()), ("18", "6"), "{down:?}");

    // Attention faults the pages back in transparently, and reads exactly the same bits.
    c.send("digest");
    let after = fields(&c.expect_line("digest"));
    assert_eq!(after["value"], before["value"], "bit-identical after device → dram → flash → device");
    assert!(after["faults"].parse::<u64>().unwrap() >= 18, "{after:?}");
    assert_eq!(after["promoted_flash"], "18", "{after:?}");
    assert_eq!(after["flash_pages"], "0");
    // And the regular checks against the reference still hold.
    c.send("check 2");
    c.expect_line("checked");
    let s = daemon.status();
    assert_eq!((s.demoted_to_flash, s.promoted_from_flash), (18, 18), "{s:?}");
    let flash_tier = s.tiers.iter().find(|t| t.tier == "flash").unwrap();
    assert_eq!((flash_tier.pages_in, flash_tier.pages_out, flash_tier.used_bytes), (18, 18, 0));
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

#[test]
fn pages_forced_to_flash_and_back_are_bit_identical_on_io_uring() {
    lossless_ladder_on("io_uring");
}

#[test]
fn pages_forced_to_flash_and_back_are_bit_identical_on_pread() {
    lossless_ladder_on("pread");
}

#[test]
fn pages_demoted_as_q8_decode_as_the_quantizer_says() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start_roomy(flash.path(), &[]);
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "6"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    let r = daemon.demote(session, Tier::Dram);
    assert_eq!(r.demoted, 18, "{r:?}");
    // Every check compares with the client's own K/V quantized to q8 for the pages read as q8.
    c.send("check 3");
    let f = fields(&c.expect_line("checked"));
    // Of each layer's 9 full pages only blocks 1..=4 are q8: the sink page (0) and the pages of the
    // last 128 tokens (5..=8) were demoted at the client's precision. 3 rounds × 2 layers × 4.
    assert!(f["formats_seen"].contains("q8:24"), "{f:?}");
    let s = daemon.status();
    let dram = s.tiers.iter().find(|t| t.tier == "dram").unwrap();
    assert!(dram.pages_in >= 18 && s.promoted_from_dram >= 18, "{s:?}");
    // q8 pages are smaller: 18 of them back on the device take less than 18 f16 pages.
    c.send("stats");
    let f = fields(&c.expect_line("stats"));
    assert!(f["device_bytes"].parse::<u64>().unwrap() < 24 * PAGE_BYTES, "{f:?}");
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

#[test]
fn three_clients_at_four_times_the_device_budget_all_complete() {
    oversubscribed("none");
}

/// The same with pages demoted as q8 (each output checked against the client's own K/V quantized as
/// the daemon did). Frames of two sizes share the arena here, so room is also made against
/// fragmentation (a regression: Extend was refused with 768 KB free in holes smaller than a page).
#[test]
fn three_clients_at_four_times_the_device_budget_complete_on_the_q8_ladder() {
    oversubscribed("q8");
}

fn oversubscribed(demote_format: &str) {
    // Per client: 6 layers × 63 pages (2,000 tokens) of 25,408 bytes = 9.6 MB; 28.8 MB for three.
    // The device holds a quarter of it and the DRAM pool another quarter; the rest goes to flash.
    let total = 3 * 6 * 63 * PAGE_BYTES;
    let quarter = (total / 4).to_string();
    let flash = tempfile::tempdir().unwrap();
    let daemon = start(
        flash.path(),
        &[
            "--device-budget",
            &quarter,
            "--dram-budget",
            &quarter,
            "--flash-budget",
            "64MiB",
            "--demote-format",
            demote_format,
        ],
    );
    let mut clients: Vec<_> = (0..3u64)
        .map(|i| {
            let seed = (40 + i).to_string();
            spawn_client(
                "run",
                &daemon,
                &["--layers", "6", "--tokens", "2000", "--max-tokens", "2048", "--seed", &seed],
            )
        })
        .collect();
    // While pages move, every Status must be one snapshot: each tier's pages by format add up to
    // its page count (kvmmctl status once showed 550 device pages beside a census of 604).
    let watching = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (watching, socket) = (watching.clone(), daemon.dir().join("kvmm-admin.sock"));
        std::thread::spawn(move || {
            let (mut polls, mut torn) = (0, Vec::new());
            while watching.load(std::sync::atomic::Ordering::Relaxed) {
                for t in admin_status(&socket).tiers {
                    if t.by_format.iter().map(|f| f.pages).sum::<u64>() != t.pages {
                        torn.push(format!("{t:?}"));
                    }
                }
                polls += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            (polls, torn)
        })
    };
    let mut pages = 0;
    for c in &mut clients {
        let line = c.expect_line("appended");
        println!("{line}");
        let f = fields(&line);
        assert_eq!(f["tokens"], "2000");
        assert!(f["worst_rel_err"].parse::<f64>().unwrap() <= 1e-3, "{f:?}");
        for tier in ["device_pages", "dram_pages", "flash_pages"] {
            pages += f[tier].parse::<u64>().unwrap();
        }
    }
    watching.store(false, std::sync::atomic::Ordering::Relaxed);
    let (polls, torn) = watcher.join().unwrap();
    println!("{polls} Status calls while pages moved");
    assert!(polls >= 10 && torn.is_empty(), "{} of {polls} Status calls were torn: {torn:?}", torn.len());
    let s = daemon.status();
    println!("{s:?}");
    let tier_pages: u64 = s.tiers.iter().map(|t| t.pages).sum();
    assert_eq!(tier_pages, 3 * 6 * 64, "every page of every session is in exactly one tier");
    assert!(pages >= tier_pages - 3, "the clients' own counts agree (taken at slightly different times)");
    assert!(s.demoted_to_flash > 0 && s.promoted_from_flash > 0, "pages went to flash and came back: {s:?}");
    for t in &s.tiers {
        assert!(t.used_bytes <= t.budget_bytes, "{t:?}");
    }
    for c in &mut clients {
        c.send("exit");
        c.expect_line("detached");
        assert!(c.wait(Duration::from_secs(20)).success());
    }
    let s = daemon.wait_drained();
    for t in &s.tiers {
        assert_eq!((t.used_bytes, t.pages), (0, 0), "everything returned: {t:?}");
    }
    assert!(daemon.stop().success());
}

/// Offset of the flash record holding page `(layer, block)`, found by its header (magic
/// `KVMMSLT1`, layer at byte 32, block at byte 36, records at 4 KiB boundaries).
fn record_of(flash: &[u8], layer: u32, block: u32) -> usize {
    (0..flash.len() / 4096)
        .map(|i| i * 4096)
        .find(|&at| {
            let h = &flash[at..at + 64];
            h.starts_with(b"KVMMSLT1") && h[32..36] == layer.to_le_bytes() && h[36..40] == block.to_le_bytes()
        })
        .expect("the page has a record in the flash file")
}

#[test]
fn a_flipped_byte_on_flash_is_data_loss_for_that_page_and_the_daemon_serves_on() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start_roomy(flash.path(), &["--demote-format", "none"]);
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "7"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    assert_eq!(daemon.demote(session, Tier::Flash).demoted, 18);
    let path = flash.path().join("kvmm.flash");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = record_of(&bytes, 1, 2) + 64 + 1000;
    bytes[at] ^= 0x40;
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &bytes[at..at + 1], at as u64).unwrap();
    file.sync_all().unwrap();

    // Layer 0 faults back intact; layer 1 holds the changed page: DATA_LOSS naming it.
    c.send("check 1");
    let line = c.expect_line("error");
    assert!(line.contains("code=DataLoss"), "{line}");
    assert!(line.contains("page 2 of layer 1"), "the error names the page: {line}");
    let s = daemon.status();
    let flash_tier = s.tiers.iter().find(|t| t.tier == "flash").unwrap();
    assert_eq!(flash_tier.auth_failures, 1, "{s:?}");
    // The daemon serves others as before.
    let mut other = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "100", "--seed", "8"]);
    other.expect_line("appended");
    other.send("exit");
    other.expect_line("detached");
    assert!(daemon.stop().success());
}

#[test]
fn a_prefetch_hint_brings_pages_back_without_faults() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start_roomy(flash.path(), &["--demote-format", "none"]);
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "9"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    c.send("digest");
    let before = fields(&c.expect_line("digest"));
    assert_eq!(daemon.demote(session, Tier::Flash).demoted, 18);
    c.send("prefetch");
    let f = fields(&c.expect_line("prefetched"));
    assert_eq!(f["scheduled"], "18", "{f:?}");
    // The tier task promotes them in the background.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        c.send("stats");
        let s = fields(&c.expect_line("stats"));
        if s["flash_pages"] == "0" && s["dram_pages"] == "0" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "prefetch did not finish: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    c.send("digest");
    let after = fields(&c.expect_line("digest"));
    assert_eq!(after["value"], before["value"]);
    assert_eq!(after["faults"], before["faults"], "no page had to be faulted");
    assert_eq!(after["promoted_flash"], "18", "the prefetch promoted them: {after:?}");
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

#[test]
fn a_canary_written_through_the_client_is_nowhere_in_the_flash_file() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start_roomy(flash.path(), &["--demote-format", "none"]);
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "10", "--canary"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    assert_eq!(daemon.demote(session, Tier::Flash).demoted, 18);
    let bytes = std::fs::read(flash.path().join("kvmm.flash")).unwrap();
    let records = (0..bytes.len() / 4096).filter(|i| bytes[i * 4096..].starts_with(b"KVMMSLT1")).count();
    assert_eq!(records, 18, "the pages are in the file");
    // Every value row of those pages holds the canary; none of it may be readable on flash.
    assert!(!bytes.windows(8).any(|w| w == b"KVMM-CAN"), "plaintext K/V found in the flash file");
    // And the pages come back exactly (the canary round-trips through the seal).
    c.send("check 1");
    c.expect_line("checked");
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

#[test]
fn injected_flash_errors_fail_only_their_pages_and_leak_nothing() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start_roomy(flash.path(), &["--demote-format", "none", "--debug-io-faults", "write:EIO:1,read:EIO:1"]);
    let mut a = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "11"]);
    let mut b = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "12"]);
    let sa: u64 = fields(&a.expect_line("appended"))["session"].parse().unwrap();
    let sb: u64 = fields(&b.expect_line("appended"))["session"].parse().unwrap();
    b.send("digest");
    let b_before = fields(&b.expect_line("digest"));

    // The first flash write fails: the pages stay in DRAM, counted once, and a retry lands.
    assert_eq!(daemon.demote(sa, Tier::Flash).demoted, 0);
    let s = daemon.status();
    let flash_tier = s.tiers.iter().find(|t| t.tier == "flash").unwrap();
    assert_eq!((flash_tier.io_failures, flash_tier.pages, flash_tier.used_bytes), (18, 0, 0), "{s:?}");
    assert_eq!(s.tiers.iter().find(|t| t.tier == "dram").unwrap().pages, 18);
    assert_eq!(daemon.demote(sa, Tier::Flash).demoted, 18);
    assert_eq!(daemon.demote(sb, Tier::Flash).demoted, 18);

    // The first flash read fails: A's fault reports it (INTERNAL, naming the read), B is untouched.
    a.send("digest");
    let line = a.expect_line("error");
    assert!(line.contains("code=Internal") && line.contains("read of"), "{line}");
    b.send("digest");
    let b_after = fields(&b.expect_line("digest"));
    assert_eq!(b_after["value"], b_before["value"], "the other session lost nothing");

    // A's process is gone: its session is destroyed, and nothing of it stays in any tier (the
    // frames taken for its failed read were given back).
    let (s, _) = daemon.wait_status(Duration::from_secs(5), |s| s.sessions == 1);
    let pages: u64 = s.tiers.iter().map(|t| t.pages).sum();
    // 300 tokens take 10 pages per layer, allocated in batches of 4: 12 blocks × 2 layers.
    assert_eq!(pages, 2 * 12, "B's pages only: {s:?}");
    assert_eq!(s.tiers[0].used_bytes, s.session_bytes);
    b.send("exit");
    b.expect_line("detached");
    let s = daemon.wait_drained();
    for t in &s.tiers {
        assert_eq!((t.used_bytes, t.pages), (0, 0), "{t:?}");
    }
    assert!(daemon.stop().success());
}

/// A regression: with the device full of pages that were not full (each layer's tail page and the
/// empty pages `Extend` reserves ahead of it), a `Fault` or `Extend` found no victim and failed
/// with RESOURCE_EXHAUSTED while DRAM and flash had room (four SmolLM2 processes on an 8 MiB
/// device, `infer/demo.sh`). Such pages are now taken when full ones are not enough: empty ones
/// first, then tails, each demoted at the client's precision and faulted back when written.
#[test]
fn tail_and_reserved_pages_give_way_when_no_full_page_is_left() {
    // Per client: 16 layers × (4 full pages, a tail of 22 tokens and 3 reserved pages) = 128 pages
    // the old victim rule could not take; 384 for three, on a device of 100 pages.
    let device = (100 * PAGE_BYTES).to_string();
    let flash = tempfile::tempdir().unwrap();
    let daemon = start(
        flash.path(),
        &["--device-budget", &device, "--dram-budget", "64MiB", "--flash-budget", "64MiB", "--demote-format", "none"],
    );
    let mut clients: Vec<_> = (0..3u64)
        .map(|i| {
            let seed = (70 + i).to_string();
            spawn_client("run", &daemon, &["--layers", "16", "--tokens", "150", "--seed", &seed])
        })
        .collect();
    for c in &mut clients {
        let f = fields(&c.expect_line("appended"));
        assert_eq!(f["tokens"], "150");
        assert!(f["worst_rel_err"].parse::<f64>().unwrap() <= 1e-3, "{f:?}");
    }
    let s = daemon.status();
    assert!(s.demoted_to_dram > 0, "the device was oversubscribed: {s:?}");
    let device_tier = s.tiers.iter().find(|t| t.tier == "device").unwrap();
    assert!(device_tier.used_bytes <= device_tier.budget_bytes, "{device_tier:?}");
    for c in &mut clients {
        c.send("check 1");
        c.expect_line("checked");
        c.send("exit");
        c.expect_line("detached");
        assert!(c.wait(Duration::from_secs(20)).success());
    }
    assert!(daemon.stop().success());
}

/// Found by `kvmm-soak`: while a fault's flash read runs (without the core lock), the device frames
/// it reserved for the pages count in the pool's `used` and `frames` but in no page table, and
/// `Status` broke `used_bytes == session_bytes` (17 frames, 282,176 bytes, in one soak check).
/// `Status` reports them now (`reserved_frames`, `reserved_bytes`), and the accounting adds up at
/// every moment: here, seen from inside the read, held open by a pausing fail point.
#[test]
fn frames_reserved_for_a_flash_read_are_accounted_while_it_runs() {
    let flash = tempfile::tempdir().unwrap();
    let mut kvmmd = kvmm_tests::kvmmd_command();
    kvmmd.env("KVMM_FAILPOINT", "promote-after-read:1:pause-3000");
    let flash_dir = flash.path().to_str().unwrap();
    let args = [
        "--device-budget",
        "64MiB",
        "--dram-budget",
        "16MiB",
        "--flash-budget",
        "16MiB",
        "--flash-dir",
        flash_dir,
        "--demote-format",
        "none",
    ];
    let daemon = Daemon::start_with(kvmmd, None, &args);
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "21"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    assert_eq!(daemon.demote(session, Tier::Flash).demoted, 18);

    // Attention over layer 0 faults its 9 full pages back from flash; the read pauses.
    c.send("check 1");
    let (s, waited) = daemon.wait_status(Duration::from_secs(20), |s| s.tiers[0].reserved_frames > 0);
    let device = &s.tiers[0];
    assert_eq!(device.reserved_frames, 9, "one layer's pages are on their way back after {waited:?}: {s:?}");
    assert_eq!(device.reserved_bytes, 9 * PAGE_BYTES, "a frame per page, as large as the page: {s:?}");
    assert_eq!(device.used_bytes, s.session_bytes + device.reserved_bytes, "{s:?}");
    assert_eq!(device.frames, device.pages + device.reserved_frames, "{s:?}");

    // Published: nothing reserved, and the plain equality again.
    let checked = fields(&c.expect_line("checked"));
    assert!(checked["worst_rel_err"].parse::<f64>().unwrap() <= 1e-3, "{checked:?}");
    let s = daemon.status();
    assert_eq!((s.tiers[0].reserved_frames, s.tiers[0].reserved_bytes), (0, 0), "{s:?}");
    assert_eq!(s.tiers[0].used_bytes, s.session_bytes, "{s:?}");
    assert!(daemon.log().contains("kvmmd pauses here"), "the fail point paused the read");
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

/// A lossless daemon (configuration file `toml`, device, DRAM and flash budgets `budgets`, flash
/// file in `flash`) whose first flash write pauses `pause_ms` after the core lock is released
/// (fail point `flash-before-write`).
fn start_with_a_paused_flash_write(flash: &std::path::Path, toml: &str, pause_ms: u32, budgets: [&str; 3]) -> Daemon {
    let config = flash.join("kvmm.toml");
    std::fs::write(&config, toml).unwrap();
    let mut kvmmd = kvmm_tests::kvmmd_command();
    kvmmd.env("KVMM_FAILPOINT", format!("flash-before-write:1:pause-{pause_ms}"));
    let [device, dram, flash_budget] = budgets;
    let args = [
        "--config",
        config.to_str().unwrap(),
        "--device-budget",
        device,
        "--dram-budget",
        dram,
        "--flash-budget",
        flash_budget,
        "--flash-dir",
        flash.to_str().unwrap(),
        "--demote-format",
        "none",
    ];
    Daemon::start_with(kvmmd, None, &args)
}

/// Has the client check its last two steps' outputs against its reference and asserts the worst
/// relative error is at most `max`.
fn check_within(c: &mut Worker, max: f64) {
    c.send("check 2");
    let checked = fields(&c.expect_line("checked"));
    assert!(checked["worst_rel_err"].parse::<f64>().unwrap() <= max, "worst error over {max}: {checked:?}");
}

/// Waits until the paused fail point is reached; fails with `why()` after `limit`.
fn wait_for_the_pause(daemon: &Daemon, limit: Duration, why: impl Fn() -> String) {
    let started = std::time::Instant::now();
    while !daemon.log().contains("kvmmd pauses here") {
        assert!(started.elapsed() < limit, "{}", why());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// When a request needs device room and the DRAM pool is full, its pages go on to flash without the
/// core lock: while one client's `Extend` waits on that write, others are served. The fail point
/// pauses the write for 5 s with the lock released; a `Status` (which takes the core lock) must come
/// back long before the pause ends. Background draining is off (watermarks at 100%), so the only
/// DRAM → flash moves are those of requests that wait on room.
#[test]
fn a_request_that_pushes_dram_pages_to_flash_does_not_hold_the_core_lock_during_the_write() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start_with_a_paused_flash_write(
        flash.path(),
        "[tiers]\nhigh_watermark = 100\nlow_watermark = 99\n",
        5000,
        ["2MiB", "512KiB", "16MiB"],
    );
    // 8 layers × 1,200 tokens: 304 pages against about 80 device frames and 20 DRAM pages.
    let mut c =
        spawn_client("run", &daemon, &["--layers", "8", "--tokens", "1200", "--attend-every", "64", "--seed", "8"]);

    wait_for_the_pause(&daemon, Duration::from_secs(60), || {
        format!("no request pushed DRAM pages to flash:\n{}", daemon.log())
    });
    let asked = std::time::Instant::now();
    let s = daemon.status();
    let waited = asked.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "Status waited {waited:?} for the core lock while a flash write was paused: {s:?}"
    );

    // The paused write completes, the client finishes its appends and its checks hold.
    c.expect_line("appended");
    check_within(&mut c, 1e-3);
    let s = daemon.status();
    assert!(s.tiers[2].pages > 0, "pages reached flash: {s:?}");
    assert_eq!(s.tiers[0].used_bytes, s.session_bytes + s.tiers[0].reserved_bytes, "{s:?}");
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

/// Two moves to flash running at once (the flash drain, and a request or the tier mover making
/// room when DRAM is full) never take the same DRAM page: a page one of them is sealing and writing
/// is outbound, and the other picks other pages. Before, both picked the coldest pages, so a page
/// was written twice (one copy thrown away at commit) and counted as room twice. The first flash
/// write is paused 3 s while the client's appends fill the device and DRAM (watermarks 50/25:
/// device 80 frames, DRAM 20 pages; 8 layers × 1,200 tokens, 304 pages). With no attention (no
/// faults, no promotions) and no session ending, every flash write must end in a committed move:
/// flash `pages_in` equals `demoted_to_flash` once all is still.
#[test]
fn two_moves_to_flash_at_once_never_write_the_same_page_twice() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start_with_a_paused_flash_write(
        flash.path(),
        "[tiers]\nhigh_watermark = 50\nlow_watermark = 25\n[policy]\nmode = \"balanced\"\n",
        3000,
        ["2MiB", "512KiB", "16MiB"],
    );
    let mut c = spawn_client(
        "run",
        &daemon,
        &["--layers", "8", "--tokens", "1200", "--attend-every", "1000000", "--seed", "10"],
    );
    wait_for_the_pause(&daemon, Duration::from_secs(60), || {
        format!("no page was moved to flash: {:?}\n{}", daemon.status(), daemon.log())
    });
    let paused = std::time::Instant::now();
    c.expect_line("appended");
    // Still: the paused write is over and two readings 300 ms apart agree.
    std::thread::sleep(Duration::from_millis(3000).saturating_sub(paused.elapsed()));
    let mut last = daemon.status();
    let s = loop {
        std::thread::sleep(Duration::from_millis(300));
        let s = daemon.status();
        let key = |s: &kvmm_proto::v1::StatusResponse| (s.tiers[2].pages_in, s.demoted_to_flash, s.tiers[1].pages_in);
        if key(&s) == key(&last) {
            break s;
        }
        assert!(paused.elapsed() < Duration::from_secs(60), "the tiers never settled: {s:?}");
        last = s;
    };
    assert!(s.demoted_to_flash > 0, "{s:?}");
    assert_eq!(
        s.tiers[2].pages_in,
        s.demoted_to_flash,
        "flash writes that ended in no move (a page written twice): {s:?}\n{}",
        daemon.log()
    );
    eprintln!("flash pages written {}, moved {}", s.tiers[2].pages_in, s.demoted_to_flash);
    check_within(&mut c, 1e-5);
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

/// Background demotion into DRAM goes on while the flash drain seals and writes DRAM pages: the
/// drain runs on a thread of its own, so the tier mover is not stuck behind its I/O. The first
/// flash write is paused 6 s (fail point); meanwhile the client's appends push the device past its
/// high watermark again, and the tier mover must move them down (its background bytes grow while
/// no page has reached flash yet). Watermarks 50/25: device 160 frames (drained at 80, down to 40),
/// DRAM 328 pages (drained to flash past 164); 8 layers × 1,000 tokens then 400 more: 256 + 104
/// pages, which fit in device + DRAM without the paused write.
#[test]
fn the_tier_mover_keeps_demoting_into_dram_while_the_flash_drain_writes() {
    let flash = tempfile::tempdir().unwrap();
    // Balanced pinned: performance (the mode on a host without a battery) drains DRAM only past 95%.
    let daemon = start_with_a_paused_flash_write(
        flash.path(),
        "[tiers]\nhigh_watermark = 50\nlow_watermark = 25\n[policy]\nmode = \"balanced\"\n",
        6000,
        ["4MiB", "8MiB", "32MiB"],
    );
    let mut c =
        spawn_client("run", &daemon, &["--layers", "8", "--tokens", "1000", "--attend-every", "64", "--seed", "9"]);
    wait_for_the_pause(&daemon, Duration::from_secs(30), || {
        format!("the DRAM pool was never drained: {:?}\n{}", daemon.status(), daemon.log())
    });
    let paused = std::time::Instant::now();
    let before = daemon.status();
    assert_eq!(before.demoted_to_flash, 0, "{before:?}");
    c.expect_line("appended");
    c.send("append 400");
    let (s, _) =
        daemon.wait_status(Duration::from_secs(4), |s| s.background_bytes >= before.background_bytes + 4 * PAGE_BYTES);
    let seen = paused.elapsed();
    assert!(
        s.background_bytes >= before.background_bytes + 4 * PAGE_BYTES && s.demoted_to_flash == 0,
        "the tier mover moved {} B in the background in {seen:?} while the flash write was paused (demoted \
         to flash: {}):\n{}",
        s.background_bytes - before.background_bytes,
        s.demoted_to_flash,
        daemon.log()
    );
    assert!(seen < Duration::from_millis(5500), "seen after the pause: {seen:?}");
    eprintln!(
        "while the drain's write was paused: {} B demoted into DRAM in the background in {seen:?}",
        s.background_bytes - before.background_bytes
    );

    // The write completes; the drain carries on and the client's checks hold.
    c.expect_line("appended");
    let (s, _) = daemon.wait_status(Duration::from_secs(20), |s| s.demoted_to_flash > 0);
    assert!(s.demoted_to_flash > 0, "{s:?}");
    check_within(&mut c, 1e-5);
    let s = daemon.status();
    assert_eq!(s.tiers[0].used_bytes, s.session_bytes + s.tiers[0].reserved_bytes, "{s:?}");
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

/// `kB` field `name` of `/proc/PID/status`, in bytes.
fn proc_status_bytes(pid: u32, name: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    kvmm_tests::soak::proc_kib(&status, name).unwrap() * 1024
}

/// Moving a large session's DRAM pages to flash copies them out in the clear a batch at a time:
/// kvmmd's peak memory during the move grows by a batch, not by the session. Before, every page
/// was copied out first and then sealed and written in one go, so an admin `Demote` (or a drain
/// under memory pressure, when memory is scarcest) briefly took as much heap again as it moved.
#[test]
fn moving_a_large_session_to_flash_holds_a_batch_of_copies_not_the_session() {
    use kvmm_client::Client;

    let flash = tempfile::tempdir().unwrap();
    let flash_dir = flash.path().to_str().unwrap();
    let daemon = Daemon::start(&[
        "--device-budget",
        "256MiB",
        "--dram-budget",
        "128MiB",
        "--flash-budget",
        "128MiB",
        "--flash-dir",
        flash_dir,
        "--demote-format",
        "none",
    ]);
    // Llama-3-8B's KV shape over 16 layers of 1,024 tokens: 512 f16 pages of 135,232 bytes (69 MB).
    let g = kvmm_tests::llama3_8b(16, 1024);
    let client = Client::connect(daemon.socket()).unwrap();
    let mut session = client.attach(g).unwrap();
    kvmm_tests::fill_every_layer(&mut session, g);
    assert_eq!(daemon.demote(session.id(), Tier::Dram).demoted, 512);
    let moved_bytes = 512 * 135_232;

    let pid = daemon.pid();
    let before = proc_status_bytes(pid, "VmRSS");
    // Resets VmHWM, the peak resident set, to the present one.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
    assert_eq!(daemon.demote(session.id(), Tier::Flash).demoted, 512);
    let peak = proc_status_bytes(pid, "VmHWM");
    let grew = peak.saturating_sub(before);
    println!("moving {moved_bytes} bytes to flash: peak RSS {peak} bytes, {grew} above the {before} before");
    assert!(grew < moved_bytes / 3, "kvmmd's peak RSS grew by {grew} bytes while {moved_bytes} bytes moved to flash");
    session.detach().unwrap();
    assert!(daemon.stop().success());
}
