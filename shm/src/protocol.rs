//! The pin/migrate protocol: how a client reads a page while the daemon may move it.
//!
//! Two words per page, in two different memfds:
//!
//! - `pins` (`u32`, in the **client region**, written by the client): how many of the client's
//!   threads are using the page right now.
//! - `state` (`u64`, in the **session table**, written only by the daemon; clients map it read-only):
//!   `generation << 32 | flags` ([`crate::state`]), with `RESIDENT` and `MIGRATING` among the flags.
//!
//! Each side writes its own word, issues a `SeqCst` fence, and reads the other side's word
//! (Dekker's pattern, with fences because the two words are in different places):
//!
//! ```text
//!  client: pin                                   daemon: migrate
//!  pins += 1                (Relaxed)  [A]       state |= MIGRATING         (Relaxed)  [B]
//!  fence(SeqCst)                       [FA]      fence(SeqCst)                         [FB]
//!  s = state                (Acquire)  [RA]      p = pins                   (Acquire)  [RB]
//!  if s has MIGRATING or lacks RESIDENT:         if p != 0:
//!      pins -= 1 (Release); fault or retry           state &= !MIGRATING (Release); skip, never wait
//!  read location, use the page                   copy the frame, write the new location (Relaxed)
//!  pins -= 1                (Release)  [U]       state = (gen + 1) | ALLOCATED | RESIDENT (Release) [P]
//!                                                free the old frame
//! ```
//!
//! **Why a page is never moved under a reader.** The two fences are ordered one way or the other in
//! the single total order of `SeqCst` operations. If `FA` comes first, `RB` (after `FB`) must observe
//! `A` or a later change of `pins`: either the pin, and the daemon backs off, or the client's own
//! unpin `U`, whose `Release` the daemon's `Acquire` load synchronizes with, so everything the
//! client did with the page happens before the daemon touches it. If `FB` comes first, `RA` (after
//! `FA`) must observe `B` or a later store to `state`: `MIGRATING`, and the client backs off; or the
//! daemon's restore after backing off (nothing moved); or the publication `P` of a finished
//! migration, which the client's acquire synchronizes with. Either way at least one side sees the
//! other, and the outcome "both proceed" is impossible. Without either fence, both loads may read
//! the old values (store buffering) and the daemon frees a frame the client is reading;
//! `shm/tests/loom_protocol.rs` checks both the protocol and that removing either fence breaks it.
//!
//! **What a client sees after a successful pin.** Its acquire of `state` read the value stored by the
//! daemon's last `Release` publication (or a later restore, which changes nothing else). The daemon
//! wrote the location (offset, length, format, tier) *before* that publication, so the client's
//! subsequent relaxed loads of the location return exactly the published location, and the daemon
//! does not change it while the pin is held. The bytes of the frame were written before the
//! publication too (the daemon's copy) and, for a tail page, by the client itself.
//!
//! **Reads of read-only memory.** Clients map the session table read-only, where the standard library
//! only allows relaxed loads of small atomics. So the client's "acquire load" is a relaxed load
//! followed by an acquire fence, which gives the same synchronization.
//!
//! **What a misbehaving client can do.** It writes only its own `pins` (and token counts and
//! importance, which the daemon clamps). Pinning forever keeps its own pages from being moved — the
//! daemon never waits on a pin; it skips the page and, once one pin has been held past the pin
//! lease (the client's unpin count, [`crate::layout::ClientEntry::unpins`], standing still), reports
//! it as a stuck pin, and an operator may revoke the session with a wipe. Lying about pins (unpinning early, or writing zero) lets the
//! daemon move a page the client is still reading, which only corrupts that client's own view: the
//! old frame may already hold another page of the same trust domain, whose arena the client has
//! mapped anyway. The daemon never reads a location, or anything else that decides where it writes,
//! from shared memory: its page table lives in its own memory and the shared table is a copy it
//! publishes, and pins live in each client's own region, so one client's pins never hold another
//! client's pages.
//!
//! **Batches.** A client pins every page of a layer with [`pin_announce`] on each, one [`pin_fence`],
//! then [`pin_check`] on each, so attention costs one fence per call. The daemon can likewise mark
//! several pages with [`migrate_announce`], issue one [`migrate_fence`], and [`migrate_check`] each.
//!
//! **Liveness.** A client retrying a pin and a daemon retrying a migration can both back off at the
//! same time, indefinitely in theory. The daemon never retries in a loop; it skips the page until its
//! next planning round.
//!
//! The functions take plain references to atomics so that the same source runs over the shared
//! mappings (std atomics, via [`crate::layout`]) and under loom (`--cfg loom`, via `crate::sync`).

