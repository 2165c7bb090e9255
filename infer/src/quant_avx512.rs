//! AVX-512 products of ggml weight blocks with an `f32` vector: the fast path of
//! [`crate::Matrix::matvec`] for `Q4_1` and `Q8_0` rows.
//!
//! The arithmetic is the portable products' ([`crate::quant`]): a block's codes are widened to
//! `f32`, multiplied by the input in 16 lanes (low half of the block in lane `j`, high half added
//! in the same lane), scaled by the block's `d` into the row's accumulator, and for `Q4_1` the
//! offset term `m · Σ x` added from the block sums. Only the order of the additions differs (four
//! rows share each input load, and the lanes are reduced once per row), so results agree with the
//! portable code to `f32` rounding, not bit for bit.
//!
//! Decoding is bound by reading the weights (about 96 MB per token for SmolLM2-135M): the portable
//! code, which the default x86-64 target vectorizes 4 lanes wide, did not keep up with memory.
//!
//! Invariant: an [`Avx512`] exists only on a CPU with AVX-512 F, which is what makes its safe
//! methods sound; they check every length they rely on.

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m512, _MM_HINT_T0, _mm_loadu_si128, _mm_prefetch, _mm512_and_si512, _mm512_cvtepi8_epi32, _mm512_cvtepi32_ps,
    _mm512_cvtepu8_epi32, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mul_ps, _mm512_reduce_add_ps, _mm512_set1_epi32,
    _mm512_set1_ps, _mm512_setzero_ps, _mm512_srli_epi32,
};
use std::sync::OnceLock;

use crate::quant::{BLOCK, BlockQ4_1, BlockQ8_0};

/// Rows computed together: they share each load of the input and keep independent accumulators.
const ROWS: usize = 4;

/// Proof that this CPU runs AVX-512 F.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// The token, when the CPU has AVX-512 F (detected once per process).
    pub(crate) fn detect() -> Option<Avx512> {
        static DETECTED: OnceLock<bool> = OnceLock::new();
        DETECTED.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f")).then_some(Avx512(()))
    }

    /// `out[i] = Σ_j w[i][j] · x[j]` for `Q4_1` rows of `x.len() / 32` blocks each; `sums` holds the
    /// sum of each 32-element block of `x`. Panics when the lengths disagree.
    pub(crate) fn matvec_q4_1(self, blocks: &[BlockQ4_1], x: &[f32], sums: &[f32], out: &mut [f32]) {
        let (x, per_row) = check(blocks.len(), x, out.len());
        assert_eq!(sums.len(), per_row, "one block sum per input block");
        for (rows, o) in blocks.chunks(ROWS * per_row).zip(out.chunks_mut(ROWS)) {
            if o.len() == ROWS {
                let rows: [&[BlockQ4_1]; ROWS] = std::array::from_fn(|r| &rows[r * per_row..][..per_row]);
                // SAFETY: `self` proves AVX-512 F; every row has one block per input block.
                o.copy_from_slice(&unsafe { q4_1_rows(rows, x, sums) });
            } else {
                for (row, o) in rows.chunks_exact(per_row).zip(o) {
                    // SAFETY: as above.
                    *o = unsafe { q4_1_rows([row], x, sums) }[0];
                }
            }
        }
    }

    /// `out[i] = Σ_j w[i][j] · x[j]` for `Q8_0` rows of `x.len() / 32` blocks each. Panics when the
    /// lengths disagree.
    pub(crate) fn matvec_q8_0(self, blocks: &[BlockQ8_0], x: &[f32], out: &mut [f32]) {
        let (x, per_row) = check(blocks.len(), x, out.len());
        for (rows, o) in blocks.chunks(ROWS * per_row).zip(out.chunks_mut(ROWS)) {
            if o.len() == ROWS {
                let rows: [&[BlockQ8_0]; ROWS] = std::array::from_fn(|r| &rows[r * per_row..][..per_row]);
                // SAFETY: `self` proves AVX-512 F; every row has one block per input block.
                o.copy_from_slice(&unsafe { q8_0_rows(rows, x) });
            } else {
                for (row, o) in rows.chunks_exact(per_row).zip(o) {
                    // SAFETY: as above.
                    *o = unsafe { q8_0_rows([row], x) }[0];
                }
            }
        }
    }
}

