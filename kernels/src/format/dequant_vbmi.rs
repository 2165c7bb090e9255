//! AVX-512 VBMI dequantize: the same floats as the scalar code of `quant.rs`, with the key
//! transpose done on code bytes.
//!
//! Keys are channel-major and the output is token-major, so every 16 channels × 16 tokens of key
//! codes are transposed. The AVX-512 F/BW dequantizer (`quant_avx512.rs`) converts each channel's
//! 16 codes to `f32` and transposes 16 × 16 floats (64 shuffles); here the codes are transposed
//! while still bytes, which takes a quarter of the shuffles:
//!
//! 1. **Unpack.** The tile's 16 code rows (16 tokens each) are loaded into registers, one load of
//!    their own width per row, and widened to one byte per code: 8-bit codes as they are; 4- and
//!    2-bit codes with `vpmultishiftqb` (each output byte an 8-bit window of its qword at a chosen
//!    bit offset, here the offsets of consecutive codes) and a mask, after `vpmovzx` gave each 8
//!    codes their own qword. Each 64-byte vector then holds 4 channels × 16 tokens, channel-major.
//! 2. **Transpose.** One `vpermb` per vector makes it token-major (dword `t` = the 4 channels'
//!    codes of token `t`); a 4 × 4 dword transpose of the 4 vectors of the tile (8 unpacks) leaves
//!    each token's 16 channel codes in one 128-bit lane. The 4 vectors go to a stack buffer, with
//!    the tile's 16 channel parameters decoded to a `scale` and a `min` vector.
//! 3. **Widen.** Per token, the tiles of a chunk of KV heads in channel order, which is one run of
//!    the token's output row: `vpmovzxbd` of the token's 16 bytes from the stack buffer (a load and
//!    one shuffle), `vcvtdq2ps` and one FMA with the tile's `scale` and `min`, which equals the
//!    scalar `min + scale × code` (the product is exact), then a 64-byte store.
//!
//! Values are token-major already: per 16 tokens of a group the 16 parameter pairs are decoded at
//! once and stored as floats, and each token's pair is two broadcast loads (load ports, not
//! shuffles) for the FMA of its codes. Both loops are flat runs over a token's row, with few scalar
//! operations per 16 elements; with a loop per KV head and per value group inside, the profile
//! showed most of the time in the loops' bookkeeping (`KVMM_BENCH_DEQUANTIZE=smollm2/q4 cargo bench -p
//! kvmm-kernels --bench quantize`, 2026-12-02, in one sitting: to f32 rows SmolLM2 q4 8.26 → 11.36,
//! q8 8.61 → 11.59, Llama-3-8B q4 9.06 → 11.45, q8 9.09 → 11.33 G elements/s).
//!
//! Needs `block_tokens` a multiple of 16 (the dispatcher in `quant.rs` checks) and AVX-512 VBMI
//! besides F/BW/VL (the dispatcher runs it for [`crate::Isa::Avx512Vnni`] only). Memory safety
//! rests on the lengths checked by the callers in `quant.rs`: every pointer below is derived from
//! a page slice at an offset the [`QuantLayout`] computes, an output slice, or a stack buffer, and
//! stays inside the region the comment at its use names.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use crate::attention::avx512_quant::params16;
use crate::format::quant::{QuantLayout, V_GROUP};

const LANES: usize = 16;

/// `vpermb` indices turning 4 channel rows of 16 byte codes (channel-major, 16 bytes each) into 16
/// dwords of 4 channel codes (token-major): byte `4t + c` takes byte `16c + t`.
const TOKEN_MAJOR: [u8; 64] = {
    let mut idx = [0u8; 64];
    let mut t = 0;
    while t < 16 {
        let mut c = 0;
        while c < 4 {
            idx[4 * t + c] = (16 * c + t) as u8;
            c += 1;
        }
        t += 1;
    }
    idx
};

/// Dequantizes the first `tokens` slots of the quantized page `page` into token-major rows.
///
/// # Safety
///
/// The CPU must support avx512f, avx512bw, avx512vl, avx512vbmi, avx2, fma and f16c; `page` is at
/// least `layout`'s page bytes long; `k_out` and `v_out` hold `tokens × kv_heads × head_dim`
/// floats; `tokens ≤ block_tokens`, `block_tokens` a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(crate) unsafe fn dequantize(
    layout: &QuantLayout,
    page: &[u8],
    tokens: usize,
    k_out: &mut [f32],
    v_out: &mut [f32],
) {
    // SAFETY: same features and contract; the widths match the layout's.
    unsafe {
        match (layout.k_bits, layout.v_bits) {
            (8, 8) => dequantize_in::<8, 8>(layout, page, tokens, k_out, v_out),
            (8, 4) => dequantize_in::<8, 4>(layout, page, tokens, k_out, v_out),
            (4, 4) => dequantize_in::<4, 4>(layout, page, tokens, k_out, v_out),
            _ => dequantize_in::<2, 2>(layout, page, tokens, k_out, v_out),
        }
    }
}

