//! Generated fused element-wise kernels: CUDA C written from a [`FusedProgram`] (one statement
//! per step, on `elementwise_math.cuh`'s per-element functions, so each step computes what the
//! unfused kernel computes: 16-bit steps in f32 rounded to 16 bits, f64 steps in f64), compiled
//! by NVRTC through the on-disk kernel cache, which keys it by its source. A source depends on
//! the program, the dtypes and how each input is broadcast (same shape, trailing dims, or
//! strided), never on sizes, so groups with one program (repeated transformer blocks) share one
//! module; [`prebuild`] compiles the distinct sources of a compiled step on several threads.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::DeviceRepr;
use oxiflow_dtype::DType;

use super::kernels::grid;
use super::nvrtc_module::{launch_fn, Module};
use super::ops::elementwise::unary_code;
use super::raw::{invalid, FResult};
use super::CudaRuntime;
use oxiflow_tensor::custom::{
    Broadcast, FusedProgram, FusedStep, MAX_FUSED_INPUTS, MAX_FUSED_OUTPUTS,
};
use oxiflow_tensor::{BinaryOp, ScalarOp};

/// Most output dims a strided input handles.
pub(crate) const FUSED_MAXD: usize = 8;

/// The kernel's parameter block (`struct FusedArgs` in the generated source).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedArgs {
    pub n: i64,
    pub ndim: i32,
    pub pad: i32,
    pub dims: [i64; FUSED_MAXD],
    pub ptr: [u64; MAX_FUSED_INPUTS],
    pub repeat: [i64; MAX_FUSED_INPUTS],
    pub strides: [[i64; FUSED_MAXD]; MAX_FUSED_INPUTS],
    pub out: [u64; MAX_FUSED_OUTPUTS],
}
// SAFETY: plain old data with the C layout of `struct FusedArgs` in the generated source.
unsafe impl DeviceRepr for FusedArgs {}

const ARGS_DECL: &str = "
#define FUSED_MAXIN 16
#define FUSED_MAXD 8
#define FUSED_MAXOUT 4
struct FusedArgs {
    i64 n; int ndim; int pad;
    i64 dims[FUSED_MAXD];
    unsigned long long ptr[FUSED_MAXIN];
    i64 repeat[FUSED_MAXIN];
    i64 strides[FUSED_MAXIN][FUSED_MAXD];
    unsigned long long out[FUSED_MAXOUT];
};
// i % n, in 32 bits where both fit (a 64-bit remainder costs many instructions).
__device__ __forceinline__ i64 fused_mod(i64 i, i64 n) {
    return (i < 4294967296LL && n < 4294967296LL) ? (i64)((unsigned)i % (unsigned)n) : i % n;
}
// The element of strided input k that output element i reads.
__device__ __forceinline__ i64 fused_at(const FusedArgs& a, int k, i64 i) {
    i64 at = 0;
    for (int d = a.ndim - 1; d >= 0; --d) { at += fused_mod(i, a.dims[d]) * a.strides[k][d]; i /= a.dims[d]; }
    return at;
}
";

/// How output element `i` reads an input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Reach {
    /// Same shape: element `i`.
    Same,
    /// The output's trailing dims: element `i % repeat`.
    Repeat,
    /// One element for all.
    Scalar,
    /// Through per-dim strides over the output's dims.
    Strided,
}

/// How an input of `dims` broadcast to `out` is read, and its `repeat` count and strides;
/// None when it does not broadcast to `out`, or is strided over more than [`FUSED_MAXD`] dims.
pub(crate) fn reach(dims: &[usize], out: &[usize]) -> Option<(Reach, i64, [i64; FUSED_MAXD])> {
    let mut strides = [0i64; FUSED_MAXD];
    Some(match Broadcast::of(dims, out)? {
        Broadcast::Same => (Reach::Same, 0, strides),
        Broadcast::Scalar => (Reach::Scalar, 1, strides),
        Broadcast::Repeat(n) => (Reach::Repeat, n as i64, strides),
        Broadcast::Strided(s) if s.len() <= FUSED_MAXD => {
            for (d, &v) in s.iter().enumerate() {
                strides[d] = v as i64;
            }
            (Reach::Strided, 0, strides)
        }
        Broadcast::Strided(_) => return None,
    })
}

