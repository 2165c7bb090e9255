//! The operator's view through the admin API, against a real daemon and real clients:
//! `ListSessions` and `Session` (owner, executable, geometry, tokens, bytes per tier and format),
//! `Status` by format, `GetPolicy`/`SetPolicy` (a `[policy]` table in TOML, validated, applied at
//! once, a bad one refused with nothing changed) and `Drain` (no new sessions or pages, every full
//! page off the device, then resumed).

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvmm_proto::v1 as pb;
use kvmm_tests::{Daemon, fields, spawn_client};

#[test]
fn operators_list_sessions_change_the_policy_and_drain() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_tiered("64MiB", flash.path(), &[]);
    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "41"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    daemon.demote_layers(session, 0..1, pb::Tier::Dram);

    let list = daemon.admin(async |mut a| a.list_sessions(pb::ListSessionsRequest {}).await.unwrap().into_inner());
    assert_eq!(list.sessions.len(), 1);
    let s = &list.sessions[0];
    println!("{s:?}");
    assert_eq!((s.session_id, s.uid, s.tokens), (session, rustix::process::geteuid().as_raw(), 300));
    assert_eq!(s.executable, "kvmm-test-clien");
    assert_eq!(s.geometry.as_ref().unwrap().layers, 2);
    let tier = |name: &str| s.tiers.iter().find(|t| t.tier == name).unwrap();
    // 9 full pages of layer 0 went down as q8 (sink and recent window exact, as f16).
    assert_eq!(tier("dram").pages, 9);
    let dram_formats: Vec<(&str, u64)> = tier("dram").by_format.iter().map(|f| (f.format.as_str(), f.pages)).collect();
    assert_eq!(dram_formats, vec![("f16", 5), ("q8", 4)], "{s:?}");
    // Pages come in batches of 4: 12 per layer, of which 9 full; layer 0 keeps its 3 others.
    assert_eq!(tier("device").pages, 3 + 12);
    let one = daemon.admin(async |mut a| a.session(pb::SessionRequest { session_id: session }).await.unwrap());
    assert_eq!(one.into_inner().tiers, s.tiers);
    let missing = daemon.admin(async |mut a| a.session(pb::SessionRequest { session_id: 999 }).await.unwrap_err());
    assert_eq!(missing.code(), tonic::Code::NotFound);
    let status = daemon.status();
    let dram = status.tiers.iter().find(|t| t.tier == "dram").unwrap();
    assert_eq!(dram.by_format.iter().map(|f| f.pages).sum::<u64>(), dram.pages);

    // Policy: read, set, refuse.
    let got = daemon.admin(async |mut a| a.get_policy(pb::GetPolicyRequest {}).await.unwrap().into_inner());
    assert!(got.policy_toml.contains("mode = \"auto\""), "{}", got.policy_toml);
    let set = |text: &str| {
        let request = pb::SetPolicyRequest { policy_toml: text.to_owned() };
        daemon.admin(async |mut a| a.set_policy(request).await.map(tonic::Response::into_inner))
    };
    let p = set("mode = \"powersave\"\n[[floor]]\nlayers = \"0\"\nformat = \"q8\"\n").unwrap();
    assert_eq!(p.status.as_ref().unwrap().mode, "powersave");
    assert!(p.policy_toml.contains("layers = \"0\"") && p.policy_toml.contains("format = \"q8\""), "{}", p.policy_toml);
    // What GetPolicy returns, SetPolicy takes back.
    assert_eq!(set(&p.policy_toml).unwrap().policy_toml, p.policy_toml);
    let bad = set("mode = \"turbo\"").unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("turbo"), "{bad:?}");
    let bad = set("modes = 1").unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert_eq!(daemon.status().policy.unwrap().mode, "powersave", "a refused table changes nothing");

    // Drain: every full page leaves the device, nothing new is admitted, then it resumes.
    let d = daemon.admin(async |mut a| a.drain(pb::DrainRequest { resume: false }).await.unwrap().into_inner());
    println!("{d:?}");
    assert!(d.draining && d.demoted_pages == 18, "every full page, now on flash: {d:?}");
    assert_eq!(d.left_on_device, 6, "each layer's tail page and its two empty ones");
    assert!(daemon.status().draining);
    let mut refused = spawn_client("run", &daemon, &["--tokens", "10"]);
    let e = refused.expect_line("error");
    assert_eq!(fields(&e)["code"], "Unavailable", "{e}");
    assert!(e.contains("draining"), "{e}");
    refused.wait(Duration::from_secs(10));
    // The running client still reads every page (faults work while draining).
    c.send("check 1");
    c.expect_line("checked");
    let d = daemon.admin(async |mut a| a.drain(pb::DrainRequest { resume: true }).await.unwrap().into_inner());
    assert!(!d.draining);
    let mut again = spawn_client("run", &daemon, &["--tokens", "10"]);
    again.expect_line("appended");
    for w in [&mut c, &mut again] {
        w.send("exit");
        w.expect_line("detached");
    }
    assert!(daemon.stop().success());
}
