//! Arena compaction: a pure planner that moves the highest frames into the lowest holes, and the pass
//! that carries a plan out with the move primitive.
//!
//! Compaction keeps each arena's used frames dense at the bottom, so the populated part of the memfd
//! stays close to what sessions own (and, later, the top can be punched out under memory pressure).
//! It is also the daemon's steady driver of page moves, exercising the pin/migrate protocol in
//! production rather than only in tests.

use parking_lot::MutexGuard;

use super::LockPacer;
use super::mover::{MoveOutcome, move_page};
use crate::daemon::Core;
use crate::error::Result;
use kvmm_store::extent::ExtentAllocator;

/// A page and where it lives now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlacedPage {
    /// Owning session.
    pub session: u64,
    /// Layer.
    pub layer: u32,
    /// Block.
    pub block: u32,
    /// Current arena offset.
    pub offset: u64,
    /// Page bytes.
    pub len: u64,
}

/// One planned move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedMove {
    /// The page.
    pub page: PlacedPage,
    /// Its destination offset.
    pub to: u64,
}

/// Plans up to `max_moves` moves of the highest pages into the lowest holes that fit entirely below
/// them. Pure: `pages` and `holes` (offset, length) describe one arena; nothing is touched.
pub fn plan(pages: &[PlacedPage], holes: &[(u64, u64)], max_moves: usize) -> Vec<PlannedMove> {
    let mut holes: Vec<(u64, u64)> = holes.to_vec();
    holes.sort_unstable();
    let mut by_height: Vec<PlacedPage> = pages.to_vec();
    by_height.sort_unstable_by_key(|p| std::cmp::Reverse(p.offset));
    let mut moves = Vec::new();
    for page in by_height {
        if moves.len() >= max_moves {
            break;
        }
        let need = ExtentAllocator::frame_len(page.len);
        let Some(i) = holes.iter().position(|&(o, l)| l >= need && o + need <= page.offset) else { continue };
        let (o, l) = holes[i];
        moves.push(PlannedMove { page, to: o });
        if l == need {
            holes.remove(i);
        } else {
            holes[i] = (o + need, l - need);
        }
    }
    moves
}

/// Result of one compaction pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Pages moved.
    pub moved: u64,
    /// Pages skipped (pinned, or gone).
    pub skipped: u64,
}

/// Runs one compaction pass over every arena, at most `max_moves` moves per arena. The core lock is
/// handed to waiting requests between moves ([`LockPacer`]), so a move whose page has gone, shrunk
/// or already sits at or below its planned place meanwhile is skipped.
pub fn run_pass(core: &mut MutexGuard<'_, Core>, max_moves: usize) -> Result<PassReport> {
    let mut pacer = LockPacer::start();
    let mut report = PassReport::default();
    let uids: Vec<u32> =
        core.pool.arenas().filter(|(_, a)| a.frames().holes_below_high_water() > 0).map(|(u, _)| u).collect();
    for uid in uids {
        let pages: Vec<PlacedPage> = core
            .sessions
            .iter()
            .filter(|s| s.owner.uid == uid)
            .flat_map(|s| {
                s.pages.pages().map(move |(layer, block, f)| PlacedPage {
                    session: s.id,
                    layer,
                    block,
                    offset: f.offset,
                    len: f.len,
                })
            })
            .collect();
        let Some(arena) = core.pool.arena(uid) else { continue };
        let holes: Vec<(u64, u64)> = arena.frames().free_extents().collect();
        for m in plan(&pages, &holes, max_moves) {
            pacer.between_pages(core);
            let here =
                core.sessions.get_unchecked(m.page.session).and_then(|s| s.pages.page(m.page.layer, m.page.block));
            if here.and_then(|p| p.frame()).is_none_or(|f| f.offset <= m.to) {
                report.skipped += 1;
                continue;
            }
            let Some(dst) = core.pool.alloc_move_target(uid, m.page.len, Some(m.to))? else {
                report.skipped += 1;
                continue;
            };
            match move_page(core, uid, m.page.session, m.page.layer, m.page.block, dst)? {
                MoveOutcome::Moved => report.moved += 1,
                MoveOutcome::Skipped(_) => report.skipped += 1,
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(offset: u64) -> PlacedPage {
        PlacedPage { session: 1, layer: 0, block: (offset / 64) as u32, offset, len: 64 }
    }

    #[test]
    fn the_highest_pages_fill_the_lowest_holes() {
        let pages = [page(64), page(256), page(320)];
        let holes = [(0, 64), (128, 128), (384, 640)];
        let m = plan(&pages, &holes, 10);
        assert_eq!(m, vec![PlannedMove { page: page(320), to: 0 }, PlannedMove { page: page(256), to: 128 }]);
    }

    #[test]
    fn pages_never_move_upwards_and_the_limit_holds() {
        let pages = [page(0), page(64)];
        let holes = [(128, 1024)];
        assert!(plan(&pages, &holes, 10).is_empty());
        let pages = [page(512), page(576)];
        let holes = [(0, 512)];
        assert_eq!(plan(&pages, &holes, 1).len(), 1);
    }

    #[test]
    fn a_page_only_takes_a_hole_it_fits() {
        let big = PlacedPage { len: 200, ..page(1024) };
        let holes = [(0, 128), (256, 256)];
        assert_eq!(plan(&[big], &holes, 10), vec![PlannedMove { page: big, to: 256 }]);
    }
}