use crate::state::{PageFlags, pack_state, unpack_state};
use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};

/// The result of checking a page after announcing a pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[must_use = "a Pinned outcome must be unpinned; the other outcomes mean the page may not be read"]
pub enum PinOutcome {
    /// The page is pinned: its location may be read and its frame used until [`unpin`].
    Pinned {
        /// The page's generation when it was pinned.
        generation: u32,
    },
    /// The daemon is moving the page; the pin was undone. Retry shortly.
    Migrating,
    /// The page is not in the device tier (or does not exist); the pin was undone. Fault it in.
    NotResident,
    /// The page was dropped by opt-in eviction; the pin was undone. Skip it: it is gone for good.
    Dropped,
}

impl PinOutcome {
    /// True for [`PinOutcome::Pinned`].
    pub fn is_pinned(self) -> bool {
        matches!(self, PinOutcome::Pinned { .. })
    }
}

/// Client, step 1: announces a pin (`pins += 1`, relaxed; the fence orders it).
pub fn pin_announce(pins: &AtomicU32) {
    pins.fetch_add(1, Ordering::Relaxed);
}

/// Client, step 2: the fence between announcing pins and checking states. One fence covers any
/// number of announced pins.
pub fn pin_fence() {
    fence(Ordering::SeqCst);
}

/// Client, step 3: checks a page whose pin was announced before the last [`pin_fence`]. On
/// anything but [`PinOutcome::Pinned`] the pin is undone here.
pub fn pin_check(pins: &AtomicU32, state: &AtomicU64) -> PinOutcome {
    // Relaxed load + acquire fence = acquire load that is also allowed on read-only memory.
    let word = state.load(Ordering::Relaxed);
    fence(Ordering::Acquire);
    let (generation, flags) = unpack_state(word);
    if flags.contains(PageFlags::MIGRATING) {
        unpin(pins);
        PinOutcome::Migrating
    } else if flags.contains(PageFlags::DROPPED) {
        unpin(pins);
        PinOutcome::Dropped
    } else if !flags.contains(PageFlags::RESIDENT) {
        unpin(pins);
        PinOutcome::NotResident
    } else {
        PinOutcome::Pinned { generation }
    }
}

/// Client: pins one page (announce, fence, check).
pub fn pin(pins: &AtomicU32, state: &AtomicU64) -> PinOutcome {
    pin_announce(pins);
    pin_fence();
    pin_check(pins, state)
}

/// Client: releases a pin taken by a [`PinOutcome::Pinned`] outcome. `Release`, so that everything
/// done with the page happens before a daemon that sees the count drop moves it.
pub fn unpin(pins: &AtomicU32) {
    pins.fetch_sub(1, Ordering::Release);
}

/// Why the daemon did not start migrating a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MigrateSkip {
    /// A client holds a pin; try again in a later round (and count it towards stuck pins).
    Pinned,
    /// The page is not in the device tier; there is nothing to move.
    NotResident,
    /// Another migration of this page is in progress.
    AlreadyMigrating,
}

/// The daemon's claim on a page between [`migrate_announce`] (or [`try_begin_migrate`]) and
/// [`finish_migrate`], [`finish_evict`], [`finish_free`] or [`abort_migrate`]. While it is held, no
/// client uses the page and only its holder may change the page's entry.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a migration ticket must be finished or aborted, or the page stays MIGRATING forever"]
pub struct MigrateTicket {
    /// Generation when the page was claimed.
    generation: u32,
    /// Flags when the page was claimed (without `MIGRATING`).
    flags: PageFlags,
}

impl MigrateTicket {
    /// Generation of the page when it was claimed.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Flags of the page when it was claimed (never including `MIGRATING`).
    pub fn flags(&self) -> PageFlags {
        self.flags
    }
}

/// Daemon, step 1: claims a resident, unclaimed page by setting `MIGRATING` (relaxed; the fence
/// orders it). Does not look at pins yet.
pub fn migrate_announce(state: &AtomicU64) -> Result<MigrateTicket, MigrateSkip> {
    let mut current = state.load(Ordering::Relaxed);
    loop {
        let (generation, flags) = unpack_state(current);
        if flags.contains(PageFlags::MIGRATING) {
            return Err(MigrateSkip::AlreadyMigrating);
        }
        if !flags.contains(PageFlags::RESIDENT) {
            return Err(MigrateSkip::NotResident);
        }
        let claimed = pack_state(generation, flags.union(PageFlags::MIGRATING));
        // A CAS, not a store: two daemon threads racing for one page cannot both win.
        match state.compare_exchange(current, claimed, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Ok(MigrateTicket { generation, flags }),
            Err(actual) => current = actual,
        }
    }
}

