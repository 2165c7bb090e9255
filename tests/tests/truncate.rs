//! A client takes tokens back (`Session::truncate`, the `Truncate` RPC): draft tokens a speculative
//! decoder rejected, an answer to regenerate. What stays reads exactly as in a session that never
//! held the rest, appends go on from the cut, and the pages past it are given back wherever they
//! were: their frames zeroed (the rejected tokens' bytes are gone from the arena), their DRAM and
//! flash copies freed. A cut inside a compressed page keeps that page's decoded values.

#![allow(clippy::unwrap_used)]

use kvmm_client::{Client, Geometry, Session, f16};
use kvmm_kernels::Format;
use kvmm_proto::v1::{PageFormat, Tier};
use kvmm_tests::rows::{self, DIM, Q, ROW, attend, rows, worst_error};
use kvmm_tests::{Daemon, fields, spawn_client};

const LAYERS: u32 = 2;

/// Written into the value rows of the tokens taken back: 8 f16 values whose bytes spell it.
const CANARY: &[u8; 16] = b"KVMM-TRUNC-9a3f!";

fn geometry() -> Geometry {
    rows::geometry(LAYERS)
}

/// Value rows whose every head starts with the canary's bytes (as f16, exactly).
fn canary_rows(tokens: usize) -> Vec<f32> {
    let canary: Vec<f32> =
        CANARY.chunks(2).map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()).collect();
    let mut v = rows(tokens, 99);
    for head in v.chunks_mut(DIM) {
        head[..canary.len()].copy_from_slice(&canary);
    }
    v
}

fn holds_canary(bytes: &[u8]) -> bool {
    bytes.windows(CANARY.len()).any(|w| w == CANARY)
}

/// Appends `tokens` of `k`/`v` to every layer, in calls of 7 tokens (crossing page boundaries).
fn append_all(session: &mut Session, k: &[f32], v: &[f32]) {
    for layer in 0..LAYERS {
        for (kc, vc) in k.chunks(7 * ROW).zip(v.chunks(7 * ROW)) {
            session.append(layer, kc, vc).unwrap();
        }
    }
}

