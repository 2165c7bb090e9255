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

/// Inputs computed together by the batched products: each weight block is decoded once for them.
const TOKENS: usize = 8;

/// Proof that this CPU runs AVX-512 F.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512(());

/// A ggml block the products read: `Q4_1` or `Q8_0`.
pub(crate) trait Block {
    /// Whether the block adds `m · Σ x` over its 32 inputs (`Q4_1`): the products then take the
    /// input's block sums.
    const OFFSET: bool;

    /// The codes as floats: lane `j` of the first vector is weight `j`, of the second `j + 16`.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F.
    unsafe fn codes(&self) -> (__m512, __m512);

    /// The scale `d`.
    fn scale(&self) -> f32;

    /// The offset `m` (0 without one).
    fn offset(&self) -> f32;
}

impl Block for BlockQ4_1 {
    const OFFSET: bool = true;

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn codes(&self) -> (__m512, __m512) {
        // SAFETY: `qs` is 16 bytes.
        let codes = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(self.qs.as_ptr().cast()) });
        let lo = _mm512_cvtepi32_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)));
        (lo, _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(codes)))
    }

    fn scale(&self) -> f32 {
        self.d
    }

    fn offset(&self) -> f32 {
        self.m
    }
}

impl Block for BlockQ8_0 {
    const OFFSET: bool = false;

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn codes(&self) -> (__m512, __m512) {
        let q = self.qs.as_ptr();
        // SAFETY: `qs` is 32 bytes: two loads of 16.
        let (lo, hi) = unsafe { (_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast())) };
        (_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)))
    }

    fn scale(&self) -> f32 {
        self.d
    }

    fn offset(&self) -> f32 {
        0.0
    }
}

impl Avx512 {
    /// The token, when the CPU has AVX-512 F (detected once per process).
    pub(crate) fn detect() -> Option<Avx512> {
        static DETECTED: OnceLock<bool> = OnceLock::new();
        DETECTED.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f")).then_some(Avx512(()))
    }

    /// `out[i] = Σ_j w[i][j] · x[j]` for rows of `x.len() / 32` blocks each; for `Q4_1` `sums` holds
    /// the sum of each 32-element block of `x` (for `Q8_0` it is empty). Panics when the lengths
    /// disagree.
    pub(crate) fn matvec<B: Block>(self, blocks: &[B], x: &[f32], sums: &[f32], out: &mut [f32]) {
        let (x, _, per_row) = check_batch(blocks.len(), x.len(), x, out.len());
        assert_eq!(sums.len(), if B::OFFSET { per_row } else { 0 }, "one block sum per input block");
        for (rows, o) in blocks.chunks(ROWS * per_row).zip(out.chunks_mut(ROWS)) {
            if o.len() == ROWS {
                let rows: [&[B]; ROWS] = std::array::from_fn(|r| &rows[r * per_row..][..per_row]);
                // SAFETY: `self` proves AVX-512 F; every row has one block per input block.
                o.copy_from_slice(&unsafe { rows_product(rows, x, sums) });
            } else {
                for (row, o) in rows.chunks_exact(per_row).zip(o) {
                    // SAFETY: as above.
                    *o = unsafe { rows_product([row], x, sums) }[0];
                }
            }
        }
    }

    /// `outs[t][i] = Σ_j w[i][j] · xs[t][j]` for every input `t` of `xs` (each `cols` long, `cols`
    /// = 32 × blocks per row); for `Q4_1` `sums` holds each input's block sums, input after input
    /// (for `Q8_0` it is empty). Each output is bit for bit what [`Avx512::matvec`] gives for that
    /// input alone: the same operations in the same order, only the weights' decoding is shared.
    /// Panics when the lengths disagree.
    pub(crate) fn matmul<B: Block>(self, blocks: &[B], cols: usize, xs: &[f32], sums: &[f32], outs: &mut [f32]) {
        let (inputs, rows, per_row) = check_batch(blocks.len(), cols, xs, outs.len());
        assert_eq!(sums.len(), if B::OFFSET { inputs.len() } else { 0 }, "one block sum per input block");
        // The block sums of `n` inputs from input `t`, for the blocks that take them.
        let sums_of = |t: usize, n: usize| if B::OFFSET { &sums[t * per_row..][..n * per_row] } else { &[][..] };
        for (i, row) in blocks.chunks_exact(per_row).enumerate() {
            for (group, first) in inputs.chunks(TOKENS * per_row).zip((0..).step_by(TOKENS)) {
                let mut put = |t: usize, y: f32| outs[(first + t) * rows + i] = y;
                if group.len() == TOKENS * per_row {
                    // SAFETY: `self` proves AVX-512 F; the group is `TOKENS` inputs of a row's blocks.
                    let y = unsafe { inputs_product::<B, TOKENS>(row, group, sums_of(first, TOKENS)) };
                    y.iter().enumerate().for_each(|(t, &y)| put(t, y));
                } else {
                    for t in 0..group.len() / per_row {
                        let x = &group[t * per_row..][..per_row];
                        // SAFETY: as above, one input.
                        put(t, unsafe { inputs_product::<B, 1>(row, x, sums_of(first + t, 1)) }[0]);
                    }
                }
            }
        }
    }
}

