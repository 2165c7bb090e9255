//! Authorization of the admin API, table-driven over every RPC of `kvmm.v1.Admin` (the list is
//! read from `admin.proto`, so a new RPC joins the table by itself):
//!
//! - the admin socket is `0660`: another uid cannot even connect;
//! - with the socket opened to everyone (a misconfigured socket unit), every RPC still answers a
//!   uid that is neither root nor in the admin group `PERMISSION_DENIED`, and nothing changes;
//! - a member of the configured admin group is served, and so is the uid kvmmd itself runs as (a
//!   per-user daemon's user).
//!
//! Needs root (to run the caller as uid 65534 with `setpriv`); otherwise skipped with the reason.
//!
//! Under the unit's sandbox (`KVMM_SANDBOX`) kvmmd cannot chown, so a kvmmd that binds its own
//! admin socket refuses to start with an admin group, saying why; the member is then served by a
//! sandboxed kvmmd on an admin socket passed in as `kvmmd-admin.socket` would pass it.

#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvmm_tests::{
    Daemon, Worker, can_run_as_nobody, client_args, client_bin, fields, kvmmd_bin, kvmmd_command, sandbox_launcher,
    sandboxed, spawn_client, wait_timeout,
};

fn as_nobody(args: &[String], groups: Option<&str>) -> Worker {
    Worker::spawn_cmd(kvmm_tests::as_nobody(&client_bin(), groups).args(args))
}

/// Every RPC name of the Admin service.
fn admin_rpcs() -> Vec<String> {
    let proto =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../proto/proto/kvmm/v1/admin.proto")).unwrap();
    proto
        .lines()
        .filter_map(|l| l.trim().strip_prefix("rpc "))
        .map(|l| l.split('(').next().unwrap().trim().to_owned())
        .collect()
}

