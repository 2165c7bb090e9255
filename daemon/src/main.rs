//! `kvmmd`: parses flags, loads the configuration, takes the runtime directory and serves.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvmm_daemon::config::{ByteSize, Environment, FileConfig, Overrides};
use kvmm_daemon::daemon::Daemon;
use kvmm_daemon::runtime_dir::RuntimeDir;

/// kvmmd owns the KV-cache memory of local LLM inference processes: clients attach over gRPC on a
/// Unix socket and read and write their KV pages in shared memory.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// TOML configuration file (unknown keys are rejected). Without it, embedded defaults apply.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Directory for the sockets [default: $RUNTIME_DIRECTORY, /run/kvmm as root, else $XDG_RUNTIME_DIR/kvmm].
    #[arg(long, value_name = "DIR")]
    runtime_dir: Option<PathBuf>,
    /// Device-tier budget: bytes, a size such as 512MiB or 4GiB, or a percentage of MemAvailable [default: 25%].
    #[arg(long, value_name = "SIZE")]
    device_budget: Option<ByteSize>,
    /// Group (name or gid) allowed on the admin socket besides root and kvmmd's own user.
    #[arg(long, value_name = "GROUP")]
    admin_group: Option<String>,
    /// Lifetime of the one-time fd token, in milliseconds [default: 10000].
    #[arg(long, value_name = "MS")]
    fd_token_ttl_ms: Option<u64>,
    /// How long a client may hold one pin on a page before the page is reported as stuck, in
    /// milliseconds (200..=3600000) [default: 10000].
    #[arg(long, value_name = "MS")]
    pin_lease_ms: Option<u64>,
    /// Revoke (wipe) a session once one of its pages has stayed pinned past the pin lease, rather
    /// than only report it.
    #[arg(long)]
    revoke_stuck_pins: bool,
    /// The longest a session may outlive its connection waiting for a Resume (its `linger_ms` at
    /// attach), in milliseconds (0..=86400000; 0 turns lingering off) [default: 300000].
    #[arg(long, value_name = "MS")]
    max_linger_ms: Option<u64>,
    /// Milliseconds between arena compaction passes; 0 disables [default: 1000].
    #[arg(long, value_name = "MS")]
    compaction_interval_ms: Option<u64>,
    /// Log filter, e.g. info or kvmm_daemon=debug [default: info].
    #[arg(long, value_name = "FILTER")]
    log: Option<String>,
    /// Test mode: move random pages between frames continuously.
    #[arg(long, hide = true)]
    debug_move_churn: bool,
    /// DRAM-tier budget (the daemon's private pool of demoted pages); 0 disables [default: 10%].
    #[arg(long, value_name = "SIZE")]
    dram_budget: Option<ByteSize>,
    /// Flash-tier budget (a preallocated file); 0 disables [default: 0].
    #[arg(long, value_name = "SIZE")]
    flash_budget: Option<ByteSize>,
    /// Directory of the flash file [default: $STATE_DIRECTORY, /var/lib/kvmm as root, else $XDG_STATE_HOME/kvmm].
    #[arg(long, value_name = "DIR")]
    flash_dir: Option<PathBuf>,
    /// I/O engine of the flash tier: auto, io_uring or pread [default: auto].
    #[arg(long, value_name = "ENGINE")]
    io_engine: Option<String>,
    /// Format of demoted pages: q8, q4, q2, k8v4, or none to keep them exact [default: q8].
    #[arg(long, value_name = "FORMAT")]
    demote_format: Option<String>,
    /// Test mode: faults armed in the flash I/O engine, e.g. write:EIO:1,read:EIO:1.
    #[arg(long, hide = true, value_name = "SPEC")]
    debug_io_faults: Option<String>,
    /// Operating mode: auto (from battery, temperature and memory pressure), performance, balanced,
    /// powersave or thermal [default: auto].
    #[arg(long, value_name = "MODE")]
    mode: Option<String>,
    /// Root of the sysfs/procfs tree the sensors read [default: /].
    #[arg(long, value_name = "DIR")]
    host_root: Option<PathBuf>,
    /// Milliseconds between sensor readings [default: 1000].
    #[arg(long, value_name = "MS")]
    policy_interval_ms: Option<u64>,
    /// Test mode: a watched loop (tiers or policy) stops for good MS milliseconds after start.
    #[arg(long, hide = true, value_name = "LOOP:MS")]
    debug_hang: Option<String>,
    /// Check the configuration (file, flags and environment together), print the values kvmmd
    /// would run with and exit: 0 when it is valid, 1 with the reason when not. Touches nothing.
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    // Before any thread exists, so that none has taken an arena of its own yet.
    let arenas = kvmm_daemon::malloc::cap_arenas();
    let cli = Cli::parse();
    match run(cli, arenas) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvmmd: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, arenas: kvmm_daemon::malloc::ArenaCap) -> anyhow::Result<()> {
    // First, before anything else opens fds: the sockets systemd passed, if any.
    let passed = kvmm_shm::activation::take_listen_fds()?;
    let file = match &cli.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    let overrides = Overrides {
        runtime_dir: cli.runtime_dir,
        device_budget: cli.device_budget,
        admin_group: cli.admin_group,
        fd_token_ttl_ms: cli.fd_token_ttl_ms,
        pin_lease_ms: cli.pin_lease_ms,
        revoke_stuck_pins: cli.revoke_stuck_pins,
        max_linger_ms: cli.max_linger_ms,
        log: cli.log,
        compaction_interval_ms: cli.compaction_interval_ms,
        debug_move_churn: cli.debug_move_churn,
        dram_budget: cli.dram_budget,
        flash_budget: cli.flash_budget,
        flash_dir: cli.flash_dir,
        io_engine: cli.io_engine,
        demote_format: cli.demote_format,
        debug_io_faults: cli.debug_io_faults,
        mode: cli.mode,
        host_root: cli.host_root,
        policy_interval_ms: cli.policy_interval_ms,
        debug_hang: cli.debug_hang,
    };
    let mut config = file.resolve(overrides, &Environment::from_process()?)?;
    config.config_file = cli.config;
    if cli.check_config {
        print!("{}", config.summary());
        return Ok(());
    }
    init_logging(&config.log)?;
    tracing::debug!(?arenas, "malloc arenas");
    raise_open_file_limit();
    let dir = RuntimeDir::acquire(&config.runtime_dir)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let daemon = Daemon::new(config)?;
    runtime.block_on(kvmm_daemon::server::run(daemon, dir, passed))?;
    Ok(())
}

