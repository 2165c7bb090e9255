//! A session's authoritative page table: `[layer][block] -> (Place, Format)`, in the daemon's own
//! memory. A page lives in exactly one tier: a device frame the client maps, a DRAM slot or a flash
//! slot.
//!
//! The shared session table is a view the daemon publishes from this; the daemon never reads a
//! location back from shared memory. Blocks are allocated for every layer at once (`Extend`), so
//! `allocated_blocks` is the same for all layers, and blocks `0..allocated_blocks` all have a page
//! except those dropped by opt-in eviction (counted per layer).

use kvmm_kernels::Format;
use kvmm_store::dram::DramSlot;
use kvmm_store::flash::FlashSlot;
use kvmm_store::tier::TierKind;

use crate::pool::Frame;

/// Where a page's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// A frame of the owner's arena: resident, clients read it.
    Device(Frame),
    /// A slot of the daemon's DRAM pool.
    Dram(DramSlot),
    /// A slot of the flash file.
    Flash(FlashSlot),
}

impl Place {
    /// The tier.
    pub fn tier(&self) -> TierKind {
        match self {
            Place::Device(_) => TierKind::Device,
            Place::Dram(_) => TierKind::Dram,
            Place::Flash(_) => TierKind::Flash,
        }
    }

    /// Bytes the page takes in its tier (as allocated).
    pub fn footprint(&self) -> u64 {
        match self {
            Place::Device(f) => f.footprint(),
            Place::Dram(s) => s.extent,
            Place::Flash(s) => s.extent,
        }
    }
}

/// Where a page lives and how it is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Page {
    /// Its place.
    pub place: Place,
    /// Its format (f16/bf16 when written; lower after recompression or a compressing demotion,
    /// never higher again).
    pub format: Format,
}

impl Page {
    /// The device frame, if the page is resident.
    pub fn frame(&self) -> Option<Frame> {
        match self.place {
            Place::Device(f) => Some(f),
            _ => None,
        }
    }
}

/// The page table of one session.
#[derive(Debug)]
pub struct PageTable {
    layers: u32,
    blocks_per_layer: u32,
    /// Blocks allocated in every layer.
    allocated_blocks: u32,
    /// `pages[layer * blocks_per_layer + block]`; `Some` exactly for blocks below `allocated_blocks`
    /// that were not dropped.
    pages: Vec<Option<Page>>,
    /// Pages dropped by eviction, per layer.
    dropped: Vec<u32>,
}

impl PageTable {
    /// An empty table for `layers × blocks_per_layer` pages.
    pub fn new(layers: u32, blocks_per_layer: u32) -> Self {
        PageTable {
            layers,
            blocks_per_layer,
            allocated_blocks: 0,
            pages: vec![None; layers as usize * blocks_per_layer as usize],
            dropped: vec![0; layers as usize],
        }
    }

    /// Gives back every block from `blocks` on, in every layer: returns where each page was, with
    /// its layer and block (pages dropped by eviction had none). The caller frees their places and
    /// clears their entries; the next [`PageTable::extend`] starts at `blocks`. Nothing happens when
    /// `blocks` is at or past the allocated blocks.
    ///
    /// A move that took one of these pages with the core lock released (a flash write or read)
    /// finds at its commit that the block no longer holds the slot it took, even if the block was
    /// handed out again and its new page went down to the same place: a DRAM slot carries a serial
    /// and a flash slot a write counter that are never reused.
    pub fn truncate(&mut self, blocks: u32) -> Vec<(u32, u32, Place)> {
        let old = self.allocated_blocks;
        if blocks >= old {
            return Vec::new();
        }
        let mut freed = Vec::new();
        for layer in 0..self.layers {
            for block in blocks..old {
                let Some(i) = self.index(layer, block) else { continue };
                match self.pages[i].take() {
                    Some(page) => freed.push((layer, block, page.place)),
                    None => self.dropped[layer as usize] -= 1,
                }
            }
        }
        self.allocated_blocks = blocks;
        freed
    }

    /// Blocks allocated per layer.
    pub fn allocated_blocks(&self) -> u32 {
        self.allocated_blocks
    }

    /// Pages of `layer` that hold bytes somewhere: allocated and not dropped.
    pub fn live_blocks(&self, layer: u32) -> u32 {
        self.allocated_blocks - self.dropped.get(layer as usize).copied().unwrap_or(0)
    }

