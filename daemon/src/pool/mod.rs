//! The device-tier pool: one [`Arena`] per trust domain (uid) and one global budget across all of them.
//!
//! Accounting is exact: `used` is the sum of the footprints of every frame handed out, in every arena,
//! and an allocation that would push it past the budget fails with `RESOURCE_EXHAUSTED` naming the
//! tier and the requested and available bytes. Nothing is overcommitted: each arena is a sparse memfd
//! as large as the whole budget, but only frames inside the budget are ever handed out.

pub mod arena;
pub mod quarantine;

use std::collections::HashMap;

use kvmm_store::extent::ExtentAllocator;

pub use arena::{Arena, Frame, PrefaultJob};

use crate::error::{Error, Result};

/// Name of the tier this pool implements, as it appears in messages and stats.
pub const DEVICE_TIER: &str = "device";

/// The device-tier pool.
#[derive(Debug)]
pub struct Pool {
    /// Bytes the device tier may hold now, across all arenas: the configured budget, or less while
    /// the policy shrinks it (memory pressure). Allocations past it fail.
    budget: u64,
    /// The budget configured at start-up; the size of every arena's memfd.
    configured: u64,
    /// Bytes of frames handed out, across all arenas.
    used: u64,
    /// Frames handed out, across all arenas.
    frames: u64,
    /// Arenas by uid, created on a uid's first attach and kept (memory is reused) until shutdown.
    arenas: HashMap<u32, Arena>,
}

impl Pool {
    /// An empty pool with the given budget.
    pub fn new(budget: u64) -> Self {
        Pool { budget, configured: budget, used: 0, frames: 0, arenas: HashMap::new() }
    }

    /// The budget in force, in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// The budget configured at start-up.
    pub fn configured_budget(&self) -> u64 {
        self.configured
    }

    /// Sets the budget in force to `bytes` (at most the configured one). Frames already handed out
    /// stay: `used` may exceed a lowered budget until demotion brings it down, and until then no
    /// new frame is handed out.
    pub fn set_budget(&mut self, bytes: u64) {
        self.budget = bytes.min(self.configured);
    }

    /// Bytes a new frame may still take under the budget in force.
    fn room(&self) -> u64 {
        self.budget.saturating_sub(self.used)
    }

    /// Gives the memory behind free frames back to the system (punching whole 4 KiB pages out of
    /// each arena's memfd, which reads as zeros, like a freed frame), and forgets that the tail past
    /// each arena's high-water mark was faulted in. Returns the bytes punched.
    pub fn release_free(&mut self) -> Result<u64> {
        let mut released = 0;
        for arena in self.arenas.values_mut() {
            released += arena.release_free()?;
        }
        Ok(released)
    }

    /// Bytes of frames in use.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Frames in use.
    pub fn frame_count(&self) -> u64 {
        self.frames
    }

    /// Number of arenas (trust domains seen).
    pub fn arena_count(&self) -> usize {
        self.arenas.len()
    }

    /// The arena of `uid`, created on first use.
    pub fn arena_for(&mut self, uid: u32) -> Result<&mut Arena> {
        if !self.arenas.contains_key(&uid) {
            let arena = Arena::create(uid, self.configured)?;
            tracing::info!(uid, bytes = self.configured, "created arena");
            self.arenas.insert(uid, arena);
        }
        self.arenas.get_mut(&uid).ok_or_else(|| Error::FailedPrecondition("arena vanished".to_owned()))
    }

    /// The arena of `uid`, if it exists.
    pub fn arena(&self, uid: u32) -> Option<&Arena> {
        self.arenas.get(&uid)
    }

    /// Mutable access to the arena of `uid`, if it exists.
    pub fn arena_mut(&mut self, uid: u32) -> Option<&mut Arena> {
        self.arenas.get_mut(&uid)
    }

    /// Allocates `count` frames of `len` bytes for `uid`: all of them or none.
    pub fn alloc_frames(&mut self, uid: u32, len: u64, count: u64) -> Result<Vec<Frame>> {
        let requested = ExtentAllocator::frame_len(len).saturating_mul(count);
        let available = self.room();
        if requested > available {
            return Err(Error::Exhausted { tier: DEVICE_TIER, requested, available, budget: self.budget });
        }
        let arena = self.arena_for(uid)?;
        let mut frames = Vec::with_capacity(count as usize);
        for _ in 0..count {
            match arena.alloc(len) {
                Some(f) => frames.push(f),
                None => {
                    for f in frames {
                        arena.free(f)?;
                    }
                    return Err(Error::Exhausted { tier: DEVICE_TIER, requested, available, budget: self.budget });
                }
            }
        }
        self.used += requested;
        self.frames += count;
        Ok(frames)
    }

    /// Allocates one frame for a page move inside `uid`'s arena: at exactly `at` when given, else
    /// anywhere. The move needs the destination before it frees the source, so the destination is
    /// counted like any other frame; `None` when the budget or the arena has no room.
    pub fn alloc_move_target(&mut self, uid: u32, len: u64, at: Option<u64>) -> Result<Option<Frame>> {
        let need = ExtentAllocator::frame_len(len);
        if need > self.room() {
            return Ok(None);
        }
        let Some(arena) = self.arenas.get_mut(&uid) else { return Ok(None) };
        let frame = match at {
            Some(offset) => arena.alloc_at(offset, len),
            None => arena.alloc(len),
        };
        if frame.is_some() {
            self.used += need;
            self.frames += 1;
        }
        Ok(frame)
    }