/// [`dequantize`] for `KB`-bit keys and `VB`-bit values.
///
/// # Safety
///
/// As for [`dequantize`], with the layout's widths equal to `KB` and `VB`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn dequantize_in<const KB: usize, const VB: usize>(
    layout: &QuantLayout,
    page: &[u8],
    tokens: usize,
    k_out: &mut [f32],
    v_out: &mut [f32],
) {
    let shape = layout.shape;
    let (heads, dim, block) = (shape.kv_heads, shape.head_dim, shape.block_tokens);
    let bytes = page.as_ptr();
    let (k_out, v_out) = (k_out.as_mut_ptr(), v_out.as_mut_ptr());
    // SAFETY: a 64-byte table.
    let token_major = unsafe { _mm512_loadu_si512(TOKEN_MAJOR.as_ptr().cast()) };
    let row = layout.k_row_bytes();
    // The transposed key tiles (4 vectors per 16 channels) and channel parameters of up to
    // `CHUNK` KV heads, and their value parameters as floats (16 tokens per group, scales then
    // minimums), read back per token by broadcast loads.
    const CHUNK: usize = 8;
    const GROUPS: usize = 256 / V_GROUP;
    let per_head = dim / LANES;
    let mut stack = MaybeUninit::<[__m512i; CHUNK * 4 * 256 / LANES]>::uninit();
    let tiles = stack.as_mut_ptr().cast::<__m512i>();
    let mut stack = MaybeUninit::<[__m512; CHUNK * 2 * 256 / LANES]>::uninit();
    let k_params = stack.as_mut_ptr().cast::<__m512>();
    let mut stack = MaybeUninit::<[__m512; CHUNK * 2 * GROUPS]>::uninit();
    let v_params = stack.as_mut_ptr().cast::<__m512>();
    let groups = layout.v_groups();
    // Block by block of 16 tokens and chunk by chunk of KV heads, so each output row is written in
    // runs of `CHUNK × 4 × dim` bytes: the output is larger than L1, and 64-byte stores across 16
    // rows 4 KB apart would all fall into the same few L1 sets (measured at a third of the
    // bandwidth of whole rows).
    for t0 in (0..tokens).step_by(LANES) {
        let count = (tokens - t0).min(LANES);
        for h0 in (0..heads).step_by(CHUNK) {
            let chunk = (heads - h0).min(CHUNK);
            for c in 0..chunk {
                let h = h0 + c;
                for (i, d0) in (0..dim).step_by(LANES).enumerate() {
                    let tile = c * per_head + i;
                    let first = layout.k_codes(h) + d0 * row + t0 * KB / 8;
                    // SAFETY: the 16 key pairs of channels `d0..d0 + 16 ≤ dim` of head `h`; 16 code
                    // rows of `2 × KB` bytes from token `t0` (`t0 + 16 ≤ block`) of those channels,
                    // inside its key codes; stack vectors of tile `tile < CHUNK × 16`.
                    unsafe {
                        let (scale, min) = params16(bytes.add(layout.k_param(h, d0)));
                        *k_params.add(2 * tile) = scale;
                        *k_params.add(2 * tile + 1) = min;
                        let t = transpose_tile::<KB>(bytes.add(first), row, token_major);
                        for (k, t) in t.iter().enumerate() {
                            *tiles.add(4 * tile + k) = *t;
                        }
                    }
                }
                for g in 0..groups {
                    // SAFETY: the 16 pairs of tokens `t0..t0 + 16 ≤ block` of group `g < GROUPS`
                    // of head `h`; stack vectors `2 × (c × GROUPS + g) + 1 < CHUNK × 2 × GROUPS`.
                    unsafe {
                        let (scale, min) = params16(bytes.add(layout.v_param(h, g, t0)));
                        *v_params.add(2 * (c * GROUPS + g)) = scale;
                        *v_params.add(2 * (c * GROUPS + g) + 1) = min;
                    }
                }
            }
            // Keys: the chunk's tiles in channel order are one run of its heads' output row.
            let run = chunk * per_head;
            for j in 0..count {
                let out = ((t0 + j) * heads + h0) * dim;
                // Token `4m + k` of a tile is 128-bit lane `m` of its transposed vector `k`.
                let codes = tiles.cast::<u8>().wrapping_add(64 * (j % 4) + 16 * (j / 4));
                for tile in 0..run {
                    // SAFETY: the stack bytes and vectors of tile `tile < run` written above; floats
                    // `16 × tile .. 16 × tile + 16 ≤ chunk × dim` of the run of heads `h0 .. h0 +
                    // chunk` in output row `t0 + j < tokens`.
                    unsafe {
                        let codes = _mm_load_si128(codes.add(256 * tile).cast());
                        let x = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)),
                            *k_params.add(2 * tile),
                            *k_params.add(2 * tile + 1),
                        );
                        _mm512_storeu_ps(k_out.add(out + LANES * tile), x);
                    }
                }
            }
            // Values: each token's pair of a group broadcast from the stacked parameters.
            let pairs = v_params.cast::<f32>();
            for j in 0..count {
                let t = t0 + j;
                for c in 0..chunk {
                    let codes = bytes.wrapping_add(layout.v_codes(h0 + c) + t * layout.v_row_bytes());
                    let out = v_out.wrapping_add((t * heads + h0 + c) * dim);
                    let pair = pairs.wrapping_add(2 * LANES * c * GROUPS + j);
                    for i in 0..per_head {
                        let g = i * LANES / V_GROUP;
                        // SAFETY: the stack floats written above (group `g < groups`, lane `j`);
                        // 16 codes of channels `16i..16i + 16 ≤ dim` of token `t` of head `h0 + c`;
                        // 16 floats of its output row.
                        unsafe {
                            let scale = _mm512_set1_ps(*pair.add(2 * LANES * g));
                            let min = _mm512_set1_ps(*pair.add(2 * LANES * g + LANES));
                            let x = _mm512_fmadd_ps(widen16::<VB>(codes.add(i * LANES * VB / 8)), scale, min);
                            _mm512_storeu_ps(out.add(LANES * i), x);
                        }
                    }
                }
            }
        }
    }
    debug_assert!(block.is_multiple_of(LANES));
}

