//! `--json` output: the admin API's responses as JSON objects for scripts.
//!
//! Field names are the proto's (snake_case), enums are their proto names (`"PRIORITY_FOREGROUND"`),
//! and 64-bit integers are JSON numbers (proto3's canonical mapping makes them strings, which no
//! shell script wants). A field added to the proto appears here only when added below: the output
//! stays stable across daemon upgrades.

use kvmm_proto::v1 as pb;
use serde_json::{Value, json};

/// `Status`.
pub fn status(s: &pb::StatusResponse) -> Value {
    json!({
        "tiers": s.tiers.iter().map(tier_status).collect::<Vec<_>>(),
        "sessions": s.sessions,
        "trust_domains": s.trust_domains,
        "pages_moved": s.pages_moved,
        "moves_skipped_pinned": s.moves_skipped_pinned,
        "uptime_ms": s.uptime_ms,
        "pid": s.pid,
        "version": s.version,
        "session_bytes": s.session_bytes,
        "io_engine": s.io_engine,
        "io_fallback": s.io_fallback,
        "demoted_to_dram": s.demoted_to_dram,
        "demoted_to_flash": s.demoted_to_flash,
        "promoted_from_dram": s.promoted_from_dram,
        "promoted_from_flash": s.promoted_from_flash,
        "background_bytes": s.background_bytes,
        "policy": s.policy.as_ref().map_or(Value::Null, policy_status),
        "draining": s.draining,
        "stuck_pins": s.stuck_pins,
        "pin_lease_ms": s.pin_lease_ms,
        "orphaned_sessions": s.orphaned_sessions,
        "max_linger_ms": s.max_linger_ms,
    })
}

fn tier_status(t: &pb::TierStatus) -> Value {
    json!({
        "tier": t.tier,
        "budget_bytes": t.budget_bytes,
        "used_bytes": t.used_bytes,
        "free_bytes": t.free_bytes,
        "frames": t.frames,
        "pages": t.pages,
        "pages_in": t.pages_in,
        "pages_out": t.pages_out,
        "auth_failures": t.auth_failures,
        "io_failures": t.io_failures,
        "by_format": t.by_format.iter().map(format_usage).collect::<Vec<_>>(),
    })
}

fn format_usage(f: &pb::FormatUsage) -> Value {
    json!({ "format": f.format, "pages": f.pages, "bytes": f.bytes })
}

fn tier_usage(t: &pb::TierUsage) -> Value {
    json!({
        "tier": t.tier,
        "pages": t.pages,
        "bytes": t.bytes,
        "by_format": t.by_format.iter().map(format_usage).collect::<Vec<_>>(),
    })
}

/// The `PolicyStatus` message.
pub fn policy_status(p: &pb::PolicyStatus) -> Value {
    json!({
        "mode": p.mode,
        "cause": p.cause,
        "memory_pressure": p.memory_pressure,
        "mode_changes": p.mode_changes,
        "held_ms": p.held_ms,
        "demote_format": p.demote_format,
        "prefetch_depth": p.prefetch_depth,
        "flash_write_limit_bytes_per_s": p.flash_write_limit_bytes_per_s,
        "background_limit_bytes_per_s": p.background_limit_bytes_per_s,
        "device_budget_percent": p.device_budget_percent,
        "dram_budget_percent": p.dram_budget_percent,
        "thermal": p.thermal.iter().map(thermal).collect::<Vec<_>>(),
        "power": p.power,
        "battery": p.battery,
        "psi_known": p.psi_known,
        "psi_some_avg10": p.psi_some_avg10,
        "mem_available_bytes": p.mem_available_bytes,
        "pressure_watch": p.pressure_watch,
        "sensor_problems": p.sensor_problems,
        "adaptive_precision": p.adaptive_precision,
        "adaptive_ranking": p.adaptive_ranking,
        "layer_floors": p.layer_floors,
    })
}

fn thermal(t: &pb::ThermalReading) -> Value {
    json!({
        "zone": t.zone,
        "kind": t.kind,
        "celsius": t.celsius,
        "has_passive_trip": t.has_passive_trip,
        "passive_trip_celsius": t.passive_trip_celsius,
    })
}

/// `ListSessions`.
pub fn sessions(list: &pb::ListSessionsResponse) -> Value {
    json!({ "sessions": list.sessions.iter().map(session).collect::<Vec<_>>() })
}

