//! Page selection: bounds that hold, the pages always kept, exactness at full budget, and the
//! quality of attention over a 25% budget (random data, a peaked synthetic sequence, and real
//! queries, keys and values from the inference engine's fixture).

mod common;

use std::path::PathBuf;

use common::{Fill, Paged, random_query, worst_row_error};
use kvmm_kernels::attention::select::RECENT_PAGES;
use kvmm_kernels::{
    AttnShape, Format, PageView, decode_attention, decode_attention_selected, page_score_bounds, select_pages,
};
use proptest::prelude::*;

fn full(shape: AttnShape, q: &[f32], scale: f32, views: &[PageView<'_>]) -> Vec<f32> {
    let mut out = vec![0.0; shape.q_heads * shape.head_dim];
    let mut mass = vec![0.0; views.len()];
    decode_attention(shape, q, scale, views, &mut out, &mut mass).expect("valid pages");
    out
}

fn selected(shape: AttnShape, q: &[f32], scale: f32, views: &[PageView<'_>], budget: usize) -> (Vec<usize>, Vec<f32>) {
    let chosen = select_pages(shape, q, scale, views, budget).expect("valid pages");
    let mut out = vec![0.0; shape.q_heads * shape.head_dim];
    let mut mass = vec![0.0; views.len()];
    decode_attention_selected(shape, q, scale, views, &chosen, &mut out, &mut mass).expect("valid selection");
    (chosen, out)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn page_bounds_exceed_every_stored_keys_score(
        kv_heads in 1usize..=3,
        group in 1usize..=4,
        dim16 in 1usize..=8,
        tokens in 1usize..=64,
        format in proptest::sample::select(Format::ALL.to_vec()),
        seed in any::<u64>(),
    ) {
        let shape = AttnShape { q_heads: kv_heads * group, kv_heads, head_dim: 16 * dim16, block_tokens: 64 };
        let paged = Paged::random(shape, format, tokens, seed, Fill::Random);
        let q = random_query(shape, seed);
        let mut bound = vec![0.0; shape.q_heads];
        page_score_bounds(shape, &q, paged.views()[0], &mut bound).unwrap();
        let dim = shape.head_dim;
        for qh in 0..shape.q_heads {
            let kv = qh / group;
            for t in 0..tokens {
                let k = &paged.keys[(t * kv_heads + kv) * dim..][..dim];
                let score: f32 = q[qh * dim..][..dim].iter().zip(k).map(|(a, b)| a * b).sum();
                prop_assert!(score <= bound[qh] + 1e-4 * bound[qh].abs().max(1.0), "{format}: {score} > {}", bound[qh]);
            }
        }
    }
}

#[test]
fn full_budget_selects_every_page_and_attention_is_exact() {
    let shape = AttnShape { q_heads: 9, kv_heads: 3, head_dim: 64, block_tokens: 32 };
    let paged = Paged::random_mixed(shape, &[Format::F16, Format::Q8], 300, 1, Fill::Random);
    let views = paged.views();
    let q = random_query(shape, 1);
    let (chosen, out) = selected(shape, &q, 0.125, &views, views.len());
    assert_eq!(chosen, (0..views.len()).collect::<Vec<_>>());
    assert_eq!(out, full(shape, &q, 0.125, &views));
}

#[test]
fn sink_and_recent_pages_are_always_kept_and_the_budget_is_respected() {
    let shape = AttnShape { q_heads: 4, kv_heads: 2, head_dim: 32, block_tokens: 16 };
    let paged = Paged::random(shape, Format::Bf16, 20 * 16 - 3, 2, Fill::Random);
    let views = paged.views();
    let q = random_query(shape, 2);
    for budget in 0..25 {
        let chosen = select_pages(shape, &q, 0.2, &views, budget).unwrap();
        assert_eq!(chosen.len(), budget.clamp(1 + RECENT_PAGES, 20), "budget {budget}");
        assert_eq!(chosen[0], 0);
        assert!(chosen.ends_with(&[18, 19]));
        assert!(chosen.windows(2).all(|w| w[0] < w[1]), "ascending, no repeats");
    }
}

/// A sequence where a few pages hold keys close to the query's direction, the rest noise: the
/// peaked attention Quest is built for. The heads of a group ask similar questions (the first
/// head's query plus a little noise), so the hot pages matter to all of them.
fn peaked(shape: AttnShape, pages: usize, hot: &[usize], seed: u64, format: Format) -> (Paged, Vec<f32>) {
    peaked_mixed(shape, pages, hot, seed, &[format])
}

/// [`peaked`] with page `i` in `formats[i % formats.len()]`.
fn peaked_mixed(shape: AttnShape, pages: usize, hot: &[usize], seed: u64, formats: &[Format]) -> (Paged, Vec<f32>) {
    let mut q = random_query(shape, seed);
    let (dim, group) = (shape.head_dim, shape.group());
    for qh in 0..shape.q_heads {
        let first = qh / group * group;
        for d in 0..dim {
            q[qh * dim + d] = q[first * dim + d] + 0.2 * q[qh * dim + d];
        }
    }
    let (mut k, v) = common::random_rows(shape, pages * shape.block_tokens, seed);
    for &p in hot {
        for t in p * shape.block_tokens..(p + 1) * shape.block_tokens {
            for kv in 0..shape.kv_heads {
                let row = &mut k[(t * shape.kv_heads + kv) * dim..][..dim];
                for (d, x) in row.iter_mut().enumerate() {
                    *x = 0.5 * *x + 1.5 * q[kv * group * dim + d];
                }
            }
        }
    }
    (Paged::from_rows_mixed(shape, formats, &k, &v, seed, Fill::Random), q)
}

/// The documented ranking (`select.rs`) from each page's own bounds, one page at a time: a page's
/// largest log-share over the query heads; the sink and recent pages kept, then the best others.
fn select_by_single_page_bounds(
    shape: AttnShape,
    q: &[f32],
    scale: f32,
    views: &[PageView<'_>],
    budget: usize,
) -> Vec<usize> {
    let heads = shape.q_heads;
    let bounds: Vec<Vec<f32>> = views
        .iter()
        .map(|&view| {
            let mut b = vec![0.0; heads];
            page_score_bounds(shape, q, view, &mut b).expect("a valid page");
            b
        })
        .collect();
    let offset: Vec<f64> = (0..heads)
        .map(|h| {
            let best = bounds.iter().map(|b| b[h] as f64).fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = bounds.iter().map(|b| (scale as f64 * (b[h] as f64 - best)).exp()).sum();
            scale as f64 * best + total.ln()
        })
        .collect();
    let n = views.len();
    let rank =
        |p: usize| (0..heads).map(|h| scale as f64 * bounds[p][h] as f64 - offset[h]).fold(f64::NEG_INFINITY, f64::max);
    let mut chosen: Vec<usize> = (0..n).filter(|&p| p == 0 || p + RECENT_PAGES >= n).collect();
    let mut others: Vec<usize> = (1..n - RECENT_PAGES).collect();
    others.sort_by(|&a, &b| rank(b).total_cmp(&rank(a)));
    chosen.extend(others.into_iter().take(budget - chosen.len()));
    chosen.sort_unstable();
    chosen
}

#[test]
fn selection_over_runs_of_mixed_formats_ranks_every_page_by_its_own_bounds() {
    // Runs of 1 to 6 pages of one format, so the kernel's batches of consecutive same-format pages
    // break at every position; hot pages at every position of a batch.
    let shape = AttnShape { q_heads: 8, kv_heads: 2, head_dim: 64, block_tokens: 32 };
    let runs =
        [(Format::F16, 5), (Format::Q8, 1), (Format::Q4, 6), (Format::Bf16, 2), (Format::Q2, 3), (Format::K8V4, 4)];
    let formats: Vec<Format> = runs.iter().cycle().flat_map(|&(f, n)| std::iter::repeat_n(f, n)).take(40).collect();
    let hot = [3, 6, 9, 13, 16, 22, 27, 30];
    let (paged, q) = peaked_mixed(shape, 40, &hot, 5, &formats);
    let views = paged.views();
    for budget in [6, 10, 16, 25] {
        let chosen = select_pages(shape, &q, 0.125, &views, budget).unwrap();
        assert_eq!(chosen, select_by_single_page_bounds(shape, &q, 0.125, &views, budget), "budget {budget}");
    }
    let chosen = select_pages(shape, &q, 0.125, &views, 11).unwrap();
    for p in hot {
        assert!(chosen.contains(&p), "hot page {p} ({}) not in {chosen:?}", formats[p]);
    }
}

#[test]
fn pages_that_match_the_query_are_selected_and_a_quarter_budget_keeps_the_output() {
    let shape = AttnShape { q_heads: 8, kv_heads: 2, head_dim: 64, block_tokens: 32 };
    let hot = [5, 11, 23];
    for format in [Format::F16, Format::Q4] {
        let (paged, q) = peaked(shape, 32, &hot, 3, format);
        let views = paged.views();
        let scale = 1.0 / 8.0;
        let (chosen, out) = selected(shape, &q, scale, &views, 8);
        for p in hot {
            assert!(chosen.contains(&p), "{format}: hot page {p} not in {chosen:?}");
        }
        let err = worst_row_error(&out, &full(shape, &q, scale, &views), shape.head_dim);
        println!("peaked synthetic, {format}, 25% of 32 pages: worst relative row error {err:.2e}");
        assert!(err < 0.05, "{format}: {err}");
    }
}

#[test]
fn quarter_budget_on_random_data_reports_its_error() {
    // Random keys give flat attention, the worst case for selection: report, do not pretend.
    for shape in [
        AttnShape { q_heads: 9, kv_heads: 3, head_dim: 64, block_tokens: 32 },
        AttnShape { q_heads: 32, kv_heads: 8, head_dim: 128, block_tokens: 32 },
    ] {
        let paged = Paged::random(shape, Format::F16, 64 * 32, 4, Fill::Zero);
        let views = paged.views();
        let q = random_query(shape, 4);
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let (_, out) = selected(shape, &q, scale, &views, 16);
        let err = worst_row_error(&out, &full(shape, &q, scale, &views), shape.head_dim);
        println!(
            "random data, {}/{}/{}, 25% of 64 pages: worst relative row error {err:.3}",
            shape.q_heads, shape.kv_heads, shape.head_dim
        );
        assert!(err.is_finite());
    }
}

/// Queries, keys and values of a real model, read from the inference engine's KV fixture
/// (`infer/fixtures/*.kvfx`, format documented in `infer/src/fixture.rs`).
struct Fixture {
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    positions: usize,
    /// Per layer: q `[T][Hq][D]`, k and v `[T][Hkv][D]`.
    q: Vec<Vec<f32>>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

fn read_fixture() -> Option<Fixture> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../infer/fixtures");
    let path = std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "kvfx"))?;
    let bytes = std::fs::read(path).ok()?;
    let word = |i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes")) as usize;
    if &bytes[..4] != b"KVFX" || word(1) != 1 {
        return None;
    }
    let (layers, heads, kv_heads, head_dim, positions) = (word(4), word(5), word(6), word(7), word(12));
    let mut at = 56 + 4 * positions;
    let mut floats = |n: usize| {
        let out: Vec<f32> =
            bytes[at..at + 4 * n].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
        at += 4 * n;
        out
    };
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..layers {
        q.push(floats(positions * heads * head_dim));
        k.push(floats(positions * kv_heads * head_dim));
        v.push(floats(positions * kv_heads * head_dim));
    }
    Some(Fixture { layers, heads, kv_heads, head_dim, positions, q, k, v })
}

/// Zero-pads rows of `from` floats to `to` (the kernels need head_dim a multiple of 16; zeros
/// change no dot product).
fn pad(rows: &[f32], from: usize, to: usize) -> Vec<f32> {
    rows.chunks_exact(from).flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0.0, to - from))).collect()
}

