//! The forecaster is built on ironweave's public facade only: `cargo tree` shows `ironweave`
//! and not `ironweave-train` (the workspace's own GPT/MoE trainer) nor the CLI's crates.

#[test]
fn cargo_tree_shows_the_facade_and_not_the_trainer() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let o = std::process::Command::new(cargo)
        .args(["tree", "--offline", "-p", "ironweave-airq", "--prefix", "none", "-e", "normal,build,dev"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    let tree = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&o.stderr));
    let crates: Vec<&str> = tree.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert!(crates.contains(&"ironweave"), "{tree}");
    for forbidden in ["ironweave-train", "ironweave-cli", "ironweave-ops", "ironweave-sim"] {
        assert!(!crates.contains(&forbidden), "{forbidden} in the forecaster's tree:\n{tree}");
    }
}
