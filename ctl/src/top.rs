//! `kvmmctl top`: a live terminal view of the tiers (bars of used over budget), the mode and its
//! cause, and the sessions, refreshed every `--interval-ms`.
//!
//! The terminal is put in raw mode on the alternate screen only after the first refresh succeeded
//! (so a refused or missing socket is an ordinary error with its exit code), and restored on every
//! way out: `q`, Esc or Ctrl-C, an error, and a panic (ratatui's hook). A refresh that fails later
//! keeps the last data on screen under the error, and the next one tries again.

use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use kvmm_proto::v1 as pb;
use kvmm_proto::v1::admin_client::AdminClient;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Gauge, Paragraph, Row, Table};
use tonic::transport::Channel;

use crate::failure::Failure;
use crate::render;

/// How long one refresh may take before it counts as failed.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(3);

/// What the screen shows: the last answers and the last failure.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// The last `Status`.
    pub status: pb::StatusResponse,
    /// The last `ListSessions`, sorted by id.
    pub sessions: Vec<pb::SessionInfo>,
    /// Why the last refresh failed, if it did.
    pub error: Option<String>,
}

/// Runs the view until the operator quits.
pub fn run(
    runtime: &tokio::runtime::Runtime,
    mut admin: AdminClient<Channel>,
    socket: &Path,
    interval: Duration,
) -> Result<(), Failure> {
    if !std::io::stdout().is_terminal() {
        return Err(Failure::Usage(
            "top needs a terminal on stdout; scripts use `kvmmctl --json status` and `kvmmctl --json sessions`"
                .to_owned(),
        ));
    }
    let mut snapshot = Snapshot::default();
    runtime.block_on(refresh(&mut admin, &mut snapshot))?;
    let terminal_error = |source| Failure::Local { what: "the terminal failed".to_owned(), source };
    let mut terminal = ratatui::try_init().map_err(terminal_error)?;
    let _restore = RestoreOnDrop;
    let title = format!("kvmmctl top — {} — every {} ms — q quits", socket.display(), interval.as_millis());
    let mut next = Instant::now() + interval;
    loop {
        terminal.draw(|frame| draw(frame, &title, &snapshot)).map_err(terminal_error)?;
        // Wait for a key or the next refresh; a resize redraws at once.
        loop {
            let now = Instant::now();
            if now >= next {
                break;
            }
            if !event::poll(next - now).map_err(terminal_error)? {
                continue;
            }
            match event::read().map_err(terminal_error)? {
                Event::Key(key) if key.kind == KeyEventKind::Press => {
                    let ctrl_c = key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL);
                    if matches!(key.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                        return Ok(());
                    }
                }
                Event::Resize(..) => {
                    terminal.draw(|frame| draw(frame, &title, &snapshot)).map_err(terminal_error)?;
                }
                _ => {}
            }
        }
        if let Err(f) = runtime.block_on(refresh(&mut admin, &mut snapshot)) {
            snapshot.error = Some(f.to_string());
        }
        next = Instant::now() + interval;
    }
}

/// Leaves raw mode and the alternate screen however `run` ends.
struct RestoreOnDrop;

impl Drop for RestoreOnDrop {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// Asks for `Status` and `ListSessions`; on success the snapshot holds both and no error.
async fn refresh(admin: &mut AdminClient<Channel>, snapshot: &mut Snapshot) -> Result<(), Failure> {
    let timed_out = |rpc: &'static str| {
        move |_: tokio::time::error::Elapsed| Failure::Rpc {
            rpc,
            status: tonic::Status::deadline_exceeded("no answer in 3 s"),
        }
    };
    let status = tokio::time::timeout(REFRESH_TIMEOUT, admin.status(pb::StatusRequest {}))
        .await
        .map_err(timed_out("Status"))?
        .map_err(Failure::rpc("Status"))?
        .into_inner();
    let mut sessions = tokio::time::timeout(REFRESH_TIMEOUT, admin.list_sessions(pb::ListSessionsRequest {}))
        .await
        .map_err(timed_out("ListSessions"))?
        .map_err(Failure::rpc("ListSessions"))?
        .into_inner()
        .sessions;
    sessions.sort_by_key(|s| s.session_id);
    *snapshot = Snapshot { status, sessions, error: None };
    Ok(())
}

