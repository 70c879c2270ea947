//! A TCP world inside one test process: one thread per rank.

use std::time::Duration;

use ironweave_tcp::TcpConfig;
use ironweave_transport::rendezvous::{EnvSource, JobEnv};
use ironweave_transport::{CommOptions, Communicator};

pub fn world(n: usize) -> Vec<Communicator> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            std::thread::spawn(move || {
                let env = JobEnv {
                    rank,
                    world_size: n,
                    local_rank: rank,
                    master: ([127, 0, 0, 1], port).into(),
                    job_id: format!("ckpt-{port}"),
                    secret: b"k".to_vec(),
                    source: EnvSource::Ironweave,
                };
                let cfg = TcpConfig { timeout: Duration::from_secs(60), linger: Duration::from_secs(2), ..TcpConfig::default() };
                ironweave_tcp::connect(&env, &cfg, CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() })
                    .unwrap()
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}
