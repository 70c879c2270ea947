//! How model states are held ([`Strategy`]) and the communicators a strategy runs on ([`Groups`]).

use std::sync::Arc;

use ironweave_transport::Communicator;
use serde::{Deserialize, Serialize};

use crate::{Result, SdpError};

/// How model states are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Every rank holds everything; gradients all-reduced over all ranks.
    Replicated,
    /// FSDP FULL_SHARD: sharded over all ranks.
    Full,
    /// HYBRID_SHARD: sharded within the host, shard gradients all-reduced across hosts.
    Hybrid,
    /// Each layer split between a `full` part and a `hybrid` part by the plan's fraction.
    Hsdp,
}

impl Strategy {
    /// Name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Replicated => "replicated",
            Strategy::Full => "full",
            Strategy::Hybrid => "hybrid",
            Strategy::Hsdp => "hsdp",
        }
    }
    /// Parse a name.
    pub fn parse(s: &str) -> Result<Self> {
        [Strategy::Replicated, Strategy::Full, Strategy::Hybrid, Strategy::Hsdp]
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| SdpError::Invalid(format!("unknown sharding strategy `{s}` (replicated, full, hybrid, hsdp)")))
    }
}

/// The communicators a rank's shards travel over.
#[derive(Debug, Clone)]
pub struct Groups {
    /// All ranks (the `full` part; `replicated`'s all-reduce), on its link.
    pub world: Arc<Communicator>,
    /// The ranks of this rank's host (the `hybrid` part's shards).
    pub intra: Arc<Communicator>,
    /// The ranks with this rank's place on every host (the `hybrid` part's all-reduce of shard
    /// gradients), on its link.
    pub inter: Arc<Communicator>,
}

impl Groups {
    /// `full_link` value that stripes the all-rank group over every link of the world (the
    /// transport's striping: FSDP's FULL_SHARD on all links at once).
    pub const STRIPED: usize = usize::MAX;

    /// Groups of `world` with `ranks_per_host` consecutive ranks per host: the all-rank group
    /// on link `full_link` ([`Groups::STRIPED`]: over every link), the cross-host group on
    /// link `inter_link` (different links: their collectives run at once), the host group on
    /// the world's first link. Collective: every rank calls it.
    pub fn new(world: &Communicator, ranks_per_host: usize, full_link: usize, inter_link: usize) -> Result<Self> {
        let (n, r) = (world.size(), world.rank());
        let k = ranks_per_host.max(1);
        if n % k != 0 {
            return Err(SdpError::Invalid(format!("{n} ranks do not make hosts of {k}")));
        }
        // one view per link, every split made on it: two views of one link share a tag space,
        // so splits of different views would too
        let mut views: Vec<(usize, Communicator)> = Vec::new();
        let mut split_on = |link: usize, color: u32| -> Result<Communicator> {
            if !views.iter().any(|(l, _)| *l == link) {
                views.push((link, world.on_link(link)?));
            }
            let (_, v) = views.iter().find(|(l, _)| *l == link).expect("just added");
            Ok(v.split(color, r as u32)?)
        };
        let full = if full_link == Self::STRIPED { world.striped(None)?.split(0, r as u32)? } else { split_on(full_link, 0)? };
        let intra = split_on(0, (r / k) as u32)?;
        let inter = split_on(inter_link, (r % k) as u32)?;
        Ok(Groups { world: Arc::new(full), intra: Arc::new(intra), inter: Arc::new(inter) })
    }
}
