//! Stuck pins: a page a client holds pinned past the pin lease is reported (admin `Status` and
//! `ListSessions`, the owner's `SessionStats`, the metrics, a log line), while a client that reads
//! its only page back to back, pinned nearly all the time but never by one pin, is not; an unpin
//! clears the report, and a wipe revokes the session. The daemon has no tier below the device, so
//! no tier thread: the pin watch runs, and frees a wiped session's held frame, on its own. With
//! `--revoke-stuck-pins` kvmmd revokes the session itself, and its client is told why.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kvmm_proto::v1::{ListSessionsRequest, MetricsRequest, SessionInfo, StatusRequest};
use kvmm_tests::{Daemon, fields, spawn_client};

const LEASE_MS: u64 = 300;

fn session_info(daemon: &Daemon, id: u64) -> SessionInfo {
    let listed = daemon.admin(async |mut a| a.list_sessions(ListSessionsRequest {}).await.unwrap().into_inner());
    listed.sessions.into_iter().find(|s| s.session_id == id).unwrap()
}

#[test]
fn a_pin_held_past_the_lease_is_reported_and_a_busy_reader_is_not() {
    let lease = LEASE_MS.to_string();
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--dram-budget", "0", "--pin-lease-ms", &lease]);
    assert_eq!(daemon.status().pin_lease_ms, LEASE_MS);

    // The busy reader: one layer of one page, attention back to back from here on.
    let mut busy = spawn_client("attend-spin", &daemon, &["--layers", "1", "--tokens", "32"]);
    let busy_session: u64 = fields(&busy.expect_line("ready"))["session"].parse().unwrap();
    // The holder pins its page once and keeps the pin.
    let mut holder = spawn_client("hold-pin", &daemon, &["--layers", "1"]);
    let held: u64 = fields(&holder.expect_line("pinned"))["session"].parse().unwrap();

    let (s, waited) = daemon.wait_status(Duration::from_secs(10), |s| s.stuck_pins > 0);
    println!("the held pin was reported {waited:?} after the client printed it");
    assert_eq!(s.stuck_pins, 1, "{s:?}");
    // Many leases later the busy reader's page is still not counted.
    std::thread::sleep(Duration::from_millis(6 * LEASE_MS));
    assert_eq!(daemon.status().stuck_pins, 1);
    let info = session_info(&daemon, held);
    assert_eq!(info.stuck_pins, 1, "{info:?}");
    assert!(info.longest_pin_ms >= LEASE_MS, "{info:?}");
    let busy_info = session_info(&daemon, busy_session);
    assert_eq!((busy_info.stuck_pins, busy_info.longest_pin_ms), (0, 0), "{busy_info:?}");
    // kvmmctl shows the same.
    let status: serde_json::Value = serde_json::from_str(&daemon.kvmmctl(&["--json", "status"])).unwrap();
    assert_eq!((status["stuck_pins"].as_u64(), status["pin_lease_ms"].as_u64()), (Some(1), Some(LEASE_MS)));
    let listed: serde_json::Value = serde_json::from_str(&daemon.kvmmctl(&["--json", "sessions"])).unwrap();
    let stuck_of = |id: u64| {
        listed["sessions"].as_array().unwrap().iter().find(|s| s["session_id"] == id).unwrap()["stuck_pins"].as_u64()
    };
    assert_eq!((stuck_of(held), stuck_of(busy_session)), (Some(1), Some(0)), "{listed}");
    let human = daemon.kvmmctl(&["status"]);
    assert!(human.contains("stuck pins: 1 page(s) held pinned past the 300ms pin lease"), "{human}");
    let human = daemon.kvmmctl(&["session", &held.to_string()]);
    assert!(human.contains("stuck pins: 1 page(s) held pinned past the pin lease, the longest for"), "{human}");
    let metrics = daemon.admin(async |mut a| a.metrics(MetricsRequest {}).await.unwrap().into_inner().text);
    assert!(metrics.contains("\nkvmm_daemon_stuck_pins 1\n"), "{metrics}");
    let log = daemon.log();
    let line = log.lines().find(|l| l.contains("pinned past the pin lease")).unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains(&format!("session={held}")) && line.contains("layer=0 block=0"), "{line}");
    assert_eq!(log.matches("pinned past the pin lease").count(), 1, "reported once: {log}");

    // Let go: no longer stuck. Pinned again: stuck again after a lease.
    holder.send("unpin");
    holder.expect_line("unpinned");
    daemon.wait_status(Duration::from_secs(5), |s| s.stuck_pins == 0);
    holder.send("pin");
    assert_eq!(fields(&holder.expect_line("pin"))["pinned"], "true");
    daemon.wait_status(Duration::from_secs(10), |s| s.stuck_pins == 1);

    // The operator revokes the session: nothing stuck is left, the pinned frame stays zeroed and
    // held until the client lets go, and the busy reader is served all along.
    daemon.wipe_session(held).unwrap();
    let (s, _) = daemon.wait_status(Duration::from_secs(5), |s| s.sessions == 1);
    assert_eq!((s.stuck_pins, s.tiers[0].reserved_frames), (0, 1), "{s:?}");
    // Once the client lets go, the frame is freed. Watched over one admin connection: the end of
    // any connection frees every held frame whose pin went, which would hide a daemon that never
    // looks by itself.
    holder.send("unpin");
    holder.expect_line("unpinned");
    let (s, waited) = daemon.admin(async |mut a| {
        let start = Instant::now();
        loop {
            let s = a.status(StatusRequest {}).await.unwrap().into_inner();
            if s.tiers[0].reserved_frames == 0 || start.elapsed() > Duration::from_secs(5) {
                return (s, start.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    println!("the held frame was freed {waited:?} after the unpin");
    assert_eq!(s.tiers[0].reserved_frames, 0, "the unpinned frame is freed: {s:?}");
    assert_eq!(s.tiers[0].used_bytes, s.session_bytes, "{s:?}");
    daemon.wipe_session(busy_session).unwrap();
    let end = fields(&busy.expect_line("error"));
    assert_eq!(end["code"], "FailedPrecondition", "{end:?}");
    let attentions: u64 = end["attentions"].parse().unwrap();
    assert!(attentions > 1000, "the busy reader kept reading through the test: {end:?}");
    holder.send("exit");
    assert!(daemon.stop().success());
}

#[test]
fn with_revoke_stuck_pins_the_session_holding_a_pin_past_the_lease_is_revoked_and_no_other() {
    let lease = LEASE_MS.to_string();
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--pin-lease-ms", &lease, "--revoke-stuck-pins"]);
    let mut busy = spawn_client("attend-spin", &daemon, &["--layers", "1", "--tokens", "32"]);
    let busy_session: u64 = fields(&busy.expect_line("ready"))["session"].parse().unwrap();
    let mut holder = spawn_client("hold-pin", &daemon, &["--layers", "2"]);
    let held: u64 = fields(&holder.expect_line("pinned"))["session"].parse().unwrap();
    holder.send("stats");
    assert_eq!(fields(&holder.expect_line("stats"))["code"], "Ok");

    // Revoked once its pin outlasts the lease: wiped, its pinned frame held, the other page freed.
    let (s, waited) = daemon.wait_status(Duration::from_secs(10), |s| s.sessions == 1);
    println!("the session was revoked {waited:?} after its client printed its pin");
    assert_eq!((s.stuck_pins, s.tiers[0].reserved_frames), (0, 1), "{s:?}");
    let log = daemon.log();
    assert!(log.lines().any(|l| l.contains("session revoked") && l.contains(&format!("session={held}"))), "{log}");
    // Its client is told why, on the RPC and in the session table.
    holder.send("stats");
    let line = holder.expect_line("stats");
    let f = fields(&line);
    assert_eq!((f["code"].as_str(), f["table"].as_str()), ("FailedPrecondition", "Ok(Revoked)"), "{line}");
    assert!(line.contains("revoked by kvmmd") && line.contains("pin lease"), "{line}");

    // The busy reader outlives many leases untouched.
    std::thread::sleep(Duration::from_millis(6 * LEASE_MS));
    assert_eq!(daemon.status().sessions, 1);
    assert_eq!(session_info(&daemon, busy_session).stuck_pins, 0);
    daemon.wipe_session(busy_session).unwrap();
    let end = fields(&busy.expect_line("error"));
    assert!(end["attentions"].parse::<u64>().unwrap() > 1000, "{end:?}");
    holder.send("exit");
    assert!(daemon.stop().success());
}
