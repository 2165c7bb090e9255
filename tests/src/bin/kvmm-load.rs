//! `kvmm-load`: a bounded load generator for kvmmd over its real session socket.
//!
//! ```text
//! kvmm-load --start-daemon --processes 32 --seconds 60            # its own kvmmd, default config
//! kvmm-load --socket /run/kvmm/kvmm.sock --processes 8 --seconds 10 --json
//! ```
//!
//! The parent starts `--processes` worker processes of this same binary (`kvmm-load worker ...`,
//! not meant to be run by hand). Each worker loops until a shared deadline: connect, attach a small
//! session (SmolLM2-like by default: 3 KV heads × 64 dims, 9 query heads, 4 layers), append
//! `--tokens` tokens to every layer in `--chunk`-token appends with attention over every layer
//! after each chunk, `SessionStats` every `--stats-every` cycles, and detach. Every call is timed
//! into a per-operation histogram and every failure counted by gRPC code (see `kvmm_tests::load`);
//! at the deadline the worker finishes the call under way, detaches, and prints its report as one
//! JSON line.
//!
//! The time is capped: a worker checks the deadline between calls, and the parent kills any worker
//! still alive `--kill-after` seconds (10 by default) past the deadline and reports it as failed.
//! The parent merges the reports, prints a table (or, with `--json`, the merged summary) and exits 0
//! only if every worker reported and no call failed with a code other than `RESOURCE_EXHAUSTED`
//! (which a full budget returns by design); 1 if the run failed; 2 if it could not be run.
//!
//! The client library has no public `Extend`: `append` sends one when it needs a page the session
//! does not hold. Appends that will cross into an unallocated page are timed as `extend` (the RPC,
//! pre-faulting the batch's frames and writing the rows), the others as `append`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use kvmm_client::{AttachOptions, Client, ElementType, Geometry, Session};
use kvmm_tests::load::{Merged, Operation, Recorder, Summary};

/// How long a worker waits after a failed cycle before the next, so that a daemon refusing
/// everything (a full budget, a lost socket) is measured rather than hammered in a tight loop.
const BACKOFF_AFTER_FAILURE: Duration = Duration::from_millis(10);

/// How often the parent looks for finished workers.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// How long a kvmmd started by `--start-daemon` has to serve, and to exit after SIGTERM.
const DAEMON_START_TIMEOUT: Duration = Duration::from_secs(20);
const DAEMON_STOP_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Parser, Debug)]
#[command(
    name = "kvmm-load",
    about = "N client processes × attach/extend/attention/detach loops against kvmmd, for a bounded time",
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// One worker process (started by the parent).
    #[command(hide = true)]
    Worker(WorkerArgs),
}

#[derive(Args, Debug)]
struct RunArgs {
    /// kvmmd's session socket (the fd socket must be beside it).
    #[arg(long, required_unless_present = "start_daemon", conflicts_with = "start_daemon")]
    socket: Option<PathBuf>,
    /// Start a kvmmd with its default configuration in a temporary runtime directory, and stop it
    /// at the end (its clean exit is part of the verdict).
    #[arg(long)]
    start_daemon: bool,
    /// The kvmmd binary for --start-daemon; default `$KVMMD_BIN`, else `kvmmd` beside this binary.
    #[arg(long, requires = "start_daemon")]
    kvmmd: Option<PathBuf>,
    /// An extra argument for the kvmmd of --start-daemon (repeat it: --daemon-arg=--device-budget
    /// --daemon-arg=64MiB).
    #[arg(long = "daemon-arg", requires = "start_daemon", allow_hyphen_values = true)]
    daemon_args: Vec<String>,
    /// Worker processes.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    processes: u32,
    /// Seconds every worker loops.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Seconds past the deadline after which a worker still running is killed and reported.
    #[arg(long, default_value_t = 10)]
    kill_after: u64,
    /// Print the merged summary as JSON instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    workload: Workload,
}

#[derive(Args, Debug)]
struct WorkerArgs {
    /// kvmmd's session socket.
    #[arg(long)]
    socket: PathBuf,
    /// This worker's index, for its messages and its data.
    #[arg(long)]
    index: u32,
    /// The deadline, in milliseconds since the Unix epoch (shared by every worker).
    #[arg(long)]
    until_unix_ms: u64,
    #[command(flatten)]
    workload: Workload,
}

