//! Human output: the admin API's responses as aligned plain-text tables and lines. Pure functions
//! from responses to strings, so they are tested without a daemon.

use std::fmt::Write as _;

use kvmm_proto::v1 as pb;

/// A plain-text table: a header row and rows of cells, columns padded to their widest cell.
/// Columns listed in `right` are right-aligned (numbers).
#[derive(Debug)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    right: Vec<usize>,
}

impl Table {
    /// A table with these column titles.
    pub fn new(header: &[&str]) -> Table {
        Table { header: header.iter().map(|s| (*s).to_owned()).collect(), rows: Vec::new(), right: Vec::new() }
    }

    /// Right-aligns the given columns.
    pub fn right(mut self, columns: &[usize]) -> Table {
        self.right = columns.to_vec();
        self
    }

    /// Appends a row (missing cells are empty).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as lines, each ending in a newline, without trailing spaces.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                if i < widths.len() {
                    widths[i] = widths[i].max(cell.chars().count());
                }
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::new();
            for (i, width) in widths.iter().enumerate() {
                let cell = row.get(i).map_or("", String::as_str);
                if i > 0 {
                    line.push_str("  ");
                }
                if self.right.contains(&i) {
                    let _ = write!(line, "{cell:>width$}");
                } else {
                    let _ = write!(line, "{cell:<width$}");
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Bytes in binary units with one decimal: `0 B`, `512 B`, `1.5 KiB`, `64.0 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A duration in milliseconds, in its two largest units: `850ms`, `12.3s`, `4m05s`, `2h03m`, `3d04h`.
pub fn duration_ms(ms: u64) -> String {
    let s = ms / 1000;
    match ms {
        0..1_000 => format!("{ms}ms"),
        1_000..60_000 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{}m{:02}s", s / 60, s % 60),
        3_600_000..86_400_000 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// Pages per format, e.g. `f16 5, q8 4` (`-` when there are none).
pub fn formats(by_format: &[pb::FormatUsage]) -> String {
    if by_format.is_empty() {
        return "-".to_owned();
    }
    by_format.iter().map(|f| format!("{} {}", f.format, f.pages)).collect::<Vec<_>>().join(", ")
}

/// A priority's short name: `foreground`, `background`, `batch`.
pub fn priority(p: i32) -> String {
    match pb::Priority::try_from(p) {
        Ok(pb::Priority::Unspecified | pb::Priority::Foreground) => "foreground".to_owned(),
        Ok(pb::Priority::Background) => "background".to_owned(),
        Ok(pb::Priority::Batch) => "batch".to_owned(),
        Err(_) => p.to_string(),
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// `Status`.
pub fn status(s: &pb::StatusResponse) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvmmd {} (pid {}), up {}; {} session(s) in {} trust domain(s); draining: {}",
        s.version,
        s.pid,
        duration_ms(s.uptime_ms),
        s.sessions,
        s.trust_domains,
        yes_no(s.draining)
    );
    let engine = match (s.io_engine.as_str(), s.io_fallback.as_str()) {
        ("", _) => "none (no flash tier)".to_owned(),
        (e, "") => e.to_owned(),
        (e, why) => format!("{e} ({why})"),
    };
    let _ = writeln!(out, "I/O engine: {engine}");
    out.push('\n');
    let mut t = Table::new(&["TIER", "BUDGET", "USED", "FREE", "PAGES", "IN", "OUT", "FAILURES", "FORMATS"])
        .right(&[1, 2, 3, 4, 5, 6, 7]);
    for tier in &s.tiers {
        t.row(vec![
            tier.tier.clone(),
            bytes(tier.budget_bytes),
            bytes(tier.used_bytes),
            bytes(tier.free_bytes),
            tier.pages.to_string(),
            tier.pages_in.to_string(),
            tier.pages_out.to_string(),
            format!("{} auth, {} io", tier.auth_failures, tier.io_failures),
            formats(&tier.by_format),
        ]);
    }
    out.push_str(&t.render());
    out.push('\n');
    let _ = writeln!(
        out,
        "moves: {} pages moved, {} skipped (pinned); demoted {} to dram, {} to flash; promoted {} from dram, {} from flash; {} moved in the background",
        s.pages_moved,
        s.moves_skipped_pinned,
        s.demoted_to_dram,
        s.demoted_to_flash,
        s.promoted_from_dram,
        s.promoted_from_flash,
        bytes(s.background_bytes)
    );
    let _ = writeln!(
        out,
        "stuck pins: {} page(s) held pinned past the {} pin lease{}",
        s.stuck_pins,
        duration_ms(s.pin_lease_ms),
        if s.stuck_pins > 0 { " (`kvmmctl sessions` names their sessions; `kvmmctl wipe ID` revokes one)" } else { "" }
    );
    let _ = match s.max_linger_ms {
        0 => writeln!(out, "orphaned sessions: {} (lingering is off: max_linger_ms = 0)", s.orphaned_sessions),
        max => writeln!(
            out,
            "orphaned sessions: {} waiting for a Resume (a session may outlive its connection for at most {})",
            s.orphaned_sessions,
            duration_ms(max)
        ),
    };
    if let Some(p) = &s.policy {
        out.push_str(&policy_status(p));
    }
    out
}

/// Per second rate limit, `unlimited` for 0.
fn rate(bytes_per_s: u64) -> String {
    if bytes_per_s == 0 { "unlimited".to_owned() } else { format!("{}/s", bytes(bytes_per_s)) }
}

/// The `PolicyStatus` message: mode and cause, what the mode sets, the sensor readings.
pub fn policy_status(p: &pb::PolicyStatus) -> String {
    let mut out = String::new();
    let _ =
        writeln!(out, "mode: {} ({}), held {}, {} change(s)", p.mode, p.cause, duration_ms(p.held_ms), p.mode_changes);
    let _ = writeln!(
        out,
        "  memory pressure: {}; demote format: {}; prefetch depth: {}; budgets: device {}%, dram {}%",
        yes_no(p.memory_pressure),
        p.demote_format,
        p.prefetch_depth,
        p.device_budget_percent,
        p.dram_budget_percent
    );
    let _ = writeln!(
        out,
        "  rates: flash writes {}, background migration {}",
        rate(p.flash_write_limit_bytes_per_s),
        rate(p.background_limit_bytes_per_s)
    );
    let floors = if p.layer_floors.is_empty() { "none".to_owned() } else { p.layer_floors.join(", ") };
    let adaptive = match (p.adaptive_precision, p.adaptive_ranking.as_str()) {
        (false, _) => "no".to_owned(),
        (true, "") => "yes".to_owned(),
        (true, ranking) => format!("yes, by {ranking}"),
    };
    let _ = writeln!(out, "  adaptive precision: {adaptive}; layer floors: {floors}");
    let battery = if p.battery.is_empty() { String::new() } else { format!(" ({})", p.battery) };
    let psi = if p.psi_known { format!("{:.2}%", p.psi_some_avg10) } else { "unknown".to_owned() };
    let available = if p.mem_available_bytes == 0 { "unknown".to_owned() } else { bytes(p.mem_available_bytes) };
    let _ = writeln!(
        out,
        "sensors: power {}{battery}; PSI some avg10 {psi}; MemAvailable {available}; pressure watch: {}",
        p.power, p.pressure_watch
    );
    for z in &p.thermal {
        let trip = if z.has_passive_trip {
            format!(", passive trip {:.1} °C", z.passive_trip_celsius)
        } else {
            String::new()
        };
        let _ = writeln!(out, "  {} ({}): {:.1} °C{trip}", z.zone, z.kind, z.celsius);
    }
    for problem in &p.sensor_problems {
        let _ = writeln!(out, "  problem: {problem}");
    }
    out
}

/// A session's bytes in one tier (0 if it has nothing there).
pub fn tier_bytes(s: &pb::SessionInfo, tier: &str) -> u64 {
    s.tiers.iter().find(|t| t.tier == tier).map_or(0, |t| t.bytes)
}

/// The columns of the sessions table (`sessions` and `top`).
pub const SESSION_COLUMNS: [&str; 12] =
    ["ID", "UID", "PID", "EXECUTABLE", "MODEL", "PRIORITY", "TOKENS", "DEVICE", "DRAM", "FLASH", "IDLE", "STUCK"];

/// One session's cells under [`SESSION_COLUMNS`].
pub fn session_cells(s: &pb::SessionInfo) -> [String; 12] {
    [
        s.session_id.to_string(),
        s.uid.to_string(),
        // An orphan's process is gone (or let go of it): it waits for a Resume.
        if s.orphaned_ms > 0 { "gone".to_owned() } else { s.pid.to_string() },
        s.executable.clone(),
        s.model_id.clone(),
        priority(s.priority),
        s.tokens.to_string(),
        bytes(tier_bytes(s, "device")),
        bytes(tier_bytes(s, "dram")),
        bytes(tier_bytes(s, "flash")),
        duration_ms(s.idle_ms),
        s.stuck_pins.to_string(),
    ]
}

/// `ListSessions`.
pub fn sessions(list: &pb::ListSessionsResponse) -> String {
    if list.sessions.is_empty() {
        return "no sessions\n".to_owned();
    }
    let mut t = Table::new(&SESSION_COLUMNS).right(&[0, 1, 2, 6, 7, 8, 9, 10, 11]);
    for s in &list.sessions {
        t.row(session_cells(s).into());
    }
    t.render()
}

/// `Session`: everything, per tier and format.
pub fn session(s: &pb::SessionInfo) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "session {}", s.session_id);
    let _ = writeln!(out, "  owner: uid {}, pid {}, executable {:?}", s.uid, s.pid, s.executable);
    let _ = writeln!(out, "  model: {:?}; priority: {}", s.model_id, priority(s.priority));
    if let Some(g) = &s.geometry {
        let element = pb::ElementType::try_from(g.element_type).map_or("?", |e| match e {
            pb::ElementType::Bf16 => "bf16",
            pb::ElementType::Unspecified | pb::ElementType::F16 => "f16",
        });
        let _ = writeln!(
            out,
            "  geometry: {} layers, {} kv heads, {} q heads, head dim {}, {} tokens per block, {element}, at most {} tokens",
            g.layers, g.kv_heads, g.q_heads, g.head_dim, g.block_tokens, g.max_tokens
        );
    }
    let quota = if s.quota_tokens == 0 { "none".to_owned() } else { format!("{} tokens", s.quota_tokens) };
    let _ = writeln!(
        out,
        "  tokens: {}; quota: {quota}; eviction: {}; dropped pages: {}",
        s.tokens,
        if s.evict { "on" } else { "off" },
        s.dropped_pages
    );
    let _ = writeln!(out, "  idle {}, attached {} ago", duration_ms(s.idle_ms), duration_ms(s.attached_ms));
    match (s.linger_ms, s.orphaned_ms) {
        (0, _) => {}
        (linger, 0) => {
            let _ = writeln!(
                out,
                "  linger: {} (outlives its connection for that long, waiting for a Resume)",
                duration_ms(linger.into())
            );
        }
        (linger, orphaned) => {
            let _ = writeln!(
                out,
                "  orphaned: its connection closed {} ago; waiting for a Resume, wiped after {} (linger)",
                duration_ms(orphaned),
                duration_ms(linger.into())
            );
        }
    }
    if s.stuck_pins > 0 {
        let _ = writeln!(
            out,
            "  stuck pins: {} page(s) held pinned past the pin lease, the longest for {}",
            s.stuck_pins,
            duration_ms(s.longest_pin_ms)
        );
    }
    out.push('\n');
    let mut t = Table::new(&["TIER", "FORMAT", "PAGES", "BYTES"]).right(&[2, 3]);
    for tier in &s.tiers {
        t.row(vec![tier.tier.clone(), "all".to_owned(), tier.pages.to_string(), bytes(tier.bytes)]);
        for f in &tier.by_format {
            t.row(vec![String::new(), f.format.clone(), f.pages.to_string(), bytes(f.bytes)]);
        }
    }
    out.push_str(&t.render());
    out
}

/// `GetPolicy` and `SetPolicy`: the mode in force as a TOML comment, then the body of the `[policy]`
/// table as the daemon sent it, so that `policy get > p.toml` and `policy set p.toml` round-trip.
pub fn policy(p: &pb::PolicyResponse) -> String {
    let mut out = String::new();
    if let Some(s) = &p.status {
        let _ = writeln!(out, "# mode in force: {} ({})", s.mode, s.cause.replace('\n', " "));
    }
    out.push_str(&p.policy_toml);
    if !p.policy_toml.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// `WipeSession`, `WipeUser` and `WipeAll`.
pub fn wipe(w: &pb::WipeResponse) -> String {
    let mut t = Table::new(&["TIER", "WIPED"]).right(&[1]);
    t.row(vec!["device".to_owned(), bytes(w.device_bytes)]);
    t.row(vec!["dram".to_owned(), bytes(w.dram_bytes)]);
    t.row(vec!["flash".to_owned(), bytes(w.flash_bytes)]);
    format!("wiped {} session(s)\n{}", w.sessions, t.render())
}

/// `Compress` of session `id`.
pub fn compress(id: u64, c: &pb::CompressResponse) -> String {
    let mut out = format!(
        "session {id}: {} page(s) re-encoded, {} -> {}\n",
        c.compressed,
        bytes(c.bytes_before),
        bytes(c.bytes_after)
    );
    for f in &c.compressed_to {
        out += &format!("  {} as {} ({})\n", f.pages, f.format, bytes(f.bytes));
    }
    let skipped = [
        (c.skipped_pinned, "pinned by the client (try again)"),
        (c.skipped_not_full, "not full (the client is still writing them)"),
        (c.skipped_already, "already at or below the format"),
        (c.skipped_floor, "held by their layer's floor"),
        (c.skipped_window, "the sink page or the recent window, kept as they are"),
        (c.skipped_invalid, "values the format cannot encode"),
    ];
    for (pages, why) in skipped.iter().filter(|(pages, _)| *pages > 0) {
        out += &format!("  {pages} skipped: {why}\n");
    }
    out
}

/// `Demote` of session `id` to `tier`.
pub fn demote(id: u64, tier: pb::Tier, d: &pb::DemoteResponse) -> String {
    let (name, full) = match tier {
        pb::Tier::Flash => ("flash", "no room in flash (or DRAM on the way)"),
        _ => ("dram", "no room in DRAM"),
    };
    let mut out = format!("session {id}: {} page(s) now in {name}\n", d.demoted);
    let reasons = [
        (d.skipped_not_full, "not full (the client is still writing them)"),
        (d.skipped_pinned, "pinned by the client (try again)"),
        (d.skipped_no_room, full),
    ];
    for (pages, why) in reasons.iter().filter(|(pages, _)| *pages > 0) {
        out += &format!("  {pages} left: {why}\n");
    }
    let other = d.skipped.saturating_sub(d.skipped_not_full + d.skipped_pinned + d.skipped_no_room);
    if other > 0 {
        out += &format!("  {other} left: moved meanwhile (a fault brought them back)\n");
    }
    out
}

/// `Drain`.
pub fn drain(d: &pb::DrainResponse) -> String {
    if d.draining {
        format!(
            "draining: no new sessions or pages are admitted; {} full pages are below the device, {} left on it\n",
            d.demoted_pages, d.left_on_device
        )
    } else {
        "resumed: new sessions and pages are admitted again\n".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_read_at_a_glance() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(64 << 20), "64.0 MiB");
        assert_eq!(duration_ms(850), "850ms");
        assert_eq!(duration_ms(12_345), "12.3s");
        assert_eq!(duration_ms(245_000), "4m05s");
        assert_eq!(duration_ms(7_380_000), "2h03m");
        assert_eq!(duration_ms(273_600_000), "3d04h");
    }

    #[test]
    fn a_table_pads_columns_and_right_aligns_numbers() {
        let mut t = Table::new(&["NAME", "N"]).right(&[1]);
        t.row(vec!["device".into(), "7".into()]);
        t.row(vec!["dram".into(), "1234".into()]);
        assert_eq!(t.render(), "NAME       N\ndevice     7\ndram    1234\n");
    }

    #[test]
    fn the_sessions_table_shows_bytes_per_tier() {
        let s = pb::SessionInfo {
            session_id: 42,
            executable: "llama".into(),
            tokens: 300,
            tiers: vec![pb::TierUsage { tier: "dram".into(), pages: 2, bytes: 2048, by_format: vec![] }],
            ..Default::default()
        };
        let text = sessions(&pb::ListSessionsResponse { sessions: vec![s] });
        let row = text.lines().nth(1).unwrap();
        assert!(
            row.starts_with("42") && row.contains("llama") && row.contains("2.0 KiB") && row.contains("300"),
            "{text}"
        );
        assert_eq!(sessions(&pb::ListSessionsResponse::default()), "no sessions\n");
    }
}