    /// Whether `count` frames of `len` bytes fit both the budget and the free space of `uid`'s
    /// arena (holes are counted whole frames at a time; a uid without an arena yet has all of it).
    pub fn fits(&self, uid: u32, len: u64, count: u64) -> bool {
        let need = ExtentAllocator::frame_len(len);
        if need.saturating_mul(count) > self.room() {
            return false;
        }
        let Some(arena) = self.arenas.get(&uid) else { return true };
        let mut room = 0u64;
        for (_, hole) in arena.frames().free_extents() {
            room += hole / need;
            if room >= count {
                return true;
            }
        }
        false
    }

    /// Zeroes and frees a frame of `uid`'s arena.
    pub fn free_frame(&mut self, uid: u32, frame: Frame) -> Result<()> {
        let arena = self
            .arenas
            .get_mut(&uid)
            .ok_or_else(|| Error::FailedPrecondition(format!("no arena for uid {uid} while freeing a frame")))?;
        arena.free(frame)?;
        self.used -= frame.footprint();
        self.frames -= 1;
        Ok(())
    }

    /// The next prefault job of each arena that needs one.
    pub fn prefault_jobs(&self, headroom: u64, max_step: u64) -> Vec<PrefaultJob> {
        self.arenas.values().filter_map(|a| a.next_prefault(headroom, max_step)).collect()
    }

    /// Records a finished prefault job.
    pub fn prefault_done(&mut self, job: &PrefaultJob) {
        if let Some(a) = self.arenas.get_mut(&job.uid) {
            a.mark_populated(job.end);
        }
    }

    /// Every arena, by uid.
    pub fn arenas(&self) -> impl Iterator<Item = (u32, &Arena)> {
        self.arenas.iter().map(|(&uid, a)| (uid, a))
    }

    /// Shrinks a frame of `uid`'s arena in place to `new_len` bytes (a page recompressed into fewer
    /// bytes at the same offset): the tail is zeroed and returned. Returns the shrunk frame.
    pub fn shrink_frame(&mut self, uid: u32, frame: Frame, new_len: u64) -> Result<Frame> {
        let shrunk = Frame { offset: frame.offset, len: new_len };
        let (old, new) = (frame.footprint(), shrunk.footprint());
        if new > old || new_len == 0 {
            return Err(Error::FailedPrecondition(format!(
                "cannot shrink a {}-byte frame to {new_len} bytes",
                frame.len
            )));
        }
        if new < old {
            let arena = self
                .arenas
                .get_mut(&uid)
                .ok_or_else(|| Error::FailedPrecondition(format!("no arena for uid {uid} while shrinking a frame")))?;
            arena.free(Frame { offset: frame.offset + new, len: old - new })?;
            self.used -= old - new;
        }
        Ok(shrunk)
    }

    /// Sum of the used bytes the arenas report; equals `used()` (checked in tests and by the admin status).
    pub fn used_by_arenas(&self) -> u64 {
        self.arenas.values().map(Arena::used).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shrinking_a_frame_returns_its_tail_to_the_budget_and_the_allocator() {
        let mut pool = Pool::new(64 << 20);
        let f = pool.alloc_frames(7, 24_576, 2).unwrap();
        let before = pool.used();
        let small = pool.shrink_frame(7, f[0], 6_720).unwrap();
        assert_eq!(small.offset, f[0].offset);
        assert_eq!(pool.used(), before - (24_576 - 6_720));
        assert_eq!(pool.used(), pool.used_by_arenas());
        // The freed tail is reusable: a small frame fits there, between the two pages.
        let tail = pool.alloc_move_target(7, 1_000, None).unwrap().unwrap();
        assert_eq!(tail.offset, f[0].offset + 6_720);
        assert!(pool.shrink_frame(7, small, 10_000).is_err(), "frames never grow in place");
    }

    #[test]
    fn fits_sees_holes_too_small_for_a_frame_though_the_budget_has_the_bytes() {
        let mut pool = Pool::new(2 << 20);
        // Fill the arena with small frames, then free every other one: half the budget is free,
        // in holes of 14,336 bytes.
        let small = pool.alloc_frames(3, 14_336, (2 << 20) / 14_336).unwrap();
        for f in small.iter().step_by(2) {
            pool.free_frame(3, *f).unwrap();
        }
        assert!(pool.budget() - pool.used() > 25_408 * 4);
        assert!(!pool.fits(3, 25_408, 1), "no hole takes an f16 page");
        assert!(pool.fits(3, 14_336, 4));
        assert!(pool.fits(9, 25_408, 1), "a uid without an arena only needs the budget");
        assert!(!pool.fits(3, 14_336, 1_000), "nor more than the budget");
    }

    #[test]
    fn a_lowered_budget_refuses_new_frames_until_used_is_under_it_and_comes_back() {
        let mut pool = Pool::new(8 << 20);
        let f = pool.alloc_frames(5, 1 << 20, 6).unwrap();
        pool.set_budget(4 << 20);
        assert_eq!((pool.budget(), pool.configured_budget()), (4 << 20, 8 << 20));
        let e = pool.alloc_frames(5, 4096, 1).unwrap_err();
        assert!(matches!(e, Error::Exhausted { available: 0, budget, .. } if budget == 4 << 20), "{e}");
        assert!(!pool.fits(5, 4096, 1));
        for frame in &f[..3] {
            pool.free_frame(5, *frame).unwrap();
        }
        assert!(pool.fits(5, 1 << 20, 1) && !pool.fits(5, 1 << 20, 2));
        pool.set_budget(u64::MAX);
        assert_eq!(pool.budget(), 8 << 20, "never above the configured budget");
        assert!(pool.fits(5, 1 << 20, 5));
    }
}
