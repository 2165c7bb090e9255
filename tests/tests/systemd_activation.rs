//! kvmmd under systemd's socket activation, with the notification protocol on a socket this test
//! owns: the real `systemd-socket-activate` binds the three sockets (the fd socket as
//! `SOCK_SEQPACKET` by an outer instance, whose fd the inner one passes through) and starts kvmmd
//! on the first connection; kvmmd takes them by name, says READY=1 with a status line, feeds the
//! watchdog, reloads its policy on SIGHUP between RELOADING=1 and READY=1, and on SIGTERM says
//! STOPPING=1 and exits 0 within 5 s while its attached client is told UNAVAILABLE.

#![allow(clippy::unwrap_used)]

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvmm_client::Client;
use kvmm_kernels::ElementType;
use kvmm_shm::Geometry;
use kvmm_tests::{kvmmd_bin, wait_timeout};

/// Datagrams received on the notify socket, in order.
struct NotifySocket {
    sock: UnixDatagram,
    seen: Vec<String>,
}

impl NotifySocket {
    fn bind(path: &Path) -> NotifySocket {
        let sock = UnixDatagram::bind(path).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        NotifySocket { sock, seen: Vec::new() }
    }

    /// Waits up to `timeout` for a message containing `needle`; returns it.
    fn expect(&mut self, needle: &str, timeout: Duration, log: &dyn Fn() -> String) -> String {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 4096];
        loop {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                self.seen.push(msg.clone());
                if msg.contains(needle) {
                    return msg;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} within {timeout:?}; received {:?}; kvmmd log:\n{}",
                self.seen,
                log()
            );
        }
    }

    /// Messages containing `needle` received within `window`.
    fn count(&mut self, needle: &str, window: Duration) -> usize {
        let deadline = Instant::now() + window;
        let mut buf = [0u8; 4096];
        let mut n_seen = 0;
        while Instant::now() < deadline {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                n_seen += usize::from(msg.contains(needle));
                self.seen.push(msg);
            }
        }
        n_seen
    }
}

/// Kills the process (and so the socket-activation chain that exec'd into kvmmd) if a test fails
/// before it exits.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn geometry() -> Geometry {
    Geometry {
        layers: 2,
        kv_heads: 2,
        q_heads: 4,
        head_dim: 64,
        block_tokens: 32,
        element_type: ElementType::F16,
        max_tokens: 1024,
    }
}

/// Whether `systemd-socket-activate` can run here; says why the scenario is skipped otherwise.
fn socket_activate_installed() -> bool {
    let installed = Command::new("systemd-socket-activate").arg("--version").output().is_ok();
    if !installed {
        println!("skipped: systemd-socket-activate is not installed");
    }
    installed
}

