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
    // The session leaves the registry before its frames are zeroed and freed (with the lock handed
    // over between pages): wait for both.
    let back = |s: &kvmm_proto::v1::StatusResponse| {
        s.sessions == baseline.sessions
            && s.tiers[0].used_bytes == baseline.tiers[0].used_bytes
            && s.tiers[0].frames == baseline.tiers[0].frames
    };
    let (after, took) = daemon.wait_status(Duration::from_secs(5), back);
    println!("the killed client's session was wiped and its frames freed {took:?} after SIGKILL returned");
    assert_eq!(after.sessions, baseline.sessions, "the session is gone");
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

/// A `sleep` that a test client started holding its sockets (`share-sockets`): killed on drop.
struct Holder(i32);

impl Holder {
    /// Sockets the holder has open: it runs and still holds the dead client's connection.
    fn sockets(&self) -> usize {
        let fds = std::fs::read_dir(format!("/proc/{}/fd", self.0)).unwrap();
        fds.filter(|e| {
            std::fs::read_link(e.as_ref().unwrap().path()).is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))
        })
        .count()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.0) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// Asks `client` to let a child inherit its sockets; the child, and how many sockets it holds.
fn share_sockets(client: &mut kvmm_tests::Worker) -> Holder {
    client.send("share-sockets");
    let f = fields(&client.expect_line("shared"));
    let holder = Holder(f["holder"].parse().unwrap());
    let sockets: usize = f["sockets"].parse().unwrap();
    assert!(sockets >= 1, "the client has a connection to share: {f:?}");
    assert_eq!(holder.sockets(), sockets, "the child holds every socket the client had");
    holder
}

/// A connection lives as long as the process that opened it: a child that inherited the socket (a
/// fork without exec) does not keep a killed client's session, or its pins, alive. kvmmd watches
/// the opener's pidfd, so the session is wiped (or, lingering, orphaned for a Resume) while the
/// socket is still open in the child.
#[test]
fn a_killed_clients_session_ends_while_a_child_still_holds_its_connection() {
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let mut plain = spawn_client("run", &daemon, &["--tokens", "100", "--seed", "5"]);
    plain.expect_line("appended");
    let plain_holder = share_sockets(&mut plain);
    let args = ["--tokens", "100", "--seed", "6", "--no-attend", "--linger-ms", "30000"];
    let mut lingering = spawn_client("run", &daemon, &args);
    let id = fields(&lingering.expect_line("attached"))["session"].clone();
    lingering.expect_line("appended");
    let lingering_holder = share_sockets(&mut lingering);
    assert_eq!(daemon.status().sessions, 2);

    plain.kill9();
    lingering.kill9();
    let (after, took) = daemon.wait_status(Duration::from_secs(10), |s| s.sessions == 1 && s.orphaned_sessions == 1);
    println!(
        "the killed clients' sessions ended {took:?} after SIGKILL returned, their sockets still open in children"
    );
    assert_eq!((after.sessions, after.orphaned_sessions), (1, 1), "one wiped, one orphaned: {after:?}");
    assert!(plain_holder.sockets() >= 1 && lingering_holder.sockets() >= 1, "the children still hold the sockets");
    assert!(after.session_bytes > 0, "the orphan keeps its pages: {after:?}");
    assert!(
        daemon.log().contains("the process that opened the connection exited; closing the connection"),
        "{}",
        daemon.log()
    );

    // The orphan is whole: a new process resumes it and checks its attention.
    let mut second = spawn_client("run", &daemon, &["--resume", &id, "--tokens", "100", "--seed", "6"]);
    let resumed = fields(&second.expect_line("resumed"));
    assert_eq!(resumed["tokens"], "100", "{resumed:?}");
    second.send("check 2");
    second.expect_line("checked");
    second.send("exit");
    second.expect_line("detached");
    assert!(second.wait(Duration::from_secs(10)).success());
    let s = daemon.wait_drained();
    assert_eq!((s.sessions, s.orphaned_sessions, s.tiers[0].used_bytes), (0, 0, 0), "{s:?}");
    assert!(daemon.stop().success());
}
