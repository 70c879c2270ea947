//! ironweave-plan: cost models and the two planners.
//!
//! - [`desc`]: cluster and model descriptions (serde, TOML under `configs/`).
//! - [`cost`]: the alpha-beta cost model for collectives on device groups and FLOP-based
//!   compute times (overridable by a measured [`cost::ProfileTable`]).
//! - [`tp`]: the Oases tensor-parallel planner — per sub-layer TP degree and sub-batch
//!   count under an overlap-aware cost model, solved as an ILP by HiGHS ([`chain`]), with a
//!   Megatron-style uniform baseline and a brute-force search for tests.
//! - [`sdp`]: the HSDP sharded-data-parallel planner — per layer, the fraction of parameters
//!   gathered over each link group so several links run at once, an LP/MILP for HiGHS, with
//!   FSDP FULL_SHARD and HYBRID_SHARD as baselines.
//!
//! Where it sits: below the simulator (`ironweave-sim`), which runs the plans on the same
//! cost model, and the CLI (`ironweave plan`). It does no IO and reads no clock: parsing takes
//! strings, and the same inputs give the same plan.
//!
//! ```
//! use ironweave_plan::{tp, ClusterDesc, CostModel, ModelDesc};
//! let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs");
//! let model = ModelDesc::from_toml_str(&std::fs::read_to_string(format!("{root}/models/gpt-2.7b.toml")).unwrap())?;
//! let cluster = ClusterDesc::from_toml_str(&std::fs::read_to_string(format!("{root}/clusters/32x3090-pcie.toml")).unwrap())?;
//! // Oases: a tensor-parallel degree and sub-batch count per sub-layer, overlap-aware
//! let p = tp::plan(&model, &cluster, &CostModel::new(&cluster), &tp::TpOptions::default())?;
//! assert!(p.predicted_iter_s > 0.0 && p.predicted_iter_s <= p.megatron.iter_s * 1.0001);
//! # Ok::<(), ironweave_plan::PlanError>(())
//! ```

pub mod chain;
pub mod cost;
pub mod desc;
mod error;
pub mod sdp;
pub mod tp;

pub use cost::{Coll, CostModel, GroupPath, MeasuredOp, ProfileTable};
pub use desc::{ClusterDesc, DType, DeviceDesc, LinkDesc, ModelDesc, MoeDesc, Scope};
pub use error::{PlanError, Result};
