//! `kvmm.v1.Admin` on `kvmm-admin.sock`: operator requests, served only to root and to members of the
//! configured admin group (identity from `SO_PEERCRED`, supplementary groups from `/proc/PID/status`).

use std::sync::Arc;

use kvmm_proto::v1 as pb;
use tonic::{Request, Response, Status};

use super::conn::ConnInfo;
use super::session_service::caller;
use crate::daemon::Daemon;
use crate::error::Error;
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
        if who.uid == 0 {
            return Ok(());
        }
        if let Some(gid) = self.daemon.config.admin_gid
            && (who.gid == gid || supplementary_groups(who.pid).contains(&gid))
        {
            return Ok(());
        }
        let group = match &self.daemon.config.admin_group {
            Some(g) => format!("root or a member of the '{g}' group"),
            None => "root (no admin_group is configured)".to_owned(),
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

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn status(&self, req: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        self.authorize(caller(&req)?)?;
        let s = self.daemon.status();
        Ok(Response::new(pb::StatusResponse {
            tiers: vec![pb::TierStatus {
                tier: DEVICE_TIER.to_owned(),
                budget_bytes: s.budget,
                used_bytes: s.used,
                free_bytes: s.budget - s.used,
                frames: s.frames,
            }],
            sessions: s.sessions,
            trust_domains: s.trust_domains,
            pages_moved: s.moves,
            moves_skipped_pinned: s.moves_skipped_pinned,
            uptime_ms: self.daemon.started.elapsed().as_millis() as u64,
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            session_bytes: s.session_bytes,
        }))
    }
}
