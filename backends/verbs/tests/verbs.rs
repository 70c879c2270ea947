//! The verbs backend: the conformance suite where an RDMA device exists, and on machines
//! without one (this CI machine) the typed "not available" errors. Skips are printed straight
//! to stderr so they show in the test output even though the test passes.

use std::io::Write;
use std::time::Duration;

use ironweave_transport::{CommOptions, Communicator, Error};
use ironweave_verbs::VerbsConfig;

/// The reason the suite cannot run here, if any.
fn skip_reason() -> Option<String> {
    ironweave_verbs::available().err().map(|e| e.to_string())
}

fn make(n: usize) -> Vec<Communicator> {
    let opts = CommOptions { timeout: Duration::from_secs(120), ..CommOptions::default() };
    ironweave_verbs::local_world(n, &VerbsConfig::from_env().unwrap(), opts).unwrap()
}

ironweave_transport::conformance_suite!(make, skip_if = |_| skip_reason());

#[test]
fn without_a_device_every_entry_point_says_why_instead_of_panicking() {
    let Some(reason) = skip_reason() else {
        let _ = writeln!(std::io::stderr(), "verbs: an RDMA device exists here; the no-device checks do not apply");
        return;
    };
    let _ = writeln!(std::io::stderr(), "verbs: no usable device here: {reason}");
    assert!(reason.contains("RDMA"), "{reason}");
    match ironweave_verbs::local_world(2, &VerbsConfig::default(), CommOptions::default()) {
        Err(Error::Config(msg)) => assert!(msg.contains("RDMA"), "{msg}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
    // Device discovery itself works (an empty list or a kernel without RDMA both answer).
    let _ = ironweave_verbs::devices();
}
