//! Generation from a decoder on its layout: prompts of one length decode as one batch through
//! a key/value cache (`Gpt::decode`: the prompt whole, then one token a step; under tensor
//! parallelism each rank keeps its heads' keys and values), each next token the arg-max at
//! temperature 0 (`oxiflow_ops::argmax` where the logits are: only the ids travel), else a
//! draw from the softmax at that temperature over the `top_k` most likely ids and the smallest
//! set of them holding `top_p` of the probability (draws from the seed, the same on every
//! rank); a sequence ends after an end-of-sequence id. After the prompt the
//! cache moves into tensors of the positions the request can reach (`FixedKvCache`), and each
//! token runs as one compiled step (`Gpt::decode_at`, the position a device value: one
//! program, replayed as one device graph on CUDA), its keys and values written into the cache
//! in place; each block's query/key/value projections and gate/up run there each as one
//! product where they fuse (`DecodeWeights`, step inputs the session keeps and each request
//! rewrites in place). Where a sequence outgrows the model's positions, each further token is
//! predicted from the last window of them, computed whole.

use std::collections::BTreeMap;
use std::time::Instant;

use oxiflow_collectives::DType;
use oxiflow_compile::{CompileError, CompiledStep};
use oxiflow_models::nn::gpt::{DecodeWeights, FixedKvCache, Gpt};
use oxiflow_models::nn::{Module, Pass};
use oxiflow_ops::argmax::argmax;
use oxiflow_ops::context_parallel::SeqOrder;
use oxiflow_ops::decode::rows_beside;
use oxiflow_placement::{NamedMesh, Placement};
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::{no_grad, PendingRead, Tensor};

use crate::error::TrainError;
use crate::tasks::eval::rows_on;

/// How each next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0: the arg-max (greedy).
    pub temperature: f64,
    /// Only the `top_k` most likely ids (0: all).
    pub top_k: usize,
    /// Only the smallest set of most likely ids holding this much of the probability (1: all).
    pub top_p: f64,
    pub seed: u64,
}

fn layout_err(detail: String) -> TrainError {
    TrainError::Layout { detail }
}

/// How the decoding steps of a request ran (the prompts' prefill not counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeSteps {
    /// Steps run as a compiled step (its capture included).
    pub compiled: usize,
    /// Of those, replays that launched one device graph.
    pub graph: usize,
    /// Programs compiled for them (one per shape of the batch and cache).
    pub programs: usize,
    /// Steps run eagerly over the cache (a step the compile cannot replay).
    pub eager: usize,
    /// Steps whose sequences outgrew the positions, each computed whole over the last window.
    pub whole: usize,
    /// Steps whose keys and values were written into the cache in place.
    pub in_place: usize,
    /// Time of the steps over the cache in their three parts: running the step (its inputs
    /// made, the program replayed), writing the cache, reading the next ids on the host.
    pub parts: [std::time::Duration; 3],
    /// Time spent once compiling the step and capturing its device graph (the compile's
    /// capture, passes and first replay, and the graph's capture and instantiation).
    pub setup: std::time::Duration,
    /// Time before the steps over the cache: the compute copies of the weights, each batch's
    /// prompts through a new cache (until their first ids are read) and the cache fixed at the
    /// positions they reach.
    pub prefill: std::time::Duration,
}

impl DecodeSteps {
    /// One step over the cache, compiled or (without a compiled step) eager.
    fn count(&mut self, compiled: &Option<CompiledStep>) {
        match compiled {
            Some(_) => self.compiled += 1,
            None => self.eager += 1,
        }
    }
}

/// The compiled decoding step of one model, kept across requests: a later request of the same
/// batch and cache shapes replays the program (and device graph) an earlier one made. None
/// once the compile refused the step (every later step runs eagerly).
pub struct DecodeSession {
    compiled: Option<CompiledStep>,
    /// The model's decoding weights (fused projections), step inputs written again in place
    /// by each request from the parameters' values then.
    weights: Option<DecodeWeights>,
}

