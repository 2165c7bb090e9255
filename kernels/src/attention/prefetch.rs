//! Software prefetch for the x86-64 kernels: one KV head ahead, into L1 or L2.
//!
//! A kernel reading KV head `h` of a page prefetches the same offsets of head `h + 1` (or of head 0
//! of the next page, see `kernel.rs`), so memory reads run ahead of the arithmetic. Where the lines
//! go depends on how much is in flight: one head's K and V blocks up to [`L1_AHEAD_BYTES`] fit in L1
//! beside the blocks being read; larger ones go to L2, where they do not evict the working set (on the
//! development machine, a Xeon with 48 KiB L1d and 2 MiB L2, L1 won for SmolLM2's 8 KiB per head and
//! L2 for Llama-3-8B's 16 KiB).
//!
//! Prefetches are hints: they never fault and change no memory, so addresses are computed with
//! wrapping arithmetic and may point anywhere.

use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};

/// Largest K+V block of one head (bytes) prefetched into L1 rather than L2.
pub(crate) const L1_AHEAD_BYTES: usize = 12 * 1024;

/// Where one region's lines are prefetched from: a base address (or none) and the cache level.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Prefetch {
    /// Start of the region ahead; null for no prefetching.
    base: *const u8,
    /// Prefetch into L1 (`prefetcht0`) rather than L2 (`prefetcht1`).
    into_l1: bool,
}

impl Prefetch {
    /// Prefetches from `base` into L1 when a head's K+V block is at most [`L1_AHEAD_BYTES`] bytes.
    pub fn ahead(base: *const u8, head_block_bytes: usize) -> Prefetch {
        Prefetch { base, into_l1: head_block_bytes <= L1_AHEAD_BYTES }
    }

    /// No prefetching.
    pub fn none() -> Prefetch {
        Prefetch { base: std::ptr::null(), into_l1: false }
    }

    /// The same target, `bytes` further on.
    pub fn offset(self, bytes: usize) -> Prefetch {
        Prefetch { base: self.base.wrapping_add(bytes), ..self }
    }

    /// Prefetches the line holding byte `offset` of the target, with no check for a missing one:
    /// for hot loops whose caller always names a target (a prefetch near address 0 would be
    /// harmless too, but may cost a page walk).
    #[inline(always)]
    pub fn line(self, offset: usize) {
        let at = self.base.wrapping_add(offset);
        // SAFETY: as in `span`: a prefetch needs only SSE and never faults.
        unsafe {
            if self.into_l1 {
                _mm_prefetch::<_MM_HINT_T0>(at.cast());
            } else {
                _mm_prefetch::<_MM_HINT_T1>(at.cast());
            }
        }
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
            // SAFETY: `prefetcht0/1` need only SSE, part of the x86-64 baseline every x86-64 CPU has;
            // a prefetch is a hint that never faults and changes no memory, whatever the address.
            unsafe {
                if self.into_l1 {
                    _mm_prefetch::<_MM_HINT_T0>(at.cast());
                } else {
                    _mm_prefetch::<_MM_HINT_T1>(at.cast());
                }
            }
            at = at.wrapping_add(64);
        }
    }
}
