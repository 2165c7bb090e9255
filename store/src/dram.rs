//! The DRAM tier: the daemon's private pool of (usually compressed) pages, never mapped into clients.
//!
//! One anonymous private mapping the size of the DRAM budget, reserved but not committed
//! (`MAP_NORESERVE`: pages are faulted in as frames are first written) and left out of core dumps
//! (`MADV_DONTDUMP`). Frames are 64-byte aligned extents from an [`ExtentAllocator`]; a frame holds
//! the page's bytes, sealed in place with the session's key when the pool seals (config), in which
//! case the slot keeps the tag and the write counter (the nonce is `(dram, frame offset / 64,
//! counter)`, unique per [`SlotCounters`]).
//!
//! Invariants: every live slot's extent is allocated in `frames` and in no other slot; a freed frame
//! is zeroed (with writes the compiler cannot elide) before it returns to the allocator, so the pool
//! never holds a page's bytes outside a live slot; `used` is the sum of the live slots' extents.

use std::ptr::NonNull;

use rustix::mm::{Advice, MapFlags, ProtFlags};
use zeroize::Zeroize;

use crate::extent::{ExtentAllocator, FRAME_ALIGN};
use crate::seal::{PageAad, SealError, SealNonce, SlotCounters, TAG_LEN, TIER_DRAM, open, seal};
use crate::tier::{PageId, PageRead, PageWrite, Tier, TierError, TierKind, TierStats};

/// Where a page sits in the pool, and what opens it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DramSlot {
    /// Byte offset of the frame in the pool (a multiple of 64).
    pub offset: u64,
    /// Bytes the frame takes.
    pub extent: u64,
    /// Payload length.
    pub len: u32,
    /// The seal's write counter and tag, when the page was sealed.
    pub sealed: Option<(u64, [u8; TAG_LEN])>,
    /// Which store this is, unique in the pool's life: two slots of one frame are never equal, so a
    /// page stored, freed and stored again in the same frame is told from its earlier self.
    pub serial: u64,
}

/// The daemon's private page pool; see the module doc.
#[derive(Debug)]
pub struct DramPool {
    /// Start of the mapping; valid for `budget` bytes until drop.
    base: NonNull<u8>,
    /// The mapping's length: the DRAM budget, rounded down to 64 bytes.
    budget: u64,
    /// Free space.
    frames: ExtentAllocator,
    /// Whether pages are sealed (with the key each write brings).
    seal: bool,
    /// Write counters per frame start (`offset / 64`).
    counters: SlotCounters,
    /// Counters for stats (`used` comes from `frames`).
    stats: TierStats,
    /// Stores so far: the next slot's [`DramSlot::serial`].
    stored: u64,
}

// SAFETY: the pool owns its mapping exclusively; all access goes through `&mut self` or `&self`
// methods that borrow it accordingly.
unsafe impl Send for DramPool {}

impl DramPool {
    /// A pool of `budget` bytes (rounded down to 64); `seal` makes every page sealed.
    pub fn new(budget: u64, seal: bool) -> Result<DramPool, TierError> {
        let budget = budget / FRAME_ALIGN * FRAME_ALIGN;
        let fail = |what: String| TierError::Create { tier: TierKind::Dram, at: "an anonymous mapping".into(), what };
        let slots = u32::try_from(budget / FRAME_ALIGN)
            .map_err(|_| fail(format!("a DRAM budget of {budget} bytes is over the 256 GiB a pool can address")))?;
        if budget == 0 {
            return Err(fail("the DRAM budget must be at least 64 bytes".into()));
        }
        let len = usize::try_from(budget).map_err(|_| fail("the DRAM budget does not fit the address space".into()))?;
        // SAFETY: a fresh anonymous mapping at an address the kernel picks; nothing else refers to it.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| fail(format!("mmap of {len} bytes failed: {e}")))?;
        // SAFETY: `base..base + len` is the mapping just made.
        if let Err(e) = unsafe { rustix::mm::madvise(base, len, Advice::LinuxDontDump) } {
            tracing::warn!(error = %e, "DRAM pool stays in core dumps: MADV_DONTDUMP failed");
        }
        let base = NonNull::new(base.cast::<u8>()).ok_or_else(|| fail("mmap returned a null address".into()))?;
        Ok(DramPool {
            base,
            budget,
            frames: ExtentAllocator::new(budget),
            seal,
            counters: SlotCounters::new(TIER_DRAM, slots),
            stats: TierStats { budget, ..TierStats::default() },
            stored: 0,
        })
    }

