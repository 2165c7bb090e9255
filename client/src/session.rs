//! A session: one sequence's KV cache in kvmmd, mapped into this process.
//!
//! After `Attach`, the session fetches its memfds over the fd socket and maps its session table
//! (read-only) and its client region (read-write); the trust domain's arena it maps read-write once
//! per client, shared with the client's other sessions (`SharedArena`). Appending writes
//! K/V rows straight into the tail page in the arena and publishes the page's token count with
//! Release; attention pins every page of a layer (one fence for all of them), runs the fused kernel
//! over the pages in place, and unpins. A page is pinned whenever this process reads or writes it,
//! so the daemon never moves it underneath.
//!
//! Locations come from the daemon-written table and are bounds-checked against the arena before any
//! byte is touched.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use kvmm_kernels::attention::{AttnShape, DecodeAttention, PageView};
use kvmm_kernels::format::rows::{RowElement, truncate_rows, write_rows};
use kvmm_kernels::{Format, PageShape};
use kvmm_proto::v1 as pb;
use kvmm_shm::fdpass::{FdRequest, ReceivedReply, SeqpacketConn};
use kvmm_shm::protocol;
use kvmm_shm::{
    Access, ClientEntry, ClientRegion, Geometry, Mapping, Memfd, PageFlags, PageLocation, PinOutcome, Seals,
    SessionTable,
};

use crate::Inner;
use crate::error::{Error, Result};

/// Blocks requested per `Extend` unless the caller says otherwise.
pub const DEFAULT_EXTEND_BATCH: u32 = 4;
/// How long the fd handshake may take.
const FD_TIMEOUT: Duration = Duration::from_secs(5);
/// Pin attempts on a page the daemon is moving before giving up (a move takes microseconds).
const MAX_PIN_ATTEMPTS: u32 = 1_000_000;
/// Faults one pin tries before giving up on a page that keeps being demoted.
const MAX_FAULTS_PER_PAGE: u32 = 8;
/// Weight of the newest attention mass in a page's importance EMA.
const IMPORTANCE_EMA: f32 = 0.1;

/// Scheduling class of a session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Priority {
    /// Interactive; demoted last.
    #[default]
    Foreground,
    /// Can wait.
    Background,
    /// Bulk; demoted first.
    Batch,
}

/// Options for [`crate::Client::attach_with`].
#[derive(Clone, Debug)]
pub struct AttachOptions {
    /// Free-text model id shown in stats.
    pub model_id: String,
    /// Scheduling class.
    pub priority: Priority,
    /// Blocks per layer requested by each `Extend` (at least the blocks needed).
    pub extend_batch: u32,
    /// The most tokens per layer the session may hold in kvmm (rounded down to whole pages); 0: no
    /// quota. Past it, appending fails with `RESOURCE_EXHAUSTED` unless `evict` is set.
    pub quota_tokens: u32,
    /// Opt-in lossy eviction (needs `quota_tokens`): past the quota the daemon drops the pages with
    /// the least accumulated attention mass, never the first page or the last 128 tokens, and
    /// attention skips what was dropped ([`Session::dropped_blocks`]).
    pub evict: bool,
    /// How long the session outlives this client's connection, waiting for a process of the same
    /// uid to take it over with [`crate::Client::resume`] (a crash or a restart keeps the context);
    /// at most the daemon's `max_linger_ms`. Zero (the default): the session is wiped when the
    /// connection closes. Dropping or detaching the [`Session`] ends it at once either way.
    pub linger: Duration,
}

impl Default for AttachOptions {
    fn default() -> Self {
        AttachOptions {
            model_id: String::new(),
            priority: Priority::Foreground,
            extend_batch: DEFAULT_EXTEND_BATCH,
            quota_tokens: 0,
            evict: false,
            linger: Duration::ZERO,
        }
    }
}

/// The part of a session's geometry its model fixes: what [`crate::Client::resume`] checks before
/// it takes a session over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    pub layers: u32,
    pub kv_heads: u32,
    pub q_heads: u32,
    pub head_dim: u32,
}

impl From<&Geometry> for ModelShape {
    fn from(g: &Geometry) -> ModelShape {
        ModelShape { layers: g.layers, kv_heads: g.kv_heads, q_heads: g.q_heads, head_dim: g.head_dim }
    }
}

/// What the daemon reports about a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionStats {
    /// Pages allocated per layer.
    pub allocated_blocks: u32,
    /// Tokens published (minimum over layers).
    pub tokens: u64,
    /// Device-tier bytes owned.
    pub device_bytes: u64,
    /// Pages the daemon moved between frames.
    pub pages_moved: u64,
    /// Pages faulted.
    pub faults: u64,
    /// Bytes of this session's pages in the daemon's DRAM tier and in its flash tier.
    pub dram_bytes: u64,
    pub flash_bytes: u64,
    /// Pages in each tier: device, DRAM, flash.
    pub pages: [u32; 3],
    /// Pages named in faults that were resident already, and pages brought back from DRAM and
    /// from flash.
    pub fault_hits: u64,
    pub promoted_from_dram: u64,
    pub promoted_from_flash: u64,
    /// The quota in force in tokens per layer (0: none), and pages dropped by eviction so far.
    pub quota_tokens: u32,
    pub dropped_pages: u64,
    /// This process's name as the daemon recorded it at attach.
    pub owner_name: String,
}

