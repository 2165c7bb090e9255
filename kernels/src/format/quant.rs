//! Quantized pages: the layout they share, the rounding rule, and conversion from and to 16-bit.
//!
//! A quantized page stores every element as a `b`-bit code `c` of a group with `f16` parameters
//! `(scale, min)`, asymmetric: `x ≈ min + scale × c`. Keys are grouped per channel along the page's
//! tokens (one group per KV head and channel, `block_tokens` long), values per token along channels
//! in groups of [`V_GROUP`] = 32 (the KIVI layout: outliers live in key channels, so a key channel
//! gets its own range). `head_dim ≤ 32` is a single value group per token; a `head_dim` that is not
//! a multiple of 32 ends with one 16-channel group. Per-token groups of 32 rather than one group per
//! whole token row: the same at `head_dim ≤ 32`, and at 64 or 128 it costs the same 1 bit per
//! element of metadata as the keys while bounding the error of each 32 channels by their own range.
//!
//! The formats differ only in code widths ([`super::q8`], [`super::q4`], [`super::q2`],
//! [`super::k8v4`], each with its byte diagram). Every section is per KV head, parameters first:
//!
//! ```text
//!  offset 0        64                                                    v_offset (64-aligned)
//!  +--------------+-----------------------------------------------------+------------------------------------------+
//!  | header 64 B  | K section, per KV head h:                           | V section, per KV head h:                |
//!  | tokens = n   |   params [D] × (scale f16, min f16)       4·D bytes |   params [G][B] × (scale f16, min f16)   |
//!  |              |   codes  [D][B] at kb bits, channel-major           |          (group-major: 16 tokens of one  |
//!  |              |          (row d = channel d's B tokens,             |           group are 64 contiguous bytes) |
//!  |              |           B·kb/8 bytes per row)                     |   codes  [B][D] at vb bits, token-major  |
//!  +--------------+-----------------------------------------------------+------------------------------------------+
//!  H = kv_heads, D = head_dim, B = block_tokens, G = ceil(D / 32), kb / vb = key / value code bits
//!  page_bytes = round_up(v_offset + H·(4·G·B + B·D·vb/8), 64)
//! ```
//!
//! Inside a row of codes, code `i` sits in byte `i·b / 8` at bit `(i·b) mod 8`: the lowest bits hold
//! the even token (keys) or even channel (values), as in ggml's q4.
//!
//! **Rounding** (ggml q4_1-style, pinned by tests). For a group with smallest value `m` and largest
//! `M` (filled tokens only), with `L = 2^b − 1`:
//!
//! - `min` = `m` rounded to f16 toward −∞;
//! - `scale` = `(M − min) / L` rounded to f16 toward +∞, i.e. the smallest f16 with
//!   `min + scale·L ≥ M` exactly, so the stored parameters bound the group;
//! - `inv = 1 / scale` in f32 (0 when `scale` = 0), `code = min(L, floor((x − min)·inv + 0.5))` in
//!   f32 without fused operations (round half up, as ggml's `(int)(x + 0.5f)`), so codes lie in
//!   `0..=L`;
//! - reconstruction is `min + scale·code` in f32; the product is exact (11 × 8 bits), so this is
//!   the one rounding of the sum, whichever way a kernel associates it.
//!
//! Both zeros count as +0 (`m` and `M` are normalized with `+ 0.0` first), so parameters never
//! depend on which zero a reduction kept. A constant group (`M == m`) gets `scale = 0` and all codes 0 and is reconstructed exactly (from
//! f16 sources). NaN, ±∞ and finite values beyond ±65504 (possible in bf16 sources) cannot be
//! bounded by f16 parameters: [`quantize`] refuses the page with [`KernelError::Unquantizable`],
//! naming the first such element, and leaves the destination without a valid header. Token slots at
//! or past the encoded count have codes and value parameters 0 and are never read.

use half::f16;

use crate::attention::Isa;
use crate::error::KernelError;
use crate::format::header::{HEADER_BYTES, PageHeader};
use crate::format::read::PageReader;
use crate::format::rows::decode;
use crate::format::{Format, PageShape};

