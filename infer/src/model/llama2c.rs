//! Loader for Karpathy's llama2.c checkpoints (the legacy, version-0 layout that `run.c` reads).
//!
//! All integers and floats are little-endian. `L` = layers, `V` = vocab size, `S` = seq_len,
//! `H` = n_heads, `Hkv` = n_kv_heads, `D` = head_dim = dim / H, `F` = hidden_dim.
//!
//! ```text
//!  offset 0   header: 7 × i32
//!  +-----+------------+----------+----+---------+------------+---------+
//!  | dim | hidden_dim | n_layers | H  | Hkv     | vocab_size | seq_len |   vocab_size < 0: the
//!  +-----+------------+----------+----+---------+------------+---------+   classifier is separate
//!  offset 28  f32 arrays, row-major, rows are outputs (W[out][in]):
//!    tok_emb  [V][dim]          rms_att [L][dim]
//!    wq       [L][H·D][dim]     wk      [L][Hkv·D][dim]    wv [L][Hkv·D][dim]
//!    wo       [L][dim][H·D]     rms_ffn [L][dim]
//!    w1       [L][F][dim]       w2      [L][dim][F]        w3 [L][F][dim]
//!    rms_final[dim]
//!    freq_cis_real[S][D/2]      freq_cis_imag[S][D/2]      (legacy RoPE tables; skipped)
//!    wcls     [V][dim]          (only when vocab_size < 0)
//!  end of file: exactly here
//! ```
//!
//! The file size must equal what the header implies, to the byte; every weight must be finite.
//! llama2.c fixes RoPE theta at 10000 and the RMSNorm epsilon at 1e-5. The newer versioned
//! exports (magic `ak42`) are a different layout and are refused with a sentence saying so.

use std::path::Path;

use super::{Classifier, LayerWeights, Model, Weights};
use crate::config::ModelConfig;
use crate::cursor::{Cursor, first_non_finite};
use crate::error::InferError;
use crate::matmul::Matrix;

/// Bytes in the header (7 × i32).
pub const HEADER_BYTES: usize = 28;

/// RoPE base used by llama2.c (`run.c` hard-codes it).
pub const ROPE_THETA: f32 = 10000.0;

/// RMSNorm epsilon used by llama2.c (`run.c` hard-codes it).
pub const NORM_EPS: f32 = 1e-5;

/// The first u32 of llama2.c's versioned exports (`export.py --version 1/2`).
const VERSIONED_MAGIC: u32 = 0x616b_3432;

/// Reads and validates the checkpoint at `path`.
pub fn load(path: &Path) -> Result<Model, InferError> {
    let bytes = std::fs::read(path).map_err(|source| InferError::Io { path: path.to_owned(), source })?;
    parse(&bytes, path)
}

