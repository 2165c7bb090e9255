//! Quantized formats: the rounding rule, round trips, key bounds, bits per element, and every
//! quantize/dequantize kernel against the scalar one.

mod common;

use common::{Fill, make_page};
use half::{bf16, f16};
use kvmm_kernels::{
    AttnShape, Format, Isa, KernelErrorKind, PageHeader, PageShape, QuantLayout, dequantize, dequantize_page,
    dequantize_page_with, dequantize_with, init_page, key_bounds, quantize, quantize_with, read_rows, write_rows,
};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// An f16 page of one KV head, head_dim 16, block_tokens 8, every key channel and value token
/// holding `group` (8 keys per channel; values: the first 8 entries then repeated).
fn one_group_page(format: Format, group: [f32; 8]) -> (PageShape, Vec<u8>) {
    let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 8 };
    let k: Vec<f32> = (0..8).flat_map(|t| [group[t]; 16]).collect();
    let v: Vec<f32> = (0..8).flat_map(|_| (0..16).map(|d| group[d % 8])).collect();
    let mut rng = StdRng::seed_from_u64(0);
    (shape, make_page(shape, format, &k, &v, &mut rng, Fill::Zero))
}

fn f16_bits(page: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([page[at], page[at + 1]])
}

#[test]
fn q4_group_follows_the_ggml_q4_1_rounding_rule() {
    // min −1 is an f16; scale 3/15 = 0.2 rounds *up* to the f16 0.20007324 (0x3267), not to the
    // nearer 0.19995117 (0x3266), so min + 15·scale ≥ 2.
    let (shape, page) = one_group_page(Format::Q4, [-1.0, 0.5, 2.0, -1.0, 0.3, 0.7, 1.1, 1.9]);
    let q = QuantLayout::new(shape, Format::Q4).unwrap();
    assert_eq!(f16_bits(&page, q.k_param(0, 0)), 0x3267);
    assert_eq!(f16_bits(&page, q.k_param(0, 0) + 2), f16::from_f32(-1.0).to_bits());
    let scale = f16::from_bits(0x3267).to_f32();
    let inv = 1.0 / scale;
    let want: Vec<u32> = [-1.0f32, 0.5, 2.0, -1.0, 0.3, 0.7, 1.1, 1.9]
        .iter()
        .map(|&x| (((f16::from_f32(x).to_f32() + 1.0) * inv + 0.5).floor() as u32).min(15))
        .collect();
    assert_eq!(want, [0, 7, 15, 0, 6, 8, 10, 14]);
    let row = q.k_codes(0);
    let got: Vec<u32> = (0..8).map(|t| u32::from(page[row + t / 2] >> (4 * (t % 2))) & 15).collect();
    assert_eq!(got, want);
    // Reconstruction is min + scale × code.
    let mut k = vec![0.0; 8 * 16];
    let mut v = vec![0.0; 8 * 16];
    dequantize(shape, Format::Q4, &page, 8, &mut k, &mut v).unwrap();
    for t in 0..8 {
        assert_eq!(k[t * 16], -1.0 + scale * want[t] as f32);
    }
}

#[test]
fn constant_groups_are_reconstructed_exactly_with_zero_scale() {
    for format in Format::QUANTIZED {
        let (shape, page) = one_group_page(format, [0.3125; 8]);
        let q = QuantLayout::new(shape, format).unwrap();
        assert_eq!(f16_bits(&page, q.k_param(0, 3)), 0, "{format}: scale");
        let mut k = vec![0.0; 8 * 16];
        let mut v = vec![0.0; 8 * 16];
        dequantize(shape, format, &page, 8, &mut k, &mut v).unwrap();
        assert!(k.iter().chain(&v).all(|&x| x == 0.3125), "{format}");
    }
}

#[test]
fn bf16_values_beyond_the_f16_range_are_refused() {
    let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 8 };
    let mut src = vec![0u8; shape.page_bytes(Format::Bf16)];
    init_page(shape, Format::Bf16, &mut src).unwrap();
    let mut v = vec![1.0f32; 16];
    v[9] = 70000.0;
    write_rows(shape, Format::Bf16, &mut src, 0, &[0.0; 16], &v).unwrap();
    let mut dst = vec![0u8; shape.page_bytes(Format::Q8)];
    for isa in Isa::available() {
        let err = quantize_with(isa, shape, Format::Bf16, &src, 1, Format::Q8, &mut dst).unwrap_err();
        assert_eq!(err.kind(), KernelErrorKind::BadValue, "{isa}");
        assert!(err.to_string().starts_with("the value at token 0, KV head 0, channel 9 is 70144,"), "{isa}: {err}");
    }
}