/// The inputs of a batch as blocks (input after input), the rows, and the blocks per row, after
/// checking that the batch is whole inputs of `cols` and `blocks` is one row of blocks per output
/// of each.
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

/// The `R` products of `rows` (each `x.len()` blocks) with `x`; `sums` as for [`Avx512::matvec`].
///
/// # Safety
/// The CPU runs AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn rows_product<B: Block, const R: usize>(rows: [&[B]; R], x: &[[f32; BLOCK]], sums: &[f32]) -> [f32; R] {
    let mut acc = [_mm512_setzero_ps(); R];
    let mut offset = [0.0f32; R];
    for (b, xb) in x.iter().enumerate() {
        let xb = load_block(xb);
        for r in 0..R {
            let block = &rows[r][b];
            prefetch_ahead(block, R * x.len());
            // SAFETY: AVX-512 F, as the caller guarantees.
            acc[r] = accumulate(acc[r], block.scale(), unsafe { block.codes() }, xb);
            if B::OFFSET {
                offset[r] += block.offset() * sums[b];
            }
        }
    }
    reduce::<B, R>(acc, offset)
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

/// The products of one row with `T` inputs (`x`, and for `Q4_1` `sums`, input after input), each
/// exactly as [`rows_product`] computes it.
///
/// # Safety
/// The CPU runs AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn inputs_product<B: Block, const T: usize>(row: &[B], x: &[[f32; BLOCK]], sums: &[f32]) -> [f32; T] {
    let n = row.len();
    assert!(x.len() == T * n && sums.len() == if B::OFFSET { T * n } else { 0 }, "{T} inputs of {n} blocks");
    let mut acc = [_mm512_setzero_ps(); T];
    let mut offset = [0.0f32; T];
    for (b, block) in row.iter().enumerate() {
        // SAFETY: AVX-512 F, as the caller guarantees.
        let codes = unsafe { block.codes() };
        for t in 0..T {
            acc[t] = accumulate(acc[t], block.scale(), codes, load_block(&x[t * n + b]));
            if B::OFFSET {
                offset[t] += block.offset() * sums[t * n + b];
            }
        }
    }
    reduce::<B, T>(acc, offset)
}

/// Each accumulator's lanes added up, plus its offset term for `Q4_1` blocks.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce<B: Block, const N: usize>(acc: [__m512; N], offset: [f32; N]) -> [f32; N] {
    let mut out = [0.0; N];
    for i in 0..N {
        out[i] = _mm512_reduce_add_ps(acc[i]);
        if B::OFFSET {
            out[i] += offset[i];
        }
    }
    out
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

        /// `n` `Q4_1` blocks with every code and scales of both signs.
        fn q4_1_blocks(&mut self, n: usize) -> Vec<BlockQ4_1> {
            (0..n)
                .map(|_| BlockQ4_1 {
                    d: self.unit() * 0.1,
                    m: self.unit() * 0.2,
                    qs: std::array::from_fn(|_| self.next() as u8),
                })
                .collect()
        }

        /// `n` `Q8_0` blocks with every code and scales of both signs.
        fn q8_0_blocks(&mut self, n: usize) -> Vec<BlockQ8_0> {
            (0..n)
                .map(|_| BlockQ8_0 { d: self.unit() * 0.01, qs: std::array::from_fn(|_| self.next() as i8) })
                .collect()
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
            let (q4, q8) = (s.q4_1_blocks(rows * per_row), s.q8_0_blocks(rows * per_row));
            let (mut got4, mut got8) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            avx.matvec(&q4, &x, &sums, &mut got4);
            avx.matvec(&q8, &x, &[], &mut got8);
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
            let (q4, q8) = (s.q4_1_blocks(rows * per_row), s.q8_0_blocks(rows * per_row));
            let (mut got4, mut got8) = (vec![f32::NAN; inputs * rows], vec![f32::NAN; inputs * rows]);
            avx.matmul(&q4, cols, &xs, &sums, &mut got4);
            avx.matmul(&q8, cols, &xs, &[], &mut got8);
            for (t, x) in xs.chunks_exact(cols).enumerate() {
                let (mut want4, mut want8) = (vec![0.0; rows], vec![0.0; rows]);
                avx.matvec(&q4, x, &block_sums(x), &mut want4);
                avx.matvec(&q8, x, &[], &mut want8);
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
        avx.matvec(&blocks, &[1.0; 2 * BLOCK], &[], &mut [0.0; 2]);
    }
}