/// Channels per value group.
pub const V_GROUP: usize = 32;

/// Largest magnitude a quantized page can hold: the largest finite f16, since parameters are f16.
pub const MAX_QUANTIZED: f32 = 65504.0;

/// Where the parameters and codes of a quantized page live (byte offsets from the page start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantLayout {
    /// The page's shape.
    pub shape: PageShape,
    /// Key code bits.
    pub k_bits: usize,
    /// Value code bits.
    pub v_bits: usize,
    /// Byte offset of the V section.
    pub v_offset: usize,
}

impl QuantLayout {
    /// The layout of `format` pages of `shape`; `format` must be quantized and `shape` pass
    /// [`PageShape::check_format`].
    pub fn new(shape: PageShape, format: Format) -> Result<QuantLayout, KernelError> {
        if !format.is_quantized() {
            return Err(KernelError::UnsupportedFormat { code: format.as_u8() });
        }
        shape.check_format(format)?;
        Ok(QuantLayout::of_checked(shape, format))
    }

    /// [`QuantLayout::new`] for a quantized `format` and a shape that passed
    /// [`PageShape::check_format`] for it (a page header check does both), without checking again.
    pub(crate) const fn of_checked(shape: PageShape, format: Format) -> QuantLayout {
        QuantLayout {
            shape,
            k_bits: format.k_bits() as usize,
            v_bits: format.v_bits() as usize,
            v_offset: shape.v_offset(format),
        }
    }

    /// Value groups per token: `ceil(head_dim / 32)`.
    pub const fn v_groups(&self) -> usize {
        self.shape.head_dim.div_ceil(V_GROUP)
    }

    /// Bytes of one channel's key codes (one row of `block_tokens` codes).
    pub const fn k_row_bytes(&self) -> usize {
        self.shape.block_tokens * self.k_bits / 8
    }

    /// Bytes of one token's value codes (one row of `head_dim` codes).
    pub const fn v_row_bytes(&self) -> usize {
        self.shape.head_dim * self.v_bits / 8
    }

    /// Bytes of one KV head's K section (parameters and codes).
    pub const fn k_head_bytes(&self) -> usize {
        4 * self.shape.head_dim + self.shape.head_dim * self.k_row_bytes()
    }

    /// Bytes of one KV head's V section (parameters and codes).
    pub const fn v_head_bytes(&self) -> usize {
        4 * self.v_groups() * self.shape.block_tokens + self.shape.block_tokens * self.v_row_bytes()
    }

    /// Offset of KV head `h`'s key parameters: `head_dim` pairs `(scale, min)`.
    pub const fn k_params(&self, h: usize) -> usize {
        HEADER_BYTES + h * self.k_head_bytes()
    }

    /// Offset of KV head `h`'s key codes: `head_dim` rows of [`QuantLayout::k_row_bytes`].
    pub const fn k_codes(&self, h: usize) -> usize {
        self.k_params(h) + 4 * self.shape.head_dim
    }

    /// Offset of KV head `h`'s value parameters: `v_groups × block_tokens` pairs, group-major.
    pub const fn v_params(&self, h: usize) -> usize {
        self.v_offset + h * self.v_head_bytes()
    }

    /// Offset of KV head `h`'s value codes: `block_tokens` rows of [`QuantLayout::v_row_bytes`].
    pub const fn v_codes(&self, h: usize) -> usize {
        self.v_params(h) + 4 * self.v_groups() * self.shape.block_tokens
    }

    /// Offset of the `(scale, min)` pair of key channel `d` of head `h`.
    pub const fn k_param(&self, h: usize, d: usize) -> usize {
        self.k_params(h) + 4 * d
    }

    /// Offset of the `(scale, min)` pair of value group `g` of head `h` at token `t`.
    pub const fn v_param(&self, h: usize, g: usize, t: usize) -> usize {
        self.v_params(h) + 4 * (g * self.shape.block_tokens + t)
    }
}

