//! The health guard inside the loop, on 2 in-process ranks with global parameters: a finite
//! loss whose gradient is NaN in the second parameter names that parameter, the same on every
//! rank, and stops before the update; a NaN batch is skipped under `NonFinitePolicy::Skip`
//! (the parameters keep their values) and the next step trains; a save of training state that
//! holds a NaN is refused and the checkpoint already there is kept.

use std::path::{Path, PathBuf};
use std::time::Duration;

use oxiflow_models::checkpoint::{self, Metadata, SaveOptions};
use oxiflow_models::nn::{Module, Parameter, Pass};
use oxiflow_models::optim::{AdamW, AdamWOptions, Optimizer, Sgd, SgdOptions};
use oxiflow_tensor::{no_grad, run_ranks, DType, DeviceType, Placement, Sbp, Tensor, UnaryOp};
use oxiflow_trainer::{
    Batch, BatchSource, HealthGuard, LrSchedule, NonFinitePolicy, StepHook, TrainError, TrainModel,
    TrainOptions, Trainer,
};

fn both() -> Placement {
    Placement::new_1d(DeviceType::Cpu, [0, 1]).unwrap()
}

fn global(values: Vec<f64>) -> Tensor {
    let n = values.len();
    Tensor::from_vec(values, [n])
        .unwrap()
        .to_global(&both(), Sbp::B)
        .unwrap()
}

/// loss = mean(a * x) + sqrt(sum(b^2)): with b = 0 the loss is finite and b's gradient is not
/// (the square root's slope at 0 is infinite). Without b: just mean(a * x).
struct Probe {
    a: Parameter,
    b: Option<Parameter>,
}

impl Module for Probe {
    fn parameters(&self) -> Vec<Parameter> {
        std::iter::once(self.a.clone())
            .chain(self.b.clone())
            .collect()
    }
}

impl TrainModel for Probe {
    fn loss(&self, batch: &Batch, _pass: Pass) -> Result<Tensor, TrainError> {
        let mut loss = self.a.compute()?.mul(&batch.inputs)?.mean_all()?;
        if let Some(b) = &self.b {
            let norm = b.compute()?.square()?.sum_all()?.unary(UnaryOp::Sqrt)?;
            loss = loss.add(&norm)?;
        }
        Ok(loss)
    }
}

/// x = [1, 2, 3, 4] on every step, NaN on step `nan_at` (0-based).
struct Ramp {
    nan_at: Option<u64>,
}

impl BatchSource for Ramp {
    fn batch_size(&self) -> usize {
        4
    }
    fn tokens_per_row(&self) -> usize {
        1
    }
    fn train_batch(&mut self, step: u64, _: usize, _: usize) -> Result<Batch, TrainError> {
        let _ng = no_grad();
        let x = if self.nan_at == Some(step) {
            vec![f64::NAN; 4]
        } else {
            vec![1.0, 2.0, 3.0, 4.0]
        };
        Ok(Batch {
            inputs: global(x),
            targets: global(vec![0.0]),
        })
    }
    fn heldout_batch(&mut self, _: u64) -> Result<Batch, TrainError> {
        self.train_batch(0, 0, 1)
    }
    fn heldout_batches(&self) -> u64 {
        1
    }
    fn describe(&self) -> String {
        "a ramp".into()
    }
}

fn trainer(with_b: bool, nan_at: Option<u64>, policy: NonFinitePolicy) -> Trainer<Probe> {
    trainer_with(with_b, nan_at, policy, Opt::Sgd)
}

/// The optimizer of a test's trainer: SGD (its update queued, then committed or dropped by the
/// verdict), AdamW (applied at once, guarded on the device, since the health guard skips only
/// non-finite steps), or AdamW beside a hook that may skip anything (queued again).
#[derive(Clone, Copy, PartialEq)]
enum Opt {
    Sgd,
    AdamW,
    AdamWQueued,
}

/// A hook that never skips but does not say so: the loop waits for its verdict.
struct Bystander;
impl StepHook for Bystander {}

fn trainer_with(
    with_b: bool,
    nan_at: Option<u64>,
    policy: NonFinitePolicy,
    opt: Opt,
) -> Trainer<Probe> {
    let model = Probe {
        a: Parameter::new("a", &global(vec![0.5; 4])),
        b: with_b.then(|| Parameter::new("b", &global(vec![0.0; 3]))),
    };
    let params = model.parameters();
    let optimizer: Box<dyn Optimizer> = match opt {
        Opt::Sgd => Box::new(Sgd::new(
            params,
            SgdOptions {
                lr: 0.1,
                momentum: 0.0,
                ..SgdOptions::default()
            },
        )),
        Opt::AdamW | Opt::AdamWQueued => Box::new(AdamW::new(params, AdamWOptions::default())),
    };
    let mut t = Trainer::new(
        model,
        optimizer,
        Box::new(Ramp { nan_at }),
        TrainOptions {
            schedule: LrSchedule::constant(0.1),
            clip_grad: (opt != Opt::Sgd).then_some(1.0),
            grad_accum: 1,
            bucket_bytes: 0,
            precision: None,
            pipeline: None,
            compile: false,
        },
    )
    .unwrap();
    t.add_hook(Box::new(HealthGuard::new(policy, 4.0, false)));
    if opt == Opt::AdamWQueued {
        t.add_hook(Box::new(Bystander));
    }
    t
}

