//! Simulator tests: conservation on random DAGs, determinism, speculative activation,
//! agreement with the planners where their models coincide, and typed errors.

use ironweave_plan::{sdp as psdp, tp as ptp, ClusterDesc, CostModel, ModelDesc};
use ironweave_sim::ckpt::{self, CkptOptions, Strategy};
use ironweave_sim::engine::{run, Class, Dag, Sharing, Work};
use ironweave_sim::load::{LoadSource, LoadTrace, Rng, SyntheticLoad};
use ironweave_sim::{sdp, tp, SimError};

fn random_dag(seed: u64, priority: bool) -> Dag {
    let mut r = Rng::new(seed);
    let mut d = Dag::default();
    let streams: Vec<usize> = (0..2).map(|i| d.stream(&format!("gpu{i}"))).collect();
    let links: Vec<usize> = (0..3).map(|i| d.link(&format!("link{i}"), 1e9 * (1.0 + 4.0 * r.unit()), priority)).collect();
    for i in 0..300 {
        let ndeps = (r.next_u64() % 3) as usize;
        let deps: Vec<usize> = if i == 0 { vec![] } else { (0..ndeps).map(|_| (r.next_u64() % i as u64) as usize).collect() };
        match r.next_u64() % 5 {
            0 | 1 => {
                let s = streams[(r.next_u64() % 2) as usize];
                d.compute(format!("c{i}"), "compute", s, 1e-3 * r.unit(), deps);
            }
            2 | 3 => {
                let l = links[(r.next_u64() % 3) as usize];
                let class = if r.unit() < 0.5 { Class::Training } else { Class::Checkpoint };
                d.transfer(format!("t{i}"), "x", l, 1e7 * r.unit(), 1e-5 * r.unit(), class, deps);
            }
            _ => {
                if r.unit() < 0.5 {
                    d.mark(format!("m{i}"), deps);
                } else {
                    d.delay(format!("d{i}"), 1e-3 * r.unit(), deps);
                }
            }
        }
    }
    d
}

#[test]
fn conservation_on_random_dags() {
    for seed in 0..20 {
        for priority in [false, true] {
            let d = random_dag(seed, priority);
            let tr = run(&d).expect("valid DAG");
            for (i, op) in d.ops.iter().enumerate() {
                let rec = tr.ops[i];
                assert!(rec.end >= rec.start && rec.start >= rec.ready - 1e-12, "op {i}: {rec:?}");
                for &dep in &op.deps {
                    assert!(rec.start >= tr.ops[dep].end - 1e-12, "op {i} started before its dependency {dep} ended");
                }
                match op.work {
                    Work::Transfer { bytes, latency_s, .. } => {
                        // bytes sent = bytes received
                        assert!(
                            (rec.delivered - bytes).abs() <= bytes * 1e-9 + 1e-6,
                            "op {i}: delivered {} of {bytes}",
                            rec.delivered
                        );
                        assert!(rec.end - rec.start >= latency_s - 1e-12);
                    }
                    Work::Compute { seconds, .. } => assert!((rec.end - rec.start - seconds).abs() < 1e-9),
                    _ => {}
                }
            }
            // a link never exceeds its rate
            for sp in &tr.spans {
                let bw = d.resources[sp.res].bytes_per_s.expect("spans are on links");
                assert!(sp.rate <= bw * (1.0 + 1e-9), "link {} at {} > {bw}", sp.res, sp.rate);
                assert!(sp.t1 >= sp.t0);
            }
            // the bytes integrated over the spans equal the bytes of the transfers, per link
            for (r, res) in d.resources.iter().enumerate() {
                if res.bytes_per_s.is_none() {
                    // a compute stream runs one op at a time
                    let mut iv: Vec<(f64, f64)> = d
                        .ops
                        .iter()
                        .enumerate()
                        .filter(|(_, o)| matches!(o.work, Work::Compute { res, .. } if res == r))
                        .map(|(i, _)| (tr.ops[i].start, tr.ops[i].end))
                        .collect();
                    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
                    for w in iv.windows(2) {
                        assert!(w[1].0 >= w[0].1 - 1e-12, "stream {r} overlaps: {w:?}");
                    }
                    continue;
                }
                let moved: f64 = tr.spans.iter().filter(|s| s.res == r).map(|s| s.rate * (s.t1 - s.t0)).sum();
                let want: f64 = d
                    .ops
                    .iter()
                    .filter_map(
                        |o| if let Work::Transfer { res, bytes, .. } = o.work { (res == r).then_some(bytes) } else { None },
                    )
                    .sum();
                assert!((moved - want).abs() <= want * 1e-6 + 1.0, "link {r}: {moved} moved, {want} requested");
            }
        }
    }
}