/// The parameters of one group, as stored, plus the reciprocal the encoder multiplies by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GroupParams {
    /// Step between codes; 0 for a constant group.
    pub scale: f16,
    /// Value of code 0.
    pub min: f16,
    /// `1 / scale` in f32, or 0 when `scale` is 0.
    pub inv: f32,
}

/// `x` rounded to f16 toward −∞ (`x` finite and within ±65504).
pub(crate) fn f16_down(x: f32) -> f16 {
    let r = f16::from_f32(x);
    if r.to_f32() <= x {
        return r;
    }
    let bits = r.to_bits();
    // One step toward −∞: down in magnitude for positives, up in magnitude for negatives and −0.
    if bits & 0x8000 == 0 {
        if bits == 0 { f16::from_bits(0x8001) } else { f16::from_bits(bits - 1) }
    } else {
        f16::from_bits(bits + 1)
    }
}

/// The rounding rule of the module documentation for a group with smallest value `lo` and largest
/// `hi` (finite, within ±65504, `lo ≤ hi`) and `levels = 2^b − 1`.
pub(crate) fn group_params(lo: f32, hi: f32, levels: u32) -> GroupParams {
    // + 0.0 turns −0.0 into +0.0 and changes nothing else, so the parameters do not depend on which
    // zero a min or max reduction happened to keep.
    let (lo, hi) = (lo + 0.0, hi + 0.0);
    let min = f16_down(lo);
    let (m, top, n) = (f64::from(min.to_f32()), f64::from(hi), f64::from(levels));
    // Exact in f64: min and scale·n are multiples of 2^-24 below 2^17, and hi is an f32.
    let covers = |s: f16| m + f64::from(s.to_f32()) * n >= top;
    let mut scale = f16::from_f64(((top - m) / n).max(0.0));
    if covers(scale) {
        while scale.to_bits() > 0 {
            let below = f16::from_bits(scale.to_bits() - 1);
            if !covers(below) {
                break;
            }
            scale = below;
        }
    } else {
        // (hi − min) / levels ≤ 131008 / 3 < 65504, so a finite scale always covers.
        while !covers(scale) && scale.to_bits() < 0x7bff {
            scale = f16::from_bits(scale.to_bits() + 1);
        }
    }
    let inv = if scale.to_bits() == 0 { 0.0 } else { 1.0 / scale.to_f32() };
    GroupParams { scale, min, inv }
}

/// Quantizes one group of values in place with the rounding rule of the module documentation at
/// `bits` bits (1..=8) and replaces each value by its reconstruction `min + scale × code`: exactly
/// what a page of this family would hold for the group. For simulating other groupings (e.g.
/// per-token keys) with the same rule. Values must be finite and within ±65504.
pub fn round_trip_group(values: &mut [f32], bits: u32) {
    debug_assert!((1..=8).contains(&bits));
    if values.is_empty() {
        return;
    }
    let levels = (1u32 << bits) - 1;
    let lo = values.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let p = group_params(lo, hi, levels);
    let (scale, min) = (p.scale.to_f32(), p.min.to_f32());
    for x in values.iter_mut() {
        *x = min + scale * f32::from(encode(*x, &p, levels));
    }
}

/// The code of `x` in a group with parameters `p` (see the module documentation).
#[inline]
pub(crate) fn encode(x: f32, p: &GroupParams, levels: u32) -> u8 {
    let c = ((x - p.min.to_f32()) * p.inv + 0.5).floor();
    // `as` saturates: a NaN (impossible after validation) would give 0, never an out-of-range code.
    (c as u32).min(levels) as u8
}

/// Reads code `i` of a row of `bits`-bit codes starting at `row`.
#[inline]
pub(crate) fn get_code(bytes: &[u8], row: usize, i: usize, bits: usize) -> u32 {
    let bit = i * bits;
    u32::from(bytes[row + bit / 8] >> (bit % 8)) & ((1 << bits) - 1)
}

