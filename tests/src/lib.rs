//! Harness for multi-process scenarios: starts the real `kvmmd` binary in a private runtime
//! directory, spawns real client processes (`kvmm-test-client`), and reads the daemon's admin status.
//!
//! Every scenario runs its own daemon in its own temporary directory, so scenarios can run in
//! parallel and never touch `/run/kvmm`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod load;
pub mod models;
pub mod rows;
pub mod soak;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvmm_proto::v1::admin_client::AdminClient;
use kvmm_proto::v1::{StatusRequest, StatusResponse};

/// Path of a binary of this workspace: `$<NAME>_BIN` (upper case, `-` as `_`), else the binary in the
/// target directory this test was built into (`cargo test --workspace` builds every binary).
pub fn workspace_bin(name: &str) -> PathBuf {
    let var = format!("{}_BIN", name.to_uppercase().replace('-', "_"));
    if let Some(p) = std::env::var_os(&var) {
        return PathBuf::from(p);
    }
    let bin = profile_dir().join(name);
    assert!(
        bin.exists(),
        "{} does not exist: run the tests with `cargo test --workspace` (which builds it) or set {var}",
        bin.display()
    );
    bin
}

/// The target directory this test was built into, `target/<profile>/`: integration tests live in
/// its `deps/`, the workspace's binaries in it.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_owned()
}

/// The C API's `libkvmm.so` that cargo built for this package: kvmm-capi is a dependency of
/// kvmm-tests, so its cdylib lands in `deps/` beside the integration tests.
pub fn libkvmm() -> PathBuf {
    capi_library("libkvmm.so")
}

/// The C API's static library, `libkvmm.a`, built beside [`libkvmm`].
pub fn libkvmm_static() -> PathBuf {
    capi_library("libkvmm.a")
}

fn capi_library(file: &str) -> PathBuf {
    let library = profile_dir().join("deps").join(file);
    assert!(
        library.exists(),
        "{} does not exist: run the tests with `cargo test --workspace`, which builds it",
        library.display()
    );
    library
}

/// Path of the kvmmd binary.
pub fn kvmmd_bin() -> PathBuf {
    workspace_bin("kvmmd")
}

/// The launcher that runs a program under kvmmd.service's sandbox without systemd
/// (`tests/sandbox/kvmmd-sandbox`: namespaces, read-only mounts, no capabilities, seccomp). It
/// execs all the way down, so the program keeps the pid of the spawned child.
pub fn sandbox_launcher() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("sandbox").join("kvmmd-sandbox")
}

/// The exit code of [`sandbox_launcher`] when the sandbox cannot be set up here (not root, a tool
/// missing); it prints the reason on stderr.
pub const SANDBOX_UNAVAILABLE: i32 = 77;

/// Whether `KVMM_SANDBOX` (set and not empty) asks for every kvmmd the harness starts to run under
/// the unit's sandbox.
pub fn sandboxed() -> bool {
    std::env::var_os("KVMM_SANDBOX").is_some_and(|v| !v.is_empty())
}

/// A command that runs kvmmd: through [`sandbox_launcher`] when [`sandboxed`], else directly.
/// Arguments added to it go to kvmmd.
pub fn kvmmd_command() -> Command {
    if sandboxed() { sandboxed_command(&kvmmd_bin()) } else { Command::new(kvmmd_bin()) }
}

/// A command that runs `program` under the unit's sandbox, whatever `KVMM_SANDBOX` says.
pub fn sandboxed_command(program: &Path) -> Command {
    let mut cmd = Command::new(sandbox_launcher());
    cmd.arg(program);
    cmd
}

/// Whether [`sandbox_launcher`] can set up the sandbox here (it needs root, util-linux, python3,
/// libseccomp and systemd-analyze); if not, prints why the scenario is skipped. A launcher that
/// fails for any other reason fails the test.
pub fn can_sandbox() -> bool {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: the unit's sandbox needs root to create namespaces and mounts");
        return false;
    }
    let out = sandboxed_command(Path::new("/bin/true")).output().expect("run the sandbox launcher");
    match out.status.code() {
        Some(0) => true,
        Some(SANDBOX_UNAVAILABLE) => {
            println!("skipped: {}", String::from_utf8_lossy(&out.stderr).trim());
            false
        }
        _ => panic!("the sandbox launcher failed: {out:?}"),
    }
}