    /// Whether an allocated block of `layer` was dropped by eviction.
    pub fn is_dropped(&self, layer: u32, block: u32) -> bool {
        block < self.allocated_blocks && self.page(layer, block).is_none()
    }

    /// Pages dropped by eviction, over all layers.
    pub fn dropped(&self) -> u64 {
        self.dropped.iter().map(|&d| u64::from(d)).sum()
    }

    /// Forgets an allocated page for good (opt-in eviction) and returns where it was; the caller
    /// frees its place.
    pub fn drop_page(&mut self, layer: u32, block: u32) -> Option<Page> {
        let i = self.index(layer, block)?;
        let page = self.pages[i].take()?;
        self.dropped[layer as usize] += 1;
        Some(page)
    }

    /// Capacity per layer.
    pub fn blocks_per_layer(&self) -> u32 {
        self.blocks_per_layer
    }

    /// Number of layers.
    pub fn layers(&self) -> u32 {
        self.layers
    }

    fn index(&self, layer: u32, block: u32) -> Option<usize> {
        (layer < self.layers && block < self.blocks_per_layer)
            .then(|| layer as usize * self.blocks_per_layer as usize + block as usize)
    }

    /// A page, if allocated.
    pub fn page(&self, layer: u32, block: u32) -> Option<Page> {
        self.index(layer, block).and_then(|i| self.pages[i])
    }

    /// The device frame of a page, if allocated and resident.
    pub fn frame(&self, layer: u32, block: u32) -> Option<Frame> {
        self.page(layer, block).and_then(|p| p.frame())
    }

    /// Replaces the place of an allocated page, keeping its format (a move); returns the old place.
    pub fn replace(&mut self, layer: u32, block: u32, place: Place) -> Option<Place> {
        let i = self.index(layer, block)?;
        let page = self.pages[i].as_mut()?;
        Some(std::mem::replace(&mut page.place, place))
    }

    /// Records that an allocated page now lives at `place` encoded as `format` (recompression, or a
    /// demotion that compressed it); returns the old page.
    pub fn set(&mut self, layer: u32, block: u32, place: Place, format: Format) -> Option<Page> {
        let i = self.index(layer, block)?;
        let page = self.pages[i].as_mut()?;
        Some(std::mem::replace(page, Page { place, format }))
    }

    /// Records `frames`, ordered layer-major (all new blocks of layer 0, then of layer 1, ...), as the
    /// next `blocks` blocks of every layer, all encoded as `format`.
    pub fn extend(&mut self, blocks: u32, frames: &[Frame], format: Format) {
        debug_assert_eq!(frames.len(), blocks as usize * self.layers as usize);
        let first = self.allocated_blocks;
        for (i, frame) in frames.iter().enumerate() {
            let layer = i as u32 / blocks;
            let block = first + i as u32 % blocks;
            if let Some(idx) = self.index(layer, block) {
                self.pages[idx] = Some(Page { place: Place::Device(*frame), format });
            }
        }
        self.allocated_blocks += blocks;
    }

