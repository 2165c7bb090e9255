//! AVX-512 kernels of `rows.rs`, writing the same bytes as its scalar code: the row writer and
//! the key pass of `truncate_rows`.
//!
//! **Writer**, per KV head and run of up to 32 channels: the run's key bounds loaded as two
//! vectors of interleaved `(min, max)` pairs and split into a min and a max vector; then token by
//! token, the values and keys converted 32 at a time, the values stored as their row and the
//! bounds widened on the bits; at the end the bounds interleaved and stored back. The keys of a call
//! of at least [`TRANSPOSED`] tokens (a prefill's) go to their channel-major places by chunks of up
//! to 32 tokens, transposed in registers ([`transpose`]) and stored a channel at a time: 1.4–2.1× the
//! words a second of storing them key by key, as a shorter call (a decode step's token) does.
//!
//! ```text
//!   rows (token-major)           page
//!   v[t][h][d0..d0+32] ──convert──▶ V region, row (h, slot): one masked store
//!   k[t][h][d0..d0+32] ──convert──▶ a chunk's vectors, one a slot ──transpose──▶ K region,
//!                                    channel d: slots of the chunk, one masked store
//!                                    (calls of fewer than 8 tokens: 32 two-byte stores a slot)
//!                                    bounds (h, d0..d0+32): min/max widened per lane
//! ```
//!
//! Conversions round as `rows.rs` does: f32 → f16 by `vcvtps2ph` to nearest even (the instruction
//! the `half` crate uses where F16C is present), f32 → bf16 to nearest even on the bits with a
//! NaN's top mantissa bit set (the `half` crate's rule), 16-bit rows of the page's own type copied.
//! The bounds rule is `widen` in `rows.rs`: a key replaces a bound it passes or a NaN bound,
//! compared here in the unsigned order of the bits (both zeros one value, so an equal zero never
//! replaces the first); a NaN key never passes.
//!
//! **Truncate's key pass.** A channel's keys are contiguous in slot order (the channel-major K
//! region of [`crate::format::layout`]), so up to 32 slots of one channel are one vector. Per run
//! of 32 channels:
//!
//! ```text
//!   per channel: slots 0 .. keep (kept)          keep .. block_tokens
//!  ┌───────────────────────────────────────────┬──────────────────────┐
//!  │ loaded masked, 32 a vector                 │ the last kept vector │
//!  │  bits → unsigned order of their values     │ stored back as       │
//!  │  min and max folded lane by lane over the  │ loaded (0 past keep),│
//!  │  vectors, on orders shifted so that NaNs   │ later vectors zeroed │
//!  │  pass neither                              │                      │
//!  └───────────────────────────────────────────┴──────────────────────┘
//!   the run's 32 (min, max) vector pairs → one pair, a lane per channel (a tree of shuffles)
//!   → each extreme's bits: its order inverted; for a zero, the first zero's bits
//!   → the (min, max) pairs stored in channel order, two masked stores
//! ```
//!
//! The order is the scalar one: a negative key's bits inverted, a positive key's with the top bit
//! set. It is one to one, so an extreme needs no search for its slot, except a zero: −0 and +0 are
//! one value to the rule, whose first copy stands, so a zero extreme (order 0x7fff or 0x8000) takes
//! the bits of the channel's first zero. Reducing 32 channels' vectors to one with a tree (two
//! shuffles and a min or max per pair) replaced folding each channel's vector to a lane by
//! `phminposuw` (six instructions a channel for each extreme): 1.09 → 0.74 µs a SmolLM2 page.
//!
//! Memory safety rests on the slices the callers pass: every pointer below is derived from a
//! slice whose length was checked against the offsets the [`PageShape`] computes, and every
//! vector load and store is masked to the lanes inside it.

use std::arch::x86_64::*;

use super::rows::{RowElement, Source, first_zeros, infinity_bits, nan_shift, set_bits, source_of};
use crate::format::{Format, PageShape};

/// Slots of one channel a vector holds.
const LANES: usize = 32;
/// The order of both zeros.
const ZERO: u16 = 0x8000;

/// The lanes below `n` of a vector.
fn below(n: usize) -> __mmask32 {
    if n >= LANES { u32::MAX } else { (1u32 << n) - 1 }
}

/// Lanes holding NaN bits (a magnitude above `infinite`, the format's +∞ bits in every lane).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn nan_lanes(bits: __m512i, infinite: __m512i) -> __mmask32 {
    _mm512_cmpgt_epu16_mask(_mm512_and_si512(bits, _mm512_set1_epi16(0x7fff)), infinite)
}

