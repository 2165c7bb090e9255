//! While clients run attention continuously, the daemon moves their pages between frames (the
//! `--debug-move-churn` driver, which uses the same move primitive as compaction) at least 10,000
//! times; every output stays equal to the reference, so no client ever reads a torn page.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvmm_tests::{Daemon, fields, spawn_client};

const MOVES: u64 = 10_000;

#[test]
fn ten_thousand_moves_under_continuous_attention_never_tear_a_page() {
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--debug-move-churn"]);
    let mut workers = [
        spawn_client(
            "run",
            &daemon,
            &[
                "--layers",
                "2",
                "--kv-heads",
                "3",
                "--q-heads",
                "9",
                "--head-dim",
                "64",
                "--tokens",
                "300",
                "--seed",
                "5",
            ],
        ),
        spawn_client(
            "run",
            &daemon,
            &[
                "--layers",
                "2",
                "--kv-heads",
                "2",
                "--q-heads",
                "8",
                "--head-dim",
                "32",
                "--block-tokens",
                "8",
                "--bf16",
                "--tokens",
                "300",
                "--seed",
                "6",
            ],
        ),
    ];
    for w in &mut workers {
        w.expect_line("appended");
        w.send("loop");
    }
    let (status, took) = daemon.wait_status(Duration::from_secs(240), |s| s.pages_moved >= MOVES);
    assert!(status.pages_moved >= MOVES, "only {} moves in {took:?}", status.pages_moved);
    let mut attentions = 0u64;
    let mut moved = 0u64;
    for w in &mut workers {
        w.send("stop");
        let f = fields(&w.expect_line("looped"));
        attentions += f["attentions"].parse::<u64>().unwrap();
        moved += f["moved"].parse::<u64>().unwrap();
        w.send("exit");
        w.expect_line("detached");
        assert!(w.wait(Duration::from_secs(10)).success());
    }
    println!(
        "{} moves in {took:?} ({} skipped on a pin); these sessions' pages moved {moved} times under {attentions} checked attentions",
        status.pages_moved, status.moves_skipped_pinned
    );
    assert!(moved >= MOVES, "the moves hit the clients' own pages");
    assert!(daemon.stop().success());
}

/// Compaction fills the holes a detached session leaves with the highest pages of the others, and
/// the pages it moves still hold what was written. Two sessions take alternate frames; once the
/// first detaches, the second's upper pages move down into its holes (the pass hands the core lock
/// over between moves and re-checks each page, so a stale plan must not stop it).
#[test]
fn compaction_moves_the_highest_pages_into_the_holes_of_a_detached_session() {
    use kvmm_client::{Client, ElementType, Geometry};

    let daemon = Daemon::start(&["--device-budget", "64MiB", "--compaction-interval-ms", "50"]);
    let geometry = Geometry {
        layers: 1,
        kv_heads: 2,
        q_heads: 4,
        head_dim: 64,
        block_tokens: 32,
        element_type: ElementType::F16,
        max_tokens: 32 * 32,
    };
    let client = Client::connect(daemon.socket()).unwrap();
    let (mut gone, mut kept) = (client.attach(geometry).unwrap(), client.attach(geometry).unwrap());
    let row = (geometry.kv_heads * geometry.head_dim) as usize;
    let k: Vec<f32> = (0..32 * row).map(|i| (i % 97) as f32 / 97.0 - 0.5).collect();
    let v: Vec<f32> = (0..32 * row).map(|i| (i % 89) as f32 / 89.0 - 0.5).collect();
    // One page each in turn, so their frames alternate in the arena.
    for _ in 0..32 {
        gone.append(0, &k, &v).unwrap();
        kept.append(0, &k, &v).unwrap();
    }
    let q: Vec<f32> = (0..geometry.q_heads as usize * 64).map(|i| (i % 13) as f32 / 13.0 - 0.5).collect();
    let mut before = vec![0.0; q.len()];
    kept.attention(0, &q, &mut before).unwrap();
    let moved_before = daemon.status().pages_moved;
    gone.detach().unwrap();
    let (status, took) = daemon.wait_status(Duration::from_secs(20), |s| s.pages_moved >= moved_before + 8);
    assert!(status.pages_moved >= moved_before + 8, "{} moves in {took:?}: {status:?}", status.pages_moved);
    assert_eq!(status.tiers[0].used_bytes, status.session_bytes, "{status:?}");
    let mut after = vec![0.0; q.len()];
    kept.attention(0, &q, &mut after).unwrap();
    assert_eq!(before, after, "the moved pages read back as they were written");
    kept.detach().unwrap();
    assert!(daemon.stop().success());
}
