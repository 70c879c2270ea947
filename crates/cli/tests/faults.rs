//! Faults and bad input against real processes over TCP: a peer killed mid-collective,
//! mismatched lengths, wrong secret or world size, random bytes at a listening port. Every
//! case must end in a typed error (or success) well within the deadline, never a hang: each
//! process gets IRONWEAVE_TIMEOUT_S and the test kills anything still alive after a guard.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ironweave");
/// Hang guard: far above IRONWEAVE_TIMEOUT_S so only a real hang trips it.
const GUARD: Duration = Duration::from_secs(90);

fn free_port() -> u16 {
    ironweave_testkit::master_port(4)
}

fn rank_cmd(rank: usize, world: usize, port: u16, scenario: &str) -> Command {
    let mut c = Command::new(BIN);
    c.args(["selftest", scenario])
        .env("IRONWEAVE_RANK", rank.to_string())
        .env("IRONWEAVE_WORLD_SIZE", world.to_string())
        .env("IRONWEAVE_MASTER_ADDR", "127.0.0.1")
        .env("IRONWEAVE_MASTER_PORT", port.to_string())
        .env("IRONWEAVE_JOB_ID", format!("faults-{port}"))
        .env("IRONWEAVE_SECRET", "right")
        .env("IRONWEAVE_TIMEOUT_S", "20")
        .env("IRONWEAVE_TCP_LINGER_S", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn finish(mut child: Child, what: &str) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > GUARD {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("{what} hung; stderr:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Starts three `selftest loop` ranks, kills rank 1 with SIGKILL once rank 0 reports progress,
/// and returns the survivors' outputs.
fn kill_rank_1_mid_collective(configure: impl Fn(&mut Command)) -> Vec<(usize, Output)> {
    kill_rank_1_in("loop", configure)
}

/// The same with the ranks running `scenario` (which prints `iter N` as it goes).
fn kill_rank_1_in(scenario: &str, configure: impl Fn(&mut Command)) -> Vec<(usize, Output)> {
    let port = free_port();
    let mut kids: Vec<Child> = (0..3)
        .map(|r| {
            let mut c = rank_cmd(r, 3, port, scenario);
            configure(&mut c);
            c.spawn().unwrap()
        })
        .collect();
    // Watch rank 0's progress; kill rank 1 once the collectives are running.
    let (tx, rx) = mpsc::channel();
    let out0 = kids[0].stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out0).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let start = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(l) if l == "iter 3" => break,
            Ok(_) => {}
            Err(_) => assert!(start.elapsed() < GUARD, "the ranks never got going"),
        }
    }
    kids[1].kill().unwrap(); // SIGKILL
    let _ = kids[1].wait();
    kids.into_iter().enumerate().filter(|(r, _)| *r != 1).map(|(r, k)| (r, finish(k, &format!("survivor rank {r}")))).collect()
}

#[test]
fn peer_killed_mid_collective_fails_every_survivor_with_peer_lost() {
    for (r, o) in kill_rank_1_mid_collective(|c| {
        c.env("IRONWEAVE_SHM", "0");
    }) {
        let t = text(&o);
        assert_eq!(o.status.code(), Some(3), "rank {r} should fail with a typed error:\n{t}");
        assert!(t.contains("selftest path link"), "rank {r} should be on the sockets:\n{t}");
        assert!(t.contains("PeerLost { rank: 1"), "rank {r} should name the lost rank:\n{t}");
    }
}

#[test]
fn peer_killed_mid_collective_on_the_shared_memory_path_fails_every_survivor_with_peer_lost() {
    // The default on one host: the survivors wait in the shared segment, where the closed
    // socket of the dead rank (or its vanished pid) must reach them well before the deadline.
    for (r, o) in kill_rank_1_mid_collective(|_| {}) {
        let t = text(&o);
        assert_eq!(o.status.code(), Some(3), "rank {r} should fail with a typed error:\n{t}");
        assert!(t.contains("selftest path shm"), "rank {r} should be on the shared-memory path:\n{t}");
        assert!(t.contains("PeerLost { rank: 1"), "rank {r} should name the lost rank:\n{t}");
        assert!(!t.contains("Timeout"), "rank {r} only noticed through the deadline:\n{t}");
    }
}

#[test]
fn peer_killed_while_a_nonblocking_collective_is_in_flight_is_a_typed_error() {
    // the survivors are waiting on handles of iall_reduce when rank 1 dies
    for (r, o) in kill_rank_1_in("iloop", |c| {
        c.env("IRONWEAVE_TIMEOUT_S", "20");
    }) {
        let t = text(&o);
        assert_eq!(o.status.code(), Some(3), "rank {r} should fail with a typed error:\n{t}");
        assert!(t.contains("PeerLost { rank: 1") || t.contains("PeerAborted"), "rank {r}:\n{t}");
    }
}

#[test]
fn peer_killed_mid_striped_collective_fails_every_survivor_with_peer_lost() {
    // Two loopback links; all-gather and reduce-scatter balance dynamically over both, each
    // link's thread waiting on its own receives (and on its socket draining) when rank 1 dies.
    for (r, o) in kill_rank_1_in("sloop", |c| {
        c.env("IRONWEAVE_TCP_LINKS", "a=127.0.0.1,b=127.0.0.1");
    }) {
        let t = text(&o);
        assert_eq!(o.status.code(), Some(3), "rank {r} should fail with a typed error:\n{t}");
        assert!(t.contains("selftest striped over 2 links, dynamic true"), "rank {r} should balance over both links:\n{t}");
        assert!(t.contains("PeerLost { rank: 1"), "rank {r} should name the lost rank:\n{t}");
        assert!(!t.contains("Timeout"), "rank {r} only noticed through the deadline:\n{t}");
    }
}

#[test]
fn ucx_tcp_link_reports_a_killed_peer_as_lost() {
    let outs = kill_rank_1_mid_collective(|c| {
        // IRONWEAVE_SHM=0: the collectives stay on UCX (the segment has its own test above).
        c.args(["--backend", "ucx"])
            .env("IRONWEAVE_UCX_LINKS", "tcp")
            .env("IRONWEAVE_UCX_LINGER_S", "1")
            .env("IRONWEAVE_SHM", "0");
    });
    for (r, o) in outs {
        let t = text(&o);
        assert_eq!(o.status.code(), Some(3), "rank {r} should fail with a typed error:\n{t}");
        // UCX's TCP transport detects the closed connection: the survivors name the dead rank
        // (or, for the one that learns it second hand, the rank that aborted after it).
        assert!(t.contains("PeerLost { rank: 1") || t.contains("PeerAborted"), "rank {r}:\n{t}");
    }
}

#[test]
fn ucx_shared_memory_link_turns_a_killed_peer_into_a_deadline_not_a_hang() {
    // UCX 1.13's shared-memory transports cannot report a dead peer: the deadline must.
    let outs = kill_rank_1_mid_collective(|c| {
        c.args(["--backend", "ucx"])
            .env("IRONWEAVE_UCX_LINKS", "shm")
            .env("IRONWEAVE_UCX_LINGER_S", "1")
            .env("IRONWEAVE_SHM", "0")
            .env("IRONWEAVE_TIMEOUT_S", "5");
    });
    for (r, o) in outs {
        let t = text(&o);
        assert_eq!(o.status.code(), Some(3), "rank {r} should fail with a typed error:\n{t}");
        assert!(t.contains("Timeout") || t.contains("PeerAborted") || t.contains("PeerLost"), "rank {r}:\n{t}");
    }
}

#[test]
fn mismatched_lengths_are_a_typed_error_on_every_rank() {
    for shm in ["0", "1"] {
        mismatched_lengths_with(shm);
    }
}

fn mismatched_lengths_with(shm: &str) {
    let port = free_port();
    let kids: Vec<Child> = (0..3)
        .map(|r| {
            let mut c = rank_cmd(r, 3, port, "mismatch");
            c.env("IRONWEAVE_SHM", shm);
            c.spawn().unwrap()
        })
        .collect();
    let mut saw_mismatch = false;
    for (r, k) in kids.into_iter().enumerate() {
        let o = finish(k, &format!("rank {r}"));
        let t = text(&o);
        assert_eq!(o.status.code(), Some(3), "rank {r}:\n{t}");
        assert!(!t.contains("went unnoticed"), "rank {r} accepted mismatched lengths:\n{t}");
        assert!(!t.contains("Timeout"), "rank {r} only noticed through a timeout:\n{t}");
        assert!(t.contains("LengthMismatch") || t.contains("PeerAborted"), "rank {r}:\n{t}");
        assert!(t.contains(if shm == "1" { "selftest path shm" } else { "selftest path link" }), "rank {r}:\n{t}");
        saw_mismatch |= t.contains("LengthMismatch");
    }
    assert!(saw_mismatch, "some rank must report the LengthMismatch itself");
}

fn two_ranks_with(env1: &[(&str, &str)]) -> (String, String) {
    let port = free_port();
    let a = rank_cmd(0, 2, port, "ok").spawn().unwrap();
    let mut c1 = rank_cmd(1, 2, port, "ok");
    for (k, v) in env1 {
        c1.env(k, v);
    }
    let b = c1.spawn().unwrap();
    let (oa, ob) = (finish(a, "rank 0"), finish(b, "rank 1"));
    assert!(!oa.status.success() && !ob.status.success(), "both ranks must fail:\n{}\n{}", text(&oa), text(&ob));
    (text(&oa), text(&ob))
}

#[test]
fn wrong_secret_is_rejected_on_both_sides() {
    let (a, b) = two_ranks_with(&[("IRONWEAVE_SECRET", "wrong")]);
    for (r, t) in [(0, a), (1, b)] {
        assert!(t.contains("HandshakeRejected") || t.contains("rendezvous failed"), "rank {r}:\n{t}");
        assert!(t.contains("secret"), "rank {r} should say the secret is wrong:\n{t}");
    }
}

#[test]
fn wrong_world_size_is_rejected_on_both_sides() {
    let (a, b) = two_ranks_with(&[("IRONWEAVE_WORLD_SIZE", "3")]);
    for (r, t) in [(0, a), (1, b)] {
        assert!(t.contains("world size 3 does not match 2"), "rank {r} should name both world sizes:\n{t}");
    }
}

#[test]
fn random_bytes_at_the_listening_port_do_not_disturb_the_job() {
    let port = free_port();
    let a = rank_cmd(0, 2, port, "ok").spawn().unwrap();
    // Wait for rank 0's rendezvous to listen, then throw garbage at it.
    let start = Instant::now();
    let connect = || loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => return s,
            Err(_) => {
                assert!(start.elapsed() < GUARD, "rank 0 never listened");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let mut s1 = connect();
    let _ = s1.write_all(&noise);
    // A length prefix claiming 4 GiB must not make anyone allocate it.
    let mut s2 = connect();
    let _ = s2.write_all(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]);
    // A connection that says nothing at all.
    let _s3 = connect();
    let b = rank_cmd(1, 2, port, "ok").spawn().unwrap();
    for (r, o) in [(0, finish(a, "rank 0")), (1, finish(b, "rank 1"))] {
        let t = text(&o);
        assert!(o.status.success(), "rank {r} failed:\n{t}");
        assert!(t.contains("sum-correct=true"), "rank {r}:\n{t}");
    }
    // The garbage connections were dropped by the server.
    let mut buf = [0u8; 16];
    s1.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(matches!(s1.read(&mut buf), Ok(0) | Err(_)));
}
