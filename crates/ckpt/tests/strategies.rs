//! The five strategies on a small training loop over TCP: layer timers, a training all-reduce
//! per layer on the checkpoint link, a checkpoint every iteration.

use std::sync::Arc;
use std::time::Duration;

use ironweave_ckpt::engine::{IterationReport, Strategy};
use ironweave_ckpt::{DType, Engine, EngineConfig, Registry, TensorSpec};
use ironweave_profile::{CommKind, ExpertLoad, Phase};
use ironweave_transport::ReduceOp;

mod common;
use common::world;

fn registry() -> Registry {
    Registry::new(&[TensorSpec::new("w", DType::F32, &[256, 1024]), TensorSpec::new("step", DType::I64, &[])]).unwrap()
}

fn load(iter: u64, shift_at: u64) -> ExpertLoad {
    let hot_first = iter < shift_at;
    ExpertLoad { tokens: vec![(0..8).map(|e| if (e < 4) == hot_first { 100 + iter % 3 } else { 10 }).collect(); 2] }
}

struct Outcome {
    reports: Vec<IterationReport>,
    committed: Option<u64>,
    /// Replica bytes sent per link slot; storage bytes written.
    per_link: Vec<u64>,
    storage: u64,
    /// After a restart of rank 1's memory: where each rank's state came from, and whether it
    /// equals the last checkpointed state.
    restored: Option<(ironweave_ckpt::Source, bool)>,
}

fn train(strategy: Strategy, iters: u64, shift_at: u64, dir: Option<std::path::PathBuf>) -> Vec<Outcome> {
    train_on(world(2), strategy, iters, shift_at, dir, Vec::new(), None)
}