/// The C storage type of `dt` and the type it computes in.
fn types(dt: DType) -> (&'static str, &'static str) {
    match dt {
        DType::F64 => ("double", "double"),
        DType::BF16 => ("bf16", "float"),
        DType::F16 => ("f16", "float"),
        _ => ("float", "float"),
    }
}

/// `c` as a literal of compute type `ty`, bit for bit (`(C)c` as the scalar kernel converts).
fn literal(ty: &str, c: f64) -> String {
    if ty == "double" {
        format!("__longlong_as_double({:#018x}LL)", c.to_bits())
    } else {
        format!("__int_as_float({:#010x})", (c as f32).to_bits())
    }
}

/// The CUDA source of `program` with its inputs read as `reaches` say: one kernel
/// `fused_elementwise(FusedArgs)`.
pub(crate) fn source(program: &FusedProgram, reaches: &[Reach]) -> Result<String, String> {
    let mut s = String::from(concat!(
        include_str!("gelu.cuh"),
        include_str!("elementwise_math.cuh")
    ));
    s.push_str(ARGS_DECL);
    s.push_str("extern \"C\" __global__ void fused_elementwise(FusedArgs a) {\n");
    s.push_str("    GRID_LOOP(i, a.n) {\n");
    let v = |j: usize| format!("v{j}");
    for (j, ins) in program.instrs().iter().enumerate() {
        let (_, c) = types(ins.dtype);
        let expr = match ins.step {
            FusedStep::Input(k) => {
                let (st, _) = types(ins.dtype);
                let at = match reaches.get(k) {
                    Some(Reach::Same) => "i".to_string(),
                    Some(Reach::Repeat) => format!("fused_mod(i, a.repeat[{k}])"),
                    Some(Reach::Scalar) => "0".to_string(),
                    Some(Reach::Strided) => format!("fused_at(a, {k}, i)"),
                    None => return Err(format!("no way to read input {k}")),
                };
                format!("({c})((const {st}*)a.ptr[{k}])[{at}]")
            }
            FusedStep::Unary(u, a) => format!("un_f<{c}>({}, {})", unary_code(u), v(a)),
            FusedStep::UnaryBackward(u, g, x) => {
                format!("unb_f<{c}>({}, {}, {})", unary_code(u), v(g), v(x))
            }
            FusedStep::Scalar(op, k, a) => {
                let (x, k) = (v(a), literal(c, k.get()));
                match op {
                    ScalarOp::Add => format!("{x} + {k}"),
                    ScalarOp::Mul => format!("{x} * {k}"),
                    ScalarOp::RSub => format!("{k} - {x}"),
                    ScalarOp::RDiv => format!("{k} / {x}"),
                    ScalarOp::Pow => format!("m_pow({x}, {k})"),
                }
            }
            FusedStep::Binary(op, a, b) => {
                let sym = match op {
                    BinaryOp::Add => "+",
                    BinaryOp::Sub => "-",
                    BinaryOp::Mul => "*",
                    BinaryOp::Div => "/",
                };
                format!("{} {sym} {}", v(a), v(b))
            }
            FusedStep::Cast(a) => match ins.dtype {
                DType::BF16 | DType::F16 => format!("(float){}({})", types(ins.dtype).0, v(a)),
                _ => format!("({c}){}", v(a)),
            },
        };
        let _ = writeln!(s, "        {c} v{j} = {expr};");
        let rounds = !matches!(ins.step, FusedStep::Input(_) | FusedStep::Cast(_));
        if rounds && ins.dtype.is_half() {
            let _ = writeln!(s, "        v{j} = (float){}(v{j});", types(ins.dtype).0);
        }
    }
    for (m, &o) in program.outputs().iter().enumerate() {
        let (st, _) = types(program.instrs()[o].dtype);
        let _ = writeln!(s, "        (({st}*)a.out[{m}])[i] = ({st})v{o};");
    }
    s.push_str("    }\n}\n");
    Ok(s)
}

