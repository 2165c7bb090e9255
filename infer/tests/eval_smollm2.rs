//! The evaluation on SmolLM2-135M-Instruct (Q4_1 GGUF) over the shipped text, against the issue's
//! acceptance thresholds: q8 top-1 agreement ≥ 99%, mean KL ≤ 0.0015, perplexity at most 1% up;
//! q4 (KIVI layout, sink page and window exact) top-1 ≥ 97%, mean KL ≤ 0.004. Skipped (with a
//! message) when the model has not been fetched.
//!
//! The whole text is 6,318 tokens and takes far longer than CI allows (see the ignored test for
//! the command and its time); the CI-sized test runs the first 256 tokens (about 2 minutes of CPU
//! in the dev profile), where 2 of each layer's 8 pages have left the window: a smoke test of the
//! pipeline on a real model, whose thresholds hold with wide margins (q8's mean KL ~2e-6, q4's
//! ~3e-4 at this length, against 0.0015 and 0.004).

#![allow(clippy::unwrap_used)]

mod common;

use kvmm_infer::eval::{EvalOptions, EvalReport, evaluate_with_progress, parse_storages};
use kvmm_infer::model::gguf;
use kvmm_infer::{Storage, Tokenizer};
use kvmm_kernels::Format;

fn evaluate(storages: &str, tokens: Option<usize>) -> Option<EvalReport> {
    let path = common::smollm2_gguf()?;
    let (model, tokenizer) = gguf::load(&path).unwrap();
    let tokenizer = Tokenizer::from(tokenizer);
    let options =
        EvalOptions { storages: parse_storages(storages).unwrap(), max_tokens: tokens, ..EvalOptions::default() };
    let report = evaluate_with_progress(&model, &tokenizer, &common::evaluation_text(), &options, &mut |done, all| {
        if done % 512 == 0 {
            eprintln!("{done}/{all} steps");
        }
    })
    .unwrap();
    println!("{report}");
    print!("{}", report.json_lines());
    Some(report)
}

/// The issue's thresholds for q8 and q4.
fn assert_acceptance(report: &EvalReport) {
    let q8 = report.pass(Storage::Uniform(Format::Q8)).unwrap();
    assert!(q8.top1_agreement().unwrap() >= 0.99, "q8 top-1: {q8:?}");
    assert!(q8.mean_kl <= 0.0015, "q8 KL: {q8:?}");
    assert!(report.delta_perplexity_percent(q8) <= 1.0, "q8 perplexity: {q8:?}");
    let q4 = report.pass(Storage::Uniform(Format::Q4)).unwrap();
    assert!(q4.top1_agreement().unwrap() >= 0.97, "q4 top-1: {q4:?}");
    assert!(q4.mean_kl <= 0.004, "q4 KL: {q4:?}");
}

#[test]
fn smollm2_meets_the_q8_and_q4_thresholds_over_the_first_256_tokens() {
    let Some(report) = evaluate("q8,q4", Some(256)) else { return };
    assert_eq!(report.steps(), 255);
    assert!(!report.bos, "SmolLM2 documents start without BOS");
    assert_acceptance(&report);
}

/// The full table (every format over the whole text). Slow: run it with
///
/// ```text
/// cargo test --release -p kvmm-infer --test eval_smollm2 -- --ignored --nocapture
/// ```
#[test]
#[ignore = "the whole text takes about 25 minutes in release on 2 cores; see the doc comment for the command"]
fn smollm2_quality_table_over_the_whole_shipped_text() {
    let Some(report) = evaluate("q8,k8v4,q4,auto,mass,q2", None) else { return };
    assert_eq!(report.tokens, report.text_tokens, "the whole text fits SmolLM2's context");
    assert_acceptance(&report);
    // The daemon's adaptive precision (by age) at q4's bytes: lower mean KL than q4.
    let (auto, q4) = (report.pass(Storage::AUTO).unwrap(), report.pass(Storage::Uniform(Format::Q4)).unwrap());
    assert!(auto.bits_per_element <= q4.bits_per_element, "auto bytes: {auto:?}");
    assert!(auto.mean_kl < q4.mean_kl, "auto KL: {auto:?} against q4's {}", q4.mean_kl);
}
