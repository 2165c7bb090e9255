//! One suite for every tier below the device, against the `Tier` contract: the DRAM pool sealed and
//! unsealed, and the flash file on each I/O engine (pread/pwrite and io_uring with registered
//! buffers), on real files and real memory.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use kvmm_store::dram::DramPool;
use kvmm_store::flash::{FlashFile, RUN_BYTES};
use kvmm_store::io::{EngineChoice, EngineKind, IoBuffers, probe};
use kvmm_store::seal::SessionKey;
use kvmm_store::tier::{PageId, PageRead, PageWrite, Tier, TierError};

/// Page lengths of every shape a tier sees: tiny, unaligned, a q4 SmolLM2 page, an f16 one, a
/// Llama-3-8B f16 page.
const LENGTHS: [usize; 7] = [1, 63, 64, 4097, 7_744, 25_408, 131_136];

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

fn id(block: u32) -> PageId {
    PageId { session: 11, layer: block % 3, block }
}

/// Runs the whole suite on tiers made by `make(budget)`; `seals` says whether the tier seals.
fn suite<T: Tier, G>(name: &str, seals: bool, make: impl Fn(u64) -> (G, T)) {
    round_trip_in_any_order(name, &make);
    full_refuses_without_holding_anything(name, &make);
    wrong_length_and_missing_key_fail_alone(name, seals, &make);
    if seals {
        another_key_is_data_loss(name, &make);
    }
}

