//! The committed fixture `infer/fixtures/stories260k_bos_256.kvfx` is what `kvmm-dump-kv` produces
//! today (the test runs the tool itself), so it cannot silently rot when the forward pass changes.
//!
//! Configuration and token ids must match exactly. Floats may differ by rounding (another libm's
//! `expf`/`sinf`, or the SIMD matmuls that will replace the plain loops reordering sums), so they
//! are compared with a tight relative tolerance; a real change (RoPE, norms, weights) moves them
//! by orders of magnitude more. To regenerate, run the command in the crate documentation.

#![allow(clippy::unwrap_used)]

mod common;

use kvmm_infer::tokenizer::BOS;
use kvmm_infer::{KvTrace, fixture, trace_greedy, trace_tokens};

const REGENERATE: &str = "cargo run --release -p kvmm-infer --bin kvmm-dump-kv -- \
    --model ../shared/models/stories260K/stories260K.bin --tokenizer ../shared/models/stories260K/tok512.bin \
    --bos-steps 256 --out infer/fixtures/stories260k_bos_256.kvfx";

/// Runs the `kvmm-dump-kv` binary with `args` plus `--model` and `--out`, and reads what it wrote.
fn run_dump_tool(args: &[&str]) -> KvTrace {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("dump.kvfx");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_kvmm-dump-kv"))
        .arg("--model")
        .arg(common::models_dir().join("stories260K.bin"))
        .args(args)
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success(), "kvmm-dump-kv {args:?} failed: {status}");
    fixture::read(&out).unwrap()
}

/// The largest `|a − b| / (1 + |b|)` over all floats of two traces of the same shape.
fn max_relative_difference(a: &KvTrace, b: &KvTrace) -> f32 {
    let mut worst = 0.0f32;
    for (la, lb) in a.layers.iter().zip(&b.layers) {
        for (x, y) in [(&la.q, &lb.q), (&la.k, &lb.k), (&la.v, &lb.v)] {
            assert_eq!(x.len(), y.len());
            for (p, q) in x.iter().zip(y.iter()) {
                worst = worst.max((p - q).abs() / (1.0 + q.abs()));
            }
        }
    }
    worst
}

#[test]
fn the_committed_fixture_matches_a_fresh_dump() {
    let path = common::fixture_path();
    let committed = fixture::read(&path).unwrap_or_else(|e| panic!("{e}; regenerate it with: {REGENERATE}"));
    let now = run_dump_tool(&["--bos-steps", "256"]);
    assert_eq!(committed.config, now.config, "model configuration changed; regenerate with: {REGENERATE}");
    assert_eq!(committed.tokens, now.tokens, "token sequence changed; regenerate with: {REGENERATE}");
    let diff = max_relative_difference(&committed, &now);
    assert!(diff <= 1e-4, "q/k/v differ by up to {diff} (relative); regenerate with: {REGENERATE}");
    assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, fixture::encode(&now).unwrap().len());
}

#[test]
fn the_fixture_holds_bos_then_the_golden_tokens_it_fed() {
    let committed = fixture::read(&common::fixture_path()).unwrap();
    let golden = common::golden_ids();
    assert_eq!(committed.positions(), 256);
    assert_eq!(committed.tokens[0], BOS);
    assert_eq!(committed.tokens[1..], golden[..255]);
}

#[test]
fn teacher_forcing_the_greedy_tokens_records_the_same_trace() {
    let model = common::model();
    let (greedy, generation) = trace_greedy(&model, &[BOS], 64, &[BOS]).unwrap();
    let forced = trace_tokens(&model, &generation.fed).unwrap();
    assert_eq!(forced, greedy);
}

#[test]
fn recorded_keys_are_exactly_what_the_cache_attends_over() {
    use kvmm_infer::{KvCache, LocalKvCache, RecordingKvCache, generate_greedy};
    let model = common::model();
    let config = *model.config();
    let mut cache = RecordingKvCache::new(LocalKvCache::new(&config, 32).unwrap(), &config);
    generate_greedy(&model, &mut cache, &[BOS], 32, &[BOS]).unwrap();
    assert_eq!(cache.tokens(4), 32);
    let local_keys: Vec<Vec<f32>> = (0..5).map(|l| cache.inner().keys(l).to_vec()).collect();
    let local_values: Vec<Vec<f32>> = (0..5).map(|l| cache.inner().values(l).to_vec()).collect();
    let (layers, _) = cache.into_parts();
    for (l, layer) in layers.iter().enumerate() {
        assert_eq!(layer.k, local_keys[l]);
        assert_eq!(layer.v, local_values[l]);
        assert_eq!(layer.q.len(), 32 * config.q_dim());
    }
}

#[test]
fn the_dump_tool_feeds_a_text_file_teacher_forced() {
    let model = common::model();
    let tokenizer = common::tokenizer(&model);
    let dir = tempfile::tempdir().unwrap();
    let text_path = dir.path().join("story.txt");
    let text = "Tom had a red ball. He liked to play with it every day.\n";
    std::fs::write(&text_path, text).unwrap();
    let tok = common::models_dir().join("tok512.bin");
    let trace = run_dump_tool(&["--tokenizer", tok.to_str().unwrap(), "--text", text_path.to_str().unwrap()]);
    let tokens = tokenizer.encode(text, true, false);
    assert_eq!(trace.tokens, tokens);
    assert_eq!(trace, trace_tokens(&model, &tokens).unwrap());
}
