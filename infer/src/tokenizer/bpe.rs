//! [`BpeTokenizer`]: byte-level BPE as GPT-2 defined it and llama.cpp's `gpt2` tokenizer model runs
//! it, built from a GGUF file's `tokenizer.ggml.*` metadata (SmolLM2 and other Hugging Face BPE
//! models).
//!
//! The vocabulary is text in GPT-2's byte-level alphabet ([`super::byte_level`]): a normal token's
//! characters each stand for one byte. Token types (`tokenizer.ggml.token_type`) say which tokens are
//! special: control (`3`, e.g. `<|im_start|>`) and user-defined (`4`) tokens are written as plain
//! text and recognized verbatim in input; normal (`1`) tokens are byte-level text. Merges
//! (`tokenizer.ggml.merges`) are `"left right"` pairs of token texts, ranked by their position.
//!
//! Encoding:
//!
//! 1. Special tokens are cut out of the text wherever they occur (the longest one wins); they are
//!    never split or merged.
//! 2. Each stretch between them is cut by the [`PreTokenizer`] the file names
//!    (`tokenizer.ggml.pre`).
//! 3. Each piece starts as one token per byte; then, repeatedly, the adjacent pair with the lowest
//!    merge rank (the leftmost of equals) becomes the token the merge makes, until no pair has a
//!    merge.
//!
//! A vocabulary need not have a token for every byte: SmolLM2's lacks 21 (`0x04`, `0x06`, `0x13`,
//! `0x14`, `0x16`, `0x1D`, and `0xC0`, `0xC1`, `0xF1`, `0xF2`, `0xF5..=0xFF`, most of which never
//! occur in UTF-8). Such a byte is dropped from the output, as llama.cpp and Hugging Face
//! tokenizers drop it, and until then it sits between its neighbours so that no merge joins across
//! it.
//!
//! Decoding maps each normal token's characters back to bytes and writes special tokens' text, so
//! `decode(encode(t)) == t` for every text `t` whose bytes all have tokens.
//!
//! Invariants checked on construction, each with a sentence naming the key and the token: one type
//! per token, all of known kinds; every normal token made of byte characters only; every merge
//! naming two tokens whose concatenation is a token; BOS and EOS inside the vocabulary.

use std::collections::HashMap;

use super::byte_level::{byte_to_char, char_to_byte};
use super::chat::ChatTemplate;
use super::pretokenize::PreTokenizer;
use crate::error::InferError;
use crate::gguf::{Gguf, Value};

/// What a token is, from GGUF `tokenizer.ggml.token_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenKind {
    /// `1`: byte-level text, produced by merges.
    Normal,
    /// `2`: the unknown token.
    Unknown,
    /// `3`: a control token such as `<|im_start|>`, recognized in text.
    Control,
    /// `4`: a token added by hand, recognized in text.
    UserDefined,
    /// `5`: a reserved slot.
    Unused,
    /// `6`: a single raw byte written `<0xXX>`.
    Byte,
}

impl TokenKind {
    /// The kind with GGUF code `code`.
    pub fn from_code(code: i64) -> Option<Self> {
        Some(match code {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }

    /// Whether tokens of this kind are recognized verbatim in text.
    fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined)
    }
}

/// The pieces a [`BpeTokenizer`] is built from (what a GGUF file stores).
#[derive(Clone, Debug)]
pub(crate) struct BpeParts {
    pub(crate) tokens: Vec<String>,
    pub(crate) kinds: Vec<TokenKind>,
    pub(crate) merges: Vec<String>,
    pub(crate) bos: u32,
    pub(crate) eos: u32,
    pub(crate) add_bos: bool,
    pub(crate) pre_tokenizer: PreTokenizer,
    pub(crate) chat_template: Option<ChatTemplate>,
}

