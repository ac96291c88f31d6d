//! What the sections of the device check share: the report of checks and timings, the error
//! measure and tolerances, a deterministic generator of inputs, device buffers of encoded
//! values, and CUDA-event timing.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use oxiflow_cuda::kernel_layer::{download, upload, Block, FloatType};
use oxiflow_cuda::{device_error as derr, CudaRuntime};
use oxiflow_tensor::Result;

/// What a check or a timing measured: its name, dtype and shape.
pub(crate) struct Subject {
    pub(crate) name: String,
    pub(crate) dtype: String,
    pub(crate) shape: String,
}

impl Subject {
    fn new(name: &str, dtype: &str, shape: String) -> Subject {
        Subject {
            name: name.to_string(),
            dtype: dtype.to_string(),
            shape,
        }
    }
    /// The three in the console's columns.
    fn padded(&self) -> String {
        format!("{:<34} {:<5} {:<28}", self.name, self.dtype, self.shape)
    }
    /// The three as cells of a Markdown table row (without the outer bars).
    pub(crate) fn cells(&self) -> String {
        format!("{} | {} | {}", self.name, self.dtype, self.shape)
    }
}

/// A check's outcome.
pub(crate) struct Check {
    pub(crate) subject: Subject,
    pub(crate) err: f64,
    pub(crate) tol: f64,
    pub(crate) note: String,
}

impl Check {
    pub(crate) fn pass(&self) -> bool {
        self.err.is_finite() && self.err <= self.tol
    }
}

/// A timing's outcome.
pub(crate) struct Timing {
    pub(crate) subject: Subject,
    pub(crate) ms: f64,
    pub(crate) rate: f64,
    pub(crate) unit: &'static str,
    pub(crate) ceiling: String,
}

/// Results collected by the sections.
#[derive(Default)]
pub(crate) struct Report {
    pub(crate) checks: Vec<Check>,
    pub(crate) timings: Vec<Timing>,
    pub(crate) notes: Vec<String>,
}

impl Report {
    /// A check at the tolerance of `dtype`.
    pub(crate) fn check(
        &mut self,
        name: &str,
        dtype: FloatType,
        shape: String,
        err: f64,
        note: impl Into<String>,
    ) {
        self.check_tol(name, dtype.suffix(), shape, (err, tolerance(dtype)), note);
    }
    /// A check of f32 results computed from inputs of type `input` (noted as such).
    pub(crate) fn check_f32_from(&mut self, name: &str, input: FloatType, shape: String, err: f64) {
        let note = format!("{} in", input.suffix());
        self.check(name, FloatType::F32, shape, err, note);
    }
    /// A check with its own tolerance (exact comparisons use 0): `(error, tolerance)`.
    pub(crate) fn check_tol(
        &mut self,
        name: &str,
        dtype: &str,
        shape: String,
        (err, tol): (f64, f64),
        note: impl Into<String>,
    ) {
        let c = Check {
            subject: Subject::new(name, dtype, shape),
            err,
            tol,
            note: note.into(),
        };
        println!(
            "check {} err {:.3e} tol {:.0e} {} {}",
            c.subject.padded(),
            c.err,
            c.tol,
            if c.pass() { "PASS" } else { "FAIL" },
            c.note
        );
        self.checks.push(c);
    }
    pub(crate) fn fail(&mut self, name: &str, dtype: &str, shape: String, why: String) {
        self.check_tol(name, dtype, shape, (f64::NAN, 0.0), why);
    }
    pub(crate) fn time(
        &mut self,
        name: &str,
        dtype: &str,
        shape: String,
        ms: f64,
        (work, unit): (f64, &'static str),
        ceiling: String,
    ) {
        let div = if unit == "GB/s" { 1e9 } else { 1e12 };
        let rate = work / (ms * 1e-3) / div;
        let subject = Subject::new(name, dtype, shape);
        let columns = subject.padded();
        println!("time  {columns} {ms:.4} ms {rate:.1} {unit} (ceiling {ceiling})");
        self.timings.push(Timing {
            subject,
            ms,
            rate,
            unit,
            ceiling,
        });
    }
}

/// ‖out − ref‖ / ‖ref‖ tolerance of a precision (METHOD.md: f32 far under 1e-3, 16-bit
/// operands between 1e-3 and 1e-2).
pub(crate) fn tolerance(t: FloatType) -> f64 {
    match t {
        FloatType::F32 => 1e-4,
        FloatType::F16 => 5e-3,
        FloatType::Bf16 => 1e-2,
    }
}

/// ‖out − ref‖ / ‖ref‖ (NaN when any output is NaN or the lengths differ).
pub(crate) fn rel_err(out: &[f64], reference: &[f64]) -> f64 {
    if out.len() != reference.len() || out.iter().any(|x| !x.is_finite()) {
        return f64::NAN;
    }
    let (mut num, mut den) = (0.0, 0.0);
    for (o, r) in out.iter().zip(reference) {
        num += (o - r) * (o - r);
        den += r * r;
    }
    (num / den.max(1e-300)).sqrt()
}

/// A deterministic generator of never-zero values (splitmix64).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// `n` values of magnitude in [0.1, 1] * scale with random signs.
    pub(crate) fn vals(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                let m = 0.1 + 0.9 * self.unit();
                if self.next() & 1 == 0 {
                    m * scale
                } else {
                    -m * scale
                }
            })
            .collect()
    }
}

