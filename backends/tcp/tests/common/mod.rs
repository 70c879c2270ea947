//! Builds an n-rank TCP world inside one test process (`ironweave_tcp::local_world`) with the
//! test suite's deadlines.

use ironweave_tcp::TcpConfig;
use ironweave_transport::{CommOptions, Communicator};
use std::time::Duration;

pub fn world_with(n: usize, cfg: TcpConfig) -> Vec<Communicator> {
    let opts = CommOptions { timeout: Duration::from_secs(120), ..CommOptions::default() };
    let cfg = TcpConfig { timeout: Duration::from_secs(60), linger: Duration::from_secs(2), ..cfg };
    ironweave_tcp::local_world(n, &cfg, opts).unwrap()
}

#[allow(dead_code)]
pub fn world(n: usize) -> Vec<Communicator> {
    world_with(n, TcpConfig::default())
}
