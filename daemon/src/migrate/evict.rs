//! Opt-in lossy eviction: a session that attached with `evict` and a quota loses its least-attended
//! pages instead of failing `Extend` when it would go over its quota.
//!
//! Per layer, independently (each layer's attention has its own heavy hitters):
//!
//! ```text
//!  block:  0      1    2    3  ...  n-5  n-4  n-3  n-2  n-1 (tail)
//!          sink | candidates, dropped least mass first    | recent window (last 128 tokens)
//!          kept |  (full pages only; ties: older first)   | kept
//! ```
//!
//! The mass is the importance the client's kernels record per page (an exponential average of the
//! attention mass each page received), so the pages that keep drawing attention (heavy hitters)
//! are the last to go. A page a client has pinned is skipped for this round; the next candidate
//! goes instead. [`drop_order`] is the pure ranking; [`fit_quota`] carries it out through the
//! pin/migrate protocol and frees each dropped page's frame, DRAM slot or flash slot.

use kvmm_store::flash::FlashSlot;
use kvmm_store::tier::Tier;

use crate::daemon::Core;
use crate::error::{Error, Result};
use crate::migrate::tiering::{RECENT_WINDOW_TOKENS, keeps_precision};
use crate::session::page_table::Place;

/// One page of a layer as the ranking sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Its block.
    pub block: u32,
    /// Tokens the client has written into it (clamped to the page size).
    pub tokens: u32,
    /// Its accumulated attention mass (clamped: finite, non-negative).
    pub mass: f32,
}

/// The blocks of one layer that eviction may drop, in the order it drops them: full pages outside
/// the sink page and the recent window of a layer holding `layer_tokens` tokens, least mass first,
/// older first among equals.
pub fn drop_order(candidates: &[Candidate], block_tokens: u32, layer_tokens: u64) -> Vec<u32> {
    let mut eligible: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| {
            c.tokens == block_tokens && !keeps_precision(c.block, block_tokens, layer_tokens, RECENT_WINDOW_TOKENS)
        })
        .collect();
    eligible.sort_by(|a, b| a.mass.total_cmp(&b.mass).then(a.block.cmp(&b.block)));
    eligible.into_iter().map(|c| c.block).collect()
}

/// The smallest quota (in pages per layer) eviction can work under: the sink page, the pages of
/// the recent window, and the page being written.
pub fn min_quota_pages(block_tokens: u32) -> u32 {
    2 + (RECENT_WINDOW_TOKENS as u32).div_ceil(block_tokens)
}

