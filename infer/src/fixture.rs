//! The KV fixture format (`.kvfx`): a [`KvTrace`] on disk, for kernel and page-format tests that
//! want real queries, keys and values rather than random ones.
//!
//! All fields little-endian. `L` = layers, `T` = positions, `Hq` = heads, `Hkv` = kv_heads,
//! `D` = head_dim.
//!
//! ```text
//!  offset  bytes  field
//!  0       4      magic "KVFX"
//!  4       4      version: u32 = 1
//!  8       4      dim            u32 ┐
//!  12      4      hidden_dim     u32 │
//!  16      4      layers (L)     u32 │
//!  20      4      heads (Hq)     u32 │ the model's ModelConfig
//!  24      4      kv_heads (Hkv) u32 │
//!  28      4      head_dim (D)   u32 │
//!  32      4      vocab_size     u32 │
//!  36      4      seq_len        u32 │
//!  40      4      rope_theta     f32 │
//!  44      4      norm_eps       f32 ┘
//!  48      4      T: u32, positions (1..=seq_len)
//!  52      4      reserved: u32 = 0
//!  56      4·T    token ids: u32[T], the token fed at each position
//!  56+4T          layer 0: q f32[T][Hq][D]  (post-RoPE queries)
//!                          k f32[T][Hkv][D] (post-RoPE keys, exactly as cached)
//!                          v f32[T][Hkv][D] (values)
//!                 layer 1 .. layer L-1, the same
//!  end            56 + 4·T + 4·L·T·(Hq + 2·Hkv)·D, exactly
//! ```
//!
//! [`decode`] rejects a wrong magic or version, a nonzero reserved word, an unsupported
//! configuration, a size that differs from the formula by even one byte, token ids outside the
//! vocabulary and non-finite floats, each with a sentence saying which.

use std::path::Path;

use crate::config::ModelConfig;
use crate::cursor::{Cursor, first_non_finite};
use crate::error::InferError;
use crate::trace::{KvTrace, LayerTrace};

/// The first four bytes of every fixture.
pub const MAGIC: [u8; 4] = *b"KVFX";
/// The format version this module writes and reads.
pub const VERSION: u32 = 1;
/// Bytes before the token ids.
pub const HEADER_BYTES: usize = 56;

/// The exact size of a fixture for `config` and `positions`, or `None` on overflow.
pub fn encoded_len(config: &ModelConfig, positions: usize) -> Option<usize> {
    let per_position = config.q_dim().checked_add(config.kv_dim().checked_mul(2)?)?;
    let floats = per_position.checked_mul(positions)?.checked_mul(config.layers)?;
    HEADER_BYTES.checked_add(positions.checked_mul(4)?)?.checked_add(floats.checked_mul(4)?)
}