/// Daemon, step 2: the fence between claiming pages and checking their pins.
pub fn migrate_fence() {
    fence(Ordering::SeqCst);
}

/// Daemon, step 3: checks the pins of a page claimed before the last [`migrate_fence`]. If a client
/// holds a pin, the claim is withdrawn here and the page skipped; the daemon never waits.
pub fn migrate_check(state: &AtomicU64, pins: &AtomicU32, ticket: MigrateTicket) -> Result<MigrateTicket, MigrateSkip> {
    if pins.load(Ordering::Acquire) != 0 {
        abort_migrate(state, ticket);
        return Err(MigrateSkip::Pinned);
    }
    Ok(ticket)
}

/// Daemon: claims one page for migration (announce, fence, check).
pub fn try_begin_migrate(state: &AtomicU64, pins: &AtomicU32) -> Result<MigrateTicket, MigrateSkip> {
    let ticket = migrate_announce(state)?;
    migrate_fence();
    migrate_check(state, pins, ticket)
}

/// Daemon: publishes the page at its new location: `state = (generation + 1) | ALLOCATED |
/// RESIDENT` with `Release`. The caller has already written the new location (relaxed is enough:
/// this store publishes it) and copied the bytes.
pub fn finish_migrate(state: &AtomicU64, ticket: MigrateTicket) {
    let next = ticket.generation.wrapping_add(1);
    state.store(pack_state(next, PageFlags::ALLOCATED | PageFlags::RESIDENT), Ordering::Release);
}

/// Daemon: the page left the device tier (demoted to dram or flash) but still exists:
/// `state = (generation + 1) | ALLOCATED`. Clients that try to pin it get
/// [`PinOutcome::NotResident`] and fault it back in.
pub fn finish_evict(state: &AtomicU64, ticket: MigrateTicket) {
    let next = ticket.generation.wrapping_add(1);
    state.store(pack_state(next, PageFlags::ALLOCATED), Ordering::Release);
}

/// Daemon: the page was freed: `state = generation + 1` with no flags.
pub fn finish_free(state: &AtomicU64, ticket: MigrateTicket) {
    let next = ticket.generation.wrapping_add(1);
    state.store(pack_state(next, PageFlags::NONE), Ordering::Release);
}

/// Daemon: the page was dropped by opt-in eviction: `state = (generation + 1) | DROPPED`.
/// Clients that try to pin it get [`PinOutcome::Dropped`] and skip it.
pub fn finish_drop(state: &AtomicU64, ticket: MigrateTicket) {
    let next = ticket.generation.wrapping_add(1);
    state.store(pack_state(next, PageFlags::DROPPED), Ordering::Release);
}

/// Daemon: marks a page that is not resident (in a lower tier) as dropped, without the protocol:
/// no client can hold a pin on it, because [`pin_check`] refuses pages without `RESIDENT`.
pub fn mark_dropped(state: &AtomicU64) {
    let (generation, flags) = unpack_state(state.load(Ordering::Relaxed));
    debug_assert!(!flags.contains(PageFlags::RESIDENT), "mark_dropped on a resident page; claim it first");
    state.store(pack_state(generation.wrapping_add(1), PageFlags::DROPPED), Ordering::Release);
}

/// Daemon: withdraws a claim without changing anything: the state word returns to what it was
/// when the page was claimed.
pub fn abort_migrate(state: &AtomicU64, ticket: MigrateTicket) {
    state.store(pack_state(ticket.generation, ticket.flags), Ordering::Release);
}

/// Daemon: makes a page that no client can be using resident at a location written just before:
/// `state = (generation + 1) | ALLOCATED | RESIDENT`, `Release`.
///
/// For pages that are not `RESIDENT` (never allocated, freed, or demoted): no client can hold a pin
/// on them, because [`pin_check`] refuses pages without `RESIDENT`. Resident pages move with
/// [`try_begin_migrate`] and [`finish_migrate`] instead.
pub fn publish_resident(state: &AtomicU64) {
    let (generation, flags) = unpack_state(state.load(Ordering::Relaxed));
    debug_assert!(
        !flags.contains(PageFlags::RESIDENT),
        "publish_resident on a resident page; move it with try_begin_migrate instead"
    );
    state.store(pack_state(generation.wrapping_add(1), PageFlags::ALLOCATED | PageFlags::RESIDENT), Ordering::Release);
}

