//! A Python process keeps its KV cache in a real kvmmd through `capi/python/kvmm.py`, the standard
//! library's ctypes over `libkvmm.so` (no gRPC stack in Python): `tests/python/capi_session.py`
//! attaches, appends from a list and from an `array('f')`, checks attention against its own
//! double-precision reference, gets `kvmm.Error` with the status and sentence for bad input, and a
//! process that dies leaves a lingering session another finds and resumes.
//!
//! The interpreter is `python3` on the `PATH`; without one the test says so and skips.

#![allow(clippy::unwrap_used)]

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kvmm_proto::v1::{ListSessionsRequest, Priority};
use kvmm_tests::{Daemon, libkvmm};

/// `python3`, or `None` after saying why the test skips.
fn python() -> Option<&'static str> {
    let found = Command::new("python3").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        println!("skipped: no python3 on the PATH");
    }
    found.then_some("python3")
}

/// Runs `capi_session.py MODE SOCKET` with the module and the library this package was built with
/// (it must succeed): the JSON object it prints.
fn run(python: &str, mode: &str, socket: &Path) -> serde_json::Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_owned();
    let out = Command::new(python)
        .arg(root.join("tests/python/capi_session.py"))
        .args([OsStr::new(mode), socket.as_os_str()])
        .env("PYTHONPATH", root.join("capi/python"))
        .env("KVMM_LIBRARY", libkvmm())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "capi_session.py {mode}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    println!("python {mode}: {stdout}");
    serde_json::from_str(stdout.trim()).unwrap()
}

#[test]
fn a_python_process_appends_and_attends_through_libkvmm_and_bad_input_raises_its_status() {
    let Some(python) = python() else { return };
    let daemon = Daemon::start(&[]);
    let r = run(python, "session", &daemon.socket());
    // Values f16 holds exactly: float rounding only.
    let worst = r["worst"].as_f64().unwrap();
    assert!(worst < 1e-5, "relative error {worst}");
    assert_eq!(r["tokens"], serde_json::json!([70, 70]));
    assert_eq!(r["geometry"]["block_tokens"], 32);
    assert_eq!(r["geometry"]["element"], "f16");
    assert_eq!(r["stats"]["tokens"], 70);
    // `Extend` hands out 4 pages a layer at a time; the prefetch named the 3 each layer fills.
    assert_eq!(r["stats"]["device_pages"], 8, "2 layers × 4 pages");
    assert_eq!(r["resident"], 6);
    assert!(r["wiped"].as_u64().unwrap() > 0);
    // Layer 1 was attended last: its 3 pages' mass sums to 1; no eviction, so nothing dropped.
    assert_eq!(r["mass"][0], 3);
    assert!((r["mass"][1].as_f64().unwrap() - 1.0).abs() < 1e-5, "{}", r["mass"]);
    assert_eq!(r["dropped"], serde_json::json!([]));
    assert!(r["wiped_tiers"][0].as_u64().unwrap() > 0, "{}", r["wiped_tiers"]);
    let says = |key: &str, text: &str| {
        let message = r[key].as_str().unwrap();
        assert!(message.contains(text), "{key}: {message:?} should say {text:?}");
    };
    says("bad_geometry", "kvmm_attach: invalid geometry: head_dim (20) must be a multiple of 16");
    says("out_of_range", "kvmm_attention: layer 2 is out of range: this session has layers 0..2");
    says("budget", "kvmm_set_page_budget: a page budget of 2 is too small");
    says("unknown", "kvmm_resume: kvmmd: session 987654 does not exist");
    says("detached", "was detached; attach a new one");
    says("after_wipe", "was wiped by this process; its data is gone");
    says("type_error", "k is a buffer of format 'd', not float32 ('f')");
    // 16-bit rows (an array('H') of f16 bits, a list of bf16 bits, a ctypes array) into an f16 and a
    // bf16 session: the same attention output, bit for bit, as f32 rows of the same values.
    assert_eq!(r["sixteen_same"], 6);
    let sixteen_errors: Vec<&str> =
        r["sixteen_errors"].as_array().unwrap().iter().map(|e| e.as_str().unwrap()).collect();
    let wanted = [
        "ValueError: element must be one of ['bf16', 'f16'] or None (floats), not 'f32'",
        "TypeError: k is a buffer of format 'f', not 16-bit ('e' or 'H' or 'h'): pass the 16-bit patterns",
        "TypeError: k must be a 16-bit buffer or a sequence of 16-bit values, not list",
    ];
    assert_eq!(sixteen_errors.len(), wanted.len(), "{sixteen_errors:?}");
    for (got, want) in sixteen_errors.iter().zip(wanted) {
        assert!(got.starts_with(want), "{got:?} should start with {want:?}");
    }
    // 70 tokens, 10 drafts taken back, 5 more: the output of a session that never held the drafts.
    assert_eq!(r["truncated"][0], 70);
    assert_eq!(r["truncated"][1], true, "the cut session reads differently");
    assert!(r["truncated"][2].as_str().unwrap().starts_with("tokens must be an int from 0"), "{}", r["truncated"]);
    let value_errors = r["value_errors"].as_array().unwrap();
    assert!(value_errors[0].as_str().unwrap().contains("kv_heads * head_dim = 192 floats"), "{value_errors:?}");
    assert!(
        value_errors[1].as_str().unwrap().contains("q must hold q_heads * head_dim = 576 floats"),
        "{value_errors:?}"
    );
    daemon.wait_drained();
}

#[test]
fn a_python_process_that_dies_leaves_a_lingering_session_that_another_resumes() {
    let Some(python) = python() else { return };
    let daemon = Daemon::start(&[]);
    let left = run(python, "leave", &daemon.socket());
    let sessions = daemon.admin(async |mut a| a.list_sessions(ListSessionsRequest {}).await.unwrap().into_inner());
    let s =
        sessions.sessions.iter().find(|s| Some(s.session_id) == left["id"].as_u64()).expect("the lingering session");
    assert_eq!(
        (s.model_id.as_str(), s.priority(), s.tokens, s.linger_ms),
        ("py-linger", Priority::Foreground, 45, 30000)
    );

    // kvmmd orphans the session once it has cleaned up the closed connection, after the exit.
    daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 1);
    let resumed = run(python, "resume", &daemon.socket());
    assert_eq!(resumed["id"], left["id"]);
    assert_eq!(resumed["tokens"], serde_json::json!([45, 45]));
    // The same attention over the pages the first process left, bit for bit.
    assert_eq!(resumed["checksum"], left["checksum"]);
    let refusal = resumed["refusal"].as_str().unwrap();
    assert!(refusal.contains("it was attached for another model; it is left as it was"), "{refusal}");
    daemon.wait_drained();
}
