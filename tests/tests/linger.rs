//! Lingering sessions: a session attached with `linger_ms` outlives its client's connection, and a
//! new process of the same uid takes it over with `Resume`, finding its pages, token counts and
//! K/V intact and carrying on appending. While it waits it is reported as orphaned (Status,
//! ListSessions, kvmmctl), serves nothing but `Resume`, and the pins its dead process held no
//! longer keep its pages from moving; once its linger time has run out it is wiped, and a late
//! `Resume` is told so. An `Attach` asking for more than `max_linger_ms` is refused. A process of
//! the same uid finds the orphans it may resume with `ListOrphans` (by model id, newest first;
//! another uid sees none) and may end one with `Detach` or `Wipe` instead of resuming it.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kvmm_proto::v1::{ListSessionsRequest, PageFormat, SessionInfo};
use kvmm_tests::{Daemon, fields, spawn_client};

fn session_info(daemon: &Daemon, id: u64) -> Option<SessionInfo> {
    let listed = daemon.admin(async |mut a| a.list_sessions(ListSessionsRequest {}).await.unwrap().into_inner());
    listed.sessions.into_iter().find(|s| s.session_id == id)
}

/// `run --resume ID` with the first process's seed and token count: its `error` line, after which
/// it must exit 2.
fn refused_resume(daemon: &Daemon, id: &str) -> String {
    let mut late = spawn_client("run", daemon, &["--resume", id, "--tokens", "100", "--seed", "7"]);
    let line = late.expect_line("error");
    assert_eq!(late.wait(Duration::from_secs(10)).code(), Some(2), "{line}");
    line
}

#[test]
fn a_lingering_session_outlives_its_client_and_a_new_process_takes_it_over() {
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--dram-budget", "0", "--pin-lease-ms", "400"]);
    assert_eq!(daemon.status().max_linger_ms, 300_000, "the default");

    // 100 tokens (three full pages and a tail of four per layer), no attention: the K/V depends on
    // the seed alone, so the next process can rebuild its own copy.
    let args = ["--linger-ms", "30000", "--tokens", "100", "--no-attend", "--seed", "7"];
    let mut first = spawn_client("run", &daemon, &args);
    let id = fields(&first.expect_line("attached"))["session"].clone();
    let session: u64 = id.parse().unwrap();
    first.expect_line("appended");
    let bytes = daemon.status().session_bytes;
    assert!(bytes > 0);
    let info = session_info(&daemon, session).unwrap();
    assert_eq!((info.linger_ms, info.orphaned_ms), (30_000, 0), "{info:?}");

    // While its connection lives, nobody else takes it over.
    let refusal = refused_resume(&daemon, &id);
    assert!(refusal.contains("code=FailedPrecondition") && refusal.contains("attached through a live connection"));

    // The client dies: the session stays, orphaned, with all its pages.
    first.kill9();
    let (s, waited) = daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 1);
    println!("orphaned {waited:?} after the kill");
    assert_eq!((s.sessions, s.session_bytes), (1, bytes), "{s:?}");
    let info = session_info(&daemon, session).unwrap();
    assert!(info.orphaned_ms > 0 && info.linger_ms == 30_000 && info.tokens == 100, "{info:?}");
    let human = daemon.kvmmctl(&["session", &id]);
    assert!(human.contains("orphaned: its connection closed") && human.contains("wiped after 30.0s"), "{human}");
    let status: serde_json::Value = serde_json::from_str(&daemon.kvmmctl(&["--json", "status"])).unwrap();
    assert_eq!((status["orphaned_sessions"].as_u64(), status["max_linger_ms"].as_u64()), (Some(1), Some(300_000)));
    assert!(daemon.kvmmctl(&["status"]).contains("orphaned sessions: 1 waiting for a Resume"));
    let listed = daemon.kvmmctl(&["sessions"]);
    let row = listed.lines().find(|l| l.trim_start().starts_with(&id)).unwrap_or_else(|| panic!("{listed}"));
    assert!(row.contains(" gone "), "an orphan's PID reads gone: {listed}");
    assert!(daemon.log().contains("session kept for a Resume"), "{}", daemon.log());

    // A new process takes it over: the token counts came along, every layer's attention matches its
    // own copy of the K/V, and appending carries on from token 100 (into the tail page).
    let mut second = spawn_client("run", &daemon, &["--resume", &id, "--tokens", "100", "--seed", "7"]);
    let resumed = fields(&second.expect_line("resumed"));
    assert_eq!((resumed["session"].as_str(), resumed["tokens"].as_str()), (id.as_str(), "100"), "{resumed:?}");
    assert_eq!(daemon.status().orphaned_sessions, 0);
    second.send("check 3");
    println!("{}", second.expect_line("checked"));
    second.send("append 60");
    let appended = fields(&second.expect_line("appended"));
    println!("after resuming: {appended:?}");
    let info = session_info(&daemon, session).unwrap();
    assert_eq!((info.tokens, info.orphaned_ms), (160, 0), "{info:?}");
    assert_eq!(info.pid as u32, second.pid(), "the session is the new process's now");

    // Detach ends it at once, linger or not.
    second.send("exit");
    second.expect_line("detached");
    assert!(second.wait(Duration::from_secs(10)).success());
    let s = daemon.wait_drained();
    assert_eq!((s.sessions, s.orphaned_sessions, s.tiers[0].used_bytes), (0, 0, 0), "{s:?}");
    assert!(daemon.stop().success());
}

