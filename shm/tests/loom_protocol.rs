//! Model-checks the pin/migrate protocol (`kvmm_shm::protocol`) with loom.
//!
//! Run with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=/work/target-loom \
//!     cargo test -p kvmm-shm --test loom_protocol --release
//! ```
//!
//! The model: one page with two frames, each a plain (non-atomic) `[value, !value]` cell, as the real
//! frames are plain memory copied with memcpy; a location word names the frame in use. A client
//! thread pins the page, reads the location, reads both words of that frame, checks them (not
//! poison, checksum intact, value equal to the generation the pin observed) and unpins. A daemon
//! thread tries to migrate: claims the page (skipping it when pinned), writes the next generation
//! into the other frame, writes the location, publishes, and then poisons the old frame, as a
//! reused frame would be overwritten. Loom reports any read of a frame that is not ordered after
//! the writes it could see (a data race) and any failed check.
//!
//! The negative models remove one fence each and must fail; a protocol test that cannot fail
//! would prove nothing.
//!
//! Every model is explored exhaustively except the largest (two pages, two batches on each side),
//! which bounds preemptions at 4 (loom's `preemption_bound`); `LOOM_MAX_PREEMPTIONS` overrides the
//! bound of every model. The whole file runs in about 25 s on two cores.
//!
//! Batches are modelled too: the client pins two pages with one fence (announce both, fence, check
//! both) while the daemon claims both with one fence.

#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use loom::thread;

use kvmm_shm::protocol::{self, PinOutcome};
use kvmm_shm::state::{PageFlags, pack_state, unpack_state};

const POISON: u64 = 0xdead_dead_dead_dead;

/// One page as both sides see it.
struct Page {
    /// Client region: pins.
    pins: AtomicU32,
    /// Session table: state word.
    state: AtomicU64,
    /// Session table: location (which frame).
    location: AtomicU64,
    /// Arena: two frames of two plain words each.
    frames: [UnsafeCell<[u64; 2]>; 2],
}

impl Page {
    fn new() -> Page {
        Page {
            pins: AtomicU32::new(0),
            state: AtomicU64::new(pack_state(1, PageFlags::ALLOCATED.union(PageFlags::RESIDENT))),
            location: AtomicU64::new(0),
            frames: [UnsafeCell::new([1, !1]), UnsafeCell::new([POISON, POISON])],
        }
    }
}

#[derive(Clone, Copy)]
struct Model {
    /// Pages, all pinned (and claimed) as one batch.
    pages: usize,
    /// Client threads.
    clients: usize,
    /// Batches each client pins.
    client_pins: usize,
    /// Batches the daemon migrates.
    daemon_migrations: usize,
    /// The client's fence between announcing and checking.
    client_fence: bool,
    /// The daemon's fence between claiming and checking pins.
    daemon_fence: bool,
    /// Instead of moving the page directly, demote it (`finish_evict`, old frame poisoned) and
    /// bring it back into the other frame (`publish_resident`), as a fault would.
    evict_and_restore: bool,
    /// Loom's preemption bound (None: exhaustive).
    preemption_bound: Option<usize>,
}

impl Model {
    /// One page, one client, both fences, explored exhaustively.
    fn single(client_pins: usize, daemon_migrations: usize) -> Model {
        Model {
            pages: 1,
            clients: 1,
            client_pins,
            daemon_migrations,
            client_fence: true,
            daemon_fence: true,
            evict_and_restore: false,
            preemption_bound: None,
        }
    }
}

fn client(pages: &[Page], model: Model) {
    for _ in 0..model.client_pins {
        for page in pages {
            protocol::pin_announce(&page.pins);
        }
        if model.client_fence {
            protocol::pin_fence();
        }
        let outcomes: Vec<PinOutcome> = pages.iter().map(|page| protocol::pin_check(&page.pins, &page.state)).collect();
        for (page, outcome) in pages.iter().zip(outcomes) {
            let PinOutcome::Pinned { generation } = outcome else {
                continue;
            };
            let frame = page.location.load(Ordering::Relaxed) as usize;
            // SAFETY: (model) the pin keeps the daemon from writing this frame; loom checks it.
            let [value, check] = page.frames[frame].with(|words| unsafe { *words });
            assert_ne!(value, POISON, "client read a freed frame while pinned");
            assert_eq!(check, !value, "client read a torn frame while pinned");
            assert_eq!(value, u64::from(generation), "client read a frame of another generation than it pinned");
            protocol::unpin(&page.pins);
        }
    }
}

