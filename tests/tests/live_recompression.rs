//! While clients run attention continuously (and the daemon also moves their pages between frames),
//! the daemon recompresses their full pages in place, f16 → q8 → q4. Every output stays equal, to
//! float rounding, to a reference over the client's own K/V passed through the same quantizer for the
//! pages that were compressed when they were read: no client ever sees a torn or half-encoded page.
//! The tail pages, still being written, stay f16; the device bytes shrink.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kvmm_proto::v1::PageFormat;
use kvmm_tests::{Daemon, Worker, fields, spawn_client};

/// Compresses every full page of a session to `format`, retrying pages a client had pinned.
fn compress_all(daemon: &Daemon, client: &mut Worker, session: u64, format: PageFormat, full_pages: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut done = 0;
    loop {
        let r = match daemon.try_compress(session, format) {
            Ok(r) => r,
            Err(e) => panic!("{e:?}; the client said: {}", client.expect_line("")),
        };
        done += r.compressed;
        if r.skipped_pinned == 0 {
            assert_eq!(done, full_pages, "{r:?}");
            return done;
        }
        assert!(Instant::now() < deadline, "pages stayed pinned: {r:?}");
    }
}

#[test]
fn pages_recompressed_under_running_attention_decode_exactly_as_quantized() {
    let daemon = Daemon::start(&["--device-budget", "64MiB", "--debug-move-churn"]);
    // 300 tokens at 32 per page: 9 full pages and a tail of 12 tokens, per layer.
    let mut clients = [
        spawn_client("run", &daemon, &["--layers", "2", "--tokens", "300", "--seed", "21", "--requantized-from", "q8"]),
        spawn_client(
            "run",
            &daemon,
            &[
                "--layers",
                "3",
                "--kv-heads",
                "2",
                "--q-heads",
                "8",
                "--head-dim",
                "32",
                "--bf16",
                "--tokens",
                "300",
                "--seed",
                "22",
                "--requantized-from",
                "q8",
            ],
        ),
    ];
    let mut sessions = Vec::new();
    for (c, layers) in clients.iter_mut().zip([2u32, 3]) {
        let f = fields(&c.expect_line("appended"));
        sessions.push((f["session"].parse::<u64>().unwrap(), layers, f["device_bytes"].parse::<u64>().unwrap()));
        c.send("loop");
    }
    let before = daemon.status().tiers[0].used_bytes;

    for format in [PageFormat::Q8, PageFormat::Q4] {
        for (client, &(session, layers, _)) in clients.iter_mut().zip(&sessions) {
            compress_all(&daemon, client, session, format, 9 * layers);
        }
        // Let the clients read the pages in their new format for a while.
        std::thread::sleep(Duration::from_millis(500));
    }
    // Already at q4: nothing more to do; back up to q8 is refused as a no-op.
    let again = daemon.compress(sessions[0].0, PageFormat::Q8);
    assert_eq!((again.compressed, again.skipped_already), (0, 18), "{again:?}");
    let f16 = daemon.try_compress(sessions[0].0, PageFormat::F16).unwrap_err();
    assert_eq!(f16.code(), tonic::Code::InvalidArgument, "{f16:?}");

    let after = daemon.status();
    println!("device bytes: {before} before, {} after recompression to q4", after.tiers[0].used_bytes);
    assert!(after.tiers[0].used_bytes < before / 2, "q4 pages take less than half of f16");
    assert_eq!(after.tiers[0].used_bytes, after.session_bytes);

    for (c, &(_, _, first_bytes)) in clients.iter_mut().zip(&sessions) {
        c.send("stop");
        let line = c.expect_line("looped");
        println!("{line}");
        let f = fields(&line);
        assert!(f["attentions"].parse::<u64>().unwrap() > 0);
        let seen = &f["formats_seen"];
        assert!(seen.contains("q8:") && seen.contains("q4:"), "read pages in q8 and q4: {seen}");
        assert!(f["device_bytes"].parse::<u64>().unwrap() < first_bytes);
        // The tail page is still f16 and still writable.
        c.send("append 40");
        c.expect_line("appended");
        c.send("exit");
        c.expect_line("detached");
        assert!(c.wait(Duration::from_secs(10)).success());
    }
    println!("{} page moves ran alongside", after.pages_moved);
    let status = daemon.wait_drained();
    assert_eq!(status.tiers[0].used_bytes, 0);
    assert!(daemon.stop().success());
}