/// `Session` (and each entry of `ListSessions`).
pub fn session(s: &pb::SessionInfo) -> Value {
    json!({
        "session_id": s.session_id,
        "uid": s.uid,
        "pid": s.pid,
        "executable": s.executable,
        "geometry": s.geometry.as_ref().map_or(Value::Null, geometry),
        "model_id": s.model_id,
        "priority": priority_name(s.priority),
        "tokens": s.tokens,
        "tiers": s.tiers.iter().map(tier_usage).collect::<Vec<_>>(),
        "quota_tokens": s.quota_tokens,
        "evict": s.evict,
        "dropped_pages": s.dropped_pages,
        "idle_ms": s.idle_ms,
        "attached_ms": s.attached_ms,
        "stuck_pins": s.stuck_pins,
        "longest_pin_ms": s.longest_pin_ms,
        "linger_ms": s.linger_ms,
        "orphaned_ms": s.orphaned_ms,
    })
}

fn geometry(g: &pb::Geometry) -> Value {
    json!({
        "layers": g.layers,
        "kv_heads": g.kv_heads,
        "q_heads": g.q_heads,
        "head_dim": g.head_dim,
        "block_tokens": g.block_tokens,
        "element_type": pb::ElementType::try_from(g.element_type)
            .map_or_else(|_| g.element_type.to_string(), |e| e.as_str_name().to_owned()),
        "max_tokens": g.max_tokens,
    })
}

/// The proto name of a priority (`"PRIORITY_BACKGROUND"`), or its number if this build does not know it.
pub fn priority_name(priority: i32) -> String {
    pb::Priority::try_from(priority).map_or_else(|_| priority.to_string(), |p| p.as_str_name().to_owned())
}

/// `GetPolicy` and `SetPolicy`.
pub fn policy(p: &pb::PolicyResponse) -> Value {
    json!({
        "policy_toml": p.policy_toml,
        "status": p.status.as_ref().map_or(Value::Null, policy_status),
    })
}

/// `ReloadPolicy`.
pub fn reload(r: &pb::ReloadPolicyResponse) -> Value {
    json!({ "policy": r.policy.as_ref().map_or(Value::Null, policy_status) })
}

/// `WipeSession`, `WipeUser` and `WipeAll`.
pub fn wipe(w: &pb::WipeResponse) -> Value {
    json!({
        "device_bytes": w.device_bytes,
        "dram_bytes": w.dram_bytes,
        "flash_bytes": w.flash_bytes,
        "sessions": w.sessions,
    })
}

/// `Compress`.
pub fn compress(c: &pb::CompressResponse) -> Value {
    json!({
        "compressed": c.compressed,
        "skipped_pinned": c.skipped_pinned,
        "skipped_not_full": c.skipped_not_full,
        "skipped_already": c.skipped_already,
        "skipped_invalid": c.skipped_invalid,
        "skipped_floor": c.skipped_floor,
        "skipped_window": c.skipped_window,
        "bytes_before": c.bytes_before,
        "bytes_after": c.bytes_after,
        "compressed_to": c.compressed_to.iter().map(|f| json!({ "format": f.format, "pages": f.pages, "bytes": f.bytes })).collect::<Vec<_>>(),
    })
}

/// `Demote`.
pub fn demote(d: &pb::DemoteResponse) -> Value {
    json!({
        "demoted": d.demoted,
        "skipped": d.skipped,
        "skipped_not_full": d.skipped_not_full,
        "skipped_pinned": d.skipped_pinned,
        "skipped_no_room": d.skipped_no_room,
    })
}

/// `Drain`.
pub fn drain(d: &pb::DrainResponse) -> Value {
    json!({ "draining": d.draining, "demoted_pages": d.demoted_pages, "left_on_device": d.left_on_device })
}

/// `Metrics`.
pub fn metrics(m: &pb::MetricsResponse) -> Value {
    json!({ "text": m.text })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_keeps_the_protos_field_names_and_enum_names() {
        let s = pb::SessionInfo {
            session_id: u64::MAX,
            priority: pb::Priority::Background as i32,
            tiers: vec![pb::TierUsage {
                tier: "dram".into(),
                pages: 3,
                bytes: 96,
                by_format: vec![pb::FormatUsage { format: "q8".into(), pages: 3, bytes: 96 }],
            }],
            ..Default::default()
        };
        let v = session(&s);
        assert_eq!(v["session_id"], u64::MAX, "64-bit ids survive as numbers");
        assert_eq!(v["priority"], "PRIORITY_BACKGROUND");
        assert_eq!(v["tiers"][0]["by_format"][0]["format"], "q8");
        assert_eq!(v["geometry"], Value::Null);
        assert_eq!(priority_name(77), "77");
    }
}
