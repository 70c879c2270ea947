//! [`ShardEngine`]: a model's layers held as shards, their gathers and reductions as handles, and
//! Adam on the local shards.

use ironweave_transport::{CollHandle, Communicator, ReduceOp};
use ironweave_units::Locked;

use crate::trace::{log_span, SpanLog};
use crate::{adam_update, Adam, CollSpan, Groups, Lane, Result, SdpError, Strategy};

/// One part of a layer: a contiguous range of its parameters, sharded over a group of `n`
/// (padded to a multiple of `n`); this rank holds block `me`.
#[derive(Debug, Clone)]
struct Part {
    /// Offset of the part in its layer.
    lo: usize,
    /// This rank's block of the part.
    me: usize,
    /// Elements of the layer in this part.
    len: usize,
    /// Padded block size.
    block: usize,
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    /// The averaged gradient of this rank's block, when reduced.
    g: Option<Vec<f32>>,
}

impl Layer {
    fn len(&self) -> usize {
        self.parts.iter().map(|p| p.1.len).sum()
    }
}

impl Part {
    fn new(offset: usize, values: &[f32], n: usize, me: usize) -> Part {
        let block = values.len().div_ceil(n.max(1));
        let mut p = vec![0.0; block];
        let lo = (me * block).min(values.len());
        let hi = ((me + 1) * block).min(values.len());
        p[..hi - lo].copy_from_slice(&values[lo..hi]);
        Part { lo: offset, me, len: values.len(), block, m: vec![0.0; block], v: vec![0.0; block], p, g: None }
    }

    /// The layer elements this rank's block holds (padding excluded).
    fn held(&self) -> std::ops::Range<usize> {
        let a = (self.me * self.block).min(self.len);
        let b = ((self.me + 1) * self.block).min(self.len);
        self.lo + a..self.lo + b
    }
}

/// Which group a part's shards live on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Over {
    /// Every rank holds all of it (replicated).
    Nobody,
    /// Sharded over all ranks.
    World,
    /// Sharded within the host, gradients all-reduced across hosts.
    Host,
}

#[derive(Debug, Clone)]
struct Layer {
    /// (group, part): the first part is elements `[0, parts[0].len)`, the second the rest.
    parts: Vec<(Over, Part)>,
    /// The element ranges of the layer weight decay applies to (a flat layer holds matrices
    /// and norms side by side).
    decay: Vec<std::ops::Range<usize>>,
}

/// A gather in flight: the layer's full parameters once waited.
pub struct Gather {
    layer: usize,
    parts: Vec<GatherPart>,
    log: SpanLog,
}

/// One part of a gather: in flight on its group, or this rank's own copy (replicated).
struct GatherPart {
    handle: Option<(Lane, CollHandle<Vec<f32>>)>,
    len: usize,
    local: Vec<f32>,
}

impl std::fmt::Debug for Gather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gather").field("parts", &self.parts.len()).finish()
    }
}

impl Gather {
    /// The layer's full parameters.
    pub fn wait(self) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for p in self.parts {
            let mut all = match p.handle {
                Some((lane, h)) => {
                    let deadline = h.deadline();
                    let (v, start, end) = h.wait_timed(deadline)?;
                    log_span(&self.log, CollSpan { lane, name: format!("gather {}", self.layer), start, end, elems: v.len() });
                    v
                }
                None => p.local,
            };
            all.truncate(p.len);
            out.extend_from_slice(&all);
        }
        Ok(out)
    }
}

/// Gradient reductions in flight for one layer: each part's reduce-scatter (or all-reduce),
/// then, for a host part with more than one host, the cross-host all-reduce of its shard
/// ([`ShardEngine::advance_reduce`] starts it).
pub struct Reduce {
    layer: usize,
    handles: Vec<(usize, Stage, CollHandle<Vec<f32>>)>,
}

/// Which reduction a handle is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Reduce-scatter (or `replicated`'s all-reduce) over the part's group.
    First,
    /// The cross-host all-reduce of a host part's shard.
    CrossHost,
}

