//! Moving pages between tiers: demotion (device → DRAM → flash) and promotion (faults), each step
//! through the pin/migrate protocol so clients keep running.
//!
//! - **Device → DRAM** ([`demote_to_dram`]): claim the page (a pinned page is skipped), read its
//!   frame, encode a full 16-bit page in the format the [`Demotion`] gives it (the mode's format,
//!   q8 by default, per page by age or attention mass with adaptive precision, never below its
//!   layer's floor; `None` keeps it bit-exact; see [`crate::policy::precision`]), store it in the
//!   pool (sealed when configured), publish it evicted (`ALLOCATED` without `RESIDENT`, so clients
//!   fault it back), free the frame. Under adaptive precision by age, planning a layer also steps
//!   its DRAM pages down to their allocation ([`step_down_in_dram`]).
//! - **DRAM → flash**, in three phases so flash I/O never runs under the core lock:
//!   [`take_from_dram`] copies the pages out of the pool (core lock), [`write_to_flash`] seals and
//!   writes them (flash lock only), [`commit_to_flash`] switches every page that is still where it
//!   was to its flash slot and frees the DRAM slot (core lock); a page promoted or destroyed in
//!   between keeps its new state and its flash slot is returned (flash lock, after the core lock).
//!   From take to commit the pages are in `Core::outbound`: another move to flash running meanwhile
//!   (the flash drain and a request making room) neither picks nor takes them.
//! - **Promotion**: DRAM pages are copied into a fresh frame under the core lock
//!   ([`promote_from_dram`]); flash pages get their frame under the core lock ([`prepare_flash_reads`]),
//!   are read and authenticated under the flash lock alone ([`read_from_flash`]) and published under
//!   the core lock ([`commit_flash_reads`]). A page is published resident only with bytes that
//!   passed authentication; a tag failure frees the frame and reports `DATA_LOSS` for that page.
//! - **Room** ([`make_room`]): frees device bytes by demoting the coldest pages (and DRAM bytes by
//!   pushing its coldest pages to flash, with the core lock released during the flash I/O), never
//!   touching protected pages.
//!
//! Locks: nothing waits for the flash lock while it holds the core lock, nor for the core lock
//! while it holds the flash lock. A write or a read holds the flash lock for its whole batch (an
//! 8 MiB write seals and writes for milliseconds), so a wait for it under the core lock would stop
//! every client's requests for as long: flash slots given back under the core lock (pages
//! promoted, destroyed, truncated, dropped, or orphaned by a move) are freed or punched out once
//! the core lock is released ([`free_flash_slots`], [`discard_flash_slots`]), and `Status` reads
//! the flash counters through their own handle ([`kvmm_store::flash::FlashStats`]).
//!
//! Victims ([`pick_victims`]): full pages first; for a request that waits on the room ([`Need`])
//! then empty pages (reserved by `Extend`) and last partly written tails, which the client faults
//! back when it writes them; a page promoted in the last [`HOT_AFTER_FAULT`] only when nothing else
//! can go; within each of those, batch sessions first, then background, then foreground, and within
//! a class by the attention mass the client's kernels record (least first), older blocks first.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmm_kernels::Format;
use kvmm_kernels::precision::allocate_graded;
use kvmm_shm::PageLocation;
use kvmm_store::dram::{DramPool, DramSlot};
use kvmm_store::extent::ExtentAllocator;
use kvmm_store::flash::{FlashFile, FlashSlot};
use kvmm_store::pace::CpuShare;
use kvmm_store::seal::SessionKey;
use kvmm_store::tier::{PageId, PageRead, PageWrite, Tier, TierError};
use parking_lot::{Mutex, MutexGuard};
use zeroize::{Zeroize, Zeroizing};

use crate::daemon::Core;
use crate::error::{Error, Result};
use crate::metrics::{FlashOp, Metrics};
use crate::migrate::LockPacer;
use crate::policy::precision::{self, Demotion, Ranking};
use crate::pool::Frame;
use crate::session::page_table::Place;
use crate::session::{Priority, Session};

/// A page promoted this recently is demoted again only when nothing else can go: the client that
/// faulted it is about to pin it.
pub const HOT_AFTER_FAULT: Duration = Duration::from_millis(20);

/// One page of one session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRef {
    pub session: u64,
    pub layer: u32,
    pub block: u32,
}

impl PageRef {
    fn id(self) -> PageId {
        PageId { session: self.session, layer: self.layer, block: self.block }
    }
}

/// Daemon-wide tier traffic, for stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Pages moved device → DRAM, DRAM → flash.
    pub demoted_to_dram: u64,
    pub demoted_to_flash: u64,
    /// Pages promoted from DRAM and from flash.
    pub promoted_from_dram: u64,
    pub promoted_from_flash: u64,
    /// Demotions skipped because a client held a pin.
    pub skipped_pinned: u64,
    /// Pages that failed authentication.
    pub data_loss: u64,
    /// Bytes the tier thread moved down in the background (device frames freed, DRAM bytes sent
    /// to flash), as opposed to moves a client's request made.
    pub background_bytes: u64,
}

/// Device frames handed to flash pages on their way back to the device: allocated by
/// [`prepare_flash_reads`] (core lock), filled and published or freed by [`commit_flash_reads`]
/// (core lock again). In between the read runs without the core lock, so other requests see these
/// frames in the pool's `used` and `frames` but in no page table; admin `Status` reports them, so
/// that `used` = the sessions' page-table bytes + `bytes` holds at every point a request can observe.
/// (Before they were reported, `kvmm-soak` saw 17 frames, 282,176 bytes, that no table named.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reserved {
    /// Frames reserved.
    pub frames: u64,
    /// Their footprint in the device budget.
    pub bytes: u64,
}

impl Reserved {
    /// Counts one more frame.
    pub(crate) fn add(&mut self, frame: Frame) {
        self.frames += 1;
        self.bytes += frame.footprint();
    }