#[test]
fn priority_gives_training_the_link() {
    for priority in [false, true] {
        let mut d = Dag::default();
        let l = d.link("l", 1e9, priority);
        let a = d.transfer("train", "x", l, 1e9, 0.0, Class::Training, vec![]);
        let b = d.transfer("ckpt", "x", l, 1e9, 0.0, Class::Checkpoint, vec![]);
        let tr = run(&d).unwrap();
        if priority {
            assert_eq!(tr.ops[a].end, 1.0);
        } else {
            assert!((tr.ops[a].end - 2.0).abs() < 1e-9);
        }
        assert!((tr.ops[b].end - 2.0).abs() < 1e-9);
    }
}

#[test]
fn a_fifo_link_serves_transfers_that_arrive_together_in_program_order() {
    // a timer released beside them used to reorder the release list, so the big transfer,
    // created second, took the link first and the small one waited a whole second behind it
    let mut d = Dag::default();
    let l = d.fifo_link("l", 1e6);
    let m = d.mark("m", vec![]);
    let _timer = d.delay("timer", 0.5, vec![m]);
    let small = d.transfer("small", "x", l, 1.0, 0.0, Class::Training, vec![m]);
    let big = d.transfer("big", "x", l, 1e6, 0.0, Class::Training, vec![m]);
    let tr = run(&d).unwrap();
    assert!((tr.ops[small].end - 1e-6).abs() < 1e-9, "{:?}", tr.ops[small]);
    assert!((tr.ops[big].end - (1.0 + 1e-6)).abs() < 1e-9, "{:?}", tr.ops[big]);
}

#[test]
fn a_shared_link_interleaves_the_classes_after_the_queue_wait() {
    // 100 B/s; training gets a quarter while both classes are on the link, and waits 0.5 s for
    // the queue ahead when it finds checkpoint bytes there
    let sh = Sharing { training_share: 0.25, queue_wait_s: 0.5 };
    let mut d = Dag::default();
    let l = d.shared_link("l", 100.0, sh);
    let m = d.mark("m", vec![]);
    let ckpt = d.transfer("ckpt", "x", l, 100.0, 0.0, Class::Checkpoint, vec![m]);
    let at = d.delay("at", 0.2, vec![m]);
    let train = d.transfer("train", "x", l, 50.0, 0.0, Class::Training, vec![at]);
    let after = d.delay("after", 2.0, vec![m]);
    let alone = d.transfer("alone", "x", l, 50.0, 0.0, Class::Training, vec![after]);
    let tr = run(&d).unwrap();
    // 0-0.2 s: the checkpoint alone (20 B); 0.2-0.7 s: training waits, the checkpoint alone
    // (50 B); then 25 and 75 B/s: the checkpoint's last 30 B by 1.1 s, training's 10 B by
    // then and its last 40 B alone by 1.5 s
    assert!((tr.ops[ckpt].end - 1.1).abs() < 1e-9, "{:?}", tr.ops[ckpt]);
    assert!((tr.ops[train].end - 1.5).abs() < 1e-9, "{:?}", tr.ops[train]);
    // with the link to itself, no wait and the whole rate
    assert!((tr.ops[alone].end - 2.5).abs() < 1e-9, "{:?}", tr.ops[alone]);
    // a share outside (0, 1] or a negative wait is refused
    for bad in [Sharing { training_share: 0.0, queue_wait_s: 0.0 }, Sharing { training_share: 0.5, queue_wait_s: -1.0 }] {
        let mut d = Dag::default();
        let l = d.shared_link("l", 100.0, bad);
        d.transfer("t", "x", l, 1.0, 0.0, Class::Training, vec![]);
        assert!(matches!(run(&d), Err(SimError::BadDag(_))), "{bad:?}");
    }
}

#[test]
fn runs_are_deterministic() {
    let d = random_dag(99, true);
    let a = serde_json::to_string(&run(&d).unwrap()).unwrap();
    let b = serde_json::to_string(&run(&d).unwrap()).unwrap();
    assert_eq!(a, b);
}

