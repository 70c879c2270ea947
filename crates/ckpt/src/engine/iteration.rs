//! What the engine does each iteration: decide whether to profile, snapshot, plan the chunks
//! over the predicted windows, release them as the training communications end, write the
//! persistent tier when due, and measure what happened.

use super::*;

impl Engine {
    /// [`SnapshotBuffers::take`] of the registered state, counted: one copy (read and write)
    /// per state byte, its checksums computed as it copies.
    fn take_snapshot(&mut self, iter: u64, keep_from: u64, bufs: &[&[u8]]) -> Result<Arc<Snapshot>> {
        let snap = self.snaps.take(iter, keep_from, &self.registry, bufs)?;
        let n = snap.data.len() as u64;
        self.counters.snapshot_bytes.fetch_add(n, Ordering::Relaxed);
        self.counters.send_pass_bytes.fetch_add(2 * n, Ordering::Relaxed);
        Ok(snap)
    }

    /// Start iteration `iter`. `load` is the expert load the trainer expects (e.g. the last
    /// iteration's); Capricorn profiles only when it drifted. Returns whether this iteration is
    /// profiled (layer timers on). Releases the chunks of the previous snapshot planned for
    /// this iteration's windows.
    pub fn begin_iteration(&mut self, iter: u64, load: Option<&ExpertLoad>) -> bool {
        let profile = match self.cfg.strategy {
            Strategy::Capricorn if self.cfg.drift_threshold <= 0.0 => true,
            Strategy::Capricorn => match load {
                // the load of the iteration profiled first (before any load was known) is
                // the reference; later ones decide
                Some(l) if !self.activation.primed() && self.profiled_iters > 0 => {
                    self.activation.prime(l);
                    false
                }
                Some(l) => self.activation.decide(l),
                None => self.profiled_iters == 0,
            },
            Strategy::Gemini => self.profiled_iters < self.cfg.gemini_profile_iters,
            _ => false,
        };
        self.profiler.set_detailed(profile);
        self.profiler.begin_iteration(iter);
        self.this_iter = Some((iter, profile));
        let now = self.now_ns();
        let mut s = self.sched.locked();
        s.comms = 0;
        s.iter_start_ns = Some(now);
        if let Some(mut p) = self.pending.take() {
            let parts = self.spread();
            let (from, to) = part_range(p.snap.data.len() as u64, parts, p.part);
            let total = to - from;
            let plan = match self.cfg.strategy {
                Strategy::Capricorn => {
                    let windows: Vec<Vec<Window>> = self.link_ids.iter().map(|&l| self.predictor.predict(l)).collect();
                    if windows[0].is_empty() {
                        // nothing profiled yet: everything after the iteration's traffic
                        schedule::capricorn(total, &[], 1.0, 1.0, 1, self.cfg.chunk_bytes)
                    } else {
                        let links: Vec<(&[Window], f64)> =
                            windows.iter().enumerate().map(|(k, w)| (w.as_slice(), self.slot_rate(k))).collect();
                        schedule::capricorn_links(
                            total,
                            &links,
                            self.cfg.window_fill,
                            self.cfg.chunk_bytes.min(1 << 20),
                            self.cfg.chunk_bytes,
                        )
                    }
                }
                _ => {
                    let rate = self.link_rate();
                    match &self.gemini_spans {
                        Some(spans) => schedule::gemini(total, spans, rate, self.cfg.gemini_chunk_bytes, self.cfg.gemini_fill),
                        None => schedule::gemini(total, &[], rate, self.cfg.gemini_chunk_bytes, self.cfg.gemini_fill),
                    }
                }
            };
            let plan = schedule::shifted(plan, from);
            if !p.begun {
                s.begin(&p.snap, self.keep_from());
                p.begun = true;
            }
            s.more_parts = p.part + 1 < parts;
            s.releaser = Some(Releaser::new(plan));
            s.released = 0;
            self.sending = Some(p.snap.iter);
            if s.more_parts {
                p.part += 1;
                self.pending = Some(p);
            } else {
                self.last_sent = Some(p.snap.iter);
            }
            let rel = s.releaser.as_mut().map(|r| r.start()).unwrap_or_default();
            s.dispatch(rel);
        }
        profile
    }

