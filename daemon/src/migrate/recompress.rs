//! Recompression in place: re-encode a session's full pages into a smaller format while its client
//! keeps running, through the pin/migrate protocol.
//!
//! Under MIGRATING no client can pin the page, so the daemon reads the page out, quantizes it, writes
//! the smaller encoding back at the same offset, publishes the new length and format with the
//! generation bump, and returns the frame's tail to the allocator. No second frame is needed, so a
//! full budget can still be relieved by compression. Lossy formats are one-way (f16 → q8 → q4 → q2);
//! a page already at or below the target is left alone, and the tail page a client is still writing
//! (fewer than `block_tokens` tokens published) stays in its element type.
//!
//! The target is the request's format for every page, or under adaptive precision each page's own:
//! the allocation a demotion at that format would give it ([`LayerPlan`]: the sink page and the
//! recent window keep their format, the other full pages are ranked by age or attention mass and
//! spread over the formats around the requested one at its uniform bytes). Each layer's floor
//! holds either way.

use std::ops::Range;

use kvmm_kernels::Format;
use kvmm_shm::PageLocation;
use parking_lot::MutexGuard;

use crate::daemon::Core;
use crate::error::{Error, Result};
use crate::migrate::LockPacer;
use crate::migrate::tiering::{LayerPlan, Scratch};
use crate::policy::precision::{self, Demotion};

/// What one recompression request did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecompressReport {
    /// Pages re-encoded.
    pub compressed: u32,
    /// Pages skipped because the client held a pin.
    pub skipped_pinned: u32,
    /// Pages skipped because the client is still filling them.
    pub skipped_not_full: u32,
    /// Pages skipped because they are already at or below the target format.
    pub skipped_already: u32,
    /// Pages left as they were because their layer's `[[policy.floor]]` is at or above their format
    /// (where a layer's floor lies between a page's format and the target, the page goes down to the
    /// floor only, and counts as compressed).
    pub skipped_floor: u32,
    /// Pages skipped because they are not in the device tier (demoted pages keep their format).
    pub skipped_not_resident: u32,
    /// Pages skipped because their bytes could not be encoded (e.g. NaN written by the client).
    pub skipped_invalid: u32,
    /// Under adaptive precision: pages left as they were because they are the sink page or in the
    /// recent window.
    pub skipped_window: u32,
    /// The compressed pages by their new format: (format, pages, frame bytes after), in the order
    /// the formats first came up.
    pub compressed_to: Vec<(Format, u32, u64)>,
    /// Frame bytes of the compressed pages before.
    pub bytes_before: u64,
    /// Frame bytes of the compressed pages after.
    pub bytes_after: u64,
}

/// Precision rank (key plus value bits): a page may only move to a lower rank.
fn rank(format: Format) -> u32 {
    format.k_bits() + format.v_bits()
}

/// Re-encodes the full pages of `layers × blocks` of a session as `how.format`, or as the layer's
/// floor in `how.floors` where that is more precise (a 16-bit floor keeps every page of its layer as
/// it is). With `how.adaptive`, each page takes its layer's allocation around that format instead
/// (module doc), and the ranking is `how.ranking`.
///
/// The core lock is handed to waiting requests between pages ([`LockPacer`]): a page's migration
/// begins and ends under the lock, so other clients wait for about 100 µs and one page, not for the
/// whole request. A session that ends meanwhile ends the request with [`Error::UnknownSession`].
pub fn recompress(
    core: &mut MutexGuard<'_, Core>,
    session_id: u64,
    layers: Range<u32>,
    blocks: Range<u32>,
    how: &Demotion,
    scratch: &mut Scratch,
) -> Result<RecompressReport> {
    let to = match how.format {
        Some(to) if to.is_quantized() => to,
        other => {
            return Err(Error::InvalidArgument(format!(
                "{} is not a compressed format; recompress to q8, k8v4, q4 or q2",
                other.map_or("lossless", Format::name)
            )));
        }
    };
    let s = core.sessions.get_unchecked(session_id).ok_or(Error::UnknownSession(session_id))?;
    let g = s.geometry;
    if layers.is_empty() || layers.end > g.layers {
        return Err(Error::InvalidArgument(format!(
            "layers {}..{} are out of range: session {session_id} has layers 0..{}",
            layers.start, layers.end, g.layers
        )));
    }
    let allocated = s.pages.allocated_blocks();
    if blocks.is_empty() || blocks.end > allocated {
        return Err(Error::InvalidArgument(format!(
            "blocks {}..{} are out of range: session {session_id} has blocks 0..{allocated} allocated",
            blocks.start, blocks.end
        )));
    }
    let mut report = RecompressReport::default();
    let mut pacer = LockPacer::start();
    for layer in layers {
        let floor = how.floors.of(layer, g.layers);
        let plan = if how.ranks_pages() {
            let s = core.sessions.get_unchecked(session_id).ok_or(Error::UnknownSession(session_id))?;
            Some(LayerPlan::of(s, layer, how))
        } else {
            None
        };
        for block in blocks.clone() {
            let page = PageAt { session_id, layer, block, to, floor, plan: plan.as_ref(), by_age: how.by_age() };
            recompress_page(core, page, scratch, &mut report)?;
            pacer.between_pages(core);
        }
    }
    Ok(report)
}

