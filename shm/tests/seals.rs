//! The seals on the session memfds really hold, and a client's views see what the daemon writes.

#![cfg(not(loom))]

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use kvmm_kernels::ElementType;
use kvmm_shm::layout::TableStatus;
use kvmm_shm::{
    Access, ClientRegion, Geometry, Mapping, Memfd, PageFlags, PageLocation, PinOutcome, Seals, SessionTable, ShmError,
    ShmErrorKind,
};
use rustix::io::Errno;

fn geometry() -> Geometry {
    Geometry {
        layers: 4,
        kv_heads: 2,
        q_heads: 8,
        head_dim: 64,
        block_tokens: 32,
        element_type: ElementType::Bf16,
        max_tokens: 1000,
    }
}

/// A second handle on `memfd`, as a client would receive it.
fn received(memfd: &Memfd) -> Result<Memfd, ShmError> {
    Memfd::from_fd(memfd.try_clone()?.into_owned_fd())
}

#[test]
fn a_sealed_table_cannot_be_resized_written_or_mapped_writable() -> Result<(), ShmError> {
    let (memfd, _table) = SessionTable::create(1, &geometry())?;
    assert_eq!(memfd.seals()?, Seals::SHRINK | Seals::GROW | Seals::FUTURE_WRITE | Seals::SEAL);
    assert_eq!(rustix::fs::ftruncate(memfd.as_fd(), 0), Err(Errno::PERM));
    assert_eq!(rustix::fs::ftruncate(memfd.as_fd(), memfd.len() + 4096), Err(Errno::PERM));
    assert_eq!(rustix::io::pwrite(memfd.as_fd(), b"x", 0), Err(Errno::PERM));
    let err = Mapping::map(&memfd, Access::ReadWrite).err();
    assert_eq!(err.as_ref().map(ShmError::kind), Some(ShmErrorKind::PermissionDenied), "{err:?}");
    assert_eq!(err.and_then(|e| e.errno()), Some(Errno::PERM));
    assert_eq!(memfd.seal(Seals::WRITE).err().and_then(|e| e.errno()), Some(Errno::PERM));
    Ok(())
}

#[test]
fn a_client_cannot_make_its_read_only_table_mapping_writable() -> Result<(), ShmError> {
    let (memfd, _table) = SessionTable::create(1, &geometry())?;
    let client = SessionTable::open(received(&memfd)?)?;
    let ptr = client.mapping().as_ptr().cast_mut().cast::<c_void>();
    let len = client.mapping().len();
    // SAFETY: `ptr..ptr + len` is the client's own live mapping; the call is expected to fail, and
    // if it succeeded it would only add write permission to memory no Rust reference treats as
    // immutable.
    let result =
        unsafe { rustix::mm::mprotect(ptr, len, rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE) };
    assert_eq!(result, Err(Errno::ACCESS));
    Ok(())
}

#[test]
fn the_client_sees_what_the_daemon_publishes_through_its_own_mapping() -> Result<(), ShmError> {
    let g = geometry();
    let (memfd, daemon) = SessionTable::create(77, &g)?;
    let client = SessionTable::open(received(&memfd)?)?;
    assert!(!client.is_writable());
    assert_eq!(client.session_id(), 77);
    assert_eq!(client.geometry(), g);
    assert_eq!(client.header().page_bytes, g.page_bytes());
    assert_eq!(client.status()?, TableStatus::Open);

    let (region_fd, daemon_region) = ClientRegion::create(&g)?;
    let region = ClientRegion::open(region_fd, &g)?;

    let view = client.entry(3, 31)?;
    assert_eq!(view.load_state(Ordering::Acquire), (0, PageFlags::NONE));
    assert_eq!(region.entry(3, 31)?.pin(view), PinOutcome::NotResident);

    let location = PageLocation::device(1 << 20, g.page_bytes() as u32, g.format());
    daemon.entry_writer(3, 31)?.publish_new(location);
    assert_eq!(view.load_state(Ordering::Acquire), (1, PageFlags::ALLOCATED | PageFlags::RESIDENT));
    let pin = region.entry(3, 31)?.pin(view);
    assert_eq!(pin, PinOutcome::Pinned { generation: 1 });
    assert_eq!(view.location(), location);
    // The daemon sees the pin through its own mapping of the region and skips the page.
    let daemon_pins = daemon_region.entry(3, 31)?;
    assert_eq!(daemon_pins.pins(), 1);
    let writer = daemon.entry_writer(3, 31)?;
    assert!(writer.try_begin_migrate(daemon_pins).is_err());
    region.entry(3, 31)?.unpin();
    let Ok(ticket) = writer.try_begin_migrate(daemon_pins) else {
        panic!("an unpinned page can be claimed");
    };
    writer.finish_evict(ticket);
    assert_eq!(view.load_state(Ordering::Acquire), (2, PageFlags::ALLOCATED));

    // Client-written fields reach the daemon, clamped.
    region.entry(0, 0)?.publish_tokens(5000);
    region.entry(0, 0)?.set_importance(f32::NAN);
    assert_eq!(daemon_region.entry(0, 0)?.tokens_clamped(g.block_tokens), 32);
    assert_eq!(daemon_region.entry(0, 0)?.importance_clamped(), 0.0);

    daemon.set_status(TableStatus::Wiped)?;
    assert_eq!(client.status()?, TableStatus::Wiped);
    Ok(())
}

