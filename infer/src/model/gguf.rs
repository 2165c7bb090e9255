//! Loader for llama-architecture GGUF models (SmolLM2 and its kin), weights and tokenizer together.
//!
//! The container is read and validated by [`crate::gguf`]; this module gives the metadata and
//! tensors their llama meaning (`{a}` = `general.architecture`, which must be `llama`):
//!
//! ```text
//!  ModelConfig field  metadata key                              if absent
//!  dim                {a}.embedding_length                      required
//!  hidden_dim         {a}.feed_forward_length                   required
//!  layers             {a}.block_count                           required
//!  heads              {a}.attention.head_count                  required
//!  kv_heads           {a}.attention.head_count_kv               = heads
//!  head_dim           {a}.attention.key_length                  = dim / heads
//!  vocab_size         token_embd.weight's second dimension      (must equal {a}.vocab_size and the
//!                                                                tokenizer's token count)
//!  seq_len            {a}.context_length                        required
//!  rope_theta         {a}.rope.freq_base                        10000
//!  norm_eps           {a}.attention.layer_norm_rms_epsilon      required
//!
//!  tensor (ggml shape [ne0 = in, ne1 = out])   weight
//!  token_embd.weight       [dim, vocab]        token_embedding (and the classifier when tied)
//!  output.weight           [dim, vocab]        Classifier::Separate; absent: TiedToEmbedding
//!  output_norm.weight      [dim]               final_norm
//!  blk.{i}.attn_norm.weight  [dim]             attn_norm      blk.{i}.ffn_norm.weight [dim]   ffn_norm
//!  blk.{i}.attn_q.weight   [dim, heads·D]      wq             blk.{i}.ffn_gate.weight [dim, F] w1
//!  blk.{i}.attn_k.weight   [dim, kv_heads·D]   wk             blk.{i}.ffn_down.weight [F, dim] w2
//!  blk.{i}.attn_v.weight   [dim, kv_heads·D]   wv             blk.{i}.ffn_up.weight   [dim, F] w3
//!  blk.{i}.attn_output.weight [heads·D, dim]   wo
//! ```
//!
//! Matrices may be `F32`, `F16` (widened to `f32`), `Q4_1` or `Q8_0` (kept quantized, see
//! [`crate::quant`]); norms `F32` or `F16`. llama.cpp's converter permutes the rows of `attn_q` and
//! `attn_k` so that RoPE rotates adjacent pairs — the convention of [`crate::rope`] — so the weights
//! are used as stored. Refused with a sentence: another architecture, RoPE scaling, partial RoPE
//! (`{a}.rope.dimension_count` ≠ `head_dim`), keys and values of different widths, other tensor
//! types, and any shape that disagrees with the metadata.

use std::path::Path;

use super::{Classifier, LayerWeights, Model, Weights};
use crate::config::ModelConfig;
use crate::cursor::first_non_finite;
use crate::error::InferError;
use crate::gguf::{GgmlType, Gguf, TensorInfo};
use crate::matmul::Matrix;
use crate::quant::{BlockQ4_1, BlockQ8_0, f16_to_f32};
use crate::tokenizer::BpeTokenizer;

/// RoPE base when the file does not say (llama.cpp's default).
pub const DEFAULT_ROPE_THETA: f32 = 10000.0;

/// Reads the GGUF model at `path`: its weights, and the tokenizer its metadata describes.
pub fn load(path: &Path) -> Result<(Model, BpeTokenizer), InferError> {
    let file = Gguf::read(path)?;
    let model = model_from_gguf(&file)?;
    let tokenizer = BpeTokenizer::from_gguf(&file)?;
    if tokenizer.vocab_size() != model.config().vocab_size {
        return Err(file.error(format!(
            "its tokenizer has {} tokens, but its embedding has {} rows",
            tokenizer.vocab_size(),
            model.config().vocab_size
        )));
    }
    Ok((model, tokenizer))
}

