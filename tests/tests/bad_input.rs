//! Bad input gets a precise gRPC code and a sentence, and the daemon keeps serving the others: a
//! bystander client runs reference-checked attention throughout and must finish clean.

#![allow(clippy::unwrap_used)]

use std::os::fd::OwnedFd;
use std::time::Duration;

use kvmm_client::session::geometry_to_pb;
use kvmm_client::{Client, ElementType, Geometry, proto as pb};
use kvmm_shm::fdpass::{FdRequest, ReceivedReply, SeqpacketConn};
use kvmm_shm::{Access, Mapping, Memfd};
use kvmm_tests::{Daemon, fields, spawn_client};
use tonic::Code;

fn geometry() -> Geometry {
    Geometry {
        layers: 2,
        kv_heads: 2,
        q_heads: 4,
        head_dim: 32,
        block_tokens: 32,
        element_type: ElementType::F16,
        max_tokens: 64,
    }
}

fn expect_status<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, words: &[&str]) -> String {
    let s = r.expect_err("the request must be refused");
    assert_eq!(s.code(), code, "{s:?}");
    for w in words {
        assert!(s.message().contains(w), "'{}' should mention '{w}'", s.message());
    }
    assert!(s.message().len() > 20, "a sentence, not a code: {}", s.message());
    s.message().to_owned()
}

fn attach(client: &Client, g: pb::Geometry) -> Result<pb::AttachResponse, tonic::Status> {
    let mut rpc = client.rpc();
    client
        .block_on(rpc.attach(pb::AttachRequest {
            geometry: Some(g),
            model_id: "bad-input".into(),
            ..Default::default()
        }))
        .map(tonic::Response::into_inner)
}

enum Reply {
    Granted(Vec<OwnedFd>),
    Refused(Code, String),
}

fn present(daemon: &Daemon, bytes: &[u8]) -> Reply {
    let conn = SeqpacketConn::connect(&daemon.dir().join("kvmm-fd.sock")).unwrap();
    conn.set_timeouts(Duration::from_secs(5)).unwrap();
    conn.send(bytes, &[]).unwrap();
    match conn.recv_reply().unwrap() {
        ReceivedReply::Granted(m) => {
            Reply::Granted(vec![m.arena.into_owned_fd(), m.table.into_owned_fd(), m.client_region.into_owned_fd()])
        }
        ReceivedReply::Refused { code, message } => Reply::Refused(Code::from(code as i32), message),
    }
}

fn token_of(r: &pb::AttachResponse) -> Vec<u8> {
    FdRequest { session_id: r.session_id, token: r.fd_token.as_slice().try_into().unwrap() }.encode().to_vec()
}

fn expect_refused(reply: Reply, code: Code, word: &str) -> String {
    match reply {
        Reply::Granted(_) => panic!("memfds were handed out"),
        Reply::Refused(c, msg) => {
            assert_eq!(c, code, "{msg}");
            assert!(msg.contains(word), "'{msg}' should mention '{word}'");
            msg
        }
    }
}

