//! Cluster, device and model descriptions: plain serde structs read from TOML
//! (`configs/clusters`, `configs/devices`, `configs/models`). Parsing takes a string; reading
//! the file is the caller's job, so this crate does no IO.

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};

const GIB: f64 = (1u64 << 30) as f64;

/// Where a link sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scope {
    /// Joins the devices of one node, in aligned blocks of `span` devices (NVLink bridges
    /// join pairs: `span = 2`; PCIe or an NVSwitch joins the whole node).
    IntraNode,
    /// Joins nodes through NICs; `instances` NICs per node are shared by the node's devices.
    InterNode,
}

/// One kind of link (NVLink, PCIe, InfiniBand, ...).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkDesc {
    /// Name shown in plans and timelines.
    pub name: String,
    /// Intra-node or inter-node.
    pub scope: Scope,
    /// Per-message latency (the alpha of the alpha-beta model), microseconds.
    pub latency_us: f64,
    /// Bus bandwidth one device reaches on this link, GB/s (10^9 bytes/s) — what nccl-tests
    /// reports as busbw. For an inter-node link: the bandwidth of one NIC.
    pub bandwidth_gbyte_s: f64,
    /// Intra-node: devices per block this link joins (default: the whole node).
    #[serde(default)]
    pub span: Option<u32>,
    /// Inter-node: NICs per node (default 1).
    #[serde(default)]
    pub instances: Option<u32>,
}

impl LinkDesc {
    /// Beta: bytes per second.
    pub fn bytes_per_s(&self) -> f64 {
        self.bandwidth_gbyte_s * 1e9
    }
    /// Alpha: seconds.
    pub fn latency_s(&self) -> f64 {
        self.latency_us * 1e-6
    }
}

/// The accelerator.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceDesc {
    /// Marketing name, for tables.
    pub name: String,
    /// Peak dense half-precision throughput, TFLOP/s.
    pub peak_tflops: f64,
    /// Fraction of peak that large matmuls reach (model FLOPs utilisation of one kernel).
    pub efficiency: f64,
    /// Device memory, GiB.
    pub memory_gib: f64,
    /// Device memory bandwidth, GB/s (10^9 bytes/s): the rate of memory-bound operations.
    /// Optional in a cluster description (the planners cost matmuls only); required in a
    /// device profile (`configs/devices/*.toml`), which emulated compute runs on.
    #[serde(default)]
    pub memory_gbyte_s: Option<f64>,
}

impl DeviceDesc {
    /// Parses and validates a device profile (`configs/devices/*.toml`: the fields of this
    /// struct at the top level, `memory_gbyte_s` required).
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let d: DeviceDesc = toml::from_str(text).map_err(|source| PlanError::Parse { what: "device profile".into(), source })?;
        let what = format!("device profile `{}`", d.name);
        d.validate(&what, "")?;
        if d.memory_gbyte_s.is_none() {
            return Err(PlanError::invalid(what, "memory_gbyte_s is missing: a device profile needs its memory bandwidth"));
        }
        Ok(d)
    }

    /// Checks the values no real device has; `what` names the file or cluster in the error,
    /// `at` is where the fields sit (`device.` in a cluster description, nothing in a profile).
    pub fn validate(&self, what: &str, at: &str) -> Result<()> {
        if !(self.peak_tflops > 0.0 && self.peak_tflops.is_finite()) {
            return Err(PlanError::invalid(what, format!("{at}peak_tflops = {} must be a positive number", self.peak_tflops)));
        }
        if !(self.efficiency > 0.0 && self.efficiency <= 1.0) {
            return Err(PlanError::invalid(what, format!("{at}efficiency = {} must be in (0, 1]", self.efficiency)));
        }
        if !(self.memory_gib.is_finite() && self.memory_gib > 0.0) {
            return Err(PlanError::invalid(what, format!("{at}memory_gib = {} must be positive", self.memory_gib)));
        }
        if let Some(bw) = self.memory_gbyte_s {
            if !(bw.is_finite() && bw > 0.0) {
                return Err(PlanError::invalid(what, format!("{at}memory_gbyte_s = {bw} must be a positive number")));
            }
        }
        Ok(())
    }

    /// FLOP/s a large kernel reaches: peak × efficiency.
    pub fn flops_per_s(&self) -> f64 {
        self.peak_tflops * 1e12 * self.efficiency
    }

    /// The device as the roofline model sees it (FLOP/s and memory bytes/s).
    pub fn roofline(&self) -> ironweave_units::Roofline {
        ironweave_units::Roofline { flops_per_s: self.flops_per_s(), bytes_per_s: self.memory_gbyte_s.map(|g| g * 1e9) }
    }
}

