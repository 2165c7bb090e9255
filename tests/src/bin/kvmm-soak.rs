//! `kvmm-soak`: minutes of chaos against a real kvmmd whose tiers are small enough that pages keep
//! moving, with the daemon's accounting checked every second (issue 9). A bench, not part of
//! `cargo test`.
//!
//! ```text
//! kvmm-soak [--minutes 10] [--clients 6] [--seed S] [--json]
//! ```
//!
//! It starts kvmmd (the one beside this binary, or `--kvmmd` / `$KVMMD_BIN`) in a temporary runtime
//! directory with an 8 MiB device budget, 4 MiB of DRAM and a 256 MiB flash file, and q8 demotion.
//! Then:
//!
//! - **Clients.** One thread per slot keeps a `kvmm-test-client run` process going (beside this
//!   binary, or `--test-client` / `$KVMM_TEST_CLIENT_BIN`): a 4-layer SmolLM2-shaped session
//!   (f16 or bf16, a random priority) that appends, checks rounds of attention, asks for stats,
//!   prefetches and takes 1–40 tokens back (`truncate`, to its page's start where the cut would
//!   fall inside a full page), at a human pace, until it holds a random 256–1280 tokens, reads a while longer,
//!   then detaches and exits; the slot starts the next one. The client checks every attention output against its own copy
//!   of the K/V (quantized as the daemon quantizes, for compressed pages): a wrong byte served prints
//!   `FAIL` and exits 3, which fails the soak.
//! - **Chaos.** Every 1–3 s, by a seeded RNG: SIGKILL a random client; flip the policy (admin
//!   `SetPolicy`, between the bodies of `kvmm_tests::soak::POLICIES`); wipe a random client's
//!   session (the client must then end with `FAILED_PRECONDITION`); demote a random session to DRAM
//!   or flash; compress one to q8.
//! - **Invariants**, every second: the checks of `kvmm_tests::soak` on `Status`, `ListSessions`,
//!   `Status`, and whether kvmmd is alive.
//! - **Memory**: kvmmd's RSS and PSS after the warm-up (30 s, or a third of a shorter run) and at
//!   the end, each time with every slot's session attached and the chaos paused; the verdict takes
//!   RSS (PSS moves with the clients' own mappings of the arena), and only after the full warm-up
//!   (runs of 90 s or more; a smoke run reports it). RSS is also sampled every 20 s after the
//!   warm-up, so a leak shows as a climb and a warm-up as a level; from six samples on (a run of
//!   2.5 minutes or more), the verdict judges their trend instead (`kvmm_tests::soak::trend_pct`:
//!   the lowest of the last third against the highest of the first), since two single samples can
//!   show a swing of about 6% as growth.
//! - **End**: the clients detach, every tier must then be empty, and kvmmd must exit 0 on SIGTERM.
//!
//! The report (a table, or `--json`) gives actions by kind, checks, violations by kind with the
//! first few described, the clients' ends, page traffic between tiers and the memory samples. Exit
//! 0 when it passed; 1 on any violation, client `FAIL` or unexpected end, RSS growth above 5% (the
//! trend where there is one), a tier not empty at the end or an unclean daemon exit; 2 when it
//! could not run.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::Parser;
use kvmm_proto::v1 as pb;
use kvmm_proto::v1::admin_client::AdminClient;
use kvmm_tests::soak::{
    self, Action, ActionTally, Budgets, ClientTally, Finding, Memory, Owner, Report, Sandwich, Violations,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tonic::transport::Channel;

/// The daemon's tiers: small, so that six clients of a few hundred tokens each overflow the device
/// and DRAM and pages travel all the way down to flash and back (with 8 MiB of DRAM, q8 pages of
/// six such clients fit in DRAM and flash saw only the chaos loop's demotions).
const DEVICE_BUDGET: &str = "8MiB";
const DRAM_BUDGET: &str = "4MiB";
const FLASH_BUDGET: &str = "256MiB";

/// How often the invariants are checked.
const CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// How many times a torn sandwich is taken again before the check gives up on its cross-RPC part.
const SANDWICH_TRIES: u32 = 5;

/// How long before an owner violation is looked at again on a fresh listing.
const OWNER_RECHECK_AFTER: Duration = Duration::from_millis(200);

/// The longest a client may take to answer one command (a round of checked attention over four
/// layers of ≤ 1024 tokens takes milliseconds; a debug build on a loaded machine, seconds).
const CLIENT_ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest an admin RPC may take (a `Demote` to flash of a whole session under load).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the memory samples wait for every slot's session to be attached.
const FULL_HOUSE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the end waits for the clients to detach, then for every tier to empty.
const CLIENTS_STOP_TIMEOUT: Duration = Duration::from_secs(90);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(15);

/// How often a progress line goes to stderr.
const PROGRESS_EVERY: Duration = Duration::from_secs(60);
/// How often kvmmd's RSS is sampled for the trend, after the warm-up.
const MEMORY_EVERY: Duration = Duration::from_secs(20);

/// The geometry every client attaches with (tokens per page and head shape are the test client's
/// defaults: 32, 3 KV heads × 64 dims, 9 query heads).
const LAYERS: u32 = 4;
const MAX_TOKENS: u32 = 2048;

/// The most tokens a client appends. A client's attention pins a whole layer: six clients at 40
/// 16-bit pages each pin 6 MB at worst, inside the 8 MiB device, so a fault always finds room.
const MAX_TARGET_TOKENS: u32 = 1280;

#[derive(Parser, Debug)]
#[command(
    name = "kvmm-soak",
    about = "Random client kills, policy flips, wipes and page moves against kvmmd, with its accounting checked \
             every second"
)]
struct Cli {
    /// Minutes of chaos (fractions allowed: 0.25 is a 15 s smoke run).
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Client processes kept running.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=64))]
    clients: u32,
    /// Seed of every random choice (default: from the clock; the report prints it).
    #[arg(long)]
    seed: Option<u64>,
    /// Print the report as JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// The kvmmd binary; default `$KVMMD_BIN`, else `kvmmd` beside this binary.
    #[arg(long)]
    kvmmd: Option<PathBuf>,
    /// The test client; default `$KVMM_TEST_CLIENT_BIN`, else `kvmm-test-client` beside this binary.
    #[arg(long)]
    test_client: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(report) => {
            if cli.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(text) => println!("{text}"),
                    Err(e) => eprintln!("kvmm-soak: the report does not serialize: {e}"),
                }
            } else {
                println!("{report}");
            }
            if report.passed { ExitCode::SUCCESS } else { ExitCode::from(1) }
        }
        Err(e) => {
            eprintln!("kvmm-soak: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Locks a mutex; a thread that panicked while holding it leaves counters that are still worth
/// reporting.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A binary of this workspace: `flag`, else `$<ENV>`, else `name` beside this binary.
fn sibling_binary(flag: Option<&Path>, env: &str, name: &str) -> anyhow::Result<PathBuf> {
    if let Some(path) = flag {
        return Ok(path.to_owned());
    }
    if let Some(path) = std::env::var_os(env).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let bin = std::env::current_exe().context("cannot find this binary")?.with_file_name(name);
    if !bin.exists() {
        bail!(
            "{} does not exist: build it (`cargo build --release -p kvmm-daemon -p kvmm-tests --bins`), or set ${env}",
            bin.display()
        );
    }
    Ok(bin)
}

// ---------------------------------------------------------------------------------------------
// The admin connection

/// One admin connection on its own single-threaded runtime; every call has [`ADMIN_TIMEOUT`].
struct Admin {
    runtime: tokio::runtime::Runtime,
    client: AdminClient<Channel>,
}

impl Admin {
    fn connect(socket: &Path) -> anyhow::Result<Admin> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let channel = runtime.block_on(kvmm_client::connect::channel(socket))?;
        Ok(Admin { runtime, client: AdminClient::new(channel) })
    }

    /// Runs one call with the timeout; a timeout is `DEADLINE_EXCEEDED`.
    fn call<T, F>(&mut self, call: impl FnOnce(AdminClient<Channel>) -> F) -> Result<T, tonic::Status>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let future = call(self.client.clone());
        match self.runtime.block_on(async { tokio::time::timeout(ADMIN_TIMEOUT, future).await }) {
            Ok(reply) => reply.map(tonic::Response::into_inner),
            Err(_) => Err(tonic::Status::deadline_exceeded(format!("no answer within {ADMIN_TIMEOUT:?}"))),
        }
    }

    fn status(&mut self) -> Result<pb::StatusResponse, tonic::Status> {
        self.call(|mut a| async move { a.status(pb::StatusRequest {}).await })
    }

    fn sessions(&mut self) -> Result<pb::ListSessionsResponse, tonic::Status> {
        self.call(|mut a| async move { a.list_sessions(pb::ListSessionsRequest {}).await })
    }

    fn set_policy(&mut self, body: &str) -> Result<pb::PolicyResponse, tonic::Status> {
        let request = pb::SetPolicyRequest { policy_toml: body.to_owned() };
        self.call(|mut a| async move { a.set_policy(request).await })
    }

    fn wipe(&mut self, session_id: u64) -> Result<pb::WipeResponse, tonic::Status> {
        self.call(|mut a| async move { a.wipe_session(pb::WipeRequest { session_id }).await })
    }

    fn demote(&mut self, session_id: u64, tier: pb::Tier) -> Result<pb::DemoteResponse, tonic::Status> {
        let request = pb::DemoteRequest { session_id, tier: tier as i32, ..Default::default() };
        self.call(|mut a| async move { a.demote(request).await })
    }

    fn compress(&mut self, session_id: u64) -> Result<pb::CompressResponse, tonic::Status> {
        let request = pb::CompressRequest { session_id, format: pb::PageFormat::Q8 as i32, ..Default::default() };
        self.call(|mut a| async move { a.compress(request).await })
    }
}