/// The mapping of a trust domain's arena that a client's sessions share, and the file it maps.
///
/// Every session of a uid gets the same arena memfd, so one mapping serves them all, and it stays
/// while the client lives: a new session's pages, in frames an earlier session of this client
/// used, are already in this process's page tables, where a mapping per session faulted each page
/// in again (`MADV_POPULATE_WRITE` at `Extend`) and unmapped it at detach. Nothing is exposed
/// that a session's own mapping would not show: the arena is the whole trust domain's.
#[derive(Debug)]
pub(crate) struct SharedArena {
    /// `(device, inode)` of the memfd mapped.
    file: (u64, u64),
    mapping: Arc<Mapping>,
}

impl Inner {
    /// The mapping of the arena `memfd`: the one this client's sessions share if it maps the same
    /// file at the same size, else a new one, which later sessions then share (a kvmmd restarted
    /// under a new client hands out a new arena; the old mapping goes with the last session using it).
    fn arena(&self, memfd: &Memfd) -> Result<Arc<Mapping>> {
        let file = memfd.identity()?;
        let mut shared = self.arena.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(arena) = shared.as_ref().filter(|a| a.file == file && a.mapping.len() as u64 == memfd.len()) {
            return Ok(arena.mapping.clone());
        }
        let mapping = Arc::new(Mapping::map(memfd, Access::ReadWrite)?);
        *shared = Some(SharedArena { file, mapping: mapping.clone() });
        Ok(mapping)
    }
}

/// One attached session. Dropping it detaches (the daemon wipes its pages).
#[derive(Debug)]
pub struct Session {
    inner: Arc<Inner>,
    id: u64,
    geometry: Geometry,
    shape: AttnShape,
    page_shape: PageShape,
    format: Format,
    /// The trust domain's arena, read-write (tail pages are written here); one mapping for all of
    /// this client's sessions.
    arena: Arc<Mapping>,
    /// The daemon-written table, mapped read-only.
    table: SessionTable,
    /// Pins, token counts and importance, written by this process.
    region: ClientRegion,
    /// Tokens appended per layer: this process's own count, never read back from shared memory
    /// (except once by `resume`, to carry on where the previous process stopped).
    tokens: Vec<u32>,
    /// Blocks allocated per layer, as the last `Extend` reported.
    allocated_blocks: u32,
    extend_batch: u32,
    /// Softmax scale; 1/sqrt(head_dim) by default.
    scale: f32,
    /// Reused attention state.
    attn: Option<DecodeAttention>,
    /// Per-page attention mass of the last `attention` call.
    mass: Vec<f32>,
    /// The format each page was read in by the last `attention` call; `None` for dropped pages.
    formats: Vec<Option<Format>>,
    /// Most pages one `attention` call reads (query-aware selection); `None` reads every page.
    page_budget: Option<usize>,
    detached: bool,
}

/// Unpins a set of pages when dropped, so an error never leaves a page pinned.
struct Pins<'a> {
    entries: Vec<&'a ClientEntry>,
    /// Blocks found dropped by eviction (not pinned; readers skip them), ascending.
    dropped: Vec<u32>,
}

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        for e in &self.entries {
            e.unpin();
        }
    }
}

impl Session {
    pub(crate) fn attach(inner: Arc<Inner>, geometry: Geometry, options: AttachOptions) -> Result<Session> {
        geometry.validate().map_err(|e| Error::InvalidArgument(format!("invalid geometry: {e}")))?;
        let request = pb::AttachRequest {
            geometry: Some(geometry_to_pb(&geometry)),
            model_id: options.model_id,
            priority: match options.priority {
                Priority::Foreground => pb::Priority::Foreground,
                Priority::Background => pb::Priority::Background,
                Priority::Batch => pb::Priority::Batch,
            } as i32,
            quota_tokens: options.quota_tokens,
            evict: options.evict,
            linger_ms: u32::try_from(options.linger.as_millis()).unwrap_or(u32::MAX),
        };
        let mut rpc = inner.rpc.clone();
        let granted = inner.runtime.block_on(rpc.attach(request))?.into_inner();
        // From here on the daemon holds a session: detach it if the handshake fails.
        match Self::map(&inner, &granted, geometry) {
            Ok(mapped) => Ok(Self::assemble(inner, &granted, geometry, mapped, options.extend_batch)),
            Err(e) => {
                let mut rpc = inner.rpc.clone();
                let _ = inner.runtime.block_on(rpc.detach(pb::DetachRequest { session_id: granted.session_id }));
                Err(e)
            }
        }
    }

    pub(crate) fn resume(inner: Arc<Inner>, session_id: u64, shape: Option<ModelShape>) -> Result<Session> {
        let mut rpc = inner.rpc.clone();
        // Zero block_tokens and max_tokens and no element type: whatever the session has.
        let geometry = shape.map(|s| pb::Geometry {
            layers: s.layers,
            kv_heads: s.kv_heads,
            q_heads: s.q_heads,
            head_dim: s.head_dim,
            ..pb::Geometry::default()
        });
        let granted = inner.runtime.block_on(rpc.resume(pb::ResumeRequest { session_id, geometry }))?.into_inner();
        let geometry = granted
            .geometry
            .as_ref()
            .map(geometry_from_pb)
            .ok_or_else(|| Error::Protocol("Resume returned no geometry".to_owned()))?;
        geometry.validate().map_err(|e| Error::Protocol(format!("Resume returned an invalid geometry: {e}")))?;
        if granted.allocated_blocks > geometry.blocks_per_layer() {
            return Err(Error::Protocol(format!(
                "Resume reported {} allocated blocks, more than the geometry's {}",
                granted.allocated_blocks,
                geometry.blocks_per_layer()
            )));
        }
        // Unlike after Attach, a failure here leaves the session to the daemon: it is bound to this
        // connection and lingers again once the connection closes.
        let mapped = Self::map(&inner, &granted, geometry)?;
        let mut session = Self::assemble(inner, &granted, geometry, mapped, DEFAULT_EXTEND_BATCH);
        // The token counts this process's predecessor published, as the daemon carried them over.
        session.allocated_blocks = granted.allocated_blocks;
        let bt = geometry.block_tokens;
        for layer in 0..geometry.layers {
            let entries = session.region.entries_of_layer(layer)?;
            let published: u32 =
                entries.iter().take(granted.allocated_blocks as usize).map(|e| e.tokens().min(bt)).sum();
            session.tokens[layer as usize] = published;
        }
        session.prefault(0..granted.allocated_blocks);
        Ok(session)
    }

