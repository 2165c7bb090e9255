//! `q4` (format code 4): 4-bit codes for keys and values, two per byte.
//!
//! The layout of [`super::quant`] with `kb = vb = 4`. The low nibble holds the even token (keys)
//! or the even channel (values): key row byte `i` = `t(2i) | t(2i+1) << 4`, so an 8-byte load is 16
//! tokens of one channel. One KV head at `head_dim` D = 64, `block_tokens` B = 32:
//!
//! ```text
//!  K section of head h (1280 B)                          V section of head h (1280 B)
//!  +0     d0:(scale,min) ... d63:(scale,min)      256 B   +0    g0: t0 ... t31 (scale,min)     128 B
//!  +256   d0 codes: [t1|t0] [t3|t2] ... [t31|t30]  16 B         g1: t0 ... t31 (scale,min)     128 B
//!  +272   d1 codes                                 16 B   +256  t0 codes: [d1|d0] ... [d63|d62] 32 B
//!  ...                                                    ...
//!  +1264  d63 codes                                16 B   +1248 t31 codes                       32 B
//!         ([hi|lo] = one byte, high nibble | low nibble)
//! ```
//!
//! Metadata: 1 bit per element (32 bits per key channel per 32 tokens, 32 bits per 32 value
//! channels per token); 5.04 bits per element for a whole SmolLM2 page, header included.

#[cfg(test)]
mod tests {
    use crate::format::quant::QuantLayout;
    use crate::format::quant::test_pages::quantized;
    use crate::format::{Format, PageShape};

    #[test]
    fn q4_low_nibble_holds_the_even_token_and_the_even_channel() {
        let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 16 };
        // Key channel d at token t is t (min 0, scale 1, code t); value channel d is d (code d).
        let k: Vec<f32> = (0..16).flat_map(|t| [t as f32; 16]).collect();
        let v: Vec<f32> = (0..16).flat_map(|_| (0..16).map(|d| d as f32)).collect();
        let page = quantized(shape, Format::Q4, &k, &v);
        let q = QuantLayout::new(shape, Format::Q4).unwrap();
        assert_eq!(q.k_row_bytes(), 8);
        let row = q.k_codes(0) + 7 * q.k_row_bytes();
        assert_eq!(&page[row..row + 8], &[0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe]);
        let row = q.v_codes(0) + 2 * q.v_row_bytes();
        assert_eq!(&page[row..row + 8], &[0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe]);
        assert_eq!(&page[q.v_param(0, 0, 2)..q.v_param(0, 0, 2) + 4], &[0x00, 0x3c, 0x00, 0x00]);
    }
}
