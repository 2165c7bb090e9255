//! Writing and reading token rows of a 16-bit page.
//!
//! Rows arrive the way a model produces them, token-major: `k[(t × kv_heads + h) × head_dim + d]` for
//! token `t` of the batch, KV head `h`, channel `d` (the same for `v`). They are scattered into the
//! page layout of [`crate::format::layout`]: keys transposed into channel-major order, values copied
//! row by row. Every write also widens the page's key bounds to include the keys written (as
//! stored, after rounding; NaN keys are left out).
//!
//! The page must carry a valid header for the shape and format ([`crate::format::header::init_page`]
//! writes one); a page without one is refused before any byte is written. Quantized pages are never
//! written row by row (they are produced whole by [`crate::format::quant::quantize`]).
//!
//! Conversion from `f32` rounds to nearest, ties to even, for both f16 and bf16 (the `half` crate's
//! rule); values too large for f16 become ±infinity, NaN stays NaN. Rows that are already 16-bit
//! ([`RowElement`] for `f16` and `bf16`) are copied bit for bit into a page of their own format and
//! rounded once into the other.
//!
//! Clients write into shared memory they mapped themselves, where no `&mut [u8]` exists yet:
//! [`write_rows_raw`] takes a pointer and length and is the one place that builds the slice; every
//! entry point then runs the same private writer.

use half::{bf16, f16};

use crate::attention::Isa;
use crate::error::KernelError;
use crate::format::header::PageHeader;
use crate::format::{Format, PageShape};

/// An element type rows can be written from: `f32`, or 16-bit [`f16`](struct@f16) and
/// [`bf16`](struct@bf16) rows an engine already holds. An element is rounded once, to nearest-even,
/// into the page's format; a 16-bit element written into a page of its own format is copied bit for
/// bit. The trait is sealed: these three are the types a page's conversion rules are written for.
pub trait RowElement: Copy + sealed::Encode {}

impl RowElement for f32 {}
impl RowElement for f16 {}
impl RowElement for bf16 {}

mod sealed {
    use half::slice::HalfFloatSliceExt;
    use half::{bf16, f16};

    use crate::format::Format;

    /// What a [`super::RowElement`] is, for the vector writer, which converts each kind itself.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Source {
        /// `f32`, 4 bytes.
        F32,
        /// `f16`, 2 bytes.
        F16,
        /// `bf16`, 2 bytes.
        Bf16,
    }

    /// The conversion of a [`super::RowElement`] into a 16-bit page's elements.
    pub trait Encode: Sized {
        /// Which element this is.
        const SOURCE: Source;

        /// The 16-bit pattern of `x` in `format` (f16 or bf16; any other format encodes as f16).
        fn encode(x: Self, format: Format) -> u16;

        /// [`Encode::encode`] of every element of `src` into `dst` (of the same length).
        fn encode_slice(src: &[Self], dst: &mut [u16], format: Format)
        where
            Self: Copy,
        {
            for (d, &x) in dst.iter_mut().zip(src) {
                *d = Self::encode(x, format);
            }
        }
    }

    impl Encode for f32 {
        const SOURCE: Source = Source::F32;

        fn encode(x: f32, format: Format) -> u16 {
            match format {
                Format::Bf16 => bf16::from_f32(x).to_bits(),
                _ => f16::from_f32(x).to_bits(),
            }
        }

        fn encode_slice(src: &[f32], dst: &mut [u16], format: Format) {
            match format {
                Format::Bf16 => {
                    for (d, &x) in dst.iter_mut().zip(src) {
                        *d = bf16::from_f32(x).to_bits();
                    }
                }
                // Eight at a time with F16C where the CPU has it; the same rounding.
                _ => half::slice::HalfBitsSliceExt::reinterpret_cast_mut::<f16>(dst).convert_from_f32_slice(src),
            }
        }
    }

    impl Encode for f16 {
        const SOURCE: Source = Source::F16;

        fn encode(x: f16, format: Format) -> u16 {
            match format {
                // f16 → f32 is exact, so this rounds once, from the f16 value.
                Format::Bf16 => bf16::from_f32(x.to_f32()).to_bits(),
                _ => x.to_bits(),
            }
        }
    }

    impl Encode for bf16 {
        const SOURCE: Source = Source::Bf16;

        fn encode(x: bf16, format: Format) -> u16 {
            match format {
                Format::Bf16 => x.to_bits(),
                // bf16 → f32 is exact, so this rounds once, from the bf16 value.
                _ => f16::from_f32(x.to_f32()).to_bits(),
            }
        }
    }

    /// Decodes 16-bit elements of `format` to `f32`, exactly (eight at a time with F16C).
    pub fn decode_slice(format: Format, src: &[u16], dst: &mut [f32]) {
        match format {
            Format::Bf16 => {
                for (d, &b) in dst.iter_mut().zip(src) {
                    *d = f32::from_bits(u32::from(b) << 16);
                }
            }
            _ => half::slice::HalfBitsSliceExt::reinterpret_cast::<f16>(src).convert_to_f32_slice(dst),
        }
    }
}

