//! Row writes and reads: round trips, the rounding rule, and the layout seen from outside.

use half::{bf16, f16};
use kvmm_kernels::{
    Format, Isa, KernelError, PageShape, init_page, key_bounds, read_rows, truncate_rows, truncate_rows_with,
    write_rows, write_rows_raw, write_rows_with,
};
use proptest::prelude::*;

const SHAPE: PageShape = PageShape { kv_heads: 2, head_dim: 16, block_tokens: 8 };

fn bits_at(page: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([page[at], page[at + 1]])
}

/// A zeroed page of `shape` in `format` with its header and empty bounds written.
fn empty_page(shape: PageShape, format: Format) -> Vec<u8> {
    let mut page = vec![0u8; shape.page_bytes(format)];
    init_page(shape, format, &mut page).expect("valid shape");
    page
}

/// Writes `x` as key channel 0 of head 0 at slot 0 and returns the stored bits.
fn stored_bits(format: Format, x: f32) -> u16 {
    let shape = PageShape { kv_heads: 1, head_dim: 1, block_tokens: 1 };
    let mut page = empty_page(shape, format);
    write_rows(shape, format, &mut page, 0, &[x], &[x]).expect("one element fits a one-slot page");
    bits_at(&page, shape.k_byte(0, 0, 0))
}

#[test]
fn f32_to_f16_rounds_to_nearest_even() {
    let ulp = 2f32.powi(-10);
    // Halfway between 1.0 (even) and 1 + ulp (odd): to 1.0.
    assert_eq!(stored_bits(Format::F16, 1.0 + ulp / 2.0), 0x3c00);
    // Halfway between 1 + ulp (odd) and 1 + 2 ulp (even): up.
    assert_eq!(stored_bits(Format::F16, 1.0 + 1.5 * ulp), 0x3c02);
    // Just above halfway rounds up.
    assert_eq!(stored_bits(Format::F16, 1.0 + ulp / 2.0 + 2f32.powi(-20)), 0x3c01);
    // 65520 is halfway between the largest f16 (65504) and 65536: ties to even overflow to +inf.
    assert_eq!(stored_bits(Format::F16, 65520.0), 0x7c00);
    assert_eq!(stored_bits(Format::F16, 65519.0), 0x7bff);
    assert_eq!(stored_bits(Format::F16, -0.0), 0x8000);
    assert!(f16::from_bits(stored_bits(Format::F16, f32::NAN)).is_nan());
}

#[test]
fn f32_to_bf16_rounds_to_nearest_even() {
    let ulp = 2f32.powi(-7);
    assert_eq!(stored_bits(Format::Bf16, 1.0 + ulp / 2.0), 0x3f80);
    assert_eq!(stored_bits(Format::Bf16, 1.0 + 1.5 * ulp), 0x3f82);
    assert_eq!(stored_bits(Format::Bf16, 1.0 + ulp / 2.0 + 2f32.powi(-20)), 0x3f81);
    assert_eq!(stored_bits(Format::Bf16, f32::INFINITY), 0x7f80);
    assert!(bf16::from_bits(stored_bits(Format::Bf16, f32::NAN)).is_nan());
}

/// The bits stored at every key and value position of slot `slot` of `page`.
fn slot_bits(page: &[u8], slot: usize) -> (Vec<u16>, Vec<u16>) {
    let positions = (0..SHAPE.kv_heads).flat_map(|h| (0..SHAPE.head_dim).map(move |d| (h, d)));
    positions.map(|(h, d)| (bits_at(page, SHAPE.k_byte(h, d, slot)), bits_at(page, SHAPE.v_byte(h, slot, d)))).unzip()
}