/// A command that runs kvmmd as uid and gid [`NOBODY`] with no supplementary groups (check
/// [`can_run_as_nobody`] first): the sandbox's own `setpriv` switches the uid when [`sandboxed`].
pub fn kvmmd_command_as_nobody() -> Command {
    if sandboxed() {
        let mut cmd = sandboxed_command(&kvmmd_bin());
        cmd.env("KVMM_SANDBOX_USER", NOBODY);
        cmd
    } else {
        as_nobody(&kvmmd_bin(), None)
    }
}

/// Spawns `kvmmd` with `--runtime-dir dir` and `args`, its stderr into `log`.
fn spawn_kvmmd(kvmmd: &mut Command, dir: &Path, log: &Path, args: &[&str]) -> Child {
    kvmmd
        .arg("--runtime-dir")
        .arg(dir)
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("spawn kvmmd")
}

/// Llama-3-8B's KV shape (8 KV heads of 128 channels, 32 query heads, 32-token f16 pages of
/// 135,232 bytes) with `layers` layers of up to `max_tokens` tokens.
pub fn llama3_8b(layers: u32, max_tokens: u32) -> kvmm_client::Geometry {
    kvmm_client::Geometry {
        layers,
        kv_heads: 8,
        q_heads: 32,
        head_dim: 128,
        block_tokens: 32,
        element_type: kvmm_client::ElementType::F16,
        max_tokens,
    }
}

/// Appends `g.max_tokens` tokens of fixed K/V in [-1, 1) to every layer of `session`.
pub fn fill_every_layer(session: &mut kvmm_client::Session, g: kvmm_client::Geometry) {
    let row = (g.kv_heads * g.head_dim) as usize;
    let tokens = g.max_tokens as usize;
    let k: Vec<f32> = (0..tokens * row).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let v: Vec<f32> = (0..tokens * row).map(|i| ((i * 104_729) % 1000) as f32 / 500.0 - 1.0).collect();
    for layer in 0..g.layers {
        session.append(layer, &k, &v).unwrap();
    }
}

/// A running kvmmd in a private runtime directory. Dropping it kills the daemon.
#[derive(Debug)]
pub struct Daemon {
    child: Option<Child>,
    dir: tempfile::TempDir,
    log: PathBuf,
}

impl Daemon {
    /// Starts kvmmd with `--runtime-dir` in a fresh directory plus `args`, and waits for its sockets;
    /// under the unit's sandbox when [`sandboxed`].
    pub fn start(args: &[&str]) -> Daemon {
        Daemon::start_with(kvmmd_command(), None, args)
    }

