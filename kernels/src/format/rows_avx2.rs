//! AVX2 kernels of `rows.rs`, writing the same bytes as its scalar code, for x86-64 CPUs without
//! AVX-512 (most laptop and small-form-factor Intel parts since 2021): the row writer, and the key
//! pass of `truncate_rows` ([`truncate_keys`], the steps of `rows_avx512.rs` 16 slots a vector).
//!
//! The same steps as the AVX-512 writer of `rows_avx512.rs`, 16 channels a run (one 256-bit vector
//! of 16-bit lanes) and keys transposed by chunks of 16 tokens; with no masked 16-bit store, a
//! chunk's transposed keys go out in 32-bit lanes (two slots, `vpmaskmovd`), so the last slot of a
//! call whose last chunk has an odd number of them is stored key by key:
//!
//! ```text
//!   rows (token-major)           page
//!   v[t][h][d0..d0+16] ──convert──▶ V region, row (h, slot): one store
//!   k[t][h][d0..d0+16] ──convert──▶ a chunk's vectors, one a slot ──transpose──▶ K region,
//!                                    channel d: the chunk's whole pairs of slots, one store
//!                                    (an odd last slot, or calls of fewer than 8 tokens: 16
//!                                    two-byte stores a slot)
//!                                    bounds (h, d0..d0+16): min/max widened per lane
//! ```
//!
//! AVX2 has no masked 16-bit loads or stores and no unsigned 16-bit compares, so a run of fewer
//! than 16 channels (a head narrower than 16, or the end of one) goes through a zeroed buffer on
//! the stack, and the bounds are compared in the signed order of the bits (a negative key's
//! magnitude bits flipped; both zeros 0, so an equal zero never replaces the first). Conversions
//! round as `rows.rs` does: f32 → f16 by `vcvtps2ph` to nearest even (the instruction the `half`
//! crate uses where F16C is present), f32 → bf16 to nearest even on the bits with a NaN's top
//! mantissa bit set (the `half` crate's rule), 16-bit rows of the page's own type copied.
//!
//! Memory safety rests on the checks of the caller in `rows.rs` and the asserts below: every
//! pointer is derived from the page or the rows at an offset the [`PageShape`] computes for a
//! channel, slot and head inside them, and a partial run touches only its `n` elements.

use std::arch::x86_64::*;

use super::rows::{RowElement, Source, first_zeros, infinity_bits, nan_shift, set_bits, source_of};
use crate::format::{Format, PageShape};

/// Channels a run holds: 16-bit lanes of a vector.
const LANES: usize = 16;

/// Lanes holding NaN bits (a magnitude above `infinite`, the format's +∞ bits in every lane).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nan_lanes(bits: __m256i, infinite: __m256i) -> __m256i {
    _mm256_cmpgt_epi16(_mm256_and_si256(bits, _mm256_set1_epi16(0x7fff)), infinite)
}

/// The signed order of the values of 16-bit patterns (sign and magnitude): a negative pattern's
/// magnitude bits flipped, and both zeros 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn order(bits: __m256i) -> __m256i {
    let magnitude = _mm256_set1_epi16(0x7fff);
    let flipped = _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi16::<15>(bits), magnitude));
    let zero = _mm256_cmpeq_epi16(_mm256_and_si256(bits, magnitude), _mm256_setzero_si256());
    _mm256_andnot_si256(zero, flipped)
}

/// Running key bounds `(lo, hi)` (bits, lane per channel) widened to `keys` (bits) by the rule of
/// `widen` in `rows.rs`: a key replaces a bound it passes or a NaN bound; a NaN key passes none.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen(lo: __m256i, hi: __m256i, keys: __m256i, infinite: __m256i) -> (__m256i, __m256i) {
    let key = order(keys);
    let nan_key = nan_lanes(keys, infinite);
    let below =
        _mm256_or_si256(_mm256_andnot_si256(nan_key, _mm256_cmpgt_epi16(order(lo), key)), nan_lanes(lo, infinite));
    let above =
        _mm256_or_si256(_mm256_andnot_si256(nan_key, _mm256_cmpgt_epi16(key, order(hi))), nan_lanes(hi, infinite));
    (_mm256_blendv_epi8(lo, keys, below), _mm256_blendv_epi8(hi, keys, above))
}