#[test]
fn sixteen_bit_rows_are_copied_bit_for_bit_into_a_page_of_their_format() {
    // Patterns across the range, with a subnormal, ±0, ±infinity and a NaN payload among them.
    let patterns: Vec<u16> =
        (0..27u16).map(|i| i.wrapping_mul(0x9e37)).chain([0x0001, 0x8000, 0x7c00, 0xfc00, 0x7e01]).collect();
    let k16: Vec<f16> = patterns.iter().map(|&b| f16::from_bits(b)).collect();
    let v16: Vec<f16> = patterns.iter().rev().map(|&b| f16::from_bits(b)).collect();
    let mut page = empty_page(SHAPE, Format::F16);
    write_rows(SHAPE, Format::F16, &mut page, 5, &k16, &v16).unwrap();
    assert_eq!(slot_bits(&page, 5), (patterns.clone(), patterns.iter().rev().copied().collect()));

    let kb: Vec<bf16> = patterns.iter().map(|&b| bf16::from_bits(b)).collect();
    let mut page = empty_page(SHAPE, Format::Bf16);
    write_rows(SHAPE, Format::Bf16, &mut page, 7, &kb, &kb).unwrap();
    assert_eq!(slot_bits(&page, 7), (patterns.clone(), patterns));
}

#[test]
fn sixteen_bit_rows_into_the_other_format_round_once_from_their_value() {
    // bf16 → f16: exact inside f16's normal range; below it f16's subnormal step is 2^-24, and a bf16
    // value halfway between two steps goes to the even one; past 65504 it is infinity.
    let tiny = 2f32.powi(-24);
    let pinned = [(1.5 * tiny, 0x0002), (2.5 * tiny, 0x0002), (3.5 * tiny, 0x0004), (70000.0, 0x7c00), (-1.0, 0xbc00)];
    let mut bf: Vec<bf16> = pinned.iter().map(|&(x, _)| bf16::from_f32(x)).collect();
    bf.extend((bf.len()..32).map(|i| bf16::from_f32((i as f32 - 16.0) * 1234.5 + 0.0078125)));
    let mut page = empty_page(SHAPE, Format::F16);
    write_rows(SHAPE, Format::F16, &mut page, 0, &bf, &bf).unwrap();
    let (keys, values) = slot_bits(&page, 0);
    let want: Vec<u16> = bf.iter().map(|x| f16::from_f32(x.to_f32()).to_bits()).collect();
    assert_eq!((&keys, &values), (&want, &want));
    for (i, &(_, bits)) in pinned.iter().enumerate() {
        assert_eq!(keys[i], bits, "bf16 {} into f16", bf[i]);
    }

    // f16 → bf16: bf16 keeps 7 fraction bits, f16 10, so 1 + i·2^-9 lands between bf16 steps.
    let h: Vec<f16> = (0..32).map(|i| f16::from_f32(1.0 + i as f32 * 2f32.powi(-9))).collect();
    let mut page = empty_page(SHAPE, Format::Bf16);
    write_rows(SHAPE, Format::Bf16, &mut page, 3, &h, &h).unwrap();
    let (keys, values) = slot_bits(&page, 3);
    let want: Vec<u16> = h.iter().map(|x| bf16::from_f32(x.to_f32()).to_bits()).collect();
    assert_eq!((&keys, &values), (&want, &want));
    // 1 + 2^-8 is halfway between bf16's 1 and 1 + 2^-7: ties to even, down to 1.
    assert_eq!(keys[2], 0x3f80);
    // 1 + 3·2^-9 is past halfway: up to 1 + 2^-7.
    assert_eq!(keys[3], 0x3f81);
}

#[test]
fn sixteen_bit_rows_write_the_same_page_as_f32_rows_of_the_same_values() {
    let k: Vec<f32> = (0..64).map(|i| (i as f32 * 0.73).sin() * 40.0).collect();
    let v = vec![0.5f32; 64];
    let mut from_f32 = empty_page(SHAPE, Format::Bf16);
    write_rows(SHAPE, Format::Bf16, &mut from_f32, 2, &k, &v).unwrap();
    let kb: Vec<bf16> = k.iter().map(|&x| bf16::from_f32(x)).collect();
    let vb: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut from_bf16 = empty_page(SHAPE, Format::Bf16);
    write_rows(SHAPE, Format::Bf16, &mut from_bf16, 2, &kb, &vb).unwrap();
    // The whole page, header and key bounds included.
    assert_eq!(from_f32, from_bf16);
}