#[test]
fn bad_dags_are_typed_errors() {
    let mut d = Dag::default();
    let g = d.stream("gpu");
    d.compute("a", "compute", g, 1.0, vec![1]);
    d.compute("b", "compute", g, 1.0, vec![]);
    assert!(matches!(run(&d), Err(SimError::BadDag(_))));
    let mut d = Dag::default();
    let g = d.stream("gpu");
    d.transfer("t", "x", g, 1.0, 0.0, Class::Training, vec![]);
    assert!(matches!(run(&d), Err(SimError::BadDag(_))));
    let mut d = Dag::default();
    let g = d.stream("gpu");
    d.compute("nan", "compute", g, f64::NAN, vec![]);
    assert!(matches!(run(&d), Err(SimError::BadDag(_))));
}

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR"))).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn moe() -> (ModelDesc, ClusterDesc) {
    let mut m = ModelDesc::from_toml_str(&read("configs/models/moe-gpt-32e.toml")).unwrap();
    m.layers = 8; // keep the test quick
    (m, ClusterDesc::from_toml_str(&read("configs/clusters/4x8-a100.toml")).unwrap())
}

#[test]
fn ckpt_scenario_is_deterministic_for_a_seed() {
    let (m, c) = moe();
    let opts = |seed| CkptOptions {
        iterations: 6,
        load: Some(LoadSource::Synthetic(SyntheticLoad { seed, ..Default::default() })),
        ..Default::default()
    };
    let a = ckpt::simulate(&m, &c, &Strategy::ALL, &opts(3)).unwrap();
    let b = ckpt::simulate(&m, &c, &Strategy::ALL, &opts(3)).unwrap();
    let c2 = ckpt::simulate(&m, &c, &Strategy::ALL, &opts(4)).unwrap();
    assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
    assert_ne!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&c2).unwrap());
    assert_eq!(a.results.len(), 5);
    let none = a.results[0].mean_iter_s;
    for r in &a.results[1..] {
        assert!(r.mean_iter_s >= none * (1.0 - 1e-9), "{:?} faster than no checkpoint", r.strategy);
        assert!(r.ckpt_bytes_per_iter > 0.0);
    }
}

#[test]
fn sparse_capricorn_moves_a_kth_of_the_bytes_and_is_never_slower() {
    let (m, c) = moe();
    let opts = CkptOptions { iterations: 12, sparse: vec![4], ..Default::default() };
    let r = ckpt::simulate(&m, &c, &[Strategy::None, Strategy::Capricorn], &opts).unwrap();
    let (none, full, sparse) = (&r.results[0], &r.results[1], &r.results[2]);
    assert_eq!(sparse.label, "capricorn-sparse");
    assert!((sparse.ckpt_bytes_per_iter * 4.0 / full.ckpt_bytes_per_iter - 1.0).abs() < 1e-9);
    assert!(sparse.mean_iter_s <= full.mean_iter_s * (1.0 + 1e-9), "{} vs {}", sparse.mean_iter_s, full.mean_iter_s);
    assert!(sparse.mean_iter_s >= none.mean_iter_s * (1.0 - 1e-9));
    let bad = CkptOptions { sparse: vec![1], ..opts };
    assert!(ckpt::simulate(&m, &c, &[Strategy::Capricorn], &bad).is_err());
}

fn trace(iterations: usize, shift_at: Option<usize>, moe_layers: usize, experts: usize) -> LoadTrace {
    // popular experts in the first half, then (after the shift) in the second half
    let base: Vec<f64> = (0..experts).map(|e| if e < experts / 2 { 100.0 + (e % 3) as f64 } else { 2.0 }).collect();
    let shifted: Vec<f64> = base.iter().rev().copied().collect();
    LoadTrace {
        experts: experts as u32,
        iterations: (0..iterations)
            .map(|i| {
                let l = if shift_at.is_some_and(|s| i >= s) { &shifted } else { &base };
                vec![l.clone(); moe_layers]
            })
            .collect(),
    }
}