/// The host side of a node.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostDesc {
    /// Host memory per node, GiB.
    pub memory_gib: f64,
    /// Device-to-host copy bandwidth per device, GB/s.
    pub pcie_gbyte_s: f64,
    /// Persistent storage write bandwidth per node, GB/s (local NVMe or a share of a parallel FS).
    pub storage_gbyte_s: f64,
}

/// A cluster: identical nodes of identical devices.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterDesc {
    /// Name shown in tables.
    pub name: String,
    /// Number of nodes.
    pub nodes: u32,
    /// Devices per node.
    pub devices_per_node: u32,
    /// The accelerator.
    pub device: DeviceDesc,
    /// The host.
    pub host: HostDesc,
    /// Links; at least one intra-node link covering the whole node, and one inter-node link
    /// when `nodes > 1`.
    pub links: Vec<LinkDesc>,
}

impl ClusterDesc {
    /// Parse and validate a cluster description.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let c: ClusterDesc =
            toml::from_str(text).map_err(|source| PlanError::Parse { what: "cluster description".into(), source })?;
        c.validate()?;
        Ok(c)
    }

    /// Total number of devices.
    pub fn devices(&self) -> u32 {
        self.nodes * self.devices_per_node
    }

    /// Device memory in bytes.
    pub fn device_memory_bytes(&self) -> f64 {
        self.device.memory_gib * GIB
    }

    /// Sustained device FLOP/s.
    pub fn flops(&self) -> f64 {
        self.device.flops_per_s()
    }

    /// Intra-node links joining blocks of at least `n` devices, fastest first.
    pub fn intra_links_covering(&self, n: u32) -> impl Iterator<Item = &LinkDesc> {
        let dpn = self.devices_per_node;
        let mut v: Vec<&LinkDesc> =
            self.links.iter().filter(|l| l.scope == Scope::IntraNode && l.span.unwrap_or(dpn) >= n).collect();
        v.sort_by(|a, b| b.bandwidth_gbyte_s.total_cmp(&a.bandwidth_gbyte_s));
        v.into_iter()
    }

    /// The inter-node link (the fastest if several).
    pub fn inter_link(&self) -> Option<&LinkDesc> {
        self.links
            .iter()
            .filter(|l| l.scope == Scope::InterNode)
            .max_by(|a, b| a.bandwidth_gbyte_s.total_cmp(&b.bandwidth_gbyte_s))
    }

    /// The inter-node links, fastest first.
    pub fn inter_links(&self) -> Vec<&LinkDesc> {
        let mut v: Vec<&LinkDesc> = self.links.iter().filter(|l| l.scope == Scope::InterNode).collect();
        v.sort_by(|a, b| b.bandwidth_gbyte_s.total_cmp(&a.bandwidth_gbyte_s));
        v
    }

    /// Check the description for values no real cluster has.
    pub fn validate(&self) -> Result<()> {
        let what = format!("cluster `{}`", self.name);
        if self.nodes == 0 || self.devices_per_node == 0 {
            return Err(PlanError::invalid(what, "`nodes` and `devices_per_node` must be at least 1"));
        }
        self.device.validate(&what, "device.")?;
        let h = &self.host;
        if !(h.memory_gib > 0.0 && h.pcie_gbyte_s > 0.0 && h.storage_gbyte_s > 0.0) {
            return Err(PlanError::invalid(what, "host.memory_gib, host.pcie_gbyte_s and host.storage_gbyte_s must be positive"));
        }
        for l in &self.links {
            if !(l.bandwidth_gbyte_s > 0.0 && l.bandwidth_gbyte_s.is_finite() && l.latency_us >= 0.0 && l.latency_us.is_finite())
            {
                return Err(PlanError::invalid(
                    what,
                    format!("link `{}`: bandwidth_gbyte_s must be positive and latency_us non-negative", l.name),
                ));
            }
            match l.scope {
                Scope::IntraNode => {
                    let span = l.span.unwrap_or(self.devices_per_node);
                    if span < 2 || span > self.devices_per_node || self.devices_per_node % span != 0 {
                        return Err(PlanError::invalid(
                            what,
                            format!(
                                "link `{}`: span {} must be ≥ 2 and divide devices_per_node {}",
                                l.name, span, self.devices_per_node
                            ),
                        ));
                    }
                    if l.instances.is_some() {
                        return Err(PlanError::invalid(what, format!("link `{}`: `instances` is for inter-node links", l.name)));
                    }
                }
                Scope::InterNode => {
                    if l.instances == Some(0) {
                        return Err(PlanError::invalid(what, format!("link `{}`: instances must be at least 1", l.name)));
                    }
                    if l.span.is_some() {
                        return Err(PlanError::invalid(what, format!("link `{}`: `span` is for intra-node links", l.name)));
                    }
                }
            }
        }
        if self.devices_per_node > 1 && self.intra_links_covering(self.devices_per_node).next().is_none() {
            return Err(PlanError::invalid(what, "add an intra-node link that joins the whole node (omit `span`), e.g. PCIe"));
        }
        if self.nodes > 1 && self.inter_link().is_none() {
            return Err(PlanError::invalid(what, "more than one node needs an inter-node link (scope = \"inter-node\")"));
        }
        Ok(())
    }
}

