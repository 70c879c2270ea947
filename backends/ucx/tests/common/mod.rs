//! Builds an n-rank UCX world inside one test process, or says visibly why it cannot.

use ironweave_transport::shm::ShmConfig;
use ironweave_transport::{CommOptions, Communicator};
use ironweave_ucx::{parse_links, UcxConfig};
use std::time::Duration;

/// A world whose only link is `link` (`shm` or `tcp`); collectives stay on it (the
/// transport's own intra-host path is off, so these suites test UCX).
pub fn world_on(n: usize, link: &str) -> Vec<Communicator> {
    let opts = CommOptions { timeout: Duration::from_secs(120), ..CommOptions::default() };
    let cfg = UcxConfig {
        links: parse_links(link).unwrap(),
        linger: Duration::from_secs(5),
        timeout: Duration::from_secs(60),
        shm: ShmConfig { enabled: false, ..ShmConfig::default() },
        ..UcxConfig::default()
    };
    match ironweave_ucx::local_world(n, &cfg, opts) {
        Ok(w) => w,
        Err(e) => panic!("UCX world of {n} on {link} failed: {e} (install libucx0; CI installs libucx-dev)"),
    }
}
