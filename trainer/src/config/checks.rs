//! Checks of single values, shared by the command line's parsers (which parse text, then
//! check) and the configuration's resolution (which checks every value again, whatever set it:
//! a job file bypasses the command line's parsers).

use oxiflow_dtype::DType;

/// A count of at least 1.
pub fn positive(v: u64) -> Result<u64, String> {
    if v == 0 {
        return Err("must be at least 1".into());
    }
    Ok(v)
}

/// A finite number above 0.
pub fn positive_finite(v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("{v} is not a finite number above 0"))
    }
}

/// A finite number at least 0.
pub fn non_negative(v: f64) -> Result<f64, String> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("{v} is not a finite number at least 0"))
    }
}

/// A finite number in [0, 1).
pub fn unit_fraction(v: f64) -> Result<f64, String> {
    if (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not in [0, 1)"))
    }
}

/// A probability above 0, at most 1.
pub fn probability(v: f64) -> Result<f64, String> {
    if v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("{v} is not in (0, 1]"))
    }
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
    if v < 2 {
        return Err(format!("{v} classes: a classifier needs at least 2"));
    }
    Ok(v)
}

/// The most tokens a generated sample may have: each is a forward pass over the window, so
/// a sample is a sample, not a corpus.
pub const MAX_GEN_TOKENS: u64 = 100_000;

/// A sample length of at most `MAX_GEN_TOKENS`.
pub fn gen_tokens(v: u64) -> Result<u64, String> {
    if v > MAX_GEN_TOKENS {
        return Err(format!(
            "{v} tokens is more than a sample's {MAX_GEN_TOKENS} (each token is a forward pass)"
        ));
    }
    Ok(v)
}

/// The most untimed runs of a generation request before the timed one.
pub const MAX_GEN_WARMUP: u64 = 100;

/// A warm-up count of at most `MAX_GEN_WARMUP`.
pub fn gen_warmup(v: u64) -> Result<u64, String> {
    if v > MAX_GEN_WARMUP {
        return Err(format!(
            "{v} warm-up runs is more than {MAX_GEN_WARMUP} (each runs the whole request)"
        ));
    }
    Ok(v)
}

/// A finite factor above 1.
pub fn spike_factor(v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 1.0 {
        Ok(v)
    } else {
        Err(format!("{v} is not a finite factor above 1"))
    }
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
    if d.is_float() {
        Ok(d)
    } else {
        Err(format!("{d} is not a float dtype (bf16, f16, f32, f64)"))
    }
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
    pub fn positive_usize(s: &str) -> Result<usize, String> {
        let v = super::positive(count(s)?)?;
        usize::try_from(v).map_err(|e| e.to_string())
    }
    pub fn positive_u64(s: &str) -> Result<u64, String> {
        super::positive(count(s)?)
    }
    pub fn u64_any(s: &str) -> Result<u64, String> {
        count(s)
    }
    pub fn usize_any(s: &str) -> Result<usize, String> {
        usize::try_from(count(s)?).map_err(|e| e.to_string())
    }
    pub fn positive_finite(s: &str) -> Result<f64, String> {
        super::positive_finite(number(s)?)
    }
    pub fn non_negative(s: &str) -> Result<f64, String> {
        super::non_negative(number(s)?)
    }
    pub fn unit_fraction(s: &str) -> Result<f64, String> {
        super::unit_fraction(number(s)?)
    }
    pub fn class_count(s: &str) -> Result<usize, String> {
        let v = super::class_count(count(s)?)?;
        usize::try_from(v).map_err(|e| e.to_string())
    }
    pub fn gen_tokens(s: &str) -> Result<usize, String> {
        let v = super::gen_tokens(count(s)?)?;
        usize::try_from(v).map_err(|e| e.to_string())
    }
    pub fn gen_warmup(s: &str) -> Result<usize, String> {
        let v = super::gen_warmup(count(s)?)?;
        usize::try_from(v).map_err(|e| e.to_string())
    }
    pub fn spike_factor(s: &str) -> Result<f64, String> {
        super::spike_factor(number(s)?)
    }
    pub fn probability(s: &str) -> Result<f64, String> {
        super::probability(number(s)?)
    }
    pub fn param_dtype(s: &str) -> Result<DType, String> {
        super::param_dtype(dtype(s)?)
    }
    pub fn float_dtype(s: &str) -> Result<DType, String> {
        super::float_dtype(dtype(s)?)
    }
    pub fn zero_stage(s: &str) -> Result<u8, String> {
        let v = super::zero_stage(count(s)?)?;
        u8::try_from(v).map_err(|e| e.to_string())
    }
}