#[test]
fn raw_pointer_writes_equal_slice_writes() {
    let k: Vec<f32> = (0..96).map(|i| i as f32 * 0.37 - 9.0).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    let mut by_slice = empty_page(SHAPE, Format::Bf16);
    write_rows(SHAPE, Format::Bf16, &mut by_slice, 2, &k, &v).unwrap();
    let mut by_pointer = empty_page(SHAPE, Format::Bf16);
    // SAFETY: the pointer and length come from a live Vec that nothing else touches during the call.
    unsafe {
        write_rows_raw(by_pointer.as_mut_ptr(), by_pointer.len(), SHAPE, Format::Bf16, 2, &k, &v).unwrap();
    }
    assert_eq!(by_slice, by_pointer);
}

#[test]
fn rows_past_the_page_are_refused_and_leave_it_untouched() {
    let mut page = vec![0xaau8; SHAPE.page_bytes(Format::F16)];
    init_page(SHAPE, Format::F16, &mut page).unwrap();
    let before = page.clone();
    let rows = vec![1.0f32; 3 * 32];
    let err = write_rows(SHAPE, Format::F16, &mut page, 6, &rows, &rows).unwrap_err();
    assert_eq!(err, KernelError::TokenRange { first: 6, count: 3, block_tokens: 8 });
    assert_eq!(err.to_string(), "tokens 6..9 do not fit in a page of block_tokens = 8; start a new page at token 8");
    assert_eq!(page, before);
}

