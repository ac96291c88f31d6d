//! The routed experts' CPU kernels on host arrays: each rank orders its rows by the member
//! holding their expert, exchanges ids and rows (widened) with its peers, runs the SwiGLU of
//! each of its experts on the rows it received (in parallel over experts), and sends the
//! results back to be put in row order; f32 and f64 computed in their own precision, bf16 in
//! f32 (rounded once per output element).

use half::bf16;
use ndarray::{Array2, ArrayView2, LinalgScalar, Zip};
use oxiflow_tensor::{CpuArray, CpuBackend, ExternOp, KernelIo, Peers, Result};
use rayon::prelude::*;

use super::RoutedExperts;
use crate::cpu_dispatch::cpu_kernels_by_dtype;
use crate::host_slices::{input, kernel_err, output, Elem, Wide};

/// What the kernels need of a wide element type: products, and bytes to send.
trait Compute: Wide + LinalgScalar + bytemuck::Pod {}
impl<W: Wide + LinalgScalar + bytemuck::Pod> Compute for W {}

/// One rank's call: its peers, the sizes, its experts' matrices (widened) and where its rows
/// go.
struct Call<'a, W> {
    name: &'static str,
    peers: Peers,
    /// Rows in, the model width `c` and each expert's hidden width `f` (this rank's part).
    m: usize,
    c: usize,
    f: usize,
    /// This rank's first expert and its number of experts.
    first: usize,
    local: usize,
    gate: Vec<W>,
    up: Vec<W>,
    down: Vec<W>,
    /// The rows in send order (grouped by destination member) and the rows per member.
    order: Vec<usize>,
    counts: Vec<usize>,
    ids: &'a [i64],
}

fn setup<'a, T: Elem>(op: &RoutedExperts, x: &'a [&'a CpuArray]) -> Result<Call<'a, T::W>>
where
    T::W: Compute,
{
    let name = op.name();
    let dims = |i: usize| x.get(i).map(|a| a.shape().to_vec()).unwrap_or_default();
    let (xs, gs, ds) = (dims(0), dims(2), dims(4));
    let (&[m, c], &[local, gc, f]) = (&xs[..], &gs[..]) else {
        return Err(kernel_err(
            name,
            format!("rows {xs:?} and gate {gs:?} are not [m, c] and [experts, c, f]"),
        ));
    };
    if gc != c || dims(3) != gs || ds != [local, f, c] {
        return Err(kernel_err(
            name,
            format!(
                "rows {xs:?} against gate {gs:?}, up {:?} and down {ds:?}",
                dims(3)
            ),
        ));
    }
    let peers = match &op.peers {
        Some(p) => p.clone().map_err(|e| kernel_err(name, e))?,
        None => Peers::alone(local),
    };
    let mine = peers.regions()[peers.me()].clone();
    if mine.len() != local {
        return Err(kernel_err(
            name,
            format!("this rank holds experts {mine:?} but {local} matrices"),
        ));
    }
    let ids = match x.get(1) {
        Some(CpuArray::I64(a)) => a.as_slice().filter(|s| s.len() == m),
        _ => None,
    }
    .ok_or_else(|| {
        kernel_err(
            name,
            format!("input 1 is not {m} contiguous i64 expert ids"),
        )
    })?;
    let (order, counts) = plan(name, &peers, ids)?;
    let wide = |i: usize| -> Result<Vec<T::W>> {
        Ok(input::<T>(name, x, i)?.iter().map(|v| v.widen()).collect())
    };
    Ok(Call {
        name,
        m,
        c,
        f,
        first: mine.start,
        local,
        gate: wide(2)?,
        up: wide(3)?,
        down: wide(4)?,
        order,
        counts,
        ids,
        peers,
    })
}

/// Each row's destination member (the one whose expert range holds its id): the rows in
/// member order (row order within a member) and the rows per member.
fn plan(name: &'static str, peers: &Peers, ids: &[i64]) -> Result<(Vec<usize>, Vec<usize>)> {
    let regions = peers.regions();
    let experts = regions.iter().map(|r| r.end).max().unwrap_or(0);
    let dest = ids
        .iter()
        .enumerate()
        .map(|(m, &e)| {
            usize::try_from(e)
                .ok()
                .and_then(|e| regions.iter().position(|r| r.contains(&e)))
                .ok_or_else(|| {
                    kernel_err(
                        name,
                        format!("row {m} is routed to expert {e} of {experts}"),
                    )
                })
        })
        .collect::<Result<Vec<usize>>>()?;
    let mut counts = vec![0; regions.len()];
    dest.iter().for_each(|&j| counts[j] += 1);
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&m| dest[m]);
    Ok((order, counts))
}

