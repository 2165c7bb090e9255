//! The operator CLI, `kvmmctl`, against a real daemon and real clients: every subcommand's `--json`
//! output agrees with what the harness's own admin calls return; the exit codes tell a missing
//! session or socket (4), a refused user (3), bad usage (2) and other failures (5) apart; `wipe --all`
//! is refused without `--yes` where nobody can confirm; `top` draws the tiers, the mode and the
//! sessions in a real terminal (tmux) and gives the terminal back on `q`.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvmm_proto::v1 as pb;
use kvmm_tests::{Daemon, fields, spawn_client, workspace_bin};
use serde_json::Value;

/// What one kvmmctl run left.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        assert_eq!(self.code, 0, "kvmmctl failed: {}", self.stderr);
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", self.stdout))
    }
}

fn kvmmctl_bin() -> PathBuf {
    workspace_bin("kvmmctl")
}

/// Runs kvmmctl with `args` (no `--socket` added, `$KVMM_ADMIN_SOCKET` unset), `stdin` piped in (or
/// /dev/null).
fn run(args: &[&str], stdin: Option<&str>) -> Run {
    run_cmd(Command::new(kvmmctl_bin()).args(args).env_remove("KVMM_ADMIN_SOCKET"), stdin)
}

fn run_cmd(cmd: &mut Command, stdin: Option<&str>) -> Run {
    let mut child = cmd
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(text) = stdin {
        child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn admin_socket(daemon: &Daemon) -> String {
    daemon.dir().join("kvmm-admin.sock").display().to_string()
}

/// Runs kvmmctl against `daemon`.
fn ctl(daemon: &Daemon, args: &[&str]) -> Run {
    ctl_in(daemon, args, None)
}

fn ctl_in(daemon: &Daemon, args: &[&str], stdin: Option<&str>) -> Run {
    let socket = admin_socket(daemon);
    let mut all = vec!["--socket", socket.as_str()];
    all.extend_from_slice(args);
    run(&all, stdin)
}

fn list_sessions(daemon: &Daemon) -> Vec<pb::SessionInfo> {
    daemon.admin(async |mut a| a.list_sessions(pb::ListSessionsRequest {}).await.unwrap().into_inner().sessions)
}

fn tier_bytes(s: &pb::SessionInfo, tier: &str) -> u64 {
    s.tiers.iter().find(|t| t.tier == tier).map_or(0, |t| t.bytes)
}

fn json_tier_bytes(s: &Value, tier: &str) -> u64 {
    s["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == tier).map_or(0, |t| t["bytes"].as_u64().unwrap())
}

/// The table row (human `sessions`, or `top`'s screen inside its border) whose first cell is `id`.
fn session_row<'a>(text: &'a str, id: &str) -> Option<&'a str> {
    text.lines().find(|l| l.trim_start_matches(['│', ' ']).split_whitespace().next() == Some(id))
}

fn daemon_with_tiers(extra: &[&str]) -> (Daemon, tempfile::TempDir) {
    let flash = tempfile::tempdir().unwrap();
    (Daemon::start_tiered("64MiB", flash.path(), extra), flash)
}

#[test]
fn every_read_and_policy_subcommand_agrees_with_the_admin_api() {
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), "[policy]\nmode = \"balanced\"\n").unwrap();
    let (daemon, _flash) = daemon_with_tiers(&["--config", config.path().to_str().unwrap()]);
    let mut a = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "41"]);
    let first: u64 = fields(&a.expect_line("appended"))["session"].parse().unwrap();
    let mut b = spawn_client("run", &daemon, &["--tokens", "100", "--seed", "42"]);
    let second: u64 = fields(&b.expect_line("appended"))["session"].parse().unwrap();
    daemon.demote_layers(first, 0..1, pb::Tier::Dram);

    // status
    let status = daemon.status();
    let s = ctl(&daemon, &["--json", "status"]).json();
    assert_eq!(s["pid"], daemon.pid());
    assert_eq!(s["sessions"], 2);
    assert_eq!(s["draining"], false);
    assert_eq!(s["policy"]["mode"], "balanced");
    assert_eq!(s["policy"]["mode"], status.policy.as_ref().unwrap().mode.as_str());
    let tiers = s["tiers"].as_array().unwrap();
    assert_eq!(tiers.len(), status.tiers.len());
    for (j, t) in tiers.iter().zip(&status.tiers) {
        assert_eq!(j["tier"], t.tier.as_str());
        assert_eq!(j["budget_bytes"], t.budget_bytes, "{}", t.tier);
        assert_eq!(j["used_bytes"], t.used_bytes, "{}", t.tier);
        assert_eq!(j["pages"], t.pages, "{}", t.tier);
        let pages: u64 = j["by_format"].as_array().unwrap().iter().map(|f| f["pages"].as_u64().unwrap()).sum();
        assert_eq!(pages, t.pages, "{}", t.tier);
    }
    assert_eq!(tiers[1]["tier"], "dram");
    assert!(tiers[1]["used_bytes"].as_u64().unwrap() > 0, "layer 0 was demoted to DRAM");
    let human = ctl(&daemon, &["status"]);
    assert_eq!(human.code, 0, "{}", human.stderr);
    for expected in ["device", "dram", "flash", "mode: balanced", "draining: no", "64.0 MiB", "I/O engine"] {
        assert!(human.stdout.contains(expected), "{expected:?} missing:\n{}", human.stdout);
    }

    // sessions and session
    let listed = list_sessions(&daemon);
    let j = ctl(&daemon, &["--json", "sessions"]).json();
    let js = j["sessions"].as_array().unwrap();
    assert_eq!(js.len(), 2);
    for want in &listed {
        let got = js.iter().find(|s| s["session_id"] == want.session_id).unwrap();
        assert_eq!(got["tokens"], want.tokens);
        assert_eq!(got["uid"], want.uid);
        assert_eq!(got["pid"], want.pid);
        assert_eq!(got["executable"], want.executable.as_str());
        assert_eq!(got["priority"], "PRIORITY_FOREGROUND");
        for tier in ["device", "dram", "flash"] {
            assert_eq!(json_tier_bytes(got, tier), tier_bytes(want, tier), "session {} {tier}", want.session_id);
        }
    }
    let one = ctl(&daemon, &["--json", "session", &first.to_string()]).json();
    assert_eq!(one["session_id"], first);
    assert_eq!(one["tokens"], 300);
    assert_eq!(one["geometry"]["layers"], 2);
    let want = listed.iter().find(|s| s.session_id == first).unwrap();
    assert!(tier_bytes(want, "dram") > 0);
    assert_eq!(json_tier_bytes(&one, "dram"), tier_bytes(want, "dram"));
    let dram = one["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == "dram").unwrap();
    assert!(dram["by_format"].as_array().unwrap().iter().any(|f| f["format"] == "q8"), "{one}");
    let human = ctl(&daemon, &["sessions"]);
    assert!(human.stdout.starts_with("ID") && human.stdout.contains("TOKENS"), "{}", human.stdout);
    for (id, tokens) in [(first, "300"), (second, "100")] {
        let row =
            session_row(&human.stdout, &id.to_string()).unwrap_or_else(|| panic!("no row {id}:\n{}", human.stdout));
        assert!(row.split_whitespace().any(|cell| cell == tokens), "{row}");
    }
    let human = ctl(&daemon, &["session", &first.to_string()]);
    assert!(human.stdout.contains(&format!("session {first}")) && human.stdout.contains("q8"), "{}", human.stdout);

    // policy get, set (a file, stdin), a refused one, reload
    let got = ctl(&daemon, &["--json", "policy", "get"]).json();
    assert!(got["policy_toml"].as_str().unwrap().contains("mode = \"balanced\""), "{got}");
    assert_eq!(got["status"]["mode"], "balanced");
    let text = ctl(&daemon, &["policy", "get"]);
    assert!(text.stdout.starts_with("# mode in force: balanced"), "{}", text.stdout);
    let file = tempfile::NamedTempFile::new().unwrap();
    // What `policy get` prints, `policy set` takes back (the mode line is a TOML comment).
    std::fs::write(file.path(), text.stdout.replace("mode = \"balanced\"", "mode = \"thermal\"")).unwrap();
    let set = ctl(&daemon, &["--json", "policy", "set", file.path().to_str().unwrap()]).json();
    assert_eq!(set["status"]["mode"], "thermal");
    assert_eq!(daemon.status().policy.unwrap().mode, "thermal");
    let set = ctl_in(&daemon, &["policy", "set", "-"], Some("mode = \"powersave\"\n"));
    assert_eq!(set.code, 0, "{}", set.stderr);
    assert!(set.stdout.contains("# mode in force: powersave") && set.stdout.contains("mode = \"powersave\""));
    assert_eq!(daemon.status().policy.unwrap().mode, "powersave");
    let bad = ctl_in(&daemon, &["policy", "set", "-"], Some("mode = \"turbo\"\n"));
    assert_eq!(bad.code, 5, "{bad:?}");
    assert!(bad.stderr.contains("INVALID_ARGUMENT") && bad.stderr.contains("turbo"), "{}", bad.stderr);
    assert_eq!(daemon.status().policy.unwrap().mode, "powersave", "a refused table changes nothing");
    let reloaded = ctl(&daemon, &["--json", "policy", "reload"]).json();
    assert_eq!(reloaded["policy"]["mode"], "balanced", "back to the file");
    assert_eq!(daemon.status().policy.unwrap().mode, "balanced");

    // drain and resume
    let d = ctl(&daemon, &["--json", "drain"]).json();
    assert_eq!(d["draining"], true);
    assert!(d["demoted_pages"].as_u64().unwrap() > 0, "{d}");
    assert!(daemon.status().draining);
    assert_eq!(ctl(&daemon, &["--json", "status"]).json()["draining"], true);
    let r = ctl(&daemon, &["drain", "--resume"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("resumed"), "{}", r.stdout);
    assert!(!daemon.status().draining);

    // metrics: the daemon's Prometheus text, as is.
    let m = ctl(&daemon, &["metrics"]);
    assert_eq!(m.code, 0, "{}", m.stderr);
    assert!(m.stdout.contains("# TYPE kvmm_daemon_sessions gauge"), "{}", m.stdout);
    assert!(m.stdout.contains("kvmm_daemon_sessions 2"), "{}", m.stdout);

    for w in [&mut a, &mut b] {
        w.send("exit");
        w.expect_line("detached");
    }
    assert!(daemon.stop().success());
}

#[test]
fn wipe_by_id_by_user_and_all_and_all_is_refused_without_yes_on_a_pipe() {
    let (daemon, _flash) = daemon_with_tiers(&[]);
    let mut a = spawn_client("run", &daemon, &["--tokens", "300", "--seed", "1"]);
    let first: u64 = fields(&a.expect_line("appended"))["session"].parse().unwrap();
    let mut b = spawn_client("run", &daemon, &["--tokens", "200", "--seed", "2"]);
    b.expect_line("appended");
    daemon.demote_layers(first, 0..1, pb::Tier::Dram);

    // No terminal to confirm on, no --yes: refused, nothing wiped.
    let refused = ctl(&daemon, &["wipe", "--all"]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("--yes") && refused.stderr.contains("nothing was wiped"), "{}", refused.stderr);
    assert_eq!(list_sessions(&daemon).len(), 2);
    assert_eq!(daemon.status().sessions, 2);

    // One session: the bytes wiped per tier are what it held.
    let before = list_sessions(&daemon).into_iter().find(|s| s.session_id == first).unwrap();
    let w = ctl(&daemon, &["--json", "wipe", &first.to_string()]).json();
    assert_eq!(w["sessions"], 1);
    assert_eq!(w["device_bytes"], tier_bytes(&before, "device"));
    assert_eq!(w["dram_bytes"], tier_bytes(&before, "dram"));
    assert!(w["dram_bytes"].as_u64().unwrap() > 0);
    assert_eq!(list_sessions(&daemon).len(), 1);

    // A user's sessions.
    let uid = rustix::process::geteuid().as_raw().to_string();
    let w = ctl(&daemon, &["wipe", "--user", &uid]);
    assert_eq!(w.code, 0, "{}", w.stderr);
    assert!(w.stdout.contains("wiped 1 session(s)") && w.stdout.contains("device"), "{}", w.stdout);
    assert!(list_sessions(&daemon).is_empty());

    // Everything, confirmed with --yes.
    let mut c = spawn_client("run", &daemon, &["--tokens", "50", "--seed", "3"]);
    c.expect_line("appended");
    let w = ctl(&daemon, &["--json", "wipe", "--all", "--yes"]).json();
    assert_eq!(w["sessions"], 1);
    assert!(w["device_bytes"].as_u64().unwrap() > 0);
    assert!(list_sessions(&daemon).is_empty());
    drop((a, b, c));
    assert!(daemon.stop().success());
}

#[test]
fn exit_codes_tell_not_found_usage_and_other_failures_apart() {
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);

    let missing = ctl(&daemon, &["session", "999999"]);
    assert_eq!(missing.code, 4, "{missing:?}");
    assert!(missing.stderr.contains("NOT_FOUND"), "{}", missing.stderr);
    assert_eq!(missing.stderr.lines().count(), 1, "one sentence: {}", missing.stderr);
    assert_eq!(ctl(&daemon, &["wipe", "999999"]).code, 4);

    // A missing socket, by flag and by $KVMM_ADMIN_SOCKET: the path tried and how to pass another.
    let gone = daemon.dir().join("nothing-here.sock");
    let r = run(&["--socket", gone.to_str().unwrap(), "status"], None);
    assert_eq!(r.code, 4, "{r:?}");
    assert!(r.stderr.contains(gone.to_str().unwrap()) && r.stderr.contains("--socket"), "{}", r.stderr);
    let r = run_cmd(Command::new(kvmmctl_bin()).arg("status").env("KVMM_ADMIN_SOCKET", &gone), None);
    assert_eq!(r.code, 4, "{r:?}");
    assert!(r.stderr.contains(gone.to_str().unwrap()), "{}", r.stderr);
    let r = run_cmd(
        Command::new(kvmmctl_bin()).args(["--json", "status"]).env("KVMM_ADMIN_SOCKET", admin_socket(&daemon)),
        None,
    );
    assert_eq!(r.json()["pid"], daemon.pid());

    // Bad usage is clap's 2.
    for args in [&["sessionz"][..], &["session", "x"], &["wipe"], &["drain", "--now"]] {
        assert_eq!(ctl(&daemon, args).code, 2, "{args:?}");
    }

    // A socket nobody listens on: the daemon is not running (5).
    let stale = daemon.dir().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let r = run(&["--socket", stale.to_str().unwrap(), "status"], None);
    assert_eq!(r.code, 5, "{r:?}");
    assert!(r.stderr.contains("is kvmmd running"), "{}", r.stderr);
    assert!(daemon.stop().success());
}

