//! A session's authoritative page table: `[layer][block] -> (Frame, Format)`, in the daemon's own
//! memory.
//!
//! The shared session table is a view the daemon publishes from this; the daemon never reads a
//! location back from shared memory. Blocks are allocated for every layer at once (`Extend`), so
//! `allocated_blocks` is the same for all layers and blocks `0..allocated_blocks` all have frames.

use kvmm_kernels::Format;

use crate::pool::Frame;

/// Where a page lives and how it is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Page {
    /// Its frame.
    pub frame: Frame,
    /// Its format (f16/bf16 when written; lower after recompression, never higher again).
    pub format: Format,
}

/// The page table of one session.
#[derive(Debug)]
pub struct PageTable {
    layers: u32,
    blocks_per_layer: u32,
    /// Blocks allocated in every layer.
    allocated_blocks: u32,
    /// `pages[layer * blocks_per_layer + block]`; `Some` exactly for blocks below `allocated_blocks`.
    pages: Vec<Option<Page>>,
}

impl PageTable {
    /// An empty table for `layers × blocks_per_layer` pages.
    pub fn new(layers: u32, blocks_per_layer: u32) -> Self {
        PageTable {
            layers,
            blocks_per_layer,
            allocated_blocks: 0,
            pages: vec![None; layers as usize * blocks_per_layer as usize],
        }
    }

    /// Blocks allocated per layer.
    pub fn allocated_blocks(&self) -> u32 {
        self.allocated_blocks
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

    /// The frame of a page, if allocated.
    pub fn frame(&self, layer: u32, block: u32) -> Option<Frame> {
        self.page(layer, block).map(|p| p.frame)
    }

    /// Replaces the frame of an allocated page (a move, same format); returns the old frame.
    pub fn replace(&mut self, layer: u32, block: u32, frame: Frame) -> Option<Frame> {
        let i = self.index(layer, block)?;
        let page = self.pages[i].as_mut()?;
        Some(std::mem::replace(&mut page.frame, frame))
    }

    /// Records that an allocated page now lives in `frame` encoded as `format` (recompression).
    pub fn recompressed(&mut self, layer: u32, block: u32, frame: Frame, format: Format) {
        if let Some(i) = self.index(layer, block)
            && let Some(page) = self.pages[i].as_mut()
        {
            *page = Page { frame, format };
        }
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
                self.pages[idx] = Some(Page { frame: *frame, format });
            }
        }
        self.allocated_blocks += blocks;
    }

    /// Every allocated page with its frame.
    pub fn pages(&self) -> impl Iterator<Item = (u32, u32, Frame)> + '_ {
        (0..self.layers)
            .flat_map(move |l| (0..self.allocated_blocks).filter_map(move |b| self.frame(l, b).map(|f| (l, b, f))))
    }

    /// Removes every frame and returns them (session destruction).
    pub fn take_all(&mut self) -> Vec<Frame> {
        self.allocated_blocks = 0;
        self.pages.iter_mut().filter_map(Option::take).map(|p| p.frame).collect()
    }

    /// Sum of frame footprints.
    pub fn bytes(&self) -> u64 {
        self.pages.iter().flatten().map(|p| p.frame.footprint()).sum()
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
        t.recompressed(1, 2, Frame { offset: 320, len: 32 }, Format::Q8);
        assert_eq!(t.page(1, 2), Some(Page { frame: Frame { offset: 320, len: 32 }, format: Format::Q8 }));
        assert_eq!(t.replace(1, 2, f(384)), Some(Frame { offset: 320, len: 32 }));
        assert_eq!(t.page(1, 2).map(|p| p.format), Some(Format::Q8), "a move keeps the format");
        assert_eq!(t.allocated_blocks(), 3);
        assert_eq!(t.pages().count(), 6);
        assert_eq!(t.take_all().len(), 6);
        assert_eq!(t.bytes(), 0);
    }
}
