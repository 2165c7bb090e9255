//! One trust domain's arena: a sealed memfd sized to the device budget, mapped by the daemon and by
//! that uid's clients, carved into frames by an [`ExtentAllocator`].
//!
//! Memory is faulted in by the daemon in [`POPULATE_CHUNK`] steps as the high-water mark rises
//! (first touch costs ~0.6 s/GiB, so it is done once, off the client's path), and frames are reused.
//! Every frame is zeroed when it is freed, so a new frame never shows an earlier session's bytes.

use kvmm_shm::{Access, Mapping, Memfd, Seals};

use super::extent::ExtentAllocator;
use crate::error::Result;

/// Granularity with which the daemon faults arena memory in.
pub const POPULATE_CHUNK: u64 = 2 << 20;

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
    /// The daemon's read-write mapping of the whole arena.
    map: Mapping,
    /// Which extents are frames.
    frames: ExtentAllocator,
    /// Bytes from offset 0 that the daemon has faulted in; only grows.
    populated: u64,
}

impl Arena {
    /// Creates the arena of `uid` with room for `capacity` bytes of frames.
    pub fn create(uid: u32, capacity: u64) -> Result<Self> {
        let memfd = Memfd::create(&format!("kvmm-arena-uid{uid}"), capacity)?;
        memfd.seal(Seals::SHRINK | Seals::GROW | Seals::SEAL)?;
        let map = Mapping::map(&memfd, Access::ReadWrite)?;
        Ok(Arena { uid, memfd, map, frames: ExtentAllocator::new(capacity), populated: 0 })
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
    pub fn alloc(&mut self, len: u64) -> Result<Option<Frame>> {
        match self.frames.alloc(len) {
            Some(offset) => self.finish_alloc(Frame { offset, len }).map(Some),
            None => Ok(None),
        }
    }

    /// Allocates the frame at exactly `offset` for `len` bytes (a planned compaction move), if free.
    pub fn alloc_at(&mut self, offset: u64, len: u64) -> Result<Option<Frame>> {
        if self.frames.alloc_at(offset, len) { self.finish_alloc(Frame { offset, len }).map(Some) } else { Ok(None) }
    }

    fn finish_alloc(&mut self, frame: Frame) -> Result<Frame> {
        let end = frame.offset + frame.footprint();
        if end > self.populated {
            let target = end.div_ceil(POPULATE_CHUNK) * POPULATE_CHUNK;
            let target = target.min(self.map.len() as u64);
            if let Err(e) =
                self.map.populate(self.populated as usize, (target - self.populated) as usize, Access::ReadWrite)
            {
                self.frames.free(frame.offset, frame.len);
                return Err(e.into());
            }
            self.populated = target;
        }
        Ok(frame)
    }

    /// Zeroes a frame and returns it to the allocator.
    pub fn free(&mut self, frame: Frame) -> Result<()> {
        self.map.zero(frame.offset as usize, frame.footprint() as usize)?;
        self.frames.free(frame.offset, frame.len);
        Ok(())
    }

    /// Copies a page's bytes from one frame to another (used by the move protocol under MIGRATING).
    pub fn copy(&self, from: Frame, to: Frame) -> Result<()> {
        debug_assert_eq!(from.len, to.len);
        self.map.copy_within(from.offset as usize, to.offset as usize, from.len as usize)?;
        Ok(())
    }
}
