//! Quantize (f16 → q8, k8v4, q4, q2) and dequantize (→ f32 rows), one thread, every available
//! kernel, in elements per second (an element is one K or V value; a full page of block_tokens 32
//! holds 2 × kv_heads × head_dim × 32).
//!
//! Pages: 64 full f16 pages of random rows per shape (SmolLM2 3 × 64, Llama-3-8B 8 × 128), quantized
//! one after another into one reused destination page (dequantized into reused rows), so the numbers
//! are the kernels' speed on data in cache. Targets: quantize f16 → q8 ≥ 2 G elements/s, dequantize
//! ≥ 10 G elements/s.
//!
//! `cargo bench -p kvmm-kernels --bench quantize` (`KVMM_BENCH_ISA=avx512` for one kernel only)

use std::hint::black_box;
use std::time::Instant;

use kvmm_kernels::{Format, Isa, PageShape, dequantize_with, init_page, quantize_with, write_rows};
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

fn main() {
    // Only under `cargo bench` (not `cargo test`, which runs bench targets without `--bench`).
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    println!("single thread, block_tokens {BLOCK_TOKENS}, {PAGES} pages cycled; G = 1e9 elements");
    println!(
        "{:<12} {:<12} {:>8} {:>18} {:>20}",
        "shape", "format", "kernel", "quantize Gelem/s", "dequantize Gelem/s"
    );
    for (name, kv_heads, head_dim) in [("smollm2", 3, 64), ("llama3-8b", 8, 128)] {
        let shape = PageShape { kv_heads, head_dim, block_tokens: BLOCK_TOKENS };
        let row = BLOCK_TOKENS * kv_heads * head_dim;
        let mut rng = StdRng::seed_from_u64(7);
        let f16_bytes = shape.page_bytes(Format::F16);
        let mut sources = vec![0u8; PAGES * f16_bytes];
        for page in sources.chunks_exact_mut(f16_bytes) {
            let k: Vec<f32> = (0..row).map(|_| rng.random_range(-3.0..3.0)).collect();
            let v: Vec<f32> = (0..row).map(|_| rng.random_range(-3.0..3.0)).collect();
            init_page(shape, Format::F16, page).expect("valid shape");
            write_rows(shape, Format::F16, page, 0, &k, &v).expect("rows fit");
        }
        let elements = (PAGES * 2 * row) as f64;
        for format in Format::QUANTIZED {
            let bytes = shape.page_bytes(format);
            let mut quantized = vec![0u8; PAGES * bytes];
            for (src, dst) in sources.chunks_exact(f16_bytes).zip(quantized.chunks_exact_mut(bytes)) {
                quantize_with(Isa::Scalar, shape, Format::F16, src, BLOCK_TOKENS, format, dst).expect("quantizable");
            }
            let mut dst = vec![0u8; bytes];
            let (mut k, mut v) = (vec![0.0f32; row], vec![0.0f32; row]);
            // `KVMM_BENCH_ISA=avx512` (say) measures one kernel only, e.g. for profiling.
            let only = std::env::var("KVMM_BENCH_ISA").ok();
            for isa in Isa::available().into_iter().filter(|isa| only.as_deref().is_none_or(|o| o == isa.name())) {
                let runs = if isa == Isa::Scalar { 3 } else { 20 };
                let quantize = best_seconds(runs, || {
                    for src in sources.chunks_exact(f16_bytes) {
                        quantize_with(isa, shape, Format::F16, black_box(src), BLOCK_TOKENS, format, &mut dst)
                            .expect("quantizable");
                        black_box(&dst);
                    }
                });
                let dequantize = best_seconds(runs, || {
                    for page in quantized.chunks_exact(bytes) {
                        dequantize_with(isa, shape, format, black_box(page), BLOCK_TOKENS, &mut k, &mut v)
                            .expect("valid page");
                        black_box((&k, &v));
                    }
                });
                println!(
                    "{:<12} {:<12} {:>8} {:>18.2} {:>20.2}",
                    name,
                    format!("f16 → {format}"),
                    isa.name(),
                    elements / quantize / 1e9,
                    elements / dequantize / 1e9
                );
            }
        }
    }
}
