//! The flash file against real files, with every engine: round trips, coalescing, tampering,
//! canaries, exhaustion, injected faults, nonce uniqueness.

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::io::{EngineChoice, Fault, FaultyEngine, SyncEngine, probe};
use crate::seal::SessionKey;

/// A SmolLM2 f16 page.
const PAGE: usize = 25_408;

/// A named engine and the staging buffers it has registered, if any.
type Engine = (&'static str, Arc<dyn IoEngine>, Option<Arc<IoBuffers>>);

fn engines() -> Vec<Engine> {
    let registered = IoBuffers::new(RUN_BYTES, 8).unwrap();
    let uring = probe(EngineChoice::IoUring, 64, Some(Arc::clone(&registered))).unwrap().engine;
    vec![("pread", Arc::new(SyncEngine::new()), None), ("io_uring", uring, Some(registered))]
}

fn file_with(
    engine: Arc<dyn IoEngine>,
    buffers: Option<Arc<IoBuffers>>,
    capacity: u64,
) -> (tempfile::TempDir, FlashFile) {
    let dir = tempfile::tempdir().unwrap();
    let file = FlashFile::create(&dir.path().join("kvmm.flash"), capacity, engine, buffers).unwrap();
    (dir, file)
}

fn page_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn id(block: u32) -> PageId {
    PageId { session: 7, layer: 3, block }
}

fn write_all(file: &mut FlashFile, key: &SessionKey, pages: &[Vec<u8>]) -> Vec<FlashSlot> {
    let writes: Vec<PageWrite<'_>> =
        pages.iter().enumerate().map(|(i, b)| PageWrite { key: Some(key), page: id(i as u32), bytes: b }).collect();
    file.put(&writes).into_iter().map(|r| r.unwrap()).collect()
}

fn read_all(file: &mut FlashFile, key: &SessionKey, slots: &[FlashSlot]) -> (Vec<Vec<u8>>, Vec<Result<(), TierError>>) {
    let mut outs: Vec<Vec<u8>> = slots.iter().map(|s| vec![0xee; s.len as usize]).collect();
    let mut reads: Vec<PageRead<'_, FlashSlot>> = outs
        .iter_mut()
        .zip(slots)
        .enumerate()
        .map(|(i, (out, &slot))| PageRead { key: Some(key), page: id(i as u32), slot, out })
        .collect();
    let results = file.get(&mut reads);
    drop(reads);
    (outs, results)
}

#[test]
fn pages_written_together_come_back_identical_in_few_large_requests() {
    for (name, engine, buffers) in engines() {
        let (_dir, mut file) = file_with(engine, buffers, 64 << 20);
        assert!(file.is_direct(), "{name}: ext4 takes O_DIRECT");
        let key = SessionKey::generate().unwrap();
        let pages: Vec<Vec<u8>> = (0..48).map(|i| page_bytes(i, PAGE - (i as usize % 3) * 1000)).collect();
        let slots = write_all(&mut file, &key, &pages);
        let stats = file.stats();
        assert_eq!(stats.pages, 48);
        assert_eq!(stats.used, slots.iter().map(|s| s.extent).sum::<u64>(), "{name}: accounting");
        // 48 slots of 24-28 KiB (1.19 MiB) in runs of at most 1 MiB: two requests, not 48.
        assert_eq!(stats.write_requests, 2, "{name}");
        let (outs, results) = read_all(&mut file, &key, &slots);
        assert!(results.iter().all(Result::is_ok), "{name}: {results:?}");
        assert_eq!(outs, pages, "{name}");
        assert_eq!(file.stats().read_requests, 2, "{name}: adjacent slots are read together");
    }
}

#[test]
fn long_writes_and_reads_through_the_pipeline_come_back_identical_call_after_call() {
    for (name, engine, buffers) in engines() {
        let (_dir, mut file) = file_with(engine, buffers, 64 << 20);
        let key = SessionKey::generate().unwrap();
        // About 12 MiB: 12 runs, more than the 8 staging chunks and the pipeline's depth, so the
        // sealers wait for the writer and some runs stage in buffers of their own.
        let pages: Vec<Vec<u8>> = (0..480).map(|i| page_bytes(1000 + i, PAGE - (i as usize % 5) * 700)).collect();
        for round in 0..3 {
            let slots = write_all(&mut file, &key, &pages);
            assert!(file.stats().write_requests >= 12 * (round + 1), "{name}: {:?}", file.stats());
            let (outs, results) = read_all(&mut file, &key, &slots);
            assert!(results.iter().all(Result::is_ok), "{name}: round {round}");
            assert!(outs == pages, "{name}: round {round} read back different bytes");
            for slot in slots {
                file.free(slot);
            }
            assert_eq!(file.stats().used, 0, "{name}: round {round} accounting");
        }
    }
}

#[test]
fn one_flipped_byte_is_data_loss_for_exactly_that_page() {
    for (name, engine, buffers) in engines() {
        let (dir, mut file) = file_with(engine, buffers, 16 << 20);
        let key = SessionKey::generate().unwrap();
        let pages: Vec<Vec<u8>> = (0..4).map(|i| page_bytes(i, PAGE)).collect();
        let slots = write_all(&mut file, &key, &pages);
        let raw = std::fs::OpenOptions::new().read(true).write(true).open(dir.path().join("kvmm.flash")).unwrap();
        let at = slots[2].offset + RECORD_HEADER as u64 + 12_345;
        let mut byte = [0u8];
        raw.read_exact_at(&mut byte, at).unwrap();
        raw.write_all_at(&[byte[0] ^ 0x10], at).unwrap();
        raw.sync_all().unwrap();
        let (outs, results) = read_all(&mut file, &key, &slots);
        for (i, r) in results.iter().enumerate() {
            if i == 2 {
                assert!(matches!(r, Err(TierError::DataLoss { block: 2, .. })), "{name}: {r:?}");
                assert!(outs[2].iter().all(|&b| b == 0), "{name}: no bytes of a failed page are returned");
            } else {
                assert!(r.is_ok(), "{name}: page {i}: {r:?}");
                assert_eq!(outs[i], pages[i]);
            }
        }
        assert_eq!(file.stats().auth_failures, 1);
    }
}

/// Found by the `flash_records` fuzz target: a record whose reserved header bytes (9..12, 40..48)
/// had been changed on disk read back as if intact, because the decoder skipped them and the AAD
/// does not cover them.
#[test]
fn a_changed_reserved_header_byte_is_data_loss_not_an_intact_read() {
    let (_, engine, buffers) = engines().remove(0);
    let (dir, mut file) = file_with(engine, buffers, 4 << 20);
    let key = SessionKey::generate().unwrap();
    let page = page_bytes(9, 258);
    let slots = write_all(&mut file, &key, std::slice::from_ref(&page));
    let raw = std::fs::OpenOptions::new().read(true).write(true).open(dir.path().join("kvmm.flash")).unwrap();
    for at in [9u64, 11, 40, 46, 47] {
        let mut byte = [0u8];
        raw.read_exact_at(&mut byte, slots[0].offset + at).unwrap();
        assert_eq!(byte, [0], "byte {at} of the header is reserved and written as zero");
        raw.write_all_at(&[0xee], slots[0].offset + at).unwrap();
        raw.sync_all().unwrap();
        let (outs, results) = read_all(&mut file, &key, &slots);
        match &results[0] {
            Err(TierError::DataLoss { why, .. }) => assert!(why.contains("no record"), "byte {at}: {why}"),
            other => panic!("byte {at}: expected data loss, got {other:?}"),
        }
        assert!(outs[0].iter().all(|&b| b == 0), "byte {at}: no bytes of a failed page are returned");
        raw.write_all_at(&[0], slots[0].offset + at).unwrap();
        raw.sync_all().unwrap();
        let (outs, results) = read_all(&mut file, &key, &slots);
        assert!(results[0].is_ok() && outs[0] == page, "byte {at}: restoring the zero restores the page");
    }
}

#[test]
fn record_headers_decode_only_in_their_one_encoding() {
    let header = Header { len: 258, counter: 3, page: id(1), tag: [0xab; TAG_LEN] };
    let mut bytes = [0u8; RECORD_HEADER];
    header.encode(&mut bytes);
    assert_eq!(Header::decode(&bytes), Some(header));
    assert_eq!(reencode_record_header(&bytes), Some(bytes));
    assert_eq!(Header::decode(&bytes[..RECORD_HEADER - 1]), None, "a short header is no header");
    for at in (9..12).chain(40..48) {
        let mut changed = bytes;
        changed[at] = 1;
        assert_eq!(Header::decode(&changed), None, "reserved byte {at} set");
    }
}

#[test]
fn swapped_slots_are_data_loss_whether_headers_travel_or_not() {
    let (name, engine, buffers) = engines().remove(1);
    let (dir, mut file) = file_with(engine, buffers, 16 << 20);
    let key = SessionKey::generate().unwrap();
    let pages: Vec<Vec<u8>> = (0..4).map(|i| page_bytes(i, PAGE)).collect();
    let slots = write_all(&mut file, &key, &pages);
    let raw = std::fs::OpenOptions::new().read(true).write(true).open(dir.path().join("kvmm.flash")).unwrap();
    let swap = |from: u64, skip: usize| {
        let len = slots[0].extent as usize - skip;
        let (mut a, mut b) = (vec![0u8; len], vec![0u8; len]);
        raw.read_exact_at(&mut a, slots[0].offset + from + skip as u64).unwrap();
        raw.read_exact_at(&mut b, slots[1].offset + from + skip as u64).unwrap();
        raw.write_all_at(&b, slots[0].offset + from + skip as u64).unwrap();
        raw.write_all_at(&a, slots[1].offset + from + skip as u64).unwrap();
        raw.sync_all().unwrap();
    };
    // Whole records: the headers name other pages.
    swap(0, 0);
    let (_, results) = read_all(&mut file, &key, &slots);
    assert!(
        matches!(results[0], Err(TierError::DataLoss { .. })) && matches!(results[1], Err(TierError::DataLoss { .. })),
        "{name}"
    );
    assert!(results[2].is_ok() && results[3].is_ok());
    // Swap back, then only tag and ciphertext (each header stays): the AAD and nonce catch it.
    swap(0, 0);
    let (_, results) = read_all(&mut file, &key, &slots);
    assert!(results.iter().all(Result::is_ok), "swapping back restores both");
    swap(0, 48);
    let (_, results) = read_all(&mut file, &key, &slots);
    for r in &results[..2] {
        match r {
            Err(TierError::DataLoss { why, .. }) => assert!(why.contains("tag"), "{why}"),
            other => panic!("expected a tag failure, got {other:?}"),
        }
    }
}

#[test]
fn another_sessions_key_cannot_open_a_page() {
    let (_, engine, buffers) = engines().remove(0);
    let (_dir, mut file) = file_with(engine, buffers, 4 << 20);
    let (key, other) = (SessionKey::generate().unwrap(), SessionKey::generate().unwrap());
    let slots = write_all(&mut file, &key, &[page_bytes(1, PAGE)]);
    let (_, results) = read_all(&mut file, &other, &slots);
    assert!(matches!(results[0], Err(TierError::DataLoss { .. })));
}

#[test]
fn a_canary_written_through_the_file_is_nowhere_in_it() {
    for (name, engine, buffers) in engines() {
        let (dir, mut file) = file_with(engine, buffers, 4 << 20);
        let key = SessionKey::generate().unwrap();
        let canary = b"KVMM-CANARY-7f3a9c1e";
        let page: Vec<u8> = canary.iter().copied().cycle().take(PAGE).collect();
        let slots = write_all(&mut file, &key, &[page.clone(), page]);
        let (outs, _) = read_all(&mut file, &key, &slots);
        assert!(outs[0].starts_with(canary), "{name}: the canary round-trips");
        let raw = std::fs::read(dir.path().join("kvmm.flash")).unwrap();
        assert!(!raw.windows(8).any(|w| w == &canary[..8]), "{name}: plaintext found in the flash file");
    }
}

#[test]
fn a_full_file_refuses_the_page_and_keeps_exact_accounting() {
    let (_, engine, buffers) = engines().remove(1);
    let (_dir, mut file) = file_with(engine, buffers, 5 * FlashFile::extent_for(PAGE));
    let key = SessionKey::generate().unwrap();
    let pages: Vec<Vec<u8>> = (0..7).map(|i| page_bytes(i, PAGE)).collect();
    let writes: Vec<PageWrite<'_>> =
        pages.iter().enumerate().map(|(i, b)| PageWrite { key: Some(&key), page: id(i as u32), bytes: b }).collect();
    let results = file.put(&writes);
    let ok: Vec<FlashSlot> = results.iter().filter_map(|r| r.as_ref().ok().copied()).collect();
    assert_eq!(ok.len(), 5, "{results:?}");
    assert!(results[5..].iter().all(|r| matches!(r, Err(TierError::Full { .. }))));
    let message = results[6].as_ref().unwrap_err().to_string();
    assert!(message.contains("raise the flash budget"), "{message}");
    assert_eq!(file.stats().used, 5 * FlashFile::extent_for(PAGE));
    file.free(ok[1]);
    assert_eq!(file.stats().used, 4 * FlashFile::extent_for(PAGE));
    assert_eq!(file.stats().pages, 4);
    let again = file.put(&writes[6..]);
    assert!(again[0].is_ok(), "a freed slot is reused");
}

#[test]
fn injected_io_faults_surface_per_page_and_leave_the_accounting_exact() {
    for (name, inner, buffers) in engines() {
        let engine = Arc::new(FaultyEngine::new(inner));
        let (_dir, mut file) = file_with(Arc::clone(&engine) as Arc<dyn IoEngine>, buffers, 64 << 20);
        let key = SessionKey::generate().unwrap();
        let pages: Vec<Vec<u8>> = (0..40).map(|i| page_bytes(i, PAGE)).collect();
        // ENOSPC on the first run's request: its pages fail and hold nothing; the second run lands.
        engine.arm(Fault::write_error(libc::ENOSPC, 1));
        let writes: Vec<PageWrite<'_>> = pages
            .iter()
            .enumerate()
            .map(|(i, b)| PageWrite { key: Some(&key), page: id(i as u32), bytes: b })
            .collect();
        let results = file.put(&writes);
        let failed = results
            .iter()
            .filter(|r| matches!(r, Err(TierError::Io(e)) if e.raw_os_error() == Some(libc::ENOSPC)))
            .count();
        let landed: Vec<FlashSlot> = results.iter().filter_map(|r| r.as_ref().ok().copied()).collect();
        assert!(failed > 0 && failed + landed.len() == 40, "{name}: {failed} failed, {} landed", landed.len());
        assert_eq!(file.stats().used, landed.iter().map(|s| s.extent).sum::<u64>(), "{name}");
        assert_eq!(file.stats().pages, landed.len() as u64);
        // Short writes and reads are resumed; EIO on a read fails that read only and a retry works.
        engine.arm(Fault::short_write(IO_ALIGN, 2));
        let again = file.put(&writes[..3]);
        assert!(again.iter().all(Result::is_ok), "{name}: {again:?}");
        let slot = *again[1].as_ref().unwrap();
        engine.arm(Fault::read_error(libc::EIO, 1));
        let mut out = vec![0u8; PAGE];
        let mut read = [PageRead { key: Some(&key), page: id(1), slot, out: &mut out }];
        let r = file.get(&mut read);
        assert!(matches!(&r[0], Err(TierError::Io(e)) if e.raw_os_error() == Some(libc::EIO)), "{name}: {r:?}");
        engine.arm(Fault::short_read(IO_ALIGN, 3));
        let r = file.get(&mut read);
        assert!(r[0].is_ok(), "{name}: {r:?}");
        assert_eq!(out, pages[1]);
    }
}

#[test]
fn discard_punches_the_slot_out_of_the_file() {
    let (_, engine, buffers) = engines().remove(0);
    let (dir, mut file) = file_with(engine, buffers, 4 << 20);
    let key = SessionKey::generate().unwrap();
    let slots = write_all(&mut file, &key, &[page_bytes(1, PAGE), page_bytes(2, PAGE)]);
    file.discard(slots[0]).unwrap();
    let raw = std::fs::read(dir.path().join("kvmm.flash")).unwrap();
    let range = slots[0].offset as usize..(slots[0].offset + slots[0].extent) as usize;
    assert!(raw[range].iter().all(|&b| b == 0), "the discarded slot reads as zeros");
    assert!(raw[slots[1].offset as usize..][..64].starts_with(b"KVMMSLT1"), "its neighbour is intact");
    assert_eq!(file.stats().pages, 1);
}

#[test]
fn published_counters_follow_every_call_and_are_read_while_the_file_is_held() {
    let (_, engine, buffers) = engines().remove(1);
    let (_dir, mut file) = file_with(engine, buffers, 4 << 20);
    let handle = file.stats_handle();
    assert_eq!(handle.get(), file.stats());
    let key = SessionKey::generate().unwrap();
    let slots = write_all(&mut file, &key, &[page_bytes(1, PAGE), page_bytes(2, PAGE), page_bytes(3, PAGE)]);
    assert_eq!((handle.get().pages, handle.get().used), (3, 3 * FlashFile::extent_for(PAGE)));
    let (_, results) = read_all(&mut file, &key, &slots[..2]);
    assert!(results.iter().all(Result::is_ok));
    assert_eq!(handle.get().pages_out, 2);
    file.free(slots[0]);
    file.discard(slots[1]).unwrap();
    assert_eq!(handle.get(), file.stats());
    assert_eq!((handle.get().pages, handle.get().used), (1, FlashFile::extent_for(PAGE)));
    // A reader of the counters does not wait for whoever holds the file (a write's whole I/O).
    let held = std::sync::Mutex::new(file);
    let _guard = held.lock().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = handle.clone();
    std::thread::spawn(move || tx.send(reader.get()).unwrap());
    let seen = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("the counters while the file is held");
    assert_eq!(seen.pages, 1);
}

#[derive(Clone, Debug)]
enum Op {
    Write(usize),
    Free(usize),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Slots are freed and reused at random; no (slot, counter) pair, hence no nonce, repeats.
    #[test]
    fn nonces_never_repeat_across_slot_reuse(ops in prop::collection::vec(prop_oneof![
        (1usize..4).prop_map(Op::Write),
        (0usize..16).prop_map(Op::Free),
    ], 1..60)) {
        let (_dir, mut file) = file_with(Arc::new(SyncEngine::new()), None, 12 * FlashFile::extent_for(4000));
        let key = SessionKey::generate().unwrap();
        let mut live: Vec<FlashSlot> = Vec::new();
        let mut seen: HashSet<(u32, u64)> = HashSet::new();
        let page = vec![5u8; 4000];
        for op in ops {
            match op {
                Op::Write(n) => {
                    let writes: Vec<PageWrite<'_>> = (0..n).map(|i| PageWrite { key: Some(&key), page: id(i as u32), bytes: &page }).collect();
                    for slot in file.put(&writes).into_iter().flatten() {
                        prop_assert!(seen.insert((slot.id(), slot.counter)), "nonce reused: {:?}", slot);
                        live.push(slot);
                    }
                }
                Op::Free(i) if !live.is_empty() => {
                    let slot = live.swap_remove(i % live.len());
                    file.free(slot);
                }
                Op::Free(_) => {}
            }
            prop_assert_eq!(file.stats().used, live.iter().map(|s| s.extent).sum::<u64>());
        }
    }
}

#[test]
fn the_suite_runs_on_both_real_engines() {
    let kinds: Vec<_> = engines().iter().map(|(_, e, _)| e.kind()).collect();
    assert_eq!(
        kinds,
        [crate::io::EngineKind::Sync, crate::io::EngineKind::IoUring],
        "io_uring must not fall back here"
    );
}
