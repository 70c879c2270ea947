//! `ironweave bench reshard`: a MoE checkpoint of N ranks loaded onto other world sizes (other
//! expert placements), beside `cat` of its files, interleaved; the page cache dropped before
//! each timing when root.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ironweave::ckpt::{layout, persist};

use serde::Serialize;

use crate::ckpt::{bytes_needed, moe_registries};
use crate::error::{Context, Result};

/// `ironweave bench reshard`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ReshardBenchArgs {
    /// The model (a MoE config).
    #[arg(long, default_value = "configs/moe-wide.toml")]
    pub config: PathBuf,
    /// Ranks of the job that writes the checkpoint.
    #[arg(long, default_value_t = 4)]
    pub from_ranks: usize,
    /// World sizes it is loaded onto.
    #[arg(long, value_delimiter = ',', default_value = "2,3")]
    pub to: Vec<usize>,
    /// Interleaved rounds (plain read, load, per target).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Where the checkpoint and the table go.
    #[arg(long, default_value = "target/bench/reshard")]
    pub out: PathBuf,
    /// Also write the rows here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One row of `bench reshard`.
#[derive(Debug, Clone, Serialize)]
pub struct ReshardRow {
    pub from_ranks: usize,
    pub to_ranks: usize,
    /// Median seconds to load every target rank's part (one after the other).
    pub load_s: f64,
    /// Median seconds `cat` took to read every file of the checkpoint (the plain read beside
    /// it, same cache state; `file_bytes` against the loader's `bytes_read`).
    pub plain_read_s: f64,
    pub load_over_plain: f64,
    pub bytes_read: u64,
    /// Bytes in the checkpoint's files (a whole-file reader's volume).
    pub file_bytes: u64,
    /// Whether the page cache was dropped before each timing (root), else warm reads.
    pub cold: bool,
    /// The layout-free digest equal to the writer's.
    pub exact: bool,
}

fn drop_caches() -> bool {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// `ironweave bench reshard`: a `from_ranks` checkpoint of the MoE config loaded onto each of
/// `to` world sizes, beside `cat` reading the checkpoint's files, interleaved, the page cache
/// dropped before each timing when root.
pub fn bench(a: &ReshardBenchArgs) -> Result<Vec<ReshardRow>> {
    let (cfg, _) = crate::train::args::load_config(&a.config)?;
    if a.rounds == 0 || a.to.is_empty() {
        crate::error::bail!("--rounds and --to need at least one value");
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let src = a.out.join("writer");
    let args = crate::train::args::TrainArgs {
        ranks: a.from_ranks,
        iters: Some(2),
        persist_every: 2,
        report_dir: src.clone(),
        quiet: true,
        ..crate::train::args::TrainArgs::new(&a.config)
    };
    if crate::train::moe::run(&args)? != 0 {
        crate::error::bail!("the writing run failed; see its output above");
    }
    let wrote: crate::rundir::Report = serde_json::from_slice(&std::fs::read(src.join("report.json"))?)?;
    let dir = src.join("persist");
    let (iter, _) = persist::newest_complete(&dir)?;
    let mans = persist::read_manifests(&dir, iter)?;
    let idx = persist::global_index(&mans)?;
    let file_bytes: u64 =
        (0..mans.len()).map(|r| std::fs::metadata(persist::paths(&dir, iter, r as u32).0).map_or(0, |m| m.len())).sum();
    let mut rows = Vec::new();
    for &m in &a.to {
        let regs = moe_registries(&cfg, m)?;
        let bytes_read: u64 = regs.iter().map(|reg| bytes_needed(&idx, reg)).sum::<Result<u64>>()?;
        let (mut loads, mut plains, mut cold, mut exact) = (Vec::new(), Vec::new(), true, true);
        for _ in 0..a.rounds {
            // the plain read: one `cat` of every file of the checkpoint to /dev/null (every byte
            // the loader may touch, and the replicated copies it skips)
            cold &= drop_caches();
            let t0 = std::time::Instant::now();
            let st = std::process::Command::new("cat")
                .args((0..mans.len()).map(|r| persist::paths(&dir, iter, r as u32).0))
                .stdout(std::process::Stdio::null())
                .status()
                .context("running cat")?;
            if !st.success() {
                crate::error::bail!("cat failed on the checkpoint's files");
            }
            plains.push(t0.elapsed().as_secs_f64());
            cold &= drop_caches();
            let t1 = std::time::Instant::now();
            let mut per_tensor: BTreeMap<String, [u8; 32]> = BTreeMap::new();
            let mut hash_s = 0.0;
            for reg in &regs {
                let snap = persist::load_global(&dir, iter, reg)?;
                let h0 = std::time::Instant::now();
                for t in &reg.tensors {
                    if let Some(g) = t.global.as_ref().filter(|g| g.owner) {
                        per_tensor.insert(g.tensor.clone(), layout::tensor_sha256(snap.tensor(&t.name).unwrap_or_default()));
                    }
                }
                hash_s += h0.elapsed().as_secs_f64();
            }
            // the digest is the check, not part of the load
            loads.push(t1.elapsed().as_secs_f64() - hash_s);
            exact &= Some(layout::hex(&layout::global_digest(&per_tensor))) == wrote.digests.global_state_sha256;
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (l, p) = (med(&mut loads), med(&mut plains));
        rows.push(ReshardRow {
            from_ranks: a.from_ranks,
            to_ranks: m,
            load_s: l,
            plain_read_s: p,
            load_over_plain: l / p.max(1e-9),
            bytes_read,
            file_bytes,
            cold,
            exact,
        });
    }
    println!("| from → to ranks | load (all target ranks) | cat of the files | load / plain read | bytes read | bytes in the files | page cache | digest equal to the writer's |");
    println!("|---|---:|---:|---:|---:|---:|---|---|");
    for r in &rows {
        println!(
            "| {} → {} | {:.1} ms | {:.1} ms | {:.2}x | {:.1} MB | {:.1} MB | {} | {} |",
            r.from_ranks,
            r.to_ranks,
            r.load_s * 1e3,
            r.plain_read_s * 1e3,
            r.load_over_plain,
            r.bytes_read as f64 / 1e6,
            r.file_bytes as f64 / 1e6,
            if r.cold { "dropped before each timing" } else { "warm (not root)" },
            if r.exact { "yes" } else { "NO" }
        );
    }
    let json = serde_json::json!({ "config": a.config.display().to_string(), "rounds": a.rounds, "rows": rows });
    std::fs::write(a.out.join("reshard.json"), serde_json::to_vec_pretty(&json)?)?;
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&json)?).with_context(|| format!("writing {}", p.display()))?;
    }
    if rows.iter().any(|r| !r.exact) {
        crate::error::bail!("a load's global digest differs from the writer's");
    }
    Ok(rows)
}