/// Inputs computed together by the batched products: each weight block is decoded once for them.
const TOKENS: usize = 8;

impl Avx512 {
    /// `outs[t][i] = Σ_j w[i][j] · xs[t][j]` for every input `t` of `xs` (each `cols` long, `cols`
    /// = 32 × blocks per row), for `Q4_1` rows; `sums` holds each input's block sums, input after
    /// input. Each output is bit for bit what [`Avx512::matvec_q4_1`] gives for that input alone:
    /// the same operations in the same order, only the weights' decoding is shared. Panics when
    /// the lengths disagree.
    pub(crate) fn matmul_q4_1(self, blocks: &[BlockQ4_1], cols: usize, xs: &[f32], sums: &[f32], outs: &mut [f32]) {
        let (inputs, rows, per_row) = check_batch(blocks.len(), cols, xs, outs.len());
        assert_eq!(sums.len(), inputs.len(), "one block sum per input block");
        for (i, row) in blocks.chunks_exact(per_row).enumerate() {
            for (group, first) in inputs.chunks(TOKENS * per_row).zip((0..).step_by(TOKENS)) {
                let mut put = |t: usize, y: f32| outs[(first + t) * rows + i] = y;
                let group_sums = &sums[first * per_row..][..group.len()];
                if group.len() == TOKENS * per_row {
                    // SAFETY: `self` proves AVX-512 F; the group is `TOKENS` inputs of a row's blocks.
                    let y = unsafe { q4_1_inputs::<TOKENS>(row, group, group_sums) };
                    y.iter().enumerate().for_each(|(t, &y)| put(t, y));
                } else {
                    for t in 0..group.len() / per_row {
                        let x = &group[t * per_row..][..per_row];
                        // SAFETY: as above, one input.
                        put(t, unsafe { q4_1_inputs::<1>(row, x, &group_sums[t * per_row..][..per_row]) }[0]);
                    }
                }
            }
        }
    }

    /// As [`Avx512::matmul_q4_1`], for `Q8_0` rows (bit for bit [`Avx512::matvec_q8_0`] per input).
    pub(crate) fn matmul_q8_0(self, blocks: &[BlockQ8_0], cols: usize, xs: &[f32], outs: &mut [f32]) {
        let (inputs, rows, per_row) = check_batch(blocks.len(), cols, xs, outs.len());
        for (i, row) in blocks.chunks_exact(per_row).enumerate() {
            for (group, first) in inputs.chunks(TOKENS * per_row).zip((0..).step_by(TOKENS)) {
                let mut put = |t: usize, y: f32| outs[(first + t) * rows + i] = y;
                if group.len() == TOKENS * per_row {
                    // SAFETY: `self` proves AVX-512 F; the group is `TOKENS` inputs of a row's blocks.
                    let y = unsafe { q8_0_inputs::<TOKENS>(row, group) };
                    y.iter().enumerate().for_each(|(t, &y)| put(t, y));
                } else {
                    for t in 0..group.len() / per_row {
                        // SAFETY: as above, one input.
                        put(t, unsafe { q8_0_inputs::<1>(row, &group[t * per_row..][..per_row]) }[0]);
                    }
                }
            }
        }
    }
}

/// The inputs of a batch as blocks (input after input), the rows, and the blocks per row, after checking that the
/// batch is whole inputs of `cols` and `blocks` is one row of blocks per output of each.
fn check_batch(blocks: usize, cols: usize, xs: &[f32], outs: usize) -> (&[[f32; BLOCK]], usize, usize) {
    assert!(cols > 0 && cols.is_multiple_of(BLOCK), "inputs are whole blocks of {BLOCK}");
    assert!(xs.len().is_multiple_of(cols), "the batch is whole inputs of {cols}");
    let n = xs.len() / cols;
    let per_row = cols / BLOCK;
    assert!(n > 0 && outs.is_multiple_of(n), "one output row per input");
    let rows = outs / n;
    assert_eq!(blocks, rows * per_row, "one row of blocks per output");
    (xs.as_chunks::<BLOCK>().0, rows, per_row)
}

