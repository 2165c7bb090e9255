//! [`Forward`]: the `f32` forward pass of one token at one position, the llama-2 block order
//! ([`Forward::step`]), and of a prompt's tokens layer by layer with the same arithmetic
//! ([`Forward::prefill`]).
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

/// Tokens a [`Forward::prefill`] runs through each layer together (its buffers hold this many).
pub const PREFILL_TOKENS: usize = 64;

/// The activations of the tokens run together (one for a step, up to [`PREFILL_TOKENS`] for a
/// prefill group): one row per token in each buffer, token after token.
#[derive(Clone, Debug, Default)]
struct Batch {
    /// The residual stream, `dim` per token.
    x: Vec<f32>,
    /// Normed input of a sub-block, `dim` per token.
    xb: Vec<f32>,
    /// Output of a sub-block before the residual add, `dim` per token.
    xb2: Vec<f32>,
    /// Query, `q_dim` per token.
    q: Vec<f32>,
    /// Attention output, `q_dim` per token.
    attn: Vec<f32>,
    /// Key and value, `kv_dim` per token.
    k: Vec<f32>,
    v: Vec<f32>,
    /// FFN gate and up activations, `hidden_dim` per token.
    hb: Vec<f32>,
    hb2: Vec<f32>,
}

impl Batch {
    /// Sizes every buffer for `n` tokens of `c`.
    fn size(&mut self, c: &ModelConfig, n: usize) {
        let dims = [c.dim, c.dim, c.dim, c.q_dim(), c.q_dim(), c.kv_dim(), c.kv_dim(), c.hidden_dim, c.hidden_dim];
        let bufs = [
            &mut self.x,
            &mut self.xb,
            &mut self.xb2,
            &mut self.q,
            &mut self.attn,
            &mut self.k,
            &mut self.v,
            &mut self.hb,
            &mut self.hb2,
        ];
        for (buf, dim) in bufs.into_iter().zip(dims) {
            buf.resize(n * dim, 0.0);
        }
    }
}

/// Scratch state for running one model: a token at a time, or a prompt's tokens together.
#[derive(Clone, Debug)]
pub struct Forward {
    /// The configuration the buffers are sized for.
    config: ModelConfig,
    rope: Rope,
    /// The activations of the tokens being run (resized per call).
    batch: Batch,
    /// Output of the last step or prefill, `vocab_size`.
    logits: Vec<f32>,
}

impl Forward {
    /// Buffers for `model`.
    pub fn new(model: &Model) -> Self {
        let c = *model.config();
        Self { config: c, rope: Rope::new(&c), batch: Batch::default(), logits: vec![0.0; c.vocab_size] }
    }