/// A byte-level BPE tokenizer.
#[derive(Clone, Debug)]
pub struct BpeTokenizer {
    /// Token text by id, as the vocabulary stores it.
    tokens: Vec<String>,
    /// Token kind by id.
    kinds: Vec<TokenKind>,
    /// The bytes each token decodes to.
    decoded: Vec<Vec<u8>>,
    /// Token text to id; for duplicate texts, the lowest id.
    ids: HashMap<String, u32>,
    /// The token of each single byte (256 entries), or [`NO_TOKEN`] when the vocabulary has none.
    byte_tokens: Vec<u32>,
    /// `(left, right)` to `(rank, merged)`; for duplicate pairs, the lowest rank.
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Tokens recognized in text, longest text first.
    specials: Vec<(String, u32)>,
    /// Whether some special token's text starts with this byte (256 entries; a quick filter).
    special_first_byte: Vec<bool>,
    /// How text is cut into pieces before merging (`tokenizer.ggml.pre`).
    pre_tokenizer: PreTokenizer,
    /// `tokenizer.ggml.bos_token_id`.
    bos: u32,
    /// `tokenizer.ggml.eos_token_id`.
    eos: u32,
    /// Whether documents are encoded with BOS first (`tokenizer.ggml.add_bos_token`).
    add_bos: bool,
    /// Tokens that end generation: EOS and the other end-of-text control tokens.
    stop_tokens: Vec<u32>,
    /// The ChatML template recognized in `tokenizer.chat_template`, if any.
    chat_template: Option<ChatTemplate>,
}

impl BpeTokenizer {
    /// Builds the tokenizer a GGUF file describes (`tokenizer.ggml.model` = `gpt2`).
    pub fn from_gguf(g: &Gguf) -> Result<Self, InferError> {
        let model = g.require_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(g.error(format!(
                "its tokenizer.ggml.model is {model:?}, but this engine reads only byte-level BPE (\"gpt2\") \
                 vocabularies from GGUF"
            )));
        }
        let pre = g.require_str("tokenizer.ggml.pre")?;
        let pre_tokenizer = PreTokenizer::from_gguf_name(pre).ok_or_else(|| {
            g.error(format!(
                "its tokenizer.ggml.pre is {pre:?}, a pre-tokenizer this engine does not implement (it knows \
                 smollm, starcoder, refact, command-r, codeshell, exaone, minerva, gpt2, mpt, olmo and jais)"
            ))
        })?;
        let strings = |key: &str| -> Result<Vec<String>, InferError> {
            g.require_array(key)?
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str().map(str::to_owned).ok_or_else(|| {
                        g.error(format!("its {key} element {i} is {}, but it must be a string", v.describe_type()))
                    })
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let kinds = match g.get("tokenizer.ggml.token_type") {
            None => vec![TokenKind::Normal; tokens.len()],
            Some(Value::Array(_, types)) => types
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_i64().and_then(TokenKind::from_code).ok_or_else(|| {
                        g.error(format!(
                            "its tokenizer.ggml.token_type element {i} is {v:?}, not a token type (1 to 6)"
                        ))
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(v) => {
                return Err(g.error(format!(
                    "its tokenizer.ggml.token_type is {}, but it must be an array",
                    v.describe_type()
                )));
            }
        };
        let id = |key: &str| -> Result<u32, InferError> {
            let v = g.require_u64(key)?;
            u32::try_from(v).map_err(|_| g.error(format!("its {key} is {v}, too large for a token id")))
        };
        let parts = BpeParts {
            tokens,
            kinds,
            merges,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            add_bos: g.optional_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false),
            pre_tokenizer,
            chat_template: match g.get("tokenizer.chat_template") {
                Some(v) => v.as_str().and_then(ChatTemplate::from_jinja),
                None => None,
            },
        };
        Self::new(parts).map_err(|reason| g.error(reason))
    }

    /// Builds and checks a tokenizer; errors complete "... is not a usable GGUF model: ".
    pub(crate) fn new(parts: BpeParts) -> Result<Self, String> {
        let BpeParts { tokens, kinds, merges, bos, eos, add_bos, pre_tokenizer, chat_template } = parts;
        let n = tokens.len();
        if n == 0 || u32::try_from(n).is_err() {
            return Err(format!("its tokenizer.ggml.tokens has {n} tokens"));
        }
        if kinds.len() != n {
            return Err(format!(
                "its tokenizer.ggml.token_type has {} entries, but tokenizer.ggml.tokens has {n}",
                kinds.len()
            ));
        }
        for (what, id) in [("bos", bos), ("eos", eos)] {
            if id as usize >= n {
                return Err(format!("its tokenizer.ggml.{what}_token_id is {id}, outside the {n} tokens"));
            }
        }
        let mut ids = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            ids.entry(t.clone()).or_insert(i as u32);
        }

        let mut decoded = Vec::with_capacity(n);
        for (i, (text, kind)) in tokens.iter().zip(&kinds).enumerate() {
            decoded.push(match kind {
                TokenKind::Normal => text.chars().map(char_to_byte).collect::<Option<Vec<u8>>>().ok_or_else(|| {
                    format!(
                        "its normal token {i} ({text:?}) has a character outside GPT-2's byte-level alphabet, so \
                         it stands for no bytes"
                    )
                })?,
                TokenKind::Byte => byte_piece(text)
                    .map(|b| vec![b])
                    .ok_or_else(|| format!("its byte token {i} is {text:?}, not of the form <0xXX>"))?,
                _ => text.as_bytes().to_vec(),
            });
        }

        let mut byte_tokens = vec![NO_TOKEN; 256];
        for b in 0..=255u8 {
            if let Some(&id) = ids.get(&byte_to_char(b).to_string()) {
                byte_tokens[usize::from(b)] = id;
            }
        }

        let mut merge_table = HashMap::with_capacity(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            let bad = |why: &str| format!("its tokenizer.ggml.merges entry {rank} ({merge:?}) {why}");
            let (left, right) = merge.split_once(' ').ok_or_else(|| bad("is not two tokens separated by a space"))?;
            let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) else {
                return Err(bad("names a token that is not in tokenizer.ggml.tokens"));
            };
            let &merged =
                ids.get(&format!("{left}{right}")).ok_or_else(|| bad("makes a token that is not in the vocabulary"))?;
            merge_table.entry((l, r)).or_insert((rank as u32, merged));
        }

