//! Demote and promote throughput of the flash tier against plain O_DIRECT I/O of the same bytes
//! with the same engine, as ratios within one run (this machine is shared and noisy).
//!
//! - **write**: `FlashFile::put` of a batch of pages (seal with AES-256-GCM, frame records, coalesce
//!   into 1 MiB requests, one submission) vs writing the same number of bytes to the same offsets in
//!   1 MiB requests with `run_all`.
//! - **demote**: what the daemon's default ladder does to a batch of f16 pages, as its two
//!   background threads do it: the tier thread quantizes them to q8 into DRAM
//!   (`kvmm_kernels::quantize`) while the flash drain copies the pages quantized so far out of DRAM
//!   and `FlashFile::put`s them, in 4 steps of 16 MiB of f16; throughput counted in
//!   f16 bytes and compared with the plain write of the f16 bytes (the pages as they are). Twice:
//!   one batch alone (the pipeline fills at its start and drains at its end: the first step is
//!   quantized with nothing to write yet, the last written with nothing left to quantize), and
//!   [`LAPS`] batches back to back through the same pipeline, as the daemon's two threads run
//!   while pressure lasts, against as many plain batch writes back to back. The quantize step
//!   alone is timed too and printed to stderr, to show how the arm's time splits.
//! - **read**: `FlashFile::get` of the batch (read, authenticate and decrypt, copy into each page's
//!   buffer) vs reading the same bytes with `run_all`.
//! - **get latency** of 1 page and of 32 adjacent pages (p50, p99 of single calls).
//!
//! Both arms alternate, `ROUNDS` times each, the plain arm first in every other round; the GB/s
//! columns are medians, and each ratio is the median of the rounds' own ratios (sealed vs plain
//! within one round, so the machine's slow drifts cancel out). The plain arms use one block of
//! their own (huge pages where the system gives them, like the flash file's staging chunks). Run
//! with
//! `cargo bench -p kvmm-store --bench tiers`; `KVMM_BENCH_DIR` picks the directory of the file
//! (default: the system temp dir, which must take O_DIRECT).

use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmm_kernels::{Format, PageShape, init_page, quantize, write_rows};
use kvmm_store::flash::{FlashFile, FlashSlot, RUN_BYTES};
use kvmm_store::io::{AlignedBuf, EngineChoice, IoBuffers, IoRequest, probe, run_all};
use kvmm_store::seal::SessionKey;
use kvmm_store::tier::{PageId, PageRead, PageWrite, Tier};

const ROUNDS: usize = 31;
const BATCH_BYTES: usize = 64 << 20;
/// Batches the sustained demote arm runs through its pipeline back to back (and the plain arm
/// writes back to back for it).
const LAPS: usize = 4;
/// Where in the file (in batches) the plain arms write and read: past the most the flash slots
/// take (one sealed batch, and [`LAPS`] batches of q8, about half as large).
const PLAIN_AT: usize = 1 + LAPS;

/// Page shapes measured: SmolLM2-135M (3 KV heads × 64) and Llama-3-8B (8 KV heads × 128), 32 tokens.
const SHAPES: [PageShape; 2] = [
    PageShape { kv_heads: 3, head_dim: 64, block_tokens: 32 },
    PageShape { kv_heads: 8, head_dim: 128, block_tokens: 32 },
];

/// A full f16 page of smooth pseudo-random K/V (per-channel offsets and scales, as real keys have).
fn f16_page(shape: PageShape, seed: usize) -> Vec<u8> {
    let mut page = vec![0u8; shape.page_bytes(Format::F16)];
    init_page(shape, Format::F16, &mut page).expect("f16 page");
    let n = shape.block_tokens * shape.kv_heads * shape.head_dim;
    let value = |i: usize, salt: usize| {
        let channel = i % shape.head_dim;
        let x = ((i * 7919 + seed * 104_729 + salt) % 10_007) as f32 / 10_007.0 - 0.5;
        x * (1.0 + (channel % 7) as f32) + (channel % 5) as f32 * 0.3
    };
    let k: Vec<f32> = (0..n).map(|i| value(i, 1)).collect();
    let v: Vec<f32> = (0..n).map(|i| value(i, 2)).collect();
    write_rows(shape, Format::F16, &mut page, 0, &k, &v).expect("rows");
    page
}