#[test]
fn rows_into_a_quantized_page_are_refused() {
    let mut page = vec![0u8; SHAPE.page_bytes(Format::Q4)];
    let err = write_rows(SHAPE, Format::Q4, &mut page, 0, &[0.0; 32], &[0.0; 32]).unwrap_err();
    assert_eq!(err, KernelError::NotRowWritable { format: Format::Q4 });
    assert!(page.iter().all(|&b| b == 0));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn rows_written_then_read_come_back_rounded_once(
        kv_heads in 1usize..=4,
        head_dim in 1usize..=40,
        block_tokens in prop_oneof![(0u32..=6).prop_map(|log| 1usize << log), 1usize..=70],
        first_frac in 0.0f64..1.0,
        bf in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let format = if bf { Format::Bf16 } else { Format::F16 };
        let shape = PageShape { kv_heads, head_dim, block_tokens };
        let first = ((shape.block_tokens as f64) * first_frac) as usize;
        let count = 1 + (seed as usize % (shape.block_tokens - first));
        let row = kv_heads * head_dim;
        let k: Vec<f32> = (0..count * row)
            .map(|i| ((i as u64).wrapping_mul(seed | 1) % 20_000) as f32 * 0.013 - 130.0)
            .collect();
        let v: Vec<f32> = k.iter().map(|x| x * -0.5 + 1.0).collect();
        let mut page = empty_page(shape, format);
        let header = page[..64].to_vec();
        write_rows(shape, format, &mut page, first, &k, &v).unwrap();
        prop_assert_eq!(&page[..64], &header[..], "row writes never touch the header");
        let mut k_back = vec![0.0; k.len()];
        let mut v_back = vec![0.0; v.len()];
        read_rows(shape, format, &page, first, &mut k_back, &mut v_back).unwrap();
        let round = |x: f32| match format {
            Format::F16 => f16::from_f32(x).to_f32(),
            _ => bf16::from_f32(x).to_f32(),
        };
        for (orig, back) in k.iter().zip(&k_back).chain(v.iter().zip(&v_back)) {
            prop_assert_eq!(round(*orig).to_bits(), back.to_bits());
        }
        // Slots outside the written range stay zero.
        for t in (0..first).chain(first + count..shape.block_tokens) {
            for h in 0..kv_heads {
                for d in 0..head_dim {
                    prop_assert_eq!(bits_at(&page, shape.k_byte(h, d, t)), 0);
                    prop_assert_eq!(bits_at(&page, shape.v_byte(h, t, d)), 0);
                }
            }
        }
        // The key bounds are exactly the range of the keys written, per head and channel.
        let mut lo = vec![0.0; row];
        let mut hi = vec![0.0; row];
        key_bounds(shape, format, &page, &mut lo, &mut hi).unwrap();
        for i in 0..row {
            let column = k_back.iter().skip(i).step_by(row);
            let want_lo = column.clone().copied().fold(f32::INFINITY, f32::min);
            let want_hi = column.copied().fold(f32::NEG_INFINITY, f32::max);
            prop_assert_eq!((lo[i], hi[i]), (want_lo, want_hi));
        }
    }

    /// The writer against the rule it implements, written out element by element: every key and
    /// value rounded once into its place, then each channel's bounds widened by the stored keys in
    /// token order (a key replaces a bound it passes strictly or a NaN bound; a NaN key never
    /// passes). Inputs are arbitrary bit patterns (NaNs, infinities, subnormals, ±0), in several
    /// calls, onto a page whose bounds start arbitrary too; heads wider than the scalar writer's
    /// 64-channel step and the AVX-512 writer's 32 included; each kernel available here.
    #[test]
    fn the_writer_matches_the_element_by_element_rule(
        isa in prop::sample::select(Isa::available()),
        kv_heads in 1usize..=3,
        head_dim in prop_oneof![1usize..=20, 60usize..=140],
        block_tokens in prop_oneof![(0u32..=5).prop_map(|log| 1usize << log), 1usize..=40],
        calls in 1usize..=3,
        source in 0u8..3,
        bf in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let format = if bf { Format::Bf16 } else { Format::F16 };
        let shape = PageShape { kv_heads, head_dim, block_tokens };
        let row = kv_heads * head_dim;
        let mut state = seed | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut page = empty_page(shape, format);
        let mut want = page.clone();
        for h in 0..kv_heads {
            for d in 0..head_dim {
                let (lo, hi) = (next() as u16, next() as u16);
                for p in [&mut page, &mut want] {
                    p[shape.bound_byte(h, d)..][..2].copy_from_slice(&lo.to_le_bytes());
                    p[shape.bound_byte(h, d) + 2..][..2].copy_from_slice(&hi.to_le_bytes());
                }
            }
        }
        let decode = |b: u16| if bf { bf16::from_bits(b).to_f32() } else { f16::from_bits(b).to_f32() };
        let mut first = 0;
        for _ in 0..calls {
            if first == shape.block_tokens {
                break;
            }
            let count = 1 + (next() as usize % (shape.block_tokens - first));
            let raw: Vec<u64> = (0..2 * count * row).map(|_| next()).collect();
            // The stored bits of element i, by the rule, and the write itself, from `source`.
            let stored: Vec<u16> = match source {
                0 => {
                    let x: Vec<f32> = raw.iter().map(|&r| f32::from_bits(r as u32)).collect();
                    write_rows_with(isa, shape, format, &mut page, first, &x[..count * row], &x[count * row..]).unwrap();
                    x.iter().map(|&x| if bf { bf16::from_f32(x).to_bits() } else { f16::from_f32(x).to_bits() }).collect()
                }
                1 => {
                    let x: Vec<f16> = raw.iter().map(|&r| f16::from_bits(r as u16)).collect();
                    write_rows_with(isa, shape, format, &mut page, first, &x[..count * row], &x[count * row..]).unwrap();
                    x.iter().map(|&x| if bf { bf16::from_f32(x.to_f32()).to_bits() } else { x.to_bits() }).collect()
                }
                _ => {
                    let x: Vec<bf16> = raw.iter().map(|&r| bf16::from_bits(r as u16)).collect();
                    write_rows_with(isa, shape, format, &mut page, first, &x[..count * row], &x[count * row..]).unwrap();
                    x.iter().map(|&x| if bf { x.to_bits() } else { f16::from_f32(x.to_f32()).to_bits() }).collect()
                }
            };
            let (k, v) = stored.split_at(count * row);
            for i in 0..count {
                for h in 0..kv_heads {
                    for d in 0..head_dim {
                        let e = (i * kv_heads + h) * head_dim + d;
                        want[shape.k_byte(h, d, first + i)..][..2].copy_from_slice(&k[e].to_le_bytes());
                        want[shape.v_byte(h, first + i, d)..][..2].copy_from_slice(&v[e].to_le_bytes());
                    }
                }
            }
            for h in 0..kv_heads {
                for d in 0..head_dim {
                    let at = shape.bound_byte(h, d);
                    let (mut lo, mut hi) = (bits_at(&want, at), bits_at(&want, at + 2));
                    for i in 0..count {
                        let b = k[(i * kv_heads + h) * head_dim + d];
                        let x = decode(b);
                        if x < decode(lo) || decode(lo).is_nan() {
                            lo = b;
                        }
                        if x > decode(hi) || decode(hi).is_nan() {
                            hi = b;
                        }
                    }
                    want[at..][..2].copy_from_slice(&lo.to_le_bytes());
                    want[at + 2..][..2].copy_from_slice(&hi.to_le_bytes());
                }
            }
            prop_assert!(page == want, "{}: the page differs from the rule after writing {} tokens at {}", isa, count, first);
            first += count;
        }
    }

    /// Taking tokens back leaves a page byte for byte as writing its kept rows into a blank page
    /// does: the slots past them zeroed, the key bounds those of the kept keys alone. Rows of
    /// arbitrary bits (NaNs, infinities, ±0) of the page's own type, so they are stored as given;
    /// for half the seeds, bits from a few values (±0, ±1, ±infinity, a NaN, a subnormal), so a
    /// channel's extreme value recurs and the first of its copies must stand. Pages of up to 130
    /// slots, up to five 32-slot vectors of the AVX-512 kernel, whose last is whole or not (sessions
    /// take powers of two, pages any count); every kernel available here.
    #[test]
    fn truncating_leaves_what_writing_the_kept_rows_into_a_blank_page_leaves(
        kv_heads in 1usize..=3,
        head_dim in prop_oneof![1usize..=20, 60usize..=140],
        block_tokens in prop_oneof![(0u32..=7).prop_map(|log| 1usize << log), 1usize..=130],
        bf in any::<bool>(),
        fill in any::<prop::sample::Index>(),
        keep in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let format = if bf { Format::Bf16 } else { Format::F16 };
        let shape = PageShape { kv_heads, head_dim, block_tokens };
        let row = kv_heads * head_dim;
        let tokens = fill.index(shape.block_tokens + 1);
        let keep = keep.index(tokens + 1);
        let mut state = seed | 1;
        let few: [u16; 8] = if bf {
            [0x0000, 0x8000, 0x3f80, 0xbf80, 0x7f80, 0xff80, 0x7fc0, 0x0001]
        } else {
            [0x0000, 0x8000, 0x3c00, 0xbc00, 0x7c00, 0xfc00, 0x7e00, 0x0001]
        };
        let bits: Vec<u16> = (0..2 * tokens * row)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                if seed % 2 == 0 { few[(state >> 32) as usize % few.len()] } else { state as u16 }
            })
            .collect();
        let (k, v) = bits.split_at(tokens * row);
        let write = |page: &mut Vec<u8>, n: usize| {
            if n == 0 {
                return;
            }
            if bf {
                let x = |b: &[u16]| b.iter().map(|&b| bf16::from_bits(b)).collect::<Vec<_>>();
                write_rows(shape, format, page, 0, &x(&k[..n * row]), &x(&v[..n * row])).unwrap();
            } else {
                let x = |b: &[u16]| b.iter().map(|&b| f16::from_bits(b)).collect::<Vec<_>>();
                write_rows(shape, format, page, 0, &x(&k[..n * row]), &x(&v[..n * row])).unwrap();
            }
        };
        let mut full = empty_page(shape, format);
        write(&mut full, tokens);
        let mut want = empty_page(shape, format);
        write(&mut want, keep);
        for isa in Isa::available() {
            let mut page = full.clone();
            truncate_rows_with(isa, shape, format, &mut page, keep).unwrap();
            prop_assert!(
                page == want,
                "{}: {} of {} tokens kept: the page differs from a blank page given them", isa, keep, tokens
            );
        }
    }
}

