//! Per-layer floors and adaptive precision in a real kvmmd: pages forced down by the admin
//! `Demote` take per-page formats, never below their layer's floor, while the sink page and the
//! recent window keep the client's precision. Every attention output is checked by the client
//! against its f64 reference over its own K/V passed through the same quantizer as each page it
//! read (through the format it last read a page in, when the page stepped down since).
//!
//! The client: 2 layers × 1,440 tokens in 32-token pages = 45 full pages per layer.
//!
//! - **By age** (the default): block 0 is the sink and block 44 holds the last 32 tokens, so blocks
//!   1..=43 are the candidates. The three pages between the last 32 and the last 128 tokens that
//!   the shorter window spares pay for 17 pages at k8v4 instead of q4 (SmolLM2's page: 3 × (25,408
//!   − 7,744) ≥ 17 × 3,104), the newest: blocks 27..=43.
//! - **By mass** (`adaptive_ranking = "mass"`): blocks 41..=44 hold the last 128 tokens, so blocks
//!   1..=40 are the 40 candidates. The keys of blocks 9 and 30 are scaled 8× so random queries give
//!   them most of the attention mass. Adaptive precision moves 5% of 40 = 2 pages a step up and pays
//!   with the fewest lowest-mass pages a step down: 4 at q4 (q8 + 38 × q2 ≤ 40 × q4 needs 4 q2 pages
//!   for 2 q8 ones), and likewise 4 in q8 mode (f16 pages paid for by q4 ones).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use kvmm_kernels::{Format, PageShape};
use kvmm_proto::v1 as pb;
use kvmm_proto::v1::Tier;
use kvmm_tests::{Daemon, Worker, fields, spawn_client};

const HOT: [usize; 2] = [9, 30];
const SINK_AND_RECENT: [usize; 5] = [0, 41, 42, 43, 44];

/// Starts a client with hot blocks 9 and 30, lets it attend 4 rounds (its kernels record each
/// page's mass), demotes all its full pages to DRAM, and reads every layer once more (faulting
/// the pages back in their demoted formats). Returns the client and each layer's page formats.
fn demoted_formats(daemon: &Daemon, seed: &str) -> (Worker, Vec<Vec<String>>) {
    let hot = HOT.map(|b| b.to_string()).join(",");
    let mut c = spawn_client(
        "run",
        daemon,
        &["--layers", "2", "--tokens", "1440", "--no-attend", "--hot-blocks", &hot, "--seed", seed],
    );
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    c.send("check 4");
    c.expect_line("checked");
    assert_eq!(daemon.demote(session, Tier::Dram).demoted, 90, "every full page of both layers goes down");
    let layers = read_formats(&mut c, 2);
    (c, layers)
}

/// Has the client read every layer (checked attention, faulting demoted pages back in their
/// formats) and returns each layer's page formats.
fn read_formats(c: &mut Worker, layers: u32) -> Vec<Vec<String>> {
    c.send("formats");
    (0..layers)
        .map(|layer| {
            let f = fields(&c.expect_line("formats"));
            assert_eq!(f["layer"], layer.to_string());
            f["pages"].split(',').map(str::to_owned).collect::<Vec<_>>()
        })
        .collect()
}

/// The session's pages in DRAM by format, from admin `ListSessions`.
fn dram_census(daemon: &Daemon, session: u64) -> BTreeMap<String, u64> {
    let list = daemon.admin(async |mut a| a.list_sessions(pb::ListSessionsRequest {}).await.unwrap().into_inner());
    let s = list.sessions.iter().find(|s| s.session_id == session).unwrap();
    let dram = s.tiers.iter().find(|t| t.tier == "dram").unwrap();
    dram.by_format.iter().map(|f| (f.format.clone(), f.pages)).collect()
}

/// Bytes of pages counted by format name, at SmolLM2's page shape.
fn page_bytes(census: &BTreeMap<String, u64>) -> u64 {
    let shape = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };
    census.iter().map(|(f, &n)| n * shape.page_bytes(Format::from_name(f).unwrap()) as u64).sum()
}

/// How many pages of each format `pages` (a layer's formats) has among `blocks`.
fn count(pages: &[String], blocks: impl IntoIterator<Item = usize>) -> BTreeMap<String, usize> {
    let mut n = BTreeMap::new();
    for b in blocks {
        *n.entry(pages[b].clone()).or_default() += 1;
    }
    n
}

