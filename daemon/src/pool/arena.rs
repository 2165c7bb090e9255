//! One trust domain's arena: a sealed memfd sized to the device budget, mapped by the daemon and by
//! that uid's clients, carved into frames by an [`ExtentAllocator`].
//!
//! Memory is faulted in ahead of demand by the daemon's prefaulter ([`Arena::next_prefault`]), in
//! [`POPULATE_CHUNK`] steps outside the core lock, so that first touch (~0.6 s/GiB) is paid neither on
//! an RPC nor by a client; frames are reused. Populating is only ever a speed-up: an untouched part of
//! the memfd reads as zero and is faulted in by whoever touches it first. Every frame is zeroed when
//! it is freed, so a new frame never shows an earlier session's bytes.

use std::sync::Arc;

use kvmm_shm::{Access, Mapping, Memfd, Seals};

use crate::error::Result;
use kvmm_store::extent::ExtentAllocator;

/// Granularity with which the daemon faults arena memory in.
pub const POPULATE_CHUNK: u64 = 2 << 20;

/// Work for the prefaulter: fault `start..end` of an arena in, outside the core lock.
#[derive(Debug, Clone)]
pub struct PrefaultJob {
    /// The arena's owner.
    pub uid: u32,
    /// The daemon's mapping (kept alive by the job even if the arena goes).
    pub map: Arc<Mapping>,
    /// First byte to fault in.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

/// A frame: the extent of the arena that holds one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Byte offset in the arena; a multiple of the frame alignment.
    pub offset: u64,
    /// Bytes of the page stored in it (the allocator rounds the extent up to the alignment).
    pub len: u64,
}

impl Frame {
    /// Bytes the frame takes from the budget.
    pub fn footprint(&self) -> u64 {
        ExtentAllocator::frame_len(self.len)
    }
}

/// The arena of one uid.
#[derive(Debug)]
pub struct Arena {
    /// The uid whose clients may map this arena. Fixed at creation.
    uid: u32,
    /// The memfd handed to clients; sealed against resizing so no client can cause SIGBUS.
    memfd: Memfd,
    /// The daemon's read-write mapping of the whole arena; shared with the prefaulter.
    map: Arc<Mapping>,
    /// Which extents are frames.
    frames: ExtentAllocator,
    /// Bytes from offset 0 that the prefaulter has faulted in; grows, and falls back to the
    /// high-water mark when memory is given back under pressure.
    populated: u64,
}

impl Arena {
    /// Creates the arena of `uid` with room for `capacity` bytes of frames.
    pub fn create(uid: u32, capacity: u64) -> Result<Self> {
        let memfd = Memfd::create(&format!("kvmm-arena-uid{uid}"), capacity)?;
        memfd.seal(Seals::SHRINK | Seals::GROW | Seals::SEAL)?;
        let map = Mapping::map(&memfd, Access::ReadWrite)?;
        Ok(Arena { uid, memfd, map: Arc::new(map), frames: ExtentAllocator::new(capacity), populated: 0 })
    }

    /// The owning uid.
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// The arena memfd (duplicate it to hand it out).
    pub fn memfd(&self) -> &Memfd {
        &self.memfd
    }

    /// The daemon's mapping.
    pub fn mapping(&self) -> &Mapping {
        &self.map
    }

    /// Bytes of frames in use.
    pub fn used(&self) -> u64 {
        self.frames.used()
    }

    /// Bytes faulted in.
    pub fn populated(&self) -> u64 {
        self.populated
    }

    /// The allocator (read-only), for the compaction planner.
    pub fn frames(&self) -> &ExtentAllocator {
        &self.frames
    }

    /// Allocates a zeroed frame for `len` bytes, or `None` when no hole fits.
    pub fn alloc(&mut self, len: u64) -> Option<Frame> {
        self.frames.alloc(len).map(|offset| Frame { offset, len })
    }

    /// Allocates the frame at exactly `offset` for `len` bytes (a planned compaction move), if free.
    pub fn alloc_at(&mut self, offset: u64, len: u64) -> Option<Frame> {
        self.frames.alloc_at(offset, len).then_some(Frame { offset, len })
    }

    /// The next range to fault in so that `headroom` bytes beyond the high-water mark are populated,
    /// at most `max_step` bytes of it; `None` when there is enough.
    pub fn next_prefault(&self, headroom: u64, max_step: u64) -> Option<PrefaultJob> {
        let cap = self.map.len() as u64;
        let want = (self.frames.high_water() + headroom).div_ceil(POPULATE_CHUNK) * POPULATE_CHUNK;
        let want = want.min(cap);
        (want > self.populated).then(|| PrefaultJob {
            uid: self.uid,
            map: self.map.clone(),
            start: self.populated,
            end: want.min(self.populated + max_step.max(POPULATE_CHUNK)),
        })
    }

    /// Records that `..end` has been faulted in.
    pub fn mark_populated(&mut self, end: u64) {
        self.populated = self.populated.max(end);
    }

