//! K/V traces: the post-RoPE queries, keys and values a model produces over a token sequence.
//!
//! [`RecordingKvCache`] wraps any [`KvCache`] and copies what the forward pass hands it: the key and
//! value rows of each append (post-RoPE keys, exactly as cached) and the query of each attention call
//! (post-RoPE). Because it sits on the cache seam, tracing knows nothing of checkpoint formats or the
//! forward pass's internals: [`trace_tokens`] (teacher-forced) and [`trace_greedy`] take any
//! [`Model`]. [`crate::fixture`] stores a [`KvTrace`] on disk.
//!
//! Invariant of a [`KvTrace`] (checked by [`KvTrace::validate`]): for `T = tokens.len()`, every
//! layer holds `q` of `T × heads × head_dim`, `k` and `v` of `T × kv_heads × head_dim` floats,
//! token-major, and row `t` belongs to the token fed at position `t`.

use crate::config::ModelConfig;
use crate::error::InferError;
use crate::forward::Forward;
use crate::generate::{Generation, generate_greedy};
use crate::kv_cache::{KvCache, LocalKvCache};
use crate::model::Model;

/// The attention inputs of one layer over a whole sequence.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerTrace {
    /// Post-RoPE queries, `T × heads × head_dim`.
    pub q: Vec<f32>,
    /// Post-RoPE keys, `T × kv_heads × head_dim`.
    pub k: Vec<f32>,
    /// Values, `T × kv_heads × head_dim`.
    pub v: Vec<f32>,
}

/// Queries, keys and values of every layer at every position of a token sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct KvTrace {
    /// The model the trace came from.
    pub config: ModelConfig,
    /// The token fed at each position.
    pub tokens: Vec<u32>,
    /// One entry per layer.
    pub layers: Vec<LayerTrace>,
}

impl KvTrace {
    /// Number of positions.
    pub fn positions(&self) -> usize {
        self.tokens.len()
    }

    /// The query of `layer` at position `t`, `heads × head_dim`.
    pub fn q(&self, layer: usize, t: usize) -> &[f32] {
        let n = self.config.q_dim();
        &self.layers[layer].q[t * n..][..n]
    }

    /// The key of `layer` at position `t`, `kv_heads × head_dim`.
    pub fn k(&self, layer: usize, t: usize) -> &[f32] {
        let n = self.config.kv_dim();
        &self.layers[layer].k[t * n..][..n]
    }

    /// The value of `layer` at position `t`, `kv_heads × head_dim`.
    pub fn v(&self, layer: usize, t: usize) -> &[f32] {
        let n = self.config.kv_dim();
        &self.layers[layer].v[t * n..][..n]
    }

    /// The trace of the first `positions` positions (all of them when it has fewer): what a
    /// tracer would have recorded had the sequence stopped there.
    pub fn prefix(&self, positions: usize) -> KvTrace {
        let t = positions.min(self.positions());
        let (q_dim, kv_dim) = (self.config.q_dim(), self.config.kv_dim());
        KvTrace {
            config: self.config,
            tokens: self.tokens[..t].to_vec(),
            layers: self
                .layers
                .iter()
                .map(|l| LayerTrace {
                    q: l.q[..t * q_dim].to_vec(),
                    k: l.k[..t * kv_dim].to_vec(),
                    v: l.v[..t * kv_dim].to_vec(),
                })
                .collect(),
        }
    }