    /// Counts one frame less.
    pub(crate) fn remove(&mut self, frame: Frame) {
        debug_assert!(self.frames > 0 && self.bytes >= frame.footprint(), "a frame released twice: {self:?}");
        self.frames = self.frames.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(frame.footprint());
    }

    /// Both counts together.
    pub fn plus(self, other: Reserved) -> Reserved {
        Reserved { frames: self.frames + other.frames, bytes: self.bytes + other.bytes }
    }
}

/// Reused buffers of demotion, DRAM promotion and recompression: a page as read, and its new
/// encoding. They hold pages in the clear, so they are wiped when dropped, and a long-lived holder
/// (the tier thread) calls [`Scratch::wipe`] after each use.
#[derive(Debug, Default)]
pub struct Scratch {
    pub(super) src: Zeroizing<Vec<u8>>,
    pub(super) dst: Zeroizing<Vec<u8>>,
}

impl Scratch {
    /// Zeroes both buffers (their whole capacity, which is kept for the next use).
    pub fn wipe(&mut self) {
        self.src.zeroize();
        self.dst.zeroize();
    }
}

/// Which tier [`pick_victims`] looks in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VictimTier {
    Device,
    Dram,
}

/// Which pages [`pick_victims`] may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Background draining: full pages only. A tail page is written by its client at every token
    /// and a reserved page soon, so moving them down early only buys a fault back.
    Cold,
    /// A request waits for the room (`Fault`, `Extend`, a spill to flash): when full pages are not
    /// enough, pages nothing was written to yet (the blocks `Extend` reserves ahead) and then
    /// partly written tails. They are demoted at the client's precision and faulted back when
    /// written; without them a device filled with tails and reservations refused every request
    /// while DRAM and flash had room.
    Waiting,
}

/// The coldest pages in `from` whose footprints add up to at least `bytes` (fewer if there are not
/// enough), leaving out `protect`, and pages promoted within [`HOT_AFTER_FAULT`] unless the others
/// are not enough.
pub fn pick_victims(core: &Core, from: VictimTier, bytes: u64, protect: &HashSet<PageRef>, need: Need) -> Vec<PageRef> {
    let cold = pick(core, from, bytes, protect, true, need);
    let total: u64 = cold.iter().filter_map(|r| footprint(core, *r)).sum();
    if total >= bytes { cold } else { pick(core, from, bytes, protect, false, need) }
}

/// How soon a page is taken: full pages first, then (for [`Need::Waiting`]) empty ones, then tails.
fn fill_rank(tokens: u32, block_tokens: u32) -> u8 {
    match tokens {
        t if t >= block_tokens => 0,
        0 => 1,
        _ => 2,
    }
}

fn pick(
    core: &Core,
    from: VictimTier,
    bytes: u64,
    protect: &HashSet<PageRef>,
    spare_hot: bool,
    need: Need,
) -> Vec<PageRef> {
    let now = Instant::now();
    let mut candidates: Vec<(u8, u8, f32, u32, PageRef, u64)> = Vec::new();
    for s in core.sessions.iter() {
        // A session no process holds (orphaned, waiting for a Resume) is the coldest of all.
        let class = match s.priority {
            _ if s.orphaned.is_some() => 0,
            Priority::Batch => 1,
            Priority::Background => 2,
            Priority::Foreground => 3,
        };
        let bt = s.geometry.block_tokens;
        for (layer, block, page) in s.pages.all() {
            let wanted = matches!(
                (from, page.place),
                (VictimTier::Device, Place::Device(_)) | (VictimTier::Dram, Place::Dram(_))
            );
            let r = PageRef { session: s.id, layer, block };
            let taken = from == VictimTier::Dram && core.outbound.contains(&r);
            if !wanted || taken || protect.contains(&r) || (spare_hot && s.hot(layer, block, now)) {
                continue;
            }
            let Ok(client) = s.region.entry(layer, block) else { continue };
            let rank = fill_rank(client.tokens_clamped(bt), bt);
            if rank > 0 && need == Need::Cold {
                continue;
            }
            candidates.push((rank, class, client.importance_clamped(), block, r, page.place.footprint()));
        }
    }
    candidates
        .sort_by(|a, b| (a.0, a.1, a.2, a.3).partial_cmp(&(b.0, b.1, b.2, b.3)).unwrap_or(std::cmp::Ordering::Equal));
    let mut total = 0;
    let mut out = Vec::new();
    for (_, _, _, _, r, footprint) in candidates {
        if total >= bytes {
            break;
        }
        total += footprint;
        out.push(r);
    }
    out
}

/// Tokens at the end of a layer whose pages keep the client's precision when demoted (the recent
/// window the next queries attend to most).
pub const RECENT_WINDOW_TOKENS: u64 = 128;

/// The recent window of adaptive precision ranked by age: shorter, and the bytes its pages below
/// [`RECENT_WINDOW_TOKENS`] save pay for the newest pages past it one step up (measured in the
/// evaluation: a 32-token window beat 64 and 96 on SmolLM2; 0 was worse, the newest page needs
/// its full precision).
pub const AGE_WINDOW_TOKENS: u64 = 32;

/// Whether block `block` of a layer holding `tokens` tokens keeps its precision when demoted: the
/// sink page (block 0, which draws attention from every query) and every page with a token in the
/// last `window` tokens ([`RECENT_WINDOW_TOKENS`], or [`AGE_WINDOW_TOKENS`] under adaptive
/// precision by age).
pub fn keeps_precision(block: u32, block_tokens: u32, tokens: u64, window: u64) -> bool {
    block == 0 || (u64::from(block) + 1) * u64::from(block_tokens) + window > tokens
}

/// The recent window a demotion keeps at the client's precision.
fn window_of(demotion: &Demotion) -> u64 {
    if demotion.by_age() { AGE_WINDOW_TOKENS } else { RECENT_WINDOW_TOKENS }
}