    /// Punches the whole 4 KiB pages of every free extent out of the memfd (they read as zeros
    /// afterwards, as freed frames do) and lowers the faulted-in mark to the high-water mark's
    /// chunk. Returns the bytes punched.
    pub fn release_free(&mut self) -> Result<u64> {
        const PAGE: u64 = 4096;
        let mut punched = 0;
        let holes: Vec<(u64, u64)> = self.frames.free_extents().collect();
        for (offset, len) in holes {
            let (start, end) = (offset.next_multiple_of(PAGE), (offset + len) / PAGE * PAGE);
            let end = end.min(self.populated.next_multiple_of(PAGE));
            if end > start {
                self.memfd.punch_hole(start, end - start)?;
                punched += end - start;
            }
        }
        self.populated = self.populated.min(self.frames.high_water().next_multiple_of(POPULATE_CHUNK));
        Ok(punched)
    }

    /// Zeroes a frame and returns it to the allocator.
    pub fn free(&mut self, frame: Frame) -> Result<()> {
        self.zero(frame)?;
        self.frames.free(frame.offset, frame.len);
        Ok(())
    }

    /// Zeroes a frame's whole footprint, keeping it allocated.
    pub fn zero(&self, frame: Frame) -> Result<()> {
        self.map.zero(frame.offset as usize, frame.footprint() as usize)?;
        Ok(())
    }

    /// Copies a page's bytes from one frame to another (used by the move protocol under MIGRATING).
    pub fn copy(&self, from: Frame, to: Frame) -> Result<()> {
        debug_assert_eq!(from.len, to.len);
        self.map.copy_within(from.offset as usize, to.offset as usize, from.len as usize)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefaulter_stays_a_headroom_ahead_of_the_high_water_mark() {
        let mut a = Arena::create(4242, 64 << 20).unwrap();
        let job = a.next_prefault(4 << 20, 2 << 20).unwrap();
        assert_eq!((job.start, job.end), (0, 2 << 20), "one step at a time");
        a.mark_populated(job.end);
        let job = a.next_prefault(4 << 20, 8 << 20).unwrap();
        assert_eq!((job.start, job.end), (2 << 20, 4 << 20));
        job.map.populate(job.start as usize, (job.end - job.start) as usize, Access::ReadWrite).unwrap();
        a.mark_populated(job.end);
        assert!(a.next_prefault(4 << 20, 8 << 20).is_none(), "enough headroom");
        let f = a.alloc(3 << 20).unwrap();
        let job = a.next_prefault(4 << 20, 64 << 20).unwrap();
        assert_eq!(job.end, 8 << 20, "the headroom follows the high-water mark, rounded to a chunk");
        a.free(f).unwrap();
        let full = a.next_prefault(1 << 30, 1 << 30).unwrap();
        assert_eq!(full.end, 64 << 20, "never past the arena");
    }

    /// Pages of the arena's memfd that are resident (`mincore` on the daemon's mapping).
    fn resident_pages(a: &Arena) -> usize {
        let len = a.mapping().len();
        let mut vec = vec![0u8; len.div_ceil(4096)];
        // SAFETY: the mapping covers `len` bytes and `vec` has one byte per page of it.
        let r = unsafe { libc::mincore(a.mapping().as_ptr() as *mut libc::c_void, len, vec.as_mut_ptr()) };
        assert_eq!(r, 0);
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn released_free_frames_leave_memory_and_live_frames_keep_their_bytes() {
        let mut a = Arena::create(4243, 16 << 20).unwrap();
        let frames: Vec<Frame> = (0..40).map(|_| a.alloc(100_000).unwrap()).collect();
        for (i, f) in frames.iter().enumerate() {
            a.mapping().write_at(f.offset as usize, &vec![i as u8 + 1; f.len as usize]).unwrap();
        }
        a.mark_populated(8 << 20);
        let before = resident_pages(&a);
        for f in frames.iter().skip(10) {
            a.free(*f).unwrap();
        }
        let punched = a.release_free().unwrap();
        assert!(punched >= 30 * 100_000 - 30 * 8192, "{punched}");
        let after = resident_pages(&a);
        // Only the ten live frames (about 1 MB) stay resident; the thirty written and freed left.
        let live_pages = (10 * 100_032usize).div_ceil(4096) + 1;
        assert!(after <= live_pages && before - after >= 30 * 100_000 / 4096 - 30, "{before} -> {after} pages");
        assert_eq!(a.populated(), (10 * 100_032u64).next_multiple_of(POPULATE_CHUNK), "back to the high-water chunk");
        for (i, f) in frames.iter().take(10).enumerate() {
            let mut buf = vec![0u8; f.len as usize];
            a.mapping().read_at(f.offset as usize, &mut buf).unwrap();
            assert!(buf.iter().all(|&b| b == i as u8 + 1), "frame {i} kept its bytes");
        }
        let mut freed = vec![1u8; 100_000];
        a.mapping().read_at(frames[20].offset as usize, &mut freed).unwrap();
        assert!(freed.iter().all(|&b| b == 0), "a released frame reads as zeros");
    }
}
