//! Fuzz target `frame_decoder`: see `checks::frame_decoder` (`fuzz/src/checks.rs`). Run from `fuzz/` with
//! `cargo fuzz run frame_decoder` (docs/RELIABILITY.md has the flags and the figures).
#![no_main]

#[path = "../src/checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::frame_decoder(data));
