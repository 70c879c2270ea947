//! Tensor parallelism of the dense GPT (Megatron-LM's layout), run by the overlap scheduler.
//!
//! Every transformer layer is two sub-layers. Attention: the query, key and value projections
//! are split by columns (each rank of the tensor-parallel group owns `heads / d` heads), the
//! output projection by rows, so each rank produces a partial sum of the attention output that
//! one all-reduce completes. The MLP: first linear by columns, second by rows, one all-reduce.
//! In the backward pass, the gradient of each sub-layer's (replicated) input is a partial sum
//! too: one all-reduce per sub-layer again. Layer norms, embeddings and the head are replicated.
//!
//! Each sub-layer has its own degree d (uniform, or per sub-layer as the Oases planner
//! chooses): the ranks form groups of d consecutive ranks, each group training `B·d/N` of the
//! iteration's `B` sequences, data parallel across groups. Between sub-layers of different
//! degrees the activations are resharded: to a larger group by an all-gather of the merging
//! groups' rows, to a smaller one by keeping this group's part; backward does the reverse
//! (the gradient of a gathered input is replicated in the larger group, so keeping one's part
//! is enough; a kept part's gradient is all-gathered back).
//!
//! The iteration is an [`ironweave_overlap::Program`]: one stage per sub-layer forward and
//! backward, each ending with its all-reduce, a stage per reshard, so the overlap scheduler
//! decides what runs while a collective is on the wire (Megatron: nothing; Oases: the next
//! sub-batch). Each backward stage first finishes the previous one (the layer norm behind the
//! all-reduced gradient and the residual), then back-propagates its own sub-layer up to its
//! all-reduce. Data parallelism adds one tail per sub-layer: its gradients are averaged across
//! the groups of its degree as soon as backward has finished them.

use std::collections::BTreeMap;
use std::error::Error as StdError;

use candle_core::{Device, Tensor, Var};
use ironweave_overlap::{execute, steps, CommSpec, ExecStats, Program, Schedule, Stage, Step, Tail, Work};
use ironweave_transport::{Communicator, ReduceOp};

use crate::config::TrainConfig;
use crate::data::Corpus;
use crate::emulated::{DeviceOp, Emulated, ACTIVATION_DTYPE};
use crate::error::{Result, TrainError};
use crate::gelu::gelu;
use crate::model::{adamw, init, layer_norm, softmax_last, Params};

/// How the job is laid out and scheduled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpSpec {
    /// Tensor-parallel degree of each sub-layer (`L0.attn, L0.mlp, L1.attn, ...`); one entry
    /// means every sub-layer. The embeddings run at the first sub-layer's degree, the head at
    /// the last's.
    pub degrees: Vec<usize>,
    /// Schedule of the collectives.
    pub schedule: Schedule,
    /// Sub-batches each group's batch is split into.
    pub sub_batches: usize,
    /// Sequences per iteration over the whole job (None: the config's `batch` per group of
    /// the first sub-layer's degree).
    pub global_batch: Option<usize>,
}

impl TpSpec {
    /// Every sub-layer at degree `tp`, the config's batch per group.
    pub fn uniform(tp: usize, schedule: Schedule, sub_batches: usize) -> TpSpec {
        TpSpec { degrees: vec![tp], schedule, sub_batches, global_batch: None }
    }
}

/// What one tensor-parallel iteration did.
#[derive(Debug, Clone)]
pub struct TpStepReport {
    /// Iteration (1-based).
    pub iter: u64,
    /// Mean cross-entropy over the whole batch.
    pub loss: f32,
    /// The executor's spans and overlap, per group (see [`TpTrainer::group_names`]).
    pub stats: ExecStats,
    /// Seconds of the step outside the executor: the loss average and the optimizer.
    pub outside_s: f64,
}

/// How a parameter is split across the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    Columns,
    Rows,
    Replicated,
}

fn split_of(name: &str) -> Split {
    let tail = name.split_once('.').map_or(name, |(_, t)| t);
    match tail {
        "attn.wq" | "attn.wk" | "attn.wv" | "mlp.w1" => Split::Columns,
        "attn.wo" | "mlp.w2" => Split::Rows,
        _ => Split::Replicated,
    }
}

/// The sub-layer a parameter belongs to (`2l` attention with its norm, `2l+1` MLP with its
/// norm), or None (embeddings, final norm, head).
fn sublayer_of(name: &str) -> Option<usize> {
    let (l, rest) = name.strip_prefix('l')?.split_once('.')?;
    let l: usize = l.parse().ok()?;
    match rest.split('.').next()? {
        "attn" | "ln1" => Some(2 * l),
        "mlp" | "ln2" => Some(2 * l + 1),
        _ => None,
    }
}

