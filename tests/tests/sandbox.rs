//! kvmmd under the sandbox of `systemd/kvmmd.service`, applied without systemd by
//! `tests/sandbox/kvmmd-sandbox` (namespaces, read-only mounts, no capabilities, seccomp filters
//! derived from the installed systemd's `@system-service`):
//!
//! - the daemon really is confined: no new privileges, seccomp on, no capability in any set, its
//!   own mount, network, IPC and UTS namespaces, a read-only root, umask 077, no core files;
//! - it still does its whole job in there: a client attaches and runs attention, pages go down to
//!   flash through io_uring and come back bit-identical, and SIGTERM ends it cleanly;
//! - it does so as an unprivileged uid too (standing in for `User=kvmm`);
//! - the confinement bites: a probe run by the same launcher is refused what the unit refuses
//!   (other socket families, writes outside /tmp, W+X memory, namespaces, realtime, personality,
//!   another ABI).
//!
//! Every scenario is skipped, with the reason printed, where the sandbox cannot be set up (not
//! root, a tool missing); a launcher that fails otherwise fails the scenario.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use kvmm_proto::v1::Tier;
use kvmm_tests::{
    Daemon, NOBODY, Worker, as_nobody, can_run_as_nobody, can_sandbox, client_args, client_bin, fields, kvmmd_bin,
    sandboxed_command, spawn_client,
};

/// The filters `seccomp_exec.py` installs: MemoryDenyWriteExecute, RestrictAddressFamilies,
/// RestrictNamespaces, RestrictRealtime, RestrictSUIDSGID, LockPersonality, SystemCallFilter.
const SECCOMP_FILTERS: &str = "7";

/// `/proc/PID/status` as key → value.
fn proc_status(pid: u32) -> HashMap<String, String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(':').map(|(k, v)| (k.to_owned(), v.trim().to_owned())))
        .collect()
}

/// The namespace `kind` of process `pid` (`self` for this one), e.g. `mnt:[4026531841]`.
fn namespace(pid: &str, kind: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap().display().to_string()
}

/// Soft and hard value of one line of `/proc/PID/limits`.
fn limit(pid: u32, name: &str) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {limits}"));
    let mut values = line[name.len()..].split_whitespace();
    (values.next().unwrap().to_owned(), values.next().unwrap().to_owned())
}

/// This process's RLIMIT_MEMLOCK hard limit in bytes (`None`: unlimited).
fn memlock_hard() -> Option<u64> {
    let (_, hard) = limit(std::process::id(), "Max locked memory");
    hard.parse().ok()
}

/// The per-mount options of the mount at `mount_point` as kvmmd sees it.
fn mount_options(pid: u32, mount_point: &str) -> String {
    let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    // The last mount on a mount point is the one visible there.
    let line = info
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some(mount_point))
        .unwrap_or_else(|| panic!("no mount on {mount_point}:\n{info}"));
    line.split(' ').nth(5).unwrap().to_owned()
}

/// Checks what `/proc` says of a sandboxed kvmmd: confined as the unit says.
fn assert_confined(daemon: &Daemon, uid: &str) {
    let pid = daemon.pid();
    let status = proc_status(pid);
    println!(
        "kvmmd {pid}: NoNewPrivs {} Seccomp {} filters {} CapEff {} Uid {}",
        status["NoNewPrivs"], status["Seccomp"], status["Seccomp_filters"], status["CapEff"], status["Uid"]
    );
    assert_eq!(status["Name"], "kvmmd", "the launcher exec'd into kvmmd, keeping the pid");
    assert_eq!(status["NoNewPrivs"], "1", "NoNewPrivileges=yes");
    assert_eq!(status["Seccomp"], "2", "SystemCallFilter= and friends: seccomp filter mode");
    assert_eq!(status["Seccomp_filters"], SECCOMP_FILTERS);
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status[set], "0000000000000000", "{set}: CapabilityBoundingSet= and AmbientCapabilities= empty");
    }
    assert_eq!(status["Uid"], [uid; 4].join("\t"));
    assert_eq!(status["Umask"], "0077", "UMask=0077");

    // PrivateMounts=, PrivateNetwork=, PrivateIPC=, ProtectHostname=: namespaces of its own. Not the
    // pid namespace (the unit has no PrivatePIDs=) nor the user namespace (no PrivateUsers=).
    for kind in ["mnt", "net", "ipc", "uts"] {
        assert_ne!(namespace(&pid.to_string(), kind), namespace("self", kind), "kvmmd has its own {kind} namespace");
    }
    for kind in ["pid", "user"] {
        assert_eq!(namespace(&pid.to_string(), kind), namespace("self", kind), "{kind} namespace shared");
    }

    // ProtectSystem=strict with /tmp writable; PrivateDevices=: a /dev of its own, read-only.
    assert!(mount_options(pid, "/").split(',').any(|o| o == "ro"), "/ is read-only");
    assert!(mount_options(pid, "/tmp").split(',').any(|o| o == "rw"), "/tmp is writable");
    assert!(mount_options(pid, "/dev").split(',').any(|o| o == "ro"), "the private /dev is read-only");
    assert!(mount_options(pid, "/proc/sys").split(',').any(|o| o == "ro"), "ProtectKernelTunables=");

    // LimitCORE=0; LimitMEMLOCK=64M, or this machine's hard limit where that is lower.
    assert_eq!(limit(pid, "Max core file size"), ("0".to_owned(), "0".to_owned()));
    let memlock = memlock_hard().map_or(64 << 20, |hard| hard.min(64 << 20));
    assert_eq!(limit(pid, "Max locked memory").0, memlock.to_string());
}

