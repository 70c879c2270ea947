//! An engine's life: built on a communicator, its sender and receiver threads started, rebound
//! to the next generation's communicator (snapshots and held replicas kept), shut down.

use super::*;

impl Engine {
    /// Start the engine for `registry` on `comm` (all ranks call this together).
    pub fn new(comm: Arc<Communicator>, registry: Registry, cfg: EngineConfig) -> Result<Self> {
        if cfg.replicas == 0 || cfg.chunk_bytes == 0 || cfg.checksum_bytes == 0 {
            return Err(CkptError::Invalid(
                "replicas, chunk_bytes and checksum_bytes must be at least 1 (gemini_chunk_bytes 0: sized from the spans)".into(),
            ));
        }
        if !(cfg.window_fill > 0.0 && cfg.window_fill <= 1.0) {
            return Err(CkptError::Invalid(format!("window_fill {} must be in (0, 1]", cfg.window_fill)));
        }
        if !(cfg.gemini_fill > 0.0 && cfg.gemini_fill <= 1.0) {
            return Err(CkptError::Invalid(format!("gemini_fill {} must be in (0, 1]", cfg.gemini_fill)));
        }
        if matches!(cfg.strategy, Strategy::Blocking | Strategy::Async) && cfg.persist_dir.is_none() {
            return Err(CkptError::Invalid(format!("strategy `{}` writes to storage: set persist_dir", cfg.strategy.name())));
        }
        if cfg.spread_iters == 0 {
            return Err(CkptError::Invalid("spread_iters must be at least 1 (1: a whole snapshot every iteration)".into()));
        }
        if let Some(r) = cfg.storage_bytes_per_s {
            if !(r.is_finite() && r > 0.0) {
                return Err(CkptError::Invalid(format!("storage_bytes_per_s {r} must be a positive rate")));
            }
        }
        let n_links = comm.links().len() as u32;
        let mut link_ids = vec![cfg.link];
        for &l in &cfg.extra_links {
            if l >= n_links || link_ids.contains(&l) {
                return Err(CkptError::Invalid(format!(
                    "extra link {l}: the communicator has links 0..{n_links} and each may be named once (the training link is {})",
                    cfg.link
                )));
            }
            link_ids.push(l);
        }
        if cfg.strategy != Strategy::Capricorn {
            link_ids.truncate(1);
        }
        let mut snaps = SnapshotBuffers::new(cfg.copy_threads, cfg.checksum_bytes);
        snaps.set_wait(cfg.timeout);
        // a bucket of one write block: the declared rate holds from the first block on
        let storage = cfg.storage_bytes_per_s.map(|r| Arc::new(Mutex::new(TokenBucket::new(r, persist::PACE_BLOCK as u64))));
        let job = cfg.resolved_job_id(&comm)?;
        let written = Arc::new(persist::Written { layout: cfg.layout.clone(), job, key: cfg.mac_key.clone() });
        let mut e = Engine {
            written,
            comm,
            activation: SpeculativeActivation::new(cfg.drift_threshold),
            predictor: WindowPredictor::new(0.5),
            registry: Arc::new(registry),
            snaps,
            holders: Vec::new(),
            hosts: Vec::new(),
            shared: Arc::new(Mutex::new(Shared::default())),
            stop: Arc::new(AtomicBool::new(false)),
            senders: Vec::new(),
            services: Vec::new(),
            last_sent: None,
            committed: None,
            corrupt_in_transit: Arc::new(AtomicU64::new(u64::MAX)),
            stall_replication: Arc::new(AtomicBool::new(false)),
            profiler: Arc::new(Profiler::new(MonotonicClock::default(), 8)),
            sched: Arc::new(Mutex::new(Sched::default())),
            pending: None,
            sending: None,
            gemini_spans: None,
            profiled_iters: 0,
            this_iter: None,
            writer: None,
            durable: None,
            rate: Arc::new(Mutex::new(vec![(0.0, 0.0); link_ids.len()])),
            declared: vec![0.0; link_ids.len()],
            counters: Arc::new(Counters::new(link_ids.len())),
            link_ids,
            storage,
            exposed_ns: 0,
            kept: None,
            kept_mismatch: None,
            cfg,
        };
        // copies an earlier process of this rank kept (torchrun restarted it) are memory again
        e.adopt_kept()?;
        // every buffer the strategy will fill, allocated and touched now rather than inside
        // a training step (the in-memory strategies hold up to three snapshots; the storage
        // ones refill one); with a keep directory, segments beside the adopted ones
        let total = e.registry.total;
        match e.cfg.strategy {
            Strategy::None => {}
            s if s.in_memory() => e.snaps.prepare(crate::snapshot::SNAPSHOT_BUFFERS, total)?,
            _ => e.snaps.prepare(1, total)?,
        }
        e.start_threads()?;
        Ok(e)
    }

