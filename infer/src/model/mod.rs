//! [`Model`]: a [`ModelConfig`] and [`Weights`] whose shapes have been checked against it.
//!
//! A `Model` is what every loader produces and what the forward pass, generation and the KV dump
//! consume; none of them knows which file format the weights came from. [`Model::new`] is the one
//! place shapes are checked, so the forward pass can size its buffers from the configuration alone.
//!
//! Loaders: [`llama2c`] (Karpathy's llama2.c checkpoints, e.g. stories260K, all `f32`) and
//! [`gguf`] (llama-architecture GGUF files, e.g. SmolLM2, with quantized matrices). Both build the
//! same [`Weights`]; a [`Matrix`] knows its own storage format.

pub mod gguf;
pub mod llama2c;

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::InferError;
use crate::matmul::Matrix;
use crate::tokenizer::{Llama2cTokenizer, Tokenizer};

/// The weights of one transformer block. Matrices are `W[out][in]` (see [`Matrix`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// RMSNorm gain before attention, `dim`.
    pub attn_norm: Vec<f32>,
    /// Query projection, `q_dim × dim`.
    pub wq: Matrix,
    /// Key projection, `kv_dim × dim`.
    pub wk: Matrix,
    /// Value projection, `kv_dim × dim`.
    pub wv: Matrix,
    /// Attention output projection, `dim × q_dim`.
    pub wo: Matrix,
    /// RMSNorm gain before the FFN, `dim`.
    pub ffn_norm: Vec<f32>,
    /// FFN gate projection (`silu` applies to its output), `hidden_dim × dim`.
    pub w1: Matrix,
    /// FFN down projection, `dim × hidden_dim`.
    pub w2: Matrix,
    /// FFN up projection, `hidden_dim × dim`.
    pub w3: Matrix,
}

/// Where the logits come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Classifier {
    /// The classifier is the token embedding table (tied weights, as in stories260K).
    TiedToEmbedding,
    /// A separate `vocab_size × dim` matrix.
    Separate(Matrix),
}

/// All weights of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    /// Token embedding table, `vocab_size × dim`.
    pub token_embedding: Matrix,
    /// One entry per layer, in order.
    pub layers: Vec<LayerWeights>,
    /// RMSNorm gain after the last layer, `dim`.
    pub final_norm: Vec<f32>,
    /// The output projection to logits.
    pub classifier: Classifier,
}

/// A configuration with weights of matching shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    config: ModelConfig,
    weights: Weights,
}

impl Model {
    /// Checks `config` and that every tensor in `weights` has the shape `config` needs.
    pub fn new(config: ModelConfig, weights: Weights) -> Result<Self, InferError> {
        config.validate()?;
        let c = &config;
        let shape = |what: String, m: &Matrix, rows: usize, cols: usize| {
            if (m.rows(), m.cols()) == (rows, cols) {
                Ok(())
            } else {
                Err(InferError::WeightShape {
                    reason: format!(
                        "{what} is {} × {}, but the configuration needs {rows} × {cols}",
                        m.rows(),
                        m.cols()
                    ),
                })
            }
        };
        let norm = |what: String, v: &[f32]| {
            if v.len() == c.dim {
                Ok(())
            } else {
                Err(InferError::WeightShape {
                    reason: format!("{what} has {} values, but the configuration needs dim = {}", v.len(), c.dim),
                })
            }
        };
        shape("the token embedding".into(), &weights.token_embedding, c.vocab_size, c.dim)?;
        if weights.layers.len() != c.layers {
            return Err(InferError::WeightShape {
                reason: format!(
                    "there are {} layers of weights, but the configuration has {}",
                    weights.layers.len(),
                    c.layers
                ),
            });
        }
        for (i, l) in weights.layers.iter().enumerate() {
            norm(format!("layer {i} attention norm"), &l.attn_norm)?;
            shape(format!("layer {i} wq"), &l.wq, c.q_dim(), c.dim)?;
            shape(format!("layer {i} wk"), &l.wk, c.kv_dim(), c.dim)?;
            shape(format!("layer {i} wv"), &l.wv, c.kv_dim(), c.dim)?;
            shape(format!("layer {i} wo"), &l.wo, c.dim, c.q_dim())?;
            norm(format!("layer {i} FFN norm"), &l.ffn_norm)?;
            shape(format!("layer {i} w1"), &l.w1, c.hidden_dim, c.dim)?;
            shape(format!("layer {i} w2"), &l.w2, c.dim, c.hidden_dim)?;
            shape(format!("layer {i} w3"), &l.w3, c.hidden_dim, c.dim)?;
        }
        norm("the final norm".into(), &weights.final_norm)?;
        if let Classifier::Separate(m) = &weights.classifier {
            shape("the classifier".into(), m, c.vocab_size, c.dim)?;
        }
        Ok(Self { config, weights })
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The weights.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The matrix that maps the final hidden state to logits.
    pub fn classifier(&self) -> &Matrix {
        match &self.weights.classifier {
            Classifier::TiedToEmbedding => &self.weights.token_embedding,
            Classifier::Separate(m) => m,
        }
    }
}

/// The file name `../shared/scripts/fetch-smollm2.sh` stores SmolLM2-135M-Instruct under.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// SmolLM2-135M-Instruct's GGUF in the model cache (`$KVMM_MODEL_CACHE`, else
/// `~/.cache/kvmm/models`, where the fetch script puts it); otherwise a sentence saying where it
/// was looked for and how to fetch it.
pub fn smollm2_in_cache() -> Result<std::path::PathBuf, String> {
    let cache = std::env::var_os("KVMM_MODEL_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache/kvmm/models")));
    match cache.map(|c| c.join(SMOLLM2_FILE)) {
        Some(p) if p.is_file() => Ok(p),
        Some(p) => Err(format!("run ../shared/scripts/fetch-smollm2.sh (looked for {})", p.display())),
        None => Err(format!(
            "run ../shared/scripts/fetch-smollm2.sh (looked for {SMOLLM2_FILE} with neither KVMM_MODEL_CACHE nor HOME set)"
        )),
    }
}

/// Loads a model of either family, told apart by the file's first bytes (`GGUF` or not), with its
/// tokenizer: a GGUF file carries its own, a llama2.c checkpoint takes one from `tokenizer` (or has
/// none when that is `None`).
pub fn load(model: &Path, tokenizer: Option<&Path>) -> Result<(Model, Option<Tokenizer>), InferError> {
    if crate::gguf::is_gguf(model)? {
        if let Some(t) = tokenizer {
            return Err(InferError::InvalidArgument(format!(
                "{} is a GGUF file and carries its own tokenizer; drop the separate tokenizer {}",
                model.display(),
                t.display()
            )));
        }
        let (m, t) = gguf::load(model)?;
        return Ok((m, Some(t.into())));
    }
    let m = llama2c::load(model)?;
    let t = tokenizer.map(|p| Llama2cTokenizer::load(p, m.config().vocab_size)).transpose()?;
    Ok((m, t.map(Tokenizer::from)))
}
