//! Decode speed of SmolLM2-135M-Instruct with its KV cache in process (`local`, f32 rows) and in a
//! real kvmmd session (`kvmm f16`, and `kvmm q8` / `kvmm q4`: pages outside the sink page and the
//! last 128 tokens recompressed by the daemon's admin `Compress`, as `kvmm-generate --kv-format`
//! does), at several contexts.
//!
//! ```text
//! bash ../shared/scripts/fetch-smollm2.sh
//! cargo build --release -p kvmm-daemon && cargo bench -p kvmm-infer --bench decode_speed
//! ```
//!
//! For each context the cache is first filled with that many tokens of K/V rows in every layer
//! (pseudo-random values: what attention costs does not depend on them, and a one-token-at-a-time
//! prefill of 8k tokens would take minutes per case), the old pages are recompressed for q8/q4,
//! then the model decodes `KVMM_BENCH_STEPS` tokens (default 16) after one warm-up step, each a
//! full forward pass whose attention reads every cached token. Backends run in turn within a
//! round, the order rotated each round (`KVMM_BENCH_ROUNDS`, default 3), so a noisy neighbour
//! hits them alike; the table gives each backend's median tokens/s and the median over rounds of
//! its ratio to `local` in the same round, and for q4 its ratio to kvmm f16.
//!
//! The model is `$KVMM_MODEL`, else SmolLM2 in the model cache (`kvmm_infer::model::smollm2_in_cache`);
//! contexts are `$KVMM_BENCH_CONTEXTS` (default `0,2048,8064`: SmolLM2 holds 8,192 positions).
//! kvmmd is taken from `$KVMMD_BIN`, else from the target directory beside this bench, and runs
//! with a device budget that holds every case (no demotion), as root or a user in its admin group
//! (the q8/q4 cases use the admin API).

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../client/benches/support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::time::Instant;

use kvmm_infer::kv_format::{self, Admin};
use kvmm_infer::{
    Forward, KvCache, KvFormat, KvmmCacheOptions, KvmmKvCache, LocalKvCache, Model, Recompression, argmax, model,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Local,
    Kvmm(KvFormat),
}

impl Backend {
    const ALL: [Backend; 4] =
        [Backend::Local, Backend::Kvmm(KvFormat::F16), Backend::Kvmm(KvFormat::Q8), Backend::Kvmm(KvFormat::Q4)];

    fn name(self) -> String {
        match self {
            Backend::Local => "local (f32)".to_owned(),
            Backend::Kvmm(f) => format!("kvmm {}", f.name()),
        }
    }
}

/// One backend's cache for one case, and for q8/q4 its recompression.
enum Cache {
    Local(LocalKvCache),
    Kvmm(Box<KvmmKvCache>, Option<Recompression>),
}

impl Cache {
    fn kv(&mut self) -> &mut dyn KvCache {
        match self {
            Cache::Local(c) => c,
            Cache::Kvmm(c, _) => c.as_mut(),
        }
    }