/// Steps of the demote arm's batch: 16 MiB of f16 each (8 MiB of q8, eight flash runs). The daemon's
/// steps are larger still (a watermark band: 10% of a pool by default), but a step much under two
/// runs is written at queue depth 1, slower than the plain arm's 16 requests in flight.
const DEMOTE_STEPS: usize = 4;

/// The demote arm: the daemon's two background stages as its two threads run them, overlapped. A
/// second thread (the tier thread) quantizes the f16 pages to q8 into `dram`, a step of pages at a
/// time ([`DEMOTE_STEPS`] per batch), at most two steps ahead; this thread (the flash drain) copies
/// each step out (as `take_from_dram` does under the core lock) and seals and writes it with one
/// `put`. `laps` times over the batch without a pause (the steps' DRAM buffers reused, each taken
/// under its lock). Returns the flash slots.
#[allow(clippy::too_many_arguments)]
fn demote(
    file: &mut FlashFile,
    shape: PageShape,
    pages: &[Vec<u8>],
    dram: &mut [Vec<u8>],
    outbound: &mut [Vec<u8>],
    ids: &[PageId],
    key: &SessionKey,
    laps: usize,
) -> Vec<FlashSlot> {
    let mut slots = Vec::with_capacity(pages.len() * laps);
    let step = pages.len().div_ceil(DEMOTE_STEPS);
    let dram_steps: Vec<std::sync::Mutex<&mut [Vec<u8>]>> = dram.chunks_mut(step).map(std::sync::Mutex::new).collect();
    let dram_steps = &dram_steps;
    std::thread::scope(|scope| {
        let (ready, steps) = std::sync::mpsc::sync_channel::<usize>(2);
        scope.spawn(move || {
            for lap in 0..laps {
                for (k, src) in pages.chunks(step).enumerate() {
                    let mut dst = dram_steps[k].lock().expect("a step buffer");
                    for (q8, page) in dst.iter_mut().zip(src) {
                        quantize(shape, Format::F16, page, shape.block_tokens, Format::Q8, q8).expect("q8");
                    }
                    drop(dst);
                    ready.send(lap * DEMOTE_STEPS + k).expect("the drain takes every step");
                }
            }
        });
        for k in steps.iter() {
            let k = k % DEMOTE_STEPS;
            let first = k * step;
            let dst = dram_steps[k].lock().expect("a step buffer");
            let out = &mut outbound[first..first + dst.len()];
            for (o, q8) in out.iter_mut().zip(dst.iter()) {
                o.copy_from_slice(q8);
            }
            drop(dst);
            let writes: Vec<PageWrite<'_>> =
                out.iter().zip(&ids[first..]).map(|(b, &page)| PageWrite { key: Some(key), page, bytes: b }).collect();
            slots.extend(file.put(&writes).into_iter().map(|r| r.expect("flash write")));
        }
    });
    slots
}