fn values(p: &Parameter) -> Vec<f64> {
    p.value().cast(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

#[test]
fn a_non_finite_gradient_names_its_parameter_on_every_rank_and_stops_before_the_update() {
    let out = run_ranks(2, Duration::from_secs(20), |_| {
        let mut t = trainer(true, None, NonFinitePolicy::Stop);
        let before = values(&t.model.a);
        let err = t.train_step().expect_err("the step must stop");
        assert_eq!(values(&t.model.a), before, "the update was applied");
        assert_eq!(t.step, 0, "the step counted");
        err.to_string()
    });
    assert_eq!(out[0], out[1], "the ranks disagree");
    assert!(
        out[0].starts_with("step 1: non-finite gradient norm NaN (loss 1.25)")
            && out[0].contains("the first non-finite tensor: the gradient of b;"),
        "{}",
        out[0]
    );
}

#[test]
fn skip_drops_the_update_of_a_nan_batch_and_trains_on() {
    let out = run_ranks(2, Duration::from_secs(20), |_| {
        let mut t = trainer(false, Some(1), NonFinitePolicy::Skip);
        let s1 = t.train_step().unwrap();
        let after1 = values(&t.model.a);
        let s2 = t.train_step().unwrap();
        let after2 = values(&t.model.a);
        let s3 = t.train_step().unwrap();
        let after3 = values(&t.model.a);
        (s1, s2, s3, after1, after2, after3)
    });
    for (s1, s2, s3, after1, after2, after3) in &out {
        assert!(!s1.skipped && s2.skipped && !s3.skipped);
        assert!(s2.loss.is_nan());
        assert_eq!(s2.non_finite.as_deref(), Some("the loss"));
        assert_eq!(after1, after2, "the skipped step changed the parameters");
        assert_ne!(
            after2, after3,
            "the step after the skipped one did not train"
        );
        // a -= 0.1 * x / 4 on each trained step.
        assert!((after3[3] - (0.5 - 2.0 * 0.1)).abs() < 1e-6, "{after3:?}");
    }
    assert_eq!(out[0].5, out[1].5);
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-health-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn saved_step(path: &Path) -> String {
    checkpoint::read_manifest_at(path).unwrap().metadata["step"].clone()
}

#[test]
fn a_save_of_nan_state_is_refused_and_the_checkpoint_there_is_kept() {
    let dir = tmp("save");
    let out = run_ranks(2, Duration::from_secs(20), |_| {
        let mut t = trainer(false, None, NonFinitePolicy::Stop);
        t.train_step().unwrap();
        t.save(&dir, &Metadata::new(), &SaveOptions::default())
            .unwrap();
        t.train_step().unwrap();
        t.model
            .a
            .set_value(&global(vec![1.0, f64::INFINITY, 0.0, 0.0]))
            .unwrap();
        t.save(&dir, &Metadata::new(), &SaveOptions::default())
            .expect_err("a save of an infinite parameter")
            .to_string()
    });
    assert_eq!(out[0], out[1]);
    assert!(
        out[0].starts_with("step 2: a holds a NaN or infinity: refusing to save it"),
        "{}",
        out[0]
    );
    assert_eq!(saved_step(&dir), "1");
    let _ = std::fs::remove_dir_all(&dir);
}

/// AdamW's update runs before the hooks decide, guarded on the device: a NaN batch leaves the
/// parameters, state and step count as they were, the next step trains, and the parameters
/// are bit for bit those of the queued update that the verdict drops; a non-finite gradient
/// under `Stop` changes nothing either.
#[test]
fn a_guarded_update_skips_exactly_the_non_finite_steps() {
    let out = run_ranks(2, Duration::from_secs(20), |_| {
        let run = |opt: Opt| {
            let mut t = trainer_with(false, Some(1), NonFinitePolicy::Skip, opt);
            let mut seen = Vec::new();
            for _ in 0..3 {
                let s = t.train_step().unwrap();
                seen.push((s.skipped, values(&t.model.a), t.optimizer.step_count()));
            }
            seen
        };
        let stop = {
            let mut t = trainer_with(true, None, NonFinitePolicy::Stop, Opt::AdamW);
            let before = values(&t.model.a);
            let err = t.train_step().expect_err("the step must stop").to_string();
            (before == values(&t.model.a), t.optimizer.step_count(), err)
        };
        (run(Opt::AdamW), run(Opt::AdamWQueued), stop)
    });
    for (guarded, queued, (unchanged, count, err)) in &out {
        assert_eq!(guarded, queued, "guarded and queued updates differ");
        let skipped: Vec<bool> = guarded.iter().map(|s| s.0).collect();
        assert_eq!(skipped, [false, true, false]);
        assert_eq!(guarded[0].1, guarded[1].1, "the skipped step changed a");
        assert_ne!(
            guarded[1].1, guarded[2].1,
            "the step after it did not train"
        );
        let counts: Vec<u64> = guarded.iter().map(|s| s.2).collect();
        assert_eq!(counts, [1, 1, 2], "a skipped step counted");
        assert!(
            *unchanged && *count == 0,
            "a stopped step changed something"
        );
        assert!(err.contains("the gradient of b"), "{err}");
    }
}
