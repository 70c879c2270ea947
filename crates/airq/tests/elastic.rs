//! `airq train` on 4 ranks through `ironweave launch`, a Capricorn checkpoint every iteration:
//! once clean, once with rank 1 killed by SIGKILL after iteration 10 and restarted by the
//! launcher. Every rank restores from memory (its own or a peer's) and the job ends in the
//! clean run's state, bit for bit, with the same scores and the same loss curve.

mod common;

use common::{job, launch, train_args};
use ironweave_testkit::{assert_restored_from_memory, final_states};

#[test]
fn airq_survives_kill_9_of_a_rank_bit_identical_on_4_ranks() {
    let base = std::env::temp_dir().join(format!("airq-elastic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let iters = 24;
    let clean = launch(&train_args(4, 0, &base.join("clean"), iters), 300, |_| {});
    let clean_state = final_states(&clean);
    assert_eq!(clean_state.len(), 4, "{clean:?}");

    let run = job(&train_args(4, 2, &base.join("killed"), iters)).run_killing(1, 10);
    assert_restored_from_memory(&run, 4, 1);
    assert!(run.iter().any(|l| l.contains("1 recoveries")), "{run:?}");
    assert_eq!(final_states(&run), clean_state, "{run:?}");

    // rank 0 scored the same model and kept the whole loss curve through the recovery
    let metrics = |d: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(base.join(d).join("metrics.json")).unwrap()).unwrap()
    };
    let (a, b) = (metrics("clean"), metrics("killed"));
    assert_eq!(a["model"], b["model"]);
    assert_eq!(a["losses"], b["losses"]);
    let losses = a["losses"].as_array().unwrap();
    assert_eq!(losses.len(), iters as usize);
    assert!(losses.iter().all(|l| l["total"].as_f64().unwrap() > 0.0), "every iteration's loss recorded");
    let _ = std::fs::remove_dir_all(&base);
}
