//! SmolLM2-135M-Instruct end to end (GGUF, Q4_1 weights): the loader reads the documented shape,
//! the chat template frames the question, and greedy decoding answers "What is the capital of
//! France?" with Paris, stopping at `<|im_end|>`. Skipped (with a message) when the model has not
//! been fetched.

#![allow(clippy::unwrap_used)]

mod common;

use kvmm_infer::generate::Stop;
use kvmm_infer::model::gguf;
use kvmm_infer::{Classifier, LocalKvCache, Tokenizer, WeightFormat, generate_greedy};

/// `<|im_end|>`, SmolLM2's EOS.
const IM_END: u32 = 2;

#[test]
fn smollm2_answers_that_the_capital_of_france_is_paris() {
    let Some(path) = common::smollm2_gguf() else { return };
    let (model, tokenizer) = gguf::load(&path).unwrap();

    let c = model.config();
    assert_eq!(
        (c.dim, c.hidden_dim, c.layers, c.heads, c.kv_heads, c.head_dim, c.vocab_size, c.seq_len),
        (576, 1536, 30, 9, 3, 64, 49152, 8192)
    );
    assert_eq!((c.rope_theta, c.norm_eps), (100000.0, 1e-5));
    let w = model.weights();
    assert_eq!(w.classifier, Classifier::TiedToEmbedding);
    assert_eq!((w.token_embedding.format(), w.layers[29].w2.format()), (WeightFormat::Q8_0, WeightFormat::Q4_1));

    let tokenizer = Tokenizer::from(tokenizer);
    let prompt = tokenizer.chat_prompt("What is the capital of France?").unwrap();
    assert_eq!(prompt[0], tokenizer.bos(), "the template opens with <|im_start|>");
    let steps = prompt.len() + 16;
    let mut cache = LocalKvCache::new(c, steps).unwrap();
    let generation = generate_greedy(&model, &mut cache, &prompt, steps, tokenizer.stop_tokens()).unwrap();
    let answer = String::from_utf8(tokenizer.decode(prompt[prompt.len() - 1], &generation.generated).unwrap()).unwrap();
    println!("SmolLM2 answered: {answer:?}");
    assert!(answer.contains("Paris"), "the answer does not name Paris: {answer:?}");
    assert_eq!(generation.stop, Stop::Token(IM_END), "the answer ran on: {answer:?}");
}
