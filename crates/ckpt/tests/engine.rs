//! Replication, commit and recovery over real TCP connections (one thread per rank).

use std::sync::Arc;
use std::time::Duration;

use ironweave_ckpt::{placement, placement_on_hosts, CkptError, DType, Engine, EngineConfig, Registry, Source, TensorSpec};

mod common;
use common::world;

fn registry() -> Registry {
    Registry::new(&[
        TensorSpec::new("w", DType::F32, &[300, 101]),
        TensorSpec::new("adam.m", DType::F32, &[300, 101]),
        TensorSpec::new("step", DType::I64, &[]),
        TensorSpec::new("rng", DType::U8, &[32]),
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
    run_each(n, move |_| cfg.clone(), f)
}

/// [`run`] with each rank's own configuration.
fn run_each<T: Send + 'static>(
    n: usize,
    cfg: impl Fn(usize) -> EngineConfig,
    f: impl Fn(usize, &mut Engine) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let hs: Vec<_> = world(n)
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (f, cfg) = (f.clone(), cfg(rank));
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
        (committed, r.iter, r.source, r.snapshot.data.to_vec())
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
        (r.iter, r.source, r.snapshot.data.to_vec())
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
        (r.source, r.snapshot.data.to_vec())
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
        (r.iter, r.source, r.snapshot.data.to_vec())
    });
    assert_eq!(out[0].0, 2);
    assert_eq!(out[0].1, Source::Persistent);
    assert_eq!(out[0].2, state(0, 2).concat());
    assert_eq!(out[1].0, 2);
    assert_eq!(out[1].2, state(1, 2).concat());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_new_job_in_a_reused_directory_never_restores_the_old_job_s_files() {
    // job A persists iterations 1..=4 and ends; job B starts with the same layout in the same
    // directory and fails before its first checkpoint: it must not take A's iteration 4 for
    // its own state (it restores it only when told to continue A)
    let dir = tmpdir("two-jobs");
    let a = EngineConfig { persist_dir: Some(dir.clone()), persist_every: 1, job_id: Some("job-a".into()), ..cfg() };
    run(2, a, |rank, e| {
        for it in 1..=4 {
            e.checkpoint(it, &refs(&state(rank, it))).unwrap();
            e.commit(true).unwrap();
        }
        assert_eq!(e.job_id(), "job-a");
    });
    let b = EngineConfig { persist_dir: Some(dir.clone()), persist_every: 1, job_id: Some("job-b".into()), ..cfg() };
    let out = run(2, b.clone(), |_, e| e.restore_latest().map(|r| r.iter).map_err(|e| e.to_string()));
    for r in out {
        let e = r.unwrap_err();
        assert!(e.contains("no valid checkpoint") && e.contains("iteration 4 (job \"job-a\")"), "{e}");
        assert!(e.contains("restore_other_jobs"), "the error says how to continue the other job: {e}");
    }
    // job B's own files are taken, job A's newer ones passed over
    let out = run(2, b.clone(), |rank, e| {
        e.checkpoint(2, &refs(&state(rank, 102))).unwrap();
        e.commit(true).unwrap();
        e.forget_memory_for_test();
        let r = e.restore_latest().unwrap();
        (r.iter, r.source, r.snapshot.data.to_vec())
    });
    for (rank, (iter, source, data)) in out.into_iter().enumerate() {
        assert_eq!((iter, source), (2, Source::Persistent));
        assert_eq!(data, state(rank, 102).concat(), "rank {rank} restored job B's iteration 2");
    }
    // a job told to continue another job's files takes A's iteration 4 (B's 2 is older)
    let c = EngineConfig { restore_other_jobs: true, job_id: Some("job-c".into()), ..b };
    let out = run(2, c, |_, e| e.restore_latest().map(|r| (r.iter, r.snapshot.data.to_vec())).unwrap());
    for (rank, (iter, data)) in out.into_iter().enumerate() {
        assert_eq!(iter, 4);
        assert_eq!(data, state(rank, 4).concat());
    }
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
fn a_host_lost_while_commits_lag_finds_the_committed_iteration_everywhere() {
    // 2 hosts x 2 ranks, each rank's replica on the other host. Iteration 1 commits; then rank
    // 1's link delivers nothing, so iterations 2 and 3 never commit. Every rank must keep its
    // own copy of iteration 1, and host b must keep its replica of rank 0's iteration 1 although
    // it holds a complete, newer one (2): rank 1's newest complete copy is 1. Host a is then
    // lost (ranks 0 and 1 restart with nothing). Before the fix the survivors had refilled their
    // buffers of iteration 1 and host b had dropped rank 0's replica of it: nothing restorable.
    let host = |rank: usize| if rank < 2 { "a" } else { "b" };
    let cfg = move |rank: usize| EngineConfig { replicas: 2, host: host(rank).into(), timeout: Duration::from_secs(6), ..cfg() };
    let out = run_each(4, cfg, |rank, e| {
        use std::sync::atomic::Ordering::Relaxed;
        let mut committed = vec![];
        let mut bytes = vec![];
        e.checkpoint(1, &refs(&state(rank, 1))).unwrap();
        committed.push(e.commit(true).unwrap());
        if rank == 1 {
            e.stall_replication_for_test(true);
        }
        for it in 2..=4 {
            bytes.push(e.checkpoint(it, &refs(&state(rank, it))).unwrap().bytes);
            // waits (bounded: rank 1's never come) for the acknowledgements of what was sent
            committed.push(e.commit(true).unwrap());
        }
        let skipped = e.counters().snapshots_skipped.load(Relaxed);
        // host a is lost: its ranks restart with nothing
        if rank < 2 {
            e.forget_memory_for_test();
            e.stall_replication_for_test(false);
        }
        let r = e.restore_latest().unwrap();
        let restored = (r.iter, r.source, r.snapshot.data == state(rank, 1).concat());
        drop(r);
        // training goes on from the restored iteration and commits again
        e.checkpoint(2, &refs(&state(rank, 2))).unwrap();
        let after = e.commit(true).unwrap();
        (committed, bytes, skipped, restored, after)
    });
    let total = registry().total;
    for (rank, (committed, bytes, skipped, restored, after)) in out.into_iter().enumerate() {
        assert_eq!(committed, vec![Some(1); 4], "rank {rank}");
        // iterations 1, 2 and 3 fill the buffers while only 1 is committed: 4 is not taken
        assert_eq!(bytes, vec![total, total, 0], "rank {rank}");
        assert_eq!(skipped, 1, "rank {rank}");
        let source = if rank < 2 { Source::Peer(rank + 2) } else { Source::Local };
        assert_eq!(restored, (1, source, true), "rank {rank}");
        assert_eq!(after, Some(2), "rank {rank}");
    }
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
        (
            c.replica_bytes.load(Relaxed),
            c.replica_send_cpu_ns.load(Relaxed),
            c.replica_recv_cpu_ns.load(Relaxed),
            c.snapshots_skipped.load(Relaxed),
        )
    });
    for (rank, (bytes, send, recv, skipped)) in out.into_iter().enumerate() {
        // a snapshot whose buffers are all still held by unacknowledged ones is skipped (on a
        // loaded machine the acknowledgements can lag a non-blocking commit); every other one
        // is sent whole
        assert!(skipped < 4, "rank {rank}: every snapshot skipped");
        assert!(bytes >= (4 - skipped) * registry().total, "rank {rank} sent {bytes} bytes, {skipped} snapshots skipped");
        assert!(send > 0, "rank {rank}: the senders' CPU was not counted");
        assert!(recv > 0, "rank {rank}: the receivers' CPU was not counted");
    }
}

