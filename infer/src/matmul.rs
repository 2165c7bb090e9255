//! The matrix–vector seam: [`Matrix`] holds a weight matrix, [`Matrix::matvec`] applies it.
//!
//! Weights are row-major with rows as outputs (`y = W·x`, `W[out][in]`), the layout of llama2.c and
//! GGUF alike. A matrix stores its rows in one of three [`WeightFormat`]s:
//!
//! - `F32`: plain floats (llama2.c checkpoints; GGUF `F32` and `F16` tensors, widened exactly). The
//!   product accumulates each row left to right in `f32`, exactly as llama2.c `run.c` does, so
//!   results match it bit for bit.
//! - `Q4_1` and `Q8_0`: ggml's quantized blocks ([`crate::quant`]), kept quantized in memory and
//!   dequantized on the fly inside the product, which sums in vector lanes. On x86-64 CPUs with
//!   AVX-512 F the products run in `quant_avx512.rs` (same arithmetic, 16 lanes, four rows at once);
//!   elsewhere in the portable code of [`crate::quant`].
//!
//! The forward pass only ever calls [`Matrix::matvec`] and [`Matrix::dequantize_row`], and only a
//! loader builds a `Matrix`, so faster kernels replace this file's insides without touching either.
//!
//! Invariants, checked once by the constructors: `rows × cols` weights exactly; for the quantized
//! formats `cols` is a multiple of [`BLOCK`] and every scale is finite.

use crate::error::InferError;
use crate::quant::{BLOCK, BlockQ4_1, BlockQ8_0, block_sums, dot_q4_1, dot_q8_0};
#[cfg(target_arch = "x86_64")]
use crate::quant_avx512::Avx512;

/// How a [`Matrix`] stores its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// One `f32` per weight.
    F32,
    /// ggml `Q4_1` blocks: 4-bit codes with a scale and an offset per 32 weights.
    Q4_1,
    /// ggml `Q8_0` blocks: 8-bit codes with a scale per 32 weights.
    Q8_0,
}

/// The rows of a matrix, in one of the formats.
#[derive(Clone, Debug, PartialEq)]
enum Storage {
    /// `rows × cols` floats, row-major.
    F32(Vec<f32>),
    /// `rows × cols / 32` blocks; row `i` is blocks `i·cols/32 ..`.
    Q4_1(Vec<BlockQ4_1>),
    /// `rows × cols / 32` blocks; row `i` is blocks `i·cols/32 ..`.
    Q8_0(Vec<BlockQ8_0>),
}

/// A row-major weight matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Output size.
    rows: usize,
    /// Input size.
    cols: usize,
    /// The weights.
    storage: Storage,
}

