//! Three client processes with different geometries share one daemon whose only tier is the device:
//! every attention output of every step equals a scalar reference over the same K/V, the daemon's
//! device-tier bytes equal the sum of the sessions' frames, a fourth client that outgrows the budget
//! gets RESOURCE_EXHAUSTED naming the tier and the bytes, the three carry on unaffected, and
//! accounting returns to zero when they exit. (With tiers below, the fourth would demote the others'
//! pages instead: see `tier_ladder.rs`.)

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvmm_tests::{Daemon, fields, spawn_client};

const GEOMETRIES: [&[&str]; 3] = [
    // SmolLM2-like heads: 9 query heads over 3 KV heads, head_dim 64, f16.
    &["--layers", "2", "--kv-heads", "3", "--q-heads", "9", "--head-dim", "64", "--block-tokens", "32", "--seed", "11"],
    // bf16, small pages.
    &[
        "--layers",
        "3",
        "--kv-heads",
        "2",
        "--q-heads",
        "8",
        "--head-dim",
        "32",
        "--block-tokens",
        "16",
        "--bf16",
        "--seed",
        "22",
    ],
    // One KV head, wide heads, large pages.
    &[
        "--layers",
        "2",
        "--kv-heads",
        "1",
        "--q-heads",
        "4",
        "--head-dim",
        "128",
        "--block-tokens",
        "64",
        "--seed",
        "33",
    ],
];

#[test]
fn three_processes_match_the_reference_and_a_fourth_past_the_budget_is_refused() {
    let daemon = Daemon::start(&["--device-budget", "16MiB", "--dram-budget", "0"]);
    let mut workers: Vec<_> = GEOMETRIES
        .iter()
        .map(|g| {
            let mut args = g.to_vec();
            args.extend(["--tokens", "2000"]);
            spawn_client("run", &daemon, &args)
        })
        .collect();

    let mut sum = 0u64;
    for w in &mut workers {
        let f = fields(&w.expect_line("appended"));
        assert_eq!(f["tokens"], "2000");
        let worst: f64 = f["worst_rel_err"].parse().unwrap();
        let attentions: u64 = f["attentions"].parse().unwrap();
        println!("session {}: {attentions} checked attentions, worst relative error {worst:e}", f["session"]);
        assert!(worst <= 1e-3);
        sum += f["device_bytes"].parse::<u64>().unwrap();
    }
    let status = daemon.status();
    assert_eq!(status.sessions, 3);
    assert_eq!(status.tiers[0].used_bytes, sum, "device bytes are exactly the sessions' frames");
    assert_eq!(status.session_bytes, sum);
    println!("device tier: {} of {} bytes used by 3 sessions", sum, status.tiers[0].budget_bytes);

    // A fourth session that wants far more than is left: its batches shrink to the pages it needs, it
    // fills the budget to the last page that fits, and the next page is refused.
    let mut fourth = spawn_client(
        "run",
        &daemon,
        &["--layers", "2", "--max-tokens", "32768", "--tokens", "20000", "--extend-batch", "512", "--no-attend"],
    );
    let refusal = fourth.expect_line("error");
    let f = fields(&refusal);
    assert_eq!(f["code"], "ResourceExhausted", "{refusal}");
    for word in ["device", "requested", "available"] {
        assert!(refusal.contains(word), "the refusal names the {word}: {refusal}");
    }
    // The refused request is one page per layer: the batch of 512 shrank to what was needed.
    let page = kvmm_shm::Geometry::new(2, 3, 9, 64, 32768).page_bytes().div_ceil(64) * 64;
    assert!(refusal.contains(&format!("{} bytes requested", 2 * page)), "{refusal}");
    println!("fourth client: {refusal}");
    assert_eq!(fourth.wait(Duration::from_secs(30)).code(), Some(2));
    let (status, _) = daemon.wait_status(Duration::from_secs(5), |s| s.sessions == 3);
    assert_eq!(status.tiers[0].used_bytes, sum, "the fourth session's pages went with it");

    // The three are unaffected: they keep appending (and extending) with checked attention.
    for w in &mut workers {
        w.send("append 100");
        let f = fields(&w.expect_line("appended"));
        assert_eq!(f["tokens"], "2100");
    }
    for w in &mut workers {
        w.send("exit");
        w.expect_line("detached");
        assert!(w.wait(Duration::from_secs(10)).success());
    }
    let status = daemon.wait_drained();
    assert_eq!(status.tiers[0].used_bytes, 0, "accounting returns to zero");
    assert_eq!(status.tiers[0].frames, 0);
    assert!(daemon.stop().success());
}
