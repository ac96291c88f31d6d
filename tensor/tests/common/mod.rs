//! Shared helpers of the tensor integration tests: placements and nd-SBPs from seeds, running a
//! closure on every rank of a placement, reading values (whole global ones too, or their bits), the weighted
//! sum a gradient test differentiates, finite-difference gradient checks, array comparison
//! with an f32 tolerance, the f64 reference of the padded cross-entropy, the small meshes the
//! global property tests draw, and the meshes and SBPs the bucket tests draw.

#![allow(dead_code)]

pub mod attention;

use std::time::Duration;

use ndarray::ArrayD;
use oxiflow_tensor::{
    run_ranks, DeviceType, GlobalLayout, NdSbp, Placement, ReduceOp, Sbp, Shape, Tensor,
};
use proptest::prelude::*;

/// A placement over `n` ranks of mesh `mesh` (product = n), ranks permuted by `perm_seed`.
pub fn placement(mesh: &[usize], perm_seed: u64) -> Placement {
    let n: usize = mesh.iter().product();
    let mut ranks: Vec<usize> = (0..n).collect();
    let mut s = perm_seed;
    for i in (1..n).rev() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let j = (s >> 33) as usize % (i + 1);
        ranks.swap(i, j);
    }
    Placement::new(DeviceType::Cpu, mesh.to_vec(), ranks).unwrap()
}

/// A placement over ranks `0..n` in order, shaped as `mesh` (product = n).
pub fn ordered_placement(mesh: &[usize]) -> Placement {
    Placement::range(DeviceType::Cpu, mesh.iter().product())
        .and_then(|p| p.reshaped(mesh.to_vec()))
        .unwrap()
}

/// The local tensor `x` (the same value on every rank) laid out `s` on `p`: broadcast to every
/// rank, then boxed.
pub fn boxed_from_b(x: &Tensor, p: &Placement, s: &NdSbp) -> Tensor {
    x.to_global(p, NdSbp::broadcast(p.ndim()))
        .and_then(|t| t.to_global(p, s.clone()))
        .unwrap()
}

/// One SBP per mesh axis chosen by `seed` among S(0..ndim), B, P (P only when `allow_p`).
pub fn nd_sbp(naxes: usize, ndim: usize, seed: u64, allow_p: bool) -> NdSbp {
    let mut s = seed;
    NdSbp::new((0..naxes).map(|_| {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let k = ndim + 1 + usize::from(allow_p);
        match (s >> 33) as usize % k {
            d if d < ndim => Sbp::S(d),
            d if d == ndim => Sbp::B,
            _ => Sbp::P,
        }
    }))
}

/// `f` run on every rank of `p`'s world (threads of this process, 30 s to finish), one result
/// per rank.
pub fn on_ranks<R: Send>(p: &Placement, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    run_ranks(p.num_ranks(), Duration::from_secs(30), f)
}

/// [`Tensor::randn_global`]'s f64 values laid out `sbp` on `p`, a leaf that requires a gradient.
pub fn randn_leaf(
    shape: impl Into<Shape>,
    seed: u64,
    p: &Placement,
    sbp: impl Into<NdSbp>,
) -> Tensor {
    Tensor::randn_global(shape, seed, oxiflow_tensor::DType::F64, p, sbp)
        .unwrap()
        .requires_grad_(true)
}

/// The values of a float tensor as f64, row-major.
pub fn vals(x: &Tensor) -> Vec<f64> {
    x.to_dtype(oxiflow_tensor::DType::F64)
        .unwrap()
        .to_ndarray::<f64>()
        .unwrap()
        .into_raw_vec_and_offset()
        .0
}

/// The bits of a local tensor's values, each widened to f64 (exact for every float dtype).
pub fn bits(x: &Tensor) -> Vec<u64> {
    vals(x).into_iter().map(f64::to_bits).collect()
}

/// The whole value of the global f64 tensor `t` on `p` (broadcast to every rank), row-major.
pub fn whole(t: &Tensor, p: &Placement) -> Vec<f64> {
    vals(&t.to_global(p, NdSbp::broadcast(p.ndim())).unwrap())
}

