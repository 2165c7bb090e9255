//! Decode attention: every available kernel against the scalar kernel, the scalar kernel against the
//! dense f64 reference, pages of mixed formats, and unfilled slots that must never matter.

mod common;

use common::{Fill, Paged, random_query, worst_row_error};
use kvmm_kernels::{
    AttnShape, DecodeAttention, Format, Isa, PageView, decode_attention, reference_attention_f32, reference_token_mass,
};
use proptest::prelude::*;

/// Output and per-page mass of one kernel over the pages.
fn run(isa: Isa, shape: AttnShape, q: &[f32], scale: f32, pages: &[PageView<'_>]) -> (Vec<f32>, Vec<f32>) {
    let mut attention = DecodeAttention::with_isa(isa, shape, q, scale).expect("valid arguments");
    for page in pages {
        attention.page(*page).expect("valid page");
    }
    let mut out = vec![0.0; shape.q_heads * shape.head_dim];
    let mut mass = vec![0.0; pages.len()];
    attention.finish(&mut out, &mut mass).expect("valid buffers");
    (out, mass)
}

fn shapes() -> impl Strategy<Value = (AttnShape, usize)> {
    (1usize..=4, prop_oneof![4 => 1usize..=8, 1 => 9usize..=12], 1usize..=16, 0u32..=5).prop_flat_map(
        |(kv_heads, group, dim16, block_log)| {
            let shape =
                AttnShape { q_heads: kv_heads * group, kv_heads, head_dim: 16 * dim16, block_tokens: 8 << block_log };
            // Up to three pages, with a random partial last page; keep the scalar work bounded.
            let max_tokens = (3 * shape.block_tokens).min(640);
            (Just(shape), 1usize..=max_tokens)
        },
    )
}

/// The formats of a sequence's pages, page `i` in `formats[i % len]`: one format, or a mix.
fn formats() -> impl Strategy<Value = Vec<Format>> {
    proptest::collection::vec(proptest::sample::select(Format::ALL.to_vec()), 1..=3)
}

/// Shapes for the quantized formats, which need `head_dim` a multiple of 16 (always) and
/// `block_tokens` at least 16 for the AVX-512 kernels: group sizes 1..=8, partial last pages.
fn quantized_shapes() -> impl Strategy<Value = (AttnShape, usize)> {
    (1usize..=3, 1usize..=8, 1usize..=16, 1u32..=5).prop_flat_map(|(kv_heads, group, dim16, block_log)| {
        let shape =
            AttnShape { q_heads: kv_heads * group, kv_heads, head_dim: 16 * dim16, block_tokens: 8 << block_log };
        let max_tokens = (3 * shape.block_tokens).min(640);
        (Just(shape), 1usize..=max_tokens)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Tolerance 1e-4 (relative to each head's largest output) for every kernel. The integer key
    /// scores of `avx512vnni` quantize the scaled query to i16 per page and head (a step of 1/32767
    /// of its largest element); a tile of heads whose typical score error would exceed 2e-5 logits
    /// takes the f32 path instead, so its outputs stay within about 7e-5 of the scalar kernel's in
    /// every regime this test draws (the f32 kernels within about 2e-5).
    #[test]
    fn every_available_kernel_matches_the_scalar_kernel(
        (shape, tokens) in shapes(),
        formats in formats(),
        scale in 0.01f32..0.5,
        seed in any::<u64>(),
    ) {
        let paged = Paged::random_mixed(shape, &formats, tokens, seed, Fill::Random);
        let q = random_query(shape, seed);
        let views = paged.views();
        let (want_out, want_mass) = run(Isa::Scalar, shape, &q, scale, &views);
        let total: f32 = want_mass.iter().sum();
        prop_assert!((total - 1.0).abs() <= 1e-4, "scalar mass sums to {}", total);
        for isa in Isa::available() {
            let (out, mass) = run(isa, shape, &q, scale, &views);
            let err = worst_row_error(&out, &want_out, shape.head_dim);
            prop_assert!(err <= 1e-4, "{isa}: relative error {err} on {shape:?}, {formats:?}, {tokens} tokens");
            let total: f32 = mass.iter().sum();
            prop_assert!((total - 1.0).abs() <= 1e-4, "{isa}: mass sums to {total}");
            for (p, (got, want)) in mass.iter().zip(&want_mass).enumerate() {
                prop_assert!((got - want).abs() <= 1e-4, "{isa}: page {p} mass {got} vs {want}");
            }
        }
    }

    #[test]
    fn scalar_kernel_matches_the_dense_reference(
        (shape, tokens) in shapes(),
        formats in formats(),
        scale in 0.01f32..0.5,
        seed in any::<u64>(),
    ) {
        let paged = Paged::random_mixed(shape, &formats, tokens, seed, Fill::Zero);
        let q = random_query(shape, seed);
        let (out, mass) = run(Isa::Scalar, shape, &q, scale, &paged.views());

        let mut want = vec![0.0; out.len()];
        reference_attention_f32(
            shape.q_heads, shape.kv_heads, shape.head_dim, &q, &paged.keys, &paged.values, scale,
            &mut want,
        ).expect("valid reference arguments");
        let err = worst_row_error(&out, &want, shape.head_dim);
        prop_assert!(err <= 1e-3, "relative error {err} on {shape:?}, {tokens} tokens");

        let mut token_mass = vec![0.0; tokens];
        reference_token_mass(
            shape.q_heads, shape.kv_heads, shape.head_dim, &q, &paged.keys, scale, &mut token_mass,
        ).expect("valid reference arguments");
        for (p, chunk) in token_mass.chunks(shape.block_tokens).enumerate() {
            let want: f32 = chunk.iter().sum();
            prop_assert!((mass[p] - want).abs() <= 1e-3, "page {p} mass {} vs {want}", mass[p]);
        }
    }

    #[test]
    fn garbage_in_unfilled_slots_never_changes_any_kernel(
        (shape, tokens) in shapes(),
        formats in formats(),
        scale in 0.01f32..0.5,
        seed in any::<u64>(),
    ) {
        let mut paged = Paged::random_mixed(shape, &formats, tokens, seed, Fill::Zero);
        let q = random_query(shape, seed);
        let clean: Vec<_> = Isa::available()
            .into_iter()
            .map(|isa| run(isa, shape, &q, scale, &paged.views()))
            .collect();
        for fill in [Fill::Random, Fill::Poison] {
            paged.refill_unfilled(fill, seed.rotate_left(7));
            for (isa, (want_out, want_mass)) in Isa::available().into_iter().zip(&clean) {
                let (out, mass) = run(isa, shape, &q, scale, &paged.views());
                // Bit for bit: unfilled lanes are discarded by selection, so nothing may differ.
                prop_assert!(
                    out.iter().zip(want_out).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa}: {fill:?} in unfilled slots changed the output"
                );
                prop_assert!(
                    mass.iter().zip(want_mass).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa}: {fill:?} in unfilled slots changed the mass"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The integer key scores of `avx512vnni` against the scalar kernel where they always run:
    /// keys and queries in [-1, 1) and the usual softmax scale `1 / sqrt(head_dim)` bound the
    /// largest scaled query element by `(2 / 255) / sqrt(head_dim)`, so the typical score error of
    /// its i16 quantization is at most about 5e-6 logits, below the 2e-5 at which a tile falls back
    /// to f32 scores. Tolerance 1e-4, as for every kernel (the integer path measures below 7e-5).
    #[test]
    fn integer_key_scores_match_the_scalar_kernel_at_usual_logit_scales(
        (shape, tokens) in quantized_shapes(),
        formats in proptest::collection::vec(proptest::sample::select(Format::QUANTIZED.to_vec()), 1..=3),
        seed in any::<u64>(),
    ) {
        let (k, v) = common::random_rows(shape, tokens, seed);
        let (k, v): (Vec<f32>, Vec<f32>) = (k.iter().map(|x| x / 2.0).collect(), v.iter().map(|x| x / 2.0).collect());
        let paged = Paged::from_rows_mixed(shape, &formats, &k, &v, seed, Fill::Random);
        let q: Vec<f32> = random_query(shape, seed).iter().map(|x| x / 2.0).collect();
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let views = paged.views();
        let (want_out, want_mass) = run(Isa::Scalar, shape, &q, scale, &views);
        for isa in Isa::available() {
            let (out, mass) = run(isa, shape, &q, scale, &views);
            let err = worst_row_error(&out, &want_out, shape.head_dim);
            prop_assert!(err <= 1e-4, "{isa}: relative error {err} on {shape:?}, {formats:?}, {tokens} tokens");
            for (p, (got, want)) in mass.iter().zip(&want_mass).enumerate() {
                prop_assert!((got - want).abs() <= 1e-4, "{isa}: page {p} mass {got} vs {want}");
            }
        }
    }
}

#[test]
fn mixed_pages_equal_dequantizing_every_page_then_the_dense_reference() {
    // Pages in f16, q8 and q4 interleaved (plus the other formats), a partial last page, for the
    // SmolLM2 and Llama-3-8B head shapes. Tolerance 1e-4 relative to each head's largest output:
    // the f32 kernels agree to float rounding (about 1e-6); the integer key scores of `avx512vnni`
    // add the error of their i16 query (see `every_available_kernel_matches_the_scalar_kernel`),
    // about 2e-5 here.
    let mixes: [&[Format]; 2] = [
        &[Format::F16, Format::Q8, Format::Q4],
        &[Format::Q4, Format::F16, Format::Q8, Format::Bf16, Format::Q2, Format::K8V4],
    ];
    for shape in [
        AttnShape { q_heads: 9, kv_heads: 3, head_dim: 64, block_tokens: 32 },
        AttnShape { q_heads: 32, kv_heads: 8, head_dim: 128, block_tokens: 32 },
    ] {
        for (m, formats) in mixes.iter().enumerate() {
            let paged = Paged::random_mixed(shape, formats, 7 * 32 - 5, 40 + m as u64, Fill::Poison);
            let q = random_query(shape, 41);
            let scale = 1.0 / (shape.head_dim as f32).sqrt();
            let mut want = vec![0.0; shape.q_heads * shape.head_dim];
            reference_attention_f32(
                shape.q_heads,
                shape.kv_heads,
                shape.head_dim,
                &q,
                &paged.keys,
                &paged.values,
                scale,
                &mut want,
            )
            .unwrap();
            for isa in Isa::available() {
                let (out, mass) = run(isa, shape, &q, scale, &paged.views());
                let err = worst_row_error(&out, &want, shape.head_dim);
                assert!(err <= 1e-4, "{isa}, {formats:?}: relative error {err}");
                assert!((mass.iter().sum::<f32>() - 1.0).abs() < 1e-4, "{isa}");
            }
        }
    }
}

#[test]
fn one_token_gets_all_the_mass_and_returns_its_value() {
    let shape = AttnShape { q_heads: 9, kv_heads: 3, head_dim: 64, block_tokens: 32 };
    let paged = Paged::random(shape, Format::F16, 1, 7, Fill::Poison);
    let q = random_query(shape, 7);
    for isa in Isa::available() {
        let (out, mass) = run(isa, shape, &q, 0.125, &paged.views());
        assert_eq!(mass, vec![1.0]);
        for qh in 0..shape.q_heads {
            let kv = qh / 3;
            let v = &paged.values[kv * 64..(kv + 1) * 64];
            let got = &out[qh * 64..(qh + 1) * 64];
            assert!(got.iter().zip(v).all(|(a, b)| (a - b).abs() <= 1e-6 * b.abs()), "{isa}");
        }
    }
}

#[test]
fn mass_follows_the_page_that_matches_the_query() {
    // Page 1 holds keys equal to a large multiple of the query direction; it must take nearly all
    // the mass, in every kernel.
    let shape = AttnShape { q_heads: 4, kv_heads: 1, head_dim: 16, block_tokens: 8 };
    let q = vec![1.0f32; 64];
    let row = 16;
    let mut keys = vec![0.0f32; 24 * row];
    for t in 8..16 {
        keys[t * row..(t + 1) * row].fill(2.0);
    }
    let values = vec![0.5f32; 24 * row];
    let paged = Paged::from_rows(shape, Format::Bf16, &keys, &values, 1, Fill::Zero);
    for isa in Isa::available() {
        let (out, mass) = run(isa, shape, &q, 1.0, &paged.views());
        assert!(mass[1] > 0.999_999, "{isa}: {mass:?}");
        assert!(out.iter().all(|x| (x - 0.5).abs() < 1e-6), "{isa}");
    }
}

#[test]
fn decode_attention_over_a_slice_equals_feeding_pages_one_by_one() {
    let shape = AttnShape { q_heads: 32, kv_heads: 8, head_dim: 128, block_tokens: 32 };
    let paged = Paged::random(shape, Format::F16, 100, 3, Fill::Random);
    let q = random_query(shape, 3);
    let views = paged.views();
    let (want_out, want_mass) = run(Isa::detect(), shape, &q, 0.088, &views);
    let mut out = vec![0.0; want_out.len()];
    let mut mass = vec![0.0; views.len()];
    decode_attention(shape, &q, 0.088, &views, &mut out, &mut mass).unwrap();
    assert_eq!(out, want_out);
    assert_eq!(mass, want_mass);
}

#[test]
fn prefetch_hints_never_change_the_result() {
    let shape = AttnShape { q_heads: 12, kv_heads: 3, head_dim: 64, block_tokens: 32 };
    let paged = Paged::random(shape, Format::F16, 150, 5, Fill::Poison);
    let q = random_query(shape, 5);
    let views = paged.views();
    let empty: &[u8] = &[];
    for isa in Isa::available() {
        let (want_out, want_mass) = run(isa, shape, &q, 0.125, &views);
        // The true next page, an empty slice, and an unrelated short buffer are all just hints.
        for hint in 0..3 {
            let mut attention = DecodeAttention::with_isa(isa, shape, &q, 0.125).unwrap();
            for (i, page) in views.iter().enumerate() {
                let next = match hint {
                    0 => views.get(i + 1).map_or(empty, |v| v.bytes),
                    1 => empty,
                    _ => &paged.pages[0][..7],
                };
                attention.page_prefetching(*page, next).unwrap();
            }
            let mut out = vec![0.0; want_out.len()];
            let mut mass = vec![0.0; views.len()];
            attention.finish(&mut out, &mut mass).unwrap();
            assert_eq!(out, want_out, "{isa}, hint {hint}");
            assert_eq!(mass, want_mass, "{isa}, hint {hint}");
        }
    }
}

#[test]
fn reset_reuses_the_accumulator_for_a_new_query() {
    let shape = AttnShape { q_heads: 8, kv_heads: 2, head_dim: 32, block_tokens: 16 };
    let paged = Paged::random(shape, Format::F16, 40, 11, Fill::Random);
    let views = paged.views();
    for isa in Isa::available() {
        let mut attention = DecodeAttention::with_isa(isa, shape, &random_query(shape, 1), 0.2).unwrap();
        for page in &views {
            attention.page(*page).unwrap();
        }
        let q2 = random_query(shape, 2);
        attention.reset(&q2, 0.3).unwrap();
        assert_eq!(attention.pages(), 0);
        for page in &views {
            attention.page(*page).unwrap();
        }
        let mut out = vec![0.0; 8 * 32];
        let mut mass = vec![0.0; views.len()];
        attention.write_output(&mut out, &mut mass).unwrap();
        let (want_out, want_mass) = run(isa, shape, &q2, 0.3, &views);
        assert_eq!(out, want_out, "{isa}");
        assert_eq!(mass, want_mass, "{isa}");
    }
}

#[test]
fn detected_isa_is_available_and_cached() {
    let isa = Isa::detect();
    assert!(isa.is_available());
    assert_eq!(Isa::detect(), isa);
    assert_eq!(Isa::available().first(), Some(&Isa::Scalar));
    assert_eq!(Isa::available().last(), Some(&isa));
}

/// Every AArch64 CPU has Advanced SIMD, so there the NEON kernel is the one chosen, and the
/// comparisons above (every available kernel against the scalar one) run it. CI runs this file under
/// `qemu-aarch64`; a detection that failed there would silently leave NEON untested.
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_is_detected_on_aarch64() {
    assert_eq!(Isa::detect(), Isa::Neon);
    assert_eq!(Isa::available(), vec![Isa::Scalar, Isa::Neon]);
}
