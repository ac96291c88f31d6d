//! Checks of the fused classifier against f64: the one-read kernel at each vectors-per-thread
//! template (rows held in registers, and rows continued in shared memory), the two-pass kernel
//! it falls back to (rows not whole 16-byte vectors, unaligned addresses, rows too wide), with
//! padded columns holding NaN, ignored and strict targets, -inf logits, in place and not; and
//! the timings of both kernels on GPT-2's padded vocabulary against one read and one write.

use std::sync::Arc;

use crate::harness::{rel_err, Buf, Report, Rng, TimingRun};
use oxiflow_cuda::kernel_layer::FloatType;
use oxiflow_cuda::kernel_layer::{
    classifier_plan, classifier_using, row_plan_occupancy, Classifier, ClassifierKernel, RowPlan,
};
use oxiflow_cuda::CudaRuntime;
use oxiflow_tensor::Result;

/// One classifier check.
#[derive(Clone, Copy)]
struct Case {
    t: FloatType,
    rows: usize,
    v: usize,
    ld: usize,
    /// Logits of magnitude in [0.1, 1] * scale.
    scale: f64,
    strict: bool,
    in_place: bool,
    /// Elements the logits and the gradient start past a 16-byte boundary.
    offset: usize,
    /// Some logits -inf (never a target's).
    neg_inf: bool,
    kernel: ClassifierKernel,
    /// The vectors a thread of the one-read kernel `classifier` picks (None: two-pass); checked
    /// when `kernel` is `Auto`.
    expect: Option<usize>,
}

impl Case {
    fn new(t: FloatType, rows: usize, v: usize, ld: usize, expect: Option<usize>) -> Case {
        Case {
            t,
            rows,
            v,
            ld,
            scale: 3.0,
            strict: false,
            in_place: true,
            offset: 0,
            neg_inf: false,
            kernel: ClassifierKernel::Auto,
            expect,
        }
    }
    fn strict(self) -> Case {
        Case {
            strict: true,
            ..self
        }
    }
    fn separate(self) -> Case {
        Case {
            in_place: false,
            ..self
        }
    }
    fn neg_inf(self) -> Case {
        Case {
            neg_inf: true,
            ..self
        }
    }
    fn kernel(self, kernel: ClassifierKernel) -> Case {
        Case { kernel, ..self }
    }
}

fn describe(plan: Option<RowPlan>) -> String {
    match plan {
        Some(p) => format!("one-read V{} x {} threads, {} B smem", p.v, p.block, p.smem),
        None => "two-pass".to_string(),
    }
}

/// Targets: row 0 in range, rows 1, 2, 4, 5 out of range (-1, v, i64::MAX, i64::MIN), row 3
/// the last class, the rest drawn.
fn targets(rows: usize, v: usize, rng: &mut Rng) -> Vec<i64> {
    (0..rows)
        .map(|i| match i {
            1 => -1,
            2 => v as i64,
            3 => v as i64 - 1,
            4 => i64::MAX,
            5 => i64::MIN,
            _ => (rng.next() % v as u64) as i64,
        })
        .collect()
}

/// The f64 loss and gradient of `c` over logits `x` (`rows * ld`).
fn reference(c: &Case, x: &[f64], tg: &[i64], dloss: f64) -> (Vec<f64>, Vec<f64>) {
    let (mut loss, mut grad) = (vec![0.0; c.rows], vec![0.0; c.rows * c.ld]);
    for i in 0..c.rows {
        let row = &x[i * c.ld..][..c.v];
        let g = &mut grad[i * c.ld..][..c.v];
        if tg[i] < 0 || tg[i] >= c.v as i64 {
            if c.strict {
                loss[i] = f64::NAN;
                g.fill(f64::NAN);
            }
            continue;
        }
        let t = tg[i] as usize;
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
        loss[i] = m + s.ln() - row[t];
        for (j, gj) in g.iter_mut().enumerate() {
            *gj = ((row[j] - m).exp() / s - if j == t { 1.0 } else { 0.0 }) * dloss;
        }
    }
    (loss, grad)
}

