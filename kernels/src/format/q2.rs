//! `q2` (format code 5): 2-bit codes for keys and values, four per byte.
//!
//! The layout of [`super::quant`] with `kb = vb = 2`. Code `i` of a row sits at bits
//! `2·(i mod 4)` of byte `i / 4`, lowest first: key row byte `j` = `t(4j) | t(4j+1) << 2 |
//! t(4j+2) << 4 | t(4j+3) << 6`, so a 4-byte load is 16 tokens of one channel. One KV head at
//! `head_dim` D = 64, `block_tokens` B = 32:
//!
//! ```text
//!  K section of head h (768 B)                                    V section of head h (768 B)
//!  +0    d0:(scale,min) ... d63:(scale,min)                256 B   +0    g0, g1: [B] × (scale,min)   256 B
//!  +256  d0 codes: [t3|t2|t1|t0] ... [t31|t30|t29|t28]       8 B   +256  t0 codes: [d3|d2|d1|d0] ... 16 B
//!  ...                                                             ...
//!  +760  d63 codes                                           8 B   +752  t31 codes                   16 B
//! ```
//!
//! Metadata: 1 bit per element, as large as half the codes; 3.04 bits per element for a whole
//! SmolLM2 page, header included.

#[cfg(test)]
mod tests {
    use crate::format::quant::QuantLayout;
    use crate::format::quant::test_pages::quantized;
    use crate::format::{Format, PageShape};

    #[test]
    fn q2_packs_four_codes_per_byte_lowest_first() {
        let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 8 };
        // Key at token t is t mod 4 (min 0, scale 1); value channel d is 3 − d mod 4.
        let k: Vec<f32> = (0..8).flat_map(|t| [(t % 4) as f32; 16]).collect();
        let v: Vec<f32> = (0..8).flat_map(|_| (0..16).map(|d| (3 - d % 4) as f32)).collect();
        let page = quantized(shape, Format::Q2, &k, &v);
        let q = QuantLayout::new(shape, Format::Q2).unwrap();
        let row = q.k_codes(0) + 9 * q.k_row_bytes();
        assert_eq!(&page[row..row + 2], &[0b11_10_01_00, 0b11_10_01_00]);
        let row = q.v_codes(0) + 7 * q.v_row_bytes();
        assert_eq!(&page[row..row + 4], &[0b00_01_10_11; 4]);
    }
}