/// The input as blocks and the blocks per row, after checking that `blocks` is `rows` rows of them.
fn check(blocks: usize, x: &[f32], rows: usize) -> (&[[f32; BLOCK]], usize) {
    let (x, rest) = x.as_chunks::<BLOCK>();
    assert!(rest.is_empty(), "the input is whole blocks of {BLOCK}");
    assert_eq!(blocks, x.len() * rows, "one row of blocks per output");
    (x, x.len())
}

/// The `R` products of `rows` (each `x.len()` blocks) with `x`.
///
/// # Safety
/// The CPU runs AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn q4_1_rows<const R: usize>(rows: [&[BlockQ4_1]; R], x: &[[f32; BLOCK]], sums: &[f32]) -> [f32; R] {
    let mut acc = [_mm512_setzero_ps(); R];
    let mut offset = [0.0f32; R];
    for (b, (xb, &sum)) in x.iter().zip(sums).enumerate() {
        let (x_lo, x_hi) = load_block(xb);
        for r in 0..R {
            let block = &rows[r][b];
            prefetch_ahead(block, R * x.len());
            acc[r] = accumulate(acc[r], block.d, codes_q4_1(block), (x_lo, x_hi));
            offset[r] += block.m * sum;
        }
    }
    let mut out = [0.0; R];
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(acc[r]) + offset[r];
    }
    out
}

/// The `R` products of `rows` (each `x.len()` blocks) with `x`.
///
/// # Safety
/// The CPU runs AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn q8_0_rows<const R: usize>(rows: [&[BlockQ8_0]; R], x: &[[f32; BLOCK]]) -> [f32; R] {
    let mut acc = [_mm512_setzero_ps(); R];
    for (b, xb) in x.iter().enumerate() {
        let (x_lo, x_hi) = load_block(xb);
        for r in 0..R {
            let block = &rows[r][b];
            prefetch_ahead(block, R * x.len());
            acc[r] = accumulate(acc[r], block.d, codes_q8_0(block), (x_lo, x_hi));
        }
    }
    let mut out = [0.0; R];
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(acc[r]);
    }
    out
}

/// Asks for the block `AHEAD` row groups after `block` (`group` blocks each), so that the four
/// short row streams of a group do not each wait for memory: the hardware prefetcher barely ramps
/// up on a stream of a few hundred bytes.
#[inline]
#[target_feature(enable = "avx512f")]
fn prefetch_ahead<T>(block: &T, group: usize) {
    // A prefetch never faults, and `wrapping_add` keeps the address computation defined past the
    // matrix's end.
    let ahead = (block as *const T).wrapping_add(AHEAD * group);
    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
}

/// Row groups ahead that [`prefetch_ahead`] asks for.
const AHEAD: usize = 2;

/// The products of one `Q4_1` row with `T` inputs (`x` and `sums` input after input), each exactly
/// as [`q4_1_rows`] computes it.
///
/// # Safety
/// The CPU runs AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn q4_1_inputs<const T: usize>(row: &[BlockQ4_1], x: &[[f32; BLOCK]], sums: &[f32]) -> [f32; T] {
    let n = row.len();
    assert!(x.len() == T * n && sums.len() == T * n, "{T} inputs of {n} blocks and their sums");
    let mut acc = [_mm512_setzero_ps(); T];
    let mut offset = [0.0f32; T];
    for (b, block) in row.iter().enumerate() {
        let codes = codes_q4_1(block);
        for t in 0..T {
            acc[t] = accumulate(acc[t], block.d, codes, load_block(&x[t * n + b]));
            offset[t] += block.m * sums[t * n + b];
        }
    }
    let mut out = [0.0; T];
    for t in 0..T {
        out[t] = _mm512_reduce_add_ps(acc[t]) + offset[t];
    }
    out
}