#[test]
fn every_kernel_refuses_nan_infinite_and_out_of_range_elements_and_ignores_slots_past_tokens() {
    // block_tokens 32 and head_dim 64, so the vector kernels run (they need multiples of 16).
    let shape = PageShape { kv_heads: 2, head_dim: 64, block_tokens: 32 };
    let row = shape.kv_heads * shape.head_dim;
    let at = |t: usize, h: usize, d: usize| t * row + h * shape.head_dim + d;
    let mut dst = vec![0u8; shape.page_bytes(Format::Q8)];
    // bf16 holds finite values beyond the f16 range; f16 does not (70000 would be stored as inf).
    let cases = [
        (Format::Bf16, f32::NAN, "NaN"),
        (Format::Bf16, f32::INFINITY, "inf"),
        (Format::Bf16, f32::NEG_INFINITY, "-inf"),
        (Format::Bf16, 70000.0, "70144"),
        (Format::F16, f32::NAN, "NaN"),
        (Format::F16, f32::INFINITY, "inf"),
        (Format::F16, f32::NEG_INFINITY, "-inf"),
    ];
    for (from, bad, shown) in cases {
        for (key, t, h, d) in [(true, 19, 1, 37), (false, 3, 0, 50), (false, 17, 1, 0)] {
            let (mut k, mut v) = (vec![0.25f32; 32 * row], vec![-0.5f32; 32 * row]);
            // Slot 25 lies past the 20 quantized tokens: nothing there is read.
            (k[at(25, 0, 3)], v[at(25, 1, 9)]) = (f32::NAN, f32::INFINITY);
            if key {
                k[at(t, h, d)] = bad
            } else {
                v[at(t, h, d)] = bad
            }
            let mut src = vec![0u8; shape.page_bytes(from)];
            init_page(shape, from, &mut src).unwrap();
            write_rows(shape, from, &mut src, 0, &k, &v).unwrap();
            let which = if key { "key" } else { "value" };
            let want = format!("the {which} at token {t}, KV head {h}, channel {d} is {shown},");
            for isa in Isa::available() {
                let err = quantize_with(isa, shape, from, &src, 20, Format::Q8, &mut dst).unwrap_err();
                assert_eq!(err.kind(), KernelErrorKind::BadValue, "{isa} {from:?}");
                assert!(err.to_string().starts_with(&want), "{isa} {from:?}: {err}");
            }
            if key {
                k[at(t, h, d)] = 0.25
            } else {
                v[at(t, h, d)] = -0.5
            }
            write_rows(shape, from, &mut src, 0, &k, &v).unwrap();
            for isa in Isa::available() {
                quantize_with(isa, shape, from, &src, 20, Format::Q8, &mut dst).unwrap();
            }
        }
    }
}

#[test]
fn bits_per_element_with_metadata_stay_within_one_bit_of_the_codes() {
    println!("{:<10} {:>8} {:>8} {:>8} {:>8}", "format", "kb/vb", "D=64", "D=128", "params");
    for format in Format::ALL {
        let mut row = Vec::new();
        for head_dim in [64, 128] {
            let shape = PageShape { kv_heads: 8, head_dim, block_tokens: 32 };
            let bits = format.bits_per_element(shape);
            let codes = f64::from(format.k_bits() + format.v_bits()) / 2.0;
            let header = 8.0 * 64.0 / (2 * shape.region_elements()) as f64;
            let metadata = bits - codes - header;
            assert!(metadata <= 1.0 + 1e-9, "{format} at head_dim {head_dim}: {metadata} bits of metadata");
            row.push((bits, metadata));
        }
        println!(
            "{:<10} {:>8} {:>8.3} {:>8.3} {:>8.3}",
            format,
            format!("{}/{}", format.k_bits(), format.v_bits()),
            row[0].0,
            row[1].0,
            row[0].1
        );
    }
    let smol = PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 };
    let rounded: Vec<f64> =
        Format::QUANTIZED.iter().map(|f| (f.bits_per_element(smol) * 100.0).round() / 100.0).collect();
    assert_eq!(rounded, [9.04, 5.04, 3.04, 7.04]);
}