#[test]
fn every_bad_request_gets_a_precise_code_and_the_daemon_keeps_serving() {
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--fd-token-ttl-ms", "300"]);
    let mut bystander = spawn_client("run", &daemon, &["--tokens", "150", "--seed", "8"]);
    bystander.expect_line("appended");
    bystander.send("loop");

    let client = Client::connect(daemon.socket()).unwrap();
    let good = geometry_to_pb(&geometry());
    let mut messages = Vec::new();

    // Malformed geometry: each rule, each its own sentence.
    let cases: [(pb::Geometry, &[&str]); 8] = [
        (pb::Geometry { q_heads: 5, ..good }, &["q_heads", "multiple", "kv_heads"]),
        (pb::Geometry { head_dim: 24, ..good }, &["head_dim", "24"]),
        (pb::Geometry { head_dim: 512, ..good }, &["head_dim", "512"]),
        (pb::Geometry { block_tokens: 12, ..good }, &["block_tokens", "power of two"]),
        (pb::Geometry { layers: 0, ..good }, &["layers"]),
        (pb::Geometry { max_tokens: 0, ..good }, &["max_tokens"]),
        (pb::Geometry { kv_heads: 0, q_heads: 0, ..good }, &["kv_heads"]),
        (pb::Geometry { element_type: 9, ..good }, &["element_type", "9"]),
    ];
    for (g, words) in cases {
        messages.push(expect_status(attach(&client, g), Code::InvalidArgument, words));
    }
    let mut rpc = client.rpc();
    let no_geometry = client.block_on(rpc.attach(pb::AttachRequest::default()));
    messages.push(expect_status(no_geometry, Code::InvalidArgument, &["geometry"]));

    // Unknown session.
    let r = client.block_on(rpc.extend(pb::ExtendRequest { session_id: 987_654, blocks: 1 }));
    messages.push(expect_status(r, Code::NotFound, &["987654"]));
    let r = client.block_on(rpc.session_stats(pb::SessionStatsRequest { session_id: 987_654 }));
    expect_status(r, Code::NotFound, &["987654"]);

    // Extend past the geometry (max_tokens 64 at 32 per block is 2 blocks), and zero blocks.
    let s = attach(&client, good).unwrap();
    client.block_on(rpc.extend(pb::ExtendRequest { session_id: s.session_id, blocks: 2 })).unwrap();
    let r = client.block_on(rpc.extend(pb::ExtendRequest { session_id: s.session_id, blocks: 1 }));
    messages.push(expect_status(r, Code::InvalidArgument, &["past the geometry", "max_tokens"]));
    let r = client.block_on(rpc.extend(pb::ExtendRequest { session_id: s.session_id, blocks: 0 }));
    expect_status(r, Code::InvalidArgument, &["at least 1"]);
    let r = client.block_on(
        rpc.fault(pb::FaultRequest { session_id: s.session_id, pages: vec![pb::PageRef { layer: 0, block: 7 }] }),
    );
    messages.push(expect_status(r, Code::InvalidArgument, &["block 7"]));
    let r = client.block_on(
        rpc.fault(pb::FaultRequest { session_id: s.session_id, pages: vec![pb::PageRef { layer: 2, block: 0 }] }),
    );
    expect_status(r, Code::InvalidArgument, &["layer 2"]);

    // The token: granted once to this process; a replay is refused.
    let Reply::Granted(fds) = present(&daemon, &token_of(&s)) else { panic!("the attaching process gets its fds") };
    messages.push(expect_refused(present(&daemon, &token_of(&s)), Code::FailedPrecondition, "already used"));

    // Seals: the arena cannot be resized, the table cannot be mapped writable.
    let arena = Memfd::from_fd(fds[0].try_clone().unwrap()).unwrap();
    let err = rustix::fs::ftruncate(&fds[0], arena.len() * 2).unwrap_err();
    assert_eq!(err, rustix::io::Errno::PERM, "ftruncate on the arena must fail");
    assert_eq!(rustix::fs::ftruncate(&fds[0], 0).unwrap_err(), rustix::io::Errno::PERM);
    let table = Memfd::from_fd(fds[1].try_clone().unwrap()).unwrap();
    assert!(Mapping::map(&table, Access::ReadWrite).is_err(), "the session table is read-only for clients");
    assert_eq!(rustix::fs::ftruncate(&fds[1], 0).unwrap_err(), rustix::io::Errno::PERM);

    // An expired token.
    let late = attach(&client, good).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    messages.push(expect_refused(present(&daemon, &token_of(&late)), Code::FailedPrecondition, "expired"));

    // A token presented from another process.
    let stolen = attach(&client, good).unwrap();
    let hex: String = stolen.fd_token.iter().map(|b| format!("{b:02x}")).collect();
    let id = stolen.session_id.to_string();
    let mut thief = spawn_client("fd-request", &daemon, &["--session", &id, "--token", &hex]);
    let refusal = thief.expect_line("refused");
    assert_eq!(fields(&refusal)["code"], (Code::PermissionDenied as i32).to_string(), "{refusal}");
    assert!(refusal.contains("only the attaching process"), "{refusal}");
    messages.push(refusal);
    // ... and the leaked token is revoked for the owner too.
    expect_refused(present(&daemon, &token_of(&stolen)), Code::FailedPrecondition, "already used");

    // A wrong token, and a frame that is not a request at all.
    let mut wrong = token_of(&attach(&client, good).unwrap());
    *wrong.last_mut().unwrap() ^= 0xff;
    messages.push(expect_refused(present(&daemon, &wrong), Code::PermissionDenied, "does not match"));
    messages.push(expect_refused(present(&daemon, b"hello kvmmd"), Code::InvalidArgument, "malformed"));

    // Attention with a wrong query length (checked by the library before any memory is touched).
    let mut other = spawn_client("run", &daemon, &["--tokens", "10"]);
    other.expect_line("appended");
    other.send("bad-query");
    let e = other.expect_line("error");
    assert_eq!(fields(&e)["code"], "InvalidArgument", "{e}");
    assert!(e.contains("q_heads × head_dim"), "{e}");
    messages.push(e);
    other.send("exit");
    other.expect_line("detached");

    // The bystander ran reference-checked attention through all of it.
    bystander.send("stop");
    let f = fields(&bystander.expect_line("looped"));
    assert!(f["attentions"].parse::<u64>().unwrap() > 0);
    bystander.send("exit");
    bystander.expect_line("detached");
    assert!(bystander.wait(Duration::from_secs(10)).success());
    for m in &messages {
        println!("refused: {m}");
    }
    drop(client);
    let status = daemon.wait_drained();
    assert_eq!(status.tiers[0].used_bytes, 0);
    assert!(daemon.stop().success());
}
