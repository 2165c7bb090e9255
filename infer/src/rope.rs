//! Rotary position embedding (RoPE) on adjacent pairs, as llama2.c and GGUF llama models use it.
//!
//! Within each head, elements `(2i, 2i+1)` are rotated by the angle `pos × θ_i`, with
//! `θ_i = rope_theta^(−2i / head_dim)`:
//!
//! ```text
//!   x'[2i]   = x[2i] cos(pos θ_i) − x[2i+1] sin(pos θ_i)
//!   x'[2i+1] = x[2i] sin(pos θ_i) + x[2i+1] cos(pos θ_i)
//! ```
//!
//! Hugging Face checkpoints rotate the halves `(i, i + head_dim/2)` instead; GGUF converters
//! permute `wq`/`wk` rows so that adjacent pairs are right for them too. Angles are computed in
//! `f32` from `pos as f32 × θ_i`, the way llama2.c `run.c` does, so results match it exactly.

use crate::config::ModelConfig;

/// Per-pair inverse frequencies for one head geometry.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    head_dim: usize,
    /// `θ_i` for `i in 0..head_dim/2`.
    inv_freq: Vec<f32>,
}

impl Rope {
    /// The frequencies for `config` (its `head_dim` is even by [`ModelConfig::validate`]).
    pub fn new(config: &ModelConfig) -> Self {
        let d = config.head_dim;
        let inv_freq = (0..d / 2).map(|i| 1.0 / config.rope_theta.powf((2 * i) as f32 / d as f32)).collect();
        Self { head_dim: d, inv_freq }
    }

    /// Rotates every head of `x` (`heads × head_dim`, head-major) for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        debug_assert!(x.len().is_multiple_of(self.head_dim), "RoPE input is whole heads");
        for head in x.chunks_exact_mut(self.head_dim) {
            for (pair, &freq) in head.chunks_exact_mut(2).zip(&self.inv_freq) {
                let angle = pos as f32 * freq;
                let (sin, cos) = angle.sin_cos();
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * cos - b * sin;
                pair[1] = a * sin + b * cos;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(head_dim: usize) -> ModelConfig {
        ModelConfig {
            dim: head_dim,
            hidden_dim: 1,
            layers: 1,
            heads: 1,
            kv_heads: 1,
            head_dim,
            vocab_size: 1,
            seq_len: 8,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
        }
    }

    #[test]
    fn position_zero_is_the_identity() {
        let rope = Rope::new(&config(4));
        let mut x = [1.0, 2.0, 3.0, 4.0];
        rope.apply(&mut x, 0);
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn the_first_pair_turns_by_one_radian_per_position_and_pairs_are_adjacent() {
        let rope = Rope::new(&config(4));
        let mut x = [1.0, 0.0, 1.0, 0.0];
        rope.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
        // Pair 1 turns by 10000^(-2/4) = 0.01 radians.
        assert!((x[2] - 0.01f32.cos()).abs() < 1e-6 && (x[3] - 0.01f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn rotation_preserves_each_pairs_length() {
        let rope = Rope::new(&config(8));
        let mut x = [3.0, 4.0, -1.0, 2.0, 0.5, 0.5, 6.0, -8.0];
        rope.apply(&mut x, 123);
        for (pair, len) in x.chunks_exact(2).zip([5.0f32, 5f32.sqrt(), 0.5f32.sqrt(), 10.0]) {
            assert!((pair[0].hypot(pair[1]) - len).abs() < 1e-4);
        }
    }
}
