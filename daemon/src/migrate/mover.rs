//! The page-move primitive every migration uses: move one page to another frame while its client may
//! be reading or appending to it.
//!
//! The move goes through the pin/migrate protocol (`kvmm_shm::protocol`): mark the entry MIGRATING,
//! fence, and check the client's pin count; a pinned page is skipped, never waited on. Otherwise the
//! bytes are copied, the new location is published, the generation is bumped (Release), and only
//! then is the old frame zeroed and freed.

use kvmm_shm::{MigrateSkip, PageLocation};

use crate::daemon::Core;
use crate::error::{Error, Result};
use crate::pool::Frame;

/// What happened to a requested move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveOutcome {
    /// The page now lives in the destination frame.
    Moved,
    /// The page was left where it was; the destination frame was returned.
    Skipped(MigrateSkip),
}

/// Moves page `(layer, block)` of `session_id` into `dst`, a frame already allocated from the arena
/// of `uid` (the session's owner) for this purpose. On a skip, `dst` is freed again.
pub fn move_page(
    core: &mut Core,
    uid: u32,
    session_id: u64,
    layer: u32,
    block: u32,
    dst: Frame,
) -> Result<MoveOutcome> {
    let outcome = move_inner(core, uid, session_id, layer, block, dst);
    match outcome {
        Ok(MoveOutcome::Moved) => core.moves += 1,
        Ok(MoveOutcome::Skipped(MigrateSkip::Pinned)) => core.moves_skipped_pinned += 1,
        _ => {}
    }
    outcome
}

fn move_inner(core: &mut Core, uid: u32, session_id: u64, layer: u32, block: u32, dst: Frame) -> Result<MoveOutcome> {
    let Core { pool, sessions, .. } = core;
    let s = match sessions.get_mut_unchecked(session_id) {
        Some(s) if s.owner.uid == uid => s,
        _ => {
            pool.free_frame(uid, dst)?;
            return Ok(MoveOutcome::Skipped(MigrateSkip::NotResident));
        }
    };
    let Some(page) = s.pages.page(layer, block) else {
        pool.free_frame(uid, dst)?;
        return Ok(MoveOutcome::Skipped(MigrateSkip::NotResident));
    };
    let Some(src) = page.frame() else {
        pool.free_frame(uid, dst)?;
        return Ok(MoveOutcome::Skipped(MigrateSkip::NotResident));
    };
    if src.len != dst.len {
        // The page changed size since the caller sized `dst` (it was recompressed): try again later.
        pool.free_frame(uid, dst)?;
        return Ok(MoveOutcome::Skipped(MigrateSkip::NotResident));
    }
    // Everything fallible is looked up before the page is marked MIGRATING, so a failure cannot leave
    // it marked; from `try_begin_migrate` on, every path finishes or aborts the migration.
    let entry = s.table.entry_writer(layer, block)?;
    let client = s.region.entry(layer, block)?;
    let arena = pool.arena(uid).ok_or_else(|| Error::FailedPrecondition(format!("uid {uid} has no arena")))?;
    let ticket = match entry.try_begin_migrate(client) {
        Ok(t) => t,
        Err(skip) => {
            pool.free_frame(uid, dst)?;
            return Ok(MoveOutcome::Skipped(skip));
        }
    };
    if let Err(e) = arena.copy(src, dst) {
        entry.abort_migrate(ticket);
        pool.free_frame(uid, dst)?;
        return Err(e);
    }
    entry.finish_migrate(
        ticket,
        PageLocation {
            offset: dst.offset,
            len: dst.len as u32,
            format: page.format.as_u8(),
            tier: PageLocation::TIER_DEVICE,
        },
    );
    s.pages.replace(layer, block, crate::session::page_table::Place::Device(dst));
    s.counters.moves += 1;
    pool.free_frame(uid, src)?;
    Ok(MoveOutcome::Moved)
}
