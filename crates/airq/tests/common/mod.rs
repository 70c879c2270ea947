//! Running `airq train` as a job of `ironweave launch`, as a user does.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub const AIRQ: &str = env!("CARGO_BIN_EXE_airq");

/// The `ironweave` command (crates/cli), built beside this test by `cargo test --workspace`.
pub fn ironweave() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().and_then(Path::parent).unwrap().join("ironweave");
    assert!(p.exists(), "{} is missing: run `cargo test --workspace` (or `cargo build -p ironweave-cli`) first", p.display());
    p
}

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

/// Runs `ironweave launch ARGS` to the end (at most `secs`), calling `on_line` with each line
/// the ranks print; returns every line. Panics when the job fails or outlives its deadline.
pub fn launch(args: &[String], secs: u64, mut on_line: impl FnMut(&str)) -> Vec<String> {
    use std::io::BufRead;
    let mut child = Command::new(ironweave())
        .arg("launch")
        .args(args)
        .env("IRONWEAVE_TIMEOUT_S", "30")
        .env("AIRQ_VERBOSE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    let errs = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let mut lines = Vec::new();
    loop {
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(l) => {
                on_line(&l);
                lines.push(l);
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the job outlived its {secs} s deadline; so far:\n{}", lines.join("\n"));
        }
    }
    let status = child.wait().unwrap();
    let errs = errs.join().unwrap();
    assert!(status.success(), "launch {args:?}: {status}\n{}\n{errs}", lines.join("\n"));
    lines
}

pub fn final_states(lines: &[String]) -> Vec<String> {
    lines.iter().filter_map(|l| l.split_once("final state ").map(|(_, d)| d.trim().to_string())).collect()
}

/// Headless Chromium with the flags this machine needs (no network, no sandbox as root).
pub fn chromium(profile: &Path) -> Command {
    let exe = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
        .expect("headless Chromium is needed for the report test: apt-get install chromium (scripts/deps.sh does)");
    let mut c = Command::new(exe);
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    c
}