/// bf16 bits of 8 f32 lanes, in the low half of each 32-bit lane: to nearest even, a NaN's top
/// mantissa bit set (the `half` crate's `bf16::from_f32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bf16_bits(x: __m256) -> __m256i {
    let x = _mm256_castps_si256(x);
    // No unsigned 32-bit compare: the magnitudes are below 2^31, so the signed one serves.
    let nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff)), _mm256_set1_epi32(0x7f80_0000));
    let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))));
    let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(0x40));
    _mm256_blendv_epi8(rounded, quiet, nan)
}

/// Two vectors of 8 f32 as 16 lanes of 16-bit bits of f16 or bf16, `a` in lanes 0..8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pack(a: __m256, b: __m256, bf16: bool) -> __m256i {
    if bf16 {
        // `packus` interleaves the 128-bit halves of its operands; the permute puts them in order.
        let packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));
        _mm256_permute4x64_epi64::<0b11_01_10_00>(packed)
    } else {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT;
        _mm256_set_m128i(_mm256_cvtps_ph::<NEAREST>(b), _mm256_cvtps_ph::<NEAREST>(a))
    }
}

/// 16 elements of `E` from `src` converted to the bits of `format` (f16 or bf16) as `rows.rs`
/// converts them.
///
/// # Safety
///
/// `src` must be valid for reads of 16 elements of `E`; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn convert<E: RowElement>(src: *const E, format: Format) -> __m256i {
    let bf16 = format == Format::Bf16;
    match source_of::<E>() {
        Source::F32 => {
            let src = src.cast::<f32>();
            // SAFETY: 16 readable f32 from `src`, which the caller guarantees.
            let (a, b) = unsafe { (_mm256_loadu_ps(src), _mm256_loadu_ps(src.add(8))) };
            pack(a, b, bf16)
        }
        from => {
            // SAFETY: 16 readable 16-bit elements from `src`, which the caller guarantees.
            let bits = unsafe { _mm256_loadu_si256(src.cast()) };
            if (from == Source::Bf16) == bf16 {
                return bits;
            }
            let (low, high) = (_mm256_castsi256_si128(bits), _mm256_extracti128_si256::<1>(bits));
            let wide = |half: __m128i| {
                if from == Source::Bf16 {
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(half)))
                } else {
                    _mm256_cvtph_ps(half)
                }
            };
            pack(wide(low), wide(high), bf16)
        }
    }
}

/// Elements `0..n` (`1 ≤ n ≤ 16`) of a row of `E`, `row`, converted as [`convert`] does, in lanes
/// `0..n`; a partial run is read through a buffer (its other lanes are not used).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn convert_run<E: RowElement>(row: &[E], format: Format) -> __m256i {
    if let Some(whole) = row.first_chunk::<LANES>() {
        // SAFETY: `whole` is 16 readable elements.
        return unsafe { convert(whole.as_ptr(), format) };
    }
    let mut buffer = [row[0]; LANES];
    buffer[..row.len()].copy_from_slice(row);
    // SAFETY: the buffer holds 16 readable elements.
    unsafe { convert(buffer.as_ptr(), format) }
}

/// The row writer of `rows.rs` (`write_rows_impl`) on AVX2: `k.len() / (kv_heads × head_dim)`
/// tokens of rows into slots from `first` of `page`, a 16-bit page of `format` with a valid header,
/// the same bytes as the scalar writer.
///
/// Panics if the rows or the page disagree with the shape or the slots pass the page's last.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn write_rows<E: RowElement>(
    shape: PageShape,
    format: Format,
    page: &mut [u8],
    first: usize,
    k: &[E],
    v: &[E],
) {
    let row = shape.kv_heads * shape.head_dim;
    if k.len() / row >= TRANSPOSED {
        write::<E, true>(shape, format, page, first, k, v);
    } else {
        write::<E, false>(shape, format, page, first, k, v);
    }
}

