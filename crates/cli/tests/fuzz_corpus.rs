//! Replays every fuzz target's checked-in corpus (`fuzz/corpus/<target>/`) through the same
//! checks the fuzzers run (`fuzz/src/checks.rs`), so a decoder that regresses on an input the
//! fuzzers once found interesting fails CI without a nightly toolchain.

#[path = "../../../fuzz/src/checks.rs"]
#[allow(dead_code)]
mod checks;

use std::path::PathBuf;

fn replay(target: &str, check: fn(&[u8])) {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus")).join(target);
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        let data = std::fs::read(&p).unwrap();
        // a panic names the input that caused it
        let r = std::panic::catch_unwind(|| check(&data));
        assert!(r.is_ok(), "{target}: input {} fails", p.display());
        n += 1;
    }
    assert!(n >= 10, "{target}: only {n} inputs in {}", dir.display());
}

#[test]
fn frame_decoder_corpus() {
    replay("frame_decoder", checks::frame_decoder);
}

#[test]
fn ckpt_wire_corpus() {
    replay("ckpt_wire", checks::ckpt_wire);
}

#[test]
fn ckpt_files_corpus() {
    replay("ckpt_files", checks::ckpt_files);
}

#[test]
fn configs_corpus() {
    replay("configs", checks::configs);
}

#[test]
fn plans_corpus() {
    replay("plans", checks::plans);
}

#[test]
fn rdata_corpus() {
    replay("rdata", checks::rdata);
}
