//! `kvmm.v1.Admin` on `kvmm-admin.sock`: operator requests, served only to root, to the uid kvmmd
//! itself runs as (the user of a per-user daemon, who could signal or trace it anyway) and to
//! members of the configured admin group (identity from `SO_PEERCRED`, supplementary groups from
//! `/proc/PID/status`).

use std::sync::Arc;

use kvmm_proto::v1 as pb;
use tonic::{Request, Response, Status};

use super::conn::ConnInfo;
use super::off_workers;
use super::session_service::{caller, geometry_to_pb, priority_to_pb, wipe_to_pb};
use crate::daemon::{Daemon, SessionInfo, Usage, WipeScope};
use crate::error::Error;
use crate::policy::live::PolicyView;
use crate::policy::mode::Pressure;
use crate::policy::sensors::BatteryStatus;
use crate::pool::DEVICE_TIER;

/// The admin service.
#[derive(Debug, Clone)]
pub struct AdminService {
    daemon: Arc<Daemon>,
}

impl AdminService {
    /// A service over `daemon`.
    pub fn new(daemon: Arc<Daemon>) -> Self {
        AdminService { daemon }
    }

    fn authorize(&self, who: ConnInfo) -> Result<(), Error> {
        let daemon_uid = rustix::process::geteuid().as_raw();
        if who.uid == 0 || who.uid == daemon_uid {
            return Ok(());
        }
        if let Some(gid) = self.daemon.config.admin_gid
            && (who.gid == gid || supplementary_groups(who.pid).contains(&gid))
        {
            return Ok(());
        }
        let group = match &self.daemon.config.admin_group {
            Some(g) => format!("root, uid {daemon_uid} (kvmmd's own) or a member of the '{g}' group"),
            None => format!("root or uid {daemon_uid} (kvmmd's own; no admin_group is configured)"),
        };
        Err(Error::PermissionDenied(format!("uid {} may not use the admin API; it is for {group}", who.uid)))
    }
}

/// The supplementary groups of a live process (empty if it cannot be read).
fn supplementary_groups(pid: i32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Groups:"))
                .map(|g| g.split_whitespace().filter_map(|x| x.parse().ok()).collect())
        })
        .unwrap_or_default()
}

