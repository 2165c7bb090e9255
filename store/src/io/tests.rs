//! One suite for every engine: real files opened with O_DIRECT in a temporary directory.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};

use super::*;

fn open_direct(dir: &tempfile::TempDir, len: u64) -> File {
    let path = dir.path().join("flash");
    let fd: OwnedFd = rustix::fs::open(
        &path,
        OFlags::RDWR | OFlags::CREATE | OFlags::DIRECT | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .expect("the test directory is on a filesystem with O_DIRECT (ext4 here)");
    rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, len).unwrap();
    File::from(fd)
}

/// Every engine this machine can run, with the buffers registered where there are any.
fn engines() -> Vec<(&'static str, Arc<dyn IoEngine>, Arc<IoBuffers>)> {
    let mut all: Vec<(&'static str, Arc<dyn IoEngine>, Arc<IoBuffers>)> = Vec::new();
    let pool = IoBuffers::new(64 * 1024, 16).unwrap();
    all.push(("pread", Arc::new(SyncEngine::new()), Arc::clone(&pool)));
    let registered = IoBuffers::new(64 * 1024, 16).unwrap();
    let uring = UringEngine::new(8, Some(Arc::clone(&registered)))
        .expect("io_uring is enabled on the development machine and in CI");
    assert!(uring.has_registered_buffers());
    all.push(("io_uring registered", Arc::new(uring), registered));
    let plain = IoBuffers::new(64 * 1024, 16).unwrap();
    all.push(("io_uring", Arc::new(UringEngine::new(8, None).unwrap()), plain));
    all
}

fn pattern(seed: usize, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (seed.wrapping_mul(131) ^ i.wrapping_mul(7) ^ (i >> 8)) as u8;
    }
}

#[test]
fn every_engine_writes_and_reads_back_a_batch_larger_than_its_ring() {
    for (name, engine, pool) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let file = open_direct(&dir, 8 << 20);
        // 40 requests (ring depth 8): leased chunks (fixed buffers for the registered engine) and
        // plain aligned blocks, at scattered aligned offsets.
        let mut leased: Vec<IoBuffer> = (0..8).map(|_| pool.lease().unwrap()).collect();
        let mut plain: Vec<AlignedBuf> = (0..32).map(|_| AlignedBuf::zeroed(16 * 1024).unwrap()).collect();
        let offsets: Vec<u64> = (0..40u64).map(|i| (i * 37 % 40) * 128 * 1024).collect();
        for (i, b) in leased.iter_mut().enumerate() {
            pattern(i, b);
        }
        for (i, b) in plain.iter_mut().enumerate() {
            pattern(100 + i, b);
        }
        let mut writes: Vec<IoRequest<'_>> = leased
            .iter()
            .map(|b| &b[..])
            .chain(plain.iter().map(|b| &b[..]))
            .zip(&offsets)
            .map(|(buf, &offset)| IoRequest::Write { offset, buf })
            .collect();
        for r in run_all(engine.as_ref(), file.as_fd(), &mut writes) {
            r.unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let mut back_leased: Vec<IoBuffer> = (0..8).map(|_| pool.lease().unwrap()).collect();
        let mut back_plain: Vec<AlignedBuf> = (0..32).map(|_| AlignedBuf::zeroed(16 * 1024).unwrap()).collect();
        let mut reads: Vec<IoRequest<'_>> = back_leased
            .iter_mut()
            .map(|b| &mut b[..])
            .chain(back_plain.iter_mut().map(|b| &mut b[..]))
            .zip(&offsets)
            .map(|(buf, &offset)| IoRequest::Read { offset, buf })
            .collect();
        for r in run_all(engine.as_ref(), file.as_fd(), &mut reads) {
            r.unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        drop(reads);
        for (a, b) in leased.iter().zip(&back_leased) {
            assert!(a[..] == b[..], "{name}: a leased chunk came back different");
        }
        for (a, b) in plain.iter().zip(&back_plain) {
            assert!(a[..] == b[..], "{name}: a plain block came back different");
        }
    }
}

#[test]
fn a_read_past_the_end_of_the_file_is_a_short_transfer_error() {
    for (name, engine, _) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let file = open_direct(&dir, 64 * 1024);
        let mut inside = AlignedBuf::zeroed(IO_ALIGN).unwrap();
        let mut straddling = AlignedBuf::zeroed(4 * IO_ALIGN).unwrap();
        let mut reads = [
            IoRequest::Read { offset: 0, buf: &mut inside },
            IoRequest::Read { offset: 62 * 1024, buf: &mut straddling },
        ];
        let results = run_all(engine.as_ref(), file.as_fd(), &mut reads);
        assert!(results[0].is_ok(), "{name}");
        match &results[1] {
            Err(IoError::Short { done, len, .. }) => assert_eq!((*done, *len), (2048, 4 * IO_ALIGN), "{name}"),
            other => panic!("{name}: expected a short transfer, got {other:?}"),
        }
    }
}

