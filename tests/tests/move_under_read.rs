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
