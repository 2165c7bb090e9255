//! stories260K end to end: the loader, forward pass, KV cache and greedy loop reproduce llama2.c
//! `run.c`'s greedy output token for token, and the tokenizer round-trips text.

#![allow(clippy::unwrap_used)]

mod common;

use kvmm_infer::generate::Stop;
use kvmm_infer::tokenizer::{BOS, BYTE_OFFSET};
use kvmm_infer::{KvCache, LocalKvCache, generate_greedy};

#[test]
fn stories260k_header_is_read_as_documented() {
    let model = common::model();
    let c = model.config();
    assert_eq!(
        (c.dim, c.hidden_dim, c.layers, c.heads, c.kv_heads, c.head_dim, c.vocab_size, c.seq_len),
        (64, 172, 5, 8, 4, 8, 512, 512)
    );
    assert_eq!((c.rope_theta, c.norm_eps), (10000.0, 1e-5));
    assert_eq!(model.weights().classifier, kvmm_infer::Classifier::TiedToEmbedding);
}

#[test]
fn greedy_from_bos_reproduces_run_c_for_256_steps_ids_and_text() {
    let model = common::model();
    let tokenizer = common::tokenizer(&model);
    let mut cache = LocalKvCache::new(model.config(), 256).unwrap();
    let generation = generate_greedy(&model, &mut cache, &[BOS], 256, &[BOS]).unwrap();

    let golden = common::golden_ids();
    assert_eq!(golden.len(), 256);
    let first_diff = generation.generated.iter().zip(&golden).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "generation diverges from the golden ids at step {first_diff:?}");
    assert_eq!(generation.generated, golden);
    assert_eq!(generation.stop, Stop::Steps);
    // 256 forward passes: BOS and the first 255 generated tokens; the 256th is never fed.
    assert_eq!(generation.fed.len(), 256);
    assert_eq!(generation.fed[0], BOS);
    assert_eq!(generation.fed[1..], golden[..255]);
    assert!((0..5).all(|l| cache.tokens(l) == 256));

    // run.c prints decode(prev, next) for every generated token; the golden file is that output
    // without the newline run.c prints after the loop.
    let text = tokenizer.decode(BOS, &generation.generated).unwrap();
    assert_eq!(String::from_utf8_lossy(&text), String::from_utf8_lossy(&common::golden_text()));
}

#[test]
fn ascii_text_round_trips_through_encode_and_decode() {
    let model = common::model();
    let tokenizer = common::tokenizer(&model);
    let text = "Once upon a time, Tom saw a big dog. He said, \"Hi!\"\nThe end.";
    let ids = tokenizer.encode(text, true, false);
    assert_eq!(ids[0], BOS);
    // BPE merges leave far fewer tokens than bytes, and no byte fallback for plain ASCII letters.
    assert!(ids.len() < text.len() / 2, "{} tokens for {} bytes", ids.len(), text.len());
    assert_eq!(tokenizer.decode(BOS, &ids[1..]).unwrap(), text.as_bytes());
}

#[test]
fn the_golden_text_round_trips_through_encode_and_decode() {
    let model = common::model();
    let tokenizer = common::tokenizer(&model);
    let golden = common::golden_text();
    let text = std::str::from_utf8(&golden).unwrap();
    let ids = tokenizer.encode(text, true, true);
    assert_eq!((ids[0], *ids.last().unwrap()), (BOS, 2));
    assert_eq!(tokenizer.decode(BOS, &ids[1..ids.len() - 1]).unwrap(), golden);
}

#[test]
fn characters_outside_the_vocabulary_fall_back_to_byte_tokens() {
    let model = common::model();
    let tokenizer = common::tokenizer(&model);
    // tok512 has "é" (id 485) but neither "ü" (C3 BC) nor "🙂" (F0 9F 99 82): those become byte tokens.
    let text = "café über 🙂";
    let ids = tokenizer.encode(text, false, false);
    assert!(ids.contains(&485));
    let bytes: Vec<u32> = ids.iter().copied().filter(|id| (BYTE_OFFSET..BYTE_OFFSET + 256).contains(id)).collect();
    let expect: Vec<u32> = [0xC3u32, 0xBC, 0xF0, 0x9F, 0x99, 0x82].iter().map(|b| b + BYTE_OFFSET).collect();
    assert_eq!(bytes, expect);
    // Without BOS before it, the dummy-prefix space stays.
    assert_eq!(tokenizer.decode(0, &ids).unwrap(), format!(" {text}").as_bytes());
    assert_eq!(tokenizer.decode(BOS, &ids).unwrap(), text.as_bytes());
}

#[test]
fn the_newline_byte_token_decodes_to_a_raw_newline() {
    let model = common::model();
    let tokenizer = common::tokenizer(&model);
    assert_eq!(tokenizer.piece(13).unwrap(), b"<0x0A>");
    assert_eq!(tokenizer.decode_piece(BOS, 13).unwrap(), b"\n");
    assert_eq!(tokenizer.encode("\n", false, false), vec![tokenizer.id(b" ").unwrap(), 13]);
}
