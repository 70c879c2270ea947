//! Device profiles (`configs/devices/*.toml`): every shipped one parses with the published
//! figures its comments cite, and a profile no device could have is refused naming the field.

use ironweave_plan::DeviceDesc;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn shipped_profiles_parse_and_price_a_matmul_by_its_flops() {
    let mut names = Vec::new();
    for e in std::fs::read_dir(root().join("configs/devices")).unwrap() {
        let p = e.unwrap().path();
        let d =
            DeviceDesc::from_toml_str(&std::fs::read_to_string(&p).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        names.push(p.file_stem().unwrap().to_string_lossy().into_owned());
        // a large matmul is compute-bound on every one of them
        let n = 8192.0;
        let r = d.roofline();
        assert_eq!(r.seconds(2.0 * n * n * n, 3.0 * n * n * 2.0), 2.0 * n * n * n / d.flops_per_s(), "{}", d.name);
    }
    names.sort();
    assert_eq!(names, ["a100", "h100", "h200"]);
    // the H200 is the H100's compute with faster memory: a memory-bound op runs faster on it
    let load = |n: &str| {
        DeviceDesc::from_toml_str(&std::fs::read_to_string(root().join(format!("configs/devices/{n}.toml"))).unwrap()).unwrap()
    };
    let (h100, h200) = (load("h100").roofline(), load("h200").roofline());
    assert_eq!(h100.flops_per_s, h200.flops_per_s);
    assert!(h200.seconds(1e6, 1e9) < h100.seconds(1e6, 1e9));
}

#[test]
fn a_profile_no_device_has_is_refused_naming_the_field() {
    let good = "name = \"d\"\npeak_tflops = 100.0\nefficiency = 0.5\nmemory_gib = 80.0\nmemory_gbyte_s = 2000.0\n";
    assert!(DeviceDesc::from_toml_str(good).is_ok());
    for (text, field) in [
        (good.replace("peak_tflops = 100.0", "peak_tflops = 0.0"), "peak_tflops"),
        (good.replace("peak_tflops = 100.0", "peak_tflops = -3.0"), "peak_tflops"),
        (good.replace("peak_tflops = 100.0\n", ""), "peak_tflops"),
        (good.replace("efficiency = 0.5", "efficiency = 1.5"), "efficiency"),
        (good.replace("memory_gbyte_s = 2000.0", "memory_gbyte_s = 0.0"), "memory_gbyte_s"),
        (good.replace("memory_gbyte_s = 2000.0\n", ""), "memory_gbyte_s"),
        (good.replace("memory_gib = 80.0", "memory_gib = -1.0"), "memory_gib"),
        (format!("{good}flops = 3\n"), "flops"),
    ] {
        let e = DeviceDesc::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains(field), "{text:?}: the error should name {field}: {e}");
    }
}