/// ORs code `c` into slot `i` of a row of `bits`-bit codes starting at `row` (the slot must be 0).
#[inline]
fn put_code(bytes: &mut [u8], row: usize, i: usize, bits: usize, c: u8) {
    let bit = i * bits;
    bytes[row + bit / 8] |= c << (bit % 8);
}

/// Reads the `(scale, min)` pair at `at` as f32.
#[inline]
pub(crate) fn get_params(bytes: &[u8], at: usize) -> (f32, f32) {
    let scale = f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]]));
    let min = f16::from_bits(u16::from_le_bytes([bytes[at + 2], bytes[at + 3]]));
    (scale.to_f32(), min.to_f32())
}

fn put_params(bytes: &mut [u8], at: usize, p: &GroupParams) {
    bytes[at..at + 2].copy_from_slice(&p.scale.to_bits().to_le_bytes());
    bytes[at + 2..at + 4].copy_from_slice(&p.min.to_bits().to_le_bytes());
}

/// Checks the arguments of [`quantize`]; returns the destination layout.
fn check_quantize(
    shape: PageShape,
    from: Format,
    src: &[u8],
    tokens: usize,
    to: Format,
    dst_len: usize,
) -> Result<QuantLayout, KernelError> {
    if from.is_quantized() || !to.is_quantized() {
        return Err(KernelError::QuantizePair { from, to });
    }
    PageHeader::validate(shape, from, src)?;
    shape.check_page(to, dst_len)?;
    if tokens == 0 || tokens > shape.block_tokens {
        return Err(KernelError::PageTokens { page: 0, tokens, block_tokens: shape.block_tokens });
    }
    Ok(QuantLayout::of_checked(shape, to))
}

/// Quantizes the first `tokens` token slots of the 16-bit page `src` (format `from`, f16 or bf16)
/// into a whole page of the quantized format `to` in `dst` (header, parameters, codes; every other
/// byte of `dst[..page_bytes(to)]` zero). Lossy and one-way.
///
/// On error `dst` holds no valid page: its header is zero (validation errors leave `dst`
/// untouched; a refused value is found after `dst` was cleared). Runs the best kernel of this CPU;
/// [`quantize_with`] chooses one.
pub fn quantize(
    shape: PageShape,
    from: Format,
    src: &[u8],
    tokens: usize,
    to: Format,
    dst: &mut [u8],
) -> Result<(), KernelError> {
    quantize_with(Isa::detect(), shape, from, src, tokens, to, dst)
}

/// [`quantize`] with a chosen kernel (for tests and benchmarks); every kernel writes the same bytes.
pub fn quantize_with(
    isa: Isa,
    shape: PageShape,
    from: Format,
    src: &[u8],
    tokens: usize,
    to: Format,
    dst: &mut [u8],
) -> Result<(), KernelError> {
    if !isa.is_available() {
        return Err(KernelError::IsaUnavailable { isa: isa.name() });
    }
    let layout = check_quantize(shape, from, src, tokens, to, dst.len())?;
    let dst = &mut dst[..shape.page_bytes(to)];
    dst.fill(0);
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() && shape.block_tokens.is_multiple_of(16) {
        // SAFETY: `isa` passed `is_available`, so avx512f/bw/vl, avx2, fma and f16c were detected;
        // `check_quantize` checked both pages' lengths, the token count and (through the layout)
        // head_dim; block_tokens is a multiple of 16 and `dst` was just zeroed.
        let done = unsafe { super::quant_avx512::quantize(&layout, from, src, tokens, dst) };
        if done.is_ok() {
            dst[..HEADER_BYTES].copy_from_slice(&PageHeader::expected(shape, to, tokens).encode());
            return Ok(());
        }
        // An element cannot be quantized: the scalar pass below finds and names it.
        dst.fill(0);
    }
    quantize_scalar(&layout, from, src, tokens, dst)?;
    dst[..HEADER_BYTES].copy_from_slice(&PageHeader::expected(shape, to, tokens).encode());
    Ok(())
}