/// Compares `got` with `want` where NaN is expected exactly where `want` has it.
fn compare(
    rep: &mut Report,
    name: &str,
    t: FloatType,
    shape: &str,
    (got, want): (&[f64], &[f64]),
    note: &str,
) {
    let wrong_nan = got
        .iter()
        .zip(want)
        .filter(|(g, w)| g.is_nan() != w.is_nan())
        .count();
    let (g, w): (Vec<f64>, Vec<f64>) = got
        .iter()
        .zip(want)
        .filter(|(_, w)| !w.is_nan())
        .map(|(g, w)| (*g, *w))
        .unzip();
    let err = if wrong_nan > 0 {
        f64::NAN
    } else {
        rel_err(&g, &w)
    };
    let note = if wrong_nan > 0 {
        format!("{note}; {wrong_nan} values NaN where they should not be, or not NaN")
    } else {
        note.to_string()
    };
    rep.check(name, t, shape.to_string(), err, note);
}

fn run_case(rt: &Arc<CudaRuntime>, rep: &mut Report, c: &Case, seed: u64) -> Result<()> {
    let mut rng = Rng(seed);
    let t = c.t;
    let tg = targets(c.rows, c.v, &mut rng);
    let mut vals = rng.vals(c.offset + c.rows * c.ld, c.scale);
    for i in 0..c.rows {
        let row = &mut vals[c.offset + i * c.ld..][..c.ld];
        // Padding holds NaN: the kernels must never read it into the result.
        row[c.v..].fill(f64::NAN);
        if c.neg_inf {
            for (j, x) in row[..c.v].iter_mut().enumerate() {
                if (j + 3 * i) % 61 == 0 && j as i64 != tg[i] {
                    *x = f64::NEG_INFINITY;
                }
            }
        }
    }
    let (logits, lv) = Buf::vals(rt, t, &vals)?;
    let before = logits.read_bytes(rt)?;
    let tb: Vec<u8> = tg.iter().flat_map(|x| x.to_le_bytes()).collect();
    let tbuf = Buf::from(rt, &tb)?;
    let loss = Buf::new(rt, c.rows * 4)?;
    let grad = Buf::new(rt, (c.offset + c.rows * c.ld) * t.size())?;
    loss.poison(rt)?;
    grad.poison(rt)?;
    let off = (c.offset * t.size()) as u64;
    let dloss = 1.0 / c.rows as f32;
    let args = Classifier {
        rows: c.rows,
        v: c.v,
        ld: c.ld,
        dloss,
        dtype: t,
        logits: logits.ptr() + off,
        dlogits: (!c.in_place).then(|| grad.ptr() + off),
        targets: tbuf.ptr(),
        loss: loss.ptr(),
        strict: c.strict,
    };
    let shape = format!(
        "{}x{} ld{}{}{}{}{}",
        c.rows,
        c.v,
        c.ld,
        if c.in_place { " in place" } else { "" },
        if c.strict { " strict" } else { "" },
        if c.offset > 0 { " unaligned" } else { "" },
        if c.neg_inf { " -inf" } else { "" },
    );
    let plan = match classifier_plan(rt, &args, c.kernel) {
        Ok(p) => p,
        Err(e) => {
            rep.fail("classifier", t.suffix(), shape, e.to_string());
            return Ok(());
        }
    };
    let note = describe(plan);
    if c.kernel == ClassifierKernel::Auto {
        let chosen = plan.map(|p| p.v);
        let wrong = (chosen != c.expect) as u8 as f64;
        let why = format!(
            "{note} (expected {})",
            c.expect.map_or("two-pass".into(), |v| format!("V{v}"))
        );
        rep.check_tol(
            "classifier kernel choice",
            t.suffix(),
            shape.clone(),
            (wrong, 0.0),
            why,
        );
    }
    if let Err(e) = classifier_using(rt, &args, c.kernel) {
        rep.fail("classifier", t.suffix(), shape, e.to_string());
        return Ok(());
    }
    let lv = &lv[c.offset..];
    let (wl, wg) = reference(c, lv, &tg, dloss as f64);
    let out = if c.in_place { &logits } else { &grad };
    let got = &out.read(rt, t)?[c.offset..];
    let got_loss = loss.read(rt, FloatType::F32)?;
    let tag = format!("{note}, {} logits", t.suffix());
    compare(
        rep,
        "classifier loss",
        FloatType::F32,
        &shape,
        (&got_loss, &wl),
        &tag,
    );
    compare(rep, "classifier dlogits", t, &shape, (got, &wg), &note);
    if c.ld > c.v {
        let nonzero = (0..c.rows)
            .flat_map(|i| &got[i * c.ld + c.v..(i + 1) * c.ld])
            .filter(|g| **g != 0.0)
            .count();
        let pad = (nonzero as f64, 0.0);
        rep.check_tol(
            "classifier padding exactly 0",
            t.suffix(),
            shape.clone(),
            pad,
            note.clone(),
        );
    }
    if !c.in_place {
        let after = logits.read_bytes(rt)?;
        let changed = before.iter().zip(&after).filter(|(a, b)| a != b).count() as f64;
        rep.check_tol(
            "classifier logits untouched",
            t.suffix(),
            shape,
            (changed, 0.0),
            note,
        );
    }
    Ok(())
}