#[test]
fn a_snapshot_spread_over_iterations_sends_a_part_per_iteration_and_restores_whole() {
    // one snapshot every 4 iterations, a quarter of it per iteration: a restarted rank gets the
    // newest snapshot whose every part arrived, bit-identical, never a mix of iterations
    let c = EngineConfig { spread_iters: 4, ..cfg() };
    let total = registry().total;
    let out = run(2, c, move |rank, e| {
        use std::sync::atomic::Ordering::Relaxed;
        let mut per_iter = Vec::new();
        let mut committed = Vec::new();
        let mut expect = 0;
        for it in 1..=10 {
            let before = e.counters().replica_bytes.load(Relaxed);
            e.begin_iteration(it, None);
            e.end_iteration();
            if it > 1 {
                let (a, z) = ironweave_ckpt::engine::part_range(total, 4, (it - 2) % 4);
                expect += z - a;
            }
            // the sender threads count what they sent: wait (bounded) for at least the part due
            let t0 = std::time::Instant::now();
            while e.counters().replica_bytes.load(Relaxed) < expect && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(1));
            }
            per_iter.push(e.counters().replica_bytes.load(Relaxed) - before);
            e.checkpoint(it, &refs(&state(rank, it))).unwrap();
            committed.push(e.commit(false).unwrap());
        }
        // snapshot 5's last part went in iteration 9: wait (collectively, bounded) for its
        // acknowledgement; the part of snapshot 9 in flight is never waited for
        let t0 = std::time::Instant::now();
        while e.commit(false).unwrap() != Some(5) && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if rank == 1 {
            e.forget_memory_for_test();
        }
        let r = e.restore_latest().unwrap();
        (per_iter, committed, r.iter, r.source, r.snapshot.data.to_vec())
    });
    for (rank, (per_iter, committed, iter, source, data)) in out.into_iter().enumerate() {
        // snapshots of 1, 5, 9; iteration k+1..k+4 each carry a quarter of snapshot k
        assert_eq!(per_iter[0], 0, "rank {rank}: nothing to send in iteration 1");
        for (i, &b) in per_iter.iter().enumerate().skip(1) {
            let (a, z) = ironweave_ckpt::engine::part_range(total, 4, (i as u64 - 1) % 4);
            assert_eq!(b, z - a, "rank {rank}: iteration {} sent {b} bytes", i + 1);
        }
        // commit only ever names a snapshot iteration, and 5 once its last part was acknowledged
        assert!(committed.iter().flatten().all(|i| [1, 5].contains(i)), "rank {rank}: {committed:?}");
        assert_eq!(iter, 5, "rank {rank}: the newest snapshot every part of which arrived");
        assert_eq!(data, state(rank, 5).concat(), "rank {rank}");
        assert_eq!(source, if rank == 1 { Source::Peer(0) } else { Source::Local });
    }
}

