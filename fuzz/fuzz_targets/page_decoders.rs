//! Page decoders over arbitrary bytes: a page in shared memory can hold anything (a client of the same
//! uid can write over it), so every reader must reject a bad header, format byte, version or length
//! with an error and never read out of bounds or panic. The first bytes choose a geometry, a format
//! and a token count; the rest is the page as found in memory, often with a valid header (so the
//! decoders behind the header check are reached too).

#![no_main]

use kvmm_kernels::format::{Format, PageShape};
use kvmm_kernels::{
    AttnShape, DecodeAttention, PageHeader, PageView, dequantize, dequantize_page, key_bounds, requantize, select_pages,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [a, b, c, d, rest @ ..] = data else { return };
    let shape = PageShape {
        kv_heads: 1 + usize::from(a & 3),
        head_dim: 16 * (1 + usize::from((a >> 2) & 3)),
        block_tokens: 8 << (b & 3),
    };
    let format = Format::ALL[usize::from(b >> 2) % Format::ALL.len()];
    let tokens = 1 + usize::from(*c) % shape.block_tokens;
    // Half of the inputs get a well-formed header for their shape, so the bodies are decoded too.
    let mut page = rest.to_vec();
    if d & 1 == 1 {
        let size = shape.page_bytes(format);
        page.resize(size, 0);
        if let Ok(h) = PageHeader::new(shape, format, if format.is_quantized() { tokens } else { 0 }) {
            page[..64].copy_from_slice(&h.encode());
        }
    }
    let _ = PageHeader::decode(&page);
    let _ = PageHeader::validate(shape, format, &page);

    let n = tokens * shape.kv_heads * shape.head_dim;
    let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
    let _ = dequantize(shape, format, &page, tokens, &mut k, &mut v);
    // Back to a 16-bit page (both element types), and one step further down, as Compress does.
    for to in [Format::F16, Format::Bf16] {
        let mut back = vec![0u8; shape.page_bytes(to)];
        let _ = dequantize_page(shape, format, &page, tokens, to, &mut back);
    }
    let mut lower = vec![0u8; shape.page_bytes(Format::Q2)];
    let _ = requantize(shape, Format::F16, format, &page, tokens, Format::Q2, &mut lower);
    let (mut lo, mut hi) = (vec![0f32; shape.kv_heads * shape.head_dim], vec![0f32; shape.kv_heads * shape.head_dim]);
    let _ = key_bounds(shape, format, &page, &mut lo, &mut hi);

    let attn = AttnShape {
        q_heads: shape.kv_heads * 2,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        block_tokens: shape.block_tokens,
    };
    let q = vec![0.25f32; attn.q_heads * attn.head_dim];
    let view = PageView { bytes: &page, format, tokens };
    let _ = select_pages(attn, &q, 0.125, &[view, view, view, view], 3);
    if let Ok(mut state) = DecodeAttention::new(attn, &q, 0.125)
        && state.page(view).is_ok()
    {
        let mut out = vec![0f32; q.len()];
        let mut mass = [0f32; 1];
        let _ = state.write_output(&mut out, &mut mass);
    }
});
