//! The conformance suite over real TCP sockets on loopback: one thread per rank, each with its
//! own rendezvous client, listeners and connections.

use ironweave_transport::rendezvous::{EnvSource, JobEnv};
use ironweave_transport::{CommOptions, Communicator};
use std::time::Duration;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn make(n: usize) -> Vec<Communicator> {
    let port = free_port();
    let opts = CommOptions { timeout: Duration::from_secs(120), ..CommOptions::default() };
    let cfg = ironweave_tcp::TcpConfig { timeout: Duration::from_secs(60), linger: Duration::from_secs(2), ..Default::default() };
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let (opts, cfg) = (opts.clone(), cfg.clone());
            std::thread::spawn(move || {
                let env = JobEnv {
                    rank,
                    world_size: n,
                    local_rank: rank,
                    master: ([127, 0, 0, 1], port).into(),
                    job_id: format!("conformance-{port}"),
                    secret: b"s3cret".to_vec(),
                    source: EnvSource::Ironweave,
                };
                ironweave_tcp::connect(&env, &cfg, opts).unwrap()
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

ironweave_transport::conformance_suite!(make);