#[test]
fn a_user_outside_the_admin_group_is_refused_with_exit_3() {
    if !kvmm_tests::can_run_as_nobody() {
        return;
    }
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let socket = admin_socket(&daemon);
    let r = run_cmd(kvmm_tests::as_nobody(&kvmmctl_bin(), None).args(["--socket", &socket, "status"]), None);
    assert_eq!(r.code, 3, "{r:?}");
    assert!(r.stderr.contains("permission denied") && r.stderr.contains(&socket), "{}", r.stderr);
    assert!(daemon.stop().success());
}

/// Pages of `tier` in `format` that the admin API reports for session `id`.
fn pages_in(daemon: &Daemon, id: u64, tier: &str, format: &str) -> u64 {
    let s = list_sessions(daemon).into_iter().find(|s| s.session_id == id).unwrap();
    let t = s.tiers.iter().find(|t| t.tier == tier);
    t.and_then(|t| t.by_format.iter().find(|f| f.format == format)).map_or(0, |f| f.pages)
}

/// `compress` and `demote` re-encode and move a running client's pages: the counts match what the
/// admin API then reports, the client's attention stays within each format's bound (it checks
/// every output against its own K/V passed through the same quantizer) and faults demoted pages
/// back, pages left behind are told apart (not full, pinned, no room), and bad requests get the
/// daemon's sentence with the exit code of their gRPC code.
#[test]
fn compress_and_demote_re_encode_and_move_a_running_clients_pages() {
    let (daemon, _flash) = daemon_with_tiers(&[]);
    // 200 tokens a layer: 6 full pages, a tail of 8 and an empty page (Extend hands out 4 at a time)
    // in each of 2 layers.
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "200", "--seed", "9"]);
    let id = fields(&c.expect_line("appended"))["session"].clone();
    let session: u64 = id.parse().unwrap();

    let r = ctl(&daemon, &["--json", "compress", &id, "--format", "q8", "--layers", "0"]).json();
    assert_eq!((r["compressed"].as_u64(), r["skipped_not_full"].as_u64()), (Some(6), Some(2)), "{r}");
    assert!(r["bytes_after"].as_u64().unwrap() * 3 / 2 < r["bytes_before"].as_u64().unwrap(), "{r}");
    let human = ctl(&daemon, &["compress", &id, "--format", "k8v4", "--layers", "1", "--blocks", "1..4"]);
    assert_eq!(human.code, 0, "{human:?}");
    assert!(human.stdout.starts_with(&format!("session {id}: 3 page(s) re-encoded, ")), "{}", human.stdout);
    let again = ctl(&daemon, &["compress", &id, "--format", "q8", "--layers", "0"]);
    assert!(again.stdout.contains("6 skipped: already at or below the format"), "{}", again.stdout);
    assert!(again.stdout.contains("2 skipped: not full (the client is still writing them)"), "{}", again.stdout);
    assert_eq!((pages_in(&daemon, session, "device", "q8"), pages_in(&daemon, session, "device", "k8v4")), (6, 3));
    c.send("check 2");
    c.expect_line("checked");

    // Blocks 3.. of both layers to DRAM (3 q8 pages and 3 f16 ones, which take the mode's format;
    // the tail and the empty page stay), then layer 1's to flash.
    let r = ctl(&daemon, &["--json", "demote", &id, "--tier", "dram", "--blocks", "3.."]).json();
    assert_eq!((r["demoted"].as_u64(), r["skipped"].as_u64()), (Some(6), Some(4)), "{r}");
    assert_eq!((r["skipped_not_full"].as_u64(), r["skipped_pinned"].as_u64()), (Some(4), Some(0)), "{r}");
    let human = ctl(&daemon, &["demote", &id, "--tier", "flash", "--layers", "1", "--blocks", "3..6"]);
    assert_eq!(human.code, 0, "{human:?}");
    assert_eq!(human.stdout, format!("session {id}: 3 page(s) now in flash\n"));
    let info = list_sessions(&daemon).into_iter().find(|s| s.session_id == session).unwrap();
    assert_eq!((tier_bytes(&info, "dram") > 0, tier_bytes(&info, "flash") > 0), (true, true), "{info:?}");
    c.send("check 2");
    println!("after compress and demote: {}", c.expect_line("checked"));

    // Bad requests: the daemon's sentence, the exit code of its gRPC code.
    let missing = ctl(&daemon, &["compress", "999999", "--format", "q4"]);
    assert_eq!(missing.code, 4, "{missing:?}");
    let out_of_range = ctl(&daemon, &["compress", &id, "--format", "q4", "--layers", "2..4"]);
    assert_eq!(out_of_range.code, 5, "{out_of_range:?}");
    assert!(out_of_range.stderr.contains("INVALID_ARGUMENT") && out_of_range.stderr.contains("layers 0..2"));
    for args in [&["compress", &id][..], &["compress", &id, "--format", "f16"], &["demote", &id, "--tier", "device"]] {
        assert_eq!(ctl(&daemon, args).code, 2, "{args:?}");
    }
    // Why pages stay behind: a DRAM tier of 64 KiB holds only a few of a session's 12 full pages,
    // and a page a client holds pinned does not move.
    let small = Daemon::start(&["--device-budget", "64MiB", "--dram-budget", "64KiB"]);
    let mut big = spawn_client("run", &small, &["--layers", "2", "--tokens", "200", "--seed", "3"]);
    let big_id = fields(&big.expect_line("appended"))["session"].clone();
    let r = ctl(&small, &["--json", "demote", &big_id, "--tier", "dram"]).json();
    let (demoted, no_room) = (r["demoted"].as_u64().unwrap(), r["skipped_no_room"].as_u64().unwrap());
    println!("to a 64 KiB DRAM tier: {demoted} pages moved, {no_room} found no room");
    assert!(demoted >= 1 && no_room >= 1 && demoted + no_room == 12, "{r}");
    assert_eq!((r["skipped"].as_u64(), r["skipped_not_full"].as_u64()), (Some(16 - demoted), Some(4)), "{r}");
    let human = ctl(&small, &["demote", &big_id, "--tier", "dram"]);
    assert!(human.stdout.contains(&format!("{no_room} left: no room in DRAM")), "{}", human.stdout);
    let mut holder = spawn_client("hold-pin", &small, &[]);
    let held = fields(&holder.expect_line("pinned"))["session"].clone();
    holder.send("publish");
    holder.expect_line("published");
    let human = ctl(&small, &["demote", &held, "--tier", "dram"]);
    assert!(human.stdout.starts_with(&format!("session {held}: 0 page(s) now in dram\n")), "{}", human.stdout);
    assert!(human.stdout.contains("1 left: pinned by the client (try again)"), "{}", human.stdout);
    holder.send("exit");
    big.send("exit");
    big.expect_line("detached");
    assert!(small.stop().success());

    let plain = Daemon::start(&["--device-budget", "64MiB", "--dram-budget", "0"]);
    let mut p = spawn_client("run", &plain, &["--tokens", "40", "--seed", "2"]);
    let pid = fields(&p.expect_line("appended"))["session"].clone();
    let no_tier = ctl(&plain, &["demote", &pid, "--tier", "flash"]);
    assert_eq!(no_tier.code, 5, "{no_tier:?}");
    assert!(no_tier.stderr.contains("without a flash tier; configure tiers.flash_budget"), "{}", no_tier.stderr);
    p.send("exit");
    p.expect_line("detached");
    assert!(plain.stop().success());

    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}