/// [`write_rows`], the keys transposed by chunks of 16 tokens (`TRANSPOSE`) or stored key by key:
/// two instances of one body, as in `rows_avx512.rs`.
#[target_feature(enable = "avx2,fma,f16c")]
fn write<E: RowElement, const TRANSPOSE: bool>(
    shape: PageShape,
    format: Format,
    page: &mut [u8],
    first: usize,
    k: &[E],
    v: &[E],
) {
    let (heads, dim, bt) = (shape.kv_heads, shape.head_dim, shape.block_tokens);
    let row = heads * dim;
    let count = k.len() / row;
    assert!(k.len() == count * row && v.len() == k.len(), "whole rows of keys and values");
    assert!(first + count <= bt && page.len() >= shape.page_bytes(format), "slots inside the page");
    let infinite = _mm256_set1_epi16(infinity_bits(format) as i16);
    let (low_half, p) = (_mm256_set1_epi32(0xffff), page.as_mut_ptr());
    // Consecutive channels of one slot lie this far apart among the keys.
    let channel_stride = 2 * bt;
    // A chunk's keys, a vector a slot (`TRANSPOSE`); the lanes past a chunk's slots or the run's
    // channels are never stored, so what an earlier chunk left there stays.
    let mut chunk = [_mm256_setzero_si256(); LANES];
    for h in 0..heads {
        for d0 in (0..dim).step_by(LANES) {
            let n = LANES.min(dim - d0);
            // The `(min, max)` pairs of the run, as 32-bit lanes `min | max << 16`.
            let bounds = p.wrapping_add(shape.bound_byte(h, d0));
            let mut pairs = [0u32; LANES];
            // SAFETY: the pairs of channels `d0..d0 + n` are `4n` bytes from `bounds`, inside the
            // page's bounds region; the buffer holds 64.
            unsafe { std::ptr::copy_nonoverlapping(bounds, pairs.as_mut_ptr().cast::<u8>(), 4 * n) };
            // SAFETY: 64 readable bytes.
            let (a, b) =
                unsafe { (_mm256_loadu_si256(pairs.as_ptr().cast()), _mm256_loadu_si256(pairs[8..].as_ptr().cast())) };
            let split = |x: __m256i, y: __m256i| _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(x, y));
            let mut lo = split(_mm256_and_si256(a, low_half), _mm256_and_si256(b, low_half));
            let mut hi = split(_mm256_srli_epi32::<16>(a), _mm256_srli_epi32::<16>(b));
            let mut bits = [0u16; LANES];
            for i in 0..count {
                let slot = first + i;
                let r = (i * heads + h) * dim + d0;
                let values = convert_run(&v[r..r + n], format);
                let key = convert_run(&k[r..r + n], format);
                let at = p.wrapping_add(shape.v_byte(h, slot, d0));
                if n == LANES {
                    // SAFETY: the values of channels `d0..d0 + 16` at `slot` are 32 contiguous
                    // bytes from `at`, inside the V region.
                    unsafe { _mm256_storeu_si256(at.cast(), values) };
                } else {
                    // SAFETY: 32 writable bytes.
                    unsafe { _mm256_storeu_si256(bits.as_mut_ptr().cast(), values) };
                    // SAFETY: the values of channels `d0..d0 + n` at `slot` are `2n` contiguous
                    // bytes from `at`, inside the V region; the buffer holds 32.
                    unsafe { std::ptr::copy_nonoverlapping(bits.as_ptr().cast::<u8>(), at, 2 * n) };
                }
                (lo, hi) = widen(lo, hi, key, infinite);
                // A chunk's keys go out in 32-bit lanes, two slots each: the last slot of a call
                // whose last chunk has an odd number goes key by key.
                let last = i + 1 == count;
                if !TRANSPOSE || (last && i % 2 == 0) {
                    // SAFETY: 32 writable bytes.
                    unsafe { _mm256_storeu_si256(bits.as_mut_ptr().cast(), key) };
                    let mut place = p.wrapping_add(shape.k_byte(h, d0, slot));
                    for &key in &bits[..n] {
                        // SAFETY: `place` is `k_byte(h, d0 + j, slot)` for the `j`-th key, `j < n`,
                        // and `slot < block_tokens`: a two-byte key inside the K region of the
                        // page, whose length was checked above.
                        unsafe { place.cast::<u16>().write_unaligned(key) };
                        place = place.wrapping_add(channel_stride);
                    }
                }
                if !TRANSPOSE {
                    continue;
                }
                chunk[i % LANES] = key;
                if i % LANES == LANES - 1 || last {
                    // The chunk's slots `start..=slot`, contiguous in each channel; the whole
                    // pairs of them stored here.
                    let (start, tokens) = (first + i / LANES * LANES, i % LANES + 1);
                    let numbers = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    let lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((tokens / 2) as i32), numbers);
                    for (j, keys) in transpose(&chunk)[..n].iter().enumerate() {
                        let at = p.wrapping_add(shape.k_byte(h, d0 + j, start));
                        // SAFETY: slots `start..start + tokens / 2 × 2` of channel `d0 + j < dim`,
                        // below `slot + 1 ≤ block_tokens`: contiguous two-byte keys from `at`,
                        // inside the K region; the mask holds those 32-bit lanes only.
                        unsafe {
                            if tokens == LANES {
                                _mm256_storeu_si256(at.cast(), *keys);
                            } else {
                                _mm256_maskstore_epi32(at.cast(), lanes, *keys);
                            }
                        }
                    }
                }
            }
            // Back to pairs: the low unpack holds those of channels 0..4 and 8..12, the high one
            // those of 4..8 and 12..16; the permutes put them in channel order.
            let (first_pairs, second_pairs) = (_mm256_unpacklo_epi16(lo, hi), _mm256_unpackhi_epi16(lo, hi));
            let ordered = [
                _mm256_permute2x128_si256::<0x20>(first_pairs, second_pairs),
                _mm256_permute2x128_si256::<0x31>(first_pairs, second_pairs),
            ];
            // SAFETY: 64 writable bytes.
            unsafe {
                _mm256_storeu_si256(pairs.as_mut_ptr().cast(), ordered[0]);
                _mm256_storeu_si256(pairs[8..].as_mut_ptr().cast(), ordered[1]);
            }
            // SAFETY: the same `4n` bytes the pairs were read from.
            unsafe { std::ptr::copy_nonoverlapping(pairs.as_ptr().cast::<u8>(), bounds, 4 * n) };
        }
    }
}

