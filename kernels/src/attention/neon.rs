//! The aarch64 NEON page kernel: 4 `f32` lanes.
//!
//! **Not compiled on the x86-64 CI machine, and never run there**: CI builds only for x86-64. Where
//! the aarch64 standard library is installed, `cargo clippy -p kvmm-kernels --lib --target
//! aarch64-unknown-linux-gnu` type-checks it (it passed when written), but no test exercises it. So
//! it is kept deliberately plain, to be checked by reading: elements are widened to `f32` one row at
//! a time with `half`'s scalar conversion (stable Rust has no NEON f16 vector types), into a stack buffer; only
//! the multiply-adds are vectorized. Softmax uses `f32::exp` exactly as the scalar kernel does.
//!
//! Per KV head: for each channel `d`, widen the channel's filled token values (channel-major keys)
//! and FMA them, 4 tokens per vector, with the broadcast `q[d]` of each head of the group into that
//! head's score row; softmax per head; then for each filled token widen its value row and FMA
//! `p_t × v_t` into each head's accumulator row, after rescaling it by `alpha`. Slots `t ≥ tokens`
//! are never widened: the key buffer's lanes past `tokens` stay 0, and those score lanes are never read.

use std::arch::aarch64::*;

use crate::format::rows::decode;

use super::kernel::{PageJob, Running};

const LANES: usize = 4;
/// Largest `block_tokens` and `head_dim` (see `AttnShape::validate`).
const MAX_ROW: usize = 256;

/// Widens `out.len()` consecutive elements starting at byte `first` of the page.
fn widen(job: &PageJob<'_>, first: usize, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let at = first + 2 * i;
        *o = decode(job.format, u16::from_le_bytes([job.bytes[at], job.bytes[at + 1]]));
    }
}

/// `dst[i] += a[i] × b` for `i < dst.len()`, `dst.len()` a multiple of 4 and `a.len() ≥ dst.len()`.
///
/// # Safety
///
/// The CPU must support neon.
#[target_feature(enable = "neon")]
unsafe fn fma_rows(dst: &mut [f32], a: &[f32], b: f32) {
    for (d, a) in dst.chunks_exact_mut(LANES).zip(a.chunks_exact(LANES)) {
        // SAFETY: both chunks hold exactly 4 floats, the width of one q register.
        unsafe { vst1q_f32(d.as_mut_ptr(), vfmaq_n_f32(vld1q_f32(d.as_ptr()), vld1q_f32(a.as_ptr()), b)) };
    }
}

/// `dst[i] *= b` for `i < dst.len()`, a multiple of 4.
///
/// # Safety
///
/// The CPU must support neon.
#[target_feature(enable = "neon")]
unsafe fn scale_row(dst: &mut [f32], b: f32) {
    for d in dst.chunks_exact_mut(LANES) {
        // SAFETY: the chunk holds exactly 4 floats, the width of one q register.
        unsafe { vst1q_f32(d.as_mut_ptr(), vmulq_n_f32(vld1q_f32(d.as_ptr()), b)) };
    }
}

/// Folds one page of a 16-bit format into the running state (quantized pages go to the scalar
/// kernel).
///
/// # Safety
///
/// The CPU must support neon, and `job` and `run` must satisfy the length contract of `kernel.rs`
/// (`Running::check`).
#[target_feature(enable = "neon")]
pub(super) unsafe fn page(job: &PageJob<'_>, run: &mut Running<'_>) {
    let shape = job.shape;
    let layout = shape.page_shape();
    let (dim, group, block, tokens) = (shape.head_dim, shape.group(), shape.block_tokens, job.tokens);
    // `tokens ≤ block`, a multiple of 8, so the rounded-up width still fits every score row.
    let width = tokens.next_multiple_of(LANES);
    let mut key_row = [0.0f32; MAX_ROW];
    let mut value_row = [0.0f32; MAX_ROW];

    for kv in 0..shape.kv_heads {
        let first_q = kv * group;

        for g in 0..group {
            run.scores[g * block..g * block + width].fill(0.0);
        }
        for d in 0..dim {
            widen(job, layout.k_byte(kv, d, 0), &mut key_row[..tokens]);
            for g in 0..group {
                let qd = run.q[(first_q + g) * dim + d];
                // SAFETY: the caller guarantees neon.
                unsafe { fma_rows(&mut run.scores[g * block..g * block + width], &key_row, qd) };
            }
        }

        for g in 0..group {
            let qh = first_q + g;
            let scores = &mut run.scores[g * block..g * block + tokens];
            let page_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = run.reference[qh].max(page_max);
            let alpha = (run.reference[qh] - new_max).exp();
            let mut page_sum = 0.0f32;
            for s in scores.iter_mut() {
                *s = (*s - new_max).exp();
                page_sum += *s;
            }
            run.sum[qh] = alpha * run.sum[qh] + page_sum;
            run.reference[qh] = new_max;
            run.page_ref[qh] = new_max;
            run.page_sum[qh] = page_sum;
            // SAFETY: the caller guarantees neon; `dim` is a multiple of 16.
            unsafe { scale_row(&mut run.acc[qh * dim..(qh + 1) * dim], alpha) };
        }

        for t in 0..tokens {
            widen(job, layout.v_byte(kv, t, 0), &mut value_row[..dim]);
            for g in 0..group {
                let qh = first_q + g;
                let p = run.scores[g * block + t];
                // SAFETY: the caller guarantees neon; `dim` is a multiple of 16.
                unsafe { fma_rows(&mut run.acc[qh * dim..(qh + 1) * dim], &value_row, p) };
            }
        }
    }
}
