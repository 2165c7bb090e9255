//! The aarch64 NEON page kernel: 4 `f32` lanes, for every page format.
//!
//! CI runs it under `qemu-user` (`.ci/run`: the kernels' tests for `aarch64-unknown-linux-gnu`,
//! where the proptests compare it with the scalar kernel). Emulation says nothing about speed, so
//! it is kept plain: each key channel or value row is widened to `f32` into a stack buffer, then
//! the multiply-adds are vectorized. 16-bit elements are widened with `half`'s scalar conversion
//! (stable Rust has no NEON f16 vector types); 8- and 4-bit codes 16 at a time with NEON widening
//! moves and one FMA `min + scale × code` (the product is exact, so this is the scalar rounding);
//! 2-bit codes one by one. Softmax uses `f32::exp` exactly as the scalar kernel does.
//!
//! Per KV head: for each channel `d`, widen the channel's filled token values (channel-major keys)
//! and FMA them, 4 tokens per vector, with the broadcast `q[d]` of each head of the group into that
//! head's score row; softmax per head; then for each filled token widen its value row and FMA
//! `p_t × v_t` into each head's accumulator row, after rescaling it by `alpha`. Slots `t ≥ tokens`
//! are never widened: the key buffer's lanes past `tokens` stay 0, and those score lanes are never
//! read. All page reads are indexed slices: a page that passed the header check cannot be read out
//! of bounds.

use std::arch::aarch64::*;

use crate::format::quant::{QuantLayout, V_GROUP, get_code, get_params};
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

/// `out[i] = min + scale × c_i` for the `out.len()` consecutive `bits`-bit codes `c_i` of the row
/// starting at byte `at` of `bytes` (code `i` at bit `i × bits`).
///
/// # Safety
///
/// The CPU must support neon.
#[target_feature(enable = "neon")]
unsafe fn widen_codes(bytes: &[u8], at: usize, bits: usize, scale: f32, min: f32, out: &mut [f32]) {
    let base = vdupq_n_f32(min);
    for (k, chunk) in out.chunks_mut(16).enumerate() {
        // The chunk's code bytes, copied so that a short last chunk never reads past its row.
        let mut packed = [0u8; 16];
        let (first, len) = (at + 16 * k * bits / 8, (chunk.len() * bits).div_ceil(8));
        packed[..len].copy_from_slice(&bytes[first..first + len]);
        let mut wide = [0.0f32; 16];
        if bits == 2 {
            for (i, w) in wide.iter_mut().enumerate() {
                *w = min + scale * get_code(&packed, 0, i, 2) as f32;
            }
        } else {
            // SAFETY: `packed` holds 16 bytes and `wide` 16 floats; every load and store below
            // stays inside them.
            unsafe {
                let codes = if bits == 8 {
                    vld1q_u8(packed.as_ptr())
                } else {
                    // Byte j holds codes 2j (low nibble) and 2j + 1.
                    let x = vld1_u8(packed.as_ptr());
                    let pairs = vzip_u8(vand_u8(x, vdup_n_u8(0x0f)), vshr_n_u8::<4>(x));
                    vcombine_u8(pairs.0, pairs.1)
                };
                let (lo, hi) = (vmovl_u8(vget_low_u8(codes)), vmovl_high_u8(codes));
                let lanes =
                    [vmovl_u16(vget_low_u16(lo)), vmovl_high_u16(lo), vmovl_u16(vget_low_u16(hi)), vmovl_high_u16(hi)];
                for (j, lane) in lanes.iter().enumerate() {
                    vst1q_f32(wide.as_mut_ptr().add(4 * j), vfmaq_n_f32(base, vcvtq_f32_u32(*lane), scale));
                }
            }
        }
        chunk.copy_from_slice(&wide[..chunk.len()]);
    }
}

/// Widens key channel `d` of KV head `kv` at token slots `0..out.len()`.
///
/// # Safety
///
/// The CPU must support neon.
#[target_feature(enable = "neon")]
unsafe fn widen_keys(job: &PageJob<'_>, quant: Option<&QuantLayout>, kv: usize, d: usize, out: &mut [f32]) {
    match quant {
        None => widen(job, job.shape.page_shape().k_byte(kv, d, 0), out),
        Some(q) => {
            let (scale, min) = get_params(job.bytes, q.k_param(kv, d));
            // SAFETY: the caller guarantees neon.
            unsafe { widen_codes(job.bytes, q.k_codes(kv) + d * q.k_row_bytes(), q.k_bits, scale, min, out) };
        }
    }
}

/// Widens the value row of token slot `t` of KV head `kv` (`out.len()` = head_dim channels).
///
/// # Safety
///
/// The CPU must support neon.
#[target_feature(enable = "neon")]
unsafe fn widen_values(job: &PageJob<'_>, quant: Option<&QuantLayout>, kv: usize, t: usize, out: &mut [f32]) {
    match quant {
        None => widen(job, job.shape.page_shape().v_byte(kv, t, 0), out),
        Some(q) => {
            let row = q.v_codes(kv) + t * q.v_row_bytes();
            for (j, group) in out.chunks_mut(V_GROUP).enumerate() {
                let (scale, min) = get_params(job.bytes, q.v_param(kv, j, t));
                let at = row + j * V_GROUP * q.v_bits / 8;
                // SAFETY: the caller guarantees neon.
                unsafe { widen_codes(job.bytes, at, q.v_bits, scale, min, group) };
            }
        }
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

/// Folds one page of any format into the running state.
///
/// # Safety
///
/// The CPU must support neon, and `job` and `run` must satisfy the length contract of `kernel.rs`
/// (`Running::check`).
#[target_feature(enable = "neon")]
pub(super) unsafe fn page(job: &PageJob<'_>, run: &mut Running<'_>) {
    let shape = job.shape;
    let quant = job.format.is_quantized().then(|| QuantLayout::new(shape.page_shape(), job.format).ok()).flatten();
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
            // SAFETY: the caller guarantees neon.
            unsafe { widen_keys(job, quant.as_ref(), kv, d, &mut key_row[..tokens]) };
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
            // SAFETY: the caller guarantees neon.
            unsafe { widen_values(job, quant.as_ref(), kv, t, &mut value_row[..dim]) };
            for g in 0..group {
                let qh = first_q + g;
                let p = run.scores[g * block + t];
                // SAFETY: the caller guarantees neon; `dim` is a multiple of 16.
                unsafe { fma_rows(&mut run.acc[qh * dim..(qh + 1) * dim], &value_row, p) };
            }
        }
    }
}
