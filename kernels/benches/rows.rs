//! Row writes (`write_rows`: K/V rows into a 16-bit page, keys transposed channel-major, key bounds
//! widened), one thread, in elements per second (an element is one K or V value): a whole page of
//! 32 tokens per call (prefill) and one token per call (decode), from f32 rows into f16 and bf16
//! pages and from f16 rows into an f16 page, for the SmolLM2 (3 × 64) and Llama-3-8B (8 × 128)
//! shapes. 64 pages cycled, in cache.
//!
//! `cargo bench -p kvmm-kernels --bench rows` (`KVMM_BENCH_RUNS=300` for the best of more runs)

use std::hint::black_box;
use std::time::Instant;

use half::f16;
use kvmm_kernels::{Format, PageShape, RowElement, init_page, write_rows};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const PAGES: usize = 64;
const BLOCK_TOKENS: usize = 32;

/// Best (smallest) wall time of `runs` calls of `f`, after one warm-up call.
fn best_seconds(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// G elements/s of writing `k`/`v` (one page's rows) into every page, `tokens` per call.
fn measure<E: RowElement>(
    runs: usize,
    shape: PageShape,
    format: Format,
    pages: &mut [u8],
    k: &[E],
    v: &[E],
    tokens: usize,
) -> f64 {
    let bytes = shape.page_bytes(format);
    let row = shape.kv_heads * shape.head_dim;
    let seconds = best_seconds(runs, || {
        for page in pages.chunks_exact_mut(bytes) {
            for first in (0..BLOCK_TOKENS).step_by(tokens) {
                let rows = first * row..(first + tokens) * row;
                write_rows(shape, format, page, first, &k[rows.clone()], &v[rows]).expect("rows fit");
            }
            black_box(&page);
        }
    });
    (PAGES * 2 * BLOCK_TOKENS * row) as f64 / seconds / 1e9
}

fn main() {
    // Only under `cargo bench` (not `cargo test`, which runs bench targets without `--bench`).
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let runs = std::env::var("KVMM_BENCH_RUNS").ok().and_then(|r| r.parse().ok()).unwrap_or(100);
    println!("single thread, block_tokens {BLOCK_TOKENS}, {PAGES} pages cycled; G = 1e9 elements");
    println!("{:<10} {:<12} {:>22} {:>22}", "shape", "rows → page", "32 tokens/call Gelem/s", "1 token/call Gelem/s");
    for (name, kv_heads, head_dim) in [("smollm2", 3, 64), ("llama3-8b", 8, 128)] {
        let shape = PageShape { kv_heads, head_dim, block_tokens: BLOCK_TOKENS };
        let n = BLOCK_TOKENS * kv_heads * head_dim;
        let mut rng = StdRng::seed_from_u64(11);
        let k: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        let (k16, v16): (Vec<f16>, Vec<f16>) =
            (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
        for (label, format, sixteen) in
            [("f32 → f16", Format::F16, false), ("f32 → bf16", Format::Bf16, false), ("f16 → f16", Format::F16, true)]
        {
            let bytes = shape.page_bytes(format);
            let mut pages = vec![0u8; PAGES * bytes];
            for page in pages.chunks_exact_mut(bytes) {
                init_page(shape, format, page).expect("valid shape");
            }
            let (whole, single) = if sixteen {
                let whole = measure(runs, shape, format, &mut pages, &k16, &v16, BLOCK_TOKENS);
                (whole, measure(runs, shape, format, &mut pages, &k16, &v16, 1))
            } else {
                let whole = measure(runs, shape, format, &mut pages, &k, &v, BLOCK_TOKENS);
                (whole, measure(runs, shape, format, &mut pages, &k, &v, 1))
            };
            println!("{name:<10} {label:<12} {whole:>22.3} {single:>22.3}");
        }
    }
}
