//! Builds an n-rank TCP world inside one test process: one thread per rank, each with its own
//! rendezvous client, listeners and sockets.

use ironweave_tcp::TcpConfig;
use ironweave_transport::rendezvous::{EnvSource, JobEnv};
use ironweave_transport::{CommOptions, Communicator};
use std::time::Duration;

pub fn world_with(n: usize, cfg: TcpConfig) -> Vec<Communicator> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let opts = CommOptions { timeout: Duration::from_secs(120), ..CommOptions::default() };
    let cfg = TcpConfig { timeout: Duration::from_secs(60), linger: Duration::from_secs(2), ..cfg };
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let (opts, cfg) = (opts.clone(), cfg.clone());
            std::thread::spawn(move || {
                let env = JobEnv {
                    rank,
                    world_size: n,
                    local_rank: rank,
                    master: ([127, 0, 0, 1], port).into(),
                    job_id: format!("test-{port}"),
                    secret: b"s3cret".to_vec(),
                    source: EnvSource::Ironweave,
                };
                ironweave_tcp::connect(&env, &cfg, opts).unwrap()
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[allow(dead_code)]
pub fn world(n: usize) -> Vec<Communicator> {
    world_with(n, TcpConfig::default())
}