/// This rank's shards of the full parameters (`full` as `init` makes them, moments included):
/// each split matrix of sub-layer s cut `degree(s)` ways, shard `rank mod degree(s)`.
pub fn shard(full: &Params, degree: impl Fn(usize) -> usize, rank: usize) -> Params {
    let mut out = full.clone();
    for p in &mut out.list {
        let (rows, cols) = match p.shape[..] {
            [a, b] => (a, b),
            _ => continue,
        };
        let Some(s) = sublayer_of(&p.name) else { continue };
        let (tp, r) = (degree(s), rank % degree(s));
        match split_of(&p.name) {
            Split::Columns => {
                let c = cols / tp;
                let take = |v: &[f32]| -> Vec<f32> {
                    (0..rows).flat_map(|i| v[i * cols + r * c..i * cols + (r + 1) * c].to_vec()).collect()
                };
                (p.w, p.m, p.v) = (take(&p.w), take(&p.m), take(&p.v));
                p.shape = vec![rows, c];
            }
            Split::Rows => {
                let n = rows / tp;
                let take = |v: &[f32]| v[r * n * cols..(r + 1) * n * cols].to_vec();
                (p.w, p.m, p.v) = (take(&p.w), take(&p.m), take(&p.v));
                p.shape = vec![n, cols];
            }
            Split::Replicated => {}
        }
    }
    out
}

/// A change of degree between sub-layer `s` and `s + 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Boundary {
    /// Degrees before and after.
    from: usize,
    to: usize,
    /// The group of ranks that exchange rows: same larger group, same place in the smaller one.
    group: usize,
    /// Its size (`max / min` of the degrees) and this rank's place in it.
    m: usize,
    pos: usize,
}

/// What a stage of the program does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Fwd(usize),
    /// After sub-layer s's forward all-reduce: its output, gathered or cut to s+1's groups.
    ReshardFwd(usize),
    Bwd(usize),
    /// After sub-layer s's backward all-reduce: the gradient of its input, cut or gathered to
    /// s-1's groups.
    ReshardBwd(usize),
    Embed,
}

/// The groups, stages and row layout every rank derives alike from the spec (no IO).
#[derive(Debug, Clone)]
struct Layout {
    deg: Vec<usize>,
    /// Per group index: (name, split colour); created in this order by every rank.
    groups: Vec<(String, u32)>,
    dp_group: BTreeMap<usize, usize>,
    bounds: Vec<Option<Boundary>>,
    program: Program,
    kinds: Vec<Kind>,
    /// Per tail: the sub-layer whose gradients it averages (sub-layer 0's includes the
    /// embeddings; [`HEAD`] for the final norm and the head).
    tail_of: Vec<usize>,
    /// Per sub-layer and sub-batch: the sequences (of the iteration's batch) of this rank's rows.
    rows: Vec<Vec<Vec<usize>>>,
    global_batch: usize,
}

const HEAD: usize = usize::MAX;

fn sublayer_name(s: usize) -> String {
    format!("L{}.{}", s / 2, if s % 2 == 0 { "attn" } else { "mlp" })
}