/// The products of one `Q8_0` row with `T` inputs (`x` input after input), each exactly as
/// [`q8_0_rows`] computes it.
///
/// # Safety
/// The CPU runs AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn q8_0_inputs<const T: usize>(row: &[BlockQ8_0], x: &[[f32; BLOCK]]) -> [f32; T] {
    let n = row.len();
    assert_eq!(x.len(), T * n, "{T} inputs of {n} blocks");
    let mut acc = [_mm512_setzero_ps(); T];
    for (b, block) in row.iter().enumerate() {
        let codes = codes_q8_0(block);
        for t in 0..T {
            acc[t] = accumulate(acc[t], block.d, codes, load_block(&x[t * n + b]));
        }
    }
    let mut out = [0.0; T];
    for t in 0..T {
        out[t] = _mm512_reduce_add_ps(acc[t]);
    }
    out
}

/// A `Q4_1` block's codes as floats: lane `j` of the first vector is weight `j` (low nibbles),
/// of the second weight `j + 16` (high nibbles).
#[inline]
#[target_feature(enable = "avx512f")]
fn codes_q4_1(block: &BlockQ4_1) -> (__m512, __m512) {
    // SAFETY: `qs` is 16 bytes.
    let codes = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(block.qs.as_ptr().cast()) });
    let lo = _mm512_cvtepi32_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)));
    (lo, _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(codes)))
}

/// A `Q8_0` block's codes as floats: weights `0..16` and `16..32`.
#[inline]
#[target_feature(enable = "avx512f")]
fn codes_q8_0(block: &BlockQ8_0) -> (__m512, __m512) {
    let q = block.qs.as_ptr();
    // SAFETY: `qs` is 32 bytes: two loads of 16.
    let (lo, hi) = unsafe { (_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast())) };
    (_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)))
}

/// `acc + d · (codes · x)` lane by lane, the one arithmetic every product here repeats per block
/// (low half times the input's low half, then the high half fused in, then scaled into `acc`), so
/// that the row-grouped and the input-grouped products round alike.
#[inline]
#[target_feature(enable = "avx512f")]
fn accumulate(acc: __m512, d: f32, (lo, hi): (__m512, __m512), (x_lo, x_hi): (__m512, __m512)) -> __m512 {
    let t = _mm512_fmadd_ps(hi, x_hi, _mm512_mul_ps(lo, x_lo));
    _mm512_fmadd_ps(_mm512_set1_ps(d), t, acc)
}

