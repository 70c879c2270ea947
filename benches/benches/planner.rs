//! Planner solve time on a 96-layer model (193 sub-layers for TMP, 97 layers for SDP).
//! Target: under one second per plan.

use criterion::{criterion_group, criterion_main, Criterion};
use ironweave_plan::{sdp, tp, ClusterDesc, CostModel, ModelDesc};

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))).expect(path)
}

fn planners(c: &mut Criterion) {
    let m = ModelDesc::from_toml_str(&read("configs/models/gpt-96l.toml")).unwrap();
    let mut g = c.benchmark_group("plan 96 layers");
    g.sample_size(10);
    for cluster in ["32x3090-pcie", "128x8-h100"] {
        let cl = ClusterDesc::from_toml_str(&read(&format!("configs/clusters/{cluster}.toml"))).unwrap();
        g.bench_function(format!("tp {cluster}"), |b| {
            b.iter(|| tp::plan(&m, &cl, &CostModel::new(&cl), &tp::TpOptions::default()).unwrap())
        });
    }
    // one sequence per device: the model's global batch of 1024 on 1024 devices
    let cl = ClusterDesc::from_toml_str(&read("configs/clusters/128x8-h100.toml")).unwrap();
    g.bench_function("sdp 128x8-h100", |b| {
        b.iter(|| sdp::plan(&m, &cl, &CostModel::new(&cl), &sdp::SdpOptions::default()).unwrap())
    });
    g.finish();
}

criterion_group!(benches, planners);
criterion_main!(benches);
