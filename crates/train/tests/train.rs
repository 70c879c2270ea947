//! The reference workload learns and is deterministic.

use ironweave_profile::{MonotonicClock, Phase, Profiler};
use ironweave_train::data::Corpus;
use ironweave_train::{TrainConfig, Trainer};

fn cfg() -> (TrainConfig, Corpus) {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let c = TrainConfig::from_toml_str(&std::fs::read_to_string(format!("{root}/configs/moe-tiny.toml")).unwrap()).unwrap();
    let corpus = Corpus::load(std::path::Path::new(&format!("{root}/{}", c.data.path)), c.model.seq).unwrap();
    (c, corpus)
}

#[test]
fn moe_tiny_learns_and_two_runs_are_bit_identical() {
    let (c, corpus) = cfg();
    let run = |n: u64| {
        let mut t = Trainer::new(c.clone(), corpus.clone(), 0);
        let prof = Profiler::new(MonotonicClock::default(), 4);
        let mut losses = Vec::new();
        let mut loads = Vec::new();
        for _ in 0..n {
            prof.begin_iteration(t.params.step + 1);
            let r = t.step(Some(&prof)).unwrap();
            let p = prof.end_iteration().unwrap();
            // every layer's forward and backward was timed
            assert_eq!(p.layers.iter().filter(|l| l.phase == Phase::Forward).count(), c.model.layers);
            assert_eq!(p.layers.iter().filter(|l| l.phase == Phase::Backward).count(), c.model.layers);
            losses.push(r.loss);
            loads.push(r.load);
        }
        (losses, loads, t.state_sha256())
    };
    let (l1, loads, h1) = run(30);
    let (l2, _, h2) = run(30);
    assert_eq!(h1, h2, "two runs with the same config must end in the same state");
    assert_eq!(l1, l2);
    let first: f32 = l1[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = l1[25..].iter().sum::<f32>() / 5.0;
    assert!(last < first - 0.3, "loss must fall: first {first}, last {last} ({l1:?})");
    assert!(first > 4.0 && first < 6.5, "initial loss near ln(256) = 5.55: {first}");
    // expert load varies across iterations on real text
    let distinct: std::collections::BTreeSet<_> = loads.iter().map(|l| l.tokens.clone()).collect();
    assert!(distinct.len() > 20, "expert load should vary: {} distinct of 30", distinct.len());
}

#[test]
fn bad_configs_are_typed_errors() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let text = std::fs::read_to_string(format!("{root}/configs/moe-tiny.toml")).unwrap();
    for (from, to) in
        [("top_k = 2", "top_k = 9"), ("heads = 4", "heads = 5"), ("seq = 64", "seq = 1"), ("batch = 4", "bogus = 1")]
    {
        let e = TrainConfig::from_toml_str(&text.replace(from, to)).unwrap_err();
        assert!(e.to_string().contains("invalid training configuration"), "{e}");
    }
    let e = Corpus::load(std::path::Path::new("/nonexistent"), 64).unwrap_err();
    assert!(e.to_string().contains("/nonexistent"), "{e}");
}