impl Layout {
    fn new(cfg: &TrainConfig, spec: &TpSpec, n: usize, r: usize) -> Result<Layout> {
        let m = &cfg.model;
        let subs = 2 * m.layers;
        let bad = |w: String| Err(TrainError::Config(format!("{}: {w}", cfg.name)));
        let deg: Vec<usize> = match spec.degrees.len() {
            1 => vec![spec.degrees[0]; subs],
            l if l == subs => spec.degrees.clone(),
            l => return bad(format!("{l} tensor-parallel degrees for {subs} sub-layers")),
        };
        if (0..m.layers).any(|l| cfg.is_moe(l)) {
            return bad("tensor parallelism runs dense models: set moe_every above layers (see configs/gpt-tp.toml)".into());
        }
        for (s, &d) in deg.iter().enumerate() {
            if d == 0 || n % d != 0 {
                return bad(format!("--tp {d} ({}) does not divide the {n} ranks", sublayer_name(s)));
            }
            if m.heads % d != 0 || (m.hidden * m.ffn_mult) % d != 0 {
                return bad(format!(
                    "--tp {d} must divide the heads ({}) and the MLP width ({})",
                    m.heads,
                    m.hidden * m.ffn_mult
                ));
            }
        }
        let k = spec.sub_batches;
        let b = spec.global_batch.unwrap_or(cfg.train.batch * n / deg[0]);
        if k == 0 || b * deg[0] / n < k {
            return bad(format!("{k} sub-batches of a batch of {} sequences", b * deg[0] / n));
        }
        let dmin = *deg.iter().min().expect("at least one layer");
        if (b * dmin) % (n * k) != 0 {
            return bad(format!(
                "a batch of {b} sequences does not split into {k} equal sub-batches in every group of {dmin} of the {n} ranks"
            ));
        }
        // groups: for each degree its tensor-parallel and data-parallel group, then one per
        // boundary; colours are computed alike on every rank
        let mut groups = Vec::new();
        let (mut tp_group, mut dp_group) = (BTreeMap::new(), BTreeMap::new());
        let mut distinct = deg.clone();
        distinct.sort_unstable();
        distinct.dedup();
        for &d in &distinct {
            tp_group.insert(d, groups.len());
            groups.push((format!("tensor-parallel {d}"), (r / d) as u32));
            dp_group.insert(d, groups.len());
            groups.push((format!("data-parallel {d}"), (r % d) as u32));
        }
        let mut bounds = vec![None; subs];
        for s in 0..subs - 1 {
            let (a, c) = (deg[s], deg[s + 1]);
            if a != c {
                let (hi, lo) = (a.max(c), a.min(c));
                bounds[s] = Some(Boundary { from: a, to: c, group: groups.len(), m: hi / lo, pos: (r % hi) / lo });
                groups.push((format!("reshard {a}>{c}"), ((r / hi) * lo + r % lo) as u32));
            }
        }
        // the rows of every rank along the chain (all ranks: a gather concatenates others')
        let mut lists: Vec<Vec<Vec<usize>>> = (0..n)
            .map(|q| {
                let per = b * deg[0] / n;
                let g0 = (q / deg[0]) * per;
                (0..k).map(|j| (g0 + j * per / k..g0 + (j + 1) * per / k).collect()).collect()
            })
            .collect();
        let mut rows = Vec::with_capacity(subs);
        for bound in &bounds {
            rows.push(lists[r].clone());
            if let Some(bd) = *bound {
                let (a, c) = (bd.from, bd.to);
                lists = (0..n)
                    .map(|q| {
                        (0..k)
                            .map(|j| {
                                if a < c {
                                    (0..c / a).flat_map(|t| lists[(q / c) * c + t * a + q % a][j].clone()).collect()
                                } else {
                                    let part = lists[q][j].len() / (a / c);
                                    let p = (q % a) / c;
                                    lists[q][j][p * part..(p + 1) * part].to_vec()
                                }
                            })
                            .collect()
                    })
                    .collect();
            }
        }
        // stages
        let tp = |s: usize| Some(CommSpec::all_reduce(tp_group[&deg[s]], ReduceOp::Sum));
        let mut stages = Vec::new();
        let mut kinds = Vec::new();
        for (s, bound) in bounds.iter().enumerate() {
            stages.push(Stage { name: sublayer_name(s), comm: tp(s) });
            kinds.push(Kind::Fwd(s));
            if let Some(bd) = *bound {
                let comm = (bd.from < bd.to).then(|| CommSpec::all_gather(bd.group));
                stages.push(Stage { name: format!("reshard {}>{}", sublayer_name(s), sublayer_name(s + 1)), comm });
                kinds.push(Kind::ReshardFwd(s));
            }
        }
        let mut tails = Vec::new();
        let mut tail_of = Vec::new();
        let avg = |d: usize| CommSpec::all_reduce(dp_group[&d], ReduceOp::Avg);
        for s in (0..subs).rev() {
            let head = if s + 1 == subs { "head+" } else { "" };
            stages.push(Stage { name: format!("{head}{}.bwd", sublayer_name(s)), comm: tp(s) });
            kinds.push(Kind::Bwd(s));
            if s + 1 == subs && n / deg[s] > 1 {
                tails.push(Tail { name: "head.grads".into(), after_stage: stages.len() - 1, comm: avg(deg[s]) });
                tail_of.push(HEAD);
            }
            // a sub-layer's gradients are final once the stage that runs its norm's backward
            // has run: the next backward stage, or the reshard between them
            if s + 1 < subs && bounds[s].is_none() && n / deg[s + 1] > 1 {
                tails.push(Tail {
                    name: format!("{}.grads", sublayer_name(s + 1)),
                    after_stage: stages.len() - 1,
                    comm: avg(deg[s + 1]),
                });
                tail_of.push(s + 1);
            }
            if s > 0 {
                if let Some(bd) = bounds[s - 1] {
                    let comm = (bd.from > bd.to).then(|| CommSpec::all_gather(bd.group));
                    stages.push(Stage { name: format!("reshard {}<{}", sublayer_name(s - 1), sublayer_name(s)), comm });
                    kinds.push(Kind::ReshardBwd(s));
                    if n / deg[s] > 1 {
                        tails.push(Tail {
                            name: format!("{}.grads", sublayer_name(s)),
                            after_stage: stages.len() - 1,
                            comm: avg(deg[s]),
                        });
                        tail_of.push(s);
                    }
                }
            }
        }
        stages.push(Stage { name: "embed.bwd".into(), comm: None });
        kinds.push(Kind::Embed);
        if n / deg[0] > 1 {
            tails.push(Tail { name: format!("{}.grads", sublayer_name(0)), after_stage: stages.len() - 1, comm: avg(deg[0]) });
            tail_of.push(0);
        }
        let program = Program { stages, tails, sub_batches: k };
        Ok(Layout { deg, groups, dp_group, bounds, program, kinds, tail_of, rows, global_batch: b })
    }
}

/// One rank of a tensor- (and data-) parallel job.
#[derive(Debug)]
pub struct TpTrainer {
    /// Configuration.
    pub cfg: TrainConfig,
    /// This rank's parameters: its shards of the split matrices, the replicated rest.
    pub params: Params,
    corpus: Corpus,
    spec: TpSpec,
    n: usize,
    rank: usize,
    lay: Layout,
    comms: Vec<Option<Communicator>>,
    steps: Vec<Step>,
    /// Parameter indices of each tail (data-parallel gradient group), in tail order.
    tail_params: Vec<Vec<usize>>,
    dev: Device,
    mask: Tensor,
}

type BoxErr = Box<dyn StdError + Send + Sync>;