/// Draws one screen: a header (daemon, mode and cause, error), a bar per tier, the sessions.
pub fn draw(frame: &mut Frame, title: &str, snapshot: &Snapshot) {
    let s = &snapshot.status;
    let (mode, cause) = s.policy.as_ref().map_or(("?", ""), |p| (p.mode.as_str(), p.cause.as_str()));
    let mut lines = vec![
        Line::from(vec![
            Span::styled(format!("kvmmd {}", s.version), Style::new().add_modifier(Modifier::BOLD)),
            Span::raw(format!(
                "  pid {}  up {}  {} session(s)  {} trust domain(s)  draining: {}",
                s.pid,
                render::duration_ms(s.uptime_ms),
                s.sessions,
                s.trust_domains,
                if s.draining { "YES" } else { "no" }
            )),
        ]),
        Line::from(vec![
            Span::raw("mode: "),
            Span::styled(mode.to_owned(), Style::new().fg(Color::Cyan).add_modifier(Modifier::BOLD)),
            Span::raw(format!("  {cause}")),
        ]),
    ];
    if let Some(p) = &s.policy {
        lines.push(Line::from(format!(
            "demote format {}  prefetch depth {}  memory pressure: {}",
            p.demote_format,
            p.prefetch_depth,
            if p.memory_pressure { "yes" } else { "no" }
        )));
    }
    if let Some(e) = &snapshot.error {
        lines.push(Line::from(Span::styled(format!("refresh failed: {e}"), Style::new().fg(Color::Red))));
    }
    // The title takes the first row; tiers take a row each inside a border.
    let header_rows = u16::try_from(lines.len() + 1).unwrap_or(u16::MAX);
    let tier_rows = u16::try_from(s.tiers.len()).unwrap_or(u16::MAX).saturating_add(2);
    let [header, bars, table] =
        Layout::vertical([Constraint::Length(header_rows), Constraint::Length(tier_rows), Constraint::Min(3)])
            .areas(frame.area());
    frame.render_widget(Paragraph::new(lines).block(Block::new().title(title.to_owned())), header);

    let bars_block = Block::bordered().title("tiers");
    let inner = bars_block.inner(bars);
    frame.render_widget(bars_block, bars);
    let rows = Layout::vertical(s.tiers.iter().map(|_| Constraint::Length(1))).split(inner);
    for (tier, area) in s.tiers.iter().zip(rows.iter()) {
        let ratio = if tier.budget_bytes == 0 { 0.0 } else { tier.used_bytes as f64 / tier.budget_bytes as f64 };
        let label = format!(
            "{:<6} {} / {} ({:.0}%)  {} pages  {}",
            tier.tier,
            render::bytes(tier.used_bytes),
            render::bytes(tier.budget_bytes),
            ratio * 100.0,
            tier.pages,
            render::formats(&tier.by_format)
        );
        let color = if ratio > 0.9 { Color::Red } else { Color::Green };
        frame.render_widget(
            Gauge::default()
                .ratio(ratio.clamp(0.0, 1.0))
                .label(label)
                .gauge_style(Style::new().fg(color).bg(Color::Black)),
            *area,
        );
    }

    let header_row = Row::new(render::SESSION_COLUMNS).style(Style::new().add_modifier(Modifier::BOLD));
    let body = snapshot.sessions.iter().map(|x| Row::new(render::session_cells(x)));
    let widths = [
        Constraint::Length(10),
        Constraint::Length(6),
        Constraint::Length(7),
        Constraint::Length(16),
        Constraint::Min(8),
        Constraint::Length(10),
        Constraint::Length(8),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(6),
        Constraint::Length(5),
    ];
    let sessions = Table::new(body, widths)
        .header(header_row)
        .block(Block::bordered().title(format!("sessions ({})", snapshot.sessions.len())));
    frame.render_widget(sessions, table);
}

#[cfg(test)]
mod tests {
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    use super::*;

    #[test]
    fn the_screen_shows_tiers_mode_cause_and_sessions() {
        let snapshot = Snapshot {
            status: pb::StatusResponse {
                version: "0.1.0".into(),
                sessions: 1,
                tiers: vec![
                    pb::TierStatus {
                        tier: "device".into(),
                        budget_bytes: 64 << 20,
                        used_bytes: 16 << 20,
                        ..Default::default()
                    },
                    pb::TierStatus { tier: "dram".into(), budget_bytes: 0, ..Default::default() },
                ],
                policy: Some(pb::PolicyStatus {
                    mode: "powersave".into(),
                    cause: "battery BAT0 discharging at 15%".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            sessions: vec![pb::SessionInfo { session_id: 1234567, tokens: 300, ..Default::default() }],
            error: Some("Status failed with UNAVAILABLE: gone".into()),
        };
        let mut terminal = Terminal::new(TestBackend::new(120, 24)).unwrap();
        terminal.draw(|f| draw(f, "kvmmctl top", &snapshot)).unwrap();
        let screen = terminal.backend().to_string();
        for expected in [
            "powersave",
            "battery BAT0 discharging at 15%",
            "device",
            "16.0 MiB / 64.0 MiB (25%)",
            "1234567",
            "300",
            "UNAVAILABLE",
        ] {
            assert!(screen.contains(expected), "{expected:?} missing from\n{screen}");
        }
    }
}