pub(super) fn checks(rt: &Arc<CudaRuntime>, rep: &mut Report) -> Result<()> {
    let gpt2 = (50257, 50304);
    for (i, t) in FloatType::ALL.into_iter().enumerate() {
        let per = 16 / t.size();
        let wide = |n: usize| n * per;
        let gpt2_v = if t == FloatType::F32 { 8 } else { 1 };
        let cases = [
            // One vector a thread: many rows (each block loops over several), and one-vector rows.
            Case::new(t, 2500, wide(130) - 5, wide(130), Some(1)),
            Case::new(t, 7, 3, per, Some(1)).strict().separate(),
            Case::new(t, 19, wide(1500) - 13, wide(1500), Some(2))
                .strict()
                .separate()
                .neg_inf(),
            // Rows that would need 4 vectors a thread take one and shared memory; V4 forced.
            Case {
                scale: 20.0,
                ..Case::new(t, 13, wide(4000), wide(4000), Some(1))
            },
            Case {
                scale: 20.0,
                ..Case::new(t, 13, wide(4000), wide(4000), None)
                    .kernel(ClassifierKernel::OneRead { v: 4, block: 1024 })
            },
            Case::new(t, 21, wide(8192) - 68, wide(8192), Some(8)).neg_inf(),
            // GPT-2: 16-bit rows one vector a thread and the rest in shared memory (two blocks
            // a multiprocessor), f32 rows 8 a thread and the rest in shared memory.
            Case::new(t, 263, gpt2.0, gpt2.1, Some(gpt2_v)),
            Case::new(t, 37, gpt2.0, gpt2.1, Some(gpt2_v))
                .strict()
                .separate(),
            Case::new(t, 5, wide(12500) - 1, wide(12500), Some(8))
                .strict()
                .separate(),
            // The two-pass kernel: rows not whole vectors, unaligned, too wide for one block.
            Case::new(t, 9, 999, 999, None),
            Case {
                offset: 1,
                ..Case::new(t, 11, 1000, 1008, None).separate()
            },
            Case::new(t, 3, wide(24576) - 2, wide(24576), None),
            // The same GPT-2 rows through either kernel when asked for.
            Case::new(t, 37, gpt2.0, gpt2.1, None)
                .strict()
                .neg_inf()
                .kernel(ClassifierKernel::TwoPass),
            Case::new(t, 37, gpt2.0, gpt2.1, None)
                .neg_inf()
                .kernel(ClassifierKernel::OneRead { v: 2, block: 1024 }),
        ];
        for (k, c) in cases.iter().enumerate() {
            run_case(rt, rep, c, 700 + 100 * i as u64 + k as u64)?;
        }
    }
    Ok(())
}

