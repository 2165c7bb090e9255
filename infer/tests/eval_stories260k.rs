//! The evaluation harness on stories260K (fast, CI): 512 tokens of the shipped text,
//! teacher-forced, every storage against f16 pages.
//!
//! The harness is sound (f16 against the f16 reference is exactly the reference; the f16
//! reference is the model's own f32 cache up to f16 rounding; the thread count changes nothing),
//! the pages are where the daemon leaves them (sink page and window f16, the rest in the format),
//! and the formats order as their bits do. Thresholds are measured values with margin: q8's mean
//! KL was 1.6e-6 (max 5.7e-5) and q4's 7.3e-5.
//!
//! stories260K's head_dim is 8, padded to 16 in pages, so bits per element count padded slots.

#![allow(clippy::unwrap_used)]

mod common;

use kvmm_infer::eval::{EvalOptions, EvalReport, PassReport, evaluate, parse_storages};
use kvmm_infer::{Forward, LocalKvCache, Storage, Tokenizer};
use kvmm_kernels::Format;

const TOKENS: usize = 512;

fn options(storages: &str, threads: usize) -> EvalOptions {
    EvalOptions {
        storages: parse_storages(storages).unwrap(),
        max_tokens: Some(TOKENS),
        threads,
        ..EvalOptions::default()
    }
}

fn run(storages: &str, threads: usize) -> EvalReport {
    let model = common::model();
    let tokenizer = Tokenizer::from(common::tokenizer(&model));
    evaluate(&model, &tokenizer, &common::evaluation_text(), &options(storages, threads)).unwrap()
}

fn pass(report: &EvalReport, name: &str) -> PassReport {
    report.pass(Storage::from_name(name).unwrap()).unwrap().clone()
}

#[test]
fn stories260k_quality_table_over_the_shipped_text() {
    let report = run("f16,q8,k8v4,q4,auto,mass,mass-down,q2", 0);
    println!("{report}");
    print!("{}", report.json_lines());
    assert_eq!((report.tokens, report.steps(), report.page_head_dim), (TOKENS, TOKENS - 1, 16));
    assert!(report.text_tokens > TOKENS && report.bos);
    let counted = report.reference.top1_counted;
    assert!(counted > 200, "steps with a clear reference top-1: {counted}");

    // f16 pages against the f16 reference: the same computation, so exactly the same numbers.
    let f16 = pass(&report, "f16");
    assert_eq!((f16.mean_kl, f16.max_kl), (0.0, 0.0));
    assert_eq!((f16.top1_agree, f16.top1_counted), (counted, counted));
    assert_eq!(f16.perplexity, report.reference.perplexity);

    // q8 is nearly lossless.
    let q8 = pass(&report, "q8");
    assert!(q8.mean_kl < 2e-5 && q8.max_kl < 1e-3, "{q8:?}");
    assert!(q8.top1_agreement().unwrap() >= 0.99, "{q8:?}");
    assert!(report.delta_perplexity_percent(&q8).abs() < 0.1, "{q8:?}");

    // Fewer bits, more divergence.
    let kl = |name| pass(&report, name).mean_kl;
    assert!(kl("q8") < kl("k8v4") && kl("k8v4") < kl("q4") && kl("q4") < kl("q2"), "{report}");
    assert!(kl("q2") > 10.0 * kl("q4"), "{report}");

    // Bytes: the formats' own costs on the pages that left the window; adaptive precision by mass
    // as the daemon does it spends at least q4's there, the step-down variant at most q4's; by age
    // (a shorter window, so compare every page) at most q4's.
    let old_bits = |name| pass(&report, name).old_bits_per_element.unwrap();
    let shape = kvmm_kernels::PageShape { kv_heads: 4, head_dim: 16, block_tokens: 32 };
    for name in ["f16", "q8", "k8v4", "q4", "q2"] {
        let format = Format::from_name(name).unwrap();
        assert_eq!(old_bits(name), format.bits_per_element(shape), "{name}");
    }
    assert!(old_bits("mass") >= old_bits("q4"), "{report}");
    assert!(old_bits("mass-down") <= old_bits("q4"), "{report}");
    let bits = |name| pass(&report, name).bits_per_element;
    assert!(bits("auto") <= bits("q4"), "{report}");
}

