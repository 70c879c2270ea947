//! Sharded data parallelism equals plain data parallelism: 4 ranks (2 "hosts" of 2) over two
//! loopback TCP links train a small stack of linear layers; `full`, `hybrid` and `hsdp` (with
//! per-layer fractions, parts on different links) end where `replicated` ends — the loss of
//! every iteration within 1e-4 relative, every parameter within fp tolerance — while each rank
//! holds ~1/4 (`full`) or ~1/2 (`hybrid`) of the replicated state.

use std::sync::Arc;
use std::time::Duration;

use ironweave_sdp::{Adam, Groups, ShardEngine, Strategy};
use ironweave_transport::{Communicator, ReduceOp};

const D: usize = 13; // 169 parameters per layer: padding on 2 and 4 ranks
const LAYERS: usize = 3;
const BATCH: usize = 3;
const ITERS: usize = 10;

fn worlds(n: usize) -> Vec<Communicator> {
    ironweave_tcp::local_world_on_links(n, &["a", "b"], Duration::from_secs(60)).unwrap()
}

/// Deterministic pseudo-random numbers in [-0.5, 0.5).
fn rnd(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// y = W x for a D x D matrix (row-major) and a D x BATCH input (column per sample).
fn matmul(w: &[f32], x: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; D * BATCH];
    for i in 0..D {
        for b in 0..BATCH {
            y[i * BATCH + b] = (0..D).map(|k| w[i * D + k] * x[k * BATCH + b]).sum();
        }
    }
    y
}

struct Run {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    state_bytes: u64,
}