    /// Runs `tokens` at positions `pos..pos + tokens.len()` (a prompt), appending their keys and
    /// values to `cache`, and returns the logits after the last one: bit for bit what
    /// [`Forward::step`] returns when fed the same tokens one by one. The same arithmetic runs for
    /// each token; the tokens go through each layer [`PREFILL_TOKENS`] at a time, so each weight
    /// matrix is read once per group instead of once per token ([`crate::Matrix::matmul`]). Each
    /// token's attention still runs right after its own keys and values are appended, so it sees
    /// exactly the tokens before it.
    ///
    /// The same conditions as `step` hold for the first token, and all of them must fit below
    /// `seq_len`. On error the cache may hold some of the tokens in some layers; discard it.
    pub fn prefill<C: KvCache + ?Sized>(
        &mut self,
        model: &Model,
        cache: &mut C,
        tokens: &[u32],
        pos: usize,
    ) -> Result<&[f32], InferError> {
        let c = self.config;
        if tokens.is_empty() {
            return Err(InferError::InvalidArgument("a prefill needs at least one token".to_owned()));
        }
        if pos.checked_add(tokens.len()).is_none_or(|end| end > c.seq_len) {
            return Err(InferError::InvalidArgument(format!(
                "{} tokens from position {pos} run past the model's context of {} tokens (seq_len)",
                tokens.len(),
                c.seq_len
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(InferError::InvalidArgument(format!(
                "token id {bad} is outside the model's vocabulary of {} tokens",
                c.vocab_size
            )));
        }
        let mut at = pos;
        for group in tokens.chunks(PREFILL_TOKENS) {
            // The model, the group's first position and the cache, as `step` checks them; the
            // group's other positions follow.
            self.check(model, cache, at)?;
            self.run(model, cache, group, at)?;
            at += group.len();
        }
        Ok(&self.logits)
    }

    /// Runs `tokens` (checked) at positions `pos..`, layer by layer (the module's block order):
    /// the matrix products over all of them at once, the rest token by token, each token's
    /// attention right after its own append. Leaves the logits after the last token.
    fn run<C: KvCache + ?Sized>(
        &mut self,
        model: &Model,
        cache: &mut C,
        tokens: &[u32],
        pos: usize,
    ) -> Result<(), InferError> {
        let c = self.config;
        let n = tokens.len();
        let b = &mut self.batch;
        b.size(&c, n);
        let w = model.weights();
        for (x, &token) in b.x.chunks_exact_mut(c.dim).zip(tokens) {
            w.token_embedding.dequantize_row(token as usize, x);
        }
        for (l, lw) in w.layers.iter().enumerate() {
            for (xb, x) in b.xb.chunks_exact_mut(c.dim).zip(b.x.chunks_exact(c.dim)) {
                rmsnorm(xb, x, &lw.attn_norm, c.norm_eps);
            }
            lw.wq.matmul(&b.xb, &mut b.q);
            lw.wk.matmul(&b.xb, &mut b.k);
            lw.wv.matmul(&b.xb, &mut b.v);
            let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
            for i in 0..n {
                let (q, k) = (&mut b.q[i * q_dim..][..q_dim], &mut b.k[i * kv_dim..][..kv_dim]);
                self.rope.apply(q, pos + i);
                self.rope.apply(k, pos + i);
                cache.append(l, k, &b.v[i * kv_dim..][..kv_dim])?;
                cache.attention(l, q, &mut b.attn[i * q_dim..][..q_dim])?;
            }
            lw.wo.matmul(&b.attn, &mut b.xb2);
            add(&mut b.x, &b.xb2);

            for (xb, x) in b.xb.chunks_exact_mut(c.dim).zip(b.x.chunks_exact(c.dim)) {
                rmsnorm(xb, x, &lw.ffn_norm, c.norm_eps);
            }
            lw.w1.matmul(&b.xb, &mut b.hb);
            lw.w3.matmul(&b.xb, &mut b.hb2);
            for (g, u) in b.hb.iter_mut().zip(&b.hb2) {
                *g = silu(*g) * u;
            }
            lw.w2.matmul(&b.hb, &mut b.xb2);
            add(&mut b.x, &b.xb2);
        }
        let last = (n - 1) * c.dim;
        rmsnorm(&mut b.xb[last..], &b.x[last..], &w.final_norm, c.norm_eps);
        model.classifier().matvec(&b.xb[last..], &mut self.logits);
        Ok(())
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
        if token as usize >= self.config.vocab_size {
            return Err(InferError::InvalidArgument(format!(
                "token id {token} is outside the model's vocabulary of {} tokens",
                self.config.vocab_size
            )));
        }
        self.check(model, cache, pos)?;
        self.run(model, cache, &[token], pos)?;
        Ok(&self.logits)
    }

    /// Checks what [`Forward::step`] and [`Forward::prefill`] need of the model, the position and
    /// the cache before running a token at `pos`.
    fn check<C: KvCache + ?Sized>(&self, model: &Model, cache: &C, pos: usize) -> Result<(), InferError> {
        let c = &self.config;
        if model.config() != c {
            return Err(InferError::InvalidArgument(
                "this Forward was built for a model with another configuration; build one per model".to_owned(),
            ));
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
        Ok(())
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