/// Times `kernel` on `args`, rated against one read and one write of the logits.
fn time_kernel(
    rt: &Arc<CudaRuntime>,
    rep: &mut Report,
    run: &TimingRun,
    (name, args, kernel): (&str, &Classifier, ClassifierKernel),
) -> Result<()> {
    let plan = match classifier_plan(rt, args, kernel) {
        Ok(p) => p,
        Err(e) => {
            println!("note  {name}: {e}");
            return Ok(());
        }
    };
    let ms = crate::harness::time_ms(rt, run.repeats, |_| {
        classifier_using(rt, args, kernel).map_err(Into::into)
    })?;
    let occupancy = match &plan {
        Some(p) => format!(", {}", row_plan_occupancy(rt, p, args.dtype)?),
        None => String::new(),
    };
    let bytes = 2 * args.rows * args.ld * args.dtype.size();
    rep.time(
        name,
        args.dtype.suffix(),
        format!("{}x{} ld{}", args.rows, args.v, args.ld),
        ms,
        (bytes as f64, "GB/s"),
        format!(
            "{:.0} GB/s copy; floor 1 read + 1 write; {}{occupancy}",
            run.bw,
            describe(plan)
        ),
    );
    Ok(())
}

/// GPT-2's vocabulary padded to 50304: 8192 rows of bf16 (micro-batch 8 of 1024 tokens) and
/// 4096 rows of f32, through the two-pass kernel, the one-read kernel `classifier` picks, and
/// one-read alternatives with the rest of the row in shared memory.
pub(super) fn timings(rt: &Arc<CudaRuntime>, rep: &mut Report, run: &TimingRun) -> Result<()> {
    let mut rng = Rng(500);
    let (v, ld) = (50257, 50304);
    for (t, rows) in [(FloatType::Bf16, 8192), (FloatType::F32, 4096)] {
        let logits = Buf::repeat(rt, t, &rng.vals(ld * 7, 3.0), rows * ld)?;
        let grad = Buf::new(rt, rows * ld * t.size())?;
        let tg: Vec<u8> = (0..rows)
            .flat_map(|i| ((i * 7919 % v) as i64).to_le_bytes())
            .collect();
        let tbuf = Buf::from(rt, &tg)?;
        let loss = Buf::new(rt, rows * 4)?;
        let in_place = Classifier {
            rows,
            v,
            ld,
            dloss: 1.0 / rows as f32,
            dtype: t,
            logits: logits.ptr(),
            dlogits: None,
            targets: tbuf.ptr(),
            loss: loss.ptr(),
            strict: false,
        };
        let separate = Classifier {
            dlogits: Some(grad.ptr()),
            ..in_place
        };
        let one_read = |v, block| ClassifierKernel::OneRead { v, block };
        let mut runs = vec![
            ("classifier two-pass", &separate, ClassifierKernel::TwoPass),
            ("classifier one-read", &separate, ClassifierKernel::Auto),
            (
                "classifier two-pass (in place)",
                &in_place,
                ClassifierKernel::TwoPass,
            ),
            (
                "classifier one-read (in place)",
                &in_place,
                ClassifierKernel::Auto,
            ),
        ];
        if t == FloatType::Bf16 {
            runs.push(("classifier one-read V1+smem", &separate, one_read(1, 1024)));
            runs.push(("classifier one-read V2+smem", &separate, one_read(2, 1024)));
            runs.push(("classifier one-read V4+smem", &separate, one_read(4, 1024)));
        }
        for r in runs {
            time_kernel(rt, rep, run, r)?;
        }
    }
    Ok(())
}
