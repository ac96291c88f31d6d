//! The rows' exchange around the experts' CUDA compute where a mesh axis splits the experts
//! (expert parallelism): each rank reads its rows' expert ids back, orders its rows by the
//! member holding their expert, and the members exchange their row counts, then the rows' ids
//! and the rows (each an all-to-all-v over NCCL among the axis's ranks); each runs its own
//! experts on the rows it received (`cuda_rows`) and sends the results (backward: the rows'
//! gradients, beside its experts' weight gradients) back by the reverse all-to-all-v, to be
//! scattered into row order. A rank may send or receive no rows and hold experts no row
//! reaches. What a rank receives is sized by the routing: those buffers come from the
//! backend's allocator once the counts are known. Reading the routing back is what a device
//! graph cannot replay: under a capture it is a typed error, as on the local path.

use oxiflow_collectives::DevicePtr;
use oxiflow_cuda::kernel_layer::{download, upload};
use oxiflow_cuda::{device_error, CudaKernels, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use oxiflow_tensor::{KernelBackend, OutSpec, Peers, Result};

use super::super::cuda::{grouped_host, ids_on_host, move_rows, zero};
use super::cuda_rows::{backward_rows, forward_rows, Sizes, Weights};

/// Where this rank's rows go and what comes to it: rows sent to and received from each member,
/// and the received rows grouped by this rank's experts (row list, rows per expert).
struct Routes {
    sent: Vec<usize>,
    received: Vec<usize>,
    grouped: (Vec<i32>, Vec<usize>),
}

impl Routes {
    fn rows_in(&self) -> usize {
        self.received.iter().sum()
    }
}

fn alloc(b: &CudaKernels, shape: &[usize], dtype: DType) -> Result<CudaStorage> {
    b.alloc(&OutSpec {
        shape: Shape::from(shape),
        dtype,
    })
}

/// `values` into `to` (nothing when empty).
fn put<T: cudarc::driver::DeviceRepr + Copy>(
    b: &CudaKernels,
    name: &'static str,
    to: &CudaStorage,
    values: &[T],
) -> Result<()> {
    if values.is_empty() {
        return Ok(());
    }
    upload(b.runtime(), to.ptr(), values, name)
}

/// `n` i64 values of `from` read back.
fn get(b: &CudaKernels, name: &'static str, from: &CudaStorage, n: usize) -> Result<Vec<i64>> {
    let mut out = vec![0i64; n];
    if n > 0 {
        download(b.runtime(), from.ptr(), &mut out, name)?;
    }
    Ok(out)
}

/// Sends `sent[j] * width` elements of `dtype` at `send` to member j and receives
/// `received[i] * width` from member i at `recv`.
fn exchange(
    b: &CudaKernels,
    (name, peers, dtype): (&'static str, &Peers, DType),
    (send, sent): (u64, &[usize]),
    (recv, received): (u64, &[usize]),
    width: usize,
) -> Result<()> {
    let scaled = |c: &[usize]| c.iter().map(|&n| n * width).collect::<Vec<_>>();
    let (sc, rc) = (scaled(sent), scaled(received));
    let bytes = |c: &[usize]| c.iter().sum::<usize>() * dtype.size();
    let dev = b.runtime().ordinal();
    // SAFETY: `send` and `recv` are device buffers of this call (its inputs and outputs, the
    // executor's scratch, or allocations it holds until it returns) sized from these counts;
    // the exchange is unfenced, so the compute stream waits for its end before any later
    // kernel reads or frees them.
    let (s, r) = unsafe {
        (
            DevicePtr::new(send, bytes(&sc), dev),
            DevicePtr::new(recv, bytes(&rc), dev),
        )
    };
    peers.all_to_all_v_device(name, dtype, (s, &sc), (r, &rc))
}

/// Reads the routing back, writes this rank's send order into `list` (i32 row indices) and
/// exchanges the counts and the rows' expert ids.
fn routes(
    b: &CudaKernels,
    (name, peers): (&'static str, &Peers),
    s: &Sizes,
    ids: &CudaStorage,
    list: &CudaStorage,
) -> Result<Routes> {
    let host = ids_on_host(b.runtime(), name, ids)?;
    let regions = peers.regions();
    let experts = regions.last().map_or(0, |r| r.end);
    let member_of = |m: usize, e: i64| {
        usize::try_from(e)
            .ok()
            .and_then(|e| regions.iter().position(|r| r.contains(&e)))
            .ok_or_else(|| {
                device_error(
                    name,
                    format!("row {m} is routed to expert {e} of {experts}"),
                )
            })
    };
    let dest = host
        .iter()
        .enumerate()
        .map(|(m, &e)| member_of(m, e))
        .collect::<Result<Vec<usize>>>()?;
    let n = peers.len();
    let mut sent = vec![0usize; n];
    dest.iter().for_each(|&d| sent[d] += 1);
    let mut order: Vec<usize> = (0..host.len()).collect();
    order.sort_by_key(|&m| dest[m]);
    let order32 = order
        .iter()
        .map(|&m| i32::try_from(m))
        .collect::<std::result::Result<Vec<i32>, _>>()
        .map_err(|_| device_error(name, format!("{} rows exceed i32 indices", host.len())))?;
    put(b, name, list, &order32)?;
    let (out, inn) = (alloc(b, &[n], DType::I64)?, alloc(b, &[n], DType::I64)?);
    put(
        b,
        name,
        &out,
        &sent.iter().map(|&c| c as i64).collect::<Vec<_>>(),
    )?;
    let ones = vec![1; n];
    let at = (name, peers, DType::I64);
    exchange(b, at, (out.ptr(), &ones), (inn.ptr(), &ones), 1)?;
    let received = get(b, name, &inn, n)?
        .into_iter()
        .map(|c| {
            usize::try_from(c).map_err(|_| device_error(name, format!("a member sends {c} rows")))
        })
        .collect::<Result<Vec<usize>>>()?;
    let rows_in: usize = received.iter().sum();
    let (ids_out, ids_in) = (
        alloc(b, &[host.len()], DType::I64)?,
        alloc(b, &[rows_in], DType::I64)?,
    );
    put(
        b,
        name,
        &ids_out,
        &order.iter().map(|&m| host[m]).collect::<Vec<_>>(),
    )?;
    exchange(b, at, (ids_out.ptr(), &sent), (ids_in.ptr(), &received), 1)?;
    let first = regions[peers.me()].start as i64;
    let local: Vec<i64> = get(b, name, &ids_in, rows_in)?
        .into_iter()
        .map(|e| e - first)
        .collect();
    Ok(Routes {
        grouped: grouped_host(name, &local, s.e)?,
        sent,
        received,
    })
}

/// Buffers `[rows, width]` of `dtype` for each width of `widths`, then the row list of `rows`.
fn buffers(
    b: &CudaKernels,
    rows: usize,
    widths: &[usize],
    dtype: DType,
) -> Result<Vec<CudaStorage>> {
    let mut out = widths
        .iter()
        .map(|&w| alloc(b, &[rows, w], dtype))
        .collect::<Result<Vec<_>>>()?;
    out.push(alloc(b, &[rows.div_ceil(2)], DType::I64)?);
    Ok(out)
}

/// The forward where the rows travel: `x`'s rows (routed by `ids`) to their experts' ranks and
/// the results back into `y`, on scratch `[xs, ys, list]` (rows and results in send order,
/// the send list).
pub(super) fn forward_exchanged(
    b: &CudaKernels,
    name: &'static str,
    s: &Sizes,
    peers: &Peers,
    (x, ids, y): (&CudaStorage, &CudaStorage, &CudaStorage),
    weights: Weights,
    [xs, ys, list]: [&CudaStorage; 3],
) -> Result<()> {
    let rt = b.runtime();
    let r = routes(b, (name, peers), s, ids, list)?;
    let row_bytes = s.c * s.elem() as usize;
    move_rows(
        rt,
        name,
        true,
        (x.ptr(), xs.ptr()),
        (list.ptr(), s.m),
        row_bytes,
    )?;
    let rows_in = r.rows_in();
    let (xr, yr) = (
        alloc(b, &[rows_in, s.c], s.dtype)?,
        alloc(b, &[rows_in, s.c], s.dtype)?,
    );
    let at = (name, peers, s.dtype);
    exchange(b, at, (xs.ptr(), &r.sent), (xr.ptr(), &r.received), s.c)?;
    let here = Sizes { m: rows_in, ..*s };
    if s.f == 0 || s.e == 0 {
        zero(rt, name, &yr)?;
    } else if rows_in > 0 && s.c > 0 {
        let sc = buffers(b, rows_in, &[s.c, s.f, s.f, s.c], s.dtype)?;
        let p: Vec<u64> = sc.iter().map(CudaStorage::ptr).collect();
        let sc = [p[0], p[1], p[2], p[3], p[4]];
        forward_rows(
            rt,
            name,
            &here,
            &r.grouped,
            (xr.ptr(), yr.ptr()),
            weights,
            sc,
        )?;
    }
    exchange(b, at, (yr.ptr(), &r.received), (ys.ptr(), &r.sent), s.c)?;
    move_rows(
        rt,
        name,
        false,
        (ys.ptr(), y.ptr()),
        (list.ptr(), s.m),
        row_bytes,
    )
}

/// The backward where the rows travel: rows and output gradients to their experts' ranks, the
/// rows' gradients back into `dx` and the weight gradients (zeroed by the caller) of this
/// rank's experts into `grads`, on scratch `[xs, dys, dxs, list]` in send order.
pub(super) fn backward_exchanged(
    b: &CudaKernels,
    name: &'static str,
    s: &Sizes,
    peers: &Peers,
    (x, dy, ids, dx): (&CudaStorage, &CudaStorage, &CudaStorage, &CudaStorage),
    (weights, grads): (Weights, Weights),
    [xs, dys, dxs, list]: [&CudaStorage; 4],
) -> Result<()> {
    let rt = b.runtime();
    let r = routes(b, (name, peers), s, ids, list)?;
    let row_bytes = s.c * s.elem() as usize;
    for (from, to) in [(x, xs), (dy, dys)] {
        move_rows(
            rt,
            name,
            true,
            (from.ptr(), to.ptr()),
            (list.ptr(), s.m),
            row_bytes,
        )?;
    }
    let rows_in = r.rows_in();
    let at = (name, peers, s.dtype);
    let [xr, dyr, dxr] = [(); 3].map(|_| alloc(b, &[rows_in, s.c], s.dtype));
    let (xr, dyr, dxr) = (xr?, dyr?, dxr?);
    exchange(b, at, (xs.ptr(), &r.sent), (xr.ptr(), &r.received), s.c)?;
    exchange(b, at, (dys.ptr(), &r.sent), (dyr.ptr(), &r.received), s.c)?;
    let here = Sizes { m: rows_in, ..*s };
    if s.f == 0 || s.e == 0 {
        zero(rt, name, &dxr)?;
    } else if rows_in > 0 && s.c > 0 {
        let sc = buffers(b, rows_in, &[s.c, s.c, s.f, s.f, s.f, s.c], s.dtype)?;
        let p: Vec<u64> = sc.iter().map(CudaStorage::ptr).collect();
        let sc = [p[0], p[1], p[2], p[3], p[4], p[5], p[6]];
        let rows = (xr.ptr(), dyr.ptr(), dxr.ptr());
        backward_rows(rt, name, &here, &r.grouped, rows, (weights, grads), sc)?;
    }
    exchange(b, at, (dxr.ptr(), &r.received), (dxs.ptr(), &r.sent), s.c)?;
    move_rows(
        rt,
        name,
        false,
        (dxs.ptr(), dx.ptr()),
        (list.ptr(), s.m),
        row_bytes,
    )
}