#[test]
fn parts_cover_the_snapshot_exactly() {
    use ironweave_ckpt::engine::part_range;
    for total in [0u64, 1, 7, 1000, 1 << 40] {
        for parts in 1..=9 {
            let mut at = 0;
            for k in 0..parts {
                let (a, z) = part_range(total, parts, k);
                assert_eq!(a, at);
                assert!(z >= a && z - a <= total / parts + 1);
                at = z;
            }
            assert_eq!(at, total);
        }
    }
}

#[test]
fn the_holder_judges_each_chunk_by_its_wire_time_against_its_own_training() {
    // Every iteration: a training communication of 30 ms on link 0, then 30 ms idle. Capricorn
    // releases the chunks when the communication ends, so they travel in the idle part. When
    // the holder (rank 1) keeps its own training communication open the whole iteration, the
    // same chunks reach it while its link is busy: its wire accuracy must fall to 0.
    fn run_with(holder_busy: bool) -> (u64, u64) {
        let out = run(2, cfg(), move |rank, e| {
            use std::sync::atomic::Ordering::Relaxed;
            for it in 1..=6 {
                e.begin_iteration(it, None);
                let prof = e.profiler().clone();
                if rank == 1 && holder_busy {
                    let _c = prof.comm(0, ironweave_profile::CommKind::Training, 1);
                    std::thread::sleep(Duration::from_millis(60));
                } else {
                    {
                        let _c = prof.comm(0, ironweave_profile::CommKind::Training, 1);
                        std::thread::sleep(Duration::from_millis(30));
                    }
                    std::thread::sleep(Duration::from_millis(30));
                }
                e.end_iteration();
                e.checkpoint(it, &refs(&state(rank, it))).unwrap();
                e.commit(false).unwrap();
            }
            let c = e.counters();
            (c.wire_chunks_in_window.load(Relaxed), c.wire_chunks.load(Relaxed))
        });
        out[1]
    }
    let (inside, n) = run_with(false);
    assert!(n > 0 && inside > 0, "chunks released after the communication arrive in the idle window: {inside} of {n}");
    let (inside, n) = run_with(true);
    assert!(n > 0, "rank 1 received chunks");
    assert_eq!(inside, 0, "rank 1's link was busy with its own training the whole time: {inside} of {n} judged idle");
}