/// The kernels' format for a wire format.
fn format_from_pb(f: i32) -> Result<kvmm_kernels::Format, Error> {
    pb::PageFormat::try_from(f)
        .ok()
        .filter(|f| *f != pb::PageFormat::Unspecified)
        .and_then(|f| kvmm_kernels::Format::from_u8(f as u8))
        .ok_or_else(|| Error::InvalidArgument(format!("format {f} is unknown; use PAGE_FORMAT_Q8, _K8V4, _Q4 or _Q2")))
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn wipe_session(&self, req: Request<pb::WipeRequest>) -> Result<Response<pb::WipeResponse>, Status> {
        let who = caller(&req)?;
        self.authorize(who)?;
        let id = req.into_inner().session_id;
        let daemon = self.daemon.clone();
        let report = off_workers("wipe", move || daemon.wipe(WipeScope::Session(id), who, false)).await??;
        Ok(Response::new(wipe_to_pb(report)))
    }

    async fn wipe_user(&self, req: Request<pb::WipeUserRequest>) -> Result<Response<pb::WipeResponse>, Status> {
        let who = caller(&req)?;
        self.authorize(who)?;
        let uid = req.into_inner().uid;
        let daemon = self.daemon.clone();
        let report = off_workers("wipe", move || daemon.wipe(WipeScope::User(uid), who, false)).await??;
        Ok(Response::new(wipe_to_pb(report)))
    }

    async fn wipe_all(&self, req: Request<pb::WipeAllRequest>) -> Result<Response<pb::WipeResponse>, Status> {
        let who = caller(&req)?;
        self.authorize(who)?;
        let daemon = self.daemon.clone();
        let report = off_workers("wipe", move || daemon.wipe(WipeScope::All, who, false)).await??;
        Ok(Response::new(wipe_to_pb(report)))
    }

    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        self.authorize(caller(&req)?)?;
        let sessions = self.daemon.sessions(None)?.into_iter().map(session_info).collect();
        Ok(Response::new(pb::ListSessionsResponse { sessions }))
    }

    async fn session(&self, req: Request<pb::SessionRequest>) -> Result<Response<pb::SessionInfo>, Status> {
        self.authorize(caller(&req)?)?;
        let id = req.into_inner().session_id;
        let info = self.daemon.sessions(Some(id))?.into_iter().next().ok_or(Error::UnknownSession(id))?;
        Ok(Response::new(session_info(info)))
    }

    async fn get_policy(&self, req: Request<pb::GetPolicyRequest>) -> Result<Response<pb::PolicyResponse>, Status> {
        self.authorize(caller(&req)?)?;
        let (policy_toml, view) = self.daemon.policy_now();
        Ok(Response::new(pb::PolicyResponse { policy_toml, status: Some(policy_status(&view)) }))
    }

    async fn set_policy(&self, req: Request<pb::SetPolicyRequest>) -> Result<Response<pb::PolicyResponse>, Status> {
        let who = caller(&req)?;
        self.authorize(who)?;
        let text = req.into_inner().policy_toml;
        tracing::info!(uid = who.uid, pid = who.pid, "SetPolicy");
        self.daemon.set_policy(&text)?;
        let (policy_toml, view) = self.daemon.policy_now();
        Ok(Response::new(pb::PolicyResponse { policy_toml, status: Some(policy_status(&view)) }))
    }

    async fn drain(&self, req: Request<pb::DrainRequest>) -> Result<Response<pb::DrainResponse>, Status> {
        self.authorize(caller(&req)?)?;
        let resume = req.into_inner().resume;
        let daemon = self.daemon.clone();
        let (draining, demoted_pages, left_on_device) = off_workers("drain", move || daemon.drain(resume)).await??;
        Ok(Response::new(pb::DrainResponse { draining, demoted_pages, left_on_device }))
    }

    async fn metrics(&self, req: Request<pb::MetricsRequest>) -> Result<Response<pb::MetricsResponse>, Status> {
        self.authorize(caller(&req)?)?;
        // A scrape takes the core and flash locks briefly (as Status does): off the async workers.
        let daemon = self.daemon.clone();
        let text = off_workers("metrics", move || daemon.metrics.encode(&daemon)).await?;
        Ok(Response::new(pb::MetricsResponse { text }))
    }

    async fn compress(&self, req: Request<pb::CompressRequest>) -> Result<Response<pb::CompressResponse>, Status> {
        self.authorize(caller(&req)?)?;
        let r = req.into_inner();
        let span = tracing::debug_span!("Compress", session = r.session_id);
        let to = format_from_pb(r.format)?;
        let layers = r.first_layer..if r.layers == 0 { u32::MAX } else { r.first_layer.saturating_add(r.layers) };
        let blocks = r.first_block..if r.blocks == 0 { u32::MAX } else { r.first_block.saturating_add(r.blocks) };
        let (layers, blocks) = self.daemon.clamp_ranges(r.session_id, layers, blocks)?;
        // Re-encoding a large session takes tens of milliseconds or more: off the async workers.
        let daemon = self.daemon.clone();
        let compress = move || span.in_scope(|| daemon.compress(r.session_id, layers, blocks, to, r.adaptive));
        let rep = off_workers("compress", compress).await??;
        let compressed_to = rep
            .compressed_to
            .iter()
            .map(|&(format, pages, bytes)| pb::FormatUsage {
                format: format.name().to_owned(),
                pages: u64::from(pages),
                bytes,
            })
            .collect();
        Ok(Response::new(pb::CompressResponse {
            compressed: rep.compressed,
            skipped_pinned: rep.skipped_pinned,
            skipped_not_full: rep.skipped_not_full,
            skipped_already: rep.skipped_already,
            skipped_invalid: rep.skipped_invalid,
            skipped_floor: rep.skipped_floor,
            skipped_window: rep.skipped_window,
            bytes_before: rep.bytes_before,
            bytes_after: rep.bytes_after,
            compressed_to,
        }))
    }

    async fn demote(&self, req: Request<pb::DemoteRequest>) -> Result<Response<pb::DemoteResponse>, Status> {
        self.authorize(caller(&req)?)?;
        let r = req.into_inner();
        let span = tracing::debug_span!("Demote", session = r.session_id);
        let to = match pb::Tier::try_from(r.tier) {
            Ok(pb::Tier::Dram) => kvmm_store::tier::TierKind::Dram,
            Ok(pb::Tier::Flash) => kvmm_store::tier::TierKind::Flash,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "tier {} is not a tier to demote to; use TIER_DRAM or TIER_FLASH",
                    r.tier
                ))
                .into());
            }
        };
        let layers = r.first_layer..if r.layers == 0 { u32::MAX } else { r.first_layer.saturating_add(r.layers) };
        let blocks = r.first_block..if r.blocks == 0 { u32::MAX } else { r.first_block.saturating_add(r.blocks) };
        let (layers, blocks) = self.daemon.clamp_ranges(r.session_id, layers, blocks)?;
        let daemon = self.daemon.clone();
        let report =
            off_workers("demote", move || span.in_scope(|| daemon.demote(r.session_id, layers, blocks, to))).await??;
        Ok(Response::new(pb::DemoteResponse {
            demoted: report.there,
            skipped: report.left,
            skipped_not_full: report.not_full,
            skipped_pinned: report.pinned,
            skipped_no_room: report.no_room,
        }))
    }

    async fn reload_policy(
        &self,
        req: Request<pb::ReloadPolicyRequest>,
    ) -> Result<Response<pb::ReloadPolicyResponse>, Status> {
        self.authorize(caller(&req)?)?;
        self.daemon.reload_policy()?;
        Ok(Response::new(pb::ReloadPolicyResponse { policy: Some(policy_status(&self.daemon.policy.lock().view())) }))
    }

    async fn status(&self, req: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        self.authorize(caller(&req)?)?;
        let (s, usage) = self.daemon.status_with_usage();
        let usage = tier_usage(&usage);
        let formats = |tier: &str| usage.iter().find(|t| t.tier == tier).map_or(Vec::new(), |t| t.by_format.clone());
        let mut tiers = vec![pb::TierStatus {
            tier: DEVICE_TIER.to_owned(),
            budget_bytes: s.budget,
            used_bytes: s.used,
            free_bytes: s.budget.saturating_sub(s.used),
            frames: s.frames,
            pages: s.pages_device,
            by_format: formats(DEVICE_TIER),
            reserved_bytes: s.reserved.bytes,
            reserved_frames: s.reserved.frames,
            ..Default::default()
        }];
        for (name, stats, pages) in [("dram", s.dram, s.pages_dram), ("flash", s.flash, s.pages_flash)] {
            if let Some(t) = stats {
                tiers.push(pb::TierStatus {
                    tier: name.to_owned(),
                    budget_bytes: t.budget,
                    used_bytes: t.used,
                    free_bytes: t.budget - t.used,
                    frames: 0,
                    pages,
                    pages_in: t.pages_in,
                    pages_out: t.pages_out,
                    auth_failures: t.auth_failures,
                    io_failures: t.io_failures,
                    by_format: formats(name),
                    ..Default::default()
                });
            }
        }
        let (io_engine, io_fallback) = match &s.io_engine {
            Some((kind, fallback)) => (kind.name().to_owned(), fallback.clone().unwrap_or_default()),
            None => (String::new(), String::new()),
        };
        Ok(Response::new(pb::StatusResponse {
            tiers,
            io_engine,
            io_fallback,
            demoted_to_dram: s.tier_counters.demoted_to_dram,
            demoted_to_flash: s.tier_counters.demoted_to_flash,
            promoted_from_dram: s.tier_counters.promoted_from_dram,
            promoted_from_flash: s.tier_counters.promoted_from_flash,
            sessions: s.sessions,
            trust_domains: s.trust_domains,
            pages_moved: s.moves,
            moves_skipped_pinned: s.moves_skipped_pinned,
            uptime_ms: self.daemon.started.elapsed().as_millis() as u64,
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            session_bytes: s.session_bytes,
            background_bytes: s.tier_counters.background_bytes,
            policy: Some(policy_status(&self.daemon.policy.lock().view())),
            draining: self.daemon.is_draining(),
            stuck_pins: s.stuck_pins,
            pin_lease_ms: self.daemon.config.pin_lease.as_millis() as u64,
            orphaned_sessions: s.orphaned_sessions,
            max_linger_ms: self.daemon.config.max_linger.as_millis() as u64,
        }))
    }
}

