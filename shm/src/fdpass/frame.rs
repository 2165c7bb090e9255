//! The two frames of the fd-passing socket: the client's request and the daemon's reply.
//!
//! Each frame is one `SOCK_SEQPACKET` message; all integers are little-endian. Decoding rejects
//! anything that is not exactly a frame of this version (length, magic, version, reserved bytes,
//! kind, message length and encoding) with a sentence saying what was wrong.
//!
//! ```text
//!  FdRequest, client → daemon, 48 bytes, no fds
//!  +--------------+-------------+--------------+---------------------+-----------------------+
//!  | 0 magic u32  | 4 version   | 6 reserved   | 8 session_id u64    | 16 token [u8; 32]     |
//!  |   "KVFD"     |   u16 = 1   |   u16 = 0    |                     |    (from Attach)      |
//!  +--------------+-------------+--------------+---------------------+-----------------------+
//!
//!  FdReply, daemon → client
//!  +--------------+-------------+-----------+------------+
//!  | 0 magic u32  | 4 version   | 6 kind u8 | 7 reserved |   kind 1 = granted, 2 = refused
//!  |   "KVFR"     |   u16 = 1   |           |   u8 = 0   |
//!  +--------------+-------------+-----------+------------+
//!  granted, 32 bytes, sent with exactly 3 fds (SCM_RIGHTS): arena, session table, client region
//!  | 8 arena_bytes u64 | 16 table_bytes u64 | 24 client_region_bytes u64 |
//!  refused, 16 + n bytes, no fds
//!  | 8 code u32 (gRPC status code) | 12 message_len u32 = n ≤ 1024 | 16 message [u8; n] UTF-8 |
//! ```

use std::fmt;

use crate::error::ShmError;

/// `magic` of a request: `"KVFD"` as a little-endian u32.
pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"KVFD");
/// `magic` of a reply: `"KVFR"` as a little-endian u32.
pub const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"KVFR");
/// Version of both frames.
pub const FRAME_VERSION: u16 = 1;
/// Size of an encoded [`FdRequest`].
pub const REQUEST_BYTES: usize = 48;
/// Size of an encoded granted [`FdReply`].
pub const GRANTED_BYTES: usize = 32;
/// Size of a refused [`FdReply`] before its message.
pub const REFUSED_HEADER_BYTES: usize = 16;
/// Longest message of a refused [`FdReply`], in bytes.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Largest frame of either kind; a receive buffer of this size never truncates a valid frame.
pub const MAX_FRAME_BYTES: usize = REFUSED_HEADER_BYTES + MAX_MESSAGE_BYTES;
/// Fds sent with a granted reply.
pub const GRANTED_FDS: usize = 3;

const KIND_GRANTED: u8 = 1;
const KIND_REFUSED: u8 = 2;

/// The client's request for a session's memfds.
#[derive(Clone, PartialEq, Eq)]
pub struct FdRequest {
    /// The session the token was issued for.
    pub session_id: u64,
    /// The one-time token from `Attach`.
    pub token: [u8; 32],
}

impl FdRequest {
    /// The 48-byte wire form.
    pub fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut out = [0u8; REQUEST_BYTES];
        out[0..4].copy_from_slice(&REQUEST_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&FRAME_VERSION.to_le_bytes());
        out[8..16].copy_from_slice(&self.session_id.to_le_bytes());
        out[16..48].copy_from_slice(&self.token);
        out
    }

    /// Parses a received request.
    pub fn decode(bytes: &[u8]) -> Result<FdRequest, ShmError> {
        const FRAME: &str = "fd request";
        if bytes.len() != REQUEST_BYTES {
            return Err(ShmError::malformed(
                FRAME,
                format!("it is {} bytes long, but a request is exactly {REQUEST_BYTES}", bytes.len()),
            ));
        }
        check_magic_version(FRAME, bytes, REQUEST_MAGIC)?;
        let reserved = u16_at(bytes, 6);
        if reserved != 0 {
            return Err(ShmError::malformed(FRAME, format!("its reserved field is {reserved}, but must be 0")));
        }
        let mut token = [0u8; 32];
        token.copy_from_slice(&bytes[16..48]);
        Ok(FdRequest { session_id: u64_at(bytes, 8), token })
    }
}

impl fmt::Debug for FdRequest {
    /// The token is a credential and is never printed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FdRequest").field("session_id", &self.session_id).field("token", &"<redacted>").finish()
    }
}

/// The daemon's answer to an [`FdRequest`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FdReply {
    /// The memfds follow as SCM_RIGHTS, in the order arena, session table, client region; each size
    /// lets the client check it got the files it expected.
    Granted {
        /// Bytes of the arena memfd.
        arena_bytes: u64,
        /// Bytes of the session-table memfd.
        table_bytes: u64,
        /// Bytes of the client-region memfd.
        client_region_bytes: u64,
    },
    /// The request was refused.
    Refused {
        /// A gRPC status code number (e.g. 7 = PERMISSION_DENIED).
        code: u32,
        /// A sentence for the person running the client; at most [`MAX_MESSAGE_BYTES`] bytes.
        message: String,
    },
}

