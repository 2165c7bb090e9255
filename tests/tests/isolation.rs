//! A client running as another uid cannot extend, inspect, fault, detach, resume or fetch the memfds
//! of the first uid's session, and is only ever sent its own uid's arena. Needs root (to drop
//! privileges with `setpriv`); otherwise it is skipped with the reason printed.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvmm_tests::{Daemon, Worker, client_args, client_bin, fields, spawn_client};

fn as_nobody(args: &[String]) -> Worker {
    Worker::spawn_cmd(kvmm_tests::as_nobody(&client_bin(), None).args(args))
}

#[test]
fn another_uid_cannot_touch_a_session_or_receive_its_arena() {
    if !kvmm_tests::can_run_as_nobody() {
        return;
    }
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);

    // uid 0: one session with its memfds fetched, one whose token is still unused.
    let mut owner = spawn_client("raw-attach", &daemon, &["--fetch"]);
    let mine = fields(&owner.expect_line("attached"));
    let mut pending = spawn_client("raw-attach", &daemon, &[]);
    let unused = fields(&pending.expect_line("attached"));

    // uid 65534: every RPC on uid 0's session is refused.
    let mut foreign = as_nobody(&client_args("foreign", &daemon, &["--session", &mine["session"]]));
    let verdict = foreign.expect_line("foreign");
    println!("uid 65534 on uid 0's session: {verdict}");
    let f = fields(&format!("x {verdict}"));
    for rpc in ["extend", "stats", "fault", "wipe", "detach", "resume"] {
        assert_eq!(f[rpc], "PermissionDenied", "{rpc}: {verdict}");
    }
    assert!(foreign.wait(Duration::from_secs(10)).success());

    // ... and presenting uid 0's unused token gets no fds.
    let mut thief =
        as_nobody(&client_args("fd-request", &daemon, &["--session", &unused["session"], "--token", &unused["token"]]));
    let refusal = thief.expect_line("refused");
    println!("uid 65534 presenting uid 0's token: {refusal}");
    assert_eq!(fields(&refusal)["code"], (tonic::Code::PermissionDenied as i32).to_string());
    assert!(thief.wait(Duration::from_secs(10)).success());

    // uid 65534 attaching for itself gets a different arena: its own trust domain.
    let mut own = as_nobody(&client_args("raw-attach", &daemon, &["--fetch"]));
    let theirs = fields(&own.expect_line("attached"));
    assert_ne!(theirs["arena_ino"], mine["arena_ino"], "never another uid's arena");
    let status = daemon.status();
    assert_eq!(status.trust_domains, 2);
    assert_eq!(status.sessions, 3);

    for w in [&mut owner, &mut pending, &mut own] {
        w.send("exit");
        assert!(w.wait(Duration::from_secs(10)).success());
    }
    let status = daemon.wait_drained();
    assert_eq!(status.tiers[0].used_bytes, 0);
    assert!(daemon.stop().success());
}