// ---------------------------------------------------------------------------------------------
// Client slots

/// Why the chaos loop expects a client to end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Doom {
    /// It was sent SIGKILL.
    Killed,
    /// Its session was wiped: its next call fails with `FAILED_PRECONDITION`.
    Wiped,
}

/// What the chaos loop and a slot's thread share about the slot's current client.
#[derive(Debug, Default)]
struct Slot {
    /// The client's pid while it is unreaped: the slot's thread clears it (under this lock) before
    /// reaping, so a kill through it never reaches a recycled pid.
    pid: Option<u32>,
    /// Its session, once it printed `attached`.
    session: Option<u64>,
    /// Set by the chaos loop before it kills the client or wipes its session.
    doom: Option<Doom>,
}

/// State shared by the main thread and the slot threads.
struct Shared {
    /// One per client slot.
    slots: Vec<Mutex<Slot>>,
    /// Every client process started, by pid: the owner check's view of who may own a session.
    owners: Mutex<HashMap<u32, Owner>>,
    /// How the clients ended.
    tally: Mutex<ClientTally>,
    /// What went wrong with clients (FAILs and unexpected ends), first few described.
    problems: Mutex<Violations>,
    /// The run's start, for timestamps.
    started: Instant,
    /// Set at the end: slots detach their client and start no other.
    stop: AtomicBool,
}