fn counts(list: &[(&str, usize)]) -> BTreeMap<String, usize> {
    list.iter().map(|&(f, n)| (f.to_owned(), n)).collect()
}

fn bits(format: &str) -> u32 {
    match format {
        "f16" | "bf16" => 32,
        "q8" => 16,
        "k8v4" => 12,
        "q4" => 8,
        "q2" => 4,
        other => panic!("unknown format {other}"),
    }
}

/// A kvmmd with a 64 MiB device and 32 MiB of DRAM whose configuration file (returned, so a test
/// can rewrite it and reload) holds `policy`.
fn daemon_with_policy(policy: &str) -> (tempfile::NamedTempFile, Daemon) {
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), policy).unwrap();
    let path = config.path().to_str().unwrap();
    let daemon = Daemon::start(&["--config", path, "--device-budget", "64MiB", "--dram-budget", "32MiB"]);
    (config, daemon)
}

fn finish(mut c: Worker) {
    c.send("exit");
    c.expect_line("detached");
}

#[test]
fn a_q8_floor_on_layer_0_holds_under_powersave_q4_while_layer_1_gets_bits_by_attention() {
    let (_config, daemon) = daemon_with_policy(
        "[policy]\nmode = \"powersave\"\nadaptive_ranking = \"mass\"\n\n[[policy.floor]]\nlayers = \"0\"\n\
         format = \"q8\"\n",
    );
    let p = daemon.status().policy.unwrap();
    assert_eq!((p.mode.as_str(), p.demote_format.as_str()), ("powersave", "q4"), "{p:?}");
    assert!(p.adaptive_precision, "adaptive precision is on by default: {p:?}");
    assert_eq!((p.adaptive_ranking.as_str(), p.layer_floors.as_slice()), ("mass", ["0:q8".to_owned()].as_slice()));

    let (c, layers) = demoted_formats(&daemon, "11");
    let (l0, l1) = (&layers[0], &layers[1]);
    println!("layer 0: {}\nlayer 1: {}", l0.join(","), l1.join(","));
    assert_eq!((l0.len(), l1.len()), (45, 45));
    for pages in [l0, l1] {
        assert_eq!(count(pages, SINK_AND_RECENT), counts(&[("f16", 5)]), "the sink and recent window stay f16");
    }
    // Layer 0: powersave's q4 (and adaptive's q2) raised to the floor.
    assert_eq!(count(l0, 1..=40), counts(&[("q8", 40)]), "{l0:?}");
    // Layer 1: the two most attended pages q8, the four least attended q2, the rest q4: the bytes
    // of uniform q4.
    assert_eq!(count(l1, 1..=40), counts(&[("q8", 2), ("q4", 34), ("q2", 4)]), "{l1:?}");
    for b in HOT {
        assert_eq!(l1[b], "q8", "hot block {b} keeps more bits: {l1:?}");
    }
    finish(c);
    assert!(daemon.stop().success());
}