/// Daemon: marks a page as not existing (`state = generation + 1`, no flags) without the
/// protocol. Only for pages no client can be using: not resident, claimed under a ticket
/// (prefer [`finish_free`]), or owned by a client that is gone.
pub fn clear(state: &AtomicU64) {
    let (generation, _) = unpack_state(state.load(Ordering::Relaxed));
    state.store(pack_state(generation.wrapping_add(1), PageFlags::NONE), Ordering::Release);
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const RESIDENT: PageFlags = PageFlags::ALLOCATED.union(PageFlags::RESIDENT);

    #[test]
    fn pin_succeeds_on_a_resident_page_and_unpin_releases_it() {
        let pins = AtomicU32::new(0);
        let state = AtomicU64::new(pack_state(7, RESIDENT));
        assert_eq!(pin(&pins, &state), PinOutcome::Pinned { generation: 7 });
        assert_eq!(pins.load(Ordering::Relaxed), 1);
        unpin(&pins);
        assert_eq!(pins.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn failed_pins_undo_themselves() {
        let pins = AtomicU32::new(0);
        let state = AtomicU64::new(pack_state(1, RESIDENT | PageFlags::MIGRATING));
        assert_eq!(pin(&pins, &state), PinOutcome::Migrating);
        assert_eq!(pins.load(Ordering::Relaxed), 0);
        let state = AtomicU64::new(pack_state(1, PageFlags::ALLOCATED));
        assert_eq!(pin(&pins, &state), PinOutcome::NotResident);
        assert_eq!(pins.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn migration_of_a_pinned_page_is_skipped_and_the_state_restored() {
        let pins = AtomicU32::new(0);
        let state = AtomicU64::new(pack_state(3, RESIDENT));
        assert!(pin(&pins, &state).is_pinned());
        assert_eq!(try_begin_migrate(&state, &pins), Err(MigrateSkip::Pinned));
        assert_eq!(state.load(Ordering::Relaxed), pack_state(3, RESIDENT));
    }

    #[test]
    fn migration_bumps_the_generation_and_blocks_pins_meanwhile() {
        let pins = AtomicU32::new(0);
        let state = AtomicU64::new(pack_state(u32::MAX, RESIDENT));
        let ticket = try_begin_migrate(&state, &pins);
        let Ok(ticket) = ticket else {
            panic!("an unpinned resident page can be claimed: {ticket:?}");
        };
        assert_eq!(ticket.generation(), u32::MAX);
        assert_eq!(pin(&pins, &state), PinOutcome::Migrating);
        assert_eq!(try_begin_migrate(&state, &pins), Err(MigrateSkip::AlreadyMigrating));
        finish_migrate(&state, ticket);
        assert_eq!(pin(&pins, &state), PinOutcome::Pinned { generation: 0 });
    }

    #[test]
    fn evict_free_and_abort_leave_the_documented_states() {
        let pins = AtomicU32::new(0);
        let state = AtomicU64::new(pack_state(5, RESIDENT));
        let Ok(t) = try_begin_migrate(&state, &pins) else {
            panic!("claim");
        };
        abort_migrate(&state, t);
        assert_eq!(state.load(Ordering::Relaxed), pack_state(5, RESIDENT));
        let Ok(t) = try_begin_migrate(&state, &pins) else {
            panic!("claim");
        };
        finish_evict(&state, t);
        assert_eq!(state.load(Ordering::Relaxed), pack_state(6, PageFlags::ALLOCATED));
        assert_eq!(try_begin_migrate(&state, &pins), Err(MigrateSkip::NotResident));
        publish_resident(&state);
        let Ok(t) = try_begin_migrate(&state, &pins) else {
            panic!("claim");
        };
        finish_free(&state, t);
        assert_eq!(state.load(Ordering::Relaxed), pack_state(8, PageFlags::NONE));
        clear(&state);
        assert_eq!(state.load(Ordering::Relaxed), pack_state(9, PageFlags::NONE));
    }

    #[test]
    fn dropped_pages_refuse_pins_and_claims_for_good() {
        let pins = AtomicU32::new(0);
        let state = AtomicU64::new(pack_state(3, RESIDENT));
        let Ok(t) = try_begin_migrate(&state, &pins) else {
            panic!("claim");
        };
        finish_drop(&state, t);
        assert_eq!(state.load(Ordering::Relaxed), pack_state(4, PageFlags::DROPPED));
        assert_eq!(pin(&pins, &state), PinOutcome::Dropped);
        assert_eq!(pins.load(Ordering::Relaxed), 0, "a refused pin is undone");
        assert_eq!(try_begin_migrate(&state, &pins), Err(MigrateSkip::NotResident));
        // A page in a lower tier is dropped without a claim.
        let lower = AtomicU64::new(pack_state(9, PageFlags::ALLOCATED));
        mark_dropped(&lower);
        assert_eq!(lower.load(Ordering::Relaxed), pack_state(10, PageFlags::DROPPED));
        assert_eq!(pin(&pins, &lower), PinOutcome::Dropped);
    }
}
