//! `--precision`, `--dtype` and `--reduce-dtype` as the command line spells them, resolved into
//! the one `MixedPrecision` value per device, and the combinations refused by name.

use clap::Parser;
use oxiflow_dtype::{DType, MatmulPrecision, MixedPrecision};
use oxiflow_placement::DeviceType;

use super::{Flags, TrainConfig};
use crate::error::TrainError;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    flags: Flags,
}

fn resolved(args: &[&str]) -> Result<TrainConfig, TrainError> {
    let cli =
        Cli::try_parse_from(std::iter::once("train").chain(args.iter().copied())).map_err(|e| {
            TrainError::Config {
                detail: e.to_string(),
            }
        })?;
    TrainConfig::resolve(cli.flags, Default::default())
}

/// The policy on (cpu, cuda).
fn policies(args: &[&str]) -> (MixedPrecision, MixedPrecision) {
    let cfg = resolved(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let on = |d| {
        cfg.precision(d)
            .unwrap_or_else(|e| panic!("{args:?} {d:?}: {e}"))
    };
    (on(DeviceType::Cpu), on(DeviceType::Cuda))
}

fn refusal(args: &[&str]) -> String {
    match resolved(args) {
        Ok(c) => panic!("{args:?} resolved: {:?}", c.precision(DeviceType::Cpu)),
        Err(e) => e.to_string(),
    }
}

#[test]
fn flags_become_one_value_per_device() {
    let full = |d| MixedPrecision::full(d).unwrap();
    let mixed = |d| MixedPrecision::bf16_mixed(d).unwrap();
    assert_eq!(policies(&[]), (full(DType::F32), mixed(DType::F32)));
    assert_eq!(
        policies(&["--dtype", "f64"]),
        (full(DType::F64), mixed(DType::F64))
    );
    assert_eq!(
        policies(&["--precision", "f64"]),
        (full(DType::F64), full(DType::F64))
    );
    assert_eq!(
        resolved(&["--precision", "f64"]).unwrap().model.dtype,
        DType::F64
    );
    assert_eq!(
        policies(&["--precision", "f32", "--dtype", "f32"]),
        (full(DType::F32), full(DType::F32))
    );
    let tf32 = full(DType::F32).with_matmul(MatmulPrecision::Tf32).unwrap();
    assert_eq!(policies(&["--precision", "tf32"]), (tf32, tf32));
    let want =
        MixedPrecision::new(DType::F64, DType::BF16, DType::BF16, MatmulPrecision::F32).unwrap();
    let args = [
        "--precision",
        "bf16-mixed",
        "--dtype",
        "f64",
        "--reduce-dtype",
        "bf16",
    ];
    assert_eq!(policies(&args), (want, want));
}

#[test]
fn disagreeing_and_unknown_spellings_are_refused_by_name() {
    let e = refusal(&["--precision", "f32", "--dtype", "f64"]);
    assert!(
        e.contains("--precision f32") && e.contains("give --precision f64"),
        "{e}"
    );
    let e = refusal(&["--precision", "tf32", "--dtype", "f64"]);
    assert!(
        e.contains("--precision tf32") && e.contains("--dtype f64"),
        "{e}"
    );
    let e = refusal(&["--precision", "f64", "--dtype", "f32"]);
    assert!(e.contains("give --precision f32"), "{e}");
    for (args, flag) in [
        (&["--dtype", "bf16"][..], "--dtype"),
        (&["--dtype", "i64"][..], "--dtype"),
        (&["--reduce-dtype", "i64"][..], "--reduce-dtype"),
        (&["--precision", "fp8"][..], "--precision"),
    ] {
        let e = refusal(args);
        assert!(e.contains(flag), "{args:?}: {e}");
    }
    // A job file bypasses the parsers: the same checks run when the configuration resolves.
    let mut f = Flags::default();
    f.model.dtype = Some(DType::BF16);
    let e = TrainConfig::resolve(f, Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--dtype") && e.contains("bf16 is not f32 or f64"),
        "{e}"
    );
    let mut f = Flags::default();
    f.optim.reduce_dtype = Some(DType::I64);
    let e = TrainConfig::resolve(f, Default::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--reduce-dtype"), "{e}");
}