/// What each cycle of a worker does; the parent passes it on to every worker.
#[derive(Args, Debug, Clone)]
struct Workload {
    /// Layers of each session.
    #[arg(long, default_value_t = 4)]
    layers: u32,
    /// KV heads.
    #[arg(long, default_value_t = 3)]
    kv_heads: u32,
    /// Query heads (a multiple of --kv-heads).
    #[arg(long, default_value_t = 9)]
    q_heads: u32,
    /// Elements per head.
    #[arg(long, default_value_t = 64)]
    head_dim: u32,
    /// Tokens per page.
    #[arg(long, default_value_t = 32)]
    block_tokens: u32,
    /// Tokens appended to every layer per cycle (also the session's max_tokens).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    tokens: u32,
    /// Tokens per append; attention over every layer follows each chunk.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    chunk: u32,
    /// Call SessionStats once every this many cycles (0: never).
    #[arg(long, default_value_t = 4)]
    stats_every: u64,
}

impl Workload {
    /// The geometry every session attaches with.
    fn geometry(&self) -> Geometry {
        Geometry {
            layers: self.layers,
            kv_heads: self.kv_heads,
            q_heads: self.q_heads,
            head_dim: self.head_dim,
            block_tokens: self.block_tokens,
            element_type: ElementType::F16,
            max_tokens: self.tokens,
        }
    }

    /// The arguments that give a worker this workload.
    fn to_args(&self) -> Vec<String> {
        [
            ("--layers", u64::from(self.layers)),
            ("--kv-heads", u64::from(self.kv_heads)),
            ("--q-heads", u64::from(self.q_heads)),
            ("--head-dim", u64::from(self.head_dim)),
            ("--block-tokens", u64::from(self.block_tokens)),
            ("--tokens", u64::from(self.tokens)),
            ("--chunk", u64::from(self.chunk)),
            ("--stats-every", self.stats_every),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value.to_string()])
        .collect()
    }

    /// One line for the top of the table.
    fn describe(&self) -> String {
        format!(
            "workload per cycle: {} layers × {} KV heads × {} dims ({} query heads, {} tokens per page, f16), \
             {} tokens per layer in appends of {}, attention over every layer after each, stats every {} cycles",
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.q_heads,
            self.block_tokens,
            self.tokens,
            self.chunk,
            self.stats_every
        )
    }
}

/// Whether appending `n` tokens to a layer holding `tokens` needs a page beyond the
/// `allocated_blocks` the session holds per layer, i.e. whether the append sends `Extend`.
fn needs_extend(tokens: u32, n: u32, allocated_blocks: u32, block_tokens: u32) -> bool {
    u64::from(tokens) + u64::from(n) > u64::from(allocated_blocks) * u64::from(block_tokens)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.role {
        Some(Role::Worker(args)) => worker(&args).map(|()| true),
        None => run(&cli.run),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("kvmm-load: {e:#}");
            ExitCode::from(2)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The worker

/// Deterministic K/V/q values in [-1, 1) per seed (xorshift64*); their content does not matter to
/// latency, only that they are finite and differ between workers.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let x = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// What a worker times with: its recorder and its index, for messages.
struct Timer {
    recorder: Recorder,
    index: u32,
}

impl Timer {
    /// Runs `call` as `op`: records its latency if it succeeds, counts its code if not (printing
    /// the first failure of each operation and code on stderr). `None` on failure.
    fn time<T>(&mut self, op: Operation, call: impl FnOnce() -> kvmm_client::Result<T>) -> Option<T> {
        let start = Instant::now();
        match call() {
            Ok(value) => {
                self.recorder.record(op, start.elapsed());
                Some(value)
            }
            Err(e) => {
                let code = e.code();
                if self.recorder.fail(op, code) {
                    eprintln!(
                        "kvmm-load worker {}: {} failed with {} (first of its kind): {e}",
                        self.index,
                        op.name(),
                        kvmm_tests::load::code_name(code)
                    );
                }
                None
            }
        }
    }
}

/// One worker's fixed setup and its measurements.
struct Worker<'a> {
    /// kvmmd's session socket.
    socket: &'a Path,
    /// What each cycle does.
    load: &'a Workload,
    /// The geometry of every session, from `load`.
    geometry: Geometry,
    /// The options of every attach.
    options: AttachOptions,
    /// When to stop: no call starts after it but the detach of the session in hand.
    deadline: Instant,
    /// Times the calls and counts the failures.
    timer: Timer,
    /// `--chunk` tokens' K and V rows, every append writes these.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// The query every attention reads with, and its output.
    query: Vec<f32>,
    out: Vec<f32>,
}

fn worker(args: &WorkerArgs) -> anyhow::Result<()> {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).context("the clock is before 1970")?.as_millis();
    let left = Duration::from_millis(u64::try_from(u128::from(args.until_unix_ms).saturating_sub(now_ms))?);
    let load = &args.workload;
    let geometry = load.geometry();
    geometry.validate().context("invalid geometry")?;
    let row = (load.kv_heads * load.head_dim) as usize;
    let query_len = (load.q_heads * load.head_dim) as usize;
    let seed = u64::from(args.index) + 1;
    let mut worker = Worker {
        socket: &args.socket,
        load,
        geometry,
        options: AttachOptions { model_id: "kvmm-load".to_owned(), ..AttachOptions::default() },
        deadline: Instant::now() + left,
        timer: Timer { recorder: Recorder::new()?, index: args.index },
        keys: values(seed, load.chunk as usize * row),
        values: values(seed << 32, load.chunk as usize * row),
        query: values(seed << 16, query_len),
        out: vec![0.0; query_len],
    };
    let mut cycles = 0u64;
    while Instant::now() < worker.deadline {
        let stats = load.stats_every > 0 && cycles.is_multiple_of(load.stats_every);
        cycles += 1;
        if worker.cycle(stats).is_none() {
            std::thread::sleep(BACKOFF_AFTER_FAILURE);
        }
    }
    println!("{}", serde_json::to_string(&worker.timer.recorder.report())?);
    Ok(())
}