/// Lines of the daemon's log that show a call the sandbox refused.
fn refusals(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("Operation not permitted") || l.contains("os error 1)")).collect()
}

#[test]
fn a_sandboxed_kvmmd_is_confined_as_the_unit_says_and_serves_attention_with_flash_on_io_uring() {
    if !can_sandbox() {
        return;
    }
    let flash = tempfile::tempdir().unwrap();
    let flash_dir = flash.path().to_str().unwrap();
    let daemon = Daemon::start_with(
        sandboxed_command(&kvmmd_bin()),
        None,
        &[
            "--device-budget",
            "64MiB",
            "--dram-budget",
            "16MiB",
            "--flash-budget",
            "16MiB",
            "--flash-dir",
            flash_dir,
            "--demote-format",
            "none",
            "--io-engine",
            "io_uring",
        ],
    );
    assert_confined(&daemon, "0");

    // io_uring is allowed by @system-service (@aio) and works in there.
    let status = daemon.status();
    println!("io engine {} (fallback: {:?})", status.io_engine, status.io_fallback);
    assert_eq!(status.io_engine, "io_uring", "fallback: {}", status.io_fallback);

    let mut c = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "71"]);
    let session: u64 = fields(&c.expect_line("appended"))["session"].parse().unwrap();
    c.send("digest");
    let before = fields(&c.expect_line("digest"));
    let r = daemon.demote(session, Tier::Flash);
    assert_eq!(r.demoted, 18, "every full page went down to flash: {r:?}");
    c.send("digest");
    let after = fields(&c.expect_line("digest"));
    assert_eq!(after["value"], before["value"], "bit-identical after flash and back");
    assert_eq!(after["promoted_flash"], "18", "{after:?}");
    c.send("check 2");
    c.expect_line("checked");
    c.send("exit");
    c.expect_line("detached");
    let s = daemon.status();
    assert_eq!((s.demoted_to_flash, s.promoted_from_flash), (18, 18), "{s:?}");

    let stopped = daemon.stop();
    assert!(stopped.success(), "{stopped:?}");
    let refused = refusals(&stopped.log);
    assert!(refused.is_empty(), "the sandbox refused kvmmd something:\n{}", refused.join("\n"));
}