impl TpTrainer {
    /// Rank `world.rank()` of a job of `world.size()` ranks (or alone when `world` is None).
    /// Every rank must call this (it splits `world` into the layout's groups).
    pub fn new(cfg: TrainConfig, corpus: Corpus, world: Option<&Communicator>, spec: TpSpec) -> Result<Self> {
        let (n, r) = world.map_or((1, 0), |w| (w.size(), w.rank()));
        let lay = Layout::new(&cfg, &spec, n, r)?;
        let mut comms = Vec::with_capacity(lay.groups.len());
        for (_, colour) in &lay.groups {
            comms.push(match world {
                Some(w) if n > 1 => Some(w.split(*colour, r as u32)?),
                _ => None,
            });
        }
        let deg = lay.deg.clone();
        let params = shard(&init(&cfg), |s| deg[s], r);
        let tail_params = lay
            .tail_of
            .iter()
            .map(|&s| {
                params
                    .list
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| match s {
                        HEAD => p.name.starts_with("lnf.") || p.name == "head",
                        s => sublayer_of(&p.name) == Some(s) || (s == 0 && p.name.ends_with("_emb")),
                    })
                    .map(|(i, _)| i)
                    .collect()
            })
            .collect();
        let steps = steps(&lay.program, spec.schedule).map_err(|e| TrainError::Config(e.to_string()))?;
        let dev = Device::Cpu;
        let t = cfg.model.seq;
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
        let mask = Tensor::from_slice(&mask, (t, t), &dev)?;
        Ok(TpTrainer { cfg, params, corpus, spec, n, rank: r, lay, comms, steps, tail_params, dev, mask })
    }

    /// The program every rank of a job of `n` ranks runs under `spec` (as rank 0 derives it;
    /// no communicator needed): for predictions.
    pub fn program_for(cfg: &TrainConfig, spec: &TpSpec, n: usize) -> Result<Program> {
        Ok(Layout::new(cfg, spec, n, 0)?.program)
    }

    /// The program every iteration runs.
    pub fn program(&self) -> &Program {
        &self.lay.program
    }

    /// Each sub-layer's degree.
    pub fn degrees(&self) -> &[usize] {
        &self.lay.deg
    }

    /// Sequences per iteration over the whole job.
    pub fn global_batch(&self) -> usize {
        self.lay.global_batch
    }

    /// The executor's group names, in the order of [`ExecStats`]' per-group figures.
    pub fn group_names(&self) -> Vec<String> {
        self.lay.groups.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Whether group `g` carries tensor-parallel traffic (activations and their gradients,
    /// resharding included) rather than data-parallel gradients.
    pub fn is_tp_group(&self, g: usize) -> bool {
        !self.lay.dp_group.values().any(|&d| d == g)
    }

    /// Data-parallel degree of the head (groups the loss is averaged over).
    pub fn dp(&self) -> usize {
        self.n / self.lay.deg[self.lay.deg.len() - 1]
    }

    /// Runs the next iteration with the real math.
    pub fn step(&mut self) -> Result<TpStepReport> {
        self.step_with(None)
    }

    /// Runs the next iteration with emulated compute ([`crate::emulated`]): every stage's math
    /// is a wait on `emu`'s device ([`TpTrainer::emulated_ops`]) while the executor runs the
    /// same program and schedule as [`TpTrainer::step`]: the tensor-parallel all-reduces and
    /// reshards carry the activations' real sizes (bf16 rows of `hidden` values), the
    /// data-parallel averages the gradients' (fp32), and the real AdamW updates the state with
    /// deterministic pseudo-gradients. The loss is NaN: nothing is learned.
    pub fn step_emulated(&mut self, emu: &Emulated) -> Result<TpStepReport> {
        self.step_with(Some(emu))
    }

    fn step_with(&mut self, emu: Option<&Emulated>) -> Result<TpStepReport> {
        let iter = self.params.step + 1;
        let t = self.cfg.model.seq;
        let k = self.spec.sub_batches;
        let subs = self.lay.deg.len();
        let groups: Vec<Option<&Communicator>> = self.comms.iter().map(Option::as_ref).collect();
        let lift = |e: ironweave_overlap::OverlapError| match e {
            ironweave_overlap::OverlapError::Transport(t) => TrainError::Transport(t),
            other => TrainError::Config(other.to_string()),
        };
        let (stats, mut loss, grads) = match emu {
            Some(emu) => {
                let mut grads: Vec<Vec<f32>> = self.params.list.iter().map(|p| vec![0.0; p.w.len()]).collect();
                for (i, g) in grads.iter_mut().enumerate() {
                    crate::trainer::pseudo_gradient(g, iter, self.rank, i);
                }
                let mut w = EmuTpWork { tr: self, emu, grads };
                let stats = execute(&self.lay.program, &self.steps, &groups, &mut w).map_err(lift)?;
                (stats, f32::NAN, w.grads)
            }
            None => {
                // the iteration's whole batch, the same on every rank; each rank takes its rows
                let (x_tok, y_tok) = self.corpus.batch(self.cfg.train.seed, iter, 0, self.lay.global_batch, t);
                let mut w = TpWork {
                    tr: self,
                    x_tok: &x_tok,
                    y_tok: &y_tok,
                    x_in: vec![vec![None; k]; subs],
                    g_cur: vec![None; k],
                    grads: self.params.list.iter().map(|p| vec![0.0; p.w.len()]).collect(),
                    loss: 0.0,
                };
                let stats = execute(&self.lay.program, &self.steps, &groups, &mut w).map_err(lift)?;
                (stats, w.loss, w.grads)
            }
        };
        let exec_end = std::time::Instant::now();
        let head_dp = self.lay.dp_group[&self.lay.deg[subs - 1]];
        if let Some(d) = self.comms[head_dp].as_ref().filter(|c| c.size() > 1) {
            let mut l = [loss];
            d.all_reduce(&mut l, ReduceOp::Avg)?;
            loss = l[0];
        }
        if let Some(emu) = emu {
            let op = emu.optimizer(self.params.list.iter().map(|p| p.w.len()).sum());
            emu.device.run(op.flops, op.bytes);
        }
        adamw(&mut self.params, &grads, self.cfg.train.lr, self.cfg.train.weight_decay);
        Ok(TpStepReport { iter, loss, stats, outside_s: exec_end.elapsed().as_secs_f64() })
    }

    /// The device operations of stage `stage` for sub-batch `j` under emulated compute: a
    /// sub-layer's forward or backward at its degree on this rank's rows (the head, replicated
    /// in its group, on the group's rows), nothing for reshards and the embeddings.
    fn stage_ops(&self, emu: &Emulated, stage: usize, j: usize) -> Vec<DeviceOp> {
        let lay = &self.lay;
        let seqs = |s: usize| lay.rows[s][j].len() as f64;
        let fwd = |s: usize| {
            if s % 2 == 0 {
                emu.attn_forward_on(seqs(s), lay.deg[s])
            } else {
                emu.mlp_forward_on(seqs(s), lay.deg[s])
            }
        };
        match lay.kinds[stage] {
            Kind::Fwd(s) => vec![fwd(s)],
            Kind::Bwd(s) if s + 1 == lay.deg.len() => {
                let head = emu.head_forward_on(seqs(s));
                vec![head.clone(), Emulated::backward(&head), Emulated::backward(&fwd(s))]
            }
            Kind::Bwd(s) => vec![Emulated::backward(&fwd(s))],
            Kind::ReshardFwd(_) | Kind::ReshardBwd(_) | Kind::Embed => Vec::new(),
        }
    }

    /// Every device operation of one emulated iteration on this rank (every stage and
    /// sub-batch, then the optimizer): what [`TpTrainer::step_emulated`] runs, for tests and
    /// predictions (the schedule changes their order, not their sum).
    pub fn emulated_ops(&self, emu: &Emulated) -> Vec<DeviceOp> {
        let mut v: Vec<DeviceOp> = (0..self.lay.kinds.len())
            .flat_map(|st| (0..self.spec.sub_batches).flat_map(move |j| self.stage_ops(emu, st, j)))
            .collect();
        v.push(emu.optimizer(self.params.list.iter().map(|p| p.w.len()).sum()));
        v
    }

    /// The gradients a data-parallel tail averages, concatenated.
    fn tail_grads(&self, grads: &[Vec<f32>], tail: usize) -> Vec<f32> {
        self.tail_params[tail].iter().flat_map(|&i| grads[i].iter().copied()).collect()
    }

    /// Puts a tail's averaged gradients back.
    fn set_tail_grads(&self, grads: &mut [Vec<f32>], tail: usize, data: &[f32]) {
        let mut off = 0;
        for &i in &self.tail_params[tail] {
            let n = grads[i].len();
            grads[i].copy_from_slice(&data[off..off + n]);
            off += n;
        }
    }

    /// SHA-256 of this rank's parameters, both moments and the step.
    pub fn state_digest(&self) -> [u8; 32] {
        self.params.digest()
    }

    fn t(&self, name: &str) -> candle_core::Result<Tensor> {
        let p = &self.params.list[self.params.idx(name)];
        Tensor::from_slice(&p.w, p.shape.as_slice(), &self.dev)
    }

    fn v(&self, name: &str) -> candle_core::Result<Var> {
        let p = &self.params.list[self.params.idx(name)];
        Var::from_slice(&p.w, p.shape.as_slice(), &self.dev)
    }

    /// This rank's heads of attention on `a` (the layer norm of the sub-layer's input), through
    /// its rows of the output projection: a partial sum of the attention output.
    fn attn_partial(&self, s: usize, a: &Tensor, w: [&Tensor; 4]) -> candle_core::Result<Tensor> {
        let m = &self.cfg.model;
        let (n, _) = a.dims2()?;
        let t = m.seq;
        let (nh, hd) = (m.heads / self.lay.deg[s], m.hidden / m.heads);
        let heads = |w: &Tensor| a.matmul(w)?.reshape((n / t, t, nh, hd))?.transpose(1, 2)?.contiguous();
        let (q, k, v) = (heads(w[0])?, heads(w[1])?, heads(w[2])?);
        let att =
            q.matmul(&k.transpose(2, 3)?.contiguous()?)?.affine(1.0 / (hd as f64).sqrt(), 0.0)?.broadcast_add(&self.mask)?;
        let att = softmax_last(&att).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        att.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((n, nh * hd))?.matmul(w[3])
    }
}

fn ln(x: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    layer_norm(x, g, b).map_err(|e| candle_core::Error::Msg(e.to_string()))
}

fn msg(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// The layer norm in front of sub-layer `s`'s branch.
fn norm_of(s: usize) -> String {
    format!("l{}.{}", s / 2, if s % 2 == 0 { "ln1" } else { "ln2" })
}

/// The state of one iteration the compute tasks share.
struct TpWork<'a> {
    tr: &'a TpTrainer,
    x_tok: &'a [u32],
    y_tok: &'a [u32],
    /// Per sub-layer and sub-batch: the sub-layer's input (the residual stream).
    x_in: Vec<Vec<Option<Tensor>>>,
    /// Per sub-batch: the gradient of the residual stream where backward has reached.
    g_cur: Vec<Option<Tensor>>,
    grads: Vec<Vec<f32>>,
    loss: f32,
}

impl TpWork<'_> {
    fn add_grad(&mut self, name: &str, g: &candle_core::backprop::GradStore, v: &Var) -> candle_core::Result<()> {
        if let Some(gi) = g.get(v.as_tensor()) {
            let i = self.tr.params.idx(name);
            for (a, b) in self.grads[i].iter_mut().zip(gi.flatten_all()?.to_vec1::<f32>()?) {
                *a += b;
            }
        }
        Ok(())
    }

    /// Backward through layer norm `pre` (`l3.ln1`) at `x` with output gradient `gy`: adds the
    /// norm's gradients, returns the input's.
    fn ln_backward(&mut self, pre: &str, x: &Tensor, gy: &Tensor) -> candle_core::Result<Tensor> {
        let xv = Var::from_tensor(&x.detach())?;
        let (gv, bv) = (self.tr.v(&format!("{pre}.g"))?, self.tr.v(&format!("{pre}.b"))?);
        let y = ln(xv.as_tensor(), gv.as_tensor(), bv.as_tensor())?;
        let g = (y * gy)?.sum_all()?.backward()?;
        self.add_grad(&format!("{pre}.g"), &g, &gv)?;
        self.add_grad(&format!("{pre}.b"), &g, &bv)?;
        g.get(xv.as_tensor()).cloned().map_or_else(|| xv.as_tensor().zeros_like(), Ok)
    }

    /// The tokens (inputs or targets) of the sequences `seqs`.
    fn tokens(&self, of: &[u32], seqs: &[usize]) -> Vec<u32> {
        let t = self.tr.cfg.model.seq;
        seqs.iter().flat_map(|&q| of[q * t..(q + 1) * t].iter().copied()).collect()
    }

    /// The gradient of sub-layer `s + 1`'s input (the residual stream after sub-layer `s`):
    /// the stream's gradient plus the branch's, through `s + 1`'s norm.
    fn finish_above(&mut self, s1: usize, j: usize, g_branch: Tensor) -> candle_core::Result<Tensor> {
        let x = self.x_in[s1][j].take().ok_or_else(|| msg("backward before forward"))?;
        let g = self.g_cur[j].take().ok_or_else(|| msg("backward out of order"))?;
        g + self.ln_backward(&norm_of(s1), &x, &g_branch)?
    }

    /// Sub-batch `j`'s rows of `x`, part `p` of `m` (a cut to a smaller group).
    fn part(x: &Tensor, m: usize, p: usize) -> candle_core::Result<Tensor> {
        let n = x.dims2()?.0 / m;
        x.narrow(0, p * n, n)?.contiguous()
    }

    fn run(&mut self, stage: usize, j: usize, input: Option<Vec<f32>>) -> candle_core::Result<Vec<f32>> {
        let tr = self.tr;
        let lay = &tr.lay;
        let subs = lay.deg.len();
        let h = tr.cfg.model.hidden;
        let prev = stage.checked_sub(1).map(|p| lay.kinds[p]);
        let input = match input {
            Some(v) => {
                let rows = v.len() / h;
                Some(Tensor::from_vec(v, (rows, h), &tr.dev)?)
            }
            None => None,
        };
        let need = |i: Option<Tensor>| i.ok_or_else(|| msg(format!("stage {stage} has no input")));
        let flat = |x: Tensor| x.flatten_all()?.to_vec1::<f32>();
        match lay.kinds[stage] {
            Kind::Fwd(s) => {
                let x = match prev {
                    None => {
                        let seqs = &lay.rows[0][j];
                        let model = crate::model::Model::new(&tr.cfg, &tr.params).map_err(msg)?;
                        model.embed(&self.tokens(self.x_tok, seqs), seqs.len()).map_err(msg)?
                    }
                    Some(Kind::ReshardFwd(_)) => need(input)?,
                    _ => (self.x_in[s - 1][j].clone().ok_or_else(|| msg("forward out of order"))? + need(input)?)?,
                };
                let norm = norm_of(s);
                let a = ln(&x, &tr.t(&format!("{norm}.g"))?, &tr.t(&format!("{norm}.b"))?)?;
                let p = |w: &str| format!("l{}.{w}", s / 2);
                let part = if s % 2 == 0 {
                    let w = [tr.t(&p("attn.wq"))?, tr.t(&p("attn.wk"))?, tr.t(&p("attn.wv"))?, tr.t(&p("attn.wo"))?];
                    tr.attn_partial(s, &a, [&w[0], &w[1], &w[2], &w[3]])?
                } else {
                    gelu(&a.matmul(&tr.t(&p("mlp.w1"))?)?).map_err(msg)?.matmul(&tr.t(&p("mlp.w2"))?)?
                };
                self.x_in[s][j] = Some(x);
                flat(part)
            }
            Kind::ReshardFwd(s) => {
                let bd = lay.bounds[s].ok_or_else(|| msg("reshard without a boundary"))?;
                let y = (self.x_in[s][j].clone().ok_or_else(|| msg("forward out of order"))? + need(input)?)?;
                // to a larger group: all of this group's rows go to the gather; to a smaller
                // one: this rank's part of them
                flat(if bd.from < bd.to { y } else { Self::part(&y, bd.m, bd.pos)? })
            }
            Kind::Bwd(s) => {
                let g = if s + 1 == subs {
                    let x_l = (self.x_in[s][j].clone().ok_or_else(|| msg("forward did not run"))? + need(input)?)?;
                    self.head(&x_l, j)?
                } else if let Some(Kind::ReshardBwd(_)) = prev {
                    need(input)?
                } else {
                    self.finish_above(s + 1, j, need(input)?)?
                };
                let x = self.x_in[s][j].clone().ok_or_else(|| msg("forward did not run"))?;
                let norm = norm_of(s);
                let a = ln(&x, &tr.t(&format!("{norm}.g"))?, &tr.t(&format!("{norm}.b"))?)?;
                let av = Var::from_tensor(&a)?;
                let p = |w: &str| format!("l{}.{w}", s / 2);
                let names: &[&str] =
                    if s % 2 == 0 { &["attn.wq", "attn.wk", "attn.wv", "attn.wo"] } else { &["mlp.w1", "mlp.w2"] };
                let ws: Vec<Var> = names.iter().map(|w| tr.v(&p(w))).collect::<candle_core::Result<_>>()?;
                let y = if s % 2 == 0 {
                    tr.attn_partial(
                        s,
                        av.as_tensor(),
                        [ws[0].as_tensor(), ws[1].as_tensor(), ws[2].as_tensor(), ws[3].as_tensor()],
                    )?
                } else {
                    gelu(&av.as_tensor().matmul(ws[0].as_tensor())?).map_err(msg)?.matmul(ws[1].as_tensor())?
                };
                let gs = (y * &g)?.sum_all()?.backward()?;
                for (w, v) in names.iter().zip(&ws) {
                    self.add_grad(&p(w), &gs, v)?;
                }
                self.g_cur[j] = Some(g);
                flat(gs.get(av.as_tensor()).cloned().map_or_else(|| av.as_tensor().zeros_like(), Ok)?)
            }
            Kind::ReshardBwd(s1) => {
                let bd = lay.bounds[s1 - 1].ok_or_else(|| msg("reshard without a boundary"))?;
                let g = self.finish_above(s1, j, need(input)?)?;
                // forward gathered: the gradient is replicated in the larger group, keep this
                // rank's part; forward cut: all-gather the parts back
                flat(if bd.from < bd.to { Self::part(&g, bd.m, bd.pos)? } else { g })
            }
            Kind::Embed => {
                let g0 = self.finish_above(0, j, need(input)?)?;
                let seqs = lay.rows[0][j].clone();
                let model = crate::model::Model::new(&tr.cfg, &tr.params).map_err(msg)?;
                model.embed_backward(&self.tokens(self.x_tok, &seqs), seqs.len(), &g0, &mut self.grads).map_err(msg)?;
                Ok(Vec::new())
            }
        }
    }

    /// The head on sub-batch `j`'s final activations: adds the weighted loss and the head's
    /// gradients, returns the gradient of the activations.
    fn head(&mut self, x: &Tensor, j: usize) -> candle_core::Result<Tensor> {
        let tr = self.tr;
        let rows = &tr.lay.rows[tr.lay.deg.len() - 1];
        // the group's loss is the mean over its tokens: sub-batch j weighs its share
        let total: usize = rows.iter().map(Vec::len).sum();
        let weight = rows[j].len() as f64 / total as f64;
        let (gv, bv, hv) = (tr.v("lnf.g")?, tr.v("lnf.b")?, tr.v("head")?);
        let xv = Var::from_tensor(&x.detach())?;
        let logits = ln(xv.as_tensor(), gv.as_tensor(), bv.as_tensor())?.matmul(hv.as_tensor())?;
        let targets = self.tokens(self.y_tok, &rows[j]);
        let tg = Tensor::from_vec(targets, rows[j].len() * tr.cfg.model.seq, &tr.dev)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &tg)?;
        let g = loss.affine(weight, 0.0)?.backward()?;
        self.loss += (weight * loss.to_scalar::<f32>()? as f64) as f32;
        self.add_grad("lnf.g", &g, &gv)?;
        self.add_grad("lnf.b", &g, &bv)?;
        self.add_grad("head", &g, &hv)?;
        g.get(xv.as_tensor()).cloned().map_or_else(|| xv.as_tensor().zeros_like(), Ok)
    }
}