/// A long admin `Compress` shares the daemon with other clients: it hands the core lock to their
/// requests between pages, runs off the gRPC workers, and yields its CPU between pages too
/// (kvmmd's `migrate::LockPacer`). With kvmmd on one CPU (every thread of it),
/// as a device whose other cores are busy would leave it, another client's `SessionStats` calls
/// keep completing while 1,024 Llama-3-8B-shaped pages (135 MB) are re-encoded. Before 3ad6526
/// the request held the core lock (and a worker) from its first page to its last, so no call
/// could finish inside it; until it yielded its CPU too, each call waited out the request's
/// scheduler slice (about 11 ms).
#[test]
fn other_clients_are_served_while_a_large_session_is_recompressed() {
    use std::sync::atomic::{AtomicBool, Ordering};

    use kvmm_client::{Client, Geometry};

    let daemon = start_on_one_cpu(&["--device-budget", "256MiB"]);
    let llama = kvmm_tests::llama3_8b(32, 32 * 32);
    let client = Client::connect(daemon.socket()).unwrap();
    let mut big = client.attach(llama).unwrap();
    kvmm_tests::fill_every_layer(&mut big, llama);
    let other = Client::connect(daemon.socket()).unwrap();
    let probe = other.attach(Geometry { layers: 1, kv_heads: 1, q_heads: 1, head_dim: 64, ..llama }).unwrap();

    let done = AtomicBool::new(false);
    let (compressed, window, calls) = std::thread::scope(|scope| {
        let calls = scope.spawn(|| {
            let mut calls = Vec::new();
            while !done.load(Ordering::Acquire) {
                let started = Instant::now();
                probe.stats().unwrap();
                calls.push((started, Instant::now()));
            }
            calls
        });
        std::thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        let r = daemon.compress(big.id(), PageFormat::Q8);
        let ended = Instant::now();
        done.store(true, Ordering::Release);
        (r.compressed, (started, ended), calls.join().unwrap())
    });
    assert_eq!(compressed, 1024);
    let (started, ended) = window;
    let inside = calls.iter().filter(|&&(s, e)| s > started && e < ended).count();
    println!("compress took {:?}; {inside} of the other client's calls ran inside it", ended - started);
    // One call per 5 ms at least, on average: 3–7 calls in 47–107 ms while each waited out the
    // request's slice; 67–552 calls in 83–248 ms since, with a CPU hog beside kvmmd or not.
    let wanted = ((ended - started).as_millis() / 5).max(3) as usize;
    assert!(
        inside >= wanted,
        "only {inside} calls started and ended while Compress ran for {:?} ({wanted} wanted)",
        ended - started
    );
    big.detach().unwrap();
    probe.detach().unwrap();
    assert!(daemon.stop().success());
}

/// Starts kvmmd with `args` allowed on one CPU only (the first this test may use): every thread it
/// starts inherits the affinity of the thread that spawned it, through the sandbox launcher too.
fn start_on_one_cpu(args: &[&str]) -> Daemon {
    use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

    let allowed = sched_getaffinity(None).unwrap();
    let first = (0..CpuSet::MAX_CPU).find(|&cpu| allowed.is_set(cpu)).unwrap();
    let mut one = CpuSet::new();
    one.set(first);
    sched_setaffinity(None, &one).unwrap();
    let daemon = Daemon::start(args);
    sched_setaffinity(None, &allowed).unwrap();
    daemon
}
