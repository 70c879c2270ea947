//! UCX-specific behaviour beyond the conformance suite: separate shared-memory and TCP links,
//! zero-copy landing, failure propagation, memory registration.

mod common;

use std::time::{Duration, Instant};

use ironweave_transport::shm::ShmConfig;
use ironweave_transport::{CommOptions, Error, Link, ReduceOp, Tag};
use ironweave_ucx::{parse_links, ucp, UcxConfig};

fn both_links(n: usize) -> Vec<ironweave_transport::Communicator> {
    let cfg = UcxConfig {
        links: parse_links("shm,tcp").unwrap(),
        linger: Duration::from_secs(5),
        shm: ShmConfig { enabled: false, ..ShmConfig::default() },
        ..UcxConfig::default()
    };
    let opts = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
    ironweave_ucx::local_world(n, &cfg, opts).unwrap()
}

#[test]
fn shared_memory_and_tcp_are_separate_links_usable_alone_and_striped() {
    let comms = both_links(2);
    let names: Vec<String> = comms[0].links().into_iter().map(|l| l.name).collect();
    assert_eq!(names, ["ucx:shm", "ucx:tcp"]);
    assert!(comms[0].links().iter().all(|l| l.backend == "ucx"));
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                for i in 0..2 {
                    let v = c.on_link(i).unwrap();
                    let mut x = vec![c.rank() as f32 + 1.0; 1 << 18];
                    v.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    assert!(x.iter().all(|&e| e == 3.0), "link {i}");
                }
                let st = c.striped(Some(vec![0.7, 0.3])).unwrap();
                let mut x = vec![c.rank() as i32 + 2; (4 << 20) + 5];
                st.all_reduce(&mut x, ReduceOp::Prod).unwrap();
                assert!(x.iter().all(|&e| e == 6));
            });
        }
    });
}

#[test]
fn on_one_host_whole_world_collectives_take_the_shared_memory_path_by_default() {
    let cfg = UcxConfig { links: parse_links("tcp").unwrap(), linger: Duration::from_secs(5), ..UcxConfig::default() };
    let opts = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
    let comms = ironweave_ucx::local_world(3, &cfg, opts).unwrap();
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                assert!(c.uses_shared_memory(), "rank {}", c.rank());
                let before = c.shared_memory_collectives().unwrap();
                let mut v = vec![c.rank() as i64 + 1; 100_000];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert!(v.iter().all(|&x| x == 6));
                assert_eq!(c.shared_memory_collectives().unwrap(), before + 1, "the all-reduce went through the segment");
                // Point-to-point stays on the UCX link.
                if c.rank() == 0 {
                    c.send_bytes(1, 3, b"hello").unwrap();
                } else if c.rank() == 1 {
                    assert_eq!(c.recv_bytes(0, 3).unwrap(), b"hello");
                }
            });
        }
    });
}

#[test]
fn large_and_small_messages_land_in_the_posted_buffer() {
    let cfg = UcxConfig { links: parse_links("shm").unwrap(), linger: Duration::from_secs(5), ..UcxConfig::default() };
    let links = ironweave_ucx::local_links(2, &cfg).unwrap();
    let (a, b) = (&links[0][0], &links[1][0]);
    let soon = || Instant::now() + Duration::from_secs(30);
    for len in [0usize, 8, 4 << 20] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; len];
        // SAFETY: `dst` outlives the handle, which is waited on below before `dst` is read.
        let h = unsafe { b.irecv_into(0, Tag(7), dst.as_mut_ptr(), len) }.unwrap();
        a.send(1, Tag(7), &data, soon()).unwrap();
        let m = h.wait(soon()).unwrap();
        assert!(m.is_landed(), "{len} bytes were buffered instead of landing");
        assert_eq!(dst, data, "{len} bytes");
        // A zone of the wrong size is not written; the message is buffered with its real length.
        let mut small = vec![0u8; 4];
        // SAFETY: as above.
        let h = unsafe { b.irecv_into(0, Tag(8), small.as_mut_ptr(), 4) }.unwrap();
        a.send(1, Tag(8), &data, soon()).unwrap();
        let m = h.wait(soon()).unwrap();
        if len != 4 {
            assert!(!m.is_landed() && m.len() == len && small == [0; 4]);
            assert_eq!(m.into_vec(), data);
        }
    }
}

#[test]
fn an_abort_reaches_the_peer_and_later_calls_fail_at_once() {
    let comms = common::world_on(2, "tcp");
    comms[0].abort("test abort from rank 0");
    let t = Instant::now();
    let e = comms[1].recv_bytes(0, 1).unwrap_err();
    assert!(matches!(&e, Error::PeerAborted { rank: 0, reason } if reason.contains("test abort")), "{e}");
    assert!(t.elapsed() < Duration::from_secs(30));
    assert!(matches!(comms[0].send_bytes(1, 1, b"x"), Err(Error::Aborted { .. })));
}

#[test]
fn a_peer_that_closed_is_reported_instead_of_waited_for() {
    let mut comms = common::world_on(2, "shm");
    let gone = comms.pop().unwrap();
    let t = std::thread::spawn(move || drop(gone));
    let e = comms[0].recv_bytes(1, 3).unwrap_err();
    assert!(matches!(e, Error::PeerClosed { rank: 1, me: 0 }), "{e}");
    t.join().unwrap();
}

#[test]
fn a_missing_message_times_out() {
    let mut comms = common::world_on(2, "shm");
    comms[0].set_timeout(Duration::from_millis(300));
    let e = comms[0].recv_bytes(1, 4).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
}

#[test]
fn rank_out_of_range_is_an_argument_error() {
    let comms = common::world_on(1, "shm");
    assert!(matches!(comms[0].send_bytes(3, 0, b"x"), Err(Error::RankOutOfRange { rank: 3, size: 1 })));
    // A rank sends to itself without UCX.
    comms[0].send_bytes(0, 5, b"self").unwrap();
    assert_eq!(comms[0].recv_bytes(0, 5).unwrap(), b"self");
}

#[test]
fn memory_registration_maps_and_unmaps() {
    let ctx = ucp::Context::new(Some("posix,sysv,cma,self")).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let region = ctx.map(buf.as_mut_ptr(), buf.len()).unwrap();
    assert_eq!(region.range(), (buf.as_ptr() as usize, buf.len()));
    assert!(!region.handle().is_null());
    drop(region);
}

#[test]
fn doctor_probe_opens_each_preset_alone() {
    let r = ironweave_ucx::probe_links(&parse_links("shm,tcp").unwrap());
    assert_eq!(r.len(), 2);
    for (name, res) in r {
        assert!(res.is_ok(), "{name}: {res:?}");
    }
    let bad = ironweave_ucx::probe_links(&parse_links("x:no_such_transport").unwrap());
    assert!(bad[0].1.is_err(), "a transport UCX does not know must be reported");
    assert!(ironweave_ucx::available().unwrap().starts_with("UCX 1."));
}