impl Default for DecodeSession {
    fn default() -> Self {
        DecodeSession {
            compiled: Some(CompiledStep::new()),
            weights: None,
        }
    }
}

impl DecodeSession {
    /// The one-time cost of the programs so far (compiling, capturing the device graph) and
    /// their replays as one device graph.
    fn spent(&self) -> (std::time::Duration, usize) {
        self.compiled.as_ref().map_or_else(Default::default, |c| {
            c.programs().iter().fold(Default::default(), |(t, g), p| {
                (
                    t + p.report.compile_time + p.graph_built_in().unwrap_or_default(),
                    g + p.replay_counts().graph,
                )
            })
        })
    }
}

/// `prompts` (ids below the model's vocabulary, none empty) each continued by up to `n`
/// tokens, fewer when one of `eos` ends it (that id included), as `sampling` picks them,
/// through `session`'s compiled step (made by the first request that needs it, replayed by
/// the later ones; a fresh session for a one-off request); the steps count only this
/// request's work. `world` holds every rank of the job (where a pipeline's last stage shares
/// the logits). Every rank calls it alike and gets the same ids.
pub fn generate_with(
    session: &mut DecodeSession,
    model: &Gpt,
    world: &Placement,
    prompts: &[Vec<usize>],
    n: usize,
    sampling: &Sampling,
    eos: &[usize],
) -> Result<(Vec<Vec<usize>>, DecodeSteps), TrainError> {
    let _ng = no_grad();
    let mut steps = DecodeSteps::default();
    let started = Instant::now();
    // Every parameter's compute copy made once (kept with it): the decoding step reads them
    // as constants rather than casting every weight at every token.
    for p in model.parameters() {
        p.ensure_compute_copy()?;
    }
    let (spent, graphs) = session.spent();
    let kept = session.weights.take();
    let weights = &*session.weights.insert(model.decode_weights(kept)?);
    steps.prefill += started.elapsed();
    let mut by_len: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, p) in prompts.iter().enumerate() {
        by_len.entry(p.len()).or_default().push(i);
    }
    let decoder = Decoder {
        model,
        weights,
        world,
        n,
        sampling,
        eos,
    };
    let mut out = vec![Vec::new(); prompts.len()];
    for rows in by_len.values() {
        let batch: Vec<Vec<usize>> = rows.iter().map(|&i| prompts[i].clone()).collect();
        let got = decoder.run(&batch, rows, &mut session.compiled, &mut steps)?;
        for (&i, g) in rows.iter().zip(got) {
            out[i] = g;
        }
    }
    let (spent_now, graphs_now) = session.spent();
    steps.setup = spent_now.saturating_sub(spent);
    steps.graph = graphs_now.saturating_sub(graphs);
    steps.programs = session.compiled.as_ref().map_or(0, |c| c.programs().len());
    Ok((out, steps))
}

/// The `b` arg-max ids of a started read, once it is done.
fn picked(pending: PendingRead<i64>, b: usize) -> Result<Vec<usize>, TrainError> {
    let ids = pending.wait()?;
    if ids.len() != b {
        return Err(layout_err(format!("{} picks for {b} sequences", ids.len())));
    }
    Ok(ids.into_iter().map(|i| i as usize).collect())
}

/// What a batch's next ids are picked from: the logits `[B, table_rows]`, or the arg-max ids
/// `[B]` a greedy step over the cache picked where the logits were, with the device ids
/// `[B, 1]` and position `[1]` that feed the step after it (nothing uploaded from the host).
enum Next {
    Logits(Tensor),
    Picks {
        picks: Tensor,
        ids: Tensor,
        pos: Tensor,
    },
}

/// Batches of prompts of one length through `model`, each continued by up to `n` tokens as
/// `sampling` picks them, until one of `eos`.
struct Decoder<'a> {
    model: &'a Gpt,
    weights: &'a DecodeWeights,
    world: &'a Placement,
    n: usize,
    sampling: &'a Sampling,
    eos: &'a [usize],
}

