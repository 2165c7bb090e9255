//! `k8v4` (format code 7): 8-bit key codes, 4-bit value codes.
//!
//! The layout of [`super::quant`] with `kb = 8`, `vb = 4`: the K section of [`super::q8`] and the V
//! section of [`super::q4`]. Keys never get fewer bits than values: score errors pass through the
//! softmax exponential, value errors only average, so at about 7 bits per element this loses far
//! less than the reverse split. One KV head at `head_dim` D = 64, `block_tokens` B = 32:
//!
//! ```text
//!  K section of head h (2304 B)                     V section of head h (1280 B)
//!  +0     d0 .. d63: (scale,min)           256 B    +0    g0, g1: [B] × (scale,min)          256 B
//!  +256   d0 codes: t0 ... t31 (1 B each)   32 B    +256  t0 codes: [d1|d0] ... [d63|d62]     32 B
//!  ...                                              ...
//!  +2272  d63 codes                         32 B    +1248 t31 codes                           32 B
//! ```
//!
//! 7.04 bits per element for a whole SmolLM2 page, header included.

#[cfg(test)]
mod tests {
    use crate::format::quant::QuantLayout;
    use crate::format::quant::test_pages::quantized;
    use crate::format::{Format, PageShape};

    #[test]
    fn k8v4_has_byte_keys_and_nibble_values() {
        let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 16 };
        let k: Vec<f32> = (0..16).flat_map(|t| [17.0 * t as f32; 16]).collect();
        let v: Vec<f32> = (0..16).flat_map(|_| (0..16).map(|d| d as f32)).collect();
        let page = quantized(shape, Format::K8V4, &k, &v);
        let q = QuantLayout::new(shape, Format::K8V4).unwrap();
        assert_eq!((q.k_row_bytes(), q.v_row_bytes()), (16, 8));
        let row = q.k_codes(0);
        assert_eq!(&page[row..row + 3], &[0, 17, 34]);
        let row = q.v_codes(0) + 15 * q.v_row_bytes();
        assert_eq!(&page[row..row + 2], &[0x10, 0x32]);
    }
}