    /// Starts `kvmmd` (a command that runs kvmmd, e.g. [`sandboxed_command`]) with `--runtime-dir`
    /// in a fresh directory, owned by `owner` (the uid kvmmd runs as, as systemd's
    /// `RuntimeDirectory=` does for `User=`) or by this process, plus `args`, and waits for its
    /// sockets.
    pub fn start_with(mut kvmmd: Command, owner: Option<u32>, args: &[&str]) -> Daemon {
        let dir = tempfile::Builder::new().prefix("kvmm-test-").tempdir().unwrap();
        // Other uids (the isolation scenario) must reach the sockets inside.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        if let Some(uid) = owner {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(uid)).unwrap();
        }
        let log = dir.path().join("kvmmd.log");
        let child = spawn_kvmmd(&mut kvmmd, dir.path(), &log, args);
        let mut d = Daemon { child: Some(child), dir, log };
        d.wait_for_sockets();
        d
    }

    /// Waits for the daemon to exit by itself (at most `timeout`) and returns how it ended.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        wait_timeout(self.child.as_mut().unwrap(), timeout)
            .unwrap_or_else(|| panic!("kvmmd did not exit within {timeout:?}; log:\n{}", self.log()))
    }

    /// Starts `kvmmd` again in the same runtime directory (after it exited), with `args`, as a
    /// service manager restarts it; its log starts afresh.
    pub fn restart(&mut self, mut kvmmd: Command, args: &[&str]) {
        if self.child.as_mut().unwrap().try_wait().unwrap().is_some() {
            let child = spawn_kvmmd(&mut kvmmd, self.dir.path(), &self.log, args);
            self.child = Some(child);
            self.wait_for_sockets();
        } else {
            panic!("restart: kvmmd is still running");
        }
    }

    /// Starts kvmmd with every tier: a device budget of `device`, 16 MiB of DRAM and a 16 MiB flash
    /// file in `flash_dir`, plus `extra`.
    pub fn start_tiered(device: &str, flash_dir: &Path, extra: &[&str]) -> Daemon {
        let flash = flash_dir.to_str().expect("a UTF-8 flash directory");
        let mut args =
            vec!["--device-budget", device, "--dram-budget", "16MiB", "--flash-budget", "16MiB", "--flash-dir", flash];
        args.extend_from_slice(extra);
        Daemon::start(&args)
    }

    /// Waits until kvmmd serves on its sockets and says it is ready.
    fn wait_for_sockets(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let names = ["kvmm.sock", "kvmm-fd.sock", "kvmm-admin.sock"];
        while !names.iter().all(|n| self.dir.path().join(n).exists()) {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("kvmmd exited ({status}) before binding its sockets; log:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "kvmmd did not bind its sockets in 20 s; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        // Admin status answers once the servers run.
        while std::panic::catch_unwind(|| self.status()).is_err() {
            assert!(Instant::now() < deadline, "kvmmd did not answer status in 20 s; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        // Ready as systemd sees it (READY=1 goes with this line): the watched loops have gone round
        // once. Signals are only handled from about then on (see daemon_lifecycle's
        // a_signal_right_after_the_sockets_appear_is_handled_not_fatal).
        while !self.log().contains("kvmmd ready") {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("kvmmd exited ({status}) before it was ready; log:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "kvmmd was not ready in 20 s; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The runtime directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The session socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("kvmm.sock")
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Runs `call` against a fresh admin connection.
    pub fn admin<T>(&self, call: impl AsyncFnOnce(AdminClient<tonic::transport::Channel>) -> T) -> T {
        admin_at(&self.dir.path().join("kvmm-admin.sock"), call)
    }

    /// `kvmmctl --socket <this daemon's admin socket> args...`: its standard output (it must
    /// succeed).
    pub fn kvmmctl(&self, args: &[&str]) -> String {
        let out = Command::new(workspace_bin("kvmmctl"))
            .arg("--socket")
            .arg(self.dir.path().join("kvmm-admin.sock"))
            .args(args)
            .env_remove("KVMM_ADMIN_SOCKET")
            .output()
            .unwrap();
        assert!(out.status.success(), "kvmmctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// Admin `Status`.
    pub fn status(&self) -> StatusResponse {
        self.admin(async |mut admin| admin.status(StatusRequest {}).await.unwrap().into_inner())
    }

    /// Admin `Demote` of every full page of a session to `tier`.
    pub fn demote(&self, session_id: u64, tier: kvmm_proto::v1::Tier) -> kvmm_proto::v1::DemoteResponse {
        let request = kvmm_proto::v1::DemoteRequest { session_id, tier: tier as i32, ..Default::default() };
        self.admin(async |mut admin| admin.demote(request).await.unwrap().into_inner())
    }

    /// Admin `Compress` of every full page of a session.
    pub fn compress(&self, session_id: u64, format: kvmm_proto::v1::PageFormat) -> kvmm_proto::v1::CompressResponse {
        self.try_compress(session_id, format).unwrap()
    }

    /// Admin `Compress` of every full page of a session, returning the status on refusal.
    pub fn try_compress(
        &self,
        session_id: u64,
        format: kvmm_proto::v1::PageFormat,
    ) -> Result<kvmm_proto::v1::CompressResponse, tonic::Status> {
        let request = kvmm_proto::v1::CompressRequest { session_id, format: format as i32, ..Default::default() };
        self.admin(async |mut admin| admin.compress(request).await.map(tonic::Response::into_inner))
    }

    /// Admin `ReloadPolicy`, returning the status on refusal.
    pub fn reload_policy(&self) -> Result<kvmm_proto::v1::ReloadPolicyResponse, tonic::Status> {
        let request = kvmm_proto::v1::ReloadPolicyRequest {};
        self.admin(async |mut admin| admin.reload_policy(request).await.map(tonic::Response::into_inner))
    }

    /// Admin `Demote` of the full pages of `layers` of a session to `tier`.
    pub fn demote_layers(
        &self,
        session_id: u64,
        layers: std::ops::Range<u32>,
        tier: kvmm_proto::v1::Tier,
    ) -> kvmm_proto::v1::DemoteResponse {
        let request = kvmm_proto::v1::DemoteRequest {
            session_id,
            tier: tier as i32,
            first_layer: layers.start,
            layers: layers.end - layers.start,
            ..Default::default()
        };
        self.admin(async |mut admin| admin.demote(request).await.unwrap().into_inner())
    }

    /// Admin `WipeSession`, returning the status on refusal.
    pub fn wipe_session(&self, session_id: u64) -> Result<kvmm_proto::v1::WipeResponse, tonic::Status> {
        let request = kvmm_proto::v1::WipeRequest { session_id };
        self.admin(async |mut admin| admin.wipe_session(request).await.map(tonic::Response::into_inner))
    }

    /// Admin `WipeUser` and `WipeAll` (`uid` `None`).
    pub fn wipe_many(&self, uid: Option<u32>) -> kvmm_proto::v1::WipeResponse {
        self.admin(async |mut admin| match uid {
            Some(uid) => admin.wipe_user(kvmm_proto::v1::WipeUserRequest { uid }).await.unwrap().into_inner(),
            None => admin.wipe_all(kvmm_proto::v1::WipeAllRequest {}).await.unwrap().into_inner(),
        })
    }

    /// Every memfd the daemon holds open (arenas, session tables, client regions), as (link name,
    /// path under `/proc/PID/fd`).
    fn memfd_paths(&self) -> Vec<(String, PathBuf)> {
        let dir = format!("/proc/{}/fd", self.pid());
        std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| {
                let path = e.ok()?.path();
                let link = std::fs::read_link(&path).ok()?.to_string_lossy().into_owned();
                link.starts_with("/memfd:").then_some((link, path))
            })
            .collect()
    }

    /// Every memfd the daemon holds open, read through `/proc/PID/fd` (arenas, session tables,
    /// client regions), as (link name, bytes).
    pub fn memfds(&self) -> Vec<(String, Vec<u8>)> {
        self.memfd_paths().into_iter().filter_map(|(link, path)| std::fs::read(&path).ok().map(|b| (link, b))).collect()
    }

    /// Memory the daemon's memfds hold (allocated blocks, whoever touched the pages): what the
    /// arenas really cost the machine, unlike the daemon's Rss, which counts only the pages its own
    /// mapping has faulted in.
    pub fn memfd_allocated(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.memfd_paths().iter().filter_map(|(_, path)| std::fs::metadata(path).ok().map(|m| m.blocks() * 512)).sum()
    }

    /// Device-tier bytes in use.
    pub fn device_used(&self) -> u64 {
        self.status().tiers[0].used_bytes
    }

    /// Polls `status` until `pred` holds or `timeout` passes; returns the last status and the time taken.
    pub fn wait_status(&self, timeout: Duration, pred: impl Fn(&StatusResponse) -> bool) -> (StatusResponse, Duration) {
        let start = Instant::now();
        loop {
            let s = self.status();
            if pred(&s) || start.elapsed() > timeout {
                return (s, start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Polls `status` (at most 5 s) until no session is attached and no tier holds a byte or a
    /// page; returns the last status. A session leaves the registry before its frames are zeroed
    /// and freed, and a closed connection is cleaned up after the client has exited, so `sessions`
    /// reaches 0 before the tiers are empty.
    pub fn wait_drained(&self) -> StatusResponse {
        let empty = |s: &StatusResponse| s.sessions == 0 && s.tiers.iter().all(|t| t.used_bytes == 0 && t.pages == 0);
        self.wait_status(Duration::from_secs(5), empty).0
    }

    /// Sends a signal to the daemon.
    pub fn signal(&self, sig: rustix::process::Signal) {
        rustix::process::kill_process(rustix::process::Pid::from_raw(self.pid() as i32).unwrap(), sig).unwrap();
    }

    /// Sends SIGTERM, waits for the exit (at most 15 s), and reports what the daemon left behind
    /// before its directory is removed.
    pub fn stop(mut self) -> Stopped {
        self.signal(rustix::process::Signal::TERM);
        let status = wait_timeout(self.child.as_mut().unwrap(), Duration::from_secs(15))
            .expect("kvmmd did not exit within 15 s of SIGTERM");
        let leftover_sockets = ["kvmm.sock", "kvmm-fd.sock", "kvmm-admin.sock"]
            .into_iter()
            .filter(|n| self.dir.path().join(n).exists())
            .map(str::to_owned)
            .collect();
        Stopped { status, log: self.log(), leftover_sockets }
    }
}

/// Runs `call` against a fresh connection to the admin socket at `socket`.
pub fn admin_at<T>(socket: &Path, call: impl AsyncFnOnce(AdminClient<tonic::transport::Channel>) -> T) -> T {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let channel = kvmm_client::connect::channel(socket).await.unwrap();
        call(AdminClient::new(channel)).await
    })
}

/// Admin `Status` from the admin socket at `socket`.
pub fn admin_status(socket: &Path) -> StatusResponse {
    admin_at(socket, async |mut admin| admin.status(StatusRequest {}).await.unwrap().into_inner())
}

/// How a daemon ended.
#[derive(Debug)]
pub struct Stopped {
    /// Its exit status.
    pub status: ExitStatus,
    /// Its whole log.
    pub log: String,
    /// Socket files still present after it exited.
    pub leftover_sockets: Vec<String>,
}

impl Stopped {
    /// Exit 0 with every socket removed.
    pub fn success(&self) -> bool {
        self.status.success() && self.leftover_sockets.is_empty()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take()
            && c.try_wait().ok().flatten().is_none()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits for a child with a timeout.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A running `kvmm-test-client` process that speaks a line protocol on stdin/stdout.
#[derive(Debug)]
pub struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Every line read so far, for failure messages.
    pub transcript: Vec<String>,
}

impl Worker {
    /// Spawns the test client with `args`.
    pub fn spawn(bin: &Path, args: &[String]) -> Worker {
        Self::spawn_cmd(Command::new(bin).args(args))
    }

    /// Spawns a prepared command (e.g. with another uid).
    pub fn spawn_cmd(cmd: &mut Command) -> Worker {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn test client");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Worker { child, stdin, stdout, transcript: Vec::new() }
    }

    /// Reads lines until one starts with `prefix`; returns the rest of it. Panics on EOF.
    pub fn expect_line(&mut self, prefix: &str) -> String {
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "test client exited before printing '{prefix}'; transcript:\n{}", self.transcript.join(""));
            self.transcript.push(line.clone());
            if let Some(rest) = line.trim_end().strip_prefix(prefix) {
                return rest.trim().to_owned();
            }
        }
    }

    /// Sends one line on stdin.
    pub fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILLs the process.
    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits for exit (at most `timeout`) and returns the status.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        wait_timeout(&mut self.child, timeout).unwrap_or_else(|| {
            let _ = self.child.kill();
            panic!("test client did not exit within {timeout:?}; transcript:\n{}", self.transcript.join(""))
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The number after `label` in a report line (`"attention worst 4.7e-07"`, label `"worst"`).
pub fn number_after(line: &str, label: &str) -> f64 {
    let mut words = line.split_whitespace().skip_while(|w| *w != label);
    words.nth(1).and_then(|w| w.parse().ok()).unwrap_or_else(|| panic!("no number after {label:?} in {line:?}"))
}

/// Parses `key=value` pairs of a report line.
pub fn fields(line: &str) -> std::collections::HashMap<String, String> {
    line.split_whitespace().filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned()))).collect()
}

/// The test client binary built with this crate.
pub fn client_bin() -> PathBuf {
    workspace_bin("kvmm-test-client")
}

/// Arguments for a `kvmm-test-client` mode against a daemon.
pub fn client_args(mode: &str, daemon: &Daemon, extra: &[&str]) -> Vec<String> {
    let mut v = vec![mode.to_owned(), "--socket".to_owned(), daemon.socket().display().to_string()];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}

/// Spawns a `kvmm-test-client` in `mode` against `daemon`.
pub fn spawn_client(mode: &str, daemon: &Daemon, extra: &[&str]) -> Worker {
    Worker::spawn(&client_bin(), &client_args(mode, daemon, extra))
}

/// The uid (and gid) scenarios run other callers as: `nobody`.
pub const NOBODY: &str = "65534";

/// Whether this process can run others as [`NOBODY`] (root, with util-linux's `setpriv`); if not,
/// prints why the scenario is skipped.
pub fn can_run_as_nobody() -> bool {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: this scenario needs root to run a caller as another uid");
        return false;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        println!("skipped: setpriv (util-linux) is not installed");
        return false;
    }
    true
}

/// A command that runs `program` as uid and gid [`NOBODY`], with supplementary `groups` (comma
/// separated) or none.
pub fn as_nobody(program: &Path, groups: Option<&str>) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", NOBODY, "--regid", NOBODY]);
    match groups {
        Some(g) => cmd.args(["--groups", g]),
        None => cmd.arg("--clear-groups"),
    };
    cmd.arg("--").arg(program);
    cmd
}