#[test]
fn dequantizing_a_16_bit_page_equals_reading_its_rows() {
    let shape = AttnShape { q_heads: 4, kv_heads: 2, head_dim: 32, block_tokens: 16 };
    let layout = shape.page_shape();
    let (k, v) = common::random_rows(shape, 11, 5);
    let mut rng = StdRng::seed_from_u64(1);
    for format in [Format::F16, Format::Bf16] {
        let page = make_page(layout, format, &k, &v, &mut rng, Fill::Random);
        let (mut k1, mut v1, mut k2, mut v2) =
            (vec![0.0; k.len()], vec![0.0; k.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
        read_rows(layout, format, &page, 0, &mut k1, &mut v1).unwrap();
        dequantize(layout, format, &page, 11, &mut k2, &mut v2).unwrap();
        assert_eq!((k1, v1), (k2, v2));
    }
}

fn quantized_shapes() -> impl Strategy<Value = (PageShape, usize)> {
    // 9 KV heads: more than the 8 that the AVX-512 dequantizer stages at once.
    (proptest::sample::select(vec![1usize, 2, 3, 9]), 1usize..=16, 0u32..=5).prop_flat_map(
        |(kv_heads, dim16, block_log)| {
            let shape = PageShape { kv_heads, head_dim: 16 * dim16, block_tokens: 8 << block_log };
            (Just(shape), 1..=shape.block_tokens)
        },
    )
}

/// Random rows with a per-channel offset and spread, so key channels have different ranges, a few
/// constant channels, and sometimes large magnitudes.
fn spread_rows(shape: PageShape, tokens: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let row = shape.kv_heads * shape.head_dim;
    let magnitude = if seed.is_multiple_of(5) { 3000.0 } else { 2.0 };
    let offsets: Vec<(f32, f32)> = (0..row)
        .map(
            |i| if i % 13 == 7 { (rng.random_range(-1.0..1.0), 0.0) } else { (rng.random_range(-4.0..4.0), magnitude) },
        )
        .collect();
    // Channels 3 mod 13 lie on a grid of 1/16, so group ranges often divide exactly into f16 steps.
    let k: Vec<f32> = (0..tokens * row)
        .map(|i| {
            let x = offsets[i % row].0 + offsets[i % row].1 * rng.random_range(-1.0f32..1.0);
            if i % row % 13 == 3 { (x * 16.0).round() / 16.0 } else { x }
        })
        .collect();
    let v: Vec<f32> = (0..tokens * row).map(|_| magnitude * rng.random_range(-1.0f32..1.0)).collect();
    (k, v)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn dequantized_elements_lie_within_half_a_step_and_inside_the_key_bounds(
        (shape, tokens) in quantized_shapes(),
        format in proptest::sample::select(Format::QUANTIZED.to_vec()),
        bf in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let from = if bf { Format::Bf16 } else { Format::F16 };
        let (k, v) = spread_rows(shape, tokens, seed);
        let mut src = vec![0u8; shape.page_bytes(from)];
        init_page(shape, from, &mut src).unwrap();
        write_rows(shape, from, &mut src, 0, &k, &v).unwrap();
        let (mut k16, mut v16) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        read_rows(shape, from, &src, 0, &mut k16, &mut v16).unwrap();

        let mut page = vec![0u8; shape.page_bytes(format)];
        quantize_with(Isa::Scalar, shape, from, &src, tokens, format, &mut page).unwrap();
        let header = PageHeader::validate(shape, format, &page).unwrap();
        prop_assert_eq!(usize::from(header.tokens), tokens);
        let (mut kq, mut vq) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        dequantize_with(Isa::Scalar, shape, format, &page, tokens, &mut kq, &mut vq).unwrap();

        let q = QuantLayout::new(shape, format).unwrap();
        let row = shape.kv_heads * shape.head_dim;
        let step = |at: usize| f16::from_bits(f16_bits(&page, at)).to_f32();
        let (mut lo, mut hi) = (vec![0.0; row], vec![0.0; row]);
        key_bounds(shape, format, &page, &mut lo, &mut hi).unwrap();
        for t in 0..tokens {
            for h in 0..shape.kv_heads {
                for d in 0..shape.head_dim {
                    let i = (t * shape.kv_heads + h) * shape.head_dim + d;
                    let ks = step(q.k_param(h, d));
                    // Half a step, plus the f32 rounding of (x − min)·inv and of the reconstruction.
                    let slack = |x: f32, s: f32| 0.5 * s * (1.0 + 1e-3) + x.abs() * 1e-6;
                    prop_assert!((kq[i] - k16[i]).abs() <= slack(k16[i], ks), "key {i}: {} vs {}", kq[i], k16[i]);
                    let vs = step(q.v_param(h, d / 32, t));
                    prop_assert!((vq[i] - v16[i]).abs() <= slack(v16[i], vs), "value {i}: {} vs {}", vq[i], v16[i]);
                    let c = h * shape.head_dim + d;
                    prop_assert!(lo[c] <= k16[i] && k16[i] <= hi[c], "source key outside its bounds");
                    prop_assert!(lo[c] <= kq[i] && kq[i] <= hi[c], "reconstructed key outside its bounds");
                }
            }
        }
    }

    #[test]
    fn every_quantize_kernel_writes_the_scalar_kernels_bytes(
        (shape, tokens) in quantized_shapes(),
        format in proptest::sample::select(Format::QUANTIZED.to_vec()),
        bf in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let from = if bf { Format::Bf16 } else { Format::F16 };
        let (k, v) = spread_rows(shape, tokens, seed);
        let mut rng = StdRng::seed_from_u64(seed);
        let src = make_page(shape, from, &k, &v, &mut rng, Fill::Random);
        let mut want = vec![0u8; shape.page_bytes(format)];
        quantize_with(Isa::Scalar, shape, from, &src, tokens, format, &mut want).unwrap();
        let (mut k_want, mut v_want) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        dequantize_with(Isa::Scalar, shape, format, &want, tokens, &mut k_want, &mut v_want).unwrap();
        for isa in Isa::available() {
            let mut got = vec![0x5au8; shape.page_bytes(format)];
            quantize_with(isa, shape, from, &src, tokens, format, &mut got).unwrap();
            prop_assert!(got == want, "{isa}: quantized bytes differ from the scalar kernel's");
            let (mut kg, mut vg) = (vec![0.0; k.len()], vec![0.0; v.len()]);
            dequantize_with(isa, shape, format, &want, tokens, &mut kg, &mut vg).unwrap();
            prop_assert!(
                kg.iter().zip(&k_want).chain(vg.iter().zip(&v_want)).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa}: dequantized floats differ from the scalar kernel's"
            );
        }
    }
}

#[test]
fn bf16_sources_round_through_their_own_values() {
    // A bf16 value that is no f16 (1 + 2^-7 is, 1 + 3·2^-8 is not a bf16; 0.0078125·1.5 is both):
    // the min rounds down to f16 and the group still reconstructs within half a step.
    let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 8 };
    let x = bf16::from_f32(1.0e-6).to_f32();
    let mut src = vec![0u8; shape.page_bytes(Format::Bf16)];
    init_page(shape, Format::Bf16, &mut src).unwrap();
    write_rows(shape, Format::Bf16, &mut src, 0, &[x; 16], &[x; 16]).unwrap();
    let mut page = vec![0u8; shape.page_bytes(Format::Q8)];
    quantize(shape, Format::Bf16, &src, 1, Format::Q8, &mut page).unwrap();
    let (mut k, mut v) = (vec![0.0; 16], vec![0.0; 16]);
    dequantize(shape, Format::Q8, &page, 1, &mut k, &mut v).unwrap();
    assert!(k.iter().all(|&y| (y - x).abs() <= 6e-8), "{k:?} vs {x}");
}

