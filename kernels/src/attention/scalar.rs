//! The scalar page kernel: the reference every SIMD kernel is tested against.
//!
//! Written straight from the contract in `kernel.rs`, one query head at a time, one element at a
//! time, decoding each element from the page bytes with the format's scalar reader (16-bit elements
//! exactly, quantized ones as `min + scale × code`) and using `f32::exp`. It runs on every target,
//! for every format, and is the fallback when no SIMD kernel is available for a page.

use crate::format::read::PageReader;

use super::kernel::{PageJob, Running};

/// Folds one page into the running state of every query head.
pub(crate) fn page(job: &PageJob<'_>, run: &mut Running<'_>) {
    let shape = job.shape;
    let reader = PageReader::new(shape.page_shape(), job.format, job.bytes);
    let (dim, group, tokens) = (shape.head_dim, shape.group(), job.tokens);
    let scores = &mut run.scores[..tokens];
    for qh in 0..shape.q_heads {
        let kv = qh / group;
        let q = &run.q[qh * dim..(qh + 1) * dim];

        for (t, score) in scores.iter_mut().enumerate() {
            *score = (0..dim).map(|d| q[d] * reader.key(kv, d, t)).sum();
        }
        let page_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let old_max = run.reference[qh];
        let new_max = old_max.max(page_max);
        let alpha = (old_max - new_max).exp();

        let mut page_sum = 0.0f32;
        for score in scores.iter_mut() {
            *score = (*score - new_max).exp();
            page_sum += *score;
        }

        let acc = &mut run.acc[qh * dim..(qh + 1) * dim];
        for (d, a) in acc.iter_mut().enumerate() {
            let mut weighted = 0.0f32;
            for (t, p) in scores.iter().enumerate() {
                weighted += p * reader.value(kv, t, d);
            }
            *a = alpha * *a + weighted;
        }

        run.sum[qh] = alpha * run.sum[qh] + page_sum;
        run.reference[qh] = new_max;
        run.page_ref[qh] = new_max;
        run.page_sum[qh] = page_sum;
    }
}