    /// A session over freshly mapped memory, with no pages allocated as far as it knows.
    fn assemble(
        inner: Arc<Inner>,
        granted: &pb::AttachResponse,
        geometry: Geometry,
        (arena, table, region): (Arc<Mapping>, SessionTable, ClientRegion),
        extend_batch: u32,
    ) -> Session {
        let shape = AttnShape {
            q_heads: geometry.q_heads as usize,
            kv_heads: geometry.kv_heads as usize,
            head_dim: geometry.head_dim as usize,
            block_tokens: geometry.block_tokens as usize,
        };
        Session {
            id: granted.session_id,
            geometry,
            shape,
            page_shape: geometry.page_shape(),
            format: geometry.format(),
            arena,
            table,
            region,
            tokens: vec![0; geometry.layers as usize],
            allocated_blocks: 0,
            extend_batch: extend_batch.max(1),
            scale: 1.0 / (geometry.head_dim as f32).sqrt(),
            attn: None,
            mass: Vec::new(),
            formats: Vec::new(),
            page_budget: None,
            detached: false,
            inner,
        }
    }

    /// The fd handshake and the three mappings (the arena's shared with the client's other sessions).
    fn map(
        inner: &Inner,
        granted: &pb::AttachResponse,
        geometry: Geometry,
    ) -> Result<(Arc<Mapping>, SessionTable, ClientRegion)> {
        let token: [u8; 32] = granted
            .fd_token
            .as_slice()
            .try_into()
            .map_err(|_| Error::Protocol(format!("fd token of {} bytes, expected 32", granted.fd_token.len())))?;
        let conn = SeqpacketConn::connect(&inner.fd_socket)?;
        conn.set_timeouts(FD_TIMEOUT)?;
        conn.send_request(&FdRequest { session_id: granted.session_id, token })?;
        match conn.recv_reply()? {
            ReceivedReply::Refused { code, message } => {
                Err(Error::FdRefused { code: tonic::Code::from(code as i32), message })
            }
            ReceivedReply::Granted(fds) => {
                let sizes = [
                    (fds.arena.len(), granted.arena_bytes, "arena"),
                    (fds.table.len(), granted.table_bytes, "session table"),
                    (fds.client_region.len(), granted.client_region_bytes, "client region"),
                ];
                for (actual, attached, what) in sizes {
                    if actual != attached {
                        return Err(Error::Protocol(format!(
                            "the {what} memfd is {actual} bytes but Attach announced {attached}"
                        )));
                    }
                }
                // A resizable arena would let another process of this uid make reads fault (SIGBUS).
                fds.arena.require_seals("arena", Seals::SHRINK | Seals::GROW)?;
                let arena = inner.arena(&fds.arena)?;
                let table = SessionTable::open(fds.table)?;
                if table.geometry() != geometry || table.session_id() != granted.session_id {
                    return Err(Error::Protocol("the session table describes another session".to_owned()));
                }
                let region = ClientRegion::open(fds.client_region, &geometry)?;
                Ok((arena, table, region))
            }
        }
    }

    /// The session id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Tokens appended to `layer`.
    pub fn tokens(&self, layer: u32) -> u32 {
        self.tokens.get(layer as usize).copied().unwrap_or(0)
    }

    /// Blocks allocated per layer.
    pub fn allocated_blocks(&self) -> u32 {
        self.allocated_blocks
    }

    /// Sets the softmax scale (default 1/sqrt(head_dim)).
    pub fn set_scale(&mut self, scale: f32) {
        self.scale = scale;
    }

    /// Limits each `attention` call to `pages` pages (at least 3: the first page, the two most recent,
    /// and the pages whose key bounds allow the largest attention share for the query), or reads
    /// every page with `None`. Sparse attention reads less memory; it is exact when the budget covers
    /// the layer.
    pub fn set_page_budget(&mut self, pages: Option<usize>) -> Result<()> {
        if let Some(n) = pages
            && n < 3
        {
            return Err(Error::InvalidArgument(format!(
                "a page budget of {n} is too small: the first page and the two most recent are always read, so use at least 3"
            )));
        }
        self.page_budget = pages;
        Ok(())
    }

    /// Per-page attention mass of the last `attention` call (sums to 1; 0 for pages not read).
    pub fn last_mass(&self) -> &[f32] {
        &self.mass
    }

    /// The format each page was in when the last `attention` call read it (pages change format when
    /// the daemon recompresses them); `None` for pages eviction dropped.
    pub fn last_formats(&self) -> &[Option<Format>] {
        &self.formats
    }

    /// The blocks of `layer` that eviction dropped (see [`AttachOptions::evict`]), ascending.
    pub fn dropped_blocks(&self, layer: u32) -> Result<Vec<u32>> {
        self.check_layer(layer)?;
        Ok((0..self.allocated_blocks).filter(|&b| self.is_dropped(layer, b)).collect())
    }

