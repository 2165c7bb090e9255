//! Opt-in lossy eviction and per-session quotas with real processes.
//!
//! - A session that opted into eviction runs 16k tokens under a 2k-token quota: every `Extend` past
//!   the quota drops its least-attended pages, no call fails, the client checks at every attention
//!   that the sink page and the pages of the last 128 tokens are still there and that the output
//!   equals an f64 reference over exactly the pages kept, and the pages that draw the most attention
//!   (heavy hitters) are the ones kept.
//! - Meanwhile a session that did not opt in, squeezed by the same device budget, is demoted, never
//!   dropped: every one of its attention outputs covers all of its tokens.
//! - Without eviction a quota is a hard limit: `Extend` past it is `RESOURCE_EXHAUSTED` with a
//!   sentence that says what to do; eviction without a quota, or a quota too small for the pages
//!   eviction keeps, is `INVALID_ARGUMENT`.
//! - Pages dropped while they are in flash give their slots back, punched out, and the flash
//!   file's accounting follows (the slots are freed once the core lock is released).

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvmm_client::{AttachOptions, Client};
use kvmm_proto::v1::{StatusResponse, Tier, TierStatus};
use kvmm_tests::rows::{self, DIM, Q, ROW, attend, rows};
use kvmm_tests::{Daemon, fields, spawn_client};

#[test]
fn an_opted_in_session_runs_16k_tokens_under_a_2k_quota_while_another_loses_nothing() {
    let flash = tempfile::tempdir().unwrap();
    // 8 MiB of device: the evicting session keeps 2 × 64 pages (3.2 MB); the other one's 2 × 125
    // pages (6.4 MB) must partly go down to DRAM.
    let daemon = Daemon::start_tiered("8MiB", flash.path(), &[]);
    let mut keeper = spawn_client(
        "run",
        &daemon,
        &["--layers", "2", "--tokens", "4000", "--max-tokens", "4096", "--attend-every", "8", "--seed", "21"],
    );
    let mut evicting = spawn_client(
        "run",
        &daemon,
        &[
            "--layers",
            "2",
            "--tokens",
            "16384",
            "--max-tokens",
            "16384",
            "--quota-tokens",
            "2048",
            "--evict",
            "--attend-every",
            "16",
            "--heavy-every",
            "8",
            "--hot-scale",
            "3",
            "--seed",
            "22",
        ],
    );
    let done = fields(&evicting.expect_line("appended"));
    let quota = fields(&evicting.expect_line("quota"));
    println!("evicting session: {done:?} {quota:?}");
    assert_eq!(done["tokens"], "16384", "{done:?}");
    // The daemon knows which program attached (the kernel's 15-character process name).
    assert_eq!(done["owner"], "kvmm-test-clien", "{done:?}");
    assert_eq!(quota["tokens"], "2048");
    let kept: Vec<u32> = quota["kept_pages"].split(',').map(|k| k.parse().unwrap()).collect();
    assert!(kept.iter().all(|&k| k <= 64), "at most 2048 tokens per layer are held: {kept:?}");
    let dropped: u32 = quota["dropped_pages"].parse().unwrap();
    assert_eq!(dropped, kept.iter().map(|k| 512 - k).sum::<u32>(), "every page is kept or dropped");
    // Heavy hitters: 1 page in 8 draws several times the attention of the others; with 64 pages
    // per layer kept and about 60 heavy pages per layer eligible, nearly all of them survive.
    let (heavy_kept, heavy) = quota["heavy_kept"].split_once('/').unwrap();
    let (heavy_kept, heavy): (f64, f64) = (heavy_kept.parse().unwrap(), heavy.parse().unwrap());
    println!("heavy hitters kept: {heavy_kept} of {heavy}");
    assert!(heavy > 100.0 && heavy_kept >= 0.8 * heavy, "heavy hitters are kept: {heavy_kept}/{heavy}");

    let kept_all = fields(&keeper.expect_line("appended"));
    println!("session without eviction: {kept_all:?}");
    assert_eq!(kept_all["tokens"], "4000");
    // Squeezed by the budget, its pages went down a tier and came back on faults (as q8 pages).
    assert!(kept_all["faults"].parse::<u64>().unwrap() > 0, "{kept_all:?}");
    assert!(kept_all["formats_seen"].contains("q8"), "{kept_all:?}");
    keeper.send("check 2");
    let checked = fields(&keeper.expect_line("checked"));
    let pages: u64 =
        ["device_pages", "dram_pages", "flash_pages"].iter().map(|k| checked[*k].parse::<u64>().unwrap()).sum();
    // 125 pages of tokens per layer, allocated in batches of 4: 128.
    assert_eq!(pages, 2 * 128, "a session without eviction keeps every page: {checked:?}");

    for c in [&mut evicting, &mut keeper] {
        c.send("exit");
        c.expect_line("detached");
        assert!(c.wait(Duration::from_secs(10)).success());
    }
    let status = daemon.status();
    assert_eq!((daemon.device_used(), status.sessions), (0, 0), "{status:?}");
    assert!(daemon.stop().success());
}