#[test]
fn every_admin_rpc_refuses_a_uid_that_is_not_an_administrator() {
    if !can_run_as_nobody() {
        return;
    }
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let mut c = spawn_client("run", &daemon, &["--tokens", "100", "--seed", "61"]);
    let session = fields(&c.expect_line("appended"))["session"].clone();
    let socket = daemon.dir().join("kvmm-admin.sock");
    let args = client_args("admin-all", &daemon, &["--admin-socket", socket.to_str().unwrap(), "--session", &session]);

    // The socket's mode keeps other uids out before any RPC.
    let mut out = as_nobody(&args, None);
    let line = out.expect_line("admin");
    assert!(line.starts_with("connect=") && line.contains("ermission denied"), "{line}");
    out.wait(Duration::from_secs(10));

    // Opened to everyone, the service itself refuses every RPC.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut out = as_nobody(&args, None);
    let line = out.expect_line("admin");
    println!("uid 65534: {line}");
    let codes = fields(&format!("x {line}"));
    let rpcs = admin_rpcs();
    assert!(rpcs.len() >= 13, "{rpcs:?}");
    for rpc in &rpcs {
        assert_eq!(codes.get(rpc).map(String::as_str), Some("PermissionDenied"), "{rpc}: {line}");
    }
    out.wait(Duration::from_secs(10));
    // Nothing changed: the session is whole, the policy as it was, nothing drained.
    c.send("check 1");
    c.expect_line("checked");
    let status = daemon.status();
    assert_eq!((status.sessions, status.draining), (1, false));
    assert_eq!(status.policy.unwrap().mode, "performance");
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

#[test]
fn a_member_of_the_admin_group_is_served() {
    if !can_run_as_nobody() {
        return;
    }
    if sandboxed() {
        a_member_of_the_admin_group_is_served_by_a_sandboxed_kvmmd_on_the_socket_units_socket();
        return;
    }
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--admin-group", "nogroup"]);
    let socket = daemon.dir().join("kvmm-admin.sock");
    let args = client_args("admin-all", &daemon, &["--admin-socket", socket.to_str().unwrap(), "--session", "7"]);
    // uid 65534 with gid 65534 (nogroup): the socket's group lets it connect, the service serves it.
    assert_member_served(&mut as_nobody(&args, Some("65534")));
    assert!(daemon.stop().success());
}

/// A per-user kvmmd (here run as uid 65534) serves its own user's admin requests: `kvmmctl` works
/// on the daemon a user started, with no admin group and no root.
#[test]
fn the_uid_kvmmd_runs_as_is_served() {
    if !can_run_as_nobody() {
        return;
    }
    let daemon = Daemon::start_with(kvmm_tests::kvmmd_command_as_nobody(), Some(65534), &["--device-budget", "64MiB"]);
    let socket = daemon.dir().join("kvmm-admin.sock");
    let args = client_args("admin-all", &daemon, &["--admin-socket", socket.to_str().unwrap(), "--session", "7"]);
    assert_member_served(&mut as_nobody(&args, None));
    assert!(daemon.stop().success());
}

/// The nogroup member's `admin-all` run: served, and told there is no session 7.
fn assert_member_served(out: &mut Worker) {
    let line = out.expect_line("admin");
    println!("nogroup member: {line}");
    let codes = fields(&format!("x {line}"));
    assert_eq!(codes["Status"], "Ok", "{line}");
    assert_eq!(codes["ListSessions"], "Ok", "{line}");
    assert_eq!(codes["Session"], "NotFound", "no session 7: {line}");
    out.wait(Duration::from_secs(10));
}

/// Under the unit's sandbox kvmmd cannot chown at all (`SystemCallFilter=~@privileged` holds
/// `@chown`, and it has no `CAP_CHOWN`), so a kvmmd that binds its own admin socket cannot hand it
/// to the admin group: it refuses to start and says so. Under systemd the admin socket comes from
/// `kvmmd-admin.socket` (`SocketGroup=`): here `systemd-socket-activate` binds it, the test gives
/// it the group and mode the socket unit would, and the sandboxed kvmmd it starts on the first
/// connection takes it and serves the group's member.
fn a_member_of_the_admin_group_is_served_by_a_sandboxed_kvmmd_on_the_socket_units_socket() {
    let args = ["--device-budget", "64MiB", "--admin-group", "nogroup"];
    let dir = tempfile::tempdir().unwrap();
    let out = kvmmd_command().arg("--runtime-dir").arg(dir.path()).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    println!("sandboxed kvmmd binding its own admin socket: {}", err.trim());
    assert!(!out.status.success() && err.contains("admin socket to the admin group"), "{out:?}");

    if Command::new("systemd-socket-activate").arg("--version").output().is_err() {
        println!("skipped the rest: systemd-socket-activate is not installed");
        return;
    }
    let dir = tempfile::Builder::new().prefix("kvmm-test-").tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let admin = dir.path().join("kvmm-admin.sock");
    let log = dir.path().join("kvmmd.log");
    let mut kvmmd = Command::new("systemd-socket-activate")
        .arg("-l")
        .arg(&admin)
        .arg("--fdname=admin")
        .arg("--setenv=RUST_LOG=info")
        .arg(sandbox_launcher())
        .arg(kvmmd_bin())
        .arg("--runtime-dir")
        .arg(dir.path())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !admin.exists() {
        assert!(Instant::now() < deadline, "systemd-socket-activate did not bind {}", admin.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    // SocketGroup=nogroup, SocketMode=0660.
    std::os::unix::fs::chown(&admin, None, Some(65534)).unwrap();
    std::fs::set_permissions(&admin, std::fs::Permissions::from_mode(0o660)).unwrap();

    let session = dir.path().join("kvmm.sock");
    let client = ["admin-all", "--socket", session.to_str().unwrap(), "--admin-socket", admin.to_str().unwrap()];
    let client: Vec<String> = client.iter().chain(&["--session", "7"]).map(|s| (*s).to_owned()).collect();
    assert_member_served(&mut as_nobody(&client, Some("65534")));

    // systemd-socket-activate exec'd the launcher, which exec'd kvmmd: one pid, confined.
    let status = std::fs::read_to_string(format!("/proc/{}/status", kvmmd.id())).unwrap();
    assert!(status.contains("Name:\tkvmmd") && status.contains("Seccomp:\t2"), "{status}");
    let log = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(log().contains("using the socket systemd passed"), "{}", log());
    // Signals are kvmmd's to handle once it is ready (daemon_lifecycle's
    // a_signal_right_after_the_sockets_appear_is_handled_not_fatal).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !log().contains("kvmmd ready") {
        assert!(Instant::now() < deadline, "kvmmd was not ready in 20 s; log:\n{}", log());
        std::thread::sleep(Duration::from_millis(5));
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(kvmmd.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let exit = wait_timeout(&mut kvmmd, Duration::from_secs(15));
    assert!(exit.is_some_and(|s| s.success()), "{exit:?}; log:\n{}", log());
}
