//! Shared fixtures for the kernel tests: random K/V, pages built from them, and comparisons.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use kvmm_kernels::{AttnShape, Format, PageShape, PageView, read_rows, write_rows};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// A sequence of `tokens` tokens stored in pages, plus the dense rows it came from.
pub struct Paged {
    pub shape: AttnShape,
    pub format: Format,
    pub tokens: usize,
    /// One buffer per page, each exactly `page_bytes` long.
    pub pages: Vec<Vec<u8>>,
    /// Filled tokens of each page.
    pub filled: Vec<usize>,
    /// Dense keys and values as stored (rounded through the format), token-major.
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

impl Paged {
    /// Random K/V in `[-2, 2)` for `tokens` tokens, written into pages whose unfilled slots hold
    /// `fill` bytes.
    pub fn random(shape: AttnShape, format: Format, tokens: usize, seed: u64, fill: Fill) -> Paged {
        let mut rng = StdRng::seed_from_u64(seed);
        let row = shape.kv_heads * shape.head_dim;
        let raw_k: Vec<f32> = (0..tokens * row).map(|_| rng.random_range(-2.0..2.0)).collect();
        let raw_v: Vec<f32> = (0..tokens * row).map(|_| rng.random_range(-2.0..2.0)).collect();
        Paged::from_rows(shape, format, &raw_k, &raw_v, seed ^ 0x5eed, fill)
    }

    pub fn from_rows(shape: AttnShape, format: Format, raw_k: &[f32], raw_v: &[f32], seed: u64, fill: Fill) -> Paged {
        let layout = shape.page_shape();
        let row = shape.kv_heads * shape.head_dim;
        let tokens = raw_k.len() / row;
        let block = shape.block_tokens;
        let bytes = layout.page_bytes(format);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut pages = Vec::new();
        let mut filled = Vec::new();
        let mut keys = vec![0.0; raw_k.len()];
        let mut values = vec![0.0; raw_v.len()];
        for first in (0..tokens).step_by(block) {
            let n = block.min(tokens - first);
            let mut page: Vec<u8> = (0..bytes).map(|_| fill.byte(&mut rng)).collect();
            let span = first * row..(first + n) * row;
            write_rows(layout, format, &mut page, 0, &raw_k[span.clone()], &raw_v[span.clone()])
                .expect("rows fit the page");
            read_rows(layout, format, &page, 0, &mut keys[span.clone()], &mut values[span]).expect("rows fit the page");
            pages.push(page);
            filled.push(n);
        }
        Paged { shape, format, tokens, pages, filled, keys, values }
    }

    pub fn views(&self) -> Vec<PageView<'_>> {
        self.pages
            .iter()
            .zip(&self.filled)
            .map(|(bytes, &tokens)| PageView { bytes, format: self.format, tokens })
            .collect()
    }

    /// Overwrites every unfilled slot (K and V) with bytes from `fill`.
    pub fn refill_unfilled(&mut self, fill: Fill, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        let layout: PageShape = self.shape.page_shape();
        for (page, &n) in self.pages.iter_mut().zip(&self.filled) {
            for t in n..layout.block_tokens {
                for h in 0..layout.kv_heads {
                    for d in 0..layout.head_dim {
                        for index in [layout.k_index(h, d, t), layout.v_index(h, t, d)] {
                            let bits = fill.element(&mut rng);
                            page[2 * index..2 * index + 2].copy_from_slice(&bits.to_le_bytes());
                        }
                    }
                }
            }
        }
    }
}

/// What unfilled slots hold.
#[derive(Clone, Copy, Debug)]
pub enum Fill {
    Zero,
    /// Random bytes.
    Random,
    /// A mix of NaN, ±infinity, huge finite values and random bits, per element.
    Poison,
}

impl Fill {
    fn byte(self, rng: &mut StdRng) -> u8 {
        match self {
            Fill::Zero => 0,
            Fill::Random | Fill::Poison => rng.random(),
        }
    }

    fn element(self, rng: &mut StdRng) -> u16 {
        match self {
            Fill::Zero => 0,
            Fill::Random => rng.random(),
            Fill::Poison => {
                const PATTERNS: [u16; 8] = [0x7e00, 0xfe00, 0x7c00, 0xfc00, 0x7fff, 0xffff, 0x7bff, 0x7f80];
                if rng.random_range(0..4) == 0 { rng.random() } else { PATTERNS[rng.random_range(0..PATTERNS.len())] }
            }
        }
    }
}

pub fn random_query(shape: AttnShape, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (0..shape.q_heads * shape.head_dim).map(|_| rng.random_range(-2.0..2.0)).collect()
}

/// Largest `|a − b|` in each head's row, relative to the largest `|b|` of that row (at least 1e-3,
/// so rows of near-zero outputs are compared absolutely). A NaN on either side counts as infinite.
pub fn worst_row_error(a: &[f32], b: &[f32], head_dim: usize) -> f64 {
    a.chunks(head_dim)
        .zip(b.chunks(head_dim))
        .map(|(ra, rb)| {
            let norm = rb.iter().fold(1e-3f64, |m, x| m.max(x.abs() as f64));
            let diff = ra
                .iter()
                .zip(rb)
                .map(|(x, y)| (*x as f64 - *y as f64).abs())
                .fold(0.0f64, |m, e| if e.is_nan() { f64::INFINITY } else { m.max(e) });
            diff / norm
        })
        .fold(0.0, f64::max)
}
