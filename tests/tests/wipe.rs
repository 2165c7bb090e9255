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
    let status = daemon.wait_drained();
    assert_eq!(status.tiers[0].used_bytes, 0, "{status:?}");
    assert!(daemon.stop().success());
}

/// The frame of a page a client had pinned when its session was wiped (the client was writing K/V
/// rows into its tail page, say) used to go back to the allocator at once, zeroed; the client's
/// write still under way then landed in a frame handed to the next session of the same uid. Such
/// a frame is now zeroed and held, counted among the reserved frames, until the client unpins
/// (then freed and zeroed again) or its connection closes.
#[test]
fn a_frame_pinned_during_a_wipe_is_not_handed_out_until_its_client_lets_go() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = start(flash.path());
    let pinned_line = |c: &mut kvmm_tests::Worker| {
        let f = fields(&c.expect_line("pinned"));
        let parse = |k: &str| f[k].parse::<u64>().unwrap();
        (parse("session"), parse("offset"), parse("len"))
    };
    let mut holder = spawn_client("hold-pin", &daemon, &["--layers", "1"]);
    let (session, offset, len) = pinned_line(&mut holder);
    let w = daemon.wipe_session(session).unwrap();
    assert!(w.device_bytes >= len, "{w:?}");

    // The wiped session's other frames are zeroed and freed after it leaves the registry.
    let (s, _) =
        daemon.wait_status(std::time::Duration::from_secs(5), |s| s.sessions == 0 && s.tiers[0].reserved_frames <= 1);
    let device = &s.tiers[0];
    assert_eq!(device.reserved_frames, 1, "the pinned frame is held: {s:?}");
    assert_eq!(device.used_bytes, device.reserved_bytes, "and nothing else is in use: {s:?}");
    assert_eq!(s.session_bytes, 0, "{s:?}");

    // Another session of the same uid gets another frame while the first is held.
    let mut next = spawn_client("hold-pin", &daemon, &["--layers", "1"]);
    let (_, next_offset, _) = pinned_line(&mut next);
    assert_ne!(next_offset, offset, "the held frame was handed to the next session");

    // The wiped client's late write stays in the held frame, which is zeroed again when freed.
    holder.send("write");
    holder.expect_line("written");
    let pattern = vec![0xABu8; len as usize];
    let arena_has_pattern = || {
        daemon
            .memfds()
            .iter()
            .any(|(name, b)| name.contains("kvmm-arena") && b.windows(len as usize).any(|w| w == pattern))
    };
    assert!(arena_has_pattern(), "the scan finds the late write in the held frame");
    holder.send("unpin");
    holder.expect_line("unpinned");
    let (s, waited) = daemon.wait_status(std::time::Duration::from_secs(5), |s| s.tiers[0].reserved_frames == 0);
    println!("the held frame was freed {waited:?} after the unpin");
    assert_eq!(s.tiers[0].used_bytes, s.session_bytes, "only the next session's frame is in use: {s:?}");
    assert!(!arena_has_pattern(), "the late write outlived the frame's release");

    // A client killed inside its pinned access never unpins: its connection closing frees the frame.
    assert_eq!(daemon.status().sessions, 1);
    let listed =
        daemon.admin(async |mut a| a.list_sessions(kvmm_proto::v1::ListSessionsRequest {}).await.unwrap().into_inner());
    let id = listed.sessions[0].session_id;
    daemon.wipe_session(id).unwrap();
    // The wiped session's other frames are zeroed and freed after it leaves the registry.
    let (s, _) =
        daemon.wait_status(std::time::Duration::from_secs(5), |s| s.sessions == 0 && s.tiers[0].reserved_frames <= 1);
    assert_eq!(s.tiers[0].reserved_frames, 1, "{s:?}");
    next.kill9();
    let (s, waited) = daemon.wait_status(std::time::Duration::from_secs(5), |s| s.tiers[0].used_bytes == 0);
    println!("the killed client's held frame was freed {waited:?} after the kill");
    assert_eq!((s.tiers[0].reserved_frames, s.tiers[0].frames), (0, 0), "{s:?}");
    holder.send("exit");
    assert!(daemon.stop().success());
}
