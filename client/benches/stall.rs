//! How long other clients wait while the daemon does something long for someone else: a session of
//! Llama-3-8B's KV shape (32 layers, 8 KV heads of 128 channels, 32-token f16 pages of 135,232
//! bytes) is filled to 2,048 full pages (270 MB), then one request works on all of it (an admin
//! `Compress` to q8 or q4, an admin `Demote` to DRAM or to flash, the owner's `Detach`, an admin
//! `WipeSession`) while a second client calls `SessionStats` on its own small session in a loop.
//! The demotion to flash runs twice more with a third party beside it: an operator's admin
//! `Status` every millisecond (`kvmmctl top`, a metrics scraper), which reads the flash file's
//! counters; and a client whose pages are sent to flash and faulted back in a loop (4 layers of 8
//! pages), whose promotions give flash slots back while the demotion's batches hold the flash file.
//! Prints how long the request took and the latency of the other client's calls that started
//! while it ran (p50, p99, max): a daemon that held its one lock for the whole request would make
//! the first of them wait about as long as the request.
//!
//! ```text
//! cargo build --release -p kvmm-daemon && cargo bench -p kvmm-client --bench stall
//! ```
//!
//! `KVMM_BENCH_ROUNDS` (default 2) sets how many times each request is measured.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvmm_client::{Client, Geometry, Session, proto as pb};

const BLOCKS: u32 = 64;

/// The long request of one measurement.
#[derive(Clone, Copy, Debug)]
enum Request {
    /// No request: 150 ms of the other client's calls alone, for comparison.
    Nothing,
    Compress(pb::PageFormat),
    /// An admin `Demote` to DRAM or to flash (through DRAM: compressed to q8, then sealed).
    Demote(pb::Tier),
    /// The same with a third party calling beside it.
    DemoteBeside(pb::Tier, Beside),
    Detach,
    Wipe,
}

/// What a third party does beside a request, until it is done.
#[derive(Clone, Copy, Debug)]
enum Beside {
    /// An admin `Status` every millisecond.
    Status,
    /// A session of 4 Llama-3-8B layers × 8 pages demoted to flash and faulted back (attention over
    /// every layer), again and again.
    Faults,
}

