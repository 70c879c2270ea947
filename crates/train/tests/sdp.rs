//! Sharded data parallelism of the dense GPT is the same training as plain data parallelism:
//! 4 ranks (2 "hosts" of 2) over the in-process transport, 10 iterations; `full`, `hybrid` and
//! `hsdp` give the data-parallel trainer's loss at every iteration within 1e-4 (relative) and
//! its final parameters within fp tolerance, while each rank holds ~1/4 (`full`) or ~1/2
//! (`hybrid`) of the replicated state.

use ironweave_sdp::{Groups, Strategy};
use ironweave_train::data::Corpus;
use ironweave_train::dist::Dist;
use ironweave_train::sdp::SdpTrainer;
use ironweave_train::{TrainConfig, Trainer};
use ironweave_transport::{inproc, CommOptions, Communicator, ReduceOp};

const CFG: &str = r#"
name = "gpt-sdp-test"
[model]
layers = 2
hidden = 32
heads = 4
seq = 16
experts = 1
top_k = 1
capacity_factor = 1.0
moe_every = 1000
ffn_mult = 4
[train]
batch = 2
lr = 3e-3
weight_decay = 0.01
seed = 11
[data]
path = "data/kjv-genesis-esther.txt"
"#;

const ITERS: usize = 10;
const RANKS: usize = 4;

fn worlds(n: usize) -> Vec<Communicator> {
    inproc::world(n).into_iter().map(|l| Communicator::new(vec![l], CommOptions::default()).unwrap()).collect()
}

fn setup() -> (TrainConfig, Corpus) {
    let c = TrainConfig::from_toml_str(CFG).unwrap();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let corpus = Corpus::load(std::path::Path::new(&format!("{root}/{}", c.data.path)), c.model.seq).unwrap();
    (c, corpus)
}

/// Per rank: losses (mean over ranks), final parameters, state bytes held.
type Out = (Vec<f32>, Vec<Vec<f32>>, u64);

fn data_parallel() -> Vec<Out> {
    let (cfg, corpus) = setup();
    let worlds = worlds(RANKS);
    let hs: Vec<_> = worlds
        .into_iter()
        .map(|w| {
            let (cfg, corpus) = (cfg.clone(), corpus.clone());
            std::thread::spawn(move || {
                let w = std::sync::Arc::new(w);
                let mut tr = Trainer::distributed(cfg, corpus, Dist { comm: w.clone(), prof: None }).unwrap();
                let mut losses = Vec::new();
                for _ in 0..ITERS {
                    let mut l = [tr.step(None).unwrap().loss];
                    w.all_reduce(&mut l, ReduceOp::Avg).unwrap();
                    losses.push(l[0]);
                }
                let bytes = tr.params.list.iter().map(|p| (p.w.len() * 16) as u64).sum();
                (losses, tr.params.list.iter().map(|p| p.w.clone()).collect(), bytes)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn sharded(strategy: Strategy, fractions: Vec<f64>) -> Vec<Out> {
    let (cfg, corpus) = setup();
    let worlds = worlds(RANKS);
    let hs: Vec<_> = worlds
        .into_iter()
        .map(|w| {
            let (cfg, corpus, fractions) = (cfg.clone(), corpus.clone(), fractions.clone());
            std::thread::spawn(move || {
                let groups = Groups::new(&w, 2, 0, 0).unwrap();
                let mut tr = SdpTrainer::new(cfg, corpus, &w, groups, strategy, &fractions).unwrap();
                let losses = (0..ITERS).map(|_| tr.step().unwrap()).collect();
                let params = tr.full_params().unwrap().list.into_iter().map(|p| p.w).collect();
                (losses, params, tr.state_bytes_per_rank())
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn sharded_gpt_trains_like_data_parallelism() {
    let dp = data_parallel();
    let losses = &dp[0].0;
    assert!(losses[ITERS - 1] < losses[0], "data parallelism must learn: {losses:?}");
    for (strategy, fractions) in [(Strategy::Full, vec![]), (Strategy::Hybrid, vec![]), (Strategy::Hsdp, vec![0.25, 0.75])] {
        let runs = sharded(strategy, fractions.clone());
        for (rank, (run, refr)) in runs.iter().zip(&dp).enumerate() {
            for (it, (a, b)) in run.0.iter().zip(&refr.0).enumerate() {
                assert!((a - b).abs() <= 1e-4 * b.abs(), "{strategy:?} rank {rank} iteration {it}: loss {a} vs {b}");
            }
            for (t, (p, q)) in run.1.iter().zip(&refr.1).enumerate() {
                let worst = p.iter().zip(q).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
                assert!(worst < 1e-4, "{strategy:?} rank {rank} tensor {t}: parameters differ by {worst}");
            }
        }
        let share = runs[0].2 as f64 / dp[0].2 as f64;
        match strategy {
            Strategy::Full => assert!((0.25..0.26).contains(&share), "full holds {share} of the replicated state"),
            Strategy::Hybrid => assert!((0.5..0.51).contains(&share), "hybrid holds {share}"),
            _ => assert!((0.25..0.51).contains(&share), "hsdp holds {share}"),
        }
    }
}

#[test]
fn moe_configs_and_short_plans_are_refused() {
    let (mut cfg, corpus) = setup();
    let w = worlds(1).pop().unwrap();
    let g = Groups::new(&w, 1, 0, 0).unwrap();
    let e = SdpTrainer::new(cfg.clone(), corpus.clone(), &w, g.clone(), Strategy::Hsdp, &[0.5]).unwrap_err();
    assert!(e.to_string().contains("one fraction per layer"), "{e}");
    cfg.model.moe_every = 1;
    cfg.model.experts = 2;
    let e = SdpTrainer::new(cfg, corpus, &w, g, Strategy::Full, &[]).unwrap_err();
    assert!(e.to_string().contains("MoE"), "{e}");
}
