//! A TCP world inside one test process: one thread per rank.

use std::time::Duration;

use ironweave_tcp::TcpConfig;
use ironweave_transport::{CommOptions, Communicator};

pub fn world(n: usize) -> Vec<Communicator> {
    let cfg = TcpConfig { timeout: Duration::from_secs(60), linger: Duration::from_secs(2), ..TcpConfig::default() };
    ironweave_tcp::local_world(n, &cfg, CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() }).unwrap()
}
