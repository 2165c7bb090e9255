//! Software prefetch for the x86-64 kernels: one KV head ahead, into L2.
//!
//! A kernel reading KV head `h` of a page prefetches the same offsets of head `h + 1` (or of head 0
//! of the next page, see `kernel.rs`), so memory reads run ahead of the arithmetic. The lines go to
//! L2 (`prefetcht1`), not L1: a head's K and V blocks are 1.5 to 16 KiB, hundreds of lines issued at
//! once, and a prefetch into L1 holds one of L1's few fill buffers until its line arrives, so when the
//! pages come from DRAM the kernel's own loads queue behind them. Measured on the development
//! machine (a Xeon with 48 KiB L1d and 2 MiB L2) on 2026-12-02, Llama-3-8B's shape at 32k tokens:
//! q8 pages 8.1–8.4 → 6.5–7.7 ms a call and k8v4 7.45 → 6.50 when their 9 and 7 KiB head blocks
//! went to L2 instead of L1, and no case got slower (SmolLM2's 8 KiB f16 heads at 4k tokens 127 µs
//! either way), so L2 is the only target.
//!
//! Prefetches are hints: they never fault and change no memory, so addresses are computed with
//! wrapping arithmetic and may point anywhere.

use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};

/// Where one region's lines are prefetched from: a base address, or none.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Prefetch {
    /// Start of the region ahead; null for no prefetching.
    base: *const u8,
}

impl Prefetch {
    /// Prefetches from `base`.
    pub fn ahead(base: *const u8) -> Prefetch {
        Prefetch { base }
    }

    /// No prefetching.
    pub fn none() -> Prefetch {
        Prefetch { base: std::ptr::null() }
    }

    /// The same target, `bytes` further on.
    pub fn offset(self, bytes: usize) -> Prefetch {
        Prefetch { base: self.base.wrapping_add(bytes) }
    }

    /// Prefetches the line holding byte `offset` of the target, with no check for a missing one:
    /// for hot loops whose caller always names a target (a prefetch near address 0 would be
    /// harmless too, but may cost a page walk).
    #[inline(always)]
    pub fn line(self, offset: usize) {
        let at = self.base.wrapping_add(offset);
        // SAFETY: as in `span`: a prefetch needs only SSE and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(at.cast()) }
    }

    /// Prefetches the lines holding bytes `offset`, `offset + 64`, ... below `offset + len` of the
    /// target. Callers prefetch spans back to back over a contiguous region, so a span that straddles
    /// a line boundary has its last line covered by the next span.
    #[inline(always)]
    pub fn span(self, offset: usize, len: usize) {
        if self.base.is_null() {
            return;
        }
        let mut at = self.base.wrapping_add(offset);
        let end = at.wrapping_add(len);
        while at < end {
            // SAFETY: `prefetcht1` needs only SSE, part of the x86-64 baseline every x86-64 CPU has;
            // a prefetch is a hint that never faults and changes no memory, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(at.cast()) };
            at = at.wrapping_add(64);
        }
    }
}
