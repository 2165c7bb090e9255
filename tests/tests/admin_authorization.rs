//! Authorization of the admin API, table-driven over every RPC of `kvmm.v1.Admin` (the list is
//! read from `admin.proto`, so a new RPC joins the table by itself):
//!
//! - the admin socket is `0660`: another uid cannot even connect;
//! - with the socket opened to everyone (a misconfigured socket unit), every RPC still answers a
//!   uid that is neither root nor in the admin group `PERMISSION_DENIED`, and nothing changes;
//! - a member of the configured admin group is served.
//!
//! Needs root (to run the caller as uid 65534 with `setpriv`); otherwise skipped with the reason.
//!
//! Under the unit's sandbox (`KVMM_SANDBOX`), kvmmd has no `CAP_CHOWN`, so a kvmmd that binds its
//! own admin socket can hand it to the admin group only as a member of that group: without, it
//! refuses to start and says why (under systemd, `kvmmd-admin.socket` sets `SocketGroup=`); with
//! the group as a supplementary group (as `SupplementaryGroups=` would give it) it is served.

#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use kvmm_tests::{
    Daemon, NOBODY, Worker, can_run_as_nobody, client_args, client_bin, fields, kvmmd_command, sandboxed, spawn_client,
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
    let args = ["--device-budget", "64MiB", "--admin-group", "nogroup"];
    let daemon = if sandboxed() { admin_group_daemon_in_the_sandbox(&args) } else { Daemon::start(&args) };
    let socket = daemon.dir().join("kvmm-admin.sock");
    let args = client_args("admin-all", &daemon, &["--admin-socket", socket.to_str().unwrap(), "--session", "7"]);
    // uid 65534 with gid 65534 (nogroup): the socket's group lets it connect, the service serves it.
    let mut out = as_nobody(&args, Some("65534"));
    let line = out.expect_line("admin");
    println!("nogroup member: {line}");
    let codes = fields(&format!("x {line}"));
    assert_eq!(codes["Status"], "Ok", "{line}");
    assert_eq!(codes["ListSessions"], "Ok", "{line}");
    assert_eq!(codes["Session"], "NotFound", "no session 7: {line}");
    out.wait(Duration::from_secs(10));
    assert!(daemon.stop().success());
}

/// A sandboxed kvmmd with the admin group `nogroup` (gid 65534, [`NOBODY`]'s): first not a member,
/// which must refuse to start naming the cause, then a member.
fn admin_group_daemon_in_the_sandbox(args: &[&str]) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let out = kvmmd_command().arg("--runtime-dir").arg(dir.path()).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    println!("sandboxed kvmmd outside the admin group: {}", err.trim());
    assert!(!out.status.success() && err.contains("admin socket to the admin group"), "{out:?}");
    let mut kvmmd = kvmmd_command();
    kvmmd.env("KVMM_SANDBOX_GROUPS", NOBODY);
    Daemon::start_with(kvmmd, None, args)
}