/// How many tensors the autograd node that made `y` keeps for its backward (None for a
/// tensor no node made).
pub fn saved_count(y: &Tensor) -> Option<usize> {
    y.autograd().grad_fn().map(|f| f.saved_count())
}

/// `sum(y * r)`: a scalar whose gradient reaches every element of `y` (weighted by `r`).
pub fn weighted_sum(y: &Tensor, r: &Tensor) -> Tensor {
    y.mul(r).unwrap().sum_all().unwrap()
}

/// How far a gradient may be from its finite difference `fd`.
#[derive(Clone, Copy, Debug)]
pub enum Tol {
    /// At most this much.
    Abs(f64),
    /// At most this times `1 + |fd|`.
    Rel(f64),
}

impl Tol {
    fn allows(self, g: f64, fd: f64) -> bool {
        let tol = match self {
            Tol::Abs(t) => t,
            Tol::Rel(t) => t * (1.0 + fd.abs()),
        };
        (g - fd).abs() < tol
    }
}

/// Asserts that `grad`, the autograd gradient of the scalar `loss` at the f64 tensor `x`, equals
/// the central difference (step 1e-6) of `loss` at every element within `tol`; `loss` is
/// evaluated at copies of `x` with one element moved.
pub fn assert_grad_matches_fd(
    x: &Tensor,
    grad: &Tensor,
    tol: Tol,
    loss: impl Fn(&Tensor) -> Tensor,
    what: &str,
) {
    let (base, shape) = (vals(x), x.shape().dims().to_vec());
    for (i, g) in vals(grad).iter().enumerate() {
        let at = |delta: f64| {
            let mut v = base.clone();
            v[i] += delta;
            vals(&loss(&Tensor::from_vec(v, shape.clone()).unwrap()))[0]
        };
        let fd = (at(1e-6) - at(-1e-6)) / 2e-6;
        assert!(tol.allows(*g, fd), "{what} element {i}: {g} vs {fd}");
    }
}

/// Makes the f64 tensor `x` a leaf that requires a gradient, runs the backward of the scalar
/// `loss` at it, and asserts that its gradient matches the central differences of `loss`
/// ([`assert_grad_matches_fd`]).
pub fn assert_backward_matches_fd(
    x: &Tensor,
    tol: Tol,
    loss: impl Fn(&Tensor) -> Tensor,
    what: &str,
) {
    let x = x.clone().requires_grad_(true);
    loss(&x).backward().unwrap();
    assert_grad_matches_fd(&x, &x.grad().unwrap(), tol, loss, what);
}

/// [`assert_backward_matches_fd`] within an absolute 1e-6 for each op `which` of a test: the
/// loss `loss(which, x)` at the `which`-th of `xs`.
pub fn assert_each_op_matches_fd(
    xs: impl IntoIterator<Item = Tensor>,
    loss: impl Fn(usize, &Tensor) -> Tensor,
) {
    for (which, x) in xs.into_iter().enumerate() {
        assert_backward_matches_fd(
            &x,
            Tol::Abs(1e-6),
            |x| loss(which, x),
            &format!("op {which}"),
        );
    }
}

/// Element-wise closeness with an f32 tolerance (equal infinities and NaN against NaN pass).
pub fn assert_close(got: &ArrayD<f32>, want: &ArrayD<f32>, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
        let tol = 2e-4 * (1.0 + w.abs());
        assert!(
            (g - w).abs() <= tol || g == w || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

/// Asserts `got` equals `want` element by element within a relative 1e-10 (`what` names the
/// values in the message).
pub fn assert_vals_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-10 * (1.0 + b.abs()),
            "{what}[{i}]: {a} vs {b}"
        );
    }
}