#[test]
fn a_group_holding_both_zeros_gets_the_same_bytes_from_every_kernel() {
    // Found by the property test: the scalar min kept −0.0 where the vector reduction kept +0.0,
    // so the stored min's sign bit differed. Both zeros now count as +0.
    // The vector kernels order 16-bit patterns as integers, where −0 lies below +0: the same bytes
    // still, from both source formats and for both zeros alone.
    let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 16 };
    let mixed: Vec<f32> = (0..16).flat_map(|t| [if t % 2 == 0 { -0.0 } else { 0.0 }; 16]).collect();
    for from in [Format::Bf16, Format::F16] {
        for k in [mixed.clone(), vec![-0.0; 256], vec![0.0; 256]] {
            let mut src = vec![0u8; shape.page_bytes(from)];
            init_page(shape, from, &mut src).unwrap();
            write_rows(shape, from, &mut src, 0, &k, &k).unwrap();
            let mut want = vec![0u8; shape.page_bytes(Format::Q2)];
            quantize_with(Isa::Scalar, shape, from, &src, 16, Format::Q2, &mut want).unwrap();
            let q = QuantLayout::new(shape, Format::Q2).unwrap();
            assert_eq!(&want[q.k_param(0, 0)..q.k_param(0, 0) + 4], &[0, 0, 0, 0], "scale +0, min +0");
            for isa in Isa::available() {
                let mut got = vec![0u8; shape.page_bytes(Format::Q2)];
                quantize_with(isa, shape, from, &src, 16, Format::Q2, &mut got).unwrap();
                assert_eq!(got, want, "{isa} {from:?}");
            }
        }
    }
}

