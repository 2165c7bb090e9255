//! A best-fit extent allocator over a byte range: frames of the device tier's arenas (aligned to
//! [`FRAME_ALIGN`]) and of the DRAM pool, and the flash file's slots (aligned to its I/O block).
//!
//! Extents are contiguous and aligned to the allocator's alignment. Free space is kept twice: by offset (to
//! coalesce neighbours on free) and by (length, offset) (to find the smallest hole that fits, lowest
//! address first, which keeps the high-water mark low and the populated part of the arena dense).
//!
//! Invariants (checked by `check` in tests and debug builds):
//! - free extents never overlap, never touch (touching ones are merged) and lie inside the capacity;
//! - `by_size` holds exactly the entries of `by_offset`;
//! - `used + Σ free = capacity`.

use std::collections::{BTreeMap, BTreeSet};

/// Alignment of every frame: one cache line, and the width of an AVX-512 load.
pub const FRAME_ALIGN: u64 = 64;

/// Best-fit allocator of aligned extents inside `0..capacity`.
#[derive(Debug)]
pub struct ExtentAllocator {
    /// Alignment of every extent's offset and length, a power of two.
    align: u64,
    capacity: u64,
    used: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl ExtentAllocator {
    /// An allocator of [`FRAME_ALIGN`]-aligned frames with all of `0..capacity` free (capacity
    /// rounded down to the alignment).
    pub fn new(capacity: u64) -> Self {
        Self::with_align(capacity, FRAME_ALIGN)
    }

    /// Like [`ExtentAllocator::new`] with extents aligned to `align` (a power of two).
    pub fn with_align(capacity: u64, align: u64) -> Self {
        assert!(align.is_power_of_two(), "extent alignment {align} is not a power of two");
        let capacity = capacity / align * align;
        let mut a = ExtentAllocator { align, capacity, used: 0, by_offset: BTreeMap::new(), by_size: BTreeSet::new() };
        if capacity > 0 {
            a.insert_free(0, capacity);
        }
        a
    }

    /// Rounds a byte count up to the frame alignment ([`FRAME_ALIGN`]).
    pub fn frame_len(bytes: u64) -> u64 {
        bytes.div_ceil(FRAME_ALIGN) * FRAME_ALIGN
    }

    /// Rounds a byte count up to this allocator's alignment: the length an extent of `bytes` takes.
    pub fn extent_len(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.align) * self.align
    }

    /// The alignment of every extent.
    pub fn align(&self) -> u64 {
        self.align
    }