impl std::fmt::Debug for Reduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reduce").field("layer", &self.layer).field("parts", &self.handles.len()).finish()
    }
}

/// One tensor of a sharded rank's checkpoint ([`ShardEngine::checkpoint_tensors`]).
#[derive(Debug, Clone)]
pub struct CheckpointTensor<'a> {
    /// The rank-local name (`7.1.m`: layer 7, part 1, first moment).
    pub name: String,
    /// Its elements.
    pub values: &'a [f32],
    /// The global tensor it is a slice of (`layer7.m`).
    pub global: String,
    /// The global tensor's length (the layer's elements).
    pub global_len: usize,
    /// Where the slice starts in it.
    pub offset: usize,
    /// Whether this copy is the one a loader reads.
    pub owner: bool,
}

/// The sharded engine of one rank.
pub struct ShardEngine {
    groups: Groups,
    strategy: Strategy,
    layers: Vec<Layer>,
    adam: Adam,
    t: u64,
    log: SpanLog,
}

impl std::fmt::Debug for ShardEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardEngine").field("strategy", &self.strategy).field("layers", &self.layers.len()).finish()
    }
}

impl ShardEngine {
    /// The learning rate of the next steps (a schedule, or a fine-tuning phase); the moments
    /// and the step count carry on.
    pub fn set_lr(&mut self, lr: f64) {
        self.adam.lr = lr;
    }

    /// Shard `layers` (each layer's full initial parameters, the same on every rank) under
    /// `strategy`; `fractions[l]` is the share of layer `l` sharded over all ranks under `hsdp`
    /// (ignored otherwise; the plan's `x`).
    pub fn new(groups: Groups, strategy: Strategy, layers: &[Vec<f32>], fractions: &[f64], adam: Adam) -> Result<Self> {
        if strategy == Strategy::Hsdp && fractions.len() != layers.len() {
            return Err(SdpError::Invalid(format!(
                "hsdp needs one fraction per layer: {} layers, {} fractions",
                layers.len(),
                fractions.len()
            )));
        }
        if let Some(f) = fractions.iter().find(|f| !(0.0..=1.0).contains(*f)) {
            return Err(SdpError::Invalid(format!("fraction {f} is outside [0, 1]")));
        }
        let (wn, wr) = (groups.world.size(), groups.world.rank());
        let (hn, hr) = (groups.intra.size(), groups.intra.rank());
        let layers = layers
            .iter()
            .enumerate()
            .map(|(l, w)| {
                let split = match strategy {
                    Strategy::Replicated | Strategy::Full | Strategy::Hybrid => w.len(),
                    Strategy::Hsdp => (w.len() as f64 * fractions[l]).round() as usize,
                };
                let (a, b) = w.split_at(split.min(w.len()));
                let mut parts = Vec::new();
                if !a.is_empty() {
                    parts.push(match strategy {
                        Strategy::Replicated => (Over::Nobody, Part::new(0, a, 1, 0)),
                        Strategy::Hybrid => (Over::Host, Part::new(0, a, hn, hr)),
                        _ => (Over::World, Part::new(0, a, wn, wr)),
                    });
                }
                if !b.is_empty() {
                    parts.push((Over::Host, Part::new(a.len(), b, hn, hr)));
                }
                Layer { parts, decay: std::iter::once(0..w.len()).collect() }
            })
            .collect();
        Ok(ShardEngine { groups, strategy, layers, adam, t: 0, log: SpanLog::default() })
    }

    /// Which layers weight decay applies to (default: all).
    pub fn with_decay(self, mask: &[bool]) -> Result<Self> {
        let ranges: Vec<Vec<std::ops::Range<usize>>> = self
            .layers
            .iter()
            .zip(mask)
            .map(|(l, &d)| if d { std::iter::once(0..l.len()).collect() } else { Vec::new() })
            .collect();
        if mask.len() != self.layers.len() {
            return Err(SdpError::Invalid(format!("{} decay flags for {} layers", mask.len(), self.layers.len())));
        }
        self.with_decay_ranges(&ranges)
    }