    /// Iterations one snapshot is replicated over (`spread_iters` for Capricorn, else 1).
    pub(super) fn spread(&self) -> u64 {
        if self.cfg.strategy == Strategy::Capricorn {
            self.cfg.spread_iters.max(1)
        } else {
            1
        }
    }

    /// Whether an in-memory strategy writes iteration `iter`'s snapshot to the persistent tier:
    /// every `persist_every` iterations; with snapshots every `spread` iterations, the snapshot
    /// of the `spread` iterations that include a multiple of `persist_every`.
    pub(super) fn persist_due(&self, iter: u64) -> bool {
        let every = self.cfg.persist_every;
        if self.cfg.persist_dir.is_none() || every == 0 {
            return false;
        }
        let k = self.spread();
        if k == 1 {
            iter % every == 0
        } else {
            iter / every != iter.saturating_sub(k) / every
        }
    }

    /// End the current iteration (after the optimizer step): leftover chunks go now; a
    /// profiled iteration's windows feed the predictor.
    pub fn end_iteration(&mut self) -> IterationReport {
        // leftovers go now, marked as such: they count as outside every window
        let released = {
            let mut s = self.sched.locked();
            s.flush();
            let n = s.released * s.txs.len();
            s.released = 0;
            n
        };
        let sending = self.sending.take();
        let prof = self.profiler.end_iteration();
        let (iter, profiled) = self.this_iter.take().unwrap_or((0, false));
        let mut rep = IterationReport {
            iter,
            strategy: self.cfg.strategy.name().into(),
            profiled,
            exposed_s: std::mem::take(&mut self.exposed_ns) as f64 * 1e-9,
            ..Default::default()
        };
        if let Some(p) = prof {
            rep.iter_s = p.duration_ns() as f64 * 1e-9;
            let training: Vec<(u32, u64, u64)> =
                p.comms.iter().filter(|c| c.kind == CommKind::Training).map(|c| (c.link, c.start_ns, c.end_ns)).collect();
            rep.bytes_sent = p.comms.iter().filter(|c| c.kind == CommKind::Checkpoint).map(|c| c.bytes).sum();
            // this iteration's snapshot's transfers, by the iteration that released them;
            // older entries go (late ones of this snapshot are dropped at the next report)
            let spans: Vec<ChunkSpan> = {
                let mut sh = self.shared.locked();
                let v = sh.chunk_log.iter().filter(|c| Some(c.snapshot) == sending).copied().collect();
                sh.chunk_log.retain(|c| sending.is_some_and(|i| c.snapshot > i));
                v
            };
            rep.partition_accuracy = partition_accuracy(&training, &spans, released, p.end_ns);
            // what this rank received as a holder, judged on its own training traffic
            let arrivals = std::mem::take(&mut self.shared.locked().arrivals);
            let rate = |link: u32| self.link_ids.iter().position(|&l| l == link).map_or(0.0, |k| self.slot_rate(k));
            let (inside, n) = wire_accuracy(&training, &arrivals, rate, p.start_ns, p.end_ns);
            rep.wire_chunks = (inside, n);
            self.counters.wire_chunks.fetch_add(n, Ordering::Relaxed);
            self.counters.wire_chunks_in_window.fetch_add(inside, Ordering::Relaxed);
            rep.chunks = released as u32;
            rep.chunks_in_window = rep.partition_accuracy.map_or(0, |a| (a * released as f64).round() as u32);
            if profiled {
                let w = idle_windows(&p, self.cfg.link, self.cfg.min_window_ns);
                // every link chunks may take (a link without training traffic: one window, the
                // whole iteration)
                let all: Vec<Window> = self
                    .link_ids
                    .iter()
                    .flat_map(|&l| if l == self.cfg.link { w.clone() } else { idle_windows(&p, l, self.cfg.min_window_ns) })
                    .collect();
                self.predictor.observe(&all);
                // Gemini keeps the spans of its last profiled iteration (the first is cold)
                if self.cfg.strategy == Strategy::Gemini {
                    self.gemini_spans = Some(w);
                }
                self.profiled_iters += 1;
            }
        }
        rep
    }