/// The error for the first element of a group that cannot be quantized, if any.
pub(crate) fn refuse(
    which: &'static str,
    value: f32,
    token: usize,
    head: usize,
    channel: usize,
    to: Format,
) -> KernelError {
    KernelError::Unquantizable { which, value, token, head, channel, to }
}

/// Whether `x` can be stored in a quantized page.
#[inline]
pub(crate) fn quantizable(x: f32) -> bool {
    x.abs() <= MAX_QUANTIZED
}

/// The scalar quantizer, the reference for the SIMD ones. `dst` is zeroed, `page_bytes` long.
fn quantize_scalar(
    layout: &QuantLayout,
    from: Format,
    src: &[u8],
    tokens: usize,
    dst: &mut [u8],
) -> Result<(), KernelError> {
    let shape = layout.shape;
    let to = format_of(layout);
    let (kb, vb) = (layout.k_bits, layout.v_bits);
    let (k_levels, v_levels) = ((1u32 << kb) - 1, (1u32 << vb) - 1);
    let element = |at: usize| decode(from, u16::from_le_bytes([src[at], src[at + 1]]));
    for h in 0..shape.kv_heads {
        for d in 0..shape.head_dim {
            let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
            for t in 0..tokens {
                let x = element(shape.k_byte(h, d, t));
                if !quantizable(x) {
                    return Err(refuse("key", x, t, h, d, to));
                }
                lo = lo.min(x);
                hi = hi.max(x);
            }
            let p = group_params(lo, hi, k_levels);
            put_params(dst, layout.k_param(h, d), &p);
            let row = layout.k_codes(h) + d * layout.k_row_bytes();
            for t in 0..tokens {
                put_code(dst, row, t, kb, encode(element(shape.k_byte(h, d, t)), &p, k_levels));
            }
        }
        for t in 0..tokens {
            let row = layout.v_codes(h) + t * layout.v_row_bytes();
            for g in 0..layout.v_groups() {
                let channels = g * V_GROUP..((g + 1) * V_GROUP).min(shape.head_dim);
                let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
                for d in channels.clone() {
                    let x = element(shape.v_byte(h, t, d));
                    if !quantizable(x) {
                        return Err(refuse("value", x, t, h, d, to));
                    }
                    lo = lo.min(x);
                    hi = hi.max(x);
                }
                let p = group_params(lo, hi, v_levels);
                put_params(dst, layout.v_param(h, g, t), &p);
                for d in channels {
                    put_code(dst, row, d, vb, encode(element(shape.v_byte(h, t, d)), &p, v_levels));
                }
            }
        }
    }
    Ok(())
}

/// The quantized format with `layout`'s code widths.
pub(crate) fn format_of(layout: &QuantLayout) -> Format {
    match (layout.k_bits, layout.v_bits) {
        (8, 8) => Format::Q8,
        (8, 4) => Format::K8V4,
        (4, _) => Format::Q4,
        _ => Format::Q2,
    }
}

/// Decodes the first `tokens` token slots of a page of any format into `f32` rows, token-major
/// (`k_out[(t × kv_heads + h) × head_dim + d]`, as [`crate::format::rows::write_rows`] takes them).
///
/// The header is checked against `shape` and `format`; a quantized page must encode at least
/// `tokens` slots. For 16-bit pages this equals [`crate::format::rows::read_rows`] from slot 0.
/// Runs the best kernel of this CPU; [`dequantize_with`] chooses one.
pub fn dequantize(
    shape: PageShape,
    format: Format,
    page: &[u8],
    tokens: usize,
    k_out: &mut [f32],
    v_out: &mut [f32],
) -> Result<(), KernelError> {
    dequantize_with(Isa::detect(), shape, format, page, tokens, k_out, v_out)
}