    /// Checks the invariant in the module documentation; the message says what is off.
    pub fn validate(&self) -> Result<(), String> {
        self.config.validate().map_err(|e| e.to_string())?;
        let c = &self.config;
        let t = self.tokens.len();
        if t == 0 || t > c.seq_len {
            return Err(format!("it has {t} positions, but a trace holds 1..={} (seq_len)", c.seq_len));
        }
        if let Some((i, id)) = self.tokens.iter().enumerate().find(|(_, id)| **id as usize >= c.vocab_size) {
            return Err(format!("token {i} is id {id}, outside the vocabulary of {} tokens", c.vocab_size));
        }
        if self.layers.len() != c.layers {
            return Err(format!("it has {} layers, but the configuration says {}", self.layers.len(), c.layers));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            for (name, len, width) in
                [("q", layer.q.len(), c.q_dim()), ("k", layer.k.len(), c.kv_dim()), ("v", layer.v.len(), c.kv_dim())]
            {
                if len != t * width {
                    return Err(format!(
                        "layer {l} {name} has {len} floats, but {t} positions × {width} need {}",
                        t * width
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A [`KvCache`] that records every row and query passing through it, then defers to `inner`.
#[derive(Clone, Debug)]
pub struct RecordingKvCache<C> {
    inner: C,
    q_dim: usize,
    layers: Vec<LayerTrace>,
}

impl<C: KvCache> RecordingKvCache<C> {
    /// Wraps `inner` (which must be empty) for a model shaped like `config`.
    pub fn new(inner: C, config: &ModelConfig) -> Self {
        Self { inner, q_dim: config.q_dim(), layers: vec![LayerTrace::default(); config.layers] }
    }

    /// The wrapped cache.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// What was recorded, per layer, and the wrapped cache.
    pub fn into_parts(self) -> (Vec<LayerTrace>, C) {
        (self.layers, self.inner)
    }
}

impl<C: KvCache> KvCache for RecordingKvCache<C> {
    fn tokens(&self, layer: usize) -> usize {
        self.inner.tokens(layer)
    }

    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), InferError> {
        self.inner.append(layer, k, v)?;
        let rec = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| InferError::InvalidArgument(format!("layer {layer} is out of range for the recorder")))?;
        rec.k.extend_from_slice(k);
        rec.v.extend_from_slice(v);
        Ok(())
    }

    fn attention(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<(), InferError> {
        self.inner.attention(layer, q, out)?;
        let pos = self.inner.tokens(layer).checked_sub(1).ok_or_else(|| {
            InferError::InvalidArgument(format!("layer {layer} has no tokens yet; append before attention"))
        })?;
        let rec = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| InferError::InvalidArgument(format!("layer {layer} is out of range for the recorder")))?;
        // One query per position: the forward pass attends once right after each append.
        if rec.q.len() != pos * self.q_dim {
            return Err(InferError::InvalidArgument(format!(
                "layer {layer} was asked for attention twice at position {pos}; the recorder keeps one query \
                 per position"
            )));
        }
        rec.q.extend_from_slice(q);
        Ok(())
    }
}

/// Runs `model` teacher-forced over `tokens` (positions `0..tokens.len()`) and records the trace.
pub fn trace_tokens(model: &Model, tokens: &[u32]) -> Result<KvTrace, InferError> {
    let config = *model.config();
    if tokens.is_empty() || tokens.len() > config.seq_len {
        return Err(InferError::InvalidArgument(format!(
            "a trace runs 1..={} tokens (seq_len); got {}",
            config.seq_len,
            tokens.len()
        )));
    }
    let mut cache = RecordingKvCache::new(LocalKvCache::new(&config, tokens.len())?, &config);
    let mut forward = Forward::new(model);
    for (pos, &token) in tokens.iter().enumerate() {
        forward.step(model, &mut cache, token, pos)?;
    }
    let (layers, _) = cache.into_parts();
    Ok(KvTrace { config, tokens: tokens.to_vec(), layers })
}

/// Runs greedy generation from `prompt` for `steps` positions, stopping at a token in `stop` (see
/// [`generate_greedy`]), and records the trace of every token fed. Returns the generation too: its
/// `fed` are the trace's tokens.
pub fn trace_greedy(
    model: &Model,
    prompt: &[u32],
    steps: usize,
    stop: &[u32],
) -> Result<(KvTrace, Generation), InferError> {
    let config = *model.config();
    if steps == 0 || steps > config.seq_len {
        return Err(InferError::InvalidArgument(format!(
            "a greedy trace runs 1..={} steps (seq_len); got {steps}",
            config.seq_len
        )));
    }
    let mut cache = RecordingKvCache::new(LocalKvCache::new(&config, steps)?, &config);
    let generation = generate_greedy(model, &mut cache, prompt, steps, stop)?;
    let (layers, _) = cache.into_parts();
    let trace = KvTrace { config, tokens: generation.fed.clone(), layers };
    Ok((trace, generation))
}