/// The unsigned order of the values of 16-bit patterns (sign and magnitude): a negative pattern
/// inverted, a positive one with its top bit set, and both zeros [`ZERO`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn order(bits: __m512i) -> __m512i {
    let top = _mm512_set1_epi16(ZERO as i16);
    _mm512_mask_mov_epi16(raw_order(bits), _mm512_testn_epi16_mask(bits, _mm512_set1_epi16(0x7fff)), top)
}

/// The unsigned order of the values of 16-bit patterns as [`order`] gives it, but with −0 just
/// below +0 (0x7fff and 0x8000).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn raw_order(bits: __m512i) -> __m512i {
    // bits ^ (sign spread | 0x8000): A ^ (B | C) is 0x1e.
    _mm512_ternarylogic_epi32::<0x1e>(bits, _mm512_srai_epi16::<15>(bits), _mm512_set1_epi16(ZERO as i16))
}

/// Running key bounds `(lo, hi)` (bits, lane per channel) widened to `keys` (bits) by the rule of
/// `widen` in `rows.rs`: a key replaces a bound it passes or a NaN bound; a NaN key passes none.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn widen(lo: __m512i, hi: __m512i, keys: __m512i, infinite: __m512i) -> (__m512i, __m512i) {
    let (nan_key, nan_lo, nan_hi) = (nan_lanes(keys, infinite), nan_lanes(lo, infinite), nan_lanes(hi, infinite));
    let key = order(keys);
    let below = (_mm512_cmplt_epu16_mask(key, order(lo)) & !nan_key) | nan_lo;
    let above = (_mm512_cmpgt_epu16_mask(key, order(hi)) & !nan_key) | nan_hi;
    (_mm512_mask_mov_epi16(lo, below, keys), _mm512_mask_mov_epi16(hi, above, keys))
}

/// bf16 bits of 16 f32 lanes, in the low half of each 32-bit lane: to nearest even, a NaN's top
/// mantissa bit set (the `half` crate's `bf16::from_f32`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn bf16_bits(x: __m512) -> __m512i {
    let x = _mm512_castps_si512(x);
    let nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff)), _mm512_set1_epi32(0x7f80_0000));
    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))));
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
    _mm512_mask_mov_epi32(rounded, nan, quiet)
}

/// Two vectors of 16 f32 as 32 lanes of 16-bit bits of f16 or bf16, `a` in lanes 0..16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
fn pack(a: __m512, b: __m512, bf16: bool) -> __m512i {
    let (a, b) = if bf16 {
        (_mm512_cvtepi32_epi16(bf16_bits(a)), _mm512_cvtepi32_epi16(bf16_bits(b)))
    } else {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        (_mm512_cvtps_ph::<NEAREST>(a), _mm512_cvtps_ph::<NEAREST>(b))
    };
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
}

/// Elements `0..n` of a row of `E` from `src`, converted to the bits of `format` (f16 or bf16) as
/// `rows.rs` converts them, in lanes `0..n`; the other lanes 0.
///
/// # Safety
///
/// `n ≤ 32`, and `src` must be valid for reads of `n` elements of `E`; the CPU must support the
/// enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
unsafe fn convert<E: RowElement>(src: *const E, n: usize, format: Format) -> __m512i {
    let lanes = below(n);
    let bf16 = format == Format::Bf16;
    match source_of::<E>() {
        Source::F32 => {
            let src = src.cast::<f32>();
            // SAFETY: the masked loads read elements `0..n` only, which the caller guarantees;
            // the second address is formed without `add` since it may lie past the row.
            let (a, b) = unsafe {
                (
                    _mm512_maskz_loadu_ps(lanes as __mmask16, src),
                    _mm512_maskz_loadu_ps((lanes >> 16) as __mmask16, src.wrapping_add(16)),
                )
            };
            pack(a, b, bf16)
        }
        from => {
            // SAFETY: the masked load reads elements `0..n` only, which the caller guarantees.
            let bits = unsafe { _mm512_maskz_loadu_epi16(lanes, src.cast()) };
            if (from == Source::Bf16) == bf16 {
                return bits;
            }
            let (low, high) = (_mm512_castsi512_si256(bits), _mm512_extracti64x4_epi64::<1>(bits));
            let wide = |half: __m256i| {
                if from == Source::Bf16 {
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
                } else {
                    _mm512_cvtph_ps(half)
                }
            };
            pack(wide(low), wide(high), bf16)
        }
    }
}