/// The configuration a GGUF file describes (see the table in the module documentation).
pub fn config_from_gguf(g: &Gguf) -> Result<ModelConfig, InferError> {
    let arch = g.require_str("general.architecture")?;
    if arch != "llama" {
        return Err(g.error(format!(
            "its general.architecture is {arch:?}, but this engine runs only the \"llama\" architecture"
        )));
    }
    let size = |key: &str| -> Result<usize, InferError> {
        let v = g.require_u64(&format!("{arch}.{key}"))?;
        usize::try_from(v).map_err(|_| g.error(format!("its {arch}.{key} is {v}, which does not fit in memory")))
    };
    let optional = |key: &str| g.get(&format!("{arch}.{key}")).is_some();
    let dim = size("embedding_length")?;
    let heads = size("attention.head_count")?;
    let kv_heads = if optional("attention.head_count_kv") { size("attention.head_count_kv")? } else { heads };
    let head_dim = if optional("attention.key_length") {
        size("attention.key_length")?
    } else {
        if heads == 0 || !dim.is_multiple_of(heads) {
            return Err(g.error(format!(
                "its {arch}.embedding_length ({dim}) is not a multiple of {arch}.attention.head_count ({heads}), \
                 and it has no {arch}.attention.key_length"
            )));
        }
        dim / heads
    };
    if optional("attention.value_length") && size("attention.value_length")? != head_dim {
        return Err(g.error(format!(
            "its {arch}.attention.value_length differs from the key length {head_dim}; this engine needs keys \
             and values of one width"
        )));
    }
    if optional("rope.dimension_count") && size("rope.dimension_count")? != head_dim {
        return Err(g.error(format!(
            "its {arch}.rope.dimension_count is {}, but RoPE over part of a head (head_dim {head_dim}) is not \
             supported",
            size("rope.dimension_count")?
        )));
    }
    if let Some(kind) = g.get(&format!("{arch}.rope.scaling.type")).and_then(|v| v.as_str())
        && kind != "none"
    {
        return Err(g.error(format!("its {arch}.rope.scaling.type is {kind:?}; RoPE scaling is not supported")));
    }
    let embedding = g.tensor("token_embd.weight").ok_or_else(|| g.error("it has no token_embd.weight".into()))?;
    let vocab_size = match embedding.dims.as_slice() {
        &[d, v] if d as usize == dim => v as usize,
        _ => {
            return Err(g.error(format!(
                "its token_embd.weight has shape {}, but [{dim}, vocab] is needed",
                embedding.shape()
            )));
        }
    };
    if optional("vocab_size") && size("vocab_size")? != vocab_size {
        return Err(g.error(format!(
            "its {arch}.vocab_size is {}, but token_embd.weight has {vocab_size} rows",
            size("vocab_size")?
        )));
    }
    let rope_key = format!("{arch}.rope.freq_base");
    let config = ModelConfig {
        dim,
        hidden_dim: size("feed_forward_length")?,
        layers: size("block_count")?,
        heads,
        kv_heads,
        head_dim,
        vocab_size,
        seq_len: size("context_length")?,
        rope_theta: if g.get(&rope_key).is_some() { g.require_f32(&rope_key)? } else { DEFAULT_ROPE_THETA },
        norm_eps: g.require_f32(&format!("{arch}.attention.layer_norm_rms_epsilon"))?,
    };
    config.validate().map_err(|e| match e {
        InferError::Config { reason } => g.error(format!("its metadata describes an unsupported model: {reason}")),
        other => other,
    })?;
    Ok(config)
}

/// The model a GGUF file holds.
pub fn model_from_gguf(g: &Gguf) -> Result<Model, InferError> {
    let c = config_from_gguf(g)?;
    let token_embedding = matrix(g, "token_embd.weight", c.vocab_size, c.dim)?;
    let classifier = match g.tensor("output.weight") {
        Some(_) => Classifier::Separate(matrix(g, "output.weight", c.vocab_size, c.dim)?),
        None => Classifier::TiedToEmbedding,
    };
    let mut layers = Vec::with_capacity(c.layers);
    for i in 0..c.layers {
        let name = |what: &str| format!("blk.{i}.{what}.weight");
        layers.push(LayerWeights {
            attn_norm: vector(g, &name("attn_norm"), c.dim)?,
            wq: matrix(g, &name("attn_q"), c.q_dim(), c.dim)?,
            wk: matrix(g, &name("attn_k"), c.kv_dim(), c.dim)?,
            wv: matrix(g, &name("attn_v"), c.kv_dim(), c.dim)?,
            wo: matrix(g, &name("attn_output"), c.dim, c.q_dim())?,
            ffn_norm: vector(g, &name("ffn_norm"), c.dim)?,
            w1: matrix(g, &name("ffn_gate"), c.hidden_dim, c.dim)?,
            w2: matrix(g, &name("ffn_down"), c.dim, c.hidden_dim)?,
            w3: matrix(g, &name("ffn_up"), c.hidden_dim, c.dim)?,
        });
    }
    let final_norm = vector(g, "output_norm.weight", c.dim)?;
    Model::new(c, Weights { token_embedding, layers, final_norm, classifier }).map_err(|e| on_file(g, e))
}

