//! Flash slot records over arbitrary bytes. The flash file lives on a disk that anything with write
//! access to it (another root process, a failing drive, an offline edit) can change under kvmmd, so
//! the daemon trusts none of a slot's bytes. Two things must hold:
//!
//! - **The codecs are total and canonical.** The record header and the seal's AAD decode any bytes
//!   to a value or a rejection, never a panic, and whatever decodes re-encodes to the same bytes (so
//!   no two byte strings are read as one record).
//! - **The read path returns the written page or nothing.** A page is written through the real
//!   [`FlashFile`] (pread/pwrite engine, a session key), its slot is changed on disk as the input
//!   says (patched bytes, an overwritten span, a replaced header or body), and it is read back,
//!   possibly as another page. The read succeeds exactly when the header and ciphertext are as
//!   written and the page is the one asked for, and then gives the written bytes; otherwise it is
//!   `DataLoss` with the buffer zeroed. The zero padding after the ciphertext is not part of the
//!   record, so changing it changes nothing.

#![no_main]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use kvmm_store::flash::{FlashFile, FlashSlot, RECORD_HEADER, reencode_record_header};
use kvmm_store::io::SyncEngine;
use kvmm_store::seal::{AAD_LEN, AAD_VERSION, PageAad, SessionKey};
use kvmm_store::tier::{PageId, PageRead, PageWrite, Tier, TierError};
use libfuzzer_sys::fuzz_target;

/// The magic and version a record header opens with (the layout in `kvmm_store::flash`).
const RECORD_PREFIX: &[u8; 9] = b"KVMMSLT1\x01";
/// The page every input writes.
const PAGE: PageId = PageId { session: 0x5e55_1011, layer: 7, block: 42 };
/// The longest page written: two 4 KiB blocks with the header.
const MAX_PAGE: usize = 2 * 4096 - RECORD_HEADER;

/// One flash file for the whole run, with a second descriptor that writes under it.
struct Flash {
    file: FlashFile,
    /// The same file opened without O_DIRECT: the input's changes go through it, as an outside
    /// writer's would.
    raw: File,
    key: SessionKey,
}

fn flash() -> &'static Mutex<Flash> {
    static FLASH: OnceLock<Mutex<Flash>> = OnceLock::new();
    FLASH.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory for the flash file");
        let path = dir.path().join("kvmm.flash");
        let file = FlashFile::create(&path, 1 << 20, Arc::new(SyncEngine::new()), None)
            .expect("a 1 MiB flash file in a temporary directory");
        let raw = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("the flash file reopens");
        // Both descriptors stay valid; removing the directory now leaves nothing behind when the
        // fuzzer exits without running destructors.
        dir.close().expect("the temporary directory is removed");
        let key = SessionKey::generate().expect("a session key");
        Mutex::new(Flash { file, raw, key })
    })
}

/// Decoders alone, on the input as it is and behind a valid prefix (so the fields are reached).
fn codecs(data: &[u8]) {
    for bytes in [data.to_vec(), [RECORD_PREFIX.as_slice(), data].concat()] {
        if let Some(again) = reencode_record_header(&bytes) {
            assert_eq!(again.as_slice(), &bytes[..RECORD_HEADER], "an accepted record header is canonical");
        }
    }
    for bytes in [data, &[&[AAD_VERSION], data].concat()] {
        for len in [bytes.len(), AAD_LEN.min(bytes.len())] {
            if let Ok(aad) = PageAad::decode(&bytes[..len]) {
                assert_eq!(aad.encode().as_slice(), &bytes[..len], "an accepted AAD is canonical");
            }
        }
    }
}

/// How the input changes the slot on disk.
fn tamper(mode: u8, rest: &[u8], record: &mut [u8]) {
    let extent = record.len();
    match mode % 4 {
        // Byte patches: (offset, value) triples.
        0 => {
            for patch in rest.chunks_exact(3) {
                let at = usize::from(u16::from_le_bytes([patch[0], patch[1]])) % extent;
                record[at] = patch[2];
            }
        }
        // One span overwritten at an offset.
        1 => {
            if let [lo, hi, bytes @ ..] = rest {
                let at = usize::from(u16::from_le_bytes([*lo, *hi])) % extent;
                let n = bytes.len().min(extent - at);
                record[at..at + n].copy_from_slice(&bytes[..n]);
            }
        }
        // The header replaced (what a stale or foreign record looks like).
        2 => {
            let n = rest.len().min(RECORD_HEADER);
            record[..n].copy_from_slice(&rest[..n]);
        }
        // The body replaced.
        _ => {
            let n = rest.len().min(extent - RECORD_HEADER);
            record[RECORD_HEADER..RECORD_HEADER + n].copy_from_slice(&rest[..n]);
        }
    }
}

/// Writes a page, changes its slot as the input says, and reads it back.
fn read_path(data: &[u8]) {
    let [lo, hi, mode, rest @ ..] = data else { return };
    let len = 1 + usize::from(u16::from_le_bytes([*lo, *hi])) % MAX_PAGE;
    let page: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(*mode)).collect();
    // Bit 2: read it as another page (a neighbouring block), which must always fail.
    let asked = if mode & 4 == 0 { PAGE } else { PageId { block: PAGE.block + 1, ..PAGE } };

    let mut flash = flash().lock().unwrap_or_else(PoisonError::into_inner);
    let Flash { file, raw, key } = &mut *flash;
    let write = PageWrite { key: Some(key), page: PAGE, bytes: &page };
    let slot: FlashSlot = file.put(&[write]).remove(0).expect("one page fits in an empty 1 MiB file");
    let mut record = vec![0u8; slot.extent as usize];
    raw.read_exact_at(&mut record, slot.offset).expect("the slot reads back");
    let written = record.clone();
    tamper(*mode >> 3, rest, &mut record);
    raw.write_all_at(&record, slot.offset).expect("the slot is overwritten");

    let mut out = vec![0xEE; len];
    let result = file.get(&mut [PageRead { key: Some(key), page: asked, slot, out: &mut out }]).remove(0);
    let authentic = record[..RECORD_HEADER + len] == written[..RECORD_HEADER + len] && asked == PAGE;
    if authentic {
        assert!(result.is_ok(), "an unchanged record of the page asked for reads back: {result:?}");
        assert!(out == page, "a read that succeeds gives the bytes written");
    } else {
        assert!(
            matches!(result, Err(TierError::DataLoss { .. })),
            "a changed or foreign record is data loss: {result:?}"
        );
        assert!(out.iter().all(|&b| b == 0), "a failed read returns no bytes");
    }
    file.free(slot);
}

fuzz_target!(|data: &[u8]| {
    codecs(data);
    read_path(data);
});
