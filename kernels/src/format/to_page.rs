//! Dequantizing a quantized page straight into a 16-bit page of the same shape.
//!
//! [`dequantize_page`] writes what [`init_page`] followed by [`write_rows`] of the page's decoded rows
//! would leave in a zeroed buffer: the header of an empty 16-bit page, each element `min + scale ×
//! code` rounded to nearest-even in the element type, the key bounds of the filled slots, zeros in
//! the unfilled slots and in the padding. Both layouts keep keys channel-major and values
//! token-major, so a key channel is one row in and one row out, with no transpose and no `f32` rows
//! in between: this is the path [`super::quant::requantize`] takes (q8 → 16-bit → q4).
//!
//! The AVX-512 path (f16 output, `block_tokens` a multiple of 16): per key channel, 16 codes at a
//! time are widened, turned into `min + scale × code` with one FMA (the product is exact, so this is
//! the scalar rounding), rounded to f16 by `vcvtps2ph` and stored; the channel's bounds are the
//! rounded smallest and largest filled value (rounding is monotonic, so this is the smallest and
//! largest stored element; NaN is skipped, as [`write_rows`] skips it), eight channels' bounds
//! reduced at once by a transposing reduction. Values: the parameters of 16 tokens of a group are
//! decoded at once, each token's pair broadcast from memory, and the same FMA and rounding run
//! over the token's codes; for 4- and 2-bit codes they run once per group and code value instead
//! (a table of 16 rounded values), and the group's 32 codes pick from it with one `vpermw`.
//!
//! Keys of pages of 32 token slots (the default) take a shorter path when a head's key parameters
//! are finite with non-negative scales, as the quantizer writes them: then an element never
//! decreases with its code, so a channel's bounds are the rounded values of its smallest and largest
//! filled code, found on the code bytes themselves (byte minima and maxima, folded 16 channels at a
//! time by a transposing reduction) instead of on every decoded element, and 4- and 2-bit key
//! channels are decoded by table as the values are. To a page, against the general path (ad70e6e),
//! both measured in one sitting on 2026-12-02 (`KVMM_BENCH_DEQUANTIZE=smollm2/q4 cargo bench -p
//! kvmm-kernels --bench quantize`, best of 3 s; the new code in two runs, which differ by the
//! machine's noise): SmolLM2 pages q4 6.21 → 9.70–9.92 G elements/s, q8 6.69 → 10.21, q2 6.73 →
//! 11.80–11.83, k8v4 6.65 → 10.02–10.05; Llama-3-8B q4 6.99 → 12.51–12.55, q8 7.29 → 11.03–11.06,
//! q2 7.16 → 12.98–13.06, k8v4 7.19 → 11.19–11.54 (with the page geometry's offsets inlined).
//! The reduction's lane order (`fold_order`) is a compile-time constant: computed at run time it
//! became two scatters whose result was loaded at once, per KV head (SmolLM2 q4 9.5–9.7 → 11.2–11.6,
//! Llama-3-8B q4 12.5 → 13.8, one sitting on 2026-12-02).
//!
//! Other outputs (bf16) and shapes take the reference path, which is the definition.
//!
//! A call checks the shape once (the source header's check) rather than three times, and a valid
//! header costs one 64-byte compare ([`PageHeader::validate`]'s fast path): to a page, one sitting
//! on 2026-12-06 (`KVMM_BENCH_DEQUANTIZE=smollm2/q8 cargo bench -p kvmm-kernels --bench quantize`,
//! base and new binaries alternated, two runs each), SmolLM2 q8 10.36–10.39 → 10.64–10.70 G
//! elements/s, k8v4 10.09 → 10.42–10.45, Llama-3-8B q8 11.10–11.21 → 11.16–11.20 (unchanged: its
//! pages are five times larger). What is left is the conversions themselves: in the keys of a q8
//! page, most samples fall on the stores that wait for `vcvtps2ph`.
//!
//! Memory safety of the AVX-512 path rests on the checks of [`dequantize_page_with`]: the source
//! header fixed its format and shape (so every offset [`crate::QuantLayout`] computes lies inside it), and
//! the destination holds at least `page_bytes(to)`.
//!
//! [`init_page`]: super::header::init_page
//! [`write_rows`]: super::rows::write_rows