impl Shared {
    fn seconds(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}

/// What a slot's thread needs to start clients.
#[derive(Clone)]
struct ClientSetup {
    /// The test client binary.
    binary: PathBuf,
    /// kvmmd's session socket.
    socket: PathBuf,
    /// Where each slot's client writes its stderr (`slot-N.stderr`, overwritten per client).
    logs: PathBuf,
}

/// How a conversation with a client ended before its detach.
#[derive(Debug)]
enum End {
    /// stdout closed (it exited or was killed).
    Eof,
    /// No answer within [`CLIENT_ANSWER_TIMEOUT`].
    Timeout,
    /// It printed `FAIL ...`: an attention output did not match its K/V.
    Fail(String),
    /// It printed `error code=... msg=...` (and exits 2).
    Error(String),
}

/// One running client process, as its slot's thread sees it.
struct Conversation {
    child: Child,
    stdin: ChildStdin,
    /// Lines of its stdout, read by a thread until EOF.
    lines: Receiver<String>,
    /// `attentions=` of its last report: outputs it checked.
    attentions: u64,
    /// `tokens=` of its last report.
    tokens: u64,
}

/// The value of `key=` in a report line.
fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

impl Conversation {
    /// Waits for a line starting with `prefix`, remembering the counters of report lines.
    fn expect(&mut self, prefix: &str) -> Result<String, End> {
        loop {
            let line = match self.lines.recv_timeout(CLIENT_ANSWER_TIMEOUT) {
                Ok(line) => line,
                Err(RecvTimeoutError::Timeout) => return Err(End::Timeout),
                Err(RecvTimeoutError::Disconnected) => return Err(End::Eof),
            };
            if line.starts_with("FAIL") {
                return Err(End::Fail(line));
            }
            if line.starts_with("error code=") {
                return Err(End::Error(line));
            }
            if let Some(n) = field(&line, "attentions") {
                self.attentions = n;
            }
            if let Some(n) = field(&line, "tokens") {
                self.tokens = n;
            }
            if line.starts_with(prefix) {
                return Ok(line);
            }
        }
    }

    /// Sends a command and waits for its answer.
    fn ask(&mut self, command: &str, answer: &str) -> Result<String, End> {
        if writeln!(self.stdin, "{command}").and_then(|()| self.stdin.flush()).is_err() {
            return Err(self.last_words());
        }
        self.expect(answer)
    }