#[test]
fn injected_errors_hit_exactly_the_requests_they_match() {
    for (name, inner, _) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let file = open_direct(&dir, 1 << 20);
        let engine = FaultyEngine::new(inner);
        engine.arm(Fault::write_error(libc::ENOSPC, 1).at(64 * 1024..128 * 1024));
        let bufs: Vec<AlignedBuf> = (0..4)
            .map(|i| {
                let mut b = AlignedBuf::zeroed(IO_ALIGN).unwrap();
                pattern(i, &mut b);
                b
            })
            .collect();
        let mut writes: Vec<IoRequest<'_>> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| IoRequest::Write { offset: i as u64 * 64 * 1024, buf: &b[..] })
            .collect();
        let results = run_all(&engine, file.as_fd(), &mut writes);
        assert_eq!(results[1].as_ref().err().and_then(IoError::raw_os_error), Some(libc::ENOSPC), "{name}");
        assert!(results[0].is_ok() && results[2].is_ok() && results[3].is_ok(), "{name}: {results:?}");
        assert_eq!(engine.fired(), 1);

        engine.arm(Fault::read_error(libc::EIO, 1));
        let mut first = AlignedBuf::zeroed(IO_ALIGN).unwrap();
        let mut third = AlignedBuf::zeroed(IO_ALIGN).unwrap();
        let mut reads =
            [IoRequest::Read { offset: 0, buf: &mut first }, IoRequest::Read { offset: 128 * 1024, buf: &mut third }];
        let results = run_all(&engine, file.as_fd(), &mut reads);
        assert_eq!(results[0].as_ref().err().and_then(IoError::raw_os_error), Some(libc::EIO), "{name}");
        assert!(results[1].is_ok(), "{name}");
        assert!(third[..] == bufs[2][..], "{name}: the request after the failed one is intact");
        assert!(first.iter().all(|&b| b == 0), "{name}: a failed read leaves its buffer alone");
        // The failed write never reached the file.
        let mut second = AlignedBuf::zeroed(IO_ALIGN).unwrap();
        let mut read = [IoRequest::Read { offset: 64 * 1024, buf: &mut second }];
        assert!(run_all(&engine, file.as_fd(), &mut read)[0].is_ok());
        assert!(second.iter().all(|&b| b == 0), "{name}");
    }
}

#[test]
fn short_transfers_are_resumed_and_a_stalled_one_is_an_error() {
    for (name, inner, _) in engines() {
        let dir = tempfile::tempdir().unwrap();
        let file = open_direct(&dir, 1 << 20);
        let engine = FaultyEngine::new(inner);
        let mut data = AlignedBuf::zeroed(8 * IO_ALIGN).unwrap();
        pattern(7, &mut data);
        // Each of the first three rounds moves one block of the write and of the read.
        engine.arm(Fault::short_write(IO_ALIGN, 3));
        let mut write = [IoRequest::Write { offset: 0, buf: &data }];
        assert!(run_all(&engine, file.as_fd(), &mut write)[0].is_ok(), "{name}");
        engine.arm(Fault::short_read(IO_ALIGN, 3));
        let mut back = AlignedBuf::zeroed(8 * IO_ALIGN).unwrap();
        let mut read = [IoRequest::Read { offset: 0, buf: &mut back }];
        assert!(run_all(&engine, file.as_fd(), &mut read)[0].is_ok(), "{name}");
        assert!(back[..] == data[..], "{name}: resumed transfers join up");
        assert_eq!(engine.fired(), 6);

        engine.arm(Fault::short_read(0, 1));
        let mut read = [IoRequest::Read { offset: 0, buf: &mut back }];
        match &run_all(&engine, file.as_fd(), &mut read)[0] {
            Err(IoError::Short { done: 0, .. }) => {}
            other => panic!("{name}: a read that moves nothing must fail, got {other:?}"),
        }
    }
}

