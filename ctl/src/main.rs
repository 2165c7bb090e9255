//! `kvmmctl`: the operator's command line for kvmmd. Every subcommand is one or two calls of the
//! admin API (`kvmm.v1.Admin` on `kvmm-admin.sock`) printed as human tables, or with `--json` as
//! JSON objects for scripts; `top` is a live terminal view. Exit codes are in `failure.rs`.

mod failure;
mod json;
mod render;
mod socket;
mod top;

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use kvmm_proto::v1 as pb;
use kvmm_proto::v1::admin_client::AdminClient;
use tonic::transport::Channel;

use crate::failure::Failure;

const EXIT_CODES: &str = "\
Exit codes:
  0  done
  2  usage error (also `wipe --all` not confirmed)
  3  permission denied (PERMISSION_DENIED, or no permission on the admin socket)
  4  not found (NOT_FOUND, e.g. no such session; or no admin socket at the path tried)
  5  any other failure (UNAVAILABLE: kvmmd not running; UNIMPLEMENTED; a refused policy; ...)

The admin socket: --socket PATH, else $KVMM_ADMIN_SOCKET, else kvmm-admin.sock in kvmmd's runtime
directory ($RUNTIME_DIRECTORY, else /run/kvmm as root, else $XDG_RUNTIME_DIR/kvmm, falling back to
/run/kvmm when only the system daemon runs).";

/// Operate kvmmd: status, sessions, policy, wipe, drain, metrics and a live view.
#[derive(Parser, Debug)]
#[command(name = "kvmmctl", version, after_help = EXIT_CODES)]
struct Cli {
    /// The admin socket (default: see `kvmmctl --help`).
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Print JSON objects (the proto's field names) instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Tiers (budget, use, pages by format), mode and cause, sensors, I/O engine, uptime, draining.
    Status,
    /// Every session: owner, process, model, priority, tokens, bytes per tier, idle time.
    Sessions,
    /// One session: everything, per tier and format.
    Session {
        /// The session id (from `kvmmctl sessions`).
        id: u64,
    },
    /// Read, replace or reload the policy ([policy] table).
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// Destroy sessions' data for certain (frames zeroed, flash slots punched out, keys destroyed).
    Wipe(WipeArgs),
    /// Re-encode a session's full pages in place in a smaller format while its client keeps running
    /// (lossy and one-way; each layer's [[policy.floor]] holds).
    Compress(CompressArgs),
    /// Move a session's full pages off the device, to DRAM or flash, now.
    Demote(DemoteArgs),
    /// Stop admitting new sessions and pages and demote every full page off the device.
    Drain {
        /// End a drain: admit again.
        #[arg(long)]
        resume: bool,
    },
    /// Print kvmmd's metrics (Prometheus text format) as they come.
    Metrics,
    /// A live view of the tiers, the mode and the sessions; q or Esc quits.
    Top {
        /// Refresh period in milliseconds.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(50..=3_600_000))]
        interval_ms: u64,
    },
    /// Print a shell completion script.
    Completions {
        /// The shell.
        shell: CompletionShell,
    },
}

#[derive(Subcommand, Debug)]
enum PolicyAction {
    /// Print the policy in force (the body of a [policy] table) and the mode.
    Get,
    /// Replace the running policy with a [policy] table body from FILE, or stdin for `-`; not written
    /// to the configuration file (`policy reload` goes back to it).
    Set {
        /// A TOML file with the body of a [policy] table, or `-` for stdin.
        file: PathBuf,
    },
    /// Read the configuration file's [policy] table again and apply it (as SIGHUP does).
    Reload,
}

#[derive(Args, Debug)]
struct WipeArgs {
    #[command(flatten)]
    target: WipeTarget,
    /// Do not ask before `--all` (required when stdin is not a terminal).
    #[arg(long)]
    yes: bool,
}

#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
struct WipeTarget {
    /// The session to wipe.
    id: Option<u64>,
    /// Wipe every session of this uid.
    #[arg(long, value_name = "UID")]
    user: Option<u32>,
    /// Wipe every session.
    #[arg(long)]
    all: bool,
}

#[derive(Args, Debug)]
struct CompressArgs {
    /// The session (from `kvmmctl sessions`).
    id: u64,
    /// The format to re-encode into.
    #[arg(long, value_enum)]
    format: CompressFormat,
    /// Give each page the format a demotion under adaptive precision would (around FORMAT at its
    /// bytes, ranked by age or attention mass as [policy] adaptive_ranking says); the sink page and
    /// the recent window keep theirs.
    #[arg(long)]
    adaptive: bool,
    #[command(flatten)]
    range: PageRange,
}

#[derive(Args, Debug)]
struct DemoteArgs {
    /// The session (from `kvmmctl sessions`).
    id: u64,
    /// The tier to move the pages to.
    #[arg(long, value_enum)]
    tier: DemoteTier,
    #[command(flatten)]
    range: PageRange,
}

/// Which pages of a session: every layer and every allocated block unless narrowed.
#[derive(Args, Debug)]
struct PageRange {
    /// Layers: N, or A..B (B excluded), or A.. (to the last).
    #[arg(long, value_name = "RANGE", value_parser = parse_range)]
    layers: Option<Span>,
    /// Blocks (pages of a layer): N, or A..B (B excluded), or A.. (to the last allocated).
    #[arg(long, value_name = "RANGE", value_parser = parse_range)]
    blocks: Option<Span>,
}

/// A range as the admin API takes it: a first index and a count (0: to the end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    first: u32,
    count: u32,
}