        let mut specials: Vec<(String, u32)> = tokens
            .iter()
            .zip(&kinds)
            .enumerate()
            .filter(|(_, (text, kind))| kind.is_special() && !text.is_empty())
            .map(|(i, (text, _))| (text.clone(), i as u32))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut special_first_byte = vec![false; 256];
        for (text, _) in &specials {
            special_first_byte[usize::from(text.as_bytes()[0])] = true;
        }

        let mut stop_tokens = vec![eos];
        for name in ["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>"] {
            if let Some(&id) = ids.get(name)
                && kinds[id as usize] == TokenKind::Control
                && !stop_tokens.contains(&id)
            {
                stop_tokens.push(id);
            }
        }

        Ok(Self {
            tokens,
            kinds,
            decoded,
            ids,
            byte_tokens,
            merges: merge_table,
            specials,
            special_first_byte,
            pre_tokenizer,
            bos,
            eos,
            add_bos,
            stop_tokens,
            chat_template,
        })
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The beginning-of-sequence id (for ChatML models, `<|im_start|>`).
    pub fn bos(&self) -> u32 {
        self.bos
    }

    /// The end-of-sequence id (for ChatML models, `<|im_end|>`).
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// Whether documents are encoded with BOS first (the file's `tokenizer.ggml.add_bos_token`;
    /// `false` when absent).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The tokens that end generation: EOS, and the control tokens `<|endoftext|>`, `<|im_end|>`,
    /// `<|eot_id|>` and `<|end_of_text|>` when the vocabulary has them.
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    /// The pre-tokenizer.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre_tokenizer
    }

    /// The chat template, when the file has a ChatML one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The vocabulary text of `id` (byte-level text for normal tokens: `"Ġworld"`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The kind of `id`.
    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// The id whose vocabulary text is `text` (byte-level text for normal tokens).
    pub fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Encodes `text` (special tokens in it included), optionally framed by BOS and EOS.
    pub fn encode(&self, text: &str, bos: bool, eos: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if bos {
            out.push(self.bos);
        }
        let bytes = text.as_bytes();
        let (mut plain_start, mut i) = (0, 0);
        while i < bytes.len() {
            if self.special_first_byte[usize::from(bytes[i])]
                && let Some((special, id)) = self.specials.iter().find(|(s, _)| bytes[i..].starts_with(s.as_bytes()))
            {
                // A UTF-8 string never starts with a continuation byte, so `i` is a char boundary.
                self.encode_plain(&text[plain_start..i], &mut out);
                out.push(*id);
                i += special.len();
                plain_start = i;
                continue;
            }
            i += 1;
        }
        self.encode_plain(&text[plain_start..], &mut out);
        if eos {
            out.push(self.eos);
        }
        out
    }

    /// Encodes text with no special tokens in it.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        for piece in self.pre_tokenizer.split(text) {
            let mut symbols: Vec<u32> = piece.bytes().map(|b| self.byte_tokens[usize::from(b)]).collect();
            loop {
                let mut best: Option<(u32, usize, u32)> = None;
                for (i, pair) in symbols.windows(2).enumerate() {
                    if let Some(&(rank, merged)) = self.merges.get(&(pair[0], pair[1]))
                        && best.is_none_or(|(r, _, _)| rank < r)
                    {
                        best = Some((rank, i, merged));
                    }
                }
                let Some((_, i, merged)) = best else { break };
                symbols[i] = merged;
                symbols.remove(i + 1);
            }
            out.extend(symbols.iter().filter(|&&s| s != NO_TOKEN));
        }
    }

    /// The bytes `token` decodes to.
    pub fn decode_token(&self, token: u32) -> Result<&[u8], InferError> {
        self.decoded.get(token as usize).map(Vec::as_slice).ok_or_else(|| {
            InferError::InvalidArgument(format!(
                "token id {token} is not in the vocabulary of {} tokens",
                self.vocab_size()
            ))
        })
    }

    /// Decodes `tokens` to bytes (a code point may span tokens, so a slice of tokens may end inside
    /// one). Special tokens decode to their text.
    pub fn decode(&self, tokens: &[u32]) -> Result<Vec<u8>, InferError> {
        let mut out = Vec::with_capacity(tokens.len() * 4);
        for &t in tokens {
            out.extend_from_slice(self.decode_token(t)?);
        }
        Ok(out)
    }
}

