//! Tensor parallelism is the same training: the loss sequence of every degree and schedule
//! equals one rank's within 1e-4 (relative) per iteration, and the Megatron and Oases
//! schedules end with the same parameters within float tolerance. Ranks are threads over the
//! in-process transport; collectives run on their collective threads as in a real job.

use ironweave_overlap::Schedule;
use ironweave_train::data::Corpus;
use ironweave_train::model::Params;
use ironweave_train::tp::{TpSpec, TpTrainer};
use ironweave_train::{TrainConfig, Trainer};
use ironweave_transport::{inproc, CommOptions, Communicator};

const CFG: &str = r#"
name = "gpt-tp-test"
[model]
layers = 2
hidden = 64
heads = 4
seq = 32
experts = 1
top_k = 1
capacity_factor = 1.0
moe_every = 1000
ffn_mult = 4
[train]
batch = 4
lr = 2e-3
weight_decay = 0.01
seed = 7
[data]
path = "data/kjv-genesis-esther.txt"
"#;

const ITERS: usize = 10;

fn setup() -> (TrainConfig, Corpus) {
    let c = TrainConfig::from_toml_str(CFG).unwrap();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let corpus = Corpus::load(std::path::Path::new(&format!("{root}/{}", c.data.path)), c.model.seq).unwrap();
    (c, corpus)
}

/// Rank 0's losses and every rank's final parameters.
fn run(n: usize, spec: TpSpec) -> (Vec<f32>, Vec<Params>) {
    let (cfg, corpus) = setup();
    let comms: Vec<Communicator> =
        inproc::world(n).into_iter().map(|l| Communicator::new(vec![l], CommOptions::default()).unwrap()).collect();
    let mut out: Vec<(usize, Vec<f32>, Params)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let (cfg, corpus, spec) = (cfg.clone(), corpus.clone(), spec.clone());
                s.spawn(move || {
                    let mut tr = TpTrainer::new(cfg, corpus, (n > 1).then_some(c), spec).unwrap();
                    let losses: Vec<f32> = (0..ITERS).map(|_| tr.step().unwrap().loss).collect();
                    (c.rank(), losses, tr.params)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    out.sort_by_key(|o| o.0);
    let losses = out[0].1.clone();
    (losses, out.into_iter().map(|o| o.2).collect())
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    let m = a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs()).fold(0f32, f32::max);
    eprintln!("{what}: max relative {m:.2e}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let rel = (x - y).abs() / y.abs().max(1e-6);
        assert!(rel <= 1e-4, "{what}: iteration {} loss {x} vs {y} (relative {rel:.2e})", i + 1);
    }
}

fn spec(tp: usize, schedule: Schedule, k: usize) -> TpSpec {
    TpSpec::uniform(tp, schedule, k)
}

#[test]
fn every_tensor_parallel_degree_and_schedule_trains_like_one_rank() {
    let (base, _) = run(1, spec(1, Schedule::Megatron, 1));
    // the tensor-parallel model at degree 1 is the reference model
    let (cfg, corpus) = setup();
    let mut reference = Trainer::new(cfg, corpus, 0);
    let plain: Vec<f32> = (0..ITERS).map(|_| reference.step(None).unwrap().loss).collect();
    close(&base, &plain, "tp1 vs the reference trainer");
    assert!(base[ITERS - 1] < base[0], "it learns: {base:?}");
    for (n, s) in [
        (1, spec(1, Schedule::Oases, 2)),
        (2, spec(2, Schedule::Megatron, 1)),
        (2, spec(2, Schedule::Oases, 2)),
        (4, spec(4, Schedule::Megatron, 1)),
        (4, spec(4, Schedule::Oases, 2)),
        // per sub-layer degrees (L0.attn, L0.mlp, L1.attn, L1.mlp), the same 4 sequences in all,
        // resharded between sub-layers of different degrees
        (2, TpSpec { degrees: vec![2, 1, 1, 2], schedule: Schedule::Oases, sub_batches: 2, global_batch: Some(4) }),
        (4, TpSpec { degrees: vec![4, 1, 2, 4], schedule: Schedule::Megatron, sub_batches: 1, global_batch: Some(4) }),
        (4, TpSpec { degrees: vec![1, 2, 4, 2], schedule: Schedule::Oases, sub_batches: 1, global_batch: Some(4) }),
    ] {
        let (l, _) = run(n, s.clone());
        close(&l, &base, &format!("tp{:?} {} k={}", s.degrees, s.schedule, s.sub_batches));
    }
}

#[test]
fn megatron_and_oases_end_with_the_same_parameters() {
    let (_, m) = run(2, spec(2, Schedule::Megatron, 1));
    let (_, o) = run(2, spec(2, Schedule::Oases, 2));
    let mut worst = 0f32;
    for (pm, po) in m.iter().zip(&o) {
        for (a, b) in pm.list.iter().zip(&po.list) {
            assert_eq!((&a.name, &a.shape), (&b.name, &b.shape));
            for (x, y) in a.w.iter().zip(&b.w) {
                worst = worst.max((x - y).abs());
            }
        }
    }
    // Adam's step is at most lr per iteration whatever the gradient's size: sub-batching
    // changes sums in the last bits only, so the parameters agree far below one step
    eprintln!("worst {worst}");
    assert!(worst < 2e-4, "largest parameter difference {worst}");
}

#[test]
fn tensor_by_data_parallel_grids_train_like_data_parallelism() {
    let (dp, _) = run(2, spec(1, Schedule::Oases, 2));
    let (grid, params) = run(4, spec(2, Schedule::Oases, 2));
    close(&grid, &dp, "tp2 x dp2 vs dp2");
    // the two data-parallel replicas of each shard are identical
    for (a, b) in params[0].list.iter().zip(&params[2].list) {
        assert_eq!(a.w, b.w, "{}", a.name);
    }
}

#[test]
fn layouts_that_cannot_split_are_refused_with_the_reason() {
    let (cfg, corpus) = setup();
    let e = TpTrainer::new(cfg.clone(), corpus.clone(), None, spec(3, Schedule::Oases, 2)).unwrap_err().to_string();
    assert!(e.contains("does not divide the 1 ranks"), "{e}");
    let e = TpTrainer::new(cfg.clone(), corpus.clone(), None, spec(1, Schedule::Oases, 9)).unwrap_err().to_string();
    assert!(e.contains("9 sub-batches of a batch of 4"), "{e}");
    let mut moe = cfg;
    moe.model.moe_every = 1;
    moe.model.experts = 2;
    let e = TpTrainer::new(moe, corpus, None, spec(1, Schedule::Oases, 2)).unwrap_err().to_string();
    assert!(e.contains("dense models"), "{e}");
}
