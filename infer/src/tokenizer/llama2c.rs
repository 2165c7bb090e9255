//! [`Llama2cTokenizer`]: llama2.c's sentencepiece-style BPE (merges chosen by score), read from a
//! `tokenizer.bin` such as stories260K's `tok512.bin`.
//!
//! File layout (little-endian; the vocabulary size is not stored, it comes from the model):
//!
//! ```text
//!  +----------------------+---------------------------------------------------------------+
//!  | max_token_length i32 | vocab_size × ( score f32 | len i32 | len bytes of the piece )  |
//!  +----------------------+---------------------------------------------------------------+
//! ```
//!
//! Invariants checked on load: the file ends exactly after `vocab_size` entries, every length is in
//! `0..=max_token_length`, every score is finite, and ids 3..=258 are the byte pieces `<0x00>`..
//! `<0xFF>` that byte fallback relies on. Ids 0, 1, 2 are `<unk>`, BOS and EOS.
//!
//! Encoding follows llama2.c `run.c`: optional BOS, the dummy-prefix piece `" "` when the text is not
//! empty, one piece per UTF-8 code point (falling back to byte pieces `byte + 3` for code points not
//! in the vocabulary), then repeatedly merge the adjacent pair whose concatenation is in the
//! vocabulary with the highest score (the leftmost on ties), optional EOS. BOS never takes part in a
//! merge (run.c tries it too, but no piece of a llama2.c vocabulary starts with BOS's).
//!
//! Decoding a token after BOS drops one leading space; a `<0xXX>` piece decodes to that raw byte, so
//! decoded text is bytes (a code point may span several byte tokens). Unlike run.c's `safe_printf`,
//! decoding keeps control bytes: it returns what the model produced, and printing is the caller's
//! business.

use std::collections::HashMap;
use std::path::Path;

use crate::cursor::Cursor;
use crate::error::InferError;

/// The unknown-token id.
pub const UNK: u32 = 0;
/// The beginning-of-sequence id. Generation from BOS stops when the model emits it again (run.c).
pub const BOS: u32 = 1;
/// The end-of-sequence id.
pub const EOS: u32 = 2;
/// Byte `b` falls back to token `b + BYTE_OFFSET`.
pub const BYTE_OFFSET: u32 = 3;

/// A llama2.c BPE vocabulary with scores.
#[derive(Clone, Debug)]
pub struct Llama2cTokenizer {
    /// Piece bytes by id.
    pieces: Vec<Vec<u8>>,
    /// Merge priority by id (higher merges first).
    scores: Vec<f32>,
    /// Piece bytes to id; for duplicate pieces, the lowest id.
    ids: HashMap<Vec<u8>, u32>,
    /// Longest piece, in bytes, as the file declares.
    max_token_length: usize,
}

impl Llama2cTokenizer {
    /// Reads the tokenizer at `path` for a model with `vocab_size` tokens.
    pub fn load(path: &Path, vocab_size: usize) -> Result<Self, InferError> {
        let bytes = std::fs::read(path).map_err(|source| InferError::Io { path: path.to_owned(), source })?;
        Self::parse(&bytes, vocab_size, path)
    }

