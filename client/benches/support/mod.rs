//! What the benches that run a real kvmmd share: finding the binary, starting it in a private
//! runtime directory, an admin client, SmolLM2's and Llama-3-8B's KV shapes, the best of timed
//! runs, and stopping it.

#![allow(dead_code, reason = "each bench uses a subset")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvmm_client::{Client, ElementType, Geometry, proto as pb};

/// Best (smallest) wall time of `runs` calls of `f`, after one warm-up call. The minimum rather than
/// the median: on a shared machine (other builds running) most of the spread is time spent waiting
/// for a core, which only ever adds.
pub fn best_seconds(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64 channels (9 query heads), 32-token f16
/// pages.
pub fn smollm2(max_tokens: u32) -> Geometry {
    Geometry::new(30, 3, 9, 64, max_tokens)
}

/// kvmmd from `$KVMMD_BIN`, else from the target directory beside the running bench.
pub fn kvmmd() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMMD_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    let bin = exe.parent().and_then(|d| d.parent()).expect("target/<profile>").join("kvmmd");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --release -p kvmm-daemon` first or set KVMMD_BIN",
        bin.display()
    );
    bin
}

/// Starts kvmmd with `--runtime-dir dir` and `args`, and waits for its sockets.
pub fn start(dir: &Path, args: &[&str]) -> Child {
    let daemon = Command::new(kvmmd())
        .arg("--runtime-dir")
        .arg(dir)
        .args(args)
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvmmd");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dir.join("kvmm-admin.sock").exists() {
        assert!(Instant::now() < deadline, "kvmmd did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    daemon
}

/// Stops kvmmd with SIGTERM and checks that it exited cleanly.
pub fn stop(mut daemon: Child) {
    let pid = rustix::process::Pid::from_raw(daemon.id() as i32).expect("a child's pid is positive");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("signal kvmmd");
    assert!(daemon.wait().expect("wait for kvmmd").success());
}

/// An admin client on the admin socket of the kvmmd running in `dir`.
pub fn admin(client: &Client, dir: &Path) -> pb::admin_client::AdminClient<tonic::transport::Channel> {
    client
        .block_on(kvmm_client::connect::channel(&dir.join("kvmm-admin.sock")))
        .map(pb::admin_client::AdminClient::new)
        .expect("connect to the admin socket")
}

/// Llama-3-8B's KV shape: 32 layers, 8 KV heads of 128 channels (32 query heads), 32-token f16
/// pages of 135,232 bytes.
pub fn llama3_8b(max_tokens: u32) -> Geometry {
    Geometry {
        layers: 32,
        kv_heads: 8,
        q_heads: 32,
        head_dim: 128,
        block_tokens: 32,
        element_type: ElementType::F16,
        max_tokens,
    }
}