/// What one demotion decided for one layer of one session, once per [`demote_to_dram`] call.
#[derive(Debug)]
pub(crate) struct LayerPlan {
    /// Tokens the client has published in the layer (where the recent window ends).
    written: u64,
    /// The recent window: pages with a token in the layer's last `window` tokens keep their format.
    window: u64,
    /// The format adaptive precision gives each candidate page (full, neither the sink page nor
    /// in the recent window), by block; empty when the demotion does not rank pages.
    allocated: HashMap<u32, Format>,
    /// The layer's floor.
    floor: Option<Format>,
}

impl LayerPlan {
    /// Allocates the layer's candidate pages, wherever they live and in whatever format: by age
    /// (oldest first, the bytes of the full pages the shorter window spares paying for the step
    /// up), or by the attention mass the client recorded (clamped: a client can only misplace its
    /// own pages).
    pub(crate) fn of(s: &Session, layer: u32, demotion: &Demotion) -> LayerPlan {
        let g = s.geometry;
        let bt = g.block_tokens;
        let written = s.layer_tokens(layer);
        let window = window_of(demotion);
        let mut allocated = HashMap::new();
        if let (true, Some(mode)) = (demotion.ranks_pages(), demotion.format) {
            let full: Vec<(u32, f64)> = (0..s.pages.allocated_blocks())
                .filter(|&b| s.pages.page(layer, b).is_some())
                .filter_map(|b| {
                    let client = s.region.entry(layer, b).ok()?;
                    (client.tokens_clamped(bt) == bt).then(|| (b, f64::from(client.importance_clamped())))
                })
                .collect();
            let outside = |w: u64| full.iter().filter(move |&&(b, _)| !keeps_precision(b, bt, written, w));
            let candidates: Vec<(u32, f64)> = outside(window).copied().collect();
            let formats = match demotion.ranking {
                Ranking::Age => {
                    let saved = candidates.len().saturating_sub(outside(RECENT_WINDOW_TOKENS).count());
                    allocate_graded(g.page_shape(), g.format(), mode, candidates.len(), saved)
                }
                Ranking::Mass => {
                    let mass: Vec<f64> = candidates.iter().map(|&(_, m)| m).collect();
                    precision::layer_formats(g.page_shape(), g.format(), mode, &mass)
                }
            };
            allocated = candidates.iter().map(|&(b, _)| b).zip(formats).collect();
        }
        LayerPlan { written, window, allocated, floor: demotion.floors.of(layer, g.layers) }
    }

    /// The format adaptive precision gave candidate block `block` (`None` when it ranks no pages).
    pub(crate) fn allocated(&self, block: u32) -> Option<Format> {
        self.allocated.get(&block).copied()
    }

    /// Whether block `block`, holding `tokens` tokens, is a candidate: full, neither the sink page
    /// nor in the recent window.
    pub(crate) fn candidate(&self, block: u32, tokens: u32, block_tokens: u32) -> bool {
        tokens == block_tokens && !keeps_precision(block, block_tokens, self.written, self.window)
    }
}

/// [`LayerPlan::of`] for `layer` of session `session` (`s`), with the layer's DRAM pages stepped
/// down to it under adaptive precision by age ([`step_down_in_dram`]).
#[allow(clippy::too_many_arguments)]
fn plan_layer(
    s: &mut Session,
    session: u64,
    layer: u32,
    demotion: &Demotion,
    dram: &mut DramPool,
    outbound: &HashSet<PageRef>,
    scratch: &mut Scratch,
) -> LayerPlan {
    let plan = LayerPlan::of(s, layer, demotion);
    if demotion.by_age() {
        let stepped = step_down_in_dram(s, session, layer, &plan, demotion, dram, outbound, scratch);
        if stepped > 0 {
            tracing::debug!(session, layer, stepped, "DRAM pages stepped down");
        }
    }
    plan
}

/// Adaptive precision by age: re-encodes the layer's pages in DRAM whose allocation in `plan` now
/// has fewer bits than their format (a page that aged past the step-up pages), so the layer stays
/// within the mode's bytes. Pages on their way to flash, pages the quantizer refuses and pages
/// the pool has no room for (the new encoding is stored before the old one is freed) stay as they
/// are; pages in flash keep their format ([`move_to_flash`] steps pages down before it seals them).
/// Returns pages re-encoded.
#[allow(clippy::too_many_arguments)]
fn step_down_in_dram(
    s: &mut Session,
    session: u64,
    layer: u32,
    plan: &LayerPlan,
    demotion: &Demotion,
    dram: &mut DramPool,
    outbound: &HashSet<PageRef>,
    scratch: &mut Scratch,
) -> u32 {
    let g = s.geometry;
    let shape = g.page_shape();
    let mut stepped = 0;
    for (&block, &allocated) in &plan.allocated {
        let r = PageRef { session, layer, block };
        let Some(page) = s.pages.page(layer, block) else { continue };
        let Place::Dram(slot) = page.place else { continue };
        let target = precision::target_format(page.format, true, Some(allocated), demotion.format, plan.floor, true);
        if target == page.format || outbound.contains(&r) {
            continue;
        }
        let Scratch { src, dst } = scratch;
        src.resize(slot.len as usize, 0);
        let key = s.key.as_deref();
        if let Err(e) = dram.get(&mut [PageRead { key, page: r.id(), slot, out: src }]).remove(0) {
            tracing::warn!(session, layer, block, error = %e, "a DRAM page could not be read to step it down");
            continue;
        }
        dst.resize(shape.page_bytes(target), 0);
        let bt = g.block_tokens as usize;
        if kvmm_kernels::requantize(shape, g.format(), page.format, src, bt, target, dst).is_err() {
            continue;
        }
        match dram.put(&[PageWrite { key, page: r.id(), bytes: dst }]).remove(0) {
            Ok(new) => {
                dram.free(slot);
                s.pages.set(layer, block, Place::Dram(new), target);
                stepped += 1;
            }
            Err(TierError::Full { .. }) => break,
            Err(e) => tracing::warn!(session, layer, block, error = %e, "a DRAM page could not be stepped down"),
        }
    }
    stepped
}