/// Tier usage on the wire: one entry per tier that holds pages, with its formats.
fn tier_usage(usage: &Usage) -> Vec<pb::TierUsage> {
    let mut out: Vec<pb::TierUsage> = Vec::new();
    for (&(tier, format), &(pages, bytes)) in &usage.0 {
        let name = ["device", "dram", "flash"][tier as usize % 3];
        if out.last().is_none_or(|t| t.tier != name) {
            out.push(pb::TierUsage { tier: name.to_owned(), ..Default::default() });
        }
        if let Some(t) = out.last_mut() {
            t.pages += pages;
            t.bytes += bytes;
            t.by_format.push(pb::FormatUsage {
                format: kvmm_kernels::Format::from_u8(format).map_or("unknown", |f| f.name()).to_owned(),
                pages,
                bytes,
            });
        }
    }
    out
}

/// One session on the wire.
fn session_info(s: SessionInfo) -> pb::SessionInfo {
    pb::SessionInfo {
        session_id: s.id,
        uid: s.uid,
        pid: s.pid,
        executable: s.executable,
        geometry: Some(geometry_to_pb(&s.geometry)),
        model_id: s.model_id,
        priority: priority_to_pb(s.priority) as i32,
        tokens: s.tokens,
        tiers: tier_usage(&s.usage),
        quota_tokens: s.quota.pages_per_layer.map_or(0, |p| p * s.geometry.block_tokens),
        evict: s.quota.evict,
        dropped_pages: s.dropped_pages,
        idle_ms: s.idle.as_millis() as u64,
        attached_ms: s.attached.as_millis() as u64,
        stuck_pins: s.pins.stuck,
        longest_pin_ms: s.pins.longest.as_millis() as u64,
        linger_ms: s.linger.as_millis() as u32,
        orphaned_ms: s.orphaned.map_or(0, |d| (d.as_millis() as u64).max(1)),
    }
}

