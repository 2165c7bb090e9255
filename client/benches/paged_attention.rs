//! Decode attention over pages in a private buffer vs. pages scattered through a shared memfd mapping.
//!
//! At 32k tokens of context, for the SmolLM2 (9/3/64) and Llama-3-8B (32/8/128) shapes, block_tokens
//! 32, f16, one thread, best available kernel:
//!
//! - (a) **private**: pages contiguous, in order, in one `Vec<u8>`;
//! - (b) **shared**: the same pages in a memfd-backed `MAP_SHARED` mapping (`kvmm_shm::Memfd`,
//!   `kvmm_shm::Mapping`), populated up front, each page in a frame at a shuffled offset, borrowed
//!   with `Mapping::bytes` and fed page by page, as a client does after pinning a layer.
//!
//! Both feed each page with the next one as a prefetch hint. Criterion times both; in benchmark mode a
//! summary prints the ratio (b)/(a) of the best times and the median of paired per-round ratios
//! (target ≤ 1.05).
//!
//! `cargo bench -p kvmm-client --bench paged_attention`

mod support;

use support::best_seconds;

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use half::f16;
use kvmm_kernels::{AttnShape, DecodeAttention, Format, PageView, init_page};
use kvmm_shm::{Access, Mapping, Memfd};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

const BLOCK_TOKENS: usize = 32;
const CONTEXT: usize = 32768;
const PAGES: usize = CONTEXT / BLOCK_TOKENS;
/// Paired rounds in the summary.
const PAIRS: usize = 61;

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

/// The same context twice: contiguous in private memory, and scattered through a shared mapping.
struct Case {
    label: String,
    shape: AttnShape,
    page_bytes: usize,
    q: Vec<f32>,
    scale: f32,
    private: Vec<u8>,
    /// Keeps the memfd alive for the mapping's sake (a mapping outlives its fd anyway).
    _memfd: Memfd,
    shared: Mapping,
    /// `frames[i]`: the frame of the shared mapping that holds page `i`.
    frames: Vec<usize>,
}

impl Case {
    fn new(model: &Model) -> Case {
        let shape = AttnShape {
            q_heads: model.q_heads,
            kv_heads: model.kv_heads,
            head_dim: model.head_dim,
            block_tokens: BLOCK_TOKENS,
        };
        let page_bytes = shape.page_shape().page_bytes(Format::F16);
        let mut rng = StdRng::seed_from_u64(7);
        let mut private = vec![0u8; page_bytes * PAGES];
        for element in private.chunks_exact_mut(2) {
            let x = f16::from_f32(rng.random_range(-1.0..1.0));
            element.copy_from_slice(&x.to_bits().to_le_bytes());
        }
        // A valid header and empty key bounds over the random bytes: kernels refuse a page without.
        for page in private.chunks_exact_mut(page_bytes) {
            init_page(shape.page_shape(), Format::F16, page).expect("valid shape");
        }
        let q = (0..shape.q_heads * shape.head_dim).map(|_| rng.random_range(-1.0..1.0)).collect();

        let len = private.len();
        let memfd = Memfd::create("kvmm-bench-arena", len as u64).expect("memfd_create works");
        let shared = Mapping::map(&memfd, Access::ReadWrite).expect("mmap of a fresh memfd works");
        shared.populate(0, len, Access::ReadWrite).expect("the arena fits in memory");
        let mut frames: Vec<usize> = (0..PAGES).collect();
        frames.shuffle(&mut rng);
        for (page, &frame) in private.chunks_exact(page_bytes).zip(&frames) {
            shared.write_at(frame * page_bytes, page).expect("frames lie inside the mapping");
        }
        Case {
            label: format!("{}/ctx{CONTEXT}", model.name),
            shape,
            page_bytes,
            q,
            scale: 1.0 / (model.head_dim as f32).sqrt(),
            private,
            _memfd: memfd,
            shared,
            frames,
        }
    }

