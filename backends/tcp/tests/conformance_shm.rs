//! The conformance suite on the intra-host shared-memory path (the TCP backend's default when
//! every rank is on one host), with small slots so that every size runs through many windows
//! and both buffers of each slot.

mod common;

use ironweave_tcp::TcpConfig;
use ironweave_transport::shm::ShmConfig;
use ironweave_transport::Communicator;

fn make(n: usize) -> Vec<Communicator> {
    let cfg = TcpConfig { shm: ShmConfig { slot_bytes: 64 << 10, ..ShmConfig::default() }, ..TcpConfig::default() };
    let comms = common::world_exactly(n, cfg);
    // The path must really be taken (a world of one has nobody to share with).
    for c in &comms {
        assert_eq!(c.uses_shared_memory(), n > 1, "rank {} of {n}", c.rank());
    }
    comms
}

ironweave_transport::conformance_suite!(make);
