//! TCP-specific behaviour: ordering of non-blocking operations, striping over several
//! connections, landing striped parts straight into the receiver's buffer, two links at once.

mod common;

use ironweave_tcp::{parse_links, TcpConfig};
use ironweave_transport::testing::{check_collective, Case};
use ironweave_transport::{Communicator, ReduceOp};

fn run_all(comms: Vec<Communicator>, f: impl Fn(&Communicator) + Sync) {
    std::thread::scope(|s| {
        for c in comms {
            let f = &f;
            s.spawn(move || f(&c));
        }
    });
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt)).collect()
}

#[test]
fn nonblocking_operations_match_in_issue_order_and_stripes_reassemble() {
    // Three connections per peer and a tiny stripe threshold: big messages arrive in parts.
    let cfg = TcpConfig { conns_per_peer: 3, stripe_min_bytes: 1000, ..TcpConfig::default() };
    let sizes = [0usize, 1, 999, 1000, (4 << 20) + 13];
    run_all(common::world_with(2, cfg), |c| {
        let dl = || c.deadline_from_now();
        if c.rank() == 0 {
            let hs: Vec<_> = sizes.iter().enumerate().map(|(k, &n)| c.isend_bytes(1, 7, pattern(n, k as u8)).unwrap()).collect();
            c.send_bytes(1, 7, &pattern(5000, 99)).unwrap();
            for (h, &n) in hs.into_iter().zip(&sizes) {
                assert_eq!(h.wait(dl()).unwrap().len(), n, "isend hands the buffer back");
            }
            // Sending to ourselves works too.
            c.send_bytes(0, 3, b"self").unwrap();
            assert_eq!(c.recv_bytes(0, 3).unwrap(), b"self");
        } else {
            let hs: Vec<_> = (0..=sizes.len()).map(|_| c.irecv_bytes(0, 7).unwrap()).collect();
            // Wait in reverse: matching follows posting order, not waiting order.
            let mut got: Vec<Vec<u8>> = hs.into_iter().rev().map(|h| h.wait(dl()).unwrap().into_vec()).collect();
            got.reverse();
            for (k, &n) in sizes.iter().enumerate() {
                assert_eq!(got[k], pattern(n, k as u8), "message {k}");
            }
            assert_eq!(got[sizes.len()], pattern(5000, 99));
        }
        c.barrier().unwrap();
    });
}

#[test]
fn striped_parts_land_in_the_receivers_buffer() {
    let cfg = TcpConfig { conns_per_peer: 4, stripe_min_bytes: 4096, ..TcpConfig::default() };
    run_all(common::world_with(3, cfg), |c| {
        for (i, case) in [Case::AllGather, Case::AllReduce, Case::Broadcast, Case::ReduceScatter].into_iter().enumerate() {
            check_collective::<f32>(c, case, (6 << 20) / 4 + 3 * i, ReduceOp::Sum, 42 + i as u64, true).unwrap();
        }
    });
}

#[test]
fn two_links_run_collectives_at_the_same_time() {
    // Two loopback addresses stand for two interfaces.
    let cfg = TcpConfig { links: parse_links("a=127.0.0.1,b=127.0.0.2").unwrap(), ..TcpConfig::default() };
    run_all(common::world_with(3, cfg), |c| {
        let names: Vec<String> = c.links().into_iter().map(|l| l.name).collect();
        assert_eq!(names, ["tcp:a", "tcp:b"]);
        let (a, b) = (c.on_link(0).unwrap(), c.on_link(1).unwrap());
        std::thread::scope(|s| {
            for (i, view) in [a, b].into_iter().enumerate() {
                s.spawn(move || {
                    for k in 0..5 {
                        check_collective::<i64>(&view, Case::AllReduce, 300_000 + k, ReduceOp::Sum, (i * 10 + k) as u64, true)
                            .unwrap();
                        check_collective::<i64>(&view, Case::AllGather, 3 * (70_000 + k), ReduceOp::Sum, k as u64, true).unwrap();
                    }
                });
            }
        });
        assert!(c.on_link(2).is_err());
    });
}

#[test]
fn bad_link_configuration_is_a_clear_error() {
    assert!(parse_links("a=not-an-ip").is_err());
    assert!(parse_links("justaname").is_err());
    assert!(parse_links("a=10.0.0.1@fast").is_err());
    assert!(parse_links("a=10.0.0.1@0mbit").is_err());
    let l = parse_links("a=10.0.0.1@1gbit,b=10.1.0.1@300mbit,c=127.0.0.1").unwrap();
    assert_eq!(l.iter().map(|l| l.rate_bytes_per_s).collect::<Vec<_>>(), [Some(125_000_000), Some(37_500_000), None]);
}

#[test]
fn landing_and_buffering_never_split_a_message() {
    // Striped messages whose parts race with the posting of their landing zone: rank 1 posts
    // later and later, so that some parts of a message arrive before the zone exists and
    // others after. Every result is checked.
    let cfg = TcpConfig { conns_per_peer: 4, stripe_min_bytes: 1024, ..TcpConfig::default() };
    run_all(common::world_with(2, cfg), |c| {
        for i in 0..100u64 {
            if c.rank() == 1 {
                let until = std::time::Instant::now() + std::time::Duration::from_micros(60 * (i % 50));
                while std::time::Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
            check_collective::<i32>(c, Case::AllToAll, 2 << 20, ReduceOp::Sum, i, true).unwrap();
        }
    });
}
