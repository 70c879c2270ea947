//! Bad input to `airq` ends with a message that says what to do, never a panic or a hang.

use std::process::Command;

const AIRQ: &str = env!("CARGO_BIN_EXE_airq");

fn fails(args: &[&str]) -> String {
    let o = Command::new(AIRQ)
        .args(args)
        .env_remove("IRONWEAVE_RANK")
        .env_remove("RANK")
        .env_remove("IRONWEAVE_WORLD_SIZE")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "airq {args:?} succeeded: {}", String::from_utf8_lossy(&o.stdout));
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn bad_input_is_a_clear_error() {
    let e = fails(&["data", "--data", "/no/such/air.rda"]);
    assert!(e.contains("r-cran-spacetime"), "{e}");
    let e = fails(&["train"]);
    assert!(e.contains("ironweave launch"), "outside a job: {e}");
    let e = fails(&["experiment", "--target", "Atlantis", "--seeds", "1"]);
    assert!(e.contains("no state `Atlantis`") && e.contains("Niedersachsen"), "{e}");
    let e = fails(&["experiment", "--sources", "40", "--seeds", "1", "--methods", "no-classifier"]);
    assert!(e.contains("source states asked for"), "{e}");
    let e = fails(&["experiment", "--methods", "magic"]);
    assert!(e.contains("unknown method `magic`") && e.contains("grl-per-source"), "{e}");
    let e = fails(&["report", "/no/such/dir"]);
    assert!(e.contains("written by `airq train`"), "{e}");
}