impl FdReply {
    /// A refusal; `message` is cut to [`MAX_MESSAGE_BYTES`] bytes at a character boundary.
    pub fn refused(code: u32, message: impl Into<String>) -> FdReply {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE_BYTES {
            let mut cut = MAX_MESSAGE_BYTES;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        FdReply::Refused { code, message }
    }

    /// The number of fds that must accompany this reply.
    pub fn fd_count(&self) -> usize {
        match self {
            FdReply::Granted { .. } => GRANTED_FDS,
            FdReply::Refused { .. } => 0,
        }
    }

    /// The wire form. Fails only for a refusal whose message is longer than
    /// [`MAX_MESSAGE_BYTES`] (build refusals with [`FdReply::refused`] to avoid that).
    pub fn encode(&self) -> Result<Vec<u8>, ShmError> {
        let mut out = Vec::with_capacity(GRANTED_BYTES);
        out.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
        out.extend_from_slice(&FRAME_VERSION.to_le_bytes());
        match self {
            FdReply::Granted { arena_bytes, table_bytes, client_region_bytes } => {
                out.extend_from_slice(&[KIND_GRANTED, 0]);
                out.extend_from_slice(&arena_bytes.to_le_bytes());
                out.extend_from_slice(&table_bytes.to_le_bytes());
                out.extend_from_slice(&client_region_bytes.to_le_bytes());
            }
            FdReply::Refused { code, message } => {
                if message.len() > MAX_MESSAGE_BYTES {
                    return Err(ShmError::malformed(
                        "fd reply",
                        format!(
                            "its message is {} bytes, more than the {MAX_MESSAGE_BYTES} a frame \
                             carries; build it with FdReply::refused",
                            message.len()
                        ),
                    ));
                }
                out.extend_from_slice(&[KIND_REFUSED, 0]);
                out.extend_from_slice(&code.to_le_bytes());
                out.extend_from_slice(&(message.len() as u32).to_le_bytes());
                out.extend_from_slice(message.as_bytes());
            }
        }
        Ok(out)
    }

    /// Parses a received reply (the fds are checked by the caller against [`FdReply::fd_count`]).
    pub fn decode(bytes: &[u8]) -> Result<FdReply, ShmError> {
        const FRAME: &str = "fd reply";
        if bytes.len() < 8 {
            return Err(ShmError::malformed(
                FRAME,
                format!("it is {} bytes long, shorter than the 8-byte frame header", bytes.len()),
            ));
        }
        check_magic_version(FRAME, bytes, REPLY_MAGIC)?;
        if bytes[7] != 0 {
            return Err(ShmError::malformed(FRAME, format!("its reserved byte is {}, but must be 0", bytes[7])));
        }
        match bytes[6] {
            KIND_GRANTED => {
                if bytes.len() != GRANTED_BYTES {
                    return Err(ShmError::malformed(
                        FRAME,
                        format!("a granted reply is exactly {GRANTED_BYTES} bytes, but this one is {}", bytes.len()),
                    ));
                }
                Ok(FdReply::Granted {
                    arena_bytes: u64_at(bytes, 8),
                    table_bytes: u64_at(bytes, 16),
                    client_region_bytes: u64_at(bytes, 24),
                })
            }
            KIND_REFUSED => {
                if bytes.len() < REFUSED_HEADER_BYTES {
                    return Err(ShmError::malformed(
                        FRAME,
                        format!(
                            "a refused reply is at least {REFUSED_HEADER_BYTES} bytes, but this \
                             one is {}",
                            bytes.len()
                        ),
                    ));
                }
                let code = u32_at(bytes, 8);
                let len = u32_at(bytes, 12) as usize;
                if len > MAX_MESSAGE_BYTES {
                    return Err(ShmError::malformed(
                        FRAME,
                        format!("its message length is {len}, more than the {MAX_MESSAGE_BYTES} allowed"),
                    ));
                }
                if bytes.len() != REFUSED_HEADER_BYTES + len {
                    return Err(ShmError::malformed(
                        FRAME,
                        format!("it announces a {len}-byte message but carries {}", bytes.len() - REFUSED_HEADER_BYTES),
                    ));
                }
                let message = std::str::from_utf8(&bytes[REFUSED_HEADER_BYTES..])
                    .map_err(|_| ShmError::malformed(FRAME, "its message is not valid UTF-8"))?;
                Ok(FdReply::Refused { code, message: message.to_owned() })
            }
            kind => Err(ShmError::malformed(
                FRAME,
                format!("its kind is {kind}, but must be {KIND_GRANTED} (granted) or {KIND_REFUSED} (refused)"),
            )),
        }
    }
}

fn check_magic_version(frame: &'static str, bytes: &[u8], magic: u32) -> Result<(), ShmError> {
    let found = u32_at(bytes, 0);
    if found != magic {
        return Err(ShmError::malformed(
            frame,
            format!(
                "its magic is {:?}, not {:?}; the peer is not speaking the kvmm fd protocol",
                String::from_utf8_lossy(&found.to_le_bytes()),
                String::from_utf8_lossy(&magic.to_le_bytes()),
            ),
        ));
    }
    let version = u16_at(bytes, 4);
    if version != FRAME_VERSION {
        return Err(ShmError::malformed(
            frame,
            format!(
                "its version is {version}, but this build speaks version {FRAME_VERSION}; upgrade \
                 the client and daemon together"
            ),
        ));
    }
    Ok(())
}

/// The little-endian u16 at `at`; callers have checked the length.
fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// The little-endian u32 at `at`; callers have checked the length.
fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// The little-endian u64 at `at`; callers have checked the length.
fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(err: Result<impl fmt::Debug, ShmError>) -> String {
        match err {
            Err(ShmError::Malformed { reason, .. }) => reason,
            other => panic!("expected a malformed-frame error, got {other:?}"),
        }
    }