    fn check_layer(&self, layer: u32) -> Result<()> {
        if let Ok(status) = self.table.status()
            && status.is_wiped()
        {
            return Err(self.wiped(status));
        }
        if layer >= self.geometry.layers {
            return Err(Error::InvalidArgument(format!(
                "layer {layer} is out of range: this session has layers 0..{}",
                self.geometry.layers
            )));
        }
        Ok(())
    }

    /// The error of every call on a wiped (or revoked) session.
    fn wiped(&self, status: kvmm_shm::TableStatus) -> Error {
        let by = match status {
            kvmm_shm::TableStatus::Revoked => {
                "revoked by kvmmd because one of its pages stayed pinned past the daemon's pin lease"
            }
            // Only `wipe` leaves a session this process still holds marked detached.
            _ if self.detached => "wiped by this process",
            _ => "wiped by an administrator",
        };
        Error::FailedPrecondition(format!("session {} was {by}; its data is gone: attach a new session", self.id))
    }

    /// A wipe zeroes and frees the session's frames even while they are pinned, so every access to
    /// pinned pages ends here: if the session was wiped meanwhile (the daemon publishes that before
    /// it touches a frame), whatever the access read or wrote is void and the call fails with
    /// `FAILED_PRECONDITION`, whether the access itself succeeded or tripped over a zeroed page.
    fn after_pinned_access<T>(&self, result: Result<T>) -> Result<T> {
        if let Ok(status) = self.table.status_after_access()
            && status.is_wiped()
        {
            return Err(self.wiped(status));
        }
        result
    }