/// One emulated iteration's shared state: the device, and every parameter's gradient
/// (pseudo-gradients; the data-parallel tails average them in place).
struct EmuTpWork<'a> {
    tr: &'a TpTrainer,
    emu: &'a Emulated,
    grads: Vec<Vec<f32>>,
}

impl Work for EmuTpWork<'_> {
    fn compute(&mut self, stage: usize, j: usize, _input: Option<Vec<f32>>) -> std::result::Result<Vec<f32>, BoxErr> {
        for op in self.tr.stage_ops(self.emu, stage, j) {
            self.emu.device.run(op.flops, op.bytes);
        }
        let lay = &self.tr.lay;
        // activations travel as bf16: `hidden` values of 2 bytes, as f32 words
        let width = (self.tr.cfg.model.hidden * ACTIVATION_DTYPE.size()).div_ceil(4);
        let rows = |s: usize| lay.rows[s][j].len() * self.tr.cfg.model.seq;
        let bound = |s: usize| lay.bounds[s].ok_or_else(|| Box::new(msg("reshard without a boundary")) as BoxErr);
        let n = match lay.kinds[stage] {
            Kind::Fwd(s) | Kind::Bwd(s) => rows(s),
            // as the real stages: to a larger group all of this group's rows, to a smaller one
            // this rank's part
            Kind::ReshardFwd(s) => {
                let bd = bound(s)?;
                if bd.from < bd.to {
                    rows(s)
                } else {
                    rows(s) / bd.m
                }
            }
            Kind::ReshardBwd(s1) => {
                let bd = bound(s1 - 1)?;
                if bd.from < bd.to {
                    rows(s1) / bd.m
                } else {
                    rows(s1)
                }
            }
            Kind::Embed => 0,
        };
        Ok(vec![0.0; n * width])
    }

    fn tail_input(&mut self, tail: usize) -> Vec<f32> {
        self.tr.tail_grads(&self.grads, tail)
    }

    fn tail_output(&mut self, tail: usize, data: Vec<f32>) {
        self.tr.set_tail_grads(&mut self.grads, tail, &data)
    }
}