fn round_trip_in_any_order<T: Tier, G>(name: &str, make: &impl Fn(u64) -> (G, T)) {
    let (_guard, mut tier) = make(16 << 20);
    let key = SessionKey::generate().unwrap();
    let pages: Vec<Vec<u8>> = (0..28).map(|i| bytes(i, LENGTHS[i as usize % LENGTHS.len()])).collect();
    let mut slots = Vec::new();
    for chunk in pages.chunks(9).enumerate() {
        let writes: Vec<PageWrite<'_>> = chunk
            .1
            .iter()
            .enumerate()
            .map(|(k, b)| PageWrite { key: Some(&key), page: id((chunk.0 * 9 + k) as u32), bytes: b })
            .collect();
        for r in tier.put(&writes) {
            slots.push(r.unwrap_or_else(|e| panic!("{name}: {e}")));
        }
    }
    let stats = tier.stats();
    assert_eq!(stats.pages, 28, "{name}");
    assert_eq!(stats.pages_in, 28, "{name}");
    assert_eq!(stats.bytes_in, pages.iter().map(|p| p.len() as u64).sum::<u64>(), "{name}");
    assert!(stats.used >= stats.bytes_in && stats.used <= stats.budget, "{name}: {stats:?}");
    // Read back in reverse, every other page, then the rest.
    let order: Vec<usize> = (0..28).rev().step_by(2).chain((0..28).rev().skip(1).step_by(2)).collect();
    let mut outs: Vec<Vec<u8>> = order.iter().map(|&i| vec![0xcc; pages[i].len()]).collect();
    let mut reads: Vec<PageRead<'_, T::Slot>> = order
        .iter()
        .zip(outs.iter_mut())
        .map(|(&i, out)| PageRead { key: Some(&key), page: id(i as u32), slot: slots[i], out })
        .collect();
    for r in tier.get(&mut reads) {
        r.unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    drop(reads);
    for (&i, out) in order.iter().zip(&outs) {
        assert!(out == &pages[i], "{name}: page {i} came back different");
    }
    assert_eq!(tier.stats().pages_out, 28, "{name}");
    for (i, slot) in slots.into_iter().enumerate() {
        if i % 2 == 0 { tier.free(slot) } else { tier.discard(slot).unwrap() }
    }
    let stats = tier.stats();
    assert_eq!((stats.used, stats.pages), (0, 0), "{name}: every slot returned");
}

fn full_refuses_without_holding_anything<T: Tier, G>(name: &str, make: &impl Fn(u64) -> (G, T)) {
    let (_guard, mut tier) = make(256 * 1024);
    let key = SessionKey::generate().unwrap();
    let page = bytes(5, 25_408);
    let mut held = Vec::new();
    loop {
        let before = tier.stats().used;
        match tier.put(&[PageWrite { key: Some(&key), page: id(held.len() as u32), bytes: &page }]).remove(0) {
            Ok(slot) => held.push(slot),
            Err(e) => {
                assert!(matches!(e, TierError::Full { .. }), "{name}: {e}");
                assert!(e.to_string().contains("raise the"), "{name}: the message says what to do: {e}");
                assert_eq!(tier.stats().used, before, "{name}: a refused page holds nothing");
                break;
            }
        }
        assert!(held.len() < 100, "{name}: the budget is never reached");
    }
    assert!(held.len() >= 8, "{name}: 256 KiB holds at least 8 pages of 28 KiB, got {}", held.len());
    tier.free(held.pop().unwrap());
    assert!(
        tier.put(&[PageWrite { key: Some(&key), page: id(99), bytes: &page }]).remove(0).is_ok(),
        "{name}: freed room is reused"
    );
}

fn wrong_length_and_missing_key_fail_alone<T: Tier, G>(name: &str, seals: bool, make: &impl Fn(u64) -> (G, T)) {
    let (_guard, mut tier) = make(1 << 20);
    let key = SessionKey::generate().unwrap();
    let (a, b) = (bytes(1, 5000), bytes(2, 5000));
    let slots: Vec<T::Slot> = tier
        .put(&[
            PageWrite { key: Some(&key), page: id(0), bytes: &a },
            PageWrite { key: Some(&key), page: id(1), bytes: &b },
        ])
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let (mut short, mut good) = (vec![0u8; 4999], vec![0u8; 5000]);
    let mut reads = [
        PageRead { key: Some(&key), page: id(0), slot: slots[0], out: &mut short },
        PageRead { key: Some(&key), page: id(1), slot: slots[1], out: &mut good },
    ];
    let results = tier.get(&mut reads);
    assert!(matches!(results[0], Err(TierError::BufferLength { got: 4999, len: 5000 })), "{name}: {results:?}");
    assert!(results[1].is_ok(), "{name}");
    assert_eq!(good, b);
    let keyless = tier.put(&[PageWrite { key: None, page: id(2), bytes: &a }]).remove(0);
    if seals {
        assert!(matches!(keyless, Err(TierError::NoKey { .. })), "{name}: {keyless:?}");
    } else {
        assert!(keyless.is_ok(), "{name}: {keyless:?}");
    }
}

fn another_key_is_data_loss<T: Tier, G>(name: &str, make: &impl Fn(u64) -> (G, T)) {
    let (_guard, mut tier) = make(1 << 20);
    let (key, other) = (SessionKey::generate().unwrap(), SessionKey::generate().unwrap());
    let page = bytes(3, 9000);
    let slot = tier.put(&[PageWrite { key: Some(&key), page: id(0), bytes: &page }]).remove(0).unwrap();
    let mut out = vec![0x77u8; 9000];
    let r = tier.get(&mut [PageRead { key: Some(&other), page: id(0), slot, out: &mut out }]).remove(0);
    assert!(r.as_ref().is_err_and(TierError::is_data_loss), "{name}: {r:?}");
    assert!(out.iter().all(|&x| x == 0), "{name}: a failed page comes back as zeros");
    // The page itself is intact for its own key, and asking for it as another page fails.
    let r = tier.get(&mut [PageRead { key: Some(&key), page: id(1), slot, out: &mut out }]).remove(0);
    assert!(r.as_ref().is_err_and(TierError::is_data_loss), "{name}: {r:?}");
    assert!(tier.get(&mut [PageRead { key: Some(&key), page: id(0), slot, out: &mut out }]).remove(0).is_ok());
    assert_eq!(out, page);
    assert_eq!(tier.stats().auth_failures, 2, "{name}");
}

#[test]
fn dram_pool_sealed() {
    suite("dram sealed", true, |budget| ((), DramPool::new(budget, true).unwrap()));
}

#[test]
fn dram_pool_unsealed() {
    suite("dram", false, |budget| ((), DramPool::new(budget, false).unwrap()));
}

fn flash(choice: EngineChoice, kind: EngineKind) -> impl Fn(u64) -> (tempfile::TempDir, FlashFile) {
    move |budget| {
        let buffers = IoBuffers::new(RUN_BYTES, 4).unwrap();
        let probed = probe(choice, 64, Some(Arc::clone(&buffers))).unwrap();
        assert_eq!(probed.engine.kind(), kind, "fallback: {:?}", probed.fallback);
        let dir = tempfile::tempdir().unwrap();
        let file = FlashFile::create(&dir.path().join("kvmm.flash"), budget, probed.engine, Some(buffers)).unwrap();
        (dir, file)
    }
}

#[test]
fn flash_file_on_pread() {
    suite("flash/pread", true, flash(EngineChoice::Sync, EngineKind::Sync));
}

#[test]
fn flash_file_on_io_uring() {
    suite("flash/io_uring", true, flash(EngineChoice::IoUring, EngineKind::IoUring));
}