impl Matrix {
    /// Wraps `data` as `rows × cols` `f32` weights, row-major. `what` names the tensor in the error.
    pub fn new(what: &str, rows: usize, cols: usize, data: Vec<f32>) -> Result<Self, InferError> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(InferError::WeightShape {
                reason: format!("{what} has {} values, but {rows} × {cols} needs {}", data.len(), rows * cols),
            });
        }
        Ok(Self { rows, cols, storage: Storage::F32(data) })
    }

    /// Wraps `blocks` as `rows × cols` `Q4_1` weights, each row `cols / 32` consecutive blocks.
    pub fn from_q4_1(what: &str, rows: usize, cols: usize, blocks: Vec<BlockQ4_1>) -> Result<Self, InferError> {
        check_blocks(what, rows, cols, blocks.len(), blocks.iter().position(|b| !b.is_finite()))?;
        Ok(Self { rows, cols, storage: Storage::Q4_1(blocks) })
    }

    /// Wraps `blocks` as `rows × cols` `Q8_0` weights, each row `cols / 32` consecutive blocks.
    pub fn from_q8_0(what: &str, rows: usize, cols: usize, blocks: Vec<BlockQ8_0>) -> Result<Self, InferError> {
        check_blocks(what, rows, cols, blocks.len(), blocks.iter().position(|b| !b.is_finite()))?;
        Ok(Self { rows, cols, storage: Storage::Q8_0(blocks) })
    }

    /// Output size.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input size.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// How the weights are stored.
    pub fn format(&self) -> WeightFormat {
        match self.storage {
            Storage::F32(_) => WeightFormat::F32,
            Storage::Q4_1(_) => WeightFormat::Q4_1,
            Storage::Q8_0(_) => WeightFormat::Q8_0,
        }
    }

    /// Bytes the weights occupy in memory.
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(d) => std::mem::size_of_val(d.as_slice()),
            Storage::Q4_1(b) => std::mem::size_of_val(b.as_slice()),
            Storage::Q8_0(b) => std::mem::size_of_val(b.as_slice()),
        }
    }

    /// Writes row `i` as `f32` into `out` (for an embedding table: the vector of token `i`).
    /// Panics if `i >= rows` or `out.len() != cols`; callers check token ids first and size `out`
    /// from the same configuration the matrix was checked against.
    pub fn dequantize_row(&self, i: usize, out: &mut [f32]) {
        assert!(i < self.rows, "row {i} of a matrix with {} rows", self.rows);
        assert_eq!(out.len(), self.cols, "dequantize_row output length");
        let per_row = self.cols / BLOCK;
        match &self.storage {
            Storage::F32(d) => out.copy_from_slice(&d[i * self.cols..][..self.cols]),
            Storage::Q4_1(b) => {
                for (o, block) in out.chunks_exact_mut(BLOCK).zip(&b[i * per_row..][..per_row]) {
                    o.copy_from_slice(&block.dequantize());
                }
            }
            Storage::Q8_0(b) => {
                for (o, block) in out.chunks_exact_mut(BLOCK).zip(&b[i * per_row..][..per_row]) {
                    o.copy_from_slice(&block.dequantize());
                }
            }
        }
    }

    /// `out = self · x`. `x.len()` must be `cols` and `out.len()` must be `rows`; the forward pass
    /// sizes its buffers from the same configuration that [`crate::Model::new`] checked the
    /// matrices against, so a mismatch is a bug, caught by the debug assertions.
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        debug_assert_eq!(x.len(), self.cols, "matvec input length");
        debug_assert_eq!(out.len(), self.rows, "matvec output length");
        match &self.storage {
            Storage::F32(data) => {
                for (o, row) in out.iter_mut().zip(data.chunks_exact(self.cols)) {
                    let mut acc = 0.0f32;
                    for (w, xi) in row.iter().zip(x) {
                        acc += w * xi;
                    }
                    *o = acc;
                }
            }
            Storage::Q4_1(blocks) => {
                let sums = block_sums(x);
                #[cfg(target_arch = "x86_64")]
                if let Some(avx) = Avx512::detect() {
                    return avx.matvec(blocks, x, &sums, out);
                }
                let xb = x.as_chunks::<BLOCK>().0;
                for (o, row) in out.iter_mut().zip(blocks.chunks_exact(self.cols / BLOCK)) {
                    *o = dot_q4_1(row, xb, &sums);
                }
            }
            Storage::Q8_0(blocks) => {
                #[cfg(target_arch = "x86_64")]
                if let Some(avx) = Avx512::detect() {
                    return avx.matvec(blocks, x, &[], out);
                }
                let xb = x.as_chunks::<BLOCK>().0;
                for (o, row) in out.iter_mut().zip(blocks.chunks_exact(self.cols / BLOCK)) {
                    *o = dot_q8_0(row, xb);
                }
            }
        }
    }
}