#[test]
fn a_quota_without_eviction_is_a_hard_limit_and_bad_quotas_are_refused() {
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    // 512 tokens of quota: the 17th page of a layer is refused.
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "600", "--quota-tokens", "512"]);
    let e = c.expect_line("error");
    assert_eq!(fields(&e)["code"], "ResourceExhausted", "{e}");
    assert!(e.contains("over its quota of 512") && e.contains("attach with eviction"), "{e}");
    assert!(c.wait(Duration::from_secs(10)).code() == Some(2));

    let mut c = spawn_client("run", &daemon, &["--evict", "--tokens", "10"]);
    let e = c.expect_line("error");
    assert_eq!(fields(&e)["code"], "InvalidArgument", "{e}");
    assert!(e.contains("set quota_tokens"), "{e}");
    c.wait(Duration::from_secs(10));

    // At 32 tokens per page eviction keeps the sink page, 4 pages of recent window and the page
    // being written: 192 tokens is the least.
    let mut c = spawn_client("run", &daemon, &["--evict", "--quota-tokens", "160", "--tokens", "10"]);
    let e = c.expect_line("error");
    assert_eq!(fields(&e)["code"], "InvalidArgument", "{e}");
    assert!(e.contains("at least 192"), "{e}");
    c.wait(Duration::from_secs(10));

    // The smallest quota works: 1,000 tokens through 192 of quota, nothing it must keep dropped.
    let mut c = spawn_client(
        "run",
        &daemon,
        &["--evict", "--quota-tokens", "192", "--tokens", "1000", "--extend-batch", "1", "--seed", "3"],
    );
    c.expect_line("appended");
    let q = fields(&c.expect_line("quota"));
    assert_eq!(q["kept_pages"], "6,6", "{q:?}");
    c.send("exit");
    c.expect_line("detached");
    assert!(c.wait(Duration::from_secs(10)).success());
    assert!(daemon.stop().success());
}

#[test]
fn pages_dropped_in_flash_give_their_slots_back() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_tiered("64MiB", flash.path(), &[]);
    let client = Client::connect(daemon.socket()).unwrap();
    // 16 pages a layer under a quota of 16: the next token's `Extend` (a batch of 4) drops 4 pages
    // of each layer, chosen among blocks 1..12 (not the sink page, not the last 128 tokens).
    let options = AttachOptions { quota_tokens: 512, evict: true, ..AttachOptions::default() };
    let mut s = client.attach_with(rows::geometry(2), options).unwrap();
    let (k, v) = (rows(513, 1), rows(513, 2));
    for layer in 0..2 {
        s.append(layer, &k[..512 * ROW], &v[..512 * ROW]).unwrap();
    }
    let moved = daemon.demote(s.id(), Tier::Flash);
    assert_eq!(moved.demoted, 32, "{moved:?}");
    let flash_tier =
        |st: &StatusResponse| -> TierStatus { st.tiers.iter().find(|t| t.tier == "flash").unwrap().clone() };
    let slots = |t: &TierStatus| t.by_format.iter().map(|f| f.bytes).sum::<u64>();
    let before = flash_tier(&daemon.status());
    assert_eq!((before.pages, before.used_bytes), (32, slots(&before)), "{before:?}");

    for layer in 0..2 {
        s.append(layer, &k[512 * ROW..], &v[512 * ROW..]).unwrap();
    }
    let st = s.stats().unwrap();
    assert_eq!(st.dropped_pages, 8, "{st:?}");
    let after = flash_tier(&daemon.status());
    assert_eq!(after.pages, 24, "{after:?}");
    assert_eq!(after.used_bytes, slots(&after), "the dropped pages' slots are free: {after:?}");
    assert!(after.used_bytes < before.used_bytes, "{before:?} {after:?}");
    // The pages kept are still read (faulted back from flash); the dropped ones are skipped.
    let q = rows(3, 3)[..Q * DIM].to_vec();
    for layer in 0..2 {
        let out = attend(&mut s, layer, &q);
        assert!(out.iter().all(|x| x.is_finite()), "layer {layer}");
    }
    s.detach().unwrap();
    let drained = daemon.wait_drained();
    assert!(drained.tiers.iter().all(|t| t.pages == 0 && t.used_bytes == 0), "{drained:?}");
}
