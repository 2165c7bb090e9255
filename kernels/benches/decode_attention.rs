//! Decode attention over a whole context, one thread, against a plain streaming read of the same bytes.
//!
//! Shapes: SmolLM2 (9 query heads, 3 KV heads, head_dim 64) and Llama-3-8B (32/8/128), block_tokens
//! 32, f16, contexts of 4096 and 32768 tokens stored as full pages in one contiguous private buffer.
//! Criterion times every available kernel and the streaming sum (throughput in bytes of KV read);
//! then, in benchmark mode, a summary table gives for each shape, context and kernel the attention
//! bandwidth, the streaming bandwidth of a buffer of the same size, and their ratio (the acceptance
//! target is ≥ 0.6 for the best kernel at 32k), from the best of several runs of each. Pages are fed
//! with the next page as a prefetch hint (`DecodeAttention::page_prefetching`), as a client that
//! has pinned a whole layer can.
//!
//! `cargo bench -p kvmm-kernels --bench decode_attention`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use half::f16;
use kvmm_kernels::{AttnShape, DecodeAttention, Format, Isa, PageView};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const BLOCK_TOKENS: usize = 32;
const CONTEXTS: [usize; 2] = [4096, 32768];

struct Model {
    name: &'static str,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

const MODELS: [Model; 2] = [
    Model { name: "smollm2", q_heads: 9, kv_heads: 3, head_dim: 64 },
    Model { name: "llama3-8b", q_heads: 32, kv_heads: 8, head_dim: 128 },
];

/// One benchmark case: a context of full f16 pages, contiguous, and a query.
struct Case {
    label: String,
    shape: AttnShape,
    page_bytes: usize,
    pages: Vec<u8>,
    q: Vec<f32>,
    scale: f32,
}

impl Case {
    fn new(model: &Model, context: usize) -> Case {
        let shape = AttnShape {
            q_heads: model.q_heads,
            kv_heads: model.kv_heads,
            head_dim: model.head_dim,
            block_tokens: BLOCK_TOKENS,
        };
        let page_bytes = shape.page_shape().page_bytes(Format::F16);
        let mut rng = StdRng::seed_from_u64(context as u64);
        let mut pages = vec![0u8; page_bytes * context / BLOCK_TOKENS];
        for element in pages.chunks_exact_mut(2) {
            let x = f16::from_f32(rng.random_range(-1.0..1.0));
            element.copy_from_slice(&x.to_bits().to_le_bytes());
        }
        let q = (0..shape.q_heads * shape.head_dim).map(|_| rng.random_range(-1.0..1.0)).collect();
        Case {
            label: format!("{}/ctx{}", model.name, context),
            shape,
            page_bytes,
            pages,
            q,
            scale: 1.0 / (model.head_dim as f32).sqrt(),
        }
    }

    fn bytes(&self) -> usize {
        self.pages.len()
    }

    /// One attention call over every page, pages fed in order, each with the next as a prefetch hint.
    fn attend(&self, attention: &mut DecodeAttention, out: &mut [f32], mass: &mut [f32]) {
        attention.reset(&self.q, self.scale).expect("query fits the shape");
        for (i, bytes) in self.pages.chunks_exact(self.page_bytes).enumerate() {
            let page = black_box(PageView { bytes, format: Format::F16, tokens: BLOCK_TOKENS });
            let next = &self.pages[((i + 1) * self.page_bytes).min(self.pages.len())..];
            if next.is_empty() {
                attention.page(page).expect("page fits the shape");
            } else {
                attention.page_prefetching(page, next).expect("page fits the shape");
            }
        }
        attention.write_output(out, mass).expect("buffers fit");
        black_box((out, mass));
    }
}

/// Sum of every 64-bit word of `bytes`: the streaming-read baseline. Word reads of all the memory,
/// summed so nothing can be skipped; the loop vectorizes to full-width loads.
fn stream_sum(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: avx512f was detected on this CPU just above.
        return unsafe { stream_sum_avx512(bytes) };
    }
    stream_sum_portable(bytes)
}

#[inline(always)]
fn stream_sum_portable(bytes: &[u8]) -> u64 {
    bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("chunks are 8 bytes")))
        .fold(0u64, u64::wrapping_add)
}

/// [`stream_sum_portable`] compiled for AVX-512 so the loop uses 64-byte loads.
///
/// # Safety
///
/// The CPU must support avx512f.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_sum_avx512(bytes: &[u8]) -> u64 {
    stream_sum_portable(bytes)
}

/// Best (smallest) wall time of `runs` calls of `f`, after one warm-up call. The minimum rather than
/// the median: on a shared machine (other builds running) most of the spread is time spent waiting
/// for a core, which only ever adds.
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
    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    // The summary table runs under `cargo bench` only: not under `cargo test` (no `--bench`) nor when
    // profiling a single benchmark with `--profile-time`.
    let args: Vec<String> = std::env::args().collect();
    let benchmarking = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--profile-time");
    let cases: Vec<Case> = MODELS.iter().flat_map(|m| CONTEXTS.iter().map(move |&c| Case::new(m, c))).collect();

    for case in &cases {
        let mut group = criterion.benchmark_group(format!("decode_attention/{}", case.label));
        group.throughput(Throughput::Bytes(case.bytes() as u64));
        let mut out = vec![0.0; case.shape.q_heads * case.shape.head_dim];
        let mut mass = vec![0.0; case.bytes() / case.page_bytes];
        for isa in Isa::available() {
            let mut attention = DecodeAttention::with_isa(isa, case.shape, &case.q, case.scale)
                .expect("shape is valid and isa available");
            group.bench_function(isa.name(), |b| b.iter(|| case.attend(&mut attention, &mut out, &mut mass)));
        }
        group.bench_function("stream", |b| b.iter(|| stream_sum(black_box(&case.pages))));
        group.finish();
    }
    criterion.final_summary();

    if !benchmarking {
        return;
    }
    println!();
    println!(
        "single thread, f16, block_tokens {BLOCK_TOKENS}, pages contiguous, next page as prefetch hint; \
         best of n runs; GB = 1e9 bytes"
    );
    println!(
        "{:<20} {:>8} {:>8} {:>15} {:>12} {:>7}",
        "case", "KV MiB", "kernel", "attention GB/s", "stream GB/s", "ratio"
    );
    for case in &cases {
        let bytes = case.bytes() as f64;
        let mut out = vec![0.0; case.shape.q_heads * case.shape.head_dim];
        let mut mass = vec![0.0; case.bytes() / case.page_bytes];
        for isa in Isa::available() {
            let mut attention = DecodeAttention::with_isa(isa, case.shape, &case.q, case.scale)
                .expect("shape is valid and isa available");
            let runs = if isa == Isa::Scalar { 3 } else { 25 };
            let attend = best_seconds(runs, || case.attend(&mut attention, &mut out, &mut mass));
            // Measured right after, so both see the same cache and frequency state.
            let stream = best_seconds(25, || {
                black_box(stream_sum(black_box(&case.pages)));
            });
            println!(
                "{:<20} {:>8.1} {:>8} {:>15.2} {:>12.2} {:>7.3}",
                case.label,
                bytes / (1 << 20) as f64,
                isa.name(),
                bytes / attend / 1e9,
                bytes / stream / 1e9,
                stream / attend,
            );
        }
    }
}
