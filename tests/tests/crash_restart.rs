//! Crash and restart: kvmmd killed with `SIGKILL` at chosen points of a demotion and a promotion
//! (the fail points of `daemon/src/failpoint.rs`, compiled into debug builds only), then started
//! again as systemd would. The client gets `UNAVAILABLE` (or `FAILED_PRECONDITION` for a page left
//! marked as moving), reconnects, attaches again, appends its K/V again and carries on, with every
//! attention output checked against its own K/V: no wrong bytes are served, before or after. The
//! restarted daemon's accounting holds: its tiers' pages are the session's, and when the client
//! detaches every tier is empty again (no flash slot or DRAM frame owned twice or leaked). Nothing
//! of the killed daemon's flash file is readable: its keys died with it, and the restart truncates
//! the file.

#![allow(clippy::unwrap_used)]

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use kvmm_tests::{Daemon, fields, kvmmd_command, spawn_client};

/// A SmolLM2-shaped f16 page: 3 KV heads × 64 channels × 32 tokens, with header and bounds.
const PAGE_BYTES: u64 = 25_408;

fn crash_at(point: &str) {
    // The test binaries and kvmmd come from one profile; only debug builds compile fail points in.
    if !cfg!(debug_assertions) {
        println!("skipped: a release kvmmd has no fail points; run `cargo test` without --release");
        return;
    }
    // 12 layers × 10 pages (320 tokens); the device holds 82 pages (its smallest budget, 2 MiB) and
    // DRAM 24, so pages go to flash and come back as the layers are read in turn.
    let device = "2MiB";
    let dram = (24 * PAGE_BYTES).to_string();
    let flash = tempfile::tempdir().unwrap();
    let flash_dir = flash.path().to_str().unwrap();
    let args = [
        "--device-budget",
        device,
        "--dram-budget",
        &dram,
        "--flash-budget",
        "16MiB",
        "--flash-dir",
        flash_dir,
        "--demote-format",
        "none",
    ];
    let mut kvmmd = kvmmd_command();
    kvmmd.env("KVMM_FAILPOINT", format!("{point}:3"));
    let mut daemon = Daemon::start_with(kvmmd, None, &args);
    let mut c = spawn_client("crash-run", &daemon, &["--layers", "12", "--tokens", "320", "--seed", "11"]);

    let status = daemon.wait_exit(Duration::from_secs(120));
    let log = daemon.log();
    assert_eq!(status.signal(), Some(9), "{point}: kvmmd was killed, not {status}; log:\n{log}");
    assert!(log.contains("fail point reached") && log.contains(point), "{point}: log:\n{log}");

    daemon.restart(kvmmd_command(), &args);
    let done = fields(&c.expect_line("done"));
    println!("{point}: {done:?}");
    assert_eq!(done["reconnects"], "1", "{point}: one reconnect, after the kill: {done:?}");
    assert!(done["worst_rel_err"].parse::<f64>().unwrap() <= 1e-3, "{done:?}");

    let s = daemon.status();
    assert_eq!(s.sessions, 1, "{s:?}");
    let tier_pages: u64 = s.tiers.iter().map(|t| t.pages).sum();
    assert!(tier_pages >= 12 * 10, "the new session's pages are accounted for: {s:?}");
    for t in &s.tiers {
        assert!(t.used_bytes <= t.budget_bytes, "{t:?}");
    }
    c.send("exit");
    c.expect_line("detached");
    // A flash write the detach overtook returns its slot when it commits, a moment later.
    let (s, _) = daemon.wait_status(Duration::from_secs(5), |s| {
        s.sessions == 0 && s.tiers.iter().all(|t| (t.used_bytes, t.pages) == (0, 0))
    });
    for t in &s.tiers {
        assert_eq!((t.used_bytes, t.pages), (0, 0), "{point}: everything returned: {t:?}");
    }
    assert!(daemon.stop().success());
}

#[test]
fn killed_after_a_page_is_stored_in_dram_before_it_is_published() {
    crash_at("dram-after-store");
}

#[test]
fn killed_with_pages_copied_out_of_dram_before_they_are_written_to_flash() {
    crash_at("flash-before-write");
}

#[test]
fn killed_after_a_flash_write_before_the_page_table_update() {
    crash_at("flash-after-write");
}

#[test]
fn killed_after_the_page_table_update_before_the_dram_slot_is_freed() {
    crash_at("flash-after-index");
}

#[test]
fn killed_after_a_flash_read_before_the_page_is_published() {
    crash_at("promote-after-read");
}

#[test]
fn killed_after_a_promoted_page_is_published_before_the_fault_reply() {
    crash_at("promote-after-publish");
}

/// A regression found by the scenarios above: after a restart, a client dropped its stale session
/// handle, whose `Detach` went through a new connection (the gRPC channel reconnects by itself) and
/// detached the restarted daemon's new session that had the same id. A session is now used only
/// through the connection that attached it.
#[test]
fn a_stale_handle_cannot_touch_a_session_of_another_connection_with_its_id() {
    let daemon = Daemon::start(&[]);
    let mut owner = spawn_client("raw-attach", &daemon, &[]);
    let session: u64 = fields(&owner.expect_line("attached"))["session"].parse().unwrap();

    // The same uid on another connection: every session call naming it is refused, and nothing
    // changes.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let refused = rt.block_on(async {
        let channel = kvmm_client::connect::channel(&daemon.socket()).await.unwrap();
        let mut rpc = kvmm_proto::v1::session_client::SessionClient::new(channel);
        let detach = rpc.detach(kvmm_proto::v1::DetachRequest { session_id: session }).await.unwrap_err();
        let stats = rpc.session_stats(kvmm_proto::v1::SessionStatsRequest { session_id: session }).await.unwrap_err();
        [detach, stats]
    });
    for status in &refused {
        assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
        assert!(status.message().contains("attached through another connection"), "{status:?}");
    }
    assert_eq!(daemon.status().sessions, 1, "the session is still attached");
    owner.send("exit");
    assert!(owner.wait(Duration::from_secs(10)).success());
    assert!(daemon.stop().success());
}
