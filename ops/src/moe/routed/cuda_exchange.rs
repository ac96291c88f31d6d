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

/// This call's rows on their way: where they go (`routes`, the send order in `list`), and the
/// moves of a `[rows, c]` buffer out to the experts' ranks and back.
struct Travel<'a> {
    b: &'a CudaKernels,
    name: &'static str,
    peers: &'a Peers,
    s: &'a Sizes,
    routes: Routes,
    list: &'a CudaStorage,
}

impl<'a> Travel<'a> {
    /// The exchange of a call whose rows go by the expert ids `ids`, its send list in `list`.
    fn new(
        b: &'a CudaKernels,
        (name, peers): (&'static str, &'a Peers),
        s: &'a Sizes,
        ids: &CudaStorage,
        list: &'a CudaStorage,
    ) -> Result<Travel<'a>> {
        let routes = routes(b, (name, peers), s, ids, list)?;
        Ok(Travel {
            b,
            name,
            peers,
            s,
            routes,
            list,
        })
    }

    fn row_bytes(&self) -> usize {
        self.s.c * self.s.elem() as usize
    }

    /// `from`'s rows in send order (through `staging`, `[m, c]`) to the experts' ranks: what
    /// this rank receives, `[rows in, c]`.
    fn out(&self, from: &CudaStorage, staging: &CudaStorage) -> Result<CudaStorage> {
        let (s, r) = (self.s, &self.routes);
        let list = (self.list.ptr(), s.m);
        move_rows(
            self.b.runtime(),
            self.name,
            true,
            (from.ptr(), staging.ptr()),
            list,
            self.row_bytes(),
        )?;
        let got = alloc(self.b, &[r.rows_in(), s.c], s.dtype)?;
        let at = (self.name, self.peers, s.dtype);
        exchange(
            self.b,
            at,
            (staging.ptr(), &r.sent),
            (got.ptr(), &r.received),
            s.c,
        )?;
        Ok(got)
    }

    /// `results` (one per received row) back to the rows' ranks (through `staging`) and into
    /// `to` in row order.
    fn back(&self, results: &CudaStorage, staging: &CudaStorage, to: &CudaStorage) -> Result<()> {
        let (s, r) = (self.s, &self.routes);
        let at = (self.name, self.peers, s.dtype);
        exchange(
            self.b,
            at,
            (results.ptr(), &r.received),
            (staging.ptr(), &r.sent),
            s.c,
        )?;
        let list = (self.list.ptr(), s.m);
        move_rows(
            self.b.runtime(),
            self.name,
            false,
            (staging.ptr(), to.ptr()),
            list,
            self.row_bytes(),
        )
    }

    /// The sizes of the received rows.
    fn here(&self) -> Sizes {
        Sizes {
            m: self.routes.rows_in(),
            ..*self.s
        }
    }

    /// Scratch `[rows in, width]` for each of `widths`, then the row list, as addresses.
    fn scratch<const N: usize>(
        &self,
        widths: [usize; N],
    ) -> Result<(Vec<CudaStorage>, [u64; N], u64)> {
        let bufs = buffers(self.b, self.routes.rows_in(), &widths, self.s.dtype)?;
        let ptrs = std::array::from_fn(|i| bufs[i].ptr());
        let list = bufs[N].ptr();
        Ok((bufs, ptrs, list))
    }
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
    let t = Travel::new(b, (name, peers), s, ids, list)?;
    let xr = t.out(x, xs)?;
    let here = t.here();
    let yr = alloc(b, &[here.m, s.c], s.dtype)?;
    if s.f == 0 || s.e == 0 {
        zero(b.runtime(), name, &yr)?;
    } else if here.m > 0 && s.c > 0 {
        let (_held, [a, b1, c, d], l) = t.scratch([s.c, s.f, s.f, s.c])?;
        let rows = (xr.ptr(), yr.ptr());
        forward_rows(
            b.runtime(),
            name,
            &here,
            &t.routes.grouped,
            rows,
            weights,
            [a, b1, c, d, l],
        )?;
    }
    t.back(&yr, ys, y)
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
    let t = Travel::new(b, (name, peers), s, ids, list)?;
    let (xr, dyr) = (t.out(x, xs)?, t.out(dy, dys)?);
    let here = t.here();
    let dxr = alloc(b, &[here.m, s.c], s.dtype)?;
    if s.f == 0 || s.e == 0 {
        zero(b.runtime(), name, &dxr)?;
    } else if here.m > 0 && s.c > 0 {
        let (_held, p, l) = t.scratch([s.c, s.c, s.f, s.f, s.f, s.c])?;
        let sc = [p[0], p[1], p[2], p[3], p[4], p[5], l];
        let rows = (xr.ptr(), dyr.ptr(), dxr.ptr());
        backward_rows(
            b.runtime(),
            name,
            &here,
            &t.routes.grouped,
            rows,
            (weights, grads),
            sc,
        )?;
    }
    t.back(&dxr, dxs, dx)
}
