//! `kvmm.v1.Session` on `kvmm.sock`: converts messages, takes the caller's identity from the
//! connection, and calls [`Daemon`]. No logic lives here beyond translation. Every RPC runs in an
//! info-level span named after it that carries the session id (Attach: the caller's uid and pid),
//! so every line logged on its behalf names the session; refused Extend and Fault requests are
//! logged, rate-limited ([`crate::ratelog`]).

use std::sync::Arc;

use kvmm_proto::v1 as pb;
use kvmm_shm::{DEFAULT_BLOCK_TOKENS, Geometry};
use tonic::{Request, Response, Status};

use super::conn::ConnInfo;
use crate::daemon::{AttachGrant, Daemon, ExpectedShape, SessionOptions, WipeReport, WipeScope};
use crate::error::Error;
use crate::session::Priority;

/// The session service.
#[derive(Debug, Clone)]
pub struct SessionService {
    daemon: Arc<Daemon>,
}

impl SessionService {
    /// A service over `daemon`.
    pub fn new(daemon: Arc<Daemon>) -> Self {
        SessionService { daemon }
    }
}

impl SessionService {
    /// An attach or resume grant on the wire.
    fn grant_to_pb(&self, g: &AttachGrant) -> pb::AttachResponse {
        pb::AttachResponse {
            session_id: g.session_id,
            fd_token: g.fd_token.to_vec(),
            fd_token_ttl_ms: self.daemon.config.fd_token_ttl.as_millis() as u32,
            arena_bytes: g.arena_bytes,
            table_bytes: g.table_bytes,
            client_region_bytes: g.client_region_bytes,
            page_bytes: g.geometry.page_bytes(),
            blocks_per_layer: g.geometry.blocks_per_layer(),
            geometry: Some(geometry_to_pb(&g.geometry)),
            linger_ms: g.linger.as_millis() as u32,
            allocated_blocks: g.allocated_blocks,
        }
    }
}

/// The caller's identity, from the connection (never from the request).
pub fn caller<T>(req: &Request<T>) -> Result<ConnInfo, Status> {
    req.extensions()
        .get::<ConnInfo>()
        .copied()
        .ok_or_else(|| Status::internal("the connection carries no peer credentials"))
}

/// Converts a wire geometry, filling defaults; range checks happen in `Geometry::validate`.
pub fn geometry_from_pb(g: Option<pb::Geometry>) -> Result<Geometry, Error> {
    let g = g.ok_or_else(|| {
        Error::InvalidArgument(
            "Attach needs a geometry: layers, kv_heads, q_heads, head_dim, block_tokens and max_tokens".to_owned(),
        )
    })?;
    let element_type = match pb::ElementType::try_from(g.element_type) {
        Ok(pb::ElementType::Unspecified | pb::ElementType::F16) => kvmm_kernels::ElementType::F16,
        Ok(pb::ElementType::Bf16) => kvmm_kernels::ElementType::Bf16,
        Err(_) => {
            return Err(Error::InvalidArgument(format!(
                "element_type {} is unknown; use ELEMENT_TYPE_F16 or ELEMENT_TYPE_BF16",
                g.element_type
            )));
        }
    };
    Ok(Geometry {
        layers: g.layers,
        kv_heads: g.kv_heads,
        q_heads: g.q_heads,
        head_dim: g.head_dim,
        block_tokens: if g.block_tokens == 0 { DEFAULT_BLOCK_TOKENS } else { g.block_tokens },
        element_type,
        max_tokens: g.max_tokens,
    })
}