/// Calls of at least this many tokens (a prefill's) have their keys transposed in registers by
/// chunks of 16 and stored a channel at a time; shorter ones (a decode step's token, a few drafts)
/// store them key by key.
const TRANSPOSED: usize = 8;

/// Keys of up to 16 slots, a vector a slot (lane per channel), as a vector a channel (lane per
/// slot): lane `c` of `slots[t]` is lane `t` of the result's `c`.
///
/// The steps of `transpose` in `rows_avx512.rs`: three unpack stages transpose the 8 × 8 blocks
/// inside each 128-bit lane, so that a group of eight slots' vector `i` holds, in 128-bit lane
/// `L`, channel `8L + i` at the group's slots; one 128-bit permute then joins lane `L` of both
/// groups' vectors `i` into the result's `8L + i`. 64 shuffles, where storing key by key takes 16
/// stores a slot.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose(slots: &[__m256i; LANES]) -> [__m256i; LANES] {
    use std::array::from_fn;
    // Per group `g` of eight slots, `8g + k`: slots `2p, 2p + 1` (`p = k / 2`) interleaved, channels
    // 0..4 of each 128-bit lane for even `k`, 4..8 for odd.
    let pairs: [__m256i; LANES] = from_fn(|j| {
        let (a, b) = (slots[j & !1], slots[j | 1]);
        if j % 2 == 0 { _mm256_unpacklo_epi16(a, b) } else { _mm256_unpackhi_epi16(a, b) }
    });
    // Per group, `k < 4` for slots 0..4 and `k ≥ 4` for 4..8: channels `2(k % 4)` and `2(k % 4) + 1`.
    let quads: [__m256i; LANES] = from_fn(|j| {
        let (g, k) = (j & !7, j % 8);
        let x = g + k / 4 * 4 + k % 4 / 2;
        let (a, b) = (pairs[x], pairs[x + 2]);
        if k % 2 == 0 { _mm256_unpacklo_epi32(a, b) } else { _mm256_unpackhi_epi32(a, b) }
    });
    // Per group, `k`: channel `k` of each 128-bit lane at the group's eight slots.
    let blocks: [__m256i; LANES] = from_fn(|j| {
        let (g, k) = (j & !7, j % 8);
        let (a, b) = (quads[g + k / 2], quads[g + k / 2 + 4]);
        if k % 2 == 0 { _mm256_unpacklo_epi64(a, b) } else { _mm256_unpackhi_epi64(a, b) }
    });
    from_fn(|c| {
        let (a, b) = (blocks[c % 8], blocks[8 + c % 8]);
        if c < 8 { _mm256_permute2x128_si256::<0x20>(a, b) } else { _mm256_permute2x128_si256::<0x31>(a, b) }
    })
}

