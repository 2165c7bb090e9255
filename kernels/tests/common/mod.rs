//! Shared fixtures for the kernel tests: random K/V, pages built from them in any format, and
//! comparisons.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use kvmm_kernels::{
    AttnShape, Format, Isa, PageShape, PageView, QuantLayout, dequantize, init_page, quantize_with, write_rows,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// A sequence of `tokens` tokens stored in pages, plus the dense rows it came from.
pub struct Paged {
    pub shape: AttnShape,
    /// Format of each page.
    pub formats: Vec<Format>,
    pub tokens: usize,
    /// One buffer per page, each exactly `page_bytes` of its format long.
    pub pages: Vec<Vec<u8>>,
    /// Filled tokens of each page.
    pub filled: Vec<usize>,
    /// Dense keys and values as stored (rounded through or reconstructed from each page's format),
    /// token-major.
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

/// Random K/V rows in `[-2, 2)` for `tokens` tokens.
pub fn random_rows(shape: AttnShape, tokens: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let row = shape.kv_heads * shape.head_dim;
    let k: Vec<f32> = (0..tokens * row).map(|_| rng.random_range(-2.0..2.0)).collect();
    let v: Vec<f32> = (0..tokens * row).map(|_| rng.random_range(-2.0..2.0)).collect();
    (k, v)
}

/// One page of `format` holding `k`, `v` (token-major rows, at most `block_tokens` tokens), whose
/// bytes outside what the format writes are `fill`: 16-bit pages are initialized and written row
/// by row; quantized pages are quantized from an f16 page (`quantize` writes every byte).
pub fn make_page(shape: PageShape, format: Format, k: &[f32], v: &[f32], rng: &mut StdRng, fill: Fill) -> Vec<u8> {
    let mut page: Vec<u8> = (0..shape.page_bytes(format)).map(|_| fill.byte(rng)).collect();
    if format.is_quantized() {
        let src = make_page(shape, Format::F16, k, v, rng, fill);
        let tokens = k.len() / (shape.kv_heads * shape.head_dim);
        quantize_with(Isa::Scalar, shape, Format::F16, &src, tokens, format, &mut page).expect("quantizable rows");
    } else {
        init_page(shape, format, &mut page).expect("valid shape");
        write_rows(shape, format, &mut page, 0, k, v).expect("rows fit the page");
    }
    page
}

impl Paged {
    /// Random K/V in `[-2, 2)` for `tokens` tokens, written into pages of `format` whose unfilled
    /// slots hold `fill` bytes.
    pub fn random(shape: AttnShape, format: Format, tokens: usize, seed: u64, fill: Fill) -> Paged {
        Paged::random_mixed(shape, &[format], tokens, seed, fill)
    }

    /// Like [`Paged::random`], page `i` in `formats[i % formats.len()]`.
    pub fn random_mixed(shape: AttnShape, formats: &[Format], tokens: usize, seed: u64, fill: Fill) -> Paged {
        let (k, v) = random_rows(shape, tokens, seed);
        Paged::from_rows_mixed(shape, formats, &k, &v, seed ^ 0x5eed, fill)
    }

    pub fn from_rows(shape: AttnShape, format: Format, raw_k: &[f32], raw_v: &[f32], seed: u64, fill: Fill) -> Paged {
        Paged::from_rows_mixed(shape, &[format], raw_k, raw_v, seed, fill)
    }

    pub fn from_rows_mixed(
        shape: AttnShape,
        formats: &[Format],
        raw_k: &[f32],
        raw_v: &[f32],
        seed: u64,
        fill: Fill,
    ) -> Paged {
        let layout = shape.page_shape();
        let row = shape.kv_heads * shape.head_dim;
        let tokens = raw_k.len() / row;
        let block = shape.block_tokens;
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut pages, mut filled, mut page_formats) = (Vec::new(), Vec::new(), Vec::new());
        let mut keys = vec![0.0; raw_k.len()];
        let mut values = vec![0.0; raw_v.len()];
        for (i, first) in (0..tokens).step_by(block).enumerate() {
            let format = formats[i % formats.len()];
            let n = block.min(tokens - first);
            let span = first * row..(first + n) * row;
            let page = make_page(layout, format, &raw_k[span.clone()], &raw_v[span.clone()], &mut rng, fill);
            dequantize(layout, format, &page, n, &mut keys[span.clone()], &mut values[span])
                .expect("the page holds n tokens");
            pages.push(page);
            filled.push(n);
            page_formats.push(format);
        }
        Paged { shape, formats: page_formats, tokens, pages, filled, keys, values }
    }

    pub fn views(&self) -> Vec<PageView<'_>> {
        self.pages
            .iter()
            .zip(&self.filled)
            .zip(&self.formats)
            .map(|((bytes, &tokens), &format)| PageView { bytes, format, tokens })
            .collect()
    }

    /// Overwrites every unfilled slot (K and V; for quantized pages their codes and value
    /// parameters) with bytes from `fill`.
    pub fn refill_unfilled(&mut self, fill: Fill, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        let layout: PageShape = self.shape.page_shape();
        for ((page, &n), &format) in self.pages.iter_mut().zip(&self.filled).zip(&self.formats) {
            if format.is_quantized() {
                refill_quantized(layout, format, page, n, fill, &mut rng);
                continue;
            }
            for t in n..layout.block_tokens {
                for h in 0..layout.kv_heads {
                    for d in 0..layout.head_dim {
                        for at in [layout.k_byte(h, d, t), layout.v_byte(h, t, d)] {
                            let bits = fill.element(&mut rng);
                            page[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                        }
                    }
                }
            }
        }
    }
}

/// Sets code `i` of the row at `row` (`bits` wide) to the low bits of `c`.
fn set_code(page: &mut [u8], row: usize, i: usize, bits: usize, c: u8) {
    let (at, shift) = (row + i * bits / 8, (i * bits) % 8);
    let mask = (((1u16 << bits) - 1) as u8) << shift;
    page[at] = (page[at] & !mask) | ((c << shift) & mask);
}

/// Garbage in the codes and value parameters of slots `n..` of a quantized page, which encodes `n`
/// slots (its header says so), so these slots are unfilled.
fn refill_quantized(shape: PageShape, format: Format, page: &mut [u8], n: usize, fill: Fill, rng: &mut StdRng) {
    let q = QuantLayout::new(shape, format).expect("quantized format");
    for h in 0..shape.kv_heads {
        for t in n..shape.block_tokens {
            for d in 0..shape.head_dim {
                let byte = fill.byte(rng);
                set_code(page, q.k_codes(h) + d * q.k_row_bytes(), t, q.k_bits, byte);
                let byte = fill.byte(rng);
                set_code(page, q.v_codes(h) + t * q.v_row_bytes(), d, q.v_bits, byte);
            }
            for g in 0..q.v_groups() {
                let at = q.v_param(h, g, t);
                let (a, b) = (fill.element(rng), fill.element(rng));
                page[at..at + 2].copy_from_slice(&a.to_le_bytes());
                page[at + 2..at + 4].copy_from_slice(&b.to_le_bytes());
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
    pub fn byte(self, rng: &mut StdRng) -> u8 {
        match self {
            Fill::Zero => 0,
            Fill::Random | Fill::Poison => rng.random(),
        }
    }

    pub fn element(self, rng: &mut StdRng) -> u16 {
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
