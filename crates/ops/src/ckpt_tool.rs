//! `ironweave ckpt inspect DIR`: what a persistent tier holds — its iterations, the newest one
//! every rank finished writing, the layout that wrote it, every global tensor with its owner
//! slices — with every file verified (each tensor against its checksum, the owner slices
//! against the model: no overlap, no hole) and the layout-free digest of the global state.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ironweave::ckpt::{layout, persist};
use serde::Serialize;

use crate::error::{Context, Result};

/// What `inspect` found.
#[derive(Debug, Clone, Serialize)]
pub struct Inspection {
    /// The directory.
    pub dir: PathBuf,
    /// Iterations with rank 0's manifest, newest first.
    pub iterations: Vec<u64>,
    /// The iteration inspected (the newest complete one unless asked).
    pub iter: u64,
    /// Newer iterations passed over, and why.
    pub incomplete: Vec<String>,
    /// World size that wrote it.
    pub world: u32,
    /// The writer's parallel layout (rank 0's manifest).
    pub layout: BTreeMap<String, String>,
    /// Global tensors: name → (dtype, shape, owner slices as (rank, offsets, extent)).
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Bytes of the global state (each element once).
    pub global_bytes: u64,
    /// Bytes in the files (replicated tensors counted on every rank).
    pub file_bytes: u64,
    /// The layout-free digest (`ironweave_ckpt::layout::global_digest`), as `report.json`'s
    /// `global_state_sha256`.
    pub global_state_sha256: String,
}

/// One global tensor.
#[derive(Debug, Clone, Serialize)]
pub struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<u64>,
    /// (rank whose file holds it, offsets, extent).
    pub slices: Vec<(usize, Vec<u64>, Vec<u64>)>,
}

/// Inspects `dir` at `iter` (None: the newest complete iteration), reading every file and
/// verifying it.
pub fn inspect(dir: &Path, iter: Option<u64>) -> Result<Inspection> {
    let iterations = persist::iterations(dir, 0);
    let (iter, incomplete) = match iter {
        Some(i) => (i, Vec::new()),
        None => persist::newest_complete(dir).with_context(|| format!("inspecting {}", dir.display()))?,
    };
    let mans = persist::read_manifests(dir, iter)?;
    let files: Vec<(&ironweave::ckpt::Registry, Option<&[u64]>)> =
        mans.iter().map(|m| (&m.registry, (!m.tensor_xxh3.is_empty()).then_some(m.tensor_xxh3.as_slice()))).collect();
    let idx = layout::index(&files)?;
    let mut file_bytes = 0u64;
    let mut per_tensor: BTreeMap<String, [u8; 32]> = BTreeMap::new();
    for (r, m) in mans.iter().enumerate() {
        // the whole file against the manifest's chunk checksums, then each tensor against its own
        let snap = persist::load(dir, iter, r as u32)?;
        file_bytes += snap.data.len() as u64;
        for (k, t) in m.registry.tensors.iter().enumerate() {
            let b = &snap.data[t.offset as usize..(t.offset + t.len) as usize];
            if let Some(&x) = m.tensor_xxh3.get(k) {
                if xxhash_rust::xxh3::xxh3_64(b) != x {
                    crate::error::bail!(
                        "tensor `{}` in rank {r}'s file of iteration {iter}: its bytes do not match its checksum",
                        t.name
                    );
                }
            }
            if let Some(g) = t.global.as_ref().filter(|g| g.owner && g.shape == t.shape) {
                per_tensor.insert(g.tensor.clone(), layout::tensor_sha256(b));
            }
        }
    }
    // global tensors split over several owners are assembled (all in one load) to be hashed
    let split: Vec<ironweave::ckpt::TensorSpec> =
        idx.iter()
            .filter(|(name, _)| !per_tensor.contains_key(*name))
            .map(|(name, t)| {
                ironweave::ckpt::TensorSpec::new(name.clone(), t.dtype, &t.shape)
                    .with_global(ironweave::ckpt::GlobalSlice::whole(name.clone(), &t.shape, true))
            })
            .collect();
    if !split.is_empty() {
        let whole = persist::load_global(dir, iter, &ironweave::ckpt::Registry::new(&split)?)?;
        for t in &split {
            per_tensor.insert(t.name.clone(), layout::tensor_sha256(whole.tensor(&t.name).unwrap_or_default()));
        }
    }
    let tensors = idx
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                TensorInfo {
                    dtype: t.dtype.name().into(),
                    shape: t.shape.clone(),
                    slices: t.sources.iter().map(|s| (s.file, s.offsets.clone(), s.extent.clone())).collect(),
                },
            )
        })
        .collect();
    Ok(Inspection {
        dir: dir.to_path_buf(),
        iterations,
        iter,
        incomplete,
        world: mans[0].world,
        layout: mans[0].layout.clone(),
        global_bytes: idx.values().map(|t| t.shape.iter().product::<u64>() * t.dtype.size() as u64).sum(),
        file_bytes,
        tensors,
        global_state_sha256: layout::hex(&layout::global_digest(&per_tensor)),
    })
}

