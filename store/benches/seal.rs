//! AES-256-GCM sealing throughput: [`seal`] and [`open`] of one page, in place, one thread, against
//! a plain `memcpy` of the same size measured in the same run.
//!
//! Page sizes: 4096, 16384, 25408 (a SmolLM2 f16 page as `kvmm-kernels` lays it out: 3 KV heads,
//! head_dim 64, 32 tokens, keys, values and key bounds), 65536 and 262144 bytes. Throughput is in
//! bytes of page per second.
//!
//! `seal` and `memcpy` work on one buffer that stays in cache; `open` needs a fresh ciphertext each
//! time, so its inputs are copied in untimed batches of about 1 MiB (so they come partly from L2).
//! `open_rejected` opens a page with a changed tag: the whole decrypt-and-hash pass, the tag
//! comparison and the zero fill (ring decrypts while it authenticates, so a rejected page costs
//! about what an accepted one does).
//!
//! Which code runs: ring 0.17.14's AES-256-GCM, whose implementation is picked at run time from
//! CPUID, so nothing has to be enabled at build time. On a CPU with VAES, VPCLMULQDQ and AVX2 (the
//! development VM) it is BoringSSL's `aes_gcm_{enc,dec}_update_vaes_avx2`, one pass that runs the
//! CTR keystream and GHASH together; older CPUs get the AES-NI + PCLMULQDQ + MOVBE code, then
//! slower fallbacks.
//!
//! Measured on the development VM (quick settings below, means): seal 9.1 / 10.7 / 10.7 / 11.0 GB/s
//! at 4096 / 25408 / 65536 / 262144 bytes; open 10.1 / 11.4 / 11.5 / 11.7 GB/s. The `aes-gcm` 0.11.1
//! crate used before (two passes: a VAES-512 keystream, then a 128-bit PCLMULQDQ GHASH with no
//! wider path), measured by the same bench minutes earlier: seal 4.4 / 4.8 / 5.0 / 5.1 GB/s, open
//! 4.4 / 4.9 / 4.9 / 5.0 GB/s.
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