impl<W: Compute> Call<'_, W> {
    /// Sends each row of `rows` (`[m, width]`, row order) with its id to its expert's member;
    /// returns the ids and rows received (member order) and the rows from each member.
    fn dispatch(&self, rows: &[W], width: usize) -> Result<(Vec<i64>, Vec<W>, Vec<usize>)> {
        let ids: Vec<i64> = self.order.iter().map(|&m| self.ids[m]).collect();
        let (got_ids, from) = self.peers.all_to_all_v(self.name, &ids, &self.counts)?;
        let send: Vec<W> = self
            .order
            .iter()
            .flat_map(|&m| rows[m * width..(m + 1) * width].iter().copied())
            .collect();
        let counts: Vec<usize> = self.counts.iter().map(|n| n * width).collect();
        let (got, _) = self.peers.all_to_all_v(self.name, &send, &counts)?;
        Ok((got_ids, got, from))
    }

    /// Sends each received row's result (`[rows, width]`, received order) back to the member
    /// it came from (`from`: rows per member); returns this rank's rows' results in row order.
    fn combine(&self, results: &[W], width: usize, from: &[usize]) -> Result<Vec<W>> {
        let counts: Vec<usize> = from.iter().map(|n| n * width).collect();
        let (back, _) = self.peers.all_to_all_v(self.name, results, &counts)?;
        if back.len() != self.m * width {
            return Err(kernel_err(
                self.name,
                format!(
                    "{} values came back for {} rows of {width}",
                    back.len(),
                    self.m
                ),
            ));
        }
        let mut out = vec![W::constant(0.0); self.m * width];
        for (i, &row) in self.order.iter().enumerate() {
            out[row * width..(row + 1) * width].copy_from_slice(&back[i * width..(i + 1) * width]);
        }
        Ok(out)
    }

    /// The received rows of each local expert, from their global ids.
    fn by_expert(&self, ids: &[i64]) -> Result<Vec<Vec<usize>>> {
        let mut rows = vec![Vec::new(); self.local];
        for (r, &e) in ids.iter().enumerate() {
            let slot = usize::try_from(e)
                .ok()
                .and_then(|e| e.checked_sub(self.first))
                .and_then(|e| rows.get_mut(e))
                .ok_or_else(|| {
                    kernel_err(
                        self.name,
                        format!(
                            "received a row for expert {e}; this rank holds experts {}..{}",
                            self.first,
                            self.first + self.local
                        ),
                    )
                })?;
            slot.push(r);
        }
        Ok(rows)
    }

    /// Expert `e`'s matrices: gate and up `[c, f]`, down `[f, c]`.
    fn matrices(&self, e: usize) -> Result<[ArrayView2<'_, W>; 3]> {
        let (c, f) = (self.c, self.f);
        Ok([
            self.matrix(&self.gate, e, (c, f))?,
            self.matrix(&self.up, e, (c, f))?,
            self.matrix(&self.down, e, (f, c))?,
        ])
    }

    /// Expert `e`'s matrix of `shape` in the stacked values `v`.
    fn matrix<'v>(&self, v: &'v [W], e: usize, shape: (usize, usize)) -> Result<ArrayView2<'v, W>> {
        let n = shape.0 * shape.1;
        v.get(e * n..(e + 1) * n)
            .and_then(|s| ArrayView2::from_shape(shape, s).ok())
            .ok_or_else(|| {
                kernel_err(
                    self.name,
                    format!("expert {e} of {} has no {shape:?} matrix", self.local),
                )
            })
    }
}

/// Columns `cols` of the rows `rows` of the row-major `[_, width]` values `v`.
fn gather<W: Compute>(
    v: &[W],
    width: usize,
    rows: &[usize],
    cols: std::ops::Range<usize>,
) -> Array2<W> {
    Array2::from_shape_fn((rows.len(), cols.len()), |(r, j)| {
        v[rows[r] * width + cols.start + j]
    })
}

/// Puts the rows of `p` at rows `rows` of the row-major `[_, width]` values `out`.
fn scatter<W: Compute>(out: &mut [W], width: usize, rows: &[usize], p: &Array2<W>) {
    for (r, &row) in rows.iter().enumerate() {
        out[row * width..(row + 1) * width]
            .iter_mut()
            .zip(p.row(r))
            .for_each(|(o, &v)| *o = v);
    }
}