/// Re-encodes the first `tokens` slots of a page of any format as the lower format `to`: decodes it,
/// writes the values into a `via` page (f16 or bf16, the session's element type, so this is the same
/// rounding a freshly written page gets), and quantizes that. Used to step a quantized page further
/// down (q8 → q4 → q2); a 16-bit source is quantized directly. `to` must have fewer bits than `from`.
pub fn requantize(
    shape: PageShape,
    via: Format,
    from: Format,
    src: &[u8],
    tokens: usize,
    to: Format,
    dst: &mut [u8],
) -> Result<(), KernelError> {
    if !from.is_quantized() {
        return quantize(shape, from, src, tokens, to, dst);
    }
    if via.is_quantized() || !to.is_quantized() || to.k_bits() + to.v_bits() >= from.k_bits() + from.v_bits() {
        return Err(KernelError::QuantizePair { from, to });
    }
    let mut page = vec![0u8; shape.page_bytes(via)];
    crate::format::to_page::dequantize_page(shape, from, src, tokens, via, &mut page)?;
    quantize(shape, via, &page, tokens, to, dst)
}

/// [`dequantize`] with a chosen kernel (for tests and benchmarks); every kernel gives the same bits.
pub fn dequantize_with(
    isa: Isa,
    shape: PageShape,
    format: Format,
    page: &[u8],
    tokens: usize,
    k_out: &mut [f32],
    v_out: &mut [f32],
) -> Result<(), KernelError> {
    if !isa.is_available() {
        return Err(KernelError::IsaUnavailable { isa: isa.name() });
    }
    let header = PageHeader::validate(shape, format, page)?;
    if tokens > shape.block_tokens {
        return Err(KernelError::TokenRange { first: 0, count: tokens, block_tokens: shape.block_tokens });
    }
    if format.is_quantized() && tokens > usize::from(header.tokens) {
        return Err(KernelError::EncodedTokens { tokens, encoded: usize::from(header.tokens), format });
    }
    let need = tokens * shape.kv_heads * shape.head_dim;
    if k_out.len() != need {
        return Err(KernelError::BufferLength {
            what: "k_out (tokens × kv_heads × head_dim)", got: k_out.len(), need
        });
    }
    if v_out.len() != need {
        return Err(KernelError::BufferLength {
            what: "v_out (tokens × kv_heads × head_dim)", got: v_out.len(), need
        });
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni && format.is_quantized() && shape.block_tokens.is_multiple_of(16) {
        let layout = QuantLayout::of_checked(shape, format);
        // SAFETY: `isa` passed `is_available`, so avx512f/bw/vl/vbmi, avx2, fma and f16c were
        // detected; the header check fixed the page's length for `layout`, the output lengths and
        // the token count were checked above, and block_tokens is a multiple of 16.
        unsafe { super::dequant_vbmi::dequantize(&layout, page, tokens, k_out, v_out) };
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() && format.is_quantized() && shape.block_tokens.is_multiple_of(16) {
        let layout = QuantLayout::of_checked(shape, format);
        // SAFETY: `isa` passed `is_available`, so avx512f/bw/vl, avx2, fma and f16c were detected;
        // the header check fixed the page's length for `layout`, the output lengths and the token
        // count were checked above, and block_tokens is a multiple of 16.
        unsafe { super::quant_avx512::dequantize(&layout, page, tokens, k_out, v_out) };
        return Ok(());
    }
    let reader = PageReader::new(shape, format, page);
    let (heads, dim) = (shape.kv_heads, shape.head_dim);
    for t in 0..tokens {
        for h in 0..heads {
            let row = (t * heads + h) * dim;
            for d in 0..dim {
                k_out[row + d] = reader.key(h, d, t);
                v_out[row + d] = reader.value(h, t, d);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(x: f16) -> u16 {
        x.to_bits()
    }

    #[test]
    fn min_rounds_toward_negative_infinity() {
        assert_eq!(f16_down(1.0), f16::ONE);
        // 1 + 2^-11 lies between 1 and 1 + 2^-10: down to 1.
        assert_eq!(f16_down(1.0 + 2f32.powi(-11)), f16::ONE);
        // −(1 + 2^-11): down to −(1 + 2^-10).
        assert_eq!(bits(f16_down(-1.0 - 2f32.powi(-11))), 0xbc01);
        // A tiny negative value goes to the smallest negative subnormal, not to −0.
        assert_eq!(bits(f16_down(-1e-10)), 0x8001);
        assert_eq!(bits(f16_down(1e-10)), 0);
        assert_eq!(f16_down(-65504.0).to_f32(), -65504.0);
    }

    #[test]
    fn scale_is_the_smallest_f16_whose_range_covers_the_max() {
        for &(lo, hi, levels) in &[(0.0f32, 1.0f32, 15u32), (-1.3, 2.7, 255), (-0.001, 0.002, 3), (5.0, 5.5, 15)] {
            let p = group_params(lo, hi, levels);
            let top = |s: f16| f64::from(p.min.to_f32()) + f64::from(s.to_f32()) * f64::from(levels);
            assert!(top(p.scale) >= f64::from(hi), "{lo} {hi} {levels}");
            let below = f16::from_bits(p.scale.to_bits() - 1);
            assert!(top(below) < f64::from(hi), "{lo} {hi} {levels}: scale not minimal");
        }
        // 0..=15 in 15 steps is exactly scale 1.
        let p = group_params(0.0, 15.0, 15);
        assert_eq!((p.scale, p.min, p.inv), (f16::ONE, f16::ZERO, 1.0));
    }

    #[test]
    fn codes_round_half_up_and_saturate() {
        let p = group_params(0.0, 15.0, 15);
        assert_eq!(encode(0.49, &p, 15), 0);
        assert_eq!(encode(0.5, &p, 15), 1);
        assert_eq!(encode(1.5, &p, 15), 2);
        assert_eq!(encode(2.5, &p, 15), 3);
        assert_eq!(encode(15.0, &p, 15), 15);
        assert_eq!(encode(400.0, &p, 15), 15);
    }

    #[test]
    fn constant_group_has_zero_scale_and_zero_codes() {
        let p = group_params(-3.25, -3.25, 255);
        assert_eq!(p.scale.to_bits(), 0);
        assert_eq!(p.min.to_f32(), -3.25);
        assert_eq!(p.inv, 0.0);
        assert_eq!(encode(-3.25, &p, 255), 0);
    }

    #[test]
    fn codes_pack_low_bits_first() {
        let mut nibbles = [0u8; 2];
        put_code(&mut nibbles, 0, 0, 4, 0x3);
        put_code(&mut nibbles, 0, 1, 4, 0xa);
        put_code(&mut nibbles, 0, 2, 4, 0x5);
        assert_eq!(nibbles, [0xa3, 0x05]);
        assert_eq!(get_code(&nibbles, 0, 1, 4), 0xa);
        let mut crumbs = [0u8; 2];
        for (i, c) in [1u8, 2, 3, 0, 2].into_iter().enumerate() {
            put_code(&mut crumbs, 0, i, 2, c);
        }
        assert_eq!(crumbs, [0b00_11_10_01, 0b10]);
        assert_eq!(get_code(&crumbs, 0, 2, 2), 3);
    }
}

/// Pages for the unit tests of the per-format files.
#[cfg(test)]
pub(crate) mod test_pages {
    use super::*;
    use crate::format::header::init_page;
    use crate::format::rows::write_rows;

    /// An f16 page of one KV head holding `k` and `v` (token-major rows), quantized to `to`.
    pub fn quantized(shape: PageShape, to: Format, k: &[f32], v: &[f32]) -> Vec<u8> {
        let mut src = vec![0u8; shape.page_bytes(Format::F16)];
        init_page(shape, Format::F16, &mut src).expect("valid shape");
        write_rows(shape, Format::F16, &mut src, 0, k, v).expect("rows fit");
        let tokens = k.len() / (shape.kv_heads * shape.head_dim);
        let mut dst = vec![0xffu8; shape.page_bytes(to)];
        quantize_with(Isa::Scalar, shape, Format::F16, &src, tokens, to, &mut dst).expect("quantizable");
        dst
    }
}