    /// Snapshot the state after iteration `iter`'s optimizer step. In-memory strategies
    /// replicate it during the next iteration's windows (or at once on `commit(true)`);
    /// `blocking` writes it to storage now; `async` hands it to a background writer.
    pub fn checkpoint(&mut self, iter: u64, bufs: &[&[u8]]) -> Result<CheckpointReport> {
        let t0 = self.now_ns();
        let r = self.checkpoint_inner(iter, bufs);
        self.exposed_ns += self.now_ns().saturating_sub(t0);
        r
    }

    /// Writes `snap` to the persistent tier through the storage bucket (if any), counting the
    /// bytes.
    pub(super) fn write_persistent(&self, snap: &Snapshot) -> Result<PathBuf> {
        write_paced(
            self.cfg.persist_dir.as_deref().expect("checked by the caller"),
            snap,
            &self.comm,
            self.storage.as_deref(),
            &self.counters,
            &self.written,
        )
    }

    pub(super) fn checkpoint_inner(&mut self, iter: u64, bufs: &[&[u8]]) -> Result<CheckpointReport> {
        if let Some(last) = self.snaps.latest().map(|s| s.iter) {
            if iter <= last {
                return Err(CkptError::Invalid(format!("iteration {iter} is not after the last checkpointed iteration {last}")));
            }
        }
        let t0 = self.now_ns();
        let mut persisted = false;
        match self.cfg.strategy {
            Strategy::None => {
                return Ok(CheckpointReport { iter, bytes: 0, blocking_s: 0.0, persisted: false });
            }
            Strategy::Blocking => {
                let snap = self.take_snapshot(iter, u64::MAX, bufs)?;
                self.write_persistent(&snap)?;
                self.durable = Some(iter);
                persisted = true;
            }
            Strategy::Async => {
                if self.cfg.async_skip_busy && self.writer.as_ref().is_some_and(|w| !w.is_finished()) {
                    // the storage is still busy with an earlier iteration: skip this one
                    return Ok(CheckpointReport { iter, bytes: 0, blocking_s: 0.0, persisted: false });
                }
                // the next snapshot waits for the previous write (one host buffer in flight)
                self.join_writer()?;
                let snap = self.take_snapshot(iter, u64::MAX, bufs)?;
                let dir = self.cfg.persist_dir.clone().expect("checked in new");
                let (bucket, counters) = (self.storage.clone(), self.counters.clone());
                let (comm, written) = (self.comm.clone(), self.written.clone());
                self.writer = Some(spawn("ckpt-writer".into(), move || {
                    write_paced(&dir, &snap, &comm, bucket.as_deref(), &counters, &written).map(|_| snap.iter)
                })?);
                persisted = true;
            }
            Strategy::Gemini | Strategy::Capricorn => {
                if self.pending.is_some() && self.spread() > 1 {
                    // the parts of an earlier snapshot are still going out: no snapshot now
                    return Ok(CheckpointReport { iter, bytes: 0, blocking_s: 0.0, persisted: false });
                }
                // whatever of the previous snapshot was not sent yet goes now
                self.flush_pending();
                // The newest committed iteration and every newer one stay held until a newer
                // one commits: a copy of the committed state must survive any one host. When
                // they fill every buffer (the commits lag two snapshots), wait for the oldest
                // of the newer ones and agree again; if it still did not commit, skip this
                // snapshot. Collective, and the same choice on every rank: every rank holds the
                // same iterations (snapshots are taken, skipped and dropped collectively) and
                // `committed` was agreed.
                if !self.snaps.can_take(self.keep_from()) {
                    let c = self.committed;
                    let want = self.snaps.held().map(|s| s.iter).filter(|&i| c.is_none_or(|c| i > c)).min();
                    self.wait_for_acks(want);
                    self.agree()?;
                    if !self.snaps.can_take(self.keep_from()) {
                        if self.counters.snapshots_skipped.fetch_add(1, Ordering::Relaxed) == 0 {
                            eprintln!(
                                "rank {}: warning: iteration {iter} is not checkpointed: the newest committed iteration ({:?}) and the ones after it fill every snapshot buffer, and the oldest of those was not acknowledged by every holder within {:?} (a slow or lost link); said once, counted in `snapshots_skipped`",
                                self.comm.rank(),
                                self.committed,
                                self.cfg.timeout / 2
                            );
                        }
                        return Ok(CheckpointReport { iter, bytes: 0, blocking_s: 0.0, persisted: false });
                    }
                }
                let snap = self.take_snapshot(iter, self.keep_from(), bufs)?;
                if self.persist_due(iter) {
                    // the persistent tier backs the in-memory replicas up: a full or failing
                    // disk must not stop training (said once; counted every time)
                    match self.write_persistent(&snap) {
                        Ok(_) => persisted = true,
                        Err(e) => {
                            if self.counters.storage_failures.fetch_add(1, Ordering::Relaxed) == 0 {
                                eprintln!(
                                    "rank {}: warning: writing iteration {iter} to the persistent tier failed ({e}); in-memory checkpoints go on, the persistent tier is retried every {} iterations",
                                    self.comm.rank(),
                                    self.cfg.persist_every
                                );
                            }
                            let mut sh = self.shared.locked();
                            if sh.failures.len() < 64 {
                                sh.failures.push(format!("persistent write of iteration {iter}: {e}"));
                            }
                        }
                    }
                }
                if self.holders.is_empty() {
                    self.last_sent = Some(iter);
                } else {
                    self.pending = Some(Pending::new(snap));
                }
            }
        }
        Ok(CheckpointReport {
            iter,
            bytes: self.registry.total,
            blocking_s: self.now_ns().saturating_sub(t0) as f64 * 1e-9,
            persisted,
        })
    }

