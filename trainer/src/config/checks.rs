//! Checks of single values, shared by the command line's parsers (which parse text, then
//! check) and the configuration's resolution (which checks every value again, whatever set it:
//! a job file bypasses the command line's parsers).

use oxiflow_dtype::DType;

/// `v` where `ok`, else the error "`v` `what`".
fn accept<T: std::fmt::Display>(v: T, ok: bool, what: &str) -> Result<T, String> {
    if ok {
        Ok(v)
    } else {
        Err(format!("{v} {what}"))
    }
}

/// A count of at least 1.
pub fn positive(v: u64) -> Result<u64, String> {
    if v == 0 {
        return Err("must be at least 1".into());
    }
    Ok(v)
}

/// A finite number above 0.
pub fn positive_finite(v: f64) -> Result<f64, String> {
    accept(
        v,
        v.is_finite() && v > 0.0,
        "is not a finite number above 0",
    )
}

/// A finite number at least 0.
pub fn non_negative(v: f64) -> Result<f64, String> {
    accept(
        v,
        v.is_finite() && v >= 0.0,
        "is not a finite number at least 0",
    )
}

/// A finite number in [0, 1).
pub fn unit_fraction(v: f64) -> Result<f64, String> {
    accept(v, (0.0..1.0).contains(&v), "is not in [0, 1)")
}

/// A probability above 0, at most 1.
pub fn probability(v: f64) -> Result<f64, String> {
    accept(v, v > 0.0 && v <= 1.0, "is not in (0, 1]")
}

/// Prompts as token ids: `5,17,3`, several separated by `;`, none empty.
pub fn prompt_ids(text: &str) -> Result<Vec<Vec<usize>>, String> {
    text.split(';')
        .map(|p| {
            let ids = p
                .split(',')
                .map(|id| {
                    id.trim()
                        .parse::<usize>()
                        .map_err(|e| format!("{id:?} in {p:?} is not a token id: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            if ids.is_empty() {
                return Err(format!("an empty prompt in {text:?}"));
            }
            Ok(ids)
        })
        .collect()
}

/// At least 2 classes.
pub fn class_count(v: u64) -> Result<u64, String> {
    accept(v, v >= 2, "classes: a classifier needs at least 2")
}

/// The most tokens a generated sample may have: each is a forward pass over the window, so
/// a sample is a sample, not a corpus.
pub const MAX_GEN_TOKENS: u64 = 100_000;

/// A sample length of at most `MAX_GEN_TOKENS`.
pub fn gen_tokens(v: u64) -> Result<u64, String> {
    accept(
        v,
        v <= MAX_GEN_TOKENS,
        &format!("tokens is more than a sample's {MAX_GEN_TOKENS} (each token is a forward pass)"),
    )
}

/// The most untimed runs of a generation request before the timed one.
pub const MAX_GEN_WARMUP: u64 = 100;

/// A warm-up count of at most `MAX_GEN_WARMUP`.
pub fn gen_warmup(v: u64) -> Result<u64, String> {
    accept(
        v,
        v <= MAX_GEN_WARMUP,
        &format!("warm-up runs is more than {MAX_GEN_WARMUP} (each runs the whole request)"),
    )
}

/// A finite factor above 1.
pub fn spike_factor(v: f64) -> Result<f64, String> {
    accept(
        v,
        v.is_finite() && v > 1.0,
        "is not a finite factor above 1",
    )
}

/// A ZeRO stage.
pub fn zero_stage(v: u64) -> Result<u64, String> {
    if v > 3 {
        return Err(format!("ZeRO stage {v} is not 0, 1, 2 or 3"));
    }
    Ok(v)
}

/// A dtype master weights and data may have (f32 or f64).
pub fn param_dtype(d: DType) -> Result<DType, String> {
    match d {
        DType::F32 | DType::F64 => Ok(d),
        _ => Err(format!("{d} is not f32 or f64")),
    }
}

/// A float dtype (bf16, f16, f32, f64).
pub fn float_dtype(d: DType) -> Result<DType, String> {
    accept(
        d,
        d.is_float(),
        "is not a float dtype (bf16, f16, f32, f64)",
    )
}

/// Parsers of command-line text: parse, then the check above.
pub mod parse {
    use oxiflow_dtype::DType;

    fn dtype(s: &str) -> Result<DType, String> {
        s.parse::<DType>().map_err(|e| e.to_string())
    }
    /// A count a job file could also hold (TOML integers are i64).
    fn count(s: &str) -> Result<u64, String> {
        let v = s.parse::<u64>().map_err(|e| format!("not a count: {e}"))?;
        if v > i64::MAX as u64 {
            return Err(format!("{v} is out of range (at most {})", i64::MAX));
        }
        Ok(v)
    }
    fn number(s: &str) -> Result<f64, String> {
        s.parse::<f64>().map_err(|e| format!("not a number: {e}"))
    }
    fn same<T>(v: T) -> Result<T, String> {
        Ok(v)
    }
    fn to_usize(v: u64) -> Result<usize, String> {
        usize::try_from(v).map_err(|e| e.to_string())
    }
    fn to_u8(v: u64) -> Result<u8, String> {
        u8::try_from(v).map_err(|e| e.to_string())
    }
    /// `pub fn name(s: &str) -> Result<T, String>` for each `name: read, check, out -> T`:
    /// `read` the text, then `check` the value, then `out` converts it to `T`.
    macro_rules! parsers {
        ($($name:ident: $read:ident, $check:path, $out:ident -> $t:ty;)*) => {
            $(
                pub fn $name(s: &str) -> Result<$t, String> {
                    $out($check($read(s)?)?)
                }
            )*
        };
    }
    parsers! {
        positive_usize: count, super::positive, to_usize -> usize;
        positive_u64: count, super::positive, same -> u64;
        u64_any: count, same, same -> u64;
        usize_any: count, same, to_usize -> usize;
        positive_finite: number, super::positive_finite, same -> f64;
        non_negative: number, super::non_negative, same -> f64;
        unit_fraction: number, super::unit_fraction, same -> f64;
        class_count: count, super::class_count, to_usize -> usize;
        gen_tokens: count, super::gen_tokens, to_usize -> usize;
        gen_warmup: count, super::gen_warmup, to_usize -> usize;
        spike_factor: number, super::spike_factor, same -> f64;
        probability: number, super::probability, same -> f64;
        param_dtype: dtype, super::param_dtype, same -> DType;
        float_dtype: dtype, super::float_dtype, same -> DType;
        zero_stage: count, super::zero_stage, to_u8 -> u8;
    }
}