pub(crate) use sealed::Source;

/// Which element `E` is.
pub(crate) const fn source_of<E: RowElement>() -> Source {
    E::SOURCE
}

/// For the vector truncate kernels: gives each bound `(c, offset)` of `zeros` (channel `group + c`,
/// `c < n`; offset 0 its min, 2 its max), whose extreme is a zero, the bits of that channel's first
/// kept zero. −0 and +0 are one value to the rule, whose first copy stands; rare in real keys.
/// `keys` holds the channels `stride` bytes apart, `bounds` their `(min, max)` pairs, 4 bytes each.
/// A `c` past `n` is passed over.
///
/// # Safety
///
/// `keys` must be valid for reads of the first `2 × keep` bytes of each channel `group + c`, `c < n`,
/// and not be written meanwhile.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn first_zeros(
    keys: *const u8,
    stride: usize,
    keep: usize,
    (group, n): (usize, usize),
    bounds: &mut [u8],
    zeros: impl Iterator<Item = (usize, usize)>,
) {
    for (c, offset) in zeros.filter(|&(c, _)| c < n) {
        // SAFETY: the first `2 × keep` bytes of channel `group + c`, `c < n`, as the caller
        // guarantees.
        let channel = unsafe { std::slice::from_raw_parts(keys.add((group + c) * stride), 2 * keep) };
        let first = channel.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).find(|b| b & 0x7fff == 0);
        let sign = first.expect("a zero extreme is a kept key");
        bounds[4 * (group + c) + offset..][..2].copy_from_slice(&sign.to_le_bytes());
    }
}

/// For the vector truncate kernels: how the unsigned order of key bits (a negative key's bits
/// inverted, a positive key's with the top bit set) is shifted so that NaNs need no mask. Of the
/// `nans` NaN magnitudes above +∞'s, the negative NaNs come first in that order (orders
/// `0..nans`) and the positive ones last. Shifted down by `nans` (wrapping), every NaN lies above
/// every key, so a minimum passes them over; shifted up by `nans`, below every key, so a maximum
/// does.
#[cfg(target_arch = "x86_64")]
pub(crate) struct NanShift {
    /// `nans`, the shift.
    pub(crate) shift: u16,
    /// The largest shifted-down order of a key (+∞'s): a minimum above it saw no key.
    pub(crate) highest_min: u16,
    /// The smallest shifted-up order of a key (−∞'s): a maximum below it saw no key.
    pub(crate) lowest_max: u16,
}

/// The [`NanShift`] of a 16-bit format whose +∞ bits are `infinity`.
#[cfg(target_arch = "x86_64")]
pub(crate) const fn nan_shift(infinity: u16) -> NanShift {
    let nans = 0x7fff - infinity;
    NanShift { shift: nans, highest_min: (0x8000 | infinity) - nans, lowest_max: (0x7fff ^ infinity) + nans }
}

/// The positions of the set bits of `mask`, lowest first.
#[cfg(target_arch = "x86_64")]
pub(crate) fn set_bits(mut mask: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (mask != 0).then(|| {
            let bit = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            bit
        })
    })
}