    /// Why a client that stopped reading its commands ended: its `FAIL` or `error` line if it
    /// printed one before its stdout closed.
    fn last_words(&mut self) -> End {
        loop {
            match self.lines.recv_timeout(CLIENT_ANSWER_TIMEOUT) {
                Ok(line) if line.starts_with("FAIL") => return End::Fail(line),
                Ok(line) if line.starts_with("error code=") => return End::Error(line),
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => return End::Timeout,
                Err(RecvTimeoutError::Disconnected) => return End::Eof,
            }
        }
    }
}

/// A slot's thread: keeps a client running until the soak stops.
fn slot_thread(index: usize, shared: Arc<Shared>, setup: ClientSetup, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut bad_in_a_row = 0u32;
    while !shared.stop.load(Ordering::SeqCst) {
        let expected = one_client(index, &shared, &setup, &mut rng);
        // A client that cannot even start (a broken build, a dead daemon) must not spin.
        bad_in_a_row = if expected { 0 } else { bad_in_a_row + 1 };
        std::thread::sleep(Duration::from_millis(50 + 500 * u64::from(bad_in_a_row.min(10))));
    }
}

/// Runs one client from spawn to reaping and counts how it ended; `false` if it ended in a way
/// nobody asked for.
fn one_client(index: usize, shared: &Shared, setup: &ClientSetup, rng: &mut StdRng) -> bool {
    let first = rng.random_range(32..=128u32);
    let target = u64::from(rng.random_range(256..=MAX_TARGET_TOKENS));
    let mut args = vec![
        "run".to_owned(),
        "--socket".to_owned(),
        setup.socket.display().to_string(),
        "--layers".to_owned(),
        LAYERS.to_string(),
        "--max-tokens".to_owned(),
        MAX_TOKENS.to_string(),
        "--tokens".to_owned(),
        first.to_string(),
        "--attend-every".to_owned(),
        "4".to_owned(),
        "--seed".to_owned(),
        rng.random_range(1..u64::MAX).to_string(),
        "--priority".to_owned(),
        ["foreground", "background", "batch"][rng.random_range(0..3usize)].to_owned(),
    ];
    if rng.random_range(0..4) == 0 {
        args.push("--bf16".to_owned());
    }
    let stderr_path = setup.logs.join(format!("slot-{index}.stderr"));
    let spawned = std::fs::File::create(&stderr_path).and_then(|stderr| {
        Command::new(&setup.binary).args(&args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(stderr).spawn()
    });
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let f = Finding { kind: "client_spawn", detail: format!("slot {index}: cannot start the client: {e}") };
            lock(&shared.problems).add(&f, shared.seconds());
            lock(&shared.tally).unexpected += 1;
            return false;
        }
    };
    let pid = child.id();
    lock(&shared.owners).insert(pid, Owner::Running);
    lock(&shared.tally).started += 1;
    *lock(&shared.slots[index]) = Slot { pid: Some(pid), session: None, doom: None };
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        lock(&shared.owners).insert(pid, Owner::Ended(Instant::now()));
        return false;
    };
    let (tx, lines) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut talk = Conversation { child, stdin, lines, attentions: 0, tokens: 0 };
    let outcome = converse(index, shared, &mut talk, target, rng);
    // Take the pid first: from here on the chaos loop cannot signal this process.
    let (doom, session) = {
        let mut slot = lock(&shared.slots[index]);
        slot.pid = None;
        (slot.doom.take(), slot.session.take())
    };
    if matches!(outcome, Err(End::Timeout)) {
        let _ = talk.child.kill();
    }
    let status = talk.child.wait();
    let _ = reader.join();
    lock(&shared.owners).insert(pid, Owner::Ended(Instant::now()));
    let mut tally = lock(&shared.tally);
    tally.attentions_checked += talk.attentions;
    let unexpected = |what: String| {
        let tail = stderr_tail(&stderr_path);
        let detail = format!(
            "slot {index} pid {pid} session {}: {what}{}",
            session.map_or("-".to_owned(), |s| s.to_string()),
            if tail.is_empty() { String::new() } else { format!("; stderr: {tail}") }
        );
        Finding { kind: "client_unexpected", detail }
    };
    let status_text = |s: &std::io::Result<ExitStatus>| match s {
        Ok(s) => s.to_string(),
        Err(e) => format!("not reaped: {e}"),
    };
    match (outcome, doom) {
        (Err(End::Fail(line)), _) => {
            tally.fails += 1;
            let f = Finding {
                kind: "client_fail",
                detail: format!(
                    "slot {index} pid {pid} session {}: {line}",
                    session.map_or("-".to_owned(), |s| s.to_string())
                ),
            };
            lock(&shared.problems).add(&f, shared.seconds());
            false
        }
        (_, Some(Doom::Killed)) => {
            tally.killed += 1;
            true
        }
        (Err(End::Error(line)), Some(Doom::Wiped)) if line.starts_with("error code=FailedPrecondition") => {
            tally.wiped += 1;
            true
        }
        (Ok(()), _) if status.as_ref().is_ok_and(ExitStatus::success) => {
            tally.finished += 1;
            true
        }
        (outcome, doom) => {
            tally.unexpected += 1;
            let what = match outcome {
                Ok(()) => format!("detached but exited with {}", status_text(&status)),
                Err(End::Error(line)) => format!("{line} (doom {doom:?})"),
                Err(End::Eof) => format!("exited on its own with {}", status_text(&status)),
                Err(End::Timeout) => format!("no answer within {CLIENT_ANSWER_TIMEOUT:?}; killed"),
                Err(End::Fail(line)) => line,
            };
            lock(&shared.problems).add(&unexpected(what), shared.seconds());
            false
        }
    }
}