#[test]
fn injected_latency_delays_every_batch() {
    let dir = tempfile::tempdir().unwrap();
    let file = open_direct(&dir, 1 << 20);
    let engine = FaultyEngine::new(Arc::new(SyncEngine::new()));
    engine.set_latency(Duration::from_millis(30));
    let mut buf = AlignedBuf::zeroed(IO_ALIGN).unwrap();
    let start = Instant::now();
    let mut read = [IoRequest::Read { offset: 0, buf: &mut buf }];
    assert!(run_all(&engine, file.as_fd(), &mut read)[0].is_ok());
    assert!(start.elapsed() >= Duration::from_millis(30));
    engine.clear();
}

#[test]
fn one_ring_serves_several_threads_at_once() {
    let registered = IoBuffers::new(IO_ALIGN, 64).unwrap();
    let engine: Arc<dyn IoEngine> = Arc::new(UringEngine::new(4, Some(Arc::clone(&registered))).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let file = Arc::new(open_direct(&dir, 4 << 20));
    let workers: Vec<_> = (0..4usize)
        .map(|t| {
            let (engine, file, pool) = (Arc::clone(&engine), Arc::clone(&file), Arc::clone(&registered));
            std::thread::spawn(move || {
                for round in 0..20usize {
                    let mut bufs: Vec<IoBuffer> = (0..8).map(|_| pool.lease().unwrap()).collect();
                    for (i, b) in bufs.iter_mut().enumerate() {
                        pattern(t * 1000 + round * 10 + i, b);
                    }
                    let base = (t * 8) as u64 * IO_ALIGN as u64;
                    let mut writes: Vec<IoRequest<'_>> = bufs
                        .iter()
                        .enumerate()
                        .map(|(i, b)| IoRequest::Write { offset: base + (i * IO_ALIGN) as u64, buf: &b[..] })
                        .collect();
                    assert!(run_all(engine.as_ref(), file.as_fd(), &mut writes).iter().all(Result::is_ok));
                    let mut back = AlignedBuf::zeroed(8 * IO_ALIGN).unwrap();
                    let mut read = [IoRequest::Read { offset: base, buf: &mut back }];
                    assert!(run_all(engine.as_ref(), file.as_fd(), &mut read)[0].is_ok());
                    for (i, b) in bufs.iter().enumerate() {
                        assert!(back[i * IO_ALIGN..(i + 1) * IO_ALIGN] == b[..], "thread {t} round {round}");
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
}

#[test]
fn a_batch_does_not_wait_for_another_callers_batch_in_flight() {
    // A read from an empty pipe stays in flight until something is written to the pipe. A file
    // read submitted meanwhile by another thread must complete without it: the ring serves both
    // batches at once (before, one batch at a time, the file read waited behind the pipe).
    let engine: Arc<dyn IoEngine> = Arc::new(UringEngine::new(8, None).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let file = open_direct(&dir, 1 << 20);
    let (pipe_r, pipe_w) = rustix::pipe::pipe().unwrap();
    let pending = {
        let engine = Arc::clone(&engine);
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 5];
            let mut read = [IoRequest::Read { offset: 0, buf: &mut buf }];
            let got = engine.submit(pipe_r.as_fd(), &mut read).remove(0).unwrap();
            (got, buf)
        })
    };
    // Give the pipe read time to reach the ring first.
    std::thread::sleep(Duration::from_millis(100));
    let (done, answer) = std::sync::mpsc::channel();
    let other = {
        let engine = Arc::clone(&engine);
        std::thread::spawn(move || {
            let mut buf = AlignedBuf::zeroed(IO_ALIGN).unwrap();
            let mut read = [IoRequest::Read { offset: 0, buf: &mut buf }];
            let result = engine.submit(file.as_fd(), &mut read).remove(0);
            done.send(result.map_err(|e| e.to_string())).unwrap();
        })
    };
    let result = answer.recv_timeout(Duration::from_secs(5));
    // Release the pipe read either way, so the threads end.
    rustix::io::write(&pipe_w, b"hello").unwrap();
    assert_eq!(result.expect("the file read completed while the pipe read was in flight"), Ok(IO_ALIGN));
    other.join().unwrap();
    let (got, buf) = pending.join().unwrap();
    assert_eq!((got, &buf[..]), (5, &b"hello"[..]));
}

#[test]
fn the_probe_picks_io_uring_here_and_pread_when_asked() {
    let pool = IoBuffers::new(IO_ALIGN, 4).unwrap();
    let probed = probe(EngineChoice::Auto, 32, Some(pool)).unwrap();
    assert_eq!(probed.engine.kind(), EngineKind::IoUring, "fallback: {:?}", probed.fallback);
    assert!(probed.fallback.is_none());
    let probed = probe(EngineChoice::Sync, 32, None).unwrap();
    assert_eq!(probed.engine.kind(), EngineKind::Sync);
    assert_eq!("io_uring".parse::<EngineChoice>(), Ok(EngineChoice::IoUring));
    assert_eq!("pread".parse::<EngineChoice>(), Ok(EngineChoice::Sync));
    assert!("uring".parse::<EngineChoice>().unwrap_err().contains("\"auto\""));
}

/// Runs in a child process (see the tests below): applies the restriction named by
/// `KVMM_PROBE_CHILD`, then prints what `probe(Auto)` and `probe(IoUring)` pick.
#[test]
#[ignore = "run by the fallback tests in a restricted child process"]
fn probe_in_restricted_child() {
    let Ok(restriction) = std::env::var("KVMM_PROBE_CHILD") else { return };
    if restriction == "seccomp" {
        deny_io_uring_setup();
    }
    let pool = IoBuffers::new(1 << 20, 4).unwrap();
    let auto = probe(EngineChoice::Auto, 8, Some(Arc::clone(&pool))).unwrap();
    println!("auto={} fallback={:?}", auto.engine.kind(), auto.fallback);
    match probe(EngineChoice::IoUring, 8, Some(pool)) {
        Ok(p) => println!("forced=ok:{}", p.engine.kind()),
        Err(e) => println!("forced=err:{e}"),
    }
}

/// Installs a seccomp filter that fails `io_uring_setup` with EPERM, as a hardened service
/// manager's system-call filter does.
fn deny_io_uring_setup() {
    const NR_IO_URING_SETUP: u32 = 425;
    let filter = [
        libc::sock_filter { code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16, jt: 0, jf: 0, k: 0 },
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: NR_IO_URING_SETUP,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        },
        libc::sock_filter { code: (libc::BPF_RET | libc::BPF_K) as u16, jt: 0, jf: 0, k: libc::SECCOMP_RET_ALLOW },
    ];
    let program = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
    // SAFETY: plain prctl calls; `program` points at `filter`, which outlives the call (the kernel
    // copies it).
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &program as *const libc::sock_fprog),
            0
        );
    }
}

/// Runs `probe_in_restricted_child` in a child process under `wrapper` and returns its output.
fn probe_child(restriction: &str, wrapper: &[&str]) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut args: Vec<String> = wrapper.iter().map(|s| s.to_string()).collect();
    args.push(exe.display().to_string());
    args.extend(["--exact", "io::tests::probe_in_restricted_child", "--ignored", "--nocapture"].map(String::from));
    let out =
        std::process::Command::new(&args[0]).args(&args[1..]).env("KVMM_PROBE_CHILD", restriction).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed: {text}");
    text
}

#[test]
fn a_seccomp_filter_on_io_uring_falls_back_to_pread_and_fails_a_forced_io_uring() {
    let out = probe_child("seccomp", &["env"]);
    assert!(out.contains("auto=pread"), "{out}");
    assert!(out.contains("io_uring is disabled"), "the reason names the cause: {out}");
    assert!(out.contains("forced=err:the io_uring engine is unavailable"), "{out}");
}

#[test]
fn a_refused_buffer_registration_keeps_io_uring_without_fixed_buffers() {
    // Registered buffers count against RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK: run the
    // child as an unprivileged user allowed 64 KiB of locked memory: enough for a small ring (which
    // counts too), not for 4 MiB of buffers. With no locked memory at all, even the ring is refused.
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: dropping to another user needs root");
        return;
    }
    let out = probe_child(
        "memlock",
        &["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "prlimit", "--memlock=65536:65536"],
    );
    assert!(out.contains("auto=io_uring"), "{out}");
    assert!(out.contains("RLIMIT_MEMLOCK"), "the reason names the limit: {out}");
    assert!(out.contains("forced=ok:io_uring"), "{out}");
}
