//! The planners as a library: describe a model and a cluster, ask for an Oases tensor-parallel
//! plan and an HSDP sharded-data-parallel plan, and compare each with its baselines under the
//! same cost model. Descriptions are TOML (the files under configs/ are examples).
//!
//! ```sh
//! cargo run --release -p ironweave --example plan -- configs/models/gpt-7b.toml configs/clusters/32x3090-pcie.toml
//! ```
use ironweave::plan::{sdp, tp, ClusterDesc, CostModel, ModelDesc};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args.next().unwrap_or_else(|| "configs/models/gpt-2.7b.toml".into());
    let cluster = args.next().unwrap_or_else(|| "configs/clusters/32x3090-pcie.toml".into());
    let model = ModelDesc::from_toml_str(&std::fs::read_to_string(&model)?)?;
    let cluster = ClusterDesc::from_toml_str(&std::fs::read_to_string(&cluster)?)?;
    let cost = CostModel::new(&cluster);

    // Oases: per sub-layer TP degree and sub-batch count, overlap-aware.
    let p = tp::plan(&model, &cluster, &cost, &tp::TpOptions::default())?;
    println!("Oases plan for {} on {} ({} devices):", p.model, p.cluster, p.devices);
    for s in &p.sublayers {
        println!("  {:<24} TP {} x {} sub-batches", s.name, s.tp, s.sub_batches);
    }
    println!(
        "  iteration {:.1} ms, {:.1} GiB per device; Megatron (best uniform TP = {}) {:.1} ms: {:.2}x",
        p.predicted_iter_s * 1e3,
        p.memory_gib,
        p.megatron.tp,
        p.megatron.iter_s * 1e3,
        p.speedup_vs_megatron
    );

    // HSDP: per layer, the share of parameters sharded over all devices vs within a node.
    match sdp::plan(&model, &cluster, &cost, &sdp::SdpOptions::default()) {
        Ok(s) => println!(
            "HSDP plan: iteration {:.1} ms, {:.0}% of parameters sharded within a node; {:.2}x FSDP full shard",
            s.predicted_iter_s * 1e3,
            s.node_fraction_overall * 100.0,
            s.speedup_vs_fsdp
        ),
        Err(e) => println!("HSDP: no plan for this pair: {e}"),
    }
    Ok(())
}