/// The median over rounds of (sealed throughput / plain throughput) within each round.
fn paired_ratio(sealed_bytes: usize, sealed: &[Duration], plain_bytes: usize, plain: &[Duration]) -> f64 {
    let mut ratios: Vec<f64> =
        sealed.iter().zip(plain).map(|(&s, &p)| gbps(sealed_bytes, s) / gbps(plain_bytes, p)).collect();
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn percentile(mut xs: Vec<Duration>, p: f64) -> Duration {
    xs.sort();
    xs[((xs.len() - 1) as f64 * p).round() as usize]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn main() {
    let dir = std::env::var_os("KVMM_BENCH_DIR").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    println!(
        "| engine | page bytes | pages | seal+write GB/s | plain write GB/s | ratio | q8 demote, one batch, GB/s (f16 bytes) | ratio | q8 demote, {LAPS} batches on, GB/s | ratio | read+open GB/s | plain read GB/s | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut latency_rows = Vec::new();
    // The cells, after one that runs unreported: whichever cell ran first often measured its plain
    // I/O faster than the same cell did later in the run (2026-12-01: pread with small pages run
    // first gave demote and read+open at 0.69–0.82 of plain I/O, run after the io_uring cells
    // 0.91–0.94; io_uring with small pages run first, once 0.59 with a plain write at 3.2 GB/s), so
    // every reported cell runs after a warm-up cell.
    let cells =
        SHAPES.iter().map(|&s| (EngineChoice::Sync, s)).chain(SHAPES.iter().map(|&s| (EngineChoice::IoUring, s)));
    for (cell, (choice, shape)) in std::iter::once((EngineChoice::Sync, SHAPES[0])).chain(cells).enumerate() {
        let report = cell > 0;
        let page_len = shape.page_bytes(Format::F16);
        let buffers = IoBuffers::new(RUN_BYTES, 32).expect("staging buffers");
        let engine = probe(choice, 128, Some(Arc::clone(&buffers))).expect("engine").engine;
        let path = dir.join(format!("kvmm-bench-{}.flash", std::process::id()));
        let mut file =
            FlashFile::create(&path, ((PLAIN_AT + LAPS) * BATCH_BYTES) as u64, Arc::clone(&engine), Some(buffers))
                .expect("flash file in KVMM_BENCH_DIR");
        let raw = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .expect("the same file, O_DIRECT");
        let key = SessionKey::generate().expect("key");
        let pages_n = BATCH_BYTES / FlashFile::extent_for(page_len) as usize;
        let pages: Vec<Vec<u8>> = (0..pages_n).map(|i| f16_page(shape, i)).collect();
        let mut q8_pages: Vec<Vec<u8>> = vec![vec![0u8; shape.page_bytes(Format::Q8)]; pages_n];
        let mut outbound = q8_pages.clone();
        let (mut demote_w, mut stream_w, mut plain_stream_w) = (Vec::new(), Vec::new(), Vec::new());
        let mut quantize_w = Vec::new();
        let ids: Vec<PageId> = (0..pages_n as u32).map(|b| PageId { session: 1, layer: b % 30, block: b }).collect();
        let total = pages_n * FlashFile::extent_for(page_len) as usize;
        // One block for the plain arms too (on huge pages where the system has them, as the flash
        // file's staging chunks are), cut into its 1 MiB requests.
        let mut plain = AlignedBuf::zeroed(total.next_multiple_of(RUN_BYTES)).expect("buffer");
        let (mut sealed_w, mut plain_w, mut sealed_r, mut plain_r) = (vec![], vec![], vec![], vec![]);
        let mut slots: Vec<FlashSlot> = Vec::new();
        let mut outs: Vec<Vec<u8>> = pages.iter().map(|p| vec![0u8; p.len()]).collect();
        // The plain arms, timed.
        // `laps` batches back to back, each with one submission, to consecutive batches of the file.
        let plain_write = |plain: &[u8], laps: usize| {
            let t = Instant::now();
            for lap in 0..laps {
                let base = (PLAIN_AT + lap) * BATCH_BYTES;
                let mut requests: Vec<IoRequest<'_>> = plain
                    .chunks(RUN_BYTES)
                    .enumerate()
                    .map(|(i, b)| IoRequest::Write { offset: (base + i * RUN_BYTES) as u64, buf: b })
                    .collect();
                assert!(run_all(engine.as_ref(), raw.as_fd(), &mut requests).iter().all(Result::is_ok));
            }
            t.elapsed()
        };
        let plain_read = |plain: &mut [u8]| {
            let t = Instant::now();
            let mut requests: Vec<IoRequest<'_>> = plain
                .chunks_mut(RUN_BYTES)
                .enumerate()
                .map(|(i, b)| IoRequest::Read { offset: (PLAIN_AT * BATCH_BYTES + i * RUN_BYTES) as u64, buf: b })
                .collect();
            assert!(run_all(engine.as_ref(), raw.as_fd(), &mut requests).iter().all(Result::is_ok));
            t.elapsed()
        };
        for round in 0..ROUNDS {
            for slot in slots.drain(..) {
                file.free(slot);
            }
            // The quantizer alone first (the disk idles meanwhile, which helps whatever runs next),
            // then the arms back to back, the plain ones first in every other round: whatever an
            // arm leaves behind (the host's write-back of what it wrote, a drained rate limit)
            // falls on the sealed and the plain arms alike.
            let t = Instant::now();
            for (q8, page) in q8_pages.iter_mut().zip(&pages) {
                quantize(shape, Format::F16, page, shape.block_tokens, Format::Q8, q8).expect("q8");
            }
            quantize_w.push(t.elapsed());
            let plain_first = round % 2 == 1;
            if plain_first {
                plain_w.push(plain_write(&plain, 1));
            }
            let writes: Vec<PageWrite<'_>> =
                pages.iter().zip(&ids).map(|(b, &page)| PageWrite { key: Some(&key), page, bytes: b }).collect();
            let t = Instant::now();
            slots = file.put(&writes).into_iter().map(|r| r.expect("flash write")).collect();
            sealed_w.push(t.elapsed());
            if !plain_first {
                plain_w.push(plain_write(&plain, 1));
            }

            if plain_first {
                plain_r.push(plain_read(&mut plain));
            }
            let t = Instant::now();
            let mut reads: Vec<PageRead<'_, FlashSlot>> = outs
                .iter_mut()
                .zip(&slots)
                .zip(&ids)
                .map(|((out, &slot), &page)| PageRead { key: Some(&key), page, slot, out })
                .collect();
            assert!(file.get(&mut reads).iter().all(Result::is_ok));
            sealed_r.push(t.elapsed());
            if !plain_first {
                plain_r.push(plain_read(&mut plain));
            }

            if plain_first {
                plain_stream_w.push(plain_write(&plain, LAPS));
            }
            for (laps, times) in [(1, &mut demote_w), (LAPS, &mut stream_w)] {
                let t = Instant::now();
                let demoted = demote(&mut file, shape, &pages, &mut q8_pages, &mut outbound, &ids, &key, laps);
                times.push(t.elapsed());
                for slot in demoted {
                    file.free(slot);
                }
            }
            if !plain_first {
                plain_stream_w.push(plain_write(&plain, LAPS));
            }
        }
        assert!(outs.iter().zip(&pages).all(|(a, b)| a == b));
        if !report {
            drop(file);
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let plain_bytes = plain.len();
        let write_ratio = paired_ratio(total, &sealed_w, plain_bytes, &plain_w);
        let demote_ratio = paired_ratio(total, &demote_w, plain_bytes, &plain_w);
        let demote_gbps = gbps(total, median(demote_w));
        let stream_ratio = paired_ratio(LAPS * total, &stream_w, LAPS * plain_bytes, &plain_stream_w);
        let stream_gbps = gbps(LAPS * total, median(stream_w));
        eprintln!(
            "{} {page_len}: quantize f16 -> q8 alone {:.2} GB/s of f16",
            engine.kind(),
            gbps(total, median(quantize_w))
        );
        let read_ratio = paired_ratio(total, &sealed_r, plain_bytes, &plain_r);
        let (sw, pw, sr, pr) = (median(sealed_w), median(plain_w), median(sealed_r), median(plain_r));
        let (swg, pwg, srg, prg) = (gbps(total, sw), gbps(plain_bytes, pw), gbps(total, sr), gbps(plain_bytes, pr));
        println!(
            "| {} | {page_len} | {pages_n} | {swg:.2} | {pwg:.2} | {:.2} | {demote_gbps:.2} | {demote_ratio:.2} | {stream_gbps:.2} | {stream_ratio:.2} | {srg:.2} | {prg:.2} | {:.2} |",
            engine.kind(),
            write_ratio,
            read_ratio
        );
        for n in [1usize, 32] {
            let mut times = Vec::new();
            for round in 0..200 {
                let first = (round * 37) % (pages_n - n);
                let mut reads: Vec<PageRead<'_, FlashSlot>> = outs[first..first + n]
                    .iter_mut()
                    .zip(&slots[first..first + n])
                    .zip(&ids[first..first + n])
                    .map(|((out, &slot), &page)| PageRead { key: Some(&key), page, slot, out })
                    .collect();
                let t = Instant::now();
                assert!(file.get(&mut reads).iter().all(Result::is_ok));
                times.push(t.elapsed());
            }
            latency_rows.push(format!(
                "| {} | {page_len} | {n} | {:.0} | {:.0} |",
                engine.kind(),
                percentile(times.clone(), 0.5).as_secs_f64() * 1e6,
                percentile(times, 0.99).as_secs_f64() * 1e6
            ));
        }
        drop(file);
        let _ = std::fs::remove_file(&path);
    }
    println!();
    println!("| engine | page bytes | pages per get | p50 µs | p99 µs |");
    println!("|---|---|---|---|---|");
    for row in latency_rows {
        println!("{row}");
    }
}