    /// Appends `n` tokens' K and V rows to `layer`. `k` and `v` each hold `n × kv_heads × head_dim`
    /// elements, token-major (`k[(t * kv_heads + h) * head_dim + d]`): `f32`, or [`f16`](crate::f16)
    /// or [`bf16`](crate::bf16) rows an engine already holds. They are stored as the session's
    /// element type, rounded once to nearest-even; 16-bit rows of the session's own type are copied
    /// bit for bit. New pages are requested in batches, never one RPC per token.
    ///
    /// If a page cannot be had (`RESOURCE_EXHAUSTED`), the tokens that fit in pages already held stay
    /// appended and [`Session::tokens`] says how many; the rest can be appended once room is made.
    pub fn append<E: RowElement>(&mut self, layer: u32, k: &[E], v: &[E]) -> Result<()> {
        self.check_layer(layer)?;
        let row = (self.geometry.kv_heads * self.geometry.head_dim) as usize;
        if k.is_empty() || k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(Error::InvalidArgument(format!(
                "k and v must hold the same whole number of tokens of kv_heads × head_dim = {row} elements; got {} and {}",
                k.len(),
                v.len()
            )));
        }
        let n = (k.len() / row) as u64;
        let have = u64::from(self.tokens[layer as usize]);
        if have + n > u64::from(self.geometry.max_tokens) {
            return Err(Error::InvalidArgument(format!(
                "appending {n} tokens to layer {layer} would make {} tokens, past this session's max_tokens {}",
                have + n,
                self.geometry.max_tokens
            )));
        }
        let bt = self.geometry.block_tokens;
        let mut done = 0usize;
        while done < n as usize {
            let t = self.tokens[layer as usize];
            let (block, slot) = (t / bt, t % bt);
            let take = ((bt - slot) as usize).min(n as usize - done);
            if block >= self.allocated_blocks {
                self.extend_to(block + 1)?;
            }
            let written = self.write_pinned(
                layer,
                block,
                slot,
                &k[done * row..(done + take) * row],
                &v[done * row..(done + take) * row],
            );
            self.after_pinned_access(written)?;
            self.tokens[layer as usize] += take as u32;
            done += take;
        }
        Ok(())
    }

    /// Takes tokens back: every layer keeps its first `tokens` tokens (a layer that holds fewer keeps
    /// what it holds), and the next [`Session::append`] to a layer continues from there: draft tokens
    /// a speculative decoder rejected, an answer to regenerate, a prompt edited after its first part.
    ///
    /// When the tokens taken back lie in at most `extend_batch` pages a layer, all on the device in
    /// the session's element type (the usual case for a few draft tokens), the pages are cut in
    /// place under a pin, with no RPC ([`truncate_rows`]): each is left byte for byte as appending
    /// only its kept rows would have left it (the slots past them zeroed, the key bounds those of
    /// the kept keys), and pages left empty stay allocated, as the pages `Extend` reserves ahead.
    ///
    /// Otherwise every page past the kept tokens goes back to kvmmd in one `Truncate` (frames zeroed,
    /// copies in DRAM and flash freed), with the pages reserved ahead. The page the kept tokens end
    /// inside goes back too: its kept rows are read out first, in whatever format the page is in (a
    /// compressed page gives its decoded values), and appended again at the session's element type.
    /// If they cannot be appended again (`RESOURCE_EXHAUSTED`: another session took the room
    /// meanwhile), the layer keeps the tokens before that page, [`Session::tokens`] says so, and the
    /// error names what was lost.
    ///
    /// Either way the bytes of the tokens taken back are gone from shared memory. A layer whose kept
    /// tokens end inside a page that eviction dropped (see [`AttachOptions::evict`]) cannot be cut
    /// there: `FAILED_PRECONDITION`, nothing changed.
    pub fn truncate(&mut self, tokens: u32) -> Result<()> {
        if let Ok(status) = self.table.status()
            && status.is_wiped()
        {
            return Err(self.wiped(status));
        }
        if self.tokens.iter().all(|&t| t <= tokens) {
            return Ok(());
        }
        let bt = self.geometry.block_tokens;
        let (block, start) = (tokens / bt, tokens / bt * bt);
        let end = self.tokens.iter().map(|&t| t.div_ceil(bt)).max().unwrap_or(0);
        if end - block <= self.extend_batch.max(1) && self.truncate_in_place(tokens)? {
            return Ok(());
        }
        // The kept rows of the page the kept tokens end inside, per layer, read before it goes.
        let mut rewrite = Vec::new();
        for layer in 0..self.geometry.layers {
            let keep = self.tokens[layer as usize].min(tokens);
            if keep <= start {
                continue;
            }
            if self.is_dropped(layer, block) {
                return Err(Error::FailedPrecondition(format!(
                    "cannot keep {tokens} tokens: page ({layer}, {block}), which holds tokens {start}..{} of layer \
                     {layer}, was dropped by eviction; truncate to {start} tokens or to a count past that page",
                    start + bt
                )));
            }
            let (k, v) = self.read_rows(layer, block, keep - start)?;
            rewrite.push((layer, k, v));
        }
        let mut rpc = self.inner.rpc.clone();
        let r = self
            .inner
            .runtime
            .block_on(rpc.truncate(pb::TruncateRequest { session_id: self.id, blocks: block }))?
            .into_inner();
        self.allocated_blocks = r.allocated_blocks;
        for t in &mut self.tokens {
            *t = (*t).min(start);
        }
        for (layer, k, v) in rewrite {
            let lost = (k.len() / (self.geometry.kv_heads * self.geometry.head_dim) as usize) as u32;
            if let Err(e) = self.append(layer, &k, &v) {
                let kept = self.tokens[layer as usize];
                let what = format!(
                    "truncate kept {kept} of the {tokens} tokens asked for in layer {layer}: the last {} could not \
                     be written back into a new page ({e})",
                    start + lost - kept
                );
                return Err(match e.code() {
                    tonic::Code::ResourceExhausted => Error::Exhausted(what),
                    tonic::Code::FailedPrecondition => Error::FailedPrecondition(what),
                    _ => e,
                });
            }
        }
        Ok(())
    }

    /// [`Session::truncate`] in shared memory alone: pins every page that holds tokens past
    /// `tokens`, without faulting; if each one is resident in the session's element type, rewrites
    /// them (see there) and returns true. Otherwise changes nothing and returns false.
    fn truncate_in_place(&mut self, tokens: u32) -> Result<bool> {
        let bt = self.geometry.block_tokens;
        let block = tokens / bt;
        let mut pins = Pins { entries: Vec::new(), dropped: Vec::new() };
        // (layer, block, offset, length, rows kept) of each page to rewrite.
        let mut pages = Vec::new();
        for layer in 0..self.geometry.layers {
            let have = self.tokens[layer as usize];
            if have <= tokens {
                continue;
            }
            for b in block..have.div_ceil(bt) {
                let (page, client) = (self.table.entry(layer, b)?, self.region.entry(layer, b)?);
                if !matches!(client.pin(page), PinOutcome::Pinned { .. }) {
                    return Ok(false);
                }
                pins.entries.push(client);
                let loc = page.location();
                if loc.format != self.format.as_u8() {
                    return Ok(false);
                }
                let (offset, len) = self.checked(loc)?;
                pages.push((layer, b, offset, len, if b == block { tokens % bt } else { 0 }));
            }
        }
        let written = pages.iter().try_for_each(|&(layer, b, offset, len, kept)| -> Result<()> {
            // SAFETY: every page of `pages` is pinned (`pins` lives until after this closure), so the
            // daemon neither moves nor frees its frame; this thread is the session's only writer.
            let page = unsafe { self.arena.bytes_mut(offset, len)? };
            truncate_rows(self.page_shape, self.format, page, kept as usize)?;
            let entry = self.region.entry(layer, b)?;
            entry.publish_tokens(kept);
            if kept == 0 {
                // The attention mass it drew was the tokens' taken back.
                entry.set_importance(0.0);
            }
            Ok(())
        });
        let written = self.after_pinned_access(written);
        drop(pins);
        written?;
        for t in &mut self.tokens {
            *t = (*t).min(tokens);
        }
        Ok(true)
    }

    /// The first `n` tokens' K and V rows of page `(layer, block)` as `f32`, token-major, decoded
    /// from whatever format the page is in.
    fn read_rows(&self, layer: u32, block: u32, n: u32) -> Result<(Vec<f32>, Vec<f32>)> {
        let row = (self.geometry.kv_heads * self.geometry.head_dim) as usize;
        let (mut k, mut v) = (vec![0f32; n as usize * row], vec![0f32; n as usize * row]);
        let read = (|| {
            let (loc, _pin) = self.pin(layer, block)?;
            let (offset, len) = self.checked(loc)?;
            let format = Format::from_u8(loc.format)
                .ok_or_else(|| Error::Protocol(format!("page ({layer}, {block}) has unknown format {}", loc.format)))?;
            // SAFETY: the page is pinned, so the daemon neither moves nor frees the frame while this
            // slice lives (`_pin` outlives it); this thread is the session's only writer.
            let page = unsafe { self.arena.bytes(offset, len)? };
            kvmm_kernels::dequantize(self.page_shape, format, page, n as usize, &mut k, &mut v)?;
            Ok(())
        })();
        self.after_pinned_access(read)?;
        Ok((k, v))
    }

    /// Writes rows at `slot` of a pinned page and publishes the page's new token count (Release).
    fn write_pinned<E: RowElement>(&self, layer: u32, block: u32, slot: u32, k: &[E], v: &[E]) -> Result<()> {
        let (loc, _pin) = self.pin(layer, block)?;
        let (offset, len) = self.checked(loc)?;
        // SAFETY: the page is pinned, so the daemon neither moves nor frees the frame while this
        // slice lives; this process is the only writer of its session's tail pages, and `_pin`
        // outlives the slice.
        let page = unsafe { self.arena.bytes_mut(offset, len)? };
        write_rows(self.page_shape, self.format, page, slot as usize, k, v)?;
        let row = self.shape.kv_heads * self.shape.head_dim;
        self.region.entry(layer, block)?.publish_tokens(slot + (k.len() / row) as u32);
        Ok(())
    }

    /// Decode attention for one query token over every page of `layer`. `q` and `out` hold
    /// `q_heads × head_dim` floats. Pages are read in place, in whatever format each is in.
    pub fn attention(&mut self, layer: u32, q: &[f32], out: &mut [f32]) -> Result<()> {
        self.check_layer(layer)?;
        let want = self.shape.q_heads * self.shape.head_dim;
        if q.len() != want || out.len() != want {
            return Err(Error::InvalidArgument(format!(
                "attention needs q and out of q_heads × head_dim = {} × {} = {want} floats; got q {} and out {}",
                self.shape.q_heads,
                self.shape.head_dim,
                q.len(),
                out.len()
            )));
        }
        let n = self.tokens[layer as usize];
        if n == 0 {
            return Err(Error::FailedPrecondition(format!("layer {layer} has no tokens yet; append before attention")));
        }
        let bt = self.geometry.block_tokens;
        let pages = n.div_ceil(bt);
        // The scratch state is taken out for the call so the pins can borrow the mappings.
        let mut attn = match self.attn.take() {
            Some(mut a) => {
                a.reset(q, self.scale)?;
                a
            }
            None => DecodeAttention::new(self.shape, q, self.scale)?,
        };
        let mut mass = std::mem::take(&mut self.mass);
        mass.resize(pages as usize, 0.0);
        let mut formats = std::mem::take(&mut self.formats);
        formats.clear();
        let result = self.attend_pinned(q, layer, pages, n, &mut attn, out, &mut mass, &mut formats);
        self.attn = Some(attn);
        self.mass = mass;
        self.formats = formats;
        self.after_pinned_access(result)?;
        for (block, &m) in self.mass.iter().enumerate() {
            if self.formats[block].is_none() {
                continue;
            }
            let e = self.region.entry(layer, block as u32)?;
            e.set_importance((1.0 - IMPORTANCE_EMA) * e.importance() + IMPORTANCE_EMA * m);
        }
        Ok(())
    }

    /// Pins the layer's pages, feeds them to the kernel, writes the output, and unpins.
    #[allow(clippy::too_many_arguments)]
    fn attend_pinned(
        &self,
        q: &[f32],
        layer: u32,
        pages: u32,
        tokens: u32,
        attn: &mut DecodeAttention,
        out: &mut [f32],
        mass: &mut [f32],
        formats: &mut Vec<Option<Format>>,
    ) -> Result<()> {
        let bt = self.geometry.block_tokens;
        let pins = self.pin_layer(layer, pages)?;
        // The pages read, in block order, and the block of each: dropped pages are skipped.
        let mut views = Vec::with_capacity(pages as usize);
        let mut blocks = Vec::with_capacity(pages as usize);
        let mut dropped = pins.dropped.iter().peekable();
        for block in 0..pages {
            if dropped.next_if_eq(&&block).is_some() {
                formats.push(None);
                continue;
            }
            let loc = self.table.entry(layer, block)?.location();
            let (offset, len) = self.checked(loc)?;
            let format = Format::from_u8(loc.format)
                .ok_or_else(|| Error::Protocol(format!("page ({layer}, {block}) has unknown format {}", loc.format)))?;
            // SAFETY: every page of the layer that was not dropped is pinned (`pins` lives until this
            // function returns, after the last use of `bytes`), so no frame is moved or freed while it
            // is read; this thread is the session's only writer and does not write during the call.
            let bytes = unsafe { self.arena.bytes(offset, len)? };
            let filled = if block + 1 == pages { tokens - block * bt } else { bt };
            formats.push(Some(format));
            views.push(PageView { bytes, format, tokens: filled as usize });
            blocks.push(block as usize);
        }
        let selected: Vec<usize> = match self.page_budget {
            Some(budget) if budget < views.len() => {
                kvmm_kernels::select_pages(self.shape, q, self.scale, &views, budget)?
            }
            _ => (0..views.len()).collect(),
        };
        // Feed each page with the next one as a prefetch hint: pages are scattered in the arena.
        for (i, &p) in selected.iter().enumerate() {
            match selected.get(i + 1) {
                Some(&next) => attn.page_prefetching(views[p], views[next].bytes)?,
                None => attn.page(views[p])?,
            }
        }
        if selected.len() == pages as usize {
            attn.write_output(out, mass)?;
        } else {
            let mut read = vec![0f32; selected.len()];
            attn.write_output(out, &mut read)?;
            mass.fill(0.0);
            for (&p, &m) in selected.iter().zip(&read) {
                mass[blocks[p]] = m;
            }
        }
        drop(pins);
        Ok(())
    }

    /// Daemon-side statistics of this session.
    pub fn stats(&self) -> Result<SessionStats> {
        let mut rpc = self.inner.rpc.clone();
        let s = self
            .inner
            .runtime
            .block_on(rpc.session_stats(pb::SessionStatsRequest { session_id: self.id }))?
            .into_inner();
        Ok(SessionStats {
            allocated_blocks: s.allocated_blocks,
            tokens: s.tokens,
            device_bytes: s.device_bytes,
            pages_moved: s.pages_moved,
            faults: s.faults,
            dram_bytes: s.dram_bytes,
            flash_bytes: s.flash_bytes,
            pages: [s.device_pages, s.dram_pages, s.flash_pages],
            fault_hits: s.fault_hits,
            promoted_from_dram: s.promoted_from_dram,
            promoted_from_flash: s.promoted_from_flash,
            quota_tokens: s.quota_tokens,
            dropped_pages: s.dropped_pages,
            owner_name: s.owner_name,
        })
    }

    /// Wipes this session now (the daemon zeroes every frame, punches its flash slots out and
    /// destroys its key); later calls fail with `FAILED_PRECONDITION`. Returns the bytes wiped in
    /// the device, DRAM and flash tiers.
    pub fn wipe(&mut self) -> Result<[u64; 3]> {
        let mut rpc = self.inner.rpc.clone();
        let r = self.inner.runtime.block_on(rpc.wipe(pb::WipeRequest { session_id: self.id }))?.into_inner();
        self.detached = true;
        Ok([r.device_bytes, r.dram_bytes, r.flash_bytes])
    }

    /// Detaches now; the daemon wipes the session's pages. Returns the bytes wiped.
    pub fn detach(mut self) -> Result<u64> {
        self.detach_inner()
    }

    fn detach_inner(&mut self) -> Result<u64> {
        self.detached = true;
        detach(&self.inner, self.id)
    }

    /// Asks for enough blocks that `blocks` exist per layer (at least one batch), and pre-faults the
    /// new pages' frames in this process's mapping.
    fn extend_to(&mut self, blocks: u32) -> Result<()> {
        let cap = self.geometry.blocks_per_layer();
        let needed = blocks - self.allocated_blocks;
        let batch = needed.max(self.extend_batch).min(cap - self.allocated_blocks);
        let mut rpc = self.inner.rpc.clone();
        let mut extend =
            |n| self.inner.runtime.block_on(rpc.extend(pb::ExtendRequest { session_id: self.id, blocks: n }));
        let r = match extend(batch) {
            // A full batch may not fit where the pages needed now still do.
            Err(s) if s.code() == tonic::Code::ResourceExhausted && batch > needed => extend(needed)?,
            other => other?,
        }
        .into_inner();
        let old = self.allocated_blocks;
        self.allocated_blocks = r.allocated_blocks;
        self.prefault(old..r.allocated_blocks);
        Ok(())
    }

    /// Faults in the frames of new pages, merging neighbouring frames into one call. Advisory: a page
    /// that moves meanwhile is simply faulted on first touch.
    fn prefault(&self, blocks: std::ops::Range<u32>) {
        let mut ranges: Vec<(usize, usize)> = (0..self.geometry.layers)
            .flat_map(|l| blocks.clone().map(move |b| (l, b)))
            .filter_map(|(l, b)| self.table.entry(l, b).ok().map(|e| e.location()))
            .filter_map(|loc| self.checked(loc).ok())
            .collect();
        ranges.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::new();
        for (off, len) in ranges {
            match merged.last_mut() {
                Some((o, l)) if *o + *l + 4096 >= off => *l = (off + len).max(*o + *l) - *o,
                _ => merged.push((off, len)),
            }
        }
        for (off, len) in merged {
            let _ = self.arena.populate(off, len, Access::ReadWrite);
        }
    }

    /// Pins one page, waiting out a move in progress and faulting it in (one `Fault` per try) when
    /// the daemon has demoted it.
    fn pin(&self, layer: u32, block: u32) -> Result<(PageLocation, Pins<'_>)> {
        let page = self.table.entry(layer, block)?;
        let client = self.region.entry(layer, block)?;
        let mut faults = 0;
        for attempt in 0..MAX_PIN_ATTEMPTS {
            match client.pin(page) {
                PinOutcome::Pinned { .. } => {
                    return Ok((page.location(), Pins { entries: vec![client], dropped: Vec::new() }));
                }
                PinOutcome::Dropped => {
                    return Err(Error::FailedPrecondition(format!(
                        "page ({layer}, {block}) was dropped by eviction and cannot be read or written"
                    )));
                }
                PinOutcome::Migrating => backoff(attempt),
                PinOutcome::NotResident if faults < MAX_FAULTS_PER_PAGE => {
                    self.fault(layer, &[block])?;
                    faults += 1;
                }
                PinOutcome::NotResident => {
                    return Err(Error::Exhausted(format!(
                        "page ({layer}, {block}) was demoted again each of the {MAX_FAULTS_PER_PAGE} times it was \
                         faulted in; the device budget is too small for this workload"
                    )));
                }
            }
        }
        Err(Error::FailedPrecondition(format!("page ({layer}, {block}) stayed in migration; is kvmmd stuck?")))
    }

    /// Asks the daemon to make `blocks` of `layer` resident (one RPC for all of them).
    fn fault(&self, layer: u32, blocks: &[u32]) -> Result<()> {
        let mut rpc = self.inner.rpc.clone();
        let pages = blocks.iter().map(|&block| pb::PageRef { layer, block }).collect();
        self.inner.runtime.block_on(rpc.fault(pb::FaultRequest { session_id: self.id, pages }))?;
        Ok(())
    }

    /// Hints that `layers × blocks` will be read soon: the daemon promotes the pages it holds below
    /// the device in the background. Returns (pages already resident, promotions scheduled).
    pub fn prefetch(&self, layers: std::ops::Range<u32>, blocks: std::ops::Range<u32>) -> Result<(u32, u32)> {
        let mut rpc = self.inner.rpc.clone();
        let request = pb::PrefetchRequest {
            session_id: self.id,
            first_layer: layers.start,
            layers: layers.end.saturating_sub(layers.start),
            first_block: blocks.start,
            blocks: blocks.end.saturating_sub(blocks.start),
        };
        let r = self.inner.runtime.block_on(rpc.prefetch(request))?.into_inner();
        Ok((r.resident_pages, r.scheduled_pages))
    }

    /// Pins blocks `0..pages` of `layer`: announce every pin, one fence, then check each; pages caught
    /// mid-move are retried one by one.
    fn pin_layer(&self, layer: u32, pages: u32) -> Result<Pins<'_>> {
        let n = pages as usize;
        let table = self.table.entries_of_layer(layer)?;
        let region = self.region.entries_of_layer(layer)?;
        let (table, region) = (&table[..n.min(table.len())], &region[..n.min(region.len())]);
        for round in 0..MAX_FAULTS_PER_PAGE {
            for c in region {
                c.pin_announce();
            }
            protocol::pin_fence();
            let mut pins = Pins { entries: Vec::with_capacity(n), dropped: Vec::new() };
            let (mut retry, mut missing) = (Vec::new(), Vec::new());
            for (block, (page, client)) in table.iter().zip(region).enumerate() {
                match client.pin_check(page) {
                    PinOutcome::Pinned { .. } => pins.entries.push(client),
                    PinOutcome::Migrating => retry.push(block as u32),
                    PinOutcome::NotResident => missing.push(block as u32),
                    PinOutcome::Dropped => pins.dropped.push(block as u32),
                }
            }
            // Pages the daemon demoted come back with one Fault for all of them. The pins taken so
            // far are released first: the daemon may need to demote some of these very pages to
            // make room for others' faults, and holding them while waiting could starve everyone.
            if !missing.is_empty() && round + 1 < MAX_FAULTS_PER_PAGE {
                drop(pins);
                self.fault(layer, &missing)?;
                continue;
            }
            for block in retry.into_iter().chain(missing) {
                match self.pin(layer, block) {
                    Ok((_, mut single)) => pins.entries.append(&mut single.entries),
                    // Dropped between the two looks (eviction runs only in this session's own
                    // Extend, so this is rare): skip it like the others.
                    Err(_) if self.is_dropped(layer, block) => pins.dropped.push(block),
                    Err(e) => return Err(e),
                }
            }
            pins.dropped.sort_unstable();
            return Ok(pins);
        }
        Err(Error::Exhausted(format!("the pages of layer {layer} could not all be made resident at once")))
    }

    /// Whether the daemon marked a page dropped.
    fn is_dropped(&self, layer: u32, block: u32) -> bool {
        self.table
            .entry(layer, block)
            .is_ok_and(|e| e.load_state(std::sync::atomic::Ordering::Acquire).1.contains(PageFlags::DROPPED))
    }

    /// Checks a location from the shared table against this session's page format and the arena.
    fn checked(&self, loc: PageLocation) -> Result<(usize, usize)> {
        let format = Format::from_u8(loc.format)
            .ok_or_else(|| Error::Protocol(format!("unknown page format code {}", loc.format)))?;
        let expect = self.page_shape.page_bytes(format);
        let (offset, len) = (loc.offset as usize, loc.len as usize);
        if len != expect || offset.checked_add(len).is_none_or(|end| end > self.arena.len()) {
            return Err(Error::Protocol(format!(
                "page location {offset}+{len} does not fit a {expect}-byte page in the {}-byte arena",
                self.arena.len()
            )));
        }
        Ok((offset, len))
    }
}