/// What [`demote_to_dram`] moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Moved {
    pub pages: u32,
    /// The device bytes their frames took.
    pub bytes: u64,
    /// Pages left on the device because a client held a pin.
    pub pinned: u32,
    /// Pages not moved because the DRAM pool had no room (the first such page and every one after).
    pub no_room: u32,
}

/// Moves `pages` from the device to the DRAM pool (module doc), each in the format `demotion`
/// gives it; returns what moved. Stops at the first page the pool has no room for.
///
/// The core lock is handed to waiting requests between pages ([`LockPacer`]): each page's move
/// begins and ends under the lock, so other requests wait for about 100 µs and one page, not for
/// the whole batch (a watermark drain may demote hundreds of megabytes in one call).
pub fn demote_to_dram(
    core: &mut MutexGuard<'_, Core>,
    demotion: &Demotion,
    pages: &[PageRef],
    scratch: &mut Scratch,
) -> Result<Moved> {
    let mut moved = Moved::default();
    let mut plans: HashMap<(u64, u32), LayerPlan> = HashMap::new();
    let mut pacer = LockPacer::start();
    for (i, &r) in pages.iter().enumerate() {
        match demote_page(core, demotion, r, &mut plans, scratch)? {
            Demoted::Moved(bytes) => {
                moved.pages += 1;
                moved.bytes += bytes;
            }
            Demoted::Skipped => {}
            Demoted::Pinned => moved.pinned += 1,
            Demoted::NoRoom => {
                moved.no_room = (pages.len() - i) as u32;
                break;
            }
        }
        pacer.between_pages(core);
    }
    Ok(moved)
}

/// What [`demote_page`] did with one page.
enum Demoted {
    /// With the device bytes its frame took.
    Moved(u64),
    /// Not on the device any more.
    Skipped,
    /// A client held a pin.
    Pinned,
    /// The DRAM pool is full (or absent): the page stays.
    NoRoom,
}

/// One page of [`demote_to_dram`]; `plans` caches each layer's plan across the call's pages.
fn demote_page(
    core: &mut Core,
    demotion: &Demotion,
    r: PageRef,
    plans: &mut HashMap<(u64, u32), LayerPlan>,
    scratch: &mut Scratch,
) -> Result<Demoted> {
    let Core { pool, sessions, dram, tier_counters, metrics, outbound, .. } = core;
    let Some(dram) = dram.as_mut() else { return Ok(Demoted::NoRoom) };
    let Some(s) = sessions.get_mut_unchecked(r.session) else { return Ok(Demoted::Skipped) };
    let Some(page) = s.pages.page(r.layer, r.block) else { return Ok(Demoted::Skipped) };
    let Some(frame) = page.frame() else { return Ok(Demoted::Skipped) };
    let plan = match plans.entry((r.session, r.layer)) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => e.insert(plan_layer(s, r.session, r.layer, demotion, dram, outbound, scratch)),
    };
    let g = s.geometry;
    let shape = g.page_shape();
    let tokens = s.region.entry(r.layer, r.block)?.tokens_clamped(g.block_tokens);
    let candidate = plan.candidate(r.block, tokens, g.block_tokens);
    let allocated = plan.allocated(r.block);
    let target =
        precision::target_format(page.format, candidate, allocated, demotion.format, plan.floor, demotion.by_age());
    let entry = s.table.entry_writer(r.layer, r.block)?;
    let client = s.region.entry(r.layer, r.block)?;
    let uid = s.owner.uid;
    let arena = pool.arena(uid).ok_or_else(|| Error::FailedPrecondition(format!("uid {uid} has no arena")))?;
    let Ok(ticket) = entry.try_begin_migrate(client) else {
        tier_counters.skipped_pinned += 1;
        return Ok(Demoted::Pinned);
    };
    // From here every path finishes or aborts the migration.
    if client.tokens_clamped(g.block_tokens) != tokens {
        // Written between the look above and the claim (under a pin, so the claim makes the count
        // stable now). Appends only raise it, but `Session::truncate` lowers it in place: a page
        // planned as full may now be the client's tail. Left for the next pass.
        entry.abort_migrate(ticket);
        return Ok(Demoted::Skipped);
    }
    let Scratch { src, dst } = scratch;
    src.resize(frame.len as usize, 0);
    if let Err(e) = arena.mapping().read_at(frame.offset as usize, src) {
        entry.abort_migrate(ticket);
        return Err(e.into());
    }
    let (bytes, format): (&[u8], Format) = if target == page.format {
        (src, page.format)
    } else {
        dst.resize(shape.page_bytes(target), 0);
        match kvmm_kernels::requantize(shape, g.format(), page.format, src, tokens as usize, target, dst) {
            Ok(()) => {
                if metrics.sample_quantization() {
                    metrics.observe_quantization(shape, (page.format, &src[..]), (target, &dst[..]), tokens as usize);
                }
                (dst, target)
            }
            // Bytes the quantizer refuses (NaN written by the client) travel as they are.
            Err(_) => (src, page.format),
        }
    };
    let stored = dram.put(&[PageWrite { key: s.key.as_deref(), page: r.id(), bytes }]).remove(0);
    let slot = match stored {
        Ok(slot) => slot,
        Err(TierError::Full { .. }) => {
            entry.abort_migrate(ticket);
            return Ok(Demoted::NoRoom);
        }
        Err(e) => {
            entry.abort_migrate(ticket);
            return Err(e.into());
        }
    };
    crate::failpoint::hit("dram-after-store");
    entry.finish_evict(ticket);
    s.pages.set(r.layer, r.block, Place::Dram(slot), format);
    pool.free_frame(uid, frame)?;
    tier_counters.demoted_to_dram += 1;
    Ok(Demoted::Moved(frame.footprint()))
}

/// A page on its way from DRAM to flash.
#[derive(Debug)]
pub struct Outbound {
    page: PageRef,
    slot: DramSlot,
    /// The page in the clear (wiped when dropped, which [`move_to_flash`] does right after the
    /// write).
    bytes: Zeroizing<Vec<u8>>,
    key: Arc<SessionKey>,
}