impl Work for TpWork<'_> {
    fn compute(&mut self, stage: usize, sub: usize, input: Option<Vec<f32>>) -> std::result::Result<Vec<f32>, BoxErr> {
        self.run(stage, sub, input).map_err(|e| Box::new(e) as BoxErr)
    }

    fn tail_input(&mut self, tail: usize) -> Vec<f32> {
        self.tr.tail_grads(&self.grads, tail)
    }

    fn tail_output(&mut self, tail: usize, data: Vec<f32>) {
        self.tr.set_tail_grads(&mut self.grads, tail, &data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> TrainConfig {
        TrainConfig::from_toml_str(
            "name = \"t\"\n[model]\nlayers = 2\nhidden = 16\nheads = 4\nseq = 4\nexperts = 1\ntop_k = 1\ncapacity_factor = 1.0\n\
             moe_every = 9\n[train]\nbatch = 4\nlr = 1e-3\nseed = 1\n[data]\npath = \"x\"\n",
        )
        .unwrap()
    }

    #[test]
    fn a_mixed_layout_reshards_where_degrees_change_and_rows_follow() {
        // 4 ranks, global batch 8, 2 sub-batches: attention at 4, MLPs at 2 and 1
        let spec = TpSpec { degrees: vec![4, 2, 2, 1], schedule: Schedule::Oases, sub_batches: 2, global_batch: Some(8) };
        let lay = Layout::new(&cfg(), &spec, 4, 3).unwrap();
        let names: Vec<&str> = lay.program.stages.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "L0.attn",
                "reshard L0.attn>L0.mlp",
                "L0.mlp",
                "L1.attn",
                "reshard L1.attn>L1.mlp",
                "L1.mlp",
                "head+L1.mlp.bwd",
                "reshard L1.attn<L1.mlp",
                "L1.attn.bwd",
                "L0.mlp.bwd",
                "reshard L0.attn<L0.mlp",
                "L0.attn.bwd",
                "embed.bwd"
            ]
        );
        // cutting to smaller groups needs no collective forward and a gather backward
        assert!(lay.program.stages[1].comm.is_none() && lay.program.stages[7].comm.is_some());
        // rank 3: at degree 4 every sequence (two sub-batches of 4); at degree 2 (group 1)
        // the second half of each; at degree 1 (rank 3 = second half of group 1's)
        assert_eq!(lay.rows[0], vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(lay.rows[1], vec![vec![2, 3], vec![6, 7]]);
        assert_eq!(lay.rows[3], vec![vec![3], vec![7]]);
        // tails: head and L1.mlp at degree 1 (4 replicas), L0.mlp and L1.attn at 2, none at 4;
        // a tail never comes before the stage that finishes its sub-layer's norm
        let tails: Vec<(&str, usize)> = lay.program.tails.iter().map(|t| (t.name.as_str(), t.after_stage)).collect();
        assert_eq!(tails, [("head.grads", 6), ("L1.mlp.grads", 7), ("L1.attn.grads", 9), ("L0.mlp.grads", 10)]);
        let e = Layout::new(&cfg(), &TpSpec { global_batch: Some(6), ..spec }, 4, 0).unwrap_err().to_string();
        assert!(e.contains("does not split into 2 equal sub-batches"), "{e}");
    }
}