/// Two ranks on `worlds`; chunks may also go over `extra_links`; the storage is paced at
/// `storage_rate` bytes/s when given.
fn train_on(
    worlds: Vec<ironweave_transport::Communicator>,
    strategy: Strategy,
    iters: u64,
    shift_at: u64,
    dir: Option<std::path::PathBuf>,
    extra_links: Vec<u32>,
    storage_rate: Option<f64>,
) -> Vec<Outcome> {
    let hs: Vec<_> = worlds
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let dir = dir.clone();
            let extra_links = extra_links.clone();
            std::thread::spawn(move || {
                let comm = Arc::new(comm);
                let cfg = EngineConfig {
                    strategy,
                    chunk_bytes: 64 << 10,
                    copy_threads: 1,
                    persist_dir: dir,
                    timeout: Duration::from_secs(60),
                    min_window_ns: 100_000,
                    // with a second link, the first is declared slow (20 MB/s: its 3 ms windows
                    // carry less than a chunk), so chunks take the second
                    link_bytes_per_s: (!extra_links.is_empty()).then_some(2e7),
                    extra_links,
                    storage_bytes_per_s: storage_rate,
                    ..EngineConfig::default()
                };
                let mut e = Engine::new(comm.clone(), registry(), cfg).unwrap();
                let mut w = vec![0u8; 256 * 1024 * 4];
                let mut reports = Vec::new();
                let mut grad = vec![0f32; 64 << 10];
                for it in 1..=iters {
                    e.begin_iteration(it, Some(&load(it, shift_at)));
                    let prof = e.profiler().clone();
                    for l in 0..4u32 {
                        {
                            let _t = prof.layer(l, Phase::Forward);
                            std::thread::sleep(Duration::from_millis(3));
                        }
                        let _c = prof.comm(0, CommKind::Training, (grad.len() * 4) as u64);
                        comm.all_reduce(&mut grad, ReduceOp::Sum).unwrap();
                    }
                    for (i, b) in w.iter_mut().enumerate().take(4096) {
                        *b = (it as usize * 7 + i + rank) as u8;
                    }
                    reports.push(e.end_iteration());
                    e.checkpoint(it, &[&w, &it.to_le_bytes()]).unwrap();
                    e.commit(false).unwrap();
                }
                let committed = e.commit(true).unwrap();
                let c = e.counters();
                use std::sync::atomic::Ordering::Relaxed;
                let per_link: Vec<u64> = c.replica_bytes_per_link.iter().map(|x| x.load(Relaxed)).collect();
                let storage = c.storage_bytes.load(Relaxed);
                let restored = (committed.is_some() && strategy == Strategy::Capricorn).then(|| {
                    if rank == 1 {
                        e.forget_memory_for_test();
                    }
                    let r = e.restore_latest().unwrap();
                    (r.source, r.snapshot.tensor("w").unwrap() == &w[..])
                });
                e.shutdown().unwrap();
                Outcome { reports, committed, per_link, storage, restored }
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn capricorn_replicates_in_windows_and_reprofiles_only_on_drift() {
    let out = train(Strategy::Capricorn, 10, 6, None);
    for o in &out {
        assert_eq!(o.committed, Some(10));
        let profiled: Vec<u64> = o.reports.iter().filter(|r| r.profiled).map(|r| r.iter).collect();
        // the decision smooths the load (EWMA): a shift at 6 is caught within 2 iterations
        assert!(
            profiled.len() == 2 && profiled[0] == 1 && (6..=7).contains(&profiled[1]),
            "profiling must run at the start and when the load shifts: {profiled:?}"
        );
        // from iteration 2 on, the previous snapshot (1 MiB) goes out during the iteration
        for r in &o.reports[1..] {
            assert!(r.chunks > 0 && r.bytes_sent >= registry().total, "iteration {}: {r:?}", r.iter);
            // honest: leftovers and transfers still running at the end count as outside
            let a = r.partition_accuracy.expect("chunks were released");
            assert!((0.0..=1.0).contains(&a) && r.chunks_in_window <= r.chunks, "{r:?}");
            assert!(r.exposed_s > 0.0 && r.exposed_s < r.iter_s + 1.0, "{r:?}");
        }
    }
}

#[test]
fn capricorn_routes_chunks_over_an_idle_second_link() {
    // two loopback links; training all-reduces on the first only, so the second is one long
    // window and takes chunks from the start of every iteration
    let worlds = ironweave_tcp::local_world_on_links(2, &["a", "b"], Duration::from_secs(60)).unwrap();
    let out = train_on(worlds, Strategy::Capricorn, 6, 100, None, vec![1], None);
    for (rank, o) in out.iter().enumerate() {
        assert_eq!(o.committed, Some(6));
        assert!(o.per_link[1] > 0, "rank {rank}: nothing went over the second link: {:?}", o.per_link);
        // every snapshot went out whole, over the two links together
        assert_eq!(o.per_link[0] + o.per_link[1], 6 * registry().total, "rank {rank}: {:?}", o.per_link);
        // and what arrived over both restores bit-identically from the peer
        let (source, same) = o.restored.expect("restored");
        assert!(same, "rank {rank}: restored state differs");
        if rank == 1 {
            assert_eq!(source, ironweave_ckpt::Source::Peer(0));
        }
    }
    // a second link the communicator does not have is refused
    let comm = Arc::new(world(1).pop().unwrap());
    let e = Engine::new(comm, registry(), EngineConfig { extra_links: vec![3], ..EngineConfig::default() }).unwrap_err();
    assert!(e.to_string().contains("extra link 3"), "{e}");
}

#[test]
fn gemini_profiles_its_first_iterations_only() {
    let out = train(Strategy::Gemini, 6, 3, None);
    for o in &out {
        assert_eq!(o.committed, Some(6));
        // gemini_profile_iters (3) at the start, then never again
        let profiled: Vec<u64> = o.reports.iter().filter(|r| r.profiled).map(|r| r.iter).collect();
        assert_eq!(profiled, vec![1, 2, 3]);
        assert!(o.reports[2..].iter().all(|r| r.chunks > 0));
        for r in &o.reports {
            assert!(r.chunks_in_window <= r.chunks && r.partition_accuracy.is_none_or(|a| (0.0..=1.0).contains(&a)), "{r:?}");
        }
    }
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ironweave-strat-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn storage_strategies_commit_what_is_written() {
    for s in [Strategy::Blocking, Strategy::Async] {
        let dir = tmpdir(s.name());
        // paced at 8 MB/s: about 0.13 s per 1 MiB write, and every byte counted
        let out = train_on(world(2), s, 4, 100, Some(dir.clone()), Vec::new(), Some(8e6));
        for (rank, o) in out.iter().enumerate() {
            assert_eq!(o.committed, Some(4), "{s:?}");
            assert_eq!(o.storage, 4 * registry().total, "{s:?}");
            assert!(o.reports.iter().all(|r| r.chunks == 0 && !r.profiled));
            assert_eq!(ironweave_ckpt::persist::iterations(&dir, rank as u32), vec![4, 3, 2, 1]);
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn none_commits_nothing_and_storage_strategies_need_a_directory() {
    for o in train(Strategy::None, 3, 100, None) {
        assert_eq!(o.committed, None);
    }
    let comm = Arc::new(world(1).pop().unwrap());
    let e = Engine::new(comm, registry(), EngineConfig { strategy: Strategy::Blocking, ..EngineConfig::default() }).unwrap_err();
    assert!(e.to_string().contains("persist_dir"), "{e}");
}

#[test]
fn async_at_the_interval_its_storage_sustains_skips_what_would_wait() {
    // one rank, writes paced at 2 MB/s (about 0.5 s per 1 MiB snapshot), six iterations back
    // to back: the first is written, the ones that come while it is on its way are skipped
    let dir = tmpdir("async-skip");
    let comm = Arc::new(world(1).pop().unwrap());
    let cfg = EngineConfig {
        strategy: Strategy::Async,
        persist_dir: Some(dir.clone()),
        storage_bytes_per_s: Some(2e6),
        async_skip_busy: true,
        timeout: Duration::from_secs(60),
        ..EngineConfig::default()
    };
    let mut e = Engine::new(comm, registry(), cfg).unwrap();
    let w = vec![0u8; registry().tensors[0].len as usize];
    let mut written = Vec::new();
    for it in 1..=6u64 {
        let step = (it as i64).to_le_bytes();
        if e.checkpoint(it, &[&w, &step]).unwrap().persisted {
            written.push(it);
        }
    }
    e.commit(true).unwrap();
    assert_eq!(written.first(), Some(&1), "{written:?}");
    assert!(written.len() < 6, "nothing was skipped: {written:?}");
    // what was written is on the tier, newest first
    let mut on_disk = ironweave_ckpt::persist::iterations(&dir, 0);
    on_disk.reverse();
    assert_eq!(on_disk, written);
    e.shutdown().unwrap();
    std::fs::remove_dir_all(&dir).ok();
}
