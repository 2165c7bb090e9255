//! The pin/migrate protocol under real threads and real mappings: a daemon thread moves pages
//! between two frames of an arena as fast as it can, rewriting each page with its new generation and
//! poisoning the old frame right after publishing, while a client thread pins pages (one at a time
//! and a whole layer with one fence), reads them through its own mappings, and checks that every
//! word of every page it read while pinned belongs to the generation its pin observed.

#![cfg(not(loom))]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvmm_kernels::ElementType;
use kvmm_shm::layout::{pin_batch, unpin_batch};
use kvmm_shm::{
    Access, ClientRegion, Geometry, Mapping, Memfd, MigrateSkip, PageLocation, PinOutcome, Seals, SessionTable,
    ShmError,
};

const POISON: u64 = 0xdead_dead_dead_dead;
const TARGET: u64 = 20_000;
const DEADLINE: Duration = Duration::from_secs(20);

fn geometry() -> Geometry {
    Geometry {
        layers: 1,
        kv_heads: 1,
        q_heads: 1,
        head_dim: 64,
        block_tokens: 32,
        element_type: ElementType::F16,
        max_tokens: 4 * 32,
    }
}

/// Page contents for `block` at `generation`: every word is `block << 32 | generation`.
fn pattern(block: u32, generation: u32, page_bytes: usize) -> Vec<u8> {
    let word = (u64::from(block) << 32 | u64::from(generation)).to_le_bytes();
    word.iter().copied().cycle().take(page_bytes).collect()
}

/// Checks a page read while pinned at `generation`.
fn check_page(block: u32, generation: u32, bytes: &[u8]) {
    let expected = u64::from(block) << 32 | u64::from(generation);
    for (i, chunk) in bytes.chunks_exact(8).enumerate() {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let word = u64::from_le_bytes(word);
        assert_ne!(word, POISON, "block {block}: word {i} read from a freed frame while pinned");
        assert_eq!(word, expected, "block {block}: word {i} is {word:#x}, not generation {generation}'s {expected:#x}");
    }
}