#[test]
fn completions_name_every_subcommand() {
    for shell in ["bash", "zsh", "fish"] {
        let r = run(&["completions", shell], None);
        assert_eq!(r.code, 0, "{shell}: {}", r.stderr);
        let subcommands = [
            "status",
            "sessions",
            "session",
            "policy",
            "wipe",
            "compress",
            "demote",
            "drain",
            "metrics",
            "top",
            "completions",
        ];
        for sub in subcommands {
            assert!(r.stdout.contains(sub), "{shell} completions lack {sub}");
        }
    }
    assert_eq!(run(&["completions", "tcsh"], None).code, 2);
}

/// A private tmux server, killed however the test ends.
struct Tmux {
    name: String,
}

impl Tmux {
    fn cmd(&self) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.name]).env("TERM", "xterm-256color");
        c
    }

    fn screen(&self) -> String {
        let out = self.cmd().args(["capture-pane", "-p", "-t", "top"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Polls the screen until `pred` holds (at most 15 s).
    fn wait_screen(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let screen = self.screen();
            if pred(&screen) {
                return screen;
            }
            assert!(Instant::now() < deadline, "the pane never showed {what}:\n{screen}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").stderr(Stdio::null()).status();
    }
}

#[test]
fn top_shows_tiers_mode_and_sessions_in_a_terminal_and_q_gives_the_terminal_back() {
    if Command::new("tmux").arg("-V").output().is_err() {
        println!("skipped: tmux is not installed (CI installs it)");
        return;
    }
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--mode", "powersave"]);
    let mut c = spawn_client("run", &daemon, &["--tokens", "100"]);
    let session = fields(&c.expect_line("appended"))["session"].clone();
    let mode = daemon.status().policy.unwrap().mode;
    assert_eq!(mode, "powersave");

    // After top ends, the script reports its exit status and the terminal's line discipline.
    let script = daemon.dir().join("top.sh");
    std::fs::write(
        &script,
        format!(
            "'{}' --socket '{}' top --interval-ms 200\necho \"kvmmctl exited $?\"\n\
             echo \"tty: $(stty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\\n' ' ')\"\n\
             sleep 600\n",
            kvmmctl_bin().display(),
            admin_socket(&daemon)
        ),
    )
    .unwrap();
    let tmux = Tmux { name: format!("kvmmctl-test-{}", std::process::id()) };
    let started = tmux
        .cmd()
        .args(["-f", "/dev/null", "new-session", "-d", "-s", "top", "-x", "120", "-y", "40"])
        .arg(format!("sh '{}'", script.display()))
        .status()
        .unwrap();
    assert!(started.success());

    let screen = tmux.wait_screen("the session", |s| session_row(s, &session).is_some());
    println!("{screen}");
    for expected in [&format!("mode: {mode}")[..], "device", "dram", "sessions (1)", "TOKENS"] {
        assert!(screen.contains(expected), "{expected:?} missing from\n{screen}");
    }
    let row = session_row(&screen, &session).unwrap();
    assert!(row.contains("kvmm-test-clien") && row.split_whitespace().any(|c| c == "100"), "{row}");

    tmux.cmd().args(["send-keys", "-t", "top", "q"]).status().unwrap();
    let screen = tmux.wait_screen("kvmmctl's exit and the tty modes", |s| s.contains("tty: "));
    println!("{screen}");
    assert!(screen.contains("kvmmctl exited 0"), "{screen}");
    // The alternate screen is gone (the table is no longer shown) and raw mode is off.
    assert!(!screen.contains("TOKENS") && session_row(&screen, &session).is_none(), "{screen}");
    let tty = screen.lines().find_map(|l| l.strip_prefix("tty: ")).unwrap();
    assert_eq!(tty.split_whitespace().collect::<Vec<_>>(), ["icanon", "echo"], "{screen}");

    c.send("exit");
    c.expect_line("detached");
    assert!(daemon.stop().success());
}
