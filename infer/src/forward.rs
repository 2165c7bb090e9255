//! [`Forward`]: the `f32` forward pass of one token at one position, the llama-2 block order.
//!
//! ```text
//!   x = embedding[token]
//!   per layer l:
//!     h = rmsnorm(x) · attn_norm[l]
//!     q, k, v = wq·h, wk·h, wv·h;  RoPE(q, pos), RoPE(k, pos)
//!     cache.append(l, k, v);  a = cache.attention(l, q)       (grouped-query, see kv_cache)
//!     x += wo·a
//!     h = rmsnorm(x) · ffn_norm[l]
//!     x += w2·(silu(w1·h) ⊙ (w3·h))
//!   logits = classifier · (rmsnorm(x) · final_norm)
//! ```
//!
//! `Forward` owns only scratch buffers sized from the model's configuration; the K/V history lives
//! behind [`KvCache`], and the weights stay borrowed. Every operation outside the quantized matrix
//! products uses the same `f32` arithmetic in the same order as llama2.c `run.c`, so an `f32` model
//! (stories260K) reproduces it exactly.

use crate::config::ModelConfig;
use crate::error::InferError;
use crate::kv_cache::KvCache;
use crate::model::Model;
use crate::rope::Rope;

/// Scratch state for running one model, one token at a time.
#[derive(Clone, Debug)]
pub struct Forward {
    /// The configuration the buffers are sized for.
    config: ModelConfig,
    rope: Rope,
    /// The residual stream, `dim`.
    x: Vec<f32>,
    /// Normed input of a sub-block, `dim`.
    xb: Vec<f32>,
    /// Output of a sub-block before the residual add, `dim`.
    xb2: Vec<f32>,
    /// Query, then attention output: `q_dim`.
    q: Vec<f32>,
    attn: Vec<f32>,
    /// Key and value of this token, `kv_dim`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// FFN gate and up activations, `hidden_dim`.
    hb: Vec<f32>,
    hb2: Vec<f32>,
    /// Output of the last step, `vocab_size`.
    logits: Vec<f32>,
}

impl Forward {
    /// Buffers for `model`.
    pub fn new(model: &Model) -> Self {
        let c = *model.config();
        Self {
            config: c,
            rope: Rope::new(&c),
            x: vec![0.0; c.dim],
            xb: vec![0.0; c.dim],
            xb2: vec![0.0; c.dim],
            q: vec![0.0; c.q_dim()],
            attn: vec![0.0; c.q_dim()],
            k: vec![0.0; c.kv_dim()],
            v: vec![0.0; c.kv_dim()],
            hb: vec![0.0; c.hidden_dim],
            hb2: vec![0.0; c.hidden_dim],
            logits: vec![0.0; c.vocab_size],
        }
    }

    /// Runs `token` at position `pos`, appending its keys and values to `cache`, and returns the
    /// logits for the next token.
    ///
    /// `pos` must equal the number of tokens every layer of `cache` holds (positions are fed in
    /// order, each once) and be below `seq_len`. On error the cache may hold this token in some
    /// layers but not others; discard it.
    pub fn step<C: KvCache + ?Sized>(
        &mut self,
        model: &Model,
        cache: &mut C,
        token: u32,
        pos: usize,
    ) -> Result<&[f32], InferError> {
        let c = &self.config;
        if model.config() != c {
            return Err(InferError::InvalidArgument(
                "this Forward was built for a model with another configuration; build one per model".to_owned(),
            ));
        }
        if token as usize >= c.vocab_size {
            return Err(InferError::InvalidArgument(format!(
                "token id {token} is outside the model's vocabulary of {} tokens",
                c.vocab_size
            )));
        }
        if pos >= c.seq_len {
            return Err(InferError::InvalidArgument(format!(
                "position {pos} is past the model's context of {} tokens (seq_len)",
                c.seq_len
            )));
        }
        if let Some(layer) = (0..c.layers).find(|&l| cache.tokens(l) != pos) {
            return Err(InferError::InvalidArgument(format!(
                "position {pos} does not follow the cache: layer {layer} holds {} tokens; feed positions \
                 in order, starting at 0",
                cache.tokens(layer)
            )));
        }

        let w = model.weights();
        w.token_embedding.dequantize_row(token as usize, &mut self.x);
        for (l, lw) in w.layers.iter().enumerate() {
            rmsnorm(&mut self.xb, &self.x, &lw.attn_norm, c.norm_eps);
            lw.wq.matvec(&self.xb, &mut self.q);
            lw.wk.matvec(&self.xb, &mut self.k);
            lw.wv.matvec(&self.xb, &mut self.v);
            self.rope.apply(&mut self.q, pos);
            self.rope.apply(&mut self.k, pos);
            cache.append(l, &self.k, &self.v)?;
            cache.attention(l, &self.q, &mut self.attn)?;
            lw.wo.matvec(&self.attn, &mut self.xb2);
            add(&mut self.x, &self.xb2);

            rmsnorm(&mut self.xb, &self.x, &lw.ffn_norm, c.norm_eps);
            lw.w1.matvec(&self.xb, &mut self.hb);
            lw.w3.matvec(&self.xb, &mut self.hb2);
            for (g, u) in self.hb.iter_mut().zip(&self.hb2) {
                *g = silu(*g) * u;
            }
            lw.w2.matvec(&self.hb, &mut self.xb2);
            add(&mut self.x, &self.xb2);
        }
        rmsnorm(&mut self.xb, &self.x, &w.final_norm, c.norm_eps);
        model.classifier().matvec(&self.xb, &mut self.logits);
        Ok(&self.logits)
    }
}

/// `out = gain ⊙ (x / sqrt(mean(x²) + eps))`, in run.c's order of operations.
fn rmsnorm(out: &mut [f32], x: &[f32], gain: &[f32], eps: f32) {
    let mut ss = 0.0f32;
    for v in x {
        ss += v * v;
    }
    ss /= x.len() as f32;
    ss += eps;
    let inv = 1.0 / ss.sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(gain) {
        *o = g * (inv * v);
    }
}

/// `x · sigmoid(x)`.
fn silu(x: f32) -> f32 {
    x * (1.0 / (1.0 + (-x).exp()))
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_scales_to_unit_mean_square() {
        let mut out = [0.0; 2];
        rmsnorm(&mut out, &[3.0, 4.0], &[1.0, 2.0], 0.0);
        let inv = 1.0 / 12.5f32.sqrt();
        assert_eq!(out, [3.0 * inv, 2.0 * (4.0 * inv)]);
    }

    #[test]
    fn silu_is_zero_at_zero_and_near_identity_for_large_inputs() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(20.0) - 20.0).abs() < 1e-6);
        assert!(silu(-20.0).abs() < 1e-6);
    }
}
