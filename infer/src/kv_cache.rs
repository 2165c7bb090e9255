//! The KV-cache seam: [`KvCache`], and [`LocalKvCache`], the plain in-process implementation.
//!
//! The forward pass never touches K/V storage itself: per layer and per token it appends the new
//! post-RoPE key and value rows, then asks the cache for attention of the post-RoPE query over every
//! token of that layer. This is exactly the shape of `kvmm_client::Session` (append rows, attention
//! in place over pages), so a kvmm-backed cache plugs in behind the same trait; the local cache is
//! the plain second implementation that tests and tools use.
//!
//! Attention, for query head `h` using KV head `h / (q_heads / kv_heads)` (grouped-query attention)
//! over tokens `t = 0..n` of the layer:
//!
//! ```text
//!   s_t = (q_h · k_t) / sqrt(head_dim)
//!   p_t = exp(s_t − max_u s_u) / Σ_u exp(s_u − max_u s_u)
//!   out_h = Σ_t p_t × v_t
//! ```

use crate::config::ModelConfig;
use crate::error::InferError;

/// Storage for keys and values, and attention over them.
///
/// Rows are `kv_heads × head_dim` floats (head-major: `row[h * head_dim + d]`); queries and outputs
/// are `q_heads × head_dim`. Implementations MUST:
///
/// - keep each layer's tokens in append order, and start with every layer empty;
/// - make [`append`](KvCache::append) add exactly one token to `layer`, or fail and add nothing;
/// - make [`attention`](KvCache::attention) cover every token appended to `layer` so far (the
///   just-appended one included) with the formula in the module documentation, scale
///   `1 / sqrt(head_dim)`, and fail rather than attend over an empty layer;
/// - refuse rows, queries and outputs of the wrong length, and layers out of range, with
///   [`InferError::InvalidArgument`]; their own failures are [`InferError::Cache`].
///
/// Implementations MAY store rows at lower precision (f16, bf16, quantized) and compute in any
/// order, so their outputs can differ from [`LocalKvCache`] by rounding.
pub trait KvCache {
    /// Tokens appended to `layer` so far (0 for a layer out of range).
    fn tokens(&self, layer: usize) -> usize;

    /// Appends one token's key row `k` and value row `v` to `layer`.
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), InferError>;

    /// Writes attention of query `q` over all of `layer`'s tokens into `out`.
    fn attention(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<(), InferError>;
}

/// An in-process `f32` KV cache: per layer, keys and values as token-major rows
/// (`keys[(t × kv_heads + h) × head_dim + d]`, the layout `kvmm_kernels` row writes take).
#[derive(Clone, Debug)]
pub struct LocalKvCache {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Tokens each layer can hold.
    max_tokens: usize,
    /// Keys per layer, `tokens × kv_heads × head_dim`.
    keys: Vec<Vec<f32>>,
    /// Values per layer, same layout as `keys`.
    values: Vec<Vec<f32>>,
    /// Scores of one query head over all tokens, reused across calls.
    scores: Vec<f32>,
}

impl LocalKvCache {
    /// An empty cache shaped for `config`, holding up to `max_tokens` tokens per layer (at most
    /// `config.seq_len`).
    pub fn new(config: &ModelConfig, max_tokens: usize) -> Result<Self, InferError> {
        config.validate()?;
        if max_tokens == 0 || max_tokens > config.seq_len {
            return Err(InferError::InvalidArgument(format!(
                "a KV cache for this model holds 1..={} tokens (seq_len), not {max_tokens}",
                config.seq_len
            )));
        }
        Ok(Self {
            q_heads: config.heads,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
            max_tokens,
            keys: (0..config.layers).map(|_| Vec::with_capacity(max_tokens * config.kv_dim())).collect(),
            values: (0..config.layers).map(|_| Vec::with_capacity(max_tokens * config.kv_dim())).collect(),
            scores: Vec::with_capacity(max_tokens),
        })
    }

    /// The keys of `layer`, token-major.
    pub fn keys(&self, layer: usize) -> &[f32] {
        self.keys.get(layer).map_or(&[], Vec::as_slice)
    }

    /// The values of `layer`, token-major.
    pub fn values(&self, layer: usize) -> &[f32] {
        self.values.get(layer).map_or(&[], Vec::as_slice)
    }
}

/// The layer check every [`KvCache`] makes: `layer` is one of the cache's `layers`.
pub(crate) fn check_layer(layer: usize, layers: usize) -> Result<(), InferError> {
    if layer >= layers {
        return Err(InferError::InvalidArgument(format!(
            "layer {layer} is out of range: this cache has layers 0..{layers}"
        )));
    }
    Ok(())
}

/// The checks of [`KvCache::append`]: `k` and `v` are one token's rows of `row` floats, and the
/// layer, holding `held` tokens, has room below `capacity`.
pub(crate) fn check_append(
    layer: usize,
    held: usize,
    capacity: usize,
    row: usize,
    k: &[f32],
    v: &[f32],
) -> Result<(), InferError> {
    if k.len() != row || v.len() != row {
        return Err(InferError::InvalidArgument(format!(
            "append takes one token: k and v of kv_heads × head_dim = {row} floats each; got {} and {}",
            k.len(),
            v.len()
        )));
    }
    if held >= capacity {
        return Err(InferError::InvalidArgument(format!(
            "layer {layer} already holds {capacity} tokens, this cache's capacity"
        )));
    }
    Ok(())
}

