//! Where replicas go: Gemini's "mixed" placement across machines. Pure.
//!
//! With more than one host, each replica of a rank goes to *another* host (the rank with the
//! same place on the next hosts), so losing a whole host loses no in-memory copy of its ranks.
//! On one host, ranks form groups of `m` consecutive ranks and each rank's snapshot is held by
//! the other members of its group; ranks left over when the world is not a multiple of `m` use
//! ring placement (the next `m - 1` ranks).

/// Ranks holding a replica of each rank (excluding itself).
pub fn placement(world: usize, m: usize) -> Vec<Vec<usize>> {
    let m = m.clamp(1, world.max(1));
    let full = (world / m) * m;
    (0..world)
        .map(|r| {
            if r < full {
                let g = r / m * m;
                (g..g + m).filter(|&x| x != r).collect()
            } else {
                (1..m).map(|k| (r + k) % world).collect()
            }
        })
        .collect()
}

/// Ranks holding a replica of each rank when rank `r` runs on host `hosts[r]`: with several
/// hosts, every holder is on another host — replica `t` of a rank at place `i` on host `h` goes
/// to place `i` (shifted by the round when hosts run out) on the `t`-th next host; with one
/// host, [`placement`]. A host with fewer ranks takes the place modulo its count; a rank never
/// holds the same replica twice.
pub fn placement_on_hosts<H: PartialEq>(hosts: &[H], m: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<&H> = Vec::new();
    for h in hosts {
        if !order.contains(&h) {
            order.push(h);
        }
    }
    if order.len() <= 1 {
        return placement(hosts.len(), m);
    }
    let n_hosts = order.len();
    let ranks_on: Vec<Vec<usize>> = order.iter().map(|h| (0..hosts.len()).filter(|&r| hosts[r] == **h).collect()).collect();
    (0..hosts.len())
        .map(|r| {
            let hi = order.iter().position(|h| **h == hosts[r]).unwrap_or(0);
            let place = ranks_on[hi].iter().position(|&x| x == r).unwrap_or(0);
            let mut holders = Vec::new();
            for t in 0..m.saturating_sub(1) {
                let other = (hi + 1 + t % (n_hosts - 1)) % n_hosts;
                let round = t / (n_hosts - 1);
                let on = &ranks_on[other];
                let h = on[(place + round) % on.len()];
                if !holders.contains(&h) {
                    holders.push(h);
                }
            }
            holders
        })
        .collect()
}
