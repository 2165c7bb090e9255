//! Every request of the session API (`kvmm.sock`, any local user) and the admin API
//! (`kvmm-admin.sock`), decoded from arbitrary bytes with prost and handed to the real service
//! handlers of one in-process daemon, with what a hostile client also controls: the bytes of its
//! pages and of its client region, which it maps read-write. Handlers must answer every request with
//! a response or a `Status`, never panic (a panic in a blocking task aborts the run too: libFuzzer's
//! panic hook), and the daemon's accounting must hold after every call and be empty once every
//! session is wiped.
//!
//! The daemon is built once, as `kvmmd` builds it but without sockets: an 8 MiB device budget, a
//! 2 MiB DRAM pool and a 4 MiB flash file (pread engine) in a directory removed at once. An input is
//! a sequence of calls, each `[rpc, caller, length, message bytes...]`:
//!
//! - `rpc` picks one of the 21 RPCs; or (the 21st choice) a client write: `[session, memfd, offset
//!   u32 LE, bytes...]` into the arena or client region of a session attached earlier in the input;
//!   or (the 23rd) an Attach whose geometry is replaced by a valid one from a table (`[shape,
//!   message bytes...]`), so that a run without a corpus reaches live sessions within seconds;
//! - `caller` picks the connection the request comes from: uid 1000, uid 1001, or root (the only
//!   one the admin API serves); identity never comes from the message, as on the real sockets;
//! - a session id (or uid) below 8 in a decoded message is replaced by that entry of the sessions
//!   (callers) of this input, so that calls reach live sessions; larger ids stay as decoded.
//!
//! After each input every connection is closed (which destroys its sessions and frees frames held
//! for pins of wiped ones), a drain is ended and the starting policy put back, so inputs do not
//! depend on each other.

#![no_main]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kvmm_daemon::config::{Environment, FileConfig, Overrides};
use kvmm_daemon::daemon::Daemon;
use kvmm_daemon::server::admin_service::AdminService;
use kvmm_daemon::server::conn::{ConnId, ConnInfo};
use kvmm_daemon::server::session_service::SessionService;
use kvmm_proto::v1 as pb;
use kvmm_proto::v1::admin_server::Admin;
use kvmm_proto::v1::session_server::Session;
use kvmm_shm::fdpass::{FdRequest, PeerCred};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::Request;

/// The most calls one input makes (an attach can map a large table).
const MAX_CALLS: usize = 24;
/// The connections requests come from: (connection id, uid).
const CALLERS: [(u64, u32); 3] = [(1, 1000), (2, 1001), (3, 0)];

/// The daemon and its two services, built once for the run.
struct Harness {
    /// Runs the handlers (they are async, and some move work to blocking threads).
    runtime: tokio::runtime::Runtime,
    daemon: Arc<Daemon>,
    session: SessionService,
    admin: AdminService,
    /// The policy the daemon started with, put back after every input.
    policy: String,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory for the flash file");
        let text = format!(
            "device_budget = \"8MiB\"\n\
             [tiers]\ndram_budget = \"2MiB\"\nflash_budget = \"4MiB\"\nflash_dir = {dir:?}\nio_engine = \"pread\"\n\
             [policy]\nhost_root = {dir:?}\n",
            dir = dir.path().display().to_string(),
        );
        let file = FileConfig::parse(&text).expect("the harness's configuration parses");
        let environment = Environment {
            runtime_directory: Some(dir.path().to_owned()),
            xdg_runtime_dir: None,
            euid: 1000,
            mem_available: 1 << 30,
            state_directory: None,
            xdg_state_home: Some(PathBuf::from("/nonexistent")),
        };
        let config = file.resolve(Overrides::default(), &environment).expect("the harness's configuration resolves");
        let daemon = Daemon::new(config).expect("a daemon with DRAM and flash tiers");
        // The flash file stays open in the daemon; nothing is left behind when the fuzzer exits
        // without running destructors.
        dir.close().expect("the temporary directory is removed");
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a tokio runtime");
        let policy = daemon.policy_now().0;
        Harness {
            runtime,
            session: SessionService::new(Arc::clone(&daemon)),
            admin: AdminService::new(Arc::clone(&daemon)),
            daemon,
            policy,
        }
    })
}

/// A session attached in this input, with the memfds its client maps read-write.
struct Attached {
    id: u64,
    arena: File,
    region: File,
}

/// The connection `pick` names.
fn caller(pick: u8) -> ConnInfo {
    let (id, uid) = CALLERS[usize::from(pick) % CALLERS.len()];
    ConnInfo { id: ConnId(id), uid, gid: uid, pid: std::process::id() as i32 }
}