type Cell = Arc<OnceLock<Result<Module, String>>>;

/// The module cell of `source` (one per distinct source in this process).
fn cell(source: &str) -> Cell {
    static MODULES: OnceLock<Mutex<HashMap<String, Cell>>> = OnceLock::new();
    let map = MODULES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    map.entry(source.to_string()).or_default().clone()
}

/// The module cell of `program` read as `reaches` (its source generated once per process).
fn cell_for(program: &FusedProgram, reaches: &[Reach]) -> Result<Cell, String> {
    type Key = (FusedProgram, Vec<Reach>);
    static BY_PROGRAM: OnceLock<Mutex<HashMap<Key, Cell>>> = OnceLock::new();
    let map = BY_PROGRAM.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (program.clone(), reaches.to_vec());
    if let Some(c) = map.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(c.clone());
    }
    let c = cell(&source(program, reaches)?);
    map.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, c.clone());
    Ok(c)
}

/// Builds the module in `c` from `source` unless it is there; whether it compiled.
fn build(rt: &CudaRuntime, c: &Cell, source: &str) -> Result<(), String> {
    c.get_or_init(|| {
        let names = ["fused_elementwise".to_string()];
        Module::compile(rt.context(), "fused element-wise", source, &names)
    })
    .as_ref()
    .map(|_| ())
    .map_err(Clone::clone)
}

/// Compiles the kernel of every distinct `(program, reaches)` of `kernels` that this process
/// has not compiled yet, on up to eight threads; the first failure, if any. Returns the number
/// of distinct sources.
pub(crate) fn prebuild(
    rt: &CudaRuntime,
    kernels: &[(&FusedProgram, Vec<Reach>)],
) -> Result<usize, String> {
    let mut sources: Vec<String> = kernels
        .iter()
        .map(|(p, r)| source(p, r))
        .collect::<Result<_, _>>()?;
    sources.sort();
    sources.dedup();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
        .min(sources.len().max(1));
    let per = sources.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = sources
            .chunks(per)
            .map(|part| {
                scope.spawn(move || part.iter().try_for_each(|src| build(rt, &cell(src), src)))
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .map_err(|_| "a kernel build thread panicked".to_string())?
        })
    })?;
    Ok(sources.len())
}

/// Launches the kernel of `program` read as `reaches` with `args` (its pointers live device
/// allocations covering `args.n` output elements and each input's broadcast reads) on the
/// compute stream.
pub(crate) fn launch(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    program: &FusedProgram,
    reaches: &[Reach],
    args: FusedArgs,
) -> FResult<()> {
    if args.n == 0 {
        return Ok(());
    }
    let c = cell_for(program, reaches).map_err(|e| invalid(op, e))?;
    if c.get().is_none() {
        let src = source(program, reaches).map_err(|e| invalid(op, e))?;
        build(rt, &c, &src)
            .map_err(|e| invalid(op, format!("compiling the generated kernel: {e}")))?;
    }
    let Some(Ok(m)) = c.get() else {
        return Err(invalid(op, "the generated kernel did not compile"));
    };
    let f = m.get(op, "fused_elementwise")?;
    let cfg = grid(args.n as usize);
    launch_fn!(rt, op, f, cfg; args)
}

/// One fused call a compiled step will launch: its program, input shapes and output shape.
pub struct FusedCall<'a> {
    pub program: &'a FusedProgram,
    pub inputs: Vec<Vec<usize>>,
    pub out: Vec<usize>,
}