/// Lane indices of `_mm512_permutex2var_epi16` over two vectors of interleaved `(min, max)` pairs
/// (lanes 0..32 the first vector, 32..64 the second): the mins.
const MINS: [u16; LANES] = {
    let mut lanes = [0u16; LANES];
    let mut j = 0;
    while j < LANES {
        lanes[j] = 2 * j as u16;
        j += 1;
    }
    lanes
};
/// The same over the pairs: the maxes.
const MAXES: [u16; LANES] = {
    let mut lanes = MINS;
    let mut j = 0;
    while j < LANES {
        lanes[j] += 1;
        j += 1;
    }
    lanes
};
/// And back, over a min vector (lanes 0..32) and a max vector (32..64): the pairs of channels
/// 0..16, then of 16..32.
const PAIRS: [[u16; LANES]; 2] = {
    let mut pairs = [[0u16; LANES]; 2];
    let mut j = 0;
    while j < 2 * LANES {
        // Lane `j` of the pairs: channel `j / 2`'s min (even `j`) or max (odd, the second operand).
        let channel = (j / 2) as u16;
        pairs[j / LANES][j % LANES] = if j % 2 == 0 { channel } else { LANES as u16 + channel };
        j += 1;
    }
    pairs
};

/// A vector of 32 lane indices.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn lanes_of(indices: &[u16; LANES]) -> __m512i {
    // SAFETY: 64 readable bytes.
    unsafe { _mm512_loadu_si512(indices.as_ptr().cast()) }
}

/// The row writer of `rows.rs` (`write_rows_impl`) on AVX-512: `k.len() / (kv_heads × head_dim)`
/// tokens of rows into slots from `first` of `page`, a 16-bit page of `format` with a valid header,
/// the same bytes as the scalar writer.
///
/// Panics if the rows or the page disagree with the shape or the slots pass the page's last.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
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

/// Calls of at least this many tokens (a prefill's) have their keys transposed in registers by
/// chunks of 32 and stored a channel at a time; shorter ones (a decode step's token, a few drafts)
/// store them key by key.
const TRANSPOSED: usize = 8;

