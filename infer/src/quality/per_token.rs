//! Per-token quantization of `f32` rows, simulated: the baseline the KIVI layout is measured against.
//!
//! kvmm's quantized pages group keys per channel along a page's tokens (KIVI) and values per token
//! in groups of 32 channels. The usual alternative for keys is the value layout: per token, groups
//! of [`GROUP`] = 32 channels. That layout is not a page format, so it is simulated here: each group
//! is quantized and reconstructed in `f32` by the pages' own rounding rule
//! (`kvmm_kernels::format::quant::round_trip_group`, ggml q4_1 style): for a group with smallest
//! value `m` and largest `M` and `L = 2^bits − 1`,
//!
//! ```text
//!   min   = m rounded to f16 toward −∞
//!   scale = the smallest f16 with min + scale·L ≥ M   ((M − min) / L rounded to f16 toward +∞)
//!   inv   = 1 / scale in f32 (0 when scale = 0)
//!   code  = min(L, floor((x − min)·inv + 0.5))
//!   x'    = min + scale·code in f32
//! ```
//!
//! A row of `width` channels is split into groups of 32 from its start; a last group may be shorter.
//! Applied to value rows this reproduces the values of a kvmm q4 page bit for bit (a unit test
//! checks it), so the only difference between the baseline and q4 is the key grouping.

use kvmm_kernels::format::quant::round_trip_group;

/// Channels per group.
pub const GROUP: usize = 32;

/// Quantizes and reconstructs, in place, every row of `width` channels in `rows` (a multiple of
/// `width` long) per token, in groups of [`GROUP`] channels at `bits` bits (1..=8). Values must be
/// finite and within ±65504, as f16 parameters require; rows written through an f16 page are.
pub fn quantize_rows(rows: &mut [f32], width: usize, bits: u32) {
    debug_assert!((1..=8).contains(&bits) && width > 0 && rows.len().is_multiple_of(width));
    for row in rows.chunks_exact_mut(width) {
        for group in row.chunks_mut(GROUP) {
            round_trip_group(group, bits);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmm_kernels::{Format, PageShape, dequantize, init_page, quantize, write_rows};

    fn rows(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed | 1;
        (0..n)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let x = (state >> 8) as f32 / (1u32 << 24) as f32 * 6.0 - 3.0;
                // An outlier channel now and then, as real keys have.
                if i % 37 == 5 { 20.0 * x } else { x }
            })
            .collect()
    }

    #[test]
    fn per_token_groups_reproduce_the_values_of_quantized_pages_bit_for_bit() {
        for (head_dim, format, bits) in [(64, Format::Q4, 4), (48, Format::Q8, 8), (16, Format::Q2, 2)] {
            let shape = PageShape { kv_heads: 3, head_dim, block_tokens: 32 };
            let n = 32 * 3 * head_dim;
            let (k, v) = (rows(n, 7), rows(n, 11));
            let mut page = vec![0u8; shape.page_bytes(Format::F16)];
            init_page(shape, Format::F16, &mut page).unwrap();
            write_rows(shape, Format::F16, &mut page, 0, &k, &v).unwrap();
            let (mut k16, mut v16) = (vec![0.0; n], vec![0.0; n]);
            dequantize(shape, Format::F16, &page, 32, &mut k16, &mut v16).unwrap();
            let mut quantized = vec![0u8; shape.page_bytes(format)];
            quantize(shape, Format::F16, &page, 32, format, &mut quantized).unwrap();
            let (mut kq, mut vq) = (vec![0.0; n], vec![0.0; n]);
            dequantize(shape, format, &quantized, 32, &mut kq, &mut vq).unwrap();

            quantize_rows(&mut v16, head_dim, bits);
            let first = v16.iter().zip(&vq).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(first, None, "{format} head_dim {head_dim}: the simulation and the page differ");
        }
    }

    #[test]
    fn a_constant_group_is_reconstructed_exactly() {
        let mut row = vec![1.5f32; 40];
        quantize_rows(&mut row, 40, 4);
        assert!(row.iter().all(|&x| x == 1.5));
    }

    #[test]
    fn reconstruction_error_is_at_most_half_a_step() {
        let mut row = rows(64, 3);
        let original = row.clone();
        quantize_rows(&mut row, 64, 4);
        for (g, (a, b)) in original.chunks(GROUP).zip(row.chunks(GROUP)).enumerate() {
            let range =
                a.iter().copied().fold(f32::NEG_INFINITY, f32::max) - a.iter().copied().fold(f32::INFINITY, f32::min);
            let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
            // Half a step of (range / 15), plus the f16 rounding of the parameters.
            assert!(worst <= 0.5 * range / 15.0 * 1.01 + 1e-3, "group {g}: error {worst} for range {range}");
        }
    }
}
