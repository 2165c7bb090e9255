//! AES-256-GCM sealing throughput: [`seal`] and [`open`] of one page, in place, one thread, against
//! a plain `memcpy` of the same size measured in the same run.
//!
//! Page sizes: 4096, 16384, 25408 (a SmolLM2 f16 page as `kvmm-kernels` lays it out: 3 KV heads,
//! head_dim 64, 32 tokens, keys, values and key bounds), 65536 and 262144 bytes. Throughput is in
//! bytes of page per second.
//!
//! `seal` and `memcpy` work on one buffer that stays in cache; `open` needs a fresh ciphertext each
//! time, so its inputs are copied in untimed batches of about 1 MiB (so they come partly from L2).
//! `open_rejected` opens a page with a changed tag: GHASH and the zero fill only, which shows how a
//! seal's time splits between GHASH and the AES keystream.
//!
//! Which code runs (aes-gcm 0.11.1 on aes 0.9.4, ghash 0.6.0 / polyval 0.7.3, read from their
//! sources): every choice is made at run time with `cpufeatures` (CPUID, cached after the first
//! check), so nothing has to be enabled at build time.
//!
//! - AES (the CTR keystream): `avx512f` + `vaes` → the VAES-512 backend, 64 blocks in flight; else
//!   `vaes` → VAES-256 (30 blocks); else `aes` → AES-NI; else a constant-time fixsliced software AES.
//!   On the development VM (aes, vaes, avx512f) it is VAES-512.
//! - GHASH: polyval's `avx` + `pclmulqdq` backend, 128-bit PCLMULQDQ with 4-block aggregation; there is
//!   no VPCLMULQDQ (256/512-bit) path in polyval 0.7.3, whatever its file header says.
//! - aes-gcm 0.11.1 makes two passes over the page (keystream, then GHASH; its source carries a TODO
//!   to interleave them), so throughput is bounded by the sum of the two, not the slower one.
//!
//! Build-time knobs: the crates document `RUSTFLAGS=-Ctarget-feature=+aes,+avx512f,+ssse3,+vaes`
//! (aes: skip the run-time check, always VAES-512; the binary then crashes on CPUs without those
//! features) and `--cfg aes_backend="soft"` / `--cfg polyval_backend="soft"` (force the slow software
//! code). No cfg or feature selects a faster *run-time-detected* path. Compiling with the features on
//! does make the same backends faster, presumably because the intrinsics code can then be inlined
//! into the generic CTR and GHASH loops (a `#[target_feature]` function cannot be inlined into a
//! caller without those features): on the development VM, seal of 256 KiB went from 2.67 GiB/s to
//! 3.56 GiB/s with `-Ctarget-feature=+aes,+avx512f,+ssse3,+vaes,+avx,+pclmulqdq` and to 3.90 GiB/s with
//! `-Ctarget-cpu=native`. The project sets no such flags (they tie the binary to the CPU); it builds
//! release and bench code with fat LTO instead, which lets the same run-time-selected intrinsics
//! inline across the crates (25 KiB pages: 2.63 → 3.21 GiB/s).
//!
//! `cargo bench -p kvmm-store --bench seal` (quick: `-- --warm-up-time 1 --measurement-time 2`).

use std::hint::black_box;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use kvmm_store::seal::{PageAad, SealNonce, SessionKey, SlotCounters, TIER_FLASH, open, seal};

/// Page sizes measured, in bytes.
const PAGE_SIZES: [usize; 5] = [4096, 16384, 25408, 65536, 262144];

/// Bytes of ciphertext copied per untimed batch for `open`.
const OPEN_BATCH_BYTES: usize = 1 << 20;

fn aad(nonce: SealNonce, len: usize) -> PageAad {
    PageAad {
        session: 1,
        layer: 0,
        block: 0,
        tier: nonce.tier(),
        counter: nonce.counter(),
        len: u32::try_from(len).expect("bench pages are small"),
    }
}

/// What the AES and GHASH crates will pick on this CPU (their own run-time checks, restated).
fn detected_backends() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let aes = if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("vaes") {
            "VAES-512"
        } else if is_x86_feature_detected!("vaes") {
            "VAES-256"
        } else if is_x86_feature_detected!("aes") {
            "AES-NI"
        } else {
            "software (fixslice)"
        };
        let ghash = if is_x86_feature_detected!("avx") && is_x86_feature_detected!("pclmulqdq") {
            "PCLMULQDQ"
        } else {
            "software"
        };
        format!("AES: {aes}, GHASH: {ghash}")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "not x86-64: see the aes and polyval docs".to_owned()
    }
}

fn bench_seal(c: &mut Criterion, key: &SessionKey) {
    let mut group = c.benchmark_group("seal");
    for size in PAGE_SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        let mut counters = SlotCounters::new(TIER_FLASH, 1);
        let mut buf = vec![0x5Au8; size];
        group.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter(|| {
                let nonce = counters.next(0).expect("2^56 writes are far away");
                seal(key, nonce, &aad(nonce, size), black_box(&mut buf)).expect("consistent arguments")
            });
        });
    }
    group.finish();
}

fn bench_open(c: &mut Criterion, key: &SessionKey) {
    let mut group = c.benchmark_group("open");
    for size in PAGE_SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        let mut counters = SlotCounters::new(TIER_FLASH, 1);
        let nonce = counters.next(0).expect("first write");
        let aad = aad(nonce, size);
        let mut sealed = vec![0x5Au8; size];
        let tag = seal(key, nonce, &aad, &mut sealed).expect("consistent arguments");
        let per_batch = (OPEN_BATCH_BYTES / size).max(1) as u64;
        group.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, _| {
            b.iter_batched_ref(
                || sealed.clone(),
                |buf| open(key, nonce, &aad, black_box(buf), tag).expect("an intact page opens"),
                BatchSize::NumIterations(per_batch),
            );
        });
    }
    group.finish();
}

/// Opening a page whose tag does not verify: the GHASH pass and the zero fill, no decryption. Beside
/// `open`, this splits a seal's time between GHASH and the AES keystream.
fn bench_open_rejected(c: &mut Criterion, key: &SessionKey) {
    let mut group = c.benchmark_group("open_rejected");
    for size in PAGE_SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        let mut counters = SlotCounters::new(TIER_FLASH, 1);
        let nonce = counters.next(0).expect("first write");
        let aad = aad(nonce, size);
        let mut buf = vec![0x5Au8; size];
        let mut tag = seal(key, nonce, &aad, &mut buf).expect("consistent arguments");
        tag[0] ^= 1;
        group.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, _| {
            b.iter(|| open(key, nonce, &aad, black_box(&mut buf), tag).expect_err("a changed tag is refused"));
        });
    }
    group.finish();
}

fn bench_memcpy(c: &mut Criterion) {
    let mut group = c.benchmark_group("memcpy");
    for size in PAGE_SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        let src = vec![0x5Au8; size];
        let mut dst = vec![0u8; size];
        group.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, _| {
            b.iter(|| black_box(&mut dst).copy_from_slice(black_box(&src)));
        });
    }
    group.finish();
}

fn main() {
    println!("seal bench: {}", detected_backends());
    let key = SessionKey::generate().expect("a session key (needs a page of RLIMIT_MEMLOCK)");
    let mut criterion = Criterion::default().configure_from_args();
    bench_seal(&mut criterion, &key);
    bench_open(&mut criterion, &key);
    bench_open_rejected(&mut criterion, &key);
    bench_memcpy(&mut criterion);
    criterion.final_summary();
}