/// The last lines of a client's stderr, on one line.
fn stderr_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..].join(" | ")
}

/// The client's life: attach and first tokens, then appends, checked rounds, stats, prefetches and
/// truncations at a human pace until it holds `target` tokens, then a few more reads (its pages
/// keep moving meanwhile), then detach; when the soak stops, detach at once.
fn converse(index: usize, shared: &Shared, talk: &mut Conversation, target: u64, rng: &mut StdRng) -> Result<(), End> {
    let attached = talk.expect("attached")?;
    lock(&shared.slots[index]).session = field(&attached, "session");
    talk.expect("appended")?;
    let mut reads_after_target = rng.random_range(4..=16u32);
    while reads_after_target > 0 && !shared.stop.load(Ordering::SeqCst) {
        let growing = talk.tokens < target;
        if !growing {
            reads_after_target -= 1;
        }
        match rng.random_range(if growing { 0 } else { 5 }..11) {
            0..=4 => {
                let n = rng.random_range(8..=48u64).min(target - talk.tokens).max(1);
                talk.ask(&format!("append {n}"), "appended")?;
            }
            5..=7 => {
                talk.ask(&format!("check {}", rng.random_range(1..=2)), "checked")?;
            }
            8 => {
                talk.ask("stats", "stats")?;
            }
            // Draft tokens rejected, or an answer to regenerate: the client appends again after. It
            // keeps a page at least, so that its checked rounds have tokens to read.
            10 if talk.tokens > 72 => {
                talk.ask(&format!("truncate {}", rng.random_range(1..=40u32)), "truncated")?;
            }
            _ => {
                talk.ask("prefetch", "prefetched")?;
            }
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(20..=200)));
    }
    talk.ask("exit", "detached")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The run

/// Everything the main thread keeps while the soak runs.
struct Soak {
    admin: Admin,
    shared: Arc<Shared>,
    rng: StdRng,
    budgets: Budgets,
    daemon_pid: u32,
    /// Index into `soak::POLICIES` of the body in force.
    policy: usize,
    actions: std::collections::BTreeMap<Action, ActionTally>,
    checks: u64,
    torn_checks: u64,
    violations: Violations,
    /// The daemon stopped answering: the chaos ends.
    daemon_down: bool,
    /// kvmmd's memory at each progress line.
    memory_series: Vec<(f64, Memory)>,
}

impl Soak {
    fn violation(&mut self, f: &Finding) {
        self.violations.add(f, self.shared.seconds());
    }

    /// Whether kvmmd's process still exists.
    fn daemon_alive(&self) -> bool {
        Path::new(&format!("/proc/{}", self.daemon_pid)).exists()
            && std::fs::read_to_string(format!("/proc/{}/stat", self.daemon_pid))
                .is_ok_and(|s| !s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')))
    }

    /// An admin call failed: a violation of its own kind, or the daemon's death.
    fn admin_failed(&mut self, what: &str, e: &tonic::Status) {
        if self.daemon_alive() {
            self.violation(&Finding { kind: "admin_rpc", detail: format!("{what} failed: {e}") });
        } else if !self.daemon_down {
            self.daemon_down = true;
            self.violation(&Finding { kind: "daemon_down", detail: format!("kvmmd is gone ({what}: {e})") });
        }
    }

    /// One invariant check; see `kvmm_tests::soak`.
    fn check(&mut self) {
        self.checks += 1;
        if !self.daemon_alive() {
            if !self.daemon_down {
                self.daemon_down = true;
                self.violation(&Finding { kind: "daemon_down", detail: "kvmmd's process is gone".to_owned() });
            }
            return;
        }
        for attempt in 0..SANDWICH_TRIES {
            let triple = self.admin.status().and_then(|before| {
                let list = self.admin.sessions()?;
                Ok((before, list, self.admin.status()?))
            });
            let (before, list, after) = match triple {
                Ok(t) => t,
                Err(e) => return self.admin_failed("Status/ListSessions", &e),
            };
            if attempt == 0 {
                let mut found = soak::check_status(&before, &self.budgets);
                found.extend(soak::check_listing(&list));
                for f in &found {
                    self.violation(f);
                }
                self.check_owners(&list);
            }
            match soak::compare(&before, &list, &after) {
                Sandwich::Compared(found) => {
                    for f in &found {
                        self.violation(f);
                    }
                    return;
                }
                Sandwich::Torn => continue,
            }
        }
        self.torn_checks += 1;
    }

    /// The owner part of a check, with its one re-check on a fresh listing.
    fn check_owners(&mut self, list: &pb::ListSessionsResponse) {
        let owners = lock(&self.shared.owners).clone();
        if soak::check_owners(&list.sessions, &owners, Instant::now()).is_empty() {
            return;
        }
        std::thread::sleep(OWNER_RECHECK_AFTER);
        let again = match self.admin.sessions() {
            Ok(l) => l,
            Err(e) => return self.admin_failed("ListSessions", &e),
        };
        let owners = lock(&self.shared.owners).clone();
        for f in soak::check_owners(&again.sessions, &owners, Instant::now()) {
            self.violation(&f);
        }
    }

    /// A random slot matching `pick` (given the slot), with its lock held.
    fn random_slot(&mut self, pick: impl Fn(&Slot) -> bool) -> Option<MutexGuard<'_, Slot>> {
        let n = self.shared.slots.len();
        let start = self.rng.random_range(0..n);
        (0..n).map(|i| &self.shared.slots[(start + i) % n]).map(lock).find(|s| pick(s))
    }

