//! Fuzzes every decoder that sees bytes from the network before a peer is trusted or while
//! it talks: the data-frame header and the handshake messages. Run with
//! `cargo fuzz run frame_decoder` from `fuzz/` (needs cargo-fuzz and a nightly toolchain).
#![no_main]

use ironweave_transport::wire::{FrameHeader, Handshake};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = FrameHeader::decode(data, 1 << 30) {
        // Whatever decodes must satisfy the invariants the reader relies on.
        assert!(h.offset.checked_add(h.len).is_some_and(|end| end <= h.total));
        assert!(h.total <= 1 << 30);
        assert_eq!(FrameHeader::decode(&h.encode(), 1 << 30), Ok(h));
    }
    if data.len() >= 4 {
        if let Ok(n) = Handshake::check_len([data[0], data[1], data[2], data[3]]) {
            assert!(n <= ironweave_transport::wire::MAX_HANDSHAKE);
        }
    }
    if let Ok(m) = Handshake::decode(data) {
        let enc = m.encode();
        assert_eq!(Handshake::decode(&enc[4..]).as_ref(), Ok(&m));
    }
});
