//! The session table as a mapped object: created and written by the daemon, opened read-only by
//! the client.
//!
//! The byte layout is in [`crate::layout`]. A [`SessionTable`] owns a mapping of the table memfd and
//! a copy of the geometry (validated against the header once, when opened), so every address it
//! hands out is bounds-checked against numbers that shared memory cannot change afterwards.
//!
//! The daemon's mapping is the only writable one: [`SessionTable::create`] maps the fresh memfd
//! read-write, writes the header, and then seals it `SHRINK | GROW | FUTURE_WRITE | SEAL`, after
//! which the kernel refuses any new writable mapping (and `write(2)`), while the daemon's existing
//! mapping keeps working. Writes to entries go through [`EntryWriter`], which only a writable table
//! hands out; clients get [`DaemonEntry`] views whose methods only load.

use std::fmt;
use std::ops::Deref;
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering, fence};

use crate::error::ShmError;
use crate::geometry::{Geometry, element_type_code, element_type_from_code};
use crate::layout::{
    ABI_VERSION, ClientEntry, DAEMON_ENTRY_BYTES, DaemonEntry, PageLocation, TABLE_HEADER_BYTES, TABLE_MAGIC,
    TableHeader, TableStatus, render_magic, table_bytes,
};
use crate::mapping::{Access, Mapping};
use crate::memfd::{Memfd, Seals};
use crate::protocol::{self, MigrateSkip, MigrateTicket};

/// The seals a session table carries once handed out.
pub const TABLE_SEALS: Seals = Seals::SHRINK.union(Seals::GROW).union(Seals::FUTURE_WRITE).union(Seals::SEAL);

const REGION: &str = "session table";

/// A mapped session table.
pub struct SessionTable {
    /// Mapping of the whole table memfd: read-write in the daemon that created it, read-only in
    /// clients. Unmapped on drop; the daemon drops it when the session is destroyed.
    mapping: Mapping,
    /// The geometry, validated and checked against the memfd size when the table was created or
    /// opened; never re-read from shared memory.
    geometry: Geometry,
    /// The session id from the header.
    session_id: u64,
}

impl SessionTable {
    /// Daemon: creates the table memfd for a session (`table_bytes(geometry)` bytes, all entries
    /// zero: no page exists), writes the header with status open, and seals it. Returns the memfd
    /// to hand to the client and the daemon's writable table.
    pub fn create(session_id: u64, geometry: &Geometry) -> Result<(Memfd, SessionTable), ShmError> {
        geometry.validate()?;
        let memfd = Memfd::create(&format!("kvmm-table-{session_id}"), table_bytes(geometry))?;
        let mapping = Mapping::map(&memfd, Access::ReadWrite)?;
        let header = TableHeader {
            magic: TABLE_MAGIC,
            abi_version: ABI_VERSION,
            header_bytes: TABLE_HEADER_BYTES,
            session_id,
            layers: geometry.layers,
            blocks_per_layer: geometry.blocks_per_layer(),
            kv_heads: geometry.kv_heads,
            q_heads: geometry.q_heads,
            head_dim: geometry.head_dim,
            block_tokens: geometry.block_tokens,
            element_type: element_type_code(geometry.element_type),
            entry_bytes: DAEMON_ENTRY_BYTES,
            page_bytes: geometry.page_bytes(),
            max_tokens: geometry.max_tokens,
            status: AtomicU32::new(TableStatus::Open.code()),
            _reserved: [0; 14],
        };
        // SAFETY: the mapping is writable, page-aligned (so aligned for `TableHeader`) and at least
        // `TABLE_HEADER_BYTES` long (`table_bytes` includes the header). The memfd was created just
        // now and has not been shared, so nobody else can observe or hold references to these bytes.
        unsafe { ptr::write(mapping.as_mut_ptr().cast::<TableHeader>(), header) };
        memfd.seal(TABLE_SEALS)?;
        let table = SessionTable { mapping, geometry: *geometry, session_id };
        Ok((memfd, table))
    }

