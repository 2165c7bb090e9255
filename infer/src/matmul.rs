//! The matrix–vector seam: [`Matrix`] holds a weight matrix, [`Matrix::matvec`] applies it.
//!
//! Weights are row-major with rows as outputs (`y = W·x`, `W[out][in]`), the layout of llama2.c and
//! GGUF alike. Today the storage is plain `f32` and the product is a plain loop that accumulates each
//! row left to right in `f32`, exactly as llama2.c `run.c` does, so results match it bit for bit.
//! SIMD and quantized (Q8_0, Q4_K, ...) versions replace this file's insides later: the forward
//! pass only ever calls [`Matrix::matvec`] and [`Matrix::row`], and only a loader builds a `Matrix`.
//!
//! Invariant: `data.len() == rows × cols`, checked once by [`Matrix::new`].

use crate::error::InferError;

/// A dense row-major weight matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

impl Matrix {
    /// Wraps `data` as `rows × cols`, row-major. `what` names the tensor in the error.
    pub fn new(what: &str, rows: usize, cols: usize, data: Vec<f32>) -> Result<Self, InferError> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(InferError::WeightShape {
                reason: format!("{what} has {} values, but {rows} × {cols} needs {}", data.len(), rows * cols),
            });
        }
        Ok(Self { rows, cols, data })
    }

    /// Output size.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input size.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `i` (for an embedding table: the vector of token `i`). Panics if `i >= rows`; callers
    /// check token ids first.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..][..self.cols]
    }

    /// `out = self · x`. `x.len()` must be `cols` and `out.len()` must be `rows`; the forward pass
    /// sizes its buffers from the same configuration that [`crate::Model::new`] checked the
    /// matrices against, so a mismatch is a bug, caught by the debug assertions.
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        debug_assert_eq!(x.len(), self.cols, "matvec input length");
        debug_assert_eq!(out.len(), self.rows, "matvec output length");
        for (o, row) in out.iter_mut().zip(self.data.chunks_exact(self.cols)) {
            let mut acc = 0.0f32;
            for (w, xi) in row.iter().zip(x) {
                acc += w * xi;
            }
            *o = acc;
        }
    }
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
        assert_eq!(m.row(1), &[-1.0, 0.5, 0.0]);
    }

    #[test]
    fn data_of_the_wrong_length_is_rejected_with_the_tensor_name() {
        let msg = Matrix::new("layer 2 wq", 2, 3, vec![0.0; 5]).unwrap_err().to_string();
        assert!(msg.contains("layer 2 wq has 5 values, but 2 × 3 needs 6"), "{msg}");
    }
}