/// Asserts each of the outputs `got` equals the same one of `want` ([`assert_vals_close`]),
/// as many of them.
pub fn assert_outputs_close(got: &[Vec<f64>], want: &[Vec<f64>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: outputs");
    for (j, (g, w)) in got.iter().zip(want).enumerate() {
        assert_vals_close(g, w, &format!("{what}: output {j}"));
    }
}

/// Whether every rank's outputs (`got[rank][output]`) equal the one-rank values `want[output]`
/// within a relative 1e-9; the first difference otherwise.
pub fn ranks_match(got: &[Vec<Vec<f64>>], want: &[Vec<f64>]) -> Result<(), String> {
    for (rank, outs) in got.iter().enumerate() {
        counts_match(&format!("rank {rank}"), outs.len(), want.len(), "outputs")?;
        for (o, (g, w)) in outs.iter().zip(want).enumerate() {
            counts_match(
                &format!("rank {rank} output {o}"),
                g.len(),
                w.len(),
                "values",
            )?;
            for (i, (a, b)) in g.iter().zip(w).enumerate() {
                if (a - b).abs() >= 1e-9 * (1.0 + b.abs()) {
                    return Err(format!("rank {rank} output {o} [{i}]: {a} vs {b}"));
                }
            }
        }
    }
    Ok(())
}

/// `Err("{what}: {got} {unit}, want {want}")` where the counts differ.
fn counts_match(what: &str, got: usize, want: usize, unit: &str) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: {got} {unit}, want {want}"))
    }
}

/// The f64 log-sum-exp of `values` (-inf for none).
pub fn log_sum_exp(values: &[f64]) -> f64 {
    let m = values.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + values.iter().map(|v| (v - m).exp()).sum::<f64>().ln()
}

/// The f64 reference of the cross-entropy over the first `classes` of `width` columns of
/// logits `x` (row-major): per-row loss `logsumexp(x[..classes]) - x[t]`, and the gradient of
/// `sum(loss * c)`: `c (softmax - onehot)` in the class columns, 0 in the padding.
pub fn padded_cross_entropy_reference(
    x: &[f64],
    width: usize,
    classes: usize,
    t: &[i64],
    c: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let mut loss = Vec::new();
    let mut grad = vec![0.0; x.len()];
    for (i, row) in x.chunks(width).enumerate() {
        let real = &row[..classes];
        let lse = log_sum_exp(real);
        let ti = t[i] as usize;
        loss.push(lse - real[ti]);
        for (j, v) in real.iter().enumerate() {
            let onehot = if j == ti { 1.0 } else { 0.0 };
            grad[i * width + j] = c[i] * ((v - lse).exp() - onehot);
        }
    }
    (loss, grad)
}

/// The f64 reference of the fused linear cross-entropy over the first `classes` rows of the
/// table `w` `[v, width]` for `x` `[rows, width]` and targets `t`: the sum of the rows' losses
/// times `c`, and its gradients `c D w` and `c D^T x` (`D` = softmax - onehot, 0 in the
/// padding).
pub fn linear_cross_entropy_reference(
    x: &[f64],
    w: &[f64],
    (rows, width, v): (usize, usize, usize),
    classes: usize,
    t: &[i64],
    c: f64,
) -> (f64, Vec<f64>, Vec<f64>) {
    let mut logits = vec![0.0; rows * v];
    for i in 0..rows {
        let xi = &x[i * width..(i + 1) * width];
        for j in 0..v {
            let wj = &w[j * width..(j + 1) * width];
            logits[i * v + j] = xi.iter().zip(wj).map(|(a, b)| a * b).sum();
        }
    }
    let (loss, d) = padded_cross_entropy_reference(&logits, v, classes, t, &vec![c; rows]);
    let mut dx = vec![0.0; rows * width];
    let mut dw = vec![0.0; v * width];
    for i in 0..rows {
        for j in 0..classes {
            let g = d[i * v + j];
            for k in 0..width {
                dx[i * width + k] += g * w[j * width + k];
                dw[j * width + k] += g * x[i * width + k];
            }
        }
    }
    (c * loss.iter().sum::<f64>(), dx, dw)
}

/// One of `meshes`, each as often.
pub fn one_mesh_of(meshes: &[&[usize]]) -> impl Strategy<Value = Vec<usize>> {
    prop::sample::select(meshes.iter().map(|m| m.to_vec()).collect::<Vec<_>>())
}

/// Meshes of 2 to 4 ranks, as often each: 2 and 3 in a row, 2x2 and 1x3.
pub fn small_meshes() -> impl Strategy<Value = Vec<usize>> {
    one_mesh_of(&[&[2], &[3], &[2, 2], &[1, 3]])
}