/// [`write_rows`], the keys transposed by chunks (`TRANSPOSE`) or stored key by key. Two
/// instances of one body: the key-by-key one holds no chunk of vectors, which costs a decode
/// step's call (one token, 0.14 µs a SmolLM2 layer) a sixth more when it is there.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
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
    let infinite = _mm512_set1_epi16(infinity_bits(format) as i16);
    let (mins, maxes) = (lanes_of(&MINS), lanes_of(&MAXES));
    let (low_pairs, high_pairs) = (lanes_of(&PAIRS[0]), lanes_of(&PAIRS[1]));
    let p = page.as_mut_ptr();
    // Consecutive channels of one slot lie this far apart among the keys.
    let channel_stride = 2 * bt;
    // A chunk's keys, a vector a slot (`TRANSPOSE`); the lanes past a chunk's slots or the run's
    // channels are never stored, so what an earlier chunk left there stays.
    let mut chunk = [_mm512_setzero_si512(); LANES];
    for h in 0..heads {
        for d0 in (0..dim).step_by(LANES) {
            let n = LANES.min(dim - d0);
            let (first_pairs, second_pairs) = (below(2 * n), below((2 * n).saturating_sub(LANES)));
            let bounds = p.wrapping_add(shape.bound_byte(h, d0));
            // SAFETY: the `(min, max)` pairs of channels `d0..d0 + n` are the `2n` two-byte lanes
            // from `bounds`, inside the page's bounds region; the masks hold those lanes only.
            let (a, b) = unsafe {
                (
                    _mm512_maskz_loadu_epi16(first_pairs, bounds.cast()),
                    _mm512_maskz_loadu_epi16(second_pairs, bounds.wrapping_add(64).cast()),
                )
            };
            let (mut lo, mut hi) = (_mm512_permutex2var_epi16(a, mins, b), _mm512_permutex2var_epi16(a, maxes, b));
            let mut keys = [0u16; LANES];
            for i in 0..count {
                let slot = first + i;
                let r = (i * heads + h) * dim + d0;
                // SAFETY: `r + n ≤ count × row`, the length of both rows, so elements `r..r + n`
                // are readable.
                let (values, key) =
                    unsafe { (convert(v.as_ptr().add(r), n, format), convert(k.as_ptr().add(r), n, format)) };
                // SAFETY: the values of channels `d0..d0 + n` at `slot` are `n` contiguous
                // two-byte elements from `v_byte(h, slot, d0)`, inside the V region.
                unsafe { _mm512_mask_storeu_epi16(p.add(shape.v_byte(h, slot, d0)).cast(), below(n), values) };
                (lo, hi) = widen(lo, hi, key, infinite);
                if !TRANSPOSE {
                    // SAFETY: 64 writable bytes.
                    unsafe { _mm512_storeu_si512(keys.as_mut_ptr().cast(), key) };
                    let mut place = p.wrapping_add(shape.k_byte(h, d0, slot));
                    for &bits in &keys[..n] {
                        // SAFETY: `place` is `k_byte(h, d0 + j, slot)` for the `j`-th key, `j < n`,
                        // and `slot < block_tokens`: a two-byte key inside the K region.
                        unsafe { place.cast::<u16>().write_unaligned(bits) };
                        place = place.wrapping_add(channel_stride);
                    }
                    continue;
                }
                chunk[i % LANES] = key;
                if i % LANES == LANES - 1 || i + 1 == count {
                    // The chunk's slots `first + start ..= slot`, contiguous in each channel.
                    let (start, tokens) = (first + i / LANES * LANES, i % LANES + 1);
                    for (j, keys) in transpose(&chunk)[..n].iter().enumerate() {
                        // SAFETY: slots `start..=slot` of channel `d0 + j < dim`, `slot <
                        // block_tokens`: `tokens` contiguous two-byte keys from `k_byte(h, d0 + j,
                        // start)`, inside the K region; the mask holds those lanes only.
                        unsafe {
                            let at = p.add(shape.k_byte(h, d0 + j, start));
                            _mm512_mask_storeu_epi16(at.cast(), below(tokens), *keys);
                        }
                    }
                }
            }
            let (a, b) = (_mm512_permutex2var_epi16(lo, low_pairs, hi), _mm512_permutex2var_epi16(lo, high_pairs, hi));
            // SAFETY: the same lanes the loads above read.
            unsafe {
                _mm512_mask_storeu_epi16(bounds.cast(), first_pairs, a);
                _mm512_mask_storeu_epi16(bounds.wrapping_add(64).cast(), second_pairs, b);
            }
        }
    }
}

/// Keys of up to 32 slots, a vector a slot (lane per channel), as a vector a channel (lane per
/// slot): lane `c` of `slots[t]` is lane `t` of the result's `c`.
///
/// Three unpack stages transpose the 8 × 8 blocks inside each 128-bit lane: for a group of eight
/// slots, 16-bit pairs of two slots, then 32-bit pieces of four, then 64-bit halves of eight, so
/// that the group's vector `i` holds, in 128-bit lane `L`, channel `8L + i` at the group's eight
/// slots. Two stages of 128-bit shuffles then carry lane `L` of the four groups' vectors `i` into
/// the result's `8L + i`. 160 shuffles, where storing key by key takes 32 stores a slot.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn transpose(slots: &[__m512i; LANES]) -> [__m512i; LANES] {
    use std::array::from_fn;
    // Per group `g` of eight slots, `8g + k`: slots `2p, 2p + 1` (`p = k / 2`) interleaved, channels
    // 0..4 of each 128-bit lane for even `k`, 4..8 for odd.
    let pairs: [__m512i; LANES] = from_fn(|j| {
        let (a, b) = (slots[j & !1], slots[j | 1]);
        if j % 2 == 0 { _mm512_unpacklo_epi16(a, b) } else { _mm512_unpackhi_epi16(a, b) }
    });
    // Per group, `k < 4` for slots 0..4 and `k ≥ 4` for 4..8: channels `2(k % 4)` and `2(k % 4) + 1`.
    let quads: [__m512i; LANES] = from_fn(|j| {
        let (g, k) = (j & !7, j % 8);
        let x = g + k / 4 * 4 + k % 4 / 2;
        let (a, b) = (pairs[x], pairs[x + 2]);
        if k % 2 == 0 { _mm512_unpacklo_epi32(a, b) } else { _mm512_unpackhi_epi32(a, b) }
    });
    // Per group, `k`: channel `k` of each 128-bit lane at the group's eight slots.
    let blocks: [__m512i; LANES] = from_fn(|j| {
        let (g, k) = (j & !7, j % 8);
        let (a, b) = (quads[g + k / 2], quads[g + k / 2 + 4]);
        if k % 2 == 0 { _mm512_unpacklo_epi64(a, b) } else { _mm512_unpackhi_epi64(a, b) }
    });
    // `4i + m`: 128-bit lanes 0, 1 (`m` even) or 2, 3 (odd) of channel `i`'s blocks of groups
    // `m / 2 × 2` and `m / 2 × 2 + 1`.
    let halves: [__m512i; LANES] = from_fn(|j| {
        let (i, m) = (j / 4, j % 4);
        let (a, b) = (blocks[8 * (m / 2 * 2) + i], blocks[8 * (m / 2 * 2 + 1) + i]);
        if m % 2 == 0 { _mm512_shuffle_i64x2::<0x44>(a, b) } else { _mm512_shuffle_i64x2::<0xee>(a, b) }
    });
    from_fn(|c| {
        let (lane, i) = (c / 8, c % 8);
        let (a, b) = (halves[4 * i + lane / 2], halves[4 * i + 2 + lane / 2]);
        if lane % 2 == 0 { _mm512_shuffle_i64x2::<0x88>(a, b) } else { _mm512_shuffle_i64x2::<0xdd>(a, b) }
    })
}