/// One page of a [`recompress`] request.
#[derive(Clone, Copy)]
struct PageAt<'a> {
    session_id: u64,
    layer: u32,
    block: u32,
    /// The request's format.
    to: Format,
    /// The layer's floor.
    floor: Option<Format>,
    /// Under adaptive precision, the layer's allocation.
    plan: Option<&'a LayerPlan>,
    /// Adaptive precision ranks by age: a quantized page steps down to its allocation.
    by_age: bool,
}

/// Re-encodes one page if it is full, resident, unpinned and above the target, and counts what
/// happened in `report`.
fn recompress_page(core: &mut Core, at: PageAt, scratch: &mut Scratch, report: &mut RecompressReport) -> Result<()> {
    let PageAt { session_id, layer, block, to, floor, plan, by_age } = at;
    let Core { pool, sessions, .. } = core;
    let s = sessions.get_mut_unchecked(session_id).ok_or(Error::UnknownSession(session_id))?;
    let g = s.geometry;
    let shape = g.page_shape();
    let uid = s.owner.uid;
    let Some(page) = s.pages.page(layer, block) else { return Ok(()) };
    let Some(frame) = page.frame() else {
        report.skipped_not_resident += 1;
        return Ok(());
    };
    let tokens = s.region.entry(layer, block)?.tokens_clamped(g.block_tokens);
    let to = match plan {
        None => to,
        Some(_) if tokens < g.block_tokens => {
            report.skipped_not_full += 1;
            return Ok(());
        }
        Some(plan) if !plan.candidate(block, tokens, g.block_tokens) => {
            report.skipped_window += 1;
            return Ok(());
        }
        // The allocation without the floor, which is applied below for both kinds of request.
        Some(plan) => precision::target_format(page.format, true, plan.allocated(block), Some(to), None, by_age),
    };
    if rank(page.format) <= rank(to) {
        report.skipped_already += 1;
        return Ok(());
    }
    if tokens < g.block_tokens {
        report.skipped_not_full += 1;
        return Ok(());
    }
    // Above `to` (checked above), so a target that is not below the page is the floor's doing.
    let to = precision::raise(to, floor, page.format);
    if rank(page.format) <= rank(to) {
        report.skipped_floor += 1;
        return Ok(());
    }
    let new_len = shape.page_bytes(to) as u64;
    // Everything fallible that does not depend on the page's bytes is looked up before the page is
    // marked MIGRATING; from `try_begin_migrate` on, every path finishes or aborts.
    let entry = s.table.entry_writer(layer, block)?;
    let client = s.region.entry(layer, block)?;
    let arena = pool.arena(uid).ok_or_else(|| Error::FailedPrecondition(format!("uid {uid} has no arena")))?;
    let Ok(ticket) = entry.try_begin_migrate(client) else {
        report.skipped_pinned += 1;
        return Ok(());
    };
    if client.tokens_clamped(g.block_tokens) != tokens {
        // Written between the look above and the claim, which makes the count stable now (the
        // client writes it under a pin). `Session::truncate` lowers it in place, so a page judged
        // full may be the client's tail again: left as it is.
        entry.abort_migrate(ticket);
        report.skipped_not_full += 1;
        return Ok(());
    }
    let Scratch { src, dst } = scratch;
    src.resize(frame.len as usize, 0);
    dst.resize(new_len as usize, 0);
    let encoded = arena.mapping().read_at(frame.offset as usize, src).map_err(Error::from).and_then(|()| {
        kvmm_kernels::requantize(shape, g.format(), page.format, src, tokens as usize, to, dst).map_err(Error::from)
    });
    match encoded {
        Ok(()) => {}
        Err(Error::Kernel(e)) => {
            entry.abort_migrate(ticket);
            tracing::debug!(session = session_id, layer, block, error = %e, "page not recompressed");
            report.skipped_invalid += 1;
            return Ok(());
        }
        Err(e) => {
            entry.abort_migrate(ticket);
            return Err(e);
        }
    }
    if let Err(e) = arena.mapping().write_at(frame.offset as usize, dst) {
        // `write_at` checks its range before writing a byte, so the old page is intact.
        entry.abort_migrate(ticket);
        return Err(e.into());
    }
    entry.finish_migrate(
        ticket,
        PageLocation { offset: frame.offset, len: new_len as u32, format: to.as_u8(), tier: PageLocation::TIER_DEVICE },
    );
    let shrunk = pool.shrink_frame(uid, frame, new_len)?;
    s.pages.set(layer, block, crate::session::page_table::Place::Device(shrunk), to);
    report.compressed += 1;
    report.bytes_before += frame.footprint();
    report.bytes_after += shrunk.footprint();
    match report.compressed_to.iter_mut().find(|(f, ..)| *f == to) {
        Some((_, pages, bytes)) => {
            *pages += 1;
            *bytes += shrunk.footprint();
        }
        None => report.compressed_to.push((to, 1, shrunk.footprint())),
    }
    Ok(())
}
