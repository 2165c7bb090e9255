//! A second gRPC stack: a Python `grpcio` client, with stubs generated from the repo's `.proto`
//! files at run time, calls `Status` and `ListSessions` on a real daemon over the Unix socket, so
//! the API works outside Rust.
//!
//! The interpreter is `$KVMM_PYTHON` (`.ci/run` sets it to a virtual environment with grpcio and
//! grpcio-tools), else `~/.cache/kvmm/pyenv/bin/python`. Without either the test says so and skips;
//! with `$KVMM_PYTHON` set it must work.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

use kvmm_tests::{Daemon, fields, spawn_client};

fn python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVMM_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME").map(PathBuf::from)?;
    let venv = home.join(".cache/kvmm/pyenv/bin/python");
    venv.exists().then_some(venv)
}

#[test]
fn a_python_grpcio_client_reads_status_and_sessions() {
    let Some(python) = python() else {
        println!("skipped: no Python with grpcio (set KVMM_PYTHON; .ci/run makes one)");
        return;
    };
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let mut c = spawn_client("run", &daemon, &["--layers", "3", "--tokens", "77", "--seed", "51"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(&python)
        .arg(root.join("python/admin_client.py"))
        .arg(root.join("../proto/proto"))
        .arg(daemon.dir().join("kvmm-admin.sock"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}: {stdout}{}", python.display(), String::from_utf8_lossy(&out.stderr));
    println!("python saw: {stdout}");
    let seen: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(seen["sessions"], 1);
    assert_eq!(seen["tiers"]["device"], 64 << 20);
    assert!(seen["mode"].as_str().is_some_and(|m| !m.is_empty()));
    let listed = &seen["listed"][0];
    assert_eq!(
        (listed["id"].as_u64(), listed["tokens"].as_u64(), listed["layers"].as_u64()),
        (Some(session), Some(77), Some(3))
    );
    assert_eq!(listed["executable"], "kvmm-test-clien");
    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}