    /// Bytes allocated (after rounding to the alignment).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The managed capacity.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Allocates `len` bytes (rounded up to the alignment); returns the offset, or `None` when no hole fits.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let len = self.extent_len(len.max(1));
        let &(hole_len, hole_off) = self.by_size.range((len, 0)..).next()?;
        self.remove_free(hole_off, hole_len);
        if hole_len > len {
            self.insert_free(hole_off + len, hole_len - len);
        }
        self.used += len;
        Some(hole_off)
    }

    /// Allocates exactly `offset..offset+len` (rounded), if that range is free. The compactor uses it
    /// to carry out a planned move.
    pub fn alloc_at(&mut self, offset: u64, len: u64) -> bool {
        let len = self.extent_len(len.max(1));
        let Some((&hole_off, &hole_len)) = self.by_offset.range(..=offset).next_back() else { return false };
        if !offset.is_multiple_of(self.align) || offset + len > hole_off + hole_len {
            return false;
        }
        self.remove_free(hole_off, hole_len);
        if offset > hole_off {
            self.insert_free(hole_off, offset - hole_off);
        }
        let end = offset + len;
        if hole_off + hole_len > end {
            self.insert_free(end, hole_off + hole_len - end);
        }
        self.used += len;
        true
    }

    /// The free extents as (offset, length), lowest offset first.
    pub fn free_extents(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_offset.iter().map(|(&o, &l)| (o, l))
    }

    /// Returns an extent given out by `alloc` with the same `len`.
    ///
    /// # Panics
    /// In debug builds, if the extent overlaps free space (a double free).
    pub fn free(&mut self, offset: u64, len: u64) {
        let mut off = offset;
        let mut len = self.extent_len(len.max(1));
        debug_assert!(off + len <= self.capacity, "free past capacity");
        debug_assert!(!self.overlaps_free(off, len), "double free of {off}+{len}");
        self.used -= len;
        if let Some((&prev_off, &prev_len)) = self.by_offset.range(..off).next_back()
            && prev_off + prev_len == off
        {
            self.remove_free(prev_off, prev_len);
            off = prev_off;
            len += prev_len;
        }
        if let Some(&next_len) = self.by_offset.get(&(off + len)) {
            self.remove_free(off + len, next_len);
            len += next_len;
        }
        self.insert_free(off, len);
    }

    /// One past the highest allocated byte (0 when empty).
    pub fn high_water(&self) -> u64 {
        match self.by_offset.iter().next_back() {
            Some((&off, &len)) if off + len == self.capacity => off,
            _ => self.capacity,
        }
    }

    /// Bytes of free space below the high-water mark (fragmentation the compactor can recover).
    pub fn holes_below_high_water(&self) -> u64 {
        let hw = self.high_water();
        self.by_offset.iter().filter(|&(&off, _)| off < hw).map(|(_, &len)| len).sum()
    }

    fn overlaps_free(&self, off: u64, len: u64) -> bool {
        self.by_offset.range(..off + len).next_back().is_some_and(|(&o, &l)| o + l > off)
    }

    fn insert_free(&mut self, off: u64, len: u64) {
        self.by_offset.insert(off, len);
        self.by_size.insert((len, off));
    }

    fn remove_free(&mut self, off: u64, len: u64) {
        self.by_offset.remove(&off);
        self.by_size.remove(&(len, off));
    }

    /// Verifies the invariants; used by tests.
    pub fn check(&self) -> Result<(), String> {
        let mut end = 0;
        let mut free = 0;
        for (&off, &len) in &self.by_offset {
            if off < end || (off == end && end != 0) {
                return Err(format!("free extent {off}+{len} overlaps or touches its predecessor"));
            }
            if !self.by_size.contains(&(len, off)) {
                return Err(format!("free extent {off}+{len} missing from the size index"));
            }
            end = off + len;
            free += len;
        }
        if end > self.capacity || self.by_size.len() != self.by_offset.len() {
            return Err("indexes disagree or exceed capacity".to_owned());
        }
        if free + self.used != self.capacity {
            return Err(format!("used {} + free {free} != capacity {}", self.used, self.capacity));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn freeing_everything_coalesces_back_to_one_extent() {
        let mut a = ExtentAllocator::new(1 << 20);
        let xs: Vec<u64> = (0..10).map(|_| a.alloc(1000).unwrap()).collect();
        for x in xs.iter().skip(1).step_by(2) {
            a.free(*x, 1000);
        }
        for x in xs.iter().step_by(2) {
            a.free(*x, 1000);
        }
        a.check().unwrap();
        assert_eq!(a.used(), 0);
        assert_eq!(a.by_offset.len(), 1);
        assert_eq!(a.high_water(), 0);
    }

    #[test]
    fn best_fit_prefers_the_smallest_hole() {
        let mut a = ExtentAllocator::new(64 * 100);
        let x = a.alloc(64 * 10).unwrap();
        let _y = a.alloc(64).unwrap();
        let z = a.alloc(64 * 3).unwrap();
        let _w = a.alloc(64).unwrap();
        a.free(x, 64 * 10);
        a.free(z, 64 * 3);
        assert_eq!(a.alloc(64 * 2), Some(z), "the 3-frame hole fits a 2-frame request best");
        a.check().unwrap();
    }

    #[test]
    fn exhaustion_returns_none_and_leaves_state_intact() {
        let mut a = ExtentAllocator::new(64 * 4);
        assert!(a.alloc(64 * 4).is_some());
        assert_eq!(a.alloc(1), None);
        a.check().unwrap();
    }

    #[test]
    fn holes_below_the_high_water_mark_are_counted() {
        let mut a = ExtentAllocator::new(64 * 10);
        let x = a.alloc(64).unwrap();
        let _ = a.alloc(64).unwrap();
        let z = a.alloc(64).unwrap();
        a.free(x, 64);
        assert_eq!(a.high_water(), z + 64);
        assert_eq!(a.holes_below_high_water(), 64);
    }

    #[test]
    fn a_coarser_alignment_rounds_offsets_and_lengths() {
        let mut a = ExtentAllocator::with_align(10 * 4096 + 100, 4096);
        assert_eq!(a.capacity(), 10 * 4096);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(4097).unwrap();
        assert_eq!((x, y, a.used()), (0, 4096, 3 * 4096));
        assert!(!a.alloc_at(5 * 4096 + 64, 64), "an unaligned offset is refused");
        a.free(y, 4097);
        a.check().unwrap();
        assert_eq!(a.used(), 4096);
    }

    #[test]
    fn alloc_at_splits_a_hole_around_the_target() {
        let mut a = ExtentAllocator::new(64 * 10);
        assert!(a.alloc_at(64 * 3, 64 * 2));
        assert!(!a.alloc_at(64 * 4, 64), "already taken");
        assert!(!a.alloc_at(64 * 9, 128), "runs past the end");
        assert_eq!(a.free_extents().collect::<Vec<_>>(), vec![(0, 192), (320, 320)]);
        a.check().unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec(prop_oneof![(1u64..5000).prop_map(Op::Alloc), (0usize..64).prop_map(Op::Free)], 1..200)
    }

    proptest! {
        /// Model test: the allocator against a list of live extents.
        #[test]
        fn model_live_extents_never_overlap_and_accounting_is_exact(ops in ops()) {
            let cap = 64 * 1024;
            let mut a = ExtentAllocator::new(cap);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        let need = ExtentAllocator::frame_len(len);
                        let free_total = cap - live.iter().map(|e| e.1).sum::<u64>();
                        match a.alloc(len) {
                            Some(off) => {
                                prop_assert_eq!(off % FRAME_ALIGN, 0);
                                prop_assert!(off + need <= cap);
                                for &(o, l) in &live {
                                    prop_assert!(off + need <= o || o + l <= off, "overlap");
                                }
                                live.push((off, need));
                            }
                            None => prop_assert!(free_total < need || !live.is_empty()),
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (o, l) = live.swap_remove(i % live.len());
                        a.free(o, l);
                    }
                    Op::Free(_) => {}
                }
                prop_assert_eq!(a.used(), live.iter().map(|e| e.1).sum::<u64>());
                prop_assert!(a.check().is_ok(), "{:?}", a.check());
                let hw = live.iter().map(|&(o, l)| o + l).max().unwrap_or(0);
                prop_assert_eq!(a.high_water(), hw);
            }
        }
    }
}