fn train(strategy: Strategy, fractions: Vec<f64>) -> Vec<Run> {
    let hs: Vec<_> = worlds(4)
        .into_iter()
        .map(|world| {
            let fractions = fractions.clone();
            std::thread::spawn(move || {
                let rank = world.rank();
                // the all-rank part on link b, the cross-host all-reduce on link a
                let groups = Groups::new(&world, 2, 1, 0).unwrap();
                let init: Vec<Vec<f32>> =
                    (0..LAYERS).map(|l| rnd(100 + l as u64, D * D).iter().map(|v| v * 0.5).collect()).collect();
                // a large eps makes the update depend on the gradient's scale (Adam alone would not
                // notice a wrongly averaged gradient)
                let adam = Adam { lr: 1e-2, weight_decay: 0.01, eps: 0.1, ..Adam::default() };
                let mut e = ShardEngine::new(groups, strategy, &init, &fractions, adam).unwrap();
                let world = Arc::new(world);
                let mut losses = Vec::new();
                for it in 0..ITERS {
                    // this rank's batch and target
                    let x = rnd(1000 + (it * 4 + rank) as u64, D * BATCH);
                    let target = rnd(5000 + (it * 4 + rank) as u64, D * BATCH);
                    // forward: gather layer l+1 while layer l computes; keep the activations
                    let mut acts = vec![x];
                    let mut next = Some(e.start_gather(0).unwrap());
                    for l in 0..LAYERS {
                        let w = next.take().unwrap().wait().unwrap();
                        if l + 1 < LAYERS {
                            next = Some(e.start_gather(l + 1).unwrap());
                        }
                        let y = matmul(&w, acts.last().unwrap());
                        acts.push(y);
                        // the gathered parameters are dropped here
                    }
                    let out = acts.last().unwrap();
                    let mut g: Vec<f32> = out.iter().zip(&target).map(|(y, t)| (y - t) / BATCH as f32).collect();
                    let loss: f32 = out.iter().zip(&target).map(|(y, t)| 0.5 * (y - t) * (y - t)).sum::<f32>() / BATCH as f32;
                    let mut l_all = [loss];
                    world.all_reduce(&mut l_all, ReduceOp::Sum).unwrap();
                    losses.push(l_all[0] / 4.0);
                    // backward: gather again (freed after forward), reduce each layer's gradient
                    // while the next one computes
                    let mut pending = Vec::new();
                    let mut next = Some(e.start_gather(LAYERS - 1).unwrap());
                    for l in (0..LAYERS).rev() {
                        let w = next.take().unwrap().wait().unwrap();
                        if l > 0 {
                            next = Some(e.start_gather(l - 1).unwrap());
                        }
                        let x = &acts[l];
                        let mut dw = vec![0.0; D * D];
                        for i in 0..D {
                            for k in 0..D {
                                dw[i * D + k] = (0..BATCH).map(|b| g[i * BATCH + b] * x[k * BATCH + b]).sum();
                            }
                        }
                        let mut gx = vec![0.0; D * BATCH];
                        for k in 0..D {
                            for b in 0..BATCH {
                                gx[k * BATCH + b] = (0..D).map(|i| w[i * D + k] * g[i * BATCH + b]).sum();
                            }
                        }
                        g = gx;
                        pending.push(e.start_reduce(l, &dw).unwrap());
                    }
                    for r in pending {
                        e.finish_reduce(r).unwrap();
                    }
                    e.step().unwrap();
                }
                let params = (0..LAYERS).map(|l| e.start_gather(l).unwrap().wait().unwrap()).collect();
                Run { losses, params, state_bytes: e.state_bytes() }
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn sharded_strategies_train_like_plain_data_parallelism() {
    let reference = train(Strategy::Replicated, vec![]);
    let replicated_bytes = reference[0].state_bytes;
    assert_eq!(replicated_bytes, (LAYERS * D * D * 16) as u64);
    let first = reference[0].losses[0];
    assert!(reference[0].losses[ITERS - 1] < first, "the reference must learn: {:?}", reference[0].losses);
    for (strategy, fractions) in [
        (Strategy::Full, vec![]),
        (Strategy::Hybrid, vec![]),
        (Strategy::Hsdp, vec![0.3, 0.5, 0.8]),
        (Strategy::Hsdp, vec![1.0, 0.0, 0.5]),
    ] {
        let runs = train(strategy, fractions.clone());
        for (rank, (run, refr)) in runs.iter().zip(&reference).enumerate() {
            for (it, (a, b)) in run.losses.iter().zip(&refr.losses).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1e-6),
                    "{strategy:?} {fractions:?} rank {rank} iteration {it}: {a} vs {b}"
                );
            }
            for (l, (p, q)) in run.params.iter().zip(&refr.params).enumerate() {
                let worst = p.iter().zip(q).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
                assert!(worst < 1e-5, "{strategy:?} {fractions:?} rank {rank} layer {l}: parameters differ by {worst}");
            }
        }
        // state held between iterations: ~1/4 of the replicated state for full, ~1/2 for
        // hybrid (padding to the group size aside)
        let b = runs[0].state_bytes as f64 / replicated_bytes as f64;
        match strategy {
            Strategy::Full => assert!((0.25..0.27).contains(&b), "full holds {b} of the replicated state"),
            Strategy::Hybrid => assert!((0.5..0.52).contains(&b), "hybrid holds {b}"),
            _ => assert!((0.25..0.52).contains(&b), "hsdp holds {b}"),
        }
    }
}

#[test]
fn bad_arguments_are_refused_with_the_reason() {
    let w = worlds(1).pop().unwrap();
    let g = Groups::new(&w, 1, 0, 0).unwrap();
    let e = ShardEngine::new(g.clone(), Strategy::Hsdp, &[vec![0.0; 4]], &[], Adam::default()).unwrap_err();
    assert!(e.to_string().contains("one fraction per layer"), "{e}");
    let e = ShardEngine::new(g.clone(), Strategy::Hsdp, &[vec![0.0; 4]], &[1.5], Adam::default()).unwrap_err();
    assert!(e.to_string().contains("outside [0, 1]"), "{e}");
    let mut s = ShardEngine::new(g, Strategy::Full, &[vec![0.0; 4]], &[], Adam::default()).unwrap();
    assert!(s.step().unwrap_err().to_string().contains("before its gradients"));
    assert!(s.start_reduce(0, &[1.0; 3]).unwrap_err().to_string().contains("4 parameters"));
    assert!(Strategy::parse("zero3").unwrap_err().to_string().contains("replicated, full, hybrid, hsdp"));
    assert!(Groups::new(&w, 3, 0, 0).unwrap_err().to_string().contains("hosts of 3"));
}