    /// Whether pages are sealed.
    pub fn seals(&self) -> bool {
        self.seal
    }

    /// The pool's size: the configured DRAM budget.
    pub fn capacity(&self) -> u64 {
        self.budget
    }

    /// Sets the bytes the pool may hold now (at most its size; memory pressure lowers it). Pages
    /// already stored stay; new ones are refused as [`TierError::Full`] until `used` is below it.
    pub fn set_limit(&mut self, bytes: u64) {
        self.stats.budget = bytes.min(self.budget);
    }

    /// Gives the memory behind free frames back to the system (`MADV_DONTNEED` on their whole
    /// 4 KiB pages: they read as zeros afterwards). Returns the bytes released.
    pub fn release_free(&mut self) -> u64 {
        const PAGE: u64 = 4096;
        let holes: Vec<(u64, u64)> = self.frames.free_extents().collect();
        let mut released = 0;
        for (offset, len) in holes {
            let (start, end) = (offset.next_multiple_of(PAGE), (offset + len) / PAGE * PAGE);
            if end <= start {
                continue;
            }
            // SAFETY: `start..end` is inside the mapping (free extents lie inside the capacity) and
            // holds no live frame; `&mut self` means nobody reads it meanwhile.
            let done = unsafe {
                rustix::mm::madvise(
                    self.base.as_ptr().add(start as usize).cast(),
                    (end - start) as usize,
                    Advice::LinuxDontNeed,
                )
            };
            match done {
                Ok(()) => released += end - start,
                Err(e) => tracing::warn!(error = %e, "MADV_DONTNEED on free DRAM frames failed"),
            }
        }
        released
    }

    /// The bytes of an allocated extent.
    fn frame(&mut self, offset: u64, len: u64) -> &mut [u8] {
        assert!(offset + len <= self.budget, "frame {offset}+{len} outside the pool");
        // SAFETY: inside the mapping (checked above), which lives as long as `self`; `&mut self`
        // makes this the only reference into the pool.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset as usize), len as usize) }
    }

    /// Stores one page (see [`Tier::put`]).
    fn put_one(&mut self, page: &PageWrite<'_>) -> Result<DramSlot, TierError> {
        let len = u32::try_from(page.bytes.len()).map_err(|_| SealError::TooLong { len: page.bytes.len() })?;
        let key = match (self.seal, page.key) {
            (false, _) => None,
            (true, Some(key)) => Some(key),
            (true, None) => {
                let p = page.page;
                return Err(TierError::NoKey {
                    tier: TierKind::Dram,
                    session: p.session,
                    layer: p.layer,
                    block: p.block,
                });
            }
        };
        let extent = ExtentAllocator::frame_len(u64::from(len).max(1));
        let limit = self.stats.budget;
        let full = TierError::Full {
            tier: TierKind::Dram,
            need: extent,
            free: limit.saturating_sub(self.frames.used()),
            budget: limit,
        };
        if self.frames.used() + extent > limit {
            return Err(full);
        }
        let offset = self.frames.alloc(extent).ok_or(full)?;
        let nonce = match key {
            Some(_) => match self.counters.next((offset / FRAME_ALIGN) as u32) {
                Ok(nonce) => Some(nonce),
                // A spent frame stays allocated: it is retired for good.
                Err(e) => return Err(e.into()),
            },
            None => None,
        };
        let frame = self.frame(offset, u64::from(len));
        frame.copy_from_slice(page.bytes);
        let sealed = match (key, nonce) {
            (Some(key), Some(nonce)) => {
                let aad = aad_of(page.page, nonce.counter(), len);
                match seal(key, nonce, &aad, frame) {
                    Ok(tag) => Some((nonce.counter(), tag)),
                    Err(e) => {
                        frame.zeroize();
                        self.frames.free(offset, extent);
                        return Err(e.into());
                    }
                }
            }
            _ => None,
        };
        self.stats.pages_in += 1;
        self.stats.bytes_in += u64::from(len);
        self.stats.pages += 1;
        self.stored += 1;
        Ok(DramSlot { offset, extent, len, sealed, serial: self.stored })
    }

