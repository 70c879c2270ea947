//! `ironweave ckpt inspect DIR` and `ironweave ckpt reshard DIR --to NEW --ranks N`. Inspect:
//! what a persistent tier holds — its iterations, the newest one
//! every rank finished writing, the layout that wrote it, every global tensor with its owner
//! slices — with every file verified (each tensor against its checksum, the owner slices
//! against the model: no overlap, no hole) and the layout-free digest of the global state.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ironweave::ckpt::{layout, persist};
use serde::Serialize;

use crate::error::{Context, Result};

/// `ironweave ckpt`'s subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CkptCmd {
    /// The iterations of a persistent tier, the layout that wrote the newest complete one, its
    /// global tensors and owner slices; every file and tensor verified; the layout-free digest.
    Inspect(InspectArgs),
    /// Rewrite a MoE checkpoint for another world size (experts e on rank e mod ranks): every
    /// rank's files and manifest, as that job's persistent tier would write them.
    Reshard(ReshardArgs),
}

/// `ironweave ckpt inspect`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct InspectArgs {
    /// The directory (`<report dir>/persist`).
    pub dir: PathBuf,
    /// Iteration (default: the newest every rank finished writing).
    #[arg(long)]
    pub iter: Option<u64>,
    /// Also write the whole inspection (every tensor and slice) here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `ironweave ckpt reshard`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ReshardArgs {
    /// The source directory (`<report dir>/persist`).
    pub dir: PathBuf,
    /// Where the result goes (a new directory).
    #[arg(long)]
    pub to: PathBuf,
    /// World size of the result.
    #[arg(long)]
    pub ranks: usize,
    /// The model's training configuration (its parameters' names and shapes).
    #[arg(long)]
    pub config: PathBuf,
    /// Iteration (default: the newest every rank finished writing).
    #[arg(long)]
    pub iter: Option<u64>,
}

/// `ironweave ckpt inspect|reshard`: prints what was found or done.
pub fn command(c: &CkptCmd) -> Result<i32> {
    match c {
        CkptCmd::Inspect(a) => {
            let i = inspect(&a.dir, a.iter)?;
            print!("{}", summary(&i));
            if let Some(p) = &a.json {
                std::fs::write(p, serde_json::to_vec_pretty(&i)?).with_context(|| format!("writing {}", p.display()))?;
            }
        }
        CkptCmd::Reshard(a) => {
            let (cfg, _) = crate::train::args::load_config(&a.config)?;
            let r = reshard(&a.dir, a.iter, &a.to, a.ranks, &cfg)?;
            println!(
                "resharded iteration {} from {} to {} ranks into {}: {:.1} MB read in {:.2} s, {:.1} MB written in {:.2} s; global_state_sha256 {}",
                r.iter,
                r.from_world,
                r.to_world,
                a.to.display(),
                r.bytes_read as f64 / 1e6,
                r.load_s,
                r.bytes_written as f64 / 1e6,
                r.write_s,
                r.global_state_sha256
            );
        }
    }
    Ok(0)
}

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
    let idx = persist::global_index(&mans)?;
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
pub(crate) fn bytes_needed(idx: &layout::GlobalIndex, want: &ironweave::ckpt::Registry) -> Result<u64> {
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
    let idx = persist::global_index(&mans)?;
    let regs = moe_registries(cfg, ranks)?;
    let mut by = persist::Written { layout: mans[0].layout.clone(), job: mans[0].job.clone(), key: None };
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