#[test]
fn stories260k_pages_outside_the_sink_page_and_window_take_the_format() {
    let report = run("q4,mass,mass-down", 0);
    // 511 tokens fed: 16 pages per layer; page b left the window once (b + 1) × 32 + 128 ≤ 511,
    // so pages 1..=10 are compressed, the sink page 0 and pages 11..=15 (the last 128 tokens and
    // the partial page) are f16.
    for p in &report.passes {
        assert_eq!(p.page_formats.len(), 5);
        for (layer, formats) in p.page_formats.iter().enumerate() {
            assert_eq!(formats.len(), 16, "{} layer {layer}", p.storage);
            for (b, &f) in formats.iter().enumerate() {
                let kept = b == 0 || b >= 11;
                assert_eq!(f == Format::F16, kept, "{} layer {layer}: page {b} is {f}", p.storage);
                if !kept && p.storage == Storage::Uniform(Format::Q4) {
                    assert_eq!(f, Format::Q4);
                }
                if !kept {
                    assert!([Format::Q8, Format::Q4, Format::Q2].contains(&f), "{} page {b}: {f}", p.storage);
                }
            }
        }
    }
    let census = |name| pass(&report, name).census();
    assert_eq!(census("q4"), [(Format::F16, 30), (Format::Q4, 50)]);
    // 10 candidates per layer: 5% is one page up in every layer.
    let q8 = |name| census(name).iter().find(|(f, _)| *f == Format::Q8).map_or(0, |&(_, n)| n);
    assert!(q8("mass") >= 5 && q8("mass-down") >= 1, "{report}");
}

#[test]
fn stories260k_by_age_the_newest_pages_past_a_32_token_window_are_k8v4_and_older_ones_q4() {
    let report = run("auto", 0);
    let auto = pass(&report, "auto");
    // 511 tokens: page b left the 32-token window once (b + 1) × 32 + 32 ≤ 511, so pages 1..=13
    // are compressed; the sink page 0, page 14 and the partial page 15 are f16.
    for (layer, formats) in auto.page_formats.iter().enumerate() {
        let names: Vec<&str> = formats.iter().map(|f| f.name()).collect();
        assert_eq!(formats.len(), 16);
        assert_eq!([formats[0], formats[14], formats[15]], [Format::F16; 3], "layer {layer}: {names:?}");
        let k8v4 = formats[1..=13].iter().filter(|&&f| f == Format::K8V4).count();
        assert!(k8v4 >= 1, "layer {layer}: {names:?}");
        let (q4, newest) = formats[1..=13].split_at(13 - k8v4);
        assert!(q4.iter().all(|&f| f == Format::Q4) && newest.iter().all(|&f| f == Format::K8V4), "{names:?}");
    }
}

#[test]
fn stories260k_results_do_not_depend_on_the_thread_count() {
    let one = run("q8,auto", 1);
    let two = run("q8,auto", 2);
    assert_eq!(one.reference, two.reference);
    assert_eq!(one.passes, two.passes);
}

#[test]
fn stories260k_f16_reference_is_the_f32_cache_up_to_f16_rounding() {
    let model = common::model();
    let tokenizer = Tokenizer::from(common::tokenizer(&model));
    let mut tokens = tokenizer.encode_document(&common::evaluation_text());
    tokens.truncate(TOKENS);
    let mut cache = LocalKvCache::new(model.config(), TOKENS).unwrap();
    let mut forward = Forward::new(&model);
    let mut nll = 0.0f64;
    for (pos, pair) in tokens.windows(2).enumerate() {
        let logits = forward.step(&model, &mut cache, pair[0], pos).unwrap();
        let mut log_probs = vec![0.0; logits.len()];
        assert!(kvmm_infer::eval::metrics::log_softmax(logits, &mut log_probs));
        nll -= log_probs[pair[1] as usize];
    }
    let f32_ppl = (nll / (TOKENS - 1) as f64).exp();
    let report = run("q8", 0);
    let f16_ppl = report.reference.perplexity;
    println!("perplexity over {TOKENS} tokens: f32 cache {f32_ppl:.4}, f16 pages {f16_ppl:.4}");
    assert!((f16_ppl / f32_ppl - 1.0).abs() < 1e-3, "f32 {f32_ppl} vs f16 pages {f16_ppl}");
}

#[test]
fn a_text_too_short_to_predict_and_unknown_storages_are_refused_with_a_sentence() {
    let model = common::model();
    let tokenizer = Tokenizer::from(common::tokenizer(&model));
    let err = evaluate(&model, &tokenizer, "", &options("q8", 1)).unwrap_err();
    assert!(err.to_string().contains("needs at least 2"), "{err}");
    let err = parse_storages("q8,q3").unwrap_err();
    assert!(err.to_string().contains("\"q3\" is not a KV storage"), "{err}");
}