/// Where the tree of [`level`] leaves channel `c` of 32: lane `8L + 2k + b` for `c = 16b + 4k + L`.
const fn lane_of(c: usize) -> usize {
    8 * (c % 4) + 2 * (c % 16 / 4) + c / 16
}

/// The channel whose lane the tree of [`level`] leaves at `lane` (the inverse of [`lane_of`]).
const fn channel_of(lane: usize) -> usize {
    16 * (lane % 2) + 4 * (lane % 8 / 2) + lane / 8
}

/// Lane indices of `_mm512_permutex2var_epi16` over the reduced minima (lanes 0..32) and maxima
/// (32..64): the `(min, max)` pairs of channels 0..16, then of 16..32, in channel order.
const REDUCED_PAIRS: [[u16; LANES]; 2] = {
    let mut pairs = [[0u16; LANES]; 2];
    let mut j = 0;
    while j < 2 * LANES {
        let lane = lane_of(j / 2) as u16;
        pairs[j / LANES][j % LANES] = if j % 2 == 0 { lane } else { LANES as u16 + lane };
        j += 1;
    }
    pairs
};

/// The running minima and maxima of channels, folded lane by lane, a pair of vectors.
type Folds = (__m512i, __m512i);

/// One level of the tree that reduces 32 channels' [`Folds`] to one pair of vectors, where lane
/// [`lane_of`]`(c)` holds channel `c`'s minimum and maximum: two vectors of the level below become
/// one, each one's lanes folded in half, two shuffles and a min or max each. `LEVEL` 1 folds 256-bit
/// halves, 2 128-bit quarters, 3 64-bit, 4 32-bit and 5 16-bit pieces. 31 pairs for 32 channels,
/// where folding each channel's vector alone takes six instructions.
///
/// What each level leaves (channels numbered within the run it covers):
///
/// ```text
///   level 1, channels a, b:        a in the low 256 bits, b in the high
///   level 2, 4 channels:           channel L in 128-bit lane L
///   level 3, 8 channels:           in 128-bit lane L, channel L in the low 64 bits, 4 + L in the high
///   level 4, 16 channels:          in 128-bit lane L, channel 4k + L in 32-bit piece k
///   level 5, 32 channels:          in 128-bit lane L, piece k: 4k + L in its low 16 bits, 16 + 4k + L
///                                  in its high
/// ```
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn level<const LEVEL: u8>(a: Folds, b: Folds) -> Folds {
    let fold = |a: __m512i, b: __m512i, max: bool| {
        let (x, y) = match LEVEL {
            1 => (_mm512_shuffle_i64x2::<0x44>(a, b), _mm512_shuffle_i64x2::<0xee>(a, b)),
            2 => (_mm512_shuffle_i64x2::<0x88>(a, b), _mm512_shuffle_i64x2::<0xdd>(a, b)),
            3 => (_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b)),
            4 => {
                let (a, b) = (_mm512_castsi512_ps(a), _mm512_castsi512_ps(b));
                (
                    _mm512_castps_si512(_mm512_shuffle_ps::<0x88>(a, b)),
                    _mm512_castps_si512(_mm512_shuffle_ps::<0xdd>(a, b)),
                )
            }
            // The low 16 bits of each 32-bit piece from `a`, the high from `b`; the other halves
            // folded with a shifted-in 0, which neither a max nor (below) a blend keeps.
            _ => {
                let (x, y) = (_mm512_srli_epi32::<16>(a), _mm512_slli_epi32::<16>(b));
                let (a, b) = if max {
                    (_mm512_max_epu16(a, x), _mm512_max_epu16(b, y))
                } else {
                    (_mm512_min_epu16(a, x), _mm512_min_epu16(b, y))
                };
                return _mm512_mask_blend_epi16(0xaaaa_aaaa, a, b);
            }
        };
        if max { _mm512_max_epu16(x, y) } else { _mm512_min_epu16(x, y) }
    };
    (fold(a.0, b.0, false), fold(a.1, b.1, true))
}