/// Makes room under session `session_id`'s quota for `blocks` more pages in every layer: fails
/// with `RESOURCE_EXHAUSTED` when the session did not opt into eviction, or when not enough pages
/// may be dropped (pages dropped on the way stay dropped: they were over the quota). Returns the
/// pages dropped. The flash slots of the pages dropped go to `flash_slots`, for the caller to punch
/// out once it has released the core lock, even when this fails.
pub fn fit_quota(core: &mut Core, session_id: u64, blocks: u32, flash_slots: &mut Vec<FlashSlot>) -> Result<u64> {
    let Core { pool, sessions, dram, .. } = core;
    let Some(s) = sessions.get_mut_unchecked(session_id) else { return Err(Error::UnknownSession(session_id)) };
    let Some(quota) = s.quota.pages_per_layer else { return Ok(0) };
    let bt = s.geometry.block_tokens;
    let over_quota = |live: u32| Error::OverQuota {
        session: session_id,
        tokens: (u64::from(live) + u64::from(blocks)) * u64::from(bt),
        quota: u64::from(quota) * u64::from(bt),
        evict: s.quota.evict,
    };
    let mut dropped = 0u64;
    let mut result = Ok(());
    for layer in 0..s.geometry.layers {
        let live = s.pages.live_blocks(layer);
        let need = (live + blocks).saturating_sub(quota);
        if need == 0 {
            continue;
        }
        if !s.quota.evict {
            result = Err(over_quota(live));
            break;
        }
        let candidates: Vec<Candidate> = (0..s.pages.allocated_blocks())
            .filter(|&b| s.pages.page(layer, b).is_some())
            .filter_map(|block| {
                let e = s.region.entry(layer, block).ok()?;
                Some(Candidate { block, tokens: e.tokens_clamped(bt), mass: e.importance_clamped() })
            })
            .collect();
        let mut done = 0;
        for block in drop_order(&candidates, bt, s.layer_tokens(layer)) {
            if done == need {
                break;
            }
            let Some(page) = s.pages.page(layer, block) else { continue };
            let entry = s.table.entry_writer(layer, block)?;
            match page.place {
                Place::Device(frame) => {
                    let Ok(ticket) = entry.try_begin_migrate(s.region.entry(layer, block)?) else { continue };
                    entry.finish_drop(ticket);
                    pool.free_frame(s.owner.uid, frame)?;
                }
                Place::Dram(slot) => {
                    entry.mark_dropped();
                    if let Some(dram) = dram.as_mut() {
                        dram.free(slot);
                    }
                }
                Place::Flash(slot) => {
                    entry.mark_dropped();
                    flash_slots.push(slot);
                }
            }
            s.pages.drop_page(layer, block);
            done += 1;
        }
        dropped += u64::from(done);
        if done < need {
            result = Err(Error::NothingToDrop {
                session: session_id,
                quota: u64::from(quota) * u64::from(bt),
                window: RECENT_WINDOW_TOKENS,
            });
            break;
        }
    }
    if dropped > 0 {
        tracing::debug!(session = session_id, dropped, "eviction dropped pages over the quota");
    }
    result.map(|()| dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(block: u32, tokens: u32, mass: f32) -> Candidate {
        Candidate { block, tokens, mass }
    }

    #[test]
    fn the_least_attended_full_pages_go_first_and_the_sink_and_recent_window_never() {
        // 12 pages of 32 tokens, 380 tokens: blocks 0..=10 full, block 11 holds 28. The last 128
        // tokens (252..380) touch blocks 7..=11.
        let mass = [0.0, 0.5, 0.01, 0.3, 0.01, 0.2, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0];
        let pages: Vec<Candidate> =
            mass.iter().enumerate().map(|(b, &m)| page(b as u32, if b == 11 { 28 } else { 32 }, m)).collect();
        assert_eq!(drop_order(&pages, 32, 380), vec![2, 4, 6, 5, 3, 1], "heavy hitters (1, 3) last");
    }

    #[test]
    fn partly_written_pages_and_short_layers_are_never_candidates() {
        // A layer behind the others: its newer pages are not full yet.
        let pages = [page(0, 32, 0.0), page(1, 32, 0.0), page(2, 5, 0.0), page(3, 0, 0.0)];
        assert_eq!(drop_order(&pages, 32, 69), Vec::<u32>::new(), "69 tokens: all inside the window");
        let long: Vec<Candidate> = (0..10).map(|b| page(b, if b == 9 { 0 } else { 32 }, 1.0)).collect();
        assert_eq!(drop_order(&long, 32, 288), vec![1, 2, 3, 4], "equal mass: older first");
    }

    #[test]
    fn the_smallest_quota_holds_the_kept_pages_and_the_one_being_written() {
        assert_eq!(min_quota_pages(32), 6);
        assert_eq!(min_quota_pages(16), 10);
        assert_eq!(min_quota_pages(256), 3);
        // At the smallest quota, a layer whose pages are all full can always make room for one more:
        // the pages it keeps number at most min_quota_pages - 1.
        for bt in [8u32, 16, 32, 64, 128, 256] {
            let q = min_quota_pages(bt);
            let pages: Vec<Candidate> = (0..q).map(|b| page(b, bt, 0.5)).collect();
            let kept = q as usize - drop_order(&pages, bt, u64::from(q * bt)).len();
            assert!(kept < q as usize, "block_tokens {bt}: {kept} of {q} pages kept");
        }
    }
}