    /// Parses a tokenizer already in memory; `path` only names it in errors.
    pub fn parse(bytes: &[u8], vocab_size: usize, path: &Path) -> Result<Self, InferError> {
        let fail = |reason: String| InferError::Tokenizer { path: path.to_owned(), reason };
        let truncated = |what: String| {
            fail(format!(
                "it ends at byte {} in the middle of {what}; the file is truncated or the model's \
                 vocab_size ({vocab_size}) is larger than the tokenizer's",
                bytes.len()
            ))
        };
        let mut r = Cursor::at(bytes, 0);
        let max_len = r.i32().ok_or_else(|| truncated("the max_token_length header".to_owned()))?;
        let max_token_length = usize::try_from(max_len)
            .ok()
            .filter(|&m| m > 0)
            .ok_or_else(|| fail(format!("its header says max_token_length = {max_len}, which must be positive")))?;
        if vocab_size < (BYTE_OFFSET + 256) as usize {
            return Err(fail(format!(
                "the model has {vocab_size} tokens, but a llama2.c vocabulary needs at least 259 \
                 (<unk>, BOS, EOS and 256 byte pieces)"
            )));
        }
        let mut pieces = Vec::with_capacity(vocab_size);
        let mut scores = Vec::with_capacity(vocab_size);
        for id in 0..vocab_size {
            let score = r.f32().ok_or_else(|| truncated(format!("the score of token {id}")))?;
            let len = r.i32().ok_or_else(|| truncated(format!("the length of token {id}")))?;
            if !score.is_finite() {
                return Err(fail(format!("token {id} has the non-finite score {score}")));
            }
            let len = usize::try_from(len).ok().filter(|&l| l <= max_token_length).ok_or_else(|| {
                fail(format!("token {id} has length {len}, outside 0..={max_token_length} (max_token_length)"))
            })?;
            let piece = r.take(len).ok_or_else(|| truncated(format!("token {id}'s {len} bytes")))?;
            pieces.push(piece.to_vec());
            scores.push(score);
        }
        if r.remaining() != 0 {
            return Err(fail(format!(
                "{} bytes follow the {vocab_size} tokens the model expects; the tokenizer belongs to a \
                 model with a larger vocabulary, or the file is padded",
                r.remaining()
            )));
        }
        for b in 0..=255u8 {
            let id = (u32::from(b) + BYTE_OFFSET) as usize;
            if pieces[id] != format!("<0x{b:02X}>").as_bytes() {
                return Err(fail(format!(
                    "token {id} is {:?}, but byte fallback needs ids 3..=258 to be <0x00>..<0xFF>",
                    String::from_utf8_lossy(&pieces[id])
                )));
            }
        }
        let mut ids = HashMap::with_capacity(vocab_size);
        for (id, piece) in pieces.iter().enumerate() {
            ids.entry(piece.clone()).or_insert(id as u32);
        }
        Ok(Self { pieces, scores, ids, max_token_length })
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// The longest piece, in bytes, as the file declares.
    pub fn max_token_length(&self) -> usize {
        self.max_token_length
    }

    /// The raw piece of `id` (byte tokens are the literal `<0xXX>`), if `id` is in the vocabulary.
    pub fn piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// The id of a piece, if the vocabulary has it.
    pub fn id(&self, piece: &[u8]) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// Encodes `text`, optionally framed by BOS and EOS (see the module documentation).
    pub fn encode(&self, text: &str, bos: bool, eos: bool) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(text.len() + 3);
        if bos {
            tokens.push(BOS);
        }
        if !text.is_empty() {
            self.push_piece(b" ", &mut tokens);
        }
        let mut utf8 = [0u8; 4];
        for ch in text.chars() {
            self.push_piece(ch.encode_utf8(&mut utf8).as_bytes(), &mut tokens);
        }
        let start = usize::from(bos);
        let mut merged = Vec::with_capacity(2 * self.max_token_length);
        loop {
            let mut best: Option<(f32, usize, u32)> = None;
            for i in start..tokens.len().saturating_sub(1) {
                merged.clear();
                merged.extend_from_slice(&self.pieces[tokens[i] as usize]);
                merged.extend_from_slice(&self.pieces[tokens[i + 1] as usize]);
                if let Some(id) = self.id(&merged) {
                    let score = self.scores[id as usize];
                    if best.is_none_or(|(s, _, _)| score > s) {
                        best = Some((score, i, id));
                    }
                }
            }
            let Some((_, i, id)) = best else { break };
            tokens[i] = id;
            tokens.remove(i + 1);
        }
        if eos {
            tokens.push(EOS);
        }
        tokens
    }

    /// Pushes the id of `piece`, or its bytes as byte tokens when the vocabulary lacks it.
    fn push_piece(&self, piece: &[u8], tokens: &mut Vec<u32>) {
        match self.id(piece) {
            Some(id) => tokens.push(id),
            None => tokens.extend(piece.iter().map(|&b| u32::from(b) + BYTE_OFFSET)),
        }
    }

    /// The bytes `token` prints as when it follows `prev`: after BOS one leading space is dropped,
    /// and a byte piece `<0xXX>` is that raw byte.
    pub fn decode_piece(&self, prev: u32, token: u32) -> Result<&[u8], InferError> {
        let mut piece = self.piece(token).ok_or_else(|| {
            InferError::InvalidArgument(format!(
                "token id {token} is not in the vocabulary of {} tokens",
                self.vocab_size()
            ))
        })?;
        if prev == BOS && piece.first() == Some(&b' ') {
            piece = &piece[1..];
        }
        if (BYTE_OFFSET..BYTE_OFFSET + 256).contains(&token) {
            // Ids 3..=258 were checked on load to be exactly the byte pieces, so the piece's single
            // byte is a slice of the static table.
            let b = (token - BYTE_OFFSET) as usize;
            return Ok(&ALL_BYTES[b..b + 1]);
        }
        Ok(piece)
    }