/// The shape a `Resume` expects, from the wire: zero `block_tokens` and `max_tokens` and an
/// unspecified element type stand for whatever the session has.
fn expected_shape(g: &pb::Geometry) -> Result<ExpectedShape, Error> {
    let element_type = match pb::ElementType::try_from(g.element_type) {
        Ok(pb::ElementType::Unspecified) => None,
        Ok(pb::ElementType::F16) => Some(kvmm_kernels::ElementType::F16),
        Ok(pb::ElementType::Bf16) => Some(kvmm_kernels::ElementType::Bf16),
        Err(_) => {
            return Err(Error::InvalidArgument(format!(
                "element_type {} is unknown; use ELEMENT_TYPE_F16, ELEMENT_TYPE_BF16 or leave it unspecified",
                g.element_type
            )));
        }
    };
    Ok(ExpectedShape {
        layers: g.layers,
        kv_heads: g.kv_heads,
        q_heads: g.q_heads,
        head_dim: g.head_dim,
        block_tokens: (g.block_tokens != 0).then_some(g.block_tokens),
        element_type,
        max_tokens: (g.max_tokens != 0).then_some(g.max_tokens),
    })
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

fn priority_from_pb(p: i32) -> Result<Priority, Error> {
    match pb::Priority::try_from(p) {
        Ok(pb::Priority::Unspecified | pb::Priority::Foreground) => Ok(Priority::Foreground),
        Ok(pb::Priority::Background) => Ok(Priority::Background),
        Ok(pb::Priority::Batch) => Ok(Priority::Batch),
        Err(_) => Err(Error::InvalidArgument(format!(
            "priority {p} is unknown; use PRIORITY_FOREGROUND, PRIORITY_BACKGROUND or PRIORITY_BATCH"
        ))),
    }
}

pub fn priority_to_pb(p: Priority) -> pb::Priority {
    match p {
        Priority::Foreground => pb::Priority::Foreground,
        Priority::Background => pb::Priority::Background,
        Priority::Batch => pb::Priority::Batch,
    }
}

/// A wipe report on the wire.
pub fn wipe_to_pb(r: WipeReport) -> pb::WipeResponse {
    pb::WipeResponse { device_bytes: r.device, dram_bytes: r.dram, flash_bytes: r.flash, sessions: r.sessions }
}

#[tonic::async_trait]
impl pb::session_server::Session for SessionService {
    async fn attach(&self, req: Request<pb::AttachRequest>) -> Result<Response<pb::AttachResponse>, Status> {
        let who = caller(&req)?;
        let _span = tracing::info_span!("Attach", uid = who.uid, pid = who.pid).entered();
        let r = req.into_inner();
        let geometry = geometry_from_pb(r.geometry)?;
        let priority = priority_from_pb(r.priority)?;
        let options = SessionOptions {
            model_id: r.model_id,
            priority,
            quota_tokens: r.quota_tokens,
            evict: r.evict,
            linger: std::time::Duration::from_millis(r.linger_ms.into()),
        };
        let g = self.daemon.attach(who, geometry, options)?;
        Ok(Response::new(self.grant_to_pb(&g)))
    }

    async fn resume(&self, req: Request<pb::ResumeRequest>) -> Result<Response<pb::AttachResponse>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let session_id = r.session_id;
        let _span = tracing::info_span!("Resume", session = session_id, uid = who.uid, pid = who.pid).entered();
        let expected = r.geometry.map(|g| expected_shape(&g)).transpose()?;
        let g = self.daemon.resume(who, session_id, expected).inspect_err(|e| {
            crate::limited!(info, code = ?super::status::code(e.kind()), error = %e, "Resume refused");
        })?;
        Ok(Response::new(self.grant_to_pb(&g)))
    }

    async fn list_orphans(
        &self,
        req: Request<pb::ListOrphansRequest>,
    ) -> Result<Response<pb::ListOrphansResponse>, Status> {
        let who = caller(&req)?;
        let _span = tracing::info_span!("ListOrphans", uid = who.uid, pid = who.pid).entered();
        let model_id = req.into_inner().model_id;
        let orphans = self
            .daemon
            .orphans(who, &model_id)
            .into_iter()
            .map(|o| pb::Orphan {
                session_id: o.session_id,
                model_id: o.model_id,
                geometry: Some(geometry_to_pb(&o.geometry)),
                tokens: o.tokens,
                allocated_blocks: o.allocated_blocks,
                linger_ms: o.linger.as_millis() as u32,
                orphaned_ms: o.orphaned.as_millis() as u64,
                expires_in_ms: o.linger.saturating_sub(o.orphaned).as_millis() as u64,
                bytes: o.bytes,
                pid: o.pid,
                process: o.process,
            })
            .collect();
        Ok(Response::new(pb::ListOrphansResponse { orphans }))
    }

    async fn extend(&self, req: Request<pb::ExtendRequest>) -> Result<Response<pb::ExtendResponse>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let span = tracing::info_span!("Extend", session = r.session_id);
        // Extend may demote pages to make room, which can wait on flash I/O: off the async workers.
        let daemon = self.daemon.clone();
        let (allocated_blocks, device_bytes) = super::off_workers("extend", move || {
            span.in_scope(|| {
                daemon.extend(who, r.session_id, r.blocks).inspect_err(|e| {
                    crate::limited!(info, code = ?super::status::code(e.kind()), error = %e, "Extend refused");
                })
            })
        })
        .await??;
        Ok(Response::new(pb::ExtendResponse { allocated_blocks, device_bytes }))
    }

    async fn truncate(&self, req: Request<pb::TruncateRequest>) -> Result<Response<pb::TruncateResponse>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let span = tracing::info_span!("Truncate", session = r.session_id, blocks = r.blocks);
        // Truncating zeroes the frames it frees and may punch out flash slots: off the async workers.
        let daemon = self.daemon.clone();
        let report = super::off_workers("truncate", move || {
            span.in_scope(|| {
                daemon.truncate(who, r.session_id, r.blocks).inspect_err(|e| {
                    crate::limited!(info, code = ?super::status::code(e.kind()), error = %e, "Truncate refused");
                })
            })
        })
        .await??;
        Ok(Response::new(pb::TruncateResponse {
            allocated_blocks: report.allocated_blocks,
            freed_pages: report.freed_pages,
            freed_bytes: report.freed_bytes,
            device_bytes: report.device_bytes,
        }))
    }

    async fn prefetch(&self, req: Request<pb::PrefetchRequest>) -> Result<Response<pb::PrefetchResponse>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let _span = tracing::info_span!("Prefetch", session = r.session_id).entered();
        let layers = r.first_layer..r.first_layer.saturating_add(r.layers);
        let blocks = r.first_block..r.first_block.saturating_add(r.blocks);
        let (resident_pages, scheduled_pages) = self.daemon.prefetch(who, r.session_id, layers, blocks)?;
        Ok(Response::new(pb::PrefetchResponse { resident_pages, scheduled_pages }))
    }

    async fn fault(&self, req: Request<pb::FaultRequest>) -> Result<Response<pb::FaultResponse>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let span = tracing::info_span!("Fault", session = r.session_id, pages = r.pages.len());
        let pages: Vec<(u32, u32)> = r.pages.iter().map(|p| (p.layer, p.block)).collect();
        // Promotion reads flash and may demote other pages: off the async workers.
        let daemon = self.daemon.clone();
        let session_id = r.session_id;
        let out = super::off_workers("fault", move || {
            span.in_scope(|| {
                daemon.fault(who, session_id, &pages).inspect_err(|e| {
                    crate::limited!(info, code = ?super::status::code(e.kind()), error = %e, "Fault failed");
                })
            })
        })
        .await??;
        Ok(Response::new(pb::FaultResponse {
            pages: out
                .into_iter()
                .map(|p| pb::PageResidency {
                    page: Some(pb::PageRef { layer: p.layer, block: p.block }),
                    resident: p.resident,
                    tier: if p.resident { pb::Tier::Device } else { pb::Tier::Unspecified } as i32,
                    generation: p.generation,
                    dropped: p.dropped,
                })
                .collect(),
        }))
    }

    async fn detach(&self, req: Request<pb::DetachRequest>) -> Result<Response<pb::DetachResponse>, Status> {
        let who = caller(&req)?;
        let session_id = req.into_inner().session_id;
        let span = tracing::info_span!("Detach", session = session_id);
        // Detaching zeroes the session's frames: off the async workers.
        let daemon = self.daemon.clone();
        let bytes_wiped =
            super::off_workers("detach", move || span.in_scope(|| daemon.detach(who, session_id))).await??;
        Ok(Response::new(pb::DetachResponse { bytes_wiped }))
    }

    async fn wipe(&self, req: Request<pb::WipeRequest>) -> Result<Response<pb::WipeResponse>, Status> {
        let who = caller(&req)?;
        let session_id = req.into_inner().session_id;
        let span = tracing::info_span!("Wipe", session = session_id);
        let daemon = self.daemon.clone();
        let report = super::off_workers("wipe", move || {
            span.in_scope(|| daemon.wipe(WipeScope::Session(session_id), who, true))
        })
        .await??;
        Ok(Response::new(wipe_to_pb(report)))
    }

    async fn session_stats(
        &self,
        req: Request<pb::SessionStatsRequest>,
    ) -> Result<Response<pb::SessionStatsResponse>, Status> {
        let who = caller(&req)?;
        let session_id = req.into_inner().session_id;
        let _span = tracing::info_span!("SessionStats", session = session_id).entered();
        let s = self.daemon.session_stats(who, session_id)?;
        Ok(Response::new(pb::SessionStatsResponse {
            session_id: s.session_id,
            geometry: Some(geometry_to_pb(&s.geometry)),
            model_id: s.model_id,
            priority: priority_to_pb(s.priority) as i32,
            allocated_blocks: s.allocated_blocks,
            tokens: s.tokens,
            device_bytes: s.device_bytes,
            pages_moved: s.counters.moves,
            faults: s.counters.faults,
            prefetches: s.counters.prefetches,
            dram_bytes: s.dram_bytes,
            flash_bytes: s.flash_bytes,
            device_pages: s.pages[0] as u32,
            dram_pages: s.pages[1] as u32,
            flash_pages: s.pages[2] as u32,
            fault_hits: s.counters.fault_hits,
            promoted_from_dram: s.counters.promoted_from_dram,
            promoted_from_flash: s.counters.promoted_from_flash,
            quota_tokens: s.quota.pages_per_layer.map_or(0, |p| p * s.geometry.block_tokens),
            evict: s.quota.evict,
            dropped_pages: s.dropped_pages,
            owner_name: s.owner_name,
            stuck_pins: s.stuck_pins,
            linger_ms: s.linger.as_millis() as u32,
        }))
    }
}