/// The checks of [`KvCache::attention`]: `q` and `out` hold `want` floats (`q_heads × head_dim`),
/// and the layer, holding `held` tokens, has at least one.
pub(crate) fn check_attention(
    layer: usize,
    held: usize,
    want: usize,
    q: &[f32],
    out: &[f32],
) -> Result<(), InferError> {
    if q.len() != want || out.len() != want {
        return Err(InferError::InvalidArgument(format!(
            "attention needs q and out of q_heads × head_dim = {want} floats; got q {} and out {}",
            q.len(),
            out.len()
        )));
    }
    if held == 0 {
        return Err(InferError::InvalidArgument(format!("layer {layer} has no tokens yet; append before attention")));
    }
    Ok(())
}

impl KvCache for LocalKvCache {
    fn tokens(&self, layer: usize) -> usize {
        self.keys(layer).len() / (self.kv_heads * self.head_dim)
    }

    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), InferError> {
        check_layer(layer, self.keys.len())?;
        check_append(layer, self.tokens(layer), self.max_tokens, self.kv_heads * self.head_dim, k, v)?;
        self.keys[layer].extend_from_slice(k);
        self.values[layer].extend_from_slice(v);
        Ok(())
    }

    fn attention(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<(), InferError> {
        check_layer(layer, self.keys.len())?;
        let (d, kv_heads) = (self.head_dim, self.kv_heads);
        let n = self.tokens(layer);
        check_attention(layer, n, self.q_heads * d, q, out)?;
        let (keys, values) = (&self.keys[layer], &self.values[layer]);
        let group = self.q_heads / kv_heads;
        // The same f32 operations in the same order as llama2.c run.c, so greedy decoding matches it.
        let scale = (d as f32).sqrt();
        for (h, (qh, oh)) in q.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
            let kvh = h / group;
            self.scores.clear();
            self.scores.extend((0..n).map(|t| {
                let k = &keys[(t * kv_heads + kvh) * d..][..d];
                let mut dot = 0.0f32;
                for (a, b) in qh.iter().zip(k) {
                    dot += a * b;
                }
                dot / scale
            }));
            let max = self.scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for s in &mut self.scores {
                *s = (*s - max).exp();
                sum += *s;
            }
            oh.fill(0.0);
            for (t, s) in self.scores.iter().enumerate() {
                let p = s / sum;
                let v = &values[(t * kv_heads + kvh) * d..][..d];
                for (o, x) in oh.iter_mut().zip(v) {
                    *o += p * x;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn config(heads: usize, kv_heads: usize, head_dim: usize) -> ModelConfig {
        ModelConfig {
            dim: heads * head_dim,
            hidden_dim: 4,
            layers: 2,
            heads,
            kv_heads,
            head_dim,
            vocab_size: 4,
            seq_len: 64,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
        }
    }

    #[test]
    fn attention_over_one_token_returns_its_value() {
        let mut c = LocalKvCache::new(&config(2, 1, 2), 4).unwrap();
        c.append(1, &[1.0, 2.0], &[3.0, -4.0]).unwrap();
        let mut out = [0.0; 4];
        c.attention(1, &[0.5, 0.5, -7.0, 1.0], &mut out).unwrap();
        assert_eq!(out, [3.0, -4.0, 3.0, -4.0]);
        assert_eq!(c.tokens(1), 1);
        assert_eq!(c.tokens(0), 0);
    }

    #[test]
    fn attention_on_an_empty_layer_is_refused() {
        let mut c = LocalKvCache::new(&config(2, 1, 2), 4).unwrap();
        let err = c.attention(0, &[0.0; 4], &mut [0.0; 4]).unwrap_err();
        assert!(err.to_string().contains("append before attention"));
    }

    #[test]
    fn a_full_layer_refuses_another_token_and_keeps_what_it_has() {
        let mut c = LocalKvCache::new(&config(2, 1, 2), 1).unwrap();
        c.append(0, &[1.0, 2.0], &[3.0, 4.0]).unwrap();
        assert!(c.append(0, &[1.0, 2.0], &[3.0, 4.0]).is_err());
        assert_eq!(c.keys(0), &[1.0, 2.0]);
    }

    #[test]
    fn rows_of_the_wrong_length_are_refused() {
        let mut c = LocalKvCache::new(&config(2, 1, 2), 4).unwrap();
        assert!(c.append(0, &[1.0], &[3.0, 4.0]).is_err());
        assert!(c.append(2, &[1.0, 2.0], &[3.0, 4.0]).is_err());
        assert_eq!(c.tokens(0), 0);
    }

    proptest! {
        /// The local cache agrees with the kernels crate's dense f64 ground truth.
        #[test]
        fn local_attention_matches_the_f64_reference(
            group in 1usize..4,
            kv_heads in 1usize..4,
            half_dim in 1usize..9,
            tokens in 1usize..40,
            seed in any::<u64>(),
        ) {
            let (heads, head_dim) = (group * kv_heads, 2 * half_dim);
            let cfg = config(heads, kv_heads, head_dim);
            let mut c = LocalKvCache::new(&cfg, tokens).unwrap();
            let mut state = seed | 1;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            };
            for _ in 0..tokens {
                let k: Vec<f32> = (0..cfg.kv_dim()).map(|_| next()).collect();
                let v: Vec<f32> = (0..cfg.kv_dim()).map(|_| next()).collect();
                c.append(0, &k, &v).unwrap();
            }
            let q: Vec<f32> = (0..cfg.q_dim()).map(|_| next()).collect();
            let mut ours = vec![0.0; cfg.q_dim()];
            let mut reference = vec![0.0; cfg.q_dim()];
            c.attention(0, &q, &mut ours).unwrap();
            kvmm_kernels::reference_attention_f32(
                heads, kv_heads, head_dim, &q, c.keys(0), c.values(0),
                1.0 / (head_dim as f32).sqrt(), &mut reference,
            ).unwrap();
            for (a, b) in ours.iter().zip(&reference) {
                prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }
}