/// Rounds `v` to `t` and returns (bytes, the rounded values).
pub(crate) fn encode(t: FloatType, v: &[f64]) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::with_capacity(v.len() * t.size());
    let mut rounded = Vec::with_capacity(v.len());
    for &x in v {
        match t {
            FloatType::F32 => {
                let f = x as f32;
                bytes.extend_from_slice(&f.to_le_bytes());
                rounded.push(f as f64);
            }
            FloatType::Bf16 => {
                // Through f32, as the device rounds.
                let h = half::bf16::from_f32(x as f32);
                bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                rounded.push(h.to_f64());
            }
            FloatType::F16 => {
                let h = half::f16::from_f32(x as f32);
                bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                rounded.push(h.to_f64());
            }
        }
    }
    (bytes, rounded)
}

pub(crate) fn decode(t: FloatType, b: &[u8]) -> Vec<f64> {
    match t {
        FloatType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        FloatType::Bf16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
            .collect(),
        FloatType::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
            .collect(),
    }
}

/// A device buffer of the check.
pub(crate) struct Buf {
    pub(crate) block: Block,
    pub(crate) bytes: usize,
}

impl Buf {
    pub(crate) fn new(rt: &Arc<CudaRuntime>, bytes: usize) -> Result<Buf> {
        Ok(Buf {
            block: Block::alloc(rt, bytes.max(16))?,
            bytes,
        })
    }
    pub(crate) fn from(rt: &Arc<CudaRuntime>, data: &[u8]) -> Result<Buf> {
        let b = Buf::new(rt, data.len())?;
        upload(rt, b.ptr(), data, "kernel check")?;
        Ok(b)
    }
    /// Values of `t` rounded from `v`, uploaded; returns the buffer and the rounded values.
    pub(crate) fn vals(rt: &Arc<CudaRuntime>, t: FloatType, v: &[f64]) -> Result<(Buf, Vec<f64>)> {
        let (bytes, r) = encode(t, v);
        Ok((Buf::from(rt, &bytes)?, r))
    }
    /// `n` values of `t`: `pattern` (rounded) repeated (for timing inputs too large to draw).
    pub(crate) fn repeat(
        rt: &Arc<CudaRuntime>,
        t: FloatType,
        pattern: &[f64],
        n: usize,
    ) -> Result<Buf> {
        let (one, _) = encode(t, pattern);
        let total = n * t.size();
        let bytes: Vec<u8> = one.iter().copied().cycle().take(total).collect();
        Buf::from(rt, &bytes)
    }
    pub(crate) fn ptr(&self) -> u64 {
        self.block.ptr()
    }
    /// Fills every byte with 0xFF (NaN in f32, bf16 and f16).
    pub(crate) fn poison(&self, rt: &Arc<CudaRuntime>) -> Result<()> {
        rt.bind("kernel check")?;
        // SAFETY: the block holds at least `bytes` bytes; the memset is stream-ordered.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.ptr(),
                0xFF,
                self.bytes,
                rt.stream().cu_stream(),
            )
        }
        .map_err(|e| derr("kernel check", e))
    }
    pub(crate) fn read(&self, rt: &Arc<CudaRuntime>, t: FloatType) -> Result<Vec<f64>> {
        let mut b = vec![0u8; self.bytes];
        download(rt, self.ptr(), &mut b, "kernel check")?;
        Ok(decode(t, &b))
    }
    pub(crate) fn read_bytes(&self, rt: &Arc<CudaRuntime>) -> Result<Vec<u8>> {
        let mut b = vec![0u8; self.bytes];
        download(rt, self.ptr(), &mut b, "kernel check")?;
        Ok(b)
    }
}

/// Median milliseconds of `repeats` runs of `f(i)` (after 3 warm-up runs), each between two
/// CUDA events on the compute stream.
pub(crate) fn time_ms(
    rt: &Arc<CudaRuntime>,
    repeats: usize,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let op = "kernel check timing";
    for i in 0..3 {
        f(i)?;
    }
    rt.synchronize()?;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut ms = Vec::with_capacity(repeats);
    for i in 0..repeats.max(1) {
        let (a, b) = (
            rt.context().new_event(flags).map_err(|e| derr(op, e))?,
            rt.context().new_event(flags).map_err(|e| derr(op, e))?,
        );
        a.record(rt.stream()).map_err(|e| derr(op, e))?;
        f(i)?;
        b.record(rt.stream()).map_err(|e| derr(op, e))?;
        b.synchronize().map_err(|e| derr(op, e))?;
        ms.push(a.elapsed_ms(&b).map_err(|e| derr(op, e))? as f64);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// How the timings run: the repeats of each measurement, and the measured ceilings (copy
/// bandwidth in GB/s, bf16 matmul TFLOP/s) their rows are set beside.
pub(crate) struct TimingRun {
    pub(crate) repeats: usize,
    pub(crate) bw: f64,
    pub(crate) mm: f64,
}
