//! Per-layer floors and adaptive precision in a real kvmmd: pages forced down by the admin
//! `Demote` take per-page formats from the attention mass the client's kernels recorded (the most
//! attended pages keep more bits, the least attended pay for them), never below their layer's
//! floor, while the sink page and the last 128 tokens keep the client's precision. Every attention
//! output is checked by the client against its f64 reference over its own K/V passed through the
//! same quantizer as each page it read.
//!
//! The client: 2 layers × 1,440 tokens in 32-token pages = 45 full pages per layer; block 0 is the
//! sink and blocks 41..=44 hold the last 128 tokens, so blocks 1..=40 are the 40 candidates. The
//! keys of blocks 9 and 30 are scaled 8× so random queries give them most of the attention mass.
//! Adaptive precision moves 5% of 40 = 2 pages a step up and pays with the fewest lowest-mass pages
//! a step down: 4 at q4 (q8 + 38 × q2 ≤ 40 × q4 needs 4 q2 pages for 2 q8 ones, SmolLM2's page),
//! and likewise 4 in q8 mode (f16 pages paid for by q4 ones).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

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
    c.send("formats");
    let layers = (0..2)
        .map(|layer| {
            let f = fields(&c.expect_line("formats"));
            assert_eq!(f["layer"], layer.to_string());
            f["pages"].split(',').map(str::to_owned).collect::<Vec<_>>()
        })
        .collect();
    (c, layers)
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

fn finish(mut c: Worker) {
    c.send("exit");
    c.expect_line("detached");
}

#[test]
fn a_q8_floor_on_layer_0_holds_under_powersave_q4_while_layer_1_gets_bits_by_attention() {
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        config.path(),
        "[policy]\nmode = \"powersave\"\n\n[[policy.floor]]\nlayers = \"0\"\nformat = \"q8\"\n",
    )
    .unwrap();
    let daemon = Daemon::start(&[
        "--config",
        config.path().to_str().unwrap(),
        "--device-budget",
        "64MiB",
        "--dram-budget",
        "32MiB",
    ]);
    let p = daemon.status().policy.unwrap();
    assert_eq!((p.mode.as_str(), p.demote_format.as_str()), ("powersave", "q4"), "{p:?}");
    assert!(p.adaptive_precision, "adaptive precision is on by default: {p:?}");
    assert_eq!(p.layer_floors, ["0:q8"]);

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
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), "[policy]\nmode = \"performance\"\n").unwrap();
    let daemon = Daemon::start(&[
        "--config",
        config.path().to_str().unwrap(),
        "--device-budget",
        "64MiB",
        "--dram-budget",
        "32MiB",
    ]);

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
