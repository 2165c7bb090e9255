//! Model tests of the session table and client region: entry addressing tiles the memfds exactly,
//! and a random sequence of daemon and client operations leaves the shared table (as a client sees
//! it, through its own read-only mapping) equal to a `HashMap` model.

#![cfg(not(loom))]

use std::collections::HashMap;

use kvmm_kernels::ElementType;
use kvmm_shm::layout::{CLIENT_ENTRY_BYTES, CLIENT_HEADER_BYTES, DAEMON_ENTRY_BYTES, TABLE_HEADER_BYTES};
use kvmm_shm::{
    ClientRegion, Geometry, Memfd, MigrateSkip, PageFlags, PageLocation, PinOutcome, SessionTable, ShmError,
};
use proptest::prelude::*;
use std::sync::atomic::Ordering;

fn geometries() -> impl Strategy<Value = Geometry> {
    (1u32..=6, 1u32..=4, 1u32..=4, 1u32..=16, 3u32..=8, any::<bool>(), 1u32..=3000).prop_map(
        |(layers, kv_heads, group, dim16, log_block, bf16, max_tokens)| Geometry {
            layers,
            kv_heads,
            q_heads: kv_heads * group,
            head_dim: dim16 * 16,
            block_tokens: 1 << log_block,
            element_type: if bf16 { ElementType::Bf16 } else { ElementType::F16 },
            max_tokens,
        },
    )
}

fn to_test_error(e: ShmError) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn entries_tile_both_memfds_exactly_once(g in geometries()) {
        prop_assert_eq!(g.validate(), Ok(()));
        let (table_fd, table) = SessionTable::create(9, &g).map_err(to_test_error)?;
        let (region_fd, region) = ClientRegion::create(&g).map_err(to_test_error)?;
        prop_assert_eq!(table_fd.len(), g.table_bytes());
        prop_assert_eq!(region_fd.len(), g.client_region_bytes());
        prop_assert_eq!(table.mapping().len() as u64, g.table_bytes());

        let table_base = table.mapping().as_ptr() as usize;
        let region_base = region.mapping().as_ptr() as usize;
        let mut next_table = TABLE_HEADER_BYTES as usize;
        let mut next_region = CLIENT_HEADER_BYTES as usize;
        for layer in 0..g.layers {
            let table_layer = table.entries_of_layer(layer).map_err(to_test_error)?;
            let region_layer = region.entries_of_layer(layer).map_err(to_test_error)?;
            prop_assert_eq!(table_layer.len() as u32, g.blocks_per_layer());
            prop_assert_eq!(region_layer.len() as u32, g.blocks_per_layer());
            for block in 0..g.blocks_per_layer() {
                let t = table.entry(layer, block).map_err(to_test_error)?;
                let r = region.entry(layer, block).map_err(to_test_error)?;
                // Consecutive, in row-major order, starting right after the header: so no two
                // entries overlap and the last one ends at the end of the memfd.
                prop_assert_eq!(t as *const _ as usize - table_base, next_table);
                prop_assert_eq!(r as *const _ as usize - region_base, next_region);
                prop_assert!(std::ptr::eq(t, &table_layer[block as usize]));
                prop_assert!(std::ptr::eq(r, &region_layer[block as usize]));
                next_table += DAEMON_ENTRY_BYTES as usize;
                next_region += CLIENT_ENTRY_BYTES as usize;
            }
        }
        prop_assert_eq!(next_table as u64, table_fd.len());
        prop_assert_eq!(next_region as u64, region_fd.len());

        let outside = [
            (g.layers, 0),
            (0, g.blocks_per_layer()),
            (u32::MAX, u32::MAX),
        ];
        for (layer, block) in outside {
            let err = table.entry(layer, block).err();
            prop_assert!(
                matches!(err, Some(ShmError::EntryOutOfRange { .. })),
                "{:?}", err
            );
            prop_assert!(region.entry(layer, block).is_err());
        }
        prop_assert!(table.entries_of_layer(g.layers).is_err());
        prop_assert!(region.entries_of_layer(g.layers).is_err());

        // The client's view agrees on the geometry.
        let client_table = SessionTable::open(table_fd).map_err(to_test_error)?;
        prop_assert_eq!(client_table.geometry(), g);
        prop_assert_eq!(client_table.session_id(), 9);
        ClientRegion::open(region_fd, &g).map_err(to_test_error)?;
    }
}

/// One step of the model.
#[derive(Clone, Debug)]
enum Op {
    /// Daemon: make the page resident at `offset` (publish if not resident, else migrate).
    Place { offset: u64 },
    /// Daemon: demote the page out of the device tier.
    Evict,
    /// Daemon: free the page.
    Free,
    /// Client: pin the page.
    Pin,
    /// Client: release one pin.
    Unpin,
}

fn ops() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..1 << 40).prop_map(|offset| Op::Place { offset }),
        Just(Op::Evict),
        Just(Op::Free),
        Just(Op::Pin),
        Just(Op::Unpin),
    ]
}

