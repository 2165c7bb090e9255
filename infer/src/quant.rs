//! Quantized weight blocks — ggml's `Q4_1` and `Q8_0` — and their dot products with `f32` vectors.
//!
//! Both formats cut a weight row into blocks of [`BLOCK`] = 32 consecutive weights, each with its own
//! scale. In a GGUF file (little-endian, `f16` = IEEE 754 binary16):
//!
//! ```text
//!  Q4_1, 20 bytes per 32 weights                 Q8_0, 34 bytes per 32 weights
//!  +------+------+---------------------+          +------+-------------------------------+
//!  | d    | m    | qs: u8[16]          |          | d    | qs: i8[32]                    |
//!  | f16  | f16  | two 4-bit codes per |          | f16  |                               |
//!  +------+------+---------------------+          +------+-------------------------------+
//!  w[j]    = d · (qs[j] & 15) + m    (j < 16)     w[j] = d · qs[j]    (j < 32)
//!  w[j+16] = d · (qs[j] >> 4) + m
//! ```
//!
//! In memory a block keeps its codes as they are and its scales widened to `f32` ([`f16_to_f32`] is
//! exact), so a matrix–vector product never converts half floats in its inner loop and a block
//! dequantizes to exactly the weights the file encodes. The products dequantize on the fly and
//! multiply in `f32`: a block's 32 products are summed in 16 independent lanes that the compiler
//! keeps in vector registers, and the lanes are added up once per row. The sums are therefore not
//! in left-to-right order, unlike the `f32` path in [`crate::matmul`] that must match llama2.c bit
//! for bit; quantized models have no such reference.
//!
//! For `Q4_1` the offset term is factored out of the block: `Σ_j (d·q_j + m)·x_j =
//! d·Σ_j q_j·x_j + m·Σ_j x_j`, and the block sums of `x` are computed once per product
//! (`block_sums`), not once per row.

/// Weights per block, for both formats.
pub const BLOCK: usize = 32;

/// One `Q4_1` block: 32 four-bit codes with a scale and an offset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4_1 {
    /// The scale `d`.
    pub d: f32,
    /// The offset `m` (the block's minimum).
    pub m: f32,
    /// Codes: the low nibble of byte `j` is weight `j`, the high nibble weight `j + 16`.
    pub qs: [u8; 16],
}

/// One `Q8_0` block: 32 signed eight-bit codes with a scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_0 {
    /// The scale `d`.
    pub d: f32,
    /// Codes: weight `j` is `d · qs[j]`.
    pub qs: [i8; 32],
}

impl BlockQ4_1 {
    /// Bytes of one block in a GGUF file.
    pub const GGUF_BYTES: usize = 20;

    /// Decodes a block as GGUF stores it.
    pub fn from_gguf(bytes: &[u8; Self::GGUF_BYTES]) -> Self {
        let (d, rest) = bytes.split_at(2);
        let (m, qs) = rest.split_at(2);
        Self {
            d: f16_to_f32(u16::from_le_bytes([d[0], d[1]])),
            m: f16_to_f32(u16::from_le_bytes([m[0], m[1]])),
            qs: qs.try_into().expect("20 − 4 bytes of codes"),
        }
    }

    /// The block's 32 weights.
    pub fn dequantize(&self) -> [f32; BLOCK] {
        let mut w = [0.0; BLOCK];
        for (j, &q) in self.qs.iter().enumerate() {
            w[j] = self.d * f32::from(q & 15) + self.m;
            w[j + 16] = self.d * f32::from(q >> 4) + self.m;
        }
        w
    }

    /// Whether both scales are finite numbers.
    pub fn is_finite(&self) -> bool {
        self.d.is_finite() && self.m.is_finite()
    }
}

impl BlockQ8_0 {
    /// Bytes of one block in a GGUF file.
    pub const GGUF_BYTES: usize = 34;

    /// Decodes a block as GGUF stores it.
    pub fn from_gguf(bytes: &[u8; Self::GGUF_BYTES]) -> Self {
        let (d, qs) = bytes.split_at(2);
        let mut codes = [0i8; BLOCK];
        for (c, &b) in codes.iter_mut().zip(qs) {
            *c = i8::from_le_bytes([b]);
        }
        Self { d: f16_to_f32(u16::from_le_bytes([d[0], d[1]])), qs: codes }
    }

    /// The block's 32 weights.
    pub fn dequantize(&self) -> [f32; BLOCK] {
        self.qs.map(|q| self.d * f32::from(q))
    }

    /// Whether the scale is a finite number.
    pub fn is_finite(&self) -> bool {
        self.d.is_finite()
    }
}

/// The exact `f32` value of the IEEE 754 half-precision number with bits `h` (subnormals, infinities
/// and NaNs included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exponent = u32::from((h >> 10) & 0x1f);
    let mantissa = u32::from(h & 0x3ff);
    match exponent {
        // Subnormal (or zero): mantissa × 2^−24, exact in f32.
        0 => sign * (mantissa as f32 * (1.0 / 16_777_216.0)),
        // Infinity or NaN: keep the payload's top bits.
        31 => f32::from_bits((u32::from(h & 0x8000) << 16) | 0x7f80_0000 | (mantissa << 13)),
        // Normal: rebias the exponent from 15 to 127.
        _ => f32::from_bits((u32::from(h & 0x8000) << 16) | ((exponent + 112) << 23) | (mantissa << 13)),
    }
}

