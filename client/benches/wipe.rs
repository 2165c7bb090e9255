//! Time to wipe a 1 GiB session on a real kvmmd: a session of Llama-3-8B's KV shape (32 layers,
//! 8 KV heads of 128 channels, 32-token f16 pages of 135,232 bytes) is extended to 8,192 pages
//! (1.03 GiB of device frames, faulted in by the daemon's prefaulter), then one admin `WipeSession`
//! zeroes every frame (stores the compiler cannot drop), drops the key and marks the table wiped;
//! timed from the caller's side, five rounds.
//!
//! ```text
//! cargo build --release -p kvmm-daemon && cargo bench -p kvmm-client --bench wipe
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use kvmm_client::{Client, proto as pb};

const BLOCKS: u32 = 256;

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = support::start(dir.path(), &["--device-budget", "1200MiB", "--log", "warn"]);
    let client = Client::connect(dir.path().join("kvmm.sock")).unwrap();
    let admin = support::admin(&client, dir.path());
    let geometry = support::llama3_8b(BLOCKS * 32);
    let mut rpc = client.rpc();
    let mut times = Vec::new();
    println!("| round | bytes wiped | wipe ms | GiB/s |");
    println!("|---|---|---|---|");
    for round in 0..5 {
        let session = client.attach(geometry).unwrap();
        for _ in 0..BLOCKS / 8 {
            client.block_on(rpc.extend(pb::ExtendRequest { session_id: session.id(), blocks: 8 })).unwrap();
        }
        // Let the prefaulter fault the arena in, as it does for a session that has been running.
        std::thread::sleep(Duration::from_secs(2));
        let t = Instant::now();
        let r = client
            .block_on(admin.clone().wipe_session(pb::WipeRequest { session_id: session.id() }))
            .unwrap()
            .into_inner();
        let took = t.elapsed();
        assert!(r.device_bytes >= 1 << 30, "{r:?}");
        println!(
            "| {round} | {} | {:.1} | {:.2} |",
            r.device_bytes,
            took.as_secs_f64() * 1e3,
            r.device_bytes as f64 / took.as_secs_f64() / f64::from(1u32 << 30)
        );
        times.push(took);
        // The library's detach on drop meets a wiped session; that is expected here.
        drop(session);
    }
    times.sort_unstable();
    println!("median wipe of 1 GiB: {:.1} ms", times[times.len() / 2].as_secs_f64() * 1e3);
    drop(client);
    support::stop(daemon);
}