    /// Decodes `tokens`, where `prev` is the token before `tokens[0]` (BOS when decoding what was
    /// generated from BOS). Returns bytes: byte tokens may split a UTF-8 code point.
    pub fn decode(&self, prev: u32, tokens: &[u32]) -> Result<Vec<u8>, InferError> {
        let mut out = Vec::with_capacity(tokens.len() * 4);
        let mut prev = prev;
        for &token in tokens {
            out.extend_from_slice(self.decode_piece(prev, token)?);
            prev = token;
        }
        Ok(out)
    }
}

/// Every byte value, so a byte token can decode to a slice without allocating.
static ALL_BYTES: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = i as u8;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of the 259 required pieces plus `extra` (piece, score) entries.
    fn build(extra: &[(&str, f32)]) -> Llama2cTokenizer {
        let mut entries: Vec<(Vec<u8>, f32)> =
            vec![(b"<unk>".to_vec(), 0.0), (b"\n<s>\n".to_vec(), 0.0), (b"\n</s>\n".to_vec(), 0.0)];
        entries.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>").into_bytes(), 0.0)));
        entries.extend(extra.iter().map(|(p, s)| (p.as_bytes().to_vec(), *s)));
        let mut bytes = 7i32.to_le_bytes().to_vec();
        for (piece, score) in &entries {
            bytes.extend(score.to_le_bytes());
            bytes.extend((piece.len() as i32).to_le_bytes());
            bytes.extend(piece);
        }
        Llama2cTokenizer::parse(&bytes, entries.len(), Path::new("tok.bin")).unwrap()
    }

    #[test]
    fn merges_follow_scores_not_position() {
        // "abc": "bc" outranks "ab", so the result is a + bc, then (a,bc) is not a piece.
        let t = build(&[(" ", -10.0), ("a", -1.0), ("b", -1.0), ("c", -1.0), ("ab", -3.0), ("bc", -2.0)]);
        let ids = t.encode("abc", false, false);
        let pieces: Vec<&[u8]> = ids.iter().map(|&i| t.piece(i).unwrap()).collect();
        assert_eq!(pieces, [b" ".as_slice(), b"a", b"bc"]);
    }

    #[test]
    fn missing_code_points_fall_back_to_byte_tokens() {
        let t = build(&[(" ", -1.0)]);
        // 'é' is C3 A9 in UTF-8 and not in the vocabulary.
        assert_eq!(t.encode("é", true, true), vec![BOS, 259, 0xC3 + 3, 0xA9 + 3, EOS]);
        // After BOS the dummy-prefix space is dropped; the two byte tokens rejoin into one code point.
        assert_eq!(t.decode(BOS, &[259, 0xC3 + 3, 0xA9 + 3]).unwrap(), "é".as_bytes());
        assert_eq!(t.decode(EOS, &[259, 0xC3 + 3, 0xA9 + 3]).unwrap(), " é".as_bytes());
    }

    #[test]
    fn empty_text_gets_no_dummy_prefix() {
        let t = build(&[(" ", -1.0)]);
        assert_eq!(t.encode("", true, false), vec![BOS]);
        assert!(t.encode("", false, false).is_empty());
    }

    #[test]
    fn decoding_after_bos_drops_one_leading_space_only_there() {
        let t = build(&[(" ", -1.0), (" hi", -1.0)]);
        let hi = t.id(b" hi").unwrap();
        assert_eq!(t.decode_piece(BOS, hi).unwrap(), b"hi");
        assert_eq!(t.decode_piece(hi, hi).unwrap(), b" hi");
    }

    #[test]
    fn a_byte_table_out_of_place_is_rejected() {
        let mut bytes = 7i32.to_le_bytes().to_vec();
        for id in 0..259 {
            let piece = format!("t{id}").into_bytes();
            bytes.extend(0f32.to_le_bytes());
            bytes.extend((piece.len() as i32).to_le_bytes());
            bytes.extend(piece);
        }
        let msg = Llama2cTokenizer::parse(&bytes, 259, Path::new("tok.bin")).unwrap_err().to_string();
        assert!(msg.contains("token 3 is \"t3\", but byte fallback needs"), "{msg}");
    }

    #[test]
    fn a_vocab_size_larger_than_the_file_is_reported_as_truncation() {
        let mut bytes = 7i32.to_le_bytes().to_vec();
        bytes.extend(0f32.to_le_bytes());
        let msg = Llama2cTokenizer::parse(&bytes, 300, Path::new("tok.bin")).unwrap_err().to_string();
        assert!(msg.starts_with("tok.bin is not a usable llama2.c tokenizer"), "{msg}");
        assert!(msg.contains("the length of token 0"), "{msg}");
    }

    #[test]
    fn unknown_ids_do_not_decode() {
        let t = build(&[]);
        assert!(t.decode(BOS, &[9999]).unwrap_err().to_string().contains("9999"));
    }
}