/// `User=kvmm` stands in as uid 65534 here (no kvmm user exists on the test machine): the runtime
/// and flash directories belong to it, as `RuntimeDirectory=` and `StateDirectory=` would make
/// them; clients of other uids (root, and the daemon's own uid) are served.
#[test]
fn a_sandboxed_kvmmd_running_as_an_unprivileged_uid_serves_clients_of_other_uids() {
    if !can_sandbox() || !can_run_as_nobody() {
        return;
    }
    let uid: u32 = NOBODY.parse().unwrap();
    let flash = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(flash.path(), Some(uid), Some(uid)).unwrap();
    let mut kvmmd = sandboxed_command(&kvmmd_bin());
    kvmmd.env("KVMM_SANDBOX_USER", NOBODY);
    let daemon = Daemon::start_with(
        kvmmd,
        Some(uid),
        &[
            "--device-budget",
            "64MiB",
            "--dram-budget",
            "16MiB",
            "--flash-budget",
            "16MiB",
            "--flash-dir",
            flash.path().to_str().unwrap(),
        ],
    );
    assert_confined(&daemon, NOBODY);

    let mut root_client = spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "72"]);
    let session: u64 = fields(&root_client.expect_line("appended"))["session"].parse().unwrap();
    let mut nobody_client = Worker::spawn_cmd(as_nobody(&client_bin(), None).args(client_args(
        "run",
        &daemon,
        &["--tokens", "200", "--seed", "73"],
    )));
    nobody_client.expect_line("appended");
    assert_eq!(daemon.demote(session, Tier::Flash).demoted, 18);
    for c in [&mut root_client, &mut nobody_client] {
        c.send("check 2");
        c.expect_line("checked");
        c.send("exit");
        c.expect_line("detached");
    }
    let stopped = daemon.stop();
    assert!(stopped.success(), "{stopped:?}");
    let refused = refusals(&stopped.log);
    assert!(refused.is_empty(), "the sandbox refused kvmmd something:\n{}", refused.join("\n"));
}

/// A probe run by the launcher in kvmmd's place tries what the unit forbids; each line is
/// `what result`, the result an errno name or `ok`.
const PROBE: &str = r#"
import ctypes, errno, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.syscall.restype = ctypes.c_long
scratch = sys.argv[1]

def report(what, f):
    try:
        r = f()
    except OSError as e:
        print(what, errno.errorcode[e.errno])
        return
    if r is None or (isinstance(r, int) and r >= 0) or r is True:
        print(what, "ok")
    else:
        print(what, errno.errorcode[ctypes.get_errno()])

def mmap_anon(prot):
    p = libc.mmap(None, 4096, prot, 0x22, -1, 0)
    return -1 if p in (None, 2**64 - 1) else 0

def write(path):
    with open(path, "w") as f:
        f.write("x")

def setscheduler_fifo():
    param = ctypes.c_int(1)
    return libc.sched_setscheduler(0, 1, ctypes.byref(param))

report("socket_unix", lambda: socket.socket(socket.AF_UNIX).close())
report("socket_inet", lambda: socket.socket(socket.AF_INET).close())
report("socket_inet6", lambda: socket.socket(socket.AF_INET6).close())
report("socket_netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close())
report("write_tmp", lambda: write(os.path.join(scratch, "probe")))
report("write_usr", lambda: write("/usr/kvmm-sandbox-probe"))
report("write_etc", lambda: write("/etc/kvmm-sandbox-probe"))
report("write_proc_sys", lambda: write("/proc/sys/kernel/hostname"))
report("read_root", lambda: os.listdir("/root"))
report("read_home", lambda: os.listdir("/home"))
report("read_kmsg", lambda: open("/proc/kmsg", "rb").close())
report("mmap_rw", lambda: mmap_anon(3))
report("mmap_wx", lambda: mmap_anon(7))
report("mprotect_x", lambda: libc.mprotect(ctypes.c_void_p(libc.mmap(None, 4096, 3, 0x22, -1, 0)), 4096, 5))
report("mdwe", lambda: libc.prctl(66, 0, 0, 0, 0) - 1)
report("unshare_user", lambda: libc.unshare(0x10000000))
report("unshare_net", lambda: libc.unshare(0x40000000))
report("setns", lambda: libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0))
report("clone3", lambda: libc.syscall(435, None, 0))
report("personality", lambda: libc.personality(0x0008))
report("sched_fifo", setscheduler_fifo)
report("setpriority", lambda: libc.setpriority(0, 0, 5))
report("sethostname", lambda: libc.sethostname(b"kvmm", 4))
report("mount", lambda: libc.mount(b"none", scratch.encode(), b"tmpfs", 0, None))
report("syslog", lambda: libc.klogctl(10, None, 0))
report("chmod_setuid", lambda: os.chmod(os.path.join(scratch, "probe"), 0o4700))
report("mknod_dev", lambda: os.mknod(os.path.join(scratch, "null"), 0o20666, os.makedev(1, 3)))
print("dev", ",".join(sorted(os.listdir("/dev"))))
print("session_keyring", libc.syscall(250, 0, -3, 0))
"#;