    /// Now, on the profiler's clock, ns.
    pub(super) fn now_ns(&self) -> u64 {
        self.profiler.now_ns()
    }

    /// Move the engine to a new communicator over the same ranks (after a failure, once the
    /// job has re-formed with a restarted rank). Snapshots and replicas held in memory are
    /// kept; transfers in flight are dropped (those iterations are not committed).
    pub fn rebind(&mut self, comm: Arc<Communicator>) -> Result<()> {
        if comm.size() != self.comm.size() || comm.rank() != self.comm.rank() {
            return Err(CkptError::Invalid(format!(
                "rebind to rank {} of {} from rank {} of {}: the engine's replicas are laid out for the old ranks",
                comm.rank(),
                comm.size(),
                self.comm.rank(),
                self.comm.size()
            )));
        }
        self.stop_threads();
        self.comm = comm;
        {
            let mut sh = self.shared.locked();
            sh.acks.clear();
            sh.failures.clear();
            sh.lost_holders.clear();
            for v in sh.store.values_mut() {
                v.retain(|r| r.verified);
            }
        }
        self.pending = None;
        self.last_sent = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        self.start_threads()
    }

    pub(super) fn stop_threads(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        {
            let mut s = self.sched.locked();
            s.txs.clear();
            s.releaser = None;
            s.open = false;
        }
        for (_, t) in self.senders.drain(..) {
            let _ = t.join();
        }
        for t in self.services.drain(..) {
            let _ = t.join();
        }
    }