/// Copies kept in a directory that outlives the process (`EngineConfig::keep_dir`): every
/// process of the job dies (torchrun restarts them all) and new engines restore from them —
/// each rank from its own copies, a rank whose copies are gone (its host lost) from a peer's,
/// bit-identical; another job's copies are never taken; the job's end removes them.
#[test]
fn kept_copies_outlive_every_process_of_the_job() {
    let dir = std::env::temp_dir().join(format!("ironweave-keep-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let keep = EngineConfig { keep_dir: Some(dir.clone()), job_id: Some("job-k".into()), ..cfg() };
    // the first processes: 4 iterations committed
    let committed = run(3, keep.clone(), |rank, e| {
        for it in 1..=4 {
            e.checkpoint(it, &refs(&state(rank, it))).unwrap();
            e.commit(true).unwrap();
        }
        e.kept().unwrap()
    });
    assert_eq!(committed, vec![Some(4); 3]);
    // the copies of the two newest committed iterations are there: the snapshot and replica
    // segments themselves, and per iteration one manifest per copy (own state, the replica held)
    for rank in 0..3 {
        let holder = ironweave_ckpt::engine::holder_dir(&dir, rank);
        let mut names: Vec<String> =
            std::fs::read_dir(&holder).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        let iters: Vec<&String> = names.iter().filter(|n| n.starts_with("iter-")).collect();
        assert_eq!(iters, vec!["iter-00000003", "iter-00000004"], "rank {rank}");
        let own = names.iter().filter(|n| n.starts_with("own-") && n.ends_with(".seg")).count();
        assert_eq!(own, ironweave_ckpt::SNAPSHOT_BUFFERS, "rank {rank}: one segment per snapshot buffer, reused: {names:?}");
        let held = placement(3, 2).iter().filter(|hs| hs.contains(&rank)).count();
        assert_eq!(names.iter().any(|n| n.starts_with("rep-")), held > 0, "rank {rank}: replica segments: {names:?}");
        let files = std::fs::read_dir(holder.join("iter-00000004")).unwrap().count();
        assert_eq!(files, 1 + held, "rank {rank}: a manifest for its own state and each replica it holds");
    }
    // every process restarted: each rank's own kept copy, its segments mapped, not read
    let restore = |rank: usize, e: &mut Engine| {
        let r = e.restore_latest().unwrap();
        (r.iter, r.source, r.snapshot.data == state(rank, r.iter).concat())
    };
    let out = run(3, keep.clone(), move |rank, e| {
        use std::sync::atomic::Ordering::Relaxed;
        let r = restore(rank, e);
        let c = e.counters();
        (r, c.kept_bytes_mapped.load(Relaxed), c.kept_bytes_copied.load(Relaxed))
    });
    for (rank, (r, mapped, copied)) in out.into_iter().enumerate() {
        assert_eq!(r, (4, Source::Local, true), "rank {rank}");
        let own = state(rank, 4).concat().len() as u64;
        assert!(mapped >= own && copied == 0, "rank {rank}: kept bytes mapped {mapped}, copied {copied}");
    }
    // rank 0's own segment of iteration 4 altered behind its back: refused by its checksums,
    // and rank 0 restores iteration 4 from the peer holding its replica
    {
        let holder = ironweave_ckpt::engine::holder_dir(&dir, 0);
        let man: serde_json::Value =
            serde_json::from_slice(&std::fs::read(holder.join("iter-00000004/rank-00000.json")).unwrap()).unwrap();
        let seg = holder.join(man["segment"].as_str().unwrap());
        let mut bytes = std::fs::read(&seg).unwrap();
        bytes[3] ^= 0x10;
        std::fs::write(&seg, &bytes).unwrap();
    }
    let out = run(3, keep.clone(), move |rank, e| (restore(rank, e), e.failures()));
    assert_eq!(out[0].0 .0, 4);
    assert!(matches!(out[0].0 .1, Source::Peer(p) if p != 0) && out[0].0 .2, "{:?}", out[0].0);
    assert!(out[0].1.iter().any(|f| f.contains("checksum") && f.contains("own-")), "{:?}", out[0].1);
    // rank 1's host lost with its copies: its state comes from the rank that held its replica
    std::fs::remove_dir_all(ironweave_ckpt::engine::holder_dir(&dir, 1)).unwrap();
    let out = run(3, keep.clone(), restore);
    assert_eq!(out[1].0, 4);
    assert!(matches!(out[1].1, Source::Peer(p) if p != 1), "{:?}", out[1].1);
    assert!(out[1].2, "rank 1's state from a peer differs from the one it committed");
    assert_eq!((out[0].1, out[2].1), (Source::Local, Source::Local));
    // another job finds nothing of this one (and says so), and the copies stay
    let other = EngineConfig { job_id: Some("job-other".into()), ..keep.clone() };
    let out = run(3, other, |_, e| match e.restore_latest() {
        Err(CkptError::NothingToRestore { .. }) => e.failures().iter().any(|f| f.contains("of job \"job-k\"")),
        r => panic!("another job restored {:?}", r.map(|r| r.iter)),
    });
    // (rank 1 kept the state it restored from its peer again: its copies are back)
    assert_eq!(out, vec![true; 3]);
    // the job ends: every rank removes its copies, after which nothing is left to restore
    run(3, keep.clone(), |_, e| {
        e.restore_latest().unwrap();
        e.comm().barrier().unwrap();
        let root = e.remove_kept().unwrap().unwrap();
        e.comm().barrier().unwrap();
        if e.comm().rank() == 0 {
            std::fs::remove_dir(root).unwrap();
        }
    });
    assert!(!dir.exists(), "the keep directory outlived the job's end");
    let out = run(3, keep, |_, e| matches!(e.restore_latest(), Err(CkptError::NothingToRestore { .. })));
    assert_eq!(out, vec![true; 3]);
}