#[test]
fn an_orphan_no_one_resumes_is_wiped_and_its_dead_process_pins_hold_nothing() {
    let daemon = Daemon::start(&[
        "--device-budget",
        "64MiB",
        "--dram-budget",
        "0",
        "--pin-lease-ms",
        "400",
        "--max-linger-ms",
        "2000",
    ]);

    // Asking for more than the daemon allows is refused, and says what is allowed.
    let mut greedy = spawn_client("raw-attach", &daemon, &["--linger-ms", "5000"]);
    let refusal = greedy.expect_line("error");
    assert_eq!(greedy.wait(Duration::from_secs(10)).code(), Some(2));
    println!("{refusal}");
    assert!(refusal.contains("code=InvalidArgument") && refusal.contains("at most 2000 ms (max_linger_ms)"));

    // A process pins its only (full) page and dies holding the pin.
    let mut holder = spawn_client("hold-pin", &daemon, &["--layers", "1", "--linger-ms", "1500"]);
    let id = fields(&holder.expect_line("pinned"))["session"].clone();
    let session: u64 = id.parse().unwrap();
    holder.send("publish");
    holder.expect_line("published");
    let pinned = daemon.compress(session, PageFormat::Q8);
    assert_eq!((pinned.compressed, pinned.skipped_pinned), (0, 1), "pinned while its process lives: {pinned:?}");
    holder.kill9();
    let killed = Instant::now();
    daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 1);

    // Its pin died with it: the page moves, and no pin is reported stuck.
    let moved = daemon.compress(session, PageFormat::Q8);
    assert_eq!((moved.compressed, moved.skipped_pinned), (1, 0), "the dead process's pin holds nothing: {moved:?}");
    assert_eq!(daemon.status().stuck_pins, 0);

    // Nobody resumes it: wiped once its linger time has run out.
    let (s, _) = daemon.wait_status(Duration::from_secs(10), |s| s.sessions == 0);
    let after = killed.elapsed();
    println!("wiped {after:?} after its client was killed (linger 1500 ms)");
    assert!(after >= Duration::from_millis(1500), "wiped before its linger ran out: {after:?}");
    assert_eq!((s.orphaned_sessions, s.session_bytes), (0, 0), "{s:?}");
    assert!(session_info(&daemon, session).is_none());
    let log = daemon.log();
    assert!(log.contains("no process resumed the session within its linger time"), "{log}");

    // A late Resume hears why.
    let late = refused_resume(&daemon, &id);
    assert!(late.contains("code=FailedPrecondition") && late.contains("no process resumed it within its linger"));
    let s = daemon.wait_drained();
    assert_eq!(s.tiers[0].used_bytes, 0, "{s:?}");
    assert!(daemon.stop().success());
}