    fn request() -> FdRequest {
        FdRequest { session_id: 0x0102_0304_0506_0708, token: [0xab; 32] }
    }

    #[test]
    fn request_has_the_documented_bytes_and_round_trips() -> Result<(), ShmError> {
        let bytes = request().encode();
        assert_eq!(&bytes[0..4], b"KVFD");
        assert_eq!(&bytes[4..8], &[1, 0, 0, 0]);
        assert_eq!(&bytes[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(FdRequest::decode(&bytes)?, request());
        Ok(())
    }

    #[test]
    fn request_debug_never_shows_the_token() {
        let shown = format!("{:?}", request());
        assert!(!shown.contains("171") && !shown.contains("ab"), "{shown}");
        assert!(shown.contains("redacted"));
    }

    #[test]
    fn malformed_requests_are_rejected_with_a_reason() {
        let good = request().encode();
        assert!(reason(FdRequest::decode(&good[..47])).contains("47 bytes long"));
        let mut long = good.to_vec();
        long.push(0);
        assert!(reason(FdRequest::decode(&long)).contains("exactly 48"));
        let mut bad = good;
        bad[0] = b'X';
        assert!(reason(FdRequest::decode(&bad)).contains("magic"));
        let mut bad = good;
        bad[4] = 2;
        assert!(reason(FdRequest::decode(&bad)).contains("version is 2"));
        let mut bad = good;
        bad[6] = 1;
        assert!(reason(FdRequest::decode(&bad)).contains("reserved"));
    }

    #[test]
    fn replies_round_trip() -> Result<(), ShmError> {
        for reply in [
            FdReply::Granted { arena_bytes: 1 << 40, table_bytes: 4224, client_region_bytes: 2112 },
            FdReply::refused(7, "token was issued to another process"),
            FdReply::refused(16, ""),
        ] {
            let bytes = reply.encode()?;
            assert_eq!(&bytes[0..4], b"KVFR");
            assert_eq!(FdReply::decode(&bytes)?, reply);
        }
        assert_eq!(
            FdReply::Granted { arena_bytes: 0, table_bytes: 0, client_region_bytes: 0 }.encode()?.len(),
            GRANTED_BYTES
        );
        Ok(())
    }

    #[test]
    fn long_refusals_are_cut_at_a_character_boundary() -> Result<(), ShmError> {
        let reply = FdReply::refused(3, "é".repeat(600));
        let FdReply::Refused { message, .. } = &reply else {
            panic!("refused builds a refusal");
        };
        assert_eq!(message.len(), 1024);
        assert_eq!(FdReply::decode(&reply.encode()?)?, reply);
        let too_long = FdReply::Refused { code: 3, message: "x".repeat(1025) };
        assert!(reason(too_long.encode()).contains("1025 bytes"));
        Ok(())
    }

    #[test]
    fn malformed_replies_are_rejected_with_a_reason() -> Result<(), ShmError> {
        let granted = FdReply::Granted { arena_bytes: 1, table_bytes: 2, client_region_bytes: 3 }.encode()?;
        assert!(reason(FdReply::decode(&granted[..7])).contains("8-byte frame header"));
        assert!(reason(FdReply::decode(&granted[..31])).contains("exactly 32"));
        let mut bad = granted.clone();
        bad[6] = 9;
        assert!(reason(FdReply::decode(&bad)).contains("kind is 9"));
        let mut bad = granted.clone();
        bad[7] = 1;
        assert!(reason(FdReply::decode(&bad)).contains("reserved byte"));
        let mut bad = granted;
        bad[0..4].copy_from_slice(b"KVFD");
        assert!(reason(FdReply::decode(&bad)).contains("magic"));

        let refused = FdReply::refused(5, "no such session").encode()?;
        assert!(reason(FdReply::decode(&refused[..15])).contains("at least 16"));
        assert!(reason(FdReply::decode(&refused[..20])).contains("15-byte message but carries 4"));
        let mut bad = refused.clone();
        bad[12..16].copy_from_slice(&2000u32.to_le_bytes());
        assert!(reason(FdReply::decode(&bad)).contains("2000"));
        let mut bad = refused;
        bad[16] = 0xff;
        assert!(reason(FdReply::decode(&bad)).contains("UTF-8"));
        Ok(())
    }
}