impl Decoder<'_> {
    /// The generated ids of `batch` (prompts `rows` of the whole request, for the draws),
    /// its steps counted into `steps`.
    fn run(
        &self,
        batch: &[Vec<usize>],
        rows: &[usize],
        compiled: &mut Option<CompiledStep>,
        steps: &mut DecodeSteps,
    ) -> Result<Vec<Vec<usize>>, TrainError> {
        let (n, eos) = (self.n, self.eos);
        let positions = self.model.cfg.seq_len;
        let mut seqs: Vec<Vec<usize>> = batch.to_vec();
        let mut done = vec![false; batch.len()];
        let prompt = seqs.first().map_or(0, Vec::len);
        let mut logits = None;
        let mut fixed = None;
        if prompt <= positions {
            let started = Instant::now();
            let mut cache = self.model.new_cache();
            // On a context-parallel axis the prompt is padded to whole load-balanced chunks.
            let padded = match self.model.layout.seq_order() {
                SeqOrder::Natural => prompt,
                SeqOrder::Balanced { ranks } => prompt
                    .next_multiple_of(2 * ranks)
                    .min(positions)
                    .max(prompt),
            };
            let padding = |s: &Vec<usize>| {
                let mut s = s.clone();
                s.resize(padded, 0);
                s
            };
            let ids = self.ids(&seqs.iter().map(padding).collect::<Vec<_>>(), 0)?;
            logits = Some(self.model.decode_prompt(&ids, prompt, &mut cache)?);
            let reach = (prompt + n).min(positions);
            if n > 1 && reach > prompt {
                fixed = Some(self.model.fix_cache(&cache, reach)?);
            }
            steps.prefill += started.elapsed();
        }
        let greedy = self.sampling.temperature <= 0.0;
        let mut next = logits.map(Next::Logits);
        let room = |c: &FixedKvCache| c.len() < c.positions();
        for step in 0..n {
            let read = Instant::now();
            // A step over the cache launched before this one's ids reach the host.
            let mut ahead = None;
            let picks = match next.take() {
                Some(Next::Logits(l)) => {
                    let ids = self.next_ids(&l, rows, step)?;
                    if step == 0 {
                        // The prompts' logits: the prefill's device work is done by now.
                        steps.prefill += read.elapsed();
                    }
                    ids
                }
                Some(Next::Picks { picks, ids, pos }) => {
                    // The read waits for this step alone, so the next step (fed on the
                    // device) runs while the host waits; it is wasted only when every
                    // sequence ends here.
                    let pending = self.start_picks(&picks)?;
                    if let Some(cache) = fixed.as_mut().filter(|c| step + 1 < n && room(c)) {
                        ahead = Some(self.step_at(ids, pos, cache, compiled, greedy, steps)?);
                        steps.count(compiled);
                    }
                    let read = Instant::now();
                    let got = picked(pending, rows.len())?;
                    steps.parts[2] += read.elapsed();
                    got
                }
                None => {
                    if step > 0 {
                        steps.whole += 1;
                    }
                    self.next_ids(&self.window(&seqs, positions)?, rows, step)?
                }
            };
            for ((seq, next), d) in seqs.iter_mut().zip(picks).zip(done.iter_mut()) {
                if !*d {
                    *d = eos.contains(&next);
                }
                seq.push(next);
            }
            if done.iter().all(|&d| d) || step + 1 == n {
                break;
            }
            next = match (ahead, fixed.as_mut().filter(|c| room(c))) {
                (Some(launched), _) => Some(launched),
                (None, Some(cache)) => {
                    let (ids, pos) = self.feed(&seqs, cache.len())?;
                    let launched = self.step_at(ids, pos, cache, compiled, greedy, steps)?;
                    steps.count(compiled);
                    Some(launched)
                }
                (None, None) => None,
            };
        }
        // Each sequence's ids after its prompt, up to and with its first end-of-sequence id.
        let ids = seqs
            .into_iter()
            .zip(batch)
            .map(|(s, p)| {
                let mut g = s[p.len()..].to_vec();
                if let Some(e) = g.iter().position(|id| eos.contains(id)) {
                    g.truncate(e + 1);
                }
                g
            })
            .collect();
        Ok(ids)
    }

    /// The next-token logits `[B, table_rows]` of every sequence (on the last stage) from its
    /// last `positions` tokens, computed whole.
    fn window(&self, seqs: &[Vec<usize>], positions: usize) -> Result<Tensor, TrainError> {
        let len = seqs.first().map_or(0, Vec::len);
        let window = self.ids(seqs, len.saturating_sub(positions))?;
        let all = self.model.forward(&window, Pass::Eval)?;
        let (b, t, rows) = (all.shape().dim(0), all.shape().dim(1), all.shape().dim(2));
        // The row of the last token in the sequence's order (load-balanced under --cp).
        let last = self.model.layout.seq_order().indices(t)[t - 1];
        Ok(all.narrow(1, last, 1)?.reshape([b, rows])?)
    }

    /// Every sequence's last token and its position, from the host: ids `[B, 1]` on the first
    /// stage and the position `[1]` broadcast there.
    fn feed(&self, seqs: &[Vec<usize>], pos: usize) -> Result<(Tensor, Tensor), TrainError> {
        let len = seqs.first().map_or(0, Vec::len);
        let p = self.first_mesh()?.placement();
        let pos =
            Tensor::from_vec(vec![pos as i64], [1])?.to_global(p, NdSbp::broadcast(p.ndim()))?;
        Ok((self.ids(seqs, len - 1)?, pos))
    }

    /// The mesh of the first stage.
    fn first_mesh(&self) -> Result<&NamedMesh, TrainError> {
        self.model
            .split
            .first()
            .mesh()
            .ok_or_else(|| layout_err("the decoder is not global".into()))
    }

    /// The tokens `ids` `[B, 1]` at the device position `pos` (the cache's next) through
    /// `cache` as one compiled step (`compiled`, captured on the first call, replayed after;
    /// None: eagerly): where `greedy` the arg-max ids and what feeds the step after, else the
    /// logits; the step's keys and values are then written into the cache (queued behind
    /// the step on a device: nothing here waits for it).
    fn step_at(
        &self,
        ids: Tensor,
        pos: Tensor,
        cache: &mut FixedKvCache,
        compiled: &mut Option<CompiledStep>,
        greedy: bool,
        steps: &mut DecodeSteps,
    ) -> Result<Next, TrainError> {
        let started = Instant::now();
        let mut inputs = vec![ids, pos];
        inputs.extend(cache.kv.iter().flat_map(|(k, v)| [k.clone(), v.clone()]));
        inputs.extend(self.weights.tensors());
        let eager = || self.decode_step(&inputs, greedy);
        let outs = match compiled.as_mut() {
            Some(c) => match c.run(&inputs, eager) {
                Ok((outs, _)) => outs,
                // A step the compile cannot replay (it reads routing on the host, say) runs
                // eagerly from now on; every rank refuses alike.
                Err(TrainError::Compile(
                    e @ (CompileError::HostRead { .. }
                    | CompileError::HostData { .. }
                    | CompileError::Unreplayable { .. }),
                )) => {
                    tracing::info!("generation: decoding steps run eagerly ({e})");
                    *compiled = None;
                    eager()?
                }
                Err(e) => return Err(e),
            },
            None => eager()?,
        };
        // The cache's tensors are held by the cache alone again: written in place.
        drop(inputs);
        let mut outs = outs.into_iter();
        let mut take = || {
            outs.next()
                .ok_or_else(|| layout_err("the decoding step gave too few outputs".into()))
        };
        let next = if greedy {
            Next::Picks {
                picks: take()?,
                ids: take()?,
                pos: take()?,
            }
        } else {
            Next::Logits(take()?)
        };
        let mut rows = Vec::with_capacity(cache.kv.len());
        for _ in 0..cache.kv.len() {
            rows.push((take()?, take()?));
        }
        let pushed = Instant::now();
        steps.parts[0] += pushed - started;
        steps.in_place += usize::from(cache.push(&rows)?);
        steps.parts[1] += pushed.elapsed();
        Ok(next)
    }

    /// The next id of every sequence (the same on every rank): at temperature 0 the arg-max
    /// over the vocabulary picked where the logits are (only the ids travel), else drawn on the
    /// host from the logits (see [`pick`]); `rows` are the sequences' places in the request.
    fn next_ids(
        &self,
        logits: &Tensor,
        rows: &[usize],
        step: usize,
    ) -> Result<Vec<usize>, TrainError> {
        let (b, vocab, sampling) = (rows.len(), self.model.cfg.vocab, self.sampling);
        if sampling.temperature <= 0.0 {
            return self.read_picks(&argmax(&logits.narrow(1, 0, vocab)?)?, b);
        }
        Ok(self
            .read(logits, b)?
            .iter()
            .zip(rows)
            .map(|(l, &r)| pick(l, sampling, (r as u64) << 32 | step as u64))
            .collect())
    }

    /// One decoding step on `inputs` (ids, position, each block's cached keys and values,
    /// then the decoding weights' tensors): where `greedy` the arg-max ids `[B]`, the same ids
    /// as the next step's input and the next position, else the logits; then each block's new
    /// key and value, laid out as its cache.
    fn decode_step(&self, inputs: &[Tensor], greedy: bool) -> Result<Vec<Tensor>, TrainError> {
        let caches = 2 + 2 * self.model.blocks.len();
        if inputs.len() < caches {
            return Err(layout_err(format!(
                "a decoding step of {} inputs for {} blocks",
                inputs.len(),
                self.model.blocks.len()
            )));
        }
        let (head, rest) = inputs.split_at(caches);
        let kv: Vec<(Tensor, Tensor)> = head[2..]
            .chunks_exact(2)
            .map(|c| (c[0].clone(), c[1].clone()))
            .collect();
        let weights = self.weights.with_tensors(rest)?;
        let (ids, pos) = (&inputs[0], &inputs[1]);
        let (logits, rows) = self.model.decode_at(ids, pos, &kv, &weights)?;
        let mut outs = if greedy {
            let picks = argmax(&logits.narrow(1, 0, self.model.cfg.vocab)?)?;
            let b = picks.shape().dim(0);
            let next_ids = picks.reshape([b, 1])?.to_layout_of(ids)?;
            vec![picks, next_ids, pos.add_scalar(1.0)?]
        } else {
            vec![logits]
        };
        for ((k, v), (ck, cv)) in rows.into_iter().zip(&kv) {
            outs.push(rows_beside(&k, ck, 1)?);
            outs.push(rows_beside(&v, cv, 1)?);
        }
        Ok(outs)
    }

    /// The arg-max ids `[B]` (on the last stage) on the host of every rank.
    fn read_picks(&self, picks: &Tensor, b: usize) -> Result<Vec<usize>, TrainError> {
        picked(self.start_picks(picks)?, b)
    }

    /// Starts reading the arg-max ids `[B]` (on the last stage) to the host of every rank,
    /// behind the work queued so far (see [`picked`]).
    fn start_picks(&self, picks: &Tensor) -> Result<PendingRead<i64>, TrainError> {
        Ok(self.everywhere(picks)?.start_read::<i64>()?)
    }

    /// Every sequence's ids from `from` on, as global `[B, len - from]` ids on the first stage,
    /// split over the data-parallel axis.
    fn ids(&self, seqs: &[Vec<usize>], from: usize) -> Result<Tensor, TrainError> {
        let first = self.first_mesh()?;
        let t = seqs.first().map_or(0, Vec::len) - from;
        let v: Vec<i64> = seqs
            .iter()
            .flat_map(|s| s[from..].iter().map(|&id| id as i64))
            .collect();
        rows_on(first, seqs.len(), t, v)
    }

    /// `t` (on the last stage) whole on every rank.
    fn everywhere(&self, t: &Tensor) -> Result<Tensor, TrainError> {
        Ok(match (self.model.split.stages(), t.placement()) {
            (1, Some(p)) => t.to_global(p, NdSbp::broadcast(p.ndim()))?,
            _ => t.to_global(self.world, NdSbp::broadcast(1))?,
        })
    }

    /// Logits `[B, table_rows]` (on the last stage) on every rank, each row cut to the
    /// vocabulary.
    fn read(&self, logits: &Tensor, b: usize) -> Result<Vec<Vec<f64>>, TrainError> {
        let v = self
            .everywhere(&logits.cast(DType::F64)?)?
            .to_vec::<f64>()?;
        let (vocab, rows) = (self.model.cfg.vocab, self.model.cfg.table_rows());
        if v.len() != b * rows {
            return Err(layout_err(format!(
                "{} logits for {b} sequences and a token table of {rows} rows",
                v.len()
            )));
        }
        Ok(v.chunks_exact(rows).map(|r| r[..vocab].to_vec()).collect())
    }
}

