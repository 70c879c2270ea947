//! `ironweave bench sdp` on the emulated 2-host, 2-link cluster (root and iproute2; skipped
//! visibly otherwise): one invocation probes the links, runs replicated, FULL_SHARD on each
//! link and striped over both, HYBRID_SHARD with its cross-host all-reduce on each link and
//! HSDP with the planner's plan, and writes every row with the counters that show the
//! mechanism — the link each row's traffic took, by the kernel's own counters, and the
//! communication threads' CPU per byte.

#[test]
fn bench_sdp_rows_carry_their_links_and_predictions() {
    if !ironweave_testkit::can_run_emulated("bench_sdp_rows_carry_their_links_and_predictions") {
        return;
    }
    let base = std::env::temp_dir().join(format!("ironweave-bench-sdp-{}", std::process::id()));
    let json = base.join("rows.json");
    let (v, text) = ironweave_testkit::json_of(
        ironweave_testkit::ironweave()
            .args(["bench", "sdp", "--iters", "3", "--probe-seconds", "0.5", "--out"])
            .arg(base.join("runs")),
        &json,
    );
    let rows = v["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["strategy"].as_str().unwrap()).collect();
    assert_eq!(names, ["replicated", "full (a)", "full (b)", "full (striped a+b)", "hybrid", "hybrid (a)", "hsdp"]);
    let row = |n: &str| rows.iter().find(|r| r["strategy"] == n).unwrap();
    let link = |n: &str, l: &str| row(n)["link_bytes"][l].as_f64().unwrap();
    // each full row's traffic took the link it names (the other carries the loss average only)
    assert!(link("full (a)", "a") > 1e6 && link("full (a)", "b") < 1e5, "{text}");
    assert!(link("full (b)", "b") > 1e6 && link("full (b)", "a") < 1e5, "{text}");
    // striped FULL_SHARD drives both links
    assert!(link("full (striped a+b)", "a") > 1e6 && link("full (striped a+b)", "b") > 1e6, "{text}");
    // hybrid crosses hosts only with its shard all-reduce, on b (on a for `hybrid (a)`)
    assert!(link("hybrid", "b") > 1e6 && link("hybrid", "a") < 1e5, "{text}");
    assert!(link("hybrid (a)", "a") > 1e6 && link("hybrid (a)", "b") < 1e5, "{text}");
    // hsdp ran on the links its plan assigned (the planner solves both assignments) and its
    // bytes follow the plan: both links, unless the plan (from the links as probed, which a
    // loaded machine changes) shards everything within the host — then only the cross-host
    // all-reduce crosses, on its link. The planner's own tests fix the split exactly.
    let plan: serde_json::Value = serde_json::from_slice(&std::fs::read(base.join("runs/plan.json")).unwrap()).unwrap();
    let (inter, rail) = (plan["plan"]["inter_link"].as_str().unwrap(), plan["plan"]["rail_link"].as_str().unwrap());
    assert_ne!(inter, rail);
    let within = plan["plan"]["node_fraction_overall"].as_f64().unwrap();
    if within < 0.999 {
        assert!(link("hsdp", "a") > 1e6 && link("hsdp", "b") > 1e6, "plan {within}: {text}");
    } else {
        // `rail_link` carries the all-reduce, `inter_link` the all-device part: the loss
        // average and the few layers outside the host (a plan of 99.97% within the host put
        // ~0.1 MB an iteration there, over the 1e5 a plan of exactly 100% stays under)
        let all_device = (1.0 - within) * link("full (a)", "a");
        assert!(link("hsdp", rail) > 1e6 && link("hsdp", inter) < 1e5 + 3.0 * all_device, "plan {within}: {text}");
    }
    let ran = |i: usize| row("hsdp")["links"][i].as_str().unwrap().rsplit(':').next().unwrap().to_string();
    assert_eq!((ran(0), ran(1)), (inter.to_string(), rail.to_string()), "{text}");
    // a quarter of the state under full, half under hybrid, in between under hsdp — or
    // hybrid's half when the plan shards everything within the host (as above)
    let state = |n: &str| row(n)["state_bytes_per_rank"].as_f64().unwrap();
    assert!((state("full (a)") / state("replicated") - 0.25).abs() < 0.01);
    assert!((state("hybrid") / state("replicated") - 0.5).abs() < 0.01);
    if within < 0.999 {
        assert!(state("hsdp") > state("full (a)") && state("hsdp") < state("hybrid"), "plan {within}: {text}");
    } else {
        assert!((state("hsdp") / state("hybrid") - 1.0).abs() < 0.01, "plan {within}: {text}");
    }
    // every sharded row has the planner's prediction; the same training everywhere (the sums
    // in another order: within 1e-4)
    for r in rows {
        if r["strategy"] != "replicated" {
            let (p, m) = (r["predicted_iter_time_s"].as_f64().unwrap(), r["iter_time_s"].as_f64().unwrap());
            assert!(p > 0.0 && (r["predicted_over_measured"].as_f64().unwrap() - p / m).abs() < 1e-9, "{r}");
        }
        let (l, l0) = (r["final_loss"].as_f64().unwrap(), rows[0]["final_loss"].as_f64().unwrap());
        assert!((l - l0).abs() <= 1e-4 * l0.abs(), "{}: final loss {l} vs replicated {l0}", r["strategy"]);
        // the links' bytes fit in the time the collectives were on the wire at the links'
        // rates: a byte counted twice (or a phase timed short) shows as a share above 1
        let u = r["link_utilization"].as_f64().unwrap();
        assert!(u > 0.0 && u <= 1.05, "{}: link utilization {u}\n{text}", r["strategy"]);
        // the communication threads' CPU per inter-host byte, counted (None when no thread's
        // clock was read), and those threads' CPU a part of the processes'
        let cpu = r["cpu_ns_per_byte"].as_f64();
        let share = r["comm_cpu_share"].as_f64().unwrap_or(0.0);
        assert!(cpu.is_some_and(|c| c > 0.0), "{}: cpu_ns_per_byte {cpu:?}", r["strategy"]);
        assert!(share > 0.0 && share <= 1.0, "{}: communication threads' share of the CPU {share}", r["strategy"]);
    }
    // the speedups are the best rows' times over each row's, as the rows say
    let it = |r: &serde_json::Value| r["iter_time_s"].as_f64().unwrap();
    let best = rows.iter().filter(|r| r["strategy"] != "hsdp").map(it).fold(f64::INFINITY, f64::min);
    let full = it(row("full (a)")).min(it(row("full (b)")));
    for r in rows {
        assert!((r["speedup_vs_best_baseline"].as_f64().unwrap() - best / it(r)).abs() < 1e-9, "{r}");
        assert!((r["speedup_vs_full"].as_f64().unwrap() - full / it(r)).abs() < 1e-9, "{r}");
    }
    assert!(base.join("runs/plan.json").exists() && base.join("runs/probe.json").exists());
    assert!(base.join("runs/hsdp/timeline.svg").exists() && base.join("runs/hsdp/trace.json").exists());
    std::fs::remove_dir_all(&base).ok();
}
