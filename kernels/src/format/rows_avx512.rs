//! AVX-512 key pass of `truncate_rows`: the same bytes as the scalar code of `rows.rs`.
//!
//! A channel's keys are contiguous in slot order (the channel-major K region of
//! [`crate::format::layout`]), so up to 32 slots of one channel are one vector. Per channel:
//!
//! ```text
//!   slots 0 .. keep (kept)                      keep .. block_tokens
//!  ┌───────────────────────────────────────────┬──────────────────┐
//!  │ loaded masked, 32 a vector                 │ masked stores of │
//!  │  bits → unsigned order of their values     │ zero             │
//!  │  (±0 one value, NaN lanes left out)        │                  │
//!  │  min and max folded over the vectors,      │                  │
//!  │  each to one lane (`phminposuw`)           │                  │
//!  │  each extreme's bits: its order inverted,  │                  │
//!  │  or for a zero, the first zero's bits      │                  │
//!  └───────────────────────────────────────────┴──────────────────┘
//! ```
//!
//! The order is the scalar one: a negative key's bits inverted, a positive key's with the top bit
//! set, both zeros mapped to +0's order so the first zero stands whatever its sign. The map is
//! one to one on the other keys, so an extreme other than zero needs no search for its slot. A
//! real key's order is never 0 or `u16::MAX` (those are NaN bits), so they are the neutral
//! elements of max and min, and mean "no key" after the fold.
//!
//! Memory safety rests on the slices the caller passes: every pointer below is derived from
//! `keys`, one channel's `2 × block_tokens` bytes at a time, and every load and store is masked to
//! the lanes of that channel.

use std::arch::x86_64::*;

/// Slots of one channel a vector holds.
const LANES: usize = 32;
/// The order of both zeros.
const ZERO: u16 = 0x8000;

/// The lanes below `n` of a vector.
fn below(n: usize) -> __mmask32 {
    if n >= LANES { u32::MAX } else { (1u32 << n) - 1 }
}

/// The smallest of the 32 unsigned 16-bit lanes of `v`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn fold_min(v: __m512i) -> u16 {
    let half = _mm256_min_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
    let quarter = _mm_min_epu16(_mm256_castsi256_si128(half), _mm256_extracti128_si256::<1>(half));
    // Lane 0 of `phminposuw` holds the minimum, lane 1 its index.
    _mm_extract_epi16::<0>(_mm_minpos_epu16(quarter)) as u16
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
    let magnitude = _mm512_set1_epi16(0x7fff);
    let top = _mm512_set1_epi16(i16::MIN);
    let infinite = _mm512_set1_epi16(infinity as i16);
    let (zero, ones) = (_mm512_setzero_si512(), _mm512_set1_epi16(-1));
    let kept_vectors = keep.div_ceil(LANES);
    for (channel, bound) in keys.chunks_exact_mut(2 * block_tokens).zip(bounds.chunks_exact_mut(4)) {
        let p = channel.as_mut_ptr();
        // The order of vector `j`'s kept slots (`j < kept_vectors`), and which lanes hold a key
        // that is not NaN.
        let order = |j: usize| -> (__m512i, __mmask32) {
            let lanes = below(keep - j * LANES);
            // SAFETY: slots `32j + lane` for the lanes in `lanes` are below `keep ≤ block_tokens`,
            // inside this channel's `2 × block_tokens` bytes; the masked load reads only those.
            let bits = unsafe { _mm512_maskz_loadu_epi16(lanes, p.add(2 * LANES * j).cast()) };
            let nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(bits, magnitude), infinite);
            let zeros = _mm512_testn_epi16_mask(bits, magnitude);
            // bits ^ (sign spread | 0x8000): A ^ (B | C) is 0x1e.
            let order = _mm512_ternarylogic_epi32::<0x1e>(bits, _mm512_srai_epi16::<15>(bits), top);
            (_mm512_mask_mov_epi16(order, zeros, top), lanes & !nan)
        };
        let (mut low, mut high) = (ones, zero);
        for j in 0..kept_vectors {
            let (order, valid) = order(j);
            low = _mm512_mask_min_epu16(low, valid, low, order);
            high = _mm512_mask_max_epu16(high, valid, high, order);
        }
        let (low, high) = (fold_min(low), !fold_min(_mm512_xor_si512(high, ones)));
        // The bits of the kept key of order `target`: the order inverted, but for a zero, whose
        // sign the first zero of the channel gives.
        let bits = |target: u16| match target {
            u16::MAX | 0 => None,
            ZERO => (0..kept_vectors).find_map(|j| {
                let (order, valid) = order(j);
                let hits = _mm512_mask_cmpeq_epu16_mask(valid, order, top);
                let slot = j * LANES + hits.trailing_zeros() as usize;
                // SAFETY: a hit is a lane of `valid`, so `slot < keep`, inside this channel.
                (hits != 0).then(|| unsafe { p.add(2 * slot).cast::<u16>().read_unaligned() })
            }),
            _ if target & ZERO != 0 => Some(target & !ZERO),
            _ => Some(!target),
        };
        let (lo, hi) = (bits(low), bits(high));
        for j in keep / LANES..block_tokens.div_ceil(LANES) {
            let lanes = below(block_tokens - j * LANES) & !below(keep.saturating_sub(j * LANES));
            // SAFETY: the lanes are slots in `keep..block_tokens` of this channel; the masked store
            // writes only those.
            unsafe { _mm512_mask_storeu_epi16(p.add(2 * LANES * j).cast(), lanes, zero) };
        }
        bound[..2].copy_from_slice(&lo.unwrap_or(infinity).to_le_bytes());
        bound[2..].copy_from_slice(&hi.unwrap_or(infinity | 0x8000).to_le_bytes());
    }
}