    fn catch_up(&mut self) {
        if let Cache::Kvmm(c, Some(r)) = self {
            r.catch_up(c).unwrap();
        }
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// A splitmix64 stream mapped to floats in [-2, 2): rows that look like K/V to the kernels.
struct Rows(u64);

impl Rows {
    fn fill(&mut self, row: &mut [f32]) {
        for x in row {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            *x = (z >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
        }
    }
}

/// Tokens per second of `steps` decode steps after `context` cached tokens, and the seconds the
/// fill (and recompression) took.
fn run_case(
    model: &Model,
    client: &kvmm_client::Client,
    admin_socket: &std::path::Path,
    backend: Backend,
    context: usize,
    steps: usize,
) -> (f64, f64) {
    let config = *model.config();
    let positions = context + steps + 1;
    let mut cache = match backend {
        Backend::Local => Cache::Local(LocalKvCache::new(&config, positions).unwrap()),
        Backend::Kvmm(format) => {
            let options = KvmmCacheOptions { model_id: "decode_speed".to_owned(), ..KvmmCacheOptions::default() };
            let cache = KvmmKvCache::attach(client, &config, positions, options).unwrap();
            let recompression = format
                .recompress_to()
                .map(|_| Recompression::new(Admin::connect(client, admin_socket).unwrap(), format).unwrap());
            Cache::Kvmm(Box::new(cache), recompression)
        }
    };
    let filling = Instant::now();
    let row = config.kv_heads * config.head_dim;
    let (mut k, mut v) = (vec![0.0; row], vec![0.0; row]);
    let mut rows = Rows(context as u64);
    for _ in 0..context {
        for layer in 0..config.layers {
            rows.fill(&mut k);
            rows.fill(&mut v);
            cache.kv().append(layer, &k, &v).unwrap();
        }
    }
    cache.catch_up();
    let fill_seconds = filling.elapsed().as_secs_f64();

    let mut forward = Forward::new(model);
    let mut token = argmax(forward.step(model, cache.kv(), 1, context).unwrap());
    cache.catch_up();
    let decoding = Instant::now();
    for pos in context + 1..=context + steps {
        token = argmax(forward.step(model, cache.kv(), token, pos).unwrap());
        cache.catch_up();
    }
    (steps as f64 / decoding.elapsed().as_secs_f64(), fill_seconds)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 { xs[n / 2] } else { (xs[n / 2 - 1] + xs[n / 2]) / 2.0 }
}

fn main() {
    let model_path = match std::env::var_os("KVMM_MODEL") {
        Some(path) => PathBuf::from(path),
        None => match model::smollm2_in_cache() {
            Ok(path) => path,
            Err(why) => return println!("decode_speed: skipped: {why}, or set KVMM_MODEL"),
        },
    };
    let contexts: Vec<usize> =
        env_or("KVMM_BENCH_CONTEXTS", "0,2048,8064").split(',').map(|c| c.trim().parse().unwrap()).collect();
    let steps: usize = env_or("KVMM_BENCH_STEPS", "16").parse().unwrap();
    let rounds: usize = env_or("KVMM_BENCH_ROUNDS", "3").parse().unwrap();
    let (model, _) = model::load(&model_path, None).unwrap();
    let config = *model.config();
    assert!(
        contexts.iter().all(|&c| c + steps < config.seq_len),
        "every context plus {steps} steps must fit the model's {} positions",
        config.seq_len
    );

    let dir = tempfile::tempdir().unwrap();
    let daemon = support::start(dir.path(), &["--device-budget", "2GiB"]);
    let socket = dir.path().join("kvmm.sock");
    let client = kvmm_client::Client::connect(&socket).unwrap();
    let admin_socket = kv_format::admin_socket_beside(&socket);

    println!(
        "decode_speed: {} ({} layers, {} KV heads × {}), {steps} decode steps per case, {rounds} rounds",
        model_path.display(),
        config.layers,
        config.kv_heads,
        config.head_dim
    );
    println!();
    println!("| context | backend | tokens/s (median) | ÷ local (median of rounds) | ÷ kvmm f16 | fill s |");
    println!("|---:|---|---:|---:|---:|---:|");
    for &context in &contexts {
        let mut speed = vec![Vec::new(); Backend::ALL.len()];
        let mut fill = vec![Vec::new(); Backend::ALL.len()];
        for round in 0..rounds {
            for i in 0..Backend::ALL.len() {
                let b = (i + round) % Backend::ALL.len();
                let (tps, seconds) = run_case(&model, &client, &admin_socket, Backend::ALL[b], context, steps);
                speed[b].push(tps);
                fill[b].push(seconds);
            }
        }
        for (b, backend) in Backend::ALL.iter().enumerate() {
            let to_local = median((0..rounds).map(|r| speed[b][r] / speed[0][r]).collect());
            let to_f16 = median((0..rounds).map(|r| speed[b][r] / speed[1][r]).collect());
            println!(
                "| {context} | {} | {:.1} | {to_local:.3} | {to_f16:.3} | {:.1} |",
                backend.name(),
                median(speed[b].clone()),
                median(fill[b].clone()),
            );
        }
    }
    drop(client);
    support::stop(daemon);
}
