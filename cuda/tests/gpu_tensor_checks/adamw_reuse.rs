//! The multi-tensor AdamW written over its slots' own memory (`AdamWReuse`) against the same
//! update into new memory: the same bits for the new values, moments and compute copies (f32
//! in the one launch with bf16 and f16 copies, f64 through the composed passes; split and
//! broadcast pieces; clipped by a device ratio and by a host factor; the first step's, with no
//! moments and compute copies yet), each result over its slot's old piece on a device (the
//! first step's moments and copies new) and the old tensors holding the new values there; on
//! the host
//! new memory and unchanged operands. Also: a clone, a detached tensor or a second hold of a
//! piece makes `Tensor::data_held_only_by` false on the device, a `BoundPiece` does not. And
//! the guarded update over the slots' memory: a NaN ratio changes nothing, a finite one gives
//! the clipped update's bits.

use oxiflow_ops::adamw::{AdamWReuse, AdamWSlot, AdamWUpdated};
use oxiflow_tensor::capture::piece_of;
use oxiflow_tensor::BoundPiece;

use super::adamw_copies::bits;
use super::*;

/// The results' tensors in order: param, m, v, then the copy when there is one.
fn parts(u: &AdamWUpdated) -> Vec<&Tensor> {
    let mut v = vec![&u.param, &u.m, &u.v];
    v.extend(u.copy.as_ref());
    v
}

/// (p, g, m, v) of slot `i`: random never-zero values, `v` positive.
fn slot_tensors(i: usize, n: usize, dtype: DType, pl: &Placement, sbp: Sbp) -> Result<[Tensor; 4]> {
    let mk = |k: u64| {
        Tensor::randn_global([n, 3], 40 * i as u64 + k, DType::F32, pl, sbp)
            .and_then(|t| t.abs())
            .and_then(|t| t.add_scalar(0.125))
            .and_then(|t| t.mul_scalar(if k.is_multiple_of(2) { 0.5 } else { -0.25 }))
            .and_then(|t| t.cast(dtype))
    };
    Ok([mk(0)?, mk(1)?, mk(2)?, mk(4)?])
}

/// A slot's case: rows (of 3 columns), dtype, layout, compute copy.
type Case = (usize, DType, Sbp, Option<DType>);

const CASES: [Case; 5] = [
    (7, DType::F32, Sbp::S(0), Some(DType::BF16)),
    (4099, DType::F32, Sbp::B, Some(DType::F16)),
    (65_537, DType::F32, Sbp::S(0), None),
    (33, DType::F64, Sbp::S(0), Some(DType::F32)),
    (1, DType::F32, Sbp::B, Some(DType::BF16)),
];

/// Every case's (p, g, m, v), and its compute copy.
type CaseTensors = (Vec<[Tensor; 4]>, Vec<Option<Tensor>>);

/// The cases' (p, g, m, v) (seeds from `base`) and their compute copies.
fn case_tensors(base: usize, pl: &Placement) -> Result<CaseTensors> {
    let tensors: Vec<[Tensor; 4]> = CASES
        .iter()
        .enumerate()
        .map(|(i, &(n, d, sbp, _))| slot_tensors(base + i, n, d, pl, sbp))
        .collect::<Result<_>>()?;
    let copies = tensors
        .iter()
        .zip(&CASES)
        .map(|(t, c)| c.3.map(|d| t[0].to_dtype(d)).transpose())
        .collect::<Result<_>>()?;
    Ok((tensors, copies))
}

/// The cases' slots over `tensors` and `copies`, written over their memory with `reuse`;
/// `first`: the first step's, with no moments and no compute copies yet (the update makes
/// them).
fn slots_of<'a>(
    tensors: &'a [[Tensor; 4]],
    copies: &'a [Option<Tensor>],
    reuse: bool,
    first: bool,
) -> Vec<AdamWSlot<'a>> {
    tensors
        .iter()
        .zip(&CASES)
        .zip(copies)
        .map(|((t, c), copy)| AdamWSlot {
            param: &t[0],
            grad: &t[1],
            m: (!first).then_some(&t[2]),
            v: (!first).then_some(&t[3]),
            weight_decay: 0.1,
            compute_copy: c.3,
            reuse: reuse.then_some(AdamWReuse {
                copy: copy.as_ref().filter(|_| !first),
            }),
        })
        .collect()
}