    /// Client: maps a table received from the daemon read-only and checks it: the seals, the magic,
    /// the ABI version and sizes, the geometry, and that the memfd is exactly as large as the
    /// geometry implies. Every mismatch is an error that says what was expected.
    pub fn open(memfd: Memfd) -> Result<SessionTable, ShmError> {
        memfd.require_seals(REGION, Seals::SHRINK | Seals::GROW | Seals::FUTURE_WRITE)?;
        if memfd.len() < u64::from(TABLE_HEADER_BYTES) {
            return Err(ShmError::layout(
                REGION,
                "memfd size",
                format!("at least {TABLE_HEADER_BYTES} bytes"),
                format!("{} bytes", memfd.len()),
            ));
        }
        let mapping = Mapping::map(&memfd, Access::ReadOnly)?;
        let header = header_in(&mapping);
        if header.magic != TABLE_MAGIC {
            return Err(ShmError::layout(REGION, "magic", render_magic(TABLE_MAGIC), render_magic(header.magic)));
        }
        let expect = |field: &'static str, expected: u64, found: u64| {
            if expected == found { Ok(()) } else { Err(ShmError::layout(REGION, field, expected, found)) }
        };
        expect("abi_version", u64::from(ABI_VERSION), u64::from(header.abi_version))?;
        expect("header_bytes", u64::from(TABLE_HEADER_BYTES), u64::from(header.header_bytes))?;
        expect("entry_bytes", u64::from(DAEMON_ENTRY_BYTES), u64::from(header.entry_bytes))?;
        let geometry = Geometry {
            layers: header.layers,
            kv_heads: header.kv_heads,
            q_heads: header.q_heads,
            head_dim: header.head_dim,
            block_tokens: header.block_tokens,
            element_type: element_type_from_code(header.element_type)?,
            max_tokens: header.max_tokens,
        };
        geometry.validate()?;
        expect("blocks_per_layer", u64::from(geometry.blocks_per_layer()), u64::from(header.blocks_per_layer))?;
        expect("page_bytes", geometry.page_bytes(), header.page_bytes)?;
        expect("memfd size", table_bytes(&geometry), memfd.len())?;
        header.status()?;
        let session_id = header.session_id;
        Ok(SessionTable { mapping, geometry, session_id })
    }

    /// The header.
    pub fn header(&self) -> &TableHeader {
        header_in(&self.mapping)
    }

    /// The underlying mapping (read-only for a client's session table).
    pub fn mapping(&self) -> &Mapping {
        &self.mapping
    }

    /// The geometry (as validated when the table was created or opened).
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The session id from the header.
    pub fn session_id(&self) -> u64 {
        self.session_id
    }

    /// True in the daemon that created the table.
    pub fn is_writable(&self) -> bool {
        self.mapping.is_writable()
    }

    /// All entries, layer by layer.
    pub fn entries(&self) -> &[DaemonEntry] {
        let count = self.geometry.pages() as usize;
        // SAFETY: `table_bytes(geometry)` = header + `count` entries is the mapping's length
        // (checked by `open`, implied by `create`); the entries start at byte 128, a multiple of
        // their 32-byte alignment, in a page-aligned mapping. All their fields are atomics, so
        // concurrent writes by the daemon are allowed, and `DaemonEntry`'s public methods only load
        // with relaxed ordering, which is allowed on the client's read-only mapping.
        unsafe { self.mapping.view_slice::<DaemonEntry>(TABLE_HEADER_BYTES as usize, count) }
    }

    /// The entry of page `(layer, block)`, or an error naming the table's limits.
    pub fn entry(&self, layer: u32, block: u32) -> Result<&DaemonEntry, ShmError> {
        let index = crate::layout::entry_index(REGION, &self.geometry, layer, block)?;
        Ok(&self.entries()[index])
    }

    /// The `blocks_per_layer` entries of `layer`.
    pub fn entries_of_layer(&self, layer: u32) -> Result<&[DaemonEntry], ShmError> {
        let start = crate::layout::layer_start(REGION, &self.geometry, layer)?;
        let blocks = self.geometry.blocks_per_layer() as usize;
        Ok(&self.entries()[start..start + blocks])
    }

    /// Daemon: write access to the entry of page `(layer, block)`. Fails on a client's read-only
    /// table.
    pub fn entry_writer(&self, layer: u32, block: u32) -> Result<EntryWriter<'_>, ShmError> {
        if !self.is_writable() {
            return Err(ShmError::ReadOnly { what: "writing a session-table entry" });
        }
        Ok(EntryWriter { entry: self.entry(layer, block)? })
    }

    /// The session's status (see [`TableHeader::status`]).
    pub fn status(&self) -> Result<TableStatus, ShmError> {
        self.header().status()
    }

    /// Daemon: publishes the session's status, ordered before every later access of this thread
    /// (a `Release` store, then a `SeqCst` fence). A wipe publishes `Wiped` before it clears the
    /// entries and zeroes the frames, which a client may be reading under a pin: a client that read
    /// a byte the wipe wrote sees `Wiped` in [`SessionTable::status_after_access`] afterwards. Fails
    /// on a client's read-only table.
    pub fn set_status(&self, status: TableStatus) -> Result<(), ShmError> {
        if !self.is_writable() {
            return Err(ShmError::ReadOnly { what: "setting the session status" });
        }
        self.header().status.store(status.code(), Ordering::Release);
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// Client: the session's status, ordered after every earlier access of this thread to the
    /// session's pages (a `SeqCst` fence, then the load): the pairing of [`SessionTable::set_status`].
    pub fn status_after_access(&self) -> Result<TableStatus, ShmError> {
        fence(Ordering::SeqCst);
        self.status()
    }
}

/// The header at the start of a table mapping of at least `TABLE_HEADER_BYTES` bytes.
fn header_in(mapping: &Mapping) -> &TableHeader {
    debug_assert!(mapping.len() >= TABLE_HEADER_BYTES as usize);
    // SAFETY: every caller has checked (`open`) or ensured (`create`) that the mapping holds at
    // least `TABLE_HEADER_BYTES` bytes, and mappings are page-aligned. Every bit pattern is a valid
    // `TableHeader`. Its plain fields are written only by `create`, before the memfd is shared and
    // before any reference exists, so they are immutable while references live; `status` is
    // atomic. On a client's read-only mapping only relaxed loads go through it
    // (`TableHeader::status`; `set_status` refuses read-only tables).
    unsafe { &mapping.view_slice::<TableHeader>(0, 1)[0] }
}