#[test]
fn q8_mode_keeps_the_most_attended_pages_exact_and_a_reload_turns_adaptive_off_and_floors_the_last_layer() {
    let (config, daemon) = daemon_with_policy("[policy]\nmode = \"performance\"\nadaptive_ranking = \"mass\"\n");

    // q8 mode, adaptive: the hot pages stay f16, four least attended q4, the rest q8.
    let (first, layers) = demoted_formats(&daemon, "12");
    for pages in &layers {
        println!("adaptive q8: {}", pages.join(","));
        assert_eq!(count(pages, SINK_AND_RECENT), counts(&[("f16", 5)]));
        assert_eq!(count(pages, 1..=40), counts(&[("f16", 2), ("q8", 34), ("q4", 4)]), "{pages:?}");
        for b in HOT {
            assert_eq!(pages[b], "f16", "hot block {b}: {pages:?}");
        }
        let coldest = (1..=40).map(|b| bits(&pages[b])).min().unwrap();
        assert!(HOT.iter().all(|&b| bits(&pages[b]) > coldest));
    }

    // Reloaded: adaptive off, the last layer floored at f16 (never compressed).
    std::fs::write(
        config.path(),
        "[policy]\nmode = \"performance\"\nadaptive_precision = false\n\n[[policy.floor]]\nlayers = \"last\"\n\
         format = \"f16\"\n",
    )
    .unwrap();
    let p = daemon.reload_policy().unwrap().policy.unwrap();
    assert!(!p.adaptive_precision, "{p:?}");
    assert_eq!(p.layer_floors, ["last:f16"]);
    assert!(daemon.log().contains("precision reloaded"), "{}", daemon.log());
    let (second, layers) = demoted_formats(&daemon, "13");
    assert_eq!(count(&layers[0], 1..=40), counts(&[("q8", 40)]), "uniform q8: {:?}", layers[0]);
    assert_eq!(count(&layers[1], 0..45), counts(&[("f16", 45)]), "the floored last layer: {:?}", layers[1]);

    // A bad floor is refused and the running precision stays.
    std::fs::write(config.path(), "[[policy.floor]]\nlayers = \"2-1\"\nformat = \"q8\"\n").unwrap();
    let err = daemon.reload_policy().unwrap_err();
    assert!(err.message().contains("not a range of layers"), "{err:?}");
    let p = daemon.status().policy.unwrap();
    assert_eq!((p.adaptive_precision, p.layer_floors.as_slice()), (false, ["last:f16".to_owned()].as_slice()));
    finish(first);
    finish(second);
    assert!(daemon.stop().success());
}

/// Adaptive precision by age under powersave's q4: the newest 17 candidates past a 32-token window
/// at k8v4, older ones at q4, within uniform q4's bytes (with the usual 128-token window). After
/// 320 more tokens the pages that aged past the newest 17 step down to q4 where they lie, in
/// DRAM, and the page that left the window is quantized there; the client's checks hold over every
/// page, including the ones re-encoded twice (f16 → k8v4 → q4).
#[test]
fn by_age_the_newest_pages_take_k8v4_and_step_down_to_q4_in_dram_as_they_age() {
    let (_config, daemon) = daemon_with_policy("[policy]\nmode = \"powersave\"\n");
    let p = daemon.status().policy.unwrap();
    assert_eq!((p.demote_format.as_str(), p.adaptive_precision), ("q4", true), "{p:?}");
    assert_eq!(p.adaptive_ranking, "age", "ranking by age is the default: {p:?}");

    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "1440", "--no-attend", "--seed", "14"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    assert_eq!(daemon.demote(session, Tier::Dram).demoted, 90);
    // In DRAM, per layer: 26 q4, 17 k8v4, the sink and the last page f16; uniform q4 would hold
    // 40 q4 and 5 f16 (the 128-token window).
    let census = dram_census(&daemon, session);
    let want = |list: &[(&str, u64)]| list.iter().map(|&(f, n)| (f.to_owned(), n)).collect::<BTreeMap<_, _>>();
    assert_eq!(census, want(&[("f16", 4), ("k8v4", 34), ("q4", 52)]));
    let uniform = want(&[("f16", 10), ("q4", 80)]);
    println!("by age: {} bytes in DRAM, uniform q4 {}", page_bytes(&census), page_bytes(&uniform));
    assert!(page_bytes(&census) <= page_bytes(&uniform));
    for pages in read_formats(&mut c, 2) {
        assert_eq!(count(&pages, [0, 44]), counts(&[("f16", 2)]), "{pages:?}");
        assert_eq!(count(&pages, 1..=26), counts(&[("q4", 26)]), "{pages:?}");
        assert_eq!(count(&pages, 27..=43), counts(&[("k8v4", 17)]), "{pages:?}");
    }

    // Down again (the read faulted every page back), then 10 more pages each on the device.
    assert_eq!(daemon.demote(session, Tier::Dram).demoted, 90);
    c.send("append-only 320");
    assert_eq!(fields(&c.expect_line("appended"))["tokens"], "1760");
    // Demoting the new pages plans each layer again: blocks 1..=53 are candidates, 37..=53 the
    // newest 17. Blocks 27..=36 step down from k8v4 to q4 and block 44 from f16 to k8v4 in DRAM.
    assert_eq!(daemon.demote(session, Tier::Dram).demoted, 110, "every full page is in DRAM");
    let census = dram_census(&daemon, session);
    assert_eq!(census, want(&[("f16", 4), ("k8v4", 34), ("q4", 72)]));
    let uniform = want(&[("f16", 10), ("q4", 100)]);
    assert!(page_bytes(&census) <= page_bytes(&uniform));
    for pages in read_formats(&mut c, 2) {
        assert_eq!(count(&pages, [0, 54]), counts(&[("f16", 2)]), "{pages:?}");
        assert_eq!(count(&pages, 1..=36), counts(&[("q4", 36)]), "{pages:?}");
        assert_eq!(count(&pages, 37..=53), counts(&[("k8v4", 17)]), "{pages:?}");
    }
    c.send("check 2");
    let checked = fields(&c.expect_line("checked"));
    assert!(checked["worst_rel_err"].parse::<f64>().unwrap() <= 1e-3, "{checked:?}");
    finish(c);
    assert!(daemon.stop().success());
}