#[test]
fn a_client_table_refuses_every_write() -> Result<(), ShmError> {
    let (memfd, _daemon) = SessionTable::create(1, &geometry())?;
    let client = SessionTable::open(received(&memfd)?)?;
    assert!(matches!(client.entry_writer(0, 0), Err(ShmError::ReadOnly { .. })));
    assert!(matches!(client.set_status(TableStatus::Closed), Err(ShmError::ReadOnly { .. })));
    assert!(matches!(client.mapping().write_at(0, b"x"), Err(ShmError::ReadOnly { .. })));
    assert!(matches!(client.mapping().atomic_u64(128), Err(ShmError::ReadOnly { .. })));
    Ok(())
}

#[test]
fn a_sealed_client_region_cannot_be_resized_but_stays_writable() -> Result<(), ShmError> {
    let (memfd, _region) = ClientRegion::create(&geometry())?;
    assert_eq!(memfd.seals()?, Seals::SHRINK | Seals::GROW | Seals::SEAL);
    assert_eq!(rustix::fs::ftruncate(memfd.as_fd(), 0), Err(Errno::PERM));
    Mapping::map(&memfd, Access::ReadWrite)?.write_at(64, b"pins")?;
    Ok(())
}

#[test]
fn an_unsealed_or_foreign_memfd_is_not_accepted_as_a_table() -> Result<(), ShmError> {
    let g = geometry();
    let unsealed = Memfd::create("not-a-table", g.table_bytes())?;
    let err = SessionTable::open(unsealed).err();
    assert!(matches!(err, Some(ShmError::MissingSeals { .. })), "{err:?}");
    assert!(
        err.is_some_and(|e| e.to_string().contains("lacks the seals SHRINK | GROW | FUTURE_WRITE (it has (none))")),
        "the message names the missing seals"
    );

    let garbage = Memfd::create("garbage", g.table_bytes())?;
    Mapping::map(&garbage, Access::ReadWrite)?.write_at(0, b"NOTATABLE")?;
    garbage.seal(Seals::SHRINK | Seals::GROW | Seals::FUTURE_WRITE)?;
    let err = SessionTable::open(garbage).err().map(|e| e.to_string());
    assert_eq!(
        err.as_deref(),
        Some(
            "the session table has magic = \"NOTATABL\", but this build expects \"KVMMTABL\"; \
             the fd is not a session table, or the daemon and this process speak different ABI \
             versions"
        )
    );

    let tiny = Memfd::create("tiny", 64)?;
    tiny.seal(Seals::SHRINK | Seals::GROW | Seals::FUTURE_WRITE)?;
    let err = SessionTable::open(tiny).err();
    assert!(
        err.is_some_and(|e| e.to_string().contains("memfd size = 64 bytes")),
        "a memfd too small for a header is refused before mapping"
    );
    Ok(())
}

#[test]
fn a_client_region_for_another_geometry_is_refused() -> Result<(), ShmError> {
    let g = geometry();
    let (memfd, _region) = ClientRegion::create(&g)?;
    let other = Geometry { max_tokens: 2000, ..g };
    let err = ClientRegion::open(received(&memfd)?, &other).err();
    assert!(err.as_ref().is_some_and(|e| e.to_string().contains("client region has memfd size")), "{err:?}");
    let same_size = Geometry { layers: 8, max_tokens: 500, ..g };
    assert_eq!(same_size.client_region_bytes(), g.client_region_bytes());
    let err = ClientRegion::open(received(&memfd)?, &same_size).err();
    assert!(err.as_ref().is_some_and(|e| e.to_string().contains("layers = 4, but this build expects 8")), "{err:?}");
    Ok(())
}

#[test]
fn an_invalid_geometry_is_refused_before_any_memfd_exists() {
    let bad = Geometry { q_heads: 10, kv_heads: 3, ..geometry() };
    let err = SessionTable::create(1, &bad).err().map(|e| e.to_string());
    assert_eq!(err.as_deref(), Some("q_heads (10) must be a multiple of kv_heads (3) for grouped-query attention"));
    assert!(ClientRegion::create(&bad).is_err());
}