/// q8 → q4 goes through the element type: the result is the q4 encoding of the q8 page's values as a
/// freshly written f16 page would hold them, and stepping up or sideways is refused.
#[test]
fn a_q8_page_requantizes_to_q4_through_its_decoded_values() {
    use kvmm_kernels::format::{Format, PageShape};
    use kvmm_kernels::{dequantize, init_page, quantize, requantize, write_rows};
    let shape = PageShape { kv_heads: 2, head_dim: 32, block_tokens: 32 };
    let n = 32 * 2 * 32;
    let k: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let v: Vec<f32> = (0..n).map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0).collect();
    let mut f16_page = vec![0u8; shape.page_bytes(Format::F16)];
    init_page(shape, Format::F16, &mut f16_page).unwrap();
    write_rows(shape, Format::F16, &mut f16_page, 0, &k, &v).unwrap();
    let mut q8 = vec![0u8; shape.page_bytes(Format::Q8)];
    quantize(shape, Format::F16, &f16_page, 32, Format::Q8, &mut q8).unwrap();

    let mut q4 = vec![0u8; shape.page_bytes(Format::Q4)];
    requantize(shape, Format::F16, Format::Q8, &q8, 32, Format::Q4, &mut q4).unwrap();

    // The same chain by hand.
    let (mut k8, mut v8) = (vec![0f32; n], vec![0f32; n]);
    dequantize(shape, Format::Q8, &q8, 32, &mut k8, &mut v8).unwrap();
    let mut mid = vec![0u8; shape.page_bytes(Format::F16)];
    init_page(shape, Format::F16, &mut mid).unwrap();
    write_rows(shape, Format::F16, &mut mid, 0, &k8, &v8).unwrap();
    let mut want = vec![0u8; shape.page_bytes(Format::Q4)];
    quantize(shape, Format::F16, &mid, 32, Format::Q4, &mut want).unwrap();
    assert_eq!(q4, want);

    let mut back = vec![0u8; shape.page_bytes(Format::Q8)];
    assert!(requantize(shape, Format::F16, Format::Q4, &q4, 32, Format::Q8, &mut back).is_err(), "never up");
    assert!(requantize(shape, Format::F16, Format::Q8, &q8, 32, Format::Q8, &mut back).is_err(), "never sideways");
}

/// What [`dequantize_page`] must write: the decoded rows written into a zeroed, initialized 16-bit
/// page.
fn reference_page(shape: PageShape, from: Format, src: &[u8], tokens: usize, to: Format) -> Vec<u8> {
    let n = tokens * shape.kv_heads * shape.head_dim;
    let (mut k, mut v) = (vec![0.0; n], vec![0.0; n]);
    dequantize_with(Isa::Scalar, shape, from, src, tokens, &mut k, &mut v).expect("a valid quantized page");
    let mut page = vec![0u8; shape.page_bytes(to)];
    init_page(shape, to, &mut page).expect("a valid shape");
    write_rows(shape, to, &mut page, 0, &k, &v).expect("rows that fit the page");
    page
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Every kernel's page-to-page dequantize writes exactly the reference page, whatever the
    /// destination held before (it is filled with 0xa5 first), for any prefix of the encoded tokens.
    #[test]
    fn dequantize_page_writes_the_decoded_rows_as_a_16_bit_page(
        (shape, tokens) in quantized_shapes(),
        format in proptest::sample::select(Format::QUANTIZED.to_vec()),
        to_bf16 in any::<bool>(),
        fewer in 0usize..=3,
        seed in any::<u64>(),
    ) {
        let to = if to_bf16 { Format::Bf16 } else { Format::F16 };
        let (k, v) = spread_rows(shape, tokens, seed);
        let mut f16_page = vec![0u8; shape.page_bytes(Format::F16)];
        init_page(shape, Format::F16, &mut f16_page).unwrap();
        write_rows(shape, Format::F16, &mut f16_page, 0, &k, &v).unwrap();
        let mut src = vec![0u8; shape.page_bytes(format)];
        quantize(shape, Format::F16, &f16_page, tokens, format, &mut src).unwrap();
        let read = tokens.saturating_sub(fewer);
        let want = reference_page(shape, format, &src, read, to);
        for isa in Isa::available() {
            let mut dst = vec![0xa5u8; shape.page_bytes(to) + 7];
            dequantize_page_with(isa, shape, format, &src, read, to, &mut dst).unwrap();
            prop_assert!(dst[..want.len()] == want[..], "{isa}: {format} → {to}, {read} of {tokens} tokens, {shape:?}");
            prop_assert!(dst[want.len()..].iter().all(|&b| b == 0xa5), "{isa}: wrote past the page");
        }
    }
}

