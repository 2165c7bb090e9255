//! A prompt's prefill (`Forward::prefill`, layer by layer over groups of tokens, the weight
//! products batched) against feeding the same tokens one by one (`Forward::step`): the logits
//! after the prompt, and of the steps after it, are the same bit for bit, for stories260K's f32
//! weights and SmolLM2's Q4_1/Q8_0 weights (skipped, with a message, when SmolLM2 has not been
//! fetched). Prompts longer than a group (`PREFILL_TOKENS`) cross group boundaries.

#![allow(clippy::unwrap_used)]

mod common;

use kvmm_infer::forward::PREFILL_TOKENS;
use kvmm_infer::model::gguf;
use kvmm_infer::{Forward, InferErrorKind, KvCache, LocalKvCache, Model, argmax};

fn bits(logits: &[f32]) -> Vec<u32> {
    logits.iter().map(|l| l.to_bits()).collect()
}

/// Feeds `prompt` one token at a time into one cache and as one prefill into another, then
/// decodes `after` greedy steps on both; every compared logit must be identical.
fn prefill_matches_steps(model: &Model, prompt: &[u32], after: usize) {
    let positions = prompt.len() + after;
    let c = model.config();
    let (mut one, mut all) = (LocalKvCache::new(c, positions).unwrap(), LocalKvCache::new(c, positions).unwrap());
    let (mut f1, mut f2) = (Forward::new(model), Forward::new(model));
    let mut stepped = Vec::new();
    for (pos, &t) in prompt.iter().enumerate() {
        stepped = f1.step(model, &mut one, t, pos).unwrap().to_vec();
    }
    let prefilled = f2.prefill(model, &mut all, prompt, 0).unwrap().to_vec();
    assert_eq!(bits(&prefilled), bits(&stepped), "logits after a {}-token prompt", prompt.len());
    assert!((0..c.layers).all(|l| all.tokens(l) == prompt.len()));
    let mut token = argmax(&stepped);
    for pos in prompt.len()..positions {
        let a = f1.step(model, &mut one, token, pos).unwrap().to_vec();
        let b = f2.step(model, &mut all, token, pos).unwrap().to_vec();
        assert_eq!(bits(&a), bits(&b), "logits at position {pos}, after the prompt");
        token = argmax(&a);
    }
}

#[test]
fn stories260k_prefill_gives_the_logits_of_feeding_the_prompt_token_by_token() {
    let model = common::model();
    let ids = common::golden_ids();
    assert!(ids.len() > 2 * PREFILL_TOKENS + 1);
    for len in [1, PREFILL_TOKENS, 2 * PREFILL_TOKENS + 1] {
        prefill_matches_steps(&model, &ids[..len], 4);
    }
}

#[test]
fn smollm2_prefill_gives_the_logits_of_feeding_the_prompt_token_by_token() {
    let Some(path) = common::smollm2_gguf() else { return };
    let (model, tokenizer) = gguf::load(&path).unwrap();
    let tokenizer = kvmm_infer::Tokenizer::from(tokenizer);
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/texts/us-constitution.txt")).unwrap();
    let ids = tokenizer.encode_document(&text);
    prefill_matches_steps(&model, &ids[..PREFILL_TOKENS + 9], 3);
}

#[test]
fn a_prefill_refuses_empty_prompts_unknown_tokens_and_positions_that_do_not_fit() {
    let model = common::model();
    let c = *model.config();
    let mut cache = LocalKvCache::new(&c, c.seq_len).unwrap();
    let mut f = Forward::new(&model);
    let refused = |r: Result<&[f32], kvmm_infer::InferError>, needle: &str| {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), InferErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains(needle), "{e}");
    };
    refused(f.prefill(&model, &mut cache, &[], 0), "at least one token");
    refused(f.prefill(&model, &mut cache, &[1, c.vocab_size as u32], 0), "outside the model's vocabulary");
    refused(f.prefill(&model, &mut cache, &vec![1; c.seq_len + 1], 0), "past the model's context");
    refused(f.prefill(&model, &mut cache, &[1, 2], 5), "does not follow the cache");
    assert!((0..c.layers).all(|l| cache.tokens(l) == 0), "nothing was appended by a refused prefill");
    f.prefill(&model, &mut cache, &[1, 2], 0).unwrap();
    refused(f.prefill(&model, &mut cache, &[3], 0), "does not follow the cache");
}