fn daemon(pages: &[Page], model: Model) {
    for _ in 0..model.daemon_migrations {
        let announced: Vec<_> = pages.iter().map(|page| protocol::migrate_announce(&page.state)).collect();
        if model.daemon_fence {
            protocol::migrate_fence();
        }
        for (page, announced) in pages.iter().zip(announced) {
            let claimed = announced.and_then(|ticket| protocol::migrate_check(&page.state, &page.pins, ticket));
            let Ok(ticket) = claimed else { continue };
            let old = page.location.load(Ordering::Relaxed) as usize;
            let new = 1 - old;
            if model.evict_and_restore {
                protocol::finish_evict(&page.state, ticket);
                // SAFETY: (model) an evicted page has no readers; loom checks it.
                page.frames[old].with_mut(|words| unsafe { *words = [POISON, POISON] });
                let (generation, _) = unpack_state(page.state.load(Ordering::Relaxed));
                let next = u64::from(generation) + 1;
                // SAFETY: (model) a page that is not resident has no readers; loom checks it.
                page.frames[new].with_mut(|words| unsafe { *words = [next, !next] });
                page.location.store(new as u64, Ordering::Relaxed);
                protocol::publish_resident(&page.state);
                continue;
            }
            let next = u64::from(ticket.generation()) + 1;
            // SAFETY: (model) the ticket excludes readers of the page; loom checks it.
            page.frames[new].with_mut(|words| unsafe { *words = [next, !next] });
            page.location.store(new as u64, Ordering::Relaxed);
            protocol::finish_migrate(&page.state, ticket);
            // The old frame is free and reused at once.
            // SAFETY: (model) no client may still read the old frame; loom checks it.
            page.frames[old].with_mut(|words| unsafe { *words = [POISON, POISON] });
        }
    }
}

fn check(model: Model) {
    let mut builder = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        builder.preemption_bound = model.preemption_bound;
    }
    let executions = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&executions);
    builder.check(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pages: Arc<Vec<Page>> = Arc::new((0..model.pages).map(|_| Page::new()).collect());
        let clients: Vec<_> = (0..model.clients)
            .map(|_| {
                let pages = Arc::clone(&pages);
                thread::spawn(move || client(&pages, model))
            })
            .collect();
        daemon(&pages, model);
        for c in clients {
            c.join().expect("a client thread does not panic");
        }
        // Every pin was released, whatever happened.
        for page in pages.iter() {
            assert_eq!(page.pins.load(Ordering::Relaxed), 0);
        }
    });
    eprintln!("loom explored {} executions", executions.load(std::sync::atomic::Ordering::Relaxed));
}

#[test]
fn a_pinned_page_is_never_moved_or_freed_under_the_reader() {
    check(Model::single(1, 1));
}

#[test]
fn two_pins_against_two_migrations_never_see_a_freed_or_torn_frame() {
    check(Model::single(2, 2));
}

#[test]
fn a_batch_pinned_with_one_fence_is_safe_against_a_batch_claimed_with_one_fence() {
    check(Model { pages: 2, ..Model::single(1, 1) });
}

#[test]
fn two_clients_pinning_one_page_both_hold_off_the_daemon() {
    check(Model { clients: 2, ..Model::single(1, 1) });
}

#[test]
fn a_page_evicted_and_faulted_back_is_never_read_in_between() {
    check(Model { evict_and_restore: true, ..Model::single(2, 2) });
}

#[test]
fn batches_pinned_twice_against_batches_migrated_twice_stay_consistent() {
    check(Model { pages: 2, preemption_bound: Some(4), ..Model::single(2, 2) });
}

// Loom reports the unordered read of the frame the daemon is poisoning as a causality violation.
#[test]
#[should_panic(expected = "Causality violation")]
fn without_the_client_fence_a_reader_sees_a_freed_frame() {
    check(Model { client_fence: false, ..Model::single(1, 1) });
}

#[test]
#[should_panic(expected = "Causality violation")]
fn without_the_daemon_fence_a_reader_sees_a_freed_frame() {
    check(Model { daemon_fence: false, ..Model::single(1, 1) });
}

#[test]
#[should_panic(expected = "Causality violation")]
fn without_the_batch_fence_a_batch_reader_sees_a_freed_frame() {
    check(Model { pages: 2, client_fence: false, ..Model::single(1, 1) });
}