/// Generates and compiles (on several threads, through the kernel cache) the kernels of
/// `calls` on this process's CUDA device before their first launch; calls of one program and
/// broadcast pattern share one kernel. Returns the number of distinct kernels; an error names
/// the call that cannot run or the compile that failed.
pub fn prebuild_fused_elementwise(calls: &[FusedCall<'_>]) -> oxiflow_tensor::Result<usize> {
    let op = "fused_elementwise";
    let rt = super::runtime(op)?;
    let mut kernels = Vec::with_capacity(calls.len());
    for c in calls {
        let reaches = c
            .inputs
            .iter()
            .map(|d| reach(d, &c.out).map(|r| r.0))
            .collect::<Option<Vec<Reach>>>()
            .ok_or_else(|| {
                super::derr(
                    op,
                    format!("inputs {:?} do not broadcast to {:?}", c.inputs, c.out),
                )
            })?;
        kernels.push((c.program, reaches));
    }
    prebuild(&rt, &kernels).map_err(|e| super::derr(op, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxiflow_tensor::custom::FusedInstr;
    use oxiflow_tensor::{F64Bits, UnaryOp};

    fn program(dtype: DType) -> FusedProgram {
        let at = |step, dtype| FusedInstr { step, dtype };
        FusedProgram::new(vec![
            at(FusedStep::Input(0), dtype),
            at(FusedStep::Input(1), dtype),
            at(FusedStep::Binary(BinaryOp::Add, 0, 1), dtype),
            at(FusedStep::Unary(UnaryOp::Gelu, 2), dtype),
            at(
                FusedStep::Scalar(ScalarOp::Mul, F64Bits::new(0.1), 3),
                dtype,
            ),
            at(FusedStep::Cast(4), DType::F64),
        ])
        .unwrap()
    }

    #[test]
    fn reach_of_each_broadcast() {
        assert_eq!(reach(&[3, 4], &[3, 4]).unwrap().0, Reach::Same);
        assert_eq!(reach(&[4], &[3, 4]).unwrap().0, Reach::Repeat);
        assert_eq!(reach(&[1, 4], &[3, 4]).unwrap().1, 4);
        assert_eq!(reach(&[1], &[3, 4]).unwrap().0, Reach::Scalar);
        let (r, _, strides) = reach(&[3, 1], &[3, 4]).unwrap();
        assert_eq!((r, &strides[..2]), (Reach::Strided, &[1, 0][..]));
        assert!(reach(&[2, 4], &[3, 4]).is_none());
        assert!(reach(&[3, 4, 1], &[3, 4]).is_none());
    }

    #[test]
    fn sources_depend_on_program_dtypes_and_reaches_only() {
        let p = program(DType::BF16);
        let a = source(&p, &[Reach::Same, Reach::Repeat]).unwrap();
        assert_eq!(
            a,
            source(&program(DType::BF16), &[Reach::Same, Reach::Repeat]).unwrap()
        );
        assert_ne!(a, source(&p, &[Reach::Same, Reach::Strided]).unwrap());
        assert_ne!(
            a,
            source(&program(DType::F16), &[Reach::Same, Reach::Repeat]).unwrap()
        );
        // 16-bit loads, f32 math rounded to bf16 after each step, the scalar's f32 bits, an
        // exact f64 cast, an f64 store.
        assert!(
            a.contains("float v0 = (float)((const bf16*)a.ptr[0])[i];"),
            "{a}"
        );
        assert!(a.contains("float v1 = (float)((const bf16*)a.ptr[1])[fused_mod(i, a.repeat[1])];"));
        assert!(a.contains("float v3 = un_f<float>(2, v2);\n        v3 = (float)bf16(v3);"));
        let bits = format!("__int_as_float({:#010x})", 0.1f32.to_bits());
        assert!(a.contains(&format!("float v4 = v3 * {bits};")), "{a}");
        assert!(a.contains("double v5 = (double)v4;"));
        assert!(a.contains("((double*)a.out[0])[i] = (double)v5;"));
        assert!(source(&p, &[Reach::Same]).is_err());
        // More outputs: each stored from its step in its storage type.
        let instrs = p.instrs().to_vec();
        let two = FusedProgram::with_outputs(instrs, &[3]).unwrap();
        let b = source(&two, &[Reach::Same, Reach::Same]).unwrap();
        assert!(b.contains("((double*)a.out[0])[i] = (double)v5;"), "{b}");
        assert!(b.contains("((bf16*)a.out[1])[i] = (bf16)v3;"), "{b}");
    }
}
