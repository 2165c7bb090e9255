//! GPT-2's byte-level alphabet: a bijection between the 256 byte values and 256 printable
//! characters, so that a byte-level BPE vocabulary can be stored as text.
//!
//! The 188 bytes that are printable in Latin-1 map to the character with the same code:
//! `0x21..=0x7E` (`!`..`~`), `0xA1..=0xAC` and `0xAE..=0xFF`. The other 68 — `0x00..=0x20`
//! (controls and space), `0x7F..=0xA0` and `0xAD` (soft hyphen) — map, in increasing byte order, to
//! `U+0100`, `U+0101`, ... `U+0143`. So a space is `Ġ` (U+0120), a newline `Ċ` (U+010A), and the
//! token `"Ġworld"` is the bytes `" world"`.

/// Bytes that map to themselves.
const fn printable(b: u8) -> bool {
    matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff)
}

/// Number of bytes that do not map to themselves.
const SHIFTED: usize = 68;

/// The character of each byte.
static BYTE_TO_CHAR: [char; 256] = {
    let mut table = ['\0'; 256];
    let mut shifted = 0u32;
    let mut b = 0;
    while b < 256 {
        table[b] = if printable(b as u8) {
            b as u8 as char
        } else {
            let c = match char::from_u32(256 + shifted) {
                Some(c) => c,
                None => panic!("U+0100..U+0143 are characters"),
            };
            shifted += 1;
            c
        };
        b += 1;
    }
    table
};

/// The byte of each character `U+0100 + i`.
static SHIFTED_TO_BYTE: [u8; SHIFTED] = {
    let mut table = [0u8; SHIFTED];
    let mut i = 0;
    let mut b = 0;
    while b < 256 {
        if !printable(b as u8) {
            table[i] = b as u8;
            i += 1;
        }
        b += 1;
    }
    table
};

/// The character that stands for byte `b`.
pub fn byte_to_char(b: u8) -> char {
    BYTE_TO_CHAR[usize::from(b)]
}

/// The byte that `c` stands for, if `c` is in the alphabet.
pub fn char_to_byte(c: char) -> Option<u8> {
    let code = u32::from(c);
    match code {
        0..=255 if printable(code as u8) => Some(code as u8),
        256.. => SHIFTED_TO_BYTE.get((code - 256) as usize).copied(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_round_trips_and_the_alphabet_has_256_characters() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b);
            assert_eq!(char_to_byte(c), Some(b));
            assert!(seen.insert(c));
        }
        assert_eq!((byte_to_char(b' '), byte_to_char(b'\n'), byte_to_char(b'a')), ('Ġ', 'Ċ', 'a'));
        assert_eq!((byte_to_char(0), byte_to_char(0xad), byte_to_char(0xff)), ('\u{100}', '\u{143}', 'ÿ'));
    }

    #[test]
    fn characters_outside_the_alphabet_have_no_byte() {
        for c in [' ', '\n', '\u{7f}', '\u{ad}', '\u{144}', '€'] {
            assert_eq!(char_to_byte(c), None, "{c:?}");
        }
    }
}