/// Parses a checkpoint already in memory; `path` only names it in errors.
pub fn parse(bytes: &[u8], path: &Path) -> Result<Model, InferError> {
    let fail = |reason: String| InferError::Checkpoint { path: path.to_owned(), reason };
    if bytes.len() < HEADER_BYTES {
        return Err(fail(format!("it is {} bytes long, shorter than the {HEADER_BYTES}-byte header", bytes.len())));
    }
    let mut header_cursor = Cursor::at(bytes, 0);
    let header: Vec<i32> = (0..7).map(|_| header_cursor.i32().expect("the header length was checked above")).collect();
    if header[0] as u32 == VERSIONED_MAGIC {
        return Err(fail(format!(
            "it starts with the magic of a versioned llama2.c export (version {}); only the legacy \
             layout with the 7-integer header that run.c reads is supported (export with --version 0)",
            header[1]
        )));
    }
    let names = ["dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"];
    let shared_classifier = header[5] > 0;
    let mut sizes = [0usize; 7];
    for (i, (&value, name)) in header.iter().zip(names).enumerate() {
        let magnitude = if i == 5 { value.unsigned_abs() } else { value.max(0).unsigned_abs() };
        if magnitude == 0 {
            return Err(fail(format!("its header says {name} = {value}, which must be positive")));
        }
        sizes[i] = magnitude as usize;
    }
    let [dim, hidden_dim, layers, heads, kv_heads, vocab_size, seq_len] = sizes;
    if !dim.is_multiple_of(heads) {
        return Err(fail(format!(
            "its header says dim = {dim} and n_heads = {heads}; dim must be a multiple of n_heads"
        )));
    }
    let config = ModelConfig {
        dim,
        hidden_dim,
        layers,
        heads,
        kv_heads,
        head_dim: dim / heads,
        vocab_size,
        seq_len,
        rope_theta: ROPE_THETA,
        norm_eps: NORM_EPS,
    };
    config.validate().map_err(|e| match e {
        InferError::Config { reason } => fail(format!("its header describes an unsupported model: {reason}")),
        other => other,
    })?;

    let floats = float_count(&config, shared_classifier);
    let expected = HEADER_BYTES as u64 + 4 * floats;
    if bytes.len() as u64 != expected {
        return Err(fail(format!(
            "it is {} bytes long, but its header ({}) implies {expected} bytes ({HEADER_BYTES}-byte header + \
             {floats} f32 values{}); the file is truncated, padded or not a legacy llama2.c checkpoint",
            bytes.len(),
            names.iter().zip(&header).map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>().join(" "),
            if shared_classifier { ", classifier shared with the embedding" } else { ", separate classifier" },
        )));
    }

    let mut r = Reader { cursor: Cursor::at(bytes, HEADER_BYTES), path };
    let c = &config;
    let token_embedding = Matrix::new("tok_emb", c.vocab_size, c.dim, r.floats("tok_emb", c.vocab_size * c.dim)?)?;
    let mut rms_att = r.per_layer("rms_att", c.layers, c.dim)?;
    let mut wq = r.per_layer("wq", c.layers, c.q_dim() * c.dim)?;
    let mut wk = r.per_layer("wk", c.layers, c.kv_dim() * c.dim)?;
    let mut wv = r.per_layer("wv", c.layers, c.kv_dim() * c.dim)?;
    let mut wo = r.per_layer("wo", c.layers, c.dim * c.q_dim())?;
    let mut rms_ffn = r.per_layer("rms_ffn", c.layers, c.dim)?;
    let mut w1 = r.per_layer("w1", c.layers, c.hidden_dim * c.dim)?;
    let mut w2 = r.per_layer("w2", c.layers, c.dim * c.hidden_dim)?;
    let mut w3 = r.per_layer("w3", c.layers, c.hidden_dim * c.dim)?;
    let final_norm = r.floats("rms_final", c.dim)?;
    r.skip(2 * c.seq_len * (c.head_dim / 2));
    let classifier = if shared_classifier {
        Classifier::TiedToEmbedding
    } else {
        Classifier::Separate(Matrix::new("wcls", c.vocab_size, c.dim, r.floats("wcls", c.vocab_size * c.dim)?)?)
    };
    debug_assert_eq!(r.cursor.remaining(), 0, "the size check above covers every array read");

    let mut layer_weights = Vec::with_capacity(c.layers);
    for i in 0..c.layers {
        let m = |what: &str, rows, cols, data: &mut Vec<Vec<f32>>| {
            Matrix::new(&format!("layer {i} {what}"), rows, cols, std::mem::take(&mut data[i]))
        };
        layer_weights.push(LayerWeights {
            attn_norm: std::mem::take(&mut rms_att[i]),
            wq: m("wq", c.q_dim(), c.dim, &mut wq)?,
            wk: m("wk", c.kv_dim(), c.dim, &mut wk)?,
            wv: m("wv", c.kv_dim(), c.dim, &mut wv)?,
            wo: m("wo", c.dim, c.q_dim(), &mut wo)?,
            ffn_norm: std::mem::take(&mut rms_ffn[i]),
            w1: m("w1", c.hidden_dim, c.dim, &mut w1)?,
            w2: m("w2", c.dim, c.hidden_dim, &mut w2)?,
            w3: m("w3", c.hidden_dim, c.dim, &mut w3)?,
        });
    }
    Model::new(config, Weights { token_embedding, layers: layer_weights, final_norm, classifier })
}

/// The number of f32 values after the header. Cannot overflow: [`ModelConfig::validate`] bounds
/// every size so each product stays below 2^60.
fn float_count(c: &ModelConfig, shared_classifier: bool) -> u64 {
    let [dim, hidden, layers, q, kv, vocab, seq, head] =
        [c.dim, c.hidden_dim, c.layers, c.q_dim(), c.kv_dim(), c.vocab_size, c.seq_len, c.head_dim].map(|v| v as u64);
    let per_layer = dim + q * dim + 2 * kv * dim + dim * q + dim + 3 * hidden * dim;
    let classifier = if shared_classifier { 0 } else { vocab * dim };
    vocab * dim + layers * per_layer + dim + seq * head + classifier
}

/// Sequential tensor reads; the caller has checked the total length.
struct Reader<'a> {
    cursor: Cursor<'a>,
    path: &'a Path,
}