impl Beside {
    fn run(self, client: &Client, admin: &AdminClient, done: &AtomicBool) {
        let mut admin = admin.clone();
        match self {
            Beside::Status => {
                while !done.load(Ordering::Acquire) {
                    client.block_on(admin.status(pb::StatusRequest {})).unwrap();
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Beside::Faults => {
                let geometry = Geometry { layers: 4, ..support::llama3_8b(8 * 32) };
                let mut session = client.attach(geometry).unwrap();
                let row = (geometry.kv_heads * geometry.head_dim) as usize;
                let k: Vec<f32> = (0..8 * 32 * row).map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5).collect();
                for layer in 0..geometry.layers {
                    session.append(layer, &k, &k).unwrap();
                }
                let q = vec![0.1f32; (geometry.q_heads * geometry.head_dim) as usize];
                let mut out = vec![0.0f32; q.len()];
                while !done.load(Ordering::Acquire) {
                    let request = pb::DemoteRequest {
                        session_id: session.id(),
                        tier: pb::Tier::Flash as i32,
                        ..Default::default()
                    };
                    client.block_on(admin.demote(request)).unwrap();
                    for layer in 0..geometry.layers {
                        session.attention(layer, &q, &mut out).unwrap();
                    }
                }
                session.detach().unwrap();
            }
        }
    }
}

type AdminClient = pb::admin_client::AdminClient<tonic::transport::Channel>;

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let flash = dir.path().join("flash");
    std::fs::create_dir(&flash).unwrap();
    let daemon = support::start(
        dir.path(),
        &[
            "--device-budget",
            "1GiB",
            "--dram-budget",
            "1GiB",
            "--flash-budget",
            "1GiB",
            "--flash-dir",
            flash.to_str().unwrap(),
            "--log",
            "warn",
        ],
    );
    let socket = dir.path().join("kvmm.sock");
    let client = Client::connect(&socket).unwrap();
    let admin = support::admin(&client, dir.path());
    let llama = support::llama3_8b(BLOCKS * 32);
    let row = (llama.kv_heads * llama.head_dim) as usize;
    let tokens = (BLOCKS * llama.block_tokens) as usize;
    let k: Vec<f32> = (0..tokens * row).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let v: Vec<f32> = (0..tokens * row).map(|i| ((i * 104_729) % 1000) as f32 / 500.0 - 1.0).collect();
    let small = Geometry { layers: 1, kv_heads: 1, q_heads: 1, head_dim: 64, max_tokens: 64, ..llama };
    let other = Client::connect(&socket).unwrap();
    let probe = other.attach(small).unwrap();
    let rounds: usize = std::env::var("KVMM_BENCH_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(2);

    println!("| request | round | request ms | other client's calls | p50 µs | p99 µs | max µs |");
    println!("|---|---|---|---|---|---|---|");
    let requests = [
        Request::Nothing,
        Request::Compress(pb::PageFormat::Q8),
        Request::Compress(pb::PageFormat::Q4),
        Request::Demote(pb::Tier::Dram),
        Request::Demote(pb::Tier::Flash),
        Request::DemoteBeside(pb::Tier::Flash, Beside::Status),
        Request::DemoteBeside(pb::Tier::Flash, Beside::Faults),
        Request::Detach,
        Request::Wipe,
    ];
    for request in requests {
        for round in 0..rounds {
            let mut session = client.attach(llama).unwrap();
            for layer in 0..llama.layers {
                session.append(layer, &k, &v).unwrap();
            }
            let id = session.id();
            let mut kept: Option<Session> = None;
            let done = AtomicBool::new(false);
            let (took, samples) = std::thread::scope(|scope| {
                let calls = scope.spawn(|| {
                    let mut samples = Vec::new();
                    while !done.load(Ordering::Acquire) {
                        let t = Instant::now();
                        probe.stats().unwrap();
                        samples.push((t, t.elapsed()));
                    }
                    samples
                });
                let beside = match request {
                    Request::DemoteBeside(_, beside) => {
                        let (client, admin, done) = (&client, &admin, &done);
                        Some(scope.spawn(move || beside.run(client, admin, done)))
                    }
                    _ => None,
                };
                // Let the other client's loop start first.
                std::thread::sleep(Duration::from_millis(50));
                let t = Instant::now();
                let mut admin = admin.clone();
                match request {
                    Request::Nothing => {
                        std::thread::sleep(Duration::from_millis(150));
                        kept = Some(session);
                    }
                    Request::Compress(format) => {
                        let r = client
                            .block_on(admin.compress(pb::CompressRequest {
                                session_id: id,
                                format: format as i32,
                                ..Default::default()
                            }))
                            .unwrap()
                            .into_inner();
                        assert_eq!(r.compressed, llama.layers * BLOCKS, "{r:?}");
                        kept = Some(session);
                    }
                    Request::Demote(tier) | Request::DemoteBeside(tier, _) => {
                        let r = client
                            .block_on(admin.demote(pb::DemoteRequest {
                                session_id: id,
                                tier: tier as i32,
                                ..Default::default()
                            }))
                            .unwrap()
                            .into_inner();
                        assert_eq!(r.demoted, llama.layers * BLOCKS, "{r:?}");
                        kept = Some(session);
                    }
                    Request::Detach => {
                        session.detach().unwrap();
                    }
                    Request::Wipe => {
                        let r = client
                            .block_on(admin.wipe_session(pb::WipeRequest { session_id: id }))
                            .unwrap()
                            .into_inner();
                        assert!(r.device_bytes > 0, "{r:?}");
                        // The library's detach on drop meets a wiped session; that is expected here.
                        drop(session);
                    }
                }
                let took = t.elapsed();
                done.store(true, Ordering::Release);
                if let Some(beside) = beside {
                    beside.join().unwrap();
                }
                // The calls that started while the request ran (the last one may end after it).
                let during: Vec<Duration> = calls
                    .join()
                    .unwrap()
                    .into_iter()
                    .filter(|(at, _)| *at >= t && *at < t + took)
                    .map(|(_, d)| d)
                    .collect();
                (took, during)
            });
            if let Some(session) = kept {
                session.detach().unwrap();
            }
            let mut samples = samples;
            samples.sort_unstable();
            let at = |p: f64| {
                samples
                    .get(((samples.len().max(1) - 1) as f64 * p).round() as usize)
                    .map_or(0.0, |d| d.as_secs_f64() * 1e6)
            };
            println!(
                "| {request:?} | {round} | {:.1} | {} | {:.0} | {:.0} | {:.0} |",
                took.as_secs_f64() * 1e3,
                samples.len(),
                at(0.5),
                at(0.99),
                at(1.0)
            );
        }
    }
    probe.detach().unwrap();
    drop((client, other));
    support::stop(daemon);
}
