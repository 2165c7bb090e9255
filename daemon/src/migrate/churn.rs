//! The move-churn driver: moves randomly chosen pages to fresh frames, continuously, so tests can
//! prove that clients never see a torn page while the daemon moves their pages (`--debug-move-churn`).
//! It uses the same primitive as compaction; only the choice of pages differs.

use super::mover::move_page;
use crate::daemon::Core;
use crate::error::Result;

/// A small xorshift generator: the choice only needs to be spread out, not unpredictable.
#[derive(Debug)]
pub struct Picker(u64);

impl Picker {
    /// A picker seeded from the clock.
    pub fn new(seed: u64) -> Self {
        Picker(seed | 1)
    }

    fn next(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        if bound == 0 { 0 } else { self.0 % bound }
    }
}

/// Tries `count` random moves; returns how many moved.
pub fn churn(core: &mut Core, picker: &mut Picker, count: usize) -> Result<u64> {
    let ids = core.sessions.ids();
    let mut moved = 0;
    for _ in 0..count {
        if ids.is_empty() {
            break;
        }
        let id = ids[picker.next(ids.len() as u64) as usize];
        let Some(s) = core.sessions.get_mut_unchecked(id) else { continue };
        let blocks = s.pages.allocated_blocks();
        if blocks == 0 {
            continue;
        }
        let layer = picker.next(u64::from(s.geometry.layers)) as u32;
        let block = picker.next(u64::from(blocks)) as u32;
        // The page's own frame size: recompressed pages are smaller than the geometry's pages.
        let Some(frame) = s.pages.frame(layer, block) else { continue };
        let (uid, len) = (s.owner.uid, frame.len);
        let Some(dst) = core.pool.alloc_move_target(uid, len, None)? else { continue };
        if move_page(core, uid, id, layer, block, dst)? == super::mover::MoveOutcome::Moved {
            moved += 1;
        }
    }
    Ok(moved)
}