impl Matrix {
    /// `outs[t] = self · xs[t]` for a batch of inputs: `xs` holds `n` inputs of `cols` one after
    /// another, `outs` their `n` outputs of `rows`. Each output is bit for bit [`Matrix::matvec`]
    /// of its input: the AVX-512 quantized products decode each weight block once for up to eight
    /// inputs (a prompt's tokens) and repeat the matrix–vector arithmetic for each; one input, and
    /// every input elsewhere, is `matvec`.
    pub fn matmul(&self, xs: &[f32], outs: &mut [f32]) {
        debug_assert!(xs.len().is_multiple_of(self.cols), "matmul inputs are whole rows");
        let n = xs.len() / self.cols;
        debug_assert_eq!(outs.len(), n * self.rows, "matmul output length");
        if n == 1 {
            // One input (a decode step): the matrix–vector kernel, which groups rows instead.
            return self.matvec(xs, outs);
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(avx) = Avx512::detect() {
            match &self.storage {
                Storage::F32(_) => {}
                Storage::Q4_1(blocks) => {
                    let sums: Vec<f32> = xs.chunks_exact(self.cols).flat_map(block_sums).collect();
                    return avx.matmul(blocks, self.cols, xs, &sums, outs);
                }
                Storage::Q8_0(blocks) => return avx.matmul(blocks, self.cols, xs, &[], outs),
            }
        }
        for (x, out) in xs.chunks_exact(self.cols).zip(outs.chunks_exact_mut(self.rows)) {
            self.matvec(x, out);
        }
    }
}

/// Checks a block count against `rows × cols` and reports the first non-finite block.
fn check_blocks(
    what: &str,
    rows: usize,
    cols: usize,
    blocks: usize,
    first_non_finite: Option<usize>,
) -> Result<(), InferError> {
    let fail = |reason: String| Err(InferError::WeightShape { reason });
    if cols == 0 || !cols.is_multiple_of(BLOCK) {
        return fail(format!("{what} has {cols} columns, but quantized rows are whole blocks of {BLOCK}"));
    }
    if rows.checked_mul(cols / BLOCK) != Some(blocks) {
        return fail(format!("{what} has {blocks} blocks, but {rows} × {cols} needs {}", rows * (cols / BLOCK)));
    }
    if let Some(i) = first_non_finite {
        return fail(format!(
            "{what} block {i} (row {}, columns {}..{}) has a non-finite scale; the weights are corrupt",
            i / (cols / BLOCK),
            (i % (cols / BLOCK)) * BLOCK,
            (i % (cols / BLOCK) + 1) * BLOCK
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matvec_multiplies_rows_as_outputs() {
        let m = Matrix::new("m", 2, 3, vec![1.0, 2.0, 3.0, -1.0, 0.5, 0.0]).unwrap();
        let mut out = [0.0; 2];
        m.matvec(&[1.0, 1.0, 2.0], &mut out);
        assert_eq!(out, [9.0, -0.5]);
        let mut row = [0.0; 3];
        m.dequantize_row(1, &mut row);
        assert_eq!(row, [-1.0, 0.5, 0.0]);
        assert_eq!((m.format(), m.bytes()), (WeightFormat::F32, 24));
    }

    #[test]
    fn data_of_the_wrong_length_is_rejected_with_the_tensor_name() {
        let msg = Matrix::new("layer 2 wq", 2, 3, vec![0.0; 5]).unwrap_err().to_string();
        assert!(msg.contains("layer 2 wq has 5 values, but 2 × 3 needs 6"), "{msg}");
    }

    /// A 3 × 64 Q4_1 matrix whose weights are easy to write down, and the same as f32.
    fn q4_1_pair() -> (Matrix, Matrix) {
        let blocks: Vec<BlockQ4_1> = (0..6)
            .map(|i| BlockQ4_1 {
                d: 0.25 * (i + 1) as f32,
                m: -(i as f32),
                qs: std::array::from_fn(|j| (j * 17 + i * 5) as u8),
            })
            .collect();
        let dense: Vec<f32> = blocks.iter().flat_map(BlockQ4_1::dequantize).collect();
        (Matrix::from_q4_1("q", 3, 64, blocks).unwrap(), Matrix::new("f", 3, 64, dense).unwrap())
    }

    #[test]
    fn a_quantized_matvec_agrees_with_its_dequantized_f32_twin() {
        let (q, f) = q4_1_pair();
        let x: Vec<f32> = (0..64).map(|i| ((i * 7) % 13) as f32 / 8.0 - 0.75).collect();
        let (mut yq, mut yf) = ([0.0; 3], [0.0; 3]);
        q.matvec(&x, &mut yq);
        f.matvec(&x, &mut yf);
        for (a, b) in yq.iter().zip(&yf) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
        }
        let (mut rq, mut rf) = ([0.0; 64], [0.0; 64]);
        q.dequantize_row(2, &mut rq);
        f.dequantize_row(2, &mut rf);
        assert_eq!(rq, rf);
        assert_eq!((q.format(), q.bytes()), (WeightFormat::Q4_1, 6 * 24));
    }

    #[test]
    fn q8_0_rows_dequantize_block_by_block() {
        let blocks =
            vec![BlockQ8_0 { d: 0.5, qs: std::array::from_fn(|j| j as i8 - 16) }, BlockQ8_0 { d: -2.0, qs: [1; 32] }];
        let m = Matrix::from_q8_0("emb", 1, 64, blocks).unwrap();
        let mut row = [0.0; 64];
        m.dequantize_row(0, &mut row);
        assert_eq!((row[0], row[31], row[32], row[63]), (-8.0, 7.5, -2.0, -2.0));
        let mut y = [0.0];
        m.matvec(&[1.0; 64], &mut y);
        assert_eq!(y[0], (0..32).map(|j| 0.5 * (j as f32 - 16.0)).sum::<f32>() - 64.0);
    }

    #[test]
    fn quantized_shapes_must_be_whole_blocks_and_scales_finite() {
        let block = BlockQ8_0 { d: 1.0, qs: [0; 32] };
        let msg = Matrix::from_q8_0("w", 1, 48, vec![block; 2]).unwrap_err().to_string();
        assert!(msg.contains("w has 48 columns, but quantized rows are whole blocks of 32"), "{msg}");
        let msg = Matrix::from_q8_0("w", 2, 64, vec![block; 3]).unwrap_err().to_string();
        assert!(msg.contains("w has 3 blocks, but 2 × 64 needs 4"), "{msg}");
        let mut blocks = vec![block; 4];
        blocks[3].d = f32::INFINITY;
        let msg = Matrix::from_q8_0("w", 2, 64, blocks).unwrap_err().to_string();
        assert!(msg.contains("w block 3 (row 1, columns 32..64) has a non-finite scale"), "{msg}");
    }
}