/// A request as it arrives from `who`'s connection.
fn request<T>(who: ConnInfo, message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.extensions_mut().insert(who);
    request
}

/// A decoded session id, or the live session it stands for (module doc).
fn session(live: &[Attached], id: u64) -> u64 {
    match live.len() {
        0 => id,
        n if id < 8 => live[id as usize % n].id,
        _ => id,
    }
}

/// Fetches the memfds of a session just attached, as its client does on the fd socket.
fn fetch_fds(daemon: &Daemon, who: ConnInfo, reply: &pb::AttachResponse) -> Attached {
    let token = reply.fd_token.as_slice().try_into().expect("Attach returns a 32-byte token");
    let peer = PeerCred { pid: who.pid, uid: who.uid, gid: who.gid };
    let grant = daemon
        .grant_fds(peer, &FdRequest { session_id: reply.session_id, token })
        .expect("the attaching process redeems its fresh token");
    let file = |fd: std::os::fd::BorrowedFd<'_>| File::from(fd.try_clone_to_owned().expect("a memfd duplicates"));
    Attached { id: reply.session_id, arena: file(grant.arena.as_fd()), region: file(grant.region.as_fd()) }
}

/// A client's write into its own shared memory: `[session, memfd, offset u32 LE, bytes...]`.
fn client_write(live: &[Attached], body: &[u8]) {
    let [s, which, a, b, c, d, bytes @ ..] = body else { return };
    let Some(target) = live.get(usize::from(*s) % live.len().max(1)) else { return };
    let file = if which & 1 == 0 { &target.arena } else { &target.region };
    let len = file.metadata().map_or(0, |m| m.len());
    if len == 0 {
        return;
    }
    let offset = u64::from(u32::from_le_bytes([*a, *b, *c, *d])) % len;
    let n = bytes.len().min((len - offset) as usize);
    file.write_all_at(&bytes[..n], offset).expect("a client writes its own memfd");
}

/// Decodes `body` as `$message`, lets `$fix` adjust it, and calls `$service.$rpc`; any answer is
/// fine (the call returns it or a Status).
macro_rules! call {
    ($h:expr, $service:ident . $rpc:ident, $message:ty, $who:expr, $body:expr, |$m:ident| $fix:expr) => {{
        let Ok(mut $m) = <$message>::decode($body) else { return None };
        $fix;
        let reply = $h.runtime.block_on($h.$service.$rpc(request($who, $m)));
        reply.map(|r| r.into_inner()).err()
    }};
    ($h:expr, $service:ident . $rpc:ident, $message:ty, $who:expr, $body:expr) => {{
        let Ok(m) = <$message>::decode($body) else { return None };
        let reply = $h.runtime.block_on($h.$service.$rpc(request($who, m)));
        reply.map(|r| r.into_inner()).err()
    }};
}