/// Runs [`PROBE`] under the sandbox; returns its report as what → result, and its stderr.
fn run_probe(scratch: &Path) -> (HashMap<String, String>, String) {
    let out = sandboxed_command(Path::new("/usr/bin/python3"))
        .args(["-I", "-c", PROBE])
        .arg(scratch)
        .env("KVMM_SANDBOX_VERBOSE", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "the probe failed: {:?}\n{stdout}\n{stderr}", out.status);
    let report = stdout.lines().filter_map(|l| l.split_once(' ')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
    (report, stderr)
}

#[test]
fn the_sandbox_refuses_what_the_unit_refuses() {
    if !can_sandbox() {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let (report, stderr) = run_probe(scratch.path());
    let mut lines: Vec<_> = report.iter().map(|(k, v)| format!("{k} {v}")).collect();
    lines.sort();
    println!("{}\n{}", stderr.trim(), lines.join("\n"));

    let expected = [
        // What kvmmd needs: positive controls, so the refusals below are the sandbox's doing.
        ("socket_unix", "ok"),
        ("write_tmp", "ok"),
        ("mmap_rw", "ok"),
        // MemoryDenyWriteExecute=yes: the kernel's MDWE survived execve, and the seccomp rules.
        ("mdwe", "ok"),
        ("mmap_wx", "EPERM"),
        ("mprotect_x", "EPERM"),
        // RestrictAddressFamilies=AF_UNIX.
        ("socket_inet", "EAFNOSUPPORT"),
        ("socket_inet6", "EAFNOSUPPORT"),
        ("socket_netlink", "EAFNOSUPPORT"),
        // ProtectSystem=strict, ProtectKernelTunables=.
        ("write_usr", "EROFS"),
        ("write_etc", "EROFS"),
        ("write_proc_sys", "EROFS"),
        // ProtectHome=yes, ProtectKernelLogs=: covered by inaccessible nodes.
        ("read_root", "EACCES"),
        ("read_home", "EACCES"),
        ("read_kmsg", "EACCES"),
        // RestrictNamespaces=yes.
        ("unshare_user", "EPERM"),
        ("unshare_net", "EPERM"),
        ("setns", "EPERM"),
        ("clone3", "ENOSYS"),
        // LockPersonality=yes, RestrictRealtime=yes.
        ("personality", "EPERM"),
        ("sched_fifo", "EPERM"),
        // SystemCallFilter=~@privileged @resources, and the calls outside @system-service.
        ("setpriority", "EPERM"),
        ("sethostname", "EPERM"),
        ("mount", "EPERM"),
        ("syslog", "EPERM"),
        // RestrictSUIDSGID=yes; no CAP_MKNOD (PrivateDevices=, DevicePolicy=closed).
        ("chmod_setuid", "EPERM"),
        ("mknod_dev", "EPERM"),
    ];
    for (what, result) in expected {
        assert_eq!(report.get(what).map(String::as_str), Some(result), "{what}; whole report:\n{}", lines.join("\n"));
    }

    // PrivateDevices=yes: pseudo devices only.
    assert_eq!(
        report["dev"], "fd,full,mqueue,null,ptmx,pts,random,shm,stderr,stdin,stdout,tty,urandom,zero",
        "the private /dev"
    );
    // KeyringMode=private: a session keyring of its own.
    assert_ne!(report["session_keyring"], session_keyring_here().to_string(), "KeyringMode=private");

    // The allow list came from systemd-analyze: @system-service less @privileged and @resources.
    let allowed = stderr
        .split("SystemCallFilter: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or_else(|| panic!("the launcher reports its allow list: {stderr}"));
    assert!(allowed > 200, "{allowed} calls allowed: {stderr}");
}

/// This process's session keyring id (keyctl GET_KEYRING_ID of KEY_SPEC_SESSION_KEYRING), read by
/// a child that shares it, so that this file needs no `unsafe`.
fn session_keyring_here() -> i64 {
    let out = Command::new("/usr/bin/python3")
        .args(["-I", "-c", "import ctypes; print(ctypes.CDLL(None).syscall(250, 0, -3, 0))"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
fn a_call_through_another_abi_kills_the_sandboxed_process() {
    if !can_sandbox() {
        return;
    }
    // SystemCallArchitectures=native: getpid through the x32 ABI (nr | 0x40000000).
    let out = sandboxed_command(Path::new("/usr/bin/python3"))
        .args(["-I", "-c", "import ctypes; ctypes.CDLL(None).syscall(0x40000000 + 39); print('survived')"])
        .output()
        .unwrap();
    println!("{:?}", out.status);
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&out.status), Some(libc::SIGSYS), "{out:?}");
}