/// Element type of parameters and activations (`dtype = "fp16" | "bf16" | "fp32"` in a
/// model's TOML): the workspace's one dtype, a floating-point one.
pub use ironweave_units::DType;

/// Mixture-of-Experts feed-forward layers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeDesc {
    /// Experts per MoE layer.
    pub experts: u32,
    /// Experts each token is routed to (1 or 2).
    pub top_k: u32,
    /// Capacity factor: an expert takes at most `capacity_factor × tokens × top_k / experts` tokens.
    pub capacity_factor: f64,
    /// Every `every`-th layer is MoE (1: all layers).
    #[serde(default = "one")]
    pub every: u32,
}

fn micro() -> u32 {
    4
}
fn one() -> u32 {
    1
}
fn four() -> f64 {
    4.0
}
fn yes() -> bool {
    true
}

/// A GPT-style decoder (dense or MoE).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelDesc {
    /// Name shown in tables.
    pub name: String,
    /// Transformer layers.
    pub layers: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Attention heads.
    pub heads: u32,
    /// Sequence length.
    pub seq: u32,
    /// Sequences per iteration over the whole cluster.
    pub global_batch: u32,
    /// Sequences a tensor-parallel group processes at once; the rest of its share of the
    /// global batch is gradient accumulation. Bounds activation memory.
    #[serde(default = "micro")]
    pub micro_batch: u32,
    /// Vocabulary size.
    pub vocab: u32,
    /// Feed-forward width as a multiple of hidden.
    #[serde(default = "four")]
    pub ffn_mult: f64,
    /// Element type of weights and activations (optimizer state is fp32 master + Adam moments).
    pub dtype: DType,
    /// Element type of the data-parallel gradient all-reduce; `dtype` when left out.
    /// Megatron averages a bf16 model's gradients in fp32 by default, and so do ironweave's
    /// trainers: a model description of a run of ours says `grad_dtype = "fp32"`.
    #[serde(default)]
    pub grad_dtype: Option<DType>,
    /// Recompute activations in backward (store only each layer's input).
    #[serde(default = "yes")]
    pub activation_recompute: bool,
    /// MoE layers, if any.
    #[serde(default)]
    pub moe: Option<MoeDesc>,
}

impl ModelDesc {
    /// Bytes per gradient element in the data-parallel all-reduce (`grad_dtype`, else `dtype`).
    pub fn grad_elem_bytes(&self) -> f64 {
        self.grad_dtype.unwrap_or(self.dtype).size() as f64
    }