/// `N`, `A..B` (B excluded, more than A) or `A..`.
fn parse_range(text: &str) -> Result<Span, String> {
    let number = |t: &str| t.trim().parse::<u32>().map_err(|_| format!("{t:?} is not a whole number"));
    match text.split_once("..") {
        None => Ok(Span { first: number(text)?, count: 1 }),
        Some((a, "")) => Ok(Span { first: number(a)?, count: 0 }),
        Some((a, b)) => {
            let (first, end) = (number(a)?, number(b)?);
            if end <= first {
                return Err(format!("{text} is empty: the end of A..B is excluded, so B must exceed A"));
            }
            Ok(Span { first, count: end - first })
        }
    }
}

impl PageRange {
    /// (first layer, layers, first block, blocks) for the request.
    fn fields(&self) -> (u32, u32, u32, u32) {
        let all = Span { first: 0, count: 0 };
        let (l, b) = (self.layers.unwrap_or(all), self.blocks.unwrap_or(all));
        (l.first, l.count, b.first, b.count)
    }
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum CompressFormat {
    Q8,
    K8v4,
    Q4,
    Q2,
}

impl CompressFormat {
    fn to_pb(self) -> pb::PageFormat {
        match self {
            CompressFormat::Q8 => pb::PageFormat::Q8,
            CompressFormat::K8v4 => pb::PageFormat::K8v4,
            CompressFormat::Q4 => pb::PageFormat::Q4,
            CompressFormat::Q2 => pb::PageFormat::Q2,
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum DemoteTier {
    Dram,
    Flash,
}

impl DemoteTier {
    fn to_pb(self) -> pb::Tier {
        match self {
            DemoteTier::Dram => pb::Tier::Dram,
            DemoteTier::Flash => pb::Tier::Flash,
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::from(failure::EXIT_OK),
        Err(f) => {
            eprintln!("kvmmctl: {f}");
            ExitCode::from(f.exit_code())
        }
    }
}

fn run(cli: Cli) -> Result<(), Failure> {
    if let Command::Completions { shell } = cli.command {
        let shell = match shell {
            CompletionShell::Bash => clap_complete::Shell::Bash,
            CompletionShell::Zsh => clap_complete::Shell::Zsh,
            CompletionShell::Fish => clap_complete::Shell::Fish,
        };
        let mut text = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "kvmmctl", &mut text);
        return emit(&String::from_utf8_lossy(&text));
    }
    let path = socket::admin_socket(cli.socket.as_deref(), &socket::SocketEnv::from_process(), Path::exists);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| Failure::Local { what: "cannot start the async runtime".to_owned(), source })?;
    let mut admin = runtime.block_on(connect(&path))?;
    let json = cli.json;
    match cli.command {
        Command::Status => {
            let s = runtime.block_on(admin.status(pb::StatusRequest {})).map_err(Failure::rpc("Status"))?.into_inner();
            print(json, json::status(&s), || render::status(&s))
        }
        Command::Sessions => {
            let l = runtime
                .block_on(admin.list_sessions(pb::ListSessionsRequest {}))
                .map_err(Failure::rpc("ListSessions"))?
                .into_inner();
            print(json, json::sessions(&l), || render::sessions(&l))
        }
        Command::Session { id } => {
            let s = runtime
                .block_on(admin.session(pb::SessionRequest { session_id: id }))
                .map_err(Failure::rpc("Session"))?
                .into_inner();
            print(json, json::session(&s), || render::session(&s))
        }
        Command::Policy { action } => policy(&runtime, &mut admin, action, json),
        Command::Wipe(args) => wipe(&runtime, &mut admin, args, json),
        Command::Compress(args) => {
            let (first_layer, layers, first_block, blocks) = args.range.fields();
            let request = pb::CompressRequest {
                session_id: args.id,
                first_layer,
                layers,
                first_block,
                blocks,
                format: args.format.to_pb() as i32,
                adaptive: args.adaptive,
            };
            let c = runtime.block_on(admin.compress(request)).map_err(Failure::rpc("Compress"))?.into_inner();
            print(json, json::compress(&c), || render::compress(args.id, &c))
        }
        Command::Demote(args) => {
            let (first_layer, layers, first_block, blocks) = args.range.fields();
            let tier = args.tier.to_pb();
            let request =
                pb::DemoteRequest { session_id: args.id, first_layer, layers, first_block, blocks, tier: tier as i32 };
            let d = runtime.block_on(admin.demote(request)).map_err(Failure::rpc("Demote"))?.into_inner();
            print(json, json::demote(&d), || render::demote(args.id, tier, &d))
        }
        Command::Drain { resume } => {
            let d =
                runtime.block_on(admin.drain(pb::DrainRequest { resume })).map_err(Failure::rpc("Drain"))?.into_inner();
            print(json, json::drain(&d), || render::drain(&d))
        }
        Command::Metrics => {
            let m =
                runtime.block_on(admin.metrics(pb::MetricsRequest {})).map_err(Failure::rpc("Metrics"))?.into_inner();
            print(json, json::metrics(&m), || m.text.clone())
        }
        Command::Top { interval_ms } => top::run(&runtime, admin, &path, Duration::from_millis(interval_ms)),
        Command::Completions { .. } => unreachable!("handled before connecting"),
    }
}

/// Connects to the admin socket, telling a missing socket and a refused one from other failures.
async fn connect(path: &Path) -> Result<AdminClient<Channel>, Failure> {
    let channel = kvmm_client::connect::channel(path).await.map_err(|e| Failure::connect(path, &e))?;
    Ok(AdminClient::new(channel))
}

fn policy(
    runtime: &tokio::runtime::Runtime,
    admin: &mut AdminClient<Channel>,
    action: PolicyAction,
    json: bool,
) -> Result<(), Failure> {
    match action {
        PolicyAction::Get => {
            let p = runtime
                .block_on(admin.get_policy(pb::GetPolicyRequest {}))
                .map_err(Failure::rpc("GetPolicy"))?
                .into_inner();
            print(json, json::policy(&p), || render::policy(&p))
        }
        PolicyAction::Set { file } => {
            let policy_toml = read_policy(&file)?;
            let p = runtime
                .block_on(admin.set_policy(pb::SetPolicyRequest { policy_toml }))
                .map_err(Failure::rpc("SetPolicy"))?
                .into_inner();
            print(json, json::policy(&p), || render::policy(&p))
        }
        PolicyAction::Reload => {
            let r = runtime
                .block_on(admin.reload_policy(pb::ReloadPolicyRequest {}))
                .map_err(Failure::rpc("ReloadPolicy"))?
                .into_inner();
            print(json, json::reload(&r), || {
                let status = r.policy.as_ref().map(render::policy_status).unwrap_or_default();
                format!("reloaded the [policy] table from the configuration file\n{status}")
            })
        }
    }
}

/// The TOML of `policy set`: a file, or stdin for `-`.
fn read_policy(file: &Path) -> Result<String, Failure> {
    if file == Path::new("-") {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|source| Failure::Local { what: "cannot read the policy from stdin".to_owned(), source })?;
        return Ok(text);
    }
    std::fs::read_to_string(file)
        .map_err(|source| Failure::Local { what: format!("cannot read the policy file {}", file.display()), source })
}

fn wipe(
    runtime: &tokio::runtime::Runtime,
    admin: &mut AdminClient<Channel>,
    args: WipeArgs,
    json: bool,
) -> Result<(), Failure> {
    let w = match args.target {
        WipeTarget { id: Some(session_id), .. } => {
            runtime.block_on(admin.wipe_session(pb::WipeRequest { session_id })).map_err(Failure::rpc("WipeSession"))?
        }
        WipeTarget { user: Some(uid), .. } => {
            runtime.block_on(admin.wipe_user(pb::WipeUserRequest { uid })).map_err(Failure::rpc("WipeUser"))?
        }
        WipeTarget { all: true, .. } => {
            if !args.yes {
                let sessions = runtime
                    .block_on(admin.status(pb::StatusRequest {}))
                    .map_err(Failure::rpc("Status"))?
                    .into_inner()
                    .sessions;
                confirm_wipe_all(sessions)?;
            }
            runtime.block_on(admin.wipe_all(pb::WipeAllRequest {})).map_err(Failure::rpc("WipeAll"))?
        }
        WipeTarget { .. } => unreachable!("clap requires exactly one of ID, --user and --all"),
    }
    .into_inner();
    print(json, json::wipe(&w), || render::wipe(&w))
}

/// Asks on the terminal before `wipe --all`; without a terminal, refuses (scripts pass `--yes`).
fn confirm_wipe_all(sessions: u32) -> Result<(), Failure> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Failure::Usage(
            "wipe --all destroys every session's data and stdin is not a terminal to confirm it: nothing was wiped; pass --yes"
                .to_owned(),
        ));
    }
    eprint!("Wipe all {sessions} session(s)? Their data is destroyed for certain and their clients fail. [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    stdin
        .read_line(&mut answer)
        .map_err(|source| Failure::Local { what: "cannot read the answer".to_owned(), source })?;
    if matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
        Ok(())
    } else {
        Err(Failure::Usage("not confirmed: nothing was wiped".to_owned()))
    }
}