/// Raises the soft limit on open files to the hard limit. kvmmd holds a few fds per client (the
/// connection's socket and its opener's pidfd, each session's table and region memfds, one arena
/// per uid), and the usual soft limit of 1,024 (systemd's default for services, with a hard limit
/// of 524,288) would end Attach with "Too many open files" at a few hundred clients. The sysinfo
/// crate also raises it, as a side effect of its first process lookup (the first Attach's process
/// name); doing it here makes it explicit and logged. kvmmd uses epoll, never select(2), so high
/// fd numbers are safe.
fn raise_open_file_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let (Some(soft), hard) = (limit.current, limit.maximum) else { return };
    if hard.is_some_and(|hard| hard <= soft) {
        return;
    }
    // An unlimited hard limit cannot be a soft one for RLIMIT_NOFILE (the kernel caps it at
    // fs.nr_open): ask for that cap.
    let target = hard.unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/fs/nr_open").ok().and_then(|t| t.trim().parse().ok()).unwrap_or(1 << 20)
    });
    match setrlimit(Resource::Nofile, rustix::process::Rlimit { current: Some(target), maximum: hard }) {
        Ok(()) => tracing::info!(from = soft, to = target, "raised the limit on open files to its hard limit"),
        Err(e) => {
            tracing::warn!(limit = soft, error = %e, "cannot raise the limit on open files; Attach may fail with \"Too many open files\" past a few hundred clients (raise LimitNOFILE=)")
        }
    }
}

/// Where log lines go: to journald (structured fields, priorities from levels) when stderr is the
/// journal's stream (`JOURNAL_STREAM` names stderr's device and inode, as systemd sets it), else
/// plain text on stderr. A journal that cannot be reached falls back to plain text and says why.
fn init_logging(filter: &str) -> anyhow::Result<()> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let registry = tracing_subscriber::registry().with(tracing_subscriber::EnvFilter::try_new(filter)?);
    let fallback = if stderr_is_journal() {
        match tracing_journald::layer() {
            Ok(journal) => {
                registry.with(journal.with_syslog_identifier("kvmmd".to_owned())).init();
                return Ok(());
            }
            Err(e) => Some(e),
        }
    } else {
        None
    };
    let text = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    registry.with(text).init();
    if let Some(e) = fallback {
        tracing::warn!(error = %e, "stderr is the journal's stream but journald cannot be reached; logging plain text");
    }
    Ok(())
}

/// Whether `JOURNAL_STREAM` (`DEVICE:INODE`) names this process's stderr, so a redirected stderr
/// (a test harness, a shell under a unit) keeps plain text.
fn stderr_is_journal() -> bool {
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else { return false };
    let Some((dev, ino)) = value.to_str().and_then(|v| v.split_once(':')) else { return false };
    let Ok(st) = rustix::fs::fstat(std::io::stderr()) else { return false };
    dev.parse() == Ok(st.st_dev) && ino.parse() == Ok(st.st_ino)
}
