//! The frames of the fd socket (`kvmm-fd.sock`), which any local process can send to kvmmd: decoding
//! arbitrary bytes must never panic, and whatever decodes must encode back to the same bytes.

#![no_main]

use kvmm_shm::fdpass::{FdReply, FdRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = FdRequest::decode(data) {
        assert_eq!(request.encode().as_slice(), data, "a request re-encodes to its bytes");
    }
    if let Ok(reply) = FdReply::decode(data) {
        let bytes = reply.encode().expect("a decoded reply is within the limits, so it encodes");
        let again = FdReply::decode(&bytes).expect("an encoded reply decodes");
        assert_eq!(again, reply);
    }
});