/// On their way to flash, pages step down first: flash keeps a page's format. 45 pages per layer go
/// to DRAM at 1,440 tokens (k8v4 27..=43; the client reads them once, so that it checks the pages
/// stepped down through k8v4), 320 more tokens are appended, then only the old pages,
/// all in DRAM, are sent to flash: nothing leaves the device, so only the move to flash plans the
/// layers again, and the pages that aged past the newest 17 land in flash as q4.
#[test]
fn by_age_pages_step_down_before_they_go_to_flash() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_tiered("64MiB", flash.path(), &["--mode", "powersave"]);
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "1440", "--no-attend", "--seed", "15"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    // Read once (so the client knows which pages were k8v4) and back down to DRAM.
    assert_eq!(daemon.demote(session, Tier::Dram).demoted, 90);
    read_formats(&mut c, 2);
    assert_eq!(daemon.demote(session, Tier::Dram).demoted, 90);
    c.send("append-only 320");
    c.expect_line("appended");
    let request = pb::DemoteRequest {
        session_id: session,
        first_block: 0,
        blocks: 45,
        tier: Tier::Flash as i32,
        ..Default::default()
    };
    let moved = daemon.admin(async |mut a| a.demote(request).await.unwrap().into_inner());
    assert_eq!(moved.demoted, 90, "{moved:?}");
    let list = daemon.admin(async |mut a| a.list_sessions(pb::ListSessionsRequest {}).await.unwrap().into_inner());
    let flash_tier = list.sessions[0].tiers.iter().find(|t| t.tier == "flash").unwrap();
    let census: BTreeMap<String, u64> = flash_tier.by_format.iter().map(|f| (f.format.clone(), f.pages)).collect();
    // Per layer: q4 1..=36, k8v4 37..=44 (block 44 left the window since), f16 the sink page.
    let want = [("f16", 2), ("k8v4", 16), ("q4", 72)].map(|(f, n)| (f.to_owned(), n)).into_iter().collect();
    assert_eq!(census, want);
    for pages in read_formats(&mut c, 2) {
        assert_eq!(count(&pages, 1..=36), counts(&[("q4", 36)]), "{pages:?}");
        assert_eq!(count(&pages, 37..=44), counts(&[("k8v4", 8)]), "{pages:?}");
    }
    finish(c);
    assert!(daemon.stop().success());
}

