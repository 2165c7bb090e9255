//! Appending K/V through a real kvmmd, the whole client path: `Extend` RPCs for new pages, pins,
//! the row writes into the shared frames. SmolLM2-135M's geometry (30 layers, 3 KV heads × 64):
//!
//! - prefill: 4,096 tokens a layer in one `append` per layer (an engine that computed a prompt);
//! - decode: 1,024 tokens, one `append` of one token per layer per token;
//! - speculative decoding after a 1,024-token prompt: each step appends 5 draft tokens a layer in
//!   one call, then takes 3 of them back with `truncate` (the verifier accepted 2), against the
//!   same steps without the `truncate` (the appends alone), alternating in one run.
//!
//! ```text
//! cargo build --release -p kvmm-daemon && cargo bench -p kvmm-client --bench append
//! ```
//!
//! kvmmd is taken from `$KVMMD_BIN`, else from the target directory beside this bench. Prints the
//! best of `KVMM_BENCH_RUNS` (default 5) fresh sessions for each.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Instant;

use kvmm_client::Client;

const LAYERS: u32 = 30;
const ROW: usize = 3 * 64;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let runs = std::env::var("KVMM_BENCH_RUNS").ok().and_then(|r| r.parse().ok()).unwrap_or(5);
    let dir = tempfile::tempdir().unwrap();
    let daemon = support::start(dir.path(), &["--device-budget", "2GiB", "--log", "warn"]);
    let client = Client::connect(dir.path().join("kvmm.sock")).unwrap();
    let geometry = support::smollm2(8192);
    for (name, tokens, per_call) in [("prefill", 4096usize, 4096usize), ("decode", 1024, 1)] {
        let k: Vec<f32> = (0..tokens * ROW).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut best = f64::INFINITY;
        for _ in 0..runs {
            let mut session = client.attach(geometry).unwrap();
            let start = Instant::now();
            for first in (0..tokens).step_by(per_call) {
                let rows = first * ROW..(first + per_call) * ROW;
                for layer in 0..LAYERS {
                    session.append(layer, &k[rows.clone()], &k[rows.clone()]).unwrap();
                }
            }
            let took = start.elapsed().as_secs_f64();
            best = best.min(took);
            session.detach().unwrap();
        }
        let elements = (tokens * LAYERS as usize * 2 * ROW) as f64;
        println!(
            "{name:<8} {tokens:>5} tokens × {LAYERS} layers, {per_call:>4} per call: {:>8.1} ms, {:>7.2} µs a token, \
             {:>6.3} G elements/s",
            best * 1e3,
            best * 1e6 / tokens as f64,
            elements / best / 1e9
        );
    }
    speculative(&client, geometry, runs);
    support::stop(daemon);
}

/// Steps of 5 draft tokens a layer, of which `truncate` takes 3 back; the time a step's `truncate`
/// takes, against the step's appends.
fn speculative(client: &Client, geometry: kvmm_client::Geometry, runs: usize) {
    const PROMPT: usize = 1024;
    const STEPS: usize = 256;
    let k: Vec<f32> = (0..(PROMPT + 5 * STEPS) * ROW).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let (mut append_best, mut truncate_best) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..runs {
        let mut session = client.attach(geometry).unwrap();
        for layer in 0..LAYERS {
            session.append(layer, &k[..PROMPT * ROW], &k[..PROMPT * ROW]).unwrap();
        }
        let (mut appending, mut truncating) = (0.0, 0.0);
        let mut tokens = PROMPT;
        for _ in 0..STEPS {
            let drafts = tokens * ROW..(tokens + 5) * ROW;
            let start = Instant::now();
            for layer in 0..LAYERS {
                session.append(layer, &k[drafts.clone()], &k[drafts.clone()]).unwrap();
            }
            let appended = Instant::now();
            session.truncate((tokens + 2) as u32).unwrap();
            truncating += appended.elapsed().as_secs_f64();
            appending += (appended - start).as_secs_f64();
            tokens += 2;
        }
        append_best = append_best.min(appending);
        truncate_best = truncate_best.min(truncating);
        session.detach().unwrap();
    }
    println!(
        "speculative {STEPS} steps × {LAYERS} layers after {PROMPT} tokens: appending 5 drafts {:>7.1} µs a step, \
         truncating 3 of them {:>7.1} µs a step ({:.2}× the appends)",
        append_best * 1e6 / STEPS as f64,
        truncate_best * 1e6 / STEPS as f64,
        truncate_best / append_best
    );
}
