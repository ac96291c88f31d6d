//! `train --explain` on a 4-rank DP2xTP2 MLP: rank 0 prints every parameter's global shape,
//! placement and SBP, every op's output layout and each boxing of one training step with its
//! bytes, from the explain recorder that dispatch feeds.

mod common;

use common::launch_mlp;

#[test]
fn explain_prints_layouts_and_boxings_of_one_dp2_tp2_step() {
    let out = launch_mlp(4, &["--dp", "2", "--tp", "2", "--explain"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    eprintln!("{stdout}");
    let section = |from: &str, to: &str| -> Vec<String> {
        stdout
            .lines()
            .skip_while(|l| !l.contains(from))
            .skip(1)
            .take_while(|l| !l.contains(to))
            .map(str::to_string)
            .collect()
    };
    let mesh = "on cpu:[[0, 1], [2, 3]] as (";
    let params = section("parameters (", "one training step");
    assert!(params.len() >= 4, "{stdout}");
    assert!(params.iter().all(|l| l.contains(mesh)), "{stdout}");
    // Tensor parallelism splits some parameter along mesh axis 1.
    assert!(params.iter().any(|l| l.contains(", S(")), "{stdout}");
    let step = section("one training step", "explained step loss");
    let ops = step.iter().filter(|l| l.contains(" op ")).count();
    assert!(ops >= 10, "{stdout}");
    let boxing_bytes: Vec<u64> = step
        .iter()
        .filter(|l| l.contains(" boxing for "))
        .filter_map(|l| {
            l.split(": ")
                .nth(2)?
                .split(" bytes max")
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert!(!boxing_bytes.is_empty(), "{stdout}");
    assert!(boxing_bytes.iter().any(|&b| b > 0), "{stdout}");
    assert!(
        step.iter()
            .any(|l| l.ends_with("bytes in all") && l.contains("boxing(s): ")),
        "{stdout}"
    );
    // Rank 0 alone reports.
    assert_eq!(stdout.matches("explained step loss").count(), 1, "{stdout}");
}