impl Worker<'_> {
    /// One connect → attach → append/attention → (stats) → detach cycle. `None` if a call failed
    /// (it is counted already). Past the deadline it stops appending and detaches.
    fn cycle(&mut self, stats: bool) -> Option<()> {
        self.timer.recorder.begin_cycle();
        let socket = self.socket;
        let client = self.timer.time(Operation::Connect, || Client::connect(socket))?;
        let (geometry, options) = (self.geometry, self.options.clone());
        let mut session = self.timer.time(Operation::Attach, || client.attach_with(geometry, options))?;
        let mut outcome = self.fill_and_read(&mut session);
        if stats && outcome.is_some() && self.timer.time(Operation::Stats, || session.stats()).is_none() {
            outcome = None;
        }
        // Detach even after a failed call: dropping the session would too, but untimed.
        self.timer.time(Operation::Detach, || session.detach())?;
        outcome
    }

    /// Appends the cycle's tokens to every layer chunk by chunk, with attention over every layer
    /// after each chunk, until the tokens are in or the deadline passes.
    fn fill_and_read(&mut self, session: &mut Session) -> Option<()> {
        let load = self.load;
        let row = (load.kv_heads * load.head_dim) as usize;
        let mut appended = 0;
        while appended < load.tokens && Instant::now() < self.deadline {
            let n = load.chunk.min(load.tokens - appended);
            let (keys, values) = (&self.keys[..n as usize * row], &self.values[..n as usize * row]);
            for layer in 0..load.layers {
                let extends = needs_extend(session.tokens(layer), n, session.allocated_blocks(), load.block_tokens);
                let op = if extends { Operation::Extend } else { Operation::Append };
                self.timer.time(op, || session.append(layer, keys, values))?;
            }
            for layer in 0..load.layers {
                let (query, out) = (&self.query, &mut self.out);
                self.timer.time(Operation::Attention, || session.attention(layer, query, out))?;
            }
            appended += n;
        }
        Some(())
    }
}

// ---------------------------------------------------------------------------------------------
// The parent

/// A worker process, as the parent sees it.
struct Running {
    /// Its index, given on its command line.
    index: u32,
    /// The process.
    child: Child,
    /// The thread reading its stdout to the end; taken when the report is read.
    stdout: Option<JoinHandle<std::io::Result<String>>>,
    /// How it ended; `None` while it runs.
    status: Option<ExitStatus>,
    /// Killed at the hard cap.
    killed: bool,
}