    pub(super) fn start_threads(&mut self) -> Result<()> {
        let comm = self.comm.clone();
        let world = comm.size();
        let me = comm.rank();
        // every rank's host, to put replicas on other hosts (a collective: every rank starts
        // or re-binds its engine at the same point)
        let key = xxhash_rust::xxh3::xxh3_64(self.cfg.host.as_bytes()).to_le_bytes();
        let mut keys = vec![0u8; 8 * world];
        if world > 1 {
            comm.all_gather(&key, &mut keys)?;
        }
        let hosts: Vec<&[u8]> = keys.chunks_exact(8).collect();
        let place = placement_on_hosts(&hosts, self.cfg.replicas as usize);
        self.hosts = hosts.iter().map(|h| u64::from_le_bytes((*h).try_into().unwrap_or([0; 8]))).collect();
        let on_my_host = self.hosts.iter().filter(|&&h| h == self.hosts[me]).count().max(1);
        let infos = comm.links();
        self.declared = self
            .link_ids
            .iter()
            .map(|&l| {
                infos.get(l as usize).filter(|i| i.speed_source != SpeedSource::Unknown).map_or(0.0, |i| {
                    // the ranks of a host share its link
                    i.bandwidth_bytes_per_s / on_my_host as f64
                })
            })
            .collect();
        let in_mem = self.cfg.strategy.in_memory();
        self.holders = if in_mem { place[me].clone() } else { Vec::new() };
        let sources: Vec<usize> = if in_mem { (0..world).filter(|&s| place[s].contains(&me)).collect() } else { Vec::new() };
        // slot 0: the engine's communicator as given; further slots: views on the extra links
        let mut slots: Vec<Arc<Communicator>> = vec![comm.clone()];
        for &l in &self.link_ids[1..] {
            slots.push(Arc::new(comm.on_link(l as usize)?));
        }
        self.stop = Arc::new(AtomicBool::new(false));
        let (shared, stop, profiler) = (self.shared.clone(), self.stop.clone(), self.profiler.clone());
        let limit = replicate::replica_limit(self.registry.total);
        for &s in &sources {
            for (k, c) in slots.iter().enumerate() {
                let (c, ack, shared, stop) = (c.clone(), comm.clone(), shared.clone(), stop.clone());
                let (counters, prof, link) = (self.counters.clone(), profiler.clone(), self.link_ids[k]);
                self.services.push(spawn(format!("ckpt-in-{s}.{k}"), move || {
                    let meter = replicate::Meter { cpu: &counters.replica_recv_cpu_ns, arrived: Some((&prof, link)) };
                    replicate::receive_replicas(&c, &ack, s, limit, &shared, &stop, meter)
                })?);
            }
        }
        for &h in &self.holders {
            let (comm, shared, stop) = (comm.clone(), shared.clone(), stop.clone());
            self.services.push(spawn(format!("ckpt-ack-{h}"), move || replicate::receive_acks(&comm, h, &shared, &stop))?);
        }
        // one sender thread per holder and link slot, so a long transfer on one link does not
        // hold back chunks due on another
        let mut txs = Vec::new();
        for &h in &self.holders {
            let mut per_slot = Vec::new();
            for (k, c) in slots.iter().enumerate() {
                let (tx, rx) = channel::<Job>();
                let cx = SenderCtx {
                    holder: h,
                    slot: k,
                    remote: self.hosts[h] != self.hosts[me],
                    comm: c.clone(),
                    first: comm.clone(),
                    link_id: self.link_ids[k],
                    rank: me as u32,
                    world: world as u32,
                    chunk: self.cfg.chunk_bytes as usize,
                    shared: shared.clone(),
                    counters: self.counters.clone(),
                    corrupt: self.corrupt_in_transit.clone(),
                    stalled: self.stall_replication.clone(),
                    prof: profiler.clone(),
                    rate: self.rate.clone(),
                };
                self.senders.push((h, spawn(format!("ckpt-out-{h}.{k}"), move || replicate::send_loop(cx, rx))?));
                per_slot.push(tx);
            }
            txs.push(per_slot);
        }
        {
            let mut s = self.sched.locked();
            *s = Sched { txs, ..Default::default() };
        }
        // Capricorn: a window opens when a training communication on the link ends.
        {
            let sched = self.sched.clone();
            let link = self.cfg.link;
            profiler.set_comm_hook(Some(Arc::new(move |span: &ironweave_profile::CommSpan| {
                if span.link != link || span.kind != CommKind::Training {
                    return;
                }
                let mut s = sched.locked();
                let k = s.comms;
                s.comms += 1;
                if let Some(r) = s.releaser.as_mut() {
                    let rel = r.comm_done(k);
                    s.dispatch(rel);
                }
            })));
        }
        // Gemini: chunks go by the clock.
        if self.cfg.strategy == Strategy::Gemini {
            let (sched, stop, prof) = (self.sched.clone(), stop.clone(), profiler.clone());
            self.services.push(spawn("ckpt-timer".into(), move || {
                while !stop.load(Ordering::SeqCst) {
                    {
                        let mut s = sched.locked();
                        let now = prof.now_ns();
                        if let (Some(start), Some(r)) = (s.iter_start_ns, s.releaser.as_mut()) {
                            let rel = r.tick(now.saturating_sub(start));
                            s.dispatch(rel);
                        }
                    }
                    std::thread::sleep(Duration::from_micros(250));
                }
            })?);
        }
        Ok(())
    }

    /// Flush replication, wait for the acknowledgements (bounded), stop the threads
    /// (collective: every rank calls it).
    pub fn shutdown(mut self) -> Result<()> {
        let _ = self.commit(true)?;
        {
            let mut s = self.sched.locked();
            s.txs.clear();
        }
        for (_, t) in self.senders.drain(..) {
            let _ = t.join();
        }
        self.comm.barrier()?;
        self.stop_threads();
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.profiler.set_comm_hook(None);
        self.sched.locked().txs.clear();
    }
}
