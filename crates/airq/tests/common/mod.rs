//! Running `airq train` as a job of `ironweave launch`, as a user does.
#![allow(dead_code)]

use std::path::Path;

pub const AIRQ: &str = env!("CARGO_BIN_EXE_airq");

/// `airq train` on a small slice (the last two years), 4 ranks unless `ranks` says otherwise.
pub fn train_args(ranks: usize, restarts: u32, out: &Path, iters: u64) -> Vec<String> {
    let mut v: Vec<String> =
        ["-n", &ranks.to_string(), "--no-prefix", "--max-restarts", &restarts.to_string(), "--", AIRQ, "train"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    for a in ["--last-days", "730", "--batch", "16", "--hidden", "8", "--method", "grl-per-source", "--sources", "2"] {
        v.push(a.into());
    }
    v.extend(["--iterations".into(), iters.to_string(), "--out".into(), out.display().to_string()]);
    v
}

/// `ironweave launch ARGS` to the end (at most `secs`), the ranks verbose (`AIRQ_VERBOSE`),
/// calling `on_line` with each line they print; returns every line.
pub fn launch(args: &[String], secs: u64, on_line: impl FnMut(&str)) -> Vec<String> {
    job(args).deadline(std::time::Duration::from_secs(secs)).run(on_line)
}

/// `ironweave launch ARGS` with the ranks verbose, not run yet (300 s).
pub fn job(args: &[String]) -> ironweave_testkit::Launch {
    ironweave_testkit::Launch::new(args).env("AIRQ_VERBOSE", "1")
}