/// The channel of 16 whose extremes the tree of [`level`] leaves at `lane`: lane `8L + 2k + b`
/// holds channel `8b + 2k + L`.
const fn channel_of(lane: usize) -> usize {
    8 * (lane % 2) + 2 * (lane % 8 / 2) + lane / 8
}

/// The running minima and maxima of channels, folded lane by lane, a pair of vectors.
type Folds = (__m256i, __m256i);

/// One level of the tree that reduces 16 channels' [`Folds`] to one pair of vectors, a lane per
/// channel (see [`channel_of`]) holding its minimum and maximum, as `level` of `rows_avx512.rs` does
/// for 32: two vectors of the level below become one, each one's lanes folded in half. `LEVEL` 1
/// folds 128-bit halves, 2 64-bit, 3 32-bit and 4 16-bit pieces. What each level leaves (channels
/// numbered within the run it covers):
///
/// ```text
///   level 1, channels a, b:        a in 128-bit lane 0, b in lane 1
///   level 2, 4 channels:           in 128-bit lane L, channel L in the low 64 bits, 2 + L in the high
///   level 3, 8 channels:           in 128-bit lane L, channel 2k + L in 32-bit piece k
///   level 4, 16 channels:          in 128-bit lane L, piece k: 2k + L in its low 16 bits, 8 + 2k + L
///                                  in its high
/// ```
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn level<const LEVEL: u8>(a: Folds, b: Folds) -> Folds {
    let fold = |a: __m256i, b: __m256i, max: bool| {
        let (x, y) = match LEVEL {
            1 => (_mm256_permute2x128_si256::<0x20>(a, b), _mm256_permute2x128_si256::<0x31>(a, b)),
            2 => (_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b)),
            3 => {
                let (a, b) = (_mm256_castsi256_ps(a), _mm256_castsi256_ps(b));
                (
                    _mm256_castps_si256(_mm256_shuffle_ps::<0x88>(a, b)),
                    _mm256_castps_si256(_mm256_shuffle_ps::<0xdd>(a, b)),
                )
            }
            // The low 16 bits of each 32-bit piece from `a`, the high from `b`; the other halves
            // folded with a shifted-in 0, which the blend drops.
            _ => {
                let (x, y) = (_mm256_srli_epi32::<16>(a), _mm256_slli_epi32::<16>(b));
                let (a, b) = if max {
                    (_mm256_max_epu16(a, x), _mm256_max_epu16(b, y))
                } else {
                    (_mm256_min_epu16(a, x), _mm256_min_epu16(b, y))
                };
                return _mm256_blend_epi16::<0xaa>(a, b);
            }
        };
        if max { _mm256_max_epu16(x, y) } else { _mm256_min_epu16(x, y) }
    };
    (fold(a.0, b.0, false), fold(a.1, b.1, true))
}