#[test]
fn an_orphans_pages_leave_the_device_first_and_come_back_when_it_is_resumed() {
    let daemon = Daemon::start(&["--device-budget", "32MiB", "--dram-budget", "32MiB", "--max-linger-ms", "60000"]);
    // Sessions of about 12 MB: 6 layers × 2,600 tokens (81 full pages per layer). The one that
    // will be orphaned attaches last, so by age alone its pages would go last.
    let args = |seed: &'static str, linger: &'static str| {
        vec!["--layers", "6", "--tokens", "2600", "--no-attend", "--seed", seed, "--linger-ms", linger]
    };
    let mut kept = spawn_client("run", &daemon, &args("41", "0"));
    let attached: u64 = fields(&kept.expect_line("attached"))["session"].parse().unwrap();
    kept.expect_line("appended");
    let mut gone = spawn_client("run", &daemon, &args("7", "60000"));
    let id = fields(&gone.expect_line("attached"))["session"].clone();
    let orphan: u64 = id.parse().unwrap();
    gone.expect_line("appended");
    gone.kill9();
    daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 1);
    let device_pages = |id: u64| {
        let info = session_info(&daemon, id).unwrap();
        info.tiers.iter().find(|t| t.tier == "device").map_or(0, |t| t.pages)
    };
    let (kept_before, orphan_before) = (device_pages(attached), device_pages(orphan));

    // A third session pushes the device past its high watermark (90% of 32 MiB): the drain to the
    // low watermark moves about 8 MB, less than the orphan holds, so only the orphan's pages go,
    // although it is as much a foreground session as the others.
    let mut third = spawn_client("run", &daemon, &["--layers", "6", "--tokens", "1800", "--no-attend", "--seed", "9"]);
    third.expect_line("appended");
    let (s, _) = daemon.wait_status(Duration::from_secs(10), |s| s.tiers[0].used_bytes <= (32 << 20) / 100 * 85);
    let (kept_after, orphan_after) = (device_pages(attached), device_pages(orphan));
    println!("device pages: attached {kept_before} -> {kept_after}, orphaned {orphan_before} -> {orphan_after}");
    assert!(s.tiers[0].used_bytes <= (32 << 20) / 100 * 85, "{s:?}");
    assert_eq!(kept_after, kept_before, "the attached session kept every page on the device");
    assert!(orphan_after < orphan_before, "the orphan's pages went to DRAM");

    // Resumed, it reads every page again, wherever it went (faulted back, in the format it was
    // demoted to), and the output matches its own copy of the K/V through that format.
    let mut back = spawn_client("run", &daemon, &["--resume", &id, "--layers", "6", "--tokens", "2600", "--seed", "7"]);
    back.expect_line("resumed");
    back.send("check 1");
    let checked = fields(&back.expect_line("checked"));
    println!("resumed after demotion: {checked:?}");
    assert!(checked["faults"].parse::<u64>().unwrap() > 0, "{checked:?}");
    for mut c in [kept, third, back] {
        c.send("exit");
        c.expect_line("detached");
    }
    assert!(daemon.stop().success());
}

