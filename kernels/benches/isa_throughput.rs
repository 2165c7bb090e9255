//! Throughput of the AVX-512 instructions the decode kernels are built from, on this CPU: how many
//! of each retire per nanosecond when nothing else runs (12 independent destinations per loop, so
//! latency does not limit), and then pairs of one FMA and one other instruction, to see which of
//! them take the FMA's port. The kernels' cost models (how many `vpdpwssd` or FMAs a page takes, and
//! which instructions compete for the same port) are judged against these figures.
//!
//! `cargo bench -p kvmm-kernels --bench isa_throughput` (x86-64 with AVX-512 VNNI and VBMI; prints a
//! line saying so and exits elsewhere).

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::time::Instant;

    /// Loop iterations per measurement (12 instructions each).
    const ITERATIONS: u64 = 20_000_000;

    /// Emits a loop of `ITERATIONS` × 12 copies of one instruction, each writing its own register
    /// (zmm2..zmm13) from zmm0 and zmm1, and returns instructions per nanosecond (best of 3).
    macro_rules! throughput {
        ($($ins:expr),+ $(,)?) => {{
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let start = Instant::now();
                // SAFETY: register-only AVX-512 instructions (the caller checked the features); the
                // loop counter is the only general register written, and every vector register
                // written is declared clobbered.
                unsafe {
                    std::arch::asm!(
                        "2:",
                        $($ins,)+
                        "dec {n}",
                        "jnz 2b",
                        n = inout(reg) ITERATIONS => _,
                        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
                        out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
                        out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _,
                        options(nostack, nomem),
                    );
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            (ITERATIONS * 12) as f64 / best / 1e9
        }};
    }

    /// Twelve copies of `$op $a, $b, zmm<k>` for k = 2..=13, as string literals.
    macro_rules! twelve {
        ($op:literal, $srcs:literal) => {
            throughput!(
                concat!($op, " zmm2, ", $srcs),
                concat!($op, " zmm3, ", $srcs),
                concat!($op, " zmm4, ", $srcs),
                concat!($op, " zmm5, ", $srcs),
                concat!($op, " zmm6, ", $srcs),
                concat!($op, " zmm7, ", $srcs),
                concat!($op, " zmm8, ", $srcs),
                concat!($op, " zmm9, ", $srcs),
                concat!($op, " zmm10, ", $srcs),
                concat!($op, " zmm11, ", $srcs),
                concat!($op, " zmm12, ", $srcs),
                concat!($op, " zmm13, ", $srcs),
            )
        };
    }

    /// Six FMAs interleaved with six copies of `$op $srcs` (zmm2..zmm7 FMAs, zmm8..zmm13 the other
    /// instruction): whether the two compete for one port (about 3.7 per ns in all) or not (about 7).
    macro_rules! with_fma {
        ($op:literal, $srcs:literal) => {
            throughput!(
                "vfmadd231ps zmm2, zmm0, zmm1",
                concat!($op, " zmm8, ", $srcs),
                "vfmadd231ps zmm3, zmm0, zmm1",
                concat!($op, " zmm9, ", $srcs),
                "vfmadd231ps zmm4, zmm0, zmm1",
                concat!($op, " zmm10, ", $srcs),
                "vfmadd231ps zmm5, zmm0, zmm1",
                concat!($op, " zmm11, ", $srcs),
                "vfmadd231ps zmm6, zmm0, zmm1",
                concat!($op, " zmm12, ", $srcs),
                "vfmadd231ps zmm7, zmm0, zmm1",
                concat!($op, " zmm13, ", $srcs),
            )
        };
    }

    pub fn run() {
        let needed = ["avx512f", "avx512bw", "avx512vnni", "avx512vbmi", "f16c"];
        let detected = [
            std::arch::is_x86_feature_detected!("avx512f"),
            std::arch::is_x86_feature_detected!("avx512bw"),
            std::arch::is_x86_feature_detected!("avx512vnni"),
            std::arch::is_x86_feature_detected!("avx512vbmi"),
            std::arch::is_x86_feature_detected!("f16c"),
        ];
        if let Some((name, _)) = needed.iter().zip(detected).find(|(_, ok)| !ok) {
            println!("this CPU lacks {name}: nothing to measure");
            return;
        }
        println!("instructions per ns, one thread, 12 independent destinations (Intel syntax)");
        // SAFETY: the features were detected just above.
        for (name, per_ns) in unsafe { measure() } {
            println!("{name:<42} {per_ns:>6.2}");
        }
    }

    /// One row per instruction: its name and instructions per nanosecond.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,f16c")]
    unsafe fn measure() -> [(&'static str, f64); 15] {
        [
            ("vfmadd231ps zmm (f32 FMA, 16 MACs)", twelve!("vfmadd231ps", "zmm0, zmm1")),
            ("vpdpwssd zmm (i16 pairs, 32 MACs)", twelve!("vpdpwssd", "zmm0, zmm1")),
            ("vpdpbusd zmm (u8 x i8 quads, 64 MACs)", twelve!("vpdpbusd", "zmm0, zmm1")),
            ("vpermb zmm (VBMI byte permute)", twelve!("vpermb", "zmm0, zmm1")),
            ("vpermt2b zmm (two-table byte permute)", twelve!("vpermt2b", "zmm0, zmm1")),
            ("vpaddd zmm", twelve!("vpaddd", "zmm0, zmm1")),
            ("vcvtph2ps zmm <- ymm (f16 -> f32)", twelve!("vcvtph2ps", "ymm0")),
            ("vpmovzxbd zmm <- xmm (u8 -> i32)", twelve!("vpmovzxbd", "xmm0")),
            ("vcvtdq2ps zmm (i32 -> f32)", twelve!("vcvtdq2ps", "zmm0")),
            ("FMA + vpermb, 6 each", with_fma!("vpermb", "zmm0, zmm1")),
            ("FMA + vpaddd, 6 each", with_fma!("vpaddd", "zmm0, zmm1")),
            ("FMA + vpmovzxbd, 6 each", with_fma!("vpmovzxbd", "xmm0")),
            ("FMA + vcvtdq2ps, 6 each", with_fma!("vcvtdq2ps", "zmm0")),
            ("FMA + vcvtph2ps, 6 each", with_fma!("vcvtph2ps", "ymm0")),
            ("FMA + vpdpwssd, 6 each", with_fma!("vpdpwssd", "zmm0, zmm1")),
        ]
    }
}

fn main() {
    // Only under `cargo bench` (not `cargo test`, which runs bench targets without `--bench`).
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    x86::run();
    #[cfg(not(target_arch = "x86_64"))]
    println!("not x86-64: nothing to measure");
}
