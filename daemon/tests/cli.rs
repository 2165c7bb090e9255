//! The `kvmmd` command line: help, version, and refusals of bad flags before anything is bound.
//! (Being an integration test of this package, it also makes `cargo test --workspace` build the
//! `kvmmd` binary that the scenarios in `tests/` run.)

#![allow(clippy::unwrap_used)]

use std::process::Command;

fn kvmmd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvmmd"))
}

#[test]
fn help_lists_every_flag() {
    let out = kvmmd().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--config",
        "--runtime-dir",
        "--device-budget",
        "--admin-group",
        "--fd-token-ttl-ms",
        "--compaction-interval-ms",
        "--log",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    assert!(!help.contains("debug-move-churn"), "test-only flags stay hidden");
}

#[test]
fn version_prints_the_crate_version() {
    let out = kvmmd().arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn a_bad_budget_is_refused_with_a_sentence() {
    let dir = tempfile::tempdir().unwrap();
    let out = kvmmd().arg("--runtime-dir").arg(dir.path()).args(["--device-budget", "4KiB"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at least") && err.contains("2 MiB"), "{err}");
    let out = kvmmd().args(["--device-budget", "12 parsecs"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("parsecs"));
    assert!(!dir.path().join("kvmm.sock").exists(), "nothing was bound");
}
