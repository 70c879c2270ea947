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

#[test]
fn orthonets_corpus() {
    replay("orthonets", checks::orthonets);
    // no libFuzzer run is recorded for this target yet: every prefix of each seed and 64
    // seeded byte changes of each go through the same check
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus/orthonets"));
    let mut rng = ironweave_units::SplitMix64::new(7);
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let data = std::fs::read(&p).unwrap();
        let mut inputs: Vec<Vec<u8>> = (0..data.len()).step_by(data.len() / 40 + 1).map(|n| data[..n].to_vec()).collect();
        for _ in 0..64 {
            let mut m = data.clone();
            if !m.is_empty() {
                let i = (rng.next_u64() % m.len() as u64) as usize;
                m[i] = match rng.next_u64() % 4 {
                    0 => b'\t',
                    1 => b'\n',
                    2 => b'"',
                    _ => rng.next_u64() as u8,
                };
            }
            inputs.push(m);
        }
        for input in inputs {
            let r = std::panic::catch_unwind(|| checks::orthonets(&input));
            assert!(r.is_ok(), "orthonets: a change of {} fails: {:?}", p.display(), String::from_utf8_lossy(&input));
        }
    }
}
