//! Replication, commit and recovery over real TCP connections (one thread per rank).

use std::sync::Arc;
use std::time::Duration;

use ironweave_ckpt::{placement, placement_on_hosts, CkptError, Dtype, Engine, EngineConfig, Registry, Source, TensorSpec};

mod common;
use common::world;

fn registry() -> Registry {
    Registry::new(&[
        TensorSpec::new("w", Dtype::F32, &[300, 101]),
        TensorSpec::new("adam.m", Dtype::F32, &[300, 101]),
        TensorSpec::new("step", Dtype::I64, &[]),
        TensorSpec::new("rng", Dtype::U8, &[32]),
    ])
    .unwrap()
}

/// Deterministic state of `rank` after iteration `iter`.
fn state(rank: usize, iter: u64) -> Vec<Vec<u8>> {
    registry()
        .tensors
        .iter()
        .enumerate()
        .map(|(t, m)| {
            (0..m.len).map(|i| (i * 31 + iter * 7 + rank as u64 * 131 + t as u64).wrapping_mul(2654435761) as u8).collect()
        })
        .collect()
}

fn refs(b: &[Vec<u8>]) -> Vec<&[u8]> {
    b.iter().map(|v| v.as_slice()).collect()
}

/// Run `f(rank, engine)` on every rank of an `n`-rank world, in threads.
fn run<T: Send + 'static>(n: usize, cfg: EngineConfig, f: impl Fn(usize, &mut Engine) -> T + Send + Sync + 'static) -> Vec<T> {
    let f = Arc::new(f);
    let hs: Vec<_> = world(n)
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (f, cfg) = (f.clone(), cfg.clone());
            std::thread::spawn(move || {
                let mut e = Engine::new(Arc::new(comm), registry(), cfg).unwrap();
                let out = f(rank, &mut e);
                e.shutdown().unwrap();
                out
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn cfg() -> EngineConfig {
    EngineConfig { chunk_bytes: 16 << 10, copy_threads: 2, timeout: Duration::from_secs(60), ..EngineConfig::default() }
}

#[test]
fn placement_is_mixed_groups_then_ring() {
    assert_eq!(placement(4, 2), vec![vec![1], vec![0], vec![3], vec![2]]);
    assert_eq!(placement(5, 2), vec![vec![1], vec![0], vec![3], vec![2], vec![0]]);
    assert_eq!(placement(3, 3), vec![vec![1, 2], vec![0, 2], vec![0, 1]]);
    assert_eq!(placement(2, 5), vec![vec![1], vec![0]]);
    assert_eq!(placement(3, 1), vec![Vec::<usize>::new(); 3]);
}

#[test]
fn with_several_hosts_every_replica_is_on_another_host() {
    // 2 hosts x 2 ranks (the launcher's layout: rank / ranks-per-host), 2 copies: each rank's
    // replica is the rank at the same place on the other host
    let hosts = ["h0", "h0", "h1", "h1"];
    assert_eq!(placement_on_hosts(&hosts, 2), vec![vec![2], vec![3], vec![0], vec![1]]);
    // 3 copies over 3 hosts: one on each other host
    let hosts = [0, 0, 1, 1, 2, 2];
    let p = placement_on_hosts(&hosts, 3);
    assert_eq!(p[0], vec![2, 4]);
    assert_eq!(p[5], vec![1, 3]);
    // more copies than other hosts: the next places on them, never the rank's own host
    let p = placement_on_hosts(&["a", "a", "a", "b", "b", "b"], 3);
    assert_eq!(p[0], vec![3, 4]);
    for (r, hs) in p.iter().enumerate() {
        assert!(hs.iter().all(|&h| (h < 3) != (r < 3)), "rank {r}: {hs:?}");
    }
    // uneven hosts, and one host falling back to consecutive groups
    let p = placement_on_hosts(&[1, 1, 1, 2], 2);
    assert_eq!(p, vec![vec![3], vec![3], vec![3], vec![0]]);
    assert_eq!(placement_on_hosts(&[7, 7, 7, 7], 2), placement(4, 2));
}

#[test]
fn iterations_commit_and_restore_from_local_memory() {
    let out = run(4, cfg(), |rank, e| {
        let mut committed = Vec::new();
        for it in 1..=3 {
            e.checkpoint(it, &refs(&state(rank, it))).unwrap();
            committed.push(e.commit(true).unwrap());
        }
        let r = e.restore_latest().unwrap();
        assert!(e.failures().is_empty(), "{:?}", e.failures());
        (committed, r.iter, r.source, r.snapshot.data.clone())
    });
    for (rank, (committed, iter, source, data)) in out.into_iter().enumerate() {
        assert_eq!(committed, vec![Some(1), Some(2), Some(3)]);
        assert_eq!(iter, 3);
        assert_eq!(source, Source::Local);
        assert_eq!(data, state(rank, 3).concat());
    }
}

#[test]
fn a_restarted_rank_gets_its_state_from_a_peer_bit_identical() {
    let out = run(4, cfg(), |rank, e| {
        for it in 1..=2 {
            e.checkpoint(it, &refs(&state(rank, it))).unwrap();
            e.commit(true).unwrap();
        }
        if rank == 2 {
            e.forget_memory_for_test(); // as if killed and restarted
        }
        let r = e.restore_latest().unwrap();
        (r.iter, r.source, r.snapshot.data.clone())
    });
    assert_eq!(out[2].0, 2);
    assert_eq!(out[2].1, Source::Peer(3));
    assert_eq!(out[2].2, state(2, 2).concat());
    assert_eq!(out[0].1, Source::Local);
}

#[test]
fn a_flipped_byte_in_a_replica_falls_back_to_another_replica() {
    let c = EngineConfig { replicas: 3, ..cfg() };
    let out = run(3, c, |rank, e| {
        e.checkpoint(5, &refs(&state(rank, 5))).unwrap();
        e.commit(true).unwrap();
        // rank 1 loses its memory; the replica of rank 1 held by rank 0 is corrupted
        if rank == 0 {
            assert!(e.corrupt_replica_for_test(1, 5, 1000));
        }
        if rank == 1 {
            e.forget_memory_for_test();
        }
        let r = e.restore_latest().unwrap();
        (r.source, r.snapshot.data.clone())
    });
    assert_eq!(out[1].0, Source::Peer(2), "the corrupt replica on rank 0 must be skipped");
    assert_eq!(out[1].1, state(1, 5).concat());
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ironweave-engine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn all_replicas_corrupt_falls_back_to_the_persistent_tier() {
    let dir = tmpdir("persist");
    let c = EngineConfig { persist_dir: Some(dir.clone()), persist_every: 2, ..cfg() };
    let out = run(2, c, |rank, e| {
        for it in 1..=3 {
            let rep = e.checkpoint(it, &refs(&state(rank, it))).unwrap();
            assert_eq!(rep.persisted, it == 2);
            e.commit(true).unwrap();
        }
        // rank 0 restarts and its only replica (on rank 1) is corrupt: iteration 3 exists only
        // for rank 1, so everyone goes back to iteration 2, which rank 0 has on disk
        if rank == 0 {
            e.forget_memory_for_test();
        }
        if rank == 1 {
            assert!(e.corrupt_replica_for_test(0, 3, 10));
            assert!(e.corrupt_replica_for_test(0, 2, 10));
        }
        let r = e.restore_latest().unwrap();
        (r.iter, r.source, r.snapshot.data.clone())
    });
    assert_eq!(out[0].0, 2);
    assert_eq!(out[0].1, Source::Persistent);
    assert_eq!(out[0].2, state(0, 2).concat());
    assert_eq!(out[1].0, 2);
    assert_eq!(out[1].2, state(1, 2).concat());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn nothing_valid_is_a_typed_error_naming_what_was_tried() {
    let out = run(2, cfg(), |rank, e| {
        e.checkpoint(1, &refs(&state(rank, 1))).unwrap();
        e.commit(true).unwrap();
        if rank == 0 {
            e.forget_memory_for_test();
        }
        if rank == 1 {
            e.corrupt_replica_for_test(0, 1, 0);
        }
        e.restore_latest().map(|r| r.iter).map_err(|e| e.to_string())
    });
    for r in out {
        let e = r.unwrap_err();
        assert!(e.contains("no valid checkpoint") && e.contains("rank 0: nothing valid"), "{e}");
    }
    let _ = CkptError::Invalid(String::new());
}

#[test]
fn a_torn_iteration_is_never_committed_and_later_ones_are() {
    let out = run(2, cfg(), |rank, e| {
        let mut committed = Vec::new();
        for it in 1..=3 {
            if rank == 0 && it == 2 {
                e.corrupt_in_transit_for_test(2);
            }
            e.checkpoint(it, &refs(&state(rank, it))).unwrap();
            committed.push(e.commit(true).unwrap());
        }
        (committed, e.failures())
    });
    // iteration 2 of rank 0 arrived corrupt at rank 1: not committed anywhere; 3 commits
    assert_eq!(out[0].0, vec![Some(1), Some(1), Some(3)]);
    assert_eq!(out[1].0, vec![Some(1), Some(1), Some(3)]);
    assert!(out[1].1.iter().any(|f| f.contains("replica of rank 0 iteration 2 failed verification")), "{:?}", out[1].1);
}

#[test]
fn the_replica_path_counts_its_cpu_per_byte() {
    // two ranks replicate to each other for a few iterations over TCP; the counters say how much
    // CPU the sender and receiver threads spent on the bytes they moved
    let out = run(2, cfg(), |rank, e| {
        for it in 1..=4 {
            e.begin_iteration(it, None);
            e.end_iteration();
            e.checkpoint(it, &refs(&state(rank, it))).unwrap();
            e.commit(false).unwrap();
        }
        e.commit(true).unwrap();
        use std::sync::atomic::Ordering::Relaxed;
        let c = e.counters();
        (c.replica_bytes.load(Relaxed), c.replica_send_cpu_ns.load(Relaxed), c.replica_recv_cpu_ns.load(Relaxed))
    });
    for (rank, (bytes, send, recv)) in out.into_iter().enumerate() {
        assert!(bytes >= 4 * registry().total, "rank {rank} sent {bytes} bytes");
        assert!(send > 0, "rank {rank}: the senders' CPU was not counted");
        assert!(recv > 0, "rank {rank}: the receivers' CPU was not counted");
    }
}
