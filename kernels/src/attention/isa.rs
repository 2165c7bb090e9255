//! Which page kernel runs: instruction-set detection, once per process, and dispatch.
//!
//! [`Isa::detect`] picks the best kernel this CPU supports the first time it is called and caches the
//! answer. A value of [`Isa`] held by a [`super::DecodeAttention`] has always been checked with
//! [`Isa::is_available`], which is the invariant [`run_page`] relies on to call a
//! `#[target_feature]` kernel.

use std::fmt;
use std::sync::OnceLock;

use super::kernel::{PageJob, Running};
use super::scalar;

/// A page-kernel implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable scalar code, the reference.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C, 8 lanes: one kernel for 16-bit pages, one for quantized pages.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL (plus AVX2, FMA, F16C), 16 lanes.
    Avx512,
    /// [`Isa::Avx512`] plus AVX-512 DQ, VNNI and VBMI: the same kernel for 16-bit pages; for
    /// quantized pages, key scores from 16-bit integer dot products (`vpdpwssd` on codes rearranged
    /// with `vpermb`), and a dequantizer that transposes key codes as bytes.
    Avx512Vnni,
    /// aarch64 Advanced SIMD, 4 lanes.
    Neon,
}

static DETECTED: OnceLock<Isa> = OnceLock::new();

impl Isa {
    /// Every implementation, best last.
    pub const ALL: [Isa; 5] = [Isa::Scalar, Isa::Neon, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni];

    /// Short lowercase name, as used in bench ids and messages.
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Neon => "neon",
        }
    }

    /// Whether this build has the kernel and this CPU can run it.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx512.is_available()
                    && is_x86_feature_detected!("avx512dq")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512vbmi")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns, reason = "which arms exist depends on the target")]
            _ => false,
        }
    }

    /// Whether this is one of the AVX-512 kernels, which share the 16-bit page kernel, the quantizer
    /// and page selection.
    pub const fn is_avx512(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Avx512Vnni)
    }

    /// Every implementation available here, scalar first, best last.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.is_available()).collect()
    }

    /// The best available implementation, detected on first call and cached for the process.
    pub fn detect() -> Isa {
        *DETECTED.get_or_init(|| Isa::ALL.into_iter().rev().find(|isa| isa.is_available()).unwrap_or(Isa::Scalar))
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Runs one page through the kernel of `isa`. Every SIMD kernel now reads every format: AVX2 has its own kernel for
/// quantized pages (`avx2_quant`), which also takes AVX-512's quantized pages of fewer than 16 token
/// slots; both AVX-512 kernels share the 16-bit page kernel and differ on quantized pages; NEON
/// takes every format. So the scalar kernel runs only as `Isa::Scalar`.
///
/// `isa` MUST have passed [`Isa::is_available`]; [`super::DecodeAttention`] only stores such values.
/// The lengths in `run` are checked here, since the SIMD kernels index with raw pointers.
pub(crate) fn run_page(isa: Isa, job: &PageJob<'_>, run: &mut Running<'_>) {
    run.check(job);
    debug_assert!(isa.is_available());
    #[cfg(target_arch = "x86_64")]
    let quantized = job.format.is_quantized();
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if quantized && job.shape.block_tokens >= 16 => {
            // SAFETY: `isa` passed `is_available`, so avx512f/bw/vl, avx2, fma and f16c were
            // detected on this CPU; `check` above established the length contract of `kernel.rs`,
            // and `block_tokens ≥ 16` was just tested.
            unsafe { super::avx512_quant::page(job, run) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni if quantized && job.shape.block_tokens >= 16 => {
            // SAFETY: `isa` passed `is_available`, so avx512f/bw/vl/dq/vnni/vbmi, avx2, fma and f16c
            // were detected on this CPU; `check` above established the length contract of
            // `kernel.rs`, and `block_tokens ≥ 16` was just tested.
            unsafe { super::avx512_vnni::page(job, run) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni if !quantized => {
            // SAFETY: `isa` passed `is_available`, so avx512f/bw/vl, avx2, fma and f16c were
            // detected on this CPU; `check` above established the length contract of `kernel.rs`.
            unsafe { super::avx512::page(job, run) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni if quantized => {
            // SAFETY: `isa` passed `is_available`, so avx512f (hence AVX2), fma and f16c were
            // detected on this CPU; `check` above established the length contract of `kernel.rs`,
            // and `job.shape` was validated (`PageJob::shape`), so `block_tokens ≥ 8`.
            unsafe { super::avx2_quant::page(job, run) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if quantized => {
            // SAFETY: `isa` passed `is_available`, so avx2, fma and f16c were detected on this CPU;
            // `check` above established the length contract of `kernel.rs`, and `job.shape` was
            // validated (`PageJob::shape`), so `block_tokens ≥ 8`.
            unsafe { super::avx2_quant::page(job, run) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if !quantized => {
            // SAFETY: `isa` passed `is_available`, so avx2, fma and f16c were detected on this CPU;
            // `check` above established the length contract of `kernel.rs`.
            unsafe { super::avx2::page(job, run) }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => {
            // SAFETY: `isa` passed `is_available`, so neon was detected on this CPU; `check` above
            // established the length contract of `kernel.rs`.
            unsafe { super::neon::page(job, run) }
        }
        _ => scalar::page(job, run),
    }
}
