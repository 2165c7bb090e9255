//! kvmmctl's command line without a daemon: help documents the exit codes, bad usage is exit 2,
//! a missing socket is exit 4 naming the path and `--socket`. (Being an integration test of this
//! package, it also makes `cargo test --workspace` build the `kvmmctl` binary that the scenarios
//! in `tests/tests/kvmmctl.rs` run.)

use std::process::{Command, Output};

fn kvmmctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvmmctl"))
        .args(args)
        .env_remove("KVMM_ADMIN_SOCKET")
        .output()
        .expect("run kvmmctl")
}

#[test]
fn help_documents_the_exit_codes_and_the_socket() {
    let out = kvmmctl(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    for expected in ["Exit codes:", "3  permission denied", "4  not found", "5  any other failure", "KVMM_ADMIN_SOCKET"]
    {
        assert!(text.contains(expected), "{expected:?} missing from --help:\n{text}");
    }
}

#[test]
fn bad_usage_is_exit_2() {
    for args in [&["frobnicate"][..], &["session", "not-a-number"], &["wipe"], &["wipe", "1", "--all"], &[]] {
        let out = kvmmctl(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn a_missing_socket_is_exit_4_and_says_which_path_and_how_to_pass_another() {
    let dir = std::env::temp_dir().join(format!("kvmmctl-none-{}", std::process::id()));
    let path = dir.join("kvmm-admin.sock");
    let out = kvmmctl(&["--socket", path.to_str().expect("utf-8 temp dir"), "status"]);
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(path.to_str().expect("utf-8")) && err.contains("--socket"), "{err}");
    assert_eq!(err.lines().count(), 1, "one sentence: {err}");
}