    /// Feeds `pages` in order, each with the next as a prefetch hint, and writes the result.
    fn attend<'a>(
        &self,
        attention: &mut DecodeAttention,
        pages: impl Iterator<Item = &'a [u8]>,
        out: &mut [f32],
        mass: &mut [f32],
    ) {
        attention.reset(&self.q, self.scale).expect("query fits the shape");
        let mut pages = pages.peekable();
        while let Some(bytes) = pages.next() {
            let page = black_box(PageView { bytes, format: Format::F16, tokens: BLOCK_TOKENS });
            match pages.peek() {
                Some(next) => attention.page_prefetching(page, next),
                None => attention.page(page),
            }
            .expect("page fits the shape");
        }
        attention.write_output(out, mass).expect("buffers fit");
        black_box((out, mass));
    }

    fn private_pages(&self) -> impl Iterator<Item = &[u8]> {
        self.private.chunks_exact(self.page_bytes)
    }

    fn shared_pages(&self) -> impl Iterator<Item = &[u8]> {
        self.frames.iter().map(|&frame| {
            // SAFETY: this process created the memfd and nothing writes the mapping after `new`
            // (no other process has the fd), so the bytes cannot change while the slice lives.
            unsafe { self.shared.bytes(frame * self.page_bytes, self.page_bytes) }
                .expect("frames lie inside the mapping")
        })
    }
}

fn main() {
    let mut criterion = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    // The summary runs under `cargo bench` only, not under `cargo test` or `--profile-time`.
    let args: Vec<String> = std::env::args().collect();
    let benchmarking = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--profile-time");
    let cases: Vec<Case> = MODELS.iter().map(Case::new).collect();

    for case in &cases {
        let mut group = criterion.benchmark_group(format!("paged_attention/{}", case.label));
        group.throughput(Throughput::Bytes(case.private.len() as u64));
        let mut attention = DecodeAttention::new(case.shape, &case.q, case.scale).expect("shape and query are valid");
        let mut out = vec![0.0; case.shape.q_heads * case.shape.head_dim];
        let mut mass = vec![0.0; PAGES];
        group.bench_function("private_contiguous", |b| {
            b.iter(|| case.attend(&mut attention, case.private_pages(), &mut out, &mut mass))
        });
        group.bench_function("shared_scattered", |b| {
            b.iter(|| case.attend(&mut attention, case.shared_pages(), &mut out, &mut mass))
        });
        group.finish();
    }
    criterion.final_summary();

    if !benchmarking {
        return;
    }
    println!();
    println!("single thread, f16, block_tokens {BLOCK_TOKENS}, kernel {}", kvmm_kernels::Isa::detect());
    println!(
        "{:<20} {:>8} {:>18} {:>18} {:>14} {:>16}",
        "case", "KV MiB", "(a) private GB/s", "(b) shared GB/s", "(b)/(a) best", "(b)/(a) median"
    );
    for case in &cases {
        let mut attention = DecodeAttention::new(case.shape, &case.q, case.scale).expect("shape and query are valid");
        let mut out = vec![0.0; case.shape.q_heads * case.shape.head_dim];
        let mut mass = vec![0.0; PAGES];
        // Paired rounds: one call of each, back to back, so both see the same machine state. The
        // median of the per-pair ratios is robust to the bursts of a shared machine; the ratio of
        // best times is printed beside it.
        let (mut a, mut b) = (f64::INFINITY, f64::INFINITY);
        let mut ratios = Vec::with_capacity(PAIRS);
        let _warm = best_seconds(2, || case.attend(&mut attention, case.shared_pages(), &mut out, &mut mass));
        for _ in 0..PAIRS {
            let ta = best_seconds(1, || case.attend(&mut attention, case.private_pages(), &mut out, &mut mass));
            let tb = best_seconds(1, || case.attend(&mut attention, case.shared_pages(), &mut out, &mut mass));
            (a, b) = (a.min(ta), b.min(tb));
            ratios.push(tb / ta);
        }
        ratios.sort_unstable_by(f64::total_cmp);
        let bytes = case.private.len() as f64;
        println!(
            "{:<20} {:>8.1} {:>18.2} {:>18.2} {:>14.3} {:>16.3}",
            case.label,
            bytes / (1 << 20) as f64,
            bytes / a / 1e9,
            bytes / b / 1e9,
            b / a,
            ratios[PAIRS / 2]
        );
    }
}