    /// Loads one page (see [`Tier::get`]).
    fn get_one(&mut self, read: &mut PageRead<'_, DramSlot>) -> Result<(), TierError> {
        let slot = read.slot;
        if read.out.len() != slot.len as usize {
            return Err(TierError::BufferLength { got: read.out.len(), len: slot.len });
        }
        let page = read.page;
        let frame = self.frame(slot.offset, u64::from(slot.len));
        read.out.copy_from_slice(frame);
        if let Some((counter, tag)) = slot.sealed {
            let Some(key) = read.key else {
                read.out.fill(0);
                return Err(TierError::NoKey {
                    tier: TierKind::Dram,
                    session: page.session,
                    layer: page.layer,
                    block: page.block,
                });
            };
            let nonce = SealNonce::new(TIER_DRAM, (slot.offset / FRAME_ALIGN) as u32, counter)?;
            if let Err(e) = open(key, nonce, &aad_of(page, counter, slot.len), read.out, tag) {
                self.stats.auth_failures += 1;
                return Err(match e {
                    SealError::Tag { .. } => TierError::DataLoss {
                        tier: TierKind::Dram,
                        session: page.session,
                        layer: page.layer,
                        block: page.block,
                        why: "the authentication tag does not match",
                    },
                    other => other.into(),
                });
            }
        }
        self.stats.pages_out += 1;
        self.stats.bytes_out += u64::from(slot.len);
        Ok(())
    }

    /// The raw (possibly sealed) bytes of a live slot, for tests that tamper with them.
    #[cfg(test)]
    pub(crate) fn raw_mut(&mut self, slot: DramSlot) -> &mut [u8] {
        self.frame(slot.offset, u64::from(slot.len))
    }

    /// The whole pool's bytes, for tests that look for plaintext.
    #[cfg(test)]
    pub(crate) fn raw_pool(&mut self) -> &mut [u8] {
        self.frame(0, self.budget)
    }
}

fn aad_of(page: PageId, counter: u64, len: u32) -> PageAad {
    PageAad { session: page.session, layer: page.layer, block: page.block, tier: TIER_DRAM, counter, len }
}

impl Tier for DramPool {
    type Slot = DramSlot;

    fn kind(&self) -> TierKind {
        TierKind::Dram
    }

    fn stats(&self) -> TierStats {
        TierStats { used: self.frames.used(), ..self.stats }
    }