/// The sum of each 32-element block of `x`, for [`dot_q4_1`]. `x.len()` is a multiple of
/// [`BLOCK`].
pub(crate) fn block_sums(x: &[f32]) -> Vec<f32> {
    let (blocks, rest) = x.as_chunks::<BLOCK>();
    debug_assert!(rest.is_empty(), "the input is whole blocks");
    blocks
        .iter()
        .map(|b| {
            let mut lanes = [0.0f32; 8];
            for chunk in b.as_chunks::<8>().0 {
                for (l, v) in lanes.iter_mut().zip(chunk) {
                    *l += v;
                }
            }
            lanes.iter().sum()
        })
        .collect()
}

/// `Σ_j w_j · x_j` over one row of `Q4_1` blocks; `x` holds one 32-element block per block of the
/// row, and `sums` their sums ([`block_sums`]).
pub(crate) fn dot_q4_1(row: &[BlockQ4_1], x: &[[f32; BLOCK]], sums: &[f32]) -> f32 {
    debug_assert_eq!(row.len(), x.len(), "one input block per weight block");
    let mut lanes = [0.0f32; 16];
    let mut offsets = 0.0f32;
    for ((block, xb), &sum) in row.iter().zip(x).zip(sums) {
        let (lo, hi) = xb.split_at(16);
        let mut t = [0.0f32; 16];
        for j in 0..16 {
            let q = block.qs[j];
            t[j] = f32::from(q & 15) * lo[j] + f32::from(q >> 4) * hi[j];
        }
        for (l, v) in lanes.iter_mut().zip(t) {
            *l += block.d * v;
        }
        offsets += block.m * sum;
    }
    lanes.iter().sum::<f32>() + offsets
}

/// `Σ_j w_j · x_j` over one row of `Q8_0` blocks; `x` holds one 32-element block per block.
pub(crate) fn dot_q8_0(row: &[BlockQ8_0], x: &[[f32; BLOCK]]) -> f32 {
    debug_assert_eq!(row.len(), x.len(), "one input block per weight block");
    let mut lanes = [0.0f32; 16];
    for (block, xb) in row.iter().zip(x) {
        let (lo, hi) = xb.split_at(16);
        let mut t = [0.0f32; 16];
        for j in 0..16 {
            t[j] = f32::from(block.qs[j]) * lo[j] + f32::from(block.qs[j + 16]) * hi[j];
        }
        for (l, v) in lanes.iter_mut().zip(t) {
            *l += block.d * v;
        }
    }
    lanes.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_half_float_converts_exactly() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h);
            let reference = half::f16::from_bits(h).to_f32();
            if reference.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(ours.to_bits(), reference.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn q4_1_codes_are_low_nibbles_then_high_nibbles() {
        let mut bytes = [0u8; 20];
        bytes[0..2].copy_from_slice(&0x4000u16.to_le_bytes()); // d = 2
        bytes[2..4].copy_from_slice(&0xbc00u16.to_le_bytes()); // m = −1
        bytes[4] = 0x53; // weight 0: code 3, weight 16: code 5
        bytes[19] = 0xf0; // weight 15: code 0, weight 31: code 15
        let w = BlockQ4_1::from_gguf(&bytes).dequantize();
        assert_eq!((w[0], w[16], w[15], w[31], w[1]), (5.0, 9.0, -1.0, 29.0, -1.0));
    }

    #[test]
    fn q8_0_codes_are_signed() {
        let mut bytes = [0u8; 34];
        bytes[0..2].copy_from_slice(&0x3800u16.to_le_bytes()); // d = 0.5
        bytes[2] = 0xff; // −1
        bytes[33] = 0x7f; // 127
        let w = BlockQ8_0::from_gguf(&bytes).dequantize();
        assert_eq!((w[0], w[31], w[1]), (-0.5, 63.5, 0.0));
    }

    /// `Σ dequantized · x` in f64, for comparing with the lane-parallel f32 sums.
    fn reference_dot(weights: &[f32], x: &[f32]) -> f64 {
        weights.iter().zip(x).map(|(w, x)| f64::from(*w) * f64::from(*x)).sum()
    }

    #[test]
    fn quantized_dots_match_the_dequantized_weights() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let blocks = 5;
        let x: Vec<f32> = (0..blocks * BLOCK).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let q4: Vec<BlockQ4_1> = (0..blocks)
            .map(|i| BlockQ4_1 {
                d: 0.01 * (i + 1) as f32,
                m: -0.05 * i as f32,
                qs: std::array::from_fn(|_| next() as u8),
            })
            .collect();
        let q8: Vec<BlockQ8_0> = (0..blocks)
            .map(|i| BlockQ8_0 { d: 0.003 * (i + 1) as f32, qs: std::array::from_fn(|_| next() as i8) })
            .collect();
        let xb = x.as_chunks::<BLOCK>().0;
        let w4: Vec<f32> = q4.iter().flat_map(BlockQ4_1::dequantize).collect();
        let w8: Vec<f32> = q8.iter().flat_map(BlockQ8_0::dequantize).collect();
        let got4 = f64::from(dot_q4_1(&q4, xb, &block_sums(&x)));
        let got8 = f64::from(dot_q8_0(&q8, xb));
        assert!((got4 - reference_dot(&w4, &x)).abs() < 1e-4, "{got4} vs {}", reference_dot(&w4, &x));
        assert!((got8 - reference_dot(&w8, &x)).abs() < 1e-4, "{got8} vs {}", reference_dot(&w8, &x));
    }
}