fn forward_typed<T: Elem>(op: &RoutedExperts, io: KernelIo<'_, CpuBackend>) -> Result<()>
where
    T::W: Compute,
{
    let call = setup::<T>(op, io.inputs)?;
    let c = call.c;
    let x: Vec<T::W> = input::<T>(call.name, io.inputs, 0)?
        .iter()
        .map(|v| v.widen())
        .collect();
    let (ids, rows, from) = call.dispatch(&x, c)?;
    let groups = call.by_expert(&ids)?;
    let products: Vec<Array2<T::W>> = groups
        .par_iter()
        .enumerate()
        .map(|(e, rs)| {
            let [gate, up, down] = call.matrices(e)?;
            let xe = gather(&rows, c, rs, 0..c);
            let mut h = xe.dot(&gate);
            Zip::from(&mut h)
                .and(&xe.dot(&up))
                .for_each(|g, &u| *g = *g * g.sigmoid() * u);
            Ok(h.dot(&down))
        })
        .collect::<Result<_>>()?;
    let mut results = vec![T::W::constant(0.0); ids.len() * c];
    for (rs, p) in groups.iter().zip(&products) {
        scatter(&mut results, c, rs, p);
    }
    let y = call.combine(&results, c, &from)?;
    let out = output::<T>(call.name, io.outputs, 0, call.m * c)?;
    out.iter_mut().zip(&y).for_each(|(o, &v)| *o = T::narrow(v));
    Ok(())
}

/// One expert's gradients from its rows `x` and their output gradients `dy`: the rows'
/// gradients and the expert's gate, up and down gradients.
fn expert_grads<W: Compute>(
    [gate, up, down]: [ArrayView2<'_, W>; 3],
    x: &Array2<W>,
    dy: &Array2<W>,
) -> [Array2<W>; 4] {
    let (g, u) = (x.dot(&gate), x.dot(&up));
    let dh = dy.dot(&down.t());
    let one = W::constant(1.0);
    // silu(g), and the gradients at the gate's and the up projection's outputs.
    let mut s = g.clone();
    let mut dg = dh.clone();
    let mut du = dh;
    Zip::from(&mut s)
        .and(&mut dg)
        .and(&mut du)
        .and(&g)
        .and(&u)
        .for_each(|s, dg, du, &g, &u| {
            let sg = g.sigmoid();
            *s = g * sg;
            *du = *du * *s;
            *dg = *dg * u * sg * (one + g * (one - sg));
        });
    let h = &s * &u;
    let dx = dg.dot(&gate.t()) + du.dot(&up.t());
    [dx, x.t().dot(&dg), x.t().dot(&du), h.t().dot(dy)]
}

fn backward_typed<T: Elem>(op: &RoutedExperts, io: KernelIo<'_, CpuBackend>) -> Result<()>
where
    T::W: Compute,
{
    let call = setup::<T>(op, io.inputs)?;
    let (c, f) = (call.c, call.f);
    // Each row with its output gradient: [x | dy].
    let (x, dy) = (
        input::<T>(call.name, io.inputs, 0)?,
        input::<T>(call.name, io.inputs, 5)?,
    );
    if dy.len() != x.len() {
        return Err(kernel_err(
            call.name,
            format!("dy holds {} values for rows of {}", dy.len(), x.len()),
        ));
    }
    let both: Vec<T::W> = x
        .chunks(c.max(1))
        .zip(dy.chunks(c.max(1)))
        .flat_map(|(a, b)| a.iter().chain(b).map(|v| v.widen()))
        .collect();
    let (ids, rows, from) = call.dispatch(&both, 2 * c)?;
    let groups = call.by_expert(&ids)?;
    let grads: Vec<[Array2<T::W>; 4]> = groups
        .par_iter()
        .enumerate()
        .map(|(e, rs)| {
            let (xe, dye) = (
                gather(&rows, 2 * c, rs, 0..c),
                gather(&rows, 2 * c, rs, c..2 * c),
            );
            Ok(expert_grads(call.matrices(e)?, &xe, &dye))
        })
        .collect::<Result<_>>()?;
    let mut dx_rows = vec![T::W::constant(0.0); ids.len() * c];
    for (rs, g) in groups.iter().zip(&grads) {
        scatter(&mut dx_rows, c, rs, &g[0]);
    }
    let dx = call.combine(&dx_rows, c, &from)?;
    let narrow = |out: &mut [T], vals: &mut dyn Iterator<Item = T::W>| {
        out.iter_mut()
            .zip(vals)
            .for_each(|(o, v)| *o = T::narrow(v));
    };
    narrow(
        output::<T>(call.name, io.outputs, 0, call.m * c)?,
        &mut dx.iter().copied(),
    );
    for w in 1..4 {
        let out = output::<T>(call.name, io.outputs, w, call.local * c * f)?;
        narrow(out, &mut grads.iter().flat_map(|g| g[w].iter().copied()));
    }
    Ok(())
}

cpu_kernels_by_dtype! {
    [f32, f64, bf16];
    pub(super) fn forward(RoutedExperts) => forward_typed;
    pub(super) fn backward(RoutedExperts) => backward_typed;
}
