//! Checks of the conversion and fill kernels, which move a 16-byte pack a thread where their
//! pointers are aligned and value by value elsewhere: every float pair converted at lengths
//! around the pack widths and at element offsets that misalign either side, bit for bit the
//! host's rounding, nothing written outside the range; fills likewise. Then their bandwidth on
//! the GPT-2 124M embedding's 50304 x 768 elements.

use std::sync::Arc;

use crate::harness::{decode, encode, time_ms, Buf, Report, Rng, TimingRun};
use oxiflow_cuda::kernel_layer::{cast, fill, FloatType};
use oxiflow_cuda::CudaRuntime;
use oxiflow_tensor::Result;

/// Lengths below, at and past the packs of 4 and 8 values, and a long odd one.
const LENGTHS: [usize; 11] = [1, 3, 4, 5, 7, 8, 9, 16, 17, 1000, 65_541];
/// Element offsets of the input and of the output (both aligned, either misaligned).
const OFFSETS: [(usize, usize); 4] = [(0, 0), (1, 0), (0, 3), (5, 1)];

/// Bytes of the output buffer that differ from what is expected: the `n` converted values at
/// element `at` and the poison (0xFF) everywhere else.
fn mismatches(got: &[u8], want: &[u8], at: usize) -> usize {
    got.iter()
        .enumerate()
        .filter(|&(i, &b)| {
            let inside = i >= at && i < at + want.len();
            b != if inside { want[i - at] } else { 0xFF }
        })
        .count()
}

pub(super) fn checks(rt: &Arc<CudaRuntime>, rep: &mut Report) -> Result<()> {
    let mut rng = Rng(900);
    for from in FloatType::ALL {
        for to in FloatType::ALL.into_iter().filter(|&t| t != from) {
            let (mut bad, mut cases) = (0, 0);
            for n in LENGTHS {
                for (xo, yo) in OFFSETS {
                    let scale = [1e-3, 1.0, 1e3][cases % 3];
                    let (bytes, rounded) = encode(from, &rng.vals(xo + n, scale));
                    let x = Buf::from(rt, &bytes)?;
                    let y = Buf::new(rt, (yo + n + 2) * to.size())?;
                    y.poison(rt)?;
                    cast(
                        rt,
                        "cast check",
                        (from.dtype(), x.ptr() + (xo * from.size()) as u64),
                        (to.dtype(), y.ptr() + (yo * to.size()) as u64),
                        n,
                    )?;
                    // The host's rounding of the exact values (each within f32), once to
                    // nearest even as the device rounds.
                    let want = encode(to, &rounded[xo..]).0;
                    bad += mismatches(&y.read_bytes(rt)?, &want, yo * to.size());
                    cases += 1;
                }
            }
            rep.check_tol(
                &format!("cast {} -> {}", from.suffix(), to.suffix()),
                to.suffix(),
                format!("{cases} lengths x offsets"),
                (bad as f64, 0.0),
                "bytes differing from the host's rounding or written outside",
            );
        }
    }
    for t in FloatType::ALL {
        let (mut bad, mut cases) = (0, 0);
        for n in LENGTHS {
            for (_, yo) in OFFSETS {
                let y = Buf::new(rt, (yo + n + 2) * t.size())?;
                y.poison(rt)?;
                let v = -0.375 - n as f64;
                fill(
                    rt,
                    "fill check",
                    t.dtype(),
                    y.ptr() + (yo * t.size()) as u64,
                    n,
                    v,
                    0,
                )?;
                let want = encode(t, &vec![v; n]).0;
                let got = y.read_bytes(rt)?;
                bad += mismatches(&got, &want, yo * t.size());
                // The values read back are the fill value (the bytes decode to it).
                let vals = decode(t, &got[yo * t.size()..(yo + n) * t.size()]);
                bad += vals.iter().filter(|&&x| x != encode(t, &[v]).1[0]).count();
                cases += 1;
            }
        }
        rep.check_tol(
            &format!("fill {}", t.suffix()),
            t.suffix(),
            format!("{cases} lengths x offsets"),
            (bad as f64, 0.0),
            "bytes differing from the value or written outside",
        );
    }
    Ok(())
}

pub(super) fn timings(rt: &Arc<CudaRuntime>, rep: &mut Report, run: &TimingRun) -> Result<()> {
    let bw = format!("{:.0} GB/s copy", run.bw);
    let n = 50_304 * 768;
    let pattern = Rng(901).vals(4096, 1.0);
    for (from, to) in [
        (FloatType::Bf16, FloatType::F32),
        (FloatType::F32, FloatType::Bf16),
    ] {
        let x = Buf::repeat(rt, from, &pattern, n)?;
        let y = Buf::new(rt, n * to.size())?;
        let ms = time_ms(rt, run.repeats, |_| {
            cast(
                rt,
                "cast timing",
                (from.dtype(), x.ptr()),
                (to.dtype(), y.ptr()),
                n,
            )
        })?;
        rep.time(
            &format!("cast {} -> {}", from.suffix(), to.suffix()),
            to.suffix(),
            format!("{n}"),
            ms,
            ((n * (from.size() + to.size())) as f64, "GB/s"),
            bw.clone(),
        );
    }
    let y = Buf::new(rt, n * 4)?;
    let ms = time_ms(rt, run.repeats, |_| {
        fill(
            rt,
            "fill timing",
            FloatType::F32.dtype(),
            y.ptr(),
            n,
            0.0,
            0,
        )
    })?;
    rep.time(
        "fill",
        "f32",
        format!("{n}"),
        ms,
        ((n * 4) as f64, "GB/s"),
        bw,
    );
    Ok(())
}