/// The human summary of an inspection.
pub fn summary(i: &Inspection) -> String {
    let mut s = format!(
        "{}: iteration {} of {:?} (newest every rank finished), written by {} ranks\n",
        i.dir.display(),
        i.iter,
        i.iterations,
        i.world
    );
    for x in &i.incomplete {
        s.push_str(&format!("  passed over: {x}\n"));
    }
    for (k, v) in &i.layout {
        s.push_str(&format!("  layout {k}: {v}\n"));
    }
    let split = i.tensors.values().filter(|t| t.slices.len() > 1).count();
    s.push_str(&format!(
        "  {} global tensors ({} split over several ranks), {:.1} MB of global state, {:.1} MB in the files; every tensor verified against its checksum\n",
        i.tensors.len(),
        split,
        i.global_bytes as f64 / 1e6,
        i.file_bytes as f64 / 1e6
    ));
    s.push_str(&format!("  global_state_sha256 {}\n", i.global_state_sha256));
    s
}

/// What [`reshard`] wrote.
#[derive(Debug, Clone, Serialize)]
pub struct Resharded {
    /// The iteration.
    pub iter: u64,
    /// World size of the source and of the result.
    pub from_world: u32,
    pub to_world: usize,
    /// Bytes the loader read from the source files (each target rank's owner slices).
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Seconds loading (all target ranks, one after the other) and writing.
    pub load_s: f64,
    pub write_s: f64,
    /// The layout-free digest of the result (equal to the source's when exact).
    pub global_state_sha256: String,
}

/// The data- and expert-parallel layout of `cfg` on `ranks` ranks, as each rank registers it.
pub fn moe_registries(cfg: &ironweave_train::TrainConfig, ranks: usize) -> Result<Vec<ironweave::ckpt::Registry>> {
    (0..ranks).map(|r| Ok(ironweave::ckpt::Registry::new(&ironweave_train::trainer::state_specs_for(cfg, r, ranks))?)).collect()
}

/// Bytes [`persist::load_global`] reads for `want` from the checkpoint `idx`: every owner slice
/// one of its tensors intersects.
fn bytes_needed(idx: &layout::GlobalIndex, want: &ironweave::ckpt::Registry) -> Result<u64> {
    let plan = layout::plan(idx, want)?;
    let mut n = 0;
    for f in &plan {
        let g = want.tensors[f.target].global.as_ref().expect("planned");
        for (si, _) in &f.from {
            n += idx[&g.tensor].sources[*si].len;
        }
    }
    Ok(n)
}

