//! Authorization of the admin API, table-driven over every RPC of `kvmm.v1.Admin` (the list is
//! read from `admin.proto`, so a new RPC joins the table by itself):
//!
//! - the admin socket is `0660`: another uid cannot even connect;
//! - with the socket opened to everyone (a misconfigured socket unit), every RPC still answers a
//!   uid that is neither root nor in the admin group `PERMISSION_DENIED`, and nothing changes;
//! - a member of the configured admin group is served.
//!
//! Needs root (to run the caller as uid 65534 with `setpriv`); otherwise skipped with the reason.

#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use kvmm_tests::{Daemon, Worker, client_args, client_bin, fields, spawn_client};

fn as_nobody(args: &[String], groups: &str) -> Worker {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", "65534", "--regid", "65534"]);
    if groups.is_empty() {
        cmd.arg("--clear-groups");
    } else {
        cmd.args(["--groups", groups]);
    }
    Worker::spawn_cmd(cmd.arg("--").arg(client_bin()).args(args))
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

fn skip() -> bool {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: this scenario needs root to run a caller as another uid");
        return true;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        println!("skipped: setpriv (util-linux) is not installed");
        return true;
    }
    false
}

#[test]
fn every_admin_rpc_refuses_a_uid_that_is_not_an_administrator() {
    if skip() {
        return;
    }
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let mut c = spawn_client("run", &daemon, &["--tokens", "100", "--seed", "61"]);
    let session = fields(&c.expect_line("appended"))["session"].clone();
    let socket = daemon.dir().join("kvmm-admin.sock");
    let args = client_args("admin-all", &daemon, &["--admin-socket", socket.to_str().unwrap(), "--session", &session]);

    // The socket's mode keeps other uids out before any RPC.
    let mut out = as_nobody(&args, "");
    let line = out.expect_line("admin");
    assert!(line.starts_with("connect=") && line.contains("ermission denied"), "{line}");
    out.wait(Duration::from_secs(10));

    // Opened to everyone, the service itself refuses every RPC.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut out = as_nobody(&args, "");
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
    if skip() {
        return;
    }
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--admin-group", "nogroup"]);
    let socket = daemon.dir().join("kvmm-admin.sock");
    let args = client_args("admin-all", &daemon, &["--admin-socket", socket.to_str().unwrap(), "--session", "7"]);
    // uid 65534 with gid 65534 (nogroup): the socket's group lets it connect, the service serves it.
    let mut out = as_nobody(&args, "65534");
    let line = out.expect_line("admin");
    println!("nogroup member: {line}");
    let codes = fields(&format!("x {line}"));
    assert_eq!(codes["Status"], "Ok", "{line}");
    assert_eq!(codes["ListSessions"], "Ok", "{line}");
    assert_eq!(codes["Session"], "NotFound", "no session 7: {line}");
    out.wait(Duration::from_secs(10));
    assert!(daemon.stop().success());
}
