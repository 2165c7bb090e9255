//! [`ModelConfig`]: the shape of a llama-family decoder, independent of the file it came from.
//!
//! Every loader (llama2.c checkpoints today, GGUF later) produces one, and everything downstream
//! (weights, forward pass, KV caches, fixtures) sizes itself from it. Invariants, checked by
//! [`ModelConfig::validate`]: all sizes positive and within the private `LIMITS` table,
//! `heads` a multiple of `kv_heads` (grouped-query attention), `head_dim` even (RoPE rotates
//! pairs), `rope_theta` and `norm_eps` finite and positive. `heads × head_dim` need not equal
//! `dim`: the query width and the residual width are kept apart.

use crate::error::InferError;

/// Upper bounds that keep every product of two sizes far from overflow and reject garbage headers
/// before anything is allocated. Generous for any model this engine is meant to run.
const LIMITS: [(&str, usize); 8] = [
    ("dim", 1 << 16),
    ("hidden_dim", 1 << 18),
    ("layers", 512),
    ("heads", 1024),
    ("kv_heads", 1024),
    ("head_dim", 1024),
    ("vocab_size", 1 << 22),
    ("seq_len", 1 << 22),
];

/// The architecture hyper-parameters of a llama-family decoder-only model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelConfig {
    /// Width of the residual stream (embedding size).
    pub dim: usize,
    /// Width of the SwiGLU hidden layer (`w1`, `w3` outputs; `w2` input).
    pub hidden_dim: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Query heads per layer.
    pub heads: usize,
    /// Key/value heads per layer; every `heads / kv_heads` query heads share one.
    pub kv_heads: usize,
    /// Elements per attention head (queries, keys and values alike).
    pub head_dim: usize,
    /// Number of tokens in the vocabulary (rows of the embedding and the classifier).
    pub vocab_size: usize,
    /// Longest sequence (positions) the model was trained for; the KV cache never holds more.
    pub seq_len: usize,
    /// RoPE base: pair `i` of a head rotates by `pos × rope_theta^(−2i / head_dim)`.
    pub rope_theta: f32,
    /// The epsilon added to the mean square inside RMSNorm.
    pub norm_eps: f32,
}

impl ModelConfig {
    /// Checks the invariants listed in the module documentation.
    pub fn validate(&self) -> Result<(), InferError> {
        let fail = |reason: String| Err(InferError::Config { reason });
        let values = [
            self.dim,
            self.hidden_dim,
            self.layers,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.vocab_size,
            self.seq_len,
        ];
        for ((name, limit), value) in LIMITS.iter().zip(values) {
            if value == 0 || value > *limit {
                return fail(format!("{name} is {value}, but it must be between 1 and {limit}"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return fail(format!(
                "heads is {} and kv_heads is {}; every KV head must serve the same number of query heads",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "head_dim is {}, but RoPE rotates pairs of elements, so it must be even",
                self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return fail(format!("rope_theta is {}, but it must be a finite positive number", self.rope_theta));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return fail(format!("norm_eps is {}, but it must be a finite positive number", self.norm_eps));
        }
        Ok(())
    }

    /// Width of all query heads together (`heads × head_dim`).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of all key (or value) heads together (`kv_heads × head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Query heads per KV head (`heads / kv_heads`).
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stories260k() -> ModelConfig {
        ModelConfig {
            dim: 64,
            hidden_dim: 172,
            layers: 5,
            heads: 8,
            kv_heads: 4,
            head_dim: 8,
            vocab_size: 512,
            seq_len: 512,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
        }
    }

    #[test]
    fn stories260k_shape_is_valid() {
        let c = stories260k();
        c.validate().unwrap();
        assert_eq!((c.q_dim(), c.kv_dim(), c.group()), (64, 32, 2));
    }

    #[test]
    fn query_heads_not_divisible_by_kv_heads_are_rejected() {
        let c = ModelConfig { kv_heads: 3, ..stories260k() };
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("heads is 8 and kv_heads is 3"), "{msg}");
    }

    #[test]
    fn odd_head_dim_is_rejected_because_rope_needs_pairs() {
        let c = ModelConfig { head_dim: 7, ..stories260k() };
        assert!(c.validate().unwrap_err().to_string().contains("must be even"));
    }

    #[test]
    fn zero_and_huge_sizes_are_rejected() {
        assert!(ModelConfig { layers: 0, ..stories260k() }.validate().is_err());
        assert!(ModelConfig { dim: usize::MAX, ..stories260k() }.validate().is_err());
        assert!(ModelConfig { norm_eps: f32::NAN, ..stories260k() }.validate().is_err());
    }
}