/// Zeroes the key slots `keep..block_tokens` of every channel of `keys` (the K region of a 16-bit
/// page: channels of `block_tokens` little-endian 16-bit keys each, `bounds.len() / 4` of them)
/// and writes each channel's `(min, max)` bits into its 4 bytes of `bounds`: exactly what
/// `first_extremes` in `rows.rs` gives for the kept slots, with `infinity` the format's +∞ bits.
///
/// Panics if the lengths disagree or `keep > block_tokens`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) fn truncate_keys(keys: &mut [u8], bounds: &mut [u8], block_tokens: usize, keep: usize, infinity: u16) {
    assert!(keep <= block_tokens && block_tokens > 0, "keep {keep} of {block_tokens} slots");
    assert_eq!(keys.len(), bounds.len() / 4 * 2 * block_tokens, "K region and bounds of one shape");
    // The orders (`raw_order`) shifted so that NaNs pass neither fold.
    let nan_shift = nan_shift(infinity);
    let shift = _mm512_set1_epi16(nan_shift.shift as i16);
    let (zero, ones) = (_mm512_setzero_si512(), _mm512_set1_epi16(-1));
    let (low_pairs, high_pairs) = (lanes_of(&REDUCED_PAIRS[0]), lanes_of(&REDUCED_PAIRS[1]));
    let channels = bounds.len() / 4;
    let kept_vectors = keep.div_ceil(LANES);
    let stride = 2 * block_tokens;
    let base = keys.as_mut_ptr();
    // The vectors of a channel, the lanes of its last kept vector and of its last vector; and where
    // the last kept vector holds slots past `keep`, its lanes inside the channel: it is stored
    // back as loaded, 0 past `keep` (a zero-masked load), the kept slots rewritten as they were.
    let vectors = block_tokens.div_ceil(LANES);
    let last_kept = below(keep - keep.saturating_sub(1) / LANES * LANES);
    let last_lanes = below(block_tokens - (vectors - 1) * LANES);
    let cleared_lanes = if keep.is_multiple_of(LANES) { 0 } else { below(block_tokens - keep / LANES * LANES) };
    for group in (0..channels).step_by(LANES) {
        let n = LANES.min(channels - group);
        // Channel `c` of the group: its kept keys' shifted orders folded over its vectors lane by
        // lane (a channel past `n`: neutral), and its slots past `keep` zeroed.
        let channel = |c: usize| -> Folds {
            let (mut low, mut high) = (ones, zero);
            let p = base.wrapping_add((group + c) * stride);
            for j in 0..kept_vectors {
                let lanes = if j + 1 == kept_vectors { last_kept } else { u32::MAX };
                // SAFETY: slots `32j + lane` for the lanes in `lanes` are below `keep ≤
                // block_tokens`, inside channel `group + c < channels`, whose `2 × block_tokens`
                // bytes lie in `keys`; the masked load reads only those.
                let bits = unsafe { _mm512_maskz_loadu_epi16(lanes, p.add(2 * LANES * j).cast()) };
                let order = raw_order(bits);
                low = _mm512_mask_min_epu16(low, lanes, low, _mm512_sub_epi16(order, shift));
                high = _mm512_mask_max_epu16(high, lanes, high, _mm512_add_epi16(order, shift));
                if j + 1 == kept_vectors && cleared_lanes != 0 {
                    // SAFETY: the lanes of `cleared_lanes` are this vector's slots below
                    // `block_tokens`, inside this channel.
                    unsafe { _mm512_mask_storeu_epi16(p.add(2 * LANES * j).cast(), cleared_lanes, bits) };
                }
            }
            for j in kept_vectors..vectors {
                let lanes = if j + 1 == vectors { last_lanes } else { u32::MAX };
                // SAFETY: slots `32j + lane ≥ keep` for the lanes in `lanes`, below `block_tokens`.
                unsafe { _mm512_mask_storeu_epi16(p.add(2 * LANES * j).cast(), lanes, zero) };
            }
            (low, high)
        };
        let folds: [Folds; LANES] = std::array::from_fn(|c| if c < n { channel(c) } else { (ones, zero) });
        let halves: [Folds; 16] = std::array::from_fn(|i| level::<1>(folds[2 * i], folds[2 * i + 1]));
        let quarters: [Folds; 8] = std::array::from_fn(|i| level::<2>(halves[2 * i], halves[2 * i + 1]));
        let eighths: [Folds; 4] = std::array::from_fn(|i| level::<3>(quarters[2 * i], quarters[2 * i + 1]));
        let (a, b) = (level::<4>(eighths[0], eighths[1]), level::<4>(eighths[2], eighths[3]));
        let (low, high) = level::<5>(a, b);
        // No key entered where the extreme is a NaN's (or the neutral element).
        let no_low = _mm512_cmpgt_epu16_mask(low, _mm512_set1_epi16(nan_shift.highest_min as i16));
        let no_high = _mm512_cmplt_epu16_mask(high, _mm512_set1_epi16(nan_shift.lowest_max as i16));
        let (low, high) = (_mm512_add_epi16(low, shift), _mm512_sub_epi16(high, shift));
        // An extreme's bits: its order with the top bit cleared where it is set, inverted where
        // not (`o ^ (!(o >> 15) | 0x8000)`, the shift arithmetic: ternary-logic 0x4b); where no key
        // entered, the empty bound's.
        let top = _mm512_set1_epi16(ZERO as i16);
        let bits = |o: __m512i| _mm512_ternarylogic_epi32::<0x4b>(o, _mm512_srai_epi16::<15>(o), top);
        let lo = _mm512_mask_mov_epi16(bits(low), no_low, _mm512_set1_epi16(infinity as i16));
        let hi = _mm512_mask_mov_epi16(bits(high), no_high, _mm512_set1_epi16((infinity | 0x8000) as i16));
        let (first_pairs, second_pairs) = (below(2 * n), below((2 * n).saturating_sub(LANES)));
        let at = bounds.as_mut_ptr().wrapping_add(4 * group);
        // SAFETY: the pairs of channels `group..group + n` are the `2n` two-byte lanes from `at`,
        // inside `bounds` (4 bytes a channel); the masks hold those lanes only.
        unsafe {
            _mm512_mask_storeu_epi16(at.cast(), first_pairs, _mm512_permutex2var_epi16(lo, low_pairs, hi));
            _mm512_mask_storeu_epi16(
                at.wrapping_add(64).cast(),
                second_pairs,
                _mm512_permutex2var_epi16(lo, high_pairs, hi),
            );
        }
        // A zero extreme (−0's order 0x7fff or +0's 0x8000) takes the sign of the channel's first
        // zero. The channels past `n` hold the neutral elements: lanes where no key entered.
        let zeros = |o: __m512i, none: __mmask32| {
            _mm512_cmple_epu16_mask(_mm512_sub_epi16(o, _mm512_set1_epi16(0x7fff)), _mm512_set1_epi16(1)) & !none
        };
        let (zero_low, zero_high) = (zeros(low, no_low), zeros(high, no_high));
        if zero_low | zero_high != 0 {
            let bounds_of = |zero: u32, offset: usize| set_bits(zero).map(move |lane| (channel_of(lane), offset));
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
        if !std::is_x86_feature_detected!("avx512bw") {
            return;
        }
        check_transpose::<LANES>(|slots| {
            let mut channels = [[0u16; LANES]; LANES];
            // SAFETY: avx512bw was detected (this kernel's CPUs have f, vl and avx2 with it); every
            // load and store is of 64 bytes of a 64-byte array.
            unsafe {
                let vectors = slots.map(|s| _mm512_loadu_si512(s.as_ptr().cast()));
                for (out, v) in channels.iter_mut().zip(transpose(&vectors)) {
                    _mm512_storeu_si512(out.as_mut_ptr().cast(), v);
                }
            }
            channels
        });
    }
}