/// Stands for a byte without a token while a piece is merged; no merge involves it.
const NO_TOKEN: u32 = u32::MAX;

/// The byte of a `<0xXX>` piece.
fn byte_piece(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of the 256 byte characters, `<s>`, `</s>`, and merges building `extra`.
    fn build(merges: &[&str]) -> BpeTokenizer {
        let mut tokens = vec!["<s>".to_owned(), "</s>".to_owned()];
        let mut kinds = vec![TokenKind::Control; 2];
        tokens.extend((0..=255u8).map(|b| byte_to_char(b).to_string()));
        kinds.extend([TokenKind::Normal; 256]);
        for m in merges {
            let merged = m.replace(' ', "");
            if !tokens.contains(&merged) {
                tokens.push(merged);
                kinds.push(TokenKind::Normal);
            }
        }
        BpeTokenizer::new(BpeParts {
            tokens,
            kinds,
            merges: merges.iter().map(|m| m.to_string()).collect(),
            bos: 0,
            eos: 1,
            add_bos: false,
            pre_tokenizer: PreTokenizer::Gpt2Digits,
            chat_template: None,
        })
        .unwrap()
    }

    fn texts(t: &BpeTokenizer, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&i| t.token_text(i).unwrap().to_owned()).collect()
    }

    #[test]
    fn merges_apply_by_rank_not_by_position() {
        // "abc": (b,c) outranks (a,b), so "bc" forms first and (a,bc) has no merge.
        let t = build(&["b c", "a b"]);
        assert_eq!(texts(&t, &t.encode("abc", false, false)), ["a", "bc"]);
        let t = build(&["a b", "b c", "ab c"]);
        assert_eq!(texts(&t, &t.encode("abc", false, false)), ["abc"]);
    }

    #[test]
    fn spaces_are_byte_characters_and_merges_stay_inside_pieces() {
        let t = build(&["Ġ w", "Ġw o"]);
        // The pre-tokenizer cuts "a wo" into "a" and " wo"; " w" merges, then " wo".
        assert_eq!(texts(&t, &t.encode("a wo", false, false)), ["a", "Ġwo"]);
    }

    #[test]
    fn special_tokens_are_recognized_in_text_and_never_merged() {
        let t = build(&["s >"]);
        let ids = t.encode("x<s>y</s>", true, true);
        assert_eq!(ids[0], 0);
        assert_eq!(ids[2], 0);
        assert_eq!(ids[4], 1);
        assert_eq!(*ids.last().unwrap(), 1);
        assert_eq!(t.decode(&ids[1..ids.len() - 1]).unwrap(), b"x<s>y</s>");
    }

    #[test]
    fn any_text_round_trips_through_bytes() {
        let t = build(&["Ġ t", "h e", "Ġt he"]);
        for text in ["the cat", "naïve café 🙂\n\n\ttabs", "\u{0}\u{7f}\u{ad}", ""] {
            assert_eq!(t.decode(&t.encode(text, false, false)).unwrap(), text.as_bytes(), "{text:?}");
        }
    }

    #[test]
    fn bad_merges_and_vocabularies_are_named() {
        let mut parts = BpeParts {
            tokens: (0..=255u8).map(|b| byte_to_char(b).to_string()).collect(),
            kinds: vec![TokenKind::Normal; 256],
            merges: vec!["a b".into()],
            bos: 0,
            eos: 1,
            add_bos: false,
            pre_tokenizer: PreTokenizer::Gpt2,
            chat_template: None,
        };
        let msg = BpeTokenizer::new(parts.clone()).unwrap_err();
        assert!(msg.contains("merges entry 0 (\"a b\") makes a token that is not in the vocabulary"), "{msg}");
        parts.merges = vec!["ab".into()];
        assert!(BpeTokenizer::new(parts.clone()).unwrap_err().contains("is not two tokens separated by a space"));
        parts.merges.clear();
        parts.tokens[65] = "Ā€".into();
        let msg = BpeTokenizer::new(parts.clone()).unwrap_err();
        assert!(msg.contains("normal token 65"), "{msg}");
        parts.eos = 999;
        assert!(BpeTokenizer::new(parts).unwrap_err().contains("eos_token_id is 999, outside the 256 tokens"));
    }

    #[test]
    fn bytes_without_a_token_are_dropped_and_block_merges_across_them() {
        let mut t = build(&["a b"]);
        t.byte_tokens[4] = NO_TOKEN;
        assert_eq!(texts(&t, &t.encode("ab", false, false)), ["ab"]);
        assert_eq!(texts(&t, &t.encode("a\u{4}b", false, false)), ["a", "b"]);
    }

    #[test]
    fn byte_tokens_decode_to_their_byte() {
        assert_eq!(byte_piece("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_piece("<0x0A"), None);
        assert_eq!(byte_piece("<0xZZ>"), None);
    }
}