/// Serializes `trace`. Fails if the trace breaks its own invariant.
pub fn encode(trace: &KvTrace) -> Result<Vec<u8>, InferError> {
    trace.validate().map_err(|reason| InferError::InvalidArgument(format!("the trace cannot be written: {reason}")))?;
    let c = &trace.config;
    let len = encoded_len(c, trace.positions()).expect("validate bounds every size far below overflow");
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&MAGIC);
    let words = [
        VERSION,
        c.dim as u32,
        c.hidden_dim as u32,
        c.layers as u32,
        c.heads as u32,
        c.kv_heads as u32,
        c.head_dim as u32,
        c.vocab_size as u32,
        c.seq_len as u32,
        c.rope_theta.to_bits(),
        c.norm_eps.to_bits(),
        trace.positions() as u32,
        0,
    ];
    for w in words.iter().chain(&trace.tokens) {
        out.extend_from_slice(&w.to_le_bytes());
    }
    for layer in &trace.layers {
        for x in layer.q.iter().chain(&layer.k).chain(&layer.v) {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    debug_assert_eq!(out.len(), len, "the layout diagram and the writer agree");
    Ok(out)
}

/// Writes `trace` to `path`.
pub fn write(path: &Path, trace: &KvTrace) -> Result<(), InferError> {
    let bytes = encode(trace)?;
    std::fs::write(path, bytes).map_err(|source| InferError::Write { path: path.to_owned(), source })
}

/// Reads and validates the fixture at `path`.
pub fn read(path: &Path) -> Result<KvTrace, InferError> {
    let bytes = std::fs::read(path).map_err(|source| InferError::Io { path: path.to_owned(), source })?;
    parse(&bytes).map_err(|reason| InferError::Fixture { origin: path.display().to_string(), reason })
}

/// Parses and validates fixture bytes.
pub fn decode(bytes: &[u8]) -> Result<KvTrace, InferError> {
    parse(bytes).map_err(|reason| InferError::Fixture { origin: "the buffer".to_owned(), reason })
}

fn parse(bytes: &[u8]) -> Result<KvTrace, String> {
    if bytes.len() < HEADER_BYTES {
        return Err(format!("it is {} bytes long, shorter than the {HEADER_BYTES}-byte header", bytes.len()));
    }
    if bytes[..4] != MAGIC {
        return Err(format!("it starts with {:?}, not the magic \"KVFX\"", String::from_utf8_lossy(&bytes[..4])));
    }
    let word = |i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4-byte slice"));
    let version = word(1);
    if version != VERSION {
        return Err(format!("it is format version {version}, but this reader knows only version {VERSION}"));
    }
    let size = |i: usize| word(i) as usize;
    let config = ModelConfig {
        dim: size(2),
        hidden_dim: size(3),
        layers: size(4),
        heads: size(5),
        kv_heads: size(6),
        head_dim: size(7),
        vocab_size: size(8),
        seq_len: size(9),
        rope_theta: f32::from_bits(word(10)),
        norm_eps: f32::from_bits(word(11)),
    };
    config.validate().map_err(|e| format!("its header holds an unsupported configuration ({e})"))?;
    let positions = size(12);
    if positions == 0 || positions > config.seq_len {
        return Err(format!("it claims {positions} positions, but a fixture holds 1..={} (seq_len)", config.seq_len));
    }
    if word(13) != 0 {
        return Err(format!("its reserved header word is {:#x}, but version {VERSION} requires 0", word(13)));
    }
    let expected = encoded_len(&config, positions).ok_or("its header describes a size that overflows")?;
    if bytes.len() != expected {
        return Err(format!(
            "it is {} bytes long, but its header (L={} T={positions} Hq={} Hkv={} D={}) implies {expected} bytes; \
             the file is truncated or padded",
            bytes.len(),
            config.layers,
            config.heads,
            config.kv_heads,
            config.head_dim
        ));
    }

    let mut r = Cursor::at(bytes, HEADER_BYTES);
    let tokens = r.u32s(positions).expect("the total size was checked above");
    let mut layers = Vec::with_capacity(config.layers);
    for l in 0..config.layers {
        let mut read = |name: &str, width: usize| {
            let offset = r.offset();
            let values = r.f32s(positions * width).expect("the total size was checked above");
            match first_non_finite(&values) {
                Some((i, value)) => Err(format!(
                    "layer {l} {name} holds the non-finite value {value} at element {i} (byte offset {})",
                    offset + 4 * i
                )),
                None => Ok(values),
            }
        };
        let q = read("q", config.q_dim())?;
        let k = read("k", config.kv_dim())?;
        let v = read("v", config.kv_dim())?;
        layers.push(LayerTrace { q, k, v });
    }
    let trace = KvTrace { config, tokens, layers };
    trace.validate()?;
    Ok(trace)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> KvTrace {
        let config = ModelConfig {
            dim: 8,
            hidden_dim: 6,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            vocab_size: 10,
            seq_len: 16,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
        };
        let t = 3;
        let ramp = |n: usize, base: f32| (0..n).map(|i| base + i as f32 * 0.25).collect::<Vec<f32>>();
        let layers = (0..2)
            .map(|l| LayerTrace {
                q: ramp(t * 8, l as f32),
                k: ramp(t * 4, 10.0 + l as f32),
                v: ramp(t * 4, -10.0 - l as f32),
            })
            .collect();
        KvTrace { config, tokens: vec![1, 7, 9], layers }
    }

    fn error(bytes: &[u8]) -> String {
        decode(bytes).unwrap_err().to_string()
    }

    #[test]
    fn a_trace_round_trips_and_has_the_documented_size() {
        let trace = small();
        let bytes = encode(&trace).unwrap();
        // 56 + 4·3 + 4·2·3·(2 + 2·1)·4
        assert_eq!(bytes.len(), 56 + 12 + 384);
        assert_eq!(&bytes[..4], b"KVFX");
        assert_eq!(bytes[56..60], 1u32.to_le_bytes());
        // Layer 0's q starts right after the tokens.
        assert_eq!(bytes[68..72], 0f32.to_le_bytes());
        assert_eq!(decode(&bytes).unwrap(), trace);
    }

    #[test]
    fn a_wrong_magic_is_rejected() {
        let mut bytes = encode(&small()).unwrap();
        bytes[..4].copy_from_slice(b"GGUF");
        let msg = error(&bytes);
        assert!(msg.starts_with("the buffer is not a valid KV fixture"), "{msg}");
        assert!(msg.contains("not the magic \"KVFX\""), "{msg}");
    }

    #[test]
    fn a_future_version_is_rejected() {
        let mut bytes = encode(&small()).unwrap();
        bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert!(error(&bytes).contains("format version 2"));
    }

    #[test]
    fn truncation_and_padding_are_rejected_with_both_sizes() {
        let bytes = encode(&small()).unwrap();
        let msg = error(&bytes[..bytes.len() - 1]);
        assert!(msg.contains(&format!("it is {} bytes long", bytes.len() - 1)), "{msg}");
        assert!(msg.contains(&format!("implies {} bytes", bytes.len())), "{msg}");
        let mut padded = bytes.clone();
        padded.push(0);
        assert!(error(&padded).contains("truncated or padded"));
        assert!(error(&bytes[..20]).contains("shorter than the 56-byte header"));
    }

    #[test]
    fn a_header_with_an_impossible_configuration_is_rejected() {
        let mut bytes = encode(&small()).unwrap();
        bytes[24..28].copy_from_slice(&3u32.to_le_bytes()); // kv_heads 3 does not divide heads 2
        assert!(error(&bytes).contains("unsupported configuration"));
    }

    #[test]
    fn more_positions_than_the_context_are_rejected() {
        let mut bytes = encode(&small()).unwrap();
        bytes[48..52].copy_from_slice(&17u32.to_le_bytes());
        assert!(error(&bytes).contains("claims 17 positions"));
    }

    #[test]
    fn token_ids_outside_the_vocabulary_are_rejected() {
        let mut bytes = encode(&small()).unwrap();
        bytes[60..64].copy_from_slice(&10u32.to_le_bytes());
        assert!(error(&bytes).contains("token 1 is id 10, outside the vocabulary of 10 tokens"));
    }

    #[test]
    fn a_nan_is_reported_with_its_layer_tensor_and_offset() {
        let mut bytes = encode(&small()).unwrap();
        // Layer 1's k: after header, tokens, layer 0 (q 24 + k 12 + v 12 floats) and layer 1's q (24).
        let at = 68 + 4 * (48 + 24 + 2);
        bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let msg = error(&bytes);
        assert!(
            msg.contains(&format!("layer 1 k holds the non-finite value NaN at element 2 (byte offset {at})")),
            "{msg}"
        );
    }

    #[test]
    fn a_trace_with_short_layers_is_not_written() {
        let mut trace = small();
        trace.layers[1].v.pop();
        let msg = encode(&trace).unwrap_err().to_string();
        assert!(msg.contains("layer 1 v has 11 floats, but 3 positions × 4 need 12"), "{msg}");
    }
}