    /// Which elements of each layer weight decay applies to (default: all): ranges in the
    /// layer's flat order, e.g. its matrices but not its norms.
    pub fn with_decay_ranges(mut self, ranges: &[Vec<std::ops::Range<usize>>]) -> Result<Self> {
        if ranges.len() != self.layers.len() {
            return Err(SdpError::Invalid(format!(
                "decay ranges for {} layers, the engine has {}",
                ranges.len(),
                self.layers.len()
            )));
        }
        for (l, r) in self.layers.iter_mut().zip(ranges) {
            if let Some(bad) = r.iter().find(|x| x.start > x.end || x.end > l.len()) {
                return Err(SdpError::Invalid(format!("decay range {bad:?} is outside a layer of {} elements", l.len())));
            }
            l.decay = r.clone();
        }
        Ok(self)
    }

    /// The strategy.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    fn group(&self, over: Over) -> &Communicator {
        match over {
            Over::World | Over::Nobody => &self.groups.world,
            Over::Host => &self.groups.intra,
        }
    }

    fn lane(over: Over) -> Lane {
        match over {
            Over::World | Over::Nobody => Lane::World,
            Over::Host => Lane::Intra,
        }
    }

    /// The collectives that finished since the last call, with their times on the wire.
    pub fn take_spans(&self) -> Vec<CollSpan> {
        std::mem::take(&mut *self.log.locked())
    }

    /// Elements of layer `l` (0 if there is no such layer).
    pub fn layer_len(&self, l: usize) -> usize {
        self.layers.get(l).map_or(0, |layer| layer.parts.iter().map(|p| p.1.len).sum())
    }

    /// Starts gathering layer `l`'s parameters (each part on its group, at once).
    pub fn start_gather(&self, l: usize) -> Result<Gather> {
        let layer = self.layers.get(l).ok_or_else(|| SdpError::Invalid(format!("no layer {l}")))?;
        let mut parts = Vec::new();
        for (over, part) in &layer.parts {
            parts.push(match over {
                Over::Nobody => GatherPart { handle: None, len: part.len, local: part.p.clone() },
                _ => GatherPart {
                    handle: Some((Self::lane(*over), self.group(*over).iall_gather(part.p.clone())?)),
                    len: part.len,
                    local: Vec::new(),
                },
            });
        }
        Ok(Gather { layer: l, parts, log: self.log.clone() })
    }

    /// Starts reducing layer `l`'s full gradient (this rank's batch): each part reduce-scattered
    /// over its group (the host part then all-reduced across hosts when the reduce-scatter
    /// ends, in [`Self::finish_reduce`]); `replicated` all-reduces the whole.
    pub fn start_reduce(&self, l: usize, grad: &[f32]) -> Result<Reduce> {
        let layer = self.layers.get(l).ok_or_else(|| SdpError::Invalid(format!("no layer {l}")))?;
        let total: usize = layer.parts.iter().map(|p| p.1.len).sum();
        if grad.len() != total {
            return Err(SdpError::Invalid(format!("layer {l} has {total} parameters, the gradient {}", grad.len())));
        }
        let mut handles = Vec::new();
        let mut at = 0;
        for (k, (over, part)) in layer.parts.iter().enumerate() {
            let g = &grad[at..at + part.len];
            at += part.len;
            let h = match over {
                Over::Nobody => self.groups.world.iall_reduce(g.to_vec(), ReduceOp::Sum)?,
                _ => {
                    let n = self.group(*over).size();
                    let mut padded = g.to_vec();
                    padded.resize(part.block * n, 0.0);
                    self.group(*over).ireduce_scatter(padded, ReduceOp::Sum)?
                }
            };
            handles.push((k, Stage::First, h));
        }
        Ok(Reduce { layer: l, handles })
    }

    /// Waits for one reduction, logs its span, and either keeps the averaged gradient block or
    /// (a host part's reduce-scatter, several hosts) starts its cross-host all-reduce.
    fn settle(&mut self, layer: usize, k: usize, stage: Stage, h: CollHandle<Vec<f32>>) -> Result<Option<CollHandle<Vec<f32>>>> {
        let over = self.layers[layer].parts[k].0;
        let deadline = h.deadline();
        let (g, start, end) = h.wait_timed(deadline)?;
        let (lane, what) = match (stage, over) {
            (Stage::CrossHost, _) => (Lane::Inter, "all-reduce"),
            (Stage::First, Over::Nobody) => (Lane::World, "all-reduce"),
            (Stage::First, o) => (Self::lane(o), "reduce-scatter"),
        };
        log_span(&self.log, CollSpan { lane, name: format!("{what} {layer}"), start, end, elems: g.len() });
        if stage == Stage::First && over == Over::Host && self.groups.inter.size() > 1 {
            return Ok(Some(self.groups.inter.iall_reduce(g, ReduceOp::Sum)?));
        }
        let world = self.groups.world.size() as f32;
        self.layers[layer].parts[k].1.g = Some(g.into_iter().map(|x| x / world).collect());
        Ok(None)
    }

    /// Waits for a layer's host parts' reduce-scatters (within the host: quick) and starts the
    /// cross-host all-reduces that follow them, without waiting for those or for the all-rank
    /// part's reduction: called right after [`Self::start_reduce`], the cross-host link gets the
    /// layer's gradients while the next layer's backward computes and the all-rank part's
    /// reduce-scatter is on its own link.
    pub fn advance_reduce(&mut self, r: Reduce) -> Result<Reduce> {
        let chained = self.groups.inter.size() > 1;
        let mut next = Vec::with_capacity(r.handles.len());
        for (k, stage, h) in r.handles {
            let host_first = stage == Stage::First && self.layers[r.layer].parts[k].0 == Over::Host;
            if !(host_first && chained) {
                next.push((k, stage, h));
            } else if let Some(h2) = self.settle(r.layer, k, stage, h)? {
                next.push((k, Stage::CrossHost, h2));
            }
        }
        Ok(Reduce { layer: r.layer, handles: next })
    }

    /// Waits for a layer's reductions and keeps this rank's averaged gradient blocks.
    pub fn finish_reduce(&mut self, r: Reduce) -> Result<()> {
        // every cross-host all-reduce is started before any is waited
        let r = self.advance_reduce(r)?;
        for (k, stage, h) in r.handles {
            if let Some(h2) = self.settle(r.layer, k, stage, h)? {
                // a host part whose cross-host stage had not started (one host)
                self.settle(r.layer, k, Stage::CrossHost, h2)?;
            }
        }
        Ok(())
    }

    /// One Adam step on every local shard (each layer's gradients must have been reduced).
    pub fn step(&mut self) -> Result<()> {
        self.t += 1;
        let (a, t) = (self.adam, self.t);
        // every layer's gradients first: a step never applies to some layers only
        if let Some(l) = self.layers.iter().position(|l| l.parts.iter().any(|(_, p)| p.g.is_none())) {
            self.t -= 1;
            return Err(SdpError::Invalid(format!("layer {l}: step before its gradients were reduced")));
        }
        for layer in self.layers.iter_mut() {
            for (_, part) in layer.parts.iter_mut() {
                let g = part.g.take().unwrap_or_default();
                // the block in runs of equal decay (the padding beyond the layer: no decay)
                let held = part.held();
                let mut cuts = vec![0, part.block];
                for r in &layer.decay {
                    for x in [r.start, r.end] {
                        if x > held.start && x < held.end {
                            cuts.push(x - held.start);
                        }
                    }
                }
                cuts.sort_unstable();
                cuts.dedup();
                for w in cuts.windows(2) {
                    let (i, j) = (w[0], w[1]);
                    let at = held.start + i;
                    let decay = at < held.end && layer.decay.iter().any(|r| r.contains(&at));
                    adam_update(&a, t, decay, &mut part.p[i..j], &mut part.m[i..j], &mut part.v[i..j], &g[i..j]);
                }
            }
        }
        Ok(())
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// This rank's shard tensors — each part's parameters and both moments, in a fixed order
    /// (layer, part, then `p`, `m`, `v`) — with their names (`7.1.m`: layer 7, part 1, first
    /// moment): what a checkpoint holds.
    pub fn shard_tensors(&self) -> Vec<(String, &[f32])> {
        let mut out = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            for (k, (_, part)) in layer.parts.iter().enumerate() {
                out.push((format!("{l}.{k}.p"), part.p.as_slice()));
                out.push((format!("{l}.{k}.m"), part.m.as_slice()));
                out.push((format!("{l}.{k}.v"), part.v.as_slice()));
            }
        }
        out
    }

    /// What a checkpoint holds of this rank's shards, each with its place in the global model:
    /// `(name, elements, global tensor, its length, offset in it, owner)` — the elements of a
    /// block that are the layer's (padding left out: it stays zero), as a slice of the flat
    /// global tensor `layer{l}.p` / `.m` / `.v`. Owners: every rank for the all-rank part (the
    /// blocks are disjoint), the ranks of the first host for a host part (the other hosts hold
    /// equal copies), rank 0 under `replicated`.
    pub fn checkpoint_tensors(&self) -> Vec<CheckpointTensor<'_>> {
        let first_host = self.groups.inter.rank() == 0;
        let rank0 = self.groups.world.rank() == 0;
        let mut out = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let layer_len: usize = layer.parts.iter().map(|(_, p)| p.len).sum();
            for (k, (over, part)) in layer.parts.iter().enumerate() {
                let held = part.held();
                let owner = match over {
                    Over::World => true,
                    Over::Host => first_host,
                    Over::Nobody => rank0,
                };
                for (what, v) in [("p", &part.p), ("m", &part.m), ("v", &part.v)] {
                    out.push(CheckpointTensor {
                        name: format!("{l}.{k}.{what}"),
                        values: &v[..held.len()],
                        global: format!("layer{l}.{what}"),
                        global_len: layer_len,
                        offset: held.start,
                        owner,
                    });
                }
            }
        }
        out
    }

    /// Loads shards saved from [`Self::shard_tensors`] (by name; each must have its size) and
    /// the step count.
    pub fn load_shards(&mut self, steps: u64, tensor: impl Fn(&str) -> Option<Vec<u8>>) -> Result<()> {
        for (l, layer) in self.layers.iter_mut().enumerate() {
            for (k, (_, part)) in layer.parts.iter_mut().enumerate() {
                let held = part.held().len();
                for (what, dst) in [("p", &mut part.p), ("m", &mut part.m), ("v", &mut part.v)] {
                    let name = format!("{l}.{k}.{what}");
                    let b = tensor(&name).ok_or_else(|| SdpError::Invalid(format!("the restored state lacks shard `{name}`")))?;
                    // the whole block, or its held elements alone ([`Self::checkpoint_tensors`]:
                    // the padding is zero)
                    if b.len() != dst.len() * 4 && b.len() != held * 4 {
                        return Err(SdpError::Invalid(format!(
                            "shard `{name}`: {} bytes restored for {} floats (a checkpoint of another layout)",
                            b.len(),
                            dst.len()
                        )));
                    }
                    dst.fill(0.0);
                    for (d, c) in dst.iter_mut().zip(b.chunks_exact(4)) {
                        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                    part.g = None;
                }
            }
        }
        self.t = steps;
        Ok(())
    }

    /// Parameters, gradients and both Adam moments this rank holds between iterations, bytes.
    pub fn state_bytes(&self) -> u64 {
        self.layers.iter().flat_map(|l| l.parts.iter()).map(|(_, p)| (p.p.len() * 4 * 4) as u64).sum()
    }
}
