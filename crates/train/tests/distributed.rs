//! Expert + data parallelism over TCP gives the gradients of one process training on the
//! union of the ranks' batches; distributed training is deterministic and learns.

use std::sync::Arc;
use std::time::Duration;

use ironweave_tcp::TcpConfig;
use ironweave_train::data::Corpus;
use ironweave_train::dist::Dist;
use ironweave_train::{TrainConfig, Trainer};
use ironweave_transport::{CommOptions, Communicator};

fn world(n: usize) -> Vec<Communicator> {
    let cfg = TcpConfig { timeout: Duration::from_secs(60), linger: Duration::from_secs(2), ..TcpConfig::default() };
    ironweave_tcp::local_world(n, &cfg, CommOptions { timeout: Duration::from_secs(120), ..CommOptions::default() }).unwrap()
}

fn cfg(no_drops: bool) -> (TrainConfig, Corpus) {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let mut text = std::fs::read_to_string(format!("{root}/configs/moe-tiny.toml")).unwrap();
    if no_drops {
        // no token dropped and no load-balancing loss: then the split is exactly equivalent
        text = text
            .replace("capacity_factor = 1.25", "capacity_factor = 100.0")
            .replace("moe_every = 1", "moe_every = 1\naux_loss_coef = 0.0");
    }
    let c = TrainConfig::from_toml_str(&text).unwrap();
    let corpus = Corpus::load(std::path::Path::new(&format!("{root}/{}", c.data.path)), c.model.seq).unwrap();
    (c, corpus)
}

#[test]
fn expert_and_data_parallel_gradients_equal_the_single_process_ones() {
    let (c, corpus) = cfg(true);
    let (b, t, seed) = (c.train.batch, c.model.seq, c.train.seed);
    // single process on the union of both ranks' batches
    let single = Trainer::new(c.clone(), corpus.clone(), 0);
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for r in 0..2 {
        let (x, y) = corpus.batch(seed, 1, r, b, t);
        xs.extend(x);
        ys.extend(y);
    }
    let (loss1, _, g1) = single.gradients(&xs, &ys, 2 * b, None).unwrap();
    let names: Vec<String> = single.params.list.iter().map(|p| p.name.clone()).collect();
    let hs: Vec<_> = world(2)
        .into_iter()
        .map(|comm| {
            let (c, corpus) = (c.clone(), corpus.clone());
            std::thread::spawn(move || {
                let d = Dist { comm: Arc::new(comm), prof: None };
                let r = d.rank();
                let tr = Trainer::distributed(c.clone(), corpus.clone(), d).unwrap();
                let (x, y) = corpus.batch(c.train.seed, 1, r, c.train.batch, c.model.seq);
                let (loss, _, g) = tr.gradients(&x, &y, c.train.batch, None).unwrap();
                let names: Vec<String> = tr.params.list.iter().map(|p| p.name.clone()).collect();
                (loss, names, g)
            })
        })
        .collect();
    let outs: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    for (loss, rnames, g) in &outs {
        assert!((loss - loss1).abs() < 1e-4, "loss {loss} vs {loss1}");
        for (name, gr) in rnames.iter().zip(g) {
            let i = names.iter().position(|n| n == name).unwrap();
            let scale = g1[i].iter().fold(1e-6f32, |a, &x| a.max(x.abs()));
            let diff = g1[i].iter().zip(gr).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(diff <= 2e-3 * scale, "{name}: max difference {diff} vs scale {scale}");
        }
    }
    // every expert lives on exactly one rank
    let experts: usize = outs.iter().map(|o| o.1.iter().filter(|n| n.contains(".e")).count()).sum();
    assert_eq!(experts, names.iter().filter(|n| n.contains(".e")).count());
}

#[test]
fn distributed_training_is_deterministic_and_learns() {
    let run = || {
        let (c, corpus) = cfg(false);
        let hs: Vec<_> = world(2)
            .into_iter()
            .map(|comm| {
                let (c, corpus) = (c.clone(), corpus.clone());
                std::thread::spawn(move || {
                    let mut tr = Trainer::distributed(c, corpus, Dist { comm: Arc::new(comm), prof: None }).unwrap();
                    let losses: Vec<f32> = (0..20).map(|_| tr.step(None).unwrap().loss).collect();
                    (losses, tr.state_sha256())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    };
    let a = run();
    let b = run();
    assert_eq!(a[0].1, b[0].1);
    assert_eq!(a[1].1, b[1].1);
    assert_eq!(a[0].0, a[1].0, "both ranks report the averaged loss");
    let l = &a[0].0;
    assert!(l[15..].iter().sum::<f32>() / 5.0 < l[..5].iter().sum::<f32>() / 5.0 - 0.2, "{l:?}");
}

/// Trains `iters` steps on `n` ranks with dense gradients averaged in `bucket_kb` buckets
/// (0: one bucket after backward); returns every rank's state digest and its bucket count.
fn train_with_buckets(n: usize, bucket_kb: usize, iters: usize) -> Vec<([u8; 32], usize, usize)> {
    let (mut c, corpus) = cfg(false);
    c.train.bucket_kb = bucket_kb;
    let hs: Vec<_> = world(n)
        .into_iter()
        .map(|comm| {
            let (c, corpus) = (c.clone(), corpus.clone());
            std::thread::spawn(move || {
                let mut tr = Trainer::distributed(c, corpus, Dist { comm: Arc::new(comm), prof: None }).unwrap();
                let mut averaged = 0;
                for _ in 0..iters {
                    averaged += tr.step(None).unwrap().sync.buckets;
                }
                (tr.state_digest(), tr.buckets().len(), averaged)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn bucketed_gradients_are_bit_identical_to_one_bucket() {
    // 4 ranks: with a ring all-reduce, where an element's chunk falls decides the order its
    // four parts are added in, so two bucketings would differ; the rank-ordered average does not
    for n in [2, 4] {
        let single = train_with_buckets(n, 0, 3);
        let bucketed = train_with_buckets(n, 8, 3);
        for (r, ((d1, b1, a1), (d2, b2, a2))) in single.iter().zip(&bucketed).enumerate() {
            assert_eq!(*b1, 1, "single-bucket path, rank {r}");
            assert!(*b2 >= 4, "8 KiB buckets on moe-tiny should give several buckets, got {b2}");
            assert_eq!((*a1, *a2), (3, 3 * b2), "every bucket averaged every iteration");
            assert_eq!(d1, d2, "{n} ranks, rank {r}: bucketed state differs from the single-bucket one");
        }
    }
}