/// The next id from `logits`: the arg-max at temperature 0, else a draw (keyed by `draw`)
/// from the softmax at the temperature over the `top_k` most likely ids and, of those, the
/// smallest set holding `top_p` of the probability.
fn pick(logits: &[f64], s: &Sampling, draw: u64) -> usize {
    let best =
        logits.iter().enumerate().fold(
            (0, f64::NEG_INFINITY),
            |a, (i, &v)| if v > a.1 { (i, v) } else { a },
        );
    if s.temperature <= 0.0 {
        return best.0;
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if s.top_k > 0 {
        order.truncate(s.top_k);
    }
    let w: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] - best.1) / s.temperature).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = w.len();
    if s.top_p < 1.0 {
        let mut mass = 0.0;
        for (k, x) in w.iter().enumerate() {
            mass += x / total;
            if mass >= s.top_p {
                keep = k + 1;
                break;
            }
        }
    }
    let kept: f64 = w[..keep].iter().sum();
    let mut u = oxiflow_tensor::rng::uniform(s.seed, draw) * kept;
    for (k, x) in w[..keep].iter().enumerate() {
        if u < *x {
            return order[k];
        }
        u -= x;
    }
    order[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(temperature: f64, top_k: usize, top_p: f64) -> Sampling {
        Sampling {
            temperature,
            top_k,
            top_p,
            seed: 9,
        }
    }

    #[test]
    fn greedy_takes_the_first_largest_and_filters_keep_only_the_likeliest() {
        let logits = [0.5, 2.0, 2.0, -1.0, 1.0];
        assert_eq!(pick(&logits, &s(0.0, 0, 1.0), 0), 1);
        // top-k 1 and a tiny top-p leave the arg-max alone at any temperature.
        for d in 0..50 {
            assert_eq!(pick(&logits, &s(1.0, 1, 1.0), d), 1);
            assert_eq!(pick(&logits, &s(1.0, 0, 1e-9), d), 1);
        }
        // top-k 3 never draws the two least likely; every draw of the three appears.
        let drawn: std::collections::BTreeSet<usize> = (0..400)
            .map(|d| pick(&logits, &s(1.0, 3, 1.0), d))
            .collect();
        assert_eq!(drawn, [1, 2, 4].into_iter().collect());
        // top-p 0.6 keeps the two tied ids (together about 0.63 of the mass).
        let drawn: std::collections::BTreeSet<usize> = (0..400)
            .map(|d| pick(&logits, &s(1.0, 0, 0.6), d))
            .collect();
        assert_eq!(drawn, [1, 2].into_iter().collect());
    }
}
