//! The conformance suite on a striped communicator over two TCP links (two loopback
//! addresses standing for two interfaces), 60% / 40%.

mod common;

use ironweave_tcp::{parse_links, TcpConfig};
use ironweave_transport::Communicator;

fn make(n: usize) -> Vec<Communicator> {
    let cfg = TcpConfig { links: parse_links("a=127.0.0.1,b=127.0.0.2").unwrap(), ..TcpConfig::default() };
    common::world_with(n, cfg).into_iter().map(|c| c.striped(Some(vec![0.6, 0.4])).unwrap()).collect()
}

ironweave_transport::conformance_suite!(make);
