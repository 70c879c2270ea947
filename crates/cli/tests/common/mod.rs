//! Shared by the tests that need the emulated cluster.

use std::process::Command;

/// Whether the emulated cluster can run here (root and iproute2); says why not when it cannot,
/// so the test can report itself skipped (CI runs as root).
pub fn can_run_emulated() -> bool {
    let root = Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false);
    let ip = Command::new("ip").args(["netns", "list"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !(root && ip) {
        eprintln!("SKIPPED: the emulated cluster needs root and iproute2 (root={root}, ip={ip})");
    }
    root && ip
}