/// Meshes of 2 to 4 ranks with three ranks on either axis, as often each: 2 and 4 in a row,
/// 2x2, 1x3 and 3x1.
pub fn small_meshes_either_way() -> impl Strategy<Value = Vec<usize>> {
    one_mesh_of(&[&[2], &[4], &[2, 2], &[1, 3], &[3, 1]])
}

/// A placement on a mesh drawn from `meshes`, its ranks permuted by a drawn seed
/// ([`placement`]).
pub fn placed(meshes: impl Strategy<Value = Vec<usize>>) -> impl Strategy<Value = Placement> {
    (meshes, any::<u64>()).prop_map(|(mesh, perm_seed)| placement(&mesh, perm_seed))
}

/// (world size, mesh shape) of the bucket tests: 1-d and 2-d meshes of up to six ranks.
pub fn bucket_mesh() -> impl Strategy<Value = (usize, Vec<usize>)> {
    prop_oneof![
        Just((1, vec![1])),
        Just((2, vec![2])),
        Just((3, vec![3])),
        Just((4, vec![4])),
        Just((4, vec![2, 2])),
        Just((6, vec![2, 3])),
        Just((6, vec![3, 2])),
    ]
}

/// The layout of a bucket case: the world size and mesh shape, the mesh axis the bucket uses,
/// and (rows, cols, SBP on the other mesh axis) per tensor.
#[derive(Clone, Debug)]
pub struct BucketLayout {
    pub world: usize,
    pub shape: Vec<usize>,
    pub axis: usize,
    pub tensors: Vec<(usize, usize, Sbp)>,
}

/// A bucket case's layout: a [`bucket_mesh`], either mesh axis (wrapped to the mesh's axes),
/// and `count` tensors of `rows` rows and 1 to 3 columns, [`other_axis_sbp`] on the other axis.
pub fn bucket_layout(
    rows: std::ops::Range<usize>,
    count: std::ops::Range<usize>,
) -> impl Strategy<Value = BucketLayout> {
    (
        bucket_mesh(),
        0usize..2,
        prop::collection::vec((rows, 1usize..4, other_axis_sbp()), count),
    )
        .prop_map(|((world, shape), axis, tensors)| BucketLayout {
            axis: axis % shape.len(),
            world,
            shape,
            tensors,
        })
}

impl BucketLayout {
    /// `f(placement, rank)` on every rank of the case's world ([`bucket_placement`]; threads of
    /// this process, 30 s to finish), one result per rank.
    pub fn on_ranks<R: Send>(&self, f: impl Fn(&Placement, usize) -> R + Sync) -> Vec<R> {
        let placement = bucket_placement(self.world, &self.shape);
        run_ranks(self.world, Duration::from_secs(30), |rank| {
            f(&placement, rank)
        })
    }

    /// Each tensor of the case on `rank`, made by `make(nd-SBP, piece shape, seed)` from its
    /// [`bucket_piece`] with `on_axis` on the bucket's axis.
    pub fn pieces<T>(
        &self,
        placement: &Placement,
        rank: usize,
        on_axis: Sbp,
        make: impl Fn(NdSbp, Shape, u64) -> T,
    ) -> Vec<T> {
        self.tensors
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let (nd, local, seed) = bucket_piece(placement, rank, (self.axis, on_axis), t, i);
                make(nd, local, seed)
            })
            .collect()
    }
}

