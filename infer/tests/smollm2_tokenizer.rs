//! SmolLM2's byte-level BPE, built from the GGUF metadata, against ids established independently:
//! vocabulary look-ups, and Hugging Face `tokenizers` 0.23 configured as SmolLM2's
//! `tokenizer.json` (`Digits(individual_digits)` + `ByteLevel`, BPE over the same vocabulary and
//! merges), whose output the golden ids below are. Skipped (with a message) when the model has not
//! been fetched.

#![allow(clippy::unwrap_used)]

mod common;

use kvmm_infer::BpeTokenizer;
use kvmm_infer::gguf::Gguf;
use kvmm_infer::tokenizer::{PreTokenizer, TokenKind};

fn tokenizer() -> Option<BpeTokenizer> {
    let path = common::smollm2_gguf()?;
    Some(BpeTokenizer::from_gguf(&Gguf::read(&path).unwrap()).unwrap())
}

fn texts(t: &BpeTokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter().map(|&i| String::from_utf8(t.decode(&[i]).unwrap()).unwrap()).collect()
}

#[test]
fn smollm2_vocabulary_metadata_is_read_as_documented() {
    let Some(t) = tokenizer() else { return };
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!((t.bos(), t.eos(), t.add_bos()), (1, 2, false));
    assert_eq!((t.token_text(1), t.token_text(2)), (Some("<|im_start|>"), Some("<|im_end|>")));
    assert_eq!(t.kind(0), Some(TokenKind::Control));
    assert_eq!(t.stop_tokens(), &[2, 0], "<|im_end|> and <|endoftext|>");
    assert_eq!(t.pre_tokenizer(), PreTokenizer::Gpt2Digits);
    assert_eq!(
        t.chat_template().unwrap().default_system(),
        Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    );
}

#[test]
fn hello_world_encodes_to_the_vocabulary_ids_of_hello_and_space_world() {
    let Some(t) = tokenizer() else { return };
    assert_eq!((t.id("Hello"), t.id("Ġworld"), t.id("Ċ")), (Some(19556), Some(905), Some(198)));
    assert_eq!(t.encode("Hello world", false, false), [19556, 905]);
    assert_eq!(t.encode("Hello world\n", true, true), [1, 19556, 905, 198, 2]);
}

#[test]
fn the_chat_prompt_matches_hugging_face_token_for_token() {
    let Some(t) = tokenizer() else { return };
    let prompt = t.chat_template().unwrap().render(None, "What is the capital of France?");
    let golden = [
        1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
        198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
    ];
    assert_eq!(t.encode(&prompt, false, false), golden);
}

#[test]
fn digits_are_cut_one_by_one_and_never_carry_a_space() {
    let Some(t) = tokenizer() else { return };
    assert_eq!(texts(&t, &t.encode("in 1787.", false, false)), ["in", " ", "1", "7", "8", "7", "."]);
}

#[test]
fn the_evaluation_text_matches_hugging_face_and_round_trips() {
    let Some(t) = tokenizer() else { return };
    let text = common::evaluation_text();
    let ids = t.encode(&text, false, false);
    // Hugging Face tokenizers: 6318 tokens, starting with these.
    let golden_start = [
        504, 7152, 282, 260, 1797, 1918, 198, 198, 1882, 260, 4228, 282, 260, 1797, 1918, 28, 281, 11643, 288, 910,
        253, 540, 3468, 4353, 28, 3348, 9423, 28, 35831, 5747, 43904, 385, 783, 28,
    ];
    assert_eq!(ids.len(), 6318);
    assert_eq!(ids[..golden_start.len()], golden_start);
    assert_eq!(t.decode(&ids).unwrap(), text.as_bytes());
}

#[test]
fn special_tokens_in_text_are_single_tokens_and_everything_round_trips() {
    let Some(t) = tokenizer() else { return };
    let text = "a<|im_end|>b<|endoftext|>café — “quotes” 🙂 日本語 <|im_start";
    let ids = t.encode(text, false, false);
    assert_eq!(ids[1], 2);
    assert_eq!(ids[3], 0);
    assert_eq!(t.decode(&ids).unwrap(), text.as_bytes());
}