/// For the vector writers' tests: checks that `transpose` turns the vectors of `N` slots (lane
/// `c` of slot `t` holding `t << 8 | c`) into those of their `N` channels (lane `t` of channel `c`).
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) fn check_transpose<const N: usize>(transpose: impl FnOnce([[u16; N]; N]) -> [[u16; N]; N]) {
    use std::array::from_fn;
    let channels = transpose(from_fn(|t| from_fn(|c| (t << 8 | c) as u16)));
    for (c, channel) in channels.iter().enumerate() {
        for (t, &x) in channel.iter().enumerate() {
            assert_eq!(x, (t << 8 | c) as u16, "channel {c}, slot {t}");
        }
    }
}

/// The bits of +∞ in `format` (f16 or bf16; any other format as f16): the empty lower key bound,
/// and with the sign bit set the empty upper one. A key whose magnitude bits exceed them is NaN.
pub(crate) const fn infinity_bits(format: Format) -> u16 {
    match format {
        Format::Bf16 => 0x7f80,
        _ => 0x7c00,
    }
}

/// Decodes one 16-bit element of `format` (f16 or bf16; any other format reads as f16) to `f32`,
/// exactly.
pub(crate) fn decode(format: Format, bits: u16) -> f32 {
    match format {
        Format::Bf16 => bf16::from_bits(bits).to_f32(),
        _ => f16::from_bits(bits).to_f32(),
    }
}

/// Checks the format, the page's header, row lengths against the shape and the token range against
/// the page; returns the number of tokens the rows hold.
fn check_rows(
    shape: PageShape,
    format: Format,
    page: &[u8],
    first_token: usize,
    k_len: usize,
    v_len: usize,
) -> Result<usize, KernelError> {
    if format.is_quantized() {
        return Err(KernelError::NotRowWritable { format });
    }
    PageHeader::validate(shape, format, page)?;
    let row = shape.kv_heads * shape.head_dim;
    for (which, len) in [("keys", k_len), ("values", v_len)] {
        if len % row != 0 {
            return Err(KernelError::RowLength { which, got: len, kv_heads: shape.kv_heads, head_dim: shape.head_dim });
        }
    }
    if k_len != v_len {
        return Err(KernelError::KeyValueMismatch { k_len, v_len });
    }
    let count = k_len / row;
    if first_token.checked_add(count).is_none_or(|end| end > shape.block_tokens) {
        return Err(KernelError::TokenRange { first: first_token, count, block_tokens: shape.block_tokens });
    }
    Ok(count)
}

fn store(page: &mut [u8], at: usize, bits: u16) {
    page[at..at + 2].copy_from_slice(&bits.to_le_bytes());
}

fn load(page: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([page[at], page[at + 1]])
}

/// Channels of one KV head converted and compared together: whole heads of the usual sizes (64,
/// 128) in one or two steps, on the stack.
const CHANNELS: usize = 64;

/// Widens running per-channel bounds (values and their bits) to `keys` (with their `bits`): a key
/// replaces a bound it passes or a NaN bound; comparisons with a NaN key are false, so it never
/// enters. Branch-free and indexed over equal lengths, so the compiler runs it on vectors.
#[inline(always)]
fn widen(keys: &[f32], bits: &[u16], lo: (&mut [f32], &mut [u16]), hi: (&mut [f32], &mut [u16])) {
    let n = keys.len();
    let (keys, bits) = (&keys[..n], &bits[..n]);
    let (lo, lo_bits, hi, hi_bits) = (&mut lo.0[..n], &mut lo.1[..n], &mut hi.0[..n], &mut hi.1[..n]);
    for j in 0..n {
        let x = keys[j];
        let below = (x < lo[j]) | lo[j].is_nan();
        let above = (x > hi[j]) | hi[j].is_nan();
        lo[j] = if below { x } else { lo[j] };
        lo_bits[j] = if below { bits[j] } else { lo_bits[j] };
        hi[j] = if above { x } else { hi[j] };
        hi_bits[j] = if above { bits[j] } else { hi_bits[j] };
    }
}