fn run(args: &RunArgs) -> anyhow::Result<bool> {
    let load = &args.workload;
    load.geometry().validate().context("invalid geometry")?;
    let daemon = if args.start_daemon {
        let kvmmd = match &args.kvmmd {
            Some(path) => path.clone(),
            None => kvmmd_beside_this_binary()?,
        };
        Some(StartedDaemon::start(&kvmmd, &args.daemon_args)?)
    } else {
        None
    };
    let socket = match (&daemon, &args.socket) {
        (Some(d), _) => d.socket(),
        (None, Some(socket)) => socket.clone(),
        (None, None) => bail!("give --socket or --start-daemon"),
    };
    let summary = drive(args, &socket)?;
    let stopped = match daemon {
        Some(d) => d.stop(),
        None => Ok(()),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!("{}", load.describe());
        println!("{summary}");
    }
    stopped?;
    Ok(summary.passed)
}

/// Starts the workers, enforces the hard cap, and merges what they report.
fn drive(args: &RunArgs, socket: &Path) -> anyhow::Result<Summary> {
    let exe = std::env::current_exe().context("cannot find this binary to start the workers")?;
    let span = Duration::from_secs(args.seconds);
    let until = SystemTime::now().duration_since(UNIX_EPOCH).context("the clock is before 1970")? + span;
    let deadline = Instant::now() + span;
    let hard_cap = deadline + Duration::from_secs(args.kill_after);
    let mut merged = Merged::new()?;
    let mut workers = Vec::new();
    for index in 0..args.processes {
        let spawned = Command::new(&exe)
            .arg("worker")
            .arg("--socket")
            .arg(socket)
            .args(["--index".to_owned(), index.to_string()])
            .args(["--until-unix-ms".to_owned(), until.as_millis().to_string()])
            .args(args.workload.to_args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn();
        match spawned {
            Ok(mut child) => {
                // Read stdout on a thread: a report larger than the pipe would otherwise block the
                // worker's exit while the parent waits for it.
                let stdout = child.stdout.take().map(|mut pipe| {
                    std::thread::spawn(move || {
                        let mut text = String::new();
                        pipe.read_to_string(&mut text).map(|_| text)
                    })
                });
                workers.push(Running { index, child, stdout, status: None, killed: false });
            }
            Err(e) => merged.worker_failed(index, format!("could not be started: {e}")),
        }
    }
    loop {
        for w in workers.iter_mut().filter(|w| w.status.is_none()) {
            w.status = w.child.try_wait().with_context(|| format!("cannot wait for worker {}", w.index))?;
        }
        if workers.iter().all(|w| w.status.is_some()) {
            break;
        }
        if Instant::now() >= hard_cap {
            for w in workers.iter_mut().filter(|w| w.status.is_none()) {
                // A worker that exits between the check and the kill is reaped by the wait below.
                let _ = w.child.kill();
                w.status = Some(w.child.wait().with_context(|| format!("cannot wait for worker {}", w.index))?);
                w.killed = true;
            }
            break;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
    for w in &mut workers {
        let output = match w.stdout.take().map(JoinHandle::join) {
            Some(Ok(Ok(text))) => text,
            Some(Ok(Err(e))) => format!("(stdout unreadable: {e})"),
            Some(Err(_)) | None => String::new(),
        };
        let report = output.lines().rev().find(|l| l.trim_start().starts_with('{'));
        if w.killed {
            merged.worker_failed(
                w.index,
                format!("still running {} s after the deadline; killed, its measurements lost", args.kill_after),
            );
            continue;
        }
        match (w.status, report) {
            (Some(status), Some(line)) if status.success() => {
                if let Err(e) = merged.add_line(line) {
                    merged.worker_failed(w.index, e.to_string());
                }
            }
            (Some(status), _) if !status.success() => merged.worker_failed(w.index, format!("exited with {status}")),
            _ => merged.worker_failed(w.index, "exited without printing its report".to_owned()),
        }
    }
    Ok(merged.summary(args.processes, args.seconds))
}

/// `$KVMMD_BIN`, else the `kvmmd` built into the same target directory as this binary.
fn kvmmd_beside_this_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("KVMMD_BIN").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().context("cannot find this binary")?;
    let bin = exe.with_file_name("kvmmd");
    if !bin.exists() {
        bail!(
            "{} does not exist: build it (`cargo build --release -p kvmm-daemon`), or give --kvmmd or $KVMMD_BIN",
            bin.display()
        );
    }
    Ok(bin)
}

/// A kvmmd this process started in a temporary runtime directory; killed if dropped unstopped.
struct StartedDaemon {
    /// The daemon; `None` once stopped.
    child: Option<Child>,
    /// Its runtime directory (sockets, its log); removed when dropped.
    dir: tempfile::TempDir,
}

impl StartedDaemon {
    /// Starts `kvmmd --runtime-dir DIR extra...` and waits until its session socket serves.
    fn start(kvmmd: &Path, extra: &[String]) -> anyhow::Result<StartedDaemon> {
        let dir = tempfile::Builder::new().prefix("kvmm-load-").tempdir().context("cannot create a runtime dir")?;
        let log = std::fs::File::create(dir.path().join("kvmmd.log")).context("cannot create kvmmd.log")?;
        let child = Command::new(kvmmd)
            .arg("--runtime-dir")
            .arg(dir.path())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {}", kvmmd.display()))?;
        let mut daemon = StartedDaemon { child: Some(child), dir };
        let started = Instant::now();
        loop {
            if let Some(child) = daemon.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("kvmmd exited ({status}) before serving; its log:\n{}", daemon.log());
            }
            let sockets = ["kvmm.sock", "kvmm-fd.sock", "kvmm-admin.sock"];
            if sockets.iter().all(|s| daemon.dir.path().join(s).exists()) && Client::connect(daemon.socket()).is_ok() {
                return Ok(daemon);
            }
            if started.elapsed() > DAEMON_START_TIMEOUT {
                bail!("kvmmd did not serve within {DAEMON_START_TIMEOUT:?}; its log:\n{}", daemon.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The session socket.
    fn socket(&self) -> PathBuf {
        self.dir.path().join("kvmm.sock")
    }

    /// The daemon's log so far.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("kvmmd.log")).unwrap_or_default()
    }

    /// SIGTERM, and a clean exit within [`DAEMON_STOP_TIMEOUT`].
    fn stop(mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else { return Ok(()) };
        let pid = rustix::process::Pid::from_child(&child);
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).context("cannot signal kvmmd")?;
        let asked = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    bail!("kvmmd exited with {status} after SIGTERM; its log:\n{}", self.log());
                }
                return Ok(());
            }
            if asked.elapsed() > DAEMON_STOP_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                bail!("kvmmd did not exit within {DAEMON_STOP_TIMEOUT:?} of SIGTERM; killed. Its log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for StartedDaemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_append_that_reaches_past_the_held_pages_extends() {
        // 32-token pages, 4 held: 128 slots.
        assert!(needs_extend(0, 1, 0, 32));
        assert!(!needs_extend(0, 16, 4, 32));
        assert!(!needs_extend(112, 16, 4, 32));
        assert!(needs_extend(120, 16, 4, 32));
        assert!(needs_extend(128, 1, 4, 32));
    }

    #[test]
    fn a_worker_gets_the_parents_workload() {
        let parent = Cli::parse_from(["kvmm-load", "--socket", "/s", "--layers", "6", "--chunk", "8"]);
        let mut argv = vec!["kvmm-load".to_owned(), "worker".to_owned()];
        argv.extend(["--socket", "/s", "--index", "3", "--until-unix-ms", "5"].map(str::to_owned));
        argv.extend(parent.run.workload.to_args());
        let Some(Role::Worker(w)) = Cli::parse_from(argv).role else { panic!("not parsed as a worker") };
        assert_eq!((w.workload.layers, w.workload.chunk, w.workload.tokens), (6, 8, 256));
        assert_eq!(w.index, 3);
    }

    #[test]
    fn the_socket_and_start_daemon_exclude_each_other() {
        assert!(Cli::try_parse_from(["kvmm-load"]).is_err());
        assert!(Cli::try_parse_from(["kvmm-load", "--socket", "/s", "--start-daemon"]).is_err());
        assert!(Cli::try_parse_from(["kvmm-load", "--start-daemon"]).is_ok());
    }

    #[test]
    fn values_are_finite_and_in_range() {
        assert!(values(7, 1000).iter().all(|x| x.is_finite() && (-1.0..1.0).contains(x)));
    }
}