/// Shape errors found while loading are errors of the file.
fn on_file(g: &Gguf, e: InferError) -> InferError {
    match e {
        InferError::WeightShape { reason } => g.error(reason),
        other => other,
    }
}

fn tensor<'a>(g: &'a Gguf, name: &str, dims: &[u64]) -> Result<&'a TensorInfo, InferError> {
    let t = g.tensor(name).ok_or_else(|| g.error(format!("it has no tensor {name}")))?;
    if t.dims != dims {
        return Err(g.error(format!("its tensor {name} has shape {}, but the metadata implies {dims:?}", t.shape())));
    }
    Ok(t)
}

/// The `W[rows][cols]` matrix stored as ggml shape `[cols, rows]`.
fn matrix(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<Matrix, InferError> {
    let t = tensor(g, name, &[cols as u64, rows as u64])?;
    let data = g.tensor_data(t);
    let m = match t.ggml_type {
        GgmlType::F32 | GgmlType::F16 => Matrix::new(name, rows, cols, floats(g, t)?),
        GgmlType::Q4_1 => Matrix::from_q4_1(
            name,
            rows,
            cols,
            data.as_chunks::<{ BlockQ4_1::GGUF_BYTES }>().0.iter().map(BlockQ4_1::from_gguf).collect(),
        ),
        GgmlType::Q8_0 => Matrix::from_q8_0(
            name,
            rows,
            cols,
            data.as_chunks::<{ BlockQ8_0::GGUF_BYTES }>().0.iter().map(BlockQ8_0::from_gguf).collect(),
        ),
        other => {
            return Err(
                g.error(format!("its tensor {name} is {other}, but this engine runs F32, F16, Q4_1 and Q8_0 weights"))
            );
        }
    };
    m.map_err(|e| on_file(g, e))
}

/// A norm gain vector of `len` floats.
fn vector(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>, InferError> {
    let t = tensor(g, name, &[len as u64])?;
    floats(g, t)
}

/// An `F32` or `F16` tensor's values, all finite.
fn floats(g: &Gguf, t: &TensorInfo) -> Result<Vec<f32>, InferError> {
    let data = g.tensor_data(t);
    let values: Vec<f32> = match t.ggml_type {
        GgmlType::F32 => data.as_chunks::<4>().0.iter().map(|b| f32::from_le_bytes(*b)).collect(),
        GgmlType::F16 => data.as_chunks::<2>().0.iter().map(|b| f16_to_f32(u16::from_le_bytes(*b))).collect(),
        other => {
            return Err(g.error(format!("its tensor {} is {other}, but it must be F32 or F16", t.name)));
        }
    };
    if let Some((i, v)) = first_non_finite(&values) {
        return Err(g.error(format!("its tensor {} holds the non-finite value {v} at element {i}", t.name)));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Value;
    use crate::gguf::builder::GgufBuilder;

    /// A tiny llama GGUF: dim 32, hidden 64, 1 layer, 2 heads of 16, 1 KV head, vocab 3, F32/Q8_0/Q4_1.
    fn tiny(extra: impl FnOnce(&mut GgufBuilder)) -> Vec<u8> {
        let mut b = GgufBuilder::new();
        b.kv("general.architecture", Value::String("llama".into()));
        for (k, v) in [
            ("llama.embedding_length", 32),
            ("llama.feed_forward_length", 64),
            ("llama.block_count", 1),
            ("llama.attention.head_count", 2),
            ("llama.attention.head_count_kv", 1),
            ("llama.context_length", 16),
        ] {
            b.kv(k, Value::U32(v));
        }
        b.kv("llama.rope.freq_base", Value::F32(100000.0));
        b.kv("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
        extra(&mut b);
        let f32s = |n: usize| (0..n).flat_map(|i| (i as f32 * 0.01).to_le_bytes()).collect::<Vec<u8>>();
        let q8 = |rows: usize, cols: usize| {
            let mut block = vec![0x00, 0x3c]; // d = 1.0
            block.extend((0..32).map(|j| j as u8));
            block.repeat(rows * cols / 32)
        };
        let q4 = |rows: usize, cols: usize| {
            let mut block = vec![0x00, 0x38, 0x00, 0xbc]; // d = 0.5, m = −1
            block.extend([0x21u8; 16]);
            block.repeat(rows * cols / 32)
        };
        b.tensor("token_embd.weight", &[32, 3], GgmlType::Q8_0, &q8(3, 32));
        b.tensor("blk.0.attn_norm.weight", &[32], GgmlType::F32, &f32s(32));
        b.tensor("blk.0.attn_q.weight", &[32, 32], GgmlType::Q4_1, &q4(32, 32));
        b.tensor("blk.0.attn_k.weight", &[32, 16], GgmlType::Q4_1, &q4(16, 32));
        b.tensor("blk.0.attn_v.weight", &[32, 16], GgmlType::Q4_1, &q4(16, 32));
        b.tensor("blk.0.attn_output.weight", &[32, 32], GgmlType::Q4_1, &q4(32, 32));
        b.tensor("blk.0.ffn_norm.weight", &[32], GgmlType::F32, &f32s(32));
        b.tensor("blk.0.ffn_gate.weight", &[32, 64], GgmlType::Q4_1, &q4(64, 32));
        b.tensor("blk.0.ffn_down.weight", &[64, 32], GgmlType::Q4_1, &q4(32, 64));
        b.tensor("blk.0.ffn_up.weight", &[32, 64], GgmlType::F32, &f32s(64 * 32));
        b.tensor("output_norm.weight", &[32], GgmlType::F16, &[0x00, 0x3c].repeat(32));
        b.build()
    }

    fn load_tiny(bytes: Vec<u8>) -> Result<Model, String> {
        let g = Gguf::parse(bytes, Path::new("tiny.gguf")).map_err(|e| e.to_string())?;
        model_from_gguf(&g).map_err(|e| e.to_string())
    }

    #[test]
    fn a_tiny_llama_loads_with_its_metadata_and_tied_classifier() {
        let m = load_tiny(tiny(|_| {})).unwrap();
        let c = m.config();
        assert_eq!((c.dim, c.hidden_dim, c.layers, c.heads, c.kv_heads, c.head_dim), (32, 64, 1, 2, 1, 16));
        assert_eq!((c.vocab_size, c.seq_len, c.rope_theta), (3, 16, 100000.0));
        assert_eq!(m.weights().classifier, Classifier::TiedToEmbedding);
        assert_eq!(m.weights().final_norm, vec![1.0; 32]);
        let mut row = vec![0.0; 32];
        m.weights().token_embedding.dequantize_row(2, &mut row);
        assert_eq!(row[5], 5.0);
        m.weights().layers[0].wq.dequantize_row(0, &mut row);
        // Code 1 (low nibble of 0x21) for weights 0..16, code 2 for 16..32: 0.5 · q − 1.
        assert_eq!((row[0], row[16]), (-0.5, 0.0));
        let mut cache = crate::LocalKvCache::new(c, 4).unwrap();
        let logits = crate::Forward::new(&m).step(&m, &mut cache, 1, 0).unwrap().to_vec();
        assert!(logits.iter().all(|l| l.is_finite()));
    }

    #[test]
    fn another_architecture_is_refused_by_name() {
        let bytes = tiny(|_| {});
        let mut b = GgufBuilder::new();
        b.kv("general.architecture", Value::String("qwen2".into()));
        let msg = load_tiny(b.build()).unwrap_err();
        assert!(msg.contains("general.architecture is \"qwen2\""), "{msg}");
        assert!(load_tiny(bytes).is_ok());
    }

    #[test]
    fn a_missing_key_and_a_missing_tensor_are_named() {
        let mut b = GgufBuilder::new();
        b.kv("general.architecture", Value::String("llama".into()));
        b.kv("llama.embedding_length", Value::U32(32));
        let msg = load_tiny(b.build()).unwrap_err();
        assert!(msg.contains("its metadata has no llama.attention.head_count"), "{msg}");
    }

    #[test]
    fn partial_rope_and_rope_scaling_are_refused() {
        let msg = load_tiny(tiny(|b| {
            b.kv("llama.rope.dimension_count", Value::U32(8));
        }))
        .unwrap_err();
        assert!(msg.contains("rope.dimension_count is 8"), "{msg}");
        let msg = load_tiny(tiny(|b| {
            b.kv("llama.rope.scaling.type", Value::String("linear".into()));
        }))
        .unwrap_err();
        assert!(msg.contains("RoPE scaling is not supported"), "{msg}");
    }

    #[test]
    fn a_vocab_size_that_disagrees_with_the_embedding_is_refused() {
        let msg = load_tiny(tiny(|b| {
            b.kv("llama.vocab_size", Value::U32(4));
        }))
        .unwrap_err();
        assert!(msg.contains("llama.vocab_size is 4, but token_embd.weight has 3 rows"), "{msg}");
    }
}
