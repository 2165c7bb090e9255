//! A second gRPC stack: Python `grpcio` clients, with stubs generated from the repo's `.proto` files
//! at run time, on a real daemon over its Unix sockets, so the API works outside Rust: the admin
//! socket's `Status` and `ListSessions`, and the session socket and fd socket end to end (attach,
//! memfds by `SCM_RIGHTS`, K/V written in place, a lingering session resumed by another process).
//!
//! The interpreter is `$KVMM_PYTHON` (`.ci/run` sets it to a virtual environment with grpcio and
//! grpcio-tools), else `~/.cache/kvmm/pyenv/bin/python`. Without either the test says so and skips;
//! with `$KVMM_PYTHON` set it must work.

#![allow(clippy::unwrap_used)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvmm_tests::{Daemon, fields, spawn_client};

/// The interpreter, or `None` after saying why the test skips.
fn python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVMM_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let venv = std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/kvmm/pyenv/bin/python"));
    let found = venv.filter(|v| v.exists());
    if found.is_none() {
        println!("skipped: no Python with grpcio (set KVMM_PYTHON; .ci/run makes one)");
    }
    found
}

/// Runs `tests/python/SCRIPT PROTO_DIR ARGS...` (it must succeed): the JSON object it prints.
fn run_script(python: &Path, script: &str, args: &[&OsStr]) -> serde_json::Value {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python)
        .arg(root.join("python").join(script))
        .arg(root.join("../proto/proto"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{script} {args:?}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    println!("python {script}: {stdout}");
    serde_json::from_str(stdout.trim()).unwrap()
}

#[test]
fn a_python_grpcio_client_reads_status_and_sessions() {
    let Some(python) = python() else { return };
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let mut c = spawn_client("run", &daemon, &["--layers", "3", "--tokens", "77", "--seed", "51"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    let seen = run_script(&python, "admin_client.py", &[daemon.dir().join("kvmm-admin.sock").as_os_str()]);
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

/// Runs `tests/python/session_client.py RUNTIME_DIR ARGS...` against `daemon`.
fn session_client(python: &Path, daemon: &Daemon, args: &[&str]) -> serde_json::Value {
    let mut all = vec![daemon.dir().as_os_str()];
    all.extend(args.iter().map(OsStr::new));
    run_script(python, "session_client.py", &all)
}

/// A Python process attaches a lingering session, receives its memfds on the fd socket, checks the
/// table's header and entries against the ABI, writes K/V rows into every page in place in the
/// kernels' page layout (after checking each page's header), publishes 40 tokens a layer and leaves
/// without detaching. kvmmd counts the tokens it published; a second Python process lists the
/// orphan, resumes it with its shape, finds every page byte for byte as the first left it (wherever
/// the table now places it), reads the token counts back, and detaches.
#[test]
fn a_python_process_writes_kv_in_place_and_another_resumes_the_session_it_left() {
    let Some(python) = python() else { return };
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let left = session_client(&python, &daemon, &["leave"]);
    assert_eq!(left["refused"]["code"], "INVALID_ARGUMENT", "{left}");
    assert!(left["refused"]["message"].as_str().unwrap().contains("at most 300000 ms (max_linger_ms)"), "{left}");
    let session = left["session"].as_u64().unwrap();
    assert_eq!((left["linger_ms"].as_u64(), left["allocated_blocks"].as_u64()), (Some(30_000), Some(2)), "{left}");
    assert_eq!((left["table_status"].as_u64(), left["tokens"].as_u64()), (Some(0), Some(40)), "{left}");

    let (s, _) = daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 1);
    assert_eq!((s.sessions, s.orphaned_sessions), (1, 1), "{s:?}");
    assert_eq!(Some(s.session_bytes), left["device_bytes"].as_u64(), "{s:?}");

    let digests: Vec<&str> = left["digests"].as_array().unwrap().iter().map(|d| d.as_str().unwrap()).collect();
    assert_eq!(digests.len(), 4, "two pages in each of two layers: {left}");
    let took = session_client(&python, &daemon, &["take", &digests.join(",")]);
    let orphan = &took["orphans"][0];
    assert_eq!(took["orphans"].as_array().map(Vec::len), Some(1), "{took}");
    assert_eq!((orphan["session"].as_u64(), orphan["tokens"].as_u64()), (Some(session), Some(40)), "{took}");
    assert_eq!((orphan["allocated_blocks"].as_u64(), orphan["linger_ms"].as_u64()), (Some(2), Some(30_000)));
    assert_eq!(orphan["bytes"].as_u64(), Some(s.session_bytes), "{took}");
    assert_eq!((took["resumed"].as_u64(), took["allocated_blocks"].as_u64()), (Some(session), Some(2)), "{took}");
    assert_eq!(took["kv_intact"], true, "every page reads back as the first process left it: {took}");
    assert_eq!(took["token_counts"], serde_json::json!([32, 8, 32, 8]), "{took}");
    assert_eq!(took["bytes_wiped"].as_u64(), Some(s.session_bytes), "{took}");
    let s = daemon.wait_drained();
    assert_eq!((s.sessions, s.orphaned_sessions, s.session_bytes), (0, 0, 0), "{s:?}");
    assert!(daemon.stop().success());
}