/// 16 slots from `p`, of which the first `len / 2` are read and the others are 0.
///
/// # Safety
///
/// `p` must be valid for reads of `min(len, 32)` bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_slots(p: *const u8, len: usize) -> __m256i {
    if len >= 2 * LANES {
        // SAFETY: 32 readable bytes, which the caller guarantees.
        return unsafe { _mm256_loadu_si256(p.cast()) };
    }
    let mut buffer = [0u8; 2 * LANES];
    // SAFETY: `len < 32` readable bytes, which the caller guarantees, into the buffer.
    unsafe { std::ptr::copy_nonoverlapping(p, buffer.as_mut_ptr(), len) };
    // SAFETY: 32 readable bytes.
    unsafe { _mm256_loadu_si256(buffer.as_ptr().cast()) }
}

/// Stores the first `min(len, 32)` bytes of `v` at `p`.
///
/// # Safety
///
/// `p` must be valid for writes of `min(len, 32)` bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_slots(p: *mut u8, len: usize, v: __m256i) {
    if len >= 2 * LANES {
        // SAFETY: 32 writable bytes, which the caller guarantees.
        return unsafe { _mm256_storeu_si256(p.cast(), v) };
    }
    let mut buffer = [0u8; 2 * LANES];
    // SAFETY: 32 writable bytes, then `len < 32` bytes to `p`, which the caller guarantees.
    unsafe {
        _mm256_storeu_si256(buffer.as_mut_ptr().cast(), v);
        std::ptr::copy_nonoverlapping(buffer.as_ptr(), p, len);
    }
}

/// Lanes where `a ≥ b`, unsigned 16-bit, as all-ones lanes (AVX2 has no unsigned compare).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn at_least(a: __m256i, b: __m256i) -> __m256i {
    _mm256_cmpeq_epi16(_mm256_max_epu16(a, b), a)
}