/// Transposes 16 channel rows × 16 tokens of `KB`-bit codes (`2 × KB` bytes at `rows + r × row`
/// for row `r`) into 16 token rows of 16 byte codes: token `4m + k`'s codes are 128-bit lane `m`
/// of vector `k` of the result. The row segments are gathered into registers with loads of their own width (a copy
/// through memory would make the wide loads wait for narrow stores).
///
/// # Safety
///
/// `rows + r × row` readable for `2 × KB` bytes for every `r < 16`; `token_major` is
/// [`TOKEN_MAJOR`]; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn transpose_tile<const KB: usize>(rows: *const u8, row: usize, token_major: __m512i) -> [__m512i; 4] {
    // Four vectors of 4 channels × 16 byte codes, channel-major.
    let mut quads = [_mm512_setzero_si512(); 4];
    let at = |r: usize| rows.wrapping_add(r * row);
    // SAFETY: every load below reads `2 × KB` bytes of one of the 16 rows.
    unsafe {
        match KB {
            8 => {
                for (a, quad) in quads.iter_mut().enumerate() {
                    let x = _mm512_castsi128_si512(_mm_loadu_si128(at(4 * a).cast()));
                    let x = _mm512_inserti32x4::<1>(x, _mm_loadu_si128(at(4 * a + 1).cast()));
                    let x = _mm512_inserti32x4::<2>(x, _mm_loadu_si128(at(4 * a + 2).cast()));
                    *quad = _mm512_inserti32x4::<3>(x, _mm_loadu_si128(at(4 * a + 3).cast()));
                }
            }
            4 => {
                // 4 rows of 8 bytes (two dwords of 8 nibble codes each) per vector; each dword to
                // its own qword, then byte `i` of a qword is the nibble at bit `4i`.
                let shifts = _mm512_set1_epi64(0x1c18_1410_0c08_0400);
                let q = |r: usize| at(r).cast::<i64>().read_unaligned();
                for (a, quad) in quads.iter_mut().enumerate() {
                    let dwords = _mm256_set_epi64x(q(4 * a + 3), q(4 * a + 2), q(4 * a + 1), q(4 * a));
                    let spread = _mm512_multishift_epi64_epi8(shifts, _mm512_cvtepu32_epi64(dwords));
                    *quad = _mm512_and_si512(spread, _mm512_set1_epi8(0x0f));
                }
            }
            _ => {
                // 4 rows of 4 bytes (two words of 8 crumb codes each) per vector; each word to its
                // own qword, then byte `i` of a qword is the crumb at bit `2i`.
                let shifts = _mm512_set1_epi64(0x0e0c_0a08_0604_0200);
                let d = |r: usize| at(r).cast::<i32>().read_unaligned();
                for (a, quad) in quads.iter_mut().enumerate() {
                    let words = _mm_set_epi32(d(4 * a + 3), d(4 * a + 2), d(4 * a + 1), d(4 * a));
                    let spread = _mm512_multishift_epi64_epi8(shifts, _mm512_cvtepu16_epi64(words));
                    *quad = _mm512_and_si512(spread, _mm512_set1_epi8(0x03));
                }
            }
        }
    }
    // Token-major: dword `t` of quad `a` = the codes of channels `4a .. 4a + 4` at token `t`.
    for quad in quads.iter_mut() {
        *quad = _mm512_permutexvar_epi8(token_major, *quad);
    }
    // 4 × 4 dword transposes per 128-bit lane `m`: lane `m` of vector `k` = token `4m + k`.
    let low01 = _mm512_unpacklo_epi32(quads[0], quads[1]);
    let high01 = _mm512_unpackhi_epi32(quads[0], quads[1]);
    let low23 = _mm512_unpacklo_epi32(quads[2], quads[3]);
    let high23 = _mm512_unpackhi_epi32(quads[2], quads[3]);
    [
        _mm512_unpacklo_epi64(low01, low23),
        _mm512_unpackhi_epi64(low01, low23),
        _mm512_unpacklo_epi64(high01, high23),
        _mm512_unpackhi_epi64(high01, high23),
    ]
}