/// What the model knows about one page.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct ModelPage {
    generation: u32,
    allocated: bool,
    resident: bool,
    location: PageLocation,
    pins: u32,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn the_client_view_follows_a_hashmap_model(
        g in geometries(),
        steps in proptest::collection::vec((any::<u32>(), any::<u32>(), ops()), 1..80),
    ) {
        let (table_fd, daemon_table) = SessionTable::create(1, &g).map_err(to_test_error)?;
        let (region_fd, daemon_region) = ClientRegion::create(&g).map_err(to_test_error)?;
        let client_table = SessionTable::open(
            Memfd::from_fd(table_fd.into_owned_fd()).map_err(to_test_error)?,
        )
        .map_err(to_test_error)?;
        let client_region = ClientRegion::open(region_fd, &g).map_err(to_test_error)?;
        let mut model: HashMap<(u32, u32), ModelPage> = HashMap::new();
        let format = g.format();
        let len = g.page_bytes() as u32;

        for (l, b, op) in steps {
            let (layer, block) = (l % g.layers, b % g.blocks_per_layer());
            let page = model.entry((layer, block)).or_default();
            let writer = daemon_table.entry_writer(layer, block).map_err(to_test_error)?;
            let daemon_client_entry = daemon_region.entry(layer, block).map_err(to_test_error)?;
            let client_entry = client_region.entry(layer, block).map_err(to_test_error)?;
            let view = client_table.entry(layer, block).map_err(to_test_error)?;
            match op {
                Op::Place { offset } => {
                    let location = PageLocation::device(offset, len, format);
                    if !page.resident {
                        writer.publish_new(location);
                        *page = ModelPage {
                            generation: page.generation.wrapping_add(1),
                            allocated: true,
                            resident: true,
                            location,
                            pins: page.pins,
                        };
                    } else {
                        match writer.try_begin_migrate(daemon_client_entry) {
                            Ok(ticket) => {
                                prop_assert_eq!(page.pins, 0);
                                writer.finish_migrate(ticket, location);
                                page.generation = page.generation.wrapping_add(1);
                                page.location = location;
                            }
                            Err(skip) => {
                                prop_assert_eq!(skip, MigrateSkip::Pinned);
                                prop_assert!(page.pins > 0);
                            }
                        }
                    }
                }
                Op::Evict | Op::Free => {
                    let free = matches!(op, Op::Free);
                    match writer.try_begin_migrate(daemon_client_entry) {
                        Ok(ticket) => {
                            prop_assert!(page.resident && page.pins == 0);
                            if free {
                                writer.finish_free(ticket);
                            } else {
                                writer.finish_evict(ticket);
                            }
                            page.generation = page.generation.wrapping_add(1);
                            page.allocated = !free;
                            page.resident = false;
                            page.location = PageLocation::default();
                        }
                        Err(MigrateSkip::Pinned) => prop_assert!(page.resident && page.pins > 0),
                        Err(MigrateSkip::NotResident) => {
                            prop_assert!(!page.resident);
                            if free {
                                writer.clear();
                                page.generation = page.generation.wrapping_add(1);
                                page.allocated = false;
                                page.location = PageLocation::default();
                            }
                        }
                        Err(MigrateSkip::AlreadyMigrating) => {
                            prop_assert!(false, "no claim is ever left behind");
                        }
                    }
                }
                Op::Pin => {
                    let outcome = client_entry.pin(view);
                    if page.resident {
                        prop_assert_eq!(outcome, PinOutcome::Pinned { generation: page.generation });
                        page.pins += 1;
                    } else {
                        prop_assert_eq!(outcome, PinOutcome::NotResident);
                    }
                }
                Op::Unpin => {
                    if page.pins > 0 {
                        client_entry.unpin();
                        page.pins -= 1;
                    }
                }
            }
            // The client's read-only view matches the model.
            let (generation, flags) = view.load_state(Ordering::Acquire);
            prop_assert_eq!(generation, page.generation);
            prop_assert_eq!(flags.contains(PageFlags::ALLOCATED), page.allocated);
            prop_assert_eq!(flags.contains(PageFlags::RESIDENT), page.resident);
            prop_assert!(!flags.contains(PageFlags::MIGRATING));
            prop_assert_eq!(view.location(), page.location);
            prop_assert_eq!(daemon_client_entry.pins(), page.pins);
        }

        // Untouched pages are still empty; touched ones match.
        for layer in 0..g.layers {
            for block in 0..g.blocks_per_layer() {
                let view = client_table.entry(layer, block).map_err(to_test_error)?;
                let page = model.get(&(layer, block)).copied().unwrap_or_default();
                let (generation, flags) = view.load_state(Ordering::Relaxed);
                prop_assert_eq!(generation, page.generation);
                prop_assert_eq!(flags.contains(PageFlags::RESIDENT), page.resident);
                prop_assert_eq!(view.location(), page.location);
                if page.location != PageLocation::default() {
                    prop_assert_eq!(view.location().format(), Some(format));
                }
            }
        }
    }
}
