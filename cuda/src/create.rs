//! Creation ops on the device: the `create` kernel fills a region of a tensor from the global
//! element index (full, arange, Philox uniform and normal), the values `creation.rs` computes
//! on the host, so large random tensors need no host generation and upload.

use std::sync::Arc;

use oxiflow_dtype::DType;
use oxiflow_sbp::{Region, Shape};

use super::copy::fill;
use super::kernels::{grid, launch, strides, Kernel, Nd, Template};
use super::storage::{download, CudaStorage};
use super::{derr, runtime, Block};
use oxiflow_tensor::rng::ElementInit;
use oxiflow_tensor::DeviceStorage;
use oxiflow_tensor::Result;

/// The elements of `region` of a tensor of `shape` (zeros with `zero`) from `init`.
pub(crate) fn create(
    init: ElementInit,
    dtype: DType,
    shape: &Shape,
    region: &Region,
    zero: bool,
) -> Result<Arc<dyn DeviceStorage>> {
    let op = "create";
    let rt = runtime(op)?;
    let extents: Vec<usize> = region.iter().map(|r| r.len()).collect();
    let out = CudaStorage::alloc(&rt, dtype, Shape::from(extents.as_slice()))?;
    let n = out.numel();
    if n == 0 {
        return Ok(Arc::new(out));
    }
    if zero {
        fill(&rt, op, dtype, out.ptr(), n, 0.0, 0)?;
        return Ok(Arc::new(out));
    }
    let global = shape.strides();
    let gst: Vec<i64> = global.iter().map(|&s| s as i64).collect();
    let base: i64 = region
        .iter()
        .zip(&gst)
        .map(|(r, &s)| r.start as i64 * s)
        .sum();
    // Dims contiguous both in the tensor and in the region collapse.
    let p = Nd::new(&extents, &gst, &strides(&extents))
        .ok_or_else(|| derr(op, format!("region {region:?} has too many dims")))?;
    let (kind, a, b, seed) = match init {
        ElementInit::Full(v) => (0i32, v, 0.0, 0u64),
        ElementInit::Arange { start, step } => (1, start, step, 0),
        ElementInit::Rand(seed) => (2, 0.0, 0.0, seed),
        ElementInit::Randn(seed) => (3, 0.0, 0.0, seed),
    };
    let (nn, k0, k1, y) = (n as i64, seed as u32, (seed >> 32) as u32, out.ptr());
    let name = Template::Create.at(dtype);
    launch!(rt, op, name, grid(n); nn, kind, a, b, k0, k1, base, p, y)?;
    Ok(Arc::new(out))
}

/// Philox4x32-10 words for counters `start..start + n` under `seed` (the device twin of
/// `rng::philox4x32_10` with counter `[i, i >> 32, 0, 0]` and key `[seed, seed >> 32]`).
pub fn philox_words_device(seed: u64, start: u64, n: usize) -> Result<Vec<[u32; 4]>> {
    let op = "philox";
    let rt = runtime(op)?;
    let blk = Block::alloc(&rt, n.max(1) * 16)?;
    let (nb, c0, c1, c2, c3) = (n as i64, start as u32, (start >> 32) as u32, 0u32, 0u32);
    let (k0, k1, out) = (seed as u32, (seed >> 32) as u32, blk.ptr());
    launch!(rt, op, Kernel::Philox, grid(n); nb, c0, c1, c2, c3, k0, k1, out)?;
    let mut host = vec![0u32; n * 4];
    download(&rt, blk.ptr(), &mut host, op)?;
    Ok(host.chunks(4).map(|c| [c[0], c[1], c[2], c[3]]).collect())
}
