//! Dense decode attention in `f64`, independent of pages, formats and kernels: ground truth for tests.
//!
//! Keys and values are plain token-major `f32` rows (`keys[(t × kv_heads + h) × head_dim + d]`),
//! exactly what [`crate::format::rows::write_rows`] takes. To compare with a paged kernel, round the
//! rows through the page format first (write then [`crate::format::rows::read_rows`]); the remaining
//! difference is the kernel's `f32` arithmetic.

use crate::error::KernelError;

fn check(
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q_len: usize,
    k_len: usize,
    v_len: usize,
) -> Result<usize, KernelError> {
    if kv_heads == 0 || q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(KernelError::GroupMismatch { q_heads, kv_heads });
    }
    if head_dim == 0 {
        return Err(KernelError::InvalidShape { what: "head_dim", value: 0, rule: "it must be positive" });
    }
    if q_len != q_heads * head_dim {
        return Err(KernelError::QueryLength { got: q_len, q_heads, head_dim });
    }
    let row = kv_heads * head_dim;
    for (which, len) in [("keys", k_len), ("values", v_len)] {
        if len % row != 0 {
            return Err(KernelError::RowLength { which, got: len, kv_heads, head_dim });
        }
    }
    if k_len != v_len {
        return Err(KernelError::KeyValueMismatch { k_len, v_len });
    }
    if k_len == 0 {
        return Err(KernelError::NoPages);
    }
    Ok(k_len / row)
}

/// Softmax probabilities `p[qh][t]` in `f64`, straight from the definition.
fn probabilities(
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q: &[f32],
    keys: &[f32],
    scale: f32,
    tokens: usize,
) -> Vec<Vec<f64>> {
    let group = q_heads / kv_heads;
    (0..q_heads)
        .map(|qh| {
            let kv = qh / group;
            let scores: Vec<f64> = (0..tokens)
                .map(|t| {
                    let k = &keys[(t * kv_heads + kv) * head_dim..][..head_dim];
                    let q = &q[qh * head_dim..][..head_dim];
                    let dot: f64 = q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum();
                    scale as f64 * dot
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = exps.iter().sum();
            exps.iter().map(|e| e / total).collect()
        })
        .collect()
}

/// Attention of one query token over `tokens` dense K/V rows, computed in `f64`.
///
/// `q` is `q_heads × head_dim`, `keys` and `values` are `tokens × kv_heads × head_dim` (token-major),
/// `out` receives `q_heads × head_dim`. Query head `qh` attends with KV head
/// `qh / (q_heads / kv_heads)`.
#[expect(
    clippy::too_many_arguments,
    reason = "mirrors the textbook definition; a shape struct would hide that it is layout-free"
)]
pub fn reference_attention_f32(
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let tokens = check(q_heads, kv_heads, head_dim, q.len(), keys.len(), values.len())?;
    if out.len() != q_heads * head_dim {
        return Err(KernelError::OutputLength { got: out.len(), q_heads, head_dim });
    }
    let group = q_heads / kv_heads;
    let probs = probabilities(q_heads, kv_heads, head_dim, q, keys, scale, tokens);
    for (qh, p) in probs.iter().enumerate() {
        let kv = qh / group;
        for d in 0..head_dim {
            let value: f64 = (0..tokens).map(|t| p[t] * values[(t * kv_heads + kv) * head_dim + d] as f64).sum();
            out[qh * head_dim + d] = value as f32;
        }
    }
    Ok(())
}

/// The attention mass of each token, averaged over query heads (`mass_out.len()` = tokens; sums to 1),
/// computed in `f64` like [`reference_attention_f32`]. Summing it over a page's tokens gives that
/// page's `mass` from [`super::DecodeAttention::finish`].
pub fn reference_token_mass(
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q: &[f32],
    keys: &[f32],
    scale: f32,
    mass_out: &mut [f32],
) -> Result<(), KernelError> {
    let tokens = check(q_heads, kv_heads, head_dim, q.len(), keys.len(), keys.len())?;
    if mass_out.len() != tokens {
        return Err(KernelError::MassLength { got: mass_out.len(), need: tokens, per: "token" });
    }
    let probs = probabilities(q_heads, kv_heads, head_dim, q, keys, scale, tokens);
    for (t, m) in mass_out.iter_mut().enumerate() {
        *m = (probs.iter().map(|p| p[t]).sum::<f64>() / q_heads as f64) as f32;
    }
    Ok(())
}