    /// Every resident page with its device frame.
    pub fn pages(&self) -> impl Iterator<Item = (u32, u32, Frame)> + '_ {
        (0..self.layers)
            .flat_map(move |l| (0..self.allocated_blocks).filter_map(move |b| self.frame(l, b).map(|f| (l, b, f))))
    }

    /// Every allocated page, wherever it is.
    pub fn all(&self) -> impl Iterator<Item = (u32, u32, Page)> + '_ {
        (0..self.layers)
            .flat_map(move |l| (0..self.allocated_blocks).filter_map(move |b| self.page(l, b).map(|p| (l, b, p))))
    }

    /// Removes every page and returns where each was (session destruction).
    pub fn take_all(&mut self) -> Vec<Place> {
        self.allocated_blocks = 0;
        self.dropped.fill(0);
        self.pages.iter_mut().filter_map(Option::take).map(|p| p.place).collect()
    }

    /// Sum of device frame footprints.
    pub fn bytes(&self) -> u64 {
        self.bytes_in(TierKind::Device)
    }

    /// Sum of the footprints of the pages in `tier`.
    pub fn bytes_in(&self, tier: TierKind) -> u64 {
        self.pages.iter().flatten().filter(|p| p.place.tier() == tier).map(|p| p.place.footprint()).sum()
    }

    /// Number of pages in `tier`.
    pub fn count_in(&self, tier: TierKind) -> u64 {
        self.pages.iter().flatten().filter(|p| p.place.tier() == tier).count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extend_places_frames_layer_major_after_existing_blocks() {
        let mut t = PageTable::new(2, 8);
        let f = |o| Frame { offset: o, len: 64 };
        t.extend(2, &[f(0), f(64), f(128), f(192)], Format::F16);
        assert_eq!(t.frame(0, 0), Some(f(0)));
        assert_eq!(t.frame(0, 1), Some(f(64)));
        assert_eq!(t.frame(1, 0), Some(f(128)));
        t.extend(1, &[f(256), f(320)], Format::F16);
        assert_eq!(t.frame(0, 2), Some(f(256)));
        assert_eq!(t.frame(1, 2), Some(f(320)));
        assert_eq!(t.page(0, 2).map(|p| p.format), Some(Format::F16));
        t.set(1, 2, Place::Device(Frame { offset: 320, len: 32 }), Format::Q8);
        assert_eq!(
            t.page(1, 2),
            Some(Page { place: Place::Device(Frame { offset: 320, len: 32 }), format: Format::Q8 })
        );
        assert_eq!(t.replace(1, 2, Place::Device(f(384))), Some(Place::Device(Frame { offset: 320, len: 32 })));
        assert_eq!(t.page(1, 2).map(|p| p.format), Some(Format::Q8), "a move keeps the format");
        assert_eq!(t.allocated_blocks(), 3);
        assert_eq!(t.pages().count(), 6);
        assert_eq!((t.live_blocks(0), t.dropped()), (3, 0));
        assert_eq!(t.drop_page(0, 1), Some(Page { place: Place::Device(f(64)), format: Format::F16 }));
        assert_eq!(t.drop_page(0, 1), None, "a page is dropped once");
        assert!(t.is_dropped(0, 1) && !t.is_dropped(1, 1) && !t.is_dropped(0, 3));
        assert_eq!((t.live_blocks(0), t.live_blocks(1), t.dropped()), (2, 3, 1));
        assert_eq!(t.pages().count(), 5, "a dropped page is nowhere");
        assert_eq!(t.take_all().len(), 5);
        assert_eq!(t.dropped(), 0);
        assert_eq!(t.bytes(), 0);
    }

    #[test]
    fn truncate_gives_back_the_blocks_past_it_in_every_layer_and_extend_starts_there_again() {
        let mut t = PageTable::new(2, 8);
        let f = |o| Frame { offset: o, len: 64 };
        t.extend(3, &[f(0), f(64), f(128), f(192), f(256), f(320)], Format::F16);
        let slot = DramSlot { offset: 0, extent: 64, len: 10, sealed: None, serial: 7 };
        t.set(1, 2, Place::Dram(slot), Format::Q8);
        assert_eq!(t.drop_page(0, 1).map(|p| p.place), Some(Place::Device(f(64))));
        assert_eq!(t.truncate(3), vec![], "nothing past the allocated blocks");
        assert_eq!(t.truncate(9), vec![]);

        let freed = t.truncate(1);
        assert_eq!(
            freed,
            vec![(0, 2, Place::Device(f(128))), (1, 1, Place::Device(f(256))), (1, 2, Place::Dram(slot)),],
            "the dropped page (0, 1) had no place"
        );
        assert_eq!((t.allocated_blocks(), t.dropped()), (1, 0));
        assert_eq!((t.live_blocks(0), t.live_blocks(1)), (1, 1));
        assert!(t.page(0, 2).is_none() && !t.is_dropped(0, 1), "past the allocated blocks: nothing");
        assert_eq!(t.bytes_in(TierKind::Dram), 0);

        t.extend(1, &[f(384), f(448)], Format::F16);
        assert_eq!((t.frame(0, 1), t.frame(1, 1)), (Some(f(384)), Some(f(448))));
        assert_eq!(t.allocated_blocks(), 2);
        assert_eq!(t.truncate(0).len(), 4);
        assert_eq!((t.allocated_blocks(), t.bytes()), (0, 0));
    }
}