impl Reader<'_> {
    fn floats(&mut self, what: &str, n: usize) -> Result<Vec<f32>, InferError> {
        let start = self.cursor.offset();
        let values = self.cursor.f32s(n).expect("the file size was checked against the header");
        if let Some((i, value)) = first_non_finite(&values) {
            return Err(InferError::Checkpoint {
                path: self.path.to_owned(),
                reason: format!(
                    "{what} holds the non-finite value {value} at element {i} (file offset {}); the weights \
                     are corrupt",
                    start + 4 * i
                ),
            });
        }
        Ok(values)
    }

    fn per_layer(&mut self, what: &str, layers: usize, each: usize) -> Result<Vec<Vec<f32>>, InferError> {
        (0..layers).map(|i| self.floats(&format!("layer {i} {what}"), each)).collect()
    }

    fn skip(&mut self, floats: usize) {
        self.cursor.take(4 * floats).expect("the file size was checked against the header");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny, valid checkpoint: dim 4, hidden 6, 2 layers, 2 heads, 1 KV head, vocab 5, seq 3.
    fn tiny(vocab_field: i32) -> Vec<u8> {
        let header = [4, 6, 2, 2, 1, vocab_field, 3];
        let c = ModelConfig {
            dim: 4,
            hidden_dim: 6,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 2,
            vocab_size: 5,
            seq_len: 3,
            rope_theta: ROPE_THETA,
            norm_eps: NORM_EPS,
        };
        let n = float_count(&c, vocab_field > 0) as usize;
        let mut bytes: Vec<u8> = header.iter().flat_map(|v: &i32| v.to_le_bytes()).collect();
        bytes.extend((0..n).flat_map(|i| (i as f32 * 0.01).to_le_bytes()));
        bytes
    }

    fn error(bytes: &[u8]) -> String {
        parse(bytes, Path::new("m.bin")).unwrap_err().to_string()
    }

    #[test]
    fn tiny_checkpoint_loads_with_tied_classifier() {
        let m = parse(&tiny(5), Path::new("m.bin")).unwrap();
        assert_eq!(m.config().head_dim, 2);
        assert_eq!(m.weights().classifier, Classifier::TiedToEmbedding);
        let mut row = [0.0; 4];
        m.weights().token_embedding.dequantize_row(0, &mut row);
        assert_eq!(row, [0.0, 0.01, 0.02, 0.03]);
    }

    #[test]
    fn negative_vocab_size_means_a_separate_classifier_at_the_end() {
        let bytes = tiny(-5);
        let m = parse(&bytes, Path::new("m.bin")).unwrap();
        let Classifier::Separate(wcls) = &m.weights().classifier else { panic!("expected a separate classifier") };
        let last = f32::from_le_bytes(bytes[bytes.len() - 4..].try_into().unwrap());
        let mut row = [0.0; 4];
        wcls.dequantize_row(4, &mut row);
        assert_eq!(row[3], last);
    }

    #[test]
    fn a_truncated_file_names_both_sizes() {
        let bytes = tiny(5);
        let msg = error(&bytes[..bytes.len() - 4]);
        assert!(msg.starts_with("m.bin is not a usable llama2.c checkpoint"), "{msg}");
        assert!(msg.contains(&format!("it is {} bytes long", bytes.len() - 4)), "{msg}");
        assert!(msg.contains(&format!("implies {} bytes", bytes.len())), "{msg}");
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut bytes = tiny(5);
        bytes.extend([0; 4]);
        assert!(error(&bytes).contains("truncated, padded"));
    }

    #[test]
    fn a_short_header_is_rejected() {
        assert!(error(&[0; 10]).contains("shorter than the 28-byte header"));
    }

    #[test]
    fn zero_or_negative_sizes_are_rejected() {
        let mut bytes = tiny(5);
        bytes[12..16].copy_from_slice(&(-2i32).to_le_bytes());
        assert!(error(&bytes).contains("n_heads = -2, which must be positive"));
    }

    #[test]
    fn dim_not_divisible_by_heads_is_rejected() {
        let mut bytes = tiny(5);
        bytes[12..16].copy_from_slice(&3i32.to_le_bytes());
        assert!(error(&bytes).contains("dim must be a multiple of n_heads"));
    }

    #[test]
    fn versioned_exports_are_refused_by_name() {
        let mut bytes = tiny(5);
        bytes[0..4].copy_from_slice(&VERSIONED_MAGIC.to_le_bytes());
        bytes[4..8].copy_from_slice(&2i32.to_le_bytes());
        assert!(error(&bytes).contains("versioned llama2.c export (version 2)"));
    }

    #[test]
    fn a_nan_weight_is_reported_with_its_tensor_and_offset() {
        let mut bytes = tiny(5);
        // tok_emb is 5 × 4 floats, rms_att layer 0 follows: its element 1.
        let at = HEADER_BYTES + 4 * (20 + 1);
        bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let msg = error(&bytes);
        assert!(
            msg.contains(&format!("layer 0 rms_att holds the non-finite value NaN at element 1 (file offset {at})")),
            "{msg}"
        );
    }
}
