//! `q8` (format code 3): 8-bit codes for keys and values.
//!
//! The layout of [`super::quant`] with `kb = vb = 8`: one byte per code, so a key row is
//! `block_tokens` bytes (one 16-byte load = 16 tokens of one channel) and a value row `head_dim`
//! bytes. One KV head at `head_dim` D = 64, `block_tokens` B = 32:
//!
//! ```text
//!  K section of head h (2304 B)                         V section of head h (2304 B)
//!  +0     d0:(scale,min) d1:(scale,min) ... d63  256 B   +0    g0: t0 t1 ... t31 (scale,min)   128 B
//!  +256   d0 codes: t0 t1 ... t31 (1 B each)      32 B         g1: t0 t1 ... t31 (scale,min)   128 B
//!  +288   d1 codes: t0 ... t31                    32 B   +256  t0 codes: d0 d1 ... d63 (1 B each) 64 B
//!  ...                                                   ...
//!  +2272  d63 codes                               32 B   +2240 t31 codes                        64 B
//! ```
//!
//! Metadata: 32 bits per key channel per 32 tokens and 32 bits per 32 value channels per token,
//! 1 bit per element; 9.04 bits per element for a whole SmolLM2 page (3 KV heads), header included.

#[cfg(test)]
mod tests {
    use crate::format::quant::QuantLayout;
    use crate::format::quant::test_pages::quantized;
    use crate::format::{Format, PageShape};

    #[test]
    fn q8_codes_are_one_byte_per_token_and_channel() {
        let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 16 };
        // Key channel d at token t is 17·t, so min 0, scale 1, code 17·t; value channel d is d − 8.
        let k: Vec<f32> = (0..16).flat_map(|t| [17.0 * t as f32; 16]).collect();
        let v: Vec<f32> = (0..16).flat_map(|_| (0..16).map(|d| d as f32 - 8.0)).collect();
        let page = quantized(shape, Format::Q8, &k, &v);
        let q = QuantLayout::new(shape, Format::Q8).unwrap();
        assert_eq!(&page[q.k_param(0, 3)..q.k_param(0, 3) + 4], &[0x00, 0x3c, 0x00, 0x00]); // scale 1, min 0
        let row = q.k_codes(0) + 3 * q.k_row_bytes();
        assert_eq!(&page[row..row + 3], &[0, 17, 34]);
        assert_eq!(page[row + 15], 255);
        // Values: min −8 (0xc800), scale 15/255 rounded up; channel 0 → code 0, channel 15 → 255.
        let at = q.v_param(0, 0, 5);
        assert_eq!(&page[at + 2..at + 4], &[0x00, 0xc8]);
        let row = q.v_codes(0) + 5 * q.v_row_bytes();
        assert_eq!((page[row], page[row + 15]), (0, 255));
    }
}