    /// Whether an admin refusal means the session went away between the pick and the call.
    fn target_gone(e: &tonic::Status) -> bool {
        matches!(e.code(), tonic::Code::NotFound | tonic::Code::FailedPrecondition)
    }

    /// Does one chaos action.
    fn act(&mut self, action: Action) {
        let outcome = match action {
            Action::Kill => self.kill(),
            Action::Policy => {
                let next = soak::next_policy(&mut self.rng, self.policy);
                match self.admin.set_policy(soak::POLICIES[next]) {
                    Ok(_) => {
                        self.policy = next;
                        Some(Ok(()))
                    }
                    Err(e) => Some(Err(e)),
                }
            }
            Action::Wipe => self.wipe(),
            Action::Demote | Action::Compress => {
                let session = self.random_slot(|s| s.pid.is_some() && s.session.is_some()).and_then(|s| s.session);
                session.map(|id| {
                    if action == Action::Compress {
                        self.admin.compress(id).map(|_| ())
                    } else {
                        let tier = if self.rng.random_range(0..2) == 0 { pb::Tier::Dram } else { pb::Tier::Flash };
                        self.admin.demote(id, tier).map(|_| ())
                    }
                })
            }
        };
        let tally = self.actions.entry(action).or_default();
        match outcome {
            None => tally.skipped += 1,
            Some(Ok(())) => tally.done += 1,
            Some(Err(e)) if Self::target_gone(&e) => tally.target_gone += 1,
            Some(Err(e)) => self.admin_failed(action.name(), &e),
        }
    }

    /// SIGKILLs a random running client not already doomed.
    fn kill(&mut self) -> Option<Result<(), tonic::Status>> {
        let mut slot = self.random_slot(|s| s.pid.is_some() && s.doom.is_none())?;
        let pid = slot.pid?;
        slot.doom = Some(Doom::Killed);
        let target = rustix::process::Pid::from_raw(i32::try_from(pid).ok()?)?;
        // The slot's thread reaps only after taking the pid under this lock, so `pid` is this client.
        Some(
            rustix::process::kill_process(target, rustix::process::Signal::KILL)
                .map_err(|e| tonic::Status::internal(format!("kill {pid}: {e}"))),
        )
    }

    /// Wipes a random running client's session (marking the client doomed first).
    fn wipe(&mut self) -> Option<Result<(), tonic::Status>> {
        let (index, session) = {
            let n = self.shared.slots.len();
            let start = self.rng.random_range(0..n);
            (0..n).map(|i| (start + i) % n).find_map(|i| {
                let mut slot = lock(&self.shared.slots[i]);
                match (slot.pid, slot.session, slot.doom) {
                    (Some(_), Some(session), None) => {
                        slot.doom = Some(Doom::Wiped);
                        Some((i, session))
                    }
                    _ => None,
                }
            })?
        };
        let result = self.admin.wipe(session).map(|_| ());
        if result.is_err() {
            let mut slot = lock(&self.shared.slots[index]);
            if slot.session == Some(session) && slot.doom == Some(Doom::Wiped) {
                slot.doom = None;
            }
        }
        Some(result)
    }