    /// Release every chunk still held back: the rest of the plan in progress, then the parts
    /// of a snapshot not released yet.
    pub(super) fn flush_pending(&mut self) {
        self.sched.locked().flush();
        if let Some(prev) = self.pending.take() {
            self.release_rest(prev);
        }
    }

    /// Send what is left of a snapshot now, back to back.
    pub(super) fn release_rest(&mut self, p: Pending) {
        let mut s = self.sched.locked();
        if !p.begun {
            s.begin(&p.snap, self.keep_from());
        }
        let total = p.snap.data.len() as u64;
        let from = part_range(total, self.spread(), p.part).0;
        let plan = schedule::capricorn(total - from, &[], 1.0, 1.0, 1, self.cfg.chunk_bytes);
        s.more_parts = false;
        s.releaser = Some(Releaser::new(schedule::shifted(plan, from)));
        let rel = s.releaser.as_mut().map(|r| r.end()).unwrap_or_default();
        s.dispatch(rel);
        self.last_sent = Some(p.snap.iter);
    }

    /// Write the newest snapshot to the persistent tier now.
    pub fn persist_now(&self) -> Result<Option<PathBuf>> {
        let (Some(_), Some(s)) = (&self.cfg.persist_dir, self.snaps.latest()) else { return Ok(None) };
        Ok(Some(self.write_persistent(s)?))
    }
}

/// Writes `snap` of `comm`'s rank under `dir`, paced by `bucket` (the emulated storage's
/// bandwidth) when given; counts the bytes written.
fn write_paced(
    dir: &std::path::Path,
    snap: &Snapshot,
    comm: &Communicator,
    bucket: Option<&Mutex<TokenBucket>>,
    counters: &Counters,
    written: &persist::Written,
) -> Result<PathBuf> {
    let p = persist::write_layout(dir, snap, comm.rank() as u32, comm.size() as u32, bucket, written)?;
    counters.storage_bytes.fetch_add(snap.data.len() as u64, Ordering::Relaxed);
    Ok(p)
}
