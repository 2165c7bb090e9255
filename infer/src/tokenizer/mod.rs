//! [`Tokenizer`]: text to token ids and back, for either model family.
//!
//! - [`Llama2cTokenizer`] ([`llama2c`]): llama2.c's sentencepiece-style vocabulary with merge
//!   scores, from a separate `tokenizer.bin` (stories260K's `tok512.bin`).
//! - [`BpeTokenizer`] ([`bpe`]): GPT-2 byte-level BPE with ranked merges, from a GGUF file's
//!   metadata (SmolLM2), with [`PreTokenizer`] cutting text into pieces first and a ChatML
//!   [`ChatTemplate`] when the file has one.
//!
//! Generation, the dump tool and tests hold a [`Tokenizer`] and never ask which family it is,
//! except for what only one family has (the chat template). The families differ in their
//! conventions, which the enum makes explicit: which token starts a document ([`Tokenizer::bos`],
//! [`Tokenizer::adds_bos`]) and which tokens end generation ([`Tokenizer::stop_tokens`]: BOS for
//! llama2.c, as `run.c` does; EOS `<|im_end|>` and `<|endoftext|>` for SmolLM2).
//!
//! The constants below are llama2.c's fixed ids, kept here for the stories260K code and tests.

pub mod bpe;
pub mod byte_level;
pub mod chat;
pub mod llama2c;
pub mod pretokenize;

pub use bpe::{BpeTokenizer, TokenKind};
pub use chat::ChatTemplate;
pub use llama2c::{BOS, BYTE_OFFSET, EOS, Llama2cTokenizer, UNK};
pub use pretokenize::PreTokenizer;

use crate::error::InferError;

/// A tokenizer of either family.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// llama2.c's vocabulary (stories260K).
    Llama2c(Llama2cTokenizer),
    /// Byte-level BPE from a GGUF file (SmolLM2).
    Bpe(BpeTokenizer),
}

impl From<Llama2cTokenizer> for Tokenizer {
    fn from(t: Llama2cTokenizer) -> Self {
        Self::Llama2c(t)
    }
}

impl From<BpeTokenizer> for Tokenizer {
    fn from(t: BpeTokenizer) -> Self {
        Self::Bpe(t)
    }
}

impl Tokenizer {
    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Llama2c(t) => t.vocab_size(),
            Self::Bpe(t) => t.vocab_size(),
        }
    }

    /// The token a sequence starts with (llama2.c: BOS = 1; SmolLM2: `<|im_start|>` = 1).
    pub fn bos(&self) -> u32 {
        match self {
            Self::Llama2c(_) => BOS,
            Self::Bpe(t) => t.bos(),
        }
    }

    /// Whether a plain document is encoded with [`bos`](Self::bos) first: always for llama2.c,
    /// as the file says for GGUF (SmolLM2: no — its BOS opens a chat turn, not a document).
    pub fn adds_bos(&self) -> bool {
        match self {
            Self::Llama2c(_) => true,
            Self::Bpe(t) => t.add_bos(),
        }
    }

    /// The tokens that end greedy generation.
    pub fn stop_tokens(&self) -> &[u32] {
        match self {
            Self::Llama2c(_) => &[BOS],
            Self::Bpe(t) => t.stop_tokens(),
        }
    }

    /// Encodes `text`, optionally framed by BOS and EOS (each family's own rules; see their
    /// modules).
    pub fn encode(&self, text: &str, bos: bool, eos: bool) -> Vec<u32> {
        match self {
            Self::Llama2c(t) => t.encode(text, bos, eos),
            Self::Bpe(t) => t.encode(text, bos, eos),
        }
    }

    /// Encodes a plain document: [`adds_bos`](Self::adds_bos) decides about BOS, and there is no EOS.
    pub fn encode_document(&self, text: &str) -> Vec<u32> {
        self.encode(text, self.adds_bos(), false)
    }

    /// Decodes `tokens` to bytes; `prev` is the token before `tokens[0]` (llama2.c drops the
    /// leading space of a token after BOS; byte-level BPE ignores it).
    pub fn decode(&self, prev: u32, tokens: &[u32]) -> Result<Vec<u8>, InferError> {
        match self {
            Self::Llama2c(t) => t.decode(prev, tokens),
            Self::Bpe(t) => t.decode(tokens),
        }
    }

    /// The chat template, when the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        match self {
            Self::Llama2c(_) => None,
            Self::Bpe(t) => t.chat_template(),
        }
    }

    /// The tokens of a one-turn chat prompt for `user` (with the template's default system
    /// message), ending where the assistant's answer begins; `None` without a chat template.
    pub fn chat_prompt(&self, user: &str) -> Option<Vec<u32>> {
        let text = self.chat_template()?.render(None, user);
        Some(self.encode(&text, false, false))
    }
}