#[test]
fn dequantize_page_refuses_what_it_cannot_do() {
    let shape = PageShape { kv_heads: 1, head_dim: 16, block_tokens: 16 };
    let (k, v) = spread_rows(shape, 5, 1);
    let mut rng = StdRng::seed_from_u64(1);
    let q8 = make_page(shape, Format::Q8, &k, &v, &mut rng, Fill::Zero);
    let f16_page = make_page(shape, Format::F16, &k, &v, &mut rng, Fill::Zero);
    let mut dst = vec![0u8; shape.page_bytes(Format::F16)];
    let kind = |r: Result<(), kvmm_kernels::KernelError>| r.unwrap_err().kind();
    // A 16-bit source, a quantized destination, more tokens than encoded, a short destination, a
    // source whose header names another format.
    assert_eq!(
        kind(dequantize_page(shape, Format::F16, &f16_page, 5, Format::F16, &mut dst)),
        KernelErrorKind::Unsupported
    );
    let mut q4 = vec![0u8; shape.page_bytes(Format::Q4)];
    assert!(dequantize_page(shape, Format::Q8, &q8, 5, Format::Q4, &mut q4).is_err());
    assert!(dequantize_page(shape, Format::Q8, &q8, 6, Format::F16, &mut dst).is_err());
    let mut short = vec![0u8; shape.page_bytes(Format::F16) - 1];
    assert!(dequantize_page(shape, Format::Q8, &q8, 5, Format::F16, &mut short).is_err());
    assert!(dequantize_page(shape, Format::Q4, &q8, 5, Format::F16, &mut dst).is_err());
    dequantize_page(shape, Format::Q8, &q8, 5, Format::F16, &mut dst).unwrap();
}

#[test]
fn dequantize_page_bounds_cover_only_the_tokens_read() {
    // The tokens past those read hold keys far above (even channels) or below (odd channels) the
    // ones read, so their codes are the extremes: a kernel that let an unread token's code into a
    // channel's bounds, or left a read one out, writes a different page. Every count read, every
    // kernel, every format (keys may be decoded by table, bounds found on the codes).
    let shape = PageShape { kv_heads: 2, head_dim: 32, block_tokens: 32 };
    let row = shape.kv_heads * shape.head_dim;
    for read in 1..=32 {
        let k: Vec<f32> = (0..32 * row)
            .map(|i| match (i / row, i % shape.head_dim) {
                // Rising along the tokens (falling in every third channel), so each prefix has its
                // own extremes, in the last token read.
                (t, c) if t < read && c % 3 == 0 => 90.0 - 5.8 * t as f32,
                (t, _) if t < read => -90.0 + 5.8 * t as f32,
                (_, c) if c % 2 == 0 => 100.0,
                _ => -100.0,
            })
            .collect();
        let v: Vec<f32> = (0..32 * row).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut f16_page = vec![0u8; shape.page_bytes(Format::F16)];
        init_page(shape, Format::F16, &mut f16_page).unwrap();
        write_rows(shape, Format::F16, &mut f16_page, 0, &k, &v).unwrap();
        for format in Format::QUANTIZED {
            let mut src = vec![0u8; shape.page_bytes(format)];
            quantize(shape, Format::F16, &f16_page, 32, format, &mut src).unwrap();
            let want = reference_page(shape, format, &src, read, Format::F16);
            for isa in Isa::available() {
                let mut dst = vec![0xa5u8; shape.page_bytes(Format::F16)];
                dequantize_page_with(isa, shape, format, &src, read, Format::F16, &mut dst).unwrap();
                assert!(dst == want, "{isa}: {format}, {read} of 32 tokens read");
            }
        }
    }
}
