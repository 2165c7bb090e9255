//! The client region as a mapped object: one [`ClientEntry`] per page, written by the client.
//!
//! The byte layout is in [`crate::layout`]. The daemon creates the memfd (sized for the geometry,
//! header written, sealed `SHRINK | GROW | SEAL` so the client can neither truncate it under the
//! daemon nor grow it), keeps its read-write mapping, and hands the memfd to the client, which maps
//! it read-write too. Everything after the header is atomics, so both sides may access it at any
//! time; the daemon treats every value it reads here as untrusted (clamping token counts and
//! importance) and never reads the header back, since the client may have overwritten it.

use std::fmt;

use crate::error::ShmError;
use crate::geometry::Geometry;
use crate::layout::{CLIENT_HEADER_BYTES, CLIENT_MAGIC, ClientEntry, ClientHeader, client_region_bytes, render_magic};
use crate::mapping::{Access, Mapping};
use crate::memfd::{Memfd, Seals};

/// The seals a client region carries once handed out.
pub const CLIENT_REGION_SEALS: Seals = Seals::SHRINK.union(Seals::GROW).union(Seals::SEAL);

const REGION: &str = "client region";

/// A mapped client region.
pub struct ClientRegion {
    /// Read-write mapping of the whole region memfd (in the daemon and in the client). Unmapped on
    /// drop.
    mapping: Mapping,
    /// The session's geometry, given by the caller (the daemon's own copy, or the one the client
    /// read from the session table), never read from the region.
    geometry: Geometry,
}

impl ClientRegion {
    /// Daemon: creates the region memfd for `geometry` (all entries zero), writes its header and
    /// seals it. Returns the memfd to hand to the client and the daemon's mapping.
    pub fn create(geometry: &Geometry) -> Result<(Memfd, ClientRegion), ShmError> {
        geometry.validate()?;
        let memfd = Memfd::create("kvmm-client-region", client_region_bytes(geometry))?;
        let mapping = Mapping::map(&memfd, Access::ReadWrite)?;
        mapping.write_at(0, &ClientHeader::for_geometry(geometry).encode())?;
        memfd.seal(CLIENT_REGION_SEALS)?;
        Ok((memfd, ClientRegion { mapping, geometry: *geometry }))
    }

    /// Client: maps a region received from the daemon read-write and checks its seals, size and
    /// header against `geometry` (the session table's).
    pub fn open(memfd: Memfd, geometry: &Geometry) -> Result<ClientRegion, ShmError> {
        geometry.validate()?;
        memfd.require_seals(REGION, Seals::SHRINK | Seals::GROW)?;
        let expected_len = client_region_bytes(geometry);
        if memfd.len() != expected_len {
            return Err(ShmError::layout(
                REGION,
                "memfd size",
                format!("{expected_len} bytes"),
                format!("{} bytes", memfd.len()),
            ));
        }
        let mapping = Mapping::map(&memfd, Access::ReadWrite)?;
        let mut bytes = [0u8; CLIENT_HEADER_BYTES as usize];
        mapping.read_at(0, &mut bytes)?;
        let found = ClientHeader::decode(&bytes);
        let expected = ClientHeader::for_geometry(geometry);
        if found.magic != expected.magic {
            return Err(ShmError::layout(REGION, "magic", render_magic(CLIENT_MAGIC), render_magic(found.magic)));
        }
        for (field, want, got) in [
            ("abi_version", expected.abi_version, found.abi_version),
            ("header_bytes", expected.header_bytes, found.header_bytes),
            ("entry_bytes", expected.entry_bytes, found.entry_bytes),
            ("layers", expected.layers, found.layers),
            ("blocks_per_layer", expected.blocks_per_layer, found.blocks_per_layer),
        ] {
            if want != got {
                return Err(ShmError::layout(REGION, field, want, got));
            }
        }
        Ok(ClientRegion { mapping, geometry: *geometry })
    }

    /// The underlying mapping (read-only for a client's session table).
    pub fn mapping(&self) -> &Mapping {
        &self.mapping
    }

    /// The geometry the region was created or opened with.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// All entries, layer by layer.
    pub fn entries(&self) -> &[ClientEntry] {
        let count = self.geometry.pages() as usize;
        // SAFETY: the mapping is `client_region_bytes(geometry)` = 64 + 16 × `count` bytes (created
        // so, or checked by `open`) and read-write; entries start at byte 64, a multiple of their
        // 16-byte alignment, in a page-aligned mapping. Every field of `ClientEntry` is an atomic,
        // so concurrent writes by the other process are allowed and every bit pattern is valid.
        unsafe { self.mapping.view_slice::<ClientEntry>(CLIENT_HEADER_BYTES as usize, count) }
    }

    /// The entry of page `(layer, block)`, or an error naming the region's limits.
    pub fn entry(&self, layer: u32, block: u32) -> Result<&ClientEntry, ShmError> {
        let index = crate::layout::entry_index(REGION, &self.geometry, layer, block)?;
        Ok(&self.entries()[index])
    }

    /// The `blocks_per_layer` entries of `layer`.
    pub fn entries_of_layer(&self, layer: u32) -> Result<&[ClientEntry], ShmError> {
        let start = crate::layout::layer_start(REGION, &self.geometry, layer)?;
        let blocks = self.geometry.blocks_per_layer() as usize;
        Ok(&self.entries()[start..start + blocks])
    }
}

impl fmt::Debug for ClientRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientRegion").field("geometry", &self.geometry).finish_non_exhaustive()
    }
}
