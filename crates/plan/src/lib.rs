//! ironweave-plan: cost models and the two planners.
//!
//! - [`desc`]: cluster and model descriptions (serde, TOML under `configs/`).
//! - [`cost`]: the alpha-beta cost model for collectives on device groups and FLOP-based
//!   compute times (overridable by a measured [`cost::ProfileTable`]).
//! - [`tmp`]: the Oases tensor-model-parallel planner — per sub-layer TP degree and sub-batch
//!   count under an overlap-aware cost model, solved as an ILP by HiGHS ([`chain`]), with a
//!   Megatron-style uniform baseline and a brute-force search for tests.
//! - [`sdp`]: the HSDP sharded-data-parallel planner — per layer, the fraction of parameters
//!   gathered over each link group so several links run at once, an LP/MILP for HiGHS, with
//!   FSDP FULL_SHARD and HYBRID_SHARD as baselines.
//!
//! Where it sits: below the simulator (`ironweave-sim`), which runs the plans on the same
//! cost model, and the CLI (`ironweave plan`). It does no IO and reads no clock: parsing takes
//! strings, and the same inputs give the same plan.

pub mod chain;
pub mod cost;
pub mod desc;
mod error;
pub mod sdp;
pub mod tmp;

pub use cost::{Coll, CostModel, GroupPath, MeasuredOp, ProfileTable};
pub use desc::{ClusterDesc, Dtype, LinkDesc, ModelDesc, MoeDesc, Scope};
pub use error::{PlanError, Result};