/// The status RPC's view of the policy.
fn policy_status(v: &PolicyView) -> pb::PolicyStatus {
    let t = &v.tuning;
    let s = &v.signals;
    let power = match (s.power.on_ac, &s.power.battery) {
        (Some(true), _) => "mains",
        (_, Some(b)) if b.status == BatteryStatus::Discharging => "battery",
        (Some(false), _) => "battery",
        _ => "unknown",
    };
    let battery = s.power.battery.as_ref().map_or(String::new(), |b| match b.capacity {
        Some(c) => format!("{} {} {c}%", b.name, b.status.name()),
        None => format!("{} {}", b.name, b.status.name()),
    });
    pb::PolicyStatus {
        mode: v.mode.name().to_owned(),
        cause: v.cause.clone(),
        memory_pressure: v.pressure == Pressure::High,
        mode_changes: v.changes,
        held_ms: v.held_for.as_millis() as u64,
        demote_format: t.demote_format.map_or("none", |f| f.name()).to_owned(),
        prefetch_depth: t.prefetch_depth,
        flash_write_limit_bytes_per_s: t.flash_write_bytes_per_s.unwrap_or(0),
        background_limit_bytes_per_s: t.background_bytes_per_s.unwrap_or(0),
        device_budget_percent: u32::from(t.device_budget_pct),
        dram_budget_percent: u32::from(t.dram_budget_pct),
        thermal: s
            .thermal
            .iter()
            .map(|z| {
                let passive = z.passive_trip();
                pb::ThermalReading {
                    zone: z.name.clone(),
                    kind: z.kind.clone(),
                    celsius: z.temp_mc as f64 / 1000.0,
                    has_passive_trip: passive.is_some(),
                    passive_trip_celsius: passive.map_or(0.0, |p| p as f64 / 1000.0),
                }
            })
            .collect(),
        power: power.to_owned(),
        battery,
        psi_known: s.memory.some_avg10.is_some(),
        psi_some_avg10: s.memory.some_avg10.unwrap_or(0.0),
        mem_available_bytes: s.memory.mem_available.unwrap_or(0),
        pressure_watch: v.pressure_watch.clone(),
        sensor_problems: s.problems.clone(),
        adaptive_precision: v.precision.adaptive,
        adaptive_ranking: v.precision.ranking.to_string(),
        layer_floors: v.precision.floors.iter().map(ToString::to_string).collect(),
    }
}
