//! Shared by the tests that need the emulated cluster.

use std::process::Command;

/// Whether the emulated cluster can run here (root and iproute2). When it cannot, `test` is
/// reported as skipped (`ironweave_transport::testing::skip`: on the real standard error past
/// the harness's capture, and counted in the skip log `scripts/test.sh` sums up) — unless
/// `IRONWEAVE_REQUIRE_EMULATED=1` (set by `.ci/run`, which runs as root): then a test that
/// cannot run fails instead of skipping.
pub fn can_run_emulated(test: &str) -> bool {
    let root = Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false);
    let ip = Command::new("ip").args(["netns", "list"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !(root && ip) {
        let reason = format!("the emulated cluster needs root and iproute2 (root={root}, ip={ip})");
        assert!(
            std::env::var("IRONWEAVE_REQUIRE_EMULATED").as_deref() != Ok("1"),
            "{test}: {reason}, and IRONWEAVE_REQUIRE_EMULATED=1 forbids skipping it"
        );
        ironweave_transport::testing::skip(test, &reason);
    }
    root && ip
}