    fn put(&mut self, pages: &[PageWrite<'_>]) -> Vec<Result<DramSlot, TierError>> {
        pages.iter().map(|page| self.put_one(page)).collect()
    }

    fn get(&mut self, reads: &mut [PageRead<'_, DramSlot>]) -> Vec<Result<(), TierError>> {
        reads.iter_mut().map(|read| self.get_one(read)).collect()
    }

    /// Zeroes the frame, then returns it.
    fn free(&mut self, slot: DramSlot) {
        self.frame(slot.offset, slot.extent).zeroize();
        self.frames.free(slot.offset, slot.extent);
        self.stats.pages = self.stats.pages.saturating_sub(1);
    }

    /// The same as `free`: the frame is zeroed either way.
    fn discard(&mut self, slot: DramSlot) -> Result<(), TierError> {
        self.free(slot);
        Ok(())
    }
}

impl Drop for DramPool {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, with its length; no reference into it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.budget as usize) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seal::SessionKey;

    fn id(block: u32) -> PageId {
        PageId { session: 3, layer: 1, block }
    }

    #[test]
    fn a_lowered_limit_refuses_pages_and_free_frames_go_back_to_the_system() {
        let mut pool = DramPool::new(4 << 20, false).unwrap();
        let page = vec![7u8; 100_000];
        let put = |pool: &mut DramPool, n: u32| -> Vec<Result<DramSlot, TierError>> {
            let writes: Vec<PageWrite<'_>> =
                (0..n).map(|b| PageWrite { key: None, page: id(b), bytes: &page }).collect();
            pool.put(&writes)
        };
        let slots: Vec<DramSlot> = put(&mut pool, 30).into_iter().map(|r| r.unwrap()).collect();
        pool.set_limit(2 << 20);
        assert_eq!((pool.stats().budget, pool.capacity()), (2 << 20, 4 << 20));
        let refused = put(&mut pool, 1);
        assert!(matches!(refused[0], Err(TierError::Full { budget, .. }) if budget == 2 << 20), "{refused:?}");
        for slot in &slots[5..] {
            pool.free(*slot);
        }
        assert!(put(&mut pool, 1)[0].is_ok(), "room again under the limit");
        let released = pool.release_free();
        assert!(released >= 24 * 100_000, "{released}");
        // The live pages keep their bytes.
        let mut out = vec![0u8; page.len()];
        let mut reads = [PageRead { key: None, page: id(0), slot: slots[0], out: &mut out }];
        assert!(pool.get(&mut reads)[0].is_ok());
        assert_eq!(out, page);
        pool.set_limit(u64::MAX);
        assert_eq!(pool.stats().budget, 4 << 20, "never above the pool's size");
    }

    #[test]
    fn a_page_stored_again_in_the_same_frame_gets_a_different_slot() {
        let mut pool = DramPool::new(1 << 16, false).unwrap();
        let bytes = vec![1u8; 1000];
        let first = pool.put(&[PageWrite { key: None, page: id(0), bytes: &bytes }]).remove(0).unwrap();
        pool.free(first);
        let again = pool.put(&[PageWrite { key: None, page: id(0), bytes: &bytes }]).remove(0).unwrap();
        assert_eq!((again.offset, again.extent, again.len), (first.offset, first.extent, first.len));
        assert_ne!(again, first, "the serial tells them apart");
    }

    #[test]
    fn a_sealed_pool_holds_no_plaintext_and_a_flipped_byte_is_data_loss() {
        let mut pool = DramPool::new(1 << 20, true).unwrap();
        let key = SessionKey::generate().unwrap();
        let canary: Vec<u8> = b"KVMM-CANARY-dram-5d2e".iter().copied().cycle().take(20_000).collect();
        let slots: Vec<DramSlot> = pool
            .put(&[
                PageWrite { key: Some(&key), page: id(0), bytes: &canary },
                PageWrite { key: Some(&key), page: id(1), bytes: &canary },
            ])
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert!(!pool.raw_pool().windows(8).any(|w| w == &canary[..8]), "plaintext in the sealed pool");
        pool.raw_mut(slots[1])[777] ^= 1;
        let (mut a, mut b) = (vec![0u8; canary.len()], vec![0xffu8; canary.len()]);
        let mut reads = [
            PageRead { key: Some(&key), page: id(0), slot: slots[0], out: &mut a },
            PageRead { key: Some(&key), page: id(1), slot: slots[1], out: &mut b },
        ];
        let results = pool.get(&mut reads);
        assert!(results[0].is_ok());
        assert!(results[1].as_ref().is_err_and(TierError::is_data_loss), "{results:?}");
        assert_eq!(a, canary);
        assert!(b.iter().all(|&x| x == 0), "nothing of a failed page is returned");
        assert_eq!(pool.stats().auth_failures, 1);
    }

    #[test]
    fn an_unsealed_pool_round_trips_and_zeroes_freed_frames() {
        let mut pool = DramPool::new(1 << 16, false).unwrap();
        let bytes = vec![0x5au8; 1000];
        let slot = pool.put(&[PageWrite { key: None, page: id(0), bytes: &bytes }]).remove(0).unwrap();
        assert_eq!(slot.sealed, None);
        assert!(pool.raw_mut(slot).iter().all(|&x| x == 0x5a), "unsealed pages are stored as they are");
        pool.free(slot);
        assert!(pool.raw_pool().iter().all(|&x| x == 0), "a freed frame is zeroed");
        assert_eq!(pool.stats().used, 0);
    }
}