#[test]
fn real_model_keys_quarter_budget_and_quantized_pages_stay_close_to_full_f16_attention() {
    let Some(fx) = read_fixture() else {
        println!("no infer/fixtures/*.kvfx: skipped");
        return;
    };
    let dim = fx.head_dim.next_multiple_of(16);
    let shape = AttnShape { q_heads: fx.heads, kv_heads: fx.kv_heads, head_dim: dim, block_tokens: 16 };
    let scale = 1.0 / (fx.head_dim as f32).sqrt();
    let t = fx.positions;
    let mut worst = [0.0f64; 6];
    for layer in 0..fx.layers {
        let k = pad(&fx.k[layer], fx.head_dim, dim);
        let v = pad(&fx.v[layer], fx.head_dim, dim);
        let q = pad(&fx.q[layer][(t - 1) * fx.heads * fx.head_dim..], fx.head_dim, dim);
        let f16 = Paged::from_rows(shape, Format::F16, &k, &v, 9, Fill::Zero);
        let views = f16.views();
        let want = full(shape, &q, scale, &views);
        let budget = views.len().div_ceil(4);
        let (_, sparse) = selected(shape, &q, scale, &views, budget);
        worst[0] = worst[0].max(worst_row_error(&sparse, &want, dim));
        let (_, half) = selected(shape, &q, scale, &views, views.len().div_ceil(2));
        worst[1] = worst[1].max(worst_row_error(&half, &want, dim));
        for (i, format) in Format::QUANTIZED.into_iter().enumerate() {
            let paged = Paged::from_rows(shape, format, &k, &v, 9, Fill::Zero);
            let got = full(shape, &q, scale, &paged.views());
            worst[2 + i] = worst[2 + i].max(worst_row_error(&got, &want, dim));
        }
    }
    println!(
        "real keys ({} layers × {t} positions, {}/{}/{}): worst relative row error vs full f16: \
         top-25% {:.3}, top-50% {:.3}, q8 {:.4}, q4 {:.4}, q2 {:.4}, k8v4 {:.4}",
        fx.layers, fx.heads, fx.kv_heads, fx.head_dim, worst[0], worst[1], worst[2], worst[3], worst[4], worst[5]
    );
    // This small model has large query and key norms (|q|, |k| up to ~30), so key quantization error
    // is amplified into the scores; the bounds below pin today's behaviour rather than a goal.
    assert!(worst.iter().all(|e| e.is_finite()));
    assert!(worst[2] < 0.25 && worst[5] < 0.25, "q8 {}, k8v4 {}", worst[2], worst[5]);
    assert!(worst[2] < worst[3] && worst[3] < worst[4], "more bits, less error");
    assert!(worst[1] <= worst[0], "a larger budget is no worse");
}
