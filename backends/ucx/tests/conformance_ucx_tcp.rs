//! The conformance suite over UCX restricted to its TCP transport.

mod common;

fn make(n: usize) -> Vec<ironweave_transport::Communicator> {
    common::world_on(n, "tcp")
}

ironweave_transport::conformance_suite!(make);