#[test]
fn truncating_refuses_quantized_pages_and_a_count_past_the_page() {
    let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 32 };
    let mut page = empty_page(shape, Format::F16);
    assert!(matches!(
        truncate_rows(shape, Format::F16, &mut page, 33).unwrap_err(),
        KernelError::TokenRange { first: 33, count: 0, block_tokens: 32 }
    ));
    let mut q8 = vec![0u8; shape.page_bytes(Format::Q8)];
    assert!(truncate_rows(shape, Format::Q8, &mut q8, 1).is_err());
    // A page without a header for this shape is refused before a byte is written.
    let mut blank = vec![7u8; shape.page_bytes(Format::F16)];
    assert!(truncate_rows(shape, Format::F16, &mut blank, 0).is_err());
    assert!(blank.iter().all(|&b| b == 7));
}

/// A channel whose extreme is zero keeps the sign of its first zero, also when the zeros lie in
/// different 32-slot vectors of the AVX-512 kernel (a few-values proptest seldom draws a channel
/// of more than 32 keys with no negative key).
#[test]
fn truncating_keeps_the_first_zero_across_vectors_of_slots() {
    let shape = PageShape { kv_heads: 1, head_dim: 2, block_tokens: 128 };
    let (neg_zero, pos_zero) = (f16::from_bits(0x8000), f16::ZERO);
    // Channel 0: positive keys, −0 at slot 40, +0 at slot 70: its minimum is −0.
    // Channel 1: negative keys, +0 at slot 35, −0 at slot 90: its maximum is +0.
    let mut k = Vec::new();
    for t in 0..128 {
        k.push(match t {
            40 => neg_zero,
            70 => pos_zero,
            _ => f16::from_f32(1.0 + (t % 3) as f32),
        });
        k.push(match t {
            35 => pos_zero,
            90 => neg_zero,
            _ => f16::from_f32(-1.0 - (t % 5) as f32),
        });
    }
    let mut full = empty_page(shape, Format::F16);
    write_rows(shape, Format::F16, &mut full, 0, &k, &k).unwrap();
    let mut want = empty_page(shape, Format::F16);
    write_rows(shape, Format::F16, &mut want, 0, &k[..2 * 100], &k[..2 * 100]).unwrap();
    assert_eq!(bits_at(&want, shape.bound_byte(0, 0)), 0x8000, "the rule keeps the first zero, −0");
    assert_eq!(bits_at(&want, shape.bound_byte(0, 1) + 2), 0x0000, "the rule keeps the first zero, +0");
    for isa in Isa::available() {
        let mut page = full.clone();
        truncate_rows_with(isa, shape, Format::F16, &mut page, 100).unwrap();
        assert!(page == want, "{isa}: the page differs from a blank page given the first 100 tokens");
    }
}

/// A kernel this build or CPU lacks is refused by name, and the page is left as it was.
#[test]
fn a_kernel_this_cpu_lacks_is_refused() {
    let Some(missing) = Isa::ALL.into_iter().find(|isa| !isa.is_available()) else {
        return;
    };
    let mut page = empty_page(SHAPE, Format::F16);
    let before = page.clone();
    let rows = vec![1.0f32; SHAPE.kv_heads * SHAPE.head_dim];
    let refused = KernelError::IsaUnavailable { isa: missing.name() };
    assert_eq!(write_rows_with(missing, SHAPE, Format::F16, &mut page, 0, &rows, &rows).unwrap_err(), refused);
    assert_eq!(truncate_rows_with(missing, SHAPE, Format::F16, &mut page, 0).unwrap_err(), refused);
    assert!(page == before);
}