/// An administrator's `Compress` obeys the floors too: layer 0 (floor q8) goes down to q8 only,
/// layer 1 (floor f16) is left alone and counted in `skipped_floor`, layer 2 (no floor) takes the
/// q4 asked for. The client's checks hold over the pages in their new formats.
#[test]
fn an_admin_compress_goes_no_lower_than_each_layers_floor() {
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        config.path(),
        "[[policy.floor]]\nlayers = \"0\"\nformat = \"q8\"\n\n[[policy.floor]]\nlayers = \"1\"\nformat = \"f16\"\n",
    )
    .unwrap();
    let daemon = Daemon::start(&["--config", config.path().to_str().unwrap(), "--device-budget", "64MiB"]);
    // 3 layers × 300 tokens: 9 full pages and a tail in each.
    let mut c = spawn_client("run", &daemon, &["--layers", "3", "--tokens", "300", "--seed", "12"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();

    let r = daemon.compress(session, kvmm_proto::v1::PageFormat::Q4);
    assert_eq!((r.compressed, r.skipped_floor, r.skipped_already), (18, 9, 0), "{r:?}");
    c.send("formats");
    let layers: Vec<Vec<String>> =
        (0..3).map(|_| fields(&c.expect_line("formats"))["pages"].split(',').map(str::to_owned).collect()).collect();
    assert_eq!(count(&layers[0], 0..9), counts(&[("q8", 9)]), "{:?}", layers[0]);
    assert_eq!(count(&layers[1], 0..9), counts(&[("f16", 9)]), "{:?}", layers[1]);
    assert_eq!(count(&layers[2], 0..9), counts(&[("q4", 9)]), "{:?}", layers[2]);

    // Asked again: layer 0 is at its floor, layer 1 under its f16 floor, layer 2 already at q4.
    let again = daemon.compress(session, kvmm_proto::v1::PageFormat::Q4);
    assert_eq!((again.compressed, again.skipped_floor, again.skipped_already), (0, 18, 9), "{again:?}");
    c.send("check 2");
    let checked = fields(&c.expect_line("checked"));
    assert!(checked["worst_rel_err"].parse::<f64>().unwrap() <= 0.3, "{checked:?}");
    finish(c);
    assert!(daemon.stop().success());
}

/// An administrator's adaptive `Compress` gives each page, in place on the device, the format a
/// demotion by age would at the format asked for: per layer the sink page and the last page (the
/// 32-token window) keep f16 (`skipped_window`), blocks 27..=43 take k8v4 and 1..=26 q4, within
/// the bytes of uniform q4 over the usual 128-token window. A plain `Compress` to q4 afterwards
/// takes the k8v4 pages and the kept ones down to q4.
#[test]
fn an_adaptive_admin_compress_gives_each_page_the_format_a_demotion_would() {
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    assert_eq!(daemon.status().policy.unwrap().adaptive_ranking, "age");
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "1440", "--no-attend", "--seed", "15"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    let compress = |adaptive: bool| {
        let request = pb::CompressRequest {
            session_id: session,
            format: pb::PageFormat::Q4 as i32,
            adaptive,
            ..Default::default()
        };
        daemon.admin(async |mut a| a.compress(request).await.unwrap().into_inner())
    };
    let by_format = |r: &pb::CompressResponse| -> BTreeMap<String, u64> {
        r.compressed_to.iter().map(|f| (f.format.clone(), f.pages)).collect()
    };
    let want = |list: &[(&str, u64)]| list.iter().map(|&(f, n)| (f.to_owned(), n)).collect::<BTreeMap<_, _>>();

    let r = compress(true);
    assert_eq!((r.compressed, r.skipped_window, r.skipped_already), (86, 4, 0), "{r:?}");
    assert_eq!(by_format(&r), want(&[("k8v4", 34), ("q4", 52)]), "{r:?}");
    let census = want(&[("f16", 4), ("k8v4", 34), ("q4", 52)]);
    let uniform = want(&[("f16", 10), ("q4", 80)]);
    println!("adaptive compress: {} bytes, uniform q4 {}", page_bytes(&census), page_bytes(&uniform));
    assert!(page_bytes(&census) <= page_bytes(&uniform));
    assert_eq!(r.bytes_after, page_bytes(&want(&[("k8v4", 34), ("q4", 52)])), "frames shrink to the pages' bytes");
    for pages in read_formats(&mut c, 2) {
        assert_eq!(count(&pages, [0, 44]), counts(&[("f16", 2)]), "{pages:?}");
        assert_eq!(count(&pages, 1..=26), counts(&[("q4", 26)]), "{pages:?}");
        assert_eq!(count(&pages, 27..=43), counts(&[("k8v4", 17)]), "{pages:?}");
    }

    let plain = compress(false);
    assert_eq!((plain.compressed, plain.skipped_already, plain.skipped_window), (38, 52, 0), "{plain:?}");
    assert_eq!(by_format(&plain), want(&[("q4", 38)]), "{plain:?}");
    for pages in read_formats(&mut c, 2) {
        assert_eq!(count(&pages, 0..=44), counts(&[("q4", 45)]), "{pages:?}");
    }
    c.send("check 2");
    let checked = fields(&c.expect_line("checked"));
    assert!(checked["worst_rel_err"].parse::<f64>().unwrap() <= 1e-3, "{checked:?}");
    finish(c);
    assert!(daemon.stop().success());
}
