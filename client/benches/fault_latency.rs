//! Fault latency against a real kvmmd with a DRAM pool and a flash file: a page (or 32 pages of one
//! layer) is pushed down with the admin `Demote`, then one `Fault` RPC brings it back, timed from the
//! client's side (the RPC, making room, the DRAM copy or the batched flash read with
//! authentication, and publishing the pages).
//!
//! ```text
//! cargo build --release -p kvmm-daemon && cargo bench -p kvmm-client --bench fault_latency
//! ```
//!
//! kvmmd is taken from `$KVMMD_BIN`, else from the target directory beside this bench; the flash
//! file goes to `$KVMM_BENCH_DIR` (default: the system temp dir, which must take O_DIRECT).
//! `KVMM_BENCH_ENGINE` picks the I/O engine (default `io_uring`). Prints p50/p99 per case.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvmm_client::{Client, ElementType, Geometry, proto as pb};

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6;
    println!("| {name} | {} | {:.0} | {:.0} |", samples.len(), at(0.50), at(0.99));
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let flash_dir = std::env::var_os("KVMM_BENCH_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let flash = tempfile::tempdir_in(flash_dir).unwrap();
    let engine = std::env::var("KVMM_BENCH_ENGINE").unwrap_or_else(|_| "io_uring".to_owned());
    let flash_dir = flash.path().to_str().expect("a UTF-8 temp path");
    let daemon = support::start(
        dir.path(),
        &[
            "--flash-dir",
            flash_dir,
            "--device-budget",
            "256MiB",
            "--dram-budget",
            "64MiB",
            "--flash-budget",
            "256MiB",
            "--demote-format",
            "none",
            "--io-engine",
            &engine,
            "--log",
            "warn",
        ],
    );
    let client = Client::connect(dir.path().join("kvmm.sock")).unwrap();
    // SmolLM2-135M's KV heads: 25,408-byte f16 pages; 2 layers of 33 full pages.
    let geometry = Geometry {
        layers: 2,
        kv_heads: 3,
        q_heads: 9,
        head_dim: 64,
        block_tokens: 32,
        element_type: ElementType::F16,
        max_tokens: 2048,
    };
    let mut session = client.attach(geometry).unwrap();
    let row = vec![0.25f32; 3 * 64];
    for _ in 0..33 * 32 + 1 {
        for layer in 0..2 {
            session.append(layer, &row, &row).unwrap();
        }
    }
    let id = session.id();
    let admin = support::admin(&client, dir.path());
    let mut rpc = client.rpc();
    println!("| fault ({engine}) | n | p50 µs | p99 µs |");
    println!("|---|---|---|---|");
    for (tier, name) in [(pb::Tier::Dram, "dram"), (pb::Tier::Flash, "flash")] {
        for pages in [1u32, 32] {
            let mut samples = Vec::new();
            for _ in 0..200 {
                let demote = pb::DemoteRequest {
                    session_id: id,
                    first_layer: 0,
                    layers: 1,
                    first_block: 0,
                    blocks: pages,
                    tier: tier as i32,
                };
                let r = client.block_on(admin.clone().demote(demote)).unwrap().into_inner();
                assert_eq!(r.demoted, pages, "{r:?}");
                let request = pb::FaultRequest {
                    session_id: id,
                    pages: (0..pages).map(|block| pb::PageRef { layer: 0, block }).collect(),
                };
                let t = Instant::now();
                let r = client.block_on(rpc.fault(request)).unwrap().into_inner();
                samples.push(t.elapsed());
                assert!(r.pages.iter().all(|p| p.resident));
            }
            report(&format!("{pages} page(s) from {name}"), samples);
        }
    }
    drop(session);
    drop(client);
    support::stop(daemon);
}