#[test]
fn pages_read_while_pinned_are_never_moved_torn_or_freed() -> Result<(), ShmError> {
    let g = geometry();
    let page_bytes = g.page_bytes() as usize;
    let blocks = g.blocks_per_layer();

    // Daemon side: arena with two frames per page, table, client region.
    let arena_fd = Memfd::create("kvmm-stress-arena", 2 * u64::from(blocks) * g.page_bytes())?;
    arena_fd.seal(Seals::SHRINK | Seals::GROW | Seals::SEAL)?;
    let arena = Mapping::map(&arena_fd, Access::ReadWrite)?;
    let (table_fd, table) = SessionTable::create(5, &g)?;
    let (region_fd, region) = ClientRegion::create(&g)?;

    // Client side: its own mappings of the same memfds.
    let client_arena = Mapping::map(&Memfd::from_fd(arena_fd.try_clone()?.into_owned_fd())?, Access::ReadWrite)?;
    let client_table = SessionTable::open(Memfd::from_fd(table_fd.into_owned_fd())?)?;
    let client_region = ClientRegion::open(region_fd, &g)?;

    // The daemon's own bookkeeping: where each page is. It never reads locations back.
    let mut frame_of: Vec<usize> = vec![0; blocks as usize];
    let mut generation_of: Vec<u32> = vec![0; blocks as usize];
    let frame_offset = |block: u32, frame: usize| (2 * block as usize + frame) * page_bytes;
    for block in 0..blocks {
        arena.write_at(frame_offset(block, 0), &pattern(block, 1, page_bytes))?;
        table.entry_writer(0, block)?.publish_new(PageLocation::device(
            frame_offset(block, 0) as u64,
            page_bytes as u32,
            g.format(),
        ));
        generation_of[block as usize] = 1;
    }

    let done = AtomicBool::new(false);
    let migrated = AtomicU64::new(0);
    let skipped_pinned = AtomicU64::new(0);
    let pinned = AtomicU64::new(0);
    let saw_migrating = AtomicU64::new(0);
    let start = Instant::now();

    std::thread::scope(|s| -> Result<(), ShmError> {
        let client = s.spawn(|| -> Result<(), ShmError> {
            let mut buf = vec![0u8; page_bytes];
            let mut outcomes = Vec::new();
            let mut round = 0u64;
            while !done.load(Ordering::Relaxed) {
                round += 1;
                if round.is_multiple_of(2) {
                    for block in 0..blocks {
                        let view = client_table.entry(0, block)?;
                        let mine = client_region.entry(0, block)?;
                        match mine.pin(view) {
                            PinOutcome::Pinned { generation } => {
                                let loc = view.location();
                                client_arena.read_at(loc.offset as usize, &mut buf)?;
                                check_page(block, generation, &buf);
                                mine.unpin();
                                pinned.fetch_add(1, Ordering::Relaxed);
                            }
                            PinOutcome::Migrating => {
                                saw_migrating.fetch_add(1, Ordering::Relaxed);
                            }
                            PinOutcome::NotResident | PinOutcome::Dropped => panic!("block {block} is always resident"),
                        }
                    }
                } else {
                    let mine = client_region.entries_of_layer(0)?;
                    let views = client_table.entries_of_layer(0)?;
                    pin_batch(mine, views, &mut outcomes)?;
                    for (block, (view, outcome)) in views.iter().zip(&outcomes).enumerate() {
                        match *outcome {
                            PinOutcome::Pinned { generation } => {
                                let loc = view.location();
                                client_arena.read_at(loc.offset as usize, &mut buf)?;
                                check_page(block as u32, generation, &buf);
                                pinned.fetch_add(1, Ordering::Relaxed);
                            }
                            PinOutcome::Migrating => {
                                saw_migrating.fetch_add(1, Ordering::Relaxed);
                            }
                            PinOutcome::NotResident | PinOutcome::Dropped => panic!("block {block} is always resident"),
                        }
                    }
                    unpin_batch(mine, &outcomes);
                }
            }
            Ok(())
        });

        let poison = POISON.to_le_bytes().repeat(page_bytes / 8);
        let result = (|| -> Result<(), ShmError> {
            while (migrated.load(Ordering::Relaxed) < TARGET || pinned.load(Ordering::Relaxed) < TARGET)
                && start.elapsed() < DEADLINE
                && !client.is_finished()
            {
                for block in 0..blocks {
                    let writer = table.entry_writer(0, block)?;
                    match writer.try_begin_migrate(region.entry(0, block)?) {
                        Ok(ticket) => {
                            let b = block as usize;
                            let (old, new) = (frame_of[b], 1 - frame_of[b]);
                            let next = generation_of[b].wrapping_add(1);
                            arena.write_at(frame_offset(block, new), &pattern(block, next, page_bytes))?;
                            writer.finish_migrate(
                                ticket,
                                PageLocation::device(frame_offset(block, new) as u64, page_bytes as u32, g.format()),
                            );
                            // The old frame is reused at once.
                            arena.write_at(frame_offset(block, old), &poison)?;
                            frame_of[b] = new;
                            generation_of[b] = next;
                            migrated.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(MigrateSkip::Pinned) => {
                            skipped_pinned.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(other) => panic!("block {block}: unexpected skip {other:?}"),
                    }
                }
            }
            Ok(())
        })();
        done.store(true, Ordering::Relaxed);
        let client_result = client.join().expect("the client thread does not panic");
        result.and(client_result)
    })?;

    let (migrated, pinned) = (migrated.into_inner(), pinned.into_inner());
    let (skipped, saw_migrating) = (skipped_pinned.into_inner(), saw_migrating.into_inner());
    eprintln!(
        "{migrated} migrations, {skipped} skipped for pins; {pinned} pinned reads, \
         {saw_migrating} pins refused as migrating; {:?}",
        start.elapsed()
    );
    assert!(migrated >= 1000, "the daemon made progress ({migrated} migrations)");
    assert!(pinned >= 1000, "the client made progress ({pinned} pinned reads)");
    let parallel = std::thread::available_parallelism().map_or(1, |n| n.get());
    if parallel >= 2 {
        assert!(skipped + saw_migrating > 0, "the two sides never contended, so the test proved nothing");
    }
    Ok(())
}