impl fmt::Debug for SessionTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionTable")
            .field("session_id", &self.session_id)
            .field("geometry", &self.geometry)
            .field("writable", &self.is_writable())
            .finish_non_exhaustive()
    }
}

/// Daemon-only write access to one [`DaemonEntry`] of a writable table. Dereferences to the entry
/// for reads.
///
/// Resident pages change only under a [`MigrateTicket`] (see [`crate::protocol`]); pages that are
/// not resident can be published or cleared directly, because no client can hold a pin on them.
pub struct EntryWriter<'a> {
    /// An entry in the daemon's writable mapping.
    entry: &'a DaemonEntry,
}

impl EntryWriter<'_> {
    /// Makes a page that is not resident (new, freed or demoted) resident at `location`: writes the
    /// location, then `state = (generation + 1) | ALLOCATED | RESIDENT` with `Release`.
    pub fn publish_new(&self, location: PageLocation) {
        self.entry.store_location(location);
        protocol::publish_resident(&self.entry.state);
    }

    /// Marks the page as not existing and zeroes its location, without the protocol. Only for pages
    /// no client can be using: not resident, or owned by a client that is gone. Free resident pages
    /// with [`EntryWriter::try_begin_migrate`] and [`EntryWriter::finish_free`].
    pub fn clear(&self) {
        protocol::clear(&self.entry.state);
        self.entry.store_location(PageLocation::default());
    }

    /// Claims the page for moving, demoting or freeing, unless a client holds a pin on it (then the
    /// page is skipped; the daemon never waits). `client` is the page's entry in the client region.
    pub fn try_begin_migrate(&self, client: &ClientEntry) -> Result<MigrateTicket, MigrateSkip> {
        protocol::try_begin_migrate(&self.entry.state, &client.pins)
    }

    /// Batch step 1: claims the page without checking pins ([`protocol::migrate_announce`]).
    /// Follow with one [`protocol::migrate_fence`] for the batch, then
    /// [`EntryWriter::migrate_check`] per page.
    pub fn migrate_announce(&self) -> Result<MigrateTicket, MigrateSkip> {
        protocol::migrate_announce(&self.entry.state)
    }

    /// Batch step 3: checks pins after the fence ([`protocol::migrate_check`]).
    pub fn migrate_check(&self, client: &ClientEntry, ticket: MigrateTicket) -> Result<MigrateTicket, MigrateSkip> {
        protocol::migrate_check(&self.entry.state, &client.pins, ticket)
    }

    /// Publishes the page at `location` (bytes already copied there) and bumps the generation.
    /// The old frame may be reused as soon as this returns.
    pub fn finish_migrate(&self, ticket: MigrateTicket, location: PageLocation) {
        self.debug_check_ticket(&ticket);
        self.entry.store_location(location);
        protocol::finish_migrate(&self.entry.state, ticket);
    }

    /// The page left the device tier but still exists; clients fault it back in.
    pub fn finish_evict(&self, ticket: MigrateTicket) {
        self.debug_check_ticket(&ticket);
        self.entry.store_location(PageLocation::default());
        protocol::finish_evict(&self.entry.state, ticket);
    }

    /// The page was freed.
    pub fn finish_free(&self, ticket: MigrateTicket) {
        self.debug_check_ticket(&ticket);
        self.entry.store_location(PageLocation::default());
        protocol::finish_free(&self.entry.state, ticket);
    }

    /// The page was dropped by opt-in eviction (claimed, so no client reads it); readers skip it.
    pub fn finish_drop(&self, ticket: MigrateTicket) {
        self.debug_check_ticket(&ticket);
        self.entry.store_location(PageLocation::default());
        protocol::finish_drop(&self.entry.state, ticket);
    }

    /// Marks a page that is not resident (it lives in a lower tier) as dropped.
    pub fn mark_dropped(&self) {
        protocol::mark_dropped(&self.entry.state);
        self.entry.store_location(PageLocation::default());
    }

    /// Withdraws the claim; nothing changed.
    pub fn abort_migrate(&self, ticket: MigrateTicket) {
        self.debug_check_ticket(&ticket);
        protocol::abort_migrate(&self.entry.state, ticket);
    }

    fn debug_check_ticket(&self, ticket: &MigrateTicket) {
        if cfg!(debug_assertions) {
            let (generation, flags) = self.entry.load_state(Ordering::Relaxed);
            debug_assert!(
                generation == ticket.generation() && flags.contains(crate::state::PageFlags::MIGRATING),
                "migration ticket for generation {} used on an entry at generation {generation} \
                 with flags {flags:?}",
                ticket.generation()
            );
        }
    }
}

impl Deref for EntryWriter<'_> {
    type Target = DaemonEntry;

    fn deref(&self) -> &DaemonEntry {
        self.entry
    }
}

impl fmt::Debug for EntryWriter<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("EntryWriter").field(self.entry).finish()
    }
}