use crate::attention::Isa;
use crate::error::KernelError;
use crate::format::header::{PageHeader, init_page};
use crate::format::quant::dequantize_with;
use crate::format::rows::write_rows;
use crate::format::{Format, PageShape};

/// Dequantizes the first `tokens` slots of the quantized page `src` (format `from`) into `dst` as a
/// 16-bit page of format `to` (f16 or bf16) and the same shape. `dst` must hold at least
/// `shape.page_bytes(to)` bytes; only those are written. See the [module](self) documentation.
pub fn dequantize_page(
    shape: PageShape,
    from: Format,
    src: &[u8],
    tokens: usize,
    to: Format,
    dst: &mut [u8],
) -> Result<(), KernelError> {
    dequantize_page_with(Isa::detect(), shape, from, src, tokens, to, dst)
}

/// [`dequantize_page`] with a chosen kernel (for tests and benchmarks); every kernel gives the same
/// bytes.
pub fn dequantize_page_with(
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
    if !from.is_quantized() {
        return Err(KernelError::UnsupportedFormat { code: from.as_u8() });
    }
    if to.is_quantized() {
        return Err(KernelError::NotRowWritable { format: to });
    }
    let header = PageHeader::validate(shape, from, src)?;
    if tokens > usize::from(header.tokens) {
        return Err(KernelError::EncodedTokens { tokens, encoded: usize::from(header.tokens), format: from });
    }
    // The header check validated the shape for `from`, which covers every rule of a 16-bit `to`.
    shape.check_len(to, dst.len())?;
    let dst = &mut dst[..shape.page_bytes(to)];
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() && to == Format::F16 && shape.block_tokens.is_multiple_of(16) {
        let layout = crate::format::quant::QuantLayout::of_checked(shape, from);
        // SAFETY: `isa` passed `is_available`, so avx512f/bw/vl, avx2, fma and f16c were detected;
        // the header check fixed the source's length for `layout`, `dst` is exactly one f16 page of
        // `shape`, `tokens ≤ block_tokens` (the header's count is at most that), and block_tokens is
        // a multiple of 16.
        unsafe { avx512::to_f16_page(&layout, src, tokens, dst) };
        return Ok(());
    }
    let n = tokens * shape.kv_heads * shape.head_dim;
    let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
    dequantize_with(isa, shape, from, src, tokens, &mut k, &mut v)?;
    dst.fill(0);
    init_page(shape, to, dst)?;
    write_rows(shape, to, dst, 0, &k, &v)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::attention::avx512::{MAX, MIN, reduce_lanes};
    use crate::attention::avx512_quant::{codes16, interleave, params16};
    use crate::format::Format;
    use crate::format::header::PageHeader;
    use crate::format::quant::{QuantLayout, V_GROUP};

    const LANES: usize = 16;
    /// `vcvtps2ph` rounding: to nearest-even, exceptions suppressed.
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// The f16 page of `layout`'s shape holding the first `tokens` slots of the quantized `src`.
    ///
    /// # Safety
    ///
    /// The CPU must support avx512f, avx512bw, avx512vl, avx2, fma and f16c; `src` passed the header
    /// check for `layout`'s shape and format; `dst.len() == page_bytes(F16)`; `tokens ≤
    /// block_tokens`, a multiple of 16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn to_f16_page(layout: &QuantLayout, src: &[u8], tokens: usize, dst: &mut [u8]) {
        // SAFETY: same contract.
        unsafe {
            match (layout.k_bits, layout.v_bits) {
                (8, 8) => page::<8, 8>(layout, src, tokens, dst),
                (4, 4) => page::<4, 4>(layout, src, tokens, dst),
                (2, 2) => page::<2, 2>(layout, src, tokens, dst),
                (8, 4) => page::<8, 4>(layout, src, tokens, dst),
                _ => unreachable!("QuantLayout only describes the quantized formats"),
            }
        }
    }

    /// The 32 `B`-bit codes (`B` 4 or 2) at `src`, in order, as 16-bit lanes: indices for a table
    /// of the group's values.
    ///
    /// # Safety
    ///
    /// `src` must be valid for reading `4 × B` bytes; the CPU must support the enabled features.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn codes32<const B: usize>(src: *const u8) -> __m512i {
        if B == 4 {
            // Byte k holds codes 2k (low nibble) and 2k + 1: as dword k, the low nibble stays in
            // word 2k's low bits and the high nibble moves to word 2k + 1's.
            // SAFETY: the caller guarantees 16 readable bytes.
            let d = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(src.cast()) });
            _mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32::<12>(d)), _mm512_set1_epi32(0x000f_000f))
        } else {
            // Byte k holds codes 4k .. 4k + 3, two bits each, lowest first: as qword k, code 4k + i
            // moves to word 4k + i's low bits.
            // SAFETY: the caller guarantees 8 readable bytes.
            let q = _mm512_cvtepu8_epi64(unsafe { _mm_loadl_epi64(src.cast()) });
            let words = _mm512_or_si512(
                _mm512_or_si512(q, _mm512_slli_epi64::<14>(q)),
                _mm512_or_si512(_mm512_slli_epi64::<28>(q), _mm512_slli_epi64::<42>(q)),
            );
            _mm512_and_si512(words, _mm512_set1_epi16(0x3))
        }
    }

    /// Whether every key parameter pair of head `h` has a finite minimum and a finite, non-negative
    /// scale: then `min + scale × code`, rounded, never decreases with the code, so a channel's
    /// smallest and largest element are those of its smallest and largest code ([`keys_block32`]).
    ///
    /// # Safety
    ///
    /// `src` passed the header check for `layout`'s shape; `head_dim` a multiple of 16; the CPU must
    /// support the enabled features.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn monotonic_keys(layout: &QuantLayout, src: *const u8, h: usize) -> bool {
        let dim = layout.shape.head_dim;
        let infinity = _mm512_set1_ps(f32::INFINITY);
        for c0 in (0..dim).step_by(LANES) {
            // SAFETY: pairs `c0 .. c0 + 16 ≤ dim` of head `h`, inside the source's K section.
            let (scale, min) = unsafe { params16(src.add(layout.k_param(h, c0))) };
            // Ordered comparisons: false for NaN.
            let scale_ok = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(scale, _mm512_setzero_ps())
                & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(scale, infinity);
            let min_ok = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(min), infinity);
            if scale_ok & min_ok != 0xffff {
                return false;
            }
        }
        true
    }

    /// The row whose result [`fold_rows`] leaves in dword `d`, for rows of `row` bytes (see there).
    const fn fold_row(row: usize, d: usize) -> usize {
        let (lane, m, s) = (d / 4, (d / 2) % 2, d % 2);
        if row == 8 { 8 * s + 2 * lane + m } else { 8 * s + 4 * m + lane }
    }

    /// `vpermd` indices that put [`fold_rows`]'s results in row order: lane `k` takes the dword
    /// holding row `k`.
    const fn fold_order(row: usize) -> [u32; 16] {
        let mut order = [0u32; 16];
        let mut d = 0;
        while d < 16 {
            order[fold_row(row, d)] = d as u32;
            d += 1;
        }
        order
    }

    /// The smallest (`MAX` false) or largest byte of each of 16 rows of `row` bytes (32, 16 or 8)
    /// held back to back in the first `16 × row / 64` vectors of `v` (clobbered), as the low byte
    /// of dword [`fold_order`]`(row)[k]` for row `k`, the other bytes zero. A transposing
    /// reduction: each operation folds bytes of several rows at once (rows of 32 bytes: pairs of
    /// vectors to four 16-byte rows per vector; of 16: to two 8-byte rows per 128-bit lane; then
    /// the two vectors left into one, four bytes per row, and within each dword).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    fn fold_rows<const MAX: bool>(v: &mut [__m512i; 8], row: usize) -> __m512i {
        let op = |a: __m512i, b: __m512i| if MAX { _mm512_max_epu8(a, b) } else { _mm512_min_epu8(a, b) };
        if row == 32 {
            // Vector i: rows 2i, 2i + 1 → rows 4i .. 4i + 4, one per 128-bit lane.
            for i in 0..4 {
                let (a, b) = (v[2 * i], v[2 * i + 1]);
                v[i] = op(_mm512_shuffle_i64x2::<0b10_00_10_00>(a, b), _mm512_shuffle_i64x2::<0b11_01_11_01>(a, b));
            }
        }
        if row >= 16 {
            // Vector i: rows 8i + L (lane L, qword 0) and 8i + 4 + L (qword 1).
            for i in 0..2 {
                let (x, y) = (v[2 * i], v[2 * i + 1]);
                v[i] = op(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y));
            }
        }
        // Each qword one row: fold it to its dwords, then take vector 0's in even dwords and
        // vector 1's in odd ones.
        let (z, w) = (v[0], v[1]);
        let z = op(z, _mm512_shuffle_epi32::<0xb1>(z));
        let w = op(w, _mm512_shuffle_epi32::<0xb1>(w));
        let x = _mm512_mask_blend_epi32(0xaaaa, z, w);
        let x = op(x, _mm512_srli_epi32::<16>(x));
        let x = op(x, _mm512_srli_epi16::<8>(x));
        _mm512_and_si512(x, _mm512_set1_epi32(0xff))
    }

    /// Keys and key bounds of head `h` for `KB`-bit codes and `block_tokens` 32, `1 ≤ tokens ≤ 32`,
    /// on [`monotonic_keys`]. A channel's elements: for 4- and 2-bit codes, the `2^KB` values of its
    /// codes rounded once (a table, as for the values) and its 32 codes looked up with one `vpermw`;
    /// for 8-bit codes, `min + scale × code` per element. Its bounds: the rounded values of its
    /// smallest and largest filled code (the table never decreases), found on the codes themselves,
    /// `64 / row` channels per vector, and evaluated 16 channels at once. The bytes are those of the
    /// general path: the same `f32` products, rounded the same way.
    ///
    /// # Safety
    ///
    /// As for [`page`], with `monotonic_keys(layout, src, h)`, `KB`-bit keys, `block_tokens` 32 and
    /// `1 ≤ tokens ≤ 32`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn keys_block32<const KB: usize>(
        layout: &QuantLayout,
        src: *const u8,
        dst: *mut u8,
        h: usize,
        tokens: usize,
    ) {
        // Bytes per channel row; codes per byte; rows per vector.
        let row = 4 * KB;
        let per_byte = 8 / KB;
        let vectors = LANES * row / 64;
        let shape = layout.shape;
        let dim = shape.head_dim;
        let (bounds_at, k_at) = (shape.bounds_offset(Format::F16), shape.k_offset(Format::F16));
        let iota = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let filled: __mmask32 = ((1u64 << tokens) - 1) as __mmask32;
        let (filled_lo, filled_hi): (__mmask16, __mmask16) =
            ((filled & 0xffff) as __mmask16, (filled >> 16) as __mmask16);
        // Field `j` of byte `b` of a vector holds the token `(b mod row) × per_byte + j` of its row.
        let mut field_filled = [0 as __mmask64; 4];
        for (j, mask) in field_filled.iter_mut().enumerate().take(per_byte) {
            for b in 0..64 {
                if (b % row) * per_byte + j < tokens {
                    *mask |= 1 << b;
                }
            }
        }
        // A code's bits, which is also the largest code.
        let field = _mm512_set1_epi8(((1u32 << KB) - 1) as i8);
        let codes_at = layout.k_codes(h);
        let order = const { fold_order(4 * KB) };
        // SAFETY: 16 dwords.
        let order = unsafe { _mm512_loadu_si512(order.as_ptr().cast()) };
        for c0 in (0..dim).step_by(LANES) {
            // SAFETY: pairs `c0 .. c0 + 16 ≤ dim` of head `h`; code rows `c0 .. c0 + 16` of its K
            // codes (`row` bytes each, `vectors` loads of 64 bytes); K elements `(h, c0 .. c0 + 16,
            // 0..32)` and bound pairs `(h, c0 .. c0 + 16)` of `dst`.
            unsafe {
                let (scale, min) = params16(src.add(layout.k_param(h, c0)));
                let (mut scales, mut mins) = ([0.0f32; LANES], [0.0f32; LANES]);
                _mm512_storeu_ps(scales.as_mut_ptr(), scale);
                _mm512_storeu_ps(mins.as_mut_ptr(), min);
                for k in 0..LANES {
                    let c = c0 + k;
                    let (s, m) = (_mm512_set1_ps(scales[k]), _mm512_set1_ps(mins[k]));
                    let codes = src.add(codes_at + c * row);
                    let out = dst.add(k_at + 2 * (h * dim + c) * 32);
                    if KB == 8 {
                        let first = _mm512_maskz_mov_ps(filled_lo, _mm512_fmadd_ps(codes16::<8>(codes), s, m));
                        let second = _mm512_maskz_mov_ps(filled_hi, _mm512_fmadd_ps(codes16::<8>(codes.add(16)), s, m));
                        _mm256_storeu_si256(out.cast(), _mm512_cvtps_ph::<NEAREST>(first));
                        _mm256_storeu_si256(out.add(32).cast(), _mm512_cvtps_ph::<NEAREST>(second));
                    } else {
                        let table = _mm512_castsi256_si512(_mm512_cvtps_ph::<NEAREST>(_mm512_fmadd_ps(iota, s, m)));
                        let x = _mm512_maskz_permutexvar_epi16(filled, codes32::<KB>(codes), table);
                        _mm512_storeu_si512(out.cast(), x);
                    }
                }
                // The smallest and largest filled code of each row: unfilled codes count as the
                // largest code for the smallest and 0 for the largest.
                let (mut least, mut most) = ([_mm512_setzero_si512(); 8], [_mm512_setzero_si512(); 8]);
                for q in 0..vectors {
                    let x = _mm512_loadu_si512(src.add(codes_at + c0 * row + 64 * q).cast());
                    let (mut lo, mut hi) = (field, _mm512_setzero_si512());
                    for (j, &mask) in field_filled.iter().enumerate().take(per_byte) {
                        let f = match j {
                            0 if KB == 8 => x,
                            0 => _mm512_and_si512(x, field),
                            1 if KB == 4 => _mm512_and_si512(_mm512_srli_epi16::<4>(x), field),
                            1 => _mm512_and_si512(_mm512_srli_epi16::<2>(x), field),
                            2 => _mm512_and_si512(_mm512_srli_epi16::<4>(x), field),
                            _ => _mm512_and_si512(_mm512_srli_epi16::<6>(x), field),
                        };
                        lo = _mm512_min_epu8(lo, _mm512_mask_blend_epi8(mask, field, f));
                        hi = _mm512_max_epu8(hi, _mm512_maskz_mov_epi8(mask, f));
                    }
                    (least[q], most[q]) = (lo, hi);
                }
                // Lane k: channel c0 + k's code.
                let codes = |v: __m512i| _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(order, v));
                let lo = _mm512_fmadd_ps(codes(fold_rows::<false>(&mut least, row)), scale, min);
                let hi = _mm512_fmadd_ps(codes(fold_rows::<true>(&mut most, row)), scale, min);
                // (min, max) pairs of channels c0 .. c0 + 8, then c0 + 8 .. c0 + 16.
                let (first, second) = interleave(lo, hi);
                let at = dst.add(bounds_at + 4 * (h * dim + c0));
                _mm256_storeu_si256(at.cast(), _mm512_cvtps_ph::<NEAREST>(first));
                _mm256_storeu_si256(at.add(32).cast(), _mm512_cvtps_ph::<NEAREST>(second));
            }
        }
    }

    /// [`to_f16_page`] for `KB`-bit keys and `VB`-bit values.
    ///
    /// # Safety
    ///
    /// As for [`to_f16_page`], and the layout has these code widths.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn page<const KB: usize, const VB: usize>(layout: &QuantLayout, src: &[u8], tokens: usize, dst: &mut [u8]) {
        let shape = layout.shape;
        let (heads, dim, block) = (shape.kv_heads, shape.head_dim, shape.block_tokens);
        let (bounds_at, k_at, v_at) =
            (shape.bounds_offset(Format::F16), shape.k_offset(Format::F16), shape.v_offset(Format::F16));
        // Header and padding: every byte that no element or bound covers is zero.
        dst[..bounds_at].copy_from_slice(&PageHeader::expected(shape, Format::F16, 0).encode());
        dst[bounds_at + 4 * heads * dim..k_at].fill(0);
        dst[k_at + 2 * heads * dim * block..v_at].fill(0);
        dst[v_at + 2 * heads * block * dim..].fill(0);
        let full = tokens / LANES;
        let tail: __mmask16 = ((1u32 << (tokens % LANES)) - 1) as __mmask16;
        let filled = |i: usize| {
            if i < full {
                !0
            } else if i == full {
                tail
            } else {
                0
            }
        };
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let k_row = layout.k_row_bytes();
        for h in 0..heads {
            // SAFETY: `page`'s contract (the source passed the header check for this layout).
            let by_codes = block == 32 && tokens >= 1 && unsafe { monotonic_keys(layout, s, h) };
            if by_codes {
                // SAFETY: as above, and the fast path's conditions were just checked.
                unsafe { keys_block32::<KB>(layout, s, d, h, tokens) };
            } else {
                // Eight channels at a time, so their bounds are the lanes of one transposing reduction.
                for c0 in (0..dim).step_by(8) {
                    let (mut lo, mut hi) = ([_mm512_setzero_ps(); 8], [_mm512_setzero_ps(); 8]);
                    for (k, (lo, hi)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                        let c = c0 + k;
                        // SAFETY: parameter pair `c < dim` of head `h` and code row `c` (`block × KB / 8`
                        // bytes, read 16 codes at a time for `16i + 16 ≤ block`) lie in the source's K
                        // section; K elements `(h, c, 0..block)` in `dst`'s K region.
                        unsafe {
                            let pair = _mm_cvtph_ps(_mm_cvtsi32_si128(
                                s.add(layout.k_param(h, c)).cast::<i32>().read_unaligned(),
                            ));
                            let (scale, min) =
                                (_mm512_broadcastss_ps(pair), _mm512_broadcastss_ps(_mm_movehdup_ps(pair)));
                            let codes = s.add(layout.k_codes(h) + c * k_row);
                            let out = d.add(k_at + 2 * (h * dim + c) * block);
                            (*lo, *hi) = (_mm512_set1_ps(f32::INFINITY), _mm512_set1_ps(f32::NEG_INFINITY));
                            for i in 0..block / LANES {
                                let x = _mm512_fmadd_ps(codes16::<KB>(codes.add(i * LANES * KB / 8)), scale, min);
                                let keep = filled(i);
                                // `min(x, lo)` returns `lo` when `x` is NaN: NaN keys stay out of the bounds.
                                let x = if keep == !0 {
                                    (*lo, *hi) = (_mm512_min_ps(x, *lo), _mm512_max_ps(x, *hi));
                                    x
                                } else {
                                    *lo = _mm512_mask_min_ps(*lo, keep, x, *lo);
                                    *hi = _mm512_mask_max_ps(*hi, keep, x, *hi);
                                    _mm512_maskz_mov_ps(keep, x)
                                };
                                let bits = _mm512_cvtps_ph::<NEAREST>(x);
                                _mm256_storeu_si256(out.add(2 * LANES * i).cast(), bits);
                            }
                        }
                    }
                    // Lane k: channel c0 + k (lanes 8.. unused); interleaved (min, max) pairs, rounded.
                    let (lo, hi) = (reduce_lanes::<MIN>(&lo, 8), reduce_lanes::<MAX>(&hi, 8));
                    let pairs = _mm512_cvtps_ph::<NEAREST>(_mm512_permutex2var_ps(
                        lo,
                        _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                        hi,
                    ));
                    // SAFETY: bound pairs `(h, c0 .. c0 + 8)`, 32 bytes, in `dst`'s bounds region
                    // (`dim` is a multiple of 16).
                    unsafe { _mm256_storeu_si256(d.add(bounds_at + 4 * (h * dim + c0)).cast(), pairs) };
                }
            }
            let v_row = layout.v_row_bytes();
            let groups = dim.div_ceil(V_GROUP);
            for t0 in (0..block).step_by(LANES) {
                // The parameters of 16 tokens of each group at once (group-major: 64 contiguous
                // bytes), stored as floats, so a token's pair is two broadcasts from memory (load
                // ports) rather than two lane permutes.
                let mut scales = [[0.0f32; LANES]; 256 / V_GROUP];
                let mut mins = [[0.0f32; LANES]; 256 / V_GROUP];
                if t0 < tokens {
                    for j in 0..groups {
                        // SAFETY: pairs `(h, j, t0 .. t0 + 16)`, `t0 + 16 ≤ block`, lie in the source's
                        // V parameters; 16-float arrays.
                        unsafe {
                            let (scale, min) = params16(s.add(layout.v_param(h, j, t0)));
                            _mm512_storeu_ps(scales[j].as_mut_ptr(), scale);
                            _mm512_storeu_ps(mins[j].as_mut_ptr(), min);
                        }
                    }
                }
                for t in t0..t0 + LANES {
                    let out = d.wrapping_add(v_at + 2 * (h * block + t) * dim);
                    if t >= tokens {
                        // SAFETY: row `(h, t)` of the V region, `dim` elements.
                        unsafe { std::ptr::write_bytes(out, 0, 2 * dim) };
                        continue;
                    }
                    let lane = t - t0;
                    // SAFETY: token row `t` of the source's V codes (`dim × VB / 8` bytes, read 16 or 32
                    // codes at a time, `dim` a multiple of 16); elements `(h, t, 0..dim)` of `dst`'s V
                    // region.
                    unsafe {
                        let codes = s.add(layout.v_codes(h) + t * v_row);
                        if VB == 8 {
                            for c in (0..dim).step_by(LANES) {
                                let j = c / V_GROUP;
                                let x = _mm512_fmadd_ps(
                                    codes16::<VB>(codes.add(c * VB / 8)),
                                    _mm512_set1_ps(scales[j][lane]),
                                    _mm512_set1_ps(mins[j][lane]),
                                );
                                _mm256_storeu_si256(out.add(2 * c).cast(), _mm512_cvtps_ph::<NEAREST>(x));
                            }
                            continue;
                        }
                        for j in 0..groups {
                            let (scale, min) = (_mm512_set1_ps(scales[j][lane]), _mm512_set1_ps(mins[j][lane]));
                            let c0 = j * V_GROUP;
                            if c0 + V_GROUP <= dim {
                                // A whole group of narrow codes: the group's 2^VB values, rounded
                                // as every element is, then looked up 32 at a time.
                                let table = _mm512_castsi256_si512(_mm512_cvtps_ph::<NEAREST>(_mm512_fmadd_ps(
                                    _mm512_setr_ps(
                                        0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
                                    ),
                                    scale,
                                    min,
                                )));
                                let x = _mm512_permutexvar_epi16(codes32::<VB>(codes.add(c0 * VB / 8)), table);
                                _mm512_storeu_si512(out.add(2 * c0).cast(), x);
                                continue;
                            }
                            for c in (c0..dim.min(c0 + V_GROUP)).step_by(LANES) {
                                let x = _mm512_fmadd_ps(codes16::<VB>(codes.add(c * VB / 8)), scale, min);
                                _mm256_storeu_si256(out.add(2 * c).cast(), _mm512_cvtps_ph::<NEAREST>(x));
                            }
                        }
                    }
                }
            }
        }
    }
}