fn backoff(attempt: u32) {
    if attempt < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// Converts a geometry to the wire.
pub fn geometry_to_pb(g: &Geometry) -> pb::Geometry {
    pb::Geometry {
        layers: g.layers,
        kv_heads: g.kv_heads,
        q_heads: g.q_heads,
        head_dim: g.head_dim,
        block_tokens: g.block_tokens,
        element_type: match g.element_type {
            kvmm_kernels::ElementType::Bf16 => pb::ElementType::Bf16,
            _ => pb::ElementType::F16,
        } as i32,
        max_tokens: g.max_tokens,
    }
}

/// The `Detach` RPC on session `session_id`: returns the bytes wiped.
pub(crate) fn detach(inner: &Inner, session_id: u64) -> Result<u64> {
    let mut rpc = inner.rpc.clone();
    let r = inner.runtime.block_on(rpc.detach(pb::DetachRequest { session_id }))?;
    Ok(r.into_inner().bytes_wiped)
}

/// A geometry from the wire, as the daemon accepted it.
pub(crate) fn geometry_from_pb(g: &pb::Geometry) -> Geometry {
    Geometry {
        layers: g.layers,
        kv_heads: g.kv_heads,
        q_heads: g.q_heads,
        head_dim: g.head_dim,
        block_tokens: g.block_tokens,
        element_type: match pb::ElementType::try_from(g.element_type) {
            Ok(pb::ElementType::Bf16) => kvmm_kernels::ElementType::Bf16,
            _ => kvmm_kernels::ElementType::F16,
        },
        max_tokens: g.max_tokens,
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.detached {
            // The daemon also wipes the session when the connection closes; this makes it prompt.
            let _ = self.detach_inner();
        }
    }
}