#[test]
fn tokens_taken_back_leave_what_a_session_that_never_had_them_holds_and_their_bytes_go() {
    let daemon = Daemon::start(&["--device-budget", "64MiB"]);
    let client = Client::connect(daemon.socket()).unwrap();
    let (k, v) = (rows(130, 1), rows(130, 2));
    let q = rows(3, 3)[..Q * DIM].to_vec();
    let mut drafted = client.attach(geometry()).unwrap();
    let mut straight = client.attach(geometry()).unwrap();
    append_all(&mut straight, &k, &v);
    let same_as_straight = |drafted: &mut Session, straight: &mut Session| {
        for layer in 0..LAYERS {
            assert_eq!(drafted.tokens(layer), 130);
            let out = attend(drafted, layer, &q);
            assert_eq!(out, attend(straight, layer, &q), "layer {layer}: the same pages, the same bits");
            assert!(worst_error(&out, &k, &v, &q) < 1e-5);
        }
    };

    // 40 draft tokens (100..140, blocks 3 and 4), taken back in place: two pages a layer, resident
    // and f16, rewritten under a pin with no RPC; the session keeps its pages.
    append_all(&mut drafted, &k[..100 * ROW], &v[..100 * ROW]);
    append_all(&mut drafted, &rows(40, 4), &canary_rows(40));
    assert!(daemon.memfds().iter().any(|(_, b)| holds_canary(b)), "the scan finds the drafts' bytes");
    let before = drafted.stats().unwrap();
    drafted.truncate(100).unwrap();
    for layer in 0..LAYERS {
        assert_eq!(drafted.tokens(layer), 100);
    }
    for (name, bytes) in daemon.memfds() {
        assert!(!holds_canary(&bytes), "a rejected token's value row is still in {name}");
    }
    let after = drafted.stats().unwrap();
    assert_eq!(after.tokens, 100, "kvmmd counts the tokens the client keeps");
    assert_eq!((after.allocated_blocks, after.device_bytes), (before.allocated_blocks, before.device_bytes));
    // The cut is exact, and appends go on from it: the same pages as a session that never held the
    // drafts (key bounds included), so the same attention bits.
    append_all(&mut drafted, &k[100 * ROW..], &v[100 * ROW..]);
    same_as_straight(&mut drafted, &mut straight);

    // 200 drafts (130..330, blocks 4..10): more pages than a batch, so they go back to kvmmd. Block
    // 4, which holds 2 kept tokens, goes too and comes back with them, and a batch after it.
    append_all(&mut drafted, &rows(200, 5), &canary_rows(200));
    assert!(daemon.memfds().iter().any(|(_, b)| holds_canary(b)));
    let before = drafted.stats().unwrap();
    drafted.truncate(130).unwrap();
    for (name, bytes) in daemon.memfds() {
        assert!(!holds_canary(&bytes), "a rejected token's value row is still in {name}");
    }
    let after = drafted.stats().unwrap();
    assert_eq!((before.allocated_blocks, after.allocated_blocks), (12, 8), "{before:?} {after:?}");
    assert_eq!(after.device_bytes * 12, before.device_bytes * 8);
    same_as_straight(&mut drafted, &mut straight);

    // Past every layer's tokens nothing happens; a cut to 5 tokens gives blocks 0..5 back.
    drafted.truncate(1000).unwrap();
    drafted.truncate(5).unwrap();
    assert_eq!(drafted.stats().unwrap().allocated_blocks, 4);
    for layer in 0..LAYERS {
        assert_eq!(drafted.tokens(layer), 5);
        assert!(worst_error(&attend(&mut drafted, layer, &q), &k[..5 * ROW], &v[..5 * ROW], &q) < 1e-5);
    }
    // Everything back, in place: the session takes appends from token 0.
    drafted.truncate(0).unwrap();
    assert_eq!(drafted.stats().unwrap().tokens, 0);
    append_all(&mut drafted, &k[..7 * ROW], &v[..7 * ROW]);
    assert!(worst_error(&attend(&mut drafted, 1, &q), &k[..7 * ROW], &v[..7 * ROW], &q) < 1e-5);

    // A wiped session cannot be cut; the daemon's accounting ends empty.
    drafted.wipe().unwrap();
    let e = drafted.truncate(1).unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    drop(drafted);
    straight.detach().unwrap();
    daemon.wait_drained();
}

#[test]
fn a_cut_inside_a_compressed_page_keeps_its_decoded_values_and_pages_below_the_device_are_freed() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_tiered("64MiB", flash.path(), &[]);
    let client = Client::connect(daemon.socket()).unwrap();
    let (k, v) = (rows(200, 5), rows(200, 6));
    let q = rows(3, 7)[..Q * DIM].to_vec();
    let mut s = client.attach(geometry()).unwrap();
    append_all(&mut s, &k, &v);
    // Full pages 0..6 of each layer to q8 (the tail, block 6, stays f16), then layer 1's to flash.
    assert!(daemon.compress(s.id(), PageFormat::Q8).compressed > 0);
    let moved = daemon.demote_layers(s.id(), 1..2, Tier::Flash);
    assert!(moved.demoted > 0, "{moved:?}");
    assert_eq!(s.stats().unwrap().pages[2], 6, "layer 1's full pages in flash");

    // 50 tokens: block 1 (tokens 32..64, q8) holds the cut; layer 1's is faulted in from flash to be
    // read, and every page past it, in flash or on the device, is given back.
    s.truncate(50).unwrap();
    // Layer 1's block 0 stays in flash (its tokens are kept); its pages past the cut are gone from
    // there, and block 1 is back on the device with the batch reserved after it.
    let st = s.stats().unwrap();
    assert_eq!((st.tokens, st.pages), (50, [2 * st.allocated_blocks - 1, 0, 1]), "{st:?}");
    assert_eq!(
        daemon.status().tiers.iter().map(|t| t.pages).sum::<u64>(),
        st.pages.iter().map(|&p| u64::from(p)).sum::<u64>()
    );
    for layer in 0..LAYERS {
        let out = attend(&mut s, layer, &q);
        // Block 0 is still q8; block 1 is f16 again, holding what q8 decoded to.
        assert_eq!(s.last_formats()[1], Some(Format::F16), "layer {layer}: {:?}", s.last_formats());
        assert_ne!(s.last_formats()[0], Some(Format::F16), "layer {layer}: {:?}", s.last_formats());
        let e = worst_error(&out, &k[..50 * ROW], &v[..50 * ROW], &q);
        assert!(e < 0.05, "layer {layer}: relative error {e} past q8's");
    }
    // Appends go on into the rewritten page.
    for layer in 0..LAYERS {
        s.append(layer, &k[50 * ROW..60 * ROW], &v[50 * ROW..60 * ROW]).unwrap();
        let e = worst_error(&attend(&mut s, layer, &q), &k[..60 * ROW], &v[..60 * ROW], &q);
        assert!(e < 0.05, "layer {layer}: relative error {e}");
    }
    s.detach().unwrap();
    let drained = daemon.wait_drained();
    assert!(drained.tiers.iter().all(|t| t.pages == 0), "{drained:?}");
}