    /// kvmmd's memory, with the session count it was taken at.
    fn memory(&mut self) -> Option<Memory> {
        let sessions = self.admin.status().ok()?.sessions;
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.daemon_pid)).ok()?;
        let rollup = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", self.daemon_pid)).ok();
        Memory::parse(&status, rollup.as_deref(), sessions)
    }

    /// Waits (checking every second) until every slot's session is attached, then samples memory.
    fn memory_with_every_client(&mut self) -> Option<Memory> {
        let want = self.shared.slots.len() as u32;
        let deadline = Instant::now() + FULL_HOUSE_TIMEOUT;
        let mut next_check = Instant::now() + CHECK_INTERVAL;
        while Instant::now() < deadline && !self.daemon_down {
            if self.admin.status().is_ok_and(|s| s.sessions == want) {
                return self.memory();
            }
            if Instant::now() >= next_check {
                self.check();
                next_check += CHECK_INTERVAL;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// A memory sample for the series, `chaos_started` being the time 0 of its labels.
    fn sample_memory(&mut self, chaos_started: Instant) {
        if let Some(m) = self.memory() {
            self.memory_series.push((chaos_started.elapsed().as_secs_f64(), m));
        }
    }

    /// A progress line on stderr.
    fn progress(&mut self, chaos_started: Instant) {
        let tally = lock(&self.shared.tally).clone();
        let done: u64 = self.actions.values().map(|t| t.done).sum();
        let at = chaos_started.elapsed().as_secs_f64();
        let memory = self.memory();
        eprintln!(
            "kvmm-soak: {at:.0} s: {done} actions, {} checks, {} violations; clients {} started, {} FAIL, {} \
             unexpected; kvmmd RSS {} KiB",
            self.checks,
            self.violations.total(),
            tally.started,
            tally.fails,
            tally.unexpected,
            memory.map_or("?".to_owned(), |m| m.rss_kib.to_string())
        );
    }
}

fn run(cli: &Cli) -> anyhow::Result<Report> {
    if !(cli.minutes.is_finite() && cli.minutes > 0.0) {
        bail!("--minutes must be a positive number of minutes");
    }
    let kvmmd = sibling_binary(cli.kvmmd.as_deref(), "KVMMD_BIN", "kvmmd")?;
    let client_bin = sibling_binary(cli.test_client.as_deref(), "KVMM_TEST_CLIENT_BIN", "kvmm-test-client")?;
    let seed = match cli.seed {
        Some(s) => s,
        None => SystemTime::now().duration_since(UNIX_EPOCH).context("the clock is before 1970")?.as_nanos() as u64,
    };
    let started = Instant::now();
    let scratch = tempfile::Builder::new().prefix("kvmm-soak-").tempdir().context("cannot create a scratch dir")?;
    let flash_dir = scratch.path().join("flash");
    let logs = scratch.path().join("clients");
    std::fs::create_dir_all(&flash_dir)?;
    std::fs::create_dir_all(&logs)?;
    let flash = flash_dir.to_str().context("the scratch directory's path is not UTF-8")?;
    let daemon_args = vec![
        "--device-budget",
        DEVICE_BUDGET,
        "--dram-budget",
        DRAM_BUDGET,
        "--flash-budget",
        FLASH_BUDGET,
        "--flash-dir",
        flash,
        "--demote-format",
        "q8",
    ];
    let daemon = kvmm_tests::Daemon::start_with(Command::new(&kvmmd), None, &daemon_args);
    let mut admin = Admin::connect(&daemon.dir().join("kvmm-admin.sock"))?;
    let first = admin.status().context("admin Status")?;
    let tiers: Vec<&str> = first.tiers.iter().map(|t| t.tier.as_str()).collect();
    if tiers != soak::TIERS {
        bail!("kvmmd came up with tiers {tiers:?}, not device, dram and flash; its log:\n{}", daemon.log());
    }
    admin.set_policy(soak::POLICIES[0]).context("admin SetPolicy")?;

    let clients = cli.clients as usize;
    let shared = Arc::new(Shared {
        slots: (0..clients).map(|_| Mutex::new(Slot::default())).collect(),
        owners: Mutex::new(HashMap::new()),
        tally: Mutex::new(ClientTally::default()),
        problems: Mutex::new(Violations::default()),
        started,
        stop: AtomicBool::new(false),
    });
    let setup = ClientSetup { binary: client_bin, socket: daemon.socket(), logs };
    let mut rng = StdRng::seed_from_u64(seed);
    let threads: Vec<JoinHandle<()>> = (0..clients)
        .map(|index| {
            let (shared, setup, slot_seed) = (shared.clone(), setup.clone(), rng.random_range(0..u64::MAX));
            std::thread::spawn(move || slot_thread(index, shared, setup, slot_seed))
        })
        .collect();

    let mut soak = Soak {
        admin,
        shared: shared.clone(),
        rng,
        budgets: Budgets::of(&first),
        daemon_pid: daemon.pid(),
        policy: 0,
        actions: Action::ALL.into_iter().map(|a| (a, ActionTally::default())).collect(),
        checks: 0,
        torn_checks: 0,
        violations: Violations::default(),
        daemon_down: false,
        memory_series: Vec::new(),
    };

    // The chaos phase, with the memory sample after the warm-up.
    let chaos = Duration::from_secs_f64(cli.minutes * 60.0);
    let warmup = soak::FULL_WARMUP.min(chaos / 3);
    let chaos_started = Instant::now();
    let chaos_end = chaos_started + chaos;
    let mut next_check = chaos_started + CHECK_INTERVAL;
    let mut next_action = chaos_started + soak::action_interval(&mut soak.rng);
    let mut next_progress = chaos_started + PROGRESS_EVERY;
    let mut memory_start = None;
    let mut next_memory = chaos_end;
    while Instant::now() < chaos_end && !soak.daemon_down {
        let now = Instant::now();
        if memory_start.is_none() && now >= chaos_started + warmup {
            memory_start = Some(soak.memory_with_every_client());
            next_check = Instant::now() + CHECK_INTERVAL;
            next_action = Instant::now() + soak::action_interval(&mut soak.rng);
            next_memory = Instant::now() + MEMORY_EVERY;
            continue;
        }
        if now >= next_memory {
            soak.sample_memory(chaos_started);
            next_memory += MEMORY_EVERY;
        }
        if now >= next_check {
            soak.check();
            next_check += CHECK_INTERVAL;
            if next_check < Instant::now() {
                next_check = Instant::now() + CHECK_INTERVAL;
            }
        }
        if now >= next_action {
            let action = soak::pick_action(&mut soak.rng);
            soak.act(action);
            next_action = Instant::now() + soak::action_interval(&mut soak.rng);
        }
        if now >= next_progress {
            soak.progress(chaos_started);
            next_progress += PROGRESS_EVERY;
        }
        let wake = next_check.min(next_action).min(next_memory).min(chaos_end);
        std::thread::sleep(wake.saturating_duration_since(Instant::now()).min(Duration::from_millis(200)));
    }
    let chaos_seconds = chaos_started.elapsed().as_secs_f64();
    let memory_end = if soak.daemon_down { None } else { soak.memory_with_every_client() };

    // The end: clients detach, tiers empty, kvmmd exits cleanly.
    shared.stop.store(true, Ordering::SeqCst);
    let stop_deadline = Instant::now() + CLIENTS_STOP_TIMEOUT;
    while threads.iter().any(|t| !t.is_finished()) && Instant::now() < stop_deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for slot in &shared.slots {
        // A client still running now is stuck: its slot counts it as unexpected once it dies.
        let slot = lock(slot);
        if let Some(pid) = slot.pid.and_then(|p| rustix::process::Pid::from_raw(i32::try_from(p).ok()?)) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
    for t in threads {
        let _ = t.join();
    }
    soak.check();
    let mut drained_empty = false;
    let mut last = None;
    let drain_deadline = Instant::now() + DRAIN_TIMEOUT;
    while !soak.daemon_down {
        match soak.admin.status() {
            Ok(s) => {
                let left = soak::check_empty(&s);
                last = Some(s);
                if left.is_empty() {
                    drained_empty = true;
                    break;
                }
                if Instant::now() >= drain_deadline {
                    for f in &left {
                        soak.violation(f);
                    }
                    break;
                }
            }
            Err(e) => {
                soak.admin_failed("Status", &e);
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let traffic = last.as_ref().map(soak::Traffic::of).unwrap_or_default();
    let daemon_exit = if soak.daemon_down {
        "it died during the run".to_owned()
    } else {
        let stopped = daemon.stop();
        if stopped.success() {
            "clean".to_owned()
        } else {
            let log_tail: Vec<&str> = stopped.log.lines().rev().take(5).collect();
            format!(
                "{} with sockets {:?} left; log ends: {}",
                stopped.status,
                stopped.leftover_sockets,
                log_tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            )
        }
    };

    let memory_start = memory_start.flatten();
    let problems = lock(&shared.problems).clone();
    let mut violations = soak.violations.clone();
    for (kind, n) in problems.by_kind {
        *violations.by_kind.entry(kind).or_default() += n;
    }
    violations.first.extend(problems.first);
    // Client problems count in the client tally, not as invariant violations.
    violations.by_kind.retain(|kind, _| !kind.starts_with("client_"));
    let mut report = Report {
        seed,
        clients: cli.clients,
        minutes: cli.minutes,
        chaos_seconds,
        total_seconds: started.elapsed().as_secs_f64(),
        daemon_args: daemon_args.iter().map(|s| (*s).to_owned()).collect(),
        actions: soak.actions.clone(),
        checks: soak.checks,
        torn_checks: soak.torn_checks,
        violations,
        client_processes: lock(&shared.tally).clone(),
        traffic,
        rss_growth_pct: memory_start.zip(memory_end).map(|(a, b)| soak::growth_pct(a.rss_kib, b.rss_kib)),
        pss_growth_pct: memory_start
            .and_then(|a| a.pss_kib)
            .zip(memory_end.and_then(|b| b.pss_kib))
            .map(|(a, b)| soak::growth_pct(a, b)),
        memory_start,
        memory_end,
        rss_trend_pct: soak::trend_pct(&soak.memory_series.iter().map(|(_, m)| m.rss_kib).collect::<Vec<_>>()),
        memory_series: soak.memory_series.clone(),
        memory_judged: warmup >= soak::FULL_WARMUP,
        drained_empty,
        daemon_exit,
        passed: false,
        failures: Vec::new(),
    };
    report.decide();
    Ok(report)
}
