//! Fuzz target `orthonets`: see `checks::orthonets` (`fuzz/src/checks.rs`). Run from `fuzz/` with
//! `cargo fuzz run orthonets` (docs/RELIABILITY.md has the flags and the figures).
#![no_main]

#[path = "../src/checks.rs"]
#[allow(dead_code)] // each target drives one of the checks
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::orthonets(data));