#[test]
fn truncate_of_a_session_the_caller_does_not_hold_is_refused_and_changes_nothing() {
    let daemon = Daemon::start(&[]);
    let client = Client::connect(daemon.socket()).unwrap();
    let mut s = client.attach(geometry()).unwrap();
    append_all(&mut s, &rows(40, 8), &rows(40, 9));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let [unknown, foreign] = rt.block_on(async {
        let channel = kvmm_client::connect::channel(&daemon.socket()).await.unwrap();
        let mut rpc = kvmm_proto::v1::session_client::SessionClient::new(channel);
        let truncate = |session_id| kvmm_proto::v1::TruncateRequest { session_id, blocks: 0 };
        let unknown = rpc.truncate(truncate(999_999)).await.unwrap_err();
        let foreign = rpc.truncate(truncate(s.id())).await.unwrap_err();
        [unknown, foreign]
    });
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    assert!(unknown.message().contains("999999"), "{unknown:?}");
    assert_eq!(foreign.code(), tonic::Code::NotFound, "{foreign:?}");
    assert!(foreign.message().contains("attached through another connection"), "{foreign:?}");
    let st = s.stats().unwrap();
    assert_eq!((st.tokens, st.allocated_blocks), (40, 4), "nothing changed: {st:?}");
    s.detach().unwrap();
    daemon.wait_drained();
}

#[test]
fn a_page_its_client_holds_pinned_refuses_the_truncation_and_every_claim_is_withdrawn() {
    let daemon = Daemon::start(&[]);
    // Layer 1's page is pinned; layer 0's comes first and is claimed before the pin is seen.
    let mut holder = spawn_client("hold-pin", &daemon, &["--layers", "2", "--pin-layer", "1"]);
    holder.expect_line("pinned");
    holder.send("truncate");
    let refused = holder.expect_line("truncate");
    assert_eq!(fields(&refused)["code"], "FailedPrecondition", "{refused}");
    assert!(refused.contains("has page (layer 1, block 0) pinned: truncate while no attention or append"), "{refused}");
    let pages = |d: &Daemon| d.status().tiers.iter().find(|t| t.tier == "device").unwrap().pages;
    assert_eq!(pages(&daemon), 2, "nothing was freed");
    // Once the pin goes, both pages go: layer 0's claim was withdrawn, not left MIGRATING.
    holder.send("unpin");
    holder.expect_line("unpinned");
    holder.send("truncate");
    let done = holder.expect_line("truncate");
    assert_eq!(fields(&done)["freed"], "2", "{done}");
    assert_eq!(pages(&daemon), 0);
    holder.send("exit");
    daemon.wait_drained();
}
