//! Wiping sessions for certain, with real processes.
//!
//! - A client's K/V holds a 16-byte canary in every value row; its pages are spread over the
//!   device, DRAM and flash tiers. Before the wipe the canary is found in the daemon's arena memfd
//!   (read through `/proc/PID/fd`, so the scan can find it); after an admin `WipeSession` it is in
//!   no memfd the daemon holds and not in the flash file, the RPC reports bytes in every tier, and
//!   the client's next call is `FAILED_PRECONDITION` ("wiped by an administrator").
//! - An owner wipes their own session through the session socket; `WipeUser` and `WipeAll` take
//!   every session of a uid, or every one; another session of the same uid is untouched by a
//!   `WipeSession` of its neighbour.

#![allow(clippy::unwrap_used)]

use kvmm_proto::v1::Tier;
use kvmm_tests::{Daemon, fields, spawn_client};

const CANARY: &[u8] = b"KVMM-CANARY-7e1d";

fn holds_canary(bytes: &[u8]) -> bool {
    bytes.windows(CANARY.len()).any(|w| w == CANARY)
}

fn start(flash: &std::path::Path) -> Daemon {
    Daemon::start_tiered("64MiB", flash, &["--demote-format", "none"])
}

#[test]
fn a_wiped_session_leaves_no_canary_in_any_tier_and_its_client_is_told() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start(flash.path());
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "31", "--canary"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    let mut bystander = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "100", "--seed", "32"]);
    bystander.expect_line("appended");
    // Layer 0's full pages to flash, layer 1's to DRAM; the tail pages stay on the device.
    assert_eq!(daemon.demote_layers(session, 0..1, Tier::Flash).demoted, 9);
    assert_eq!(daemon.demote_layers(session, 1..2, Tier::Dram).demoted, 9);
    let arenas = daemon.memfds().into_iter().filter(|(name, _)| name.contains("kvmm-arena")).count();
    assert_eq!(arenas, 1, "one trust domain");
    assert!(daemon.memfds().iter().any(|(_, b)| holds_canary(b)), "the scan finds the canary before the wipe");

    let w = daemon.wipe_session(session).unwrap();
    println!("wiped: {w:?}");
    assert_eq!(w.sessions, 1);
    assert!(w.device_bytes > 0 && w.dram_bytes > 0 && w.flash_bytes > 0, "every tier held pages: {w:?}");
    for (name, bytes) in daemon.memfds() {
        assert!(!holds_canary(&bytes), "the canary survived the wipe in {name}");
    }
    let file = std::fs::read(flash.path().join("kvmm.flash")).unwrap();
    assert!(!holds_canary(&file), "the canary is in the flash file");
    assert!(!file.windows(8).any(|w| w == b"KVMMSLT1"), "the session's flash records were punched out");

    // The client hears why on its next call, and the daemon serves the other session on.
    c.send("check 1");
    let e = c.expect_line("error");
    assert_eq!(fields(&e)["code"], "FailedPrecondition", "{e}");
    assert!(e.contains("wiped by an administrator"), "{e}");
    bystander.send("check 2");
    bystander.expect_line("checked");
    // A second wipe of the same session: it is gone.
    assert_eq!(daemon.wipe_session(session).unwrap_err().code(), tonic::Code::FailedPrecondition);
    assert_eq!(daemon.wipe_session(999).unwrap_err().code(), tonic::Code::NotFound);
    bystander.send("exit");
    bystander.expect_line("detached");
    assert!(daemon.stop().success());
}

#[test]
fn owners_wipe_their_own_sessions_and_operators_wipe_by_user_or_all() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start(flash.path());
    let mut own = spawn_client("run", &daemon, &["--tokens", "100", "--seed", "33"]);
    own.expect_line("appended");
    own.send("wipe");
    let w = fields(&own.expect_line("wiped"));
    assert!(w["device"].parse::<u64>().unwrap() > 0, "{w:?}");
    own.send("check 1");
    assert_eq!(fields(&own.expect_line("error"))["code"], "FailedPrecondition");

    let mut a = spawn_client("run", &daemon, &["--tokens", "100", "--seed", "34"]);
    let mut b = spawn_client("run", &daemon, &["--tokens", "100", "--seed", "35"]);
    a.expect_line("appended");
    b.expect_line("appended");
    let uid = rustix::process::geteuid().as_raw();
    assert_eq!(daemon.wipe_many(Some(uid + 1)).sessions, 0, "another uid has no sessions");
    let by_user = daemon.wipe_many(Some(uid));
    assert_eq!(by_user.sessions, 2, "{by_user:?}");
    let mut c = spawn_client("run", &daemon, &["--tokens", "100", "--seed", "36"]);
    c.expect_line("appended");
    assert_eq!(daemon.wipe_many(None).sessions, 1);
    for w in [&mut a, &mut b, &mut c] {
        w.send("check 1");
        assert_eq!(fields(&w.expect_line("error"))["code"], "FailedPrecondition");
    }
    let status = daemon.status();
    assert_eq!((daemon.device_used(), status.sessions), (0, 0), "{status:?}");
    assert!(daemon.stop().success());
}

/// Found by `kvmm-soak`: a wipe zeroes and frees a session's frames even while its client holds
/// them pinned, and published `wiped` only afterwards, so an attention under way when an operator
/// wiped the session read zeroed pages and failed with `INVALID_ARGUMENT` ("page header is all zero
/// bytes"), or, reading a page zeroed after its header was checked, returned a wrong output as if
/// nothing happened. The daemon now publishes `wiped` before it clears or zeroes anything, and the
/// client looks at the status again after every access to pinned pages: the call under way fails
/// with `FAILED_PRECONDITION`, and no output computed from wiped pages is ever returned.
#[test]
fn a_wipe_during_attention_fails_the_call_in_flight_and_never_returns_what_it_read() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start(flash.path());
    for round in 0..12u64 {
        let seed = (40 + round).to_string();
        let mut c = spawn_client("attend-spin", &daemon, &["--layers", "4", "--tokens", "1024", "--seed", &seed]);
        let session: u64 = fields(&c.expect_line("ready"))["session"].parse().unwrap();
        // The client is reading pinned pages nearly all the time now.
        std::thread::sleep(std::time::Duration::from_millis(20 + 7 * round));
        daemon.wipe_session(session).unwrap();
        let line = c.expect_line("");
        let end = fields(&line);
        assert!(!line.starts_with("FAIL"), "round {round}: an output read from wiped pages was returned: {line}");
        assert_eq!(end.get("code").map(String::as_str), Some("FailedPrecondition"), "round {round}: {line}");
        assert!(line.contains("wiped by an administrator"), "round {round}: {line}");
        assert_eq!(c.wait(std::time::Duration::from_secs(10)).code(), Some(2));
    }
    let (status, _) = daemon.wait_status(std::time::Duration::from_secs(5), |s| s.sessions == 0);
    assert_eq!(daemon.device_used(), 0, "{status:?}");
    assert!(daemon.stop().success());
}