/// The key pass of `truncate_rows` on AVX2, the same bytes as the scalar `first_extremes` and
/// zeroing in `rows.rs` and as `truncate_keys` of `rows_avx512.rs`, whose steps it takes 16 slots
/// and 16 channels a vector: each channel's kept slots in the unsigned order of their values,
/// shifted so that NaNs pass neither the min nor the max, folded lane by lane; a run's 16 channels
/// reduced to one pair of vectors by [`level`]; an extreme's bits its order inverted (a zero
/// extreme's, the first zero's); the slots past the kept ones zeroed. A vector that would pass
/// the end of a channel (pages of fewer than 16 slots, or not a multiple of 16) is read and
/// written back through a buffer.
///
/// `keys` is the K region of a 16-bit page (channels of `block_tokens` little-endian 16-bit keys
/// each, `bounds.len() / 4` of them), `bounds` the `(min, max)` bits of each channel, `infinity`
/// the format's +∞ bits. Panics if the lengths disagree or `keep > block_tokens`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn truncate_keys(keys: &mut [u8], bounds: &mut [u8], block_tokens: usize, keep: usize, infinity: u16) {
    assert!(keep <= block_tokens && block_tokens > 0, "keep {keep} of {block_tokens} slots");
    assert_eq!(keys.len(), bounds.len() / 4 * 2 * block_tokens, "K region and bounds of one shape");
    // The orders shifted so that NaNs pass neither fold.
    let nan_shift = nan_shift(infinity);
    let shift = _mm256_set1_epi16(nan_shift.shift as i16);
    let (zero, ones, top) = (_mm256_setzero_si256(), _mm256_set1_epi16(-1), _mm256_set1_epi16(0x8000_u16 as i16));
    let lane = _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let channels = bounds.len() / 4;
    let stride = 2 * block_tokens;
    let kept_vectors = keep.div_ceil(LANES);
    // The kept lanes of the last kept vector, as all-ones lanes.
    let last_kept = _mm256_cmpgt_epi16(_mm256_set1_epi16((keep - keep.saturating_sub(1) / LANES * LANES) as i16), lane);
    // The bytes from here to a channel's end, past its kept vectors, are zeroed (a last kept vector
    // holding slots past `keep` writes them back as 0).
    let cleared_from = 2 * LANES * kept_vectors;
    let base = keys.as_mut_ptr();
    for group in (0..channels).step_by(LANES) {
        let n = LANES.min(channels - group);
        // Channel `c` of the group: its kept keys' shifted orders folded over its vectors lane by
        // lane, and its slots past `keep` zeroed.
        let channel = |c: usize| -> Folds {
            let p = base.wrapping_add((group + c) * stride);
            let (mut low, mut high) = (ones, zero);
            for j in 0..kept_vectors {
                let (at, kept) = (2 * LANES * j, if j + 1 == kept_vectors { last_kept } else { ones });
                // SAFETY: the bytes from `at` to the channel's end or 32 on, inside channel
                // `group + c < channels`, whose `2 × block_tokens` bytes lie in `keys`.
                let bits = _mm256_and_si256(unsafe { load_slots(p.add(at), stride - at) }, kept);
                let order = _mm256_xor_si256(bits, _mm256_or_si256(_mm256_srai_epi16::<15>(bits), top));
                // Lanes past `keep`: all ones for the min, zero for the max.
                low = _mm256_min_epu16(
                    low,
                    _mm256_or_si256(_mm256_sub_epi16(order, shift), _mm256_xor_si256(kept, ones)),
                );
                high = _mm256_max_epu16(high, _mm256_and_si256(_mm256_add_epi16(order, shift), kept));
                if j + 1 == kept_vectors && !keep.is_multiple_of(LANES) {
                    // SAFETY: as the load: the vector back as kept, 0 past `keep`.
                    unsafe { store_slots(p.add(at), stride - at, bits) };
                }
            }
            if cleared_from < stride {
                // SAFETY: bytes `cleared_from..stride` of this channel.
                unsafe { std::ptr::write_bytes(p.add(cleared_from), 0, stride - cleared_from) };
            }
            (low, high)
        };
        let mut folds = [(ones, zero); LANES];
        for (c, fold) in folds[..n].iter_mut().enumerate() {
            *fold = channel(c);
        }
        let halves: [Folds; 8] = std::array::from_fn(|i| level::<1>(folds[2 * i], folds[2 * i + 1]));
        let quarters: [Folds; 4] = std::array::from_fn(|i| level::<2>(halves[2 * i], halves[2 * i + 1]));
        let (a, b) = (level::<3>(quarters[0], quarters[1]), level::<3>(quarters[2], quarters[3]));
        let (low, high) = level::<4>(a, b);
        // No key entered where the extreme is a NaN's (or the neutral element).
        let no_low = at_least(low, _mm256_set1_epi16((nan_shift.highest_min + 1) as i16));
        let no_high = at_least(_mm256_set1_epi16((nan_shift.lowest_max - 1) as i16), high);
        let (low, high) = (_mm256_add_epi16(low, shift), _mm256_sub_epi16(high, shift));
        // An extreme's bits: its order with the top bit cleared where it is set, inverted where
        // not; where no key entered, the empty bound's.
        let bits =
            |o: __m256i| _mm256_xor_si256(o, _mm256_or_si256(_mm256_xor_si256(_mm256_srai_epi16::<15>(o), ones), top));
        let lo = _mm256_blendv_epi8(bits(low), _mm256_set1_epi16(infinity as i16), no_low);
        let hi = _mm256_blendv_epi8(bits(high), _mm256_set1_epi16((infinity | 0x8000) as i16), no_high);
        // The (min, max) pairs in channel order: the unpacks pair lane `8L + j` with its max, in
        // the low one for `j < 4` and the high one for the others (32-bit piece `4L + j % 4`);
        // channel `c < 8` (lane `8(c % 2) + 2(c / 2)`) and `8 + c` (one lane up) are gathered
        // from them by one index vector each.
        let (low_pairs, high_pairs) = (_mm256_unpacklo_epi16(lo, hi), _mm256_unpackhi_epi16(lo, hi));
        let gather = |index: __m256i| {
            _mm256_blend_epi32::<0xf0>(
                _mm256_permutevar8x32_epi32(low_pairs, index),
                _mm256_permutevar8x32_epi32(high_pairs, index),
            )
        };
        let pairs =
            [gather(_mm256_setr_epi32(0, 4, 2, 6, 0, 4, 2, 6)), gather(_mm256_setr_epi32(1, 5, 3, 7, 1, 5, 3, 7))];
        let at = 4 * group;
        if n == LANES {
            // SAFETY: the 64 bytes of channels `group..group + 16`, inside `bounds`.
            unsafe {
                _mm256_storeu_si256(bounds.as_mut_ptr().add(at).cast(), pairs[0]);
                _mm256_storeu_si256(bounds.as_mut_ptr().add(at + 32).cast(), pairs[1]);
            }
        } else {
            let mut buffer = [0u8; 4 * LANES];
            // SAFETY: 64 writable bytes.
            unsafe {
                _mm256_storeu_si256(buffer.as_mut_ptr().cast(), pairs[0]);
                _mm256_storeu_si256(buffer.as_mut_ptr().add(32).cast(), pairs[1]);
            }
            bounds[at..at + 4 * n].copy_from_slice(&buffer[..4 * n]);
        }
        // A zero extreme (−0's order 0x7fff or +0's 0x8000) takes the sign of the channel's first
        // zero. The channels past `n` hold the neutral elements: lanes where no key entered. Two
        // mask bits a lane.
        let zeros = |o: __m256i, none: __m256i| {
            let off = _mm256_sub_epi16(o, _mm256_set1_epi16(0x7fff));
            _mm256_movemask_epi8(_mm256_andnot_si256(none, at_least(_mm256_set1_epi16(1), off))) as u32 & 0x5555_5555
        };
        let (zero_low, zero_high) = (zeros(low, no_low), zeros(high, no_high));
        if zero_low | zero_high != 0 {
            let bounds_of = |zero: u32, offset: usize| set_bits(zero).map(move |bit| (channel_of(bit / 2), offset));
            let zeros = bounds_of(zero_low, 0).chain(bounds_of(zero_high, 2));
            // SAFETY: every channel's first `2 × keep` bytes lie in `keys`, written by nothing else now.
            unsafe { first_zeros(base, stride, keep, (group, n), bounds, zeros) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::rows::check_transpose;

    #[test]
    fn transpose_turns_slots_into_channels() {
        if !std::is_x86_feature_detected!("avx2") {
            return;
        }
        check_transpose::<LANES>(|slots| {
            let mut channels = [[0u16; LANES]; LANES];
            // SAFETY: avx2 was detected (the shuffles need nothing else); every load and store is
            // of 32 bytes of a 32-byte array.
            unsafe {
                let vectors = slots.map(|s| _mm256_loadu_si256(s.as_ptr().cast()));
                for (out, v) in channels.iter_mut().zip(transpose(&vectors)) {
                    _mm256_storeu_si256(out.as_mut_ptr().cast(), v);
                }
            }
            channels
        });
    }
}