/// Returns how many results were checked.
pub(crate) fn child_adamw_reuse(world: usize, device: DeviceType) -> Checked {
    let e = |what: &str, err: oxiflow_tensor::TensorError| format!("adamw reuse: {what}: {err}");
    let pl = world_placement(world, device)?;
    let on_device = device != DeviceType::Cpu;
    let hyper = adamw_hyper(1.0);
    let ratio = Tensor::from_vec(vec![0.7f64], Vec::<usize>::new())
        .and_then(|r| r.to_global(&pl, vec![Sbp::B]))
        .map_err(|x| e("ratio", x))?;
    let mut checked = 0;
    for (clipped, first) in [(false, false), (true, false), (false, true), (true, true)] {
        let (tensors, copies) = case_tensors(0, &pl).map_err(|x| e("inputs", x))?;
        let slots = |reuse: bool| slots_of(&tensors, &copies, reuse, first);
        // The bits of every operand of every slot.
        let all_bits = |when: &str| -> std::result::Result<Vec<Vec<u64>>, String> {
            let b = tensors.iter().flatten().map(bits).collect::<Result<_>>();
            b.map_err(|x| e(when, x))
        };
        let run = |reuse: bool| match clipped {
            true => adamw_multi_clipped(&slots(reuse), &hyper, &ratio),
            false => adamw_multi(&slots(reuse), &adamw_hyper(0.7)),
        };
        let before = all_bits("before")?;
        let want = run(false).map_err(|x| e("into new memory", x))?;
        let got = run(true).map_err(|x| e("over the old memory", x))?;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (g, w) = (parts(g), parts(w));
            if g.len() != w.len() {
                return Err(format!(
                    "adamw reuse: slot {i}: {} results for {}",
                    g.len(),
                    w.len()
                ));
            }
            let olds: Vec<&Tensor> = [&tensors[i][0], &tensors[i][2], &tensors[i][3]]
                .into_iter()
                .chain(copies[i].as_ref())
                .collect();
            for (k, ((a, b), old)) in g.iter().zip(&w).zip(&olds).enumerate() {
                let same =
                    bits(a).map_err(|x| e("got", x))? == bits(b).map_err(|x| e("want", x))?;
                if !same {
                    return Err(format!(
                        "adamw reuse (clipped {clipped}, first step {first}): slot {i} result {k} differs from the update into new memory"
                    ));
                }
                // The first step's moments and copies are new (the update makes them).
                let over_old = a.shares_piece(old) || a.local_shape().numel() == 0;
                if !(first && k > 0) && on_device != over_old {
                    return Err(format!(
                        "adamw reuse on {device} (first step {first}): slot {i} result {k} over its old piece: {over_old}"
                    ));
                }
                checked += 1;
            }
        }
        let after = all_bits("after")?;
        // On a device the params and moments (slots' 0, 2 and 3) hold the new values now (the
        // first step's moments are not the slots' tensors); the gradients never change.
        for (j, (b, a)) in before.iter().zip(&after).enumerate() {
            let changed = b != a;
            let expect = on_device && (j % 4 == 0 || (!first && j % 4 != 1));
            if changed != expect {
                return Err(format!(
                    "adamw reuse on {device}: operand {j} of slot {} changed: {changed}",
                    j / 4
                ));
            }
        }
    }
    // Guarded (a NaN ratio keeps everything), over the slots' own memory.
    let (tensors, copies) = case_tensors(10, &pl).map_err(|x| e("guarded inputs", x))?;
    let slots = |reuse: bool| slots_of(&tensors, &copies, reuse, false);
    let all_bits = |ts: &[[Tensor; 4]], cs: &[Option<Tensor>]| -> Result<Vec<Vec<u64>>> {
        ts.iter()
            .flatten()
            .chain(cs.iter().flatten())
            .map(bits)
            .collect()
    };
    let before = all_bits(&tensors, &copies).map_err(|x| e("guarded before", x))?;
    let want = adamw_multi_clipped(&slots(false), &hyper, &ratio)
        .map_err(|x| e("guarded reference", x))?;
    let nan = Tensor::from_vec(vec![f64::NAN], Vec::<usize>::new())
        .and_then(|r| r.to_global(&pl, vec![Sbp::B]))
        .map_err(|x| e("nan ratio", x))?;
    let kept = adamw_multi_guarded(&slots(true), &hyper, &nan).map_err(|x| e("guarded nan", x))?;
    drop(kept);
    if all_bits(&tensors, &copies).map_err(|x| e("guarded after nan", x))? != before {
        return Err("adamw guarded: a NaN ratio changed a value".into());
    }
    let got = adamw_multi_guarded(&slots(true), &hyper, &ratio).map_err(|x| e("guarded", x))?;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        for (a, b) in parts(g).iter().zip(parts(w)) {
            if bits(a).map_err(|x| e("got", x))? != bits(b).map_err(|x| e("want", x))? {
                return Err(format!(
                    "adamw guarded: slot {i} differs from the clipped update"
                ));
            }
            checked += 1;
        }
    }
    // Who holds a device piece.
    let t = Tensor::randn_global([64, 3], 9, DType::F32, &pl, Sbp::S(0))
        .map_err(|x| e("holders", x))?;
    let lone = Tensor::data_held_only_by(&[&t]);
    let c = t.clone();
    let cloned = Tensor::data_held_only_by(&[&t]);
    drop(c);
    let d = t.detach();
    let detached = Tensor::data_held_only_by(&[&t]) || !Tensor::data_held_only_by(&[&t, &d]);
    drop(d);
    let extra = piece_of(&t).cloned();
    let held = Tensor::data_held_only_by(&[&t]);
    drop(extra);
    let bound = piece_of(&t).cloned().map(BoundPiece::new);
    let with_binding = Tensor::data_held_only_by(&[&t]);
    drop(bound);
    if !lone || cloned || detached || held || !with_binding {
        return Err(format!(
            "data_held_only_by on {device}: alone {lone}, cloned {cloned}, detached {detached}, extra hold {held}, bound {with_binding}"
        ));
    }
    Ok(checked + 5)
}