/// A block of the input as its two halves of 16 lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn load_block(xb: &[f32; BLOCK]) -> (__m512, __m512) {
    // SAFETY: `xb` is 32 floats: two loads of 16.
    unsafe { (_mm512_loadu_ps(xb.as_ptr()), _mm512_loadu_ps(xb.as_ptr().add(16))) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{block_sums, dot_q4_1, dot_q8_0};

    /// A xorshift stream, for weights and inputs that exercise every code.
    struct Stream(u64);

    impl Stream {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn unit(&mut self) -> f32 {
            (self.next() % 2001) as f32 / 1000.0 - 1.0
        }
    }

    /// Rows that are not a multiple of the row group, so both the grouped and the single-row
    /// paths run, against the portable products row by row.
    #[test]
    fn avx512_matvec_agrees_with_the_portable_products_on_every_row() {
        let Some(avx) = Avx512::detect() else {
            eprintln!("skipped: this CPU has no AVX-512 F");
            return;
        };
        let mut s = Stream(0x9e37_79b9_7f4a_7c15);
        for (rows, per_row) in [(1, 1), (3, 2), (4, 18), (7, 5), (13, 48)] {
            let x: Vec<f32> = (0..per_row * BLOCK).map(|_| s.unit()).collect();
            let xb = x.as_chunks::<BLOCK>().0;
            let sums = block_sums(&x);
            let q4: Vec<BlockQ4_1> = (0..rows * per_row)
                .map(|_| BlockQ4_1 {
                    d: s.unit() * 0.1,
                    m: s.unit() * 0.2,
                    qs: std::array::from_fn(|_| s.next() as u8),
                })
                .collect();
            let q8: Vec<BlockQ8_0> = (0..rows * per_row)
                .map(|_| BlockQ8_0 { d: s.unit() * 0.01, qs: std::array::from_fn(|_| s.next() as i8) })
                .collect();
            let (mut got4, mut got8) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            avx.matvec_q4_1(&q4, &x, &sums, &mut got4);
            avx.matvec_q8_0(&q8, &x, &mut got8);
            for i in 0..rows {
                let want4 = dot_q4_1(&q4[i * per_row..][..per_row], xb, &sums);
                let want8 = dot_q8_0(&q8[i * per_row..][..per_row], xb);
                // Rounding is relative to the sum of the products' magnitudes, not to their sum.
                let magnitude = |w: Vec<f32>| 1e-6 * w.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum::<f32>();
                let (tol4, tol8) = (
                    magnitude(q4[i * per_row..][..per_row].iter().flat_map(BlockQ4_1::dequantize).collect()),
                    magnitude(q8[i * per_row..][..per_row].iter().flat_map(BlockQ8_0::dequantize).collect()),
                );
                assert!((got4[i] - want4).abs() <= tol4, "q4_1 {rows}×{per_row} row {i}: {} vs {want4}", got4[i]);
                assert!((got8[i] - want8).abs() <= tol8, "q8_0 {rows}×{per_row} row {i}: {} vs {want8}", got8[i]);
            }
        }
    }

    /// Batches that are not a multiple of the input group, against the matrix–vector products of
    /// each input alone, bit for bit.
    #[test]
    fn a_batched_product_gives_each_input_exactly_its_matvec() {
        let Some(avx) = Avx512::detect() else {
            eprintln!("skipped: this CPU has no AVX-512 F");
            return;
        };
        let mut s = Stream(0x2545_f491_4f6c_dd1d);
        for (rows, per_row, inputs) in [(1, 1, 1), (5, 3, 8), (6, 18, 13), (3, 2, 17)] {
            let cols = per_row * BLOCK;
            let xs: Vec<f32> = (0..inputs * cols).map(|_| s.unit()).collect();
            let sums: Vec<f32> = xs.chunks_exact(cols).flat_map(block_sums).collect();
            let q4: Vec<BlockQ4_1> = (0..rows * per_row)
                .map(|_| BlockQ4_1 {
                    d: s.unit() * 0.1,
                    m: s.unit() * 0.2,
                    qs: std::array::from_fn(|_| s.next() as u8),
                })
                .collect();
            let q8: Vec<BlockQ8_0> = (0..rows * per_row)
                .map(|_| BlockQ8_0 { d: s.unit() * 0.01, qs: std::array::from_fn(|_| s.next() as i8) })
                .collect();
            let (mut got4, mut got8) = (vec![f32::NAN; inputs * rows], vec![f32::NAN; inputs * rows]);
            avx.matmul_q4_1(&q4, cols, &xs, &sums, &mut got4);
            avx.matmul_q8_0(&q8, cols, &xs, &mut got8);
            for (t, x) in xs.chunks_exact(cols).enumerate() {
                let (mut want4, mut want8) = (vec![0.0; rows], vec![0.0; rows]);
                avx.matvec_q4_1(&q4, x, &block_sums(x), &mut want4);
                avx.matvec_q8_0(&q8, x, &mut want8);
                let bits = |v: &[f32]| v.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got4[t * rows..][..rows]),
                    bits(&want4),
                    "q4_1 {rows}×{per_row}, input {t} of {inputs}"
                );
                assert_eq!(
                    bits(&got8[t * rows..][..rows]),
                    bits(&want8),
                    "q8_0 {rows}×{per_row}, input {t} of {inputs}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "one row of blocks per output")]
    fn a_matvec_with_too_few_blocks_for_its_rows_panics_instead_of_reading_past_them() {
        let Some(avx) = Avx512::detect() else {
            panic!("one row of blocks per output (skipped: this CPU has no AVX-512 F)");
        };
        let blocks = vec![BlockQ8_0 { d: 1.0, qs: [1; BLOCK] }; 3];
        avx.matvec_q8_0(&blocks, &[1.0; 2 * BLOCK], &mut [0.0; 2]);
    }
}