#[test]
fn speculative_activation_follows_expert_load() {
    let (m, c) = moe();
    let moe_layers = (0..m.layers).filter(|&l| m.is_moe_layer(l)).count();
    let experts = m.moe.as_ref().unwrap().experts as usize;
    let run_with = |t: LoadTrace| {
        let opts = CkptOptions { iterations: 8, load: Some(LoadSource::Trace(t)), ..Default::default() };
        ckpt::simulate(&m, &c, &[Strategy::Capricorn], &opts).unwrap().results[0].profiling_activations
    };
    // stable load: only the initial profiling
    assert_eq!(run_with(trace(8, None, moe_layers, experts)), 1);
    // the router's preferred experts flip at iteration 4: the engine's smoothed drift (from
    // the previous iteration's load, as the engine knows it) re-profiles within 2 iterations,
    // and only then
    let t = trace(10, Some(4), moe_layers, experts);
    let load = |i: usize| ironweave_profile::ExpertLoad {
        tokens: t.iterations[i].iter().map(|l| l.iter().map(|&v| v.round() as u64).collect()).collect(),
    };
    assert!(load(4).drift(&load(3)).unwrap() > CkptOptions::default().drift_threshold);
    assert_eq!(run_with(t.clone()), 2);
    let opts = CkptOptions { iterations: 7, load: Some(LoadSource::Trace(t)), ..Default::default() };
    // iterations 5 and 6 see the shifted loads of 4 and 5: caught by iteration 6
    assert_eq!(ckpt::simulate(&m, &c, &[Strategy::Capricorn], &opts).unwrap().results[0].profiling_activations, 2);
}

#[test]
fn a_malformed_load_trace_is_rejected() {
    let (m, c) = moe();
    let mut t = trace(3, None, 1, 32);
    t.iterations[1][0][0] = -1.0;
    let opts = CkptOptions { iterations: 3, load: Some(LoadSource::Trace(t)), ..Default::default() };
    assert!(matches!(ckpt::simulate(&m, &c, &[Strategy::None], &opts), Err(SimError::Invalid(_))));
}

#[test]
fn tp_and_sdp_simulations_match_the_planner_where_it_is_exact() {
    // Megatron's schedule has no overlap and no sharing: the simulator must agree with the
    // planner's sum of compute and communication (up to the DP gradient overlap).
    let m = ModelDesc::from_toml_str(&read("configs/models/gpt-2.7b.toml")).unwrap();
    let c = ClusterDesc::from_toml_str(&read("configs/clusters/32x3090-pcie.toml")).unwrap();
    let cm = CostModel::new(&c);
    let opts = ptp::TpOptions::default();
    let p = ptp::build(&m, &c, &cm, &opts).unwrap();
    let picks: Vec<usize> =
        p.sublayers.iter().map(|s| s.options.iter().position(|o| o.tp == 4 && o.sub_batches == 1).unwrap()).collect();
    let r = tp::simulate(&p, &m, &cm, &picks, "megatron").unwrap();
    assert!((r.simulated_s / r.predicted_s - 1.0).abs() < 0.01, "{} vs {}", r.simulated_s, r.predicted_s);
    let (sol, _) = p.chain.solve(opts.solver, 60.0, 0.0).unwrap();
    let o = tp::simulate(&p, &m, &cm, &sol.picks, "oases").unwrap();
    assert!(o.simulated_s < r.simulated_s, "the overlapped plan must beat Megatron in the simulator too");

    let m = ModelDesc::from_toml_str(&read("configs/models/gpt-40b.toml")).unwrap();
    let c = ClusterDesc::from_toml_str(&read("configs/clusters/2x8-h100.toml")).unwrap();
    let cm = CostModel::new(&c);
    let layers = psdp::layers(&m, &c, &cm).unwrap();
    let plan = psdp::plan(&m, &c, &cm, &psdp::SdpOptions::default()).unwrap();
    let g: Vec<f64> = plan.layers.iter().map(|l| l.global_fraction).collect();
    let fsdp = sdp::simulate(&layers, &m, &cm, &vec![1.0; layers.len()], "fsdp").unwrap();
    let hsdp = sdp::simulate(&layers, &m, &cm, &g, "hsdp").unwrap();
    // the simulator adds latency and pipeline fill: never faster than the planner's bound
    assert!(fsdp.simulated_s >= fsdp.predicted_s * 0.999 && hsdp.simulated_s >= hsdp.predicted_s * 0.999);
    assert!(hsdp.simulated_s < fsdp.simulated_s);
}
