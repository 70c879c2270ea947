//! ironweave-profile: what Capricorn's checkpoint planner needs to know about an iteration.
//!
//! - [`Profiler`]: scoped timers for each layer's forward and backward, a per-link timeline of
//!   communication (start, end, bytes, training or checkpoint), iteration boundaries; cheap
//!   enough to leave on, and switchable per iteration (speculative activation).
//! - [`idle_windows`] and [`WindowPredictor`]: the gaps between training communications on a
//!   link, anchored to the layer phase they fall in, and the prediction of the next iteration's.
//! - [`ExpertLoad`], [`ExpertLoadTracker`], [`SpeculativeActivation`]: tokens per expert per
//!   MoE layer, the drift measure, and the decision to re-profile.
//! - [`export`]: Chrome-trace/Perfetto JSON and SVG timelines.
//!
//! Where it sits: used by `ironweave-ckpt` (the engine) and by the trainer; depends on no
//! transport. Time comes only from a [`Clock`] ([`MonotonicClock`] in production,
//! [`ManualClock`] in tests), and nothing here does IO.
//!
//! ```
//! use ironweave_profile::{idle_windows, CommKind, ManualClock, Phase, Profiler};
//! // an iteration of one layer, 10 ms forward and 10 ms backward, with 3 ms of training
//! // communication at the end of the forward: the link is idle for the other 17 ms
//! let clock = ManualClock::new();
//! let p = Profiler::new(clock.clone(), 8);
//! p.begin_iteration(1);
//! {
//!     let _f = p.layer(0, Phase::Forward);
//!     clock.advance(7_000_000);
//!     let _c = p.comm(0, CommKind::Training, 1 << 20);
//!     clock.advance(3_000_000);
//! }
//! {
//!     let _b = p.layer(0, Phase::Backward);
//!     clock.advance(10_000_000);
//! }
//! p.end_iteration();
//! let w = idle_windows(&p.history()[0], 0, 1);
//! assert_eq!(w.iter().map(|w| w.len_ns).sum::<u64>(), 17_000_000);
//! ```

mod clock;
mod error;
pub mod export;
mod load;
mod profiler;
mod windows;

pub use clock::{Clock, ManualClock, MonotonicClock};
pub use error::{ProfileError, Result};
pub use load::{ExpertLoad, ExpertLoadTracker, SpeculativeActivation};
pub use profiler::{CommKind, CommSpan, CommTimer, IterationProfile, LayerSpan, LayerTimer, Phase, Profiler};
pub use windows::{idle_windows, Anchor, Window, WindowPredictor};
