//! RPC latency against a real kvmmd: `Extend` (one page for every layer, and a 4,096-token prompt's
//! 128 pages for every layer at once) and `Attach` end to end (the RPC, the fd handshake over
//! SCM_RIGHTS, and mapping the three memfds).
//!
//! ```text
//! cargo build --release -p kvmm-daemon && cargo bench -p kvmm-client --bench rpc_latency
//! ```
//!
//! kvmmd is taken from `$KVMMD_BIN`, else from the target directory beside this bench. Prints
//! p50/p90/p99/max per operation.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use kvmm_client::{Client, Geometry, proto as pb};

fn percentiles(name: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    println!(
        "{name:<44} n={:<5} p50 {:>8.1} µs  p90 {:>8.1} µs  p99 {:>8.1} µs  max {:>8.1} µs",
        samples.len(),
        at(0.50).as_secs_f64() * 1e6,
        at(0.90).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        samples[samples.len() - 1].as_secs_f64() * 1e6
    );
}

/// An `Attach` RPC alone (no fds, no mappings): the session's id and shape.
fn attach_raw(
    client: &Client,
    rpc: &mut pb::session_client::SessionClient<tonic::transport::Channel>,
    geometry: &Geometry,
) -> pb::AttachResponse {
    let request = pb::AttachRequest {
        geometry: Some(kvmm_client::session::geometry_to_pb(geometry)),
        model_id: "bench".into(),
        ..Default::default()
    };
    client.block_on(rpc.attach(request)).unwrap().into_inner()
}

fn main() {
    // `cargo bench` passes --bench; a test run of benches passes nothing useful either way.
    let dir = tempfile::tempdir().unwrap();
    let daemon = support::start(dir.path(), &["--device-budget", "2GiB", "--log", "warn"]);
    let socket = dir.path().join("kvmm.sock");
    let client = Client::connect(&socket).unwrap();

    // SmolLM2-135M: 30 layers, 3 KV heads, 9 query heads, head_dim 64: a 24 KiB page per layer.
    let smollm2 = support::smollm2(8192);

    let mut attach = Vec::new();
    for _ in 0..300 {
        let t = Instant::now();
        let s = client.attach(smollm2).unwrap();
        attach.push(t.elapsed());
        s.detach().unwrap();
    }
    percentiles("Attach end to end (RPC + fds + 3 mappings)", attach);

    let mut rpc = client.rpc();
    let mut extend = Vec::new();
    let mut cold = None;
    while extend.len() < 4000 {
        let s = attach_raw(&client, &mut rpc, &smollm2);
        for _ in 0..s.blocks_per_layer {
            let t = Instant::now();
            client.block_on(rpc.extend(pb::ExtendRequest { session_id: s.session_id, blocks: 1 })).unwrap();
            extend.push(t.elapsed());
        }
        client.block_on(rpc.detach(pb::DetachRequest { session_id: s.session_id })).unwrap();
        if cold.is_none() {
            // The first session grows the arena: the daemon faults memory in, 2 MiB at a time.
            cold = Some(std::mem::take(&mut extend));
        }
    }
    percentiles("Extend, 1 block × 30 layers, cold arena", cold.unwrap());
    percentiles("Extend, 1 block × 30 layers, frames reused", extend);

    // A 4,096-token prompt's 128 blocks in one RPC: what asking for a whole prompt's pages at once
    // would hold the core lock for (`Session::append` asks 4 blocks at a time).
    let mut prompt = Vec::new();
    for _ in 0..100 {
        let s = attach_raw(&client, &mut rpc, &smollm2);
        let t = Instant::now();
        client.block_on(rpc.extend(pb::ExtendRequest { session_id: s.session_id, blocks: 128 })).unwrap();
        prompt.push(t.elapsed());
        client.block_on(rpc.detach(pb::DetachRequest { session_id: s.session_id })).unwrap();
    }
    percentiles("Extend, 128 blocks × 30 layers, frames reused", prompt);

    let mut stats = Vec::new();
    let s = client.attach(smollm2).unwrap();
    for _ in 0..2000 {
        let t = Instant::now();
        s.stats().unwrap();
        stats.push(t.elapsed());
    }
    percentiles("SessionStats (RPC round trip floor)", stats);
    drop(s);
    drop(client);
    support::stop(daemon);
}