/// The errors of `bucket` on ranks 0 and 1 (a 1-d placement) for two pairs of tensors: an f64
/// `[3]` laid out `sbp` with the same in f32 (mixed dtypes), and with an f64 of `other`'s shape
/// and SBP; each rank's values its own.
pub fn refused_buckets(
    sbp: Sbp,
    other: (&[usize], Sbp),
    bucket: impl Fn(&[Tensor]) -> oxiflow_tensor::Result<Vec<Tensor>> + Sync,
) -> Vec<(String, String)> {
    let placement = Placement::new_1d(DeviceType::Cpu, vec![0, 1]).unwrap();
    run_ranks(2, Duration::from_secs(30), |rank| {
        let nd = NdSbp::new([sbp]);
        let a = Tensor::randn([3], rank as u64, oxiflow_tensor::DType::F64)
            .to_global(&placement, nd.clone())
            .unwrap();
        let b = Tensor::randn([3], rank as u64, oxiflow_tensor::DType::F32)
            .to_global(&placement, nd)
            .unwrap();
        let c = Tensor::randn(other.0.to_vec(), rank as u64, oxiflow_tensor::DType::F64)
            .to_global(&placement, other.1)
            .unwrap();
        (
            bucket(&[a.clone(), b]).unwrap_err().to_string(),
            bucket(&[a, c]).unwrap_err().to_string(),
        )
    })
}

/// The SBP of a bucket test's tensor on the mesh axis the bucket does not use.
pub fn other_axis_sbp() -> impl Strategy<Value = Sbp> {
    prop_oneof![
        Just(Sbp::B),
        Just(Sbp::S(0)),
        Just(Sbp::S(1)),
        Just(Sbp::Partial(ReduceOp::Sum))
    ]
}

/// A seed for `rank`'s piece of a tensor laid out `nd` on `placement`: ranks that differ only
/// on a B axis hold the same piece, so they get the same key.
pub fn piece_key(placement: &Placement, rank: usize, nd: &NdSbp) -> usize {
    let coord = placement.coord_of(rank).unwrap();
    coord
        .iter()
        .zip(nd.as_slice())
        .map(|(c, s)| if *s == Sbp::B { 0 } else { *c + 1 })
        .fold(0, |k, c| k * 10 + c)
}

/// The placement of a bucket case: mesh `shape` over ranks `0..world` in order.
pub fn bucket_placement(world: usize, shape: &[usize]) -> Placement {
    Placement::new(
        DeviceType::Cpu,
        shape.to_vec(),
        (0..world).collect::<Vec<_>>(),
    )
    .unwrap()
}

/// Tensor `i` (`rows x cols`, `other` on the mesh axes but `axis`, which is `on_axis`) of a
/// bucket case on `rank`: its nd-SBP, the rank's piece shape and a seed for that piece (the
/// same on ranks that hold the same piece).
pub fn bucket_piece(
    placement: &Placement,
    rank: usize,
    (axis, on_axis): (usize, Sbp),
    (rows, cols, other): (usize, usize, Sbp),
    i: usize,
) -> (NdSbp, Shape, u64) {
    let mut sbps = vec![other; placement.ndim()];
    sbps[axis] = on_axis;
    let nd = NdSbp::new(sbps);
    let layout = GlobalLayout::new([rows, cols], placement, nd.clone()).unwrap();
    let local = layout.local_shape(rank).unwrap();
    let key = piece_key(placement, rank, &nd);
    (nd, local, (key * 100 + i) as u64)
}

/// Asserts that each output of a bucket has its input's shape and dtype, and the input's
/// nd-SBP with `sbp` on mesh axis `axis`.
pub fn assert_bucket_layouts(out: &[Tensor], inputs: &[Tensor], axis: usize, sbp: Sbp) {
    for (o, t) in out.iter().zip(inputs) {
        let want = t.nd_sbp().unwrap().with_axis(axis, sbp);
        assert_eq!(o.nd_sbp(), Some(&want));
        assert_eq!(o.shape(), t.shape());
        assert_eq!(o.dtype(), t.dtype());
    }
}

/// Checks that a bucket's values (`bucket[tensor]`) equal those of each tensor boxed alone,
/// tensor by tensor, within `tol` times `max(|alone|, 1)`.
pub fn bucket_close(
    bucket: &[Vec<f64>],
    alone: &[Vec<f64>],
    tol: f64,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(bucket.len(), alone.len());
    for (b, a) in bucket.iter().zip(alone) {
        prop_assert_eq!(b.len(), a.len());
        for (x, y) in b.iter().zip(a) {
            prop_assert!((x - y).abs() <= tol * y.abs().max(1.0), "{:?} {:?}", b, a);
        }
    }
    Ok(())
}
