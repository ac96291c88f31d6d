//! `Pass`: whether a forward pass trains (and on which part of which step's batch) or
//! evaluates; models key their dropout masks by it.

/// Whether a forward pass trains (dropout on, masks keyed by the step) or evaluates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Train {
        step: u64,
    },
    /// Training on micro-batch `index` of `count`, the rows `[index b, (index + 1) b)` of the
    /// step's batch (b the micro-batch size): its dropout masks are those rows of the whole
    /// batch's, so gradient accumulation over micro-batches equals one full-batch step.
    TrainMicro {
        step: u64,
        index: usize,
        count: usize,
    },
    Eval,
}

impl Pass {
    /// The pass of micro-batch `index` of `count` of a step: `Train` for a whole batch, else
    /// `TrainMicro` (evaluation stays `Eval`). A `TrainMicro` pass splits its own part further:
    /// micro-batch `index` of `count` inside part `i` of `n` is part `i count + index` of
    /// `n count`.
    pub fn micro(self, index: usize, count: usize) -> Pass {
        match self {
            Pass::Train { step } if count > 1 => Pass::TrainMicro { step, index, count },
            Pass::TrainMicro {
                step,
                index: i,
                count: n,
            } => Pass::TrainMicro {
                step,
                index: i * count + index,
                count: n * count,
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_of_micro_batches_number_the_whole_batch() {
        let whole = Pass::Train { step: 3 };
        assert_eq!(whole.micro(0, 1), whole);
        assert_eq!(
            whole.micro(1, 2).micro(2, 4),
            Pass::TrainMicro {
                step: 3,
                index: 6,
                count: 8
            }
        );
        assert_eq!(Pass::Eval.micro(1, 2), Pass::Eval);
    }
}