    /// Parse and validate a model description.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let m: ModelDesc =
            toml::from_str(text).map_err(|source| PlanError::Parse { what: "model description".into(), source })?;
        m.validate()?;
        Ok(m)
    }

    /// Check for values no real model has.
    pub fn validate(&self) -> Result<()> {
        let what = format!("model `{}`", self.name);
        for (name, v) in [("layers", self.layers), ("hidden", self.hidden), ("heads", self.heads), ("seq", self.seq)] {
            if v == 0 {
                return Err(PlanError::invalid(what, format!("`{name}` must be at least 1")));
            }
        }
        if self.global_batch == 0 || self.vocab == 0 || self.micro_batch == 0 {
            return Err(PlanError::invalid(what, "`global_batch`, `micro_batch` and `vocab` must be at least 1"));
        }
        if !self.dtype.is_float() {
            return Err(PlanError::invalid(
                what,
                format!("`dtype` {} is not a type a model trains in: use \"fp16\", \"bf16\" or \"fp32\"", self.dtype),
            ));
        }
        if self.hidden % self.heads != 0 {
            return Err(PlanError::invalid(what, format!("hidden {} is not a multiple of heads {}", self.hidden, self.heads)));
        }
        if !(self.ffn_mult > 0.0 && self.ffn_mult.is_finite()) {
            return Err(PlanError::invalid(what, "`ffn_mult` must be positive"));
        }
        if let Some(moe) = &self.moe {
            if moe.experts < 2 || moe.top_k == 0 || moe.top_k > moe.experts || moe.every == 0 {
                return Err(PlanError::invalid(what, "moe: need experts ≥ 2, 1 ≤ top_k ≤ experts, every ≥ 1"));
            }
            if !(moe.capacity_factor >= 1.0 && moe.capacity_factor.is_finite()) {
                return Err(PlanError::invalid(what, "moe.capacity_factor must be ≥ 1"));
            }
        }
        Ok(())
    }

    /// Whether layer `l` (0-based) has an MoE feed-forward.
    pub fn is_moe_layer(&self, l: u32) -> bool {
        self.moe.as_ref().is_some_and(|m| (l + 1) % m.every == 0)
    }

    /// Parameters of one attention block.
    pub fn attn_params(&self) -> f64 {
        let h = self.hidden as f64;
        4.0 * h * h
    }

    /// Parameters of one dense feed-forward block (or of one expert).
    pub fn mlp_params(&self) -> f64 {
        let h = self.hidden as f64;
        2.0 * self.ffn_mult * h * h
    }

    /// Parameters of layer `l`'s feed-forward (all experts for an MoE layer).
    pub fn ffn_params(&self, l: u32) -> f64 {
        match &self.moe {
            Some(m) if self.is_moe_layer(l) => self.mlp_params() * m.experts as f64 + self.hidden as f64 * m.experts as f64,
            _ => self.mlp_params(),
        }
    }

    /// Embedding (tied with the LM head) parameters.
    pub fn embed_params(&self) -> f64 {
        self.vocab as f64 * self.hidden as f64
    }

    /// All parameters.
    pub fn total_params(&self) -> f64 {
        (0..self.layers).map(|l| self.attn_params() + self.ffn_params(l)).sum::<f64>() + self.embed_params()
    }

    /// Forward FLOPs of one attention block for `seqs` sequences.
    pub fn attn_flops(&self, seqs: f64) -> f64 {
        let (h, s) = (self.hidden as f64, self.seq as f64);
        seqs * (8.0 * s * h * h + 4.0 * s * s * h)
    }

    /// Forward FLOPs of one dense feed-forward block for `seqs` sequences (an MoE block with
    /// top-k routing does `top_k` times this, spread over the experts).
    pub fn mlp_flops(&self, seqs: f64) -> f64 {
        let (h, s) = (self.hidden as f64, self.seq as f64);
        seqs * 4.0 * self.ffn_mult * s * h * h
    }

    /// Forward FLOPs of the LM head for `seqs` sequences.
    pub fn head_flops(&self, seqs: f64) -> f64 {
        seqs * 2.0 * self.seq as f64 * self.hidden as f64 * self.vocab as f64
    }

    /// Bytes of one layer's activations (input of a sub-layer) for `seqs` sequences.
    pub fn activation_bytes(&self, seqs: f64) -> f64 {
        seqs * self.seq as f64 * self.hidden as f64 * self.dtype.size() as f64
    }
}

/// Bytes of training state per parameter under mixed precision Adam: weights and gradients in
/// `dtype`, fp32 master weights and two fp32 moments.
pub fn state_bytes_per_param(dtype: DType) -> f64 {
    2.0 * dtype.size() as f64 + 12.0
}
