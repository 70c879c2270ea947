//! `ironweave train`: one [`TrainArgs`] and [`run`], which picks the run by its options — data
//! and expert parallel ([`moe`]), sharded ([`sdp`], `--sdp`) or tensor parallel ([`tp`],
//! `--tp`). Each run starts its ranks through [`crate::launch`] as a hidden subcommand whose
//! options are one typed struct the parent writes (`to_argv`) and the rank parses back
//! ([`moe::WorkerArgs`], [`sdp::SdpWorkerArgs`], [`tp::TpWorkerArgs`]); the data- and
//! sharded-parallel ranks then run on [`ironweave::elastic`] through [`elastic`].

pub mod args;
pub mod busy;
pub mod elastic;
pub mod moe;
pub mod sdp;
pub mod tp;

pub use args::TrainArgs;

use crate::error::{bail, Result};

/// `ironweave train`: sharded (`--sdp`), tensor parallel (`--tp`, `--schedule`, `--tp-plan`)
/// or data and expert parallel; returns the command's exit status.
pub fn run(a: &TrainArgs) -> Result<i32> {
    if a.resume_from.is_some() && (a.tp.is_some() || a.tp_plan.is_some()) {
        bail!(
            "--resume-from loads onto another layout for the data- and expert-parallel and the --sdp runs so far; --tp runs resume from their own in-memory and persistent checkpoints"
        );
    }
    let dense = a.sdp.is_some() || a.sdp_plan.is_some() || a.tp.is_some() || a.tp_plan.is_some();
    if a.record_routing.is_some() && dense {
        bail!("--record-routing records a MoE run's router: leave out --sdp and --tp");
    }
    if a.compute.emulated()? && dense && a.compute.routing.is_some() {
        bail!("--routing replays a MoE router: --sdp and --tp run dense models, leave it out");
    }
    if a.sdp.is_some() || a.sdp_plan.is_some() {
        if a.tp.is_some() || a.tp_plan.is_some() {
            bail!("--sdp and --tp do not combine yet: choose one");
        }
        return sdp::run(a);
    }
    if a.tp.is_some() || a.schedule.is_some() || a.sub_batches.is_some() || a.tp_plan.is_some() {
        return tp::run(a);
    }
    moe::run(a)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::args::ElasticRankArgs;
    use super::moe::WorkerArgs;
    use super::sdp::SdpWorkerArgs;
    use super::tp::TpWorkerArgs;

    #[test]
    fn every_rank_parses_back_what_its_parent_wrote() {
        let run = ElasticRankArgs {
            config: PathBuf::from("configs/moe small.toml"),
            ckpt: "gemini-fill0.8-chunk1M".into(),
            iters: Some(30),
            report_dir: PathBuf::from("/tmp/r"),
            fail: Some("rank=1+2,iter=5".into()),
            persist_every: 0,
            resume_from: Some(PathBuf::from("-odd/persist")),
        };
        let moe = WorkerArgs {
            run: run.clone(),
            replicas: 3,
            bucket_kb: Some(512),
            storage_bytes_per_s: Some(1.0 / 3.0 * 1e8),
            routing_dir: Some(PathBuf::from("/tmp/r/routing")),
            compute: super::args::ComputeArgs {
                compute: "emulated".into(),
                device: Some(PathBuf::from("h100")),
                routing: Some(PathBuf::from("/tmp/r t/routing.json")),
                dilation: 400.0,
            },
        };
        assert_eq!(crate::parse_back::<WorkerArgs>(&moe.to_argv()), moe);
        let bare = WorkerArgs {
            run: ElasticRankArgs { iters: None, fail: None, resume_from: None, ..run.clone() },
            bucket_kb: None,
            storage_bytes_per_s: None,
            routing_dir: None,
            compute: super::args::ComputeArgs::default(),
            ..moe
        };
        assert_eq!(crate::parse_back::<WorkerArgs>(&bare.to_argv()), bare);

        let sdp = SdpWorkerArgs {
            run: ElasticRankArgs {
                config: PathBuf::from("configs/moe-tiny.toml"),
                ckpt: "capricorn".into(),
                iters: Some(4),
                report_dir: PathBuf::from("target/x"),
                fail: Some("rank=1,iter=2".into()),
                persist_every: 10,
                resume_from: None,
            },
            strategy: "hsdp".into(),
            fractions: vec![0.25, 1.0 / 3.0, 0.0],
            ranks_per_host: 2,
            full_link: String::new(),
            inter_link: "b".into(),
            compute: super::args::ComputeArgs {
                compute: "emulated".into(),
                device: Some(PathBuf::from("configs/devices/a100.toml")),
                routing: None,
                dilation: 200.0,
            },
        };
        assert_eq!(crate::parse_back::<SdpWorkerArgs>(&sdp.to_argv()), sdp);
        let unplanned = SdpWorkerArgs { fractions: Vec::new(), strategy: "full".into(), ..sdp };
        assert_eq!(crate::parse_back::<SdpWorkerArgs>(&unplanned.to_argv()), unplanned);

        let tp = TpWorkerArgs {
            config: PathBuf::from("configs/gpt-tp.toml"),
            degrees: vec![2, 1, 2],
            schedule: "oases".into(),
            sub_batches: 2,
            iters: None,
            report_dir: PathBuf::from("target/tp"),
            global_batch: Some(16),
            compute: super::args::ComputeArgs {
                compute: "emulated".into(),
                device: Some(PathBuf::from("h100")),
                routing: None,
                dilation: 400.0,
            },
        };
        assert_eq!(crate::parse_back::<TpWorkerArgs>(&tp.to_argv()), tp);
    }
}
