//! `kill -9` of a client in the middle of appending: the daemon notices the closed connection,
//! zeroes and frees the dead client's frames within a second, accounting returns to the baseline,
//! and another client's outputs stay equal to the reference throughout.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvmm_tests::{Daemon, fields, spawn_client};

#[test]
fn a_killed_client_is_wiped_within_a_second_and_others_are_unaffected() {
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let mut survivor = spawn_client("run", &daemon, &["--tokens", "200", "--seed", "3"]);
    let survivor_bytes: u64 = fields(&survivor.expect_line("appended"))["device_bytes"].parse().unwrap();
    let baseline = daemon.status();
    assert_eq!(baseline.tiers[0].used_bytes, survivor_bytes);
    survivor.send("loop");

    let mut victim = spawn_client("append-forever", &daemon, &["--layers", "4", "--seed", "9", "--extend-batch", "1"]);
    for _ in 0..3 {
        victim.expect_line("progress");
    }
    assert!(daemon.device_used() > baseline.tiers[0].used_bytes);
    victim.kill9();
    let (after, took) = daemon.wait_status(Duration::from_secs(5), |s| s.sessions == baseline.sessions);
    println!("the killed client's session was wiped {took:?} after SIGKILL returned");
    assert!(took <= Duration::from_secs(1), "wipe took {took:?}");
    assert_eq!(after.tiers[0].used_bytes, baseline.tiers[0].used_bytes, "accounting is back to baseline");
    assert_eq!(after.tiers[0].frames, baseline.tiers[0].frames);

    survivor.send("stop");
    let f = fields(&survivor.expect_line("looped"));
    assert!(f["attentions"].parse::<u64>().unwrap() > 0);
    survivor.send("exit");
    survivor.expect_line("detached");
    assert!(survivor.wait(Duration::from_secs(10)).success());
    assert!(daemon.stop().success());
}
