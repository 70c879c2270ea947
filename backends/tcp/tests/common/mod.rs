//! Builds an n-rank TCP world inside one test process (`ironweave_tcp::local_world`) with the
//! test suite's deadlines.

use ironweave_tcp::TcpConfig;
use ironweave_transport::shm::ShmConfig;
use ironweave_transport::{CommOptions, Communicator};
use std::time::Duration;

/// A world whose collectives stay on the sockets (the intra-host path off), so these suites
/// test the TCP link itself.
pub fn world_with(n: usize, cfg: TcpConfig) -> Vec<Communicator> {
    let shm = ShmConfig { enabled: false, ..cfg.shm.clone() };
    world_exactly(n, TcpConfig { shm, ..cfg })
}

/// A world with `cfg` as given (the intra-host path as configured there).
pub fn world_exactly(n: usize, cfg: TcpConfig) -> Vec<Communicator> {
    let opts = CommOptions { timeout: Duration::from_secs(120), ..CommOptions::default() };
    let cfg = TcpConfig { timeout: Duration::from_secs(60), linger: Duration::from_secs(2), ..cfg };
    ironweave_tcp::local_world(n, &cfg, opts).unwrap()
}

#[allow(dead_code)]
pub fn world(n: usize) -> Vec<Communicator> {
    world_with(n, TcpConfig::default())
}
