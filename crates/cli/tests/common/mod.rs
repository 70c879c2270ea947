//! Shared by the tests that need the emulated cluster.

use std::process::Command;

/// Whether the emulated cluster can run here (root and iproute2). When it cannot, `test` is
/// reported as `SKIPPED test: reason` on the real standard error — written past the test
/// harness's capture, so a skip shows in every run's log instead of passing silently (CI runs
/// as root).
pub fn can_run_emulated(test: &str) -> bool {
    use std::io::Write;
    let root = Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false);
    let ip = Command::new("ip").args(["netns", "list"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !(root && ip) {
        let _ =
            writeln!(std::io::stderr(), "SKIPPED {test}: the emulated cluster needs root and iproute2 (root={root}, ip={ip})");
    }
    root && ip
}