/// Prints `value` as pretty JSON with `--json`, else the human text.
fn print(json: bool, value: serde_json::Value, human: impl FnOnce() -> String) -> Result<(), Failure> {
    if json {
        let mut text = serde_json::to_string_pretty(&value).expect("a serde_json::Value always serializes");
        text.push('\n');
        emit(&text)
    } else {
        emit(&human())
    }
}

/// Writes to stdout; a reader that went away (`kvmmctl sessions | head`) is not a failure.
fn emit(text: &str) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(Failure::Local { what: "cannot write to stdout".to_owned(), source: e })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn page_ranges_read_as_first_and_count() {
        assert_eq!(parse_range("3"), Ok(Span { first: 3, count: 1 }));
        assert_eq!(parse_range("2..6"), Ok(Span { first: 2, count: 4 }));
        assert_eq!(parse_range("5.."), Ok(Span { first: 5, count: 0 }));
        assert!(parse_range("6..6").is_err_and(|e| e.contains("B must exceed A")));
        assert!(parse_range("x..2").is_err_and(|e| e.contains("not a whole number")));
        assert!(parse_range("-1").is_err());
        let cli = Cli::try_parse_from(["kvmmctl", "compress", "7", "--format", "k8v4", "--layers", "1..3"]).unwrap();
        let Command::Compress(args) = cli.command else { panic!("{:?}", cli.command) };
        assert_eq!((args.id, args.range.fields()), (7, (1, 2, 0, 0)));
        assert!(Cli::try_parse_from(["kvmmctl", "compress", "7"]).is_err(), "a format is required");
        assert!(Cli::try_parse_from(["kvmmctl", "compress", "7", "--format", "f16"]).is_err(), "not a smaller format");
        assert!(Cli::try_parse_from(["kvmmctl", "demote", "7", "--tier", "flash", "--blocks", "4.."]).is_ok());
        assert!(Cli::try_parse_from(["kvmmctl", "demote", "7", "--tier", "device"]).is_err());
    }

    #[test]
    fn wipe_takes_exactly_one_target() {
        assert!(Cli::try_parse_from(["kvmmctl", "wipe"]).is_err());
        assert!(Cli::try_parse_from(["kvmmctl", "wipe", "7", "--all"]).is_err());
        assert!(Cli::try_parse_from(["kvmmctl", "wipe", "--user", "1000", "--all"]).is_err());
        assert!(Cli::try_parse_from(["kvmmctl", "wipe", "--all", "--yes"]).is_ok());
        assert!(Cli::try_parse_from(["kvmmctl", "--json", "wipe", "7"]).is_ok());
    }
}