/// DRAM → flash, phase 1 (core lock): copies `pages` out of the pool and marks them outbound.
/// Pages whose session has no key (no flash tier was configured at attach) stay where they are,
/// and so do pages another move has taken (already outbound). The lock is handed to waiting
/// requests between pages ([`LockPacer`]; a page taken is outbound, so no other move takes it).
fn take_from_dram(core: &mut MutexGuard<'_, Core>, pages: &[PageRef]) -> Result<Vec<Outbound>> {
    if core.dram.is_none() {
        return Ok(Vec::new());
    }
    let mut out = Vec::with_capacity(pages.len());
    let mut pacer = LockPacer::start();
    for &r in pages {
        let taken = take_page(core, r);
        match taken {
            Ok(Some(o)) => out.push(o),
            Ok(None) => {}
            Err(e) => {
                // Nothing taken goes anywhere: the pages stay in DRAM, free for any move.
                for o in &out {
                    core.outbound.remove(&o.page);
                }
                return Err(e);
            }
        }
        pacer.between_pages(core);
    }
    Ok(out)
}

/// One page of [`take_from_dram`]: its bytes in the clear, or `None` where it stays.
fn take_page(core: &mut Core, r: PageRef) -> Result<Option<Outbound>> {
    let Core { sessions, dram, tier_counters, outbound, .. } = core;
    let Some(dram) = dram.as_mut() else { return Ok(None) };
    if outbound.contains(&r) {
        return Ok(None);
    }
    let Some(s) = sessions.get_unchecked(r.session) else { return Ok(None) };
    let (Some(page), Some(key)) = (s.pages.page(r.layer, r.block), s.key.clone()) else { return Ok(None) };
    let Place::Dram(slot) = page.place else { return Ok(None) };
    let mut bytes = Zeroizing::new(vec![0u8; slot.len as usize]);
    let got = dram.get(&mut [PageRead { key: Some(&key), page: r.id(), slot, out: &mut bytes }]).remove(0);
    match got {
        Ok(()) => {
            outbound.insert(r);
            Ok(Some(Outbound { page: r, slot, bytes, key }))
        }
        Err(e) if e.is_data_loss() => {
            tier_counters.data_loss += 1;
            tracing::error!(session = r.session, layer = r.layer, block = r.block, error = %e, "DRAM page lost");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// DRAM → flash, phase 2 (flash lock only): seals and writes the pages (one timed batch).
fn write_to_flash(flash: &mut FlashFile, out: &[Outbound], metrics: &Metrics) -> Vec<Result<FlashSlot, TierError>> {
    let writes: Vec<PageWrite<'_>> =
        out.iter().map(|o| PageWrite { key: Some(&o.key), page: o.page.id(), bytes: &o.bytes }).collect();
    metrics.time_flash(FlashOp::Write, || flash.put(&writes))
}

/// DRAM → flash, phase 3 (core lock): every page still in the DRAM slot it was taken from now
/// lives in its flash slot; the others' flash slots go to `orphans`, for the caller to free once it
/// has released the core lock. Returns pages moved.
fn commit_to_flash(
    core: &mut Core,
    out: Vec<Outbound>,
    written: Vec<Result<FlashSlot, TierError>>,
    orphans: &mut Vec<FlashSlot>,
) -> u32 {
    let Core { sessions, dram, tier_counters, outbound, .. } = core;
    let mut moved = 0;
    for o in &out {
        outbound.remove(&o.page);
    }
    for (o, w) in out.into_iter().zip(written) {
        let slot = match w {
            Ok(slot) => slot,
            Err(e) => {
                tracing::warn!(session = o.page.session, error = %e, "page stays in DRAM: the flash write failed");
                continue;
            }
        };
        let still = sessions
            .get_mut_unchecked(o.page.session)
            .filter(|s| s.pages.page(o.page.layer, o.page.block).is_some_and(|p| p.place == Place::Dram(o.slot)));
        match (still, dram.as_mut()) {
            (Some(s), Some(dram)) => {
                s.pages.replace(o.page.layer, o.page.block, Place::Flash(slot));
                crate::failpoint::hit("flash-after-index");
                dram.free(o.slot);
                tier_counters.demoted_to_flash += 1;
                moved += 1;
            }
            _ => orphans.push(slot),
        }
    }
    moved
}

/// Returns flash slots whose pages live elsewhere now (their bytes are stale copies; a page whose
/// bytes must go for good is discarded instead). Called without the core lock: the flash lock's
/// holder may be in the middle of a batch's I/O.
pub fn free_flash_slots(flash: &Mutex<FlashFile>, slots: Vec<FlashSlot>) {
    if slots.is_empty() {
        return;
    }
    let mut flash = flash.lock();
    for slot in slots {
        flash.free(slot);
    }
}

/// Frees and punches out flash slots whose pages are gone for good (a destroyed session's, or pages
/// given back). Called without the core lock: the flash lock's holder may be in the middle of a
/// batch's I/O.
pub fn discard_flash_slots(flash: Option<&Mutex<FlashFile>>, session: u64, slots: Vec<FlashSlot>) {
    let (Some(flash), false) = (flash, slots.is_empty()) else { return };
    let mut flash = flash.lock();
    for slot in slots {
        if let Err(e) = flash.discard(slot) {
            tracing::warn!(session, error = %e, "a flash slot was freed but its blocks could not be punched out");
        }
    }
}

/// Promotes one DRAM page into a fresh frame (core lock); the caller made room. Returns whether the
/// page is resident now (false: no frame was available).
pub fn promote_from_dram(core: &mut Core, r: PageRef, scratch: &mut Scratch) -> Result<bool> {
    let Core { pool, sessions, dram, tier_counters, .. } = core;
    let (Some(s), Some(dram)) = (sessions.get_mut_unchecked(r.session), dram.as_mut()) else { return Ok(false) };
    let Some(page) = s.pages.page(r.layer, r.block) else { return Ok(false) };
    let Place::Dram(slot) = page.place else { return Ok(matches!(page.place, Place::Device(_))) };
    let uid = s.owner.uid;
    let Some(frame) = pool.alloc_frames(uid, u64::from(slot.len), 1).ok().and_then(|mut f| f.pop()) else {
        return Ok(false);
    };
    scratch.src.resize(slot.len as usize, 0);
    let got = dram.get(&mut [PageRead { key: s.key.as_deref(), page: r.id(), slot, out: &mut scratch.src }]).remove(0);
    if let Err(e) = got {
        pool.free_frame(uid, frame)?;
        if e.is_data_loss() {
            tier_counters.data_loss += 1;
        }
        return Err(e.into());
    }
    publish(pool, s, r, frame, page.format, &scratch.src)?;
    dram.free(slot);
    tier_counters.promoted_from_dram += 1;
    s.counters.promoted_from_dram += 1;
    Ok(true)
}

/// Writes `bytes` into `frame` and publishes the page resident there.
fn publish(
    pool: &crate::pool::Pool,
    s: &mut Session,
    r: PageRef,
    frame: Frame,
    format: Format,
    bytes: &[u8],
) -> Result<()> {
    let uid = s.owner.uid;
    let arena = pool.arena(uid).ok_or_else(|| Error::FailedPrecondition(format!("uid {uid} has no arena")))?;
    arena.mapping().write_at(frame.offset as usize, bytes)?;
    s.table.entry_writer(r.layer, r.block)?.publish_new(PageLocation {
        offset: frame.offset,
        len: frame.len as u32,
        format: format.as_u8(),
        tier: PageLocation::TIER_DEVICE,
    });
    s.pages.replace(r.layer, r.block, Place::Device(frame));
    s.mark_hot(r.layer, r.block);
    Ok(())
}

/// A flash page on its way back to the device.
#[derive(Debug)]
pub struct Inbound {
    page: PageRef,
    slot: FlashSlot,
    frame: Frame,
    uid: u32,
    key: Arc<SessionKey>,
    /// The page in the clear once read (wiped when dropped).
    bytes: Zeroizing<Vec<u8>>,
}

/// Flash → device, phase 1 (core lock): a frame for each flash page of `pages` (the caller made
/// room), counted in `core.reserved` until [`commit_flash_reads`]; pages without a frame are left
/// out.
pub fn prepare_flash_reads(core: &mut Core, pages: &[PageRef]) -> Vec<Inbound> {
    let Core { pool, sessions, reserved, .. } = core;
    let mut out = Vec::new();
    for &r in pages {
        let Some(s) = sessions.get_unchecked(r.session) else { continue };
        let (Some(page), Some(key)) = (s.pages.page(r.layer, r.block), s.key.clone()) else { continue };
        let Place::Flash(slot) = page.place else { continue };
        let Some(frame) = pool.alloc_frames(s.owner.uid, u64::from(slot.len), 1).ok().and_then(|mut f| f.pop()) else {
            continue;
        };
        reserved.add(frame);
        out.push(Inbound {
            page: r,
            slot,
            frame,
            uid: s.owner.uid,
            key,
            bytes: Zeroizing::new(vec![0u8; slot.len as usize]),
        });
    }
    out
}

/// Flash → device, phase 2 (flash lock only): reads and authenticates the pages (one timed batch).
pub fn read_from_flash(
    flash: &mut FlashFile,
    inbound: &mut [Inbound],
    metrics: &Metrics,
) -> Vec<Result<(), TierError>> {
    let mut reads: Vec<PageRead<'_, FlashSlot>> = inbound
        .iter_mut()
        .map(|i| PageRead { key: Some(&*i.key), page: i.page.id(), slot: i.slot, out: &mut i.bytes })
        .collect();
    metrics.time_flash(FlashOp::Read, || flash.get(&mut reads))
}

/// Flash → device, phase 3 (core lock): publishes every page read intact that is still in the slot
/// it was read from; frees the frames of the others. The flash slots of the pages published go to
/// `freed`, for the caller to free once it has released the core lock ([`free_flash_slots`]), even
/// when this fails. Returns the pages that failed authentication.
pub fn commit_flash_reads(
    core: &mut Core,
    inbound: Vec<Inbound>,
    read: Vec<Result<(), TierError>>,
    freed: &mut Vec<FlashSlot>,
) -> Result<Vec<(PageRef, TierError)>> {
    let Core { pool, sessions, tier_counters, reserved, .. } = core;
    let mut lost = Vec::new();
    let mut failed: Option<TierError> = None;
    // Every frame is published or freed below, all under this one hold of the core lock.
    for i in &inbound {
        reserved.remove(i.frame);
    }
    for (i, result) in inbound.into_iter().zip(read) {
        let still = sessions
            .get_mut_unchecked(i.page.session)
            .filter(|s| s.pages.page(i.page.layer, i.page.block).is_some_and(|p| p.place == Place::Flash(i.slot)));
        match (still, result) {
            (Some(s), Ok(())) => {
                let format = s.pages.page(i.page.layer, i.page.block).map(|p| p.format).unwrap_or(Format::F16);
                publish(pool, s, i.page, i.frame, format, &i.bytes)?;
                freed.push(i.slot);
                tier_counters.promoted_from_flash += 1;
                s.counters.promoted_from_flash += 1;
            }
            (still, Err(e)) => {
                pool.free_frame(i.uid, i.frame)?;
                if e.is_data_loss() && still.is_some() {
                    tier_counters.data_loss += 1;
                    lost.push((i.page, e));
                } else if still.is_some() && failed.is_none() {
                    // Reported after every other page of the batch is settled (frames freed or
                    // published): an early return here would leak their frames.
                    failed = Some(e);
                }
            }
            (None, Ok(())) => pool.free_frame(i.uid, i.frame)?,
        }
    }
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(lost),
    }
}

/// What [`make_room`] must make fit: `count` frames of `frame_len` bytes in the arena of `uid`, or
/// (`uid` `None`) just that many bytes of the device budget.
#[derive(Clone, Copy, Debug)]
pub struct Room {
    pub uid: Option<u32>,
    pub frame_len: u64,
    pub count: u64,
}

impl Room {
    /// Bytes of budget the frames take.
    fn bytes(&self) -> u64 {
        ExtentAllocator::frame_len(self.frame_len).saturating_mul(self.count)
    }

    fn fits(&self, core: &Core) -> bool {
        match self.uid {
            Some(uid) => core.pool.fits(uid, self.frame_len, self.count),
            None => core.pool.budget().saturating_sub(core.pool.used()) >= self.bytes(),
        }
    }
}

/// When every DRAM page [`make_room`] could push to flash is already on its way there (another
/// move's), it looks again every [`OUTBOUND_POLL`], the core lock released, until that move
/// commits; after [`OUTBOUND_PATIENCE`] without a commit it gives up.
const OUTBOUND_POLL: Duration = Duration::from_millis(2);
/// See [`OUTBOUND_POLL`]: about as long as a watermark band of a large DRAM pool takes to write to
/// slow flash.
const OUTBOUND_PATIENCE: Duration = Duration::from_secs(2);

/// Demotes the coldest unprotected pages until `room` fits: to DRAM, and when DRAM is full its
/// coldest pages to flash first. When the budget has the bytes but the arena's free space is cut
/// into holes too small for the frames (pages of mixed formats), pages of that arena are demoted
/// until holes join. Returns whether `room` fits now.
///
/// The core lock is released while pages are sealed and written to flash ([`move_to_flash`]), so
/// other clients are served meanwhile and anything may have changed when this returns: the caller
/// checks again what it checked before (its session may even be gone).
pub fn make_room(
    core: &mut MutexGuard<'_, Core>,
    flash: Option<&Mutex<FlashFile>>,
    demotion: &Demotion,
    room: Room,
    protect: &HashSet<PageRef>,
    scratch: &mut Scratch,
) -> Result<bool> {
    for _ in 0..16 {
        if room.fits(core) {
            return Ok(true);
        }
        let free = core.pool.budget().saturating_sub(core.pool.used());
        let need = room.bytes();
        // Short of budget: any session's pages help. Short of a hole: only the arena's own do.
        let (bytes, only) = if free < need { (need - free, None) } else { (need, room.uid) };
        let victims: Vec<PageRef> = pick_victims(core, VictimTier::Device, bytes, protect, Need::Waiting)
            .into_iter()
            .filter(|r| {
                only.is_none_or(|uid| core.sessions.get_unchecked(r.session).is_some_and(|s| s.owner.uid == uid))
            })
            .collect();
        if victims.is_empty() {
            return Ok(false);
        }
        let moved = demote_to_dram(core, demotion, &victims, scratch)?;
        if moved.pages == 0 {
            // DRAM is full (or absent): push its coldest pages to flash, then try again.
            let Some(flash) = flash else { return Ok(false) };
            let spill = victims.iter().filter_map(|r| footprint(core, *r)).sum::<u64>();
            if spill_dram(core, flash, demotion, spill, protect, Need::Waiting)? == 0 {
                if core.outbound.is_empty() {
                    return Ok(false);
                }
                // Another move is writing DRAM pages to flash: their room comes when it commits
                // (as long as that write takes, which on slow flash is a while).
                let (before, since) = (core.outbound.len(), Instant::now());
                while !core.outbound.is_empty() && core.outbound.len() >= before {
                    if since.elapsed() >= OUTBOUND_PATIENCE {
                        return Ok(room.fits(core));
                    }
                    MutexGuard::unlocked(core, || std::thread::sleep(OUTBOUND_POLL));
                }
            }
        }
    }
    Ok(room.fits(core))
}

/// Demotes about `bytes` of the coldest device pages (the tier thread's watermark drain, in
/// rate-limited steps): to DRAM, and when DRAM is full its coldest pages to flash first (the core
/// lock released during the flash I/O, as in [`make_room`]). Returns the device bytes freed.
pub fn demote_coldest(
    core: &mut MutexGuard<'_, Core>,
    flash: Option<&Mutex<FlashFile>>,
    demotion: &Demotion,
    bytes: u64,
    scratch: &mut Scratch,
) -> Result<u64> {
    let victims = pick_victims(core, VictimTier::Device, bytes, &HashSet::new(), Need::Cold);
    if victims.is_empty() {
        return Ok(0);
    }
    let mut moved = demote_to_dram(core, demotion, &victims, scratch)?;
    if moved.pages == 0
        && let Some(flash) = flash
    {
        let spill = victims.iter().filter_map(|r| footprint(core, *r)).sum::<u64>();
        if spill_dram(core, flash, demotion, spill, &HashSet::new(), Need::Waiting)? > 0 {
            moved = demote_to_dram(core, demotion, &victims, scratch)?;
        }
    }
    // Counted page by page: the lock is handed over between pages, so the pool's use may also
    // change by other requests meanwhile.
    Ok(moved.bytes)
}

/// Bytes of DRAM pages [`move_to_flash`] copies out, seals and writes at a time. It bounds the
/// copies in the clear that a move holds: moving all of a 69 MB session at once made kvmmd's peak
/// RSS grow by 69.6 MB (the `tier_ladder` test), which a drain under memory pressure can least
/// afford. 8 MiB of q8 pages is eight of the flash file's 1 MiB runs, enough to keep its sealer and
/// writer busy together.
const FLASH_BATCH_BYTES: u64 = 8 << 20;

/// Moves `pages` from DRAM to flash with the flash I/O outside the core lock, in batches of
/// [`FLASH_BATCH_BYTES`]: for each, the pages are copied out under the lock, the guard is released
/// while they are sealed and written, and taken again to commit them. Under adaptive precision by
/// age, the layers of `pages` are planned first and their DRAM pages stepped down
/// ([`step_down_in_dram`]): a page keeps its format in flash. Returns pages moved; on an error,
/// the batches before it stay moved.
pub fn move_to_flash(
    core: &mut MutexGuard<'_, Core>,
    flash: &Mutex<FlashFile>,
    demotion: &Demotion,
    pages: &[PageRef],
) -> Result<u32> {
    if demotion.by_age() {
        step_down_layers(core, demotion, pages);
    }
    let mut moved = 0;
    let mut rest = pages;
    while let Some((&first, next)) = rest.split_first() {
        // The first page always goes; the next ones while the batch stays within its bytes.
        let mut bytes = footprint(core, first).unwrap_or(0);
        let taken = 1 + next
            .iter()
            .take_while(|&&r| {
                bytes += footprint(core, r).unwrap_or(0);
                bytes <= FLASH_BATCH_BYTES
            })
            .count();
        let (batch, later) = rest.split_at(taken);
        moved += move_batch_to_flash(core, flash, batch)?;
        rest = later;
    }
    Ok(moved)
}

/// One batch of [`move_to_flash`].
fn move_batch_to_flash(core: &mut MutexGuard<'_, Core>, flash: &Mutex<FlashFile>, pages: &[PageRef]) -> Result<u32> {
    let mut out = take_from_dram(core, pages)?;
    if out.is_empty() {
        return Ok(0);
    }
    let metrics = core.metrics.clone();
    let written = MutexGuard::unlocked(core, || {
        crate::failpoint::hit("flash-before-write");
        let written = write_to_flash(&mut flash.lock(), &out, &metrics);
        // The copies are wiped and freed here, not under the core lock at commit: the page is in
        // flash now, or still in its DRAM slot if the write failed.
        let mut cpu = CpuShare::start();
        for o in &mut out {
            o.bytes = Zeroizing::new(Vec::new());
            cpu.between();
        }
        written
    });
    crate::failpoint::hit("flash-after-write");
    let mut orphans = Vec::new();
    let moved = commit_to_flash(core, out, written, &mut orphans);
    if !orphans.is_empty() {
        MutexGuard::unlocked(core, || free_flash_slots(flash, orphans));
    }
    Ok(moved)
}

/// Moves at least `bytes` of the coldest DRAM pages to flash ([`move_to_flash`]: the core lock is
/// released during the I/O), chosen as `need` allows; returns pages moved.
pub fn spill_dram(
    core: &mut MutexGuard<'_, Core>,
    flash: &Mutex<FlashFile>,
    demotion: &Demotion,
    bytes: u64,
    protect: &HashSet<PageRef>,
    need: Need,
) -> Result<u32> {
    let victims = pick_victims(core, VictimTier::Dram, bytes, protect, need);
    if victims.is_empty() {
        return Ok(0);
    }
    move_to_flash(core, flash, demotion, &victims)
}

/// Plans each layer of `pages` as [`demote_to_dram`] would and steps its DRAM pages down
/// ([`step_down_in_dram`]), handing the core lock over between layers ([`LockPacer`]).
fn step_down_layers(core: &mut MutexGuard<'_, Core>, demotion: &Demotion, pages: &[PageRef]) {
    let layers: HashSet<(u64, u32)> = pages.iter().map(|r| (r.session, r.layer)).collect();
    let mut scratch = Scratch::default();
    let mut pacer = LockPacer::start();
    for (session, layer) in layers {
        let Core { sessions, dram, outbound, .. } = &mut **core;
        let Some(dram) = dram.as_mut() else { return };
        if let Some(s) = sessions.get_mut_unchecked(session) {
            plan_layer(s, session, layer, demotion, dram, outbound, &mut scratch);
        }
        pacer.between_pages(core);
    }
}

fn footprint(core: &Core, r: PageRef) -> Option<u64> {
    core.sessions.get_unchecked(r.session)?.pages.page(r.layer, r.block).map(|p| p.place.footprint())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sink_page_and_the_recent_window_keep_their_precision() {
        // 300 tokens in 32-token pages: blocks 0..=8 full, block 9 holds 12. The last 128 tokens
        // (172..300) touch blocks 5..=9.
        let w = RECENT_WINDOW_TOKENS;
        let keeps: Vec<u32> = (0..10).filter(|&b| keeps_precision(b, 32, 300, w)).collect();
        assert_eq!(keeps, vec![0, 5, 6, 7, 8, 9]);
        // A layer exactly 128 tokens past a page boundary: that page is outside the window.
        assert!(!keeps_precision(3, 32, 256, w) && keeps_precision(4, 32, 256, w));
        // Short layers keep everything.
        assert!((0..4).all(|b| keeps_precision(b, 32, 128, w)));
        // Long ones compress nearly everything.
        assert_eq!((0..2048).filter(|&b| !keeps_precision(b, 16, 32_768, w)).count(), 2048 - 1 - 8);
        // The age ranking's 32 tokens: the last 32 (268..300) touch blocks 8 and 9 only.
        let keeps: Vec<u32> = (0..10).filter(|&b| keeps_precision(b, 32, 300, AGE_WINDOW_TOKENS)).collect();
        assert_eq!(keeps, vec![0, 8, 9]);
    }

    #[test]
    fn a_wiped_scratch_keeps_its_capacity_and_no_page_bytes() {
        let mut scratch = Scratch::default();
        scratch.src.resize(25_408, 0xA5);
        scratch.dst.resize(13_056, 0x5A);
        let (src_cap, dst_cap) = (scratch.src.capacity(), scratch.dst.capacity());
        scratch.wipe();
        assert!(scratch.src.is_empty() && scratch.dst.is_empty());
        assert_eq!((scratch.src.capacity(), scratch.dst.capacity()), (src_cap, dst_cap), "kept for reuse");
        // Growing again within the capacity shows what the memory holds now.
        // SAFETY: `set_len` within the capacity; `Vec::zeroize` wrote zeros over the whole capacity,
        // so every byte is initialised.
        unsafe {
            scratch.src.set_len(src_cap);
            scratch.dst.set_len(dst_cap);
        }
        assert!(scratch.src.iter().chain(scratch.dst.iter()).all(|&b| b == 0), "page bytes left in scratch");
    }
}
