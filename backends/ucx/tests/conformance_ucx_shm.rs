//! The conformance suite over UCX restricted to shared memory (`posix,sysv,cma,self`).

mod common;

fn make(n: usize) -> Vec<ironweave_transport::Communicator> {
    common::world_on(n, "shm")
}

ironweave_transport::conformance_suite!(make);