/// Makes one call; returns the Status it failed with, if any.
fn one_call(h: &Harness, live: &mut Vec<Attached>, rpc: u8, who: ConnInfo, body: &[u8]) -> Option<tonic::Status> {
    let uid = |u: u32| if u < 8 { CALLERS[u as usize % CALLERS.len()].1 } else { u };
    match rpc % 23 {
        0 => {
            let Ok(m) = pb::AttachRequest::decode(body) else { return None };
            attach(h, live, who, m)
        }
        1 => call!(h, session.extend, pb::ExtendRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        2 => call!(h, session.prefetch, pb::PrefetchRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        3 => call!(h, session.fault, pb::FaultRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        4 => call!(h, session.detach, pb::DetachRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        5 => call!(h, session.wipe, pb::WipeRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        6 => call!(h, session.session_stats, pb::SessionStatsRequest, who, body, |m| m.session_id =
            session(live, m.session_id)),
        7 => call!(h, admin.wipe_session, pb::WipeRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        8 => call!(h, admin.wipe_user, pb::WipeUserRequest, who, body, |m| m.uid = uid(m.uid)),
        9 => call!(h, admin.wipe_all, pb::WipeAllRequest, who, body),
        10 => call!(h, admin.list_sessions, pb::ListSessionsRequest, who, body),
        11 => call!(h, admin.session, pb::SessionRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        12 => call!(h, admin.get_policy, pb::GetPolicyRequest, who, body),
        13 => call!(h, admin.set_policy, pb::SetPolicyRequest, who, body),
        14 => call!(h, admin.drain, pb::DrainRequest, who, body),
        15 => call!(h, admin.metrics, pb::MetricsRequest, who, body),
        16 => call!(h, admin.compress, pb::CompressRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        17 => call!(h, admin.demote, pb::DemoteRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        18 => call!(h, admin.reload_policy, pb::ReloadPolicyRequest, who, body),
        19 => call!(h, admin.status, pb::StatusRequest, who, body),
        20 => {
            client_write(live, body);
            None
        }
        21 => call!(h, session.truncate, pb::TruncateRequest, who, body, |m| m.session_id = session(live, m.session_id)),
        _ => {
            // A short cut to a live session: a valid geometry from the table, the rest decoded.
            let [shape, rest @ ..] = body else { return None };
            let Ok(mut m) = pb::AttachRequest::decode(rest) else { return None };
            m.geometry = Some(GEOMETRIES[usize::from(*shape) % GEOMETRIES.len()]);
            attach(h, live, who, m)
        }
    }
}

/// Calls Attach and, when it succeeds, fetches the session's memfds.
fn attach(h: &Harness, live: &mut Vec<Attached>, who: ConnInfo, m: pb::AttachRequest) -> Option<tonic::Status> {
    match h.runtime.block_on(h.session.attach(request(who, m))) {
        Ok(reply) => {
            live.push(fetch_fds(&h.daemon, who, reply.get_ref()));
            None
        }
        Err(status) => Some(status),
    }
}

/// Geometries the short-cut attach uses: small to large against the 8 MiB device, both element
/// types, several block sizes.
const GEOMETRIES: [pb::Geometry; 4] = [
    geometry(2, 1, 2, 16, 8, 64, pb::ElementType::F16),
    geometry(4, 2, 4, 32, 16, 256, pb::ElementType::Bf16),
    geometry(1, 1, 1, 64, 32, 1024, pb::ElementType::F16),
    geometry(8, 4, 8, 64, 32, 4096, pb::ElementType::F16),
];

const fn geometry(
    layers: u32,
    kv_heads: u32,
    q_heads: u32,
    head_dim: u32,
    block_tokens: u32,
    max_tokens: u32,
    element_type: pb::ElementType,
) -> pb::Geometry {
    pb::Geometry { layers, kv_heads, q_heads, head_dim, block_tokens, element_type: element_type as i32, max_tokens }
}

/// Whether to print each call and its answer (`KVMM_FUZZ_TRACE=1`, to read what an input does).
fn tracing() -> bool {
    static TRACE: OnceLock<bool> = OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("KVMM_FUZZ_TRACE").is_some())
}

/// What must hold between calls: the sessions' pages and the frames held for pins of wiped
/// sessions account for every device byte in use (no page is mid-move, since nothing else runs),
/// and no tier holds more than its budget.
fn check_accounting(daemon: &Daemon) {
    let s = daemon.status();
    assert_eq!(
        s.session_bytes + s.reserved.bytes,
        s.used,
        "the sessions' device pages and the held frames are the pool's used bytes: {s:?}"
    );
    assert!(s.used <= s.budget, "the device is within its budget: {s:?}");
    for tier in [s.dram, s.flash].into_iter().flatten() {
        assert!(tier.used <= tier.budget, "a tier is within its budget: {tier:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let h = harness();
    let mut live: Vec<Attached> = Vec::new();
    let mut input = data;
    let mut calls = 0;
    while let [rpc, who, len, rest @ ..] = input
        && calls < MAX_CALLS
    {
        let (body, tail) = rest.split_at(usize::from(*len).min(rest.len()));
        input = tail;
        calls += 1;
        let refused = one_call(h, &mut live, *rpc, caller(*who), body);
        if tracing() {
            eprintln!("call {rpc} from {:?}: {:?}", caller(*who), refused.as_ref().map(|s| (s.code(), s.message())));
        }
        if let Some(status) = refused {
            assert_ne!(status.code(), tonic::Code::Internal, "a request is refused for a reason, not internally");
        }
        check_accounting(&h.daemon);
    }

    // Every connection closes, as when the fuzzed clients exit: their sessions go, and so do frames
    // held because a wiped session's region claimed pins.
    for who in 0..CALLERS.len() {
        h.daemon.connection_closed(caller(who as u8).id);
    }
    h.daemon.wipe_all();
    let s = h.daemon.status();
    assert!(
        s.sessions == 0 && s.used == 0 && s.frames == 0 && s.pages_device + s.pages_dram + s.pages_flash == 0,
        "wiping every session frees the device: {s:?}"
    );
    for tier in [s.dram, s.flash].into_iter().flatten() {
        assert_eq!((tier.used, tier.pages), (0, 0), "wiping every session frees every tier: {tier:?}");
    }
    if h.daemon.is_draining() {
        h.daemon.drain(true).expect("a drain ends");
    }
    if h.daemon.policy_now().0 != h.policy {
        h.daemon.set_policy(&h.policy).expect("the starting policy is put back");
    }
});