/// The one row writer behind every public entry point. Per KV head and run of [`CHANNELS`]
/// channels, token by token: the values converted into their contiguous row, the keys converted and
/// spread over their channel-major places, and the key bounds widened to the keys as stored (NaN
/// keys never enter; a NaN bound, a corrupt summary, is replaced by the first key), in token order
/// per channel.
///
/// `isa` MUST have passed [`Isa::is_available`]; on AVX-512 and AVX2 the writers of
/// `rows_avx512.rs` and `rows_avx2.rs` run instead, with the same result.
fn write_rows_impl<E: RowElement>(
    isa: Isa,
    shape: PageShape,
    format: Format,
    page: &mut [u8],
    first_token: usize,
    k: &[E],
    v: &[E],
) -> Result<(), KernelError> {
    let count = check_rows(shape, format, page, first_token, k.len(), v.len())?;
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() {
        // SAFETY: `isa` passed `is_available`, so avx512f/bw/vl, avx2 and f16c were detected.
        unsafe { super::rows_avx512::write_rows(shape, format, page, first_token, k, v) };
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: `isa` passed `is_available`, so avx2, fma and f16c were detected.
        unsafe { super::rows_avx2::write_rows(shape, format, page, first_token, k, v) };
        return Ok(());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    let (heads, dim) = (shape.kv_heads, shape.head_dim);
    // Consecutive channels of one token lie this far apart among the keys.
    let channel_stride = 2 * shape.block_tokens;
    let mut bits = [0u16; CHANNELS];
    let mut keys = [0f32; CHANNELS];
    let (mut lo_bits, mut hi_bits) = ([0u16; CHANNELS], [0u16; CHANNELS]);
    let (mut lo, mut hi) = ([0f32; CHANNELS], [0f32; CHANNELS]);
    for h in 0..heads {
        for d0 in (0..dim).step_by(CHANNELS) {
            let n = CHANNELS.min(dim - d0);
            for j in 0..n {
                let at = shape.bound_byte(h, d0 + j);
                (lo_bits[j], hi_bits[j]) = (load(page, at), load(page, at + 2));
            }
            sealed::decode_slice(format, &lo_bits[..n], &mut lo[..n]);
            sealed::decode_slice(format, &hi_bits[..n], &mut hi[..n]);
            for i in 0..count {
                let slot = first_token + i;
                let row = (i * heads + h) * dim + d0;
                E::encode_slice(&v[row..row + n], &mut bits[..n], format);
                let at = shape.v_byte(h, slot, d0);
                for (dst, b) in page[at..at + 2 * n].chunks_exact_mut(2).zip(&bits[..n]) {
                    dst.copy_from_slice(&b.to_le_bytes());
                }
                E::encode_slice(&k[row..row + n], &mut bits[..n], format);
                let at = shape.k_byte(h, d0, slot);
                let places = page[at..at + (n - 1) * channel_stride + 2].chunks_mut(channel_stride);
                for (dst, b) in places.zip(&bits[..n]) {
                    dst[..2].copy_from_slice(&b.to_le_bytes());
                }
                sealed::decode_slice(format, &bits[..n], &mut keys[..n]);
                widen(&keys[..n], &bits[..n], (&mut lo[..n], &mut lo_bits[..n]), (&mut hi[..n], &mut hi_bits[..n]));
            }
            for j in 0..n {
                let at = shape.bound_byte(h, d0 + j);
                store(page, at, lo_bits[j]);
                store(page, at + 2, hi_bits[j]);
            }
        }
    }
    Ok(())
}

/// Writes `n` tokens of key and value rows into token slots `first_token..first_token + n` of
/// `page`, each element rounded once to nearest-even in `format` ([`RowElement`]: `f32`, or 16-bit
/// rows, copied bit for bit into a page of their own format).
///
/// `k` and `v` each hold `n × kv_heads × head_dim` elements, token-major
/// (`k[(t × kv_heads + h) × head_dim + d]`). Slots outside the range are left untouched.
pub fn write_rows<E: RowElement>(
    shape: PageShape,
    format: Format,
    page: &mut [u8],
    first_token: usize,
    k: &[E],
    v: &[E],
) -> Result<(), KernelError> {
    write_rows_impl(Isa::detect(), shape, format, page, first_token, k, v)
}

/// [`write_rows`] with a chosen kernel (for tests and benchmarks); every kernel writes the same
/// bytes. The AVX-512 and AVX2 writers convert 32 and 16 elements a vector and widen the bounds
/// on their bits (`rows_avx512.rs`, `rows_avx2.rs`).
pub fn write_rows_with<E: RowElement>(
    isa: Isa,
    shape: PageShape,
    format: Format,
    page: &mut [u8],
    first_token: usize,
    k: &[E],
    v: &[E],
) -> Result<(), KernelError> {
    if !isa.is_available() {
        return Err(KernelError::IsaUnavailable { isa: isa.name() });
    }
    write_rows_impl(isa, shape, format, page, first_token, k, v)
}

/// [`write_rows`] into memory given by pointer and length, for pages in a mapping the caller made.
///
/// # Safety
///
/// `ptr` must be valid for reads and writes of `len` bytes for the whole call, and nothing else may
/// read or write those bytes while it runs: no reference to them in this process, and no other
/// process writing them (a tail page the caller owns, or a page it has pinned for writing).
pub unsafe fn write_rows_raw<E: RowElement>(
    ptr: *mut u8,
    len: usize,
    shape: PageShape,
    format: Format,
    first_token: usize,
    k: &[E],
    v: &[E],
) -> Result<(), KernelError> {
    // SAFETY: the caller guarantees `ptr..ptr + len` is valid for reads and writes and not accessed
    // by anyone else during this call, which is what a `&mut [u8]` of that extent requires.
    let page = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
    write_rows_impl(Isa::detect(), shape, format, page, first_token, k, v)
}

/// Keeps the first `keep` token slots of a 16-bit page and blanks the rest: the keys and values of
/// slots `keep..block_tokens` are zeroed and the key bounds recomputed over the kept keys, by the
/// rule and in the token order [`write_rows`] widens them, so the page is byte for byte what writing
/// its kept rows into a blank page leaves (a zeroed frame given
/// [`init_page`](crate::format::header::init_page)). For a client that takes tokens back.
pub fn truncate_rows(shape: PageShape, format: Format, page: &mut [u8], keep: usize) -> Result<(), KernelError> {
    truncate_rows_with(Isa::detect(), shape, format, page, keep)
}

/// [`truncate_rows`] with a chosen kernel (for tests and benchmarks); every kernel writes the same
/// bytes. The AVX-512 and AVX2 kernels take a channel's keys 32 and 16 slots a vector
/// (`rows_avx512.rs`, `rows_avx2.rs`); measured with the last table of `cargo bench -p
/// kvmm-kernels --bench rows`: 0.74 and 0.87 µs a SmolLM2 page, 3.8 and 4.5 µs a Llama-3-8B page,
/// against 8.0 and 42.5 µs for the scalar kernel.
pub fn truncate_rows_with(
    isa: Isa,
    shape: PageShape,
    format: Format,
    page: &mut [u8],
    keep: usize,
) -> Result<(), KernelError> {
    if !isa.is_available() {
        return Err(KernelError::IsaUnavailable { isa: isa.name() });
    }
    check_rows(shape, format, page, keep, 0, 0)?;
    let (heads, dim, bt) = (shape.kv_heads, shape.head_dim, shape.block_tokens);
    for h in 0..heads {
        page[shape.v_byte(h, keep, 0)..shape.v_byte(h, bt, 0)].fill(0);
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() || isa == Isa::Avx2 {
        let infinity = infinity_bits(format);
        // The bounds of every channel, then (64-byte aligned after them) every channel's keys.
        let (head, keys) = page.split_at_mut(shape.k_byte(0, 0, 0));
        let bounds = &mut head[shape.bound_byte(0, 0)..shape.bound_byte(heads - 1, dim - 1) + 4];
        let keys = &mut keys[..shape.k_byte(heads - 1, dim - 1, bt) - shape.k_byte(0, 0, 0)];
        if isa.is_avx512() {
            // SAFETY: `isa` passed `is_available`, so avx512f/bw/vl and avx2 were detected.
            unsafe { super::rows_avx512::truncate_keys(keys, bounds, bt, keep, infinity) };
        } else {
            // SAFETY: `isa` passed `is_available`, so avx2, fma and f16c were detected.
            unsafe { super::rows_avx2::truncate_keys(keys, bounds, bt, keep, infinity) };
        }
        return Ok(());
    }
    for h in 0..heads {
        for d in 0..dim {
            // A channel's keys are contiguous, in slot order.
            let (lo, hi) = first_extremes(format, &page[shape.k_byte(h, d, 0)..shape.k_byte(h, d, keep)]);
            page[shape.k_byte(h, d, keep)..shape.k_byte(h, d, bt)].fill(0);
            let at = shape.bound_byte(h, d);
            store(page, at, lo);
            store(page, at + 2, hi);
        }
    }
    Ok(())
}

/// The key bounds (bits) [`widen`] leaves when one channel's keys, `raw` (little-endian 16-bit
/// keys of `format` in slot order), are widened one by one into empty bounds: the first key of
/// the smallest value and the first of the largest (±0 are equal, so the first zero stands); NaN
/// keys never enter; where no key passes a bound, the empty bound's bits (±infinity, the bits an
/// infinite key has too).
///
/// On the bits alone, with no float conversion: sign-magnitude bits map to an unsigned order (a
/// negative key's bits inverted, a positive key's with the top bit set; a NaN to the far end of
/// each search). One pass over the channel, which runs on vectors, finds the extremes of that
/// order; a scan that stops at the first hit then finds the slot holding each. Measured with the
/// last table of `cargo bench -p kvmm-kernels --bench rows`: 2.8–3.0× a 5-token `write_rows`, against
/// 4.1× for widening 64 channels at a time token by token as the writer does (each key gathered
/// from its channel-major place). The scalar kernel; AVX-512 and AVX2 have their own.
fn first_extremes(format: Format, raw: &[u8]) -> (u16, u16) {
    const SLOTS: usize = 64;
    let infinity = infinity_bits(format);
    let order = |b: u16| if b & 0x8000 != 0 { !b } else { b | 0x8000 };
    // A key's order is never 0 or u16::MAX (those would be NaN bits), so these mean "none".
    let (mut low, mut high) = (u16::MAX, 0u16);
    let mut bits = [0u16; SLOTS];
    for chunk in raw.chunks(2 * SLOTS) {
        let n = chunk.len() / 2;
        for (b, p) in bits[..n].iter_mut().zip(chunk.chunks_exact(2)) {
            *b = u16::from_le_bytes([p[0], p[1]]);
        }
        for &b in &bits[..n] {
            let (o, nan) = (order(b), b & 0x7fff > infinity);
            low = low.min(if nan { u16::MAX } else { o });
            high = high.max(if nan { 0 } else { o });
        }
    }
    // The bits of the first key of order `o` (the bits `o` inverts to), or of either zero where
    // `o` is a zero's.
    let first = |o: u16| {
        let (mask, want) = match o {
            0x7fff | 0x8000 => (0x7fff, 0),
            _ if o & 0x8000 != 0 => (0xffff, o & 0x7fff),
            _ => (0xffff, !o),
        };
        raw.chunks_exact(2).map(|p| u16::from_le_bytes([p[0], p[1]])).find(|&b| b & mask == want)
    };
    let lo = if low == u16::MAX { None } else { first(low) };
    let hi = if high == 0 { None } else { first(high) };
    (lo.unwrap_or(infinity), hi.unwrap_or(infinity | 0x8000))
}

/// Reads `n` tokens starting at slot `token` back into `f32` rows, in the same token-major order
/// [`write_rows`] takes (`n` = `k_out.len() / (kv_heads × head_dim)`). For tests and debugging.
pub fn read_rows(
    shape: PageShape,
    format: Format,
    page: &[u8],
    token: usize,
    k_out: &mut [f32],
    v_out: &mut [f32],
) -> Result<(), KernelError> {
    let count = check_rows(shape, format, page, token, k_out.len(), v_out.len())?;
    let (heads, dim) = (shape.kv_heads, shape.head_dim);
    for i in 0..count {
        let slot = token + i;
        for h in 0..heads {
            let row = (i * heads + h) * dim;
            for d in 0..dim {
                k_out[row + d] = decode(format, load(page, shape.k_byte(h, d, slot)));
                v_out[row + d] = decode(format, load(page, shape.v_byte(h, slot, d)));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::format::header::init_page;

    const TINY: PageShape = PageShape { kv_heads: 2, head_dim: 3, block_tokens: 4 };

    fn empty(format: Format) -> Vec<u8> {
        let mut page = vec![0u8; TINY.page_bytes(format)];
        init_page(TINY, format, &mut page).unwrap();
        page
    }

    #[test]
    fn one_token_lands_channel_major_in_k_and_row_major_in_v() {
        let mut page = empty(Format::F16);
        let k: Vec<f32> = (1..=6).map(|x| x as f32).collect();
        let v: Vec<f32> = (11..=16).map(|x| x as f32).collect();
        write_rows(TINY, Format::F16, &mut page, 2, &k, &v).unwrap();
        // Head 1, channel 2 of the key is k[1 * 3 + 2] = 6.0, at slot 2 of that channel's run.
        assert_eq!(load(&page, TINY.k_byte(1, 2, 2)), f16::from_f32(6.0).to_bits());
        assert_eq!(load(&page, TINY.v_byte(1, 2, 0)), f16::from_f32(14.0).to_bits());
        // Nothing else in slot 1 or 3 was touched.
        assert_eq!(load(&page, TINY.k_byte(1, 2, 1)), 0);
        assert_eq!(load(&page, TINY.k_byte(1, 2, 3)), 0);
    }

    #[test]
    fn key_bounds_widen_with_every_write_and_skip_nan() {
        let mut page = empty(Format::Bf16);
        let at = TINY.bound_byte(1, 0);
        let bounds = |page: &[u8]| (decode(Format::Bf16, load(page, at)), decode(Format::Bf16, load(page, at + 2)));
        assert_eq!(bounds(&page), (f32::INFINITY, f32::NEG_INFINITY));
        let mut k = [0.0f32; 6];
        k[3] = 2.5;
        write_rows(TINY, Format::Bf16, &mut page, 0, &k, &k).unwrap();
        assert_eq!(bounds(&page), (2.5, 2.5));
        k[3] = f32::NAN;
        write_rows(TINY, Format::Bf16, &mut page, 1, &k, &k).unwrap();
        assert_eq!(bounds(&page), (2.5, 2.5));
        k[3] = -1.0;
        write_rows(TINY, Format::Bf16, &mut page, 2, &k, &k).unwrap();
        assert_eq!(bounds(&page), (-1.0, 2.5));
    }

    #[test]
    fn rows_into_an_uninitialized_page_are_refused() {
        let mut page = vec![0u8; TINY.page_bytes(Format::F16)];
        let err = write_rows(TINY, Format::F16, &mut page, 0, &[0.0; 6], &[0.0; 6]).unwrap_err();
        assert_eq!(err, KernelError::HeaderUninitialized);
        assert!(page.iter().all(|&b| b == 0));
    }

    #[test]
    fn rows_past_the_last_slot_are_rejected() {
        let mut page = empty(Format::Bf16);
        let rows = vec![0.0f32; 2 * 6];
        let err = write_rows(TINY, Format::Bf16, &mut page, 3, &rows, &rows).unwrap_err();
        assert_eq!(err, KernelError::TokenRange { first: 3, count: 2, block_tokens: 4 });
    }
}
