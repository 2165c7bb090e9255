//! K/V rows and their checks for the scenarios that append through the Rust client with a
//! SmolLM2-like head shape: 3 KV heads, 9 query heads, head_dim 64.

use kvmm_client::{Geometry, Session};
use kvmm_kernels::reference_attention_f32;

/// KV heads.
pub const KV: usize = 3;
/// Query heads.
pub const Q: usize = 9;
/// Channels per head.
pub const DIM: usize = 64;
/// Elements of one token's K (or V) row.
pub const ROW: usize = KV * DIM;

/// A session of `layers` layers of this head shape, up to 4,096 tokens.
pub fn geometry(layers: u32) -> Geometry {
    Geometry::new(layers, KV as u32, Q as u32, DIM as u32, 4096)
}

/// `tokens` rows of values f16 holds exactly (multiples of 1/64 in [-2, 2]), so a reference over
/// the f32 rows sees what the pages hold.
pub fn rows(tokens: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..tokens * ROW)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state % 257) as f32 - 128.0) / 64.0
        })
        .collect()
}

/// Decode attention of `q` over `layer`.
pub fn attend(session: &mut Session, layer: u32, q: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; Q * DIM];
    session.attention(layer, q, &mut out).unwrap();
    out
}

/// The worst error of `got` relative to each head's largest output of the reference over `k`, `v`.
pub fn worst_error(got: &[f32], k: &[f32], v: &[f32], q: &[f32]) -> f64 {
    let mut want = vec![0.0f32; Q * DIM];
    reference_attention_f32(Q, KV, DIM, q, k, v, 1.0 / (DIM as f32).sqrt(), &mut want).unwrap();
    let mut worst = 0.0f64;
    for (g, w) in got.chunks(DIM).zip(want.chunks(DIM)) {
        let largest = w.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-30);
        for (a, b) in g.iter().zip(w) {
            worst = worst.max(f64::from((a - b).abs() / largest));
        }
    }
    worst
}