#[test]
fn a_process_finds_the_sessions_its_uid_left_and_may_discard_them_instead() {
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--dram-budget", "0"]);
    // Three sessions of this uid are left behind: two for the model "chat" (the second left last)
    // and one for "code"; a fourth, of "chat" too, is still attached.
    let left = |model: &str, tokens: &str| {
        let mut c = spawn_client(
            "run",
            &daemon,
            &["--linger-ms", "30000", "--model-id", model, "--tokens", tokens, "--no-attend", "--seed", "7"],
        );
        let id: u64 = fields(&c.expect_line("attached"))["session"].parse().unwrap();
        c.expect_line("appended");
        let pid = c.pid();
        c.kill9();
        (id, pid)
    };
    let (older, older_pid) = left("chat", "100");
    let (code, _) = left("code", "50");
    let (newer, newer_pid) = left("chat", "40");
    let mut live = spawn_client("run", &daemon, &["--linger-ms", "30000", "--model-id", "chat", "--tokens", "10"]);
    let attached: u64 = fields(&live.expect_line("attached"))["session"].parse().unwrap();
    live.expect_line("appended");
    daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 3);

    // A new process of this uid finds what it left, newest first, by model.
    let client = kvmm_client::Client::connect(daemon.socket()).unwrap();
    let chat = client.orphans(Some("chat")).unwrap();
    println!("{chat:#?}");
    let ids: Vec<u64> = chat.iter().map(|o| o.session_id).collect();
    assert_eq!(ids, [newer, older], "only orphans, only of the model asked for, newest first");
    let (n, o) = (&chat[0], &chat[1]);
    assert_eq!((n.tokens, o.tokens), (40, 100));
    assert_eq!((n.pid as u32, o.pid as u32), (newer_pid, older_pid));
    assert_eq!(n.model_id, "chat");
    assert_eq!(n.linger, Duration::from_secs(30));
    assert!(n.orphaned_for < o.orphaned_for, "{chat:?}");
    assert!(n.expires_in > Duration::ZERO && n.expires_in + n.orphaned_for <= n.linger + Duration::from_millis(1));
    assert!(n.fits(&(&n.geometry).into()) && n.geometry.layers > 0);
    let info = session_info(&daemon, older).unwrap();
    let tier_bytes: u64 = info.tiers.iter().map(|t| t.bytes).sum();
    assert_eq!((o.bytes, o.tokens), (tier_bytes, info.tokens), "{info:?}");
    assert!(o.allocated_blocks >= 100u32.div_ceil(o.geometry.block_tokens), "{o:?}");
    let all: Vec<u64> = client.orphans(None).unwrap().iter().map(|o| o.session_id).collect();
    assert_eq!(all, [newer, code, older]);
    assert!(client.orphans(Some("nothing")).unwrap().is_empty());

    // Another uid is shown none of them and can end none of them.
    if kvmm_tests::can_run_as_nobody() {
        let args = kvmm_tests::client_args("foreign", &daemon, &["--session", &older.to_string()]);
        let mut foreign =
            kvmm_tests::Worker::spawn_cmd(kvmm_tests::as_nobody(&kvmm_tests::client_bin(), None).args(&args));
        let verdict = fields(&format!("x {}", foreign.expect_line("foreign")));
        assert!(foreign.wait(Duration::from_secs(10)).success());
        println!("uid 65534 on uid 0's orphan: {verdict:?}");
        for rpc in ["detach", "wipe", "resume"] {
            assert_eq!(verdict[rpc], "PermissionDenied", "{rpc}: {verdict:?}");
        }
        assert_eq!(verdict["orphans"], "0");
        assert_eq!(daemon.status().orphaned_sessions, 3);
    }

    // This uid may end an orphan without resuming it: Detach from any of its connections frees its
    // pages now rather than when its linger runs out, and it is gone for good.
    let before = daemon.status().session_bytes;
    let wiped = client.discard(older).unwrap();
    assert_eq!(wiped, tier_bytes);
    let s = daemon.status();
    assert_eq!((s.orphaned_sessions, s.session_bytes), (2, before - tier_bytes), "{s:?}");
    let gone = client.resume(older, None).unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone}");
    // ... and so may its Wipe.
    let mut rpc = client.rpc();
    let report = client.block_on(rpc.wipe(kvmm_proto::v1::WipeRequest { session_id: code })).unwrap().into_inner();
    assert_eq!(report.sessions, 1);
    let gone = client.resume(code, None).unwrap_err();
    assert_eq!(gone.code(), tonic::Code::FailedPrecondition, "{gone}");
    assert!(gone.to_string().contains("wiped at its owner's request"), "{gone}");
    // A session still attached through its own connection is not another connection's to end.
    let refused = client.discard(attached).unwrap_err();
    println!("{refused}");
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused}");
    assert_eq!(daemon.status().sessions, 2);

    // What is left is still resumable: the newer chat session, with its 40 tokens.
    let resumed = client.resume(newer, None).unwrap();
    assert_eq!(resumed.tokens(0), 40);
    assert!(client.orphans(None).unwrap().is_empty());
    drop(resumed);
    live.send("exit");
    live.expect_line("detached");
    let s = daemon.wait_drained();
    assert_eq!((s.sessions, s.tiers[0].used_bytes), (0, 0), "{s:?}");
    assert!(daemon.stop().success());
}