/// Loads iteration `iter` (None: the newest complete) of the checkpoint under `dir` onto
/// `ranks` ranks of `cfg`'s data- and expert-parallel layout and writes it under `to` as that
/// job's persistent tier would (every rank's files and manifest), so `train --resume-from`
/// or any reader takes it as written by `ranks` ranks.
pub fn reshard(dir: &Path, iter: Option<u64>, to: &Path, ranks: usize, cfg: &ironweave_train::TrainConfig) -> Result<Resharded> {
    if ranks == 0 {
        crate::error::bail!("--ranks must be at least 1");
    }
    let iter = match iter {
        Some(i) => i,
        None => persist::newest_complete(dir)?.0,
    };
    if std::fs::canonicalize(dir).ok() == std::fs::canonicalize(to).ok() {
        crate::error::bail!("--to {}: reshard writes a new directory beside the source, not into it", to.display());
    }
    let mans = persist::read_manifests(dir, iter)?;
    let files: Vec<(&ironweave::ckpt::Registry, Option<&[u64]>)> =
        mans.iter().map(|m| (&m.registry, (!m.tensor_xxh3.is_empty()).then_some(m.tensor_xxh3.as_slice()))).collect();
    let idx = layout::index(&files)?;
    let regs = moe_registries(cfg, ranks)?;
    let mut by = persist::Written { layout: mans[0].layout.clone(), job: mans[0].job.clone() };
    by.layout.insert("world".into(), ranks.to_string());
    by.layout.insert("resharded_from_world".into(), mans[0].world.to_string());
    let (mut load_s, mut write_s, mut read, mut written) = (0.0, 0.0, 0u64, 0u64);
    let mut per_tensor: BTreeMap<String, [u8; 32]> = BTreeMap::new();
    for (r, reg) in regs.iter().enumerate() {
        let t0 = std::time::Instant::now();
        let snap = persist::load_global(dir, iter, reg).with_context(|| format!("loading rank {r} of {ranks}"))?;
        load_s += t0.elapsed().as_secs_f64();
        read += bytes_needed(&idx, reg)?;
        for t in &reg.tensors {
            if let Some(g) = t.global.as_ref().filter(|g| g.owner) {
                per_tensor.insert(g.tensor.clone(), layout::tensor_sha256(snap.tensor(&t.name).unwrap_or_default()));
            }
        }
        let t1 = std::time::Instant::now();
        persist::write_layout(to, &snap, r as u32, ranks as u32, None, &by)?;
        write_s += t1.elapsed().as_secs_f64();
        written += snap.data.len() as u64;
    }
    Ok(Resharded {
        iter,
        from_world: mans[0].world,
        to_world: ranks,
        bytes_read: read,
        bytes_written: written,
        load_s,
        write_s,
        global_state_sha256: layout::hex(&layout::global_digest(&per_tensor)),
    })
}

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
    let (cfg, _) = crate::run::load_config(&a.config)?;
    if a.rounds == 0 || a.to.is_empty() {
        crate::error::bail!("--rounds and --to need at least one value");
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let src = a.out.join("writer");
    let args = crate::run::TrainArgs {
        ranks: a.from_ranks,
        iters: Some(2),
        persist_every: 2,
        report_dir: src.clone(),
        quiet: true,
        ..crate::run::TrainArgs::new(&a.config)
    };
    if crate::train::run(&args)? != 0 {
        crate::error::bail!("the writing run failed; see its output above");
    }
    let wrote: crate::run::Report = serde_json::from_slice(&std::fs::read(src.join("report.json"))?)?;
    let dir = src.join("persist");
    let (iter, _) = persist::newest_complete(&dir)?;
    let mans = persist::read_manifests(&dir, iter)?;
    let files: Vec<(&ironweave::ckpt::Registry, Option<&[u64]>)> =
        mans.iter().map(|m| (&m.registry, (!m.tensor_xxh3.is_empty()).then_some(m.tensor_xxh3.as_slice()))).collect();
    let idx = layout::index(&files)?;
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