#[test]
fn socket_activated_kvmmd_notifies_reloads_and_stops_in_order() {
    if !socket_activate_installed() {
        return;
    }
    let dir = tempfile::Builder::new().prefix("kvmm-activation-").tempdir().unwrap();
    let d = dir.path();
    let config = d.join("kvmmd.toml");
    std::fs::write(&config, "[policy]\nmode = \"performance\"\n").unwrap();
    let mut notify = NotifySocket::bind(&d.join("notify"));
    let log_path = d.join("kvmmd.log");
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();

    // The outer instance binds the two stream sockets and, on the first connection, execs the
    // inner one, which binds the fd socket (SOCK_SEQPACKET) and passes the outer's fds through:
    // kvmmd gets fd 3 = session, 4 = admin, 5 = fd, named.
    let child = Command::new("systemd-socket-activate")
        .arg("-l")
        .arg(d.join("kvmm.sock"))
        .arg("-l")
        .arg(d.join("kvmm-admin.sock"))
        .arg("--fdname=session:admin")
        .arg("systemd-socket-activate")
        .arg("--seqpacket")
        .arg("-l")
        .arg(d.join("kvmm-fd.sock"))
        .arg("--fdname=session:admin:fd")
        // systemd-socket-activate gives its child only the environment named here.
        .arg(format!("--setenv=NOTIFY_SOCKET={}", d.join("notify").display()))
        .arg("--setenv=WATCHDOG_USEC=1000000")
        .arg(kvmmd_bin())
        .arg("--runtime-dir")
        .arg(d)
        .arg("--config")
        .arg(&config)
        .arg("--device-budget")
        .arg("64MiB")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d.join("kvmm-admin.sock").exists() {
        assert!(Instant::now() < deadline, "systemd-socket-activate did not bind; log:\n{}", log());
        std::thread::sleep(Duration::from_millis(10));
    }
    // The first connection starts kvmmd; the client attaches through the passed sockets.
    let client = Client::connect(d.join("kvmm.sock")).unwrap();
    let mut session = client.attach(geometry()).unwrap();
    let ready = notify.expect("READY=1", Duration::from_secs(20), &log);
    assert!(ready.contains("STATUS="), "READY=1 comes with a status line: {ready:?}");
    let kv = vec![0.25f32; 2 * 64];
    for _ in 0..40 {
        for layer in 0..2 {
            session.append(layer, &kv, &kv).unwrap();
        }
    }
    let mut out = vec![0f32; 4 * 64];
    session.attention(0, &vec![0.5f32; 4 * 64], &mut out).unwrap();
    assert!((out[0] - 0.25).abs() < 1e-3, "attention over equal rows returns the row: {}", out[0]);
    assert_eq!(session.stats().unwrap().tokens, 40);
    let text = log();
    assert!(text.contains("session, admin, fd passed by systemd"), "kvmmd took all three passed sockets:\n{text}");
    let inode = |name: &str| std::fs::metadata(d.join(name)).unwrap().ino();
    let inodes: Vec<u64> = ["kvmm.sock", "kvmm-fd.sock", "kvmm-admin.sock"].map(inode).to_vec();

    // The status line follows the sessions; the watchdog is fed about every half second.
    let status = notify.expect("STATUS=1 sessions", Duration::from_secs(10), &log);
    assert!(status.contains("mode performance"), "{status:?}");
    let pings = notify.count("WATCHDOG=1", Duration::from_millis(2600));
    assert!(pings >= 3, "at least 3 watchdog pings in 2.6 s at WATCHDOG_USEC=1 s, got {pings}: {:?}", notify.seen);

    // SIGHUP: RELOADING=1, then READY=1, and the new policy is in force.
    std::fs::write(&config, "[policy]\nmode = \"powersave\"\n").unwrap();
    let pid = rustix::process::Pid::from_raw(child.0.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
    let reloading = notify.expect("RELOADING=1", Duration::from_secs(10), &log);
    assert!(reloading.contains("MONOTONIC_USEC="), "{reloading:?}");
    let ready = notify.expect("READY=1", Duration::from_secs(10), &log);
    assert!(ready.contains("mode powersave"), "READY=1 after the reload shows the new mode: {ready:?}");
    let admin = kvmm_tests::admin_status(&d.join("kvmm-admin.sock"));
    assert_eq!(admin.policy.unwrap().mode, "powersave");

    // SIGTERM: STOPPING=1, exit 0 within 5 s, and the attached client is told UNAVAILABLE.
    let stop = Instant::now();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    notify.expect("STOPPING=1", Duration::from_secs(5), &log);
    let status = wait_timeout(&mut child.0, Duration::from_secs(5))
        .unwrap_or_else(|| panic!("kvmmd did not exit within 5 s of SIGTERM; log:\n{}", log()));
    let took = stop.elapsed();
    assert!(status.success(), "kvmmd exits 0 after SIGTERM, got {status}; log:\n{}", log());
    println!("stopped in {took:?}");
    let err = session.stats().expect_err("the daemon is gone");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(took < Duration::from_secs(2), "an idle client does not hold the stop up: {took:?}");
    assert!(log().contains("all sessions wiped"), "{}", log());
    // The socket files belong to the socket units: kvmmd leaves them for the next activation.
    for (name, ino) in ["kvmm.sock", "kvmm-fd.sock", "kvmm-admin.sock"].into_iter().zip(inodes) {
        assert!(d.join(name).exists(), "kvmmd removed {name}, which systemd owns");
        assert_eq!(inode(name), ino, "{name} is still systemd's socket file");
    }
}

#[test]
fn a_passed_socket_kvmmd_cannot_place_is_refused_with_a_sentence() {
    if !socket_activate_installed() {
        return;
    }
    let dir = tempfile::Builder::new().prefix("kvmm-activation-").tempdir().unwrap();
    let d = dir.path();
    let log_path = d.join("kvmmd.log");
    // A stream socket named "fd" where kvmmd wants SOCK_SEQPACKET.
    let child = Command::new("systemd-socket-activate")
        .arg("-l")
        .arg(d.join("kvmm-fd.sock"))
        .arg("--fdname=fd")
        .arg(kvmmd_bin())
        .arg("--runtime-dir")
        .arg(d)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(d.join("kvmm-fd.sock")).is_err() {
        assert!(Instant::now() < deadline, "systemd-socket-activate did not bind");
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = wait_timeout(&mut child.0, Duration::from_secs(10)).expect("kvmmd refuses and exits");
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("must be a listening SOCK_SEQPACKET socket") && log.contains("ListenSequentialPacket="),
        "{log}"
    );
}

#[test]
fn the_watchdog_is_fed_only_while_the_tier_mover_flash_drain_and_policy_loop_run() {
    // kvmmd started directly (binding its own sockets) with a notify socket; one watched loop stops
    // for good 1.5 s after start, as a deadlocked one would (hidden --debug-hang).
    for which in ["tiers", "flash", "policy"] {
        let dir = tempfile::Builder::new().prefix("kvmm-watchdog-").tempdir().unwrap();
        let d = dir.path();
        let mut notify = NotifySocket::bind(&d.join("notify"));
        let log_path = d.join("kvmmd.log");
        let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        let child = Command::new(kvmmd_bin())
            .arg("--runtime-dir")
            .arg(d)
            .args(["--device-budget", "16MiB", "--dram-budget", "16MiB", "--flash-budget", "16MiB", "--flash-dir"])
            .arg(d)
            .args(["--debug-hang", &format!("{which}:1500")])
            .env("NOTIFY_SOCKET", d.join("notify"))
            .env("WATCHDOG_USEC", "1000000")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .unwrap();
        let child = KillOnDrop(child);
        notify.expect("READY=1", Duration::from_secs(20), &log);
        assert!(notify.count("WATCHDOG=1", Duration::from_millis(1200)) >= 1, "fed while both loops run");
        let unhealthy = notify.expect("STATUS=unhealthy", Duration::from_secs(10), &log);
        let name = match which {
            "tiers" => "tier mover",
            "flash" => "flash drain",
            _ => "policy loop",
        };
        assert!(unhealthy.contains(name), "the status names the stalled loop: {unhealthy:?}");
        assert_eq!(notify.count("WATCHDOG=1", Duration::from_millis(2000)), 0, "no ping once a loop stalls");
        assert!(log().contains("no longer feeding the watchdog"), "{}", log());
        drop(child);
    }
}
