//! The conformance suite on the in-process backend.

use ironweave_transport::{inproc, CommOptions, Communicator};
use std::time::Duration;

fn make(n: usize) -> Vec<Communicator> {
    let opts = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
    inproc::world(n).into_iter().map(|l| Communicator::new(vec![l], opts.clone()).unwrap()).collect()
}

ironweave_transport::conformance_suite!(make);