/// `vpmultishiftqb` controls for [`widen16`]: byte 0 of the qword of dwords `2q, 2q + 1` takes the
/// bits of code `2q`, byte 4 those of code `2q + 1`, for `B`-bit codes (the other bytes are masked
/// to zero).
const fn widen_shifts(b: u64) -> [u64; 8] {
    let mut ctrl = [0u64; 8];
    let mut q = 0;
    while q < 8 {
        ctrl[q] = (2 * q as u64 * b) | ((2 * q as u64 + 1) * b) << 32;
        q += 1;
    }
    ctrl
}

/// The controls of [`widen_shifts`] for 4- and 2-bit codes.
const WIDEN_SHIFTS: [[u64; 8]; 2] = [widen_shifts(4), widen_shifts(2)];

/// 16 consecutive `B`-bit codes starting at `src` (code `i` at bit `i × B`), widened to `f32` in
/// order: for 8 bits `vpmovzxbd`; for 4 and 2 bits the `2 × B` code bytes broadcast to every qword
/// and each dword's low byte cut out at its code's bit offset by one zero-masking
/// `vpmultishiftqb`, then masked to the code's width. The same values as `avx512_quant::codes16`,
/// with three vector operations instead of five for the narrow codes.
///
/// # Safety
///
/// `src` must be valid for reading `2 × B` bytes; the CPU must support the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn widen16<const B: usize>(src: *const u8) -> __m512 {
    // Byte 0 of every dword.
    const LOW_BYTES: __mmask64 = 0x1111_1111_1111_1111;
    // SAFETY: the caller guarantees `2 × B` readable bytes; each load reads exactly that many, and
    // the tables are 64 bytes.
    let lanes = unsafe {
        match B {
            8 => _mm512_cvtepu8_epi32(_mm_loadu_si128(src.cast())),
            4 => {
                let codes = _mm512_set1_epi64(src.cast::<i64>().read_unaligned());
                let ctrl = _mm512_loadu_si512(WIDEN_SHIFTS[0].as_ptr().cast());
                _mm512_and_si512(_mm512_maskz_multishift_epi64_epi8(LOW_BYTES, ctrl, codes), _mm512_set1_epi32(0xf))
            }
            _ => {
                // The 4 code bytes twice per qword: windows past bit 32 read the copy, and the mask
                // keeps only each code's own bits.
                let codes = _mm512_set1_epi32(src.cast::<i32>().read_unaligned());
                let ctrl = _mm512_loadu_si512(WIDEN_SHIFTS[1].as_ptr().cast());
                _mm512_and_si512(_mm512_maskz_multishift_epi64_epi8(LOW_BYTES, ctrl, codes), _mm512_set1_epi32(0x3))
            }
        }
    };
    _mm512_cvtepi32_ps(lanes)
}
